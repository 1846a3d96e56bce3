"""The generator side of on-policy distillation: the [T, N] cache of ids, behavior log-probs and
teacher log-probs each rollout carries with `opd.enabled`, checked against fresh forwards of the
student and the teacher, one sequence at a time, and its wire frames."""

from __future__ import annotations

import asyncio

import pytest
import torch

from asyncrl.generators.opd import cache_arrays, teacher_logprobs
from asyncrl.models.sampling import generate, next_token_logprobs, sample_seed
from tests.conftest import set_up_generator

PROMPTS = [[1, 5, 6, 14, 7], [1, 9, 14, 11, 17], [1, 4, 17], [1, 8]]  # different lengths: left padding
SEEDS = [sample_seed(3, 7, k) for k in range(len(PROMPTS))]
MAX_NEW = 6
NUM_EXTRA = 3


@pytest.fixture(scope="module")
def student(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory):
    """A second tiny model, same tokenizer, different weights (seed 1)."""
    from asyncrl.models.tiny import create_base

    return create_base(
        tmp_path_factory.mktemp("teacher") / "model", hidden_size=32, num_layers=1, num_heads=2, seed=1
    )


@pytest.fixture(scope="module")
def teacher(teacher_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(teacher_dir).eval()


def sample(model, prompts=PROMPTS, seeds=SEEDS, *, temperature=0.9, top_p=1.0, num_extra=NUM_EXTRA):
    return generate(
        model,
        prompts,
        max_new_tokens=MAX_NEW,
        temperature=temperature,
        top_p=top_p,
        eos_token_id=2,
        pad_token_id=0,
        seeds=seeds,
        num_extra_samples=num_extra,
    )


def fresh_rows(model, prompt, completion, *, temperature, top_p=1.0) -> torch.Tensor:
    """[T, V] log-probs of each completion position from one unpadded forward."""
    ids = torch.tensor([list(prompt) + list(completion)])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0]
    start = len(prompt) - 1
    return next_token_logprobs(logits[start : start + len(completion)], temperature=temperature, top_p=top_p)


# ----------------------------------------------------------------------------- student extras
@pytest.mark.parametrize(("temperature", "top_p"), [(0.9, 1.0), (1.3, 0.8)])
def test_extra_logprobs_are_the_students_at_that_position(student, temperature, top_p):
    out = sample(student, temperature=temperature, top_p=top_p)
    assert out.extra_ids is not None and out.extra_logprobs is not None
    for prompt, ids, extra_ids, extra_logps in zip(
        PROMPTS, out.completion_ids, out.extra_ids, out.extra_logprobs, strict=True
    ):
        assert len(extra_ids) == len(extra_logps) == len(ids)
        rows_TV = fresh_rows(student, prompt, ids, temperature=temperature, top_p=top_p)
        for t in range(len(ids)):
            assert len(extra_ids[t]) == NUM_EXTRA
            expected = rows_TV[t, torch.tensor(extra_ids[t])]
            assert torch.isfinite(expected).all(), "an extra token outside the sampling support"
            assert extra_logps[t] == pytest.approx(expected.tolist(), abs=1e-5)


def test_extras_leave_the_completion_unchanged(student):
    """Extras use their own per-sample stream: the same seeds give the same completions with or
    without them, so turning OPD on does not change what the student samples."""
    plain = sample(student, num_extra=0)
    with_extras = sample(student)
    assert plain.extra_ids is None and plain.extra_logprobs is None
    assert with_extras.completion_ids == plain.completion_ids
    assert with_extras.logprobs == plain.logprobs
    assert with_extras.versions == plain.versions


def test_extras_are_deterministic_per_sample(student):
    """A sample's extras depend on its seed only, not on which samples share its batch."""
    batch = sample(student)
    for i in range(len(PROMPTS)):
        alone = sample(student, [PROMPTS[i]], [SEEDS[i]])
        assert alone.completion_ids[0] == batch.completion_ids[i]
        assert alone.extra_ids[0] == batch.extra_ids[i]
        torch.testing.assert_close(
            torch.tensor(alone.extra_logprobs[0]), torch.tensor(batch.extra_logprobs[i]), atol=1e-6, rtol=0
        )
    assert sample(student).extra_ids == batch.extra_ids


