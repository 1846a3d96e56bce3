"""The per-prompt record (pure): a Beta pass-rate posterior, last seen and times sampled per prompt.

Place in the data flow: the launcher's dispatcher (`scheduler/dispatch.py`) tells it which prompt
each admitted group samples (`admitted`), and the launcher hands it each TaskDone with its task
(`observe`); the selection strategies (`scheduler/selection.py`) read it; the launcher's checkpoint
saves it (`state`) and a resume restores it exactly (`restore`); each step record carries its
summary (`step_fields`).

A prompt is named by a digest of its text (`prompt_key`), so the same prompt is one record
whatever stream index rendered it (the dataset task's later epochs reorder the rows).

The success rule (stated; #37): a group of n samples adds its successes s to alpha and n - s to
beta, from the prior Beta(1, 1). s is the sum of the group's primary reward (the held-out
accuracy's reward: `task.scoring.eval_reward`, else the first of `task.rewards`; with no
`task.rewards`, the task's own score, from the TaskDone's mean), clipped to [0, n]. For 0/1 rewards
this is the Bernoulli update; for rewards in [0, 1] it is the fractional one (a reward of 0.7 is
0.7 of a success). Rewards outside [0, 1] are not pass rates: only their clipped group sum counts.

Exactness: s is rounded to a multiple of 2**-20 before it is added, so alpha and beta are sums of
dyadic numbers, exact in float64 (below 2**32 samples): the record does not depend on the order
TaskDones arrive in, and a resumed run rebuilds it bit for bit. `last_seen` is the largest
window (training step) a group of the prompt was admitted for, and `index` the largest stream
index admitted in it, also order-free.

Checkpoints: the saved record holds only the groups the learner has trained (`groups_trained`,
from the launcher's StepDones). A group admitted and not trained, finished or not, is admitted
again by a resume and counted when it finishes again, so a resumed record equals the
uninterrupted run's instead of counting such a group twice.

Guided members (`sampling.guidance`) are not the policy's own samples: their forced prefix is
the worked solution, so their successes say nothing of the prompt's pass rate. The update uses the
unguided members only: n - g samples and s - (the guided members' reward sum) successes, clipped
to [0, n - g] as above (the TaskDone carries `num_guided` and `guided_reward_sum`; selection.py
subtracts them). A group whose members were all guided adds no samples. `guided_reward_sum` is
of the weighted reward sum, so with guidance and several rewards (or one weighted other than 1)
the record counts that sum for every group, not the primary reward (`selection.primary_reward`).

A group is degenerate (no learning signal in the pass rate) when s == 0 or s == n: every sample
failed or every sample succeeded. For rewards in [0, 1] these are exactly the groups whose primary
reward is all-equal at 0 or at 1; a group all-equal at an interior value is not counted (the
launcher receives the group's sum, not each sample's reward).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence

import msgspec

from asyncrl.tasks.base import Problem

PRIOR = (1.0, 1.0)  # Beta(alpha, beta) of a prompt never sampled
QUANTUM = 2.0**-20  # a group's successes are rounded to this (exact sums; module docstring)
QUANTILES = (0.1, 0.25, 0.5, 0.75, 0.9)  # of the estimated pass rates, in each step record


def prompt_key(problem: Problem) -> str:
    """The prompt's name in the record: a digest of its text (its chat turns when it has them)."""
    text = problem.prompt if problem.messages is None else repr([dict(m) for m in problem.messages])
    return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()


class PromptRecord(msgspec.Struct, array_like=True):
    """One prompt: its posterior's counts beyond the prior, groups sampled, last window, and a
    stream index that renders it (the last one admitted)."""

    successes: float = 0.0
    failures: float = 0.0
    groups: int = 0
    last_seen: int = -1  # the window (step) of its last admitted group; -1 = never observed
    index: int = 0


class Observation(msgspec.Struct, array_like=True, frozen=True):
    """One finished group: its prompt, successes, samples, window and stream index."""

    key: str
    successes: float
    num_samples: int
    window: int
    index: int


class StatsState(msgspec.Struct, kw_only=True, frozen=True):
    """What a launcher checkpoint saves (JSON): the record of the trained groups only. A group
    admitted and not trained is admitted again by a resume and observed again then, so counting
    it here would count it twice."""

    records: dict[str, PromptRecord]
    open: dict[int, tuple[int, str, int]]  # group id -> (stream index, prompt key, window), for the record


def group_successes(total: float, num_samples: int) -> float:
    """A group's successes: its primary reward's sum, clipped to [0, n], on the 2**-20 grid."""
    clipped = min(max(total, 0.0), float(num_samples))
    return round(clipped / QUANTUM) * QUANTUM


