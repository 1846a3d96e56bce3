"""The pure parts of `asyncrl bench env`: the lockstep barrier, the stand-in learner's idle
fraction, and the workload's tail."""

from __future__ import annotations

import asyncio
import random

from asyncrl.benchmarks.env import Lockstep, learner_idle_fraction
from asyncrl.benchmarks.env_workload import SIGMA_P99_20, step_seconds


def test_lockstep_releases_a_turn_when_every_live_episode_asked():
    async def go():
        gate = Lockstep(3)
        order = []

        async def episode(name, turns):
            for t in range(turns):
                await gate.arrive()
                order.append((t, name))
            gate.leave()

        await asyncio.gather(episode("a", 1), episode("b", 2), episode("c", 3))
        return order

    order = asyncio.run(go())
    turns = [t for t, _ in order]
    assert turns == sorted(turns)  # nobody starts turn t + 1 before every live episode started turn t
    assert sorted(order) == [(0, "a"), (0, "b"), (0, "c"), (1, "b"), (1, "c"), (2, "c")]


def test_learner_idle_fraction_by_hand():
    # batches of 2: complete at 1.0 and 3.0; steps of 0.5 -> busy 1.0 of a 3.5 s span
    assert (
        abs(learner_idle_fraction([0.2, 1.0, 2.0, 3.0], 3.0, batch=2, step_s=0.5) - (1 - 1.0 / 3.5)) < 1e-12
    )
    # a learner slower than arrivals is never idle after its first batch
    assert learner_idle_fraction([0.0, 0.0, 0.0, 0.0], 0.0, batch=2, step_s=1.0) == 0.0


def test_the_workload_tail_is_twenty_times_the_median():
    rng = random.Random(0)
    draws = sorted(step_seconds(rng, median_s=1.0, sigma=SIGMA_P99_20) for _ in range(200_000))
    median, p99 = draws[len(draws) // 2], draws[int(len(draws) * 0.99)]
    assert abs(median - 1.0) < 0.02 and abs(p99 / median - 20.0) < 1.0
