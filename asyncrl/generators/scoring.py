"""Scoring rollouts as they arrive, in the generator service, and knowing when a group is done.

Place in the data flow: a backend hands over Rollouts as they finish (`RolloutBuilder` left their
texts and a NaN reward when `task.rewards` is configured); `SampleScorer.take` checks each one,
runs every reward over those that arrived together (`asyncrl/rewards/`: cheap ones in a thread,
CPU-bound ones in a worker pool with a per-call timeout, async and remote ones awaited with a
timeout; never on the service's event loop), applies `scoring.on_failure`, and says which
rollouts to send now, which samples to draw again, and which groups are complete (their
TaskDone, with per-group counts for the launcher: `reward_sums`, `reward_failures`, ...). No
rollout waits for the others of its batch or group: each is sent once its own reward is in.

A failed reward either scores 0 for that reward ("zero") or has the sample drawn again
("regenerate": the same sample index with `PromptTask.attempt` raised, so with fresh seeds), up to
`scoring.max_regenerations` times, then 0. The sample keeps its place (task, sample index,
traj_id): nothing is lost or duplicated. Every failure is counted; whether there were too many is
the launcher's call (the budget).

A sample the learner would reject (no token, or behavior log-probs that are not finite and <= 0:
the rules of `learner/service.py: _invalid`) is drawn again the same way, counted as invalid,
instead of being sent: a rejected trajectory would leave its step waiting forever. One still
invalid after `scoring.max_regenerations` redraws fails the generator with the reason. Every
arriving rollout is checked, redraws included; each redraw of a sample takes the next attempt.

`scoring.overlong = "mask"` takes samples cut at `sampling.max_new_tokens` out of the loss (a
loss mask of all False: the sample still counts in its group's baseline); it applies with or
without rewards and is counted either way.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import msgspec

from asyncrl.generators.base import Rollout
from asyncrl.generators.feed import Draw
from asyncrl.generators.guidance import GuidanceBook
from asyncrl.messages import PromptTask
from asyncrl.rewards.base import RewardInput
from asyncrl.rewards.scorer import make_scorer

if TYPE_CHECKING:
    from asyncrl.config import Config

log = logging.getLogger(__name__)


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
    num_guided: int = 0  # guided members (sampling.guidance)
    guided_reward_sum: float = 0.0  # ... and their rewards' sum (so pass rates can leave them out)

    def as_fields(self) -> dict:
        return dataclasses.asdict(self)


@dataclass
class _Group:
    """One open task: which samples are final, which are awaited, how often each was redrawn."""

    task: PromptTask
    waiting: set[int]  # sample indices drawn and not back yet
    final: dict[int, Rollout] = field(default_factory=dict)
    num_draws: dict[int, int] = field(default_factory=dict)  # redraws of each sample so far
    invalid_redraws: dict[int, int] = field(default_factory=dict)
    failed_redraws: dict[int, int] = field(default_factory=dict)
    counts: GroupCounts = field(default_factory=GroupCounts)
    guided: dict[int, PromptTask] = field(default_factory=dict)  # sample -> its guided variant


class Verdict(NamedTuple):
    """What to do with the rollouts of one `SampleScorer.take`."""

    send: list[tuple[PromptTask, Rollout]]  # final: to the learner now
    redraw: list[Draw]  # to draw again (back to the feed)
    done: list[tuple[PromptTask, list[Rollout], GroupCounts]]  # groups now complete (TaskDone)


class SampleScorer:
    """The run's rewards and failure policy for one generator process, one sample at a time."""

    def __init__(self, config: Config, tokenizer: Any = None, report: Path | None = None) -> None:
        self.scoring = config.task.scoring
        self.report = report  # where `close` writes the guidance book's summary (None: nowhere)
        # Per-prompt failure counts; guided variants when sampling.guidance is on (`guidance.py`).
        self.guidance = GuidanceBook(config.sampling.guidance)
        if self.guidance.enabled:
            from asyncrl.tasks.base import make_task

            if tokenizer is None:
                raise ValueError(
                    "sampling.guidance needs the generator's tokenizer (a `tokenizer` attribute) to "
                    "force solution prefixes; this generator has none: turn sampling.guidance off"
                )

            self.guidance.task, self.guidance.tokenizer = make_task(config.task), tokenizer
        self.max_new_tokens = config.sampling.max_new_tokens
        self.scorer = make_scorer(config.task)  # None: the backend scored with Task.score
        self.mask_overlong = self.scoring.overlong == "mask"
        self.groups: dict[int, _Group] = {}

    def open(self, task: PromptTask) -> None:
        """A task the launcher sent: every sample of it is awaited."""
        self.groups[task.task_id] = _Group(task, waiting=set(range(task.num_samples)))

    def open_tasks(self, tasks: Sequence[PromptTask]) -> tuple[list[PromptTask], list[Draw]]:
        """Open `tasks`; what the feed draws: the tasks (a guided one cut to its unguided members)
        and the draws of guided members (`GuidanceBook.plan`)."""
        plain, guided = [], []
        for task in tasks:
            self.open(task)
            feed_task, draws = self.guidance.plan(task)
            plain.append(feed_task)
            guided += draws
            self.groups[task.task_id].guided = {d.sample_index: d.task for d in draws}
        return plain, guided

    def awaited(self) -> set[tuple[int, int]]:
        """(task_id, sample_index) of every sample whose rollout has not come back yet."""
        return {(tid, k) for tid, g in self.groups.items() for k in g.waiting}

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

    def _redraw(self, g: _Group, k: int) -> Draw:
        g.num_draws[k] = g.num_draws.get(k, 0) + 1
        g.waiting.add(k)
        g.counts.num_regenerated += 1
        base = g.guided.get(k, g.task)  # a guided member is drawn again guided
        return Draw(msgspec.structs.replace(base, attempt=g.task.attempt + g.num_draws[k]), k)

    async def take(self, rollouts: Sequence[Rollout]) -> Verdict:
        """Check, score and place `rollouts` (each one a sample the feed handed out)."""
        redraw: list[Draw] = []
        ready: list[tuple[_Group, Rollout]] = []
        invalid: list[str] = []
        for r in rollouts:
            g = self.groups.get(r.task_id)
            k = r.sample_index
            if g is None or k not in g.waiting:
                raise ValueError(
                    f"generator returned sample {k} of task {r.task_id}, which was not asked for "
                    "(a duplicate, or a task not in flight here)"
                )
            g.waiting.discard(k)
            if why := rollout_problem(r):
                g.counts.num_invalid += 1
                if g.invalid_redraws.get(k, 0) == self.scoring.max_regenerations:
                    raise ValueError(
                        f"sample {k} of task {r.task_id} is still invalid after "
                        f"{self.scoring.max_regenerations} redraws ({why}); the learner cannot train on it"
                    )
                g.invalid_redraws[k] = g.invalid_redraws.get(k, 0) + 1
                invalid.append(why)
                redraw.append(self._redraw(g, k))
                continue
            ready.append((g, r))
        if invalid:
            log.warning("drawing %d invalid samples again (first: %s)", len(invalid), invalid[0])
        if self.scorer is not None and ready:
            ready = await self._score(ready, redraw)
        send: list[tuple[PromptTask, Rollout]] = []
        done = []
        for g, r in ready:
            if r.finish_reason == "length":
                g.counts.num_overlong += 1
                if self.mask_overlong:
                    r = dataclasses.replace(r, loss_mask=[False] * len(r.completion_ids))
            g.final[r.sample_index] = r
            send.append((g.task, r))
            if r.guided_prefix:
                g.counts.num_guided += 1
                g.counts.guided_reward_sum += float(r.reward)
            if len(g.final) == g.task.num_samples:
                del self.groups[g.task.task_id]
                group = [g.final[i] for i in range(g.task.num_samples)]
                self.guidance.observe(g.task, group)
                done.append((g.task, group, g.counts))
        return Verdict(send, redraw, done)

    async def _score(
        self, ready: list[tuple[_Group, Rollout]], redraw: list[Draw]
    ) -> list[tuple[_Group, Rollout]]:
        assert self.scorer is not None
        scores = await self.scorer.score([self.sample(g.task, r) for g, r in ready])
        scored = []
        for (g, r), score in zip(ready, scores, strict=True):
            c = g.counts
            c.num_scored += 1
            if score.failed:
                c.num_score_failed += 1
                for name in score.failures:
                    c.reward_failures[name] = c.reward_failures.get(name, 0) + 1
                k = r.sample_index
                if (
                    self.scoring.on_failure == "regenerate"
                    and g.failed_redraws.get(k, 0) < self.scoring.max_regenerations
                ):
                    g.failed_redraws[k] = g.failed_redraws.get(k, 0) + 1
                    redraw.append(self._redraw(g, k))
                    continue
            for name, value in score.parts.items():
                c.reward_sums[name] = c.reward_sums.get(name, 0.0) + float(value)
            # Each reward's unweighted value in task.rewards order (a failed one scored 0): GDPO's input.
            parts = [float(score.parts.get(name, 0.0)) for name in self.scorer.names]
            scored.append((g, dataclasses.replace(r, reward=float(score.reward), reward_parts=parts)))
        return scored

    async def close(self) -> None:
        if self.report is not None and self.guidance.prompts:
            self.guidance.write(self.report)
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
