"""The units of an on-policy distillation step (no sockets), and the packed teacher arrays that
the RL work's combined objective (`opd.reward`) reads too.

Place in the data flow: the `Trainer` builds `DistillWork` when `opd.enabled` and
`opd.reward = "off"`. Per-token teacher advantages need no group, so the plan (`plans.py`) names
`TrainChunk` units as trajectories come, and the whole-batch path is the same loss over the
sorted step. Token selection and the distillation weight are the objective's
(`DistillationObjective.term`, `opd_mix.py`); what the step used of the teacher's scores is
reported in the step's stats (`DistillStats.report`).

The teacher's cache of a position is the N ids the student drew (column 0 the sampled token) and,
with opd.teacher_top_k = K > 0, the teacher's top-K ids after them: the union cache [B, L, N + K],
scored by the student in one forward. Which columns each estimator reads (`estimator_columns`):
reverse_kl and mc_reverse_kl the N draws only (Monte Carlo over draws from the student: the
teacher's ids are not draws, so adding them would bias the estimate); forward_kl every distinct id
of the union (the forward KL restricted to the union: exact at K = V); topk_forward_kl the K
teacher ids only (`opd.topk_forward_kl`). The weights of `opd_control.DistillControl` (horizon,
position, teachability, freshness) multiply each position's term; learner.kl_coef with pure
distillation adds kl_coef x the KL to the initial model (`learner/kl.py`) at the sampled tokens.
With opd.teachers, the step's KL estimate is also reported per teacher and per domain
(`kl_by_teacher`, `KlByTeacher`: stats `opd_kl/teacher/<name>`, `opd_kl/domain/<d>`).

Legend: B sequences, L packed length, N cached tokens per position, K teacher top-K ids.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

import torch

from asyncrl.learner.kl import kl_loss
from asyncrl.learner.objective import DistillationObjective, DistillStats
from asyncrl.learner.opd import topk_forward_kl
from asyncrl.learner.opd_control import DistillControl
from asyncrl.learner.opd_mix import select_tokens, selection_scores
from asyncrl.learner.plans import TrainChunk, Unit
from asyncrl.learner.state import StepState
from asyncrl.learner.step import TrainSample, pack_opd
from asyncrl.learner.streaming import StreamingAccumulator

if TYPE_CHECKING:
    from asyncrl.learner.engine import Engine


class OpdArrays(NamedTuple):
    """The teacher's cache of a packed batch, aligned with its rows ([B, L, N + K]: the student's N
    draws, then the teacher's top-K), on the learner's device, each trajectory's distillation gate
    (None: all 1), the number N of drawn columns (None: every column), and the run's control."""

    teacher_BLN: torch.Tensor
    ids_BLN: torch.Tensor
    behav_BLN: torch.Tensor
    gate_B: torch.Tensor | None = None
    num_sampled: int | None = None
    control: DistillControl | None = None

    def rows(self, sl: torch.Tensor, width: int) -> OpdArrays:
        """Rows `sl`, cut at `width` columns (a micro-batch of a whole-batch step)."""
        return OpdArrays(
            self.teacher_BLN[sl, :width],
            self.ids_BLN[sl, :width],
            self.behav_BLN[sl, :width],
            None if self.gate_B is None else self.gate_B[sl],
            self.num_sampled,
            self.control,
        )


def opd_arrays(
    samples: Sequence[TrainSample], width: int, engine: Engine, gate_B: torch.Tensor | None = None
) -> OpdArrays:
    """`pack_opd` of `samples` in the engine's dtype and on its device, with the engine's
    `DistillControl` (`opd_control.install`; None: none installed)."""
    if any(s.teacher_logprobs is None for s in samples):
        raise ValueError("opd is enabled but a trajectory carries no teacher log-probs")
    tops = {None if s.teacher_top_ids is None else int(s.teacher_top_ids.shape[1]) for s in samples}
    if len(tops) > 1:
        raise ValueError(
            f"trajectories with different teacher top-K widths in one batch: {sorted(map(str, tops))}"
        )
    teacher, ids, behav = (
        (x.to(engine.dtype) if x.is_floating_point() else x).to(engine.device)
        for x in pack_opd(samples, width)
    )
    gate = None if gate_B is None else gate_B.to(engine.device)
    return OpdArrays(
        teacher, ids, behav, gate, int(samples[0].opd_ids.shape[1]), getattr(engine, "opd_control", None)
    )


