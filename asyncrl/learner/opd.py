"""On-policy distillation losses (pure): student and teacher log-probs in, (loss, stats) out.

Place in the data flow: after a student rollout, the teacher scores the sampled token ids (or N
cached ids per position); the learner recomputes the student's log-probs at the same ids (with
grad) and calls one of these. Definitions follow AsyncOPD (ALGORITHMS.md 6.2).

Legend: B sequences, T tokens per sequence (padded; `mask_BT` marks real completion tokens),
N samples per position (the finite teacher-score cache; column 0 is the generated token).

Reverse-KL OPD treats A_t = logp_teacher - sg(logp_student) as a per-token advantage; its
gradient E_{y~mu}[(pi/mu) (logp_student - logp_teacher) grad logp_student] is the exact gradient
of KL(pi_student || pi_teacher) at that position when no clip is active.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from asyncrl.learner.losses import (
    MAX_LOG_RATIO,
    PpoTerms,
    aggregate,
    apply_weight,
    check_agg_mode,
    fill_masked,
    loss_stats,
    ppo_terms,
)

# AsyncOPD `pg_clip_eps` default; their multi-sample example config uses 1e6 (effectively unclipped).
OPD_CLIP_EPS = 0.2


class OpdStats(NamedTuple):
    kl: torch.Tensor  # mean per-position divergence estimate (reverse or forward, per loss)
    clip_fraction: torch.Tensor
    mean_ratio: torch.Tensor  # mean pi_student / mu over valid samples (1 for forward-KL losses)
    num_tokens: torch.Tensor


def reverse_kl_advantage(logp_teacher: torch.Tensor, logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Shape-agnostic A = logp_teacher - sg(logp), recomputed under the current student; 0 where masked."""
    return fill_masked(logp_teacher.detach(), mask) - fill_masked(logp.detach(), mask)


def _reverse_kl_pg(
    logp: torch.Tensor,
    logp_behav: torch.Tensor,
    logp_teacher: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_eps: float,
    online_advantage: bool,
) -> tuple[PpoTerms, torch.Tensor]:
    """Per-position (or per-sample) clipped IS policy-gradient terms on cleaned inputs."""
    logp = fill_masked(logp, mask)
    logp_behav = fill_masked(logp_behav.detach(), mask)
    anchor = logp if online_advantage else logp_behav
    adv = reverse_kl_advantage(logp_teacher, anchor, mask)
    log_ratio = (logp - logp_behav).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    terms = ppo_terms(log_ratio, adv, clip_low=clip_eps, clip_high=clip_eps)
    # Importance-weighted estimate of KL(pi || teacher): E_mu[rho (logp - logp_teacher)].
    with torch.no_grad():
        kl = terms.ratio * (logp - fill_masked(logp_teacher, mask))
    return terms, kl


def pg_kl_loss(
    logp_BT: torch.Tensor,
    logp_behav_BT: torch.Tensor,
    logp_teacher_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    weight_BT: torch.Tensor | None = None,
    *,
    clip_eps: float = OPD_CLIP_EPS,
    online_advantage: bool = True,
    mode: str = "token-mean",
    num_tokens_global: float | torch.Tensor | None = None,
    num_seqs_global: float | torch.Tensor | None = None,
    norm_constant: float | torch.Tensor | None = None,
) -> tuple[torch.Tensor, OpdStats]:
    """Reverse-KL OPD at the sampled token: max(-A rho, -A clip(rho, 1 - eps, 1 + eps)).

    rho = pi_student / mu with mu the rollout (behavior) student. A = logp_teacher - sg(logp_student)
    under the current student when `online_advantage` (AsyncOPD's recommended "recompute" surrogate),
    else logp_teacher - logp_behav (the stale, rollout-time signal).
    """
    _check_eps(clip_eps)
    check_agg_mode(mode)
    terms, kl_BT = _reverse_kl_pg(
        logp_BT, logp_behav_BT, logp_teacher_BT, mask_BT, clip_eps=clip_eps, online_advantage=online_advantage
    )
    loss = aggregate(
        apply_weight(terms.loss, weight_BT, mask_BT),
        mask_BT,
        mode=mode,
        num_tokens_global=num_tokens_global,
        num_seqs_global=num_seqs_global,
        norm_constant=norm_constant,
    )
    return loss, _stats(mask_BT, kl_BT, terms, mask_BT)


