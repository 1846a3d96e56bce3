"""Weight-sync benchmark (`asyncrl bench weights`): shards and the gloo broadcast group against memcpy.

The heavy half of `asyncrl.benchmarks.weights` (imported only when the command runs); the machine
bounds it reports next to its figures are measured by `weights_bounds.py`.

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

import logging
import multiprocessing as mp
import os
import shutil
import statistics
import tempfile
import time
import traceback
from multiprocessing.connection import Connection
from pathlib import Path

import msgspec
import torch

from asyncrl.benchmarks.weights_bounds import (
    broadcast_bound,
    measure_bounds,
    measure_memcpy_gbps,
    ring_bound,
    shards_bound,
)
from asyncrl.messages import WeightsPublished
from asyncrl.transport.checksum import DEFAULT_CHECKSUM
from asyncrl.transport.delta import DeltaBase
from asyncrl.transport.publisher import MAX_SHARD_BYTES
from asyncrl.transport.receiver import WeightsReceiver
from asyncrl.transport.retention import VersionRetention, prune
from asyncrl.transport.shard_read import read_shards
from asyncrl.transport.shards import write_shards

logger = logging.getLogger(__name__)

HIDDEN = 1024
MATRIX_PARAMS = 4 * HIDDEN * HIDDEN  # one [4096, 1024] bf16 matrix = 8 MiB, like a mid-size MLP weight
DEFAULT_SHARD_BYTES = MAX_SHARD_BYTES  # what runs use (weights.max_shard_bytes)
DEFAULT_BUCKET_BYTES = 4 << 20  # gloo: tensors of 4 MiB or more go alone, without copies
KEEP_LAST = 2  # weights.keep_last's default: retention as in a run
# The delta row's learning rate: RL post-training of LLMs commonly uses 1e-6 (GRPO recipes).
DEFAULT_DELTA_LR = 1e-6
_GB = 1e9


def make_state_dict(num_params: int) -> dict[str, torch.Tensor]:
    """A transformer-shaped state dict of about `num_params` parameters: bf16 matrices, fp32 norms."""
    if num_params < HIDDEN * 2:
        raise ValueError(f"num_params must be >= {HIDDEN * 2}, got {num_params}")
    sd: dict[str, torch.Tensor] = {}
    vocab = max(1, num_params // 4 // HIDDEN)
    sd["model.embed_tokens.weight"] = torch.empty(vocab, HIDDEN, dtype=torch.bfloat16).uniform_()
    remaining = num_params - vocab * HIDDEN
    layer = 0
    while remaining > HIDDEN:
        rows = max(1, min(MATRIX_PARAMS, remaining - HIDDEN) // HIDDEN)
        sd[f"model.layers.{layer}.mlp.weight"] = torch.empty(rows, HIDDEN, dtype=torch.bfloat16).uniform_()
        sd[f"model.layers.{layer}.norm.weight"] = torch.ones(HIDDEN, dtype=torch.float32)
        remaining -= rows * HIDDEN + HIDDEN
        layer += 1
    return sd


def num_bytes_of(sd: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in sd.values())


# ---------------------------------------------------------------------------------------------- children


def _send(conn: Connection, **fields: object) -> None:
    conn.send_bytes(msgspec.json.encode(fields))


def _recv(conn: Connection) -> dict:
    return msgspec.json.decode(conn.recv_bytes())


def _apply(params: dict[str, torch.Tensor], state: dict[str, torch.Tensor]) -> None:
    """What the torch generator's `apply_pending` does with offered weights: copy into the model."""
    with torch.no_grad():
        for name, tensor in state.items():
            params[name].copy_(tensor)


def shard_reader(conn: Connection, root: str, reader_id: str) -> None:
    """A generator that loads announced versions, two ways per version: `load` reads into the
    tensors it holds (the transport's own speed); `fetch` does what a generator does (verified
    fresh tensors from `WeightsReceiver.fetch`, then copied into its parameters and dropped)."""
    try:
        torch.set_num_threads(1)
        receiver = WeightsReceiver(reader_id)
        params: dict[str, torch.Tensor] | None = None
        _send(conn, op="ready")
        while (msg := _recv(conn))["op"] in ("load", "fetch"):
            t0, cpu0 = time.perf_counter(), time.process_time()
            if params is None:  # the first version allocates
                params = read_shards(Path(root), msg["version"])
            elif msg["op"] == "load":
                read_shards(Path(root), msg["version"], out=params)
            else:
                announcement = WeightsPublished(
                    version=msg["version"], transport="safetensors", location=root, num_bytes=0
                )
                state = receiver.fetch(announcement)
                _apply(params, state)
                del state  # as the generator drops it: freeing is part of the cost
            _send(conn, op="done", load_s=time.perf_counter() - t0, cpu_s=time.process_time() - cpu0)
    except Exception:  # tell the parent instead of leaving it waiting
        _send(conn, op="error", traceback=traceback.format_exc())
        raise


