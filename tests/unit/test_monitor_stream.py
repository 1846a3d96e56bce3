"""Metrics stream plumbing without sockets: catch-up/gap logic of the follower, target
resolution errors, the optional sinks, and the report's plots."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import pytest
from typer.testing import CliRunner

from asyncrl.benchmarks.monitor import synthetic_records
from asyncrl.monitor import sinks
from asyncrl.monitor.attach import Follower, Target, resolve_target
from asyncrl.monitor.report import series, write_report
from asyncrl.monitor.stream import MonitorHub, count_lines


def write_jsonl(path: Path, records: list[dict]) -> list[str]:
    lines = [json.dumps(r) for r in records]
    path.write_text("".join(line + "\n" for line in lines))
    return lines


def test_follower_reads_each_record_once_in_order_and_fills_gaps_from_the_file(tmp_path):
    records = [{"type": "event", "text": f"r{i}", "time_s": float(i)} for i in range(8)]
    lines = write_jsonl(tmp_path / "metrics.jsonl", records[:3])
    seen: list[str] = []
    follower = Follower(Target(run_dir=tmp_path, endpoint=None, live=False), lambda r: seen.append(r["text"]))
    follower.catch_up()
    assert seen == ["r0", "r1", "r2"]
    lines = write_jsonl(tmp_path / "metrics.jsonl", records)
    follower.on_frames([b"1", lines[1].encode()])  # already read from the file: skipped
    follower.on_frames([b"3", lines[3].encode()])  # the next one: taken from the socket
    follower.on_frames([b"6", lines[6].encode()])  # 4 and 5 were missed: filled from the file
    follower.on_frames([b"7", lines[7].encode()])
    assert seen == [f"r{i}" for i in range(8)]


def test_a_follower_told_to_stop_leaves_its_backlog_between_pieces(tmp_path):
    """A monitor behind a fast run folds a long backlog; q must not wait for all of it. Reading
    stops between pieces once `should_stop` says so, and goes on from there next time."""
    lines = [json.dumps({"type": "event", "text": f"line {i:03d}"}) for i in range(40)]
    (tmp_path / "metrics.jsonl").write_text("".join(line + "\n" for line in lines))
    seen: list[str] = []
    follower = Follower(Target(run_dir=tmp_path, endpoint=None, live=False), lambda r: seen.append(r["text"]))
    read_new = follower.file.read_new
    follower.file.read_new = lambda from_seq: read_new(from_seq, max_bytes=64)  # a line or two a piece
    follower.should_stop = lambda: len(seen) >= 5
    first = follower.catch_up()
    assert 5 <= first < 10 and seen == [f"line {i:03d}" for i in range(first)]
    follower.should_stop = lambda: False
    follower.catch_up()
    assert seen == [f"line {i:03d}" for i in range(40)]  # nothing lost or read twice


def test_a_follower_told_to_stop_leaves_even_a_piece_it_has_read(tmp_path):
    """One piece of the file holds thousands of records, each folded under the dashboard's lock
    (which its renders hold): q is asked before each record, and the rest wait for the next
    catch-up, none lost or read twice."""
    lines = [json.dumps({"type": "event", "text": f"line {i:03d}"}) for i in range(40)]
    (tmp_path / "metrics.jsonl").write_text("".join(line + "\n" for line in lines))
    seen: list[str] = []
    follower = Follower(Target(run_dir=tmp_path, endpoint=None, live=False), lambda r: seen.append(r["text"]))
    follower.should_stop = lambda: len(seen) >= 5
    assert follower.catch_up() == 5 and len(seen) == 5  # the whole file is one piece
    follower.should_stop = lambda: False
    follower.on_frames([b"40", json.dumps({"type": "event", "text": "line 040"}).encode()])
    assert seen == [f"line {i:03d}" for i in range(41)]


def test_follower_drops_malformed_frames_and_keeps_going(tmp_path):
    seen: list[dict] = []
    follower = Follower(Target(run_dir=None, endpoint=None, live=False), seen.append)
    for frames in ([b"x", b"{}"], [b"0"], [b"0", b"not json"], [b"0", b"[1, 2]"], [b"0", b"{}", b"extra"]):
        follower.on_frames(frames)
    assert follower.num_bad_frames == 5 and seen == []
    follower.on_frames([b"0", b'{"type": "event", "text": "ok"}'])
    assert seen == [{"type": "event", "text": "ok"}]


def test_a_torn_last_line_waits_for_its_newline(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"type": "event", "text": "a"}\n{"type": "ev')
    seen: list[str] = []
    follower = Follower(Target(run_dir=tmp_path, endpoint=None, live=False), lambda r: seen.append(r["text"]))
    follower.catch_up()
    assert seen == ["a"]
    with open(path, "a") as f:
        f.write('ent", "text": "b"}\n')
    follower.catch_up()
    assert seen == ["a", "b"]


def test_hub_numbers_records_from_the_existing_line_count_and_feeds_sinks(tmp_path):
    path = tmp_path / "metrics.jsonl"
    write_jsonl(path, [{"type": "event"}] * 3)
    got: list[dict] = []

    class Sink:
        def on_record(self, record):
            got.append(record)

    hub = MonitorHub(pub=None, sinks=[Sink()], first_seq=count_lines(path))
    hub.publish({"type": "event", "text": "x"}, '{"type": "event", "text": "x"}')
    assert hub.seq == 4 and got == [{"type": "event", "text": "x"}]


def test_a_failing_third_party_sink_is_disabled_not_fatal():
    class Broken:
        def on_record(self, record):
            raise RuntimeError("disk full")

        def close(self):
            pass

    hub = MonitorHub(pub=None, sinks=[], external_sinks=[Broken()])
    hub.publish({"type": "event"}, "{}")
    assert hub.external_sinks == []


@pytest.mark.parametrize(
    ("arg", "message"),
    [
        ("does/not/exist", "no such run directory"),
        ("tcp://localhost", "expected tcp://HOST:PORT"),
    ],
)
def test_bad_monitor_targets_are_clear_errors(arg, message):
    with pytest.raises(ValueError, match=message):
        resolve_target(arg)


def test_a_directory_that_is_not_a_run_is_refused(tmp_path):
    (tmp_path / "notes.txt").write_text("hi")
    with pytest.raises(ValueError, match="not an asyncrl run directory"):
        resolve_target(str(tmp_path))
    with pytest.raises(ValueError, match="is a file"):
        resolve_target(str(tmp_path / "notes.txt"))
    from asyncrl.cli import app

    result = CliRunner().invoke(app, ["monitor", str(tmp_path)])
    assert result.exit_code == 2 and "not an asyncrl run directory" in result.output


def test_a_run_whose_launcher_is_gone_is_replayed_not_attached(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("")
    dead_pid = 2**22 + 12345  # above the default pid_max: no such process
    (tmp_path / "monitor.json").write_text(
        json.dumps({"endpoint": "tcp://127.0.0.1:1", "pid": dead_pid, "live": True})
    )
    assert resolve_target(str(tmp_path)).live is False


def test_sink_scalars_and_a_wandb_sink_in_offline_mode(tmp_path, monkeypatch):
    step = {
        "type": "step",
        "step": 4,
        "loss": 0.5,
        "mean_reward": 0.25,
        "stats": {"ess_ratio": 0.9},
        "samples_per_s": 10,
    }
    assert sinks.scalars(step) == {
        "train/loss": 0.5,
        "train/mean_reward": 0.25,
        "throughput/samples_per_s": 10.0,
        "policy/ess_ratio": 0.9,
    }
    assert sinks.scalars({"type": "metrics", "source": "gen-0", "gen/busy_ratio": 0.5}) == {
        "gen-0/gen/busy_ratio": 0.5
    }
    calls: list = []

    class FakeRun:
        def log(self, values, step):
            calls.append(("log", values, step))

        def finish(self):
            calls.append(("finish",))

    fake = types.ModuleType("wandb")
    fake.init = lambda **kw: calls.append(("init", kw)) or FakeRun()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    sink = sinks.WandbSink(tmp_path, {"learner": {"steps": 5}})
    sink.on_record(step)
    sink.on_record({"type": "metrics", "source": "learner", "learner/idle_ratio": 0.3})
    sink.close()
    assert calls[0][1]["mode"] == "offline" and calls[0][1]["dir"] == str(tmp_path)
    assert calls[1] == ("log", sinks.scalars(step), 5)
    assert calls[2] == ("log", {"learner/idle_ratio": 0.3}, 5)
    assert calls[3] == ("finish",)


def test_a_requested_sink_that_is_not_installed_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(sinks.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ValueError, match="pip install tensorboard"):
        sinks.check_sinks(["tensorboard"])
    sinks.check_sinks([])  # nothing asked, nothing needed


def make_run(tmp_path: Path, num_steps: int = 6) -> Path:
    run = tmp_path / "run"
    run.mkdir()
    write_jsonl(run / "metrics.jsonl", synthetic_records(num_steps=num_steps, groups_per_step=4))
    (run / "config.json").write_text(json.dumps({"mode": "async", "learner": {"steps": num_steps}}))
    (run / "summary.json").write_text(
        json.dumps({"status": "completed", "eval_before": 0.2, "eval_after": 0.9})
    )
    return run


def test_report_series_match_the_records(tmp_path):
    records = synthetic_records(num_steps=3, groups_per_step=4)
    s = series(records)
    assert s["step"] == [1, 2, 3]
    assert s["reward"] == [0.5, 0.5, 0.5]
    steps = [r for r in records if r["type"] == "step"]
    dt = steps[1]["time_s"] - steps[0]["time_s"]
    assert s["samples_rate"][0] == pytest.approx(256 / dt)
    assert s["idle"]["learner"][1] == [0.5, 0.5, 0.5]
    assert s["idle"]["gen-0"][1][0] == pytest.approx(0.4)


def test_report_writes_plots_and_a_page(tmp_path):
    run = make_run(tmp_path)
    page = write_report(run)
    text = page.read_text()
    for name in ("reward", "throughput", "staleness", "idle"):
        png = run / "report" / f"report_{name}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
        assert f"(report_{name}.png)" in text
    assert "| status | completed |" in text
    assert "| held-out accuracy before -> after | 0.200 -> 0.900 |" in text
    assert "| steps | 6 / 6 |" in text


def test_report_refuses_what_it_cannot_plot(tmp_path):
    with pytest.raises(ValueError, match="no metrics.jsonl"):
        write_report(tmp_path)
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"type": "event", "text": "x"}) + "\n")
    with pytest.raises(ValueError, match="no learner steps"):
        write_report(tmp_path)
