"""`asyncrl bench learner`: the learner's memory, measured. Two figures, side by side in one run:

1. **The log-prob path at a large vocabulary** (151,936, Qwen2's). One training forward and
   backward of `--tokens` predicted tokens through a one-block Qwen2 model, three ways:
   `PolicyLM` (the learner's forward: the LM head applied `--chunk-size` tokens at a time, fused
   backward), `PolicyLM` with N = 4 distillation candidates, and the unchunked reference
   (`causal_lm_logprobs` on the model's full [B, L, V] logits). Reported: the peak bytes of live
   tensors allocated during the step (`PeakTensorBytes`: every op's output storage, counted until
   it is freed; kernels' internal scratch is not seen), and the largest single tensor, next to
   the [tokens, V] float32 logits' size. The chunked peak is a few [chunk, V] buffers whatever the
   token count; the full path's is several [tokens, V] tensors.
2. **Peak resident memory per learner rank** for one training step (forward, backward, AdamW
   step, float32) of a Qwen2-architecture model of about 100M parameters built from a config (no
   download), on 1 rank unsharded vs 2 ranks FSDP2 (`learner.parallel.parallelize`, gloo on
   127.0.0.1). Each rank is a fresh process (`python -m asyncrl.benchmarks.learner --rank-spec ...`)
   and reports its peak RSS (VmHWM: the whole process, imports, model build, step); the global batch
   (`--seqs` x `--seq-len`) is the same, split over the ranks as the learner splits a step.
   Reported: each rank's peak, the ratio of the 2-rank per-rank peak (the larger) to the 1-rank
   peak, the same net of the memory a rank holds after its imports, and the step's loss and
   gradient norm from both layouts (equal to float tolerance: the same gradient).
   Children run with a fixed glibc mmap threshold, so freed large tensors go back to the system
   (by default glibc raises the threshold to the largest freed block, up to 32 MiB, and keeps
   later frees of that size in its heap: RSS would then count memory the process no longer uses).

    asyncrl bench learner             # ~1-2 minutes on 2 cores; --json for every figure
    asyncrl bench learner --quick     # small sizes (tests)

Importing this module is cheap: torch and transformers load when the command runs.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Annotated, Any

import typer

QWEN2_VOCAB = 151_936
# Children's glibc: mmap every allocation from 128 KiB up and return it on free (see docstring).
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "131072", "MALLOC_TRIM_THRESHOLD_": "131072"}
RESULT_PREFIX = "LEARNER_BENCH_RESULT "
_MB = 1 << 20

# Model shapes: ~100M parameters (12 Qwen2 blocks of width 768, 32k vocabulary, tied embeddings,
# as Qwen2's small models) and a small one for --quick.
FULL_MODEL = {"vocab": 32_000, "hidden": 768, "intermediate": 2048, "layers": 12, "heads": 12, "kv_heads": 4}
QUICK_MODEL = {"vocab": 4096, "hidden": 128, "intermediate": 256, "layers": 2, "heads": 4, "kv_heads": 2}


# ----------------------------------------------------------------------------- measuring
@functools.cache
def _tracker_class() -> type:
    import torch
    from torch.multiprocessing.reductions import StorageWeakRef
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    def storages(tree: object) -> list:
        leaves = tree_flatten(tree)[0]
        return [t.untyped_storage() for t in leaves if isinstance(t, torch.Tensor) and not t.is_meta]

    class PeakTensorBytes(TorchDispatchMode):
        """Peak bytes of live tensor storages allocated by ops run inside it (forward and
        backward), and the largest one. A storage counts from the op that creates it until it is
        freed (checked at every later op); outputs that alias an input (views, in-place ops)
        allocate nothing. Storages that existed before (parameters) are not counted."""

        def __init__(self) -> None:
            super().__init__()
            self.live: dict[int, tuple[Any, int]] = {}  # data_ptr -> (weak ref, bytes)
            self.live_bytes = 0
            self.peak_bytes = 0
            self.largest_bytes = 0
            self.num_ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            self.num_ops += 1
            for ptr in [p for p, (ref, _) in self.live.items() if ref.expired()]:
                self.live_bytes -= self.live.pop(ptr)[1]
            inputs = {s.data_ptr() for s in storages((args, kwargs))}
            for s in storages(out):
                ptr, size = s.data_ptr(), s.nbytes()
                if size == 0 or ptr in self.live or ptr in inputs:
                    continue
                self.live[ptr] = (StorageWeakRef(s), size)
                self.live_bytes += size
                self.largest_bytes = max(self.largest_bytes, size)
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)
            return out

    return PeakTensorBytes


def tensor_peak():
    """A `PeakTensorBytes` dispatch mode: `with tensor_peak() as m: ...; m.peak_bytes`."""
    return _tracker_class()()


def _status_bytes(field: str) -> int:
    """A memory field of /proc/self/status ("VmRSS", "VmHWM"), in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024  # reported in kB
    raise RuntimeError(f"/proc/self/status has no {field}")


