"""Real processes on loopback: a short multi-generator run, and Ctrl-C leaving nothing behind."""

from __future__ import annotations

import json
import re
import signal
import subprocess
from pathlib import Path

import pytest
from conftest import short_job_args

pytestmark = pytest.mark.slow


def _job_args(model_dir: Path, out_dir: Path, *extra: str) -> list[str]:
    return short_job_args(model_dir, out_dir, "learner.groups_per_step=4", "task.num_eval=16", *extra)


@pytest.mark.timeout(240)
def test_two_generators_run_to_completion_with_nothing_lost(tiny_model_dir, tmp_path):
    proc = subprocess.run(
        _job_args(
            tiny_model_dir,
            tmp_path,
            "learner.steps=3",
            "generators.num_generators=2",
            "staleness.max_staleness=1",
        ),
        capture_output=True,
        text=True,
        timeout=220,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = json.loads((tmp_path / "t" / "summary.json").read_text())
    assert summary["status"] == "completed"
    assert summary["policy_versions"] == 3
    assert summary["trajectories_trained"] == 3 * 4 * 4
    assert summary["trajectories_generated"] == summary["trajectories_trained"]
    assert summary["trajectories_lost"] == 0
    assert summary["duplicates"] == 0
    assert 0 <= summary["max_staleness"] <= 1
    assert summary["lint"] == [] and "settings:" not in proc.stdout  # nothing unsafe in this config
    lengths = summary["completion_lengths"]  # window admission trains every generated sample
    assert lengths["evicted"] is None and lengths["trained"] == pytest.approx(lengths["generated"])
    for key in ("eval_before", "eval_after", "wall_s", "samples_per_s", "tokens_per_s"):
        assert summary[key] >= 0
    lines = [json.loads(x) for x in (tmp_path / "t" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in lines if r["type"] == "step"]
    assert [r["step"] for r in steps] == [0, 1, 2]
    assert {r["generator_id"] for r in lines if r["type"] == "loaded"} == {"gen-0", "gen-1"}
    assert (tmp_path / "t" / "final_model" / "config.json").is_file()
    assert json.loads((tmp_path / "t" / "config.json").read_text())["generators"]["num_generators"] == 2


@pytest.mark.timeout(240)
def test_ctrl_c_leaves_no_process_behind(tiny_model_dir, tmp_path, pid_alive):
    proc = subprocess.Popen(
        _job_args(tiny_model_dir, tmp_path, "learner.steps=1000", "generators.num_generators=2"),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    pids: list[int] = []
    try:
        for line in proc.stdout:
            m = re.search(r"started (\S+) \(pid (\d+)\)", line)
            if m:
                pids.append(int(m.group(2)))
            if line.startswith("step 1/"):
                break
        assert len(pids) == 3, pids
        assert all(pid_alive(p) for p in pids)
        proc.send_signal(signal.SIGINT)
        rest = proc.communicate(timeout=60)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, rest
    assert "interrupted" in rest
    assert not [p for p in pids if pid_alive(p)]
    summary = json.loads((tmp_path / "t" / "summary.json").read_text())
    assert summary["status"] == "interrupted"
