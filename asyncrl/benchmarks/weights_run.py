"""Weight-sync benchmark (`asyncrl bench weights`): shards and the gloo broadcast group against memcpy.

The heavy half of `asyncrl.benchmarks.weights` (imported only when the command runs): runs every
row and puts the machine's bounds beside it. The rows are measured by `weights_shards.py`,
`weights_broadcast.py` and `weights_network.py` (children and pipes in `weights_procs.py`, the
weights themselves from `weights_workload.py`); the bounds by `weights_bounds.py`.

Place in the data flow: measures the learner -> generators weight path (asyncrl.transport.shards,
shard_read and asyncrl.transport.broadcast) on this machine. The parent process plays learner rank 0
and publishes or broadcasts; spawned processes play generators and load into tensors they already
hold (as a generator loads into its model's parameters). Process start-up is outside every timed
region.

Figures (GB/s = 1e9 bytes/s, one copy of the weights as the unit of work; medians over rounds):
  memcpy_gbps     torch copy of a buffer of the same size, one thread, warm (destination touched)
  shards_gbps     bytes / (publish (write + checksum (xxh3 by default) + rename, as ShardPublisher
                  does) + the slowest reader's verified load), in the steady state of retention
                  (keep_last 2, pruned versions recycled); `publish_fresh_gbps` is a publish that
                  had to create its files. detail: `shards_sha256` the same with sha256 (the old
                  integrity), `shards_fp32` the same model in float32 (twice the bytes of the
                  bf16 serving dtype), `delta` versions that change as a small-lr Adam step does,
                  published with `weights.delta` and fetched as a generator does (the delta
                  applied to the version it holds), with the bytes of each delta
  broadcast_gbps  bytes / (broadcast until every receiver holds all bytes, confirmed by an all-reduce),
                  sent as runs send by default: receivers on this host through the shared-memory
                  ring (weights.broadcast_local = "shm"); `broadcast_gloo_gbps` the same over
                  gloo's loopback TCP streams ("gloo", the broadcast figure before the ring)
  generator_gbps  (detail) the same, with each generator taking the weights as a real one does:
                  into fresh tensors (`WeightsReceiver.fetch` / `receive_tensors`), then copied
                  into its parameters, the fresh tensors dropped; the figures above load straight
                  into the tensors a generator holds, which is the transports' own speed
  cpu_s           CPU seconds of all processes for one update (wall figures move with other load on
                  the machine; CPU seconds much less so); `cpu_bound_gbps` = bytes / (cpu_s / CPUs):
                  the figure if every core worked on the update and nothing else
  bounds          what limits the two transports, measured in the same run (fastest of the
                  repeats), one core each: every checksum kind, zstd on XOR data, tmpfs writes
                  (new and recycled files) and reads, one loopback TCP stream

    asyncrl bench weights --json
    asyncrl bench weights --num-params 20000000 --generators 1 --generators 2 --repeats 5
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import torch

from asyncrl.benchmarks.weights_bounds import (
    broadcast_bound,
    measure_bounds,
    measure_memcpy_gbps,
    ring_bound,
    shards_bound,
)
from asyncrl.benchmarks.weights_shards import bench_shards
from asyncrl.benchmarks.weights_workload import adam_like_states, make_state_dict, num_bytes_of
from asyncrl.transport.checksum import DEFAULT_CHECKSUM
from asyncrl.transport.publisher import MAX_SHARD_BYTES

DEFAULT_SHARD_BYTES = MAX_SHARD_BYTES  # what runs use (weights.max_shard_bytes)
DEFAULT_BUCKET_BYTES = 4 << 20  # gloo: tensors of 4 MiB or more go alone, without copies
# The delta row's learning rate: RL post-training of LLMs commonly uses 1e-6 (GRPO recipes).
DEFAULT_DELTA_LR = 1e-6
_GB = 1e9


def _num_cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _extra_rows(
    sd: dict[str, torch.Tensor],
    root: Path,
    bounds: dict,
    *,
    n: int,
    repeats: int,
    max_shard_bytes: int,
    delta_lr: float,
) -> dict[str, dict[str, dict]]:
    """The rows beside the main ones, for `n` generators: sha256 shards (the old integrity),
    float32 shards (twice the bytes of the bf16 serving dtype) and delta updates."""
    num_cpus = _num_cpus()
    rows: dict[str, dict[str, dict]] = {}
    fp32 = {name: t.float() for name, t in sd.items()}
    for key, state, kind, state_of in (
        ("shards_sha256", sd, "sha256", None),
        ("shards_fp32", fp32, DEFAULT_CHECKSUM, None),
        ("delta", sd, DEFAULT_CHECKSUM, adam_like_states(sd, lr=delta_lr)),
    ):
        shard_dir = root / f"{key}-x{n}"
        shard_dir.mkdir()
        row = bench_shards(
            state,
            shard_dir,
            num_readers=n,
            repeats=repeats,
            max_shard_bytes=max_shard_bytes,
            checksum=kind,
            state_of=state_of,
        )
        row["bound"] = shards_bound(
            bounds, num_bytes=num_bytes_of(state), num_readers=n, num_cpus=num_cpus, checksum=kind
        )
        if state_of is not None:
            row["lr"] = delta_lr
        rows[key] = {str(n): row}
        shutil.rmtree(shard_dir)
    del fp32
    return rows


def run_weights_bench(
    *,
    num_params: int = 100_000_000,
    num_generators_list: tuple[int, ...] = (1, 2),
    repeats: int = 5,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    shard_root: Path | None = None,
    checksum: str = DEFAULT_CHECKSUM,
    extra_rows: bool = True,
    delta_lr: float = DEFAULT_DELTA_LR,
) -> dict:
    """Measure memcpy, the bounds, shards and broadcast; top-level figures are medians for
    num_generators_list[0]. With `extra_rows`, for the first generator count also: shards with
    sha256, shards of the model in float32, and delta updates (`adam_like_states` at `delta_lr`)."""
    if repeats < 1 or not num_generators_list or min(num_generators_list) < 1:
        raise ValueError("repeats and every generator count must be >= 1")
    load_start = os.getloadavg()[0]
    torch.set_num_threads(1)  # copies and hashing here are single-stream, like the library's callers
    num_cpus = _num_cpus()
    sd = make_state_dict(num_params)
    num_bytes = num_bytes_of(sd)
    memcpy = measure_memcpy_gbps(num_bytes, repeats=max(11, repeats))  # short: more samples
    base = shard_root or (Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir()))
    detail: dict[str, dict[str, dict]] = {"shards": {}, "broadcast": {}, "broadcast_gloo": {}}
    root = Path(tempfile.mkdtemp(prefix="asyncrl-bench-weights-", dir=base))
    try:
        bounds = measure_bounds(num_bytes, root, bucket_bytes=bucket_bytes, repeats=max(5, repeats))
        for n in num_generators_list:
            rows = _rows_for(
                n,
                sd,
                root,
                bounds,
                memcpy=memcpy,
                repeats=repeats,
                max_shard_bytes=max_shard_bytes,
                bucket_bytes=bucket_bytes,
                checksum=checksum,
                with_extra_rows=extra_rows and n == num_generators_list[0],
                delta_lr=delta_lr,
            )
            for key, row in rows.items():
                detail.setdefault(key, {})[str(n)] = row
    finally:
        shutil.rmtree(root, ignore_errors=True)
    for rows_by_count in detail.values():  # what the CPU work allows when every core is the update's
        for row in rows_by_count.values():
            row["cpu_bound_gbps"] = row.get("bytes", num_bytes) / (row["cpu_s"] / num_cpus) / _GB
    first = str(num_generators_list[0])
    return {
        **_headline(detail, first, sd=sd, num_bytes=num_bytes, memcpy=memcpy),
        "bounds": bounds,
        "max_shard_bytes": max_shard_bytes,
        "bucket_bytes": bucket_bytes,
        "checksum": checksum,
        "repeats": repeats,
        "shard_root": str(base),
        "num_cpus": num_cpus,
        "load_average_1min_start": load_start,
        "load_average_1min": os.getloadavg()[0],
        "detail": detail,
    }


def _rows_for(
    n: int,
    sd: dict[str, torch.Tensor],
    root: Path,
    bounds: dict,
    *,
    memcpy: float,
    repeats: int,
    max_shard_bytes: int,
    bucket_bytes: int,
    checksum: str,
    with_extra_rows: bool,
    delta_lr: float,
) -> dict[str, dict]:
    """Every row for `n` generators, by row name, each with its bound: shards, (with
    `with_extra_rows`) network, sha256, fp32 and delta, then broadcast through the ring and over gloo."""
    from asyncrl.benchmarks.weights_broadcast import bench_broadcast

    num_cpus, num_bytes = _num_cpus(), num_bytes_of(sd)
    rows: dict[str, dict] = {}
    shard_dir = root / f"x{n}"
    shard_dir.mkdir()
    rows["shards"] = bench_shards(
        sd, shard_dir, num_readers=n, repeats=repeats, max_shard_bytes=max_shard_bytes, checksum=checksum
    )
    rows["shards"]["bound"] = shards_bound(
        bounds, num_bytes=num_bytes, num_readers=n, num_cpus=num_cpus, checksum=checksum
    )
    shutil.rmtree(shard_dir)
    if with_extra_rows:
        rows["network"] = _network_row(
            sd, root, repeats=repeats, max_shard_bytes=max_shard_bytes, checksum=checksum
        )
        extra = _extra_rows(
            sd, root, bounds, n=n, repeats=repeats, max_shard_bytes=max_shard_bytes, delta_lr=delta_lr
        )
        rows.update({key: by_count[str(n)] for key, by_count in extra.items()})
    # the default (receivers on this host take the shared-memory ring), then gloo's loopback TCP
    # streams, the row's figure before the ring (weights_broadcast.py)
    rows["broadcast"] = bench_broadcast(
        sd, num_receivers=n, repeats=repeats, bucket_bytes=bucket_bytes, local="shm"
    )
    rows["broadcast"]["bound"] = ring_bound(memcpy, num_receivers=n, num_cpus=num_cpus)
    rows["broadcast_gloo"] = bench_broadcast(
        sd, num_receivers=n, repeats=repeats, bucket_bytes=bucket_bytes, local="gloo"
    )
    rows["broadcast_gloo"]["bound"] = broadcast_bound(
        bounds, num_bytes=num_bytes, num_receivers=n, num_cpus=num_cpus
    )
    return rows


def _network_row(
    sd: dict[str, torch.Tensor], root: Path, *, repeats: int, max_shard_bytes: int, checksum: str
) -> dict:
    """Shards served over the network to a generator without the weights root (weights_network.py)."""
    from asyncrl.benchmarks.weights_network import bench_network

    net_dir = root / "network"
    net_dir.mkdir()
    row = bench_network(sd, net_dir, repeats=repeats, max_shard_bytes=max_shard_bytes, checksum=checksum)
    shutil.rmtree(net_dir)
    return row


def _headline(
    detail: dict[str, dict[str, dict]],
    first: str,
    *,
    sd: dict[str, torch.Tensor],
    num_bytes: int,
    memcpy: float,
) -> dict:
    """The top-level figures: the first generator count's shards and broadcast rows against memcpy."""
    shards_gbps = detail["shards"][first]["gbps"]
    broadcast_gbps = detail["broadcast"][first]["gbps"]
    broadcast_gloo_gbps = detail["broadcast_gloo"][first]["gbps"]
    return {
        "bytes": num_bytes,
        "num_params": sum(t.numel() for t in sd.values()),
        "num_tensors": len(sd),
        "memcpy_gbps": memcpy,
        "shards_gbps": shards_gbps,
        "broadcast_gbps": broadcast_gbps,
        "shards_vs_memcpy": shards_gbps / memcpy,
        "broadcast_vs_memcpy": broadcast_gbps / memcpy,
        "broadcast_gloo_gbps": broadcast_gloo_gbps,
        "broadcast_gloo_vs_memcpy": broadcast_gloo_gbps / memcpy,
    }