def test_extras_follow_the_students_distribution(student):
    """Many extras at one position: their frequencies match the student's probabilities there."""
    num_draws = 4000
    temperature = 1.5  # flatter, so many tokens get visible mass
    out = sample(student, [PROMPTS[0]], [11], temperature=temperature, num_extra=num_draws)
    first_pos = torch.tensor(out.extra_ids[0][0])
    probs_V = fresh_rows(student, PROMPTS[0], out.completion_ids[0][:1], temperature=temperature)[0].exp()
    freq_V = torch.bincount(first_pos, minlength=probs_V.shape[0]).double() / num_draws
    # Each frequency's standard error is <= 0.5 / sqrt(4000) ~ 0.008; allow about 4 of them.
    assert (freq_V - probs_V.double()).abs().max() < 0.035


def test_greedy_extras_are_drawn_from_log_softmax(student):
    out = sample(student, temperature=0.0)
    for prompt, ids, extra_ids, extra_logps in zip(
        PROMPTS, out.completion_ids, out.extra_ids, out.extra_logprobs, strict=True
    ):
        rows_TV = fresh_rows(student, prompt, ids, temperature=1.0)
        for t in range(len(ids)):
            assert extra_logps[t] == pytest.approx(rows_TV[t, torch.tensor(extra_ids[t])].tolist(), abs=1e-5)


# ----------------------------------------------------------------------------- cache + teacher
def test_cache_arrays_put_the_generated_token_in_column_0():
    ids_TN, logp_TN = cache_arrays(
        [4, 5, 2], [-0.1, -0.2, -0.3], [[6, 7], [8, 9], [10, 11]], [[-1, -2], [-3, -4], [-5, -6]]
    )
    assert ids_TN.dtype == torch.int64 and logp_TN.dtype == torch.float32
    assert ids_TN.tolist() == [[4, 6, 7], [5, 8, 9], [2, 10, 11]]
    assert logp_TN[:, 0].tolist() == pytest.approx([-0.1, -0.2, -0.3])
    assert logp_TN[:, 1:].tolist() == [[-1, -2], [-3, -4], [-5, -6]]
    ids_T1, logp_T1 = cache_arrays([4, 5], [-0.1, -0.2], None, None)
    assert ids_T1.shape == logp_T1.shape == (2, 1)
    with pytest.raises(ValueError, match="must match"):
        cache_arrays([4, 5], [-0.1, -0.2], [[6]], [[-1.0]])


@pytest.mark.parametrize(("batch_rows", "budget_bytes"), [(32, 1 << 30), (3, 1 << 30), (32, 1)])
def test_teacher_logprobs_equal_a_fresh_teacher_forward(student, teacher, batch_rows, budget_bytes):
    out = sample(student)
    caches = [
        cache_arrays(ids, logps, x_ids, x_logps)
        for ids, logps, x_ids, x_logps in zip(
            out.completion_ids, out.logprobs, out.extra_ids, out.extra_logprobs, strict=True
        )
    ]
    scores = teacher_logprobs(
        teacher,
        PROMPTS,
        [c[0] for c in caches],
        pad_token_id=0,
        batch_rows=batch_rows,
        budget_bytes=budget_bytes,
    )
    for prompt, (ids_TN, _), teacher_TN in zip(PROMPTS, caches, scores, strict=True):
        assert teacher_TN.dtype == torch.float32 and teacher_TN.shape == ids_TN.shape
        rows_TV = fresh_rows(teacher, prompt, ids_TN[:, 0].tolist(), temperature=1.0)
        torch.testing.assert_close(teacher_TN, rows_TV.gather(1, ids_TN), atol=1e-5, rtol=0)


def test_teacher_scores_completions_of_different_lengths(teacher):
    """Left padding aligns the ends; a short completion next to a long one is scored right."""
    prompts = [[1, 5, 6, 14], [1, 9]]
    ids = [torch.tensor([[7, 3], [2, 2]]), torch.tensor([[4, 4], [5, 6], [7, 8], [2, 9]])]
    scores = teacher_logprobs(teacher, prompts, ids, pad_token_id=0)
    for prompt, ids_TN, teacher_TN in zip(prompts, ids, scores, strict=True):
        rows_TV = fresh_rows(teacher, prompt, ids_TN[:, 0].tolist(), temperature=1.0)
        torch.testing.assert_close(teacher_TN, rows_TV.gather(1, ids_TN), atol=1e-5, rtol=0)


