"""Hedged stragglers (pure): which tasks, outstanding far beyond what their peers take, are sent
to a second generator, and what each TaskDone means once a task has two copies.

Place in the data flow: the launcher (`scheduler/service.py`) reports each dispatch and each
TaskDone here with the clock, and on each supervision tick asks `due`: tasks outstanding longer
than `factor` x the median time of the last `WINDOW` tasks done (and at least `min_s`), not
hedged yet, each with the serving generator (not the one running it) with the fewest outstanding
tasks. The launcher sends that generator the same PromptTask. Both copies produce the same
traj_ids (`group_id * num_samples + sample_index`): the learner keeps the first copy of each
sample and drops the other, so a sample is trained once whichever copy it came from.

The ledger (`buffer/ledger.py`) knows one generator per task; this book keeps the second copy:
  * the first TaskDone of a hedged task closes it in the ledger (`TaskBook.done_by`, from either
    copy), and the other copy becomes `wasted`: its TaskDone, whenever it comes, is counted and
    dropped (its samples, already dropped by the learner, were never counted as generated);
  * the generator running the ledger's copy dies: the task passes to the hedge's generator (it is
    running it already) instead of being re-queued; the hedge's generator dies: the hedge is
    forgotten (the ledger's copy still runs).
Nothing trains twice, and the staleness bound holds: a hedge carries the task's window, and the
generator that gets it serves weights within the bound like any other.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field

# The median is taken over this many recent tasks (peers of the one outstanding).
WINDOW = 64
# No hedging before this many tasks are done: a median of a handful says little.
MIN_DONE = 4


@dataclass
class HedgeCounts:
    tasks_hedged: int = 0  # tasks sent to a second generator
    hedges_won: int = 0  # ... whose second copy finished first
    hedges_wasted: int = 0  # copies finished after the other, dropped
    samples_wasted: int = 0  # their samples (generated twice, trained once)


@dataclass
class HedgeBook:
    factor: float  # a task outstanding this many times the median is hedged (0: never)
    min_s: float  # ... and at least this long
    sent_at: dict[int, tuple[str, float]] = field(default_factory=dict)  # task -> (peer, when)
    hedges: dict[int, str] = field(default_factory=dict)  # task -> the peer running its second copy
    wasted: dict[int, set[str]] = field(default_factory=dict)  # task -> peers whose copy lost
    durations: deque[float] = field(default_factory=lambda: deque(maxlen=WINDOW))
    counts: HedgeCounts = field(default_factory=HedgeCounts)

    @property
    def enabled(self) -> bool:
        return self.factor > 0

    def dispatched(self, task_id: int, peer: str, now: float) -> None:
        self.sent_at[task_id] = (peer, now)

    def due(self, now: float, serving: dict[str, int]) -> list[tuple[int, str, str]]:
        """(task, its peer, the peer to hedge on) for each task overdue; `serving`: serving
        generators and their outstanding tasks (updated here as hedges are planned)."""
        if not self.enabled or len(self.durations) < MIN_DONE or len(serving) < 2:
            return []
        limit = max(self.min_s, self.factor * statistics.median(self.durations))
        out = []
        for task_id, (peer, since) in sorted(self.sent_at.items(), key=lambda item: item[1][1]):
            if now - since <= limit:
                break  # the rest were sent later
            if task_id in self.hedges:
                continue
            others = [p for p in serving if p != peer]
            if not others:
                continue
            to = min(others, key=lambda p: serving[p])
            serving[to] += 1
            self.hedges[task_id] = to
            self.counts.tasks_hedged += 1
            out.append((task_id, peer, to))
        return out

    def copy_of(self, task_id: int, peer: str) -> str:
        """What a TaskDone of `task_id` from `peer` is: "wasted" (the other copy finished first:
        drop it), "hedge" (the second copy finished first), or "" (the ledger's own copy)."""
        if peer in self.wasted.get(task_id, ()):
            return "wasted"
        return "hedge" if self.hedges.get(task_id) == peer else ""

    def done(self, task_id: int, peer: str, now: float) -> str | None:
        """The first TaskDone of `task_id` (from `peer`, either copy); the peer whose copy is now
        wasted, if the task was hedged."""
        sent = self.sent_at.pop(task_id, None)
        if sent is not None:
            self.durations.append(now - sent[1])
        other = self.hedges.pop(task_id, None)
        if other is None:
            return None
        if other == peer:  # the hedge won; the ledger's copy runs on
            self.counts.hedges_won += 1
            other = sent[0] if sent is not None else None
        if other is not None:
            self.wasted.setdefault(task_id, set()).add(other)
        return other

    def wasted_done(self, task_id: int, peer: str, num_samples: int) -> None:
        """The losing copy's TaskDone came: counted, dropped."""
        peers = self.wasted.get(task_id, set())
        peers.discard(peer)
        if not peers:
            self.wasted.pop(task_id, None)
        self.counts.hedges_wasted += 1
        self.counts.samples_wasted += num_samples

    def generator_failed(self, peer: str, requeued: list[int]) -> dict[int, str]:
        """`peer` died with `requeued` tasks (the ledger's copies): those hedged elsewhere pass to
        their hedge's generator (task -> peer; not hedged again); hedges `peer` ran are forgotten."""
        passed = {t: self.hedges.pop(t) for t in requeued if t in self.hedges}
        for t in requeued:
            self.sent_at.pop(t, None)
        for t in [t for t, p in self.hedges.items() if p == peer]:
            del self.hedges[t]
        for t in [t for t, peers in self.wasted.items() if peers <= {peer}]:
            del self.wasted[t]
        for peers in self.wasted.values():
            peers.discard(peer)
        return passed
