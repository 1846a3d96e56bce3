"""The ZAP handler of a process that binds CURVE sockets: who may connect, and what was refused.

ZeroMQ asks the handler bound at `inproc://zeromq.zap.01` of a socket's context about every
client that completes the CURVE handshake. This one admits only the public keys the process
loaded from the run's key directory (`asyncrl.transport.security.CurveKeys.clients`) and answers
with the key's role as the connection's User-Id, which every message received on it carries (the
receiving `Endpoint` checks it against `security.may_send`). A refused key is counted.

A client that does not speak CURVE at all (no key) never reaches ZAP: its handshake fails. The
same thread watches each CURVE server socket's monitor events and counts those failures too.

One daemon thread per context (`ensure_guard`), owning its sockets; it ends when the context is
terminated (`ctx.term()` / `ctx.destroy()` wake it with ETERM, and it closes what it owns, so
termination does not hang). The counts are process-wide (`auth_failures`), for the launcher's
metrics.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
from collections import Counter
from collections.abc import Mapping

import zmq
from zmq.utils import z85

log = logging.getLogger(__name__)

ZAP_ENDPOINT = "inproc://zeromq.zap.01"
# Handshake failures that did not reach ZAP (a client without CURVE, garbage on the port); an
# AUTH failure is the ZAP refusal, counted where it is decided.
_HANDSHAKE_EVENTS = zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
_MONITOR_EVENTS = _HANDSHAKE_EVENTS | zmq.EVENT_MONITOR_STOPPED

_lock = threading.Lock()
_counted = threading.Condition(_lock)
_guards: dict[int, _Guard] = {}  # by the libzmq context's address
_failures: Counter[str] = Counter()
_ids = itertools.count()


def auth_failures() -> dict[str, int]:
    """Connections refused in this process so far, by reason ("unknown key", "handshake failed")."""
    with _lock:
        return dict(_failures)


def num_auth_failures() -> int:
    with _lock:
        return sum(_failures.values())


def wait_auth_failures(at_least: int, *, timeout_s: float) -> bool:
    """Block until this process has refused `at_least` connections in all (False on timeout)."""
    with _counted:
        return _counted.wait_for(lambda: sum(_failures.values()) >= at_least, timeout=timeout_s)


def _count(reason: str, detail: str) -> None:
    with _counted:
        _failures[reason] += 1
        total = sum(_failures.values())
        _counted.notify_all()
    if total <= 10 or total % 1000 == 0:
        log.warning("refused a connection (%s: %s); %d refused so far", reason, detail, total)


def handshake_failed(detail: str) -> None:
    """Count a failed handshake seen by a socket monitor other than the guard's (a socket has one
    monitor; the launcher's control socket watches its connections itself, scheduler/connections.py)."""
    _count("handshake failed", detail)


def ensure_guard(ctx: zmq.Context, clients: Mapping[bytes, str]) -> _Guard:
    """The running guard of `ctx`, started on first use with the known client keys."""
    with _lock:
        guard = _guards.get(ctx.underlying)
        if guard is None or not guard.alive:
            guard = _guards[ctx.underlying] = _Guard(ctx, clients)
    return guard


def watch(sock: zmq.Socket) -> None:
    """Count `sock`'s failed handshakes (a CURVE server socket, before it binds)."""
    with _lock:
        guard = _guards.get(sock.context.underlying)
    if guard is not None:
        guard.watch(sock)


class _Guard:
    def __init__(self, ctx: zmq.Context, clients: Mapping[bytes, str]) -> None:
        self.clients = dict(clients)
        self.n = next(_ids)
        # Sockets made with zmq.Socket(ctx, ...), not ctx.socket(): ctx.destroy() must not close them
        # from another thread while this one polls them; ETERM tells this thread to close them.
        self.zap = zmq.Socket(ctx, zmq.REP)
        self.zap.linger = 0
        self.zap.bind(ZAP_ENDPOINT)  # bound before any server socket binds: no client slips past
        self._wake_rx = zmq.Socket(ctx, zmq.PAIR)
        self._wake_rx.linger = 0
        self._wake_rx.bind(f"inproc://asyncrl.guard.{self.n}")
        self._wake_tx = zmq.Socket(ctx, zmq.PAIR)
        self._wake_tx.linger = 0
        self._wake_tx.connect(self._wake_rx.last_endpoint)
        self._wake_lock = threading.Lock()  # the one socket other threads touch
        self._pending: queue.SimpleQueue[zmq.Socket] = queue.SimpleQueue()
        self._ctx = ctx
        self.alive = True
        self._thread = threading.Thread(target=self._run, name=f"asyncrl-zap-{self.n}", daemon=True)
        self._thread.start()

    def watch(self, sock: zmq.Socket) -> None:
        url = f"inproc://asyncrl.monitor.{self.n}.{next(_ids)}"
        sock.monitor(url, _MONITOR_EVENTS)
        mon = zmq.Socket(self._ctx, zmq.PAIR)
        mon.linger = 0
        mon.connect(url)
        self._pending.put(mon)
        with self._wake_lock:
            if self.alive:
                self._wake_tx.send(b"", zmq.NOBLOCK)

    # ------------------------------------------------------------------ the thread
    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.zap, zmq.POLLIN)
        poller.register(self._wake_rx, zmq.POLLIN)
        monitors: list[zmq.Socket] = []
        try:
            while True:
                for sock, _ in poller.poll():
                    if sock is self.zap:
                        self._answer(self.zap.recv_multipart())
                    elif sock is self._wake_rx:
                        self._wake_rx.recv()
                        while not self._pending.empty():
                            mon = self._pending.get()
                            monitors.append(mon)
                            poller.register(mon, zmq.POLLIN)
                    else:
                        if self._on_monitor(sock):
                            poller.unregister(sock)
                            monitors.remove(sock)
                            sock.close()
        except zmq.ContextTerminated:
            pass
        finally:
            with self._wake_lock:
                self.alive = False
                for sock in (self.zap, self._wake_rx, self._wake_tx, *monitors):
                    sock.close(linger=0)
            while not self._pending.empty():
                self._pending.get().close(linger=0)

    def _answer(self, request: list[bytes]) -> None:
        """One ZAP request (RFC 27): version, request id, domain, address, identity, mechanism,
        credentials. Reply 200 with the role as User-Id, or 400."""
        if len(request) < 6:
            _count("bad ZAP request", f"{len(request)} frames")
            self.zap.send_multipart([b"1.0", b"", b"500", b"bad request", b"", b""])  # REP must answer
            return
        version, request_id, _domain, address, _identity, mechanism = request[:6]
        credentials = request[6:]
        role = None
        if mechanism == b"CURVE" and len(credentials) == 1 and len(credentials[0]) == 32:
            role = self.clients.get(z85.encode(credentials[0]))
        if role is None:
            _count(
                "unknown key",
                f"{mechanism.decode(errors='replace')} client from {address.decode(errors='replace')}",
            )
            reply = [version, request_id, b"400", b"unknown key", b"", b""]
        else:
            reply = [version, request_id, b"200", b"OK", role.encode(), b""]
        self.zap.send_multipart(reply)

    def _on_monitor(self, mon: zmq.Socket) -> bool:
        """Count a failed handshake; True when the watched socket has closed."""
        from zmq.utils.monitor import parse_monitor_message

        event = parse_monitor_message(mon.recv_multipart())
        if event["event"] == zmq.EVENT_MONITOR_STOPPED:
            return True
        _count("handshake failed", event["endpoint"].decode(errors="replace"))
        return False
