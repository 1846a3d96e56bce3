"""Value tests for none / TIS / MIS / IcePop against ALGORITHMS.md §4.2-§4.3, on hand-computed cases."""

from __future__ import annotations

import math

import pytest
import torch

from asyncrl.staleness import IcePop, MaskedIS, NoCorrection, TokenBatch, TruncatedIS
from asyncrl.staleness.importance import level_log_weight, self_normalize

F64 = torch.float64
ln = math.log


def close(x, expected):
    torch.testing.assert_close(x, torch.tensor(expected, dtype=x.dtype))


def make_batch(log_rho, mask=None, *, logp=None):
    """Batch with behav = 0 and prox = log_rho, so rho = pi_prox/mu is given directly."""
    prox = torch.tensor(log_rho, dtype=F64)
    mask = torch.ones_like(prox, dtype=torch.bool) if mask is None else torch.tensor(mask)
    logp = prox.clone() if logp is None else torch.tensor(logp, dtype=F64)
    zeros = torch.zeros_like(prox)
    return TokenBatch(
        logp, zeros, mask, torch.zeros_like(mask, dtype=torch.int64), zeros, 0, logp_prox_BT=prox
    )


def weights(corr):
    return corr.weight_BT.tolist()


def test_none_anchor_is_behaviour_or_current():
    batch = make_batch([[ln(2.0), 0.3]], logp=[[0.7, -0.2]])
    corr = NoCorrection().correct(batch)
    assert torch.equal(corr.logp_anchor_BT, batch.logp_behav_BT)
    assert weights(corr) == [[1.0, 1.0]] and corr.use_clip and corr.lr_scale == 1.0
    cur = NoCorrection(anchor="current").correct(batch)
    assert torch.equal(cur.logp_anchor_BT, batch.logp_BT)


def test_tis_truncates_the_token_weight():
    batch = make_batch([[ln(3.0), ln(0.5), ln(1.5)]])
    corr = TruncatedIS().correct(batch)
    close(corr.weight_BT, [[2.0, 0.5, 1.5]])
    assert torch.equal(corr.logp_anchor_BT, batch.logp_prox_BT)
    assert corr.mask_BT.all() and corr.use_clip
    assert float(corr.stats.clip_fraction) == pytest.approx(1 / 3)
    low = TruncatedIS(clip=2.5, clip_low=0.8).correct(batch)
    close(low.weight_BT, [[2.5, 0.8, 1.5]])
    assert float(low.stats.clip_fraction) == pytest.approx(2 / 3)


def test_tis_requires_prox():
    batch = make_batch([[0.0]])._replace(logp_prox_BT=None)
    with pytest.raises(ValueError, match="'tis' needs TokenBatch.logp_prox_BT"):
        TruncatedIS().correct(batch)


def test_mis_token_level_rejection_and_truncation():
    batch = make_batch([[ln(3.0), ln(0.5), ln(1.5), ln(0.4)]])
    corr = MaskedIS(veto=None).correct(batch)  # accept 1/2 <= rho <= 2, weight min(rho, 2)
    assert corr.mask_BT.tolist() == [[False, True, True, False]]
    close(corr.weight_BT, [[0.0, 0.5, 1.5, 0.0]])
    assert float(corr.stats.masked_fraction) == 0.5


def test_mis_sequence_and_geometric_levels():
    log_rho = [[ln(1.5), ln(1.5), 0.0], [ln(4.0), ln(0.25), 0.0]]
    mask = [[True, True, False], [True, True, True]]
    # sequence metric: 2.25 (rejected, > 2) and 1.0 (accepted); weight = product, untruncated
    seq = MaskedIS(is_level="sequence", is_clip=None, rs_level="sequence", veto=None).correct(
        make_batch(log_rho, mask)
    )
    assert seq.mask_BT.tolist() == [[False, False, False], [True, True, True]]
    close(seq.weight_BT, [[0.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
    # geometric metric: exp(mean log rho) = 1.5 and 1.0, both accepted; token weights truncated at 2
    geo = MaskedIS(is_level="token", rs_level="geometric", veto=None).correct(make_batch(log_rho, mask))
    assert geo.mask_BT.tolist() == mask
    close(geo.weight_BT, [[1.5, 1.5, 0.0], [2.0, 0.25, 1.0]])
    geo_w = level_log_weight(torch.tensor(log_rho, dtype=F64), torch.tensor(mask), level="geometric")
    close(geo_w.exp(), [[1.5, 1.5, 1.0], [1.0, 1.0, 1.0]])


def test_mis_veto_drops_the_whole_sequence():
    batch = make_batch(
        [[0.0, ln(1e-5), 0.0], [0.0, 0.0, ln(1e-5)]], [[True, True, True], [True, True, False]]
    )
    corr = MaskedIS(rs_level=None).correct(batch)
    assert corr.mask_BT.tolist() == [[False, False, False], [True, True, False]]
    kept = MaskedIS(rs_level=None, veto=None).correct(batch)
    assert kept.mask_BT.tolist() == [[True, True, True], [True, True, False]]


def test_mis_self_normalisation_gives_mean_one_over_kept_tokens():
    batch = make_batch([[ln(1.5), ln(0.5), ln(3.0)]])
    corr = MaskedIS(self_normalize=True, veto=None).correct(batch)
    # kept: 1.5, 0.5 (3.0 rejected) -> mean 1.0
    close(corr.weight_BT, [[1.5, 0.5, 0.0]])
    corr2 = MaskedIS(self_normalize=True, rs_level=None, veto=None).correct(batch)  # 1.5, 0.5, 2 -> mean 4/3
    close(corr2.weight_BT, [[1.125, 0.375, 1.5]])
    assert float(corr2.stats.mean_weight) == pytest.approx(1.0)


def test_self_normalize_with_explicit_global_sums():
    w = torch.tensor([[1.0, 3.0]], dtype=F64)
    keep = torch.tensor([[True, True]])
    assert self_normalize(w, keep, weight_sum=8.0, num_kept=4).tolist() == [[0.5, 1.5]]
    assert self_normalize(torch.zeros(1, 2), keep).tolist() == [[0.0, 0.0]]


def test_icepop_keeps_untruncated_ratio_inside_band():
    batch = make_batch([[ln(3.0), ln(0.05), ln(1.9), ln(2.0)]])
    corr = IcePop().correct(batch)  # slime: weight = rho if 0 <= rho <= 2 else 0
    assert corr.mask_BT.tolist() == [[False, True, True, True]]
    close(corr.weight_BT, [[0.0, 0.05, 1.9, 2.0]])
    band = IcePop(rs_low=0.5, rs_high=2.0).correct(batch)
    assert band.mask_BT.tolist() == [[False, False, True, True]]
    assert float(band.stats.clip_fraction) == 0.0


def test_mis_rs_low_defaults_to_reciprocal():
    assert MaskedIS(rs_high=4.0).low == 0.25
    assert MaskedIS(rs_high=4.0, rs_low=0.1).low == 0.1
