"""The pairwise layout check of a CPU weight update group, and the path each receiver's bytes take.

Place in the data flow: every transfer of `broadcast.broadcast_tensors` / `receive_tensors` on a
CPU (gloo) group starts here. Learner rank 0 and each receiver compare layout fingerprints over
their own gloo pair, so a dead receiver fails only its pair; the same exchange settles how that
receiver gets the bytes:

  gloo  point-to-point sends (or broadcasts) over the group, as every receiver did before;
  shm   the same-host shared-memory ring (`shm_ring.py`), when the sender asks for it
        (weights.broadcast_local = "shm", point-to-point groups) and the receiver reports the
        sender's host key; `join` is shm for a receiver that does not hold the ring yet.

Messages (int64 tensors of the same sizes whatever the settings, so that ranks that disagree
raise instead of waiting for a message that never comes):

  receiver -> sender   [layout fingerprint, host key (0: no ring here), id of the ring it holds (0: none)]
  sender -> receiver   [verdict, path, rendezvous token, secret]
  receiver -> sender   [reached the rendezvous: 1 or 0]                  (path `join` only)

A receiver that cannot reach the rendezvous (another network namespace, same kernel) says so and
takes gloo. Rings live as long as their group: `release(group)`, called by
`broadcast.destroy_weight_update_group`, closes them on either side.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.distributed as dist

from asyncrl.transport.shm_ring import RecvRing, RingBroken, SendRing, host_key, new_id, ring_geometry

logger = logging.getLogger(__name__)

__all__ = ["GLOO", "JOIN", "SHM", "Offer", "check_receive", "check_send", "first_line", "release"]

GLOO, SHM, JOIN = 0, 1, 2
_OK, _MISMATCH = 1, 0
LAYOUT_ERROR = (
    "weight layout differs between ranks of the weight update group: sender and receivers "
    "must use the same tensor metadata, in the same order, the same bucket_bytes and the "
    "same p2p setting"
)

# The rings of each group on this process, dropped with the group (weak keys: a group destroyed
# without `release` takes its ring along when it is collected).
_send_rings: weakref.WeakKeyDictionary[dist.ProcessGroup, SendRing] = weakref.WeakKeyDictionary()
_recv_rings: weakref.WeakKeyDictionary[dist.ProcessGroup, RecvRing] = weakref.WeakKeyDictionary()


class Offer(NamedTuple):
    """The sender's side of a transfer after the check."""

    failed: dict[int, str]  # receivers lost during the check (rank -> why)
    ring: SendRing | None  # the group's ring, when some receivers take it
    ring_ranks: tuple[int, ...]  # those receivers; every other live receiver takes gloo


def first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]


def release(group: dist.ProcessGroup) -> None:
    """Close this process's rings of `group` (idempotent); readers see an end of file."""
    for rings in (_send_rings, _recv_rings):
        ring = rings.pop(group, None)
        if ring is not None:
            ring.close()


def _wait_all(works: dict[int, dist.Work], failed: dict[int, str]) -> None:
    for peer, work in works.items():
        try:
            work.wait()
        except RuntimeError as exc:
            failed[peer] = first_line(exc)


def _sender_ring(
    group: dist.ProcessGroup, wanted: bool, *, bucket_bytes: int, timeout_s: float
) -> SendRing | None:
    """The group's ring, made (or remade for another geometry) when `wanted`."""
    ring = _send_rings.get(group)
    num_slots, slot_bytes = ring_geometry(bucket_bytes)
    if ring is not None and (ring.num_slots, ring.slot_bytes) != (num_slots, slot_bytes):
        release(group)
        ring = None
    if ring is None and wanted:
        try:
            ring = SendRing(num_slots=num_slots, slot_bytes=slot_bytes, timeout_s=timeout_s)
        except OSError as exc:
            logger.warning(
                "no shared-memory ring for the weight update group (%s): gloo for every receiver", exc
            )
            return None
        _send_rings[group] = ring
    if ring is not None:
        ring.timeout_s = timeout_s
    return ring


