"""Learner process: receives trajectories, trains one optimizer step per admission window,
publishes every new policy_version as versioned safetensors shards.

Sockets: PULL (bound, loopback) for Trajectory messages from generators; DEALER to the launcher
for Hello / StepDone / WeightsPublished / Metrics out and WeightsLoaded / Shutdown in. Torch work
runs in a worker thread so heartbeats and receives stay responsive.

Window s (the groups admitted for step s) is trained at policy_version s. Admission guarantees
that every token in it came from a version >= s - max_staleness; the learner asserts it again.

Run as `python -m asyncrl.learner.service --ctrl ADDR --peer-id learner --run-dir DIR --extra model=PATH`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

import msgspec
import torch
import zmq

from asyncrl.config import check_staleness_policy
from asyncrl.learner.step import TrainSample, accumulate_gradients, pack
from asyncrl.messages import Metrics, Shutdown, StepDone, Trajectory, WeightsLoaded
from asyncrl.runtime import ChildContext, run_child
from asyncrl.transport.publisher import make_publisher
from asyncrl.transport.zmq_io import Endpoint

log = logging.getLogger(__name__)

# Longer sequences than this are not from any generator of ours (a guard against garbage).
MAX_SEQUENCE_TOKENS = 1 << 20


class StalenessViolation(AssertionError):
    """A trajectory older than the configured bound reached the learner (an admission bug)."""


class LearnerService:
    def __init__(self, ctx: ChildContext) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.ctx = ctx
        cfg = ctx.config
        self.cfg = cfg.learner
        torch.set_num_threads(self.cfg.threads)
        torch.manual_seed(cfg.run.seed)
        model_path = Path(ctx.extra["model"])
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
        self.model.train()
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=self.cfg.lr, weight_decay=self.cfg.weight_decay, betas=(0.9, 0.99)
        )
        self.publisher = make_publisher(
            cfg,
            run_dir=ctx.run_dir,
            model_dir=model_path,
            generator_ids=filter(None, ctx.extra.get("generators", "").split(",")),
        )
        self.data = Endpoint(ctx.zmq_ctx, zmq.PULL, name="learner.data")
        self.data.bind_loopback()
        self.max_staleness = cfg.effective_max_staleness
        self.policy = check_staleness_policy(cfg.staleness)
        self.window_size = self.cfg.groups_per_step * self.cfg.samples_per_group
        self.windows: dict[int, list[TrainSample]] = {}
        self.seen: set[int] = set()
        self.num_duplicates = 0
        self.num_invalid = 0
        self.version = 0
        self.window_ready = asyncio.Event()
        self.stopping = False
        self.idle_s = 0.0
        self.busy_s = 0.0

    async def data_loop(self) -> None:
        while True:
            _, msg, tensors = await self.data.recv()
            if not isinstance(msg, Trajectory):
                log.error("learner: %s on the trajectory socket; dropped", type(msg).__name__)
                continue
            if msg.traj_id in self.seen:
                self.num_duplicates += 1
                log.error("learner: duplicate trajectory %d dropped", msg.traj_id)
                continue
            if msg.step < self.version:
                log.error(
                    "learner: trajectory %d for past step %d dropped (now at %d)",
                    msg.traj_id,
                    msg.step,
                    self.version,
                )
                continue
            ids, logps, versions = tensors
            problem = _invalid(msg, ids, logps, versions, num_steps=self.cfg.steps)
            if problem:
                self.num_invalid += 1
                log.error("learner: trajectory %d rejected: %s", msg.traj_id, problem)
                continue
            self.seen.add(msg.traj_id)
            self.windows.setdefault(msg.step, []).append(
                TrainSample(
                    traj_id=msg.traj_id,
                    group_id=msg.group_id,
                    sample_index=msg.sample_index,
                    prompt_ids=msg.prompt_ids,
                    completion_ids=ids.clone(),
                    behavior_logprobs=logps.clone(),
                    token_versions=versions.clone(),
                    reward=msg.reward,
                )
            )
            if len(self.windows.get(self.version, ())) >= self.window_size:
                self.window_ready.set()

    async def ctrl_loop(self) -> None:
        while True:
            _, msg, _ = await self.ctx.ctrl.recv()
            match msg:
                case WeightsLoaded():
                    self.publisher.on_loaded(msg.generator_id, msg.version)
                case Shutdown():
                    self.stopping = True
                    self.window_ready.set()
                    return
                case _:
                    log.error("learner: unexpected %s on the control socket; ignored", type(msg).__name__)

    def train_window(self, step: int, samples: list[TrainSample]) -> StepDone:
        """Runs in a worker thread; touches only the model, the optimizer and the weights dir."""
        start = time.perf_counter()
        batch = pack(samples, pad_token_id=self.tokenizer.pad_token_id)
        self.optimizer.zero_grad(set_to_none=True)
        stats = accumulate_gradients(
            self.model,
            batch,
            policy=self.policy,
            policy_version=step,
            temperature=max(self.ctx.config.sampling.temperature, 1e-6),
            clip_low=self.cfg.clip_low,
            clip_high=self.cfg.clip_high,
            micro_batch_size=self.cfg.micro_batch_size,
        )
        if stats.max_staleness > self.max_staleness:
            raise StalenessViolation(
                f"step {step}: a trajectory is {stats.max_staleness} versions stale, above the bound {self.max_staleness}"
            )
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.max_grad_norm))
        for group in self.optimizer.param_groups:
            group["lr"] = self.cfg.lr * stats.lr_scale  # VCPO scales this step only
        self.optimizer.step()
        version = step + 1
        train_s = time.perf_counter() - start
        done = StepDone(
            step=step,
            version=version,
            num_trajectories=len(samples),
            num_tokens=stats.num_tokens,
            loss=stats.loss,
            mean_reward=stats.mean_reward,
            max_staleness=stats.max_staleness,
            mean_staleness=stats.mean_staleness,
            clip_fraction=stats.clip_fraction,
            grad_norm=grad_norm,
            step_s=train_s,
            idle_s=0.0,
            lr_scale=stats.lr_scale,
            stats=stats.policy_stats,
        )
        return done

    async def train_loop(self) -> None:
        for step in range(self.cfg.steps):
            wait_start = time.perf_counter()
            while len(self.windows.get(step, ())) < self.window_size and not self.stopping:
                self.window_ready.clear()
                await self.window_ready.wait()
            if self.stopping:
                return
            idle = time.perf_counter() - wait_start
            self.idle_s += idle
            samples = self.windows.pop(step)
            busy_start = time.perf_counter()
            done = await asyncio.to_thread(self.train_window, step, samples)
            self.version = done.version
            state = {k: v.detach() for k, v in self.model.state_dict().items()}
            published = await self.publisher.publish(state, done.version, self.ctx.ctrl.send)
            if step == self.cfg.steps - 1:
                # The launcher ends the run on the last StepDone: the final model must exist by then.
                await asyncio.to_thread(self.save_final)
            self.busy_s += time.perf_counter() - busy_start
            await self.ctx.ctrl.send(msgspec.structs.replace(done, idle_s=idle))
            await self.ctx.ctrl.send(
                Metrics(
                    source="learner",
                    time_s=time.time(),
                    values={
                        "learner/idle_ratio": self.idle_s / max(1e-9, self.idle_s + self.busy_s),
                        "learner/duplicates": float(self.num_duplicates),
                        "learner/invalid_trajectories": float(self.num_invalid),
                        "learner/rejected_frames": float(self.data.num_rejected + self.ctx.ctrl.num_rejected),
                        "learner/publish_s": published.publish_s,
                    },
                )
            )

    def save_final(self) -> None:
        out = self.ctx.run_dir / "final_model"
        self.model.save_pretrained(out, safe_serialization=True)
        self.tokenizer.save_pretrained(out)

    async def run(self) -> None:
        await self.ctx.hello(endpoint=self.data.address)
        async with asyncio.TaskGroup() as tg:
            loops = [tg.create_task(self.data_loop(), name="learner-data")]
            ctrl = tg.create_task(self.ctrl_loop(), name="learner-ctrl")
            await tg.create_task(self.train_loop(), name="learner-train")
            await ctrl  # finished training: wait for the launcher's Shutdown
            for t in loops:
                t.cancel()
        self.data.close()


def _invalid(msg: Trajectory, ids, logps, versions, *, num_steps: int) -> str:
    """Why a trajectory cannot be trained on ("" if it can); checked before it is buffered."""
    if not (ids.ndim == logps.ndim == versions.ndim == 1):
        return "tensors must be 1-D"
    if not (len(ids) == len(logps) == len(versions) >= 1):
        return f"{len(ids)} tokens, {len(logps)} log-probs, {len(versions)} versions"
    if ids.dtype != torch.int64 or versions.dtype != torch.int64 or not logps.is_floating_point():
        return "wrong tensor dtypes"
    if not 0 <= msg.sample_index < msg.num_samples or not 0 <= msg.step < num_steps:
        return f"sample {msg.sample_index}/{msg.num_samples} for step {msg.step} is out of range"
    if not bool(torch.isfinite(logps).all()) or bool((logps > 0).any()):
        return "behavior log-probs must be finite and <= 0"
    if not msg.prompt_ids or len(msg.prompt_ids) + len(ids) > MAX_SEQUENCE_TOKENS:
        return "empty prompt or sequence too long"
    return ""


async def main(ctx: ChildContext) -> None:
    await LearnerService(ctx).run()


if __name__ == "__main__":
    run_child("learner", main)
