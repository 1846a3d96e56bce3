"""`asyncrl bench learner-step`: a learner step against a plain forward/backward of the same
batch, at 1 and 2 threads (bench/README.md, "Learner step against a plain step").

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

Each thread count runs in its own process (`python -m asyncrl.benchmarks.learner_step --threads
N`, `torch.set_num_threads` first), the two steps interleaved batch by batch, after 2 warm-up
batches; the figure is the median step time over `--repeats` passes over the batches, and the
ratio learner / plain.

    asyncrl bench learner-step [--repeats 5] [--json] [--set learner.shared_prefix=false]

Importing this module is cheap: torch and transformers load when the command runs.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Annotated, Any

import typer

if TYPE_CHECKING:
    from asyncrl.config import Config
    from asyncrl.learner.step import TrainSample
    from asyncrl.learner.trainer import Trainer

BATCHES = 12
WARMUP = 2
THREAD_COUNTS = (1, 2)
MODULE = "asyncrl.benchmarks.learner_step"  # what each thread count's process runs (`main`)


def draw_samples(task, tok, actor, cfg: Config, step: int) -> list[TrainSample]:
    """Step `step`'s groups of the default job, sampled by `actor` (seeded per sample)."""
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


def learner_step_timer(trainer: Trainer, *, groups: int) -> Callable[[list[TrainSample]], float]:
    """Seconds of one learner step per call, from `begin_step` to the end of `finish_step`, the
    step numbers counting up from 0 across calls."""
    import torch

    step = 0

    def timed(samples: list[TrainSample]) -> float:
        nonlocal step
        start = time.perf_counter()
        trainer.begin_step(step, window_groups=groups)
        # Sampled by the version being trained (on-policy, as in sync).
        versioned = [
            dataclasses.replace(s, token_versions=torch.full_like(s.token_versions, step)) for s in samples
        ]
        if trainer.fallback:  # whole-batch steps take the window at once, as the step loop does
            trainer.batch_backward(versioned)
        else:
            for s in versioned:
                trainer.offer(s)
            while trainer.has_work():
                trainer.work()
        trainer.finish_step()
        step += 1
        return time.perf_counter() - start

    return timed


def plain_step_timer(lm, opt, cfg: Config, *, pad_token_id: int) -> Callable[[list[TrainSample]], float]:
    """Seconds of one plain GRPO step of `lm` per call: padding the batch, forward, loss,
    backward, gradient clipping and the AdamW step `opt`."""
    import torch

    lrn = cfg.learner
    clip_low, clip_high = lrn.clip_range()
    groups, size = lrn.groups_per_step, lrn.samples_per_group

    def timed(samples: list[TrainSample]) -> float:
        start = time.perf_counter()
        rows = [list(s.prompt_ids) + s.completion_ids.tolist() for s in samples]
        width = max(map(len, rows))
        ids = torch.full((len(rows), width), pad_token_id)
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

    return timed


def interleaved_medians(
    learner_step: Callable[[Any], float], plain_step: Callable[[Any], float], batches: list, *, repeats: int
) -> tuple[float, float]:
    """(learner, plain) median seconds: both steps on each batch in turn, `repeats` passes, the
    first pass's first WARMUP batches not counted."""
    learner_s, plain_s = [], []
    for r in range(repeats):
        for b, samples in enumerate(batches):
            lt, pt = learner_step(samples), plain_step(samples)
            if r > 0 or b >= WARMUP:
                learner_s.append(lt)
                plain_s.append(pt)
    return statistics.median(learner_s), statistics.median(plain_s)


def run_threads(threads: int, repeats: int, sets: list[str]) -> dict[str, float]:
    """One thread count's figures (call in a fresh process: the thread count is process-wide)."""
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
    batches = [draw_samples(task, tok, actor, cfg, s) for s in range(BATCHES)]
    lm = AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL_DIR, dtype=torch.float32).train()
    lrn = cfg.learner
    opt = torch.optim.AdamW(lm.parameters(), lr=lrn.lr, betas=(0.9, 0.99), weight_decay=lrn.weight_decay)

    # As in the learner process: its steps run on one compute thread, which (with data-parallel
    # threads, learner.threads > 1) drives pieces on threads of one torch thread each; the plain
    # step runs in the main thread with `threads` torch threads.
    compute = ThreadPoolExecutor(
        1, initializer=torch.set_num_threads, initargs=(1 if trainer.engine.threads > 1 else threads,)
    )
    torch.set_num_threads(threads)
    on_compute = learner_step_timer(trainer, groups=lrn.groups_per_step)
    try:
        learner_med, plain_med = interleaved_medians(
            lambda samples: compute.submit(on_compute, samples).result(),
            plain_step_timer(lm, opt, cfg, pad_token_id=tok.pad_token_id),
            batches,
            repeats=repeats,
        )
    finally:
        compute.shutdown()
    return {
        "threads": threads,
        "learner_step_s": learner_med,
        "plain_step_s": plain_med,
        "ratio": learner_med / plain_med,
    }


def run_bench(repeats: int, sets: list[str]) -> list[dict[str, float]]:
    """Every thread count's figures, each measured in a fresh process (`--threads N`)."""
    rows = []
    for threads in THREAD_COUNTS:
        cmd = [sys.executable, "-m", MODULE, "--threads", str(threads), "--repeats", str(repeats)]
        cmd += [f"--set={s}" for s in sets]
        out = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if out.returncode != 0:
            raise RuntimeError(f"learner-step at {threads} threads failed:\n{out.stderr[-4000:]}")
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    return rows


def command(
    repeats: Annotated[int, typer.Option(help="passes over the 12 batches; medians reported")] = 5,
    threads: Annotated[
        int, typer.Option(help="one thread count, in this process (prints its row as JSON)")
    ] = 0,
    set_: Annotated[
        list[str] | None,
        typer.Option("--set", help="config override for the learner, e.g. learner.shared_prefix=false"),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="print the rows as JSON")] = False,
) -> None:
    """Learner step against a plain forward/backward of the same batch, at 1 and 2 threads."""
    if repeats < 1:
        raise typer.BadParameter(f"--repeats must be >= 1, got {repeats}")
    if threads < 0:
        raise typer.BadParameter(f"--threads must be >= 0, got {threads}")
    sets = list(set_ or [])
    if threads:
        typer.echo(json.dumps(run_threads(threads, repeats, sets)))
        return
    rows = run_bench(repeats, sets)
    if as_json:
        typer.echo(json.dumps(rows, indent=2))
        return
    typer.echo("| threads | learner step (ms) | plain step (ms) | learner / plain |")
    typer.echo("|---:|---:|---:|---:|")
    for r in rows:
        typer.echo(
            f"| {r['threads']} | {1e3 * r['learner_step_s']:.1f} | {1e3 * r['plain_step_s']:.1f} "
            f"| {r['ratio']:.2f} |"
        )


def main(argv: list[str] | None = None) -> None:
    """`python -m asyncrl.benchmarks.learner_step [options]`: the options of `command` (how the
    bench starts its per-thread-count processes)."""
    app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
    app.command()(command)
    app(args=sys.argv[1:] if argv is None else list(argv))


if __name__ == "__main__":
    main()
