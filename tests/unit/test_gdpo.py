"""GDPO (reward-decoupled normalisation) against hand-computed groups (float64)."""

from __future__ import annotations

import math

import pytest
import torch

from asyncrl.learner.advantages import gdpo_advantages, grpo_advantages

F64 = torch.float64
EPS = 1e-6


def t(rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=F64)


def test_collapse_example_groupwise_without_batch_norm():
    # Two rollouts, two binary rewards. Group 0: r1 = (0, 0), r2 = (0, 1): sums (0, 1).
    # Group 1: r1 = (0, 1), r2 = (0, 1): sums (0, 2). GRPO of the sum gives both groups the same
    # advantages; GDPO keeps them apart: group 0's r1 is constant (contributes 0), and for N = 2
    # each non-constant binary reward normalises to -+ (1/2) / (1/sqrt(2) + eps).
    rewards = t([[[0, 0], [0, 1]], [[0, 0], [1, 1]]])
    one = 0.5 / (1 / math.sqrt(2) + EPS)
    adv = gdpo_advantages(rewards, t([1.0, 1.0]), batch_norm=False)
    torch.testing.assert_close(adv, t([[-one, one], [-2 * one, 2 * one]]))
    summed = grpo_advantages(rewards.sum(dim=2))
    torch.testing.assert_close(
        summed[0], summed[1], atol=1e-5, rtol=0
    )  # the collapse GDPO avoids (up to eps)


def test_collapse_example_with_batch_norm():
    # Continuing: the batch (-a, a, -2a, 2a) with a = one has ddof-1 std a * sqrt(10/3), so the
    # advantages become -+ 1/sqrt(10/3) = sqrt(3/10) and -+ 2/sqrt(10/3) = sqrt(6/5).
    rewards = t([[[0, 0], [0, 1]], [[0, 0], [1, 1]]])
    one = 0.5 / (1 / math.sqrt(2) + EPS)
    batch_std = one * math.sqrt(10 / 3)
    adv = gdpo_advantages(rewards, t([1.0, 1.0]))
    expected = t([[-one, one], [-2 * one, 2 * one]]) / (batch_std + EPS)
    torch.testing.assert_close(adv, expected)
    torch.testing.assert_close(adv, t([[-1, 1], [-2, 2]]) * math.sqrt(3 / 10), atol=1e-5, rtol=1e-5)


def test_weights_scale_each_reward_after_its_own_normalisation():
    # One group of four, r1 = (1, 1, 0, 0) (scale 1), r2 = (3, 0, 0, 0) (scale 3), weights (2, 0.5).
    # r1: mean 1/2, std sqrt(1/3) -> +-(1/2)/(sqrt(1/3) + eps).
    # r2: mean 3/4, std sqrt((2.25^2 + 3 * 0.75^2) / 3) = sqrt(2.25) = 1.5 -> (2.25, -0.75 x3)/(1.5 + eps).
    rewards = t([[[1, 3], [1, 0], [0, 0], [0, 0]]])
    a1 = 0.5 / (math.sqrt(1 / 3) + EPS)
    s2 = 1.5 + EPS
    expected = t(
        [
            [
                2 * a1 + 0.5 * 2.25 / s2,
                2 * a1 - 0.5 * 0.75 / s2,
                -2 * a1 - 0.5 * 0.75 / s2,
                -2 * a1 - 0.5 * 0.75 / s2,
            ]
        ]
    )
    adv = gdpo_advantages(rewards, t([2.0, 0.5]), batch_norm=False)
    torch.testing.assert_close(adv, expected)


def test_one_reward_without_batch_norm_is_weighted_grpo():
    rewards = t([[[0.2], [0.9], [0.5]], [[1.0], [0.0], [0.0]]])
    adv = gdpo_advantages(rewards, t([-1.5]), batch_norm=False)
    torch.testing.assert_close(adv, -1.5 * grpo_advantages(rewards[:, :, 0]))


