"""torch.distributed weight-update group: the broadcast path of weight sync (learner -> generators).

Place in the data flow: learner rank 0 is rank 0 of a dedicated "weight update" process group whose
other ranks are generator processes (or SGLang server TP ranks). After an optimizer step the learner
announces `BroadcastPublished(version, ...)` with the tensor metadata over ZMQ, then
calls `broadcast_tensors`; each generator calls `receive_tensors` with the same metadata and acks with
`WeightsLoaded`.

The group has its own TCPStore on `master_addr:master_port`, wrapped in `PrefixStore(group_name)`
exactly as SGLang's `init_weights_update_group` does on the server side, so it never touches the
learner's default (data-parallel) group and SGLang ranks can join it.

Bytes travel in buckets (`plan_buckets`): small tensors grouped up to `bucket_bytes`, large ones
alone, each bucket one flat uint8 buffer, sent as one broadcast (what inference-server ranks receive) or, with
`p2p` (`uses_point_to_point`: gloo, between our own processes), as one send per receiver with
receives posted several buckets ahead. Inside a bucket tensors are ordered by element size, largest
first, so every tensor starts at an offset that is a multiple of its element size with no padding:
the layout an inference server's flattened-bucket loader expects (the SGLang backend builds its
request from the bucket's entries, `generators/sglang/group.py`). A bucket of one tensor is sent straight from (received straight into) that tensor.
On gloo (CPU) pick `bucket_bytes` around a few MiB so large tensors go without copies; for NCCL
and SGLang larger buckets (hundreds of MiB) mean fewer calls.

Receivers on the sender's host: with `p2p` on a CPU group and `local = "shm"` (the default,
weights.broadcast_local) their bytes go through a shared-memory ring instead of gloo
(`shm_ring.py`): the buckets as one stream of slot-sized chunks, copied in by the sender and out
by each receiver at once. Which receivers take it is settled in each transfer's layout check
(`pairwise.py`); the others (other hosts, `local = "gloo"`) get gloo's sends as before.

Losing a peer: with `p2p` every receiver is its own pair of the group (gloo fails only that pair
when a process dies: measured, a reset within milliseconds), the layout check is pairwise too, and
the sender finishes the transfer to every other receiver before it raises `PeersLost` naming the
ranks it lost, so no rank waits for a dead one. Later transfers leave those ranks out (`peers`).
A ring reader has its own socket to the sender, which closes when either process dies: the same.
A broadcast (NCCL, SGLang ranks) is a collective: a dead rank fails it on every rank only at the
group's timeout.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import logging
import math
from collections.abc import Iterator, Mapping, Sequence
from datetime import timedelta

import msgspec
import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from asyncrl.messages import TensorMeta
from asyncrl.transport import pairwise
from asyncrl.transport.manifest import dtype_from_name, dtype_name
from asyncrl.transport.shard_io import fresh_cpu_bytes
from asyncrl.transport.shm_ring import RecvRing

logger = logging.getLogger(__name__)

# At most this many buckets are in flight per rank: one being sent while the next is packed.
_MAX_IN_FLIGHT = 2
# With `p2p`, receives are posted this many buckets ahead. gloo moves a message only once the
# receiver has posted its receive and told the sender so (a round trip per message); broadcasts
# post theirs one at a time on the group's two worker threads, sends and receives at once.
_P2P_IN_FLIGHT = 8
# Groups on these backends move weights point to point (`uses_point_to_point`).
_P2P_BACKENDS = ("gloo",)
# The layout fingerprint is the first 7 bytes of a sha256, so it and its negation fit in int64.
_FINGERPRINT_BYTES = 7
# How the bytes reach receivers on the sender's host (weights.broadcast_local): the shared-memory
# ring (`shm_ring.py`) or gloo's sends, as for receivers elsewhere.
LOCAL_PATHS = ("shm", "gloo")
# A group whose timeout cannot be read: torch.distributed's default for gloo.
_DEFAULT_TIMEOUT_S = 1800.0


class PeersLost(RuntimeError):
    """A p2p transfer reached every receiver except `failed` (rank -> the error); `num_bytes`
    were sent to each of the others."""

    def __init__(self, failed: dict[int, str], num_bytes: int) -> None:
        self.failed = dict(failed)
        self.num_bytes = num_bytes
        lost = "; ".join(f"rank {rank}: {why}" for rank, why in sorted(self.failed.items()))
        super().__init__(f"weight transfer lost {len(self.failed)} receiver(s): {lost}")


class BucketEntry(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    dtype: str
    shape: tuple[int, ...]
    offset_bytes: int  # a multiple of the dtype's element size
    num_bytes: int


class Bucket(msgspec.Struct, frozen=True, kw_only=True):
    """One flat broadcast: `entries` in byte order, `num_bytes` in total (no padding)."""

    entries: tuple[BucketEntry, ...]
    num_bytes: int


def tensor_metas(
    tensors: Mapping[str, torch.Tensor] | Sequence[tuple[str, torch.Tensor]],
) -> list[TensorMeta]:
    """Wire metadata of named tensors, in order (what receivers need to call `receive_tensors`)."""
    items = tensors.items() if isinstance(tensors, Mapping) else tensors
    return [TensorMeta(name=n, dtype=dtype_name(t.dtype), shape=tuple(t.shape)) for n, t in items]


def plan_buckets(metas: Sequence[TensorMeta], *, bucket_bytes: int) -> list[Bucket]:
    """Group tensors into buckets of at most `bucket_bytes` (pure, so identical on every rank).

    A tensor of `bucket_bytes` or more gets a bucket of its own, sent without a copy; smaller ones
    are packed, in order, into shared buckets that keep filling across the large ones (so the small
    norms and biases of many layers travel together). Within a bucket, entries are stably sorted by
    element size, largest first, and packed without gaps: as element sizes are powers of two, each
    offset is then a multiple of its tensor's element size.
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
    seen: set[str] = set()
    sized: list[tuple[TensorMeta, torch.dtype, int]] = []
    for meta in metas:
        if meta.name in seen:
            raise ValueError(f"tensor name {meta.name!r} appears twice")
        seen.add(meta.name)
        if any(dim < 0 for dim in meta.shape):
            raise ValueError(f"tensor {meta.name!r} has a negative dimension in shape {meta.shape}")
        dtype = dtype_from_name(meta.dtype)
        sized.append((meta, dtype, math.prod(meta.shape) * dtype.itemsize))

    groups: list[list[tuple[TensorMeta, torch.dtype, int]]] = []
    current: list[tuple[TensorMeta, torch.dtype, int]] = []
    current_bytes = 0
    for item in sized:
        if item[2] >= bucket_bytes:
            groups.append([item])
            continue
        if current_bytes + item[2] > bucket_bytes:
            groups.append(current)
            current, current_bytes = [], 0
        current.append(item)
        current_bytes += item[2]
    if current:
        groups.append(current)

    buckets = []
    for group in groups:
        entries = []
        offset = 0
        for meta, dtype, nbytes in sorted(group, key=lambda item: -item[1].itemsize):
            assert offset % dtype.itemsize == 0, "offsets stay aligned when sorted by element size"
            entries.append(
                BucketEntry(
                    name=meta.name, dtype=meta.dtype, shape=meta.shape, offset_bytes=offset, num_bytes=nbytes
                )
            )
            offset += nbytes
        buckets.append(Bucket(entries=tuple(entries), num_bytes=offset))
    return buckets


