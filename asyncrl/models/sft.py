"""Warm-start supervised fine-tuning (completion tokens only) and greedy evaluation.

Used by `asyncrl sft` to produce the embedded default checkpoint, and by the launcher to measure
held-out accuracy before and after RL with the same greedy decoding: float32, on the device the
caller names (`task.eval_device`), `batch_size` held-out prompts decoded together. Greedy decoding
reads only each row's own tokens, so the batch size does not change the completions.
"""

from __future__ import annotations

import logging
import math
import random
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

log = logging.getLogger(__name__)


class SftResult(NamedTuple):
    steps: int
    final_loss: float


def encode_pairs(
    tokenizer, pairs: Sequence[tuple[str, str]]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded input ids, attention mask and a bool mask of the completion(+eos) positions."""
    rows, loss_rows = [], []
    for prompt, completion in pairs:
        p = tokenizer(prompt)["input_ids"]
        c = tokenizer(completion, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        rows.append(p + c)
        loss_rows.append([False] * len(p) + [True] * len(c))
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)
    attn = torch.zeros((len(rows), width), dtype=torch.long)
    loss_mask = torch.zeros((len(rows), width), dtype=torch.bool)
    for i, (r, m) in enumerate(zip(rows, loss_rows, strict=True)):
        ids[i, : len(r)] = torch.tensor(r)
        attn[i, : len(r)] = 1
        loss_mask[i, : len(m)] = torch.tensor(m)
    return ids, attn, loss_mask


def sft(
    model,
    tokenizer,
    pairs: Sequence[tuple[str, str]],
    *,
    steps: int,
    batch_size: int,
    lr: float,
    seed: int = 0,
    on_step: Callable[[int, float], None] | None = None,
) -> SftResult:
    """AdamW with cosine decay on next-token loss over completion tokens."""
    rng = random.Random(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    model.train()
    loss_value = math.nan
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = lr * 0.5 * (1.0 + math.cos(math.pi * step / steps))
        batch = [pairs[rng.randrange(len(pairs))] for _ in range(batch_size)]
        ids, attn, loss_mask = encode_pairs(tokenizer, batch)
        logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1]
        targets = ids[:, 1:]
        mask = loss_mask[:, 1:]
        nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), targets, reduction="none")
        loss = torch.where(mask, nll, torch.zeros_like(nll)).sum() / mask.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        loss_value = float(loss.detach())
        if on_step is not None:
            on_step(step, loss_value)
    model.eval()
    return SftResult(steps=steps, final_loss=loss_value)


class Completion(NamedTuple):
    """A greedy completion as the rewards read it: decoded up to its first eos."""

    text: str
    num_tokens: int
    finish_reason: str


@torch.no_grad()
def greedy_completions(
    model,
    tokenizer,
    task,
    *,
    max_new_tokens: int,
    batch_size: int = 256,
    samples: int = 1,
    temperature: float = 0.0,
) -> list:
    """(problem, Completion) for each of `task`'s held-out problems (an `asyncrl.tasks.base.Task`:
    prompts rendered by the task), greedy, the same decoding before and after training, on the
    model's device, `batch_size` prompts per `generate` call. With `samples` = k > 1: k
    completions per problem (problem by problem) at `temperature`, seeded by their position."""
    from asyncrl.models.sampling import answer_ids, generate, sample_seed

    problems = [p for p in task.eval_problems for _ in range(samples)]
    out = []
    for start in range(0, len(problems), batch_size):
        chunk = problems[start : start + batch_size]
        gen = generate(
            model,
            task.render(chunk, tokenizer),
            max_new_tokens=max_new_tokens,
            temperature=temperature if samples > 1 else 0.0,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            seeds=[sample_seed(0, (start + i) // samples, (start + i) % samples) for i in range(len(chunk))],
        )
        for problem, ids, finish in zip(chunk, gen.completion_ids, gen.finish_reasons, strict=True):
            text = tokenizer.decode(answer_ids(ids, tokenizer.eos_token_id), skip_special_tokens=True)
            out.append((problem, Completion(text, len(ids), finish)))
    return out


def greedy_accuracy(model, tokenizer, task, *, max_new_tokens: int, batch_size: int = 256) -> float:
    """Mean task score (`task.score`) of the greedy completions of `task`'s held-out problems."""
    done = greedy_completions(model, tokenizer, task, max_new_tokens=max_new_tokens, batch_size=batch_size)
    total = sum(task.score(p.prompt, c.text, p.answer) for p, c in done)
    return total / max(1, len(done))


def _load(path, threads: int, device: str):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if threads > 0:
        torch.set_num_threads(threads)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return model.to(device), tokenizer


def _release(device: str) -> None:
    """Give the evaluation model's cached GPU memory back (its last reference is gone): the
    launcher evaluates in its own process, and the learner and generators need the GPU."""
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


def checkpoint_accuracy(
    path, task, *, max_new_tokens: int, threads: int = 0, device: str = "cpu", batch_size: int = 256
) -> float:
    """`greedy_accuracy` of the Hugging Face checkpoint at `path` (float32, eval mode, on
    `device`); NaN when the task holds nothing out (nothing is loaded then). `threads` > 0 sets
    torch's intra-op threads first."""
    if not task.eval_problems:
        return float("nan")
    model, tokenizer = _load(path, threads, device)
    try:
        return greedy_accuracy(model, tokenizer, task, max_new_tokens=max_new_tokens, batch_size=batch_size)
    finally:
        del model
        _release(device)


def checkpoint_completions(
    path,
    task,
    *,
    max_new_tokens: int,
    threads: int = 0,
    device: str = "cpu",
    batch_size: int = 256,
    samples: int = 1,
    temperature: float = 0.0,
) -> list:
    """`greedy_completions` of the checkpoint at `path` on `device` (for scoring with the run's
    rewards); empty when the task holds nothing out (nothing is loaded then)."""
    if not task.eval_problems:
        return []
    model, tokenizer = _load(path, threads, device)
    try:
        return greedy_completions(
            model,
            tokenizer,
            task,
            max_new_tokens=max_new_tokens,
            batch_size=batch_size,
            samples=samples,
            temperature=temperature,
        )
    finally:
        del model
        _release(device)
