"""`asyncrl bench baseline`: asyncrl against the plain loop on the default job (bench/README.md,
"Baseline").

  plain   `python -m asyncrl.benchmarks.plain_loop --json`: the simplest correct single-process
          GRPO loop on the same job (asyncrl/benchmarks/plain_loop.py: Hugging Face `generate`,
          one forward/backward/step per batch, no overlap; torch on every CPU, or
          `--plain-threads`)
  async   `asyncrl launch --no-tui --set mode=async` (the default)
  sync    `asyncrl launch --no-tui --set mode=sync`

Each variant is a subprocess in its own run directory under a temporary directory (`--out-dir`
keeps them); every repeat runs all three, interleaved, the order rotated by one each repeat so
that neither machine noise nor position in the round favours one. `--set` overrides go to all three
(the plain loop reads the same config loader). Figures, the same definition for every variant:

  samples/s    training phase: samples trained / (end of the last optimizer step - start of
               training). Start: asyncrl, the launcher entering its training phase (learner and
               generators are loaded; the first prompts go out next), recovered from the step
               records of metrics.jsonl (`time_s - samples trained so far / samples_per_s`, where
               the launcher's `samples_per_s` counts from that moment); the plain loop, just
               before its first `generate`. End: asyncrl, the launcher's record of the last
               version's publish (the learner publishes right after its last optimizer step;
               its last StepDone comes only after the final checkpoint, the final model's save
               and the held-out evaluation); the plain loop, just after its last optimizer step.
               So the first batch's generation counts, process start, model loading and the
               evaluations do not.
  job_s        the subprocess's wall clock, Popen to exit, measured here for all three: imports,
               model loading, both evaluations, start-up and shutdown of every process.
  eval_*       greedy held-out accuracy before and after training (`asyncrl.models.sft`'s
               `greedy_accuracy`: summary.json for asyncrl, the plain loop's own result).

Reported: medians over repeats of each, `async_vs_plain` and `sync_vs_plain` (samples/s ratios of
the medians), the per-repeat figures and ratios. The pure parts (figures from records, medians,
ratios) are functions here; importing this module is cheap, subprocesses and rich load when the
command runs.
"""

from __future__ import annotations

import json
import math
import os
import statistics
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Annotated, Any

import typer

from asyncrl.benchmarks.plain_loop import json_safe

VARIANTS = ("plain", "async", "sync")
PLAIN_MODULE = "asyncrl.benchmarks.plain_loop"
RUN_TIMEOUT_S = 3600.0  # one run; the launcher's own supervision catches hung children sooner
FIGURES = ("sps", "train_s", "job_s", "eval_before", "eval_after")


# ---------------------------------------------------------------------------- pure figures
def training_start_s(steps: list[dict]) -> float:
    """When training began, on the records' clock (`time_s`), from metrics.jsonl step records.

    Each step record carries `samples_per_s` = samples trained so far / seconds since the launcher
    entered its training phase, so that moment is `time_s - trained so far / samples_per_s`; every
    record gives it (up to `time_s`'s rounding), the last one is used."""
    steps = sorted(steps, key=lambda r: r["step"])
    if not steps:
        raise ValueError("no step records: the run trained nothing")
    last = steps[-1]
    trained = sum(r["num_trajectories"] for r in steps)
    if last.get("samples_per_s", 0) <= 0:
        raise ValueError(f"step record {last['step']} has no positive samples_per_s")
    return last["time_s"] - trained / last["samples_per_s"]


def train_figures(records: list[dict]) -> dict[str, float]:
    """An asyncrl run's training phase from its metrics.jsonl records: samples trained (`samples`),
    seconds from the start of training to the last update (`train_s`: the publish record of the
    last step's version, else the last step record) and their ratio (`sps`)."""
    steps = sorted((r for r in records if r.get("type") == "step"), key=lambda r: r["step"])
    start_s = training_start_s(steps)
    last = steps[-1]
    published = [
        r["time_s"] for r in records if r.get("type") == "publish" and r.get("version") == last.get("version")
    ]
    train_s = (published[0] if published else last["time_s"]) - start_s
    samples = sum(r["num_trajectories"] for r in steps)
    if train_s <= 0 or samples <= 0:
        raise ValueError(f"no measurable training ({samples} samples in {train_s:.3f} s)")
    return {"samples": float(samples), "train_s": train_s, "sps": samples / train_s}


