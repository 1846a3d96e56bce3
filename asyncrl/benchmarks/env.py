"""`asyncrl bench env`: environment-level async against lockstep sync on heavy-tailed episodes.

Episodes of `--turns` model turns on the default model (the torch generator's turn server: real
decoding, continuous batching), whose environment steps take log-normal time with p99 = 20 x
median (`env_workload.py`). Three ways to run the same episodes, `--concurrency` at a time:

  lockstep     sync baseline: a batch of `concurrency` episodes; every turn waits until every live
               episode of the batch has its environment's answer, decodes all turns together,
               then steps all environments; the next batch starts when the batch is done
  serial-env   async episodes (a new one starts as soon as one ends, turns decode as they come),
               but one environment step at a time (no environment concurrency)
  env-async    async episodes and concurrent environment steps (the episode runner as it ships)

Per mode: samples/s (episodes per second), the generator's idle fraction (its decoding thread
had no turn to decode), and the learner's idle fraction for a stand-in learner that trains each
`concurrency` episodes, in the order they finish, for `--learner-step-s` (a model of the learner:
only its waiting is measured). Repeats are interleaved (lockstep, serial-env, env-async, then
again) and the medians reported, with the ratios to lockstep.

    asyncrl bench env [--episodes 64] [--concurrency 16] [--turns 4] [--median-ms 50] [--repeats 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from typing import Any

from asyncrl.environments.base import EnvironmentContext
from asyncrl.environments.host import InProcessHost
from asyncrl.generators.episode_runner import Budgets, EpisodeRunner, TurnRequest

MODES = ("lockstep", "serial-env", "env-async")


class Lockstep:
    """A barrier over a batch's live episodes: a turn starts when every live episode asked for one."""

    def __init__(self, live: int) -> None:
        self.live = live
        self.waiting: list[asyncio.Future] = []

    async def arrive(self) -> None:
        fut = asyncio.get_running_loop().create_future()
        self.waiting.append(fut)
        self._release()
        await fut

    def leave(self) -> None:
        self.live -= 1
        self._release()

    def _release(self) -> None:
        if self.waiting and len(self.waiting) >= self.live:
            for fut in self.waiting:
                fut.set_result(None)
            self.waiting = []


class GatedBackend:
    """A backend whose turns wait at a `Lockstep` barrier first."""

    def __init__(self, inner: Any, gate: Lockstep) -> None:
        self.inner = inner
        self.gate = gate

    @property
    def version(self) -> int:
        return self.inner.version

    async def turn(self, request: TurnRequest):
        await self.gate.arrive()
        return await self.inner.turn(request)


