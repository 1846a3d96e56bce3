"""`asyncrl worker --join tcp://HOST:PORT`: serve generator slots of a run launched on another host.

Place in the data flow (docs/multi-host.md): the launcher on node A waits for `generators.remote`
slots to be served (`scheduler/remote.py`). This process, on node B, connects a DEALER to the
launcher's control address and sends `Join(count)`. The `Welcome` it gets back carries everything
it needs: the resolved config, the slots it serves (peer ids and their `WorkerArgs`) and,
with generators.remote_weights = "network", the address of the launcher's file socket and the
initial model's files with their checksums. Nothing here reads the launcher's run directory.

It makes a scratch directory of its own (under /dev/shm where there is one) as the local run
directory of its generators: `config.json` (the launcher's, with this host's `--set` overrides:
generators.* options and cluster.keys_dir), `model/` (fetched and checked), `weights/` (each
version, fetched by the generator that loads it, `transport/serve.py`) and `logs/`. It then starts
one generator process per slot (`python -m asyncrl.generators.service`, as the launcher would on
its own host); each connects to the launcher under its slot's peer id and is supervised there by
heartbeat like a local generator. This process watches its generators and the launcher: when
every generator has exited (the run ended, or the launcher gave up on them) it exits; when the
launcher's connection has been gone for LAUNCHER_GONE_S it stops its generators (a launcher that
died sends no Shutdown). SIGTERM or Ctrl-C stops the generators and exits. If this process is
killed, its generators notice that their parent is gone and exit (`runtime._watch_parent`); the
launcher re-queues their tasks and waits for another worker to join.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Awaitable
from pathlib import Path
from urllib.parse import urlparse

import msgspec
import zmq

from asyncrl.config_load import config_from_tree, write_resolved_config
from asyncrl.config_sections import ClusterConfig, ConfigError
from asyncrl.messages import FileEntry, Join, JoinRefused, Welcome
from asyncrl.scheduler.spawner import ForkSpawner, LocalProcess, LocalSpawner, is_prewarmed, prewarm
from asyncrl.transport import security
from asyncrl.transport.serve import fetch_tree
from asyncrl.transport.zmq_io import Endpoint

log = logging.getLogger(__name__)

GENERATOR_MODULE = "asyncrl.generators.service"
# `--set` keys a worker may change for its own host; anything else would change the run itself.
SETTABLE_PREFIXES = ("generators.", "cluster.keys_dir", "cluster.max_message_mb")
UNSETTABLE = ("generators.num_generators", "generators.remote", "generators.kind")
# ZeroMQ's own heartbeats on the connection to the launcher: a launcher host that vanished
# (no FIN) is noticed after HEARTBEAT_TIMEOUT_MS as a disconnect.
HEARTBEAT_IVL_MS = 1000
HEARTBEAT_TIMEOUT_MS = 5000
# After the launcher's connection is lost, how long it may take to come back before the
# generators are stopped (a launcher that is gone never tells them to).
LAUNCHER_GONE_S = 15.0
# A launcher whose slots are all served is asked again this often while the worker waits for one
# (the launcher forgets a waiting worker it has not heard from for `remote.WAITING_STALE_S`).
JOIN_RETRY_S = 2.0
# How often the worker looks at its generators' exit status (an exit code, not a message).
POLL_S = 0.2


class JoinFailed(RuntimeError):
    """The launcher refused the join, or never answered."""


def check_overrides(overrides: list[str]) -> None:
    for item in overrides:
        key = item.partition("=")[0].strip()
        if not key.startswith(SETTABLE_PREFIXES) or key in UNSETTABLE:
            raise ValueError(
                f"--set {key}: a worker sets only its own generators' options (generators.*, except "
                f"{', '.join(UNSETTABLE)}) and cluster.keys_dir; the rest comes from the launcher"
            )


def join_cluster(address: str, keys_dir: str, overrides: list[str]) -> ClusterConfig:
    """The cluster section this worker's own socket uses before it has the run's config: CURVE
    when the launcher is beyond loopback (as the launcher's `auto` decides), with `keys_dir`."""
    host = urlparse(address).hostname or ""
    if not address.startswith("tcp://") or not host:
        raise ValueError(f"--join {address!r}: expected the launcher's control address, tcp://HOST:PORT")
    tree: dict = {"bind_host": host, "keys_dir": keys_dir}
    for item in overrides:
        key, _, value = item.partition("=")
        if key.strip() == "cluster.max_message_mb":
            tree["max_message_mb"] = float(value)
    import msgspec

    return msgspec.convert(tree, ClusterConfig)


def scratch_dir(run_name: str, parent: str) -> Path:
    base = parent or ("/dev/shm" if os.access("/dev/shm", os.W_OK) else None)
    if base:
        Path(base).mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f"asyncrl-worker-{run_name or 'run'}-", dir=base))


