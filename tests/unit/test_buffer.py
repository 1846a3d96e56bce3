"""Value tests for the pure buffer (asyncrl.buffer.store) and its lazy heap."""

from __future__ import annotations

import math

import pytest

from asyncrl.buffer.heap import LazyHeap
from asyncrl.buffer.store import (
    MIN_FRESHNESS,
    Buffer,
    BufferFull,
    BufferItem,
    freshness_from_staleness,
)


def item(
    traj_id, group_id, *, num_samples=2, step=0, min_version=0, freshness=1.0, num_tokens=10, payload=None
):
    return BufferItem(
        traj_id=traj_id,
        group_id=group_id,
        num_samples=num_samples,
        step=step,
        min_version=min_version,
        freshness=freshness,
        num_tokens=num_tokens,
        payload=payload,
    )


def put_group(buf, group_id, *, num_samples=2, first_traj=None, **kw):
    """Put a whole group; traj ids are group_id * 100 + i unless `first_traj` is given."""
    base = group_id * 100 if first_traj is None else first_traj
    done = [buf.put(item(base + i, group_id, num_samples=num_samples, **kw)) for i in range(num_samples)]
    assert done == [False] * (num_samples - 1) + [True]


def ids(batches):
    return [b.group_id for b in batches]


def accounted(buf):
    s = buf.stats()
    return s.size + s.num_handed_out + sum(s.evicted_by_reason.values()) == s.num_put


# ---------------------------------------------------------------------------------------- heap


def test_lazy_heap_orders_replaces_and_removes():
    heap = LazyHeap()
    for key, prio in [(1, 5), (2, 3), (3, 9), (4, 3)]:
        heap.push(key, prio)
    heap.push(3, 1)  # re-push replaces the old entry
    assert heap.remove(1) and not heap.remove(1)
    assert len(heap) == 3 and 1 not in heap and 3 in heap
    assert [heap.pop() for _ in range(4)] == [(1, 3), (3, 2), (3, 4), None]  # ties by push order


def test_lazy_heap_compacts_dead_entries():
    heap = LazyHeap()
    for key in range(10_000):
        heap.push(key, key)
    for key in range(0, 10_000, 2):
        heap.remove(key)
    for key in range(1, 10_000, 2):
        heap.push(key, -key)  # re-prioritise: the old entries die
    assert len(heap) == 5_000
    assert len(heap._entries) <= 2 * len(heap) + 64
    assert heap.peek() == (-9_999, 9_999)


# ---------------------------------------------------------------------------------------- groups and order


def test_groups_are_handed_out_whole_and_only_when_complete():
    buf = Buffer()
    buf.put(item(1, 7, num_samples=3))
    buf.put(item(2, 7, num_samples=3))
    assert buf.sample(5) == [] and buf.stats().num_pending == 2
    assert buf.put(item(3, 7, num_samples=3))
    (batch,) = buf.sample(5)
    assert batch.group_id == 7 and [it.traj_id for it in batch.items] == [1, 2, 3]
    assert batch.weight == 1.0 and batch.reuse == 0 and len(buf) == 0 and accounted(buf)


def test_fifo_is_completion_order():
    buf = Buffer(order="fifo")
    buf.put(item(1, 1))  # group 1 starts first ...
    put_group(buf, 2)
    buf.put(item(2, 1))  # ... but completes second
    put_group(buf, 3)
    assert ids(buf.sample(2)) == [2, 1] and ids(buf.sample(2)) == [3]


def test_freshest_first_by_group_minimum_then_arrival():
    buf = Buffer(order="freshest")
    buf.put(item(1, 1, freshness=1.0))
    buf.put(item(2, 1, freshness=0.2))  # group 1 freshness = min = 0.2
    put_group(buf, 2, freshness=0.5)
    put_group(buf, 3, freshness=0.9)
    put_group(buf, 4, freshness=0.5)
    (b,) = buf.sample(1)
    assert b.group_id == 3 and b.freshness == 0.9
    assert ids(buf.sample(3)) == [2, 4, 1]


def test_windowed_hands_out_oldest_step_within_window_and_waits_for_future_steps():
    buf = Buffer(order="windowed", window=1, action="drop", learner_version=5)
    put_group(buf, 1, step=6)  # future step: waits
    put_group(buf, 2, step=5)
    put_group(buf, 3, step=4)  # within window (5 - 1 <= 4)
    put_group(buf, 4, step=3)  # out of window on arrival: dropped
    assert buf.stats().evicted_by_reason["window"] == 2
    assert ids(buf.sample(5)) == [3, 2]
    assert buf.sample(1) == []
    buf.update_version(6)
    assert ids(buf.sample(1)) == [1]


