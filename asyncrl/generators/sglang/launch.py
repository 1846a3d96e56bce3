"""Starting and stopping the SGLang servers of the `sglang` generator (`generators.options.launch`).

Place in the data flow: the generator's `setup` calls `launch_servers` (one process per GPU, each
on a free loopback port, output to `<run>/logs/sglang-<generator>-<i>.log`) and hands the URLs to
its `Fleet`; before its first request it awaits `wait_ready` (every server answers
`GET /health_generate` with 200, or an error shows the exit code and the tail of the server's
log); its `close` calls `stop_servers`. Nothing here speaks the generation protocol.

Processes: each server is the leader of its own session (`start_new_session`), so a Ctrl-C in the
terminal reaches only the launcher, which stops the run in order (Shutdown -> the generator's
`close` -> `stop_servers`), and stopping signals the server's own process group (a real server
forks scheduler and detokenizer processes). `stop_servers` sends SIGTERM, waits, then SIGKILL,
and only ever signals processes it started, by pid (the group id is the pid of the leader, and it
is signalled only while that leader is unreaped, so the id cannot have been reused). On Linux the
kernel also kills a server when the generator process dies without stopping it (SIGKILLed, say):
PR_SET_PDEATHSIG, which follows the thread that started the server, so launch from a thread that
lives as long as the servers should (the generator process's main thread). An interpreter that
exits normally stops whatever is still running (atexit).
"""

from __future__ import annotations

import atexit
import ctypes
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from asyncrl.generators.sglang.client import ServerUnavailable, http_call

log = logging.getLogger(__name__)

HOST = "127.0.0.1"
STOP_GRACE_S = 10.0  # SIGTERM -> SIGKILL; inside the launcher's own grace for the generator
POLL_S = 0.5  # readiness and exit polling while servers start (there is no message to wait for)
EXIT_POLL_S = 0.05
HEALTH_TIMEOUT_S = 30.0  # one /health_generate runs a 1-token generation (SGLang's own limit is 20 s)
LOG_TAIL_LINES = 30
_PR_SET_PDEATHSIG = 1


class ServerLaunchError(RuntimeError):
    """A launched server exited or did not become healthy; the message carries its log's tail."""


@dataclass(frozen=True, kw_only=True)
class LaunchSpec:
    """What to start: `command` (argv prefix) + the per-server flags, `num_servers` times."""

    command: tuple[str, ...]
    model_path: str
    num_servers: int
    log_dir: Path
    name: str = "sglang"  # log file prefix (the generator id)
    gpus: tuple[str, ...] | None = None  # CUDA_VISIBLE_DEVICES per server; None = automatic
    extra_args: tuple[str, ...] = ()
    mem_fraction_static: float | None = None
    host: str = HOST  # --host: cluster.bind_host (loopback by default)
    advertise_host: str = ""  # the host in the servers' URLs; "" = host
    # --api-key (generators.options.api_key_env); never in repr (logs), and on the server's command
    # line, which other local users can read (docs/multi-host.md, "Security").
    api_key: str = field(default="", repr=False)


@dataclass(eq=False)
class ServerProcess:
    index: int
    url: str
    gpu: str
    log_path: Path
    proc: subprocess.Popen
    api_key: str = field(default="", repr=False)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def tail(self, lines: int = LOG_TAIL_LINES) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError as exc:
            return f"(log unreadable: {exc})"
        return "\n".join(text.splitlines()[-lines:]) or "(the log is empty)"


_running: set[ServerProcess] = set()  # stopped at interpreter exit if nobody stopped them
# One stop at a time: a pid is signalled only while unreaped, and a concurrent stop could reap it.
_stop_lock = threading.Lock()


def resolve_command(command: Sequence[str]) -> list[str]:
    """A leading `python` means this interpreter (the generator's venv), not whatever PATH finds."""
    argv = list(command)
    if argv and argv[0] in ("python", "python3"):
        argv[0] = sys.executable
    return argv


