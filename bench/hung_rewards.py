"""What a hung reward costs (issue #36, acceptance 4): the training phase and the held-out evaluation
of the word-problems example with a reward that never returns on a share of prompts, against the
same reward hanging on none, interleaved on one machine.

    python bench/hung_rewards.py train [--pairs 3] [--fraction 0.1] [--steps 6] [--out DIR]
    python bench/hung_rewards.py eval [--pairs 2] [--fraction 0.1]

`train` runs `asyncrl launch examples/word_problems/config.toml` for `--steps` steps without
held-out evaluation (`task.num_eval=0`), hung then clean, `--pairs` times, and reads each run's
training time (the last `step` record's `time_s`); it prints every run, the medians and the
median pair's cost in timeouts (`task.scoring.timeout_s`, default 30 s). Issue #36's bound: a clean
run's time plus two timeouts. It also checks each run trained every step with nothing lost or
duplicated (summary.json).

`eval` runs the held-out evaluation as `asyncrl/job.py: evaluate` does (the example's 300 held-out
prompts decoded greedily, then scored with the run's rewards), timing its two phases; decoding is
the same work with or without hangs, so the hangs' cost is the scoring's difference. Issue #36's
bound: one timeout.

The reward is `tests.reward_fixtures:hang_fraction` (the `correct` reward of the example, hanging
on the prompts a hash puts in `fraction`: every sample of such a group hangs). Run from the
repository root; figures in docs/safety.md.
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

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "examples" / "word_problems" / "config.toml"
TIMEOUT_S = 30.0  # task.scoring.timeout_s's default, which both modes keep


def rewards_override(fraction: float) -> str:
    return (
        'task.rewards=[{kind="tests.reward_fixtures:hang_fraction",name="correct",'
        f"options={{fraction={fraction}}}}}]"
    )


def train_once(out: Path, name: str, fraction: float, steps: int) -> dict:
    """One launch; its training time and what its summary says of the trajectories."""
    cmd = [
        sys.executable, "-m", "asyncrl", "launch", str(CONFIG), "--no-tui",
        "--set", f"learner.steps={steps}", "--set", "task.num_eval=0",
        "--set", f"run.out_dir={out}", "--set", f"run.name={name}",
        "--set", rewards_override(fraction),
    ]  # fmt: skip
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=_env())
    run_dir = out / name
    if done.returncode != 0:
        raise SystemExit(f"{name} failed ({done.returncode}):\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps_done = [r for r in records if r["type"] == "step"]
    summary = json.loads((run_dir / "summary.json").read_text())
    return {
        "name": name,
        "train_s": max(r["time_s"] for r in steps_done),
        "steps": len(steps_done),
        "lost": summary.get("trajectories_lost", 0),
        "duplicated": summary.get("trajectories_duplicated", 0),
        "load": Path("/proc/loadavg").read_text().split()[0],
    }


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    return env


def train(args: argparse.Namespace) -> None:
    out = Path(args.out or tempfile.mkdtemp(prefix="hung-rewards-"))
    runs: dict[str, list[dict]] = {"hung": [], "clean": []}
    for i in range(args.pairs):
        for mode, fraction in (("hung", args.fraction), ("clean", 0.0)):
            run = train_once(out, f"{mode}-{i}-{int(time.time())}", fraction, args.steps)
            runs[mode].append(run)
            print(
                f"{mode:5s} pair {i}: training {run['train_s']:.1f} s, {run['steps']} steps, "
                f"{run['lost']} lost, {run['duplicated']} duplicated (load {run['load']})",
                flush=True,
            )
    hung = statistics.median(r["train_s"] for r in runs["hung"])
    clean = statistics.median(r["train_s"] for r in runs["clean"])
    pairs = [h["train_s"] - c["train_s"] for h, c in zip(runs["hung"], runs["clean"], strict=True)]
    print(
        f"medians: hung {hung:.1f} s, clean {clean:.1f} s: the hangs cost {hung - clean:.1f} s = "
        f"{(hung - clean) / TIMEOUT_S:.2f} timeouts (pairs: "
        + ", ".join(f"{p / TIMEOUT_S:.2f}" for p in pairs)
        + "); bound: 2 timeouts"
    )


def eval_once(fraction: float) -> tuple[float, float, int]:
    """(decode s, score s, samples failed) of the example's held-out evaluation."""
    sys.path.insert(0, str(ROOT))
    from asyncrl.config_load import load_config
    from asyncrl.job import load_task, model_path
    from asyncrl.models.sft import checkpoint_completions
    from asyncrl.rewards.scorer import score_completions

    config = load_config(CONFIG, [rewards_override(fraction)])
    path = model_path(config)
    task, _, _ = load_task(config, path)
    max_new = config.sampling.max_new_tokens
    start = time.monotonic()
    done = checkpoint_completions(path, task, max_new_tokens=max_new, batch_size=config.task.eval_batch_size)
    decoded = time.monotonic()
    scores, _ = score_completions(config.task, done, max_new_tokens=max_new)
    return decoded - start, time.monotonic() - decoded, sum(s.failed for s in scores)


def evaluation(args: argparse.Namespace) -> None:
    scored: dict[str, list[float]] = {"hung": [], "clean": []}
    for i in range(args.pairs):
        for mode, fraction in (("hung", args.fraction), ("clean", 0.0)):
            decode_s, score_s, failed = eval_once(fraction)
            scored[mode].append(score_s)
            print(
                f"{mode:5s} pair {i}: decoding {decode_s:.2f} s, scoring {score_s:.2f} s, {failed} failed",
                flush=True,
            )
    hung, clean = (statistics.median(scored[m]) for m in ("hung", "clean"))
    print(
        f"scoring medians: hung {hung:.2f} s, clean {clean:.2f} s: the hangs cost {hung - clean:.2f} s = "
        f"{(hung - clean) / TIMEOUT_S:.3f} timeouts; bound: 1 timeout"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("what", choices=("train", "eval"))
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--fraction", type=float, default=0.1)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--out", default="", help="where `train` keeps its runs (default: a new temp dir)")
    args = parser.parse_args()
    train(args) if args.what == "train" else evaluation(args)


if __name__ == "__main__":
    main()