def multi_sample_reverse_kl(
    logp_BTN: torch.Tensor,
    logp_behav_BTN: torch.Tensor,
    logp_teacher_BTN: torch.Tensor,
    mask_BT: torch.Tensor,
    weight_BT: torch.Tensor | None = None,
    *,
    clip_eps: float = OPD_CLIP_EPS,
    online_advantage: bool = True,
    mode: str = "token-mean",
    num_tokens_global: float | torch.Tensor | None = None,
    num_seqs_global: float | torch.Tensor | None = None,
    norm_constant: float | torch.Tensor | None = None,
) -> tuple[torch.Tensor, OpdStats]:
    """Multi-sample Monte Carlo reverse KL: the per-position loss is the mean of `pg_kl_loss`'s
    per-token term over N ids sampled from mu (with replacement). Unbiased for the reverse-KL
    gradient when no clip is active (e.g. clip_eps = 1e6, AsyncOPD's MC example config).
    """
    _check_eps(clip_eps)
    check_agg_mode(mode)
    mask_BTN = mask_BT[..., None].expand_as(logp_BTN)
    terms, kl_BTN = _reverse_kl_pg(
        logp_BTN,
        logp_behav_BTN,
        logp_teacher_BTN,
        mask_BTN,
        clip_eps=clip_eps,
        online_advantage=online_advantage,
    )
    per_token_BT = terms.loss.mean(dim=-1)
    loss = aggregate(
        apply_weight(per_token_BT, weight_BT, mask_BT),
        mask_BT,
        mode=mode,
        num_tokens_global=num_tokens_global,
        num_seqs_global=num_seqs_global,
        norm_constant=norm_constant,
    )
    return loss, _stats(mask_BT, kl_BTN.mean(dim=-1), terms, mask_BTN)


def token_level_forward_kl(
    logp_BT: torch.Tensor,
    logp_teacher_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    weight_BT: torch.Tensor | None = None,
    *,
    mode: str = "token-mean",
    num_tokens_global: float | torch.Tensor | None = None,
    num_seqs_global: float | torch.Tensor | None = None,
    norm_constant: float | torch.Tensor | None = None,
) -> tuple[torch.Tensor, OpdStats]:
    """Forward-KL contribution at the sampled token: p_T(y) (logp_T(y) - logp_S(y)), teacher detached."""
    check_agg_mode(mode)
    logp_BT = fill_masked(logp_BT, mask_BT)
    logp_teacher_BT = fill_masked(logp_teacher_BT.detach(), mask_BT)
    per_token_BT = torch.exp(logp_teacher_BT) * (logp_teacher_BT - logp_BT)
    loss = aggregate(
        apply_weight(per_token_BT, weight_BT, mask_BT),
        mask_BT,
        mode=mode,
        num_tokens_global=num_tokens_global,
        num_seqs_global=num_seqs_global,
        norm_constant=norm_constant,
    )
    return loss, _stats(mask_BT, per_token_BT.detach())


def multi_sample_forward_kl(
    logp_BTN: torch.Tensor,
    logp_teacher_BTN: torch.Tensor,
    mask_BT: torch.Tensor,
    weight_BT: torch.Tensor | None = None,
    *,
    mode: str = "token-mean",
    num_tokens_global: float | torch.Tensor | None = None,
    num_seqs_global: float | torch.Tensor | None = None,
    norm_constant: float | torch.Tensor | None = None,
) -> tuple[torch.Tensor, OpdStats]:
    """Forward KL by Monte Carlo over N ids sampled from the *teacher*: mean_k (logp_T - logp_S).

    Its gradient -mean_k grad logp_S(y_k) is unbiased for grad KL(pi_teacher || pi_student).
    """
    check_agg_mode(mode)
    mask_BTN = mask_BT[..., None].expand_as(logp_BTN)
    logp_BTN = fill_masked(logp_BTN, mask_BTN)
    logp_teacher_BTN = fill_masked(logp_teacher_BTN.detach(), mask_BTN)
    per_token_BT = (logp_teacher_BTN - logp_BTN).mean(dim=-1)
    loss = aggregate(
        apply_weight(per_token_BT, weight_BT, mask_BT),
        mask_BT,
        mode=mode,
        num_tokens_global=num_tokens_global,
        num_seqs_global=num_seqs_global,
        norm_constant=norm_constant,
    )
    return loss, _stats(mask_BT, per_token_BT.detach())


