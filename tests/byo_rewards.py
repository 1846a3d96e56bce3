"""Rewards for the bring-your-own-task launches (tests/integration/test_byo_task.py), imported by
`pkg.mod:fn` path in the generators' reward workers. Each misbehaves on a fixed, known set of
rows (the dataset's `row` extra field), so a test knows exactly which samples must fail."""

from __future__ import annotations

import fcntl
import os
import threading


def _row(sample) -> int:
    return int(sample.extras["row"])


def exact(sample) -> float:
    return 1.0 if sample.completion.strip() == sample.answer else 0.0


def raises_on_tenth(sample) -> float:
    """Raises on every tenth row (rows 0, 10, 20, ...): 10% of the samples."""
    if _row(sample) % 10 == 0:
        raise RuntimeError(f"verifier crashed on row {_row(sample)}")
    return exact(sample)


def hangs_on_tenth(sample) -> float:
    """Never returns on every tenth row (rows 3, 13, 23, ...)."""
    if _row(sample) % 10 == 3:
        threading.Event().wait()  # a verifier that never answers: blocks forever, by design
    return exact(sample)


def recording(path: str):
    """A factory: the reward appends the row of every sample it scores to `path` (one line each)."""

    def reward(sample) -> float:
        with open(path, "a") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            f.write(f"{_row(sample)} {os.getpid()}\n")
        return exact(sample)

    return reward


def degenerate_on_even_rows(sample) -> float:
    """Even rows: 1.0 for every sample (a group with equal rewards); odd rows: the completion's
    length parity, which differs between samples of a group almost always."""
    if _row(sample) % 2 == 0:
        return 1.0
    return float(len(sample.completion) % 2)
