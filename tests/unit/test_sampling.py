"""The torch generator's behavior log-probs equal a fresh forward pass's log-probs of the sampled
tokens at the sampling temperature (and under the top-p nucleus when top_p < 1)."""

from __future__ import annotations

import pytest
import torch

from asyncrl.models.sampling import answer_ids, generate, next_token_logprobs


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


def test_ignore_eos_samples_every_completion_to_the_budget(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    kwargs = dict(max_new_tokens=6, temperature=1.0, eos_token_id=2, pad_token_id=0, seeds=list(range(16)))
    stopped = generate(model, [[1, 5]] * 16, **kwargs)
    full = generate(model, [[1, 5]] * 16, ignore_eos=True, **kwargs)
    assert any(len(ids) < 6 for ids in stopped.completion_ids)  # else the case proves nothing
    for short, ids, logps, reason in zip(
        stopped.completion_ids, full.completion_ids, full.logprobs, full.finish_reasons, strict=True
    ):
        assert len(ids) == len(logps) == 6 and reason == "length"
        assert ids[: len(short)] == short  # the same draws up to where the answer ended
        assert answer_ids(ids, 2) == [t for t in short if t != 2]


def test_answer_ids_is_the_completion_up_to_its_first_eos():
    assert answer_ids([5, 6, 2], 2) == [5, 6]
    assert answer_ids([5, 2, 7, 2, 2], 2) == [5]
    assert answer_ids([5, 6], 2) == [5, 6]
    assert answer_ids([2, 5], 2) == []
    assert answer_ids([5, 2], None) == [5, 2]


def test_nucleus_renormalises():
    logits = torch.tensor([[2.0, 1.0, 0.5, -3.0]])
    logp = next_token_logprobs(logits, temperature=1.0, top_p=0.8)
    assert torch.isclose(logp.exp().sum(), torch.tensor(1.0))
    assert torch.isinf(logp[0, 3]) and logp[0, 3] < 0


def test_torch_generator_with_ignore_eos_scores_the_answer_up_to_its_eos():
    """The shipped model can add; with `ignore_eos` it samples on past its answer's eos, and the
    verifier still reads the answer (reading on would score every answer 0)."""
    from asyncrl.config_sections import SamplingConfig, TaskConfig
    from asyncrl.generators.base import GeneratorContext
    from asyncrl.generators.torch_gen import TorchGenerator
    from asyncrl.messages import PromptTask, SamplingParams
    from asyncrl.models.default import DEFAULT_MODEL_DIR
    from asyncrl.tasks.base import make_task

    gen = TorchGenerator()
    ctx = GeneratorContext(
        generator_id="g0",
        model_path=str(DEFAULT_MODEL_DIR),
        sampling=SamplingConfig(),
        task=TaskConfig(),
        seed=0,
    )
    gen.setup(ctx)
    tok = gen.tokenizer
    params = SamplingParams(temperature=1.0, max_new_tokens=8, ignore_eos=True)
    problems = [("12+39=", "51"), ("7+8=", "15"), ("30+41=", "71")]
    batch = [
        PromptTask(
            task_id=i,
            group_id=i,
            prompt_ids=tok(p)["input_ids"],
            num_samples=8,
            sampling=params,
            dataset_index=i,
            window=0,
            answer=a,
        )
        for i, (p, a) in enumerate(problems)
    ]
    rollouts = gen.generate_sync(batch)
    verify = make_task(TaskConfig()).score
    for r in rollouts:
        assert len(r.completion_ids) == len(r.behavior_logprobs) == 8 and r.finish_reason == "length"
        answer = tok.decode(answer_ids(r.completion_ids, tok.eos_token_id), skip_special_tokens=True)
        assert r.reward == verify(problems[r.task_id][0], answer, problems[r.task_id][1])
    assert sum(r.reward for r in rollouts) > 0


class _EveryPositionLM(torch.nn.Module):
    """The wrapped model without `logits_to_keep`: its prefill returns the logits of every position."""

    def __init__(self, model) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask, position_ids, use_cache, cache=None):
        return self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=use_cache,
            cache=cache,
        )


def test_cpu_prefill_computes_every_position(tiny_model_dir):
    """Off the CPU the prefill asks for the last position's logits only (`logits_to_keep`); on it
    every position's are computed as before, since the last rows of a smaller product can differ
    in the last bit (they do for this model): CPU ids and log-probs stay bit-for-bit."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    prompts = [[1, 5, 6, 14, 7], [1, 9, 14, 11, 17], [1, 4, 17]]
    kwargs = dict(
        max_new_tokens=6,
        temperature=1.0,
        eos_token_id=2,
        pad_token_id=0,
        seeds=[3, 4, 5],
        num_extra_samples=2,
    )
    last_only = generate(model, prompts, **kwargs)
    assert last_only == generate(_EveryPositionLM(model), prompts, **kwargs)
