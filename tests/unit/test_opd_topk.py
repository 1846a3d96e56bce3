"""The teacher's top-K cache on the learner's side (float64): the teacher-weighted sparse forward KL
over the top-K equals the full forward KL, value and gradient, when K = V; every estimator on the
union cache (the student's N draws + the teacher's K ids) against its definition; and the
horizon, position, teachability and freshness weights of `opd_control` against hand-computed
cases."""

from __future__ import annotations

import math

import pytest
import torch

from asyncrl.learner.distill_work import OpdArrays, distill_term, estimator_columns
from asyncrl.learner.objective import DistillationObjective
from asyncrl.learner.opd import topk_forward_kl
from asyncrl.learner.opd_control import (
    DistillControl,
    completion_positions,
    freshness_weights_B,
    horizon_mask,
    next_horizon,
    position_weights,
    teachability_weights,
)

F64 = torch.float64
V = 7  # a small vocabulary: K = V is the whole distribution


def b(rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.bool)


def t(rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=F64)


def distributions(seed: int, shape=(2, 4)):
    """Student logits (leaf, with grad) and teacher log-probs over V ids, float64."""
    g = torch.Generator().manual_seed(seed)
    student_BTV = torch.randn(*shape, V, generator=g, dtype=F64).requires_grad_(True)
    teacher_BTV = torch.log_softmax(2.0 * torch.randn(*shape, V, generator=g, dtype=F64), dim=-1)
    return student_BTV, teacher_BTV


def full_forward_kl(student_BTV, teacher_BTV, mask_BT) -> torch.Tensor:
    """sum over valid positions of KL(pi_T || pi_S), over the whole vocabulary."""
    logp_BTV = torch.log_softmax(student_BTV, dim=-1)
    per_BT = (teacher_BTV.exp() * (teacher_BTV - logp_BTV)).sum(-1)
    return torch.where(mask_BT, per_BT, 0.0).sum()


def union_cache(student_BTV, teacher_BTV, *, num: int, k: int, seed: int):
    """The learner's arrays of a union cache: N student draws (column 0 the sampled token), then the
    teacher's top-k ids; the student's log-probs of every column (with grad)."""
    g = torch.Generator().manual_seed(seed + 100)
    logp_BTV = torch.log_softmax(student_BTV, dim=-1)
    probs = logp_BTV.detach().exp().reshape(-1, V)
    drawn_BTN = torch.multinomial(probs, num, replacement=True, generator=g).reshape(
        *student_BTV.shape[:2], num
    )
    top_BTK = teacher_BTV.topk(k, dim=-1).indices
    ids_BTC = torch.cat([drawn_BTN, top_BTK], dim=-1)
    behav = logp_BTV.detach().gather(-1, drawn_BTN) - 0.05  # a slightly stale behavior student
    behav_BTC = torch.cat([behav, torch.full_like(top_BTK, math.nan, dtype=F64)], dim=-1)
    return logp_BTV.gather(-1, ids_BTC), teacher_BTV.gather(-1, ids_BTC), ids_BTC, behav_BTC


def objective(estimator: str, **kw) -> DistillationObjective:
    return DistillationObjective(
        estimator=estimator, agg="token-mean", norm_constant=1.0, streaming="auto", **kw
    )


MASK = b([[True, True, True, False], [True, True, False, False]])


# ----------------------------------------------------------------------------- acceptance 1
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_sparse_forward_kl_with_k_equal_v_is_the_full_forward_kl(seed):
    student_BTV, teacher_BTV = distributions(seed)
    top = teacher_BTV.topk(V, dim=-1)
    logp_BTK = torch.log_softmax(student_BTV, dim=-1).gather(-1, top.indices)
    sparse, _ = topk_forward_kl(logp_BTK, top.values, MASK, mode="token-mean", num_tokens_global=1.0)
    (g_sparse,) = torch.autograd.grad(sparse, student_BTV)
    full = full_forward_kl(student_BTV, teacher_BTV, MASK)
    (g_full,) = torch.autograd.grad(full, student_BTV)
    assert abs(float(sparse.detach()) - float(full.detach())) < 1e-10
    assert float((g_sparse - g_full).abs().max()) < 1e-10


