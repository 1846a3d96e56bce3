"""`PolicyLM` (the learner's forward) and the distillation teacher's scores: parity with the
unchunked references (values and gradients), and, by peak tensor memory, that neither ever
allocates a micro-batch's full-vocabulary logits."""

from __future__ import annotations

import pytest
import torch

from asyncrl.benchmarks.learner import tensor_peak
from asyncrl.generators.opd import _scores_from_logits, teacher_logprobs
from asyncrl.kernels.logprobs import causal_lm_logprobs
from asyncrl.models.policy import PolicyLM
from tests.support.logprob_reference import causal_lm_position_logprobs

transformers = pytest.importorskip("transformers")

TOLERANCES = {torch.float64: 1e-10, torch.float32: 2e-5}


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def make_lm(*, vocab=37, hidden=16, layers=2, bias=False, dtype=torch.float32, seed=0):
    """A small Qwen2 model; with `bias`, its LM head has a bias (the logits include it)."""
    config = transformers.Qwen2Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    lm = transformers.Qwen2ForCausalLM(config)
    if bias:
        lm.lm_head = torch.nn.Linear(hidden, vocab, bias=True)
        torch.nn.init.normal_(lm.lm_head.bias, std=1.0)
    return lm.to(dtype)


def _ids(vocab, shape, seed=1):
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(seed))


def _values_and_grads(lm, out_logp, out_entropy=None, seed=2):
    """The outputs and the gradient of a random linear objective of them, for every parameter."""
    gen = torch.Generator().manual_seed(seed)
    objective = (out_logp * torch.randn(out_logp.shape, generator=gen, dtype=out_logp.dtype)).sum()
    if out_entropy is not None:
        objective = objective + (out_entropy * torch.randn(out_entropy.shape, generator=gen)).sum()
    params = [p for p in lm.parameters() if p.requires_grad]
    grads = torch.autograd.grad(objective, params, allow_unused=True)
    values = [out_logp.detach()] + ([] if out_entropy is None else [out_entropy.detach()])
    return values + [torch.zeros_like(p) if g is None else g for p, g in zip(params, grads, strict=True)]


def _assert_close(got, expected, tol):
    for g, e in zip(got, expected, strict=True):
        assert g.dtype == e.dtype and g.shape == e.shape
        scale = max(1.0, float(e.abs().max()))
        assert float((g - e).abs().max()) <= tol * scale


# ----------------------------------------------------------------------------- parity
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize(
    ("chunk_size", "temperature", "top_p", "bias"),
    [(4, 1.0, 1.0, True), (7, 0.7, 1.0, False), (5, 0.8, 0.9, True), (64, 1.3, 0.7, False)],
)
def test_policy_logprobs_equal_the_full_logits_reference(dtype, chunk_size, temperature, top_p, bias):
    """2 x 10 inputs = 18 predicted tokens: chunks of 4, 5 and 7 leave a short last chunk."""
    lm = make_lm(bias=bias, dtype=dtype)
    ids = _ids(37, (2, 10))
    ref = causal_lm_logprobs(lm, ids, temperature=temperature, top_p=top_p)
    expected = _values_and_grads(lm, ref.logp, ref.entropy)
    out = PolicyLM(lm, chunk_size=chunk_size)(ids, temperature=temperature, top_p=top_p)
    got = _values_and_grads(lm, out.logp, out.entropy)
    assert out.logp.shape == ids.shape and bool((out.logp[:, 0] == 0).all())
    _assert_close(got, expected, TOLERANCES[dtype])


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize(
    ("chunk_size", "temperature", "bias"), [(5, 0.8, True), (3, 1.0, False), (64, 1.2, True)]
)
def test_policy_candidates_equal_the_position_reference(dtype, chunk_size, temperature, bias):
    lm = make_lm(bias=bias, dtype=dtype)
    ids = _ids(37, (2, 10))
    cands = _ids(37, (2, 10, 3), seed=5)
    cands[..., 0] = ids  # column 0 holds the sampled token, as in the OPD cache
    ref = causal_lm_position_logprobs(lm, ids, cands, temperature=temperature)
    expected = _values_and_grads(lm, ref)
    out = PolicyLM(lm, chunk_size=chunk_size)(ids, temperature=temperature, candidates_BLN=cands)
    _assert_close(_values_and_grads(lm, out), expected, TOLERANCES[dtype])
    # Column 0 is the sampled token's log-prob, the same number the token path gives.
    tokens = PolicyLM(lm, chunk_size=chunk_size)(ids, temperature=temperature).logp
    torch.testing.assert_close(out[..., 0], tokens, rtol=0, atol=TOLERANCES[dtype])