def _rss_bytes() -> int:
    return _status_bytes("VmRSS")


def _max_rss_bytes() -> int:
    """This process's peak resident memory. VmHWM, not getrusage's ru_maxrss: Linux carries
    ru_maxrss over fork and exec, so a rank started by a parent holding 6 GB would report 6 GB."""
    return _status_bytes("VmHWM")


def build_qwen2(
    *, vocab: int, hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int, seed: int
):
    """A randomly initialised Qwen2ForCausalLM (tied embeddings, float32, eager attention)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        use_cache=False,
    )
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(config)


# ----------------------------------------------------------------------------- 1. log-prob path
def logprob_path_memory(*, vocab: int, tokens: int, chunk_size: int, hidden: int = 64, seed: int = 0) -> dict:
    """Peak tensor bytes of one forward + backward of `tokens` predicted tokens, three ways."""
    import torch

    from asyncrl.kernels.logprobs import causal_lm_logprobs
    from asyncrl.models.policy import PolicyLM

    lm = build_qwen2(
        vocab=vocab, hidden=hidden, intermediate=2 * hidden, layers=1, heads=4, kv_heads=2, seed=seed
    )
    policy = PolicyLM(lm, chunk_size=chunk_size)
    rows = max(1, tokens // 512)
    width = -(-tokens // rows) + 1  # rows * (width - 1) >= tokens predicted positions
    gen = torch.Generator().manual_seed(seed)
    ids_BL = torch.randint(0, vocab, (rows, width), generator=gen)
    cands_BLN = torch.randint(0, vocab, (rows, width, 4), generator=gen)
    predicted = rows * (width - 1)

    def tokens_loss(out) -> torch.Tensor:
        return out.logp.sum() + out.entropy.sum()

    variants: dict[str, Callable[[], torch.Tensor]] = {
        "policy": lambda: tokens_loss(policy(ids_BL)),
        "policy_candidates": lambda: policy(ids_BL, candidates_BLN=cands_BLN).sum(),
        "full_logits": lambda: tokens_loss(causal_lm_logprobs(lm, ids_BL)),
    }
    out: dict[str, Any] = {
        "vocab": vocab,
        "tokens": predicted,
        "chunk_size": chunk_size,
        "logits_bytes": predicted * vocab * 4,  # one float32 [tokens, V] tensor
        "chunk_logits_bytes": min(chunk_size, predicted) * vocab * 4,
        "param_bytes": sum(p.numel() * p.element_size() for p in lm.parameters()),
    }
    for name, step in variants.items():
        lm.zero_grad(set_to_none=True)
        start = time.perf_counter()
        with tensor_peak() as mode:
            step().backward()
        out[name] = {
            "peak_bytes": mode.peak_bytes,
            "largest_tensor_bytes": mode.largest_bytes,
            "seconds": time.perf_counter() - start,
        }
    lm.zero_grad(set_to_none=True)
    out["policy_vs_full"] = out["policy"]["peak_bytes"] / out["full_logits"]["peak_bytes"]
    return out


# ----------------------------------------------------------------------------- 2. ranks
def _rank_step(args: dict) -> dict:
    """One learner rank: build, (shard), one training step; returns its figures."""
    import datetime

    import torch
    import torch.distributed as dist

    # Loaded before the baseline is read (a learner holds them too): the modelling code is ~120 MB.
    from transformers import Qwen2Config, Qwen2ForCausalLM  # noqa: F401

    from asyncrl.learner.parallel import parallelize
    from asyncrl.models.policy import PolicyLM

    rss_imports = _rss_bytes()
    torch.set_num_threads(args["threads"])
    rank, world = args["rank"], args["world_size"]
    if world > 1:
        store = dist.TCPStore("127.0.0.1", args["store_port"], world, is_master=False)
        dist.init_process_group(
            "gloo", store=store, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120)
        )
    lm = build_qwen2(**args["model"], seed=args["seed"])
    num_params = sum(p.numel() for p in lm.parameters())
    policy = PolicyLM(lm, chunk_size=args["chunk_size"])
    if world > 1:
        parallelize(
            policy,
            world_size=world,
            sharding="fsdp",
            mixed_precision="none",
            cpu_offload=False,
            activation_checkpointing=False,
            device=torch.device("cpu"),
        )
    copies = _weight_copies(policy, args) if args.get("copies") else None
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-4, betas=(0.9, 0.99))
    # The global batch, the same on every rank; this rank trains rows rank, rank + world, ...
    gen = torch.Generator().manual_seed(args["seed"] + 1)
    seqs, width = args["seqs"], args["seq_len"]
    ids_BL = torch.randint(0, args["model"]["vocab"], (seqs, width), generator=gen)
    adv_B = torch.randn(seqs, generator=gen, dtype=torch.float64)
    num_tokens_global = seqs * (width - 1)  # explicit denominator: the split cannot change it
    rss_setup = _rss_bytes()
    start = time.perf_counter()
    out = policy(ids_BL[rank::world])
    loss = -(out.logp[:, 1:] * adv_B[rank::world, None].float()).sum() / num_tokens_global
    rss_forward = _rss_bytes()
    loss.backward()
    del out
    rss_backward, peak_backward = _rss_bytes(), _max_rss_bytes()
    optimizer.step()
    if copies is not None:  # the copies move with the update, then score the rows (no grad)
        copies.after_update(policy.lm, 1)
        copies.logp_of(copies.ewma.params, ids_BL[rank::world], lambda m, ids: m(ids).logp)
    step_s = time.perf_counter() - start
    peak = _max_rss_bytes()
    # The gradient's global norm (after the step: AdamW leaves .grad as it was): the same
    # number from both layouts when they compute the same update.
    totals = torch.stack([loss.detach().double(), _local_grad_sq(policy)])
    if world > 1:
        dist.all_reduce(totals)
        dist.destroy_process_group()
    return {
        "rank": rank,
        "world_size": world,
        "num_params": num_params,
        "peak_rss_bytes": peak,
        "rss_after_imports_bytes": rss_imports,
        "rss_after_setup_bytes": rss_setup,
        "rss_after_forward_bytes": rss_forward,
        "rss_after_backward_bytes": rss_backward,
        "peak_rss_before_optimizer_bytes": peak_backward,
        "step_s": step_s,
        "loss": float(totals[0]),
        "grad_norm": float(totals[1].sqrt()),
    }


def _local_grad_sq(policy):
    """This rank's part of the squared gradient norm (its shards of every gradient)."""
    import torch

    grad_sq = torch.zeros((), dtype=torch.float64)
    for p in policy.parameters():
        if p.grad is not None:
            local = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
            grad_sq += local.double().square().sum()
    return grad_sq


