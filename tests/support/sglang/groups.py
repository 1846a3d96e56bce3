"""The stand-in SGLang server's torch.distributed weight update groups (the receiving side of
SGLANG_API.md sections 2.2, 2.4 and 2.8), over gloo on the CPU.

Place in the data flow: `server.py` routes /init_weights_update_group,
/update_weights_from_distributed and /destroy_weights_update_group here; received tensors go to
`Engine.update_weights_from_tensors`, which loads them into the torch model under the engine's
rules (at once when paused, else after running requests drain). The server has tp_size 1, so it is
one rank of a group, `rank_offset`.

Joining follows SGLang's `init_custom_process_group`: a TCPStore client on
`master_address:master_port`, wrapped in `PrefixStore(group_name)`, and a process group of that
name; the call blocks until every rank (the trainer included) has joined. A distributed update
allocates one tensor per (dtype, shape), receives each with a broadcast from rank 0 in the listed
order (async handles, then wait), and only then loads them.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

GROUP_TIMEOUT_S = 300.0  # store and collective timeout of a group (SGLang uses torch's default)


class GroupError(Exception):
    """A request the stand-in answers with HTTP 400 `{"success": false, "message": ...}`."""


def _dtype(name: Any) -> torch.dtype:
    found = getattr(torch, name, None) if isinstance(name, str) and name.isidentifier() else None
    if not isinstance(found, torch.dtype):
        raise GroupError(f"Failed to update weights: unknown dtype {name!r}.")
    return found


class WeightGroups:
    """Named weight update groups of one server, with the server's rank in each."""

    def __init__(self, timeout_s: float = GROUP_TIMEOUT_S) -> None:
        self.timeout_s = timeout_s
        self.groups: dict[str, dist.ProcessGroup] = {}
        self.lock = threading.Lock()
        self.joining: set[str] = set()

    def init(self, body: dict[str, Any]) -> str:
        """POST /init_weights_update_group: join; blocks until every rank has. Returns the message."""
        try:
            addr = str(body["master_address"])
            port = int(body["master_port"])
            rank = int(body["rank_offset"])
            world_size = int(body["world_size"])
        except (KeyError, TypeError, ValueError) as exc:
            raise GroupError(f"Failed to initialize custom process group: bad request field {exc}") from None
        name = str(body.get("group_name", "weight_update_group"))
        backend = str(body.get("backend", "nccl"))
        if backend != "gloo":
            raise GroupError(
                f"Failed to initialize custom process group: the stand-in server runs on the CPU and "
                f"supports backend 'gloo' only, not {backend!r}."
            )
        if not 0 < rank < world_size:
            raise GroupError(
                f"Failed to initialize custom process group: rank_offset {rank} is not a rank of a "
                f"group of {world_size} (rank 0 is the trainer)."
            )
        with self.lock:
            if name in self.groups or name in self.joining:
                raise GroupError(f"Failed to initialize custom process group: {name!r} already exists.")
            self.joining.add(name)
        try:
            timeout = timedelta(seconds=self.timeout_s)
            store = dist.TCPStore(addr, port, world_size, is_master=False, timeout=timeout)
            prefixed = dist.PrefixStore(name, store)
            pg, _ = c10d._new_process_group_helper(
                world_size, rank, [], dist.Backend(backend), prefixed, group_name=name, timeout=timeout
            )
            c10d._world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
        except (RuntimeError, ValueError) as exc:  # store unreachable, rendezvous timed out
            raise GroupError(f"Failed to initialize custom process group: {exc}") from None
        finally:
            with self.lock:
                self.joining.discard(name)
        with self.lock:
            self.groups[name] = pg
        return "Succeeded to initialize custom process group."

    def receive(self, body: dict[str, Any]) -> dict[str, torch.Tensor]:
        """The tensors of one /update_weights_from_distributed call, {name: tensor} in order."""
        names, dtypes, shapes = body.get("names"), body.get("dtypes"), body.get("shapes")
        if not (isinstance(names, list) and isinstance(dtypes, list) and isinstance(shapes, list)):
            raise GroupError("names, dtypes and shapes must be lists.")
        if not len(names) == len(dtypes) == len(shapes):
            raise GroupError(
                f"names, dtypes and shapes differ in length ({len(names)}, {len(dtypes)}, {len(shapes)})."
            )
        if body.get("load_format") is not None:
            raise GroupError(
                f"load_format {body['load_format']!r} is not implemented by the stand-in server; send null."
            )
        name = str(body.get("group_name", "weight_update_group"))
        with self.lock:
            pg = self.groups.get(name)
        if pg is None:
            raise GroupError(f"Failed to update weights: the weight update group {name!r} does not exist.")
        tensors = [torch.empty(_shape(s), dtype=_dtype(d)) for d, s in zip(dtypes, shapes, strict=True)]
        try:
            works = [dist.broadcast(t, src=0, group=pg, async_op=True) for t in tensors]
            for work in works:
                work.wait()
        except RuntimeError as exc:  # the trainer died or timed out
            raise GroupError(
                f"Failed to update weights: receiving failed ({exc}). The weights may be partially "
                "updated. Please discard the whole weights."
            ) from None
        return dict(zip((str(n) for n in names), tensors, strict=True))

    def destroy(self, name: str) -> str:
        with self.lock:
            pg = self.groups.pop(name, None)
        if pg is None:
            raise GroupError("The group to be destroyed does not exist.")
        dist.destroy_process_group(pg)
        return "Succeeded to destroy custom process group."

    def close(self) -> None:
        with self.lock:
            groups, self.groups = list(self.groups.values()), {}
        for pg in groups:
            dist.destroy_process_group(pg)


def _shape(shape: Any) -> Sequence[int]:
    if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
        raise GroupError(f"Failed to update weights: bad shape {shape!r}.")
    return shape
