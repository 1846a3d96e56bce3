"""The shards rows of `asyncrl bench weights`: safetensors shards published as `ShardPublisher` does
and loaded by spawned generator processes, with retention as a run has it (weights_run.py runs them
and puts the bounds beside them; bench/README.md, "Weight sync", defines each figure)."""

from __future__ import annotations

import multiprocessing as mp
import statistics
import time
import traceback
from multiprocessing.connection import Connection
from pathlib import Path

import torch

from asyncrl.benchmarks.weights_procs import copy_into, expect, receive, send, start_child, stop_children
from asyncrl.benchmarks.weights_workload import num_bytes_of
from asyncrl.messages import ShardsPublished
from asyncrl.transport.checksum import DEFAULT_CHECKSUM
from asyncrl.transport.delta import DeltaBase
from asyncrl.transport.receiver import WeightsReceiver
from asyncrl.transport.retention import VersionRetention, prune
from asyncrl.transport.shard_read import read_shards
from asyncrl.transport.shards import write_shards

KEEP_LAST = 2  # weights.keep_last's default: retention as in a run
_GB = 1e9


def shard_reader(conn: Connection, root: str, reader_id: str) -> None:
    """A generator that loads announced versions, two ways per version: `load` reads into the
    tensors it holds (the transport's own speed); `fetch` does what a generator does (verified
    fresh tensors from `WeightsReceiver.fetch`, then copied into its parameters and dropped)."""
    try:
        torch.set_num_threads(1)
        receiver = WeightsReceiver(reader_id)
        params: dict[str, torch.Tensor] | None = None
        send(conn, op="ready")
        while (msg := receive(conn))["op"] in ("load", "fetch"):
            t0, cpu0 = time.perf_counter(), time.process_time()
            if params is None:  # the first version allocates
                params = read_shards(Path(root), msg["version"])
            elif msg["op"] == "load":
                read_shards(Path(root), msg["version"], out=params)
            else:
                announcement = ShardsPublished(version=msg["version"], root=root, num_bytes=0)
                state = receiver.fetch(announcement)
                copy_into(params, state)
                del state  # as the generator drops it: freeing is part of the cost
            send(conn, op="done", load_s=time.perf_counter() - t0, cpu_s=time.process_time() - cpu0)
    except Exception:  # tell the parent instead of leaving it waiting
        send(conn, op="error", traceback=traceback.format_exc())
        raise


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
        start_child(ctx, shard_reader, str(root), f"reader-{i}", name=f"shard-reader-{i}")
        for i in range(num_readers)
    ]
    procs, conns = [p for p, _ in started], [c for _, c in started]
    retention = VersionRetention(KEEP_LAST)
    for i in range(num_readers):
        retention.register(f"reader-{i}")
    num_warmup = KEEP_LAST + 1
    delta_base = DeltaBase() if state_of is not None else None
    rounds, fresh_publish_s = [], []
    try:
        for conn in conns:
            expect(conn, "ready")
        for version in range(num_warmup + repeats):
            state = sd if state_of is None else state_of(version)
            figures = _one_version(
                state,
                root,
                version,
                conns,
                retention,
                max_shard_bytes=max_shard_bytes,
                checksum=checksum,
                delta_base=delta_base,
            )
            if version >= num_warmup:
                rounds.append(figures)
            elif version > 0:
                fresh_publish_s.append(figures["publish_s"])
        for conn in conns:
            send(conn, op="stop")
    finally:
        stop_children(procs)
    return _summary(rounds, fresh_publish_s, num_bytes=num_bytes_of(sd), checksum=checksum)


def _one_version(
    state: dict[str, torch.Tensor],
    root: Path,
    version: int,
    conns: list[Connection],
    retention: VersionRetention,
    *,
    max_shard_bytes: int,
    checksum: str,
    delta_base: DeltaBase | None,
) -> dict:
    """Publish `version` as ShardPublisher does, every reader loads it into the tensors it holds,
    then fetches it as a generator does; acks and pruning after the clocks stop. Its figures."""
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
        send(conn, op="load", version=version)
    loads = [expect(conn, "done") for conn in conns]
    t2 = time.perf_counter()
    for conn in conns:
        send(conn, op="fetch", version=version)
    fetches = [expect(conn, "done") for conn in conns]
    t3 = time.perf_counter()
    for i in range(len(conns)):  # acks; pruning is off the critical path, as in a run
        retention.ack(f"reader-{i}", version)
    prune(root, retention, keep_spare=True)
    return {
        "publish_s": t1 - t0,
        "load_s": max(m["load_s"] for m in loads),
        "total_s": t2 - t0,
        "publish_cpu_s": publish_cpu_s,
        "load_cpu_s": sum(m["cpu_s"] for m in loads),
        "cpu_s": publish_cpu_s + sum(m["cpu_s"] for m in loads),
        "generator_s": (t1 - t0) + (t3 - t2),
        "generator_cpu_s": publish_cpu_s + sum(m["cpu_s"] for m in fetches),
        "fetch_s": t3 - t2,
        "delta_bytes": sum(d.size_bytes for d in manifest.delta.files) if manifest.delta else 0,
        "file_bytes": sum(f.size_bytes for f in manifest.files),
    }


def _summary(rounds: list[dict], fresh_publish_s: list[float], *, num_bytes: int, checksum: str) -> dict:
    """The row: medians over the timed rounds, as GB/s of one copy of the weights, and the rounds."""

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
