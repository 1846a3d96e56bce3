"""Trajectories in the learner's terms, packed into padded batches (no sockets, no model).

The engine (`engine.py`) packs what a unit trains on with `pack`; `staleness_B` gives each
sequence's staleness; `StepResult` reports a step's figures (summed in `state.StepTotals`). The
learner service sends a step's result to the launcher as the `StepDone` message that
`StepResult.step_done` builds.

Legend: B sequences, L packed length (prompt + completion, right-padded), G groups, N samples
per group. Log-probs are aligned with input positions: position t holds log pi(x_t | x_<t).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import msgspec
import torch

from asyncrl.messages import StepDone


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
    # On-policy distillation: [T, N] teacher log-probs, cached ids (column 0 = the sampled token)
    # and their behavior log-probs; None for RL.
    teacher_logprobs: torch.Tensor | None = None
    opd_ids: torch.Tensor | None = None
    opd_behavior_logprobs: torch.Tensor | None = None
    loss_mask: torch.Tensor | None = None  # bool [T]: False = not trained (e.g. tool output)
    # opd.teacher_top_k = K > 0: the teacher's top-K ids and log-probs per position, [T, K] each.
    teacher_top_ids: torch.Tensor | None = None
    teacher_top_logprobs: torch.Tensor | None = None
    # Loss weight of the trajectory's group (buffer.action = "downweight" past a bound): its
    # advantages are scaled by it, which scales its policy-gradient terms exactly.
    weight: float = 1.0
    # Each reward's unweighted value in task.rewards order (`Trajectory.reward_parts`; GDPO).
    reward_parts: Sequence[float] = ()
    # Guided (sampling.guidance): this many leading completion tokens were forced, not sampled.
    guided_prefix: int = 0
    # Its group's size (`Trajectory.num_samples`; rollout budgets make sizes differ); 0 = the
    # learner's learner.samples_per_group.
    group_size: int = 0
    # opd.teachers: the teacher that scored it (`Trajectory.teacher_id`; "" = the one teacher), for
    # the learner's distillation KL per teacher and per domain (`distill_work.KlByTeacher`).
    teacher_id: str = ""


class PackedBatch(NamedTuple):
    input_ids_BL: torch.Tensor
    completion_mask_BL: torch.Tensor  # bool: positions of completion tokens
    behavior_logp_BL: torch.Tensor
    versions_BL: torch.Tensor
    reward_B: torch.Tensor
    group_B: torch.Tensor  # dense group index 0..G-1
    slot_B: torch.Tensor  # sample index within the group
    num_groups: int
    group_size: int  # the largest group's size
    lengths_B: torch.Tensor | None = None  # real tokens per row (prompt + completion)
    # Each group's size when they differ (rollout budgets); None: every group has group_size.
    sizes_G: torch.Tensor | None = None

    def to(self, device: torch.device) -> PackedBatch:
        """The same batch with its tensors on `device` (no copy when they are there already)."""
        return self._replace(
            **{k: v.to(device) for k, v in self._asdict().items() if isinstance(v, torch.Tensor)}
        )


def sample_from_message(msg, tensors: Sequence[torch.Tensor]) -> TrainSample:
    """A received `Trajectory` and its tensor frames (3, or 6 with OPD), copied out of the frames."""
    ids, logps, versions = tensors[:3]
    names = (
        "teacher_logprobs",
        "opd_ids",
        "opd_behavior_logprobs",
        "loss_mask",
        "teacher_top_ids",
        "teacher_top_logprobs",
    )
    extra = {n: tensors[ref.frame].clone() for n in names if (ref := getattr(msg, n)) is not None}
    if msg.guided_prefix:  # a guided sample's forced prefix is never trained as sampled (the learner's rule)
        mask = extra.get("loss_mask", torch.ones(len(ids), dtype=torch.bool)).bool()
        mask[: msg.guided_prefix] = False
        extra["loss_mask"] = mask
    return TrainSample(
        traj_id=msg.traj_id,
        group_id=msg.group_id,
        sample_index=msg.sample_index,
        prompt_ids=msg.prompt_ids,
        completion_ids=ids.clone(),
        behavior_logprobs=logps.clone(),
        token_versions=versions.clone(),
        reward=msg.reward,
        reward_parts=list(msg.reward_parts),
        guided_prefix=msg.guided_prefix,
        group_size=msg.num_samples,
        teacher_id=msg.teacher_id,
        **extra,
    )


def pack(samples: Sequence[TrainSample], *, pad_token_id: int, require_complete: bool = True) -> PackedBatch:
    """Right-padded prompt + completion rows. With `require_complete`, every group present must
    be complete: its own size (`TrainSample.group_size`) where the samples carry one, else the
    same number of samples in every group (a whole step); without it, any members may be packed.
    Groups of unequal sizes (rollout budgets) set `sizes_G`.

    Written with one scatter per field over the whole batch (not a copy per row): a streaming
    learner packs every chunk it trains (the cost of row copies: bench/README.md, "pack")."""
    if not samples:
        raise ValueError("cannot pack an empty batch")
    num = len(samples)
    prompt_N = torch.tensor([len(s.prompt_ids) for s in samples], dtype=torch.long)
    comp_N = torch.tensor([len(s.completion_ids) for s in samples], dtype=torch.long)
    width = int((prompt_N + comp_N).max())
    row_start_N = torch.arange(num, dtype=torch.long) * width
    prompt_at = _spans(row_start_N, prompt_N)  # flat [B * L] positions of the prompts' tokens
    comp_at = _spans(row_start_N + prompt_N, comp_N)  # ... and of the completions'
    ids = torch.full((num, width), pad_token_id, dtype=torch.long)
    flat_ids = ids.view(-1)
    flat_ids[prompt_at] = torch.tensor([t for s in samples for t in s.prompt_ids], dtype=torch.long)
    flat_ids[comp_at] = torch.cat([s.completion_ids for s in samples]).long()
    mask = torch.zeros((num, width), dtype=torch.bool)
    if all(s.loss_mask is None for s in samples):
        mask.view(-1)[comp_at] = True
    else:
        mask.view(-1)[comp_at] = torch.cat(
            [
                torch.ones(len(s.completion_ids), dtype=torch.bool)
                if s.loss_mask is None
                else s.loss_mask.bool()
                for s in samples
            ]
        )
    behav = torch.zeros((num, width), dtype=torch.float32)
    behav.view(-1)[comp_at] = torch.cat([s.behavior_logprobs for s in samples]).float()
    versions = torch.zeros((num, width), dtype=torch.long)
    versions.view(-1)[comp_at] = torch.cat([s.token_versions for s in samples]).long()
    group_index: dict[int, int] = {}
    sizes: dict[int, int] = {}
    for s in samples:
        group_index.setdefault(s.group_id, len(group_index))
        sizes[s.group_id] = sizes.get(s.group_id, 0) + 1
    group_B = torch.tensor([group_index[s.group_id] for s in samples], dtype=torch.long)
    slot_B = torch.tensor([s.sample_index for s in samples], dtype=torch.long)
    group_size = max(sizes.values())
    own = {s.group_id: s.group_size or group_size for s in samples}
    if require_complete and any(n != own[g] for g, n in sizes.items()):
        raise ValueError(f"incomplete groups in batch: sizes {sorted(set(sizes.values()))}")
    ragged = len(set(sizes.values())) > 1 or len(set(own.values())) > 1
    sizes_G = torch.tensor([own[g] for g in group_index], dtype=torch.long) if ragged else None
    rewards = torch.tensor([s.reward for s in samples], dtype=torch.float32)
    return PackedBatch(
        ids,
        mask,
        behav,
        versions,
        rewards,
        group_B,
        slot_B,
        len(group_index),
        group_size,
        prompt_N + comp_N,
        sizes_G,
    )


def _spans(start_N: torch.Tensor, count_N: torch.Tensor) -> torch.Tensor:
    """The concatenated ranges start_i .. start_i + count_i - 1, as one long tensor."""
    total = int(count_N.sum())
    first_N = torch.cumsum(count_N, 0) - count_N  # where each range begins in the output
    return torch.arange(total, dtype=torch.long) + (start_N - first_N).repeat_interleave(count_N)


def pack_opd(samples: Sequence[TrainSample], width: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The OPD arrays of `samples` as [B, L, N] aligned with `pack`'s rows (zeros off-completion).

    With the teacher's top-K (opd.teacher_top_k = K > 0) the last K columns are its top-K ids and
    log-probs: the union cache [B, L, N + K], whose behavior log-probs there are NaN (the student
    did not draw them; no estimator reads them)."""
    num = samples[0].opd_ids.shape[1]
    top = 0 if samples[0].teacher_top_ids is None else samples[0].teacher_top_ids.shape[1]
    teacher = torch.zeros((len(samples), width, num + top), dtype=torch.float32)
    ids = torch.zeros((len(samples), width, num + top), dtype=torch.long)
    behav = torch.zeros((len(samples), width, num + top), dtype=torch.float32)
    for b, s in enumerate(samples):
        p, c = len(s.prompt_ids), len(s.completion_ids)
        teacher[b, p : p + c, :num] = s.teacher_logprobs
        ids[b, p : p + c, :num] = s.opd_ids
        behav[b, p : p + c, :num] = s.opd_behavior_logprobs
        if top:
            teacher[b, p : p + c, num:] = s.teacher_top_logprobs
            ids[b, p : p + c, num:] = s.teacher_top_ids
            behav[b, p : p + c, num:] = float("nan")
    return teacher, ids, behav


