"""`python -m asyncrl.benchmarks.canary_cost`: what is counted (pairs after the warm-up, medians)
and its option checks; the measurement itself is a benchmark, never timed in tests."""

from __future__ import annotations

import pytest

from asyncrl.benchmarks import canary_cost


def test_pairs_after_the_warm_up_are_counted_as_medians():
    works = iter([100.0, 100.0, 1.0, 3.0, 2.0])  # the first WARMUP (2) are not counted
    canaries = iter([50.0, 50.0, 0.1, 0.3, 0.2])
    calls = []

    def work(i):
        calls.append(i)
        return next(works)

    assert canary_cost.WARMUP == 2
    assert canary_cost._median_pairs(work, lambda: next(canaries), 3) == (2.0, 0.2)
    assert calls == [0, 1, 2, 3, 4]  # each pair's work sees its index (the batch it samples)


def test_repeats_must_be_positive(capsys):
    with pytest.raises(SystemExit):
        canary_cost.main(["--repeats", "0"])
    assert "--repeats must be at least 1" in capsys.readouterr().err
