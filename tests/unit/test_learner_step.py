"""The learner step: every selectable staleness policy runs, and micro-batching changes nothing."""

from __future__ import annotations

import pytest
import torch

from asyncrl.config import LEARNER_PROVIDES
from asyncrl.learner.step import TrainSample, accumulate_gradients, pack, staleness_B
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


def _grads(model, batch, policy, micro):
    model.zero_grad(set_to_none=True)
    stats = accumulate_gradients(
        model,
        batch,
        policy=policy,
        policy_version=6,
        temperature=1.0,
        clip_low=0.2,
        clip_high=0.28,
        micro_batch_size=micro,
    )
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]), stats


def test_selectable_policies_are_the_documented_ones():
    assert {"none", "tis", "mis", "icepop", "decoupled", "m2po", "vcpo"} <= set(SELECTABLE)


@pytest.mark.parametrize("name", SELECTABLE)
def test_micro_batching_changes_nothing(tiny_model_dir, name):
    model = _model(tiny_model_dir)
    batch = pack(_samples(), pad_token_id=0)
    batch = batch._replace(behavior_logp_BL=batch.behavior_logp_BL.double())
    policy = make_policy(name)
    full, stats = _grads(model, batch, policy, micro=1000)
    split, stats_split = _grads(model, batch, policy, micro=5)
    assert torch.isfinite(full).all() and full.abs().sum() > 0
    torch.testing.assert_close(split, full, rtol=1e-9, atol=1e-12)
    assert stats.loss == pytest.approx(stats_split.loss, rel=1e-9, abs=1e-12)
    assert stats.max_staleness == 3 and stats.num_tokens == int(batch.completion_mask_BL.sum())


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


def test_learner_rejects_malformed_trajectories():
    from asyncrl.learner.service import _invalid
    from asyncrl.messages import Trajectory
    from asyncrl.transport.codec import tensor_ref

    ids, logps, versions = torch.tensor([5, 2]), torch.tensor([-0.1, -0.2]), torch.tensor([0, 0])
    msg = Trajectory(
        traj_id=0, group_id=0, task_id=0, sample_index=1, step=0, num_samples=2, prompt_ids=[1, 4],
        completion_ids=tensor_ref(0, ids), behavior_logprobs=tensor_ref(1, logps), token_versions=tensor_ref(2, versions),
        reward=1.0, finish_reason="stop", generator_id="g",
    )  # fmt: skip
    assert _invalid(msg, ids, logps, versions, num_steps=3) == ""
    assert "log-probs" in _invalid(msg, ids, logps[:1], versions, num_steps=3)
    assert "finite" in _invalid(msg, ids, torch.tensor([float("nan"), -0.2]), versions, num_steps=3)
    assert "finite" in _invalid(msg, ids, torch.tensor([0.5, -0.2]), versions, num_steps=3)
    assert "out of range" in _invalid(msg, ids, logps, versions, num_steps=0)
    assert "dtypes" in _invalid(msg, ids.float(), logps, versions, num_steps=3)
