"""Same-host shared-memory ring: how weight bytes reach a generator on the learner's host (`shm`).

Place in the data flow: learner rank 0 -> generator processes of the CPU weight update group
(`broadcast.py`) that run on the same host as the learner (weights.broadcast_local = "shm", the
default). `pairwise.py` decides, in each transfer's layout check, which receivers take this path;
receivers elsewhere, or where it is unavailable, keep gloo's point-to-point sends.

The ring is `num_slots` slots of `slot_bytes` in one shared mapping. A transfer is one byte stream
(the buckets, in order); its chunks go through the slots in turn, numbered by `seq`, a count kept
over the ring's whole life. The sender waits until every reader has acknowledged the chunk that
last used a slot, copies the next chunk into it and writes the chunk's `seq` to each reader's
socket; a reader reads that `seq` (it must be the one it expects), copies the chunk out and writes
the `seq` back. So the sender fills one slot while the readers empty the other: two memcpys that
overlap, on two cores, instead of one loopback TCP stream.

The two copies overlap only on two cores. A sender and a reader that wake each other for every
chunk are what the kernel's scheduler puts on one core (it places a woken task near its waker),
where the copies take turns: measured on 2 cores, 0.6x of one memcpy with both on one core
against 1.2x on two, and a run got one or the other by chance. So for each transfer the sender's
thread stays on the CPU it was on, which it names in each chunk's signal, and each reader's
thread keeps off that CPU (among those it may use), both as before once the transfer ends
(`_pin`). Nothing changes where the readers are as many as the sender's CPUs (the copies then
share cores whatever is done), or where a reader may use no other CPU.

The signals go over one Unix stream socket per reader: a blocking read, no spinning, and a reader
or a sender whose process dies closes its socket, so the other end sees it at once (an end of
file), as gloo's pairs do. Small gloo messages on the group's pairs were tried first: each wakes
the gloo threads of both processes, and the signals then cost more than the copies they order
(docs/weights.md, "Speed").

Nothing is left behind: the memory is an anonymous memfd, passed to each reader over its socket,
never named in /dev/shm or anywhere else, and freed by the kernel when the last process holding it
closes it or dies. Readers connect to a socket in Linux's abstract namespace (no file either),
bound only while they connect. Admission: the connecting process must run as our user
(SO_PEERCRED) and present the secret its layout verdict carried over the group's own pair.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import functools
import hashlib
import logging
import mmap
import os
import secrets
import socket
import struct
import threading
import time
import weakref
from collections.abc import Iterable
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

__all__ = [
    "RecvRing",
    "RingBroken",
    "SendRing",
    "host_key",
    "new_id",
    "ring_geometry",
    "supported",
]

# Two slots: the sender fills one while the readers empty the other.
NUM_SLOTS = 2
# A slot is one bucket (weights.bucket_bytes), at most this much: the ring's memory is slots times
# this, and chunks far larger than a few MiB gain nothing once copies overlap.
MAX_SLOT_BYTES = 64 << 20
_SEQ = struct.Struct("<Q")  # reader -> sender: "I have read chunk seq"
_CHUNK = struct.Struct("<Qq")  # sender -> reader: chunk seq is in its slot; the sender's CPU (-1: any)
_HELLO = struct.Struct("<QQ")  # reader -> sender on connecting: its group rank, the verdict's secret
_RING = struct.Struct("<QQQQ")  # sender -> reader, with the memfd: ring id, slots, slot bytes, next seq
_CRED = struct.Struct("3i")  # SO_PEERCRED: pid, uid, gid
_BOOT_ID = Path("/proc/sys/kernel/random/boot_id")
_ADDRESS_PREFIX = b"\0asyncrl-weights-"
_MEMFD_NAME = "asyncrl-weights"


def copy_bytes(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst[:] = src for contiguous 1-D uint8 CPU tensors of one size: one memmove on the calling
    thread. (torch's `copy_` spreads a large copy over the process's intra-op threads; the sender
    and every reader copying at once then run more threads than the host has cores, and a copy
    waits for its slowest thread, descheduled: the ring's throughput became bimodal.)"""
    if dst.numel() != src.numel():
        raise ValueError(f"copy of {src.numel()} bytes into {dst.numel()}")
    if not (dst.is_contiguous() and src.is_contiguous() and dst.device.type == src.device.type == "cpu"):
        dst.copy_(src)  # another layout or device: torch's own copy
        return
    if dst.numel():
        ctypes.memmove(dst.data_ptr(), src.data_ptr(), dst.numel() * dst.element_size())


