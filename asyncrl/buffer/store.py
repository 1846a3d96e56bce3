"""The trajectory buffer as a pure data structure (learner side, no sockets, no clocks).

Data flow: generators -> Trajectory -> learner `service.py` wraps each one in a `BufferItem` and
`put`s it here; the learner's step loop `sample`s whole groups; `update_version` is called after
every optimizer step. Freshness is computed elsewhere (`asyncrl.staleness`) and only read here;
`freshness_from_staleness` is the fallback score when log-prob drift is unknown.

Life of a group:

  pending     members still arriving (`put` returns True when the last one arrives)
  ready       complete and within every bound: `sample` may hand it out
  withheld    complete but violating a bound, with action="withhold"
  handed out  left through `sample` (at its last use, if replayed)
  evicted     dropped and counted by reason: a bound with action="drop", "abandoned" or
              "degenerate" (`discard_pending`), or "reclaimed" (withheld data dropped to make room)

  pending --complete--> ready --sample--> handed out
     |         |          ^ |  +--sample, replays left: freshness *= replay_decay, re-filed
     |         |          | |     like a newly completed group
     |         | violated | | bound crossed (update_version, set_bounds tightened)
     |         v  loosened| v
     |       withheld / evicted (by action)      withheld --memory full--> evicted
     +--discard_pending--> evicted

A bound is violated when staleness = learner_version - min_version > max_staleness, when the
group's freshness (the minimum over its members) is below `freshness_floor`, or, for the
`windowed` order, when the group's admission step fell out of the window. With
`action="downweight"` nothing is withheld or dropped: a violating group is handed out with
`weight=downweight` instead of 1.

Every item put is, at any time, exactly one of: in the buffer (pending, ready or withheld),
handed out for the last time, or evicted. Every operation is O(log n) amortised (lazy heaps);
`stats()` is O(1).

Why one module past 500 lines: `Buffer` is one state machine (the diagram above) whose invariant,
every item in exactly one state, is kept by methods that each move items between the same few
heaps and counters. Split across modules, each transition would have to reach into the others'
internals; the pieces that stand alone already live apart (`heap.py`, `types.py`).
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from typing import Any, Generic, Literal

from asyncrl.buffer.heap import LazyHeap
from asyncrl.buffer.types import (
    ACTIONS,
    BOUND_REASONS,
    EVICTION_REASONS,
    MIN_FRESHNESS,
    ORDERS,
    UNCHANGED,
    Action,
    BufferEvent,
    BufferFull,
    BufferItem,
    BufferStats,
    GroupBatch,
    Order,
    P,
    freshness_from_staleness,
)

__all__ = [
    "ACTIONS",
    "BOUND_REASONS",
    "EVICTION_REASONS",
    "MIN_FRESHNESS",
    "ORDERS",
    "UNCHANGED",
    "Buffer",
    "BufferEvent",
    "BufferFull",
    "BufferItem",
    "BufferStats",
    "GroupBatch",
    "freshness_from_staleness",
]


class _Group:
    __slots__ = (
        "group_id",
        "num_samples",
        "step",
        "items",
        "num_tokens",
        "min_version",
        "freshness",
        "where",
        "reason",
        "reuse",
        "ready_seq",
    )

    def __init__(self, item: BufferItem[Any]) -> None:
        self.group_id = item.group_id
        self.num_samples = item.num_samples
        self.step = item.step
        self.items: list[BufferItem[Any]] = []
        self.num_tokens = 0
        self.min_version = item.min_version
        self.freshness = item.freshness
        # "replaying": handed out, a replay left, re-filed at the next update_version (sample with
        # defer_replays=True)
        self.where: Literal["pending", "ready", "withheld", "replaying"] = "pending"
        self.reason: str | None = None  # why withheld
        self.reuse = 0
        self.ready_seq = -1  # completion order; FIFO and tie-breaking key


class Buffer(Generic[P]):
    """Version-tagged trajectory store handing out whole groups (see the module docstring).

    order: "fifo" (completion order), "freshest" (group freshness, then completion order) or
      "windowed" (only groups with learner_version - window <= step <= learner_version, oldest
      step first; older groups violate the "window" bound, newer ones wait).
    max_staleness: None for no staleness bound. freshness_floor: 0.0 for none.
    action: what happens to a group violating a bound ("withhold", "downweight" or "drop").
    max_replays: extra uses of a group after the first; each multiplies freshness by replay_decay.
    record_events: keep a log of what happened to each group (`drain_events`), for a caller
      that reports it (the learner's pool mode tells the launcher which groups left the pool).
    max_items / max_tokens: memory bound (None = unbounded). Withheld groups are dropped oldest
      first (reason "reclaimed") before a put is refused; pending groups are never reclaimed, so
      size the bound above the admission window (groups admitted ahead x num_samples).
    """

    def __init__(
        self,
        *,
        order: Order = "fifo",
        window: int = 0,
        max_staleness: int | None = None,
        freshness_floor: float = 0.0,
        action: Action = "withhold",
        downweight: float = 0.5,
        max_replays: int = 0,
        replay_decay: float = 1.0,
        max_items: int | None = None,
        max_tokens: int | None = None,
        learner_version: int = 0,
        record_events: bool = False,
    ) -> None:
        if order not in ORDERS:
            raise ValueError(f"order must be one of {ORDERS}, got {order!r}")
        if action not in ACTIONS:
            raise ValueError(f"action must be one of {ACTIONS}, got {action!r}")
        if not 0.0 < downweight < 1.0:
            raise ValueError(f"downweight must be in (0, 1), got {downweight}")
        if max_replays < 0:
            raise ValueError(f"max_replays must be >= 0, got {max_replays}")
        if not 0.0 < replay_decay <= 1.0:
            raise ValueError(f"replay_decay must be in (0, 1], got {replay_decay}")
        for name, bound in (("max_items", max_items), ("max_tokens", max_tokens)):
            if bound is not None and bound < 1:
                raise ValueError(f"{name} must be >= 1 or None, got {bound}")
        self._order = order
        self._action = action
        self._downweight = downweight
        self._max_replays = max_replays
        self._replay_decay = replay_decay
        self._max_items = max_items
        self._max_tokens = max_tokens
        self._version = learner_version
        self._max_staleness: int | None = None
        self._freshness_floor = 0.0
        self._window = 0
        self._check_bounds(max_staleness, freshness_floor, window)
        self._max_staleness, self._freshness_floor, self._window = max_staleness, freshness_floor, window

        self._groups: dict[int, _Group] = {}
        self._traj_ids: set[int] = set()
        self._next_seq = 0
        # Sampling order over ready groups.
        self._policy = LazyHeap()
        # Ready groups by how close they are to violating a bound (smallest first).
        self._by_version = LazyHeap()  # min_version
        self._by_freshness = LazyHeap()  # freshness
        # Withheld groups by how close they are to being released (closest first), per reason.
        self._withheld_heaps = {reason: LazyHeap() for reason in BOUND_REASONS}
        self._withheld_order: OrderedDict[int, None] = OrderedDict()  # reclaim oldest first

        self._size = 0
        self._num_tokens = 0
        self._num_pending = 0
        self._num_items_ready = 0
        self._num_withheld = 0
        self._num_tokens_withheld = 0
        self._withheld_by_reason = dict.fromkeys(BOUND_REASONS, 0)
        self._evicted_by_reason = dict.fromkeys(EVICTION_REASONS, 0)
        self._downweighted_by_reason = dict.fromkeys(BOUND_REASONS, 0)
        self._replays = 0
        self._num_put = 0
        self._num_handed_out = 0
        self._num_released = 0
        self._deferred: list[_Group] = []  # replays held back until the next update_version
        self._record_events = record_events
        self._events: list[BufferEvent] = []

    # ----------------------------------------------------------------------------- queries

    def __len__(self) -> int:
        return self._size

    @property
    def learner_version(self) -> int:
        return self._version

    def stats(self) -> BufferStats:
        return BufferStats(
            size=self._size,
            num_tokens=self._num_tokens,
            num_pending=self._num_pending,
            num_groups_ready=len(self._policy),
            num_items_ready=self._num_items_ready,
            num_groups_withheld=len(self._withheld_order),
            withheld=self._num_withheld,
            withheld_by_reason=dict(self._withheld_by_reason),
            evicted_by_reason=dict(self._evicted_by_reason),
            downweighted_by_reason=dict(self._downweighted_by_reason),
            replays=self._replays,
            num_put=self._num_put,
            num_handed_out=self._num_handed_out,
            num_released=self._num_released,
            learner_version=self._version,
        )

    # ----------------------------------------------------------------------------- commands

    def put(self, item: BufferItem[P], *, reuse: int = 0) -> bool:
        """Store one item; returns True when it completed its group.

        `reuse` (restoring `contents()` on resume): uses the group already had, given with its
        first item.

        Raises BufferFull when the memory bound leaves no room (after reclaiming withheld groups)
        and ValueError for a malformed item, a duplicate traj_id, or a group that disagrees with
        its earlier members or is already complete.
        """
        if not 0.0 < item.freshness <= 1.0:
            raise ValueError(f"traj {item.traj_id}: freshness must be in (0, 1], got {item.freshness}")
        if item.num_tokens < 0 or item.num_samples < 1:
            raise ValueError(
                f"traj {item.traj_id}: need num_tokens >= 0 and num_samples >= 1, "
                f"got {item.num_tokens} and {item.num_samples}"
            )
        if self._max_tokens is not None and item.num_tokens > self._max_tokens:
            raise ValueError(
                f"traj {item.traj_id}: {item.num_tokens} tokens can never fit max_tokens={self._max_tokens}"
            )
        if item.traj_id in self._traj_ids:
            raise ValueError(f"traj {item.traj_id} is already in the buffer")
        group = self._groups.get(item.group_id)
        if group is not None:
            if group.where != "pending":
                raise ValueError(
                    f"traj {item.traj_id}: group {item.group_id} is already complete ({group.where})"
                )
            if (group.num_samples, group.step) != (item.num_samples, item.step):
                raise ValueError(
                    f"traj {item.traj_id}: (num_samples, step)=({item.num_samples}, {item.step}) disagrees with "
                    f"group {item.group_id}'s ({group.num_samples}, {group.step})"
                )
        if not self._fits(item.num_tokens, reclaimable=False):
            if not self._fits(item.num_tokens, reclaimable=True):
                raise BufferFull(
                    f"buffer full: {self._size}/{self._max_items} items, {self._num_tokens}/{self._max_tokens} "
                    f"tokens, {self._num_pending} pending; cannot take traj {item.traj_id} ({item.num_tokens} tokens)"
                )
            self._reclaim(item.num_tokens)

        if group is None:
            if not 0 <= reuse <= self._max_replays:
                raise ValueError(
                    f"traj {item.traj_id}: reuse {reuse} not in [0, max_replays={self._max_replays}]"
                )
            group = self._groups[item.group_id] = _Group(item)
            group.reuse = reuse
        group.items.append(item)
        group.num_tokens += item.num_tokens
        group.min_version = min(group.min_version, item.min_version)
        group.freshness = min(group.freshness, item.freshness)
        self._traj_ids.add(item.traj_id)
        self._size += 1
        self._num_tokens += item.num_tokens
        self._num_pending += 1
        self._num_put += 1
        if len(group.items) < group.num_samples:
            return False
        self._num_pending -= group.num_samples
        group.ready_seq = self._next_seq
        self._next_seq += 1
        self._place(group)
        return True

    def pending_step(self, group_id: int) -> int | None:
        """The admission step of group `group_id` while it waits for members; None otherwise."""
        group = self._groups.get(group_id)
        return group.step if group is not None and group.where == "pending" else None

    def sample(self, num_groups: int = 1, *, defer_replays: bool = False) -> list[GroupBatch[P]]:
        """Hand out up to `num_groups` whole groups in the configured order (fewer if none ready).

        A group with replays left goes back to the ready set after this call, with its freshness
        multiplied by replay_decay, so it never appears twice in one call; with `defer_replays`
        it goes back at the next `update_version` instead, so several calls between two versions
        (one optimizer step) never hand it out twice either.
        """
        out: list[GroupBatch[P]] = []
        replay: list[_Group] = []
        while len(out) < num_groups:
            top = self._policy.peek()
            if top is None:
                break
            group = self._groups[top[1]]
            if self._order == "windowed" and group.step > self._version:
                break  # the oldest ready group is for a future step: nothing is eligible yet
            self._unready(group)
            reason = self._violation(group)
            # Staleness is bounded by construction (enforced on every version or bound change);
            # assert it again where the data is consumed.
            assert reason is None or self._action == "downweight", (group.group_id, reason)
            weight = 1.0
            if reason is not None:
                weight = self._downweight
                self._downweighted_by_reason[reason] += len(group.items)
            if group.reuse > 0:
                self._replays += 1
            out.append(
                GroupBatch(
                    group_id=group.group_id,
                    items=tuple(group.items),
                    weight=weight,
                    reuse=group.reuse,
                    staleness=self._version - group.min_version,
                    freshness=group.freshness,
                )
            )
            if group.reuse < self._max_replays:
                replay.append(group)
            else:
                self._forget(group)
                self._num_handed_out += len(group.items)
                self._log("consumed", group.group_id)
        for group in replay:
            if defer_replays:
                group.where = "replaying"
                self._deferred.append(group)
            else:
                self._refile_replay(group)
        return out

    def contents(self) -> list[tuple[BufferItem[P], int]]:
        """Every item held, with its group's reuse count, as the buffer will offer them at the
        next version: groups waiting to be replayed (`defer_replays`) are shown re-filed
        (reuse + 1, freshness decayed). Complete groups in completion order, then pending ones;
        `put(item, reuse=...)` of these in this order rebuilds an equivalent buffer."""
        groups = sorted(self._groups.values(), key=lambda g: (g.where == "pending", g.ready_seq))
        out: list[tuple[BufferItem[P], int]] = []
        for group in groups:
            if group.where == "replaying":
                d = self._replay_decay
                out.extend(
                    (dataclasses.replace(i, freshness=max(i.freshness * d, MIN_FRESHNESS)), group.reuse + 1)
                    for i in group.items
                )
            else:
                out.extend((item, group.reuse) for item in group.items)
        return out

    def drain_events(self) -> list[BufferEvent]:
        """What happened to groups since the last call, in order (empty unless record_events):
        ("consumed", id, "") handed out for the last time; ("evicted", id, reason) dropped;
        ("withheld", id, reason); ("released", id, "") moved from withheld back to ready."""
        events, self._events = self._events, []
        return events

    def update_version(self, learner_version: int) -> None:
        """The learner stepped: re-score staleness (and the window) and apply the action.

        Only groups that cross a bound are touched, O(log n) each.
        """
        if learner_version < self._version:
            raise ValueError(f"learner_version went backwards: {self._version} -> {learner_version}")
        self._version = learner_version
        deferred, self._deferred = self._deferred, []
        for group in deferred:
            self._refile_replay(group)
        self._enforce()

    def set_bounds(
        self,
        *,
        max_staleness: int | None = UNCHANGED,
        freshness_floor: float = UNCHANGED,
        window: int = UNCHANGED,
    ) -> None:
        """Change the bounds; tightening applies the action, loosening releases withheld groups."""
        max_staleness = self._max_staleness if max_staleness is UNCHANGED else max_staleness
        freshness_floor = self._freshness_floor if freshness_floor is UNCHANGED else freshness_floor
        window = self._window if window is UNCHANGED else window
        self._check_bounds(max_staleness, freshness_floor, window)
        self._max_staleness, self._freshness_floor, self._window = max_staleness, freshness_floor, window
        self._enforce()

    def discard_pending(self, group_id: int, *, reason: str = "abandoned") -> int:
        """Drop an incomplete group (e.g. its task was re-queued); returns the items dropped.

        Complete or unknown groups are left alone and 0 is returned.
        """
        if reason not in EVICTION_REASONS:
            raise ValueError(f"reason must be one of {EVICTION_REASONS}, got {reason!r}")
        group = self._groups.get(group_id)
        if group is None or group.where != "pending":
            return 0
        self._num_pending -= len(group.items)
        self._drop(group, reason)
        return len(group.items)

    # ----------------------------------------------------------------------------- internals

    @staticmethod
    def _check_bounds(max_staleness: int | None, freshness_floor: float, window: int) -> None:
        if max_staleness is not None and max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0 or None, got {max_staleness}")
        if not 0.0 <= freshness_floor <= 1.0:
            raise ValueError(f"freshness_floor must be in [0, 1], got {freshness_floor}")
        if window < 0:
            raise ValueError(f"window must be >= 0, got {window}")

    def _fits(self, num_tokens: int, *, reclaimable: bool) -> bool:
        items, tokens = self._size + 1, self._num_tokens + num_tokens
        if reclaimable:
            items -= self._num_withheld
            tokens -= self._num_tokens_withheld
        return (self._max_items is None or items <= self._max_items) and (
            self._max_tokens is None or tokens <= self._max_tokens
        )

    def _reclaim(self, num_tokens: int) -> None:
        while not self._fits(num_tokens, reclaimable=False):
            group = self._groups[next(iter(self._withheld_order))]
            self._unwithhold(group)
            self._drop(group, "reclaimed")

    def _violation(self, group: _Group) -> str | None:
        """The first bound `group` violates, or None."""
        if self._max_staleness is not None and self._version - group.min_version > self._max_staleness:
            return "staleness"
        if group.freshness < self._freshness_floor:
            return "freshness"
        if self._order == "windowed" and group.step < self._version - self._window:
            return "window"
        return None

    def _passes(self, reason: str, group: _Group) -> bool:
        if reason == "staleness":
            return self._max_staleness is None or self._version - group.min_version <= self._max_staleness
        if reason == "freshness":
            return group.freshness >= self._freshness_floor
        return group.step >= self._version - self._window

    def _policy_key(self, group: _Group) -> Any:
        if self._order == "fifo":
            return group.ready_seq
        if self._order == "freshest":
            return (-group.freshness, group.ready_seq)
        return (group.step, group.ready_seq)

    def _place(self, group: _Group) -> None:
        """File a complete group: ready, or (bound violated) withheld or dropped."""
        reason = None if self._action == "downweight" else self._violation(group)
        if reason is None:
            self._make_ready(group)
        elif self._action == "drop":
            self._drop(group, reason)
        else:
            self._withhold(group, reason)

    def _make_ready(self, group: _Group) -> None:
        group.where = "ready"
        self._policy.push(group.group_id, self._policy_key(group))
        if self._action != "downweight":
            self._by_version.push(group.group_id, group.min_version)
            self._by_freshness.push(group.group_id, group.freshness)
        self._num_items_ready += len(group.items)

    def _unready(self, group: _Group) -> None:
        self._policy.remove(group.group_id)
        self._by_version.remove(group.group_id)
        self._by_freshness.remove(group.group_id)
        self._num_items_ready -= len(group.items)

    def _withhold(self, group: _Group, reason: str) -> None:
        group.where, group.reason = "withheld", reason
        if reason == "staleness":
            release_key: Any = -group.min_version
        elif reason == "freshness":
            release_key = -group.freshness
        else:
            release_key = -group.step
        self._withheld_heaps[reason].push(group.group_id, release_key)
        self._withheld_order[group.group_id] = None
        self._num_withheld += len(group.items)
        self._num_tokens_withheld += group.num_tokens
        self._withheld_by_reason[reason] += len(group.items)
        self._log("withheld", group.group_id, reason)

    def _unwithhold(self, group: _Group) -> None:
        assert group.reason is not None
        self._withheld_heaps[group.reason].remove(group.group_id)
        del self._withheld_order[group.group_id]
        self._num_withheld -= len(group.items)
        self._num_tokens_withheld -= group.num_tokens
        self._withheld_by_reason[group.reason] -= len(group.items)
        group.reason = None

    def _forget(self, group: _Group) -> None:
        """Remove a group that is in no index any more from the store and the accounting."""
        del self._groups[group.group_id]
        for item in group.items:
            self._traj_ids.discard(item.traj_id)
        self._size -= len(group.items)
        self._num_tokens -= group.num_tokens

    def _drop(self, group: _Group, reason: str) -> None:
        self._forget(group)
        self._evicted_by_reason[reason] += len(group.items)
        self._log("evicted", group.group_id, reason)

    def _refile_replay(self, group: _Group) -> None:
        self._decay(group)
        group.reuse += 1
        group.ready_seq = self._next_seq
        self._next_seq += 1
        self._place(group)

    def _log(self, kind: str, group_id: int, reason: str = "") -> None:
        if self._record_events:
            self._events.append(BufferEvent(kind, group_id, reason))

    def _decay(self, group: _Group) -> None:
        decay = self._replay_decay
        if decay == 1.0:
            return
        group.items = [
            dataclasses.replace(item, freshness=max(item.freshness * decay, MIN_FRESHNESS))
            for item in group.items
        ]
        group.freshness = max(group.freshness * decay, MIN_FRESHNESS)

    def _enforce(self) -> None:
        """Apply the bounds after a version or bound change: evict crossers, release the rest."""
        if self._action == "downweight":
            return  # violations are only weighed at hand-out
        for heap, reason in ((self._by_version, "staleness"), (self._by_freshness, "freshness")):
            while (top := heap.peek()) is not None and not self._passes(reason, self._groups[top[1]]):
                group = self._groups[top[1]]
                self._unready(group)
                self._place(group)
        if self._order == "windowed":
            while (top := self._policy.peek()) is not None and not self._passes(
                "window", self._groups[top[1]]
            ):
                group = self._groups[top[1]]
                self._unready(group)
                self._place(group)
        for reason, heap in self._withheld_heaps.items():
            while (top := heap.peek()) is not None and self._passes(reason, self._groups[top[1]]):
                group = self._groups[top[1]]
                self._unwithhold(group)
                still = self._violation(group)  # passes `reason`, may still fail another bound
                if still is None:
                    self._num_released += len(group.items)
                    self._log("released", group.group_id)
                    self._make_ready(group)
                else:
                    self._withhold(group, still)
