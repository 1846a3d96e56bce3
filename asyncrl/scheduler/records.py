"""The launcher's records: the run state, `<run>/metrics.jsonl`, and what the monitor is handed.

Place in the data flow: the launcher (`scheduler/service.py`) turns what it hears (TasksDone,
StepDone, WeightsPublished, WeightsLoaded, Metrics) and what it does (spawn, restart) into one
record each through `Records.write`: a JSON line appended to metrics.jsonl, then handed to the
`RecordStream` the app layer wired in (the monitor's hub, `asyncrl/monitor/stream.py`: PUB socket,
dashboard, TensorBoard). While the run is up (`open` .. `close`), events (the launcher's log
lines) become `event` records and state updates throttled `launcher` records, a
`LauncherSnapshot` the scheduler builds itself (`launcher_snapshot`); a monitor that attaches
later, or replays the file, reads everything from records and never imports the scheduler.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import msgspec

from asyncrl.config import Config
from asyncrl.messages import LauncherSnapshot, LearnerMetrics, StepDone, TaskDone
from asyncrl.scheduler.lengths import LengthTally
from asyncrl.scheduler.modes import AdmissionMode

log = logging.getLogger(__name__)


@dataclass
class RunState:
    """Everything the live view and the summary need; updated by the launcher only."""

    total_steps: int
    max_staleness_bound: int
    launched: float = field(default_factory=time.perf_counter)  # the clock of every record's time_s
    started: float = field(default_factory=time.perf_counter)  # reset when training starts
    step: int = 0
    policy_version: int = 0
    trajectories_generated: int = 0
    trajectories_trained: int = 0
    tokens_generated: int = 0
    groups_admitted: int = 0
    groups_in_flight: int = 0
    max_staleness: int = 0
    last_reward: float = 0.0
    last_loss: float = 0.0
    last_clip_fraction: float = 0.0
    rewards: list[float] = field(default_factory=list)
    loaded_versions: dict[str, int] = field(default_factory=dict)  # generator slot -> version
    # The learner's latest metric record (None before its first step): the stall check and the
    # summary read its typed fields.
    learner_metrics: LearnerMetrics | None = None
    generator_restarts: int = 0
    waiting_workers: int = 0  # workers on other hosts waiting for a remote slot to free (remote.py)
    steps_skipped_nonfinite: int = 0  # updates the learner skipped (non-finite loss or gradient)
    tasks_requeued: int = 0
    stale_messages: int = 0  # from a generator process already replaced (dropped)
    rejected_frames: int = 0  # on the launcher's control socket (malformed, unknown peer, ...)
    auth_failures: int = 0  # connections this process refused at the CURVE handshake
    phase: str = "starting"
    rewards_tally: RewardTally = field(default_factory=lambda: RewardTally())
    lengths: LengthTally = field(default_factory=LengthTally)  # generated / trained / evicted
    last_progress: float = field(default_factory=time.monotonic)  # the last TaskDone or StepDone
    last_progress_what: str = "nothing yet"

    @property
    def elapsed_s(self) -> float:
        return time.perf_counter() - self.started

    def progressed(self, what: str) -> None:
        self.last_progress = time.monotonic()
        self.last_progress_what = what

    def task_done(self, msg: TaskDone, peer_id: str) -> None:
        """A generator finished a group: its counts, lengths and rewards."""
        self.groups_in_flight -= 1
        self.trajectories_generated += msg.num_trajectories
        self.tokens_generated += msg.num_tokens
        self.progressed(f"TaskDone of group {msg.task_id} from {peer_id}")
        self.lengths.generated(msg.task_id, tokens=msg.num_tokens, samples=msg.num_trajectories)
        self.rewards_tally.add(msg)

    def step_done(self, msg: StepDone) -> dict:
        """The learner finished a step: the state moves on; returns the step's metrics record
        (the StepDone, the rewards' running means, samples/s, the completion lengths since the
        last step)."""
        self.step = msg.step + 1
        self.policy_version = msg.version
        self.trajectories_trained += msg.num_trajectories
        self.steps_skipped_nonfinite += int(msg.skipped_nonfinite)
        self.max_staleness = max(self.max_staleness, msg.max_staleness)
        self.last_reward = msg.mean_reward
        self.last_loss = msg.loss
        self.last_clip_fraction = msg.clip_fraction
        self.rewards.append(msg.mean_reward)
        self.progressed(f"StepDone {msg.step}")
        record = msgspec.to_builtins(msg)
        if self.rewards_tally.sums:  # each reward's running mean (task.rewards)
            record["rewards"] = self.rewards_tally.means()
        record["samples_per_s"] = self.trajectories_trained / max(1e-9, self.elapsed_s)
        self.lengths.trained(tokens=msg.num_tokens, samples=msg.num_trajectories)
        # Mean completion lengths since the last step, and of how many samples.
        record["lengths"], record["length_samples"] = self.lengths.step_record()
        return record


@dataclass
class RewardTally:
    """The run's rewards, summed from TaskDones (task.rewards): per-reward means and failures."""

    sums: dict[str, float] = field(default_factory=dict)
    num_samples: int = 0  # samples whose final scores are in `sums`
    failures: dict[str, int] = field(default_factory=dict)  # failed reward calls, by reward name
    num_scored: int = 0  # scorings, redraws included
    num_score_failed: int = 0  # scorings with at least one failed reward
    num_regenerated: int = 0
    num_overlong: int = 0
    num_invalid: int = 0

    def add(self, msg: TaskDone) -> None:
        if msg.reward_sums:
            self.num_samples += msg.num_trajectories
        for name, value in msg.reward_sums.items():
            self.sums[name] = self.sums.get(name, 0.0) + value
        for name, n in msg.reward_failures.items():
            self.failures[name] = self.failures.get(name, 0) + n
        self.num_scored += msg.num_scored
        self.num_score_failed += msg.num_score_failed
        self.num_regenerated += msg.num_regenerated
        self.num_overlong += msg.num_overlong
        self.num_invalid += msg.num_invalid

    def means(self) -> dict[str, float]:
        return {name: total / max(1, self.num_samples) for name, total in self.sums.items()}

    def over_budget(self, budget: float, min_samples: int) -> str | None:
        """Why the run must stop (too many failed rewards), or None."""
        if self.num_scored < min_samples or self.num_score_failed <= budget * self.num_scored:
            return None
        by_name = ", ".join(f"{name}: {n}" for name, n in sorted(self.failures.items()))
        return (
            f"rewards failed on {self.num_score_failed} of {self.num_scored} scored samples "
            f"({self.num_score_failed / self.num_scored:.0%}; {by_name}), past task.scoring.failure_budget = "
            f"{budget:g}; the generator logs name each failure: fix the reward, or raise the budget"
        )


