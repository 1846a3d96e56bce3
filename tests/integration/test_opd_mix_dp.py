"""Distillation with rewards and token selection on two lockstep learner ranks (FSDP2, gloo): the
update equals one plain rank streaming per trajectory, and a whole-batch step, on the same samples
(sync mode, the shipped model and teacher, plain SGD so the final weights read out the gradient);
the two loss parts are all-reduced with the loss."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import read_records

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

COMMON = [
    "mode=sync",
    "learner.steps=1",
    "learner.groups_per_step=8",
    "run.seed=3",
    'model.path=""',  # the shipped model: it earns reward, so the RL part is not zero
    "sampling.max_new_tokens=5",
    "learner.optimizer=sgd",
    "learner.lr=1.0",
    "opd.enabled=true",
    "opd.num_samples=2",
    "opd.reward=weight_failed",
    "opd.select=entropy",
    "opd.select_fraction=0.5",
]


def _final_params(run_dir):
    from safetensors.torch import load_file

    state = {}
    for f in sorted((run_dir / "final_model").glob("*.safetensors")):
        state.update(load_file(f))
    return state


def test_two_ranks_and_a_whole_batch_step_equal_one_streaming_rank(run_short_job):
    _, one = run_short_job(*COMMON, name="one", timeout=300)
    _, two = run_short_job(*COMMON, "learner.world_size=2", "learner.sharding=fsdp", name="two", timeout=300)
    _, whole = run_short_job(*COMMON, "learner.streaming=off", name="whole", timeout=300)
    assert json.loads((two / "summary.json").read_text())["status"] == "completed"
    assert (two / "logs" / "learner-rank1.log").exists()  # a second rank really ran
    a = _final_params(one)
    for other in (two, whole):
        b = _final_params(other)
        for name in a:
            torch.testing.assert_close(a[name], b[name], rtol=0, atol=1e-6, msg=name)
    (s_one,), (s_two,) = read_records(one, "step"), read_records(two, "step")
    for key in ("opd_reward_loss", "opd_distill_loss"):
        assert s_two["stats"][key] == pytest.approx(s_one["stats"][key], rel=1e-5), key
    assert s_one["stats"]["opd_reward_loss"] != 0 and s_one["stats"]["opd_distill_loss"] != 0
    assert 0.5 <= s_one["stats"]["opd_selected_fraction"] < 1.0
