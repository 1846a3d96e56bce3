"""M2PO second-moment trust region (pure): mask the few tokens that carry the log-ratio's second moment.

Place in the data flow: a `StalenessPolicy` the learner calls before each optimizer step (theta at
the step start) over the whole mini-batch. The mask is global over the tokens it is given: under
data parallelism, all-gather the detached TokenBatch fields first (they are small next to the
model) and slice this rank's rows of the Correction; that keeps the tie order exact.

Paper: Zheng, Zhao, Chen, arXiv 2510.01161 (ALGORITHMS.md §1). With log r = log pi_theta - log mu
and M2_i = (log r_i)^2 over the trust-region ("harmful") tokens
  T = valid & ((A > 0 & r > 1) | (A < 0 & r < 1))     (official code's candidate set, §1.1)
two rules exist:
* "remove" (paper Algorithm 1, default): while mean_T M2 > tau, drop argmax M2 from T. Dropped
  tokens are masked; the loss is sum(M * r * A) / num_valid with no eps-clip.
* "cap" (official repo, §1.2a): largest breakpoint c of the sorted M2 with mean_T min(M2, c) <= tau;
  mask candidates with M2 > c (== PPO-clip at e^{+-sqrt(c)} restricted to harmful tokens).
Capping masks at least as many tokens as removal at the same tau (capped tokens still count c).

Legend: B sequences, T token positions per sequence (padded), N flattened candidate tokens.
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
    finish,
    log_ratio,
    require_inputs,
    zero_masked,
)

if TYPE_CHECKING:
    import torch
else:
    torch = lazy_module("torch", globals())  # the launcher validates policies without torch

M2PO_TAU = 0.04  # official script `M2_budget=0.04`; AReaL `m2_threshold: 0.04`


def trust_region_tokens(log_r_BT: torch.Tensor, adv_BT: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    """Tokens whose ratio moved in the direction the advantage rewards (the only ones PPO can clip)."""
    adv_BT = zero_masked(adv_BT, mask_BT)
    return mask_BT & (((adv_BT > 0) & (log_r_BT > 0)) | ((adv_BT < 0) & (log_r_BT < 0)))


def m2po_remove_greedy(m2_N: torch.Tensor, *, tau: float) -> torch.Tensor:
    """Paper Algorithm 1, literally: bool [N], True for removed tokens. O(N^2); the reference.

    "mean > tau" is evaluated as "sum > tau * count" so both forms compare the same quantities.
    Among equal values argmax takes the lowest index (ties are removed by rank).
    """
    removed_N = torch.zeros_like(m2_N, dtype=torch.bool)
    neg_inf = torch.full_like(m2_N, -math.inf)
    while True:
        remaining = int((~removed_N).sum())
        if remaining == 0 or float(m2_N[~removed_N].sum()) <= tau * remaining:
            return removed_N
        removed_N[int(torch.where(removed_N, neg_inf, m2_N).argmax())] = True


def m2po_remove_sorted(m2_N: torch.Tensor, *, tau: float) -> torch.Tensor:
    """Algorithm 1 as sort + suffix means (§1.4): remove the k largest, k the first index whose
    suffix mean is <= tau (N if none). Stable sort, so ties are removed by rank as in the greedy loop."""
    n = m2_N.numel()
    removed_N = torch.zeros_like(m2_N, dtype=torch.bool)
    if n == 0:
        return removed_N
    sorted_N, order_N = torch.sort(m2_N, descending=True, stable=True)
    suffix_sum_N = torch.flip(torch.cumsum(torch.flip(sorted_N, (0,)), 0), (0,))
    count_N = torch.arange(n, 0, -1, dtype=m2_N.dtype, device=m2_N.device)
    ok_N = suffix_sum_N <= tau * count_N
    k = torch.where(ok_N.any(), ok_N.to(torch.int64).argmax(), torch.tensor(n, device=m2_N.device))
    removed_N[order_N] = torch.arange(n, device=m2_N.device) < k
    return removed_N


def m2po_cap_bound(m2_N: torch.Tensor, *, tau: float) -> torch.Tensor:
    """Official capping rule: the largest sorted value c with mean(min(M2, c)) <= tau (+inf for an
    empty set). If even the smallest value fails, every value exceeds tau and c = tau solves
    mean(min(M2, c)) = tau exactly."""
    n = m2_N.numel()
    if n == 0:
        return torch.tensor(math.inf, dtype=m2_N.dtype, device=m2_N.device)
    sorted_N = torch.sort(m2_N).values
    # capped sum at c = sorted[j]: values up to j count themselves, the n-1-j above count c.
    above_N = torch.arange(n - 1, -1, -1, dtype=m2_N.dtype, device=m2_N.device)
    capped_sum_N = torch.cumsum(sorted_N, 0) + above_N * sorted_N
    ok_N = capped_sum_N <= tau * n  # nondecreasing in j, so ok is a prefix
    last = (ok_N.sum() - 1).clamp(min=0)
    return torch.where(ok_N.any(), sorted_N[last], torch.tensor(tau, dtype=m2_N.dtype, device=m2_N.device))


def m2po_cap_mask(m2_N: torch.Tensor, *, tau: float) -> torch.Tensor:
    """bool [N]: tokens the capping rule masks (M2 strictly above the bound: at the bound the clip
    clamp(r, e^-t, e^t) still passes the gradient)."""
    return m2_N > m2po_cap_bound(m2_N, tau=tau)


@dataclass(frozen=True, kw_only=True)
class M2PO:
    """M2PO masking; `anchor` "behav" (paper) or "old_train" (official code's trainer recompute at v_b);
    `candidates` "all" drops the trust-region restriction (AReaL's variant)."""

    tau: float = M2PO_TAU
    rule: Literal["remove", "cap"] = "remove"
    candidates: Literal["trust_region", "all"] = "trust_region"
    anchor: Literal["behav", "old_train"] = "behav"
    name: ClassVar[str] = "m2po"
    # The removal threshold is a statistic of the whole batch's second moments.
    batch_global: ClassVar[bool] = True
    clip_only_sign_dependence: ClassVar[bool] = False  # the candidate set reads sign(A)
    ewma_decay: ClassVar[float | None] = None

    def __post_init__(self) -> None:
        if self.tau <= 0:
            raise ValueError(f"m2po.tau must be > 0, got {self.tau}")
        if self.rule not in ("remove", "cap"):
            raise ValueError(f"m2po.rule must be 'remove' or 'cap', got {self.rule!r}")
        if self.candidates not in ("trust_region", "all"):
            raise ValueError(f"m2po.candidates must be 'trust_region' or 'all', got {self.candidates!r}")
        if self.anchor not in ("behav", "old_train"):
            raise ValueError(f"m2po.anchor must be 'behav' or 'old_train', got {self.anchor!r}")

    @property
    def needs(self) -> tuple[Need, ...]:
        return ("old_train",) if self.anchor == "old_train" else ()

    @property
    def streamable(self) -> bool:
        # The harmful set depends on sign(A) and the threshold on the whole batch (§5.5).
        return False

    def correct(self, batch: TokenBatch) -> Correction:
        require_inputs(batch, self.needs, policy=self.name)
        anchor_BT = batch.logp_old_train_BT if self.anchor == "old_train" else batch.logp_behav_BT
        assert anchor_BT is not None
        valid_BT = batch.mask_BT
        log_r_BT = log_ratio(batch.logp_BT, anchor_BT, valid_BT)
        m2_BT = log_r_BT * log_r_BT
        if self.candidates == "trust_region":
            cand_BT = trust_region_tokens(log_r_BT, batch.adv_BT, valid_BT)
        else:
            cand_BT = valid_BT
        select = m2po_remove_sorted if self.rule == "remove" else m2po_cap_mask
        removed_BT = torch.zeros_like(valid_BT)
        removed_BT[cand_BT] = select(m2_BT[cand_BT], tau=self.tau)
        weight_BT = torch.ones_like(m2_BT)
        return finish(batch, anchor_BT, weight_BT, valid_BT & ~removed_BT, use_clip=False)
