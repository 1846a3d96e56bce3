"""`asyncrl slurm JOB.toml ...`: check the job, make its run directory, keys and batch script,
and submit it with sbatch (or, with --dry-run, print the script and touch nothing).

Place in the data flow: before any process of the run exists. What this writes into the run
directory (all under RUN_DIR/slurm/, the only entry a fresh launch there tolerates):

  job.sbatch     the batch script (script.py), the user's to edit and resubmit
  keys/          the run's CURVE keys (`asyncrl keys`), 0700/0600: the head node's
  worker-keys/   the three files a generator host needs, 0700/0600
  jobs.log       one line per event of the job: submitted, each allocation's start and end,
                 signals, requeues (the script appends the rest)
  job-JOBID.out  the batch step's output (sbatch --output), every allocation appended
  logs/JOBID.N/  allocation N's logs: the launcher's, one per learner node, one per worker
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from asyncrl.config_load import load_config
from asyncrl.slurm.script import (
    KEYS_DIR,
    SCRIPT_NAME,
    WORKER_KEY_FILES,
    WORKER_KEYS_DIR,
    Job,
    Layout,
    check_overrides,
    check_warning,
    render,
)
from asyncrl.transport.security import write_keys

SBATCH_TIMEOUT_S = 60.0


@dataclass(frozen=True, kw_only=True)
class Submission:
    """The command's flags, as typed."""

    config: Path | None
    overrides: tuple[str, ...]
    layout: Layout
    partition: str = ""
    time: str = ""
    warn_s: int = 300
    max_requeues: int = 20


def build_job(sub: Submission) -> Job:
    """The job the script is written from; ValueError (or ConfigError) for bad input, before
    anything is written. The config is loaded as `asyncrl launch` will load it."""
    check_overrides(sub.overrides)
    check_warning(sub.time, sub.warn_s)
    if sub.max_requeues < 0:
        raise ValueError(f"--max-requeues {sub.max_requeues}: 0 or more")
    layout = sub.layout
    scale = [
        f"learner.world_size={layout.world_size}",
        f"generators.num_generators={layout.num_generators}",
        f"generators.remote={layout.num_generators}",
    ]
    config = load_config(sub.config, [*sub.overrides, *scale])
    name = config.run.name or datetime.now().strftime("%Y%m%d-%H%M%S-") + config.mode
    return Job(
        layout=layout,
        run_dir=Path(os.path.abspath(config.run.out_dir)) / name,
        config=Path(os.path.abspath(sub.config)) if sub.config is not None else None,
        overrides=sub.overrides,
        python=sys.executable,
        workdir=Path.cwd(),
        partition=sub.partition,
        time=sub.time,
        warn_s=sub.warn_s,
        max_requeues=sub.max_requeues,
    )


def sbatch_path() -> str:
    path = shutil.which("sbatch")
    if path is None:
        raise ValueError(
            "sbatch is not on PATH: run asyncrl slurm on a SLURM login node (Debian: apt-get install "
            "slurm-client, with the cluster's slurm.conf), or add --dry-run to print the script"
        )
    return path


def prepare_run_dir(job: Job, text: str) -> Path:
    """The run directory with the script and the run's keys; the script's path."""
    run_dir = job.run_dir
    if run_dir.exists() and any(run_dir.iterdir()):
        raise ValueError(f"run directory {run_dir} already exists and is not empty; choose another run.name")
    (run_dir / "slurm").mkdir(parents=True, exist_ok=True)
    write_keys(run_dir / KEYS_DIR)
    workers = run_dir / WORKER_KEYS_DIR
    workers.mkdir(mode=0o700)
    for name in WORKER_KEY_FILES:
        shutil.copy2(run_dir / KEYS_DIR / name, workers / name)  # the mode (0600) comes along
    script = run_dir / SCRIPT_NAME
    script.write_text(text)
    return script


def submit(job: Job, text: str) -> tuple[str, Path]:
    """Write the run directory and submit the script; (the job id, the script's path)."""
    sbatch = sbatch_path()
    script = prepare_run_dir(job, text)
    done = subprocess.run(
        [sbatch, "--parsable", str(script)], capture_output=True, text=True, timeout=SBATCH_TIMEOUT_S
    )
    if done.returncode != 0:
        raise ValueError(
            f"sbatch refused the job: {done.stderr.strip() or done.stdout.strip()}\n"
            f"the script is {script}: fix it (or the flags) and run `sbatch {script}`"
        )
    job_id = done.stdout.strip().split(";")[0]
    stamp = datetime.now().astimezone().strftime("%Y-%m-%dT%H:%M:%S%z")
    with open(job.run_dir / "slurm" / "jobs.log", "a") as log:
        log.write(f"{stamp} job {job_id}: submitted ({script})\n")
    return job_id, script


def run_slurm(sub: Submission, *, dry_run: bool) -> str:
    """The command: the script (dry run), or submit it; what to print."""
    job = build_job(sub)
    text = render(job)
    if dry_run:
        return text
    job_id, script = submit(job, text)
    return (
        f"submitted job {job_id}: {script}\n"
        f"run directory: {job.run_dir} (jobs.log, logs/ and job-{job_id}.out under slurm/)\n"
        f"watch it:      squeue -j {job_id}; asyncrl monitor {job.run_dir}\n"
        f"stop it:       scancel --signal=USR1 --batch {job_id}  (checkpoint, then requeue and resume)\n"
        f"               scancel --signal=TERM --batch {job_id}  (checkpoint, and end)\n"
    )
