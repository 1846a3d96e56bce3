"""Background evaluation's launcher half (asyncrl/scheduler/evals.py) with a stand-in evaluator
command (a Python one-liner), and its pass@k arithmetic (asyncrl/evaluator.py)."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

import pytest

from asyncrl.evaluator import pass_at_k
from asyncrl.messages import EvalDue
from asyncrl.scheduler.evals import BackgroundEvals
from asyncrl.scheduler.records import read_records

# Prints the version's result as the evaluator does (accuracy = version / 10) once the test writes
# a word to the FIFO "gate" in its weights directory (so the test decides when it finishes): "go",
# or "fail" to make it fail. Reading a FIFO blocks until a word comes: no polling.
STAND_IN = (
    "import json, os, sys; run, v, path = sys.argv[1:]; "
    "word = open(os.path.join(path, 'gate')).readline().strip(); "
    "sys.exit('bad weights') if word == 'fail' else None; "
    "print(json.dumps({'version': int(v), 'accuracy': int(v) / 10}))"
)


def _due(tmp_path: Path, version: int) -> EvalDue:
    path = tmp_path / f"v{version}"
    path.mkdir()
    os.mkfifo(path / "gate")
    return EvalDue(version=version, path=str(path))


@pytest.fixture
def gates():
    """`gates(due, word)` tells a stand-in evaluator what to do. The FIFO is opened read-write, so
    the test never blocks whether or not the evaluator has started; the ends stay open until the
    test is over, so a word is not lost before the evaluator opens the FIFO."""
    fds: list[int] = []

    def say(due: EvalDue, word: str) -> None:
        fd = os.open(Path(due.path) / "gate", os.O_RDWR)
        os.write(fd, f"{word}\n".encode())
        fds.append(fd)

    yield say
    for fd in fds:
        os.close(fd)


def _evals(tmp_path: Path, max_pending: int = 2):
    results, events = [], []
    evals = BackgroundEvals(
        tmp_path,
        max_pending=max_pending,
        on_result=results.append,
        on_event=events.append,
        command=(sys.executable, "-c", STAND_IN),
    )
    return evals, results, events


def test_one_at_a_time_in_order_and_the_oldest_waiting_is_skipped(tmp_path: Path, gates) -> None:
    async def main():
        evals, results, events = _evals(tmp_path, max_pending=2)
        dues = [_due(tmp_path, v) for v in (2, 4, 6, 8)]
        for d in dues:
            evals.submit(d)  # 2 runs; 4, 6 wait; 8 arrives: 4 is skipped
        assert evals.skipped == [4] and not Path(dues[1].path).exists()
        assert "evaluation of version 4 skipped" in events[0]
        assert [d.version for d in evals.pending] == [6, 8]
        for d in (dues[0], dues[2], dues[3]):
            gates(d, "go")
        await evals.drain(timeout_s=60)
        return evals, results

    evals, results = asyncio.run(main())
    assert [r["version"] for r in results] == [2, 6, 8]  # in order, one process at a time
    assert [p["accuracy"] for p in evals.points()] == [0.2, 0.6, 0.8]


def test_a_failed_evaluation_is_an_event_not_a_failure(tmp_path: Path, gates) -> None:
    async def main():
        evals, results, events = _evals(tmp_path)
        bad, good = _due(tmp_path, 3), _due(tmp_path, 6)
        gates(bad, "fail")
        gates(good, "go")
        evals.submit(bad)
        evals.submit(good)
        await evals.drain(timeout_s=60)
        return evals, results, events

    evals, results, events = asyncio.run(main())
    assert evals.failed == [3] and [r["version"] for r in results] == [6]
    assert events == ["evaluation of version 3 failed: bad weights"]


def test_drain_stops_an_evaluation_past_its_deadline(tmp_path: Path) -> None:
    async def main():
        evals, results, events = _evals(tmp_path)
        evals.submit(_due(tmp_path, 5))  # never told to go
        await evals.drain(timeout_s=0.5)
        return evals, results, events

    evals, results, events = asyncio.run(main())
    assert results == [] and evals.running is None
    assert "background evaluation unfinished after 0.5 s" in events[0]


def test_a_resumed_run_keeps_its_curve_up_to_its_checkpoint(tmp_path: Path) -> None:
    metrics = tmp_path / "metrics.jsonl"
    lines = [{"type": "eval", "version": v, "accuracy": v / 10} for v in (2, 4, 6)]
    metrics.write_text("".join(json.dumps(r) + "\n" for r in lines) + '{"type": "eval", "vers')  # torn
    evals, _, _ = _evals(tmp_path)
    evals.restore(read_records(metrics, "eval"), up_to=4)
    assert evals.points() == [{"version": 2, "accuracy": 0.2}, {"version": 4, "accuracy": 0.4}]  # not 6


# Prints what the evaluator's process runs at: its nice value and its scheduling policy.
PRIORITY = (
    "import json, os, sys; "
    "print(json.dumps({'version': int(sys.argv[2]), 'accuracy': 0.0, 'nice': os.nice(0), "
    "'policy': os.sched_getscheduler(0)}))"
)


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="SCHED_IDLE is Linux's")
@pytest.mark.parametrize("idle_class", [True, False])
def test_the_evaluator_runs_niced_and_in_the_idle_class(tmp_path: Path, idle_class: bool) -> None:
    async def main():
        results: list[dict] = []
        evals = BackgroundEvals(
            tmp_path,
            max_pending=1,
            nice=7,
            idle_class=idle_class,
            on_result=results.append,
            on_event=print,
            command=(sys.executable, "-c", PRIORITY),
        )
        evals.submit(_due(tmp_path, 3))
        await evals.drain(timeout_s=60)
        return results

    (result,) = asyncio.run(main())
    assert result["nice"] == os.nice(0) + 7
    assert result["policy"] == (os.SCHED_IDLE if idle_class else os.sched_getscheduler(0))


@pytest.mark.parametrize(
    ("scores", "samples", "expected"),
    [
        ([1, 0, 1, 1], 1, {"1": 0.75}),
        # two problems x 2 samples: (1, 0) solved, (0, 0) not -> pass@2 = 0.5, pass@1 = 0.25
        ([1, 0, 0, 0], 2, {"1": 0.25, "2": 0.5}),
        ([0.2, 0.8, 0.5, 0.1, 0.0, 0.3], 3, {"1": 1.9 / 6, "3": (0.8 + 0.3) / 2}),
    ],
)
def test_pass_at_k_by_hand(scores, samples, expected) -> None:
    assert pass_at_k(scores, samples) == pytest.approx(expected)