def layout_fingerprint(buckets: Sequence[Bucket], *, p2p: bool = False) -> int:
    """A positive int64 that differs (almost surely) whenever two ranks planned different layouts
    (or one sends point to point and another broadcasts)."""
    plan = ["p2p", list(buckets)] if p2p else list(buckets)
    digest = hashlib.sha256(msgspec.json.encode(plan)).digest()
    return int.from_bytes(digest[:_FINGERPRINT_BYTES], "little")


def uses_point_to_point(backend: str) -> bool:
    """Whether the sender and the receivers of a weight update group on `backend` pass `p2p=True`.

    On gloo, a point-to-point send per bucket and receiver, with receives posted `_P2P_IN_FLIGHT`
    buckets ahead, moved the same bytes faster than bucket broadcasts on loopback, with less CPU
    (the figures: bench/README.md, "Weight sync"). The sender then sends one stream per receiver,
    as gloo's own broadcast does for up to two receivers; across hosts with many generators, NCCL
    is the backend to use anyway. NCCL (and SGLang ranks, which receive broadcasts) keep
    broadcasts. Both sides decide from the backend named in the announcement; `_check_layout`
    turns a mismatch into an error on every rank, not a hang.
    """
    return backend in _P2P_BACKENDS


# ---------------------------------------------------------------------------------------------- group


