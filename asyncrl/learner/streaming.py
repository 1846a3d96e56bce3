"""Gradient streaming (pure): per-trajectory score gradients in, the step's flat gradient out.

Place in the data flow: the learner service takes a finished trajectory (with its reward, or its
teacher scores for OPD) as soon as it arrives, runs one forward and one backward on it with
data-parallel gradient sync off (`trajectory_score_gradient`), and hands the flat gradient h_i to
`StreamingAccumulator.add_trajectory`. When a group's last sample arrives its running sums are
folded into the step sum and freed. At the step boundary the caller all-reduces the unit count
(one scalar) and, after `finish`, the flat gradient (once), writes it into `.grad`
(`write_flat_grad`), clips and steps the optimizer. Nothing here talks to other processes.

Legend: P flattened parameter count, T tokens of one trajectory (prompt + completion), N samples
per group.

Math (ALGORITHMS.md 5.1-5.6). At the step's parameters the ratio is 1, the PPO clip is inactive
and the batch gradient is  grad L = -(1/Z) sum_i A_i h_i  with  h_i = grad sum_t c_t logp_t.
The per-token weight c_t and the denominator Z depend on the aggregation mode (`losses.AGG_MODES`):

    mode                       c_t (`token_weight`)    Z
    token-mean                 1                       kept completion tokens (global)
    seq-mean-token-mean        1 / max(|o_i|, 1)       kept sequences (global)
    seq-mean-token-sum         1                       kept sequences (global)
    seq-mean-token-sum-norm    1                       `norm_constant` (Dr. GRPO: max length)

For OPD the advantage is per token, A_t = logp_teacher_t - sg(logp_t) (times the importance
weight pi/mu at the step start), so the caller backpropagates sum_t c_t A_t w_t logp_t and h_i is
already the trajectory's whole contribution: no group buffer.

Group estimators. With the group's first reward p as a pivot (it makes a degenerate group's
sums exactly zero and keeps the fold well conditioned), S0 = sum h_i, S1 = sum (r_i - p) h_i and
    grpo     sum_i A_i h_i = (S1 + (p - mu) S0) / (sigma + eps)        2 buffers per open group
    dr_grpo  sum_i A_i h_i = S1 + (p - mu) S0                          1 buffer: S1 goes straight
    rloo     sum_i A_i h_i = N/(N-1) (S1 + (p - mu) S0)                  into the step sum
mu and sigma are the group's reward mean and std with the same `unbiased`/`eps` as
`advantages.grpo_advantages`; as there, a group whose rewards are all equal (or a group of one)
has A = 0 exactly. With `drop_degenerate_groups` (DAPO dynamic sampling) such a group is dropped
at fold time: its tokens and sequences do not count in Z.

Off-policy optimal baseline (`baseline="opob"`, VCPO, ALGORITHMS.md 2.2 and 5.3). The group mean
mu is replaced by b = sum_i W_i r_i / sum_i W_i with W_i = ||h_i||^2 (times a per-trajectory
`baseline_scale`, 1 for the proposal; the released code's L_i^2 w_i^2 for "opob_released"),
recorded from h_i on arrival, before h_i enters the sums. The fold is the same with b for mu:
    grpo     sum_i (r_i - b) / (sigma + eps) h_i = (S1 + (p - b) S0) / (sigma + eps)
    dr_grpo  sum_i (r_i - b) h_i                = S1 + (p - b) S0
so an open group holds the same buffers as with the mean, plus one float per member. It needs
every member's own h_i: `close_with_known` (members trained together) is refused. The common
factor 1/(sigma + eps) of the g_i = h_i/(sigma + eps) that multiplies (r_i - b) cancels in b.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Literal, NamedTuple, get_args

import torch

from asyncrl.kernels.logprobs import causal_lm_logprobs
from asyncrl.learner.advantages import GRPO_EPS
from asyncrl.learner.losses import check_agg_mode
from asyncrl.staleness.vcpo import opob_baseline

Estimator = Literal["grpo", "dr_grpo", "rloo", "opd"]
ESTIMATORS: tuple[str, ...] = get_args(Estimator)
# Parameter-sized buffers an open group holds, per estimator (ALGORITHMS.md 5.3); the same with
# the off-policy optimal baseline, which adds one float per member.
BUFFERS_PER_OPEN_GROUP = {"grpo": 2, "dr_grpo": 1, "rloo": 1, "opd": 0}
Baseline = Literal["mean", "opob"]
# Estimators whose baseline the optimal baseline replaces (RLOO's is leave-one-out).
OPOB_ESTIMATORS = ("grpo", "dr_grpo")


class OpenGroupLimitError(RuntimeError):
    """A trajectory of a new group arrived while `max_open_groups` groups were open (back-pressure)."""


class GroupFold(NamedTuple):
    group_id: Hashable
    kept: bool  # False: dropped as degenerate, tokens and sequences not counted in Z
    degenerate: bool  # all rewards equal (or a single sample): zero advantage
    num_samples: int
    reward_mean: float
    reward_std: float  # with the accumulator's `unbiased` choice; 0 for a single sample
    baseline: float = math.nan  # the b the fold used: the mean, or the optimal baseline


class StreamStats(NamedTuple):
    num_trajectories: int
    num_groups_kept: int
    num_groups_dropped: int
    num_tokens: int  # completion tokens of kept trajectories (local)
    num_seqs: int  # kept trajectories (local)
    denominator: float  # Z used by `finish`
    peak_memory_bytes: int  # open-group buffers plus the step sum, high-water mark this step


@dataclass
class _OpenGroup:
    pivot: float
    rewards: list[float] = field(default_factory=list)
    s0_P: torch.Tensor | None = None
    s1_P: torch.Tensor | None = None  # grpo only; allocated when a reward differs from the pivot
    num_tokens: int = 0
    weights: list[float] = field(default_factory=list)  # opob: W_i per streamed member
    size: int | None = None  # its members (rollout budgets: each group its own); None: group_size


def token_weight(mode: str, num_tokens: int) -> float:
    """c_t of every completion token of a trajectory with `num_tokens` tokens (see module docstring)."""
    check_agg_mode(mode)
    if mode == "seq-mean-token-mean":
        return 1.0 / max(num_tokens, 1)
    return 1.0


class StreamingAccumulator:
    """Running sums for one optimizer step of streamed per-trajectory gradients.

    Feed `add_trajectory` in any arrival order; every group closes by itself when its
    `group_size`-th sample arrives; `finish` returns the step gradient and resets for the next step.
    Buffers are flat, parameter-sized, in `dtype` (float32 by default, float64 for exactness tests).
    The fold computes mu and sigma from the rewards in float64.

    With data parallelism every sample of a group must go to the same rank (the scheduler's
    prompt-major dispatch); splitting a group would need its mu and sigma broadcast first.
    `max_open_groups` bounds the open-group buffers at `max_open_groups * BUFFERS_PER_OPEN_GROUP
    * buffer_bytes`; `free_group_slots` is the matching credit count for the scheduler.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor],
        *,
        estimator: Estimator = "grpo",
        agg: str = "token-mean",
        group_size: int | None = None,
        eps: float = GRPO_EPS,
        unbiased: bool = True,
        drop_degenerate_groups: bool = False,
        max_open_groups: int | None = None,
        norm_constant: float | None = None,
        dtype: torch.dtype = torch.float32,
        baseline: Baseline = "mean",
    ) -> None:
        if estimator not in ESTIMATORS:
            raise ValueError(f"unknown estimator {estimator!r}; valid: {', '.join(ESTIMATORS)}")
        if baseline not in ("mean", "opob"):
            raise ValueError(f"unknown baseline {baseline!r}; valid: mean, opob")
        if baseline == "opob" and estimator not in OPOB_ESTIMATORS:
            raise ValueError(
                f"the optimal baseline replaces the group mean of {', '.join(OPOB_ESTIMATORS)}, not {estimator!r}"
            )
        check_agg_mode(agg)
        if estimator != "opd" and (group_size is None or group_size < 1):
            raise ValueError(f"estimator {estimator!r} needs group_size >= 1, got {group_size}")
        if eps < 0:
            raise ValueError(f"eps must be >= 0, got {eps}")
        if max_open_groups is not None and max_open_groups < 1:
            raise ValueError(f"max_open_groups must be >= 1 or None, got {max_open_groups}")
        if agg == "seq-mean-token-sum-norm" and (norm_constant is None or norm_constant <= 0):
            raise ValueError(f"agg {agg!r} needs norm_constant > 0, got {norm_constant}")
        if estimator == "opd" and drop_degenerate_groups:
            raise ValueError("drop_degenerate_groups needs a group estimator, not 'opd'")
        params = list(params)
        if not params:
            raise ValueError("params is empty")
        self.num_params = sum(p.numel() for p in params)
        self.device = params[0].device
        self.dtype = dtype
        self.estimator = estimator
        self.agg = agg
        self.group_size = group_size
        self.eps = eps
        self.unbiased = unbiased
        self.drop_degenerate_groups = drop_degenerate_groups
        self.max_open_groups = max_open_groups
        self.norm_constant = norm_constant
        self.baseline = baseline
        self._open: dict[Hashable, _OpenGroup] = {}
        self._reset_step()

    def _reset_step(self) -> None:
        self._closed: set[Hashable] = set()  # groups folded this step: a late sample is an error
        self._acc_P: torch.Tensor | None = None
        self._num_trajectories = 0
        self._num_groups_kept = 0
        self._num_groups_dropped = 0
        self._num_tokens = 0
        self._num_seqs = 0
        self._peak_bytes = 0

    # -- accounting ---------------------------------------------------------------------------

    @property
    def buffer_bytes(self) -> int:
        """Size of one flat parameter-sized buffer."""
        return self.num_params * self.dtype.itemsize

    @property
    def memory_bytes(self) -> int:
        """Bytes held by the buffers of open groups."""
        return self.buffer_bytes * sum(
            (g.s0_P is not None) + (g.s1_P is not None) for g in self._open.values()
        )

    @property
    def total_memory_bytes(self) -> int:
        """Open-group buffers plus the step sum."""
        return self.memory_bytes + (self.buffer_bytes if self._acc_P is not None else 0)

    @property
    def num_open_groups(self) -> int:
        return len(self._open)

    @property
    def free_group_slots(self) -> int | None:
        """How many more groups may open now (credits for the scheduler); None if unbounded."""
        if self.max_open_groups is None:
            return None
        return self.max_open_groups - len(self._open)

    @property
    def num_tokens(self) -> int:
        """Completion tokens of kept trajectories so far this step (local to this rank)."""
        return self._num_tokens

    @property
    def num_seqs(self) -> int:
        """Kept trajectories so far this step (local to this rank)."""
        return self._num_seqs

    @property
    def num_units(self) -> int:
        """The local count whose global sum is Z: tokens for token-mean, sequences otherwise.

        For seq-mean-token-sum-norm Z is `norm_constant` and this count is not used.
        """
        return self._num_tokens if self.agg == "token-mean" else self._num_seqs

    def is_open(self, group_id: Hashable) -> bool:
        return group_id in self._open

    def _track_peak(self) -> None:
        self._peak_bytes = max(self._peak_bytes, self.total_memory_bytes)

    # -- accumulation -------------------------------------------------------------------------

    def _step_sum(self) -> torch.Tensor:
        if self._acc_P is None:
            self._acc_P = torch.zeros(self.num_params, dtype=self.dtype, device=self.device)
            self._track_peak()
        return self._acc_P

    def _count(self, num_tokens: int, num_seqs: int) -> None:
        self._num_tokens += num_tokens
        self._num_seqs += num_seqs

    def add_trajectory(
        self,
        h_P: torch.Tensor,
        *,
        num_tokens: int,
        group_id: Hashable | None = None,
        reward: float | None = None,
        baseline_scale: float = 1.0,
        group_size: int | None = None,
    ) -> GroupFold | None:
        """Add h_i = grad sum_t c_t logp_t (see `token_weight`; OPD: c_t A_t w_t) of one trajectory.

        `num_tokens` counts its completion tokens. Group estimators need `group_id` and `reward`;
        OPD takes neither. With the optimal baseline, W_i = ||h_i||^2 * `baseline_scale`.
        `group_size`: this group's own size (rollout budgets; None: the accumulator's).
        Returns the fold record when this sample closes its group.
        Raises `OpenGroupLimitError` (and changes nothing) when it would open one group too many.
        """
        if h_P.shape != (self.num_params,):
            raise ValueError(f"h_P must be flat with {self.num_params} elements, got {tuple(h_P.shape)}")
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        if self.estimator == "opd":
            if group_id is not None or reward is not None:
                raise ValueError("estimator 'opd' takes no group_id or reward (advantages are per token)")
            self._step_sum().add_(h_P)
            self._num_trajectories += 1
            self._count(num_tokens, 1)
            return None
        if group_id is None or reward is None:
            raise ValueError(f"estimator {self.estimator!r} needs group_id and reward")
        if not math.isfinite(reward):
            raise ValueError(f"reward must be finite, got {reward} (group {group_id!r})")
        if group_id in self._closed:
            raise ValueError(f"group {group_id!r} already closed this step")
        group = self._open.get(group_id)
        if group is None:
            if self.max_open_groups is not None and len(self._open) >= self.max_open_groups:
                raise OpenGroupLimitError(
                    f"{len(self._open)} groups open (max_open_groups={self.max_open_groups}); "
                    f"cannot open group {group_id!r} until one closes"
                )
            group = self._open[group_id] = _OpenGroup(pivot=float(reward), size=group_size)
        self._num_trajectories += 1
        group.rewards.append(float(reward))
        group.num_tokens += num_tokens
        if self.baseline == "opob":  # before h_i enters the sums (it may be added in place)
            if not (math.isfinite(baseline_scale) and baseline_scale >= 0):
                raise ValueError(f"baseline_scale must be finite and >= 0, got {baseline_scale}")
            group.weights.append(float(h_P.double().square().sum()) * baseline_scale)
        if group.s0_P is None:
            group.s0_P = h_P.to(dtype=self.dtype, copy=True)
        else:
            group.s0_P.add_(h_P)
        shift = float(reward) - group.pivot
        if shift != 0.0:
            if self.estimator == "grpo":
                if group.s1_P is None:
                    group.s1_P = torch.zeros_like(group.s0_P)
                group.s1_P.add_(h_P, alpha=shift)
            else:
                self._step_sum().add_(h_P, alpha=self._mean_baseline_scale(group) * shift)
        self._track_peak()
        if len(group.rewards) == self._size(group):
            return self._fold(group_id)
        return None

    def close_with_known(
        self,
        group_id: Hashable,
        rewards: Sequence[float],
        *,
        num_tokens: int,
        group_size: int | None = None,
    ) -> GroupFold:
        """Close a group with its last members, whose advantages the caller computes from the
        group's complete rewards (the streamed members' plus `rewards`).

        The caller keeps sum_{these members} A_i h_i itself (the learner trains them in one batched
        backward into `.grad`, with any other closing groups) and adds it to `finish`'s result;
        `num_tokens` counts these members' completion tokens. The group's streamed members (if
        any) fold as usual. This is how the learner takes members that arrive together with their
        group's last reward, or that could not stream on their own, without a backward per
        trajectory.
        """
        if self.estimator == "opd":
            raise ValueError("estimator 'opd' has no groups")
        if self.baseline == "opob":
            raise ValueError(
                "the optimal baseline needs every member's own gradient norm: add each with add_trajectory"
            )
        if group_id in self._closed:
            raise ValueError(f"group {group_id!r} already closed this step")
        group = self._open.get(group_id)
        if group is None:
            if not rewards:
                raise ValueError(f"group {group_id!r}: no rewards")
            group = self._open[group_id] = _OpenGroup(pivot=float(rewards[0]), size=group_size)
        if len(group.rewards) + len(rewards) != self._size(group):
            raise ValueError(
                f"group {group_id!r}: {len(group.rewards)} streamed + {len(rewards)} known members, "
                f"expected {self._size(group)}"
            )
        if not all(math.isfinite(r) for r in rewards):
            raise ValueError(f"rewards must be finite (group {group_id!r})")
        group.rewards.extend(float(r) for r in rewards)
        group.num_tokens += num_tokens
        self._num_trajectories += len(rewards)
        return self._fold(group_id)

    def _size(self, group: _OpenGroup) -> int | None:
        return group.size or self.group_size

    def _mean_baseline_scale(self, group: _OpenGroup) -> float:
        # RLOO: r_i - mean of the others = N/(N-1) (r_i - mu), N the group's own size. A group of
        # one is degenerate (A = 0).
        size = self._size(group)
        if self.estimator == "rloo" and size is not None and size > 1:
            return size / (size - 1)
        return 1.0

    def _fold(self, group_id: Hashable) -> GroupFold:
        # The group stays in `_open` until folded, so the peak accounts for it and the step sum.
        group = self._open[group_id]
        rewards_N = torch.tensor(group.rewards, dtype=torch.float64)
        num_samples = len(group.rewards)
        mean = float(rewards_N.mean())
        std = float(rewards_N.std(unbiased=self.unbiased)) if num_samples > 1 else 0.0
        degenerate = all(r == group.pivot for r in group.rewards)
        baseline = mean
        if self.baseline == "opob":
            weights_N = torch.tensor(group.weights, dtype=torch.float64)
            baseline = float(opob_baseline(weights_N, rewards_N))
        kept = not (degenerate and self.drop_degenerate_groups)
        if kept:
            self._num_groups_kept += 1
            self._count(group.num_tokens, num_samples)
        else:
            self._num_groups_dropped += 1
        # Degenerate: every shift was 0, so S1 was never allocated and (for mean-only baselines)
        # nothing reached the step sum; A = 0 exactly, as in the batch estimators.
        if not degenerate and group.s0_P is not None:  # None: no member was streamed
            acc_P = self._step_sum()
            if self.estimator == "grpo":
                scale = 1.0 / (std + self.eps)
                if group.s1_P is not None:
                    acc_P.add_(group.s1_P, alpha=scale)
                acc_P.add_(group.s0_P, alpha=scale * (group.pivot - baseline))
            else:
                acc_P.add_(group.s0_P, alpha=self._mean_baseline_scale(group) * (group.pivot - baseline))
        del self._open[group_id]
        self._closed.add(group_id)
        return GroupFold(group_id, kept, degenerate, num_samples, mean, std, baseline)

    def finish(self, num_units_global: float | None = None) -> tuple[torch.Tensor, StreamStats]:
        """The step's flat loss gradient -sum_i A_i h_i / Z, and stats; then reset for the next step.

        `num_units_global` is Z for token-mean / seq-mean-*: the all-reduced `num_units` of every
        rank (default: this rank's count, i.e. single process). With data parallelism each rank
        returns its partial gradient over the global Z; their all-reduce SUM is the full gradient.
        Ignored for seq-mean-token-sum-norm, whose Z is `norm_constant`. Every group must be closed:
        a step must contain whole groups (the gradients of one step share one set of parameters).
        A step with no kept units returns a zero gradient.
        """
        if self._open:
            raise RuntimeError(
                f"{len(self._open)} groups still open at the step boundary: {list(self._open)[:5]}"
            )
        if self.agg == "seq-mean-token-sum-norm":
            assert self.norm_constant is not None
            denominator = float(self.norm_constant)
        else:
            denominator = float(self.num_units if num_units_global is None else num_units_global)
        if denominator < 0:
            raise ValueError(f"num_units_global must be >= 0, got {num_units_global}")
        grad_P = self._step_sum()
        if denominator > 0:
            grad_P.mul_(-1.0 / denominator)
        else:
            grad_P.zero_()
        stats = StreamStats(
            num_trajectories=self._num_trajectories,
            num_groups_kept=self._num_groups_kept,
            num_groups_dropped=self._num_groups_dropped,
            num_tokens=self._num_tokens,
            num_seqs=self._num_seqs,
            denominator=denominator,
            peak_memory_bytes=self._peak_bytes,
        )
        self._reset_step()
        return grad_P, stats


