"""Crash and exact resume: the learner is SIGKILLed mid-run, `asyncrl launch --resume RUN_DIR`
continues from the newest complete checkpoint, and the final parameters equal those of an
uninterrupted run with the same seed (sync mode: both runs sample the same completions from the
same weights, with per-sample seeds; whole-batch steps in a fixed order). The ledger shows no group skipped or repeated."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
import torch
from conftest import read_records, short_job_args

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

STEPS = 6
GROUPS = 4
SETS = [
    'model.path=""',  # the shipped model earns rewards, so every step changes the weights
    "mode=sync",
    f"learner.steps={STEPS}",
    f"learner.groups_per_step={GROUPS}",
    "learner.samples_per_group=4",
    "sampling.max_new_tokens=5",
    "run.checkpoint_every=2",
    "run.seed=5",
    # Whole-batch steps, packed in trajectory-id order: float32 sums that do not depend on the
    # order trajectories arrive in (streamed sums do, at float32 rounding, run to run).
    "learner.streaming=off",
]


def _params(run_dir):
    return _params_of(run_dir / "final_model")


def _run_then_kill_the_learner(launch_streamed, tiny_model_dir, tmp_path, sets) -> tuple:
    """Start a job, SIGKILL its learner once the first checkpoint exists; (run_dir, exit code,
    output) of the launcher, which must end on its own."""
    run_dir = tmp_path / "crash"
    lines = launch_streamed(short_job_args(tiny_model_dir, tmp_path, *sets, name="crash"))
    learner_pid = int(lines.wait_for(r"^started learner \(pid (\d+)\)", timeout_s=200)[1])
    # The launcher writes its half of a checkpoint on the StepDone of that version (the learner
    # wrote its half before sending it), before it prints the step: step 2 is version 2's.
    lines.wait_for(r"^step 2/", timeout_s=200, what="the first checkpoint (step 2)")
    assert (run_dir / "checkpoints" / "launcher-00000002.json").is_file()
    os.kill(learner_pid, signal.SIGKILL)  # the launcher started it; this test started the launcher
    code = lines.wait_exit(timeout_s=120)
    return run_dir, code, lines.text


def _resume(run_dir) -> dict:
    """`asyncrl launch --resume run_dir` to completion; its summary."""
    resumed = subprocess.run(
        [sys.executable, "-m", "asyncrl", "launch", "--no-tui", "--resume", str(run_dir)],
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    return json.loads((run_dir / "summary.json").read_text())


def test_learner_killed_then_resumed_equals_an_uninterrupted_run(tiny_model_dir, tmp_path, launch_streamed):
    whole = subprocess.run(
        short_job_args(tiny_model_dir, tmp_path, *SETS, name="whole"),
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert whole.returncode == 0, whole.stdout + whole.stderr

    run_dir, code, out = _run_then_kill_the_learner(launch_streamed, tiny_model_dir, tmp_path, SETS)
    assert code == 1 and "learner" in out, out
    first = json.loads((run_dir / "summary.json").read_text())
    assert first["status"] == "failed" and first["policy_versions"] < STEPS

    summary = _resume(run_dir)
    v = summary["resumed_from"]
    assert summary["status"] == "completed" and 2 <= v < STEPS and v % 2 == 0
    assert summary["policy_versions"] == STEPS
    # The ledger of the resumed segment: exactly the groups of steps v..STEPS-1, each trained once.
    assert summary["trajectories_lost"] == 0 and summary["trajectories_duplicated"] == 0
    assert summary["trajectories_trained"] == (STEPS - v) * GROUPS * 4
    steps_after = [r["step"] for r in read_records(run_dir, "step")][-(STEPS - v) :]
    assert steps_after == list(range(v, STEPS))
    tasks_after = [r["task_id"] for r in read_records(run_dir, "task")][-(STEPS - v) * GROUPS :]
    assert sorted(tasks_after) == list(range(v * GROUPS, STEPS * GROUPS))

    a, b = _params(tmp_path / "whole"), _params(run_dir)
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=0, atol=1e-4, msg=name)
    from asyncrl.models.default import DEFAULT_MODEL_DIR

    initial = _params_of(DEFAULT_MODEL_DIR)
    assert any(not torch.equal(a[n], initial[n]) for n in a)  # training really moved the weights


def _params_of(model_dir):
    from safetensors.torch import load_file

    state = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        state.update(load_file(f))
    return state


def test_async_resume_trains_the_checkpointed_buffer_and_loses_nothing(
    tiny_model_dir, tmp_path, launch_streamed
):
    """Async mode: the generators run ahead, so the learner holds trajectories of later windows
    when it checkpoints. The resumed learner puts them back and drops their regenerated copies;
    the ledger shows every group of steps v..STEPS-1 trained exactly once."""
    sets = [s for s in SETS if s not in ("mode=sync", "learner.streaming=off")] + ["mode=async"]
    run_dir, code, out = _run_then_kill_the_learner(launch_streamed, tiny_model_dir, tmp_path, sets)
    assert code == 1, out
    from asyncrl.config_load import load_resolved_config
    from asyncrl.job import resume_point

    v = resume_point(run_dir, load_resolved_config(run_dir / "config.json"))
    held = torch.load(run_dir / "checkpoints" / f"learner-{v:08d}" / "extras.pt", weights_only=True)["held"]

    summary = _resume(run_dir)
    assert summary["resumed_from"] == v
    assert summary["status"] == "completed" and summary["policy_versions"] == STEPS
    assert summary["trajectories_lost"] == 0 and summary["trajectories_duplicated"] == 0
    assert summary["trajectories_trained"] == (STEPS - v) * GROUPS * 4
    # The learner put back every held trajectory (all of windows the resumed run trains), and
    # the regenerated copies of them were dropped without counting as duplicates.
    assert all(v <= h["step"] < STEPS for h in held)
    last = [r for r in read_records(run_dir, "metrics") if r.get("source") == "learner"][-1]
    assert last["learner/resume_restored"] == len(held)
    assert last["learner/duplicates"] == 0
    assert last["learner/resume_regenerated"] <= len(held)


def test_pool_resume_trains_no_group_twice_and_skips_none(tiny_model_dir, tmp_path, launch_streamed):
    """Pool mode (buffer.mode = "pool", replays on): the resumed learner puts its buffer back,
    reuse counts included, and the launcher re-admits every group the checkpoint's ledger had
    open. Across the two segments no group is trained twice as new, and every group open at the
    checkpoint is trained or generated again after the resume."""
    from asyncrl.config_load import load_resolved_config
    from asyncrl.job import resume_point

    sets = [s for s in SETS if s not in ("mode=sync", "learner.streaming=off")]
    sets += ["mode=async", "buffer.mode=pool", "buffer.max_replays=1"]
    run_dir, code, out = _run_then_kill_the_learner(launch_streamed, tiny_model_dir, tmp_path, sets)
    assert code == 1, out
    v = resume_point(run_dir, load_resolved_config(run_dir / "config.json"))
    saved = json.loads((run_dir / "checkpoints" / f"launcher-{v:08d}.json").read_text())
    open_at_v = {t["task_id"] for t in saved["ledger"]["tasks"]}
    assert open_at_v  # async: groups were admitted ahead of the learner
    num_before = len(read_records(run_dir))

    summary = _resume(run_dir)
    assert summary["resumed_from"] == v and summary["status"] == "completed"
    assert summary["trajectories_lost"] == 0 and summary["trajectories_duplicated"] == 0
    records = read_records(run_dir)
    first = [r for r in records[:num_before] if r["type"] == "step" and r["step"] < v]
    second = [r for r in records[num_before:] if r["type"] == "step"]
    assert [r["step"] for r in first] == list(range(v)) and [r["step"] for r in second] == list(
        range(v, STEPS)
    )
    new_before = [g for r in first for g in r["groups_trained"]]
    new_after = [g for r in second for g in r["groups_trained"]]
    assert len(new_before + new_after) == len(set(new_before + new_after))
    assert not open_at_v & set(new_before)
    regenerated = {r["task_id"] for r in records[num_before:] if r["type"] == "task"}
    assert open_at_v <= set(new_after) | regenerated
    last = [r for r in records[num_before:] if r.get("source") == "learner"][-1]
    assert last["learner/resume_restored"] > 0 and last["learner/duplicates"] == 0
