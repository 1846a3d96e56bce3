"""The learner on one GPU, checked in one run (issue #21): throughput, memory and exactness.

    python bench/gpu_check.py --out OUT                # on a CUDA machine; < 8 minutes on an H100
    python bench/gpu_check.py --out OUT --cpu-dry-run  # the same code paths on CPU, tiny models

Writes OUT/gpu_check.json (rewritten after every section, so a run cut short keeps what it
measured) and prints a short summary. Sections, in the order they run:

1. `environment`: torch, CUDA, cuDNN, NCCL and transformers versions; device name, bf16 support,
   free memory.
2. `process_group`: the learner's single-rank group (`parallel.init_single_rank_group`: NCCL on a
   GPU) and whether it can all-reduce the CPU tensors the lockstep trainer reduces (micro-batch
   counts, step sums, the finite-parameter check). If it cannot, the finding is recorded and the
   rest of the run uses a group with gloo for CPU tensors and NCCL for CUDA ones.
3. `exactness`: a tiny Qwen2 (2 layers, width 64, vocabulary 128, float32, eager attention) trains
   the same batch for one step (SGD, so the update is a readout of the gradient) with the real
   `Trainer`: on CPU unwrapped (the default CPU path), then on the device unwrapped and FSDP2
   (float32, with and without activation checkpointing, then bf16), in streaming and whole-batch
   modes. Reported: the largest parameter difference from the CPU path and whether it is bitwise,
   the loss and gradient-norm differences, whether two runs on the device are bitwise equal
   (`torch.use_deterministic_algorithms(True, warn_only=True)`, CUBLAS_WORKSPACE_CONFIG set
   before CUDA starts, TF32 off), and bf16 vs float32.
4. `throughput`: a Qwen2.5-0.5B-shaped model (random init, no download) wrapped in `PolicyLM` and
   FSDP2 (bf16 compute, float32 master weights, activation checkpointing) trains synthetic GRPO
   groups through the `Trainer` (lockstep steps, micro-batches by
   `learner.max_tokens_per_microbatch`). After warm-up steps: step time (median), tokens/s (prompt
   + completion tokens through forward and backward), completion tokens/s, MFU = 6 x parameters x
   tokens/s / peak (attention FLOPs and the checkpointing recompute not counted; the peak used is
   in the report), peak memory allocated and reserved. Then the same model trained by a bare
   forward/backward/AdamW loop, without the trainer: its overhead, or figures when it failed.
5. `e2e`: the default job on the device (`asyncrl launch` with every device set to cuda), with what
   is left of the budget as its timeout; eval_before/eval_after from its summary.json.

Robustness: each section records its error and traceback and the run goes on; a section starts
only with enough of `--budget-s` left; a watchdog writes the report and exits if the run
overshoots the budget by `WATCHDOG_GRACE_S` (a hung collective, say). The exit status is 1 when a
section failed, else 0.
"""

from __future__ import annotations

import os

# cuBLAS reads this when it creates its first handle: it must be set before CUDA starts, or the
# exactness section's repeat runs may differ in their GEMM reductions.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import argparse  # noqa: E402
import copy  # noqa: E402
import dataclasses  # noqa: E402
import faulthandler  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import signal  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
import warnings  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run as a script from anywhere, without an installed asyncrl

SECTIONS = ("environment", "process_group", "exactness", "throughput", "e2e")
# Seconds of budget a section needs to start at all (it also stops its own loops in time).
MIN_START_S = {"environment": 0, "process_group": 0, "exactness": 30, "throughput": 60, "e2e": 60}
WATCHDOG_GRACE_S = 45.0  # past the budget: write the report and exit (8 minutes at the default 420)
GROUP_TIMEOUT_S = 60.0  # a collective of one rank that takes longer is stuck
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


# ----------------------------------------------------------------------------- the report
class Report:
    """The JSON report, rewritten whole (atomically) after every section and by the watchdog."""

    def __init__(self, path: Path, meta: dict) -> None:
        self.path = path
        self.data: dict = {"meta": meta, "findings": [], "sections": {}}
        self.lock = threading.Lock()

    def write(self) -> None:
        with self.lock:
            for _ in range(3):  # the watchdog may write while the main thread edits a section
                try:
                    text = json.dumps(self.data, indent=2, default=str)
                    break
                except RuntimeError:
                    time.sleep(0.05)
            else:
                return
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(text)
            os.replace(tmp, self.path)


