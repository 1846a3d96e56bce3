"""The teacher's top-K on the generator side and on the wire: `teacher_scores` returns, with the
log-probs of the cached ids, the top-K ids and log-probs of a fresh teacher forward; the torch
generator ships them as [T, K] frames 6-7; the learner checks them and packs the union cache; and
a learner step on a top-K cache with K = V trains the full forward KL's gradient."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from asyncrl.generators.opd import TeacherScoring, as_scoring, check_top_k, teacher_logprobs, teacher_scores
from tests.unit.test_opd_generator import PROMPTS, fresh_rows, make_generator, sample, tasks
from tests.unit.test_opd_generator import student as student  # noqa: F401 (fixtures)
from tests.unit.test_opd_generator import teacher as teacher  # noqa: F401
from tests.unit.test_opd_generator import teacher_dir as teacher_dir  # noqa: F401
from tests.unit.test_trainer import STEP, _model, _samples, _trainer


def caches(student):
    from asyncrl.generators.opd import cache_arrays

    out = sample(student)
    return [
        cache_arrays(*row)[0]
        for row in zip(out.completion_ids, out.logprobs, out.extra_ids, out.extra_logprobs, strict=True)
    ]


@pytest.mark.parametrize("chunked", [True, False])
def test_top_k_is_the_fresh_teacher_forwards(student, teacher, monkeypatch, chunked):
    if not chunked:  # the path of teachers whose logits are not lm_head(hidden)
        monkeypatch.setattr("asyncrl.generators.opd.unchunkable_reason", lambda model: "test")
    ids = caches(student)
    scored = teacher_scores(teacher, PROMPTS, ids, pad_token_id=0, top_k=5, budget_bytes=1)
    plain = teacher_logprobs(teacher, PROMPTS, ids, pad_token_id=0)
    for prompt, ids_TN, s, logp_TN in zip(PROMPTS, ids, scored, plain, strict=True):
        # The same arithmetic with or without top-K (to float32 rounding: BLAS may differ by shape).
        torch.testing.assert_close(s.logprobs, logp_TN, atol=1e-6, rtol=0)
        assert s.top_ids.dtype == torch.int64 and s.top_ids.shape == s.top_logprobs.shape == (len(ids_TN), 5)
        rows_TV = fresh_rows(teacher, prompt, ids_TN[:, 0].tolist(), temperature=1.0)
        want = rows_TV.topk(5, dim=-1)
        torch.testing.assert_close(s.top_logprobs, want.values, atol=1e-5, rtol=0)
        torch.testing.assert_close(rows_TV.gather(1, s.top_ids), want.values, atol=1e-5, rtol=0)
        assert (s.top_logprobs[:, :-1] >= s.top_logprobs[:, 1:]).all()  # descending


def test_scoring_records_and_bad_k():
    scores = torch.zeros(2, 1)
    assert as_scoring(scores) == TeacherScoring(scores)
    assert check_top_k(22, 22) == 22
    with pytest.raises(ValueError, match=r"opd\.teacher_top_k = 23"):
        check_top_k(23, 22)


def make_top_k_generator(model_dir, teacher_path, k):
    from asyncrl.config_sections import OpdConfig
    from asyncrl.generators.torch_gen import TorchGenerator
    from tests.conftest import set_up_generator

    opd = OpdConfig(enabled=True, teacher=str(teacher_path), num_samples=2, teacher_top_k=k)
    return set_up_generator(TorchGenerator, model_dir, run_seed=5, opd=opd)


def test_generator_ships_top_k_frames_the_learner_accepts(tiny_model_dir, teacher_dir, teacher):  # noqa: F811
    from asyncrl.config_sections import OpdConfig
    from asyncrl.learner.service import _invalid_top_k
    from asyncrl.learner.step import pack_opd, sample_from_message
    from asyncrl.transport.codec import decode, encode, trajectory_frames

    gen = make_top_k_generator(tiny_model_dir, teacher_dir, 4)
    batch = tasks(1)
    rollouts = gen.generate_sync(batch)
    r = next(r for r in rollouts if r.task_id == 0)
    top_ids, top_logps = torch.tensor(r.teacher_top_ids), torch.tensor(r.teacher_top_logprobs)
    assert top_ids.shape == top_logps.shape == (len(r.completion_ids), 4)
    rows_TV = fresh_rows(teacher, batch[0].prompt_ids, r.completion_ids, temperature=1.0)
    torch.testing.assert_close(top_logps, rows_TV.topk(4, dim=-1).values, atol=1e-5, rtol=0)

    msg, tensors = trajectory_frames(batch[0], r, "g0", 0.1, num_opd_samples=2)
    assert (msg.teacher_top_ids.frame, msg.teacher_top_logprobs.frame) == (6, 7) and len(tensors) == 8
    got, frames = decode(encode(msg, tensors))
    assert got == msg and torch.equal(frames[6], top_ids) and torch.equal(frames[7], top_logps)
    cfg = OpdConfig(enabled=True, num_samples=2, teacher_top_k=4)
    assert _invalid_top_k(frames[0], got, frames, cfg) == ""
    assert "[T, K] = " in _invalid_top_k(frames[0], got, frames, OpdConfig(enabled=True, teacher_top_k=3))
    assert "opd.teacher_top_k is 0" in _invalid_top_k(frames[0], got, frames, OpdConfig(enabled=True))
    bad = list(frames)
    bad[7] = frames[7].clone()
    bad[7][0, 0] = float("nan")
    assert "finite" in _invalid_top_k(frames[0], got, bad, cfg)
    plain_msg, _ = trajectory_frames(
        batch[0],
        dataclasses.replace(r, teacher_top_ids=None, teacher_top_logprobs=None),
        "g0",
        0.1,
        num_opd_samples=2,
    )
    assert "expected the teacher's top-K" in _invalid_top_k(frames[0], plain_msg, frames, cfg)

    sample_ = sample_from_message(got, frames)
    assert torch.equal(sample_.teacher_top_ids, top_ids)
    teacher_BLC, ids_BLC, behav_BLC = pack_opd([sample_], len(msg.prompt_ids) + len(r.completion_ids) + 1)
    p, c = len(msg.prompt_ids), len(r.completion_ids)
    assert ids_BLC.shape[-1] == 6
    assert torch.equal(ids_BLC[0, p : p + c, 2:], top_ids) and torch.equal(
        teacher_BLC[0, p : p + c, 2:], top_logps
    )
    assert (
        torch.isnan(behav_BLC[0, p : p + c, 2:]).all() and not torch.isnan(behav_BLC[0, p : p + c, :2]).any()
    )


def test_generator_without_top_k_ships_none(tiny_model_dir, teacher_dir):  # noqa: F811
    gen = make_generator(tiny_model_dir, teacher_dir, num_samples=2)
    for r in gen.generate_sync(tasks(1)):
        assert r.teacher_top_ids is None and r.teacher_top_logprobs is None


# ----------------------------------------------------------------------------- a learner step
def with_top_k(model, teacher, samples):
    """Each sample's cache: its sampled token, and the teacher's top-V (every id) from a forward."""
    from tests.support.logprob_reference import causal_lm_position_logprobs

    vocab = model.config.vocab_size
    out = []
    for s in samples:
        p, c = len(s.prompt_ids), len(s.completion_ids)
        full = torch.tensor([list(s.prompt_ids) + s.completion_ids.tolist()])
        every = torch.arange(vocab).expand(1, p + c, vocab)
        with torch.no_grad():
            teacher_TV = causal_lm_position_logprobs(teacher, full, every)[0, p:]
            behav_T1 = causal_lm_position_logprobs(model, full, every)[0, p:].gather(
                1, s.completion_ids[:, None]
            )
        top = teacher_TV.topk(vocab, dim=-1)
        out.append(
            dataclasses.replace(
                s,
                behavior_logprobs=behav_T1[:, 0].float(),
                teacher_logprobs=teacher_TV.gather(1, s.completion_ids[:, None]).float(),
                opd_ids=s.completion_ids[:, None].clone(),
                opd_behavior_logprobs=behav_T1.float(),
                teacher_top_ids=top.indices,
                teacher_top_logprobs=top.values.float(),
            )
        )
    return out


def full_forward_kl_grad(model, samples, horizon=None):
    """The gradient of sum over completion tokens of KL(pi_T || pi_theta) over the whole
    vocabulary (the teacher's float32 scores), over each completion's first `horizon` tokens
    (None: all): the step's unnormalised sum, before the update divides it by the token count."""
    from tests.support.logprob_reference import causal_lm_position_logprobs

    model.zero_grad()
    vocab = model.config.vocab_size
    total = 0.0
    for s in samples:
        p, c = len(s.prompt_ids), len(s.completion_ids)
        full = torch.tensor([list(s.prompt_ids) + s.completion_ids.tolist()])
        logp_TV = causal_lm_position_logprobs(model, full, torch.arange(vocab).expand(1, p + c, vocab))[0, p:]
        teacher_TV = torch.zeros_like(logp_TV).scatter(1, s.teacher_top_ids, s.teacher_top_logprobs.double())
        total = total + (teacher_TV.exp() * (teacher_TV - logp_TV))[:horizon].sum()
    total.backward()
    return torch.cat([p.grad.flatten() for p in model.parameters()])


# A whole-batch distillation step on the K = V cache of `with_top_k` (22 ids: the tiny vocabulary).
TOP_V = ["opd.enabled=true", "opd.teacher_top_k=22", "opd.estimator=topk_forward_kl", "learner.streaming=off"]


def step_grad(base, samples, sets, *, perturb=0.0, step=STEP):
    """The unnormalised gradient of one whole-batch step built as `build_trainer` builds it
    (its `DistillControl` installed); `perturb` moves the weights after the reference is taken."""
    from asyncrl.config_load import load_config
    from asyncrl.learner.distill_work import install_control

    trainer = _trainer(copy.deepcopy(base), *sets)
    install_control(trainer, load_config(overrides=[f"learner.samples_per_group={4}", *sets]))
    if perturb:
        g = torch.Generator().manual_seed(9)
        with torch.no_grad():
            for p in trainer.engine.params:
                p.add_(perturb * torch.randn(p.shape, generator=g, dtype=p.dtype))
    trainer.begin_step(step)
    trainer.batch_backward(samples)
    return trainer, torch.cat([p.grad.flatten() for p in trainer.engine.params])


def test_learner_step_on_the_top_v_cache_trains_the_full_forward_kl(tiny_model_dir, teacher_dir):  # noqa: F811
    base = _model(tiny_model_dir)
    samples = with_top_k(base, _model(teacher_dir), _samples(base, num_groups=2, seed=3))
    sets = TOP_V
    _, got = step_grad(base, samples, sets)
    want = full_forward_kl_grad(copy.deepcopy(base), samples)
    assert float((got - want).abs().max()) < 1e-10


def test_kl_coef_with_pure_distillation_adds_the_reference_kl(tiny_model_dir, teacher_dir):  # noqa: F811
    """StableOPD: the step's gradient is the distillation gradient plus kl_coef x the gradient of
    sum_t k3(log pi_ref - log pi) at the sampled tokens, pi_ref the weights the run started from."""
    from asyncrl.learner.kl import kl_loss
    from tests.support.logprob_reference import causal_lm_position_logprobs

    base = _model(tiny_model_dir)
    samples = with_top_k(base, _model(teacher_dir), _samples(base, num_groups=2, seed=4))
    opd = ["opd.enabled=true", "opd.num_samples=1", "learner.streaming=off"]
    trainer, got = step_grad(base, samples, [*opd, "learner.kl_coef=0.3"], perturb=0.05)
    _, distill = step_grad(base, samples, opd, perturb=0.05)
    model = trainer.model
    model.zero_grad()
    total = 0.0
    for s in samples:
        p = len(s.prompt_ids)
        full = torch.tensor([list(s.prompt_ids) + s.completion_ids.tolist()])
        ids = torch.zeros((1, full.shape[1], 1), dtype=torch.long)
        ids[0, p:, 0] = s.completion_ids
        logp = causal_lm_position_logprobs(model, full, ids)[0, p:, 0]
        with torch.no_grad():
            ref = causal_lm_position_logprobs(base, full, ids)[0, p:, 0]
        mask = torch.ones_like(logp, dtype=torch.bool)[None]
        loss, _ = kl_loss(
            logp[None], ref[None], mask, estimator="k3", mode="token-mean", num_tokens_global=1.0
        )
        total = total + loss
    total.backward()
    kl_grad = torch.cat([p.grad.flatten() for p in model.parameters() if p.requires_grad])
    assert float(kl_grad.abs().max()) > 1e-4  # the perturbation makes the KL term matter
    assert float((got - (distill + 0.3 * kl_grad)).abs().max()) < 1e-10
    assert trainer.finish_step().stats["opd_kl_ref"] > 0


def test_the_horizon_grows_by_its_schedule_through_steps(tiny_model_dir, teacher_dir):  # noqa: F811
    """Horizon 1, linear growth 1 up to 2: step 0 distils each completion's first token only (its
    gradient is the horizon-masked one), and steps 0, 1, 2 report horizons 1, 2, 2."""
    base = _model(tiny_model_dir)
    samples = with_top_k(base, _model(teacher_dir), _samples(base, num_groups=2, seed=5))
    opd = TOP_V
    sched = ["opd.horizon=1", "opd.horizon_schedule=linear", "opd.horizon_max=2"]
    trainer, got = step_grad(base, samples, [*opd, *sched], step=0)
    want = full_forward_kl_grad(copy.deepcopy(base), samples, horizon=1)
    assert float((got - want).abs().max()) < 1e-10
    horizons = [trainer.finish_step().stats["opd_horizon"]]
    for step in (1, 2):
        trainer.begin_step(step)
        trainer.batch_backward(samples)
        horizons.append(trainer.finish_step().stats["opd_horizon"])
    assert horizons == [1.0, 2.0, 2.0]


def test_a_horizon_teacher_scores_the_first_h_tokens_only(tiny_model_dir, teacher_dir, teacher):  # noqa: F811
    """opd.horizon = 2, linear growth 1: at policy version 0 the teacher scores each completion's
    first 2 positions (as a full scoring would), the rest come back NaN; after the generator holds
    version 1, the first 3. The learner accepts whole NaN rows only with a horizon."""
    from asyncrl.config_sections import OpdConfig
    from asyncrl.generators.teachers import Horizon, ModelTeacher
    from asyncrl.learner.service import _invalid_opd

    ids = [torch.tensor([[7, 3], [4, 2], [5, 6], [2, 9]]), torch.tensor([[4, 4]])]
    tasks_ = tasks(1)[:1] * 2
    full, _ = ModelTeacher(teacher, pad_token_id=0, top_k=3).score(tasks_, ids)
    cut = ModelTeacher(teacher, pad_token_id=0, top_k=3, horizon=Horizon(2, "linear", 1, 0))
    for version, h in ((0, 2), (1, 3)):
        cut.on_weights(version, {})
        got, _ = cut.score(tasks_, ids)
        torch.testing.assert_close(got[0].logprobs[:h], full[0].logprobs[:h], atol=1e-5, rtol=0)
        torch.testing.assert_close(got[0].top_logprobs[:h], full[0].top_logprobs[:h], atol=1e-5, rtol=0)
        assert torch.isnan(got[0].logprobs[h:]).all() and torch.isnan(got[0].top_logprobs[h:]).all()
        assert (got[0].top_ids[h:] == 0).all() and got[0].logprobs.shape == (4, 2)
        assert torch.equal(got[1].logprobs, full[1].logprobs)  # shorter than the horizon: whole
    cfg = OpdConfig(enabled=True, num_samples=2, horizon=2)
    assert _invalid_opd(ids[0][:, 0], [got[0].logprobs, ids[0], torch.zeros(4, 2)], cfg) == ""
    refused = _invalid_opd(
        ids[0][:, 0], [got[0].logprobs, ids[0], torch.zeros(4, 2)], OpdConfig(enabled=True, num_samples=2)
    )
    assert "finite" in refused
    half = got[0].logprobs.clone()
    half[0, 1] = float("nan")
    assert "finite" in _invalid_opd(ids[0][:, 0], [half, ids[0], torch.zeros(4, 2)], cfg)


def test_the_torch_generator_gives_its_teacher_the_horizon(tiny_model_dir, teacher_dir):  # noqa: F811
    """opd.horizon = 1 (fixed): every rollout's teacher rows past the first are NaN, the first finite."""
    from asyncrl.config_sections import OpdConfig
    from asyncrl.generators.torch_gen import TorchGenerator
    from tests.conftest import set_up_generator

    opd = OpdConfig(enabled=True, teacher=str(teacher_dir), num_samples=2, teacher_top_k=3, horizon=1)
    gen = set_up_generator(TorchGenerator, tiny_model_dir, run_seed=5, opd=opd)
    rollouts = gen.generate_sync(tasks(2))
    assert any(len(r.completion_ids) > 1 for r in rollouts)
    for r in rollouts:
        teacher_TN, top_TK = torch.tensor(r.teacher_logprobs), torch.tensor(r.teacher_top_logprobs)
        assert torch.isfinite(teacher_TN[0]).all() and torch.isfinite(top_TK[0]).all()
        assert torch.isnan(teacher_TN[1:]).all() and torch.isnan(top_TK[1:]).all()


@pytest.mark.parametrize(
    "extra",
    [
        ["opd.reward=add", "opd.estimator=topk_forward_kl"],
        ["opd.estimator=forward_kl", "opd.select=entropy", "opd.select_fraction=0.5"],
    ],
)
def test_streamed_steps_on_the_union_cache_equal_the_batch_step(tiny_model_dir, teacher_dir, extra):  # noqa: F811
    """The union cache in the learner's streaming paths (pure distillation, and the RL part plus
    distillation): a streamed step's update equals the whole-batch step's (float64, 1e-10)."""
    from tests.unit.test_trainer import _batch_step, _params, _stream_step

    base = _model(tiny_model_dir)
    samples = with_top_k(base, _model(teacher_dir), _samples(base, num_groups=2, seed=6))
    sets = ["opd.enabled=true", "opd.teacher_top_k=22", *extra]
    ref = copy.deepcopy(base)
    batch = _batch_step(ref, samples, *sets)
    model = copy.deepcopy(base)
    trainer, streamed = _stream_step(model, samples, *sets, seed=1)
    assert trainer.fallback == ""
    torch.testing.assert_close(_params(model), _params(ref), rtol=0, atol=1e-10)
    assert streamed.loss == pytest.approx(batch.loss, abs=1e-9)
    assert not torch.equal(_params(ref), _params(base))
