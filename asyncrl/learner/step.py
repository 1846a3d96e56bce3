"""One learner step over a batch of trajectories: pack, advantages, loss, gradients (no sockets).

The service (`service.py`) collects the trajectories of an admission window and calls
`accumulate_gradients`; the optimizer step, weight publishing and messages stay there.

Legend: B sequences, L packed length (prompt + completion, right-padded), G groups, N samples
per group. Log-probs are aligned with input positions: position t holds log pi(x_t | x_<t).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from asyncrl.learner.advantages import group_rewards, grpo_advantages, sequence_advantages, token_advantages
from asyncrl.learner.logprobs import causal_lm_logprobs
from asyncrl.learner.losses import clipped_surrogate
from asyncrl.staleness.base import StalenessPolicy, TokenBatch, with_current_as_prox


@dataclass(frozen=True, slots=True)
class TrainSample:
    """A received trajectory, in the learner's terms."""

    traj_id: int
    group_id: int
    sample_index: int
    prompt_ids: Sequence[int]
    completion_ids: torch.Tensor  # int64 [T]
    behavior_logprobs: torch.Tensor  # float32 [T]
    token_versions: torch.Tensor  # int64 [T]
    reward: float


class PackedBatch(NamedTuple):
    input_ids_BL: torch.Tensor
    completion_mask_BL: torch.Tensor  # bool: positions of completion tokens
    behavior_logp_BL: torch.Tensor
    versions_BL: torch.Tensor
    reward_B: torch.Tensor
    group_B: torch.Tensor  # dense group index 0..G-1
    slot_B: torch.Tensor  # sample index within the group
    num_groups: int
    group_size: int


class StepStats(NamedTuple):
    loss: float
    clip_fraction: float
    mean_reward: float
    num_tokens: int
    max_staleness: int
    mean_staleness: float
    lr_scale: float
    policy_stats: dict[str, float]  # the staleness policy's diagnostics (finite ones)


