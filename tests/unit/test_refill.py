"""The continuous batching take rule (`generators/refill.py`), checked against hand-computed
expectations: it takes into a running batch only when the samples running will keep the loop
going for half a mean sample, and never before it has seen a sample finish."""

from __future__ import annotations

import pytest
import torch

from asyncrl.generators.refill import RefillPolicy


def policy(lengths, *, max_new_tokens=10, capacity=8) -> RefillPolicy:
    p = RefillPolicy(max_new_tokens=max_new_tokens, capacity=capacity)
    p.observe(lengths)
    return p


def test_expected_remaining_is_the_mean_overshoot_of_longer_samples():
    p = policy([2, 4, 4, 10])  # equal weights: one exponential factor for all four
    rem = p.expected_remaining().tolist()
    assert rem[0] == pytest.approx((2 + 4 + 4 + 10) / 4)
    assert rem[2] == pytest.approx(((4 - 2) * 2 + (10 - 2)) / 3)
    assert rem[4] == pytest.approx(10 - 4)
    assert rem[9] == pytest.approx(1) and rem[10] == 0.0


def test_nothing_seen_takes_only_into_an_empty_batch():
    p = RefillPolicy(max_new_tokens=10, capacity=8)
    assert p.should_take(0, torch.zeros(0, dtype=torch.long))
    assert not p.should_take(1, torch.tensor([0]))
    assert not policy([3]).should_take(8, torch.zeros(8, dtype=torch.long))  # full


def test_near_equal_lengths_wait_for_the_batch_to_end_a_long_tail_does_not():
    short = policy([4, 4, 5, 4, 3] * 20)
    # Two samples 4 tokens in: at most ~1 more step, less than half a mean sample (~2 tokens).
    assert not short.should_take(2, torch.tensor([4, 4]))
    assert short.should_take(2, torch.tensor([0, 1]))  # they just started: the loop runs on
    tail = policy([4] * 90 + [10] * 10)
    # Samples 5 tokens in are the long ones: 5 more steps to go, enough to ride along.
    assert tail.should_take(2, torch.tensor([5, 5]))
    assert not tail.should_take(7, torch.tensor([5] * 7))  # only 1 of 8 slots free: < MIN_FREE_FRACTION


def test_recent_lengths_weigh_more():
    p = policy([10] * 50)
    assert p.should_take(2, torch.tensor([2, 2]))  # 8 more steps expected
    p.observe([3] * 1000)
    # Now a sample 2 tokens in almost surely ends at 3: the old long answers barely count.
    assert not p.should_take(2, torch.tensor([2, 2]))