@pytest.mark.parametrize("estimator", ["topk_forward_kl", "forward_kl"])
@pytest.mark.parametrize("seed", [0, 1])
def test_union_cache_forward_kls_with_k_equal_v_are_the_full_forward_kl(estimator, seed):
    """Through the learner's distillation term: the top-K estimator reads the K teacher columns, the
    forward_kl estimator every distinct id of the union; at K = V both are the full forward KL."""
    student_BTV, teacher_BTV = distributions(seed)
    logp, teacher, ids, behav = union_cache(student_BTV, teacher_BTV, num=3, k=V, seed=seed)
    opd = OpdArrays(teacher, ids, behav, num_sampled=3, control=DistillControl())
    loss, stats = distill_term(objective(estimator), logp, opd, MASK)
    (g_loss,) = torch.autograd.grad(loss, student_BTV)
    full = full_forward_kl(student_BTV, teacher_BTV, MASK)
    (g_full,) = torch.autograd.grad(full, student_BTV)
    assert abs(float(loss.detach()) - float(full.detach())) < 1e-10
    assert float((g_loss - g_full).abs().max()) < 1e-10
    assert abs(stats.kl - float(full.detach()) / float(MASK.sum())) < 1e-10
    assert stats.num_distilled == stats.num_tokens == float(MASK.sum())


def test_sparse_forward_kl_below_v_is_the_hand_sum_without_renormalising():
    """K = 2 of three ids: p_T not renormalised over the two (module opd.py)."""
    teacher = t([[[math.log(0.5), math.log(0.3)]]])  # the third id has 0.2
    student = t([[[math.log(0.25), math.log(0.25)]]]).requires_grad_(True)
    loss, _ = topk_forward_kl(student, teacher, b([[True]]), mode="token-mean", num_tokens_global=1.0)
    want = 0.5 * math.log(0.5 / 0.25) + 0.3 * math.log(0.3 / 0.25)
    assert abs(float(loss.detach()) - want) < 1e-12
    (grad,) = torch.autograd.grad(loss, student)
    assert torch.allclose(grad, t([[[-0.5, -0.3]]]), atol=1e-12, rtol=0)


def test_union_forward_kl_counts_an_id_drawn_and_in_the_top_k_once():
    """Union cache [3, 3 | 3, 5]: ids 3 and 5 once each."""
    logp = t([[[-1.0, -1.0, -1.0, -2.0]]]).requires_grad_(True)
    teacher = t([[[-0.5, -0.5, -0.5, -1.5]]])
    ids = torch.tensor([[[3, 3, 3, 5]]])
    behav = t([[[-1.0, -1.0, math.nan, math.nan]]])
    opd = OpdArrays(teacher, ids, behav, num_sampled=2, control=DistillControl())
    loss, _ = distill_term(objective("forward_kl"), logp, opd, b([[True]]))
    want = math.exp(-0.5) * (-0.5 + 1.0) + math.exp(-1.5) * (-1.5 + 2.0)
    assert abs(float(loss.detach()) - want) < 1e-12


@pytest.mark.parametrize("estimator", ["reverse_kl", "mc_reverse_kl"])
def test_reverse_estimators_read_the_students_draws_only(estimator):
    """The teacher's ids are not draws from the student: the Monte Carlo reverse-KL estimators give
    bitwise the loss and gradient they give without the top-K columns."""
    student_BTV, teacher_BTV = distributions(4)
    logp, teacher, ids, behav = union_cache(student_BTV, teacher_BTV, num=3, k=4, seed=4)
    obj = objective(estimator, clip_eps=0.2)
    with_top, _ = distill_term(obj, logp, OpdArrays(teacher, ids, behav, num_sampled=3), MASK)
    (g_with,) = torch.autograd.grad(with_top, student_BTV)
    logp, teacher, ids, behav = union_cache(student_BTV, teacher_BTV, num=3, k=4, seed=4)
    alone, _ = distill_term(
        obj, logp[..., :3], OpdArrays(teacher[..., :3], ids[..., :3], behav[..., :3]), MASK
    )
    (g_alone,) = torch.autograd.grad(alone, student_BTV)
    assert torch.equal(with_top, alone) and torch.equal(g_with, g_alone)
    assert not bool(torch.isnan(g_with).any())  # the NaN behavior log-probs of the top-K never reach it


