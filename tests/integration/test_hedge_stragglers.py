"""Hedged stragglers (issue #36, acceptance 2): a generator many times slower than its peers for
one task. The first generator to get group 10 (the last step's) holds it until the test opens a
gate (tests/support/straggler_generator.py). With hedging on, the task is sent to the other
generator too and the run completes with the gate still shut: no step waits for the straggler. Exactly once is proven by the ledger:
every sample trained once, none lost or duplicated, the copy that lost counted as wasted. With
hedging off (the default), today's behaviour: the step waits for the straggler."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest
from conftest import read_records, short_job_args

from tests.support.gate import GATE_ENV, Gate
from tests.support.straggler_generator import GROUP_ENV, MARK_ENV

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

STRAGGLER_GROUP = 10  # the last step's: a straggler also holds admission (it loads no weights)
STEPS, GROUPS, SAMPLES = 6, 2, 4


def _job(tiny_model_dir: Path, tmp_path: Path, *extra: str) -> tuple[list[str], dict[str, str], Gate]:
    gate = Gate(tmp_path / "gate")
    root = str(Path(__file__).resolve().parents[2])
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([root, *filter(None, [os.environ.get("PYTHONPATH")])]),
        GATE_ENV: str(gate.path),
        GROUP_ENV: str(STRAGGLER_GROUP),
        MARK_ENV: str(tmp_path / "straggler"),
    }
    args = short_job_args(
        tiny_model_dir,
        tmp_path / "runs",
        f"learner.steps={STEPS}",
        f"learner.groups_per_step={GROUPS}",
        f"learner.samples_per_group={SAMPLES}",
        "generators.num_generators=2",
        'generators.kind="tests.support.straggler_generator:StragglerGenerator"',
        "generators.max_batch_groups=1",
        *extra,
    )
    return args, env, gate


def _exactly_once(run_dir: Path) -> dict:
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed", summary
    assert summary["policy_versions"] == STEPS
    assert summary["trajectories_trained"] == summary["trajectories_generated"] == STEPS * GROUPS * SAMPLES
    assert summary["trajectories_lost"] == 0 and summary["trajectories_duplicated"] == 0
    assert 0 <= summary["max_staleness"] <= summary["max_staleness_bound"]
    return summary


def test_with_hedging_the_step_does_not_wait_for_a_straggler_and_trains_each_sample_once(
    tiny_model_dir, tmp_path
):
    args, env, gate = _job(
        tiny_model_dir, tmp_path, "generators.hedge_factor=4", "generators.hedge_min_s=0.5"
    )
    try:
        # The gate stays shut for the whole run: it can only complete if the hedge serves group 6.
        proc = subprocess.run(args, env=env, capture_output=True, text=True, timeout=200)
    finally:
        gate.open()  # let the straggler's held batch go, if it still waits
        gate.close()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    run_dir = tmp_path / "runs" / "t"
    _exactly_once(run_dir)
    slow = (tmp_path / "straggler").read_text()
    fast = {"gen-0": "gen-1", "gen-1": "gen-0"}[slow]
    hedges = read_records(run_dir, "hedge")
    assert {"task_id": STRAGGLER_GROUP, "peer_id": slow, "hedge_peer_id": fast} in [
        {k: h[k] for k in ("task_id", "peer_id", "hedge_peer_id")} for h in hedges
    ]
    won = {r["task_id"]: r for r in read_records(run_dir, "hedge_done")}
    assert won[STRAGGLER_GROUP]["winner"] == fast and won[STRAGGLER_GROUP]["loser"] == slow
    (counts,) = read_records(run_dir, "hedge_summary")
    assert counts["tasks_hedged"] == len(hedges) and counts["hedges_won"] >= 1
    # Whatever copy lost and finished anyway was dropped, never counted as generated.
    assert counts["hedges_wasted"] == len(read_records(run_dir, "hedge_wasted"))
    done_by = {r["task_id"]: r["generator_id"] for r in read_records(run_dir, "task")}
    assert done_by[STRAGGLER_GROUP] == fast
    print(f"\nhedging: {counts}")


def test_without_hedging_the_step_waits_for_the_straggler(tiny_model_dir, tmp_path):
    args, env, gate = _job(tiny_model_dir, tmp_path)
    proc = subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen = []
    try:
        for line in proc.stdout:
            seen.append(line)
            if re.match(r"^step 5/", line):  # steps 0-4 trained; step 5 holds group 10
                break
        gate.open()
        rest = proc.communicate(timeout=200)[0]
    finally:
        gate.close()
        if proc.poll() is None:
            proc.kill()  # our own Popen, by pid
            proc.wait(timeout=30)
    assert proc.returncode == 0, "".join(seen) + rest
    run_dir = tmp_path / "runs" / "t"
    _exactly_once(run_dir)
    assert not read_records(run_dir, "hedge")
    done_by = {r["task_id"]: r["generator_id"] for r in read_records(run_dir, "task")}
    assert done_by[STRAGGLER_GROUP] == (tmp_path / "straggler").read_text()  # the straggler did it
    steps = {r["step"]: r["time_s"] for r in read_records(run_dir, "step")}
    done = [r["time_s"] for r in read_records(run_dir, "task") if r["task_id"] == STRAGGLER_GROUP]
    assert steps[5] >= done[0]  # the last step was trained only after the straggler's group was done
