"""Guided rollouts for prompts nobody solves (`sampling.guidance`), on the generator's side.

Place in the data flow: the generator service's scorer (`scoring.py`) keeps one `GuidanceBook`.
When a group completes, `observe` counts, per prompt (its rendered ids: the same prompt whatever
stream index or epoch rendered it), the groups in a row whose *unguided* samples all scored below
`pass_reward`. When a task arrives for a prompt at
`after_failures` or more, `plan` guides its last `samples` members: each is drawn from a variant
of the task whose prompt ends with the first ceil(prefix_fraction x |s|) tokens of the task's
worked solution s (`Problem.solution`, the privileged context self-distillation also reads; the
answer when a task has none), forced, and the policy samples the rest after them
(`PromptTask.guided_prefix` marks the variant; `RolloutBuilder.build` turns its rollout back into
the student's prompt with prefix + continuation as the completion, the prefix behind a loss mask
and counted in `Trajectory.guided_prefix`). The learner takes the group's baseline from its
unguided members and treats the prefix as `sampling.guidance.prefix_loss` says
(`learner/guidance.py`).

The count is this generator's own (minimal, not checkpointed; the launcher's per-prompt record,
`scheduler/prompt_stats.py`, is not visible here): a prompt whose groups go to several generators
is counted by each apart, and a restarted generator starts from zero. A run that should count
without guiding (a baseline) sets `after_failures` past its number of steps. `summary()` (written to the run directory at exit) says how many prompts reached the
failure count, how many of those an unguided sample solved later, and the guided samples' count
and rewards against the unguided ones'.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from asyncrl.generators.feed import Draw
from asyncrl.messages import PromptTask

if TYPE_CHECKING:
    from asyncrl.generators.base import Rollout

log = logging.getLogger(__name__)


@dataclass
class PromptRecord:
    """One prompt as this generator has seen it."""

    failures: int = 0  # groups in a row whose unguided samples all failed
    failing: bool = False  # reached after_failures at some point
    guided_groups: int = 0
    solved_after: bool = False  # failing, then an unguided sample passed


@dataclass
class GuidanceBook:
    """Per-prompt failure counts and the guided variants of tasks (module docstring)."""

    section: Any  # sampling.guidance
    task: Any = None  # the run's Task (solutions), built on first use when guidance is on
    tokenizer: Any = None
    prompts: dict[tuple[int, ...], PromptRecord] = field(default_factory=dict)  # by prompt ids
    samples: dict[str, list[float]] = field(default_factory=lambda: {"guided": [], "unguided": []})

    @property
    def enabled(self) -> bool:
        return bool(self.section.enabled)

    def plan(self, task: PromptTask) -> tuple[PromptTask, list[Draw]]:
        """The task to feed (its unguided members) and the guided members' draws (none when the
        prompt is not failing, or guidance is off)."""
        rec = self.prompts.get(tuple(task.prompt_ids))
        if not self.enabled or rec is None or rec.failures < self.section.after_failures:
            return task, []
        prefix = self.solution_prefix(task)
        if not prefix:
            return task, []
        num = min(self.section.samples, task.num_samples - 1)
        first = task.num_samples - num
        guided = msgspec.structs.replace(
            task, prompt_ids=[*task.prompt_ids, *prefix], guided_prefix=len(prefix)
        )
        rec.guided_groups += 1
        plain = msgspec.structs.replace(task, num_samples=first)
        return plain, [Draw(guided, k) for k in range(first, task.num_samples)]

    def solution_prefix(self, task: PromptTask) -> list[int]:
        """The first ceil(prefix_fraction x |solution|) token ids of the task's worked solution."""
        problem = self.task.train_problem(task.dataset_index)
        if problem.answer != task.answer:  # not the prompt the launcher rendered: do not guess
            log.warning(
                "guidance: prompt %d's answer differs from the task's; not guided", task.dataset_index
            )
            return []
        text = problem.solution or problem.answer
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return list(ids[: math.ceil(self.section.prefix_fraction * len(ids))])

    def observe(self, task: PromptTask, rollouts: list[Rollout]) -> None:
        """A complete group: count its prompt's failure (or its success by an unguided sample)."""
        passed = False
        for r in rollouts:
            kind = "guided" if r.guided_prefix else "unguided"
            self.samples[kind].append(r.reward)
            passed = passed or (not r.guided_prefix and r.reward >= self.section.pass_reward)
        rec = self.prompts.setdefault(tuple(task.prompt_ids), PromptRecord())
        if passed:
            rec.solved_after = rec.solved_after or rec.failing
            rec.failures = 0
            return
        rec.failures += 1
        if rec.failures >= self.section.after_failures and not rec.failing:
            rec.failing = True
            log.info("guidance: prompt %d failed %d groups in a row", task.dataset_index, rec.failures)

    def summary(self) -> dict[str, Any]:
        """The figures the run reports (module docstring)."""
        failing = [r for r in self.prompts.values() if r.failing]
        out: dict[str, Any] = {
            "enabled": self.enabled,
            "prompts_seen": len(self.prompts),
            "prompts_failing": len(failing),
            "prompts_guided": sum(1 for r in failing if r.guided_groups),
            "failing_solved_later": sum(1 for r in failing if r.solved_after),
            "guided_and_solved_later": sum(1 for r in failing if r.solved_after and r.guided_groups),
        }
        for kind, rewards in self.samples.items():
            out[f"{kind}_samples"] = len(rewards)
            out[f"{kind}_mean_reward"] = sum(rewards) / len(rewards) if rewards else None
        return out

    def write(self, path: Path) -> None:
        path.write_text(json.dumps(self.summary(), indent=1) + "\n")
