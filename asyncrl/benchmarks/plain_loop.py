"""The plain loop: the simplest correct single-process GRPO on asyncrl's job, as a reference for
`asyncrl bench baseline` (asyncrl/benchmarks/baseline.py).

One process, no overlap, no messages: for each step, sample `groups_per_step` prompts x
`samples_per_group` answers with Hugging Face `model.generate(do_sample=True)`, score them with
the task's rewards (`task.rewards`, through asyncrl's scorer, as the generators score) or, without
any, its own verifier (`task.score`), then one forward, backward and optimizer step. It runs the
job `asyncrl launch` runs, read from the same config (`load_config`, so `--set` means the same):
the model (`model.path`, float32), the task and its prompt stream (step s trains
`task.train_problem(j)` for j in s*G .. s*G + G - 1, as the launcher admits them), the sampling
(temperature, top_p, max_new_tokens), the optimizer (AdamW, betas 0.9/0.99 as the learner's, or
plain SGD; lr, weight decay, gradient clipping at `learner.max_grad_norm`) and asyncrl's default
objective, written out here on its own: GRPO advantages (r - mean_g) / (std_g + 1e-6) with the
unbiased std and exactly 0 for a group of equal rewards, the PPO clipped surrogate against the
behaviour log-probs (those `generate` sampled from, as asyncrl's default staleness policy `none`
anchors), token-mean over every completion token (the eos included). With one update per batch
the ratio is 1 up to float rounding. Settings it does not implement are refused (`unsupported`).

Evaluation is asyncrl's own: greedy completions of the held-out problems
(`asyncrl.models.sft.greedy_completions`) scored as `asyncrl.evaluator.score_completions` scores
them, on the in-memory model, before and after training.

`python -m asyncrl.benchmarks.plain_loop --config JOB.toml` runs a job file (default: the
embedded job).

Timing (the definitions `asyncrl bench baseline` uses for every variant): `train_s` runs from just
before the first `generate` to just after the last optimizer step; `samples_per_s` is the trained
samples over `train_s`; `job_s` runs from the start of `run_plain_loop` (before torch and
transformers are imported, in a fresh process) to its return: imports, model load, both
evaluations. The bench measures the subprocess's own wall clock from outside as well.

Run it as a process, as the bench does: `python -m asyncrl.benchmarks.plain_loop --json
[--set key=value ...] [--threads N]` prints the result as one JSON object on stdout.

Legend: G groups (prompts) per step, N samples per group, B = G*N sequences, L prompt width (left
padded), T completion tokens (the longest in the batch), V vocab.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    import torch

    from asyncrl.config import Config

# verl's GRPO: the std is unbiased (ddof=1) and this is added to it (asyncrl's default too).
GRPO_STD_EPS = 1e-6
# Log-ratios are clamped before exp so that a token whose log-prob collapsed cannot overflow the
# ratio to inf (never binds on-policy: the ratio is 1 up to rounding).
MAX_LOG_RATIO = 20.0


# (problem, asyncrl.models.sft.Completion) pairs -> each one's reward
Scoring = Callable[[list[tuple[Any, Any]]], list[float]]


# ---------------------------------------------------------------------------- pure parts
def unsupported(config: Config) -> list[str]:
    """The settings of `config` the plain loop does not implement (empty: it runs the same job)."""
    lrn = config.learner
    checks = [
        (lrn.advantage != "grpo", f"learner.advantage = {lrn.advantage!r} (only 'grpo')"),
        (lrn.loss != "ppo", f"learner.loss = {lrn.loss!r} (only 'ppo')"),
        (lrn.agg != "token-mean", f"learner.agg = {lrn.agg!r} (only 'token-mean')"),
        (lrn.dual_clip is not None, "learner.dual_clip"),
        (lrn.kl_coef > 0, "learner.kl_coef > 0"),
        (lrn.epochs != 1, "learner.epochs != 1"),
        (lrn.drop_degenerate_groups, "learner.drop_degenerate_groups"),
        (lrn.lora.rank > 0, "learner.lora.rank > 0"),
        (lrn.mixed_precision != "none", f"learner.mixed_precision = {lrn.mixed_precision!r}"),
        (config.opd.enabled, "opd.enabled"),
        (config.task.scoring.overlong != "keep", "task.scoring.overlong = 'mask'"),
        (config.sampling.temperature <= 0, "sampling.temperature = 0"),
        (config.sampling.ignore_eos, "sampling.ignore_eos"),
    ]
    return [what for bad, what in checks if bad]


def completion_mask(completion_BT: torch.Tensor, *, eos_token_id: int) -> torch.Tensor:
    """bool [B, T]: the sampled tokens of each row, up to and including its first eos (what
    `generate` wrote after it is padding)."""
    import torch

    is_eos_BT = completion_BT == eos_token_id
    eos_before_BT = torch.cumsum(is_eos_BT.long(), dim=1) - is_eos_BT.long()
    return eos_before_BT == 0


def grpo_advantages(rewards_GN: torch.Tensor, *, eps: float = GRPO_STD_EPS) -> torch.Tensor:
    """(r - mean of the group) / (unbiased std of the group + eps); exactly 0 for a group whose
    rewards are all equal (its float mean may miss them by an ulp, and eps would blow that up)."""
    import torch

    mean_G1 = rewards_GN.mean(dim=1, keepdim=True)
    std_G1 = rewards_GN.std(dim=1, keepdim=True, unbiased=True)
    adv_GN = (rewards_GN - mean_G1) / (std_G1 + eps)
    all_equal_G1 = (rewards_GN == rewards_GN[:, :1]).all(dim=1, keepdim=True)
    return torch.where(all_equal_G1, torch.zeros_like(adv_GN), adv_GN)


def clipped_surrogate_token_mean(
    logp_BT: torch.Tensor,
    logp_old_BT: torch.Tensor,
    adv_B: torch.Tensor,
    mask_BT: torch.Tensor,
    *,
    clip_low: float,
    clip_high: float,
) -> torch.Tensor:
    """PPO's clipped surrogate, minimised: per token max(-A r, -A clip(r, 1 - clip_low, 1 +
    clip_high)) with r = exp(logp - logp_old), averaged over every valid token of the batch.
    Masked positions are replaced before any arithmetic, so -inf there reaches no gradient."""
    import torch

    log_ratio_BT = torch.where(mask_BT, logp_BT - logp_old_BT, torch.zeros_like(logp_BT))
    ratio_BT = torch.exp(log_ratio_BT.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO))
    adv_BT = adv_B[:, None].expand_as(ratio_BT)
    per_token_BT = torch.maximum(
        -adv_BT * ratio_BT, -adv_BT * ratio_BT.clamp(1.0 - clip_low, 1.0 + clip_high)
    )
    return torch.where(mask_BT, per_token_BT, torch.zeros_like(per_token_BT)).sum() / mask_BT.sum()


def token_logprobs(
    logits_BTV: torch.Tensor, tokens_BT: torch.Tensor, *, keep_BTV: torch.Tensor | None = None
) -> torch.Tensor:
    """log softmax(logits) of each token; with `keep_BTV` (the nucleus, top_p < 1) renormalised
    over the kept tokens. Temperature is the caller's (divide the logits first)."""
    import torch

    if keep_BTV is not None:
        logits_BTV = torch.where(keep_BTV, logits_BTV, torch.full_like(logits_BTV, -math.inf))
    logp_BTV = torch.log_softmax(logits_BTV.float(), dim=-1)
    return logp_BTV.gather(-1, tokens_BT[..., None]).squeeze(-1)