class Context:
    """What the sections share: arguments, device, deadline, report, the e2e child."""

    def __init__(self, args: argparse.Namespace, report: Report) -> None:
        self.args = args
        self.report = report
        self.dry = args.cpu_dry_run
        self.start = time.monotonic()
        self.deadline = self.start + args.budget_s
        self.device = torch.device("cpu")
        self.child: subprocess.Popen | None = None
        self.section = ""

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    def left_s(self) -> float:
        return self.deadline - time.monotonic()

    def sync(self) -> None:
        if self.is_cuda:
            torch.cuda.synchronize()

    def finding(self, text: str) -> None:
        self.report.data["findings"].append(text)
        log(f"FINDING: {text}")


def log(text: str) -> None:
    print(f"[gpu_check] {text}", flush=True)


def error_record(exc: BaseException) -> dict:
    return {"error": f"{type(exc).__name__}: {exc}"[:2000], "traceback": traceback.format_exc()[-6000:]}


def start_watchdog(ctx: Context) -> threading.Timer:
    def overrun() -> None:
        ctx.report.data["meta"]["watchdog"] = (
            f"budget {ctx.args.budget_s:.0f} s + {WATCHDOG_GRACE_S:.0f} s passed in section {ctx.section!r}; "
            "stacks of every thread are on stderr"
        )
        ctx.report.data["sections"].setdefault(ctx.section, {})["status"] = "error"
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        stop_child(ctx)
        ctx.report.write()
        os._exit(3)

    timer = threading.Timer(ctx.args.budget_s + WATCHDOG_GRACE_S, overrun)
    timer.daemon = True
    timer.start()
    return timer


def run_section(ctx: Context, name: str, fn) -> None:
    sections = ctx.report.data["sections"]
    if name not in ctx.args.sections:
        sections[name] = {"status": "skipped", "reason": "not selected (--sections)"}
        return
    if ctx.left_s() < MIN_START_S[name]:
        sections[name] = {"status": "skipped", "reason": f"budget: {ctx.left_s():.0f} s left"}
        log(f"{name}: skipped ({ctx.left_s():.0f} s of budget left)")
        ctx.report.write()
        return
    if name != "environment" and not ctx.dry and not ctx.is_cuda:
        sections[name] = {"status": "error", "error": "no CUDA device (see the environment section)"}
        ctx.report.write()
        return
    ctx.section = name
    record: dict = {"status": "running"}
    sections[name] = record
    log(f"{name}: start ({ctx.left_s():.0f} s of budget left)")
    begin = time.monotonic()
    try:
        fn(ctx, record)
        record["status"] = "partial" if record.get("errors") else "ok"
    except Exception as exc:  # one failed section must not cost the others their GPU time
        record.update(error_record(exc), status="error")
    record["seconds"] = round(time.monotonic() - begin, 2)
    gc.collect()
    if ctx.is_cuda:
        torch.cuda.empty_cache()
    log(
        f"{name}: {record['status']} in {record['seconds']:.1f} s"
        + (f": {record['error']}" if "error" in record else "")
    )
    ctx.report.write()


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
    from asyncrl.config import load_config

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


# ----------------------------------------------------------------------------- 1. environment
def section_environment(ctx: Context, rec: dict) -> None:
    import transformers

    rec.update(
        python=platform.python_version(),
        torch=torch.__version__,
        transformers=transformers.__version__,
        torch_cuda=torch.version.cuda,
        cuda_available=torch.cuda.is_available(),
        cpu_count=os.cpu_count(),
        cublas_workspace_config=os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
        git_head=_git_head(),
    )
    if ctx.dry:
        rec["device"] = "cpu (dry run)"
        return
    if not torch.cuda.is_available():
        raise RuntimeError("no CUDA device is visible (use --cpu-dry-run to test the script on CPU)")
    from asyncrl.learner.parallel import resolve_device

    ctx.device = resolve_device("cuda")
    rec["device"] = torch.cuda.get_device_name(ctx.device)
    facts = {  # each on its own: one missing attribute must not lose the rest (or the device)
        "device_count": torch.cuda.device_count,
        "capability": lambda: ".".join(map(str, torch.cuda.get_device_capability(ctx.device))),
        "multiprocessors": lambda: torch.cuda.get_device_properties(ctx.device).multi_processor_count,
        "bf16_supported": torch.cuda.is_bf16_supported,
        "memory_free_total_bytes": lambda: torch.cuda.mem_get_info(ctx.device),
        "cudnn": torch.backends.cudnn.version,
        "nccl": lambda: str(torch.cuda.nccl.version()),
    }
    for key, fact in facts.items():
        try:
            rec[key] = fact()
        except Exception as exc:  # recorded in place of the value
            rec[key] = f"unavailable: {type(exc).__name__}: {exc}"[:300]


