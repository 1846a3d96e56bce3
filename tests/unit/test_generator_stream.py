"""The generator service's stream (`GeneratorService.run_stream`), with a scripted generator and
recording stand-ins for its two sockets: each trajectory goes to the learner as soon as its own
reward is in, while the rest of its group is still being generated, a redraw goes back through
the feed, and a task's TaskDone follows its last sample. No sockets, no processes, no sleeps: the
scripted generator waits (with a deadline) for the service to have sent what it must have sent."""

from __future__ import annotations

import asyncio
import dataclasses
import math
from types import SimpleNamespace

import pytest

from asyncrl.config_load import load_config
from asyncrl.generators.base import Rollout
from asyncrl.generators.canary import GeneratorCanary
from asyncrl.generators.feed import SampleFeed
from asyncrl.generators.scoring import SampleScorer
from asyncrl.generators.service import GeneratorService
from asyncrl.messages import PromptTask, SamplingParams, TasksDone, Trajectories, Trajectory

DEADLINE_S = 30.0  # a service that held the sample back fails here instead of hanging


def task(task_id: int, n: int = 3) -> PromptTask:
    return PromptTask(
        task_id=task_id,
        group_id=task_id,
        prompt_ids=[1, 5, 6],
        num_samples=n,
        sampling=SamplingParams(temperature=1.0, max_new_tokens=4),
        dataset_index=task_id,
        window=0,
        answer="7",
    )


def rollout(t: PromptTask, k: int, *, logp: float = -0.25) -> Rollout:
    return Rollout(
        task_id=t.task_id,
        sample_index=k,
        completion_ids=[4, 2],
        behavior_logprobs=[logp, -0.5],
        token_versions=[0, 0],
        reward=1.0,
        finish_reason="stop",
    )


class Sockets:
    """Records what the service sends; `sent` wakes whoever waits for a trajectory to go out."""

    def __init__(self) -> None:
        self.trajectories: list[tuple[int, int]] = []  # (task_id, sample_index), in send order
        self.messages: list[list[tuple[int, int]]] = []  # the same, one list per data message
        self.done: list[list[tuple[int, int, int, int]]] = []  # TasksDone: (task, n, invalid, regenerated)
        self.sent = asyncio.Event()

    async def send(self, msg, tensors=()) -> None:
        match msg:
            case Trajectories() | Trajectory():
                items = msg.items if isinstance(msg, Trajectories) else [msg]
                self.messages.append([(t.task_id, t.sample_index) for t in items])
                self.trajectories += self.messages[-1]
                self.sent.set()
            case TasksDone():
                self.done.append(
                    [(d.task_id, d.num_trajectories, d.num_invalid, d.num_regenerated) for d in msg.items]
                )


async def sent(sockets: Sockets, what: tuple[int, int]) -> None:
    async def until() -> None:
        while what not in sockets.trajectories:
            sockets.sent.clear()
            await sockets.sent.wait()

    await asyncio.wait_for(until(), DEADLINE_S)


class Scripted:
    """Takes the whole feed, then hands back sample (0, 0) alone and waits until it went to the
    learner before generating the rest; sample (1, 2) first comes back invalid (a NaN log-prob),
    and its redraw is taken from the feed like any sample."""

    def __init__(self, sockets: Sockets) -> None:
        self.sockets = sockets
        self.redraw_attempts: list[int] = []

    async def generate_stream(self, feed: SampleFeed):
        draws = feed.take(100)
        self.redraw_attempts += [d.task.attempt for d in draws if d.task.attempt]
        first, rest = draws[:1], draws[1:]
        yield [rollout(d.task, d.sample_index) for d in first]
        if rest:
            await sent(self.sockets, (0, 0))  # the group and the batch are not done: it went anyway
            nan = {(1, 2): math.nan}
            yield [
                rollout(d.task, d.sample_index, logp=nan.get((d.task.task_id, d.sample_index), -0.25))
                for d in rest
            ]


def service(sockets: Sockets, gen) -> GeneratorService:
    cfg = load_config(None, [])
    svc = GeneratorService.__new__(GeneratorService)  # its sockets and plugin are the stand-ins
    svc.ctx = SimpleNamespace(peer_id="g0", config=cfg, ctrl=sockets)
    svc.gen, svc.streams, svc.data = gen, True, sockets
    svc.feed, svc.scorer = SampleFeed(), SampleScorer(cfg)
    svc.num_opd_samples = svc.num_samples = svc.num_tokens = 0
    svc.busy_s = 0.0
    svc.metrics_sent_at = math.inf  # no Metrics in this test
    svc.sending = asyncio.Lock()
    svc.taking, svc.wake = {}, asyncio.Event()
    svc.weights = SimpleNamespace(canary=GeneratorCanary(None))  # no canary: nothing is held
    return svc


