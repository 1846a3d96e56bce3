"""Learner process: receives trajectories, streams their gradients into one optimizer step per
admission window (`trainer.py`), and publishes every new policy_version (`transport.publisher`).

Sockets: PULL (bound, loopback) for Trajectories (a generator's finished batch) and Trajectory
messages from generators; DEALER to the launcher for Hello / StepDone / WeightsPublished /
Metrics out and WeightsLoaded / Shutdown in. Torch work runs in a worker thread so heartbeats and
receives stay responsive.

Window s (the groups admitted for step s) is trained at policy_version s: its trajectories wait
in the inbox until step s - 1 is done, then each is trained as soon as the trainer can take it,
so the update follows the window's last reward by about one trajectory's backward. Admission
guarantees that every token came from a version >= s - max_staleness; the trainer asserts it.

Run as `python -m asyncrl.learner.service --ctrl ADDR --peer-id learner --run-dir DIR --args '{"model": PATH}'`.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec
import torch
import zmq

from asyncrl.learner import canary, lora
from asyncrl.learner.checkpoint import (
    learner_checkpoint_path,
    load_learner_checkpoint,
    save_learner_checkpoint,
)
from asyncrl.learner.chunking import ChunkChoice, fixed_min_chunk
from asyncrl.learner.loop import (
    StepLoop,
    build_trainer,
    canonical_chunk,
    canonical_order,
    gradient_mode,
    load_policy_model,
    sample_stride,
    window_size,
)
from asyncrl.learner.parallel import is_wrapped
from asyncrl.learner.pool import PoolLoop
from asyncrl.learner.ranks import (
    RankGroup,
    checkpoint_due,
    eval_due,
    eval_snapshot_dir,
    finish_version,
    keep_before_fault,
    publish_state,
)
from asyncrl.learner.schedule import ScheduleRecorder
from asyncrl.learner.step import StepResult, sample_from_message
from asyncrl.learner.update import NonFiniteError
from asyncrl.messages import (
    CanaryReference,
    EvalDue,
    Evaluated,
    GroupsLeft,
    LearnerMetrics,
    Metrics,
    Shutdown,
    Trajectories,
    Trajectory,
    WeightsLoaded,
)
from asyncrl.runtime import ChildContext, run_child
from asyncrl.transport import zap
from asyncrl.transport.codec import split_trajectories
from asyncrl.transport.publisher import make_publisher
from asyncrl.transport.zmq_io import Endpoint

if TYPE_CHECKING:
    from asyncrl.config_sections import OpdConfig

log = logging.getLogger(__name__)

# Longer sequences than this are not from any generator of ours (a guard against garbage).
MAX_SEQUENCE_TOKENS = 1 << 20


class LearnerService:
    def __init__(self, ctx: ChildContext) -> None:
        self.ctx = ctx
        cfg = ctx.config
        self.cfg = cfg.learner
        self.model_path = Path(ctx.args.model)
        self.ranks = RankGroup(ctx, self.model_path) if self.cfg.world_size > 1 else None
        self.data = Endpoint(ctx.zmq_ctx, zmq.PULL, name="learner.data")
        self.data.bind()
        # The last step's publish and reports, running while the next step trains (`train_loop`).
        self.closing: asyncio.Task | None = None
        self.seen: set[int] = set()
        self.num_duplicates = 0
        self.num_invalid = 0
        # Self-distillation (opd.teacher = "self"): the teacher's staleness, version trained at
        # (its step, or later) minus Trajectory.teacher_version, of the trajectories received
        # since the last report.
        self.teacher_staleness: list[int] = []
        self.restored: set[int] = set()  # traj ids put back from the checkpoint on resume
        self.num_regenerated = 0  # re-admitted copies of restored trajectories, dropped
        self.start_version = ctx.args.resume_version
        self.version = self.start_version
        # The held-out evaluation runs here, on the model being trained (`Config.evaluates_in_learner`).
        self.evaluates = cfg.evaluates_in_learner
        self.eval_task = None
        # The weight-load canary (docs/weights.md, "Canary"): scored at every version published;
        # not with several ranks (a sharded forward is a collective of all of them).
        self.canary_ids = ctx.args.canary_ids if cfg.weights.canary and self.cfg.world_size == 1 else []
        self.canary_fault = canary.fault_from(os.environ)  # tests only (learner/canary.py)
        if cfg.weights.canary and self.cfg.world_size > 1:
            log.info("learner: no weight-load canary reference (learner.world_size > 1); acks go unchecked")

    def setup(self) -> None:
        """Load the model on its device (every rank at once when there are several: the
        wrapping is collective), build the trainer and the step source, restore a checkpoint."""
        cfg = self.ctx.config
        self.policy, self.tokenizer = load_policy_model(self.model_path, cfg)
        self.model = self.policy.lm
        publishes_adapter = self.cfg.lora.rank and self.cfg.lora.publish == "adapter"
        self.publisher = make_publisher(
            cfg.weights,
            generator_kind=cfg.generators.kind,
            generator_options=cfg.generators.options,
            run_dir=self.ctx.run_dir,
            model_dir=self.model_path,
            generator_ids=self.ctx.args.generators,
            adapter_config=lora.adapter_config(self.model) if publishes_adapter else None,
        )
        self.trainer = build_trainer(cfg, self.policy, pad_token_id=self.tokenizer.pad_token_id)
        log.info(gradient_mode(self.trainer.fallback))
        if self.trainer.streams_per_trajectory:
            log.info(
                "learner: at most %d groups open at once (learner.stream_memory_mb = %g)",
                self.trainer.max_open_groups,
                self.cfg.stream_memory_mb,
            )
        canonical = canonical_order(cfg)
        # The step source, chosen once: windows (the groups admitted for each step) or the pool.
        self.loop: StepLoop = (
            PoolLoop(self.trainer, cfg)
            if cfg.buffer.mode == "pool"
            else StepLoop(
                self.trainer,
                lambda step: window_size(cfg.learner),
                before_update=self.wait_closed,
                min_chunk=fixed_min_chunk(self.cfg.min_chunk),
                chunking=(
                    ChunkChoice(window_size(cfg.learner))
                    if self.cfg.min_chunk == "auto" and self.trainer.streams_per_trajectory and not canonical
                    else None
                ),
                canonical_chunk=canonical_chunk(cfg),
                sample_stride=sample_stride(cfg),
                on_step_end=ScheduleRecorder(self.ctx.run_dir).write if cfg.run.record_schedule else None,
            )
        )
        if is_wrapped(self.cfg):
            # Gathering the weights is a collective: it must not overlap the next step's.
            self.loop.overlap_close = False
        if self.start_version:
            held = load_learner_checkpoint(self.ctx.run_dir, self.start_version, self.trainer, extras=True)
            for _, sample, _ in held:
                self.seen.add(sample.traj_id)
                self.restored.add(sample.traj_id)
            self.loop.resume(self.start_version, held)
            log.info(
                "learner: resumed at version %d with %d buffered trajectories", self.start_version, len(held)
            )
            drop_published_from(self.weights_root(), self.start_version)

    async def data_loop(self) -> None:
        while True:
            _, msg, tensors = await self.data.recv()
            if not isinstance(msg, Trajectory | Trajectories):
                log.error("learner: %s on the trajectory socket; dropped", type(msg).__name__)
                continue
            for item, frames in split_trajectories(msg, tensors):
                await self.take(item, frames)

    async def take(self, msg: Trajectory, tensors: list[torch.Tensor]) -> None:
        """One received trajectory: dropped (counted, logged) or handed to its rank's loop."""
        if msg.traj_id in self.restored:
            self.num_regenerated += 1  # the checkpoint's copy is kept
            return
        if msg.traj_id in self.seen:
            self.num_duplicates += 1
            # With hedging, the slower copy of a hedged task arrives second by design (counted,
            # and in the launcher's hedge records); otherwise a duplicate is a fault worth a line.
            hedged = self.ctx.config.generators.hedge_factor > 0
            (log.debug if hedged else log.error)("learner: duplicate trajectory %d dropped", msg.traj_id)
            return
        if not self.loop.accepts(msg.window, self.version):
            log.error(
                "learner: trajectory %d for past window %d dropped (now at %d)",
                msg.traj_id,
                msg.window,
                self.version,
            )
            return
        ids, logps, versions = tensors[:3]
        opd = [tensors[r.frame] for r in (msg.teacher_logprobs, msg.opd_ids, msg.opd_behavior_logprobs) if r]
        problem = (
            _invalid(msg, ids, logps, versions, num_steps=self.cfg.steps)
            or _invalid_opd(ids, opd, self.ctx.config.opd)
            or _invalid_top_k(ids, msg, tensors, self.ctx.config.opd)
            or _invalid_mask(ids, msg.loss_mask and tensors[msg.loss_mask.frame])
        )
        if problem:
            self.num_invalid += 1
            log.error("learner: trajectory %d rejected: %s", msg.traj_id, problem)
            return
        self.seen.add(msg.traj_id)
        if msg.teacher_version is not None:
            self.teacher_staleness.append(max(self.version, msg.window) - msg.teacher_version)
        if self.ranks is not None:
            await self.ranks.forward(msg, tensors)  # every rank sees every trajectory, in this order
        self.loop.add(msg.window, sample_from_message(msg, tensors))
        # A group withheld or dropped as it arrived frees its credit now (pool mode; per
        # trajectory, so no coroutine when there is nothing to send).
        if (left := self.loop.take_left()) is not None:
            await self.ctx.ctrl.send(GroupsLeft(version=self.version, **left))

    async def ctrl_loop(self) -> None:
        while True:
            _, msg, _ = await self.ctx.ctrl.recv()
            match msg:
                case WeightsLoaded():
                    self.publisher.on_loaded(msg.generator_id, msg.version)
                case Shutdown():
                    self.loop.stop()
                    return
                case _:
                    log.error("learner: unexpected %s on the control socket; ignored", type(msg).__name__)

    async def train_loop(self) -> None:
        loop = self.loop
        if self.evaluates and self.start_version == 0:
            # While the generators start and sample the first batches (the data loop keeps
            # receiving): the first update waits for it.
            await self.send_evaluation("before")
        try:
            for step in range(self.start_version, self.cfg.steps):
                begin = time.perf_counter()
                idle_before = loop.idle_s
                try:
                    result = await loop.run_step(step)  # awaits the last step's closing before its update
                except NonFiniteError:
                    await self.wait_closed()
                    await asyncio.to_thread(keep_before_fault, self.ctx.run_dir, step, self.trainer, loop)
                    raise
                if result is None:
                    break
                end = time.perf_counter()
                idle_s = loop.idle_s - idle_before
                self.trainer.observe_idle(idle_s, end - begin - idle_s)
                reference = await self.score_canary()  # before the next step can change the weights
                self.version = step + 1
                last = step == self.cfg.steps - 1
                checkpoint = checkpoint_due(self.ctx.config, self.version)
                await self.wait_closed()  # StepDone and WeightsPublished go out in step order
                closing = self.close_step(
                    step,
                    result,
                    step_s=end - begin - idle_s,
                    idle_s=idle_s,
                    tail_s=loop.tail_s(step, begin, end),
                    checkpoint=checkpoint,
                    last=last,
                    reference=reference,
                )
                if checkpoint or not loop.overlap_close:
                    await closing  # a checkpoint holds this version's state
                else:
                    # The next step starts training while this version is published and reported;
                    # its update waits for that (`StepLoop.before_update`), the weights stay put.
                    self.closing = asyncio.create_task(closing, name=f"close-step-{step}")
                    self.closing.add_done_callback(self._closing_done)
        except BaseException:
            if self.closing is not None:
                self.closing.cancel()
            raise
        await self.wait_closed()

    def _closing_done(self, task: asyncio.Task) -> None:
        """A failed publish must not leave the next step waiting for data that needs the new
        weights (max_staleness 0): stop the loop, and `train_loop` re-raises the error."""
        if not task.cancelled() and task.exception() is not None:
            self.loop.stop()

    async def wait_closed(self) -> None:
        """The previous step's publish and reports are done (or there was none to wait for)."""
        if self.closing is not None:
            await self.closing
            self.closing = None

    async def close_step(
        self,
        step: int,
        result: StepResult,
        *,
        step_s: float,
        idle_s: float,
        tail_s: float,
        checkpoint: bool,
        last: bool,
        reference: CanaryReference | None,
    ) -> None:
        """Publish version step + 1, checkpoint it when due, and report StepDone and the metrics."""
        loop = self.loop
        version = step + 1
        # Every rank gathers the weights and checkpoints in this order (`ranks.after_step`). The
        # generators get the new version first; the checkpoint and, on the last step, the final
        # model come before StepDone: the launcher writes its half of the checkpoint on receiving
        # it, and ends the run on the last one.
        published = await self.publish(version, reference)
        held = loop.held(after_step=step) if checkpoint else ()  # on the loop thread, before more arrive
        await asyncio.to_thread(
            finish_version,
            self.trainer,
            self.ctx.config,
            self.ctx.run_dir,
            version,
            final_to=self.save_final,
            eval_to=self.save_for_eval,
            held=held,
        )
        if eval_due(self.ctx.config, version):
            await self.ctx.ctrl.send(
                EvalDue(version=version, path=str(eval_snapshot_dir(self.ctx.run_dir, version)))
            )
        if last and self.evaluates:
            await self.send_evaluation("after")  # before the last StepDone, which ends the run
        held, windows = loop.depth()
        await self.ctx.ctrl.send(result.step_done(step_s=step_s, idle_s=idle_s, **loop.step_report()))
        await self.send_left()
        await self.ctx.ctrl.send(
            Metrics(
                source="learner",
                time_s=time.time(),
                record=LearnerMetrics(
                    idle_ratio=loop.idle_s / max(1e-9, loop.idle_s + loop.busy_s),
                    busy_s=loop.busy_s,
                    idle_s=loop.idle_s,
                    tail_s=tail_s,
                    threads=int(self.trainer.active_threads),
                    streaming=not result.fallback,
                    streamed=int(result.streamed),
                    deferred=int(result.deferred),
                    stream_peak_bytes=int(result.peak_stream_bytes),
                    open_group_bound=int(
                        self.trainer.max_open_groups if self.trainer.streams_per_trajectory else 0
                    ),
                    skipped_nonfinite=int(self.trainer.nonfinite_total),
                    duplicates=self.num_duplicates,
                    resume_restored=len(self.restored),
                    resume_regenerated=self.num_regenerated,
                    invalid_trajectories=self.num_invalid,
                    rejected_frames=self.data.num_rejected + self.ctx.ctrl.num_rejected,
                    auth_failures=zap.num_auth_failures(),
                    publish_s=published.publish_s,
                    held_trajectories=held,
                    held_windows=windows,
                    buffer=loop.metrics(),
                    **self.teacher_metrics(),
                ),
            )
        )

    def teacher_metrics(self) -> dict[str, float]:
        """`LearnerMetrics.teacher_staleness_{mean,max}` since the last report (self-distillation only)."""
        lags, self.teacher_staleness = self.teacher_staleness, []
        if not lags:
            return {}
        return {"teacher_staleness_mean": sum(lags) / len(lags), "teacher_staleness_max": float(max(lags))}

    def evaluate(self) -> tuple[float, float]:
        """(greedy held-out accuracy of the model as it is now, seconds): the launcher's
        evaluation (`asyncrl.job.evaluate`), on the model in memory."""
        from asyncrl.models.sft import greedy_accuracy
        from asyncrl.tasks.base import make_task, prepare_task

        cfg = self.ctx.config
        start = time.perf_counter()
        if self.eval_task is None:  # here, not in setup: a dataset task's prepare may take a while
            self.eval_task = make_task(cfg.task)
            prepare_task(self.eval_task, self.tokenizer, groups_per_step=cfg.learner.groups_per_step)
        training = self.model.training
        self.model.eval()
        threads = torch.get_num_threads()
        # The trainer's data-parallel threads run one torch thread each; decoding is one batch.
        torch.set_num_threads(max(threads, self.trainer.engine.threads))
        try:
            accuracy = greedy_accuracy(
                self.model,
                self.tokenizer,
                self.eval_task,
                max_new_tokens=cfg.sampling.max_new_tokens,
                batch_size=cfg.task.eval_batch_size,
            )
        finally:
            torch.set_num_threads(threads)
            self.model.train(training)
        return accuracy, time.perf_counter() - start

    async def send_evaluation(self, phase: str) -> None:
        accuracy, eval_s = await self.loop.compute(self.evaluate)  # the training thread: the model's
        log.info("learner: held-out accuracy %s training %.3f (%.2f s)", phase, accuracy, eval_s)
        await self.ctx.ctrl.send(Evaluated(phase=phase, accuracy=accuracy, eval_s=eval_s))

    async def serving_state(self, version: int):
        """The weights to publish (`ranks.publish_state`); a stream is gathered in the
        publisher's thread as it writes, the rest here, off the loop."""
        streams = getattr(self.publisher, "streams_state", False)
        state = await asyncio.to_thread(publish_state, self.trainer, self.cfg, streams=streams)
        return canary.corrupt(state, version, from_version=self.canary_fault)

    async def score_canary(self) -> CanaryReference | None:
        """The learner's log-probs of the canary under the weights as they are now (one forward
        on the training thread), or None when the canary is off."""
        if not self.canary_ids:
            return None
        pad = self.tokenizer.pad_token_id or 0
        return await self.loop.compute(
            lambda: canary.reference(self.model, self.canary_ids, pad_token_id=pad)
        )

    async def publish(self, version: int, reference: CanaryReference | None):
        """Publish `version`, its announcements carrying the canary's `reference`."""

        async def announce(msg) -> None:
            await self.ctx.ctrl.send(msgspec.structs.replace(msg, canary=reference) if reference else msg)

        return await self.publisher.publish(await self.serving_state(version), version, announce)

    async def send_left(self) -> None:
        left = self.loop.take_left()
        if left is not None:
            await self.ctx.ctrl.send(GroupsLeft(version=self.version, **left))

    def weights_root(self) -> Path:
        w = self.ctx.config.weights
        return Path(w.dir) if w.dir else self.ctx.run_dir / "weights"

    def save_final(self, version: int, state: dict[str, torch.Tensor]) -> None:
        """The final weights (gathered in float32) as a Hugging Face directory."""
        self.save_model(self.ctx.run_dir / "final_model", state)

    def save_for_eval(self, version: int, state: dict[str, torch.Tensor]) -> None:
        """`version`'s weights (float32) for the background evaluation, written whole under a
        temporary name first: the evaluator never sees a half-written directory."""
        out = eval_snapshot_dir(self.ctx.run_dir, version)
        tmp = out.with_name(f".{out.name}.tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        self.save_model(tmp, state)
        shutil.rmtree(out, ignore_errors=True)
        os.replace(tmp, out)

    def save_model(self, out: Path, state: dict[str, torch.Tensor]) -> None:
        lora.base_model(self.model).save_pretrained(out, state_dict=state, safe_serialization=True)
        self.tokenizer.save_pretrained(out)

    async def run(self) -> None:
        try:
            if self.ranks is not None:
                await self.ranks.start()
            await asyncio.to_thread(self.setup)
            await self.ctx.hello(endpoint=self.data.address, note=gradient_mode(self.trainer.fallback))
            if self.start_version > 0:
                # Resumed: generators start from the base model, so hand them this version first.
                await self.publish(self.version, await self.score_canary())
                await self.send_left()  # groups the restored buffer set aside free their credits
            async with asyncio.TaskGroup() as tg:
                loops = [tg.create_task(self.data_loop(), name="learner-data")]
                if self.ranks is not None:
                    loops.append(tg.create_task(self.ranks.supervise(), name="learner-ranks"))
                ctrl = tg.create_task(self.ctrl_loop(), name="learner-ctrl")
                await tg.create_task(self.train_loop(), name="learner-train")
                if self.trainer.world_size == 1 and self.cfg.steps > self.version > self.start_version:
                    # Stopped early (Ctrl-C or a failure elsewhere): keep what was trained. (Several
                    # ranks may be inside a step's collectives: their last periodic checkpoint stands.)
                    path = learner_checkpoint_path(self.ctx.run_dir, self.version)
                    if not path.exists():
                        held = self.loop.held(after_step=self.version - 1)
                        await asyncio.to_thread(
                            save_learner_checkpoint, self.ctx.run_dir, self.version, self.trainer, held
                        )
                await ctrl  # finished training: wait for the launcher's Shutdown
                for t in loops:
                    t.cancel()
        finally:
            if self.ranks is not None:
                await self.ranks.stop()
            self.data.close()


def drop_published_from(root: Path, version: int) -> None:
    """Resume: versions >= `version` published by the interrupted run are republished (or never
    reached) by this one; remove them so the shard writer starts clean."""
    import shutil

    from asyncrl.transport.retention import list_versions, version_dir

    if root.is_dir():
        for v in list_versions(root):
            if v >= version:
                shutil.rmtree(version_dir(root, v), ignore_errors=True)


def _invalid_mask(ids, mask) -> str:
    if mask is None:
        return ""
    if mask.dtype != torch.bool or mask.shape != ids.shape:
        return f"loss_mask must be bool [T] = [{len(ids)}], got {mask.dtype} {list(mask.shape)}"
    return ""  # all False is allowed: the sample counts in its group's baseline, trains no token


def _invalid_opd(ids, opd: list, cfg: OpdConfig) -> str:
    """Why a trajectory's OPD frames are unusable ("" if fine, or if OPD is off and none came)."""
    if not cfg.enabled:
        return "" if not opd else "teacher frames sent but opd.enabled is false"
    if len(opd) != 3:
        return "opd.enabled: expected teacher log-probs, cached ids and their behavior log-probs"
    teacher, cached, behav = opd
    shape = (len(ids), cfg.num_samples)
    if not (teacher.shape == cached.shape == behav.shape == shape):
        return f"OPD arrays must be [T, N] = {list(shape)}, got {[list(t.shape) for t in opd]}"
    if cached.dtype != torch.int64 or not (teacher.is_floating_point() and behav.is_floating_point()):
        return "wrong OPD tensor dtypes"
    if not torch.equal(cached[:, 0], ids):
        return "opd_ids[:, 0] must be the sampled tokens"
    if not bool(torch.isfinite(behav).all()):
        return "OPD log-probs must be finite"
    if not bool(torch.isfinite(teacher).all()) and not _unscored_rows(teacher, cfg):
        return "OPD teacher log-probs must be finite (NaN rows only past a distillation horizon, opd.horizon)"
    return ""


def _unscored_rows(teacher, cfg: OpdConfig) -> bool:
    """With opd.horizon, a teacher leaves the rows past it unscored: whole NaN rows (docs/opd.md)."""
    finite, nan = torch.isfinite(teacher), torch.isnan(teacher)
    return cfg.horizon > 0 and bool((finite.all(-1) | nan.all(-1)).all())


def _invalid_top_k(ids, msg: Trajectory, tensors, cfg: OpdConfig) -> str:
    """Why a trajectory's teacher top-K frames are unusable ("" if fine): [T, K] int64 ids in
    the vocabulary's range and finite float log-probs, K = opd.teacher_top_k (none when 0)."""
    refs = (msg.teacher_top_ids, msg.teacher_top_logprobs)
    want = cfg.teacher_top_k if cfg.enabled else 0
    if want == 0:
        return "" if refs == (None, None) else "teacher top-K frames sent but opd.teacher_top_k is 0"
    if None in refs:
        return f"opd.teacher_top_k = {want}: expected the teacher's top-K ids and log-probs"
    top_ids, top_logps = (tensors[r.frame] for r in refs)
    shape = (len(ids), want)
    if not (tuple(top_ids.shape) == tuple(top_logps.shape) == shape):
        return f"teacher top-K arrays must be [T, K] = {list(shape)}, got {list(top_ids.shape)}, {list(top_logps.shape)}"
    if top_ids.dtype != torch.int64 or not top_logps.is_floating_point() or bool((top_ids < 0).any()):
        return "teacher top-K: int64 ids >= 0 and float log-probs expected"
    if not bool(torch.isfinite(top_logps).all()) and not _unscored_rows(top_logps, cfg):
        return "teacher top-K log-probs must be finite (NaN rows only past a distillation horizon)"
    return ""


def _invalid(msg: Trajectory, ids, logps, versions, *, num_steps: int) -> str:
    """Why a trajectory cannot be trained on ("" if it can); checked before it is buffered."""
    if not (ids.ndim == logps.ndim == versions.ndim == 1):
        return "tensors must be 1-D"
    if not (ids.shape[0] == logps.shape[0] == versions.shape[0] >= 1):
        return f"{ids.shape[0]} tokens, {logps.shape[0]} log-probs, {versions.shape[0]} versions"
    if ids.dtype != torch.int64 or versions.dtype != torch.int64 or not logps.is_floating_point():
        return "wrong tensor dtypes"
    if not 0 <= msg.sample_index < msg.num_samples or not 0 <= msg.window < num_steps:
        return f"sample {msg.sample_index}/{msg.num_samples} for window {msg.window} is out of range"
    lowest, highest = torch.aminmax(logps)  # one reduction: NaN propagates into both
    if not (math.isfinite(float(lowest)) and float(highest) <= 0):
        return "behavior log-probs must be finite and <= 0"
    if not msg.prompt_ids or len(msg.prompt_ids) + ids.shape[0] > MAX_SEQUENCE_TOKENS:
        return "empty prompt or sequence too long"
    return ""


async def main(ctx: ChildContext) -> None:
    await LearnerService(ctx).run()


if __name__ == "__main__":
    run_child("learner", main)
