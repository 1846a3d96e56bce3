"""The torch generator's behavior log-probs equal a fresh forward pass's log-probs of the sampled
tokens at the sampling temperature (and under the top-p nucleus when top_p < 1)."""

from __future__ import annotations

import pytest
import torch

from asyncrl.generators.sampling import generate, next_token_logprobs


def _fresh_logprobs(model, prompt, completion, *, temperature, top_p):
    ids = torch.tensor([list(prompt) + list(completion)])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0]
    out = []
    for j, tok in enumerate(completion):
        pos = len(prompt) + j - 1
        logp = next_token_logprobs(logits[pos : pos + 1], temperature=temperature, top_p=top_p)[0]
        out.append(float(logp[tok]))
    return out


@pytest.mark.parametrize(("temperature", "top_p"), [(1.0, 1.0), (0.7, 1.0), (1.3, 0.9)])
def test_behavior_logprobs_match_fresh_forward(tiny_model_dir, temperature, top_p):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    prompts = [[1, 5, 6, 14, 7], [1, 9, 14, 11, 17], [1, 4, 17]]  # different lengths: left padding
    out = generate(
        model,
        prompts,
        max_new_tokens=6,
        temperature=temperature,
        top_p=top_p,
        eos_token_id=2,
        pad_token_id=0,
        rng=torch.Generator().manual_seed(0),
        current_version=lambda: 4,
    )
    for prompt, ids, logps, versions in zip(
        prompts, out.completion_ids, out.logprobs, out.versions, strict=True
    ):
        assert len(ids) == len(logps) == len(versions) >= 1
        assert versions == [4] * len(ids)
        fresh = _fresh_logprobs(model, prompt, ids, temperature=temperature, top_p=top_p)
        assert logps == pytest.approx(fresh, abs=1e-5)
        assert all(lp <= 0 for lp in logps)


def test_finish_reasons_and_eos(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    out = generate(
        model,
        [[1, 5]] * 8,
        max_new_tokens=3,
        temperature=1.0,
        eos_token_id=2,
        pad_token_id=0,
        rng=torch.Generator().manual_seed(1),
    )
    for ids, reason in zip(out.completion_ids, out.finish_reasons, strict=True):
        assert (reason == "stop") == (ids[-1] == 2)
        assert 2 not in ids[:-1]
        assert len(ids) <= 3


def test_nucleus_renormalises():
    logits = torch.tensor([[2.0, 1.0, 0.5, -3.0]])
    logp = next_token_logprobs(logits, temperature=1.0, top_p=0.8)
    assert torch.isclose(logp.exp().sum(), torch.tensor(1.0))
    assert torch.isinf(logp[0, 3]) and logp[0, 3] < 0
