"""One learner step's state (no sockets, no model): what it has been offered, what waits, what
is done, and the sums its work has added up.

Place in the data flow: the `Trainer` (`trainer.py`) makes a `StepState` when a step begins and
drops it when the step's update is applied. The step's loop offers trajectories to it; the
step's plan (`plans.py`) reads it to decide the next unit of work; the work that runs a unit
(`rl_work.py`, `distill_work.py`) changes it only through the methods below (take what it trains,
add what it measured); the update (`update.py`) reads its totals. Nothing else holds step data.

Legend: B sequences, L packed length.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from asyncrl.learner.step import PackedBatch, TrainSample, staleness_B

if TYPE_CHECKING:
    from asyncrl.learner.objective import DistillStats
    from asyncrl.learner.streaming import StreamingAccumulator


class StalenessViolation(AssertionError):
    """A trajectory older than the configured bound reached the learner (an admission bug)."""


@dataclass
class StepTotals:
    """Per-step sums; the first seven (units .. staleness_sum) and `distill_loss` are all-reduced
    across ranks (`update.reduce_sums`)."""

    units: float = 0.0
    loss: float = 0.0
    clipped_tokens: float = 0.0
    tokens: float = 0.0
    reward: float = 0.0
    seqs: float = 0.0
    staleness_sum: float = 0.0
    max_staleness: int = 0
    stats_tokens: float = 0.0
    stats: dict[str, float] = field(default_factory=dict)
    lr_scale: float = 1.0
    streamed: int = 0
    deferred: int = 0
    distill_loss: float = 0.0  # the distillation term's part of `loss` (all-reduced with it)
    distill: DistillStats | None = None  # the distillation term's figures (this rank's)

    def add_samples(self, samples: Sequence[TrainSample], stale_B: torch.Tensor) -> None:
        self.reward += sum(s.reward for s in samples)
        self.seqs += len(samples)
        self.staleness_sum += float(stale_B.sum())
        self.max_staleness = max(self.max_staleness, int(stale_B.max()))

    def add_distill(self, stats: DistillStats) -> None:
        """A distillation term's figures: its loss (already in `loss`) and its selection counts."""
        self.distill_loss += stats.loss
        self.distill = stats if self.distill is None else self.distill.plus(stats)

    def add_stats(self, stats: dict[str, float], tokens: float) -> None:
        for k, v in stats.items():
            if math.isfinite(v):
                self.stats[k] = self.stats.get(k, 0.0) + v * tokens
        self.stats_tokens += tokens


