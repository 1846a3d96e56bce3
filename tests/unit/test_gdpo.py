"""GDPO (reward-decoupled normalisation) against hand-computed groups (float64)."""

from __future__ import annotations

import math

import pytest
import torch

from asyncrl.learner.advantages import gdpo_advantages, grpo_advantages

F64 = torch.float64
EPS = 1e-6


def t(rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=F64)


def test_collapse_example_groupwise_without_batch_norm():
    # Two rollouts, two binary rewards. Group 0: r1 = (0, 0), r2 = (0, 1): sums (0, 1).
    # Group 1: r1 = (0, 1), r2 = (0, 1): sums (0, 2). GRPO of the sum gives both groups the same
    # advantages; GDPO keeps them apart: group 0's r1 is constant (contributes 0), and for N = 2
    # each non-constant binary reward normalises to -+ (1/2) / (1/sqrt(2) + eps).
    rewards = t([[[0, 0], [0, 1]], [[0, 0], [1, 1]]])
    one = 0.5 / (1 / math.sqrt(2) + EPS)
    adv = gdpo_advantages(rewards, t([1.0, 1.0]), batch_norm=False)
    torch.testing.assert_close(adv, t([[-one, one], [-2 * one, 2 * one]]))
    summed = grpo_advantages(rewards.sum(dim=2))
    torch.testing.assert_close(
        summed[0], summed[1], atol=1e-5, rtol=0
    )  # the collapse GDPO avoids (up to eps)


def test_collapse_example_with_batch_norm():
    # Continuing: the batch (-a, a, -2a, 2a) with a = one has ddof-1 std a * sqrt(10/3), so the
    # advantages become -+ 1/sqrt(10/3) = sqrt(3/10) and -+ 2/sqrt(10/3) = sqrt(6/5).
    rewards = t([[[0, 0], [0, 1]], [[0, 0], [1, 1]]])
    one = 0.5 / (1 / math.sqrt(2) + EPS)
    batch_std = one * math.sqrt(10 / 3)
    adv = gdpo_advantages(rewards, t([1.0, 1.0]))
    expected = t([[-one, one], [-2 * one, 2 * one]]) / (batch_std + EPS)
    torch.testing.assert_close(adv, expected)
    torch.testing.assert_close(adv, t([[-1, 1], [-2, 2]]) * math.sqrt(3 / 10), atol=1e-5, rtol=1e-5)


def test_weights_scale_each_reward_after_its_own_normalisation():
    # One group of four, r1 = (1, 1, 0, 0) (scale 1), r2 = (3, 0, 0, 0) (scale 3), weights (2, 0.5).
    # r1: mean 1/2, std sqrt(1/3) -> +-(1/2)/(sqrt(1/3) + eps).
    # r2: mean 3/4, std sqrt((2.25^2 + 3 * 0.75^2) / 3) = sqrt(2.25) = 1.5 -> (2.25, -0.75 x3)/(1.5 + eps).
    rewards = t([[[1, 3], [1, 0], [0, 0], [0, 0]]])
    a1 = 0.5 / (math.sqrt(1 / 3) + EPS)
    s2 = 1.5 + EPS
    expected = t(
        [
            [
                2 * a1 + 0.5 * 2.25 / s2,
                2 * a1 - 0.5 * 0.75 / s2,
                -2 * a1 - 0.5 * 0.75 / s2,
                -2 * a1 - 0.5 * 0.75 / s2,
            ]
        ]
    )
    adv = gdpo_advantages(rewards, t([2.0, 0.5]), batch_norm=False)
    torch.testing.assert_close(adv, expected)


def test_one_reward_without_batch_norm_is_weighted_grpo():
    rewards = t([[[0.2], [0.9], [0.5]], [[1.0], [0.0], [0.0]]])
    adv = gdpo_advantages(rewards, t([-1.5]), batch_norm=False)
    torch.testing.assert_close(adv, -1.5 * grpo_advantages(rewards[:, :, 0]))


def test_population_std_is_passed_through():
    rewards = t([[[1, 0], [0, 0], [0, 1], [1, 1]]])
    adv = gdpo_advantages(rewards, t([1.0, 1.0]), unbiased=False, batch_norm=False)
    a = 0.5 / (0.5 + EPS)  # each reward has mean 1/2 and population std 1/2
    torch.testing.assert_close(adv, t([[0.0, -2 * a, 0.0, 2 * a]]))


def test_constant_groups_stay_exactly_zero_under_batch_norm():
    # Group 0 has every reward constant (0.1 is not exact in binary: its float mean may be one
    # ulp off); group 1 has signal. Batch normalisation must not give group 0 a non-zero advantage.
    rewards = t([[[0.1, 0.7], [0.1, 0.7], [0.1, 0.7]], [[1, 0], [0, 0], [0, 1]]])
    adv = gdpo_advantages(rewards, t([1.0, 1.0]))
    assert torch.equal(adv[0], torch.zeros(3, dtype=F64))
    assert bool(adv[1].ne(0).any())


def test_all_constant_batch_is_zero():
    rewards = t([[[1, 0], [1, 0]], [[0.3, 0.3], [0.3, 0.3]]])
    adv = gdpo_advantages(rewards, t([1.0, 2.0]))
    assert torch.equal(adv, torch.zeros(2, 2, dtype=F64))


def test_groups_of_one_get_zero():
    adv = gdpo_advantages(t([[[1.0, 0.0]], [[0.0, 1.0]]]), t([1.0, 1.0]))
    assert torch.equal(adv, torch.zeros(2, 1, dtype=F64))


def test_shape_errors_name_the_mismatch():
    with pytest.raises(ValueError, match=r"\[G, N, K\]"):
        gdpo_advantages(t([[1.0, 0.0]]), t([1.0]))
    with pytest.raises(ValueError, match="2 rewards per sample but 3 weights"):
        gdpo_advantages(t([[[1.0, 0.0], [0.0, 1.0]]]), t([1.0, 1.0, 1.0]))