def _expect(conn: Connection, op: str) -> dict:
    msg = _recv(conn)
    if msg["op"] != op:
        raise RuntimeError(f"bench child sent {msg['op']!r} instead of {op!r}: {msg.get('traceback', '')}")
    return msg


def _start(
    ctx: mp.context.SpawnContext, target: object, *args: object, name: str
) -> tuple[mp.Process, Connection]:
    parent_end, child_end = ctx.Pipe()
    proc = ctx.Process(target=target, args=(child_end, *args), name=name, daemon=True)
    proc.start()
    child_end.close()
    return proc, parent_end


def _stop(procs: list[mp.Process]) -> None:
    for proc in procs:  # only the processes this bench started
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()
            proc.join()


# ---------------------------------------------------------------------------------------------- runs


def adam_like_states(sd: dict[str, torch.Tensor], *, lr: float, seed: int = 0):
    """Versions of `sd` as training with a small learning rate makes them: float32 master weights
    (matrices drawn N(0, 0.02) as at initialisation, the rest as given) each moved by `lr` times a
    random sign per element (Adam's first steps move every element by about lr), published in
    each tensor's dtype. Returns `state_of(version)`; versions must be asked for in order."""
    g = torch.Generator().manual_seed(seed)
    master = {
        n: (torch.empty(t.shape).normal_(0.0, 0.02, generator=g) if t.dim() > 1 else t.float().clone())
        for n, t in sd.items()
    }
    step = [0]

    def state_of(version: int) -> dict[str, torch.Tensor]:
        while step[0] < version:
            for t in master.values():
                signs = torch.randint(0, 2, t.shape, generator=g, dtype=torch.int8).float().mul_(2).sub_(1)
                t.add_(signs, alpha=lr)
            step[0] += 1
        return {n: master[n].to(sd[n].dtype) for n in sd}

    return state_of


