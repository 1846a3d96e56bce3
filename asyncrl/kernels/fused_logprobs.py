"""Fused chunked log-probs: the LM head, log-softmax, entropy and their gradients in one chunk loop.

Place in the data flow: drop-in replacement for `asyncrl.kernels.logprobs.token_logprobs` (same
arguments, same outputs), used by the learner when the vocabulary is large. Parity with the plain
reference (values and gradients) is tested in `tests/unit/test_logprobs.py`.

Legend: T tokens (leading dims flattened), D hidden size, V vocab, C tokens per chunk.

What is fused: the reference checkpoints each chunk and lets autograd rebuild the chunk graph in
the backward (logits, log-softmax, softmax, products: several [C, V] tensors alive). Here the
forward keeps only the per-token log-sum-exp and entropy ([T] each), and the backward recomputes
one chunk of logits and turns it into the logit gradient in closed form,

    z = logits / tau,  p = softmax(z),  log p = z - lse,  H = -sum p log p
    d logp_target / dz = onehot(target) - p
    d H / dz           = -p * (log p + H)

in place in two [C, V] buffers, then applies the two matmuls of the linear layer. The weight
gradient is accumulated over chunks with an in-place addmm in the accumulation dtype (float32 for
bf16 weights) and cast once at the end.

Optionally the two chunk bodies are compiled with `torch.compile` (`compile_backend="inductor"`
on a machine with a C++ compiler or GPU). If compilation fails, the chunk bodies run eagerly
(a `RuntimeWarning` names the cause): the result is the same, only slower.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable

import torch
import torch.nn.functional as F

from asyncrl.kernels.logprobs import (
    DEFAULT_CHUNK_SIZE,
    TokenLogprobs,
    accumulation_dtype,
    check_chunk_size,
    check_temperature,
)

ChunkFn = Callable[..., tuple[torch.Tensor, ...]]

# log p is clamped here before it multiplies anything: exp(-1e4) is exactly 0 in every float dtype,
# so p is unchanged, while p * log p and p * (log p + H) become 0 instead of 0 * -inf = nan for
# vocabulary entries masked to -inf (e.g. by the bias).
LOG_P_FLOOR = -1e4


def _scaled_logits(
    hidden_CD: torch.Tensor, weight_VD: torch.Tensor, bias_V: torch.Tensor | None, temperature: float
) -> torch.Tensor:
    """A fresh [C, V] tensor of logits / temperature in the accumulation dtype (safe to modify in place)."""
    z_CV = F.linear(hidden_CD, weight_VD, bias_V).to(accumulation_dtype(hidden_CD.dtype))
    return z_CV.div_(temperature)


def _chunk_forward(
    hidden_CD: torch.Tensor,
    weight_VD: torch.Tensor,
    bias_V: torch.Tensor | None,
    targets_C: torch.Tensor,
    temperature: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logp, entropy, lse) of one chunk; at most two [C, V] buffers are alive, none survives."""
    log_p_CV = _scaled_logits(hidden_CD, weight_VD, bias_V, temperature)
    lse_C = torch.logsumexp(log_p_CV, dim=-1)
    log_p_CV.sub_(lse_C[:, None])
    logp_C = log_p_CV.gather(-1, targets_C[:, None]).squeeze(-1)
    log_p_CV.clamp_(min=LOG_P_FLOOR)
    entropy_C = -torch.exp(log_p_CV).mul_(log_p_CV).sum(dim=-1)
    return logp_C, entropy_C, lse_C


