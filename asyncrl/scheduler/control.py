"""Closed-loop control of the staleness bound (pure): `staleness.max_staleness = "auto"`.

Place in the data flow: the launcher feeds every `StepDone` to `StalenessController.observe` as a
`Signal` (the learner's idle share of the step, the staleness policy's ESS ratio and mismatch KL,
the clip/mask fraction); a returned `Decision` changes the bound admission uses from then on
(`Admission.set_bound`) and is logged as a run event with the signal that caused it.

The rule (docs/safety.md, "Closed-loop staleness"):
* the off-policy signal is **degraded** when the ESS ratio is under `ess_min`, the mismatch KL
  over `kl_max`, or the clipped + masked share of tokens over `clip_max`; one degraded step lowers
  the bound by one (not under `floor`), and further changes wait `cooldown` steps;
* the learner **starves** when it waits for data more than `idle_high` of its step; `patience`
  starving steps in a row with a healthy signal raise the bound by one (not over `cap`);
* otherwise the bound stays.

The guarantee does not depend on the rule: a group is admitted under the bound in force at its
admission, and a bound only limits admissions from then on. Lowering it never makes a group
already admitted invalid: that group trains at most the bound it was admitted under, which is at
most `cap` (`admitted_bounds_hold` checks a schedule; tests/property/test_control_properties.py
runs it over random signals).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class Signal:
    step: int
    learner_idle: float  # idle share of the step: idle_s / (step_s + idle_s), in [0, 1]
    ess_ratio: float = math.nan  # NaN = not reported (a healthy value for the rule)
    mismatch_kl: float = math.nan
    clip_fraction: float = 0.0  # tokens clipped or masked by the correction, as a share

    @classmethod
    def from_step(
        cls, *, step: int, step_s: float, idle_s: float, clip_fraction: float, stats: dict
    ) -> Signal:
        """From a `StepDone`'s fields and its staleness-policy stats."""
        total = step_s + idle_s
        masked = stats.get("masked_fraction", 0.0)
        return cls(
            step=step,
            learner_idle=idle_s / total if total > 0 else 0.0,
            ess_ratio=stats.get("ess_ratio", math.nan),
            mismatch_kl=stats.get("mismatch_k3", math.nan),
            clip_fraction=max(clip_fraction, 0.0) + (masked if math.isfinite(masked) else 0.0),
        )


@dataclass(frozen=True, kw_only=True)
class Decision:
    step: int
    old: int
    new: int
    reason: str  # in words, with the numbers that caused it

    def line(self) -> str:
        return f"staleness bound {self.old} -> {self.new} after step {self.step}: {self.reason}"


@dataclass(frozen=True, kw_only=True)
class ControlSettings:
    cap: int  # the hard cap: the bound never exceeds it
    start: int = 1
    floor: int = 0
    idle_high: float = 0.10
    ess_min: float = 0.5
    kl_max: float = 0.05
    clip_max: float = 0.2
    patience: int = 3
    cooldown: int = 2

    def __post_init__(self) -> None:
        if not 0 <= self.floor <= self.start <= self.cap:
            raise ValueError(
                f"the auto staleness bound needs 0 <= floor ({self.floor}) <= start ({self.start}) <= cap ({self.cap})"
            )
        if self.patience < 1 or self.cooldown < 0:
            raise ValueError("patience must be >= 1 and cooldown >= 0")


class StalenessController:
    """The bound in force (`bound`) and the rule that moves it; see the module docstring."""

    def __init__(self, settings: ControlSettings) -> None:
        self.settings = settings
        self.bound = settings.start
        self._starving = 0  # starving healthy steps in a row
        self._quiet_until = -1  # no change before this step

    def degraded(self, sig: Signal) -> str:
        """Why the off-policy signal is unhealthy ("" when it is not)."""
        s = self.settings
        if sig.ess_ratio < s.ess_min:  # NaN compares false: not reported = healthy
            return f"ESS ratio {sig.ess_ratio:.3f} < {s.ess_min}"
        if sig.mismatch_kl > s.kl_max:
            return f"mismatch KL {sig.mismatch_kl:.4f} > {s.kl_max}"
        if sig.clip_fraction > s.clip_max:
            return f"clipped/masked share {sig.clip_fraction:.3f} > {s.clip_max}"
        return ""

    def observe(self, sig: Signal) -> Decision | None:
        s = self.settings
        why = self.degraded(sig)
        starving = sig.learner_idle > s.idle_high and not why
        self._starving = self._starving + 1 if starving else 0
        if sig.step < self._quiet_until:
            return None
        new, reason = self.bound, ""
        if why and self.bound > s.floor:
            new, reason = self.bound - 1, why
        elif self._starving >= s.patience and self.bound < s.cap:
            new = self.bound + 1
            reason = (
                f"learner idle {sig.learner_idle:.0%} of its step for {self._starving} steps, signal healthy"
            )
        if new == self.bound:
            return None
        decision = Decision(step=sig.step, old=self.bound, new=new, reason=reason)
        self.bound = new
        self._starving = 0
        self._quiet_until = sig.step + 1 + s.cooldown
        return decision


def admitted_bounds_hold(
    admitted: list[tuple[int, int]], trained: list[tuple[int, int, int]], cap: int
) -> str:
    """Checks a schedule: `admitted` = (group, bound in force at its admission); `trained` =
    (group, the step that trained it, the oldest version of its tokens). "" when every group
    trained within its admission bound and the cap, else what broke."""
    bound_of = dict(admitted)
    for group, step, oldest in trained:
        staleness = step - oldest
        if staleness > bound_of[group] or staleness > cap:
            return f"group {group} trained at staleness {staleness} (admitted under {bound_of[group]}, cap {cap})"
    return ""
