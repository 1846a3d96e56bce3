"""#37 acceptance 3: a sync run with an adaptive prompt selection, its learner SIGKILLed mid-run and
resumed with `asyncrl launch --resume`, admits exactly the prompts the uninterrupted run admits,
group by group, and its per-prompt record (the Beta posteriors), selector state and group -> prompt
map at a later checkpoint equal the uninterrupted run's. Selection is "replay" (every second group
re-admits the most uncertain prompt seen), so the choices depend on the rewards observed. The run
also has rollout budgets (sampling.budget = "uncertainty"), whose group sizes depend on the same
record: the resumed run gives every group the size the uninterrupted run gave it."""

from __future__ import annotations

import json
import subprocess

import pytest
from conftest import read_records, short_job_args
from test_resume import GROUPS, STEPS, _resume, _run_then_kill_the_learner
from test_resume import SETS as RESUME_SETS

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

# test_resume's sync job (the shipped model, which earns rewards, so posteriors differ between
# prompts; checkpoints every 2 versions), with every second group a replay.
SETS = [
    *RESUME_SETS,
    "sampling.selection=replay",
    "sampling.selection_replay_fraction=0.5",
    "sampling.budget=uncertainty",
    "sampling.budget_min=2",
    "sampling.budget_max=8",
]


def prompts_by_group(run_dir) -> dict[int, tuple[int, int]]:
    """group id -> (the stream index its prompt was, its size), from the task records (the last
    one counts: a group re-run after the resume recorded the same prompt again)."""
    return {r["task_id"]: (r["dataset_index"], r["num_trajectories"]) for r in read_records(run_dir, "task")}


def selection_at(run_dir, version: int) -> dict:
    path = run_dir / "checkpoints" / f"launcher-{version:08d}.json"
    return json.loads(path.read_text())["selection"]


def test_a_resumed_sync_run_selects_the_prompts_of_the_uninterrupted_run(
    tiny_model_dir, tmp_path, launch_streamed
):
    args = short_job_args(tiny_model_dir, tmp_path, *SETS, name="whole")
    whole = subprocess.run(args, capture_output=True, text=True, timeout=280)
    assert whole.returncode == 0, whole.stdout + whole.stderr
    run_dir, code, out = _run_then_kill_the_learner(launch_streamed, tiny_model_dir, tmp_path, SETS)
    assert code == 1, out  # the learner's death fails the run; its checkpoints stay
    assert _resume(run_dir)["resumed_from"] == 2

    expected, got = prompts_by_group(tmp_path / "whole"), prompts_by_group(run_dir)
    # Every group up to the last step's (whose TaskDones may trail the run's end) is recorded in both.
    groups = range((STEPS - 1) * GROUPS)
    assert [got[j] for j in groups] == [expected[j] for j in groups]
    assert any(expected[j][0] != j for j in groups)  # replays happened: not the uniform stream
    assert len({expected[j][1] for j in groups}) > 1  # the group sizes differ
    assert json.loads((run_dir / "summary.json").read_text())["trajectories_lost"] == 0
    # A checkpoint the resumed launcher wrote itself. The trained groups' posteriors are equal. How
    # many groups were admitted but not yet trained when it was written depends on timing, so the
    # group map must agree where both have a group, and the selector's state (its cursor, its random
    # generator) must be equal whenever both had admitted the same groups.
    mine, theirs = selection_at(run_dir, 4), selection_at(tmp_path / "whole", 4)
    assert mine["stats"]["records"] and mine["stats"]["records"] == theirs["stats"]["records"]
    shared = mine["indices"].keys() & theirs["indices"].keys()
    assert all(mine["indices"][j] == theirs["indices"][j] for j in shared)
    assert all(mine["sizes"][j] == theirs["sizes"][j] for j in mine["sizes"].keys() & theirs["sizes"].keys())
    if mine["indices"].keys() == theirs["indices"].keys():
        assert mine["selector"] == theirs["selector"]