def median(values: Iterable[float | None]) -> float:
    """The median of the finite values (a run without a held-out set reports NaN); NaN if none."""
    finite = [v for v in values if v is not None and math.isfinite(v)]
    return statistics.median(finite) if finite else math.nan


def ratio(numerator: float, denominator: float) -> float:
    return numerator / denominator if denominator > 0 and math.isfinite(denominator) else math.nan


def repeat_order(repeat: int) -> tuple[str, ...]:
    """The order of the variants in repeat `repeat`: VARIANTS rotated by `repeat`."""
    k = repeat % len(VARIANTS)
    return VARIANTS[k:] + VARIANTS[:k]


def variant_sets(variant: str) -> list[str]:
    """The `--set` overrides that make the job into `variant` (applied after the user's)."""
    match variant:
        case "plain":
            return []
        case "async" | "sync":
            return [f"mode={variant}"]
    raise ValueError(f"unknown variant {variant!r}; valid: {', '.join(VARIANTS)}")


def summarize(runs: list[dict[str, dict[str, float]]]) -> dict[str, Any]:
    """Per-repeat figures -> the result: the median of each figure of each variant
    (`<variant>_sps`, `_train_s`, `_job_s`, `_eval_before`, `_eval_after`), the samples/s ratios
    of the medians (`async_vs_plain`, `sync_vs_plain`, `async_vs_sync`) and job-time ratios
    (`async_job_vs_plain`, `sync_job_vs_plain`: how many times the plain loop's job time), and
    `per_repeat` with each repeat's own figures and ratios.

    `runs[i][variant]` holds repeat i's FIGURES of that variant."""
    if not runs:
        raise ValueError("no repeats to summarize")
    per_repeat = []
    for rep in runs:
        missing = [v for v in VARIANTS if v not in rep]
        if missing:
            raise ValueError(f"a repeat lacks variants {missing}")
        row = {f"{v}_{f}": rep[v][f] for v in VARIANTS for f in FIGURES}
        for v in ("async", "sync"):
            row[f"{v}_vs_plain"] = ratio(row[f"{v}_sps"], row["plain_sps"])
        per_repeat.append(row)
    result: dict[str, Any] = {
        f"{v}_{f}": median(r[f"{v}_{f}"] for r in per_repeat) for v in VARIANTS for f in FIGURES
    }
    for v in ("async", "sync"):
        result[f"{v}_vs_plain"] = ratio(result[f"{v}_sps"], result["plain_sps"])
        result[f"{v}_job_vs_plain"] = ratio(result[f"{v}_job_s"], result["plain_job_s"])
        result[f"median_{v}_vs_plain_per_repeat"] = median(r[f"{v}_vs_plain"] for r in per_repeat)
    result["async_vs_sync"] = ratio(result["async_sps"], result["sync_sps"])
    result["per_repeat"] = per_repeat
    return result


def _number(value: float | None) -> float:
    return math.nan if value is None else float(value)


# ---------------------------------------------------------------------------- the runs
class BaselineRunFailed(RuntimeError):
    """One run of the bench did not complete."""