@contextlib.contextmanager
def _no_split_from_default_group() -> Iterator[None]:
    """Stop torch from building the new group's communicator by splitting the default group's.

    When the default group is bound to a device (eager NCCL init), torch creates new groups with
    ncclCommSplit, a collective over *all* ranks of the default group; the generators are not in
    that group, so the split would hang. Unbinding it for the duration of the creation avoids that.
    """
    default_pg = c10d._world.default_pg if dist.is_initialized() else None
    bound = default_pg.bound_device_id if default_pg is not None else None
    if bound is None:
        yield
        return
    default_pg.bound_device_id = None
    try:
        yield
    finally:
        default_pg.bound_device_id = bound


def host_store(master_addr: str, *, world_size: int, timeout_s: float = 300.0) -> tuple[dist.TCPStore, int]:
    """Rank 0's TCPStore on a free port of `master_addr` (returned), without waiting for the others.

    Announce the port, then pass the store to `init_weight_update_group(..., store=store)`: the
    receivers learn the address from the announcement, so no port is guessed or reserved.
    """
    store = dist.TCPStore(
        master_addr, 0, world_size, True, timeout=timedelta(seconds=timeout_s), wait_for_workers=False
    )
    return store, store.port


def init_weight_update_group(
    *,
    master_addr: str,
    master_port: int,
    rank: int,
    world_size: int,
    group_name: str,
    backend: str = "gloo",
    timeout_s: float = 300.0,
    store: dist.Store | None = None,
) -> dist.ProcessGroup:
    """Join (rank 0: host) a process group used only for weight updates; blocks until all ranks join.

    Rank 0 (the learner) starts a TCPStore on `master_addr:master_port`; the store is wrapped in
    `PrefixStore(group_name, ...)` before the group is created, which is what SGLang's server side
    does, so SGLang ranks can be ranks 1.. of this group. Group ranks are used as-is (`src` in
    `broadcast_tensors` is a rank of this group). The learner's default group, if any, is untouched.
    Rank 0 may pass the `store` made by `host_store` instead (then `master_port` is not used).
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
    if store is None and not 0 < master_port < 65536:
        raise ValueError(f"master_port must be in 1..65535, got {master_port}")
    if not group_name:
        raise ValueError("group_name must be non-empty")
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
    if group_name in c10d._world.pg_names.values():
        raise ValueError(f"a process group named {group_name!r} already exists in this process")
    timeout = timedelta(seconds=timeout_s)
    if store is None:
        store = dist.TCPStore(master_addr, master_port, world_size, is_master=rank == 0, timeout=timeout)
    prefixed = dist.PrefixStore(group_name, store)
    with _no_split_from_default_group():
        pg, _ = c10d._new_process_group_helper(
            world_size, rank, [], dist.Backend(backend), prefixed, group_name=group_name, timeout=timeout
        )
    # Let torch.distributed collectives translate `src` for this group: its ranks are its own.
    c10d._world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    logger.info(
        "joined weight update group %r as rank %d of %d (%s, store %s:%d)",
        group_name,
        rank,
        world_size,
        backend,
        master_addr,
        master_port,
    )
    return pg


def destroy_weight_update_group(group: dist.ProcessGroup) -> None:
    """Leave and free a group made by `init_weight_update_group` (the default group is untouched),
    with this process's shared-memory ring of it, if any."""
    pairwise.release(group)
    dist.destroy_process_group(group)


