"""Importance-sampling corrections (pure): no correction, TIS, MIS and IcePop.

Place in the data flow: a `StalenessPolicy` the learner calls once per optimizer step; the weights
repair the training-inference mismatch between the behaviour log-probs shipped by the generator
and the trainer's proximal recompute (ALGORITHMS.md §4.2-§4.4). The PPO anchor is the proximal
log-prob, so the eps-clip controls only the update size.

Legend: B sequences, T token positions per sequence (padded; `mask_BT` marks real completion
tokens). Every `log_*` tensor is detached and 0 at invalid positions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Literal

from asyncrl.lazy import lazy_module
from asyncrl.staleness.base import (
    Correction,
    Need,
    TokenBatch,
    clamped_exp,
    finish,
    log_ratio,
    require_inputs,
    seq_mean,
    seq_sum,
    zero_masked,
)

if TYPE_CHECKING:
    import torch
else:
    torch = lazy_module("torch", globals())  # the launcher validates policies without torch

Level = Literal["token", "sequence", "geometric"]
LEVELS: tuple[Level, ...] = ("token", "sequence", "geometric")


def level_log_weight(log_rho_BT: torch.Tensor, mask_BT: torch.Tensor, *, level: Level) -> torch.Tensor:
    """log of the IS weight at `level`, broadcast to [B, T] (0 at invalid positions).

    token: log rho_t; sequence: sum_t log rho_t (log of the product); geometric: mean_t log rho_t.
    """
    if level == "token":
        return zero_masked(log_rho_BT, mask_BT)
    per_seq_B = seq_sum(log_rho_BT, mask_BT) if level == "sequence" else seq_mean(log_rho_BT, mask_BT)
    return zero_masked(per_seq_B[:, None].expand_as(log_rho_BT), mask_BT)


def rejection_mask(
    log_w_BT: torch.Tensor, mask_BT: torch.Tensor, *, high: float | None, low: float = 0.0
) -> torch.Tensor:
    """Accept valid tokens with low <= w <= high, compared in log space (exact, no overflow)."""
    accept_BT = mask_BT.clone()
    if high is not None:
        accept_BT &= log_w_BT <= math.log(high)
    if low > 0.0:
        accept_BT &= log_w_BT >= math.log(low)
    return accept_BT


def veto_mask(log_rho_BT: torch.Tensor, mask_BT: torch.Tensor, *, threshold: float) -> torch.Tensor:
    """Drop a whole sequence if any valid token has rho < threshold (catastrophic-token veto)."""
    vetoed_BT = mask_BT & (log_rho_BT < math.log(threshold))
    return mask_BT & ~vetoed_BT.any(-1, keepdim=True)


def truncated_weight(
    log_w_BT: torch.Tensor, *, high: float | None, low: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """(clamp(w, low, high), truncated_BT); `truncated_BT` marks where the clamp was active."""
    w_BT = clamped_exp(log_w_BT)
    truncated_BT = torch.zeros_like(log_w_BT, dtype=torch.bool)
    if high is not None:
        truncated_BT |= log_w_BT > math.log(high)
        w_BT = w_BT.clamp(max=high)
    if low > 0.0:
        truncated_BT |= log_w_BT < math.log(low)
        w_BT = w_BT.clamp(min=low)
    return w_BT, truncated_BT


def self_normalize(
    w_BT: torch.Tensor,
    keep_BT: torch.Tensor,
    *,
    weight_sum: float | torch.Tensor | None = None,
    num_kept: float | torch.Tensor | None = None,
) -> torch.Tensor:
    """w / mean(w over kept tokens): self-normalised IS, mean 1 over the kept tokens.

    Pass `weight_sum` and `num_kept` (both all-reduced across data-parallel ranks) to normalise by
    the global mini-batch; by default the batch given is the normalisation scope. A batch whose kept
    weights sum to 0 is returned unchanged.
    """
    w = torch.where(keep_BT, w_BT, torch.zeros((), dtype=w_BT.dtype, device=w_BT.device))
    total = w.sum() if weight_sum is None else torch.as_tensor(weight_sum, dtype=w.dtype, device=w.device)
    count = (
        keep_BT.sum().to(w.dtype)
        if num_kept is None
        else torch.as_tensor(num_kept, dtype=w.dtype, device=w.device)
    )
    ok = (total > 0) & (count > 0)
    mean = torch.where(ok, total / count.clamp(min=1), torch.ones_like(total))
    return w / mean


@dataclass(frozen=True, kw_only=True)
class NoCorrection:
    """On-policy PPO: weight 1, anchor = behaviour log-probs ("behav") or the detached current
    log-probs ("current": bypass with rho == 1, the streaming form of ALGORITHMS.md §5.1)."""

    anchor: Literal["behav", "current"] = "behav"
    name: ClassVar[str] = "none"
    batch_global: ClassVar[bool] = False
    # Weight 1 everywhere: the clip against the anchor is the only place sign(A) enters.
    clip_only_sign_dependence: ClassVar[bool] = True
    ewma_decay: ClassVar[float | None] = None

    def __post_init__(self) -> None:
        if self.anchor not in ("behav", "current"):
            raise ValueError(f"none.anchor must be 'behav' or 'current', got {self.anchor!r}")

    @property
    def needs(self) -> tuple[Need, ...]:
        return ()

    @property
    def streamable(self) -> bool:
        # PPO-clip against mu != pi_old makes the clip indicator depend on sign(A) (§5.5).
        return self.anchor == "current"

    def correct(self, batch: TokenBatch) -> Correction:
        anchor_BT = batch.logp_behav_BT if self.anchor == "behav" else batch.logp_BT
        return finish(batch, anchor_BT, torch.ones_like(batch.logp_behav_BT), batch.mask_BT)


@dataclass(frozen=True, kw_only=True)
class TruncatedIS:
    """TIS (Yao et al.; slime `--tis-clip`): w_t = clamp(pi_prox/mu, clip_low, clip), anchor = prox."""

    clip: float = 2.0
    clip_low: float = 0.0
    name: ClassVar[str] = "tis"
    batch_global: ClassVar[bool] = False
    clip_only_sign_dependence: ClassVar[bool] = False  # streamable: no sign(A) dependence at all
    ewma_decay: ClassVar[float | None] = None

    def __post_init__(self) -> None:
        if not 0.0 <= self.clip_low < self.clip:
            raise ValueError(
                f"tis needs 0 <= clip_low < clip, got clip_low={self.clip_low}, clip={self.clip}"
            )

    @property
    def needs(self) -> tuple[Need, ...]:
        return ("prox",)

    @property
    def streamable(self) -> bool:
        return True

    def correct(self, batch: TokenBatch) -> Correction:
        require_inputs(batch, self.needs, policy=self.name)
        assert batch.logp_prox_BT is not None
        log_rho_BT = log_ratio(batch.logp_prox_BT, batch.logp_behav_BT, batch.mask_BT)
        w_BT, trunc_BT = truncated_weight(log_rho_BT, high=self.clip, low=self.clip_low)
        return finish(batch, batch.logp_prox_BT, w_BT, batch.mask_BT, clipped_BT=trunc_BT)


@dataclass(frozen=True, kw_only=True)
class MaskedIS:
    """MIS (verl rollout correction, slime/Miles): IS weight at `is_level` (truncated at `is_clip`,
    None = untruncated) times a rejection mask at `rs_level` (accept rs_low <= metric <= rs_high;
    rs_low None = 1/rs_high; rs_level None = no rejection), an optional veto dropping sequences with
    any token ratio < `veto`, and optional self-normalisation of the kept weights to mean 1."""

    is_level: Level = "token"
    is_clip: float | None = 2.0
    rs_level: Level | None = "token"
    rs_high: float = 2.0
    rs_low: float | None = None
    veto: float | None = 1e-4
    self_normalize: bool = False
    name: ClassVar[str] = "mis"
    clip_only_sign_dependence: ClassVar[bool] = False  # streamable unless self-normalised
    ewma_decay: ClassVar[float | None] = None

    def __post_init__(self) -> None:
        if self.is_level not in LEVELS or (self.rs_level is not None and self.rs_level not in LEVELS):
            raise ValueError(
                f"{self.name}: levels must be one of {LEVELS}, got {self.is_level!r}, {self.rs_level!r}"
            )
        if self.is_clip is not None and self.is_clip <= 0:
            raise ValueError(f"{self.name}.is_clip must be > 0, got {self.is_clip}")
        if not 0.0 <= self.low <= self.rs_high:
            raise ValueError(f"{self.name} needs 0 <= rs_low <= rs_high, got {self.rs_low}, {self.rs_high}")
        if self.veto is not None and self.veto <= 0:
            raise ValueError(f"{self.name}.veto must be > 0, got {self.veto}")

    @property
    def low(self) -> float:
        return 1.0 / self.rs_high if self.rs_low is None else self.rs_low

    @property
    def needs(self) -> tuple[Need, ...]:
        return ("prox",)

    @property
    def streamable(self) -> bool:
        # The batch mean couples trajectories; everything else is per trajectory (§5.5).
        return not self.self_normalize

    @property
    def batch_global(self) -> bool:
        return self.self_normalize

    def correct(self, batch: TokenBatch) -> Correction:
        require_inputs(batch, self.needs, policy=self.name)
        assert batch.logp_prox_BT is not None
        valid_BT = batch.mask_BT
        log_rho_BT = log_ratio(batch.logp_prox_BT, batch.logp_behav_BT, valid_BT)
        keep_BT = valid_BT
        if self.rs_level is not None:
            log_metric_BT = level_log_weight(log_rho_BT, valid_BT, level=self.rs_level)
            keep_BT = rejection_mask(log_metric_BT, valid_BT, high=self.rs_high, low=self.low)
        if self.veto is not None:
            keep_BT = keep_BT & veto_mask(log_rho_BT, valid_BT, threshold=self.veto)
        log_w_BT = level_log_weight(log_rho_BT, valid_BT, level=self.is_level)
        w_BT, trunc_BT = truncated_weight(log_w_BT, high=self.is_clip)
        if self.self_normalize:
            w_BT = self_normalize(w_BT, keep_BT)
        return finish(batch, batch.logp_prox_BT, w_BT, keep_BT, clipped_BT=trunc_BT)


@dataclass(frozen=True, kw_only=True)
class IcePop(MaskedIS):
    """IcePop (slime `icepop_function`): untruncated token IS weight, zeroed outside [rs_low, rs_high]."""

    is_level: Level = "token"
    is_clip: float | None = None
    rs_level: Level | None = "token"
    rs_high: float = 2.0
    rs_low: float | None = 0.0
    veto: float | None = None
    self_normalize: bool = False
    name: ClassVar[str] = "icepop"
