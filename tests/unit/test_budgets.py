"""Rollout budgets (#37, sampling.budget = "uncertainty"): groups of unequal sizes.

Each estimator over each group's own members on hand-computed cases; the launcher's allocation
(equal sample budgets per step, more samples where E[p (1 - p)] is larger, the same sizes after a
resume); traj ids and the ledger with unequal groups; a streamed step on unequal groups equals the
whole-batch step (float64); the combinations not supported are refused at load."""

from __future__ import annotations

import copy
import dataclasses
import math

import msgspec
import pytest
import torch
from test_selection import SAMPLING, SetTask, make
from test_trainer import STEP, _batch_step, _model, _params, _stream_step, _trainer

from asyncrl.config_load import load_config
from asyncrl.config_sections import ConfigError
from asyncrl.learner.advantages import group_rewards
from asyncrl.learner.objective import Objective
from asyncrl.learner.step import TrainSample, pack
from asyncrl.messages import TaskDone
from asyncrl.scheduler.budget import Budget, deal, posterior_std
from asyncrl.scheduler.dispatch import Dispatcher
from asyncrl.scheduler.modes import WindowMode
from asyncrl.scheduler.tasks import TaskBook

EPS = 1e-6
BUDGET = ["sampling.budget=uncertainty", "sampling.budget_min=2", "sampling.budget_max=6"]

# -- estimators over each group's own members ------------------------------------------------

# Group 0: [1, 0] (n = 2), group 1: [1, 0, 0, 0] (n = 4), padded to [2, 4].
REWARDS_B = torch.tensor([1.0, 0.0, 1.0, 0.0, 0.0, 0.0], dtype=torch.float64)
GROUP_B = torch.tensor([0, 0, 1, 1, 1, 1])
SLOT_B = torch.tensor([0, 1, 0, 1, 2, 3])
SIZES_G = torch.tensor([2, 4])


def _advantages(advantage: str, *, parts=None, drop=False):
    objective = dataclasses.replace(
        Objective.from_config(load_config()),
        advantage=advantage,
        reward_weights=(1.0,) if advantage == "gdpo" else (),
        drop_degenerate_groups=drop,
    )
    rewards_GN = group_rewards(REWARDS_B, GROUP_B, SLOT_B, num_groups=2, group_size=4, sizes_G=SIZES_G)
    adv_GN, keep_GN = objective.group_advantages(rewards_GN, parts, sizes_G=SIZES_G)
    return adv_GN[GROUP_B, SLOT_B], keep_GN


def test_grpo_dr_grpo_and_rloo_use_each_groups_own_members():
    # Group 0: mean 1/2, unbiased std sqrt(1/2); group 1: mean 1/4, unbiased std 1/2.
    grpo, keep = _advantages("grpo")
    s0, s1 = math.sqrt(0.5) + EPS, 0.5 + EPS
    expected = [0.5 / s0, -0.5 / s0, 0.75 / s1, -0.25 / s1, -0.25 / s1, -0.25 / s1]
    torch.testing.assert_close(grpo, torch.tensor(expected, dtype=torch.float64), rtol=0, atol=1e-12)
    assert keep.tolist() == [[True, True, False, False], [True, True, True, True]]  # padding: not kept
    dr, _ = _advantages("dr_grpo")
    assert dr.tolist() == [0.5, -0.5, 0.75, -0.25, -0.25, -0.25]
    # RLOO: r_i minus the mean of the group's other n - 1 members.
    rloo, _ = _advantages("rloo")
    torch.testing.assert_close(
        rloo, torch.tensor([1.0, -1.0, 1.0, -1 / 3, -1 / 3, -1 / 3], dtype=torch.float64), rtol=0, atol=1e-12
    )


