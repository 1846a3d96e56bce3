"""On-policy distillation on the generator side (pure): the per-position token cache and the
teacher's scores of it.

Place in the data flow: `sampling.generate` returns each completion with K = N - 1 extra tokens
per position drawn from the behavior student; `cache_arrays` lays them out as the [T, N] arrays a
`Trajectory` ships as frames 3-5 (column 0 = the generated token), and `teacher_logprobs` scores
every cached id with one batched teacher forward over prompt + completion. docs/opd.md has the
wire format, the temperatures and the memory cost.

Legend: B sequences, T completion tokens, N cached ids per position (1 + K extras), L padded
sequence length, V vocab.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence

import torch

from asyncrl.models.sampling import left_pad

# The teacher is scored at its own distribution, softmax(logits): OPD distils the student toward
# pi_T itself, whatever temperature the student samples at (docs/opd.md).
TEACHER_TEMPERATURE = 1.0
# Sequences per teacher forward, at most: the logits kept are [rows, T_max + 1, V] float32 and
# their log_softmax as many again, so rows shrink (down to 1) to keep both under the budget.
TEACHER_BATCH_ROWS = 32
TEACHER_LOGITS_BUDGET_BYTES = 512 << 20


def cache_arrays(
    completion_ids: Sequence[int],
    behavior_logprobs: Sequence[float],
    extra_ids: Sequence[Sequence[int]] | None,
    extra_logprobs: Sequence[Sequence[float]] | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids_TN int64, behavior_logprobs_TN float32): column 0 is the generated token and its
    behavior log-prob, columns 1.. the extra draws at the same position (none when N = 1)."""
    ids_T1 = torch.tensor(completion_ids, dtype=torch.int64)[:, None]
    logp_T1 = torch.tensor(behavior_logprobs, dtype=torch.float32)[:, None]
    if extra_ids is None or extra_logprobs is None:
        return ids_T1, logp_T1
    if not (len(extra_ids) == len(extra_logprobs) == len(completion_ids)):
        raise ValueError(
            f"{len(completion_ids)} tokens but {len(extra_ids)} rows of extra ids and "
            f"{len(extra_logprobs)} rows of extra log-probs; they must match"
        )
    num_extra = len(extra_ids[0]) if extra_ids else 0
    extra_ids_TK = torch.tensor(extra_ids, dtype=torch.int64).reshape(len(completion_ids), num_extra)
    extra_logp_TK = torch.tensor(extra_logprobs, dtype=torch.float32).reshape(len(completion_ids), num_extra)
    return torch.cat([ids_T1, extra_ids_TK], dim=1), torch.cat([logp_T1, extra_logp_TK], dim=1)


def _keeps_tail_logits(model) -> bool:
    """transformers >= 4.50 can compute logits for the last k positions only (`logits_to_keep`)."""
    return "logits_to_keep" in inspect.signature(model.forward).parameters


@torch.no_grad()
def teacher_logprobs(
    teacher,
    prompt_ids: Sequence[Sequence[int]],
    ids_TN: Sequence[torch.Tensor],
    *,
    pad_token_id: int,
    temperature: float = TEACHER_TEMPERATURE,
    batch_rows: int = TEACHER_BATCH_ROWS,
    budget_bytes: int = TEACHER_LOGITS_BUDGET_BYTES,
) -> list[torch.Tensor]:
    """log pi_T(ids_TN[i][t, k] | prompt_i, completion_i[:t]) as float32 [T_i, N] per sequence.

    The context of position t is the prompt and the generated tokens before it (column 0 of
    `ids_TN`), so one forward over prompt + completion scores all N ids of every position.
    Sequences are left-padded, so every completion ends at the last column and only the logits of
    the last T_max + 1 positions are needed (and computed, where the model supports it).
    Sequences go through in chunks of at most `batch_rows`, fewer when their tail logits would
    pass `budget_bytes`.
    """
    if not temperature > 0:
        raise ValueError(f"teacher temperature must be > 0, got {temperature}")
    if len(prompt_ids) != len(ids_TN):
        raise ValueError(f"{len(prompt_ids)} prompts but {len(ids_TN)} completions")
    tail_only = _keeps_tail_logits(teacher)
    if any(int(x.shape[0]) < 1 for x in ids_TN):
        raise ValueError("every completion needs at least one token to be scored")
    vocab = teacher.get_output_embeddings().weight.shape[0]
    max_len = max((int(x.shape[0]) for x in ids_TN), default=0)
    bytes_per_row = 2 * (max_len + 1) * vocab * 4  # float32 logits and their log_softmax
    rows = max(1, min(batch_rows, budget_bytes // bytes_per_row))
    out: list[torch.Tensor] = []
    for start in range(0, len(ids_TN), rows):
        chunk = ids_TN[start : start + rows]
        lengths = [int(x.shape[0]) for x in chunk]
        seqs = [
            list(p) + x[:, 0].tolist() for p, x in zip(prompt_ids[start : start + rows], chunk, strict=True)
        ]
        ids_BL, attn_BL = left_pad(seqs, pad_token_id)
        pos_BL = (attn_BL.cumsum(dim=1) - 1).clamp(min=0)
        keep = max(lengths) + 1  # the logits before each completion token, plus the last one
        extra = {"logits_to_keep": keep} if tail_only else {}
        logits = teacher(input_ids=ids_BL, attention_mask=attn_BL, position_ids=pos_BL, **extra).logits
        logits_BKV = logits[:, -keep:]
        logp_BKV = torch.log_softmax(logits_BKV.float() / temperature, dim=-1)
        for row, (x, t_len) in enumerate(zip(chunk, lengths, strict=True)):
            # Token t of a completion of length T sits at column L - T + t; its logits one earlier.
            first = keep - 1 - t_len
            logp_TV = logp_BKV[row, first : first + t_len]
            out.append(logp_TV.gather(1, x.to(torch.int64)).to(torch.float32))
    return out
