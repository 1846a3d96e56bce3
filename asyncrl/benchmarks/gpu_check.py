"""The learner on one GPU, checked in one run (issue #21): throughput, memory and exactness.

    asyncrl bench gpu-check --out OUT                # on a CUDA machine; < 8 minutes on an H100
    asyncrl bench gpu-check --out OUT --cpu-dry-run  # the same code paths on CPU, tiny models
    (or `python -m asyncrl.benchmarks.gpu_check ...` from a checkout's root, without installing)

Writes OUT/gpu_check.json (rewritten after every section, so a run cut short keeps what it
measured) and prints a short summary. Sections, in the order they run:

1. `environment`: torch, CUDA, cuDNN, NCCL and transformers versions; device name, bf16 support,
   free memory.
2. `process_group`: the learner's single-rank group (`parallel.init_single_rank_group`: NCCL on a
   GPU), which the rest of the run uses: a device-tensor all-reduce (what the lockstep trainer
   reduces: micro-batch count, step sums, the finite-parameter check; and FSDP2), and a probe of
   whether it can all-reduce CPU tensors too (reported only: plain NCCL cannot, and the learner
   needs it not). Only if the learner's group fails on the device is that a finding, and the run
   goes on with a group with gloo for CPU tensors and NCCL for CUDA ones.
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

This module is the harness (report, context, watchdog, running sections, summary, arguments) with
the sections that set up the device and the group and that run the default job as a subprocess
(`environment`, `process_group`, `e2e`); the training workloads (`exactness`, `throughput`) and the
model, sample and trainer pieces they share are in `gpu_check_sections.py` beside it.
"""

from __future__ import annotations

import os

# cuBLAS reads this when it creates its first handle: it must be set before CUDA starts, or the
# exactness section's repeat runs may differ in their GEMM reductions.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import argparse  # noqa: E402
import faulthandler  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import signal  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

# The directory holding this asyncrl package: a checkout's root when run from one (its git HEAD
# goes into the report; the e2e job runs there and imports this same asyncrl).
REPO = Path(__file__).resolve().parents[2]

from asyncrl.benchmarks.gpu_check_sections import (  # noqa: E402
    error_record,
    log,
    section_exactness,
    section_throughput,
)

SECTIONS = ("environment", "process_group", "exactness", "throughput", "e2e")
# Seconds of budget a section needs to start at all (it also stops its own loops in time).
MIN_START_S = {"environment": 0, "process_group": 0, "exactness": 30, "throughput": 60, "e2e": 60}
WATCHDOG_GRACE_S = 45.0  # past the budget: write the report and exit (8 minutes at the default 420)
GROUP_TIMEOUT_S = 60.0  # a collective of one rank that takes longer is stuck


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
    """The run's group is the learner's own (`parallel.init_single_rank_group`: NCCL on a GPU). The
    lockstep trainer reduces device tensors only (micro-batch count, step sums, finite check), as
    FSDP2 does; whether the group can also all-reduce CPU tensors is probed and reported (plain
    NCCL has no CPU backend, so on a GPU "no" is expected, and nothing in the learner needs it)."""
    import datetime

    from asyncrl.learner.parallel import backend_for, init_single_rank_group

    rec["learner_backend"] = backend_for(ctx.device)
    try:
        init_single_rank_group(ctx.device, GROUP_TIMEOUT_S)
        dist.all_reduce(torch.ones(2, dtype=torch.float64, device=ctx.device))  # as the trainer does
        ctx.sync()
    except Exception as exc:  # recorded, then a group the later sections can still use
        if not ctx.is_cuda:
            raise  # on CPU the learner's group is gloo: nothing to fall back to
        ctx.finding(
            f"the learner's {rec['learner_backend']!r} single-rank group failed a device all-reduce "
            f"({type(exc).__name__}: {exc}); this run goes on with 'cpu:gloo,cuda:nccl'"[:1000]
        )
        if dist.is_initialized():
            dist.destroy_process_group()
        timeout = datetime.timedelta(seconds=GROUP_TIMEOUT_S)
        dist.init_process_group(
            "cpu:gloo,cuda:nccl", store=dist.HashStore(), rank=0, world_size=1, timeout=timeout
        )
        dist.all_reduce(torch.ones(2, device=ctx.device))
        ctx.sync()
    try:  # the probe: CPU tensors (float64, as the step sums are on the host)
        dist.all_reduce(torch.ones(2, dtype=torch.float64))
        rec["cpu_tensor_all_reduce"] = "ok"
    except Exception as exc:  # only reported: the learner reduces no CPU tensors
        if not ctx.is_cuda:
            raise
        rec["cpu_tensor_all_reduce"] = f"{type(exc).__name__}: {exc}"[:1000]
    rec["backend_used"] = str(dist.get_backend())


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
        "script": "asyncrl/benchmarks/gpu_check.py",
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
