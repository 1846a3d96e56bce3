#!/usr/bin/env python
"""A learner step against a plain forward/backward of the same batch, at 1 and 2 threads.

At 2 threads the learner trains each micro-batch in pieces on 2 data-parallel threads of one
torch thread each (`learner.threads = 2`, what "auto" picks on 2 CPUs); the plain step runs
torch's 2 intra-op threads.

The learner's step is what `asyncrl launch` runs per optimizer step on the default job: the
Trainer built from the default config (`learner.loop.build_trainer`), offered a step's 32 groups
x 8 samples as they arrive together, trained (complete groups close at once), then
`finish_step` (gradient, clipping, AdamW, the non-finite guard). The plain step is the plainest
correct GRPO step on the same samples: the Hugging Face model's forward on the right-padded batch
with its attention mask, log_softmax of the logits, the clipped surrogate with group-normalised
advantages, token-mean, backward, gradient clipping, AdamW. Both start from the shipped model;
the samples are real ones, drawn once with `asyncrl.models.sampling.generate` (12 batches).

Each thread count runs in its own process (`torch.set_num_threads` first), the two steps
interleaved batch by batch, after 2 warm-up batches; the figure is the median step time over
`--repeats` passes over the batches, and the ratio learner / plain.

    python bench/bench_learner_step.py [--repeats 5] [--json] [--set learner.shared_prefix=false]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

BATCHES = 12
WARMUP = 2


def _samples(task, tok, actor, cfg, step: int):
    import torch

    from asyncrl.learner.step import TrainSample
    from asyncrl.models.sampling import generate

    lrn = cfg.learner
    problems = [task.train_problem(step * lrn.groups_per_step + i) for i in range(lrn.groups_per_step)]
    prompts = [p for p in task.render(problems, tok) for _ in range(lrn.samples_per_group)]
    out = generate(
        actor.lm,
        prompts,
        max_new_tokens=cfg.sampling.max_new_tokens,
        temperature=cfg.sampling.temperature,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        seeds=[step * 100_000 + j for j in range(len(prompts))],
    )
    samples = []
    for j, (prompt, ids, logps) in enumerate(zip(prompts, out.completion_ids, out.logprobs, strict=True)):
        problem = problems[j // lrn.samples_per_group]
        text = tok.decode([t for t in ids if t != tok.eos_token_id])
        samples.append(
            TrainSample(
                traj_id=step * 100_000 + j,
                group_id=step * 1000 + j // lrn.samples_per_group,
                sample_index=j % lrn.samples_per_group,
                prompt_ids=prompt,
                completion_ids=torch.tensor(ids),
                behavior_logprobs=torch.tensor(logps),
                token_versions=torch.full((len(ids),), step),
                reward=float(task.score(problem.prompt, text, problem.answer)),
            )
        )
    return samples


def run_threads(threads: int, repeats: int, sets: list[str]) -> dict:
    """One process's figures (call in a fresh process: the thread count is process-wide)."""
    import torch

    torch.set_num_threads(threads)
    from transformers import AutoModelForCausalLM

    from asyncrl.config_load import load_config
    from asyncrl.learner.loop import build_trainer, load_policy_model
    from asyncrl.models.default import DEFAULT_MODEL_DIR
    from asyncrl.tasks.base import make_task

    cfg = load_config(overrides=[f"learner.threads={threads}", *sets])
    actor, tok = load_policy_model(DEFAULT_MODEL_DIR, cfg)
    trainer = build_trainer(cfg, actor, pad_token_id=tok.pad_token_id)
    task = make_task(cfg.task)
    batches = [_samples(task, tok, actor, cfg, s) for s in range(BATCHES)]
    lm = AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL_DIR, dtype=torch.float32).train()
    lrn = cfg.learner
    opt = torch.optim.AdamW(lm.parameters(), lr=lrn.lr, betas=(0.9, 0.99), weight_decay=lrn.weight_decay)
    clip_low, clip_high = lrn.clip_range()
    groups, size = lrn.groups_per_step, lrn.samples_per_group
    step = 0

    # As in the learner process: its steps run on one compute thread, which (with data-parallel
    # threads, learner.threads > 1) drives pieces on threads of one torch thread each; the plain
    # step runs in the main thread with `threads` torch threads.
    compute = ThreadPoolExecutor(
        1, initializer=torch.set_num_threads, initargs=(1 if trainer.engine.threads > 1 else threads,)
    )
    torch.set_num_threads(threads)

    def learner_step(samples) -> float:
        return compute.submit(_learner_step, samples).result()

    def _learner_step(samples) -> float:
        nonlocal step
        start = time.perf_counter()
        trainer.begin_step(step, window_groups=groups)
        for s in samples:  # sampled by the version being trained (on-policy, as in sync)
            trainer.offer(dataclasses.replace(s, token_versions=torch.full_like(s.token_versions, step)))
        if trainer.acc is not None:
            while trainer.has_work():
                trainer.work()
        else:
            trainer.batch_backward(trainer.state.arrivals)
        trainer.finish_step()
        step += 1
        return time.perf_counter() - start

    def plain_step(samples) -> float:
        start = time.perf_counter()
        rows = [list(s.prompt_ids) + s.completion_ids.tolist() for s in samples]
        width = max(map(len, rows))
        ids = torch.full((len(rows), width), tok.pad_token_id)
        attn = torch.zeros((len(rows), width), dtype=torch.long)
        mask = torch.zeros((len(rows), width))
        behav = torch.zeros((len(rows), width))
        for i, (row, s) in enumerate(zip(rows, samples, strict=True)):
            ids[i, : len(row)] = torch.tensor(row)
            attn[i, : len(row)] = 1
            mask[i, len(s.prompt_ids) : len(row)] = 1
            behav[i, len(s.prompt_ids) : len(row)] = s.behavior_logprobs
        rewards = torch.tensor([s.reward for s in samples]).view(groups, size)
        std = rewards.std(dim=1, keepdim=True)
        adv = ((rewards - rewards.mean(dim=1, keepdim=True)) / (std + 1e-6)).view(-1, 1)
        logits = lm(input_ids=ids, attention_mask=attn).logits[:, :-1].float()
        logp = torch.log_softmax(logits, dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        m, old = mask[:, 1:], behav[:, 1:]
        ratio = torch.exp(logp - old)
        surrogate = torch.minimum(ratio * adv, ratio.clamp(1 - clip_low, 1 + clip_high) * adv)
        loss = -(surrogate * m).sum() / m.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(lm.parameters(), lrn.max_grad_norm)
        opt.step()
        return time.perf_counter() - start

    learner_s, plain_s = [], []
    for r in range(repeats):
        for b, samples in enumerate(batches):
            lt, pt = learner_step(samples), plain_step(samples)
            if r > 0 or b >= WARMUP:
                learner_s.append(lt)
                plain_s.append(pt)
    lm_med, pl_med = statistics.median(learner_s), statistics.median(plain_s)
    return {"threads": threads, "learner_step_s": lm_med, "plain_step_s": pl_med, "ratio": lm_med / pl_med}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=0, help="one thread count, in this process")
    p.add_argument("--json", action="store_true")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        help="config override for the learner, e.g. learner.shared_prefix=false",
    )
    args = p.parse_args()
    if args.threads:
        print(json.dumps(run_threads(args.threads, args.repeats, args.set)))
        return
    rows = []
    for threads in (1, 2):
        cmd = [sys.executable, __file__, "--threads", str(threads), "--repeats", str(args.repeats)]
        cmd += [f"--set={s}" for s in args.set]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True)
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    print("| threads | learner step (ms) | plain step (ms) | learner / plain |")
    print("|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['threads']} | {1e3 * r['learner_step_s']:.1f} | {1e3 * r['plain_step_s']:.1f} | {r['ratio']:.2f} |"
        )


if __name__ == "__main__":
    main()
