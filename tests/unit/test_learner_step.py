"""Packing, validation, and every selectable staleness policy training a step (micro-batching
changes nothing)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from asyncrl.learner.step import TrainSample, pack, staleness_B
from asyncrl.staleness import LEARNER_PROVIDES
from asyncrl.staleness.registry import POLICIES, make_policy

SELECTABLE = sorted(
    n for n, cls in POLICIES.items() if all(x in LEARNER_PROVIDES for x in make_policy(n).needs)
)


def _model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float64)


def _samples(num_groups=3, group_size=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for grp in range(num_groups):
        prompt = [1] + torch.randint(4, 20, (3 + grp,), generator=g).tolist()
        for k in range(group_size):
            n = 2 + int(torch.randint(0, 4, (1,), generator=g))
            out.append(
                TrainSample(
                    traj_id=grp * group_size + k,
                    group_id=grp,
                    sample_index=k,
                    prompt_ids=prompt,
                    completion_ids=torch.randint(4, 20, (n,), generator=g),
                    behavior_logprobs=-torch.rand(n, generator=g, dtype=torch.float64) * 3,
                    token_versions=torch.randint(3, 6, (n,), generator=g),
                    reward=float(torch.randint(0, 2, (1,), generator=g)),
                )
            )
    return out


def test_selectable_policies_are_the_documented_ones():
    assert {"none", "tis", "mis", "icepop", "decoupled", "m2po", "vcpo"} <= set(SELECTABLE)


@pytest.mark.parametrize("name", SELECTABLE)
def test_every_policy_trains_and_micro_batching_changes_nothing(tiny_model_dir, name):
    from asyncrl.config_load import load_config
    from asyncrl.learner.objective import Objective
    from asyncrl.learner.trainer import Trainer

    cfg = load_config(
        overrides=[f"staleness.policy={name}", "staleness.max_staleness=3", "learner.streaming=off"]
    )
    results = []
    for micro in (1000, 5):
        model = _model(tiny_model_dir)
        trainer = Trainer(
            model, Objective.from_config(cfg), make_policy(name), lr=1e-3, weight_decay=0.0, max_grad_norm=1e9,
            temperature=1.0, pad_token_id=0, group_size=4, micro_batch_size=micro, max_open_groups=8,
            max_staleness=3,
        )  # fmt: skip
        if "old_train" in trainer.engine.policy.needs:  # snapshots of the versions the samples carry
            state = {k: v.detach().clone() for k, v in model.state_dict().items()}
            trainer.copies.snapshots = {v: state for v in range(3, 7)}
        trainer.begin_step(6)
        trainer.batch_backward(_samples())
        result = trainer.finish_step()
        results.append((torch.cat([p.detach().flatten() for p in model.parameters()]), result))
    (full, a), (split, b) = results
    assert a.grad_norm > 0 and torch.isfinite(full).all()
    torch.testing.assert_close(split, full, rtol=1e-9, atol=1e-12)
    assert a.loss == pytest.approx(b.loss, rel=1e-9, abs=1e-12)
    assert a.max_staleness == 3 and a.num_tokens == b.num_tokens > 0


def test_the_anchor_forward_of_a_split_batch_is_told_each_rows_real_length(tiny_model_dir):
    """The no-grad forward of the step-start policy (a whole batch in several micro-batches) passed
    no lengths, so a packed layout counted each row's right padding as tokens. Every forward of
    the step now gets the rows' real lengths."""
    from asyncrl.config_load import load_config
    from asyncrl.learner.objective import Objective
    from asyncrl.learner.trainer import Trainer

    cfg = load_config(overrides=["learner.streaming=off"])
    trainer = Trainer(
        _model(tiny_model_dir), Objective.from_config(cfg), make_policy("none"), lr=1e-3, weight_decay=0.0,
        max_grad_norm=1e9, temperature=1.0, pad_token_id=0, group_size=4, micro_batch_size=5, max_open_groups=8,
        max_staleness=3,
    )  # fmt: skip
    seen: list = []
    logp = trainer.engine.logp

    def spy(actor, ids_BL, lengths_B=None):
        seen.append((ids_BL.shape[0], None if lengths_B is None else lengths_B.tolist()))
        return logp(actor, ids_BL, lengths_B)

    trainer.engine.logp = spy
    samples = _samples()
    trainer.begin_step(6)
    trainer.batch_backward(samples)
    trainer.finish_step()
    assert len(seen) >= 4  # the anchor forward and the training forward, each over several micro-batches
    assert all(lengths is not None and len(lengths) == rows for rows, lengths in seen)
    real = sorted(len(s.prompt_ids) + len(s.completion_ids) for s in samples)
    assert sorted(n for _, lengths in seen[: len(seen) // 2] for n in lengths) == real


def test_pack_and_staleness():
    samples = _samples(num_groups=2, group_size=2)
    batch = pack(samples, pad_token_id=0)
    assert batch.num_groups == 2 and batch.group_size == 2
    for b, s in enumerate(samples):
        row = batch.input_ids_BL[b][batch.completion_mask_BL[b]]
        assert torch.equal(row, s.completion_ids)
    assert torch.equal(
        staleness_B(batch, 6), torch.tensor([6 - int(s.token_versions.min()) for s in samples])
    )
    with pytest.raises(ValueError, match="incomplete groups"):
        pack(samples[:3], pad_token_id=0)


def _pack_row_by_row(samples, pad_token_id):
    """The plain reference for `pack`'s arrays: one slice assignment per row and field."""
    width = max(len(s.prompt_ids) + len(s.completion_ids) for s in samples)
    ids = torch.full((len(samples), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(samples), width), dtype=torch.bool)
    behav = torch.zeros((len(samples), width), dtype=torch.float32)
    versions = torch.zeros((len(samples), width), dtype=torch.long)
    for b, s in enumerate(samples):
        p, c = len(s.prompt_ids), len(s.completion_ids)
        ids[b, :p] = torch.tensor(list(s.prompt_ids))
        ids[b, p : p + c] = s.completion_ids
        mask[b, p : p + c] = True if s.loss_mask is None else s.loss_mask
        behav[b, p : p + c] = s.behavior_logprobs
        versions[b, p : p + c] = s.token_versions
    return ids, mask, behav, versions


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_pack_equals_row_by_row_packing(seed):
    gen = torch.Generator().manual_seed(seed)
    samples = []
    for i in range(11):
        p = int(torch.randint(1, 9, (), generator=gen))
        c = int(torch.randint(1, 7, (), generator=gen))
        masked = seed > 0 and i % 3 == 0  # some rows with a loss mask, the rest without
        samples.append(
            TrainSample(
                traj_id=i,
                group_id=10 + i % 4,
                sample_index=i // 4,
                prompt_ids=torch.randint(3, 50, (p,), generator=gen).tolist(),
                completion_ids=torch.randint(3, 50, (c,), generator=gen),
                behavior_logprobs=-torch.rand(c, generator=gen),
                token_versions=torch.randint(0, 5, (c,), generator=gen),
                reward=float(i % 2),
                loss_mask=torch.rand(c, generator=gen) > 0.5 if masked else None,
            )
        )
    batch = pack(samples, pad_token_id=7, require_complete=False)
    ids, mask, behav, versions = _pack_row_by_row(samples, 7)
    assert torch.equal(batch.input_ids_BL, ids)
    assert torch.equal(batch.completion_mask_BL, mask)
    assert torch.equal(batch.behavior_logp_BL, behav)
    assert torch.equal(batch.versions_BL, versions)
    assert batch.group_B.tolist() == [i % 4 for i in range(11)]
    assert batch.slot_B.tolist() == [i // 4 for i in range(11)]
    assert (batch.num_groups, batch.group_size) == (4, 3)
    assert batch.reward_B.tolist() == [float(i % 2) for i in range(11)]


def test_learner_rejects_malformed_trajectories():
    from asyncrl.learner.service import _invalid
    from asyncrl.messages import Trajectory
    from asyncrl.transport.codec import tensor_ref

    ids, logps, versions = torch.tensor([5, 2]), torch.tensor([-0.1, -0.2]), torch.tensor([0, 0])
    msg = Trajectory(
        traj_id=0, group_id=0, task_id=0, sample_index=1, window=0, num_samples=2, prompt_ids=[1, 4],
        completion_ids=tensor_ref(0, ids), behavior_logprobs=tensor_ref(1, logps), token_versions=tensor_ref(2, versions),
        reward=1.0, finish_reason="stop", generator_id="g",
    )  # fmt: skip
    assert _invalid(msg, ids, logps, versions, num_steps=3) == ""
    assert "log-probs" in _invalid(msg, ids, logps[:1], versions, num_steps=3)
    assert "finite" in _invalid(msg, ids, torch.tensor([float("nan"), -0.2]), versions, num_steps=3)
    assert "finite" in _invalid(msg, ids, torch.tensor([0.5, -0.2]), versions, num_steps=3)
    assert "out of range" in _invalid(msg, ids, logps, versions, num_steps=0)
    assert "dtypes" in _invalid(msg, ids.float(), logps, versions, num_steps=3)


def _task_and_rollout(**rollout_fields):
    """A two-sample task and its sample 1, three tokens long (`rollout_fields` override)."""
    from asyncrl.generators.base import Rollout
    from asyncrl.messages import PromptTask, SamplingParams

    task = PromptTask(
        task_id=3, group_id=3, prompt_ids=[1, 5], num_samples=2, sampling=SamplingParams(),
        dataset_index=3, window=1, answer="x",
    )  # fmt: skip
    fields = dict(
        task_id=3, sample_index=1, completion_ids=[7, 8, 9], behavior_logprobs=[-0.1, -0.2, -0.3],
        token_versions=[1, 1, 2], reward=1.0, finish_reason="stop",
    )  # fmt: skip
    return task, Rollout(**{**fields, **rollout_fields})


def test_rollout_values_of_any_numeric_kind_travel_exactly():
    """The generator sends plain lists as arrays; tensors, bools or too-large ints go through torch."""
    from asyncrl.transport.codec import decode, encode, trajectory_frames

    task, plain = _task_and_rollout()
    as_tensors = dataclasses.replace(
        plain,
        completion_ids=torch.tensor([7, 8, 9]),
        behavior_logprobs=torch.tensor([-0.1, -0.2, -0.3], dtype=torch.float64),
        token_versions=[True, True, 2],
    )
    for rollout in (plain, as_tensors):
        _, frames = decode(encode(*trajectory_frames(task, rollout, "gen-0", 0.1)))
        assert frames[0].tolist() == [7, 8, 9] and frames[2].tolist() == [1, 1, 2]
        assert torch.equal(frames[1], torch.tensor([-0.1, -0.2, -0.3], dtype=torch.float32))
    with pytest.raises(ValueError, match="Overflow"):  # as torch.tensor says it
        trajectory_frames(task, dataclasses.replace(plain, completion_ids=[7, 8, 1 << 70]), "gen-0", 0.1)


def test_loss_mask_travels_from_rollout_to_train_sample():
    from asyncrl.learner.step import sample_from_message
    from asyncrl.transport.codec import decode, encode, trajectory_frames

    task, rollout = _task_and_rollout(loss_mask=[True, False, True])
    msg, tensors = trajectory_frames(task, rollout, "gen-0", 0.1)
    decoded, frames = decode(encode(msg, tensors))
    sample = sample_from_message(decoded, frames)
    assert sample.loss_mask.tolist() == [True, False, True]
    batch = pack([sample], pad_token_id=0, require_complete=False)
    assert batch.completion_mask_BL[0].tolist() == [False, False, True, False, True]
    unmasked = dataclasses.replace(rollout, loss_mask=[True, True, True])
    msg, tensors = trajectory_frames(task, unmasked, "gen-0", 0.1)
    assert msg.loss_mask is None and len(tensors) == 3  # all-True masks are not shipped


def test_step_done_is_derived_from_the_step_result():
    """Every StepDone field the result has (by name) goes into the message as it is; the
    service adds only what it alone knows (timings, pool reports)."""
    from asyncrl.learner.step import StepResult
    from asyncrl.messages import StepDone

    result = StepResult(
        step=4, num_trajectories=8, num_tokens=30, loss=0.25, mean_reward=0.5, max_staleness=2,
        mean_staleness=1.5, clip_fraction=0.1, grad_norm=3.0, lr_scale=0.9, policy_stats={"ess_ratio": 0.8},
        streamed=5, deferred=1, peak_stream_bytes=64, fallback="",
    )  # fmt: skip
    done = result.step_done(step_s=1.0, idle_s=0.5)
    assert done == StepDone(
        step=4, version=5, num_trajectories=8, num_tokens=30, loss=0.25, mean_reward=0.5, max_staleness=2,
        mean_staleness=1.5, clip_fraction=0.1, grad_norm=3.0, step_s=1.0, idle_s=0.5, lr_scale=0.9,
        stats={"ess_ratio": 0.8},
    )  # fmt: skip
    pooled = result.step_done(step_s=1.0, idle_s=0.5, groups_trained=[3], groups_replayed=[1])
    assert pooled.groups_trained == [3] and pooled.groups_replayed == [1]
    with pytest.raises(TypeError):
        result.step_done()  # step_s and idle_s only the service knows
