"""The generator's side of weight sync: turn an announcement into verified tensors.

Place in the data flow: the launcher forwards each `WeightsPublished` to every generator; the
generator service asks `WeightsReceiver.plan` whether to act on it, runs `fetch` in a worker thread
(it blocks on disk or on the group), and hands the complete tensors to its generator, which copies
them into the model at a safe point and acks with `WeightsLoaded`. Nothing here touches the model,
so a failed fetch leaves the weights being served untouched.

- safetensors: `read_shards(root, version, verify=True)` into fresh CPU tensors; a missing,
  truncated or corrupt file raises `WeightsCorruptError` naming it (or FileNotFoundError when the
  version is gone); the service keeps the old weights and retries.
- broadcast: the first broadcast announcement a generator sees founds the group (it carries the
  store address, the member list and the layout), so the generator joins lazily as rank
  `group_members.index(id) + 1`; every later broadcast must then be received, in order. A generator
  whose first announcement is a later one (it joined late: a group cannot grow) stays outside and
  takes the catch-up shards the learner writes after each broadcast instead. If a broadcast fails
  (a member died), the learner drops the group and publishes catch-up shards only; members take
  those once they are newer than the last broadcast announced.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from asyncrl.messages import WeightsPublished

log = logging.getLogger(__name__)


class WeightsReceiver:
    def __init__(self, generator_id: str, *, num_read_threads: int | None = None) -> None:
        self.generator_id = generator_id
        self.num_read_threads = num_read_threads
        self.group = None  # the weight update group, once joined
        self.member: bool | None = None  # decided by the first announcement seen
        self.last_broadcast_version = -1

    def plan(self, msg: WeightsPublished) -> bool:
        """Whether to fetch `msg` (False: not for this generator). Call once per announcement, in order."""
        if msg.transport == "broadcast":
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
        # Members already got these bytes over the group; a newer catch-up means the learner gave
        # the group up (a member died) and publishes shards only from now on.
        return not (self.member and msg.catchup and msg.version <= self.last_broadcast_version)

    def must_fetch(self, msg: WeightsPublished) -> bool:
        """A broadcast cannot be skipped by a member: the sender waits for every rank."""
        return msg.transport == "broadcast" and bool(self.member)

    def fetch(self, msg: WeightsPublished) -> dict[str, torch.Tensor]:
        """Blocking: the announced version as {name: tensor} on the CPU, verified or complete."""
        if msg.transport == "broadcast":
            return self._receive(msg)
        from asyncrl.transport.shard_read import read_shards

        return read_shards(Path(msg.location), msg.version, verify=True, num_threads=self.num_read_threads)

    def _receive(self, msg: WeightsPublished) -> dict[str, torch.Tensor]:
        from asyncrl.transport.broadcast import init_weight_update_group, receive_tensors, uses_point_to_point

        if self.group is None:
            host, _, port = msg.location.rpartition(":")
            if not host or not port.isdigit():
                raise ValueError(f"broadcast announcement has a bad store address {msg.location!r}")
            self.group = init_weight_update_group(
                master_addr=host,
                master_port=int(port),
                rank=msg.group_members.index(self.generator_id) + 1,
                world_size=len(msg.group_members) + 1,
                group_name=msg.group_name,
                backend=msg.group_backend or "gloo",
                timeout_s=msg.group_timeout_s,
            )
        device = "cuda" if msg.group_backend == "nccl" else "cpu"
        received = receive_tensors(
            self.group,
            list(msg.tensors),
            bucket_bytes=msg.bucket_bytes,
            device=device,
            p2p=uses_point_to_point(msg.group_backend or "gloo"),
        )
        if device != "cpu":
            received = {n: t.cpu() for n, t in received.items()}
        return received

    def close(self) -> None:
        if self.group is not None:
            from asyncrl.transport.broadcast import destroy_weight_update_group

            destroy_weight_update_group(self.group)
            self.group = None
