"""Freshness weighting (pure) [proposal, ALGORITHMS.md §6.1]: down-weight samples that drifted.

Place in the data flow: an optional layer over any `StalenessPolicy`. After the base policy built its
Correction, each sequence gets a freshness score f_i in (0, 1] from its stored log-probs; the loss
weight is multiplied by sg(f_i) / mean(sg(f)) and sequences with f_i < f_min are dropped.

f-OPD (Chen, Zhang, Wu, arXiv 2605.17862) publishes only the idea: split the asynchronous error into
rollout drift and supervision drift, score each sample's freshness, regulate stale samples. The score
below is this project's proposal, computable from stored log-probs:
  D_roll(i) = mean_t k3(delta_t),  delta = logp_behav - logp_now,  k3(d) = e^d - d - 1
  D_sup(i)  = mean_t |(logp_T - logp_now) - (logp_T_cached - logp_behav)|   (drift of the per-token
              reverse-KL reward; with one teacher context it reduces to mean_t |logp_behav - logp_now|)
  f_i       = exp(-(lambda_roll D_roll(i) + lambda_sup D_sup(i)))

Legend: B sequences, T token positions per sequence (padded; `mask_BT` marks real completion tokens).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from asyncrl.lazy import lazy_module
from asyncrl.staleness.base import (
    Correction,
    Need,
    StalenessPolicy,
    TokenBatch,
    k3_from_log_ratio,
    log_ratio,
    make_stats,
    seq_mean,
    zero_masked,
)

if TYPE_CHECKING:
    import torch
else:
    torch = lazy_module("torch", globals())  # the launcher validates policies without torch

# The exponent is capped so f stays strictly positive: e^-80 ~ 1.8e-35 is still a normal float32
# (smallest ~1.2e-38), while any larger drift already means "weight ~ 0" in practice.
MAX_FRESHNESS_EXPONENT = 80.0


def freshness_drifts(
    logp_now_BT: torch.Tensor,
    logp_behav_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    *,
    logp_teacher_BT: torch.Tensor | None = None,
    logp_teacher_cached_BT: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(D_roll_B, D_sup_B), both >= 0 and 0 for a sequence without valid tokens.

    `logp_teacher_BT` scores the sample on the current teacher context and `logp_teacher_cached_BT`
    is the score stored with the sample; give both or neither (neither: same context, they cancel).
    """
    if (logp_teacher_BT is None) != (logp_teacher_cached_BT is None):
        raise ValueError("freshness: give both logp_teacher_BT and logp_teacher_cached_BT, or neither")
    delta_BT = log_ratio(logp_behav_BT, logp_now_BT, mask_BT)
    d_roll_B = seq_mean(k3_from_log_ratio(delta_BT), mask_BT)
    reward_drift_BT = delta_BT  # (T - now) - (T - behav) = behav - now
    if logp_teacher_BT is not None and logp_teacher_cached_BT is not None:
        reward_drift_BT = reward_drift_BT + log_ratio(logp_teacher_BT, logp_teacher_cached_BT, mask_BT)
    d_sup_B = seq_mean(reward_drift_BT.abs(), mask_BT)
    return d_roll_B, d_sup_B


def freshness_score(
    logp_now_BT: torch.Tensor,
    logp_behav_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    *,
    lambda_roll: float,
    lambda_sup: float,
    logp_teacher_BT: torch.Tensor | None = None,
    logp_teacher_cached_BT: torch.Tensor | None = None,
) -> torch.Tensor:
    """f_B = exp(-(lambda_roll D_roll + lambda_sup D_sup)) in (0, 1]; 1 when logp_now == logp_behav."""
    if lambda_roll < 0 or lambda_sup < 0:
        raise ValueError(f"freshness lambdas must be >= 0, got {lambda_roll}, {lambda_sup}")
    d_roll_B, d_sup_B = freshness_drifts(
        logp_now_BT,
        logp_behav_BT,
        mask_BT,
        logp_teacher_BT=logp_teacher_BT,
        logp_teacher_cached_BT=logp_teacher_cached_BT,
    )
    exponent_B = (lambda_roll * d_roll_B + lambda_sup * d_sup_B).clamp(max=MAX_FRESHNESS_EXPONENT)
    return torch.exp(-exponent_B)


