"""The staleness corrections on two lockstep learner ranks (FSDP2, gloo) equal one plain rank on
the same trajectories: M2PO's mask, VCPO's ESS and learning-rate scale (batch-global statistics
taken over the whole batch across ranks), VCPO's optimal baseline (each trajectory's gradient
norm from the batched backward of its rank, summed over the ranks), PPO-EWMA and the exact old log-probs (weight copies
sharded like the model), and a KL-to-reference loss (a sharded reference). Several steps, each
with trajectories stale by up to one version, plain SGD so the parameters read out the updates;
compared: the parameters after every step and each step's statistics (masked fraction, ESS, lr
scale, loss, gradient norm).

Before this test these configurations were refused at load with learner.world_size > 1."""

from __future__ import annotations

import datetime
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from asyncrl.learner.step import TrainSample

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

WORLD_SIZE = 2
STEPS = 3
GROUPS = 5  # odd: the ranks hold different numbers of rows
GROUP_SIZE = 4
CASES = {
    "m2po": ["staleness.policy=m2po", "staleness.params.tau=0.004"],
    "vcpo": ["staleness.policy=vcpo"],
    "vcpo_opob": ["staleness.policy=vcpo", "staleness.vcpo_baseline=opob"],
    "vcpo_opob_released": ["staleness.policy=vcpo", "staleness.vcpo_baseline=opob_released"],
    "ewma": ["staleness.policy=ewma"],
    "exact": ["staleness.policy=exact"],
    "kl_loss": ["learner.kl_coef=0.5"],
}
BATCH_GLOBAL = (
    "m2po",
    "vcpo",
    "vcpo_opob",
    "vcpo_opob_released",
)  # their ESS is the whole batch's (the others' is per chunk)
STATS = ("masked_fraction", "ess_ratio", "kl")  # means over the batch (counts are per chunk)


def _samples(model, step: int, *, seed: int) -> list[TrainSample]:
    """Groups of random completions whose behaviour log-probs are the model's own, shifted for
    about half of them as an older version's would be (tokens of version step - 1)."""
    from asyncrl.kernels.logprobs import causal_lm_logprobs

    g = torch.Generator().manual_seed(seed * 100 + step)
    out = []
    for grp in range(GROUPS):
        prompt = [1] + torch.randint(4, 20, (3 + grp % 3,), generator=g).tolist()
        for k in range(GROUP_SIZE):
            n = 2 + int(torch.randint(0, 5, (1,), generator=g))
            ids = torch.randint(4, 20, (n,), generator=g)
            with torch.no_grad():
                logp = causal_lm_logprobs(model, torch.tensor([prompt + ids.tolist()])).logp[0, len(prompt) :]
            stale = step > 0 and float(torch.rand(1, generator=g)) < 0.5
            # The inference engine's own numerics, then staleness: every ratio clearly off 1 (a
            # ratio of exactly 1 up to float noise would put M2PO's candidate set at the mercy
            # of the last bit, on one rank as on two).
            logp = logp + 0.05 * (2 * torch.rand(n, generator=g) - 1)
            if stale:
                logp = logp - 0.4 * torch.rand(n, generator=g)
            out.append(
                TrainSample(
                    traj_id=1000 * step + grp * GROUP_SIZE + k,
                    group_id=100 * step + grp,
                    sample_index=k,
                    prompt_ids=prompt,
                    completion_ids=ids,
                    behavior_logprobs=logp.float(),
                    token_versions=torch.full((n,), step - 1 if stale else step, dtype=torch.int64),
                    reward=float(torch.randint(0, 2, (1,), generator=g)),
                )
            )
    return out


def _trainer(actor, sets, world_size):
    from asyncrl.config_load import load_config
    from asyncrl.learner.loop import build_trainer

    cfg = load_config(
        overrides=[
            f"learner.samples_per_group={GROUP_SIZE}",
            "staleness.max_staleness=2",
            "learner.optimizer=sgd",
            "learner.lr=0.5",
            "learner.max_grad_norm=1000",
            "learner.threads=1",
            f"learner.world_size={world_size}",
            *(["learner.sharding=fsdp"] if world_size > 1 else []),
            *sets,
        ]
    )
    return build_trainer(cfg, actor, pad_token_id=0)


