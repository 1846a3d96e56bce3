"""Value tests for the exact old-logit route (ALGORITHMS.md §3.1-§3.2)."""

from __future__ import annotations

import math

import pytest
import torch

from asyncrl.staleness import ExactOldLogits, TokenBatch, assemble_old_train_logp, versions_needed

F64 = torch.float64
ln = math.log


def test_assemble_picks_each_tokens_own_version():
    versions = torch.tensor([[3, 3, 4], [5, -1, 0]])  # -1 and 0 sit at padding
    mask = torch.tensor([[True, True, True], [True, False, False]])
    assert versions_needed(versions, mask) == [3, 4, 5]
    snap = {
        3: torch.tensor([[-1.0, -2.0, math.nan], [9.0, 9.0, 9.0]]),
        4: torch.tensor([[math.inf, 9.0, -3.0], [9.0, 9.0, 9.0]]),
        5: torch.tensor([[9.0, 9.0, 9.0], [-4.0, math.nan, 9.0]]),
        6: torch.zeros(2, 3),
    }
    out = assemble_old_train_logp(versions, snap, mask)
    assert out.tolist() == [[-1.0, -2.0, -3.0], [-4.0, 0.0, 0.0]]


def test_assemble_names_missing_versions_and_bad_shapes():
    versions = torch.tensor([[1, 2, 7]])
    mask = torch.ones(1, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"versions \[2, 7\] \(have \[1\]\)"):
        assemble_old_train_logp(versions, {1: torch.zeros(1, 3)}, mask)
    with pytest.raises(ValueError, match="expected"):
        assemble_old_train_logp(versions[:, :1], {1: torch.zeros(1, 3)}, mask[:, :1])


def make_batch(logp, behav, old_train, mask=None):
    logp, behav, old = (torch.tensor(x, dtype=F64) for x in (logp, behav, old_train))
    mask = torch.ones_like(logp, dtype=torch.bool) if mask is None else torch.tensor(mask)
    return TokenBatch(
        logp,
        behav,
        mask,
        torch.zeros_like(mask, dtype=torch.int64),
        torch.zeros_like(logp),
        0,
        logp_old_train_BT=old,
    )


def test_two_factor_correction_hand_values():
    # discrepancy old/behav = 3, 1/2, 1.5 ; staleness pi/old = 1.1, 1, 0.8
    behav = [[0.0, 0.0, 0.0]]
    old = [[ln(3.0), ln(0.5), ln(1.5)]]
    logp = [[ln(3.3), ln(0.5), ln(1.2)]]
    corr = ExactOldLogits().correct(make_batch(logp, behav, old))
    assert torch.equal(corr.logp_anchor_BT, torch.tensor(old, dtype=F64)) and corr.use_clip
    torch.testing.assert_close(corr.weight_BT, torch.tensor([[2.0, 0.5, 1.5]], dtype=F64))
    assert float(corr.stats.discrepancy_factor) == pytest.approx(5.0 / 3)
    assert float(corr.stats.staleness_factor) == pytest.approx(2.9 / 3)
    masked = ExactOldLogits(is_clip=None, rs_high=2.0).correct(make_batch(logp, behav, old))
    assert masked.mask_BT.tolist() == [[False, True, True]]
    torch.testing.assert_close(masked.weight_BT, torch.tensor([[0.0, 0.5, 1.5]], dtype=F64))


def test_untruncated_weight_times_staleness_factor_is_the_full_ratio():
    """pi/mu = [old/mu] x [pi/old] (§3.1): with no truncation weight * exp(logp - anchor) == pi/mu."""
    g = torch.Generator().manual_seed(0)
    logp, behav, old = (torch.randn(3, 5, generator=g, dtype=F64) for _ in range(3))
    batch = TokenBatch(
        logp, behav, torch.ones(3, 5, dtype=torch.bool), torch.zeros(3, 5, dtype=torch.int64), logp, 0
    )
    corr = ExactOldLogits(is_clip=None).correct(batch._replace(logp_old_train_BT=old))
    torch.testing.assert_close(
        corr.weight_BT * torch.exp(logp - corr.logp_anchor_BT), torch.exp(logp - behav)
    )


def test_veto_and_required_input():
    batch = make_batch([[0.0, 0.0], [0.0, 0.0]], [[0.0, 0.0], [0.0, 0.0]], [[ln(1e-6), 0.0], [0.0, 0.0]])
    corr = ExactOldLogits(veto=1e-4).correct(batch)
    assert corr.mask_BT.tolist() == [[False, False], [True, True]]
    with pytest.raises(ValueError, match="'exact' needs TokenBatch.logp_old_train_BT"):
        ExactOldLogits().correct(batch._replace(logp_old_train_BT=None))
