"""VCPO's off-policy optimal baseline in the learner (staleness.vcpo_baseline, ALGORITHMS.md 2.2):
the accumulator's fold by hand on two-parameter vectors; on a tiny float64 model, the trainer's
update against an independent reference built from per-trajectory gradients taken one by one
(their norms, b_g per group, VCPO's ESS learning-rate scale over the step); streamed steps equal
whole-batch steps in any arrival order; and the config refuses what it cannot train exactly."""

from __future__ import annotations

import contextlib
import copy
import itertools
import math

import pytest
import torch

from asyncrl.config_load import load_config
from asyncrl.config_objective import check_objective_config, check_staleness_policy
from asyncrl.config_sections import ConfigError
from asyncrl.learner.streaming import StreamingAccumulator
from asyncrl.staleness.vcpo import opob_released_scale
from tests.unit.test_trainer import STEP, _batch_step, _model, _params, _samples, _stream_step, _trainer

F64 = torch.float64


def _acc(estimator="grpo", eps=0.0):
    params = [torch.zeros(2, dtype=F64)]
    return StreamingAccumulator(
        params, estimator=estimator, group_size=3, eps=eps, baseline="opob", dtype=F64
    )


H = [
    torch.tensor([1.0, 0.0], dtype=F64),
    torch.tensor([0.0, 2.0], dtype=F64),
    torch.tensor([1.0, 1.0], dtype=F64),
]
R = [1.0, 0.0, 0.0]


@pytest.mark.parametrize("order", list(itertools.permutations(range(3))))
def test_fold_with_the_optimal_baseline_by_hand(order):
    """W = ||h||^2 = 1, 4, 2, so b = (1*1 + 4*0 + 2*0) / 7 = 1/7 (the mean would be 1/3);
    sum (r - b) h = 6/7 [1, 0] - 1/7 [0, 2] - 1/7 [1, 1] = [5/7, -3/7]; the unbiased std of
    (1, 0, 0) is 1/sqrt(3), so the grpo sum is sqrt(3) [5/7, -3/7] and the loss gradient its negative."""
    for estimator, scale in (("grpo", math.sqrt(3.0)), ("dr_grpo", 1.0)):
        acc = _acc(estimator)
        folds = [acc.add_trajectory(H[i], num_tokens=1, group_id=0, reward=R[i]) for i in order]
        assert folds[:2] == [None, None]
        assert folds[2].baseline == pytest.approx(1 / 7, abs=1e-15)
        assert folds[2].reward_mean == pytest.approx(1 / 3)
        grad, _ = acc.finish(1.0)
        torch.testing.assert_close(
            grad, -scale * torch.tensor([5 / 7, -3 / 7], dtype=F64), rtol=0, atol=1e-14
        )


def test_baseline_scale_multiplies_the_weights_and_degenerate_groups_add_nothing():
    acc = _acc()
    # W = 1 * 1, 4 * 0.25, 2 * 2 = 1, 1, 4: b = 1/6.
    folds = [
        acc.add_trajectory(h, num_tokens=1, group_id=0, reward=r, baseline_scale=s)
        for h, r, s in zip(H, R, (1.0, 0.25, 2.0), strict=True)
    ]
    assert folds[2].baseline == pytest.approx(1 / 6, abs=1e-15)
    for h in H:  # equal rewards: zero advantage exactly, whatever the weights
        acc.add_trajectory(h, num_tokens=1, group_id=1, reward=0.3)
    grad, stats = acc.finish(1.0)
    expected = (5 / 6) * H[0] - (1 / 6) * H[1] - (1 / 6) * H[2]
    torch.testing.assert_close(grad, -math.sqrt(3.0) * expected, rtol=0, atol=1e-14)
    assert stats.num_groups_kept == 2


def test_the_optimal_baseline_refuses_what_has_no_per_trajectory_gradient():
    acc = _acc()
    with pytest.raises(ValueError, match="every member's own gradient norm"):
        acc.close_with_known(0, [1.0, 0.0, 0.0], num_tokens=3)
    with pytest.raises(ValueError, match="not 'rloo'"):
        StreamingAccumulator([torch.zeros(2)], estimator="rloo", group_size=3, baseline="opob")
    with pytest.raises(ValueError, match="baseline_scale"):
        acc.add_trajectory(H[0], num_tokens=1, group_id=0, reward=1.0, baseline_scale=-1.0)


