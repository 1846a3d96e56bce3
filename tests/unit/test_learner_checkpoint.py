"""The learner's checkpoint (learner/checkpoint.py): the trainer state and the buffered
trajectories round-trip exactly, and `StepLoop.held` names what a checkpoint must keep."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import torch

from asyncrl.learner.checkpoint import (
    learner_checkpoint_versions,
    load_learner_checkpoint,
    save_learner_checkpoint,
)
from asyncrl.learner.loop import StepLoop
from asyncrl.learner.step import TrainSample


def _sample(traj_id: int, *, n: int = 3, masked: bool = False) -> TrainSample:
    g = torch.Generator().manual_seed(traj_id)
    return TrainSample(
        traj_id=traj_id,
        group_id=traj_id // 2,
        sample_index=traj_id % 2,
        prompt_ids=[1, 5, traj_id],
        completion_ids=torch.randint(4, 20, (n,), generator=g),
        behavior_logprobs=-torch.rand(n, generator=g),
        token_versions=torch.tensor([3, 3, 4][:n]),
        reward=float(traj_id % 2),
        loss_mask=torch.tensor([True, False, True]) if masked else None,
    )


def _same(a: TrainSample, b: TrainSample) -> bool:
    for f in dataclasses.fields(TrainSample):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, torch.Tensor):
            if not (isinstance(y, torch.Tensor) and x.dtype == y.dtype and torch.equal(x, y)):
                return False
        elif f.name == "prompt_ids":
            if list(x) != list(y):
                return False
        elif x != y:
            return False
    return True


class _Copies:
    """No staleness-policy weight copies (what `WeightCopies` saves without EWMA or snapshots)."""

    def state_dict(self) -> dict:
        return {"ewma": None, "snapshots": {}}

    def load_state_dict(self, state: dict) -> None:
        assert state["ewma"] is None and state["snapshots"] == {}


class _Updater:
    """The update's run-long count of skipped steps (what `Updater.restore` sets)."""

    def __init__(self, nonfinite_total: int) -> None:
        self.nonfinite_total = nonfinite_total

    def restore(self, *, nonfinite_total: int) -> None:
        self.nonfinite_total = nonfinite_total


class _Trainer:
    """What the checkpoint reads and writes of a trainer."""

    rank = 0
    world_size = 1
    lockstep = False  # one plain rank: its weight copies go in the extras file

    def __init__(self, seed: int) -> None:
        torch.manual_seed(seed)
        self.model = self.actor = torch.nn.Linear(4, 3)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=0.1)
        self.model(torch.ones(2, 4)).sum().backward()
        self.optimizer.step()
        self.copies = _Copies()
        self.updater = _Updater(nonfinite_total=2)


def test_trainer_state_and_held_trajectories_round_trip(tmp_path):
    src = _Trainer(seed=0)
    held = [(5, _sample(10)), (5, _sample(11, masked=True)), (6, _sample(12))]
    save_learner_checkpoint(tmp_path, 5, src, held)

    dst = _Trainer(seed=1)
    restored = load_learner_checkpoint(tmp_path, 5, dst)
    for name, value in src.model.state_dict().items():
        assert torch.equal(dst.model.state_dict()[name], value)
    for a, b in zip(src.optimizer.state.values(), dst.optimizer.state.values(), strict=True):
        assert all(torch.equal(a[k], b[k]) for k in ("exp_avg", "exp_avg_sq", "step"))
    assert dst.updater.nonfinite_total == 2
    assert [step for step, _ in restored] == [5, 5, 6]
    assert all(_same(a, b) for (_, a), (_, b) in zip(held, restored, strict=True))
    # Only tensors and plain containers are stored: weights_only loading is what restored it.
    assert learner_checkpoint_versions(tmp_path) == [5]


def test_a_checkpoint_without_held_trajectories_restores_none(tmp_path):
    save_learner_checkpoint(tmp_path, 2, _Trainer(seed=0))
    assert load_learner_checkpoint(tmp_path, 2, _Trainer(seed=1)) == []


class _NoTrain:
    """A trainer that never finishes a step (the loop stops first)."""

    fallback = "test"
    group_size = 2
    lockstep = False

    def begin_step(self, step: int, *, window_groups: int | None = None) -> None:
        pass


def test_held_covers_later_windows_and_what_an_unfinished_step_took():
    loop = StepLoop(_NoTrain(), lambda step: 4)
    a, b, c = _sample(1), _sample(2), _sample(3)
    loop.add(3, a)
    loop.add(4, b)
    loop.add(2, c)  # a window already trained: not kept
    assert [(s, x.traj_id) for s, x in loop.held(after_step=2)] == [(3, 1), (4, 2)]
    assert loop.depth() == (3, 3)  # what the learner reports as buffer/held_*

    async def take_then_stop():
        # Whole-window mode waits for all 4 of step 3; fill it, so the loop takes them, then stop
        # it from inside the sink before the update is applied.
        def sink(step, samples):
            loop.stop()
            return None

        loop.sink = sink
        for i in range(3):
            loop.add(3, _sample(20 + i))
        return await loop.run_step(3)

    assert asyncio.run(take_then_stop()) is None
    kept = loop.held(after_step=2)
    assert sorted(x.traj_id for s, x in kept if s == 3) == [1, 20, 21, 22]
    assert [x.traj_id for s, x in kept if s == 4] == [2]
    # After step 3's update, its samples are no longer held.
    assert [x.traj_id for _, x in loop.held(after_step=3)] == [2]


@pytest.mark.parametrize("bad", ["format", "version"])
def test_a_wrong_checkpoint_is_a_clear_error(tmp_path, bad):
    path = save_learner_checkpoint(tmp_path, 3, _Trainer(seed=0)) / "extras.pt"
    state = torch.load(path, weights_only=True)
    state[bad] = 99
    torch.save(state, path)
    with pytest.raises(ValueError, match="is not a format-2 checkpoint of version 3"):
        load_learner_checkpoint(tmp_path, 3, _Trainer(seed=1))