class StepState:
    """Everything one step knows about its trajectories. Plans read the public fields; work
    changes them only through the methods (`offer`, `take_*`, `defer`, `add_*`, `account`)."""

    def __init__(
        self,
        step: int,
        *,
        group_size: int,
        window_groups: int | None,
        max_staleness: int,
        acc: StreamingAccumulator | None = None,
    ) -> None:
        self.step = step  # the policy_version the step trains at
        self.group_size = group_size
        # How many groups the step will offer (None: unknown, e.g. the pool). Lockstep plans train
        # a step's last, shorter chunk once that many are in.
        self.window_groups = window_groups
        self.max_staleness = max_staleness
        self.members: dict[int, list[TrainSample]] = defaultdict(list)  # every offered, by group
        self.waiting: dict[int, list[TrainSample]] = defaultdict(list)  # offered, not trained yet
        self.completed: list[int] = []  # group ids in the order their last member was offered
        self.arrivals: list[TrainSample] = []  # every offered trajectory, in offer order
        self.trained_groups = 0  # lockstep: complete groups trained, a prefix of `completed`
        self.trained_arrivals = 0  # lockstep: trajectories trained, a prefix of `arrivals`
        self.deferred: set[int] = set()  # traj ids that tried to stream and wait for their group
        # gid -> (slot, l(+1), reward) of its streamed members, valued once its advantages are known.
        self.streamed_loss: dict[int, list[tuple[int, float, float]]] = defaultdict(list)
        # The optimal baseline's step-start log-probs [1, L_i] of each trajectory, for its lr scale.
        self.opob_logp: list[tuple[TrainSample, torch.Tensor]] = []
        # What a later epoch re-runs (learner.epochs > 1): the whole-batch work appends it.
        self.reruns: list[Callable[[], object]] = []
        # Minibatches after the first (learner.minibatches): (backward, its global units), each
        # followed by its own optimizer update.
        self.minibatches: list[tuple[Callable[[], object], float]] = []
        self.acc = acc  # the group S0/S1 sums while grouped trajectories stream; else None
        self.totals = StepTotals()

    # ------------------------------------------------------------------ offers and takes
    def offer(self, sample: TrainSample) -> None:
        self.members[sample.group_id].append(sample)
        self.waiting[sample.group_id].append(sample)
        self.arrivals.append(sample)
        if len(self.members[sample.group_id]) == self.size_of(sample.group_id):
            self.completed.append(sample.group_id)

    def size_of(self, gid: int) -> int:
        """Group `gid`'s size: its members' (rollout budgets make them differ), else group_size."""
        members = self.members.get(gid)
        return (members[0].group_size if members else 0) or self.group_size

    def num_waiting(self) -> int:
        """Trajectories offered and not trained yet."""
        return sum(len(w) for w in self.waiting.values())

    def any_waiting(self) -> bool:
        return any(self.waiting.values())

    def closable(self) -> list[int]:
        """Complete groups with members still waiting (their advantages are known now)."""
        return [g for g, w in self.waiting.items() if w and len(self.members[g]) == self.size_of(g)]

    def sorted_members(self, gid: int) -> list[TrainSample]:
        return sorted(self.members[gid], key=lambda s: s.sample_index)

    def take(self, samples: Sequence[TrainSample]) -> None:
        """These waiting trajectories are being trained (by any unit)."""
        for s in samples:
            self.waiting[s.group_id].remove(s)

    def take_groups(self, gids: Sequence[int]) -> list[TrainSample]:
        """Every waiting member of these groups, in waiting order; the groups stop waiting."""
        return [s for g in gids for s in self.waiting.pop(g, [])]

    def mark_groups_trained(self, count: int) -> None:
        self.trained_groups += count

    def mark_arrivals_trained(self, count: int) -> None:
        self.trained_arrivals += count

    def defer(self, sample: TrainSample) -> None:
        """`sample` cannot stream on its own (a clip binds for one sign): it waits for its group."""
        self.deferred.add(sample.traj_id)
        self.totals.deferred += 1

    # ------------------------------------------------------------------ what the work measured
    def add_loss(self, value: float) -> None:
        self.totals.loss += value

    def add_units(self, value: float) -> None:
        self.totals.units += value

    def add_distill(self, stats: DistillStats) -> None:
        self.totals.add_distill(stats)

    def set_lr_scale(self, value: float) -> None:
        self.totals.lr_scale = value

    def set_stat(self, name: str, token_weighted_sum: float) -> None:
        self.totals.stats[name] = token_weighted_sum

    def note_streamed(self, sample: TrainSample, loss_pos: float, *, on_arrival: bool) -> None:
        """A trajectory went into its group's sums with loss value l(+1)."""
        self.streamed_loss[sample.group_id].append((sample.sample_index, loss_pos, sample.reward))
        self.totals.streamed += int(on_arrival)

    def pop_streamed_loss(self, gid: int) -> list[tuple[int, float, float]]:
        return self.streamed_loss.pop(gid, [])

    def keep_opob_logp(self, sample: TrainSample, logp_1L: torch.Tensor) -> None:
        self.opob_logp.append((sample, logp_1L))

    def add_rerun(self, rerun: Callable[[], object]) -> None:
        self.reruns.append(rerun)

    def add_minibatch(self, backward: Callable[[], object], units_global: float) -> None:
        self.minibatches.append((backward, units_global))

    def account(
        self,
        batch: PackedBatch,
        samples: Sequence[TrainSample],
        stats: dict[str, float],
        *,
        tokens: float,
        clipped: float,
    ) -> None:
        """Add trained samples to the step's totals, asserting the staleness bound."""
        stale_B = staleness_B(batch, self.step).cpu()
        # A down-weighted group (buffer.action = "downweight") is past the bound by design.
        bounded_B = torch.tensor([s.weight == 1.0 for s in samples])
        if bool(bounded_B.any()) and int(stale_B[bounded_B].max()) > self.max_staleness:
            raise StalenessViolation(
                f"step {self.step}: a trajectory is {int(stale_B.max())} versions stale, above the bound "
                f"{self.max_staleness}"
            )
        self.totals.add_samples(samples, stale_B)
        self.totals.tokens += tokens
        self.totals.clipped_tokens += clipped
        self.totals.add_stats(stats, tokens)
