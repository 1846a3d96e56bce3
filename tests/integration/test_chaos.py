"""Chaos: generators are SIGKILLed at random points of a run, several times; the run completes,
nothing is lost, no group is trained on more samples than configured, and restarts are counted.
In both buffer modes: window (each step trains its admitted groups) and pool (each step takes
groups from the learner's buffer; no group is trained twice as new).

Kills are triggered by observed progress (TaskDone records on the run's record stream, the
launcher's metrics PUB socket), never by sleeps, and each kill waits until the launcher has
recorded the restart before the next one. The generator is the torch generator behind a gate
(tests/support/gated_generator.py): groups of the last steps (by group number) wait for a FIFO
gate the test opens after its last kill, so the run cannot finish before every kill has been
seen, however fast or loaded the machine is. The victims are generator pids that this run's
launcher started (its `spawn` records) and that have done work for it (a TaskDone or a weights
load on record: set up, their output on their log), each checked to be that generator process
before it is signalled. ASYNCRL_CHAOS_SEED reproduces a failing draw (the seed is in every
assertion message).
"""

from __future__ import annotations

import json
import os
import random
import signal
from pathlib import Path

import pytest

from tests.conftest import read_records
from tests.support.gated_generator import gated_job_args
from tests.support.waiting import RunRecords

pytestmark = pytest.mark.slow

STEPS, GROUPS, SAMPLES = 10, 2, 4
NUM_KILLS = 3
GATED_STEP = 7  # groups of this step and later wait for the gate
GATED_GROUP = GATED_STEP * GROUPS  # (in pool mode: groups numbered from here on, the same count)
WAIT_S = 300  # hang guard of each wait on the run


def live_working_generators(records: RunRecords) -> list[dict]:
    """`spawn` records of the generator processes started by this run, not yet reported dead by
    the launcher, that have sent a TaskDone or loaded weights."""
    dead = {r["peer_id"] for r in records.of("restart")}
    working = {r["generator_id"] for r in records.of("task") + records.of("loaded")}
    return [
        r
        for r in records.of("spawn")
        if r["role"] == "generator" and r["peer_id"] not in dead and r["peer_id"] in working
    ]


def is_that_generator(pid: int, peer_id: str, run_dir: Path) -> bool:
    """Whether `pid` is still that generator of this test's run: its output goes to the run's log
    of `peer_id` (true of workers started fresh and of those forked from the fork server, whose
    command line is the server's)."""
    try:
        out = os.readlink(f"/proc/{pid}/fd/1")
    except OSError:
        return False
    return Path(out) == (run_dir / "logs" / f"{peer_id}.log").resolve()


@pytest.mark.timeout(600)
@pytest.mark.parametrize("buffer_mode", ["window", "pool"])
def test_generators_sigkilled_at_random_points_lose_nothing(
    tiny_model_dir, tmp_path, pid_alive, gate, launch_streamed, buffer_mode
):
    seed = int(os.environ.get("ASYNCRL_CHAOS_SEED", random.randrange(1_000_000)))
    rng = random.Random(seed)
    total_groups = STEPS * GROUPS
    # Kill points in TaskDone records, all before the gated steps.
    thresholds = sorted(rng.sample(range(1, GATED_STEP * GROUPS), NUM_KILLS))
    args, env = gated_job_args(
        tiny_model_dir,
        tmp_path,
        gate.path,
        "generators.num_generators=2",
        f"generators.max_restarts={NUM_KILLS}",
        f"buffer.mode={buffer_mode}",
        first_held=GATED_GROUP,
        steps=STEPS,
        groups=GROUPS,
        samples=SAMPLES,
        name="chaos",
    )
    run_dir = tmp_path / "chaos"
    lines = launch_streamed(args, env)
    killed: list[dict] = []
    lines.wait_for(r"^started learner ", timeout_s=WAIT_S)  # the record stream is up
    with RunRecords(run_dir, lines) as records:
        for threshold in thresholds:
            records.wait_for(
                lambda r, t=threshold: len(r.of("task")) >= t,
                timeout_s=WAIT_S,
                what=f"{threshold} tasks done (seed {seed})",
            )
            # A worker forked from the fork server is recorded as spawned before it has put its
            # output on its log: a victim is drawn among those that have done work since.
            victims = records.wait_for(
                live_working_generators, timeout_s=WAIT_S, what=f"a live generator at work (seed {seed})"
            )
            victim = rng.choice(victims)
            assert is_that_generator(victim["pid"], victim["peer_id"], run_dir), (victim, seed)
            os.kill(victim["pid"], signal.SIGKILL)
            killed.append(victim)
            records.wait_for(
                lambda r, v=victim: any(x["peer_id"] == v["peer_id"] for x in r.of("restart")),
                timeout_s=WAIT_S,
                what=f"the restart of {victim['peer_id']} (seed {seed})",
            )
    gate.open()
    code = lines.wait_exit(timeout_s=400)
    context = f"seed {seed}, kills at {thresholds}: {[k['peer_id'] for k in killed]}\n{lines.tail()}"
    assert code == 0, context

    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed", context
    assert summary["generator_restarts"] == NUM_KILLS, context
    assert summary["trajectories_lost"] == 0, context
    if buffer_mode == "window":  # pool mode ends with the buffer's lead admitted, not trained
        assert summary["trajectories_pending"] == 0, context
    assert summary["trajectories_duplicated"] == 0, context
    assert summary["trajectories_trained"] == total_groups * SAMPLES, context

    # No group trained on more samples than configured: every step trained exactly its window.
    steps = read_records(run_dir, "step")
    assert [s["step"] for s in steps] == list(range(STEPS)), context
    assert all(s["num_trajectories"] == GROUPS * SAMPLES for s in steps), context
    if buffer_mode == "pool":  # each group trained once as new (no replays configured)
        first_uses = [g for s in steps for g in s["groups_trained"]]
        assert len(first_uses) == len(set(first_uses)) == total_groups, context

    # Every kill was seen as exactly one restart of that process, and its tasks re-queued once.
    restarts = read_records(run_dir, "restart")
    assert [r["peer_id"] for r in restarts] == [k["peer_id"] for k in killed], context
    assert [r["generator_restarts"] for r in restarts] == list(range(1, NUM_KILLS + 1)), context
    requeued = [t for r in restarts for t in r["requeued"]]
    assert summary["tasks_requeued"] == len(requeued), context
    if buffer_mode == "window":
        assert all(t < total_groups for t in requeued), context

    # Every process the run started is gone.
    pids = [r["pid"] for r in read_records(run_dir, "spawn")]
    assert len(pids) == 1 + 2 + NUM_KILLS, context
    assert not [p for p in pids if pid_alive(p)], context