def freshness_weights(
    f_B: torch.Tensor,
    keep_B: torch.Tensor,
    *,
    f_min: float = 0.0,
    self_normalize: bool = True,
    f_sum: float | torch.Tensor | None = None,
    num_kept: float | torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight_B, keep_B): drop sequences with f < f_min, weight the rest by f / mean(f over kept).

    `keep_B` marks the sequences that take part (e.g. those with a valid token). For data
    parallelism pass the all-reduced `f_sum` and `num_kept` of the kept sequences.
    """
    keep_B = keep_B & (f_B >= f_min)
    f_B = torch.where(keep_B, f_B, torch.zeros_like(f_B))
    if not self_normalize:
        return f_B, keep_B
    total = f_B.sum() if f_sum is None else torch.as_tensor(f_sum, dtype=f_B.dtype, device=f_B.device)
    count = (
        keep_B.sum().to(f_B.dtype)
        if num_kept is None
        else torch.as_tensor(num_kept, dtype=f_B.dtype, device=f_B.device)
    )
    mean = torch.where((total > 0) & (count > 0), total / count.clamp(min=1), torch.ones_like(total))
    return f_B / mean, keep_B


def apply_freshness(
    correction: Correction,
    batch: TokenBatch,
    *,
    lambda_roll: float = 1.0,
    lambda_sup: float = 1.0,
    f_min: float = 0.0,
    self_normalize: bool = True,
) -> Correction:
    """Multiply a Correction's weights by the per-sequence freshness weights (current log-probs vs
    behaviour). Stats are recomputed; clip_fraction and ess_ratio keep describing the IS weights."""
    valid_BT = batch.mask_BT
    f_B = freshness_score(
        batch.logp_BT, batch.logp_behav_BT, valid_BT, lambda_roll=lambda_roll, lambda_sup=lambda_sup
    )
    w_B, keep_B = freshness_weights(f_B, valid_BT.any(-1), f_min=f_min, self_normalize=self_normalize)
    keep_BT = correction.mask_BT & keep_B[:, None]
    weight_BT = zero_masked(correction.weight_BT * w_B[:, None], keep_BT)
    seq_valid_B = valid_BT.any(-1)
    mean_f = (torch.where(seq_valid_B, f_B, torch.zeros_like(f_B)).sum() / seq_valid_B.sum()).detach()
    stats = make_stats(batch, weight_BT, keep_BT)._replace(
        clip_fraction=correction.stats.clip_fraction,
        ess_ratio=correction.stats.ess_ratio,
        mean_freshness=mean_f,
    )
    return correction._replace(weight_BT=weight_BT, mask_BT=keep_BT, stats=stats)


@dataclass(frozen=True, kw_only=True)
class FreshnessWeighted:
    """Any policy plus freshness weighting (defaults are placeholders: §6.1 gives no values)."""

    base: StalenessPolicy
    lambda_roll: float = 1.0
    lambda_sup: float = 1.0
    f_min: float = 0.0
    self_normalize: bool = True

    def __post_init__(self) -> None:
        if self.lambda_roll < 0 or self.lambda_sup < 0:
            raise ValueError(f"freshness lambdas must be >= 0, got {self.lambda_roll}, {self.lambda_sup}")
        if not 0.0 <= self.f_min <= 1.0:
            raise ValueError(f"freshness.f_min must be in [0, 1], got {self.f_min}")

    @property
    def name(self) -> str:
        return f"{self.base.name}+freshness"

    @property
    def needs(self) -> tuple[Need, ...]:
        return self.base.needs

    @property
    def streamable(self) -> bool:
        # Self-normalisation divides by a batch mean, which couples trajectories.
        return self.base.streamable and not self.self_normalize

    @property
    def batch_global(self) -> bool:
        return self.base.batch_global or self.self_normalize

    @property
    def batch_global_lr_only(self) -> bool:
        # Self-normalised weights are batch-global themselves; otherwise the base decides.
        return bool(getattr(self.base, "batch_global_lr_only", False)) and not self.self_normalize

    @property
    def clip_only_sign_dependence(self) -> bool:
        # Not delegated: a wrapped policy that does not stream trains whole batches. Delegating
        # would also be exact without self-normalisation (freshness weights never read sign(A)),
        # but it would move "none+freshness" from whole-batch steps to streaming.
        return False

    @property
    def ewma_decay(self) -> float | None:
        return self.base.ewma_decay

    def correct(self, batch: TokenBatch) -> Correction:
        return apply_freshness(
            self.base.correct(batch),
            batch,
            lambda_roll=self.lambda_roll,
            lambda_sup=self.lambda_sup,
            f_min=self.f_min,
            self_normalize=self.self_normalize,
        )
