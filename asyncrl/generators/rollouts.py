"""From sampled tokens to `Rollout`s: decoding, reward scoring and assembly, shared by every backend.

Place in the data flow: a generator backend (`torch_gen.py`, `sglang/generator.py`, a plugin)
samples token ids with their behavior log-probs and versions, then hands each sample here. The
completion is decoded up to its first eos (`answer_ids`: a model that samples past its answer,
`ignore_eos`, is still scored on the answer) and scored by the run's task (`Task.score`, the task
seam in `asyncrl/tasks/base.py`), so no backend knows which task it serves.

With `task.rewards` configured the builder does not score: it leaves the decoded texts on the
Rollout (reward NaN) and the generator service scores whole batches with the run's rewards off
its event loop (`asyncrl/rewards/`), where a reward that raises or hangs is counted, not fatal.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple

from asyncrl.generators.base import Rollout
from asyncrl.messages import PromptTask
from asyncrl.tasks.base import Task, make_task


class OpdArrays(NamedTuple):
    """The on-policy distillation arrays of one sample, [T][N] each (`Rollout.opd_*`, docs/opd.md),
    and the teacher's policy_version when the teacher is the policy itself."""

    ids: list[list[int]]
    behavior_logprobs: list[list[float]]
    teacher_logprobs: list[list[float]]
    teacher_version: int | None = None
    # opd.teacher_top_k = K > 0: the teacher's K most likely ids per position and their log-probs.
    teacher_top_ids: list[list[int]] | None = None
    teacher_top_logprobs: list[list[float]] | None = None
    teacher_id: str = ""  # opd.teachers: the name of the teacher that scored it ("" = the one teacher)

    @classmethod
    def of(cls, ids_TN, behav_TN, scored, version: int | None) -> OpdArrays:
        """From the [T, N] cache tensors and the teacher's `opd.TeacherScoring` of them."""
        top = scored.top_ids is not None and scored.top_logprobs is not None
        return cls(
            ids=ids_TN.tolist(),
            behavior_logprobs=behav_TN.tolist(),
            teacher_logprobs=scored.logprobs.tolist(),
            teacher_version=version,
            teacher_top_ids=scored.top_ids.tolist() if top else None,
            teacher_top_logprobs=scored.top_logprobs.tolist() if top else None,
        )


class RolloutBuilder:
    """Scores completions with the run's task and assembles them into Rollouts."""

    def __init__(self, task: Task | None, tokenizer: Any) -> None:
        self.task = task  # None: the service scores (task.rewards)
        self.tokenizer = tokenizer

    @classmethod
    def for_task(cls, section: Any, tokenizer: Any) -> RolloutBuilder:
        """The builder for a `task` config section (`GeneratorContext.task`); ValueError if the task
        cannot be built. With `task.rewards` the task itself is not needed here."""
        return cls(None if section.rewards else make_task(section), tokenizer)

    def completion_text(self, completion_ids: Sequence[int]) -> str:
        """The completion as the rewards read it: decoded up to its first eos."""
        tok = self.tokenizer
        from asyncrl.models.sampling import answer_ids  # here: the launcher imports this module, not torch

        return tok.decode(answer_ids(completion_ids, tok.eos_token_id), skip_special_tokens=True)

    def prompt_text(self, task: PromptTask) -> str:
        """The student's prompt as text (a guided variant's forced prefix left out)."""
        return self.tokenizer.decode(student_prompt(task), skip_special_tokens=True)

    def reward(self, prompt_text: str, completion_ids: Sequence[int], answer: str) -> float:
        """The task's score of a completion, decoded up to its first eos."""
        assert self.task is not None, "with task.rewards the generator service scores"
        return float(self.task.score(prompt_text, self.completion_text(completion_ids), answer))

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
        """One scored Rollout; pass `prompt_text` when several samples share a prompt (decoded once).

        A guided variant's sample (`PromptTask.guided_prefix` = P) comes back as the student's: its
        prompt without the forced prefix, and a completion of the prefix then the sampled tokens,
        the prefix behind a loss mask (behaviour log-probs 0 and the first sampled token's version
        there: placeholders the learner never reads) and counted in `Rollout.guided_prefix`."""
        if prompt_text is None:
            prompt_text = self.prompt_text(task)
        mask = None
        if num := task.guided_prefix:
            completion_ids = [*task.prompt_ids[-num:], *completion_ids]
            behavior_logprobs = [0.0] * num + [float(x) for x in behavior_logprobs]
            versions = [int(v) for v in token_versions]
            token_versions = [versions[0] if versions else 0] * num + versions
            mask = [False] * num + [True] * (len(completion_ids) - num)
        if self.task is None:
            reward, texts = (
                math.nan,
                {"prompt_text": prompt_text, "completion_text": self.completion_text(completion_ids)},
            )
        else:
            reward, texts = self.reward(prompt_text, completion_ids, task.answer), {}
        return Rollout(
            task_id=task.task_id,
            sample_index=sample_index,
            completion_ids=completion_ids,
            behavior_logprobs=behavior_logprobs,
            token_versions=token_versions,
            reward=reward,
            finish_reason=finish_reason,
            opd_ids=None if opd is None else opd.ids,
            opd_behavior_logprobs=None if opd is None else opd.behavior_logprobs,
            teacher_logprobs=None if opd is None else opd.teacher_logprobs,
            teacher_version=None if opd is None else opd.teacher_version,
            loss_mask=mask,
            guided_prefix=task.guided_prefix,
            teacher_top_ids=None if opd is None else opd.teacher_top_ids,
            teacher_top_logprobs=None if opd is None else opd.teacher_top_logprobs,
            teacher_id="" if opd is None else opd.teacher_id,
            **texts,
        )


def student_prompt(task: PromptTask) -> list[int]:
    """The prompt the student saw: `prompt_ids` without a guided variant's forced prefix."""
    ids = list(task.prompt_ids)
    return ids[: len(ids) - task.guided_prefix] if task.guided_prefix else ids