def _chunk_backward(
    hidden_CD: torch.Tensor,
    weight_VD: torch.Tensor,
    bias_V: torch.Tensor | None,
    targets_C: torch.Tensor,
    lse_C: torch.Tensor,
    entropy_C: torch.Tensor,
    grad_logp_C: torch.Tensor,
    grad_entropy_C: torch.Tensor,
    temperature: float,
    with_entropy: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(d loss / d logits of the chunk in the accumulation dtype, d loss / d hidden of the chunk).

    `with_entropy` is False when the entropy output got no gradient; `grad_entropy_C` is then ignored.
    """
    log_p_CV = _scaled_logits(hidden_CD, weight_VD, bias_V, temperature)
    log_p_CV.sub_(lse_C[:, None]).clamp_(min=LOG_P_FLOOR)
    grad_CV = torch.exp(log_p_CV)
    if with_entropy:
        # d/dz = -p * (g_logp + g_H * (log p + H)), built in the log p buffer.
        inner_CV = log_p_CV.add_(entropy_C[:, None]).mul_(grad_entropy_C[:, None]).add_(grad_logp_C[:, None])
        grad_CV.mul_(inner_CV).neg_()
    else:
        grad_CV.mul_(-grad_logp_C[:, None])
    del log_p_CV
    grad_CV.scatter_add_(-1, targets_C[:, None], grad_logp_C[:, None])
    grad_CV.div_(temperature)  # now d loss / d logits
    return grad_CV, grad_CV.to(weight_VD.dtype) @ weight_VD


@functools.cache
def _compiled(fn: ChunkFn, backend: str) -> ChunkFn:
    # dynamic=True: the last chunk is shorter, and T changes every call.
    return torch.compile(fn, backend=backend, dynamic=True)


def _run(fn: ChunkFn, backend: str | None, *args: object) -> tuple[tuple[torch.Tensor, ...], str | None]:
    """Call the chunk body compiled with `backend`; on a compile failure, run it eagerly.

    Returns (outputs, backend to use for the next chunk): None after a failure, so a broken
    compiler is tried once per call, not once per chunk. A genuine error in the inputs is raised
    again by the eager call, so the fallback never hides one.
    """
    if backend is None:
        return fn(*args), None
    try:
        return _compiled(fn, backend)(*args), backend
    except (RuntimeError, OSError, ImportError, NotImplementedError) as err:
        warnings.warn(
            f"torch.compile(backend={backend!r}) failed for {fn.__name__} ({type(err).__name__}: {err}); "
            "running the fused chunk eagerly",
            RuntimeWarning,
            stacklevel=2,
        )
        return fn(*args), None


class _FusedLinearLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        hidden_TD: torch.Tensor,
        weight_VD: torch.Tensor,
        bias_V: torch.Tensor | None,
        targets_T: torch.Tensor,
        temperature: float,
        chunk_size: int,
        compile_backend: str | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        acc = accumulation_dtype(hidden_TD.dtype)
        num_tokens = targets_T.shape[0]
        logp_T = hidden_TD.new_empty(num_tokens, dtype=acc)
        entropy_T = torch.empty_like(logp_T)
        lse_T = torch.empty_like(logp_T)
        backend = compile_backend
        for start in range(0, num_tokens, chunk_size):
            end = min(start + chunk_size, num_tokens)
            (logp_T[start:end], entropy_T[start:end], lse_T[start:end]), backend = _run(
                _chunk_forward,
                backend,
                hidden_TD[start:end],
                weight_VD,
                bias_V,
                targets_T[start:end],
                temperature,
            )
        ctx.save_for_backward(hidden_TD, weight_VD, bias_V, targets_T, lse_T, entropy_T)
        ctx.temperature = temperature
        ctx.chunk_size = chunk_size
        ctx.compile_backend = backend
        # Unused outputs get a None gradient instead of a [T] zero vector: skips the entropy term.
        ctx.set_materialize_grads(False)
        return logp_T, entropy_T

    @staticmethod
    def backward(
        ctx: torch.autograd.function.FunctionCtx,
        grad_logp_T: torch.Tensor | None,
        grad_entropy_T: torch.Tensor | None,
    ) -> tuple[torch.Tensor | None, ...]:
        hidden_TD, weight_VD, bias_V, targets_T, lse_T, entropy_T = ctx.saved_tensors
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        acc = lse_T.dtype
        grad_logp_T = torch.zeros_like(lse_T) if grad_logp_T is None else grad_logp_T.to(acc)
        with_entropy = grad_entropy_T is not None
        grad_entropy_T = grad_entropy_T.to(acc) if with_entropy else lse_T
        grad_hidden_TD = torch.zeros_like(hidden_TD) if need_hidden else None
        grad_weight_VD = torch.zeros_like(weight_VD, dtype=acc) if need_weight else None
        grad_bias_V = torch.zeros_like(bias_V, dtype=acc) if need_bias else None
        num_tokens = targets_T.shape[0]
        backend = ctx.compile_backend
        for start in range(0, num_tokens, ctx.chunk_size):
            end = min(start + ctx.chunk_size, num_tokens)
            hidden_CD = hidden_TD[start:end]
            (grad_logits_CV, grad_hidden_CD), backend = _run(
                _chunk_backward,
                backend,
                hidden_CD,
                weight_VD,
                bias_V,
                targets_T[start:end],
                lse_T[start:end],
                entropy_T[start:end],
                grad_logp_T[start:end],
                grad_entropy_T[start:end],
                ctx.temperature,
                with_entropy,
            )
            if grad_hidden_TD is not None:
                grad_hidden_TD[start:end] = grad_hidden_CD
            if grad_weight_VD is not None:
                # In place: a [V, D] temporary per chunk would double the weight-gradient memory.
                grad_weight_VD.addmm_(grad_logits_CV.T, hidden_CD.to(acc))
            if grad_bias_V is not None:
                grad_bias_V += grad_logits_CV.sum(dim=0)
        if grad_weight_VD is not None:
            grad_weight_VD = grad_weight_VD.to(weight_VD.dtype)
        if grad_bias_V is not None:
            grad_bias_V = grad_bias_V.to(bias_V.dtype)
        return grad_hidden_TD, grad_weight_VD, grad_bias_V, None, None, None, None


def fused_token_logprobs(
    hidden_TD: torch.Tensor,
    weight_VD: torch.Tensor,
    targets_T: torch.Tensor,
    *,
    bias_V: torch.Tensor | None = None,
    temperature: float = 1.0,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    compile_backend: str | None = None,
) -> TokenLogprobs:
    """Same contract as `asyncrl.kernels.logprobs.token_logprobs`, with a closed-form chunked backward.

    Saved for the backward: the inputs plus two [T] vectors. Peak extra memory: one chunk of
    [C, V] logits and a few [C, V] temporaries, plus the weight gradient accumulator.
    `compile_backend` (e.g. "inductor") compiles the chunk bodies; None runs them eagerly.
    """
    check_temperature(temperature)
    check_chunk_size(chunk_size)
    if hidden_TD.shape[:-1] != targets_T.shape:
        raise ValueError(f"hidden {tuple(hidden_TD.shape)} does not match targets {tuple(targets_T.shape)}")
    logp_T, entropy_T = _FusedLinearLogprobs.apply(
        hidden_TD.reshape(-1, hidden_TD.shape[-1]),
        weight_VD,
        bias_V,
        targets_T.reshape(-1),
        float(temperature),
        int(chunk_size),
        compile_backend,
    )
    return TokenLogprobs(logp_T.reshape(targets_T.shape), entropy_T.reshape(targets_T.shape))