# ---------------------------------------------------------------------------------------------- transfer


def _check_layout(
    group: dist.ProcessGroup, buckets: Sequence[Bucket], device: torch.device, *, p2p: bool
) -> None:
    """All ranks compare layouts with one tiny all-reduce; on a mismatch all of them raise (no hang)."""
    fingerprint = layout_fingerprint(buckets, p2p=p2p)
    both = torch.tensor([fingerprint, -fingerprint], dtype=torch.int64, device=device)
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
    high, neg_low = both.tolist()
    if high != fingerprint or -neg_low != fingerprint:
        raise ValueError(pairwise.LAYOUT_ERROR)


def _pairwise(device: torch.device) -> bool:
    """Whether ranks check layouts pair by pair (CPU: gloo, whose pairs fail alone; `pairwise.py`)
    rather than with one all-reduce (NCCL). Decided by the device, never by `p2p`, so that a sender
    and a receiver that disagree about `p2p` still run the same check and both raise."""
    return device.type == "cpu"


def _group_timeout_s(group: dist.ProcessGroup) -> float:
    """The timeout the group was made with (bounds every wait on the shared-memory ring too)."""
    try:
        return group._get_backend(torch.device("cpu")).options._timeout.total_seconds()
    except (AttributeError, RuntimeError):
        return _DEFAULT_TIMEOUT_S


def _flat_bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes as a 1-D uint8 view (no copy)."""
    return t.reshape(-1).view(torch.uint8)


def _entry_view(flat: torch.Tensor, entry: BucketEntry) -> torch.Tensor:
    window = flat[entry.offset_bytes : entry.offset_bytes + entry.num_bytes]
    return window.view(dtype_from_name(entry.dtype)).view(entry.shape)


def _resolve_device(device: str | torch.device) -> torch.device:
    """`"cuda"` -> `cuda:<current>`, so it compares equal to the devices of tensors on it."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def _fresh(num_bytes: int, device: torch.device) -> torch.Tensor:
    """A new receive buffer; on the CPU one that is cheap to fill the first time (huge pages)."""
    if device.type == "cpu":
        return fresh_cpu_bytes(num_bytes)
    return torch.empty(num_bytes, dtype=torch.uint8, device=device)


def _direct(t: torch.Tensor, device: torch.device) -> bool:
    """Whether a one-tensor bucket can be sent from / received into `t` itself."""
    return t.device == device and t.is_contiguous()


class _Staging:
    """Reusable flat buffers for buckets that cannot go direct (several tensors, or one that is not
    contiguous), used round-robin.

    With at most `num_slots` transfers outstanding and the oldest waited for before the next is
    started, a slot is never reused while a transfer on it is still in flight.
    """

    def __init__(self, num_bytes: int, device: torch.device, num_slots: int) -> None:
        self._num_bytes = num_bytes
        self._device = device
        self._num_slots = num_slots
        self._buffers: list[torch.Tensor] = []
        self._num_used = 0

    def next_slot(self, num_bytes: int) -> torch.Tensor:
        slot = self._num_used % self._num_slots
        self._num_used += 1
        # A lone tensor that cannot go direct (not contiguous) may outgrow every shared bucket.
        size = max(num_bytes, self._num_bytes)
        if slot == len(self._buffers):
            self._buffers.append(torch.empty(size, dtype=torch.uint8, device=self._device))
        elif self._buffers[slot].numel() < num_bytes:
            self._buffers[slot] = torch.empty(size, dtype=torch.uint8, device=self._device)
        return self._buffers[slot][:num_bytes]


def _staging_bytes(buckets: Sequence[Bucket]) -> int:
    return max((b.num_bytes for b in buckets if len(b.entries) > 1), default=0)


