"""What VCPO's off-policy optimal baseline costs (issue #38, acceptance 2): the default job with
`staleness.vcpo_baseline = "opob"` against the group mean, back to back, on one machine.

    python bench/opob_cost.py [--pairs 4] [--seed 0] [--set KEY=VALUE ...] [--out DIR]

Each pair runs `asyncrl launch --no-tui --set staleness.policy=vcpo --set
staleness.vcpo_baseline=group_mean`, then the same with `opob` (extra `--set`s go to both), and
reads each run's summary.json (`wall_s`, held-out accuracy after, lost and duplicated
trajectories) and the median learner step (`step_s` of its step records). It prints every run,
the medians, the median of the pairwise ratios, and the 1-minute load average at each start.
Issue #38's bound: opob at most 1.3x the group mean's wall time, held-out accuracy within the
spread. Run from the repository root; figures in docs/staleness.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BASELINES = ("group_mean", "opob")


def launch(out: Path, name: str, baseline: str, sets: list[str]) -> dict:
    """One run of the default job; what its summary and step records say."""
    load = Path("/proc/loadavg").read_text().split()[0]
    cmd = [sys.executable, "-m", "asyncrl", "launch", "--no-tui"]
    for s in ("staleness.policy=vcpo", f"staleness.vcpo_baseline={baseline}", *sets):
        cmd += ["--set", s]
    cmd += ["--set", f'run.out_dir="{out}"', "--set", f'run.name="{name}"']
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{name} failed ({done.returncode}):\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    run_dir = out / name
    summary = json.loads((run_dir / "summary.json").read_text())
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step_s"] for r in records if r.get("type") == "step"]
    return {
        "name": name,
        "wall_s": summary["wall_s"],
        "step_s": statistics.median(steps),
        "held_out": summary.get("eval_after"),
        "lost": summary.get("trajectories_lost", 0),
        "duplicated": summary.get("trajectories_duplicated", 0),
        "load": load,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0, help="run.seed of every run")
    ap.add_argument("--set", action="append", default=[], dest="extra", help="more --set overrides")
    ap.add_argument(
        "--out", type=Path, default=None, help="where the runs go (default: a temporary directory)"
    )
    args = ap.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="opob-cost-"))
    sets = [f"run.seed={args.seed}", *args.extra]
    runs: dict[str, list[dict]] = {b: [] for b in BASELINES}
    for i in range(args.pairs):  # interleaved: each pair back to back
        for baseline in BASELINES:
            run = launch(out, f"{baseline}-{i}", baseline, sets)
            runs[baseline].append(run)
            print(
                f"{run['name']:>14}: wall {run['wall_s']:6.2f} s, step {run['step_s'] * 1000:5.1f} ms, "
                f"held-out {run['held_out']}, lost {run['lost']}, duplicated {run['duplicated']}, "
                f"load {run['load']}",
                flush=True,
            )
    walls = {b: [r["wall_s"] for r in runs[b]] for b in BASELINES}
    ratios = [o / g for g, o in zip(walls["group_mean"], walls["opob"], strict=True)]
    med = {b: statistics.median(w) for b, w in walls.items()}
    print(
        f"medians: group mean {med['group_mean']:.2f} s, opob {med['opob']:.2f} s: "
        f"{med['opob'] / med['group_mean']:.2f}x; pairwise {', '.join(f'{r:.2f}' for r in ratios)} "
        f"(median {statistics.median(ratios):.2f}x)"
    )
    for b in BASELINES:
        held = [r["held_out"] for r in runs[b]]
        print(f"held-out after, {b}: {min(held)}-{max(held)}")
    print(json.dumps(runs))
    if any(r["lost"] or r["duplicated"] for rs in runs.values() for r in rs):
        raise SystemExit("a run lost or duplicated trajectories")


if __name__ == "__main__":
    main()