def _run(model_dir: str, sets: list[str], world_size: int) -> dict:
    """STEPS steps of `sets` on this process's rank; the full parameters after each and the stats."""
    from transformers import AutoModelForCausalLM

    from asyncrl.learner.parallel import iter_full_state, parallelize
    from asyncrl.models.policy import PolicyLM

    torch.manual_seed(0)
    lm = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    behaviour = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    actor = PolicyLM(lm)
    if world_size > 1:
        parallelize(
            actor, world_size=world_size, sharding="fsdp", mixed_precision="none", cpu_offload=False,
            activation_checkpointing=False, device=torch.device("cpu"),
        )  # fmt: skip
    trainer = _trainer(actor, sets, world_size)
    out = {"params": [], "steps": []}
    for step in range(STEPS):
        samples = _samples(behaviour, step, seed=1)
        trainer.begin_step(step, window_groups=GROUPS)
        if trainer.fallback:
            trainer.batch_backward(samples)
        else:
            for s in samples:
                trainer.offer(s)
                while trainer.work():
                    pass
        result = trainer.finish_step()
        out["steps"].append(
            {"stats": dict(result.policy_stats), "lr_scale": result.lr_scale, "loss": result.loss,
             "grad_norm": result.grad_norm, "fallback": result.fallback}
        )  # fmt: skip
        out["params"].append({k: v.clone() for k, v in iter_full_state(lm)})
        # The behaviour model follows the learner (tokens of the next step are its own).
        behaviour.load_state_dict(out["params"][-1])
    return out


def _rank(rank: int, port: int, model_dir: str, out_path: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD_SIZE, timeout=datetime.timedelta(seconds=300))
    try:
        results = {name: _run(model_dir, sets, WORLD_SIZE) for name, sets in CASES.items()}
        if rank == 0:
            torch.save(results, out_path)
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def two_ranks(tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("ranks") / "two.pt"
    mp.spawn(_rank, args=(_free_port(), str(tiny_model_dir), str(out)), nprocs=WORLD_SIZE, join=True)
    return torch.load(out, weights_only=False)


@pytest.mark.parametrize("name", sorted(CASES))
def test_two_fsdp_ranks_equal_one_rank(two_ranks, tiny_model_dir, name):
    one = _run(str(tiny_model_dir), CASES[name], 1)
    two = two_ranks[name]
    moved = False
    for step, (a, b) in enumerate(zip(one["params"], two["params"], strict=True)):
        for k in a:
            torch.testing.assert_close(
                b[k], a[k], rtol=0, atol=1e-6, msg=lambda m, step=step, k=k: f"step {step}: {k}: {m}"
            )
        moved |= step > 0 and any(not torch.equal(a[k], one["params"][step - 1][k]) for k in a)
    assert moved  # the steps really changed the weights
    for step, (a, b) in enumerate(zip(one["steps"], two["steps"], strict=True)):
        assert b["lr_scale"] == pytest.approx(a["lr_scale"], rel=1e-6, abs=1e-9), step
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5, abs=1e-7), step
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5), step
        for key in STATS:
            if key in a["stats"] and (key != "ess_ratio" or name in BATCH_GLOBAL):
                assert b["stats"][key] == pytest.approx(a["stats"][key], rel=1e-6, abs=1e-7, nan_ok=True), (
                    step,
                    key,
                )
    if name == "m2po":  # the mask bound somewhere, and each step's fraction agreed (above)
        assert any(s["stats"]["masked_fraction"] > 0 for s in one["steps"])
    if name.startswith("vcpo"):
        assert any(s["lr_scale"] < 1.0 for s in one["steps"])
    if "opob" in name:  # each trajectory's norm from a batched backward, on 1 rank as on 2
        assert all("in one backward" in s["fallback"] for s in one["steps"] + two["steps"])
