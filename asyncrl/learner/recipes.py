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
* `DistillationRecipe`: per-token teacher advantages need no group, so every chunk of waiting
  trajectories trains as it comes, and the whole-batch path is the same loss over the sorted step.

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
from asyncrl.learner.objective import DistillationObjective, RLObjective
from asyncrl.learner.step import TrainSample, pack, pack_opd
from asyncrl.learner.streaming import StreamingAccumulator
from asyncrl.staleness.base import Correction

if TYPE_CHECKING:
    from asyncrl.learner.trainer import Trainer


class Recipe(Protocol):
    """The part of a learner step that depends on the objective's kind."""

    # The step's group S0/S1 buffers while it streams grouped trajectories; None otherwise.
    acc: StreamingAccumulator | None

    def begin_step(self) -> None: ...

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

    def begin_step(self) -> None:
        t = self.trainer
        self.deferred: set[int] = set()  # traj ids that tried to stream and could not
        self.streamed_loss: dict[int, list[tuple[int, float]]] = defaultdict(list)  # gid -> (slot, l(+1))
        self.acc = None
        self.trained_groups = 0  # lockstep: complete groups trained so far (t.completed order)
        if not t.fallback and not t.lockstep:
            self.acc = StreamingAccumulator(
                t.params,
                estimator=self.objective.stream_estimator,
                agg=self.objective.agg,
                group_size=t.group_size,
                drop_degenerate_groups=self.objective.drop_degenerate_groups,
                max_open_groups=t.max_open_groups,
                norm_constant=1.0,
                dtype=t.dtype,
            )

    # ------------------------------------------------------------------ streaming
    def has_work(self) -> bool:
        if self.trainer.lockstep:
            return not self.trainer.fallback and self._next_chunk() is not None
        if self.acc is None:
            return False
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
        closable = self._closable()
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

    def _stream_one(self, sample: TrainSample) -> bool:
        t = self.trainer
        if sample.weight != 1.0:
            return False  # a weighted group trains when complete (its advantages are scaled)
        batch = pack([sample], pad_token_id=t.pad_token_id).to(t.device)
        logp_1L = t.logp(t.actor, batch.input_ids_BL)
        corr = t.correct(batch, logp_1L.detach(), torch.ones(1, dtype=t.dtype, device=t.device))
        found = self.objective.stream_loss(logp_1L, corr, batch.completion_mask_BL)
        if found is None:
            return False
        loss_pos, stats = found
        # autograd.grad leaves `.grad` alone: it holds the step's sum over complete groups.
        grads = torch.autograd.grad(loss_pos, t.params, allow_unused=True)
        h_P = torch.cat(
            [
                (g if g is not None else torch.zeros_like(p)).reshape(-1)
                for g, p in zip(grads, t.params, strict=True)
            ]
        ).neg_()
        self.acc.add_trajectory(
            h_P, num_tokens=trained_tokens(sample), group_id=sample.group_id, reward=sample.reward
        )
        self.streamed_loss[sample.group_id].append((sample.sample_index, float(loss_pos.detach())))
        t.account(
            batch,
            [sample],
            stats_dict(corr),
            tokens=float(stats.num_tokens),
            clipped=float(stats.clip_fraction) * float(stats.num_tokens),
        )
        t.totals.streamed += 1
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
            for slot, loss_pos in self.streamed_loss.pop(g, []):
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
        logp_BL = t.logp(t.actor, batch.input_ids_BL)
        corr = t.correct(batch, logp_BL.detach(), adv_B)
        adv_BL = torch.where(mask, adv_B[:, None], 0.0)
        loss, stats = self.objective.policy_loss(logp_BL, corr, adv_BL, mask)

        def account() -> None:
            t.totals.loss += float(loss.detach())
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
        with torch.no_grad():
            logp_ref_BL = None
            if self.reference is not None:
                logp_ref_BL = _by_parts(lambda x: t.logp(self.reference, x), ids, parts, t)
        if single:
            logp_BL = t.logp(t.actor, ids)
            logp_now_BL = logp_BL.detach()
        else:
            with torch.no_grad():
                logp_now_BL = _by_parts(lambda x: t.logp(t.actor, x), ids, parts, t)
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
            plan = _EpochPlan(None, None, None, None, None, parts)
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
        plan = _EpochPlan(ids, corr, adv_BL, mask, logp_ref_BL, parts)
        if t.epochs > 1:
            t.epoch_plans.append(functools.partial(self._policy_backward, plan))
        loss_sum, clipped, kl_values = self._policy_backward(plan, logp_BL if single else None)
        t.totals.loss += loss_sum
        t.totals.units += self.objective.units(mask)
        t.totals.lr_scale = corr.lr_scale
        stats = stats_dict(corr)
        if kl_values:
            stats["kl"] = sum(kl_values) / len(kl_values)
        t.account(batch, mine, stats, tokens=float(mask.sum()), clipped=clipped)

    def _policy_backward(
        self, plan: _EpochPlan, logp_BL: torch.Tensor | None = None
    ) -> tuple[float, float, list[float]]:
        """Loss and backward of a packed batch, micro-batch by micro-batch, under the model as it
        is now (`logp_BL`: its log-probs, with grad, when the caller already has them for the whole
        batch). Returns the summed loss, the clipped token count and the KL values. A later epoch
        re-runs it with the same anchors, corrections and advantages (PPO epochs)."""
        t = self.trainer
        ids, corr, adv_BL, mask, logp_ref_BL, parts = plan
        sums = _PolicySums()
        for part in parts:
            if part is None:
                t.dummy_backward()
            elif logp_BL is not None:  # the whole batch in one part, in row order
                rows = torch.arange(ids.shape[0], device=ids.device)
                loss, account = self._rows_loss(plan, sums, rows, ids.shape[1], logp_BL)
                loss.backward()
                account()
            else:
                t.backward_pieces(part, functools.partial(self._piece_loss, plan, sums))
        return sums.loss, sums.clipped, sums.kl_values

    def _piece_loss(self, plan: _EpochPlan, sums: _PolicySums, part: Sequence[int]):
        return self._rows_loss(plan, sums, *_rows(part, plan.mask_BL))

    def _rows_loss(self, plan: _EpochPlan, sums: _PolicySums, sl: torch.Tensor, width: int, logp_BL=None):
        """The loss of rows `sl` of a packed batch (cut at `width`), and what adds its figures."""
        t = self.trainer
        ids, corr, adv_BL, mask, logp_ref_BL, _ = plan
        logp_mb = logp_BL if logp_BL is not None else t.logp(t.actor, ids[sl, :width])
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

        def account() -> None:
            sums.loss += float(loss.detach())
            sums.clipped += float(stats.clip_fraction) * float(stats.num_tokens)
            if kl_value is not None:
                sums.kl_values.append(kl_value)

        return loss, account


