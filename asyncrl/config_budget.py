"""Load-time checks of `sampling.budget = "uncertainty"` (rollout budgets, scheduler/budget.py).

Unequal group sizes are supported where each stage was built for them: window admission (sync and
async), the RL estimators grpo, dr_grpo, rloo and gdpo (whole batches and streaming), one learner
rank. Everything else is refused here, naming the key and what to do.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from asyncrl.config import Config

BUDGET_ADVANTAGES = ("grpo", "dr_grpo", "rloo", "gdpo")


def budget_refusal(config: Config) -> str | None:
    """Why this config cannot take unequal group sizes (None: it can)."""
    s, lrn = config.sampling, config.learner
    if not s.budget_min <= lrn.samples_per_group <= s.budget_max:
        return (
            f"learner.samples_per_group = {lrn.samples_per_group} is the mean group size and must lie in "
            f"sampling.budget_min..budget_max = {s.budget_min}..{s.budget_max}; widen the range"
        )
    refused = (
        (config.buffer.mode == "pool", "buffer.mode = 'pool'", "use buffer.mode = 'window'"),
        (config.opd.enabled, "opd.enabled (distillation)", "turn opd off"),
        (s.guidance.enabled, "sampling.guidance", "turn guidance off"),
        (bool(config.env.kind), "env.kind (environments)", "leave env.kind empty"),
        (
            lrn.advantage not in BUDGET_ADVANTAGES,
            f"learner.advantage = {lrn.advantage!r}",
            f"use one of {', '.join(BUDGET_ADVANTAGES)}",
        ),
        (
            config.staleness.vcpo_baseline != "group_mean",
            f"staleness.vcpo_baseline = {config.staleness.vcpo_baseline!r}",
            "use 'group_mean'",
        ),
        (lrn.world_size > 1, "learner.world_size > 1", "use one learner rank"),
        (lrn.minibatches > 1, "learner.minibatches > 1", "use learner.minibatches = 1"),
    )
    for bad, what, fix in refused:
        if bad:
            return f"sampling.budget = 'uncertainty' is not supported with {what}: {fix}, or sampling.budget = 'fixed'"
    return None


def check_budget(config: Config) -> None:
    """ValueError naming the key when the config cannot take unequal group sizes."""
    if config.sampling.budget != "fixed" and (why := budget_refusal(config)) is not None:
        raise ValueError(why)
