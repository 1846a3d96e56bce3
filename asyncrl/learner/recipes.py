"""What RL and on-policy distillation do differently inside a learner step (no sockets).

Place in the data flow: the `Trainer` (`trainer.py`) picks one recipe when it is built, from the
kind of its `Objective` (`objective.py`), and calls only the `Recipe` interface: start a step,
say whether there is streaming work, do one unit of it, or train the whole step at once. The
trainer keeps what both share: the model and optimizer, the step's offered trajectories, the
staleness policy's inputs, accounting, and the update itself (`finish_step`).

* `RLRecipe`: group advantages and staleness corrections. A trajectory streams on arrival into its
  group's S0/S1 sums (`StreamingAccumulator`) when its gradient is linear in its advantage;
  otherwise it waits for its group, whose waiting members then train in one backward with known
  advantages. The whole-batch path also carries the optional KL term to the initial model.
  With a `CombinedObjective` (`opd.reward`) every forward is the distillation forward over the
  cached ids (column 0 gives the RL part's log-probs) and each loss adds the trajectory's
  distillation term; a streamed trajectory's term goes straight into `.grad` (the step's sum),
  its RL part into the group sums. With the off-policy optimal baseline (`RLObjective.opob`)
  every trajectory streams on its own, complete group or not, and the lr scale of a policy whose
  only batch-global part it is (VCPO's ESS) is taken over the step's log-probs in `end_step`.
* `DistillationRecipe` (`distill_recipe.py`): per-token teacher advantages need no group, so every
  chunk of waiting trajectories trains as it comes, and the whole-batch path is the same loss over
  the sorted step.

A later epoch (`learner.epochs` > 1) re-runs what the recipe appended to `Trainer.epoch_plans`.

Legend: B sequences, L packed length, N samples per group (RL) or cached tokens per position (OPD),
P flattened parameters.
"""

from __future__ import annotations

import copy
import functools
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple, Protocol

import torch

from asyncrl.learner.advantages import group_rewards
from asyncrl.learner.distill_recipe import (
    DistillationRecipe,
    OpdArrays,
    candidate_logp,
    distill_term,
    opd_arrays,
)
from asyncrl.learner.objective import CombinedObjective, DistillationObjective, DistillStats, RLObjective
from asyncrl.learner.opob import baseline_scale, folded_loss, opob_step_lr_scale
from asyncrl.learner.step import TrainSample, pack
from asyncrl.learner.streaming import StreamingAccumulator
from asyncrl.staleness.base import Correction

if TYPE_CHECKING:
    from asyncrl.learner.trainer import Trainer


class Recipe(Protocol):
    """The part of a learner step that depends on the objective's kind."""

    # The step's group S0/S1 buffers while it streams grouped trajectories; None otherwise.
    acc: StreamingAccumulator | None

    def begin_step(self) -> None: ...

    def end_step(self) -> None:
        """Before the update: whatever needs the whole step (the OPOB path's learning-rate scale)."""
        ...

    def has_work(self) -> bool:
        """Streaming work that can be done now."""
        ...

    def work(self) -> bool:
        """One unit of streaming work; False if there is nothing to do until more data arrives."""
        ...

    def batch_backward(self, samples: Sequence[TrainSample]) -> None:
        """The whole step at once, `samples` in trajectory-id order; gradients into `.grad`."""
        ...


def make_recipe(trainer: Trainer) -> Recipe:
    """The recipe of the trainer's objective (chosen once, when the trainer is built)."""
    if isinstance(trainer.objective, DistillationObjective):
        return DistillationRecipe(trainer)
    return RLRecipe(trainer)


