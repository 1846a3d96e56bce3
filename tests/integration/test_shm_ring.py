"""The same-host shared-memory ring of the CPU weight update group (asyncrl.transport.shm_ring and
pairwise): its byte stream and admission with threads of this process, then real processes on
127.0.0.1 (forked, as in test_broadcast.py): which receivers take the ring, a receiver or the
sender dying mid-transfer, and what is left behind (nothing: no memfd, no mapping, no socket).

Every group, store and ring timeout inside the workers is far past the test's own timeout, so a
rank that waited for a dead one would fail the test rather than pass late. Processes are started
and ended by these tests only (by their handles).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import threading
import traceback
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from asyncrl.transport.shm_ring import RecvRing, RingBroken, SendRing, new_id, supported
from tests.integration.test_broadcast import free_ports, metas_of, run_exchange, same_bits, weights

pytestmark = pytest.mark.skipif(not supported(), reason="the ring needs Linux (memfd, SCM_RIGHTS)")
TIMEOUT_S = 900.0
DIED = 17
RING_BUCKET_BYTES = 1024  # slots of 1 KiB: weights() (about 12.5 KB) is a dozen chunks


def memfds() -> int:
    """Ring memfds this process holds open."""
    fds = Path("/proc/self/fd")
    return sum(1 for fd in fds.iterdir() if "memfd:asyncrl-weights" in _readlink(fd))


def _readlink(path: Path) -> str:
    try:
        return os.readlink(path)
    except OSError:  # the fd of the directory listing itself, closed meanwhile
        return ""


def ring_mappings() -> int:
    """Ring mappings in this process's address space."""
    return Path("/proc/self/maps").read_text().count("memfd:asyncrl-weights")


_ACCEPTING = 0x10000  # __SO_ACCEPTCON in /proc/net/unix's Flags: a listening socket


def listening(tokens: list[int]) -> list[str]:
    """Rendezvous sockets of these tokens still listening (Linux lists abstract names with an @;
    the connections a listener accepted show its name too, without the flag)."""
    names = {f"@asyncrl-weights-{token:016x}" for token in tokens}
    found = []
    for line in Path("/proc/net/unix").read_text().splitlines()[1:]:
        fields = line.split()
        if len(fields) == 8 and fields[7] in names and int(fields[3], 16) & _ACCEPTING:
            found.append(fields[7])
    return found


# ---------------------------------------------------------------------------------------------- threads


def _pair(num_slots: int, slot_bytes: int) -> tuple[SendRing, RecvRing]:
    ring = SendRing(num_slots=num_slots, slot_bytes=slot_bytes, timeout_s=60.0)
    token, secret = ring.listen(), new_id()
    reader = RecvRing.connect(token, rank=1, secret=secret, timeout_s=60.0)
    assert ring.admit([1], secret) == {}
    reader.attach()
    return ring, reader


def test_the_stream_crosses_chunk_boundaries_and_transfers() -> None:
    """Pieces of every size against 64-byte slots (empty, one byte, one short of a slot, a slot,
    one over, several slots), two transfers in a row on the same ring, the second ending in a
    partial chunk: the reader gets every byte, in order."""
    ring, reader = _pair(num_slots=2, slot_bytes=64)
    g = torch.Generator().manual_seed(0)
    try:
        for sizes in ([0, 1, 63, 64, 65, 200, 7], [130, 0, 3]):
            pieces = [torch.randint(0, 256, (n,), generator=g, dtype=torch.uint8) for n in sizes]
            errors: list[BaseException] = []

            def send(pieces: list[torch.Tensor] = pieces, errors: list[BaseException] = errors) -> None:
                try:
                    ring.begin()
                    for piece in pieces:
                        ring.write(piece)
                    errors.extend(RuntimeError(why) for why in ring.finish().values())
                except BaseException as exc:
                    errors.append(exc)

            sender = threading.Thread(target=send, name="ring-sender")
            sender.start()
            reader.begin(sum(sizes))
            got = [torch.zeros(n, dtype=torch.uint8) for n in sizes]
            for buf in got:
                reader.read_into(buf)
            reader.finish()
            sender.join(timeout=60)
            assert not sender.is_alive() and not errors, errors
            assert all(torch.equal(a, b) for a, b in zip(got, pieces, strict=True))
        assert ring.seq == reader.seq == 7 + 3  # 400 bytes, then 133: chunk numbers run on
    finally:
        reader.close()
        ring.close()
    assert memfds() == 0 and ring_mappings() == 0


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs to keep apart")
def test_a_transfer_keeps_the_reader_off_the_senders_cpu_and_restores_both() -> None:
    """During a transfer the sender's thread stays on one CPU and the reader's thread keeps off
    it (so their copies overlap on two cores, whatever the scheduler prefers); after it both
    threads may run where they could before."""
    before = os.sched_getaffinity(0)
    ring, reader = _pair(num_slots=2, slot_bytes=64)
    seen: dict[str, set[int]] = {}
    data = torch.arange(300, dtype=torch.int64).to(torch.uint8)

    def send() -> None:
        ring.begin()
        seen["sender during"] = os.sched_getaffinity(0)
        ring.write(data)
        ring.finish()
        seen["sender after"] = os.sched_getaffinity(0)

    try:
        sender = threading.Thread(target=send, name="ring-sender")
        sender.start()
        reader.begin(data.numel())
        first, rest = torch.zeros(10, dtype=torch.uint8), torch.zeros(290, dtype=torch.uint8)
        reader.read_into(first)
        seen["reader during"] = os.sched_getaffinity(0)
        reader.read_into(rest)
        reader.finish()
        seen["reader after"] = os.sched_getaffinity(0)
        sender.join(timeout=60)
        assert not sender.is_alive()
    finally:
        reader.close()
        ring.close()
    assert torch.equal(torch.cat([first, rest]), data)
    assert len(seen["sender during"]) == 1
    assert seen["reader during"] == before - seen["sender during"]
    assert seen["sender after"] == seen["reader after"] == before


