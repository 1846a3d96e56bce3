"""Admission: the staleness bound holds for every interleaving of steps and weight loads."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncrl.scheduler.admission import Admission, admission_limit, step_of


def test_limit_formula():
    assert admission_limit(loaded_version=0, groups_per_step=4, max_staleness=0, total_groups=100) == 4
    assert admission_limit(loaded_version=0, groups_per_step=4, max_staleness=2, total_groups=100) == 12
    assert admission_limit(loaded_version=5, groups_per_step=4, max_staleness=2, total_groups=20) == 20
    with pytest.raises(ValueError):
        admission_limit(loaded_version=-1, groups_per_step=4, max_staleness=0, total_groups=1)


def simulate(ops: list[int], *, groups_per_step: int, max_staleness: int, steps: int, slack: int = 0) -> int:
    """Random interleaving: 0 = the learner steps (when its window is complete), 1 = generators
    load the newest version, 2 = generate one admitted group with the loaded version. Returns the
    largest staleness seen at training time. `slack` adds extra credits (a deliberately wrong formula)."""
    adm = Admission(groups_per_step=groups_per_step, max_staleness=max_staleness, total_steps=steps)
    learner_version = 0
    loaded = 0
    pending: list[int] = []  # admitted, not yet generated
    generated: dict[int, list[int]] = {}  # step -> token versions of its groups
    worst = 0

    def admit():
        new = adm.admit(loaded)
        extra = (
            range(adm.num_admitted, min(adm.total_groups, adm.num_admitted + slack)) if slack else range(0)
        )
        adm.num_admitted += len(extra)
        pending.extend(list(new) + list(extra))

    admit()
    for op in ops:
        if op == 0 and len(generated.get(learner_version, ())) == groups_per_step:
            worst = max(worst, max(learner_version - v for v in generated.pop(learner_version)))
            learner_version += 1
        elif op == 1 and loaded < learner_version:
            loaded = learner_version
            admit()
        elif op == 2 and pending:
            j = pending.pop(0)
            generated.setdefault(step_of(j, groups_per_step=groups_per_step), []).append(loaded)
    return worst


@settings(max_examples=300, deadline=None)
@given(
    ops=st.lists(st.integers(0, 2), min_size=50, max_size=400),
    groups_per_step=st.integers(1, 4),
    max_staleness=st.integers(0, 3),
)
def test_bound_holds_for_every_interleaving(ops, groups_per_step, max_staleness):
    assert (
        simulate(ops, groups_per_step=groups_per_step, max_staleness=max_staleness, steps=50) <= max_staleness
    )


def test_off_by_one_formula_is_caught():
    """One extra credit breaks the bound on a plain interleaving: the simulation can fail."""
    ops = [2] * 10 + [0, 1] * 3 + [2] * 10 + [0] * 5
    assert simulate(ops, groups_per_step=1, max_staleness=1, steps=10) <= 1
    assert simulate(ops, groups_per_step=1, max_staleness=1, steps=10, slack=1) > 1