def estimator_columns(estimator: str, num_sampled: int, width: int) -> slice:
    """The union cache's columns `estimator` reads (module docstring)."""
    if estimator in ("reverse_kl", "mc_reverse_kl"):
        return slice(0, num_sampled)
    if estimator == "topk_forward_kl":
        if width == num_sampled:
            raise ValueError(
                "opd.estimator = 'topk_forward_kl' needs the teacher's top-K (opd.teacher_top_k > 0)"
            )
        return slice(num_sampled, width)
    return slice(0, width)


def distill_term(
    objective: DistillationObjective, logp_BLN: torch.Tensor, opd: OpdArrays, mask_BL: torch.Tensor
) -> tuple[torch.Tensor, DistillStats]:
    """kl_weight x the configured estimator on the selected, gated and control-weighted positions.
    Without top-K columns or control weights it is `DistillationObjective.term` itself."""
    width = opd.ids_BLN.shape[-1]
    num = width if opd.num_sampled is None else opd.num_sampled
    control = opd.control
    if num == width and (control is None or not control.weighs):
        return objective.term(logp_BLN, opd.teacher_BLN, opd.behav_BLN, opd.ids_BLN, mask_BL, opd.gate_B)
    if objective.select == "all":
        selected_BL = mask_BL
    else:  # scores read the student's own draws, as without top-K
        score_BL = selection_scores(
            logp_BLN[..., :num], opd.teacher_BLN[..., :num], mask_BL, select=objective.select
        )
        selected_BL = select_tokens(score_BL, mask_BL, fraction=objective.select_fraction)
    weight_BL = selected_BL.to(logp_BLN.dtype)
    if opd.gate_B is not None:
        weight_BL = weight_BL * opd.gate_B.to(logp_BLN.dtype)[:, None]
    scored_BL = opd.teacher_BLN.isfinite().all(dim=-1)  # NaN rows: past the generator's horizon
    if control is not None and control.weighs:
        weight_BL = weight_BL * control.weights(
            mask_BL,
            logp_BT=logp_BLN[..., 0],
            behav_BT=opd.behav_BLN[..., 0],
            logp_top_BTK=logp_BLN[..., num:],
        ).to(logp_BLN.dtype)
    weight_BL = torch.where(scored_BL, weight_BL, 0.0)
    used_BL = mask_BL & (weight_BL > 0)
    if control is not None:
        teacher_0 = torch.where(scored_BL, opd.teacher_BLN[..., 0], 0.0)
        control.observe(mask_BL, used_BL, scored_BL, logp_BLN[..., 0].detach() - teacher_0)
    cols = estimator_columns(objective.estimator, num, width)
    teacher_BLN = opd.teacher_BLN[..., cols]
    teacher_BLN = torch.where(used_BL[..., None] | teacher_BLN.isfinite(), teacher_BLN, 0.0)
    if objective.estimator == "topk_forward_kl":
        loss, stats = topk_forward_kl(
            logp_BLN[..., cols], teacher_BLN, mask_BL, weight_BL, mode=objective.agg, **UNNORMALISED
        )
        kl = float(stats.kl)
    else:
        loss, kl = objective.loss(
            logp_BLN[..., 0],
            logp_BLN[..., cols],
            teacher_BLN,
            opd.behav_BLN[..., cols],
            opd.ids_BLN[..., cols],
            mask_BL,
            weight_BL,
        )
    if not bool(scored_BL[mask_BL].all()):  # the KL estimate over the tokens the teacher scored
        kl = _scored_kl(objective, logp_BLN.detach(), opd, cols, mask_BL & scored_BL)
    loss = objective.kl_weight * loss
    return loss, DistillStats(
        loss=float(loss.detach()),
        kl=kl,
        num_tokens=float(mask_BL.sum()),
        num_selected=float(selected_BL.sum()),
        num_distilled=float(used_BL.sum()),
    )