def test_population_std_is_passed_through():
    rewards = t([[[1, 0], [0, 0], [0, 1], [1, 1]]])
    adv = gdpo_advantages(rewards, t([1.0, 1.0]), unbiased=False, batch_norm=False)
    a = 0.5 / (0.5 + EPS)  # each reward has mean 1/2 and population std 1/2
    torch.testing.assert_close(adv, t([[0.0, -2 * a, 0.0, 2 * a]]))


def test_constant_groups_stay_exactly_zero_under_batch_norm():
    # Group 0 has every reward constant (0.1 is not exact in binary: its float mean may be one
    # ulp off); group 1 has signal. Batch normalisation must not give group 0 a non-zero advantage.
    rewards = t([[[0.1, 0.7], [0.1, 0.7], [0.1, 0.7]], [[1, 0], [0, 0], [0, 1]]])
    adv = gdpo_advantages(rewards, t([1.0, 1.0]))
    assert torch.equal(adv[0], torch.zeros(3, dtype=F64))
    assert bool(adv[1].ne(0).any())


def test_all_constant_batch_is_zero():
    rewards = t([[[1, 0], [1, 0]], [[0.3, 0.3], [0.3, 0.3]]])
    adv = gdpo_advantages(rewards, t([1.0, 2.0]))
    assert torch.equal(adv, torch.zeros(2, 2, dtype=F64))


def test_groups_of_one_get_zero():
    adv = gdpo_advantages(t([[[1.0, 0.0]], [[0.0, 1.0]]]), t([1.0, 1.0]))
    assert torch.equal(adv, torch.zeros(2, 1, dtype=F64))


def test_shape_errors_name_the_mismatch():
    with pytest.raises(ValueError, match=r"\[G, N, K\]"):
        gdpo_advantages(t([[1.0, 0.0]]), t([1.0]))
    with pytest.raises(ValueError, match="2 rewards per sample but 3 weights"):
        gdpo_advantages(t([[[1.0, 0.0], [0.0, 1.0]]]), t([1.0, 1.0, 1.0]))


# -- selectable: learner.advantage = "gdpo" in a learner step ---------------------------------


def _two_reward_samples(model, parts):
    """One trajectory per (group, slot) of `parts` [G][N][K], with random tokens and the model's
    own behaviour log-probs; `reward` is the plain sum of the parts (weights 1)."""
    from asyncrl.kernels.logprobs import causal_lm_logprobs
    from asyncrl.learner.step import TrainSample

    g = torch.Generator().manual_seed(3)
    out = []
    for grp, group in enumerate(parts):
        prompt = [1] + torch.randint(4, 20, (3,), generator=g).tolist()
        for k, values in enumerate(group):
            ids = torch.randint(4, 20, (3 + k,), generator=g)
            with torch.no_grad():
                logp = causal_lm_logprobs(model, torch.tensor([prompt + ids.tolist()])).logp[0, len(prompt) :]
            out.append(
                TrainSample(
                    traj_id=grp * len(group) + k,
                    group_id=grp,
                    sample_index=k,
                    prompt_ids=prompt,
                    completion_ids=ids,
                    behavior_logprobs=logp.float(),
                    token_versions=torch.full((len(ids),), 6),
                    reward=float(sum(values)),
                    reward_parts=[float(v) for v in values],
                )
            )
    return out


