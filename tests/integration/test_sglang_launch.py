"""`asyncrl launch` with the sglang generator against two stand-in SGLang server processes.

The first test starts both servers itself (`python -m tests.support.sglang.server --port 0` on
127.0.0.1, URL read from their first stdout line) and ends exactly those pids. The others let the
generator start them (`generators.options.launch=2`, the stand-in as `launch_command`) and check
that the run ends them, also on Ctrl-C (pids from `<run>/logs/sglang-gen-0.json`).
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

from tests.conftest import read_records, short_job_args, start_standin_server

pytestmark = pytest.mark.slow


def start_server(model_dir) -> tuple[subprocess.Popen, str]:
    return start_standin_server(model_dir)


def get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=30) as resp:
        return json.loads(resp.read())


def test_launch_with_two_standin_servers(tiny_model_dir, run_short_job, pid_alive):
    started: list[subprocess.Popen] = []
    try:
        urls = []
        for _ in range(2):
            proc, url = start_server(tiny_model_dir)
            started.append(proc)
            urls.append(url)
        proc, run_dir = run_short_job(
            'generators.kind="sglang"',
            f'generators.options.urls="{",".join(urls)}"',
            "generators.options.health_interval_s=0.2",
            'weights.transport="shards"',
            timeout=300,
        )
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["trajectories_lost"] == 0 and summary["trajectories_duplicated"] == 0
        assert summary["status"] == "completed" and summary["policy_versions"] == 3, summary
        # both servers sampled, and both hold the last version the learner published and acked
        loads = [get_json(f"{u}/server_info")["internal_states"][0]["num_generate_requests"] for u in urls]
        assert all(n > 0 for n in loads) and sum(loads) >= 3 * 2 * 4, loads
        versions = {get_json(f"{u}/model_info")["weight_version"] for u in urls}
        assert len(versions) == 1 and int(versions.pop()) >= 2
    finally:
        for proc in started:
            proc.terminate()
        deadline = time.monotonic() + 30
        for proc in started:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    assert not any(pid_alive(p.pid) for p in started)


def launch_sets(transport: str) -> list[str]:
    """A short job whose sglang generator starts two stand-in servers itself."""
    return [
        'generators.kind="sglang"',
        "generators.options.launch=2",
        'generators.options.launch_command="python -m tests.support.sglang.server"',
        'generators.options.launch_args="--log-level warning --skip-tokenizer-init"',
        "generators.options.health_interval_s=0.2",
        f'weights.transport="{transport}"',
        "learner.steps=2",
        "learner.samples_per_group=2",
    ]


def launched_servers(run_dir) -> list[dict]:
    return json.loads((run_dir / "logs" / "sglang-gen-0.json").read_text())


@pytest.mark.parametrize("transport", ["shards", "broadcast"])
def test_launch_starts_its_servers_and_stops_them(run_short_job, pid_alive, transport):
    """`generators.options.launch=2`: the generator starts two stand-in servers through the same
    code path as real ones, the job completes (with broadcast: every version went over the
    servers' weight update group), and no server process outlives the run."""
    # max_staleness 0: step 1 is admitted only once the generator acked version 1 (loaded by its
    # servers), so that ack is in the record; the last version's ack may come after the run ends.
    sets = [*launch_sets(transport), "staleness.max_staleness=0"]
    _, run_dir = run_short_job(*sets, timeout=300, name=transport)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["policy_versions"] == 2, summary
    assert summary["trajectories_lost"] == 0 and summary["generator_restarts"] == 0
    servers = launched_servers(run_dir)
    assert len(servers) == 2 and len({s["url"] for s in servers}) == 2
    for s in servers:
        assert s["url"].startswith("http://127.0.0.1:")
        assert (run_dir / "logs" / f"sglang-gen-0-{s['index']}.log").is_file()
    assert not any(pid_alive(s["pid"]) for s in servers)
    publishes = read_records(run_dir, "publish")
    assert sorted({p["version"] for p in publishes if p["transport"] == transport}) == [1, 2]
    if transport == "broadcast":
        group = [p for p in publishes if p["transport"] == "broadcast"]
        assert all(p["group_members"] == ["gen-0", "gen-0"] for p in group)
    loaded = [r["version"] for r in read_records(run_dir, "loaded") if r["generator_id"] == "gen-0"]
    assert loaded in ([1], [1, 2]), loaded


def test_ctrl_c_stops_launched_servers(tiny_model_dir, tmp_path, pid_alive):
    """Ctrl-C on `asyncrl launch` while its generator's servers run: the run stops and takes
    every server it started with it (SIGINT reaches only the launcher; the servers have their own
    sessions and are stopped by the generator's close)."""
    args = short_job_args(tiny_model_dir, tmp_path, *launch_sets("shards"), "learner.steps=1000", name="c")
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        seen = []
        for line in proc.stdout:  # readiness by message: the launcher prints a line per step
            seen.append(line)
            if line.startswith("step "):
                break
        else:
            pytest.fail("the job ended before it trained a step:\n" + "".join(seen))
        servers = launched_servers(tmp_path / "c")
        assert len(servers) == 2 and all(pid_alive(s["pid"]) for s in servers)
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, out
    assert not any(pid_alive(s["pid"]) for s in servers)


def test_bad_sglang_options_fail_before_anything_starts(tmp_path):
    """The generator's options are checked when the job is loaded (its `check_config`), not in a
    generator process after the learner has started."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "asyncrl",
            "launch",
            "--no-tui",
            "--set",
            f'run.out_dir="{tmp_path}"',
            "--set",
            'generators.kind="sglang"',
            "--set",
            "generators.options.launch=2",
            "--set",
            'generators.options.launch_args="--port 30000"',
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "generators.options.launch_args must not set --port" in proc.stderr
    assert not list(tmp_path.iterdir())  # no run directory: nothing started
