"""The spawner seam: start a worker, and learn when it is gone.

Place in the data flow: the launcher (`scheduler/service.py`) starts the learner and every
generator through a `Spawner` and keeps the `WorkerHandle` it gets back. Supervision
(`scheduler/children.py`) asks the handle whether the worker has exited and stops it through the
handle (`terminate`, then `kill`); it never touches a process object. Whether a live worker is
still working is judged from the control channel (its Hello, Heartbeats and other messages), not
from the handle, so a worker that joins over the network needs only another spawner.

`LocalSpawner` runs `python -m <module>` with the child arguments of `asyncrl.runtime` as a
child process of the launcher, its output in `<run>/logs/<peer>.log`. Only processes it started
are ever signalled, and only by pid.

`ForkSpawner` starts the same workers, as the same `python -m` would, by forking them from a
warm fork server (the standard library's multiprocessing forkserver) that imported torch,
transformers and the worker modules once, while the launcher was still checking the config and
the task (`prewarm`). A worker then starts with its imports done: about 2 s of CPU per process
saved at start-up, and a restarted generator is back in a fraction of that. The server imports
nothing that starts a thread or touches a GPU, so forking from it is safe; each worker still
creates its own sockets, thread pools and devices after the fork. `asyncrl launch` uses it
(`run.spawn = "fork"`, the default; "exec" gives `LocalSpawner`).
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import types
from pathlib import Path
from typing import Protocol

import msgspec

from asyncrl.messages import WorkerArgs
from asyncrl.runtime import JOIN_FILE, JoinInfo, worker_argv

# How often `wait` looks for the exit status of a process that was killed or exited.
REAP_POLL_S = 0.05


class WorkerHandle(Protocol):
    """One started worker, as its spawner sees it."""

    @property
    def pid(self) -> int:
        """The worker's process id (named in records and messages)."""

    @property
    def log_path(self) -> Path:
        """Where the worker's output goes (named in failure messages)."""

    def exit_code(self) -> int | None:
        """None while the worker runs; its exit status once it has gone."""

    def terminate(self) -> None:
        """Ask it to stop now (SIGTERM for a local process)."""

    def kill(self) -> None:
        """Stop it, no questions asked (SIGKILL for a local process)."""

    async def wait(self) -> int:
        """Until it has gone (after `kill`, promptly); its exit status."""


class Spawner(Protocol):
    def start(self, peer_id: str, module: str, *, ctrl_address: str, args: WorkerArgs) -> WorkerHandle:
        """Start `module` as the worker `peer_id`, connecting to the launcher at `ctrl_address`,
        with the process arguments `args`."""


class LocalProcess:
    """A `WorkerHandle` for a child process of this launcher."""

    def __init__(self, proc: subprocess.Popen, log_path: Path) -> None:
        self._proc = proc
        self._log_path = log_path

    @property
    def pid(self) -> int:
        return self._proc.pid

    @property
    def log_path(self) -> Path:
        return self._log_path

    def exit_code(self) -> int | None:
        return self._proc.poll()

    def terminate(self) -> None:
        if self.exit_code() is None:
            os.kill(self.pid, signal.SIGTERM)

    def kill(self) -> None:
        if self.exit_code() is None:
            os.kill(self.pid, signal.SIGKILL)  # to this pid only

    async def wait(self) -> int:
        while (code := self.exit_code()) is None:
            await asyncio.sleep(REAP_POLL_S)  # waiting for an exit code; there is no message to wait for
        return code


class LocalSpawner:
    """Workers as child processes of the launcher, with the run's log directory.

    `die_with_parent`: each worker gets SIGKILL the moment this process dies (Linux's parent-death
    signal; elsewhere it notices within `runtime.PARENT_POLL_S`). `asyncrl worker` uses it: a worker
    killed on its host must take its generators with it at once, not after they have served on."""

    def __init__(self, run_dir: Path, *, die_with_parent: bool = False) -> None:
        self.run_dir = Path(run_dir)
        self.die_with_parent = die_with_parent

    def log_path(self, peer_id: str) -> Path:
        logs = self.run_dir / "logs"
        logs.mkdir(exist_ok=True)
        return logs / f"{peer_id}.log"

    def worker_argv(self, peer_id: str, ctrl_address: str, args: WorkerArgs) -> list[str]:
        """The child arguments of `asyncrl.runtime.child_args`."""
        return worker_argv(ctrl_address=ctrl_address, peer_id=peer_id, run_dir=self.run_dir, args=args)

    def start(self, peer_id: str, module: str, *, ctrl_address: str, args: WorkerArgs) -> LocalProcess:
        log_path = self.log_path(peer_id)
        cmd = [sys.executable, "-m", module, *self.worker_argv(peer_id, ctrl_address, args)]
        preexec = _die_with_parent if self.die_with_parent and sys.platform == "linux" else None
        with open(log_path, "ab") as out:
            proc = subprocess.Popen(
                cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, preexec_fn=preexec
            )
        return LocalProcess(proc, log_path)


def _die_with_parent() -> None:
    """In the child, before exec: SIGKILL when the parent dies (prctl PR_SET_PDEATHSIG)."""
    import ctypes

    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


