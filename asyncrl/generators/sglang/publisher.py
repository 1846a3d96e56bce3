"""The learner's side of distributed weight updates into SGLang servers (weights.transport=broadcast
with generators.kind=sglang), registered as the `asyncrl.publishers` plugin `sglang.broadcast`.

Place in the data flow: after each optimizer step the learner (rank 0) awaits `publish`, like any
publisher (`transport/publisher.py`, which finds this one through the plugin registry and never
imports it). The weight update group's other ranks are the SGLang servers themselves, one per
server (tp_size 1), so the group is built with the trainer-side recipe of SGLANG_API.md section 2.5:
a TCPStore hosted here on a free port, wrapped in `PrefixStore(group_name)` (SGLang prefixes its
keys with the group name), and a process group of its own name, never the learner's default
(data-parallel) group. Ranks: `group_members[i]` (a generator id, repeated once per server it
drives) owns rank i + 1, so the world is 1 + the number of servers.

The flow is `GroupPublisher`'s: announce first (`BroadcastPublished`: store
address, group name and backend, the tensors in order, the bucket size for the HTTP calls), then,
in a worker thread, create the group (first version: this blocks until every server has joined,
which the generator makes them do through `POST /init_weights_update_group` when the announcement
reaches it) and broadcast every tensor from rank 0 in the announced order. The generator's HTTP
side, and why the two cannot deadlock, is in `group.py`. With `weights.catchup_shards` each version
is then also written as shards and announced again (`catchup`), for generators outside the group;
if a broadcast fails (a server died, the generator gave up) the group is dropped and shards carry
every later version.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from asyncrl.generators.sglang.options import parse_options, servers_per_generator
from asyncrl.transport.publisher import UPDATE_DEADLINE_S, GroupPublisher, ShardPublisher

if TYPE_CHECKING:
    from asyncrl.config_sections import WeightsConfig


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


class SGLangGroupPublisher(GroupPublisher):
    """Learner rank 0 -> every SGLang server of the run, over one weight update group."""

    # gloo/NCCL: a rank died, or the rendezvous timed out.
    send_errors = (RuntimeError, ValueError)

    def __init__(
        self,
        *,
        rank_owners: Iterable[str],
        bucket_bytes: int,
        timeout_s: float,
        catchup: ShardPublisher | None = None,
        master_addr: str = "",  # "": the advertised address (cluster.*)
        group_name: str | None = None,
        deadline_s: float = UPDATE_DEADLINE_S,
    ) -> None:
        super().__init__(
            members=rank_owners,
            bucket_bytes=bucket_bytes,
            timeout_s=timeout_s,
            catchup=catchup,
            master_addr=master_addr,
            group_name=group_name or f"asyncrl-sglang-weights-{os.getpid()}",
            deadline_s=deadline_s,
        )
        if not self.members:
            raise ValueError("the SGLang weight update group needs at least one server rank")

    def _transfer(self, items: list[tuple[str, torch.Tensor]], backend: str) -> int:
        assert self.group is not None
        return broadcast_in_order(self.group, items)


def make_sglang_publisher(
    weights: WeightsConfig,
    *,
    generator_options: Mapping[str, Any],
    generator_ids: Sequence[str],
    catchup: ShardPublisher | None,
) -> SGLangGroupPublisher:
    """The `sglang.broadcast` publisher plugin (`transport.publisher.PublisherFactory`): each
    generator owns one group rank per server it drives (from the same generators.options it reads)."""
    opts = parse_options(dict(generator_options), weights.inflight)
    per_generator = servers_per_generator(opts)
    owners = [gid for gid in generator_ids for _ in range(per_generator)]
    return SGLangGroupPublisher(
        rank_owners=owners,
        bucket_bytes=weights.bucket_bytes,
        timeout_s=weights.group_timeout_s,
        catchup=catchup,
        deadline_s=weights.update_deadline_s,
    )
