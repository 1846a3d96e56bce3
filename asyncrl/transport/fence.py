"""Version fences and deadlines of weight updates (pure bookkeeping, no clocks of its own).

Place in the data flow: every published version is a fence: a generator either holds all of it
(verified, then acked with `WeightsLoaded(version)`) or keeps serving the version it had. The learner's
publisher records each publish and each ack here (`AckWatch`) and, `weights.update_deadline_s`
after a publish, asks which generators still owe an ack, so it never waits past the deadline
without saying for whom (the launcher's admission is what actually waits for acks). The generator
side of the deadline (giving up a fetch that takes too long, keeping the old version) is in the
generator service.

Invariant: a generator's acked version only grows here (a late ack of an older version never
clears a newer one), and a version is overdue for a generator exactly when the generator is known
and has acked neither it nor anything newer.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

__all__ = ["AckWatch", "Overdue", "UpdateFailed"]


class UpdateFailed(RuntimeError):
    """A weight update that did not complete on a generator (a broadcast that lost its sender or
    its layout check, a fetch past its deadline): the generator keeps the version it serves."""


class Overdue(NamedTuple):
    version: int
    generator_ids: tuple[str, ...]  # sorted
    waited_s: float


class AckWatch:
    """Which generators have acknowledged which published versions, and since when each version waits."""

    def __init__(self, generator_ids: Iterable[str]) -> None:
        self._acked: dict[str, int] = dict.fromkeys(generator_ids, -1)
        self._published_at: dict[int, float] = {}  # versions some generator still owes, -> publish time
        self._reported: set[int] = set()

    def published(self, version: int, now_s: float) -> None:
        self._published_at[version] = now_s

    def acked(self, generator_id: str, version: int) -> float | None:
        """Record an ack; returns `version`'s publish time when its deadline was already reported
        (a late ack worth saying so), else None."""
        if version > self._acked.get(generator_id, -1):
            self._acked[generator_id] = version
        late_since = self._published_at.get(version) if version in self._reported else None
        for v in [v for v in self._published_at if not self.waiting_for(v)]:
            del self._published_at[v]
            self._reported.discard(v)
        return late_since

    def waiting_for(self, version: int) -> tuple[str, ...]:
        """Generators that have acked neither `version` nor a newer one."""
        return tuple(sorted(g for g, acked in self._acked.items() if acked < version))

    def overdue(self, version: int, now_s: float) -> Overdue | None:
        """`version`'s missing acks at its deadline (then marked reported), or None if none are."""
        since = self._published_at.get(version)
        missing = self.waiting_for(version)
        if since is None or not missing:
            return None
        self._reported.add(version)
        return Overdue(version, missing, now_s - since)
