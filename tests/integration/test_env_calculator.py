"""The calculator agent, an environment (examples/calculator_agent), trains under `asyncrl launch`
on its own config on both backends, the torch generator and the sglang generator driving a
stand-in server it launches (issue #35, acceptance 1): the job completes with nothing lost or
duplicated, and the learner trains on exactly the generated tokens less the environment's masked
ones, by the generator's own count (`env/env_tokens`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import read_records

REPO = Path(__file__).resolve().parents[2]
SGLANG = [
    'generators.kind="sglang"',
    "generators.options.launch=1",
    'generators.options.launch_command="python -m tests.support.sglang.server"',
    'generators.options.launch_args="--log-level warning --skip-tokenizer-init"',
    'weights.transport="shards"',
]


def env_counters(run_dir: Path) -> dict[str, float]:
    """The generator's last env/ counters in metrics.jsonl (cumulative)."""
    last: dict[str, float] = {}
    for r in read_records(run_dir):
        env = {k: v for k, v in r.items() if k.startswith("env/")}
        if env:
            last = env
    return last


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["torch", "sglang"])
def test_calculator_environment_trains_with_exact_token_accounting(tmp_path, backend):
    args = [
        sys.executable,
        "-m",
        "asyncrl",
        "launch",
        str(REPO / "examples/calculator_agent/config.toml"),
        "--no-tui",
    ]
    sets = [f'run.out_dir="{tmp_path}"', 'run.name="agent"', "learner.steps=3", "learner.groups_per_step=4"]
    for s in sets + (SGLANG if backend == "sglang" else []):
        args += ["--set", s]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    }
    proc = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run_dir = tmp_path / "agent"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["policy_versions"] == 3
    assert summary["trajectories_lost"] == 0 and summary["trajectories_duplicated"] == 0
    assert summary["trajectories_generated"] == summary["trajectories_trained"] == 3 * 4 * 8
    generated = sum(r["num_tokens"] for r in read_records(run_dir, "task"))
    trained = sum(r["num_tokens"] for r in read_records(run_dir, "step"))
    counters = env_counters(run_dir)
    assert counters["env/episodes"] == 3 * 4 * 8 and counters.get("env/failed", 0) == 0
    assert counters["env/model_tokens"] + counters["env/env_tokens"] == generated
    assert 0 < counters["env/env_tokens"]  # some answers were wrong: the question was re-posed
    assert trained == generated - counters["env/env_tokens"]
    config = json.loads((run_dir / "config.json").read_text())
    assert config["env"]["kind"] == "examples.calculator_agent.environment:calculator"
    assert config["generators"]["kind"] == backend
