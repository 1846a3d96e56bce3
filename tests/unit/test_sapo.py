"""SAPO (`learner.loss = "sapo"`, arXiv 2511.20347): value and gradient on hand-computed tokens,
against a plain autograd reference of the paper's formula, REINFORCE at ratio 1, masked
positions, micro-batch splits, its stats, and when its registry entry lets a trajectory stream.

The loss, per valid token: l = -A (4 / tau) sigmoid(tau (r - 1)), tau = tau_pos for A > 0 and
tau_neg otherwise; dl/dlogp = -A 4 s (1 - s) r with s = sigmoid(tau (r - 1)).
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from asyncrl.config_load import load_config
from asyncrl.learner.losses import AGG_MODES, aggregate, sapo_loss
from asyncrl.learner.objective import Objective
from asyncrl.learner.policy_losses import policy_loss
from asyncrl.staleness.base import Correction

F64 = torch.float64
TAU_POS, TAU_NEG = 1.0, 1.05  # the paper's defaults


def _sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


def _by_hand(log_ratio: float, adv: float, tau_pos: float, tau_neg: float) -> tuple[float, float]:
    """(loss, dloss/dlogp) of one token, from the formula with floats only."""
    r = math.exp(log_ratio)
    tau = tau_pos if adv > 0 else tau_neg
    x = tau * (r - 1.0)
    s, one_minus_s = _sigmoid(x), _sigmoid(-x)  # 1 - s written as sigmoid(-x): no cancellation at large x
    return -adv * 4.0 / tau * s, -adv * 4.0 * s * one_minus_s * r


def _reference(logp, old, adv, mask, weight, *, tau_pos, tau_neg, **agg):
    """The paper's formula written plainly, differentiated by autograd (valid positions only)."""
    logp, old, adv = (torch.where(mask, x, 0.0) for x in (logp, old, adv))
    ratio = torch.exp(logp - old)
    tau = torch.where(adv > 0, torch.tensor(tau_pos, dtype=F64), torch.tensor(tau_neg, dtype=F64))
    per_token = -adv * 4.0 / tau * torch.sigmoid(tau * (ratio - 1.0)) * torch.where(mask, weight, 0.0)
    return aggregate(per_token, mask, **agg)


@pytest.mark.parametrize(
    ("log_ratio", "adv"),
    [
        (0.0, 1.0),  # r = 1, A > 0: f = 4/tau_pos * 1/2
        (0.0, -1.0),  # r = 1, A < 0: tau_neg
        (0.0, 0.0),  # A = 0 takes tau_neg and contributes nothing
        (0.5, 2.0),  # r > 1, A > 0: the gate saturates, the weight decays
        (0.5, -0.7),  # r > 1, A < 0
        (-0.4, 1.5),  # r < 1, A > 0
        (-0.4, -2.0),  # r < 1, A < 0
        (3.0, 1.0),  # far off-policy: the weight is almost 0
    ],
)
@pytest.mark.parametrize(("tau_pos", "tau_neg"), [(TAU_POS, TAU_NEG), (0.5, 3.0)])
def test_single_token_value_and_gradient(log_ratio, adv, tau_pos, tau_neg):
    logp = torch.tensor([[-1.2]], dtype=F64, requires_grad=True)
    old = (logp - log_ratio).detach()
    loss, stats = sapo_loss(
        logp,
        old,
        torch.tensor([[adv]], dtype=F64),
        torch.tensor([[True]]),
        tau_pos=tau_pos,
        tau_neg=tau_neg,
        num_tokens_global=1.0,
    )
    (grad,) = torch.autograd.grad(loss, logp)
    want_loss, want_grad = _by_hand(log_ratio, adv, tau_pos, tau_neg)
    assert float(loss.detach()) == pytest.approx(want_loss, rel=1e-12, abs=1e-15)
    assert float(grad) == pytest.approx(want_grad, rel=1e-12, abs=1e-15)
    assert float(stats.clip_fraction) == 0.0 and float(stats.dual_clip_fraction) == 0.0
    assert float(stats.mean_ratio) == pytest.approx(math.exp(log_ratio), rel=1e-12)


