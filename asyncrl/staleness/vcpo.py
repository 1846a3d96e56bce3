"""VCPO variance control (pure): ESS-based learning-rate scaling and the off-policy optimal baseline.

Place in the data flow: the `VCPO` policy runs once per optimizer step and returns the sequence-level
truncated IS weights plus `lr_scale` for that step. With `staleness.vcpo_baseline = "opob"` the
learner trains every trajectory with its own backward, and its streaming accumulator
(`asyncrl.learner.streaming`, which owns the per-trajectory gradient norms) calls `opob_baseline`
when a group closes; `learner/opob.py` weighs "opob_released" norms with `opob_released_scale`. The
policy's weights are per trajectory (`batch_global_lr_only`), so the per-trajectory path calls it
on each trajectory for its weights and once over the step's detached log-probs for `lr_scale`.

Paper: Huang et al., *Stable Asynchrony*, arXiv 2602.17616; code mit-han-lab/vcpo (ALGORITHMS.md §2).
  w_i = exp(sum_t log(pi_theta/mu)),  rho = (sum w)^2 / (sum w^2) / B,  lr = lr0 * min(1, rho/base)^p
  (p = 1/2 "sqrt", p = 1 "linear");  b* = sum_i W_i R_i / sum_i W_i  with W_i = ||g_i||^2 [proposal §2.2]
Data parallelism: pass already-gathered per-sequence log weights (`ess_ratio`) or all-reduced sums
(`ess_ratio_from_sums`); never reduce inside this module.

Legend: B sequences, T token positions per sequence (padded), G groups, N samples per group.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Literal

from asyncrl.lazy import lazy_module
from asyncrl.staleness.base import (
    MAX_LOG_RATIO,
    Correction,
    Need,
    TokenBatch,
    clamped_exp,
    finish,
    log_ratio,
    seq_sum,
)

if TYPE_CHECKING:
    import torch
else:
    torch = lazy_module("torch", globals())  # the launcher validates policies without torch

VCPO_SEQ_IS_CAP = 8.0  # released scripts: rollout_is="sequence", rollout_is_threshold=8.0


def sequence_log_weights(
    logp_BT: torch.Tensor, logp_behav_BT: torch.Tensor, mask_BT: torch.Tensor
) -> torch.Tensor:
    """log w_i = sum_t (log pi - log mu) over valid tokens -> [B] (detached)."""
    return seq_sum(log_ratio(logp_BT, logp_behav_BT, mask_BT), mask_BT)


def ess_ratio(log_w_B: torch.Tensor, keep_B: torch.Tensor | None = None) -> torch.Tensor:
    """ESS/B = (sum w)^2 / (sum w^2) / B in (0, 1], from log weights (NaN for no sequences).

    Computed as exp(2 lse(l) - lse(2 l)) / B: scale-free, so no weight is ever exponentiated and
    arbitrarily stale sequences cannot overflow (the code's +1e-8 guard is not needed).
    """
    keep_B = torch.ones_like(log_w_B, dtype=torch.bool) if keep_B is None else keep_B
    log_w_B = torch.where(keep_B, log_w_B.detach(), torch.full_like(log_w_B, -math.inf))
    num = keep_B.sum().to(log_w_B.dtype)
    log_ess = 2.0 * torch.logsumexp(log_w_B, 0) - torch.logsumexp(2.0 * log_w_B, 0)
    # Cauchy-Schwarz bounds the ratio by 1; the clamp only removes rounding above 1.
    return (torch.exp(log_ess) / num).clamp(max=1.0)


def ess_ratio_from_sums(sum_w: torch.Tensor, sum_w_sq: torch.Tensor, num_sequences: int) -> torch.Tensor:
    """ESS/B from all-reduced sums. The ratio is scale-free: sum exp(l_i - c) and exp(2(l_i - c))
    with a global shift c (e.g. the all-reduced max) so the sums stay finite."""
    return (sum_w * sum_w / sum_w_sq / num_sequences).clamp(max=1.0)


def vcpo_lr_scale(
    rho: float, *, base_ess_ratio: float = 1.0, rule: Literal["sqrt", "linear"] = "sqrt"
) -> float:
    """Learning-rate multiplier for this step: min(1, rho/base)^(1/2) ("sqrt", AdamW) or ^1 ("linear")."""
    if math.isnan(rho):  # no valid sequence: nothing to scale
        return 1.0
    scale = min(1.0, rho / base_ess_ratio)
    return math.sqrt(scale) if rule == "sqrt" else scale


def opob_baseline(weight_GN: torch.Tensor, reward_GN: torch.Tensor) -> torch.Tensor:
    """Off-policy optimal baseline b* = sum W R / sum W along the last dim ([G, N] -> [G]).

    A group whose weights are all 0 has all-zero gradients, so its baseline is irrelevant; it gets
    the plain mean reward to stay finite.
    """
    total_G = weight_GN.sum(-1)
    weighted_G = (weight_GN * reward_GN).sum(-1)
    safe_G = torch.where(total_G > 0, total_G, torch.ones_like(total_G))
    return torch.where(total_G > 0, weighted_G / safe_G, reward_GN.mean(-1))


def opob_weights(
    grad_sq_norm_N: torch.Tensor,
    *,
    released: bool = False,
    is_weight_N: torch.Tensor | None = None,
    length_N: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-trajectory baseline weights W_i.

    Default [proposal §2.2]: W_i = ||g_i||^2, g_i the exact vector multiplied by (R_i - b), which
    minimises the estimator's trace-variance. `released=True` reproduces the VCPO code:
    ||g_i||^2 * L_i^2 * w_i^2 (token-sum score norm times the unclipped sequence IS weight squared;
    the common factor B^2 of the code cancels in b*).
    """
    if not released:
        return grad_sq_norm_N
    if is_weight_N is None or length_N is None:
        raise ValueError("opob_weights(released=True) needs is_weight_N and length_N")
    length_N = length_N.to(grad_sq_norm_N.dtype)
    return grad_sq_norm_N * length_N * length_N * is_weight_N * is_weight_N


def opob_released_scale(log_w: float, num_tokens: int, *, token_weight: float) -> float:
    """The released code's factor on ||h_i||^2 (ALGORITHMS.md 2.2): w_i^2 (w_i the unclipped
    sequence IS weight, log clamped to +-MAX_LOG_RATIO as everywhere) times 1/c_i^2, which turns
    the norm of h_i = w_clip sum_t c_i grad logp_t into that of the token-sum score. For
    `seq-mean-token-mean` 1/c_i = L_i, as `opob_weights(released=True)` writes it."""
    log_w = min(max(log_w, -MAX_LOG_RATIO), MAX_LOG_RATIO)
    if num_tokens == 0 or token_weight <= 0:
        return 0.0
    return math.exp(2.0 * log_w) / (token_weight * token_weight)


@dataclass(frozen=True, kw_only=True)
class VCPO:
    """Bypass-mode sequence TIS (anchor = detached current log-probs, no eps-clip, weight
    min(w_i, is_cap)) plus the ESS learning-rate scale from unclipped (default) or clipped w_i."""

    is_cap: float | None = VCPO_SEQ_IS_CAP
    base_ess_ratio: float = 1.0
    rule: Literal["sqrt", "linear"] = "sqrt"
    ess_use_clipped: bool = False
    name: ClassVar[str] = "vcpo"
    # The ESS learning-rate scale could stream as running sums, but is taken from the batch here.
    batch_global: ClassVar[bool] = True
    # ... and it is the only batch-global part: the weights min(w_i, cap) are per trajectory. The
    # per-trajectory (OPOB) path recomputes lr_scale over the step's detached log-probs at its end.
    batch_global_lr_only: ClassVar[bool] = True
    clip_only_sign_dependence: ClassVar[bool] = False  # no eps-clip; weights never read sign(A)
    ewma_decay: ClassVar[float | None] = None

    def __post_init__(self) -> None:
        if self.is_cap is not None and self.is_cap <= 0:
            raise ValueError(f"vcpo.is_cap must be > 0 or None, got {self.is_cap}")
        if self.base_ess_ratio <= 0:
            raise ValueError(f"vcpo.base_ess_ratio must be > 0, got {self.base_ess_ratio}")
        if self.rule not in ("sqrt", "linear"):
            raise ValueError(f"vcpo.rule must be 'sqrt' or 'linear', got {self.rule!r}")

    @property
    def needs(self) -> tuple[Need, ...]:
        return ()

    @property
    def streamable(self) -> bool:
        # Weights are per trajectory; rho only scales the step's lr, known at step end from sums.
        return True

    def correct(self, batch: TokenBatch) -> Correction:
        valid_BT = batch.mask_BT
        log_w_B = sequence_log_weights(batch.logp_BT, batch.logp_behav_BT, valid_BT)
        log_cap = math.inf if self.is_cap is None else math.log(self.is_cap)
        log_w_clip_B = log_w_B.clamp(max=log_cap)
        seq_valid_B = valid_BT.any(-1)
        rho = ess_ratio(log_w_clip_B if self.ess_use_clipped else log_w_B, seq_valid_B)
        lr_scale = vcpo_lr_scale(float(rho), base_ess_ratio=self.base_ess_ratio, rule=self.rule)
        w_BT = clamped_exp(log_w_clip_B)[:, None].expand_as(batch.logp_behav_BT)
        clipped_BT = (log_w_B > log_cap)[:, None].expand_as(valid_BT)
        return finish(
            batch,
            batch.logp_BT,
            w_BT,
            valid_BT,
            use_clip=False,
            lr_scale=lr_scale,
            clipped_BT=clipped_BT,
            ess_ratio=rho,
        )