def test_gdpo_normalises_each_group_then_scales_by_the_std_of_every_member():
    parts = group_rewards(REWARDS_B, GROUP_B, SLOT_B, num_groups=2, group_size=4, sizes_G=SIZES_G)[..., None]
    gdpo, _ = _advantages("gdpo", parts=parts)
    s0, s1 = math.sqrt(0.5) + EPS, 0.5 + EPS
    per_group = [0.5 / s0, -0.5 / s0, 0.75 / s1, -0.25 / s1, -0.25 / s1, -0.25 / s1]
    mean = sum(per_group) / 6  # 0 up to eps
    batch_std = math.sqrt(sum((a - mean) ** 2 for a in per_group) / 5)  # about sqrt(4/5), unbiased
    expected = torch.tensor([a / (batch_std + EPS) for a in per_group], dtype=torch.float64)
    torch.testing.assert_close(gdpo, expected, rtol=0, atol=1e-9)
    assert batch_std == pytest.approx(math.sqrt(0.8), abs=1e-5)


def test_a_degenerate_group_of_its_own_size_gets_zero_and_is_dropped():
    global REWARDS_B
    saved, REWARDS_B = REWARDS_B, torch.tensor([1.0, 1.0, 1.0, 0.0, 0.0, 0.0], dtype=torch.float64)
    try:
        adv, keep = _advantages("grpo", drop=True)
    finally:
        REWARDS_B = saved
    assert adv[:2].tolist() == [0.0, 0.0] and not bool(keep[0].any())
    assert bool(keep[1].all())


def test_group_rewards_refuses_a_missing_or_extra_member():
    with pytest.raises(ValueError, match="filled exactly once"):
        group_rewards(REWARDS_B[:5], GROUP_B[:5], SLOT_B[:5], num_groups=2, group_size=4, sizes_G=SIZES_G)


# -- the launcher's allocation ---------------------------------------------------------------


def test_deal_is_proportional_within_the_bounds_and_even_for_equal_weights():
    assert deal(16, [1.0] * 4, lo=2, hi=8) == [4, 4, 4, 4]
    assert deal(12, [3.0, 1.0], lo=2, hi=8) == [8, 4]  # 3:1 would be 9:3; capped at 8
    assert deal(8, [0.0, 1.0, 0.0], lo=2, hi=8) == [2, 4, 2]
    with pytest.raises(ValueError, match="cannot deal 40 samples to 4 groups of 2..8"):
        deal(40, [1.0] * 4, lo=2, hi=8)


def test_each_step_spends_exactly_its_samples_whatever_the_admission_chunks():
    budget = Budget(groups_per_step=4, samples_per_group=4, lo=2, hi=8, adaptive=True)
    a = budget.allocate([0], [0.25])
    b = budget.allocate([1, 2], [0.01, 0.2])
    c = budget.allocate([3, 4], [0.01, 0.1])  # step 0's last group, step 1's first
    assert sum(a + b + c[:1]) == 16
    assert all(2 <= n <= 8 for n in a + b + c)
    assert b[0] < b[1]  # the prompt estimated solved or hopeless gets fewer samples
    fixed = Budget(groups_per_step=4, samples_per_group=4, lo=2, hi=16, adaptive=False)
    assert fixed.allocate([0, 1, 2], [0.25, 0.0, 0.1]) == [4, 4, 4] and fixed.stride == 0


def test_a_readmitted_group_keeps_its_saved_size_whatever_the_record_says_now():
    """A resume's record holds trained groups only, so it can differ from the one a group was
    sized by: the checkpoint's sizes win, and the step's new groups get exactly what is left."""
    budget = Budget(groups_per_step=4, samples_per_group=4, lo=2, hi=8, adaptive=True)
    sizes = budget.allocate([0, 1, 2, 3], [0.3, 0.05, 0.05, 0.05])
    assert sizes[0] > 4
    saved = msgspec.json.decode(msgspec.json.encode({0: sizes[0], 1: sizes[1]}))  # keys become strings
    resumed = Budget(groups_per_step=4, samples_per_group=4, lo=2, hi=8, adaptive=True)
    resumed.restore(saved)
    assert resumed.allocate([0, 1], [0.05, 0.3]) == sizes[:2]
    rest = resumed.allocate([2, 3], [0.05, 0.3])
    assert sum(rest) == 16 - sizes[0] - sizes[1] and rest[1] > rest[0]


