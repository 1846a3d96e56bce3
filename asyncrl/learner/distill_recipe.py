"""On-policy distillation inside a learner step (no sockets): the recipe of a `DistillationObjective`,
and the packed teacher arrays that the RL recipe's combined objective (`opd.reward`) reads too.

Place in the data flow: the `Trainer` picks `DistillationRecipe` (`recipes.make_recipe`) when
`opd.enabled` and `opd.reward = "off"`. Per-token teacher advantages need no group, so every
chunk of waiting trajectories trains as it comes, and the whole-batch path is the same loss over
the sorted step. Token selection and the distillation weight are the objective's
(`DistillationObjective.term`, `opd_mix.py`); what the step used of the teacher's scores is reported
in the step's stats (`DistillStats.report`).

Legend: B sequences, L packed length, N cached tokens per position.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

import torch

from asyncrl.learner.objective import DistillationObjective, DistillStats
from asyncrl.learner.step import TrainSample, pack, pack_opd
from asyncrl.learner.streaming import StreamingAccumulator

if TYPE_CHECKING:
    from asyncrl.learner.trainer import Trainer


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
    samples: Sequence[TrainSample], width: int, trainer: Trainer, gate_B: torch.Tensor | None = None
) -> OpdArrays:
    """`pack_opd` of `samples` in the trainer's dtype and on its device."""
    if any(s.teacher_logprobs is None for s in samples):
        raise ValueError("opd is enabled but a trajectory carries no teacher log-probs")
    teacher, ids, behav = (
        (x.to(trainer.dtype) if x.is_floating_point() else x).to(trainer.device)
        for x in pack_opd(samples, width)
    )
    return OpdArrays(teacher, ids, behav, None if gate_B is None else gate_B.to(trainer.device))


def candidate_logp(
    trainer: Trainer, ids_BL: torch.Tensor, opd: OpdArrays, lengths_B: torch.Tensor | None = None
) -> torch.Tensor:
    """The student's log-probs of the cached ids [B, L, N] (column 0: the sampled tokens)."""
    return trainer.actor(
        ids_BL.to(trainer.device),
        temperature=trainer.temperature,
        candidates_BLN=opd.ids_BLN,
        lengths_B=lengths_B,
    )


def distill_term(
    objective: DistillationObjective, logp_BLN: torch.Tensor, opd: OpdArrays, mask_BL: torch.Tensor
) -> tuple[torch.Tensor, DistillStats]:
    return objective.term(logp_BLN, opd.teacher_BLN, opd.behav_BLN, opd.ids_BLN, mask_BL, opd.gate_B)


class DistillationRecipe:
    # No group buffers: every trajectory's gradient is complete on its own.
    acc: StreamingAccumulator | None = None

    def __init__(self, trainer: Trainer) -> None:
        assert isinstance(trainer.objective, DistillationObjective)
        self.trainer = trainer
        self.objective: DistillationObjective = trainer.objective

    def begin_step(self) -> None:
        self.trained = 0  # lockstep: trajectories trained so far, in offer order

    def end_step(self) -> None:
        pass

    def has_work(self) -> bool:
        t = self.trainer
        if t.fallback:
            return False
        if t.lockstep:
            return self._next_chunk() is not None
        return any(t.waiting.values())

    def _next_chunk(self) -> list[TrainSample] | None:
        """Lockstep: the next `chunk_groups` x group_size trajectories in offer order (the step's
        last chunk may be shorter): the same on every rank."""
        t = self.trainer
        ready = t.arrivals[self.trained :]
        size = t.chunk_groups * t.group_size
        if len(ready) >= size:
            return ready[:size]
        if ready and (t.window_groups is None or len(t.arrivals) >= t.window_groups * t.group_size):
            return ready
        return None

    def work(self) -> bool:
        t = self.trainer
        assert not t.fallback, "work() is for streaming steps; use batch_backward"
        if t.lockstep:
            chunk = self._next_chunk() or []
            self.trained += len(chunk)
        else:
            chunk = [s for w in t.waiting.values() for s in w][: t.micro_batch_size]
        if not chunk:
            return False
        for s in chunk:
            t.waiting[s.group_id].remove(s)
        self._backward_parts(t.share(chunk))
        return True

    def batch_backward(self, samples: Sequence[TrainSample]) -> None:
        t = self.trainer
        mine = t.share(samples)
        self._backward_parts(mine)
        if t.epochs > 1:
            t.epoch_plans.append(functools.partial(self._backward_parts, mine, account=False))

    def _backward_parts(self, samples: Sequence[TrainSample], *, account: bool = True) -> None:
        """A later epoch (`account=False`) runs the same loss under the updated model: the
        per-token advantage log pi_T - sg(log pi) (and the token selection) is recomputed under
        the student; the step counted these samples and their loss already."""
        t = self.trainer
        for part in t.microbatches(samples):
            if part is None:
                t.dummy_backward()
            else:
                t.backward_pieces([samples[i] for i in part], functools.partial(self._loss, account=account))

    def _loss(self, samples: Sequence[TrainSample], *, account: bool = True):
        """OPD loss of these trajectories and what accounts for it (`Trainer.backward_pieces`)."""
        t = self.trainer
        batch = pack(samples, pad_token_id=t.pad_token_id, require_complete=False).to(t.device)
        opd = opd_arrays(samples, batch.input_ids_BL.shape[1], t)
        mask = batch.completion_mask_BL
        logp_BLN = candidate_logp(t, batch.input_ids_BL, opd, batch.lengths_B)
        loss, stats = distill_term(self.objective, logp_BLN, opd, mask)

        def accounted() -> None:
            if not account:
                return
            tokens = float(mask.sum())
            t.totals.loss += stats.loss
            t.totals.add_distill(stats)
            t.totals.units += self.objective.units(mask)
            t.account(batch, samples, {}, tokens=tokens, clipped=0.0)

        return loss, accounted
