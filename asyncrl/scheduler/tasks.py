"""The launcher's book of prompt tasks (pure): open PromptTasks, the re-queue, and the ledger.

Place in the data flow: the launcher's dispatcher (`scheduler/dispatch.py`) admits a group
(`admit`) and sends its PromptTask to a generator (`dispatched`); the launcher
(`scheduler/service.py`) hears TaskDone (`done`) and StepDone (`trained`, via the admission mode,
`scheduler/modes.py`), and reports a generator's death (`generator_failed`, which re-queues its
in-flight tasks exactly once: a second report of the same death finds nothing in flight).
Re-queued tasks are handed out again (`pop_requeued`) before any new group is admitted; they are
the same PromptTask, so the re-run produces the same traj_ids (`group_id * num_samples +
sample_index`) and the learner keeps the first copy of any sample the dead generator had already
pushed.

The launcher never sees trajectories, only counts. What it knows:
  * TaskDone(task): every sample of the group was pushed to the learner -> those trajectories
    are recorded as generated (live, pending until trained);
  * StepDone(step): the learner trained groups [step * B, (step + 1) * B), and a step trains only
    on a full window of B * N distinct traj_ids, so it trained each of their N samples exactly
    once (rollout budgets: each group its own size n_j, summing to B * N over the step) -> every one of those trajectories is recorded as trained.
StepDone may come before the TaskDone of a group in it (different sockets; or the generator died
after pushing its samples and the task was re-queued); the ledger accepts that order.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

from asyncrl.buffer.ledger import Ledger, LedgerSummary
from asyncrl.messages import PromptTask

if TYPE_CHECKING:
    from asyncrl.config import Config


class TaskBook:
    """Open tasks (admitted, not yet done), the re-queue, and a `Ledger` of every event."""

    def __init__(
        self, *, groups_per_step: int, samples_per_group: int, sizes: tuple[int, int] | None = None
    ) -> None:
        """`sizes`: rollout budgets (sampling.budget = "uncertainty"), each group's size in
        lo..hi and traj ids `group_id * hi + sample_index`; None: every group samples_per_group."""
        if groups_per_step <= 0 or samples_per_group <= 0:
            raise ValueError("groups_per_step and samples_per_group must be > 0")
        self.groups_per_step = groups_per_step
        self.samples_per_group = samples_per_group
        self.size_range = sizes or (samples_per_group, samples_per_group)
        self.stride = sizes[1] if sizes else 0  # PromptTask.sample_stride
        self.sizes: dict[int, int] = {}  # group id -> its size, admitted and not trained
        self.ledger = Ledger()
        self.open: dict[int, PromptTask] = {}  # task_id -> task, admitted and not done
        self.requeued: deque[int] = deque()  # task ids waiting for a generator again
        self.num_steps_trained = 0

    @classmethod
    def for_run(cls, config: Config) -> TaskBook:
        """The launcher's book: the config's step shape and rollout budgets (sampling.budget)."""
        s, lrn = config.sampling, config.learner
        sizes = (s.budget_min, s.budget_max) if s.budget == "uncertainty" else None
        return cls(groups_per_step=lrn.groups_per_step, samples_per_group=lrn.samples_per_group, sizes=sizes)

    def traj_id(self, group_id: int, sample_index: int) -> int:
        return group_id * (self.stride or self.samples_per_group) + sample_index

    def size(self, group_id: int) -> int:
        return self.sizes.get(group_id, self.samples_per_group)

    def admit(self, task: PromptTask) -> None:
        lo, hi = self.size_range
        if not self.stride and task.num_samples != self.samples_per_group:
            raise ValueError(
                f"task {task.task_id} has {task.num_samples} samples; learner.samples_per_group is "
                f"{self.samples_per_group}"
            )
        if not lo <= task.num_samples <= hi or task.sample_stride != self.stride:
            raise ValueError(
                f"task {task.task_id} has {task.num_samples} samples (stride {task.sample_stride}); the run "
                f"takes {lo}..{hi} (stride {self.stride}: learner.samples_per_group, sampling.budget)"
            )
        if self.stride:
            self.sizes[task.group_id] = task.num_samples
        self.ledger.admit(task.task_id, group_id=task.group_id, num_samples=task.num_samples)
        self.open[task.task_id] = task

    def dispatched(self, task_id: int, generator_id: str) -> None:
        self.ledger.dispatch(task_id, generator_id=generator_id)

    def pass_to(self, task_id: int, generator_id: str) -> None:
        """A re-queued task that `generator_id` runs already (its hedge): in flight there now."""
        self.requeued.remove(task_id)
        self.ledger.dispatch(task_id, generator_id=generator_id)

    def pop_requeued(self) -> PromptTask | None:
        """The oldest re-queued task (it will be dispatched now), or None."""
        return self.open[self.requeued.popleft()] if self.requeued else None

    def done(self, task_id: int, generator_id: str, *, hedge: bool = False) -> PromptTask:
        """TaskDone from `generator_id`; raises ValueError if the task is not in flight there.
        `hedge`: from the generator running its second copy (scheduler/hedge.py), which the
        ledger does not know: it closes the task as the ledger's copy would have."""
        task = self.open.get(task_id)
        if task is None:
            raise ValueError(f"TaskDone for task {task_id}, which is not open (never admitted, or done)")
        if not hedge and not self.ledger.is_in_flight(task_id, generator_id):
            raise ValueError(f"TaskDone for task {task_id} from {generator_id}, which was not running it")
        for i in self.ledger.missing_samples(task_id):
            self.ledger.generated(self.traj_id(task.group_id, i), task_id=task_id, sample_index=i)
        self.ledger.task_done(task_id, generator_id=None if hedge else generator_id)
        del self.open[task_id]
        return task

    def generator_failed(self, generator_id: str) -> list[int]:
        """Re-queue every task in flight on `generator_id` (once); returns their ids, sorted."""
        task_ids = self.ledger.generator_failed(generator_id)
        self.requeued.extend(task_ids)
        return task_ids

    def trained(self, step: int) -> None:
        """StepDone(step): every sample of the step's groups was trained exactly once."""
        if step != self.num_steps_trained:
            raise ValueError(f"StepDone for step {step}, expected step {self.num_steps_trained}")
        first = step * self.groups_per_step
        for group_id in range(first, first + self.groups_per_step):
            for traj_id in self._buffered(group_id):
                self.ledger.trained(traj_id)
            self.sizes.pop(group_id, None)
        self.num_steps_trained += 1
        self.ledger.compact()  # keep memory flat: closed tasks live on only in the counts

    def trained_pool(self, step: int, *, trained: list[int], replayed: list[int]) -> None:
        """StepDone(step) of a pool-mode learner: each group in `trained` had its N samples
        trained once, each in `replayed` was trained again. Groups the ledger no longer knows
        (trained before a resume) count their replays only."""
        if step != self.num_steps_trained:
            raise ValueError(f"StepDone for step {step}, expected step {self.num_steps_trained}")
        for group_id in trained:
            for traj_id in self._buffered(group_id):
                self.ledger.trained(traj_id)
        for group_id in replayed:
            for i in range(self.samples_per_group):
                self.ledger.replayed(self.traj_id(group_id, i), task_id=group_id)
        self.num_steps_trained += 1
        self.ledger.compact()

    def evicted_pool(self, evicted: dict[str, list[int]]) -> None:
        """GroupsLeft of a pool-mode learner: these groups were dropped (reason -> group ids),
        never trained."""
        for reason, group_ids in sorted(evicted.items()):
            for group_id in group_ids:
                for traj_id in self._buffered(group_id):
                    self.ledger.evicted(traj_id, reason=reason)

    def _buffered(self, group_id: int) -> list[int]:
        """Record every sample of a group as generated (if TaskDone has not come yet) and
        buffered; returns their traj ids."""
        task_id = group_id  # one task per group, numbered like the group
        for i in self.ledger.missing_samples(task_id):
            self.ledger.generated(self.traj_id(group_id, i), task_id=task_id, sample_index=i)
        out = [self.traj_id(group_id, i) for i in range(self.size(group_id))]
        for traj_id in out:
            self.ledger.buffered(traj_id)
        return out

    def in_flight(self) -> list[int]:
        """Open tasks that are not waiting in the re-queue, sorted."""
        waiting = set(self.requeued)
        return sorted(t for t in self.open if t not in waiting)

    def summary(self, *, at_end: bool = False) -> LedgerSummary:
        return self.ledger.summary(at_end=at_end)


def stall_reason(state, book: TaskBook, live_peers: list[str], *, timeout_s: float, now: float) -> str | None:
    """Why the run has stalled, or None: nothing has moved for `timeout_s` (monitor.stall_timeout_s;
    0 = never) while training waits on something (a group admitted and not done, or a trajectory
    the learner rejected); one line naming what the next step waits for. A learner busy with a
    long step while every admitted group is done is not a stall. `state`: the launcher's RunState."""
    if not timeout_s or state.phase != "training" or now - state.last_progress < timeout_s:
        return None
    invalid = state.learner_metrics.invalid_trajectories if state.learner_metrics is not None else 0
    if not book.open and not invalid:
        return None
    rejected = f"; the learner rejected {invalid} trajectories (logs/learner.log)" if invalid else ""
    on = [f"{peer}: {book.ledger.tasks_in_flight(peer)[:8]}" for peer in live_peers]
    return (
        f"stalled: step {state.step} has received nothing for {timeout_s:g} s (monitor.stall_timeout_s); "
        f"groups in flight {', '.join(on) or 'none'}, re-queued {list(book.requeued)[:8]}; "
        f"last progress: {state.last_progress_what}{rejected}"
    )
