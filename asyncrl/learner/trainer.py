"""The learner's optimizer-step engine (no sockets): streamed or whole-batch gradients, one update.

Place in the data flow: the learner service (`service.py`, and every data-parallel rank in
`ranks.py`) hands each received trajectory of the current step to `Trainer.offer`, calls
`Trainer.work` while there is work, and `Trainer.finish_step` once every trajectory of the step
is in. The model, optimizer and reference model live here.

Streaming (ALGORITHMS.md 5; `objective.py` says when it applies). A step holds three kinds of
trajectory: streamed (one forward and backward on arrival, folded into the group's S0/S1 sums of
`StreamingAccumulator`), waiting (not yet processed) and deferred (its gradient depends on
sign(A): it waits for its group). `work` does one unit, preferring groups whose rewards are all
in: their waiting members train in one batched backward with known advantages, and their streamed
members fold. Otherwise it streams one waiting trajectory of an open group. So the last reward of
a step costs about one trajectory's (or one group's) backward before the optimizer steps.

Whole-batch fallback: `batch_backward` trains the complete step at once (batch-global
corrections need every trajectory). Both paths produce the *sum* of per-trajectory loss
gradients; `finish_step` all-reduces it with the unit count (one collective per step), divides by
the global Z, clips, scales the learning rate (VCPO) and steps the optimizer. With
`learner.epochs` E > 1 (whole batches only) it then re-runs the batch E - 1 times under the
updated model, each time with the same anchor log-probs (the policy at the step's start),
corrections and advantages, and steps again: one gradient all-reduce per update.
"""

from __future__ import annotations

import copy
import math
from collections import defaultdict
from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.distributed as dist

from asyncrl.kernels.logprobs import causal_lm_logprobs, causal_lm_position_logprobs
from asyncrl.learner.advantages import group_rewards
from asyncrl.learner.objective import STREAM_ESTIMATOR, Objective
from asyncrl.learner.step import (
    PackedBatch,
    StepResult,
    StepTotals,
    TrainSample,
    pack,
    pack_opd,
    staleness_B,
)
from asyncrl.learner.streaming import StreamingAccumulator, flatten_grads, write_flat_grad
from asyncrl.staleness.base import Correction, StalenessPolicy, TokenBatch, with_current_as_prox
from asyncrl.staleness.ewma import EwmaParams
from asyncrl.staleness.exact import assemble_old_train_logp, versions_needed
from asyncrl.staleness.freshness import freshness_score


class StalenessViolation(AssertionError):
    """A trajectory older than the configured bound reached the learner (an admission bug)."""