def staleness_B(batch: PackedBatch, policy_version: int) -> torch.Tensor:
    """policy_version minus the oldest token version of each sequence."""
    big = torch.iinfo(torch.long).max
    oldest_B = torch.where(batch.completion_mask_BL, batch.versions_BL, big).min(dim=1).values
    return policy_version - oldest_B


@dataclass
class StepResult:
    """One optimizer step's figures. Those it shares with `StepDone` by name go into the message
    as they are (`step_done`); the rest (streaming and fallback figures) become metrics."""

    step: int
    num_trajectories: int
    num_tokens: int
    loss: float
    mean_reward: float
    max_staleness: int
    mean_staleness: float
    clip_fraction: float
    grad_norm: float
    lr_scale: float
    policy_stats: dict[str, float]
    streamed: int  # trajectories streamed on arrival (S0/S1)
    deferred: int  # trajectories whose clip made them wait for their group
    peak_stream_bytes: int
    fallback: str  # "" when streaming, else why the step trained as one batch
    skipped_nonfinite: bool = False  # a non-finite loss or gradient: no update was applied

    @property
    def version(self) -> int:
        """The policy_version this step's update produced."""
        return self.step + 1

    @property
    def stats(self) -> dict[str, float]:
        """`StepDone.stats`: the staleness policy's diagnostics."""
        return self.policy_stats

    def step_done(self, **extra: Any) -> StepDone:
        """The `StepDone` message of this step: every StepDone field this result has (a field or a
        property of the same name), plus `extra` (what only the service knows: timings, pool
        reports). A required StepDone field found in neither raises TypeError; one with a default
        (the pool reports) keeps it."""
        known = {
            name: getattr(self, name)
            for name in _STEP_DONE_FIELDS
            if name not in extra and hasattr(self, name)
        }
        return StepDone(**known, **extra)


# StepDone's field names, read once; a field added to the message is filled from a StepResult
# field or property of the same name, or must come from the service.
_STEP_DONE_FIELDS = tuple(f.name for f in msgspec.structs.fields(StepDone))
