"""Staleness policy registry: config name -> policy class, validated when the config loads.

Place in the data flow: the config loader calls `make_policy(name, **params)` once at start-up, so a
misspelled policy or parameter fails before any process starts; the learner then only calls
`policy.correct(batch)`.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Mapping
from typing import Any

from asyncrl.staleness.base import StalenessPolicy
from asyncrl.staleness.decoupled import Decoupled
from asyncrl.staleness.ewma import PpoEwma
from asyncrl.staleness.exact import ExactOldLogits
from asyncrl.staleness.freshness import FreshnessWeighted
from asyncrl.staleness.importance import IcePop, MaskedIS, NoCorrection, TruncatedIS
from asyncrl.staleness.m2po import M2PO
from asyncrl.staleness.vcpo import VCPO

POLICIES: dict[str, type] = {
    cls.name: cls
    for cls in (NoCorrection, TruncatedIS, MaskedIS, IcePop, Decoupled, M2PO, VCPO, PpoEwma, ExactOldLogits)
}


def policy_parameters(cls: type) -> dict[str, Any]:
    """Keyword parameters of a policy (or of FreshnessWeighted) and their defaults."""
    return {
        f.name: f.default for f in dataclasses.fields(cls) if f.init and f.default is not dataclasses.MISSING
    }


def _check_params(what: str, cls: type, params: Mapping[str, Any]) -> None:
    valid = policy_parameters(cls)
    for key in params:
        if key not in valid:
            hint = difflib.get_close_matches(key, list(valid), n=1)
            did_you_mean = f" (did you mean {hint[0]!r}?)" if hint else ""
            raise ValueError(
                f"{what} has no parameter {key!r}{did_you_mean}; valid parameters: {', '.join(sorted(valid)) or 'none'}"
            )


def make_policy(name: str, *, freshness: Mapping[str, Any] | None = None, **params: Any) -> StalenessPolicy:
    """Build the policy `name` with keyword hyperparameters; `freshness` (a mapping of
    FreshnessWeighted parameters, possibly empty) wraps it with freshness weighting.

    Raises ValueError listing the valid names on an unknown policy, and naming an unknown parameter.
    """
    if name not in POLICIES:
        hint = difflib.get_close_matches(name, list(POLICIES), n=1)
        did_you_mean = f" (did you mean {hint[0]!r}?)" if hint else ""
        raise ValueError(
            f"unknown staleness policy {name!r}{did_you_mean}; valid names: {', '.join(sorted(POLICIES))}"
        )
    cls = POLICIES[name]
    _check_params(f"staleness policy {name!r}", cls, params)
    policy: StalenessPolicy = cls(**params)
    if freshness is None:
        return policy
    _check_params("freshness weighting", FreshnessWeighted, freshness)
    return FreshnessWeighted(base=policy, **freshness)
