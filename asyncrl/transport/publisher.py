"""The learner's side of weight sync, behind one seam: publish a version, take acknowledgements.

Place in the data flow: after each optimizer step the learner (rank 0) awaits `publish` on its
event loop with the detached state dict and an async `announce` callable that sends a message to
the launcher (which forwards the `WeightsPublished` announcement, `ShardsPublished` or
`BroadcastPublished`, to every generator). A transport announces when it
suits it (shards: after the atomic rename; a broadcast group: before the bytes move, so receivers
join) and returns the announcement it sent. Each generator's `WeightsLoaded` comes back on the
same loop as `on_loaded`. Retention (which versions may be deleted) lives here too.

Implementations of `WeightPublisher`: `ShardPublisher` (weights.transport = "shards"),
`AdapterPublisher` (learner.lora.publish = "adapter": a PEFT adapter directory per version, the
same versioning and retention) and `BroadcastPublisher` ("broadcast": the store address and layout
go out in the announcement, generators join the group lazily, the bytes follow over it; then
catch-up shards for generators outside the group). Both broadcast flavours share `GroupPublisher`, the announce / send / catch-up /
retention flow written once; a backend only says how the bytes cross the group.

`make_publisher` picks one from the weights section (and the generator backend's name and options,
which it takes as plain arguments). A generator backend whose servers take weights in their
own way registers a factory (`PublisherFactory`) under the entry-point group `asyncrl.publishers`,
named `<generator registry name>.<weights transport>` (e.g. `mybackend.broadcast`); this module never
names a backend. See docs/weights.md.
"""

from __future__ import annotations

import abc
import asyncio
import json
import logging
import os
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import msgspec
import torch

from asyncrl.messages import BroadcastPublished, ShardsPublished, WeightsPublished
from asyncrl.plugins import available, load_plugin
from asyncrl.transport import security
from asyncrl.transport.checksum import DEFAULT_CHECKSUM
from asyncrl.transport.delta import DeltaBase
from asyncrl.transport.fence import AckWatch
from asyncrl.transport.retention import VersionRetention, prune
from asyncrl.transport.shards import StreamedState, write_shards

if TYPE_CHECKING:
    from asyncrl.config_sections import WeightsConfig

log = logging.getLogger(__name__)

Announce = Callable[[WeightsPublished], Awaitable[None]]

# Shards of at most this size: small enough to load in parallel, large enough to stream well.
MAX_SHARD_BYTES = 512 * 1024 * 1024

# weights.update_deadline_s's default: how long after a publish the learner says which
# generators have not acknowledged it.
UPDATE_DEADLINE_S = 120.0

PUBLISHERS_GROUP = "asyncrl.publishers"
# Read only for its registry names (a `pkg.mod:obj` generators.kind maps back to its name);
# transport never imports a generator.
GENERATORS_GROUP = "asyncrl.generators"


@runtime_checkable
class WeightPublisher(Protocol):
    """What the learner calls, on its event loop, to ship every policy_version."""

    async def publish(
        self, state: Mapping[str, torch.Tensor], version: int, announce: Announce
    ) -> WeightsPublished:
        """Make `version` available to every generator and `announce` it; returns the announcement
        of the version's main transport (a catch-up copy may be announced after it)."""

    def on_loaded(self, generator_id: str, version: int) -> None:
        """A generator acknowledged holding `version`: retention may drop what nobody needs."""

    def close(self) -> None:
        """Release sockets and groups; idempotent."""


class PublisherFactory(Protocol):
    """An `asyncrl.publishers` plugin: builds the backend's publisher from the weights section.

    `generator_options` is generators.options (the backend's own keys); `generator_ids` are the
    run's generators; `catchup` is the shard publisher to copy each version to for generators
    outside a group (None with weights.transport = "shards" or catchup_shards off).
    """

    def __call__(
        self,
        weights: WeightsConfig,
        *,
        generator_options: Mapping[str, Any],
        generator_ids: Sequence[str],
        catchup: ShardPublisher | None,
    ) -> WeightPublisher: ...


