"""`asyncrl bench weights`: time from publish to every generator holding the new weights, for
safetensors shards and the broadcast group, with 1 and 2 generators, against the memcpy bandwidth
measured in the same run (bench/README.md explains each figure and what bounds it).

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
    repeats: Annotated[
        int, typer.Option(help="timed rounds per figure after one warm-up; medians reported")
    ] = 3,
    max_shard_bytes: Annotated[int, typer.Option(help="tensor bytes per safetensors shard")] = 64 << 20,
    bucket_bytes: Annotated[int, typer.Option(help="broadcast bucket size")] = 4 << 20,
    shard_root: Annotated[
        Path | None, typer.Option(help="where shards are written (default: /dev/shm)")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="print the full result as JSON")] = False,
) -> None:
    """Weight sync: shards and broadcast against memcpy, 1 and 2 generators."""
    if num_params < 2048:
        raise typer.BadParameter(f"--num-params must be >= 2048, got {num_params}")
    generators = generators or [1, 2]
    if repeats < 1 or min(generators) < 1:
        raise typer.BadParameter("--repeats and every --generators value must be >= 1")
    from asyncrl.benchmarks.weights_run import run_weights_bench

    result = run_weights_bench(
        num_params=num_params,
        num_generators_list=tuple(generators),
        repeats=repeats,
        max_shard_bytes=max_shard_bytes,
        bucket_bytes=bucket_bytes,
        shard_root=shard_root,
    )
    if as_json:
        typer.echo(json.dumps(result, indent=2))
        return
    memcpy = result["memcpy_gbps"]
    typer.echo(f"{result['bytes'] / _GB:.3f} GB in {result['num_tensors']} tensors; memcpy {memcpy:.2f} GB/s")
    for n, r in result["detail"]["shards"].items():
        typer.echo(
            f"shards    x{n}: {r['gbps']:.2f} GB/s ({r['gbps'] / memcpy:.2f}x memcpy); publish "
            f"{r['publish_gbps']:.2f} GB/s, load {r['load_gbps']:.2f} GB/s; cpu {r['cpu_s']:.2f} s"
        )
    for n, r in result["detail"]["broadcast"].items():
        typer.echo(
            f"broadcast x{n}: {r['gbps']:.2f} GB/s ({r['gbps'] / memcpy:.2f}x memcpy); cpu {r['cpu_s']:.2f} s"
        )
    typer.echo(
        f"load average (1 min) at the end: {result['load_average_1min']:.2f} on {result['num_cpus']} CPUs"
    )
