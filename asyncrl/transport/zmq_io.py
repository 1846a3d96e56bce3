"""ZeroMQ sockets for asyncrl processes: one asyncio context per process, typed receive loops.

Delivery semantics: every socket sets linger and high-water marks explicitly. Control traffic
(ROUTER/DEALER) is small and must not be dropped, so HWMs are generous and sends block rather
than drop. Trajectories (PUSH/PULL) use the credit-bounded admission upstream, so queues stay
short by construction. A malformed frame is logged, counted in `rejected`, and dropped; so is a
well-formed message of a type the socket does not carry (`accept`; a PULL socket carries only
Trajectory and Trajectories), and whatever the owner rejects after decoding (`reject`, e.g. an unknown sender).

Speed: on the one-way data sockets (PUSH sends, PULL receives), a message that can go, or is
already queued, moves through a synchronous shadow of the socket with NOBLOCK, without a Future
and a trip through the event loop; only a send that would block, or a receive with nothing
queued, waits on the asyncio socket. Sends stay in order (the fast path is skipped while a
waiting send is pending), and a receiver yields to the loop after `RECV_STREAK` messages in a row
so a busy socket cannot starve the process's other tasks. Two-way sockets (ROUTER, DEALER) always
go through asyncio: an operation on a shadow could consume the edge-triggered wake-up that a
pending receive on the same socket waits for.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from typing import Any

import zmq
import zmq.asyncio

from asyncrl.messages import Trajectories, Trajectory
from asyncrl.transport.codec import MalformedFrame, decode, encode

log = logging.getLogger(__name__)

LOOPBACK = "tcp://127.0.0.1"
# On close, wait at most this long for queued messages (shutdown must never hang on a dead peer).
LINGER_MS = 1000
CONTROL_HWM = 100_000
DATA_HWM = 100_000
RECV_STREAK = 64
# Message types a socket of this kind carries when the owner does not say (`accept=`).
DEFAULT_ACCEPT: dict[int, tuple[type, ...]] = {zmq.PULL: (Trajectory, Trajectories)}
_BY_KIND = object()


class Endpoint:
    """One socket plus its codec and rejection counters. Owned by exactly one task for receiving."""

    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        kind: int,
        *,
        name: str,
        identity: str | None = None,
        accept: tuple[type, ...] | None | object = _BY_KIND,
    ):
        self.name = name
        # Message types this socket carries (None: any); others are rejected and counted.
        self.accept = DEFAULT_ACCEPT.get(kind) if accept is _BY_KIND else accept
        self.sock = ctx.socket(kind)
        self.sock.setsockopt(zmq.LINGER, LINGER_MS)
        hwm = DATA_HWM if kind in (zmq.PUSH, zmq.PULL) else CONTROL_HWM
        self.sock.setsockopt(zmq.SNDHWM, hwm)
        self.sock.setsockopt(zmq.RCVHWM, hwm)
        if kind == zmq.ROUTER:
            # Fail loudly instead of silently dropping a message to a peer that is gone.
            self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        if identity is not None:
            self.sock.setsockopt(zmq.IDENTITY, identity.encode())
        self.rejected: Counter[str] = Counter()
        self.address = ""
        # The same socket, used with NOBLOCK: for sends on PUSH, for receives on PULL (see above).
        self._now = zmq.Socket.shadow(self.sock.underlying)
        self._fast_send, self._fast_recv = kind == zmq.PUSH, kind == zmq.PULL
        self._waiting_sends = 0
        self._streak = 0

    def bind_loopback(self) -> str:
        port = self.sock.bind_to_random_port(LOOPBACK)
        self.address = f"{LOOPBACK}:{port}"
        return self.address

    def connect(self, address: str) -> None:
        self.sock.connect(address)
        self.address = address

    async def send(self, msg: Any, tensors=(), *, to: bytes | None = None) -> None:
        frames = encode(msg, tensors)
        if to is not None:
            frames = [to, *frames]
        if self._fast_send and not self._waiting_sends:
            try:
                self._now.send_multipart(frames, zmq.NOBLOCK, copy=False)
                return
            except zmq.Again:
                pass  # queue full: wait for room below
        self._waiting_sends += 1
        try:
            await self.sock.send_multipart(frames, copy=False)
        finally:
            self._waiting_sends -= 1

    async def _next_frames(self) -> list:
        if not self._fast_recv:
            return await self.sock.recv_multipart(copy=False)
        if self._streak < RECV_STREAK:
            try:
                frames = self._now.recv_multipart(zmq.NOBLOCK)
                self._streak += 1
                return frames
            except zmq.Again:
                pass
        else:
            await asyncio.sleep(0)  # a long streak: let the process's other tasks run
        self._streak = 0
        return await self.sock.recv_multipart(copy=False)

    async def recv(self) -> tuple[bytes | None, Any, list]:
        """Next valid message as (sender identity or None, message, tensors); skips malformed ones."""
        while True:
            frames = await self._next_frames()
            sender = None
            if self.sock.type == zmq.ROUTER:
                if len(frames) < 2:
                    self.reject("missing identity frame")
                    continue
                sender, frames = frames[0].bytes, frames[1:]
            try:
                msg, tensors = decode(frames)
            except MalformedFrame as exc:
                self.reject(str(exc))
                continue
            if self.accept is not None and not isinstance(msg, self.accept):
                self.reject(f"unexpected message type: {type(msg).__name__} on {self.name}")
                continue
            return sender, msg, tensors

    def reject(self, reason: str) -> None:
        """Count (and log, throttled) one rejected message; `reason` up to its first ':' is the key."""
        key = reason.split(":")[0][:80]
        self.rejected[key] += 1
        if sum(self.rejected.values()) <= 10 or sum(self.rejected.values()) % 1000 == 0:
            log.error(
                "%s: rejected malformed message (%s); %d rejected so far",
                self.name,
                reason,
                sum(self.rejected.values()),
            )

    @property
    def num_rejected(self) -> int:
        return sum(self.rejected.values())

    def close(self) -> None:
        self.sock.close()
