"""The units of an RL learner step (no sockets): group advantages, staleness corrections, losses
and backwards. It runs what the step's plan (`plans.py`) names and records what it measured in
the step's `StepState`.

Place in the data flow: the `Trainer` builds one `RLWork` (or `OpobWork`, for the off-policy
optimal baseline) from an `RLObjective` and the `Engine`. Units:
* `StreamOne`: one trajectory's forward and backward into its group's S0/S1 sums, when its
  gradient is linear in its advantage (else it is deferred: it waits for its group);
* `CloseGroups`: the waiting members of complete groups train in one backward with known
  advantages; the groups' streamed members fold from S0/S1;
* `TrainGroups` (lockstep ranks): this rank's share of complete groups, advantages known;
* `whole`: the step's whole batch at once (batch-global corrections, KL terms, epochs).
With a `CombinedObjective` (`opd.reward`) every forward is the distillation forward over the
cached ids (column 0 gives the RL part's log-probs) and each loss adds the trajectory's
distillation term; a streamed trajectory's term goes straight into `.grad` (the step's sum), its
RL part into the group sums.

Legend: B sequences, L packed length, N samples per group (RL) or cached ids per position (OPD),
G groups, P flattened parameters.
"""

from __future__ import annotations

import contextlib
import copy
import functools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.distributed as dist

from asyncrl.learner.advantages import GRPO_EPS, group_rewards
from asyncrl.learner.distill_work import OpdArrays, distill_term, opd_arrays
from asyncrl.learner.engine import Engine
from asyncrl.learner.ghost import GhostNorms
from asyncrl.learner.guidance import prefix_mask
from asyncrl.learner.objective import CombinedObjective, DistillStats, RLObjective
from asyncrl.learner.opob import (
    baseline_scale,
    folded_loss,
    informative_groups,
    opob_advantages,
    released_scales,
    step_lr_scale,
)
from asyncrl.learner.parallel import sharded_copy
from asyncrl.learner.plans import CloseGroups, StreamOne, TrainGroups, Unit
from asyncrl.learner.state import StepState
from asyncrl.learner.step import TrainSample, pack
from asyncrl.learner.streaming import StreamingAccumulator
from asyncrl.staleness.base import Correction


