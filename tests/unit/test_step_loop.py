"""StepLoop: the update gate (the learner publishes version s while step s trains, and the step's
optimizer update waits for that publish, `before_update`, so the weights being read stay put), and
when streaming starts training what has arrived (`min_chunk`)."""

from __future__ import annotations

import asyncio

import pytest

from asyncrl.learner.loop import StepLoop


class _WholeWindow:
    """A trainer that takes each window at once (a fallback objective) and logs its calls."""

    fallback = "whole window"
    group_size = 1
    lockstep = False

    def __init__(self, events: list[str]) -> None:
        self.events = events

    def begin_step(self, step: int, *, window_groups: int | None = None) -> None:
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


class _Streaming:
    """A streaming trainer: each `work()` call trains up to `per_call` waiting trajectories (a
    whole chunk, or one at a time as for a group still open) and logs how many."""

    fallback = ""
    group_size = 1
    lockstep = False

    def __init__(self, per_call: int) -> None:
        self.per_call = per_call
        self.waiting: list[str] = []
        self.trained: list[int] = []

    def begin_step(self, step: int, *, window_groups: int | None = None) -> None:
        pass

    def offer(self, sample: str) -> None:
        self.waiting.append(sample)

    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_work(self) -> bool:
        return bool(self.waiting)

    def work(self) -> bool:
        chunk, self.waiting = self.waiting[: self.per_call], self.waiting[self.per_call :]
        self.trained.append(len(chunk))
        return True

    def finish_step(self) -> str:
        return "result"


def _arrivals(per_call: int, min_chunk: int, batches: list[int]) -> list[list[int]]:
    """Feed a 10-trajectory window in `batches`; after each, what the trainer had trained."""
    trainer = _Streaming(per_call)
    seen: list[list[int]] = []

    async def main():
        loop = StepLoop(trainer, lambda step: 10, min_chunk=min_chunk)
        step = None
        for n in batches:
            for _ in range(n):
                loop.add(0, "x")
            step = step or asyncio.create_task(loop.run_step(0))
            # The loop has taken the batch once it waits for data again (or the step ended).
            while loop.arrived.is_set() and not step.done():
                await asyncio.sleep(0)
            seen.append(list(trainer.trained))
        assert await step == "result"

    asyncio.run(main())
    return seen


def test_min_chunk_waits_for_a_chunk_then_trains_the_windows_end_as_it_arrives():
    seen = _arrivals(per_call=100, min_chunk=4, batches=[3, 1, 2, 1, 1, 1, 1])
    assert seen == [
        [],  # 3 waiting, 7 to come: wait for a chunk of 4
        [4],
        [4],  # 2 waiting, 4 to come: still wait
        [4, 3],  # 3 to come (< 4): from here each arrival trains at once
        [4, 3, 1],
        [4, 3, 1, 1],
        [4, 3, 1, 1, 1],  # the last trajectory: trained, and the step ends
    ]


def test_min_chunk_1_trains_every_arrival_at_once():
    assert _arrivals(per_call=100, min_chunk=1, batches=[1] * 10)[:3] == [[1], [1, 1], [1, 1, 1]]


def test_a_started_run_of_work_continues_below_min_chunk():
    # One trajectory per work() call (an open group streams one at a time): once 4 wait, all 4
    # train, not just the first (the remaining 3 would otherwise wait for the window's end).
    assert _arrivals(per_call=1, min_chunk=4, batches=[4, 6])[0] == [1, 1, 1, 1]


def test_min_chunk_below_1_is_refused():
    with pytest.raises(ValueError, match="min_chunk"):
        StepLoop(_Streaming(1), lambda step: 1, min_chunk=0)


class _Recording(_Streaming):
    """A streaming trainer that logs every offer (by traj id) and every work call."""

    def __init__(self) -> None:
        super().__init__(per_call=1)
        self.log: list[str] = []

    def offer(self, sample) -> None:
        super().offer(sample)
        self.log.append(f"offer {sample.traj_id}")

    def work(self) -> bool:
        self.log.append(f"work {self.waiting[0].traj_id}")
        return super().work()


def _canonical_log(arrival: list[int], batches: list[int]) -> list[str]:
    """Window 3 of 6 trajectories (traj ids 18..23) arriving in `arrival` order, `batches` at a time."""
    import types

    trainer = _Recording()

    async def main():
        loop = StepLoop(trainer, lambda step: 6, min_chunk=4, canonical_chunk=4)
        step = None
        it = iter(arrival)
        for n in batches:
            for _ in range(n):
                loop.add(3, types.SimpleNamespace(traj_id=next(it)))
            step = step or asyncio.create_task(loop.run_step(3))
            while loop.arrived.is_set() and not step.done():
                await asyncio.sleep(0)
        assert await step == "result"

    asyncio.run(main())
    return trainer.log


def test_canonical_order_offers_by_traj_id_and_works_after_each_offer_whatever_the_arrivals():
    """Sync runs were not reproducible with streaming on: the streamed accumulation followed the
    trajectories' arrival order (and how many had arrived at each work call). In canonical order
    the trainer sees the same offers and work calls for any arrival order and batching: whole
    chunks in traj-id order, each followed by all its work."""
    # Chunks of 4 trajectories (groups of one), the window's last one shorter.
    offers = [f"offer {t}" for t in range(18, 22)], [f"offer {t}" for t in (22, 23)]
    works = [f"work {t}" for t in range(18, 22)], [f"work {t}" for t in (22, 23)]
    expected = offers[0] + works[0] + offers[1] + works[1]
    assert _canonical_log([18, 19, 20, 21, 22, 23], [1] * 6) == expected
    assert _canonical_log([23, 21, 19, 18, 20, 22], [2, 1, 3]) == expected
    assert _canonical_log([20, 18, 19, 23, 22, 21], [6]) == expected


def test_canonical_order_takes_what_arrived_while_it_trained_before_waiting():
    """A trajectory that arrived while the trainer worked (the event set before the loop waited
    again) was left in the inbox and the step never ended: the loop must take it first."""
    import types

    trainer = _Recording()

    async def main():
        loop = StepLoop(trainer, lambda step: 2, canonical_chunk=1)
        event_loop = asyncio.get_running_loop()
        real_work = trainer.work

        def work() -> bool:  # runs on the compute thread; the second trajectory arrives meanwhile
            if trainer.log == ["offer 0"]:
                event_loop.call_soon_threadsafe(loop.add, 0, types.SimpleNamespace(traj_id=1))
            return real_work()

        trainer.work = work
        loop.add(0, types.SimpleNamespace(traj_id=0))
        assert await asyncio.wait_for(loop.run_step(0), timeout=30) == "result"

    asyncio.run(main())
    assert trainer.log == ["offer 0", "work 0", "offer 1", "work 1"]