class AckDeadlines:
    """The learner never waits past an update's deadline without saying for whom: `deadline_s`
    after each publish, the generators that have not acked it (nor anything newer) are logged by
    id, and so is each of their acks when it comes (`fence.AckWatch`). Runs on the learner's loop."""

    def __init__(self, generator_ids: Iterable[str], deadline_s: float) -> None:
        self.watch = AckWatch(generator_ids)
        self.deadline_s = deadline_s
        self._timers: dict[int, asyncio.TimerHandle] = {}
        self.num_overdue = 0

    def published(self, version: int) -> None:
        self.watch.published(version, time.monotonic())
        loop = asyncio.get_running_loop()
        self._timers[version] = loop.call_later(self.deadline_s, self._check, version)

    def _check(self, version: int) -> None:
        self._timers.pop(version, None)
        late = self.watch.overdue(version, time.monotonic())
        if late is not None:
            self.num_overdue += 1
            log.warning(
                "weights version %d: no WeightsLoaded from %s %.0f s after it was published "
                "(weights.update_deadline_s = %g); admission waits for them",
                version,
                ", ".join(late.generator_ids),
                late.waited_s,
                self.deadline_s,
            )

    def acked(self, generator_id: str, version: int) -> None:
        since = self.watch.acked(generator_id, version)
        if since is not None:
            log.warning(
                "weights version %d: %s acknowledged it %.1f s after it was published, past the deadline",
                version,
                generator_id,
                time.monotonic() - since,
            )

    def close(self) -> None:
        for timer in self._timers.values():
            timer.cancel()
        self._timers.clear()


class ShardPublisher:
    """Versioned safetensors shards under `weights_dir` (see `shards.py`), last K kept.

    With `recycle` (the default) the newest pruned version stays as a hidden spare whose files the
    next publish overwrites (`retention.prune(..., keep_spare=True)`): on tmpfs, overwriting old
    files costs less CPU than writing new ones (docs/weights.md). `checksum` is the files' hash
    (`checksum.py`); with `delta` each version after the first is also written as a delta from the
    one before (`delta.py`; the publisher keeps that version's bytes, one copy of the weights).
    """

    single_file: str | None = None  # write_shards(single_file=...): one named file, no index
    # Takes a `shards.StreamedState`: the tensors are produced shard by shard while written.
    streams_state = True
    adapter = False  # announced as ShardsPublished.adapter

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
        checksum: str = DEFAULT_CHECKSUM,
        delta: bool = False,
        deadline_s: float = UPDATE_DEADLINE_S,
    ) -> None:
        ids = list(generator_ids)
        self.weights_dir = weights_dir
        self.recycle = recycle
        self.extra_files = dict(extra_files)
        self.max_shard_bytes = max_shard_bytes
        self.catchup = catchup  # announcements are marked as copies of broadcast versions
        self.checksum = checksum
        self.delta_base = DeltaBase() if delta else None
        self.retention = VersionRetention(keep_last)
        for gid in ids:
            self.retention.register(gid)
        # A catch-up copy's acks are watched by the group publisher that owns it.
        self.deadlines = None if catchup else AckDeadlines(ids, deadline_s)
        self.num_bytes_written = 0  # tensor bytes of every version published (full)
        # bytes of every delta file written (weights.delta), for the bytes-per-update figures
        self.num_delta_bytes = 0

    async def publish(
        self, state: Mapping[str, torch.Tensor], version: int, announce: Announce
    ) -> ShardsPublished:
        msg = await asyncio.to_thread(self._write, state, version)
        self.retention.publish(version)
        if self.deadlines is not None:
            self.deadlines.published(version)
        await announce(msg)
        return msg

    def _write(self, state: Mapping[str, torch.Tensor], version: int) -> ShardsPublished:
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
            single_file=self.single_file,
            checksum=self.checksum,
            delta_base=self.delta_base,
        )
        self.num_bytes_written += manifest.total_size_bytes
        if manifest.delta is not None:
            self.num_delta_bytes += sum(d.size_bytes for d in manifest.delta.files)
        return ShardsPublished(
            version=version,
            root=str(self.weights_dir),
            num_bytes=manifest.total_size_bytes,
            publish_s=time.perf_counter() - start,
            catchup=self.catchup,
            adapter=self.adapter,
        )

    def on_loaded(self, generator_id: str, version: int) -> None:
        """Loop thread: a generator holds `version`; delete what nobody can still need."""
        if self.deadlines is not None:
            self.deadlines.acked(generator_id, version)
        if version > 0:
            self.retention.ack(generator_id, version)
            prune(self.weights_dir, self.retention, keep_spare=self.recycle)

    def close(self) -> None:
        if self.deadlines is not None:
            self.deadlines.close()