def test_a_connection_without_the_secret_is_refused(caplog) -> None:
    ring = SendRing(num_slots=2, slot_bytes=64, timeout_s=60.0)
    token, secret = ring.listen(), new_id()
    intruder = RecvRing.connect(token, rank=1, secret=secret ^ 1, timeout_s=60.0)
    reader = RecvRing.connect(token, rank=1, secret=secret, timeout_s=60.0)
    try:
        assert ring.admit([1], secret) == {}
        assert list(ring.readers) == [1]
        with pytest.raises(RingBroken, match="refused"):
            intruder.attach()
        reader.attach()
        assert listening([token]) == []  # the rendezvous closed once its readers were in
        with pytest.raises(OSError):
            RecvRing.connect(token, rank=1, secret=secret, timeout_s=60.0)
    finally:
        intruder.close()
        reader.close()
        ring.close()
    assert "refused a connection" in caplog.text


def test_a_reader_that_leaves_is_reported_and_the_stream_goes_on() -> None:
    ring, reader = _pair(num_slots=2, slot_bytes=64)
    try:
        reader.close()  # as a process that died: its socket closes
        ring.begin()
        ring.write(torch.ones(1000, dtype=torch.uint8))  # does not block on the gone reader
        failed = ring.finish()
        assert list(failed) == [1] and "closed" in failed[1] and not ring.readers
    finally:
        ring.close()


# ---------------------------------------------------------------------------------------------- processes


