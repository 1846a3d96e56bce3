"""Where distillation spends its signal (pure weights, and the horizon's controller).

Place in the data flow: `loop.build_trainer` installs one `DistillControl` on the learner's engine
when `opd.enabled` (`distill_work.install_control`); `distill_work.opd_arrays` hands it to every distillation term with
the packed teacher cache, and `distill_work.distill_term` multiplies each position's OPD term by
`DistillControl.weights` (detached). `DistillWork.end` reports the step's KL on the distilled tokens
to `DistillControl.end_step`, which grows the horizon by its schedule. docs/opd.md, "Horizon and
token control", has the formulas and keys.

Per position t of a completion (t = 0, 1, ... counts its trained tokens), the weight is

    w_t = [t < H] * gamma^t * overlap_t * f_i

* H: the distillation horizon (opd.horizon; 0 = no horizon): tokens past the first H trained tokens
  of each completion are not distilled. "fixed" keeps H; "linear" is H + opd.horizon_growth x
  the step (the policy version the step trains at), a function of the version that the generators'
  teachers apply too (`config_sections.scheduled_horizon`: they score only the first H(v) tokens,
  v <= the step); "gap" adds opd.horizon_growth after a step whose KL estimate over the distilled
  tokens, mean (log pi(y_t) - log pi_T(y_t)) at the sampled tokens, is <= opd.horizon_gap (the
  student has caught up on the prefix; the generators score every token). Both stop at
  opd.horizon_max (0 = no limit). A position whose teacher scores are NaN (past the horizon the
  generator's teacher applied) is never distilled, whatever the learner's H.
* gamma^t: position weights (opd.position_decay = gamma in (0, 1]; 1 = uniform).
* overlap_t: teachability (opd.teachability = "overlap"), the student's probability mass on the
  teacher's top-K ids, sum_{y in topK_T} pi_S(y) in [0, 1], from the learner's log-probs of the
  top-K columns (needs opd.teacher_top_k > 0).
* f_i: the trajectory's freshness (staleness.freshness, f-OPD; `staleness/freshness.py`):
  exp(-(lambda_roll D_roll + lambda_sup D_sup)) from the sampled tokens' behavior and current
  log-probs, 0 under f_min, not self-normalised (a trajectory's own weight: it streams).

Legend: B sequences, T (or L) positions, K teacher top-K ids per position.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from asyncrl.config_sections import scheduled_horizon
from asyncrl.staleness.freshness import freshness_score

if TYPE_CHECKING:
    from asyncrl.config import Config

HORIZON_SCHEDULES = ("fixed", "linear", "gap")
TEACHABILITY = ("off", "overlap")


def completion_positions(mask_BT: torch.Tensor) -> torch.Tensor:
    """int64 [B, T]: the index of each trained token among its row's trained tokens (0, 1, ...);
    -1 where masked."""
    idx_BT = mask_BT.to(torch.int64).cumsum(dim=1) - 1
    return torch.where(mask_BT, idx_BT, -1)


def horizon_mask(mask_BT: torch.Tensor, horizon: int) -> torch.Tensor:
    """bool [B, T]: the first `horizon` trained tokens of each row (every one when horizon = 0)."""
    if horizon < 0:
        raise ValueError(f"horizon must be >= 0, got {horizon}")
    if horizon == 0:
        return mask_BT.clone()
    return mask_BT & (completion_positions(mask_BT) < horizon)


def position_weights(mask_BT: torch.Tensor, decay: float, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """gamma^t at the t-th trained token of each row, 0 where masked."""
    if not 0.0 < decay <= 1.0:
        raise ValueError(f"position decay must be in (0, 1], got {decay}")
    pos_BT = completion_positions(mask_BT).clamp(min=0).to(dtype)
    return torch.where(mask_BT, torch.as_tensor(decay, dtype=dtype) ** pos_BT, 0.0)


def teachability_weights(logp_top_BTK: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    """The student's mass on the teacher's top-K ids, sum_k exp(log pi_S(topK_T[k])), clamped to
    [0, 1] (detached; 0 where masked). The top-K ids are distinct, so the sum is a probability."""
    mass_BT = logp_top_BTK.detach().exp().sum(dim=-1).clamp(0.0, 1.0)
    return torch.where(mask_BT, mass_BT, 0.0)


def freshness_weights_B(
    logp_now_BT: torch.Tensor,
    logp_behav_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    *,
    lambda_roll: float,
    lambda_sup: float,
    f_min: float,
) -> torch.Tensor:
    """Per-trajectory f_i (detached), 0 where f_i < f_min (module docstring)."""
    f_B = freshness_score(
        logp_now_BT.detach(), logp_behav_BT.detach(), mask_BT, lambda_roll=lambda_roll, lambda_sup=lambda_sup
    )
    return torch.where(f_B >= f_min, f_B, 0.0)


def next_horizon(
    horizon: int, *, schedule: str, growth: int, horizon_max: int, gap: float, kl: float | None
) -> int:
    """The horizon after a step: `schedule` "fixed" keeps it, "linear" adds `growth`, "gap" adds it
    when the step's KL estimate over the distilled tokens `kl` is <= `gap`; at most `horizon_max`
    (0 = no limit). A horizon of 0 (none) stays 0."""
    if horizon == 0 or schedule == "fixed":
        return horizon
    if schedule == "linear":
        grown = horizon + growth
    elif schedule == "gap":
        grown = horizon + growth if kl is not None and kl <= gap else horizon
    else:
        raise ValueError(f"unknown horizon schedule {schedule!r}; valid: {', '.join(HORIZON_SCHEDULES)}")
    return min(grown, horizon_max) if horizon_max > 0 else grown


@dataclass
class DistillControl:
    """The run's horizon, position, teachability and freshness weights and the reference KL of
    pure distillation (config opd.*, staleness.freshness, learner.kl_coef); see the module docstring."""

    estimator: str = "reverse_kl"  # opd.estimator
    horizon: int = 0
    schedule: str = "fixed"
    growth: int = 1
    horizon_max: int = 0
    gap: float = 0.0
    position_decay: float = 1.0
    teachability: str = "off"
    freshness: Mapping[str, Any] | None = None  # lambda_roll, lambda_sup, f_min
    kl_coef: float = 0.0  # learner.kl_coef with opd.reward = "off" (StableOPD)
    kl_estimator: str = "k3"
    current: int = -1  # the horizon of the step being trained (-1: `horizon` until a step begins)
    history: list[int] = field(default_factory=list)  # the horizon of each step ended
    # The step's counters: gap (sum of the k1 estimates and their tokens) and scored tokens.
    gap_sum: float = 0.0
    gap_tokens: float = 0.0
    scored_tokens: float = 0.0
    trained_tokens: float = 0.0

    def __post_init__(self) -> None:
        if self.current < 0:
            self.current = self.horizon

    @staticmethod
    def from_config(config: Config) -> DistillControl:
        opd = config.opd
        fresh = config.staleness.freshness
        return DistillControl(
            estimator=opd.estimator,
            horizon=opd.horizon,
            schedule=opd.horizon_schedule,
            growth=opd.horizon_growth,
            horizon_max=opd.horizon_max,
            gap=opd.horizon_gap,
            position_decay=opd.position_decay,
            teachability=opd.teachability,
            freshness=None if fresh is None else freshness_params(fresh),
            kl_coef=config.learner.kl_coef if opd.reward == "off" else 0.0,
            kl_estimator=config.learner.kl_estimator,
        )

    @property
    def weighs(self) -> bool:
        """Whether any position weight differs from 1 (else the distillation term is today's)."""
        return bool(
            self.horizon
            or self.position_decay != 1.0
            or self.teachability != "off"
            or self.freshness is not None
        )

    def weights(
        self,
        mask_BT: torch.Tensor,
        *,
        logp_BT: torch.Tensor,
        behav_BT: torch.Tensor,
        logp_top_BTK: torch.Tensor | None,
    ) -> torch.Tensor:
        """w_t of every position (module docstring), detached, float64, 0 where masked.

        `logp_BT`, `behav_BT`: the sampled tokens' current and behavior log-probs (freshness);
        `logp_top_BTK`: the student's log-probs of the teacher's top-K ids (teachability)."""
        w_BT = horizon_mask(mask_BT, self.current).double()
        if self.position_decay != 1.0:
            w_BT = w_BT * position_weights(mask_BT, self.position_decay).to(w_BT.device)
        if self.teachability == "overlap":
            if logp_top_BTK is None or logp_top_BTK.shape[-1] == 0:
                raise ValueError(
                    "opd.teachability = 'overlap' needs the teacher's top-K (opd.teacher_top_k > 0)"
                )
            w_BT = w_BT * teachability_weights(logp_top_BTK, mask_BT).double()
        if self.freshness is not None:
            f_B = freshness_weights_B(logp_BT, behav_BT, mask_BT, **self.freshness)
            w_BT = w_BT * f_B.double()[:, None]
        return torch.where(mask_BT, w_BT, 0.0)

    def begin_step(self, step: int) -> None:
        """Step `step` (its policy version) begins: the horizon of "fixed" and "linear" is a
        function of it (as the generators' teachers compute it); "gap" keeps its own."""
        if self.schedule != "gap":
            self.current = scheduled_horizon(self.horizon, self.schedule, self.growth, self.horizon_max, step)

    def observe(
        self, mask_BT: torch.Tensor, used_BT: torch.Tensor, scored_BT: torch.Tensor, k1_BT: torch.Tensor
    ) -> None:
        """A distillation term's figures: its trained, teacher-scored and distilled tokens, and
        the k1 gap estimate at the distilled ones (detached)."""
        self.trained_tokens += float(mask_BT.sum())
        self.scored_tokens += float((mask_BT & scored_BT).sum())
        self.gap_sum += float(torch.where(used_BT, k1_BT.detach(), 0.0).sum())
        self.gap_tokens += float(used_BT.sum())

    def end_step(self) -> dict[str, float]:
        """The step's figures (horizon, gap, fraction of trained tokens the teacher scored); the
        "gap" schedule grows the horizon for the next step from this step's gap."""
        gap = self.gap_sum / self.gap_tokens if self.gap_tokens > 0 else None
        report = {"opd_horizon": float(self.current)}
        if gap is not None:
            report["opd_horizon_gap"] = gap
        if self.trained_tokens > 0:
            report["opd_scored_fraction"] = self.scored_tokens / self.trained_tokens
        self.history.append(self.current)
        if self.schedule == "gap":
            self.current = next_horizon(
                self.current,
                schedule="gap",
                growth=self.growth,
                horizon_max=self.horizon_max,
                gap=self.gap,
                kl=gap,
            )
        self.gap_sum = self.gap_tokens = self.scored_tokens = self.trained_tokens = 0.0
        return report

    def state_dict(self) -> dict[str, int]:
        """What a resumed run needs: the horizon of the next step (the "gap" schedule's own state;
        "fixed" and "linear" recompute theirs from the step at `begin_step`)."""
        return {"current": self.current}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.current = int(state["current"])


def control_state(trainer) -> dict[str, dict[str, int]]:
    """The learner checkpoint's entry for the run's control (`distill_work.install_control`):
    {"opd_control": its state}, or {} without one."""
    control = getattr(getattr(trainer, "engine", None), "opd_control", None)
    return {} if control is None else {"opd_control": control.state_dict()}


def restore_control(trainer, extras: Mapping[str, Any]) -> None:
    """Put a checkpoint's control state back (`control_state`); a checkpoint written without one
    (opd off, or an older checkpoint) leaves the control as the config built it."""
    control = getattr(getattr(trainer, "engine", None), "opd_control", None)
    if control is not None and "opd_control" in extras:
        control.load_state_dict(extras["opd_control"])


def freshness_params(section: Mapping[str, Any]) -> dict[str, float]:
    """staleness.freshness's lambdas and floor as `freshness_weights_B` takes them (the
    FreshnessWeighted defaults where a key is absent; self_normalize does not apply here)."""
    from asyncrl.staleness.freshness import FreshnessWeighted

    defaults = FreshnessWeighted.__dataclass_fields__
    return {
        name: float(section.get(name, defaults[name].default))
        for name in ("lambda_roll", "lambda_sup", "f_min")
    }
