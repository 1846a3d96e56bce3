"""Unit tests for asyncrl.staleness.base: masked helpers, shared statistics, Correction assembly."""

from __future__ import annotations

import math

import pytest
import torch

from asyncrl.staleness.base import (
    MAX_LOG_RATIO,
    TokenBatch,
    clamped_exp,
    finish,
    k3_from_log_ratio,
    log_ratio,
    make_stats,
    masked_max,
    masked_mean,
    require_inputs,
    seq_mean,
    seq_sum,
    staleness_per_sequence,
    token_ess_ratio,
    with_current_as_prox,
)

F64 = torch.float64
MASK = torch.tensor([[True, True, False], [True, False, False]])


def _t(x):
    return None if x is None else torch.tensor(x, dtype=F64)


def make_batch(logp, behav, mask=MASK, *, versions=None, policy_version=0, prox=None, old_train=None):
    logp_BT = _t(logp)
    versions_BT = torch.zeros_like(mask, dtype=torch.int64) if versions is None else torch.tensor(versions)
    return TokenBatch(
        logp_BT,
        _t(behav),
        mask,
        versions_BT,
        torch.zeros_like(logp_BT),
        policy_version,
        _t(prox),
        _t(old_train),
    )


def test_log_ratio_never_reads_masked_values():
    num = torch.tensor([[1.0, math.inf, math.nan]])
    den = torch.tensor([[0.5, -math.inf, 2.0]])
    mask = torch.tensor([[True, False, False]])
    assert torch.equal(log_ratio(num, den, mask), torch.tensor([[0.5, 0.0, 0.0]]))


def test_clamped_exp_bounds_log_ratio():
    out = clamped_exp(torch.tensor([1000.0, -1000.0, 0.0], dtype=F64))
    assert out[0] == pytest.approx(math.exp(MAX_LOG_RATIO))
    assert out[1] == pytest.approx(math.exp(-MAX_LOG_RATIO))
    assert out[2] == 1.0


def test_sequence_reductions():
    x = torch.tensor([[1.0, 2.0, math.nan], [4.0, math.inf, 0.0]])
    mask = torch.tensor([[True, True, False], [False, False, False]])
    assert torch.equal(seq_sum(x, mask), torch.tensor([3.0, 0.0]))
    assert torch.equal(seq_mean(x, mask), torch.tensor([1.5, 0.0]))
    assert masked_mean(x, mask) == 1.5
    assert masked_max(x, mask) == 2.0
    empty = torch.zeros_like(mask)
    assert math.isnan(float(masked_mean(x, empty)))
    assert math.isnan(float(masked_max(x, empty)))


def test_k3_matches_formula():
    rho = 2.0
    assert float(k3_from_log_ratio(torch.tensor(math.log(rho), dtype=F64))) == pytest.approx(
        rho - math.log(rho) - 1
    )
    assert float(k3_from_log_ratio(torch.tensor(0.0))) == 0.0


def test_token_ess_ratio_hand_values():
    mask = torch.tensor([[True, True, False]])
    assert float(token_ess_ratio(torch.tensor([[1.0, 3.0, 99.0]], dtype=F64), mask)) == pytest.approx(
        16 / 10 / 2
    )
    assert float(token_ess_ratio(torch.tensor([[2.0, 2.0, 0.0]]), mask)) == 1.0
    assert math.isnan(float(token_ess_ratio(torch.zeros(1, 3), mask)))


def test_staleness_per_sequence_uses_oldest_valid_token():
    versions = torch.tensor([[3, 5, -7], [4, 4, 4]])
    mask = torch.tensor([[True, True, False], [False, False, False]])
    assert torch.equal(staleness_per_sequence(versions, mask, policy_version=6), torch.tensor([3, 0]))


def test_require_inputs_names_missing_fields():
    batch = make_batch([[0.0] * 3] * 2, [[0.0] * 3] * 2)
    with pytest.raises(ValueError, match="logp_prox_BT, logp_ewma_BT"):
        require_inputs(batch, ("prox", "ewma"), policy="x")
    require_inputs(batch, (), policy="x")