async def drain(svc: GeneratorService) -> None:
    """As the work loop does: a stream while the feed has work (a redraw starts another), and
    the scoring tasks the streams left behind, until neither is left."""
    while svc.feed.has_work() or svc.taking:
        if svc.feed.has_work():
            await asyncio.wait_for(svc.run_stream(), DEADLINE_S)
        if svc.taking:
            await asyncio.wait_for(asyncio.wait(list(svc.taking)), DEADLINE_S)
        svc.reap_taken()


def test_each_trajectory_goes_out_as_soon_as_its_reward_is_in_and_task_done_follows_the_group():
    sockets = Sockets()
    gen = Scripted(sockets)
    svc = service(sockets, gen)
    tasks = [task(0), task(1)]

    async def go() -> None:
        for t in tasks:
            svc.scorer.open(t)
        svc.feed.put(tasks)
        await drain(svc)

    asyncio.run(go())
    assert sockets.messages[0] == [(0, 0)]  # alone, before anything else of its group or batch
    assert sorted(sockets.trajectories) == [(t, k) for t in (0, 1) for k in range(3)]  # each once
    assert sockets.trajectories[-1] == (1, 2) and gen.redraw_attempts == [1]
    assert sockets.done == [[(0, 3, 0, 0)], [(1, 3, 1, 1)]]  # task 1 done only after its redraw
    assert svc.num_samples == 6 and not svc.scorer.groups


def test_a_failing_stream_fails_the_service_with_its_error():
    class Broken:
        async def generate_stream(self, feed):
            feed.take(100)
            yield []
            raise RuntimeError("reward server unreachable")

    sockets = Sockets()
    svc = service(sockets, Broken())
    svc.scorer.open(task(0))
    svc.feed.put([task(0)])
    with pytest.raises(RuntimeError, match="reward server unreachable"):
        asyncio.run(asyncio.wait_for(svc.run_stream(), DEADLINE_S))


def test_a_stream_that_drops_a_sample_fails_instead_of_stalling_the_run():
    """A generator that ends its stream without returning every draw would leave its task open
    forever (the launcher waits for its TaskDone): the service names what is missing."""

    class Lossy:
        async def generate_stream(self, feed):
            draws = feed.take(100)
            yield [rollout(d.task, d.sample_index) for d in draws[:-1]]

    sockets = Sockets()
    svc = service(sockets, Lossy())
    svc.scorer.open(task(0))
    svc.scorer.open(task(1))
    svc.feed.put([task(0), task(1)])
    svc.feed.take(0)
    with pytest.raises(
        ValueError, match=r"without returning 1 sample\(s\) it took, \(task, sample\) \[\(1, 2\)\]"
    ):
        asyncio.run(asyncio.wait_for(svc.run_stream(), DEADLINE_S))


class HungFirst:
    """A task.rewards scorer that never answers for task 0's samples until `release` is set (a hung
    verifier), and scores every other sample at once."""

    names: list[str] = []

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.hung = asyncio.Event()  # task 0's scoring has begun

    async def score(self, samples):
        if any(s.prompt == "hang" for s in samples):
            self.hung.set()
            await self.release.wait()
        return [SimpleNamespace(failed=False, failures={}, parts={}, reward=1.0) for _ in samples]


class Texted:
    """Each call hands out the whole feed at once, with the texts rewards read (task 0: "hang")."""

    async def generate_stream(self, feed: SampleFeed):
        draws = feed.take(100)
        yield [
            dataclasses.replace(
                rollout(d.task, d.sample_index),
                prompt_text="hang" if d.task.task_id == 0 else "q",
                completion_text="a",
            )
            for d in draws
        ]


def test_a_hung_reward_holds_only_its_group_not_its_arrival_nor_the_next_stream():
    """Tasks 0 and 1 come back in one arrival and task 0's scoring hangs: task 1 goes out at once,
    the stream ends without waiting (the next stream runs, task 2 goes out), and task 0 goes out,
    after its samples, once its scoring ends."""
    sockets = Sockets()
    svc = service(sockets, Texted())
    hung = HungFirst()
    svc.scorer.scorer = hung

    async def go() -> None:
        for t in (task(0), task(1)):
            svc.scorer.open(t)
        svc.feed.put([task(0), task(1)])
        await asyncio.wait_for(svc.run_stream(), DEADLINE_S)  # returns with task 0 being scored
        await asyncio.wait_for(hung.hung.wait(), DEADLINE_S)
        await sent(sockets, (1, 2))
        assert svc.taking and sockets.done == [[(1, 3, 0, 0)]]  # not held by task 0's samples
        svc.scorer.open(task(2))
        svc.feed.put([task(2)])
        await asyncio.wait_for(svc.run_stream(), DEADLINE_S)
        await sent(sockets, (2, 2))
        assert sockets.done == [[(1, 3, 0, 0)], [(2, 3, 0, 0)]]  # while task 0 still hangs
        hung.release.set()
        await drain(svc)

    asyncio.run(go())
    assert sockets.trajectories[6:] == [(0, 0), (0, 1), (0, 2)]
    assert sockets.done[2:] == [[(0, 3, 0, 0)]] and not svc.taking and not svc.scorer.groups
