"""The training workloads of asyncrl/benchmarks/gpu_check.py (issue #21): the `exactness` and `throughput`
sections, the model, sample and trainer pieces they share, and the logging and error records the
harness shares with them.

gpu_check.py is the entry point (`asyncrl bench gpu-check`): it sets what cuBLAS reads before CUDA starts, imports this
module and runs the sections with its `Context` (arguments, device, budget, report); its docstring
describes what each section measures.
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import statistics
import time
import traceback
import warnings
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from gpu_check import Context

PAD = 0  # pad token id; synthetic tokens are drawn from 1 .. vocab - 1

# Dense bf16 tensor-core peaks (no sparsity), matched against the device name in this order.
PEAK_BF16_FLOPS = (
    ("H100 PCIe", 756e12),
    ("H100", 989e12),
    ("H200", 989e12),
    ("GH200", 989e12),
    ("A100", 312e12),
)
DEFAULT_PEAK = ("H100 SXM (assumed: device name not recognised)", 989e12)

# Qwen2.5-0.5B: 494M parameters with the embedding tied to the LM head.
QWEN25_05B = dict(vocab=151_936, hidden=896, intermediate=4864, layers=24, heads=14, kv_heads=2)
TINY = dict(vocab=128, hidden=64, intermediate=128, layers=2, heads=4, kv_heads=2)
DRY_THROUGHPUT = dict(vocab=512, hidden=64, intermediate=128, layers=2, heads=4, kv_heads=2)


# ----------------------------------------------------------------------------- shared helpers
def log(text: str) -> None:
    print(f"[gpu_check] {text}", flush=True)


def error_record(exc: BaseException) -> dict:
    return {"error": f"{type(exc).__name__}: {exc}"[:2000], "traceback": traceback.format_exc()[-6000:]}


def part_error(record: dict, where: str, exc: BaseException) -> None:
    """A failed part of a section (one variant): recorded, the section goes on ("partial")."""
    record.setdefault("errors", {})[where] = error_record(exc)
    log(f"  {where}: {type(exc).__name__}: {exc}")


# ----------------------------------------------------------------------------- shared pieces
def qwen2(shape: dict, *, seed: int, attn: str, device: torch.device):
    """A randomly initialised Qwen2ForCausalLM (tied embeddings, float32) built on `device`."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=shape["vocab"],
        hidden_size=shape["hidden"],
        intermediate_size=shape["intermediate"],
        num_hidden_layers=shape["layers"],
        num_attention_heads=shape["heads"],
        num_key_value_heads=shape["kv_heads"],
        max_position_embeddings=4096,
        rms_norm_eps=1e-6,
        rope_theta=1e6,
        tie_word_embeddings=True,
        use_cache=False,
        attn_implementation=attn,
    )
    torch.manual_seed(seed)
    with torch.device(device):  # initialised where it trains: no 2 GB host-to-device copy
        lm = Qwen2ForCausalLM(config)
    return lm.train()


