"""Per-trajectory squared gradient norms from one batched backward (`asyncrl/learner/ghost.py`)
equal the norms of per-trajectory backwards to 1e-9 in float64: a tied-embedding Llama and an
untied Qwen2 with attention biases, rows of mixed lengths (right padding), a temperature, and
per-token loss coefficients that vary (as importance weights and length normalisation make them)."""

from __future__ import annotations

import pytest
import torch

from asyncrl.learner.ghost import GhostNorms, unsupported
from asyncrl.models.policy import PolicyLM
from tests.unit.test_shared_prefix import make_lm
from tests.unit.test_trainer import _model

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TEMPERATURE = 0.7


def _rows(vocab: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([3, 9, 5, 12, 2, 7])
    ids = torch.zeros((len(lengths), int(lengths.max())), dtype=torch.long)
    coeff = torch.zeros(ids.shape, dtype=torch.float64)
    for b, n in enumerate(lengths.tolist()):
        ids[b, :n] = torch.randint(1, vocab, (n,), generator=gen)
        coeff[b, 1:n] = torch.rand(n - 1, generator=gen, dtype=torch.float64) * 2 - 0.5
    return ids, coeff


def _reference(policy: PolicyLM, ids, coeff) -> torch.Tensor:
    params = [p for p in policy.parameters() if p.requires_grad]
    out = []
    for b in range(ids.shape[0]):
        logp = policy(ids[b : b + 1], temperature=TEMPERATURE).logp
        grads = torch.autograd.grad((logp * coeff[b : b + 1]).sum(), params, allow_unused=True)
        out.append(sum(float(g.double().square().sum()) for g in grads if g is not None))
    return torch.tensor(out, dtype=torch.float64)


@pytest.mark.parametrize("which", ["llama_tied", "qwen2_untied_bias"])
def test_ghost_norms_equal_per_trajectory_backwards(tiny_model_dir, which):
    lm = _model(tiny_model_dir) if which == "llama_tied" else make_lm(kv_heads=1)
    assert (lm.get_input_embeddings().weight is lm.get_output_embeddings().weight) == (which == "llama_tied")
    assert unsupported(lm, top_p=1.0) is None
    policy = PolicyLM(lm, share_prefixes=False)
    ids, coeff = _rows(lm.config.vocab_size)
    with GhostNorms(lm, temperature=TEMPERATURE) as ghost:
        logp = policy(ids, temperature=TEMPERATURE).logp
        got = ghost.backward(logp, coeff)
    assert all(p.grad is None for p in policy.parameters())  # no parameter gradient was formed
    ref = _reference(policy, ids, coeff)
    assert (ref > 0).all()
    torch.testing.assert_close(got, ref, rtol=1e-9, atol=0)


def test_what_the_ghost_norms_do_not_cover_is_named(tiny_model_dir):
    lm = _model(tiny_model_dir)
    assert "top_p" in unsupported(lm, top_p=0.9)
    lm.model.extra = torch.nn.Conv1d(2, 2, 1).double()
    assert "extra" in unsupported(lm, top_p=1.0)


@pytest.mark.parametrize("which", ["llama_tied", "qwen2_untied_bias"])
def test_kept_pieces_form_the_weighted_gradient(tiny_model_dir, which):
    """`grads(k)` from the one backward at +1 equals autograd's gradient of sum_b k_b l_b, for
    every parameter (k_b of both signs and 0, as advantages are)."""
    lm = _model(tiny_model_dir) if which == "llama_tied" else make_lm(kv_heads=1)
    policy = PolicyLM(lm, share_prefixes=False)
    ids, coeff = _rows(lm.config.vocab_size, seed=3)
    k = torch.tensor([0.5, -1.25, 0.0, 2.0, -0.3, 1.0], dtype=torch.float64)
    with GhostNorms(lm, temperature=TEMPERATURE, capture=True) as ghost:
        logp = policy(ids, temperature=TEMPERATURE).logp
    norms = ghost.backward(logp, coeff)
    torch.testing.assert_close(norms, _reference(policy, ids, coeff), rtol=1e-9, atol=0)
    got = ghost.grads(k)
    params = [p for p in policy.parameters() if p.requires_grad]
    logp = policy(ids, temperature=TEMPERATURE).logp
    expected = torch.autograd.grad((logp * coeff * k[:, None]).sum(), params)
    assert set(got) == set(params)
    for p, e in zip(params, expected, strict=True):
        torch.testing.assert_close(got[p], e, rtol=0, atol=1e-12)


def test_hooks_act_only_for_the_thread_that_activated_them(tiny_model_dir):
    """Two collectors on one model: each sees only the forward run under its own `active`."""
    import threading

    lm = _model(tiny_model_dir)
    policy = PolicyLM(lm, share_prefixes=False)
    ids, coeff = _rows(lm.config.vocab_size)
    halves = (slice(0, 3), slice(3, 6))
    ghosts = [GhostNorms(lm, temperature=TEMPERATURE) for _ in halves]
    for g in ghosts:
        g.__enter__()
    logps = [None, None]

    def forward(i: int) -> None:
        with ghosts[i].active():
            logps[i] = policy(ids[halves[i]], temperature=TEMPERATURE).logp

    threads = [threading.Thread(target=forward, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for g in ghosts:
        g.__exit__(None, None, None)
    got = torch.cat([g.backward(lp, coeff[h]) for g, lp, h in zip(ghosts, logps, halves, strict=True)])
    torch.testing.assert_close(got, _reference(policy, ids, coeff), rtol=1e-9, atol=0)
