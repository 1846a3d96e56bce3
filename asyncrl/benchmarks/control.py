"""`asyncrl bench staleness`: the closed-loop staleness bound against a sweep of fixed bounds, on
the same job in the same run (bench/README.md, "Closed-loop staleness").

Variants: `staleness.max_staleness = K` for each K of `--bounds` (default 0 1 2 4), and "auto"
(`staleness.max_staleness = "auto"` with `staleness.max_staleness_cap` = the largest K, and
`generators.max_batch_groups = "auto"`); a `--set` applies to all of them. Every repeat runs them all, the order rotated
by one each repeat. Figures per run, as `asyncrl bench baseline` defines them: training-phase
samples/s and held-out accuracy after training. Reported: each variant's medians, the best fixed
bound (highest median samples/s), `auto_vs_best` (auto's median over the best's) and
`auto_eval_minus_best` (held-out accuracy, auto's median minus the best's).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Annotated, Any

import typer

from asyncrl.benchmarks.baseline import median, ratio, train_figures

AUTO = "auto"


def variant_name(bound: int | str) -> str:
    return AUTO if bound == AUTO else f"k{bound}"


def variant_sets(bound: int | str, *, cap: int) -> list[str]:
    if bound == AUTO:  # both closed-loop knobs
        return [
            "staleness.max_staleness=auto",
            f"staleness.max_staleness_cap={cap}",
            "generators.max_batch_groups=auto",
        ]
    return [f"staleness.max_staleness={bound}"]


def rotated(items: list, repeat: int) -> list:
    k = repeat % len(items)
    return items[k:] + items[:k]


def summarize(runs: list[dict[str, dict[str, float]]], bounds: list[int]) -> dict[str, Any]:
    """`runs[i][variant]` = repeat i's {"sps", "eval_after"} -> medians, best fixed bound, ratios."""
    names = [variant_name(b) for b in bounds] + [AUTO]
    result: dict[str, Any] = {
        name: {f: median(r[name][f] for r in runs) for f in ("sps", "eval_after")} for name in names
    }
    best = max(bounds, key=lambda b: result[variant_name(b)]["sps"])
    result["best_fixed"] = best
    best_fig = result[variant_name(best)]
    result["auto_vs_best"] = ratio(result[AUTO]["sps"], best_fig["sps"])
    result["auto_eval_minus_best"] = result[AUTO]["eval_after"] - best_fig["eval_after"]
    result["per_repeat"] = runs
    return result


def run_bench(sets: list[str], bounds: list[int], *, repeats: int, out_dir: Path, say) -> dict[str, Any]:
    from asyncrl.benchmarks.runs import launch, read_records

    cap = max(bounds)
    order: list[int | str] = [*bounds, AUTO]
    runs = []
    for rep in range(repeats):
        figures = {}
        for bound in rotated(order, rep):
            name = variant_name(bound)
            run_dir = out_dir / f"r{rep}-{name}"
            launch([*sets, *variant_sets(bound, cap=cap)], run_dir)
            summary = json.loads((run_dir / "summary.json").read_text())
            figures[name] = {**train_figures(read_records(run_dir)), "eval_after": summary["eval_after"]}
            say(
                f"repeat {rep + 1}/{repeats} {name:<5} {figures[name]['sps']:8.1f} samples/s, held-out "
                f"{summary['eval_after']:.3f} (load {os.getloadavg()[0]:.2f})"
            )
        runs.append(figures)
    return summarize(runs, bounds)


def command(
    repeats: Annotated[int, typer.Option(help="rounds of all variants; medians reported")] = 3,
    bounds: Annotated[str, typer.Option(help="fixed staleness bounds to sweep, comma-separated")] = "0,1,2,4",
    set_: Annotated[list[str] | None, typer.Option("--set", help="config override for every variant")] = None,
    out_dir: Annotated[Path | None, typer.Option(help="keep the run directories here")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="print the result as JSON")] = False,
) -> None:
    """Closed-loop staleness: the auto bound against a sweep of fixed bounds on the same job."""
    import shutil
    import tempfile

    try:
        fixed = sorted({int(b) for b in bounds.split(",") if b.strip()})
    except ValueError:
        raise typer.BadParameter(f"--bounds takes integers like 0,1,2,4; got {bounds!r}") from None
    if not fixed or min(fixed) < 0 or repeats < 1:
        raise typer.BadParameter("--bounds needs at least one bound >= 0, --repeats at least 1")
    root = out_dir or Path(tempfile.mkdtemp(prefix="asyncrl-bench-staleness-"))
    root.mkdir(parents=True, exist_ok=True)
    try:
        result = run_bench(
            list(set_ or []), fixed, repeats=repeats, out_dir=root, say=lambda t: typer.echo(t, err=True)
        )
    finally:
        if out_dir is None:
            shutil.rmtree(root, ignore_errors=True)
    result["repeats"] = repeats
    if as_json:
        typer.echo(json.dumps(result, indent=2))
        return
    for name in [variant_name(b) for b in fixed] + [AUTO]:
        typer.echo(
            f"{name:<5} {result[name]['sps']:8.1f} samples/s  held-out {result[name]['eval_after']:.3f}"
        )
    typer.echo(
        f"best fixed bound {result['best_fixed']}; auto at {result['auto_vs_best']:.2f}x its samples/s, "
        f"held-out {result['auto_eval_minus_best']:+.3f}"
    )
