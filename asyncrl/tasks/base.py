"""The task seam: what a run trains on and how a completion is scored.

A task answers four questions, and nothing else in asyncrl knows which task it serves:
  - `train_problem(i)`: the prompt at index i of the training stream (deterministic in i, so a
    resumed run admits exactly the prompts it would have);
  - `eval_problems`: the held-out set, scored greedily before and after training;
  - `render(problems, tokenizer)`: prompts to token ids (raw text, or a chat template); the
    launcher sends ids, generators never see the task;
  - `score(prompt, completion, answer)`: the reward of one completion (a verifier), unless the
    run configures `task.rewards` (asyncrl/rewards/), which the generators then run instead.

Optionally a task may also have `prepare(tokenizer) -> dict` (render and check every prompt once,
before any is admitted; returns counts for summary.json) and `num_train` (the training rows; a
run needs at least one step's worth): the dataset task (`tasks/dataset.py`) has both. A task that
has `privileged_render(problems, tokenizer)` (the prompt ids of each problem with privileged
context, e.g. its worked solution, ending as the plain prompt does) can be its own teacher:
self-distillation (`opd.teacher = "self"`, docs/opd.md) scores every completion under it.

Who calls it: the launcher (prompt stream and rendering), every generator backend (scoring, via
`generators/rollouts.py`), evaluation (`asyncrl/job.py`) and distillation (privileged context).
Tasks are plugins: a registry name of the entry-point group `asyncrl.tasks` or a `pkg.mod:obj`
path in `task.kind`; the object is called with the `task` config section (`TaskConfig`) and
returns a `Task`. The built-in `addition` task (`tasks/arithmetic.py`) is the first one.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from asyncrl.plugins import load_plugin

ENTRY_POINT_GROUP = "asyncrl.tasks"


@dataclass(frozen=True, slots=True)
class Problem:
    """One prompt of a task: its stream index, its text and the answer its verifier checks.

    `extras` travel with the prompt to the rewards (`RewardInput.extras`, asyncrl/rewards/);
    `messages` is a chat prompt (a tuple of {"role", "content"} dicts) for tasks that render one
    with the tokenizer's chat template, `prompt` then being its last user turn."""

    index: int
    prompt: str
    answer: str
    extras: Mapping[str, Any] = field(default_factory=dict)
    messages: tuple[Mapping[str, str], ...] | None = None
    # A worked solution (the addition task: the sum; the dataset task: task.dataset.solution_field):
    # privileged context for self-distillation (`privileged_render`), never shown to the student.
    solution: str | None = None


@runtime_checkable
class Task(Protocol):
    """Implement these to train on your own prompts and rewards."""

    @property
    def eval_problems(self) -> Sequence[Problem]:
        """The held-out set (never in the training stream); may be empty."""

    def train_problem(self, index: int) -> Problem:
        """Problem number `index` of the training stream; the same index, the same problem."""

    def render(self, problems: Sequence[Problem], tokenizer: Any) -> list[list[int]]:
        """The prompt token ids of `problems`, in order (`raw_prompt_ids` for plain text)."""

    def score(self, prompt: str, completion: str, answer: str) -> float:
        """The reward of `completion` (decoded, up to its first eos) for `prompt`."""


def raw_prompt_ids(problems: Sequence[Problem], tokenizer: Any) -> list[list[int]]:
    """Prompts as plain text, tokenized in one call (one call per prompt costs several times the CPU)."""
    if not problems:
        return []
    return tokenizer([p.prompt for p in problems])["input_ids"]


def make_task(section: Any) -> Task:
    """The task of a `task` config section; ValueError naming the problem if it cannot be built."""
    factory = load_plugin(ENTRY_POINT_GROUP, section.kind, field="task.kind", what="task")
    task = factory(section)
    if not isinstance(task, Task):
        raise ValueError(
            f"task plugin {section.kind!r} returned {type(task).__name__}, which is not a Task "
            "(it needs eval_problems, train_problem, render and score; asyncrl/tasks/base.py)"
        )
    return task


@runtime_checkable
class PrivilegedTask(Protocol):
    """A task that can be its own teacher (`opd.teacher = "self"`)."""

    def privileged_render(self, problems: Sequence[Problem], tokenizer: Any) -> list[list[int]]:
        """Per problem, the prompt ids with privileged context (its solution) that the policy
        scores the student's completion under; each ends as `render` of the same problem does,
        so the completion reads on from the same text. ValueError naming the key to set when a
        problem has no privileged context."""


def check_privileged(task: Task, opd: Any, tokenizer: Any = None) -> None:
    """ValueError, before any process starts, when `opd` (the `opd` section) asks for
    self-distillation and `task` cannot build privileged prompts; with `tokenizer`, the first
    training problem is rendered too, so a task configured without its solutions fails here."""
    if not opd.self_teacher:
        return
    if not isinstance(task, PrivilegedTask):
        raise ValueError(
            f"opd.teacher = 'self' needs a task that builds privileged prompts (a "
            f"privileged_render method, asyncrl/tasks/base.py), and {type(task).__name__} has none; "
            "use a teacher directory for opd.teacher, or a task with worked solutions"
        )
    if tokenizer is not None:
        task.privileged_render([task.train_problem(0)], tokenizer)


def prepare_task(task: Task, tokenizer: Any, *, groups_per_step: int, room: int = 0) -> dict[str, int]:
    """Called once before any prompt is admitted (or evaluated): the task's own `prepare`, if it
    has one, and the size check. `room`: the longest prompt the model's context leaves beside
    the completion (0 = no limit), handed to a `prepare` that takes it (a task whose `prepare`
    does not is checked per prompt at admission). ValueError naming the problem and the fix."""
    prepare = getattr(task, "prepare", None)
    stats = {}
    if prepare is not None:
        takes_room = "room" in inspect.signature(prepare).parameters
        stats = dict(prepare(tokenizer, room=room) if takes_room else prepare(tokenizer))
    num_train = getattr(task, "num_train", None)
    if num_train is not None and num_train < groups_per_step:
        raise ValueError(
            f"the training set has {num_train} prompts, fewer than one step's "
            f"learner.groups_per_step = {groups_per_step}; add rows or lower learner.groups_per_step"
        )
    return stats
