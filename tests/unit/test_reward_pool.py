"""RewardPool (asyncrl/rewards/pool.py): worker processes with a per-call timeout.

Rewards come from tests/reward_fixtures.py by `pkg.mod:fn` path, which the spawned workers import
themselves (through the parent's sys.path)."""

from __future__ import annotations

import asyncio
import os
import select
import subprocess
import sys
import textwrap
import time

import pytest

from asyncrl.config_sections import RewardConfig, ScoringConfig, TaskConfig
from asyncrl.rewards import RewardFailure, RewardInput, RewardPool, Scorer

MISBEHAVE = RewardConfig(kind="tests.reward_fixtures:misbehave")


def sample(completion: str, answer: str = "") -> RewardInput:
    return RewardInput("prompt", completion, answer, {"row": 1}, 3, "stop", 10)


def run_pool(pool: RewardPool, *batches: tuple[int, list[str]]) -> list[list]:
    """Each (reward_index, completions) batch through `pool`, in turn, on one loop; then close."""

    async def main():
        try:
            return [await pool.run(index, [sample(c) for c in batch]) for index, batch in batches]
        finally:
            await pool.aclose()

    return asyncio.run(main())


def wait_gone(pid: int, timeout_s: float = 10.0) -> bool:
    """True once `pid` has exited (woken by its pidfd, not by polling)."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        return bool(select.select([fd], [], [], timeout_s)[0])
    finally:
        os.close(fd)


def test_results_keep_sample_order_across_chunks_and_workers():
    completions = ["x" * (i % 17) for i in range(300)]
    pool = RewardPool([RewardConfig(kind="tests.reward_fixtures:length")], workers=2, timeout_s=30)
    (results,) = run_pool(pool, (0, completions))
    assert results == [float(len(c)) for c in completions]


def test_a_reward_that_raises_fails_only_those_samples():
    pool = RewardPool([MISBEHAVE], workers=2, timeout_s=30)
    (results,) = run_pool(pool, (0, ["a", "raise", "bb", "raise", "ccc"]))
    assert results[0::2] == [1.0, 2.0, 3.0]
    assert results[1] == results[3] == RewardFailure("raised", "ValueError: bad sample")


def test_non_finite_and_non_number_returns_are_invalid():
    pool = RewardPool([MISBEHAVE], workers=1, timeout_s=30)
    ((nan, text, ok),) = run_pool(pool, (0, ["nan", "str", "ok"]))
    assert nan.kind == "invalid" and "nan" in nan.detail
    assert text.kind == "invalid" and "str" in text.detail
    assert ok == 2.0


def test_a_hang_times_out_that_sample_and_its_worker_is_replaced(pid_alive):
    pool = RewardPool([MISBEHAVE, RewardConfig(kind="tests.reward_fixtures:pid")], workers=1, timeout_s=0.5)

    async def main():
        try:
            await pool.run(0, [sample("warm")])  # workers up: start-up time is not on the clock below
            before = set(pool.pids)
            started = time.monotonic()
            hung = await pool.run(0, [sample(c) for c in ["a", "hang", "bb", "ccc", "hang", "dddd"]])
            wall_s = time.monotonic() - started
            after = set(pool.pids)
            again = await pool.run(1, [sample("x") for _ in range(8)])
            return before, hung, wall_s, after, again
        finally:
            await pool.aclose()

    before, hung, wall_s, after, again = asyncio.run(main())
    assert [hung[i] for i in (0, 2, 3, 5)] == [1.0, 2.0, 3.0, 4.0]
    for failure in (hung[1], hung[4]):
        assert failure.kind == "timeout" and "task.scoring.timeout_s = 0.5s" in failure.detail
    assert wall_s < 8.0  # two hangs of 0.5 s and two worker start-ups, with room for a busy CI host
    assert len(after) == 1 and before.isdisjoint(after)  # killed and replaced (twice)
    assert not any(pid_alive(pid) for pid in before)
    assert {int(pid) for pid in again} == after  # the replacement scores
    assert pool.num_timeouts == 2


def test_a_worker_that_exits_fails_its_sample_and_the_rest_go_on():
    pool = RewardPool([MISBEHAVE], workers=1, timeout_s=30)
    (results,) = run_pool(pool, (0, ["a", "exit", "bb"]))
    assert results[0] == 1.0 and results[2] == 2.0
    assert results[1].kind == "raised" and "WorkerExited" in results[1].detail


def test_a_reward_that_cannot_build_in_the_worker_fails_every_sample():
    pool = RewardPool(
        [RewardConfig(kind="tests.reward_fixtures:failing_factory", options={"a": 1})],
        workers=1,
        timeout_s=30,
    )
    (results,) = run_pool(pool, (0, ["a", "b"]))
    assert all(r.kind == "raised" and "cannot build" in r.detail for r in results)


def test_workers_do_not_import_torch():
    pool = RewardPool([RewardConfig(kind="tests.reward_fixtures:torch_imported")], workers=1, timeout_s=30)
    assert run_pool(pool, (0, ["a"])) == [[0.0]]


def test_close_leaves_no_process(pid_alive):
    pool = RewardPool([MISBEHAVE], workers=2, timeout_s=30)
    pool.start()
    pids = pool.pids
    assert len(pids) == 2 and all(pid_alive(pid) for pid in pids)
    pool.close()
    pool.close()  # idempotent
    assert pool.pids == [] and not any(pid_alive(pid) for pid in pids)
    with pytest.raises(RuntimeError, match="closed"):
        asyncio.run(pool.run(0, [sample("a")]))


def test_close_fails_the_samples_still_pending(pid_alive):
    pool = RewardPool([MISBEHAVE], workers=1, timeout_s=30)

    async def main():
        await pool.run(0, [sample("warm")])
        pending = asyncio.ensure_future(pool.run(0, [sample("hang"), sample("a")]))
        await asyncio.sleep(0)  # let run() hand the chunk out (one loop turn, not a timed wait)
        pool.close()
        return await pending

    hang, rest = asyncio.run(main())
    assert hang.kind == rest.kind == "raised" and "closed" in hang.detail


def test_workers_die_with_their_parent(tmp_path):
    """A parent killed by SIGKILL (no close()) leaves no reward worker behind: not its started
    workers, not its fork server, not the server's forks."""
    script = textwrap.dedent(
        """
        import asyncio, select, sys
        from asyncrl.config_sections import RewardConfig
        from asyncrl.rewards import RewardInput, RewardPool

        async def main():
            pool = RewardPool([RewardConfig(kind="tests.reward_fixtures:pid")], workers=2, timeout_s=30)
            await pool.run(0, [RewardInput("p", "c", "a", {}, 1, "stop", 1)])
            assert select.select([pool._server.sock], [], [], 60.0)[0]  # the fork server is ready
            pool._spawn()  # a third worker: forked by the fork server
            print(*pool.pids, pool._server.proc.pid, flush=True)
            await asyncio.Event().wait()

        asyncio.run(main())
        """
    )
    parent = subprocess.Popen(
        [sys.executable, "-c", script],
        stdout=subprocess.PIPE,
        text=True,
        cwd=os.getcwd(),
        env=dict(os.environ),
    )
    try:
        pids = [int(p) for p in parent.stdout.readline().split()]
        assert len(pids) == 4
    finally:
        parent.kill()
        parent.wait()
        parent.stdout.close()
    assert all(wait_gone(pid) for pid in pids)


