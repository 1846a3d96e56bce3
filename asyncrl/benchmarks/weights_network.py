"""The network row of `asyncrl bench weights`: a version served to a generator that cannot see the
weights root (a worker on another host, docs/multi-host.md), on loopback.

The learner publishes shards once; a `FileServer` (the launcher's, `transport/serve.py`) serves
them from its own thread and event loop, as the launcher does; the fetcher knows only the server's
address: each round fetches the version into a fresh cache directory with `NetworkWeights`
(chunked, every file hashed as it arrives) and reads it there as the generator does
(`read_shards`, verified again). Both ends are in this process, so `cpu_s` is the whole path's CPU.
"""

from __future__ import annotations

import asyncio
import shutil
import statistics
import threading
import time
from collections.abc import Mapping
from pathlib import Path

import torch
import zmq

from asyncrl.messages import FileRequest
from asyncrl.transport.serve import FileServer, NetworkWeights
from asyncrl.transport.shard_read import read_shards
from asyncrl.transport.shards import write_shards
from asyncrl.transport.zmq_io import Endpoint

_GB = 1e9


class _ServerThread:
    """A FileServer on loopback in a thread with its own event loop; `address` once started."""

    def __init__(self, zctx: zmq.Context, root: Path) -> None:
        self.zctx = zctx
        self.root = root
        self.ready = threading.Event()
        self.address = ""
        self.loop: asyncio.AbstractEventLoop | None = None
        self.task: asyncio.Task | None = None
        self.thread = threading.Thread(
            target=lambda: asyncio.run(self._main()), name="bench-files", daemon=True
        )

    async def _main(self) -> None:
        ep = Endpoint(self.zctx, zmq.ROUTER, name="bench.files", accept=(FileRequest,))
        self.address = ep.bind()
        self.loop = asyncio.get_running_loop()
        self.task = asyncio.current_task()
        self.ready.set()
        try:
            await FileServer({"weights": self.root}).serve(ep)
        except asyncio.CancelledError:
            pass
        finally:
            ep.close()

    def __enter__(self) -> _ServerThread:
        self.thread.start()
        self.ready.wait()
        return self

    def __exit__(self, *exc) -> None:
        self.loop.call_soon_threadsafe(self.task.cancel)
        self.thread.join()


def bench_network(
    sd: Mapping[str, torch.Tensor], root: Path, *, repeats: int, max_shard_bytes: int, checksum: str
) -> dict:
    """Medians over `repeats` rounds (after one warm-up) of fetching and reading one version."""
    published = root / "published"
    manifest = write_shards(sd, published, 1, max_shard_bytes=max_shard_bytes, checksum=checksum)
    num_bytes = sum(f.size_bytes for f in manifest.files)
    zctx = zmq.Context()
    fetch_s, total_s, cpu_s = [], [], []
    try:
        with _ServerThread(zctx, published) as server:
            for i in range(repeats + 1):
                cache = root / f"cache-{i}"
                c0, t0 = time.process_time(), time.perf_counter()
                local = NetworkWeights(zctx, server.address, cache).fetch(1, lambda m: False)
                t1 = time.perf_counter()
                read_shards(local, 1, verify=True)
                t2, c2 = time.perf_counter(), time.process_time()
                shutil.rmtree(cache)
                if i:  # the first round warms the page cache and the connection path
                    fetch_s.append(t1 - t0)
                    total_s.append(t2 - t0)
                    cpu_s.append(c2 - c0)
    finally:
        zctx.destroy(linger=0)
    fetch, total = statistics.median(fetch_s), statistics.median(total_s)
    return {
        "bytes": num_bytes,
        "checksum": checksum,
        "gbps": num_bytes / total / _GB,  # fetched, then read as a generator reads (verified)
        "fetch_gbps": num_bytes / fetch / _GB,
        "total_s": total,
        "cpu_s": statistics.median(cpu_s),
    }