def run_plain(
    sets: list[str], run_dir: Path, *, threads: int, config: Path | None = None
) -> tuple[float, dict[str, Any]]:
    """The plain loop as a fresh process on `threads` torch threads; (its wall seconds, its
    result). The JSON result goes to <run_dir>/result.json, everything else to <run_dir>.log."""
    import subprocess
    import sys
    import time

    run_dir.mkdir(parents=True)
    args = [sys.executable, "-m", PLAIN_MODULE, "--json", f"--threads={threads}"]
    if config is not None:
        args.append(f"--config={config}")
    for s in sets:
        args += ["--set", s]
    log_path, out_path = run_dir.with_suffix(".log"), run_dir / "result.json"
    start = time.perf_counter()
    with log_path.open("w") as log, out_path.open("w") as out:
        proc = subprocess.Popen(args, stdout=out, stderr=log, stdin=subprocess.DEVNULL)
        try:
            code = proc.wait(timeout=RUN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            code = None
        finally:
            if proc.poll() is None:  # timed out or interrupted: the plain loop has no children
                proc.kill()
                proc.wait()
    wall_s = time.perf_counter() - start
    if code != 0:
        tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-15:])
        why = f"timed out after {RUN_TIMEOUT_S:.0f} s" if code is None else f"exited with code {code}"
        raise BaselineRunFailed(f"{run_dir.name} {why}; log {log_path}:\n{tail}")
    return wall_s, json.loads(out_path.read_text())


def run_variant(
    variant: str, sets: list[str], run_dir: Path, *, plain_threads: int, config: Path | None = None
) -> dict[str, float]:
    """One run of `variant` of the job file `config` (default: the embedded job) with the user's
    `sets`; its FIGURES (and samples trained)."""
    if variant == "plain":
        wall_s, res = run_plain(
            [*sets, *variant_sets(variant)], run_dir, threads=plain_threads, config=config
        )
        return {
            "sps": res["samples_per_s"],
            "train_s": res["train_s"],
            "samples": float(res["num_samples"]),
            "job_s": wall_s,
            "eval_before": _number(res["eval_before"]),
            "eval_after": _number(res["eval_after"]),
        }
    from asyncrl.benchmarks.runs import BenchRunFailed, launch, read_records

    try:
        wall_s = launch([*sets, *variant_sets(variant)], run_dir, config=config)
    except BenchRunFailed as exc:
        raise BaselineRunFailed(str(exc)) from None
    summary = json.loads((run_dir / "summary.json").read_text())
    return {
        **train_figures(read_records(run_dir)),
        "job_s": wall_s,
        "eval_before": _number(summary["eval_before"]),
        "eval_after": _number(summary["eval_after"]),
    }


def run_baseline_bench(
    sets: list[str],
    *,
    repeats: int,
    out_dir: Path | None,
    plain_threads: int,
    progress: Callable[[str], None] | None = None,
    config: Path | None = None,
) -> dict[str, Any]:
    """Every variant once per repeat, interleaved; `summarize`'s object plus the context."""
    import shutil
    import tempfile

    say = progress or (lambda _text: None)
    root = Path(out_dir) if out_dir is not None else Path(tempfile.mkdtemp(prefix="asyncrl-bench-baseline-"))
    root.mkdir(parents=True, exist_ok=True)
    load_start = os.getloadavg()[0]
    runs: list[dict[str, dict[str, float]]] = []
    try:
        for rep in range(repeats):
            figures: dict[str, dict[str, float]] = {}
            for variant in repeat_order(rep):
                run_dir = root / f"r{rep}-{variant}"
                if run_dir.exists():
                    raise BaselineRunFailed(f"{run_dir} already exists; choose another --out-dir")
                figures[variant] = f = run_variant(
                    variant, sets, run_dir, plain_threads=plain_threads, config=config
                )
                say(
                    f"repeat {rep + 1}/{repeats} {variant:<6} {f['sps']:8.1f} samples/s (train "
                    f"{f['train_s']:.1f} s), job {f['job_s']:.1f} s, held-out {f['eval_before']:.3f} -> "
                    f"{f['eval_after']:.3f} (load {os.getloadavg()[0]:.2f})"
                )
            runs.append(figures)
    finally:
        if out_dir is None:
            shutil.rmtree(root, ignore_errors=True)
    result = summarize(runs)
    result["samples_trained"] = {v: runs[0][v]["samples"] for v in VARIANTS}
    result["repeats"] = repeats
    result["sets"] = sets
    result["config"] = str(config) if config else ""
    result["plain_threads"] = plain_threads
    result["num_cpus"] = os.cpu_count()
    result["load_average_1min"] = {"start": load_start, "end": os.getloadavg()[0]}
    if out_dir is not None:
        result["out_dir"] = str(root)
    return result


