"""Typed records: the metric records keep their flat names on the wire's view and in
metrics.jsonl, decisions read typed fields, workers get typed process arguments, and summary.json
is written from a struct whose every key docs/monitor.md lists."""

from __future__ import annotations

import json
import re
from pathlib import Path

import msgspec
import pytest

from asyncrl.messages import (
    GeneratorMetrics,
    LearnerMetrics,
    Message,
    Metrics,
    TeacherMetrics,
    WorkerArgs,
)
from asyncrl.runtime import JOIN_FILE, child_args, read_join_info, worker_argv
from asyncrl.scheduler.records import RunState
from asyncrl.scheduler.spawner import JoinSpawner
from asyncrl.scheduler.summary import RunSummary, write_summary
from asyncrl.scheduler.tasks import TaskBook, stall_reason

ROOT = Path(__file__).resolve().parents[2]


def learner_record(**changes) -> LearnerMetrics:
    fields = dict(
        idle_ratio=0.25,
        busy_s=3.0,
        idle_s=1.0,
        tail_s=0.5,
        threads=2,
        streaming=True,
        streamed=7,
        deferred=1,
        stream_peak_bytes=1024,
        open_group_bound=405,
        skipped_nonfinite=0,
        duplicates=2,
        resume_restored=0,
        resume_regenerated=0,
        invalid_trajectories=0,
        rejected_frames=3,
        auth_failures=0,
        publish_s=0.03,
        held_trajectories=256,
        held_windows=1,
    )
    return LearnerMetrics(**{**fields, **changes})


def decoded(msg: Metrics) -> Metrics:
    return msgspec.msgpack.Decoder(Message).decode(msgspec.msgpack.encode(msg))


def test_the_learner_record_shows_the_flat_names_metrics_jsonl_had():
    record = learner_record(
        buffer={"buffer/withheld": 4.0}, teacher_staleness_mean=0.5, teacher_staleness_max=1.0
    )
    values = decoded(Metrics(source="learner", time_s=1.0, record=record)).values
    assert list(values) == [
        "learner/idle_ratio",
        "learner/busy_s",
        "learner/idle_s",
        "learner/tail_s",
        "learner/threads",
        "learner/streaming",
        "learner/streamed",
        "learner/deferred",
        "learner/stream_peak_bytes",
        "learner/open_group_bound",
        "learner/skipped_nonfinite",
        "learner/duplicates",
        "learner/resume_restored",
        "learner/resume_regenerated",
        "learner/invalid_trajectories",
        "learner/rejected_frames",
        "learner/auth_failures",
        "learner/publish_s",
        "buffer/held_trajectories",
        "buffer/held_windows",
        "buffer/withheld",
        "opd/teacher_staleness_mean",
        "opd/teacher_staleness_max",
    ]
    assert all(type(v) is float for v in values.values())
    assert values["learner/streaming"] == 1.0 and values["learner/open_group_bound"] == 405.0
    # Without self-distillation the opd names are absent, as before.
    assert "opd/teacher_staleness_mean" not in learner_record().values()


def test_generator_and_teacher_records_keep_their_names():
    gen = GeneratorMetrics(
        samples=128,
        tokens=544,
        busy_ratio=0.5,
        version=1,
        rejected_frames=0,
        weights_load_errors=0,
        weights_load_s=0.0,
        weights_fetch_bytes=10,
        weights_delta_fetches=0,
        weights_refused_locations=0,
        weights_network_bytes=0,
        inflight_updates=0,
        teacher_s=0.0,
        teacher_version=-1,
    )
    msg = decoded(Metrics(source="gen-0", time_s=1.0, record=gen))
    assert isinstance(msg.record, GeneratorMetrics) and msg.record.version == 1
    assert msg.values["gen/samples"] == 128.0 and msg.values["gen/teacher_version"] == -1.0
    assert all(k.startswith("gen/") for k in msg.values) and len(msg.values) == 14
    teacher = TeacherMetrics(
        requests=4, batches=2, sequences=8, bad_requests=0, undeliverable=0, rejected_frames=0, busy_ratio=0.1
    )
    assert (
        decoded(Metrics(source="opd-teacher", time_s=1.0, record=teacher)).values["teacher/requests"] == 4.0
    )


