"""Shared-prefix forward (`asyncrl.models.shared_prefix`): the clusters it picks, and that the
learner's log-probs, entropies and gradients through it equal the padded forward's."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from asyncrl.models import shared_prefix
from asyncrl.models.policy import PolicyLM

transformers = pytest.importorskip("transformers")


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def make_lm(*, kv_heads=1, dtype=torch.float64, seed=0, **extra):
    config = transformers.Qwen2Config(
        vocab_size=23,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=kv_heads,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        **extra,
    )
    torch.manual_seed(seed)
    return transformers.Qwen2ForCausalLM(config).to(dtype)


PAD = 0


def grpo_rows(groups=3, size=4, seed=3):
    """Right-padded rows as the learner packs them: each group's samples share a prompt of its
    own length; completions vary in length, some equal each other (a whole row shared)."""
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for g in range(groups):
        prompt = torch.randint(1, 23, (3 + 2 * g,), generator=gen).tolist()
        for n in range(size):
            comp = torch.randint(1, 23, (1 + (n * 3 + g) % 5,), generator=gen).tolist()
            rows.append(prompt + (comp if n != size - 1 else rows[-1][len(prompt) :]))
    width = max(map(len, rows))
    ids = torch.full((len(rows), width), PAD)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = torch.tensor(row)
    return ids, torch.tensor([len(r) for r in rows])


def test_clusters_maximise_the_tokens_saved():
    # Sorted rows' common prefixes 5, 5, 1, 6: runs {0,1,2} (saves 2 x 5) and {3,4} (1 x 6).
    assert shared_prefix._clusters(np.array([5, 5, 1, 6])) == [(0, 3, 5), (3, 5, 6)]
    # One long run with a short common prefix loses to two runs with longer ones: 3 x 2 < 1 x 9 + 1 x 9.
    assert shared_prefix._clusters(np.array([9, 2, 9])) == [(0, 2, 9), (2, 4, 9)]
    # Nothing shared: every row alone.
    assert shared_prefix._clusters(np.array([0, 0])) == [(0, 1, 0), (1, 2, 0), (2, 3, 0)]


def test_layout_runs_each_prompt_once_and_no_padding():
    ids, lengths = grpo_rows()
    layout = shared_prefix.plan_layout(ids, lengths)
    prompts = 3 + 5 + 7
    suffixes = int(lengths.sum()) - 4 * prompts
    # At most: each prompt once, every row's completion; the duplicated row adds nothing.
    assert layout.num_tokens <= prompts + suffixes
    assert layout.num_tokens < 0.5 * ids.numel()
    # Every real token of every row is at its position in the flat sequence.
    for b in range(ids.shape[0]):
        for t in range(int(lengths[b])):
            at = int(layout.hidden_at_BL[b, t])
            assert int(layout.flat_ids_N[at]) == int(ids[b, t]) and int(layout.positions_N[at]) == t


def test_layout_declines_when_it_saves_little():
    ids = torch.arange(1, 13).view(3, 4)  # three rows with nothing in common, no padding
    assert shared_prefix.plan_layout(ids) is None
    assert shared_prefix.plan_layout(ids[:1]) is None


def _logp_and_grads(policy, ids, lengths, mask, **kw):
    out = policy(ids, lengths_B=lengths, **kw)
    logp = out if isinstance(out, torch.Tensor) else out.logp
    gen = torch.Generator().manual_seed(7)
    weights = torch.randn(logp.shape, generator=gen, dtype=logp.dtype)
    objective = (logp * weights)[mask].sum()
    if not isinstance(out, torch.Tensor):
        objective = objective + (out.entropy * weights.flip(-1))[mask].sum()
    params = [p for p in policy.parameters() if p.requires_grad]
    grads = torch.autograd.grad(objective, params)
    entropy = None if isinstance(out, torch.Tensor) else out.entropy.detach()[mask]
    return logp.detach()[mask], entropy, grads


@pytest.mark.parametrize("kv_heads", [1, 2])
@pytest.mark.parametrize("use_lengths", [True, False])
@pytest.mark.parametrize("kernel", ["matmul", "fused"])
def test_shared_prefix_forward_equals_the_padded_forward(monkeypatch, kv_heads, use_lengths, kernel):
    if kernel == "fused":  # what GPUs and large problems take: the fused kernel with the same mask
        monkeypatch.setattr(shared_prefix, "MATMUL_MAX_SCORES", 0)
    ids, lengths = grpo_rows()
    lm = make_lm(kv_heads=kv_heads)
    padded = PolicyLM(lm, share_prefixes=False)
    shared = PolicyLM(lm)
    assert shared.share_prefixes
    mask = torch.arange(ids.shape[1])[None] < lengths[:, None]
    mask[:, 0] = False
    assert shared_prefix.plan_layout(ids, lengths if use_lengths else None) is not None
    ref = _logp_and_grads(padded, ids, None, mask)
    got = _logp_and_grads(shared, ids, lengths if use_lengths else None, mask)
    torch.testing.assert_close(got[0], ref[0], rtol=0, atol=1e-12)
    torch.testing.assert_close(got[1], ref[1], rtol=0, atol=1e-12)
    for g, r in zip(got[2], ref[2], strict=True):
        torch.testing.assert_close(g, r, rtol=1e-10, atol=1e-12)


def test_candidate_logprobs_equal_the_padded_forward():
    ids, lengths = grpo_rows(groups=2)
    lm = make_lm()
    cands = torch.randint(0, 23, (*ids.shape, 3), generator=torch.Generator().manual_seed(4))
    mask = torch.arange(ids.shape[1])[None] < lengths[:, None]
    mask[:, 0] = False
    ref = _logp_and_grads(PolicyLM(lm, share_prefixes=False), ids, None, mask, candidates_BLN=cands)
    got = _logp_and_grads(PolicyLM(lm), ids, lengths, mask, candidates_BLN=cands)
    torch.testing.assert_close(got[0], ref[0], rtol=0, atol=1e-12)
    for g, r in zip(got[2], ref[2], strict=True):
        torch.testing.assert_close(g, r, rtol=1e-10, atol=1e-12)


def test_float32_rows_with_nothing_left_after_the_prefix_have_finite_gradients():
    ids, lengths = grpo_rows(groups=1, size=3)
    ids = torch.cat([ids, ids])  # every row twice: the copies' tokens are all in the prefix
    lengths = torch.cat([lengths, lengths])
    lm = make_lm(dtype=torch.float32)
    mask = torch.arange(ids.shape[1])[None] < lengths[:, None]
    mask[:, 0] = False
    layout = shared_prefix.plan_layout(ids, lengths)
    assert layout.num_tokens <= int(lengths[:3].sum())
    got = _logp_and_grads(PolicyLM(lm), ids, lengths, mask)
    ref = _logp_and_grads(PolicyLM(lm, share_prefixes=False), ids, None, mask)
    assert all(torch.isfinite(g).all() for g in got[2])
    torch.testing.assert_close(got[0], ref[0], rtol=0, atol=2e-5)


def test_other_forwards_of_the_switched_model_are_sdpa():
    """Evaluation decodes with the same model: left padding and an attention mask, no layout."""
    lm = make_lm(dtype=torch.float32).eval()
    ids = torch.tensor([[0, 0, 5, 6, 7], [3, 4, 5, 6, 7]])
    attn = (ids != 0).long()
    before = lm(input_ids=ids, attention_mask=attn).logits
    assert shared_prefix.enable(lm)
    assert lm.config._attn_implementation == shared_prefix.ATTENTION_NAME
    after = lm(input_ids=ids, attention_mask=attn).logits
    assert torch.equal(before, after)


@pytest.mark.parametrize(
    ("extra", "why"),
    [
        ({"use_sliding_window": True, "sliding_window": 4}, "sliding-window"),
        ({"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 1}, "sliding-window"),
        ({"attn_implementation": "eager"}, "'eager'"),
    ],
)
def test_models_it_cannot_serve_keep_the_padded_forward(extra, why):
    lm = make_lm(**extra)
    assert why in shared_prefix.unsupported_reason(lm)
    policy = PolicyLM(lm)
    assert not policy.share_prefixes
    assert lm.config._attn_implementation != shared_prefix.ATTENTION_NAME


def test_a_sliding_window_size_that_is_switched_off_does_not_count():
    """Qwen2.5's configs name a window size with use_sliding_window false: full attention."""
    lm = make_lm(use_sliding_window=False, sliding_window=4)
    assert shared_prefix.unsupported_reason(lm) is None
    assert PolicyLM(lm).share_prefixes