class Worker:
    def __init__(
        self, address: str, *, count: int, keys_dir: str, overrides: list[str], scratch: str
    ) -> None:
        check_overrides(overrides)
        self.address = address
        self.count = count
        self.keys_dir = keys_dir
        self.overrides = list(overrides)
        if keys_dir:
            self.overrides.append(f'cluster.keys_dir="{keys_dir}"')
        self.scratch_parent = scratch
        self.scratch: Path | None = None
        self.children: dict[str, LocalProcess] = {}
        self.stopping = False
        self.launcher_lost_at: float | None = None
        self.monitor: zmq.Socket | None = None  # events of the connection to the launcher
        self.zctx: zmq.Context | None = None
        # A standby's pre-fetch of the initial model while it waits for a slot: the refusal's
        # (run name, file list), and the fetch (bytes fetched) into `scratch`/model.
        self.prefetch_of: tuple[str, list[FileEntry]] | None = None
        self.prefetch: asyncio.Task[int] | None = None

    def say(self, line: str) -> None:
        print(f"worker: {line}", flush=True)

    async def join(self, zctx: zmq.Context, timeout_s: float) -> tuple[Endpoint, Welcome]:
        host = socket.gethostname()
        identity = f"worker-{host}-{os.getpid()}-{os.urandom(3).hex()}"
        ep = Endpoint(zctx, zmq.DEALER, name="worker.ctrl", identity=identity, accept=(Welcome, JoinRefused))
        ep.sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
        ep.sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
        self.monitor = ep.sock.get_monitor_socket(
            zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_CONNECTED
        )
        ep.connect(self.address)
        try:
            return ep, await self.wait_for_slots(
                ep, Join(role="generator", count=self.count, host=host, pid=os.getpid()), timeout_s
            )
        except JoinFailed:
            ep.close()
            raise

    async def wait_for_slots(self, ep: Endpoint, join: Join, timeout_s: float) -> Welcome:
        """Ask for slots until a Welcome comes. `timeout_s` bounds the wait for the launcher's first
        answer; a launcher whose slots are all served keeps this worker waiting (asked again every
        JOIN_RETRY_S, which tells it the worker still waits) and sends the Welcome the moment one
        frees, for as long as the run lasts: until the launcher says the run has ended, or its
        connection has been gone for LAUNCHER_GONE_S."""
        deadline = time.monotonic() + timeout_s
        waiting = False
        while True:
            await ep.send(join)
            ask_again = time.monotonic() + JOIN_RETRY_S
            while (remaining := ask_again - time.monotonic()) > 0:
                try:
                    _, reply, _ = await asyncio.wait_for(ep.recv(), remaining)
                except TimeoutError:
                    break
                if isinstance(reply, Welcome):
                    return reply
                if not reply.full or self.stopping:
                    raise JoinFailed(f"the launcher refused: {reply.reason}")
                if not waiting:
                    waiting = True
                    self.say(
                        f"{reply.reason}; waiting for the first slot that frees (as long as the run lasts)"
                    )
                    prewarm()  # a standby: its generators will start with their imports done
                    self.start_prefetch(reply)
            self.watch_launcher()
            lost = self.launcher_lost_at
            if self.stopping:
                raise JoinFailed("stopped while waiting for a slot")
            if not waiting and time.monotonic() > deadline:
                raise JoinFailed(
                    f"no answer from {self.address} within {timeout_s:g} s: is the launcher running there, "
                    "and do this host's keys (--keys) belong to its run?"
                )
            if waiting and lost is not None and time.monotonic() - lost > LAUNCHER_GONE_S:
                raise JoinFailed(
                    f"the launcher has been unreachable for {LAUNCHER_GONE_S:g} s while waiting for a slot"
                )

    def start_prefetch(self, refused: JoinRefused) -> None:
        """A standby fetches the run's initial model while it waits (the refusal names it), so a
        slot that frees is served without that fetch (`prepare`)."""
        if self.prefetch is not None or not refused.model_files or not refused.files_endpoint:
            return
        assert self.zctx is not None
        self.scratch = scratch_dir(refused.run_name, self.scratch_parent)
        self.prefetch_of = (refused.run_name, list(refused.model_files))
        self.prefetch = asyncio.ensure_future(
            fetch_tree(
                self.zctx,
                refused.files_endpoint,
                "model",
                refused.model_files,
                self.scratch / "model",
                refused.checksum_kind,
            )
        )

    async def prefetched(self, welcome: Welcome) -> bool:
        """Whether the standby's pre-fetch holds this Welcome's model (waited for if still
        running); a failed or different pre-fetch is dropped and the model fetched as usual."""
        if self.prefetch is None or self.prefetch_of != (welcome.run_name, list(welcome.model_files)):
            return False
        t0 = time.perf_counter()
        try:
            nbytes = await self.prefetch
        except Exception as exc:  # noqa: BLE001 - any failure: fetch it again, as without a pre-fetch
            self.say(f"the model's pre-fetch failed ({exc}); fetching it now")
            return False
        self.say(
            f"the model was pre-fetched while waiting ({len(welcome.model_files)} files, "
            f"{nbytes / 1e6:.1f} MB; waited {time.perf_counter() - t0:.1f} s for the rest)"
        )
        return True

    async def prepare(self, zctx: zmq.Context, welcome: Welcome) -> Path:
        """The scratch run directory: config.json, and the model fetched over the network (or
        pre-fetched while this worker waited for a slot)."""
        ready = await self.prefetched(welcome)
        if not ready and self.prefetch is not None:  # another run's or model's pre-fetch: stop it
            self.prefetch.cancel()
            await asyncio.gather(self.prefetch, return_exceptions=True)
        if not ready and self.scratch is not None:
            shutil.rmtree(self.scratch, ignore_errors=True)
        self.scratch = run_dir = self.scratch if ready else scratch_dir(welcome.run_name, self.scratch_parent)
        tree = json.loads(welcome.config_json)
        if not welcome.weights_network:  # a shared filesystem: the launcher's weights root, same path
            tree["weights"]["dir"] = welcome.weights_root
        config = config_from_tree(tree, self.overrides)
        write_resolved_config(config, run_dir / "config.json")
        (run_dir / "logs").mkdir()
        if not welcome.weights_network:
            return Path(welcome.assignments[0].args.model)  # a shared filesystem
        if ready:
            return run_dir / "model"
        t0 = time.perf_counter()
        nbytes = await fetch_tree(
            zctx,
            welcome.files_endpoint,
            "model",
            welcome.model_files,
            run_dir / "model",
            welcome.checksum_kind,
        )
        self.say(
            f"fetched the model ({len(welcome.model_files)} files, {nbytes / 1e6:.1f} MB) in "
            f"{time.perf_counter() - t0:.1f} s into {run_dir / 'model'}"
        )
        return run_dir / "model"

    async def while_launcher_lives(self, work: Awaitable[Path]) -> Path | None:
        """`work`'s result, or None (said why) when the launcher's connection has been gone for
        LAUNCHER_GONE_S first: a run that ended while this worker fetched the model tells nobody."""
        task = asyncio.ensure_future(work)
        while not task.done():
            await asyncio.wait({task}, timeout=POLL_S)  # the connection's events are polled
            self.watch_launcher()
            lost = self.launcher_lost_at
            if not task.done() and lost is not None and time.monotonic() - lost > LAUNCHER_GONE_S:
                task.cancel()
                self.say(f"the launcher has been unreachable for {LAUNCHER_GONE_S:g} s; giving up the slots")
                return None
        return task.result()

    def start_generators(self, welcome: Welcome, model: Path) -> None:
        assert self.scratch is not None
        # A worker that waited has a warm fork server (`prewarm`): its generators fork from it with
        # torch and the worker modules imported (they stop when this process dies: the server
        # exits with it, and they with their parent, `runtime._watch_parent`); otherwise each
        # starts fresh and gets SIGKILL the moment this process dies.
        spawner: LocalSpawner = (
            ForkSpawner(self.scratch) if is_prewarmed() else LocalSpawner(self.scratch, die_with_parent=True)
        )
        for a in welcome.assignments:
            args = msgspec.structs.replace(a.args, model=str(model))
            proc = spawner.start(a.peer_id, GENERATOR_MODULE, ctrl_address=self.address, args=args)
            self.children[a.peer_id] = proc
            self.say(f"serving {a.peer_id} (pid {proc.pid}), log {proc.log_path}")

    def watch_launcher(self) -> None:
        """Take the connection's monitor events that have arrived: since when it is lost, if it is."""
        from zmq.utils.monitor import parse_monitor_message

        while self.monitor is not None:
            try:
                event = parse_monitor_message(self.monitor.recv_multipart(zmq.NOBLOCK))["event"]
            except zmq.Again:
                return
            if event == zmq.EVENT_DISCONNECTED:
                self.launcher_lost_at = self.launcher_lost_at or time.monotonic()
            else:
                self.launcher_lost_at = None

    def stop(self, why: str) -> None:
        if not self.stopping:
            self.stopping = True
            self.say(f"stopping the generators: {why}")
        for proc in self.children.values():
            proc.terminate()

    async def supervise(self) -> int:
        """Until every generator has exited; the worst exit status (0 when all ended cleanly)."""
        reported: set[str] = set()
        stop_sent_at = None
        while True:
            codes = {peer: p.exit_code() for peer, p in self.children.items()}
            for peer, code in codes.items():
                if code is not None and peer not in reported:
                    reported.add(peer)
                    self.say(f"{peer} exited with code {code}")
            if all(code is not None for code in codes.values()):
                return max((abs(c) for c in codes.values() if c is not None), default=0)
            self.watch_launcher()
            lost = self.launcher_lost_at
            if lost is not None and time.monotonic() - lost > LAUNCHER_GONE_S:
                self.stop(f"the launcher has been unreachable for {LAUNCHER_GONE_S:g} s")
            if self.stopping:
                stop_sent_at = stop_sent_at or time.monotonic()
                if time.monotonic() - stop_sent_at > 10.0:
                    for proc in self.children.values():
                        proc.kill()
            await asyncio.sleep(POLL_S)  # polling exit codes; there is no message to wait for

    async def run(self, join_timeout_s: float) -> int:
        security.install_from_config(
            join_cluster(self.address, self.keys_dir, self.overrides), role="worker", keys_dir=self.keys_dir
        )
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self.stop, f"signal {sig.name}")
        zctx = self.zctx = zmq.Context()
        ep = None
        try:
            ep, welcome = await self.join(zctx, join_timeout_s)
            slots = ", ".join(a.peer_id for a in welcome.assignments)
            self.say(f"pid {os.getpid()} joined run {welcome.run_name!r} at {self.address}: serving {slots}")
            model = await self.while_launcher_lives(self.prepare(zctx, welcome))
            if model is None or self.stopping:
                return 130 if self.stopping else 1
            self.start_generators(welcome, model)
            code = await self.supervise()
            self.say(f"done (exit code {code})")
            return code
        finally:
            if self.prefetch is not None and not self.prefetch.done():
                self.prefetch.cancel()
                await asyncio.gather(self.prefetch, return_exceptions=True)
            for proc in self.children.values():
                proc.kill()  # a no-op for those that exited
            if ep is not None:
                ep.close()
            if self.monitor is not None:
                self.monitor.close()
            zctx.destroy(linger=0)
            if self.scratch is not None and not os.environ.get("ASYNCRL_KEEP_SCRATCH"):
                shutil.rmtree(self.scratch, ignore_errors=True)


def run_worker(
    address: str,
    *,
    count: int = 1,
    keys_dir: str = "",
    overrides: list[str] | None = None,
    scratch: str = "",
    join_timeout_s: float = 60.0,
) -> int:
    """Join the run at `address` and serve `count` generator slots until it ends; an exit status.
    Raises ValueError (bad arguments or config) or JoinFailed."""
    import uvloop

    from asyncrl.models.hf import quiet_offline

    quiet_offline()
    logging.basicConfig(level=os.environ.get("ASYNCRL_LOG_LEVEL", "WARNING"))
    if count < 1:
        raise ValueError("--count must be >= 1")
    worker = Worker(address, count=count, keys_dir=keys_dir, overrides=list(overrides or []), scratch=scratch)
    try:
        return uvloop.run(worker.run(join_timeout_s))
    except ConfigError as exc:
        raise ValueError(str(exc)) from None


if __name__ == "__main__":
    sys.exit(run_worker(sys.argv[1]))