def check_send(
    group: dist.ProcessGroup,
    fingerprint: int,
    peers: Sequence[int],
    *,
    shm: bool,
    bucket_bytes: int,
    timeout_s: float,
) -> Offer:
    """Sender: compare layouts with every peer and settle each one's path (`shm`: offer the ring
    to receivers on this host). Raises ValueError on a mismatch after every live peer has its
    verdict (then they raise too)."""
    theirs = {peer: torch.zeros(3, dtype=torch.int64) for peer in peers}
    failed: dict[int, str] = {}
    _wait_all({peer: dist.irecv(theirs[peer], src=peer, group=group) for peer in peers}, failed)
    live = [peer for peer in peers if peer not in failed]
    reported = {peer: theirs[peer].tolist() for peer in live}
    ok = all(reported[peer][0] == fingerprint for peer in live)
    key = host_key() if shm and ok else 0
    local = [peer for peer in live if key and reported[peer][1] == key]
    ring = _sender_ring(group, bool(local), bucket_bytes=bucket_bytes, timeout_s=timeout_s)
    paths = dict.fromkeys(live, GLOO)
    if ring is not None:
        for peer in local:
            if peer in ring.unreachable:
                continue  # it could not reach this ring's rendezvous before: gloo, no new attempt
            held = peer in ring.readers and reported[peer][2] == ring.ring_id
            paths[peer] = SHM if held else JOIN
    joining = [peer for peer in live if paths[peer] == JOIN]
    token = secret = 0
    if joining:
        assert ring is not None
        try:
            token, secret = ring.listen(), new_id()
        except OSError as exc:
            logger.warning("shared-memory ring: no rendezvous (%s): gloo for ranks %s", exc, joining)
            paths.update(dict.fromkeys(joining, GLOO))
            joining = []
    verdicts = {
        peer: torch.tensor([_OK if ok else _MISMATCH, paths[peer], token, secret], dtype=torch.int64)
        for peer in live
    }
    _wait_all({peer: dist.isend(verdicts[peer], dst=peer, group=group) for peer in live}, failed)
    if joining:
        assert ring is not None
        reached = {peer: torch.zeros(1, dtype=torch.int64) for peer in joining if peer not in failed}
        _wait_all({peer: dist.irecv(reached[peer], src=peer, group=group) for peer in reached}, failed)
        joined = [peer for peer in reached if peer not in failed and int(reached[peer].item()) == 1]
        for peer in reached:
            if peer not in failed and peer not in joined:
                paths[peer] = GLOO
                ring.unreachable.add(peer)
                logger.info(
                    "rank %d cannot reach the shared-memory ring here: weights go to it over gloo", peer
                )
        failed.update(ring.admit(joined, secret))
        for peer in joined:
            if peer not in failed:
                logger.info("weights go to rank %d over the same-host shared-memory ring", peer)
    if not ok:
        raise ValueError(LAYOUT_ERROR)
    ring_ranks = tuple(peer for peer in live if peer not in failed and paths[peer] != GLOO)
    if ring is not None:
        for rank in list(ring.readers):
            if rank not in ring_ranks:
                ring.drop(rank)
        if not ring.readers:
            release(group)
            ring = None
    return Offer(failed, ring, ring_ranks)


def check_receive(
    group: dist.ProcessGroup, fingerprint: int, src: int, *, ring_capable: bool, timeout_s: float
) -> RecvRing | None:
    """Receiver: send the fingerprint, take the verdict; returns the ring when the bytes come
    through it (None: gloo). Raises ValueError on a layout mismatch, RingBroken when the ring
    cannot be joined."""
    held = _recv_rings.get(group)
    mine = [fingerprint, host_key() if ring_capable else 0, held.ring_id if held is not None else 0]
    dist.isend(torch.tensor(mine, dtype=torch.int64), dst=src, group=group).wait()
    verdict = torch.zeros(4, dtype=torch.int64)
    dist.irecv(verdict, src=src, group=group).wait()
    ok, path, token, secret = verdict.tolist()
    if ok != _OK:
        raise ValueError(LAYOUT_ERROR)
    if path == SHM:
        if held is None:
            raise RingBroken("the weight sender uses a shared-memory ring this receiver does not hold")
        return held
    if held is not None:  # the sender made a new ring, or sends over gloo now
        release(group)
    if path == GLOO:
        return None
    if path != JOIN:
        raise RingBroken(f"the weight sender asked for an unknown path {path}")
    try:
        ring: RecvRing | None = RecvRing.connect(token, rank=group.rank(), secret=secret, timeout_s=timeout_s)
    except OSError as exc:  # e.g. another network namespace on the same kernel
        logger.info("cannot reach the weight sender's shared-memory ring (%s): receiving over gloo", exc)
        ring = None
    dist.isend(torch.tensor([int(ring is not None)], dtype=torch.int64), dst=src, group=group).wait()
    if ring is None:
        return None
    try:
        ring.attach()
    except BaseException:
        ring.close()
        raise
    _recv_rings[group] = ring
    return ring
