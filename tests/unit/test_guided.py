"""Guided rollouts (sampling.guidance): the baseline from unguided members, the forced prefix's
off-policy treatment (masked, or LUFFY's shaped loss) against hand-computed cases, and the
generator's side (failure counts, guided variants, the wire)."""

from __future__ import annotations

import dataclasses
import math
from types import SimpleNamespace

import pytest
import torch

from asyncrl.learner.advantages import GRPO_EPS, grpo_advantages
from asyncrl.learner.guidance import guided_advantages, shaped_loss, shaped_weight
from tests.unit.test_gdpo import one_step

F64 = torch.float64


def t(rows, dtype=F64) -> torch.Tensor:
    return torch.tensor(rows, dtype=dtype)


# -- the baseline --------------------------------------------------------------------------------


def test_baseline_excludes_guided_members_hand_computed():
    # Group 0: a guided success among three failed policy samples. Plain GRPO's mean 1/4 would give
    # the policy's samples -1/4 / std (advantage inversion); from the unguided members the baseline
    # is 0, so they get exactly 0 and the guided one (1 - 0) / (std + eps), std([1,0,0,0]) = 1/2.
    # Group 1: guided 1, unguided (1, 0, 0): mean_u = 1/3, std([1,1,0,0]) = 1/sqrt(3).
    rewards = t([[1, 0, 0, 0], [1, 1, 0, 0]])
    guided = t([[1, 0, 0, 0], [1, 0, 0, 0]], dtype=torch.bool)
    adv = guided_advantages(rewards, guided)
    s1 = 1 / math.sqrt(3) + GRPO_EPS
    expected = t(
        [[1 / (0.5 + GRPO_EPS), 0, 0, 0], [(2 / 3) / s1, (2 / 3) / s1, (-1 / 3) / s1, (-1 / 3) / s1]]
    )
    torch.testing.assert_close(adv, expected, rtol=1e-12, atol=0)
    assert adv[0, 1:].eq(0).all()  # exactly 0, not an ulp off
    assert grpo_advantages(rewards)[0, 1:].lt(0).all()  # what the unguided baseline prevents


def test_baseline_without_guided_members_is_grpo_bitwise_and_dr_grpo_is_r_minus_mean_u():
    rewards = t([[0.3, 1.0, 0.0, 0.7], [1, 1, 1, 1]])
    none = torch.zeros_like(rewards, dtype=torch.bool)
    assert torch.equal(guided_advantages(rewards, none), grpo_advantages(rewards))
    guided = t([[0, 0, 0, 1], [0, 0, 0, 1]], dtype=torch.bool)
    dr = guided_advantages(rewards, guided, advantage="dr_grpo")
    mean_u = (0.3 + 1.0 + 0.0) / 3
    torch.testing.assert_close(dr[0], rewards[0] - mean_u, rtol=0, atol=1e-15)
    assert dr[1].eq(0).all()  # all equal: exactly 0
    with pytest.raises(ValueError, match="no baseline"):
        guided_advantages(rewards, torch.ones_like(none))
    with pytest.raises(ValueError, match="'grpo' or 'dr_grpo'"):
        guided_advantages(rewards, guided, advantage="rloo")


# -- LUFFY's shaped loss -------------------------------------------------------------------------


def test_shaped_weight_and_gradient_match_the_formula_hand_computed():
    # f(p) = p / (p + gamma); d(-A f(p)) / d log p = -A gamma p / (p + gamma)^2.
    # p = 0.5, gamma = 0.1: f = 5/6, gradient factor 0.05 / 0.36 = 5/36.
    # p = 0.05, gamma = 0.1: f = 1/3, gradient factor 0.005 / 0.0225 = 2/9.
    # p = 0.9, gamma = 0.1 (masked): no term, no gradient.
    logp = torch.log(t([[0.5, 0.05, 0.9]])).requires_grad_()
    adv = t([[2.0, -1.0, 3.0]])
    mask = t([[1, 1, 0]], dtype=torch.bool)
    torch.testing.assert_close(shaped_weight(logp.detach(), 0.1)[0, :2], t([5 / 6, 1 / 3]))
    loss = shaped_loss(logp, adv, mask, gamma=0.1)
    torch.testing.assert_close(loss, t(-2.0 * 5 / 6 + 1 / 3))
    (grad,) = torch.autograd.grad(loss, logp)
    torch.testing.assert_close(grad, t([[-2.0 * 5 / 36, 1.0 * 2 / 9, 0.0]]))


