"""Rollout budgets end to end (#37, sampling.budget = "uncertainty"): a launched run whose groups
get unequal sizes (the generator samples each task's own count, the learner trains the ragged
groups) completes with nothing lost or duplicated, each step spends exactly groups_per_step x
samples_per_group samples, and every group's size is in its task record."""

from __future__ import annotations

import json
from collections import defaultdict

import pytest
from conftest import read_records

STEPS, GROUPS, SAMPLES = 4, 4, 4
SETS = [
    'model.path=""',  # the shipped model earns rewards, so the prompts' records differ
    f"learner.steps={STEPS}",
    f"learner.groups_per_step={GROUPS}",
    f"learner.samples_per_group={SAMPLES}",
    "sampling.max_new_tokens=5",
    "sampling.budget=uncertainty",
    "sampling.budget_min=2",
    "sampling.budget_max=8",
    # every second group re-admits a prompt seen before, whose record sets its size
    "sampling.selection=replay",
    "sampling.selection_replay_fraction=0.5",
]


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_run_with_rollout_budgets_trains_unequal_groups_and_loses_nothing(run_short_job, mode):
    _, run_dir = run_short_job(*SETS, f"mode={mode}", name=mode)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed"
    total = STEPS * GROUPS * SAMPLES
    assert (summary["trajectories_generated"], summary["trajectories_trained"]) == (total, total)
    assert (summary["trajectories_lost"], summary["trajectories_duplicated"], summary["duplicates"]) == (
        0,
        0,
        0,
    )
    size_of = {r["task_id"]: r["num_trajectories"] for r in read_records(run_dir, "task")}
    assert sorted(size_of) == list(range(STEPS * GROUPS))
    by_step = defaultdict(int)
    for group, size in size_of.items():
        assert 2 <= size <= 8
        by_step[group // GROUPS] += size
    assert dict(by_step) == dict.fromkeys(range(STEPS), GROUPS * SAMPLES)  # equal sample budgets
    assert len(set(size_of.values())) > 1  # the sizes really differ
