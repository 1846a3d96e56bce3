"""The policy-loss registry (pure): one entry per `learner.loss` name, holding what the rest of
asyncrl needs to know about that loss, so that nothing else keeps a list of loss names.

Place in the data flow: the config checks `learner.loss`, `learner.loss_params` and the clip keys
against the entry when it loads (`Config._check_loss`; no torch is imported: `losses.py` imports
it on first use), and the learner's `RLObjective` calls the entry's function for every chunk and
asks the entry whether a trajectory's gradient is linear in its advantage (`stream_loss`).

Adding a loss touches three places: its function in `losses.py` (tensors in, `(loss, LossStats)`
out, keyword-only hyperparameters, the conventions at the top of that file), one `PolicyLoss`
entry in `POLICY_LOSSES` below, and its test (`tests/unit/test_sapo.py` is the example). Its
hyperparameters beyond the clip range come from `learner.loss_params`, validated against `params`,
so it needs no new config field; docs/algorithms.md gets its row.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

from asyncrl.learner.losses import (
    LossStats,
    check_sapo,
    cispo_loss,
    clipped_surrogate,
    gspo_loss,
    sapo_loss,
)

if TYPE_CHECKING:
    import torch


class SignProbe(NamedTuple):
    """One trajectory, asked whether its loss is linear in its still unknown advantage A (then it
    streams on its own; objective.py, ALGORITHMS.md 5.5)."""

    clipped_pos: bool  # a clip binds somewhere in the loss at A = +1 (its stats' clip_fraction > 0)
    clipped_neg: Callable[[], bool]  # the same at A = -1, evaluated only when asked
    params: Mapping[str, float]  # the loss's hyperparameters (`learner.loss_params` over the defaults)


@dataclass(frozen=True, kw_only=True)
class PolicyLoss:
    """A registered policy loss: its function and the facts about it that others read."""

    name: str  # the `learner.loss` value
    # losses.py: (logp_BT, logp_old_BT, adv_BT, mask_BT, weight_BT, *, hyperparameters, aggregation)
    fn: Callable[..., tuple[torch.Tensor, LossStats]]
    source: str  # where its formula comes from
    # Default (clip_low, clip_high) of the ratio, passed as the function's clip_low / clip_high
    # (`learner.clip_low` / `clip_high` override them); None: the loss never clips, takes no
    # clip range, and the config refuses one.
    clip: tuple[float, float] | None
    clip_low_may_be_one: bool = False  # clip_low = 1 means "no lower bound" (else it must be < 1)
    dual_clip: bool = False  # takes `learner.dual_clip` (the bound on -A r for A < 0)
    # Keyword hyperparameters beyond the clip range, with their defaults (`learner.loss_params`).
    params: Mapping[str, float] = field(default_factory=dict)
    check_params: Callable[..., None] | None = None  # raises ValueError on bad values (keywords: params)
    # Whether one trajectory's loss l(A) is linear in its advantage A, value and gradient: the
    # learner streams it as l(+1) and -grad l(+1), and multiplies both by A once A is known.
    linear_in_advantage: Callable[[SignProbe], bool]

    def resolve_params(self, given: Mapping[str, float]) -> dict[str, float]:
        """The defaults with `given` over them; ValueError naming the valid keys on an unknown one."""
        for key in given:
            if key in self.params:
                continue
            if not self.params:
                raise ValueError(f"loss {self.name!r} takes no parameters, got {key!r}")
            hint = difflib.get_close_matches(key, list(self.params), n=1)
            did_you_mean = f" (did you mean {hint[0]!r}?)" if hint else ""
            raise ValueError(
                f"loss {self.name!r} has no parameter {key!r}{did_you_mean}; "
                f"valid parameters: {', '.join(sorted(self.params))}"
            )
        resolved = {**self.params, **given}
        if self.check_params is not None:
            self.check_params(**resolved)
        return resolved

    def ever_linear(self, params: Mapping[str, float]) -> bool:
        """Whether a trajectory on which no clip binds has a loss linear in its advantage; False:
        with these hyperparameters no trajectory ever streams on its own."""
        unclipped = SignProbe(clipped_pos=False, clipped_neg=lambda: False, params=params)
        return self.linear_in_advantage(unclipped)


# ---------------------------------------------------------------------------------- sign(A)


def always_linear(probe: SignProbe) -> bool:
    """Nothing reads sign(A) (CISPO: l = -A sg(clip(r)) logp)."""
    return True


def linear_unless_clipped(probe: SignProbe) -> bool:
    """A clip is the only place sign(A) enters (PPO, GSPO): linear when none binds at A = +1 or -1."""
    return not probe.clipped_pos and not probe.clipped_neg()


def sapo_linear(probe: SignProbe) -> bool:
    """SAPO reads sign(A) through tau, so l(A) = -A (4 / tau) sigmoid(tau (r - 1)) is linear in A
    only when tau_pos == tau_neg. At r = 1 the gradient is linear whatever tau (its weight is
    exactly 1), but the value is not (2 / tau_pos for A > 0, 2 / tau_neg for A < 0), and the
    learner reports a streamed trajectory's loss as A l(+1): so it waits for its group there too."""
    return probe.params["tau_pos"] == probe.params["tau_neg"]


# ---------------------------------------------------------------------------------- the registry

POLICY_LOSSES: dict[str, PolicyLoss] = {
    entry.name: entry
    for entry in (
        PolicyLoss(
            name="ppo",
            fn=clipped_surrogate,
            source="PPO / GRPO clipped surrogate; DAPO clip-higher; dual clip as verl clip_ratio_c",
            clip=(0.2, 0.2),
            dual_clip=True,
            linear_in_advantage=linear_unless_clipped,
        ),
        PolicyLoss(
            name="gspo",
            fn=gspo_loss,
            source="GSPO, arXiv 2507.18071 (token variant as verl compute_policy_loss_gspo)",
            clip=(3e-4, 4e-4),
            linear_in_advantage=linear_unless_clipped,
        ),
        PolicyLoss(
            name="cispo",
            fn=cispo_loss,
            source="CISPO, MiniMax-M1 arXiv 2506.13585 (Trinity-RFT defaults)",
            clip=(1.0, 0.28),
            clip_low_may_be_one=True,
            linear_in_advantage=always_linear,
        ),
        PolicyLoss(
            name="sapo",
            fn=sapo_loss,
            source="SAPO, Soft Adaptive Policy Optimization, Qwen, arXiv 2511.20347",
            clip=None,
            params={"tau_pos": 1.0, "tau_neg": 1.05},
            check_params=check_sapo,
            linear_in_advantage=sapo_linear,
        ),
    )
}


def policy_loss(name: str) -> PolicyLoss:
    """The entry of `name`; ValueError listing the valid names on an unknown one."""
    if name not in POLICY_LOSSES:
        hint = difflib.get_close_matches(name, list(POLICY_LOSSES), n=1)
        did_you_mean = f" (did you mean {hint[0]!r}?)" if hint else ""
        raise ValueError(
            f"unknown policy loss {name!r}{did_you_mean}; valid names: {', '.join(sorted(POLICY_LOSSES))}"
        )
    return POLICY_LOSSES[name]
