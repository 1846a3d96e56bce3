"""The learner's step engine: a streamed step equals the whole-batch step (float64, same
parameters after one optimizer step) for every streamable objective, under random arrival
orders, degenerate groups and stale trajectories; every non-streamable configuration falls back
and still equals it; micro-batching changes nothing."""

from __future__ import annotations

import copy
import dataclasses
import random
from typing import ClassVar

import pytest
import torch

from asyncrl.config_load import load_config
from asyncrl.config_objective import check_staleness_policy
from asyncrl.learner.loop import max_open_groups
from asyncrl.learner.objective import Objective
from asyncrl.learner.state import StalenessViolation
from asyncrl.learner.step import TrainSample
from asyncrl.learner.trainer import Trainer
from asyncrl.models.policy import PolicyLM

STEP = 6  # the trainer's policy_version in these tests


def _rms_norm_float64(self, x):
    # Hugging Face's Llama RMSNorm computes in float32 whatever the input dtype; a float64 check
    # needs it in float64 (otherwise gradients agree only to float32 precision).
    return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)


def _model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float64)
    for module in model.modules():
        if type(module).__name__.endswith("RMSNorm"):
            module.forward = _rms_norm_float64.__get__(module)
    return model


def _samples(model, *, num_groups=4, group_size=4, seed=0, stale=0.0, degenerate=(1,)):
    """Groups of random completions. Behavior log-probs are the model's own (on-policy) and, for
    a `stale` fraction of trajectories, shifted as an older policy's would be (versions < STEP)."""
    from asyncrl.kernels.logprobs import causal_lm_logprobs

    g = torch.Generator().manual_seed(seed)
    out = []
    for grp in range(num_groups):
        prompt = [1] + torch.randint(4, 20, (3 + grp % 3,), generator=g).tolist()
        for k in range(group_size):
            n = 2 + int(torch.randint(0, 4, (1,), generator=g))
            ids = torch.randint(4, 20, (n,), generator=g)
            with torch.no_grad():
                full = torch.tensor([prompt + ids.tolist()])
                logp = causal_lm_logprobs(model, full).logp[0, len(prompt) :]
            is_stale = float(torch.rand(1, generator=g)) < stale
            if is_stale:
                logp = logp - 0.4 * torch.rand(n, generator=g, dtype=torch.float64)
            versions = torch.full((n,), STEP - 2 if is_stale else STEP, dtype=torch.int64)
            reward = 1.0 if grp in degenerate else float(torch.randint(0, 2, (1,), generator=g))
            out.append(
                TrainSample(
                    traj_id=grp * group_size + k,
                    group_id=grp,
                    sample_index=k,
                    prompt_ids=prompt,
                    completion_ids=ids,
                    behavior_logprobs=logp.float(),
                    token_versions=versions,
                    reward=reward,
                )
            )
    return out


def _trainer(model, *sets, micro=256, group_size=4, threads=1):
    cfg = load_config(
        overrides=[f"learner.samples_per_group={group_size}", "staleness.max_staleness=2", *sets]
    )
    objective = Objective.from_config(cfg)
    return Trainer(
        model,
        objective,
        check_staleness_policy(cfg.staleness),
        lr=1e-2,
        weight_decay=0.0,
        max_grad_norm=1e9,
        temperature=1.0,
        pad_token_id=0,
        group_size=group_size,
        micro_batch_size=micro,
        max_open_groups=max_open_groups(cfg.learner, PolicyLM(model), objective),
        max_staleness=2,
        threads=threads,
    )


def _batch_step(model, samples, *sets, micro=256, group_size=4, threads=1):
    t = _trainer(model, "learner.streaming=off", *sets, micro=micro, group_size=group_size, threads=threads)
    t.begin_step(STEP)
    t.batch_backward(samples)
    return t.finish_step()