def test_windowed_update_version_evicts_groups_that_fall_out():
    buf = Buffer(order="windowed", window=0, action="withhold")
    put_group(buf, 1, step=0)
    put_group(buf, 2, step=1)
    buf.update_version(1)
    s = buf.stats()
    assert s.withheld_by_reason["window"] == 2 and s.num_groups_ready == 1
    buf.set_bounds(window=1)  # loosening releases
    assert buf.stats().withheld == 0 and ids(buf.sample(2)) == [1, 2]


# ---------------------------------------------------------------------------------------- bounds and actions


def test_staleness_drop_counts_every_item_by_reason():
    buf = Buffer(max_staleness=1, action="drop")
    put_group(buf, 1, min_version=0)
    put_group(buf, 2, min_version=1)
    put_group(buf, 3, num_samples=3, min_version=2)
    buf.update_version(2)  # group 1: staleness 2 > 1
    assert buf.stats().evicted_by_reason["staleness"] == 2
    buf.update_version(3)  # group 2 crosses too
    s = buf.stats()
    assert s.evicted_by_reason["staleness"] == 4 and s.size == 3 and accounted(buf)
    (b,) = buf.sample(5)
    assert b.group_id == 3 and b.staleness == 1


def test_group_staleness_uses_its_oldest_member():
    buf = Buffer(max_staleness=2, action="drop", learner_version=3)
    buf.put(item(1, 1, min_version=3))
    buf.put(item(2, 1, min_version=0))  # staleness 3 on completion
    assert buf.stats().evicted_by_reason["staleness"] == 2


def test_withhold_keeps_counts_and_releases_when_the_bound_loosens():
    buf = Buffer(max_staleness=0, action="withhold")
    put_group(buf, 1, min_version=0)
    put_group(buf, 2, min_version=1)
    buf.update_version(2)
    s = buf.stats()
    assert s.withheld == 4 and s.num_groups_withheld == 2 and s.size == 4 and buf.sample(1) == []
    assert sum(s.evicted_by_reason.values()) == 0
    buf.set_bounds(max_staleness=1)  # releases group 2 only
    assert buf.stats().num_released == 2 and ids(buf.sample(5)) == [2]
    buf.set_bounds(max_staleness=None)
    assert ids(buf.sample(5)) == [1] and accounted(buf)


def test_released_group_refiled_under_another_bound_is_not_counted_released():
    buf = Buffer(max_staleness=0, freshness_floor=0.0, action="withhold")
    put_group(buf, 1, min_version=0, freshness=0.3)
    buf.update_version(1)
    assert buf.stats().withheld_by_reason["staleness"] == 2
    buf.set_bounds(freshness_floor=0.5)  # still filed under staleness
    buf.set_bounds(max_staleness=None)  # passes staleness, fails freshness: re-filed
    s = buf.stats()
    assert s.withheld_by_reason == {"staleness": 0, "freshness": 2, "window": 0} and s.num_released == 0
    buf.set_bounds(freshness_floor=0.3)
    assert buf.stats().num_released == 2 and ids(buf.sample(1)) == [1]


def test_downweight_hands_out_violators_with_weight():
    buf = Buffer(max_staleness=0, freshness_floor=0.5, action="downweight", downweight=0.25)
    put_group(buf, 1, min_version=0)
    put_group(buf, 2, min_version=1, freshness=0.4)
    put_group(buf, 3, min_version=1)
    buf.update_version(1)
    batches = buf.sample(3)
    assert [(b.group_id, b.weight) for b in batches] == [(1, 0.25), (2, 0.25), (3, 1.0)]
    s = buf.stats()
    assert s.downweighted_by_reason == {"staleness": 2, "freshness": 2, "window": 0}
    assert s.withheld == 0 and sum(s.evicted_by_reason.values()) == 0


def test_freshness_floor_drop_and_raise_floor_later():
    buf = Buffer(freshness_floor=0.5, action="drop")
    put_group(buf, 1, freshness=0.4)
    put_group(buf, 2, freshness=0.6)
    put_group(buf, 3, freshness=0.9)
    assert buf.stats().evicted_by_reason["freshness"] == 2
    buf.set_bounds(freshness_floor=0.7)
    assert buf.stats().evicted_by_reason["freshness"] == 4 and ids(buf.sample(5)) == [3]