def test_the_weight_is_largest_near_one_half_and_for_little_evidence():
    assert posterior_std(1, 1) == pytest.approx(math.sqrt(1 / 12))
    assert posterior_std(5, 5) > posterior_std(9, 1)
    assert posterior_std(2, 2) > posterior_std(20, 20)


def _dispatcher(selection, *, resume_version: int = 0) -> Dispatcher:
    return Dispatcher(
        book=TaskBook(groups_per_step=4, samples_per_group=4, sizes=(2, 6)),
        mode=WindowMode(groups_per_step=4, max_staleness=0, total_steps=8, resume_version=resume_version),
        task=SetTask(),
        sampling=SAMPLING,
        max_staleness=0,
        selection=selection,
    )


def _finish(d: Dispatcher, tasks, v: int) -> dict[int, tuple[int, int]]:
    """Every task finishes with rewards that depend on its prompt; group -> (index, size)."""
    for task in tasks:
        n = task.num_samples
        total = float((task.dataset_index * 5 + v) % (n + 1))
        d.done(
            task.task_id,
            "a",
            result=TaskDone(
                task_id=task.task_id,
                generator_id="a",
                num_trajectories=n,
                num_tokens=0,
                generate_s=0.0,
                mean_reward=total / n,
            ),
        )
    return {t.group_id: (t.dataset_index, t.num_samples) for t in tasks}


def _drive(selection, versions, d=None):
    d = d or _dispatcher(selection)
    chosen = {}
    for v in versions:
        chosen |= _finish(d, d.plan(loaded_version=v, serving=["a"]).by_peer.get("a", []), v)
        selection.trained(range(v * 4, (v + 1) * 4))
        d.book.trained(v)
    return d, chosen


def test_sizes_follow_the_record_spend_each_step_exactly_and_a_resume_repeats_them():
    whole = make("replay", "learner.samples_per_group=4", "learner.groups_per_step=4", *BUDGET)
    d, whole_chosen = _drive(whole, range(8))
    sizes = [whole_chosen[j][1] for j in range(32)]
    assert len(set(sizes)) > 1  # the sizes really differ
    assert all(sum(sizes[s * 4 : s * 4 + 4]) == 16 for s in range(8))
    summary = d.book.summary(at_end=True)
    assert (summary.num_samples_trained, summary.num_samples_lost, summary.num_duplicated) == (128, 0, 0)

    # The checkpoint after step 1: step 2 finished (in the record) but not trained, step 3 admitted
    # with step 2 in the record. The resumed record has steps 0-1 only, so step 3's sizes must come
    # from the checkpoint, not from the record again.
    first = make("replay", "learner.samples_per_group=4", "learner.groups_per_step=4", *BUDGET)
    d1, chosen = _drive(first, range(2))
    for v in (2, 3):
        chosen |= _finish(d1, d1.plan(loaded_version=v, serving=["a"]).by_peer["a"], v)
    state = msgspec.json.decode(msgspec.json.encode(first.state()))
    assert state["budget"] == "uncertainty" and len(state["sizes"]) == 8
    resumed = make("replay", "learner.samples_per_group=4", "learner.groups_per_step=4", *BUDGET)
    resumed.restore(state, where="test")
    d2 = _dispatcher(resumed, resume_version=2)
    d2.book.num_steps_trained = 2
    saved = {"admission": {"num_admitted": d1.mode.admission.num_admitted}, "selection": state}
    readmitted = d2.readmit(saved, resume_version=2)
    assert {t.group_id: (t.dataset_index, t.num_samples) for t in readmitted} == {
        j: whole_chosen[j] for j in range(8, 16)
    }
    _, rest = _drive(resumed, range(2, 8), d2)
    assert {**chosen, **rest} == whole_chosen


