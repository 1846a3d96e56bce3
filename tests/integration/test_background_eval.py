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

pytestmark = pytest.mark.slow

SETS = ("mode=sync", "task.num_eval=24", "learner.steps=6", "eval.every=2", "sampling.max_new_tokens=5")


def _run(tiny_model_dir: Path, tmp_path: Path, name: str, *extra: str) -> Path:
    done = subprocess.run(
        short_job_args(tiny_model_dir, tmp_path, *SETS, *extra, name=name), capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return tmp_path / name


def test_each_point_is_the_version_it_names(tiny_model_dir: Path, tmp_path: Path) -> None:
    run = _run(tiny_model_dir, tmp_path, "curve")
    summary = json.loads((run / "summary.json").read_text())
    curve = summary["eval_curve"]
    assert [p["version"] for p in curve] == [2, 4]
    assert [{k: v for k, v in r.items() if k not in ("type", "time_s")} for r in read_records(run, "eval")] == curve
    assert not any((run / "eval").iterdir())  # every version's weights removed once evaluated
    assert all(p["problems"] == 24 and p["samples"] == 1 for p in curve)

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