def test_shaped_loss_is_finite_and_exactly_zero_at_masked_non_finite_positions():
    logp = t([[-float("inf"), float("nan"), -1.0]]).requires_grad_()
    mask = t([[0, 0, 1]], dtype=torch.bool)
    loss = shaped_loss(logp, t([[1.0, 1.0, 1.0]]), mask, gamma=0.1)
    (grad,) = torch.autograd.grad(loss, logp)
    assert torch.isfinite(loss) and grad[0, :2].eq(0).all() and grad[0, 2] != 0


# -- a learner step ------------------------------------------------------------------------------


def _model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=F64)


def _logp(model, prompt, ids):
    from asyncrl.kernels.logprobs import causal_lm_logprobs

    with torch.no_grad():
        return causal_lm_logprobs(model, torch.tensor([list(prompt) + list(ids)])).logp[0, len(prompt) :]


def _group(model, rewards, *, guided_prefix=2, as_prompt=False, mask_prefix=False):
    """One group of len(rewards); member 0 is guided: its completion is a 2-token forced prefix then
    3 sampled tokens. `as_prompt`: the prefix moved into its prompt instead (an ordinary sample)."""
    g = torch.Generator().manual_seed(5)
    prompt = [1, 7, 9, 4]
    out = []
    for k, reward in enumerate(rewards):
        ids = torch.randint(4, 20, (5,), generator=g)
        p, c, prefix = prompt, ids, 0
        if k == 0 and as_prompt:
            p, c = prompt + ids[:guided_prefix].tolist(), ids[guided_prefix:]
        elif k == 0:
            prefix = guided_prefix
        logp = _logp(model, p, c).float()
        loss_mask = None
        if prefix:
            logp[:prefix] = 0.0  # the generator's placeholder
            if mask_prefix:
                loss_mask = torch.tensor([False] * prefix + [True] * (len(c) - prefix))
        out.append(
            dict(
                traj_id=k, group_id=0, sample_index=k, prompt_ids=p, completion_ids=c, behavior_logprobs=logp,
                token_versions=torch.full((len(c),), 6), reward=float(reward), guided_prefix=prefix,
                loss_mask=loss_mask,
            )
        )  # fmt: skip
    from asyncrl.learner.step import TrainSample

    return [TrainSample(**s) for s in out]


class _Spy:
    """Wraps an objective's group_advantages to see what the step hands it."""

    def __init__(self):
        self.calls = []


def _step(tiny_model_dir, samples, *sets, spy=None):
    from asyncrl.learner.objective import RLObjective

    def spied(objective):
        if spy is None:
            return objective

        @dataclasses.dataclass(frozen=True, kw_only=True)
        class Spied(RLObjective):
            def group_advantages(self, rewards_GN, parts_GNK=None, guided_GN=None):
                out = super().group_advantages(rewards_GN, parts_GNK, guided_GN)
                spy.calls.append((rewards_GN, guided_GN, out[0]))
                return out

        return Spied(**{f.name: getattr(objective, f.name) for f in dataclasses.fields(objective)})

    return one_step(tiny_model_dir, samples, *sets, group_size=4, objective=spied)


GUIDED = "sampling.guidance.enabled=true"


def test_learner_step_takes_the_baseline_from_unguided_members(tiny_model_dir):
    spy = _Spy()
    model = _model(tiny_model_dir)
    _step(tiny_model_dir, _group(model, [1, 0, 0, 0], mask_prefix=True), GUIDED, spy=spy)
    ((rewards, guided, adv),) = spy.calls
    assert guided.tolist() == [[True, False, False, False]]
    assert adv[0, 1:].eq(0).all() and adv[0, 0] == pytest.approx(1 / (0.5 + GRPO_EPS))


@pytest.mark.parametrize("mask_prefix", [True, False])
def test_masked_prefix_tokens_carry_no_gradient(tiny_model_dir, mask_prefix):
    # Rewards (0.5 guided; 1, 0, 0.5 unguided): the unguided mean is the group's, so the guided
    # baseline gives GRPO's advantages. With the prefix masked, training the guided sample equals
    # training its continuation alone with the prefix in the prompt (same tokens, same context),
    # whether the generator's loss mask came or not (the learner masks it itself). Trained as
    # sampled tokens instead, the prefix changes the update.
    model = _model(tiny_model_dir)
    rewards = [0.5, 1.0, 0.0, 0.5]
    guided, _ = _step(tiny_model_dir, _group(model, rewards, mask_prefix=mask_prefix), GUIDED)
    moved, _ = _step(tiny_model_dir, _group(model, rewards, as_prompt=True))
    torch.testing.assert_close(guided, moved, rtol=1e-9, atol=1e-12)
    plain = [dataclasses.replace(s, guided_prefix=0, loss_mask=None) for s in _group(model, rewards)]
    trained, _ = _step(tiny_model_dir, plain)
    assert (trained - moved).abs().max() > 1e-6