def test_estimator_columns_and_the_missing_top_k():
    assert estimator_columns("reverse_kl", 2, 6) == slice(0, 2)
    assert estimator_columns("mc_reverse_kl", 2, 6) == slice(0, 2)
    assert estimator_columns("forward_kl", 2, 6) == slice(0, 6)
    assert estimator_columns("topk_forward_kl", 2, 6) == slice(2, 6)
    with pytest.raises(ValueError, match="teacher_top_k"):
        estimator_columns("topk_forward_kl", 2, 2)


def test_selection_scores_read_the_draws_not_the_top_k():
    """Entropy selection over the draws: the top-K columns (very unlikely ids here) change nothing."""
    student_BTV, teacher_BTV = distributions(5)
    logp, teacher, ids, behav = union_cache(student_BTV, teacher_BTV, num=2, k=3, seed=5)
    obj = objective("topk_forward_kl", select="entropy", select_fraction=0.5)
    _, stats = distill_term(obj, logp, OpdArrays(teacher, ids, behav, num_sampled=2), MASK)
    from asyncrl.learner.opd_mix import select_tokens, selection_scores

    want = select_tokens(
        selection_scores(logp[..., :2], teacher[..., :2], MASK, select="entropy"), MASK, fraction=0.5
    )
    assert stats.num_selected == float(want.sum()) == stats.num_distilled


# ----------------------------------------------------------------------------- the weights
def test_completion_positions_count_trained_tokens():
    mask = b([[False, True, True, False, True], [True, False, False, False, False]])
    assert completion_positions(mask).tolist() == [[-1, 0, 1, -1, 2], [0, -1, -1, -1, -1]]


def test_horizon_mask_keeps_the_first_h_trained_tokens():
    mask = b([[False, True, True, True, True], [True, True, False, False, False]])
    assert horizon_mask(mask, 2).tolist() == [
        [False, True, True, False, False],
        [True, True, False, False, False],
    ]
    assert torch.equal(horizon_mask(mask, 0), mask)
    assert torch.equal(horizon_mask(mask, 9), mask)
    with pytest.raises(ValueError):
        horizon_mask(mask, -1)


def test_position_weights_are_powers_of_the_decay():
    mask = b([[False, True, True, True]])
    assert position_weights(mask, 0.5).tolist() == [[0.0, 1.0, 0.5, 0.25]]
    assert position_weights(mask, 1.0).tolist() == [[0.0, 1.0, 1.0, 1.0]]
    with pytest.raises(ValueError, match="decay"):
        position_weights(mask, 0.0)


def test_teachability_is_the_students_mass_on_the_teachers_top_k():
    logp_top = t([[[math.log(0.5), math.log(0.2)], [math.log(0.01), math.log(0.04)], [0.0, 0.0]]])
    w = teachability_weights(logp_top, b([[True, True, False]]))
    assert torch.allclose(w, t([[0.7, 0.05, 0.0]]), atol=1e-12, rtol=0)


def test_freshness_weight_of_a_trajectory():
    """D_roll = mean k3(behav - now), D_sup = mean |behav - now|; f = exp(-(l_r D_roll + l_s D_sup))."""
    now = t([[-1.0, -2.0, -3.0]])
    behav = t([[-1.5, -2.0, 0.0]])
    mask = b([[True, True, False]])
    d = [-0.5, 0.0]
    d_roll = sum(math.exp(x) - x - 1 for x in d) / 2
    d_sup = sum(abs(x) for x in d) / 2
    f = freshness_weights_B(now, behav, mask, lambda_roll=2.0, lambda_sup=0.5, f_min=0.0)
    assert abs(float(f[0]) - math.exp(-(2.0 * d_roll + 0.5 * d_sup))) < 1e-12
    assert float(freshness_weights_B(now, behav, mask, lambda_roll=2.0, lambda_sup=0.5, f_min=0.9)[0]) == 0.0


