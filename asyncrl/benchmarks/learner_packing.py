"""Packed vs padded training forwards on a long-tailed length distribution (part of `asyncrl bench
learner`).

What it measures: trained tokens per second of the learner's forward and backward (`PolicyLM`,
loss over every completion token) over micro-batches of rows whose lengths follow a long tail
(most answers short, a few long: lognormal lengths, as RL rollouts are), two ways on the same
rows, interleaved, medians over the repeats:

* **packed**: `PolicyLM` with its flat layout (`models/shared_prefix.py`): each row's tokens once,
  no padding, position ids restarting per sequence, attention confined to each sequence (and
  a group's common prompt run once where rows share one);
* **padded**: the same model with the layout off: every row right-padded to the micro-batch's
  longest row.

Micro-batches are cut as the learner cuts them (`learner/microbatch.py`), at most `micro` rows
and `max_tokens` tokens as they run: real tokens when packed, rows x longest when padded (so,
under the same bound, packing also runs fewer, fuller micro-batches).

Two workloads: distinct prompts (packing alone: only the padding goes) and GRPO groups of
`group_size` samples of one prompt (packing and shared prefixes). Trained tokens are the real
completion tokens; the fraction of micro-batches the layout took is reported too (a layout that
saves under 10% of the padded tokens, or whose attention mask would be too large, is not used).

Legend: B rows, L padded width.
"""

from __future__ import annotations

import statistics
import time

# A small Qwen2 (sdpa attention, float32): big enough that the forward's arithmetic dominates.
PACKING_MODEL = {"vocab": 4096, "hidden": 128, "intermediate": 256, "layers": 4, "heads": 4, "kv_heads": 2}


def _model(shape: dict, seed: int):
    import torch

    from asyncrl.benchmarks.gpu_check_sections import qwen2

    return qwen2(shape, seed=seed, attn="sdpa", device=torch.device("cpu"))


def long_tailed_rows(
    *, rows: int, group_size: int, prompt_len: int, median_len: int, max_len: int, vocab: int, seed: int
):
    """(ids_BL right-padded with 0, lengths_B, completion mask_BL): completions of lognormal
    length (median `median_len`, sigma 1, clipped to [1, max_len]); rows in groups of
    `group_size` sharing a prompt (1: every prompt distinct)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    comp = torch.exp(torch.randn(rows, generator=gen) + float(torch.log(torch.tensor(float(median_len)))))
    comp = comp.round().clamp(1, max_len).long()
    lengths = comp + prompt_len
    width = int(lengths.max())
    ids = torch.zeros((rows, width), dtype=torch.long)
    mask = torch.zeros((rows, width), dtype=torch.bool)
    for b in range(rows):
        if b % group_size == 0:
            prompt = torch.randint(1, vocab, (prompt_len,), generator=gen)
        ids[b, :prompt_len] = prompt
        ids[b, prompt_len : int(lengths[b])] = torch.randint(1, vocab, (int(comp[b]),), generator=gen)
        mask[b, prompt_len : int(lengths[b])] = True
    return ids, lengths, mask


def _step_s(policy, ids_BL, lengths_B, mask_BL, parts: list[list[int]]) -> float:
    """One forward and backward over the rows, micro-batch by micro-batch (`parts`: contiguous
    row indices), each cut to its longest row (as the learner's micro-batches are)."""
    import torch

    start = time.perf_counter()
    for part in parts:
        a, b = part[0], part[-1] + 1
        lengths = lengths_B[a:b]
        width = int(lengths.max())
        logp = policy(ids_BL[a:b, :width], lengths_B=lengths).logp
        loss = -torch.where(mask_BL[a:b, :width], logp, 0.0).sum()
        loss.backward()
    return time.perf_counter() - start


def packing_throughput(
    *,
    rows: int = 64,
    micro: int = 64,
    max_tokens: int = 2048,
    repeats: int = 7,
    quick: bool = False,
    seed: int = 0,
) -> dict:
    """Trained tokens/s packed vs padded on both workloads (module docstring)."""
    import torch

    from asyncrl.learner.microbatch import split_lengths
    from asyncrl.models import shared_prefix
    from asyncrl.models.policy import PolicyLM

    shape = PACKING_MODEL
    sizes = {"prompt_len": 16, "median_len": 24, "max_len": 256}
    if quick:
        rows, repeats, sizes = 16, 2, {"prompt_len": 8, "median_len": 8, "max_len": 64}
    lm = _model(shape, seed)
    packed = PolicyLM(lm, share_prefixes=True)
    padded = PolicyLM(lm, share_prefixes=False)
    if not packed.share_prefixes:
        raise RuntimeError(
            f"the flat layout does not apply to this model: {shared_prefix.unsupported_reason(lm)}"
        )
    out: dict = {
        "model": shape,
        "rows": rows,
        "micro_batch_size": micro,
        "max_tokens": max_tokens,
        "repeats": repeats,
        **sizes,
    }
    for name, group_size in (("distinct_prompts", 1), ("groups_of_8", 8)):
        ids, lengths, mask = long_tailed_rows(
            rows=rows, group_size=group_size, vocab=shape["vocab"], seed=seed, **sizes
        )
        tokens = int(mask.sum())
        parts = {
            label: split_lengths(
                lengths.tolist(), max_seqs=micro, max_tokens=max_tokens, packed=label == "packed"
            )
            for label in ("packed", "padded")
        }
        used = sum(
            shared_prefix.plan_layout(ids[p[0] : p[-1] + 1, : int(lengths[p].max())], lengths[p]) is not None
            for p in parts["packed"]
        )
        times: dict[str, list[float]] = {"packed": [], "padded": []}
        _step_s(packed, ids, lengths, mask, parts["packed"])  # warm-up (allocator, first-call costs)
        for _ in range(repeats):
            for label, policy in (("packed", packed), ("padded", padded)):
                lm.zero_grad(set_to_none=True)
                times[label].append(_step_s(policy, ids, lengths, mask, parts[label]))
        med = {k: statistics.median(v) for k, v in times.items()}
        padded_slots = sum(len(p) * int(lengths[p].max()) for p in parts["padded"])
        out[name] = {
            "trained_tokens": tokens,
            "real_tokens": int(lengths.sum()),
            "padded_tokens": padded_slots,
            "microbatches_packed": f"{used}/{len(parts['packed'])}",
            "microbatches_padded": len(parts["padded"]),
            "packed_tokens_per_s": tokens / med["packed"],
            "padded_tokens_per_s": tokens / med["padded"],
            "speedup": med["padded"] / med["packed"],
            "seconds": times,
        }
    torch.set_grad_enabled(True)
    return out


def print_packing(result: dict, echo) -> None:
    echo(
        f"packed vs padded forward + backward, {result['rows']} rows in micro-batches of at most "
        f"{result['micro_batch_size']} rows and {result['max_tokens']} tokens (real when packed, "
        f"padded when padded), completions lognormal (median {result['median_len']}, max "
        f"{result['max_len']}), prompt {result['prompt_len']} tokens, medians of {result['repeats']}:"
    )
    for name in ("distinct_prompts", "groups_of_8"):
        r = result[name]
        echo(
            f"  {name:<17} trained tokens/s packed {r['packed_tokens_per_s']:8.0f}  padded "
            f"{r['padded_tokens_per_s']:8.0f}  ({r['speedup']:.2f}x; real {r['real_tokens']} of "
            f"{r['padded_tokens']} padded tokens; {r['microbatches_padded']} padded micro-batches, "
            f"the layout used in {r['microbatches_packed']} packed ones)"
        )
