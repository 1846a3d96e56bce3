"""Chaos: generators are SIGKILLed at random points of a run, several times; the run completes,
nothing is lost, no group is trained on more samples than configured, and restarts are counted.
In both buffer modes: window (each step trains its admitted groups) and pool (each step takes
groups from the learner's buffer; no group is trained twice as new).

Kills are triggered by observed progress (TaskDone records in metrics.jsonl), never by sleeps, and
each kill waits until the launcher has recorded the restart before the next one. The generator is
the torch generator behind a gate: groups of the last steps (by group number) wait for a file
the test creates after its last kill, so the run cannot finish before every kill has been seen,
however fast or loaded the machine is. The victims are generator pids that this run's launcher started (its
`spawn` records), each checked to be that generator process before it is signalled.
ASYNCRL_CHAOS_SEED reproduces a failing draw (the seed is in every assertion message).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import textwrap
import time
from pathlib import Path

import pytest

from tests.conftest import gated_job, read_records

pytestmark = pytest.mark.slow

STEPS, GROUPS, SAMPLES = 10, 2, 4
NUM_KILLS = 3
POLL_S = 0.1  # how often the test re-reads metrics.jsonl for progress
GATED_STEP = 7  # groups of this step and later wait for the gate
GATED_GROUP = GATED_STEP * GROUPS  # (in pool mode: groups numbered from here on, the same count)

GATED_PLUGIN = textwrap.dedent(
    f"""
    import asyncio
    import os
    from pathlib import Path

    from asyncrl.generators.torch_gen import TorchGenerator

    class GatedGenerator(TorchGenerator):
        async def generate(self, tasks):
            gate = Path(os.environ["ASYNCRL_TEST_GATE"])
            while any(t.group_id >= {GATED_GROUP} for t in tasks) and not gate.exists():
                await asyncio.sleep(0.05)  # a file the test creates; heartbeats keep flowing
            return await super().generate(tasks)
    """
)


def records(run_dir: Path, kind: str) -> list[dict]:
    if not (run_dir / "metrics.jsonl").is_file():
        return []
    return read_records(run_dir, kind)


def wait_for(condition, proc: subprocess.Popen, what: str) -> None:
    """Poll the run directory until `condition()`; fail if the launcher exits first."""
    while not condition():
        if proc.poll() is not None:
            raise AssertionError(f"the run ended (code {proc.returncode}) while waiting for {what}")
        time.sleep(POLL_S)  # polling a file for progress; the launcher publishes nothing else


def live_generators(run_dir: Path) -> list[dict]:
    """Generator processes started by this run and not yet reported dead by the launcher."""
    dead = {r["peer_id"] for r in records(run_dir, "restart")}
    return [r for r in records(run_dir, "spawn") if r["role"] == "generator" and r["peer_id"] not in dead]


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
def test_generators_sigkilled_at_random_points_lose_nothing(tiny_model_dir, tmp_path, pid_alive, buffer_mode):
    seed = int(os.environ.get("ASYNCRL_CHAOS_SEED", random.randrange(1_000_000)))
    rng = random.Random(seed)
    total_groups = STEPS * GROUPS
    # Kill points in TaskDone records, all before the gated steps.
    thresholds = sorted(rng.sample(range(1, GATED_STEP * GROUPS), NUM_KILLS))
    args, env, gate = gated_job(
        tiny_model_dir,
        tmp_path,
        GATED_PLUGIN,
        "generators.num_generators=2",
        f"generators.max_restarts={NUM_KILLS}",
        f"buffer.mode={buffer_mode}",
        steps=STEPS,
        groups=GROUPS,
        samples=SAMPLES,
        name="chaos",
    )
    run_dir = tmp_path / "chaos"
    out = tmp_path / "launcher.out"
    with open(out, "w") as stdout:
        proc = subprocess.Popen(args, stdout=stdout, stderr=subprocess.STDOUT, text=True, env=env)
    killed: list[dict] = []
    try:
        for threshold in thresholds:
            wait_for(lambda t=threshold: len(records(run_dir, "task")) >= t, proc, f"{threshold} tasks done")
            victim = rng.choice(live_generators(run_dir))
            # A worker forked from the fork server is recorded as spawned before it has put its
            # output on its log: wait for that (it is how the test knows the pid is that worker).
            wait_for(
                lambda v=victim: is_that_generator(v["pid"], v["peer_id"], run_dir),
                proc,
                f"{victim['peer_id']} (pid {victim['pid']}) writing to its log (seed {seed})",
            )
            os.kill(victim["pid"], signal.SIGKILL)
            killed.append(victim)
            wait_for(
                lambda v=victim: any(r["peer_id"] == v["peer_id"] for r in records(run_dir, "restart")),
                proc,
                f"the restart of {victim['peer_id']}",
            )
        gate.touch()
        proc.wait(timeout=400)
    finally:
        if proc.poll() is None:
            proc.kill()  # the launcher this test started; its children follow it (they watch their parent)
            proc.wait()
    log = out.read_text()
    context = f"seed {seed}, kills at {thresholds}: {[k['peer_id'] for k in killed]}\n{log[-3000:]}"
    assert proc.returncode == 0, context

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
