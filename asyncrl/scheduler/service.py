"""The launcher: spawns and supervises the learner and generator processes, owns the prompt
stream and admission, routes control messages, aggregates metrics, and ends the run cleanly.

Sockets: one ROUTER bound on loopback; every child connects a DEALER with its peer id as the
ZeroMQ identity. Flow:
  learner Hello(endpoint) -> spawn generators -> generator Hellos -> admit + dispatch PromptTasks
  WeightsPublished (learner) -> every generator;  WeightsLoaded (generator) -> learner, admission
  StepDone (learner) -> metrics, reporter, task book; the last one ends the run.
Supervision (scheduler/supervision.py, scheduler/tasks.py): a generator that exits, raises, or
falls silent past monitor.heartbeat_timeout_s is killed (that pid only) and restarted under a new
peer id; the replacement is sent the last WeightsPublished and gets tasks once it has loaded it;
the dead one's in-flight tasks are re-queued exactly once, to whichever generator serves first.
Past generators.max_restarts for one generator, or when the learner exits, raises or hangs, the
run fails with a message naming the process, the reason and its log.
Shutdown: on completion, Ctrl-C, or a failure, every child gets Shutdown, then SIGTERM,
then SIGKILL after a grace period; only processes this launcher started are signalled.
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import msgspec
import zmq

from asyncrl.config import Config
from asyncrl.messages import (
    PROTOCOL_VERSION,
    Fatal,
    GroupsLeft,
    Heartbeat,
    Hello,
    Metrics,
    PromptTask,
    PromptTasks,
    SamplingParams,
    Shutdown,
    StepDone,
    TaskDone,
    TasksDone,
    WeightsLoaded,
    WeightsPublished,
)
from asyncrl.scheduler.admission import Admission, CreditAdmission, step_of
from asyncrl.scheduler.children import Child, health, reap, start_child
from asyncrl.scheduler.supervision import GeneratorPool, Incarnation, RestartBudgetExceeded
from asyncrl.scheduler.tasks import TaskBook
from asyncrl.transport.zmq_io import Endpoint

log = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 120.0
STOP_GRACE_S = 10.0
POLL_S = 0.2
# What the launcher's control socket accepts from children; any other type is rejected and counted.
INTERRUPTED_RUN = "(interrupted run)"  # ledger generator id of tasks re-admitted on resume
CONTROL_ACCEPT = (
    Hello,
    TasksDone,
    WeightsPublished,
    WeightsLoaded,
    StepDone,
    GroupsLeft,
    Metrics,
    Heartbeat,
    Fatal,
)


class RunFailed(RuntimeError):
    """A child process failed; the message says which and why."""


class Reporter(Protocol):
    def update(self, state: RunState) -> None: ...
    def event(self, text: str) -> None: ...


@dataclass
class RunState:
    """Everything the live view and the summary need; updated by the launcher only."""

    total_steps: int
    max_staleness_bound: int
    launched: float = field(default_factory=time.perf_counter)  # the clock of every record's time_s
    started: float = field(default_factory=time.perf_counter)  # reset when training starts
    step: int = 0
    policy_version: int = 0
    trajectories_generated: int = 0
    trajectories_trained: int = 0
    tokens_generated: int = 0
    groups_admitted: int = 0
    groups_in_flight: int = 0
    max_staleness: int = 0
    last_reward: float = 0.0
    last_loss: float = 0.0
    last_clip_fraction: float = 0.0
    rewards: list[float] = field(default_factory=list)
    loaded_versions: dict[str, int] = field(default_factory=dict)  # generator slot -> version
    metrics: dict[str, float] = field(default_factory=dict)
    generator_restarts: int = 0
    tasks_requeued: int = 0
    stale_messages: int = 0  # from a generator process already replaced (dropped)
    rejected_frames: int = 0  # on the launcher's control socket (malformed, unknown peer, ...)
    phase: str = "starting"

    @property
    def elapsed_s(self) -> float:
        return time.perf_counter() - self.started


class Launcher:
    def __init__(
        self, config: Config, run_dir: Path, model_path: Path, reporter: Reporter, *, resume_version: int = 0
    ) -> None:
        from asyncrl.tasks.arithmetic import AdditionTask

        self.cfg = config
        self.run_dir = run_dir
        self.model_path = model_path
        self.reporter = reporter
        self.state = RunState(
            total_steps=config.learner.steps, max_staleness_bound=config.effective_max_staleness
        )
        self.task = AdditionTask(
            seed=config.task.seed,
            eval_seed=config.task.eval_seed,
            num_eval=config.task.num_eval,
            max_operand=config.task.max_operand,
        )
        self.pool_mode = config.buffer.mode == "pool"
        self.admission = (
            CreditAdmission(
                groups_per_step=config.learner.groups_per_step,
                max_staleness=config.effective_max_staleness,
                total_steps=config.learner.steps,
            )
            if self.pool_mode
            else Admission(
                groups_per_step=config.learner.groups_per_step,
                max_staleness=config.effective_max_staleness,
                total_steps=config.learner.steps,
            )
        )
        self.children: dict[str, Child] = {}
        self.generator_ids = [f"gen-{i}" for i in range(config.generators.num_generators)]
        self.pool = GeneratorPool(self.generator_ids, max_restarts=config.generators.max_restarts)
        self.book = TaskBook(
            groups_per_step=config.learner.groups_per_step,
            samples_per_group=config.learner.samples_per_group,
        )
        # Resuming at version v: groups [0, v*B) were trained; every later group is admitted again
        # from the prompt stream (`readmit_checkpointed` first, for those the interrupted run had
        # admitted); the learner keeps the trajectories its checkpoint held and drops their copies.
        self.resume_version = resume_version
        if not self.pool_mode:
            self.admission.num_admitted = resume_version * config.learner.groups_per_step
        self.book.num_steps_trained = resume_version
        self.state.step = self.state.policy_version = resume_version
        self.retired: list[Child] = []  # generator processes that died and were replaced
        self.last_published: WeightsPublished | None = None
        self.ctrl_address = ""
        self.rejected_by_reason: dict[str, int] = {}
        self.learner_endpoint = ""
        self.finished = asyncio.Event()
        self.failure: str | None = None
        self.interrupted = False
        self.metrics_file = open(run_dir / "metrics.jsonl", "a", buffering=1)  # noqa: SIM115 - closed in run()
        self.monitor_hub = (
            None  # live metrics stream (PUB + sinks), opened in run(): asyncrl/monitor/stream.py
        )
        self.task_started: dict[int, float] = {}
        self._tokenizer = None

    # ------------------------------------------------------------------ processes
    def spawn(self, peer_id: str, role: str, module: str, ctrl_address: str, extra: dict[str, str]) -> Child:
        child = start_child(
            peer_id, role, module, ctrl_address=ctrl_address, run_dir=self.run_dir, extra=extra
        )
        proc = child.proc
        self.children[peer_id] = child
        self.event(f"started {peer_id} (pid {proc.pid})")
        self.write_record("spawn", {"peer_id": peer_id, "role": role, "pid": proc.pid})
        return child

    def spawn_generator(self, inc: Incarnation) -> Child:
        child = self.spawn(
            inc.peer_id,
            "generator",
            "asyncrl.generators.service",
            self.ctrl_address,
            {"model": str(self.model_path), "data": self.learner_endpoint, "index": str(inc.index)},
        )
        child.slot = inc.slot
        return child

    async def supervise(self, ctrl: Endpoint) -> None:
        """A generator that exits or falls silent is restarted; a learner that does fails the run."""
        timeout_s = self.cfg.monitor.heartbeat_timeout_s
        while not self.finished.is_set():
            for child in list(self.children.values()):
                if child.stopping or self.finished.is_set():
                    continue
                reason = health(child, heartbeat_timeout_s=timeout_s, startup_timeout_s=STARTUP_TIMEOUT_S)
                if reason is None:
                    continue
                if child.role != "generator":
                    self.fail(f"{child.role} {child.peer_id} {reason}")
                    return
                await self.restart_generator(ctrl, child, reason)
            self.report_rejected(ctrl)
            await asyncio.sleep(POLL_S)  # polling child exit status; no message to wait for

    def report_rejected(self, ctrl: Endpoint) -> None:
        """A `rejected` record whenever the control socket's rejection count has changed."""
        if ctrl.num_rejected != self.state.rejected_frames:
            self.state.rejected_frames = ctrl.num_rejected
            self.state.metrics["launcher/rejected_frames"] = float(ctrl.num_rejected)
            self.write_record("rejected", {"socket": ctrl.name, "num_rejected": ctrl.num_rejected})

    async def restart_generator(self, ctrl: Endpoint, child: Child, reason: str) -> None:
        """Kill `child` (that pid only), re-queue its in-flight tasks once, start its replacement.

        The bookkeeping happens before the first await, so no dispatch can pick the dead process.
        """
        self.pool.died(child.peer_id)
        del self.children[child.peer_id]
        child.stopping = True
        self.retired.append(child)
        requeued = self.book.generator_failed(child.peer_id)
        self.state.tasks_requeued += len(requeued)
        if child.proc.poll() is None:
            child.proc.kill()  # hung, or stuck after Fatal: SIGKILL, to this pid only
        await reap(child)
        try:
            inc = self.pool.restart(child.slot)
        except RestartBudgetExceeded as exc:
            self.fail(
                f"generator {child.slot} {reason}\nIt was {exc}, so the run stops; "
                "raise generators.max_restarts to allow more restarts."
            )
            return
        headline = reason.splitlines()[0].rstrip(".")
        self.state.generator_restarts = self.pool.num_restarts
        self.state.metrics["launcher/generator_restarts"] = float(self.pool.num_restarts)
        self.write_record(
            "restart",
            {
                "slot": child.slot,
                "peer_id": child.peer_id,
                "pid": child.proc.pid,
                "new_peer_id": inc.peer_id,
                "reason": headline,
                "requeued": requeued,
                "generator_restarts": self.pool.num_restarts,
            },
        )
        self.event(
            f"generator {child.peer_id} {headline}; restarting it as {inc.peer_id} "
            f"(restart {inc.restart} of {self.pool.max_restarts}), {len(requeued)} tasks re-queued"
        )
        self.spawn_generator(inc)
        await self.dispatch(ctrl)  # the re-queued tasks can go to generators still serving

    def fail(self, reason: str) -> None:
        if self.failure is None:
            self.failure = reason
        self.finished.set()

    async def stop_children(self, ctrl: Endpoint) -> None:
        for child in self.children.values():
            child.stopping = True
            if child.proc.poll() is None:
                reason = "run finished" if self.failure is None else "run failed"
                await self.send_to(ctrl, child.peer_id, Shutdown(reason=reason))
        deadline = time.monotonic() + STOP_GRACE_S
        for sig in (None, signal.SIGTERM, signal.SIGKILL):
            alive = [c for c in self.children.values() if c.proc.poll() is None]
            if not alive:
                return
            if sig is not None:
                for c in alive:
                    c.proc.send_signal(sig)
                deadline = time.monotonic() + 5.0
            while time.monotonic() < deadline and any(c.proc.poll() is None for c in alive):
                await asyncio.sleep(0.05)  # waiting for exit codes

    # ------------------------------------------------------------------ messages
    async def send_to(self, ctrl: Endpoint, peer_id: str, msg) -> bool:
        """Send to one child. A child that is gone (or never connected) is not an error here:
        supervision sees its exit and decides; the message is logged as undeliverable."""
        try:
            await ctrl.send(msg, to=peer_id.encode())
            return True
        except zmq.ZMQError as exc:
            log.warning("could not deliver %s to %s: %s", type(msg).__name__, peer_id, exc)
            return False

    def event(self, text: str) -> None:
        log.info(text)
        self.reporter.event(text)

    def write_record(self, kind: str, payload: dict) -> None:
        record = {**payload, "type": kind, "time_s": round(time.perf_counter() - self.state.launched, 4)}
        line = json.dumps(record)
        self.metrics_file.write(line + "\n")
        # --- monitor hook: the same record to the PUB socket and the dashboard (asyncrl/monitor/stream.py)
        if self.monitor_hub is not None:
            self.monitor_hub.publish(record, line)

    def min_loaded_version(self) -> int | None:
        """The oldest version a serving generator holds; None while none serves (admit nothing).
        Dead generators and replacements still loading the current weights do not count."""
        return self.pool.min_loaded_version()

    async def dispatch(self, ctrl: Endpoint) -> None:
        """Re-queued tasks first, then newly admitted groups, each to a serving generator."""
        if self.state.phase != "training" or self.finished.is_set():
            return
        loaded = self.min_loaded_version()
        if loaded is None:
            return
        # A task waits while its step is beyond the bound for the loaded weights (only the groups
        # re-admitted on resume can be, until the generators load the resumed version).
        max_step = loaded + self.cfg.effective_max_staleness
        tasks = []
        while self.book.requeued and self.book.open[self.book.requeued[0]].step <= max_step:
            tasks.append(self.book.pop_requeued())
        tasks += self.admit(self.admission.admit(loaded), loaded)
        by_peer: dict[str, list[PromptTask]] = {}
        for task in tasks:
            self.assign(task, by_peer)
        for peer, mine in by_peer.items():  # one message per generator
            await self.send_to(ctrl, peer, PromptTasks(tasks=mine))

    def admit(self, groups: range | list[int], loaded: int) -> list[PromptTask]:
        """The groups' PromptTasks, admitted to the task book (not sent anywhere yet). A task's
        step is the one it trains in (window mode), or in pool mode the version the generators
        held when it was admitted (the buffer's `windowed` order reads it). The prompts are
        tokenized in one call (a window's worth at a time: ~4x less CPU than one call each)."""
        if not groups:
            return []
        s = self.cfg.sampling
        sampling = SamplingParams(
            temperature=s.temperature, top_p=s.top_p, max_new_tokens=s.max_new_tokens, ignore_eos=s.ignore_eos
        )
        problems = [self.task.train_problem(j) for j in groups]
        prompt_ids = self._tokenizer([p.prompt for p in problems])["input_ids"]
        tasks = []
        now = time.perf_counter()
        for j, problem, ids in zip(groups, problems, prompt_ids, strict=True):
            task = PromptTask(
                task_id=j,
                group_id=j,
                prompt_ids=ids,
                num_samples=self.cfg.learner.samples_per_group,
                sampling=sampling,
                dataset_index=j,
                step=min(loaded, self.cfg.learner.steps - 1)
                if self.pool_mode
                else step_of(j, groups_per_step=self.cfg.learner.groups_per_step),
                answer=problem.answer,
            )
            self.book.admit(task)
            self.task_started[j] = now
            tasks.append(task)
        self.state.groups_admitted += len(tasks)
        self.state.groups_in_flight += len(tasks)
        return tasks

    def readmit_checkpointed(self) -> None:
        """Resume: admit again, before the learner starts, every group the interrupted run had
        admitted past v*B (queued for the generators). The learner may hold whole windows of them
        from its checkpoint and train those steps before any generator is up; their StepDone
        must find the groups in the book. The staleness bound holds: they were admitted for
        versions <= v + K, and the generators serve version v before they get any."""
        from asyncrl.scheduler.checkpoint import checkpoint_dir

        path = checkpoint_dir(self.run_dir) / f"launcher-{self.resume_version:08d}.json"
        saved = msgspec.json.decode(path.read_bytes())
        admitted = saved["admission"]["num_admitted"]
        if self.pool_mode:
            # Pool mode trains groups in any order: re-admit every group the checkpoint's ledger
            # still has open (admitted, neither trained nor dropped), each on a credit, and
            # continue the prompt stream after the last one admitted.
            from asyncrl.buffer.ledger import Ledger, LedgerSnapshot

            snap = msgspec.convert(saved["ledger"], LedgerSnapshot)
            again = Ledger.from_bytes(msgspec.msgpack.encode(snap)).open_tasks()
            self.admission.num_admitted = admitted
            self.admission.num_returned = admitted - len(again)
        else:
            again = list(range(self.admission.num_admitted, admitted))
        # In the ledger they were in flight on the interrupted run's generators, now gone, so
        # they are re-queued (trajectories restored by the learner may arrive for them).
        for task in self.admit(again, self.resume_version):
            self.book.dispatched(task.task_id, INTERRUPTED_RUN)
        self.book.generator_failed(INTERRUPTED_RUN)
        self.admission.num_admitted = max(self.admission.num_admitted, admitted)

    def assign(self, task: PromptTask, by_peer: dict[str, list[PromptTask]]) -> None:
        """Give `task` to the serving generator with the fewest outstanding tasks (appended to
        its list in `by_peer`, which the caller sends); with none serving, it waits in the
        re-queue. Chosen and recorded before any send is awaited (see restart)."""
        serving = [self.children[inc.peer_id] for inc in self.pool.serving()]
        if not serving:
            self.book.requeued.append(task.task_id)
            return
        gen = min(serving, key=lambda c: c.outstanding)
        gen.outstanding += 1
        self.book.dispatched(task.task_id, gen.peer_id)
        by_peer.setdefault(gen.peer_id, []).append(task)

    async def on_message(self, ctrl: Endpoint, sender: bytes, msg) -> None:
        peer = sender.decode(errors="replace")
        child = self.children.get(peer)
        if child is None:
            if self.pool.is_retired(peer):
                # Sent by a generator before it died and was replaced: its tasks are re-queued.
                self.state.stale_messages += 1
                log.info("stale %s from replaced generator %s dropped", type(msg).__name__, peer)
            else:
                ctrl.reject(f"unknown peer: {type(msg).__name__} from {peer!r} dropped")
            return
        child.last_seen = time.monotonic()
        try:
            await self.handle(ctrl, child, msg)
        except ValueError as exc:
            # A child breaking the protocol (a TaskDone for a task it does not run, a second Hello):
            # the message is rejected and counted; supervision still watches the child.
            ctrl.reject(f"protocol violation: {exc}")
        self.reporter.update(self.state)

    async def handle(self, ctrl: Endpoint, child: Child, msg) -> None:
        """One message from a live child; ValueError for one that breaks the protocol."""
        peer = child.peer_id
        is_learner = child.role == "learner"
        match msg:
            case Hello():
                if msg.protocol_version != PROTOCOL_VERSION:
                    ctrl.reject(f"wrong protocol version: {msg.protocol_version} from {peer}")
                    self.fail(
                        f"{child.role} {peer} speaks protocol version {msg.protocol_version}, the launcher "
                        f"{PROTOCOL_VERSION}: run the same asyncrl version in every process"
                    )
                    return
                if child.ready:
                    raise ValueError(f"{peer} said Hello twice")
                child.ready = True
                if is_learner:
                    self.learner_endpoint = msg.endpoint
                else:
                    latest = self.last_published.version if self.last_published else 0
                    self.pool.on_hello(peer, latest_version=latest)
                    if self.last_published is not None:
                        # A late joiner (a replacement) must load the current weights before it serves.
                        await self.send_to(ctrl, peer, self.last_published)
                    await self.dispatch(ctrl)
            case TasksDone() if not is_learner:
                for item in msg.items:  # a bad item is rejected alone, as it was in its own message
                    try:
                        self.task_done(child, item)
                    except ValueError as exc:
                        ctrl.reject(f"protocol violation: {exc}")
            case WeightsPublished() if is_learner:
                self.last_published = msg
                self.write_record("publish", msgspec.to_builtins(msg))
                for inc in self.pool.said_hello():
                    await self.send_to(ctrl, inc.peer_id, msg)
            case WeightsLoaded() if not is_learner:
                inc = self.pool.on_loaded(peer, msg.version)
                self.state.loaded_versions[inc.slot] = msg.version
                self.write_record("loaded", msgspec.to_builtins(msg))
                # The learner knows slots, not processes: its retention pins versions per slot.
                await self.send_to(ctrl, "learner", msgspec.structs.replace(msg, generator_id=inc.slot))
                await self.dispatch(ctrl)
            case StepDone() if is_learner:
                self.on_step(msg)
            case GroupsLeft() if is_learner and self.pool_mode:
                try:
                    self.book.evicted_pool(msg.evicted)
                except ValueError as exc:  # a bookkeeping bug must show in the log, not stop training
                    log.error("ledger: %s", exc)
                self.admission.release(len(msg.released), version=msg.version)
                self.write_record("left", msgspec.to_builtins(msg))
                await self.dispatch(ctrl)
            case Metrics():
                self.state.metrics.update(msg.values)
                self.write_record("metrics", {"source": msg.source, **msg.values})
            case Heartbeat():
                pass
            case Fatal():
                # The traceback is in the child's log; the user gets the reason and where to look.
                if is_learner:
                    self.fail(f"{child.role} {msg.peer_id} failed: {msg.error} (details: {child.log_path})")
                else:
                    # Supervision kills it if it has not exited, and restarts it (or, past its
                    # budget, ends the run).
                    child.last_error = f"{msg.error} (details: {child.log_path})"
                    self.event(f"generator {peer} failed: {msg.error}")
            case _:
                raise ValueError(f"{type(msg).__name__} from {child.role} {peer} is not expected")

    def task_done(self, child: Child, msg: TaskDone) -> None:
        self.book.done(msg.task_id, child.peer_id)
        child.outstanding -= 1
        self.state.groups_in_flight -= 1
        self.state.trajectories_generated += msg.num_trajectories
        self.state.tokens_generated += msg.num_tokens
        self.write_record("task", msgspec.to_builtins(msg))

    def on_step(self, msg: StepDone) -> None:
        st = self.state
        st.step = msg.step + 1
        st.policy_version = msg.version
        st.trajectories_trained += msg.num_trajectories
        st.max_staleness = max(st.max_staleness, msg.max_staleness)
        st.last_reward = msg.mean_reward
        st.last_loss = msg.loss
        st.last_clip_fraction = msg.clip_fraction
        st.rewards.append(msg.mean_reward)
        record = msgspec.to_builtins(msg)
        record["samples_per_s"] = st.trajectories_trained / max(1e-9, st.elapsed_s)
        self.write_record("step", record)
        if msg.step + 1 >= self.cfg.learner.steps:
            self.finished.set()
        try:
            if self.pool_mode:
                self.book.trained_pool(msg.step, trained=msg.groups_trained, replayed=msg.groups_replayed)
            else:
                self.book.trained(msg.step)
        except ValueError as exc:  # a bookkeeping bug must show in the ledger, not stop training
            log.error("ledger: %s", exc)
        every = self.cfg.run.checkpoint_every
        if msg.step + 1 >= self.cfg.learner.steps or (every and msg.version % every == 0):
            # The learner wrote its half for this version before sending StepDone.
            self.save_checkpoint()

    def save_checkpoint(self) -> None:
        from asyncrl.scheduler.checkpoint import save_launcher_checkpoint

        try:
            save_launcher_checkpoint(self.run_dir, self.admission, self.book)
        except OSError as exc:
            log.error("launcher checkpoint not written: %s", exc)

    # ------------------------------------------------------------------ main
    async def wait_ready(self, peers: list[str], recv) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while not all(self.children[p].ready for p in peers):
            if self.finished.is_set():
                return
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                slow = [p for p in peers if not self.children[p].ready]
                self.fail(
                    f"{', '.join(slow)} did not say Hello within {STARTUP_TIMEOUT_S:.0f} s; see {self.run_dir / 'logs'}"
                )
                return
            await recv(remaining)

    async def wait_until(self, ready: Callable[[], bool], recv) -> None:
        """Handle messages until `ready()`; supervision bounds the wait (restarts, budget)."""
        while not ready() and not self.finished.is_set():
            await recv(1.0)

    async def run(self) -> RunState:
        from transformers import AutoTokenizer

        self._tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        if self.resume_version:
            self.readmit_checkpointed()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self.interrupt)
        zctx = zmq.Context()
        ctrl = Endpoint(zctx, zmq.ROUTER, name="launcher.ctrl", accept=CONTROL_ACCEPT)
        address = ctrl.bind_loopback()
        self.ctrl_address = address
        inbox: asyncio.Queue = asyncio.Queue()
        inline = False  # training: `receive` handles each message itself (no queue, no futures)

        async def receive() -> None:
            while True:
                item = await ctrl.recv()
                if inline and not self.finished.is_set():
                    await self.on_message(ctrl, item[0], item[1])
                else:
                    inbox.put_nowait(item)

        async def recv_one(timeout_s: float) -> None:
            if not inbox.empty():  # one is queued: no futures, no timer (a message per group)
                sender, msg, _ = inbox.get_nowait()
                await self.on_message(ctrl, sender, msg)
                return
            getter = asyncio.ensure_future(inbox.get())
            stop = asyncio.ensure_future(self.finished.wait())
            done, _ = await asyncio.wait(
                {getter, stop}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED
            )
            stop.cancel()
            if getter in done:
                sender, msg, _ = getter.result()
                await self.on_message(ctrl, sender, msg)
            else:
                getter.cancel()

        receiver = asyncio.create_task(receive(), name="launcher-recv")
        supervisor = asyncio.create_task(self.supervise(ctrl), name="launcher-supervise")
        try:
            # --- monitor setup: PUB socket on loopback (<run>/monitor.json), sinks, event/snapshot records
            from asyncrl.monitor.stream import open_hub

            self.monitor_hub = open_hub(self, zctx)
            self.state.phase = "starting learner"
            self.reporter.update(self.state)
            common = {"model": str(self.model_path)}
            self.spawn(
                "learner",
                "learner",
                "asyncrl.learner.service",
                address,
                {
                    **common,
                    "generators": ",".join(self.generator_ids),
                    "resume_version": str(self.resume_version),
                },
            )
            await self.wait_ready(["learner"], recv_one)
            if not self.finished.is_set():
                self.state.phase = "starting generators"
                self.reporter.update(self.state)
                for g in self.generator_ids:
                    self.spawn_generator(self.pool.start(g))
                await self.wait_until(self.pool.all_serving, recv_one)
            if not self.finished.is_set():
                self.state.phase = "training"
                self.state.started = time.perf_counter()
                await self.dispatch(ctrl)
                while not inbox.empty() and not self.finished.is_set():  # in arrival order
                    await recv_one(0.0)
                inline = True
                stop = asyncio.ensure_future(self.finished.wait())
                await asyncio.wait({receiver, stop}, return_when=asyncio.FIRST_COMPLETED)
                stop.cancel()
                if receiver.done():
                    receiver.result()  # a handler's error ends the run as before
            self.state.phase = "stopping"
            self.reporter.update(self.state)
        finally:
            self.finished.set()
            await self.stop_children(ctrl)
            if self.book.num_steps_trained > self.resume_version and self.state.step < self.cfg.learner.steps:
                self.save_checkpoint()  # stopped early: the learner saved its half on Shutdown
            receiver.cancel()
            supervisor.cancel()
            self.state.rejected_frames = ctrl.num_rejected
            self.rejected_by_reason = dict(ctrl.rejected)
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)
            if self.monitor_hub is not None:  # --- monitor teardown: final snapshot, close PUB
                self.monitor_hub.close()
            ctrl.close()
            # destroy, not term: a socket some code path left open must not block the exit.
            zctx.destroy(linger=0)
            self.metrics_file.close()
        if self.failure is not None:
            raise RunFailed(self.failure)
        return self.state

    def interrupt(self) -> None:
        if not self.interrupted:
            self.interrupted = True
            self.event("interrupted: stopping every process")
        self.finished.set()