def test_shaped_prefix_adds_luffys_term_to_the_step(tiny_model_dir):
    # prefix_loss = "shaped": the step's loss is the masked step's policy sum plus
    # sum_t -A f(pi(y_t)) over the prefix tokens, over Z = continuation tokens + prefix tokens.
    from asyncrl.learner.guidance import shaped_loss

    model = _model(tiny_model_dir)
    rewards = [1.0, 0.0, 0.0, 0.0]
    samples = _group(model, rewards, mask_prefix=True)
    masked, masked_result = _step(tiny_model_dir, samples, GUIDED)
    shaped, shaped_result = _step(
        tiny_model_dir, samples, GUIDED, "sampling.guidance.prefix_loss=shaped", "sampling.guidance.gamma=0.1"
    )
    z_masked = sum(
        int(s.loss_mask.sum()) if s.loss_mask is not None else len(s.completion_ids) for s in samples
    )
    z_shaped = z_masked + 2
    logp_prefix = _logp(model, samples[0].prompt_ids, samples[0].completion_ids)[:2]
    adv = 1 / (0.5 + GRPO_EPS)
    term = float(
        shaped_loss(
            logp_prefix[None],
            torch.full((1, 2), adv, dtype=F64),
            torch.ones(1, 2, dtype=torch.bool),
            gamma=0.1,
        )
    )
    expected = (masked_result.loss * z_masked + term) / z_shaped
    assert shaped_result.loss == pytest.approx(expected, rel=1e-9)
    assert (shaped - masked).abs().max() > 1e-6


# -- load-time checks ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "sets, match",
    [
        (["learner.advantage=rloo"], "'grpo' or 'dr_grpo'"),
        (["learner.samples_per_group=2", "sampling.guidance.samples=2"], "no unguided member"),
        (["staleness.vcpo_baseline=opob"], "vcpo_baseline"),
        (["sampling.guidance.prefix_loss=shaped", "learner.agg=seq-mean-token-mean"], "seq-mean-token-mean"),
        (["sampling.guidance.prefix_fraction=0"], "prefix_fraction"),
        (["generators.kind=sglang"], "generators.kind"),
        (["learner.advantage=gdpo"], "gdpo|task.rewards"),
    ],
)
def test_guidance_is_refused_at_load_where_it_cannot_hold(sets, match):
    from asyncrl.config_load import load_config
    from asyncrl.config_sections import ConfigError

    with pytest.raises(ConfigError, match=match):
        load_config(overrides=[GUIDED, *sets])
    assert not load_config().sampling.guidance.enabled  # off by default


# -- the generator's side ------------------------------------------------------------------------


class _Tok:
    """Characters as ids (ord), as the tests' tokenizer; eos 0."""

    eos_token_id = 0

    def __call__(self, text, add_special_tokens=True):
        if isinstance(text, list):
            return {"input_ids": [[ord(c) for c in s] for s in text]}
        return {"input_ids": [ord(c) for c in text]}

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids if i)


def _prompt_task(task_id, index=7, answer="51", num_samples=4):
    from asyncrl.messages import PromptTask, SamplingParams

    return PromptTask(
        task_id=task_id, group_id=task_id, prompt_ids=[ord(c) for c in "12+39="], num_samples=num_samples,
        sampling=SamplingParams(), dataset_index=index, window=0, answer=answer,
    )  # fmt: skip


def _book(**options):
    from asyncrl.config_sections import GuidanceConfig
    from asyncrl.generators.guidance import GuidanceBook
    from asyncrl.tasks.base import Problem

    task = SimpleNamespace(
        train_problem=lambda i: Problem(index=i, prompt="12+39=", answer="51", solution="51")
    )
    return GuidanceBook(GuidanceConfig(enabled=True, **options), task=task, tokenizer=_Tok())


def _rollout(task, k, reward, prefix=0):
    from asyncrl.generators.base import Rollout

    return Rollout(
        task_id=task.task_id, sample_index=k, completion_ids=[53, 49], behavior_logprobs=[-0.1, -0.2],
        token_versions=[0, 0], reward=reward, finish_reason="stop", guided_prefix=prefix,
    )  # fmt: skip


