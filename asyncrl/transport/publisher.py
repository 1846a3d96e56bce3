"""The learner's side of weight sync, behind one seam: publish a version, take acknowledgements.

Place in the data flow: after each optimizer step the learner (rank 0) calls `publish` in its
worker thread with the detached state dict; the returned `WeightsPublished` goes to the launcher,
which forwards it to every generator. Each generator's `WeightsLoaded` comes back to the learner's
event-loop thread as `on_loaded`. Retention (which versions may be deleted) lives here too.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch

from asyncrl.messages import WeightsPublished
from asyncrl.transport.retention import VersionRetention, prune
from asyncrl.transport.shards import write_shards

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

    def publish(self, state: Mapping[str, torch.Tensor], version: int) -> WeightsPublished:
        """Worker thread: write and announce one version (the retention bookkeeping waits for
        `published`, on the loop thread)."""
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

    def published(self, version: int) -> None:
        """Loop thread, after `publish` returned."""
        self.retention.publish(version)

    def on_loaded(self, generator_id: str, version: int) -> None:
        """Loop thread: a generator holds `version`; delete what nobody can still need."""
        if version > 0:
            self.retention.ack(generator_id, version)
            prune(self.weights_dir, self.retention)

    def close(self) -> None:
        pass
