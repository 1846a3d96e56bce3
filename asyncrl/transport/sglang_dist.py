"""The learner's side of distributed weight updates into SGLang servers (weights.transport=broadcast
with generators.kind=sglang).

Place in the data flow: after each optimizer step the learner (rank 0) awaits `publish`, like any
publisher (`publisher.py`). The weight update group's other ranks are the SGLang servers
themselves, one per server (tp_size 1), so the group is built with the trainer-side recipe of
SGLANG_API.md section 2.5: a TCPStore hosted here on a free port, wrapped in
`PrefixStore(group_name)` (SGLang prefixes its keys with the group name), and a process group of
its own name, never the learner's default (data-parallel) group. Ranks: `group_members[i]` (a
generator id, repeated once per server it drives) owns rank i + 1, so the world is
1 + the number of servers.

Each publish announces first (`WeightsPublished`, transport "broadcast": store address, group
name and backend, the tensors in order, the bucket size for the HTTP calls) and then, in a worker
thread, creates the group (first version: this blocks until every server has joined, which the
generator makes them do through `POST /init_weights_update_group` when the announcement reaches
it) and broadcasts every tensor from rank 0 in the announced order. The generator's HTTP side,
and why the two cannot deadlock, is in `generators/sglang_group.py`. With
`weights.catchup_shards` each version is then also written as shards and announced again
(`catchup`), for generators outside the group; if a broadcast fails (a server died, the generator
gave up) the group is dropped and shards carry every later version.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence

import msgspec
import torch
import torch.distributed as dist

from asyncrl.messages import WeightsPublished
from asyncrl.transport.broadcast import host_store, init_weight_update_group, tensor_metas

log = logging.getLogger(__name__)

SGLANG_KINDS = ("sglang", "asyncrl.generators.sglang:SGLangGenerator")

Announce = Callable[[WeightsPublished], Awaitable[None]]


def tensor_list(state: Mapping[str, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
    return [(name, t.detach()) for name, t in state.items()]


def broadcast_in_order(group: dist.ProcessGroup, items: Sequence[tuple[str, torch.Tensor]]) -> int:
    """Every tensor from rank 0, one broadcast each, in list order (what SGLang receives after an
    /update_weights_from_distributed call without load_format); returns the bytes sent."""
    works = []
    num_bytes = 0
    for _, t in items:
        t = t.contiguous()
        num_bytes += t.numel() * t.element_size()
        works.append(dist.broadcast(t, src=0, group=group, async_op=True))
    for work in works:
        work.wait()
    return num_bytes


class SGLangGroupPublisher:
    """Learner rank 0 -> every SGLang server of the run, over one weight update group."""

    transport = "broadcast"

    def __init__(
        self,
        *,
        rank_owners: Iterable[str],
        bucket_bytes: int,
        timeout_s: float,
        catchup=None,  # a ShardPublisher, or None
        master_addr: str = "127.0.0.1",
        group_name: str | None = None,
    ) -> None:
        self.rank_owners = tuple(rank_owners)
        if not self.rank_owners:
            raise ValueError("the SGLang weight update group needs at least one server rank")
        self.bucket_bytes = bucket_bytes
        self.timeout_s = timeout_s
        self.catchup = catchup
        self.master_addr = master_addr
        self.group_name = group_name or f"asyncrl-sglang-weights-{os.getpid()}"
        self.group: dist.ProcessGroup | None = None
        self._store: dist.TCPStore | None = None
        self._location = ""
        self._first_version = -1
        self._early_acks: dict[str, int] = {}
        self.failed = False
        self.num_bytes_sent = 0

    @property
    def world_size(self) -> int:
        return len(self.rank_owners) + 1

    async def publish(
        self, state: Mapping[str, torch.Tensor], version: int, announce: Announce
    ) -> WeightsPublished:
        if self.failed:  # the group is gone: catch-up shards only
            assert self.catchup is not None
            return await self.catchup.publish(state, version, announce)
        start = time.perf_counter()
        items = tensor_list(state)
        backend = "nccl" if items and items[0][1].is_cuda else "gloo"
        if self._store is None:
            self._store, port = host_store(
                self.master_addr, world_size=self.world_size, timeout_s=self.timeout_s
            )
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
            group_members=self.rank_owners,
            group_first_version=self._first_version,
            group_timeout_s=self.timeout_s,
        )
        await announce(msg)
        try:
            await asyncio.to_thread(self._send, items, backend)
        except (RuntimeError, ValueError) as exc:  # gloo/NCCL: a rank died, or the rendezvous timed out
            if self.catchup is None:
                raise
            log.error(
                "distributed update of weights version %d into the SGLang servers failed (%s); the group "
                "is dropped and weights go as shards from now on",
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

    def _send(self, items: list[tuple[str, torch.Tensor]], backend: str) -> None:
        if self.group is None:
            assert self._store is not None
            # SGLANG_API.md 2.5, trainer side: PrefixStore(group_name) over this store, rank 0.
            self.group = init_weight_update_group(
                master_addr=self.master_addr,
                master_port=self._store.port,
                rank=0,
                world_size=self.world_size,
                group_name=self.group_name,
                backend=backend,
                timeout_s=self.timeout_s,
                store=self._store,
            )
            log.info(
                "weight update group %r formed with %d SGLang ranks", self.group_name, self.world_size - 1
            )
        self.num_bytes_sent += broadcast_in_order(self.group, items)

    def on_loaded(self, generator_id: str, version: int) -> None:
        """A generator may ack a version before its catch-up shards exist: retention hears it then."""
        if self.catchup is None:
            return
        published = self.catchup.retention.published
        if published and version <= published[-1]:
            self.catchup.on_loaded(generator_id, version)
        else:
            self._early_acks[generator_id] = version

    def close(self) -> None:
        if self.group is not None:
            dist.destroy_process_group(self.group)
            self.group = None
        self._store = None


def uses_sglang_group(config) -> bool:
    """Whether `config` publishes into SGLang servers' weight update group."""
    return config.weights.kind == "broadcast" and config.generators.kind in SGLANG_KINDS


def make_sglang_publisher(config, *, generator_ids: Iterable[str], catchup) -> SGLangGroupPublisher:
    """The publisher for the sglang generator with weights.transport=broadcast: each generator
    owns one group rank per server it drives (from the same generators.options it reads)."""
    from asyncrl.generators.sglang_options import parse_options, servers_per_generator

    opts = parse_options(dict(config.generators.options), config.weights.inflight)
    per_generator = servers_per_generator(opts)
    owners = [gid for gid in generator_ids for _ in range(per_generator)]
    return SGLangGroupPublisher(
        rank_owners=owners,
        bucket_bytes=config.weights.bucket_bytes,
        timeout_s=config.weights.group_timeout_s,
        catchup=catchup,
    )
