"""PPO-EWMA proxies (pure): an EWMA of the policy as the proximal (trust-region) anchor.

Place in the data flow: the learner keeps `EwmaParams` next to the model and updates it after every
optimizer step, runs a no-grad forward of the EWMA weights to fill `TokenBatch.logp_ewma_BT` (or,
for revisited samples, keeps a per-token running log-prob with `ewma_logp_update`), and the `PpoEwma`
policy turns it into the anchor and behaviour weight.

Source: Hilton, Cobbe, Schulman, arXiv 2110.00641, code openai/ppo-ewma (ALGORITHMS.md §3.4); the LLM
adaptations of §3.5 are proposals. The loss is the decoupled objective with pi_prox = pi_ewma:
  -min( (pi_theta/mu) A, (pi_ewma/mu) clip(pi_theta/pi_ewma, 1-eps, 1+eps) A )
  = (pi_ewma/mu) * max(-u A, -clip(u) A),  u = pi_theta/pi_ewma.

Legend: B sequences, T token positions per sequence (padded; `mask_BT` marks real completion tokens).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Literal, NamedTuple

from asyncrl.lazy import lazy_module
from asyncrl.staleness.base import (
    Correction,
    Need,
    TokenBatch,
    clamped_exp,
    finish,
    log_ratio,
    require_inputs,
    zero_masked,
)

if TYPE_CHECKING:
    import torch
else:
    torch = lazy_module("torch", globals())  # the launcher validates policies without torch

PPO_EWMA_IS_CAP = 100.0  # openai/ppo-ewma `imp_samp_max`


def ewma_decay_for_age(age_steps: float) -> float:
    """Decay whose EWMA lags `age_steps` optimizer steps on average (centre of mass beta/(1-beta))."""
    if age_steps < 0:
        raise ValueError(f"age_steps must be >= 0, got {age_steps}")
    return age_steps / (1.0 + age_steps)


class EwmaParams(NamedTuple):
    """Bias-corrected EWMA of a state dict: theta_ewma = sum_k beta^(n-k) theta_k / sum_k beta^(n-k).

    Immutable: `update` returns a new value. Floating tensors accumulate in float32 (a bf16 running
    average would lose the small per-step increments); other tensors (int buffers) track the latest.
    """

    params: dict[str, torch.Tensor]
    total: float  # sum_k beta^(n-k), the bias-correction normaliser

    @classmethod
    def init(cls, state_dict: Mapping[str, torch.Tensor]) -> EwmaParams:
        return cls({k: _accumulator(v) for k, v in state_dict.items()}, 1.0)

    def update(self, state_dict: Mapping[str, torch.Tensor], *, decay: float) -> EwmaParams:
        """One step: total' = decay*total + 1; theta_ewma' = theta_ewma*(decay*total/total') + theta/total'."""
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"EWMA decay must be in [0, 1), got {decay}")
        if state_dict.keys() != self.params.keys():
            diff = sorted(set(state_dict.keys()) ^ set(self.params.keys()))
            raise ValueError(f"EWMA state dict keys differ from the tracked ones: {diff}")
        new_total = decay * self.total + 1.0
        keep, add = decay * self.total / new_total, 1.0 / new_total
        out: dict[str, torch.Tensor] = {}
        for k, theta in state_dict.items():
            acc = self.params[k]
            out[k] = (
                acc * keep + theta.detach().to(acc.dtype) * add
                if acc.is_floating_point()
                else _accumulator(theta)
            )
        return EwmaParams(out, new_total)

    def reset(self, state_dict: Mapping[str, torch.Tensor]) -> EwmaParams:
        """Forget the history (openai/ppo-ewma: reset() == update(decay=0))."""
        return self.update(state_dict, decay=0.0)


def _accumulator(x: torch.Tensor) -> torch.Tensor:
    x = x.detach()
    return x.to(torch.float32, copy=True) if x.is_floating_point() else x.clone()


def ewma_logp_update(
    lbar_BT: torch.Tensor | None, logp_now_BT: torch.Tensor, mask_BT: torch.Tensor, *, beta: float
) -> torch.Tensor:
    """EWMA-of-log-probs proxy [proposal §3.5]: lbar <- beta*lbar + (1-beta)*logp_now (detached).

    `lbar_BT` None means the trainer sees the sample for the first time: lbar = logp_now. Invalid
    positions are 0 in the result.
    """
    if not 0.0 <= beta < 1.0:
        raise ValueError(f"EWMA beta must be in [0, 1), got {beta}")
    now_BT = zero_masked(logp_now_BT, mask_BT)
    if lbar_BT is None:
        return now_BT
    return beta * zero_masked(lbar_BT, mask_BT) + (1.0 - beta) * now_BT


@dataclass(frozen=True, kw_only=True)
class PpoEwma:
    """PPO-EWMA: anchor = log pi_ewma, behaviour weight pi_ewma/mu capped at `cap`.

    cap_mode "proxy" [§3.5]: w = min(pi_ewma/mu, cap). cap_mode "original" (openai/ppo-ewma):
    mu is raised to pi_theta/cap first (logp_adj = max(log mu, log pi_theta - log cap)), so the
    cap acts on pi_theta/mu and w = pi_ewma / max(mu, pi_theta/cap).
    """

    cap: float = PPO_EWMA_IS_CAP
    cap_mode: Literal["proxy", "original"] = "proxy"
    # The learner's EWMA of the parameters: theta_ewma <- decay-weighted average after every step
    # (0.5 lags about one step; `ewma_decay_for_age`).
    decay: float = 0.5
    name: ClassVar[str] = "ewma"
    batch_global: ClassVar[bool] = False
    # Not claimed, so it trains whole batches: pi_theta != pi_ewma at the step start, the clip binds.
    clip_only_sign_dependence: ClassVar[bool] = False

    def __post_init__(self) -> None:
        if not 0.0 <= self.decay < 1.0:
            raise ValueError(f"ewma.decay must be in [0, 1), got {self.decay}")
        if self.cap <= 0:
            raise ValueError(f"ewma.cap must be > 0, got {self.cap}")
        if self.cap_mode not in ("proxy", "original"):
            raise ValueError(f"ewma.cap_mode must be 'proxy' or 'original', got {self.cap_mode!r}")

    @property
    def needs(self) -> tuple[Need, ...]:
        return ("ewma",)

    @property
    def streamable(self) -> bool:
        # pi_theta != pi_ewma at the step start, so the clip can bind, and it depends on sign(A).
        return False

    @property
    def ewma_decay(self) -> float:
        return self.decay

    def correct(self, batch: TokenBatch) -> Correction:
        require_inputs(batch, self.needs, policy=self.name)
        assert batch.logp_ewma_BT is not None
        valid_BT = batch.mask_BT
        log_cap = math.log(self.cap)
        log_w_BT = log_ratio(batch.logp_ewma_BT, batch.logp_behav_BT, valid_BT)
        if self.cap_mode == "proxy":
            clipped_BT = log_w_BT > log_cap
            w_BT = clamped_exp(log_w_BT.clamp(max=log_cap))
        else:
            log_now_over_behav_BT = log_ratio(batch.logp_BT, batch.logp_behav_BT, valid_BT)
            clipped_BT = log_now_over_behav_BT > log_cap
            # log(pi_ewma / max(mu, pi_theta/cap)) = log_w - max(0, log(pi_theta/mu) - log cap)
            w_BT = clamped_exp(log_w_BT - (log_now_over_behav_BT - log_cap).clamp(min=0.0))
        return finish(batch, batch.logp_ewma_BT, w_BT, valid_BT, clipped_BT=clipped_BT)
