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

Weights (docs/weights.md): the `gen-weights` task takes announcements in order and fetches each
one it needs in a worker thread (`transport.receiver`: verified shards, or the broadcast group),
concurrently with generation; the complete tensors are offered to the generator, which applies
them at its next safe point (between decode steps, by `weights.inflight`, or between batches) and
`gen-acks` then sends `WeightsLoaded`. A plugin without `offer_weights` gets `load_weights` between
batches instead (shards only).

A version that cannot be loaded (corrupt or missing shard or delta, a broadcast that failed, a
fetch still unfinished at `weights.update_deadline_s`) never reaches the model: the generator
keeps serving the weights it has, logs the reason, counts `gen/weights_load_errors`, and never acks
what it does not hold (a failed broadcast is not retried: the generator left the group and takes
the catch-up shards). It takes the next announcement as soon as one arrives and meanwhile retries
the failed one with backoff (a shared directory may lag); if no version becomes loadable within
`weights.load_retry_timeout_s` it fails with the reason, because admission waits for its ack and a
silent stall would hang the run.

Run as `python -m asyncrl.generators.service --ctrl ADDR --peer-id ID --run-dir DIR --extra data=ADDR`.
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import logging
import math
import threading
import time
from collections import deque

import torch
import zmq

from asyncrl.generators.base import (
    GeneratorContext,
    GroupWeights,
    Rollout,
    StagedWeights,
    resolve_generator,
    streams,
)
from asyncrl.generators.feed import SampleFeed, batch_stream
from asyncrl.generators.scoring import SampleScorer
from asyncrl.generators.teacher_client import open_teacher
from asyncrl.messages import (
    DataEndpoint,
    Metrics,
    PromptTask,
    PromptTasks,
    Shutdown,
    TaskDone,
    TasksDone,
    Trajectory,
    WeightsLoaded,
    WeightsPublished,
)
from asyncrl.models.sampling import device_setting
from asyncrl.runtime import ChildContext, run_child
from asyncrl.transport.codec import batch_trajectories, tensor_ref
from asyncrl.transport.fence import UpdateFailed
from asyncrl.transport.manifest import WeightsCorruptError
from asyncrl.transport.receiver import WeightsReceiver, weights_root
from asyncrl.transport.zmq_io import Endpoint

log = logging.getLogger(__name__)

# Retrying a version that failed to load: first wait, doubling up to the cap (timers, not syncs).
RETRY_FIRST_S = 0.5
RETRY_MAX_S = 10.0
# A generator reports its metrics after a batch at most this often (each report is a record the
# launcher writes and publishes; one per batch cost it more CPU than the rest of a batch's messages).
METRICS_EVERY_S = 0.25


class WeightsUnavailable(RuntimeError):
    """No announced version could be loaded for weights.load_retry_timeout_s."""


