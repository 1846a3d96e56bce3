"""Streamed per-trajectory gradients equal the batch-synchronous gradient (ALGORITHMS.md 5).

The batch reference is what a synchronous learner does: one forward over the whole padded batch,
advantages from `asyncrl.learner.advantages`, the clipped surrogate (or reverse-KL OPD loss) at
ratio 1 (logp_old = logp.detach()) with its global denominator, one backward. The streamed side runs
one forward+backward per trajectory (`trajectory_score_gradient`) and folds the flat gradients in a
random arrival order. Everything is float64, so "equal" means equal up to summation order.
"""

from __future__ import annotations

import contextlib
import copy
from types import SimpleNamespace
from typing import NamedTuple

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncrl.learner.advantages import dr_grpo_advantages, grpo_advantages, rloo_advantages
from asyncrl.learner.losses import clipped_surrogate
from asyncrl.learner.opd import pg_kl_loss
from asyncrl.learner.streaming import (
    OpenGroupLimitError,
    StreamingAccumulator,
    StreamStats,
    flatten_grads,
    grad_sync_disabled,
    token_weight,
    trajectory_score_gradient,
    write_flat_grad,
)

NUM_GROUPS = 4
GROUP_SIZE = 3
VOCAB = 16
NORM_CONSTANT = 7.0  # Dr. GRPO's constant denominator (max response length)
# Rewards drawn from a small set so that hypothesis often produces degenerate groups; 0.3 has an
# inexact float mean, which is the case where a naive fold divides a rounding error by eps.
REWARD_VALUES = (0.0, 0.3, 1.0)
ATOL = 1e-11


class Trajectory(NamedTuple):
    input_ids_T: torch.Tensor
    mask_T: torch.Tensor  # bool: completion tokens
    group: int
    slot: int
    teacher_logp_T: torch.Tensor  # OPD teacher scores (used only by the OPD cases)

    @property
    def num_tokens(self) -> int:
        return int(self.mask_T.sum())


