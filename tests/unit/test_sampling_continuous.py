"""Continuous batching in the sampler (`Sampler` with compact, `kv_batch.DecodeBatch`): samples
join a running batch between decode steps and leave it when done, and each one is the sample it
would be alone: the same token ids, log-probs equal to float tolerance (another batch changes the
matmul shapes and the padding its attention skips, which moves the last bits only), per-token
versions and log-probs exact under in-flight weight updates, every sample back exactly once.

References are independent of the sampler: a full uncached forward of prompt + tokens (or, under
`keep`, a one-sequence replay on its own KV cache with the right weights per position)."""

from __future__ import annotations

import random

import pytest
import torch

from asyncrl.models.kv_batch import DecodeBatch
from asyncrl.models.sampling import Sampler, SampleRequest, generate, next_token_logprobs, sample_seed

# Different lengths, shorter and longer than a running batch's cache, so joins pad either side.
PROMPTS = [[1, 5, 6, 14, 7], [1, 9, 14, 11, 17], [1, 4, 17], [1, 8], [1, 7, 7, 7, 7, 7, 7, 7, 14], [1, 3, 3]]
TEMPERATURE = 1.3
LOGPROB_ABS = 1e-5  # float rounding of another batch shape; a wrong position or version is >1e-2


@pytest.fixture(scope="module")
def models(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    m0 = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    m1 = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for p in m1.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=g))
    return {0: m0, 1: m1}