def _stream_step(model, samples, *sets, seed=0, group_size=4, threads=1):
    """Arrivals in a random order, with a random amount of work between arrivals."""
    t = _trainer(model, *sets, group_size=group_size, threads=threads)
    rng = random.Random(seed)
    order = list(samples)
    rng.shuffle(order)
    t.begin_step(STEP)
    if t.fallback:
        t.batch_backward(order)
        return t, t.finish_step()
    for s in order:
        t.offer(s)
        for _ in range(rng.randint(0, 2)):
            t.work()
    while t.work():
        pass
    return t, t.finish_step()


def _params(model):
    return torch.cat([p.detach().flatten() for p in model.parameters()])


STREAMING = {
    "grpo": [],
    "dr_grpo": ["learner.advantage=dr_grpo", 'learner.agg="seq-mean-token-sum-norm"'],
    "rloo": ["learner.advantage=rloo", 'learner.agg="seq-mean-token-mean"'],
    "dapo": ["learner.clip_high=0.28", "learner.drop_degenerate_groups=true"],
    "gspo": ["learner.loss=gspo", 'learner.agg="seq-mean-token-mean"'],
    "cispo": ["learner.loss=cispo"],
    "sapo": ["learner.loss=sapo", "learner.loss_params.tau_neg=1.0"],  # streams when tau_pos = tau_neg
    "tis": ["staleness.policy=tis"],
    "icepop": ["staleness.policy=icepop"],
    "decoupled": ["staleness.policy=decoupled"],
}


@pytest.mark.parametrize("stale", [0.0, 0.5])
@pytest.mark.parametrize("name", sorted(STREAMING))
def test_streamed_step_equals_batch_step(tiny_model_dir, name, stale):
    base = _model(tiny_model_dir)
    samples = _samples(base, stale=stale, seed=sorted(STREAMING).index(name))
    ref = copy.deepcopy(base)
    batch = _batch_step(ref, samples, *STREAMING[name])
    for seed in range(3):
        model = copy.deepcopy(base)
        trainer, streamed = _stream_step(model, samples, *STREAMING[name], seed=seed)
        assert trainer.fallback == ""
        torch.testing.assert_close(_params(model), _params(ref), rtol=0, atol=1e-10)
        assert streamed.num_trajectories == batch.num_trajectories == len(samples)
        assert streamed.loss == pytest.approx(batch.loss, abs=1e-9)
        if name != "dapo":  # streamed members of a group dropped later still count in its denominator
            assert streamed.clip_fraction == pytest.approx(batch.clip_fraction, abs=1e-6)
    assert streamed.streamed > 0  # some trajectories really streamed on arrival
    if stale and name == "grpo":
        assert streamed.deferred > 0  # the clip binds for stale ones: they waited for their group


FALLBACK = {
    "m2po": (["staleness.policy=m2po"], "batch-global"),
    "vcpo": (["staleness.policy=vcpo"], "batch-global"),
    "mis_self_normalized": (
        ["staleness.policy=mis", "staleness.params.self_normalize=true"],
        "batch-global",
    ),
    "kl_loss": (["learner.kl_coef=0.1", "learner.kl_estimator=k3"], "KL"),
    "kl_reward": (["learner.kl_coef=0.1", "learner.kl_estimator=k1", "learner.kl_placement=reward"], "KL"),
    "mc_grpo": (["learner.advantage=mc_grpo"], "median"),
    "epochs": (["learner.epochs=2"], "epochs"),
}


@pytest.mark.parametrize("name", sorted(FALLBACK))
def test_non_streamable_configs_fall_back_and_equal_the_batch_update(tiny_model_dir, name):
    sets, reason = FALLBACK[name]
    group_size = 5 if name == "mc_grpo" else 4
    base = _model(tiny_model_dir)
    samples = _samples(base, stale=0.5, group_size=group_size)
    ref = copy.deepcopy(base)
    _batch_step(ref, samples, *sets, group_size=group_size)
    model = copy.deepcopy(base)
    trainer, result = _stream_step(model, samples, *sets, group_size=group_size)
    assert reason in trainer.fallback and result.fallback == trainer.fallback
    torch.testing.assert_close(_params(model), _params(ref), rtol=0, atol=1e-10)
    assert not torch.equal(_params(model), _params(base))  # it did train