# ----------------------------------------------------------------------------- the torch generator
def make_generator(model_dir, teacher_path, *, num_samples: int, enabled: bool = True):
    from asyncrl.config_sections import OpdConfig
    from asyncrl.generators.torch_gen import TorchGenerator

    gen = set_up_generator(
        TorchGenerator,
        model_dir,
        run_seed=5,
        opd=OpdConfig(enabled=enabled, teacher=str(teacher_path), num_samples=num_samples),
    )
    return gen


def tasks(num_samples: int = 3):
    from asyncrl.messages import PromptTask, SamplingParams

    params = SamplingParams(temperature=0.8, top_p=1.0, max_new_tokens=5)
    return [
        PromptTask(
            task_id=i,
            group_id=10 + i,
            prompt_ids=p,
            num_samples=num_samples,
            sampling=params,
            dataset_index=i,
            window=0,
            answer="0",
        )
        for i, p in enumerate(PROMPTS[:2])
    ]


def test_torch_generator_ships_the_opd_cache(tiny_model_dir, teacher_dir, student, teacher):
    gen = make_generator(tiny_model_dir, teacher_dir, num_samples=4)
    batch = tasks()
    rollouts = gen.generate_sync(batch)
    assert len(rollouts) == 6
    by_task = {t.task_id: t for t in batch}
    for r in rollouts:
        prompt = by_task[r.task_id].prompt_ids
        ids_TN = torch.tensor(r.opd_ids)
        behav_TN = torch.tensor(r.opd_behavior_logprobs)
        teacher_TN = torch.tensor(r.teacher_logprobs)
        assert ids_TN.shape == behav_TN.shape == teacher_TN.shape == (len(r.completion_ids), 4)
        assert ids_TN[:, 0].tolist() == r.completion_ids
        assert behav_TN[:, 0].tolist() == r.behavior_logprobs  # float32 round trip is exact
        student_TV = fresh_rows(student, prompt, r.completion_ids, temperature=0.8)
        torch.testing.assert_close(behav_TN, student_TV.gather(1, ids_TN), atol=1e-5, rtol=0)
        teacher_TV = fresh_rows(teacher, prompt, r.completion_ids, temperature=1.0)
        torch.testing.assert_close(teacher_TN, teacher_TV.gather(1, ids_TN), atol=1e-5, rtol=0)
    assert gen.teacher_s > 0
    # Per-sample determinism: the same (run seed, group, index) gives the same cache again.
    again = {(r.task_id, r.sample_index): r for r in gen.generate_sync(batch[::-1])}
    for r in rollouts:
        twin = again[(r.task_id, r.sample_index)]
        assert twin.opd_ids == r.opd_ids
        torch.testing.assert_close(
            torch.tensor(twin.teacher_logprobs), torch.tensor(r.teacher_logprobs), atol=1e-6, rtol=0
        )


def test_torch_generator_without_opd_ships_no_cache(tiny_model_dir, teacher_dir):
    gen = make_generator(tiny_model_dir, teacher_dir, num_samples=4, enabled=False)
    assert gen.teacher is None
    for r in asyncio.run(gen.generate(tasks(2))):
        assert r.opd_ids is None and r.opd_behavior_logprobs is None and r.teacher_logprobs is None


def test_single_sample_cache_has_one_column(tiny_model_dir):
    gen = make_generator(tiny_model_dir, tiny_model_dir, num_samples=1)
    for r in gen.generate_sync(tasks(2)):
        assert [row[0] for row in r.opd_ids] == r.completion_ids
        assert all(len(row) == 1 for row in r.teacher_logprobs)
        # Teacher == student at temperature 1 vs 0.8: different numbers, both real log-probs.
        assert all(row[0] <= 0 for row in r.teacher_logprobs)


def test_missing_teacher_is_a_clear_error(tiny_model_dir, tmp_path):
    with pytest.raises(ValueError, match=r"opd\.teacher: no Hugging Face model"):
        make_generator(tiny_model_dir, tmp_path / "nowhere", num_samples=2)


