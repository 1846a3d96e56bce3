"""The configured training objective (pure): RL (advantages, policy loss, KL) or on-policy
distillation, and whether it streams.

Place in the data flow: the learner's `Trainer` builds one `Objective` from `learner.*` (and
`opd.*`) with `Objective.from_config`, which returns an `RLObjective`, a
`DistillationObjective`, or (`opd.reward` != "off") a `CombinedObjective`: the RL objective plus a
distillation term; the trainer's work for that kind (`rl_work.py`, `distill_work.py`) asks it for
group advantages and for the loss of a packed chunk of trajectories and, per arriving trajectory,
for the sign-free streamed loss (`stream_loss`). The staleness policy describes itself
(`asyncrl.staleness.base.StalenessPolicy`); nothing here lists policy names.

Every loss here is an *unnormalised sum*: aggregation denominators are 1, and the trainer divides
the summed gradient by the global Z (all-reduced over data-parallel ranks) once per step. So a
chunk, a micro-batch or a rank contributes a plain sum, and any split gives the same gradient.

When does a trajectory stream on its own (ALGORITHMS.md 5.5)? Its gradient must be linear in its
advantage A_i, which is unknown until the group closes. Write the per-token loss as l(A) (the
loss with advantage A); it streams when l(A) = A l(+1), value and gradient. The loss's registry
entry decides (`PolicyLoss.linear_in_advantage`): for PPO and GSPO when no clip binds at A = +1 or
A = -1 (their stats report it), for CISPO always, for SAPO when tau_pos = tau_neg. Then
h_i = -grad l(+1) and the group's S0/S1 sums give sum_i A_i h_i. Otherwise the trajectory waits
for its group (all of its members are then trained with known advantages in one backward).
Whole-batch fallbacks (`fallback_reason`) cover what is never per-trajectory: batch-global
corrections (`StalenessPolicy.batch_global`), MC-GRPO's median pivot, KL terms (they need the
reference model's forward), several epochs per batch (`learner.epochs` > 1: an epoch's gradient
depends on the update before it) and `learner.streaming = "off"`. Distillation's per-token teacher
advantages need no group, so each of its trajectories streams on its own; so does its gated,
token-selected form (`opd_mix.py`), whose weights are the trajectory's own. In a combined objective
the RL part streams into the group sums and the distillation part straight into the step's sum.

`staleness.vcpo_baseline = "opob"` (VCPO's off-policy optimal baseline, ALGORITHMS.md 2.2) replaces
the group mean by b_g = sum W_i R_i / sum W_i, W_i = ||h_i||^2: it needs each trajectory's own
gradient, so every trajectory takes its own backward into the group sums (the accumulator keeps
the norms) and the group folds with b_g when it closes; a batch-global correction whose only
batch-global part is its learning-rate scale (VCPO's ESS) is then taken over the step at its end.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

import torch

from asyncrl.learner.advantages import (
    dr_grpo_advantages,
    gdpo_advantages,
    gdpo_batch_scale,
    grpo_advantages,
    k1_sequence_penalty,
    mc_grpo_advantages,
    ragged_advantages,
    rloo_advantages,
    valid_slots,
)
from asyncrl.learner.guidance import guided_advantages, shaped_loss
from asyncrl.learner.kl import kl_loss
from asyncrl.learner.losses import LossStats, aggregate
from asyncrl.learner.opd import multi_sample_reverse_kl, pg_kl_loss
from asyncrl.learner.opd_mix import outcome_gate, select_tokens, selection_scores
from asyncrl.learner.policy_losses import PolicyLoss, SignProbe, policy_loss
from asyncrl.staleness.base import Correction, StalenessPolicy

if TYPE_CHECKING:
    from asyncrl.config import Config

# Clip bounds that never bind: ratios live in (0, e^MAX_LOG_RATIO], so clip_low=1 and an infinite
# clip_high leave the surrogate unclipped (M2PO and VCPO use their mask or weights instead).
NO_CLIP = (1.0, float("inf"))

# Streaming estimators of `StreamingAccumulator` for each advantage (MC-GRPO never streams).
STREAM_ESTIMATOR = {"grpo": "grpo", "dr_grpo": "dr_grpo", "rloo": "rloo"}


def batch_global_lr_only(policy: StalenessPolicy) -> bool:
    """Whether the policy's only batch-global part is its `lr_scale` (VCPO's ESS): its weights and
    anchor are per trajectory. A policy says so itself (`batch_global_lr_only`); unknown: False."""
    return bool(getattr(policy, "batch_global_lr_only", False))


class DistillStats(NamedTuple):
    """Detached sums of one distillation term (local to the call)."""

    loss: float  # the term's unnormalised loss (kl_weight included)
    kl: float  # mean divergence estimate over valid tokens
    num_tokens: float  # valid tokens
    num_selected: float  # valid tokens `opd.select` kept
    num_distilled: float  # selected tokens whose trajectory's gate is > 0: their OPD term is used

    def plus(self, other: DistillStats) -> DistillStats:
        """The figures of both calls together (the KL estimate token-weighted)."""
        num = self.num_tokens + other.num_tokens
        kl = (self.kl * self.num_tokens + other.kl * other.num_tokens) / num if num > 0 else self.kl
        return DistillStats(
            self.loss + other.loss,
            kl,
            num,
            self.num_selected + other.num_selected,
            self.num_distilled + other.num_distilled,
        )

    def report(self) -> dict[str, float]:
        """The step-stats entries: the KL estimate, the fraction of valid tokens `opd.select`
        kept, and the fraction of the teacher's scores the loss did not use (tokens not selected,
        or of trajectories whose gate is 0: a teacher placed after selection and gating could
        have skipped them)."""
        num = max(self.num_tokens, 1.0)
        return {
            "opd_kl": self.kl,
            "opd_selected_fraction": self.num_selected / num,
            "opd_teacher_scores_unused": 1.0 - self.num_distilled / num,
        }


@dataclass(frozen=True, kw_only=True)
class Objective:
    """What every objective shares: how a step's loss sum is normalised and when it streams."""

    agg: str
    norm_constant: float
    streaming: str
    epochs: int = 1  # optimizer updates per batch
    minibatches: int = 1  # ... by minibatches of the batch's groups, each against the same anchor

    @property
    def distills(self) -> bool:
        """Whether a teacher's per-token signal is in the loss (its part is reported apart)."""
        return False

    @staticmethod
    def from_config(config: Config) -> Objective:
        """The configured objective: distillation when `opd.enabled`, RL otherwise."""
        lrn = config.learner
        common = dict(
            agg=lrn.agg,
            norm_constant=float(lrn.norm_constant or config.sampling.max_new_tokens),
            streaming=lrn.streaming,
            epochs=lrn.epochs,
            minibatches=lrn.minibatches,
        )
        opd = config.opd
        distill = None
        if opd.enabled:
            distill = DistillationObjective(
                estimator=opd.estimator,
                clip_eps=opd.clip_eps,
                select=opd.select,
                select_fraction=opd.select_fraction,
                kl_weight=opd.kl_weight,
                **common,
            )
            if opd.reward == "off":
                return distill
        clip_low, clip_high = lrn.clip_range() or (None, None)
        rl = dict(
            advantage=lrn.advantage,
            loss=lrn.loss,
            loss_params=policy_loss(lrn.loss).resolve_params(lrn.loss_params),
            clip_low=clip_low,
            clip_high=clip_high,
            dual_clip=lrn.dual_clip,
            drop_degenerate_groups=lrn.drop_degenerate_groups,
            kl_coef=lrn.kl_coef,
            kl_estimator=lrn.kl_estimator,
            kl_placement=lrn.kl_placement,
            baseline=config.staleness.vcpo_baseline,
            reward_weights=tuple(float(r.weight) for r in config.task.rewards),
            guidance=config.sampling.guidance.prefix_loss if config.sampling.guidance.enabled else "off",
            guidance_gamma=config.sampling.guidance.gamma,
            **common,
        )
        if distill is None:
            return RLObjective(**rl)
        return CombinedObjective(
            **rl,
            distill=distill,
            reward_mode=opd.reward,
            reward_weight=opd.reward_weight,
            pass_reward=opd.pass_reward,
        )

    # -- units ---------------------------------------------------------------------------------

    def units(self, mask_BT: torch.Tensor) -> float:
        """This chunk's share of Z: tokens (token-mean) or sequences (seq-mean-*); 0 for the
        constant-normaliser mode, whose Z is `norm_constant` whatever the batch."""
        if self.agg == "token-mean":
            return float(mask_BT.sum())
        if self.agg == "seq-mean-token-sum-norm":
            return 0.0
        return float(mask_BT.any(dim=1).sum())

    def denominator(self, units_global: float) -> float:
        return self.norm_constant if self.agg == "seq-mean-token-sum-norm" else units_global

    # -- streaming -----------------------------------------------------------------------------

    def fallback_reason(self, policy: StalenessPolicy) -> str | None:
        """Why this configuration trains whole batches instead of streaming (None: it streams)."""
        if self.streaming == "off":
            return "learner.streaming = 'off'"
        if self.epochs > 1:
            return f"learner.epochs = {self.epochs}: each later epoch needs the update of the one before"
        if self.minibatches > 1:
            return f"learner.minibatches = {self.minibatches}: each minibatch's update needs the one before"
        return None