def _scored_kl(objective: DistillationObjective, logp_BLN, opd: OpdArrays, cols: slice, mask_BL) -> float:
    """The estimator's KL estimate over `mask_BL` only (positions past a horizon have no teacher
    score to estimate it from)."""
    teacher_BLN = torch.where(mask_BL[..., None], opd.teacher_BLN[..., cols], 0.0)
    if objective.estimator == "topk_forward_kl":
        return float(topk_forward_kl(logp_BLN[..., cols], teacher_BLN, mask_BL, **UNNORMALISED)[1].kl)
    args = (logp_BLN[..., cols], teacher_BLN, opd.behav_BLN[..., cols], opd.ids_BLN[..., cols], mask_BL)
    return objective.loss(logp_BLN[..., 0], *args)[1]


def kl_by_teacher(
    objective: DistillationObjective,
    logp_BLN: torch.Tensor,
    opd: OpdArrays,
    mask_BL: torch.Tensor,
    teacher_ids: Sequence[str],
) -> dict[str, tuple[float, float]]:
    """(KL estimate x tokens, tokens) per teacher id ("" excluded: the one teacher of opd.teacher):
    the estimator's KL estimate over the valid, teacher-scored positions of that teacher's rows,
    `opd_kl`'s definition on those rows only, so the token-weighted mean over teachers is the
    step's `opd_kl` wherever every trajectory names its teacher."""
    names = sorted(set(teacher_ids) - {""})
    if not names:
        return {}
    width = opd.ids_BLN.shape[-1]
    cols = estimator_columns(
        objective.estimator, width if opd.num_sampled is None else opd.num_sampled, width
    )
    scored_BL = mask_BL & opd.teacher_BLN.isfinite().all(dim=-1)
    logp_BLN = logp_BLN.detach()
    out = {}
    for name in names:
        rows_B = torch.tensor([t == name for t in teacher_ids], device=mask_BL.device)
        mine_BL = scored_BL & rows_B[:, None]
        tokens = float(mine_BL.sum())
        if tokens > 0:
            out[name] = (_scored_kl(objective, logp_BLN, opd, cols, mine_BL) * tokens, tokens)
    return out


class KlByTeacher:
    """The learner's distillation KL per teacher and per domain over a step (`kl_by_teacher`'s
    sums): `opd_kl/teacher/<name>`, and `opd_kl/domain/<d>` for a teacher of exactly one domain
    (opd.teachers' `domains`; run a domain's own teacher entry, even one sharing another's path,
    to have its figure)."""

    def __init__(self, domains: dict[str, str] | None = None) -> None:
        self.domains = dict(domains or {})  # teacher name -> its one domain
        self.sums: dict[str, tuple[float, float]] = {}

    @classmethod
    def from_config(cls, config) -> KlByTeacher:
        return cls({t.name: t.domains[0] for t in config.opd.teachers if len(t.domains) == 1})

    def add(self, sums: dict[str, tuple[float, float]]) -> None:
        for name, (kl, tokens) in sums.items():
            old = self.sums.get(name, (0.0, 0.0))
            self.sums[name] = (old[0] + kl, old[1] + tokens)

    def report(self) -> dict[str, float]:
        """The step's means, and forget them for the next step."""
        out = {}
        for name, (kl, tokens) in sorted(self.sums.items()):
            out[f"opd_kl/teacher/{name}"] = kl / tokens
            if name in self.domains:
                out[f"opd_kl/domain/{self.domains[name]}"] = kl / tokens
        self.sums = {}
        return out


# An objective's terms are unnormalised sums: the trainer divides by the step's Z once.
UNNORMALISED = dict(num_tokens_global=1.0, num_seqs_global=1.0, norm_constant=1.0)