@pytest.mark.parametrize("name", ["grpo", "m2po", "kl_loss", "mc_grpo", "gspo", "epochs"])
def test_micro_batching_changes_nothing(tiny_model_dir, name):
    sets = STREAMING[name] if name in STREAMING else FALLBACK[name][0]
    group_size = 5 if name == "mc_grpo" else 4
    base = _model(tiny_model_dir)
    samples = _samples(base, stale=0.5, group_size=group_size)
    whole, split = copy.deepcopy(base), copy.deepcopy(base)
    a = _batch_step(whole, samples, *sets, group_size=group_size)
    b = _batch_step(split, samples, *sets, micro=3, group_size=group_size)
    torch.testing.assert_close(_params(whole), _params(split), rtol=0, atol=1e-10)
    assert a.loss == pytest.approx(b.loss, abs=1e-9)


def test_a_too_stale_trajectory_is_an_error(tiny_model_dir):
    model = _model(tiny_model_dir)
    samples = _samples(model)
    old = dataclasses.replace(samples[0], token_versions=torch.full_like(samples[0].token_versions, STEP - 3))
    t = _trainer(model)
    t.begin_step(STEP)
    t.offer(old)
    with pytest.raises(StalenessViolation, match="3 versions stale"):
        while t.work():
            pass


def test_open_group_bound_defers_instead_of_allocating(tiny_model_dir):
    model = _model(tiny_model_dir)
    samples = [s for s in _samples(model, num_groups=3, degenerate=()) if s.sample_index < 3]
    # A budget of 1.5 groups' S0/S1 buffers (grpo: two float32 parameter-sized ones) holds one group.
    group_mb = 2 * 4 * sum(p.numel() for p in model.parameters()) / 2**20
    t = _trainer(model, f"learner.stream_memory_mb={1.5 * group_mb}")
    assert t.max_open_groups == 1
    t.begin_step(STEP)
    for s in samples:
        t.offer(s)
    while t.work():
        assert t.acc.num_open_groups <= 1
    assert t.acc.num_open_groups == 1 and t.totals.streamed == 3  # one group streamed, two wait


def _with_opd(model, teacher, samples, num=3, seed=0):
    """Attach OPD caches: column 0 the sampled token, the rest random ids; teacher and behavior
    log-probs from the two models (the behavior student is the current one, shifted a little)."""
    from tests.support.logprob_reference import causal_lm_position_logprobs

    g = torch.Generator().manual_seed(seed)
    out = []
    for s in samples:
        p, c = len(s.prompt_ids), len(s.completion_ids)
        ids = torch.cat([s.completion_ids[:, None], torch.randint(4, 20, (c, num - 1), generator=g)], dim=1)
        full = torch.tensor([list(s.prompt_ids) + s.completion_ids.tolist()])
        ids_1LN = torch.zeros((1, p + c, num), dtype=torch.long)
        ids_1LN[0, p:] = ids
        with torch.no_grad():
            t = causal_lm_position_logprobs(teacher, full, ids_1LN)[0, p:]
            b = causal_lm_position_logprobs(model, full, ids_1LN)[0, p:] - 0.1 * torch.rand(
                c, num, generator=g
            )
        out.append(
            dataclasses.replace(
                s,
                behavior_logprobs=b[:, 0].float(),
                teacher_logprobs=t.float(),
                opd_ids=ids,
                opd_behavior_logprobs=b.float(),
            )
        )
    return out


@pytest.mark.parametrize("estimator", ["reverse_kl", "forward_kl", "mc_reverse_kl"])
def test_opd_streams_and_equals_the_batch_update(tiny_model_dir, tmp_path, estimator):
    from asyncrl.models.tiny import create_base

    base = _model(tiny_model_dir)
    teacher_dir = create_base(tmp_path / "teacher", hidden_size=32, num_layers=1, num_heads=2, seed=7)
    teacher = _model(teacher_dir)
    samples = _with_opd(base, teacher, _samples(base, stale=0.5))
    sets = ["opd.enabled=true", f"opd.estimator={estimator}", "opd.num_samples=3"]
    ref = copy.deepcopy(base)
    batch = _batch_step(ref, samples, *sets)
    for seed in range(2):
        model = copy.deepcopy(base)
        trainer, streamed = _stream_step(model, samples, *sets, seed=seed)
        assert trainer.fallback == "" and trainer.acc is None  # no group buffers for OPD
        torch.testing.assert_close(_params(model), _params(ref), rtol=0, atol=1e-10)
        assert streamed.loss == pytest.approx(batch.loss, abs=1e-9)
    assert not torch.equal(_params(ref), _params(base))
    assert batch.policy_stats["opd_kl"] != 0


