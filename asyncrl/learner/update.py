"""The optimizer update of a learner step (no sockets): reduce, normalise, clip, step, guard.

Place in the data flow: once a step's work has left the summed per-trajectory loss gradient in
`.grad` (and the streamed groups' part in the step's accumulator), the trainer calls
`Updater.update`: the step's scalar sums are all-reduced across lockstep ranks (`reduce_sums`),
the gradient is divided by the global normaliser Z, clipped, the learning rate scaled (VCPO) and
the optimizer stepped, unless the loss or the gradient norm is not finite: the step is then
skipped and counted, and `max_nonfinite_steps` in a row raise `NonFiniteError`. With
`learner.epochs` E > 1 the step's reruns (`StepState.reruns`: the whole batch under the updated
model, same anchors, corrections and advantages) run E - 1 more times, each followed by a step.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from asyncrl.learner.state import StepState, StepTotals

log = logging.getLogger(__name__)

# Fault injection for tests: the steps whose gradient is poisoned with NaN ("all", or "3,5").
FAULT_ENV = "ASYNCRL_FAULT_NONFINITE"


class NonFiniteError(RuntimeError):
    """Training cannot go on: too many non-finite steps in a row, or a non-finite parameter."""


class StepSums(NamedTuple):
    """A step's scalar sums after the reduction across ranks."""

    units: float
    loss: float
    clipped: float
    tokens: float
    reward: float
    seqs: float
    staleness_sum: float
    distill_loss: float


def reduce_sums(totals: StepTotals, units_local: float, *, lockstep: bool, device: torch.device) -> StepSums:
    """The step's sums over every rank (the gradient itself was reduced by each backward)."""
    summed = torch.tensor(
        [
            units_local,
            totals.loss,
            totals.clipped_tokens,
            totals.tokens,
            totals.reward,
            totals.seqs,
            totals.staleness_sum,
            totals.distill_loss,
        ],
        dtype=torch.float64,
    )
    if lockstep:
        summed = summed.to(device)  # NCCL reduces device tensors only
        dist.all_reduce(summed)
        summed = summed.cpu()
    return StepSums(*summed.tolist())


def reduce_stats(totals: StepTotals, *, device: torch.device) -> dict[str, float]:
    """The step's token-weighted policy statistics summed over the lockstep ranks (each rank's
    rows weighted by its tokens), divided by the ranks' tokens: the token-weighted mean one rank
    reports over the whole batch. A statistic of the whole batch (`Engine.correct_rows`) is the
    same on every rank, so its mean is itself. Keys: every statistic any rank has (the policy's
    own, plus the KL estimate), in one fixed order on every rank; any other key stays this
    rank's own mean."""
    from asyncrl.staleness.base import CorrectionStats

    names = sorted({*CorrectionStats._fields, "kl"})
    local = torch.tensor(
        [[totals.stats.get(n, 0.0), float(n in totals.stats)] for n in names] + [[totals.stats_tokens, 1.0]],
        dtype=torch.float64,
    ).to(device)
    dist.all_reduce(local)
    local = local.cpu()
    tokens = max(float(local[-1, 0]), 1e-12)
    own = {k: v / max(totals.stats_tokens, 1e-12) for k, v in totals.stats.items() if k not in names}
    return own | {n: float(local[i, 0]) / tokens for i, n in enumerate(names) if local[i, 1] > 0}