def print_table(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    reps = result["per_repeat"]
    table = Table(title=f"asyncrl bench baseline: medians of {len(reps)} repeat(s)")
    for name in ("variant", "samples/s", "vs plain", "job s", "held-out", "samples/s by repeat"):
        table.add_column(name, justify="left" if name in ("variant", "held-out") else "right")
    for v in VARIANTS:
        table.add_row(
            v,
            f"{result[f'{v}_sps']:.0f}",
            "1.00" if v == "plain" else f"{result[f'{v}_vs_plain']:.2f}",
            f"{result[f'{v}_job_s']:.1f}",
            f"{result[f'{v}_eval_before']:.3f} -> {result[f'{v}_eval_after']:.3f}",
            " ".join(f"{r[f'{v}_sps']:.0f}" for r in reps),
        )
    console = Console()
    console.print(table)
    console.print(
        "samples/s: samples trained / (last optimizer step's end - start of training); job wall: "
        "the process from start to exit, measured from outside; held-out: greedy accuracy"
    )
    load = result["load_average_1min"]
    console.print(
        f"plain loop on {result['plain_threads']} torch threads; load average (1 min) "
        f"{load['start']:.2f} -> {load['end']:.2f} on {result['num_cpus']} CPUs"
    )


# ---------------------------------------------------------------------------- the command
def command(
    config: Annotated[
        Path | None, typer.Argument(help="the job's TOML file (default: the embedded job)")
    ] = None,
    repeats: Annotated[int, typer.Option(help="rounds of the three variants; medians reported")] = 5,
    set_: Annotated[
        list[str] | None,
        typer.Option("--set", help="config override for all three variants, e.g. --set learner.steps=30"),
    ] = None,
    plain_threads: Annotated[
        int | None,
        typer.Option(help="the plain loop's torch threads (default: every CPU, os.cpu_count())"),
    ] = None,
    out_dir: Annotated[
        Path | None, typer.Option(help="keep the run directories here (default: a temporary directory)")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="print the result as JSON")] = False,
) -> None:
    """Baseline: asyncrl (async and sync) against a plain single-process GRPO loop on the same job."""
    if repeats < 1:
        raise typer.BadParameter(f"--repeats must be >= 1, got {repeats}")
    threads = (os.cpu_count() or 1) if plain_threads is None else plain_threads
    if threads < 1:
        raise typer.BadParameter(f"--plain-threads must be >= 1, got {plain_threads}")
    sets = list(set_ or [])
    from asyncrl.benchmarks.plain_loop import unsupported
    from asyncrl.config_load import load_config
    from asyncrl.config_sections import ConfigError

    try:  # fail on a bad --set before any process starts
        configs = {v: load_config(config, [*sets, *variant_sets(v)]) for v in VARIANTS}
    except ConfigError as exc:
        raise typer.BadParameter(str(exc)) from None
    refused = unsupported(configs["plain"])
    if refused:
        raise typer.BadParameter(f"the plain loop does not implement: {'; '.join(refused)}")
    try:
        result = run_baseline_bench(
            sets,
            repeats=repeats,
            out_dir=out_dir,
            plain_threads=threads,
            progress=lambda text: typer.echo(text, err=True),
            config=config.resolve() if config else None,
        )
    except BaselineRunFailed as exc:
        typer.secho(f"error: {exc}", fg=typer.colors.RED, err=True)
        raise typer.Exit(1) from None
    if as_json:
        typer.echo(json.dumps(json_safe(result), indent=2))
    else:
        print_table(result)