def test_teacher_with_another_vocabulary_is_rejected(tiny_model_dir, teacher_dir, tmp_path):
    import json
    import shutil

    other = tmp_path / "other"
    shutil.copytree(teacher_dir, other)
    tok = json.loads((other / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    vocab["x"] = vocab.pop("9")
    (other / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(ValueError, match="tokenizer"):
        make_generator(tiny_model_dir, other, num_samples=2)


# ----------------------------------------------------------------------------- wire frames
def test_trajectory_frames_carry_the_cache_as_frames_3_to_5(tiny_model_dir, teacher_dir):
    from asyncrl.transport.codec import decode, encode, trajectory_frames

    gen = make_generator(tiny_model_dir, teacher_dir, num_samples=3)
    batch = tasks(1)
    r = next(r for r in gen.generate_sync(batch) if r.task_id == 0)
    msg, tensors = trajectory_frames(batch[0], r, "g0", 0.1, num_opd_samples=3)
    assert len(tensors) == 6
    assert (msg.teacher_logprobs.frame, msg.opd_ids.frame, msg.opd_behavior_logprobs.frame) == (3, 4, 5)
    got, frames = decode(encode(msg, tensors))
    assert got == msg
    ids, logps, _, teacher_TN, ids_TN, behav_TN = frames
    assert teacher_TN.shape == ids_TN.shape == behav_TN.shape == (len(r.completion_ids), 3)
    assert torch.equal(ids_TN[:, 0], ids) and torch.equal(behav_TN[:, 0], logps)
    assert torch.equal(teacher_TN, torch.tensor(r.teacher_logprobs))

    plain_msg, plain = trajectory_frames(batch[0], r, "g0", 0.1)
    assert len(plain) == 3 and plain_msg.teacher_logprobs is None


def test_trajectory_frames_reject_a_missing_or_misshapen_cache(tiny_model_dir, teacher_dir):
    from dataclasses import replace

    from asyncrl.transport.codec import trajectory_frames

    gen = make_generator(tiny_model_dir, teacher_dir, num_samples=2)
    batch = tasks(1)
    r = next(r for r in gen.generate_sync(batch) if r.task_id == 0)
    with pytest.raises(ValueError, match="lacks teacher_logprobs"):
        trajectory_frames(batch[0], replace(r, teacher_logprobs=None), "g0", 0.1, num_opd_samples=2)
    with pytest.raises(ValueError, match="expected"):
        trajectory_frames(batch[0], r, "g0", 0.1, num_opd_samples=3)
    shifted = [[row[0] + 1, *row[1:]] for row in r.opd_ids]
    with pytest.raises(ValueError, match="column|generated"):
        trajectory_frames(batch[0], replace(r, opd_ids=shifted), "g0", 0.1, num_opd_samples=2)


@pytest.mark.parametrize("mode", ["keep", "retract", "abort"])
def test_extras_stay_aligned_with_tokens_across_inflight_updates(tiny_model_dir, mode):
    """New weights mid-generation: every kept token keeps its extras, dropped tokens lose theirs,
    and a position's extras are scored under the weights that produced its token."""
    from transformers import AutoModelForCausalLM

    live = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    frozen = {0: AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()}
    frozen[1] = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in frozen[1].parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=g))
    version, calls = [0], [0]

    def poll_update() -> bool:
        calls[0] += 1
        if calls[0] != 2:
            return False
        live.load_state_dict(frozen[1].state_dict())
        version[0] = 1
        return True

    out = generate(
        live,
        PROMPTS,
        max_new_tokens=MAX_NEW,
        temperature=0.9,
        eos_token_id=-1,  # never stop early: every sample sees the update
        pad_token_id=0,
        seeds=SEEDS,
        current_version=lambda: version[0],
        poll_update=poll_update,
        inflight=mode,
        num_extra_samples=NUM_EXTRA,
    )
    assert out.num_weight_updates == 1
    for prompt, ids, vers, extra_ids, extra_logps in zip(
        PROMPTS, out.completion_ids, out.versions, out.extra_ids, out.extra_logprobs, strict=True
    ):
        assert len(ids) == len(extra_ids) == len(extra_logps) == MAX_NEW
        for t in range(len(ids)):
            if mode == "keep" and vers[t] == 1:
                continue  # keep: its KV cache mixes versions, so no single fresh forward matches
            rows_TV = fresh_rows(frozen[vers[t]], prompt, ids, temperature=0.9)
            expected = rows_TV[t, torch.tensor(extra_ids[t])].tolist()
            assert extra_logps[t] == pytest.approx(expected, abs=1e-5)
