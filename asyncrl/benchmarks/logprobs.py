"""Peak memory and time of per-token log-probs + backward: full logits vs chunked vs fused.

    asyncrl bench logprobs                      # T=1024, D=256, V=150k, float32
    asyncrl bench logprobs --json               # one JSON object on stdout
    asyncrl bench logprobs --check              # exit 1 unless chunked peak <= 1/4 of naive

Each variant runs in a fresh subprocess (so one variant's freed memory cannot hide another's peak)
and is measured two ways:

* tensor peak: torch's CPU memory profiler (`torch.profiler`, profile_memory=True) records every
  CPU tensor allocation and free with a timestamp; the peak of their running sum is the most
  tensor memory alive at once during the measured call, on top of the inputs (hidden, weight).
* RSS peak: the process's peak resident set (VmHWM, reset through /proc/self/clear_refs just
  before the call) minus its resident set before it. Includes allocator slack; Linux only.

Both include the weight gradient ([V, D] float32), which every variant must produce.

Variants (objective sum_t c_t logp_t, as the streaming learner's backward):
  naive    F.linear over all tokens, float32 [T, V] logits, -F.cross_entropy (the leanest full path)
  chunked  asyncrl.kernels.logprobs.token_logprobs (per-chunk activation checkpointing)
  fused    asyncrl.kernels.fused_logprobs.fused_token_logprobs (closed-form chunked backward)
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

VARIANTS = ("naive", "chunked", "fused")
ACCEPTANCE_RATIO = 0.25  # chunked tensor peak must be <= 1/4 of naive


def _status_kib(field: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def _reset_peak_rss() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def _tensor_peak_bytes(prof) -> int:
    """Peak of the running sum of CPU allocations (+) and frees (-) recorded by the profiler."""
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    events.sort(key=lambda e: e.start_ns())
    live = peak = 0
    for e in events:
        if "CPU" in str(e.device_type()):
            live += e.nbytes()
            peak = max(peak, live)
    return peak


def run_child(args: argparse.Namespace) -> dict:
    import torch
    import torch.nn.functional as F
    from torch.profiler import ProfilerActivity, profile

    from asyncrl.kernels.fused_logprobs import fused_token_logprobs
    from asyncrl.kernels.logprobs import token_logprobs

    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(args.tokens, args.dim, generator=gen).requires_grad_()
    weight = (torch.randn(args.vocab, args.dim, generator=gen) / args.dim**0.5).requires_grad_()
    targets = torch.randint(0, args.vocab, (args.tokens,), generator=gen)
    coef = torch.rand(args.tokens, generator=gen)

    def step() -> None:
        if args.variant == "naive":
            logits = F.linear(hidden, weight).float()
            logp = -F.cross_entropy(logits, targets, reduction="none")
        elif args.variant == "chunked":
            logp = token_logprobs(hidden, weight, targets, chunk_size=args.chunk_size).logp
        else:
            logp = fused_token_logprobs(hidden, weight, targets, chunk_size=args.chunk_size).logp
        (coef * logp).sum().backward()

    rss_before_kib = _status_kib("VmRSS")
    rss_reset = _reset_peak_rss()
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    elapsed_s = time.perf_counter() - start
    rss_peak_kib = _status_kib("VmHWM")
    rss_delta = None
    if rss_reset and rss_before_kib is not None and rss_peak_kib is not None:
        rss_delta = (rss_peak_kib - rss_before_kib) * 1024
    assert weight.grad is not None and torch.isfinite(weight.grad).all()
    return {
        "variant": args.variant,
        "tensor_peak_bytes": _tensor_peak_bytes(prof),
        "rss_peak_delta_bytes": rss_delta,
        "time_s": elapsed_s,
        "weight_grad_bytes": weight.numel() * weight.element_size(),
    }


def _mib(n: int | None) -> str:
    return "n/a" if n is None else f"{n / 2**20:10.1f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=150_000)
    parser.add_argument("--chunk-size", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    parser.add_argument("--check", action="store_true", help="exit 1 if the acceptance ratio is not met")
    parser.add_argument("--child", dest="variant", choices=VARIANTS, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.variant is not None:
        print(json.dumps(run_child(args)))
        return 0

    results = {}
    for variant in VARIANTS:
        cmd = [sys.executable, "-m", "asyncrl.benchmarks.logprobs", "--child", variant]
        for flag in ("tokens", "dim", "vocab", "chunk_size", "threads"):
            cmd += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True)
        results[variant] = json.loads(out.stdout.strip().splitlines()[-1])

    naive_peak = results["naive"]["tensor_peak_bytes"]
    ratios = {v: r["tensor_peak_bytes"] / naive_peak for v, r in results.items()}
    passed = ratios["chunked"] <= ACCEPTANCE_RATIO
    report = {
        "config": {k: getattr(args, k) for k in ("tokens", "dim", "vocab", "chunk_size", "threads")},
        "results": results,
        "tensor_peak_ratio_vs_naive": ratios,
        "acceptance": {"chunked_over_naive_max": ACCEPTANCE_RATIO, "passed": passed},
    }
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        cfg = report["config"]
        print(
            f"log-probs + backward, T={cfg['tokens']} D={cfg['dim']} V={cfg['vocab']} "
            f"chunk={cfg['chunk_size']} float32, threads={cfg['threads']}"
        )
        print(f"{'variant':<9}{'tensor peak MiB':>17}{'RSS peak MiB':>15}{'vs naive':>10}{'time s':>9}")
        for variant, r in results.items():
            print(
                f"{variant:<9}{_mib(r['tensor_peak_bytes']):>17}{_mib(r['rss_peak_delta_bytes']):>15}"
                f"{ratios[variant]:>10.3f}{r['time_s']:>9.2f}"
            )
        print(f"(weight gradient alone: {_mib(results['naive']['weight_grad_bytes']).strip()} MiB)")
        print(f"acceptance chunked <= {ACCEPTANCE_RATIO} x naive: {'PASS' if passed else 'FAIL'}")
    return 0 if passed or not args.check else 1


if __name__ == "__main__":
    sys.exit(main())