def opd_frames(
    task: PromptTask, r: Rollout, generator_id: str, ids: torch.Tensor, num_opd_samples: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(teacher_logprobs, opd_ids, opd_behavior_logprobs), each [T, N], checked against the rollout."""
    where = f"generator {generator_id}: rollout of task {task.task_id}"
    if r.teacher_logprobs is None or r.opd_ids is None or r.opd_behavior_logprobs is None:
        raise ValueError(
            f"{where} lacks teacher_logprobs / opd_ids / opd_behavior_logprobs, which opd.enabled "
            "needs; the generator plugin must score its rollouts with the teacher"
        )
    shape = (len(ids), num_opd_samples)
    teacher = torch.tensor(r.teacher_logprobs, dtype=torch.float32)
    opd_ids = torch.tensor(r.opd_ids, dtype=torch.int64)
    opd_logps = torch.tensor(r.opd_behavior_logprobs, dtype=torch.float32)
    for name, t in (
        ("teacher_logprobs", teacher),
        ("opd_ids", opd_ids),
        ("opd_behavior_logprobs", opd_logps),
    ):
        if tuple(t.shape) != shape:
            raise ValueError(f"{where}: {name} has shape {list(t.shape)}, expected [T, N] = {list(shape)}")
    if not torch.equal(opd_ids[:, 0], ids):
        raise ValueError(f"{where}: opd_ids[:, 0] must be the generated tokens")
    return teacher, opd_ids, opd_logps


def _wire_array(values, code: str, dtype: torch.dtype) -> array.array | torch.Tensor:
    """A flat list as it goes on the wire: an `array.array` (the codec sends its bytes; a tenth
    of the cost of a tensor for a short list), or a tensor when the values are not plain numbers
    of that kind (torch converts them, or names the problem)."""
    try:
        return array.array(code, values)
    except (TypeError, OverflowError):
        return torch.tensor(values, dtype=dtype)


def trajectory_frames(
    task: PromptTask, r: Rollout, generator_id: str, generate_s: float, *, num_opd_samples: int = 0
):
    """The Trajectory message for one rollout and its tensor frames: three, three more when
    `num_opd_samples` (opd.num_samples, with opd.enabled) is > 0, and the loss mask when the
    rollout masks any token out."""
    ids = _wire_array(r.completion_ids, "q", torch.int64)
    logps = _wire_array(r.behavior_logprobs, "f", torch.float32)
    versions = _wire_array(r.token_versions, "q", torch.int64)
    if not (len(ids) == len(logps) == len(versions)):
        raise ValueError(
            f"generator {generator_id}: rollout of task {task.task_id} has {len(ids)} tokens, "
            f"{len(logps)} log-probs and {len(versions)} versions; they must match"
        )
    tensors: tuple[torch.Tensor | array.array, ...] = (ids, logps, versions)
    opd_refs = {}
    if num_opd_samples > 0:
        ids_T = torch.as_tensor(r.completion_ids, dtype=torch.int64)
        teacher, opd_ids, opd_logps = opd_frames(task, r, generator_id, ids_T, num_opd_samples)
        tensors += (teacher, opd_ids, opd_logps)
        opd_refs = {
            "teacher_logprobs": tensor_ref(3, teacher),
            "opd_ids": tensor_ref(4, opd_ids),
            "opd_behavior_logprobs": tensor_ref(5, opd_logps),
        }
    mask_ref = {}
    if r.loss_mask is not None and not all(r.loss_mask):
        mask = torch.tensor(r.loss_mask, dtype=torch.bool)
        if len(mask) != len(ids):
            raise ValueError(
                f"generator {generator_id}: rollout of task {task.task_id} has {len(ids)} tokens and a "
                f"loss_mask of {len(mask)}; they must match"
            )
        mask_ref = {"loss_mask": tensor_ref(len(tensors), mask)}
        tensors += (mask,)
    msg = Trajectory(
        traj_id=task.group_id * task.num_samples + r.sample_index,
        group_id=task.group_id,
        task_id=task.task_id,
        sample_index=r.sample_index,
        step=task.step,
        num_samples=task.num_samples,
        prompt_ids=list(task.prompt_ids),
        completion_ids=tensor_ref(0, ids),
        behavior_logprobs=tensor_ref(1, logps),
        token_versions=tensor_ref(2, versions),
        reward=r.reward,
        finish_reason=r.finish_reason if r.finish_reason in ("stop", "length", "abort") else "stop",
        generator_id=generator_id,
        generate_s=generate_s,
        teacher_version=r.teacher_version if num_opd_samples > 0 else None,
        **opd_refs,
        **mask_ref,
    )
    return msg, tensors


class GeneratorService:
    def __init__(self, ctx: ChildContext) -> None:
        self.ctx = ctx
        cfg = ctx.config
        self.gen = resolve_generator(cfg.generators.kind)()
        model_path = ctx.extra["model"]
        self.teacher = open_teacher(ctx)  # opd.placement = "service": the shared teacher, else None
        self.gen.setup(
            GeneratorContext(
                generator_id=ctx.peer_id,
                model_path=model_path,
                sampling=cfg.sampling,
                task=cfg.task,
                seed=cfg.run.seed * 1000 + int(ctx.extra.get("index", "0")),
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
            )
        )
        self.staged = isinstance(self.gen, StagedWeights)
        self.group_member = isinstance(self.gen, GroupWeights)  # its servers receive, not this process
        if cfg.weights.kind == "broadcast" and not (self.staged or self.group_member):
            raise ValueError(
                f"generator {cfg.generators.kind!r} has no offer_weights() (nor receive_broadcast()), "
                "which weights.transport=broadcast needs; use weights.transport=shards"
            )
        self.num_opd_samples = cfg.opd.num_samples if cfg.opd.enabled else 0
        self.scorer = SampleScorer(cfg)
        self.streams = streams(self.gen)  # else served batches through generate()
        self.data = Endpoint(ctx.zmq_ctx, zmq.PUSH, name=f"{ctx.peer_id}.data")
        # The learner's endpoint: on the command line when it was known at spawn, else the
        # launcher's DataEndpoint brings it (generators start while the learner does).
        self.data_endpoint = ""
        self.connect_data(ctx.extra.get("data", ""))
        self.feed = SampleFeed()
        self.wake = asyncio.Event()
        self.stopping = False
        self.num_samples = 0
        self.num_tokens = 0
        self.busy_s = 0.0
        self.started = time.perf_counter()
        self.metrics_sent_at = -math.inf
        # weights
        # Shards announced outside the weights root are refused (issue #23, security).
        self.receiver = WeightsReceiver(ctx.peer_id, root=weights_root(ctx.config.weights.dir, ctx.run_dir))
        if files := ctx.extra.get("files"):  # a worker that joined from a host without the weights root
            from asyncrl.transport.serve import NetworkWeights

            self.receiver.remote = NetworkWeights(ctx.zmq_ctx, files, ctx.run_dir / "weights")
        self.announcements: deque[WeightsPublished] = deque()
        self.announced = asyncio.Event()
        self.announced_at: dict[int, float] = {}
        self.fetched_version = 0  # newest version handed to the generator
        self.offered = False  # a version offered to a staged generator since the last apply
        self.applied: deque[int] = deque()
        self.applied_event = asyncio.Event()
        self.model_lock = asyncio.Lock()  # a plain plugin's load_weights never overlaps generate
        self.num_load_errors = 0
        self.last_load_s = 0.0
        self.last_error = ""

    async def recv_loop(self) -> None:
        while not self.stopping:
            _, msg, _ = await self.ctx.ctrl.recv()
            match msg:
                case PromptTasks():
                    for task in msg.tasks:
                        self.scorer.open(task)
                    self.feed.put(msg.tasks)
                case DataEndpoint():
                    self.connect_data(msg.endpoint)
                case WeightsPublished():
                    self.announcements.append(msg)
                    self.announced_at.setdefault(msg.version, time.perf_counter())
                    self.announced.set()
                case Shutdown():
                    self.stopping = True
                    self.feed.close()  # samples in flight finish; nothing new starts
                    self.announced.set()
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

    # ------------------------------------------------------------------ weights
    def next_announcement(self) -> WeightsPublished | None:
        """The next announcement to act on, in order; superseded shard versions are skipped."""
        while self.announcements:
            msg = self.announcements.popleft()
            if not self.receiver.plan(msg):
                continue
            if self.receiver.must_fetch(msg):
                return msg
            newer = any(m.version > msg.version and m.transport == msg.transport for m in self.announcements)
            if msg.version > self.fetched_version and not newer:
                return msg
        return None

    async def weights_loop(self) -> None:
        failing: WeightsPublished | None = None  # the newest version that failed to load
        failing_since = 0.0
        backoff_s = RETRY_FIRST_S
        while not self.stopping:
            msg = self.next_announcement()
            if msg is None:
                self.announced.clear()
                if self.announcements:
                    continue
                if failing is None:
                    await self.announced.wait()
                    continue
                try:  # a newer announcement ends the wait early; otherwise retry the failed one
                    await asyncio.wait_for(self.announced.wait(), backoff_s)
                    continue
                except TimeoutError:
                    msg = failing
                    if msg.version <= self.fetched_version:
                        failing = None
                        continue
            if await self.load(msg):
                failing, backoff_s = None, RETRY_FIRST_S
                continue
            if msg.transport == "broadcast":  # never retried: its catch-up shards follow
                continue
            if failing is None:
                failing_since = time.perf_counter()
            retried = failing is not None and failing.version == msg.version
            backoff_s = min(2 * backoff_s, RETRY_MAX_S) if retried else RETRY_FIRST_S
            failing = msg
            waited_s = time.perf_counter() - failing_since
            timeout_s = self.ctx.config.weights.load_retry_timeout_s
            if waited_s > timeout_s:
                raise WeightsUnavailable(
                    f"{self.ctx.peer_id} could not load any weights version for {waited_s:.0f} s "
                    f"(weights.load_retry_timeout_s = {timeout_s:g}); last error: {self.last_error}"
                )

    async def load(self, msg: WeightsPublished) -> bool:
        """Fetch and hand over one version; False (old weights kept) when it cannot be loaded."""
        try:
            if self.group_member and msg.transport == "broadcast":
                # No model lock: the servers pause themselves (generators.options.pause_mode).
                await self.gen.receive_broadcast(msg)
                self.fetched_version = msg.version
                self.on_applied(msg.version)
            elif self.staged:
                state = await self.fetch(msg)
                self.gen.offer_weights(msg.version, state, self.on_applied_threadsafe)
                self.offered = True
                self.fetched_version = msg.version
                self.wake.set()  # an idle work loop applies it now
            else:
                # The generator takes no new sample meanwhile, so a running stream drains and
                # gives the lock up (a plain plugin's load_weights never overlaps generation).
                self.feed.hold()
                try:
                    location = msg.location
                    if self.receiver.remote is not None:  # fetched over the network first
                        root = await asyncio.to_thread(
                            self.receiver.remote.fetch, msg.version, lambda m: False
                        )
                        location = str(root)
                    async with self.model_lock:
                        await self.gen.load_weights(msg.version, location)
                finally:
                    self.feed.release()
                self.fetched_version = msg.version
                self.on_applied(msg.version)
            return True
        except (WeightsCorruptError, FileNotFoundError, UpdateFailed) as exc:
            if msg.transport == "broadcast" and not isinstance(exc, UpdateFailed):
                raise
            self.num_load_errors += 1
            self.last_error = f"{type(exc).__name__}: {exc}"
            log.error(
                "%s: weights version %d could not be loaded, still serving version %d: %s",
                self.ctx.peer_id,
                msg.version,
                self.gen.version,
                self.last_error,
            )
            await self.send_metrics()
            return False

    async def fetch(self, msg: WeightsPublished):
        """The receiver's fetch in a thread of its own; shards by the update's deadline. A fetch
        past it is given up: the thread cannot be stopped, so it is a daemon thread (a hung one
        never holds up the process's exit, as one of the loop's executor would) that finishes, if
        ever, into tensors nobody takes."""
        loop = asyncio.get_running_loop()
        fetching = loop.create_future()

        def settle(result=None, exc: BaseException | None = None) -> None:
            if fetching.done():  # given up meanwhile
                return
            if exc is not None:
                fetching.set_exception(exc)
            else:
                fetching.set_result(result)

        def run() -> None:
            try:
                outcome = (self.receiver.fetch(msg), None)
            except BaseException as exc:  # handed to the awaiting task, which decides
                outcome = (None, exc)
            with contextlib.suppress(RuntimeError):  # the loop is gone: nobody waits any more
                loop.call_soon_threadsafe(settle, *outcome)

        threading.Thread(target=run, name=f"gen-fetch-v{msg.version}", daemon=True).start()
        if msg.transport == "broadcast":  # every rank must take part; the group's timeout bounds it
            return await fetching
        deadline_s = self.ctx.config.weights.update_deadline_s
        try:
            return await asyncio.wait_for(fetching, deadline_s)
        except TimeoutError:
            raise UpdateFailed(
                f"weights version {msg.version}: fetching it took longer than "
                f"weights.update_deadline_s = {deadline_s:g} s; given up"
            ) from None

    def on_applied_threadsafe(self, version: int) -> None:
        """Called by the generator on the thread that applied the weights."""
        self.loop.call_soon_threadsafe(self.on_applied, version)

    def on_applied(self, version: int) -> None:
        self.applied.append(version)
        self.applied_event.set()

    async def ack_loop(self) -> None:
        while True:
            await self.applied_event.wait()
            self.applied_event.clear()
            while self.applied:
                version = self.applied.popleft()
                self.last_load_s = time.perf_counter() - self.announced_at.pop(version, time.perf_counter())
                for v in [v for v in self.announced_at if v < version]:
                    del self.announced_at[v]
                await self.ctx.ctrl.send(
                    WeightsLoaded(generator_id=self.ctx.peer_id, version=version, load_s=self.last_load_s)
                )

    async def apply_between_batches(self) -> None:
        if self.offered:  # else nothing to apply (a generator may have applied it mid-batch)
            self.offered = False
            await asyncio.to_thread(self.gen.apply_pending)

    async def work_loop(self) -> None:
        while not self.stopping:
            await self.wake.wait()
            self.wake.clear()
            await self.apply_between_batches()
            while self.feed.has_work() and not self.stopping:
                async with self.model_lock:
                    await self.run_stream()
                await self.apply_between_batches()

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
                if rollouts:
                    await self.take(rollouts)
            await pumping  # raises what the generator raised
            # The generator is idle: whatever it was handed has come back (else its task would
            # never be done and the run would stall without a word).
            if lost := sorted(self.scorer.awaited() - self.feed.queued()):
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
        """Score `rollouts`, send the final ones, ask for redraws, report complete groups."""
        verdict = await self.scorer.take(rollouts)
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
                values={
                    "gen/samples": float(self.num_samples),
                    "gen/tokens": float(self.num_tokens),
                    "gen/busy_ratio": self.busy_s / wall if wall > 0 else 0.0,
                    "gen/version": float(self.gen.version),
                    "gen/rejected_frames": float(self.ctx.ctrl.num_rejected),
                    "gen/weights_load_errors": float(self.num_load_errors),
                    "gen/weights_load_s": self.last_load_s,
                    "gen/weights_fetch_bytes": float(self.receiver.last_fetch_bytes),
                    "gen/weights_delta_fetches": float(self.receiver.num_delta_fetches),
                    "gen/weights_refused_locations": float(self.receiver.num_refused_locations),
                    "gen/weights_network_bytes": float(getattr(self.receiver.remote, "bytes_fetched", 0)),
                    "gen/inflight_updates": float(getattr(self.gen, "num_inflight_updates", 0)),
                    "gen/teacher_s": float(getattr(self.gen, "teacher_s", 0.0)),
                    "gen/teacher_version": float(getattr(self.gen, "teacher_version", -1)),
                },
            )
        )

    async def run(self) -> None:
        self.loop = asyncio.get_running_loop()
        await self.ctx.hello()
        try:
            async with asyncio.TaskGroup() as tg:
                helpers = [
                    tg.create_task(self.recv_loop(), name="gen-recv"),
                    tg.create_task(self.weights_loop(), name="gen-weights"),
                    tg.create_task(self.ack_loop(), name="gen-acks"),
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
