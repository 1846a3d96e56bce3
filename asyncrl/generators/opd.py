"""On-policy distillation on the generator side (pure): the per-position token cache and the
teacher's scores of it.

Place in the data flow: `sampling.generate` returns each completion with K = N - 1 extra tokens
per position drawn from the behavior student; `cache_arrays` lays them out as the [T, N] arrays a
`Trajectory` ships as frames 3-5 (column 0 = the generated token), and `teacher_logprobs` scores
every cached id with one batched teacher forward over prompt + completion. docs/opd.md has the
wire format, the temperatures and the memory cost.

Memory: the teacher's [B, L, V] logits never exist. Its decoder's final hidden states at the
completion positions go through the output embedding a chunk of tokens at a time
(`kernels.logprobs.candidate_logprobs`, the learner's kernel), so the logits alive at once are
[chunk, V] float32 and their log_softmax, bounded by `TEACHER_LOGITS_BUDGET_BYTES`. A teacher
whose logits are not exactly `lm_head(hidden)` (soft-capping, logit scaling) is scored from its
own logits instead, with rows per forward shrunk to keep them under the same budget.

Teacher top-K (`opd.teacher_top_k` = K > 0): the same forward also returns, per position, the
teacher's K most likely ids and their log-probs ([T, K] each, never [T, V]): the cache of the
teacher-weighted sparse forward KL (`learner/opd.py: topk_forward_kl`). A teacher's answer for one
sample is one typed record, `TeacherScoring`, whatever the teacher (a cache of teacher scores
stores these records as they are).

Legend: B sequences, T completion tokens, N cached ids per position (1 + the extra draws), K
teacher top-K ids per position, L padded sequence length, V vocab.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F

from asyncrl.kernels.logprobs import accumulation_dtype, candidate_logprobs, unchunkable_reason
from asyncrl.models.sampling import left_pad

# The teacher is scored at its own distribution, softmax(logits): OPD distils the student toward
# pi_T itself, whatever temperature the student samples at (docs/opd.md).
TEACHER_TEMPERATURE = 1.0
# Sequences per teacher forward, at most.
TEACHER_BATCH_ROWS = 32
# Logits alive at once: a chunk of [tokens, V] float32 logits and their log_softmax (tokens
# shrink, down to 1, to stay under it); 512 MiB is 436 tokens at V = 150k. Teachers scored from
# their own logits keep [rows, T_max + 1, V] twice instead, and shrink rows.
TEACHER_LOGITS_BUDGET_BYTES = 512 << 20
# Tokens per chunk of logits at most (as learner.logprob_chunk_size), before the budget.
TEACHER_CHUNK_TOKENS = 1024


class TeacherScoring(NamedTuple):
    """A teacher's scores of one sample: log pi_T of its [T, N] cached ids and, with
    opd.teacher_top_k = K > 0, the teacher's K most likely ids per position and their log-probs
    (descending; None with K = 0). Float32 / int64 on the CPU."""

    logprobs: torch.Tensor  # float32 [T, N]
    top_ids: torch.Tensor | None = None  # int64 [T, K]
    top_logprobs: torch.Tensor | None = None  # float32 [T, K]


def score_prefixes(score, ids_TN: Sequence[torch.Tensor], horizon: int) -> list[TeacherScoring]:
    """`score(ids)` of each sample's first `horizon` positions only (0 = all), its answers padded
    back to T rows: NaN log-probs (and id 0 in the top-K) where the teacher did not score."""
    if horizon == 0 or all(int(x.shape[0]) <= horizon for x in ids_TN):
        return [as_scoring(x) for x in score(ids_TN)]
    out = []
    for full, got in zip(ids_TN, score([x[:horizon] for x in ids_TN]), strict=True):
        got = as_scoring(got)
        rest = int(full.shape[0]) - int(got.logprobs.shape[0])
        out.append(
            TeacherScoring(
                _pad_rows(got.logprobs, rest, math.nan),
                _pad_rows(got.top_ids, rest, 0),
                _pad_rows(got.top_logprobs, rest, math.nan),
            )
        )
    return out


def _pad_rows(x: torch.Tensor | None, rows: int, value: float) -> torch.Tensor | None:
    """`x` with `rows` more rows of `value` (None stays None)."""
    if x is None or rows == 0:
        return x
    return torch.cat([x, x.new_full((rows, x.shape[1]), value)])


def as_scoring(x: TeacherScoring | torch.Tensor) -> TeacherScoring:
    """A teacher answer as a `TeacherScoring` (a bare [T, N] tensor is the scores without top-K)."""
    return x if isinstance(x, TeacherScoring) else TeacherScoring(x)


def check_top_k(top_k: int, vocab: int) -> int:
    """K itself; an error naming opd.teacher_top_k when it is negative or above the vocabulary."""
    if not 0 <= top_k <= vocab:
        raise ValueError(
            f"opd.teacher_top_k = {top_k}: the teacher has {vocab} output ids; use 0 (no top-K) to {vocab}"
        )
    return top_k


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


def _padded_batch(
    prompt_ids: Sequence[Sequence[int]],
    ids_TN: Sequence[torch.Tensor],
    pad_token_id: int,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids, attention mask, position ids) [B, L] on `device` of prompt + completion (column 0
    of each `ids_TN`), left-padded so every completion ends at the last column."""
    seqs = [list(p) + x[:, 0].tolist() for p, x in zip(prompt_ids, ids_TN, strict=True)]
    ids_BL, attn_BL = left_pad(seqs, pad_token_id)
    ids_BL, attn_BL = ids_BL.to(device), attn_BL.to(device)
    return ids_BL, attn_BL, (attn_BL.cumsum(dim=1) - 1).clamp(min=0)