class DistillWork:
    def __init__(self, engine: Engine, objective: DistillationObjective) -> None:
        self.engine = engine
        self.objective = objective
        self.control: DistillControl | None = None
        # learner.kl_coef with pure distillation (StableOPD): the initial model, for the KL term.
        self.reference = None
        self._kl_ref = (0.0, 0.0)  # the step's token-weighted sum of the reference KL, and its tokens
        self.by_teacher = KlByTeacher()  # opd.teachers: the KL per teacher and domain
        self.attach(getattr(engine, "opd_control", None))

    def attach(self, control: DistillControl | None) -> None:
        """The run's control (`install_control`), and the reference model its KL term needs."""
        self.control = control
        if control is not None and control.kl_coef > 0 and self.reference is None:
            self.reference = reference_copy(self.engine)

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
        """Before the update: the step's horizon goes into its stats, and the control sets the next
        step's from this step's KL estimate over the distilled tokens."""
        if self._kl_ref[1] > 0:
            state.set_stat("opd_kl_ref", self._kl_ref[0] / self._kl_ref[1] * state.totals.stats_tokens)
        self._kl_ref = (0.0, 0.0)
        for name, value in self.by_teacher.report().items():
            state.set_stat(name, value * state.totals.stats_tokens)
        if self.control is None:
            return
        report = self.control.end_step()
        if self.control.horizon:
            for name, value in report.items():
                state.set_stat(name, value * state.totals.stats_tokens)

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
        if self.control is not None:
            self.control.begin_step(state.step)
        batch = e.pack(samples)
        opd = opd_arrays(samples, batch.input_ids_BL.shape[1], e)
        mask = batch.completion_mask_BL
        logp_BLN = e.candidate_logp(batch.input_ids_BL, opd.ids_BLN, batch.lengths_B)
        loss, stats = distill_term(self.objective, logp_BLN, opd, mask)
        by_teacher = kl_by_teacher(self.objective, logp_BLN, opd, mask, [s.teacher_id for s in samples])
        kl_ref = None
        if self.reference is not None:
            kl_part, kl_ref = self._reference_kl(batch, logp_BLN[..., 0], mask)
            loss = loss + kl_part
            stats = stats._replace(loss=stats.loss + float(kl_part.detach()))

        def accounted() -> None:
            if not account:
                return
            if kl_ref is not None:
                tokens = float(mask.sum())
                self._kl_ref = (self._kl_ref[0] + kl_ref * tokens, self._kl_ref[1] + tokens)
            self.by_teacher.add(by_teacher)
            state.add_loss(stats.loss)
            state.add_distill(stats)
            state.add_units(self.objective.units(mask))
            state.account(batch, samples, {}, tokens=float(mask.sum()), clipped=0.0)

        return loss, accounted

    def _reference_kl(
        self, batch, logp_BL: torch.Tensor, mask_BL: torch.Tensor
    ) -> tuple[torch.Tensor, float]:
        """kl_coef x the KL to the initial model at the sampled tokens (learner.kl_estimator,
        unnormalised like every term), and its mean estimate."""
        control = self.control
        assert control is not None and self.reference is not None
        with torch.no_grad():
            logp_ref_BL = self.engine.logp(self.reference, batch.input_ids_BL, batch.lengths_B)
        loss, stats = kl_loss(
            logp_BL,
            logp_ref_BL,
            mask_BL,
            estimator=control.kl_estimator,
            mode=self.objective.agg,
            **UNNORMALISED,
        )
        return control.kl_coef * loss, float(stats.kl)


def install_control(trainer, config) -> DistillControl | None:
    """The run's `DistillControl` on the trainer's engine (every `opd_arrays` reads it) and its
    distillation work, when opd.enabled (`loop.build_trainer`, before the first step); the work's
    teacher -> domain map for the KL per domain (`KlByTeacher.from_config`)."""
    control = DistillControl.from_config(config) if config.opd.enabled else None
    trainer.engine.opd_control = control
    if isinstance(trainer.runner, DistillWork):
        trainer.runner.attach(control)
        trainer.runner.by_teacher = KlByTeacher.from_config(config)
    return control


def reference_copy(engine: Engine) -> torch.nn.Module:
    """A frozen copy of the policy as it starts (sharded like it on lockstep ranks)."""
    if engine.lockstep:
        from asyncrl.learner.parallel import sharded_copy

        return sharded_copy(engine.actor)
    return copy.deepcopy(engine.actor).eval().requires_grad_(False)