def _weight_copies(policy, args: dict):
    """The copies a staleness policy keeps (`learner.copies.WeightCopies`): an EWMA of the weights
    and snapshots of the last max_staleness + 1 = 2 versions, plus the scratch model that scores
    with them; sharded like the model on several ranks, whole on one."""
    from types import SimpleNamespace

    from asyncrl.learner.copies import WeightCopies

    needs = SimpleNamespace(name="ewma+exact", needs=("ewma", "old_train"), ewma_decay=0.5)
    return WeightCopies(policy, needs, max_staleness=1, micro_batch_size=args["seqs"])


def _run_ranks(world: int, args: dict, timeout_s: float) -> list[dict]:
    """Start `world` rank processes, wait for them, return their figures (by rank)."""
    import torch.distributed as dist

    store = (
        dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False) if world > 1 else None
    )
    env = {**os.environ, **MALLOC_ENV, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}
    procs = []
    with tempfile.TemporaryDirectory(prefix="asyncrl-bench-learner-") as tmp:
        try:
            for rank in range(world):
                spec = {**args, "rank": rank, "world_size": world, "store_port": store.port if store else 0}
                out_f = open(os.path.join(tmp, f"rank{rank}.out"), "w+")  # noqa: SIM115 - closed below
                cmd = [sys.executable, "-m", "asyncrl.benchmarks.learner", "--rank-spec", json.dumps(spec)]
                proc = subprocess.Popen(cmd, stdout=out_f, stderr=subprocess.STDOUT, env=env)
                procs.append((proc, out_f))
            deadline = time.monotonic() + timeout_s
            results = []
            for rank, (proc, out_f) in enumerate(procs):
                try:
                    code = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    code = None
                out_f.seek(0)
                text = out_f.read()
                lines = [ln for ln in text.splitlines() if ln.startswith(RESULT_PREFIX)]
                if code != 0 or not lines:
                    state = "timed out" if code is None else f"exited with {code}"
                    raise RuntimeError(f"learner bench rank {rank}/{world} {state}:\n{text[-4000:]}")
                results.append(json.loads(lines[-1][len(RESULT_PREFIX) :]))
            return results
        finally:
            for proc, out_f in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
                out_f.close()


