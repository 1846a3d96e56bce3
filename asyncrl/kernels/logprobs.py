"""Per-token log-probs and entropies of sampled tokens (pure reference).

Place in the data flow: the learner turns (final hidden states, LM head, sampled token ids) into
`logp`, the input of every policy loss in `losses.py` and of the per-trajectory score gradient
that `streaming.py` accumulates. The fused version lives in `asyncrl/kernels/fused_logprobs.py` and is
checked for parity against `token_logprobs` here.

Legend: T tokens (leading dims are flattened, so [B, T] works too), D hidden size, V vocab,
C tokens per chunk, B sequences.

Memory: a float32 [T, V] logits tensor for T = 8k tokens and V = 150k is 4.9 GB, and autograd keeps
several of them alive for the backward. `token_logprobs` computes C tokens at a time and
recomputes each chunk's logits in the backward (activation checkpointing per chunk), so the peak
is O(C * V) on top of the weight gradient, whatever T is.

Numerics: logits may come out of the matmul in bf16; everything over the vocab (logsumexp, softmax,
entropy) runs in float32 (float64 for float64 inputs). Outputs have that accumulation dtype.

Top-p: generators sample from the nucleus (the smallest set of most likely tokens whose mass
reaches top_p, renormalised) and record that distribution's log-probs. With `top_p < 1` the log-prob
here is renormalised the same way over the model's own nucleus (`nucleus_keep`, the rule the
generators use), with the target always counted in, so the ratio pi / mu is 1 on-policy; the
nucleus is a constant of the backward (no gradient flows through which tokens are in it). The
entropy stays that of the full distribution.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

# 256 tokens x 150k vocab x 4 bytes = 154 MB per live chunk of float32 logits.
DEFAULT_CHUNK_SIZE = 256


class TokenLogprobs(NamedTuple):
    logp: torch.Tensor  # log pi(target | context) / temperature-scaled, shape of the targets
    entropy: torch.Tensor  # entropy of the temperature-scaled next-token distribution


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for half/bf16/float32 inputs, float64 for float64: the dtype of reductions over V."""
    return torch.promote_types(dtype, torch.float32)


def check_temperature(temperature: float) -> None:
    if not temperature > 0.0:
        raise ValueError(f"temperature must be > 0, got {temperature}")


def check_chunk_size(chunk_size: int) -> None:
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")


def check_top_p(top_p: float) -> None:
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")


@torch.no_grad()
def nucleus_keep(logp_CV: torch.Tensor, top_p: float) -> torch.Tensor:
    """bool [C, V]: the smallest set of most likely tokens whose probability mass reaches
    `top_p` (a token is kept while the mass strictly before it is < top_p; the top one always)."""
    sorted_CV, order_CV = logp_CV.sort(dim=-1, descending=True)
    p_sorted_CV = sorted_CV.exp()
    keep_sorted_CV = (p_sorted_CV.cumsum(dim=-1) - p_sorted_CV) < top_p
    return torch.zeros_like(keep_sorted_CV).scatter(-1, order_CV, keep_sorted_CV)


def _stats_from_scaled_logits(
    z_CV: torch.Tensor, targets_C: torch.Tensor, top_p: float = 1.0
) -> TokenLogprobs:
    """Log-prob of the target (over the top-p nucleus when top_p < 1) and entropy from already
    temperature-scaled float logits."""
    lse_C = torch.logsumexp(z_CV, dim=-1)
    if top_p < 1.0:
        keep_CV = nucleus_keep(z_CV.detach() - lse_C.detach()[:, None], top_p)
        keep_CV.scatter_(-1, targets_C[:, None], True)
        lse_kept_C = torch.logsumexp(z_CV.masked_fill(~keep_CV, -torch.inf), dim=-1)
        logp_C = z_CV.gather(-1, targets_C[:, None]).squeeze(-1) - lse_kept_C
    else:
        logp_C = z_CV.gather(-1, targets_C[:, None]).squeeze(-1) - lse_C
    p_CV = torch.exp(z_CV - lse_C[:, None])
    # Entries masked to -inf (e.g. by a bias) have p == 0: clean z before the product so that
    # neither the value nor the gradient sees 0 * -inf.
    live_CV = p_CV > 0
    z_clean_CV = torch.where(live_CV, z_CV, 0.0)
    entropy_C = lse_C - (p_CV * z_clean_CV).sum(dim=-1)
    return TokenLogprobs(logp_C, entropy_C)


