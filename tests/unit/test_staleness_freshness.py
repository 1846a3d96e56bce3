"""Value tests for the freshness score and weighting (ALGORITHMS.md §6.1, a proposal)."""

from __future__ import annotations

import math

import pytest
import torch

from asyncrl.staleness import FreshnessWeighted, TokenBatch, TruncatedIS, freshness_score, freshness_weights
from asyncrl.staleness.freshness import freshness_drifts

F64 = torch.float64
ln2 = math.log(2.0)


def t(x):
    return torch.tensor(x, dtype=F64)


def test_score_hand_values():
    now = t([[0.0, -1.0, 5.0], [0.0, 0.0, 0.0]])
    behav = t([[ln2, -1.0, math.nan], [0.0, 0.0, 0.0]])
    mask = torch.tensor([[True, True, False], [True, True, True]])
    d_roll, d_sup = freshness_drifts(now, behav, mask)
    k3 = 2.0 - ln2 - 1.0  # delta = behav - now = ln 2
    assert d_roll.tolist() == pytest.approx([k3 / 2, 0.0])
    assert d_sup.tolist() == pytest.approx([ln2 / 2, 0.0])
    f = freshness_score(now, behav, mask, lambda_roll=1.0, lambda_sup=2.0)
    assert f.tolist() == pytest.approx([math.exp(-(k3 / 2 + ln2)), 1.0])


def test_score_teacher_terms_and_edges():
    now, behav = t([[0.0, 0.0]]), t([[0.0, 0.0]])
    mask = torch.ones(1, 2, dtype=torch.bool)
    fresh, cached = t([[-1.0, -2.0]]), t([[-1.5, -2.0]])  # the teacher's reward moved by 0.5 on one token
    _, d_sup = freshness_drifts(now, behav, mask, logp_teacher_BT=fresh, logp_teacher_cached_BT=cached)
    assert d_sup.tolist() == pytest.approx([0.25])
    with pytest.raises(ValueError, match="both"):
        freshness_drifts(now, behav, mask, logp_teacher_BT=fresh)
    with pytest.raises(ValueError, match=">= 0"):
        freshness_score(now, behav, mask, lambda_roll=-1.0, lambda_sup=0.0)
    # empty sequence -> 1; absurd drift stays strictly positive
    empty = freshness_score(now, behav, torch.zeros(1, 2, dtype=torch.bool), lambda_roll=1.0, lambda_sup=1.0)
    assert empty.tolist() == [1.0]
    far = freshness_score(
        t([[-500.0]]).float(), t([[0.0]]).float(), mask[:, :1], lambda_roll=1e6, lambda_sup=1e6
    )
    assert 0.0 < float(far) < 1e-30


def test_weights_drop_and_self_normalise():
    f = t([1.0, 0.5, 0.25, 0.9])
    keep = torch.tensor([True, True, True, False])
    w, kept = freshness_weights(f, keep, f_min=0.3)
    assert kept.tolist() == [True, True, False, False]
    assert w.tolist() == pytest.approx([4 / 3, 2 / 3, 0.0, 0.0])
    raw, _ = freshness_weights(f, keep, f_min=0.3, self_normalize=False)
    assert raw.tolist() == [1.0, 0.5, 0.0, 0.0]
    glob, _ = freshness_weights(f, keep, f_min=0.3, f_sum=3.0, num_kept=4)
    assert glob.tolist() == pytest.approx([4 / 3, 2 / 3, 0.0, 0.0])


def test_wrapper_multiplies_base_weights():
    # seq 0 on-policy (f = 1), seq 1 drifted by ln 2 on one of its two tokens
    logp = t([[0.0, 0.0], [0.0, 0.0]])
    behav = t([[0.0, 0.0], [ln2, 0.0]])
    mask = torch.ones(2, 2, dtype=torch.bool)
    batch = TokenBatch(
        logp, behav, mask, torch.zeros(2, 2, dtype=torch.int64), torch.zeros(2, 2), 3, logp_prox_BT=logp
    )
    wrapped = FreshnessWeighted(base=TruncatedIS(), lambda_roll=0.0, lambda_sup=1.0)
    base = TruncatedIS().correct(batch)
    corr = wrapped.correct(batch)
    f1 = math.exp(-ln2 / 2)
    norm = (1.0 + f1) / 2
    expected = base.weight_BT * t([[1.0 / norm], [f1 / norm]])
    torch.testing.assert_close(corr.weight_BT, expected)
    assert float(corr.stats.mean_freshness) == pytest.approx(norm)
    assert float(corr.stats.clip_fraction) == float(base.stats.clip_fraction)
    dropped = FreshnessWeighted(base=TruncatedIS(), lambda_roll=0.0, lambda_sup=1.0, f_min=0.9).correct(batch)
    assert dropped.mask_BT.tolist() == [[True, True], [False, False]]
    assert float(dropped.stats.masked_fraction) == 0.5
