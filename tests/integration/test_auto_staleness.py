"""`staleness.max_staleness = "auto"` in a real run: the bound in force is on every step record,
moves only within [1, cap], every trained token stays within the cap (the learner asserts it),
and each move is a run event with the signal that caused it."""

from __future__ import annotations

import json
import subprocess

import pytest
from conftest import short_job_args

pytestmark = pytest.mark.slow


@pytest.mark.timeout(240)
def test_auto_bound_runs_within_its_cap(tiny_model_dir, tmp_path):
    cap = 2
    proc = subprocess.run(
        short_job_args(
            tiny_model_dir,
            tmp_path,
            "learner.steps=8",
            "staleness.max_staleness=auto",
            f"staleness.max_staleness_cap={cap}",
        ),
        capture_output=True,
        text=True,
        timeout=220,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = json.loads((tmp_path / "t" / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["trajectories_lost"] == 0
    assert summary["max_staleness_bound"] == cap and summary["max_staleness"] <= cap
    records = [json.loads(x) for x in (tmp_path / "t" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r["type"] == "step"]
    bounds = [r["staleness_bound"] for r in steps]
    assert len(bounds) == 8 and all(1 <= b <= cap for b in bounds)  # 0 would be mode = "sync"
    moves = [r["text"] for r in records if r["type"] == "event" and "staleness bound" in r.get("text", "")]
    changes = sum(a != b for a, b in zip([1, *bounds[:-1]], bounds, strict=True))  # the bound starts at 1
    assert len(moves) == changes
    for text in moves:
        assert "idle" in text or "ESS" in text or "KL" in text or "clipped" in text
