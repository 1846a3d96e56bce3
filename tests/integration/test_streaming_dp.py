"""Two gloo ranks streaming disjoint groups give the single-process batch gradient (ALGORITHMS.md 5.7).

Each rank keeps its groups to itself and computes every trajectory's gradient locally; the only
collectives of the step are one all-reduce of the unit count (a scalar) and one of the flat
gradient. The ranks get different numbers of trajectories (9 and 3), so a per-trajectory collective
would pair mismatched calls and fail or hang instead of passing by luck.

The model is not wrapped in DDP here: DDP (and torch.optim) import torch._dynamo, ~7 s per spawned
process on a busy 2-core machine. `grad_sync_disabled` is covered by a unit test with fakes.
"""

from __future__ import annotations

import multiprocessing as mp
import os
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from asyncrl.learner.advantages import grpo_advantages
from asyncrl.learner.losses import clipped_surrogate
from asyncrl.learner.streaming import (
    StreamingAccumulator,
    flatten_grads,
    token_weight,
    trajectory_score_gradient,
    write_flat_grad,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

WORLD_SIZE = 2
NUM_GROUPS = 4
GROUP_SIZE = 3
VOCAB = 13
LR = 0.5
# Group 1 is degenerate (dropped by dynamic sampling: its tokens must not count in Z).
REWARDS = [[0.0, 1.0, 1.0], [1.0, 1.0, 1.0], [0.3, 0.0, 1.0], [0.0, 0.0, 1.0]]
RANK_OF_GROUP = [0, 0, 0, 1]  # groups stay on one rank; uneven on purpose
COLLECTIVE_TIMEOUT = timedelta(seconds=60)


class TinyCausalLM(torch.nn.Module):
    """Embedding, one causal self-attention block with an MLP, LM head (float64 end to end)."""

    def __init__(self, vocab: int, dim: int) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.mlp = torch.nn.Sequential(
            torch.nn.Linear(dim, 2 * dim), torch.nn.Tanh(), torch.nn.Linear(2 * dim, dim)
        )
        self.lm_head = torch.nn.Linear(dim, vocab)

    def forward(self, input_ids: torch.Tensor) -> SimpleNamespace:
        x = self.embed(input_ids)
        q, k, v = self.qkv(x)[:, None].chunk(3, dim=-1)
        x = x + F.scaled_dot_product_attention(q, k, v, is_causal=True)[:, 0]
        return SimpleNamespace(logits=self.lm_head(x + self.mlp(x)))


def _make_model() -> TinyCausalLM:
    torch.manual_seed(0)
    return TinyCausalLM(VOCAB, 12).double()


def _make_trajectories() -> list[tuple[int, int, torch.Tensor, torch.Tensor]]:
    """(group, slot, input_ids_T, completion mask_T), identical in every process."""
    gen = torch.Generator().manual_seed(3)
    out = []
    for g in range(NUM_GROUPS):
        prompt = torch.randint(0, VOCAB, (3,), generator=gen)
        for slot in range(GROUP_SIZE):
            completion = torch.randint(
                0, VOCAB, (int(torch.randint(1, 7, (1,), generator=gen)),), generator=gen
            )
            ids = torch.cat([prompt, completion])
            mask = torch.arange(ids.shape[0]) >= prompt.shape[0]
            out.append((g, slot, ids, mask))
    return out


def _sgd_step(model: torch.nn.Module, grad_P: torch.Tensor) -> torch.Tensor:
    """Plain SGD by hand (torch.optim would import torch._dynamo in every spawned process)."""
    params = list(model.parameters())
    write_flat_grad(params, grad_P)
    with torch.no_grad():
        for p in params:
            p.sub_(LR * p.grad)
    return torch.cat([p.detach().reshape(-1) for p in params])


def _worker(rank: int, port: int, out_dir: str) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=COLLECTIVE_TIMEOUT)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD_SIZE, timeout=COLLECTIVE_TIMEOUT)
    try:
        model = _make_model()
        params = list(model.parameters())
        acc = StreamingAccumulator(
            params, estimator="grpo", agg="token-mean", group_size=GROUP_SIZE, drop_degenerate_groups=True,
            dtype=torch.float64,
        )  # fmt: skip
        mine = [t for t in _make_trajectories() if RANK_OF_GROUP[t[0]] == rank]
        # A rank-specific arrival order, interleaving groups.
        order = torch.randperm(len(mine), generator=torch.Generator().manual_seed(10 + rank)).tolist()
        for i in order:
            group, slot, ids, mask = mine[i]
            num_tokens = int(mask.sum())
            weight = torch.full(ids.shape, token_weight("token-mean", num_tokens), dtype=torch.float64)
            h = trajectory_score_gradient(model, params, ids, mask, weight)
            acc.add_trajectory(h, num_tokens=num_tokens, group_id=group, reward=REWARDS[group][slot])
        num_units = torch.tensor([float(acc.num_units)], dtype=torch.float64)
        dist.all_reduce(num_units)
        grad, stats = acc.finish(num_units_global=float(num_units))
        dist.all_reduce(grad)
        stepped = _sgd_step(model, grad)
        result = {
            "grad": grad,
            "params": stepped,
            "num_units_global": num_units,
            "local_tokens": torch.tensor(stats.num_tokens),
        }
        torch.save(result, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def _batch_reference() -> tuple[torch.Tensor, torch.Tensor, int]:
    """Single process: one forward over the kept groups, GRPO advantages, clipped surrogate at ratio 1."""
    model = _make_model()
    rewards_GN = torch.tensor(REWARDS, dtype=torch.float64)
    adv_GN = grpo_advantages(rewards_GN)
    kept_G = ~(rewards_GN == rewards_GN[:, :1]).all(dim=1)
    batch = [t for t in _make_trajectories() if kept_G[t[0]]]
    length = max(ids.shape[0] for _, _, ids, _ in batch)
    ids_BT = torch.stack([F.pad(ids, (0, length - ids.shape[0])) for _, _, ids, _ in batch])
    mask_BT = torch.stack([F.pad(mask, (0, length - mask.shape[0])) for _, _, _, mask in batch])
    adv_BT = torch.where(mask_BT, torch.stack([adv_GN[g, s] for g, s, _, _ in batch])[:, None], 0.0)
    logits = model(input_ids=ids_BT).logits[:, :-1]
    logp_BT = F.pad(torch.log_softmax(logits, dim=-1).gather(-1, ids_BT[:, 1:, None]).squeeze(-1), (1, 0))
    num_tokens = int(mask_BT.sum())
    loss, _ = clipped_surrogate(logp_BT, logp_BT.detach(), adv_BT, mask_BT, num_tokens_global=num_tokens)
    loss.backward()
    grad = flatten_grads(list(model.parameters()))
    return grad, _sgd_step(model, grad), num_tokens


def test_two_gloo_ranks_equal_single_process_batch(tmp_path):
    # The parent owns the rendezvous store on a free port, so there is no pick-then-bind race.
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=COLLECTIVE_TIMEOUT)
    ctx = mp.get_context("spawn")
    procs = [
        ctx.Process(target=_worker, args=(rank, store.port, str(tmp_path)), name=f"streaming-dp-rank{rank}")
        for rank in range(WORLD_SIZE)
    ]
    for p in procs:
        p.start()
    try:
        for p in procs:
            p.join(timeout=150)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    assert [p.exitcode for p in procs] == [0] * WORLD_SIZE

    expected_grad, expected_params, num_tokens = _batch_reference()
    results = [torch.load(tmp_path / f"rank{rank}.pt", weights_only=True) for rank in range(WORLD_SIZE)]
    for r in results:
        assert float(r["num_units_global"]) == num_tokens
        scale = float(expected_grad.abs().max())
        assert float((r["grad"] - expected_grad).abs().max()) <= 1e-11 * max(1.0, scale)
        assert float((r["params"] - expected_params).abs().max()) <= 1e-11
    # Z counted the kept groups only, each on its own rank.
    assert int(results[0]["local_tokens"]) + int(results[1]["local_tokens"]) == num_tokens