def test_released_scale_is_the_squared_is_weight_over_the_squared_token_weight():
    assert opob_released_scale(math.log(2.0), 4, token_weight=0.25) == pytest.approx(4.0 * 16.0)
    assert opob_released_scale(math.log(2.0), 4, token_weight=1.0) == pytest.approx(4.0)
    assert opob_released_scale(100.0, 4, token_weight=1.0) == pytest.approx(
        math.exp(40.0)
    )  # log clamped at 20
    assert opob_released_scale(0.0, 0, token_weight=1.0) == 0.0


# -- the trainer, against an independent reference ------------------------------------------------


def _reference_update(base, samples, *, cap, released, agg):
    """-lr_scale * grad with grad = -(1/Z) sum_g sum_i (R_i - b_g)/(sigma_g + eps) h_i, each h_i
    taken alone: h_i = grad(min(w_i, cap) * sum_t c_i logp_t), W_i = ||h_i||^2 (released: times
    L_i^2 w_i^2), b_g = sum W R / sum W; the lr scale from the unclipped w_i's ESS."""
    from asyncrl.kernels.logprobs import causal_lm_logprobs

    model = copy.deepcopy(base)
    params = [p for p in model.parameters() if p.requires_grad]
    h, weight, log_w = {}, {}, {}
    for s in samples:
        p, n = len(s.prompt_ids), len(s.completion_ids)
        full = torch.tensor([list(s.prompt_ids) + s.completion_ids.tolist()])
        logp = causal_lm_logprobs(model, full).logp[0, p:]
        log_w[s.traj_id] = float((logp.detach() - s.behavior_logprobs.double()).sum())
        c = 1.0 / n if agg == "seq-mean-token-mean" else 1.0
        coef = min(math.exp(log_w[s.traj_id]), cap) * c
        grads = torch.autograd.grad(coef * logp.sum(), params)
        h[s.traj_id] = torch.cat([g.reshape(-1) for g in grads])
        weight[s.traj_id] = float(h[s.traj_id].square().sum())
        if released:
            weight[s.traj_id] *= (1.0 / c) ** 2 * math.exp(2 * log_w[s.traj_id])
    total = torch.zeros_like(next(iter(h.values())))
    for _, members in itertools.groupby(sorted(samples, key=lambda s: s.group_id), key=lambda s: s.group_id):
        members = list(members)
        rewards = torch.tensor([s.reward for s in members], dtype=F64)
        if bool((rewards == rewards[0]).all()):
            continue
        w_n = torch.tensor([weight[s.traj_id] for s in members], dtype=F64)
        b = float((w_n * rewards).sum() / w_n.sum())
        sigma = float(rewards.std(unbiased=True))
        for s in members:
            total += (s.reward - b) / (sigma + 1e-6) * h[s.traj_id]
    z = len(samples) if agg == "seq-mean-token-mean" else sum(len(s.completion_ids) for s in samples)
    grad = -total / z
    lw = torch.tensor(list(log_w.values()), dtype=F64)
    ess = float(torch.exp(2 * torch.logsumexp(lw, 0) - torch.logsumexp(2 * lw, 0)) / len(samples))
    lr_scale = math.sqrt(min(1.0, ess))
    return -lr_scale * grad, ess


@contextlib.contextmanager
def _per_trajectory(active=True):
    """The learner's per-trajectory path (one backward per trajectory, streamed): what it takes
    where the batched norms (`learner/ghost.py`) do not apply; forced here to test both."""
    if not active:
        yield
        return
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("asyncrl.learner.trainer.ghost_unsupported", lambda *a, **k: "forced by the test")
        yield


def _opob_update(base, samples, *sets, streaming, seed=0, per_trajectory=True):
    import random

    model = copy.deepcopy(base)
    with _per_trajectory(per_trajectory):
        t = _trainer(model, *sets, *([] if streaming else ["learner.streaming=off"]))
    t.updater.optimizer = torch.optim.SGD(t.params, lr=1.0)
    t.updater.lr, t.updater.max_grad_norm = 1.0, 1e9
    before = _params(model)
    t.begin_step(STEP)
    if t.fallback:
        t.batch_backward(samples)
    else:
        order = list(samples)
        random.Random(seed).shuffle(order)
        for s in order:
            t.offer(s)
            t.work()
        while t.work():
            pass
    result = t.finish_step()
    return _params(model) - before, result


