"""The generator service's per-sample pieces, without sockets: the feed a backend takes samples
from (`generators/feed.py`), the batch adapter for backends with only `generate(tasks)`, and the
scorer that decides, one rollout at a time, what is sent, what is drawn again and which group is
complete (`generators/scoring.py`)."""

from __future__ import annotations

import asyncio
import math

import pytest

from asyncrl.config_load import load_config
from asyncrl.generators.base import Rollout, streams
from asyncrl.generators.feed import Draw, SampleFeed, batch_stream
from asyncrl.generators.scoring import SampleScorer
from asyncrl.messages import PromptTask, SamplingParams

PARAMS = SamplingParams(temperature=1.0, max_new_tokens=4)


def task(
    task_id: int, *, n: int = 4, attempt: int = 0, params: SamplingParams = PARAMS, **extras
) -> PromptTask:
    return PromptTask(
        task_id=task_id,
        group_id=task_id,
        prompt_ids=[1, 5, 6],
        num_samples=n,
        sampling=params,
        dataset_index=task_id,
        window=0,
        answer="7",
        attempt=attempt,
        extras=extras,
    )


def rollout(t: PromptTask, k: int, *, logps=(-0.5, -0.1), finish="stop", text="7") -> Rollout:
    return Rollout(
        task_id=t.task_id,
        sample_index=k,
        completion_ids=list(range(3, 3 + len(logps))),
        behavior_logprobs=list(logps),
        token_versions=[0] * len(logps),
        reward=math.nan,
        finish_reason=finish,
        prompt_text="1+6=",
        completion_text=text,
    )


# ---------------------------------------------------------------------- feed
def keys(draws: list[Draw]) -> list[tuple[int, int, int]]:
    return [(d.task.task_id, d.sample_index, d.task.attempt) for d in draws]


def test_feed_hands_out_redraws_first_then_samples_in_order_split_across_takes():
    feed = SampleFeed()
    feed.put([task(0, n=3), task(1, n=3)])
    assert keys(feed.take(2)) == [(0, 0, 0), (0, 1, 0)]
    feed.redraw([Draw(task(5, attempt=2), 1)])
    assert keys(feed.take(3)) == [(5, 1, 2), (0, 2, 0), (1, 0, 0)]
    feed.redraw([Draw(task(6, attempt=1), 0)])
    assert feed.queued() == {(6, 0), (1, 1), (1, 2)}
    assert keys(feed.take(10)) == [(6, 0, 1), (1, 1, 0), (1, 2, 0)]
    assert feed.take(10) == [] and not feed.has_work() and feed.queued() == set()
    assert set(feed.started_s) == {0, 1}  # redraws do not restart a task's clock


def test_feed_limits_groups_and_sampling_params_and_stops_when_held_or_closed():
    other = SamplingParams(temperature=0.5, max_new_tokens=4)
    feed = SampleFeed()
    feed.put([task(0, n=2), task(1, n=2), task(2, n=2, params=other), task(3, n=2)])
    assert keys(feed.take(100, max_groups=1)) == [(0, 0, 0), (0, 1, 0)]
    assert keys(feed.take(100, like=PARAMS)) == [(1, 0, 0), (1, 1, 0)]  # stops at task 2's params
    feed.hold()
    assert feed.take(100) == [] and feed.has_work()
    feed.release()
    assert keys(feed.take(100, max_groups=1)) == [(2, 0, 0), (2, 1, 0)]
    feed.close()
    assert feed.take(100) == [] and not feed.has_work()


# ---------------------------------------------------------------------- batch adapter
class BatchOnly:
    """A plugin with only `generate(tasks)`: records each call's (task id, attempt)s."""

    def __init__(self, *, drop: int | None = None) -> None:
        self.calls: list[list[tuple[int, int]]] = []
        self.drop = drop

    async def generate(self, tasks):
        self.calls.append([(t.task_id, t.attempt) for t in tasks])
        return [rollout(t, k) for t in tasks for k in range(t.num_samples) if k != self.drop]


async def collect(stream) -> list[Rollout]:
    return [r for rollouts in [x async for x in stream] for r in rollouts]


def test_batch_adapter_serves_whole_groups_and_redraws_one_sample_each():
    gen, feed = BatchOnly(), SampleFeed()
    feed.put([task(i, n=2) for i in range(5)])
    got = asyncio.run(collect(batch_stream(gen, feed, max_groups=2)))
    assert gen.calls == [[(0, 0), (1, 0)], [(2, 0), (3, 0)], [(4, 0)]]
    assert sorted((r.task_id, r.sample_index) for r in got) == [(i, k) for i in range(5) for k in range(2)]
    # Redraws: sample 1 of task 7 at attempt 1 and sample 3 at attempt 2 go to separate calls
    # (a call sees each task once); only the asked-for samples come back.
    gen.calls.clear()
    feed.redraw([Draw(task(7, attempt=1), 1), Draw(task(7, attempt=2), 3), Draw(task(8, attempt=1), 0)])
    got = asyncio.run(collect(batch_stream(gen, feed, max_groups=4)))
    assert gen.calls == [[(7, 1), (8, 1)], [(7, 2)]]
    assert sorted((r.task_id, r.sample_index) for r in got) == [(7, 1), (7, 3), (8, 0)]