@pytest.mark.parametrize(
    ("schedule", "kl", "want"),
    [("fixed", 0.0, 4), ("linear", 9.0, 6), ("gap", 0.1, 6), ("gap", 0.3, 4), ("gap", None, 4)],
)
def test_next_horizon(schedule, kl, want):
    assert next_horizon(4, schedule=schedule, growth=2, horizon_max=0, gap=0.2, kl=kl) == want


def test_horizon_stops_at_its_maximum_and_none_stays_none():
    assert next_horizon(4, schedule="linear", growth=3, horizon_max=5, gap=0.0, kl=None) == 5
    assert next_horizon(0, schedule="linear", growth=3, horizon_max=0, gap=0.0, kl=None) == 0
    control = DistillControl(horizon=1, schedule="gap", growth=1, gap=0.5)
    mask = b([[True, True]])
    reports = []
    for kl in (0.9, 0.4, 0.6, 0.1):
        control.observe(mask, mask, mask, t([[kl, kl]]))
        reports.append(control.end_step())
    assert control.history == [1, 1, 2, 2] and control.current == 3
    assert reports[1] == {"opd_horizon": 1.0, "opd_horizon_gap": 0.4, "opd_scored_fraction": 1.0}


@pytest.mark.parametrize(
    ("schedule", "version", "want"),
    [("fixed", 7, 3), ("linear", 0, 3), ("linear", 2, 7), ("linear", 9, 10), ("gap", 5, 0)],
)
def test_scheduled_horizon_is_a_function_of_the_version(schedule, version, want):
    from asyncrl.config_sections import scheduled_horizon

    assert scheduled_horizon(3, schedule, 2, 10, version) == want
    control = DistillControl(horizon=3, schedule=schedule, growth=2, horizon_max=10)
    control.begin_step(version)
    assert control.current == (want if schedule != "gap" else 3)


def test_rows_the_teacher_left_unscored_are_never_distilled():
    """NaN teacher rows (past the generator's horizon) weigh 0 and count as unscored."""
    student_BTV, teacher_BTV = distributions(7)
    logp, teacher, ids, behav = union_cache(student_BTV, teacher_BTV, num=1, k=3, seed=7)
    teacher = teacher.clone()
    teacher[0, 1:] = math.nan
    control = DistillControl(horizon=3)
    loss, stats = distill_term(
        objective("topk_forward_kl"),
        logp,
        OpdArrays(teacher, ids, behav, num_sampled=1, control=control),
        MASK,
    )
    (grad,) = torch.autograd.grad(loss, student_BTV)
    assert bool(torch.isfinite(grad).all()) and float(grad[0, 1:].abs().max()) == 0.0
    per_BT = (teacher[..., 1:].exp() * (teacher[..., 1:] - logp[..., 1:])).sum(-1)
    want = per_BT[0, 0] + per_BT[1, 0] + per_BT[1, 1]
    assert abs(float(loss.detach()) - float(want.detach())) < 1e-12
    assert stats.num_distilled == 3.0
    assert abs(stats.kl - float(want.detach()) / 3.0) < 1e-12  # over the scored tokens only
    assert control.end_step()["opd_scored_fraction"] == 3.0 / 5.0