def _current_cpu() -> int:
    """The CPU the calling thread runs on (-1 if unknown)."""
    try:
        return int(ctypes.CDLL(None, use_errno=True).sched_getcpu())
    except (OSError, AttributeError):
        return -1


def _pin(cpus: set[int]) -> tuple[int, set[int]] | None:
    """Keep the calling thread on `cpus`; returns (its thread id, the CPUs to restore it to), or
    None if nothing changed."""
    try:
        before = os.sched_getaffinity(0)
        if not cpus or cpus == before:
            return None
        os.sched_setaffinity(0, cpus)
    except (OSError, AttributeError):
        return None
    return threading.get_native_id(), before


def _unpin(pinned: tuple[int, set[int]] | None) -> None:
    """Restore a thread `_pin` kept on some CPUs (from any thread; gone threads are skipped)."""
    if pinned is not None:
        with contextlib.suppress(OSError):
            os.sched_setaffinity(*pinned)


class RingBroken(RuntimeError):
    """A reader lost its ring mid-transfer: the sender died or dropped it, or broke the protocol."""


def ring_geometry(bucket_bytes: int) -> tuple[int, int]:
    """(number of slots, bytes per slot) of the ring for a group with `bucket_bytes` buckets."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
    return NUM_SLOTS, min(bucket_bytes, MAX_SLOT_BYTES)


def supported() -> bool:
    """Whether this platform has what the ring needs (Linux: memfd, fd passing, peer credentials)."""
    return (
        hasattr(os, "memfd_create")
        and hasattr(socket, "AF_UNIX")
        and hasattr(socket, "send_fds")
        and hasattr(socket, "SO_PEERCRED")
    )


@functools.cache
def host_key() -> int:
    """This kernel's identity, a positive 63-bit int (0 where the ring is not supported).

    Equal keys mean the same host name and the same boot of the same kernel (its random boot id),
    so a ring could be shared; the connection attempt then decides (a receiver in another network
    namespace cannot reach the sender's socket and stays on gloo).
    """
    if not supported():
        return 0
    try:
        boot_id = _BOOT_ID.read_text().strip()
    except OSError:
        return 0
    digest = hashlib.sha256(f"{socket.gethostname()}\n{boot_id}".encode()).digest()
    return (int.from_bytes(digest[:8], "little") >> 1) or 1


def new_id() -> int:
    """A random positive 63-bit int (ring ids, rendezvous tokens, secrets): fits an int64 tensor."""
    return secrets.randbits(63) or 1


def _address(token: int) -> bytes:
    return _ADDRESS_PREFIX + b"%016x" % token


def _recv_exact(sock: socket.socket, num_bytes: int) -> bytes:
    """Exactly `num_bytes` from a stream socket; ConnectionError when the peer closed it first."""
    buf = bytearray(num_bytes)
    view = memoryview(buf)
    got = 0
    while got < num_bytes:
        n = sock.recv_into(view[got:])
        if n == 0:
            raise ConnectionError(_CLOSED)
        got += n
    return bytes(buf)


_CLOSED = "the other end closed the ring's socket (its process exited?)"


def _why(exc: BaseException, timeout_s: float) -> str:
    if isinstance(exc, TimeoutError):
        return f"no signal on the shared-memory ring within {timeout_s:g} s"
    if isinstance(exc, (BrokenPipeError, ConnectionResetError, ConnectionAbortedError)):
        return f"{_CLOSED}: {exc.strerror or type(exc).__name__}"
    return (str(exc).strip() or type(exc).__name__)[:200]


class _Mapping:
    """`num_slots` x `slot_bytes` of a memfd, mapped shared, as one uint8 tensor per slot."""

    def __init__(self, fd: int, num_slots: int, slot_bytes: int) -> None:
        size = num_slots * slot_bytes
        if os.fstat(fd).st_size != size:
            raise ValueError(f"the ring's memory is {os.fstat(fd).st_size} bytes, expected {size}")
        self._map = mmap.mmap(fd, size)  # MAP_SHARED: both processes see the same pages
        self.slots = torch.frombuffer(self._map, dtype=torch.uint8).view(num_slots, slot_bytes)
        self.num_slots = num_slots
        self.slot_bytes = slot_bytes

    def slot(self, seq: int) -> torch.Tensor:
        return self.slots[seq % self.num_slots]

    def close(self) -> None:
        self.slots = None  # the tensor holds the mapping's buffer: release it before closing
        with contextlib.suppress(BufferError):  # a view still alive somewhere: the GC unmaps it
            self._map.close()


class SendRing:
    """Learner rank 0's ring of one group: the memory, one socket per reader (group rank), and the
    stream of the transfer in progress (`begin`, `write`..., `finish`)."""

    def __init__(self, *, num_slots: int, slot_bytes: int, timeout_s: float) -> None:
        self.ring_id = new_id()
        self.timeout_s = timeout_s
        fd = os.memfd_create(_MEMFD_NAME, os.MFD_CLOEXEC)
        self._close_fd = weakref.finalize(self, os.close, fd)  # the fd goes with the object at the latest
        try:
            os.ftruncate(fd, num_slots * slot_bytes)
            self._mem = _Mapping(fd, num_slots, slot_bytes)
        except BaseException:
            self._close_fd()
            raise
        self._fd = fd
        self.readers: dict[int, socket.socket] = {}
        self.unreachable: set[int] = set()  # ranks that could not connect: not asked again
        self.seq = 0  # the next chunk's number
        self.failed: dict[int, str] = {}  # readers lost during the transfer in progress
        self._listener: socket.socket | None = None
        self._fill = 0  # bytes of the current chunk written so far
        self._pending: collections.deque[int] = collections.deque()  # chunks not yet acknowledged
        self._cpu = -1  # the CPU this transfer's thread is kept on (-1: any)
        self._unpinned: tuple[int, set[int]] | None = None  # that thread and its CPUs before

    @property
    def slot_bytes(self) -> int:
        return self._mem.slot_bytes

    @property
    def num_slots(self) -> int:
        return self._mem.num_slots

    # -------------------------------------------------------------------------------- readers join

    def listen(self) -> int:
        """Open the rendezvous socket; returns its token (the receivers connect to it)."""
        assert self._listener is None, "one rendezvous at a time"
        token = new_id()
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            listener.bind(_address(token))
            listener.listen()
        except OSError:
            listener.close()
            raise
        self._listener = listener
        return token

    def admit(self, ranks: Iterable[int], secret: int) -> dict[int, str]:
        """Accept the readers `ranks` (they said they connected), hand each the ring, close the
        rendezvous; returns the ranks that did not arrive within the timeout (rank -> why).
        A connection from anyone else (another user, a wrong secret or rank) is closed and logged."""
        assert self._listener is not None, "admit() after listen()"
        waiting = set(ranks)
        deadline = time.monotonic() + self.timeout_s
        try:
            while waiting and (left_s := deadline - time.monotonic()) > 0:
                self._listener.settimeout(left_s)
                try:
                    conn, _ = self._listener.accept()
                except TimeoutError:
                    break
                rank = self._admit_one(conn, waiting, secret)
                if rank is not None:
                    waiting.discard(rank)
        finally:
            self._listener.close()
            self._listener = None
        return {rank: f"did not join the shared-memory ring within {self.timeout_s:g} s" for rank in waiting}

    def _admit_one(self, conn: socket.socket, waiting: set[int], secret: int) -> int | None:
        conn.settimeout(self.timeout_s)
        try:
            _pid, uid, _gid = _CRED.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size))
            if uid != os.getuid():
                raise PermissionError(f"a process of uid {uid} connected")
            rank, their_secret = _HELLO.unpack(_recv_exact(conn, _HELLO.size))
            if their_secret != secret or rank not in waiting:
                raise PermissionError(f"a connection as rank {rank} without this transfer's secret")
            ring = _RING.pack(self.ring_id, self.num_slots, self.slot_bytes, self.seq)
            socket.send_fds(conn, [ring], [self._fd])
        except OSError as exc:
            conn.close()
            logger.warning("shared-memory ring: refused a connection (%s)", _why(exc, self.timeout_s))
            return None
        if rank in self.readers:
            self.readers.pop(rank).close()
        self.readers[rank] = conn
        return rank

    def drop(self, rank: int) -> None:
        """Stop sending to `rank` (its socket closes: the reader sees an end of file)."""
        sock = self.readers.pop(rank, None)
        if sock is not None:
            sock.close()

    # -------------------------------------------------------------------------------- streaming

    def begin(self) -> None:
        """Start a transfer to every reader in `readers`, the calling thread kept on its CPU
        until `finish` (the readers keep off it)."""
        self.failed = {}
        self._fill = 0
        self._pending.clear()
        allowed, cpu = os.sched_getaffinity(0), _current_cpu()
        if len(self.readers) >= len(allowed):  # too few CPUs to give the sender one of its own
            self._cpu = -1
        elif len(allowed) == 1:  # already kept on one CPU
            self._cpu = next(iter(allowed))
        elif cpu in allowed and self._unpinned is None:
            self._unpinned = _pin({cpu})
            self._cpu = cpu if self._unpinned is not None else -1

    def write(self, src: torch.Tensor) -> None:
        """Append the bytes of `src` (1-D uint8) to the stream; blocks while every slot is taken."""
        total = src.numel()
        pos = 0
        while pos < total and self.readers:
            if self._fill == 0 and len(self._pending) == self.num_slots:
                self._await(self._pending.popleft())  # the slot about to be filled is free
            n = min(self.slot_bytes - self._fill, total - pos)
            copy_bytes(self._mem.slot(self.seq)[self._fill : self._fill + n], src[pos : pos + n])
            self._fill += n
            pos += n
            if self._fill == self.slot_bytes:
                self._publish()

    def finish(self) -> dict[int, str]:
        """Publish the last (partial) chunk and wait until every reader has read everything; returns
        the readers lost during this transfer (rank -> why), no longer in `readers`."""
        if self._fill:
            self._publish()
        while self._pending:
            self._await(self._pending.popleft())
        self._release_cpu()
        return dict(self.failed)

    def _release_cpu(self) -> None:
        _unpin(self._unpinned)
        self._unpinned, self._cpu = None, -1

    def _publish(self) -> None:
        signal = _CHUNK.pack(self.seq, self._cpu)
        for rank, sock in list(self.readers.items()):
            try:
                sock.sendall(signal)
            except OSError as exc:
                self._lose(rank, exc)
        self._pending.append(self.seq)
        self.seq += 1
        self._fill = 0

    def _await(self, seq: int) -> None:
        for rank, sock in list(self.readers.items()):
            try:
                (got,) = _SEQ.unpack(_recv_exact(sock, _SEQ.size))
                if got != seq:
                    raise ConnectionError(f"acknowledged chunk {got} where chunk {seq} was due")
            except OSError as exc:
                self._lose(rank, exc)

    def _lose(self, rank: int, exc: BaseException) -> None:
        self.failed[rank] = _why(exc, self.timeout_s)
        self.drop(rank)

    def close(self) -> None:
        """Idempotent: every reader's socket, the rendezvous, the mapping and the memfd."""
        self._release_cpu()
        for rank in list(self.readers):
            self.drop(rank)
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        if self._mem.slots is not None:
            self._mem.close()
        self._close_fd()


class RecvRing:
    """A generator's end of the sender's ring: its socket and the shared mapping (after `attach`)."""

    def __init__(self, sock: socket.socket, timeout_s: float) -> None:
        self._sock = sock
        self.timeout_s = timeout_s
        self._mem: _Mapping | None = None
        self.ring_id = 0
        self.seq = 0  # the next chunk expected
        self._remaining = 0  # bytes of the transfer not yet in a chunk
        self._avail = 0  # bytes of the current chunk not yet read
        self._offset = 0  # where they start in its slot
        self._apart = False  # whether this transfer has kept off the sender's CPU yet
        self._unpinned: tuple[int, set[int]] | None = None  # the thread kept off it, its CPUs before

    @classmethod
    def connect(cls, token: int, *, rank: int, secret: int, timeout_s: float) -> RecvRing:
        """Connect to the sender's rendezvous `token` as group rank `rank`. Raises OSError when the
        socket cannot be reached (another network namespace): the transfer then goes over gloo."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        sock.settimeout(timeout_s)
        try:
            sock.connect(_address(token))
            sock.sendall(_HELLO.pack(rank, secret))
        except OSError:
            sock.close()
            raise
        return cls(sock, timeout_s)

    def attach(self) -> None:
        """Receive the ring (its memfd) from the sender and map it."""
        try:
            msg, fds, _flags, _addr = socket.recv_fds(self._sock, _RING.size, 1)
        except OSError as exc:
            raise RingBroken(
                f"the weight sender did not hand over its ring: {_why(exc, self.timeout_s)}"
            ) from exc
        try:
            if len(msg) != _RING.size or len(fds) != 1:
                raise RingBroken("the weight sender refused this receiver's connection to its ring")
            self.ring_id, num_slots, slot_bytes, self.seq = _RING.unpack(msg)
            self._mem = _Mapping(fds[0], num_slots, slot_bytes)
        finally:
            for fd in fds:
                os.close(fd)  # the mapping keeps the memory

    def begin(self, num_bytes: int) -> None:
        """Start receiving a transfer of `num_bytes` (the calling thread keeps off the sender's
        CPU from its first chunk until `finish`)."""
        self._remaining = num_bytes
        self._avail = 0
        self._apart = False

    def read_into(self, dst: torch.Tensor) -> None:
        """Fill `dst` (1-D uint8) with the next bytes of the stream."""
        assert self._mem is not None, "read_into() after attach()"
        total = dst.numel()
        pos = 0
        while pos < total:
            if self._avail == 0:
                self._next_chunk()
            n = min(self._avail, total - pos)
            copy_bytes(dst[pos : pos + n], self._mem.slot(self.seq)[self._offset : self._offset + n])
            self._offset += n
            self._avail -= n
            pos += n
            if self._avail == 0:
                self._signal(_SEQ.pack(self.seq))
                self.seq += 1

    def finish(self) -> None:
        self._release_cpu()
        if self._remaining or self._avail:
            raise RingBroken(f"{self._remaining + self._avail} bytes of the transfer were not read")

    def _keep_off(self, cpu: int) -> None:
        """Once a transfer: keep the calling thread off the sender's CPU, if it may run elsewhere."""
        self._apart = True
        allowed = os.sched_getaffinity(0)
        if cpu in allowed and len(allowed) > 1 and self._unpinned is None:
            self._unpinned = _pin(allowed - {cpu})

    def _release_cpu(self) -> None:
        _unpin(self._unpinned)
        self._unpinned = None

    def _next_chunk(self) -> None:
        if self._remaining == 0:
            raise RingBroken("asked for more bytes than the transfer holds")
        try:
            got, cpu = _CHUNK.unpack(_recv_exact(self._sock, _CHUNK.size))
        except OSError as exc:
            raise RingBroken(f"the weight sender's ring broke: {_why(exc, self.timeout_s)}") from exc
        if cpu >= 0 and not self._apart:
            self._keep_off(cpu)
        if got != self.seq:
            raise RingBroken(f"the weight sender published chunk {got} where chunk {self.seq} was due")
        assert self._mem is not None
        self._avail = min(self._mem.slot_bytes, self._remaining)
        self._remaining -= self._avail
        self._offset = 0

    def _signal(self, data: bytes) -> None:
        try:
            self._sock.sendall(data)
        except OSError as exc:
            raise RingBroken(f"the weight sender's ring broke: {_why(exc, self.timeout_s)}") from exc

    def close(self) -> None:
        """Idempotent: the socket and the mapping."""
        self._release_cpu()
        self._sock.close()
        if self._mem is not None:
            self._mem.close()
            self._mem = None