def test_make_stats_hand_values():
    ln2 = math.log(2.0)
    batch = make_batch(
        logp=[[0.0, ln2, 9.0], [0.0, 0.0, 0.0]],
        behav=[[0.0, 0.0, -9.0], [-ln2, 0.0, 0.0]],
        old_train=[[ln2, 0.0, 0.0], [0.0, 0.0, 0.0]],
        versions=[[1, 3, 0], [2, 0, 0]],
        policy_version=4,
    )
    weight = _t([[1.0, 3.0, 0.0], [2.0, 0.0, 0.0]])
    keep = torch.tensor([[True, True, False], [False, False, False]])
    stats = make_stats(
        batch, weight, keep, clipped_BT=torch.tensor([[False, True, True], [True, False, False]])
    )
    assert int(stats.num_valid_tokens) == 3 and int(stats.num_kept_tokens) == 2
    assert float(stats.masked_fraction) == pytest.approx(1 / 3)
    assert float(stats.clip_fraction) == pytest.approx(1 / 3)  # only kept clipped tokens count
    assert float(stats.mean_weight) == 2.0 and float(stats.max_weight) == 3.0
    assert float(stats.ess_ratio) == pytest.approx(16 / 10 / 2)
    # discrepancy old/behav per valid token: 2, 1, 2; staleness now/old: 1/2, 2, 1
    assert float(stats.discrepancy_factor) == pytest.approx(5 / 3)
    assert float(stats.staleness_factor) == pytest.approx(3.5 / 3)
    # mismatch k3 uses old_train vs behav: k3(ln2), k3(0), k3(ln2)
    assert float(stats.mismatch_k3) == pytest.approx(2 * (1 - ln2) / 3)
    assert float(stats.mean_staleness) == pytest.approx((3 + 1 + 2) / 3)
    assert float(stats.max_staleness) == 3.0
    assert math.isnan(float(stats.mean_freshness))


def test_make_stats_without_old_train_reports_nan_factors_and_uses_prox():
    ln2 = math.log(2.0)
    batch = make_batch([[5.0] * 3] * 2, [[0.0] * 3] * 2, prox=[[ln2] * 3] * 2)
    stats = make_stats(batch, torch.ones(2, 3, dtype=F64), MASK)
    assert math.isnan(float(stats.discrepancy_factor)) and math.isnan(float(stats.staleness_factor))
    assert float(stats.mismatch_k3) == pytest.approx(1 - ln2)


def test_finish_detaches_and_zeroes_outside_valid_and_kept():
    logp = torch.tensor([[0.5, 1.0, math.nan], [2.0, math.inf, 0.0]], requires_grad=True)
    batch = TokenBatch(
        logp, torch.zeros(2, 3), MASK, torch.zeros(2, 3, dtype=torch.int64), torch.zeros(2, 3), 0
    )
    keep = torch.tensor([[True, False, True], [True, True, True]])
    corr = finish(batch, logp, torch.full((2, 3), 2.0), keep, use_clip=False, lr_scale=0.5)
    assert not corr.logp_anchor_BT.requires_grad and not corr.weight_BT.requires_grad
    assert torch.equal(corr.mask_BT, keep & MASK)
    assert torch.equal(corr.logp_anchor_BT, torch.tensor([[0.5, 1.0, 0.0], [2.0, 0.0, 0.0]]))
    assert torch.equal(corr.weight_BT, torch.tensor([[2.0, 0.0, 0.0], [2.0, 0.0, 0.0]]))
    assert corr.use_clip is False and corr.lr_scale == 0.5
    assert all(not s.requires_grad for s in corr.stats)


def test_with_current_as_prox_detaches_the_current_log_probs():
    logp = torch.tensor([[0.5, 1.0, 0.0], [2.0, 0.0, 0.0]], requires_grad=True)
    batch = TokenBatch(
        logp, torch.zeros(2, 3), MASK, torch.zeros(2, 3, dtype=torch.int64), torch.zeros(2, 3), 0
    )
    prox = with_current_as_prox(batch).logp_prox_BT
    assert prox is not None and torch.equal(prox, logp.detach()) and not prox.requires_grad