def logprobs_from_logits(
    logits_TV: torch.Tensor, targets_T: torch.Tensor, *, temperature: float = 1.0, top_p: float = 1.0
) -> TokenLogprobs:
    """Log-probs of `targets_T` and entropies from full logits (small cases and references).

    Materialises float32 [T, V]; use `token_logprobs` for long sequences or large vocabularies.
    """
    check_temperature(temperature)
    check_top_p(top_p)
    acc = accumulation_dtype(logits_TV.dtype)
    vocab = logits_TV.shape[-1]
    z_NV = logits_TV.reshape(-1, vocab).to(acc) / temperature
    out = _stats_from_scaled_logits(z_NV, targets_T.reshape(-1), top_p)
    return TokenLogprobs(out.logp.reshape(targets_T.shape), out.entropy.reshape(targets_T.shape))


def _chunk_logprobs(
    hidden_CD: torch.Tensor,
    weight_VD: torch.Tensor,
    bias_V: torch.Tensor | None,
    targets_C: torch.Tensor,
    temperature: float,
    top_p: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    z_CV = F.linear(hidden_CD, weight_VD, bias_V).to(accumulation_dtype(hidden_CD.dtype)) / temperature
    out = _stats_from_scaled_logits(z_CV, targets_C, top_p)
    return out.logp, out.entropy


def token_logprobs(
    hidden_TD: torch.Tensor,
    weight_VD: torch.Tensor,
    targets_T: torch.Tensor,
    *,
    bias_V: torch.Tensor | None = None,
    temperature: float = 1.0,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    top_p: float = 1.0,
) -> TokenLogprobs:
    """Log-probs of `targets_T` under softmax((hidden @ weight.T + bias) / temperature), and entropies.

    `hidden_TD` may have any leading shape matching `targets_T` (e.g. [B, T, D] with [B, T]).
    Targets must be valid ids everywhere (put any id, e.g. 0, at masked positions and mask the
    result). Differentiable in hidden, weight and bias; the backward recomputes each chunk's logits,
    so at most one chunk of [C, V] logits and its softmax is alive at a time.
    """
    check_temperature(temperature)
    check_chunk_size(chunk_size)
    check_top_p(top_p)
    if hidden_TD.shape[:-1] != targets_T.shape:
        raise ValueError(f"hidden {tuple(hidden_TD.shape)} does not match targets {tuple(targets_T.shape)}")
    flat_hidden_TD = hidden_TD.reshape(-1, hidden_TD.shape[-1])
    flat_targets_T = targets_T.reshape(-1)
    needs_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (hidden_TD, weight_VD, bias_V)
    )
    logps, entropies = [], []
    for start in range(0, flat_targets_T.shape[0], chunk_size):
        args = (
            flat_hidden_TD[start : start + chunk_size],
            weight_VD,
            bias_V,
            flat_targets_T[start : start + chunk_size],
            temperature,
            top_p,
        )
        if needs_grad:
            logp_C, entropy_C = checkpoint(_chunk_logprobs, *args, use_reentrant=False)
        else:
            logp_C, entropy_C = _chunk_logprobs(*args)
        logps.append(logp_C)
        entropies.append(entropy_C)
    if not logps:
        empty = flat_hidden_TD.new_zeros(targets_T.shape, dtype=accumulation_dtype(hidden_TD.dtype))
        return TokenLogprobs(empty, empty.clone())
    return TokenLogprobs(
        torch.cat(logps).reshape(targets_T.shape), torch.cat(entropies).reshape(targets_T.shape)
    )


def _chunk_candidates(
    hidden_CD: torch.Tensor,
    weight_VD: torch.Tensor,
    bias_V: torch.Tensor | None,
    ids_CN: torch.Tensor,
    temperature: float,
) -> torch.Tensor:
    z_CV = F.linear(hidden_CD, weight_VD, bias_V).to(accumulation_dtype(hidden_CD.dtype)) / temperature
    # log_softmax then gather, as the unchunked references do (same rounding); its backward keeps
    # only the [C, V] output, and z_CV dies here.
    return torch.log_softmax(z_CV, dim=-1).gather(-1, ids_CN)