def test_traj_ids_of_unequal_groups_are_distinct():
    selection = make("replay", "learner.samples_per_group=4", "learner.groups_per_step=4", *BUDGET)
    d, _ = _drive(selection, range(3))
    tasks = d.admit(range(12, 16), loaded_version=3)
    ids = [t.traj_id(k) for t in tasks for k in range(t.num_samples)]
    assert len(ids) == len(set(ids)) and all(t.sample_stride == 6 for t in tasks)


def test_a_checkpoint_of_another_budget_is_refused():
    saved = msgspec.json.decode(msgspec.json.encode(make("uniform", "learner.samples_per_group=4").state()))
    with pytest.raises(ValueError, match="sampling.budget = 'fixed', the config now says 'uncertainty'"):
        make("uniform", "learner.samples_per_group=4", *BUDGET).restore(saved, where="the checkpoint")


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        (
            ["sampling.budget_min=4"],
            "sampling.budget_min / budget_max apply with sampling.budget = 'uncertainty'",
        ),
        (
            ["sampling.budget=uncertainty", "sampling.budget_min=9", "sampling.budget_max=8"],
            "budget_min = 9 is above",
        ),
        ([*BUDGET, "learner.samples_per_group=8"], "samples_per_group = 8 is the mean group size"),
        ([*BUDGET, "buffer.mode=pool"], "not supported with buffer.mode = 'pool'"),
        (
            [*BUDGET, "learner.advantage=mc_grpo", "learner.samples_per_group=5"],
            "learner.advantage = 'mc_grpo'",
        ),
        ([*BUDGET, "sampling.guidance.enabled=true"], "not supported with sampling.guidance"),
        ([*BUDGET, 'env.kind="x:y"'], "not supported with env.kind"),
        (
            [*BUDGET, "staleness.policy=vcpo", "staleness.vcpo_baseline=opob"],
            "staleness.vcpo_baseline = 'opob'",
        ),
    ],
)
def test_what_budgets_do_not_support_is_refused_at_load(sets, message):
    with pytest.raises(ConfigError, match=message):
        load_config(overrides=["learner.samples_per_group=4", *sets])


def test_opd_with_budgets_is_refused():
    """(OPD needs a teacher to load; the rule on a config with both set.)"""
    config = load_config(overrides=["learner.samples_per_group=4", *BUDGET])
    with pytest.raises(ValueError, match="not supported with opd.enabled \\(distillation\\): turn opd off"):
        msgspec.structs.replace(config, opd=msgspec.structs.replace(config.opd, enabled=True))


# -- the learner on unequal groups -----------------------------------------------------------

SIZES = (2, 5, 3, 6)  # 16 samples, as 4 groups of 4


def _ragged(model, sizes=SIZES, seed=0):
    """Groups of `sizes` random completions with the model's own log-probs; each sample carries
    its group's size (Trajectory.num_samples) and traj id group * 6 + k."""
    from asyncrl.kernels.logprobs import causal_lm_logprobs

    g = torch.Generator().manual_seed(seed)
    out = []
    for grp, size in enumerate(sizes):
        prompt = [1] + torch.randint(4, 20, (3 + grp % 3,), generator=g).tolist()
        for k in range(size):
            ids = torch.randint(4, 20, (2 + int(torch.randint(0, 4, (1,), generator=g)),), generator=g)
            with torch.no_grad():
                logp = causal_lm_logprobs(model, torch.tensor([prompt + ids.tolist()])).logp[0, len(prompt) :]
            reward = float(torch.randint(0, 2, (1,), generator=g)) if grp != 2 else 1.0  # group 2 degenerate
            out.append(
                TrainSample(
                    traj_id=grp * 6 + k, group_id=grp, sample_index=k, prompt_ids=prompt, completion_ids=ids,
                    behavior_logprobs=logp.float(), token_versions=torch.full((len(ids),), STEP), reward=reward,
                    group_size=size,
                )
            )  # fmt: skip
    return out