def test_policy_no_grad_bf16_and_state_dict_names():
    lm = make_lm()
    policy = PolicyLM(lm, chunk_size=4)
    ids = _ids(37, (3, 6))
    with torch.no_grad():
        plain = policy(ids)
    assert not plain.logp.requires_grad
    torch.testing.assert_close(plain.logp, causal_lm_logprobs(lm, ids).logp.detach(), rtol=0, atol=2e-5)
    # The checkpoint's names stay the model's (what is published and saved).
    assert set(policy.lm.state_dict()) == set(lm.state_dict())
    policy.to(torch.bfloat16)
    out = policy(ids)
    assert out.logp.dtype == torch.float32  # reductions over the vocabulary in float32
    torch.testing.assert_close(out.logp, plain.logp, rtol=0, atol=0.15)


def test_policy_rejects_what_it_cannot_compute():
    lm = make_lm()
    ids = _ids(37, (1, 4))
    with pytest.raises(ValueError, match="top_p"):
        PolicyLM(lm)(ids, top_p=0.9, candidates_BLN=ids[..., None])
    with pytest.raises(ValueError, match="chunk_size"):
        PolicyLM(lm, chunk_size=0)
    lm.config.final_logit_softcapping = 30.0  # Qwen2 ignores it; the check must not
    with pytest.raises(ValueError, match="final_logit_softcapping"):
        PolicyLM(lm)


# ----------------------------------------------------------------------------- memory
VOCAB = 32_000
CHUNK = 16


@pytest.fixture(scope="module")
def wide_lm():
    return make_lm(vocab=VOCAB, layers=1)


def _step_memory(step) -> tuple[int, int]:
    """(peak live bytes, largest tensor) of tensors allocated by one forward + backward."""
    with tensor_peak() as mode:
        step().backward()
    return mode.peak_bytes, mode.largest_bytes


@pytest.mark.parametrize("variant", ["tokens", "nucleus", "candidates"])
def test_a_training_step_never_allocates_full_vocabulary_logits(wide_lm, variant):
    """A micro-batch of 512 predicted tokens (32 chunks) at vocabulary 32k: float32 [tokens, V]
    logits would be 65.5 MB; the largest tensor of PolicyLM's forward + backward stays a few
    [chunk, V] buffers (sorting for the nucleus keeps int64 indices), and so does the peak. The
    unchunked reference allocates the full logits, so the bound can fail."""
    ids = _ids(VOCAB, (2, 257))
    tokens = 2 * 256
    logits_bytes = tokens * VOCAB * 4
    chunk_bytes = CHUNK * VOCAB * 4
    policy = PolicyLM(wide_lm, chunk_size=CHUNK)
    steps = {
        "tokens": lambda: sum(x.sum() for x in policy(ids, temperature=0.9)),  # logp and entropy
        "nucleus": lambda: policy(ids, top_p=0.9).logp.sum(),
        "candidates": lambda: policy(ids, candidates_BLN=_ids(VOCAB, (2, 257, 4))).sum(),
    }
    wide_lm.zero_grad(set_to_none=True)
    peak, largest = _step_memory(steps[variant])
    assert largest <= 2 * chunk_bytes < logits_bytes
    # Weight gradients (2 x 2 MB) and decoder activations come on top of the chunks.
    assert peak < logits_bytes / 2, (peak, largest)
    wide_lm.zero_grad(set_to_none=True)
    ref_peak, ref_largest = _step_memory(lambda: causal_lm_logprobs(wide_lm, ids).logp.sum())
    assert ref_largest >= logits_bytes and ref_peak > 2 * logits_bytes
    wide_lm.zero_grad(set_to_none=True)