class JoinedProcess:
    """A `WorkerHandle` for a worker this launcher did not start (torchrun's learner ranks): it
    joins by reading the join file and saying Hello. The launcher never signals it; it is told
    to stop over the control channel, and counts as gone once the launcher stops waiting."""

    def __init__(self, log_path: Path) -> None:
        self._log_path = log_path
        self._gone = False

    @property
    def pid(self) -> int:
        return 0  # not ours to signal; its Hello names its pid

    @property
    def log_path(self) -> Path:
        return self._log_path

    def exit_code(self) -> int | None:
        return 0 if self._gone else None

    def terminate(self) -> None:
        self._gone = True

    def kill(self) -> None:
        self._gone = True

    async def wait(self) -> int:
        self._gone = True
        return 0


class JoinSpawner:
    """Starts nothing for the roles in `joined` (e.g. the learner under torchrun): writes what a
    joining worker needs, `<run>/learner_join.json` (the launcher's control address, its peer id
    and its `WorkerArgs`), and hands back a `JoinedProcess`. Other roles go to `inner`."""

    def __init__(self, inner: Spawner, run_dir: Path, joined: frozenset[str]) -> None:
        self.inner = inner
        self.run_dir = Path(run_dir)
        self.joined = joined

    def start(self, peer_id: str, module: str, *, ctrl_address: str, args: WorkerArgs):
        if peer_id not in self.joined:
            return self.inner.start(peer_id, module, ctrl_address=ctrl_address, args=args)
        info = JoinInfo(ctrl=ctrl_address, peer_id=peer_id, args=args)
        tmp = self.run_dir / f".{JOIN_FILE}.tmp"
        tmp.write_bytes(msgspec.json.format(msgspec.json.encode(info), indent=2) + b"\n")
        tmp.replace(self.run_dir / JOIN_FILE)  # atomic: a joiner never reads half of it
        return JoinedProcess(self.run_dir / "logs" / f"{peer_id}.log")


_prewarmed = False


def is_prewarmed() -> bool:
    """Whether this process started its fork server (`prewarm`)."""
    return _prewarmed


def prewarm() -> None:
    """Start the fork server now (it imports `asyncrl.scheduler.warm` in its own process, in
    parallel with the caller), so that `ForkSpawner` workers start with their imports done.
    Idempotent.

    The server keeps the descriptors it starts with for as long as it lives, a little past this
    process's exit (it tears torch down): it gets /dev/null for stdout and stderr, so that a
    caller reading this process's output to its end (a pipe) is not held up by it. Workers write
    to their own logs (`_run_module`)."""
    global _prewarmed
    if _prewarmed:
        return
    from multiprocessing import forkserver

    forkserver.set_forkserver_preload(["asyncrl.scheduler.warm"])
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, 1)
        os.dup2(null, 2)
        forkserver.ensure_running()
    finally:
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in (*saved, null):
            os.close(fd)
    _prewarmed = True


def _run_module(module: str, argv: list[str], log_path: str) -> None:
    """In the forked worker: output to `log_path`, then `module` as `python -m module argv` runs it."""
    import runpy
    import warnings
    from multiprocessing import forkserver

    # The fork server hands every child its client's end of the pipe by which the server knows
    # the launcher is alive (so that a child could fork through the server too). A worker must not
    # hold it: when the launcher dies, the server must see that end close and exit, so that the
    # worker, now without a parent, stops too (`runtime._watch_parent`).
    alive = getattr(getattr(forkserver, "_forkserver", None), "_forkserver_alive_fd", None)
    if alive is not None:
        os.close(alive)
        forkserver._forkserver._forkserver_alive_fd = None

    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.argv = [module, *argv]
    # The fork server imported `module` already (`warm.PRELOAD`); running it again as __main__ is what
    # `python -m` does, with that copy unused. runpy warns about the pair; it is intended here.
    warnings.filterwarnings(
        "ignore", message=".*found in sys.modules after import of package", category=RuntimeWarning
    )
    runpy.run_module(module, run_name="__main__", alter_sys=True)


class ForkedProcess(LocalProcess):
    """A `WorkerHandle` for a worker forked by the fork server (`ForkSpawner`); `proc` is its
    `multiprocessing.Process`, whose exit code the server reports."""

    def exit_code(self) -> int | None:
        return self._proc.exitcode  # like Popen's: -N for a signal


class ForkSpawner(LocalSpawner):
    """`LocalSpawner`'s workers, forked from the warm fork server (`prewarm`, called here if the
    caller has not)."""

    def start(self, peer_id: str, module: str, *, ctrl_address: str, args: WorkerArgs) -> ForkedProcess:
        import multiprocessing

        prewarm()
        log_path = self.log_path(peer_id)
        argv = self.worker_argv(peer_id, ctrl_address, args)
        proc = multiprocessing.get_context("forkserver").Process(
            target=_run_module, args=(module, argv, str(log_path)), name=peer_id
        )
        # multiprocessing re-runs the parent's main script in the child (as __mp_main__) unless
        # it is a package's __main__; a worker runs its own module, never the caller's script
        # (a user's script that calls run_job unguarded would otherwise run again in each worker).
        main = sys.modules["__main__"]
        sys.modules["__main__"] = types.ModuleType("__main__")
        try:
            proc.start()
        finally:
            sys.modules["__main__"] = main
        return ForkedProcess(proc, log_path)
