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


def _step_s(policy, ids_BL, lengths_B, mask_BL, micro: int) -> float:
    """One forward and backward over the rows, `micro` rows per micro-batch, each cut to its
    longest row (as the learner's micro-batches are)."""
    import torch

    start = time.perf_counter()
    for a in range(0, ids_BL.shape[0], micro):
        lengths = lengths_B[a : a + micro]
        width = int(lengths.max())
        logp = policy(ids_BL[a : a + micro, :width], lengths_B=lengths).logp
        loss = -torch.where(mask_BL[a : a + micro, :width], logp, 0.0).sum()
        loss.backward()
    return time.perf_counter() - start


def packing_throughput(
    *, rows: int = 64, micro: int = 16, repeats: int = 7, quick: bool = False, seed: int = 0
) -> dict:
    """Trained tokens/s packed vs padded on both workloads (module docstring)."""
    import torch

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
    out: dict = {"model": shape, "rows": rows, "micro_batch_size": micro, "repeats": repeats, **sizes}
    for name, group_size in (("distinct_prompts", 1), ("groups_of_8", 8)):
        ids, lengths, mask = long_tailed_rows(
            rows=rows, group_size=group_size, vocab=shape["vocab"], seed=seed, **sizes
        )
        tokens = int(mask.sum())
        used = sum(
            shared_prefix.plan_layout(
                ids[a : a + micro, : int(lengths[a : a + micro].max())], lengths[a : a + micro]
            )
            is not None
            for a in range(0, rows, micro)
        )
        times: dict[str, list[float]] = {"packed": [], "padded": []}
        _step_s(packed, ids, lengths, mask, micro)  # warm-up (allocator, first-call costs)
        for _ in range(repeats):
            for label, policy in (("packed", packed), ("padded", padded)):
                lm.zero_grad(set_to_none=True)
                times[label].append(_step_s(policy, ids, lengths, mask, micro))
        med = {k: statistics.median(v) for k, v in times.items()}
        padded_slots = sum(
            len(lengths[a : a + micro]) * int(lengths[a : a + micro].max()) for a in range(0, rows, micro)
        )
        out[name] = {
            "trained_tokens": tokens,
            "real_tokens": int(lengths.sum()),
            "padded_tokens": padded_slots,
            "microbatches_packed": f"{used}/{-(-rows // micro)}",
            "packed_tokens_per_s": tokens / med["packed"],
            "padded_tokens_per_s": tokens / med["padded"],
            "speedup": med["padded"] / med["packed"],
            "seconds": times,
        }
    torch.set_grad_enabled(True)
    return out


def print_packing(result: dict, echo) -> None:
    echo(
        f"packed vs padded forward + backward, {result['rows']} rows in micro-batches of "
        f"{result['micro_batch_size']}, completions lognormal (median {result['median_len']}, max "
        f"{result['max_len']}), prompt {result['prompt_len']} tokens, medians of {result['repeats']}:"
    )
    for name in ("distinct_prompts", "groups_of_8"):
        r = result[name]
        echo(
            f"  {name:<17} trained tokens/s packed {r['packed_tokens_per_s']:8.0f}  padded "
            f"{r['padded_tokens_per_s']:8.0f}  ({r['speedup']:.2f}x; real {r['real_tokens']} of "
            f"{r['padded_tokens']} padded tokens; layout used in {r['microbatches_packed']} micro-batches)"
        )
