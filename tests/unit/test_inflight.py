"""In-flight weight updates in the sampler (weights.inflight = keep | retract | abort) and
per-sample determinism: per-token versions and behavior log-probs stay exact when new weights land
between decode steps, checked against forwards of the right weights, one sequence at a time."""

from __future__ import annotations

import pytest
import torch

from asyncrl.models.sampling import generate, inverse_cdf_sample, next_token_logprobs, sample_seed

PROMPTS = [[1, 5, 6, 14, 7], [1, 9, 14, 11, 17], [1, 4, 17], [1, 8]]  # different lengths: left padding
MAX_NEW = 6
SWITCH_AFTER = 2  # the update lands after this many tokens were sampled
TEMPERATURE = 0.9


@pytest.fixture(scope="module")
def models(tiny_model_dir):
    """Version 0 (as saved) and version 1 (perturbed): one frozen model per version."""
    from transformers import AutoModelForCausalLM

    m0 = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    m1 = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in m1.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=g))
    return {0: m0, 1: m1}


def run(tiny_model_dir, models, mode: str, *, eos: int = 2):
    """Sample with a live model that receives version 1's weights after SWITCH_AFTER tokens."""
    from transformers import AutoModelForCausalLM

    live = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    version = [0]
    calls = [0]

    def poll_update() -> bool:
        calls[0] += 1
        if calls[0] != SWITCH_AFTER:
            return False
        live.load_state_dict(models[1].state_dict())
        version[0] = 1
        return True

    out = generate(
        live,
        PROMPTS,
        max_new_tokens=MAX_NEW,
        temperature=TEMPERATURE,
        eos_token_id=eos,
        pad_token_id=0,
        seeds=[sample_seed(3, 10, i) for i in range(len(PROMPTS))],
        current_version=lambda: version[0],
        poll_update=poll_update,
        inflight=mode,
    )
    assert out.num_weight_updates == 1
    return out


def logp_of(logits_V: torch.Tensor, tok: int) -> float:
    return float(next_token_logprobs(logits_V[None], temperature=TEMPERATURE, top_p=1.0)[0, tok])


def fresh_logprobs(models, prompt, ids, versions) -> list[float]:
    """Token j under a full, uncached forward of prompt + ids[:j] with the weights of versions[j]."""
    out = []
    with torch.no_grad():
        for j, (tok, v) in enumerate(zip(ids, versions, strict=True)):
            seq = torch.tensor([list(prompt) + list(ids[:j])])
            out.append(logp_of(models[v](input_ids=seq).logits[0, -1], tok))
    return out


def replayed_logprobs(models, prompt, ids, versions) -> list[float]:
    """`keep`: each position is fed once, by the weights of the token its logits produce, on the
    KV cache built so far (the prompt by versions[0], token j-1 by versions[j])."""
    from asyncrl.models.sampling import _cache_keyword, _cache_of

    out = []
    with torch.no_grad():
        res = models[versions[0]](input_ids=torch.tensor([prompt]), use_cache=True)
        out.append(logp_of(res.logits[0, -1], ids[0]))
        for j in range(1, len(ids)):
            model = models[versions[j]]
            res = model(
                input_ids=torch.tensor([[ids[j - 1]]]),
                use_cache=True,
                **{_cache_keyword(model): _cache_of(res)},
            )
            out.append(logp_of(res.logits[0, -1], ids[j]))
    return out


@pytest.mark.parametrize("mode", ["keep", "retract"])
def test_keep_and_retract_switch_versions_mid_sample(tiny_model_dir, models, mode: str) -> None:
    out = run(tiny_model_dir, models, mode, eos=-1)  # no eos: every sample spans the switch
    for prompt, ids, logps, versions in zip(
        PROMPTS, out.completion_ids, out.logprobs, out.versions, strict=True
    ):
        assert len(ids) == MAX_NEW
        assert versions == [0] * SWITCH_AFTER + [1] * (MAX_NEW - SWITCH_AFTER)
        reference = (replayed_logprobs if mode == "keep" else fresh_logprobs)(models, prompt, ids, versions)
        assert logps == pytest.approx(reference, abs=1e-5)