def topk_forward_kl(
    logp_top_BTK: torch.Tensor,
    logp_teacher_top_BTK: torch.Tensor,
    mask_BT: torch.Tensor,
    weight_BT: torch.Tensor | None = None,
    *,
    mode: str = "token-mean",
    num_tokens_global: float | torch.Tensor | None = None,
    num_seqs_global: float | torch.Tensor | None = None,
    norm_constant: float | torch.Tensor | None = None,
) -> tuple[torch.Tensor, OpdStats]:
    """Teacher-weighted sparse forward KL over the teacher's top-K ids (distinct per position):

        sum_{y in topK_T} p_T(y) (log p_T(y) - log p_S(y)),   teacher detached.

    p_T is the teacher's own probability, *not* renormalised over the K ids: the teacher's mass
    outside its top-K is left out, so the term is a lower bound of the full forward KL's
    contribution at the position, and with K = V it is the full forward KL (value and gradient:
    -sum_y p_T(y) grad log p_S(y))."""
    check_agg_mode(mode)
    mask_BTK = mask_BT[..., None].expand_as(logp_top_BTK)
    logp_BTK = fill_masked(logp_top_BTK, mask_BTK)
    teacher_BTK = fill_masked(logp_teacher_top_BTK.detach(), mask_BTK)
    per_token_BT = (teacher_BTK.exp() * (teacher_BTK - logp_BTK)).sum(dim=-1)
    agg = dict(
        num_tokens_global=num_tokens_global, num_seqs_global=num_seqs_global, norm_constant=norm_constant
    )
    return _forward_loss(per_token_BT, weight_BT, mask_BT, mode=mode, **agg)


def _forward_loss(
    per_token_BT: torch.Tensor, weight_BT: torch.Tensor | None, mask_BT: torch.Tensor, *, mode: str, **agg
) -> tuple[torch.Tensor, OpdStats]:
    """A forward-KL loss from its per-position terms: weighted, aggregated, with its stats."""
    loss = aggregate(apply_weight(per_token_BT, weight_BT, mask_BT), mask_BT, mode=mode, **agg)
    return loss, _stats(mask_BT, per_token_BT.detach())


def _check_eps(clip_eps: float) -> None:
    if clip_eps <= 0.0:
        raise ValueError(f"clip_eps must be > 0, got {clip_eps}")


def _stats(
    mask_BT: torch.Tensor,
    kl_BT: torch.Tensor,
    terms: PpoTerms | None = None,
    terms_mask: torch.Tensor | None = None,
) -> OpdStats:
    """Detached local stats; `terms_mask` is the mask at the shape of `terms` ([B, T] or [B, T, N])."""
    with torch.no_grad():
        num_tokens = mask_BT.sum()
        mean_kl = fill_masked(kl_BT, mask_BT).sum() / num_tokens.clamp(min=1)
        if terms is None or terms_mask is None:
            one = torch.ones_like(mean_kl)
            return OpdStats(kl=mean_kl, clip_fraction=0.0 * one, mean_ratio=one, num_tokens=num_tokens)
        ppo = loss_stats(terms_mask, terms.ratio, terms.clipped, terms.dual_clipped)
        return OpdStats(
            kl=mean_kl, clip_fraction=ppo.clip_fraction, mean_ratio=ppo.mean_ratio, num_tokens=num_tokens
        )