def pack(samples: Sequence[TrainSample], *, pad_token_id: int) -> PackedBatch:
    if not samples:
        raise ValueError("cannot pack an empty batch")
    lengths = [len(s.prompt_ids) + len(s.completion_ids) for s in samples]
    width = max(lengths)
    num = len(samples)
    ids = torch.full((num, width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((num, width), dtype=torch.bool)
    behav = torch.zeros((num, width), dtype=torch.float32)
    versions = torch.zeros((num, width), dtype=torch.long)
    group_index: dict[int, int] = {}
    group_B = torch.empty(num, dtype=torch.long)
    slot_B = torch.empty(num, dtype=torch.long)
    sizes: dict[int, int] = {}
    for b, s in enumerate(samples):
        p = len(s.prompt_ids)
        c = len(s.completion_ids)
        ids[b, :p] = torch.as_tensor(list(s.prompt_ids), dtype=torch.long)
        ids[b, p : p + c] = s.completion_ids
        mask[b, p : p + c] = True
        behav[b, p : p + c] = s.behavior_logprobs
        versions[b, p : p + c] = s.token_versions
        group_B[b] = group_index.setdefault(s.group_id, len(group_index))
        slot_B[b] = s.sample_index
        sizes[s.group_id] = sizes.get(s.group_id, 0) + 1
    group_size = max(sizes.values())
    if any(n != group_size for n in sizes.values()):
        raise ValueError(f"incomplete groups in batch: sizes {sorted(set(sizes.values()))}")
    rewards = torch.tensor([s.reward for s in samples], dtype=torch.float32)
    return PackedBatch(ids, mask, behav, versions, rewards, group_B, slot_B, len(group_index), group_size)


def staleness_B(batch: PackedBatch, policy_version: int) -> torch.Tensor:
    """policy_version minus the oldest token version of each sequence."""
    big = torch.iinfo(torch.long).max
    oldest_B = torch.where(batch.completion_mask_BL, batch.versions_BL, big).min(dim=1).values
    return policy_version - oldest_B


def _log_probs(model: torch.nn.Module, input_ids_BL: torch.Tensor, *, temperature: float) -> torch.Tensor:
    return causal_lm_logprobs(model, input_ids_BL, temperature=temperature).logp


# Clip bounds that never bind: ratios live in (0, e^MAX_LOG_RATIO], so clip_low=1 and an infinite
# clip_high leave the surrogate unclipped (M2PO and VCPO use their mask or weights instead).
NO_CLIP = {"clip_low": 1.0, "clip_high": float("inf")}


def accumulate_gradients(
    model: torch.nn.Module,
    batch: PackedBatch,
    *,
    policy: StalenessPolicy,
    policy_version: int,
    temperature: float,
    clip_low: float,
    clip_high: float,
    micro_batch_size: int,
) -> StepStats:
    """GRPO: group-normalised advantages; the staleness policy's anchor, weights and mask; clipped
    surrogate; token-mean over the whole batch. Gradients accumulate into `.grad` micro-batch by
    micro-batch with the global token count as denominator, so the split changes nothing.

    The correction is computed over the whole batch (policies such as M2PO use batch-global
    statistics): with one micro-batch from the same forward, otherwise from one extra no-grad
    forward at the same parameters. One optimizer step per batch makes the current log-probs the
    proximal ones, so `prox` needs no other forward."""
    rewards_GN = group_rewards(
        batch.reward_B, batch.group_B, batch.slot_B, num_groups=batch.num_groups, group_size=batch.group_size
    )
    adv_B = sequence_advantages(grpo_advantages(rewards_GN), batch.group_B, batch.slot_B)
    mask_BL = batch.completion_mask_BL
    adv_BL = token_advantages(adv_B, mask_BL)
    num_tokens = int(mask_BL.sum())
    num = batch.input_ids_BL.shape[0]
    single = num <= micro_batch_size
    if single:
        logp_BL = _log_probs(model, batch.input_ids_BL, temperature=temperature)
        logp_now_BL = logp_BL.detach()
    else:
        with torch.no_grad():
            logp_now_BL = torch.cat(
                [
                    _log_probs(model, batch.input_ids_BL[i : i + micro_batch_size], temperature=temperature)
                    for i in range(0, num, micro_batch_size)
                ]
            )
    token_batch = with_current_as_prox(
        TokenBatch(
            logp_BT=logp_now_BL,
            logp_behav_BT=batch.behavior_logp_BL,
            mask_BT=mask_BL,
            versions_BT=batch.versions_BL,
            adv_BT=adv_BL,
            policy_version=policy_version,
        )
    )
    corr = policy.correct(token_batch)
    clip = {"clip_low": clip_low, "clip_high": clip_high} if corr.use_clip else NO_CLIP
    total_loss = 0.0
    clipped = 0.0
    for start in range(0, num, micro_batch_size):
        sl = slice(start, start + micro_batch_size)
        if not single:
            logp_BL = _log_probs(model, batch.input_ids_BL[sl], temperature=temperature)
        loss, stats = clipped_surrogate(
            logp_BL,
            corr.logp_anchor_BT[sl],
            adv_BL[sl],
            corr.mask_BT[sl],
            corr.weight_BT[sl],
            mode="token-mean",
            num_tokens_global=num_tokens,
            **clip,
        )
        loss.backward()
        total_loss += float(loss.detach())
        clipped += float(stats.clip_fraction) * float(stats.num_tokens)
    stale_B = staleness_B(batch, policy_version)
    return StepStats(
        loss=total_loss,
        clip_fraction=clipped / max(1, num_tokens),
        mean_reward=float(batch.reward_B.mean()),
        num_tokens=num_tokens,
        max_staleness=int(stale_B.max()),
        mean_staleness=float(stale_B.float().mean()),
        lr_scale=corr.lr_scale,
        policy_stats={k: float(v) for k, v in corr.stats._asdict().items() if math.isfinite(float(v))},
    )