def _offer_layout(
    group: dist.ProcessGroup,
    buckets: Sequence[Bucket],
    device: torch.device,
    peers: Sequence[int],
    *,
    check_layout: bool,
    p2p: bool,
    local: str,
    bucket_bytes: int,
) -> pairwise.Offer:
    """The sender's side of the layout check: pairwise on the CPU (where receivers on this host
    may take the ring), one all-reduce otherwise, nothing without `check_layout`."""
    if check_layout and _pairwise(device):
        return pairwise.check_send(
            group,
            layout_fingerprint(buckets, p2p=p2p),
            peers,
            shm=p2p and local == "shm",
            bucket_bytes=bucket_bytes,
            timeout_s=_group_timeout_s(group),
        )
    if check_layout:
        _check_layout(group, buckets, device, p2p=p2p)
    return pairwise.Offer({}, None, ())


def _bucket_source(
    bucket: Bucket, by_name: Mapping[str, torch.Tensor], device: torch.device, staging: _Staging
) -> torch.Tensor:
    """The flat bytes to send for `bucket`: a lone direct tensor itself, else packed into a
    staging slot."""
    only = by_name[bucket.entries[0].name].detach() if len(bucket.entries) == 1 else None
    if only is not None and _direct(only, device):
        return _flat_bytes(only)
    flat = staging.next_slot(bucket.num_bytes)
    for entry in bucket.entries:
        _entry_view(flat, entry).copy_(by_name[entry.name].detach())
    return flat


class _Sends:
    """The sender's transfers in flight (a broadcast, or one send per receiver with `p2p`), at
    most `max_in_flight` buckets; a p2p receiver whose send fails is recorded in `failed` and
    skipped from then on, the others go on."""

    def __init__(self, group: dist.ProcessGroup, *, src: int, p2p: bool, failed: dict[int, str]) -> None:
        self.group = group
        self.src = src
        self.p2p = p2p
        self.failed = failed
        self.max_in_flight = _P2P_IN_FLIGHT if p2p else _MAX_IN_FLIGHT
        self.in_flight: collections.deque[list[tuple[int, dist.Work]]] = collections.deque()

    def make_room(self) -> None:
        """Wait for the oldest bucket when the window is full (frees its staging slot)."""
        if len(self.in_flight) == self.max_in_flight:
            self._wait(self.in_flight.popleft())

    def start(self, flat: torch.Tensor, peers: Sequence[int]) -> None:
        if not self.p2p:
            self.in_flight.append([(-1, dist.broadcast(flat, src=self.src, group=self.group, async_op=True))])
        elif live := [peer for peer in peers if peer not in self.failed]:
            self.in_flight.append([(peer, dist.isend(flat, dst=peer, group=self.group)) for peer in live])

    def drain(self) -> None:
        while self.in_flight:
            self._wait(self.in_flight.popleft())

    def _wait(self, works: list[tuple[int, dist.Work]]) -> None:
        for peer, work in works:
            try:
                work.wait()
            except RuntimeError as exc:
                if not self.p2p:
                    raise
                self.failed.setdefault(peer, pairwise.first_line(exc))