@dataclass(frozen=True, kw_only=True)
class RLObjective(Objective):
    """Policy-gradient RL: group advantages, a policy loss from the registry (`policy_losses.py`)
    under the staleness correction, and an optional KL term to the initial model."""

    advantage: str
    loss: str  # a `POLICY_LOSSES` name
    clip_low: float | None  # None for a loss that never clips (its entry's `clip` is None)
    clip_high: float | None
    dual_clip: float | None
    drop_degenerate_groups: bool
    kl_coef: float
    kl_estimator: str
    kl_placement: str
    baseline: str = "group_mean"  # staleness.vcpo_baseline: group_mean, opob, opob_released
    loss_params: Mapping[str, float] = field(default_factory=dict)  # the loss's own hyperparameters
    # task.rewards' weights, in order: GDPO (advantage "gdpo") normalises each reward, then weighs.
    reward_weights: tuple[float, ...] = ()
    # Guided samples (sampling.guidance, `guidance.py`): "off", or how their forced prefix trains:
    # "mask" (no gradient) or "shaped" (LUFFY: -A f(pi), f(p) = p / (p + guidance_gamma)).
    guidance: str = "off"
    guidance_gamma: float = 0.1

    @property
    def policy(self) -> PolicyLoss:
        """The registry entry of `loss`."""
        return policy_loss(self.loss)

    @property
    def opob(self) -> bool:
        """The off-policy optimal baseline: one backward per trajectory, folded per group."""
        return self.baseline != "group_mean"

    # -- advantages ----------------------------------------------------------------------------

    def group_advantages(
        self,
        rewards_GN: torch.Tensor,
        parts_GNK: torch.Tensor | None = None,
        guided_GN: torch.Tensor | None = None,
        sizes_G: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(adv_GN, keep_GN): keep is False for MC-GRPO's pivot and for dropped degenerate groups.

        `parts_GNK`: each reward's unweighted value (task.rewards order), which "gdpo" needs (the
        whole batch: it renormalises over it); `guided_GN`: the guided members, whose group's
        baseline comes from its unguided members (`guidance.guided_advantages`). `sizes_G`:
        groups of unequal sizes (rollout budgets, padded [G, N]): each group over its own
        members (`advantages.ragged_advantages`), GDPO's batch scale over every member."""
        if sizes_G is None:
            return self._equal_groups(rewards_GN, parts_GNK, guided_GN)
        if guided_GN is not None and bool(guided_GN.any()):
            raise ValueError("guided rollouts with rollout budgets are refused at load (config_budget.py)")
        adv_GN, keep_GN = ragged_advantages(
            rewards_GN,
            sizes_G,
            lambda rewards, parts: self._equal_groups(rewards, parts, None, batch_norm=False),
            parts_GNK,
        )
        if self.advantage == "gdpo":
            adv_GN = gdpo_batch_scale(adv_GN, members=valid_slots(sizes_G, rewards_GN.shape[1]))
        return adv_GN, keep_GN

    def _equal_groups(
        self,
        rewards_GN: torch.Tensor,
        parts_GNK: torch.Tensor | None,
        guided_GN: torch.Tensor | None,
        *,
        batch_norm: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`group_advantages` of groups of one size; `batch_norm`: GDPO's batch scale."""
        keep_GN = torch.ones_like(rewards_GN, dtype=torch.bool)
        if guided_GN is not None and bool(guided_GN.any()):
            adv_GN = guided_advantages(rewards_GN, guided_GN, advantage=self.advantage)
        elif self.advantage == "grpo":
            adv_GN = grpo_advantages(rewards_GN)
        elif self.advantage == "dr_grpo":
            adv_GN = dr_grpo_advantages(rewards_GN)
        elif self.advantage == "rloo":
            adv_GN = rloo_advantages(rewards_GN)
        elif self.advantage == "mc_grpo":
            mc = mc_grpo_advantages(rewards_GN)
            adv_GN, keep_GN = mc.adv_GN, ~mc.pivot_GN
        elif self.advantage == "gdpo":
            adv_GN = gdpo_advantages(
                self._gdpo_parts(rewards_GN, parts_GNK), self._weights_K(), batch_norm=batch_norm
            )
        else:
            raise ValueError(
                f"learner.advantage {self.advantage!r} is not an estimator the learner knows; "
                "choose grpo, dr_grpo, rloo, mc_grpo or gdpo"
            )
        if self.drop_degenerate_groups:
            flat = rewards_GN[..., None] if self.advantage != "gdpo" else parts_GNK
            degenerate_G1 = (flat == flat[:, :1]).all(dim=2).all(dim=1, keepdim=True)
            keep_GN = keep_GN & ~degenerate_G1
        return adv_GN, keep_GN

    def _weights_K(self) -> torch.Tensor:
        return torch.tensor(self.reward_weights, dtype=torch.float64)

    def _gdpo_parts(self, rewards_GN: torch.Tensor, parts_GNK: torch.Tensor | None) -> torch.Tensor:
        """The per-reward values GDPO normalises; ValueError when trajectories came without them."""
        want = len(self.reward_weights)
        if parts_GNK is None or parts_GNK.shape != (*rewards_GN.shape, want):
            got = "none" if parts_GNK is None else f"shape {tuple(parts_GNK.shape)}"
            raise ValueError(
                f"learner.advantage = 'gdpo' needs each trajectory's {want} reward values (task.rewards, "
                f"Trajectory.reward_parts) for rewards {tuple(rewards_GN.shape)}, got {got}"
            )
        return parts_GNK.to(torch.float64)

    @property
    def shapes_guided(self) -> bool:
        """Whether guided prefix tokens train under LUFFY's shaped loss (else they carry no gradient)."""
        return self.guidance == "shaped"

    def guided_prefix_loss(
        self, logp_BT: torch.Tensor, adv_BT: torch.Tensor, prefix_BT: torch.Tensor
    ) -> torch.Tensor:
        """Unnormalised loss of guided prefix tokens `prefix_BT` (`guidance.shaped_loss`)."""
        return shaped_loss(logp_BT, adv_BT, prefix_BT, gamma=self.guidance_gamma)

    @property
    def uses_reference(self) -> bool:
        return self.kl_coef > 0

    def kl_reward_penalty(self, logp_BT, logp_ref_BT, mask_BT) -> torch.Tensor:
        """k1 in the reward: -kl_coef * sum_t (logp - logp_ref) per sequence (0 when KL is in the loss)."""
        if not self.uses_reference or self.kl_placement != "reward":
            return torch.zeros(mask_BT.shape[0], dtype=torch.float64)
        return k1_sequence_penalty(logp_BT - logp_ref_BT, mask_BT, kl_coef=self.kl_coef).double()

    # -- losses --------------------------------------------------------------------------------

    def policy_loss(
        self, logp_BT: torch.Tensor, corr: Correction, adv_BT: torch.Tensor, mask_BT: torch.Tensor
    ) -> tuple[torch.Tensor, LossStats]:
        """Unnormalised policy loss (sum over this chunk) under the staleness correction.

        `mask_BT` is the valid-token mask (it defines the aggregation); the correction's own mask
        zeroes rejected tokens through the weight, so rejection never changes a denominator."""
        return self.policy.fn(
            logp_BT,
            corr.logp_anchor_BT,
            adv_BT,
            mask_BT,
            corr.weight_BT * corr.mask_BT,
            **self._loss_keywords(use_clip=corr.use_clip),
            mode=self.agg,
            num_tokens_global=1.0,
            num_seqs_global=1.0,
            norm_constant=1.0,
        )

    def _loss_keywords(self, *, use_clip: bool) -> dict[str, float | None]:
        """The loss function's keywords: the clip range if it takes one (never binding where the
        staleness correction replaces the clip, `use_clip` False), the dual clip if it takes it,
        and its own `loss_params`."""
        entry = self.policy
        kwargs: dict[str, float | None] = dict(self.loss_params)
        if entry.clip is not None:
            kwargs["clip_low"], kwargs["clip_high"] = (self.clip_low, self.clip_high) if use_clip else NO_CLIP
        if entry.dual_clip:
            kwargs["dual_clip"] = self.dual_clip if use_clip else None
        return kwargs

    def kl_term(self, logp_BT, logp_ref_BT, mask_BT, weight_BT) -> tuple[torch.Tensor, float]:
        """kl_coef * unnormalised KL loss (0 unless KL is in the loss) and the mean estimate."""
        if not self.uses_reference or self.kl_placement != "loss":
            return logp_BT.new_zeros(()), float("nan")
        loss, stats = kl_loss(
            logp_BT,
            logp_ref_BT,
            mask_BT,
            weight_BT,
            estimator=self.kl_estimator,
            mode=self.agg,
            num_tokens_global=1.0,
            num_seqs_global=1.0,
            norm_constant=1.0,
        )
        return self.kl_coef * loss, float(stats.kl)

    # -- streaming -----------------------------------------------------------------------------

    @property
    def stream_estimator(self) -> str | None:
        """The `StreamingAccumulator` estimator of this advantage (None: it never streams)."""
        return STREAM_ESTIMATOR.get(self.advantage)

    def fallback_reason(self, policy: StalenessPolicy) -> str | None:
        reason = super().fallback_reason(policy)
        if reason is not None:
            return reason
        if self.advantage == "gdpo":
            return "advantage 'gdpo' normalises each reward over its group, then the sum over the whole batch"
        if self.stream_estimator is None:
            return f"advantage {self.advantage!r} needs the whole group (median pivot)"
        if self.guidance != "off":
            return "guided samples (sampling.guidance) take their group's baseline from its unguided members"
        if self.uses_reference:
            return "a KL term needs the reference model's log-probs and a second weighting of the scores"
        if policy.batch_global and not (self.opob and batch_global_lr_only(policy)):
            return f"staleness policy {policy.name!r} uses batch-global statistics"
        if not policy.streamable and not policy.clip_only_sign_dependence:
            return f"staleness policy {policy.name!r} clips against an anchor other than the current policy (sign(A))"
        return None

    def stream_loss(
        self, logp_BT: torch.Tensor, corr: Correction, mask_BT: torch.Tensor
    ) -> tuple[torch.Tensor, LossStats] | None:
        """The loss at A = +1 for one trajectory, if its loss is linear in A (the registry entry
        decides: `PolicyLoss.linear_in_advantage`); None if it must wait for its group's advantages."""
        pos, stats = self.policy_loss(logp_BT, corr, mask_BT.to(logp_BT.dtype), mask_BT)

        def clipped_neg() -> bool:
            with torch.no_grad():
                _, neg = self.policy_loss(logp_BT.detach(), corr, -mask_BT.to(logp_BT.dtype), mask_BT)
            return float(neg.clip_fraction) > 0

        clipped_pos = float(stats.clip_fraction) > 0
        probe = SignProbe(clipped_pos=clipped_pos, clipped_neg=clipped_neg, params=self.loss_params)
        return (pos, stats) if self.policy.linear_in_advantage(probe) else None


@dataclass(frozen=True, kw_only=True)
class DistillationObjective(Objective):
    """On-policy distillation (OPD, ALGORITHMS.md 6.2): the student's loss against a teacher's
    log-probs cached per position. Advantages are per token, so it needs no group; it applies
    no staleness correction and no KL term to the initial model. `select` keeps the OPD loss on
    each sequence's top `select_fraction` of tokens (`opd_mix.py`); `kl_weight` scales it."""

    estimator: str  # config `opd.estimator`
    clip_eps: float = 0.2
    select: str = "all"  # opd.select: all, disagreement, entropy
    select_fraction: float = 1.0
    kl_weight: float = 1.0

    @property
    def distills(self) -> bool:
        return True

    def loss(
        self,
        logp_BL: torch.Tensor,
        logp_BLN: torch.Tensor,
        teacher_BLN: torch.Tensor,
        behav_BLN: torch.Tensor,
        ids_BLN: torch.Tensor,
        mask_BL: torch.Tensor,
        weight_BL: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, float]:
        """Unnormalised OPD loss and its KL estimate (asyncrl/learner/opd.py, ALGORITHMS.md 6.2).

        reverse_kl: the clipped importance-weighted policy gradient at the sampled token, with the
        advantage log pi_T - sg(log pi) recomputed under the current student. mc_reverse_kl: its
        mean over the N cached tokens per position. forward_kl: sum over the *distinct* cached
        tokens of p_T(y) (log p_T(y) - log pi(y)), the forward KL restricted to the cache.
        `weight_BL` (detached) multiplies each position's term; the KL estimate is over every
        valid position whatever the weights."""
        common = dict(mode=self.agg, num_tokens_global=1.0, num_seqs_global=1.0, norm_constant=1.0)
        if self.estimator == "reverse_kl":
            loss, stats = pg_kl_loss(
                logp_BL,
                behav_BLN[..., 0],
                teacher_BLN[..., 0],
                mask_BL,
                weight_BL,
                clip_eps=self.clip_eps,
                **common,
            )
        elif self.estimator == "mc_reverse_kl":
            loss, stats = multi_sample_reverse_kl(
                logp_BLN, behav_BLN, teacher_BLN, mask_BL, weight_BL, clip_eps=self.clip_eps, **common
            )
        else:
            # Keep the first occurrence of each id at a position (later duplicates are masked).
            same_BLNN = ids_BLN[..., :, None] == ids_BLN[..., None, :]
            first_BLN = ~torch.tril(same_BLNN, diagonal=-1).any(dim=-1)
            keep_BLN = first_BLN & mask_BL[..., None]
            per_BLN = torch.where(keep_BLN, teacher_BLN.exp() * (teacher_BLN - logp_BLN), 0.0)
            per_BL = per_BLN.sum(-1)
            if weight_BL is not None:
                per_BL = per_BL * torch.where(mask_BL, weight_BL.detach(), 0.0)
            loss = aggregate(per_BL, mask_BL, **common)
            return loss, float(per_BLN.detach().sum() / mask_BL.sum().clamp(min=1))
        return loss, float(stats.kl)

    def term(
        self,
        logp_BLN: torch.Tensor,
        teacher_BLN: torch.Tensor,
        behav_BLN: torch.Tensor,
        ids_BLN: torch.Tensor,
        mask_BL: torch.Tensor,
        gate_B: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, DistillStats]:
        """kl_weight x the OPD loss on the selected tokens, each trajectory's weighted by its gate
        (`opd_mix.outcome_gate`; None = 1). Selection reads the student's detached log-probs
        `logp_BLN` (column 0: the sampled token), so it is recomputed under the student each pass.

        A position outside the selection, or of a trajectory whose gate is 0, contributes exactly
        nothing: its weight is 0, and a non-finite teacher score there is replaced by 0 first, so
        it cannot turn into NaN. The KL estimate still covers every valid position."""
        if self.select == "all":
            selected_BL = mask_BL
        else:
            score_BL = selection_scores(logp_BLN, teacher_BLN, mask_BL, select=self.select)
            selected_BL = select_tokens(score_BL, mask_BL, fraction=self.select_fraction)
        weight_BL = selected_BL.to(logp_BLN.dtype)
        if gate_B is not None:
            weight_BL = weight_BL * gate_B.to(logp_BLN.dtype)[:, None]
        used_BL = mask_BL & (weight_BL > 0)
        if self.select == "all" and gate_B is None:
            weight_BL = None  # every valid position at weight 1: today's arithmetic, unchanged
        else:
            teacher_BLN = torch.where(used_BL[..., None] | teacher_BLN.isfinite(), teacher_BLN, 0.0)
        loss, kl = self.loss(logp_BLN[..., 0], logp_BLN, teacher_BLN, behav_BLN, ids_BLN, mask_BL, weight_BL)
        loss = self.kl_weight * loss
        stats = DistillStats(
            loss=float(loss.detach()),
            kl=kl,
            num_tokens=float(mask_BL.sum()),
            num_selected=float(selected_BL.sum()),
            num_distilled=float(used_BL.sum()),
        )
        return loss, stats


@dataclass(frozen=True, kw_only=True)
class CombinedObjective(RLObjective):
    """The task reward's RL objective and the distillation term in one loss (`opd.reward`):

        L = reward_weight * L_RL + sum_i g_i * L_OPD,i      (L_OPD already carries kl_weight)

    with g_i the trajectory's outcome gate (`opd_mix.outcome_gate`: 1 for "add"). Both parts share
    the step's denominator Z (learner.agg). The RL part is this class's `RLObjective` behaviour
    (advantages, staleness correction, streaming into the group sums); the distillation part is
    per trajectory and streams straight into the step's sum."""

    distill: DistillationObjective
    reward_mode: str  # opd.reward: add, gate_failed, weight_failed
    reward_weight: float = 1.0
    pass_reward: float = 1.0

    @property
    def distills(self) -> bool:
        return True

    def gate(self, reward_B: torch.Tensor) -> torch.Tensor | None:
        """Each trajectory's distillation weight from its task reward (None: all 1, "add")."""
        if self.reward_mode == "add":
            return None
        return outcome_gate(reward_B, mode=self.reward_mode, pass_reward=self.pass_reward)

    def policy_loss(
        self, logp_BT: torch.Tensor, corr: Correction, adv_BT: torch.Tensor, mask_BT: torch.Tensor
    ) -> tuple[torch.Tensor, LossStats]:
        """reward_weight x the RL policy loss (so the streamed l(+1) and its h_i carry it too)."""
        loss, stats = super().policy_loss(logp_BT, corr, adv_BT, mask_BT)
        return self.reward_weight * loss, stats
