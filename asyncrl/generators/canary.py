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
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol, runtime_checkable

from asyncrl.messages import CanaryScores, WeightsPublished


@runtime_checkable
class CanaryScorer(Protocol):
    """Optional plugin method: log pi(ids[i][t] | ids[i][:t]) for t >= 1 of every sequence (plain
    log-softmax, no temperature), under the weights the generator samples with now, per engine."""

    def score_canary(
        self, ids: Sequence[Sequence[int]]
    ) -> list[CanaryScores] | Awaitable[list[CanaryScores]]: ...


class GeneratorCanary:
    """Scores the canary of each loaded version and keeps the scores until its ack is sent."""

    def __init__(self, gen: Any) -> None:
        self.scorer = gen if isinstance(gen, CanaryScorer) else None
        self.scores: dict[int, list[CanaryScores]] = {}  # version -> scores, until acked

    def applied_callback(
        self, msg: WeightsPublished, on_applied: Callable[[int], None]
    ) -> Callable[[int], None]:
        """For a staged plugin: the `on_applied` to offer `msg`'s weights with; it scores the
        canary on the applying thread, then acks (`on_applied`)."""
        if self.scorer is None or msg.canary is None:
            return on_applied
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