def test_at_ratio_one_the_weight_is_exactly_one_for_either_temperature():
    """The gradient of l(A) at r = 1 is -A to the bit, for A > 0 (tau_pos) and A < 0 (tau_neg)."""
    logp = torch.tensor([[-0.3, -2.0, -0.9]], dtype=F64, requires_grad=True)
    adv = torch.tensor([[1.25, -0.5, -3.0]], dtype=F64)
    loss, _ = sapo_loss(logp, logp.detach(), adv, torch.ones(1, 3, dtype=torch.bool), num_tokens_global=1.0)
    (grad,) = torch.autograd.grad(loss, logp)
    assert torch.equal(grad, -adv)


def _batch(seed: int, num_seqs: int = 4, num_steps: int = 5):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(num_seqs, num_steps, generator=g, dtype=F64) * 3 - 0.05
    return {
        "logp": logp.requires_grad_(True),
        "old": (logp + 0.4 * torch.randn(num_seqs, num_steps, generator=g, dtype=F64)).detach(),
        "adv": torch.randn(num_seqs, num_steps, generator=g, dtype=F64),
        "mask": torch.rand(num_seqs, num_steps, generator=g) < 0.7,
        "weight": torch.rand(num_seqs, num_steps, generator=g, dtype=F64) + 0.5,
    }


def _agg(b, mode: str) -> dict:
    return {
        "mode": mode,
        "num_tokens_global": float(max(int(b["mask"].sum()), 1)),
        "num_seqs_global": float(b["mask"].shape[0]),
        "norm_constant": float(b["mask"].shape[1] + 2),
    }


def _sapo(b, **kw):
    return sapo_loss(b["logp"], b["old"], b["adv"], b["mask"], b["weight"], **kw)


@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize(("tau_pos", "tau_neg"), [(TAU_POS, TAU_NEG), (2.0, 0.5)])
def test_equals_plain_autograd_of_the_formula(mode, tau_pos, tau_neg):
    b = _batch(seed=3)
    loss, _ = _sapo(b, tau_pos=tau_pos, tau_neg=tau_neg, **_agg(b, mode))
    inputs = (b["logp"], b["old"], b["adv"], b["mask"], b["weight"])
    want = _reference(*inputs, tau_pos=tau_pos, tau_neg=tau_neg, **_agg(b, mode))
    torch.testing.assert_close(loss, want, rtol=1e-12, atol=1e-14)
    (got,) = torch.autograd.grad(loss, b["logp"])
    (ref,) = torch.autograd.grad(want, b["logp"])
    torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("mode", AGG_MODES)
def test_on_policy_gradient_is_reinforce(mode):
    b = _batch(seed=5)
    loss, stats = sapo_loss(b["logp"], b["logp"].detach(), b["adv"], b["mask"], b["weight"], **_agg(b, mode))
    reinforce = aggregate(-b["adv"] * b["weight"] * b["logp"], b["mask"], **_agg(b, mode))
    (got,) = torch.autograd.grad(loss, b["logp"])
    (want,) = torch.autograd.grad(reinforce, b["logp"])
    torch.testing.assert_close(got, want, rtol=1e-15, atol=0.0)
    assert float(stats.mean_ratio) == 1.0


def test_masked_inf_and_nan_do_not_leak():
    clean = _batch(seed=7)
    masked = ~clean["mask"]
    dirty = dict(clean)
    for key, poison in (("logp", math.inf), ("old", -math.inf), ("adv", math.nan), ("weight", math.nan)):
        dirty[key] = torch.where(masked, poison, clean[key].detach())
    dirty["logp"].requires_grad_(True)
    agg = _agg(clean, "token-mean")
    clean_loss, clean_stats = _sapo(clean, **agg)
    dirty_loss, dirty_stats = _sapo(dirty, **agg)
    assert torch.equal(dirty_loss, clean_loss) and torch.isfinite(dirty_loss)
    (g_dirty,) = torch.autograd.grad(dirty_loss, dirty["logp"])
    (g_clean,) = torch.autograd.grad(clean_loss, clean["logp"])
    assert torch.isfinite(g_dirty).all() and torch.equal(g_dirty, g_clean)
    assert (g_dirty[masked] == 0).all()
    assert torch.equal(dirty_stats.mean_ratio, clean_stats.mean_ratio)