class RLRecipe:
    def __init__(self, trainer: Trainer) -> None:
        assert isinstance(trainer.objective, RLObjective)
        self.trainer = trainer
        self.objective: RLObjective = trainer.objective
        self.reference = None
        if self.objective.uses_reference:
            self.reference = copy.deepcopy(trainer.actor).eval().requires_grad_(False)
        self.acc: StreamingAccumulator | None = None
        # The distillation part of a combined objective (opd.reward), None for RL alone.
        self.distill: CombinedObjective | None = (
            self.objective if isinstance(self.objective, CombinedObjective) else None
        )
        self.opob = self.objective.opob
        if self.opob and trainer.lockstep:
            raise ValueError(
                "staleness.vcpo_baseline = 'opob' takes one backward per trajectory on one plain float32 "
                "rank; lockstep ranks (learner.world_size > 1, fsdp or mixed precision) train complete groups"
            )

    def begin_step(self) -> None:
        t = self.trainer
        self.deferred: set[int] = set()  # traj ids that tried to stream and could not
        # gid -> (slot, l(+1), reward) of its streamed members, valued once the group's advantages are known
        self.streamed_loss: dict[int, list[tuple[int, float, float]]] = defaultdict(list)
        self.acc = None
        self.trained_groups = 0  # lockstep: complete groups trained so far (t.completed order)
        self.opob_logp: list[tuple[TrainSample, torch.Tensor]] = []  # OPOB: step-start log-probs
        if self.opob or (not t.fallback and not t.lockstep):
            self.acc = StreamingAccumulator(
                t.params,
                estimator=self.objective.stream_estimator,
                agg=self.objective.agg,
                group_size=t.group_size,
                drop_degenerate_groups=self.objective.drop_degenerate_groups,
                max_open_groups=t.max_open_groups,
                norm_constant=1.0,
                dtype=t.dtype,
                baseline="opob" if self.opob else "mean",
            )

    def end_step(self) -> None:
        if self.opob:
            opob_step_lr_scale(self.trainer, self.opob_logp)

    # ------------------------------------------------------------------ streaming
    def has_work(self) -> bool:
        if self.trainer.lockstep:
            return not self.trainer.fallback and self._next_chunk() is not None
        if self.acc is None:
            return False
        if self.opob:  # every trajectory streams on its own, complete group or not
            return any(self._streamable_now(gid) for gid in self.trainer.waiting)
        return any(self._streamable_now(gid) for gid in self.trainer.waiting) or bool(self._closable())

    def _next_chunk(self) -> list[int] | None:
        """Lockstep: the next `chunk_groups` complete groups, in completion order (the step's
        last chunk may be shorter). Decided by the offered sequence alone, which every rank sees
        the same, so every rank trains the same chunks in the same order."""
        t = self.trainer
        ready = t.completed[self.trained_groups :]
        if not ready:
            return None
        if len(ready) >= t.chunk_groups:
            return ready[: t.chunk_groups]
        if t.window_groups is None or len(t.completed) >= t.window_groups:
            return ready
        return None

    def _closable(self) -> list[int]:
        t = self.trainer
        return [g for g, w in t.waiting.items() if w and len(t.members[g]) == t.group_size]

    def _streamable_now(self, gid: int) -> bool:
        if not self.acc.is_open(gid) and self.acc.free_group_slots == 0:
            return False  # back-pressure: no S0/S1 buffers for another group now
        return any(s.traj_id not in self.deferred for s in self.trainer.waiting[gid])

    def work(self) -> bool:
        if self.trainer.lockstep:
            chunk = self._next_chunk()
            if chunk is None:
                return False
            self._train_chunk(chunk)
            return True
        assert self.acc is not None, "work() is for streaming steps; use batch_backward"
        closable = [] if self.opob else self._closable()
        if closable:
            self._close_groups(closable)
            return True
        for gid, waiting in self.trainer.waiting.items():
            for sample in waiting:
                if sample.traj_id in self.deferred or not self._streamable_now(gid):
                    continue  # waits for its group (sign-dependent clip, or back-pressure)
                if self._stream_one(sample):
                    waiting.remove(sample)
                else:
                    self.deferred.add(sample.traj_id)
                    self.trainer.totals.deferred += 1
                return True
        return False

    def _forward(
        self, ids_BL: torch.Tensor, opd: OpdArrays | None, lengths_B: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The policy's log-probs of the sampled tokens [B, L] (with grad) and, for a combined
        objective, of the cached ids [B, L, N] (the same forward: column 0 is the first)."""
        t = self.trainer
        if opd is None:
            return t.logp(t.actor, ids_BL, lengths_B), None
        logp_BLN = candidate_logp(t, ids_BL, opd, lengths_B)
        return logp_BLN[..., 0], logp_BLN

    def _opd_for(self, samples: Sequence[TrainSample], width: int) -> OpdArrays | None:
        """The teacher arrays of a packed batch and each trajectory's gate (combined objective)."""
        if self.distill is None:
            return None
        gate_B = self.distill.gate(torch.tensor([s.reward for s in samples], dtype=torch.float64))
        return opd_arrays(samples, width, self.trainer, gate_B)

    def _stream_one(self, sample: TrainSample, *, arrival: bool = True) -> bool:
        """One trajectory's forward and backward into its group's sums (its distillation term, if
        any, into `.grad`); False if its gradient is not linear in its advantage (it waits)."""
        t = self.trainer
        if sample.weight != 1.0 and not self.opob:
            return False  # a weighted group trains when complete (its advantages are scaled)
        batch = pack([sample], pad_token_id=t.pad_token_id).to(t.device)
        opd = self._opd_for([sample], batch.input_ids_BL.shape[1])
        logp_1L, logp_1LN = self._forward(batch.input_ids_BL, opd)
        corr = t.correct(batch, logp_1L.detach(), torch.ones(1, dtype=t.dtype, device=t.device))
        found = self.objective.stream_loss(logp_1L, corr, batch.completion_mask_BL)
        if found is None:
            if self.opob:  # the config check admits only policies whose clip never binds at ratio 1
                raise RuntimeError(
                    f"trajectory {sample.traj_id}: its gradient is not linear in its advantage, which the "
                    "optimal baseline (staleness.vcpo_baseline) needs; a staleness policy let a clip bind"
                )
            return False
        loss_pos, stats = found
        # autograd.grad leaves `.grad` alone: it holds the step's sum over complete groups.
        grads = torch.autograd.grad(loss_pos, t.params, allow_unused=True, retain_graph=opd is not None)
        h_P = torch.cat(
            [
                (g if g is not None else torch.zeros_like(p)).reshape(-1)
                for g, p in zip(grads, t.params, strict=True)
            ]
        ).neg_()
        if sample.weight != 1.0:  # OPOB: the group's weight scales every member's gradient
            h_P.mul_(sample.weight)
        fold = self.acc.add_trajectory(
            h_P,
            num_tokens=trained_tokens(sample),
            group_id=sample.group_id,
            reward=sample.reward,
            baseline_scale=baseline_scale(self.objective, batch, logp_1L),
        )
        loss_value = float(loss_pos.detach()) * sample.weight
        self.streamed_loss[sample.group_id].append((sample.sample_index, loss_value, sample.reward))
        if fold is not None and self.opob:
            t.totals.loss += folded_loss(
                fold, self.streamed_loss.pop(fold.group_id, []), self.objective.advantage, eps=self.acc.eps
            )
        if self.opob:
            self.opob_logp.append((sample, logp_1L.detach()))
        if logp_1LN is not None:  # the distillation term needs no group: straight into the step's sum
            d_loss, d_stats = distill_term(self.distill.distill, logp_1LN, opd, batch.completion_mask_BL)
            d_loss.backward()
            t.totals.loss += d_stats.loss
            t.totals.add_distill(d_stats)
        t.account(
            batch,
            [sample],
            stats_dict(corr),
            tokens=float(stats.num_tokens),
            clipped=float(stats.clip_fraction) * float(stats.num_tokens),
        )
        t.totals.streamed += int(arrival)
        return True

    def _train_chunk(self, gids: list[int]) -> None:
        """Lockstep: this rank's share of complete groups `gids`, with known advantages (the
        backward reduces the gradient over the ranks)."""
        t = self.trainer
        chunk = [s for g in gids for s in sorted(t.members[g], key=lambda s: s.sample_index)]
        adv_of, keep_of = self._group_advantages(gids)
        self._backward_parts(t.share(chunk), adv_of, keep_of)
        for g in gids:
            t.waiting.pop(g, None)
        self.trained_groups += len(gids)

    def _group_advantages(self, gids: list[int]) -> tuple[dict[int, float], dict[int, bool]]:
        """Each member's advantage (times its group's weight) and keep flag, by traj id; adds
        the streamed members' loss values now that their advantages are known."""
        t = self.trainer
        adv_of: dict[int, float] = {}
        keep_of: dict[int, bool] = {}
        for g in gids:
            members = sorted(t.members[g], key=lambda s: s.sample_index)
            rewards_1N = torch.tensor([[s.reward for s in members]], dtype=torch.float64)
            adv_1N, keep_1N = self.objective.group_advantages(rewards_1N)
            for k, s in enumerate(members):
                adv_of[s.traj_id] = float(adv_1N[0, k]) * s.weight
                keep_of[s.traj_id] = bool(keep_1N[0, k])
            # Streamed members' loss value: A_i * l_i(+1), their gradient folds from S0/S1.
            for slot, loss_pos, _ in self.streamed_loss.pop(g, []):
                k = [s.sample_index for s in members].index(slot)
                t.totals.loss += float(adv_1N[0, k]) * loss_pos
        return adv_of, keep_of

    def _backward_parts(self, samples: list[TrainSample], adv_of: dict, keep_of: dict) -> None:
        t = self.trainer
        for part in t.microbatches(samples):
            if part is None:
                t.dummy_backward()
                continue
            t.backward_pieces(
                [samples[i] for i in part], functools.partial(self._chunk_loss, adv_of, keep_of)
            )

    def _close_groups(self, gids: list[int]) -> None:
        """Train the waiting members of complete groups with known advantages, then fold."""
        t = self.trainer
        chunk = [s for g in gids for s in t.waiting[g]]
        adv_of, keep_of = self._group_advantages(gids)
        self._backward_parts(chunk, adv_of, keep_of)
        # Their gradient stays in `.grad` (summed with the step's other complete groups); the
        # streamed members of these groups fold from S0/S1 into the accumulator.
        for g in gids:
            known = t.waiting.pop(g)
            self.acc.close_with_known(
                g,
                [s.reward for s in known],
                num_tokens=sum(trained_tokens(s) for s in known),
            )

    def _chunk_loss(self, adv_of: dict, keep_of: dict, samples: Sequence[TrainSample]):
        """Loss over complete-group members with known advantages (local policies only), and
        what accounts for it once its gradient is in (`Trainer.backward_pieces`)."""
        t = self.trainer
        batch = pack(samples, pad_token_id=t.pad_token_id, require_complete=False).to(t.device)
        adv_B = torch.tensor([adv_of[s.traj_id] for s in samples], dtype=t.dtype, device=t.device)
        keep_B = torch.tensor([keep_of[s.traj_id] for s in samples], device=t.device)
        mask = batch.completion_mask_BL & keep_B[:, None]
        opd = self._opd_for(samples, batch.input_ids_BL.shape[1])
        logp_BL, logp_BLN = self._forward(batch.input_ids_BL, opd, batch.lengths_B)
        corr = t.correct(batch, logp_BL.detach(), adv_B)
        adv_BL = torch.where(mask, adv_B[:, None], 0.0)
        loss, stats = self.objective.policy_loss(logp_BL, corr, adv_BL, mask)
        d_stats = None
        if logp_BLN is not None:  # every trajectory's tokens, dropped (keep False) or not
            d_loss, d_stats = distill_term(self.distill.distill, logp_BLN, opd, batch.completion_mask_BL)
            loss = loss + d_loss

        def account() -> None:
            t.totals.loss += float(loss.detach())
            if d_stats is not None:
                t.totals.add_distill(d_stats)
            if self.acc is None:  # lockstep: no accumulator counts Z for these members
                t.totals.units += self.objective.units(mask)
            tokens = float(stats.num_tokens)
            t.account(
                batch, samples, stats_dict(corr), tokens=tokens, clipped=float(stats.clip_fraction) * tokens
            )

        return loss, account

    # ------------------------------------------------------------------ whole batch
    def batch_backward(self, samples: Sequence[TrainSample]) -> None:
        t = self.trainer
        if self.opob:  # one backward per trajectory, group by group (one group open at a time)
            for sample in sorted(samples, key=lambda s: (s.group_id, s.sample_index)):
                self._stream_one(sample, arrival=False)
            return
        whole = pack(samples, pad_token_id=t.pad_token_id)
        rewards_B = whole.reward_B.double()
        # Lockstep ranks each train their share of the rows; advantages come from the whole batch.
        rows = list(range(t.rank, len(samples), t.world_size))
        mine = [samples[i] for i in rows]
        parts = t.microbatches(mine)
        batch = pack(mine, pad_token_id=t.pad_token_id, require_complete=False) if mine else None
        ids = batch.input_ids_BL.to(t.device) if batch is not None else None
        single = len(parts) == 1 and parts[0] is not None and len(parts[0]) == len(mine)
        # (With data-parallel threads the rows train in pieces: an anchor forward, then each piece.)
        single = single and self.reference is None and not t.lockstep and t.threads == 1
        opd = self._opd_for(mine, ids.shape[1]) if batch is not None else None
        with torch.no_grad():
            logp_ref_BL = None
            if self.reference is not None:
                logp_ref_BL = _by_parts(lambda sl: t.logp(self.reference, ids[sl]), ids, parts, t)
        logp_BL = logp_BLN = None
        if single:
            logp_BL, logp_BLN = self._forward(ids, opd)
            logp_now_BL = logp_BL.detach()
        else:
            with torch.no_grad():
                logp_now_BL = _by_parts(
                    lambda sl: self._forward(ids[sl], None if opd is None else opd.rows(sl, ids.shape[1]))[0],
                    ids,
                    parts,
                    t,
                )
        if logp_ref_BL is not None:
            rewards_B = (
                rewards_B
                + self.objective.kl_reward_penalty(
                    logp_now_BL, logp_ref_BL, batch.completion_mask_BL.to(t.device)
                ).cpu()
            )
        rewards_GN = group_rewards(
            rewards_B, whole.group_B, whole.slot_B, num_groups=whole.num_groups, group_size=whole.group_size
        )
        adv_GN, keep_GN = self.objective.group_advantages(rewards_GN)
        if batch is None:  # more ranks than rows: this rank only takes part in the collectives
            plan = _EpochPlan(None, None, None, None, None, parts, None, None, None)
            if t.epochs > 1:
                t.epoch_plans.append(functools.partial(self._policy_backward, plan))
            self._policy_backward(plan)
            return
        rows_t = torch.tensor(rows, dtype=torch.long)
        g_B, n_B = whole.group_B[rows_t], whole.slot_B[rows_t]
        adv_B = adv_GN[g_B, n_B].to(t.dtype)
        if any(s.weight != 1.0 for s in mine):
            adv_B = adv_B * torch.tensor([s.weight for s in mine], dtype=t.dtype)
        batch = batch.to(t.device)
        adv_B = adv_B.to(t.device)
        mask = batch.completion_mask_BL & keep_GN[g_B, n_B].to(t.device)[:, None]
        corr = t.correct(batch, logp_now_BL, adv_B)
        adv_BL = torch.where(mask, adv_B[:, None], 0.0)
        plan = _EpochPlan(
            ids, corr, adv_BL, mask, logp_ref_BL, parts, opd, batch.completion_mask_BL, batch.lengths_B
        )
        if t.epochs > 1:
            t.epoch_plans.append(functools.partial(self._policy_backward, plan))
        sums = self._policy_backward(plan, logp_BL, logp_BLN)
        t.totals.loss += sums.loss
        t.totals.units += self.objective.units(mask)
        t.totals.lr_scale = corr.lr_scale
        stats = stats_dict(corr)
        if sums.kl_values:
            stats["kl"] = sum(sums.kl_values) / len(sums.kl_values)
        if sums.distill is not None:
            t.totals.add_distill(sums.distill)
        t.account(batch, mine, stats, tokens=float(mask.sum()), clipped=sums.clipped)

    def _policy_backward(
        self, plan: _EpochPlan, logp_BL: torch.Tensor | None = None, logp_BLN: torch.Tensor | None = None
    ) -> _PolicySums:
        """Loss and backward of a packed batch, micro-batch by micro-batch, under the model as it
        is now (`logp_BL`, and `logp_BLN` for a combined objective: its log-probs, with grad, when
        the caller already has them for the whole batch). Returns the summed loss, the clipped
        token count, the KL values and the distillation term's figures. A later epoch re-runs it
        with the same anchors, corrections and advantages (PPO epochs)."""
        t = self.trainer
        ids, parts = plan.ids_BL, plan.parts
        sums = _PolicySums()
        for part in parts:
            if part is None:
                t.dummy_backward()
            elif logp_BL is not None:  # the whole batch in one part, in row order
                rows = torch.arange(ids.shape[0], device=ids.device)
                loss, account = self._rows_loss(plan, sums, rows, ids.shape[1], logp_BL, logp_BLN)
                loss.backward()
                account()
            else:
                t.backward_pieces(part, functools.partial(self._piece_loss, plan, sums))
        return sums

    def _piece_loss(self, plan: _EpochPlan, sums: _PolicySums, part: Sequence[int]):
        return self._rows_loss(plan, sums, *_rows(part, plan.valid_BL))

    def _rows_loss(
        self, plan: _EpochPlan, sums: _PolicySums, sl: torch.Tensor, width: int, logp_BL=None, logp_BLN=None
    ):
        """The loss of rows `sl` of a packed batch (cut at `width`), and what adds its figures."""
        ids, corr, adv_BL, mask, logp_ref_BL, _, opd, valid_BL, lengths_B = plan
        opd = None if opd is None else opd.rows(sl, width)
        if logp_BL is None:
            lengths = lengths_B[sl].clamp(max=width)
            logp_BL, logp_BLN = self._forward(ids[sl, :width], opd, lengths)
        logp_mb = logp_BL
        part_corr = corr._replace(
            logp_anchor_BT=corr.logp_anchor_BT[sl, :width],
            weight_BT=corr.weight_BT[sl, :width],
            mask_BT=corr.mask_BT[sl, :width],
        )
        loss, stats = self.objective.policy_loss(logp_mb, part_corr, adv_BL[sl, :width], mask[sl, :width])
        kl_value = None
        if logp_ref_BL is not None:
            kl, kl_value = self.objective.kl_term(
                logp_mb,
                logp_ref_BL[sl, :width],
                mask[sl, :width],
                part_corr.weight_BT * part_corr.mask_BT,
            )
            loss = loss + kl
        d_stats = None
        if logp_BLN is not None:
            d_loss, d_stats = distill_term(self.distill.distill, logp_BLN, opd, valid_BL[sl, :width])
            loss = loss + d_loss

        def account() -> None:
            sums.loss += float(loss.detach())
            sums.clipped += float(stats.clip_fraction) * float(stats.num_tokens)
            if kl_value is not None:
                sums.kl_values.append(kl_value)
            if d_stats is not None:
                sums.distill = d_stats if sums.distill is None else sums.distill.plus(d_stats)

        return loss, account


@dataclass
class _PolicySums:
    """What `_policy_backward` adds up over its micro-batches (and their pieces)."""

    loss: float = 0.0
    clipped: float = 0.0
    kl_values: list[float] = field(default_factory=list)
    distill: DistillStats | None = None  # the distillation term's figures (`DistillStats.plus`)


def _rows(part: list[int], mask_BL: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Row indices of a micro-batch and its width: the packed length, cut after the last column
    any of its rows has a completion token in (right padding beyond it changes nothing)."""
    sl = torch.tensor(part, dtype=torch.long, device=mask_BL.device)
    cols = mask_BL[sl].any(dim=0).nonzero()
    width = int(cols.max()) + 1 if len(cols) else 2
    return sl, width


def _by_parts(fn, ids_BL: torch.Tensor | None, parts: list, t: Trainer) -> torch.Tensor | None:
    """`fn(rows)` (a no-grad forward of those rows of `ids_BL`) over micro-batches, reassembled
    in row order and padded to the batch's width; `None` parts are a lockstep rank's empty turns."""
    out = None
    for part in parts:
        if part is None:
            t.logp(t.actor, torch.full((1, 2), t.pad_token_id, dtype=torch.long))
            continue
        sl = torch.tensor(part, dtype=torch.long, device=ids_BL.device)
        values = fn(sl)
        if out is None:
            out = values.new_zeros(ids_BL.shape)
        out[sl] = values
    return out


class _EpochPlan(NamedTuple):
    """A packed batch ready for loss and backward: what a later epoch re-runs."""

    ids_BL: torch.Tensor
    corr: Correction  # anchor log-probs, weights, mask: fixed at the step's start
    adv_BL: torch.Tensor
    mask_BL: torch.Tensor
    logp_ref_BL: torch.Tensor | None
    parts: list  # row indices per micro-batch (`Trainer.microbatches`)
    opd: OpdArrays | None  # a combined objective's teacher arrays and gates
    valid_BL: torch.Tensor | None  # every trained completion token (the distillation term's mask)
    lengths_B: torch.Tensor | None  # real tokens per row (prompt + completion)


def trained_tokens(sample: TrainSample) -> int:
    """Completion tokens the loss counts (all of them unless a loss mask drops some)."""
    if sample.loss_mask is None:
        return len(sample.completion_ids)
    return int(sample.loss_mask.sum())


def stats_dict(corr: Correction) -> dict[str, float]:
    return {k: float(v) for k, v in corr.stats._asdict().items()}