@pytest.mark.parametrize(
    ("baseline", "agg"), [("opob", "token-mean"), ("opob_released", "seq-mean-token-mean")]
)
def test_trainer_update_equals_the_hand_built_optimal_baseline_update(tiny_model_dir, baseline, agg):
    base = _model(tiny_model_dir)
    samples = _samples(base, stale=0.6, seed=5)
    sets = [
        "staleness.policy=vcpo",
        "staleness.params.is_cap=1.3",
        f"staleness.vcpo_baseline={baseline}",
        f'learner.agg="{agg}"',
    ]
    expected, ess = _reference_update(base, samples, cap=1.3, released=baseline == "opob_released", agg=agg)
    assert ess < 0.99  # stale samples: the ESS learning-rate scale is really at work
    # One backward per trajectory (streamed, or a whole-batch step), and the batched norms.
    for streaming, per_trajectory in ((True, True), (False, True), (True, False)):
        got, result = _opob_update(base, samples, *sets, streaming=streaming, per_trajectory=per_trajectory)
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)
        assert result.lr_scale == pytest.approx(math.sqrt(ess), abs=1e-12)
        assert result.policy_stats["ess_ratio"] == pytest.approx(ess, abs=1e-12)
        assert result.streamed == (len(samples) if streaming and per_trajectory else 0)
        assert ("batch in one backward" in result.fallback) == (not per_trajectory)
    mean_baseline, _ = _opob_update(base, samples, *sets[:2], f'learner.agg="{agg}"', streaming=False)
    assert float((mean_baseline - expected).abs().max()) > 1e-6  # the baseline is not the mean's


OPOB = {
    "vcpo": ["staleness.policy=vcpo", "staleness.vcpo_baseline=opob"],
    "vcpo_released": ["staleness.policy=vcpo", "staleness.vcpo_baseline=opob_released"],
    "tis_seq_mean": [
        "staleness.policy=tis",
        "staleness.vcpo_baseline=opob",
        'learner.agg="seq-mean-token-mean"',
        "learner.drop_degenerate_groups=true",
    ],
    "dr_grpo": [
        "learner.advantage=dr_grpo",
        'learner.agg="seq-mean-token-sum-norm"',
        "staleness.policy=none",
        "staleness.params.anchor=current",
        "staleness.vcpo_baseline=opob",
    ],
}


@pytest.mark.parametrize("name", sorted(OPOB))
def test_streamed_optimal_baseline_equals_the_batch_step(tiny_model_dir, name):
    base = _model(tiny_model_dir)
    samples = _samples(base, stale=0.5, seed=len(name))
    ref = copy.deepcopy(base)
    batch = _batch_step(ref, samples, *OPOB[name])  # the batched norms
    assert batch.fallback == "learner.streaming = 'off'"
    for seed in range(3):
        model = copy.deepcopy(base)
        with _per_trajectory():
            trainer, streamed = _stream_step(model, samples, *OPOB[name], seed=seed)
        assert trainer.fallback == "" and trainer.acc.baseline == "opob"
        torch.testing.assert_close(_params(model), _params(ref), rtol=0, atol=1e-10)
        assert streamed.loss == pytest.approx(batch.loss, abs=1e-9)
        assert streamed.lr_scale == pytest.approx(batch.lr_scale, abs=1e-12)
        assert streamed.streamed == len(samples) and streamed.deferred == 0
    assert not torch.equal(_params(ref), _params(base))


def test_one_open_group_at_a_time_still_trains_every_group(tiny_model_dir):
    """Back-pressure: with buffers for one group, trajectories of other groups wait until it
    closes; interleaved arrivals still end with every group folded, equal to the batch step."""
    base = _model(tiny_model_dir)
    samples = _samples(base, stale=0.5, seed=2)
    group_mb = 2 * 4 * sum(p.numel() for p in base.parameters()) / 2**20
    sets = [*OPOB["vcpo"], f"learner.stream_memory_mb={1.5 * group_mb}"]
    ref = copy.deepcopy(base)
    _batch_step(ref, samples, *sets)
    model = copy.deepcopy(base)
    with _per_trajectory():
        t = _trainer(model, *sets)
    assert t.max_open_groups == 1
    t.begin_step(STEP)
    for s in sorted(samples, key=lambda s: s.sample_index):  # round-robin over the groups
        t.offer(s)
        while t.work():
            assert t.acc.num_open_groups <= 1
    t.finish_step()
    torch.testing.assert_close(_params(model), _params(ref), rtol=0, atol=1e-10)


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        (["learner.advantage=rloo"], "'rloo' has its own baseline"),
        (["learner.world_size=2", "sampling.top_p=0.9"], "set sampling.top_p = 1"),
        (["learner.mixed_precision=bf16"], "learner.mixed_precision = 'none'"),
        (["learner.epochs=2"], "learner.epochs = 1"),
        (["learner.kl_coef=0.1"], "learner.kl_coef = 0"),
        (["opd.enabled=true"], "task reward alone"),
        (["staleness.policy=none"], "clips against an anchor other than the current policy"),
        (["staleness.policy=m2po"], "staleness policy 'm2po'"),
        (["staleness.policy=mis", "staleness.params.self_normalize=true"], "staleness policy 'mis'"),
    ],
)
def test_the_optimal_baseline_refuses_combinations_it_cannot_train_exactly(sets, message):
    with pytest.raises(ConfigError, match=message):  # at config load, before any process starts
        load_config(overrides=["staleness.policy=vcpo", "staleness.vcpo_baseline=opob", *sets])  # later wins


