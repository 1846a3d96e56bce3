"""Scoring a generated batch with the run's rewards, in the generator service.

Place in the data flow: a backend returns a batch's Rollouts (`RolloutBuilder` left their texts
and a NaN reward when `task.rewards` is configured); `BatchScorer.score` runs every reward over
the batch (`asyncrl/rewards/`: cheap ones in a thread, CPU-bound ones in a worker pool with a
per-call timeout, async and remote ones awaited with a timeout; never on the service's event
loop), applies `scoring.on_failure` to samples whose reward failed, and returns the scored
Rollouts with per-group counts for the launcher (`TaskDone.reward_sums`, `reward_failures`, ...).

A failed reward either scores 0 for that reward ("zero") or has the sample drawn again
("regenerate": the backend samples the whole group again with `PromptTask.attempt` + 1, so with
fresh seeds, and only the failed samples are replaced), up to `scoring.max_regenerations` times,
then 0. The sample keeps its place (task, sample index, traj_id): nothing is lost or duplicated.
Every failure is counted; whether there were too many is the launcher's call (the budget).

A sample the learner would reject (no token, or behavior log-probs that are not finite and <= 0:
the rules of `learner/service.py: _invalid`) is drawn again the same way, counted as invalid,
instead of being sent: a rejected trajectory would leave its step waiting forever. One still
invalid after `scoring.max_regenerations` redraws fails the generator with the reason.

`scoring.overlong = "mask"` takes samples cut at `sampling.max_new_tokens` out of the loss (a
loss mask of all False: the sample still counts in its group's baseline); it applies with or
without rewards and is counted either way.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

import msgspec

from asyncrl.generators.base import Rollout
from asyncrl.messages import PromptTask
from asyncrl.rewards.base import RewardInput
from asyncrl.rewards.scorer import make_scorer

log = logging.getLogger(__name__)

Generate = Callable[[Sequence[PromptTask]], Awaitable[list[Rollout]]]


@dataclass
class GroupCounts:
    """What one group's scoring adds to its TaskDone."""

    reward_sums: dict[str, float] = field(default_factory=dict)
    reward_failures: dict[str, int] = field(default_factory=dict)
    num_scored: int = 0
    num_score_failed: int = 0
    num_regenerated: int = 0
    num_overlong: int = 0
    num_invalid: int = 0

    def as_fields(self) -> dict:
        return dataclasses.asdict(self)


class BatchScorer:
    """The run's rewards and failure policy for one generator process."""

    def __init__(self, config) -> None:
        self.scoring = config.task.scoring
        self.max_new_tokens = config.sampling.max_new_tokens
        self.scorer = make_scorer(config.task)  # None: the backend scored with Task.score
        self.mask_overlong = self.scoring.overlong == "mask"

    def sample(self, task: PromptTask, r: Rollout) -> RewardInput:
        if r.completion_text is None or r.prompt_text is None:
            raise ValueError(
                f"rollout of task {task.task_id} carries no completion_text/prompt_text, which "
                "task.rewards needs; build rollouts with asyncrl.generators.rollouts.RolloutBuilder"
            )
        return RewardInput(
            prompt=r.prompt_text,
            completion=r.completion_text,
            answer=task.answer,
            extras=task.extras,
            num_tokens=len(r.completion_ids),
            finish_reason=r.finish_reason,
            max_new_tokens=self.max_new_tokens,
        )

    async def score(
        self, batch: Sequence[PromptTask], by_task: dict[int, list[Rollout]], generate: Generate
    ) -> dict[int, GroupCounts]:
        """Scores `by_task` in place (rollouts replaced); returns the counts of each task."""
        counts = {t.task_id: GroupCounts() for t in batch}
        await self._redraw_invalid(batch, by_task, counts, generate)
        if self.scorer is not None:
            await self._score(batch, by_task, counts, generate)
        for task in batch:
            group, c = by_task[task.task_id], counts[task.task_id]
            for i, r in enumerate(group):
                if r.finish_reason != "length":
                    continue
                c.num_overlong += 1
                if self.mask_overlong:
                    group[i] = dataclasses.replace(r, loss_mask=[False] * len(r.completion_ids))
        return counts

    async def _score(self, batch, by_task, counts, generate: Generate) -> None:
        tasks = {t.task_id: t for t in batch}
        todo = [(t.task_id, i) for t in batch for i in range(len(by_task[t.task_id]))]
        for attempt in range(self.scoring.max_regenerations + 1):
            samples = [self.sample(tasks[tid], by_task[tid][i]) for tid, i in todo]
            scores = await self.scorer.score(samples)
            redo = []
            for (tid, i), score in zip(todo, scores, strict=True):
                c = counts[tid]
                c.num_scored += 1
                if score.failed:
                    c.num_score_failed += 1
                    for name in score.failures:
                        c.reward_failures[name] = c.reward_failures.get(name, 0) + 1
                    if self.scoring.on_failure == "regenerate" and attempt < self.scoring.max_regenerations:
                        redo.append((tid, i))
                        continue
                by_task[tid][i] = dataclasses.replace(by_task[tid][i], reward=float(score.reward))
                for name, value in score.parts.items():
                    c.reward_sums[name] = c.reward_sums.get(name, 0.0) + float(value)
            if not redo:
                return
            await self._redraw(tasks, by_task, counts, redo, attempt + 1, generate)
            todo = redo

    async def _redraw_invalid(self, batch, by_task, counts, generate: Generate) -> None:
        tasks = {t.task_id: t for t in batch}
        for attempt in range(self.scoring.max_regenerations + 1):
            bad = [
                (t.task_id, i, why)
                for t in batch
                for i, r in enumerate(by_task[t.task_id])
                if (why := rollout_problem(r))
            ]
            if not bad:
                return
            for tid, _, _ in bad:
                counts[tid].num_invalid += 1
            if attempt == self.scoring.max_regenerations:
                tid, i, why = bad[0]
                raise ValueError(
                    f"sample {by_task[tid][i].sample_index} of task {tid} is still invalid after "
                    f"{attempt} redraws ({why}); the learner cannot train on it"
                )
            log.warning("drawing %d invalid samples again (first: %s)", len(bad), bad[0][2])
            await self._redraw(tasks, by_task, counts, [(tid, i) for tid, i, _ in bad], attempt + 1, generate)

    async def _redraw(self, tasks, by_task, counts, redo, attempt: int, generate: Generate) -> None:
        """Draw the groups of `redo` again with fresh seeds; replace only the failed samples."""
        again = {
            tid: msgspec.structs.replace(tasks[tid], attempt=tasks[tid].attempt + attempt)
            for tid in dict.fromkeys(tid for tid, _ in redo)
        }
        fresh = {(r.task_id, r.sample_index): r for r in await generate(list(again.values()))}
        for tid, i in redo:
            old = by_task[tid][i]
            new = fresh.get((tid, old.sample_index))
            if new is None:
                raise ValueError(
                    f"generator returned no sample {old.sample_index} when drawing task {tid} again"
                )
            by_task[tid][i] = new
            counts[tid].num_regenerated += 1

    async def close(self) -> None:
        if self.scorer is not None:
            await self.scorer.aclose()


def rollout_problem(r: Rollout) -> str:
    """Why the learner would reject this rollout ("" if it would not): the generator-side mirror
    of `learner/service.py: _invalid` for what a sampler can get wrong."""
    if not r.completion_ids:
        return "no completion token"
    total = math.fsum(r.behavior_logprobs)  # NaN or inf anywhere makes the sum non-finite
    if not math.isfinite(total) or max(r.behavior_logprobs) > 0:
        return "behavior log-probs must be finite and <= 0"
    return ""
