"""Value tests for M2PO masking (ALGORITHMS.md §1): Algorithm 1, its sorted form, the capping rule."""

from __future__ import annotations

import math

import pytest
import torch

from asyncrl.staleness import M2PO, TokenBatch
from asyncrl.staleness.m2po import (
    m2po_cap_bound,
    m2po_cap_mask,
    m2po_remove_greedy,
    m2po_remove_sorted,
    trust_region_tokens,
)

F64 = torch.float64
BOTH_REMOVALS = [m2po_remove_greedy, m2po_remove_sorted]


def t(x):
    return torch.tensor(x, dtype=F64)


@pytest.mark.parametrize("remove", BOTH_REMOVALS)
def test_removal_hand_case(remove):
    # mean 0.09 > 0.04: drop 0.25; remaining mean 0.11/3 = 0.0367 <= 0.04: stop
    assert remove(t([0.25, 0.01, 0.01, 0.09]), tau=0.04).tolist() == [True, False, False, False]


@pytest.mark.parametrize("remove", BOTH_REMOVALS)
def test_removal_ties_go_by_rank(remove):
    # sums: 3 > 2, then 2 > 1.5, then 1 <= 1: two of the three equal values go, lowest index first
    assert remove(t([1.0, 1.0, 1.0, 0.0]), tau=0.5).tolist() == [True, True, False, False]


@pytest.mark.parametrize("remove", BOTH_REMOVALS)
def test_removal_edges(remove):
    assert remove(t([0.01, 0.02]), tau=0.04).tolist() == [False, False]  # already within budget
    assert remove(t([1.0, 2.0]), tau=0.5).tolist() == [True, True]  # every suffix above tau
    assert remove(t([]), tau=0.04).tolist() == []


def test_capping_hand_case_masks_more_than_removal():
    m2 = t([0.25, 0.01, 0.01, 0.09])
    # sorted [0.01, 0.01, 0.09, 0.25]; capped means 0.01, 0.01, 0.05, 0.09 -> largest ok breakpoint 0.01
    assert float(m2po_cap_bound(m2, tau=0.04)) == pytest.approx(0.01)
    assert m2po_cap_mask(m2, tau=0.04).tolist() == [True, False, False, True]
    assert m2po_remove_sorted(m2, tau=0.04).sum() == 1


def test_capping_edges():
    assert math.isinf(float(m2po_cap_bound(t([]), tau=0.04)))
    assert float(m2po_cap_bound(t([0.01, 0.03]), tau=0.04)) == pytest.approx(0.03)  # no constraint
    assert m2po_cap_mask(t([0.01, 0.03]), tau=0.04).tolist() == [False, False]
    # all values above tau: mean(min(v, c)) = c, solved by c = tau; everything masked
    assert float(m2po_cap_bound(t([1.0, 2.0]), tau=0.5)) == 0.5
    assert m2po_cap_mask(t([1.0, 2.0]), tau=0.5).tolist() == [True, True]


def test_trust_region_tokens():
    log_r = t([[0.5, -0.1, 0.1, -0.3, 0.0, 0.7]])
    adv = t([[1.0, 1.0, -1.0, -1.0, 1.0, math.nan]])
    mask = torch.tensor([[True, True, True, True, True, False]])
    assert trust_region_tokens(log_r, adv, mask).tolist() == [[True, False, False, True, False, False]]


def make_batch(log_r, adv, mask=None, *, old_train_shift=0.0):
    logp = t(log_r)
    mask = torch.ones_like(logp, dtype=torch.bool) if mask is None else torch.tensor(mask)
    behav = torch.zeros_like(logp)
    return TokenBatch(
        logp,
        behav,
        mask,
        torch.zeros_like(mask, dtype=torch.int64),
        t(adv),
        0,
        logp_old_train_BT=behav + old_train_shift,
    )


def test_policy_masks_harmful_tokens_by_algorithm_1():
    # harmful candidates: token 0 (A>0, r>1, m2 .25) and token 3 (A<0, r<1, m2 .09)
    batch = make_batch([[0.5, -0.1, 0.1, -0.3]], [[1.0, 1.0, -1.0, -1.0]])
    corr = M2PO(tau=0.1).correct(batch)
    assert corr.mask_BT.tolist() == [[False, True, True, True]]
    assert corr.weight_BT.tolist() == [[0.0, 1.0, 1.0, 1.0]]
    assert not corr.use_clip
    assert torch.equal(corr.logp_anchor_BT, batch.logp_behav_BT)
    assert float(corr.stats.masked_fraction) == 0.25
    # at tau = 0.04 both candidates go (0.09 alone still exceeds it)
    assert M2PO().correct(batch).mask_BT.tolist() == [[False, True, True, False]]
    # AReaL-style: every valid token is a candidate; m2 = .25 .01 .01 .09 -> only the largest goes
    assert M2PO(candidates="all").correct(batch).mask_BT.tolist() == [[False, True, True, True]]
    # capping rule at tau 0.04 over candidates {.25, .09}: all values above tau -> both masked
    assert M2PO(rule="cap").correct(batch).mask_BT.tolist() == [[False, True, True, False]]


def test_policy_old_train_anchor():
    batch = make_batch([[0.5, -0.1]], [[1.0, 1.0]], old_train_shift=0.5)  # log r = 0, -0.6 -> no harmful
    corr = M2PO(anchor="old_train").correct(batch)
    assert corr.mask_BT.all()
    assert torch.equal(corr.logp_anchor_BT, batch.logp_old_train_BT)
    with pytest.raises(ValueError, match="logp_old_train_BT"):
        M2PO(anchor="old_train").correct(batch._replace(logp_old_train_BT=None))
