"""The generator's side of weight sync: turn an announcement into verified tensors.

Place in the data flow: the launcher forwards each `WeightsPublished` (`ShardsPublished` or
`BroadcastPublished`) to every generator; the
generator service asks `WeightsReceiver.plan` whether to act on it, runs `fetch` in a worker thread
(it blocks on disk or on the group), and hands the complete tensors to its generator, which copies
them into the model at a safe point and acks with `WeightsLoaded`. Nothing here touches the model,
so a failed fetch leaves the weights being served untouched.

- shards: `read_shards(root, version, verify=True)` into fresh CPU tensors (on a host without
  the weights root, `remote` first fetches the version over the network into a local cache,
  `serve.NetworkWeights`, and `root` is that cache); a missing, truncated or corrupt file raises `WeightsCorruptError` naming it (or FileNotFoundError when the
  version is gone); the service keeps the old weights and retries. When the manifest says the next
  version may come as a delta (`delta_next`), the fetched tensors are kept (`delta.HeldVersion`),
  and a version whose delta is based on exactly them is rebuilt from its delta files; any other
  reader (a late joiner, one that missed a version, one whose delta failed) reads the full shards.
- broadcast: the first broadcast announcement a generator sees founds the group (it carries the
  store address, the member list and the layout), so the generator joins lazily as rank
  `group_members.index(id) + 1`; every later broadcast must then be received, in order. A generator
  whose first announcement is a later one (it joined late: a group cannot grow) stays outside and
  takes the catch-up shards the learner writes after each broadcast instead. If a broadcast fails
  (a member died), the learner drops the group and publishes catch-up shards only; members take
  those once they are newer than the last broadcast announced. A receive that fails (the sender
  dropped this member, or died) leaves the group and raises `fence.UpdateFailed`; from then on this
  generator takes catch-up shards, including the one of the failed version.

A shards announcement whose `root` is outside the weights root (`root`, weights.dir) is
refused in `plan`, counted (`num_refused_locations`) and never read.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

from asyncrl.messages import BroadcastPublished, ShardsPublished, WeightsPublished
from asyncrl.transport.fence import UpdateFailed
from asyncrl.transport.manifest import WeightsCorruptError

log = logging.getLogger(__name__)


def weights_root(weights_dir: str, run_dir: str | Path) -> Path:
    """Where a run's shards live: weights.dir, or <run_dir>/weights when it is empty."""
    return Path(weights_dir) if weights_dir else Path(run_dir) / "weights"


def _within(path: str, root: Path) -> bool:
    """Whether `path` is `root` or below it, symlinks and `..` resolved."""
    where, top = os.path.realpath(path), os.path.realpath(root)
    return where == top or where.startswith(top.rstrip(os.sep) + os.sep)


