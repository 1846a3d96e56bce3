"""The learner's distillation KL per teacher and per domain (docs/opd.md, "Several teachers"):
`kl_by_teacher` against hand-computed sums on two domains, the step stats `opd_kl/teacher/<name>`
and `opd_kl/domain/<d>` (equal whether the step streams or trains the whole batch, and each equal
to the `opd_kl` of a step on that teacher's trajectories alone), and the domains read from
opd.teachers."""

from __future__ import annotations

import copy
import dataclasses
import math

import pytest
import torch

from asyncrl.config_load import load_config
from asyncrl.learner import distill_work
from asyncrl.learner.distill_work import KlByTeacher, OpdArrays, distill_term, kl_by_teacher
from asyncrl.learner.objective import DistillationObjective
from tests.unit.test_opd_combined import setup as setup  # noqa: F401 (fixture)
from tests.unit.test_trainer import _batch_step, _stream_step

NAN = float("nan")


def objective(estimator: str) -> DistillationObjective:
    return DistillationObjective(estimator=estimator, agg="token-mean", norm_constant=1.0, streaming="auto")


def hand_case():
    """Three rows of three positions, N = 1: rows 0 and 2 scored by teacher `lo` (domain two),
    row 1 by `hi` (domain three). Row 2's last position is past the teacher's horizon (NaN) and
    row 0's is padding. The behavior log-probs equal the student's, so each reverse-KL term is
    log pi - log pi_T."""
    logp = torch.tensor([[-0.5, -1.0, -9.0], [-0.2, -0.4, -0.1], [-1.5, -0.3, -0.7]], dtype=torch.float64)
    teacher = torch.tensor([[-1.0, -0.5, -9.0], [-0.9, -0.4, -1.1], [-0.5, -0.8, NAN]], dtype=torch.float64)
    mask = torch.tensor([[True, True, False], [True, True, True], [True, True, True]])
    opd = OpdArrays(teacher[..., None], torch.full((3, 3, 1), 5), logp[..., None], num_sampled=1)
    return logp[..., None], opd, mask, ["lo", "hi", "lo"]


def test_the_kl_per_teacher_is_the_hand_sum_over_its_scored_tokens():
    logp_BLN, opd, mask, ids = hand_case()
    got = kl_by_teacher(objective("reverse_kl"), logp_BLN, opd, mask, ids)
    # lo: row 0 (0.5, -0.5) and row 2 (-1.0, 0.5), its NaN position left out; hi: row 1 (0.7, 0, 1.0).
    assert got.keys() == {"lo", "hi"}
    assert got["lo"] == (pytest.approx(-0.5), 4.0)
    assert got["hi"] == (pytest.approx(1.7), 3.0)
    acc = KlByTeacher({"lo": "two", "hi": "three"})
    acc.add(got)
    acc.add({"hi": (0.3, 1.0)})  # a second chunk of the step
    report = acc.report()
    assert report == {
        "opd_kl/teacher/hi": pytest.approx(2.0 / 4.0),
        "opd_kl/domain/three": pytest.approx(2.0 / 4.0),
        "opd_kl/teacher/lo": pytest.approx(-0.5 / 4.0),
        "opd_kl/domain/two": pytest.approx(-0.5 / 4.0),
    }
    assert acc.report() == {}  # a step's sums do not carry into the next


def test_the_forward_kl_per_teacher_and_the_token_weighted_mean_is_opd_kl():
    """forward_kl over two distinct cached ids per position: p_T(y)(log p_T(y) - log pi(y)) summed;
    with every position scored, the teachers' token-weighted mean is the step's `opd_kl`."""
    lp = [math.log(x) for x in (0.5, 0.25, 0.2, 0.6)]
    lt = [math.log(x) for x in (0.4, 0.4, 0.5, 0.1)]
    logp = torch.tensor([[[lp[0], lp[1]]], [[lp[2], lp[3]]]], dtype=torch.float64)
    teacher = torch.tensor([[[lt[0], lt[1]]], [[lt[2], lt[3]]]], dtype=torch.float64)
    ids = torch.tensor([[[5, 6]], [[7, 8]]])
    opd = OpdArrays(teacher, ids, logp, num_sampled=2)
    mask = torch.tensor([[True], [True]])
    obj = objective("forward_kl")
    got = kl_by_teacher(obj, logp, opd, mask, ["a", "b"])
    want_a = 0.4 * math.log(0.4 / 0.5) + 0.4 * math.log(0.4 / 0.25)
    want_b = 0.5 * math.log(0.5 / 0.2) + 0.1 * math.log(0.1 / 0.6)
    assert got == {"a": (pytest.approx(want_a), 1.0), "b": (pytest.approx(want_b), 1.0)}
    _, stats = distill_term(obj, logp, opd, mask)
    assert stats.kl == pytest.approx((want_a + want_b) / 2)


def test_unnamed_teachers_report_nothing():
    logp_BLN, opd, mask, _ = hand_case()
    assert kl_by_teacher(objective("reverse_kl"), logp_BLN, opd, mask, ["", "", ""]) == {}


def test_domains_come_from_teachers_of_one_domain():
    cfg = load_config(
        overrides=[
            "opd.enabled=true",
            'opd.route_field="domain"',
            'opd.teachers=[{name="lo",domains=["two"]},{name="hi",domains=["three","four"]},{name="rest"}]',
        ]
    )
    assert KlByTeacher.from_config(cfg).domains == {"lo": "two"}


@pytest.fixture(scope="module")
def routed(setup):
    """`test_opd_combined`'s batch, groups 0 and 2 scored by teacher `lo` (domain two), 1 and 3
    by `hi` (domain three)."""
    base, samples = setup
    named = [dataclasses.replace(s, teacher_id="lo" if s.group_id % 2 == 0 else "hi") for s in samples]
    return base, named


SETS = ["opd.enabled=true", "opd.num_samples=3"]


def test_streamed_and_batch_steps_report_the_same_kl_per_domain(routed, monkeypatch):
    """Each domain's figure equals the `opd_kl` of a whole-batch step on its trajectories alone
    (the same model before the update), and a streamed step reports the same figures."""
    monkeypatch.setattr(distill_work, "KlByTeacher", lambda: KlByTeacher({"lo": "two", "hi": "three"}))
    base, samples = routed
    batch = _batch_step(copy.deepcopy(base), samples, *SETS).stats
    for teacher, domain in (("lo", "two"), ("hi", "three")):
        alone = [s for s in samples if s.teacher_id == teacher]
        want = _batch_step(copy.deepcopy(base), alone, *SETS, micro=256).stats["opd_kl"]
        assert batch[f"opd_kl/domain/{domain}"] == pytest.approx(want, abs=1e-10)
        assert batch[f"opd_kl/teacher/{teacher}"] == batch[f"opd_kl/domain/{domain}"]
    for seed in range(2):
        _, streamed = _stream_step(copy.deepcopy(base), samples, *SETS, seed=seed)
        for key in ("opd_kl/domain/two", "opd_kl/domain/three", "opd_kl/teacher/lo", "opd_kl/teacher/hi"):
            assert streamed.stats[key] == pytest.approx(batch[key], abs=1e-10)
