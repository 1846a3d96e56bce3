"""Weight-sync benchmark (`asyncrl bench weights`): shards and the gloo broadcast group against memcpy.

The heavy half of `asyncrl.benchmarks.weights` (imported only when the command runs).

Place in the data flow: measures the learner -> generators weight path (asyncrl.transport.shards and
asyncrl.transport.broadcast) on this machine. The parent process plays learner rank 0 and publishes
or broadcasts; spawned processes play generators and load into tensors they already hold (as a
generator loads into its model's parameters). Process start-up is outside every timed region.

Figures (GB/s = 1e9 bytes/s, one copy of the weights as the unit of work):
  memcpy_gbps     torch copy of a buffer of the same size, warm (destination already touched)
  shards_gbps     bytes / (publish (write + sha256 + fsync + rename) + the slowest reader's verified load)
  broadcast_gbps  bytes / (broadcast until every receiver holds all bytes, confirmed by an all-reduce)
  cpu_s           CPU seconds of all processes for one update (wall figures move with other load on
                  the machine; CPU seconds much less so)

    asyncrl bench weights --json
    asyncrl bench weights --num-params 20000000 --generators 1 --generators 2 --repeats 3
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import shutil
import socket
import statistics
import tempfile
import time
import traceback
from multiprocessing.connection import Connection
from pathlib import Path

import msgspec
import torch

from asyncrl.messages import TensorMeta
from asyncrl.transport.broadcast import (
    broadcast_tensors,
    destroy_weight_update_group,
    init_weight_update_group,
    receive_tensors,
    tensor_metas,
)
from asyncrl.transport.shards import read_shards, version_dir, write_shards

logger = logging.getLogger(__name__)

HIDDEN = 1024
MATRIX_PARAMS = 4 * HIDDEN * HIDDEN  # one [4096, 1024] bf16 matrix = 8 MiB, like a mid-size MLP weight
DEFAULT_SHARD_BYTES = 64 << 20
DEFAULT_BUCKET_BYTES = 4 << 20  # gloo: tensors of 4 MiB or more go alone, without copies
GROUP_TIMEOUT_S = 300.0
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


def measure_memcpy_gbps(num_bytes: int, *, repeats: int) -> float:
    src = torch.ones(num_bytes, dtype=torch.uint8)
    dst = torch.zeros_like(src)  # touched, so page faults are not timed
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return num_bytes / statistics.median(times) / _GB


# ---------------------------------------------------------------------------------------------- children


def _send(conn: Connection, **fields: object) -> None:
    conn.send_bytes(msgspec.json.encode(fields))


def _recv(conn: Connection) -> dict:
    return msgspec.json.decode(conn.recv_bytes())


def shard_reader(conn: Connection, root: str) -> None:
    """A generator that loads announced versions; the first load allocates, later ones load in place."""
    try:
        torch.set_num_threads(1)
        params: dict[str, torch.Tensor] | None = None
        _send(conn, op="ready")
        while (msg := _recv(conn))["op"] == "load":
            t0, cpu0 = time.perf_counter(), time.process_time()
            if params is None:
                params = read_shards(Path(root), msg["version"])
            else:
                read_shards(Path(root), msg["version"], out=params)
            _send(conn, op="done", load_s=time.perf_counter() - t0, cpu_s=time.process_time() - cpu0)
    except Exception:  # tell the parent instead of leaving it waiting
        _send(conn, op="error", traceback=traceback.format_exc())
        raise


def broadcast_receiver(
    conn: Connection, rank: int, world_size: int, port: int, group_name: str, bucket_bytes: int, rounds: int
) -> None:
    """A generator in the weight group: receives `rounds` updates, the first into fresh tensors."""
    try:
        torch.set_num_threads(1)
        metas = msgspec.json.decode(conn.recv_bytes(), type=list[TensorMeta])
        group = init_weight_update_group(
            master_addr="127.0.0.1",
            master_port=port,
            rank=rank,
            world_size=world_size,
            group_name=group_name,
            timeout_s=GROUP_TIMEOUT_S,
        )
        params = None
        done = torch.zeros(1)
        cpu_s = []
        for _ in range(rounds):
            cpu0 = time.process_time()
            params = receive_tensors(group, metas, bucket_bytes=bucket_bytes, out=params)
            torch.distributed.all_reduce(done, group=group)  # tells rank 0 every byte has arrived
            cpu_s.append(time.process_time() - cpu0)
        destroy_weight_update_group(group)
        _send(conn, op="finished", cpu_s=cpu_s)
    except Exception:
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


def bench_shards(
    sd: dict[str, torch.Tensor], root: Path, *, num_readers: int, repeats: int, max_shard_bytes: int
) -> dict:
    ctx = mp.get_context("spawn")
    started = [_start(ctx, shard_reader, str(root), name=f"shard-reader-{i}") for i in range(num_readers)]
    procs, conns = [p for p, _ in started], [c for _, c in started]
    num_bytes = num_bytes_of(sd)
    rounds = []
    try:
        for conn in conns:
            _expect(conn, "ready")
        for version in range(repeats + 1):  # version 0 warms up (readers allocate their tensors)
            t0, cpu0 = time.perf_counter(), time.process_time()
            write_shards(sd, root, version, max_shard_bytes=max_shard_bytes)
            t1, publish_cpu_s = time.perf_counter(), time.process_time() - cpu0
            for conn in conns:
                _send(conn, op="load", version=version)
            loads = [_expect(conn, "done") for conn in conns]
            t2 = time.perf_counter()
            if version > 0:
                rounds.append(
                    {
                        "publish_s": t1 - t0,
                        "load_s": max(m["load_s"] for m in loads),
                        "total_s": t2 - t0,
                        "cpu_s": publish_cpu_s + sum(m["cpu_s"] for m in loads),
                    }
                )
            if version > 0:  # keep the tmpfs footprint at two versions
                shutil.rmtree(version_dir(root, version - 1))
        for conn in conns:
            _send(conn, op="stop")
    finally:
        _stop(procs)
    publish_s = statistics.median(r["publish_s"] for r in rounds)
    load_s = statistics.median(r["load_s"] for r in rounds)
    total_s = statistics.median(r["total_s"] for r in rounds)
    return {
        "gbps": num_bytes / total_s / _GB,
        "publish_gbps": num_bytes / publish_s / _GB,
        "load_gbps": num_bytes / load_s / _GB,
        "total_s": total_s,
        "cpu_s": statistics.median(r["cpu_s"] for r in rounds),
        "rounds": rounds,
    }


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def bench_broadcast(
    sd: dict[str, torch.Tensor], *, num_receivers: int, repeats: int, bucket_bytes: int
) -> dict:
    ctx = mp.get_context("spawn")
    port = _free_port()
    world_size = num_receivers + 1
    group_name = f"bench-weights-{num_receivers}"
    metas = msgspec.json.encode(tensor_metas(sd))
    rounds = repeats + 1  # the first round warms up (receivers allocate their tensors)
    started = [
        _start(
            ctx,
            broadcast_receiver,
            rank,
            world_size,
            port,
            group_name,
            bucket_bytes,
            rounds,
            name=f"receiver-{rank}",
        )
        for rank in range(1, world_size)
    ]
    procs, conns = [p for p, _ in started], [c for _, c in started]
    num_bytes = num_bytes_of(sd)
    times_s = []
    try:
        for conn in conns:
            conn.send_bytes(metas)
        group = init_weight_update_group(
            master_addr="127.0.0.1",
            master_port=port,
            rank=0,
            world_size=world_size,
            group_name=group_name,
            timeout_s=GROUP_TIMEOUT_S,
        )
        done = torch.zeros(1)
        sender_cpu_s = []
        for _ in range(rounds):
            t0, cpu0 = time.perf_counter(), time.process_time()
            broadcast_tensors(group, sd, bucket_bytes=bucket_bytes)
            torch.distributed.all_reduce(done, group=group)
            times_s.append(time.perf_counter() - t0)
            sender_cpu_s.append(time.process_time() - cpu0)
        destroy_weight_update_group(group)
        receiver_cpu_s = [_expect(conn, "finished")["cpu_s"] for conn in conns]
    finally:
        _stop(procs)
    cpu_s = [sender_cpu_s[i] + sum(r[i] for r in receiver_cpu_s) for i in range(1, rounds)]
    return {
        "gbps": num_bytes / statistics.median(times_s[1:]) / _GB,
        "total_s": statistics.median(times_s[1:]),
        "cpu_s": statistics.median(cpu_s),
        "rounds_s": times_s[1:],
    }


def run_weights_bench(
    *,
    num_params: int = 100_000_000,
    num_generators_list: tuple[int, ...] = (1, 2),
    repeats: int = 3,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    shard_root: Path | None = None,
) -> dict:
    """Measure memcpy, shards and broadcast; top-level figures are medians for num_generators_list[0]."""
    if repeats < 1 or not num_generators_list or min(num_generators_list) < 1:
        raise ValueError("repeats and every generator count must be >= 1")
    torch.set_num_threads(1)  # copies and hashing here are single-stream, like the library's callers
    sd = make_state_dict(num_params)
    num_bytes = num_bytes_of(sd)
    memcpy = measure_memcpy_gbps(num_bytes, repeats=max(11, repeats))  # short: more samples
    base = shard_root or (Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir()))
    detail: dict[str, dict[str, dict]] = {"shards": {}, "broadcast": {}}
    for n in num_generators_list:
        root = Path(tempfile.mkdtemp(prefix="asyncrl-bench-weights-", dir=base))
        try:
            detail["shards"][str(n)] = bench_shards(
                sd, root, num_readers=n, repeats=repeats, max_shard_bytes=max_shard_bytes
            )
        finally:
            shutil.rmtree(root, ignore_errors=True)
        detail["broadcast"][str(n)] = bench_broadcast(
            sd, num_receivers=n, repeats=repeats, bucket_bytes=bucket_bytes
        )
    first = str(num_generators_list[0])
    shards_gbps = detail["shards"][first]["gbps"]
    broadcast_gbps = detail["broadcast"][first]["gbps"]
    return {
        "bytes": num_bytes,
        "num_params": sum(t.numel() for t in sd.values()),
        "num_tensors": len(sd),
        "memcpy_gbps": memcpy,
        "shards_gbps": shards_gbps,
        "broadcast_gbps": broadcast_gbps,
        "shards_vs_memcpy": shards_gbps / memcpy,
        "broadcast_vs_memcpy": broadcast_gbps / memcpy,
        "max_shard_bytes": max_shard_bytes,
        "bucket_bytes": bucket_bytes,
        "shard_root": str(base),
        "num_cpus": os.cpu_count(),
        "load_average_1min": os.getloadavg()[0],
        "detail": detail,
    }