def teacher_logprobs(
    teacher,
    prompt_ids: Sequence[Sequence[int]],
    ids_TN: Sequence[torch.Tensor],
    *,
    pad_token_id: int,
    temperature: float = TEACHER_TEMPERATURE,
    batch_rows: int = TEACHER_BATCH_ROWS,
    budget_bytes: int = TEACHER_LOGITS_BUDGET_BYTES,
    chunk_size: int = TEACHER_CHUNK_TOKENS,
) -> list[torch.Tensor]:
    """log pi_T(ids_TN[i][t, k] | prompt_i, completion_i[:t]) as float32 [T_i, N] per sequence
    (`teacher_scores` without top-K)."""
    scores = teacher_scores(
        teacher,
        prompt_ids,
        ids_TN,
        pad_token_id=pad_token_id,
        temperature=temperature,
        batch_rows=batch_rows,
        budget_bytes=budget_bytes,
        chunk_size=chunk_size,
    )
    return [s.logprobs for s in scores]


@torch.no_grad()
def teacher_scores(
    teacher,
    prompt_ids: Sequence[Sequence[int]],
    ids_TN: Sequence[torch.Tensor],
    *,
    pad_token_id: int,
    top_k: int = 0,
    temperature: float = TEACHER_TEMPERATURE,
    batch_rows: int = TEACHER_BATCH_ROWS,
    budget_bytes: int = TEACHER_LOGITS_BUDGET_BYTES,
    chunk_size: int = TEACHER_CHUNK_TOKENS,
) -> list[TeacherScoring]:
    """Per sequence, log pi_T of its [T, N] ids and (top_k > 0) the teacher's top_k ids and
    log-probs per position, [T, K] each.

    The context of position t is the prompt and the generated tokens before it (column 0 of
    `ids_TN`), so one forward over prompt + completion scores all N ids of every position, and
    gives the top-K of the same distribution. Sequences go through in forwards of at most
    `batch_rows`; the logits alive at once stay under `budget_bytes` (module docstring), in
    chunks of at most `chunk_size` tokens. The inputs go to the teacher's device; the scores come
    back on the CPU.
    """
    if not temperature > 0:
        raise ValueError(f"teacher temperature must be > 0, got {temperature}")
    if len(prompt_ids) != len(ids_TN):
        raise ValueError(f"{len(prompt_ids)} prompts but {len(ids_TN)} completions")
    if any(int(x.shape[0]) < 1 for x in ids_TN):
        raise ValueError("every completion needs at least one token to be scored")
    check_top_k(top_k, int(teacher.get_output_embeddings().weight.shape[0]))
    if unchunkable_reason(teacher) is not None:
        return _scores_from_logits(
            teacher, prompt_ids, ids_TN, pad_token_id, temperature, batch_rows, budget_bytes, top_k
        )
    head = teacher.get_output_embeddings()
    device = head.weight.device
    bytes_per_token = 2 * head.weight.shape[0] * 4  # float32 logits and their log_softmax
    chunk = max(1, min(chunk_size, budget_bytes // bytes_per_token))
    out: list[TeacherScoring] = []
    for start in range(0, len(ids_TN), batch_rows):
        rows = ids_TN[start : start + batch_rows]
        ids_BL, attn_BL, pos_BL = _padded_batch(
            prompt_ids[start : start + batch_rows], rows, pad_token_id, device
        )
        hidden_BLD = teacher.get_decoder()(
            input_ids=ids_BL, attention_mask=attn_BL, position_ids=pos_BL, use_cache=False
        ).last_hidden_state
        width = ids_BL.shape[1]
        lengths = [int(x.shape[0]) for x in rows]
        # Token t of a completion of length T sits at column L - T + t; it is predicted one earlier.
        hidden_TD = torch.cat([hidden_BLD[row, width - 1 - n : width - 1] for row, n in enumerate(lengths)])
        flat_ids_TN = torch.cat([x.to(torch.int64) for x in rows]).to(device)
        if top_k == 0:
            logp_TN = candidate_logprobs(
                hidden_TD,
                head.weight,
                flat_ids_TN,
                bias_V=head.bias,
                temperature=temperature,
                chunk_size=chunk,
            )
            out += [TeacherScoring(x.to("cpu", torch.float32)) for x in logp_TN.split(lengths)]
            continue
        parts = _chunked_top_k(hidden_TD, head.weight, head.bias, flat_ids_TN, temperature, top_k, chunk)
        out += [
            TeacherScoring(*(x.to("cpu") for x in triple))
            for triple in zip(*(p.split(lengths) for p in parts), strict=True)
        ]
    return out


def _chunked_top_k(
    hidden_TD: torch.Tensor,
    weight_VD: torch.Tensor,
    bias_V: torch.Tensor | None,
    ids_TN: torch.Tensor,
    temperature: float,
    top_k: int,
    chunk: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(log pi_T at ids_TN, top-K ids, top-K log-probs), a chunk of [chunk, V] logits at a time,
    with `kernels.logprobs.candidate_logprobs`'s arithmetic (the same log-probs at the cached ids)."""
    scores, top_ids, top_logp = [], [], []
    for start in range(0, hidden_TD.shape[0], chunk):
        h_CD = hidden_TD[start : start + chunk]
        z_CV = F.linear(h_CD, weight_VD, bias_V).to(accumulation_dtype(h_CD.dtype)) / temperature
        logp_CV = torch.log_softmax(z_CV, dim=-1)
        scores.append(logp_CV.gather(-1, ids_TN[start : start + chunk]).float())
        values, indices = logp_CV.topk(top_k, dim=-1)
        top_ids.append(indices)
        top_logp.append(values.float())
    return torch.cat(scores), torch.cat(top_ids), torch.cat(top_logp)


def _scores_from_logits(
    teacher,
    prompt_ids: Sequence[Sequence[int]],
    ids_TN: Sequence[torch.Tensor],
    pad_token_id: int,
    temperature: float,
    batch_rows: int,
    budget_bytes: int,
    top_k: int = 0,
) -> list[TeacherScoring]:
    """`teacher_scores` from the teacher's own logits (of the last T_max + 1 positions, where
    the model can compute only those): for models whose logits are not `lm_head(hidden)`."""
    tail_only = _keeps_tail_logits(teacher)
    weight = teacher.get_output_embeddings().weight
    vocab, device = weight.shape[0], weight.device
    max_len = max((int(x.shape[0]) for x in ids_TN), default=0)
    bytes_per_row = 2 * (max_len + 1) * vocab * 4  # float32 logits and their log_softmax
    rows = max(1, min(batch_rows, budget_bytes // bytes_per_row))
    out: list[TeacherScoring] = []
    for start in range(0, len(ids_TN), rows):
        chunk = ids_TN[start : start + rows]
        lengths = [int(x.shape[0]) for x in chunk]
        ids_BL, attn_BL, pos_BL = _padded_batch(prompt_ids[start : start + rows], chunk, pad_token_id, device)
        keep = max(lengths) + 1  # the logits before each completion token, plus the last one
        extra = {"logits_to_keep": keep} if tail_only else {}
        logits = teacher(input_ids=ids_BL, attention_mask=attn_BL, position_ids=pos_BL, **extra).logits
        logp_BKV = torch.log_softmax(logits[:, -keep:].float() / temperature, dim=-1)
        for row, (x, t_len) in enumerate(zip(chunk, lengths, strict=True)):
            # Token t of a completion of length T sits at column L - T + t; its logits one earlier.
            first = keep - 1 - t_len
            logp_TV = logp_BKV[row, first : first + t_len]
            scores_TN = logp_TV.gather(1, x.to(device, torch.int64)).to("cpu", torch.float32)
            if top_k == 0:
                out.append(TeacherScoring(scores_TN))
                continue
            values, indices = logp_TV.topk(top_k, dim=-1)
            out.append(TeacherScoring(scores_TN, indices.to("cpu"), values.to("cpu", torch.float32)))
    return out
