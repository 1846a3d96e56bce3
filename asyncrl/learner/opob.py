"""The learner's off-policy optimal baseline path (no sockets): what `rl_work.OpobWork` uses when
`staleness.vcpo_baseline` is "opob" or "opob_released" (ALGORITHMS.md 2.2, 5.3).

Place in the data flow: with the optimal baseline every trajectory of a step takes its own forward
and backward (`rl_work.OpobWork`, on arrival or, for whole-batch steps, group by group) into
its group's sums of the `StreamingAccumulator`, which records W_i = ||h_i||^2 x `baseline_scale`
and folds the group with b_g = sum W R / sum W when it closes. This module holds the three pieces
around that: the released variant's factor on ||h_i||^2, the closed group's loss value, and the
learning-rate scale of a policy whose only batch-global part it is (VCPO's ESS), taken over the
whole step at its end from the log-probs each trajectory's forward recorded.

Legend: B sequences, L packed length.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from asyncrl.learner.step import PackedBatch, TrainSample
from asyncrl.learner.streaming import GroupFold, token_weight
from asyncrl.staleness.vcpo import opob_baseline, opob_released_scale, sequence_log_weights

if TYPE_CHECKING:
    from asyncrl.learner.engine import Engine
    from asyncrl.learner.objective import RLObjective
    from asyncrl.learner.state import StepState


def baseline_scale(objective: RLObjective, batch: PackedBatch, logp_1L: torch.Tensor) -> float:
    """The factor on ||h_i||^2 in W_i of a one-trajectory batch: 1 ("opob"), or the released
    code's w_i^2 / c_i^2 ("opob_released": unclipped sequence IS weight, token-sum score norm)."""
    if objective.baseline != "opob_released":
        return 1.0
    mask = batch.completion_mask_BL
    behav = batch.behavior_logp_BL.to(logp_1L.dtype)
    log_w = float(sequence_log_weights(logp_1L.detach(), behav, mask)[0])
    num = int(mask.sum())
    return opob_released_scale(log_w, num, token_weight=token_weight(objective.agg, num))


def folded_loss(
    fold: GroupFold, streamed: Sequence[tuple[int, float, float]], advantage: str, *, eps: float
) -> float:
    """A closed group's loss value sum_i A_i l_i(+1) from its members' (slot, l_i(+1), reward):
    A_i = (r_i - b) / (sigma + eps) for grpo, r_i - b for dr_grpo, b the fold's baseline (the
    accumulator's sigma and eps); 0 for a degenerate group, as its gradient."""
    if fold.degenerate:
        return 0.0
    total = 0.0
    for _, loss_pos, reward in streamed:
        adv = reward - fold.baseline
        if advantage == "grpo":
            adv /= fold.reward_std + eps
        total += adv * loss_pos
    return total


def step_lr_scale(engine: Engine, state: StepState) -> None:
    """With a batch-global policy (admitted only if its lr scale is all that is batch-global:
    `config_objective`), each trajectory's own correction saw a batch of one. Take the correction
    over the step's trajectories and their recorded step-start log-probs [1, L_i] now, as the
    whole-batch step would, and set the step's `lr_scale` (and its ESS statistic) from it."""
    rows = state.opob_logp
    if not (rows and engine.policy.batch_global):
        return
    rows = sorted(rows, key=lambda r: r[0].traj_id)
    batch = engine.pack([s for s, _ in rows])
    logp_BL = torch.zeros(batch.input_ids_BL.shape, dtype=engine.dtype, device=engine.device)
    for b, (_, logp_1L) in enumerate(rows):
        logp_BL[b, : logp_1L.shape[1]] = logp_1L[0]
    corr = engine.correct(
        batch, logp_BL, torch.zeros(len(rows), dtype=engine.dtype, device=engine.device), state.step
    )
    state.set_lr_scale(corr.lr_scale)
    if "ess_ratio" in state.totals.stats:  # the token-weighted mean of the per-trajectory ratios (1 each)
        state.set_stat("ess_ratio", float(corr.stats.ess_ratio) * state.totals.stats_tokens)


def opob_advantages(
    rewards_GN: torch.Tensor, weights_GN: torch.Tensor, *, advantage: str, eps: float, unbiased: bool = True
) -> torch.Tensor:
    """A_i = (R_i - b_g) / (sigma_g + eps) ("grpo") or R_i - b_g ("dr_grpo"), b_g = sum W R / sum W
    (`opob_baseline`), sigma_g the group's reward std (the accumulator's `unbiased`); a group whose
    rewards are all equal (or of one sample) gets 0, as the streamed fold gives it."""
    rewards_GN, weights_GN = rewards_GN.double(), weights_GN.double()
    base_G1 = opob_baseline(weights_GN, rewards_GN)[:, None]
    adv_GN = rewards_GN - base_G1
    if advantage == "grpo":
        std_G1 = (
            rewards_GN.std(dim=1, keepdim=True, unbiased=unbiased)
            if rewards_GN.shape[1] > 1
            else torch.zeros_like(base_G1)
        )
        adv_GN = adv_GN / (std_G1 + eps)
    degenerate_G1 = (rewards_GN == rewards_GN[:, :1]).all(dim=1, keepdim=True)
    return torch.where(degenerate_G1, 0.0, adv_GN)


def released_scales(objective: RLObjective, batch: PackedBatch, logp_BL: torch.Tensor) -> torch.Tensor:
    """Per row, the factor on ||h_i||^2 in W_i (`baseline_scale` of each row) [B], float64."""
    if objective.baseline != "opob_released":
        return torch.ones(batch.input_ids_BL.shape[0], dtype=torch.float64)
    mask = batch.completion_mask_BL
    log_w = sequence_log_weights(logp_BL.detach(), batch.behavior_logp_BL.to(logp_BL.dtype), mask)
    nums = mask.sum(dim=1).tolist()
    return torch.tensor(
        [
            opob_released_scale(float(lw), n, token_weight=token_weight(objective.agg, n))
            for lw, n in zip(log_w.tolist(), nums, strict=True)
        ],
        dtype=torch.float64,
    )


def informative_groups(samples: Sequence[TrainSample]) -> set[int]:
    """The groups whose advantages depend on their baseline, so whose members' norms W_i are
    needed: those whose rewards are not all equal. An all-equal group's advantages are 0
    whatever b_g is (`opob_advantages`), and the filters that drop groups drop only such ones."""
    rewards: dict[int, set[float]] = {}
    for s in samples:
        rewards.setdefault(s.group_id, set()).add(float(s.reward))
    return {g for g, values in rewards.items() if len(values) > 1}
