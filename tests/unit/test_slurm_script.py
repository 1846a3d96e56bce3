"""`asyncrl slurm` without a cluster: the layout arithmetic, the batch script it writes (a
four-node GPU job run against fake `scontrol`, `srun` and interpreter, so the node lists, torchrun
ranks, GPU binding, signal handling and requeue it would do are checked as bash executes them),
and the command's errors (one line, no traceback)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from asyncrl.slurm.script import (
    Job,
    Layout,
    check_overrides,
    check_warning,
    launch_overrides,
    render,
    time_limit_s,
)

FAKE_PYTHON = r"""#!/bin/bash
# The interpreter the script calls: a launcher, the join helper.
case "$1 $2" in
"-m asyncrl")
    printf '%s\n' "$@" >"$FAKE_LOG/launch.args"
    if [[ -n ${FAKE_LAUNCH_WAITS:-} ]]; then
        # A launcher that stops when told (SIGTERM), as the real one does: exit 130; with
        # FAKE_LAUNCH_HOLD, once the test has created launch.release (a stop that takes a while).
        stop() {
            touch "$FAKE_LOG/launch.stopping"
            while [[ -n ${FAKE_LAUNCH_HOLD:-} && ! -e $FAKE_LOG/launch.release ]]; do sleep 0.05; done
            kill %1
            exit 130
        }
        trap stop TERM
        sleep 600 &
        touch "$FAKE_LOG/launch.ready"
        wait
    fi
    exit "${FAKE_LAUNCH_EXIT:-0}"
    ;;
"-m asyncrl.slurm.join")
    case $3 in
    --free-port) echo 29555 ;;
    --state) echo "${FAKE_STATE:-fresh}" ;;
    *) echo tcp://10.0.0.1:5555 ;;
    esac
    ;;
