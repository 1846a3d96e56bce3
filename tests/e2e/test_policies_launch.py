"""Every staleness policy selectable in the config runs a shortened job to completion."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from asyncrl.config import LEARNER_PROVIDES
from asyncrl.staleness.registry import POLICIES, make_policy

pytestmark = pytest.mark.slow

SELECTABLE = sorted(n for n in POLICIES if all(x in LEARNER_PROVIDES for x in make_policy(n).needs))


@pytest.mark.timeout(200)
@pytest.mark.parametrize("policy", SELECTABLE)
def test_policy_runs_a_short_job(tiny_model_dir, tmp_path, policy):
    sets = [
        f'model.path="{tiny_model_dir}"',
        f'run.out_dir="{tmp_path}"',
        'run.name="t"',
        f"staleness.policy={policy}",
        "staleness.max_staleness=1",
        "learner.steps=3",
        "learner.groups_per_step=2",
        "learner.samples_per_group=4",
        "task.num_eval=0",
    ]
    args = [sys.executable, "-m", "asyncrl", "launch", "--no-tui"]
    for s in sets:
        args += ["--set", s]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = json.loads((tmp_path / "t" / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["trajectories_lost"] == 0
    steps = [json.loads(x) for x in (tmp_path / "t" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in steps if r["type"] == "step"]
    assert len(steps) == 3
    assert all(r["grad_norm"] == r["grad_norm"] for r in steps)  # finite, not NaN
    assert "max_staleness" in steps[-1]["stats"]  # the policy's diagnostics reach the metrics