def bench_shards(
    sd: dict[str, torch.Tensor],
    root: Path,
    *,
    num_readers: int,
    repeats: int,
    max_shard_bytes: int,
    checksum: str = DEFAULT_CHECKSUM,
    state_of=None,
) -> dict:
    """Publish and load `repeats` timed versions after warm-up, with retention as a run has it.

    Warm-up: version 0 (readers allocate their tensors) up to version KEEP_LAST, the first one
    pruned; from then on every publish finds the pruned version's files to overwrite, as a run does
    after its first few steps. The warm-up publishes after version 0 created new files: their median
    is `publish_fresh_gbps`. With `state_of` (version -> state dict, e.g. `adam_like_states`) each
    version differs and is published with a delta (`weights.delta`); the readers' `fetch` then
    applies it to the version they hold, and `delta_bytes` is what each delta weighs.
    """
    ctx = mp.get_context("spawn")
    started = [
        _start(ctx, shard_reader, str(root), f"reader-{i}", name=f"shard-reader-{i}")
        for i in range(num_readers)
    ]
    procs, conns = [p for p, _ in started], [c for _, c in started]
    retention = VersionRetention(KEEP_LAST)
    for i in range(num_readers):
        retention.register(f"reader-{i}")
    num_bytes = num_bytes_of(sd)
    num_warmup = KEEP_LAST + 1
    delta_base = DeltaBase() if state_of is not None else None
    rounds, fresh_publish_s = [], []
    try:
        for conn in conns:
            _expect(conn, "ready")
        for version in range(num_warmup + repeats):
            state = sd if state_of is None else state_of(version)
            t0, cpu0 = time.perf_counter(), time.process_time()
            manifest = write_shards(  # as ShardPublisher
                state,
                root,
                version,
                max_shard_bytes=max_shard_bytes,
                fsync=False,
                checksum=checksum,
                delta_base=delta_base,
            )
            t1, publish_cpu_s = time.perf_counter(), time.process_time() - cpu0
            retention.publish(version)
            for conn in conns:
                _send(conn, op="load", version=version)
            loads = [_expect(conn, "done") for conn in conns]
            t2 = time.perf_counter()
            for conn in conns:
                _send(conn, op="fetch", version=version)
            fetches = [_expect(conn, "done") for conn in conns]
            t3 = time.perf_counter()
            for i in range(num_readers):  # acks; pruning is off the critical path, as in a run
                retention.ack(f"reader-{i}", version)
            prune(root, retention, keep_spare=True)
            if version >= num_warmup:
                rounds.append(
                    {
                        "publish_s": t1 - t0,
                        "load_s": max(m["load_s"] for m in loads),
                        "total_s": t2 - t0,
                        "publish_cpu_s": publish_cpu_s,
                        "load_cpu_s": sum(m["cpu_s"] for m in loads),
                        "cpu_s": publish_cpu_s + sum(m["cpu_s"] for m in loads),
                        "generator_s": (t1 - t0) + (t3 - t2),
                        "generator_cpu_s": publish_cpu_s + sum(m["cpu_s"] for m in fetches),
                        "fetch_s": t3 - t2,
                        "delta_bytes": sum(d.size_bytes for d in manifest.delta.files)
                        if manifest.delta
                        else 0,
                        "file_bytes": sum(f.size_bytes for f in manifest.files),
                    }
                )
            elif version > 0:
                fresh_publish_s.append(t1 - t0)
        for conn in conns:
            _send(conn, op="stop")
    finally:
        _stop(procs)

    def median(key: str) -> float:
        return statistics.median(r[key] for r in rounds)

    return {
        "checksum": checksum,
        "bytes": num_bytes,
        "gbps": num_bytes / median("total_s") / _GB,
        "publish_gbps": num_bytes / median("publish_s") / _GB,
        "publish_fresh_gbps": num_bytes / statistics.median(fresh_publish_s) / _GB,
        "load_gbps": num_bytes / median("load_s") / _GB,
        "total_s": median("total_s"),
        "cpu_s": median("cpu_s"),
        "publish_cpu_s": median("publish_cpu_s"),
        "load_cpu_s": median("load_cpu_s"),
        "generator_gbps": num_bytes / median("generator_s") / _GB,
        "generator_cpu_s": median("generator_cpu_s"),
        "fetch_gbps": num_bytes / median("fetch_s") / _GB,
        "delta_bytes": median("delta_bytes"),
        "rounds": rounds,
    }


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
    num_cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
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
    from asyncrl.benchmarks.weights_broadcast import bench_broadcast  # it imports this module

    load_start = os.getloadavg()[0]
    torch.set_num_threads(1)  # copies and hashing here are single-stream, like the library's callers
    num_cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    sd = make_state_dict(num_params)
    num_bytes = num_bytes_of(sd)
    memcpy = measure_memcpy_gbps(num_bytes, repeats=max(11, repeats))  # short: more samples
    base = shard_root or (Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir()))
    detail: dict[str, dict[str, dict]] = {"shards": {}, "broadcast": {}, "broadcast_gloo": {}}
    root = Path(tempfile.mkdtemp(prefix="asyncrl-bench-weights-", dir=base))
    try:
        bounds = measure_bounds(num_bytes, root, bucket_bytes=bucket_bytes, repeats=max(5, repeats))
        for n in num_generators_list:
            shard_dir = root / f"x{n}"
            shard_dir.mkdir()
            detail["shards"][str(n)] = bench_shards(
                sd,
                shard_dir,
                num_readers=n,
                repeats=repeats,
                max_shard_bytes=max_shard_bytes,
                checksum=checksum,
            )
            detail["shards"][str(n)]["bound"] = shards_bound(
                bounds, num_bytes=num_bytes, num_readers=n, num_cpus=num_cpus, checksum=checksum
            )
            shutil.rmtree(shard_dir)
            if extra_rows and n == num_generators_list[0]:
                from asyncrl.benchmarks.weights_network import bench_network

                (net_dir := root / "network").mkdir()
                detail["network"] = {
                    str(n): bench_network(
                        sd, net_dir, repeats=repeats, max_shard_bytes=max_shard_bytes, checksum=checksum
                    )
                }
                shutil.rmtree(net_dir)
                detail.update(
                    _extra_rows(
                        sd,
                        root,
                        bounds,
                        n=n,
                        repeats=repeats,
                        max_shard_bytes=max_shard_bytes,
                        delta_lr=delta_lr,
                    )
                )
            # the default (receivers on this host take the shared-memory ring), then gloo's
            # loopback TCP streams, the row's figure before the ring (weights_broadcast.py)
            detail["broadcast"][str(n)] = bench_broadcast(
                sd, num_receivers=n, repeats=repeats, bucket_bytes=bucket_bytes, local="shm"
            )
            detail["broadcast"][str(n)]["bound"] = ring_bound(memcpy, num_receivers=n, num_cpus=num_cpus)
            detail["broadcast_gloo"][str(n)] = bench_broadcast(
                sd, num_receivers=n, repeats=repeats, bucket_bytes=bucket_bytes, local="gloo"
            )
            detail["broadcast_gloo"][str(n)]["bound"] = broadcast_bound(
                bounds, num_bytes=num_bytes, num_receivers=n, num_cpus=num_cpus
            )
    finally:
        shutil.rmtree(root, ignore_errors=True)
    for rows in detail.values():  # what the CPU work allows when every core is the update's
        for row in rows.values():
            row["cpu_bound_gbps"] = row.get("bytes", num_bytes) / (row["cpu_s"] / num_cpus) / _GB
    first = str(num_generators_list[0])
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
