"""The launcher's records and its `launcher` snapshot, without a launcher: the record format the
monitor reads, the credits of both admission modes, events and snapshots only while running."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec

from asyncrl.config_load import load_config
from asyncrl.messages import GroupsLeft, LauncherSnapshot
from asyncrl.scheduler.modes import PoolMode, WindowMode, make_mode
from asyncrl.scheduler.records import Records, RunState, launcher_snapshot
from asyncrl.scheduler.tasks import TaskBook

# The fields of a `launcher` record, in order (the monitor and the dashboard read them).
SNAPSHOT_KEYS = [
    "phase",
    "mode",
    "policy",
    "total_steps",
    "groups_per_step",
    "samples_per_group",
    "num_generators",
    "max_staleness_bound",
    "step",
    "policy_version",
    "trajectories_generated",
    "trajectories_trained",
    "tokens_generated",
    "groups_admitted",
    "groups_in_flight",
    "credits_used",
    "credits_total",
    "credits_free",
    "restarts",
    "failure",
]


def config(*overrides: str):
    return load_config(
        overrides=[
            "learner.groups_per_step=4",
            "staleness.max_staleness=1",
            "generators.num_generators=2",
            *overrides,
        ]
    )


def test_window_snapshot_counts_credits_against_the_loaded_version():
    cfg = config()
    mode = make_mode(cfg)
    assert isinstance(mode, WindowMode)
    state = RunState(total_steps=cfg.learner.steps, max_staleness_bound=1, step=1, generator_restarts=2)
    state.loaded_versions = {"gen-0": 1}  # gen-1 has loaded nothing yet: version 0 counts
    mode.admit(0)  # 8 groups: steps 0 and 1
    snap = launcher_snapshot(
        cfg, state, mode, generator_slots=["gen-0", "gen-1"], failure=None, interrupted=False
    )
    record = msgspec.to_builtins(snap)
    assert list(record) == SNAPSHOT_KEYS
    # Step 0 trained: 4 of the 8 admitted are still in the window; at version 0 the limit is 8.
    assert (record["credits_used"], record["credits_total"], record["credits_free"]) == (4, 8, 0)
    assert record["restarts"] == 2 and record["failure"] is None and record["phase"] == "starting"
    state.loaded_versions["gen-1"] = 1
    snap = launcher_snapshot(
        cfg, state, mode, generator_slots=["gen-0", "gen-1"], failure=None, interrupted=False
    )
    assert snap.credits_free == 4


def test_pool_snapshot_counts_outstanding_credits():
    cfg = config('buffer.mode="pool"')
    mode = make_mode(cfg)
    assert isinstance(mode, PoolMode)
    state = RunState(total_steps=cfg.learner.steps, max_staleness_bound=1)
    slots = {"generator_slots": ["gen-0", "gen-1"], "failure": None, "interrupted": False}
    snap = launcher_snapshot(cfg, state, mode, **slots)
    assert (snap.credits_used, snap.credits_total, snap.credits_free) == (0, 8, 8)
    mode.admit(0)
    book = TaskBook(groups_per_step=4, samples_per_group=4)
    mode.on_groups_left(book, GroupsLeft(version=1, released=[0, 1, 2]))
    # Released groups hold their credits until the generators load version 1.
    assert mode.credits(steps_trained=1, loaded_version=0) == (8, 0)
    assert mode.admit(1) == range(8, 11) and mode.credits(steps_trained=1, loaded_version=1) == (8, 0)


def test_final_snapshot_names_the_status_in_phase_and_status():
    cfg = config()
    state = RunState(total_steps=3, max_staleness_bound=1, phase="stopping")
    mode = make_mode(cfg)
    kwargs = {"generator_slots": ["gen-0"], "final": True}
    failed = launcher_snapshot(cfg, state, mode, failure="learner died", interrupted=False, **kwargs)
    record = msgspec.to_builtins(failed)
    assert list(record) == [*SNAPSHOT_KEYS, "final", "status"]
    assert (record["phase"], record["status"], record["final"]) == ("failed", "failed", True)
    stopped = launcher_snapshot(cfg, state, mode, failure=None, interrupted=True, **kwargs)
    assert (stopped.phase, stopped.status) == ("interrupted", "interrupted")


class Reporter:
    def __init__(self) -> None:
        self.events: list[str] = []
        self.updates = 0

    def update(self, state) -> None:
        self.updates += 1

    def event(self, text: str) -> None:
        self.events.append(text)


class Sink:
    def __init__(self, feeds_reporter: bool) -> None:
        self.feeds_reporter = feeds_reporter
        self.records: list[dict] = []
        self.closed = 0

    def publish(self, record: dict, line: str) -> None:
        assert json.loads(line) == record
        self.records.append(record)

    def close(self) -> None:
        self.closed += 1


def snapshot_of(phase: str):
    def snapshot(final: bool) -> LauncherSnapshot:
        cfg = config()
        state = RunState(total_steps=3, max_staleness_bound=1, phase=phase)
        return launcher_snapshot(
            cfg,
            state,
            make_mode(cfg),
            generator_slots=["gen-0"],
            failure=None,
            interrupted=False,
            final=final,
        )

    return snapshot


def read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_events_and_snapshots_become_records_only_while_the_run_is_up(tmp_path):
    reporter, sink = Reporter(), Sink(feeds_reporter=True)
    path = tmp_path / "metrics.jsonl"
    records = Records(path, reporter, launched=0.0, snapshot_s=3600.0, snapshot=snapshot_of("training"))
    state = RunState(total_steps=3, max_staleness_bound=1)
    records.event("before")  # not running: the reporter only
    records.update(state)
    records.write("task", {"task_id": 0})
    records.open(sink)
    records.event("during")  # the sink feeds the reporter: told once, as a record
    state.phase = "training"
    records.update(state)  # a new phase: a snapshot
    records.update(state)  # same phase, within snapshot_s: none
    records.close()
    records.close()
    records.event("after")
    records.close_file()
    assert reporter.events == ["before", "after"] and reporter.updates == 3
    kinds = [r["type"] for r in read(path)]
    assert kinds == ["task", "event", "launcher", "launcher"]
    assert [r["type"] for r in sink.records] == kinds[1:] and sink.closed == 1
    final = read(path)[-1]
    assert final["final"] is True and final["status"] == "completed" and "time_s" in final


def test_a_reporter_not_fed_by_the_sink_still_hears_events(tmp_path):
    reporter = Reporter()
    records = Records(
        tmp_path / "metrics.jsonl", reporter, launched=0.0, snapshot_s=0.0, snapshot=snapshot_of("x")
    )
    records.open(Sink(feeds_reporter=False))
    records.event("started learner")
    records.close()
    records.close_file()
    assert reporter.events == ["started learner"]
    assert [r["type"] for r in read(tmp_path / "metrics.jsonl")] == ["event", "launcher"]
