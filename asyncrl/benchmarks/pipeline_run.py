"""The runs behind `asyncrl bench pipeline` (asyncrl/benchmarks/pipeline.py has the figures):
each variant is one `asyncrl launch --no-tui` subprocess in its own run directory."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from asyncrl.benchmarks.pipeline import RUN_TIMEOUT_S, VARIANTS, run_figures, summarize, variant_sets

STOP_GRACE_S = 60.0  # a launcher told to stop (SIGTERM) stops its children within this


class BenchRunFailed(RuntimeError):
    """One launch of the bench did not complete."""


def launch(sets: list[str], run_dir: Path) -> float:
    """`asyncrl launch` with `sets` into `run_dir`; returns its wall seconds. Output goes to
    <run_dir>.log; a failed or timed-out run raises BenchRunFailed with the log's tail."""
    args = [sys.executable, "-m", "asyncrl", "launch", "--no-tui"]
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
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(x) for x in lines if x.strip()]


def run_pipeline_bench(
    workload: list[str],
    *,
    repeats: int,
    skip: int,
    out_dir: Path | None,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Every variant once per repeat, interleaved; returns `summarize`'s object plus the context."""
    say = progress or (lambda _text: None)
    root = Path(out_dir) if out_dir is not None else Path(tempfile.mkdtemp(prefix="asyncrl-bench-pipeline-"))
    root.mkdir(parents=True, exist_ok=True)
    load_start = os.getloadavg()[0]
    runs: list[dict[str, dict[str, float]]] = []
    walls: list[dict[str, float]] = []
    try:
        for rep in range(repeats):
            figures: dict[str, dict[str, float]] = {}
            wall: dict[str, float] = {}
            for variant in VARIANTS:
                run_dir = root / f"r{rep}-{variant}"
                if run_dir.exists():
                    raise BenchRunFailed(f"{run_dir} already exists; choose another --out-dir")
                recording = root / f"r{rep}-gen_only" / "trajectories.jsonl"
                wall[variant] = launch([*workload, *variant_sets(variant, recording=recording)], run_dir)
                figures[variant] = run_figures(read_records(run_dir), skip=skip)
                say(
                    f"repeat {rep + 1}/{repeats} {variant:<10} {figures[variant]['sps']:8.1f} samples/s "
                    f"(launch wall {wall[variant]:.1f} s, load {os.getloadavg()[0]:.2f})"
                )
            runs.append(figures)
            walls.append(wall)
    finally:
        if out_dir is None:
            shutil.rmtree(root, ignore_errors=True)
    result = summarize(runs)
    result["launch_wall_s"] = walls
    result["workload"] = workload
    result["skip_steps"] = skip
    result["load_average_1min"] = {"start": load_start, "end": os.getloadavg()[0]}
    result["num_cpus"] = os.cpu_count()
    if out_dir is not None:
        result["out_dir"] = str(root)
    return result


def print_table(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    reps = result["per_repeat"]
    table = Table(title="asyncrl bench pipeline: steady-state samples/s")
    table.add_column("variant")
    table.add_column("median", justify="right")
    for i in range(len(reps)):
        table.add_column(f"repeat {i + 1}", justify="right")
    for v in VARIANTS:
        table.add_row(v, f"{result[f'{v}_sps']:.1f}", *(f"{r[f'{v}_sps']:.1f}" for r in reps))
    table.add_row(
        "efficiency",
        f"{result['efficiency']:.3f}",
        *(f"{r['efficiency']:.3f}" for r in reps),
        end_section=False,
    )
    table.add_row("speedup", f"{result['speedup']:.3f}", *(f"{r['speedup']:.3f}" for r in reps))
    console = Console()
    console.print(table)
    lines = [
        f"efficiency = async / min(gen_only, learn_only); speedup = async / sync; slower stage: "
        f"{result['bound']} (balance {result['balance']:.2f})",
    ]
    if "async_learner_tail_s" in result:
        lines.append(
            f"async: learner tail {result['async_learner_tail_s'] * 1e3:.1f} ms (last trajectory in -> update "
            f"done), learner idle {result.get('async_learner_idle_ratio', float('nan')):.2f}, generator busy "
            f"{result.get('async_gen_busy_ratio', float('nan')):.2f}"
        )
    load = result["load_average_1min"]
    lines.append(
        f"skipped first {result['skip_steps']} steps; load average (1 min) {load['start']:.2f} -> "
        f"{load['end']:.2f} on {result['num_cpus']} CPUs"
    )
    for line in lines:
        console.print(line)
