"""`asyncrl slurm` on a real SLURM cluster on this machine (`.ci/setup-slurm`: this host as one
node, and a second slurmd on it as a second node). Skipped, saying so, where no SLURM is reachable.

1. The default job (shortened) submitted with --colocate to one node: the launcher in the batch
   step, the learner (torchrun) and a generator worker as separate job steps; it completes with
   nothing lost or duplicated and the held-out gain, its logs and jobs.log in the run directory.
2. A sync run, learner and generators on different nodes where the cluster has two:
   `scancel --signal=USR1 --batch` mid-run (what the time-limit warning sends): the launcher stops
   with a checkpoint, the job requeues itself, the next allocation resumes and completes, and the
   final weights equal an uninterrupted run's bit for bit.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.timeout(420)]

POLL_S = 0.5
JOB_TIMEOUT_S = 300.0


def _up_nodes() -> list[str]:
    """The cluster's nodes that can run jobs, in sinfo's order ([] when sinfo fails)."""
    try:
        out = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %T"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return []
    rows = [line.split() for line in out.stdout.splitlines() if line.strip()]
    return [node for node, state in rows if state.rstrip("*") in ("idle", "mixed", "allocated")]


@pytest.fixture(scope="module")
def nodes() -> list[str]:
    if shutil.which("sbatch") is None or shutil.which("sinfo") is None:
        pytest.skip(
            "no SLURM here: sbatch/sinfo not on PATH (as root, .ci/setup-slurm installs and starts one)"
        )
    up = _up_nodes()
    if not up:
        pytest.skip("SLURM is installed but sinfo shows no node up: run .ci/setup-slurm (as root)")
    return up


class Job:
    """A job this test submitted: its state from scontrol, the steps seen while it ran."""

    def __init__(self, job_id: str) -> None:
        self.job_id = job_id
        self.steps: dict[str, set[str]] = {}  # step name -> node lists it ran on

    def show(self) -> dict[str, str]:
        out = subprocess.run(["scontrol", "show", "job", "-o", self.job_id], capture_output=True, text=True)
        return dict(re.findall(r"(\w+)=(\S*)", out.stdout))

    def watch_steps(self) -> None:
        out = subprocess.run(
            ["squeue", "-h", "-s", "-j", self.job_id, "-o", "%j %N"], capture_output=True, text=True
        )
        for line in out.stdout.splitlines():
            name, _, where = line.partition(" ")
            self.steps.setdefault(name, set()).add(where.strip())

    def wait(self, done, what: str, timeout_s: float = JOB_TIMEOUT_S) -> dict[str, str]:
        """Poll (with a deadline) until `done(state)`; the state."""
        deadline = time.monotonic() + timeout_s
        while True:
            state = self.show()
            self.watch_steps()
            if done(state):
                return state
            assert time.monotonic() < deadline, (
                f"job {self.job_id}: no {what} within {timeout_s:g} s: {state}"
            )
            time.sleep(POLL_S)  # polling the controller; it has no event to wait on


@pytest.fixture
def submit(tmp_path):
    """Submits with `asyncrl slurm` from tmp_path; cancels (by id) the jobs still there at the end."""
    jobs: list[Job] = []

    def run(*args: str) -> Job:
        done = subprocess.run(
            [sys.executable, "-m", "asyncrl", "slurm", *args],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=tmp_path,
        )
        assert done.returncode == 0, done.stdout + done.stderr
        job = Job(re.search(r"submitted job (\d+)", done.stdout)[1])
        jobs.append(job)
        return job

    yield run
    for job in jobs:
        if job.show().get("JobState") in ("PENDING", "RUNNING", "REQUEUED", "COMPLETING"):
            subprocess.run(["scancel", job.job_id], timeout=30)


def _finished(state: dict[str, str]) -> bool:
    return state.get("JobState") in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "")


def _sets(*items: str) -> list[str]:
    return [arg for item in items for arg in ("--set", item)]


def test_default_job_runs_as_a_slurm_job(nodes, submit, tmp_path):
    steps = 6
    job = submit("--colocate", *_sets("run.name=default", f"learner.steps={steps}", "task.num_eval=100"))
    state = job.wait(_finished, "end")
    run_dir = tmp_path / "runs" / "default"
    assert state["JobState"] == "COMPLETED", (run_dir / "slurm" / f"job-{job.job_id}.out").read_text()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["policy_versions"] == steps
    assert summary["trajectories_trained"] == steps * 32 * 8
    assert summary["trajectories_lost"] == 0 and summary["trajectories_duplicated"] == 0
    assert summary["eval_after"] >= summary["eval_before"] + 0.3, summary
    # The learner and the generator worker ran as job steps of their own, on the job's node.
    node = state["NodeList"]
    assert job.steps.get("learner") == {node} and job.steps.get("generators") == {node}, job.steps
    logs = run_dir / "slurm" / "logs" / f"{job.job_id}.0"
    assert sorted(p.name for p in logs.iterdir()) == [
        f"launcher-{node}.log",
        f"learner-{node}.log",
        f"worker-{node}-0.log",
    ]
    assert "joined run 'default'" in (logs / f"worker-{node}-0.log").read_text()
    events = (run_dir / "slurm" / "jobs.log").read_text()
    assert f"job {job.job_id}: submitted" in events and "restart 0: ended with exit code 0" in events
    config = json.loads((run_dir / "config.json").read_text())
    assert config["cluster"]["curve"] == "on" and config["learner"]["start"] == "torchrun"
    shown = subprocess.run(
        [sys.executable, "-m", "asyncrl", "monitor", str(run_dir), "--once"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert shown.returncode == 0, shown.stderr


SYNC = (
    "mode=sync",
    "learner.steps=24",
    "learner.groups_per_step=8",
    "task.num_eval=0",
)


def _weights(run_dir: Path) -> dict[str, torch.Tensor]:
    files = sorted((run_dir / "final_model").glob("*.safetensors"))
    assert files, f"no final model in {run_dir}"
    return {k: v for f in files for k, v in load_file(str(f)).items()}


def _first_steps_done(run_dir: Path, num_steps: int) -> bool:
    metrics = run_dir / "metrics.jsonl"
    if not metrics.is_file():
        return False
    lines = metrics.read_text().splitlines()
    return sum('"type": "step"' in line for line in lines) >= num_steps


def _check_stopped_and_resumed(job: Job, state: dict[str, str], run_dir: Path, *, two_nodes: bool) -> None:
    """One stop with a checkpoint after step 2 or later, one requeue, a resume that completed
    with nothing lost or trained twice; on two nodes, the learner on the head, the generator not."""
    out = (run_dir / "slurm" / f"job-{job.job_id}.out").read_text()
    assert state["JobState"] == "COMPLETED" and state["Restarts"] == "1", (state, out)
    (first,) = run_dir.glob("summary-before-resume-*.json")
    stopped = json.loads(first.read_text())
    assert stopped["status"] == "interrupted" and 2 <= stopped["policy_versions"] < 24, stopped
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["resumed_from"] == stopped["policy_versions"]
    assert summary["trajectories_lost"] == 0 and summary["trajectories_duplicated"] == 0
    events = (run_dir / "slurm" / "jobs.log").read_text()
    for line in (
        "restart 0: SIGUSR1",
        "restart 0: requeued",
        "restart 1: started",
        "restart 1: ended with exit code 0",
    ):
        assert line in events, events
    if two_nodes:  # the learner on the head node (the job's first), the generators on the other
        hostnames = ["scontrol", "show", "hostnames", state["NodeList"]]
        head, other = subprocess.run(hostnames, capture_output=True, text=True).stdout.split()
        assert job.steps.get("learner") == {head} and job.steps.get("generators") == {other}, job.steps


def test_usr1_checkpoints_requeues_and_resumes_to_the_same_weights(nodes, submit, tmp_path):
    two_nodes = len(nodes) >= 2
    job = submit(*([] if two_nodes else ["--colocate"]), *_sets("run.name=cut", *SYNC))
    run_dir = tmp_path / "runs" / "cut"
    job.wait(lambda s: _first_steps_done(run_dir, 2) or _finished(s), "first two steps")
    subprocess.run(["scancel", "--signal=USR1", "--batch", job.job_id], check=True, timeout=30)
    # The uninterrupted run, meanwhile (the stop and the requeue mostly wait): the same job file.
    whole = subprocess.Popen(
        [sys.executable, "-m", "asyncrl", "launch", "--no-tui", *_sets("run.name=whole", *SYNC)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=tmp_path,
    )
    try:
        # A requeued job may start again once its credential expires (AuthInfo cred_expire: 10 s here).
        state = job.wait(_finished, "end after a requeue")
        _check_stopped_and_resumed(job, state, run_dir, two_nodes=two_nodes)
        whole_out = whole.communicate(timeout=200)[0]
    finally:
        if whole.poll() is None:  # this test started it
            whole.kill()
            whole.wait()
    assert whole.returncode == 0, whole_out
    ours, theirs = _weights(run_dir), _weights(tmp_path / "runs" / "whole")
    assert ours.keys() == theirs.keys()
    for name, tensor in ours.items():
        same = torch.equal(tensor.view(torch.uint8), theirs[name].view(torch.uint8))
        assert tensor.dtype == theirs[name].dtype and same, name