def _versioned(samples, versions_of_group):
    return [
        dataclasses.replace(
            s, token_versions=torch.full_like(s.token_versions, versions_of_group(s.group_id))
        )
        for s in samples
    ]


def _run_steps(trainer, batches, first_step=0):
    """Train consecutive steps; returns the TokenBatch the policy saw at each step."""
    from unittest import mock

    seen = []
    real = type(trainer.policy).correct

    def spy(policy, token_batch):
        seen.append(token_batch)
        return real(policy, token_batch)

    with mock.patch.object(type(trainer.policy), "correct", spy):
        for k, samples in enumerate(batches):
            trainer.begin_step(first_step + k)
            trainer.batch_backward(samples)
            trainer.finish_step()
    return seen


def test_exact_old_logits_come_from_the_snapshot_of_each_tokens_version(tiny_model_dir):
    from asyncrl.kernels.logprobs import causal_lm_logprobs
    from asyncrl.learner.step import pack

    base = _model(tiny_model_dir)
    initial = copy.deepcopy(base)
    trainer = _trainer(base, "staleness.policy=exact")
    assert "old_train" in trainer.policy.needs and trainer.fallback
    step0 = _versioned(_samples(base, seed=1), lambda g: 0)
    step1 = _versioned(_samples(base, seed=2), lambda g: g % 2)  # versions 0 and 1 mixed
    seen = _run_steps(trainer, [step0, step1])
    batch = pack(step1, pad_token_id=0)
    old = seen[-1].logp_old_train_BT
    mask = batch.completion_mask_BL
    with torch.no_grad():
        logp_v0 = causal_lm_logprobs(initial, batch.input_ids_BL).logp
    v0 = mask & (batch.versions_BL == 0)
    v1 = mask & (batch.versions_BL == 1)
    torch.testing.assert_close(old[v0], logp_v0[v0], rtol=0, atol=1e-12)
    assert v1.any() and not torch.allclose(old[v1], logp_v0[v1])  # version 1 is the updated model
    assert sorted(trainer.copies.snapshots) == [0, 1, 2]  # max_staleness 2: versions >= 2 - 2 kept


def test_ewma_network_tracks_the_decayed_average_of_the_parameters(tiny_model_dir):
    base = _model(tiny_model_dir)

    def state():
        return {k: v.detach().clone() for k, v in base.state_dict().items()}

    history = [state()]
    trainer = _trainer(base, "staleness.policy=ewma", "staleness.params.decay=0.5")
    samples = _samples(base, seed=3)
    for k in range(2):
        trainer.begin_step(k)
        trainer.batch_backward(_versioned(samples, lambda g, k=k: k))
        trainer.finish_step()
        history.append(state())
    # Bias-corrected EWMA with decay 0.5 over [theta0, theta1, theta2]: weights 1/4, 1/2, 1 over 7/4.
    for name, got in trainer.copies.ewma.params.items():
        expected = (0.25 * history[0][name] + 0.5 * history[1][name] + history[2][name]) / 1.75
        torch.testing.assert_close(got.double(), expected, rtol=0, atol=1e-6, msg=name)
    assert not torch.equal(history[0]["lm_head.weight"], history[2]["lm_head.weight"])