esac
"""
FAKE_SCONTROL = r"""#!/bin/bash
echo "$*" >>"$FAKE_LOG/scontrol.calls"
case "$1 $2" in
"show hostnames") printf 'n%s\n' 1 2 3 4 ;;
"show node") echo "NodeName=$4 Arch=x86_64 NodeAddr=10.0.0.${4#n} NodeHostName=$4 Port=0" ;;
esac
"""
FAKE_SRUN = r"""#!/bin/bash
for arg in "$@"; do [[ $arg == --job-name=* ]] && name=${arg#--job-name=}; done
printf '%s\n' "$@" >"$FAKE_LOG/srun-$name.args"
"""


def _job(tmp_path: Path, layout: Layout, **kw) -> Job:
    settings = dict(
        layout=layout,
        run_dir=tmp_path / "runs" / "r1",
        config=tmp_path / "job.toml",
        overrides=("learner.lr=1e-4",),
        python=str(tmp_path / "bin" / "python"),
        workdir=tmp_path,
    )
    return Job(**{**settings, **kw})


def test_layout_counts_nodes_ranks_and_generators():
    split = Layout(learner_nodes=2, generator_nodes=3, gpus_per_node=8)
    assert (split.num_nodes, split.world_size, split.num_generators, split.per_node) == (5, 16, 24, 8)
    cpu = Layout(learner_nodes=1, generator_nodes=2)
    assert (cpu.num_nodes, cpu.world_size, cpu.num_generators) == (3, 1, 2)
    shared = Layout(learner_nodes=1, generator_nodes=1, colocate=True)
    assert shared.num_nodes == 1


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        (dict(learner_nodes=0, generator_nodes=1), "--learner-nodes 0"),
        (dict(learner_nodes=1, generator_nodes=-1), "--generator-nodes -1"),
        (dict(learner_nodes=1, generator_nodes=1, gpus_per_node=-2), "--gpus-per-node -2"),
        (dict(learner_nodes=1, generator_nodes=1, gpus_per_node=4, colocate=True), "drop --colocate"),
    ],
)
def test_layout_refuses_bad_counts(kwargs, words):
    with pytest.raises(ValueError, match=words):
        Layout(**kwargs)


def test_a_set_of_a_managed_key_is_refused_naming_the_flag():
    with pytest.raises(ValueError, match=r"learner.world_size: .*--learner-nodes x --gpus-per-node"):
        check_overrides(["learner.lr=1e-4", "learner.world_size=4"])


def test_launch_overrides_come_after_the_users_and_set_the_cluster(tmp_path):
    job = _job(tmp_path, Layout(learner_nodes=2, generator_nodes=2, gpus_per_node=8))
    sets = dict(item.split("=", 1) for item in launch_overrides(job))
    assert sets["learner.world_size"] == "16" and sets["learner.start"] == "torchrun"
    assert sets["generators.num_generators"] == sets["generators.remote"] == "16"
    assert sets["cluster.curve"] == "on" and sets["cluster.bind_host"] == "0.0.0.0"
    assert sets["cluster.keys_dir"] == str(job.run_dir / "slurm" / "keys")
    assert sets["learner.device"] == "cuda"
    assert (sets["run.out_dir"], sets["run.name"]) == (str(job.run_dir.parent), "r1")


def _fakes(tmp_path: Path) -> dict[str, str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("python", FAKE_PYTHON), ("scontrol", FAKE_SCONTROL), ("srun", FAKE_SRUN)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    log = tmp_path / "log"
    log.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update(
        PATH=f"{bin_dir}:{env['PATH']}", FAKE_LOG=str(log), SLURM_JOB_ID="77", SLURM_JOB_NODELIST="n[1-4]"
    )
    return env


def _script(tmp_path: Path, job: Job) -> Path:
    (job.run_dir / "slurm").mkdir(parents=True)
    path = job.run_dir / "slurm" / "job.sbatch"
    path.write_text(render(job))
    return path


def _args(path: Path) -> list[str]:
    return path.read_text().splitlines()


def test_the_two_node_gpu_script_places_learner_ranks_and_generators(tmp_path):
    """Two learner nodes and two generator nodes of 8 GPUs: torchrun on n1,n2 with 8 ranks each and
    rank 0's node the head; one worker per GPU on n3,n4; the launcher with the user's and the
    command's --set; no requeue when the run completes."""
    job = _job(tmp_path, Layout(learner_nodes=2, generator_nodes=2, gpus_per_node=8), time="4:00:00")
    script = _script(tmp_path, job)
    text = script.read_text()
    for line in (
        "#SBATCH --nodes=4",
        "#SBATCH --gpus-per-node=8",
        "#SBATCH --time=4:00:00",
        "#SBATCH --requeue",
    ):
        assert line in text.splitlines()
    assert "#SBATCH --signal=B:USR1@300" in text
    env = _fakes(tmp_path)
    done = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    log = tmp_path / "log"
    learner = _args(log / "srun-learner.args")
    assert "--nodelist=n1,n2" in learner and "--nodes=2" in learner and "--gpus-per-node=8" in learner
    assert "--nnodes=2" in learner and "--nproc-per-node=8" in learner
    assert "--master-addr=10.0.0.1" in learner and "--master-port=29555" in learner
    workers = _args(log / "srun-generators.args")
    assert "--nodelist=n3,n4" in workers and "--ntasks=16" in workers and "--gpus-per-task=1" in workers
    assert workers[workers.index("--join") + 1] == "tcp://10.0.0.1:5555"
    assert workers[workers.index("--keys") + 1] == str(job.run_dir / "slurm" / "worker-keys")
    assert "generators.device=cuda" in workers
    launch = _args(log / "launch.args")
    assert launch[:4] == ["-m", "asyncrl", "launch", "--no-tui"] and launch[4] == str(job.config)
    sets = [launch[i + 1] for i, a in enumerate(launch) if a == "--set"]
    assert sets[0] == "learner.lr=1e-4" and "learner.world_size=16" in sets
    assert "requeue" not in (log / "scontrol.calls").read_text()
    events = (job.run_dir / "slurm" / "jobs.log").read_text()
    assert "restart 0: started on n[1-4] (head n1, learner n1,n2, generators n3,n4)" in events
    assert "ended with exit code 0" in events


def test_colocated_generators_share_the_learner_node(tmp_path):
    job = _job(tmp_path, Layout(learner_nodes=1, generator_nodes=1, colocate=True))
    env = _fakes(tmp_path)
    done = subprocess.run(
        ["bash", str(_script(tmp_path, job))], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "--nodelist=n1" in _args(tmp_path / "log" / "srun-generators.args")
    assert "--nodelist=n1" in _args(tmp_path / "log" / "srun-learner.args")


def _wait_for(proc: subprocess.Popen, path: Path, text: str = "") -> None:
    """Until `path` exists (and holds `text`), polling with a deadline."""
    deadline = time.monotonic() + 30
    while not (path.exists() and text in path.read_text()):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0]
        time.sleep(0.05)  # polling for a file the script or a fake writes


def _run_until_launched(script: Path, env: dict[str, str], log: Path) -> subprocess.Popen:
    proc = subprocess.Popen(
        ["bash", str(script)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    _wait_for(proc, log / "launch.ready")
    return proc


@pytest.mark.parametrize(
    ("sig", "restart", "requeued"),
    [("USR1", "0", True), ("USR1", "20", False), ("TERM", "0", False), ("USR1+TERM", "0", False)],
)
def test_signals_stop_the_launcher_and_usr1_requeues(tmp_path, sig, restart, requeued):
    """SIGUSR1 (the time-limit warning) stops the launcher (SIGTERM) and requeues the job, up to
    MAX_REQUEUES; SIGTERM (a cancel) stops it and does not requeue, also after a SIGUSR1 (a
    `scancel` during the stop requeued a job that then ran on). A resume (a checkpoint in the
    run directory) launches with --resume RUN_DIR."""
    job = _job(tmp_path, Layout(learner_nodes=1, generator_nodes=1))
    script = _script(tmp_path, job)
    env = {
        **_fakes(tmp_path),
        "FAKE_LAUNCH_WAITS": "1",
        "SLURM_RESTART_COUNT": restart,
        "FAKE_STATE": "resume",
    }
    if "+" in sig:  # the second signal comes while the launcher is still stopping
        env["FAKE_LAUNCH_HOLD"] = "1"
    log = tmp_path / "log"
    proc = _run_until_launched(script, env, log)
    for name in sig.split("+"):
        proc.send_signal(getattr(signal, f"SIG{name}"))
        _wait_for(proc, job.run_dir / "slurm" / "jobs.log", f"SIG{name}")
    (log / "launch.release").touch()
    out = proc.communicate(timeout=30)[0]
    assert proc.returncode == (0 if requeued else 130), out
    assert _args(log / "launch.args")[4:] == ["--resume", str(job.run_dir)]
    assert ("requeue 77" in (log / "scontrol.calls").read_text()) == requeued
    events = (job.run_dir / "slurm" / "jobs.log").read_text()
    assert f"restart {restart}: SIG{sig.split('+')[-1]}" in events
    assert ("requeued (the next allocation resumes)" in events) == requeued


def test_a_fresh_start_sets_an_earlier_attempts_files_aside(tmp_path):
    """An allocation that stopped before its first checkpoint left files; the next starts afresh."""
    job = _job(tmp_path, Layout(learner_nodes=1, generator_nodes=1))
    script = _script(tmp_path, job)
    (job.run_dir / "metrics.jsonl").write_text("{}\n")
    env = {**_fakes(tmp_path), "SLURM_RESTART_COUNT": "1"}
    done = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert sorted(p.name for p in job.run_dir.iterdir()) == ["slurm"]
    assert (job.run_dir / "slurm" / "attempt-77.1" / "metrics.jsonl").is_file()
    assert _args(tmp_path / "log" / "launch.args")[4] == str(job.config)


def _cli(
    *args: str, env: dict[str, str] | None = None, cwd: Path | None = None
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "asyncrl", "slurm", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        cwd=cwd,
    )


def test_the_command_says_what_is_wrong_without_a_traceback(tmp_path):
    no_sbatch = {**os.environ, "PATH": str(Path(sys.executable).parent)}
    cases = [
        (["--learner-nodes", "0", "--dry-run"], None, "--learner-nodes 0"),
        (["--set", "cluster.curve=off", "--dry-run"], None, "cluster.curve: asyncrl slurm sets it"),
        (["--set", "learner.lr=oops", "--dry-run"], None, "learner.lr"),
        ([], no_sbatch, "sbatch is not on PATH"),
    ]
    for args, env, words in cases:
        done = _cli(*args, env=env, cwd=tmp_path)
        assert done.returncode == 2, (args, done.stdout, done.stderr)
        assert words in done.stderr and "Traceback" not in done.stderr, (args, done.stderr)
    assert not (tmp_path / "runs").exists()  # nothing written before the checks pass


def test_dry_run_prints_the_script_and_writes_nothing(tmp_path):
    done = _cli(
        "--learner-nodes", "2", "--generator-nodes", "2", "--gpus-per-node", "4", "--dry-run", cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("#!/bin/bash") and "#SBATCH --nodes=4" in done.stdout
    assert subprocess.run(["bash", "-n"], input=done.stdout, text=True).returncode == 0
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("30", 1800),
        ("30:15", 1815),
        ("2:00:00", 7200),
        ("1-0", 86400),
        ("1-2:30", 95400),
        ("unlimited", None),
    ],
)
def test_time_limits_read_as_sbatch_reads_them(text, seconds):
    assert time_limit_s(text) == seconds


@pytest.mark.parametrize("text", ["0", "1:2:3:4", "-5", "a-3", "2h"])
def test_bad_time_limits_are_refused(text):
    with pytest.raises(ValueError, match="--time"):
        time_limit_s(text)


def test_a_warning_that_leaves_no_time_to_train_is_refused():
    """A 2-minute limit with the warning 80 s before it: SLURM signalled at the first check, every
    allocation stopped while starting and the requeues never trained a step."""
    with pytest.raises(ValueError, match="--time 2 with --warn-s 80"):
        check_warning("2", 80)
    check_warning("4", 80)
    check_warning("", 80)  # no limit: nothing to check


def test_an_allocation_after_the_last_step_does_nothing(tmp_path):
    """A requeue after the last step was trained (a late SIGUSR1, a node failure at the end): the
    allocation ends at once instead of failing `asyncrl launch --resume` (found running a chain
    whose warning came while the launcher was stopping after step 300 of 300)."""
    job = _job(tmp_path, Layout(learner_nodes=1, generator_nodes=1))
    env = {**_fakes(tmp_path), "FAKE_STATE": "complete", "SLURM_RESTART_COUNT": "1"}
    done = subprocess.run(
        ["bash", str(_script(tmp_path, job))], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert not (tmp_path / "log" / "launch.args").exists()
    assert "restart 1: already complete" in (job.run_dir / "slurm" / "jobs.log").read_text()


def test_run_state_reads_the_checkpoints(tmp_path):
    from asyncrl.config_load import load_config, write_resolved_config
    from asyncrl.learner.checkpoint import EXTRAS
    from asyncrl.slurm.join import run_state

    write_resolved_config(load_config(None, ["learner.steps=4"]), tmp_path / "config.json")
    assert run_state(tmp_path) == "fresh"
    checkpoints = tmp_path / "checkpoints"
    checkpoints.mkdir()

    def both_halves(version: int) -> None:
        (checkpoints / f"launcher-{version:08d}.json").write_text("{}")
        (checkpoints / f"learner-{version:08d}").mkdir()
        (checkpoints / f"learner-{version:08d}" / EXTRAS).write_text("")

    both_halves(2)
    assert run_state(tmp_path) == "resume"
    (checkpoints / "launcher-00000004.json").write_text("{}")  # the learner's half is missing
    assert run_state(tmp_path) == "resume"
    both_halves(4)
    assert run_state(tmp_path) == "complete"


def _launcher(tmp_path: Path, *sets: str):
    from asyncrl.config_load import load_config
    from asyncrl.job import load_task
    from asyncrl.models.default import DEFAULT_MODEL_DIR
    from asyncrl.scheduler.service import Launcher

    config = load_config(None, ["task.num_eval=0", *sets])
    task, tokenizer, _ = load_task(config, DEFAULT_MODEL_DIR)

    class Quiet:
        def update(self, state) -> None:
            pass

        def event(self, text: str, **fields) -> None:
            pass

    return Launcher(config, tmp_path, DEFAULT_MODEL_DIR, Quiet(), task=task, tokenizer=tokenizer)


def test_a_step_the_learner_finished_while_stopping_reaches_the_checkpoint(tmp_path):
    """Interrupted: the learner finished step 3 before its Shutdown came and saved its half of the
    stop's checkpoint at version 4, while the launcher, which no longer handled messages, saved
    its half at 3: no complete checkpoint, and the requeued allocation could not resume (seen in
    the slurm test). The StepDone waiting in the inbox is now handled first."""
    import asyncio

    from asyncrl.messages import StepDone
    from asyncrl.scheduler.children import Child
    from asyncrl.scheduler.inbox import Inbox

    launcher = _launcher(tmp_path, "learner.steps=8")
    launcher.state.step = launcher.state.policy_version = 3
    launcher.interrupted = True
    launcher.children["learner"] = Child(peer_id="learner", role="learner", handle=None, stopping=True)

    class Ctrl:
        num_rejected = 0

        def reject(self, reason: str) -> None:
            raise AssertionError(reason)

    inbox = Inbox(Ctrl(), None, launcher.finished)
    done = dict(num_trajectories=8, num_tokens=40, loss=0.0, mean_reward=0.5, max_staleness=0)
    done.update(mean_staleness=0.0, clip_fraction=0.0, grad_norm=1.0, step_s=0.1, idle_s=0.0)
    inbox.queue.put_nowait((b"learner", StepDone(step=3, version=4, **done), []))
    asyncio.run(launcher.take_late_messages(Ctrl(), inbox))
    assert (launcher.state.step, launcher.state.policy_version) == (4, 4)
    assert inbox.queue.empty()


def test_a_signal_after_the_last_step_leaves_the_run_completed(tmp_path):
    """The time-limit warning landed while the launcher was stopping after step 300 of 300: the run
    was recorded as interrupted (no held-out evaluation after training) and the job requeued."""
    launcher = _launcher(tmp_path, "learner.steps=2")
    launcher.state.step = 1
    launcher.interrupt()
    assert launcher.interrupted and launcher.finished.is_set()
    after = _launcher(tmp_path, "learner.steps=2")
    after.state.step = 2
    after.interrupt()
    assert not after.interrupted
