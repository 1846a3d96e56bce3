"""Staleness policies under deliberately high staleness, side by side on the default task.

Runs `asyncrl launch` once per policy with the same seed and a large staleness bound, and
reports held-out accuracy and stability (reward trend, gradient norms) in one table. The
learner only ever sees data up to `--max-staleness` versions old, so what differs between rows
is how each policy corrects for it.

    asyncrl bench policies                       # none tis m2po vcpo ewma exact, bound 8, 3 seeds
    asyncrl bench policies --policies none m2po --max-staleness 4 --steps 40 --seeds 1 --json

With several seeds (`run.seed`, which seeds sampling) each row shows the median and the range.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


def run_policy(
    policy: str, *, max_staleness: int, steps: int, extra: list[str], out_dir: Path, seed: int = 0
) -> dict:
    name = f"{policy}-seed{seed}"
    sets = [
        f"staleness.policy={policy}",
        f"staleness.max_staleness={max_staleness}",
        f"learner.steps={steps}",
        f"run.seed={seed}",
        f'run.out_dir="{out_dir}"',
        f'run.name="{name}"',
        *extra,
    ]
    cmd = [sys.executable, "-m", "asyncrl", "launch", "--no-tui"]
    for s in sets:
        cmd += ["--set", s]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    run_dir = out_dir / name
    if proc.returncode != 0:
        return {"policy": policy, "status": "failed", "error": proc.stderr.strip().splitlines()[-1:]}
    summary = json.loads((run_dir / "summary.json").read_text())
    steps_rec = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps_rec = [r for r in steps_rec if r["type"] == "step"]
    rewards = [r["mean_reward"] for r in steps_rec]
    tail = rewards[len(rewards) // 2 :]
    return {
        "policy": policy,
        "status": summary["status"],
        "eval_before": summary["eval_before"],
        "eval_after": summary["eval_after"],
        "reward_last_half": statistics.fmean(tail),
        "reward_last_half_std": statistics.pstdev(tail),
        "reward_peak_minus_final": max(rewards) - statistics.fmean(rewards[-5:]),
        "max_grad_norm": max(r["grad_norm"] for r in steps_rec),
        "max_staleness_seen": summary["max_staleness"],
        "masked_or_clipped": statistics.fmean(
            r["stats"].get("masked_fraction", 0.0) + r["clip_fraction"] for r in steps_rec
        ),
        "wall_s": summary["wall_s"],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--policies", nargs="+", default=["none", "tis", "m2po", "vcpo", "ewma", "exact"])
    ap.add_argument("--seeds", type=int, default=3, help="runs per policy (run.seed = 0..N-1)")
    ap.add_argument("--max-staleness", type=int, default=8)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--set", dest="extra", action="append", default=[], help="extra config override")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        runs = {
            p: [
                run_policy(
                    p,
                    max_staleness=args.max_staleness,
                    steps=args.steps,
                    extra=args.extra,
                    out_dir=Path(tmp),
                    seed=k,
                )
                for k in range(args.seeds)
            ]
            for p in args.policies
        }
    rows = [summarize(p, rs) for p, rs in runs.items()]
    if args.json:
        print(
            json.dumps(
                {
                    "max_staleness": args.max_staleness,
                    "steps": args.steps,
                    "seeds": args.seeds,
                    "rows": rows,
                    "runs": runs,
                },
                indent=2,
            )
        )
        return 0
    cols = [
        "policy",
        "eval_before",
        "eval_after",
        "reward_last_half",
        "reward_last_half_std",
        "reward_peak_minus_final",
        "max_grad_norm",
        "masked_or_clipped",
        "max_staleness_seen",
        "failed",
    ]
    print(f"staleness bound {args.max_staleness}, {args.steps} steps, {args.seeds} seeds: median [min, max]")
    print(" | ".join(cols))
    for r in rows:
        print(" | ".join(_cell(r.get(c)) for c in cols))
    return 0


def summarize(policy: str, runs: list[dict]) -> dict:
    """Median and range over seeds of every numeric figure (failed runs are counted, not averaged)."""
    ok = [r for r in runs if r.get("status") == "completed"]
    row: dict = {"policy": policy, "failed": len(runs) - len(ok)}
    for key in ("eval_before", "eval_after", "reward_last_half", "reward_last_half_std",
                "reward_peak_minus_final", "max_grad_norm", "masked_or_clipped", "max_staleness_seen"):  # fmt: skip
        values = [float(r[key]) for r in ok]
        if values:
            row[key] = (statistics.median(values), min(values), max(values))
    return row


def _cell(value) -> str:
    if isinstance(value, tuple):
        med, lo, hi = value
        return f"{med:.3f} [{lo:.3f}, {hi:.3f}]" if lo != hi else f"{med:.3f}"
    return str(value)


if __name__ == "__main__":
    raise SystemExit(main())