class Reporter(Protocol):
    """The user's view of a run (the CLI's dashboard or plain lines)."""

    def update(self, state: RunState) -> None: ...
    def event(self, text: str) -> None: ...


class RecordStream(Protocol):
    """Takes every record once it is in metrics.jsonl (the monitor's hub, wired by the app layer)."""

    # The run's reporter is one of the stream's own sinks: it sees events as `event` records and is
    # not told them a second time.
    feeds_reporter: bool

    def publish(self, record: dict, line: str) -> None: ...
    def close(self) -> None: ...


def launcher_snapshot(
    config: Config,
    state: RunState,
    mode: AdmissionMode,
    *,
    generator_slots: list[str],
    failure: str | None,
    interrupted: bool,
    final: bool = False,
) -> LauncherSnapshot:
    """What only the launcher knows, as one value (pure)."""
    groups_per_step = config.learner.groups_per_step
    bound = mode.admission.max_staleness  # in force now (moves with staleness.max_staleness = "auto")
    loaded = min((state.loaded_versions.get(g, 0) for g in generator_slots), default=0)
    used, free = mode.credits(steps_trained=state.step, loaded_version=loaded)
    status = ""
    if final:
        status = "failed" if failure else "interrupted" if interrupted else "completed"
    return LauncherSnapshot(
        phase=status or state.phase,
        mode=config.mode,
        policy=config.staleness.policy,
        total_steps=state.total_steps,
        groups_per_step=groups_per_step,
        samples_per_group=config.learner.samples_per_group,
        num_generators=config.generators.num_generators,
        max_staleness_bound=bound,
        step=state.step,
        policy_version=state.policy_version,
        trajectories_generated=state.trajectories_generated,
        trajectories_trained=state.trajectories_trained,
        tokens_generated=state.tokens_generated,
        groups_admitted=state.groups_admitted,
        groups_in_flight=state.groups_in_flight,
        credits_used=used,
        credits_total=(bound + 1) * groups_per_step,
        credits_free=free,
        restarts=state.generator_restarts,
        waiting_workers=state.waiting_workers,
        failure=failure,
        final=final,
        status=status,
    )


class Records:
    """metrics.jsonl, the stream, and the reporter; `open`/`close` bracket the running launcher."""

    def __init__(
        self,
        path: Path,
        reporter: Reporter,
        *,
        launched: float,
        snapshot_s: float,
        snapshot: Callable[[bool], LauncherSnapshot],
    ) -> None:
        self.file = open(path, "a", buffering=1)  # noqa: SIM115 - closed in close_file()
        self.reporter = reporter
        self.launched = launched
        self.snapshot_s = snapshot_s
        self.snapshot = snapshot  # final -> the launcher's snapshot now
        self.stream: RecordStream | None = None
        self.running = False
        self.last_phase: str | None = None
        self.last_snapshot = float("-inf")

    def write(self, kind: str, payload: dict) -> None:
        record = {**payload, "type": kind, "time_s": round(time.perf_counter() - self.launched, 4)}
        line = json.dumps(record)
        self.file.write(line + "\n")
        if self.stream is not None:
            self.stream.publish(record, line)

    def event(self, text: str, **fields) -> None:
        """A log line; `fields` go into its record as structured values (a monitor reads those,
        never the text)."""
        log.info(text)
        if not (self.running and self.stream is not None and self.stream.feeds_reporter):
            self.reporter.event(text)
        if self.running:
            self.write("event", {"text": text, **fields})

    def update(self, state: RunState) -> None:
        self.reporter.update(state)
        if self.running and (
            state.phase != self.last_phase or time.monotonic() - self.last_snapshot >= self.snapshot_s
        ):
            self.last_phase = state.phase
            self.write_snapshot()

    def write_snapshot(self, *, final: bool = False) -> None:
        self.last_snapshot = time.monotonic()
        self.write("launcher", msgspec.to_builtins(self.snapshot(final)))

    def open(self, stream: RecordStream | None) -> None:
        """The run is up: from now on events and snapshots are records too, and go to `stream`."""
        self.stream = stream
        self.running = True

    def close(self) -> None:
        """The final snapshot, then the stream closes; idempotent."""
        if not self.running:
            return
        self.write_snapshot(final=True)
        self.running = False
        if self.stream is not None:
            self.stream.close()
            self.stream = None

    def close_file(self) -> None:
        self.file.close()


def read_records(path: Path, kind: str) -> list[dict]:
    """The records of type `kind` in a metrics.jsonl (none when it is missing; a torn last line,
    from a run that was killed, is skipped)."""
    out = []
    try:
        lines = Path(path).read_text().splitlines()
    except OSError:
        return out
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and record.get("type") == kind:
            out.append(record)
    return out
