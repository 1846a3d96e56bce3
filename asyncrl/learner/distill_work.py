"""The units of an on-policy distillation step (no sockets), and the packed teacher arrays that
the RL work's combined objective (`opd.reward`) reads too.

Place in the data flow: the `Trainer` builds `DistillWork` when `opd.enabled` and
`opd.reward = "off"`. Per-token teacher advantages need no group, so the plan (`plans.py`) names
`TrainChunk` units as trajectories come, and the whole-batch path is the same loss over the
sorted step. Token selection and the distillation weight are the objective's
(`DistillationObjective.term`, `opd_mix.py`); what the step used of the teacher's scores is
reported in the step's stats (`DistillStats.report`).

Legend: B sequences, L packed length, N cached tokens per position.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

import torch

from asyncrl.learner.objective import DistillationObjective, DistillStats
from asyncrl.learner.plans import TrainChunk, Unit
from asyncrl.learner.state import StepState
from asyncrl.learner.step import TrainSample, pack_opd
from asyncrl.learner.streaming import StreamingAccumulator

if TYPE_CHECKING:
    from asyncrl.learner.engine import Engine


class OpdArrays(NamedTuple):
    """The teacher's cache of a packed batch, aligned with its rows ([B, L, N]), on the learner's
    device, and each trajectory's distillation gate (None: all 1)."""

    teacher_BLN: torch.Tensor
    ids_BLN: torch.Tensor
    behav_BLN: torch.Tensor
    gate_B: torch.Tensor | None = None

    def rows(self, sl: torch.Tensor, width: int) -> OpdArrays:
        """Rows `sl`, cut at `width` columns (a micro-batch of a whole-batch step)."""
        return OpdArrays(
            self.teacher_BLN[sl, :width],
            self.ids_BLN[sl, :width],
            self.behav_BLN[sl, :width],
            None if self.gate_B is None else self.gate_B[sl],
        )


def opd_arrays(
    samples: Sequence[TrainSample], width: int, engine: Engine, gate_B: torch.Tensor | None = None
) -> OpdArrays:
    """`pack_opd` of `samples` in the engine's dtype and on its device."""
    if any(s.teacher_logprobs is None for s in samples):
        raise ValueError("opd is enabled but a trajectory carries no teacher log-probs")
    teacher, ids, behav = (
        (x.to(engine.dtype) if x.is_floating_point() else x).to(engine.device)
        for x in pack_opd(samples, width)
    )
    return OpdArrays(teacher, ids, behav, None if gate_B is None else gate_B.to(engine.device))


def distill_term(
    objective: DistillationObjective, logp_BLN: torch.Tensor, opd: OpdArrays, mask_BL: torch.Tensor
) -> tuple[torch.Tensor, DistillStats]:
    return objective.term(logp_BLN, opd.teacher_BLN, opd.behav_BLN, opd.ids_BLN, mask_BL, opd.gate_B)


class DistillWork:
    def __init__(self, engine: Engine, objective: DistillationObjective) -> None:
        self.engine = engine
        self.objective = objective

    def accumulator(self, group_size: int) -> StreamingAccumulator | None:
        return None  # no group buffers: every trajectory's gradient is complete on its own

    def run(self, unit: Unit, state: StepState) -> None:
        match unit:
            case TrainChunk(chunk):
                state.take(chunk)
                state.mark_arrivals_trained(len(chunk))
                self._backward_parts(state, self.engine.share(chunk))
            case _:
                raise TypeError(f"distillation work has no unit {type(unit).__name__}")

    def end(self, state: StepState) -> None:
        """Before the update: nothing needs the whole step."""

    def whole(self, state: StepState, samples: Sequence[TrainSample]) -> None:
        mine = self.engine.share(samples)
        self._backward_parts(state, mine)
        if self.objective.epochs > 1:
            state.add_rerun(functools.partial(self._backward_parts, state, mine, account=False))

    def _backward_parts(
        self, state: StepState, samples: Sequence[TrainSample], *, account: bool = True
    ) -> None:
        """A later epoch (`account=False`) runs the same loss under the updated model: the
        per-token advantage log pi_T - sg(log pi) (and the token selection) is recomputed under
        the student; the step counted these samples and their loss already."""
        e = self.engine
        for part in e.microbatches(samples):
            if part is None:
                e.dummy_backward()
            else:
                e.backward_pieces(
                    [samples[i] for i in part], functools.partial(self._loss, state, account=account)
                )

    def _loss(self, state: StepState, samples: Sequence[TrainSample], *, account: bool = True):
        """OPD loss of these trajectories and what accounts for it (`Engine.backward_pieces`)."""
        e = self.engine
        batch = e.pack(samples)
        opd = opd_arrays(samples, batch.input_ids_BL.shape[1], e)
        mask = batch.completion_mask_BL
        logp_BLN = e.candidate_logp(batch.input_ids_BL, opd.ids_BLN, batch.lengths_B)
        loss, stats = distill_term(self.objective, logp_BLN, opd, mask)

        def accounted() -> None:
            if not account:
                return
            state.add_loss(stats.loss)
            state.add_distill(stats)
            state.add_units(self.objective.units(mask))
            state.account(batch, samples, {}, tokens=float(mask.sum()), clipped=0.0)

        return loss, accounted
