"""How a learner step turns offered trajectories into units of work (pure decisions).

Place in the data flow: the `Trainer` chooses one plan when it is built (`choose_plan`), from the
objective and the ranks, and never asks again which it has. Whenever the step's loop asks for
work, the plan reads the step's `StepState` and names the next unit (or None: nothing can be done
until more trajectories arrive); the objective's work (`rl_work.py`, `distill_work.py`) runs it.
A plan never changes the state; running a unit does, through the state's methods.

The plans:

    plan              when                                  units
    StreamGroups      RL on one plain rank                  CloseGroups (complete groups with
                                                            waiting members), else StreamOne
    StreamGroups      ... with the optimal baseline         StreamOne for every trajectory
      (each=True)     (staleness.vcpo_baseline = opob*)
    StreamChunks      distillation on one plain rank        TrainChunk (waiting ones, one micro-batch)
    LockstepGroups    RL on lockstep ranks                  TrainGroups (the next chunk of complete
                                                            groups, in completion order)
    LockstepArrivals  distillation on lockstep ranks        TrainChunk (the next chunk, offer order)
    WholeBatch        the objective cannot stream           none: the step trains its whole window
                      (`Objective.fallback_reason`)         at once (`whole_batch`)

Lockstep plans decide from the offered sequence alone, which every rank sees the same, so every
rank trains the same chunks in the same order and FSDP2's collectives pair up.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Protocol

from asyncrl.learner.state import StepState
from asyncrl.learner.step import TrainSample


class StreamOne(NamedTuple):
    """One trajectory's forward and backward into its group's sums (RL streaming)."""

    sample: TrainSample


class CloseGroups(NamedTuple):
    """Complete groups: their waiting members train with known advantages, the streamed fold."""

    gids: list[int]


class TrainGroups(NamedTuple):
    """Lockstep: this rank's share of complete groups, with known advantages."""

    gids: list[int]


class TrainChunk(NamedTuple):
    """Trajectories whose gradient is complete on its own (distillation), this rank's share."""

    samples: list[TrainSample]


Unit = StreamOne | CloseGroups | TrainGroups | TrainChunk


class StepPlan(Protocol):
    # True: nothing streams; the step trains once, when its whole window is in.
    whole_batch: bool

    def next_unit(self, state: StepState) -> Unit | None:
        """The next unit of work the step can do now; None until more trajectories arrive."""
        ...


@dataclass(frozen=True)
class StreamGroups:
    """RL on one plain rank: a trajectory streams on arrival into its group's S0/S1 sums
    (`StreamingAccumulator`); a complete group's waiting members (those whose clip made them
    wait) train together with known advantages. With `each` (the optimal baseline) every
    trajectory streams on its own, complete group or not."""

    each: bool = False
    whole_batch: bool = False

    def next_unit(self, state: StepState) -> Unit | None:
        if not self.each and (closable := state.closable()):
            return CloseGroups(closable)
        for gid, waiting in state.waiting.items():
            if not _can_open(state, gid):
                continue  # back-pressure: no S0/S1 buffers for another group now
            for sample in waiting:
                if sample.traj_id not in state.deferred:
                    return StreamOne(sample)
        return None


def _can_open(state: StepState, gid: int) -> bool:
    return state.acc.is_open(gid) or state.acc.free_group_slots != 0


@dataclass(frozen=True)
class StreamChunks:
    """Distillation on one plain rank: every trajectory's gradient is complete on its own, so
    waiting trajectories train as they come, a micro-batch at a time."""

    micro_batch_size: int
    whole_batch: bool = False

    def next_unit(self, state: StepState) -> Unit | None:
        chunk = [s for w in state.waiting.values() for s in w][: self.micro_batch_size]
        return TrainChunk(chunk) if chunk else None


@dataclass(frozen=True)
class LockstepGroups:
    """RL on lockstep ranks: the next `chunk_groups` complete groups in completion order (the
    step's last chunk may be shorter, once the window is complete)."""

    chunk_groups: int
    whole_batch: bool = False

    def next_unit(self, state: StepState) -> Unit | None:
        ready = state.completed[state.trained_groups :]
        if len(ready) >= self.chunk_groups:
            return TrainGroups(ready[: self.chunk_groups])
        whole_window = state.window_groups is None or len(state.completed) >= state.window_groups
        return TrainGroups(ready) if ready and whole_window else None


@dataclass(frozen=True)
class LockstepArrivals:
    """Distillation on lockstep ranks: the next `chunk_groups` x group_size trajectories in
    offer order (the step's last chunk may be shorter)."""

    chunk_groups: int
    whole_batch: bool = False

    def next_unit(self, state: StepState) -> Unit | None:
        size = self.chunk_groups * state.group_size
        ready = state.arrivals[state.trained_arrivals :]
        if len(ready) >= size:
            return TrainChunk(ready[:size])
        whole_window = (
            state.window_groups is None or len(state.arrivals) >= state.window_groups * state.group_size
        )
        return TrainChunk(list(ready)) if ready and whole_window else None


@dataclass(frozen=True)
class WholeBatch:
    """The objective cannot stream: the step trains its whole window at once."""

    whole_batch: bool = True

    def next_unit(self, state: StepState) -> Unit | None:
        return None


def choose_plan(
    *, grouped: bool, lockstep: bool, whole_batch: bool, each: bool, chunk_groups: int, micro_batch_size: int
) -> StepPlan:
    """The plan of a learner, chosen once. `grouped`: the objective's advantages need the group
    (RL), not only the trajectory (distillation); `whole_batch`: the objective cannot stream
    (`Objective.fallback_reason`); `each`: every trajectory streams alone (the optimal baseline)."""
    if whole_batch:
        return WholeBatch()
    if lockstep:
        return LockstepGroups(chunk_groups) if grouped else LockstepArrivals(chunk_groups)
    return StreamGroups(each=each) if grouped else StreamChunks(micro_batch_size)
