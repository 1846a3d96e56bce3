"""Generator supervision state (pure): which process serves each generator slot, restarts, and
which generators admission and dispatch may count on.

Place in the data flow: the launcher (`scheduler/service.py`) owns the processes and sockets; it
reports here what it sees (spawn, Hello, WeightsLoaded, death) and asks which generators may get
PromptTasks and what version the slowest of them holds (`min_loaded_version`, for admission).

Slots and incarnations. The configured generators are slots `gen-0 .. gen-{N-1}`. The first
process of a slot has the slot's name as its peer id; restart n runs under the new peer id
`{slot}-r{n}`. A new ZeroMQ identity means the launcher's ROUTER can never mistake the
replacement for the dead process's connection, and anything the dead process sent that is still
queued (a late TaskDone, say) comes from a retired peer and is dropped, so a task it was running
is re-queued exactly once and finished by exactly one process. The learner only ever hears slot
names (the launcher forwards WeightsLoaded under the slot), so its weight retention, which pins
versions per generator, carries over to the replacement.

Life of an incarnation:

    starting --Hello--> catching_up --loaded >= target--> serving --exit/hang--> dead
        |                    |                                                    ^
        +--------------------+------------------exit/hang-------------------------+

`target` is the newest version published when the incarnation said Hello (0 if none: then it is
serving at once, with the initial weights). Only serving incarnations get tasks and count for
admission: a dead generator cannot hold admission back, and a replacement still on old weights
cannot generate tokens older than the staleness bound allows.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Phase(enum.StrEnum):
    STARTING = "starting"
    CATCHING_UP = "catching_up"
    SERVING = "serving"
    DEAD = "dead"


class RestartBudgetExceeded(RuntimeError):
    """A slot failed once more than `max_restarts` allows."""


@dataclass
class Incarnation:
    peer_id: str
    slot: str
    index: int  # the slot's position (seeds the generator)
    restart: int  # 0 for the first process of the slot
    phase: Phase = Phase.STARTING
    loaded_version: int = 0
    target_version: int = 0


def incarnation_peer_id(slot: str, restart: int) -> str:
    return slot if restart == 0 else f"{slot}-r{restart}"


class GeneratorPool:
    """Slots, their current incarnations, and restart counts. No processes, no clocks."""

    def __init__(self, slots: list[str], *, max_restarts: int) -> None:
        if max_restarts < 0:
            raise ValueError(f"generators.max_restarts must be >= 0, got {max_restarts}")
        if len(set(slots)) != len(slots) or not slots:
            raise ValueError(f"generator slots must be distinct and non-empty, got {slots}")
        self.slots = list(slots)
        self.max_restarts = max_restarts
        self.restarts: dict[str, int] = {s: 0 for s in slots}
        self.current: dict[str, Incarnation] = {}  # slot -> its newest incarnation
        self._by_peer: dict[str, Incarnation] = {}  # every incarnation ever, dead ones included

    # ------------------------------------------------------------------ lifecycle
    def start(self, slot: str) -> Incarnation:
        """The first incarnation of `slot`."""
        if slot not in self.restarts:
            raise ValueError(f"unknown generator slot {slot!r} (slots: {', '.join(self.slots)})")
        if slot in self.current:
            raise ValueError(f"generator slot {slot!r} is already started; use restart()")
        return self._new(slot, 0)

    def restart(self, slot: str) -> Incarnation:
        """A new incarnation for `slot`, whose current one must be dead; counts one restart.

        Raises RestartBudgetExceeded when the slot has used all `max_restarts`.
        """
        old = self.current[slot]
        if old.phase != Phase.DEAD:
            raise ValueError(f"generator {old.peer_id} is {old.phase}; only a dead one is restarted")
        if self.restarts[slot] >= self.max_restarts:
            raise RestartBudgetExceeded(
                f"restarted {self.restarts[slot]} times already (generators.max_restarts = {self.max_restarts})"
            )
        self.restarts[slot] += 1
        return self._new(slot, self.restarts[slot])

    def _new(self, slot: str, restart: int) -> Incarnation:
        inc = Incarnation(
            peer_id=incarnation_peer_id(slot, restart),
            slot=slot,
            index=self.slots.index(slot),
            restart=restart,
        )
        self.current[slot] = inc
        self._by_peer[inc.peer_id] = inc
        return inc

    def on_hello(self, peer_id: str, *, latest_version: int) -> Incarnation:
        """The incarnation said Hello; it must load `latest_version` before it serves."""
        inc = self._live(peer_id)
        if inc.phase != Phase.STARTING:
            raise ValueError(f"generator {peer_id} said Hello twice")
        inc.target_version = latest_version
        inc.phase = Phase.CATCHING_UP
        self._maybe_serve(inc)
        return inc

    def on_loaded(self, peer_id: str, version: int) -> Incarnation:
        inc = self._live(peer_id)
        if version < inc.loaded_version:
            raise ValueError(
                f"generator {peer_id} reports version {version} after {inc.loaded_version}; versions only grow"
            )
        inc.loaded_version = version
        self._maybe_serve(inc)
        return inc

    def died(self, peer_id: str) -> Incarnation:
        inc = self._live(peer_id)
        inc.phase = Phase.DEAD
        return inc

    def _maybe_serve(self, inc: Incarnation) -> None:
        if inc.phase == Phase.CATCHING_UP and inc.loaded_version >= inc.target_version:
            inc.phase = Phase.SERVING

    def _live(self, peer_id: str) -> Incarnation:
        inc = self._by_peer.get(peer_id)
        if inc is None or self.current.get(inc.slot) is not inc or inc.phase == Phase.DEAD:
            raise ValueError(f"generator {peer_id!r} is not a live generator")
        return inc

    # ------------------------------------------------------------------ queries
    def get(self, peer_id: str) -> Incarnation | None:
        """The incarnation with this peer id (dead or alive), or None for a stranger."""
        return self._by_peer.get(peer_id)

    def is_live(self, peer_id: str) -> bool:
        inc = self._by_peer.get(peer_id)
        return inc is not None and self.current.get(inc.slot) is inc and inc.phase != Phase.DEAD

    def is_retired(self, peer_id: str) -> bool:
        """An earlier incarnation (dead and replaced, or dead): its messages are stale."""
        return peer_id in self._by_peer and not self.is_live(peer_id)

    def live(self) -> list[Incarnation]:
        return [inc for inc in self.current.values() if inc.phase != Phase.DEAD]

    def said_hello(self) -> list[Incarnation]:
        """Live incarnations that said Hello (they can be sent weights)."""
        return [inc for inc in self.live() if inc.phase != Phase.STARTING]

    def serving(self) -> list[Incarnation]:
        return [inc for inc in self.current.values() if inc.phase == Phase.SERVING]

    def all_serving(self) -> bool:
        return len(self.serving()) == len(self.slots)

    def min_loaded_version(self) -> int | None:
        """The oldest version a serving generator holds; None when none serves (admit nothing)."""
        serving = self.serving()
        return min(inc.loaded_version for inc in serving) if serving else None

    @property
    def num_restarts(self) -> int:
        return sum(self.restarts.values())