class Updater:
    def __init__(
        self,
        params: Sequence[torch.Tensor],
        *,
        optimizer: str,
        lr: float,
        weight_decay: float,
        max_grad_norm: float,
        max_nonfinite_steps: int,
    ) -> None:
        self.params = list(params)
        self.lr = lr
        self.max_grad_norm = max_grad_norm
        self.max_nonfinite_steps = max_nonfinite_steps
        self.nonfinite_in_a_row = 0
        self.nonfinite_total = 0
        self.fault_steps = fault_steps(os.environ.get(FAULT_ENV, ""))
        if optimizer == "sgd":
            self.optimizer = torch.optim.SGD(self.params, lr=lr, weight_decay=weight_decay)
        else:
            self.optimizer = torch.optim.AdamW(
                self.params, lr=lr, weight_decay=weight_decay, betas=(0.9, 0.99)
            )

    def restore(self, *, nonfinite_total: int) -> None:
        """A checkpoint's count of skipped steps (the run goes on counting from it)."""
        self.nonfinite_total = nonfinite_total

    def update(
        self,
        state: StepState,
        *,
        scale: float,
        loss: float,
        epochs: int,
        denominator: Callable[[float], float] = lambda units: units,
    ) -> tuple[float, bool]:
        """Apply the step's update (then its later minibatches', each normalised by its own
        `denominator(units)`, and its later epochs); returns (the last gradient norm before
        clipping, whether every update was applied). Counts a skipped step."""
        grad_norm, applied = self._apply(state.step, scale, state.totals.lr_scale, loss)
        for backward, units in state.minibatches if applied else ():
            backward()
            z = denominator(units)
            grad_norm, applied = self._apply(
                state.step, 1.0 / z if z > 0 else 0.0, state.totals.lr_scale, loss
            )
            if not applied:
                break
        for _ in range(1, epochs if applied else 1):  # the same Z: the masks do not change
            for rerun in state.reruns:
                rerun()
            grad_norm, applied = self._apply(state.step, scale, state.totals.lr_scale, loss)
            if not applied:
                break
        self._count_nonfinite(state.step, applied, loss=loss * scale, grad_norm=grad_norm)
        return grad_norm, applied

    def _apply(self, step: int, scale: float, lr_scale: float, loss: float) -> tuple[float, bool]:
        """Scale the reduced gradient in `.grad`, clip, step; returns (the norm before clipping,
        whether the update was applied). A non-finite loss or norm skips the step: gradients are
        dropped, parameters and optimizer state stay as they were."""
        grads = [p.grad for p in self.params if p.grad is not None]
        if step in self.fault_steps:
            for g in grads:
                g.fill_(float("nan"))
        torch._foreach_mul_(grads, scale)
        norm_t = torch.nn.utils.get_total_norm(grads) if grads else None
        norm = _local(norm_t) if norm_t is not None else 0.0
        applied = math.isfinite(norm) and math.isfinite(loss)
        if applied:
            if norm_t is not None:
                torch.nn.utils.clip_grads_with_norm_(self.params, self.max_grad_norm, norm_t)
            for group in self.optimizer.param_groups:
                group["lr"] = self.lr * lr_scale
            self.optimizer.step()
            if not _all_finite(self.params):
                raise NonFiniteError(
                    f"step {step}: the optimizer step made a parameter non-finite; resume from the "
                    "last checkpoint with a lower learner.lr"
                )
        for p in self.params:
            p.grad = None
        return norm, applied

    def _count_nonfinite(self, step: int, applied: bool, *, loss: float, grad_norm: float) -> None:
        """Count a skipped step; too many in a row end the run (`NonFiniteError`): the weights are
        still those before the first of them, which the caller checkpoints."""
        if applied:
            self.nonfinite_in_a_row = 0
            return
        self.nonfinite_in_a_row += 1
        self.nonfinite_total += 1
        log.error(
            "step %d skipped: loss %s, gradient norm %s (%d in a row; learner.max_nonfinite_steps = %d)",
            step, loss, grad_norm, self.nonfinite_in_a_row, self.max_nonfinite_steps,
        )  # fmt: skip
        if self.nonfinite_in_a_row >= self.max_nonfinite_steps:
            raise NonFiniteError(
                f"{self.nonfinite_in_a_row} steps in a row had a non-finite loss or gradient (last: step "
                f"{step}, loss {loss}, gradient norm {grad_norm}); the checkpoint at version "
                f"{step + 1 - self.nonfinite_in_a_row} holds the weights before the first. Lower "
                "learner.lr, check the rewards and data, or raise learner.max_nonfinite_steps"
            )


def fault_steps(text: str) -> set[int] | _Every:
    """Steps whose gradient a test poisons with NaN: "" none, "all", or "3,5"."""
    text = text.strip()
    if text == "all":
        return _Every()
    return {int(x) for x in text.split(",") if x.strip()}


class _Every:
    def __contains__(self, step: object) -> bool:
        return True


def _local(t: torch.Tensor) -> float:
    return float(t.full_tensor() if isinstance(t, DTensor) else t)


def _all_finite(params: Sequence[torch.Tensor]) -> bool:
    """Every parameter finite, on every rank (this rank's shards, then an all-reduce)."""
    bad = torch.tensor(
        [sum(int(not bool(torch.isfinite(_shard(p)).all())) for p in params)],
        dtype=torch.int64,
        device=params[0].device,
    )
    if dist.is_initialized() and any(isinstance(p, DTensor) for p in params):
        dist.all_reduce(bad)
    return int(bad) == 0


def _shard(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if isinstance(p, DTensor) else p