# -- parameter plumbing (flat gradient <-> .grad) -----------------------------------------------


def flatten_grads(params: Sequence[torch.Tensor], *, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Concatenate the parameters' `.grad` into one flat vector (zeros for parameters without one)."""
    pieces = [
        (p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).to(dtype or p.dtype)
        for p in params
    ]
    return torch.cat(pieces)


def write_flat_grad(params: Sequence[torch.Tensor], grad_P: torch.Tensor) -> None:
    """Set each parameter's `.grad` to its slice of `grad_P` (copied, in the parameter's dtype)."""
    numel = sum(p.numel() for p in params)
    if grad_P.shape != (numel,):
        raise ValueError(f"grad_P must be flat with {numel} elements, got {tuple(grad_P.shape)}")
    offset = 0
    for p in params:
        piece = grad_P[offset : offset + p.numel()].reshape(p.shape)
        p.grad = piece.to(dtype=p.dtype, device=p.device, copy=True)
        offset += p.numel()


@contextlib.contextmanager
def grad_sync_disabled(model: torch.nn.Module) -> Iterator[None]:
    """No data-parallel gradient sync inside: DDP `no_sync()`, FSDP2 `set_requires_gradient_sync`.

    A plain module needs nothing. The step's single all-reduce happens after `finish`.
    """
    if hasattr(model, "no_sync"):
        with model.no_sync():
            yield
    elif hasattr(model, "set_requires_gradient_sync"):
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)
    else:
        yield


