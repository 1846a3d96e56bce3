"""One `asyncrl` job as a subprocess, for the benchmarks that measure whole runs (`bench pipeline`,
`bench baseline`, `bench staleness`): start it in its own run directory, wait with a timeout, stop
it cleanly, and read its metrics.jsonl records. Nothing here measures; the callers do."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

RUN_TIMEOUT_S = 3600.0  # one launch; the launcher's own supervision catches hung children sooner
STOP_GRACE_S = 60.0  # a launcher told to stop (SIGTERM) stops its children within this


class BenchRunFailed(RuntimeError):
    """One launch of the bench did not complete."""


def launch(
    sets: list[str], run_dir: Path, *, command: Sequence[str] = ("launch",), config: Path | None = None
) -> float:
    """`asyncrl launch` (or another `command` that runs the job) of the job file `config` (default:
    the embedded job) with `sets` into `run_dir`; returns its wall seconds. Output goes to
    <run_dir>.log; a failed or timed-out run raises BenchRunFailed with the log's tail."""
    args = [sys.executable, "-m", "asyncrl", *command, *([str(config)] if config else []), "--no-tui"]
    for s in [
        *sets,
        f"run.out_dir={json.dumps(str(run_dir.parent))}",
        f"run.name={json.dumps(run_dir.name)}",
    ]:
        args += ["--set", s]
    log_path = run_dir.with_suffix(".log")
    start = time.perf_counter()
    with log_path.open("w") as log:
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        try:
            code = proc.wait(timeout=RUN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGTERM)  # the launcher stops its own children on SIGTERM
            try:
                proc.wait(timeout=STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            code = None
        except BaseException:  # Ctrl-C: let the launcher stop its children, then re-raise
            proc.send_signal(signal.SIGTERM)
            proc.wait()
            raise
    wall_s = time.perf_counter() - start
    if code != 0:
        tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-15:])
        why = f"timed out after {RUN_TIMEOUT_S:.0f} s" if code is None else f"exited with code {code}"
        raise BenchRunFailed(f"{run_dir.name} {why}; log {log_path}:\n{tail}")
    return wall_s


def read_records(run_dir: Path) -> list[dict]:
    """The run's metrics.jsonl records, in order."""
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(x) for x in lines if x.strip()]
