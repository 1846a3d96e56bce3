"""Hypothesis invariants of the learner math (float64).

* advantages sum to zero per group, and an all-equal group gives exact zeros;
* splitting a batch into micro-batches (same global denominators) gives the same loss and gradient,
  under every aggregation mode, for every loss;
* values at masked positions (inf, nan, huge) change neither loss nor gradient;
* at ratio 1 the clipped surrogates' gradient is the REINFORCE gradient;
* the Monte Carlo OPD estimators are unbiased (exact expectation over all sample tuples).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, settings

from asyncrl.learner.advantages import (
    dr_grpo_advantages,
    grpo_advantages,
    mc_grpo_advantages,
    rloo_advantages,
)
from asyncrl.learner.kl import kl_loss
from asyncrl.learner.losses import AGG_MODES, aggregate, cispo_loss, clipped_surrogate, gspo_loss, sapo_loss
from asyncrl.learner.opd import (
    multi_sample_forward_kl,
    multi_sample_reverse_kl,
    pg_kl_loss,
    token_level_forward_kl,
)

F64 = torch.float64
NUM_SAMPLES = 3  # N for the multi-sample OPD losses
FAST = settings(max_examples=40, deadline=None)
PER_CASE = settings(max_examples=12, deadline=None)  # per (loss, mode) pair: 36 pairs

seeds = st.integers(min_value=0, max_value=2**31 - 1)
modes = st.sampled_from(AGG_MODES)


# ---------------------------------------------------------------------------------------------- advantages


@st.composite
def reward_groups(draw) -> torch.Tensor:
    num_groups = draw(st.integers(1, 4))
    group_size = draw(st.integers(2, 8))
    values = st.one_of(
        st.floats(-1e3, 1e3, allow_nan=False, allow_infinity=False),
        st.sampled_from([0.0, 1.0]),  # binary rewards, with many ties
    )
    rows = draw(
        st.lists(
            st.lists(values, min_size=group_size, max_size=group_size),
            min_size=num_groups,
            max_size=num_groups,
        )
    )
    return torch.tensor(rows, dtype=F64)


@FAST
@given(rewards=reward_groups())
def test_advantages_sum_to_zero_per_group(rewards):
    for adv in (
        grpo_advantages(rewards),
        grpo_advantages(rewards, unbiased=False),
        dr_grpo_advantages(rewards),
    ):
        scale = 1.0 + adv.abs().amax(dim=1)
        assert (adv.sum(dim=1).abs() <= 1e-9 * scale * rewards.shape[1]).all()
    rloo = rloo_advantages(rewards)
    assert (rloo.sum(dim=1).abs() <= 1e-9 * (1.0 + rewards.abs().amax(dim=1)) * rewards.shape[1]).all()
    others_mean = (rewards.sum(dim=1, keepdim=True) - rewards) / (rewards.shape[1] - 1)
    torch.testing.assert_close(rloo, rewards - others_mean, rtol=1e-9, atol=1e-9)


@FAST
@given(
    value=st.floats(-1e6, 1e6, allow_nan=False), num_groups=st.integers(1, 3), group_size=st.integers(1, 9)
)
def test_all_equal_group_gives_exact_zeros(value, num_groups, group_size):
    rewards = torch.full((num_groups, group_size), value, dtype=F64)
    zeros = torch.zeros_like(rewards)
    for estimator in (grpo_advantages, dr_grpo_advantages, rloo_advantages):
        assert torch.equal(estimator(rewards), zeros)
    assert torch.equal(mc_grpo_advantages(rewards).adv_GN, zeros)


@FAST
@given(rewards=reward_groups())
def test_mc_grpo_one_pivot_at_the_median_with_zero_advantage(rewards):
    out = mc_grpo_advantages(rewards)
    assert (out.pivot_GN.sum(dim=1) == 1).all()
    torch.testing.assert_close(rewards[out.pivot_GN], rewards.median(dim=1).values)
    assert torch.equal(out.adv_GN[out.pivot_GN], torch.zeros(rewards.shape[0], dtype=F64))


# ---------------------------------------------------------------------------------------------- losses

Batch = dict[str, torch.Tensor]


def make_batch(seed: int, num_seqs: int, num_steps: int) -> Batch:
    g = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, dtype=F64)

    shape, shape_n = (num_seqs, num_steps), (num_seqs, num_steps, NUM_SAMPLES)
    logp = -randn(*shape).abs() - 0.05
    logp_n = -randn(*shape_n).abs() - 0.05
    return {
        "logp": logp.requires_grad_(True),
        "old": (logp + 0.3 * randn(*shape)).detach(),  # ratios spread across the clip range
        "adv": randn(*shape),
        "weight": torch.rand(*shape, generator=g, dtype=F64) + 0.5,
        "teacher": -randn(*shape).abs(),
        "mask": torch.rand(*shape, generator=g) < 0.7,
        "logp_n": logp_n.requires_grad_(True),
        "behav_n": (logp_n + 0.3 * randn(*shape_n)).detach(),
        "teacher_n": -randn(*shape_n).abs(),
    }


def denominators(batch: Batch) -> dict[str, float]:
    mask = batch["mask"]
    return {
        "num_tokens_global": float(max(int(mask.sum()), 1)),
        "num_seqs_global": float(mask.shape[0]),
        "norm_constant": float(mask.shape[1] + 2),
    }


LossFn = Callable[[Batch, str, dict[str, float]], torch.Tensor]
LOSSES: dict[str, LossFn] = {
    "ppo-dual-clip": lambda b, m, d: clipped_surrogate(
        b["logp"],
        b["old"],
        b["adv"],
        b["mask"],
        b["weight"],
        clip_low=0.2,
        clip_high=0.28,
        dual_clip=3.0,
        mode=m,
        **d,
    )[0],
    "gspo": lambda b, m, d: gspo_loss(
        b["logp"], b["old"], b["adv"], b["mask"], b["weight"], clip_low=0.1, clip_high=0.1, mode=m, **d
    )[0],
    "cispo-unified": lambda b, m, d: cispo_loss(
        b["logp"], b["old"], b["adv"], b["mask"], b["weight"], clip_low=0.2, unified_mask=True, mode=m, **d
    )[0],
    "sapo": lambda b, m, d: sapo_loss(
        b["logp"], b["old"], b["adv"], b["mask"], b["weight"], tau_pos=1.0, tau_neg=1.05, mode=m, **d
    )[0],
    "kl-k3": lambda b, m, d: kl_loss(
        b["logp"], b["teacher"], b["mask"], b["weight"], estimator="k3", mode=m, **d
    )[0],
    "kl-k1+": lambda b, m, d: kl_loss(
        b["logp"], b["teacher"], b["mask"], b["weight"], estimator="k1+", mode=m, **d
    )[0],
    "opd-pg-kl": lambda b, m, d: pg_kl_loss(
        b["logp"], b["old"], b["teacher"], b["mask"], b["weight"], mode=m, **d
    )[0],
    "opd-token-fkl": lambda b, m, d: token_level_forward_kl(
        b["logp"], b["teacher"], b["mask"], b["weight"], mode=m, **d
    )[0],
    "opd-ms-rkl": lambda b, m, d: multi_sample_reverse_kl(
        b["logp_n"], b["behav_n"], b["teacher_n"], b["mask"], b["weight"], mode=m, **d
    )[0],
    "opd-ms-fkl": lambda b, m, d: multi_sample_forward_kl(
        b["logp_n"], b["teacher_n"], b["mask"], b["weight"], mode=m, **d
    )[0],
}


def grads(loss: torch.Tensor, batch: Batch) -> list[torch.Tensor]:
    leaves = [batch["logp"], batch["logp_n"]]
    got = torch.autograd.grad(loss, leaves, allow_unused=True)
    return [torch.zeros_like(leaf) if g is None else g for leaf, g in zip(leaves, got, strict=True)]


@PER_CASE
@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("name", sorted(LOSSES))
@given(
    seed=seeds,
    num_seqs=st.integers(1, 6),
    num_steps=st.integers(1, 5),
    cuts=st.sets(st.integers(1, 5), max_size=3),
)
def test_micro_batch_split_gives_same_loss_and_gradient(seed, num_seqs, num_steps, mode, name, cuts):
    batch = make_batch(seed, num_seqs, num_steps)
    d = denominators(batch)
    full = LOSSES[name](batch, mode, d)
    full_grads = grads(full, batch)
    bounds = [0, *sorted(c for c in cuts if c < num_seqs), num_seqs]
    split = sum(
        LOSSES[name]({k: v[lo:hi] for k, v in batch.items()}, mode, d)
        for lo, hi in itertools.pairwise(bounds)
    )
    torch.testing.assert_close(split, full, rtol=1e-10, atol=1e-12)
    for got, want in zip(grads(split, batch), full_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


POISON = [float("inf"), float("-inf"), float("nan"), 1e300, -1e300]


def poisoned(batch: Batch, seed: int) -> Batch:
    """A copy with every masked position of every input overwritten by inf / nan / huge values."""
    g = torch.Generator().manual_seed(seed)
    out: Batch = {"mask": batch["mask"]}
    for key, value in batch.items():
        if key == "mask":
            continue
        masked = ~batch["mask"] if value.dim() == 2 else ~batch["mask"][..., None].expand_as(value)
        palette = torch.tensor(POISON, dtype=F64)[torch.randint(len(POISON), value.shape, generator=g)]
        dirty = torch.where(masked, palette, value.detach())
        out[key] = dirty.requires_grad_(True) if value.requires_grad else dirty
    return out


@PER_CASE
@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("name", sorted(LOSSES))
@given(seed=seeds, num_seqs=st.integers(1, 5), num_steps=st.integers(1, 5))
def test_masked_positions_change_nothing(seed, num_seqs, num_steps, mode, name):
    clean = make_batch(seed, num_seqs, num_steps)
    dirty = poisoned(clean, seed + 1)
    d = denominators(clean)
    clean_loss, dirty_loss = LOSSES[name](clean, mode, d), LOSSES[name](dirty, mode, d)
    assert torch.equal(dirty_loss, clean_loss)
    for got, want, leaf in zip(
        grads(dirty_loss, dirty), grads(clean_loss, clean), ("logp", "logp_n"), strict=True
    ):
        assert torch.isfinite(got).all()
        assert torch.equal(got, want)
        masked = ~clean["mask"] if got.dim() == 2 else ~clean["mask"][..., None].expand_as(got)
        assert (got[masked] == 0).all(), leaf


@FAST
@given(
    seed=seeds,
    num_seqs=st.integers(1, 5),
    num_steps=st.integers(1, 5),
    mode=modes,
    kind=st.sampled_from(["ppo", "gspo", "cispo", "sapo", "opd-pg-kl"]),
    clip_low=st.floats(0.0, 1.0),
    clip_high=st.floats(0.0, 10.0),
    dual_clip=st.one_of(st.none(), st.floats(1.01, 10.0)),
    unified_mask=st.booleans(),
)
def test_ratio_one_gradient_is_reinforce(
    seed, num_seqs, num_steps, mode, kind, clip_low, clip_high, dual_clip, unified_mask
):
    b = make_batch(seed, num_seqs, num_steps)
    d = denominators(b)
    logp, mask, weight = b["logp"], b["mask"], b["weight"]
    old = logp.detach()
    adv = b["adv"]
    if kind == "ppo":
        loss, _ = clipped_surrogate(
            logp,
            old,
            adv,
            mask,
            weight,
            clip_low=clip_low,
            clip_high=clip_high,
            dual_clip=dual_clip,
            mode=mode,
            **d,
        )
    elif kind == "gspo":
        loss, _ = gspo_loss(
            logp, old, adv, mask, weight, clip_low=clip_low, clip_high=clip_high, mode=mode, **d
        )
    elif kind == "cispo":
        loss, _ = cispo_loss(
            logp,
            old,
            adv,
            mask,
            weight,
            clip_low=clip_low,
            clip_high=clip_high,
            unified_mask=unified_mask,
            mode=mode,
            **d,
        )
    elif kind == "sapo":  # the temperatures drawn from the clip range's draws
        loss, _ = sapo_loss(
            logp, old, adv, mask, weight, tau_pos=clip_high + 0.1, tau_neg=clip_low + 0.1, mode=mode, **d
        )
    else:
        adv = b["teacher"] - logp.detach()  # OPD: reverse-KL advantage under the current student
        loss, _ = pg_kl_loss(
            logp, old, b["teacher"], mask, weight, clip_eps=max(clip_high, 1e-3), mode=mode, **d
        )
    reinforce = aggregate(-adv * weight * logp, mask, mode=mode, **d)
    (got,) = torch.autograd.grad(loss, logp)
    (want,) = torch.autograd.grad(reinforce, logp)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


# ---------------------------------------------------------------------------------------------- OPD unbiasedness


@settings(max_examples=25, deadline=None)
@given(seed=seeds, vocab=st.integers(2, 4), num_samples=st.integers(1, 3), on_policy=st.booleans())
def test_multi_sample_reverse_kl_expectation_is_exact_gradient(seed, vocab, num_samples, on_policy):
    g = torch.Generator().manual_seed(seed)
    logits = (2.0 * torch.randn(vocab, generator=g, dtype=F64)).requires_grad_(True)
    logp_teacher = torch.log_softmax(2.0 * torch.randn(vocab, generator=g, dtype=F64), dim=0)
    logp_all = torch.log_softmax(logits, dim=0)
    logp_behav = (
        logp_all.detach() if on_policy else torch.log_softmax(torch.randn(vocab, generator=g, dtype=F64), 0)
    )
    ids_PN = torch.tensor(list(itertools.product(range(vocab), repeat=num_samples)))
    prob_1P = logp_behav[ids_PN].sum(dim=1).exp()[None]  # probability of each tuple under mu
    loss, _ = multi_sample_reverse_kl(
        logp_all[ids_PN][None],
        logp_behav[ids_PN][None],
        logp_teacher[ids_PN][None],
        torch.ones_like(prob_1P, dtype=torch.bool),
        prob_1P,
        clip_eps=0.2 if on_policy else 1e6,  # on-policy rho = 1, so even a tight clip never binds
        mode="seq-mean-token-sum",
        num_seqs_global=1,
    )
    (got,) = torch.autograd.grad(loss, logits, retain_graph=True)
    exact_kl = (logp_all.exp() * (logp_all - logp_teacher)).sum()
    (want,) = torch.autograd.grad(exact_kl, logits)
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)
