"""Continuous vs batch-at-a-time generation in whole runs: `asyncrl launch --no-tui`, interleaved.

    asyncrl bench batching                          # every workload, 3 repeats each
    asyncrl bench batching --workloads default --repeats 5
    asyncrl bench batching --json                   # every run's figures and the medians
    asyncrl bench batching --src before=/path/to/other/checkout   # one more variant

Variants: `generators.batching=continuous` and `=batch` of this checkout; `--src NAME=DIR` adds a
run of another source tree (e.g. `git archive HEAD | tar -x -C DIR`: the code before a change)
with its defaults, PYTHONPATH pointing at it. Runs go round-robin (variant A, B, A, B, ...) so
that slow drifts of a shared machine hit every variant alike; figures are medians over repeats.

Workloads:
  default    the default job as shipped (`asyncrl launch`)
  long_tail  sampling.max_new_tokens=48, sampling.temperature=4.0, task.num_eval=0,
             learner.steps=40: the shipped model's answers are 3-5 tokens at temperature 1; at 4
             most still are, a fifth run to 6-20 tokens and a few to 30-48, so a batch waits for
             its slowest sample
  long_tail_2groups  the same with generators.max_batch_groups=2 (16 samples decoded at once):
             generation becomes the slower stage

Figures (from the run's metrics.jsonl and summary.json):
  wall_s             the whole run, start-up and evaluation included
  samples_per_s      summary.json: trained samples / elapsed
  train_samples_per_s  steady state: samples trained from step STEADY_FROM's record to the last, over that time
  steps_per_s        steady state: steps per second over the same window
  learner_idle       steady state: sum(idle_s) / sum(idle_s + step_s) of the learner's step records
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

LONG_TAIL = ["sampling.max_new_tokens=48", "sampling.temperature=4.0", "task.num_eval=0", "learner.steps=40"]
WORKLOADS = {
    "default": [],
    "long_tail": LONG_TAIL,
    # The same with 2 groups (16 samples) decoded at once: generation is the slower stage, as on
    # an inference engine short of KV-cache slots.
    "long_tail_2groups": [*LONG_TAIL, "generators.max_batch_groups=2"],
}
STEADY_FROM = 10  # steps before this one are the pipeline's fill (and the first weights)
FIGURES = ("wall_s", "samples_per_s", "train_samples_per_s", "steps_per_s", "learner_idle")


def figures(run_dir: Path) -> dict[str, float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
    steps = [r for r in records if r.get("type") == "step"]
    summary = json.loads((run_dir / "summary.json").read_text())
    steady = steps[STEADY_FROM:]
    span_s = steady[-1]["time_s"] - steady[0]["time_s"]
    idle = sum(s["idle_s"] for s in steady)
    busy = sum(s["step_s"] for s in steady)
    return {
        "wall_s": float(summary["wall_s"]),
        "samples_per_s": float(summary["samples_per_s"]),
        "train_samples_per_s": sum(s["num_trajectories"] for s in steady[1:]) / span_s,
        "steps_per_s": (len(steady) - 1) / span_s,
        "learner_idle": idle / (idle + busy),
        "trajectories_lost": float(summary.get("trajectories_lost", 0)),
    }


def launch(out_dir: Path, name: str, sets: list[str], src: str | None) -> dict[str, float]:
    env = dict(os.environ)
    if src:
        env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    args = [sys.executable, "-m", "asyncrl", "launch", "--no-tui"]
    for s in [*sets, f"run.out_dir={out_dir}", f"run.name={name}"]:
        args += ["--set", s]
    proc = subprocess.run(args, capture_output=True, text=True, env=env, cwd=src or None)
    if proc.returncode != 0:
        raise RuntimeError(f"run {name} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return figures(out_dir / name)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--src", action="append", default=[], help="NAME=DIR: another source tree as a variant"
    )
    parser.add_argument("--set", action="append", default=[], dest="extra", help="more --set for every run")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    variants: dict[str, tuple[list[str], str | None]] = {
        "continuous": (["generators.batching=continuous"], None),
        "batch": (["generators.batching=batch"], None),
    }
    for spec in args.src:
        name, _, src = spec.partition("=")
        variants[name] = ([], str(Path(src).resolve()))
    runs: dict[str, dict[str, list[dict]]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-batching-") as tmp:
        for workload in args.workloads.split(","):
            runs[workload] = {v: [] for v in variants}
            for rep in range(args.repeats):
                for variant, (sets, src) in variants.items():
                    begin = time.perf_counter()
                    name = f"{workload}-{variant}-{rep}"
                    fig = launch(Path(tmp), name, [*WORKLOADS[workload], *sets, *args.extra], src)
                    runs[workload][variant].append(fig)
                    print(f"{name}: {fig} ({time.perf_counter() - begin:.0f} s)", file=sys.stderr, flush=True)
    medians = {
        w: {v: {f: statistics.median(r[f] for r in rs) for f in FIGURES} for v, rs in by_v.items()}
        for w, by_v in runs.items()
    }
    if args.json:
        print(
            json.dumps(
                {"bench": "batching", "repeats": args.repeats, "medians": medians, "runs": runs}, indent=1
            )
        )
        return 0
    for workload, by_v in medians.items():
        print(f"### {workload} ({' '.join(WORKLOADS[workload]) or 'as shipped'}), medians of {args.repeats}")
        print("| variant | wall s | samples/s (summary) | train samples/s | steps/s | learner idle |")
        print("|---|---|---|---|---|---|")
        for variant, m in by_v.items():
            print(
                f"| {variant} | {m['wall_s']:.1f} | {m['samples_per_s']:.0f} | {m['train_samples_per_s']:.0f} "
                f"| {m['steps_per_s']:.2f} | {m['learner_idle']:.2f} |"
            )
        print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
