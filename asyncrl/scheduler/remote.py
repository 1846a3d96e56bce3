"""Generator slots served by workers on other hosts (`asyncrl worker --join`): the launcher's side.

Place in the data flow: `generators.remote` of the generator slots (the last ones) are remote. The
launcher starts every slot through the spawner seam as usual; `RemoteSpawner` starts nothing for a
remote slot: it hands back a `RemoteHandle` that waits for a worker to join. A worker on another
host connects a DEALER to the launcher's control socket and sends `Join(count)`; `JoinDesk.on_join`
gives it up to `count` waiting slots in a `Welcome`: the resolved config, each slot's peer id and
`WorkerArgs`, the file socket's address and the initial model's file list (with checksums),
so nothing on the worker's host reads the launcher's run directory. The worker starts one
generator process per slot; each connects to the control socket under its slot's peer id, says
Hello, and is from then on a generator like any other (heartbeats, tasks, weights).

Supervision is the launcher's, unchanged: a remote generator that falls silent past
monitor.heartbeat_timeout_s (its host died, or its worker was killed and took its processes with
it) or reports Fatal is retired: its in-flight tasks are re-queued exactly once, messages it sent
before are stale, and its slot gets a new incarnation, which here is a new `RemoteHandle` waiting
for a worker to join (`generators.remote_lost = "wait"`, counted against max_restarts), or none
("drop": the run goes on with fewer generators). "Killing" a remote worker is telling it to
shut down (best effort); a slot that waits longer than generators.remote_join_timeout_s fails the
run, naming the command to run.

Weights: with generators.remote_weights = "network" the launcher serves the initial model and the
weights root on a socket of its own (`transport/serve.py`); each remote generator fetches every
version it loads into its worker's scratch directory and reads it there like local shards.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path

import msgspec
import zmq

from asyncrl.config import Config
from asyncrl.messages import (
    PROTOCOL_VERSION,
    Assignment,
    FileEntry,
    FileRequest,
    Join,
    JoinRefused,
    Welcome,
    WorkerArgs,
)
from asyncrl.scheduler.children import Child
from asyncrl.scheduler.records import Records
from asyncrl.scheduler.spawner import Spawner
from asyncrl.transport.serve import FileServer, list_tree
from asyncrl.transport.zmq_io import Endpoint

log = logging.getLogger(__name__)

# The command a user runs on another host to serve remote slots (events, failure messages).
WORKER_COMMAND = "asyncrl worker --join {address} --count {count}"
# A waiting worker asks again every `asyncrl.worker.JOIN_RETRY_S`; one not heard from for this
# long is forgotten (it gave up, or died while it waited).
WAITING_STALE_S = 10.0
# A freed slot is offered only to waiting workers heard from within this long (two of their asks
# and a margin): a Welcome sent to one that died meanwhile would hold the slot until its start-up
# bound; one that is alive but quiet gets the slot when it asks again (`on_join`).
OFFER_FRESH_S = 5.0


class WaitingWorker(msgspec.Struct, kw_only=True):
    """A worker that asked for slots while none was free: it waits, and the first slots that free
    are offered to it (`JoinDesk.offers`), oldest waiter first."""

    identity: str  # its DEALER's identity on the control socket
    join: Join
    since: float
    last_seen: float


class JoinStats(msgspec.Struct, frozen=True, kw_only=True, rename=lambda name: f"launcher/{name}"):
    """The join desk's counters, as the run's `files` record shows them ("launcher/worker_joins", ...)."""

    worker_joins: int
    worker_joins_refused: int  # Joins answered JoinRefused
    files_bytes_served: int  # by the launcher's file socket (generators.remote_weights = "network")


class RemoteHandle:
    """A `WorkerHandle` for a slot served (or to be served) by a worker on another host. It never
    signals anything: it is gone once the launcher gives up on it (`kill`, `terminate`), and
    `kill` also asks the process, if it still listens, to shut down (`on_kill`)."""

    remote = True

    def __init__(self, peer_id: str, args: WorkerArgs, on_kill: Callable[[str], None] | None) -> None:
        self.peer_id = peer_id
        self.args = args
        self.on_kill = on_kill
        self.waiting_since = time.monotonic()
        self.worker = ""  # "HOST (pid N)" once a worker joined to serve it
        self._gone = False

    @property
    def joined(self) -> bool:
        return bool(self.worker)

    @property
    def pid(self) -> int:
        return 0  # on another host: never ours to signal; its Hello names its pid

    @property
    def log_path(self) -> Path:
        where = f" on {self.worker}" if self.worker else ""
        return Path(f"logs/{self.peer_id}.log in the scratch directory of its worker{where}")

    def exit_code(self) -> int | None:
        return 0 if self._gone else None

    def terminate(self) -> None:
        self._gone = True

    def kill(self) -> None:
        if not self._gone and self.joined and self.on_kill is not None:
            self.on_kill(self.peer_id)  # hung, or cut off: it stops if the message reaches it
        self._gone = True

    async def wait(self) -> int:
        self._gone = True
        return 0


class RemoteSpawner:
    """Routes remote slots' peer ids (`is_remote`) to handles that wait for a join; everything
    else to `inner`."""

    def __init__(self, inner: Spawner, is_remote: Callable[[str], bool]) -> None:
        self.inner = inner
        self.is_remote = is_remote
        self.waiting: list[RemoteHandle] = []  # started, no worker yet, in start order
        self.on_kill: Callable[[str], None] | None = None

    def start(self, peer_id: str, module: str, *, ctrl_address: str, args: WorkerArgs):
        if not self.is_remote(peer_id):
            return self.inner.start(peer_id, module, ctrl_address=ctrl_address, args=args)
        handle = RemoteHandle(peer_id, args, self.on_kill)
        self.waiting.append(handle)
        return handle

    def take(self, count: int) -> list[RemoteHandle]:
        """Up to `count` waiting handles, oldest first (ones given up meanwhile are dropped)."""
        self.waiting = [h for h in self.waiting if h.exit_code() is None]
        taken, self.waiting = self.waiting[:count], self.waiting[count:]
        return taken

    def overdue(self, timeout_s: float) -> RemoteHandle | None:
        """A handle that has waited for a worker longer than `timeout_s` (0: never)."""
        now = time.monotonic()
        for h in self.waiting:
            if timeout_s and h.exit_code() is None and now - h.waiting_since > timeout_s:
                return h
        return None


class JoinDesk:
    """The launcher's side of joining: answers Join, serves files, says what is awaited."""

    FULL = "no generator slot is waiting for a worker (every remote slot is served)"

    def __init__(
        self,
        config: Config,
        inner: Spawner,
        records: Records,
        slot_of: Callable[[str], str],
        *,
        model_path: Path,
        run_dir: Path,
    ) -> None:
        """`inner` starts the local workers; `slot_of(peer_id)` names a generator's slot ("" for
        others); the last generators.remote slots are remote."""
        self.cfg = config
        slots = [f"gen-{i}" for i in range(config.generators.num_generators)]
        remote_slots = frozenset(slots[len(slots) - config.generators.remote :])
        self.spawner = RemoteSpawner(inner, lambda peer: slot_of(peer) in remote_slots)
        self.records = records
        self.network = config.generators.remote_weights == "network"
        self.model_path = Path(model_path)
        self.weights_root = Path(config.weights.dir) if config.weights.dir else Path(run_dir) / "weights"
        self.files = FileServer({"model": self.model_path, "weights": self.weights_root})
        self.files_address = ""
        self.ctrl_address = ""
        self._model_files: asyncio.Task[list[FileEntry]] | None = None
        self._serving: asyncio.Task | None = None
        self._ep: Endpoint | None = None
        self.num_joins = 0
        self.num_refused = 0
        self.waiting_workers: dict[str, WaitingWorker] = {}  # identity -> worker, in arrival order
        self.welcomed: set[str] = set()  # identities that got slots (a late Join of theirs is stale)

    def start(
        self, zctx: zmq.Context, ctrl_address: str, shutdown: Callable[[str], Awaitable[object]]
    ) -> None:
        """Bind the file socket (where the policy binds: cluster.bind_host) and start serving; the
        initial model's checksums are computed meanwhile, in a thread, for the first Welcome.
        `shutdown(peer_id)` tells a remote generator that was given up on to stop."""
        self.ctrl_address = ctrl_address
        self.spawner.on_kill = lambda peer: asyncio.ensure_future(shutdown(peer))
        if not self.network:
            return
        self._ep = Endpoint(zctx, zmq.ROUTER, name="launcher.files", accept=(FileRequest,))
        self.files_address = self._ep.bind()
        self._serving = asyncio.create_task(self.files.serve(self._ep), name="launcher-files")
        kind = self.cfg.weights.checksum
        self._model_files = asyncio.create_task(
            asyncio.to_thread(list_tree, self.model_path, kind), name="launcher-model-files"
        )

    def command(self, count: int) -> str:
        return WORKER_COMMAND.format(address=self.ctrl_address, count=count)

    async def on_join(
        self, msg: Join, children: Mapping[str, Child], identity: str
    ) -> Welcome | JoinRefused | None:
        """The answer to a worker's Join (recorded as a `join` record and an event); None for a
        worker that already has its slots (a Join it sent again while its Welcome was on the way).
        A worker refused because every slot is served waits (`waiting_workers`); it asks again
        now and then, which tells the launcher it still waits."""
        if identity in self.welcomed:
            return None
        now = time.monotonic()
        if (waiting := self.waiting_workers.get(identity)) is not None:
            waiting.last_seen = now
            if not self.spawner.waiting:
                return JoinRefused(reason=self.FULL, full=True)  # still waiting: no record, no event
        reply, handles = await self.answer(msg)
        if isinstance(reply, JoinRefused) and reply.full:
            self.waiting_workers[identity] = waiting or WaitingWorker(
                identity=identity, join=msg, since=now, last_seen=now
            )
            self._record(msg, [], f"{reply.reason}; it waits for the first slot that frees")
            return reply
        self.waiting_workers.pop(identity, None)
        self._welcomed(msg, identity, handles, children)
        return reply

    def _welcomed(self, msg: Join, identity: str, handles: list[RemoteHandle], children) -> None:
        self.welcomed.add(identity)
        for h in handles:  # its Hello is due within the start-up timeout from now
            children[h.peer_id].spawned = time.monotonic()
        self._record(msg, [h.peer_id for h in handles], "")

    def _record(self, msg: Join, slots: list[str], refused: str) -> None:
        record = {"host": msg.host, "pid": msg.pid, "count": msg.count, "slots": slots, "refused": refused}
        self.records.write("join", record)
        self.records.event(
            f"worker on {msg.host} (pid {msg.pid}) refused: {refused}"
            if refused
            else f"worker on {msg.host} (pid {msg.pid}) joined to serve {', '.join(slots)}"
        )

    async def offers(self, children: Mapping[str, Child]) -> list[tuple[str, Welcome, list[RemoteHandle]]]:
        """Slots waiting for a worker, given to the workers that wait for one, oldest first:
        (identity, Welcome, handles) to send; `undelivered` puts back those that did not arrive."""
        out = []
        now = time.monotonic()
        for identity, waiting in list(self.waiting_workers.items()):
            if not self.spawner.waiting:
                break
            if now - waiting.last_seen > OFFER_FRESH_S:
                continue
            reply, handles = await self.answer(waiting.join)
            if not handles:
                break
            del self.waiting_workers[identity]
            self._welcomed(waiting.join, identity, handles, children)
            assert isinstance(reply, Welcome)
            out.append((identity, reply, handles))
        return out

    def undelivered(self, identity: str, handles: list[RemoteHandle]) -> None:
        """A Welcome that could not be sent (its worker is gone): its slots wait again, first."""
        self.welcomed.discard(identity)
        for h in handles:
            h.worker = ""
        self.spawner.waiting[:0] = handles
        self.num_joins -= 1

    def ended(self) -> list[str]:
        """The run is over: the identities of the workers still waiting (to be told), forgotten."""
        waiting, self.waiting_workers = list(self.waiting_workers), {}
        return waiting

    def drops(self, child: Child, reason: str, *, num_requeued: int) -> bool:
        """Whether the lost remote generator `child`'s slot is given up (generators.remote_lost =
        "drop": the run goes on with fewer) rather than waiting for a replacement to join."""
        if not getattr(child.handle, "remote", False) or self.cfg.generators.remote_lost != "drop":
            return False
        headline = reason.splitlines()[0].rstrip(".")
        self.records.event(
            f"generator {child.peer_id} (remote) {headline}; its slot is dropped "
            f"(generators.remote_lost = drop), {num_requeued} tasks re-queued"
        )
        self.records.write("drop", {"slot": child.slot, "peer_id": child.peer_id, "reason": headline})
        return True

    async def answer(self, msg: Join) -> tuple[Welcome | JoinRefused, list[RemoteHandle]]:
        """The answer to a worker's Join, and the handles it now serves (none when refused)."""
        if msg.protocol_version != PROTOCOL_VERSION:
            return self._refuse(
                f"the worker speaks protocol version {msg.protocol_version}, the launcher "
                f"{PROTOCOL_VERSION}: run the same asyncrl version on every host"
            )
        if msg.role != "generator" or msg.count < 1:
            return self._refuse(
                f"cannot serve {msg.count} {msg.role!r} slot(s); this launcher takes generators"
            )
        model_files = await self._model_files if self._model_files is not None else []
        handles = self.spawner.take(msg.count)
        if not handles:  # it waits, and meanwhile pre-fetches the model the Welcome will name
            return self._refuse(
                self.FULL,
                full=True,
                run_name=self.cfg.run.name,
                files_endpoint=self.files_address,
                checksum_kind=self.cfg.weights.checksum,
                model_files=model_files,
            )
        worker = f"{msg.host} (pid {msg.pid})"
        assignments = []
        for h in handles:
            h.worker = worker
            args = msgspec.structs.replace(h.args, files=self.files_address) if self.network else h.args
            assignments.append(Assignment(peer_id=h.peer_id, args=args))
        self.num_joins += 1
        welcome = Welcome(
            run_name=self.cfg.run.name,
            config_json=msgspec.json.encode(self.cfg).decode(),
            assignments=assignments,
            files_endpoint=self.files_address,
            checksum_kind=self.cfg.weights.checksum,
            model_files=model_files,
            weights_network=self.network,
            weights_root=str(self.weights_root.resolve()),
        )
        return welcome, handles

    def _refuse(
        self, reason: str, *, full: bool = False, **standby
    ) -> tuple[JoinRefused, list[RemoteHandle]]:
        self.num_refused += 1
        return JoinRefused(reason=reason, full=full, **standby), []

    def tick(self) -> str | None:
        """Each supervision tick: why the run must stop because a remote slot waited too long for
        a worker, or None."""
        now = time.monotonic()
        for identity, waiting in list(self.waiting_workers.items()):
            if now - waiting.last_seen > WAITING_STALE_S:
                del self.waiting_workers[identity]
        timeout_s = self.cfg.generators.remote_join_timeout_s
        h = self.spawner.overdue(timeout_s)
        if h is None:
            return None
        waiting = len(self.spawner.waiting)
        return (
            f"generator {h.peer_id} waited {timeout_s:g} s for a worker to join "
            f"(generators.remote_join_timeout_s); start one on a generator host: {self.command(waiting)}"
        )

    @property
    def stats(self) -> JoinStats:
        return JoinStats(
            worker_joins=self.num_joins,
            worker_joins_refused=self.num_refused,
            files_bytes_served=self.files.bytes_served,
        )

    def close(self) -> None:
        # What the file socket served, for the run's record (a `files` record).
        self.records.write("files", msgspec.to_builtins(self.stats))
        for task in (self._serving, self._model_files):
            if task is not None:
                task.cancel()
        if self._ep is not None:
            self._ep.close()