class WeightsReceiver:
    def __init__(
        self, generator_id: str, *, num_read_threads: int | None = None, root: str | Path | None = None
    ) -> None:
        self.generator_id = generator_id
        # The weights root (`weights_root`): an announced shards root outside it is refused,
        # counted and never read (a peer that could announce must not make us read /etc).
        self.root = None if root is None else Path(root)
        self.num_refused_locations = 0
        self.num_read_threads = num_read_threads
        self.group = None  # the weight update group, once joined
        self.member: bool | None = None  # decided by the first announcement seen
        self.last_broadcast_version = -1
        self.held = None  # delta.HeldVersion: the last version fetched, when a delta may follow it
        self.last_fetch_bytes = 0  # bytes read for the last version fetched (delta or full)
        self.last_fetch_delta = False
        self.num_delta_fetches = 0
        # serve.NetworkWeights on a host that cannot see the weights root (a worker that joined):
        # each version is fetched into its local cache first, then read there like local shards.
        self.remote = None

    def plan(self, msg: WeightsPublished) -> bool:
        """Whether to fetch `msg` (False: not for this generator). Call once per announcement, in order."""
        if isinstance(msg, BroadcastPublished):
            if self.member is None:
                founding = msg.version == msg.group_first_version
                self.member = founding and self.generator_id in msg.group_members
                if not self.member:
                    log.warning(
                        "%s: joined after the weight update group formed (at version %d); "
                        "taking catch-up shards instead",
                        self.generator_id,
                        msg.group_first_version,
                    )
            if self.member:
                self.last_broadcast_version = msg.version
            return self.member
        if self.member is None:
            self.member = False
        # (A host that fetches over the network (`remote`) never reads `msg.root` itself.)
        if self.root is not None and self.remote is None and not _within(msg.root, self.root):
            self.num_refused_locations += 1
            log.error(
                "%s: weights version %d announced at %r, outside the weights root %s: refused, not read "
                "(%d refused so far)",
                self.generator_id,
                msg.version,
                msg.root,
                self.root,
                self.num_refused_locations,
            )
            return False
        # Members already got these bytes over the group; a newer catch-up means the learner gave
        # the group up (a member died) and publishes shards only from now on.
        return not (self.member and msg.catchup and msg.version <= self.last_broadcast_version)

    def must_fetch(self, msg: WeightsPublished) -> bool:
        """A broadcast cannot be skipped by a member: the sender waits for every rank."""
        return isinstance(msg, BroadcastPublished) and bool(self.member)

    def fetch(self, msg: WeightsPublished) -> dict[str, torch.Tensor]:
        """Blocking: the announced version as {name: tensor} on the CPU, verified or complete."""
        if isinstance(msg, BroadcastPublished):
            self.held = None  # a delta's base is a version read from shards
            try:
                return self._receive(msg)
            except (RuntimeError, ValueError) as exc:
                self.leave_group()
                raise UpdateFailed(
                    f"weights version {msg.version}: the broadcast failed ({exc}); left the group, "
                    "taking catch-up shards from now on"
                ) from exc
        return self._read(msg)

    def _read(self, msg: ShardsPublished) -> dict[str, torch.Tensor]:
        from asyncrl.transport.delta import HeldVersion
        from asyncrl.transport.shard_read import read_manifest, read_shards

        root = Path(msg.root)
        if self.remote is not None:
            held_now = self.held
            root = self.remote.fetch(
                msg.version, use_delta=lambda m: held_now is not None and held_now.matches(m.delta)
            )
        manifest = read_manifest(root, msg.version)
        held = self.held if self.held is not None and self.held.matches(manifest.delta) else None
        try:
            state = read_shards(
                root,
                msg.version,
                verify=True,
                num_threads=self.num_read_threads,
                held=held,
                manifest=manifest,
            )
        except WeightsCorruptError:
            if held is not None:  # a delta that failed is never tried again: full shards next
                self.held = None
            raise
        self.last_fetch_delta = held is not None
        if held is not None:
            self.num_delta_fetches += 1
            self.last_fetch_bytes = sum(d.size_bytes for d in manifest.delta.files)
        else:
            self.last_fetch_bytes = sum(f.size_bytes for f in manifest.files)
        self.held = HeldVersion.of(manifest, state) if manifest.delta_next else None
        return state

    def _receive(self, msg: BroadcastPublished) -> dict[str, torch.Tensor]:
        from asyncrl.transport.broadcast import init_weight_update_group, receive_tensors, uses_point_to_point

        if self.group is None:
            host, _, port = msg.store_address.rpartition(":")
            if not host or not port.isdigit():
                raise ValueError(f"broadcast announcement has a bad store address {msg.store_address!r}")
            self.group = init_weight_update_group(
                master_addr=host,
                master_port=int(port),
                rank=msg.group_members.index(self.generator_id) + 1,
                world_size=len(msg.group_members) + 1,
                group_name=msg.group_name,
                backend=msg.group_backend,
                timeout_s=msg.group_timeout_s,
            )
        device = "cuda" if msg.group_backend == "nccl" else "cpu"
        received = receive_tensors(
            self.group,
            list(msg.tensors),
            bucket_bytes=msg.bucket_bytes,
            device=device,
            p2p=uses_point_to_point(msg.group_backend),
        )
        if device != "cpu":
            received = {n: t.cpu() for n, t in received.items()}
        return received

    def leave_group(self) -> None:
        """Stop being a member: later broadcasts are not received, catch-up shards are taken."""
        self.member = False
        self.last_broadcast_version = -1
        self.close()

    def close(self) -> None:
        if self.group is not None:
            from asyncrl.transport.broadcast import destroy_weight_update_group

            destroy_weight_update_group(self.group)
            self.group = None
