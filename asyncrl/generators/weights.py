"""The generator's weight updates: announcements in, loaded versions and their acks out.

Place in the data flow: the launcher forwards every `WeightsPublished` (`ShardsPublished` or
`BroadcastPublished`) to the generator; the service's `gen-recv` task hands each one to
`WeightUpdates.announce`, its `gen-weights` task runs `WeightUpdates.run` (announcements in order,
each one this generator needs loaded, failed ones retried) and its `gen-acks` task runs
`WeightUpdates.ack_loop` (a `WeightsLoaded` for every version the model now holds). Fetching
(`transport.receiver`: verified shards, or the broadcast group) runs in a worker thread,
concurrently with generation.

How a version reaches the model depends on the generator plugin, and is chosen once at start
(`choose_loading`), never asked again:

- `StagedLoading` (the plugin has `offer_weights`): the complete tensors are offered to the
  generator, which applies them at its next safe point (between decode steps, by
  `weights.inflight`, or between batches: `between_batches`), then acks.
- `PlainLoading` (only `load_weights`; shards only): the feed is held so the running stream drains,
  and `load_weights(version, root)` runs under the model lock, never during generation.
- `GroupLoading` (`receive_broadcast`: the plugin's servers are ranks of the learner's group):
  broadcasts go to the plugin, catch-up shards to the staged or plain loading it wraps.

A version that cannot be loaded (corrupt or missing shard or delta, a broadcast that failed, a
fetch still unfinished at `weights.update_deadline_s`) never reaches the model: the generator
keeps serving the weights it has, logs the reason, counts `gen/weights_load_errors`, and never acks
what it does not hold (a failed broadcast is not retried: the generator left the group and takes
the catch-up shards). It takes the next announcement as soon as one arrives and meanwhile retries
the failed one with backoff (`Retry`; a shared directory may lag); if no version becomes loadable
within `weights.load_retry_timeout_s` it fails with the reason (`WeightsUnavailable`), because
admission waits for its ack and a silent stall would hang the run.

Each loaded version's weight-load canary (`canary.py`) is scored with exactly that version in the
model (the staged plugin on its applying thread, the others right after the load) and its ack
carries the scores; the launcher judges them (docs/weights.md, "Canary").
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Protocol

import torch

from asyncrl.generators.base import GroupWeights, StagedWeights
from asyncrl.generators.canary import GeneratorCanary
from asyncrl.generators.feed import SampleFeed
from asyncrl.messages import BroadcastPublished, ShardsPublished, WeightsLoaded, WeightsPublished
from asyncrl.transport.fence import UpdateFailed
from asyncrl.transport.manifest import WeightsCorruptError
from asyncrl.transport.receiver import WeightsReceiver

if TYPE_CHECKING:
    from asyncrl.config_sections import WeightsConfig

log = logging.getLogger(__name__)

# Retrying a version that failed to load: first wait, doubling up to the cap (timers, not syncs).
RETRY_FIRST_S = 0.5
RETRY_MAX_S = 10.0

OnApplied = Callable[[int], None]


class WeightsUnavailable(RuntimeError):
    """No announced version could be loaded for weights.load_retry_timeout_s."""


class Retry:
    """The newest version that failed to load, since when versions have been failing, and how long
    to wait for a newer announcement before trying it again (doubling while the same one fails)."""

    def __init__(self) -> None:
        self.failing: ShardsPublished | None = None
        self.since_s = 0.0
        self.backoff_s = RETRY_FIRST_S

    def failed(self, msg: ShardsPublished, now_s: float) -> float:
        """`msg` could not be loaded at `now_s`; returns how long loads have been failing."""
        if self.failing is None:
            self.since_s = now_s
        retried = self.failing is not None and self.failing.version == msg.version
        self.backoff_s = min(2 * self.backoff_s, RETRY_MAX_S) if retried else RETRY_FIRST_S
        self.failing = msg
        return now_s - self.since_s

    def loaded(self) -> None:
        self.failing, self.backoff_s = None, RETRY_FIRST_S

    def due(self, fetched_version: int) -> ShardsPublished | None:
        """The failed version to try again now, or None when a newer one was loaded meanwhile."""
        if self.failing is not None and self.failing.version <= fetched_version:
            self.failing = None
        return self.failing


class Loading(Protocol):
    """How one announced version gets into the model: one implementation per kind of plugin."""

    async def load(self, msg: WeightsPublished) -> None:
        """Fetch `msg`'s version and hand it over; raises (WeightsCorruptError, FileNotFoundError,
        UpdateFailed) when it cannot be loaded, leaving the weights being served untouched."""

    async def between_batches(self) -> None:
        """The work loop is between streams: apply what waits for such a point."""


async def fetch_in_thread(
    receiver: WeightsReceiver, msg: WeightsPublished, *, deadline_s: float
) -> dict[str, torch.Tensor]:
    """The receiver's fetch in a thread of its own; shards by the update's deadline. A fetch past
    it is given up: the thread cannot be stopped, so it is a daemon thread (a hung one never holds
    up the process's exit, as one of the loop's executor would) that finishes, if ever, into
    tensors nobody takes."""
    loop = asyncio.get_running_loop()
    fetching = loop.create_future()

    def settle(result=None, exc: BaseException | None = None) -> None:
        if fetching.done():  # given up meanwhile
            return
        if exc is not None:
            fetching.set_exception(exc)
        else:
            fetching.set_result(result)

    def run() -> None:
        try:
            outcome = (receiver.fetch(msg), None)
        except BaseException as exc:  # handed to the awaiting task, which decides
            outcome = (None, exc)
        with contextlib.suppress(RuntimeError):  # the loop is gone: nobody waits any more
            loop.call_soon_threadsafe(settle, *outcome)

    threading.Thread(target=run, name=f"gen-fetch-v{msg.version}", daemon=True).start()
    if isinstance(msg, BroadcastPublished):  # every rank must take part; the group's timeout bounds it
        return await fetching
    try:
        return await asyncio.wait_for(fetching, deadline_s)
    except TimeoutError:
        raise UpdateFailed(
            f"weights version {msg.version}: fetching it took longer than "
            f"weights.update_deadline_s = {deadline_s:g} s; given up"
        ) from None


class StagedLoading:
    """A plugin with `offer_weights`: fetched tensors are offered; it applies them at a safe point
    of its own (and acks through `on_applied`, from the thread that applied them)."""

    def __init__(
        self,
        gen: Any,
        receiver: WeightsReceiver,
        *,
        deadline_s: float,
        wake: asyncio.Event,
        on_applied_threadsafe: OnApplied,
        canary: GeneratorCanary,
    ) -> None:
        self.gen = gen
        self.receiver = receiver
        self.deadline_s = deadline_s
        self.wake = wake
        self.on_applied_threadsafe = on_applied_threadsafe
        self.canary = canary
        self.offered = False  # a version offered since the last apply between batches

    async def load(self, msg: WeightsPublished) -> None:
        state = await fetch_in_thread(self.receiver, msg, deadline_s=self.deadline_s)
        # The canary is scored on the applying thread, with exactly this version in the model.
        self.gen.offer_weights(
            msg.version, state, self.canary.applied_callback(msg, self.on_applied_threadsafe)
        )
        self.offered = True
        self.wake.set()  # an idle work loop applies it now

    async def between_batches(self) -> None:
        if self.offered:  # else nothing to apply (a generator may have applied it mid-batch)
            self.offered = False
            await asyncio.to_thread(self.gen.apply_pending)


class PlainLoading:
    """A plugin with only `load_weights(version, root)`: called with generation stopped (the feed
    held until the running stream drains and gives the model lock up); shards only."""

    def __init__(
        self,
        gen: Any,
        receiver: WeightsReceiver,
        *,
        feed: SampleFeed,
        model_lock: asyncio.Lock,
        on_applied: OnApplied,
        canary: GeneratorCanary,
    ) -> None:
        self.gen = gen
        self.receiver = receiver
        self.feed = feed
        self.model_lock = model_lock
        self.on_applied = on_applied
        self.canary = canary

    async def load(self, msg: WeightsPublished) -> None:
        assert isinstance(msg, ShardsPublished), "a plain generator never joins a broadcast group"
        self.feed.hold()
        try:
            root = msg.root
            if self.receiver.remote is not None:  # fetched over the network first
                fetched = await asyncio.to_thread(self.receiver.remote.fetch, msg.version, lambda m: False)
                root = str(fetched)
            async with self.model_lock:
                self.canary.expect(msg)  # before the servers may sample with it
                await self.gen.load_weights(msg.version, root)
                await self.canary.after_load(msg)
        finally:
            self.feed.release()
        self.on_applied(msg.version)

    async def between_batches(self) -> None:
        return None


class GroupLoading:
    """A plugin whose servers are ranks of the learner's group (`receive_broadcast`): broadcasts go
    to it (no model lock: the servers pause themselves, generators.options.pause_mode), catch-up
    shards to `shards`, the staged or plain loading of the same plugin."""

    def __init__(
        self,
        gen: Any,
        shards: StagedLoading | PlainLoading,
        *,
        on_applied: OnApplied,
        canary: GeneratorCanary,
    ) -> None:
        self.gen = gen
        self.shards = shards
        self.on_applied = on_applied
        self.canary = canary

    async def load(self, msg: WeightsPublished) -> None:
        if isinstance(msg, ShardsPublished):
            await self.shards.load(msg)
            return
        self.canary.expect(msg)
        await self.gen.receive_broadcast(msg)
        await self.canary.after_load(msg)
        self.on_applied(msg.version)

    async def between_batches(self) -> None:
        await self.shards.between_batches()


def choose_loading(
    gen: Any,
    receiver: WeightsReceiver,
    *,
    transport: str,
    generator_kind: str,
    deadline_s: float,
    feed: SampleFeed,
    model_lock: asyncio.Lock,
    wake: asyncio.Event,
    on_applied: OnApplied,
    on_applied_threadsafe: OnApplied,
    canary: GeneratorCanary | None = None,
) -> Loading:
    """The loading for plugin `gen`, once at start; ValueError when weights.transport `transport`
    ("shards" or "broadcast") needs what the plugin lacks."""
    staged = isinstance(gen, StagedWeights)
    group = isinstance(gen, GroupWeights)  # its servers receive, not this process
    if transport == "broadcast" and not (staged or group):
        raise ValueError(
            f"generator {generator_kind!r} has no offer_weights() (nor receive_broadcast()), "
            "which weights.transport=broadcast needs; use weights.transport=shards"
        )
    canary = canary if canary is not None else GeneratorCanary(None)
    shards: StagedLoading | PlainLoading
    if staged:
        shards = StagedLoading(
            gen,
            receiver,
            deadline_s=deadline_s,
            wake=wake,
            on_applied_threadsafe=on_applied_threadsafe,
            canary=canary,
        )
    else:
        shards = PlainLoading(
            gen, receiver, feed=feed, model_lock=model_lock, on_applied=on_applied, canary=canary
        )
    return GroupLoading(gen, shards, on_applied=on_applied, canary=canary) if group else shards


class WeightUpdates:
    """The generator's weight-update state machine: takes announcements in order, skips versions
    superseded before they were loaded, retries failed ones (`Retry`), acks loaded ones. The way a
    version gets into the model is `loading`, chosen here once (`choose_loading`)."""

    def __init__(
        self,
        gen: Any,
        receiver: WeightsReceiver,
        weights: WeightsConfig,
        *,
        generator_kind: str,
        peer_id: str,
        feed: SampleFeed,
        wake: asyncio.Event,
        send: Callable[[WeightsLoaded], Awaitable[None]],
        report: Callable[[], Awaitable[None]],
    ) -> None:
        self.gen = gen
        self.receiver = receiver
        self.peer_id = peer_id
        self.retry_timeout_s = weights.load_retry_timeout_s
        self.send = send
        self.report = report  # sends the generator's metrics (after a failed load)
        self.model_lock = asyncio.Lock()  # a plain plugin's load_weights never overlaps generation
        self.canary = GeneratorCanary(gen)  # each loaded version's canary scores, until acked
        self.wake = wake  # the service's work loop (it sends what the canary's gate releases)
        self.loading = choose_loading(
            gen,
            receiver,
            transport=weights.kind,
            generator_kind=generator_kind,
            deadline_s=weights.update_deadline_s,
            feed=feed,
            model_lock=self.model_lock,
            wake=wake,
            on_applied=self.on_applied,
            on_applied_threadsafe=self.on_applied_threadsafe,
            canary=self.canary,
        )
        self.announcements: deque[WeightsPublished] = deque()
        self.announced = asyncio.Event()
        self.announced_at: dict[int, float] = {}
        self.fetched_version = 0  # newest version handed to the generator
        self.applied: deque[int] = deque()
        self.applied_event = asyncio.Event()
        self.stopping = False
        self.loop: asyncio.AbstractEventLoop | None = None
        self.num_load_errors = 0
        self.last_load_s = 0.0
        self.last_error = ""

    def announce(self, msg: WeightsPublished) -> None:
        """A new announcement from the launcher (the recv task)."""
        self.announcements.append(msg)
        self.announced_at.setdefault(msg.version, time.perf_counter())
        self.announced.set()

    def stop(self) -> None:
        """Shutdown: the run loop ends at its next turn (waking it if it waits)."""
        self.stopping = True
        self.announced.set()

    def next_announcement(self) -> WeightsPublished | None:
        """The next announcement to act on, in order; superseded shard versions are skipped."""
        while self.announcements:
            msg = self.announcements.popleft()
            if not self.receiver.plan(msg):
                continue
            if self.receiver.must_fetch(msg):
                return msg
            newer = any(m.version > msg.version and type(m) is type(msg) for m in self.announcements)
            if msg.version > self.fetched_version and not newer:
                return msg
        return None

    async def _wait(self, retry: Retry) -> ShardsPublished | None:
        """Nothing to act on: wait for an announcement; with a failed version, at most its backoff,
        then return it to be tried again (None: look at the announcements again)."""
        self.announced.clear()
        if self.announcements:
            return None
        if retry.failing is None:
            await self.announced.wait()
            return None
        try:  # a newer announcement ends the wait early; otherwise retry the failed one
            await asyncio.wait_for(self.announced.wait(), retry.backoff_s)
            return None
        except TimeoutError:
            return retry.due(self.fetched_version)

    async def run(self) -> None:
        """The `gen-weights` task: until shutdown, load what is announced, retry what failed."""
        self.loop = asyncio.get_running_loop()
        retry = Retry()
        while not self.stopping:
            msg = self.next_announcement()
            if msg is None:
                msg = await self._wait(retry)
                if msg is None:
                    continue
            if await self.load(msg):
                retry.loaded()
                continue
            if isinstance(msg, BroadcastPublished):  # never retried: its catch-up shards follow
                continue
            waited_s = retry.failed(msg, time.perf_counter())
            if waited_s > self.retry_timeout_s:
                raise WeightsUnavailable(
                    f"{self.peer_id} could not load any weights version for {waited_s:.0f} s "
                    f"(weights.load_retry_timeout_s = {self.retry_timeout_s:g}); last error: {self.last_error}"
                )

    async def load(self, msg: WeightsPublished) -> bool:
        """Fetch and hand over one version; False (old weights kept) when it cannot be loaded."""
        try:
            await self.loading.load(msg)
        except (WeightsCorruptError, FileNotFoundError, UpdateFailed) as exc:
            if isinstance(msg, BroadcastPublished) and not isinstance(exc, UpdateFailed):
                raise
            self.num_load_errors += 1
            self.last_error = f"{type(exc).__name__}: {exc}"
            self.canary.gate.forget(msg.version)  # it will not be judged: what waited on it may go
            self.wake.set()
            log.error(
                "%s: weights version %d could not be loaded, still serving version %d: %s",
                self.peer_id,
                msg.version,
                self.gen.version,
                self.last_error,
            )
            await self.report()
            return False
        self.fetched_version = msg.version
        return True

    async def between_batches(self) -> None:
        await self.loading.between_batches()

    def on_applied_threadsafe(self, version: int) -> None:
        """Called by the generator on the thread that applied the weights."""
        assert self.loop is not None
        self.loop.call_soon_threadsafe(self.on_applied, version)

    def on_applied(self, version: int) -> None:
        self.applied.append(version)
        self.applied_event.set()

    async def ack_loop(self) -> None:
        """The `gen-acks` task: a WeightsLoaded for every version applied, in order."""
        while True:
            await self.applied_event.wait()
            self.applied_event.clear()
            while self.applied:
                version = self.applied.popleft()
                self.last_load_s = time.perf_counter() - self.announced_at.pop(version, time.perf_counter())
                for v in [v for v in self.announced_at if v < version]:
                    del self.announced_at[v]
                await self.send(
                    WeightsLoaded(
                        generator_id=self.peer_id,
                        version=version,
                        load_s=self.last_load_s,
                        canary=self.canary.take(version),
                    )
                )