def test_peak_tracker_counts_live_tensors_only():
    """The measuring tool itself: a freed temporary leaves the live count, views and in-place ops
    allocate nothing, tensors from before are not counted."""
    before = torch.ones(1000)
    with tensor_peak() as mode:
        a = torch.zeros(1000)  # 4000 bytes
        b = a.view(10, 100)
        a.add_(1)
        del a, b
        c = before * 2  # the first buffer is gone by now
        d = torch.zeros(500)
    # c and d are live together (6000 bytes); a, freed before them, is not added (10000).
    assert (mode.peak_bytes, mode.largest_bytes, mode.live_bytes) == (6000, 4000, 6000)
    assert c.shape == (1000,) and d.shape == (500,)


# ----------------------------------------------------------------------------- the teacher
PROMPTS = [[1, 5, 6, 14, 7], [1, 9, 14], [1, 4, 17, 3, 3, 8, 2], [1, 8]]


def _teacher_cache(vocab, lengths=(6, 2, 9, 4), num=3, seed=4):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n, num), generator=gen) for n in lengths]


@pytest.mark.parametrize(
    ("chunk_size", "batch_rows", "budget_bytes"), [(1, 32, 1 << 30), (3, 2, 1 << 30), (1024, 3, 1)]
)
def test_teacher_scores_equal_its_full_logits(chunk_size, batch_rows, budget_bytes):
    """The chunked teacher gives the numbers of the full-logits path (the one kept for teachers
    with soft-capped logits), to float rounding: only matmul blocking differs."""
    teacher = make_lm(vocab=41, seed=3).eval()
    cache = _teacher_cache(41)
    got = teacher_logprobs(
        teacher,
        PROMPTS,
        cache,
        pad_token_id=0,
        chunk_size=chunk_size,
        batch_rows=batch_rows,
        budget_bytes=budget_bytes,
    )
    expected = [s.logprobs for s in _scores_from_logits(teacher, PROMPTS, cache, 0, 1.0, 32, 1 << 30)]
    for g, e, ids_TN in zip(got, expected, cache, strict=True):
        assert g.dtype == torch.float32 and g.shape == ids_TN.shape and not g.requires_grad
        torch.testing.assert_close(g, e, rtol=0, atol=2e-6)


def test_teacher_with_soft_capped_logits_is_scored_from_its_logits():
    teacher = make_lm(vocab=41, seed=3).eval()
    teacher.config.final_logit_softcapping = 30.0  # Qwen2 ignores it: only the path changes
    cache = _teacher_cache(41)
    got = teacher_logprobs(teacher, PROMPTS, cache, pad_token_id=0)
    expected = [s.logprobs for s in _scores_from_logits(teacher, PROMPTS, cache, 0, 1.0, 32, 1 << 30)]
    for g, e in zip(got, expected, strict=True):
        assert torch.equal(g, e)


def test_teacher_never_allocates_full_vocabulary_logits(wide_lm):
    """4 completions of 64 tokens at vocabulary 32k: the old path's [B, T + 1, V] float32 tail
    logits were 33 MB (and their log_softmax as much again); chunked, one chunk of 16 tokens."""
    cache = _teacher_cache(VOCAB, lengths=(64, 64, 40, 64), num=2)
    tail_logits_bytes = 4 * 65 * VOCAB * 4
    with tensor_peak() as mode:
        teacher_logprobs(wide_lm, PROMPTS, cache, pad_token_id=0, chunk_size=CHUNK)
    assert mode.largest_bytes <= 2 * CHUNK * VOCAB * 4 < tail_logits_bytes
    with tensor_peak() as ref:
        _scores_from_logits(wide_lm, PROMPTS, cache, 0, 1.0, 32, 1 << 30)
    assert ref.largest_bytes >= tail_logits_bytes