def json_safe(value: Any) -> Any:
    """`value` with every non-finite float as None (strict JSON has no NaN)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(v) for v in value]
    return value


# ---------------------------------------------------------------------------- the loop
class Batch(NamedTuple):
    sequences_BS: torch.Tensor  # left-padded prompts then the completions (S = L + T)
    attention_BS: torch.Tensor
    prompt_width: int  # L
    completion_BT: torch.Tensor
    mask_BT: torch.Tensor  # bool: trained tokens
    logp_old_BT: torch.Tensor  # behaviour log-probs (what generate sampled from)
    keep_BTV: torch.Tensor | None  # the nucleus of each sampled position (top_p < 1), else None
    rewards_GN: torch.Tensor


def sample_batch(
    model, tokenizer, task, problems, *, samples_per_group: int, sampling, device, score: Scoring
) -> Batch:
    """`samples_per_group` answers to each of `problems` from one `generate` call, and their
    rewards (`score`: the task's rewards, or its own verifier)."""
    import torch

    from asyncrl.models.sampling import answer_ids
    from asyncrl.models.sft import Completion

    prompts = [ids for ids in task.render(problems, tokenizer) for _ in range(samples_per_group)]
    width = max(len(p) for p in prompts)
    ids_BL = torch.full((len(prompts), width), tokenizer.pad_token_id, dtype=torch.long)
    attn_BL = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids_BL[i, width - len(p) :] = torch.tensor(p, dtype=torch.long)
        attn_BL[i, width - len(p) :] = 1
    out = model.generate(
        input_ids=ids_BL.to(device),
        attention_mask=attn_BL.to(device),
        do_sample=True,
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        top_k=0,  # no top-k: asyncrl samples from the whole (nucleus of the) distribution
        max_new_tokens=sampling.max_new_tokens,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        output_scores=True,
        return_dict_in_generate=True,
    )
    completion_BT = out.sequences[:, width:]
    # `scores` are the processed logits each token was sampled from (temperature and top-p applied).
    scores_BTV = torch.stack(out.scores, dim=1).float()
    mask_BT = completion_mask(completion_BT, eos_token_id=tokenizer.eos_token_id)
    logp_old_BT = token_logprobs(scores_BTV, completion_BT)
    keep_BTV = torch.isfinite(scores_BTV) if sampling.top_p < 1.0 else None
    done = []
    for row, ids in enumerate(completion_BT.tolist()):
        answer = answer_ids(ids, tokenizer.eos_token_id)
        text = tokenizer.decode(answer, skip_special_tokens=True)
        finish = "stop" if len(answer) < int(mask_BT[row].sum()) else "length"
        done.append((problems[row // samples_per_group], Completion(text, int(mask_BT[row].sum()), finish)))
    rewards = score(done)
    rewards_GN = torch.tensor(rewards, dtype=torch.float32).view(len(problems), samples_per_group)
    attention_BS = torch.cat([attn_BL.to(device), torch.ones_like(completion_BT)], dim=1)
    return Batch(
        out.sequences, attention_BS, width, completion_BT, mask_BT, logp_old_BT, keep_BTV, rewards_GN
    )


def policy_logprobs(model, batch: Batch, *, temperature: float) -> torch.Tensor:
    """[B, T] log-probs of the sampled tokens under `model` now (with grad), from the distribution
    they were sampled from: logits / temperature, over the same nucleus. The forward sees the
    batch laid out as `generate` saw it (left-padded, positions counted from each prompt's start)."""
    positions_BS = (batch.attention_BS.cumsum(dim=1) - 1).clamp(min=0)
    logits_BSV = model(
        input_ids=batch.sequences_BS, attention_mask=batch.attention_BS, position_ids=positions_BS
    ).logits
    # Logits at position t predict token t + 1: the completion's are at L - 1 .. L + T - 2.
    first, num_tokens = batch.prompt_width - 1, batch.completion_BT.shape[1]
    logits_BTV = logits_BSV[:, first : first + num_tokens] / temperature
    return token_logprobs(logits_BTV, batch.completion_BT, keep_BTV=batch.keep_BTV)


def train_step(
    model,
    optimizer,
    batch: Batch,
    *,
    temperature: float,
    clip_low: float,
    clip_high: float,
    max_grad_norm: float,
) -> float:
    """One forward, backward and optimizer step on `batch`; returns the loss."""
    import torch

    logp_BT = policy_logprobs(model, batch, temperature=temperature)
    adv_B = grpo_advantages(batch.rewards_GN).reshape(-1).to(logp_BT.device)
    loss = clipped_surrogate_token_mean(
        logp_BT, batch.logp_old_BT, adv_B, batch.mask_BT, clip_low=clip_low, clip_high=clip_high
    )
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    optimizer.step()
    return float(loss.detach())


def run_plain_loop(config: Config, *, threads: int) -> dict[str, Any]:
    """The whole job in this process (see the module docstring); returns its figures."""
    job_start = time.perf_counter()
    refused = unsupported(config)
    if refused:
        raise ValueError(f"the plain loop does not implement: {'; '.join(refused)}")
    model, tokenizer, task, device = _load_job(config, threads=threads)
    score = partial(_scores, config, task)
    eval_before = _held_out_accuracy(model, tokenizer, task, config, score)
    optimizer = _optimizer(model, config)
    train_start = time.perf_counter()  # just before the first `generate`
    mean_rewards, num_tokens = _train(model, optimizer, tokenizer, task, config, device=device, score=score)
    train_s = time.perf_counter() - train_start
    eval_after = _held_out_accuracy(model, tokenizer, task, config, score)
    lrn = config.learner
    num_samples = lrn.steps * lrn.groups_per_step * lrn.samples_per_group
    return {
        "train_s": train_s,
        "samples_per_s": num_samples / train_s,
        "tokens_per_s": num_tokens / train_s,
        "num_samples": num_samples,
        "num_tokens": num_tokens,
        "steps": lrn.steps,
        "eval_before": eval_before,
        "eval_after": eval_after,
        "eval_problems": len(task.eval_problems),
        "mean_rewards": mean_rewards,
        "threads": threads,
        "device": str(device),
        "job_s": time.perf_counter() - job_start,
    }


def _load_job(config: Config, *, threads: int):
    """torch on `threads` threads and seeded; the job's model (float32, eval mode), tokenizer,
    prepared task and device, as asyncrl's learner loads them."""
    from asyncrl.models.hf import quiet_offline

    quiet_offline()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from asyncrl.job import model_path
    from asyncrl.models.sampling import resolve_device
    from asyncrl.tasks.base import make_task, prepare_task

    torch.set_num_threads(threads)
    torch.manual_seed(config.run.seed)
    device = resolve_device(config.learner.device, field="learner.device")
    path = model_path(config)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).eval()
    task = make_task(config.task)
    prepare_task(task, tokenizer, groups_per_step=config.learner.groups_per_step)
    return model, tokenizer, task, device


def _scores(config: Config, task, done: list) -> list[float]:
    """Each (problem, Completion)'s reward: the weighted sum of task.rewards, scored as asyncrl
    scores them (a scorer per call: its worker pool is this job's), or the task's own verifier."""
    if not config.task.rewards:
        return [task.score(p.prompt, c.text, p.answer) for p, c in done]
    from asyncrl.rewards.scorer import score_completions

    scores, _ = score_completions(config.task, done, max_new_tokens=config.sampling.max_new_tokens)
    return [s.reward for s in scores]


def _held_out_accuracy(model, tokenizer, task, config: Config, score: Scoring) -> float:
    """Greedy accuracy on the task's held-out problems (NaN without any), as asyncrl reports it:
    the task's score, or with task.rewards the evaluation reward's mean."""
    from asyncrl.evaluator import score_completions
    from asyncrl.models.sft import greedy_completions

    if not task.eval_problems:
        return math.nan
    done = greedy_completions(
        model,
        tokenizer,
        task,
        max_new_tokens=config.sampling.max_new_tokens,
        batch_size=config.task.eval_batch_size,
    )
    scores, _ = score_completions(config, task, done)
    return sum(scores) / len(scores)


def _optimizer(model, config: Config):
    """learner.optimizer over the model's trainable parameters (AdamW betas as the learner's)."""
    import torch

    lrn = config.learner
    params = [p for p in model.parameters() if p.requires_grad]
    if lrn.optimizer == "sgd":
        return torch.optim.SGD(params, lr=lrn.lr, weight_decay=lrn.weight_decay)
    return torch.optim.AdamW(params, lr=lrn.lr, weight_decay=lrn.weight_decay, betas=(0.9, 0.99))


def _train(
    model, optimizer, tokenizer, task, config: Config, *, device, score: Scoring
) -> tuple[list[float], int]:
    """`learner.steps` rounds of generate-then-train; each step's mean reward, and tokens trained."""
    lrn, sampling = config.learner, config.sampling
    clip_low, clip_high = lrn.clip_range()
    mean_rewards, num_tokens = [], 0
    for step in range(lrn.steps):
        first = step * lrn.groups_per_step
        problems_G = [task.train_problem(j) for j in range(first, first + lrn.groups_per_step)]
        batch = sample_batch(
            model,
            tokenizer,
            task,
            problems_G,
            samples_per_group=lrn.samples_per_group,
            sampling=sampling,
            device=device,
            score=score,
        )
        train_step(
            model,
            optimizer,
            batch,
            temperature=sampling.temperature,
            clip_low=clip_low,
            clip_high=clip_high,
            max_grad_norm=lrn.max_grad_norm,
        )
        mean_rewards.append(float(batch.rewards_GN.mean()))
        num_tokens += int(batch.mask_BT.sum())
    return mean_rewards, num_tokens


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m asyncrl.benchmarks.plain_loop",
        description="The plain single-process GRPO loop on asyncrl's job (asyncrl bench baseline).",
    )
    parser.add_argument("--config", default=None, help="the job's TOML file (default: the embedded job)")
    parser.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument(
        "--threads", type=int, default=os.cpu_count() or 1, help="torch threads (default: all)"
    )
    parser.add_argument("--json", action="store_true", help="print the result as one JSON object")
    args = parser.parse_args(argv)
    from asyncrl.config_load import load_config
    from asyncrl.config_sections import ConfigError

    try:
        config = load_config(args.config, args.sets)
        result = run_plain_loop(config, threads=max(1, args.threads))
    except (ConfigError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(json_safe(result)))
    else:
        for key, value in result.items():
            print(f"{key}: {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