class AdapterPublisher(ShardPublisher):
    """learner.lora.publish = "adapter": each version is a PEFT adapter directory,

        v00000042/  adapter_model.safetensors, adapter_config.json, manifest.json

    published, announced (`ShardsPublished.adapter`) and retained exactly like shards, for
    generators whose servers load adapters (SGLang's `/load_lora_adapter`). `publish` takes the
    adapter's tensors under PEFT's names (`learner.lora.adapter_state`); `adapter_config` is the
    content of adapter_config.json (`learner.lora.adapter_config`), the same for every version.
    """

    single_file = "adapter_model.safetensors"  # learner.lora.ADAPTER_WEIGHTS_NAME
    adapter = True

    def __init__(
        self,
        weights_dir: Path,
        *,
        adapter_config: Mapping[str, Any],
        keep_last: int,
        generator_ids: Iterable[str],
        recycle: bool = True,
        checksum: str = DEFAULT_CHECKSUM,
        deadline_s: float = UPDATE_DEADLINE_S,
    ) -> None:
        config_bytes = json.dumps(dict(adapter_config), indent=2, sort_keys=True).encode()
        super().__init__(
            weights_dir,
            extra_files={"adapter_config.json": config_bytes},
            keep_last=keep_last,
            generator_ids=generator_ids,
            recycle=recycle,
            checksum=checksum,
            deadline_s=deadline_s,
        )


