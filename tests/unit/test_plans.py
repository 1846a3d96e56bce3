"""The learner's plans (asyncrl/learner/plans.py) decide the next unit purely from a StepState:
hand-built states, the unit each plan names."""

from __future__ import annotations

import types

from asyncrl.learner.plans import (
    CloseGroups,
    LockstepArrivals,
    LockstepGroups,
    StreamChunks,
    StreamGroups,
    StreamOne,
    TrainChunk,
    TrainGroups,
    WholeBatch,
    choose_plan,
)
from asyncrl.learner.state import StepState


class _Sums:
    """The part of `StreamingAccumulator` a plan reads: open groups and free slots."""

    def __init__(self, open_groups: set[int], free: int) -> None:
        self.open_groups, self.free_group_slots = open_groups, free

    def is_open(self, gid: int) -> bool:
        return gid in self.open_groups


def _sample(gid: int, i: int):
    return types.SimpleNamespace(traj_id=gid * 10 + i, group_id=gid, sample_index=i, group_size=0)


def _state(offers: list[tuple[int, int]], *, window_groups=None, acc=None) -> StepState:
    state = StepState(3, group_size=2, window_groups=window_groups, max_staleness=0, acc=acc)
    for gid, i in offers:
        state.offer(_sample(gid, i))
    return state


def test_streaming_closes_complete_groups_first_then_streams_the_first_that_may():
    state = _state([(0, 0), (1, 0), (1, 1)], acc=_Sums(set(), free=4))
    assert StreamGroups().next_unit(state) == CloseGroups([1])
    state.take_groups([1])
    assert StreamGroups().next_unit(state) == StreamOne(state.members[0][0])


def test_streaming_skips_deferred_trajectories_and_groups_without_buffers():
    state = _state([(0, 0), (1, 0)], acc=_Sums({1}, free=0))
    assert StreamGroups().next_unit(state) == StreamOne(state.members[1][0])  # group 0: no slot
    state.defer(state.members[1][0])
    assert StreamGroups().next_unit(state) is None


def test_the_optimal_baseline_streams_every_trajectory_complete_group_or_not():
    state = _state([(0, 0), (0, 1)], acc=_Sums(set(), free=1))
    assert StreamGroups(each=True).next_unit(state) == StreamOne(state.members[0][0])


def test_lockstep_takes_chunks_of_complete_groups_and_a_shorter_last_one():
    plan = LockstepGroups(chunk_groups=2)
    state = _state([(0, 0), (0, 1), (1, 0), (2, 0)], window_groups=3)
    assert plan.next_unit(state) is None  # one complete group, the window not in yet
    state.offer(_sample(2, 1))
    assert plan.next_unit(state) == TrainGroups([0, 2])  # in the order they completed
    state.mark_groups_trained(2)
    assert plan.next_unit(state) is None
    state.offer(_sample(1, 1))
    assert plan.next_unit(state) == TrainGroups([1])  # the window's last, shorter chunk


def test_distillation_plans_take_what_waits_in_offer_order():
    state = _state([(0, 0), (1, 0), (0, 1)], window_groups=2)
    # Streaming takes what waits, group by group; lockstep takes the offer order itself.
    assert StreamChunks(micro_batch_size=2).next_unit(state) == TrainChunk(state.members[0])
    assert LockstepArrivals(chunk_groups=1).next_unit(state) == TrainChunk(state.arrivals[:2])
    state.mark_arrivals_trained(2)
    assert LockstepArrivals(chunk_groups=1).next_unit(state) is None  # 1 of 2, window not in
    state.offer(_sample(1, 1))
    assert LockstepArrivals(chunk_groups=1).next_unit(state) == TrainChunk(state.arrivals[2:])


def test_whole_batch_names_no_unit_and_each_configuration_gets_its_plan():
    assert WholeBatch().next_unit(_state([(0, 0), (0, 1)])) is None
    common = dict(chunk_groups=1, micro_batch_size=4)
    assert isinstance(
        choose_plan(grouped=True, lockstep=False, whole_batch=True, each=False, **common), WholeBatch
    )
    assert choose_plan(grouped=True, lockstep=False, whole_batch=False, each=True, **common) == StreamGroups(
        each=True
    )
    assert isinstance(
        choose_plan(grouped=False, lockstep=False, whole_batch=False, each=False, **common), StreamChunks
    )
    assert isinstance(
        choose_plan(grouped=True, lockstep=True, whole_batch=False, each=False, **common), LockstepGroups
    )
    assert isinstance(
        choose_plan(grouped=False, lockstep=True, whole_batch=False, each=False, **common), LockstepArrivals
    )
