"""Exact old logits (pure): separate training-inference discrepancy from policy staleness.

Place in the data flow: the learner keeps training-engine snapshots of the last K versions (K >= the
maximum staleness), runs one no-grad forward per version present in the batch (`versions_needed`),
stitches the results token by token (`assemble_old_train_logp`) into `logp_old_train_BT`, and the
`ExactOldLogits` policy builds the two-factor decoupled correction from it.

Paper: Guan et al., *Missing Old Logits in Asynchronous Agentic RL*, arXiv 2605.12070 (ALGORITHMS.md
§3.1-§3.2; snapshot acquisition is a proposal). With mu_vb the engine policy at behaviour version v_b
and pi^train_vb the training engine at the same version:
  pi_theta/mu_vb = [pi^train_vb / mu_vb] (discrepancy: TIS/MIS thresholds)
                 x [pi_theta / pi^train_vb] (staleness: PPO eps-clip; the anchor is pi^train_vb).

Legend: B sequences, T token positions per sequence (padded; `mask_BT` marks real completion tokens).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from asyncrl.lazy import lazy_module
from asyncrl.staleness.base import Correction, Need, TokenBatch, finish, log_ratio, require_inputs
from asyncrl.staleness.importance import rejection_mask, truncated_weight, veto_mask

if TYPE_CHECKING:
    import torch
else:
    torch = lazy_module("torch", globals())  # the launcher validates policies without torch


def versions_needed(versions_BT: torch.Tensor, mask_BT: torch.Tensor) -> list[int]:
    """Sorted policy versions present at valid tokens: the snapshots one batch needs a forward of."""
    return [int(v) for v in torch.unique(versions_BT[mask_BT]).tolist()]


def assemble_old_train_logp(
    versions_BT: torch.Tensor,
    logp_by_version: Mapping[int, torch.Tensor],
    mask_BT: torch.Tensor,
    *,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """logp_old_train_BT[b, t] = logp_by_version[versions_BT[b, t]][b, t] at valid tokens, 0 elsewhere.

    Each mapped tensor is a [B, T] forward of the whole batch with that version's snapshot; only its
    positions of that version are read (in `dtype`, default float32). Raises ValueError naming
    the versions with no snapshot.
    """
    dtype = torch.float32 if dtype is None else dtype
    needed = versions_needed(versions_BT, mask_BT)
    missing = [v for v in needed if v not in logp_by_version]
    if missing:
        have = sorted(logp_by_version)
        raise ValueError(f"no training-engine snapshot log-probs for versions {missing} (have {have})")
    out_BT = torch.zeros(versions_BT.shape, dtype=dtype, device=versions_BT.device)
    for v in needed:
        logp_BT = logp_by_version[v]
        if logp_BT.shape != versions_BT.shape:
            raise ValueError(
                f"snapshot log-probs for version {v} have shape {tuple(logp_BT.shape)}, "
                f"expected {tuple(versions_BT.shape)}"
            )
        out_BT = torch.where(mask_BT & (versions_BT == v), logp_BT.detach().to(dtype), out_BT)
    return out_BT


@dataclass(frozen=True, kw_only=True)
class ExactOldLogits:
    """Two-factor correction with exact old logits: anchor = logp_old_train (PPO eps clips staleness);
    discrepancy weight rho = pi^train_vb/mu truncated at `is_clip` (TIS; None = untruncated), tokens
    rejected outside [rs_low, rs_high] (MIS; rs_high None = no rejection, rs_low None = 1/rs_high),
    and sequences vetoed when any rho < `veto`."""

    is_clip: float | None = 2.0
    rs_high: float | None = None
    rs_low: float | None = None
    veto: float | None = None
    name: ClassVar[str] = "exact"
    batch_global: ClassVar[bool] = False
    # Not claimed, so it trains whole batches: its eps-clip against the behaviour-version policy is
    # the staleness trust region and binds by design.
    clip_only_sign_dependence: ClassVar[bool] = False
    ewma_decay: ClassVar[float | None] = None

    def __post_init__(self) -> None:
        if self.is_clip is not None and self.is_clip <= 0:
            raise ValueError(f"exact.is_clip must be > 0 or None, got {self.is_clip}")
        if self.rs_high is not None and not 0.0 <= self.low <= self.rs_high:
            raise ValueError(f"exact needs 0 <= rs_low <= rs_high, got {self.rs_low}, {self.rs_high}")
        if self.veto is not None and self.veto <= 0:
            raise ValueError(f"exact.veto must be > 0 or None, got {self.veto}")

    @property
    def low(self) -> float:
        if self.rs_low is not None:
            return self.rs_low
        return 0.0 if self.rs_high is None else 1.0 / self.rs_high

    @property
    def needs(self) -> tuple[Need, ...]:
        return ("old_train",)

    @property
    def streamable(self) -> bool:
        # The anchor is the behaviour-version policy, so the staleness clip binds and reads sign(A).
        return False

    def correct(self, batch: TokenBatch) -> Correction:
        require_inputs(batch, self.needs, policy=self.name)
        assert batch.logp_old_train_BT is not None
        valid_BT = batch.mask_BT
        log_rho_BT = log_ratio(batch.logp_old_train_BT, batch.logp_behav_BT, valid_BT)
        keep_BT = valid_BT
        if self.rs_high is not None:
            keep_BT = rejection_mask(log_rho_BT, valid_BT, high=self.rs_high, low=self.low)
        if self.veto is not None:
            keep_BT = keep_BT & veto_mask(log_rho_BT, valid_BT, threshold=self.veto)
        w_BT, trunc_BT = truncated_weight(log_rho_BT, high=self.is_clip)
        return finish(batch, batch.logp_old_train_BT, w_BT, keep_BT, clipped_BT=trunc_BT)
