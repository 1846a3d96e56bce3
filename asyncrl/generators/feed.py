"""The generator service's pending work, as a backend takes it: a sample at a time, when it has room.

Place in the data flow: the service's control loop puts the PromptTasks the launcher sends
(`put`) and the samples its scoring wants drawn again (`redraw`); a streaming backend
(`generate_stream`, `base.py`) takes `Draw`s whenever slots free up: between decode steps on the
torch generator's sampling thread, or on the event loop for SGLang. Thread-safe: one lock guards
the queues; `changed` (an asyncio.Event, set on the event loop) wakes an async taker.

Order: redraws first (their groups are otherwise done and wait for them), then tasks in the order
they came, each task's samples 0..n-1 in order; a task's samples may be split between takes.
Every sample is handed out once (a redraw is a new draw the service asked for). `hold()` stops
handing out until `release()` (a weights load that waits for the backend to be idle); `close()`
stops it for good (shutdown).

`concurrent_stream` is the stream of a backend whose samples are coroutines (SGLang requests,
agentic episodes): up to `limit` in flight, each rollout yielded as soon as its own is done.
`batch_stream` serves a backend that only has `generate(tasks)` through the same interface:
batches of up to `max_groups` whole groups, each batch's rollouts yielded when it returns.
"""

from __future__ import annotations

import asyncio
import sys
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Coroutine, Iterable
from typing import TYPE_CHECKING, Any, NamedTuple

from asyncrl.messages import PromptTask, SamplingParams

if TYPE_CHECKING:
    from asyncrl.generators.base import Generator, Rollout


class Draw(NamedTuple):
    """One sample to draw: `task.attempt` is the attempt it draws with (its seed)."""

    task: PromptTask
    sample_index: int


class SampleFeed:
    """Pending samples, handed out in order; see the module docstring."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._tasks: deque[PromptTask] = deque()
        self._next_index = 0  # the next sample of self._tasks[0]
        self._redraws: deque[Draw] = deque()
        self._held = 0
        self.closed = False
        self.changed = asyncio.Event()  # set (on the event loop) whenever work may be takeable
        self.started_s: dict[int, float] = {}  # task_id -> perf_counter when its first sample was taken

    # ------------------------------------------------------------------ the service's side
    def put(self, tasks: Iterable[PromptTask]) -> None:
        with self._lock:
            self._tasks.extend(tasks)
        self.changed.set()

    def redraw(self, draws: Iterable[Draw]) -> None:
        with self._lock:
            self._redraws.extend(draws)
        self.changed.set()

    def hold(self) -> None:
        with self._lock:
            self._held += 1

    def release(self) -> None:
        with self._lock:
            self._held -= 1
        self.changed.set()

    def close(self) -> None:
        self.closed = True
        self.changed.set()

    def has_work(self) -> bool:
        with self._lock:
            return not self.closed and bool(self._tasks or self._redraws)

    def queued(self) -> set[tuple[int, int]]:
        """(task_id, sample_index) of every sample not handed out yet."""
        with self._lock:
            out = {(d.task.task_id, d.sample_index) for d in self._redraws}
            for i, task in enumerate(self._tasks):
                first = self._next_index if i == 0 else 0
                out.update((task.task_id, k) for k in range(first, task.num_samples))
            return out

    # ------------------------------------------------------------------ the backend's side
    def take(
        self, max_samples: int, *, max_groups: int | None = None, like: SamplingParams | None = None
    ) -> list[Draw]:
        """Up to `max_samples` draws from at most `max_groups` groups (None: any number), all with
        sampling params `like` when given (a batch samples with one set): stops at the first that
        differs. Nothing while held or closed."""
        out: list[Draw] = []
        groups: set[int] = set()

        def fits(task: PromptTask) -> bool:
            if like is not None and task.sampling != like:
                return False
            return max_groups is None or task.task_id in groups or len(groups) < max_groups

        with self._lock:
            if self._held or self.closed:
                return []
            now = time.perf_counter()
            while len(out) < max_samples and self._redraws and fits(self._redraws[0].task):
                out.append(self._redraws.popleft())
                groups.add(out[-1].task.task_id)
            while len(out) < max_samples and self._tasks and fits(self._tasks[0]):
                task = self._tasks[0]
                groups.add(task.task_id)
                self.started_s.setdefault(task.task_id, now)
                end = min(task.num_samples, self._next_index + max_samples - len(out))
                out += [Draw(task, k) for k in range(self._next_index, end)]
                self._next_index = end
                if end == task.num_samples:
                    self._tasks.popleft()
                    self._next_index = 0
        return out


async def batch_stream(
    gen: Generator, feed: SampleFeed, *, max_groups: int, generator_id: str = ""
) -> AsyncIterator[list[Rollout]]:
    """`generate(tasks)` on batches of up to `max_groups` whole groups from `feed`, as a stream.
    A redraw is served by drawing its group again (with its attempt) and keeping that sample;
    a group's draws with different attempts go to separate calls (a call sees each task once)."""
    while draws := feed.take(sys.maxsize, max_groups=max_groups):
        calls: list[dict[int, PromptTask]] = []  # each call: task_id -> the task (one attempt)
        for d in draws:
            call = next(
                (c for c in calls if c.get(d.task.task_id, d.task) == d.task),
                None,
            )
            if call is None:
                calls.append(call := {})
            call[d.task.task_id] = d.task
        wanted = {(d.task.task_id, d.task.attempt, d.sample_index) for d in draws}
        for call in calls:
            rollouts = await gen.generate(list(call.values()))
            by_task: dict[int, list[Rollout]] = {tid: [] for tid in call}
            for r in rollouts:
                if r.task_id not in by_task:
                    raise ValueError(
                        f"generator returned a rollout for task {r.task_id}, which was not in the batch"
                    )
                by_task[r.task_id].append(r)
            for tid, task in call.items():
                got = sorted(r.sample_index for r in by_task[tid])
                if got != list(range(task.num_samples)):
                    raise ValueError(
                        f"generator {generator_id} returned samples {got} for task {tid}; "
                        f"expected 0..{task.num_samples - 1} exactly once"
                    )
            yield [r for r in rollouts if (r.task_id, call[r.task_id].attempt, r.sample_index) in wanted]


async def concurrent_stream(
    feed: SampleFeed,
    limit: int,
    run: Callable[[Draw], Coroutine[Any, Any, Rollout]],
    *,
    label: str = "sample",
) -> AsyncIterator[list[Rollout]]:
    """Up to `limit` of `feed`'s draws in flight as tasks running `run(draw)`; each Rollout
    yielded as soon as it is done (those done together in one list). Ends when nothing is in
    flight and the feed gives nothing; one that raises ends the stream with its error, and the
    others in flight are cancelled."""
    running: set[asyncio.Task[Rollout]] = set()
    try:
        while True:
            feed.changed.clear()  # before taking: work put after this wakes the wait below
            for draw in feed.take(limit - len(running)):
                name = f"{label}-t{draw.task.task_id}-s{draw.sample_index}"
                running.add(asyncio.create_task(run(draw), name=name))
            if not running:
                return
            changed = asyncio.create_task(feed.changed.wait())
            done, _ = await asyncio.wait({*running, changed}, return_when=asyncio.FIRST_COMPLETED)
            changed.cancel()
            finished = [t for t in running if t in done]
            running.difference_update(finished)
            if finished:
                yield [t.result() for t in finished]
    finally:
        for t in running:
            t.cancel()
