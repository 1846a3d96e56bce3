"""`asyncrl launch` with the sglang generator against two stand-in SGLang server processes.

The test starts both servers itself (`python -m asyncrl.testing.sglang_server --port 0` on
127.0.0.1, URL read from their first stdout line) and ends exactly those pids.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request

import pytest

pytestmark = pytest.mark.slow


def start_server(model_dir) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "asyncrl.testing.sglang_server",
            "--model-path",
            str(model_dir),
            "--port",
            "0",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    line = proc.stdout.readline()  # blocks until the server listens (or exits: empty line)
    assert line.startswith("SGLANG_STANDIN_URL "), f"stand-in server did not start: {line!r}"
    return proc, line.split()[1]


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
