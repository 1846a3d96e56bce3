"""Value tests for the advantage estimators on hand-computed groups (float64)."""

from __future__ import annotations

import math

import pytest
import torch

from asyncrl.learner.advantages import (
    dr_grpo_advantages,
    group_rewards,
    grpo_advantages,
    k1_reward_to_go,
    k1_sequence_penalty,
    mc_grpo_advantages,
    rloo_advantages,
    sequence_advantages,
    token_advantages,
)

F64 = torch.float64


def t(rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=F64)


def test_grpo_unbiased_std_and_eps():
    adv = grpo_advantages(t([[1.0, 0.0, 0.0, 1.0]]))
    std = math.sqrt(1.0 / 3.0)  # ddof=1: sum of squares 1.0 over N-1 = 3
    expected = 0.5 / (std + 1e-6)
    torch.testing.assert_close(adv, t([[expected, -expected, -expected, expected]]))


def test_grpo_population_std():
    adv = grpo_advantages(t([[1.0, 0.0, 0.0, 1.0]]), unbiased=False)
    expected = 0.5 / (0.5 + 1e-6)
    torch.testing.assert_close(adv, t([[expected, -expected, -expected, expected]]))


def test_grpo_custom_eps():
    adv = grpo_advantages(t([[2.0, 0.0]]), eps=1.0)
    std = math.sqrt(2.0)
    torch.testing.assert_close(adv, t([[1.0 / (std + 1.0), -1.0 / (std + 1.0)]]))


@pytest.mark.parametrize("estimator", [grpo_advantages, dr_grpo_advantages, rloo_advantages])
def test_all_equal_group_is_exactly_zero(estimator):
    """Regression: mean([0.1]*3) != 0.1 in float, and the 1-ulp residue / (tiny std + eps) was non-zero."""
    rewards = t([[0.1, 0.1, 0.1], [7.0, 7.0, 7.0], [1.0, 2.0, 3.0]])
    adv = estimator(rewards)
    assert torch.equal(adv[:2], torch.zeros(2, 3, dtype=F64))
    assert (adv[2] != 0).any()


@pytest.mark.parametrize("estimator", [grpo_advantages, dr_grpo_advantages, rloo_advantages])
def test_group_of_one_is_zero(estimator):
    assert torch.equal(estimator(t([[3.0], [-1.0]])), torch.zeros(2, 1, dtype=F64))


def test_dr_grpo_mean_only():
    torch.testing.assert_close(dr_grpo_advantages(t([[3.0, 1.0, 2.0, 5.0]])), t([[0.25, -1.75, -0.75, 2.25]]))


def test_rloo_is_leave_one_out():
    rewards = t([[3.0, 1.0, 2.0, 5.0]])
    expected = [3 - 8 / 3, 1 - 10 / 3, 2 - 9 / 3, 5 - 6 / 3]
    torch.testing.assert_close(rloo_advantages(rewards), t([expected]))


def test_mc_grpo_median_mad_and_rescale():
    # median 3 (index 0), |dev| = [0, 2, 1, 2, 1] -> MAD 1; 4 non-zero of 5 -> x 5/4.
    out = mc_grpo_advantages(t([[3.0, 1.0, 2.0, 5.0, 4.0]]))
    expected = torch.tensor([0.0, -2.0, -1.0, 2.0, 1.0], dtype=F64) / 1.001 * 1.25
    torch.testing.assert_close(out.adv_GN, expected[None])
    assert out.pivot_GN.tolist() == [[True, False, False, False, False]]


def test_mc_grpo_binary_rewards_mad_zero():
    # median 1, MAD 0 -> scale 1e-3; the two zeros are the only non-zero advantages -> x 5/2.
    out = mc_grpo_advantages(t([[1.0, 0.0, 0.0, 1.0, 1.0]]))
    torch.testing.assert_close(out.adv_GN, t([[0.0, -2500.0, -2500.0, 0.0, 0.0]]))
    # Stable order of ties: the pivot is the first reward-1 sample.
    assert out.pivot_GN.tolist() == [[True, False, False, False, False]]


def test_mc_grpo_degenerate_group_and_one_pivot_per_group():
    out = mc_grpo_advantages(t([[0.0, 0.0, 0.0], [2.0, 9.0, 4.0]]))
    assert torch.equal(out.adv_GN[0], torch.zeros(3, dtype=F64))
    assert out.pivot_GN.sum(dim=1).tolist() == [1, 1]
    assert out.pivot_GN[1].tolist() == [False, False, True]
    assert out.adv_GN[out.pivot_GN].abs().max() == 0


def test_mc_grpo_matches_torch_median_values():
    rewards = torch.randn(16, 7, generator=torch.Generator().manual_seed(0), dtype=F64)
    out = mc_grpo_advantages(rewards)
    torch.testing.assert_close(rewards[out.pivot_GN], rewards.median(dim=1).values)
    # Even group: lower median, as torch.median.
    even = t([[4.0, 1.0, 3.0, 2.0]])
    assert even[mc_grpo_advantages(even).pivot_GN].item() == 2.0


def test_k1_reward_to_go_values_and_masking():
    delta = t([[1.0, 2.0, 3.0, float("nan")], [1.0, float("inf"), 2.0, 0.5]])
    mask = torch.tensor([[True, True, True, False], [True, False, True, True]])
    rtg = k1_reward_to_go(delta, mask, kl_coef=0.1)
    torch.testing.assert_close(rtg, t([[-0.6, -0.5, -0.3, 0.0], [-0.35, 0.0, -0.25, -0.05]]))


def test_k1_reward_is_detached():
    delta = torch.ones(1, 3, dtype=F64, requires_grad=True)
    mask = torch.ones(1, 3, dtype=torch.bool)
    assert not k1_reward_to_go(delta, mask, kl_coef=1.0).requires_grad
    assert not k1_sequence_penalty(delta, mask, kl_coef=1.0).requires_grad


def test_k1_sequence_penalty():
    delta = t([[1.0, 2.0, float("-inf")]])
    mask = torch.tensor([[True, True, False]])
    torch.testing.assert_close(k1_sequence_penalty(delta, mask, kl_coef=0.5), t([-1.5]))


def test_group_scatter_gather_roundtrip():
    reward_B = t([10.0, 11.0, 20.0, 21.0])
    group_B = torch.tensor([1, 0, 1, 0])
    slot_B = torch.tensor([0, 1, 1, 0])
    rewards_GN = group_rewards(reward_B, group_B, slot_B, num_groups=2, group_size=2)
    torch.testing.assert_close(rewards_GN, t([[21.0, 11.0], [10.0, 20.0]]))
    adv_B = sequence_advantages(dr_grpo_advantages(rewards_GN), group_B, slot_B)
    torch.testing.assert_close(adv_B, t([-5.0, -5.0, 5.0, 5.0]))
    mask = torch.tensor([[True, False], [True, True], [False, False], [True, True]])
    torch.testing.assert_close(
        token_advantages(adv_B, mask), t([[-5.0, 0.0], [-5.0, -5.0], [0.0, 0.0], [5.0, 5.0]])
    )


def test_group_rewards_rejects_missing_or_duplicate_slots():
    with pytest.raises(ValueError, match="exactly once"):
        group_rewards(t([1.0, 2.0]), torch.tensor([0, 0]), torch.tensor([0, 0]), num_groups=1, group_size=2)
