"""Value tests for AReaL decoupled PPO (ALGORITHMS.md §4.1) on hand-computed cases."""

from __future__ import annotations

import math

import pytest
import torch

from asyncrl.staleness import Decoupled, TokenBatch

F64 = torch.float64
ln = math.log


def close(x, expected):
    torch.testing.assert_close(x, torch.tensor(expected, dtype=x.dtype))


def make_batch(log_w, mask=None, *, logp=None, adv=None):
    """behav = 0 and prox = log_w, so the behaviour weight pi_prox/mu is given directly."""
    prox = torch.tensor(log_w, dtype=F64)
    mask = torch.ones_like(prox, dtype=torch.bool) if mask is None else torch.tensor(mask)
    logp = prox.clone() if logp is None else torch.tensor(logp, dtype=F64)
    adv = torch.zeros_like(prox) if adv is None else torch.tensor(adv, dtype=F64)
    return TokenBatch(
        logp,
        torch.zeros_like(prox),
        mask,
        torch.zeros_like(mask, dtype=torch.int64),
        adv,
        0,
        logp_prox_BT=prox,
    )


def test_mask_action_drops_tokens_above_cap():
    corr = Decoupled().correct(make_batch([[ln(2.0), ln(6.0), ln(0.5)]]))
    assert corr.mask_BT.tolist() == [[True, False, True]]
    close(corr.weight_BT, [[2.0, 0.0, 0.5]])
    assert corr.use_clip
    assert float(corr.stats.masked_fraction) == pytest.approx(1 / 3)
    assert int(corr.stats.num_valid_tokens) == 3  # the loss denominator is unchanged by rejection


def test_clamp_action_truncates_instead():
    corr = Decoupled(action="clamp").correct(make_batch([[ln(2.0), ln(6.0), ln(0.5)]]))
    assert corr.mask_BT.all()
    close(corr.weight_BT, [[2.0, 5.0, 0.5]])
    assert float(corr.stats.clip_fraction) == pytest.approx(1 / 3)


def test_geometric_level_rejects_sequences_and_cap_none_disables():
    log_w = [[ln(8.0), ln(4.0)], [ln(8.0), ln(2.0)]]  # geometric means sqrt(32) > 5, 4 <= 5
    corr = Decoupled(level="geometric").correct(make_batch(log_w))
    assert corr.mask_BT.tolist() == [[False, False], [True, True]]
    close(corr.weight_BT, [[0.0, 0.0], [8.0, 2.0]])
    assert Decoupled(cap=None).correct(make_batch(log_w)).mask_BT.all()


def test_weighted_clipped_surrogate_equals_the_decoupled_objective():
    """w * max(-u A, -clip(u) A) == -min((pi/mu) A, (pi_prox/mu) clip(u) A), the first form of §4.1."""
    eps = 0.2
    log_w = [[ln(1.5), ln(0.7), ln(2.0), ln(1.1)]]
    logp = [[ln(1.5) + 0.5, ln(0.7) - 0.4, ln(2.0) + 0.1, ln(1.1) - 0.05]]
    adv = [[1.0, -1.0, -2.0, 0.5]]
    batch = make_batch(log_w, logp=logp, adv=adv)
    corr = Decoupled().correct(batch)
    u = torch.exp(batch.logp_BT - corr.logp_anchor_BT)
    a = batch.adv_BT
    ours = corr.weight_BT * torch.maximum(-u * a, -u.clamp(1 - eps, 1 + eps) * a)
    pi_over_mu = torch.exp(batch.logp_BT - batch.logp_behav_BT)
    prox_over_mu = torch.exp(batch.logp_prox_BT - batch.logp_behav_BT)
    paper = -torch.minimum(pi_over_mu * a, prox_over_mu * u.clamp(1 - eps, 1 + eps) * a)
    assert torch.allclose(ours, paper)
