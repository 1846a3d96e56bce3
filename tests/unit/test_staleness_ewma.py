"""Value tests for the PPO-EWMA proxies (ALGORITHMS.md §3.4-§3.5)."""

from __future__ import annotations

import math

import pytest
import torch

from asyncrl.staleness import EwmaParams, PpoEwma, TokenBatch, ewma_decay_for_age, ewma_logp_update

F64 = torch.float64
ln = math.log


def test_ewma_params_match_the_closed_form():
    beta = 0.6
    thetas = [
        torch.tensor([1.0, -2.0]),
        torch.tensor([3.0, 0.5]),
        torch.tensor([-1.0, 4.0]),
        torch.tensor([2.0, 2.0]),
    ]
    ewma = EwmaParams.init({"w": thetas[0]})
    assert ewma.total == 1.0
    for theta in thetas[1:]:
        ewma = ewma.update({"w": theta}, decay=beta)
    n = len(thetas) - 1
    coef = [beta ** (n - k) for k in range(len(thetas))]
    expected = sum(c * th for c, th in zip(coef, thetas, strict=True)) / sum(coef)
    torch.testing.assert_close(ewma.params["w"], expected)
    assert ewma.total == pytest.approx(sum(coef))


def test_ewma_params_are_pure_fp32_and_reset():
    theta0 = {"w": torch.tensor([1.0, 2.0], dtype=torch.bfloat16), "step": torch.tensor(3)}
    ewma = EwmaParams.init(theta0)
    assert ewma.params["w"].dtype == torch.float32
    theta1 = {"w": torch.tensor([3.0, 4.0], dtype=torch.bfloat16), "step": torch.tensor(4)}
    new = ewma.update(theta1, decay=0.5)
    assert ewma.params["w"].tolist() == [1.0, 2.0] and ewma.total == 1.0  # old value untouched
    assert new.params["w"].tolist() == pytest.approx([1 / 3 + 2, 2 / 3 + 8 / 3])  # (0.5*θ0 + θ1)/1.5
    assert int(new.params["step"]) == 4  # non-float buffers track the latest
    reset = new.reset(theta1)
    assert reset.params["w"].tolist() == [3.0, 4.0] and reset.total == 1.0
    with pytest.raises(ValueError, match="keys differ"):
        ewma.update({"v": torch.zeros(2)}, decay=0.5)
    with pytest.raises(ValueError, match="decay"):
        ewma.update(theta1, decay=1.0)


def test_decay_for_age():
    assert ewma_decay_for_age(0) == 0.0
    assert ewma_decay_for_age(1) == 0.5
    assert ewma_decay_for_age(2) == pytest.approx(2 / 3)


def test_ewma_logp_update():
    mask = torch.tensor([[True, True, False]])
    now = torch.tensor([[-1.0, -2.0, math.nan]])
    first = ewma_logp_update(None, now, mask, beta=0.5)
    assert first.tolist() == [[-1.0, -2.0, 0.0]]
    later = ewma_logp_update(first, torch.tensor([[-3.0, 0.0, -math.inf]]), mask, beta=0.5)
    assert later.tolist() == [[-2.0, -1.0, 0.0]]
    grad_now = torch.tensor([[-1.0, -1.0, -1.0]], requires_grad=True)
    assert not ewma_logp_update(first, grad_now, mask, beta=0.9).requires_grad


def make_batch(logp, behav, ewma, adv=None):
    logp, behav, ewma = (torch.tensor(x, dtype=F64) for x in (logp, behav, ewma))
    adv = torch.zeros_like(logp) if adv is None else torch.tensor(adv, dtype=F64)
    mask = torch.ones_like(logp, dtype=torch.bool)
    return TokenBatch(logp, behav, mask, torch.zeros_like(mask, dtype=torch.int64), adv, 0, logp_ewma_BT=ewma)


def test_proxy_cap_mode():
    batch = make_batch([[0.0, 0.0]], [[0.0, 0.0]], [[ln(2.0), ln(200.0)]])
    corr = PpoEwma().correct(batch)
    torch.testing.assert_close(corr.weight_BT, torch.tensor([[2.0, 100.0]], dtype=F64))
    assert torch.equal(corr.logp_anchor_BT, batch.logp_ewma_BT) and corr.use_clip
    assert float(corr.stats.clip_fraction) == 0.5


def test_original_cap_mode_reproduces_the_openai_loss():
    """weight * max(-u A, -clip(u) A) equals openai/ppo-ewma's max(pg1, pg2) with logp_adj (§3.4)."""
    eps, cap = 0.2, 100.0
    logp = [[ln(300.0), 0.3, -0.2, ln(150.0)]]
    behav = [[0.0, 0.0, 0.1, 0.0]]
    ewma = [[ln(250.0), 0.1, 0.2, ln(3.0)]]
    adv = [[1.0, -1.0, 2.0, -0.5]]
    batch = make_batch(logp, behav, ewma, adv)
    corr = PpoEwma(cap_mode="original").correct(batch)
    new, old, rec, a = batch.logp_BT, batch.logp_behav_BT, batch.logp_ewma_BT, batch.adv_BT
    logp_adj = torch.maximum(old, new - ln(cap))
    pg1 = -a * torch.exp(new - logp_adj)
    pg2 = -a * torch.exp(torch.clamp(new - rec, ln(1 - eps), ln(1 + eps)) + rec - logp_adj)
    reference = torch.maximum(pg1, pg2)
    u = torch.exp(new - corr.logp_anchor_BT)
    ours = corr.weight_BT * torch.maximum(-u * a, -u.clamp(1 - eps, 1 + eps) * a)
    torch.testing.assert_close(ours, reference)
    assert float(corr.stats.clip_fraction) == 0.5  # pi/mu = 300 and 150 exceed the cap
