"""Rollout budgets (pure): how many samples each admitted group gets (`sampling.budget`).

Place in the data flow: the dispatcher (`scheduler/dispatch.py`) asks `Budget.sizes` for the
groups it admits, once their prompts are chosen, and puts each size on the group's PromptTask
(`num_samples`); the generator samples that many, and the learner trains each group over its own
members (advantages and streaming per group).

  fixed (the default): every group gets learner.samples_per_group, today's behaviour.
  uncertainty: each step's B x N samples (learner.groups_per_step x samples_per_group, the same
      sample budget as fixed) are split over its B groups. A group's weight is the posterior
      standard deviation of its prompt's pass rate under the Beta record (`prompt_stats.py`),
      w = sqrt(Var p) = sqrt(m (1 - m) / (a + b + 1)), m = a / (a + b): p (1 - p) at the estimate
      over the evidence, so largest for prompts seen little or near p = 1/2, small for prompts
      estimated solved or hopeless on many samples. The groups admitted
      together for a step get their share of what the step has left, T = round(R c / m)
      (R samples left, m groups left, c admitted now; clamped so the rest still fits), and T is
      dealt out from budget_min each: every further sample goes to the group with the largest
      w / (n + 1), the first on a tie, up to budget_max. Equal weights give every group N.

Deterministic given the record and the admission order; the sizes of groups admitted and not
trained are checkpointed (with the selection state), so a resume re-admits a group with the size
it had and gives a step's new groups exactly what the step has left.
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def posterior_std(a: float, b: float) -> float:
    """The standard deviation of p under Beta(a, b)."""
    return math.sqrt(a * b / ((a + b) ** 2 * (a + b + 1)))


def deal(total: int, weights: Sequence[float], *, lo: int, hi: int) -> list[int]:
    """`total` samples over groups of `weights`: lo each, then one by one to the largest
    w / (n + 1) below hi (the first on a tie). ValueError when total does not fit."""
    count = len(weights)
    if not count * lo <= total <= count * hi:
        raise ValueError(f"cannot deal {total} samples to {count} groups of {lo}..{hi}")
    sizes = [lo] * count
    for _ in range(total - count * lo):
        best = max(
            (i for i in range(count) if sizes[i] < hi), key=lambda i: (weights[i] / (sizes[i] + 1), -i)
        )
        sizes[best] += 1
    return sizes


class Budget:
    """Each group's size; `sizes` maps every group admitted and not trained to its size."""

    def __init__(
        self, *, groups_per_step: int, samples_per_group: int, lo: int, hi: int, adaptive: bool
    ) -> None:
        self.groups_per_step, self.samples_per_group = groups_per_step, samples_per_group
        self.lo, self.hi, self.adaptive = lo, hi, adaptive
        self.sizes: dict[int, int] = {}
        self.readmitted: dict[int, int] = {}  # resume: group id -> the size it had

    @property
    def stride(self) -> int:
        """traj ids are group_id * stride + sample_index (PromptTask.sample_stride; 0 = num_samples)."""
        return self.hi if self.adaptive else 0

    def allocate(self, groups: Sequence[int], weights: Sequence[float]) -> list[int]:
        """The size of each of `groups` (admitted now, with their prompts' weights), recorded."""
        if not self.adaptive:
            return [self.samples_per_group] * len(groups)
        out = [self.readmitted.pop(j, 0) for j in groups]
        for j, n in zip(groups, out, strict=True):
            if n:
                self.sizes[j] = n
        fresh = [k for k, n in enumerate(out) if not n]
        for step in sorted({groups[k] // self.groups_per_step for k in fresh}):
            mine = [k for k in fresh if groups[k] // self.groups_per_step == step]
            for k, n in zip(mine, self._share(step, [weights[k] for k in mine]), strict=True):
                out[k] = self.sizes[groups[k]] = n
        return out

    def _share(self, step: int, weights: Sequence[float]) -> list[int]:
        """What the step has left, its share for these new groups, dealt by weight."""
        first = step * self.groups_per_step
        taken = [n for j, n in self.sizes.items() if first <= j < first + self.groups_per_step]
        left = self.groups_per_step * self.samples_per_group - sum(taken)
        groups_left = self.groups_per_step - len(taken)
        count, rest = len(weights), groups_left - len(weights)
        share = (2 * left * count + groups_left) // (2 * groups_left)
        share = max(
            count * self.lo, left - rest * self.hi, min(share, count * self.hi, left - rest * self.lo)
        )
        return deal(share, weights, lo=self.lo, hi=self.hi)

    def trained(self, groups: Sequence[int]) -> None:
        for j in groups:
            self.sizes.pop(j, None)

    def restore(self, sizes: dict[int, int]) -> None:
        self.sizes, self.readmitted = {}, {int(j): int(n) for j, n in sizes.items()}
