"""ZeroMQ sockets for asyncrl processes: one asyncio context per process, typed receive loops.

Delivery semantics: every socket sets linger and high-water marks explicitly. Control traffic
(ROUTER/DEALER) is small and must not be dropped, so HWMs are generous and sends block rather
than drop. Trajectories (PUSH/PULL) use the credit-bounded admission upstream, so queues stay
short by construction. A malformed frame is logged, counted in `rejected`, and dropped; so is a
well-formed message of a type the socket does not carry (`accept`; a PULL socket carries only
Trajectory and Trajectories), and whatever the owner rejects after decoding (`reject`, e.g. an unknown sender).

Speed: every socket is a plain (blocking-API) ZeroMQ socket driven by the process's event loop.
Each send and receive is tried first with NOBLOCK, which is how nearly all of them complete: no
Future, no trip through the loop. Only an operation that cannot proceed (nothing queued, or the
queue full) waits, on the socket's file descriptor (`loop.add_reader`). That descriptor is
edge-triggered: it signals that ZMQ_EVENTS may have changed, and any operation on the socket can
take the signal. So a waiter is woken by the descriptor, and also after each operation of the
other direction when the socket's events say it can proceed. pyzmq's asyncio sockets do the same
with a Future and several callbacks per message, which cost more CPU per round trip (the figures
are in bench/README.md, "Pipeline"). Sends stay in order (a send that had to wait holds back later
ones until it has gone), and a receiver yields to the loop after `RECV_STREAK` messages in a row so a
busy socket cannot starve the process's other tasks.

Security (`asyncrl.transport.security`): every socket takes the process's `SocketPolicy` (or the
one passed in): a maximum frame size always; where to bind (`bind`: cluster.bind_host, loopback
by default) and the address to advertise; and with CURVE on, a CURVE server for a socket that
binds, a CURVE client with the process's role keypair for one that connects. A socket that binds
with CURVE also checks each message against the role bound to its sender's key (the connection's
User-Id): a message that role may not send is rejected and counted like a malformed one.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Callable
from typing import Any

import zmq

from asyncrl.messages import Trajectories, Trajectory
from asyncrl.transport import security
from asyncrl.transport.codec import MalformedFrame, decode, encode

log = logging.getLogger(__name__)

LOOPBACK = "tcp://127.0.0.1"  # the default bind address (cluster.bind_host)
# On close, wait at most this long for queued messages (shutdown must never hang on a dead peer).
LINGER_MS = 1000
CONTROL_HWM = 100_000
DATA_HWM = 100_000
RECV_STREAK = 64
# Message types a socket of this kind carries when the owner does not say (`accept=`).
DEFAULT_ACCEPT: dict[int, tuple[type, ...]] = {zmq.PULL: (Trajectory, Trajectories)}
_BY_KIND = object()
# Plain ints: pyzmq's flags are enums, and enum arithmetic costs on every message.
_POLLIN, _POLLOUT, _NOBLOCK, _EVENTS = int(zmq.POLLIN), int(zmq.POLLOUT), int(zmq.NOBLOCK), int(zmq.EVENTS)


class Endpoint:
    """One socket plus its codec and rejection counters. Owned by exactly one task for receiving;
    any task of the owning event loop may send."""

    def __init__(
        self,
        ctx: zmq.Context,
        kind: int,
        *,
        name: str,
        identity: str | None = None,
        accept: tuple[type, ...] | None | object = _BY_KIND,
        policy: security.SocketPolicy | None = None,
    ):
        self.name = name
        # Where this socket binds, its size cap and its keys (None: the process's, `security.install`).
        self.policy = security.current() if policy is None else policy
        # Message types this socket carries (None: any); others are rejected and counted.
        self.accept = DEFAULT_ACCEPT.get(kind) if accept is _BY_KIND else accept
        # Plain socket (registered with `ctx`, so ctx.destroy() still closes it); see the module doc.
        self.sock = ctx.socket(kind, socket_class=zmq.Socket)
        self._router = kind == zmq.ROUTER  # frames start with the sender's identity
        self.sock.setsockopt(zmq.LINGER, LINGER_MS)
        hwm = DATA_HWM if kind in (zmq.PUSH, zmq.PULL) else CONTROL_HWM
        self.sock.setsockopt(zmq.SNDHWM, hwm)
        self.sock.setsockopt(zmq.RCVHWM, hwm)
        if kind == zmq.ROUTER:
            # Fail loudly instead of silently dropping a message to a peer that is gone.
            self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        if identity is not None:
            self.sock.setsockopt(zmq.IDENTITY, identity.encode())
        self.policy.apply(self.sock)
        self._checks_roles = False  # a CURVE server: each message is checked against its sender's role
        self.rejected: Counter[str] = Counter()
        self.address = ""
        self._loop: asyncio.AbstractEventLoop | None = None  # watching the descriptor once set
        self._recv_waiters: list[asyncio.Future] = []
        self._send_waiters: list[asyncio.Future] = []
        self._send_order = asyncio.Lock()  # sends that had to wait go one at a time, in order
        self._waiting_sends = 0
        self._streak = 0
        self.waited_sends = 0  # sends that found the queue full (tests, diagnostics)
        # A ROUTER's owner may watch which connection each peer speaks on (the launcher's failure
        # detection, scheduler/liveness.py): called with (sender, file descriptor) per message.
        self.on_sender: Callable[[bytes, int], None] | None = None

    def bind(self) -> str:
        """Bind a free port on the policy's bind host (loopback by default); returns the address
        peers connect to (the advertised host)."""
        if self.policy.curve is not None:
            self.policy.apply_server(self.sock)
            self._checks_roles = True
        port = self.sock.bind_to_random_port(self.policy.bind_url)
        self.address = self.policy.endpoint(port)
        return self.address

    def connect(self, address: str) -> None:
        self.policy.apply_client(self.sock)
        self.sock.connect(address)
        self.address = address

    # ------------------------------------------------------------------ readiness
    def _on_events(self) -> None:
        """The descriptor fired, or an operation may have taken its signal: read ZMQ_EVENTS
        (which also re-arms the descriptor) and wake the waiters that can proceed."""
        events = self.sock.getsockopt(_EVENTS)
        for flag, waiters in ((_POLLIN, self._recv_waiters), (_POLLOUT, self._send_waiters)):
            if events & flag and waiters:
                for fut in waiters:
                    if not fut.done():
                        fut.set_result(None)
                waiters.clear()

    def _after(self, waiters: list[asyncio.Future]) -> None:
        if waiters:  # the other direction waits: this operation may have taken its signal
            self._on_events()

    async def _wait(self, flag: int) -> None:
        """Until the socket can (probably) do `flag`; the caller retries its NOBLOCK operation."""
        loop = self._loop
        if loop is None:
            loop = self._loop = asyncio.get_running_loop()
            loop.add_reader(self.sock.FD, self._on_events)
        if self.sock.getsockopt(_EVENTS) & flag:
            return
        fut = loop.create_future()
        (self._recv_waiters if flag == _POLLIN else self._send_waiters).append(fut)
        await fut

    # ------------------------------------------------------------------ messages
    async def send(self, msg: Any, tensors=(), *, to: bytes | None = None) -> None:
        frames = encode(msg, tensors)
        if to is not None:
            frames = [to, *frames]
        if not self._waiting_sends:
            try:
                self.sock.send_multipart(frames, _NOBLOCK, copy=False)
                self._after(self._recv_waiters)
                return
            except zmq.Again:
                pass  # queue full: wait for room below
        self.waited_sends += 1
        self._waiting_sends += 1
        try:
            async with self._send_order:
                while True:
                    try:
                        self.sock.send_multipart(frames, _NOBLOCK, copy=False)
                        break
                    except zmq.Again:
                        await self._wait(_POLLOUT)
        finally:
            self._waiting_sends -= 1
        self._after(self._recv_waiters)

    async def _next_frames(self) -> list:
        if self._streak >= RECV_STREAK:
            self._streak = 0
            await asyncio.sleep(0)  # a long streak: let the process's other tasks run
        while True:
            try:
                frames = self.sock.recv_multipart(_NOBLOCK, copy=False)
            except zmq.Again:
                self._streak = 0
                await self._wait(_POLLIN)
                continue
            self._streak += 1
            self._after(self._send_waiters)
            return frames

    async def recv(self) -> tuple[bytes | None, Any, list]:
        """Next valid message as (sender identity or None, message, tensors); skips malformed ones."""
        while True:
            frames = await self._next_frames()
            sender = None
            if self._router:
                if len(frames) < 2:
                    self.reject("missing identity frame")
                    continue
                sender, frames = frames[0].bytes, frames[1:]
                if self.on_sender is not None:
                    self.on_sender(sender, _source_fd(frames[0]))
            try:
                msg, tensors = decode(frames)
            except MalformedFrame as exc:
                self.reject(str(exc))
                continue
            if self.accept is not None and not isinstance(msg, self.accept):
                self.reject(f"unexpected message type: {type(msg).__name__} on {self.name}")
                continue
            if self._checks_roles:
                role = _role_of(frames[0])
                if not security.may_send(role, msg):
                    self.reject(
                        f"not allowed for the sender's key: {role or 'no role'} sent {type(msg).__name__}"
                    )
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
        """Stop watching the descriptor, cancel waiting operations, close the socket."""
        if self._loop is not None and not self._loop.is_closed() and not self.sock.closed:
            self._loop.remove_reader(self.sock.FD)
        self._loop = None
        for fut in (*self._recv_waiters, *self._send_waiters):
            fut.cancel()
        self._recv_waiters.clear()
        self._send_waiters.clear()
        self.sock.close()


def _source_fd(frame: zmq.Frame) -> int:
    """The file descriptor of the connection a frame arrived on (-1 if libzmq does not say)."""
    try:
        return int(frame.get(zmq.SRCFD))
    except zmq.ZMQError:
        return -1


def _role_of(frame: zmq.Frame) -> str:
    """The key role ZAP gave the connection a frame arrived on ("" if none)."""
    try:
        return frame.get("User-Id") or ""
    except zmq.ZMQError:  # no such property: not an authenticated connection
        return ""
