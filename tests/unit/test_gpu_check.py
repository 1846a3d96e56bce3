"""asyncrl/benchmarks/gpu_check.py (`asyncrl bench gpu-check`), the learner's one-GPU check (issue #21), exercised on CPU: `--cpu-dry-run`
runs every section's code path with tiny models, and a failing section is recorded while the run
goes on. Nothing is timed."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys

import pytest

MODULE = "asyncrl.benchmarks.gpu_check"


def _load():
    return importlib.import_module(MODULE)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_cpu_dry_run_reports_every_section_without_errors(tmp_path):
    """The whole dry run, as a user starts it (20-50 s on 2 shared cores; the e2e job is most of it)."""
    proc = subprocess.run(
        [sys.executable, "-m", MODULE, "--cpu-dry-run", "--out", str(tmp_path), "--budget-s", "240"],
        capture_output=True,
        text=True,
        timeout=290,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["meta"]["finished"] and report["meta"]["cpu_dry_run"]
    sections = report["sections"]
    assert list(sections) == ["environment", "process_group", "exactness", "throughput", "e2e"]
    for name, rec in sections.items():
        assert rec["status"] == "ok", (name, rec.get("error"), rec.get("errors"))
    assert report["findings"] == []
    assert sections["process_group"]["cpu_tensor_all_reduce"] == "ok"

    exact = sections["exactness"]
    runs = exact["runs"]
    # The plain rank streams trajectories; FSDP2 trains in lockstep; every run stepped.
    assert runs["cpu_plain_fp32_stream"]["streamed"] > 0 and not runs["cpu_plain_fp32_stream"]["lockstep"]
    assert runs["device_fsdp_fp32_stream"]["lockstep"] and runs["cpu_plain_fp32_batch"]["whole_batch"]
    assert not any(r["skipped_nonfinite"] for r in runs.values())
    # On one CPU the same path is bitwise the same, and every repeat is bitwise.
    assert exact["device_vs_cpu_same_summation_bitwise"] == {
        "device_plain_fp32_stream": True,
        "device_plain_fp32_batch": True,
        "device_fsdp_fp32_batch": True,
    }
    assert exact["device_vs_cpu_same_summation_max_abs_param_diff"] == 0.0
    assert all(exact["repeat_bitwise"].values()) and len(exact["repeat_bitwise"]) == 6
    assert exact["device_vs_cpu_max_abs_param_diff"] < 1e-3 * exact["update_max_abs"]
    assert 0 < exact["bf16_vs_fp32"]["max_abs_param_diff"] < exact["update_max_abs"]

    through = sections["throughput"]
    assert through["figures_from"] == "trainer" and through["trainer"]["lockstep"]
    assert through["tokens_per_s"] > 0 and through["mfu"] > 0 and through["trainer"]["peak_rss_bytes"] > 0
    assert through["tokens_per_step"] == 2 * 4 * (8 + 24)
    assert through["bare_loop"]["tokens_per_s"] > 0

    summary = sections["e2e"]["summary"]
    assert summary["policy_versions"] == 2 and summary["trajectories_lost"] == 0
    assert 0.0 <= summary["eval_before"] <= 1.0 and 0.0 <= summary["eval_after"] <= 1.0
    assert "throughput: ok" in proc.stdout and "e2e: ok" in proc.stdout


def test_a_failing_section_is_recorded_and_the_next_still_runs(tmp_path):
    """What keeps a scarce GPU run useful: an exception becomes the section's error and
    traceback, later sections run, one without budget left is skipped, and the summary prints
    even when a section left none of its figures."""
    gc_mod = _load()
    args = gc_mod.parse_args(["--cpu-dry-run", "--out", str(tmp_path), "--sections", "environment,exactness"])
    report = gc_mod.Report(tmp_path / "gpu_check.json", {"finished": False})
    ctx = gc_mod.Context(args, report)

    def broken(ctx, rec):
        rec["before_the_fault"] = 1
        raise ValueError("injected")

    def fine(ctx, rec):
        rec["value"] = 2

    gc_mod.run_section(ctx, "environment", broken)
    gc_mod.run_section(ctx, "exactness", fine)
    gc_mod.run_section(ctx, "throughput", fine)  # not selected
    ctx.deadline = ctx.start  # no budget left: a section needing some is skipped
    ctx.args.sections.append("e2e")
    gc_mod.run_section(ctx, "e2e", fine)

    written = json.loads((tmp_path / "gpu_check.json").read_text())["sections"]
    env = written["environment"]
    assert env["status"] == "error" and env["error"] == "ValueError: injected"
    assert "raise ValueError" in env["traceback"] and env["before_the_fault"] == 1
    assert written["exactness"] == {"status": "ok", "value": 2, "seconds": written["exactness"]["seconds"]}
    assert written["throughput"]["status"] == "skipped" and "not selected" in written["throughput"]["reason"]
    assert written["e2e"]["status"] == "skipped" and "budget" in written["e2e"]["reason"]
    lines = gc_mod.summary_lines({"sections": written, "findings": ["f"]})
    assert lines[0] == "environment: error" and lines[1] == "  error: ValueError: injected"
    assert lines[-1] == "finding: f"