def _git_head() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


# ----------------------------------------------------------------------------- 2. process group
def section_process_group(ctx: Context, rec: dict) -> None:
    import datetime

    from asyncrl.learner.parallel import backend_for, init_single_rank_group

    rec["learner_backend"] = backend_for(ctx.device)
    try:
        init_single_rank_group(ctx.device, GROUP_TIMEOUT_S)
        # What the lockstep trainer reduces on the host: micro-batch counts, step sums (float64).
        dist.all_reduce(torch.ones(2, dtype=torch.float64))
        rec["cpu_tensor_all_reduce"] = "ok"
    except Exception as exc:  # the finding itself: recorded, then a group that can do both
        rec["cpu_tensor_all_reduce"] = f"{type(exc).__name__}: {exc}"[:1000]
        if not ctx.is_cuda:
            raise  # on CPU the learner's group is gloo: nothing to fall back to
        ctx.finding(
            f"the learner's {rec['learner_backend']!r} process group cannot all-reduce CPU tensors "
            "(Trainer.microbatches, finish_step and _all_finite do); this run goes on with "
            "'cpu:gloo,cuda:nccl' (what parallel.backend_for could return for CUDA)"
        )
        if dist.is_initialized():
            dist.destroy_process_group()
        timeout = datetime.timedelta(seconds=GROUP_TIMEOUT_S)
        dist.init_process_group(
            "cpu:gloo,cuda:nccl", store=dist.HashStore(), rank=0, world_size=1, timeout=timeout
        )
        dist.all_reduce(torch.ones(2, dtype=torch.float64))
    if ctx.is_cuda:
        dist.all_reduce(torch.ones(2, device=ctx.device))  # what FSDP2 does: NCCL
        ctx.sync()
    rec["backend_used"] = str(dist.get_backend())


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
    from asyncrl.learner.microbatch import split_microbatches
    from asyncrl.models.policy import PolicyLM

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
    if ctx.is_cuda:
        torch.cuda.reset_peak_memory_stats(ctx.device)
    t0 = time.monotonic()
    lm = qwen2(shape, seed=0, attn="sdpa", device=ctx.device)
    num_params = sum(p.numel() for p in lm.parameters())  # the tied embedding counted once
    policy = PolicyLM(lm, chunk_size=cfg.learner.logprob_chunk_size)
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
    samples = synthetic_groups(
        num_groups=a.groups, group_size=a.group_size, prompt_len=a.prompt_len,
        completion_len=a.completion_len, vocab=shape["vocab"], seed=3, ragged=False,
    )  # fmt: skip
    t0 = time.monotonic()
    samples = with_behavior(samples, policy, device=ctx.device, rows=a.group_size, jitter=0.0, seed=4)
    rec["behavior_logprobs_s"] = round(time.monotonic() - t0, 2)
    tokens = sum(len(s.prompt_ids) + len(s.completion_ids) for s in samples)
    completion_tokens = sum(len(s.completion_ids) for s in samples)
    rec.update(
        tokens_per_step=tokens,
        completion_tokens_per_step=completion_tokens,
        microbatches_per_step=len(
            split_microbatches(
                samples, max_seqs=cfg.learner.micro_batch_size, max_tokens=a.max_tokens_per_microbatch
            )
        ),
    )
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