def requests(num: int, *, group: int = 0) -> list[SampleRequest]:
    return [
        SampleRequest(i, PROMPTS[i % len(PROMPTS)], sample_seed(5, group + i // 4, i % 4)) for i in range(num)
    ]


def fresh_logprobs(models, prompt, ids, versions, temperature=TEMPERATURE) -> list[float]:
    """Token j under an uncached forward of prompt + ids[:j] with the weights of versions[j]."""
    out = []
    with torch.no_grad():
        for j, (tok, v) in enumerate(zip(ids, versions, strict=True)):
            logits = models[v](input_ids=torch.tensor([list(prompt) + list(ids[:j])])).logits[0, -1]
            logp = next_token_logprobs(logits[None], temperature=temperature, top_p=1.0)[0]
            out.append(float(logp[tok]))
    return out


def run_schedule(model, reqs, schedule, *, stop_after=None, **kw):
    """Sample `reqs` with `schedule[s]` of them joining before step s (the rest once the batch
    runs dry); returns {key: FinishedSample} and the sampler."""
    sampler = Sampler(model, **{"eos_token_id": 2, "pad_token_id": 0, **kw})
    queue, out, step = list(reqs), {}, 0
    with torch.no_grad():
        while queue or sampler.num_running:
            joining = (
                schedule[step] if step < len(schedule) else (len(queue) if not sampler.num_running else 0)
            )
            sampler.add(queue[:joining])
            queue = queue[joining:]
            for sample in sampler.step():
                assert sample.key not in out, f"sample {sample.key} came back twice"
                out[sample.key] = sample
            step += 1
    return out, sampler


def alone(model, req, **kw):
    with torch.no_grad():
        return generate(model, [req.prompt_ids], seeds=[req.seed], eos_token_id=2, pad_token_id=0, **kw)


@pytest.mark.parametrize("max_new_tokens", [1, 7])
def test_a_sample_joining_a_running_batch_is_the_sample_alone(models, max_new_tokens):
    kw = dict(max_new_tokens=max_new_tokens, temperature=TEMPERATURE)
    reqs = requests(18)
    out, sampler = run_schedule(models[0], reqs, [3, 0, 4, 1, 0, 5, 2], **kw)
    assert sorted(out) == list(range(len(reqs)))  # each exactly once
    assert sampler.num_running == 0 and sampler._batch is None
    lengths = set()
    for req in reqs:
        got, ref = out[req.key], alone(models[0], req, **kw)
        assert got.completion_ids == ref.completion_ids[0]
        assert got.finish_reason == ref.finish_reasons[0]
        assert got.versions == [0] * len(got.completion_ids)
        assert got.logprobs == pytest.approx(ref.logprobs[0], abs=LOGPROB_ABS)
        versions = got.versions
        assert got.logprobs == pytest.approx(
            fresh_logprobs(models, req.prompt_ids, got.completion_ids, versions), abs=LOGPROB_ABS
        )
        lengths.add(len(got.completion_ids))
    if max_new_tokens > 1:
        assert len(lengths) > 1  # samples of different lengths: rows left at different steps


def test_random_join_schedules_lose_and_duplicate_nothing(models):
    kw = dict(max_new_tokens=5, temperature=2.5)  # hot: lengths vary
    reqs = requests(30, group=40)
    reference = {r.key: alone(models[0], r, **kw).completion_ids[0] for r in reqs}
    for seed in range(3):
        rng = random.Random(seed)
        schedule = [rng.randint(0, 4) for _ in range(20)]
        out, _ = run_schedule(models[0], reqs, schedule, **kw)
        assert sorted(out) == sorted(reference)
        assert {k: s.completion_ids for k, s in out.items()} == reference


def test_greedy_and_extras_are_the_same_alone_and_joined(models):
    """OPD's extra draws (their own stream) and greedy decoding under continuous batching."""
    for kw in (
        dict(max_new_tokens=6, temperature=TEMPERATURE, num_extra_samples=3),
        dict(max_new_tokens=6, temperature=0.0, num_extra_samples=2),
    ):
        reqs = requests(10, group=7)
        out, _ = run_schedule(models[0], reqs, [2, 3, 0, 2], **kw)
        for req in reqs:
            ref = alone(models[0], req, **kw)
            got = out[req.key]
            assert got.completion_ids == ref.completion_ids[0]
            assert got.extra_ids == ref.extra_ids[0]
            assert len(got.extra_ids) == len(got.completion_ids)
            for row, ref_row in zip(got.extra_logprobs, ref.extra_logprobs[0], strict=True):
                assert row == pytest.approx(ref_row, abs=LOGPROB_ABS)


def test_rows_that_leave_shrink_the_cache_and_keep_the_others_exact(models):
    """`select` keeps the rows asked for and drops columns that only the leavers used; `merge`
    pads the shorter cache; the next logits are those of each row decoded on its own."""
    model = models[0]
    long, short = [1, 7, 7, 7, 7, 7, 7, 7, 14], [1, 4, 17]
    with torch.no_grad():
        batch = DecodeBatch(model, [long, short, [1, 8]], 0, torch.device("cpu"))
        assert batch.attn_BL.shape[1] == len(long)
        batch.select(torch.tensor([1, 2]))  # the long row leaves
        assert batch.attn_BL.shape[1] == len(short)
        batch.merge(DecodeBatch(model, [long], 0, torch.device("cpu")))  # a longer row joins
        assert batch.attn_BL.shape[1] == len(long)
        tok = torch.tensor([5, 6, 9])
        batch.step(tok)
        for i, seq in enumerate([short, [1, 8], long]):
            ref = model(input_ids=torch.tensor([[*seq, int(tok[i])]])).logits[0, -1]
            assert torch.allclose(batch.logits_BV[i], ref, atol=1e-5)
        assert batch.next_pos_B.tolist() == [len(short) + 1, 3, len(long) + 1]


def _replayed(models, prompt, ids, versions, joined_version):
    """`keep`: the prompt was prefilled by the weights held when the sample joined; position j's
    token was fed by the weights that then produced token j's logits (versions[j])."""
    from asyncrl.models.sampling import _cache_keyword, _cache_of

    out = []
    with torch.no_grad():
        res = models[joined_version](input_ids=torch.tensor([prompt]), use_cache=True)
        for j, tok in enumerate(ids):
            if j:
                model = models[versions[j]]
                res = model(
                    input_ids=torch.tensor([[ids[j - 1]]]),
                    use_cache=True,
                    **{_cache_keyword(model): _cache_of(res)},
                )
            logp = next_token_logprobs(res.logits[0, -1][None], temperature=TEMPERATURE, top_p=1.0)[0]
            out.append(float(logp[tok]))
    return out


@pytest.mark.parametrize("mode", ["keep", "retract", "abort"])
def test_inflight_updates_stay_exact_for_rows_that_joined_before_and_after(tiny_model_dir, models, mode):
    from transformers import AutoModelForCausalLM

    live = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    version = [0]
    polls = [0]
    switch_at = 3  # the update lands after the 3rd step; samples join at steps 0, 1 and 4

    def poll_update() -> bool:
        polls[0] += 1
        if polls[0] != switch_at:
            return False
        live.load_state_dict(models[1].state_dict())
        version[0] = 1
        return True

    sampler = Sampler(
        live,
        max_new_tokens=6,
        temperature=TEMPERATURE,
        eos_token_id=-1,  # never: every sample spans the update or starts after it
        pad_token_id=0,
        current_version=lambda: version[0],
        poll_update=poll_update,
        inflight=mode,
    )
    reqs = requests(9, group=3)
    joins = {0: reqs[:4], 1: reqs[4:6], 4: reqs[6:]}
    joined_version = {}
    out = {}
    step = 0
    with torch.no_grad():
        while step in joins or sampler.num_running or any(s > step for s in joins):
            for r in joins.get(step, []):
                joined_version[r.key] = version[0]
            sampler.add(joins.get(step, []))
            out.update({s.key: s for s in sampler.step()})
            step += 1
    assert sampler.num_weight_updates == 1 and sorted(out) == list(range(9))
    for r in reqs:
        s = out[r.key]
        assert len(s.completion_ids) == 6 and s.versions == sorted(s.versions)
        if joined_version[r.key] == 1:
            assert s.versions == [1] * 6
        elif mode == "abort":
            assert s.versions == [1] * 6  # restarted from its prompt under the new weights
        else:
            assert 0 in s.versions and 1 in s.versions
        if mode == "keep":
            ref = _replayed(models, r.prompt_ids, s.completion_ids, s.versions, joined_version[r.key])
        else:
            ref = fresh_logprobs(models, r.prompt_ids, s.completion_ids, s.versions)
        assert s.logprobs == pytest.approx(ref, abs=LOGPROB_ABS)


def test_repeated_aborts_draw_past_the_first_uniforms_like_generate(tiny_model_dir, models):
    """Restarts consume more uniforms than max_new_tokens: the sampler draws more of each stream
    (the same numbers one at a time would give), as `generate` (no compact) does too."""
    from transformers import AutoModelForCausalLM

    def run(compact: bool):
        live = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
        polls = [0]

        def poll_update() -> bool:  # an update after each of the first 5 steps, alternating weights
            polls[0] += 1
            if polls[0] > 5:
                return False
            live.load_state_dict(models[polls[0] % 2].state_dict())
            return True

        kw = dict(
            max_new_tokens=4,
            temperature=TEMPERATURE,
            eos_token_id=-1,
            pad_token_id=0,
            current_version=lambda: min(polls[0], 5) % 2,
            poll_update=poll_update,
            inflight="abort",
        )
        reqs = requests(5, group=9)
        if not compact:
            with torch.no_grad():
                return generate(live, [r.prompt_ids for r in reqs], seeds=[r.seed for r in reqs], **kw)
        out, _ = run_schedule(live, reqs, [5], **kw)
        return [out[r.key] for r in reqs]

    batched, plain = run(True), run(False)
    for i, s in enumerate(batched):
        assert s.completion_ids == plain.completion_ids[i] and s.versions == [1] * 4
        assert s.logprobs == pytest.approx(plain.logprobs[i], abs=LOGPROB_ABS)
        assert s.logprobs == pytest.approx(
            fresh_logprobs(models, PROMPTS[i % len(PROMPTS)], s.completion_ids, s.versions), abs=LOGPROB_ABS
        )


def test_a_cache_rows_cannot_leave_is_refused_with_the_fix(models):
    class OpaqueCache:
        pass

    with torch.no_grad():
        batch = DecodeBatch(models[0], [[1, 5], [1, 6]], 0, torch.device("cpu"))
    batch.cache = OpaqueCache()
    with pytest.raises(ValueError, match="generators.batching = 'batch'"):
        batch.select(torch.tensor([0]))


def test_a_batch_sampler_takes_its_samples_at_once(models):
    sampler = Sampler(
        models[0], max_new_tokens=3, temperature=1.0, eos_token_id=2, pad_token_id=0, compact=False
    )
    with torch.no_grad():
        sampler.add(requests(2))
        with pytest.raises(ValueError, match="without compact"):
            sampler.add(requests(1))
