"""The learner's side of weight sync, behind one seam: publish a version, take acknowledgements.

Place in the data flow: after each optimizer step the learner (rank 0) awaits `publish` on its
event loop with the detached state dict and an async `announce` callable that sends a message to
the launcher (which forwards `WeightsPublished` to every generator). A transport announces when it
suits it (shards: after the atomic rename; a broadcast group: before the bytes move, so receivers
join) and returns the announcement it sent. Each generator's `WeightsLoaded` comes back on the
same loop as `on_loaded`. Retention (which versions may be deleted) lives here too.

Implementations: `ShardPublisher`; `make_publisher` picks one from the config.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from pathlib import Path

import torch

from asyncrl.messages import WeightsPublished
from asyncrl.transport.retention import VersionRetention, prune
from asyncrl.transport.shards import write_shards

Announce = Callable[[WeightsPublished], Awaitable[None]]

# Shards of at most this size: small enough to load in parallel, large enough to stream well.
MAX_SHARD_BYTES = 512 * 1024 * 1024


class ShardPublisher:
    """Versioned safetensors shards under `weights_dir` (see `shards.py`), last K kept."""

    transport = "safetensors"

    def __init__(
        self,
        weights_dir: Path,
        *,
        extra_files: Mapping[str, bytes],
        keep_last: int,
        generator_ids: Iterable[str],
    ) -> None:
        self.weights_dir = weights_dir
        self.extra_files = dict(extra_files)
        self.retention = VersionRetention(keep_last)
        for gid in generator_ids:
            self.retention.register(gid)

    async def publish(
        self, state: Mapping[str, torch.Tensor], version: int, announce: Announce
    ) -> WeightsPublished:
        msg = await asyncio.to_thread(self._write, state, version)
        self.retention.publish(version)
        await announce(msg)
        return msg

    def _write(self, state: Mapping[str, torch.Tensor], version: int) -> WeightsPublished:
        start = time.perf_counter()
        manifest = write_shards(
            state,
            self.weights_dir,
            version,
            max_shard_bytes=MAX_SHARD_BYTES,
            extra_files=self.extra_files,
            num_threads=1,
            fsync=False,
        )
        return WeightsPublished(
            version=version,
            transport=self.transport,
            location=str(self.weights_dir),
            num_bytes=manifest.total_size_bytes,
            publish_s=time.perf_counter() - start,
        )

    def on_loaded(self, generator_id: str, version: int) -> None:
        """Loop thread: a generator holds `version`; delete what nobody can still need."""
        if version > 0:
            self.retention.ack(generator_id, version)
            prune(self.weights_dir, self.retention)

    def close(self) -> None:
        pass


def make_publisher(config, *, run_dir: Path, model_dir: Path, generator_ids: Iterable[str]) -> ShardPublisher:
    """The publisher for `config.weights.transport`."""
    from asyncrl.transport.shards import collect_config_files

    w = config.weights
    return ShardPublisher(
        Path(w.dir) if w.dir else run_dir / "weights",
        extra_files=collect_config_files(model_dir),
        keep_last=w.keep_last,
        generator_ids=generator_ids,
    )
