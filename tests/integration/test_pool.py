"""Pool mode (`buffer.mode = "pool"`): the learner takes each step's groups from the
freshness-scored buffer. Every order and action runs a short job to completion; the ledger
accounts for every admitted sample (trained, replayed, evicted or still pending at the end),
nothing is lost or duplicated, and what the learner reports matches the summary."""

from __future__ import annotations

import json

import pytest
from conftest import read_records

pytestmark = [pytest.mark.slow, pytest.mark.timeout(200)]

STEPS, GROUPS, N = 6, 2, 4
BASE = [
    "buffer.mode=pool",
    f"learner.steps={STEPS}",
    f"learner.groups_per_step={GROUPS}",
    f"learner.samples_per_group={N}",
    "staleness.max_staleness=1",
]
CASES = {
    "fifo-replay": ["buffer.max_replays=2", "buffer.replay_decay=0.9"],
    # A floor above the score of a group that arrives one version stale: those are dropped.
    "freshest-drop": ["buffer.order=freshest", "buffer.action=drop", "buffer.freshness_floor=0.8"],
    "windowed-downweight": [
        "buffer.order=windowed",
        "buffer.window=1",
        "buffer.action=downweight",
        "buffer.max_replays=1",
    ],
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_pool_job_accounts_for_every_sample(run_short_job, case):
    _, run_dir = run_short_job(*BASE, *CASES[case])
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["buffer_mode"] == "pool"
    assert summary["trajectories_lost"] == 0 and summary["trajectories_duplicated"] == 0
    steps = read_records(run_dir, "step")
    assert [r["step"] for r in steps] == list(range(STEPS))
    assert all(len(r["groups_trained"]) + len(r["groups_replayed"]) == GROUPS for r in steps)
    first_uses = [g for r in steps for g in r["groups_trained"]]
    assert len(first_uses) == len(set(first_uses))  # no group trained twice as new
    replayed = [g for r in steps for g in r["groups_replayed"]]
    assert set(replayed) <= set(first_uses)
    assert summary["trajectories_replayed"] == len(replayed) * N
    left = read_records(run_dir, "left")
    evicted = {}
    for r in left:
        for reason, groups in r["evicted"].items():
            evicted.setdefault(reason, []).extend(groups)
    assert not set(first_uses) & {g for gs in evicted.values() for g in gs}  # dropped = never trained
    assert summary["evicted_by_reason"] == {k: len(v) * N for k, v in evicted.items()}
    # The dropped samples' mean completion length (length bias), from their groups' TaskDones.
    tasks = {r["task_id"]: r for r in read_records(run_dir, "task")}
    dropped = [tasks[g] for gs in evicted.values() for g in gs]
    lengths = summary["completion_lengths"]
    if dropped:
        mean = sum(t["num_tokens"] for t in dropped) / sum(t["num_trajectories"] for t in dropped)
        assert lengths["evicted"] == pytest.approx(mean)
    else:
        assert lengths["evicted"] is None
    # Every admitted sample is trained, evicted or pending (the buffer's lead at the end).
    admitted = {r["task_id"] for r in read_records(run_dir, "task")}
    assert set(first_uses) <= admitted
    released = [g for r in left for g in r["released"]]
    assert len(released) == len(set(released))  # each credit comes back once
    if "downweight" not in case:
        assert summary["max_staleness"] <= 1
    learner = [r for r in read_records(run_dir, "metrics") if r.get("source") == "learner"][-1]
    if case == "freshest-drop":
        # The learner's count at its last step; groups arriving after it are dropped too.
        assert 0 < learner["buffer/evicted_freshness"] <= len(evicted["freshness"]) * N
