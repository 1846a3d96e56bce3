"""OPD losses: hand-computed values, and exact expected gradients on a small softmax policy.

Expectations over samples are exact: every tuple of N ids from a V-word vocabulary is one position,
weighted (through `weight_BT`) by its probability under the sampling distribution.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from asyncrl.learner.opd import (
    multi_sample_forward_kl,
    multi_sample_reverse_kl,
    pg_kl_loss,
    reverse_kl_advantage,
    token_level_forward_kl,
)

F64 = torch.float64


def t(rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=F64)


def test_reverse_kl_advantage_is_detached_and_masked():
    logp = torch.tensor([[-1.0, float("nan")]], dtype=F64, requires_grad=True)
    adv = reverse_kl_advantage(t([[-0.25, float("-inf")]]), logp, torch.tensor([[True, False]]))
    assert adv.tolist() == [[0.75, 0.0]]
    assert not adv.requires_grad


@pytest.mark.parametrize(
    ("behav", "online", "value", "grad", "clipped"),
    [
        pytest.param(-1.0, True, -0.5, -0.5, 0.0, id="on-policy: REINFORCE with A = T - logp"),
        pytest.param(-1.0 - math.log(1.1), True, -0.55, -0.55, 0.0, id="off-policy: rho = 1.1, inside clip"),
        pytest.param(-1.0 - math.log(1.5), True, -0.6, 0.0, 1.0, id="A > 0, rho = 1.5: clipped"),
        pytest.param(
            -1.0 - math.log(1.1),
            False,
            -1.1 * (0.5 + math.log(1.1)),
            -1.1 * (0.5 + math.log(1.1)),
            0.0,
            id="stale advantage T - behav",
        ),
    ],
)
def test_pg_kl_loss_single_token(behav, online, value, grad, clipped):
    logp = torch.tensor([[-1.0]], dtype=F64, requires_grad=True)
    loss, stats = pg_kl_loss(
        logp, t([[behav]]), t([[-0.5]]), torch.tensor([[True]]), online_advantage=online, num_tokens_global=1
    )
    loss.backward()
    assert loss.item() == pytest.approx(value, rel=1e-12)
    assert logp.grad.item() == pytest.approx(grad, rel=1e-12, abs=1e-15)
    assert stats.clip_fraction.item() == clipped
    assert stats.kl.item() == pytest.approx(math.exp(-1.0 - behav) * -0.5)


def test_token_level_forward_kl_value_and_gradient():
    logp = torch.tensor([[math.log(0.25), 3.0]], dtype=F64, requires_grad=True)
    mask = torch.tensor([[True, False]])
    loss, stats = token_level_forward_kl(logp, t([[math.log(0.5), float("nan")]]), mask, num_tokens_global=1)
    loss.backward()
    assert loss.item() == pytest.approx(0.5 * math.log(2.0))
    assert logp.grad.tolist() == [[-0.5, 0.0]]
    assert stats.kl.item() == pytest.approx(0.5 * math.log(2.0))


def test_multi_sample_forward_kl_value():
    logp = t([[[-1.0, -2.0], [0.0, 0.0]]])
    teacher = t([[[-0.5, -0.5], [9.0, 9.0]]])
    loss, _ = multi_sample_forward_kl(logp, teacher, torch.tensor([[True, False]]), num_tokens_global=1)
    assert loss.item() == pytest.approx(1.0)


def _dists(seed: int, vocab: int):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(vocab, generator=g, dtype=F64).requires_grad_(True)
    logp_teacher = torch.log_softmax(torch.randn(vocab, generator=g, dtype=F64), dim=0)
    logp_behav = torch.log_softmax(torch.randn(vocab, generator=g, dtype=F64), dim=0)
    return logits, logp_teacher, logp_behav


def _exact_reverse_kl_grad(logits: torch.Tensor, logp_teacher: torch.Tensor) -> torch.Tensor:
    logp = torch.log_softmax(logits, dim=0)
    return torch.autograd.grad((logp.exp() * (logp - logp_teacher)).sum(), logits)[0]


def _tuples(vocab: int, num_samples: int) -> torch.Tensor:
    return torch.tensor(list(itertools.product(range(vocab), repeat=num_samples)))  # [V^N, N]


def _expected_multi_sample_grad(logits, logp_teacher, logp_behav, num_samples, **kwargs) -> torch.Tensor:
    ids_PN = _tuples(logits.shape[0], num_samples)  # P = V^N positions, one per tuple
    logp_1PN = torch.log_softmax(logits, dim=0)[ids_PN][None]
    prob_1P = logp_behav[ids_PN].sum(dim=1).exp()[None]
    mask_1P = torch.ones_like(prob_1P, dtype=torch.bool)
    loss, _ = multi_sample_reverse_kl(
        logp_1PN,
        logp_behav[ids_PN][None],
        logp_teacher[ids_PN][None],
        mask_1P,
        prob_1P,
        mode="seq-mean-token-sum",
        num_seqs_global=1,
        **kwargs,
    )
    return torch.autograd.grad(loss, logits)[0]


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("num_samples", [1, 2, 3])
def test_multi_sample_reverse_kl_is_unbiased_off_policy(seed, num_samples):
    logits, logp_teacher, logp_behav = _dists(seed, vocab=4)
    got = _expected_multi_sample_grad(logits, logp_teacher, logp_behav, num_samples, clip_eps=1e6)
    torch.testing.assert_close(got, _exact_reverse_kl_grad(logits, logp_teacher), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("seed", [0, 1])
def test_multi_sample_reverse_kl_is_unbiased_on_policy_with_clip(seed):
    logits, logp_teacher, _ = _dists(seed, vocab=4)
    logp_behav = torch.log_softmax(logits, dim=0).detach()  # rho = 1: the 0.2 clip never binds
    got = _expected_multi_sample_grad(logits, logp_teacher, logp_behav, 2, clip_eps=0.2)
    torch.testing.assert_close(got, _exact_reverse_kl_grad(logits, logp_teacher), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("seed", [0, 1])
def test_stale_advantage_is_biased(seed):
    """AsyncOPD's finding 2 in miniature: the rollout-time signal T - mu is not the reverse-KL gradient."""
    logits, logp_teacher, logp_behav = _dists(seed, vocab=4)
    got = _expected_multi_sample_grad(
        logits, logp_teacher, logp_behav, 1, clip_eps=1e6, online_advantage=False
    )
    assert not torch.allclose(got, _exact_reverse_kl_grad(logits, logp_teacher), atol=1e-4)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_pg_kl_loss_is_unbiased_off_policy(seed):
    logits, logp_teacher, logp_behav = _dists(seed, vocab=5)
    logp_1V = torch.log_softmax(logits, dim=0)[None]  # position v = "the sampled token was v"
    mask = torch.ones_like(logp_1V, dtype=torch.bool)
    loss, _ = pg_kl_loss(
        logp_1V,
        logp_behav[None],
        logp_teacher[None],
        mask,
        logp_behav.exp()[None],
        clip_eps=1e6,
        mode="seq-mean-token-sum",
        num_seqs_global=1,
    )
    (got,) = torch.autograd.grad(loss, logits)
    torch.testing.assert_close(got, _exact_reverse_kl_grad(logits, logp_teacher), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("seed", [0, 1])
def test_multi_sample_forward_kl_is_unbiased_under_teacher_samples(seed):
    logits, logp_teacher, _ = _dists(seed, vocab=3)
    ids_PN = _tuples(3, 2)
    logp_1PN = torch.log_softmax(logits, dim=0)[ids_PN][None]
    prob_1P = logp_teacher[ids_PN].sum(dim=1).exp()[None]
    loss, _ = multi_sample_forward_kl(
        logp_1PN,
        logp_teacher[ids_PN][None],
        torch.ones_like(prob_1P, dtype=torch.bool),
        prob_1P,
        mode="seq-mean-token-sum",
        num_seqs_global=1,
    )
    (got,) = torch.autograd.grad(loss, logits)
    logp = torch.log_softmax(logits, dim=0)
    (want,) = torch.autograd.grad((logp_teacher.exp() * (logp_teacher - logp)).sum(), logits)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    # The MC value is unbiased too.
    exact_value = (logp_teacher.exp() * (logp_teacher - logp)).sum()
    torch.testing.assert_close(loss, exact_value, rtol=1e-10, atol=1e-12)


def test_clip_eps_must_be_positive():
    args = (t([[0.0]]), t([[0.0]]), t([[0.0]]), torch.tensor([[True]]))
    with pytest.raises(ValueError, match="clip_eps"):
        pg_kl_loss(*args, clip_eps=0.0, num_tokens_global=1)
