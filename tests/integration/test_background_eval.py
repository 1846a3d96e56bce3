"""Background evaluation in a real launch (`eval.every`): the curve's points are the held-out
figures of exactly the version they name, the weights written for them are removed, and the
records, summary.json and the curve agree."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from asyncrl.evaluator import evaluate_version
from tests.conftest import read_records, short_job_args

# The evaluator runs at a lower CPU priority than training: on a busy machine it waits its turn.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

SETS = (
    'model.path=""',  # the shipped model: held-out accuracy moves as it trains
    "mode=sync",
    "task.num_eval=16",
    "eval.every=2",
    "sampling.max_new_tokens=5",
    "eval.nice=0",  # the evaluator at training's priority: a loaded test machine would starve it
)


def _run(tiny_model_dir: Path, tmp_path: Path, name: str, *extra: str) -> Path:
    done = subprocess.run(
        short_job_args(tiny_model_dir, tmp_path, *SETS, *extra, name=name), capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return tmp_path / name


def test_each_point_is_the_version_it_names(tiny_model_dir: Path, tmp_path: Path) -> None:
    run = _run(tiny_model_dir, tmp_path, "curve", "learner.steps=6")
    summary = json.loads((run / "summary.json").read_text())
    curve = summary["eval_curve"]
    assert [p["version"] for p in curve] == [2, 4]
    assert [
        {k: v for k, v in r.items() if k not in ("type", "time_s")} for r in read_records(run, "eval")
    ] == curve
    assert not any((run / "eval").iterdir())  # every version's weights removed once evaluated
    assert all(p["problems"] == 16 and p["samples"] == 1 for p in curve)

    # A sync run is reproducible: a 2-step run's final model is the 6-step run's version 2.
    # Evaluated on its own, it scores what the curve says version 2 scored.
    short = _run(tiny_model_dir, tmp_path, "two", "learner.steps=2", "eval.every=0")
    weights = tmp_path / "v2-weights"
    shutil.copytree(short / "final_model", weights)
    alone = evaluate_version(run, 2, weights)
    assert alone.accuracy == curve[0]["accuracy"] and alone.pass_at_k == curve[0]["pass_at_k"]


def test_eval_every_without_held_out_problems_is_refused(tiny_model_dir: Path, tmp_path: Path) -> None:
    args = short_job_args(tiny_model_dir, tmp_path, "eval.every=1")
    done = subprocess.run(args, capture_output=True, text=True)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "eval.every = 1 evaluates held-out problems, and task.num_eval = 0 holds none out" in done.stderr


def test_a_resumed_run_keeps_its_curve(tiny_model_dir: Path, tmp_path: Path, gate, launch_streamed) -> None:
    """Steps 3 on wait for a gate, so the learner is still running when version 2 has its point:
    it is killed then. The resumed run (gate open) keeps that point and adds version 4's and 6's."""
    import os
    import signal
    import sys

    from tests.support.gated_generator import gated_job_args

    args, env = gated_job_args(
        tiny_model_dir,
        tmp_path,
        gate.path,
        *SETS,
        "run.checkpoint_every=2",
        "learner.streaming=off",
        first_held=3 * 2,
        steps=8,
        groups=2,
        samples=4,
        name="crash",
    )
    run = tmp_path / "crash"
    lines = launch_streamed(args, env)
    learner_pid = int(lines.wait_for(r"^started learner \(pid (\d+)\)", timeout_s=200)[1])
    lines.wait_for(r"held-out accuracy at version 2: ", timeout_s=200, what="version 2's evaluation")
    os.kill(learner_pid, signal.SIGKILL)  # the launcher started it; this test started the launcher
    assert lines.wait_exit(timeout_s=120) == 1
    before = {r["version"]: r for r in read_records(run, "eval")}
    gate.open()
    resumed = subprocess.run(
        [sys.executable, "-m", "asyncrl", "launch", "--no-tui", "--resume", str(run)],
        capture_output=True,
        text=True,
        timeout=280,
        env=env,
    )
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["resumed_from"] == 2 and summary["status"] == "completed"
    curve = {p["version"]: p for p in summary["eval_curve"]}
    assert sorted(curve) == [2, 4, 6]  # 8 is the final model, evaluated as "after"
    assert curve[2] == {k: x for k, x in before[2].items() if k not in ("type", "time_s")}
