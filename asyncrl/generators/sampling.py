"""Batched sampling with a KV cache from a Hugging Face causal LM, with exact behavior log-probs.

Pure with respect to the system: a model and token ids in, token ids, log-probs and versions out.
The log-prob recorded for each sampled token is taken from exactly the distribution it was
sampled from: softmax(logits / temperature), renormalised over the top-p nucleus when top_p < 1.
Greedy decoding (temperature 0) records log_softmax(logits).

Legend: B sequences, L prompt length (left-padded), V vocab.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch


class SampleOutput(NamedTuple):
    completion_ids: list[list[int]]  # sampled tokens, ending with eos when one was emitted
    logprobs: list[list[float]]  # behavior log-prob of each completion token
    versions: list[list[int]]  # policy_version that produced each completion token
    finish_reasons: list[str]  # "stop" (eos) or "length"
    num_decode_steps: int


def left_pad(prompt_ids: Sequence[Sequence[int]], pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompt_ids)
    ids = torch.full((len(prompt_ids), width), pad_token_id, dtype=torch.long)
    attn = torch.zeros((len(prompt_ids), width), dtype=torch.long)
    for i, p in enumerate(prompt_ids):
        if len(p) == 0:
            raise ValueError(f"prompt {i} is empty: every prompt needs at least one token (e.g. <bos>)")
        ids[i, width - len(p) :] = torch.tensor(p, dtype=torch.long)
        attn[i, width - len(p) :] = 1
    return ids, attn


def _nucleus_logprobs(logp_BV: torch.Tensor, top_p: float) -> torch.Tensor:
    """Log-probs renormalised over the smallest set whose mass reaches top_p (others -inf)."""
    sorted_BV, order_BV = logp_BV.sort(dim=-1, descending=True)
    mass_before_BV = sorted_BV.exp().cumsum(dim=-1) - sorted_BV.exp()
    keep_sorted_BV = mass_before_BV < top_p  # the top token is always kept
    keep_BV = torch.zeros_like(keep_sorted_BV).scatter(-1, order_BV, keep_sorted_BV)
    kept_BV = torch.where(keep_BV, logp_BV, torch.full_like(logp_BV, -torch.inf))
    return kept_BV - torch.logsumexp(kept_BV, dim=-1, keepdim=True)


def next_token_logprobs(logits_BV: torch.Tensor, *, temperature: float, top_p: float) -> torch.Tensor:
    logits_BV = logits_BV.float()
    if temperature > 0:
        logits_BV = logits_BV / temperature
    logp_BV = torch.log_softmax(logits_BV, dim=-1)
    if top_p < 1.0:
        logp_BV = _nucleus_logprobs(logp_BV, top_p)
    return logp_BV


def _cache_keyword(model) -> str:
    """transformers >= 5.x names the KV cache argument `cache`; 4.x calls it `past_key_values`."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _cache_of(out):
    cache = getattr(out, "cache", None)
    return cache if cache is not None else out.past_key_values


@torch.no_grad()
def generate(
    model,
    prompt_ids: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    temperature: float,
    eos_token_id: int,
    pad_token_id: int,
    top_p: float = 1.0,
    rng: torch.Generator | None = None,
    current_version: Callable[[], int] = lambda: 0,
) -> SampleOutput:
    """Sample up to `max_new_tokens` per prompt. The eos token, when emitted, is part of the
    completion's log-probs (it was sampled too) but not of `completion_ids`' text; its position is
    the last entry of `logprobs[i]` and `versions[i]`, and `completion_ids[i]` then ends with it.

    `current_version` is called before every decode step; a caller that swaps weights between
    steps (in-flight update mode `keep`) gets the new version on the tokens that follow.
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    ids_BL, attn_BL = left_pad(prompt_ids, pad_token_id)
    num_seqs = ids_BL.shape[0]
    pos_BL = (attn_BL.cumsum(dim=1) - 1).clamp(min=0)
    cache_kw = _cache_keyword(model)
    out = model(input_ids=ids_BL, attention_mask=attn_BL, position_ids=pos_BL, use_cache=True)
    cache = _cache_of(out)
    logits_BV = out.logits[:, -1]
    next_pos_B = pos_BL[:, -1] + 1

    completions: list[list[int]] = [[] for _ in range(num_seqs)]
    logprobs: list[list[float]] = [[] for _ in range(num_seqs)]
    versions: list[list[int]] = [[] for _ in range(num_seqs)]
    done_B = torch.zeros(num_seqs, dtype=torch.bool)
    steps = 0
    for steps in range(1, max_new_tokens + 1):
        version = current_version()
        logp_BV = next_token_logprobs(logits_BV, temperature=temperature, top_p=top_p)
        if temperature > 0:
            tok_B = torch.multinomial(logp_BV.exp(), num_samples=1, generator=rng).squeeze(1)
        else:
            tok_B = logp_BV.argmax(dim=-1)
        tok_logp_B = logp_BV.gather(1, tok_B[:, None]).squeeze(1)
        for i in torch.nonzero(~done_B).flatten().tolist():
            completions[i].append(int(tok_B[i]))
            logprobs[i].append(float(tok_logp_B[i]))
            versions[i].append(version)
        done_B |= tok_B == eos_token_id
        if bool(done_B.all()) or steps == max_new_tokens:
            break
        tok_B = torch.where(done_B, torch.full_like(tok_B, pad_token_id), tok_B)
        attn_BL = torch.cat([attn_BL, torch.ones((num_seqs, 1), dtype=attn_BL.dtype)], dim=1)
        out = model(
            input_ids=tok_B[:, None],
            attention_mask=attn_BL,
            position_ids=next_pos_B[:, None],
            use_cache=True,
            **{cache_kw: cache},
        )
        cache = _cache_of(out)
        logits_BV = out.logits[:, -1]
        next_pos_B = next_pos_B + 1

    finish = ["stop" if c and c[-1] == eos_token_id else "length" for c in completions]
    return SampleOutput(completions, logprobs, versions, finish, steps)


def strip_eos(ids: Sequence[int], eos_token_id: int) -> list[int]:
    return list(ids[:-1]) if ids and ids[-1] == eos_token_id else list(ids)