# ----------------------------------------------------------------------------- 5. e2e
def section_e2e(ctx: Context, rec: dict) -> None:
    out_dir = ctx.args.out / "runs"
    device = "cpu" if ctx.dry else "cuda"
    sets = [
        "monitor.tui=false",
        f'run.out_dir="{out_dir}"',
        'run.name="gpu_check"',
        f"learner.device={device}",
        f"generators.device={device}",
        f"task.eval_device={device}",
    ]
    if ctx.dry:  # the default job, shortened: the dry run checks the plumbing, not learning
        sets += ["learner.steps=2", "learner.groups_per_step=2", "learner.samples_per_group=4",
                 "sampling.max_new_tokens=4", "task.num_eval=8"]  # fmt: skip
    cmd = [sys.executable, "-m", "asyncrl", "launch"]
    for s in sets:
        cmd += ["--set", s]
    # The job's processes import this checkout's asyncrl, installed or not.
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    }
    timeout_s = max(10.0, min(ctx.args.e2e_timeout_s, ctx.left_s() - 15))
    rec.update(command=cmd, timeout_s=timeout_s)
    log_path = ctx.args.out / "e2e.log"
    t0 = time.monotonic()
    with open(log_path, "w") as log_f:
        # Its own session: on a timeout the launcher and every process it started are stopped.
        ctx.child = subprocess.Popen(
            cmd, cwd=REPO, env=env, stdout=log_f, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            code = ctx.child.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            code = None
            stop_child(ctx)
        ctx.child = None
    rec["wall_s"] = round(time.monotonic() - t0, 2)
    rec["exit_code"] = code
    rec["log_tail"] = log_path.read_text(errors="replace")[-3000:]
    if code is None:
        raise TimeoutError(f"asyncrl launch did not finish in {timeout_s:.0f} s (log: {log_path})")
    if code != 0:
        raise RuntimeError(f"asyncrl launch exited with {code} (log: {log_path})")
    found = sorted(out_dir.glob("*/summary.json"), key=lambda p: p.stat().st_mtime)
    if not found:
        raise RuntimeError(f"no summary.json under {out_dir}")
    summary = json.loads(found[-1].read_text())
    keys = ("eval_before", "eval_after", "wall_s", "samples_per_s", "tokens_per_s", "policy_versions",
            "trajectories_trained", "trajectories_lost", "max_staleness")  # fmt: skip
    rec["summary"] = {k: summary.get(k) for k in keys}
    rec["summary_path"] = str(found[-1])


def stop_child(ctx: Context) -> None:
    """Stop the e2e job this script started: its session, by the leader's process group id."""
    child = ctx.child
    if child is None or child.poll() is not None:
        return
    for sig, wait_s in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(child.pid, sig)
        except ProcessLookupError:
            return
        try:
            child.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


# ----------------------------------------------------------------------------- main
def _g(x, scale: float = 1.0, fmt: str = ".3g") -> str:
    return "n/a" if not isinstance(x, (int, float)) else format(x * scale, fmt)


def _all(flags: dict | None) -> str:
    return "n/a" if not flags else str(all(flags.values()))


def summary_lines(report: dict) -> list[str]:
    s = report["sections"]
    env, pg, ex, tp = (s.get(n, {}) for n in ("environment", "process_group", "exactness", "throughput"))
    e2e = s.get("e2e", {}).get("summary") or {}
    detail = {
        "environment": f"{env.get('device')}, torch {env.get('torch')}, CUDA {env.get('torch_cuda')}",
        "process_group": f"backend {pg.get('backend_used')}; CPU all-reduce on the learner's group: "
        f"{pg.get('cpu_tensor_all_reduce')}",
        "exactness": "device vs CPU, same summation: bitwise "
        f"{_all(ex.get('device_vs_cpu_same_summation_bitwise'))}, max |dparam| "
        f"{_g(ex.get('device_vs_cpu_same_summation_max_abs_param_diff'))}; every path: max |dparam| "
        f"{_g(ex.get('device_vs_cpu_max_abs_param_diff'))} (an update: {_g(ex.get('update_max_abs'))}); "
        f"repeats bitwise {_all(ex.get('repeat_bitwise'))}; bf16 vs fp32 max |dparam| "
        f"{_g(ex.get('bf16_vs_fp32', {}).get('max_abs_param_diff'))}",
        "throughput": f"{tp.get('figures_from')}: {_g(tp.get('tokens_per_s'), fmt='.0f')} tokens/s, MFU "
        f"{_g(tp.get('mfu'), 100, '.1f')}% of {_g(tp.get('peak_flops'), 1e-12, '.0f')} TFLOP/s, step "
        f"{_g(tp.get('step_s_median'), fmt='.3f')} s, peak {_g(tp.get('peak_memory_allocated_bytes'), 2**-30, '.2f')}"
        f" GiB allocated / {_g(tp.get('peak_memory_reserved_bytes'), 2**-30, '.2f')} GiB reserved",
        "e2e": f"eval {e2e.get('eval_before')} -> {e2e.get('eval_after')} in {_g(e2e.get('wall_s'), fmt='.0f')} s",
    }
    lines = []
    for name in SECTIONS:
        rec = s.get(name, {})
        status = rec.get("status", "missing")
        lines.append(f"{name}: {status}" + (f" ({detail[name]})" if status in ("ok", "partial") else ""))
        if "error" in rec:
            lines.append(f"  error: {rec['error'][:300]}")
        for where, err in rec.get("errors", {}).items():
            lines.append(f"  {where} error: {err['error'][:300]}")
    return lines + [f"finding: {f}" for f in report["findings"]]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--out", type=Path, required=True, help="directory for gpu_check.json, e2e.log and runs/")
    p.add_argument("--cpu-dry-run", action="store_true", help="run every section on CPU with tiny models")
    p.add_argument(
        "--budget-s", type=float, default=420.0, help="wall-clock budget; the watchdog fires 45 s after it"
    )
    p.add_argument(
        "--sections", default=",".join(SECTIONS), help=f"comma-separated subset of {','.join(SECTIONS)}"
    )
    p.add_argument("--groups", type=int, default=None, help="throughput: groups per step (8; dry run 2)")
    p.add_argument(
        "--group-size", type=int, default=None, help="throughput: samples per group (8; dry run 4)"
    )
    p.add_argument("--prompt-len", type=int, default=None, help="throughput: prompt tokens (128; dry run 8)")
    p.add_argument(
        "--completion-len", type=int, default=None, help="throughput: completion tokens (512; dry run 24)"
    )
    p.add_argument("--warmup-steps", type=int, default=None, help="throughput: untimed steps (2; dry run 1)")
    p.add_argument("--steps", type=int, default=None, help="throughput: timed steps (6; dry run 2)")
    p.add_argument(
        "--max-tokens-per-microbatch", type=int, default=16384, help="learner.max_tokens_per_microbatch"
    )
    p.add_argument("--chunk-size", type=int, default=1024, help="learner.logprob_chunk_size")
    p.add_argument("--lr", type=float, default=1e-5, help="throughput: learner.lr (AdamW)")
    p.add_argument("--e2e-timeout-s", type=float, default=240.0, help="most the default job may take")
    args = p.parse_args(argv)
    dry = args.cpu_dry_run
    for name, full, small in (("groups", 8, 2), ("group_size", 8, 4), ("prompt_len", 128, 8),
                              ("completion_len", 512, 24), ("warmup_steps", 2, 1), ("steps", 6, 2)):  # fmt: skip
        if getattr(args, name) is None:
            setattr(args, name, small if dry else full)
    args.sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = sorted(set(args.sections) - set(SECTIONS))
    if unknown:
        p.error(f"unknown sections {unknown}; choose from {','.join(SECTIONS)}")
    args.out = args.out.resolve()
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    faulthandler.enable()  # a crash in native code still leaves a Python stack on stderr
    meta = {
        "script": "bench/gpu_check.py",
        "argv": sys.argv[1:] if argv is None else argv,
        "cpu_dry_run": args.cpu_dry_run,
        "budget_s": args.budget_s,
        "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "finished": False,
    }
    report = Report(args.out / "gpu_check.json", meta)
    ctx = Context(args, report)
    watchdog = start_watchdog(ctx)
    try:
        for name, fn in (
            ("environment", section_environment),
            ("process_group", section_process_group),
            ("exactness", section_exactness),
            ("throughput", section_throughput),
            ("e2e", section_e2e),
        ):
            run_section(ctx, name, fn)
    finally:
        watchdog.cancel()
        stop_child(ctx)
        try:
            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception as exc:  # the figures are in; a teardown failure is only noted
            meta["teardown_error"] = f"{type(exc).__name__}: {exc}"[:1000]
    meta.update(finished=True, wall_s=round(time.monotonic() - ctx.start, 2))
    report.write()
    for line in summary_lines(report.data):
        log(line)
    log(f"report: {report.path}")
    failed = [n for n, r in report.data["sections"].items() if r.get("status") in ("error", "partial")]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