def one_step(tiny_model_dir, samples, *sets, group_size, objective=lambda o: o):
    """One whole-batch learner step (float64 tiny model, fresh from its seed) on `samples` under
    the default config with `sets`, the objective passed through `objective`; returns the
    parameters after the update and the step's result (also used by test_guided.py)."""
    from transformers import AutoModelForCausalLM

    from asyncrl.config_load import load_config
    from asyncrl.config_objective import check_staleness_policy
    from asyncrl.learner.objective import Objective
    from asyncrl.learner.trainer import Trainer

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=F64)
    cfg = load_config(
        overrides=[
            f"learner.samples_per_group={group_size}",
            "staleness.max_staleness=2",
            "learner.streaming=off",
            *sets,
        ]
    )
    trainer = Trainer(
        model, objective(Objective.from_config(cfg)), check_staleness_policy(cfg.staleness), lr=1e-2,
        weight_decay=0.0, max_grad_norm=1e9, temperature=1.0, pad_token_id=0, group_size=group_size,
        micro_batch_size=256, max_open_groups=4, max_staleness=2,
    )  # fmt: skip
    trainer.begin_step(6)
    trainer.batch_backward(samples)
    result = trainer.finish_step()
    return torch.cat([p.detach().flatten() for p in model.parameters()]), result


def _step(tiny_model_dir, samples, advantage, weights=()):
    import dataclasses

    def choose(objective):
        return dataclasses.replace(objective, advantage=advantage, reward_weights=weights)

    return one_step(tiny_model_dir, samples, group_size=2, objective=choose)


def test_learner_step_with_gdpo_normalises_each_reward(tiny_model_dir):
    # The collapse example as a batch: group 0 parts (1, 0), (0, 0); group 1 (1, 1), (0, 0); sums
    # (1, 0) and (2, 0). GRPO of the sums gives both groups -+1/sqrt(2); GDPO gives +-a and +-2a,
    # and after the batch std +-sqrt(3/10) and +-sqrt(6/5) (hand-computed above). Dr. GRPO
    # (A = r - mean) on rewards +-sqrt(3/10), +-sqrt(6/5) has exactly those advantages, so its step
    # is the reference; GRPO of the sums is a different step.
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=F64)
    parts = [[[1, 0], [0, 0]], [[1, 1], [0, 0]]]
    samples = _two_reward_samples(model, parts)
    gdpo, result = _step(tiny_model_dir, samples, "gdpo", (1.0, 1.0))
    a, b = math.sqrt(3 / 10), math.sqrt(6 / 5)
    expected = [a, -a, b, -b]
    reference = [dataclasses_replace(s, reward=expected[i]) for i, s in enumerate(samples)]
    ref, ref_result = _step(tiny_model_dir, reference, "dr_grpo")
    # (equal up to GDPO's eps = 1e-6 in each std)
    assert result.loss == pytest.approx(ref_result.loss, rel=1e-5)
    assert result.grad_norm == pytest.approx(ref_result.grad_norm, rel=1e-5)
    torch.testing.assert_close(gdpo, ref, rtol=1e-5, atol=1e-7)
    summed, summed_result = _step(tiny_model_dir, samples, "grpo")
    assert summed_result.grad_norm != pytest.approx(result.grad_norm, rel=1e-2)  # another update


def test_gdpo_step_refuses_trajectories_without_reward_parts(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=F64)
    samples = [
        dataclasses_replace(s, reward_parts=()) for s in _two_reward_samples(model, [[[1, 0], [0, 0]]])
    ]
    with pytest.raises(ValueError, match="per-reward values"):
        _step(tiny_model_dir, samples, "gdpo", (1.0, 1.0))


def test_gdpo_keeps_groups_whose_sum_is_flat_but_parts_are_not():
    # drop_degenerate_groups: under GDPO a group is degenerate when every reward is constant in it,
    # not when the weighted sums are: (1, 0), (0, 1) sums to (1, 1) yet carries signal per reward.
    from asyncrl.learner.objective import RLObjective

    objective = RLObjective(
        agg="token-mean", norm_constant=1.0, streaming="off", advantage="gdpo", loss="ppo", clip_low=0.2,
        clip_high=0.2, dual_clip=None, drop_degenerate_groups=True, kl_coef=0.0, kl_estimator="k3",
        kl_placement="loss", reward_weights=(1.0, 2.0),
    )  # fmt: skip
    parts = t([[[1, 0], [0, 1]], [[1, 1], [1, 1]]])
    adv, keep = objective.group_advantages(parts @ t([1.0, 2.0]), parts)
    assert keep[0].all() and not keep[1].any()
    assert adv[0, 0] != 0 and adv[1].eq(0).all()
    with pytest.raises(ValueError, match="reward values"):
        objective.group_advantages(parts.sum(dim=2))
    # It never streams: its std is the whole batch's.
    from asyncrl.staleness.registry import make_policy

    streaming = dataclasses_replace(objective, streaming="auto")
    assert "gdpo" in streaming.fallback_reason(make_policy("none"))


