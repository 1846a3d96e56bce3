"""Warm-start supervised fine-tuning (completion tokens only) and greedy evaluation.

Used by `asyncrl sft` to produce the embedded default checkpoint, and by the launcher to measure
held-out accuracy before and after RL with the same greedy decoding.
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


@torch.no_grad()
def greedy_accuracy(
    model,
    tokenizer,
    task,
    *,
    max_new_tokens: int,
    batch_size: int = 256,
) -> float:
    """Mean reward of greedy completions of `task`'s held-out problems (an `asyncrl.tasks.base.Task`:
    prompts rendered and completions scored by the task), the same decoding before and after training."""
    from asyncrl.models.sampling import answer_ids, generate

    problems = list(task.eval_problems)
    total = 0.0
    for start in range(0, len(problems), batch_size):
        chunk = problems[start : start + batch_size]
        out = generate(
            model,
            task.render(chunk, tokenizer),
            max_new_tokens=max_new_tokens,
            temperature=0.0,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
        for problem, ids in zip(chunk, out.completion_ids, strict=True):
            text = tokenizer.decode(answer_ids(ids, tokenizer.eos_token_id), skip_special_tokens=True)
            total += task.score(problem.prompt, text, problem.answer)
    return total / max(1, len(problems))


def checkpoint_accuracy(path, task, *, max_new_tokens: int, threads: int = 0) -> float:
    """`greedy_accuracy` of the Hugging Face checkpoint at `path` (float32, eval mode); NaN when
    the task holds nothing out. `threads` > 0 sets torch's intra-op threads first."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not task.eval_problems:
        return float("nan")
    if threads > 0:
        torch.set_num_threads(threads)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return greedy_accuracy(model, tokenizer, task, max_new_tokens=max_new_tokens)