def synthetic_groups(
    *,
    num_groups: int,
    group_size: int,
    prompt_len: int,
    completion_len: int,
    vocab: int,
    seed: int,
    ragged: bool,
):
    """GRPO groups of random tokens: half of each group rewarded 1, so every advantage is +-1.
    `ragged` draws completion lengths from [completion_len / 2, completion_len] (padding)."""
    from asyncrl.learner.step import TrainSample

    g = torch.Generator().manual_seed(seed)
    out = []
    for grp in range(num_groups):
        prompt = torch.randint(1, vocab, (prompt_len,), generator=g).tolist()
        order = torch.randperm(group_size, generator=g).tolist()
        for k in range(group_size):
            n = completion_len - (
                int(torch.randint(0, completion_len // 2 + 1, (1,), generator=g)) if ragged else 0
            )
            out.append(
                TrainSample(
                    traj_id=grp * group_size + k,
                    group_id=grp,
                    sample_index=k,
                    prompt_ids=prompt,
                    completion_ids=torch.randint(1, vocab, (n,), generator=g),
                    behavior_logprobs=torch.zeros(n),
                    token_versions=torch.zeros(n, dtype=torch.int64),
                    reward=float(order[k] % 2),
                )
            )
    return out


def with_behavior(samples, policy, *, device: torch.device, rows: int, jitter: float, seed: int):
    """The samples with behavior log-probs from `policy` (what a generator holding the same weights
    reports), lowered by up to `jitter` so that importance ratios differ from 1."""
    from asyncrl.learner.step import pack

    g = torch.Generator().manual_seed(seed)
    out = []
    with torch.no_grad():
        for i in range(0, len(samples), rows):
            part = samples[i : i + rows]
            batch = pack(part, pad_token_id=PAD, require_complete=False)
            logp_BL = policy(batch.input_ids_BL.to(device)).logp.float().cpu()
            for b, s in enumerate(part):
                logp = logp_BL[b][batch.completion_mask_BL[b]]
                logp = logp - jitter * torch.rand(logp.shape, generator=g)
                out.append(dataclasses.replace(s, behavior_logprobs=logp))
    reshard(policy)
    return out


def reshard(policy) -> None:
    """FSDP2 keeps the root unit (embedding, norm, head) gathered after a forward until the
    backward: a forward without one leaves plain full tensors registered as its parameters, and an
    optimizer built over `parameters()` then would hold those (the trainer segfaults in its finite
    check, torch 2.13). Re-shard, as a backward would."""
    if hasattr(policy, "reshard"):
        policy.reshard()


def at_version(samples, version: int):
    return [
        dataclasses.replace(s, token_versions=torch.full_like(s.token_versions, version)) for s in samples
    ]


def train_step(trainer, samples, *, step: int, num_groups: int):
    """One optimizer step as the learner's step loop drives it: trajectories offered one by one
    with a unit of work after each (a plain rank streams the members of open groups and trains a
    group as its last member arrives; lockstep ranks train complete chunks), or `batch_backward`
    (whole batch); then the update."""
    trainer.begin_step(step, window_groups=num_groups)
    if trainer.fallback:
        trainer.batch_backward(samples)
    else:
        for s in samples:
            trainer.offer(s)
            trainer.work()
        while trainer.work():
            pass
    return trainer.finish_step()


def learner_config(*sets: str):
    from asyncrl.config_load import load_config

    return load_config(overrides=list(sets))


def wrap(policy, *, device: torch.device, precision: str, checkpointing: bool, sharded: bool) -> None:
    """As `learner.loop.load_policy_model` places the policy: FSDP2 or a plain move to `device`."""
    from asyncrl.learner.parallel import parallelize

    if sharded:
        parallelize(
            policy,
            world_size=1,
            sharding="fsdp",
            mixed_precision=precision,
            cpu_offload=False,
            activation_checkpointing=checkpointing,
            device=device,
        )
        return
    if checkpointing:
        policy.lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    policy.to(device)


def peak_rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


# ----------------------------------------------------------------------------- 3. exactness
EXACT_GROUPS, EXACT_GROUP_SIZE = 4, 4
EXACT_SETS = (
    f"learner.samples_per_group={EXACT_GROUP_SIZE}",
    f"learner.groups_per_step={EXACT_GROUPS}",
    "learner.optimizer=sgd",  # the update is -lr x the clipped gradient: differences stay visible
    "learner.lr=0.1",
    "learner.logprob_chunk_size=16",  # several chunks per row: the chunked path is exercised
    "learner.max_tokens_per_microbatch=96",  # several micro-batches per lockstep chunk
)


def _exact_run(base_lm, samples, *, device, sharded, precision, checkpointing, mode):
    """One step of the tiny model from `base_lm`'s weights: (full parameters on the CPU, result)."""
    from asyncrl.learner.loop import build_trainer
    from asyncrl.learner.parallel import iter_full_state
    from asyncrl.models.policy import PolicyLM

    cfg = learner_config(
        *EXACT_SETS,
        f"learner.streaming={'auto' if mode == 'stream' else 'off'}",
        f"learner.mixed_precision={precision}",
        f"learner.sharding={'fsdp' if sharded else 'none'}",
    )
    policy = PolicyLM(copy.deepcopy(base_lm), chunk_size=cfg.learner.logprob_chunk_size)
    wrap(policy, device=device, precision=precision, checkpointing=checkpointing, sharded=sharded)
    trainer = build_trainer(cfg, policy, pad_token_id=PAD)
    result = train_step(trainer, samples, step=0, num_groups=EXACT_GROUPS)
    state = {name: t.clone() for name, t in iter_full_state(policy.lm)}
    info = {
        "loss": result.loss,
        "grad_norm": result.grad_norm,
        "lockstep": trainer.lockstep,
        "whole_batch": bool(trainer.fallback),
        "streamed": result.streamed,
        "skipped_nonfinite": result.skipped_nonfinite,
    }
    return state, info


def _diff(a: dict, b: dict) -> dict:
    """How far parameter dicts `a` and `b` are apart (same names)."""
    worst = max(float((a[k].double() - b[k].double()).abs().max()) for k in a)
    return {"bitwise_equal": all(torch.equal(a[k], b[k]) for k in a), "max_abs_param_diff": worst}


def _result_diff(a: dict, b: dict) -> dict:
    return {
        "loss_abs_diff": abs(a["loss"] - b["loss"]),
        "grad_norm_abs_diff": abs(a["grad_norm"] - b["grad_norm"]),
        "loss_and_grad_norm_bitwise": a["loss"] == b["loss"] and a["grad_norm"] == b["grad_norm"],
    }


def section_exactness(ctx: Context, rec: dict) -> None:
    from asyncrl.models.policy import PolicyLM

    cpu = torch.device("cpu")
    base = qwen2(TINY, seed=0, attn="eager", device=cpu)
    samples = synthetic_groups(
        num_groups=EXACT_GROUPS, group_size=EXACT_GROUP_SIZE, prompt_len=6, completion_len=12,
        vocab=TINY["vocab"], seed=1, ragged=True,
    )  # fmt: skip
    samples = with_behavior(samples, PolicyLM(base), device=cpu, rows=len(samples), jitter=0.1, seed=2)
    before = {k: v.detach().clone() for k, v in base.state_dict().items()}
    rec.update(model=TINY, samples=len(samples), optimizer="sgd lr 0.1", device=str(ctx.device))
    variants = {}  # name -> (device, sharded, precision, checkpointing, mode, repeats)
    for mode in ("stream", "batch"):
        variants[f"cpu_plain_fp32_{mode}"] = (cpu, False, "none", False, mode, 2)
        variants[f"device_plain_fp32_{mode}"] = (ctx.device, False, "none", False, mode, 2)
        variants[f"device_fsdp_fp32_{mode}"] = (ctx.device, True, "none", False, mode, 2)
    variants["device_fsdp_fp32_checkpointed_stream"] = (ctx.device, True, "none", True, "stream", 1)
    variants["device_fsdp_bf16_stream"] = (ctx.device, True, "bf16", False, "stream", 1)
    tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    torch.use_deterministic_algorithms(True, warn_only=True)  # a warning, not an error, where none exists
    states: dict[str, dict] = {}
    infos: dict[str, dict] = {}
    runs: dict[str, dict] = {}
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for name, (device, sharded, precision, checkpointing, mode, repeats) in variants.items():
                for r in range(repeats):
                    try:
                        state, info = _exact_run(
                            base, samples, device=device, sharded=sharded, precision=precision,
                            checkpointing=checkpointing, mode=mode,
                        )  # fmt: skip
                    except Exception as exc:  # one variant: recorded, the others still run
                        part_error(rec, f"{name}#{r}", exc)
                        break
                    if r == 0:
                        states[name], infos[name] = state, info
                    else:
                        infos[name]["repeat"] = {
                            **_diff(states[name], state),
                            **_result_diff(infos[name], info),
                        }
        rec["determinism_warnings"] = sorted(
            {str(w.message)[:300] for w in caught if "determinis" in str(w.message)}
        )
    finally:
        torch.use_deterministic_algorithms(False)
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32
    for name, info in infos.items():
        ref = f"cpu_plain_fp32_{'batch' if name.endswith('_batch') else 'stream'}"
        if name != ref and ref in states:
            info["vs_cpu"] = {**_diff(states[ref], states[name]), **_result_diff(infos[ref], info)}
            # Lockstep (FSDP2) trains a streamed step's groups batched, the plain rank per
            # trajectory: different sums, so on one CPU too they differ by float rounding.
            # Whole batches are summed alike.
            same = info["whole_batch"] or info["lockstep"] == infos[ref]["lockstep"]
            info["vs_cpu"]["same_summation"] = same
        runs[name] = info
    if "cpu_plain_fp32_stream" in states:
        ref = states["cpu_plain_fp32_stream"]
        rec["update_max_abs"] = max(float((ref[k] - before[k]).abs().max()) for k in ref)
    fp32, bf16 = "device_fsdp_fp32_stream", "device_fsdp_bf16_stream"
    if fp32 in states and bf16 in states:
        rec["bf16_vs_fp32"] = {**_diff(states[fp32], states[bf16]), **_result_diff(infos[fp32], infos[bf16])}
    device_runs = {k: v for k, v in runs.items() if k.startswith("device_")}
    rec["runs"] = runs
    fp32_runs = {k: v["vs_cpu"] for k, v in device_runs.items() if "vs_cpu" in v and "bf16" not in k}
    same = {k: v for k, v in fp32_runs.items() if v["same_summation"]}
    rec["device_vs_cpu_bitwise"] = {k: v["bitwise_equal"] for k, v in fp32_runs.items()}
    rec["device_vs_cpu_max_abs_param_diff"] = max(
        (v["max_abs_param_diff"] for v in fp32_runs.values()), default=None
    )
    rec["device_vs_cpu_same_summation_bitwise"] = {k: v["bitwise_equal"] for k, v in same.items()}
    rec["device_vs_cpu_same_summation_max_abs_param_diff"] = max(
        (v["max_abs_param_diff"] for v in same.values()), default=None
    )
    rec["repeat_bitwise"] = {k: v["repeat"]["bitwise_equal"] for k, v in runs.items() if "repeat" in v}


# ----------------------------------------------------------------------------- 4. throughput
def section_throughput(ctx: Context, rec: dict) -> None:
    from asyncrl.learner.loop import build_trainer

    a = ctx.args
    shape = DRY_THROUGHPUT if ctx.dry else QWEN25_05B
    cfg = learner_config(
        f"learner.samples_per_group={a.group_size}",
        f"learner.groups_per_step={a.groups}",
        "learner.sharding=fsdp",
        "learner.mixed_precision=bf16",
        "learner.activation_checkpointing=true",
        f"learner.max_tokens_per_microbatch={a.max_tokens_per_microbatch}",
        f"learner.logprob_chunk_size={a.chunk_size}",
        f"learner.lr={a.lr}",
    )
    policy, num_params = _throughput_model(ctx, rec, shape, chunk_size=cfg.learner.logprob_chunk_size)
    samples = _throughput_samples(ctx, rec, policy, shape, micro_batch_size=cfg.learner.micro_batch_size)
    tokens = rec["tokens_per_step"]
    completion_tokens = rec["completion_tokens_per_step"]
    peak_name, peak = _peak_flops(ctx)
    rec.update(peak_flops=peak, peak_flops_source=peak_name)
    try:
        rec["trainer"] = _time_trainer(
            ctx,
            build_trainer(cfg, policy, pad_token_id=PAD),
            samples,
            tokens,
            completion_tokens,
            num_params,
            peak,
        )
    except Exception as exc:  # the bare loop below still measures the model
        part_error(rec, "trainer", exc)
    gc.collect()
    if ctx.left_s() > 45:
        try:
            rec["bare_loop"] = _time_bare(ctx, policy, samples, tokens, num_params, peak)
        except Exception as exc:
            part_error(rec, "bare_loop", exc)
    figures = rec.get("trainer") or rec.get("bare_loop") or {}
    for key in (
        "tokens_per_s",
        "completion_tokens_per_s",
        "mfu",
        "step_s_median",
        "peak_memory_allocated_bytes",
        "peak_memory_reserved_bytes",
    ):
        if key in figures:
            rec[key] = figures[key]
    rec["figures_from"] = "trainer" if rec.get("trainer") else "bare_loop" if rec.get("bare_loop") else None


def _throughput_model(ctx: Context, rec: dict, shape: dict, *, chunk_size: int):
    """The throughput model on the device: `shape` in `PolicyLM`, wrapped in FSDP2 (bf16 compute,
    activation checkpointing); the workload's shape and the build go into `rec`. (policy, parameters)."""
    from asyncrl.models.policy import PolicyLM

    a = ctx.args
    if ctx.is_cuda:
        torch.cuda.reset_peak_memory_stats(ctx.device)
    t0 = time.monotonic()
    lm = qwen2(shape, seed=0, attn="sdpa", device=ctx.device)
    num_params = sum(p.numel() for p in lm.parameters())  # the tied embedding counted once
    policy = PolicyLM(lm, chunk_size=chunk_size)
    wrap(policy, device=ctx.device, precision="bf16", checkpointing=True, sharded=True)
    ctx.sync()
    rec.update(
        model=shape,
        num_params=num_params,
        attention="sdpa",
        groups=a.groups,
        group_size=a.group_size,
        prompt_len=a.prompt_len,
        completion_len=a.completion_len,
        max_tokens_per_microbatch=a.max_tokens_per_microbatch,
        logprob_chunk_size=a.chunk_size,
        build_s=round(time.monotonic() - t0, 2),
        memory_after_build_bytes=torch.cuda.memory_allocated(ctx.device) if ctx.is_cuda else None,
    )
    return policy, num_params


def _throughput_samples(ctx: Context, rec: dict, policy, shape: dict, *, micro_batch_size: int) -> list:
    """One step's synthetic GRPO groups with behaviour log-probs from `policy`; their token counts
    and micro-batches per step go into `rec`."""
    from asyncrl.learner.microbatch import split_microbatches

    a = ctx.args
    samples = synthetic_groups(
        num_groups=a.groups, group_size=a.group_size, prompt_len=a.prompt_len,
        completion_len=a.completion_len, vocab=shape["vocab"], seed=3, ragged=False,
    )  # fmt: skip
    t0 = time.monotonic()
    samples = with_behavior(samples, policy, device=ctx.device, rows=a.group_size, jitter=0.0, seed=4)
    rec["behavior_logprobs_s"] = round(time.monotonic() - t0, 2)
    rec.update(
        tokens_per_step=sum(len(s.prompt_ids) + len(s.completion_ids) for s in samples),
        completion_tokens_per_step=sum(len(s.completion_ids) for s in samples),
        microbatches_per_step=len(
            split_microbatches(samples, max_seqs=micro_batch_size, max_tokens=a.max_tokens_per_microbatch)
        ),
    )
    return samples


def _peak_flops(ctx: Context) -> tuple[str, float]:
    if not ctx.is_cuda:
        return "H100 SXM bf16 dense (dry run on CPU: the MFU figure means nothing)", 989e12
    name = torch.cuda.get_device_name(ctx.device)
    for key, flops in PEAK_BF16_FLOPS:
        if key in name:
            return f"{key} bf16 dense", flops
    return DEFAULT_PEAK


def _timed_steps(ctx: Context, one_step, *, warmup: int, steps: int) -> tuple[list[float], list[float]]:
    """(warm-up step seconds, timed step seconds); peak memory is reset after the warm-up. Timed
    steps stop early when the budget runs short (at least one is timed)."""
    warm, timed = [], []
    for k in range(warmup + steps):
        if k == warmup and ctx.is_cuda:
            torch.cuda.reset_peak_memory_stats(ctx.device)
        ctx.sync()
        t0 = time.perf_counter()
        one_step(k)
        ctx.sync()
        (warm if k < warmup else timed).append(time.perf_counter() - t0)
        log(f"  step {k}: {(warm + timed)[-1]:.3f} s")
        if k >= warmup and ctx.left_s() < 25:
            break
    return warm, timed


def _figures(ctx: Context, timed: list[float], tokens: int, num_params: int, peak: float) -> dict:
    median = statistics.median(timed)
    out = {
        "step_s": [round(t, 4) for t in timed],
        "step_s_median": median,
        "tokens_per_s": tokens / median,
        "mfu": 6 * num_params * tokens / median / peak,
    }
    if ctx.is_cuda:
        out.update(
            peak_memory_allocated_bytes=torch.cuda.max_memory_allocated(ctx.device),
            peak_memory_reserved_bytes=torch.cuda.max_memory_reserved(ctx.device),
        )
    else:
        out["peak_rss_bytes"] = peak_rss_bytes()
    return out


def _time_trainer(ctx, trainer, samples, tokens, completion_tokens, num_params, peak) -> dict:
    a = ctx.args
    by_step = [at_version(samples, k) for k in range(a.warmup_steps + a.steps)]
    results = []

    def one_step(k: int) -> None:
        results.append(train_step(trainer, by_step[k], step=k, num_groups=a.groups))

    warm, timed = _timed_steps(ctx, one_step, warmup=a.warmup_steps, steps=a.steps)
    out = _figures(ctx, timed, tokens, num_params, peak)
    last = results[-1]
    out.update(
        warmup_step_s=[round(t, 4) for t in warm],
        completion_tokens_per_s=completion_tokens / out["step_s_median"],
        lockstep=trainer.lockstep,
        whole_batch=bool(trainer.fallback),
        last_step={"loss": last.loss, "grad_norm": last.grad_norm, "num_tokens": last.num_tokens,
                   "clip_fraction": last.clip_fraction, "skipped_nonfinite": last.skipped_nonfinite},
    )  # fmt: skip
    if any(r.skipped_nonfinite for r in results):
        ctx.finding("throughput: a step was skipped as non-finite (bf16 on a random model?)")
    return out


def _time_bare(ctx, policy, samples, tokens, num_params, peak) -> dict:
    """The same micro-batches through forward, backward and AdamW, no trainer: a reference for the
    trainer's own cost (packing, corrections, host syncs)."""
    from asyncrl.learner.microbatch import split_microbatches
    from asyncrl.learner.step import pack

    a = ctx.args
    parts = split_microbatches(samples, max_seqs=256, max_tokens=a.max_tokens_per_microbatch)
    batches = [pack([samples[i] for i in part], pad_token_id=PAD).to(ctx.device) for part in parts]
    reshard(policy)  # the trainer may have failed between a forward and its backward
    optimizer = torch.optim.AdamW(policy.parameters(), lr=a.lr, betas=(0.9, 0.99))

    def one_step(k: int) -> None:
        for batch in batches:
            logp_BL = policy(batch.input_ids_BL).logp
            adv_B = (batch.reward_B.to(ctx.device) - 0.5) * 2
            loss = -torch.where(batch.completion_mask_BL, logp_BL * adv_B[:, None], 0.0).sum() / tokens
            loss.backward()
        torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    warm, timed = _timed_steps(ctx, one_step, warmup=1, steps=min(a.steps, 4))
    return {**_figures(ctx, timed, tokens, num_params, peak), "warmup_step_s": [round(t, 4) for t in warm]}
