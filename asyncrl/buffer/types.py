"""The buffer's value types, bounds and the default freshness score (`store.py` holds the Buffer)."""

from __future__ import annotations

import dataclasses
import math
import sys
from typing import Any, Generic, Literal, NamedTuple, TypeVar

P = TypeVar("P")

Order = Literal["fifo", "freshest", "windowed"]
Action = Literal["withhold", "downweight", "drop"]
ORDERS: tuple[str, ...] = ("fifo", "freshest", "windowed")
ACTIONS: tuple[str, ...] = ("withhold", "downweight", "drop")

# Bound violations, checked in this order (a group is filed under the first one it violates).
BOUND_REASONS: tuple[str, ...] = ("staleness", "freshness", "window")
# Every eviction reason: bounds, a partial group abandoned by the caller, withheld data dropped to
# make room under the memory bound, a group whose rewards are all equal (dynamic sampling).
EVICTION_REASONS: tuple[str, ...] = (*BOUND_REASONS, "abandoned", "reclaimed", "degenerate")

# Smallest freshness a score or a replay decay can produce: freshness lives in (0, 1], and an
# underflow to 0.0 would leave that interval.
MIN_FRESHNESS = sys.float_info.min


def freshness_from_staleness(staleness: int, *, half_life: float) -> float:
    """Default freshness score when log-prob drift is unknown: 2^(-staleness / half_life).

    [proposal] ALGORITHMS.md 6.1 scores a sample by its measured drift, exp(-(l_r D_roll + l_s
    D_sup)). Without log-probs under the current policy, drift is unknown; assuming it grows
    roughly linearly with the number of optimizer steps since rollout gives an exponential decay
    in staleness. `half_life` is the staleness at which the score halves. Staleness <= 0 scores
    1.0; the result is clamped to MIN_FRESHNESS so it stays in (0, 1].
    """
    if not half_life > 0:
        raise ValueError(f"half_life must be > 0, got {half_life}")
    if staleness <= 0:
        return 1.0
    return max(math.exp2(-staleness / half_life), MIN_FRESHNESS)


@dataclasses.dataclass(frozen=True, slots=True)
class BufferItem(Generic[P]):
    """One trajectory as the buffer sees it; `payload` is opaque (a Trajectory plus tensors)."""

    traj_id: int
    group_id: int
    num_samples: int  # members of the group; the group is ready when all arrived
    step: int  # the group's admission window (PromptTask.window)
    min_version: int  # oldest policy_version among the item's tokens
    freshness: float  # in (0, 1]
    num_tokens: int
    payload: P


class GroupBatch(NamedTuple, Generic[P]):
    """One whole group handed out by `Buffer.sample`."""

    group_id: int
    items: tuple[BufferItem[P], ...]  # in arrival order
    weight: float  # 1.0, or `downweight` when a bound is violated and action="downweight"
    reuse: int  # 0 on first use, k on the k-th replay
    staleness: int  # learner_version - min(member min_version) at hand-out
    freshness: float  # min(member freshness) at hand-out (decayed on replays)


class BufferStats(NamedTuple):
    size: int  # items held: pending + ready + withheld
    num_tokens: int  # tokens held
    num_pending: int  # items of incomplete groups
    num_groups_ready: int  # complete groups waiting to be sampled (now or later, if windowed)
    num_items_ready: int
    num_groups_withheld: int
    withheld: int  # items withheld now
    withheld_by_reason: dict[str, int]  # items withheld now, by reason
    evicted_by_reason: dict[str, int]  # items dropped since start, by reason
    downweighted_by_reason: dict[str, int]  # items handed out with weight < 1, by reason
    replays: int  # group hand-outs that were re-uses
    num_put: int
    num_handed_out: int  # items that left by hand-out (a replayed item counts once, at last use)
    num_released: int  # items moved from withheld back to ready
    learner_version: int


class BufferEvent(NamedTuple):
    """What happened to a group (`Buffer.drain_events`): kind is "consumed", "evicted",
    "withheld" or "released"; reason is the bound or eviction reason ("" for the others)."""

    kind: str
    group_id: int
    reason: str


class BufferFull(Exception):
    """`put` would exceed max_items or max_tokens: back-pressure, retry after a `sample`."""


class _Unchanged:
    """Sentinel type for `set_bounds` arguments left as they are."""


UNCHANGED: Any = _Unchanged()
