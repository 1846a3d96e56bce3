"""The non-finite guard in a launched run: NaN gradients injected on one step
(ASYNCRL_FAULT_NONFINITE) are skipped and counted and the run completes; injected on every step,
the run ends with one clear line and a learner checkpoint holding the weights from before the fault."""

from __future__ import annotations

import json
import os
import subprocess

import pytest
import torch
from conftest import read_records, short_job_args

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def _launch(tiny_model_dir, tmp_path, fault, *sets, name):
    env = {**os.environ, "ASYNCRL_FAULT_NONFINITE": fault}
    return subprocess.run(
        short_job_args(tiny_model_dir, tmp_path, *sets, name=name),
        capture_output=True, text=True, timeout=240, env=env,
    )  # fmt: skip


def test_one_bad_step_is_skipped_counted_and_the_run_goes_on(tiny_model_dir, tmp_path):
    out = _launch(tiny_model_dir, tmp_path, "1", name="one")
    assert out.returncode == 0, out.stdout + out.stderr
    run_dir = tmp_path / "one"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["policy_versions"] == 3
    assert summary["steps_skipped_nonfinite"] == 1
    skipped = [r["step"] for r in read_records(run_dir, "step") if r["skipped_nonfinite"]]
    assert skipped == [1]


def test_every_step_bad_ends_the_run_with_a_checkpoint_from_before(tiny_model_dir, tmp_path):
    out = _launch(
        tiny_model_dir, tmp_path, "all", "learner.steps=6", "learner.max_nonfinite_steps=2", name="all"
    )
    assert out.returncode == 1
    text = out.stdout + out.stderr
    assert "2 steps in a row had a non-finite loss or gradient" in text, text
    assert "Traceback" not in out.stdout
    run_dir = tmp_path / "all"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["steps_skipped_nonfinite"] == 1
    # Version 1 is checkpointed: its weights are the initial ones (no update was applied).
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    from transformers import AutoModelForCausalLM

    dcp_to_torch_save(run_dir / "checkpoints" / "learner-00000001", tmp_path / "v1.pt")
    saved = torch.load(tmp_path / "v1.pt", weights_only=True)["model"]
    initial = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    for name, p in initial.named_parameters():
        assert torch.equal(saved[f"lm.{name}"], p.detach()), name
