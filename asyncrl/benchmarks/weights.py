"""`asyncrl bench weights`: time from publish to every generator holding the new weights, for
safetensors shards and the broadcast group (by default through the shared-memory ring, and over
gloo beside it), with 1 and 2 generators, against the memcpy bandwidth
measured in the same run, and next to what bounds each transport on this machine (each checksum
kind per core, zstd, file writes and reads, one loopback TCP stream, all measured in the same run);
beside them sha256 shards, float32 shards, delta updates and shards served over the network to a
generator without the weights root (`weights_network.py`). bench/README.md explains each figure.

Importing this module is cheap: torch and the transports load when the command runs
(`asyncrl.benchmarks.weights_run`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

_GB = 1e9


def command(
    num_params: Annotated[
        int, typer.Option(help="parameters' worth of tensors (bf16 matrices, fp32 norms)")
    ] = 100_000_000,
    generators: Annotated[
        list[int] | None, typer.Option(help="generator counts (repeat the flag); default 1 and 2")
    ] = None,
    repeats: Annotated[int, typer.Option(help="timed rounds per figure after warm-up; medians reported")] = 5,
    max_shard_bytes: Annotated[
        int, typer.Option(help="tensor bytes per safetensors shard (default: as weights.max_shard_bytes)")
    ] = 512 << 20,
    bucket_bytes: Annotated[int, typer.Option(help="broadcast bucket size")] = 4 << 20,
    shard_root: Annotated[
        Path | None, typer.Option(help="where shards are written (default: /dev/shm)")
    ] = None,
    checksum: Annotated[
        str, typer.Option(help="shards' checksum kind: xxh3, blake3 or sha256 (as weights.checksum)")
    ] = "xxh3",
    extra_rows: Annotated[
        bool, typer.Option(help="also sha256 shards, float32 shards and delta updates (1st count)")
    ] = True,
    delta_lr: Annotated[float, typer.Option(help="learning rate of the delta row's Adam-like steps")] = 1e-6,
    trained_delta_steps: Annotated[
        int,
        typer.Option(
            help="instead of the timed rows: train a Llama-shaped model of --num-params this many AdamW "
            "steps at --delta-lr and report the bytes of each delta update (bf16 and fp32)"
        ),
    ] = 0,
    as_json: Annotated[bool, typer.Option("--json", help="print the full result as JSON")] = False,
) -> None:
    """Weight sync: shards and broadcast against memcpy, 1 and 2 generators."""
    if num_params < 2048:
        raise typer.BadParameter(f"--num-params must be >= 2048, got {num_params}")
    generators = generators or [1, 2]
    if repeats < 1 or min(generators) < 1:
        raise typer.BadParameter("--repeats and every --generators value must be >= 1")
    if checksum not in ("xxh3", "blake3", "sha256"):
        raise typer.BadParameter(f"--checksum must be xxh3, blake3 or sha256, got {checksum!r}")
    if trained_delta_steps > 0:
        _trained_deltas(num_params, trained_delta_steps, delta_lr, as_json=as_json)
        return
    from asyncrl.benchmarks.weights_run import run_weights_bench

    result = run_weights_bench(
        num_params=num_params,
        num_generators_list=tuple(generators),
        repeats=repeats,
        max_shard_bytes=max_shard_bytes,
        bucket_bytes=bucket_bytes,
        shard_root=shard_root,
        checksum=checksum,
        extra_rows=extra_rows,
        delta_lr=delta_lr,
    )
    if as_json:
        typer.echo(json.dumps(result, indent=2))
    else:
        _print_report(result)


def _print_report(result: dict) -> None:
    """The human-readable report: the workload and bounds, then each row, then the load average."""
    memcpy = result["memcpy_gbps"]
    b = result["bounds"]
    typer.echo(
        f"{result['bytes'] / _GB:.3f} GB in {result['num_tensors']} tensors; memcpy {memcpy:.2f} GB/s "
        f"(one thread); medians of {result['repeats']} rounds"
    )
    typer.echo(
        f"bounds, one core each: xxh3 {b['xxh3_gbps_per_core']:.1f} GB/s, blake3 {b['blake3_gbps_per_core']:.2f}, "
        f"sha256 {b['sha256_gbps_per_core']:.2f}; zstd {b['zstd_compress_gbps']:.1f} / "
        f"{b['zstd_decompress_gbps']:.1f} GB/s; file write "
        f"{b['file_write_new_gbps']:.2f} GB/s new, {b['file_write_recycled_gbps']:.2f} recycled; file read "
        f"{b['file_read_gbps']:.2f} GB/s; loopback TCP stream {b['loopback_tcp_gbps']:.2f} GB/s "
        f"({b['loopback_tcp_cpu_s_per_gb']:.2f} CPU-s/GB)"
    )
    _print_shards_rows(result)
    _print_network_and_delta_rows(result)
    _print_broadcast_rows(result)
    typer.echo(
        f"load average (1 min): {result['load_average_1min_start']:.2f} at the start, "
        f"{result['load_average_1min']:.2f} at the end, on {result['num_cpus']} CPUs"
    )


def _vs(gbps: float, memcpy: float) -> str:
    return f"{gbps:.2f} GB/s ({gbps / memcpy:.2f}x memcpy)"


def _print_shards_rows(result: dict) -> None:
    memcpy, cores = result["memcpy_gbps"], result["num_cpus"]
    rows = [("shards", "shards   "), ("shards_sha256", "sha256   "), ("shards_fp32", "fp32     ")]
    for key, label in rows:
        for n, r in result["detail"].get(key, {}).items():
            gb = r["bytes"] / _GB
            bound = r["bound"]
            typer.echo(
                f"{label} x{n}: {_vs(r['gbps'], memcpy)}, {r['bytes'] / 1e6:.0f} MB ({r['checksum']}); publish "
                f"{r['publish_gbps']:.2f} GB/s (new files: {r['publish_fresh_gbps']:.2f}), load "
                f"{r['load_gbps']:.2f} GB/s; cpu {r['cpu_s']:.2f} s ({r['cpu_s'] / gb:.2f} CPU-s/GB, "
                f"{r['cpu_s'] / cores / r['total_s']:.0%} of {cores} cores: {r['cpu_bound_gbps']:.2f} GB/s "
                f"with the cores to itself)"
            )
            typer.echo(
                f"  as a generator takes it (fresh tensors, then copied into its parameters): "
                f"{_vs(r['generator_gbps'], memcpy)}; cpu {r['generator_cpu_s']:.2f} s"
            )
            typer.echo(
                f"  bound: {1 + int(n)} {bound['checksum']} passes ({bound['hash_cpu_s']:.2f} CPU-s) + copies "
                f"({bound['copy_cpu_s']:.2f}) on {cores} cores -> {_vs(bound['gbps'], memcpy)}; hashing alone -> "
                f"{_vs(bound['hash_only_gbps'], memcpy)}"
            )


def _print_network_and_delta_rows(result: dict) -> None:
    memcpy = result["memcpy_gbps"]
    for n, r in result["detail"].get("network", {}).items():  # docs/multi-host.md
        typer.echo(
            f"network   x{n}: {_vs(r['gbps'], memcpy)}, served to a generator without the weights root "
            f"(loopback, {r['checksum']} checked on arrival and on read); fetch alone "
            f"{_vs(r['fetch_gbps'], memcpy)}; cpu {r['cpu_s']:.2f} s (both ends)"
        )
    for n, r in result["detail"].get("delta", {}).items():
        typer.echo(
            f"delta     x{n}: lr {r['lr']:g}; {r['delta_bytes'] / 1e6:.2f} MB per update instead of "
            f"{r['bytes'] / 1e6:.0f} MB ({r['delta_bytes'] / r['bytes']:.1%}); publish (full + delta) "
            f"{r['publish_gbps']:.2f} GB/s, generator fetch by delta {r['fetch_gbps']:.2f} GB/s; as a "
            f"generator takes it {_vs(r['generator_gbps'], memcpy)}"
        )


def _print_broadcast_rows(result: dict) -> None:
    memcpy, cores = result["memcpy_gbps"], result["num_cpus"]
    gb = result["bytes"] / _GB
    for key, label in (("broadcast", "broadcast"), ("broadcast_gloo", "gloo     ")):
        for n, r in result["detail"].get(key, {}).items():
            bound = r["bound"]
            path = (
                f"{r['ring_readers']} of {n} through the shared-memory ring"
                if key == "broadcast"
                else "every generator over gloo (loopback TCP)"
            )
            typer.echo(
                f"{label} x{n}: {_vs(r['gbps'], memcpy)}, {path}; cpu {r['cpu_s']:.2f} s ({r['cpu_s'] / gb:.2f} "
                f"CPU-s/GB, sender {r['sender_cpu_s']:.2f}: {r['cpu_bound_gbps']:.2f} GB/s with the cores to itself)"
            )
            typer.echo(
                f"  as a generator takes it (fresh tensors, then copied into its parameters): "
                f"{_vs(r['generator_gbps'], memcpy)}; cpu {r['generator_cpu_s']:.2f} s"
            )
            if key == "broadcast":
                typer.echo(
                    f"  bound: {bound['num_copies']} memcpys (into the ring, out of it) on {cores} cores -> "
                    f"{_vs(bound['gbps'], memcpy)}"
                )
            else:
                typer.echo(
                    f"  bound: {n} loopback TCP stream(s) from rank 0 ({bound['cpu_s']:.2f} CPU-s) -> "
                    f"{_vs(bound['gbps'], memcpy)}"
                )


def _trained_deltas(num_params: int, steps: int, lr: float, *, as_json: bool) -> None:
    from asyncrl.benchmarks.weights_delta import measure_trained_deltas

    result = measure_trained_deltas(num_params=num_params, steps=steps, lr=lr)
    if as_json:
        typer.echo(json.dumps(result, indent=2))
        return
    typer.echo(f"{result['num_params'] / 1e6:.1f}M parameters, {steps} AdamW steps at lr {lr:g}")
    for name, row in result["dtypes"].items():
        deltas = ", ".join(
            f"{b / 1e6:.2f} MB ({f:.1%})"
            for b, f in zip(row["delta_bytes"], row["delta_fraction"], strict=True)
        )
        typer.echo(f"  {name}: full {row['full_bytes'] / 1e6:.0f} MB; deltas {deltas}")
