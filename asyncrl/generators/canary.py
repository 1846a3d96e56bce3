"""The generator's half of the weight-load canary: score the canary with each version it loads.

Place in the data flow: an announcement (`WeightsPublished.canary`) carries the canary's token
sequences and the learner's log-probs of them; once the generator's model holds the version, it
scores the same tokens with exactly those weights and the ack (`WeightsLoaded.canary`) carries the
scores; the launcher compares (`scheduler/canary.py`, docs/weights.md "Canary").

"Exactly those weights" decides where scoring happens, per way of loading (`weights.py`):
- staged (`offer_weights`: the torch generator): in the callback the generator calls on the thread
  that applied the version, before its next decode step, so no newer version can be in the model;
- plain (`load_weights`) and group (`receive_broadcast`: SGLang servers): right after the load
  returns, in the task that loads versions one at a time, before it takes the next.

A plugin takes part by having `score_canary(ids)` (`CanaryScorer`): one `CanaryScores` per engine
it samples with (the torch generator: its model; the SGLang generator: every server in service).
Staged plugins must score synchronously (they are called on their applying thread); the others may
return an awaitable. A plugin without it acks without scores, and the launcher counts the version
as unchecked for it.

Nothing sampled with a version goes out before its canary is judged (`SendGate`): from the moment
a version that will be scored can reach the model, rollouts carrying a token of it are held, and
so is everything after them (order kept); the launcher's verdict releases them (an accepted ack
comes back as `WeightsLoaded`), or the generator is restarted and they are never sent: their
tasks are re-queued and drawn again, so the learner never trains a sample of a refused version.
"""

from __future__ import annotations

import inspect
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol, runtime_checkable

from asyncrl.generators.base import Rollout
from asyncrl.messages import CanaryScores, WeightsPublished


@runtime_checkable
class CanaryScorer(Protocol):
    """Optional plugin method: log pi(ids[i][t] | ids[i][:t]) for t >= 1 of every sequence (plain
    log-softmax, no temperature), under the weights the generator samples with now, per engine."""

    def score_canary(
        self, ids: Sequence[Sequence[int]]
    ) -> list[CanaryScores] | Awaitable[list[CanaryScores]]: ...


class SendGate:
    """What a generator sends waits while it carries a token of a version whose canary verdict is
    pending. Pure: the service asks `holds`, `hold`s, and sends what `releasable` hands back after
    a verdict (`accept`) or a failed load (`forget`)."""

    def __init__(self) -> None:
        self.pending: set[int] = set()  # versions to be judged before their tokens go out
        self.held: deque[list[Rollout]] = deque()  # batches of rollouts, in arrival order

    def expect(self, version: int) -> None:
        """`version` may reach the model now, and will be judged."""
        self.pending.add(version)

    def holds(self, rollouts: Sequence[Rollout]) -> bool:
        """Whether `rollouts` must wait: something waits already (order is kept), or one carries a
        token of a pending version."""
        if self.held:
            return True
        return bool(self.pending) and any(v in self.pending for r in rollouts for v in r.token_versions)

    def hold(self, rollouts: list[Rollout]) -> None:
        self.held.append(rollouts)

    def accept(self, version: int) -> None:
        """`version` was accepted: it and older versions are no longer pending."""
        self.pending = {v for v in self.pending if v > version}

    def forget(self, version: int) -> None:
        """`version` failed to load: it will not be judged."""
        self.pending.discard(version)

    def releasable(self) -> list[list[Rollout]]:
        """The held batches free to go now (none of their tokens pending), in order; taken out."""
        out = []
        while self.held and not any(v in self.pending for r in self.held[0] for v in r.token_versions):
            out.append(self.held.popleft())
        return out

    def held_samples(self) -> set[tuple[int, int]]:
        """(task_id, sample_index) of every rollout held."""
        return {(r.task_id, r.sample_index) for batch in self.held for r in batch}


class GeneratorCanary:
    """Scores the canary of each loaded version and keeps the scores until its ack is sent; its
    `gate` holds what was sampled with a version until the launcher's verdict."""

    def __init__(self, gen: Any) -> None:
        self.scorer = gen if isinstance(gen, CanaryScorer) else None
        self.scores: dict[int, list[CanaryScores]] = {}  # version -> scores, until acked
        self.gate = SendGate()

    def expect(self, msg: WeightsPublished) -> None:
        """`msg`'s version is about to be loaded: if it will be scored, its tokens wait for the verdict."""
        if self.scorer is not None and msg.canary is not None:
            self.gate.expect(msg.version)

    def applied_callback(
        self, msg: WeightsPublished, on_applied: Callable[[int], None]
    ) -> Callable[[int], None]:
        """For a staged plugin: the `on_applied` to offer `msg`'s weights with; it scores the
        canary on the applying thread, then acks (`on_applied`)."""
        if self.scorer is None or msg.canary is None:
            return on_applied
        self.gate.expect(msg.version)  # before the offer: no token of it exists yet
        ids = msg.canary.ids

        def scored_then_applied(version: int) -> None:
            result = self.scorer.score_canary(ids)
            if inspect.isawaitable(result):
                if inspect.iscoroutine(result):
                    result.close()  # never awaited: no "never awaited" warning on top of the error
                raise TypeError(
                    f"{type(self.scorer).__name__}.score_canary returned an awaitable; a plugin with "
                    "offer_weights is called on its applying thread and must score synchronously"
                )
            self.scores[version] = list(result)
            on_applied(version)

        return scored_then_applied

    async def after_load(self, msg: WeightsPublished) -> None:
        """For a plain or group load: score `msg`'s canary now that the load returned."""
        if self.scorer is None or msg.canary is None:
            return
        result = self.scorer.score_canary(msg.canary.ids)
        if inspect.isawaitable(result):
            result = await result
        self.scores[msg.version] = list(result)

    def take(self, version: int) -> list[CanaryScores]:
        """The scores of `version` for its ack (and of no older version any more)."""
        found = self.scores.pop(version, [])
        for old in [v for v in list(self.scores) if v < version]:  # list(): one atomic copy
            del self.scores[old]
        return found