def test_scorer_runs_non_cheap_sync_rewards_in_the_pool():
    section = TaskConfig(
        rewards=[
            RewardConfig(kind="tests.reward_fixtures:misbehave", name="m"),  # auto, not cheap: the pool
            RewardConfig(kind="exact_match", name="em", weight=0.5),  # cheap: a thread
        ],
        scoring=ScoringConfig(workers=1, timeout_s=0.5),
    )
    scorer = Scorer(section)
    try:
        assert scorer.pool is not None and len(scorer.pool.specs) == 1
        scores = scorer.score_sync([sample("ab", "ab"), sample("hang", "hang"), sample("raise", "x")])
        pool_pids = scorer.pool.pids
    finally:
        scorer.close()
    assert scores[0].reward == 2.5 and scores[0].parts == {"m": 2.0, "em": 1.0}
    assert scores[1].reward == 0.5 and scores[1].failures == {"m": "timeout"}
    assert scores[2].failures == {"m": "raised: ValueError: bad sample"} and scores[2].reward == 0.0
    assert len(pool_pids) == 1


def test_hung_calls_cost_their_timeout_once_overlapped_not_one_after_another():
    """Issue #36: each hung call held its worker for the full timeout, one after another, and the
    samples queued behind it in its chunk waited too. Now the pool grows while calls hang (up to
    max_workers) and takes the rest of a stuck worker's chunk elsewhere."""
    pool = RewardPool([MISBEHAVE], workers=2, max_workers=16, timeout_s=3.0)
    batch = ["hang" if i % 5 == 0 else "x" * (1 + i % 7) for i in range(60)]  # 12 hangs

    async def main():
        try:
            await pool.run(0, [sample("warm")])
            started = time.monotonic()
            results = await pool.run(0, [sample(c) for c in batch])
            wall_s = time.monotonic() - started
            return results, wall_s, len(pool.pids)
        finally:
            await pool.aclose()

    results, wall_s, num_after = asyncio.run(main())
    for c, r in zip(batch, results, strict=True):
        if c == "hang":
            assert isinstance(r, RewardFailure) and r.kind == "timeout"
        else:
            assert r == float(len(c))
    assert pool.num_timeouts == 12
    # One after another on 2 workers: 6 timeouts (18 s). Overlapped: about one, plus start-ups.
    assert wall_s < 10.0, wall_s
    assert num_after == 2  # the extra workers retired once idle


