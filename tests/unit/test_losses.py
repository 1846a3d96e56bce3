"""Value tests for aggregation and the policy losses on hand-computed tokens (float64)."""

from __future__ import annotations

import math

import pytest
import torch

from asyncrl.learner.losses import (
    AGG_MODES,
    aggregate,
    cispo_loss,
    clipped_surrogate,
    gspo_loss,
)

F64 = torch.float64


def leaf(rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=F64, requires_grad=True)


def t(rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=F64)


PER_TOKEN = [[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]
MASK = [[True, True, False], [True, False, False]]


@pytest.mark.parametrize(
    ("mode", "kwargs", "expected"),
    [
        ("token-mean", {"num_tokens_global": 3}, 7 / 3),
        ("seq-mean-token-mean", {"num_seqs_global": 2}, (1.5 + 4.0) / 2),
        ("seq-mean-token-sum", {"num_seqs_global": 2}, 7 / 2),
        ("seq-mean-token-sum-norm", {"norm_constant": 4}, 7 / 4),
    ],
)
def test_aggregate_modes(mode, kwargs, expected):
    loss = aggregate(t(PER_TOKEN), torch.tensor(MASK), mode=mode, **kwargs)
    assert loss.item() == pytest.approx(expected, rel=1e-12)


def test_aggregate_uses_the_global_denominator_not_the_local_count():
    loss = aggregate(t(PER_TOKEN), torch.tensor(MASK), mode="token-mean", num_tokens_global=10)
    assert loss.item() == pytest.approx(0.7)


def test_aggregate_sequence_without_valid_tokens_adds_zero():
    mask = torch.tensor([[True, True, False], [False, False, False]])
    loss = aggregate(t(PER_TOKEN), mask, mode="seq-mean-token-mean", num_seqs_global=2)
    assert loss.item() == pytest.approx(0.75)


def test_aggregate_errors():
    x, m = t(PER_TOKEN), torch.tensor(MASK)
    with pytest.raises(ValueError, match="token-mean.*seq-mean-token-sum-norm"):
        aggregate(x, m, mode="token_mean", num_tokens_global=3)
    for mode in AGG_MODES:
        with pytest.raises(ValueError, match="needs"):
            aggregate(x, m, mode=mode)
    with pytest.raises(ValueError, match="> 0"):
        aggregate(x, m, mode="token-mean", num_tokens_global=0)


# (log ratio, advantage, kwargs) -> (per-token loss, d loss / d logp, clipped, dual)
PPO_CASES = [
    pytest.param(math.log(1.5), 1.0, {}, -1.2, 0.0, True, False, id="A>0 above 1+eps: clipped"),
    pytest.param(math.log(1.25), 1.0, {"clip_high": 0.28}, -1.25, -1.25, False, False, id="clip-higher"),
    pytest.param(math.log(0.5), -1.0, {}, 0.8, 0.0, True, False, id="A<0 below 1-eps: clipped"),
    pytest.param(math.log(1.5), -1.0, {}, 1.5, 1.5, False, False, id="A<0 above: unclipped"),
    pytest.param(math.log(0.5), 1.0, {}, -0.5, -0.5, False, False, id="A>0 below: unclipped"),
    pytest.param(math.log(4.0), -1.0, {"dual_clip": 3.0}, 3.0, 0.0, False, True, id="dual clip active"),
    pytest.param(math.log(2.0), -1.0, {"dual_clip": 3.0}, 2.0, 2.0, False, False, id="dual clip inactive"),
    pytest.param(math.log(4.0), 1.0, {"dual_clip": 3.0}, -1.2, 0.0, True, False, id="dual clip ignores A>0"),
]


@pytest.mark.parametrize(("log_ratio", "adv", "kwargs", "value", "grad", "clipped", "dual"), PPO_CASES)
def test_clipped_surrogate_single_token(log_ratio, adv, kwargs, value, grad, clipped, dual):
    logp = leaf([[log_ratio - 1.0]])
    kwargs = {"clip_low": 0.2, "clip_high": 0.2, **kwargs}
    loss, stats = clipped_surrogate(
        logp, t([[-1.0]]), t([[adv]]), torch.tensor([[True]]), num_tokens_global=1, **kwargs
    )
    loss.backward()
    assert loss.item() == pytest.approx(value, rel=1e-12)
    assert logp.grad.item() == pytest.approx(grad, rel=1e-12, abs=1e-15)
    assert stats.clip_fraction.item() == float(clipped or dual)
    assert stats.dual_clip_fraction.item() == float(dual)
    assert stats.mean_ratio.item() == pytest.approx(math.exp(log_ratio))


def test_clipped_surrogate_legacy_call_and_stats():
    """The learner calls it as (logp, logp_old, adv, mask, *, clip_low, clip_high, num_tokens_global)."""
    logp = t([[math.log(1.5), math.log(1.1), 5.0]])
    mask = torch.tensor([[True, True, False]])
    loss, stats = clipped_surrogate(
        logp,
        torch.zeros(1, 3, dtype=F64),
        t([[1.0, 1.0, 1.0]]),
        mask,
        clip_low=0.2,
        clip_high=0.2,
        num_tokens_global=4,
    )
    assert loss.item() == pytest.approx(-(1.2 + 1.1) / 4)
    assert stats.clip_fraction.item() == 0.5
    assert stats.num_tokens.item() == 2
    assert stats.mean_ratio.item() == pytest.approx(1.3)
    assert not stats.clip_fraction.requires_grad


def test_weight_multiplies_per_token_loss_and_is_detached():
    logp = leaf([[0.1, -0.2]])
    weight = torch.tensor([[2.0, 0.5]], dtype=F64, requires_grad=True)
    mask = torch.ones(1, 2, dtype=torch.bool)
    adv = t([[1.0, -2.0]])
    loss, _ = clipped_surrogate(
        logp, t([[0.0, 0.0]]), adv, mask, weight, clip_low=0.5, clip_high=0.5, num_tokens_global=2
    )
    loss.backward()
    ratio = torch.exp(t([[0.1, -0.2]]))
    torch.testing.assert_close(loss, (-(adv * ratio) * weight.detach()).sum() / 2)
    torch.testing.assert_close(logp.grad, -(adv * ratio) * weight.detach() / 2)
    assert weight.grad is None


def test_clip_argument_errors():
    args = (t([[0.0]]), t([[0.0]]), t([[1.0]]), torch.tensor([[True]]))
    with pytest.raises(ValueError, match="dual_clip"):
        clipped_surrogate(*args, dual_clip=1.0, num_tokens_global=1)
    with pytest.raises(ValueError, match="clip_low"):
        clipped_surrogate(*args, clip_low=1.5, num_tokens_global=1)
    with pytest.raises(ValueError, match="aggregation mode"):
        gspo_loss(*args, mode="seq-mean", num_seqs_global=1)


def test_gspo_equals_sequence_level_objective():
    logp = leaf([[-1.0, -2.0, 0.0]])
    logp_old = t([[-1.2, -2.4, 7.0]])
    mask = torch.tensor([[True, True, False]])
    loss, stats = gspo_loss(
        logp, logp_old, t([[2.0, 2.0, 2.0]]), mask, clip_low=1.0, clip_high=10.0, num_seqs_global=1
    )
    loss.backward()
    s = math.exp(0.3)  # mean of log-ratios 0.2 and 0.4
    assert loss.item() == pytest.approx(-2.0 * s)
    # d/dlogp_t of -A * exp(mean_t(logp - old)) = -A * s / |y|
    torch.testing.assert_close(logp.grad, t([[-s, -s, 0.0]]))
    assert stats.mean_ratio.item() == pytest.approx(s)


def test_gspo_clips_on_the_sequence_ratio_with_default_eps():
    logp = leaf([[-1.0, -1.0]])
    logp_old = t([[-1.001, -1.0]])  # s = exp(0.0005) > 1 + 4e-4
    mask = torch.ones(1, 2, dtype=torch.bool)
    loss, stats = gspo_loss(logp, logp_old, t([[1.0, 1.0]]), mask, num_seqs_global=1)
    loss.backward()
    assert loss.item() == pytest.approx(-(1 + 4e-4))
    assert torch.equal(logp.grad, torch.zeros(1, 2, dtype=F64))
    assert stats.clip_fraction.item() == 1.0


def test_gspo_log_ratio_clamped_at_10():
    mask = torch.ones(1, 1, dtype=torch.bool)
    loss, _ = gspo_loss(t([[0.0]]), t([[-50.0]]), t([[-1.0]]), mask, num_seqs_global=1)
    assert loss.item() == pytest.approx(math.exp(10.0))


@pytest.mark.parametrize(
    ("ratio", "adv", "kwargs", "grad", "changed"),
    [
        pytest.param(1.5, 1.0, {}, -1.28, True, id="weight truncated at 1+eps_high"),
        pytest.param(1.5, 1.0, {"unified_mask": True}, 0.0, True, id="unified mask drops A>0, r high"),
        pytest.param(0.5, -1.0, {}, 0.5, False, id="no lower bound by default"),
        pytest.param(0.5, -1.0, {"unified_mask": True}, 0.5, False, id="clip_low=1 never drops"),
        pytest.param(0.5, -1.0, {"clip_low": 0.2}, 0.8, True, id="lower bound when asked"),
        pytest.param(
            0.5, -1.0, {"clip_low": 0.2, "unified_mask": True}, 0.0, True, id="unified drops A<0, r low"
        ),
        pytest.param(1.1, -2.0, {"unified_mask": True}, 2.2, False, id="inside range"),
    ],
)
def test_cispo_single_token(ratio, adv, kwargs, grad, changed):
    logp = leaf([[-0.7]])
    mask = torch.tensor([[True]])
    loss, stats = cispo_loss(
        logp, t([[-0.7 - math.log(ratio)]]), t([[adv]]), mask, num_tokens_global=1, **kwargs
    )
    loss.backward()
    # l = -A sg(r_hat) sg(M) logp, so d l / d logp = -A r_hat M and l = (d l / d logp) * logp.
    assert logp.grad.item() == pytest.approx(grad, rel=1e-12)
    assert loss.item() == pytest.approx(grad * -0.7, rel=1e-12)
    assert stats.clip_fraction.item() == float(changed)
    assert stats.mean_ratio.item() == pytest.approx(ratio)


def test_every_registry_entry_declares_its_functions_defaults():
    """The registry's clip range and parameters are the loss function's own keyword defaults, so
    the config and a direct call of the function agree (`asyncrl/learner/policy_losses.py`)."""
    import inspect

    from asyncrl.learner.policy_losses import POLICY_LOSSES

    for name, entry in POLICY_LOSSES.items():
        assert entry.name == name
        params = inspect.signature(entry.fn).parameters.values()
        keywords = {p.name: p.default for p in params if p.kind is p.KEYWORD_ONLY}
        if entry.clip is None:
            assert "clip_low" not in keywords and "clip_high" not in keywords, name
        else:
            assert (keywords["clip_low"], keywords["clip_high"]) == entry.clip, name
        assert ("dual_clip" in keywords) == entry.dual_clip, name
        for key, default in entry.params.items():
            assert keywords[key] == default, (name, key)
