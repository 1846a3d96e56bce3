"""The sample ledger: a pure state machine over every prompt task and trajectory.

It makes "no sample lost or duplicated" (DESIGN.md, "Where it must be strong") measurable. The
scheduler and learner services report each event; the ledger checks the transition, keeps counts,
and checkpoints to bytes (msgspec, deterministic).

Tasks (one per group; `num_samples` slots, indexed by sample_index):

    admit -> ADMITTED --dispatch(gen)--> IN_FLIGHT --task_done--> GENERATED
                 |                        |    ^
                 | cancel_task     requeue |    | dispatch(gen')      (generator_failed(gen) requeues
                 v                        v    |                       each of its in-flight tasks once)
              EVICTED <--cancel_task--- REQUEUED

Trajectories (reported by the learner as they move):

    generated -> GENERATED --buffered--> BUFFERED --trained--> TRAINED (replayed: count only)
                    |                       |
                    +-------evicted---------+--> EVICTED

TRAINED and EVICTED are terminal for trajectories; GENERATED and EVICTED are terminal for tasks.
Illegal transitions raise ValueError naming the id and both states.

A slot is resolved once one of its trajectories is TRAINED or EVICTED (or its task is cancelled
before the slot got a trajectory); it is pending while a trajectory for it is live or its task is
still being generated; otherwise it is lost (the generator said done but the sample never arrived).
Duplicates: a traj_id seen twice (not recorded again), a (task, sample_index) seen twice (recorded),
a task trained on more trajectories than `num_samples`.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from typing import NamedTuple

import msgspec

SNAPSHOT_FORMAT = 1


class TaskState(enum.StrEnum):
    ADMITTED = "admitted"
    IN_FLIGHT = "in_flight"
    REQUEUED = "requeued"
    GENERATED = "generated"
    EVICTED = "evicted"


class TrajState(enum.StrEnum):
    GENERATED = "generated"
    BUFFERED = "buffered"
    TRAINED = "trained"
    EVICTED = "evicted"


class Arrival(enum.StrEnum):
    """Verdict of `Ledger.generated`: what the learner should do with an arriving trajectory."""

    NEW = "new"
    DUPLICATE_ID = "duplicate_id"  # not recorded; drop it
    DUPLICATE_SAMPLE = "duplicate_sample"  # recorded (if its task is not compacted); better dropped


_LIVE = (TrajState.GENERATED, TrajState.BUFFERED)
_GENERATING = (TaskState.ADMITTED, TaskState.IN_FLIGHT, TaskState.REQUEUED)


class TaskRecord(msgspec.Struct, kw_only=True):
    task_id: int
    group_id: int
    num_samples: int
    state: TaskState = TaskState.ADMITTED
    generator_id: str = ""  # the generator it is (or was last) in flight on
    num_requeues: int = 0
    num_trained: int = 0


class TrajRecord(msgspec.Struct, kw_only=True):
    traj_id: int
    task_id: int
    sample_index: int
    state: TrajState = TrajState.GENERATED
    num_tokens: int = 0
    evict_reason: str = ""
    num_replays: int = 0


class LedgerCounters(msgspec.Struct, kw_only=True):
    """Running totals; they survive `compact()`, so they are checkpointed as they are."""

    tasks_by_state: dict[str, int] = msgspec.field(default_factory=lambda: {s.value: 0 for s in TaskState})
    trajectories_by_state: dict[str, int] = msgspec.field(
        default_factory=lambda: {s.value: 0 for s in TrajState}
    )
    evicted_by_reason: dict[str, int] = msgspec.field(default_factory=dict)  # trajectories
    num_requeues: int = 0
    num_duplicate_ids: int = 0
    num_duplicate_samples: int = 0
    num_overtrained: int = 0  # trainings beyond a task's num_samples
    num_replays: int = 0
    num_samples_expected: int = 0
    num_samples_trained: int = 0  # slots resolved by a trained trajectory
    num_samples_evicted: int = 0  # slots resolved by an evicted trajectory or a cancelled task


class LedgerSnapshot(msgspec.Struct, kw_only=True, frozen=True):
    format: int
    tasks: list[TaskRecord]
    trajectories: list[TrajRecord]
    closed_task_ids: list[int]  # compacted tasks: any new trajectory for them is a duplicate
    counters: LedgerCounters


class LedgerSummary(NamedTuple):
    num_tasks: int
    tasks_by_state: dict[str, int]
    num_trajectories: int
    trajectories_by_state: dict[str, int]
    evicted_by_reason: dict[str, int]
    num_requeues: int
    num_replays: int
    num_samples_expected: int  # sum of num_samples over admitted tasks
    num_samples_trained: int
    num_samples_evicted: int
    num_samples_pending: int
    num_samples_lost: int  # expected == trained + evicted + pending + lost
    num_duplicate_ids: int
    num_duplicate_samples: int
    num_overtrained: int
    num_duplicated: int  # sum of the three duplicate counts


class _Slots:
    """Derived per-task index (rebuilt on load): live trajectories and resolved slots."""

    __slots__ = ("traj_ids", "seen", "live", "resolved")

    def __init__(self) -> None:
        self.traj_ids: list[int] = []
        self.seen: set[int] = set()  # sample indices with at least one trajectory
        self.live: dict[int, int] = {}  # sample_index -> live trajectories
        self.resolved: set[int] = set()


class Ledger:
    """Records tasks and trajectories; see the module docstring for states and definitions."""

    def __init__(self) -> None:
        self._tasks: dict[int, TaskRecord] = {}
        self._trajs: dict[int, TrajRecord] = {}
        self._slots: dict[int, _Slots] = {}
        self._in_flight: dict[str, set[int]] = {}  # generator_id -> task ids
        self._open: set[int] = set()  # tasks with slots pending or lost
        self._closed: set[int] = set()  # compacted task ids
        self._counters = LedgerCounters()

    # ------------------------------------------------------------------------------ tasks

    def admit(self, task_id: int, *, group_id: int, num_samples: int) -> None:
        if num_samples < 1:
            raise ValueError(f"task {task_id}: num_samples must be >= 1, got {num_samples}")
        if task_id in self._tasks or task_id in self._closed:
            raise ValueError(f"task {task_id}: cannot admit, already admitted")
        self._tasks[task_id] = TaskRecord(task_id=task_id, group_id=group_id, num_samples=num_samples)
        self._slots[task_id] = _Slots()
        self._open.add(task_id)
        self._counters.tasks_by_state[TaskState.ADMITTED] += 1
        self._counters.num_samples_expected += num_samples

    def dispatch(self, task_id: int, *, generator_id: str) -> None:
        task = self._task(task_id)
        self._move_task(task, "dispatch", (TaskState.ADMITTED, TaskState.REQUEUED), TaskState.IN_FLIGHT)
        task.generator_id = generator_id
        self._in_flight.setdefault(generator_id, set()).add(task_id)

    def task_done(self, task_id: int, *, generator_id: str | None = None) -> None:
        """The generator sent every sample of the task (they may still be on the wire)."""
        task = self._task(task_id)
        if (
            generator_id is not None
            and task.state == TaskState.IN_FLIGHT
            and task.generator_id != generator_id
        ):
            raise ValueError(
                f"task {task_id}: done reported by {generator_id!r}, but in flight on {task.generator_id!r}"
            )
        self._move_task(task, "task_done", (TaskState.IN_FLIGHT,), TaskState.GENERATED)
        self._in_flight[task.generator_id].discard(task_id)
        self._maybe_close(task)

    def requeue(self, task_id: int) -> None:
        task = self._task(task_id)
        self._move_task(task, "requeue", (TaskState.IN_FLIGHT,), TaskState.REQUEUED)
        self._in_flight[task.generator_id].discard(task_id)
        task.num_requeues += 1
        self._counters.num_requeues += 1

    def generator_failed(self, generator_id: str) -> list[int]:
        """Requeue every task in flight on `generator_id`; returns them sorted.

        Each task is requeued once per failure: a repeated report finds nothing in flight.
        """
        task_ids = sorted(self._in_flight.get(generator_id, ()))
        for task_id in task_ids:
            self.requeue(task_id)
        return task_ids

    def cancel_task(self, task_id: int) -> None:
        """Give up on a task not being generated; its slots without a trajectory count as evicted."""
        task = self._task(task_id)
        self._move_task(task, "cancel_task", (TaskState.ADMITTED, TaskState.REQUEUED), TaskState.EVICTED)
        slots = self._slots[task_id]
        for index in range(task.num_samples):
            if index not in slots.resolved and not slots.live.get(index):
                slots.resolved.add(index)
                self._counters.num_samples_evicted += 1
        self._maybe_close(task)

    def tasks_in_flight(self, generator_id: str) -> list[int]:
        return sorted(self._in_flight.get(generator_id, ()))

    def is_in_flight(self, task_id: int, generator_id: str) -> bool:
        return task_id in self._in_flight.get(generator_id, ())

    def missing_samples(self, task_id: int) -> list[int]:
        """Sample indices of a task that have no trajectory yet (what a requeue must regenerate)."""
        task = self._task(task_id)
        seen = self._slots[task_id].seen
        return [i for i in range(task.num_samples) if i not in seen]

    # ------------------------------------------------------------------------------ trajectories

    def generated(self, traj_id: int, *, task_id: int, sample_index: int, num_tokens: int = 0) -> Arrival:
        """A trajectory arrived. Duplicates are counted, never raised (see `Arrival`)."""
        if traj_id in self._trajs:
            self._counters.num_duplicate_ids += 1
            return Arrival.DUPLICATE_ID
        if task_id in self._closed:
            self._counters.num_duplicate_samples += 1
            return Arrival.DUPLICATE_SAMPLE
        task = self._task(task_id)
        if task.state not in (TaskState.IN_FLIGHT, TaskState.GENERATED, TaskState.REQUEUED):
            raise ValueError(
                f"trajectory {traj_id}: task {task_id} is {task.state}, no trajectory can arrive for it"
            )
        if not 0 <= sample_index < task.num_samples:
            raise ValueError(
                f"trajectory {traj_id}: sample_index {sample_index} not in [0, {task.num_samples})"
            )
        slots = self._slots[task_id]
        verdict = Arrival.NEW
        if sample_index in slots.seen:
            self._counters.num_duplicate_samples += 1
            verdict = Arrival.DUPLICATE_SAMPLE
        self._trajs[traj_id] = TrajRecord(
            traj_id=traj_id, task_id=task_id, sample_index=sample_index, num_tokens=num_tokens
        )
        slots.traj_ids.append(traj_id)
        slots.seen.add(sample_index)
        slots.live[sample_index] = slots.live.get(sample_index, 0) + 1
        self._counters.trajectories_by_state[TrajState.GENERATED] += 1
        self._open.add(task_id)
        return verdict

    def buffered(self, traj_id: int) -> None:
        self._move_traj(self._traj(traj_id), "buffered", (TrajState.GENERATED,), TrajState.BUFFERED)

    def trained(self, traj_id: int) -> None:
        traj = self._traj(traj_id)
        self._move_traj(traj, "trained", (TrajState.BUFFERED,), TrajState.TRAINED)
        task = self._tasks[traj.task_id]
        task.num_trained += 1
        if task.num_trained > task.num_samples:
            self._counters.num_overtrained += 1
        self._settle(traj, trained=True)

    def replayed(self, traj_id: int, *, task_id: int | None = None) -> None:
        """A trained trajectory was used again (buffer replay): counted, no state change. With
        `task_id`, a trajectory of a task no longer recorded (compacted, or trained before a
        resume) is counted too."""
        if task_id is not None and traj_id not in self._trajs and task_id not in self._tasks:
            self._counters.num_replays += 1
            return
        traj = self._traj(traj_id)
        if traj.state != TrajState.TRAINED:
            raise ValueError(
                f"trajectory {traj_id}: cannot replay from {traj.state} (replayed needs trained)"
            )
        traj.num_replays += 1
        self._counters.num_replays += 1

    def evicted(self, traj_id: int, *, reason: str) -> None:
        traj = self._traj(traj_id)
        self._move_traj(traj, "evicted", _LIVE, TrajState.EVICTED)
        traj.evict_reason = reason
        by_reason = self._counters.evicted_by_reason
        by_reason[reason] = by_reason.get(reason, 0) + 1
        self._settle(traj, trained=False)

    # ------------------------------------------------------------------------------ reports

    def lost(self, *, at_end: bool = False) -> list[tuple[int, int]]:
        """(task_id, sample_index) of lost slots; with at_end=True pending slots count as lost."""
        return sorted(slot for slot, status in self._open_slots() if status == "lost" or at_end)

    def summary(self, *, at_end: bool = False) -> LedgerSummary:
        """Counts; O(open tasks x num_samples). at_end=True folds pending slots into lost."""
        num_pending = num_lost = 0
        for _, status in self._open_slots():
            if status == "lost" or at_end:
                num_lost += 1
            else:
                num_pending += 1
        c = self._counters
        return LedgerSummary(
            num_tasks=sum(c.tasks_by_state.values()),
            tasks_by_state=dict(c.tasks_by_state),
            num_trajectories=sum(c.trajectories_by_state.values()),
            trajectories_by_state=dict(c.trajectories_by_state),
            evicted_by_reason=dict(sorted(c.evicted_by_reason.items())),
            num_requeues=c.num_requeues,
            num_replays=c.num_replays,
            num_samples_expected=c.num_samples_expected,
            num_samples_trained=c.num_samples_trained,
            num_samples_evicted=c.num_samples_evicted,
            num_samples_pending=num_pending,
            num_samples_lost=num_lost,
            num_duplicate_ids=c.num_duplicate_ids,
            num_duplicate_samples=c.num_duplicate_samples,
            num_overtrained=c.num_overtrained,
            num_duplicated=c.num_duplicate_ids + c.num_duplicate_samples + c.num_overtrained,
        )

    def open_tasks(self) -> list[int]:
        """Tasks with a sample slot not yet resolved (trained or evicted), sorted."""
        return sorted(self._open)

    def compact(self) -> int:
        """Forget the records of closed tasks (counts are kept); returns how many were forgotten.

        A later trajectory for a forgotten task is reported as DUPLICATE_SAMPLE and not recorded;
        a reused traj_id of a forgotten trajectory is no longer detected.
        """
        closed = [t for t in self._tasks if t not in self._open]
        for task_id in closed:
            del self._tasks[task_id]
            for traj_id in self._slots.pop(task_id).traj_ids:
                del self._trajs[traj_id]
            self._closed.add(task_id)
        return len(closed)

    # ------------------------------------------------------------------------------ checkpoints

    def to_bytes(self) -> bytes:
        """Deterministic msgpack: equal ledgers give equal bytes."""
        snapshot = LedgerSnapshot(
            format=SNAPSHOT_FORMAT,
            tasks=[self._tasks[t] for t in sorted(self._tasks)],
            trajectories=[self._trajs[t] for t in sorted(self._trajs)],
            closed_task_ids=sorted(self._closed),
            counters=self._counters,
        )
        return msgspec.msgpack.encode(snapshot, order="deterministic")

    @classmethod
    def from_bytes(cls, data: bytes) -> Ledger:
        snapshot = msgspec.msgpack.decode(data, type=LedgerSnapshot)
        if snapshot.format != SNAPSHOT_FORMAT:
            raise ValueError(f"ledger snapshot format {snapshot.format}, expected {SNAPSHOT_FORMAT}")
        ledger = cls()
        ledger._counters = snapshot.counters
        ledger._closed = set(snapshot.closed_task_ids)
        for task in snapshot.tasks:
            ledger._tasks[task.task_id] = task
            ledger._slots[task.task_id] = _Slots()
            if task.state == TaskState.IN_FLIGHT:
                ledger._in_flight.setdefault(task.generator_id, set()).add(task.task_id)
        ledger._rebuild_slots(snapshot.trajectories)
        return ledger

    # ------------------------------------------------------------------------------ internals

    def _rebuild_slots(self, trajectories: Iterable[TrajRecord]) -> None:
        for traj in trajectories:
            self._trajs[traj.traj_id] = traj
            slots = self._slots[traj.task_id]
            slots.traj_ids.append(traj.traj_id)
            slots.seen.add(traj.sample_index)
            if traj.state in _LIVE:
                slots.live[traj.sample_index] = slots.live.get(traj.sample_index, 0) + 1
            else:
                slots.resolved.add(traj.sample_index)
        for task_id, task in self._tasks.items():
            slots = self._slots[task_id]
            if task.state == TaskState.EVICTED:
                slots.resolved.update(i for i in range(task.num_samples) if not slots.live.get(i))
            if not self._is_closed(task):
                self._open.add(task_id)

    def _task(self, task_id: int) -> TaskRecord:
        task = self._tasks.get(task_id)
        if task is None:
            raise ValueError(f"task {task_id}: unknown (never admitted, or compacted)")
        return task

    def _traj(self, traj_id: int) -> TrajRecord:
        traj = self._trajs.get(traj_id)
        if traj is None:
            raise ValueError(f"trajectory {traj_id}: unknown (never generated, or compacted)")
        return traj

    def _move_task(
        self, task: TaskRecord, event: str, allowed: tuple[TaskState, ...], target: TaskState
    ) -> None:
        if task.state not in allowed:
            raise ValueError(
                f"task {task.task_id}: cannot go {task.state} -> {target} "
                f"({event} needs {' or '.join(allowed)})"
            )
        self._counters.tasks_by_state[task.state] -= 1
        self._counters.tasks_by_state[target] += 1
        task.state = target

    def _move_traj(
        self, traj: TrajRecord, event: str, allowed: tuple[TrajState, ...], target: TrajState
    ) -> None:
        if traj.state not in allowed:
            raise ValueError(
                f"trajectory {traj.traj_id}: cannot go {traj.state} -> {target} "
                f"({event} needs {' or '.join(allowed)})"
            )
        self._counters.trajectories_by_state[traj.state] -= 1
        self._counters.trajectories_by_state[target] += 1
        traj.state = target

    def _settle(self, traj: TrajRecord, *, trained: bool) -> None:
        """A trajectory reached a terminal state: update its slot and maybe close its task."""
        slots = self._slots[traj.task_id]
        slots.live[traj.sample_index] -= 1
        if traj.sample_index not in slots.resolved:
            slots.resolved.add(traj.sample_index)
            if trained:
                self._counters.num_samples_trained += 1
            else:
                self._counters.num_samples_evicted += 1
        self._maybe_close(self._tasks[traj.task_id])

    def _is_closed(self, task: TaskRecord) -> bool:
        slots = self._slots[task.task_id]
        return (
            task.state in (TaskState.GENERATED, TaskState.EVICTED)
            and len(slots.resolved) == task.num_samples
            and not any(slots.live.values())
        )

    def _maybe_close(self, task: TaskRecord) -> None:
        if self._is_closed(task):
            self._open.discard(task.task_id)

    def _open_slots(self) -> Iterable[tuple[tuple[int, int], str]]:
        """((task_id, sample_index), "pending" | "lost") for every unresolved slot."""
        for task_id in sorted(self._open):
            task = self._tasks[task_id]
            slots = self._slots[task_id]
            for index in range(task.num_samples):
                if index in slots.resolved:
                    continue
                if slots.live.get(index) or task.state in _GENERATING:
                    yield (task_id, index), "pending"
                else:
                    yield (task_id, index), "lost"