class TinyCausalLM(torch.nn.Module):
    """Embedding, one causal self-attention block with an MLP, LM head.

    Not a transformers model on purpose: Llama's RMSNorm computes in float32 even for float64
    weights, which makes a float64 batch gradient differ from the sum of per-trajectory gradients
    by ~1e-8 relative (float32 rounding of the upstream gradient), hiding real errors.
    """

    def __init__(self, vocab: int, dim: int) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.mlp = torch.nn.Sequential(
            torch.nn.Linear(dim, 2 * dim), torch.nn.Tanh(), torch.nn.Linear(2 * dim, dim)
        )
        self.lm_head = torch.nn.Linear(dim, vocab)

    def hidden(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        q, k, v = self.qkv(x)[:, None].chunk(3, dim=-1)
        x = x + F.scaled_dot_product_attention(q, k, v, is_causal=True)[:, 0]
        return x + self.mlp(x)

    def get_decoder(self):
        return lambda input_ids: SimpleNamespace(last_hidden_state=self.hidden(input_ids))

    def get_output_embeddings(self) -> torch.nn.Linear:
        return self.lm_head

    def forward(self, input_ids: torch.Tensor) -> SimpleNamespace:
        return SimpleNamespace(logits=self.lm_head(self.hidden(input_ids)))


def _make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return TinyCausalLM(VOCAB, 16).double()


def _make_trajectories() -> list[Trajectory]:
    gen = torch.Generator().manual_seed(1)
    out = []
    for g in range(NUM_GROUPS):
        prompt = torch.randint(0, VOCAB, (2 + g % 2,), generator=gen)
        for slot in range(GROUP_SIZE):
            completion_len = int(torch.randint(1, 6, (1,), generator=gen))
            completion = torch.randint(0, VOCAB, (completion_len,), generator=gen)
            ids = torch.cat([prompt, completion])
            mask = torch.zeros(ids.shape[0], dtype=torch.bool)
            mask[prompt.shape[0] :] = True
            teacher = -3.0 * torch.rand(ids.shape[0], generator=gen, dtype=torch.float64) - 0.1
            out.append(Trajectory(ids, mask, g, slot, teacher))
    return out


def _opd_weight(traj: Trajectory, mode: str):
    """c_t * A_t with the reverse-KL advantage A_t = logp_teacher - sg(logp) (on-policy: w = 1)."""
    c = token_weight(mode, traj.num_tokens)
    return lambda logp_T: c * (traj.teacher_logp_T - logp_T)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def setup():
    model = _make_model()
    params = [p for p in model.parameters() if p.requires_grad]
    return model, params, _make_trajectories()


@pytest.fixture(scope="module")
def score_grads(setup):
    """h_i per trajectory for c_t = 1, c_t = 1/|o_i| and the OPD weights, computed once."""
    model, params, trajs = setup
    out = {}
    for mode in ("token-mean", "seq-mean-token-mean"):
        out[mode] = [
            trajectory_score_gradient(
                model,
                params,
                t.input_ids_T,
                t.mask_T,
                torch.full_like(t.teacher_logp_T, token_weight(mode, t.num_tokens)),
            )
            for t in trajs
        ]
        out["opd", mode] = [
            trajectory_score_gradient(model, params, t.input_ids_T, t.mask_T, _opd_weight(t, mode))
            for t in trajs
        ]
    return out


# -- batch reference ----------------------------------------------------------------------------


def _pad(trajs: list[Trajectory]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right padding: under causal attention real tokens never see the pad tokens after them."""
    length = max(t.input_ids_T.shape[0] for t in trajs)
    ids = torch.stack([F.pad(t.input_ids_T, (0, length - t.input_ids_T.shape[0])) for t in trajs])
    mask = torch.stack([F.pad(t.mask_T, (0, length - t.mask_T.shape[0])) for t in trajs])
    teacher = torch.stack([F.pad(t.teacher_logp_T, (0, length - t.mask_T.shape[0])) for t in trajs])
    return ids, mask, teacher


def _batch_logp(model: torch.nn.Module, ids_BT: torch.Tensor) -> torch.Tensor:
    """Independent of asyncrl.kernels.logprobs: full logits, log_softmax, gather."""
    logits = model(input_ids=ids_BT).logits[:, :-1]
    logp = torch.log_softmax(logits, dim=-1).gather(-1, ids_BT[:, 1:, None]).squeeze(-1)
    return F.pad(logp, (1, 0))


def _advantages(estimator: str, rewards_GN: torch.Tensor, *, unbiased: bool) -> torch.Tensor:
    if estimator == "grpo":
        return grpo_advantages(rewards_GN, unbiased=unbiased)
    if estimator == "dr_grpo":
        return dr_grpo_advantages(rewards_GN)
    return rloo_advantages(rewards_GN)


def _degenerate_G(rewards_GN: torch.Tensor) -> torch.Tensor:
    return (rewards_GN == rewards_GN[:, :1]).all(dim=1)


def batch_gradient(
    model, params, trajs, rewards_GN, *, estimator, mode, drop_degenerate=False, unbiased=True
) -> torch.Tensor:
    """The synchronous learner's gradient (dynamic sampling removes degenerate groups first)."""
    if estimator == "opd" or not drop_degenerate:
        batch = list(trajs)
    else:
        degenerate_G = _degenerate_G(rewards_GN)
        batch = [t for t in trajs if not degenerate_G[t.group]]
    if not batch:
        return torch.zeros(sum(p.numel() for p in params), dtype=torch.float64)
    ids_BT, mask_BT, teacher_BT = _pad(batch)
    for p in params:
        p.grad = None
    logp_BT = _batch_logp(model, ids_BT)
    denominators = dict(
        mode=mode, num_tokens_global=mask_BT.sum(), num_seqs_global=len(batch), norm_constant=NORM_CONSTANT
    )
    if estimator == "opd":
        loss, _ = pg_kl_loss(logp_BT, logp_BT.detach(), teacher_BT, mask_BT, **denominators)
    else:
        adv_GN = _advantages(estimator, rewards_GN, unbiased=unbiased)
        adv_B = torch.stack([adv_GN[t.group, t.slot] for t in batch])
        adv_BT = torch.where(mask_BT, adv_B[:, None], 0.0)
        loss, _ = clipped_surrogate(logp_BT, logp_BT.detach(), adv_BT, mask_BT, **denominators)
    loss.backward()
    grad = flatten_grads(params)
    for p in params:
        p.grad = None
    return grad


def streamed_gradient(
    params, trajs, h_list, rewards_GN, order, **acc_kwargs
) -> tuple[torch.Tensor, StreamStats]:
    acc = StreamingAccumulator(
        params, group_size=GROUP_SIZE, norm_constant=NORM_CONSTANT, dtype=torch.float64, **acc_kwargs
    )
    for i in order:
        t = trajs[i]
        if acc.estimator == "opd":
            acc.add_trajectory(h_list[i], num_tokens=t.num_tokens)
        else:
            reward = float(rewards_GN[t.group, t.slot])
            acc.add_trajectory(h_list[i], num_tokens=t.num_tokens, group_id=f"g{t.group}", reward=reward)
    assert acc.num_open_groups == 0 and acc.memory_bytes == 0
    return acc.finish()


def _assert_close(got: torch.Tensor, expected: torch.Tensor) -> None:
    scale = max(1.0, float(expected.abs().max()))
    err = float((got - expected).abs().max())
    assert err <= ATOL * scale, err


rewards_strategy = st.lists(
    st.sampled_from(REWARD_VALUES), min_size=NUM_GROUPS * GROUP_SIZE, max_size=NUM_GROUPS * GROUP_SIZE
)
order_strategy = st.permutations(range(NUM_GROUPS * GROUP_SIZE))

GROUP_CASES = [
    # (estimator, aggregation mode, drop degenerate groups (DAPO dynamic sampling), unbiased std)
    ("grpo", "token-mean", False, True),
    ("grpo", "seq-mean-token-mean", False, True),
    ("grpo", "token-mean", False, False),
    ("grpo", "token-mean", True, True),  # DAPO
    ("grpo", "seq-mean-token-mean", True, True),
    ("dr_grpo", "seq-mean-token-sum-norm", False, True),  # Dr. GRPO
    ("dr_grpo", "token-mean", True, True),
    ("rloo", "token-mean", False, True),
    ("rloo", "seq-mean-token-sum", True, True),
]


@pytest.mark.parametrize(("estimator", "mode", "drop", "unbiased"), GROUP_CASES)
@settings(max_examples=25, deadline=None)
@given(rewards=rewards_strategy, order=order_strategy)
def test_streamed_equals_batch(setup, score_grads, estimator, mode, drop, unbiased, rewards, order):
    model, params, trajs = setup
    rewards_GN = torch.tensor(rewards, dtype=torch.float64).reshape(NUM_GROUPS, GROUP_SIZE)
    expected = batch_gradient(
        model,
        params,
        trajs,
        rewards_GN,
        estimator=estimator,
        mode=mode,
        drop_degenerate=drop,
        unbiased=unbiased,
    )
    h_list = score_grads["seq-mean-token-mean" if mode == "seq-mean-token-mean" else "token-mean"]
    got, stats = streamed_gradient(
        params,
        trajs,
        h_list,
        rewards_GN,
        order,
        estimator=estimator,
        agg=mode,
        drop_degenerate_groups=drop,
        unbiased=unbiased,
    )
    _assert_close(got, expected)
    dropped_G = _degenerate_G(rewards_GN) & drop
    assert stats.num_groups_dropped == int(dropped_G.sum())
    assert stats.num_groups_kept == NUM_GROUPS - int(dropped_G.sum())
    assert stats.num_tokens == sum(t.num_tokens for t in trajs if not dropped_G[t.group])


def test_degenerate_groups_fixed_case(setup, score_grads):
    """A degenerate group of 0.3s (inexact float mean) and an all-ones group, with and without
    dynamic sampling: dropped groups' tokens must not count in Z, the rest must match the batch."""
    model, params, trajs = setup
    rewards_GN = torch.tensor(
        [[0.3, 0.3, 0.3], [1.0, 0.0, 1.0], [1.0, 1.0, 1.0], [0.0, 0.3, 1.0]], dtype=torch.float64
    )
    for drop in (False, True):
        expected = batch_gradient(
            model, params, trajs, rewards_GN, estimator="grpo", mode="token-mean", drop_degenerate=drop
        )
        got, stats = streamed_gradient(
            params,
            trajs,
            score_grads["token-mean"],
            rewards_GN,
            reversed(range(len(trajs))),
            estimator="grpo",
            drop_degenerate_groups=drop,
        )
        _assert_close(got, expected)
        kept_groups = (1, 3) if drop else (0, 1, 2, 3)
        assert stats.num_tokens == sum(t.num_tokens for t in trajs if t.group in kept_groups)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
@settings(max_examples=8, deadline=None)
@given(order=order_strategy)
def test_opd_streamed_equals_batch(setup, score_grads, mode, order):
    model, params, trajs = setup
    expected = batch_gradient(model, params, trajs, None, estimator="opd", mode=mode)
    got, stats = streamed_gradient(
        params, trajs, score_grads["opd", mode], None, order, estimator="opd", agg=mode
    )
    _assert_close(got, expected)
    # No group buffers: the only parameter-sized buffer is the step sum.
    assert stats.num_groups_kept == 0 and stats.peak_memory_bytes == 8 * sum(p.numel() for p in params)


MIXED_REWARDS = [[0.0, 1.0, 1.0], [1.0, 1.0, 1.0], [0.3, 0.0, 1.0], [0.0, 0.0, 1.0]]


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_same_parameters_after_one_step(setup, score_grads, optimizer):
    """The optimizer sees the same gradient: one clipped step from the same weights lands on the same weights."""
    model, params, trajs = setup
    rewards_GN = torch.tensor(MIXED_REWARDS, dtype=torch.float64)
    expected = batch_gradient(
        model, params, trajs, rewards_GN, estimator="grpo", mode="token-mean", drop_degenerate=True
    )
    order = [5, 0, 11, 3, 1, 7, 2, 9, 4, 10, 6, 8]
    got, _ = streamed_gradient(
        params,
        trajs,
        score_grads["token-mean"],
        rewards_GN,
        order,
        estimator="grpo",
        drop_degenerate_groups=True,
    )
    stepped = []
    for grad in (expected, got):
        clone = copy.deepcopy(model)
        clone_params = [p for p in clone.parameters() if p.requires_grad]
        if optimizer == "sgd":
            opt = torch.optim.SGD(clone_params, lr=0.1)
        else:
            opt = torch.optim.Adam(clone_params, lr=1e-2)
        write_flat_grad(clone_params, grad)
        torch.nn.utils.clip_grad_norm_(clone_params, max_norm=1.0)
        opt.step()
        stepped.append(torch.cat([p.detach().reshape(-1) for p in clone_params]))
    original = torch.cat([p.detach().reshape(-1) for p in params])
    assert float((stepped[0] - stepped[1]).abs().max()) <= 1e-10
    assert float((stepped[0] - original).abs().max()) > 1e-4  # the step did move the weights


def test_data_parallel_split_equals_single_process(setup, score_grads):
    """Groups split over two accumulators, one sum of the unit counts and one of the gradients."""
    model, params, trajs = setup
    rewards_GN = torch.tensor(MIXED_REWARDS, dtype=torch.float64)
    h_list = score_grads["token-mean"]
    expected = batch_gradient(
        model, params, trajs, rewards_GN, estimator="grpo", mode="token-mean", drop_degenerate=True
    )
    ranks = [
        StreamingAccumulator(params, group_size=GROUP_SIZE, drop_degenerate_groups=True, dtype=torch.float64)
        for _ in range(2)
    ]
    for t, h in zip(trajs, h_list, strict=True):
        reward = float(rewards_GN[t.group, t.slot])
        ranks[t.group % 2].add_trajectory(h, num_tokens=t.num_tokens, group_id=t.group, reward=reward)
    num_units_global = sum(acc.num_units for acc in ranks)
    got = sum(acc.finish(num_units_global)[0] for acc in ranks)
    _assert_close(got, expected)


def test_chunked_score_gradient_matches_full_logits(setup):
    model, params, trajs = setup
    t = trajs[0]
    weight = torch.full_like(t.teacher_logp_T, 0.5)
    full = trajectory_score_gradient(model, params, t.input_ids_T, t.mask_T, weight)
    chunked = trajectory_score_gradient(model, params, t.input_ids_T, t.mask_T, weight, chunk_size=2)
    _assert_close(chunked, full)
    assert all(p.grad is None for p in params)


def test_score_gradient_ignores_nonfinite_weight_on_prompt(setup):
    """A -inf teacher score at a prompt position must not turn the gradient into nan (0 * inf)."""
    model, params, trajs = setup
    t = trajs[0]
    weight = torch.where(t.mask_T, 1.0, float("-inf")).double()
    assert torch.isfinite(trajectory_score_gradient(model, params, t.input_ids_T, t.mask_T, weight)).all()


# -- accumulator mechanics ------------------------------------------------------------------------


def _tiny_params() -> list[torch.Tensor]:
    return [torch.zeros(3, 2, requires_grad=True), torch.zeros(4, requires_grad=True)]


def test_memory_accounting_and_back_pressure():
    acc = StreamingAccumulator(
        _tiny_params(), estimator="grpo", group_size=3, max_open_groups=2, dtype=torch.float64
    )
    one = torch.ones(10, dtype=torch.float64)
    assert acc.buffer_bytes == 80 and acc.memory_bytes == 0 and acc.free_group_slots == 2
    acc.add_trajectory(one, num_tokens=3, group_id="a", reward=1.0)
    assert acc.memory_bytes == 80  # S0 only: S1 is allocated when a reward differs from the pivot
    acc.add_trajectory(one, num_tokens=3, group_id="b", reward=1.0)
    assert acc.free_group_slots == 0
    with pytest.raises(OpenGroupLimitError):
        acc.add_trajectory(one, num_tokens=3, group_id="c", reward=0.0)
    assert acc.num_open_groups == 2 and not acc.is_open("c") and acc.num_tokens == 0
    acc.add_trajectory(one, num_tokens=2, group_id="a", reward=0.0)
    assert acc.memory_bytes == 80 * 3  # a: S0 and S1; b: S0
    fold = acc.add_trajectory(one, num_tokens=1, group_id="a", reward=0.0)
    assert fold is not None and fold.kept and not fold.degenerate and fold.num_samples == 3
    assert fold.reward_mean == pytest.approx(1 / 3)
    assert acc.memory_bytes == 80 and acc.total_memory_bytes == 160 and acc.free_group_slots == 1
    acc.add_trajectory(one, num_tokens=3, group_id="c", reward=0.0)
    acc.add_trajectory(2 * one, num_tokens=1, group_id="c", reward=1.0)
    assert acc.memory_bytes == 80 * 3  # b: S0; c: S0 and S1
    with pytest.raises(RuntimeError, match="still open"):
        acc.finish()
    acc.add_trajectory(one, num_tokens=1, group_id="b", reward=1.0)
    fold = acc.add_trajectory(one, num_tokens=1, group_id="b", reward=1.0)
    assert fold is not None and fold.degenerate and fold.kept  # kept: drop_degenerate_groups is off
    acc.add_trajectory(one, num_tokens=1, group_id="c", reward=0.0)
    grad, stats = acc.finish()
    assert grad.shape == (10,)
    assert stats.peak_memory_bytes == 80 * 4 and stats.num_trajectories == 9
    assert stats.num_groups_kept == 3 and stats.num_tokens == 16
    # After finish the accumulator is empty and ready for the next step.
    assert acc.total_memory_bytes == 0 and acc.num_tokens == 0


@pytest.mark.parametrize(("estimator", "buffers"), [("grpo", 2), ("dr_grpo", 1), ("rloo", 1), ("opd", 0)])
def test_buffers_per_open_group(estimator, buffers):
    acc = StreamingAccumulator(_tiny_params(), estimator=estimator, group_size=3, dtype=torch.float32)
    for reward in (0.0, 1.0):
        if estimator == "opd":
            acc.add_trajectory(torch.ones(10), num_tokens=1)
        else:
            acc.add_trajectory(torch.ones(10), num_tokens=1, group_id=0, reward=reward)
    assert acc.memory_bytes == buffers * 40


def test_hand_computed_grpo_fold():
    """Rewards 1 and 0 with h = e0 and e1: mu = 0.5, sigma = 1/sqrt(2) (ddof 1), eps 0,
    A = +-0.5 sqrt(2); token-mean over 1 + 3 tokens: grad = -(A_1 e0 + A_2 e1) / 4."""
    acc = StreamingAccumulator(_tiny_params(), group_size=2, eps=0.0, dtype=torch.float64)
    e = torch.eye(10, dtype=torch.float64)
    acc.add_trajectory(e[0], num_tokens=1, group_id=0, reward=1.0)
    fold = acc.add_trajectory(e[1], num_tokens=3, group_id=0, reward=0.0)
    assert fold is not None and fold.reward_std == pytest.approx(2**-0.5)
    grad, stats = acc.finish()
    a = 0.5 * 2**0.5
    assert stats.denominator == 4.0
    torch.testing.assert_close(grad, -(a * e[0] - a * e[1]) / 4, rtol=0, atol=1e-15)


def test_empty_step_gives_zero_gradient():
    acc = StreamingAccumulator(_tiny_params(), group_size=2, drop_degenerate_groups=True)
    acc.add_trajectory(torch.ones(10), num_tokens=2, group_id=0, reward=1.0)
    acc.add_trajectory(torch.ones(10), num_tokens=2, group_id=0, reward=1.0)
    grad, stats = acc.finish()
    assert stats.num_groups_dropped == 1 and stats.denominator == 0.0
    assert torch.equal(grad, torch.zeros(10))


def test_token_weight():
    assert token_weight("token-mean", 5) == 1.0
    assert token_weight("seq-mean-token-mean", 4) == 0.25
    assert token_weight("seq-mean-token-mean", 0) == 1.0
    assert token_weight("seq-mean-token-sum-norm", 4) == 1.0
    with pytest.raises(ValueError, match="valid"):
        token_weight("sum", 3)


def test_invalid_configuration():
    params = _tiny_params()
    with pytest.raises(ValueError, match="valid: grpo"):
        StreamingAccumulator(params, estimator="ppo")
    with pytest.raises(ValueError, match="needs group_size"):
        StreamingAccumulator(params, estimator="grpo")
    with pytest.raises(ValueError, match="norm_constant"):
        StreamingAccumulator(params, agg="seq-mean-token-sum-norm", group_size=2)
    with pytest.raises(ValueError, match="opd"):
        StreamingAccumulator(params, estimator="opd", drop_degenerate_groups=True)
    acc = StreamingAccumulator(params, estimator="opd")
    with pytest.raises(ValueError, match="no group_id"):
        acc.add_trajectory(torch.zeros(10), num_tokens=1, group_id=1, reward=1.0)
    with pytest.raises(ValueError, match="flat"):
        acc.add_trajectory(torch.zeros(3, 2), num_tokens=1)
    acc = StreamingAccumulator(params, group_size=2)
    with pytest.raises(ValueError, match="needs group_id"):
        acc.add_trajectory(torch.zeros(10), num_tokens=1)
    with pytest.raises(ValueError, match="finite"):
        acc.add_trajectory(torch.zeros(10), num_tokens=1, group_id=0, reward=float("nan"))
    acc.add_trajectory(torch.zeros(10), num_tokens=1, group_id=0, reward=1.0)
    acc.add_trajectory(torch.zeros(10), num_tokens=1, group_id=0, reward=0.0)
    with pytest.raises(ValueError, match="already closed"):
        acc.add_trajectory(torch.zeros(10), num_tokens=1, group_id=0, reward=0.0)


def test_write_flat_grad_round_trip():
    params = _tiny_params()
    flat = torch.arange(10.0)
    write_flat_grad(params, flat)
    assert torch.equal(params[0].grad, flat[:6].reshape(3, 2))
    assert torch.equal(flatten_grads(params), flat)
    with pytest.raises(ValueError, match="10 elements"):
        write_flat_grad(params, torch.zeros(9))


class _FakeDdp(torch.nn.Module):
    """DDP's surface: a `no_sync()` context manager."""

    def __init__(self) -> None:
        super().__init__()
        self.events: list[str] = []

    @contextlib.contextmanager
    def no_sync(self):
        self.events.append("off")
        yield
        self.events.append("on")


class _FakeFsdp2(torch.nn.Module):
    """FSDP2's surface: `set_requires_gradient_sync(flag)`."""

    def __init__(self) -> None:
        super().__init__()
        self.events: list[bool] = []

    def set_requires_gradient_sync(self, flag: bool) -> None:
        self.events.append(flag)


def test_grad_sync_disabled_uses_the_wrappers_switch():
    ddp, fsdp = _FakeDdp(), _FakeFsdp2()
    with grad_sync_disabled(ddp):
        assert ddp.events == ["off"]
    assert ddp.events == ["off", "on"]
    with pytest.raises(KeyError), grad_sync_disabled(fsdp):
        assert fsdp.events == [False]
        raise KeyError("sync must be restored even when the backward fails")
    assert fsdp.events == [False, True]
    with grad_sync_disabled(torch.nn.Linear(2, 2)):
        pass