def test_hangs_queued_behind_a_hang_end_at_the_same_deadline_as_it():
    """Issue #36: each hang is found `slow_s` after its call began, so a hang queued behind another
    began later and, with the clock started per call, ended later: a batch's hangs cost a timeout
    plus a chain of detections. The clock starts when the batch reaches the pool: every hang of
    the batch is cut off at the same instant, submission + timeout_s."""
    pool = RewardPool([MISBEHAVE], workers=1, max_workers=8, timeout_s=4.0)
    cut_at: list[tuple[float, float]] = []  # (the deadline applied, the job's submission)
    fail_current = pool._fail_current

    def spy(w, failure):
        if failure.kind == "timeout":
            cut_at.append((pool._deadline(w), w.task.job.submitted))
        fail_current(w, failure)

    pool._fail_current = spy

    async def main():
        try:
            await pool.run(0, [sample("warm")])
            return await pool.run(0, [sample(c) for c in ["hang", "hang", "hang", "a"]])
        finally:
            await pool.aclose()

    results = asyncio.run(main())
    assert [getattr(r, "kind", r) for r in results] == ["timeout", "timeout", "timeout", 1.0]
    assert len(cut_at) == 3 and all(deadline == submitted + 4.0 for deadline, submitted in cut_at)


def test_a_call_that_is_only_slow_keeps_its_value_and_the_rest_of_its_chunk_moves_on():
    pool = RewardPool(
        [RewardConfig(kind="tests.reward_fixtures:slow")], workers=1, max_workers=4, timeout_s=10.0
    )
    batch = ["slow:2.5", "a", "bb", "ccc"]

    async def main():
        try:
            await pool.run(0, [sample("warm")])
            return await pool.run(0, [sample(c) for c in batch])
        finally:
            await pool.aclose()

    assert asyncio.run(main()) == [float(len(c)) for c in batch]
    assert pool.num_stuck == 1 and pool.num_timeouts == 0


def server_ready(pool: RewardPool) -> None:
    """Wait (deadline 60 s) until the pool's fork server has said it is ready; start it if need be."""
    pool.start()
    assert pool._server is not None and pool._server.sock is not None
    assert select.select([pool._server.sock], [], [], 60.0)[0], "the fork server did not get ready"


def test_workers_the_pool_adds_are_forked_from_its_fork_server(pid_alive):
    """While a call is stuck the pool adds workers; once its fork server (zygote.py) is ready they
    are its forks, not interpreter starts; close() ends the server."""
    pool = RewardPool(
        [RewardConfig(kind="tests.reward_fixtures:slow_ppid")], workers=1, max_workers=4, timeout_s=10.0
    )
    batch = ["slow:2.5", "a", "bb", "ccc"]

    async def main():
        try:
            server_ready(pool)
            return await pool.run(0, [sample(c) for c in batch]), pool._server.proc.pid
        finally:
            await pool.aclose()

    parents, server_pid = asyncio.run(main())
    assert parents[0] == os.getpid()  # the first worker: an interpreter this process started
    assert parents[1:] == [server_pid] * 3  # the rest of its chunk went to forks of the server
    assert pool.num_stuck == 1 and not pid_alive(server_pid)


def test_a_fork_server_that_died_leaves_the_pool_starting_interpreters():
    pool = RewardPool(
        [RewardConfig(kind="tests.reward_fixtures:slow_ppid")], workers=1, max_workers=4, timeout_s=10.0
    )

    async def main():
        try:
            server_ready(pool)
            pool._server.proc.kill()
            pool._server.proc.wait()
            return await pool.run(0, [sample(c) for c in ["slow:1.5", "a", "bb"]])
        finally:
            await pool.aclose()

    assert asyncio.run(main()) == [float(os.getpid())] * 3
    assert pool._server.off


def test_a_call_that_computes_is_slow_not_stuck_and_the_pool_does_not_grow():
    """A call past the stuck threshold whose process is running (not sleeping) is a slow reward:
    more workers would only share the CPU, so its chunk stays with it and no worker is added."""
    pool = RewardPool(
        [RewardConfig(kind="tests.reward_fixtures:spin_pid")], workers=1, max_workers=4, timeout_s=30.0
    )

    async def main():
        try:
            await pool.run(0, [sample("warm")])
            return await pool.run(0, [sample(c) for c in ["spin:2.5", "a", "bb", "ccc"]])
        finally:
            await pool.aclose()

    pids = asyncio.run(main())
    assert len(set(pids)) == 1 and pool.num_stuck == 0