def candidate_logprobs(
    hidden_TD: torch.Tensor,
    weight_VD: torch.Tensor,
    ids_TN: torch.Tensor,
    *,
    bias_V: torch.Tensor | None = None,
    temperature: float = 1.0,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> torch.Tensor:
    """log softmax((hidden @ weight.T + bias) / temperature) at N candidate ids per position.

    `hidden_TD` has any leading shape matching `ids_TN`'s leading dims ([B, T, D] with [B, T, N]).
    Over the full vocabulary (no nucleus): distillation compares whole distributions. Chunked like
    `token_logprobs`: at most one chunk of [C, V] logits is alive, forward or backward. The output
    has the accumulation dtype (float32 for bf16/float32 inputs, float64 for float64).
    """
    check_temperature(temperature)
    check_chunk_size(chunk_size)
    if hidden_TD.shape[:-1] != ids_TN.shape[:-1]:
        raise ValueError(f"hidden {tuple(hidden_TD.shape)} does not match ids {tuple(ids_TN.shape)}")
    flat_hidden_TD = hidden_TD.reshape(-1, hidden_TD.shape[-1])
    flat_ids_TN = ids_TN.reshape(-1, ids_TN.shape[-1])
    needs_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (hidden_TD, weight_VD, bias_V)
    )
    outs = []
    for start in range(0, flat_ids_TN.shape[0], chunk_size):
        args = (
            flat_hidden_TD[start : start + chunk_size],
            weight_VD,
            bias_V,
            flat_ids_TN[start : start + chunk_size],
            temperature,
        )
        outs.append(
            checkpoint(_chunk_candidates, *args, use_reentrant=False)
            if needs_grad
            else _chunk_candidates(*args)
        )
    if not outs:
        return flat_hidden_TD.new_zeros(ids_TN.shape, dtype=accumulation_dtype(hidden_TD.dtype))
    return torch.cat(outs).reshape(ids_TN.shape)


def unchunkable_reason(model: torch.nn.Module) -> str | None:
    """Why `model`'s logits are not exactly `lm_head(final hidden state)` (None when they are).

    The chunked paths apply the output embedding themselves, so logit scaling or soft-capping
    (Gemma 2, Cohere, Granite) or a head that is not an `nn.Linear` would be silently skipped.
    """
    config = getattr(model, "config", None)
    for name in ("final_logit_softcapping", "logit_scale", "logits_scaling"):
        if getattr(config, name, None) not in (None, 1.0):
            return f"model has {name}"
    head = model.get_output_embeddings()
    if not isinstance(head, torch.nn.Linear):
        return f"the output embedding is a {type(head).__name__}, not an nn.Linear"
    return None


def _shift_to_inputs(values_BS: torch.Tensor) -> torch.Tensor:
    """[B, T-1] values of tokens 1..T-1 -> [B, T] aligned with input ids (position 0 gets 0)."""
    return F.pad(values_BS, (1, 0), value=0.0)


def causal_lm_logprobs(
    model: torch.nn.Module,
    input_ids_BT: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    top_p: float = 1.0,
) -> TokenLogprobs:
    """Log-probs (and entropies) of every input token given its prefix, aligned with `input_ids_BT`.
    With top_p < 1 the log-probs are over each position's nucleus (see the module docstring).

    Position t holds log pi(x_t | x_<t); position 0 (no prefix) holds 0 and must be masked out.
    Sequences are right-padded (causal attention keeps real tokens independent of the padding).
    With `chunk_size`, logits come from the decoder's final hidden states and the output embedding
    in chunks (`token_logprobs`); that is only valid for models whose logits are exactly
    `lm_head(hidden)` (Llama, Qwen, Mistral), so models with logit scaling or soft-capping raise.
    """
    targets_BS = input_ids_BT[:, 1:]
    if chunk_size is None:
        logits_BSV = model(input_ids=input_ids_BT).logits[:, :-1]
        out = logprobs_from_logits(logits_BSV, targets_BS, temperature=temperature, top_p=top_p)
    else:
        reason = unchunkable_reason(model)
        if reason is not None:
            raise ValueError(f"chunked log-probs need logits == lm_head(hidden); {reason}")
        head = model.get_output_embeddings()
        hidden_BTD = model.get_decoder()(input_ids=input_ids_BT).last_hidden_state
        out = token_logprobs(
            hidden_BTD[:, :-1],
            head.weight,
            targets_BS,
            bias_V=head.bias,
            temperature=temperature,
            chunk_size=chunk_size,
            top_p=top_p,
        )
    return TokenLogprobs(_shift_to_inputs(out.logp), _shift_to_inputs(out.entropy))
