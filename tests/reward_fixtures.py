"""Reward functions for the reward tests, importable as `tests.reward_fixtures:<name>` by the
worker processes of asyncrl.rewards.pool (which start fresh and import them by path).

Each misbehaves on a marker completion so a test can pin which samples fail.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time

from asyncrl.rewards.base import RewardInput


def trivial(sample: RewardInput) -> float:
    return 1.0


def length(sample: RewardInput) -> float:
    """len(completion): a value that tells samples apart, so order mistakes show."""
    return float(len(sample.completion))


def scaled(factor: float):
    """A factory (a `pkg.mod:fn` path with options): length * factor."""

    def reward(sample: RewardInput) -> float:
        return factor * len(sample.completion)

    return reward


def misbehave(sample: RewardInput) -> object:
    """Raises on "raise", hangs forever on "hang", returns NaN on "nan", a string on "str",
    exits its process on "exit"; otherwise len(completion)."""
    match sample.completion:
        case "raise":
            raise ValueError("bad sample")
        case "hang":
            threading.Event().wait()  # never set: a hung reward
        case "nan":
            return float("nan")
        case "str":
            return "abc"
        case "exit":
            os._exit(3)
    return float(len(sample.completion))


def pid(sample: RewardInput) -> float:
    """The worker's pid, so tests see which process scored a sample."""
    return float(os.getpid())


async def async_misbehave(sample: RewardInput) -> float:
    """Async: hangs on "hang", raises on "raise"; otherwise len(completion)."""
    if sample.completion == "hang":
        await asyncio.Event().wait()
    if sample.completion == "raise":
        raise RuntimeError("async bad sample")
    return float(len(sample.completion))


def torch_imported(sample: RewardInput) -> float:
    """1.0 when torch is loaded in this process (reward workers must stay light)."""
    import sys

    return float("torch" in sys.modules)


class AsyncCallable:
    """An object with `async def __call__`: an async reward."""

    async def __call__(self, sample: RewardInput) -> float:
        return 2.0


def number_factory(n: int) -> int:
    """A factory that returns no reward (resolution must reject it)."""
    return n


def failing_factory(**options: object):
    raise RuntimeError(f"cannot build with {options}")


def slow(sample: RewardInput) -> float:
    """Sleeps the seconds its completion names ("slow:1.5"), then len(completion); else at once."""
    if sample.completion.startswith("slow:"):
        # The workload under test (a reward that takes this long), not a synchronisation.
        time.sleep(float(sample.completion.split(":")[1]))
    return float(len(sample.completion))


def hang_fraction(fraction: float = 0.1):
    """A reward that never returns for `fraction` of the prompts (by a hash of the prompt: every
    sample of such a group hangs) and scores the others 1 when their last boxed number is the
    answer (the word-problems reward), else 0."""
    import re
    import zlib

    def reward(sample: RewardInput) -> float:
        if zlib.crc32(sample.prompt.encode()) % 1000 < fraction * 1000:
            threading.Event().wait()  # never set: a hung verifier
        boxed = re.findall(r"\\boxed\{([^}]*)\}", sample.completion)
        return float(bool(boxed) and boxed[-1].strip() == sample.answer.strip())

    return reward


def slow_ppid(sample: RewardInput) -> float:
    """As `slow`, then the parent pid of the process that scored it (which process started it)."""
    slow(sample)
    return float(os.getppid())


def spin_pid(sample: RewardInput) -> float:
    """Computes (a busy loop, no sleep) for the seconds its completion names ("spin:1.5"), then
    returns the scoring process's pid: a reward that is slow, not hung."""
    if sample.completion.startswith("spin:"):
        # The workload under test (a reward that computes this long), not a synchronisation.
        end = time.monotonic() + float(sample.completion.split(":")[1])
        while time.monotonic() < end:
            pass
    return float(os.getpid())
