"""Distillation with rewards and token selection (asyncrl/learner/opd_mix.py and the objective's
distillation term): hand-computed selections, scores and gates; the selected loss's gradient is
exactly the full loss's on the chosen tokens and exactly zero elsewhere; a gated loss's gradient is
the gate-weighted sum of the trajectories' gradients; and the config refuses what it cannot train."""

from __future__ import annotations

import math

import pytest
import torch

from asyncrl.config_load import load_config
from asyncrl.config_objective import check_objective_config, check_staleness_policy
from asyncrl.config_sections import ConfigError
from asyncrl.learner.objective import CombinedObjective, DistillationObjective, Objective
from asyncrl.learner.opd_mix import outcome_gate, select_tokens, selection_scores, tokens_to_keep

F64 = torch.float64
INF = math.inf


def t(rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=F64)


def b(rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.bool)


# -- selection ------------------------------------------------------------------------------------


def test_tokens_to_keep_is_the_ceiling_with_at_least_one():
    num = torch.tensor([0, 1, 3, 4, 30, 7])
    assert tokens_to_keep(num, fraction=0.5).tolist() == [0, 1, 2, 2, 15, 4]
    # 0.1 * 30 = 3.0000000000000004 in floats: still 3 tokens, not 4.
    assert tokens_to_keep(num, fraction=0.1).tolist() == [0, 1, 1, 1, 3, 1]
    assert tokens_to_keep(num, fraction=1.0).tolist() == num.tolist()
    with pytest.raises(ValueError, match=r"\(0, 1\]"):
        tokens_to_keep(num, fraction=0.0)


def test_select_tokens_keeps_each_sequences_top_fraction():
    score = t([[0.1, 0.9, 0.5, 0.3], [2.0, 1.0, 0.0, 9.0]])
    mask = b([[True, True, True, True], [True, True, True, False]])
    # Row 0: ceil(0.5 * 4) = 2 of 4 -> 0.9 and 0.5. Row 1: ceil(0.5 * 3) = 2 of its 3 valid ones
    # (the masked 9.0 never counts) -> 2.0 and 1.0.
    assert select_tokens(score, mask, fraction=0.5).tolist() == [
        [False, True, True, False],
        [True, True, False, False],
    ]
    assert torch.equal(select_tokens(score, mask, fraction=1.0), mask)


def test_select_tokens_breaks_ties_by_position_and_ranks_nan_last():
    score = t([[1.0, 1.0, 1.0, 1.0], [math.nan, 0.0, math.nan, -1.0], [-INF, -INF, 5.0, -INF]])
    mask = b([[True] * 4, [True] * 4, [False, True, True, True]])
    got = select_tokens(score, mask, fraction=0.5)
    assert got[0].tolist() == [True, True, False, False]  # equal scores: the earlier positions
    assert got[1].tolist() == [False, True, False, True]  # NaN ranks below every number
    # Row 2: the masked position 0 ties with the valid -inf ones at -inf but never takes their place.
    assert got[2].tolist() == [False, True, True, False]


def test_selection_scores_hand_values():
    logp = t([[[-1.0, -3.0], [-0.5, -0.5]]])  # [B=1, T=2, N=2]
    teacher = t([[[-2.0, -1.0], [-0.5, INF]]])  # an inf at the masked position changes nothing
    mask = b([[True, False]])
    dis = selection_scores(logp, teacher, mask, select="disagreement")
    ent = selection_scores(logp, teacher, mask, select="entropy")
    assert dis.tolist() == [[(1.0 + 2.0) / 2, 0.0]]
    assert ent.tolist() == [[(1.0 + 3.0) / 2, 0.0]]
    with pytest.raises(ValueError, match="unknown selection"):
        selection_scores(logp, teacher, mask, select="all")