def test_discard_pending_counts_abandoned_and_ignores_complete_groups():
    buf = Buffer()
    buf.put(item(1, 1, num_samples=3))
    buf.put(item(2, 1, num_samples=3))
    put_group(buf, 2)
    assert buf.discard_pending(1) == 2 and buf.discard_pending(2) == 0 and buf.discard_pending(99) == 0
    s = buf.stats()
    assert s.evicted_by_reason["abandoned"] == 2 and s.num_pending == 0 and accounted(buf)
    buf.put(item(1, 1, num_samples=3))  # the traj id is free again: the group restarts
    assert buf.stats().num_pending == 1


# ---------------------------------------------------------------------------------------- replay


def test_replay_reuses_up_to_k_times_with_decay():
    buf = Buffer(order="fifo", max_replays=2, replay_decay=0.5)
    put_group(buf, 1, freshness=0.8)
    put_group(buf, 2, freshness=1.0)
    first = buf.sample(5)
    assert [(b.group_id, b.reuse) for b in first] == [(1, 0), (2, 0)]  # never twice in one call
    second = buf.sample(5)
    assert [(b.group_id, b.reuse, b.freshness) for b in second] == [(1, 1, 0.4), (2, 1, 0.5)]
    assert [it.freshness for it in second[0].items] == [0.4, 0.4]
    third = buf.sample(5)
    assert [b.reuse for b in third] == [2, 2] and buf.sample(5) == []
    s = buf.stats()
    assert s.replays == 4 and s.num_handed_out == 4 and s.size == 0 and accounted(buf)


def test_replay_decay_below_floor_evicts():
    buf = Buffer(max_replays=3, replay_decay=0.5, freshness_floor=0.3, action="drop")
    put_group(buf, 1, freshness=1.0)
    assert [b.reuse for b in buf.sample(1) + buf.sample(1)] == [0, 1]
    assert buf.sample(1) == []  # 0.25 < 0.3
    s = buf.stats()
    assert s.evicted_by_reason["freshness"] == 2 and s.num_handed_out == 0 and accounted(buf)


# ---------------------------------------------------------------------------------------- capacity


def test_back_pressure_on_items_and_tokens():
    buf = Buffer(max_items=3, max_tokens=25)
    buf.put(item(1, 1, num_tokens=10))
    buf.put(item(2, 1, num_tokens=10))
    with pytest.raises(BufferFull, match="buffer full"):
        buf.put(item(3, 2, num_tokens=6))
    buf.put(item(3, 2, num_tokens=5))
    with pytest.raises(BufferFull):
        buf.put(item(4, 2, num_tokens=0))
    s = buf.stats()
    assert s.size == 3 and s.num_tokens == 25 and s.num_put == 3
    buf.sample(1)
    with pytest.raises(ValueError, match="can never fit"):
        buf.put(item(5, 3, num_tokens=26))


def test_withheld_groups_are_reclaimed_oldest_first_before_refusing():
    buf = Buffer(max_items=4, max_staleness=0, action="withhold")
    put_group(buf, 1, min_version=0)
    put_group(buf, 2, min_version=1)
    buf.update_version(2)  # both withheld, buffer full
    assert buf.stats().withheld == 4
    buf.put(item(900, 3, min_version=2))  # reclaims group 1 (oldest withheld)
    s = buf.stats()
    assert s.evicted_by_reason["reclaimed"] == 2 and s.withheld == 2 and s.size == 3
    buf.set_bounds(max_staleness=1)
    assert ids(buf.sample(5)) == [2] and accounted(buf)


def test_pending_groups_are_never_reclaimed():
    buf = Buffer(max_items=2)
    buf.put(item(1, 1, num_samples=3))
    buf.put(item(2, 1, num_samples=3))
    with pytest.raises(BufferFull):
        buf.put(item(3, 1, num_samples=3))


