"""The learner's pool mode (asyncrl/learner/pool.py) driven directly: steps take whole groups
from the buffer, replays come at a later step and hold no credit, groups set aside free their
credit at once, and a checkpoint's `held` rebuilds a buffer that hands out the same groups."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import torch

from asyncrl.config_load import load_config
from asyncrl.learner.loop import build_trainer, load_policy_model
from asyncrl.learner.pool import PoolLoop
from asyncrl.learner.step import TrainSample

N = 2


def _loop(tiny_model_dir, *sets):
    cfg = load_config(
        overrides=[
            "buffer.mode=pool",
            "learner.groups_per_step=2",
            f"learner.samples_per_group={N}",
            "staleness.max_staleness=1",
            *sets,
        ]
    )
    model, _ = load_policy_model(tiny_model_dir, cfg)
    return PoolLoop(build_trainer(cfg, model, pad_token_id=0), cfg)


def _add_group(loop, group_id, *, version=0, reward_of=lambda k: float(k % 2)):
    for k in range(N):
        loop.add(
            version,
            TrainSample(
                traj_id=group_id * N + k,
                group_id=group_id,
                sample_index=k,
                prompt_ids=[1, 5, 6],
                completion_ids=torch.tensor([7 + k, 8]),
                behavior_logprobs=torch.tensor([-1.0, -1.5]),
                token_versions=torch.full((2,), version),
                reward=reward_of(k),
            ),
        )


def test_steps_take_whole_groups_and_replays_come_later_without_a_credit(tiny_model_dir):
    loop = _loop(tiny_model_dir, "buffer.max_replays=1")
    for g in (0, 1):
        _add_group(loop, g)
    result = asyncio.run(loop.run_step(0))
    assert result.num_trajectories == 2 * N
    assert loop.step_report() == {"groups_trained": [0, 1], "groups_replayed": []}
    assert loop.take_left() == {"released": [0, 1], "evicted": {}}  # credits back at version 1
    # Nothing new arrived: step 1 reuses both groups (one version stale, within the bound).
    assert asyncio.run(loop.run_step(1)).max_staleness == 1
    assert loop.step_report() == {"groups_trained": [], "groups_replayed": [0, 1]}
    assert loop.take_left() is None  # replays hold no credit


def test_a_group_set_aside_frees_its_credit_at_once(tiny_model_dir):
    loop = _loop(tiny_model_dir, "buffer.action=drop", "buffer.freshness_floor=0.9")
    loop.buffer.update_version(1)
    _add_group(loop, 7, version=0)  # arrives one version stale: freshness 2^-0.5 < 0.9
    assert loop.take_left() == {"released": [7], "evicted": {"freshness": [7]}}
    assert loop.take_left() is None


def test_held_rebuilds_the_buffer_a_resume_hands_out(tiny_model_dir):
    sets = ("buffer.order=freshest", "buffer.max_replays=1")
    loop = _loop(tiny_model_dir, *sets)
    for g in (0, 1):
        _add_group(loop, g)
    asyncio.run(loop.run_step(0))
    _add_group(loop, 2, version=1)
    loop.add(1, _partial(3))  # a pending group
    held = loop.held(after_step=0)
    assert sorted(s.traj_id for _, s, _ in held) == [0, 1, 2, 3, 4, 5, 6]
    assert {s.group_id: e["reuse"] for _, s, e in held} == {0: 1, 1: 1, 2: 0, 3: 0}

    again = _loop(tiny_model_dir, *sets)
    again.buffer.update_version(1)
    again.restore(held)
    a = [(g.group_id, g.reuse, g.freshness) for g in loop.buffer.sample(5)]
    b = [(g.group_id, g.reuse, g.freshness) for g in again.buffer.sample(5)]
    assert a == b and [g for g, *_ in a] == [2, 0, 1]  # fresh group first, then the replays
    assert again.used == {0, 1}  # trained before the resume: no credit in the resumed run


def _partial(group_id):
    return TrainSample(
        traj_id=group_id * N,
        group_id=group_id,
        sample_index=0,
        prompt_ids=[1, 5],
        completion_ids=torch.tensor([9]),
        behavior_logprobs=torch.tensor([-0.5]),
        token_versions=torch.tensor([1]),
        reward=1.0,
    )


def test_a_group_held_in_part_at_a_resume_is_completed_by_its_readmission(tiny_model_dir):
    """The checkpoint held member 0 of group 3 (admitted at step 1); the resumed launcher admits
    the group again at the resume version (step 2) and its regenerated member 1 arrives with that
    step: the group completes under its first admission's step instead of failing the learner."""
    loop = _loop(tiny_model_dir)
    loop.buffer.update_version(2)
    loop.restore([(1, _partial(3), {"reuse": 0, "freshness": 1.0})])
    member = dataclasses.replace(_partial(3), traj_id=3 * N + 1, sample_index=1, reward=0.0)
    loop.add(2, member)
    (group,) = loop.buffer.sample(1)
    assert group.group_id == 3 and len(group.items) == N
    assert {item.step for item in group.items} == {1}
    other = _loop(tiny_model_dir)  # without a resume, members that disagree are still refused
    other.add(1, _partial(3))
    with pytest.raises(ValueError, match="disagrees"):
        other.add(2, member)