def test_batch_adapter_refuses_a_group_with_a_sample_missing():
    feed = SampleFeed()
    feed.put([task(0, n=3)])
    with pytest.raises(ValueError, match=r"returned samples \[0, 2\] for task 0; expected 0..2 exactly once"):
        asyncio.run(collect(batch_stream(BatchOnly(drop=1), feed, max_groups=1)))


def test_only_a_generator_whose_generate_is_its_own_streams():
    from asyncrl.generators.torch_gen import TorchGenerator

    class Gated(TorchGenerator):
        async def generate(self, tasks):
            return await super().generate(tasks)

    class Faulty(TorchGenerator):
        def generate_sync(self, tasks):
            return super().generate_sync(tasks)

    class Logged(TorchGenerator):
        def setup(self, ctx):
            super().setup(ctx)

    assert streams(TorchGenerator()) and streams(Logged())
    assert not streams(Gated()) and not streams(Faulty()) and not streams(BatchOnly())


# ---------------------------------------------------------------------- per-sample scoring
async def judge(sample) -> float:
    """A reward for the scorer tests: raises for tasks marked `fail`, else exact match."""
    if sample.extras.get("fail"):
        raise RuntimeError("verifier down")
    return 1.0 if sample.completion == sample.answer else 0.0


def scorer(*sets: str) -> SampleScorer:
    return SampleScorer(load_config(None, list(sets)))


def test_each_rollout_is_sent_on_arrival_and_a_group_is_done_with_its_last():
    s = scorer("task.scoring.overlong=mask")
    t = task(0, n=3)
    s.open(t)
    v = asyncio.run(s.take([rollout(t, 2, finish="length")]))
    assert [(x.task_id, r.sample_index) for x, r in v.send] == [(0, 2)] and not v.done and not v.redraw
    assert v.send[0][1].loss_mask == [False, False]  # overlong, masked
    v = asyncio.run(s.take([rollout(t, 0), rollout(t, 1)]))
    assert [r.sample_index for _, r in v.send] == [0, 1]
    ((done_task, group, counts),) = v.done
    assert done_task == t and [r.sample_index for r in group] == [0, 1, 2] and counts.num_overlong == 1
    with pytest.raises(ValueError, match="sample 1 of task 0, which was not asked for"):
        asyncio.run(s.take([rollout(t, 1)]))  # the group is done: a second copy is refused


def test_an_invalid_sample_is_drawn_again_with_the_next_attempt_until_the_budget():
    s = scorer("task.scoring.max_regenerations=2")
    t = task(3, n=2, attempt=1)
    s.open(t)
    nan = (float("nan"), -0.1)
    v = asyncio.run(s.take([rollout(t, 0, logps=nan), rollout(t, 1)]))
    assert [r.sample_index for _, r in v.send] == [1] and not v.done
    assert keys(v.redraw) == [(3, 0, 2)]
    with pytest.raises(ValueError, match="not asked for"):
        asyncio.run(s.take([rollout(t, 1)]))
    v = asyncio.run(s.take([rollout(v.redraw[0].task, 0, logps=(0.5,))]))  # > 0: invalid again
    assert keys(v.redraw) == [(3, 0, 3)]
    v = asyncio.run(s.take([rollout(v.redraw[0].task, 0)]))
    ((_, group, counts),) = v.done
    assert counts.num_invalid == 2 and counts.num_regenerated == 2
    s.open(t)
    v = asyncio.run(s.take([rollout(t, 0, logps=nan)]))
    v = asyncio.run(s.take([rollout(v.redraw[0].task, 0, logps=nan)]))
    with pytest.raises(ValueError, match="still invalid after 2 redraws"):
        asyncio.run(s.take([rollout(v.redraw[0].task, 0, logps=nan)]))


def test_rewards_score_each_arrival_and_failures_regenerate_then_score_zero():
    reward = 'task.rewards=[{kind = "tests.unit.test_sample_feed:judge", name = "judge"}]'
    s = scorer(reward, "task.scoring.on_failure=regenerate", "task.scoring.max_regenerations=1")
    good, bad = task(0, n=2), task(1, n=1, fail=True)
    s.open(good)
    s.open(bad)

    async def go():
        try:
            first = await s.take([rollout(good, 0), rollout(bad, 0)])
            assert [r.reward for _, r in first.send] == [1.0] and keys(first.redraw) == [(1, 0, 1)]
            second = await s.take([rollout(good, 1, text="8"), rollout(first.redraw[0].task, 0)])
            return second
        finally:
            await s.close()

    v = asyncio.run(go())
    assert [(x.task_id, r.reward) for x, r in v.send] == [(0, 0.0), (1, 0.0)]  # failed twice: scored 0
    counts = {t.task_id: c for t, _, c in v.done}
    assert counts[0].num_scored == 2 and counts[0].reward_sums == {"judge": 1.0}
    assert counts[1].num_scored == 2 and counts[1].num_score_failed == 2
    assert counts[1].num_regenerated == 1 and counts[1].reward_failures == {"judge": 2}