class SerialHost(InProcessHost):
    """An in-process host that steps one environment at a time."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.lock = asyncio.Lock()

    async def step(self, handle, action):
        async with self.lock:
            return await super().step(handle, action)


def make_tasks(tokenizer, num: int, max_new_tokens: int):
    from asyncrl.config_sections import TaskConfig
    from asyncrl.messages import PromptTask, SamplingParams
    from asyncrl.tasks.arithmetic import addition_task

    task = addition_task(TaskConfig())
    problems = [task.train_problem(i) for i in range(num)]
    ids = task.render(problems, tokenizer)
    sampling = SamplingParams(temperature=1.0, max_new_tokens=max_new_tokens)
    return [
        PromptTask(
            task_id=i,
            group_id=i,
            prompt_ids=p,
            num_samples=1,
            sampling=sampling,
            dataset_index=i,
            window=0,
            answer=pr.answer,
        )
        for i, (p, pr) in enumerate(zip(ids, problems, strict=True))
    ]


def learner_idle_fraction(finish_s: list[float], wall_s: float, *, batch: int, step_s: float) -> float:
    """Idle fraction of a learner that trains each `batch` episodes (in finishing order) for
    `step_s`, starting when the batch is complete and the previous step is done."""
    ends = sorted(finish_s)
    free_at = busy = 0.0
    for i in range(batch - 1, len(ends), batch):
        start = max(free_at, ends[i])
        free_at = start + step_s
        busy += step_s
    total = max(wall_s, free_at)
    return 1.0 - busy / total if total > 0 else 0.0


async def run_mode(mode: str, gen, tasks, args) -> dict[str, float]:
    from asyncrl.benchmarks.env_workload import latency
    from asyncrl.generators.episodes import TorchTurnServer

    opts = {"turns": args.turns, "median_s": args.median_ms / 1000.0}
    host_cls = SerialHost if mode == "serial-env" else InProcessHost
    host = host_cls(latency, EnvironmentContext(options=opts), timeout_s=600.0)
    turns = TorchTurnServer(gen, stop_ids=[], capacity=args.concurrency)
    budgets = Budgets(max_turns=args.turns, max_tokens=10**6, max_episode_s=10**6)
    turns.start()
    began = time.perf_counter()
    finish: list[float] = []
    try:
        if mode == "lockstep":
            for first in range(0, len(tasks), args.concurrency):
                batch = tasks[first : first + args.concurrency]
                gate = Lockstep(len(batch))
                runner = EpisodeRunner(GatedBackend(turns, gate), host, gen.tokenizer, budgets)

                async def one(t, runner=runner, gate=gate):
                    try:
                        await runner.run(t, 0, base_seed=t.task_id)
                    finally:
                        gate.leave()
                    finish.append(time.perf_counter() - began)

                await asyncio.gather(*(one(t) for t in batch))
        else:
            runner = EpisodeRunner(turns, host, gen.tokenizer, budgets)
            slots = asyncio.Semaphore(args.concurrency)

            async def one(t):
                async with slots:
                    await runner.run(t, 0, base_seed=t.task_id)
                finish.append(time.perf_counter() - began)

            await asyncio.gather(*(one(t) for t in tasks))
    finally:
        await asyncio.to_thread(turns.stop)
    wall = time.perf_counter() - began
    return {
        "samples_per_s": len(tasks) / wall,
        "generator_idle": turns.idle_s / wall,
        "learner_idle": learner_idle_fraction(
            finish, wall, batch=args.concurrency, step_s=args.learner_step_s
        ),
        "wall_s": wall,
    }


def measure(args) -> dict[str, Any]:
    from asyncrl.benchmarks.env_workload import SIGMA_P99_20
    from asyncrl.generators.torch_gen import TorchGenerator
    from asyncrl.models.default import DEFAULT_MODEL_DIR
    from asyncrl.testing.contract import make_context

    gen = TorchGenerator()
    gen.setup(make_context(args.model or DEFAULT_MODEL_DIR, threads=args.threads))
    tasks = make_tasks(gen.tokenizer, args.episodes, args.max_new_tokens)
    asyncio.run(run_mode("env-async", gen, tasks[: args.concurrency], args))  # warm-up
    runs: dict[str, list[dict[str, float]]] = {m: [] for m in MODES}
    for _ in range(args.repeats):
        for mode in MODES:
            runs[mode].append(asyncio.run(run_mode(mode, gen, tasks, args)))
    med = {m: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for m, rs in runs.items()}
    base = med["lockstep"]["samples_per_s"]
    return {
        "workload": {
            "episodes": args.episodes,
            "concurrency": args.concurrency,
            "turns": args.turns,
            "max_new_tokens_per_turn": args.max_new_tokens,
            "step_median_ms": args.median_ms,
            "step_sigma": round(SIGMA_P99_20, 4),
            "step_p99_over_median": 20,
            "learner_step_s": args.learner_step_s,
            "repeats": args.repeats,
        },
        "medians": med,
        "speedup_vs_lockstep": {m: med[m]["samples_per_s"] / base for m in MODES},
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="asyncrl bench env", description=__doc__.split("\n\n")[0])
    p.add_argument("--episodes", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=16, help="episodes in flight (lockstep: the batch)")
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=4, help="model tokens per turn")
    p.add_argument("--median-ms", type=float, default=50.0, help="median environment step")
    p.add_argument("--learner-step-s", type=float, default=0.25, help="the stand-in learner's step per batch")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--model", default="", help="a model directory (default: the shipped model)")
    p.add_argument("--out", default="", help="also write the result as JSON here")
    args = p.parse_args(argv)
    result = measure(args)
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
