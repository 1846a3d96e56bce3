"""AReaL decoupled PPO (pure): proximal anchor plus a behaviour importance weight with rejection.

Place in the data flow: a `StalenessPolicy` the learner calls once per optimizer step, after its
no-grad proximal forward (`logp_prox_BT`, the parameters at the start of the update).

  J = E_mu[ (pi_prox/mu) * min(u A, clip(u, 1-eps, 1+eps) A) ],  u = pi_theta/pi_prox
  (ALGORITHMS.md §4.1; AReaL arXiv 2505.24298 and `areal/utils/functional/functional.py`)

The behaviour weight w = pi_prox/mu is detached. Rejection (AReaL default: metric "ratio", level
"token", action "mask", upper 5.0) drops tokens with w > cap, or truncates w at cap with action
"clamp". Rejected tokens stay in the loss denominator: the learner divides by the count of
`TokenBatch.mask_BT`.

Legend: B sequences, T token positions per sequence (padded; `mask_BT` marks real completion tokens).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar, Literal

from asyncrl.staleness.base import (
    Correction,
    Need,
    TokenBatch,
    clamped_exp,
    finish,
    log_ratio,
    require_inputs,
)
from asyncrl.staleness.importance import level_log_weight, rejection_mask


@dataclass(frozen=True, kw_only=True)
class Decoupled:
    """Decoupled PPO. `cap` None disables rejection; `level` "geometric" rejects whole sequences
    whose geometric-mean weight exp(mean_t log w_t) exceeds `cap` (mask action only)."""

    cap: float | None = 5.0
    action: Literal["mask", "clamp"] = "mask"
    level: Literal["token", "geometric"] = "token"
    name: ClassVar[str] = "decoupled"
    batch_global: ClassVar[bool] = False
    clip_only_sign_dependence: ClassVar[bool] = False  # streamable: no sign(A) dependence at all
    ewma_decay: ClassVar[float | None] = None

    def __post_init__(self) -> None:
        if self.cap is not None and self.cap <= 0:
            raise ValueError(f"decoupled.cap must be > 0 or None, got {self.cap}")
        if self.action not in ("mask", "clamp"):
            raise ValueError(f"decoupled.action must be 'mask' or 'clamp', got {self.action!r}")
        if self.level not in ("token", "geometric"):
            raise ValueError(f"decoupled.level must be 'token' or 'geometric', got {self.level!r}")
        if self.action == "clamp" and self.level != "token":
            raise ValueError("decoupled: action 'clamp' truncates token weights; use level 'token'")

    @property
    def needs(self) -> tuple[Need, ...]:
        return ("prox",)

    @property
    def streamable(self) -> bool:
        # w is per token and A-independent; u == 1 at the step start, so the clip is inactive (§5.5).
        return True

    def correct(self, batch: TokenBatch) -> Correction:
        require_inputs(batch, self.needs, policy=self.name)
        assert batch.logp_prox_BT is not None
        valid_BT = batch.mask_BT
        log_w_BT = log_ratio(batch.logp_prox_BT, batch.logp_behav_BT, valid_BT)
        w_BT = clamped_exp(log_w_BT)
        keep_BT, clipped_BT = valid_BT, None
        if self.cap is not None and self.action == "mask":
            log_metric_BT = level_log_weight(log_w_BT, valid_BT, level=self.level)
            keep_BT = rejection_mask(log_metric_BT, valid_BT, high=self.cap)
        elif self.cap is not None:
            clipped_BT = log_w_BT > math.log(self.cap)
            w_BT = w_BT.clamp(max=self.cap)
        return finish(batch, batch.logp_prox_BT, w_BT, keep_BT, clipped_BT=clipped_BT)
