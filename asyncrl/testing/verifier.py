"""A stand-in remote verifier: the `remote` reward's HTTP protocol with exact-match scoring.

Tests point `task.rewards = [{kind = "remote", options = {url = ...}}]` at it (asyncrl/rewards/
remote.py is the client). POST any path with `{"items": [{"prompt", "completion", "answer",
"extras"}, ...]}` -> `{"rewards": [1.0 or 0.0, ...]}` (the `exact_match` reward, stripped).

In-process: `VerifierServer().start()` -> URL on 127.0.0.1 (port 0 = a free one), `stop()` closes
the listener and every open connection (a client sees it down), `start()` again serves on the
same port. `fail_next(k)`, `hang_next(k)` and `malformed_next(k)` script the next k requests.
As a process, for tests that kill and restart it:

    python -m asyncrl.testing.verifier --port N [--fail-next K]   # prints its URL, then serves

Stdlib only (http.server in a thread), so it runs beside any event loop.
"""

from __future__ import annotations

import argparse
import json
import signal
import socket
import threading
from collections import deque
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from asyncrl.rewards.base import RewardInput
from asyncrl.rewards.builtin import exact_match

_POLL_S = 0.05  # how often serve_forever checks for shutdown (stop() waits up to this long)


class VerifierServer:
    """The stand-in verifier; see the module docstring."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        self.host = host
        self.port = port
        self.num_requests = 0  # POSTs received, scripted ones included
        self.num_items = 0  # items scored
        self._score = exact_match(normalize=("strip",))
        self._lock = threading.Lock()
        self._script: deque[tuple[str, int]] = deque()  # ("fail", status) | ("hang", 0) | ("malformed", 0)
        self._connections: set[socket.socket] = set()
        self._release = threading.Event()  # set by stop(): hung requests end
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/score"

    def start(self) -> str:
        """Serve (again) and return the URL; the port stays the same across restarts."""
        if self._server is not None:
            return self.url
        self._release.clear()
        self._server = _Server((self.host, self.port), self)
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": _POLL_S}, name="verifier", daemon=True
        )
        self._thread.start()
        return self.url

    def stop(self) -> None:
        """Stop listening and drop every open connection (clients see the server down)."""
        server, self._server = self._server, None
        if server is None:
            return
        self._release.set()
        server.shutdown()
        with self._lock:
            connections, self._connections = list(self._connections), set()
        for conn in connections:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass  # already closed by its handler
        server.server_close()
        if self._thread is not None:
            self._thread.join()

    def fail_next(self, num_requests: int, status: int = 503) -> None:
        """Answer the next `num_requests` requests with HTTP `status` and no rewards."""
        with self._lock:
            self._script.extend([("fail", status)] * num_requests)

    def hang_next(self, num_requests: int) -> None:
        """Hold the next `num_requests` requests unanswered until stop()."""
        with self._lock:
            self._script.extend([("hang", 0)] * num_requests)

    def malformed_next(self, num_requests: int) -> None:
        """Answer the next `num_requests` requests 200 with a body that is not the protocol."""
        with self._lock:
            self._script.extend([("malformed", 0)] * num_requests)

    def __enter__(self) -> VerifierServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _next_action(self) -> tuple[str, int]:
        with self._lock:
            self.num_requests += 1
            return self._script.popleft() if self._script else ("score", 200)

    def _rewards(self, body: bytes) -> list[float]:
        items = json.loads(body)["items"]
        rewards = [
            self._score(
                RewardInput(item["prompt"], item["completion"], item["answer"], item["extras"], 0, "stop", 0)
            )
            for item in items
        ]
        with self._lock:
            self.num_items += len(items)
        return rewards


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False
    allow_reuse_address = True  # a restart binds the same port at once

    def __init__(self, address: tuple[str, int], verifier: VerifierServer) -> None:
        self.verifier = verifier
        super().__init__(address, _Handler)

    def process_request(self, request, client_address) -> None:  # type: ignore[override]
        with self.verifier._lock:
            self.verifier._connections.add(request)
        super().process_request(request, client_address)

    def shutdown_request(self, request) -> None:  # type: ignore[override]
        with self.verifier._lock:
            self.verifier._connections.discard(request)
        super().shutdown_request(request)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as the pooled client expects

    def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
        verifier: VerifierServer = self.server.verifier  # type: ignore[attr-defined]
        body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
        action, status = verifier._next_action()
        if action == "hang":
            verifier._release.wait()
            self.close_connection = True
            return
        if action == "fail":
            self._reply(status, b'{"error": "scripted failure"}')
            return
        if action == "malformed":
            self._reply(200, b'{"scores": "not the protocol"}')
            return
        try:
            rewards = verifier._rewards(body)
        except (ValueError, KeyError, TypeError) as exc:
            self._reply(400, json.dumps({"error": f"bad request: {exc!r}"}).encode())
            return
        self._reply(200, json.dumps({"rewards": rewards}).encode())

    def _reply(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002
        pass  # quiet: tests read counters, not access logs


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0 = a free port")
    parser.add_argument("--fail-next", type=int, default=0, help="answer the first K requests 503")
    args = parser.parse_args(argv)
    stop_signals = {signal.SIGINT, signal.SIGTERM}
    signal.pthread_sigmask(signal.SIG_BLOCK, stop_signals)  # before any thread: only sigwait sees them
    server = VerifierServer(args.host, args.port)
    server.fail_next(args.fail_next)
    print(server.start(), flush=True)
    signal.sigwait(stop_signals)
    server.stop()


if __name__ == "__main__":
    main()
