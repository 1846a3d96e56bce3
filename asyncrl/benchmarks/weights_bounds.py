"""What bounds weight sync on this machine, for `asyncrl bench weights`: single-core rates and limits.

Place in the data flow: the weight paths under test are learner rank 0 -> generators, by safetensors
shards (`asyncrl.transport.shards`, `shard_read`) or by the CPU broadcast group
(`asyncrl.transport.broadcast`: the same-host shared-memory ring, or gloo). `weights_run.py`
measures those paths end to end; this module measures, in the same run, the machine work they are
made of (memcpy, each checksum kind, zstd on XOR data, tmpfs file writes and reads, one loopback
TCP stream) and turns those rates into what each transport could reach at best (`shards_bound`,
`ring_bound`, `broadcast_bound`), so a figure can be read against its ceiling.

memcpy is a median (the reference the figures are divided by); every other rate is the fastest of
its repeats, since a bound is what the machine can do and other load on it should not lower it.
Each probe runs on at most `_BOUND_BYTES_MAX` bytes: the rates are per byte.
"""

from __future__ import annotations

import os
import socket
import statistics
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

from asyncrl.transport.checksum import CHECKSUM_KINDS, new_hasher
from asyncrl.transport.shard_io import CHUNK_BYTES

__all__ = [
    "broadcast_bound",
    "measure_bounds",
    "measure_checksum_gbps",
    "measure_file_gbps",
    "measure_loopback_tcp",
    "measure_memcpy_gbps",
    "ring_bound",
    "shards_bound",
]

_GB = 1e9
_BOUND_BYTES_MAX = 256 << 20  # the bounds are per-byte rates: no need to measure them on more


def measure_memcpy_gbps(num_bytes: int, *, repeats: int) -> float:
    """torch copy of `num_bytes` on one thread into a touched destination: median GB/s."""
    src = torch.ones(num_bytes, dtype=torch.uint8)
    dst = torch.zeros_like(src)  # touched, so page faults are not timed
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return num_bytes / statistics.median(times) / _GB


