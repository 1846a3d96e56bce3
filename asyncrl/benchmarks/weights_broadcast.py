"""The broadcast rows of `asyncrl bench weights`: the CPU weight update group, learner -> generators.

Place in the data flow: measures `asyncrl.transport.broadcast` as runs use it on one host. The
parent plays learner rank 0 and sends; spawned processes play generators and receive, into the
tensors they hold and, in a second update per round, as a generator does (fresh tensors, then
copied into its parameters). Two rows, each timed from the send to an all-reduce that says every
receiver holds every byte:

  broadcast       what runs do by default (weights.broadcast_local = "shm"): receivers on the
                  learner's host read the bytes from the shared-memory ring (`shm_ring.py`);
                  `ring_readers` says how many did (a host without the ring falls back to gloo)
  broadcast_gloo  weights.broadcast_local = "gloo": every receiver gets gloo's point-to-point
                  sends, one loopback TCP stream each (what the broadcast row measured before
                  the ring)
"""

from __future__ import annotations

import multiprocessing as mp
import socket
import statistics
import time
import traceback
from multiprocessing.connection import Connection

import msgspec
import torch

from asyncrl.benchmarks.weights_procs import copy_into, expect, send, start_child, stop_children
from asyncrl.benchmarks.weights_workload import num_bytes_of
from asyncrl.messages import TensorMeta
from asyncrl.transport import pairwise
from asyncrl.transport.broadcast import (
    broadcast_tensors,
    destroy_weight_update_group,
    init_weight_update_group,
    receive_tensors,
    tensor_metas,
    uses_point_to_point,
)

GROUP_TIMEOUT_S = 300.0
P2P = uses_point_to_point("gloo")  # as BroadcastPublisher and WeightsReceiver decide on a CPU group
_GB = 1e9


def broadcast_receiver(
    conn: Connection, rank: int, world_size: int, port: int, group_name: str, bucket_bytes: int, rounds: int
) -> None:
    """A generator in the weight group: receives two updates per round, one into the tensors it
    holds and one as a generator does (fresh tensors, as `WeightsReceiver` gets them, then copied
    into its parameters); the first round's first update allocates. Which path the bytes take is
    the sender's choice (`local`), as in a run."""
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
        cpu_s, generator_cpu_s = [], []
        for _ in range(rounds):
            cpu0 = time.process_time()
            params = receive_tensors(group, metas, bucket_bytes=bucket_bytes, out=params, p2p=P2P)
            torch.distributed.all_reduce(done, group=group)  # tells rank 0 every byte has arrived
            cpu1 = time.process_time()
            state = receive_tensors(group, metas, bucket_bytes=bucket_bytes, p2p=P2P)
            copy_into(params, state)
            del state
            torch.distributed.all_reduce(done, group=group)
            cpu_s.append(cpu1 - cpu0)
            generator_cpu_s.append(time.process_time() - cpu1)
        destroy_weight_update_group(group)
        send(conn, op="finished", cpu_s=cpu_s, generator_cpu_s=generator_cpu_s)
    except Exception:
        send(conn, op="error", traceback=traceback.format_exc())
        raise


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def bench_broadcast(
    sd: dict[str, torch.Tensor], *, num_receivers: int, repeats: int, bucket_bytes: int, local: str = "shm"
) -> dict:
    """One broadcast row: `num_receivers` generators, `repeats` timed rounds after one warm-up,
    the sender sending as `broadcast_tensors(..., local=local)` does."""
    ctx = mp.get_context("spawn")
    port = _free_port()
    world_size = num_receivers + 1
    group_name = f"bench-weights-{local}-{num_receivers}"
    metas = msgspec.json.encode(tensor_metas(sd))
    rounds = repeats + 1  # the first round warms up (receivers allocate their tensors)
    started = [
        start_child(
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
    times_s: list[float] = []
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
        sender_cpu_s, generator_times_s, generator_sender_cpu_s = [], [], []
        ring_readers = 0
        for _ in range(rounds):
            for times, cpu_times in ((times_s, sender_cpu_s), (generator_times_s, generator_sender_cpu_s)):
                t0, cpu0 = time.perf_counter(), time.process_time()
                broadcast_tensors(group, sd, bucket_bytes=bucket_bytes, p2p=P2P, local=local)
                torch.distributed.all_reduce(done, group=group)
                times.append(time.perf_counter() - t0)
                cpu_times.append(time.process_time() - cpu0)
            ring = pairwise._send_rings.get(group)
            ring_readers = len(ring.readers) if ring is not None else 0
        destroy_weight_update_group(group)
        finished = [expect(conn, "finished") for conn in conns]
    finally:
        stop_children(procs)

    def total_cpu_s(sender: list[float], key: str) -> float:
        return statistics.median(sender[i] + sum(m[key][i] for m in finished) for i in range(1, rounds))

    return {
        "local": local,
        "ring_readers": ring_readers,
        "gbps": num_bytes / statistics.median(times_s[1:]) / _GB,
        "total_s": statistics.median(times_s[1:]),
        "cpu_s": total_cpu_s(sender_cpu_s, "cpu_s"),
        "sender_cpu_s": statistics.median(sender_cpu_s[1:]),
        "generator_gbps": num_bytes / statistics.median(generator_times_s[1:]) / _GB,
        "generator_cpu_s": total_cpu_s(generator_sender_cpu_s, "generator_cpu_s"),
        "rounds_s": times_s[1:],
    }
