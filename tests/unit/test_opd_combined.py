"""Distillation with rewards and token selection in the learner's step engine (float64 tiny model):
streamed steps equal whole-batch steps for every mode; the combined update is the weighted sum of
the RL update and the distillation update (SGD, so the update is minus the gradient); the two loss
parts add up to the step's loss; selection and gating are reported."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from tests.unit.test_trainer import (
    STEP,
    _batch_step,
    _model,
    _params,
    _samples,
    _stream_step,
    _trainer,
    _with_opd,
)

OPD = ["opd.enabled=true", "opd.num_samples=3"]

MODES = {
    "add": ["opd.reward=add", "opd.reward_weight=0.5", "opd.kl_weight=2.0"],
    "gate_failed": ["opd.reward=gate_failed"],
    "weight_failed+entropy": [
        "opd.reward=weight_failed",
        "opd.pass_reward=2.0",
        "opd.select=entropy",
        "opd.select_fraction=0.5",
    ],
    "add+disagreement+mc": [
        "opd.reward=add",
        "opd.select=disagreement",
        "opd.select_fraction=0.4",
        "opd.estimator=mc_reverse_kl",
    ],
    "add+tis+seq-mean": ["opd.reward=add", "staleness.policy=tis", 'learner.agg="seq-mean-token-mean"'],
    "add+dapo": ["opd.reward=add", "learner.drop_degenerate_groups=true"],
    "off+disagreement": ["opd.select=disagreement", "opd.select_fraction=0.5"],
    "off+entropy+forward": ["opd.select=entropy", "opd.select_fraction=0.3", "opd.estimator=forward_kl"],
}


@pytest.fixture(scope="module")
def setup(tiny_model_dir, tmp_path_factory):
    from asyncrl.models.tiny import create_base

    base = _model(tiny_model_dir)
    teacher_dir = create_base(
        tmp_path_factory.mktemp("teacher") / "m", hidden_size=32, num_layers=1, num_heads=2, seed=7
    )
    samples = _with_opd(base, _model(teacher_dir), _samples(base, stale=0.5, seed=3))
    return base, samples


@pytest.mark.parametrize("name", sorted(MODES))
def test_streamed_combined_and_selected_steps_equal_the_batch_step(setup, name):
    base, samples = setup
    sets = [*OPD, *MODES[name]]
    ref = copy.deepcopy(base)
    batch = _batch_step(ref, samples, *sets)
    for seed in range(2):
        model = copy.deepcopy(base)
        trainer, streamed = _stream_step(model, samples, *sets, seed=seed)
        assert trainer.fallback == ""
        torch.testing.assert_close(_params(model), _params(ref), rtol=0, atol=1e-10)
        assert streamed.loss == pytest.approx(batch.loss, abs=1e-9)
        for key, value in batch.policy_stats.items():
            if key.startswith("opd_"):
                assert streamed.policy_stats[key] == pytest.approx(value, abs=1e-9), key
    if name.startswith("add") and "dapo" not in name:
        assert streamed.streamed > 0  # the RL part streamed into the group sums
    assert not torch.equal(_params(ref), _params(base))
    parts = batch.policy_stats
    if name.startswith("off"):
        assert "opd_reward_loss" not in parts
        assert parts["opd_distill_loss"] == pytest.approx(batch.loss, abs=1e-12)
    else:
        assert parts["opd_reward_loss"] + parts["opd_distill_loss"] == pytest.approx(batch.loss, abs=1e-12)


def test_micro_batches_and_threads_change_no_combined_update(setup, monkeypatch):
    from asyncrl.learner import engine as engine_mod

    monkeypatch.setattr(engine_mod, "MIN_PIECE", 2)
    base, samples = setup
    sets = [*OPD, *MODES["weight_failed+entropy"]]
    whole, split, threaded = copy.deepcopy(base), copy.deepcopy(base), copy.deepcopy(base)
    a = _batch_step(whole, samples, *sets)
    b = _batch_step(split, samples, *sets, micro=3)
    c = _batch_step(threaded, samples, *sets, threads=3)
    torch.testing.assert_close(_params(split), _params(whole), rtol=0, atol=1e-10)
    torch.testing.assert_close(_params(threaded), _params(whole), rtol=0, atol=1e-10)
    for other in (b, c):
        assert other.loss == pytest.approx(a.loss, abs=1e-9)
        assert other.policy_stats["opd_selected_fraction"] == pytest.approx(
            a.policy_stats["opd_selected_fraction"]
        )


def _sgd_update(base, samples, *sets, streaming=True):
    """The parameter change of one step under plain SGD with lr 1 (minus the gradient)."""
    model = copy.deepcopy(base)
    t = _trainer(model, *sets, *([] if streaming else ["learner.streaming=off"]))
    t.updater.optimizer = torch.optim.SGD(t.params, lr=1.0)
    t.updater.max_grad_norm = 1e9
    before = _params(model)
    t.begin_step(STEP)
    if t.fallback:
        t.batch_backward(samples)
    else:
        for s in samples:
            t.offer(s)
        while t.work():
            pass
    result = t.finish_step()
    return _params(model) - before, result


def _tokens(samples):
    return sum(len(s.completion_ids) for s in samples)


@pytest.mark.parametrize("streaming", [True, False])
def test_combined_gradient_is_the_weighted_sum_of_the_two_gradients(setup, streaming):
    """opd.reward = add: the update is reward_weight x the RL update plus kl_weight x the OPD update
    (the same Z: token-mean over the same tokens). gate_failed: the OPD part is the OPD update of
    the failed trajectories alone, rescaled from their token count to the step's."""
    base, samples = setup
    rl, _ = _sgd_update(base, samples, streaming=streaming)
    opd, _ = _sgd_update(base, samples, *OPD, streaming=streaming)
    add, result = _sgd_update(
        base,
        samples,
        *OPD,
        "opd.reward=add",
        "opd.reward_weight=0.3",
        "opd.kl_weight=1.7",
        streaming=streaming,
    )
    torch.testing.assert_close(add, 0.3 * rl + 1.7 * opd, rtol=0, atol=1e-10)
    assert float(rl.abs().max()) > 1e-6 and float(opd.abs().max()) > 1e-6  # both parts are real
    assert result.policy_stats["opd_teacher_scores_unused"] == 0.0
    assert result.policy_stats["opd_selected_fraction"] == 1.0

    failed = [s for s in samples if s.reward < 1.0]
    assert 0 < len(failed) < len(samples)
    opd_failed, _ = _sgd_update(base, failed, *OPD, streaming=streaming)
    gated, result = _sgd_update(base, samples, *OPD, "opd.reward=gate_failed", streaming=streaming)
    expected = rl + opd_failed * (_tokens(failed) / _tokens(samples))
    torch.testing.assert_close(gated, expected, rtol=0, atol=1e-10)
    unused = 1.0 - _tokens(failed) / _tokens(samples)
    assert result.policy_stats["opd_teacher_scores_unused"] == pytest.approx(unused, abs=1e-12)


def test_selection_reports_the_fraction_it_kept(setup):
    base, samples = setup
    result = _batch_step(copy.deepcopy(base), samples, *OPD, *MODES["off+disagreement"])
    kept = sum(math.ceil(0.5 * len(s.completion_ids)) for s in samples)
    assert result.policy_stats["opd_selected_fraction"] == pytest.approx(kept / _tokens(samples), abs=1e-12)
    assert result.policy_stats["opd_teacher_scores_unused"] == pytest.approx(1 - kept / _tokens(samples))
    assert math.isfinite(result.policy_stats["opd_kl"])


def test_combined_epochs_rerun_both_parts(setup):
    base, samples = setup
    sets = [*OPD, "opd.reward=add"]
    one_model, two_model = copy.deepcopy(base), copy.deepcopy(base)
    one = _batch_step(one_model, samples, *sets)
    two = _batch_step(two_model, samples, *sets, "learner.epochs=2")
    assert two.loss == pytest.approx(one.loss, abs=1e-12)  # the first epoch's, counted once
    assert two.policy_stats["opd_distill_loss"] == pytest.approx(
        one.policy_stats["opd_distill_loss"], abs=1e-12
    )
    assert not torch.allclose(_params(one_model), _params(two_model))
