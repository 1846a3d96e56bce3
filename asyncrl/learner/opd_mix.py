"""Distillation mixed with the task reward, and token-selective distillation (pure).

Place in the data flow: the learner's distillation term (`objective.DistillationObjective`) asks
these functions, per packed chunk of trajectories, which tokens carry the OPD loss
(`select_tokens` over `selection_scores`) and how much each trajectory is distilled given its
task reward (`outcome_gate`). Everything here is a function of one trajectory's own tensors, so a
trajectory's distillation gradient is complete when it arrives: it streams with no group buffer
(ALGORITHMS.md 5.6), whatever the chunking.

Legend: B sequences, T tokens per sequence (padded; `mask_BT` marks trained completion tokens),
N cached tokens per position (column 0 is the sampled token; docs/opd.md).

Selection is per sequence: of sequence i's n_i valid tokens it keeps the k_i = ceil(f n_i) with the
highest score (at least one when n_i > 0), ties broken by position (earlier first), so the result
depends on nothing outside the sequence. Scores (detached, under the student the loss
differentiates):
    disagreement  mean_k |log pi_T(y_k) - log pi(y_k)|       over the N cached ids
    entropy       -mean_k log pi(y_k)                         the N-sample Monte Carlo estimate of
                                                              the student's entropy at the position
                                                              (exact in expectation on-policy: the
                                                              ids are draws from the rollout student)
Outcome gates g_i of trajectory i with task reward r_i (ALGORITHMS.md 11, "Outcome gating"):
    add            1
    gate_failed    1 if r_i < pass_reward else 0
    weight_failed  clamp((pass_reward - r_i) / pass_reward, 0, 1)   (1 - r_i for rewards in [0, 1])
"""

from __future__ import annotations

import math
from typing import Literal

import torch

from asyncrl.learner.losses import fill_masked

SelectMode = Literal["all", "disagreement", "entropy"]
RewardMode = Literal["off", "add", "gate_failed", "weight_failed"]
SELECT_MODES: tuple[str, ...] = ("all", "disagreement", "entropy")
REWARD_MODES: tuple[str, ...] = ("off", "add", "gate_failed", "weight_failed")

# k_i = ceil(f n_i) is taken after subtracting this: f n_i is a float product, and e.g.
# 0.1 * 30 = 3.0000000000000004 would otherwise round up to 4 tokens.
FRACTION_ROUNDING = 1e-9


def selection_scores(
    logp_BTN: torch.Tensor, logp_teacher_BTN: torch.Tensor, mask_BT: torch.Tensor, *, select: str
) -> torch.Tensor:
    """Per-token score [B, T] that `select_tokens` ranks (detached; 0 at masked positions)."""
    mask_BTN = mask_BT[..., None].expand_as(logp_BTN)
    logp_BTN = fill_masked(logp_BTN.detach(), mask_BTN)
    if select == "disagreement":
        teacher_BTN = fill_masked(logp_teacher_BTN.detach(), mask_BTN)
        return fill_masked((teacher_BTN - logp_BTN).abs().mean(dim=-1), mask_BT)
    if select == "entropy":
        return fill_masked(-logp_BTN.mean(dim=-1), mask_BT)
    raise ValueError(f"unknown selection {select!r}; valid: disagreement, entropy (or 'all': no scores)")


def tokens_to_keep(num_B: torch.Tensor, *, fraction: float) -> torch.Tensor:
    """k_i = ceil(fraction n_i), at least 1 for a sequence with a valid token, at most n_i."""
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"fraction must be in (0, 1], got {fraction}")
    num_B = num_B.to(torch.int64)
    k_B = torch.ceil(num_B.double() * fraction - FRACTION_ROUNDING).to(torch.int64)
    return torch.minimum(k_B.clamp(min=1), num_B)


def select_tokens(score_BT: torch.Tensor, mask_BT: torch.Tensor, *, fraction: float) -> torch.Tensor:
    """Bool [B, T]: in each sequence, the `tokens_to_keep` valid tokens with the highest score.

    Ties (and NaN scores, ranked lowest) are broken by position, earlier first: two stable sorts,
    by score and then valid-before-masked, so a masked position never takes a valid one's place.
    """
    if mask_BT.dtype != torch.bool:
        raise ValueError(f"mask_BT must be bool, got {mask_BT.dtype}")
    k_B = tokens_to_keep(mask_BT.sum(dim=1), fraction=fraction)
    if fraction == 1.0:
        return mask_BT.clone()
    score_BT = torch.where(mask_BT, score_BT.detach().double().nan_to_num(nan=-math.inf), -math.inf)
    by_score_BT = torch.sort(score_BT, dim=1, descending=True, stable=True).indices
    valid_first_BT = torch.sort((~mask_BT.gather(1, by_score_BT)).to(torch.int8), dim=1, stable=True).indices
    order_BT = by_score_BT.gather(1, valid_first_BT)  # position of rank r, per sequence
    rank_BT = torch.empty_like(order_BT).scatter_(
        1, order_BT, torch.arange(mask_BT.shape[1], device=mask_BT.device).expand_as(order_BT)
    )
    return mask_BT & (rank_BT < k_B[:, None])


def outcome_gate(reward_B: torch.Tensor, *, mode: str, pass_reward: float = 1.0) -> torch.Tensor:
    """g_i in [0, 1] per trajectory (see the module docstring); float64."""
    reward_B = reward_B.double()
    if mode in ("off", "add"):
        return torch.ones_like(reward_B)
    if mode == "gate_failed":
        return (reward_B < pass_reward).double()
    if mode == "weight_failed":
        if pass_reward <= 0:
            raise ValueError(f"weight_failed needs pass_reward > 0, got {pass_reward}")
        return ((pass_reward - reward_B) / pass_reward).clamp(0.0, 1.0)
    raise ValueError(f"unknown reward mode {mode!r}; valid: {', '.join(REWARD_MODES)}")