@dataclass
class _PolicySums:
    """What `_policy_backward` adds up over its micro-batches (and their pieces)."""

    loss: float = 0.0
    clipped: float = 0.0
    kl_values: list[float] = field(default_factory=list)


def _rows(part: list[int], mask_BL: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Row indices of a micro-batch and its width: the packed length, cut after the last column
    any of its rows has a completion token in (right padding beyond it changes nothing)."""
    sl = torch.tensor(part, dtype=torch.long, device=mask_BL.device)
    cols = mask_BL[sl].any(dim=0).nonzero()
    width = int(cols.max()) + 1 if len(cols) else 2
    return sl, width


def _by_parts(fn, ids_BL: torch.Tensor | None, parts: list, t: Trainer) -> torch.Tensor | None:
    """`fn` (a no-grad forward) over micro-batches of rows, reassembled in row order and padded
    to the batch's width; `None` parts are a lockstep rank's empty turns."""
    out = None
    for part in parts:
        if part is None:
            t.logp(t.actor, torch.full((1, 2), t.pad_token_id, dtype=torch.long))
            continue
        sl = torch.tensor(part, dtype=torch.long, device=ids_BL.device)
        values = fn(ids_BL[sl])
        if out is None:
            out = values.new_zeros(ids_BL.shape)
        out[sl] = values
    return out


class DistillationRecipe:
    # No group buffers: every trajectory's gradient is complete on its own.
    acc: StreamingAccumulator | None = None

    def __init__(self, trainer: Trainer) -> None:
        assert isinstance(trainer.objective, DistillationObjective)
        self.trainer = trainer
        self.objective: DistillationObjective = trainer.objective

    def begin_step(self) -> None:
        self.trained = 0  # lockstep: trajectories trained so far, in offer order

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
        per-token advantage log pi_T - sg(log pi) is recomputed under the student; the step
        counted these samples and their loss already."""
        t = self.trainer
        for part in t.microbatches(samples):
            if part is None:
                t.dummy_backward()
            else:
                t.backward_pieces([samples[i] for i in part], functools.partial(self._loss, account=account))

    def _loss(self, samples: Sequence[TrainSample], *, account: bool = True):
        """OPD loss of these trajectories and what accounts for it (`Trainer.backward_pieces`)."""
        t = self.trainer
        if any(s.teacher_logprobs is None for s in samples):
            raise ValueError("opd is enabled but a trajectory carries no teacher log-probs")
        batch = pack(samples, pad_token_id=t.pad_token_id, require_complete=False).to(t.device)
        teacher, ids, behav = (
            (x.to(t.dtype) if x.is_floating_point() else x).to(t.device)
            for x in pack_opd(samples, batch.input_ids_BL.shape[1])
        )
        mask = batch.completion_mask_BL
        logp_BLN = t.actor(batch.input_ids_BL, temperature=t.temperature, candidates_BLN=ids)
        loss, kl = self.objective.loss(logp_BLN[..., 0], logp_BLN, teacher, behav, ids, mask)

        def accounted() -> None:
            if not account:
                return
            tokens = float(mask.sum())
            t.totals.loss += float(loss.detach())
            t.totals.units += self.objective.units(mask)
            t.account(batch, samples, {"opd_kl": kl}, tokens=tokens, clipped=0.0)

        return loss, accounted


class _EpochPlan(NamedTuple):
    """A packed batch ready for loss and backward: what a later epoch re-runs."""

    ids_BL: torch.Tensor
    corr: Correction  # anchor log-probs, weights, mask: fixed at the step's start
    adv_BL: torch.Tensor
    mask_BL: torch.Tensor
    logp_ref_BL: torch.Tensor | None
    parts: list  # row indices per micro-batch (`Trainer.microbatches`)


def trained_tokens(sample: TrainSample) -> int:
    """Completion tokens the loss counts (all of them unless a loss mask drops some)."""
    if sample.loss_mask is None:
        return len(sample.completion_ids)
    return int(sample.loss_mask.sum())


def stats_dict(corr: Correction) -> dict[str, float]:
    return {k: float(v) for k, v in corr.stats._asdict().items()}
