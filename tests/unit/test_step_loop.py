"""StepLoop's update gate: the learner publishes version s while step s trains, and the step's
optimizer update waits for that publish (`before_update`), so the weights being read stay put."""

from __future__ import annotations

import asyncio

from asyncrl.learner.loop import StepLoop


class _WholeWindow:
    """A trainer that takes each window at once (a fallback objective) and logs its calls."""

    fallback = "whole window"

    def __init__(self, events: list[str]) -> None:
        self.events = events

    def begin_step(self, step: int) -> None:
        self.events.append(f"begin {step}")

    def batch_backward(self, samples) -> None:
        self.events.append(f"backward {len(samples)}")

    def finish_step(self) -> str:
        self.events.append("update")
        return "result"


def test_the_update_waits_for_before_update_and_the_gradients_do_not():
    events: list[str] = []

    async def main():
        waiting, published = asyncio.Event(), asyncio.Event()

        async def publish_done() -> None:
            events.append("waiting for the publish")
            waiting.set()
            await published.wait()
            events.append("published")

        loop = StepLoop(_WholeWindow(events), lambda step: 2, before_update=publish_done)
        loop.add(5, "a")
        loop.add(5, "b")
        step = asyncio.create_task(loop.run_step(5))
        await waiting.wait()
        assert events == ["begin 5", "backward 2", "waiting for the publish"]  # no update yet
        published.set()
        assert await step == "result"

    asyncio.run(main())
    assert events == ["begin 5", "backward 2", "waiting for the publish", "published", "update"]


def test_without_a_gate_the_update_follows_the_backward():
    events: list[str] = []
    loop = StepLoop(_WholeWindow(events), lambda step: 1)
    loop.add(0, "a")
    assert asyncio.run(loop.run_step(0)) == "result"
    assert events == ["begin 0", "backward 1", "update"]
