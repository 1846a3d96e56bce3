"""The monitor against real short runs: the dashboard of `asyncrl launch` in a pseudo-terminal,
attaching and detaching `asyncrl monitor` during a run, replay and report afterwards."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys

import pytest

from tests.conftest import read_records, short_job_args

pexpect = pytest.importorskip("pexpect")

ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]|\x1b[()][0-9A-Za-z]|\x1b[=>]")
PTY_SIZE = (50, 160)  # rows, columns


def pty_env() -> dict[str, str]:
    return {**os.environ, "TERM": "xterm-256color", "COLUMNS": str(PTY_SIZE[1]), "LINES": str(PTY_SIZE[0])}


def last_screen(raw: str) -> str:
    """The last dashboard frame of a rich Live output, as plain text with squeezed spaces."""
    text = ANSI.sub("", raw.replace("\r", ""))
    start = text.rfind("─ progress ─")
    assert start >= 0, text[-3000:]
    return " ".join(text[text.rfind("\n", 0, start) + 1 :].split())


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_launch_shows_the_dashboard_in_a_terminal_then_replay_and_report(tiny_model_dir, tmp_path):
    args = [a for a in short_job_args(tiny_model_dir, tmp_path, name="tui") if a != "--no-tui"]
    child = pexpect.spawn(
        args[0],
        args[1:],
        dimensions=PTY_SIZE,
        env=pty_env(),
        encoding="utf-8",
        codec_errors="replace",
        timeout=240,
    )
    child.expect(pexpect.EOF)
    child.close()
    raw = child.before
    assert child.exitstatus == 0, ANSI.sub("", raw)[-3000:]
    run_dir = tmp_path / "tui"
    summary = json.loads((run_dir / "summary.json").read_text())
    screen = last_screen(raw)
    assert "step 3/3" in screen and "policy_version 3" in screen
    trained = summary["trajectories_trained"]
    assert f"samples {trained} trained / {trained}" in screen
    assert f"max {summary['max_staleness']} (bound 2)" in screen
    publishes = read_records(run_dir, "publish")
    assert f"{publishes[0]['transport']} {len(publishes)} versions" in screen
    assert "gen-0" in screen and "% idle" in screen and "ess_ratio" in screen
    assert f"restarts {summary['generator_restarts']}" in screen  # the launcher reports restarts
    fresh = read_records(run_dir, "step")[-1]["stats"]["mean_freshness"]
    assert f"mean_freshness {fresh:.3f}" in screen  # the freshness panel shows the last step's figure
    assert "started learner" in screen  # events reach the screen through the record stream

    # Replay of the finished run: the same figures from metrics.jsonl, plus the final status.
    proc = subprocess.run(
        [sys.executable, "-m", "asyncrl", "monitor", str(run_dir)], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    replay = " ".join(proc.stdout.split())
    assert "· replay" in replay and "step 3/3" in replay and "status completed" in replay
    assert f"samples {trained} trained / {trained}" in replay

    proc = subprocess.run(
        [sys.executable, "-m", "asyncrl", "report", str(run_dir)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert (run_dir / "report" / "report_reward.png").read_bytes()[:4] == b"\x89PNG"
    assert "| steps | 3 / 3 |" in (run_dir / "report" / "report.md").read_text()


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_attaching_and_detaching_twice_changes_nothing_in_the_run(
    tiny_model_dir, tmp_path, pid_alive, launch_streamed
):
    # The run is far longer than the test needs and is stopped with Ctrl-C once both monitors
    # have detached: a run that could finish while a monitor starts (the tiny model trains
    # hundreds of steps in the seconds a loaded machine takes to import the CLI) would turn the
    # monitor into a replay and the test into a race.
    groups, samples = 2, 4
    lines = launch_streamed(short_job_args(tiny_model_dir, tmp_path, "learner.steps=100000", name="att"))
    job = lines.proc
    run_dir = tmp_path / "att"
    monitors: list[int] = []
    lines.wait_for(r"^step 1/", timeout_s=180, what="a first step")
    info = json.loads((run_dir / "monitor.json").read_text())
    assert info["live"] and info["endpoint"].startswith("tcp://127.0.0.1:")
    for detach in ("q", "ctrl-c"):
        mon = pexpect.spawn(
            sys.executable,
            ["-m", "asyncrl", "monitor", str(run_dir)],
            dimensions=PTY_SIZE,
            env=pty_env(),
            encoding="utf-8",
            codec_errors="replace",
            timeout=60,
        )
        monitors.append(mon.pid)
        mon.expect("· live")
        mon.expect(r"policy_version (\d+)")
        seen = mon.match.group(1)
        mon.expect(rf"policy_version (?!{seen}\b)\d+")  # the number moves: it follows the run
        if detach == "q":
            mon.send("q")
        else:
            mon.sendintr()
        mon.expect(pexpect.EOF)
        mon.close()
        assert mon.exitstatus == 0, mon.before
        assert job.poll() is None, "the run ended while a monitor was attached"
    job.send_signal(signal.SIGINT)
    code = lines.wait_exit(timeout_s=120)
    assert code == 130, lines.tail()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "interrupted"
    steps = summary["steps"]
    assert steps == summary["policy_versions"] > 0
    assert summary["trajectories_trained"] == steps * groups * samples
    assert summary["trajectories_lost"] == 0 and summary["duplicates"] == 0
    assert [r["step"] for r in read_records(run_dir, "step")] == list(range(steps))
    assert json.loads((run_dir / "monitor.json").read_text())["live"] is False
    assert not any(pid_alive(p) for p in monitors)