def test_control_weights_multiply_into_the_distillation_term():
    """Horizon 2, decay 0.5, teachability on: the term is the hand-weighted sum of per-token terms."""
    student_BTV, teacher_BTV = distributions(6)
    logp, teacher, ids, behav = union_cache(student_BTV, teacher_BTV, num=1, k=2, seed=6)
    control = DistillControl(horizon=2, position_decay=0.5, teachability="overlap")
    loss, stats = distill_term(
        objective("topk_forward_kl"),
        logp,
        OpdArrays(teacher, ids, behav, num_sampled=1, control=control),
        MASK,
    )
    per_BT = (teacher[..., 1:].exp() * (teacher[..., 1:] - logp[..., 1:])).sum(-1)
    mass_BT = logp[..., 1:].detach().exp().sum(-1)
    w = t([[1.0, 0.5, 0.0, 0.0], [1.0, 0.5, 0.0, 0.0]]) * mass_BT
    assert abs(float(loss.detach()) - float((per_BT * w).sum().detach())) < 1e-12
    assert stats.num_distilled == 4.0 and stats.num_tokens == 5.0
    # Freshness: a trajectory whose behavior log-probs equal the current ones has f = 1.
    fresh = DistillControl(freshness={"lambda_roll": 1.0, "lambda_sup": 1.0, "f_min": 0.0})
    same = behav.clone()
    same[..., 0] = logp[..., 0].detach()
    one, _ = distill_term(
        objective("topk_forward_kl"), logp, OpdArrays(teacher, ids, same, num_sampled=1, control=fresh), MASK
    )
    plain, _ = distill_term(
        objective("topk_forward_kl"),
        logp,
        OpdArrays(teacher, ids, same, num_sampled=1, control=DistillControl()),
        MASK,
    )
    assert abs(float(one.detach()) - float(plain.detach())) < 1e-12
    stale, _ = distill_term(
        objective("topk_forward_kl"), logp, OpdArrays(teacher, ids, behav, num_sampled=1, control=fresh), MASK
    )
    assert float(stale.detach()) < float(plain.detach())


def test_teachability_without_the_top_k_is_an_error():
    control = DistillControl(teachability="overlap")
    with pytest.raises(ValueError, match="teacher_top_k"):
        control.weights(MASK, logp_BT=t([[0.0] * 4] * 2), behav_BT=t([[0.0] * 4] * 2), logp_top_BTK=None)


# ----------------------------------------------------------------------------- config
@pytest.mark.parametrize(
    ("sets", "message"),
    [
        (["opd.teacher_top_k=4"], r"opd\.teacher_top_k applies to distillation"),
        (["opd.enabled=true", "opd.estimator=topk_forward_kl"], r"reads the teacher's top-K"),
        (["opd.enabled=true", "opd.teachability=overlap"], r"reads the teacher's top-K"),
        (
            ["opd.enabled=true", "opd.teacher_top_k=4", "opd.placement=service"],
            r"shared teacher returns no top-K",
        ),
        (["opd.enabled=true", "opd.horizon_schedule=linear"], r"applies with a distillation horizon"),
        (["opd.enabled=true", "opd.horizon=2", "opd.horizon_max=4"], r"horizon_schedule = 'linear' or 'gap'"),
        (["opd.enabled=true", "opd.horizon=2", "opd.horizon_gap=0.1"], r"horizon_schedule = 'gap' only"),
        (["opd.enabled=true", "opd.horizon=4", "opd.horizon_schedule=linear", "opd.horizon_max=2"], r"below"),
        (
            ["opd.enabled=true", "opd.horizon=2", "opd.horizon_schedule=gap", "opd.reward=add"],
            r"opd.reward = 'off'",
        ),
        (["opd.enabled=true", "opd.position_decay=0"], r"position_decay"),
        (
            [
                "opd.enabled=true",
                "learner.kl_coef=0.1",
                "learner.kl_placement=reward",
                "learner.kl_estimator=k1",
            ],
            r"kl_placement = 'loss'",
        ),
    ],
)
def test_config_refuses_what_does_not_apply(sets, message):
    from asyncrl.config_load import load_config
    from asyncrl.config_sections import ConfigError

    with pytest.raises(ConfigError, match=message):
        load_config(overrides=sets)


def test_config_builds_the_control():
    from asyncrl.config_load import load_config

    cfg = load_config(
        overrides=[
            "opd.enabled=true",
            "opd.teacher_top_k=4",
            "opd.estimator=topk_forward_kl",
            "opd.horizon=2",
            "opd.horizon_schedule=gap",
            "opd.horizon_gap=0.1",
            "opd.teachability=overlap",
            "learner.kl_coef=0.01",
            "staleness.freshness.lambda_roll=2.0",
        ]
    )
    control = DistillControl.from_config(cfg)
    assert (control.horizon, control.schedule, control.gap, control.teachability) == (
        2,
        "gap",
        0.1,
        "overlap",
    )
    assert control.kl_coef == 0.01 and control.freshness == {
        "lambda_roll": 2.0,
        "lambda_sup": 1.0,
        "f_min": 0.0,
    }
