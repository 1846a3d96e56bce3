"""What the weight-load canary costs on a job: its forward against the work of one version.

`python -m asyncrl.benchmarks.canary_cost [--repeats N] [--set KEY=VALUE ...]` (docs/weights.md,
"Canary", has the figures). Two interleaved comparisons, medians, each pair timed back to back so
that a loaded machine slows both alike:

- learner: one learner step of the job (the default job's Trainer on a batch of real samples, on
  the learner's compute thread, as `learner_step` times it) against the learner's canary
  reference (`learner/canary.py: reference`) on the same thread;
- generator: sampling one version's batch (groups_per_step x samples_per_group, one thread, as a
  generator with generators.threads = 1) against the canary's scoring on the same thread.

The ratios are the canary's share of each side's work per version (each side scores it once per
version).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

WARMUP = 2  # pairs not counted (first calls pay for lazy initialisation)


def _median_pairs(work, canary, n: int) -> tuple[float, float]:
    """(work, canary) median seconds over `n` back-to-back pairs after WARMUP."""
    works, canaries = [], []
    for i in range(n + WARMUP):
        w, c = work(i), canary()
        if i >= WARMUP:
            works.append(w)
            canaries.append(c)
    return statistics.median(works), statistics.median(canaries)


def measure(repeats: int, sets: list[str]) -> dict[str, float]:
    import torch

    from asyncrl.benchmarks.learner_step import draw_samples, learner_step_timer
    from asyncrl.config_load import load_config
    from asyncrl.job import model_path
    from asyncrl.learner.canary import reference
    from asyncrl.learner.loop import build_trainer, load_policy_model
    from asyncrl.scheduler.canary import build_canary
    from asyncrl.tasks.base import make_task

    cfg = load_config(overrides=sets)
    actor, tok = load_policy_model(model_path(cfg), cfg)
    trainer = build_trainer(cfg, actor, pad_token_id=tok.pad_token_id)
    task = make_task(cfg.task)
    ids = build_canary(task, tok, num_tokens=cfg.weights.canary_tokens)
    pad = tok.pad_token_id or 0

    def canary() -> float:
        start = time.perf_counter()
        reference(actor.lm, ids, pad_token_id=pad)
        return time.perf_counter() - start

    batches = [draw_samples(task, tok, actor, cfg, s) for s in range(4)]
    threads = 1 if trainer.engine.threads > 1 else cfg.learner.threads
    compute = ThreadPoolExecutor(1, initializer=torch.set_num_threads, initargs=(threads,))
    step = learner_step_timer(trainer, groups=cfg.learner.groups_per_step)
    try:
        learner_s, learner_canary_s = _median_pairs(
            lambda i: compute.submit(step, batches[i % len(batches)]).result(),
            lambda: compute.submit(canary).result(),
            repeats,
        )
    finally:
        compute.shutdown()

    def sample(i: int) -> float:
        start = time.perf_counter()
        draw_samples(task, tok, actor, cfg, 1000 + i)
        return time.perf_counter() - start

    torch.set_num_threads(cfg.generators.threads)
    gen_s, gen_canary_s = _median_pairs(sample, canary, repeats)
    return {
        "canary_tokens": sum(len(s) for s in ids),
        "learner_step_ms": learner_s * 1e3,
        "learner_canary_ms": learner_canary_s * 1e3,
        "learner_ratio": learner_canary_s / learner_s,
        "generator_batch_ms": gen_s * 1e3,
        "generator_canary_ms": gen_canary_s * 1e3,
        "generator_ratio": gen_canary_s / gen_s,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m asyncrl.benchmarks.canary_cost", description=__doc__)
    parser.add_argument("--repeats", type=int, default=12, help="pairs timed per side (after warm-up)")
    parser.add_argument("--set", action="append", default=[], dest="sets", help="config override, KEY=VALUE")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    print(json.dumps(measure(args.repeats, args.sets), indent=2))


if __name__ == "__main__":
    main()
