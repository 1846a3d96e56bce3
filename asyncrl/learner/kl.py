"""KL-to-reference estimators (pure), as loss terms. The k1 reward form lives in `advantages.py`.

Place in the data flow: the learner adds `kl_coef * kl_loss(...)` to the policy loss when a
reference model is configured. For the asynchronous system the recommended configuration is k1 in
the reward (`advantages.k1_reward_to_go`) or no KL (ALGORITHMS.md 7.6).

Legend: B sequences, T tokens per sequence (padded; `mask_BT` marks real completion tokens).

With delta = logp - logp_ref and tokens sampled from pi_theta (Schulman, joschu.net/blog/kl-approx):
  k1 = delta                      unbiased value, expected gradient 0 as a loss
  k2 = delta^2 / 2                biased value, gradient delta * grad logp = grad KL(pi || ref)
  k3 = exp(-delta) - 1 + delta    unbiased value, gradient is the *forward*-KL gradient
  k1+, k3+                        value of k1 / k3, gradient of k2 (straight-through, as verl)
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from asyncrl.learner.losses import MAX_LOG_RATIO, aggregate, apply_weight, check_agg_mode, fill_masked

KL_ESTIMATORS: tuple[str, ...] = ("k1", "k2", "k3", "k1+", "k3+")
# verl clamps k3 at 10: one token with a huge log-ratio would otherwise dominate the batch.
MAX_K3 = 10.0


class KLStats(NamedTuple):
    kl: torch.Tensor  # mean estimator value over valid tokens
    num_tokens: torch.Tensor


def kl_per_token(
    logp_BT: torch.Tensor, logp_ref_BT: torch.Tensor, mask_BT: torch.Tensor, *, estimator: str
) -> torch.Tensor:
    """Per-token KL estimate (zero at masked positions); gradient flows through `logp_BT`."""
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"unknown KL estimator {estimator!r}; valid: {', '.join(KL_ESTIMATORS)}")
    delta_BT = fill_masked(logp_BT, mask_BT) - fill_masked(logp_ref_BT.detach(), mask_BT)
    if estimator == "k1":
        return delta_BT
    k2_BT = 0.5 * delta_BT.square()
    if estimator == "k2":
        return k2_BT
    if estimator == "k1+":
        return k2_BT - k2_BT.detach() + delta_BT.detach()
    delta_BT = delta_BT.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    k3_BT = (torch.exp(-delta_BT) - 1.0 + delta_BT).clamp(max=MAX_K3)
    if estimator == "k3":
        return k3_BT
    return k2_BT - k2_BT.detach() + k3_BT.detach()


def kl_loss(
    logp_BT: torch.Tensor,
    logp_ref_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    weight_BT: torch.Tensor | None = None,
    *,
    estimator: str,
    mode: str = "token-mean",
    num_tokens_global: float | torch.Tensor | None = None,
    num_seqs_global: float | torch.Tensor | None = None,
    norm_constant: float | torch.Tensor | None = None,
) -> tuple[torch.Tensor, KLStats]:
    """Aggregated KL loss term (multiply by kl_coef yourself; verl's default coef is 0.001).

    Off-policy, pass `weight_BT = pi_theta / mu` (detached) to keep k2's gradient unbiased.
    """
    check_agg_mode(mode)
    kl_BT = kl_per_token(logp_BT, logp_ref_BT, mask_BT, estimator=estimator)
    loss = aggregate(
        apply_weight(kl_BT, weight_BT, mask_BT),
        mask_BT,
        mode=mode,
        num_tokens_global=num_tokens_global,
        num_seqs_global=num_seqs_global,
        norm_constant=norm_constant,
    )
    with torch.no_grad():
        num_tokens = mask_BT.sum()
        stats = KLStats(kl=kl_BT.sum() / num_tokens.clamp(min=1), num_tokens=num_tokens)
    return loss, stats
