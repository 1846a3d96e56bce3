"""Value tests for the sample ledger (asyncrl.buffer.ledger)."""

from __future__ import annotations

import pytest

from asyncrl.buffer.ledger import Arrival, Ledger


def run_task(ledger, task_id, *, num_samples=2, generator_id="g0", first_traj=None, train=True):
    """Admit, dispatch, generate, buffer and (optionally) train a whole task."""
    base = task_id * 100 if first_traj is None else first_traj
    ledger.admit(task_id, group_id=task_id, num_samples=num_samples)
    ledger.dispatch(task_id, generator_id=generator_id)
    for i in range(num_samples):
        assert ledger.generated(base + i, task_id=task_id, sample_index=i, num_tokens=5) is Arrival.NEW
        ledger.buffered(base + i)
        if train:
            ledger.trained(base + i)
    ledger.task_done(task_id)


def test_happy_path_counts():
    ledger = Ledger()
    run_task(ledger, 1)
    run_task(ledger, 2, num_samples=3)
    s = ledger.summary()
    assert s.num_tasks == 2 and s.tasks_by_state["generated"] == 2
    assert s.num_trajectories == 5 and s.trajectories_by_state["trained"] == 5
    assert (s.num_samples_expected, s.num_samples_trained, s.num_samples_pending, s.num_samples_lost) == (
        5,
        5,
        0,
        0,
    )
    assert s.num_duplicated == 0 and ledger.summary(at_end=True).num_samples_lost == 0


def test_pending_then_lost_at_end():
    ledger = Ledger()
    ledger.admit(1, group_id=1, num_samples=2)
    assert ledger.summary().num_samples_pending == 2  # admitted: pending
    ledger.dispatch(1, generator_id="g0")
    ledger.generated(10, task_id=1, sample_index=0)
    assert ledger.summary().num_samples_pending == 2  # in flight
    ledger.task_done(1)  # sample 1 never arrived
    s = ledger.summary()
    assert (s.num_samples_pending, s.num_samples_lost) == (1, 1) and ledger.lost() == [(1, 1)]
    end = ledger.summary(at_end=True)
    assert (end.num_samples_pending, end.num_samples_lost) == (0, 2)
    assert ledger.lost(at_end=True) == [(1, 0), (1, 1)]


def test_trajectory_can_arrive_after_task_done():
    """TaskDone and Trajectory travel on different sockets, so their order is not guaranteed."""
    ledger = Ledger()
    ledger.admit(1, group_id=1, num_samples=1)
    ledger.dispatch(1, generator_id="g0")
    ledger.task_done(1)
    assert ledger.summary().num_samples_lost == 1
    assert ledger.generated(10, task_id=1, sample_index=0) is Arrival.NEW
    ledger.buffered(10)
    ledger.evicted(10, reason="staleness")
    s = ledger.summary()
    assert (s.num_samples_lost, s.num_samples_evicted, s.evicted_by_reason) == (0, 1, {"staleness": 1})


def test_generator_failure_requeues_each_in_flight_task_exactly_once():
    ledger = Ledger()
    for task_id, gen in [(1, "a"), (2, "a"), (3, "b")]:
        ledger.admit(task_id, group_id=task_id, num_samples=1)
        ledger.dispatch(task_id, generator_id=gen)
    ledger.task_done(2)
    assert ledger.generator_failed("a") == [1]
    assert ledger.generator_failed("a") == []  # a repeated report requeues nothing
    assert ledger.tasks_in_flight("b") == [3]
    ledger.dispatch(1, generator_id="b")
    assert ledger.generator_failed("b") == [1, 3]
    s = ledger.summary()
    assert s.num_requeues == 3 and s.tasks_by_state["requeued"] == 2
    with pytest.raises(ValueError, match="task 1: cannot go requeued -> requeued"):
        ledger.requeue(1)


def test_requeue_after_partial_delivery_makes_duplicates_measurable():
    ledger = Ledger()
    ledger.admit(1, group_id=1, num_samples=2)
    ledger.dispatch(1, generator_id="a")
    ledger.generated(10, task_id=1, sample_index=0)
    ledger.generator_failed("a")
    assert ledger.missing_samples(1) == [1]
    ledger.dispatch(1, generator_id="b")
    assert ledger.generated(20, task_id=1, sample_index=0) is Arrival.DUPLICATE_SAMPLE
    assert ledger.generated(21, task_id=1, sample_index=1) is Arrival.NEW
    assert ledger.generated(21, task_id=1, sample_index=1) is Arrival.DUPLICATE_ID
    ledger.task_done(1)
    for traj_id in (10, 20, 21):
        ledger.buffered(traj_id)
        ledger.trained(traj_id)  # the learner ignored the verdict: 3 trainings for 2 samples
    s = ledger.summary()
    assert (s.num_duplicate_ids, s.num_duplicate_samples, s.num_overtrained, s.num_duplicated) == (1, 1, 1, 3)
    assert s.num_samples_trained == 2 and s.num_samples_lost == 0


def test_cancelled_task_counts_its_slots_as_evicted():
    ledger = Ledger()
    ledger.admit(1, group_id=1, num_samples=3)
    ledger.dispatch(1, generator_id="a")
    ledger.generated(10, task_id=1, sample_index=0)
    ledger.requeue(1)
    ledger.cancel_task(1)
    s = ledger.summary()
    assert (s.num_samples_evicted, s.num_samples_pending) == (2, 1)  # traj 10 is still live
    ledger.buffered(10)
    ledger.trained(10)
    s = ledger.summary(at_end=True)
    assert (s.num_samples_trained, s.num_samples_evicted, s.num_samples_lost) == (1, 2, 0)
    with pytest.raises(ValueError, match="task 1 is evicted"):
        ledger.generated(11, task_id=1, sample_index=1)


