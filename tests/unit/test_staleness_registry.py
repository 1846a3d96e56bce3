"""Unit tests for the staleness policy registry and the Protocol every policy satisfies."""

from __future__ import annotations

import dataclasses

import pytest

from asyncrl.staleness import POLICIES, FreshnessWeighted, StalenessPolicy, make_policy
from asyncrl.staleness.registry import policy_parameters

EXPECTED = {"none", "tis", "mis", "icepop", "decoupled", "m2po", "vcpo", "ewma", "exact"}


def test_registry_names():
    assert set(POLICIES) == EXPECTED


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_every_policy_builds_with_defaults_and_satisfies_protocol(name):
    policy = make_policy(name)
    assert isinstance(policy, StalenessPolicy)
    assert policy.name == name
    assert set(policy.needs) <= {"prox", "old_train", "ewma"}
    assert isinstance(policy.streamable, bool)
    assert POLICIES[name].__doc__  # the class documents its formula and defaults
    with pytest.raises(dataclasses.FrozenInstanceError):
        policy.x = 1  # type: ignore[attr-defined]


def test_defaults_match_the_spec():
    assert policy_parameters(POLICIES["tis"]) == {"clip": 2.0, "clip_low": 0.0}
    assert policy_parameters(POLICIES["decoupled"])["cap"] == 5.0
    assert policy_parameters(POLICIES["m2po"])["tau"] == 0.04
    assert policy_parameters(POLICIES["m2po"])["rule"] == "remove"
    assert policy_parameters(POLICIES["vcpo"])["rule"] == "sqrt"
    assert policy_parameters(POLICIES["ewma"])["cap"] == 100.0


def test_streamable_and_needs_table():
    table = {name: (make_policy(name).streamable, make_policy(name).needs) for name in EXPECTED}
    assert table == {
        "none": (False, ()),
        "tis": (True, ("prox",)),
        "mis": (True, ("prox",)),
        "icepop": (True, ("prox",)),
        "decoupled": (True, ("prox",)),
        "m2po": (False, ()),
        "vcpo": (True, ()),
        "ewma": (False, ("ewma",)),
        "exact": (False, ("old_train",)),
    }
    assert make_policy("none", anchor="current").streamable
    assert not make_policy("mis", self_normalize=True).streamable
    assert make_policy("m2po", anchor="old_train").needs == ("old_train",)


def test_every_policy_describes_itself():
    """What the learner and the config check read from a policy instead of lists of names:
    (batch_global, clip_only_sign_dependence, ewma_decay)."""
    table = {
        name: (p.batch_global, p.clip_only_sign_dependence, p.ewma_decay)
        for name in EXPECTED
        for p in [make_policy(name)]
    }
    assert table == {
        "none": (False, True, None),
        "tis": (False, False, None),
        "mis": (False, False, None),
        "icepop": (False, False, None),
        "decoupled": (False, False, None),
        "m2po": (True, False, None),
        "vcpo": (True, False, None),
        "ewma": (False, False, 0.5),
        "exact": (False, False, None),
    }
    assert make_policy("mis", self_normalize=True).batch_global
    assert make_policy("ewma", decay=0.25).ewma_decay == 0.25


def test_freshness_wrapper_delegates_its_self_description():
    local = make_policy("ewma", decay=0.25, freshness={"self_normalize": False})
    assert local.ewma_decay == 0.25 and local.needs == ("ewma",) and not local.batch_global
    assert make_policy("tis", freshness={}).batch_global  # self-normalised by default
    assert make_policy("m2po", freshness={"self_normalize": False}).batch_global
    # Not delegated: a wrapped policy that does not stream trains whole batches.
    assert not make_policy("none", freshness={"self_normalize": False}).clip_only_sign_dependence


def test_unknown_name_lists_valid_names():
    with pytest.raises(ValueError, match="unknown staleness policy 'm2p0'") as err:
        make_policy("m2p0")
    msg = str(err.value)
    assert "did you mean 'm2po'" in msg
    assert all(name in msg for name in EXPECTED)


def test_unknown_parameter_is_named():
    with pytest.raises(ValueError, match="has no parameter 'clp'.*did you mean 'clip'.*clip, clip_low"):
        make_policy("tis", clp=3.0)
    with pytest.raises(ValueError, match="'vcpo' has no parameter 'x'; valid parameters: base_ess_ratio, "):
        make_policy("vcpo", x=1)


def test_bad_values_fail_at_construction():
    for name, params in [
        ("tis", {"clip": 0.0}),
        ("mis", {"rs_low": 3.0, "rs_high": 2.0}),
        ("mis", {"is_level": "tokens"}),
        ("decoupled", {"action": "clamp", "level": "geometric"}),
        ("m2po", {"tau": -1.0}),
        ("m2po", {"rule": "capping"}),
        ("vcpo", {"rule": "cubic"}),
        ("ewma", {"cap_mode": "new"}),
        ("exact", {"veto": 0.0}),
        ("none", {"anchor": "prox"}),
    ]:
        with pytest.raises(ValueError):
            make_policy(name, **params)


def test_freshness_wrapper_from_registry():
    policy = make_policy("decoupled", cap=3.0, freshness={"lambda_roll": 2.0, "f_min": 0.1})
    assert isinstance(policy, FreshnessWeighted)
    assert policy.name == "decoupled+freshness"
    assert policy.base == make_policy("decoupled", cap=3.0)
    assert policy.needs == ("prox",)
    assert not policy.streamable  # self-normalised by default
    assert make_policy("tis", freshness={"self_normalize": False}).streamable
    with pytest.raises(ValueError, match="freshness weighting has no parameter 'lam'"):
        make_policy("tis", freshness={"lam": 1.0})
    with pytest.raises(ValueError):
        make_policy("tis", freshness={"f_min": 2.0})
