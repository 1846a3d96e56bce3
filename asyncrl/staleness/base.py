"""Staleness policy interface (pure): what the learner hands a policy and what it gets back.

Place in the data flow: the learner builds a `TokenBatch` from buffered trajectories (behaviour
log-probs and per-token versions shipped by the generators, plus the log-probs it computes), asks
the configured `StalenessPolicy` for a `Correction`, and passes the correction's anchor, weights and
mask to the policy loss in `asyncrl.learner.losses`.

Contract with the loss:
* per-token loss = weight_BT * surrogate(logp_BT, logp_anchor_BT, adv_BT), PPO-clipped when use_clip;
* tokens outside `Correction.mask_BT` contribute nothing;
* the denominator counts `TokenBatch.mask_BT` (valid tokens), NOT `Correction.mask_BT`: rejection
  never changes the denominator (AReaL, ALGORITHMS.md §4.1; M2PO §1.1);
* `lr_scale` multiplies the learning rate of this optimizer step only (VCPO, §2.1).

Legend: B sequences, T token positions per sequence (padded; `mask_BT` marks real completion
tokens), N flattened candidate tokens.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Literal, NamedTuple, Protocol, runtime_checkable

from asyncrl.lazy import lazy_module

if TYPE_CHECKING:
    import torch
else:
    torch = lazy_module("torch", globals())  # the launcher validates policies without torch


Need = Literal["prox", "old_train", "ewma"]

# Optional inputs the learner computes for a policy: "prox" is the step-start forward, "ewma" a
# forward of its EWMA of the parameters (decay `StalenessPolicy.ewma_decay`), "old_train" forwards
# of its snapshots of the last max_staleness + 1 versions. A policy needing anything else cannot
# be selected (the config check names what is missing).
LEARNER_PROVIDES: tuple[Need, ...] = ("prox", "ewma", "old_train")

# Log-ratios are clamped before exp: a token that is very stale (or a rounding-level log-prob of a
# near-impossible token) must not overflow to inf and poison a weight; e^20 ~ 5e8 is far beyond any
# truncation cap in use, so clamping never changes a truncated weight (same bound as verl and
# AsyncOPD, and as `asyncrl.learner.losses.MAX_LOG_RATIO`).
MAX_LOG_RATIO = 20.0

_NAN = float("nan")


class TokenBatch(NamedTuple):
    """Per-token inputs of a staleness policy; all [B, T] tensors share one padded layout."""

    logp_BT: torch.Tensor  # current policy log-probs (may carry grad; policies only read values)
    logp_behav_BT: torch.Tensor  # behaviour (inference engine) log-probs shipped with the trajectory
    mask_BT: torch.Tensor  # bool, real completion tokens
    versions_BT: torch.Tensor  # int64, policy_version that produced each token
    adv_BT: torch.Tensor  # advantages, broadcast per token
    policy_version: int  # learner's policy_version now
    logp_prox_BT: torch.Tensor | None = None  # trainer no-grad forward at the step (update) start
    logp_old_train_BT: torch.Tensor | None = None  # training-engine log-probs at each token's version
    logp_ewma_BT: torch.Tensor | None = None  # EWMA proximal log-probs (EWMA network or EWMA-logit)


class CorrectionStats(NamedTuple):
    """Detached scalar diagnostics; NaN means "not known for this policy / these inputs"."""

    num_valid_tokens: torch.Tensor  # count of TokenBatch.mask_BT (the loss denominator)
    num_kept_tokens: torch.Tensor  # count of Correction.mask_BT
    masked_fraction: torch.Tensor  # 1 - kept/valid
    clip_fraction: torch.Tensor  # kept tokens whose weight was truncated, over valid tokens
    ess_ratio: torch.Tensor  # ESS/n of the applied weights over kept tokens (vcpo: sequence-level)
    mean_weight: torch.Tensor  # over kept tokens
    max_weight: torch.Tensor  # over kept tokens
    mismatch_k3: torch.Tensor  # mean k3 KL of the train-side reference vs behaviour, valid tokens
    mean_freshness: torch.Tensor  # mean freshness score (only with freshness weighting)
    discrepancy_factor: torch.Tensor  # mean old_train/behav (§3.1), needs logp_old_train_BT
    staleness_factor: torch.Tensor  # mean pi_theta/old_train (§3.1), needs logp_old_train_BT
    mean_staleness: torch.Tensor  # mean over valid tokens of policy_version - token version
    max_staleness: torch.Tensor  # max over valid tokens of policy_version - token version


class Correction(NamedTuple):
    """What the loss consumes; every tensor is detached."""

    logp_anchor_BT: torch.Tensor  # PPO "old"/proximal anchor; 0 at invalid positions
    weight_BT: torch.Tensor  # per-token loss weights; 0 where not kept
    mask_BT: torch.Tensor  # bool, tokens kept (subset of TokenBatch.mask_BT)
    use_clip: bool  # False: no eps-clip (M2PO, VCPO), the mask/weights are the trust region
    lr_scale: float  # multiplies this step's learning rate (VCPO); 1.0 otherwise
    stats: CorrectionStats


@runtime_checkable
class StalenessPolicy(Protocol):
    """An off-policy correction: pure function of a TokenBatch, configured by keyword scalars.

    A policy describes itself, so the learner and the config check read its facts from it and no
    other module keeps a list of policy names: the inputs it needs (`needs`, `ewma_decay`),
    whether its correction couples the trajectories of a batch (`batch_global`) and how its
    weights depend on sign(A) (`streamable`, `clip_only_sign_dependence`). Wrappers (freshness
    weighting) delegate to the policy they wrap and add their own facts.
    """

    @property
    def name(self) -> str: ...

    @property
    def needs(self) -> tuple[Need, ...]:
        """Optional TokenBatch inputs this policy requires ("prox", "old_train", "ewma")."""
        ...

    @property
    def streamable(self) -> bool:
        """True when per-token weights depend neither on sign(A) nor on other trajectories (§5.5)."""
        ...

    @property
    def batch_global(self) -> bool:
        """True when the correction is a statistic of the whole batch (M2PO's second-moment mask,
        VCPO's ESS learning-rate scale, self-normalised weights): one rank must see every
        trajectory of the step, and nothing streams."""
        ...

    @property
    def clip_only_sign_dependence(self) -> bool:
        """True when the only sign(A) dependence is the PPO clip against the anchor, so a
        trajectory still streams when the clip binds for neither sign (checked per trajectory)."""
        ...

    @property
    def ewma_decay(self) -> float | None:
        """Decay of the learner's EWMA of the parameters this policy reads ("ewma" in `needs`);
        None when it reads none."""
        ...

    def correct(self, batch: TokenBatch) -> Correction: ...


def with_current_as_prox(batch: TokenBatch) -> TokenBatch:
    """Use the detached current log-probs as `logp_prox_BT`.

    Exact when the learner takes one optimizer step per batch: every micro-batch of that step is
    computed at the step-start parameters, so the current forward *is* the proximal forward and the
    extra no-grad pass can be skipped. Wrong with several optimizer steps per batch.
    """
    return batch._replace(logp_prox_BT=batch.logp_BT.detach())


_NEED_FIELDS: dict[str, str] = {
    "prox": "logp_prox_BT",
    "old_train": "logp_old_train_BT",
    "ewma": "logp_ewma_BT",
}


def require_inputs(batch: TokenBatch, needs: tuple[Need, ...], *, policy: str) -> None:
    """Raise ValueError naming every optional input `policy` needs that the batch lacks."""
    missing = [_NEED_FIELDS[n] for n in needs if getattr(batch, _NEED_FIELDS[n]) is None]
    if missing:
        raise ValueError(f"staleness policy {policy!r} needs TokenBatch.{', '.join(missing)}")


def zero_masked(x_BT: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    """Detached copy of x with invalid positions set to 0 (so inf/nan there never propagate)."""
    return torch.where(mask_BT, x_BT.detach(), torch.zeros((), dtype=x_BT.dtype, device=x_BT.device))


def log_ratio(num_BT: torch.Tensor, den_BT: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    """Detached num - den at valid positions, 0 elsewhere; the subtraction never sees masked values."""
    return zero_masked(num_BT, mask_BT) - zero_masked(den_BT, mask_BT)


def clamped_exp(log_x: torch.Tensor) -> torch.Tensor:
    """exp of a log-ratio clamped to +-MAX_LOG_RATIO (see the constant for why)."""
    return torch.exp(log_x.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO))


def seq_sum(x_BT: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    """Per-sequence sum over valid tokens -> [B]."""
    return torch.where(mask_BT, x_BT, torch.zeros((), dtype=x_BT.dtype, device=x_BT.device)).sum(-1)


def seq_mean(x_BT: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    """Per-sequence mean over valid tokens -> [B]; 0 for a sequence without valid tokens."""
    return seq_sum(x_BT, mask_BT) / mask_BT.sum(-1).clamp(min=1).to(x_BT.dtype)


def masked_mean(x_BT: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    """Mean over masked positions; NaN (0/0) when the mask is empty: a statistic, never a loss."""
    return seq_sum(x_BT, mask_BT).sum() / mask_BT.sum().to(x_BT.dtype)


def masked_max(x_BT: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    """Max over masked positions; NaN when the mask is empty."""
    low = torch.full((), -math.inf, dtype=x_BT.dtype, device=x_BT.device)
    top = torch.where(mask_BT, x_BT, low).max()
    return torch.where(mask_BT.any(), top, torch.full_like(top, _NAN))


def k3_from_log_ratio(log_rho_BT: torch.Tensor) -> torch.Tensor:
    """k3 estimator rho - log(rho) - 1 >= 0 from log(rho) (Schulman; ALGORITHMS.md §4.3, §7.6)."""
    log_rho_BT = log_rho_BT.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    return torch.expm1(log_rho_BT) - log_rho_BT


def token_ess_ratio(w_BT: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    """(sum w)^2 / (sum w^2) / n over masked positions, in (0, 1]; NaN when empty or all zero."""
    w = torch.where(mask_BT, w_BT, torch.zeros((), dtype=w_BT.dtype, device=w_BT.device))
    s1, s2, n = w.sum(), (w * w).sum(), mask_BT.sum().to(w.dtype)
    # Cauchy-Schwarz bounds the ratio by 1; the clamp only removes rounding above 1 (NaN stays NaN).
    return (s1 * s1 / s2 / n).clamp(max=1.0)


def reference_logp(batch: TokenBatch) -> torch.Tensor:
    """Best available training-side log-prob for the mismatch diagnostic: old_train > prox > now."""
    for x in (batch.logp_old_train_BT, batch.logp_prox_BT):
        if x is not None:
            return x
    return batch.logp_BT


def make_stats(
    batch: TokenBatch,
    weight_BT: torch.Tensor,
    keep_BT: torch.Tensor,
    *,
    clipped_BT: torch.Tensor | None = None,
    ess_ratio: torch.Tensor | None = None,
) -> CorrectionStats:
    """Shared diagnostics; `clipped_BT` marks kept tokens whose weight was truncated."""
    valid_BT = batch.mask_BT
    with torch.no_grad():
        dtype, device = batch.logp_behav_BT.dtype, batch.logp_behav_BT.device
        nan = torch.tensor(_NAN, dtype=dtype, device=device)
        num_valid, num_kept = valid_BT.sum(), keep_BT.sum()
        denom = num_valid.clamp(min=1).to(dtype)  # an empty batch reports 0 masked, 0 clipped
        clipped_BT = torch.zeros_like(keep_BT) if clipped_BT is None else clipped_BT
        mismatch = masked_mean(
            k3_from_log_ratio(log_ratio(reference_logp(batch), batch.logp_behav_BT, valid_BT)), valid_BT
        )
        disc = stale = nan
        if batch.logp_old_train_BT is not None:
            disc = masked_mean(
                clamped_exp(log_ratio(batch.logp_old_train_BT, batch.logp_behav_BT, valid_BT)), valid_BT
            )
            stale = masked_mean(
                clamped_exp(log_ratio(batch.logp_BT, batch.logp_old_train_BT, valid_BT)), valid_BT
            )
        lag_BT = (batch.policy_version - torch.where(valid_BT, batch.versions_BT, batch.policy_version)).to(
            dtype
        )
        return CorrectionStats(
            num_valid_tokens=num_valid,
            num_kept_tokens=num_kept,
            masked_fraction=(num_valid - num_kept).to(dtype) / denom,
            clip_fraction=(clipped_BT & keep_BT).sum() / denom,
            ess_ratio=token_ess_ratio(weight_BT, keep_BT) if ess_ratio is None else ess_ratio.detach(),
            mean_weight=masked_mean(weight_BT, keep_BT),
            max_weight=masked_max(weight_BT, keep_BT),
            mismatch_k3=mismatch,
            mean_freshness=nan,
            discrepancy_factor=disc,
            staleness_factor=stale,
            mean_staleness=masked_mean(lag_BT, valid_BT),
            max_staleness=masked_max(lag_BT, valid_BT),
        )


def finish(
    batch: TokenBatch,
    anchor_BT: torch.Tensor,
    weight_BT: torch.Tensor,
    keep_BT: torch.Tensor,
    *,
    use_clip: bool = True,
    lr_scale: float = 1.0,
    clipped_BT: torch.Tensor | None = None,
    ess_ratio: torch.Tensor | None = None,
) -> Correction:
    """Assemble a Correction: keep only valid tokens, zero anchor/weight elsewhere, detach all."""
    keep_BT = keep_BT & batch.mask_BT
    anchor_BT = zero_masked(anchor_BT, batch.mask_BT)
    weight_BT = zero_masked(weight_BT, keep_BT)
    stats = make_stats(batch, weight_BT, keep_BT, clipped_BT=clipped_BT, ess_ratio=ess_ratio)
    return Correction(anchor_BT, weight_BT, keep_BT, use_clip, float(lr_scale), stats)


def staleness_per_sequence(
    versions_BT: torch.Tensor, mask_BT: torch.Tensor, *, policy_version: int
) -> torch.Tensor:
    """policy_version minus the oldest valid token version of each sequence -> [B] (0 if empty)."""
    newest = torch.full((), policy_version, dtype=versions_BT.dtype, device=versions_BT.device)
    return policy_version - torch.where(mask_BT, versions_BT, newest).min(-1).values