def test_unknown_advantage_name_raises_instead_of_running_mc_grpo():
    import dataclasses

    from asyncrl.learner.objective import RLObjective

    objective = RLObjective(
        agg="token-mean", norm_constant=1.0, streaming="off", advantage="grpo", loss="ppo", clip_low=0.2,
        clip_high=0.2, dual_clip=None, drop_degenerate_groups=False, kl_coef=0.0, kl_estimator="k3",
        kl_placement="loss",
    )  # fmt: skip
    with pytest.raises(ValueError, match="not an estimator"):
        dataclasses.replace(objective, advantage="mc_grpo2").group_advantages(t([[1.0, 0.0]]))


def _config(*sets):
    from asyncrl.config_load import load_config

    return load_config(overrides=list(sets))


def test_gdpo_is_refused_at_load_where_it_cannot_be_exact(tmp_path):
    from asyncrl.config_load import load_config
    from asyncrl.config_sections import ConfigError

    with pytest.raises(ConfigError, match="two or more task.rewards"):
        _config("learner.advantage=gdpo")
    two = tmp_path / "two.toml"
    two.write_text(
        '[[task.rewards]]\nkind = "exact_match"\n[[task.rewards]]\nkind = "length_penalty"\nweight = 0.5\n'
        '[learner]\nadvantage = "gdpo"\n'
    )
    cfg = load_config(two)
    assert cfg.learner.advantage == "gdpo"
    for sets, match in [
        (["learner.kl_coef=0.1", "learner.kl_placement=reward"], "kl_placement"),
        (["staleness.vcpo_baseline=opob"], "vcpo_baseline"),
        (["sampling.guidance.enabled=true"], "sampling.guidance"),
    ]:
        with pytest.raises(ConfigError, match=match):
            load_config(two, overrides=sets)


def dataclasses_replace(sample, **changes):
    import dataclasses

    return dataclasses.replace(sample, **changes)


def test_reward_parts_travel_from_the_scorer_to_the_learner_in_task_rewards_order():
    # Two rewards, the second weighted 0.5: the scorer puts each one's unweighted value on the
    # rollout in task.rewards order, the trajectory carries them, the learner's sample has them.
    import asyncio

    from asyncrl.learner.step import sample_from_message
    from asyncrl.transport.codec import decode, encode, trajectory_frames
    from tests.unit.test_sample_feed import rollout, scorer, task

    rewards = (
        'task.rewards=[{kind = "exact_match", name = "correct"}, '
        '{kind = "regex", name = "digit", weight = 0.5, options = {pattern = "8"}}]'
    )
    s = scorer(rewards)
    t = task(0, n=2)
    s.open(t)

    async def go():
        try:
            return await s.take([rollout(t, 0, text="7"), rollout(t, 1, text="8")])
        finally:
            await s.close()

    v = asyncio.run(go())
    got = {r.sample_index: (r.reward, r.reward_parts) for _, r in v.send}
    assert got == {0: (1.0, [1.0, 0.0]), 1: (0.5, [0.0, 1.0])}
    msg, frames = trajectory_frames(t, v.send[1][1], "gen-0", 0.1)
    sample = sample_from_message(*decode(encode(msg, frames)))
    assert list(sample.reward_parts) == [0.0, 1.0] and sample.reward == 0.5
