"""KL estimators: values, gradients, and the exact expected-gradient table of ALGORITHMS.md 7.6.

Expectations over a ~ pi_theta are computed exactly by enumerating a small vocabulary and weighting
each token's loss by sg(pi_theta(a)), so these tests are deterministic.
"""

from __future__ import annotations

import math

import pytest
import torch

from asyncrl.learner.advantages import k1_reward_to_go
from asyncrl.learner.kl import KL_ESTIMATORS, kl_loss, kl_per_token
from asyncrl.learner.losses import clipped_surrogate

F64 = torch.float64
LN2 = math.log(2.0)


@pytest.mark.parametrize(
    ("estimator", "value", "grad"),
    [
        ("k1", LN2, 1.0),
        ("k2", 0.5 * LN2**2, LN2),
        ("k3", 0.5 - 1.0 + LN2, 1.0 - 0.5),
        ("k1+", LN2, LN2),
        ("k3+", 0.5 - 1.0 + LN2, LN2),
    ],
)
def test_estimator_value_and_gradient(estimator, value, grad):
    logp = torch.tensor([[LN2 - 3.0]], dtype=F64, requires_grad=True)
    kl = kl_per_token(logp, torch.tensor([[-3.0]], dtype=F64), torch.tensor([[True]]), estimator=estimator)
    kl.sum().backward()
    assert kl.item() == pytest.approx(value, rel=1e-12)
    assert logp.grad.item() == pytest.approx(grad, rel=1e-12)


def test_k3_is_clamped_and_masked_positions_are_zero():
    logp = torch.tensor([[-40.0, float("nan")]], dtype=F64, requires_grad=True)
    logp_ref = torch.tensor([[0.0, float("inf")]], dtype=F64)
    kl = kl_per_token(logp, logp_ref, torch.tensor([[True, False]]), estimator="k3")
    kl.sum().backward()
    assert kl.tolist() == [[10.0, 0.0]]
    assert torch.isfinite(logp.grad).all()


def test_unknown_estimator():
    with pytest.raises(ValueError, match="k1, k2, k3"):
        kl_per_token(
            torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1, dtype=torch.bool), estimator="low_var_kl"
        )


def test_kl_loss_aggregates_weights_and_stats():
    logp = torch.tensor([[0.5, 0.0], [1.0, 9.0]], dtype=F64)
    mask = torch.tensor([[True, True], [True, False]])
    weight = torch.tensor([[2.0, 1.0], [1.0, float("inf")]], dtype=F64)
    loss, stats = kl_loss(
        logp, torch.zeros(2, 2, dtype=F64), mask, weight, estimator="k1", num_tokens_global=3
    )
    assert loss.item() == pytest.approx((2 * 0.5 + 0.0 + 1.0) / 3)
    assert stats.kl.item() == pytest.approx(0.5)
    assert stats.num_tokens.item() == 3


def _policy(seed: int, vocab: int):
    g = torch.Generator().manual_seed(seed)
    # Scale 0.5 keeps every k3 below its clamp (MAX_K3), where the identity of the table holds.
    logits = (0.5 * torch.randn(vocab, generator=g, dtype=F64)).requires_grad_(True)
    logp_ref = torch.log_softmax(0.5 * torch.randn(vocab, generator=g, dtype=F64), dim=0)
    return logits, logp_ref


def _exact_kl_grads(logits: torch.Tensor, logp_ref: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    logp = torch.log_softmax(logits, dim=0)
    reverse = (logp.exp() * (logp - logp_ref)).sum()
    forward = (logp_ref.exp() * (logp_ref - logp)).sum()
    return torch.autograd.grad(reverse, logits, retain_graph=True)[0], torch.autograd.grad(forward, logits)[0]


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("estimator", KL_ESTIMATORS)
def test_expected_gradient_table_on_policy(seed, estimator):
    """ALGORITHMS.md 7.6: k1 -> 0, k2/k1+/k3+ -> grad KL(pi||ref), k3 -> grad KL(ref||pi) (forward)."""
    logits, logp_ref = _policy(seed, vocab=5)
    grad_reverse, grad_forward = _exact_kl_grads(logits, logp_ref)
    logp_V1 = torch.log_softmax(logits, dim=0)[:, None]  # one single-token sequence per vocab item
    mask = torch.ones_like(logp_V1, dtype=torch.bool)
    loss, _ = kl_loss(
        logp_V1,
        logp_ref[:, None],
        mask,
        logp_V1.exp(),
        estimator=estimator,
        mode="seq-mean-token-sum",
        num_seqs_global=1,
    )
    (grad,) = torch.autograd.grad(loss, logits)
    expected = {"k1": torch.zeros_like(grad), "k3": grad_forward}.get(estimator, grad_reverse)
    torch.testing.assert_close(grad, expected, rtol=1e-10, atol=1e-12)
    assert not torch.allclose(grad_reverse, grad_forward, atol=1e-6)  # the table's distinction is real


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_k1_reward_to_go_gives_exact_sequence_kl_gradient(seed):
    """Two-token sequences from a tabular policy: k1 reward-to-go + score gradient = grad KL(pi(y)||ref(y)),
    while the token-local k1 reward (no reward-to-go) gives only a partial gradient."""
    vocab = 3
    g = torch.Generator().manual_seed(seed)
    logits0 = torch.randn(vocab, generator=g, dtype=F64).requires_grad_(True)
    logits1 = torch.randn(vocab, vocab, generator=g, dtype=F64).requires_grad_(True)  # row = first token
    ref0 = torch.log_softmax(torch.randn(vocab, generator=g, dtype=F64), dim=0)
    ref1 = torch.log_softmax(torch.randn(vocab, vocab, generator=g, dtype=F64), dim=1)
    first, second = torch.meshgrid(torch.arange(vocab), torch.arange(vocab), indexing="ij")
    first, second = first.reshape(-1), second.reshape(-1)  # all vocab^2 sequences

    def logp_BT() -> torch.Tensor:
        lp0 = torch.log_softmax(logits0, dim=0)[first]
        lp1 = torch.log_softmax(logits1, dim=1)[first, second]
        return torch.stack([lp0, lp1], dim=1)

    logp_ref_BT = torch.stack([ref0[first], ref1[first, second]], dim=1)
    seq_logp = logp_BT().sum(dim=1)
    exact = torch.autograd.grad(
        (seq_logp.exp() * (seq_logp - logp_ref_BT.sum(dim=1))).sum(), [logits0, logits1]
    )

    def estimator_grad(adv_BT: torch.Tensor) -> list[torch.Tensor]:
        logp = logp_BT()
        mask = torch.ones_like(logp, dtype=torch.bool)
        prob_BT = logp.sum(dim=1, keepdim=True).exp().detach().expand_as(logp)  # exact expectation weights
        loss, _ = clipped_surrogate(
            logp, logp.detach(), adv_BT, mask, prob_BT, mode="seq-mean-token-sum", num_seqs_global=1
        )
        return torch.autograd.grad(loss, [logits0, logits1])

    delta_BT = logp_BT().detach() - logp_ref_BT
    mask = torch.ones_like(delta_BT, dtype=torch.bool)
    to_go = estimator_grad(k1_reward_to_go(delta_BT, mask, kl_coef=1.0))
    for got, want in zip(to_go, exact, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    local = estimator_grad(-delta_BT)
    assert not torch.allclose(local[0], exact[0], atol=1e-6)
