"""The learner's side of weight sync, behind one seam: publish a version, take acknowledgements.

Place in the data flow: after each optimizer step the learner (rank 0) awaits `publish` on its
event loop with the detached state dict and an async `announce` callable that sends a message to
the launcher (which forwards `WeightsPublished` to every generator). A transport announces when it
suits it (shards: after the atomic rename; a broadcast group: before the bytes move, so receivers
join) and returns the announcement it sent. Each generator's `WeightsLoaded` comes back on the
same loop as `on_loaded`. Retention (which versions may be deleted) lives here too.

Implementations: `ShardPublisher` (weights.transport = "shards") and `BroadcastPublisher`
("broadcast": the store address and layout go out in the announcement, generators join the group
lazily, the bytes follow over it; then catch-up shards for generators outside the group);
`make_publisher` picks one from the config. See docs/weights.md.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from pathlib import Path

import msgspec
import torch

from asyncrl.messages import WeightsPublished
from asyncrl.transport.retention import VersionRetention, prune
from asyncrl.transport.shards import write_shards

log = logging.getLogger(__name__)

Announce = Callable[[WeightsPublished], Awaitable[None]]

# Shards of at most this size: small enough to load in parallel, large enough to stream well.
MAX_SHARD_BYTES = 512 * 1024 * 1024


class ShardPublisher:
    """Versioned safetensors shards under `weights_dir` (see `shards.py`), last K kept.

    With `recycle` (the default) the newest pruned version stays as a hidden spare whose files the
    next publish overwrites (`retention.prune(..., keep_spare=True)`): on tmpfs, writing into new
    files costs about 2.5 times the CPU of overwriting old ones (docs/weights.md).
    """

    transport = "safetensors"

    def __init__(
        self,
        weights_dir: Path,
        *,
        extra_files: Mapping[str, bytes],
        keep_last: int,
        generator_ids: Iterable[str],
        max_shard_bytes: int = MAX_SHARD_BYTES,
        catchup: bool = False,
        recycle: bool = True,
    ) -> None:
        self.weights_dir = weights_dir
        self.recycle = recycle
        self.extra_files = dict(extra_files)
        self.max_shard_bytes = max_shard_bytes
        self.catchup = catchup  # announcements are marked as copies of broadcast versions
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
            max_shard_bytes=self.max_shard_bytes,
            extra_files=self.extra_files,
            num_threads=None,  # hashlib and os.write release the GIL: shards go in parallel
            fsync=False,
            reuse_spare=self.recycle,
        )
        return WeightsPublished(
            version=version,
            transport=self.transport,
            location=str(self.weights_dir),
            num_bytes=manifest.total_size_bytes,
            publish_s=time.perf_counter() - start,
            catchup=self.catchup,
        )

    def on_loaded(self, generator_id: str, version: int) -> None:
        """Loop thread: a generator holds `version`; delete what nobody can still need."""
        if version > 0:
            self.retention.ack(generator_id, version)
            prune(self.weights_dir, self.retention, keep_spare=self.recycle)

    def close(self) -> None:
        pass


class BroadcastPublisher:
    """A torch.distributed weight update group: learner rank 0 -> every generator (docs/weights.md).

    The first `publish` hosts the group's store on a free port, announces it with the layout and
    the member list, and creates the group (blocking, off the loop, until every member has joined).
    Each publish announces first and then broadcasts, so the members are already receiving. With
    `catchup` (a ShardPublisher) the version is then also written as shards and announced again,
    marked `catchup`, for generators outside the group (late joiners, restarted generators).
    """

    transport = "broadcast"

    def __init__(
        self,
        *,
        generator_ids: Iterable[str],
        bucket_bytes: int,
        timeout_s: float,
        catchup: ShardPublisher | None,
        master_addr: str = "127.0.0.1",
        group_name: str | None = None,
    ) -> None:
        self.members = tuple(generator_ids)
        self.bucket_bytes = bucket_bytes
        self.timeout_s = timeout_s
        self.catchup = catchup
        self.master_addr = master_addr
        self.group_name = group_name or f"asyncrl-weights-{os.getpid()}"
        self.group = None
        self._store = None
        self._location = ""
        self._first_version = -1
        self._early_acks: dict[str, int] = {}
        self.failed = False

    async def publish(
        self, state: Mapping[str, torch.Tensor], version: int, announce: Announce
    ) -> WeightsPublished:
        from asyncrl.transport.broadcast import host_store, tensor_metas

        if self.failed:  # the group is gone (a member died): catch-up shards only
            assert self.catchup is not None
            return await self.catchup.publish(state, version, announce)
        start = time.perf_counter()
        items = list(state.items())
        backend = "nccl" if items and items[0][1].is_cuda else "gloo"
        world_size = len(self.members) + 1
        if self._store is None:
            self._store, port = host_store(self.master_addr, world_size=world_size, timeout_s=self.timeout_s)
            self._location = f"{self.master_addr}:{port}"
            self._first_version = version
        msg = WeightsPublished(
            version=version,
            transport="broadcast",
            location=self._location,
            num_bytes=sum(t.numel() * t.element_size() for _, t in items),
            tensors=tuple(tensor_metas(items)),
            bucket_bytes=self.bucket_bytes,
            group_name=self.group_name,
            group_backend=backend,
            group_members=self.members,
            group_first_version=self._first_version,
            group_timeout_s=self.timeout_s,
        )
        await announce(msg)
        try:
            await self._send(items, world_size, backend)
        except RuntimeError as exc:  # gloo/NCCL: a member died or the rendezvous timed out
            if self.catchup is None:
                raise
            log.error(
                "broadcast of weights version %d failed (%s); the group is dropped and weights go as "
                "shards from now on",
                version,
                exc,
            )
            self.failed = True
            self.close()
        msg = msgspec.structs.replace(msg, publish_s=time.perf_counter() - start)
        if self.catchup is not None:
            await self.catchup.publish(state, version, announce)
            for gid, acked in list(self._early_acks.items()):
                if acked <= version:
                    del self._early_acks[gid]
                    self.catchup.on_loaded(gid, acked)
        return msg

    async def _send(self, items: list, world_size: int, backend: str) -> None:
        from asyncrl.transport.broadcast import (
            broadcast_tensors,
            init_weight_update_group,
            uses_point_to_point,
        )

        if self.group is None:
            self.group = await asyncio.to_thread(
                init_weight_update_group,
                master_addr=self.master_addr,
                master_port=0,
                rank=0,
                world_size=world_size,
                group_name=self.group_name,
                backend=backend,
                timeout_s=self.timeout_s,
                store=self._store,
            )
        await asyncio.to_thread(
            broadcast_tensors,
            self.group,
            items,
            bucket_bytes=self.bucket_bytes,
            p2p=uses_point_to_point(backend),
        )

    def on_loaded(self, generator_id: str, version: int) -> None:
        """Members may ack a version before its catch-up shards exist: retention hears it then."""
        if self.catchup is None:
            return
        published = self.catchup.retention.published
        if published and version <= published[-1]:
            self.catchup.on_loaded(generator_id, version)
        else:
            self._early_acks[generator_id] = version

    def close(self) -> None:
        if self.group is not None:
            from asyncrl.transport.broadcast import destroy_weight_update_group

            destroy_weight_update_group(self.group)
            self.group = None
        self._store = None


def make_publisher(
    config, *, run_dir: Path, model_dir: Path, generator_ids: Iterable[str]
) -> ShardPublisher | BroadcastPublisher:
    """The publisher for `config.weights.transport`."""
    from asyncrl.transport.shards import collect_config_files

    w = config.weights
    ids = list(generator_ids)
    shards = ShardPublisher(
        Path(w.dir) if w.dir else run_dir / "weights",
        extra_files=collect_config_files(model_dir),
        keep_last=w.keep_last,
        generator_ids=ids,
        max_shard_bytes=w.max_shard_bytes,
        catchup=w.kind == "broadcast",
    )
    if w.kind == "shards":
        return shards
    from asyncrl.transport.sglang_dist import make_sglang_publisher, uses_sglang_group

    if uses_sglang_group(config):  # the SGLang servers are the group's ranks (sglang_dist.py)
        return make_sglang_publisher(config, generator_ids=ids, catchup=shards if w.catchup_shards else None)
    return BroadcastPublisher(
        generator_ids=ids,
        bucket_bytes=w.bucket_bytes,
        timeout_s=w.group_timeout_s,
        catchup=shards if w.catchup_shards else None,
    )