@pytest.mark.parametrize(
    ("calls", "match"),
    [
        ([("trained", 10)], r"trajectory 10: cannot go generated -> trained \(trained needs buffered\)"),
        ([("buffered", 10), ("buffered", 10)], "trajectory 10: cannot go buffered -> buffered"),
        ([("buffered", 10), ("trained", 10), ("evicted", 10)], "trajectory 10: cannot go trained -> evicted"),
        ([("evicted", 10), ("buffered", 10)], "trajectory 10: cannot go evicted -> buffered"),
        ([("buffered", 10), ("trained", 10), ("trained", 10)], "cannot go trained -> trained"),
        ([("replayed", 10)], "cannot replay from generated"),
        ([("buffered", 99)], "trajectory 99: unknown"),
    ],
)
def test_illegal_trajectory_transitions_name_id_and_states(calls, match):
    ledger = Ledger()
    ledger.admit(1, group_id=1, num_samples=1)
    ledger.dispatch(1, generator_id="g")
    ledger.generated(10, task_id=1, sample_index=0)
    with pytest.raises(ValueError, match=match):  # the last call is the illegal one
        for name, traj_id in calls:
            if name == "evicted":
                ledger.evicted(traj_id, reason="x")
            else:
                getattr(ledger, name)(traj_id)


def test_illegal_task_transitions():
    ledger = Ledger()
    ledger.admit(1, group_id=1, num_samples=1)
    with pytest.raises(ValueError, match="already admitted"):
        ledger.admit(1, group_id=1, num_samples=1)
    with pytest.raises(
        ValueError, match=r"task 1: cannot go admitted -> generated \(task_done needs in_flight\)"
    ):
        ledger.task_done(1)
    with pytest.raises(ValueError, match="task 1 is admitted"):
        ledger.generated(10, task_id=1, sample_index=0)
    ledger.dispatch(1, generator_id="a")
    with pytest.raises(ValueError, match="sample_index 1 not in"):
        ledger.generated(10, task_id=1, sample_index=1)
    with pytest.raises(ValueError, match="in flight on 'a'"):
        ledger.task_done(1, generator_id="b")
    ledger.task_done(1, generator_id="a")
    for call in (
        lambda: ledger.dispatch(1, generator_id="a"),
        lambda: ledger.requeue(1),
        lambda: ledger.cancel_task(1),
    ):
        with pytest.raises(ValueError, match="task 1: cannot go generated"):
            call()
    with pytest.raises(ValueError, match="task 7: unknown"):
        ledger.dispatch(7, generator_id="a")
    with pytest.raises(ValueError, match="num_samples"):
        ledger.admit(8, group_id=8, num_samples=0)


def test_replays_are_counted_without_state_change():
    ledger = Ledger()
    run_task(ledger, 1, num_samples=1)
    ledger.replayed(100)
    ledger.replayed(100)
    s = ledger.summary()
    assert s.num_replays == 2 and s.num_overtrained == 0 and s.trajectories_by_state["trained"] == 1


def test_bytes_round_trip_is_deterministic_and_resumable():
    ledger = Ledger()
    run_task(ledger, 2, num_samples=2)
    ledger.admit(1, group_id=1, num_samples=2)
    ledger.dispatch(1, generator_id="a")
    ledger.generated(10, task_id=1, sample_index=1)
    ledger.buffered(10)
    data = ledger.to_bytes()
    restored = Ledger.from_bytes(data)
    assert restored.to_bytes() == data and restored.summary() == ledger.summary()
    # the rebuilt indexes behave like the originals
    for lg in (ledger, restored):
        assert lg.generator_failed("a") == [1]
        assert lg.generated(10, task_id=1, sample_index=1) is Arrival.DUPLICATE_ID
        lg.dispatch(1, generator_id="b")
        assert lg.generated(11, task_id=1, sample_index=1) is Arrival.DUPLICATE_SAMPLE
    assert restored.to_bytes() == ledger.to_bytes()
    with pytest.raises(ValueError, match="format"):
        Ledger.from_bytes(data.replace(b"\xa6format\x01", b"\xa6format\x02"))


def test_same_events_in_a_different_dict_order_give_the_same_bytes():
    a, b = Ledger(), Ledger()
    run_task(a, 1)
    run_task(a, 2)
    run_task(b, 2)
    run_task(b, 1)
    assert a.to_bytes() == b.to_bytes()


def test_compact_forgets_closed_tasks_but_keeps_counts():
    ledger = Ledger()
    run_task(ledger, 1)
    run_task(ledger, 2, train=False)  # buffered, not trained: open
    before = ledger.summary()
    assert ledger.compact() == 1 and ledger.summary() == before
    assert ledger.generated(500, task_id=1, sample_index=0) is Arrival.DUPLICATE_SAMPLE
    with pytest.raises(ValueError, match="already admitted"):
        ledger.admit(1, group_id=1, num_samples=2)
    restored = Ledger.from_bytes(ledger.to_bytes())
    assert restored.summary() == ledger.summary()
    with pytest.raises(ValueError, match="task 1: unknown"):
        restored.missing_samples(1)
    assert restored.missing_samples(2) == []