def test_a_prompt_is_guided_after_its_failures_and_counted_when_solved():
    book = _book(after_failures=2, samples=1, prefix_fraction=0.5)
    task = _prompt_task(1)
    assert book.plan(task) == (task, [])  # never seen: not guided
    book.observe(task, [_rollout(task, k, 0.0) for k in range(4)])
    assert book.plan(task) == (task, [])  # one failure
    book.observe(task, [_rollout(task, k, 0.0) for k in range(4)])
    plain, draws = book.plan(_prompt_task(2))
    assert plain.num_samples == 3 and [d.sample_index for d in draws] == [3]
    variant = draws[0].task
    assert variant.prompt_ids == [*map(ord, "12+39="), ord("5")] and variant.guided_prefix == 1
    # A guided success does not count as the policy's: still failing.
    book.observe(task, [_rollout(task, k, 0.0) for k in range(3)] + [_rollout(variant, 3, 1.0, prefix=1)])
    (rec,) = book.prompts.values()
    assert rec.failures == 3 and not rec.solved_after
    book.observe(task, [_rollout(task, 0, 1.0)] + [_rollout(task, k, 0.0) for k in range(1, 4)])
    summary = book.summary()
    assert summary["prompts_failing"] == 1 and summary["guided_and_solved_later"] == 1
    assert summary["guided_samples"] == 1 and summary["guided_mean_reward"] == 1.0
    assert book.plan(task) == (task, [])  # solved: its count starts over


def test_guided_variant_comes_back_as_the_students_sample_and_travels_flagged():
    from asyncrl.generators.rollouts import RolloutBuilder
    from asyncrl.learner.step import sample_from_message
    from asyncrl.tasks.arithmetic import AdditionTask
    from asyncrl.transport.codec import decode, encode, trajectory_frames

    book = _book(after_failures=1)
    task = _prompt_task(1)
    book.observe(task, [_rollout(task, k, 0.0) for k in range(4)])
    _, (draw,) = book.plan(task)
    builder = RolloutBuilder(AdditionTask(seed=0, eval_seed=1, num_eval=1, max_operand=99), _Tok())
    r = builder.build(
        draw.task, 3, completion_ids=[ord("1"), 0], behavior_logprobs=[-0.3, -0.1], token_versions=[4, 4],
        finish_reason="stop", prompt_text=builder.prompt_text(draw.task),
    )  # fmt: skip
    assert builder.prompt_text(draw.task) == "12+39="  # the student's prompt
    assert r.completion_ids == [ord("5"), ord("1"), 0] and r.reward == 1.0  # scored on prefix + continuation
    assert r.loss_mask == [False, True, True] and r.guided_prefix == 1
    assert r.behavior_logprobs == [0.0, -0.3, -0.1] and r.token_versions == [4, 4, 4]
    msg, frames = trajectory_frames(task, r, "gen-0", 0.1)
    decoded, tensors = decode(encode(msg, frames))
    assert decoded.guided_prefix == 1 and decoded.prompt_ids == task.prompt_ids
    sample = sample_from_message(decoded, tensors)
    assert sample.guided_prefix == 1 and sample.loss_mask.tolist() == [False, True, True]
    plain_msg, _ = trajectory_frames(
        task, dataclasses.replace(r, guided_prefix=0, loss_mask=None), "gen-0", 0.1
    )
    assert b"guided_prefix" not in encode(plain_msg, [])[0]  # omitted at its default


async def _take(scorer, rollouts):
    return await scorer.take(rollouts)


def test_scorer_feeds_guided_members_apart_and_redraws_them_guided():
    import asyncio

    from asyncrl.config_load import load_config
    from asyncrl.generators.scoring import SampleScorer

    cfg = load_config(overrides=[GUIDED, "sampling.guidance.after_failures=1", "learner.samples_per_group=4"])
    scorer = SampleScorer(cfg, tokenizer=_Tok())
    scorer.guidance = _book(after_failures=1)
    first = _prompt_task(1)
    tasks, guided = scorer.open_tasks([first])
    assert tasks == [first] and guided == []
    verdict = asyncio.run(_take(scorer, [_rollout(first, k, 0.0) for k in range(4)]))
    assert len(verdict.done) == 1 and verdict.done[0][2].num_guided == 0
    second = _prompt_task(2)
    (plain,), (draw,) = scorer.open_tasks([second])
    assert plain.num_samples == 3 and draw.task.guided_prefix == 1
    bad = dataclasses.replace(_rollout(second, 3, 0.0, prefix=1), completion_ids=[])  # invalid: drawn again
    verdict = asyncio.run(_take(scorer, [bad]))
    assert verdict.redraw[0].task.guided_prefix == 1 and verdict.redraw[0].task.attempt == 1
    rollouts = [_rollout(second, k, 0.0) for k in range(3)] + [_rollout(second, 3, 1.0, prefix=1)]
    verdict = asyncio.run(_take(scorer, rollouts))
    counts = verdict.done[0][2]
    assert counts.num_guided == 1 and counts.guided_reward_sum == 1.0
