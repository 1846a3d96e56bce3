"""`asyncrl bench learner-step` (asyncrl/benchmarks/learner_step.py): what is timed and what is
counted, with stand-in steps; the real steps run only in the benchmark. Nothing is timed here."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from asyncrl.benchmarks.cli import bench_app
from asyncrl.benchmarks.learner_step import WARMUP, interleaved_medians


def test_steps_interleave_batch_by_batch_and_the_first_pass_warms_up():
    calls: list[tuple[str, int]] = []

    def step(kind: str, seconds: dict[int, float]):
        def timed(batch: int) -> float:
            calls.append((kind, batch))
            return seconds[batch]

        return timed

    batches = [0, 1, 2, 3]
    # The warm-up batches are slow; every later one takes its batch number in seconds (learner)
    # or ten times that (plain), so the medians say which samples were counted.
    learner = step("learner", {0: 100.0, 1: 100.0, 2: 2.0, 3: 3.0})
    plain = step("plain", {0: 100.0, 1: 100.0, 2: 20.0, 3: 30.0})
    assert WARMUP == 2
    assert interleaved_medians(learner, plain, batches, repeats=1) == (2.5, 25.0)
    assert calls == [(kind, b) for b in batches for kind in ("learner", "plain")]
    calls.clear()
    # Later passes count every batch: [2, 3] + [100, 100, 2, 3] -> median of 6 values.
    assert interleaved_medians(learner, plain, batches, repeats=2) == (3.0, 30.0)
    assert len(calls) == 2 * 2 * len(batches)


@pytest.mark.parametrize(
    ("args", "message"), [(["--repeats", "0"], "--repeats"), (["--threads", "-1"], "--threads")]
)
def test_bad_options_fail_before_any_work(args, message):
    result = CliRunner().invoke(bench_app, ["learner-step", *args])
    assert result.exit_code != 0
    assert message in result.output