def rank_memory(
    *, model: dict, seqs: int, seq_len: int, chunk_size: int, timeout_s: float, seed: int = 0
) -> dict:
    """1 rank unsharded, then 2 ranks FSDP2: each rank's peak RSS for one training step."""
    cores = os.cpu_count() or 1
    args = {"model": model, "seqs": seqs, "seq_len": seq_len, "chunk_size": chunk_size, "seed": seed}
    one = _run_ranks(1, {**args, "threads": max(1, cores)}, timeout_s)
    two = _run_ranks(2, {**args, "threads": max(1, cores // 2)}, timeout_s)
    one_copies = _run_ranks(1, {**args, "threads": max(1, cores), "copies": True}, timeout_s)
    two_copies = _run_ranks(2, {**args, "threads": max(1, cores // 2), "copies": True}, timeout_s)
    peak_one = one[0]["peak_rss_bytes"]
    peak_two = max(r["peak_rss_bytes"] for r in two)
    base_one = one[0]["rss_after_imports_bytes"]
    base_two = max(r["rss_after_imports_bytes"] for r in two)
    return {
        "num_params": one[0]["num_params"],
        "model": model,
        "seqs": seqs,
        "seq_len": seq_len,
        "peak_rss_bytes_1rank": peak_one,
        "peak_rss_bytes_2rank": [r["peak_rss_bytes"] for r in two],
        "fsdp_per_rank_ratio": peak_two / peak_one,
        "fsdp_per_rank_ratio_net_of_imports": (peak_two - base_two) / max(1, peak_one - base_one),
        # With the weight copies of `ewma` and `exact` (an EWMA, 2 snapshots, a scratch model).
        "copies_peak_rss_bytes_1rank": one_copies[0]["peak_rss_bytes"],
        "copies_peak_rss_bytes_2rank": [r["peak_rss_bytes"] for r in two_copies],
        "copies_extra_bytes_1rank": one_copies[0]["peak_rss_bytes"] - peak_one,
        "copies_extra_bytes_2rank": max(r["peak_rss_bytes"] for r in two_copies) - peak_two,
        "loss_1rank": one[0]["loss"],
        "loss_2rank": two[0]["loss"],
        "grad_norm_1rank": one[0]["grad_norm"],
        "grad_norm_2rank": two[0]["grad_norm"],
        "ranks": {"1": one, "2": two},
    }


# ----------------------------------------------------------------------------- the bench
def run_learner_bench(
    *,
    quick: bool = False,
    vocab: int = QWEN2_VOCAB,
    tokens: int | None = None,
    chunk_size: int | None = None,
    seqs: int | None = None,
    seq_len: int | None = None,
    ranks: bool = True,
    packing: bool = True,
    timeout_s: float = 600.0,
) -> dict:
    """Both figures (module docstring); `quick` shrinks every size. Returns a JSON-able dict."""
    start = time.perf_counter()
    result: dict[str, Any] = {
        "quick": quick,
        "logprobs": logprob_path_memory(
            vocab=vocab if not quick else 32_000,
            tokens=tokens or (256 if quick else 2048),
            chunk_size=chunk_size or (64 if quick else 256),
        ),
    }
    if ranks:
        result["ranks"] = rank_memory(
            model=QUICK_MODEL if quick else FULL_MODEL,
            seqs=seqs or 4,
            seq_len=seq_len or (32 if quick else 256),
            chunk_size=chunk_size or (64 if quick else 256),
            timeout_s=timeout_s,
        )
    if packing:
        from asyncrl.benchmarks.learner_packing import packing_throughput

        result["packing"] = packing_throughput(quick=quick)
    result["seconds"] = time.perf_counter() - start
    result["load_average_1min"] = os.getloadavg()[0]
    return result


def _print(result: dict) -> None:
    lp = result["logprobs"]
    typer.echo(
        f"log-prob path, one forward + backward of {lp['tokens']} tokens at vocabulary {lp['vocab']} "
        f"(chunks of {lp['chunk_size']}; one [tokens, V] float32 tensor = {lp['logits_bytes'] / _MB:.0f} MiB, "
        f"one [chunk, V] = {lp['chunk_logits_bytes'] / _MB:.0f} MiB):"
    )
    for name in ("policy", "policy_candidates", "full_logits"):
        r = lp[name]
        typer.echo(
            f"  {name:<18} peak {r['peak_bytes'] / _MB:8.0f} MiB  largest tensor "
            f"{r['largest_tensor_bytes'] / _MB:6.0f} MiB  {r['seconds']:.1f} s"
        )
    typer.echo(f"  PolicyLM / full logits peak: {lp['policy_vs_full']:.3f}")
    if "ranks" in result:
        rk = result["ranks"]
        two = ", ".join(f"{b / _MB:.0f}" for b in rk["peak_rss_bytes_2rank"])
        typer.echo(
            f"one training step (AdamW, float32) of a {rk['num_params'] / 1e6:.0f}M-parameter Qwen2 model, "
            f"batch {rk['seqs']} x {rk['seq_len']} tokens, peak RSS per rank:"
        )
        typer.echo(f"  1 rank unsharded: {rk['peak_rss_bytes_1rank'] / _MB:.0f} MiB")
        typer.echo(f"  2 ranks FSDP2:    {two} MiB")
        typer.echo(
            f"  per-rank ratio {rk['fsdp_per_rank_ratio']:.2f} (net of imports "
            f"{rk['fsdp_per_rank_ratio_net_of_imports']:.2f}); loss {rk['loss_1rank']:.6g} vs "
            f"{rk['loss_2rank']:.6g}, gradient norm {rk['grad_norm_1rank']:.6g} vs {rk['grad_norm_2rank']:.6g}"
        )
        two_c = ", ".join(f"{b / _MB:.0f}" for b in rk["copies_peak_rss_bytes_2rank"])
        typer.echo(
            "  with the weight copies of ewma + exact (an EWMA, 2 snapshots, a scratch model): "
            f"1 rank {rk['copies_peak_rss_bytes_1rank'] / _MB:.0f} MiB (+{rk['copies_extra_bytes_1rank'] / _MB:.0f}), "
            f"2 ranks FSDP2 {two_c} MiB (+{rk['copies_extra_bytes_2rank'] / _MB:.0f} per rank)"
        )
    if "packing" in result:
        from asyncrl.benchmarks.learner_packing import print_packing

        print_packing(result["packing"], typer.echo)
    typer.echo(f"{result['seconds']:.0f} s; load average (1 min) {result['load_average_1min']:.2f}")


def command(
    quick: Annotated[bool, typer.Option("--quick", help="small sizes (a few seconds' work)")] = False,
    tokens: Annotated[int | None, typer.Option(help="log-prob path: predicted tokens (default 2048)")] = None,
    vocab: Annotated[int, typer.Option(help="log-prob path: vocabulary size")] = QWEN2_VOCAB,
    chunk_size: Annotated[
        int | None, typer.Option(help="tokens per chunk of logits (learner.logprob_chunk_size; default 256)")
    ] = None,
    seqs: Annotated[int | None, typer.Option(help="rank memory: sequences per step (default 4)")] = None,
    seq_len: Annotated[
        int | None, typer.Option(help="rank memory: tokens per sequence (default 256)")
    ] = None,
    ranks: Annotated[bool, typer.Option(help="run the 1-rank vs 2-rank memory figure")] = True,
    packing: Annotated[bool, typer.Option(help="run the packed vs padded tokens/s figure")] = True,
    as_json: Annotated[bool, typer.Option("--json", help="print the full result as JSON")] = False,
) -> None:
    """Learner memory: chunked log-probs vs full logits at 150k vocab; 1 rank vs 2 ranks FSDP2 (with
    and without weight copies); packed vs padded training tokens/s on long-tailed lengths."""
    for name, value in (("--tokens", tokens), ("--chunk-size", chunk_size), ("--seqs", seqs)):
        if value is not None and value < 1:
            raise typer.BadParameter(f"{name} must be >= 1, got {value}")
    if seq_len is not None and seq_len < 2:
        raise typer.BadParameter(f"--seq-len must be >= 2, got {seq_len}")
    result = run_learner_bench(
        quick=quick,
        vocab=vocab,
        tokens=tokens,
        chunk_size=chunk_size,
        seqs=seqs,
        seq_len=seq_len,
        ranks=ranks,
        packing=packing,
    )
    if as_json:
        typer.echo(json.dumps(result, indent=2))
    else:
        _print(result)


def main(argv: list[str] | None = None) -> None:
    """`python -m asyncrl.benchmarks.learner [options]` runs the bench (the options of `command`);
    with `--rank-spec JSON` it is one rank process of the rank-memory figure (see `_run_ranks`)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["--rank-spec"]:
        result = _rank_step(json.loads(argv[1]))
        print(RESULT_PREFIX + json.dumps(result), flush=True)
        # The figures are out. Skip interpreter teardown: a gloo/TCPStore background thread
        # still joinable at static destruction aborts the process ("terminate called without
        # an active exception", seen once in CI), which would throw away a finished measurement.
        sys.stderr.flush()
        os._exit(0)
    app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
    app.command()(command)
    app(args=argv)


if __name__ == "__main__":
    main()
