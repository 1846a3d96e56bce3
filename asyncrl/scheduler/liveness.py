"""Connection-level failure detection (pure): which peers have lost their connection to the
launcher, in seconds rather than after the application heartbeat's timeout.

Place in the data flow: the launcher's control socket (`scheduler/service.py`) is a ROUTER whose
connections carry ZeroMQ's own heartbeats (ZMTP PING/PONG, `monitor.connection_timeout_s`) and TCP
keepalive. The launcher reports here what it sees, each with the clock:
  * `accepted(fd)`: the socket monitor saw a connection accepted on file descriptor `fd`;
  * `heard(peer, fd)`: a message from `peer` arrived on connection `fd` (ZMQ_SRCFD);
  * `disconnected(fd)`: the socket monitor saw connection `fd` close: the peer's process died (the
    kernel closed its sockets), or its host or network went silent past the ZMTP heartbeat timeout;
  * `unreachable(peer)`: a send to `peer` failed with EHOSTUNREACH (ROUTER_MANDATORY): the socket
    has no connection for it now. That is evidence too, not only a log line.
and asks `lost(now, grace_s)`: the peers disconnected for at least `grace_s`
(`monitor.reconnect_grace_s`) without coming back.

Coming back. A peer whose process lives reconnects at once (a DEALER reconnects by itself) and
sends its next heartbeat within `monitor.heartbeat_s`; that message clears the suspicion only if it
came on a connection accepted after the disconnect: messages the dead connection had delivered
before it closed may still be read after the monitor's event, and must not revive it. The
application heartbeat (`children.health`, `monitor.heartbeat_timeout_s`) stays the judge of a
process that is connected but hung.
"""

from __future__ import annotations

from dataclasses import dataclass, field

NEVER = float("-inf")


@dataclass
class Liveness:
    by_fd: dict[int, str] = field(default_factory=dict)  # connection -> the peer last heard on it
    accepted_at: dict[int, float] = field(default_factory=dict)  # connection -> when it was accepted
    suspect: dict[str, float] = field(default_factory=dict)  # peer -> since when it has no connection

    def accepted(self, fd: int, now: float) -> None:
        self.accepted_at[fd] = now

    def heard(self, peer: str, fd: int, now: float) -> None:
        if fd < 0:
            return  # libzmq did not say which connection: no evidence either way
        self.by_fd[fd] = peer
        since = self.suspect.get(peer)
        if since is not None and self.accepted_at.get(fd, NEVER) > since:
            del self.suspect[peer]  # it reconnected and spoke on the new connection

    def disconnected(self, fd: int, now: float) -> str | None:
        """Connection `fd` closed; the peer last heard on it (now suspect), if any."""
        self.accepted_at.pop(fd, None)
        peer = self.by_fd.pop(fd, None)
        if peer is not None:
            self.suspect.setdefault(peer, now)
        return peer

    def unreachable(self, peer: str, now: float) -> None:
        self.suspect.setdefault(peer, now)

    def lost(self, now: float, grace_s: float) -> list[tuple[str, float]]:
        """(peer, since) of every peer without a connection for at least `grace_s`, oldest first."""
        return sorted(
            ((peer, since) for peer, since in self.suspect.items() if now - since >= grace_s),
            key=lambda item: item[1],
        )

    def forget(self, peer: str) -> None:
        """The launcher is done with `peer` (retired, or stopping): no more verdicts about it."""
        self.suspect.pop(peer, None)
        for fd in [fd for fd, p in self.by_fd.items() if p == peer]:
            del self.by_fd[fd]
