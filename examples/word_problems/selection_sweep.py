"""Prompt selection on a dataset job (the word-problems example by default, `--config` for another,
e.g. examples/smollm2_arithmetic/config.toml): each `sampling.selection` strategy, several seeds,
at equal sample budgets (every strategy admits the same groups of the same size per step; only
which prompt a group gets differs). Runs the launches one after another and prints a table of
medians and spreads (docs/tasks.md, "Prompt selection", has the figures and the commands).

    python examples/word_problems/selection_sweep.py --out /tmp/sweep --rows 64 --steps 8 --seeds 1 2 3 \
        --set learner.groups_per_step=16 --set task.num_eval=100

`--rows N` trains on the first N rows of the job's training file (`task.dataset.path`; the subset
is written under --out), so that a short run sees each prompt several times, which is when a
per-prompt record can matter; 0 = every row (the word-problems example's 4000: a 40-step run
then sees each prompt at most once). An existing run directory is not
run again (its records are read), so an interrupted sweep continues where it stopped.

A strategy `S+B` runs selection S with `sampling.budget = B` (rollout budgets, docs/tasks.md), e.g.
`--strategies uniform uniform+uncertainty`: the same samples per step, split unequally over groups.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tomllib
from pathlib import Path

HERE = Path(__file__).resolve().parent
STRATEGIES = ("uniform", "skip", "priority", "curriculum", "replay")


def launch(out: Path, name: str, sets: list[str], config: Path) -> None:
    if (out / name / "summary.json").is_file():
        return
    args = [sys.executable, "-m", "asyncrl", "launch", "--no-tui", str(config)]
    for s in [f'run.out_dir="{out}"', f'run.name="{name}"', *sets]:
        args += ["--set", s]
    subprocess.run(args, check=True, stdout=subprocess.DEVNULL)


def figures(run_dir: Path) -> dict[str, float]:
    """Training reward over the run's last quarter of steps and its first (both at the same
    samples generated for every strategy), held-out accuracy after, the mean degenerate fraction."""
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
    steps = [r for r in steps if r.get("type") == "step"]
    quarter = max(1, len(steps) // 4)
    summary = json.loads((run_dir / "summary.json").read_text())
    degenerate = [r["degenerate_fraction"] for r in steps if r.get("degenerate_fraction") is not None]
    return {
        "reward_first_q": statistics.fmean(r["mean_reward"] for r in steps[:quarter]),
        "reward_last_q": statistics.fmean(r["mean_reward"] for r in steps[-quarter:]),
        "held_out_after": summary["eval_after"],
        "degenerate": statistics.fmean(degenerate) if degenerate else float("nan"),
        "samples": sum(r.get("num_trajectories", 0) for r in steps),
    }


def train_path(config: Path) -> Path:
    """The training file of a dataset job's config (relative paths are the config's directory's)."""
    with config.open("rb") as f:
        path = Path(tomllib.load(f)["task"]["dataset"]["path"])
    return path if path.is_absolute() else config.resolve().parent / path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument(
        "--config",
        type=Path,
        default=HERE / "config.toml",
        help="the job (a dataset task; default this example's)",
    )
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--strategies", nargs="+", default=list(STRATEGIES))
    ap.add_argument("--set", action="append", default=[], dest="extra", help="more --set overrides")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    sets = [f"learner.steps={args.steps}", *args.extra]
    if args.rows:
        rows = train_path(args.config).read_text().splitlines()[: args.rows]
        subset = args.out / f"train{args.rows}.jsonl"
        subset.write_text("\n".join(rows) + "\n")
        sets.append(f'task.dataset.path="{subset}"')
    table: dict[str, list[dict[str, float]]] = {}
    for seed in args.seeds:  # interleaved: every strategy of a seed before the next seed
        for strategy in args.strategies:
            name = f"{strategy}-s{seed}"
            selection, _, budget = strategy.partition("+")
            launch(
                args.out,
                name,
                [
                    *sets,
                    f"sampling.selection={selection}",
                    *([f"sampling.budget={budget}"] if budget else []),
                    f"run.seed={seed}",
                    f"task.seed={seed}",
                ],
                args.config,
            )
            table.setdefault(strategy, []).append(figures(args.out / name))
    keys = ("reward_first_q", "reward_last_q", "held_out_after", "degenerate")
    print("| strategy | " + " | ".join(f"{k} median [min, max]" for k in keys) + " |")
    print("|---|" + "---|" * len(keys))
    for strategy, runs in table.items():
        cells = []
        for k in keys:
            v = [r[k] for r in runs]
            cells.append(f"{statistics.median(v):.3f} [{min(v):.3f}, {max(v):.3f}]")
        print(f"| {strategy} | " + " | ".join(cells) + " |")
    print(json.dumps(table))


if __name__ == "__main__":
    main()
