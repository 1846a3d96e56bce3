"""Generator process: the sockets around one `Generator` plugin.

Receives PromptTasks and WeightsPublished from the launcher (DEALER), pushes one Trajectory per
sample to the learner (PUSH, tensors as frames), and reports TaskDone / WeightsLoaded / Metrics
back. New weights are loaded between batches, so every token of a batch carries the version it
was sampled with (in-flight mode `keep` at batch granularity).

Run as `python -m asyncrl.generators.service --ctrl ADDR --peer-id ID --run-dir DIR --extra data=ADDR`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque

import torch
import zmq

from asyncrl.generators.base import GeneratorContext, Rollout, resolve_generator
from asyncrl.messages import (
    Metrics,
    PromptTask,
    Shutdown,
    TaskDone,
    Trajectory,
    WeightsLoaded,
    WeightsPublished,
)
from asyncrl.runtime import ChildContext, run_child
from asyncrl.transport.codec import tensor_ref
from asyncrl.transport.zmq_io import Endpoint

log = logging.getLogger(__name__)


def trajectory_frames(task: PromptTask, r: Rollout, generator_id: str, generate_s: float):
    """The Trajectory message for one rollout and its three tensor frames."""
    ids = torch.tensor(r.completion_ids, dtype=torch.int64)
    logps = torch.tensor(r.behavior_logprobs, dtype=torch.float32)
    versions = torch.tensor(r.token_versions, dtype=torch.int64)
    if not (len(ids) == len(logps) == len(versions)):
        raise ValueError(
            f"generator {generator_id}: rollout of task {task.task_id} has {len(ids)} tokens, "
            f"{len(logps)} log-probs and {len(versions)} versions; they must match"
        )
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
    )
    return msg, (ids, logps, versions)


class GeneratorService:
    def __init__(self, ctx: ChildContext) -> None:
        self.ctx = ctx
        cfg = ctx.config
        self.gen = resolve_generator(cfg.generators.kind)()
        model_path = ctx.extra["model"]
        self.gen.setup(
            GeneratorContext(
                generator_id=ctx.peer_id,
                model_path=model_path,
                sampling=cfg.sampling,
                task=cfg.task,
                seed=cfg.run.seed * 1000 + int(ctx.extra.get("index", "0")),
                threads=cfg.generators.threads,
            )
        )
        self.data = Endpoint(ctx.zmq_ctx, zmq.PUSH, name=f"{ctx.peer_id}.data")
        self.data.connect(ctx.extra["data"])
        self.pending: deque[PromptTask] = deque()
        self.latest_weights: WeightsPublished | None = None
        self.wake = asyncio.Event()
        self.stopping = False
        self.num_samples = 0
        self.num_tokens = 0
        self.busy_s = 0.0
        self.started = time.perf_counter()

    async def recv_loop(self) -> None:
        while not self.stopping:
            _, msg, _ = await self.ctx.ctrl.recv()
            match msg:
                case PromptTask():
                    self.pending.append(msg)
                case WeightsPublished():
                    if self.latest_weights is None or msg.version > self.latest_weights.version:
                        self.latest_weights = msg
                case Shutdown():
                    self.stopping = True
                case _:
                    log.error(
                        "%s: unexpected %s on the control socket; ignored",
                        self.ctx.peer_id,
                        type(msg).__name__,
                    )
            self.wake.set()

    async def maybe_load_weights(self) -> None:
        w = self.latest_weights
        if w is None or w.version <= self.gen.version:
            return
        start = time.perf_counter()
        await self.gen.load_weights(w.version, w.location)
        load_s = time.perf_counter() - start
        await self.ctx.ctrl.send(
            WeightsLoaded(generator_id=self.ctx.peer_id, version=w.version, load_s=load_s)
        )

    async def work_loop(self) -> None:
        max_groups = self.ctx.config.generators.max_batch_groups
        while not self.stopping:
            await self.wake.wait()
            self.wake.clear()
            await self.maybe_load_weights()
            while self.pending and not self.stopping:
                batch = [self.pending.popleft() for _ in range(min(max_groups, len(self.pending)))]
                await self.run_batch(batch)
                await self.maybe_load_weights()

    async def run_batch(self, batch: list[PromptTask]) -> None:
        start = time.perf_counter()
        rollouts = await self.gen.generate(batch)
        elapsed = time.perf_counter() - start
        self.busy_s += elapsed
        by_task: dict[int, list[Rollout]] = {t.task_id: [] for t in batch}
        for r in rollouts:
            if r.task_id not in by_task:
                raise ValueError(
                    f"generator returned a rollout for task {r.task_id}, which was not in the batch"
                )
            by_task[r.task_id].append(r)
        for task in batch:
            group = by_task[task.task_id]
            if sorted(r.sample_index for r in group) != list(range(task.num_samples)):
                raise ValueError(
                    f"generator {self.ctx.peer_id} returned samples {sorted(r.sample_index for r in group)} "
                    f"for task {task.task_id}; expected 0..{task.num_samples - 1} exactly once"
                )
            num_tokens = 0
            for r in group:
                msg, tensors = trajectory_frames(task, r, self.ctx.peer_id, elapsed)
                await self.data.send(msg, tensors)
                num_tokens += len(r.completion_ids)
            self.num_samples += len(group)
            self.num_tokens += num_tokens
            await self.ctx.ctrl.send(
                TaskDone(
                    task_id=task.task_id,
                    generator_id=self.ctx.peer_id,
                    num_trajectories=len(group),
                    num_tokens=num_tokens,
                    generate_s=elapsed,
                    mean_reward=sum(r.reward for r in group) / len(group),
                )
            )
        wall = time.perf_counter() - self.started
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
                },
            )
        )

    async def run(self) -> None:
        await self.ctx.hello()
        async with asyncio.TaskGroup() as tg:
            recv = tg.create_task(self.recv_loop(), name="gen-recv")
            await tg.create_task(self.work_loop(), name="gen-work")
            recv.cancel()
        await self.gen.close()
        self.data.close()


async def main(ctx: ChildContext) -> None:
    await GeneratorService(ctx).run()


if __name__ == "__main__":
    run_child("generator", main)