class GroupPublisher(abc.ABC):
    """Learner rank 0 of a torch.distributed weight update group whose other ranks are `members`.

    The first `publish` hosts the group's store on a free port, announces it with the layout and
    the member list, and creates the group (blocking, off the loop, until every member has joined).
    Each publish announces first and then sends, so the members are already receiving. With
    `catchup` (a ShardPublisher) the version is then also written as shards and announced again,
    marked `catchup`, for generators outside the group (late joiners, restarted generators). If a
    send fails with one of `send_errors` (a member died, the rendezvous timed out) and there is a
    catch-up path, the group is dropped and shards carry every later version. A point-to-point
    transfer that loses only some members (`broadcast.PeersLost`: the others got every byte)
    drops just those: they take catch-up shards from then on, the rest stay in the group.

    Subclasses say how the bytes cross the group (`_transfer`).
    """

    send_errors: tuple[type[Exception], ...] = (RuntimeError,)

    def __init__(
        self,
        *,
        members: Iterable[str],
        bucket_bytes: int,
        timeout_s: float,
        catchup: ShardPublisher | None,
        master_addr: str = "",
        group_name: str,
        deadline_s: float = UPDATE_DEADLINE_S,
    ) -> None:
        self.members = tuple(members)  # member i (a generator id) owns group rank i + 1
        self.lost: set[str] = set()  # members dropped after a failed transfer: catch-up shards only
        self.deadlines = AckDeadlines(sorted(set(self.members)), deadline_s)
        self.bucket_bytes = bucket_bytes
        self.timeout_s = timeout_s
        self.catchup = catchup
        # The group's store host, told to every member: "" = this process's advertised address
        # (cluster.advertise_host / bind_host; loopback by default).
        self.master_addr = master_addr or security.current().advertise_host
        self.group_name = group_name
        self.group = None
        self._store = None
        self._store_address = ""
        self._first_version = -1
        self._early_acks: dict[str, int] = {}
        self.failed = False
        self.num_bytes_sent = 0

    @property
    def world_size(self) -> int:
        return len(self.members) + 1

    @property
    def live_ranks(self) -> list[int]:
        """Group ranks still sent to (members not lost)."""
        return [i + 1 for i, gid in enumerate(self.members) if gid not in self.lost]

    @abc.abstractmethod
    def _transfer(self, items: list[tuple[str, torch.Tensor]], backend: str) -> int:
        """Worker thread: send every tensor of `items` to the members over `self.group`, in the
        order the announcement lists them; returns the bytes sent. What each backend says: how
        the bytes cross the group (our bucket broadcast, or the SGLang servers' own protocol)."""

    async def publish(
        self, state: Mapping[str, torch.Tensor], version: int, announce: Announce
    ) -> WeightsPublished:
        from asyncrl.transport.broadcast import PeersLost, host_store, tensor_metas

        if self.failed:  # the group is gone (a member died): catch-up shards only
            assert self.catchup is not None
            self.deadlines.published(version)
            return await self.catchup.publish(state, version, announce)
        start = time.perf_counter()
        if isinstance(state, StreamedState):  # sent, then written as catch-up shards: needed twice
            state = state.materialize()
        items = [(name, t.detach()) for name, t in state.items()]
        backend = "nccl" if items and items[0][1].is_cuda else "gloo"
        if self._store is None:
            self._store, port = host_store(
                self.master_addr, world_size=self.world_size, timeout_s=self.timeout_s
            )
            self._store_address = f"{self.master_addr}:{port}"
            self._first_version = version
        msg = BroadcastPublished(
            version=version,
            store_address=self._store_address,
            num_bytes=sum(t.numel() * t.element_size() for _, t in items),
            tensors=tuple(tensor_metas(items)),
            bucket_bytes=self.bucket_bytes,
            group_name=self.group_name,
            group_backend=backend,
            group_members=self.members,
            group_first_version=self._first_version,
            group_timeout_s=self.timeout_s,
        )
        self.deadlines.published(version)
        await announce(msg)
        try:
            await asyncio.to_thread(self._send, items, backend)
        except PeersLost as exc:
            if self.catchup is None:
                raise
            lost = sorted({self.members[rank - 1] for rank in exc.failed})
            self.lost.update(lost)
            self.num_bytes_sent += exc.num_bytes
            log.error(
                "weights version %d: the transfer over the group %r lost %s (%s); they take catch-up "
                "shards from now on, the other members got every byte",
                version,
                self.group_name,
                ", ".join(lost),
                exc,
            )
            if not self.live_ranks:
                self.failed = True
                self._drop_group()
        except self.send_errors as exc:
            if self.catchup is None:
                raise
            log.error(
                "sending weights version %d over the group %r failed (%s); the group is dropped and "
                "weights go as shards from now on",
                version,
                self.group_name,
                exc,
            )
            self.failed = True
            self._drop_group()
        msg = msgspec.structs.replace(msg, publish_s=time.perf_counter() - start)
        if self.catchup is not None:
            await self.catchup.publish(state, version, announce)
            for gid, acked in list(self._early_acks.items()):
                if acked <= version:
                    del self._early_acks[gid]
                    self.catchup.on_loaded(gid, acked)
        return msg

    def _send(self, items: list[tuple[str, torch.Tensor]], backend: str) -> None:
        """Worker thread: create the group on the first version (blocks until every member joined),
        then transfer."""
        if self.group is None:
            from asyncrl.transport.broadcast import init_weight_update_group

            assert self._store is not None
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
            log.info("weight update group %r formed with %d member ranks", self.group_name, len(self.members))
        self.num_bytes_sent += self._transfer(items, backend)

    def on_loaded(self, generator_id: str, version: int) -> None:
        """Members may ack a version before its catch-up shards exist: retention hears it then."""
        self.deadlines.acked(generator_id, version)
        if self.catchup is None:
            return
        published = self.catchup.retention.published
        if published and version <= published[-1]:
            self.catchup.on_loaded(generator_id, version)
        else:
            self._early_acks[generator_id] = version

    def _drop_group(self) -> None:
        if self.group is not None:
            from asyncrl.transport.broadcast import destroy_weight_update_group

            destroy_weight_update_group(self.group)
            self.group = None
        self._store = None

    def close(self) -> None:
        self._drop_group()
        self.deadlines.close()