def test_loss_mask_leaves_masked_tokens_out_of_loss_and_denominator(tiny_model_dir):
    base = _model(tiny_model_dir)
    samples = _samples(base, stale=0.5, seed=4)
    masked = []
    for s in samples:
        mask = torch.ones(len(s.completion_ids), dtype=torch.bool)
        mask[0] = False  # e.g. a tool's output at the start of the completion
        masked.append(dataclasses.replace(s, loss_mask=mask))
    # What a masked token's behavior log-prob says cannot matter: scramble it.
    scrambled = [
        dataclasses.replace(
            s, behavior_logprobs=torch.cat([s.behavior_logprobs[:1] - 5.0, s.behavior_logprobs[1:]])
        )
        for s in masked
    ]
    ref, other, streamed_model = copy.deepcopy(base), copy.deepcopy(base), copy.deepcopy(base)
    a = _batch_step(ref, masked)
    b = _batch_step(other, scrambled)
    _, c = _stream_step(streamed_model, masked, seed=1)
    torch.testing.assert_close(_params(other), _params(ref), rtol=0, atol=1e-12)
    torch.testing.assert_close(_params(streamed_model), _params(ref), rtol=0, atol=1e-10)
    assert a.num_tokens == b.num_tokens == c.num_tokens == sum(len(s.completion_ids) - 1 for s in samples)


@pytest.mark.parametrize("self_normalize", [True, False])
def test_freshness_weighting_is_selectable_and_streams_only_when_local(tiny_model_dir, self_normalize):
    flag = "true" if self_normalize else "false"
    sets = [
        "staleness.policy=tis",
        f"staleness.freshness.self_normalize={flag}",
        "staleness.freshness.lambda_roll=2.0",
    ]
    base = _model(tiny_model_dir)
    samples = _samples(base, stale=0.5, seed=5)
    ref, model = copy.deepcopy(base), copy.deepcopy(base)
    _batch_step(ref, samples, *sets)
    trainer, result = _stream_step(model, samples, *sets)
    assert trainer.policy.name == "tis+freshness"
    assert ("batch-global" in trainer.fallback) == self_normalize  # the batch mean couples samples
    torch.testing.assert_close(_params(model), _params(ref), rtol=0, atol=1e-10)
    plain = copy.deepcopy(base)
    _batch_step(plain, samples, "staleness.policy=tis")
    assert not torch.allclose(_params(plain), _params(ref))  # the weights changed the update


def test_freshness_is_reported_whether_or_not_it_weights_the_loss(tiny_model_dir):
    """Every step reports the mean freshness score of what it trained: 1 on-policy, below 1
    for samples whose behavior log-probs drifted from the current policy."""
    base = _model(tiny_model_dir)
    fresh = _batch_step(copy.deepcopy(base), _samples(base, stale=0.0))
    stale = _batch_step(copy.deepcopy(base), _samples(base, stale=1.0))
    assert fresh.policy_stats["mean_freshness"] == pytest.approx(1.0, abs=1e-6)  # float32 behavior
    assert 0.0 < stale.policy_stats["mean_freshness"] < 0.99


@pytest.mark.parametrize("streaming", [True, False])
def test_a_group_weight_scales_its_policy_gradient_exactly(tiny_model_dir, streaming):
    """buffer.action = "downweight": a group handed out with weight w contributes w times its
    policy gradient (its advantages are scaled), whether it streams or trains in a whole batch;
    a down-weighted group may be past the staleness bound."""
    base = _model(tiny_model_dir)
    samples = _samples(base, seed=3, degenerate=())

    def update(weight):
        model = copy.deepcopy(base)
        t = _trainer(model, *([] if streaming else ["learner.streaming=off"]))
        t.updater.optimizer = torch.optim.SGD(t.params, lr=1.0)  # the update is minus the gradient
        before = _params(model)
        batch = [
            dataclasses.replace(s, weight=weight, token_versions=torch.full_like(s.token_versions, STEP - 3))
            if s.group_id == 2
            else s
            for s in samples
        ]
        t.begin_step(STEP)
        if t.fallback:
            t.batch_backward(batch)
        else:
            for s in batch:
                t.offer(s)
            while t.work():
                pass
        t.finish_step()
        return _params(model) - before

    zero, half, one = update(0.0), update(0.5), update(1.0 - 1e-12)
    assert float((one - zero).abs().max()) > 1e-6  # the group's gradient is not nothing
    torch.testing.assert_close(half, (zero + one) / 2, rtol=0, atol=1e-10)


