"""Property tests for the staleness policies: masking-rule equivalences, variance optimality of the
off-policy baseline, masked-position invariance, and the ranges of freshness and ESS."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncrl.staleness import (
    EwmaParams,
    FreshnessWeighted,
    assemble_old_train_logp,
    ess_ratio,
    freshness_score,
    make_policy,
    opob_baseline,
    opob_weights,
)
from asyncrl.staleness.base import TokenBatch, token_ess_ratio
from asyncrl.staleness.importance import self_normalize
from asyncrl.staleness.m2po import m2po_cap_mask, m2po_remove_greedy, m2po_remove_sorted

F64 = torch.float64
FAST = settings(max_examples=40, deadline=None)

# Multiples of 1/64 keep every sum exact in float64, so "mean <= tau" has one answer however it is summed.
dyadic_m2 = st.lists(st.integers(0, 1024), max_size=40).map(lambda xs: torch.tensor(xs, dtype=F64) / 64)
dyadic_tau = st.integers(1, 128).map(lambda x: x / 64)


# --------------------------------------------------------------------------------------- M2PO
@FAST
@given(dyadic_m2, dyadic_tau)
def test_m2po_greedy_equals_sorted_suffix_mean(m2_N, tau):
    assert torch.equal(m2po_remove_greedy(m2_N, tau=tau), m2po_remove_sorted(m2_N, tau=tau))


@FAST
@given(dyadic_m2, dyadic_tau)
def test_m2po_removal_is_minimal_and_takes_the_largest(m2_N, tau):
    removed = m2po_remove_sorted(m2_N, tau=tau)
    kept = m2_N[~removed]
    assert kept.numel() == 0 or float(kept.sum()) <= tau * kept.numel()
    k = int(removed.sum())
    if k > 0 and kept.numel() > 0:
        assert float(m2_N[removed].min()) >= float(kept.max())
    if k > 0:
        top_left = torch.sort(m2_N, descending=True).values[k - 1 :]  # one fewer removal
        assert float(top_left.sum()) > tau * top_left.numel()


@FAST
@given(dyadic_m2, dyadic_tau)
def test_m2po_capping_masks_at_least_as_many_as_removal(m2_N, tau):
    assert int(m2po_cap_mask(m2_N, tau=tau).sum()) >= int(m2po_remove_sorted(m2_N, tau=tau).sum())


# --------------------------------------------------------------------------------------- VCPO
@FAST
@given(st.data())
def test_off_policy_optimal_baseline_minimises_exact_trace_variance(data):
    """Finite outcome space: outcome k has probability p_k under mu, score vector s_k, IS weight a_k,
    reward R_k. The one-sample estimator a (R - b) s has exactly computable trace-variance."""
    num_k = data.draw(st.integers(2, 7))
    dim = data.draw(st.integers(1, 4))
    floats = st.floats(-2.0, 2.0, allow_nan=False)
    p = torch.softmax(torch.tensor(data.draw(st.lists(floats, min_size=num_k, max_size=num_k)), dtype=F64), 0)
    a = torch.exp(torch.tensor(data.draw(st.lists(floats, min_size=num_k, max_size=num_k)), dtype=F64))
    r = torch.tensor(data.draw(st.lists(floats, min_size=num_k, max_size=num_k)), dtype=F64)
    s = torch.tensor(data.draw(st.lists(floats, min_size=num_k * dim, max_size=num_k * dim)), dtype=F64)
    s = s.reshape(num_k, dim)
    s = s - (p * a) @ s / (p * a).sum()  # exact IS: E_mu[a s] = E_pi[grad log pi] = 0

    def trace_var(b: float) -> float:
        g_KD = (a * (r - b))[:, None] * s
        mean_D = p @ g_KD
        return float(p @ (g_KD * g_KD).sum(1) - mean_D @ mean_D)

    w = opob_weights(((a[:, None] * s) ** 2).sum(1))  # ||g_i||^2 for g_i = a_i s_i
    b_star = float(opob_baseline(p * w, r))  # population version of sum W R / sum W
    v_star = trace_var(b_star)
    tol = 1e-10 * (1.0 + abs(v_star))
    for b in (float(p @ r), float((p * a) @ r / (p @ a)), b_star + 1e-3, b_star - 0.5, 0.0):
        assert v_star <= trace_var(b) + tol


@FAST
@given(st.lists(st.floats(-50.0, 50.0, allow_nan=False), min_size=1, max_size=30), st.floats(-300.0, 300.0))
def test_ess_ratio_range_and_scale_invariance(log_w, shift):
    log_w_B = torch.tensor(log_w, dtype=F64)
    rho = float(ess_ratio(log_w_B))
    assert 0.0 < rho <= 1.0
    assert float(ess_ratio(log_w_B + shift)) == pytest.approx(rho, rel=1e-9)
    assert float(ess_ratio(torch.full_like(log_w_B, log_w[0]))) == pytest.approx(1.0, abs=1e-12)


@FAST
@given(st.lists(st.floats(1e-3, 1e3), min_size=1, max_size=30))
def test_token_ess_ratio_range_and_self_normalisation(w):
    w_BT = torch.tensor([w], dtype=F64)
    keep = torch.ones_like(w_BT, dtype=torch.bool)
    assert 0.0 < float(token_ess_ratio(w_BT, keep)) <= 1.0
    assert float(token_ess_ratio(torch.full_like(w_BT, w[0]), keep)) == pytest.approx(1.0, abs=1e-12)
    assert float(self_normalize(w_BT, keep).mean()) == pytest.approx(1.0, rel=1e-9)


# --------------------------------------------------------------------------------------- freshness
@FAST
@given(st.integers(0, 2**31 - 1), st.floats(0.0, 10.0), st.floats(0.0, 10.0))
def test_freshness_in_unit_interval_and_one_when_on_policy(seed, lambda_roll, lambda_sup):
    g = torch.Generator().manual_seed(seed)
    now = torch.randn(3, 5, generator=g) * 3
    behav = torch.randn(3, 5, generator=g) * 3
    mask = torch.rand(3, 5, generator=g) < 0.7
    f = freshness_score(now, behav, mask, lambda_roll=lambda_roll, lambda_sup=lambda_sup)
    assert bool(((f > 0) & (f <= 1)).all())
    same = freshness_score(now, now.clone(), mask, lambda_roll=lambda_roll, lambda_sup=lambda_sup)
    assert same.tolist() == [1.0, 1.0, 1.0]


# --------------------------------------------------------------------------------------- masked positions
POLICY_CONFIGS = [
    ("none", {}),
    ("none", {"anchor": "current"}),
    ("tis", {"clip_low": 0.5}),
    ("mis", {}),
    ("mis", {"is_level": "sequence", "rs_level": "geometric", "self_normalize": True}),
    ("icepop", {}),
    ("decoupled", {}),
    ("decoupled", {"action": "clamp"}),
    ("decoupled", {"level": "geometric"}),
    ("m2po", {}),
    ("m2po", {"rule": "cap", "candidates": "all"}),
    ("m2po", {"anchor": "old_train"}),
    ("vcpo", {}),
    ("ewma", {}),
    ("ewma", {"cap_mode": "original", "cap": 2.0}),
    ("exact", {"rs_high": 2.0, "veto": 0.1}),
]
JUNK = st.sampled_from([math.inf, -math.inf, math.nan, 1e30, -1e30, 0.0])


def random_batch(seed: int, num_seq: int, num_tok: int) -> TokenBatch:
    g = torch.Generator().manual_seed(seed)

    def near(x: torch.Tensor, scale: float) -> torch.Tensor:
        return x + scale * torch.randn(x.shape, generator=g, dtype=F64)

    logp = -torch.rand(num_seq, num_tok, generator=g, dtype=F64) * 3
    mask = torch.rand(num_seq, num_tok, generator=g) < 0.7
    adv = torch.randn(num_seq, 1, generator=g, dtype=F64).expand(num_seq, num_tok).clone()
    versions = torch.randint(0, 6, (num_seq, num_tok), generator=g)
    return TokenBatch(
        logp.requires_grad_(),
        near(logp.detach(), 0.5),
        mask,
        versions,
        adv,
        6,
        logp_prox_BT=near(logp.detach(), 0.3),
        logp_old_train_BT=near(logp.detach(), 0.3),
        logp_ewma_BT=near(logp.detach(), 0.3),
    )


def corrupt(batch: TokenBatch, junk: list[float]) -> TokenBatch:
    valid = batch.mask_BT

    def spoil(x: torch.Tensor | None, value: float) -> torch.Tensor | None:
        return None if x is None else torch.where(valid, x, torch.full_like(x, value))

    fields = ["logp_BT", "logp_behav_BT", "adv_BT", "logp_prox_BT", "logp_old_train_BT", "logp_ewma_BT"]
    spoiled = {name: spoil(getattr(batch, name), value) for name, value in zip(fields, junk, strict=True)}
    spoiled["versions_BT"] = torch.where(valid, batch.versions_BT, -12345)
    return batch._replace(**spoiled)


def assert_same(c1, c2) -> None:
    for name in ("logp_anchor_BT", "weight_BT", "mask_BT"):
        x, y = getattr(c1, name), getattr(c2, name)
        assert torch.equal(x, y), name
        assert not x.requires_grad, name
    assert (c1.use_clip, c1.lr_scale) == (c2.use_clip, c2.lr_scale)
    for name, x, y in zip(c1.stats._fields, c1.stats, c2.stats, strict=True):
        assert torch.equal(x, y) or (x.isnan() & y.isnan()).all(), name
    assert bool(torch.isfinite(c1.weight_BT).all() and torch.isfinite(c1.logp_anchor_BT).all())


@pytest.mark.parametrize(
    ("name", "params"), POLICY_CONFIGS, ids=[f"{n}-{i}" for i, (n, _) in enumerate(POLICY_CONFIGS)]
)
@settings(max_examples=15, deadline=None)
@given(
    st.integers(0, 2**31 - 1), st.integers(1, 4), st.integers(1, 7), st.lists(JUNK, min_size=6, max_size=6)
)
def test_values_at_masked_positions_change_no_output(name, params, seed, num_seq, num_tok, junk):
    policy = make_policy(name, **params)
    batch = random_batch(seed, num_seq, num_tok)
    assert_same(policy.correct(batch), policy.correct(corrupt(batch, junk)))
    wrapped = FreshnessWeighted(base=policy, f_min=0.2)
    assert_same(wrapped.correct(batch), wrapped.correct(corrupt(batch, junk)))


@FAST
@given(st.integers(0, 2**31 - 1), st.integers(1, 4), st.integers(1, 6))
def test_assemble_old_train_logp_reads_only_its_own_version(seed, num_seq, num_tok):
    g = torch.Generator().manual_seed(seed)
    versions = torch.randint(0, 4, (num_seq, num_tok), generator=g)
    mask = torch.rand(num_seq, num_tok, generator=g) < 0.7
    pos = torch.arange(num_seq * num_tok, dtype=F64).reshape(num_seq, num_tok)
    snaps = {v: torch.where(versions == v, 100.0 * v + pos, torch.full_like(pos, math.nan)) for v in range(4)}
    out = assemble_old_train_logp(versions, snaps, mask, dtype=F64)
    assert torch.equal(out, torch.where(mask, 100.0 * versions + pos, 0.0))


@FAST
@given(st.lists(st.floats(-5.0, 5.0), min_size=1, max_size=6), st.floats(0.0, 0.99))
def test_ewma_params_equal_the_weighted_average(thetas, decay):
    ewma = EwmaParams.init({"w": torch.tensor([thetas[0]], dtype=torch.float32)})
    for x in thetas[1:]:
        ewma = ewma.update({"w": torch.tensor([x], dtype=torch.float32)}, decay=decay)
    n = len(thetas) - 1
    coef = [decay ** (n - k) for k in range(n + 1)]
    expected = sum(c * x for c, x in zip(coef, thetas, strict=True)) / sum(coef)
    assert float(ewma.params["w"]) == pytest.approx(expected, abs=1e-4)
