"""The generator service's send gate (generators/canary.py: SendGate) around its sending:
rollouts carrying a token of a version whose canary verdict is pending wait, with everything after
them, and go out in order once the version is accepted; a stream that ends with rollouts held is
not a stream that lost them."""

from __future__ import annotations

import asyncio
import dataclasses

from asyncrl.generators.canary import GeneratorCanary
from tests.unit.test_generator_stream import Sockets, drain, rollout, service, task


def sampled(t, versions):
    return [dataclasses.replace(rollout(t, k), token_versions=versions) for k in range(t.num_samples)]


def gated_service(sockets, gen=None):
    svc = service(sockets, gen)
    svc.weights.canary = GeneratorCanary(None)
    svc.weights.canary.gate.expect(2)  # version 2 was loaded; its verdict has not come
    return svc


def test_a_pending_version_holds_its_rollouts_and_what_follows_until_accepted():
    sockets = Sockets()
    svc = gated_service(sockets)
    tasks = [task(0), task(1), task(2)]

    async def go() -> None:
        for t in tasks:
            svc.scorer.open(t)
        await svc.take(sampled(tasks[0], [1, 1]))  # version 1 only: goes at once
        await svc.take(sampled(tasks[1], [1, 2]))  # its last tokens came from version 2: held
        await svc.take(sampled(tasks[2], [1, 1]))  # behind a held batch: held, order kept
        assert sorted(sockets.trajectories) == [(0, k) for k in range(3)]
        assert sockets.done == [[(0, 3, 0, 0)]]
        svc.weights.canary.gate.accept(1)  # an older version's verdict releases nothing
        await svc.send_released()
        assert len(sockets.trajectories) == 3
        svc.weights.canary.gate.accept(2)
        await svc.send_released()

    asyncio.run(go())
    assert [t for t, _ in sockets.trajectories] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert sockets.done == [[(0, 3, 0, 0)], [(1, 3, 0, 0)], [(2, 3, 0, 0)]]
    assert not svc.weights.canary.gate.held and not svc.scorer.groups


def test_a_stream_that_ends_with_rollouts_held_has_not_lost_them():
    class Switched:
        async def generate_stream(self, feed):
            yield sampled_draws(feed.take(100))

    def sampled_draws(draws):
        return [dataclasses.replace(rollout(d.task, d.sample_index), token_versions=[2, 2]) for d in draws]

    sockets = Sockets()
    svc = gated_service(sockets, Switched())
    svc.scorer.open(task(0))
    svc.feed.put([task(0)])
    asyncio.run(drain(svc))  # no "without returning" error
    assert sockets.trajectories == [] and svc.weights.canary.gate.held_samples() == {(0, k) for k in range(3)}