def test_outcome_gates_hand_values():
    reward = t([0.0, 0.25, 1.0, 1.5, -1.0])
    assert outcome_gate(reward, mode="add").tolist() == [1.0] * 5
    assert outcome_gate(reward, mode="gate_failed").tolist() == [1.0, 1.0, 0.0, 0.0, 1.0]
    assert outcome_gate(reward, mode="gate_failed", pass_reward=0.2).tolist() == [1.0, 0.0, 0.0, 0.0, 1.0]
    assert outcome_gate(reward, mode="weight_failed").tolist() == [1.0, 0.75, 0.0, 0.0, 1.0]
    assert outcome_gate(reward, mode="weight_failed", pass_reward=2.0).tolist() == [
        1.0,
        0.875,
        0.5,
        0.25,
        1.0,
    ]


# -- the distillation term ------------------------------------------------------------------------


def _distill(estimator="reverse_kl", select="all", fraction=1.0, kl_weight=1.0, agg="token-mean"):
    return DistillationObjective(
        agg=agg,
        norm_constant=1.0,
        streaming="auto",
        estimator=estimator,
        clip_eps=1e6,
        select=select,
        select_fraction=fraction,
        kl_weight=kl_weight,
    )


def _opd_inputs(seed=0, B=3, T=6, N=3):
    g = torch.Generator().manual_seed(seed)
    logp = (-torch.rand(B, T, N, generator=g, dtype=F64) * 3).requires_grad_(True)
    teacher = -torch.rand(B, T, N, generator=g, dtype=F64) * 3
    behav = logp.detach() - 0.2 * torch.rand(B, T, N, generator=g, dtype=F64)
    ids = torch.randint(0, 5, (B, T, N), generator=g)
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[0, :2] = False  # a prompt
    mask[2, 4:] = False  # padding
    return logp, teacher, behav, ids, mask


@pytest.mark.parametrize("estimator", ["reverse_kl", "mc_reverse_kl", "forward_kl"])
@pytest.mark.parametrize("select", ["disagreement", "entropy"])
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_selection_masks_exactly_the_chosen_tokens(estimator, select, agg):
    """The selected loss's gradient equals the full loss's at the chosen positions (up to float64
    rounding) and is exactly 0 at every other one, even with a non-finite teacher score there
    (NaN for disagreement, which ranks a NaN lowest; -inf for entropy, which never reads it)."""
    logp, teacher, behav, ids, mask = _opd_inputs()
    full = _distill(estimator, agg=agg)
    part = _distill(estimator, select=select, fraction=0.5, agg=agg)
    chosen = select_tokens(selection_scores(logp, teacher, mask, select=select), mask, fraction=0.5)
    assert chosen.sum() == sum(math.ceil(0.5 * int(n)) for n in mask.sum(1))
    bad = math.nan if select == "disagreement" else -INF
    poisoned = torch.where((mask & ~chosen)[..., None], bad, teacher)
    (g_full,) = torch.autograd.grad(full.term(logp, teacher, behav, ids, mask)[0], logp)
    loss, stats = part.term(logp, poisoned, behav, ids, mask)
    (g_part,) = torch.autograd.grad(loss, logp)
    assert torch.isfinite(g_part).all()
    assert torch.equal(g_part[~chosen], torch.zeros_like(g_part[~chosen]))
    torch.testing.assert_close(g_part[chosen], g_full[chosen], rtol=0, atol=1e-15)
    assert stats.num_selected == stats.num_distilled == float(chosen.sum())
    assert stats.num_tokens == float(mask.sum())


def test_gates_weigh_each_trajectorys_distillation_gradient():
    logp, teacher, behav, ids, mask = _opd_inputs(seed=1)
    gate = t([1.0, 0.0, 0.25])
    obj = _distill(kl_weight=0.5)
    loss, stats = obj.term(logp, teacher, behav, ids, mask, gate)
    (got,) = torch.autograd.grad(loss, logp)
    expected = torch.zeros_like(logp)
    for i in range(3):
        one = torch.zeros(3, dtype=F64)
        one[i] = 1.0
        (g_i,) = torch.autograd.grad(obj.term(logp, teacher, behav, ids, mask, one)[0], logp)
        expected += gate[i] * g_i
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-15)
    assert torch.equal(got[1], torch.zeros_like(got[1]))
    assert stats.num_distilled == float(mask[0].sum() + mask[2].sum())