@pytest.mark.parametrize("mode", AGG_MODES)
def test_micro_batch_split_gives_the_same_loss_and_gradient(mode):
    b = _batch(seed=11, num_seqs=6)
    agg = _agg(b, mode)
    full, _ = _sapo(b, **agg)
    (full_grad,) = torch.autograd.grad(full, b["logp"])
    parts = itertools.pairwise([0, 1, 4, 6])
    split = sum(_sapo({k: v[lo:hi] for k, v in b.items()}, **agg)[0] for lo, hi in parts)
    (split_grad,) = torch.autograd.grad(split, b["logp"])
    torch.testing.assert_close(split, full, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(split_grad, full_grad, rtol=1e-12, atol=1e-14)


def test_bad_temperatures_are_refused():
    b = _batch(seed=1)
    with pytest.raises(ValueError, match="tau_pos and tau_neg must be > 0"):
        _sapo(b, tau_neg=0.0, num_tokens_global=1.0)


# ---------------------------------------------------------------------------- the registry entry


def test_registry_entry():
    entry = policy_loss("sapo")
    assert entry.fn is sapo_loss
    assert entry.clip is None and not entry.dual_clip  # it never clips
    assert entry.resolve_params({}) == {"tau_pos": TAU_POS, "tau_neg": TAU_NEG}
    assert entry.resolve_params({"tau_neg": 2.0}) == {"tau_pos": TAU_POS, "tau_neg": 2.0}
    assert not entry.ever_linear(entry.resolve_params({}))  # the paper's temperatures never stream
    assert entry.ever_linear({"tau_pos": 2.0, "tau_neg": 2.0})
    with pytest.raises(ValueError, match="no parameter 'tau' .*; valid parameters: tau_neg, tau_pos$"):
        entry.resolve_params({"tau": 1.0})


def _objective(*sets: str):
    return Objective.from_config(load_config(None, ["learner.loss=sapo", *sets]))


def _correction(anchor_BT: torch.Tensor, mask_BT: torch.Tensor) -> Correction:
    ones = torch.ones_like(anchor_BT)
    return Correction(anchor_BT, ones, mask_BT, use_clip=True, lr_scale=1.0, stats=None)


def _loss_and_grad(objective, logp, corr, mask, adv: float):
    loss, _ = objective.policy_loss(logp, corr, torch.full_like(logp, adv), mask)
    (grad,) = torch.autograd.grad(loss, logp)
    return loss.detach(), grad


LOGP = [[-0.5, -1.5, -0.2, 0.0]]
MASK = [[True, True, True, False]]


def test_a_trajectory_streams_when_its_loss_is_linear_in_the_advantage():
    """With tau_pos == tau_neg, l(A) = A l(+1), value and gradient, on- or off-policy: it streams."""
    logp = torch.tensor(LOGP, dtype=F64, requires_grad=True)
    mask = torch.tensor(MASK)
    stale = _correction(torch.where(mask, logp.detach() + 0.1, 0.0), mask)
    symmetric = _objective("learner.loss_params.tau_neg=1.0")
    found = symmetric.stream_loss(logp, stale, mask)
    assert found is not None and float(found[1].clip_fraction) == 0.0
    (h,) = torch.autograd.grad(found[0], logp)
    for a in (0.8, -1.3):
        loss_a, grad_a = _loss_and_grad(symmetric, logp, stale, mask, a)
        torch.testing.assert_close(loss_a, a * found[0].detach(), rtol=1e-15, atol=0.0)
        torch.testing.assert_close(grad_a, a * h, rtol=1e-15, atol=0.0)


def test_with_the_papers_temperatures_a_trajectory_waits_for_its_group():
    """tau_pos != tau_neg: l(A) is not A l(+1). Even at r = 1, where the gradient is (weight
    exactly 1 for both signs), the value is -A 2 / tau_pos for A > 0 but -A 2 / tau_neg for A < 0."""
    logp = torch.tensor(LOGP, dtype=F64, requires_grad=True)
    mask = torch.tensor(MASK)
    on_policy = _correction(torch.where(mask, logp.detach(), 0.0), mask)
    paper = _objective()
    assert paper.loss_params == {"tau_pos": TAU_POS, "tau_neg": TAU_NEG}
    assert paper.stream_loss(logp, on_policy, mask) is None
    loss_pos, grad_pos = _loss_and_grad(paper, logp, on_policy, mask, 1.0)
    loss_neg, grad_neg = _loss_and_grad(paper, logp, on_policy, mask, -1.0)
    assert torch.equal(grad_neg, -grad_pos)  # the gradient is linear at r = 1 ...
    assert float(loss_pos) == -3 * 2 / TAU_POS  # three valid tokens
    assert float(loss_neg) == pytest.approx(3 * 2 / TAU_NEG, rel=1e-15)
    assert float(loss_neg) != -float(loss_pos)  # ... its value is not