def broadcast_tensors(
    group: dist.ProcessGroup,
    tensors: Mapping[str, torch.Tensor] | Sequence[tuple[str, torch.Tensor]],
    *,
    bucket_bytes: int,
    src: int = 0,
    device: str | torch.device | None = None,
    check_layout: bool = True,
    p2p: bool = False,
    peers: Sequence[int] | None = None,
    local: str = "shm",
) -> int:
    """Send `tensors` (in order) to every other rank of `group`; returns the bytes sent.

    Receivers call `receive_tensors` with `tensor_metas(tensors)`, the same `bucket_bytes` and the
    same `p2p`. `device` is where the flat buffers live (default: the first tensor's device; "cuda"
    for NCCL). With `p2p` each bucket goes to each receiver as a send (`uses_point_to_point`), else
    as one broadcast. With `check_layout` all ranks first compare layout fingerprints (pairwise
    with `p2p`); turn it off only for receivers that do not do it (SGLang servers).

    With `p2p` on a CPU group and `local = "shm"` (weights.broadcast_local), receivers on this host
    get the bytes through the shared-memory ring instead (`shm_ring.py`; settled in the layout
    check, `pairwise.py`); `"gloo"` sends to every receiver over the group.

    With `p2p`, `peers` (default: every other rank) are the receivers; one that fails (its process
    died) is dropped and the others still get everything, then `PeersLost` is raised.
    """
    if local not in LOCAL_PATHS:
        raise ValueError(f"local must be one of {', '.join(LOCAL_PATHS)}, got {local!r}")
    items = list(tensors.items()) if isinstance(tensors, Mapping) else list(tensors)
    if not items:
        raise ValueError("there are no tensors to broadcast")
    by_name = dict(items)
    buckets = plan_buckets(tensor_metas(items), bucket_bytes=bucket_bytes)
    device = _resolve_device(device if device is not None else items[0][1].device)
    if peers is None:
        peers = [rank for rank in range(group.size()) if rank != src]
    elif not p2p:
        raise ValueError("peers is for p2p transfers (a broadcast reaches every rank)")
    offer = _offer_layout(
        group,
        buckets,
        device,
        peers,
        check_layout=check_layout,
        p2p=p2p,
        local=local,
        bucket_bytes=bucket_bytes,
    )
    failed, ring, ring_ranks = dict(offer.failed), offer.ring, offer.ring_ranks
    gloo_peers = [peer for peer in peers if peer not in failed and peer not in ring_ranks]
    sends = _Sends(group, src=src, p2p=p2p, failed=failed)
    staging = _Staging(_staging_bytes(buckets), device, sends.max_in_flight)
    if ring is not None:
        ring.begin()
    try:
        for bucket in buckets:
            if bucket.num_bytes == 0:
                continue  # nothing to send; receivers skip it too
            sends.make_room()  # frees the staging slot used below
            flat = _bucket_source(bucket, by_name, device, staging)
            sends.start(flat, gloo_peers)
            if ring is not None:  # while the sends above go out on gloo's threads
                ring.write(flat)
        sends.drain()
        if ring is not None:
            failed.update(ring.finish())
    except BaseException:
        if ring is not None:  # a ring left mid-stream is not reused: its readers see an end of file
            pairwise.release(group)
        raise
    num_bytes = sum(b.num_bytes for b in buckets)
    if failed:
        raise PeersLost(failed, num_bytes)
    return num_bytes


def _check_out(out: Mapping[str, torch.Tensor], metas: Sequence[TensorMeta]) -> None:
    """Every name the sender sends has a tensor of its dtype and shape in `out`."""
    for meta in metas:
        dest = out.get(meta.name)
        if dest is None:
            raise ValueError(f"out has no tensor named {meta.name!r}")
        if dtype_name(dest.dtype) != meta.dtype or tuple(dest.shape) != meta.shape:
            raise ValueError(
                f"out[{meta.name!r}] is {dtype_name(dest.dtype)}{list(dest.shape)}, "
                f"the sender sends {meta.dtype}{list(meta.shape)}"
            )


def _accept_layout(
    group: dist.ProcessGroup,
    buckets: Sequence[Bucket],
    device: torch.device,
    *,
    src: int,
    check_layout: bool,
    p2p: bool,
) -> RecvRing | None:
    """The receiver's side of the layout check; returns the sender's shared-memory ring when this
    receiver reads from it (`pairwise.check_receive`), else None."""
    if check_layout and _pairwise(device):
        return pairwise.check_receive(
            group,
            layout_fingerprint(buckets, p2p=p2p),
            src,
            ring_capable=p2p,
            timeout_s=_group_timeout_s(group),
        )
    if check_layout:
        _check_layout(group, buckets, device, p2p=p2p)
    return None