def test_fixed_sizes_pack_as_before():
    base = _model_stub_samples()
    assert pack(base, pad_token_id=0).sizes_G is None
    ragged = [
        dataclasses.replace(s, group_size=3 if s.group_id == 0 else 2) for s in base if s.sample_index < 3
    ]
    ragged = [s for s in ragged if s.group_id == 0 or s.sample_index < 2]
    assert pack(ragged, pad_token_id=0).sizes_G.tolist() == [3, 2]
    with pytest.raises(ValueError, match="incomplete groups"):
        pack(ragged[:-1], pad_token_id=0)


def _model_stub_samples():
    return [
        TrainSample(
            traj_id=g * 4 + k, group_id=g, sample_index=k, prompt_ids=[1, 2], completion_ids=torch.tensor([3, 4]),
            behavior_logprobs=torch.tensor([-1.0, -1.0]), token_versions=torch.tensor([0, 0]), reward=float(k % 2),
            group_size=4,
        )
        for g in range(2)
        for k in range(4)
    ]  # fmt: skip


STREAMING = {
    "grpo": [],
    "dr_grpo": ["learner.advantage=dr_grpo", 'learner.agg="seq-mean-token-sum-norm"'],
    "rloo": ["learner.advantage=rloo", 'learner.agg="seq-mean-token-mean"'],
    "dapo": ["learner.clip_high=0.28", "learner.drop_degenerate_groups=true"],
}


@pytest.mark.parametrize("name", sorted(STREAMING))
def test_a_streamed_step_on_unequal_groups_equals_the_whole_batch_step(tiny_model_dir, name):
    base = _model(tiny_model_dir)
    samples = _ragged(base, seed=sorted(STREAMING).index(name))
    ref = copy.deepcopy(base)
    batch = _batch_step(ref, samples, *STREAMING[name])
    assert (_params(ref) - _params(base)).abs().max() > 1e-6  # the step really trained
    for seed in range(2):
        model = copy.deepcopy(base)
        trainer, result = _stream_step(model, samples, *STREAMING[name], seed=seed)
        assert (trainer.fallback, result.num_trajectories, result.streamed > 0) == ("", len(samples), True)
        torch.testing.assert_close(_params(model), _params(ref), rtol=0, atol=1e-10)
        assert result.loss == pytest.approx(batch.loss, abs=1e-9)


def test_a_whole_batch_step_on_unequal_groups_is_each_groups_own_dr_grpo(tiny_model_dir):
    """Dr. GRPO on groups of 2 and 3 equals the step on the same samples with each group's
    advantages r - mean(own group) given directly as rewards of a group whose mean is 0."""
    base = _model(tiny_model_dir)
    samples = _ragged(base, sizes=(2, 3), seed=5)
    sets = ["learner.advantage=dr_grpo", 'learner.agg="seq-mean-token-sum-norm"', "learner.streaming=off"]
    ragged = copy.deepcopy(base)
    t = _trainer(ragged, *sets, group_size=4)
    t.begin_step(STEP)
    t.batch_backward(samples)
    t.finish_step()
    # The same advantages as rewards centred per group, each group alone (its mean is then 0).
    centred = []
    for g in (0, 1):
        members = [s for s in samples if s.group_id == g]
        mean = sum(s.reward for s in members) / len(members)
        centred += [dataclasses.replace(s, reward=s.reward - mean) for s in members]
    direct = copy.deepcopy(base)
    t = _trainer(direct, *sets, group_size=4)
    t.begin_step(STEP)
    t.batch_backward(centred)
    t.finish_step()
    torch.testing.assert_close(_params(ragged), _params(direct), rtol=0, atol=1e-12)
    assert (_params(ragged) - _params(base)).abs().max() > 1e-6