def trajectory_score_gradient(
    model: torch.nn.Module,
    params: Sequence[torch.Tensor],
    input_ids_T: torch.Tensor,
    mask_T: torch.Tensor,
    weight_T: torch.Tensor | Callable[[torch.Tensor], torch.Tensor],
    *,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """h = grad_params sum_t c_t logp_t for one trajectory: one forward, one backward, DP sync off.

    `input_ids_T` is prompt + completion; `mask_T` (bool, aligned with it) marks completion tokens
    (position 0 never is). `weight_T` is c_t (e.g. `token_weight(...)` at every position), or a
    function of the detached log-probs returning it (OPD: c * (logp_teacher - logp)). The
    parameters' `.grad` is used as scratch and left as None.
    """
    if mask_T.dtype != torch.bool:
        raise ValueError(f"mask_T must be bool, got {mask_T.dtype}")
    if bool(mask_T[0]):
        raise ValueError("mask_T[0] must be False: the first token has no prefix to predict it from")
    for p in params:
        p.grad = None
    with grad_sync_disabled(model):
        logp_T = causal_lm_logprobs(
            model, input_ids_T[None], temperature=temperature, chunk_size=chunk_size
        ).logp[0]
        coef_T = weight_T(logp_T.detach()) if callable(weight_T) else weight_T
        # Clean both factors: a -inf teacher score at a prompt position must not become 0 * inf.
        coef_T = torch.where(mask_T, coef_T.detach(), 0.0)
        objective = (coef_T * torch.where(mask_T, logp_T, 0.0)).sum()
        objective.backward()
    h_P = flatten_grads(params, dtype=dtype)
    for p in params:
        p.grad = None
    return h_P