# ---------------------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"order": "lifo"}, "order must be one of"),
        ({"action": "ignore"}, "action must be one of"),
        ({"downweight": 1.0}, "downweight"),
        ({"max_replays": -1}, "max_replays"),
        ({"replay_decay": 0.0}, "replay_decay"),
        ({"max_items": 0}, "max_items"),
        ({"max_staleness": -1}, "max_staleness"),
        ({"freshness_floor": 1.5}, "freshness_floor"),
        ({"window": -1}, "window"),
    ],
)
def test_bad_configuration_is_rejected(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Buffer(**kwargs)


def test_bad_items_are_rejected_without_changing_state():
    buf = Buffer()
    buf.put(item(1, 1, num_samples=3, step=2))
    for bad, match in [
        (item(1, 2), "already in the buffer"),
        (item(2, 1, num_samples=4, step=2), "disagrees"),
        (item(2, 1, num_samples=3, step=1), "disagrees"),
        (item(2, 3, freshness=0.0), "freshness"),
        (item(2, 3, freshness=1.5), "freshness"),
        (item(2, 3, num_tokens=-1), "num_tokens"),
    ]:
        with pytest.raises(ValueError, match=match):
            buf.put(bad)
    put_group(buf, 5)
    with pytest.raises(ValueError, match="already complete"):
        buf.put(item(3, 5))
    assert buf.stats().num_put == 3 and len(buf) == 3


def test_version_cannot_go_backwards():
    buf = Buffer(learner_version=3)
    with pytest.raises(ValueError, match="backwards"):
        buf.update_version(2)


# ---------------------------------------------------------------------------------------- freshness score


def test_freshness_from_staleness_halves_every_half_life():
    assert freshness_from_staleness(0, half_life=4) == 1.0
    assert freshness_from_staleness(-2, half_life=4) == 1.0
    assert freshness_from_staleness(4, half_life=4) == 0.5
    assert math.isclose(freshness_from_staleness(6, half_life=4), 2**-1.5)
    assert freshness_from_staleness(10**9, half_life=1) == MIN_FRESHNESS > 0
    with pytest.raises(ValueError, match="half_life"):
        freshness_from_staleness(1, half_life=0)


# ---------------------------------------------------------------------------------------- pool-mode helpers


def test_deferred_replays_wait_for_the_next_version():
    buf = Buffer(max_replays=1, replay_decay=0.5)
    put_group(buf, 1)
    assert ids(buf.sample(1, defer_replays=True)) == [1]
    assert buf.sample(1, defer_replays=True) == []  # not twice in one step
    assert len(buf) == 2 and accounted(buf)
    buf.update_version(1)
    again = buf.sample(1, defer_replays=True)
    assert ids(again) == [1] and again[0].reuse == 1 and again[0].freshness == 0.5
    assert len(buf) == 0 and accounted(buf)


def test_events_name_each_group_once_per_change():
    buf = Buffer(max_staleness=1, action="withhold", max_items=4, record_events=True)
    put_group(buf, 1, min_version=0)
    put_group(buf, 2, min_version=0)
    assert buf.drain_events() == []
    buf.update_version(2)  # both too stale
    assert [(e.kind, e.group_id, e.reason) for e in buf.drain_events()] == [
        ("withheld", 1, "staleness"),
        ("withheld", 2, "staleness"),
    ]
    put_group(buf, 3, min_version=2)  # room is made by dropping the oldest withheld group
    put_group(buf, 4, min_version=2)
    events = buf.drain_events()
    assert [(e.kind, e.group_id, e.reason) for e in events] == [
        ("evicted", 1, "reclaimed"),
        ("evicted", 2, "reclaimed"),
    ]
    buf.sample(2)
    assert [(e.kind, e.group_id) for e in buf.drain_events()] == [("consumed", 3), ("consumed", 4)]
    assert Buffer().drain_events() == []  # off by default


def test_contents_rebuild_an_equivalent_buffer():
    """What a pool-mode checkpoint keeps: put back in order (with reuse counts), the copy hands
    out the same groups in the same order with the same weights, reuse and freshness."""

    def build():
        buf = Buffer(order="freshest", max_replays=2, replay_decay=0.5, max_staleness=3, action="withhold")
        put_group(buf, 1, freshness=0.9)
        put_group(buf, 2, freshness=0.6)
        buf.put(item(300, 3, freshness=1.0))  # pending
        buf.sample(1, defer_replays=True)  # group 1, replay deferred
        return buf

    src = build()
    copy = Buffer(order="freshest", max_replays=2, replay_decay=0.5, max_staleness=3, action="withhold")
    for it, reuse in src.contents():
        copy.put(it, reuse=reuse)
    src.update_version(1)
    copy.update_version(1)
    assert src.stats()._replace(num_put=0, replays=0, num_handed_out=0) == copy.stats()._replace(
        num_put=0, replays=0, num_handed_out=0
    )
    a, b = src.sample(5), copy.sample(5)
    assert [(g.group_id, g.reuse, g.freshness, g.weight) for g in a] == [
        (g.group_id, g.reuse, g.freshness, g.weight) for g in b
    ]
    with pytest.raises(ValueError, match="reuse"):
        Buffer(max_replays=1).put(item(1, 1), reuse=2)