def test_the_optimal_baseline_accepts_per_trajectory_policies():
    for sets in (
        ["staleness.policy=vcpo"],
        ["staleness.policy=vcpo", "staleness.freshness.self_normalize=false"],
        ["staleness.policy=tis"],
        ["staleness.policy=none", "staleness.params.anchor=current", "learner.advantage=dr_grpo"],
    ):
        cfg = load_config(overrides=[*sets, "staleness.vcpo_baseline=opob_released"])
        check_objective_config(cfg, check_staleness_policy(cfg.staleness))
    cfg = load_config(overrides=["staleness.policy=vcpo", "staleness.freshness.self_normalize=true"])
    policy = check_staleness_policy(cfg.staleness)
    assert policy.batch_global and not policy.batch_global_lr_only  # self-normalised weights


def test_the_batched_step_takes_norms_only_of_groups_whose_baseline_matters(tiny_model_dir):
    """The norms' forward and backward run on the members of groups whose rewards
    differ and no others (an all-equal group's advantages are 0 whatever its baseline), and the
    step still equals the per-trajectory path's, which takes every norm."""
    from asyncrl.learner.ghost import GhostNorms

    base = _model(tiny_model_dir)
    samples = _samples(base, num_groups=6, stale=0.5, seed=5, degenerate=(0, 2, 3))
    rewards = [[s.reward for s in samples if s.group_id == g] for g in range(6)]
    informative = [g for g, r in enumerate(rewards) if len(set(r)) > 1]
    assert informative and set(informative) <= {1, 4, 5}
    ref = copy.deepcopy(base)
    with _per_trajectory():
        _batch_step(ref, samples, *OPOB["vcpo"])
    rows_seen: list[int] = []
    backward = GhostNorms.backward

    def counting(self, logp_BL, coeff_BL):
        rows_seen.append(logp_BL.shape[0])
        return backward(self, logp_BL, coeff_BL)

    model = copy.deepcopy(base)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(GhostNorms, "backward", counting)
        _batch_step(model, samples, *OPOB["vcpo"], micro=8)
    assert sum(rows_seen) == 4 * len(informative)
    torch.testing.assert_close(_params(model), _params(ref), rtol=0, atol=1e-10)


@pytest.mark.parametrize("one_pass", [True, False])
@pytest.mark.parametrize(("threads", "micro"), [(2, 256), (1, 8)])
def test_batched_optimal_baseline_on_pieces_and_micro_batches(tiny_model_dir, threads, micro, one_pass):
    """The batched step, its norms' pieces on 2 data-parallel threads (each its own collector)
    and over several micro-batches, trained from its norms' own backward (one pass, what it does
    without shared prefixes) or by a second forward and backward: it equals the per-trajectory
    path (one backward per trajectory)."""
    base = _model(tiny_model_dir)
    samples = _samples(base, num_groups=8, stale=0.5, seed=11)
    sets = OPOB["vcpo"]
    ref = copy.deepcopy(base)
    with _per_trajectory():
        expected = _batch_step(ref, samples, *sets, threads=threads)
    model = copy.deepcopy(base)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("asyncrl.learner.rl_work.OpobBatchWork._one_pass", lambda self: one_pass)
        got = _batch_step(model, samples, *sets, micro=micro, threads=threads)
    torch.testing.assert_close(_params(model), _params(ref), rtol=0, atol=1e-10)
    assert got.loss == pytest.approx(expected.loss, abs=1e-9)
    assert got.lr_scale == pytest.approx(expected.lr_scale, abs=1e-12)
    assert not torch.equal(_params(model), _params(base))