def server_argv(spec: LaunchSpec, port: int) -> list[str]:
    """The command line of one server (pure)."""
    argv = [
        *resolve_command(spec.command),
        "--model-path",
        spec.model_path,
        "--host",
        spec.host,
        "--port",
        str(port),
        "--weight-version",
        "0",  # integer labels: a token's policy_version is its label
    ]
    if spec.api_key:
        argv += ["--api-key", spec.api_key]
    if spec.mem_fraction_static is not None:
        argv += ["--mem-fraction-static", str(spec.mem_fraction_static)]
    return argv + list(spec.extra_args)


def assign_gpus(num_servers: int, gpus: Sequence[str] | None, visible: str | None) -> list[str]:
    """One CUDA device per server: `gpus` if given, else the first N of this process's
    CUDA_VISIBLE_DEVICES (`visible`), else 0..N-1 (pure)."""
    if gpus is not None:
        chosen = list(gpus)
    elif visible:
        chosen = [g.strip() for g in visible.split(",") if g.strip()][:num_servers]
        if len(chosen) < num_servers:
            raise ValueError(
                f"generators.options.launch = {num_servers} servers but CUDA_VISIBLE_DEVICES={visible!r} "
                "shows fewer devices; set generators.options.gpus"
            )
    else:
        chosen = [str(i) for i in range(num_servers)]
    if len(chosen) != num_servers:
        raise ValueError(f"{len(chosen)} GPUs for {num_servers} servers")
    return chosen


