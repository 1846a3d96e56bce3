"""Per-token log-probs: plain reference vs independent torch references, fused kernel vs reference;
candidate log-probs (distillation) vs full log-softmax."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from asyncrl.kernels.fused_logprobs import fused_token_logprobs
from asyncrl.kernels.logprobs import (
    candidate_logprobs,
    causal_lm_logprobs,
    logprobs_from_logits,
    token_logprobs,
)
from tests.support.logprob_reference import causal_lm_position_logprobs

TOLERANCES = {torch.float64: 1e-12, torch.float32: 2e-5}


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _inputs(dtype, *, num_tokens=23, dim=8, vocab=41, bias=True, seed=0):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(num_tokens, dim, generator=gen, dtype=torch.float64).to(dtype).requires_grad_()
    weight = torch.randn(vocab, dim, generator=gen, dtype=torch.float64).to(dtype).requires_grad_()
    bias_V = (
        torch.randn(vocab, generator=gen, dtype=torch.float64).to(dtype).requires_grad_() if bias else None
    )
    targets = torch.randint(0, vocab, (num_tokens,), generator=gen)
    # Upstream gradients for logp and entropy, so both backward paths are exercised.
    grad_logp = torch.randn(num_tokens, generator=gen, dtype=torch.float64)
    grad_entropy = torch.randn(num_tokens, generator=gen, dtype=torch.float64)
    return hidden, weight, bias_V, targets, grad_logp, grad_entropy


def _values_and_grads(fn, hidden, weight, bias_V, targets, grad_logp, grad_entropy, *, use_entropy=True):
    out = fn(hidden, weight, bias_V, targets)
    objective = (out.logp * grad_logp.to(out.logp.dtype)).sum()
    if use_entropy:
        objective = objective + (out.entropy * grad_entropy.to(out.entropy.dtype)).sum()
    leaves = [t for t in (hidden, weight, bias_V) if t is not None and t.requires_grad]
    grads = torch.autograd.grad(objective, leaves)
    return [out.logp.detach(), out.entropy.detach(), *grads]


def _assert_all_close(got, expected, tol):
    for g, e in zip(got, expected, strict=True):
        scale = max(1.0, float(e.abs().max()))
        assert float((g - e).abs().max()) <= tol * scale


def _full(temperature):
    return lambda h, w, b, t: logprobs_from_logits(F.linear(h, w, b), t, temperature=temperature)


def _chunked(temperature, chunk_size):
    return lambda h, w, b, t: token_logprobs(
        h, w, t, bias_V=b, temperature=temperature, chunk_size=chunk_size
    )


def _fused(temperature, chunk_size, backend=None):
    return lambda h, w, b, t: fused_token_logprobs(
        h, w, t, bias_V=b, temperature=temperature, chunk_size=chunk_size, compile_backend=backend
    )


# -- the plain reference against independent torch references -----------------------------------


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_from_logits_matches_cross_entropy_and_categorical(temperature):
    gen = torch.Generator().manual_seed(0)
    logits = 3 * torch.randn(2, 5, 11, generator=gen, dtype=torch.float64)
    targets = torch.randint(0, 11, (2, 5), generator=gen)
    out = logprobs_from_logits(logits, targets, temperature=temperature)
    scaled = logits / temperature
    expected_logp = -F.cross_entropy(scaled.reshape(-1, 11), targets.reshape(-1), reduction="none").reshape(
        2, 5
    )
    expected_entropy = torch.distributions.Categorical(logits=scaled).entropy()
    torch.testing.assert_close(out.logp, expected_logp, rtol=0, atol=1e-13)
    torch.testing.assert_close(out.entropy, expected_entropy, rtol=0, atol=1e-13)


def test_hand_computed_uniform_case():
    """Equal logits over V = 4: logp = -log 4 for any target, entropy = log 4."""
    out = logprobs_from_logits(torch.zeros(3, 4), torch.tensor([0, 2, 3]))
    torch.testing.assert_close(out.logp, torch.full((3,), -torch.log(torch.tensor(4.0)).item()))
    torch.testing.assert_close(out.entropy, torch.full((3,), torch.log(torch.tensor(4.0)).item()))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("chunk_size", [1, 5, 23, 64])
def test_chunked_reference_equals_full_logits(dtype, chunk_size):
    inputs = _inputs(dtype)
    expected = _values_and_grads(_full(0.8), *inputs)
    got = _values_and_grads(_chunked(0.8, chunk_size), *inputs)
    _assert_all_close(got, expected, TOLERANCES[dtype])


def test_chunked_reference_keeps_no_full_logits_for_backward():
    """The memory claim, checked structurally: nothing of T x V elements is saved for the backward."""
    hidden, weight, bias_V, targets, _, _ = _inputs(torch.float32, num_tokens=64, vocab=97)
    for fn in (_chunked(1.0, 8), _fused(1.0, 8)):
        saved = []

        def pack(t, saved=saved):
            saved.append(t.numel())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = fn(hidden, weight, bias_V, targets)
        (out.logp.sum() + out.entropy.sum()).backward()
        assert max(saved) <= max(weight.numel(), 8 * 97)
    # The naive path does save [T, V] tensors: the check above can fail.
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
        _full(1.0)(hidden, weight, bias_V, targets)
    assert max(saved) >= 64 * 97


def test_batched_leading_dims_and_no_grad():
    hidden, weight, bias_V, targets, _, _ = _inputs(torch.float64, num_tokens=12)
    flat = token_logprobs(hidden, weight, targets, bias_V=bias_V, chunk_size=5)
    batched = token_logprobs(
        hidden.reshape(3, 4, -1), weight, targets.reshape(3, 4), bias_V=bias_V, chunk_size=5
    )
    torch.testing.assert_close(batched.logp, flat.logp.reshape(3, 4), rtol=0, atol=0)
    with torch.no_grad():
        plain = token_logprobs(hidden, weight, targets, bias_V=bias_V, chunk_size=5)
    assert not plain.logp.requires_grad
    torch.testing.assert_close(plain.logp, flat.logp.detach(), rtol=0, atol=0)


def test_bf16_inputs_accumulate_in_float32():
    hidden, weight, bias_V, targets, _, _ = _inputs(torch.float32, bias=False)
    reference = token_logprobs(hidden, weight, targets)
    for fn in (token_logprobs, fused_token_logprobs):
        out = fn(hidden.bfloat16(), weight.bfloat16(), targets, chunk_size=7)
        assert out.logp.dtype == torch.float32 and out.entropy.dtype == torch.float32
        # Only the bf16 rounding of the logits remains (|logits| ~ 3, bf16 has 8 mantissa bits).
        torch.testing.assert_close(out.logp, reference.logp, rtol=0, atol=0.1)
        out.logp.sum().backward()


def test_masked_vocab_entries_give_finite_values_and_gradients():
    """A -inf bias (a banned token) must give p = 0 there, not nan from 0 * -inf."""
    hidden, weight, _, targets, grad_logp, grad_entropy = _inputs(torch.float64, vocab=10)
    bias_V = torch.zeros(10, dtype=torch.float64)
    bias_V[3] = float("-inf")
    targets = torch.where(targets == 3, 4, targets)
    expected = _values_and_grads(_chunked(1.0, 4), hidden, weight, bias_V, targets, grad_logp, grad_entropy)
    got = _values_and_grads(_fused(1.0, 4), hidden, weight, bias_V, targets, grad_logp, grad_entropy)
    for tensors in (expected, got):
        assert all(torch.isfinite(t).all() for t in tensors)
    _assert_all_close(got, expected, 1e-12)


def test_input_validation():
    hidden, weight, _, targets, _, _ = _inputs(torch.float32, bias=False)
    for fn in (token_logprobs, fused_token_logprobs):
        with pytest.raises(ValueError, match="temperature"):
            fn(hidden, weight, targets, temperature=0.0)
        with pytest.raises(ValueError, match="chunk_size"):
            fn(hidden, weight, targets, chunk_size=0)
        with pytest.raises(ValueError, match="does not match"):
            fn(hidden, weight, targets[:-1])


def test_empty_input():
    weight = torch.randn(7, 4, requires_grad=True)
    for fn in (token_logprobs, fused_token_logprobs):
        out = fn(torch.zeros(0, 4), weight, torch.zeros(0, dtype=torch.long))
        assert out.logp.shape == (0,) and out.entropy.shape == (0,)


# -- fused kernel parity ------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize(
    ("chunk_size", "temperature", "bias"), [(4, 1.0, True), (23, 0.6, False), (7, 1.3, True)]
)
@pytest.mark.parametrize("use_entropy", [True, False])
def test_fused_matches_reference(dtype, chunk_size, temperature, bias, use_entropy):
    inputs = _inputs(dtype, bias=bias)
    expected = _values_and_grads(_chunked(temperature, 5), *inputs, use_entropy=use_entropy)
    got = _values_and_grads(_fused(temperature, chunk_size), *inputs, use_entropy=use_entropy)
    _assert_all_close(got, expected, TOLERANCES[dtype])


def test_fused_only_hidden_requires_grad():
    hidden, weight, bias_V, targets, grad_logp, _ = _inputs(torch.float64)
    weight = weight.detach()
    out = fused_token_logprobs(hidden, weight, targets, bias_V=bias_V.detach(), chunk_size=6)
    (grad_fused,) = torch.autograd.grad((out.logp * grad_logp).sum(), hidden)
    ref = token_logprobs(hidden, weight, targets, bias_V=bias_V.detach(), chunk_size=6)
    (grad_ref,) = torch.autograd.grad((ref.logp * grad_logp).sum(), hidden)
    torch.testing.assert_close(grad_fused, grad_ref, rtol=0, atol=1e-12)


def test_compile_failure_falls_back_to_eager():
    inputs = _inputs(torch.float64)
    expected = _values_and_grads(_fused(1.0, 6), *inputs)
    with pytest.warns(RuntimeWarning, match="running the fused chunk eagerly"):
        got = _values_and_grads(_fused(1.0, 6, backend="no-such-backend"), *inputs)
    _assert_all_close(got, expected, 0.0)


@pytest.mark.skipif(
    os.environ.get("ASYNCRL_TEST_INDUCTOR") != "1",
    reason="inductor compiles C++ for ~20 s on CPU; set ASYNCRL_TEST_INDUCTOR=1 to run",
)
@pytest.mark.parametrize("backend", ["inductor"])
def test_compiled_fused_matches_reference(backend):
    inputs = _inputs(torch.float32)
    expected = _values_and_grads(_chunked(0.9, 5), *inputs)
    got = _values_and_grads(_fused(0.9, 5, backend=backend), *inputs)
    _assert_all_close(got, expected, TOLERANCES[torch.float32])


# -- causal LM wrapper on a real transformers model ----------------------------------------------


@pytest.fixture(scope="module")
def tiny_llama():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=32,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def test_causal_lm_logprobs_chunked_matches_full_logits(tiny_llama):
    input_ids = torch.randint(0, 32, (2, 9), generator=torch.Generator().manual_seed(0))
    full = causal_lm_logprobs(tiny_llama, input_ids, temperature=0.9)
    chunked = causal_lm_logprobs(tiny_llama, input_ids, temperature=0.9, chunk_size=4)
    assert full.logp.shape == (2, 9) and bool((full.logp[:, 0] == 0).all())
    torch.testing.assert_close(chunked.logp, full.logp, rtol=0, atol=1e-5)
    torch.testing.assert_close(chunked.entropy, full.entropy, rtol=0, atol=1e-5)
    # Position t holds log pi(x_t | x_<t).
    logits = tiny_llama(input_ids=input_ids).logits
    expected = torch.log_softmax(logits[0, 2] / 0.9, dim=-1)[input_ids[0, 3]]
    torch.testing.assert_close(full.logp[0, 3], expected, rtol=0, atol=1e-5)


def test_causal_lm_logprobs_rejects_softcapped_logits(tiny_llama):
    tiny_llama.config.final_logit_softcapping = 30.0
    try:
        with pytest.raises(ValueError, match="final_logit_softcapping"):
            causal_lm_logprobs(tiny_llama, torch.zeros(1, 3, dtype=torch.long), chunk_size=2)
    finally:
        tiny_llama.config.final_logit_softcapping = None


@pytest.mark.parametrize("chunk_size", [None, 3])
@pytest.mark.parametrize("top_p", [0.5, 0.9])
def test_learner_logprobs_over_the_nucleus_match_the_generators_on_policy(tiny_model_dir, top_p, chunk_size):
    """With top_p < 1 the generator records nucleus log-probs; the learner's recomputation over its
    own nucleus gives the same numbers on-policy (ratio 1), the plain softmax does not."""
    from transformers import AutoModelForCausalLM

    from asyncrl.models.sampling import generate

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    prompts = [[1, 5, 6, 14, 7], [1, 9, 14, 11, 17]]
    out = generate(
        model,
        prompts,
        max_new_tokens=6,
        temperature=0.8,
        top_p=top_p,
        eos_token_id=2,
        pad_token_id=0,
        rng=torch.Generator().manual_seed(1),
    )
    for prompt, ids, behavior in zip(prompts, out.completion_ids, out.logprobs, strict=True):
        seq = torch.tensor([prompt + list(ids)])
        n = len(ids)
        ours = causal_lm_logprobs(model, seq, temperature=0.8, top_p=top_p, chunk_size=chunk_size).logp[
            0, -n:
        ]
        full = causal_lm_logprobs(model, seq, temperature=0.8, chunk_size=chunk_size).logp[0, -n:]
        torch.testing.assert_close(ours, torch.tensor(behavior), rtol=0, atol=1e-5)
        assert bool((full < ours - 1e-3).all())  # the full softmax puts less mass on each token


def test_nucleus_logprob_gradient_is_finite_for_a_token_outside_the_nucleus():
    logits = torch.tensor([[4.0, 3.0, -2.0, -5.0]], requires_grad=True)
    out = logprobs_from_logits(logits, torch.tensor([3]), top_p=0.5)  # token 3 is far outside
    out.logp.sum().backward()
    # Renormalised over {0, 3}: the target is always counted in, so the value stays finite.
    expected = -5.0 - torch.logsumexp(torch.tensor([4.0, -5.0]), 0)
    assert float(out.logp.detach()) == pytest.approx(float(expected), abs=1e-6)
    assert bool(torch.isfinite(logits.grad).all()) and float(logits.grad[0, 1]) == 0.0


# -- candidate log-probs (distillation's N cached tokens) -----------------------------------------


def _candidate_inputs(dtype, *, num_tokens=23, num_candidates=3, vocab=41, bias=True, seed=1):
    hidden, weight, bias_V, _, _, _ = _inputs(dtype, num_tokens=num_tokens, vocab=vocab, bias=bias, seed=seed)
    gen = torch.Generator().manual_seed(seed + 100)
    ids_TN = torch.randint(0, vocab, (num_tokens, num_candidates), generator=gen)
    grad_TN = torch.randn(num_tokens, num_candidates, generator=gen, dtype=torch.float64)
    return hidden, weight, bias_V, ids_TN, grad_TN


def _candidate_values_and_grads(fn, hidden, weight, bias_V, ids_TN, grad_TN):
    out = fn(hidden, weight, bias_V, ids_TN)
    leaves = [t for t in (hidden, weight, bias_V) if t is not None]
    grads = torch.autograd.grad((out * grad_TN.to(out.dtype)).sum(), leaves)
    return [out.detach(), *grads]


def _candidates_full(temperature):
    def fn(h, w, b, ids):
        z = F.linear(h, w, b).to(torch.promote_types(h.dtype, torch.float32)) / temperature
        return torch.log_softmax(z, dim=-1).gather(-1, ids)

    return fn


def _candidates_chunked(temperature, chunk_size):
    return lambda h, w, b, ids: candidate_logprobs(
        h, w, ids, bias_V=b, temperature=temperature, chunk_size=chunk_size
    )


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize(
    ("chunk_size", "temperature", "bias"), [(1, 1.0, True), (5, 0.7, True), (7, 1.3, False), (64, 0.9, True)]
)
def test_candidate_logprobs_equal_full_log_softmax(dtype, chunk_size, temperature, bias):
    """23 tokens: chunk sizes 5 and 7 leave a short last chunk, 64 is one chunk."""
    inputs = _candidate_inputs(dtype, bias=bias)
    expected = _candidate_values_and_grads(_candidates_full(temperature), *inputs)
    got = _candidate_values_and_grads(_candidates_chunked(temperature, chunk_size), *inputs)
    _assert_all_close(got, expected, TOLERANCES[dtype])
    assert got[0].dtype == dtype


def test_candidate_logprobs_hand_computed_and_column_0_is_the_token_logprob():
    """Equal logits over V = 4 give -log 4 for every candidate; with the sampled token in column
    0, the candidate log-prob there equals `token_logprobs` at top_p = 1."""
    out = candidate_logprobs(torch.zeros(2, 3), torch.zeros(4, 3), torch.tensor([[0, 3], [2, 2]]))
    torch.testing.assert_close(out, torch.full((2, 2), -torch.log(torch.tensor(4.0)).item()))
    hidden, weight, bias_V, ids_TN, _ = _candidate_inputs(torch.float64)
    tokens = token_logprobs(hidden, weight, ids_TN[:, 0], bias_V=bias_V, temperature=0.8, chunk_size=4)
    cands = candidate_logprobs(hidden, weight, ids_TN, bias_V=bias_V, temperature=0.8, chunk_size=6)
    torch.testing.assert_close(cands[:, 0], tokens.logp, rtol=0, atol=1e-12)


def test_candidate_logprobs_leading_dims_no_grad_and_empty():
    hidden, weight, bias_V, ids_TN, _ = _candidate_inputs(torch.float64, num_tokens=12)
    flat = candidate_logprobs(hidden, weight, ids_TN, bias_V=bias_V, chunk_size=5)
    batched = candidate_logprobs(
        hidden.reshape(3, 4, -1), weight, ids_TN.reshape(3, 4, -1), bias_V=bias_V, chunk_size=5
    )
    assert batched.shape == (3, 4, 3)
    torch.testing.assert_close(batched, flat.reshape(3, 4, 3), rtol=0, atol=0)
    with torch.no_grad():
        plain = candidate_logprobs(hidden, weight, ids_TN, bias_V=bias_V, chunk_size=5)
    assert not plain.requires_grad
    torch.testing.assert_close(plain, flat.detach(), rtol=0, atol=0)
    empty = candidate_logprobs(
        torch.zeros(2, 0, 4), torch.randn(7, 4), torch.zeros(2, 0, 3, dtype=torch.long)
    )
    assert empty.shape == (2, 0, 3)


def test_candidate_logprobs_bf16_accumulate_in_float32():
    hidden, weight, _, ids_TN, _ = _candidate_inputs(torch.float32, bias=False)
    reference = candidate_logprobs(hidden, weight, ids_TN)
    out = candidate_logprobs(hidden.bfloat16(), weight.bfloat16(), ids_TN, chunk_size=7)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, reference, rtol=0, atol=0.1)  # bf16 rounding of the logits only
    out.sum().backward()


def test_candidate_logprobs_input_validation():
    hidden, weight, _, ids_TN, _ = _candidate_inputs(torch.float32, bias=False)
    with pytest.raises(ValueError, match="temperature"):
        candidate_logprobs(hidden, weight, ids_TN, temperature=0.0)
    with pytest.raises(ValueError, match="chunk_size"):
        candidate_logprobs(hidden, weight, ids_TN, chunk_size=0)
    with pytest.raises(ValueError, match="does not match"):
        candidate_logprobs(hidden, weight, ids_TN[:-1])


def test_candidate_logprobs_keep_no_full_logits_for_backward():
    """Nothing of T x V elements is saved for the backward (the full path does save one)."""
    hidden, weight, bias_V, ids_TN, _ = _candidate_inputs(torch.float32, num_tokens=64, vocab=97)
    for fn, bound in (
        (_candidates_chunked(1.0, 8), max(weight.numel(), 8 * 97)),
        (_candidates_full(1.0), None),
    ):
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(
            lambda t, saved=saved: saved.append(t.numel()) or t, lambda t: t
        ):
            out = fn(hidden, weight, bias_V, ids_TN)
        out.sum().backward()
        if bound is None:
            assert max(saved) >= 64 * 97
        else:
            assert max(saved) <= bound


def test_causal_lm_position_logprobs_match_candidate_logprobs_on_hidden_states(tiny_llama):
    """The unchunked OPD reference and the chunked kernel on the decoder's hidden states agree."""
    gen = torch.Generator().manual_seed(3)
    input_ids = torch.randint(0, 32, (2, 9), generator=gen)
    ids_BLN = torch.randint(0, 32, (2, 9, 3), generator=gen)
    reference = causal_lm_position_logprobs(tiny_llama, input_ids, ids_BLN, temperature=0.8)
    hidden = tiny_llama.get_decoder()(input_ids=input_ids).last_hidden_state[:, :-1]
    head = tiny_llama.get_output_embeddings()
    chunked = candidate_logprobs(hidden, head.weight, ids_BLN[:, 1:], temperature=0.8, chunk_size=5)
    assert bool((reference[:, 0] == 0).all())
    torch.testing.assert_close(reference[:, 1:], chunked, rtol=0, atol=1e-6)
