"""Dispatch (pure): which PromptTasks go to which generator now.

Place in the data flow: the launcher (`scheduler/service.py`) calls `Dispatcher.plan` whenever
work may flow (a generator starts serving or loads new weights, groups leave the pool, a restart
re-queued tasks) and sends each generator its list as one PromptTasks message. No sockets, no
awaits: the oldest version a serving generator holds and the serving generators in, a
`{peer: [PromptTask]}` plan out, with the task book already updated.

Order: re-queued tasks first, oldest first, then newly admitted groups (`AdmissionMode`). A
re-queued task waits while its window is beyond the staleness bound of the loaded weights (only
groups re-admitted on resume can be, until the generators load the resumed version). Each task
goes to the serving generator with the fewest outstanding tasks, the first in slot order on a tie;
with none serving it waits in the re-queue. Every choice is recorded before the caller awaits a
send, so a generator restarted meanwhile is never picked and its tasks are re-queued exactly once.

Prompts come from the task seam (`asyncrl/tasks/base.py`): group j is `task.train_problem(i)`,
i the stream index the run's selection chooses (`scheduler/selection.py`, `sampling.selection`;
uniform, the default: i = j; a group re-admitted on resume gets the index it had), and each
finished task's rewards go into the per-prompt record (`done(..., result=TaskDone)`); each
group's size is the selection's budget (`scheduler/budget.py`, `sampling.budget`); prompts are
rendered to token ids by `task.render`, a whole dispatch in one call; with `privileged`
(self-distillation, opd.teacher = "self") also by `task.privileged_render`, for the policy to
score its completions under (`PromptTask.privileged_ids`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from asyncrl.messages import PromptTask, SamplingParams, TaskDone
from asyncrl.scheduler.modes import AdmissionMode
from asyncrl.scheduler.prompt_stats import PromptStats, prompt_key
from asyncrl.scheduler.selection import Selection, Selector, make_selection
from asyncrl.scheduler.tasks import TaskBook
from asyncrl.tasks.base import Task

if TYPE_CHECKING:
    from asyncrl.config import Config

# The ledger's generator id of groups re-admitted on resume: they were in flight on the
# interrupted run's generators, now gone, so they are re-queued at once.
INTERRUPTED_RUN = "(interrupted run)"


class Plan(NamedTuple):
    by_peer: dict[str, list[PromptTask]]  # generator peer id -> its tasks, in dispatch order
    num_admitted: int  # groups admitted by this plan (the other tasks were re-queued ones)


class Dispatcher:
    """The prompt stream, admission and assignment; `outstanding` counts tasks per generator."""

    def __init__(
        self,
        *,
        book: TaskBook,
        mode: AdmissionMode,
        task: Task,
        sampling: SamplingParams,
        max_staleness: int,
        tokenizer: Any = None,
        privileged: bool = False,
        room: int = 0,
        selector: Selector | None = None,
        selection: Selection | None = None,
    ) -> None:
        """`selection`: the run's strategy and per-prompt record; else `selector` (default
        uniform) with a record of its own."""
        self.book = book
        self.mode = mode
        self.task = task
        self.sampling = sampling
        self.max_staleness = max_staleness
        self.tokenizer = tokenizer  # set before the first admission (the launcher loads it)
        self.privileged = privileged  # PromptTasks carry privileged prompts (opd.teacher = "self")
        # The longest prompt the model's context leaves beside sampling.max_new_tokens (0 = no
        # limit): a task's prepare drops or refuses longer ones at load; any that reach admission
        # (a plugin task without a prepare, a privileged prompt) stop the run here, named.
        self.room = room
        if selection is None:
            selection = Selection("uniform" if selector is None else "custom", selector, PromptStats())
        self.selection = selection  # which prompt each admitted group samples, and the record
        self.outstanding: dict[str, int] = {}  # serving generator -> tasks sent and not done
        # The staleness bound in force when each open task was admitted (it moves with
        # staleness.max_staleness = "auto"): a re-queued task is sent again only within it.
        self.admitted_bound: dict[int, int] = {}

    @classmethod
    def for_run(
        cls, config: Config, *, book: TaskBook, mode: AdmissionMode, task: Task, tokenizer: Any, room: int = 0
    ) -> Dispatcher:
        """The launcher's dispatcher: the config's sampling and bound."""
        s = config.sampling
        return cls(
            book=book,
            mode=mode,
            task=task,
            sampling=SamplingParams(
                temperature=s.temperature,
                top_p=s.top_p,
                max_new_tokens=s.max_new_tokens,
                ignore_eos=s.ignore_eos,
            ),
            max_staleness=config.effective_max_staleness,
            tokenizer=tokenizer,
            privileged=config.opd.self_teacher,
            room=room,
            selection=make_selection(config, task),
        )

    def plan(self, *, loaded_version: int, serving: Sequence[str]) -> Plan:
        """Re-queued tasks that fit the bound, then the groups admitted at `loaded_version` (the
        oldest version a serving generator holds), each assigned to one of `serving`."""
        book = self.book
        tasks = []
        while book.requeued and book.open[book.requeued[0]].window <= loaded_version + self.bound_of(
            book.requeued[0]
        ):
            tasks.append(book.pop_requeued())
        admitted = self.admit(self.mode.admit(loaded_version), loaded_version=loaded_version)
        return Plan(self.assign([*tasks, *admitted], serving), len(admitted))

    def admit(self, groups: Sequence[int], *, loaded_version: int) -> list[PromptTask]:
        """The groups' PromptTasks, admitted to the task book (not assigned to anyone yet)."""
        if not groups:
            return []
        indices = self.selection.choose(groups)
        problems = [self.task.train_problem(i) for i in indices]
        sizes = self.selection.sizes(groups, [prompt_key(p) for p in problems], self.book.samples_per_group)
        prompt_ids = self.task.render(problems, self.tokenizer)
        privileged: list[list[int]] = [[] for _ in problems]
        if self.privileged:
            privileged = self.task.privileged_render(problems, self.tokenizer)  # type: ignore[attr-defined]
        tasks = []
        for j, index, problem, ids, privileged_ids, size in zip(
            groups, indices, problems, prompt_ids, privileged, sizes, strict=True
        ):
            self.check_room(index, ids, privileged_ids)
            task = PromptTask(
                task_id=j,
                group_id=j,
                prompt_ids=ids,
                num_samples=size,
                sampling=self.sampling,
                dataset_index=index,
                window=self.mode.task_window(j, loaded_version=loaded_version),
                answer=problem.answer,
                extras=dict(problem.extras),
                privileged_ids=privileged_ids,
                sample_stride=self.book.stride,
            )
            self.book.admit(task)
            self.selection.admitted(task, prompt_key(problem))
            self.admitted_bound[j] = self.mode.admission.max_staleness
            tasks.append(task)
        return tasks

    def check_room(self, index: int, ids: Sequence[int], privileged_ids: Sequence[int]) -> None:
        for what, n in (
            ("prompt", len(ids)),
            ("privileged prompt (opd.teacher = 'self')", len(privileged_ids)),
        ):
            if self.room and n > self.room:
                raise ValueError(
                    f"training problem {index}: its {what} is {n} tokens, over the {self.room} the model's "
                    f"context leaves beside sampling.max_new_tokens = {self.sampling.max_new_tokens}; lower "
                    "sampling.max_new_tokens, or give the task a prepare(tokenizer, room) that drops such rows"
                )

    def bound_of(self, task_id: int) -> int:
        """The bound a task may be generated within: the one it was admitted under (a task
        re-admitted on resume: the configured one)."""
        return self.admitted_bound.get(task_id, self.max_staleness)

    def assign(self, tasks: Sequence[PromptTask], serving: Sequence[str]) -> dict[str, list[PromptTask]]:
        """Each task to the serving generator with the fewest outstanding tasks; with none
        serving, the tasks wait in the re-queue."""
        by_peer: dict[str, list[PromptTask]] = {}
        for task in tasks:
            if not serving:
                self.book.requeued.append(task.task_id)
                continue
            peer = min(serving, key=lambda p: self.outstanding.get(p, 0))
            self.outstanding[peer] = self.outstanding.get(peer, 0) + 1
            self.book.dispatched(task.task_id, peer)
            by_peer.setdefault(peer, []).append(task)
        return by_peer

    def done(
        self, task_id: int, peer: str, *, hedge: bool = False, result: TaskDone | None = None
    ) -> PromptTask:
        """TaskDone from `peer`; ValueError (nothing changed) if the task is not in flight there.
        `hedge`: from the second copy's generator (scheduler/hedge.py). `result`: the TaskDone,
        whose rewards go into the per-prompt record."""
        task = self.book.done(task_id, peer, hedge=hedge)
        if result is not None:
            self.selection.observe(task, result)
        self.release(peer)
        self.admitted_bound.pop(task_id, None)
        return task

    def hedge(self, task_id: int, peer: str) -> PromptTask:
        """The open task `task_id`, sent again to `peer` (a second copy; the ledger keeps the first)."""
        self.outstanding[peer] = self.outstanding.get(peer, 0) + 1
        return self.book.open[task_id]

    def release(self, peer: str) -> None:
        """One task fewer outstanding on `peer` (a TaskDone; a hedged copy that lost counts too)."""
        if peer in self.outstanding:
            self.outstanding[peer] -= 1

    def pass_to(self, passed: dict[int, str]) -> None:
        """Re-queued tasks whose hedge runs them already: in flight on the hedge's generator."""
        for task_id, peer in passed.items():
            self.book.pass_to(task_id, peer)

    def generator_failed(self, peer: str) -> list[int]:
        """Re-queue every task in flight on `peer` (once); returns their ids, sorted."""
        self.outstanding.pop(peer, None)
        return self.book.generator_failed(peer)

    def readmit(self, saved: dict, *, resume_version: int) -> list[PromptTask]:
        """Resume: admit again every group the interrupted run's checkpoint (`saved`, decoded
        JSON) had admitted and not trained, re-queued for the generators. Their windows were
        within the bound of versions <= v + K, and the generators serve v before they get any."""
        tasks = self.admit(self.mode.readmit(saved), loaded_version=resume_version)
        for task in tasks:
            self.book.dispatched(task.task_id, INTERRUPTED_RUN)
        self.book.generator_failed(INTERRUPTED_RUN)
        return tasks
