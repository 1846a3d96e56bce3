"""From sampled tokens to `Rollout`s: decoding, reward scoring and assembly, shared by every backend.

Place in the data flow: a generator backend (`torch_gen.py`, `sglang/generator.py`, a plugin)
samples token ids with their behavior log-probs and versions, then hands each sample here. The
completion is decoded up to its first eos (`answer_ids`: a model that samples past its answer,
`ignore_eos`, is still scored on the answer) and scored by the run's task (`Task.score`, the task
seam in `asyncrl/tasks/base.py`), so no backend knows which task it serves.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

from asyncrl.generators.base import Rollout
from asyncrl.messages import PromptTask
from asyncrl.models.sampling import answer_ids
from asyncrl.tasks.base import Task, make_task


class OpdArrays(NamedTuple):
    """The on-policy distillation arrays of one sample, [T][N] each (`Rollout.opd_*`, docs/opd.md)."""

    ids: list[list[int]]
    behavior_logprobs: list[list[float]]
    teacher_logprobs: list[list[float]]


class RolloutBuilder:
    """Scores completions with the run's task and assembles them into Rollouts."""

    def __init__(self, task: Task, tokenizer: Any) -> None:
        self.task = task
        self.tokenizer = tokenizer

    @classmethod
    def for_task(cls, section: Any, tokenizer: Any) -> RolloutBuilder:
        """The builder for a `task` config section (`GeneratorContext.task`); ValueError if the task
        cannot be built."""
        return cls(make_task(section), tokenizer)

    def prompt_text(self, task: PromptTask) -> str:
        return self.tokenizer.decode(task.prompt_ids, skip_special_tokens=True)

    def reward(self, prompt_text: str, completion_ids: Sequence[int], answer: str) -> float:
        """The task's score of a completion, decoded up to its first eos."""
        tok = self.tokenizer
        text = tok.decode(answer_ids(completion_ids, tok.eos_token_id), skip_special_tokens=True)
        return float(self.task.score(prompt_text, text, answer))

    def build(
        self,
        task: PromptTask,
        sample_index: int,
        *,
        completion_ids: list[int],
        behavior_logprobs: list[float],
        token_versions: list[int],
        finish_reason: str,
        prompt_text: str | None = None,
        opd: OpdArrays | None = None,
    ) -> Rollout:
        """One scored Rollout; pass `prompt_text` when several samples share a prompt (decoded once)."""
        if prompt_text is None:
            prompt_text = self.prompt_text(task)
        return Rollout(
            task_id=task.task_id,
            sample_index=sample_index,
            completion_ids=completion_ids,
            behavior_logprobs=behavior_logprobs,
            token_versions=token_versions,
            reward=self.reward(prompt_text, completion_ids, task.answer),
            finish_reason=finish_reason,
            opd_ids=None if opd is None else opd.ids,
            opd_behavior_logprobs=None if opd is None else opd.behavior_logprobs,
            teacher_logprobs=None if opd is None else opd.teacher_logprobs,
        )
