"""The learner recovered inside the run (issue #36, acceptance 3): with `run.recover_learner`, a
learner SIGKILLed mid-run is recovered from its newest complete checkpoint without a user, the
run completes, every step is trained once (the ledger: nothing lost or duplicated), and in sync
mode the final weights equal an uninterrupted run's bit for bit."""

from __future__ import annotations

import json
import os
import signal
import subprocess

import pytest
import torch
from conftest import read_records, short_job_args
from test_resume import GROUPS, SETS, STEPS, _params_of

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def test_a_killed_learner_is_recovered_inside_the_run_and_the_weights_equal_an_uninterrupted_run(
    tiny_model_dir, tmp_path, launch_streamed
):
    whole = subprocess.run(
        short_job_args(tiny_model_dir, tmp_path, *SETS, name="whole"),
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert whole.returncode == 0, whole.stdout + whole.stderr

    run_dir = tmp_path / "recovered"
    lines = launch_streamed(
        short_job_args(tiny_model_dir, tmp_path, *SETS, "run.recover_learner=1", name="recovered")
    )
    learner_pid = int(lines.wait_for(r"^started learner \(pid (\d+)\)", timeout_s=200)[1])
    lines.wait_for(r"^step 3/", timeout_s=200, what="a step after the first checkpoint (step 2)")
    os.kill(learner_pid, signal.SIGKILL)  # the launcher started it; this test started the launcher
    code = lines.wait_exit(timeout_s=300)
    out = lines.text
    assert code == 0, out
    assert f"learner learner was killed by SIGKILL (exit code -9) (pid {learner_pid})" in out
    assert "recovering the learner (recovery 1 of run.recover_learner = 1)" in out

    summary = json.loads((run_dir / "summary.json").read_text())
    v = summary["resumed_from"]
    assert summary["status"] == "completed" and summary["learner_recoveries"] == 1
    assert 2 <= v < STEPS and v % 2 == 0
    assert summary["policy_versions"] == STEPS
    # After the recovery, exactly the groups of steps v..STEPS-1, each trained once.
    assert summary["trajectories_lost"] == 0 and summary["trajectories_duplicated"] == 0
    assert summary["trajectories_trained"] == (STEPS - v) * GROUPS * 4
    steps = [r["step"] for r in read_records(run_dir, "step")]
    assert steps[-(STEPS - v) :] == list(range(v, STEPS))

    a, b = _params_of(tmp_path / "whole" / "final_model"), _params_of(run_dir / "final_model")
    assert a.keys() == b.keys()
    differ = [n for n in a if not torch.equal(a[n], b[n])]
    assert not differ, f"not bitwise equal: {differ[:5]}"
