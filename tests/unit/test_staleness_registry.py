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
