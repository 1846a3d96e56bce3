"""The launcher: the scheduler's imperative shell. It starts and supervises the learner and the
generators, routes control messages, and ends the run cleanly; every decision it acts on is made
in a pure module.

Sockets: one ROUTER bound on cluster.bind_host (loopback by default); every worker connects a
DEALER with its peer id as the ZeroMQ identity. Flow:
  learner Hello(endpoint) -> start generators -> generator Hellos -> dispatch PromptTasks
  WeightsPublished (learner) -> every generator;  WeightsLoaded (generator) -> learner, dispatch
  StepDone (learner) -> records, reporter, task book, checkpoint; the last one ends the run.
Where the decisions are:
  dispatch.py     which re-queued and newly admitted tasks go to which generator
  modes.py        window or pool admission (`buffer.mode`), chosen once
  supervision.py  which generator process serves each slot, restart budget
  tasks.py        open tasks, the re-queue, the ledger;  checkpoint.py  the launcher's half
  spawner.py      how a worker is started and stopped;  children.py  whether it is healthy
  remote.py       slots served by workers that join from other hosts (Join, files)
  workers.py      the workers this launcher started (spawn, retire, stop)
  records.py      metrics.jsonl, the reporter, the monitor's `launcher` snapshot
  inbox.py        how messages from the socket reach `on_message`
Supervision: a generator that exits, raises, or falls silent past monitor.heartbeat_timeout_s is
killed (that worker only) and restarted under a new peer id; the replacement is sent the last
WeightsPublished and gets tasks once it has loaded it; the dead one's in-flight tasks are
re-queued exactly once, to whichever generator serves first. Past generators.max_restarts for one
generator, or when the learner exits, raises or hangs, the run fails with a message naming the
process, the reason and its log.
Shutdown: on completion, Ctrl-C, or a failure, every worker gets Shutdown, then SIGTERM, then
SIGKILL after a grace period; only workers this launcher started are signalled.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import signal
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import msgspec
import zmq

from asyncrl.config import Config
from asyncrl.messages import (
    PROTOCOL_VERSION,
    BroadcastPublished,
    DataEndpoint,
    EvalDue,
    Evaluated,
    Fatal,
    GroupsLeft,
    Heartbeat,
    Hello,
    Join,
    JoinRefused,
    LauncherSnapshot,
    LearnerMetrics,
    Metrics,
    PromptTasks,
    ShardsPublished,
    Shutdown,
    StepDone,
    TaskDone,
    TasksDone,
    WeightsLoaded,
    WeightsPublished,
    WorkerArgs,
    join_endpoints,
    service_teachers,
)
from asyncrl.models.hf import prompt_room
from asyncrl.scheduler.canary import canary_for_run
from asyncrl.scheduler.checkpoint import checkpoint_due, read_launcher_checkpoint, save_launcher_checkpoint
from asyncrl.scheduler.children import Child, health
from asyncrl.scheduler.connections import ConnectionWatch
from asyncrl.scheduler.dispatch import Dispatcher
from asyncrl.scheduler.evals import BackgroundEvals
from asyncrl.scheduler.hedge import HedgeBook
from asyncrl.scheduler.inbox import Inbox
from asyncrl.scheduler.modes import make_mode
from asyncrl.scheduler.records import (
    Records,
    RecordStream,
    Reporter,
    RunState,
    launcher_snapshot,
    read_records,
)
from asyncrl.scheduler.remote import JoinDesk
from asyncrl.scheduler.spawner import ForkSpawner, JoinSpawner, LocalSpawner, Spawner
from asyncrl.scheduler.supervision import GeneratorPool, Incarnation, RestartBudgetExceeded
from asyncrl.scheduler.tasks import TaskBook, stall_reason
from asyncrl.scheduler.workers import TEACHER_PEER, Workers
from asyncrl.tasks.base import Task
from asyncrl.transport import security, zap
from asyncrl.transport.zmq_io import Endpoint

log = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 120.0
EVAL_DRAIN_S = 300.0  # a completed run waits this long at most for its last background evaluations
POLL_S = 0.2
# What the launcher's control socket accepts from workers; any other type is rejected and counted.
CONTROL_ACCEPT = (
    Hello,
    EvalDue,
    Evaluated,
    TasksDone,
    WeightsPublished,
    WeightsLoaded,
    StepDone,
    GroupsLeft,
    Metrics,
    Heartbeat,
    Fatal,
    Join,
)

# Opens the monitor's record stream on the launcher's zmq.Context (the app layer wires it).
OpenStream = Callable[[zmq.Context], RecordStream]


class RunFailed(RuntimeError):
    """A worker failed; the message says which and why."""


class Launcher:
    def __init__(
        self,
        config: Config,
        run_dir: Path,
        model_path: Path,
        reporter: Reporter,
        *,
        task: Task,
        tokenizer: Any,
        resume_version: int = 0,
        role_modules: Mapping[str, str] | None = None,
        spawner: Spawner | None = None,
        open_stream: OpenStream | None = None,
    ) -> None:
        """`task` and `tokenizer`: the run's task, prepared and checked by the caller once, before
        any process starts (`asyncrl.job.load_task`), and the tokenizer that renders its prompts."""
        self.cfg = config
        self.run_dir = run_dir
        self.model_path = model_path
        self.open_stream = open_stream
        self.state = RunState(
            total_steps=config.learner.steps, max_staleness_bound=config.effective_max_staleness
        )
        self.task = task
        # Resuming at version v: groups [0, v*B) were trained; the later ones the interrupted run
        # had admitted are admitted again (`readmit_checkpointed`); the learner keeps the
        # trajectories its checkpoint held and drops their copies.
        self.resume_version = resume_version
        self.mode = make_mode(config, resume_version=resume_version)
        self.state.lengths.tracks_groups = not self.mode.trains_every_admitted_sample  # the pool evicts
        self.generator_ids = [f"gen-{i}" for i in range(config.generators.num_generators)]
        self.pool = GeneratorPool(self.generator_ids, max_restarts=config.generators.max_restarts)
        self.book = TaskBook.for_run(config)
        self.book.num_steps_trained = resume_version
        self.state.step = self.state.policy_version = resume_version
        self.dispatcher = Dispatcher.for_run(
            config,
            book=self.book,
            mode=self.mode,
            task=self.task,
            tokenizer=tokenizer,
            room=prompt_room(model_path, config.sampling.max_new_tokens),
        )
        self.last_published: WeightsPublished | None = None
        self.saved_version = -1  # the version of the last launcher checkpoint written
        # The weight-load canary (canary.py): built once from the task, judged at every ack.
        self.canary_ids, self.canary = canary_for_run(config, task, tokenizer)
        self.ctrl_address = ""
        # opd.placement = "service": the shared teachers' workers and addresses, by teacher name.
        self.teachers: dict[str, Child] = {}
        self.teacher_endpoints: dict[str, str] = {}
        self.rejected_by_reason: dict[str, int] = {}
        self.learner_endpoint = ""
        # The learner's held-out evaluations (`Config.evaluates_in_learner`): phase -> (accuracy, means).
        self.evaluations: dict[str, tuple[float, dict[str, float]]] = {}
        self.finished = asyncio.Event()
        self.failure: str | None = None
        self.learner_lost = False  # the failure is the learner's death (run.recover_learner may act)
        self.interrupted = False
        self.records = Records(
            run_dir / "metrics.jsonl",
            reporter,
            launched=self.state.launched,
            snapshot_s=config.monitor.snapshot_s,
            snapshot=self.snapshot,
        )
        self.remote: JoinDesk | None = None  # generators.remote > 0: slots served by workers that join
        self.workers = Workers(self.make_spawner(spawner), role_modules, self.records)
        self.children = self.workers.children  # peer id -> a live worker
        self.evals = self.background_evals() if config.eval.every else None
        # Stragglers' tasks sent to a second generator (hedge.py; generators.hedge_factor).
        self.hedging = HedgeBook(factor=config.generators.hedge_factor, min_s=config.generators.hedge_min_s)
        # Failure detection on the control socket's connections (connections.py, liveness.py).
        self.connections = ConnectionWatch(
            connection_timeout_s=config.monitor.connection_timeout_s,
            reconnect_grace_s=config.monitor.reconnect_grace_s,
        )

    def make_spawner(self, spawner: Spawner | None) -> Spawner:
        """The caller's spawner, or the run's: forked or fresh processes; the learner's ranks
        left to torchrun; remote slots through the join desk (`self.remote`)."""
        config, run_dir = self.cfg, self.run_dir
        if spawner is None:
            spawner = ForkSpawner(run_dir) if config.run.spawn == "fork" else LocalSpawner(run_dir)
        if config.learner.start == "torchrun":  # the learner's ranks join; the launcher starts none
            spawner = JoinSpawner(spawner, run_dir, joined=frozenset({"learner"}))
        if config.generators.remote:
            slot_of = lambda peer: getattr(self.pool.get(peer), "slot", "")  # noqa: E731
            self.remote = JoinDesk(
                config, spawner, self.records, slot_of, model_path=self.model_path, run_dir=run_dir
            )
            spawner = self.remote.spawner
        return spawner

    def on_eval_result(self, result: dict) -> None:
        self.records.write("eval", result)
        passes = ", ".join(f"pass@{k} {v:.3f}" for k, v in result.get("pass_at_k", {}).items() if k != "1")
        self.records.event(
            f"held-out accuracy at version {result['version']}: {result['accuracy']:.3f}"
            + (f" ({passes})" if passes else "")
        )

    def background_evals(self) -> BackgroundEvals:
        """`eval.every`: the evaluator processes; a resumed run's curve so far comes back from its
        records."""
        evals = BackgroundEvals(
            self.run_dir,
            max_pending=self.cfg.eval.max_pending,
            nice=self.cfg.eval.nice,
            idle_class=self.cfg.eval.idle_class,
            on_result=self.on_eval_result,
            on_event=self.records.event,
        )
        if self.resume_version:
            evals.restore(read_records(self.run_dir / "metrics.jsonl", "eval"), up_to=self.resume_version)
        return evals

    # ------------------------------------------------------------------ workers
    def spawn_generator(self, inc: Incarnation) -> Child:
        args = WorkerArgs(
            model=str(self.model_path),
            data=self.learner_endpoint,
            index=inc.index,
            teacher=join_endpoints(self.teacher_endpoints),
        )
        child = self.workers.spawn(inc.peer_id, "generator", ctrl_address=self.ctrl_address, args=args)
        child.slot = inc.slot
        return child

    async def supervise(self, ctrl: Endpoint) -> None:
        """A generator that exits or falls silent is restarted; a learner that does fails the run."""
        timeout_s = self.cfg.monitor.heartbeat_timeout_s
        while not self.finished.is_set():
            if self.remote is not None and (overdue := self.remote.tick()):
                self.fail(overdue)
                return
            await self.retire_lost(ctrl)
            await self.hedge_stragglers(ctrl)
            for child in list(self.children.values()):
                if child.stopping or self.finished.is_set() or not getattr(child.handle, "joined", True):
                    continue  # (a remote slot waiting for a worker: bounded by remote.overdue above)
                startup_s = (
                    self.cfg.learner.startup_timeout_s if child.role == "learner" else STARTUP_TIMEOUT_S
                )
                if getattr(child.handle, "remote", False):  # from the join: the model comes over the network
                    startup_s = max(startup_s, self.cfg.generators.remote_join_timeout_s)
                reason = health(child, heartbeat_timeout_s=timeout_s, startup_timeout_s=startup_s)
                if reason is None:
                    continue
                if child.role != "generator":
                    self.learner_lost = child.role == "learner"
                    self.fail(f"{child.role} {child.peer_id} {reason}{self.resume_hint()}")
                    return
                await self.restart_generator(ctrl, child, reason)
            self.report_rejected(ctrl)
            self.check_stalled()
            await asyncio.sleep(POLL_S)  # polling worker exit status; no message to wait for

    async def retire_lost(self, ctrl: Endpoint) -> None:
        """Generators whose connection is gone past monitor.reconnect_grace_s (liveness.py): their
        process or host died, or the network between: retired now, not after the heartbeat timeout."""
        self.connections.poll()
        for peer, gone_s in self.connections.lost():
            child = self.children.get(peer)
            if child is None or child.role != "generator" or child.stopping or not child.ready:
                self.connections.forget(peer)
                continue
            timeout_s = self.cfg.monitor.connection_timeout_s
            await self.restart_generator(
                ctrl,
                child,
                f"lost its connection {gone_s:.1f} s ago: its process or host died or the network to it "
                f"is gone (declared lost {self.cfg.monitor.reconnect_grace_s:g} s after its connection closed; "
                f"a silent connection closes after monitor.connection_timeout_s = {timeout_s:g})",
                lost_after_s=gone_s,
            )

    async def hedge_stragglers(self, ctrl: Endpoint) -> None:
        """Tasks outstanding far beyond what their peers take go to a second generator (hedge.py)."""
        if not self.hedging.enabled or self.state.phase != "training" or self.finished.is_set():
            return
        serving = {
            inc.peer_id: self.dispatcher.outstanding.get(inc.peer_id, 0) for inc in self.pool.serving()
        }
        for task_id, peer, to in self.hedging.due(time.monotonic(), serving):
            task = self.dispatcher.hedge(task_id, to)
            self.records.write("hedge", {"task_id": task_id, "peer_id": peer, "hedge_peer_id": to})
            self.records.event(f"task {task_id} outstanding on {peer} far beyond its peers: sent to {to} too")
            await self.send_to(ctrl, to, PromptTasks(tasks=[task]))

    def resume_hint(self) -> str:
        """The line a failure ends with: how to go on from the last checkpoint."""
        return f"\nTo go on from its last checkpoint: asyncrl launch --resume {self.run_dir}"

    def report_rejected(self, ctrl: Endpoint) -> None:
        """A `rejected` record whenever the control socket's rejection count has changed."""
        if ctrl.num_rejected != self.state.rejected_frames:
            self.state.rejected_frames = ctrl.num_rejected
            self.records.write("rejected", {"socket": ctrl.name, "num_rejected": ctrl.num_rejected})
        # Connections refused by CURVE/ZAP in this process (a peer without the run's key; issue #23).
        refused = zap.num_auth_failures()
        if refused != self.state.auth_failures:
            self.state.auth_failures = refused
            self.records.write("refused", {"num_refused": refused, "by_reason": zap.auth_failures()})

    async def restart_generator(
        self, ctrl: Endpoint, child: Child, reason: str, *, lost_after_s: float | None = None
    ) -> None:
        """Kill `child` (that worker only), re-queue its in-flight tasks once, start its replacement.

        The bookkeeping happens before the first await, so no dispatch can pick the dead worker.
        """
        self.pool.died(child.peer_id)
        requeued = self.dispatcher.generator_failed(child.peer_id)
        if passed := self.hedging.generator_failed(child.peer_id, requeued):
            self.dispatcher.pass_to(passed)  # their hedges run them already
            requeued = [t for t in requeued if t not in passed]
        self.state.tasks_requeued += len(requeued)
        self.connections.forget(child.peer_id)
        await self.workers.retire(child)
        if self.remote is not None and self.remote.drops(child, reason, num_requeued=len(requeued)):
            if not self.pool.live():
                self.fail(f"generator {child.slot} {reason}\nNo generator is left, so the run stops.")
            await self.dispatch(ctrl)
            return
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
        self.records.write(
            "restart",
            {
                "slot": child.slot,
                "peer_id": child.peer_id,
                "pid": child.handle.pid,
                "new_peer_id": inc.peer_id,
                "reason": headline,
                "requeued": requeued,
                "generator_restarts": self.pool.num_restarts,
                **({} if lost_after_s is None else {"lost_after_s": round(lost_after_s, 3)}),
            },
        )
        self.records.event(
            f"generator {child.peer_id} {headline}; restarting it as {inc.peer_id} "
            f"(restart {inc.restart} of {self.pool.max_restarts}), {len(requeued)} tasks re-queued"
        )
        self.spawn_generator(inc)
        await self.offer_slots(ctrl)  # a remote slot: to a worker that waits for one, at once
        await self.dispatch(ctrl)  # the re-queued tasks can go to generators still serving

    async def offer_slots(self, ctrl: Endpoint) -> None:
        """Remote slots waiting for a worker go to the workers waiting for a slot (remote.py)."""
        if self.remote is None:
            return
        for identity, welcome, handles in await self.remote.offers(self.children):
            if not await self.send_to(ctrl, identity, welcome):
                self.remote.undelivered(identity, handles)
        self.state.waiting_workers = len(self.remote.waiting_workers)

    def fail(self, reason: str) -> None:
        if self.failure is None:
            self.failure = reason
        self.finished.set()

    async def stop_workers(self, ctrl: Endpoint) -> None:
        shutdown = Shutdown(reason="run finished" if self.failure is None else "run failed")
        if self.remote is not None:  # workers still waiting for a slot: there will be none
            for identity in self.remote.ended():
                await self.send_to(
                    ctrl, identity, JoinRefused(reason=f"the run has ended ({shutdown.reason})")
                )
        await self.workers.stop(lambda child: self.send_to(ctrl, child.peer_id, shutdown))

    # ------------------------------------------------------------------ tasks
    async def send_to(self, ctrl: Endpoint, peer_id: str, msg) -> bool:
        """Send to one worker. A worker that is gone (or never connected) is not an error here:
        supervision sees its exit and decides; the message is logged as undeliverable."""
        try:
            await ctrl.send(msg, to=peer_id.encode())
            return True
        except zmq.ZMQError as exc:
            log.warning("could not deliver %s to %s: %s", type(msg).__name__, peer_id, exc)
            child = self.children.get(peer_id)
            if exc.errno == zmq.EHOSTUNREACH and child is not None and child.ready:
                self.connections.unreachable(peer_id)  # evidence: no connection for it now
            return False

    async def dispatch(self, ctrl: Endpoint) -> None:
        """Send each serving generator its share of the dispatcher's plan, one message each."""
        if self.state.phase != "training" or self.finished.is_set():
            return
        loaded = self.pool.min_loaded_version()  # None while none serves: admit nothing
        if loaded is None:
            return
        plan = self.dispatcher.plan(
            loaded_version=loaded, serving=[inc.peer_id for inc in self.pool.serving()]
        )
        self.count_admitted(plan.num_admitted)
        now = time.monotonic()
        for peer, tasks in plan.by_peer.items():
            for task in tasks:
                self.hedging.dispatched(task.task_id, peer, now)
            await self.send_to(ctrl, peer, PromptTasks(tasks=tasks))

    def count_admitted(self, num_groups: int) -> None:
        self.state.groups_admitted += num_groups
        self.state.groups_in_flight += num_groups

    def readmit_checkpointed(self) -> None:
        """Resume: admit again, before the learner starts, every group the interrupted run had
        admitted and not trained (re-queued for the generators). The learner may hold whole
        windows of them from its checkpoint and train those steps before any generator is up;
        their StepDone must find the groups in the book."""
        saved = read_launcher_checkpoint(self.run_dir, self.resume_version)
        now, then = self.task_fingerprint(), saved.get("task_fingerprint", "")
        if now and then and now != then:
            raise ValueError(
                f"the training data of {self.run_dir} changed since its checkpoint (fingerprint {then}, now "
                f"{now}): its dataset position would name other prompts; restore {self.cfg.task.dataset.path} "
                "as it was, or start a new run"
            )
        if saved.get("selection") is not None:
            where = f"the launcher checkpoint of version {self.resume_version} in {self.run_dir}"
            self.dispatcher.selection.restore(saved["selection"], where=where)
        tasks = self.dispatcher.readmit(saved, resume_version=self.resume_version)
        self.count_admitted(len(tasks))

    # ------------------------------------------------------------------ messages
    async def on_message(self, ctrl: Endpoint, sender: bytes, msg) -> None:
        peer = sender.decode(errors="replace")
        child = self.children.get(peer)
        if child is None:
            if isinstance(msg, Join) and self.remote is not None:  # a worker on another host
                reply = await self.remote.on_join(msg, self.children, peer)
                if reply is not None:
                    await self.send_to(ctrl, peer, reply)
                self.state.waiting_workers = len(self.remote.waiting_workers)
            elif self.pool.is_retired(peer):
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
            # A worker breaking the protocol (a TaskDone for a task it does not run, a second
            # Hello): the message is rejected and counted; supervision still watches the worker.
            ctrl.reject(f"protocol violation: {exc}")
        self.records.update(self.state)

    async def handle(self, ctrl: Endpoint, child: Child, msg) -> None:
        """One message from a live worker; ValueError for one that breaks the protocol."""
        peer = child.peer_id
        is_learner = child.role == "learner"
        match msg:
            case Hello():
                await self.on_hello(ctrl, child, msg)
            case TasksDone() if not is_learner:
                for item in msg.items:  # a bad item is rejected alone, as it was in its own message
                    try:
                        self.on_task_done(child, item)
                    except ValueError as exc:
                        ctrl.reject(f"protocol violation: {exc}")
            case ShardsPublished() | BroadcastPublished() if is_learner:  # the WeightsPublished variants
                self.last_published = msg
                self.canary.on_published(msg.version, msg.canary.logprobs if msg.canary else None)
                fields = {k: v for k, v in msgspec.to_builtins(msg).items() if k != "canary"}
                self.records.write("publish", {**fields, "transport": msg.transport})
                for inc in self.pool.said_hello():
                    await self.send_to(ctrl, inc.peer_id, msg)
            case WeightsLoaded() if not is_learner:
                if not await self.on_canary(ctrl, child, msg):
                    return  # refused: the generator is restarted (or the run fails)
                inc = self.pool.on_loaded(peer, msg.version)
                self.state.loaded_versions[inc.slot] = msg.version
                self.records.write(
                    "loaded", {k: v for k, v in msgspec.to_builtins(msg).items() if k != "canary"}
                )
                # The learner knows slots, not processes: its retention pins versions per slot.
                await self.send_to(ctrl, "learner", msgspec.structs.replace(msg, generator_id=inc.slot))
                await self.dispatch(ctrl)
            case Evaluated() if is_learner:
                self.evaluations[msg.phase] = (msg.accuracy, dict(msg.means))
                self.records.event(
                    f"held-out accuracy {msg.phase} training: {msg.accuracy:.3f}",
                    held_out={"phase": msg.phase, "accuracy": msg.accuracy, "rewards": dict(msg.means)},
                )
            case EvalDue() if is_learner:
                if self.evals is None:
                    raise ValueError(f"EvalDue for version {msg.version} with eval.every = 0")
                self.evals.submit(msg)
            case StepDone() if is_learner:
                self.on_step_done(msg)
            case GroupsLeft() if is_learner:
                self.mode.on_groups_left(self.book, msg)  # ValueError when not in pool mode
                # Dropped groups are settled as trained ones are: a resume does not admit them again.
                self.dispatcher.selection.trained(g for groups in msg.evicted.values() for g in groups)
                self.state.lengths.evicted(msg.evicted)
                self.state.lengths.forget(msg.released)
                self.records.write("left", msgspec.to_builtins(msg))
                await self.dispatch(ctrl)
            case Metrics():
                if isinstance(msg.record, LearnerMetrics):
                    if not is_learner:
                        raise ValueError(f"learner metrics from {child.role} {peer}")
                    self.state.learner_metrics = msg.record
                values = msg.values
                self.dispatcher.selection.observe_metrics(values)  # domain_gap: the gap per domain
                self.records.write("metrics", {"source": msg.source, **values})
            case Heartbeat():
                pass
            case Fatal():
                # The traceback is in the worker's log; the user gets the reason and where to look.
                if is_learner:
                    self.learner_lost = True
                    self.fail(
                        f"{child.role} {msg.peer_id} failed: {msg.error} (details: {child.log_path})"
                        + self.resume_hint()
                    )
                else:
                    # Supervision kills it if it has not exited, and restarts it (or, past its
                    # budget, ends the run).
                    child.last_error = f"{msg.error} (details: {child.log_path})"
                    self.records.event(f"{child.role} {peer} failed: {msg.error}")
            case _:
                raise ValueError(f"{type(msg).__name__} from {child.role} {peer} is not expected")

    async def on_canary(self, ctrl: Endpoint, child: Child, msg: WeightsLoaded) -> bool:
        """Judge an ack by its canary (canary.py); True = accepted, and the generator is told (it
        sends nothing sampled with the version before). A refused version is not taken as loaded:
        the generator is restarted and loads it afresh; refused too often, the run fails."""
        if not self.canary_ids:  # weights.canary = false: nothing to judge, nothing to record
            return True
        verdict = self.canary.on_loaded(child.slot, msg.version, msg.canary)
        self.records.write("canary", verdict.record)
        if not verdict.refused:
            if msg.canary:  # the generator holds what it sampled with the version until told
                await self.send_to(
                    ctrl, child.peer_id, WeightsLoaded(generator_id=child.peer_id, version=msg.version)
                )
            return True
        reason = (
            f"failed the weight-load canary at weights version {msg.version}: mean |delta log-prob| "
            f"{verdict.worst.mean_abs:.3g} on {verdict.engine}, tolerance {self.canary.tolerance:g} ({self.canary.dtype})"
        )
        if verdict.fail:
            self.records.event(f"generator {child.peer_id} {reason}")
            self.fail(verdict.fail)
            return False
        await self.restart_generator(ctrl, child, reason)
        return False

    async def on_hello(self, ctrl: Endpoint, child: Child, msg: Hello) -> None:
        """The handshake: a worker speaking another protocol version fails the run; the teacher's
        and the learner's Hello bring their endpoints (generators learn the learner's); a
        generator gets the current weights and then tasks."""
        peer = child.peer_id
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
        if child.role == "teacher":
            name = next(n for n, c in self.teachers.items() if c is child)
            self.teacher_endpoints[name] = msg.endpoint
        elif child.role == "learner":
            self.learner_endpoint = msg.endpoint
            if msg.note:
                self.records.event(msg.note)
            # Generators start with the learner, before its endpoint is known.
            for inc in self.pool.said_hello():
                await self.send_to(ctrl, inc.peer_id, DataEndpoint(endpoint=msg.endpoint))
        else:
            if self.learner_endpoint:
                await self.send_to(ctrl, peer, DataEndpoint(endpoint=self.learner_endpoint))
            latest = self.last_published.version if self.last_published else 0
            self.pool.on_hello(peer, latest_version=latest)
            if self.last_published is not None:
                # A late joiner (a replacement) must load the current weights before it serves.
                await self.send_to(ctrl, peer, self.last_published)
            await self.dispatch(ctrl)

    def on_task_done(self, child: Child, msg: TaskDone) -> None:
        copy = self.hedging.copy_of(msg.task_id, child.peer_id)
        if copy == "wasted":  # a hedged task's other copy finished first; its samples were dropped
            self.dispatcher.release(child.peer_id)
            self.hedging.wasted_done(msg.task_id, child.peer_id, msg.num_trajectories)
            self.records.write("hedge_wasted", {"task_id": msg.task_id, "peer_id": child.peer_id})
            return
        task = self.dispatcher.done(msg.task_id, child.peer_id, hedge=copy == "hedge", result=msg)
        self.resave_checkpoint(task.window)
        if (loser := self.hedging.done(msg.task_id, child.peer_id, time.monotonic())) is not None:
            self.records.write(
                "hedge_done", {"task_id": msg.task_id, "winner": child.peer_id, "loser": loser}
            )
        self.state.task_done(msg, child.peer_id)
        self.records.write("task", {**msgspec.to_builtins(msg), "dataset_index": task.dataset_index})
        scoring = self.cfg.task.scoring
        tally = self.state.rewards_tally
        if reason := tally.over_budget(scoring.failure_budget, scoring.failure_budget_min_samples):
            self.fail(reason)

    def check_stalled(self) -> None:
        """No silent stalls (`tasks.stall_reason`): the run stops, resumably, naming what it waits for."""
        live = [inc.peer_id for inc in self.pool.live()]
        timeout_s = self.cfg.monitor.stall_timeout_s
        if reason := stall_reason(self.state, self.book, live, timeout_s=timeout_s, now=time.monotonic()):
            self.fail(
                f"{reason}. `asyncrl launch --resume {self.run_dir}` continues from the last checkpoint"
            )

    def on_step_done(self, msg: StepDone) -> None:
        record = self.state.step_done(msg)
        decision = self.mode.on_step_done(self.book, msg)
        # The bound admission applies from now on (staleness.max_staleness = "auto" moves it).
        self.state.max_staleness_bound = record["staleness_bound"] = self.mode.admission.max_staleness
        self.dispatcher.selection.trained(self.trained_groups(msg))
        record.update(self.dispatcher.selection.step_fields())  # the per-prompt record's summary
        self.records.write("step", record)
        for note in (msg.note, decision):
            if note:
                self.records.event(note)
        total_steps = self.cfg.learner.steps
        if msg.step + 1 >= total_steps:
            self.finished.set()
        if checkpoint_due(
            msg.step, msg.version, total_steps=total_steps, every=self.cfg.run.checkpoint_every
        ):
            self.save_checkpoint()  # the learner wrote its half for this version before StepDone

    def task_fingerprint(self) -> str:
        fingerprint = getattr(self.task, "fingerprint", None)
        return fingerprint() if fingerprint is not None else ""

    def trained_groups(self, msg: StepDone) -> list[int]:
        """The groups StepDone(msg.step) trained (window mode: the step's own)."""
        if self.mode.trains_every_admitted_sample:
            b = self.cfg.learner.groups_per_step
            return list(range(msg.step * b, (msg.step + 1) * b))
        return [*msg.groups_trained]

    def save_checkpoint(self) -> None:
        try:
            save_launcher_checkpoint(
                self.run_dir,
                self.mode.admission,
                self.book,
                task_fingerprint=self.task_fingerprint(),
                selection=self.dispatcher.selection.state(),
            )
            self.saved_version = self.book.num_steps_trained
        except OSError as exc:
            log.error("launcher checkpoint not written: %s", exc)

    def resave_checkpoint(self, window: int) -> None:
        """A TaskDone of a step already trained, after its checkpoint was written (the learner's
        StepDone can overtake a generator's TaskDone): the checkpoint is written again, so that it
        holds that group's rewards in the per-prompt record, and a resume restores the record the
        uninterrupted run has (window mode; the write is atomic, the file stays that version's)."""
        if (
            self.mode.trains_every_admitted_sample
            and window < self.book.num_steps_trained == self.saved_version
            and not self.finished.is_set()
        ):
            self.save_checkpoint()

    def snapshot(self, final: bool = False) -> LauncherSnapshot:
        return launcher_snapshot(
            self.cfg,
            self.state,
            self.mode,
            generator_slots=self.generator_ids,
            failure=self.failure,
            interrupted=self.interrupted,
            final=final,
        )

    # ------------------------------------------------------------------ main
    async def run(self) -> RunState:
        """Start every worker, train until the last StepDone (or a failure, or Ctrl-C), stop
        them all; RunFailed names a failure."""
        if self.resume_version:
            self.readmit_checkpointed()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self.interrupt)
        zctx = zmq.Context()
        ctrl = self.open_control(zctx)

        async def on_message(sender: bytes, msg) -> None:
            await self.on_message(ctrl, sender, msg)

        inbox = Inbox(ctrl, on_message, self.finished)
        receiver = asyncio.create_task(inbox.receive(), name="launcher-recv")
        supervisor = asyncio.create_task(self.supervise(ctrl), name="launcher-supervise")
        try:
            # From here on events and `launcher` snapshots are records; the monitor gets them all.
            self.records.open(self.open_stream(zctx) if self.open_stream is not None else None)
            await self.start_workers(inbox)
            if not self.finished.is_set():
                await self.train(ctrl, inbox, receiver)
            self.set_phase("stopping")
        finally:
            self.finished.set()
            await self.stop_workers(ctrl)
            if self.interrupted:
                await self.take_late_messages(ctrl, inbox)
            if self.evals is not None:  # a finished run's last evaluations, a stopped one's none
                await (
                    self.evals.close() if self.failure or self.interrupted else self.evals.drain(EVAL_DRAIN_S)
                )
            if self.book.num_steps_trained > self.resume_version and self.state.step < self.cfg.learner.steps:
                self.save_checkpoint()  # stopped early: the learner saved its half on Shutdown
            receiver.cancel()
            supervisor.cancel()
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)
            self.close_control(zctx, ctrl)
        if self.failure is not None:
            raise RunFailed(self.failure)
        return self.state

    async def take_late_messages(self, ctrl: Endpoint, inbox: Inbox) -> None:
        """Interrupted: what the workers sent while they stopped (above all the StepDone of a step
        the learner finished before its Shutdown came), handled in arrival order, so that the
        launcher's half of the stop's checkpoint is of the version the learner's half is."""
        while not inbox.queue.empty():
            sender, msg, _ = inbox.queue.get_nowait()
            await self.on_message(ctrl, sender, msg)

    def open_control(self, zctx: zmq.Context) -> Endpoint:
        """The control socket, bound (under the run's socket policy), and the join desk's file
        socket when generators may join from other hosts."""
        if security.current() == security.SocketPolicy():  # unless the caller installed one
            security.install_from_config(self.cfg.cluster, role="launcher")
        ctrl = Endpoint(zctx, zmq.ROUTER, name="launcher.ctrl", accept=CONTROL_ACCEPT)
        self.connections.prepare(ctrl)
        self.ctrl_address = ctrl.bind()
        self.connections.attach(ctrl)
        if self.remote is not None:  # its file socket; a remote generator given up on gets Shutdown
            self.remote.start(
                zctx, self.ctrl_address, lambda p: self.send_to(ctrl, p, Shutdown(reason="replaced"))
            )
        return ctrl

    def close_control(self, zctx: zmq.Context, ctrl: Endpoint) -> None:
        """The workers have stopped: the last counts, the final snapshot, every socket closed."""
        if self.remote is not None:
            self.remote.close()
        self.state.rejected_frames = ctrl.num_rejected
        self.rejected_by_reason = dict(ctrl.rejected)
        if self.canary_ids:
            self.records.write("canary_summary", msgspec.to_builtins(self.canary.summary()))
        if self.hedging.enabled:
            self.records.write("hedge_summary", dataclasses.asdict(self.hedging.counts))
        self.records.close()  # the final snapshot; the monitor's stream closes
        self.connections.close()
        ctrl.close()
        # destroy, not term: a socket some code path left open must not block the exit.
        zctx.destroy(linger=0)
        self.records.close_file()

    async def start_workers(self, inbox: Inbox) -> None:
        """The shared teacher (if any) first, then the learner and the generators together, until
        the learner said Hello and every generator serves (or the run failed meanwhile)."""
        self.set_phase("starting learner")
        # The shared teachers first: the generators need them.
        for peer, name in service_teachers(self.cfg.opd, peer=TEACHER_PEER).items():
            self.teachers[name] = self.workers.spawn(
                peer,
                "teacher",
                ctrl_address=self.ctrl_address,
                args=WorkerArgs(model=str(self.model_path), teacher=name),
            )
        learner_args = WorkerArgs(
            model=str(self.model_path),
            generators=tuple(self.generator_ids),
            resume_version=self.resume_version,
            canary_ids=self.canary_ids,
        )
        learner = self.workers.spawn("learner", "learner", ctrl_address=self.ctrl_address, args=learner_args)
        if self.cfg.learner.start == "torchrun":
            self.records.event(
                f"waiting for the learner: torchrun --nproc-per-node {self.cfg.learner.world_size} "
                f"-m asyncrl.learner.torchrun {self.run_dir}"
            )
        # The generators start with the learner (imports and model loads overlap); they get the
        # learner's endpoint once it says Hello, and the shared teacher's on their command line.
        for teacher in self.teachers.values():
            if not await inbox.wait_until(lambda t=teacher: t.ready, timeout_s=STARTUP_TIMEOUT_S):
                self.fail(
                    f"the OPD teacher {teacher.peer_id} did not say Hello within {STARTUP_TIMEOUT_S:.0f} s; "
                    f"see {teacher.log_path}"
                )
                break
        for g in [] if self.finished.is_set() else self.generator_ids:
            self.spawn_generator(self.pool.start(g))
        startup_s = self.cfg.learner.startup_timeout_s
        if not await inbox.wait_until(lambda: learner.ready, timeout_s=startup_s):
            self.fail(
                f"learner did not say Hello within {startup_s:.0f} s (learner.startup_timeout_s); "
                f"see {self.run_dir / 'logs'}"
            )
        if not self.finished.is_set():
            self.set_phase("starting generators")
            await inbox.wait_until(self.pool.all_serving)

    async def train(self, ctrl: Endpoint, inbox: Inbox, receiver: asyncio.Task) -> None:
        """Dispatch, then handle messages as they come until the run is finished; a handler's
        error (from `receiver`) ends the run."""
        self.state.phase = "training"
        self.state.started = time.perf_counter()
        self.state.progressed("training started")
        await self.dispatch(ctrl)
        await inbox.go_inline()
        stop = asyncio.ensure_future(self.finished.wait())
        await asyncio.wait({receiver, stop}, return_when=asyncio.FIRST_COMPLETED)
        stop.cancel()
        if receiver.done():
            receiver.result()

    def set_phase(self, phase: str) -> None:
        self.state.phase = phase
        self.records.update(self.state)

    def interrupt(self) -> None:
        """SIGINT/SIGTERM: stop with a resumable checkpoint. A signal after the last step (the run
        is stopping anyway; SLURM's time-limit warning can land there) leaves the run completed."""
        if self.state.step >= self.cfg.learner.steps:
            return
        if not self.interrupted:
            self.interrupted = True
            self.records.event("interrupted: stopping every process")
        self.finished.set()
