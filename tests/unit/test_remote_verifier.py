"""The `remote` reward (asyncrl/rewards/remote.py) against the stand-in verifier
(asyncrl/testing/verifier.py), in-process and as a separate process: batching, retries on 5xx,
timeouts and connection errors, a server that goes down and comes back. Loopback only."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import pytest

from asyncrl.config_sections import RewardConfig, ScoringConfig, TaskConfig
from asyncrl.rewards import RewardInput, Scorer
from asyncrl.rewards.remote import RemoteRewardError, remote
from asyncrl.testing.verifier import VerifierServer


def sample(completion: str, answer: str) -> RewardInput:
    return RewardInput("prompt", completion, answer, {"id": 7}, 3, "stop", 10)


BATCH = [sample("1", "1"), sample("2", "3"), sample(" 4 ", "4"), sample("5", "5"), sample("x", "y")]
EXPECTED = [1.0, 0.0, 1.0, 1.0, 0.0]


def run(coro_fn, *args):
    async def main():
        verifier = args[0]
        try:
            return await coro_fn(*args)
        finally:
            await verifier.close()

    return asyncio.run(main())


@pytest.fixture
def server():
    with VerifierServer() as srv:
        yield srv


def test_scores_a_batch_in_parallel_requests(server):
    verifier = remote(server.url, batch_size=2)
    assert run(lambda v: v.score_batch(BATCH), verifier) == EXPECTED
    assert server.num_requests == 3 and server.num_items == 5


def test_503s_within_the_retries_then_success(server):
    server.fail_next(2)
    verifier = remote(server.url, retries=3, backoff_s=0.01)
    assert run(lambda v: v.score_batch(BATCH), verifier) == EXPECTED
    assert server.num_requests == 3 and verifier.num_retries == 2


def test_503s_past_the_retries_raise_naming_the_url(server):
    server.fail_next(10)
    verifier = remote(server.url, retries=2, backoff_s=0.01)
    with pytest.raises(RemoteRewardError, match=rf"{server.url} failed 3 attempts.*HTTP 503"):
        run(lambda v: v.score_batch(BATCH), verifier)
    assert server.num_requests == 3


def test_a_malformed_response_is_an_error_naming_the_url_and_not_retried(server):
    server.malformed_next(1)
    verifier = remote(server.url, retries=3, backoff_s=0.01)
    with pytest.raises(RemoteRewardError, match=rf'{server.url} must answer {{"rewards"'):
        run(lambda v: v.score_batch(BATCH), verifier)
    assert server.num_requests == 1


def test_a_request_past_timeout_is_retried(server):
    server.hang_next(1)
    verifier = remote(server.url, timeout_s=0.3, retries=1, backoff_s=0.01)
    assert run(lambda v: v.score_batch(BATCH), verifier) == EXPECTED
    assert verifier.num_retries == 1


def test_server_down_then_back(server):
    verifier = remote(server.url, timeout_s=2.0, retries=2, backoff_s=0.05)

    async def scenario(v):
        first = await v.score_batch(BATCH)  # leaves a pooled keep-alive connection behind
        server.stop()
        started = time.monotonic()
        with pytest.raises(RemoteRewardError, match="failed 3 attempts"):
            await v.score_batch(BATCH)
        down_s = time.monotonic() - started
        server.start()  # the same port
        return first, down_s, await v.score_batch(BATCH)

    first, down_s, back = run(scenario, verifier)
    assert first == back == EXPECTED
    assert down_s < 2.0  # refused connections fail fast: about the 0.05 + 0.1 s of backoff


def test_scorer_fails_every_sample_of_a_failed_request_and_keeps_the_others(server):
    section = TaskConfig(
        rewards=[
            RewardConfig(
                kind="remote", name="judge", options={"url": server.url, "retries": 0, "batch_size": 8}
            ),
            RewardConfig(kind="exact_match", name="em", weight=0.25),
        ],
        scoring=ScoringConfig(timeout_s=5.0),
    )
    scorer = Scorer(section)
    try:
        good = scorer.score_sync(BATCH)
        server.fail_next(1)
        bad = scorer.score_sync(BATCH)
    finally:
        scorer.close()
    assert [s.parts["judge"] for s in good] == EXPECTED and not any(s.failed for s in good)
    assert all(s.failures["judge"].startswith("raised: RemoteRewardError:") for s in bad)
    assert [s.reward for s in bad] == [0.25 * e for e in EXPECTED]  # exact match still counts


def test_a_verifier_process_killed_and_restarted():
    def launch(port: int) -> subprocess.Popen:
        return subprocess.Popen(
            [sys.executable, "-m", "asyncrl.testing.verifier", "--port", str(port)],
            stdout=subprocess.PIPE,
            text=True,
        )

    def end(p: subprocess.Popen) -> None:
        p.kill()
        p.wait()
        p.stdout.close()

    proc = launch(0)
    try:
        url = proc.stdout.readline().strip()  # printed once it listens
        verifier = remote(url, retries=1, backoff_s=0.01)

        async def scenario(v):
            nonlocal proc
            first = await v.score_batch(BATCH)
            end(proc)
            with pytest.raises(RemoteRewardError):
                await v.score_batch(BATCH)
            proc = launch(int(url.rsplit(":", 1)[1].split("/")[0]))
            assert proc.stdout.readline().strip() == url
            return first, await v.score_batch(BATCH)

        first, back = run(scenario, verifier)
        assert first == back == EXPECTED
    finally:
        end(proc)
