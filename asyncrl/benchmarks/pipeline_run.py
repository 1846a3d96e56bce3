"""The runs behind `asyncrl bench pipeline` (the command in pipeline.py, the figures in
pipeline_figures.py): each variant is one `asyncrl launch --no-tui` subprocess (runs.py) in its own
run directory; the calibration, the trained policy, the interleaved repeats and the table."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from asyncrl.benchmarks.pipeline_figures import (
    CALIBRATION_BATCH_GROUPS,
    VARIANTS,
    balanced_batch_groups,
    run_figures,
    summarize,
    variant_command,
    variant_sets,
)
from asyncrl.benchmarks.runs import BenchRunFailed, launch, read_records


def train_policy(workload: list[str], root: Path, *, say: Callable[[str], None]) -> Path:
    """One sync run of the workload; its final model is the policy the single-stage variants run
    (`variant_sets`'s `policy`)."""
    run_dir = root / "trained-policy"
    launch([*workload, *variant_sets("sync")], run_dir)
    say(f"trained the single-stage variants' policy: {run_dir / 'final_model'}")
    return run_dir / "final_model"


def calibrate_batch_groups(
    workload: list[str],
    root: Path,
    *,
    skip: int,
    largest: int,
    say: Callable[[str], None],
    policy: Path | None = None,
) -> dict[str, Any]:
    """Pick `generators.max_batch_groups` so that the two stages run at about the same rate here:
    the learner's own rate (learn_only, replaying a gen_only recording) and the generator's at
    `CALIBRATION_BATCH_GROUPS`, fitted by `balanced_batch_groups`. The smaller batch size is only
    measured when the generator outruns the learner at the larger one."""
    # A batch never holds more groups than a step has (a larger setting samples as many).
    high, low = (min(m, largest) for m in CALIBRATION_BATCH_GROUPS)
    gen: dict[int, float] = {}

    def gen_only(m: int) -> float:
        run_dir = root / f"calibrate-gen_only-mbg{m}"
        launch(
            [f"generators.max_batch_groups={m}", *workload, *variant_sets("gen_only", policy=policy)],
            run_dir,
            command=variant_command("gen_only"),
        )
        gen[m] = run_figures(read_records(run_dir), skip=skip)["sps"]
        say(f"calibrate gen_only at max_batch_groups {m}: {gen[m]:8.1f} samples/s")
        return gen[m]

    gen_only(high)
    run_dir = root / "calibrate-learn_only"
    recording = root / f"calibrate-gen_only-mbg{high}" / "trajectories.jsonl"
    launch(
        [
            f"generators.max_batch_groups={high}",
            *workload,
            *variant_sets("learn_only", recording=recording, policy=policy),
        ],
        run_dir,
    )
    learn = run_figures(read_records(run_dir), skip=skip)["sps"]
    say(f"calibrate learn_only: {learn:8.1f} samples/s")
    if gen[high] > learn and low < high:
        gen_only(low)
    chosen = balanced_batch_groups(gen, learn, largest=largest)
    say(f"calibrate: max_batch_groups {chosen} balances the two stages")
    return {"gen_only_sps": {str(m): v for m, v in gen.items()}, "learn_only_sps": learn, "chosen": chosen}


def run_pipeline_bench(
    workload: list[str],
    *,
    repeats: int,
    skip: int,
    out_dir: Path | None,
    max_batch_groups: int | None = None,
    largest_batch_groups: int = 32,
    trained_policy: bool = True,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Every variant once per repeat, interleaved; returns `summarize`'s object plus the context.
    `max_batch_groups` None: chosen first by `calibrate_batch_groups` (at most
    `largest_batch_groups`), and the calibration is in the result. `trained_policy`: gen_only and
    learn_only run a policy trained first by one sync run (`train_policy`), not the initial one."""
    say = progress or (lambda _text: None)
    root = Path(out_dir) if out_dir is not None else Path(tempfile.mkdtemp(prefix="asyncrl-bench-pipeline-"))
    root.mkdir(parents=True, exist_ok=True)
    load_start = os.getloadavg()[0]
    runs: list[dict[str, dict[str, float]]] = []
    walls: list[dict[str, float]] = []
    calibration = None
    try:
        policy = train_policy(workload, root, say=say) if trained_policy else None
        if max_batch_groups is None:
            calibration = calibrate_batch_groups(
                workload, root, skip=skip, largest=largest_batch_groups, say=say, policy=policy
            )
            max_batch_groups = calibration["chosen"]
        workload = [f"generators.max_batch_groups={max_batch_groups}", *workload]  # a --set still wins
        for rep in range(repeats):
            figures: dict[str, dict[str, float]] = {}
            wall: dict[str, float] = {}
            for variant in VARIANTS:
                run_dir = root / f"r{rep}-{variant}"
                if run_dir.exists():
                    raise BenchRunFailed(f"{run_dir} already exists; choose another --out-dir")
                recording = root / f"r{rep}-gen_only" / "trajectories.jsonl"
                sets = variant_sets(variant, recording=recording, policy=policy)
                wall[variant] = launch([*workload, *sets], run_dir, command=variant_command(variant))
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
    result["max_batch_groups"] = max_batch_groups
    if calibration is not None:
        result["calibration"] = calibration
    result["standalone_policy"] = "trained" if trained_policy else "initial"
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
    if "efficiency_tokens" in result:
        rates = ", ".join(f"{v} {result[f'{v}_tps']:.0f}" for v in VARIANTS)
        lines.append(f"generated tokens/s: {rates}; efficiency in tokens {result['efficiency_tokens']:.3f}")
    lines.append(f"gen_only and learn_only ran the {result['standalone_policy']} policy")
    cal = result.get("calibration")
    how = "chosen by calibration" if cal else "as given"
    lines.append(f"generators.max_batch_groups {result['max_batch_groups']} ({how})")
    if cal:
        rates = ", ".join(f"mbg {m}: {v:.0f}" for m, v in cal["gen_only_sps"].items())
        lines.append(f"calibration: gen_only {rates}; learn_only {cal['learn_only_sps']:.0f} samples/s")
    if "async_learner_tail_s" in result:
        lines.append(
            f"async: learner tail {result['async_learner_tail_s'] * 1e3:.1f} ms (last trajectory in -> update "
            f"done), learner idle {result.get('async_learner_idle_ratio', float('nan')):.2f}, generator busy "
            f"{result.get('async_gen_busy_ratio', float('nan')):.2f}"
        )
    cpus = result.get("cpus")
    if cpus:
        lines.append(f"placement: learner on CPUs {cpus['learner']}, generators on {cpus['generators']}")
    else:
        lines.append("placement: wherever the OS schedules each process")
    load = result["load_average_1min"]
    lines.append(
        f"skipped first {result['skip_steps']} steps; load average (1 min) {load['start']:.2f} -> "
        f"{load['end']:.2f} on {result['num_cpus']} CPUs"
    )
    for line in lines:
        console.print(line)
