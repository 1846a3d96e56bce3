"""Background evaluation's process: one held-out evaluation of one version's weights.

    python -m asyncrl.evaluator RUN_DIR VERSION WEIGHTS_DIR

The launcher starts one per due version (`eval.every`, `scheduler/evals.py`) when the learner has
written that version's weights (`EvalDue`); it runs beside training, on `eval.threads` torch
threads, and neither the learner nor the generators wait for it. It reads the run's resolved
config, renders the task's held-out prompts with the weights' tokenizer, decodes `eval.samples`
completions per problem (1: greedy, as before and after training; k: sampled at
sampling.temperature), scores them with the task's rewards, prints one JSON line
(`EvalResult`) and removes the weights it was given.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path

import msgspec

from asyncrl.config import Config


class EvalResult(msgspec.Struct, frozen=True, kw_only=True):
    """One version's held-out figures: `accuracy` is the mean of the evaluation reward
    (`task.scoring.eval_reward`, else the first reward, else the task's score) over every
    completion (pass@1); `pass_at_k[k]` the mean over problems of the best of their k completions."""

    version: int
    accuracy: float
    pass_at_k: dict[str, float]
    rewards: dict[str, float]
    problems: int
    samples: int
    eval_s: float


def score_completions(config: Config, task, done: list) -> tuple[list[float], dict[str, float]]:
    """Each completion's evaluation score and the rewards' means, scored as training scores."""
    if not config.task.rewards:
        return [task.score(p.prompt, c.text, p.answer) for p, c in done], {}
    from asyncrl.rewards.scorer import reward_means
    from asyncrl.rewards.scorer import score_completions as score

    scores, names = score(config.task, done, max_new_tokens=config.sampling.max_new_tokens)
    key = config.task.scoring.eval_reward or names[0]
    return [s.parts.get(key, 0.0) for s in scores], reward_means(scores, names)


def pass_at_k(scores: list[float], samples: int) -> dict[str, float]:
    """pass@1 (the mean of every score) and pass@k (the mean over problems of the best of their
    k consecutive scores); for 0/1 scores, the share of problems some sample solved."""
    problems = [scores[i : i + samples] for i in range(0, len(scores), samples)]
    out = {"1": sum(scores) / len(scores)}
    if samples > 1:
        out[str(samples)] = sum(max(p) for p in problems) / len(problems)
    return out


def evaluate_version(run_dir: Path, version: int, weights: Path) -> EvalResult:
    from asyncrl.config_load import load_resolved_config
    from asyncrl.job import load_task
    from asyncrl.models.sampling import resolve_device
    from asyncrl.models.sft import checkpoint_completions

    started = time.perf_counter()
    config = load_resolved_config(run_dir / "config.json")
    task, _, _ = load_task(config, weights)
    samples = config.eval.samples
    done = checkpoint_completions(
        weights,
        task,
        max_new_tokens=config.sampling.max_new_tokens,
        threads=config.eval.threads,
        device=str(resolve_device(config.task.eval_device, field="task.eval_device")),
        batch_size=config.task.eval_batch_size,
        samples=samples,
        temperature=config.sampling.temperature,
    )
    scores, means = score_completions(config, task, done)
    passes = pass_at_k(scores, samples)
    return EvalResult(
        version=version,
        accuracy=passes["1"],
        pass_at_k=passes,
        rewards=means,
        problems=len(scores) // samples,
        samples=samples,
        eval_s=round(time.perf_counter() - started, 3),
    )


def main(argv: list[str]) -> int:
    from asyncrl.models.hf import quiet_offline

    if len(argv) != 3:
        print("usage: python -m asyncrl.evaluator RUN_DIR VERSION WEIGHTS_DIR", file=sys.stderr)
        return 2
    quiet_offline()
    run_dir, version, weights = Path(argv[0]), int(argv[1]), Path(argv[2])
    try:
        result = evaluate_version(run_dir, version, weights)
    finally:
        shutil.rmtree(weights, ignore_errors=True)
    print(json.dumps(msgspec.to_builtins(result)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