def _best_rate(num_bytes: int, run: Callable[[], object], *, repeats: int) -> float:
    """GB/s of the fastest of `repeats` timed calls of `run()`: a bound is what the machine can do,
    so other load on it should not lower the bound (it lowers the medians of the figures)."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    return num_bytes / min(times) / _GB


def measure_checksum_gbps(kind: str, num_bytes: int, *, repeats: int) -> float:
    """One checksum kind (`transport/checksum.py`) on one core, in the chunks the shard writer and
    reader hash."""
    view = memoryview(torch.ones(num_bytes, dtype=torch.uint8).numpy())

    def run() -> None:
        hasher = new_hasher(kind)
        for start in range(0, num_bytes, CHUNK_BYTES):
            hasher.update(view[start : start + CHUNK_BYTES])

    return _best_rate(num_bytes, run, repeats=repeats)


def measure_zstd_gbps(num_bytes: int, *, repeats: int) -> dict[str, float]:
    """zstd level 1 (`transport/delta.py`) on one core, compressing and decompressing XOR bytes of
    a bf16 tensor against itself after a small change to 1% of its elements (what a delta of a
    small-lr update looks like): GB/s of uncompressed bytes, and the compressed fraction."""
    import io

    import zstandard

    g = torch.Generator().manual_seed(0)
    xor = torch.zeros(num_bytes // 2, dtype=torch.int16)
    changed = torch.rand(xor.shape, generator=g) < 0.01
    xor[changed] = torch.randint(1, 4, (int(changed.sum()),), generator=g, dtype=torch.int16)
    view = memoryview(xor.view(torch.uint8).numpy())
    compressor = zstandard.ZstdCompressor(level=1)
    packed = compressor.compress(view)
    out = memoryview(torch.zeros(len(view), dtype=torch.uint8).numpy())

    def decompress() -> None:
        reader = zstandard.ZstdDecompressor().stream_reader(io.BytesIO(packed))
        pos = 0
        while pos < len(out):
            pos += reader.readinto(out[pos : pos + CHUNK_BYTES])

    return {
        "compress_gbps": _best_rate(len(view), lambda: compressor.compress(view), repeats=repeats),
        "decompress_gbps": _best_rate(len(view), decompress, repeats=repeats),
        "fraction": len(packed) / len(view),
    }


def measure_file_gbps(num_bytes: int, directory: Path, *, repeats: int) -> dict[str, float]:
    """One thread writing a new file, overwriting an existing one, and reading one into memory."""
    src = memoryview(torch.ones(num_bytes, dtype=torch.uint8).numpy())
    dst = memoryview(torch.zeros(num_bytes, dtype=torch.uint8).numpy())
    path = directory / "bound-probe"

    def write(flags: int) -> None:
        fd = os.open(path, os.O_WRONLY | flags, 0o644)
        try:
            for start in range(0, num_bytes, CHUNK_BYTES):
                os.write(fd, src[start : start + CHUNK_BYTES])
        finally:
            os.close(fd)

    def read() -> None:
        fd = os.open(path, os.O_RDONLY)
        try:
            pos = 0
            while pos < num_bytes:
                pos += os.readv(fd, [dst[pos : pos + CHUNK_BYTES]])
        finally:
            os.close(fd)

    try:
        new_times = []
        for _ in range(repeats):  # the unlink is not timed: pruning happens off the critical path
            path.unlink(missing_ok=True)
            t0 = time.perf_counter()
            write(os.O_CREAT | os.O_EXCL)
            new_times.append(time.perf_counter() - t0)
        return {
            "write_new_gbps": num_bytes / min(new_times) / _GB,
            "write_recycled_gbps": _best_rate(num_bytes, lambda: write(0), repeats=repeats),
            "read_gbps": _best_rate(num_bytes, read, repeats=repeats),
        }
    finally:
        path.unlink(missing_ok=True)


def measure_loopback_tcp(num_bytes: int, *, chunk_bytes: int, repeats: int) -> dict[str, float]:
    """One TCP stream over 127.0.0.1 (a sending and a receiving thread; the kernel does the work, as
    for gloo's connections): GB/s and CPU seconds per GB of both ends together."""
    src = memoryview(torch.ones(num_bytes, dtype=torch.uint8).numpy())
    dst = memoryview(torch.zeros(num_bytes, dtype=torch.uint8).numpy())
    with socket.create_server(("127.0.0.1", 0)) as server:
        sender = socket.create_connection(server.getsockname())
        receiver, _ = server.accept()
    received_bytes = [0]

    def drain() -> None:
        pos = 0
        while pos < num_bytes:
            n = receiver.recv_into(dst[pos : pos + chunk_bytes])
            if n == 0:
                break  # the sender is gone; the caller sees the short count
            pos += n
        received_bytes[0] = pos

    times, cpu_times = [], []
    try:
        for _ in range(repeats):
            drainer = threading.Thread(target=drain, name="bench-tcp-drain")
            t0, cpu0 = time.perf_counter(), time.process_time()
            drainer.start()
            for start in range(0, num_bytes, chunk_bytes):
                sender.sendall(src[start : start + chunk_bytes])
            drainer.join()
            times.append(time.perf_counter() - t0)
            cpu_times.append(time.process_time() - cpu0)
            if received_bytes[0] != num_bytes:
                raise RuntimeError(f"loopback probe received {received_bytes[0]} of {num_bytes} bytes")
    finally:
        sender.close()
        receiver.close()
    return {
        "gbps": num_bytes / min(times) / _GB,
        "cpu_s_per_gb": min(cpu_times) / (num_bytes / _GB),
    }


def measure_bounds(num_bytes: int, shard_dir: Path, *, bucket_bytes: int, repeats: int) -> dict[str, float]:
    """Every single-core rate the bounds use; files are probed in `shard_dir` (where shards go)."""
    probe_bytes = min(num_bytes, _BOUND_BYTES_MAX)
    files = measure_file_gbps(probe_bytes, shard_dir, repeats=repeats)
    tcp = measure_loopback_tcp(probe_bytes, chunk_bytes=bucket_bytes, repeats=repeats)
    checksums = {kind: measure_checksum_gbps(kind, probe_bytes, repeats=repeats) for kind in CHECKSUM_KINDS}
    zstd = measure_zstd_gbps(probe_bytes, repeats=repeats)
    return {
        **{f"{kind}_gbps_per_core": rate for kind, rate in checksums.items()},
        "zstd_compress_gbps": zstd["compress_gbps"],
        "zstd_decompress_gbps": zstd["decompress_gbps"],
        "file_write_new_gbps": files["write_new_gbps"],
        "file_write_recycled_gbps": files["write_recycled_gbps"],
        "file_read_gbps": files["read_gbps"],
        "loopback_tcp_gbps": tcp["gbps"],
        "loopback_tcp_cpu_s_per_gb": tcp["cpu_s_per_gb"],
    }


def shards_bound(
    bounds: dict[str, float], *, num_bytes: int, num_readers: int, num_cpus: int, checksum: str = "xxh3"
) -> dict:
    """What shards can reach here: the writer and every reader each hash all bytes (`checksum`,
    sequential within a file; files go in parallel), the writer writes them once (into recycled
    files) and every reader copies them once; on `num_cpus` cores that work takes at least its CPU
    time divided by the cores."""
    gb = num_bytes / _GB
    hash_rate = bounds[f"{checksum}_gbps_per_core"]
    hash_s = (1 + num_readers) * gb / hash_rate
    write_s = gb / bounds["file_write_recycled_gbps"]
    read_s = gb / bounds["file_read_gbps"]
    copy_s = write_s + num_readers * read_s
    return {
        "checksum": checksum,
        "hash_cpu_s": hash_s,
        "copy_cpu_s": copy_s,
        "gbps": gb / ((hash_s + copy_s) / num_cpus),
        "hash_only_gbps": gb / (hash_s / num_cpus),
    }


def broadcast_bound(bounds: dict[str, float], *, num_bytes: int, num_receivers: int, num_cpus: int) -> dict:
    """What the gloo group can reach here: every receiver gets its own TCP stream from rank 0, no
    faster than one loopback stream, and the streams' kernel work shares the cores."""
    gb = num_bytes / _GB
    cpu_s = num_receivers * gb * bounds["loopback_tcp_cpu_s_per_gb"]
    return {
        "cpu_s": cpu_s,
        "gbps": min(bounds["loopback_tcp_gbps"], gb / (cpu_s / num_cpus)),
    }


def ring_bound(memcpy_gbps: float, *, num_receivers: int, num_cpus: int) -> dict:
    """What the shared-memory ring can reach here: the sender copies every byte into the ring once
    and every receiver copies it out once, each copy at the measured memcpy rate; the copies
    overlap, but the sender's is serial and all of them share the cores."""
    num_copies = 1 + num_receivers
    return {
        "num_copies": num_copies,
        "gbps": memcpy_gbps / max(1.0, num_copies / num_cpus),
    }
