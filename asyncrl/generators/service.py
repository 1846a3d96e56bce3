"""Generator process: the sockets around one `Generator` plugin.

Receives PromptTasks and WeightsPublished from the launcher (DEALER) and puts the tasks in a
feed (`feed.py`) that the generator takes samples from as it has room (`generate_stream`; a
generator with only `generate(tasks)` is served batches of up to generators.max_batch_groups
groups). Rollouts are scored as they arrive (`scoring.py`) and each one is pushed to the learner
as soon as its own reward is in, those that arrived together in one Trajectories message, a
Trajectory per sample (PUSH, tensors as frames); a task's TaskDone goes to the launcher once all
its samples are sent (the TaskDones of one arrival in one TasksDone), with WeightsLoaded and
Metrics. A Trajectory has three tensor frames (ids, behavior log-probs, versions), or six with
`opd.enabled`: then frames 3-5 are the [T, N] teacher log-probs, cached ids and their behavior
log-probs (docs/opd.md).

Weights (docs/weights.md): announcements go to `weights.WeightUpdates`, whose `gen-weights` task
fetches each version it needs concurrently with generation and hands it to the generator the way
its plugin takes weights (chosen once at start: staged, plain `load_weights` between batches, or
its servers in the broadcast group), and whose `gen-acks` task sends `WeightsLoaded`; a version
that cannot be loaded is retried, and never acked (the failure rules are in `weights.py`).
Rollouts carrying a token of a version whose weight-load canary the launcher has not judged yet
wait (`canary.SendGate`), in order, until its `WeightsLoaded` comes back (docs/weights.md, "Canary"). The
Trajectory frames are built next to the codec (`transport.codec.trajectory_frames`).

Run as `python -m asyncrl.generators.service --ctrl ADDR --peer-id ID --run-dir DIR --args '{"model": DIR, "data": ADDR}'`
(`asyncrl.runtime.worker_argv`).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time

import zmq

from asyncrl.generators.base import GeneratorContext, Rollout, resolve_generator, streams
from asyncrl.generators.feed import SampleFeed, batch_stream
from asyncrl.generators.scoring import SampleScorer, Verdict
from asyncrl.generators.teacher_client import open_teacher
from asyncrl.generators.weights import WeightUpdates
from asyncrl.messages import (
    BroadcastPublished,
    DataEndpoint,
    GeneratorMetrics,
    Metrics,
    PromptTasks,
    ShardsPublished,
    Shutdown,
    TaskDone,
    TasksDone,
    WeightsLoaded,
)
from asyncrl.models.sampling import device_setting
from asyncrl.runtime import ChildContext, run_child
from asyncrl.transport.codec import batch_trajectories, trajectory_frames
from asyncrl.transport.receiver import WeightsReceiver, weights_root
from asyncrl.transport.zmq_io import Endpoint

log = logging.getLogger(__name__)

# A generator reports its metrics after a batch at most this often (each report is a record the
# launcher writes and publishes; one per batch cost it more CPU than the rest of a batch's messages).
METRICS_EVERY_S = 0.25


class GeneratorService:
    def __init__(self, ctx: ChildContext) -> None:
        self.ctx = ctx
        cfg = ctx.config
        self.gen = resolve_generator(cfg.generators.kind)()
        model_path = ctx.args.model
        self.teacher = open_teacher(ctx)  # opd.placement = "service": the shared teacher, else None
        self.gen.setup(
            GeneratorContext(
                generator_id=ctx.peer_id,
                model_path=model_path,
                sampling=cfg.sampling,
                task=cfg.task,
                seed=cfg.run.seed * 1000 + ctx.args.index,
                threads=cfg.generators.threads,
                run_seed=cfg.run.seed,
                inflight=cfg.weights.inflight,
                opd=cfg.opd,
                teacher=self.teacher,
                options=dict(cfg.generators.options),
                run_dir=str(ctx.run_dir),
                dtype=cfg.learner.publish_dtype,
                device=device_setting(cfg.generators.device),
                batching=cfg.generators.batching,
                max_batch_groups=cfg.batch_groups,
                env=cfg.env,
            )
        )
        self.num_opd_samples = cfg.opd.samples_per_position
        # sampling.guidance: the guided prefixes' tokenizer, and where the per-prompt counts go at exit.
        self.scorer = SampleScorer(
            cfg,
            tokenizer=getattr(self.gen, "tokenizer", None),
            report=ctx.run_dir / f"guidance-{ctx.peer_id}.json",
        )
        self.streams = streams(self.gen)  # else served batches through generate()
        self.data = Endpoint(ctx.zmq_ctx, zmq.PUSH, name=f"{ctx.peer_id}.data")
        # The learner's endpoint: on the command line when it was known at spawn, else the
        # launcher's DataEndpoint brings it (generators start while the learner does).
        self.data_endpoint = ""
        self.connect_data(ctx.args.data)
        self.feed = SampleFeed()
        self.wake = asyncio.Event()
        self.stopping = False
        self.num_samples = 0
        self.num_tokens = 0
        self.busy_s = 0.0
        self.started = time.perf_counter()
        self.metrics_sent_at = -math.inf
        # Shards announced outside the weights root are refused (issue #23, security).
        self.receiver = WeightsReceiver(ctx.peer_id, root=weights_root(cfg.weights.dir, ctx.run_dir))
        if files := ctx.args.files:  # a worker that joined from a host without the weights root
            from asyncrl.transport.serve import NetworkWeights

            self.receiver.remote = NetworkWeights(ctx.zmq_ctx, files, ctx.run_dir / "weights")
        # Sending is serialised: a batch the canary's gate releases never overlaps a new one.
        self.sending = asyncio.Lock()
        # Scoring-and-sending tasks, one per arrival, with the samples each holds: they outlive the
        # stream that produced them (a hung reward holds its groups only, not the generator's next
        # stream or its weight loads; issue #36).
        self.taking: dict[asyncio.Task, set[tuple[int, int]]] = {}
        self.weights = WeightUpdates(
            self.gen,
            self.receiver,
            cfg.weights,
            generator_kind=cfg.generators.kind,
            peer_id=ctx.peer_id,
            feed=self.feed,
            wake=self.wake,
            send=ctx.ctrl.send,
            report=self.send_metrics,
        )

    async def recv_loop(self) -> None:
        while not self.stopping:
            _, msg, _ = await self.ctx.ctrl.recv()
            match msg:
                case PromptTasks():
                    tasks, guided = self.scorer.open_tasks(msg.tasks)  # sampling.guidance's draws apart
                    self.feed.put(tasks)
                    self.feed.redraw(guided)
                case DataEndpoint():
                    self.connect_data(msg.endpoint)
                case ShardsPublished() | BroadcastPublished():  # the WeightsPublished variants
                    self.weights.announce(msg)
                case WeightsLoaded():  # the launcher accepted this version's canary
                    self.weights.canary.gate.accept(msg.version)  # the work loop sends what it frees
                case Shutdown():
                    self.stopping = True
                    self.feed.close()  # samples in flight finish; nothing new starts
                    self.weights.stop()
                case _:
                    log.error(
                        "%s: unexpected %s on the control socket; ignored",
                        self.ctx.peer_id,
                        type(msg).__name__,
                    )
            self.wake.set()

    def connect_data(self, endpoint: str) -> None:
        """Connect the trajectory socket to the learner, once (sends wait until it is)."""
        if endpoint and not self.data_endpoint:
            self.data.connect(endpoint)
            self.data_endpoint = endpoint

    async def work_loop(self) -> None:
        try:
            while not self.stopping:
                await self.wake.wait()
                self.wake.clear()
                self.reap_taken()
                await self.send_released()
                await self.weights.between_batches()
                while self.feed.has_work() and not self.stopping:
                    async with self.weights.model_lock:
                        await self.run_stream()
                    await self.weights.between_batches()
            if self.taking:  # shutdown: what is being scored finishes and is sent
                await asyncio.wait(self.taking)
            self.reap_taken()
        finally:
            for t in self.taking:
                t.cancel()

    def by_group(self, rollouts: list[Rollout]) -> list[list[Rollout]]:
        """An arrival in the parts scored (and sent) on their own: one per group when rewards are
        scored here, so a hung reward holds its own group's samples only, not the other groups
        that finished in the same decode step; else the whole arrival (one message)."""
        if self.scorer.scorer is None or not rollouts:
            return [rollouts] if rollouts else []
        groups: dict[int, list[Rollout]] = {}
        for r in rollouts:
            groups.setdefault(r.task_id, []).append(r)
        return list(groups.values())

    def start_take(self, rollouts: list[Rollout]) -> None:
        """Score and send `rollouts` in a task of their own; its end wakes the work loop (a
        redraw to sample, a failure to raise)."""
        t = asyncio.create_task(self.take(rollouts), name="gen-take")
        self.taking[t] = {(r.task_id, r.sample_index) for r in rollouts}
        t.add_done_callback(lambda _: self.wake.set())

    def reap_taken(self) -> None:
        """Forget the finished scoring tasks; raise what one of them raised."""
        for t in [t for t in self.taking if t.done()]:
            del self.taking[t]
            t.result()

    def open_stream(self):
        """The generator's stream over the feed: its own, or batches through `generate`."""
        if self.streams:
            return self.gen.generate_stream(self.feed)
        max_groups = self.ctx.config.batch_groups
        return batch_stream(self.gen, self.feed, max_groups=max_groups, generator_id=self.ctx.peer_id)

    async def run_stream(self) -> None:
        """One stream, until the generator is idle: rollouts are taken as they arrive, those that
        arrived while the last ones were scored and sent in one go; generation goes on meanwhile."""
        start = time.perf_counter()
        arrived: asyncio.Queue[list[Rollout] | None] = asyncio.Queue()

        async def pump() -> None:
            try:
                async for rollouts in self.open_stream():
                    arrived.put_nowait(rollouts)
            finally:
                arrived.put_nowait(None)

        pumping = asyncio.create_task(pump(), name="gen-stream")
        # Each arrival is scored and sent by a task of its own (`start_take`): a hung reward holds
        # only the groups of its sample, never the arrivals after it, and the stream ends (the
        # model free for new weights and the next tasks) without waiting for it (issue #36).
        try:
            ended = False
            while not ended:
                rollouts: list[Rollout] = []
                item = await arrived.get()
                while True:
                    if item is None:
                        ended = True
                        break
                    rollouts += item
                    if arrived.empty():
                        break
                    item = arrived.get_nowait()
                self.reap_taken()  # raises what scoring or sending raised
                for part in self.by_group(rollouts):
                    self.start_take(part)
            await pumping  # raises what the generator raised
            if getattr(self.gen, "env_counters", None):  # episode counters complete at every idle point
                await self.send_metrics()
            # The generator is idle: whatever it was handed has come back (else its task would
            # never be done and the run would stall without a word).
            held = self.weights.canary.gate.held_samples()  # waiting for a canary verdict
            held |= set().union(*self.taking.values())  # being scored
            if lost := sorted(self.scorer.awaited() - self.feed.queued() - held):
                raise ValueError(
                    f"generator {self.ctx.peer_id} ended its stream without returning "
                    f"{len(lost)} sample(s) it took, (task, sample) {lost[:5]}: every draw must "
                    "come back as one Rollout"
                )
        finally:
            if not pumping.done():
                pumping.cancel()
            self.busy_s += time.perf_counter() - start

    async def take(self, rollouts: list[Rollout]) -> None:
        """Send `rollouts` on, unless the canary's gate holds them (a token of a version whose
        verdict is pending, or older ones held); what it released first goes first."""
        await self.send_released()
        gate = self.weights.canary.gate
        if gate.holds(rollouts):
            if not gate.held:
                log.info(
                    "%s: holding rollouts until the canary verdict of version(s) %s",
                    self.ctx.peer_id,
                    sorted(gate.pending),
                )
            gate.hold(rollouts)
            return
        await self.take_now(rollouts)

    async def send_released(self) -> None:
        """Send what the canary's gate released (an accepted verdict, a version that failed to load)."""
        for rollouts in self.weights.canary.gate.releasable():
            await self.take_now(rollouts)

    async def take_now(self, rollouts: list[Rollout]) -> None:
        """Score `rollouts` (concurrently with other arrivals), then send them in the order their
        scores came in: a group's TaskDone always follows its samples, since the scoring that
        completes a group takes the send lock after every scoring that finished before it."""
        verdict = await self.scorer.take(rollouts)
        async with self.sending:  # no await between the scores and the lock: order kept
            await self.send_verdict(verdict)

    async def send_verdict(self, verdict: Verdict) -> None:
        """Send the final rollouts, ask for redraws, report complete groups."""
        if verdict.redraw:
            self.feed.redraw(verdict.redraw)
        now = time.perf_counter()
        started = self.feed.started_s
        if verdict.send:
            frames = [
                trajectory_frames(
                    task,
                    r,
                    self.ctx.peer_id,
                    now - started.get(task.task_id, now),
                    num_opd_samples=self.num_opd_samples,
                )
                for task, r in verdict.send
            ]
            for msg, tensors in batch_trajectories(frames):  # what arrived together, in one message
                await self.data.send(msg, tensors)
        if verdict.done:
            done = []
            for task, group, counts in verdict.done:
                num_tokens = sum(len(r.completion_ids) for r in group)
                self.num_samples += len(group)
                self.num_tokens += num_tokens
                done.append(
                    TaskDone(
                        task_id=task.task_id,
                        generator_id=self.ctx.peer_id,
                        num_trajectories=len(group),
                        num_tokens=num_tokens,
                        generate_s=now - started.pop(task.task_id, now),
                        mean_reward=sum(r.reward for r in group) / len(group),
                        **counts.as_fields(),
                    )
                )
            await self.ctx.ctrl.send(TasksDone(items=done))
        if time.perf_counter() - self.metrics_sent_at >= METRICS_EVERY_S:
            await self.send_metrics()

    async def send_metrics(self) -> None:
        self.metrics_sent_at = now = time.perf_counter()
        wall = now - self.started
        await self.ctx.ctrl.send(
            Metrics(
                source=self.ctx.peer_id,
                time_s=time.time(),
                record=GeneratorMetrics(
                    samples=self.num_samples,
                    tokens=self.num_tokens,
                    busy_ratio=self.busy_s / wall if wall > 0 else 0.0,
                    version=int(self.gen.version),
                    rejected_frames=self.ctx.ctrl.num_rejected,
                    weights_load_errors=self.weights.num_load_errors,
                    weights_load_s=self.weights.last_load_s,
                    weights_fetch_bytes=int(self.receiver.last_fetch_bytes),
                    weights_delta_fetches=int(self.receiver.num_delta_fetches),
                    weights_refused_locations=int(self.receiver.num_refused_locations),
                    weights_network_bytes=int(getattr(self.receiver.remote, "bytes_fetched", 0)),
                    inflight_updates=int(getattr(self.gen, "num_inflight_updates", 0)),
                    teacher_s=float(getattr(self.gen, "teacher_s", 0.0)),
                    teacher_version=int(getattr(self.gen, "teacher_version", -1)),
                    env=dict(getattr(self.gen, "env_counters", {})),
                    opd=self.gen.opd_metrics() if hasattr(self.gen, "opd_metrics") else {},
                ),
            )
        )

    async def run(self) -> None:
        await self.ctx.hello()
        try:
            async with asyncio.TaskGroup() as tg:
                helpers = [
                    tg.create_task(self.recv_loop(), name="gen-recv"),
                    tg.create_task(self.weights.run(), name="gen-weights"),
                    tg.create_task(self.weights.ack_loop(), name="gen-acks"),
                ]
                await tg.create_task(self.work_loop(), name="gen-work")
                for h in helpers:
                    h.cancel()
        finally:
            self.receiver.close()
            self.data.close()
            await self.scorer.close()  # its reward worker processes
            await self.gen.close()  # also on failure: a generator may own server processes
            if self.teacher is not None:
                self.teacher.close()


async def main(ctx: ChildContext) -> None:
    await GeneratorService(ctx).run()


if __name__ == "__main__":
    run_child("generator", main)
