"""The environment of `asyncrl bench env`: multi-turn episodes whose steps take heavy-tailed time.

Each step waits a log-normal time (an I/O-bound environment: a tool call, a remote judge), drawn
from the episode's own seed, so every mode of the benchmark sees the same latencies for the same
episodes. With `sigma = ln(20) / z_0.99` (about 1.288) the 99th percentile is 20 times the median.
The episode ends after `turns` model turns; each step answers one token ("1").
"""

from __future__ import annotations

import asyncio
import math
import random
from statistics import NormalDist

from asyncrl.environments.base import Action, EnvironmentContext, EpisodeStart, Observation, StepResult

P99_OVER_MEDIAN = 20.0
SIGMA_P99_20 = math.log(P99_OVER_MEDIAN) / NormalDist().inv_cdf(0.99)


def step_seconds(rng: random.Random, *, median_s: float, sigma: float) -> float:
    """One log-normal step time with the given median."""
    return median_s * math.exp(sigma * rng.gauss(0.0, 1.0))


class LatencyEnv:
    def __init__(self, *, turns: int = 4, median_s: float = 0.05, sigma: float = SIGMA_P99_20) -> None:
        self.turns = turns
        self.median_s = median_s
        self.sigma = sigma
        self.rng = random.Random(0)

    async def reset(self, start: EpisodeStart) -> Observation:
        self.rng = random.Random(f"{start.task_id}:{start.sample_index}")
        return Observation()

    async def step(self, action: Action) -> StepResult:
        await asyncio.sleep(step_seconds(self.rng, median_s=self.median_s, sigma=self.sigma))
        done = action.turn + 1 >= self.turns
        return StepResult(observation=Observation(text="1"), reward=float(done), done=done)


def latency(ctx: EnvironmentContext) -> LatencyEnv:
    """The factory (`env.kind = "asyncrl.benchmarks.env_workload:latency"`); options: turns,
    median_s, sigma."""
    opts = dict(ctx.options)
    return LatencyEnv(
        turns=int(opts.get("turns", 4)),
        median_s=float(opts.get("median_s", 0.05)),
        sigma=float(opts.get("sigma", SIGMA_P99_20)),
    )
