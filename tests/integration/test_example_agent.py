"""The calculator agent of examples/calculator_agent trains under `asyncrl launch` on its own
config: the job completes, nothing is lost, and the environment's tokens are masked out of the
loss (the learner trains on fewer tokens than the generator produced)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import read_records

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_calculator_agent_trains_with_masked_tool_tokens(tmp_path):
    args = [
        sys.executable,
        "-m",
        "asyncrl",
        "launch",
        str(REPO / "examples/calculator_agent/config.toml"),
        "--no-tui",
    ]
    for s in (
        f'run.out_dir="{tmp_path}"',
        'run.name="agent"',
        "learner.steps=3",
        "learner.groups_per_step=4",
    ):
        args += ["--set", s]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    }
    proc = subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    run_dir = tmp_path / "agent"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["policy_versions"] == 3
    assert summary["trajectories_lost"] == 0 and summary["trajectories_duplicated"] == 0
    assert summary["trajectories_generated"] == summary["trajectories_trained"] == 3 * 4 * 8
    generated = sum(r["num_tokens"] for r in read_records(run_dir, "task"))
    trained = sum(r["num_tokens"] for r in read_records(run_dir, "step"))
    assert 0 < trained < generated  # calculator values and re-posed questions are not trained
    config = json.loads((run_dir / "config.json").read_text())
    assert config["generators"]["kind"] == "examples.calculator_agent.agent:CalculatorAgent"
