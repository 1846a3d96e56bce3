"""The checks of the learner's objective that need the built staleness policy, or more than one
config section (no torch: the launcher runs them while it loads the config, before any process
starts).

Place in the data flow: `asyncrl.config_load.config_from_tree` builds the staleness policy once
(`check_staleness_policy`) and hands it here with the whole config; the learner's `build_trainer`
runs `check_objective_config` again, so a config that skipped the loader still fails before the
first step. Each error names the key and the fix.

* The policy against the rest (`check_policy_fit`): what it keeps and whether it takes batch-wide
  statistics, against buffer.action and several learner ranks.
* `opd.reward` != "off" (distillation with the task reward): the RL part applies the staleness
  policy, so the several-rank limits that distillation alone escapes apply again, and the RL
  log-probs come from the distillation forward over the full vocabulary (sampling.top_p = 1).
* `staleness.vcpo_baseline` = "opob"/"opob_released" (ALGORITHMS.md 2.2): the baseline needs each
  trajectory's own gradient norm (from one batched backward, `learner/ghost.py`, or one backward
  per trajectory where the model or a nucleus rules that out: one plain rank only), in float32,
  its gradient must be linear in its advantage (no sign(A)-dependent clip), and it must be the
  only gradient of the trajectory (no KL term, no distillation, one epoch).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from asyncrl.config_sections import ConfigError, StalenessConfig

if TYPE_CHECKING:
    from asyncrl.config import Config

OPOB_ADVANTAGES = ("grpo", "dr_grpo")  # objective.OPOB_ADVANTAGES (this module imports no torch)
GUIDED_ADVANTAGES = ("grpo", "dr_grpo")  # learner/guidance.py's (this module imports no torch)


def check_staleness_policy(section: StalenessConfig):
    """Build the configured policy once, so a misspelled name or parameter fails at load time."""
    from asyncrl.staleness import LEARNER_PROVIDES
    from asyncrl.staleness.registry import make_policy

    try:
        policy = make_policy(section.policy, freshness=section.freshness, **section.params)
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"config error at staleness.policy: {exc}") from None
    missing = [n for n in policy.needs if n not in LEARNER_PROVIDES]
    if missing:
        raise ConfigError(
            f"config error at staleness.policy: {section.policy!r} needs {', '.join(missing)} log-probs, "
            "which the learner does not compute yet; choose another policy"
        )
    return policy


def check_policy_fit(config: Config, policy) -> None:
    """Raise `ConfigError` for a staleness policy that the buffer or the learner ranks cannot serve."""
    if config.buffer.action == "downweight" and "old_train" in policy.needs:
        raise ConfigError(
            f"config error at buffer.action: staleness policy {policy.name!r} keeps the last "
            "max_staleness + 1 versions, and 'downweight' trains groups older than that; use withhold or drop"
        )
    kept = sorted({"ewma", "old_train"} & set(policy.needs))
    if config.learner.world_size > 1 and kept and config.learner.lora.rank and not config.opd.enabled:
        raise ConfigError(
            f"config error at learner.world_size: staleness policy {policy.name!r} keeps {' and '.join(kept)} "
            "copies of the weights, sharded like the model and built from its config, which a LoRA model has "
            "no constructor for; use learner.world_size = 1 with LoRA, or another staleness.policy"
        )


def check_objective_config(config: Config, policy) -> None:
    """Raise `ConfigError` for an objective combination the learner cannot train exactly."""
    _check_reward_mixing(config, policy)
    _check_opob(config, policy)
    _check_gdpo(config)
    _check_guidance(config)


def _check_reward_mixing(config: Config, policy) -> None:
    opd, lrn = config.opd, config.learner
    if opd.enabled and opd.reward == "off" and lrn.kl_coef > 0 and lrn.kl_placement != "loss":
        raise ConfigError(
            "config error at learner.kl_placement: pure distillation (opd.reward = 'off') has no reward to "
            "fold the KL into; its KL to the initial model is a loss term: set learner.kl_placement = 'loss'"
        )
    if not opd.enabled or opd.reward == "off":
        return
    if config.sampling.top_p != 1.0:
        raise ConfigError(
            f"config error at opd.reward: {opd.reward!r} takes the RL part's log-probs from the "
            "distillation forward, over the full vocabulary; set sampling.top_p = 1 (as OPD wants anyway)"
        )
    kept = sorted({"ewma", "old_train"} & set(policy.needs))
    if lrn.world_size > 1 and (kept or policy.batch_global):
        what = f"keeps {' and '.join(kept)} copies of the weights" if kept else "takes batch-wide statistics"
        raise ConfigError(
            f"config error at learner.world_size: opd.reward = {opd.reward!r} applies staleness policy "
            f"{policy.name!r} to the reward's part, and it {what}, which several learner ranks do not "
            "support; use learner.world_size = 1 or another staleness.policy"
        )


def _check_opob(config: Config, policy) -> None:
    lrn, baseline = config.learner, config.staleness.vcpo_baseline
    if baseline == "group_mean":
        return
    where = f"config error at staleness.vcpo_baseline: {baseline!r}"
    if lrn.advantage not in OPOB_ADVANTAGES:
        raise ConfigError(
            f"{where} replaces the group mean of learner.advantage = 'grpo' or 'dr_grpo'; "
            f"{lrn.advantage!r} has its own baseline: choose one of those, or vcpo_baseline = 'group_mean'"
        )
    if config.opd.enabled:
        raise ConfigError(
            f"{where} is a baseline for the task reward alone; with opd.enabled use vcpo_baseline = 'group_mean'"
        )
    if lrn.mixed_precision != "none":
        raise ConfigError(
            f"{where} weighs each trajectory by its exact gradient norm, in float32: use "
            "learner.mixed_precision = 'none'"
        )
    lockstep = lrn.world_size > 1 or lrn.sharding != "none"
    if lockstep and config.sampling.top_p != 1.0:
        raise ConfigError(
            f"{where} on several learner ranks takes each trajectory's gradient norm from one batched "
            "backward, whose LM-head part needs the full vocabulary: set sampling.top_p = 1, or "
            "learner.world_size = 1 (one backward per trajectory)"
        )
    if lrn.epochs > 1:
        raise ConfigError(f"{where} needs learner.epochs = 1 (one update per per-trajectory gradient)")
    if lrn.kl_coef > 0:
        raise ConfigError(
            f"{where}: a KL term adds a second gradient per trajectory that the baseline does not multiply; "
            "set learner.kl_coef = 0"
        )
    if not policy.streamable:
        raise ConfigError(
            f"{where} needs each trajectory's gradient linear in its advantage, and staleness policy "
            f"{policy.name!r} clips against an anchor other than the current policy or couples "
            "trajectories; use vcpo (the paper's), tis, icepop, decoupled, or none with params.anchor = 'current'"
        )
    if policy.batch_global and not getattr(policy, "batch_global_lr_only", False):
        raise ConfigError(
            f"{where}: staleness policy {policy.name!r} weighs each trajectory by statistics of the whole "
            "batch, unknown when the trajectory trains; choose a policy with per-trajectory weights"
        )


def _check_gdpo(config: Config) -> None:
    """learner.advantage = "gdpo" normalises each of task.rewards within its group (whole batches)."""
    lrn = config.learner
    if lrn.advantage != "gdpo":
        return
    where = "config error at learner.advantage: 'gdpo'"
    if config.env.kind or len(config.task.rewards) < 2:
        raise ConfigError(
            f"{where} normalises each of several rewards (task.rewards) on its own; this run has "
            f"{0 if config.env.kind else len(config.task.rewards)} (with one reward it is GRPO up to a "
            "batch scale): configure two or more task.rewards, or use learner.advantage = 'grpo'"
        )
    if lrn.kl_coef > 0 and lrn.kl_placement == "reward":
        raise ConfigError(
            f"{where} normalises each reward apart, and a KL penalty in the reward has no column of its "
            "own: set learner.kl_placement = 'loss' (or learner.kl_coef = 0)"
        )
    if config.sampling.guidance.enabled:
        raise ConfigError(
            f"{where} with sampling.guidance: guided members need a baseline from the unguided ones, "
            "which the per-reward normalisation does not take; use learner.advantage = 'grpo'"
        )


def _check_guidance(config: Config) -> None:
    """sampling.guidance: guided group members (learner/guidance.py), trained in whole batches."""
    g, lrn = config.sampling.guidance, config.learner
    if not g.enabled:
        return
    where = "config error at sampling.guidance"
    if lrn.advantage not in GUIDED_ADVANTAGES:
        raise ConfigError(
            f"{where}: the guided members' baseline is the unguided members' mean, defined for "
            f"learner.advantage = 'grpo' or 'dr_grpo', not {lrn.advantage!r}"
        )
    if g.samples >= lrn.samples_per_group:
        raise ConfigError(
            f"{where}.samples = {g.samples} leaves no unguided member in a group of "
            f"learner.samples_per_group = {lrn.samples_per_group}, so no baseline: lower it"
        )
    if config.staleness.vcpo_baseline != "group_mean":
        raise ConfigError(
            f"{where} replaces the group mean by the unguided members' mean, and staleness.vcpo_baseline "
            f"= {config.staleness.vcpo_baseline!r} replaces it too: use one of them"
        )
    if g.prefix_loss == "shaped" and lrn.agg == "seq-mean-token-mean":
        raise ConfigError(
            f"{where}.prefix_loss = 'shaped' adds the prefix tokens' terms to the token sums; "
            "learner.agg = 'seq-mean-token-mean' averages each sequence apart: use another learner.agg"
        )
    if config.opd.enabled or config.env.kind:
        raise ConfigError(
            f"{where} forces solution tokens into single-turn RL samples; it does not combine with "
            "opd.enabled or env.kind: turn one of them off"
        )
    if config.generators.kind != "torch":
        raise ConfigError(
            f"{where} tokenizes each guided prefix with the generator's tokenizer, which the built-in "
            f"torch generator gives and generators.kind = {config.generators.kind!r} does not: use "
            "generators.kind = 'torch', or turn sampling.guidance off"
        )
