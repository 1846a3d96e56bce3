"""The configured training objective (pure): advantages, policy loss, KL, and whether it streams.

Place in the data flow: the learner's `Trainer` builds one `Objective` from `learner.*` and the
staleness policy, then asks it for group advantages, for the loss of a packed chunk of
trajectories, and, per arriving trajectory, for the sign-free streamed loss (`stream_loss`).

Every loss here is an *unnormalised sum*: aggregation denominators are 1, and the trainer divides
the summed gradient by the global Z (all-reduced over data-parallel ranks) once per step. So a
chunk, a micro-batch or a rank contributes a plain sum, and any split gives the same gradient.

When does a trajectory stream on its own (ALGORITHMS.md 5.5)? Its gradient must be linear in its
advantage A_i, which is unknown until the group closes. Write the per-token loss as l(A) (the
loss with advantage A); it is linear in A exactly when no clip binds for either sign of A. We test
that directly: the loss evaluated at A = +1 and A = -1 reports no clipped token. Then
h_i = -grad l(+1) and the group's S0/S1 sums give sum_i A_i h_i. Otherwise the trajectory waits
for its group (all of its members are then trained with known advantages in one backward).
Whole-batch fallbacks (`fallback_reason`) cover what is never per-trajectory: batch-global
corrections (M2PO's mask, VCPO, self-normalised weights), MC-GRPO's median pivot, KL terms (they
need the reference model's forward), several epochs per batch (`learner.epochs` > 1: an epoch's
gradient depends on the update before it) and `learner.streaming = "off"`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from asyncrl.learner.advantages import (
    dr_grpo_advantages,
    grpo_advantages,
    k1_sequence_penalty,
    mc_grpo_advantages,
    rloo_advantages,
)
from asyncrl.learner.kl import kl_loss
from asyncrl.learner.losses import LossStats, aggregate, cispo_loss, clipped_surrogate, gspo_loss
from asyncrl.learner.opd import multi_sample_reverse_kl, pg_kl_loss
from asyncrl.staleness.base import Correction, StalenessPolicy

# Clip bounds that never bind: ratios live in (0, e^MAX_LOG_RATIO], so clip_low=1 and an infinite
# clip_high leave the surrogate unclipped (M2PO and VCPO use their mask or weights instead).
NO_CLIP = (1.0, float("inf"))

# Streaming estimators of `StreamingAccumulator` for each advantage (MC-GRPO never streams).
STREAM_ESTIMATOR = {"grpo": "grpo", "dr_grpo": "dr_grpo", "rloo": "rloo"}

# Policies whose only sign(A) dependence is the PPO clip against the behavior policy: such a
# trajectory streams when the clip binds for neither sign (checked per trajectory).
CLIP_ONLY_SIGN_DEPENDENCE = frozenset({"none"})

# Policies whose correction is a statistic of the whole batch (M2PO's second-moment mask; VCPO's
# ESS learning-rate scale, which could stream as running sums but is taken from the batch here).
BATCH_GLOBAL = frozenset({"m2po", "vcpo"})


@dataclass(frozen=True)
class Objective:
    advantage: str
    loss: str
    agg: str
    clip_low: float
    clip_high: float
    dual_clip: float | None
    norm_constant: float
    drop_degenerate_groups: bool
    kl_coef: float
    kl_estimator: str
    kl_placement: str
    streaming: str
    epochs: int = 1  # optimizer updates per batch
    opd: str | None = None  # OPD estimator (config `opd`), None for RL
    opd_clip_eps: float = 0.2

    @classmethod
    def from_config(cls, config) -> Objective:
        lrn = config.learner
        clip_low, clip_high = lrn.clip_range()
        return cls(
            advantage=lrn.advantage,
            loss=lrn.loss,
            agg=lrn.agg,
            clip_low=clip_low,
            clip_high=clip_high,
            dual_clip=lrn.dual_clip,
            norm_constant=float(lrn.norm_constant or config.sampling.max_new_tokens),
            drop_degenerate_groups=lrn.drop_degenerate_groups,
            kl_coef=lrn.kl_coef,
            kl_estimator=lrn.kl_estimator,
            kl_placement=lrn.kl_placement,
            streaming=lrn.streaming,
            epochs=lrn.epochs,
            opd=config.opd.estimator if config.opd.enabled else None,
            opd_clip_eps=config.opd.clip_eps,
        )

    # -- advantages ----------------------------------------------------------------------------

    def group_advantages(self, rewards_GN: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(adv_GN, keep_GN): keep is False for MC-GRPO's pivot and for dropped degenerate groups."""
        keep_GN = torch.ones_like(rewards_GN, dtype=torch.bool)
        if self.advantage == "grpo":
            adv_GN = grpo_advantages(rewards_GN)
        elif self.advantage == "dr_grpo":
            adv_GN = dr_grpo_advantages(rewards_GN)
        elif self.advantage == "rloo":
            adv_GN = rloo_advantages(rewards_GN)
        else:
            mc = mc_grpo_advantages(rewards_GN)
            adv_GN, keep_GN = mc.adv_GN, ~mc.pivot_GN
        if self.drop_degenerate_groups:
            degenerate_G1 = (rewards_GN == rewards_GN[:, :1]).all(dim=1, keepdim=True)
            keep_GN = keep_GN & ~degenerate_G1
        return adv_GN, keep_GN

    @property
    def uses_reference(self) -> bool:
        return self.kl_coef > 0

    def kl_reward_penalty(self, logp_BT, logp_ref_BT, mask_BT) -> torch.Tensor:
        """k1 in the reward: -kl_coef * sum_t (logp - logp_ref) per sequence (0 when KL is in the loss)."""
        if not self.uses_reference or self.kl_placement != "reward":
            return torch.zeros(mask_BT.shape[0], dtype=torch.float64)
        return k1_sequence_penalty(logp_BT - logp_ref_BT, mask_BT, kl_coef=self.kl_coef).double()

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

    # -- losses --------------------------------------------------------------------------------

    def policy_loss(
        self, logp_BT: torch.Tensor, corr: Correction, adv_BT: torch.Tensor, mask_BT: torch.Tensor
    ) -> tuple[torch.Tensor, LossStats]:
        """Unnormalised policy loss (sum over this chunk) under the staleness correction.

        `mask_BT` is the valid-token mask (it defines the aggregation); the correction's own mask
        zeroes rejected tokens through the weight, so rejection never changes a denominator."""
        clip_low, clip_high = (self.clip_low, self.clip_high) if corr.use_clip else NO_CLIP
        weight_BT = corr.weight_BT * corr.mask_BT
        common = dict(mode=self.agg, num_tokens_global=1.0, num_seqs_global=1.0, norm_constant=1.0)
        if self.loss == "ppo":
            return clipped_surrogate(
                logp_BT,
                corr.logp_anchor_BT,
                adv_BT,
                mask_BT,
                weight_BT,
                clip_low=clip_low,
                clip_high=clip_high,
                dual_clip=self.dual_clip if corr.use_clip else None,
                **common,
            )
        if self.loss == "gspo":
            return gspo_loss(
                logp_BT,
                corr.logp_anchor_BT,
                adv_BT,
                mask_BT,
                weight_BT,
                clip_low=clip_low,
                clip_high=clip_high,
                **common,
            )
        return cispo_loss(
            logp_BT,
            corr.logp_anchor_BT,
            adv_BT,
            mask_BT,
            weight_BT,
            clip_low=min(clip_low, 1.0),
            clip_high=clip_high,
            **common,
        )

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

    def fallback_reason(self, policy: StalenessPolicy) -> str | None:
        """Why this configuration trains whole batches instead of streaming (None: it streams)."""
        if self.streaming == "off":
            return "learner.streaming = 'off'"
        if self.epochs > 1:
            return f"learner.epochs = {self.epochs}: each later epoch needs the update of the one before"
        if self.opd is not None:
            return None  # per-token teacher advantages: every trajectory streams on its own
        if self.advantage not in STREAM_ESTIMATOR:
            return f"advantage {self.advantage!r} needs the whole group (median pivot)"
        if self.uses_reference:
            return "a KL term needs the reference model's log-probs and a second weighting of the scores"
        if self.needs_whole_batch(policy):
            return f"staleness policy {policy.name!r} uses batch-global statistics"
        if not policy.streamable and policy.name not in CLIP_ONLY_SIGN_DEPENDENCE:
            return f"staleness policy {policy.name!r} clips against an anchor other than the current policy (sign(A))"
        return None

    @staticmethod
    def needs_whole_batch(policy: StalenessPolicy) -> bool:
        """Corrections computed from the whole batch (M2PO's mask, VCPO's ESS learning-rate scale,
        self-normalised weights): one rank must see every trajectory of the step."""
        base = getattr(policy, "base", policy)  # freshness weighting wraps a policy
        return (
            base.name in BATCH_GLOBAL
            or bool(getattr(policy, "self_normalize", False))
            or bool(getattr(base, "self_normalize", False))
        )

    def stream_loss(
        self, logp_BT: torch.Tensor, corr: Correction, mask_BT: torch.Tensor
    ) -> tuple[torch.Tensor, LossStats] | None:
        """The loss at A = +1 for one trajectory, if its gradient is linear in A (no clip binds
        for either sign); None if it must wait for its group's advantages."""
        pos, stats = self.policy_loss(logp_BT, corr, mask_BT.to(logp_BT.dtype), mask_BT)
        if self.loss == "cispo":  # sg(clip(r)) weights never depend on sign(A)
            return pos, stats
        if float(stats.clip_fraction) > 0:
            return None
        with torch.no_grad():
            _, neg_stats = self.policy_loss(logp_BT.detach(), corr, -mask_BT.to(logp_BT.dtype), mask_BT)
        if float(neg_stats.clip_fraction) > 0:
            return None
        return pos, stats

    def opd_loss(
        self,
        logp_BL: torch.Tensor,
        logp_BLN: torch.Tensor,
        teacher_BLN: torch.Tensor,
        behav_BLN: torch.Tensor,
        ids_BLN: torch.Tensor,
        mask_BL: torch.Tensor,
    ) -> tuple[torch.Tensor, float]:
        """Unnormalised OPD loss and its KL estimate (asyncrl/learner/opd.py, ALGORITHMS.md 6.2).

        reverse_kl: the clipped importance-weighted policy gradient at the sampled token, with the
        advantage log pi_T - sg(log pi) recomputed under the current student. mc_reverse_kl: its
        mean over the N cached tokens per position. forward_kl: sum over the *distinct* cached
        tokens of p_T(y) (log p_T(y) - log pi(y)), the forward KL restricted to the cache."""
        common = dict(mode=self.agg, num_tokens_global=1.0, num_seqs_global=1.0, norm_constant=1.0)
        if self.opd == "reverse_kl":
            loss, stats = pg_kl_loss(
                logp_BL, behav_BLN[..., 0], teacher_BLN[..., 0], mask_BL, clip_eps=self.opd_clip_eps, **common
            )
        elif self.opd == "mc_reverse_kl":
            loss, stats = multi_sample_reverse_kl(
                logp_BLN, behav_BLN, teacher_BLN, mask_BL, clip_eps=self.opd_clip_eps, **common
            )
        else:
            # Keep the first occurrence of each id at a position (later duplicates are masked).
            same_BLNN = ids_BLN[..., :, None] == ids_BLN[..., None, :]
            first_BLN = ~torch.tril(same_BLNN, diagonal=-1).any(dim=-1)
            keep_BLN = first_BLN & mask_BL[..., None]
            per_BLN = torch.where(keep_BLN, teacher_BLN.exp() * (teacher_BLN - logp_BLN), 0.0)
            loss = aggregate(per_BLN.sum(-1), mask_BL, **common)
            return loss, float(per_BLN.detach().sum() / mask_BL.sum().clamp(min=1))
        return loss, float(stats.kl)
