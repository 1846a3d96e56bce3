"""Sequence packing (issue #38): rows of mixed, long-tailed lengths run as one flat sequence per
micro-batch (`PolicyLM`'s layout, `asyncrl/models/shared_prefix.py`): no padding, position ids
restarting per sequence, attention confined to each sequence. Its log-probs, entropies and
gradients equal the padded forward's to 1e-10 in float64, with distinct prompts (packing alone)
and with GRPO groups sharing prompts (packing and shared prefixes together)."""

from __future__ import annotations

import pytest
import torch

from asyncrl.benchmarks.learner_packing import long_tailed_rows
from asyncrl.models import shared_prefix
from asyncrl.models.policy import PolicyLM
from tests.unit.test_shared_prefix import _logp_and_grads, make_lm

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.mark.parametrize("group_size", [1, 4], ids=["distinct_prompts", "shared_prompts"])
@pytest.mark.parametrize("kernel", ["matmul", "fused"])
def test_packed_forward_equals_the_padded_forward_on_long_tailed_rows(monkeypatch, group_size, kernel):
    if kernel == "fused":  # what GPUs and large problems take: the fused kernel with the same mask
        monkeypatch.setattr(shared_prefix, "MATMUL_MAX_SCORES", 0)
    ids, lengths, completion = long_tailed_rows(
        rows=12, group_size=group_size, prompt_len=3, median_len=4, max_len=40, vocab=23, seed=5
    )
    ids[:, 0] = 1 + torch.arange(12) // group_size  # prompts that differ from their first token
    assert int(lengths.max()) >= 3 * int(lengths.median())  # a long tail: most of the batch is padding
    layout = shared_prefix.plan_layout(ids, lengths)
    assert layout is not None
    flat = layout.flat_ids_N.numel()
    if group_size == 1:  # distinct prompts: every real token once, nothing else
        assert flat == int(lengths.sum())
    else:  # and each group's prompt once
        assert flat == int(lengths.sum()) - 3 * (group_size - 1) * (12 // group_size)
    # Position ids restart with each sequence (row b's tokens hold positions 0 .. len_b - 1).
    assert sorted(layout.positions_N.tolist()) == sorted(
        p
        for b in range(12)
        for p in range(int(lengths[b]))
        if group_size == 1 or b % group_size == 0 or p >= 3
    )
    lm = make_lm(kv_heads=2)
    mask = completion.clone()
    ref = _logp_and_grads(PolicyLM(lm, share_prefixes=False), ids, None, mask)
    got = _logp_and_grads(PolicyLM(lm), ids, lengths, mask)
    torch.testing.assert_close(got[0], ref[0], rtol=0, atol=1e-12)
    torch.testing.assert_close(got[1], ref[1], rtol=0, atol=1e-12)
    for g, r in zip(got[2], ref[2], strict=True):
        torch.testing.assert_close(g, r, rtol=1e-10, atol=1e-12)
