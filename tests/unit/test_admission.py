"""Admission: the staleness bound holds for every interleaving of steps and weight loads."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncrl.scheduler.admission import Admission, CreditAdmission, admission_limit, step_of


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


def simulate_pool(
    ops: list[int], *, groups_per_step: int, max_staleness: int, slack: int = 0
) -> tuple[int, int]:
    """Pool mode (CreditAdmission, fifo buffer): 0 = the learner steps when B groups are ready
    (it takes the oldest B and gives their credits back at the new version), 1 = generators load
    the newest version, 2 = generate one admitted group with the loaded version. Returns (the
    largest staleness at training time, the most groups ever admitted and not trained)."""
    adm = CreditAdmission(groups_per_step=groups_per_step, max_staleness=max_staleness, total_steps=1)
    adm.capacity += slack  # a deliberately wrong formula
    learner_version = loaded = 0
    pending: list[int] = []  # admitted, not yet generated
    ready: list[int] = []  # generated groups' versions, in completion order
    worst = most_ahead = 0
    pending.extend(adm.admit(loaded))
    for op in ops:
        if op == 0 and len(ready) >= groups_per_step:
            taken, ready[:] = ready[:groups_per_step], ready[groups_per_step:]
            worst = max(worst, max(learner_version - v for v in taken))
            learner_version += 1
            adm.release(len(taken), version=learner_version)
        elif op == 1 and loaded < learner_version:
            loaded = learner_version
            pending.extend(adm.admit(loaded))
        elif op == 2 and pending:
            pending.pop(0)
            ready.append(loaded)
        most_ahead = max(most_ahead, adm.outstanding)
    return worst, most_ahead


@settings(max_examples=300, deadline=None)
@given(
    ops=st.lists(st.integers(0, 2), min_size=50, max_size=400),
    groups_per_step=st.integers(1, 4),
    max_staleness=st.integers(0, 3),
)
def test_pool_credits_bound_staleness_and_the_groups_ahead(ops, groups_per_step, max_staleness):
    worst, most_ahead = simulate_pool(ops, groups_per_step=groups_per_step, max_staleness=max_staleness)
    assert worst <= max_staleness
    assert most_ahead <= (max_staleness + 1) * groups_per_step


def test_pool_off_by_one_capacity_is_caught():
    ops = [2] * 10 + [0, 1] * 3 + [2] * 10 + [0] * 5
    assert simulate_pool(ops, groups_per_step=1, max_staleness=1)[0] <= 1
    assert simulate_pool(ops, groups_per_step=1, max_staleness=1, slack=1)[0] > 1


def test_pool_credits_come_back_only_with_the_new_weights():
    adm = CreditAdmission(groups_per_step=2, max_staleness=0, total_steps=5)
    assert list(adm.admit(0)) == [0, 1]
    adm.release(2, version=1)  # step 0 trained both
    assert list(adm.admit(0)) == []  # the generators still hold version 0
    assert list(adm.admit(1)) == [2, 3]
    adm.release(1, version=1)  # one withheld mid-step 1 (learner at version 1): back at once
    assert list(adm.admit(1)) == [4] and adm.outstanding == 2