class _Unpacker:
    """Where received buckets land: views of fresh buffers (`received`), or copies into `out`."""

    def __init__(
        self, out: Mapping[str, torch.Tensor] | None, device: torch.device, staging: _Staging
    ) -> None:
        self.out = out
        self.device = device
        self.staging = staging
        self.received: dict[str, torch.Tensor] = {}

    def target(self, bucket: Bucket) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(buffer to receive `bucket` into, flat buffer to unpack afterwards or None when the
        bytes go straight into the one `out` tensor)."""
        out = self.out
        only = out[bucket.entries[0].name].detach() if out is not None and len(bucket.entries) == 1 else None
        if only is not None and _direct(only, self.device):
            return _flat_bytes(only), None
        flat = (
            _fresh(bucket.num_bytes, self.device) if out is None else self.staging.next_slot(bucket.num_bytes)
        )
        return flat, flat

    def unpack(self, bucket: Bucket, flat: torch.Tensor | None) -> None:
        if flat is None:
            return
        for entry in bucket.entries:
            view = _entry_view(flat, entry)
            if self.out is None:
                self.received[entry.name] = view
            else:
                self.out[entry.name].detach().copy_(view)

    def result(self, metas: Sequence[TensorMeta]) -> dict[str, torch.Tensor]:
        got = self.received if self.out is None else self.out
        return {meta.name: got[meta.name] for meta in metas}


def receive_tensors(
    group: dist.ProcessGroup,
    metas: Sequence[TensorMeta],
    *,
    bucket_bytes: int,
    src: int = 0,
    device: str | torch.device = "cpu",
    out: Mapping[str, torch.Tensor] | None = None,
    check_layout: bool = True,
    p2p: bool = False,
) -> dict[str, torch.Tensor]:
    """Receive what `broadcast_tensors` sends (with the same `bucket_bytes` and `p2p`); returns
    {name: tensor} in `metas` order.

    Without `out`, tensors are fresh, on `device` (views into one buffer per bucket). With `out`
    (name -> existing tensor for every name in `metas`, e.g. model parameters) the bytes land in
    those tensors: directly when a bucket holds one contiguous tensor on `device`, else through a
    staging buffer on `device` and a copy. Whether they come over gloo or through the sender's
    shared-memory ring is the sender's choice, made in the layout check (`pairwise.py`); a ring
    that breaks mid-transfer (the sender died) raises `shm_ring.RingBroken`, a RuntimeError.
    """
    device = _resolve_device(device)
    buckets = plan_buckets(metas, bucket_bytes=bucket_bytes)
    if out is not None:
        _check_out(out, metas)
    ring = _accept_layout(group, buckets, device, src=src, check_layout=check_layout, p2p=p2p)
    max_in_flight = _P2P_IN_FLIGHT if p2p else _MAX_IN_FLIGHT
    unpacker = _Unpacker(out, device, _Staging(_staging_bytes(buckets), device, max_in_flight))
    # (work, bucket, flat buffer or None when the bytes went straight into out)
    in_flight: collections.deque[tuple[dist.Work, Bucket, torch.Tensor | None]] = collections.deque()

    def finish(work: dist.Work, bucket: Bucket, flat: torch.Tensor | None) -> None:
        work.wait()
        unpacker.unpack(bucket, flat)

    if ring is not None:
        ring.begin(sum(b.num_bytes for b in buckets))
    try:
        for bucket in buckets:
            if bucket.num_bytes == 0:  # only empty tensors: the sender sends nothing for it
                unpacker.unpack(bucket, torch.empty(0, dtype=torch.uint8, device=device))
                continue
            if len(in_flight) == max_in_flight:
                finish(*in_flight.popleft())
            target, flat = unpacker.target(bucket)
            if ring is not None:  # synchronous: the bytes are in `target` on return
                ring.read_into(target)
                unpacker.unpack(bucket, flat)
                continue
            if p2p:
                work = dist.irecv(target, src=src, group=group)
            else:
                work = dist.broadcast(target, src=src, group=group, async_op=True)
            in_flight.append((work, bucket, flat))
        while in_flight:
            finish(*in_flight.popleft())
        if ring is not None:
            ring.finish()
    except BaseException:
        if ring is not None:  # left mid-stream: closing it tells the sender at once; the next
            pairwise.release(group)  # transfer joins a ring afresh (or takes gloo)
        raise
    return unpacker.result(metas)
