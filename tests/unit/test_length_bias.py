"""Length bias (scheduler/lengths.py, docs/safety.md "Length bias"): a buffer that drops stale
groups drops long rollouts preferentially; window admission, which paces generation instead,
trains what was generated. Shown on a long-tailed task in a deterministic simulation that drives
the real admission classes and the real buffer, with a concurrent generator whose groups take
time proportional to their length."""

from __future__ import annotations

import pytest

from asyncrl.buffer.store import Buffer, BufferItem
from asyncrl.scheduler.admission import Admission, CreditAdmission
from asyncrl.scheduler.lengths import LengthTally

SHORT, LONG = 2, 8


def length_of(group: int) -> int:
    return LONG if group % 3 == 0 else SHORT  # every third group is long


def simulate(mode: str, *, groups_per_step: int = 3, max_staleness: int = 1, steps: int = 30) -> LengthTally:
    """Time in ticks: every admitted group generates at once (one slot each) and finishes after
    `length_of` ticks at the version it started on; a learner step takes 3 ticks."""
    tally = LengthTally(tracks_groups=mode == "pool")
    version, tick, busy_until, training = 0, 0, 0, None
    in_flight: dict[int, tuple[int, int]] = {}  # group -> (finish tick, version it started on)
    shape = dict(groups_per_step=groups_per_step, max_staleness=max_staleness, total_steps=steps)
    if mode == "pool":  # credits, and a buffer that drops groups past the bound
        admission = CreditAdmission(**shape)
        buffer = Buffer(order="fifo", max_staleness=max_staleness, action="drop", record_events=True)
    else:  # window: group j trains in step j // B and is admitted within the bound
        admission = Admission(**shape)
        finished: dict[int, int] = {}

    def drain() -> None:
        events = buffer.drain_events()
        evicted = [e.group_id for e in events if e.kind == "evicted"]
        tally.evicted({"stale": evicted})
        admission.release(len(evicted) + sum(e.kind == "consumed" for e in events), version=version)

    while version < steps:
        assert tick < 10_000, "the simulated run stalled"
        if training is not None and tick >= busy_until:
            version += 1
            tally.trained(tokens=sum(map(length_of, training)), samples=len(training))
            training = None
            if mode == "pool":
                buffer.update_version(version)
                drain()
        for group in admission.admit(version):  # the generators hold the newest version at once
            in_flight[group] = (tick + length_of(group), version)
        for group, (finish, started) in sorted(in_flight.items()):
            if finish > tick:
                continue
            del in_flight[group]
            tally.generated(group, tokens=length_of(group), samples=1)
            if mode == "pool":
                buffer.put(
                    BufferItem(
                        traj_id=group,
                        group_id=group,
                        num_samples=1,
                        step=started,
                        min_version=started,
                        freshness=1.0,
                        num_tokens=length_of(group),
                        payload=None,
                    )
                )
            else:
                finished[group] = started
        if training is None:
            if mode == "pool":
                drain()
                if buffer.stats().num_groups_ready >= groups_per_step:
                    training = [batch.group_id for batch in buffer.sample(groups_per_step)]
            else:
                step_groups = range(version * groups_per_step, (version + 1) * groups_per_step)
                if all(g in finished for g in step_groups):
                    training = list(step_groups)
            busy_until = tick + 3
        tick += 1
    return tally


def test_dropping_stale_groups_trains_shorter_answers_than_were_generated():
    lengths = simulate("pool").summary()
    assert lengths["generated"] > 3.5  # a third long: about (8 + 2 + 2) / 3
    assert lengths["evicted"] == LONG  # every group dropped for staleness was a long one
    assert lengths["trained"] < lengths["generated"] - 1


def test_window_admission_trains_what_was_generated():
    lengths = simulate("window").summary()
    assert lengths["evicted"] is None
    assert lengths["trained"] == pytest.approx(lengths["generated"]) == pytest.approx((LONG + 2 * SHORT) / 3)


def test_the_tally_per_step_and_over_the_run():
    tally = LengthTally(tracks_groups=True)
    tally.generated(0, tokens=12, samples=3)
    tally.generated(1, tokens=30, samples=3)
    tally.trained(tokens=12, samples=3)
    tally.evicted({"stale": [1], "reclaimed": []})
    means, counts = tally.step_record()
    assert means == {"generated": 7.0, "trained": 4.0, "evicted": 10.0}
    assert counts == {"generated": 6, "trained": 3, "evicted": 3}
    assert tally.step_record() == (
        {"generated": None, "trained": None, "evicted": None},
        {"generated": 0, "trained": 0, "evicted": 0},
    )
    assert tally.summary() == {"generated": 7.0, "trained": 4.0, "evicted": 10.0}
    tally.evicted({"stale": [2]})  # its TaskDone comes after the learner's GroupsLeft
    assert tally.step_record()[0]["evicted"] is None
    tally.generated(2, tokens=6, samples=3)
    assert tally.step_record()[0] == {"generated": 2.0, "trained": None, "evicted": 2.0}
    tally.forget([0, 1, 2])  # they left the buffer: nothing is kept for them
    assert tally.groups == {}
    assert LengthTally().groups == {} and not LengthTally().tracks_groups  # window mode keeps none
