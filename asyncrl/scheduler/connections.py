"""The launcher's watch over its control socket's connections: the I/O half of failure detection.

Place in the data flow: the launcher (`scheduler/service.py`) binds its control ROUTER and hands
it here (`prepare` before it binds, `attach` after): ZeroMQ heartbeats (a PING every
`heartbeat_ivl_s`, the connection closed when nothing came back for `monitor.connection_timeout_s`)
and TCP keepalive on every connection, a socket monitor for connections accepted and closed, and
the socket's per-message source descriptor. `poll` (each supervision tick) feeds what the monitor
saw to `Liveness` (scheduler/liveness.py, pure), and `lost` says which peers have been without a
connection past `monitor.reconnect_grace_s`; what to do about them is the launcher's decision.
"""

from __future__ import annotations

import math
import time

import zmq
from zmq.utils.monitor import parse_monitor_message

from asyncrl.scheduler.liveness import Liveness
from asyncrl.transport import zap
from asyncrl.transport.zmq_io import Endpoint

# A socket has one monitor: this one replaces the ZAP guard's (transport/zap.py) on the control
# socket, so it also takes the failed handshakes that guard counts, and hands them to it.
HANDSHAKE_FAILED = zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
MONITOR_EVENTS = zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED | HANDSHAKE_FAILED
# ZeroMQ's heartbeat: a PING this often, so a silent connection is caught within the timeout.
MAX_HEARTBEAT_IVL_S = 1.0


def keepalive_options(timeout_s: float) -> dict[int, int]:
    """Socket options that close a connection whose peer has been silent for about `timeout_s`:
    ZMTP PING/PONG (libzmq's own heartbeat) and TCP keepalive below it."""
    ivl_ms = int(1000 * min(MAX_HEARTBEAT_IVL_S, timeout_s / 3))
    idle_s = max(1, math.ceil(timeout_s / 2))
    return {
        zmq.HEARTBEAT_IVL: ivl_ms,
        zmq.HEARTBEAT_TIMEOUT: int(1000 * timeout_s),
        zmq.HEARTBEAT_TTL: int(1000 * timeout_s),  # what the peer is told: it may close on its side
        zmq.TCP_KEEPALIVE: 1,
        zmq.TCP_KEEPALIVE_IDLE: idle_s,
        zmq.TCP_KEEPALIVE_INTVL: 1,
        zmq.TCP_KEEPALIVE_CNT: max(1, math.ceil(timeout_s) - idle_s),
    }


class ConnectionWatch:
    def __init__(self, *, connection_timeout_s: float, reconnect_grace_s: float) -> None:
        self.connection_timeout_s = connection_timeout_s
        self.reconnect_grace_s = reconnect_grace_s
        self.liveness = Liveness()
        self.monitor: zmq.Socket | None = None
        self.num_disconnects = 0  # connections closed under the launcher (any peer)

    def prepare(self, ep: Endpoint) -> None:
        """Before `ep` binds: keepalive on the connections it will accept."""
        for option, value in keepalive_options(self.connection_timeout_s).items():
            ep.sock.setsockopt(option, value)

    def attach(self, ep: Endpoint) -> None:
        """Once `ep` is bound (after the ZAP guard set its monitor, which this one replaces), and
        before its address is given to anyone: a monitor, and the source of each message."""
        self.monitor = ep.sock.get_monitor_socket(MONITOR_EVENTS)
        ep.on_sender = lambda sender, fd: self.liveness.heard(
            sender.decode(errors="replace"), fd, time.monotonic()
        )

    def poll(self) -> None:
        """Take the monitor's events that have arrived (never waits)."""
        while self.monitor is not None:
            try:
                event = parse_monitor_message(self.monitor.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                return
            now = time.monotonic()
            if event["event"] == zmq.EVENT_ACCEPTED:
                self.liveness.accepted(int(event["value"]), now)
            elif event["event"] == zmq.EVENT_DISCONNECTED:
                self.num_disconnects += 1
                self.liveness.disconnected(int(event["value"]), now)
            elif event["event"] & HANDSHAKE_FAILED:
                zap.handshake_failed(event["endpoint"].decode(errors="replace"))

    def unreachable(self, peer: str) -> None:
        self.liveness.unreachable(peer, time.monotonic())

    def lost(self) -> list[tuple[str, float]]:
        """(peer, seconds since its connection went) for each peer lost past the grace."""
        now = time.monotonic()
        return [(peer, now - since) for peer, since in self.liveness.lost(now, self.reconnect_grace_s)]

    def forget(self, peer: str) -> None:
        self.liveness.forget(peer)

    def close(self) -> None:
        if self.monitor is not None:
            self.monitor.close(linger=0)
            self.monitor = None
