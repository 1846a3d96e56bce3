"""The generator's half of a distributed weight update for SGLang servers (weights.transport=broadcast).

Place in the data flow: the learner (`publisher.py`, in the learner process) is rank 0 of a weight update
group whose other ranks are the SGLang servers themselves (tp_size 1: one rank per server). The
learner announces each version (`BroadcastPublished`) and then broadcasts
every tensor from rank 0, in the announced order. The generator process, which owns the servers
(their URLs, the pause mode, the version bookkeeping), takes the announcement from its service
and drives the servers over HTTP (SGLANG_API.md sections 2.2-2.5, 2.8, 6):

    founding version only:  POST /init_weights_update_group  on every server at once
    every version:          POST /pause_generation {mode}
                            POST /flush_cache                (not in in_place mode)
                            POST /begin_weight_update
                            per bucket of names, in order:  POST /update_weights_from_distributed
                                 {names, dtypes, shapes, group_name, flush_cache: false} on every
                                 server at once; all must answer success before the next bucket
                            POST /update_weight_version {new_version, abort_all_requests: false}
                            POST /end_weight_update
                            POST /continue_generation
                            GET  /model_info  must report the new version
    close:                  POST /destroy_weights_update_group

Why the generator and not the learner makes these calls: the servers' URLs exist only in the
generator process (it may have launched them), the pause mode and the per-token version labels
are the generator's business, and the learner then needs nothing but the collective it already
does for the torch generators' broadcast group: it stays ignorant of HTTP.

Why this cannot deadlock: the learner waits only on the servers (group creation, then one
broadcast per tensor, each returning when every server has taken it); a server's
`init_weights_update_group` waits only on the other ranks, and its `update_weights_from_distributed`
only on the learner's sends of that bucket; the generator waits only on the servers' HTTP answers.
The learner sends every tensor without waiting on anything else, the generator keeps one bucket
in flight, and every server receives the names of a bucket in the announced order, so every rank
runs the same sequence of collectives. A server that refuses (a session already open, an unknown
group) fails the update here with its message; the learner's broadcast then fails at the group
timeout (or at once, when the servers are stopped), and it falls back to catch-up shards.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from asyncrl.generators.sglang.client import (
    Server,
    ServerUnavailable,
    SGLangRequestError,
    decode_model_info,
    decode_update,
    error_message,
)
from asyncrl.messages import BroadcastPublished, TensorMeta

log = logging.getLogger(__name__)

# HTTP calls that wait for the learner get the group's own timeout plus this margin.
GROUP_CALL_MARGIN_S = 60.0
CONTROL_TIMEOUT_S = 600.0  # pause waits for in-flight requests
CLEANUP_TIMEOUT_S = 30.0

Call = Callable[..., Awaitable[tuple[int, bytes]]]


def member_ranks(group_members: Sequence[str], generator_id: str) -> list[int]:
    """The group ranks a generator's servers take, in server order: `group_members[i]` owns rank
    i + 1 (a generator with N servers appears N times)."""
    return [i + 1 for i, owner in enumerate(group_members) if owner == generator_id]


def _itemsize(dtype: str) -> int:
    import torch

    found = getattr(torch, dtype, None) if dtype.isidentifier() else None
    if not isinstance(found, torch.dtype):
        raise ValueError(f"weights announcement names an unknown torch dtype {dtype!r}")
    return found.itemsize


def name_buckets(tensors: Sequence[TensorMeta], bucket_bytes: int) -> list[list[TensorMeta]]:
    """Consecutive runs of `tensors` of at most `bucket_bytes` each (a larger tensor alone): one
    /update_weights_from_distributed call each. Order is kept: it is the broadcast order."""
    buckets: list[list[TensorMeta]] = []
    size = 0
    for meta in tensors:
        num_bytes = _itemsize(meta.dtype)
        for dim in meta.shape:
            num_bytes *= dim
        if buckets and buckets[-1] and size + num_bytes <= bucket_bytes:
            buckets[-1].append(meta)
            size += num_bytes
        else:
            buckets.append([meta])
            size = num_bytes
    return buckets


class GroupUpdater:
    """Drives the servers of one generator through distributed weight updates (module docstring)."""

    def __init__(self, call: Call, *, generator_id: str, pause_mode: str) -> None:
        self.call = call  # Fleet.call
        self.generator_id = generator_id
        self.pause_mode = pause_mode
        self.group_name: str | None = None
        self.servers: list[Server] = []

    async def _post(self, server: Server, path: str, body: dict[str, Any], timeout_s: float) -> bytes:
        status, data = await self.call(server, "POST", path, body, timeout_s=timeout_s)
        if status != 200:
            raise SGLangRequestError(f"{server.url}{path} answered HTTP {status}: {error_message(data)}")
        return data

    async def _update_call(self, server: Server, path: str, body: dict[str, Any], timeout_s: float) -> None:
        """A call answering `{"success", "message"}`: HTTP 200 and success, or SGLangRequestError."""
        data = await self._post(server, path, body, timeout_s)
        result = decode_update(data) if data.strip().startswith(b"{") else None
        if result is None or not result.success:
            raise SGLangRequestError(f"{server.url}{path} failed: {error_message(data)}")

    async def _everywhere(self, step: Callable[[Server], Awaitable[Any]]) -> None:
        """`step` on every server at once; the first error (after all have answered) is raised."""
        results = await asyncio.gather(*(step(s) for s in self.servers), return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException):
                raise result

    async def join(self, msg: BroadcastPublished, servers: Sequence[Server]) -> None:
        """The founding announcement: every server joins the learner's group (blocks until all have)."""
        ranks = member_ranks(msg.group_members, self.generator_id)
        if len(ranks) != len(servers):
            raise ValueError(
                f"the learner's weight update group gives {self.generator_id} {len(ranks)} ranks, but it "
                f"drives {len(servers)} SGLang servers; the learner and the generator must read the same "
                "generators.options (urls or launch)"
            )
        self.servers = list(servers)
        await self._everywhere(self._check_tp_size)
        host, _, port = msg.store_address.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"broadcast announcement has a bad store address {msg.store_address!r}")
        timeout_s = msg.group_timeout_s + GROUP_CALL_MARGIN_S

        async def init(server: Server, rank: int) -> None:
            body = {
                "master_address": host,
                "master_port": int(port),
                "rank_offset": rank,
                "world_size": len(msg.group_members) + 1,
                "group_name": msg.group_name,
                "backend": msg.group_backend,
            }
            await self._update_call(server, "/init_weights_update_group", body, timeout_s)

        results = await asyncio.gather(
            *(init(s, r) for s, r in zip(self.servers, ranks, strict=True)), return_exceptions=True
        )
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            raise errors[0]
        self.group_name = msg.group_name
        log.info(
            "%s: %d SGLang servers joined weight update group %r as ranks %s",
            self.generator_id,
            len(self.servers),
            msg.group_name,
            ranks,
        )

    async def _check_tp_size(self, server: Server) -> None:
        """One rank per server is what the learner counted; a tensor-parallel server has more."""
        try:
            status, data = await self.call(server, "GET", "/server_info", timeout_s=30.0)
        except ServerUnavailable:
            return  # the init call below reports an unreachable server
        if status != 200 or not data.strip().startswith(b"{"):
            return
        info = json.loads(data)
        tp_size = info.get("tp_size", 1) if isinstance(info, dict) else 1
        if tp_size != 1:
            raise ValueError(
                f"SGLang server {server.url} runs with tp_size {tp_size}; the distributed weight path "
                "takes one rank per server (tp_size 1, one GPU each); use weights.transport=shards"
            )

    async def update(self, msg: BroadcastPublished) -> None:
        """One version: pause, begin, buckets, version label, end, continue, verify (every server)."""
        if msg.group_name != self.group_name:
            raise ValueError(
                f"weights version {msg.version} comes over group {msg.group_name!r}, but the servers "
                f"joined {self.group_name!r}"
            )
        version = str(msg.version)
        mode = self.pause_mode
        paused: set[Server] = set()  # servers to continue if this fails half-way
        began: set[Server] = set()  # servers whose session this update opened and has not closed

        async def pause(server: Server) -> None:
            paused.add(server)  # before the call: continuing a server that did not pause is harmless
            await self._post(server, "/pause_generation", {"mode": mode}, CONTROL_TIMEOUT_S)

        async def begin(server: Server) -> None:
            await self._update_call(server, "/begin_weight_update", {"selector": "all"}, CONTROL_TIMEOUT_S)
            began.add(server)

        async def end(server: Server) -> None:
            await self._update_call(server, "/end_weight_update", {}, CONTROL_TIMEOUT_S)
            began.discard(server)

        async def resume(server: Server) -> None:
            await self._post(server, "/continue_generation", {}, CONTROL_TIMEOUT_S)
            paused.discard(server)

        try:
            await self._everywhere(pause)
            if mode != "in_place":  # in_place keeps live KV caches: a flush would fail
                await self._everywhere(lambda s: self._post(s, "/flush_cache", {}, CONTROL_TIMEOUT_S))
            await self._everywhere(begin)
            timeout_s = msg.group_timeout_s + GROUP_CALL_MARGIN_S
            for bucket in name_buckets(msg.tensors, max(1, msg.bucket_bytes)):
                body = {
                    "names": [m.name for m in bucket],
                    "dtypes": [m.dtype for m in bucket],
                    "shapes": [list(m.shape) for m in bucket],
                    "group_name": msg.group_name,
                    "flush_cache": False,
                    "abort_all_requests": False,
                }
                await self._everywhere(
                    lambda s, b=body: self._update_call(s, "/update_weights_from_distributed", b, timeout_s)
                )
            label = {"new_version": version, "abort_all_requests": False}
            await self._everywhere(
                lambda s: self._update_call(s, "/update_weight_version", label, CONTROL_TIMEOUT_S)
            )
            await self._everywhere(end)
            await self._everywhere(resume)
        finally:
            if began or paused:  # failed half-way: leave the servers serving, best effort
                await self._cleanup(began, paused)
        await self._everywhere(lambda s: self._check_version(s, version))

    async def _cleanup(self, began: set[Server], paused: set[Server]) -> None:
        async def one(server: Server) -> None:
            for path, wanted in (("/end_weight_update", began), ("/continue_generation", paused)):
                if server in wanted:
                    try:
                        await self.call(server, "POST", path, {}, timeout_s=CLEANUP_TIMEOUT_S)
                    except ServerUnavailable as exc:
                        log.warning("%s%s after a failed weight update: %s", server.url, path, exc)

        await asyncio.gather(*(one(s) for s in self.servers))

    async def _check_version(self, server: Server, version: str) -> None:
        status, data = await self.call(server, "GET", "/model_info", timeout_s=30.0)
        if status != 200:
            raise SGLangRequestError(f"{server.url}/model_info answered HTTP {status}: {error_message(data)}")
        reported = decode_model_info(data).weight_version
        if reported != version:
            raise SGLangRequestError(
                f"{server.url} reports weight version {reported!r} after the distributed update to {version}"
            )

    async def leave(self) -> None:
        """Best effort: the servers drop the group (they may join another one later)."""
        if self.group_name is None:
            return
        name, self.group_name = self.group_name, None

        async def one(server: Server) -> None:
            try:
                status, data = await self.call(
                    server,
                    "POST",
                    "/destroy_weights_update_group",
                    {"group_name": name},
                    timeout_s=CLEANUP_TIMEOUT_S,
                )
            except ServerUnavailable as exc:
                log.warning("%s could not leave weight update group %r: %s", server.url, name, exc)
                return
            if status != 200:
                log.warning("%s/destroy_weights_update_group: %s", server.url, error_message(data))

        await asyncio.gather(*(one(s) for s in self.servers))