def test_keep_differs_from_a_fresh_forward_after_the_switch(tiny_model_dir, models) -> None:
    """Guards the test above: under keep the stale KV cache matters, so only the replay matches."""
    out = run(tiny_model_dir, models, "keep", eos=-1)
    prompt, ids, logps, versions = PROMPTS[0], out.completion_ids[0], out.logprobs[0], out.versions[0]
    fresh = fresh_logprobs(models, prompt, ids, versions)
    assert logps[:SWITCH_AFTER] == pytest.approx(fresh[:SWITCH_AFTER], abs=1e-5)
    assert max(abs(a - b) for a, b in zip(logps[SWITCH_AFTER:], fresh[SWITCH_AFTER:], strict=True)) > 1e-3


def test_abort_restarts_unfinished_samples_under_the_new_weights(tiny_model_dir, models) -> None:
    out = run(tiny_model_dir, models, "abort", eos=-1)
    for prompt, ids, logps, versions in zip(
        PROMPTS, out.completion_ids, out.logprobs, out.versions, strict=True
    ):
        assert len(ids) == MAX_NEW  # a full budget after the restart
        assert versions == [1] * MAX_NEW
        assert logps == pytest.approx(fresh_logprobs(models, prompt, ids, versions), abs=1e-5)


@pytest.mark.parametrize("mode", ["keep", "retract", "abort"])
def test_modes_with_eos_stay_exact(tiny_model_dir, models, mode: str) -> None:
    """Some samples may end before the switch; finished ones keep their version-0 tokens."""
    out = run(tiny_model_dir, models, mode, eos=2)
    reference_fn = replayed_logprobs if mode == "keep" else fresh_logprobs
    for prompt, ids, logps, versions in zip(
        PROMPTS, out.completion_ids, out.logprobs, out.versions, strict=True
    ):
        assert len(ids) == len(logps) == len(versions) >= 1
        assert versions == sorted(versions)
        assert logps == pytest.approx(reference_fn(models, prompt, ids, versions), abs=1e-5)


def test_a_sample_does_not_depend_on_its_batch(models) -> None:
    """Per-sample RNG: the same (seed, group, index) gives the same completion alone or batched."""
    model = models[0]
    common = dict(max_new_tokens=MAX_NEW, temperature=1.0, eos_token_id=2, pad_token_id=0)
    seeds = [sample_seed(0, g, k) for g, k in [(5, 0), (5, 1), (6, 0), (9, 3)]]
    batched = generate(model, PROMPTS, seeds=seeds, **common)
    alone = [generate(model, [p], seeds=[s], **common) for p, s in zip(PROMPTS, seeds, strict=True)]
    shuffled = generate(model, PROMPTS[::-1], seeds=seeds[::-1], **common)
    for i in range(len(PROMPTS)):
        assert batched.completion_ids[i] == alone[i].completion_ids[0]
        assert batched.completion_ids[i] == shuffled.completion_ids[len(PROMPTS) - 1 - i]
        assert batched.logprobs[i] == pytest.approx(alone[i].logprobs[0], abs=1e-5)
    other = generate(model, PROMPTS, seeds=[s + 1 for s in seeds], **common)
    assert other.completion_ids != batched.completion_ids


def test_sample_seeds_differ_per_sample_and_are_stable() -> None:
    seeds = {sample_seed(r, g, k) for r in range(3) for g in range(5) for k in range(8)}
    assert len(seeds) == 3 * 5 * 8
    assert sample_seed(1, 2, 3) == sample_seed(1, 2, 3)
    assert all(0 <= s < 1 << 63 for s in seeds)


def test_inverse_cdf_never_picks_a_masked_token() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.5, -3.0], [0.0, 0.0, 0.0, 0.0]])
    logp = next_token_logprobs(logits, temperature=1.0, top_p=0.8)
    for u in [0.0, 0.1, 0.5, 0.79, 0.999999, 1.0 - 1e-16]:
        tok = inverse_cdf_sample(logp, torch.full((2,), u))
        assert torch.isfinite(logp.gather(1, tok[:, None])).all()
    # monotone in u: low draws pick the first kept token, high ones the last
    assert inverse_cdf_sample(logp, torch.tensor([0.0, 0.0])).tolist() == [0, 0]


def test_bad_inflight_mode_or_seed_count_is_rejected(models) -> None:
    with pytest.raises(ValueError, match="inflight"):
        generate(
            models[0], [[1]], max_new_tokens=1, temperature=1.0, eos_token_id=2, pad_token_id=0, inflight="x"
        )
    with pytest.raises(ValueError, match="seeds"):
        generate(
            models[0], [[1]], max_new_tokens=1, temperature=1.0, eos_token_id=2, pad_token_id=0, seeds=[1, 2]
        )
