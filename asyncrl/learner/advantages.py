"""Advantage estimators (pure): group rewards in, per-sample (or per-token) advantages out.

Place in the data flow: the learner groups finished trajectories by prompt, turns each group's
rewards into advantages here, broadcasts them to tokens, and hands them to `losses.py`.

Legend: G groups (one prompt each), N samples per group, K rewards per sample, B sequences,
T tokens per sequence (padded; `mask_BT` marks real completion tokens).

A group whose rewards are all equal carries no learning signal and gets exactly zero advantage in
every estimator (the float mean of equal values can differ from them by one ulp, and dividing
that ulp by a tiny std would give a spurious non-zero advantage).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

# verl's convention: unbiased std (ddof=1) and eps 1e-6 added to the std.
GRPO_EPS = 1e-6
# MC-GRPO (lotusroot-kim/MC-GRPO): scale = MAD + 1e-3, and |A| > 1e-6 counts as non-zero.
MC_GRPO_MAD_EPS = 1e-3
MC_GRPO_NONZERO_TOL = 1e-6


def _degenerate_G1(rewards_GN: torch.Tensor) -> torch.Tensor:
    """True for groups whose rewards are all equal (and for groups of one)."""
    return (rewards_GN == rewards_GN[:, :1]).all(dim=1, keepdim=True)


def grpo_advantages(
    rewards_GN: torch.Tensor, *, eps: float = GRPO_EPS, unbiased: bool = True
) -> torch.Tensor:
    """GRPO: (r - mean_g) / (std_g + eps).

    `unbiased=True` is verl's `torch.std` (ddof=1); `unbiased=False` is the population std that
    VCPO's streaming path uses. A streaming accumulator must use the same choice as the batch path.
    A group of size 1 gets advantage 0 (verl instead uses mean 0, std 1, i.e. A = r / (1 + eps)).
    """
    if rewards_GN.shape[1] < 2:
        return torch.zeros_like(rewards_GN)
    mean_G1 = rewards_GN.mean(dim=1, keepdim=True)
    std_G1 = rewards_GN.std(dim=1, keepdim=True, unbiased=unbiased)
    adv_GN = (rewards_GN - mean_G1) / (std_G1 + eps)
    return torch.where(_degenerate_G1(rewards_GN), 0.0, adv_GN)


def gdpo_advantages(
    rewards_GNK: torch.Tensor,
    weights_K: torch.Tensor,
    *,
    eps: float = GRPO_EPS,
    unbiased: bool = True,
    batch_norm: bool = True,
) -> torch.Tensor:
    """GDPO (reward-decoupled normalisation): each reward normalised within its group, then summed.

    A_i = sum_k w_k (r_ik - mean_g r_k) / (std_g r_k + eps), each term exactly GRPO's
    (`grpo_advantages` with the same `eps` and `unbiased`). A reward constant within a group
    carries no signal there and contributes exactly 0; a group whose every reward is constant
    gets exactly 0. With `batch_norm`, A is then divided by its std over the whole batch (all
    G*N samples, same ddof) plus eps. GDPO also subtracts the batch mean, but every group's terms
    already sum to 0, so that mean is 0 up to rounding; leaving it out keeps the all-constant
    groups at exactly 0. A batch whose advantages are all 0 stays 0.
    """
    if rewards_GNK.dim() != 3:
        raise ValueError(f"gdpo_advantages: rewards must be [G, N, K], got shape {tuple(rewards_GNK.shape)}")
    if weights_K.shape != rewards_GNK.shape[2:]:
        raise ValueError(
            f"gdpo_advantages: {rewards_GNK.shape[2]} rewards per sample but {weights_K.numel()} weights"
        )
    num_groups, num_samples, num_rewards = rewards_GNK.shape
    per_reward_GK_N = rewards_GNK.permute(0, 2, 1).reshape(num_groups * num_rewards, num_samples)
    norm_GNK = (
        grpo_advantages(per_reward_GK_N, eps=eps, unbiased=unbiased)
        .reshape(num_groups, num_rewards, num_samples)
        .permute(0, 2, 1)
    )
    adv_GN = (norm_GNK * weights_K.to(norm_GNK.dtype)).sum(dim=2)
    return gdpo_batch_scale(adv_GN, eps=eps, unbiased=unbiased) if batch_norm else adv_GN


def gdpo_batch_scale(
    adv: torch.Tensor, *, eps: float = GRPO_EPS, unbiased: bool = True, members: torch.Tensor | None = None
) -> torch.Tensor:
    """GDPO's batch normalisation: `adv` divided by the std of its `members` (bool, same shape;
    None = every entry) plus eps; unchanged when fewer than 2 members or all are 0."""
    values = adv if members is None else adv[members]
    if values.numel() < 2 or not bool(values.ne(0).any()):
        return adv
    return adv / (values.std(unbiased=unbiased) + eps)


def dr_grpo_advantages(rewards_GN: torch.Tensor) -> torch.Tensor:
    """Dr. GRPO: r - mean_g, no std normalisation (pair it with the `seq-mean-token-sum-norm` loss)."""
    adv_GN = rewards_GN - rewards_GN.mean(dim=1, keepdim=True)
    return torch.where(_degenerate_G1(rewards_GN), 0.0, adv_GN)


def rloo_advantages(rewards_GN: torch.Tensor) -> torch.Tensor:
    """RLOO: r_i - mean of the other N-1 rewards = N/(N-1) * (r_i - mean_g). Groups of one get 0."""
    num_samples = rewards_GN.shape[1]
    if num_samples < 2:
        return torch.zeros_like(rewards_GN)
    adv_GN = num_samples / (num_samples - 1) * (rewards_GN - rewards_GN.mean(dim=1, keepdim=True))
    return torch.where(_degenerate_G1(rewards_GN), 0.0, adv_GN)


class McGrpoAdvantages(NamedTuple):
    adv_GN: torch.Tensor
    pivot_GN: torch.Tensor  # bool, one True per group: the median sample, excluded from the backward


def mc_grpo_advantages(
    rewards_GN: torch.Tensor,
    *,
    mad_eps: float = MC_GRPO_MAD_EPS,
    nonzero_tol: float = MC_GRPO_NONZERO_TOL,
) -> McGrpoAdvantages:
    """MC-GRPO: N = G+1 rollouts, median baseline, MAD scale, non-zero rescale, pivot excluded.

    A_i = (r_i - med) / (MAD + mad_eps), MAD = median |r - med|; then within each group the
    advantages with |A| > nonzero_tol are multiplied by N / #non-zero. The pivot (the sample that
    is the median) has A = 0 and must be dropped from the loss mask (`~pivot_GN`), so only G
    samples cost a backward. N should be odd; for even N the lower median is used (as
    `torch.median` does). Ties are broken by position (stable sort), so the pivot is deterministic.
    """
    num_samples = rewards_GN.shape[1]
    mid = (num_samples - 1) // 2
    order_GN = torch.sort(rewards_GN, dim=1, stable=True).indices
    pivot_G1 = order_GN[:, mid : mid + 1]
    median_G1 = rewards_GN.gather(1, pivot_G1)
    abs_dev_GN = (rewards_GN - median_G1).abs()
    mad_G1 = torch.sort(abs_dev_GN, dim=1).values[:, mid : mid + 1]
    adv_GN = (rewards_GN - median_G1) / (mad_G1 + mad_eps)
    nonzero_GN = adv_GN.abs() > nonzero_tol
    num_nonzero_G1 = nonzero_GN.sum(dim=1, keepdim=True).clamp(min=1)
    adv_GN = torch.where(nonzero_GN, adv_GN * (num_samples / num_nonzero_G1), 0.0)
    pivot_GN = torch.zeros_like(rewards_GN, dtype=torch.bool).scatter(1, pivot_G1, True)
    return McGrpoAdvantages(adv_GN=adv_GN, pivot_GN=pivot_GN)


def k1_reward_to_go(delta_BT: torch.Tensor, mask_BT: torch.Tensor, *, kl_coef: float) -> torch.Tensor:
    """KL-in-reward with the k1 estimator, as a per-token term to add to the advantages.

    The per-token reward is -kl_coef * delta_t with delta = logp - logp_ref (detached here: it is a
    reward). Token t gets its reward-to-go -kl_coef * sum_{t' >= t, valid} delta_t'. Used with the
    REINFORCE-style score gradient this is the unbiased sequence-level reverse-KL gradient
    (ALGORITHMS.md 7.6). Zero at masked positions.
    """
    delta_BT = torch.where(mask_BT, delta_BT.detach(), 0.0)
    to_go_BT = delta_BT.flip(1).cumsum(1).flip(1)
    return torch.where(mask_BT, -kl_coef * to_go_BT, 0.0)


def k1_sequence_penalty(delta_BT: torch.Tensor, mask_BT: torch.Tensor, *, kl_coef: float) -> torch.Tensor:
    """-kl_coef * sum_t delta_t per sequence, to fold into the outcome reward r_i before grouping."""
    return -kl_coef * torch.where(mask_BT, delta_BT.detach(), 0.0).sum(dim=1)


def group_rewards(
    reward_B: torch.Tensor,
    group_B: torch.Tensor,
    slot_B: torch.Tensor,
    *,
    num_groups: int,
    group_size: int,
    sizes_G: torch.Tensor | None = None,
) -> torch.Tensor:
    """Scatter per-sequence rewards into [G, N]: sequence b goes to (group_B[b], slot_B[b]).

    `sizes_G` (groups of unequal sizes, rollout budgets): group g fills slots 0..sizes_G[g]-1
    exactly once, the rest are 0 (padding no estimator reads: `ragged_advantages`)."""
    count_GN = torch.zeros(num_groups, group_size, dtype=torch.long, device=reward_B.device)
    count_GN.index_put_((group_B, slot_B), torch.ones_like(group_B), accumulate=True)
    want_GN = torch.ones_like(count_GN) if sizes_G is None else valid_slots(sizes_G, group_size).long()
    if not bool((count_GN == want_GN).all()):
        raise ValueError("group_rewards: every (group, slot) must be filled exactly once")
    rewards_GN = torch.zeros(num_groups, group_size, dtype=reward_B.dtype, device=reward_B.device)
    rewards_GN[group_B, slot_B] = reward_B
    return rewards_GN


def sequence_advantages(adv_GN: torch.Tensor, group_B: torch.Tensor, slot_B: torch.Tensor) -> torch.Tensor:
    """Map per-group advantages back to sequences: adv_B[b] = adv_GN[group_B[b], slot_B[b]]."""
    return adv_GN[group_B, slot_B]


def token_advantages(adv_B: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    """Broadcast a per-sequence advantage to its valid tokens (0 elsewhere)."""
    return torch.where(mask_BT, adv_B[:, None], 0.0)


def valid_slots(sizes_G: torch.Tensor, group_size: int) -> torch.Tensor:
    """bool [G, N]: slot n of group g is a member (n < sizes_G[g])."""
    return torch.arange(group_size, device=sizes_G.device)[None, :] < sizes_G[:, None]


def ragged_advantages(
    rewards_GN: torch.Tensor,
    sizes_G: torch.Tensor,
    estimate: Callable[[torch.Tensor, torch.Tensor | None], tuple[torch.Tensor, torch.Tensor]],
    parts_GNK: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(adv_GN, keep_GN) of groups of unequal sizes (rollout budgets): `estimate(rewards, parts)`
    runs on each set of groups of one size n, over their own n members only (baselines, stds,
    RLOO's n/(n-1) per group); padding slots get advantage 0 and keep False."""
    adv_GN = torch.zeros_like(rewards_GN)
    keep_GN = torch.zeros_like(rewards_GN, dtype=torch.bool)
    for n in sorted(set(sizes_G.tolist())):
        rows = (sizes_G == n).nonzero().squeeze(1)
        parts = None if parts_GNK is None else parts_GNK[rows, :n]
        adv, keep = estimate(rewards_GN[rows, :n], parts)
        adv_GN[rows, :n] = adv.to(adv_GN.dtype)
        keep_GN[rows, :n] = keep
    return adv_GN, keep_GN