def test_the_stall_reason_reads_the_learners_typed_record():
    state = RunState(total_steps=4, max_staleness_bound=1)
    state.phase = "training"
    state.last_progress = 0.0
    book = TaskBook(groups_per_step=2, samples_per_group=2)
    assert stall_reason(state, book, [], timeout_s=10.0, now=100.0) is None  # nothing open, nothing rejected
    state.learner_metrics = learner_record(invalid_trajectories=3)
    reason = stall_reason(state, book, [], timeout_s=10.0, now=100.0)
    assert reason is not None and "the learner rejected 3 trajectories" in reason


def test_worker_arguments_travel_as_one_json_argument():
    args = WorkerArgs(
        model="/m", index=2, data="tcp://127.0.0.1:5", generators=("gen-0", "gen-1"), resume_version=3
    )
    argv = worker_argv(ctrl_address="tcp://127.0.0.1:1", peer_id="gen-2", run_dir="/run", args=args)
    parsed = child_args(argv)
    assert parsed.worker_args == args and parsed.peer_id == "gen-2" and parsed.run_dir == "/run"
    assert child_args(argv[:6]).worker_args == WorkerArgs()  # none given: every default
    with pytest.raises(SystemExit):  # a key no role reads is a usage error, not silently dropped
        child_args([*argv[:6], "--args", '{"modle": "/m"}'])


def test_the_torchrun_join_file_holds_the_learners_arguments(tmp_path):
    args = WorkerArgs(model="/m", generators=("gen-0",), resume_version=5)
    handle = JoinSpawner(inner=None, run_dir=tmp_path, joined=frozenset({"learner"})).start(
        "learner", "asyncrl.learner.service", ctrl_address="tcp://127.0.0.1:9", args=args
    )
    info = read_join_info(tmp_path / JOIN_FILE)
    assert (info.ctrl, info.peer_id, info.args) == ("tcp://127.0.0.1:9", "learner", args)
    assert handle.pid == 0


def summary_keys() -> list[str]:
    return [f.encode_name for f in msgspec.structs.fields(RunSummary)]


def test_summary_json_is_written_from_the_struct_nan_included(tmp_path):
    from asyncrl.scheduler.summary import AuthFailures, RejectedFrames

    fields = {f.name: 0 for f in msgspec.structs.fields(RunSummary) if f.required}
    fields.update(
        mode="async",
        status="completed",
        buffer_mode="window",
        evicted_by_reason={},
        eval_before=float("nan"),
        eval_after=0.5,
        eval_rewards_before={},
        eval_rewards_after={},
        eval_curve=[],
        reward_means={},
        reward_failures={},
        completion_lengths={"generated": 4.0},
        task={},
        rejected_frames=RejectedFrames(launcher=0, learner=0, launcher_by_reason={}),
        auth_failures=AuthFailures(launcher=0, learner=0),
        lint=[],
        run_dir="runs/x",
    )
    write_summary(RunSummary(**fields), tmp_path / "summary.json")
    text = (tmp_path / "summary.json").read_text()
    assert '"eval_before": NaN' in text  # as json.dumps wrote it before
    out = json.loads(text)
    # omitted where they do not apply
    absent = ("evals_skipped", "evals_failed", "dataset_position", "canary", "teacher_cache", "error")
    assert list(out) == [k for k in summary_keys() if k not in absent]


def test_docs_list_every_summary_key():
    """docs/monitor.md's summary.json table names every key of RunSummary, and no other."""
    text = (ROOT / "docs" / "monitor.md").read_text()
    section = text.split("## summary.json", 1)[1].split("\n## ", 1)[0]
    documented = re.findall(r"^\| `([a-z_]+)` \|", section, flags=re.M)
    assert documented == summary_keys()


def test_the_held_out_line_gives_failed_rewards_as_a_count_of_samples():
    """Regression: the line read "(flaky 0.950, total 0.950, failed 1.000)", as if every sample had
    failed, when one of them had."""
    from types import SimpleNamespace

    from asyncrl.config_load import load_config
    from asyncrl.job import NUM_FAILED, HeldOut

    events: list[str] = []
    reporter = SimpleNamespace(event=events.append)
    task = SimpleNamespace(eval_problems=[object()] * 20)
    held_out = HeldOut(load_config(None, []), Path("."), task, reporter)
    held_out.report("after", (0.95, {"flaky": 0.95, "total": 0.95, NUM_FAILED: 1.0}))
    assert events == [
        "held-out accuracy after training: 0.950 (flaky 0.950, total 0.950; 1 of 20 samples with a failed reward)"
    ]
