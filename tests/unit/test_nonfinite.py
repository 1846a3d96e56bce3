"""The non-finite guard (Trainer._apply_gradient): a step whose loss or gradient norm is not
finite changes no parameter and no optimizer state, is counted, and too many in a row raise one
clear error. Faults are injected with ASYNCRL_FAULT_NONFINITE (NaN gradients on chosen steps)."""

from __future__ import annotations

import copy

import pytest
import torch
from test_trainer import STEP, _model, _samples, _trainer

from asyncrl.learner.update import FAULT_ENV, NonFiniteError


def _state(trainer):
    params = [p.detach().clone() for p in trainer.params]
    opt = copy.deepcopy(trainer.optimizer.state_dict())
    return params, opt


def _step(trainer, samples, step):
    trainer.begin_step(step)
    trainer.batch_backward(samples)
    return trainer.finish_step()


def test_a_nan_gradient_skips_the_step_and_training_goes_on(tiny_model_dir, monkeypatch):
    monkeypatch.setenv(FAULT_ENV, str(STEP + 1))
    model = _model(tiny_model_dir)
    samples = _samples(model)
    t = _trainer(model, "learner.streaming=off")
    first = _step(t, samples, STEP)  # a normal step: Adam state exists from here on
    assert not first.skipped_nonfinite and first.grad_norm > 0
    params, opt = _state(t)
    skipped = _step(t, samples, STEP + 1)
    assert skipped.skipped_nonfinite
    assert t.nonfinite_total == 1 and t.updater.nonfinite_in_a_row == 1
    assert all(torch.equal(a, p) for a, p in zip(params, t.params, strict=True))
    after = t.optimizer.state_dict()
    for k, v in opt["state"].items():
        assert all(torch.equal(v[name], after["state"][k][name]) for name in v)
    assert all(p.grad is None for p in t.params)  # the poisoned gradient is gone
    again = _step(t, samples, STEP + 2)
    assert not again.skipped_nonfinite and t.updater.nonfinite_in_a_row == 0 and t.nonfinite_total == 1
    assert any(not torch.equal(a, p) for a, p in zip(params, t.params, strict=True))


def test_too_many_in_a_row_end_training_with_one_clear_error(tiny_model_dir, monkeypatch):
    monkeypatch.setenv(FAULT_ENV, "all")
    model = _model(tiny_model_dir)
    samples = _samples(model)
    t = _trainer(model, "learner.streaming=off")
    t.updater.max_nonfinite_steps = 2  # learner.max_nonfinite_steps
    before = [p.detach().clone() for p in t.params]
    assert _step(t, samples, STEP).skipped_nonfinite
    with pytest.raises(NonFiniteError, match="2 steps in a row had a non-finite loss or gradient"):
        _step(t, samples, STEP + 1)
    assert all(torch.equal(a, p) for a, p in zip(before, t.params, strict=True))


def test_a_non_finite_loss_skips_even_with_finite_gradients(tiny_model_dir, monkeypatch):
    monkeypatch.delenv(FAULT_ENV, raising=False)
    model = _model(tiny_model_dir)
    samples = _samples(model)
    t = _trainer(model, "learner.streaming=off")
    t.begin_step(STEP)
    t.batch_backward(samples)
    t.totals.loss = float("inf")  # as a reward-scaled loss that overflowed would report
    before = [p.detach().clone() for p in t.params]
    assert t.finish_step().skipped_nonfinite
    assert all(torch.equal(a, p) for a, p in zip(before, t.params, strict=True))
