"""Environments for the environment tests (plugins by `tests.support.env_envs:NAME` path).

`digits`: three model turns; after each, the environment answers with digits (text), so with the
BPE model of `env_models.py` a re-tokenised episode merges model and environment tokens.
`hostile`: what a hostile or broken environment does, chosen per episode (`HOSTILE_KINDS`, by
task_id x 4 + sample_index modulo their number, or of those named by the `kinds` option);
"behave" ones are `digits` episodes.
"""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

from asyncrl.environments.base import Action, EnvironmentContext, EpisodeStart, Observation, StepResult


class DigitsEnv:
    def __init__(self, turns: int = 3) -> None:
        self.turns = turns

    async def reset(self, start: EpisodeStart) -> Observation:
        self.start = start
        return Observation()

    async def step(self, action: Action) -> StepResult:
        if action.turn + 1 >= self.turns:
            return StepResult(reward=float("1" in action.text), done=True)
        return StepResult(observation=Observation(text=str(2 + action.turn) * 2), reward=0.0)


def digits(ctx: EnvironmentContext) -> DigitsEnv:
    return DigitsEnv(**ctx.options)


OFFERS: list = []  # a test's hooks, each called once by the first `offering` step that finds it


class OfferingEnv(DigitsEnv):
    """`digits`, whose first step to get there runs the hooks in OFFERS (e.g. offers new weights)."""

    async def step(self, action: Action) -> StepResult:
        while OFFERS:
            OFFERS.pop()()
        return await super().step(action)


def offering(ctx: EnvironmentContext) -> OfferingEnv:
    return OfferingEnv()


HOSTILE_KINDS = (
    "raise",
    "hang",
    "die",
    "allocate",
    "write_outside",
    "network",
    "malformed",
    "runaway",
    "behave",
)


def hostile_kind(start: EpisodeStart, kinds: str = "") -> str:
    """The episode's kind, from `kinds` (comma-separated; "" = all of HOSTILE_KINDS)."""
    chosen = kinds.split(",") if kinds else HOSTILE_KINDS
    return chosen[(start.task_id * 4 + start.sample_index) % len(chosen)]


class HostileEnv(DigitsEnv):
    """Misbehaves at its first step as its problem says; `probe` (options) is a directory and a
    port the test watches: a write outside the jail lands in the directory, a connection reaches
    the port."""

    def __init__(self, ctx: EnvironmentContext) -> None:
        super().__init__(turns=2)
        self.opts = ctx.options

    async def step(self, action: Action) -> StepResult:
        kind = hostile_kind(self.start, self.opts.get("kinds", ""))
        if kind == "runaway":  # never done: only a budget ends it
            return StepResult(observation=Observation(text="1"))
        if action.turn == 0 and kind != "behave":
            return await getattr(self, f"_{kind}")()
        return await super().step(action)

    async def _raise(self) -> StepResult:
        raise RuntimeError("hostile environment: raised")

    async def _hang(self) -> StepResult:
        # The hostile behaviour under test, not a synchronisation: a step that blocks its worker's
        # event loop for good, so only env.step_timeout_s killing the worker ends it.
        time.sleep(3600)
        raise AssertionError("unreachable")

    async def _die(self) -> StepResult:
        os._exit(3)  # the worker process is gone, mid-step

    async def _allocate(self) -> StepResult:
        hog = bytearray(8 << 30)  # 8 GiB: past the worker's address-space limit
        return StepResult(observation=Observation(text=str(len(hog))))

    async def _write_outside(self) -> StepResult:
        target = Path(self.opts["probe_dir"]) / f"escaped-{os.getpid()}"
        target.write_text("written outside the jail")
        return StepResult(observation=Observation(text="1"))

    async def _network(self) -> StepResult:
        with socket.create_connection(("127.0.0.1", int(self.opts["probe_port"])), timeout=5):
            pass
        return StepResult(observation=Observation(text="1"))

    async def _malformed(self) -> StepResult:
        return {"observation": "not a StepResult"}  # type: ignore[return-value]


def hostile(ctx: EnvironmentContext) -> HostileEnv:
    return HostileEnv(ctx)
