"""The distillation control's state in the learner checkpoint: a run resumed from a checkpoint
continues the "gap" horizon where it was (not from opd.horizon), and a checkpoint without it
leaves the control as the config built it."""

from __future__ import annotations

from asyncrl.config_load import load_config
from asyncrl.learner.checkpoint import load_learner_checkpoint, save_learner_checkpoint
from asyncrl.learner.loop import build_trainer
from asyncrl.models.policy import PolicyLM
from tests.unit.test_trainer import _model

GAP = ["opd.enabled=true", "opd.horizon=2", 'opd.horizon_schedule="gap"', "opd.horizon_gap=0.5"]


def trainer(tiny_model_dir, *sets):
    return build_trainer(load_config(overrides=list(sets)), PolicyLM(_model(tiny_model_dir)), pad_token_id=0)


def test_a_resumed_run_continues_the_gap_horizon(tiny_model_dir, tmp_path):
    src = trainer(tiny_model_dir, *GAP)
    control = src.engine.opd_control
    for _ in range(3):  # three steps whose gap is under opd.horizon_gap: 2 -> 5
        control.begin_step(0)
        control.gap_sum, control.gap_tokens = 0.1, 1.0
        control.end_step()
    assert control.current == 5
    save_learner_checkpoint(tmp_path, 3, src)

    dst = trainer(tiny_model_dir, *GAP)
    assert dst.engine.opd_control.current == 2
    load_learner_checkpoint(tmp_path, 3, dst)
    assert dst.engine.opd_control.current == 5
    dst.engine.opd_control.begin_step(3)  # the gap schedule keeps its own at the next step
    assert dst.engine.opd_control.current == 5


def test_a_checkpoint_without_control_leaves_the_configured_horizon(tiny_model_dir, tmp_path):
    save_learner_checkpoint(tmp_path, 1, trainer(tiny_model_dir))  # opd off: no control state
    dst = trainer(tiny_model_dir, *GAP)
    load_learner_checkpoint(tmp_path, 1, dst)
    assert dst.engine.opd_control.current == 2
