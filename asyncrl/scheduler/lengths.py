"""Length bias made visible (pure): mean completion length of what was generated, trained and
dropped, per step and over the run.

Place in the data flow: the launcher feeds it each TaskDone (a group's completion tokens and
samples, `generated`), each StepDone (the tokens the step trained, `trained`) and each pool-mode
GroupsLeft (`evicted`: groups that left the buffer untrained, by reason); every step record
carries `lengths` (the means since the previous step) and summary.json the run's means.

Why: a long rollout takes longer to generate, so it arrives staler. A buffer that drops stale
groups drops long ones more often, and the model trains on shorter answers than it writes; the
gap between `generated` and `trained` (and a long `evicted` mean) shows it. Window admission
paces generation instead, so nothing is dropped for staleness (docs/safety.md, "Length bias").
Trained lengths count the tokens in the loss (`scoring.overlong = "mask"` leaves cut ones out).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping


class _Mean:
    __slots__ = ("tokens", "samples")

    def __init__(self) -> None:
        self.tokens = 0
        self.samples = 0

    def add(self, tokens: int, samples: int) -> None:
        self.tokens += tokens
        self.samples += samples

    @property
    def value(self) -> float | None:
        return self.tokens / self.samples if self.samples else None


class LengthTally:
    KINDS = ("generated", "trained", "evicted")

    def __init__(self, *, tracks_groups: bool = False) -> None:
        # Pool mode: group -> (tokens, samples) as generated, until it leaves the buffer (the
        # launcher `forget`s it): what an eviction is counted with. Window mode evicts nothing.
        self.groups: dict[int, tuple[int, int]] = {}
        self.tracks_groups = tracks_groups
        # Evicted before their TaskDone arrived (the learner's GroupsLeft and a generator's
        # TaskDone travel on different sockets): counted when it does.
        self.evicted_early: set[int] = set()
        self.run = {k: _Mean() for k in self.KINDS}
        self.since_step = {k: _Mean() for k in self.KINDS}

    def _add(self, kind: str, tokens: int, samples: int) -> None:
        self.run[kind].add(tokens, samples)
        self.since_step[kind].add(tokens, samples)

    def generated(self, group_id: int, *, tokens: int, samples: int) -> None:
        if group_id in self.evicted_early:
            self.evicted_early.discard(group_id)
            self._add("evicted", tokens, samples)
        elif self.tracks_groups:
            self.groups[group_id] = (tokens, samples)
        self._add("generated", tokens, samples)

    def trained(self, *, tokens: int, samples: int) -> None:
        self._add("trained", tokens, samples)

    def evicted(self, by_reason: Mapping[str, Iterable[int]]) -> None:
        for groups in by_reason.values():
            for group in groups:
                if group in self.groups:
                    self._add("evicted", *self.groups[group])
                else:
                    self.evicted_early.add(group)

    def forget(self, groups: Iterable[int]) -> None:
        """Groups that left the buffer for good (GroupsLeft.released, after `evicted`)."""
        for group in groups:
            self.groups.pop(group, None)

    def step_record(self) -> tuple[dict[str, float | None], dict[str, int]]:
        """(means, sample counts) since the previous call (mean None where nothing happened),
        then starts afresh."""
        out = (
            {k: m.value for k, m in self.since_step.items()},
            {k: m.samples for k, m in self.since_step.items()},
        )
        self.since_step = {k: _Mean() for k in self.KINDS}
        return out

    def summary(self) -> dict[str, float | None]:
        return {k: m.value for k, m in self.run.items()}
