"""Policy losses (pure): per-token log-probs, anchors and advantages in, (loss, stats) out.

Place in the data flow: the learner's train step calls one of these per micro-batch with the
current log-probs (with grad), the anchor log-probs, the advantages from `advantages.py` and the
optional importance weights from the staleness policy, then backpropagates the returned loss.

Legend: B sequences, T tokens per sequence (padded; `mask_BT` marks real completion tokens).
Functions documented as shape-agnostic also take [B, T, N] inputs (N samples per position).

Conventions shared by every loss here:
* Inputs are cleaned with `torch.where(mask, x, fill)` before any arithmetic, so inf/nan at
  masked positions reach neither the loss nor its gradient.
* `weight_BT` (optional) is a per-token importance weight (e.g. from a staleness policy). It is
  detached here and multiplied into the per-token loss.
* Denominators are explicit keyword arguments (see `aggregate`). Splitting the sequences of a
  batch into micro-batches, calling the loss on each with the same global denominators and summing
  gives the full-batch loss and gradient.
* Stats are detached and local to the call (means over this call's valid tokens).

Which of these `learner.loss` names, with its defaults and how it streams, is the registry's
(`policy_losses.py`); adding a loss is a function here, an entry there and its test.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

from asyncrl.lazy import lazy_module

if TYPE_CHECKING:
    import torch
else:
    torch = lazy_module("torch", globals())  # the launcher reads the loss registry without torch

# Log-ratios are clamped before exp so that a very stale token cannot overflow to inf.
MAX_LOG_RATIO = 20.0
# GSPO (verl `compute_policy_loss_gspo`): the combined token log-ratio is clamped at <= 10.
GSPO_MAX_LOG_RATIO = 10.0

AGG_MODES: tuple[str, ...] = (
    "token-mean",  # sum m*l / num_tokens_global                      (DAPO, verl default)
    "seq-mean-token-mean",  # sum_i (sum_t m*l / |o_i|) / num_seqs_global  (original GRPO)
    "seq-mean-token-sum",  # sum m*l / num_seqs_global
    "seq-mean-token-sum-norm",  # sum m*l / norm_constant                   (Dr. GRPO)
)


class LossStats(NamedTuple):
    clip_fraction: torch.Tensor  # valid tokens whose gradient clipping changed (incl. dual clip)
    dual_clip_fraction: torch.Tensor  # valid tokens where the dual-clip bound (A < 0) was active
    mean_ratio: torch.Tensor  # mean pi_theta / pi_old over valid tokens
    num_tokens: torch.Tensor  # valid tokens in this call


def fill_masked(x: torch.Tensor, mask: torch.Tensor, value: float = 0.0) -> torch.Tensor:
    """`value` where `mask` is False. Gradient at masked positions is exactly zero (no inf*0)."""
    return torch.where(mask, x, value)


def _denominator(value: float | torch.Tensor | None, name: str, mode: str) -> float | torch.Tensor:
    if value is None:
        raise ValueError(f"aggregation mode {mode!r} needs {name}")
    if not isinstance(value, torch.Tensor) and value <= 0:
        raise ValueError(f"{name} must be > 0, got {value}")
    return value


def check_agg_mode(mode: str) -> None:
    if mode not in AGG_MODES:
        raise ValueError(f"unknown loss aggregation mode {mode!r}; valid: {', '.join(AGG_MODES)}")


def aggregate(
    per_token_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    *,
    mode: str = "token-mean",
    num_tokens_global: float | torch.Tensor | None = None,
    num_seqs_global: float | torch.Tensor | None = None,
    norm_constant: float | torch.Tensor | None = None,
) -> torch.Tensor:
    """Reduce a per-token loss to a scalar with a global denominator (see AGG_MODES).

    Only the denominator the mode needs must be given: token-mean needs `num_tokens_global`
    (valid tokens in the whole optimizer-step batch, across micro-batches and ranks),
    seq-mean-* need `num_seqs_global`, seq-mean-token-sum-norm needs `norm_constant` (Dr. GRPO:
    the max response length). In seq-mean-token-mean a sequence with no valid token adds 0.
    """
    check_agg_mode(mode)
    per_token_BT = fill_masked(per_token_BT, mask_BT)
    if mode == "token-mean":
        return per_token_BT.sum() / _denominator(num_tokens_global, "num_tokens_global", mode)
    if mode == "seq-mean-token-mean":
        num_valid_B = mask_BT.sum(dim=1).clamp(min=1)
        seq_means = (per_token_BT.sum(dim=1) / num_valid_B).sum()
        return seq_means / _denominator(num_seqs_global, "num_seqs_global", mode)
    if mode == "seq-mean-token-sum":
        return per_token_BT.sum() / _denominator(num_seqs_global, "num_seqs_global", mode)
    return per_token_BT.sum() / _denominator(norm_constant, "norm_constant", mode)


def clamped_log_ratio(logp: torch.Tensor, logp_old: torch.Tensor) -> torch.Tensor:
    """log r = logp - logp_old, clamped to +-MAX_LOG_RATIO (inputs already mask-cleaned)."""
    return (logp - logp_old).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)


def apply_weight(per_token: torch.Tensor, weight: torch.Tensor | None, mask: torch.Tensor) -> torch.Tensor:
    """Multiply a detached, mask-cleaned importance weight into the per-token loss."""
    if weight is None:
        return per_token
    return per_token * fill_masked(weight.detach(), mask)


class PpoTerms(NamedTuple):
    loss: torch.Tensor  # per-token (or per-sample) clipped surrogate, to minimise
    ratio: torch.Tensor
    clipped: torch.Tensor  # bool: the clipped branch was strictly selected (zero gradient)
    dual_clipped: torch.Tensor  # bool: the dual-clip bound was strictly selected


def ppo_terms(
    log_ratio: torch.Tensor,
    adv: torch.Tensor,
    *,
    clip_low: float,
    clip_high: float,
    dual_clip: float | None = None,
) -> PpoTerms:
    """Shape-agnostic clipped surrogate on already-cleaned inputs.

    l = max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high)); with dual clip c and A < 0,
    l = min(l, -A c). `log_ratio` must already be clamped and zero at masked positions.
    """
    ratio = torch.exp(log_ratio)
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss = torch.maximum(unclipped, clipped)
    with torch.no_grad():
        clip_active = clipped > unclipped
    if dual_clip is None:
        return PpoTerms(loss, ratio, clip_active, torch.zeros_like(clip_active))
    bound = -adv * dual_clip
    with torch.no_grad():
        dual_active = (adv < 0) & (bound < loss)
    loss = torch.where(adv < 0, torch.minimum(loss, bound), loss)
    return PpoTerms(loss, ratio, clip_active & ~dual_active, dual_active)


def check_clip(clip_low: float, clip_high: float, dual_clip: float | None = None) -> None:
    if not 0.0 <= clip_low <= 1.0:
        raise ValueError(f"clip_low must be in [0, 1], got {clip_low}")
    if clip_high < 0.0:
        raise ValueError(f"clip_high must be >= 0, got {clip_high}")
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1, got {dual_clip}")


def loss_stats(
    mask: torch.Tensor, ratio: torch.Tensor, clipped: torch.Tensor, dual_clipped: torch.Tensor
) -> LossStats:
    """Detached local stats over valid positions (mask broadcastable to the other tensors)."""
    with torch.no_grad():
        mask = mask.expand_as(ratio)
        num_tokens = mask.sum()
        n = num_tokens.clamp(min=1)
        return LossStats(
            clip_fraction=((clipped | dual_clipped) & mask).sum() / n,
            dual_clip_fraction=(dual_clipped & mask).sum() / n,
            mean_ratio=fill_masked(ratio, mask).sum() / n,
            num_tokens=num_tokens,
        )


def clipped_surrogate(
    logp_BT: torch.Tensor,
    logp_old_BT: torch.Tensor,
    adv_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    weight_BT: torch.Tensor | None = None,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
    mode: str = "token-mean",
    num_tokens_global: float | torch.Tensor | None = None,
    num_seqs_global: float | torch.Tensor | None = None,
    norm_constant: float | torch.Tensor | None = None,
) -> tuple[torch.Tensor, LossStats]:
    """PPO/GRPO clipped surrogate with clip-higher (DAPO: clip_low 0.2, clip_high 0.28) and dual clip.

    r = exp(clamp(logp - logp_old, +-MAX_LOG_RATIO)); per-token loss (minimised)
    l = max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high)), and for A < 0 with `dual_clip` c > 1,
    l = min(l, -A c). At r = 1 (logp_old = logp.detach()) the gradient is REINFORCE's, -A grad logp.
    """
    check_clip(clip_low, clip_high, dual_clip)
    check_agg_mode(mode)
    logp_BT = fill_masked(logp_BT, mask_BT)
    logp_old_BT = fill_masked(logp_old_BT, mask_BT)
    adv_BT = fill_masked(adv_BT, mask_BT)
    log_ratio_BT = clamped_log_ratio(logp_BT, logp_old_BT)
    terms = ppo_terms(log_ratio_BT, adv_BT, clip_low=clip_low, clip_high=clip_high, dual_clip=dual_clip)
    loss = aggregate(
        apply_weight(terms.loss, weight_BT, mask_BT),
        mask_BT,
        mode=mode,
        num_tokens_global=num_tokens_global,
        num_seqs_global=num_seqs_global,
        norm_constant=norm_constant,
    )
    return loss, loss_stats(mask_BT, terms.ratio, terms.clipped, terms.dual_clipped)


def gspo_loss(
    logp_BT: torch.Tensor,
    logp_old_BT: torch.Tensor,
    adv_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    weight_BT: torch.Tensor | None = None,
    *,
    clip_low: float = 3e-4,
    clip_high: float = 4e-4,
    mode: str = "seq-mean-token-mean",
    num_tokens_global: float | torch.Tensor | None = None,
    num_seqs_global: float | torch.Tensor | None = None,
    norm_constant: float | torch.Tensor | None = None,
) -> tuple[torch.Tensor, LossStats]:
    """GSPO, token variant (as verl): sequence ratio s_i, token ratio s_it = sg(s_i) pi / sg(pi).

    log s_i = mean over valid t of (logp - logp_old); log s_it = sg(log s_i) + logp - sg(logp),
    clamped at <= 10; then the clipped surrogate on s_it. verl forces `seq-mean-token-mean`, which
    with a per-sequence advantage is exactly the sequence-level GSPO objective; other modes are
    allowed but change the weighting.
    """
    check_clip(clip_low, clip_high)
    check_agg_mode(mode)
    logp_BT = fill_masked(logp_BT, mask_BT)
    logp_old_BT = fill_masked(logp_old_BT, mask_BT)
    adv_BT = fill_masked(adv_BT, mask_BT)
    num_valid_B1 = mask_BT.sum(dim=1, keepdim=True).clamp(min=1)
    log_seq_ratio_B1 = (logp_BT - logp_old_BT).sum(dim=1, keepdim=True) / num_valid_B1
    log_ratio_BT = log_seq_ratio_B1.detach() + logp_BT - logp_BT.detach()
    log_ratio_BT = fill_masked(log_ratio_BT.clamp(max=GSPO_MAX_LOG_RATIO), mask_BT)
    terms = ppo_terms(log_ratio_BT, adv_BT, clip_low=clip_low, clip_high=clip_high)
    loss = aggregate(
        apply_weight(terms.loss, weight_BT, mask_BT),
        mask_BT,
        mode=mode,
        num_tokens_global=num_tokens_global,
        num_seqs_global=num_seqs_global,
        norm_constant=norm_constant,
    )
    return loss, loss_stats(mask_BT, terms.ratio, terms.clipped, terms.dual_clipped)


def cispo_loss(
    logp_BT: torch.Tensor,
    logp_old_BT: torch.Tensor,
    adv_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    weight_BT: torch.Tensor | None = None,
    *,
    clip_low: float = 1.0,
    clip_high: float = 0.28,
    unified_mask: bool = False,
    mode: str = "token-mean",
    num_tokens_global: float | torch.Tensor | None = None,
    num_seqs_global: float | torch.Tensor | None = None,
    norm_constant: float | torch.Tensor | None = None,
) -> tuple[torch.Tensor, LossStats]:
    """CISPO: l = -A sg(clip(r, 1 - clip_low, 1 + clip_high)) logp (defaults: Trinity-RFT).

    clip_low = 1 means no lower bound (the paper tunes only the upper one). With `unified_mask`,
    tokens with (A > 0 and r > 1 + clip_high) or (A < 0 and r < 1 - clip_low) are dropped, as in
    the paper's unified formulation. The token's gradient is never zeroed by the weight clip alone.
    """
    check_clip(clip_low, clip_high)
    check_agg_mode(mode)
    logp_BT = fill_masked(logp_BT, mask_BT)
    logp_old_BT = fill_masked(logp_old_BT, mask_BT)
    adv_BT = fill_masked(adv_BT, mask_BT)
    with torch.no_grad():
        ratio_BT = torch.exp(clamped_log_ratio(logp_BT, logp_old_BT))
        is_weight_BT = ratio_BT.clamp(1.0 - clip_low, 1.0 + clip_high)
        truncated_BT = is_weight_BT != ratio_BT
        if unified_mask:
            dropped_BT = ((adv_BT > 0) & (ratio_BT > 1.0 + clip_high)) | (
                (adv_BT < 0) & (ratio_BT < 1.0 - clip_low)
            )
        else:
            dropped_BT = torch.zeros_like(mask_BT)
    per_token_BT = fill_masked(-adv_BT * is_weight_BT * logp_BT, ~dropped_BT)
    loss = aggregate(
        apply_weight(per_token_BT, weight_BT, mask_BT),
        mask_BT,
        mode=mode,
        num_tokens_global=num_tokens_global,
        num_seqs_global=num_seqs_global,
        norm_constant=norm_constant,
    )
    return loss, loss_stats(mask_BT, ratio_BT, truncated_BT | dropped_BT, torch.zeros_like(dropped_BT))


def check_sapo(tau_pos: float, tau_neg: float) -> None:
    if not (tau_pos > 0 and tau_neg > 0):
        raise ValueError(f"tau_pos and tau_neg must be > 0, got tau_pos={tau_pos}, tau_neg={tau_neg}")


def sapo_loss(
    logp_BT: torch.Tensor,
    logp_old_BT: torch.Tensor,
    adv_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    weight_BT: torch.Tensor | None = None,
    *,
    tau_pos: float = 1.0,
    tau_neg: float = 1.05,
    mode: str = "token-mean",
    num_tokens_global: float | torch.Tensor | None = None,
    num_seqs_global: float | torch.Tensor | None = None,
    norm_constant: float | torch.Tensor | None = None,
) -> tuple[torch.Tensor, LossStats]:
    """SAPO: a soft, temperature-controlled gate on the ratio instead of a clip (defaults: the paper's).

    r = exp(clamp(logp - logp_old, +-MAX_LOG_RATIO)), tau = tau_pos where A > 0, tau_neg otherwise;
    l = -A f(r) with f(r) = (4 / tau) sigmoid(tau (r - 1)). Its gradient is -A w(r) r grad logp
    with w = f'(r) = 4 s (1 - s), s = sigmoid(tau (r - 1)): w r = 1 at r = 1 (REINFORCE on-policy)
    and it decays smoothly as r leaves 1, faster for the larger tau_neg on negative advantages.
    Nothing is clipped: clip_fraction is 0.

    The gradient is built from w itself: l = -A (sg(f(r)) + sg(w) (r - sg(r))) has the value and
    the gradient of -A f(r), with w = 4 sigmoid(x) sigmoid(-x) (no cancellation in 1 - s for large
    x), so at r = 1 the weight is exactly 1 for either tau and the gradient is REINFORCE's to the
    bit (an autograd of 4 / tau * sigmoid(...) would round (4 / tau) * tau).
    """
    check_sapo(tau_pos, tau_neg)
    check_agg_mode(mode)
    logp_BT = fill_masked(logp_BT, mask_BT)
    logp_old_BT = fill_masked(logp_old_BT, mask_BT)
    adv_BT = fill_masked(adv_BT, mask_BT)
    ratio_BT = torch.exp(clamped_log_ratio(logp_BT, logp_old_BT))
    with torch.no_grad():
        tau_BT = torch.full_like(ratio_BT, tau_neg).masked_fill_(adv_BT > 0, tau_pos)
        x_BT = tau_BT * (ratio_BT - 1.0)
        gate_BT = 4.0 / tau_BT * torch.sigmoid(x_BT)
        slope_BT = 4.0 * torch.sigmoid(x_BT) * torch.sigmoid(-x_BT)
    per_token_BT = -adv_BT * (gate_BT + slope_BT * (ratio_BT - ratio_BT.detach()))
    loss = aggregate(
        apply_weight(per_token_BT, weight_BT, mask_BT),
        mask_BT,
        mode=mode,
        num_tokens_global=num_tokens_global,
        num_seqs_global=num_seqs_global,
        norm_constant=norm_constant,
    )
    never_BT = torch.zeros_like(mask_BT)
    return loss, loss_stats(mask_BT, ratio_BT.detach(), never_BT, never_BT)
