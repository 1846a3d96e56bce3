"""Bitwise replay of an asynchronous run (asyncrl/replay.py): a run with two generators
records its learner schedule; `asyncrl replay` reproduces its parameters and every step's
training values bit for bit, also when replayed to step N with a checkpoint and resumed; and a
schedule that was tampered with is reported as different."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from conftest import short_job_args

pytestmark = pytest.mark.slow


def _replay(run_dir, *args: str) -> tuple[int, dict]:
    proc = subprocess.run(
        [sys.executable, "-m", "asyncrl", "replay", str(run_dir), *args],
        capture_output=True,
        text=True,
        timeout=200,
    )
    assert proc.stdout.strip(), proc.stderr
    return proc.returncode, json.loads(proc.stdout)


@pytest.fixture(scope="module")
def recorded(tiny_model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("recorded")
    proc = subprocess.run(
        short_job_args(
            tiny_model_dir,
            tmp,
            "run.record_schedule=true",
            "generators.num_generators=2",
            "learner.steps=6",
            "learner.groups_per_step=4",
            "staleness.max_staleness=2",
        ),
        capture_output=True,
        text=True,
        timeout=200,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return tmp / "t"


@pytest.mark.timeout(300)
def test_replay_reproduces_the_run_bitwise(recorded, tmp_path):
    code, verdict = _replay(recorded, "--out", str(tmp_path / "all"))
    assert code == 0, verdict
    assert verdict["steps_compared"] == 6
    assert verdict["identical_metrics"] is True and verdict["identical_params"] is True


@pytest.mark.timeout(300)
def test_replay_to_a_step_then_resume_equals_the_run(recorded, tmp_path):
    code, first = _replay(recorded, "--out", str(tmp_path / "half"), "--until", "3")
    assert code == 0 and first["to_version"] == 3 and first["identical_metrics"] is True
    assert (tmp_path / "half" / "checkpoints" / "learner-00000003").is_dir()
    code, rest = _replay(recorded, "--out", str(tmp_path / "rest"), "--resume", str(tmp_path / "half"))
    assert code == 0, rest
    assert rest["from_version"] == 3 and rest["steps_compared"] == 3
    assert rest["identical_metrics"] is True and rest["identical_params"] is True


@pytest.mark.timeout(300)
def test_a_tampered_schedule_is_reported_different(recorded, tmp_path):
    import shutil

    copy = tmp_path / "run"
    shutil.copytree(recorded, copy)
    path = copy / "schedule" / "step-00000004.pt"
    record = torch.load(path, weights_only=True)
    record["samples"][0]["reward"] = 1.0 - record["samples"][0]["reward"]  # one reward flipped
    torch.save(record, path)
    code, verdict = _replay(copy, "--out", str(tmp_path / "bad"))
    assert code == 1
    assert verdict["first_differing_step"] == 4 and verdict["identical_params"] is False


def test_recording_is_refused_where_it_cannot_replay():
    from asyncrl.config_load import load_config
    from asyncrl.config_sections import ConfigError

    for extra in ("learner.world_size=2", "buffer.mode=pool"):
        with pytest.raises((ConfigError, ValueError), match="run.record_schedule"):
            load_config(overrides=["run.record_schedule=true", extra])