class BroadcastPublisher(GroupPublisher):
    """The group's members are generator processes (docs/weights.md): bucketed broadcasts, or
    point-to-point sends on gloo, received by `transport/receiver.py` in the generator service.
    `local` (weights.broadcast_local): on gloo, members on this host read the bytes from a
    shared-memory ring ("shm") or get gloo's sends ("gloo")."""

    def __init__(
        self,
        *,
        generator_ids: Iterable[str],
        bucket_bytes: int,
        timeout_s: float,
        catchup: ShardPublisher | None,
        master_addr: str = "",
        group_name: str | None = None,
        deadline_s: float = UPDATE_DEADLINE_S,
        local: str = "shm",
    ) -> None:
        self.local = local
        super().__init__(
            members=generator_ids,
            bucket_bytes=bucket_bytes,
            timeout_s=timeout_s,
            catchup=catchup,
            master_addr=master_addr,
            group_name=group_name or f"asyncrl-weights-{os.getpid()}",
            deadline_s=deadline_s,
        )

    def _transfer(self, items: list[tuple[str, torch.Tensor]], backend: str) -> int:
        from asyncrl.transport.broadcast import broadcast_tensors, uses_point_to_point

        p2p = uses_point_to_point(backend)
        return broadcast_tensors(
            self.group,
            items,
            bucket_bytes=self.bucket_bytes,
            p2p=p2p,
            peers=self.live_ranks if p2p else None,
            local=self.local,
        )


def generator_name(kind: str) -> str | None:
    """The registry name of `generators.kind`: the name itself, or the name whose entry point is the
    `pkg.mod:obj` path given; None for a path no installed generator registers."""
    if ":" not in kind:
        return kind
    return next((name for name, target in available(GENERATORS_GROUP).items() if target == kind), None)


def publisher_key(generator_kind: str, transport: str) -> str | None:
    """The `asyncrl.publishers` name that replaces the built-in publisher for generators.kind
    `generator_kind` and weights transport `transport` ("shards" or "broadcast"), if any:
    `<generator registry name>.<transport>`, when such a plugin is installed."""
    name = generator_name(generator_kind)
    if name is None:
        return None
    key = f"{name}.{transport}"
    return key if key in available(PUBLISHERS_GROUP) else None


def make_publisher(
    weights: WeightsConfig,
    *,
    generator_kind: str,
    generator_options: Mapping[str, Any],
    run_dir: Path,
    model_dir: Path,
    generator_ids: Iterable[str],
    adapter_config: Mapping[str, Any] | None = None,
) -> WeightPublisher:
    """The publisher for `weights.transport` and the generator backend (`generator_kind` and
    `generator_options`: generators.kind and generators.options; see the module doc).

    With `adapter_config` (learner.lora.publish = "adapter": `learner.lora.adapter_config(model)`)
    it is an `AdapterPublisher`, whatever the transport; None publishes full weights.
    """
    from asyncrl.transport.shards import collect_config_files

    ids = list(generator_ids)
    weights_dir = Path(weights.dir) if weights.dir else run_dir / "weights"
    if adapter_config is not None:
        return AdapterPublisher(
            weights_dir,
            adapter_config=adapter_config,
            keep_last=weights.keep_last,
            generator_ids=ids,
            checksum=weights.checksum,
            deadline_s=weights.update_deadline_s,
        )
    shards = ShardPublisher(
        weights_dir,
        extra_files=collect_config_files(model_dir),
        keep_last=weights.keep_last,
        generator_ids=ids,
        max_shard_bytes=weights.max_shard_bytes,
        catchup=weights.kind == "broadcast",
        checksum=weights.checksum,
        delta=weights.delta,
        deadline_s=weights.update_deadline_s,
    )
    catchup = shards if weights.kind != "shards" and weights.catchup_shards else None
    key = publisher_key(generator_kind, weights.kind)
    if key is not None:
        factory: PublisherFactory = load_plugin(
            PUBLISHERS_GROUP, key, field="generators.kind", what="weight publisher"
        )
        return factory(weights, generator_options=generator_options, generator_ids=ids, catchup=catchup)
    if weights.kind == "shards":
        return shards
    return BroadcastPublisher(
        generator_ids=ids,
        bucket_bytes=weights.bucket_bytes,
        timeout_s=weights.group_timeout_s,
        catchup=catchup,
        deadline_s=weights.update_deadline_s,
        local=weights.broadcast_local,
    )
