"""`learner.minibatches`: a batch's groups cut into M minibatches, each its own optimizer update
against the anchors taken at the step's start (decoupled PPO as AReaL runs it). With an anchor that
does not move (PPO against the behaviour log-probs) two minibatches equal two one-minibatch steps
on the two halves of the groups; with decoupled PPO the second minibatch's proximal anchor stays the
step-start policy, so it differs from a second step (whose proximal policy is the updated one)."""

from __future__ import annotations

import copy

import pytest
import torch

from asyncrl.config_load import load_config
from tests.unit.test_trainer import STEP, _model, _params, _samples, _trainer


def _sgd(trainer):
    trainer.updater.optimizer = torch.optim.SGD(trainer.params, lr=0.5)
    trainer.updater.lr, trainer.updater.max_grad_norm = 0.5, 1e9
    return trainer


def _step(model, samples, *sets):
    t = _sgd(_trainer(model, "learner.streaming=off", *sets))
    t.begin_step(STEP)
    t.batch_backward(samples)
    return t.finish_step()


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_two_minibatches_equal_two_steps_on_the_halves(tiny_model_dir, agg):
    base = _model(tiny_model_dir)
    samples = _samples(base, stale=0.5, seed=4, degenerate=())
    sets = [f'learner.agg="{agg}"', "learner.clip_high=0.05", "learner.clip_low=0.05"]
    one = copy.deepcopy(base)
    _step(one, samples, *sets, "learner.minibatches=2")
    assert "learner.minibatches = 2" in _trainer(copy.deepcopy(base), "learner.minibatches=2").fallback
    two = copy.deepcopy(base)
    first = [s for s in samples if s.group_id < 2]
    _step(two, first, *sets)
    _step(two, [s for s in samples if s.group_id >= 2], *sets)
    torch.testing.assert_close(_params(one), _params(two), rtol=0, atol=1e-12)
    # Not one update over the whole batch: the second half saw the first half's update.
    whole = copy.deepcopy(base)
    _step(whole, samples, *sets)
    assert float((_params(whole) - _params(one)).abs().max()) > 1e-6


def test_decoupled_minibatches_keep_the_step_start_proximal_policy(tiny_model_dir):
    base = _model(tiny_model_dir)
    samples = _samples(base, stale=0.5, seed=6, degenerate=())
    sets = ["staleness.policy=decoupled"]
    held = copy.deepcopy(base)
    _step(held, samples, *sets, "learner.minibatches=2")
    moved = copy.deepcopy(base)  # a second step re-anchors at the updated policy
    _step(moved, [s for s in samples if s.group_id < 2], *sets)
    _step(moved, [s for s in samples if s.group_id >= 2], *sets)
    assert torch.isfinite(_params(held)).all()
    assert float((_params(held) - _params(moved)).abs().max()) > 1e-9
    assert float((_params(held) - _params(base)).abs().max()) > 1e-6


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        (["learner.groups_per_step=6", "learner.minibatches=4"], "a divisor of learner.groups_per_step"),
        (["learner.minibatches=2", "learner.epochs=2"], "learner.epochs > 1"),
        (["learner.minibatches=2", "staleness.policy=vcpo", "staleness.vcpo_baseline=opob"], "vcpo_baseline"),
    ],
)
def test_minibatches_refuse_what_they_cannot_do(sets, message):
    with pytest.raises(ValueError, match=message):
        load_config(overrides=sets)


def test_the_linter_warns_on_decoupled_with_one_update_at_a_high_bound():
    from asyncrl.lint import lint

    def rules(*sets):
        return [f.rule for f in lint(load_config(overrides=["staleness.policy=decoupled", *sets]))]

    assert "decoupled-one-update" in rules("staleness.max_staleness=8")
    assert "decoupled-one-update" not in rules("staleness.max_staleness=8", "learner.minibatches=4")
    assert "decoupled-one-update" not in rules("staleness.max_staleness=2")
