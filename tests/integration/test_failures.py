"""A child that fails ends the run cleanly, with an error naming the process and the reason."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.slow

PLUGIN = textwrap.dedent(
    """
    from asyncrl.generators.torch_gen import TorchGenerator

    class ExplodingGenerator(TorchGenerator):
        async def generate(self, tasks):
            raise RuntimeError("reward server unreachable")
    """
)


def launch_with_plugin(
    model_dir, tmp_path, source: str, target: str, *extra: str
) -> subprocess.CompletedProcess:
    """Run a short job whose generator is the plugin `target` ("module:Class") defined by `source`."""
    module = target.split(":")[0]
    (tmp_path / f"{module}.py").write_text(source)
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    args = [sys.executable, "-m", "asyncrl", "launch", "--no-tui"]
    for s in (
        f'model.path="{model_dir}"',
        f'run.out_dir="{tmp_path}"',
        'run.name="t"',
        f'generators.kind="{target}"',
        "learner.groups_per_step=2",
        "learner.samples_per_group=2",
        "task.num_eval=0",
        *extra,
    ):
        args += ["--set", s]
    return subprocess.run(args, capture_output=True, text=True, env=env, timeout=180)


@pytest.mark.timeout(200)
def test_generator_failure_is_reported_and_everything_stops(tiny_model_dir, tmp_path):
    """A generator that fails every time is restarted up to its budget, then the run stops."""
    proc = launch_with_plugin(
        tiny_model_dir,
        tmp_path,
        PLUGIN,
        "exploding_plugin:ExplodingGenerator",
        "generators.max_restarts=1",
    )
    assert proc.returncode == 1
    assert "generator gen-0 failed: RuntimeError: reward server unreachable" in proc.stderr
    assert "restarted 1 times already (generators.max_restarts = 1)" in proc.stderr
    assert "Traceback" not in proc.stdout
    summary = json.loads((tmp_path / "t" / "summary.json").read_text())
    assert summary["status"] == "failed"
    assert "reward server unreachable" in summary["error"]


HANGING_PLUGIN = textwrap.dedent(
    """
    import threading

    from asyncrl.generators.torch_gen import TorchGenerator

    class HangingGenerator(TorchGenerator):
        async def generate(self, tasks):
            threading.Event().wait()  # blocks the event loop for good: no more heartbeats
    """
)


@pytest.mark.timeout(200)
def test_hung_generator_is_detected_and_the_run_stops(tiny_model_dir, tmp_path, pid_alive):
    """A hung generator is killed and restarted; hung again past its budget, the run stops."""
    proc = launch_with_plugin(
        tiny_model_dir,
        tmp_path,
        HANGING_PLUGIN,
        "hanging_plugin:HangingGenerator",
        "monitor.heartbeat_timeout_s=3",
        "generators.max_restarts=1",
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "generator gen-0" in proc.stderr and "it is hung" in proc.stderr
    assert "restarting it as gen-0-r1" in proc.stdout
    pids = [int(p) for p in re.findall(r"started \S+ \(pid (\d+)\)", proc.stdout)]
    assert len(pids) == 3 and not [p for p in pids if pid_alive(p)]  # learner, gen-0, gen-0-r1


def test_unknown_generator_fails_before_any_process_starts(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "asyncrl",
            "launch",
            "--no-tui",
            "--set",
            'generators.kind="tourch"',
            "--set",
            f'run.out_dir="{tmp_path}"',
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert "unknown generator 'tourch'" in proc.stderr and "torch" in proc.stderr.split("valid names:")[1]
    assert not list(tmp_path.iterdir())  # no run directory: nothing started


def test_an_unavailable_cpu_fails_before_any_process_starts(tmp_path):
    cpu = max(os.sched_getaffinity(0)) + 1
    proc = subprocess.run(
        [sys.executable, "-m", "asyncrl", "launch", "--no-tui", "--set", f"learner.cpus=[{cpu}]"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    assert proc.returncode == 2
    assert f"learner.cpus = [{cpu}]: CPU {cpu} is not available here" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not list(tmp_path.iterdir())  # no run directory: nothing started


def test_config_error_is_one_clear_line(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "asyncrl", "launch", "--set", "learner.stepz=3"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    assert proc.returncode == 2
    assert "unknown key 'learner.stepz'" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.timeout(200)
def test_a_failed_publish_stops_the_run_instead_of_waiting(tiny_model_dir, tmp_path):
    """The learner publishes a version while the next step trains. With max_staleness 0 that
    step's data needs the new weights, so a publish that fails must end the run, not leave the
    learner waiting for trajectories that never come."""
    from tests.conftest import short_job_args

    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    args = short_job_args(tiny_model_dir, tmp_path, "staleness.max_staleness=0", f'weights.dir="{blocker}"')
    proc = subprocess.run(args, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 1
    assert "learner learner failed: FileExistsError" in proc.stderr
    assert "Traceback" not in proc.stdout
    summary = json.loads((tmp_path / "t" / "summary.json").read_text())
    assert summary["status"] == "failed"