def add(records: dict[str, PromptRecord], obs: Observation) -> None:
    """`obs` into its prompt's record (exact sums; last_seen and index the largest, order-free)."""
    rec = records.setdefault(obs.key, PromptRecord())
    rec.successes += obs.successes
    rec.failures += obs.num_samples - obs.successes
    rec.groups += 1
    if (obs.window, obs.index) > (rec.last_seen, rec.index):
        rec.last_seen, rec.index = obs.window, obs.index


def quantile(sorted_values: Sequence[float], q: float) -> float:
    """The q-quantile of sorted values, linear between order statistics (numpy's default)."""
    pos = q * (len(sorted_values) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


class PromptStats:
    """Every prompt's record (`records`: every group observed, what selection reads; `trained`:
    the groups the learner trained, what a checkpoint saves), and the groups admitted and not yet
    observed (`open`)."""

    def __init__(self) -> None:
        self.records: dict[str, PromptRecord] = {}
        self.trained: dict[str, PromptRecord] = {}
        self.untrained: dict[int, Observation] = {}  # observed, not trained yet
        self.trained_early: set[int] = set()  # trained before their TaskDone arrived
        self.open: dict[int, tuple[int, str, int]] = {}
        self.step_groups = 0  # groups observed since the last step record
        self.step_degenerate = 0

    # -- updates --------------------------------------------------------------------------------
    def admitted(self, group_id: int, index: int, key: str, window: int) -> None:
        """Group `group_id` samples the prompt `key` (stream index `index`) for `window`."""
        self.open[group_id] = (index, key, window)

    def observe(
        self, group_id: int, *, total: float, num_samples: int, num_guided: int = 0, guided_total: float = 0.0
    ) -> bool:
        """The group's samples are in: `total` is its primary reward's sum over `num_samples`, of
        which `num_guided` guided members summed `guided_total` (left out: module docstring).
        Returns whether its unguided members were degenerate. ValueError for a group not admitted
        (or seen twice)."""
        if group_id not in self.open:
            raise ValueError(f"prompt record: group {group_id} was not admitted, or was observed already")
        if not 0 <= num_guided <= num_samples:
            raise ValueError(
                f"prompt record: group {group_id} has {num_guided} guided of {num_samples} samples"
            )
        index, key, window = self.open.pop(group_id)
        num_samples -= num_guided
        s = group_successes(total - guided_total, num_samples)
        obs = Observation(key=key, successes=s, num_samples=num_samples, window=window, index=index)
        add(self.records, obs)
        if group_id in self.trained_early:
            self.trained_early.discard(group_id)
            add(self.trained, obs)
        else:
            self.untrained[group_id] = obs
        degenerate = num_samples > 0 and s in (0.0, float(num_samples))
        self.step_groups += 1
        self.step_degenerate += degenerate
        return degenerate

    def groups_trained(self, groups: Iterable[int]) -> None:
        """The learner trained these groups: their observations go into the saved record (one
        whose TaskDone has not arrived yet goes in when it does)."""
        for group_id in groups:
            if (obs := self.untrained.pop(group_id, None)) is not None:
                add(self.trained, obs)
            elif group_id in self.open:
                self.trained_early.add(group_id)

    # -- reading --------------------------------------------------------------------------------
    def posterior(self, key: str) -> tuple[float, float]:
        rec = self.records.get(key)
        if rec is None:
            return PRIOR
        return PRIOR[0] + rec.successes, PRIOR[1] + rec.failures

    def mean(self, key: str) -> float:
        a, b = self.posterior(key)
        return a / (a + b)

    def is_open(self, key: str) -> bool:
        return any(k == key for _, k, _ in self.open.values())

    def open_keys(self) -> set[str]:
        return {key for _, key, _ in self.open.values()}

    def step_fields(self) -> dict:
        """The step record's summary: quantiles of the posterior means of every prompt sampled so
        far, their count, and the degenerate fraction of the groups observed since the last step
        record (which it resets)."""
        means = sorted(self.mean(k) for k in self.records)
        fields = {
            "prompts_seen": len(means),
            "pass_rate_quantiles": {f"q{round(q * 100)}": round(quantile(means, q), 4) for q in QUANTILES}
            if means
            else {},
            "groups_observed": self.step_groups,
            "degenerate_fraction": round(self.step_degenerate / self.step_groups, 4)
            if self.step_groups
            else None,
        }
        self.step_groups = self.step_degenerate = 0
        return fields

    # -- checkpoint -----------------------------------------------------------------------------
    def state(self) -> StatsState:
        return StatsState(
            records={k: msgspec.structs.replace(r) for k, r in sorted(self.trained.items())},
            open=dict(sorted(self.open.items())),
        )

    def restore(self, state: StatsState) -> None:
        """Resume: the trained groups' record; the groups the resume admits again are observed
        again when they finish (`open` starts empty: the dispatcher re-admits them)."""
        self.trained = {k: msgspec.structs.replace(r) for k, r in state.records.items()}
        self.records = {k: msgspec.structs.replace(r) for k, r in state.records.items()}
        self.untrained, self.trained_early, self.open = {}, set(), {}