def test_later_epochs_rerun_the_batch_against_the_step_start_anchor(tiny_model_dir):
    """learner.epochs=2 (PPO epochs): the second pass sees the updated model's log-probs but the
    same anchor, advantages and mask as the first; the optimizer steps twice; the step's samples,
    tokens and loss are counted once."""
    from asyncrl.kernels.logprobs import causal_lm_logprobs
    from asyncrl.learner.step import pack

    base = _model(tiny_model_dir)
    samples = _samples(base, stale=0.5, seed=9)
    calls = []
    trainer = _trainer(copy.deepcopy(base), "learner.streaming=off", "learner.epochs=2")
    real = trainer.objective.policy_loss

    def spy(logp_BT, corr, adv_BT, mask_BT):
        calls.append((logp_BT.detach().clone(), corr.logp_anchor_BT.clone(), adv_BT.clone(), mask_BT.clone()))
        return real(logp_BT, corr, adv_BT, mask_BT)

    object.__setattr__(trainer.objective, "policy_loss", spy)
    trainer.begin_step(STEP)
    trainer.batch_backward(samples)
    assert len(calls) == 1
    result = trainer.finish_step()
    assert len(calls) == 2  # one more pass, inside finish_step
    (logp_1, anchor_1, adv_1, mask_1), (logp_2, anchor_2, adv_2, mask_2) = calls
    assert torch.equal(anchor_1, anchor_2) and torch.equal(adv_1, adv_2) and torch.equal(mask_1, mask_2)
    batch = pack(sorted(samples, key=lambda s: s.traj_id), pad_token_id=0)
    with torch.no_grad():  # the anchor is the policy at the step's start (the proximal policy)
        start = causal_lm_logprobs(base, batch.input_ids_BL).logp
    torch.testing.assert_close(logp_1[mask_1], start[mask_1], rtol=0, atol=1e-12)
    assert float((logp_2 - logp_1)[mask_1].abs().max()) > 1e-6  # the second pass ran the updated model
    assert all(state["step"] == 2 for state in trainer.optimizer.state.values())
    assert result.num_trajectories == len(samples)
    assert result.num_tokens == sum(len(s.completion_ids) for s in samples)
    one = _batch_step(copy.deepcopy(base), samples)
    assert result.loss == pytest.approx(one.loss, abs=1e-12)  # the first epoch's loss
    assert result.num_tokens == one.num_tokens


def test_opd_later_epochs_count_once(tiny_model_dir, tmp_path):
    from asyncrl.models.tiny import create_base

    base = _model(tiny_model_dir)
    teacher_dir = create_base(tmp_path / "teacher", hidden_size=32, num_layers=1, num_heads=2, seed=7)
    samples = _with_opd(base, _model(teacher_dir), _samples(base))
    one_model, two_model = copy.deepcopy(base), copy.deepcopy(base)
    one = _batch_step(one_model, samples, "opd.enabled=true", "opd.num_samples=3")
    two = _batch_step(two_model, samples, "opd.enabled=true", "opd.num_samples=3", "learner.epochs=2")
    assert two.num_trajectories == one.num_trajectories == len(samples)
    assert two.loss == pytest.approx(one.loss, abs=1e-12)
    assert not torch.allclose(_params(one_model), _params(two_model))  # a second update happened


@dataclasses.dataclass(frozen=True, kw_only=True)
class _FakeBatchGlobal:
    """A policy no module lists by name: it only declares itself batch-global (weights 1,
    anchor the current policy, so its corrections would otherwise stream)."""

    name: ClassVar[str] = "fake_batch_global"
    needs: ClassVar[tuple] = ()
    streamable: ClassVar[bool] = True
    batch_global: ClassVar[bool] = True
    clip_only_sign_dependence: ClassVar[bool] = False
    ewma_decay: ClassVar[float | None] = None

    def correct(self, batch):
        from asyncrl.staleness import NoCorrection

        return NoCorrection(anchor="current").correct(batch)


class _FakeLocal(_FakeBatchGlobal):
    """The same correction, not declared batch-global."""

    batch_global: ClassVar[bool] = False