def free_ports(n: int, host: str = HOST) -> list[int]:
    """`n` distinct ports free on `host` right now (all held at once, so they differ). Not a
    listener: the static guard in test_fuzz lists this file (the servers check an API key)."""
    socks = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(n)]
    try:
        for s in socks:
            s.bind((host, 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _die_with_parent_hook():
    """A preexec function that makes the kernel SIGKILL the child when this thread's process dies
    (Linux), or None elsewhere. libc is resolved here, before the fork."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def hook() -> None:
        prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL))
        if os.getppid() != parent:  # the parent died between fork and prctl
            os._exit(1)

    return hook


def launch_servers(spec: LaunchSpec) -> list[ServerProcess]:
    """Start `spec.num_servers` servers (not waiting for them); see the module docstring."""
    gpus = assign_gpus(spec.num_servers, spec.gpus, os.environ.get("CUDA_VISIBLE_DEVICES"))
    spec.log_dir.mkdir(parents=True, exist_ok=True)
    ports = free_ports(spec.num_servers, spec.host)
    hook = _die_with_parent_hook()
    atexit.unregister(_stop_leftovers)  # registered once, on first use (nothing happens at import)
    atexit.register(_stop_leftovers)
    started: list[ServerProcess] = []
    try:
        for i, (port, gpu) in enumerate(zip(ports, gpus, strict=True)):
            log_path = spec.log_dir / f"{spec.name}-{i}.log"
            argv = server_argv(spec, port)
            env = {**os.environ, "CUDA_VISIBLE_DEVICES": gpu}
            with open(log_path, "ab") as out:
                shown = ["***" if spec.api_key and a == spec.api_key else a for a in argv]  # not in the log
                out.write(f"# {' '.join(shown)}  (CUDA_VISIBLE_DEVICES={gpu})\n".encode())
                out.flush()
                proc = subprocess.Popen(
                    argv,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    env=env,
                    start_new_session=True,
                    preexec_fn=hook,  # noqa: PLW1509 (prctl only; libc resolved before the fork)
                )
            server = ServerProcess(
                index=i,
                url=f"http://{spec.advertise_host or spec.host}:{port}",
                gpu=gpu,
                log_path=log_path,
                proc=proc,
                api_key=spec.api_key,
            )
            started.append(server)
            _running.add(server)
            log.info("started SGLang server %d (pid %d) on %s, log %s", i, proc.pid, server.url, log_path)
    except OSError as exc:
        stop_servers(started)
        raise ServerLaunchError(
            f"could not start {' '.join(spec.command)!r} (generators.options.launch_command): {exc}"
        ) from None
    return started


def write_record(servers: Sequence[ServerProcess], path: Path) -> None:
    """Which servers this generator started (url, pid, GPU, log), for operators and tests."""
    rows = [
        {"index": s.index, "url": s.url, "pid": s.pid, "gpu": s.gpu, "log": str(s.log_path)} for s in servers
    ]
    path.write_text(json.dumps(rows, indent=2) + "\n")


def _exit_report(server: ServerProcess, code: int) -> str:
    return (
        f"SGLang server {server.index} ({server.url}, pid {server.pid}) exited with code {code} while "
        f"starting; last lines of {server.log_path}:\n{server.tail()}"
    )


def wait_ready(servers: Sequence[ServerProcess], timeout_s: float) -> None:
    """Blocking: until every server answers GET /health_generate with 200. ServerLaunchError if
    one exits first or the deadline passes (the servers are left running: the caller stops them)."""
    deadline = time.monotonic() + timeout_s
    pending = list(servers)
    last: dict[int, str] = {}
    while pending:
        for server in list(pending):
            code = exit_code_unreaped(server.pid)
            if code is not None:
                raise ServerLaunchError(_exit_report(server, code))
            try:
                status, _ = http_call(
                    server.url,
                    "GET",
                    "/health_generate",
                    None,
                    timeout_s=HEALTH_TIMEOUT_S,
                    api_key=server.api_key,
                )
            except ServerUnavailable as exc:
                last[server.index] = str(exc)
                continue
            if status == 200:
                pending.remove(server)
                log.info("SGLang server %d on %s is ready", server.index, server.url)
            else:
                last[server.index] = f"HTTP {status}"
        if not pending:
            return
        if time.monotonic() > deadline:
            server = pending[0]
            raise ServerLaunchError(
                f"SGLang server {server.index} ({server.url}, pid {server.pid}) did not answer "
                f"/health_generate with 200 within {timeout_s:g} s (generators.options.startup_timeout_s; "
                f"last: {last.get(server.index, 'no answer')}); last lines of {server.log_path}:\n"
                f"{server.tail()}"
            )
        time.sleep(POLL_S)  # poll interval while servers load; the deadline above bounds it


def exit_code_unreaped(pid: int) -> int | None:
    """The exit code of our child `pid` (negative: killed by that signal), or None while it runs.
    It is not reaped, so its pid (and process group id) stays reserved for us until `stop_servers`."""
    try:
        info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:  # reaped already
        return 0
    if info is None:
        return None
    return info.si_status if info.si_code == os.CLD_EXITED else -info.si_status


def _exited_unreaped(pid: int) -> bool:
    return exit_code_unreaped(pid) is not None


def _signal_group(server: ServerProcess, sig: signal.Signals) -> None:
    """`sig` to the server's process group (its id is the server's pid, still unreaped)."""
    try:
        os.killpg(server.pid, sig)
    except ProcessLookupError:
        pass


def stop_servers(servers: Sequence[ServerProcess], grace_s: float = STOP_GRACE_S) -> None:
    """SIGTERM every server's process group, wait up to `grace_s`, SIGKILL what is left, reap.
    Idempotent; blocking (call it off the event loop)."""
    with _stop_lock:
        _stop(servers, grace_s)


def _stop(servers: Sequence[ServerProcess], grace_s: float) -> None:
    live = [s for s in servers if s.proc.returncode is None]
    for server in live:
        if not _exited_unreaped(server.pid):
            _signal_group(server, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for server in live:
        while not _exited_unreaped(server.pid) and time.monotonic() < deadline:
            time.sleep(EXIT_POLL_S)  # waiting for an exit status; there is no message to wait for
        # The leader exited (a zombie, its pid still ours) or ran out of time: SIGKILL whatever of
        # its group is left (a real server's scheduler and detokenizer), then reap the leader.
        _signal_group(server, signal.SIGKILL)
        server.proc.wait()
        _running.discard(server)
        log.info(
            "SGLang server %d (pid %d) stopped, exit code %s",
            server.index,
            server.pid,
            server.proc.returncode,
        )
    for server in servers:
        _running.discard(server)


def _stop_leftovers() -> None:
    if _running:
        stop_servers(list(_running), grace_s=2.0)
