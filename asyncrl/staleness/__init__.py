"""Staleness policies: off-policy corrections applied by the learner to version-lagged samples.

The learner builds a `TokenBatch` (current, behaviour and optional proximal / old-train / EWMA
log-probs, per-token versions, advantages), the configured policy returns a `Correction` (PPO
anchor, detached per-token weights, kept-token mask, use_clip, lr_scale, stats) and the policy loss
in `asyncrl.learner.losses` consumes it. Every module here is pure math; see docs/staleness.md.
"""

from asyncrl.staleness.base import (
    LEARNER_PROVIDES,
    Correction,
    CorrectionStats,
    StalenessPolicy,
    TokenBatch,
    staleness_per_sequence,
    with_current_as_prox,
)
from asyncrl.staleness.decoupled import Decoupled
from asyncrl.staleness.ewma import EwmaParams, PpoEwma, ewma_decay_for_age, ewma_logp_update
from asyncrl.staleness.exact import ExactOldLogits, assemble_old_train_logp, versions_needed
from asyncrl.staleness.freshness import FreshnessWeighted, apply_freshness, freshness_score, freshness_weights
from asyncrl.staleness.importance import IcePop, MaskedIS, NoCorrection, TruncatedIS
from asyncrl.staleness.m2po import M2PO, m2po_cap_bound, m2po_cap_mask, m2po_remove_greedy, m2po_remove_sorted
from asyncrl.staleness.registry import POLICIES, make_policy
from asyncrl.staleness.vcpo import VCPO, ess_ratio, opob_baseline, opob_weights, vcpo_lr_scale

__all__ = [
    "LEARNER_PROVIDES",
    "M2PO",
    "POLICIES",
    "VCPO",
    "Correction",
    "CorrectionStats",
    "Decoupled",
    "EwmaParams",
    "ExactOldLogits",
    "FreshnessWeighted",
    "IcePop",
    "MaskedIS",
    "NoCorrection",
    "PpoEwma",
    "StalenessPolicy",
    "TokenBatch",
    "TruncatedIS",
    "apply_freshness",
    "assemble_old_train_logp",
    "ess_ratio",
    "ewma_decay_for_age",
    "ewma_logp_update",
    "freshness_score",
    "freshness_weights",
    "m2po_cap_bound",
    "m2po_cap_mask",
    "m2po_remove_greedy",
    "m2po_remove_sorted",
    "make_policy",
    "opob_baseline",
    "opob_weights",
    "staleness_per_sequence",
    "vcpo_lr_scale",
    "versions_needed",
    "with_current_as_prox",
]