def test_a_new_batch_global_policy_trains_whole_batches_without_any_list_edit(tiny_model_dir):
    from asyncrl.staleness import StalenessPolicy

    policy = _FakeBatchGlobal()
    assert isinstance(policy, StalenessPolicy)
    cfg = load_config(overrides=["learner.samples_per_group=4", "staleness.max_staleness=2"])
    assert "batch-global" in Objective.from_config(cfg).fallback_reason(policy)
    # The same correction without the declaration streams: the declaration alone decides.
    assert Objective.from_config(cfg).fallback_reason(_FakeLocal()) is None

    base = _model(tiny_model_dir)
    samples = _samples(base, stale=0.5, seed=11)
    model = copy.deepcopy(base)
    trainer = Trainer(
        model, Objective.from_config(cfg), policy, lr=1e-2, weight_decay=0.0, max_grad_norm=1e9,
        temperature=1.0, pad_token_id=0, group_size=4, micro_batch_size=256,
        max_open_groups=64, max_staleness=2,
    )  # fmt: skip
    assert "batch-global" in trainer.fallback
    trainer.begin_step(STEP)
    assert trainer.acc is None  # no S0/S1 buffers: nothing streams, the step waits for the batch
    trainer.batch_backward(samples)
    result = trainer.finish_step()
    assert result.fallback == trainer.fallback and result.num_trajectories == len(samples)
    assert not torch.equal(_params(model), _params(base))


THREADED = {
    "grpo stream": ([], _stream_step),
    "grpo batch": ([], _batch_step),
    "m2po batch": (["staleness.policy=m2po"], _batch_step),
    "kl batch": (["learner.kl_coef=0.1"], _batch_step),
    "ewma stream": (["staleness.policy=ewma"], _stream_step),
    "opd batch": (["opd.enabled=true", "opd.num_samples=3"], _batch_step),
}


@pytest.mark.parametrize("name", sorted(THREADED))
def test_data_parallel_threads_give_the_one_thread_update(tiny_model_dir, tmp_path, monkeypatch, name):
    """learner.threads > 1 on one CPU rank: a micro-batch's pieces train on several threads and
    their gradients are added in piece order. The update equals one thread's (float64: up to
    summation order) and does not depend on which thread finished first (bitwise across runs)."""
    from asyncrl.learner import engine as engine_mod
    from asyncrl.models.tiny import create_base

    monkeypatch.setattr(engine_mod, "MIN_PIECE", 2)  # the test's groups are small
    sets, step = THREADED[name]
    base = _model(tiny_model_dir)
    samples = _samples(base, num_groups=6, stale=0.5)
    if "opd.enabled=true" in sets:
        teacher = create_base(tmp_path / "teacher", hidden_size=32, num_layers=1, num_heads=2, seed=7)
        samples = _with_opd(base, _model(teacher), samples)
    pieces = []
    real = engine_mod.Engine._piece_grads
    monkeypatch.setattr(
        engine_mod.Engine,
        "_piece_grads",
        lambda self, f, piece: pieces.append(len(piece)) or real(self, f, piece),
    )

    def update(threads):
        model = copy.deepcopy(base)
        out = step(model, samples, *sets, threads=threads)
        result = out[1] if isinstance(out, tuple) else out
        return _params(model), result

    one, one_result = update(1)
    assert pieces == []
    runs = [update(3) for _ in range(2)]
    assert len(pieces) > 2  # pieces did run (a streamed trajectory trains alone, not in a piece)
    if step is _batch_step:
        assert sum(pieces) == 2 * len(samples)  # every row in one piece, in each of the 2 runs
    (three, three_result), (again, _) = runs
    torch.testing.assert_close(three, one, rtol=1e-9, atol=1e-12)
    assert torch.equal(three, again)
    assert three_result.loss == pytest.approx(one_result.loss, rel=1e-9, abs=1e-12)
    assert three_result.num_tokens == one_result.num_tokens
    assert three_result.num_trajectories == one_result.num_trajectories == len(samples)
    assert not torch.equal(one, _params(base))
