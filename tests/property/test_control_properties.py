"""The closed-loop staleness bound (scheduler/control.py) over random signal sequences: whatever
the controller decides, every group trains within the bound in force when it was admitted and
within the hard cap, and the run always completes."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncrl.messages import StepDone
from asyncrl.scheduler.control import ControlSettings, Signal, StalenessController, admitted_bounds_hold
from asyncrl.scheduler.modes import WindowMode

FAST = settings(max_examples=40, deadline=None)


class _Book:
    def trained(self, step: int) -> None:
        pass


def _step_done(step: int, signal: tuple[float, float, float, float]) -> StepDone:
    idle, ess, kl, clip = signal
    return StepDone(
        step=step,
        version=step + 1,
        num_trajectories=1,
        num_tokens=1,
        loss=0.0,
        mean_reward=0.0,
        max_staleness=0,
        mean_staleness=0.0,
        clip_fraction=clip,
        grad_norm=0.0,
        step_s=1.0 - idle,
        idle_s=idle,
        stats={"ess_ratio": ess, "mismatch_k3": kl, "masked_fraction": 0.0},
    )


signals = st.tuples(
    st.floats(0, 0.99),  # learner idle share
    st.floats(0, 1),  # ESS ratio
    st.floats(0, 0.2),  # mismatch KL
    st.floats(0, 0.5),  # clipped share
)


@FAST
@given(
    cap=st.integers(0, 4),
    groups_per_step=st.integers(1, 3),
    steps=st.integers(1, 12),
    signal_seq=st.lists(signals, min_size=12, max_size=12),
    choices=st.lists(st.integers(0, 2), max_size=120),
)
def test_every_group_trains_within_its_admission_bound_and_the_cap(
    cap, groups_per_step, steps, signal_seq, choices
):
    control = StalenessController(ControlSettings(cap=cap, start=min(1, cap), patience=1, cooldown=0))
    mode = WindowMode(groups_per_step=groups_per_step, max_staleness=cap, total_steps=steps, control=control)
    admitted: list[tuple[int, int]] = []  # (group, bound in force at admission)
    oldest: dict[int, int] = {}  # group -> the oldest version its tokens can come from
    trained: list[tuple[int, int, int]] = []
    version, loaded = 0, 0  # the learner's version; the oldest version a generator serves
    # The random moves, then admit / load / train in turn until done: the run must complete.
    fair = [0, 1, 2] * (steps * (groups_per_step + 2) + 1)
    for move in choices + fair:
        if version == steps:
            break
        if move == 0:  # admission, at the generators' oldest version
            for group in mode.admit(loaded):
                admitted.append((group, mode.admission.max_staleness))
                oldest[group] = loaded
        elif move == 1:  # a generator loads the next version
            loaded = min(version, loaded + 1)
        else:  # the learner trains step `version` once all its groups are in
            first = version * groups_per_step
            if all(g in oldest for g in range(first, first + groups_per_step)):
                trained += [(g, version, oldest[g]) for g in range(first, first + groups_per_step)]
                mode.on_step_done(_Book(), _step_done(version, signal_seq[version % len(signal_seq)]))
                assert 0 <= mode.admission.max_staleness <= cap
                version += 1
    assert version == steps
    assert admitted_bounds_hold(admitted, trained, cap) == ""


def test_the_rule_on_a_hand_made_sequence():
    """Starving with a healthy signal raises the bound after `patience` steps (then waits out the
    cooldown); a degraded signal lowers it at once; the bound stays within [floor, cap]."""
    control = StalenessController(ControlSettings(cap=3, start=1, patience=2, cooldown=1))
    starving = dict(learner_idle=0.5, ess_ratio=0.9, mismatch_kl=0.01, clip_fraction=0.05)
    bounds = []
    for step in range(8):
        control.observe(Signal(step=step, **starving))
        bounds.append(control.bound)
    # up after step 1 (two starving steps), quiet at step 2 (the cooldown; the count goes on),
    # up after step 3, then held at the cap
    assert bounds == [1, 2, 2, 3, 3, 3, 3, 3]
    decision = control.observe(Signal(step=8, learner_idle=0.5, ess_ratio=0.2, mismatch_kl=0.01))
    assert decision is not None and (decision.old, decision.new) == (3, 2)
    assert "ESS ratio 0.200 < 0.5" in decision.reason
    assert control.observe(Signal(step=9, learner_idle=0.5, ess_ratio=0.2)) is None  # cooldown
    for step, kl in ((10, 0.3), (12, 0.3), (14, 0.3)):
        control.observe(Signal(step=step, learner_idle=0.0, mismatch_kl=kl))
    assert control.bound == 0  # down to the floor, never below
    # a busy learner with a healthy signal leaves the bound where it is
    assert control.observe(Signal(step=20, learner_idle=0.01, ess_ratio=1.0)) is None


def test_unreported_signals_count_as_healthy():
    control = StalenessController(ControlSettings(cap=2, start=0, patience=1, cooldown=0))
    decision = control.observe(Signal(step=0, learner_idle=0.3, ess_ratio=math.nan, mismatch_kl=math.nan))
    assert decision is not None and decision.new == 1


def test_settings_out_of_order_are_refused():
    with pytest.raises(ValueError, match="floor"):
        ControlSettings(cap=1, start=2)