class RLWork:
    """Runs the RL units of a step: StreamOne, CloseGroups, TrainGroups, and the whole batch."""

    # Whether every trajectory streams on its own, weighted or not (the optimal baseline).
    every_trajectory_streams = False
    # Whether a whole batch of one micro-batch may train on its step-start forward (no anchor pass).
    trains_on_anchor_forward = True
    baseline = "mean"  # the group sums' baseline (`StreamingAccumulator`)

    def __init__(
        self, engine: Engine, objective: RLObjective, *, streams: bool, max_open_groups: int
    ) -> None:
        self.engine = engine
        self.objective = objective
        # Whether a step keeps group S0/S1 sums (trajectories stream into them).
        self.streams = streams
        self.max_open_groups = max_open_groups
        self.reference = None  # the initial model, for a KL term
        if objective.uses_reference:  # sharded like the policy on lockstep ranks
            self.reference = (
                sharded_copy(engine.actor)
                if engine.lockstep
                else copy.deepcopy(engine.actor).eval().requires_grad_(False)
            )
        # The distillation part of a combined objective (opd.reward), None for RL alone.
        self.distill: CombinedObjective | None = (
            objective if isinstance(objective, CombinedObjective) else None
        )

    def accumulator(self, group_size: int) -> StreamingAccumulator | None:
        """A new step's group S0/S1 sums (None: nothing streams into groups)."""
        if not self.streams:
            return None
        return StreamingAccumulator(
            self.engine.params,
            estimator=self.objective.stream_estimator,
            agg=self.objective.agg,
            group_size=group_size,
            drop_degenerate_groups=self.objective.drop_degenerate_groups,
            max_open_groups=self.max_open_groups,
            norm_constant=1.0,
            dtype=self.engine.dtype,
            baseline=self.baseline,
        )

    def run(self, unit: Unit, state: StepState) -> None:
        match unit:
            case StreamOne(sample):
                if self.stream_one(state, sample):
                    state.take([sample])
                else:
                    state.defer(sample)
            case CloseGroups(gids):
                self._close_groups(state, gids)
            case TrainGroups(gids):
                self._train_groups(state, gids)
            case _:
                raise TypeError(f"RL work has no unit {type(unit).__name__}")

    def end(self, state: StepState) -> None:
        """Before the update: what needs the whole step (nothing, for the group mean)."""

    # ------------------------------------------------------------------ forwards
    def _forward(
        self, ids_BL: torch.Tensor, opd: OpdArrays | None, lengths_B: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The policy's log-probs of the sampled tokens [B, L] (with grad) and, for a combined
        objective, of the cached ids [B, L, N] (the same forward: column 0 is the first)."""
        if opd is None:
            return self.engine.logp(self.engine.actor, ids_BL, lengths_B), None
        logp_BLN = self.engine.candidate_logp(ids_BL, opd.ids_BLN, lengths_B)
        return logp_BLN[..., 0], logp_BLN

    def _opd_for(self, samples: Sequence[TrainSample], width: int) -> OpdArrays | None:
        """The teacher arrays of a packed batch and each trajectory's gate (combined objective)."""
        if self.distill is None:
            return None
        gate_B = self.distill.gate(torch.tensor([s.reward for s in samples], dtype=torch.float64))
        return opd_arrays(samples, width, self.engine, gate_B)

    # ------------------------------------------------------------------ streaming
    def stream_one(self, state: StepState, sample: TrainSample, *, on_arrival: bool = True) -> bool:
        """One trajectory's forward and backward into its group's sums (its distillation term, if
        any, into `.grad`); False if its gradient is not linear in its advantage (it waits)."""
        if sample.weight != 1.0 and not self.every_trajectory_streams:
            return False  # a weighted group trains when complete (its advantages are scaled)
        e = self.engine
        batch = e.pack([sample])
        opd = self._opd_for([sample], batch.input_ids_BL.shape[1])
        logp_1L, logp_1LN = self._forward(batch.input_ids_BL, opd)
        corr = e.correct(batch, logp_1L.detach(), torch.ones(1, dtype=e.dtype, device=e.device), state.step)
        found = self.objective.stream_loss(logp_1L, corr, batch.completion_mask_BL)
        if found is None:
            return self._not_linear(sample)
        loss_pos, stats = found
        h_P = e.flat_grad(loss_pos, retain_graph=opd is not None).neg_()
        self._fold(state, sample, h_P, batch, logp_1L, float(loss_pos.detach()) * sample.weight, on_arrival)
        if logp_1LN is not None:  # the distillation term needs no group: straight into the step's sum
            d_loss, d_stats = distill_term(self.distill.distill, logp_1LN, opd, batch.completion_mask_BL)
            d_loss.backward()
            state.add_loss(d_stats.loss)
            state.add_distill(d_stats)
        state.account(
            batch,
            [sample],
            stats_dict(corr),
            tokens=float(stats.num_tokens),
            clipped=float(stats.clip_fraction) * float(stats.num_tokens),
        )
        return True

    def _not_linear(self, sample: TrainSample) -> bool:
        """A trajectory whose gradient is not linear in its advantage waits for its group."""
        return False

    def _fold(
        self, state: StepState, sample, h_P, batch, logp_1L, loss_value: float, on_arrival: bool
    ) -> None:
        """h_P into the group's sums; the loss value waits for the group's advantages."""
        state.acc.add_trajectory(
            h_P,
            num_tokens=trained_tokens(sample),
            group_id=sample.group_id,
            reward=sample.reward,
            group_size=sample.group_size or None,
        )
        state.note_streamed(sample, loss_value, on_arrival=on_arrival)

    # ------------------------------------------------------------------ complete groups
    def _close_groups(self, state: StepState, gids: list[int]) -> None:
        """Train the waiting members of complete groups with known advantages, then fold."""
        chunk = [s for g in gids for s in state.waiting[g]]
        adv_of, keep_of = self._group_advantages(state, gids)
        self._backward_parts(state, chunk, adv_of, keep_of)
        # Their gradient stays in `.grad` (summed with the step's other complete groups); the
        # streamed members of these groups fold from S0/S1 into the accumulator.
        for g in gids:
            known = state.take_groups([g])
            state.acc.close_with_known(
                g,
                [s.reward for s in known],
                num_tokens=sum(trained_tokens(s) for s in known),
                group_size=state.size_of(g),
            )

    def _train_groups(self, state: StepState, gids: list[int]) -> None:
        """Lockstep: this rank's share of complete groups `gids`, with known advantages (the
        backward reduces the gradient over the ranks)."""
        chunk = [s for g in gids for s in state.sorted_members(g)]
        adv_of, keep_of = self._group_advantages(state, gids)
        self._backward_parts(state, self.engine.share(chunk), adv_of, keep_of)
        state.take_groups(gids)
        state.mark_groups_trained(len(gids))

    def _group_advantages(
        self, state: StepState, gids: list[int]
    ) -> tuple[dict[int, float], dict[int, bool]]:
        """Each member's advantage (times its group's weight) and keep flag, by traj id; adds
        the streamed members' loss values now that their advantages are known."""
        adv_of: dict[int, float] = {}
        keep_of: dict[int, bool] = {}
        if self.objective.advantage == "gdpo" or self.objective.guidance != "off":
            # objective.fallback_reason sends both to `whole`: GDPO's batch scale, guided baselines.
            raise RuntimeError("learner.advantage = 'gdpo' and sampling.guidance train whole batches only")
        for g in gids:
            members = state.sorted_members(g)
            rewards_1N = torch.tensor([[s.reward for s in members]], dtype=torch.float64)
            adv_1N, keep_1N = self.objective.group_advantages(rewards_1N)
            for k, s in enumerate(members):
                adv_of[s.traj_id] = float(adv_1N[0, k]) * s.weight
                keep_of[s.traj_id] = bool(keep_1N[0, k])
            # Streamed members' loss value: A_i * l_i(+1), their gradient folds from S0/S1.
            slots = [s.sample_index for s in members]
            for slot, loss_pos, _ in state.pop_streamed_loss(g):
                state.add_loss(float(adv_1N[0, slots.index(slot)]) * loss_pos)
        return adv_of, keep_of

    def _backward_parts(
        self, state: StepState, samples: list[TrainSample], adv_of: dict, keep_of: dict
    ) -> None:
        e = self.engine
        for part in e.microbatches(samples):
            if part is None:
                e.dummy_backward(state.step)
                continue
            e.backward_pieces(
                [samples[i] for i in part], functools.partial(self._chunk_loss, state, adv_of, keep_of)
            )

    def _chunk_loss(self, state: StepState, adv_of: dict, keep_of: dict, samples: Sequence[TrainSample]):
        """Loss over complete-group members with known advantages (local policies only), and
        what accounts for it once its gradient is in (`Engine.backward_pieces`)."""
        e = self.engine
        batch = e.pack(samples)
        adv_B = torch.tensor([adv_of[s.traj_id] for s in samples], dtype=e.dtype, device=e.device)
        keep_B = torch.tensor([keep_of[s.traj_id] for s in samples], device=e.device)
        mask = batch.completion_mask_BL & keep_B[:, None]
        opd = self._opd_for(samples, batch.input_ids_BL.shape[1])
        logp_BL, logp_BLN = self._forward(batch.input_ids_BL, opd, batch.lengths_B)
        corr = e.correct(batch, logp_BL.detach(), adv_B, state.step)
        adv_BL = torch.where(mask, adv_B[:, None], 0.0)
        loss, stats = self.objective.policy_loss(logp_BL, corr, adv_BL, mask)
        d_stats = None
        if logp_BLN is not None:  # every trajectory's tokens, dropped (keep False) or not
            d_loss, d_stats = distill_term(self.distill.distill, logp_BLN, opd, batch.completion_mask_BL)
            loss = loss + d_loss

        def account() -> None:
            state.add_loss(float(loss.detach()))
            if d_stats is not None:
                state.add_distill(d_stats)
            if state.acc is None:  # lockstep: no accumulator counts Z for these members
                state.add_units(self.objective.units(mask))
            tokens = float(stats.num_tokens)
            state.account(
                batch, samples, stats_dict(corr), tokens=tokens, clipped=float(stats.clip_fraction) * tokens
            )

        return loss, account

    # ------------------------------------------------------------------ whole batch
    def whole(self, state: StepState, samples: Sequence[TrainSample]) -> None:
        """The whole step at once, `samples` in trajectory-id order: advantages from the whole
        batch, corrections of this rank's rows (of the whole batch where the policy is batch-
        global: `Engine.correct_rows`); lockstep ranks each train their share."""
        e = self.engine
        whole = pack(samples, pad_token_id=e.pad_token_id)
        rows = list(range(e.rank, len(samples), e.world_size))
        mine = [samples[i] for i in rows]
        parts = e.microbatches(mine)
        batch = ids = None
        if mine:
            batch = pack(mine, pad_token_id=e.pad_token_id, require_complete=False)
            ids = batch.input_ids_BL.to(e.device)
        # (With data-parallel threads the rows train in pieces: an anchor forward, then each piece.)
        single = len(parts) == 1 and parts[0] is not None and len(parts[0]) == len(mine)
        single = single and self.reference is None and not e.lockstep and e.threads == 1
        single = single and self.trains_on_anchor_forward and self.objective.minibatches == 1
        opd = self._opd_for(mine, ids.shape[1]) if mine else None
        logp_ref_BL = self._reference_logp(ids, parts)
        logp_BL = logp_BLN = None
        lengths_B = batch.lengths_B if batch is not None else None  # packed layouts skip the padding
        if single:
            logp_BL, logp_BLN = self._forward(ids, opd, lengths_B)
            logp_now_BL = logp_BL.detach()
        else:
            logp_now_BL = self._anchor_logp(ids, parts, opd, lengths_B)
        adv_GN, keep_GN = self._batch_advantages(
            state, whole, rows, parts, logp_now_BL, logp_ref_BL, batch, samples=samples
        )
        adv_all_B = adv_GN[whole.group_B, whole.slot_B].to(e.dtype)
        if any(s.weight != 1.0 for s in samples):
            adv_all_B = adv_all_B * torch.tensor([s.weight for s in samples], dtype=e.dtype)
        batch = batch.to(e.device) if mine else None
        corr = e.correct_rows(whole, rows, batch, logp_now_BL, adv_all_B, state.step)
        if not mine:  # more ranks than rows: this rank only takes part in the collectives
            self._no_rows(state, parts, whole)
            return
        rows_t = torch.tensor(rows, dtype=torch.long)
        g_B, n_B = whole.group_B[rows_t], whole.slot_B[rows_t]
        adv_B = adv_all_B[rows_t].to(e.device)
        keep_B = keep_GN[g_B, n_B].to(e.device)
        mask = batch.completion_mask_BL & keep_B[:, None]
        mask, valid_BL, shaped = self._guided_rows(mine, mask, keep_B, adv_B, batch.completion_mask_BL)
        adv_BL = torch.where(mask, adv_B[:, None], 0.0)
        plan = WholeRows(ids, corr, adv_BL, mask, logp_ref_BL, parts, opd, valid_BL, batch.lengths_B, shaped)
        if self.objective.epochs > 1:
            state.add_rerun(functools.partial(self._rows_backward, plan))
        units = self.objective.units(plan.trained_BL)
        if self.objective.minibatches > 1:  # the first now; the others after each update before
            (plan, units), *later = self._minibatch_parts(whole, rows, mine, plan)
            for plan_m, units_m in later:
                state.add_minibatch(functools.partial(self._rows_backward, plan_m), units_m)
        sums = self._rows_backward(plan, logp_BL, logp_BLN)
        state.add_loss(sums.loss)
        state.add_units(units)
        state.set_lr_scale(corr.lr_scale)
        stats = stats_dict(corr)
        if sums.kl_values:
            stats["kl"] = sum(sums.kl_values) / len(sums.kl_values)
        if sums.distill is not None:
            state.add_distill(sums.distill)
        state.account(batch, mine, stats, tokens=float(mask.sum()), clipped=sums.clipped)

    def _guided_rows(self, mine, mask, keep_B: torch.Tensor, adv_B: torch.Tensor, valid_BL: torch.Tensor):
        """Guided rows (`guidance.py`): their forced prefix tokens leave the policy loss's mask (the
        learner's own rule, whatever loss mask came); with `prefix_loss = "shaped"` they train
        under the shaped loss instead: (prefix mask of kept rows, advantages there). Returns the
        policy mask, the rows' valid-token mask (prefix included when shaped) and that pair."""
        prefix_BL = prefix_mask(mine, mask.shape[1])
        if prefix_BL is None:
            return mask, valid_BL, None
        prefix_BL = prefix_BL.to(mask.device)
        policy_mask = mask & ~prefix_BL
        if not self.objective.shapes_guided:
            return policy_mask, valid_BL & ~prefix_BL, None
        shaped_BL = prefix_BL & keep_B[:, None]
        return policy_mask, valid_BL | prefix_BL, (shaped_BL, torch.where(shaped_BL, adv_B[:, None], 0.0))

    def _minibatch_parts(
        self, whole, rows: list[int], mine: list[TrainSample], plan: WholeRows | None
    ) -> list[tuple[WholeRows, float]]:
        """`plan` (this rank's rows `rows` of the whole batch) cut into `learner.minibatches`
        minibatches of the batch's groups in order (group g of G in minibatch g * M // G), each
        with its own micro-batches and its units: this rank's for the first (the step's sums
        reduce them), summed over the ranks for the others (each update divides by its own)."""
        e, count = self.engine, self.objective.minibatches
        group_B = (
            whole.group_B[torch.tensor(rows, dtype=torch.long)] if rows else torch.zeros(0, dtype=torch.long)
        )
        minibatch_B = group_B * count // whole.num_groups
        out, units = [], []
        for m in range(count):
            index = torch.nonzero(minibatch_B == m).flatten().tolist()
            parts = e.microbatches([mine[i] for i in index])
            parts = [None if p is None else [index[j] for j in p] for p in parts]
            mask = plan.trained_BL[torch.tensor(index, dtype=torch.long)] if index else None
            units.append(self.objective.units(mask) if index else 0.0)
            out.append(parts)
        units_t = torch.tensor(units, dtype=torch.float64, device=e.device)
        if e.lockstep:
            dist.all_reduce(units_t)
        if plan is None:
            plan = WholeRows(None, None, None, None, None, None, None, None, None)
        return [
            (plan._replace(parts=parts), units[m] if m == 0 else float(units_t[m]))
            for m, parts in enumerate(out)
        ]

    def _no_rows(self, state: StepState, parts: list, whole) -> None:
        """A lockstep rank with no rows of the batch still runs its part of the backward (and of
        later epochs' or minibatches'); the forwards before it ran in `whole`, with no rows."""
        plan = WholeRows(None, None, None, None, None, parts, None, None, None)
        if self.objective.minibatches > 1:
            (plan, _), *later = self._minibatch_parts(whole, [], [], None)
            for plan_m, units_m in later:
                state.add_minibatch(functools.partial(self._rows_backward, plan_m), units_m)
        if self.objective.epochs > 1:
            state.add_rerun(functools.partial(self._rows_backward, plan))
        self._rows_backward(plan)

    def _reference_logp(self, ids: torch.Tensor, parts: list) -> torch.Tensor | None:
        """The reference (initial) model's log-probs of the rows, for a KL term; else None."""
        if self.reference is None:
            return None
        with torch.no_grad():
            return _by_parts(
                lambda sl: self.engine.logp(self.reference, ids[sl]), ids, parts, self.engine, self.reference
            )

    def _anchor_logp(
        self, ids: torch.Tensor, parts: list, opd: OpdArrays | None, lengths_B: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The current policy's log-probs of the rows (no grad), micro-batch by micro-batch;
        `lengths_B`: each row's real tokens (the flat layout then holds no right padding)."""
        with torch.no_grad():
            return _by_parts(
                lambda sl: self._forward(
                    ids[sl],
                    None if opd is None else opd.rows(sl, ids.shape[1]),
                    None if lengths_B is None else lengths_B[sl.cpu()],
                )[0],
                ids,
                parts,
                self.engine,
            )

    def _batch_advantages(
        self, state: StepState, whole, rows, parts, logp_now_BL, logp_ref_BL, batch, *, samples=()
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(adv_GN, keep_GN) of the whole batch, rewards with the KL penalty where it is placed
        (each rank's rows' penalties, summed over the lockstep ranks into the whole batch's); the
        per-reward values (GDPO) and guided members of `samples` (the batch's, in its row order)."""
        rewards_B = whole.reward_B.double()
        if self.reference is not None and self.objective.kl_placement == "reward":
            penalty_B = torch.zeros_like(rewards_B)
            if rows:
                penalty_B[torch.tensor(rows)] = self.objective.kl_reward_penalty(
                    logp_now_BL, logp_ref_BL, batch.completion_mask_BL.to(self.engine.device)
                ).cpu()
            if self.engine.lockstep:
                penalty_B = penalty_B.to(self.engine.device)
                dist.all_reduce(penalty_B)  # each row is one rank's: the others add zeros
                penalty_B = penalty_B.cpu()
            rewards_B = rewards_B + penalty_B
        shape = {"num_groups": whole.num_groups, "group_size": whole.group_size, "sizes_G": whole.sizes_G}
        rewards_GN = group_rewards(rewards_B, whole.group_B, whole.slot_B, **shape)
        parts_GNK = guided_GN = None
        if self.objective.advantage == "gdpo":
            parts_BK = reward_parts_BK(samples)
            parts_GNK = torch.stack(
                [
                    group_rewards(parts_BK[:, k], whole.group_B, whole.slot_B, **shape)
                    for k in range(parts_BK.shape[1])
                ],
                dim=2,
            )
        if any(s.guided_prefix for s in samples):
            guided_B = torch.tensor([s.guided_prefix > 0 for s in samples])
            guided_GN = group_rewards(guided_B, whole.group_B, whole.slot_B, **shape)
        if whole.sizes_G is not None:  # groups of unequal sizes (rollout budgets)
            return self.objective.group_advantages(rewards_GN, parts_GNK, guided_GN, sizes_G=whole.sizes_G)
        return self.objective.group_advantages(rewards_GN, parts_GNK, guided_GN)

    def _rows_backward(
        self, plan: WholeRows, logp_BL: torch.Tensor | None = None, logp_BLN: torch.Tensor | None = None
    ) -> RowSums:
        """Loss and backward of a packed batch, micro-batch by micro-batch, under the model as it
        is now (`logp_BL`, and `logp_BLN` for a combined objective: its log-probs, with grad, when
        the caller already has them for the whole batch). Returns the summed loss, the clipped
        token count, the KL values and the distillation term's figures. A later epoch re-runs it
        with the same anchors, corrections and advantages (PPO epochs)."""
        e = self.engine
        ids = plan.ids_BL
        sums = RowSums()
        for part in plan.parts:
            if part is None:
                e.dummy_backward()
            elif logp_BL is not None:  # the whole batch in one part, in row order
                rows = torch.arange(ids.shape[0], device=ids.device)
                loss, account = self._rows_loss(plan, sums, rows, ids.shape[1], logp_BL, logp_BLN)
                loss.backward()
                account()
            else:
                e.backward_pieces(part, functools.partial(self._piece_loss, plan, sums))
        return sums

    def _piece_loss(self, plan: WholeRows, sums: RowSums, part: Sequence[int]):
        return self._rows_loss(plan, sums, *_rows(part, plan.valid_BL))

    def _rows_loss(
        self, plan: WholeRows, sums: RowSums, sl: torch.Tensor, width: int, logp_BL=None, logp_BLN=None
    ):
        """The loss of rows `sl` of a packed batch (cut at `width`), and what adds its figures."""
        ids, corr, adv_BL, mask, logp_ref_BL, _, opd, valid_BL, lengths_B, shaped = plan
        opd = None if opd is None else opd.rows(sl, width)
        if logp_BL is None:
            lengths = lengths_B[sl].clamp(max=width)
            logp_BL, logp_BLN = self._forward(ids[sl, :width], opd, lengths)
        part_corr = corr._replace(
            logp_anchor_BT=corr.logp_anchor_BT[sl, :width],
            weight_BT=corr.weight_BT[sl, :width],
            mask_BT=corr.mask_BT[sl, :width],
        )
        loss, stats = self.objective.policy_loss(logp_BL, part_corr, adv_BL[sl, :width], mask[sl, :width])
        if shaped is not None:
            prefix_BL, prefix_adv_BL = shaped
            loss = loss + self.objective.guided_prefix_loss(
                logp_BL, prefix_adv_BL[sl, :width], prefix_BL[sl, :width]
            )
        kl_value = None
        if logp_ref_BL is not None:
            kl, kl_value = self.objective.kl_term(
                logp_BL, logp_ref_BL[sl, :width], mask[sl, :width], part_corr.weight_BT * part_corr.mask_BT
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


class OpobWork(RLWork):
    """RL with VCPO's off-policy optimal baseline (`staleness.vcpo_baseline` = opob*,
    ALGORITHMS.md 2.2): every trajectory takes its own backward into its group's sums, complete
    group or not, weighted or not; the accumulator keeps W_i and folds each group with
    b_g = sum W R / sum W when it closes. A whole-batch step streams its trajectories group by
    group. The lr scale of a policy whose only batch-global part it is (VCPO's ESS) is taken
    over the step at its end (`opob.step_lr_scale`)."""

    every_trajectory_streams = True
    baseline = "opob"

    def __init__(self, engine: Engine, objective: RLObjective, *, max_open_groups: int) -> None:
        if engine.lockstep:
            raise ValueError(
                "staleness.vcpo_baseline = 'opob' takes one backward per trajectory on one plain float32 "
                "rank; lockstep ranks (learner.world_size > 1, fsdp or mixed precision) train complete groups"
            )
        super().__init__(engine, objective, streams=True, max_open_groups=max_open_groups)

    def _not_linear(self, sample: TrainSample) -> bool:
        raise RuntimeError(
            f"trajectory {sample.traj_id}: its gradient is not linear in its advantage, which the "
            "optimal baseline (staleness.vcpo_baseline) needs; a staleness policy let a clip bind"
        )

    def _fold(
        self, state: StepState, sample, h_P, batch, logp_1L, loss_value: float, on_arrival: bool
    ) -> None:
        if sample.weight != 1.0:  # the group's weight scales every member's gradient
            h_P.mul_(sample.weight)
        fold = state.acc.add_trajectory(
            h_P,
            num_tokens=trained_tokens(sample),
            group_id=sample.group_id,
            reward=sample.reward,
            baseline_scale=baseline_scale(self.objective, batch, logp_1L),
        )
        state.note_streamed(sample, loss_value, on_arrival=on_arrival)
        if fold is not None:
            streamed = state.pop_streamed_loss(fold.group_id)
            state.add_loss(folded_loss(fold, streamed, self.objective.advantage, eps=state.acc.eps))
        state.keep_opob_logp(sample, logp_1L.detach())

    def whole(self, state: StepState, samples: Sequence[TrainSample]) -> None:
        """One backward per trajectory, group by group (one group open at a time)."""
        for sample in sorted(samples, key=lambda s: (s.group_id, s.sample_index)):
            self.stream_one(state, sample, on_arrival=False)

    def end(self, state: StepState) -> None:
        step_lr_scale(self.engine, state)


class OpobBatchWork(RLWork):
    """RL with VCPO's off-policy optimal baseline from batched backwards (whole-batch steps, one
    plain rank or lockstep ranks): rows take a forward on padded rows and a backward at A = +1
    that forms no parameter gradient but every row's ||h_i||^2 (`ghost.GhostNorms`); the ranks
    sum the norms into the whole batch's, every rank folds each group with b_g = sum W R / sum W
    (`opob.opob_advantages`), and the step trains with these advantages. The correction (and
    VCPO's ESS lr scale) is the whole batch's, as for any whole-batch step.

    Only the rows of groups whose advantages depend on their baseline take the norms' forward
    and backward (`opob.informative_groups`: rewards not all equal; on the default job 50-90% of
    the groups are not); that forward also gives their step-start log-probs, and the other rows
    take the group mean's anchor forward (no graph, on the packed layout with shared prefixes).
    Then, chosen once (`_one_pass`):
    * one pass (one plain rank, one update on the step-start model, no second loss term): the
      norms' backward also trains. It keeps each layer's inputs and output gradients at +1 and
      forms the step's gradient from them with each row's advantage (`GhostNorms.grads`; exact,
      the loss being linear in it); the other rows' advantages are 0, so they add nothing to it
      (their loss and clip figures come from their anchor forward's log-probs, as the training
      forward's would);
    * two passes (lockstep ranks, whose gradients are sharded; minibatches, epochs, or a
      distillation term): the step trains as the group mean's does, a forward and backward of
      every row.

    The norms' forwards of a step are kept (`_kept`: rows, collector, log-probs with their graph;
    rows None for a lockstep rank's empty turn) until the correction gives their backward's
    coefficients (`_batch_advantages`); one pass keeps them further, to train."""

    trains_on_anchor_forward = False  # the anchor forward is partly the norms' (padded rows)

    def __init__(self, engine: Engine, objective: RLObjective, **kwargs) -> None:
        super().__init__(engine, objective, **kwargs)
        self.one_pass = self._one_pass()
        self._kept: list = []
        self._mine: list[TrainSample] = []
        self._informative: set[int] = set()
        self._rest: list[int] = []  # this rank's rows without norms
        self._logp_now: torch.Tensor | None = None

    def _one_pass(self) -> bool:
        """Whether the norms' backward is also the step's: one plain rank, one update on the
        step-start model, no second loss term."""
        o = self.objective
        return not self.engine.lockstep and o.minibatches == 1 and o.epochs == 1 and self.distill is None

    def whole(self, state: StepState, samples: Sequence[TrainSample]) -> None:
        self._mine = self.engine.share(samples)  # this rank's rows, as `RLWork.whole` takes them
        self._informative = informative_groups(samples)
        super().whole(state, samples)

    def _anchor_logp(
        self, ids: torch.Tensor, parts: list, opd: OpdArrays | None, lengths_B: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The step-start log-probs of this rank's rows: the informative groups' rows from their
        norms' forwards (kept), the others' from the group mean's anchor forward."""
        e = self.engine
        need = [i for i, s in enumerate(self._mine) if s.group_id in self._informative]
        self._rest = [i for i, s in enumerate(self._mine) if s.group_id not in self._informative]
        rest_parts = _subset_parts(e.microbatches([self._mine[i] for i in self._rest]), self._rest)
        out = super()._anchor_logp(ids, rest_parts, opd, lengths_B)
        need_parts = _subset_parts(e.microbatches([self._mine[i] for i in need], padded=True), need)
        logp = self._keep_forwards(ids, need_parts, capture=self.one_pass)
        if out is None:  # every row informative (or none here: a lockstep rank without rows)
            out = logp
        elif logp is not None:
            rows = torch.tensor(need, dtype=torch.long, device=out.device)
            out[rows] = logp[rows]
        self._logp_now = out
        return out

    def _keep_forwards(self, ids: torch.Tensor, parts: list, *, capture: bool) -> torch.Tensor | None:
        """The norms' forwards of `parts` (rows of `ids`, micro-batch by micro-batch, each cut
        into pieces on the data-parallel threads, each piece with its own collector), kept in
        `_kept`; their log-probs (no grad) in row order, zero elsewhere (None if no rows)."""
        e = self.engine
        self._kept = []
        out = None
        for part in parts:
            if part is None:  # a lockstep rank's empty turn: its collectives, zeros to back-propagate
                with self._ghost() as ghost:
                    logp = e.logp(e.actor, torch.full((1, 2), e.pad_token_id, dtype=torch.long))
                self._kept.append((None, ghost, logp))
                continue
            pieces = [torch.tensor(piece, dtype=torch.long, device=ids.device) for piece in e.pieces(part)]
            with self._ghost(len(pieces), capture=capture) as ghosts:

                def forward(i: int, ghosts=ghosts, pieces=pieces) -> torch.Tensor:
                    with ghosts[i].active():
                        return e.logp(e.actor, ids[pieces[i]])

                logps = e.each(forward, range(len(pieces)))
            for rows, ghost, logp in zip(pieces, ghosts, logps, strict=True):
                self._kept.append((rows, ghost, logp))
                out = logp.new_zeros(ids.shape) if out is None else out
                out[rows] = logp.detach()
        return out

    def _batch_advantages(
        self, state: StepState, whole, rows, parts, logp_now_BL, logp_ref_BL, batch, *, samples=()
    ) -> tuple[torch.Tensor, torch.Tensor]:
        e = self.engine
        zeros = torch.zeros(len(whole.reward_B), dtype=e.dtype)
        corr = e.correct_rows(
            whole, rows, batch.to(e.device) if rows else None, logp_now_BL, zeros, state.step
        )
        norms_B = torch.zeros(len(whole.reward_B), dtype=torch.float64, device=e.device)
        if rows:
            mine_B = self._row_norms(batch.to(e.device), corr)
            norms_B[torch.tensor(rows, device=e.device)] = mine_B * released_scales(
                self.objective, batch, logp_now_BL.cpu()
            ).to(e.device)
        else:
            self._row_norms(None, None)
        if e.lockstep:
            dist.all_reduce(norms_B)  # each row is one rank's, the others add zeros
        shape = {"num_groups": whole.num_groups, "group_size": whole.group_size}
        rewards_GN = group_rewards(whole.reward_B.double(), whole.group_B, whole.slot_B, **shape)
        weights_GN = group_rewards(norms_B.cpu(), whole.group_B, whole.slot_B, **shape)
        _, keep_GN = self.objective.group_advantages(rewards_GN)
        adv_GN = opob_advantages(rewards_GN, weights_GN, advantage=self.objective.advantage, eps=GRPO_EPS)
        return adv_GN, keep_GN

    def _row_norms(self, batch, corr: Correction | None) -> torch.Tensor | None:
        """||h_i||^2 of this rank's rows (float64; 0 for rows without a kept forward): the
        backward at A = +1 of each kept forward, its pieces on the data-parallel threads (a
        lockstep rank's empty turns back-propagate zeros). Pieces that train in the same pass
        stay kept (`_rows_backward`)."""
        e = self.engine
        out = None if batch is None else torch.zeros(batch.input_ids_BL.shape[0], dtype=torch.float64)

        def backward(kept) -> torch.Tensor | None:
            rows, ghost, logp = kept
            if rows is None:
                ghost.backward(logp, torch.zeros_like(logp))
                return None
            mask = batch.completion_mask_BL[rows]
            loss, _ = self.objective.policy_loss(logp, _corr_rows(corr, rows), mask.to(logp.dtype), mask)
            (coeff,) = torch.autograd.grad(loss, [logp])
            return ghost.backward(logp, coeff)

        for (rows, _, _), norms in zip(self._kept, e.each(backward, self._kept), strict=True):
            if rows is not None:
                out[rows.cpu()] = norms.cpu()
        self._kept = [k for k in self._kept if k[0] is not None and k[1].capture]
        return None if out is None else out.to(e.device)

    def _rows_backward(
        self, plan: WholeRows, logp_BL: torch.Tensor | None = None, logp_BLN: torch.Tensor | None = None
    ) -> RowSums:
        """One pass: the step's gradient from the norms' own backward (the informative rows; the
        other rows' advantages are 0), every trained parameter given one (zeros where no row
        reaches it, as a backward would), the other rows' loss and clip figures from their
        step-start log-probs. Else a forward and backward of every row (`RLWork._rows_backward`)."""
        kept, self._kept = self._kept, []
        if not self.one_pass or getattr(plan, "shaped", None) is not None:  # a guided prefix's second loss
            return super()._rows_backward(plan, logp_BL, logp_BLN)
        e = self.engine
        sums = RowSums()

        def grads(piece) -> tuple[dict, float, float]:
            rows, ghost, logp = piece
            part_corr, adv, mask = _corr_rows(plan.corr, rows), plan.adv_BL[rows], plan.mask_BL[rows]
            loss, stats = self.objective.policy_loss(logp.detach(), part_corr, adv, mask)
            first = mask.to(torch.long).argmax(dim=1, keepdim=True)  # each row's advantage
            k_B = torch.where(mask.any(dim=1), adv.gather(1, first).squeeze(1), 0.0)
            clipped = float(stats.clip_fraction) * float(stats.num_tokens)
            return ghost.grads(k_B), float(loss), clipped

        for found, loss, clipped in e.each(grads, kept):
            for p in e.params:
                g = found.get(p)
                if g is not None:
                    p.grad = g if p.grad is None else p.grad.add_(g)
            sums.loss += loss
            sums.clipped += clipped
        for p in e.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        if self._rest:
            rows = torch.tensor(self._rest, dtype=torch.long, device=plan.ids_BL.device)
            loss, stats = self.objective.policy_loss(
                self._logp_now[rows], _corr_rows(plan.corr, rows), plan.adv_BL[rows], plan.mask_BL[rows]
            )
            sums.loss += float(loss)
            sums.clipped += float(stats.clip_fraction) * float(stats.num_tokens)
        return sums

    @contextlib.contextmanager
    def _ghost(self, count: int | None = None, *, capture: bool = False):
        """Hooks on (one collector, or `count` of them for pieces run on the data-parallel
        threads), and the forward on padded rows (a shared prefix would mix rows' gradients)."""
        actor = self.engine.actor
        shared, actor.share_prefixes = actor.share_prefixes, False
        try:
            with contextlib.ExitStack() as stack:
                ghosts = [
                    stack.enter_context(
                        GhostNorms(actor.lm, temperature=self.engine.temperature, capture=capture)
                    )
                    for _ in range(count or 1)
                ]
                yield ghosts[0] if count is None else ghosts
        finally:
            actor.share_prefixes = shared


def _corr_rows(corr: Correction, rows: torch.Tensor) -> Correction:
    """Rows `rows` of a correction over a packed batch (full width)."""
    return corr._replace(
        logp_anchor_BT=corr.logp_anchor_BT[rows], weight_BT=corr.weight_BT[rows], mask_BT=corr.mask_BT[rows]
    )


def _subset_parts(parts: list, subset: list[int]) -> list:
    """Micro-batches of a subset of rows (indices into `subset`) as rows' own indices; a
    lockstep rank's empty turn (None) stays one."""
    return [None if part is None else [subset[j] for j in part] for part in parts]


@dataclass
class RowSums:
    """What `_rows_backward` adds up over its micro-batches (and their pieces)."""

    loss: float = 0.0
    clipped: float = 0.0
    kl_values: list[float] = field(default_factory=list)
    distill: DistillStats | None = None  # the distillation term's figures (`DistillStats.plus`)


class WholeRows(NamedTuple):
    """A packed batch ready for loss and backward: what a later epoch re-runs."""

    ids_BL: torch.Tensor
    corr: Correction  # anchor log-probs, weights, mask: fixed at the step's start
    adv_BL: torch.Tensor
    mask_BL: torch.Tensor
    logp_ref_BL: torch.Tensor | None
    parts: list  # row indices per micro-batch (`Engine.microbatches`)
    opd: OpdArrays | None  # a combined objective's teacher arrays and gates
    valid_BL: torch.Tensor | None  # every trained completion token (the distillation term's mask)
    lengths_B: torch.Tensor | None  # real tokens per row (prompt + completion)
    # Guided prefix tokens under the shaped loss (`guidance.py`): (their mask, advantages there).
    shaped: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def trained_BL(self) -> torch.Tensor:
        """Every token with a loss term: the policy loss's, and the shaped guided prefixes'."""
        return self.mask_BL if self.shaped is None else self.mask_BL | self.shaped[0]


def _rows(part: list[int], mask_BL: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Row indices of a micro-batch and its width: the packed length, cut after the last column
    any of its rows has a completion token in (right padding beyond it changes nothing)."""
    sl = torch.tensor(part, dtype=torch.long, device=mask_BL.device)
    cols = mask_BL[sl].any(dim=0).nonzero()
    width = int(cols.max()) + 1 if len(cols) else 2
    return sl, width


def _by_parts(fn, ids_BL: torch.Tensor, parts: list, engine: Engine, model=None) -> torch.Tensor | None:
    """`fn(rows)` (a no-grad forward of those rows of `ids_BL` under `model`, default the policy)
    over micro-batches, reassembled in row order and padded to the batch's width; `None` parts
    are a lockstep rank's empty turns (on the same model: its collectives)."""
    out = None
    for part in parts:
        if part is None:
            engine.dummy_forward(model)
            continue
        sl = torch.tensor(part, dtype=torch.long, device=ids_BL.device)
        values = fn(sl)
        if out is None:
            out = values.new_zeros(ids_BL.shape)
        out[sl] = values
    return out


def reward_parts_BK(samples: Sequence[TrainSample]) -> torch.Tensor:
    """[B, K] float64: each sample's per-reward values (`TrainSample.reward_parts`); ValueError
    naming a trajectory that came without them or with another count."""
    counts = {len(s.reward_parts) for s in samples}
    if len(counts) != 1 or 0 in counts:
        bad = next((s for s in samples if len(s.reward_parts) != max(counts)), samples[0])
        raise ValueError(
            f"learner.advantage = 'gdpo' needs every trajectory's per-reward values (task.rewards), and "
            f"trajectory {bad.traj_id} carries {len(bad.reward_parts)} (others {sorted(counts)})"
        )
    return torch.tensor([list(s.reward_parts) for s in samples], dtype=torch.float64)


def trained_tokens(sample: TrainSample) -> int:
    """Completion tokens the loss counts (all of them unless a loss mask drops some)."""
    if sample.loss_mask is None:
        return len(sample.completion_ids)
    return int(sample.loss_mask.sum())


def stats_dict(corr: Correction) -> dict[str, float]:
    return {k: float(v) for k, v in corr.stats._asdict().items()}