def test_the_combined_objective_is_the_weighted_sum_of_its_parts():
    """reward_weight x the RL policy loss; the distillation term carries kl_weight (float64)."""
    cfg = load_config(
        overrides=[
            "opd.enabled=true",
            "opd.reward=add",
            "opd.reward_weight=0.3",
            "opd.kl_weight=2.0",
            "opd.select=entropy",
            "opd.select_fraction=0.5",
        ]
    )
    combined = Objective.from_config(cfg)
    assert isinstance(combined, CombinedObjective) and combined.distills
    assert (combined.distill.kl_weight, combined.distill.select, combined.reward_weight) == (
        2.0,
        "entropy",
        0.3,
    )
    rl = Objective.from_config(load_config())
    from asyncrl.staleness import NoCorrection, TokenBatch

    logp, teacher, behav, ids, mask = _opd_inputs(seed=2)
    logp_BT = logp[..., 0]
    adv = torch.where(mask, t([[0.5], [-1.0], [2.0]]), 0.0)
    batch = TokenBatch(
        logp_BT.detach(), behav[..., 0], mask, torch.zeros_like(mask, dtype=torch.long), adv, 0
    )
    corr = NoCorrection(anchor="behav").correct(batch)
    total = (
        combined.policy_loss(logp_BT, corr, adv, mask)[0]
        + combined.distill.term(logp, teacher, behav, ids, mask)[0]
    )
    (g_total,) = torch.autograd.grad(total, logp)
    (g_rl,) = torch.autograd.grad(rl.policy_loss(logp_BT, corr, adv, mask)[0], logp)
    plain = _distill(select="entropy", fraction=0.5)
    (g_opd,) = torch.autograd.grad(plain.term(logp, teacher, behav, ids, mask)[0], logp)
    torch.testing.assert_close(g_total, 0.3 * g_rl + 2.0 * g_opd, rtol=0, atol=1e-14)


# -- config ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        (
            ["opd.reward=add"],
            "opd.reward = 'add' changes the distillation objective, which needs opd.enabled",
        ),
        (["opd.select=entropy"], "opd.select = 'entropy' changes"),
        (["opd.enabled=true", "opd.select_fraction=0.5"], "opd.select_fraction applies with opd.select"),
        (["opd.enabled=true", "opd.select=entropy", "opd.select_fraction=1.5"], "opd.select_fraction"),
        (["opd.enabled=true", "opd.select=entropy", "opd.select_fraction=0"], "opd.select_fraction"),
        (["opd.enabled=true", "opd.reward_weight=0.5"], "opd.reward_weight weighs the task reward"),
        (["opd.enabled=true", "opd.reward=add", "opd.pass_reward=0.5"], "opd.pass_reward applies"),
        (["opd.enabled=true", "opd.kl_weight=0"], "opd.kl_weight = 0 leaves no distillation"),
        (["opd.enabled=true", "opd.reward=add", "opd.reward_weight=0"], "use opd.reward = 'off'"),
        (["opd.enabled=true", "opd.reward=gated"], "opd.reward"),
    ],
)
def test_bad_mixing_keys_fail_at_load_naming_the_key(sets, message):
    with pytest.raises(ConfigError, match=message):
        load_config(overrides=sets)


def _checked(*sets):
    cfg = load_config(overrides=list(sets))
    check_objective_config(cfg, check_staleness_policy(cfg.staleness))
    return cfg


def test_reward_mixing_cross_section_checks():
    _checked("opd.enabled=true", "opd.reward=gate_failed", "opd.reward_weight=0")  # gated OPD alone
    with pytest.raises(ConfigError, match="sampling.top_p = 1"):
        _checked("opd.enabled=true", "opd.reward=add", "sampling.top_p=0.9")
    with pytest.raises(ConfigError, match="learner.world_size.*staleness policy 'm2po'"):
        _checked("opd.enabled=true", "opd.reward=add", "staleness.policy=m2po", "learner.world_size=2")
    with pytest.raises(ConfigError, match="keeps ewma copies"):
        _checked("opd.enabled=true", "opd.reward=add", "staleness.policy=ewma", "learner.world_size=2")
    _checked("opd.enabled=true", "staleness.policy=m2po", "learner.world_size=2")  # OPD alone: no correction