class Trainer:
    def __init__(
        self,
        model: torch.nn.Module,
        objective: Objective,
        policy: StalenessPolicy,
        *,
        lr: float,
        weight_decay: float,
        optimizer: str = "adamw",
        max_grad_norm: float,
        temperature: float,
        top_p: float = 1.0,
        pad_token_id: int,
        group_size: int,
        micro_batch_size: int,
        max_open_groups: int,
        max_staleness: int,
        process_group: dist.ProcessGroup | None = None,
    ) -> None:
        self.model = model
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.objective = objective
        self.policy = policy
        self.lr = lr
        self.max_grad_norm = max_grad_norm
        self.temperature = max(temperature, 1e-6)
        self.top_p = top_p  # the generators' nucleus: log-probs are renormalised over it
        self.pad_token_id = pad_token_id
        self.group_size = group_size
        self.micro_batch_size = micro_batch_size
        self.max_open_groups = max_open_groups
        self.max_staleness = max_staleness
        self.process_group = process_group
        if optimizer == "sgd":
            self.optimizer = torch.optim.SGD(self.params, lr=lr, weight_decay=weight_decay)
        else:
            self.optimizer = torch.optim.AdamW(
                self.params, lr=lr, weight_decay=weight_decay, betas=(0.9, 0.99)
            )
        self.reference = None
        if objective.uses_reference:
            self.reference = copy.deepcopy(model).eval().requires_grad_(False)
        self.fallback = objective.fallback_reason(policy) or ""
        # Extra policy inputs: an EWMA of the parameters (PPO-EWMA) or snapshots of the last
        # max_staleness + 1 versions (exact old logits), each with a scratch model for forwards.
        self.ewma = None
        self.snapshots: dict[int, dict[str, torch.Tensor]] = {}
        self.scratch = None
        if "ewma" in policy.needs or "old_train" in policy.needs:
            self.scratch = copy.deepcopy(model).eval().requires_grad_(False)
        if "ewma" in policy.needs:
            self.ewma = EwmaParams.init(model.state_dict())
        if "old_train" in policy.needs:
            self.snapshots[0] = _snapshot(model)
        self.dtype = self.params[0].dtype
        self.epochs = objective.epochs
        self.step = -1

    # ------------------------------------------------------------------ step state
    def begin_step(self, step: int) -> None:
        self.step = step
        self.totals = StepTotals()
        # What later epochs re-run (learner.epochs > 1): packed batches, or OPD's samples.
        self.epoch_plans: list[_EpochPlan | Sequence[TrainSample]] = []
        self.members: dict[int, list[TrainSample]] = defaultdict(list)
        self.waiting: dict[int, list[TrainSample]] = defaultdict(list)
        self.deferred: set[int] = set()  # traj ids that tried to stream and could not
        self.streamed_loss: dict[int, list[tuple[int, float]]] = defaultdict(list)  # gid -> (slot, l(+1))
        self.acc = None
        if not self.fallback and self.objective.opd is None:
            self.acc = StreamingAccumulator(
                self.params,
                estimator=STREAM_ESTIMATOR[self.objective.advantage],
                agg=self.objective.agg,
                group_size=self.group_size,
                drop_degenerate_groups=self.objective.drop_degenerate_groups,
                max_open_groups=self.max_open_groups,
                norm_constant=1.0,
                dtype=self.dtype,
            )
        for p in self.params:
            p.grad = None

    def offer(self, sample: TrainSample) -> None:
        self.members[sample.group_id].append(sample)
        self.waiting[sample.group_id].append(sample)

    def num_waiting(self) -> int:
        """Trajectories offered this step and not trained yet."""
        return sum(len(w) for w in self.waiting.values())

    def has_work(self) -> bool:
        if self.objective.opd is not None and not self.fallback:
            return any(self.waiting.values())
        if self.acc is None:
            return False
        return any(self._streamable_now(gid) for gid in self.waiting) or bool(self._closable())

    def _closable(self) -> list[int]:
        return [g for g, w in self.waiting.items() if w and len(self.members[g]) == self.group_size]

    def _streamable_now(self, gid: int) -> bool:
        if not self.acc.is_open(gid) and self.acc.free_group_slots == 0:
            return False  # back-pressure: no S0/S1 buffers for another group now
        return any(s.traj_id not in self.deferred for s in self.waiting[gid])

    # ------------------------------------------------------------------ streaming
    def work(self) -> bool:
        """One unit of streaming work; False if there is nothing to do until more data arrives."""
        if self.objective.opd is not None and not self.fallback:
            chunk = [s for w in self.waiting.values() for s in w][: self.micro_batch_size]
            if not chunk:
                return False
            for s in chunk:
                self.waiting[s.group_id].remove(s)
            self._backward_opd(chunk)  # no groups: each trajectory's gradient is complete
            return True
        assert self.acc is not None, "work() is for streaming steps; use batch_backward"
        closable = self._closable()
        if closable:
            self._close_groups(closable)
            return True
        for gid, waiting in self.waiting.items():
            for sample in waiting:
                if sample.traj_id in self.deferred or not self._streamable_now(gid):
                    continue  # waits for its group (sign-dependent clip, or back-pressure)
                if self._stream_one(sample):
                    waiting.remove(sample)
                else:
                    self.deferred.add(sample.traj_id)
                    self.totals.deferred += 1
                return True
        return False

    def _stream_one(self, sample: TrainSample) -> bool:
        if sample.weight != 1.0:
            return False  # a weighted group trains when complete (its advantages are scaled)
        batch = pack([sample], pad_token_id=self.pad_token_id)
        logp_1L = self._logp(self.model, batch.input_ids_BL)
        corr = self._correct(batch, logp_1L.detach(), torch.ones(1, dtype=self.dtype))
        found = self.objective.stream_loss(logp_1L, corr, batch.completion_mask_BL)
        if found is None:
            return False
        loss_pos, stats = found
        # autograd.grad leaves `.grad` alone: it holds the step's sum over complete groups.
        grads = torch.autograd.grad(loss_pos, self.params, allow_unused=True)
        h_P = torch.cat(
            [
                (g if g is not None else torch.zeros_like(p)).reshape(-1)
                for g, p in zip(grads, self.params, strict=True)
            ]
        ).neg_()
        self.acc.add_trajectory(
            h_P, num_tokens=_trained_tokens(sample), group_id=sample.group_id, reward=sample.reward
        )
        self.streamed_loss[sample.group_id].append((sample.sample_index, float(loss_pos.detach())))
        self._account(
            batch,
            [sample],
            _stats_dict(corr),
            tokens=float(stats.num_tokens),
            clipped=float(stats.clip_fraction) * float(stats.num_tokens),
        )
        self.totals.streamed += 1
        return True

    def _close_groups(self, gids: list[int]) -> None:
        """Train the waiting members of complete groups with known advantages, then fold."""
        chunk = [s for g in gids for s in self.waiting[g]]
        adv_of = {}
        keep_of = {}
        for g in gids:
            members = sorted(self.members[g], key=lambda s: s.sample_index)
            rewards_1N = torch.tensor([[s.reward for s in members]], dtype=torch.float64)
            adv_1N, keep_1N = self.objective.group_advantages(rewards_1N)
            for k, s in enumerate(members):
                adv_of[s.traj_id] = float(adv_1N[0, k]) * s.weight
                keep_of[s.traj_id] = bool(keep_1N[0, k])
            # Streamed members' loss value: A_i * l_i(+1), their gradient folds from S0/S1.
            for slot, loss_pos in self.streamed_loss.pop(g, []):
                k = [s.sample_index for s in members].index(slot)
                self.totals.loss += float(adv_1N[0, k]) * loss_pos
        for start in range(0, len(chunk), self.micro_batch_size):
            part = chunk[start : start + self.micro_batch_size]
            self._backward_chunk(
                part,
                torch.tensor([adv_of[s.traj_id] for s in part], dtype=self.dtype),
                torch.tensor([keep_of[s.traj_id] for s in part]),
            )
        # Their gradient stays in `.grad` (summed with the step's other complete groups); the
        # streamed members of these groups fold from S0/S1 into the accumulator.
        for g in gids:
            known = self.waiting.pop(g)
            self.acc.close_with_known(
                g,
                [s.reward for s in known],
                num_tokens=sum(_trained_tokens(s) for s in known),
            )

    # ------------------------------------------------------------------ shared pieces
    def _scratch_logp(self, state: dict[str, torch.Tensor], ids_BL: torch.Tensor) -> torch.Tensor:
        self.scratch.load_state_dict(state, strict=True)
        mb = self.micro_batch_size
        with torch.no_grad():
            return torch.cat(
                [self._logp(self.scratch, ids_BL[i : i + mb]) for i in range(0, ids_BL.shape[0], mb)]
            )

    def _policy_inputs(self, batch: PackedBatch) -> dict[str, torch.Tensor]:
        """The optional TokenBatch inputs the policy needs beyond the current forward."""
        extra = {}
        if self.ewma is not None:
            state = {k: v.to(self.dtype) if v.is_floating_point() else v for k, v in self.ewma.params.items()}
            extra["logp_ewma_BT"] = self._scratch_logp(state, batch.input_ids_BL)
        if "old_train" in self.policy.needs:
            mask = batch.completion_mask_BL
            by_version = {}
            for v in versions_needed(batch.versions_BL, mask):
                if v not in self.snapshots:
                    raise StalenessViolation(
                        f"step {self.step}: no snapshot of version {v} (kept: {sorted(self.snapshots)})"
                    )
                by_version[v] = self._scratch_logp(self.snapshots[v], batch.input_ids_BL)
            extra["logp_old_train_BT"] = assemble_old_train_logp(
                batch.versions_BL, by_version, mask, dtype=self.dtype
            )
        return extra

    def _after_update(self) -> None:
        """Track the new version for the EWMA and snapshot policies."""
        if self.ewma is not None:
            self.ewma = self.ewma.update(
                self.model.state_dict(), decay=getattr(self.policy, "base", self.policy).decay
            )
        if "old_train" in self.policy.needs:
            version = self.step + 1
            self.snapshots[version] = _snapshot(self.model)
            for old in [v for v in self.snapshots if v < version - self.max_staleness]:
                del self.snapshots[old]

    def _correct(self, batch: PackedBatch, logp_now_BL: torch.Tensor, adv_B: torch.Tensor):
        mask = batch.completion_mask_BL
        token_batch = with_current_as_prox(
            TokenBatch(
                logp_BT=logp_now_BL,
                logp_behav_BT=batch.behavior_logp_BL.to(self.dtype),
                mask_BT=mask,
                versions_BT=batch.versions_BL,
                adv_BT=torch.where(mask, adv_B.to(self.dtype)[:, None], 0.0),
                policy_version=self.step,
                **self._policy_inputs(batch),
            )
        )
        corr = self.policy.correct(token_batch)
        if math.isnan(float(corr.stats.mean_freshness)):
            # Freshness is a metric whether or not it weights the loss: the same score
            # (staleness/freshness.py, default lambdas) over this batch's sequences.
            valid_B = mask.any(dim=1)
            f_B = freshness_score(
                logp_now_BL.detach(), token_batch.logp_behav_BT, mask, lambda_roll=1.0, lambda_sup=1.0
            )
            mean_f = f_B[valid_B].mean() if bool(valid_B.any()) else f_B.new_tensor(float("nan"))
            corr = corr._replace(stats=corr.stats._replace(mean_freshness=mean_f))
        return corr

    def _account(
        self, batch: PackedBatch, samples, stats: dict[str, float], *, tokens: float, clipped: float
    ) -> None:
        stale_B = staleness_B(batch, self.step)
        # A down-weighted group (buffer.action = "downweight") is past the bound by design.
        bounded_B = torch.tensor([s.weight == 1.0 for s in samples])
        if bool(bounded_B.any()) and int(stale_B[bounded_B].max()) > self.max_staleness:
            raise StalenessViolation(
                f"step {self.step}: a trajectory is {int(stale_B.max())} versions stale, above the bound "
                f"{self.max_staleness}"
            )
        self.totals.add_samples(samples, stale_B)
        self.totals.tokens += tokens
        self.totals.clipped_tokens += clipped
        self.totals.add_stats(stats, tokens)

    def _logp(self, model, ids_BL: torch.Tensor) -> torch.Tensor:
        return causal_lm_logprobs(model, ids_BL, temperature=self.temperature, top_p=self.top_p).logp

    def _backward_chunk(
        self, samples: Sequence[TrainSample], adv_B: torch.Tensor, keep_B: torch.Tensor
    ) -> None:
        """Loss over complete-group members with known advantages (local policies only):
        gradients accumulate into `.grad`."""
        batch = pack(samples, pad_token_id=self.pad_token_id, require_complete=False)
        mask = batch.completion_mask_BL & keep_B[:, None]
        logp_BL = self._logp(self.model, batch.input_ids_BL)
        corr = self._correct(batch, logp_BL.detach(), adv_B)
        adv_BL = torch.where(mask, adv_B[:, None], 0.0)
        loss, stats = self.objective.policy_loss(logp_BL, corr, adv_BL, mask)
        loss.backward()
        self.totals.loss += float(loss.detach())
        tokens = float(stats.num_tokens)
        self._account(
            batch, samples, _stats_dict(corr), tokens=tokens, clipped=float(stats.clip_fraction) * tokens
        )

    def _backward_opd(self, samples: Sequence[TrainSample], *, account: bool = True) -> None:
        """OPD loss of these trajectories; gradients accumulate into `.grad` (streams per chunk).
        `account` False: a later epoch, whose samples and loss the step has counted already."""
        if any(s.teacher_logprobs is None for s in samples):
            raise ValueError("opd is enabled but a trajectory carries no teacher log-probs")
        batch = pack(samples, pad_token_id=self.pad_token_id, require_complete=False)
        teacher, ids, behav = (
            t.to(self.dtype) if t.is_floating_point() else t
            for t in pack_opd(samples, batch.input_ids_BL.shape[1])
        )
        mask = batch.completion_mask_BL
        logp_BLN = causal_lm_position_logprobs(
            self.model, batch.input_ids_BL, ids, temperature=self.temperature
        )
        loss, kl = self.objective.opd_loss(logp_BLN[..., 0], logp_BLN, teacher, behav, ids, mask)
        loss.backward()
        if not account:
            return
        tokens = float(mask.sum())
        self.totals.loss += float(loss.detach())
        self.totals.units += self.objective.units(mask)
        self._account(batch, samples, {"opd_kl": kl}, tokens=tokens, clipped=0.0)

    # ------------------------------------------------------------------ whole batch
    def batch_backward(self, samples: Sequence[TrainSample]) -> None:
        """The whole step at once (the fallback): corrections see every trajectory of this rank.
        Packed in trajectory-id order, so the arithmetic does not depend on arrival order."""
        samples = sorted(samples, key=lambda s: s.traj_id)
        if self.objective.opd is not None:
            for start in range(0, len(samples), self.micro_batch_size):
                self._backward_opd(samples[start : start + self.micro_batch_size])
            if self.epochs > 1:
                self.epoch_plans.append(samples)
            return
        batch = pack(samples, pad_token_id=self.pad_token_id)
        ids = batch.input_ids_BL
        num = ids.shape[0]
        mb = self.micro_batch_size
        single = num <= mb and self.reference is None
        with torch.no_grad():
            logp_ref_BL = None
            if self.reference is not None:
                logp_ref_BL = torch.cat(
                    [self._logp(self.reference, ids[i : i + mb]) for i in range(0, num, mb)]
                )
        if single:
            logp_BL = self._logp(self.model, ids)
            logp_now_BL = logp_BL.detach()
        else:
            with torch.no_grad():
                logp_now_BL = torch.cat([self._logp(self.model, ids[i : i + mb]) for i in range(0, num, mb)])
        valid = batch.completion_mask_BL
        rewards_B = batch.reward_B.double()
        if logp_ref_BL is not None:
            rewards_B = rewards_B + self.objective.kl_reward_penalty(logp_now_BL, logp_ref_BL, valid)
        rewards_GN = group_rewards(
            rewards_B, batch.group_B, batch.slot_B, num_groups=batch.num_groups, group_size=batch.group_size
        )
        adv_GN, keep_GN = self.objective.group_advantages(rewards_GN)
        adv_B = adv_GN[batch.group_B, batch.slot_B].to(self.dtype)
        if any(s.weight != 1.0 for s in samples):
            adv_B = adv_B * torch.tensor([s.weight for s in samples], dtype=self.dtype)
        mask = valid & keep_GN[batch.group_B, batch.slot_B][:, None]
        corr = self._correct(batch, logp_now_BL, adv_B)
        adv_BL = torch.where(mask, adv_B[:, None], 0.0)
        plan = _EpochPlan(ids, corr, adv_BL, mask, logp_ref_BL)
        if self.epochs > 1:
            self.epoch_plans.append(plan)
        loss_sum, clipped, kl_values = self._policy_backward(plan, logp_BL if single else None)
        self.totals.loss += loss_sum
        self.totals.units += self.objective.units(mask)
        self.totals.lr_scale = corr.lr_scale
        stats = _stats_dict(corr)
        if kl_values:
            stats["kl"] = sum(kl_values) / len(kl_values)
        self._account(batch, samples, stats, tokens=float(mask.sum()), clipped=clipped)

    def _policy_backward(
        self, plan: _EpochPlan, logp_BL: torch.Tensor | None = None
    ) -> tuple[float, float, list[float]]:
        """Loss and backward of a packed batch, micro-batch by micro-batch, under the model as it
        is now (`logp_BL`: its log-probs, with grad, when the caller already has them for the whole
        batch). Returns the summed loss, the clipped token count and the KL values."""
        ids, corr, adv_BL, mask, logp_ref_BL = plan
        mb = self.micro_batch_size
        kl_values: list[float] = []
        loss_sum = clipped = 0.0
        for start in range(0, ids.shape[0], mb):
            sl = slice(start, start + mb)
            logp_mb = logp_BL if logp_BL is not None else self._logp(self.model, ids[sl])
            part = corr._replace(
                logp_anchor_BT=corr.logp_anchor_BT[sl], weight_BT=corr.weight_BT[sl], mask_BT=corr.mask_BT[sl]
            )
            loss, stats = self.objective.policy_loss(logp_mb, part, adv_BL[sl], mask[sl])
            if logp_ref_BL is not None:
                kl, kl_value = self.objective.kl_term(
                    logp_mb, logp_ref_BL[sl], mask[sl], part.weight_BT * part.mask_BT
                )
                loss = loss + kl
                kl_values.append(kl_value)
            loss.backward()
            loss_sum += float(loss.detach())
            clipped += float(stats.clip_fraction) * float(stats.num_tokens)
        return loss_sum, clipped, kl_values

    def _later_epoch_backward(self) -> None:
        """One more pass over the step's batch under the updated model: same anchors, corrections
        and advantages (PPO epochs); OPD recomputes its per-token advantage under the student."""
        for plan in self.epoch_plans:
            if isinstance(plan, _EpochPlan):
                self._policy_backward(plan)
                continue
            for start in range(0, len(plan), self.micro_batch_size):
                self._backward_opd(plan[start : start + self.micro_batch_size], account=False)

    def _apply_gradient(self, grad_P: torch.Tensor, lr_scale: float) -> float:
        """Write the (already reduced and scaled) gradient, clip, step; returns the norm before clipping."""
        write_flat_grad(self.params, grad_P)
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.params, self.max_grad_norm))
        for group in self.optimizer.param_groups:
            group["lr"] = self.lr * lr_scale
        self.optimizer.step()
        for p in self.params:
            p.grad = None
        return grad_norm

    # ------------------------------------------------------------------ the update
    def finish_step(self) -> StepResult:
        t = self.totals
        if self.waiting and any(self.waiting.values()):
            raise RuntimeError(f"step {self.step}: trajectories still waiting at the step boundary")
        if self.acc is not None:
            units_local = float(self.acc.num_units)
            grad_P, stream_stats = self.acc.finish(1.0)  # the streamed groups' summed loss gradient
            grad_P = grad_P + flatten_grads(self.params, dtype=self.dtype)  # plus complete groups'
            peak = stream_stats.peak_memory_bytes
        else:
            units_local = t.units
            grad_P = flatten_grads(self.params, dtype=self.dtype)
            peak = 0
        summed = torch.tensor(
            [units_local, t.loss, t.clipped_tokens, t.tokens, t.reward, t.seqs, t.staleness_sum],
            dtype=torch.float64,
        )
        if self.process_group is not None:
            flat = torch.cat([grad_P.to(torch.float64), summed])
            dist.all_reduce(flat, group=self.process_group)  # the step's one collective
            grad_P, summed = flat[: grad_P.numel()].to(self.dtype), flat[grad_P.numel() :]
        units, loss, clipped, tokens, reward, seqs, stale_sum = summed.tolist()
        denominator = self.objective.denominator(units)
        scale = 1.0 / denominator if denominator > 0 else 0.0
        grad_norm = self._apply_gradient(grad_P * scale, t.lr_scale)
        for _ in range(1, self.epochs):  # the same Z: the masks do not change between epochs
            self._later_epoch_backward()
            grad_P = flatten_grads(self.params, dtype=self.dtype)
            if self.process_group is not None:
                dist.all_reduce(grad_P, group=self.process_group)
            grad_norm = self._apply_gradient(grad_P * scale, t.lr_scale)
        self.epoch_plans = []
        self._after_update()
        stats = {k: v / max(t.stats_tokens, 1e-12) for k, v in t.stats.items()}
        return StepResult(
            step=self.step,
            num_trajectories=int(seqs),
            num_tokens=int(tokens),
            loss=loss * scale,
            mean_reward=reward / max(seqs, 1.0),
            max_staleness=t.max_staleness,
            mean_staleness=stale_sum / max(seqs, 1.0),
            clip_fraction=clipped / max(tokens, 1.0),
            grad_norm=grad_norm,
            lr_scale=t.lr_scale,
            policy_stats=stats,
            streamed=t.streamed,
            deferred=t.deferred,
            peak_stream_bytes=peak,
            fallback=self.fallback,
        )


class _EpochPlan(NamedTuple):
    """A packed batch ready for loss and backward: what a later epoch re-runs."""

    ids_BL: torch.Tensor
    corr: Correction  # anchor log-probs, weights, mask: fixed at the step's start
    adv_BL: torch.Tensor
    mask_BL: torch.Tensor
    logp_ref_BL: torch.Tensor | None


def _trained_tokens(sample: TrainSample) -> int:
    """Completion tokens the loss counts (all of them unless a loss mask drops some)."""
    if sample.loss_mask is None:
        return len(sample.completion_ids)
    return int(sample.loss_mask.sum())


def _snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _stats_dict(corr) -> dict[str, float]:
    return {k: float(v) for k, v in corr.stats._asdict().items()}