def _run(target: Callable[..., None], world_size: int, *, dies: tuple[int, ...] = ()) -> dict[int, dict]:
    """Start ranks 0..world_size-1 (forked), collect a report from every rank not in `dies`, and
    check that those exited with DIED."""
    ctx = mp.get_context("fork")
    results = ctx.Queue()
    port = free_ports(1)[0]
    procs = [
        ctx.Process(target=_entry, args=(target, rank, port, results), name=f"rank{rank}", daemon=True)
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()
    try:
        reports = {}
        for _ in range(world_size - len(dies)):
            try:
                report = results.get(timeout=120)
            except queue.Empty:
                pytest.fail(
                    f"ranks still waiting after 120 s: {sorted(set(range(world_size)) - set(reports))}"
                )
            reports[report["rank"]] = report
        for p in procs:
            p.join(timeout=60)
        assert [procs[rank].exitcode for rank in dies] == [DIED] * len(dies)
    finally:
        for p in procs:  # only the processes this test started
            if p.is_alive():
                p.kill()
                p.join()
    errors = [r["error"] for r in reports.values() if "error" in r]
    assert not errors, "\n".join(errors)
    return reports


def _entry(target: Callable[..., None], rank: int, port: int, results: mp.Queue) -> None:
    try:
        target(rank, port, results)
    except BaseException:  # report any failure to the parent instead of leaving it waiting
        results.put({"rank": rank, "error": traceback.format_exc()})
        raise


def _group(rank: int, port: int, world_size: int = 3):
    from asyncrl.transport.broadcast import init_weight_update_group

    return init_weight_update_group(
        master_addr="127.0.0.1",
        master_port=port,
        rank=rank,
        world_size=world_size,
        group_name="shm-test",
        timeout_s=TIMEOUT_S,
    )


def _record_tokens(tokens: list[int]) -> None:
    """Sender: remember every rendezvous token, to look for its socket afterwards."""
    real_listen = SendRing.listen

    def listen(self: SendRing) -> int:
        tokens.append(real_listen(self))
        return tokens[-1]

    SendRing.listen = listen


def paths_worker(rank: int, port: int, results: mp.Queue) -> None:
    from asyncrl.transport import pairwise, shm_ring
    from asyncrl.transport.broadcast import destroy_weight_update_group

    pg = _group(rank, port)
    report: dict[str, object] = {"rank": rank, "bad": []}
    tokens: list[int] = []
    if rank == 0:
        _record_tokens(tokens)

    def exchange(**kwargs: object) -> None:
        report["bad"] += run_exchange(pg, rank, p2p=True, **{"bucket_bytes": RING_BUCKET_BYTES, **kwargs})
        if rank == 0:
            ring = pairwise._send_rings.get(pg)
            report.setdefault("readers", []).append(sorted(ring.readers) if ring is not None else [])
            report.setdefault("ring_ids", []).append(ring.ring_id if ring is not None else 0)

    # rank 2 cannot reach the rendezvous (as from another network namespace): it takes gloo, in
    # the same transfer as rank 1 takes the ring
    real_connect = shm_ring.RecvRing.connect
    if rank == 2:

        def unreachable(*args: object, **kwargs: object) -> shm_ring.RecvRing:
            raise ConnectionRefusedError("unreachable (test)")

        shm_ring.RecvRing.connect = unreachable
    exchange(into=rank == 1)
    exchange(into=False)  # the same ring again (same id, no rendezvous)
    if rank == 2:
        shm_ring.RecvRing.connect = real_connect
        pairwise.host_key = lambda: 12345  # and now it reports another host: gloo again
    exchange(into=True, bucket_bytes=256)  # another geometry: a new ring
    if rank == 2:
        pairwise.host_key = shm_ring.host_key
    exchange(into=False, bucket_bytes=256)  # rank 2 back on this host: it joins the ring
    exchange(into=True, local="gloo")  # everyone on gloo: the ring is closed on every rank
    report["after_gloo"] = (memfds(), ring_mappings())
    exchange(into=False)  # and a new one made when the ring is asked for again
    report["before_destroy"] = (memfds(), ring_mappings())
    destroy_weight_update_group(pg)
    report["after_destroy"] = (memfds(), ring_mappings())
    report["listening"] = listening(tokens)
    report["num_tokens"] = len(tokens)
    results.put(report)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_receivers_on_this_host_take_the_ring_and_the_others_gloo() -> None:
    reports = _run(paths_worker, 3)
    assert [reports[rank]["bad"] for rank in range(3)] == [[]] * 3
    sender = reports[0]
    assert sender["readers"] == [[1], [1], [1], [1, 2], [], [1, 2]]
    ids = sender["ring_ids"]
    assert ids[0] == ids[1] and len({ids[0], ids[2], ids[5]}) == 3 and ids[3] == ids[2] and ids[4] == 0
    # rendezvous: the first ring, rank 1 again after the geometry changed, rank 2 joining, the last ring
    assert sender["num_tokens"] == 4 and sender["listening"] == []
    # while a ring is up, the sender and its readers hold it (a mapping, and the memfd: mmap keeps
    # a descriptor of its own)
    for rank in range(3):
        assert reports[rank]["before_destroy"][0] > 0 and reports[rank]["before_destroy"][1] == 1
    for rank in range(3):
        assert reports[rank]["after_gloo"] == (0, 0)
        assert reports[rank]["after_destroy"] == (0, 0)


def _die_at_chunk(n: int) -> None:
    """Receiver: exit at its n-th chunk of the next transfer, as a crash would (no cleanup)."""
    real = RecvRing._next_chunk
    count = [0]

    def next_chunk(self: RecvRing) -> None:
        count[0] += 1
        if count[0] == n:
            os._exit(DIED)
        real(self)

    RecvRing._next_chunk = next_chunk


def receiver_dies_worker(rank: int, port: int, results: mp.Queue) -> None:
    from asyncrl.transport import pairwise
    from asyncrl.transport.broadcast import (
        PeersLost,
        broadcast_tensors,
        destroy_weight_update_group,
        receive_tensors,
    )

    pg = _group(rank, port)
    report: dict[str, object] = {"rank": rank, "bad": []}
    tokens: list[int] = []
    if rank == 0:
        _record_tokens(tokens)
    report["bad"] += run_exchange(pg, rank, bucket_bytes=RING_BUCKET_BYTES, into=False, p2p=True)
    expected = weights()
    if rank == 0:
        try:
            broadcast_tensors(pg, expected, bucket_bytes=RING_BUCKET_BYTES, p2p=True)
        except PeersLost as exc:
            report["lost"] = sorted(exc.failed)
            report["readers"] = sorted(pairwise._send_rings[pg].readers)
        # the next transfer leaves the dead rank out, as GroupPublisher does
        broadcast_tensors(pg, expected, bucket_bytes=RING_BUCKET_BYTES, p2p=True, peers=[1])
        report["memfds"] = memfds()
    else:
        if rank == 2:
            _die_at_chunk(3)
        for _ in range(2):
            got = receive_tensors(pg, metas_of(expected), bucket_bytes=RING_BUCKET_BYTES, p2p=True)
            report["bad"] += [n for n, t in expected.items() if not same_bits(got[n], t)]
    destroy_weight_update_group(pg)
    report["after_destroy"] = (memfds(), ring_mappings())
    report["listening"] = listening(tokens)
    results.put(report)


def shm_names() -> set[str]:
    """Names in /dev/shm the ring could have made (it names none: its memory is a memfd)."""
    shm = Path("/dev/shm")
    return {p.name for p in shm.iterdir() if "asyncrl-weights" in p.name} if shm.is_dir() else set()


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_receiver_that_dies_mid_ring_transfer_is_lost_alone() -> None:
    before = shm_names()
    reports = _run(receiver_dies_worker, 3, dies=(2,))
    assert shm_names() == before
    sender, other = reports[0], reports[1]
    # the sender finished the transfer to rank 1, then named rank 2 alone; rank 1 got every byte
    assert sender["lost"] == [2] and sender["readers"] == [1]
    assert other["bad"] == [] and sender["bad"] == []
    # nothing left: the ring closed with the group, no rendezvous socket, no memfd, no mapping
    assert sender["memfds"] > 0
    assert sender["after_destroy"] == other["after_destroy"] == (0, 0)
    assert sender["listening"] == []


def sender_dies_worker(rank: int, port: int, results: mp.Queue) -> None:
    from asyncrl.transport import pairwise
    from asyncrl.transport.broadcast import broadcast_tensors, receive_tensors

    pg = _group(rank, port)
    report: dict[str, object] = {"rank": rank, "bad": []}
    report["bad"] += run_exchange(pg, rank, bucket_bytes=RING_BUCKET_BYTES, into=False, p2p=True)
    expected = weights()
    if rank == 0:
        real = SendRing._publish
        count = [0]

        def publish(self: SendRing) -> None:
            count[0] += 1
            if count[0] == 3:
                os._exit(DIED)  # mid-transfer, as a crash would
            real(self)

        SendRing._publish = publish
        broadcast_tensors(pg, expected, bucket_bytes=RING_BUCKET_BYTES, p2p=True)
        raise AssertionError("the sender should have died")
    try:
        receive_tensors(pg, metas_of(expected), bucket_bytes=RING_BUCKET_BYTES, p2p=True)
        report["raised"] = ""
    except RuntimeError as exc:
        report["raised"] = f"{type(exc).__name__}: {exc}"
    report["ring_held"] = pairwise._recv_rings.get(pg) is not None
    report["mappings"] = ring_mappings()
    results.put(report)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_receivers_raise_at_once_when_the_sender_dies_mid_transfer() -> None:
    """With a group timeout of 900 s, the receivers' reports arriving within the test's timeout
    shows they did not wait for it: the sender's socket closed with its process."""
    reports = _run(sender_dies_worker, 3, dies=(0,))
    for rank in (1, 2):
        assert reports[rank]["bad"] == []
        assert reports[rank]["raised"].startswith("RingBroken: the weight sender's ring broke")
        assert not reports[rank]["ring_held"] and reports[rank]["mappings"] == 0


def test_copy_bytes_is_one_memmove_on_the_calling_thread():
    """The ring's copies (`copy_bytes`): exact bytes, on the calling thread whatever torch's
    intra-op thread count (no team of threads per copy to oversubscribe the cores), a size
    mismatch refused, and a layout memmove cannot take left to torch's copy."""
    from asyncrl.transport.shm_ring import copy_bytes

    src = torch.randint(0, 256, (3 << 20,), dtype=torch.uint8)
    dst = torch.zeros_like(src)
    seen: list[int] = []
    before = torch.get_num_threads()
    torch.set_num_threads(max(2, before))
    try:
        with torch.autograd.profiler.profile() as prof:
            copy_bytes(dst, src)
        seen = [e for e in prof.function_events if e.name == "aten::copy_"]
    finally:
        torch.set_num_threads(before)
    assert torch.equal(dst, src) and not seen  # no torch copy (and so no intra-op team) ran
    copy_bytes(dst[:0], src[:0])
    with pytest.raises(ValueError, match="copy of 3 bytes into 2"):
        copy_bytes(dst[:2], src[:3])
    strided = torch.zeros(2 * 1000, dtype=torch.uint8)[::2]
    copy_bytes(strided, src[:1000])
    assert torch.equal(strided, src[:1000])
