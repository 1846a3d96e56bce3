"""Value tests for VCPO (ALGORITHMS.md §2): ESS ratio, lr scaling, off-policy optimal baseline."""

from __future__ import annotations

import math

import pytest
import torch

from asyncrl.staleness import VCPO, TokenBatch, ess_ratio, opob_baseline, opob_weights, vcpo_lr_scale
from asyncrl.staleness.vcpo import ess_ratio_from_sums, sequence_log_weights

F64 = torch.float64
ln = math.log


def t(x):
    return torch.tensor(x, dtype=F64)


def test_sequence_log_weights_sum_valid_tokens():
    logp = t([[0.5, 0.25, math.nan], [1.0, 0.0, 0.0]])
    behav = t([[0.0, 0.0, 0.0], [0.5, math.inf, 0.0]])
    mask = torch.tensor([[True, True, False], [True, False, False]])
    assert sequence_log_weights(logp, behav, mask).tolist() == [0.75, 0.5]


def test_ess_ratio_hand_values():
    assert float(ess_ratio(t([0.0, ln(3.0)]))) == pytest.approx(16 / 10 / 2)
    assert float(ess_ratio(t([0.7, 0.7, 0.7]))) == pytest.approx(1.0)
    # masked sequences do not count; weights 1 and 3 again
    assert float(ess_ratio(t([0.0, ln(3.0), 50.0]), torch.tensor([True, True, False]))) == pytest.approx(0.8)
    # huge log weights: no overflow, same value as the shifted weights
    assert float(ess_ratio(t([1000.0, 1000.0 + ln(3.0)]))) == pytest.approx(0.8)
    assert math.isnan(float(ess_ratio(t([1.0]), torch.tensor([False]))))


def test_ess_ratio_from_global_sums():
    assert float(ess_ratio_from_sums(t(4.0), t(10.0), 2)) == pytest.approx(0.8)


def test_lr_scale_rules():
    assert vcpo_lr_scale(0.25) == pytest.approx(0.5)
    assert vcpo_lr_scale(0.25, rule="linear") == pytest.approx(0.25)
    assert vcpo_lr_scale(0.25, base_ess_ratio=0.5) == pytest.approx(math.sqrt(0.5))
    assert vcpo_lr_scale(0.9, base_ess_ratio=0.55) == 1.0
    assert vcpo_lr_scale(math.nan) == 1.0


def test_opob_baseline_weighted_mean():
    assert float(opob_baseline(t([1.0, 3.0]), t([0.0, 1.0]))) == pytest.approx(0.75)
    groups = opob_baseline(t([[1.0, 1.0], [0.0, 2.0], [0.0, 0.0]]), t([[0.0, 1.0], [5.0, 1.0], [1.0, 3.0]]))
    assert groups.tolist() == pytest.approx([0.5, 1.0, 2.0])  # all-zero weights -> plain mean


def test_opob_weights_proposal_and_released_variant():
    g2 = t([1.0, 4.0])
    assert torch.equal(opob_weights(g2), g2)
    released = opob_weights(g2, released=True, is_weight_N=t([1.0, 0.5]), length_N=torch.tensor([2, 1]))
    assert released.tolist() == [4.0, 1.0]
    with pytest.raises(ValueError, match="needs is_weight_N and length_N"):
        opob_weights(g2, released=True)


def make_batch(logp, mask):
    logp = t(logp)
    zeros = torch.zeros_like(logp)
    mask = torch.tensor(mask)
    return TokenBatch(logp, zeros, mask, torch.zeros_like(mask, dtype=torch.int64), zeros, 0)


def test_policy_sequence_tis_and_lr_scale():
    # sequence IS weights 2 and 16 (token log-ratios sum to ln 2 and ln 16); third sequence empty
    batch = make_batch(
        [[ln(2.0), 0.0, 9.0], [ln(4.0), ln(4.0), 0.0], [3.0, 3.0, 3.0]],
        [[True, True, False], [True, True, False], [False, False, False]],
    )
    corr = VCPO().correct(batch)
    rho = 18.0**2 / (4.0 + 256.0) / 2
    assert float(corr.stats.ess_ratio) == pytest.approx(rho)
    assert corr.lr_scale == pytest.approx(math.sqrt(rho))
    expected = t([[2.0, 2.0, 0.0], [8.0, 8.0, 0.0], [0.0, 0.0, 0.0]])
    torch.testing.assert_close(corr.weight_BT, expected)
    assert not corr.use_clip
    assert torch.equal(corr.logp_anchor_BT, torch.where(batch.mask_BT, batch.logp_BT, 0.0))
    assert float(corr.stats.clip_fraction) == pytest.approx(0.5)  # the capped sequence's 2 of 4 tokens
    clipped = VCPO(ess_use_clipped=True, rule="linear", base_ess_ratio=0.5).correct(batch)
    rho_clip = 10.0**2 / (4.0 + 64.0) / 2
    assert clipped.lr_scale == pytest.approx(min(1.0, rho_clip / 0.5))
