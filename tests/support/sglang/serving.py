"""The asyncio machinery under the stand-in SGLang server's HTTP routes: threads, loop, admission.

Place in the data flow: `server.py` defines the routes (what each endpoint answers); this module
runs them. `AppThread` serves an aiohttp application from an event loop in one thread
("standin-http") on a socket bound up front, so thousands of requests can wait at once without a
thread each. `Admission` is the one thread ("standin-admission") that submits /generate requests
to the engine, whose `submit` blocks while the server is paused or a weight update waits: the
loop must never block, and a thread per request is what this server exists to avoid. `in_thread`
runs one blocking control route in a thread of its own (group rendezvous, weight loads and pauses
block for unbounded times, so a bounded pool could deadlock), and `settle` hands any thread's
result back to the loop.
"""

from __future__ import annotations

import asyncio
import json
import queue
import socket
import threading
from collections.abc import Callable, Sequence
from typing import Any

from aiohttp import web

from tests.support.sglang.engine import Engine, EngineRequest

# Clients may open a connection per request, a thousand at once (the client concurrency test); a
# short listen backlog (the stdlib's is 5) makes bursts of connects fail with resets. The kernel
# caps it at net.core.somaxconn.
LISTEN_BACKLOG = 4096
SHUTDOWN_GRACE_S = 1.0  # stop(): how long answers still being written may take


def settle(
    loop: asyncio.AbstractEventLoop, fut: asyncio.Future, result: Any = None, exc: BaseException | None = None
) -> None:
    """From any thread: resolve `fut` on its loop (once; a stopped server's loop is gone: no-op)."""

    def resolve() -> None:
        if fut.done():
            return
        if exc is not None:
            fut.set_exception(exc)
        else:
            fut.set_result(result)

    try:
        loop.call_soon_threadsafe(resolve)
    except RuntimeError:  # the loop is closed: the server stopped and nobody waits any more
        pass


async def in_thread(fn: Callable[..., Any], *args: Any) -> Any:
    """`fn(*args)` in a new daemon thread, awaited (its exception is raised here)."""
    loop = asyncio.get_running_loop()
    fut = loop.create_future()

    def run() -> None:
        try:
            result = fn(*args)
        except Exception as exc:  # noqa: BLE001 - handed to the awaiting handler, which answers it
            settle(loop, fut, exc=exc)
        else:
            settle(loop, fut, result)

    threading.Thread(target=run, name="standin-control", daemon=True).start()
    return await fut


def json_response(status: int, body: Any) -> web.Response:
    """SGLang's answer shapes: no body, plain text (a str) or JSON."""
    if body is None:
        data, ctype = b"", "application/json"
    elif isinstance(body, str):
        data, ctype = body.encode(), "text/plain; charset=utf-8"
    else:
        data, ctype = json.dumps(body).encode(), "application/json"
    return web.Response(status=status, body=data, headers={"Content-Type": ctype})


class Admission:
    """The admission thread: submits each job's requests in order; a refused item cancels the
    job's earlier ones (as SGLang refuses a whole batch) and fails the job."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        # (engine requests, loop, future), or None to stop.
        self.jobs: queue.SimpleQueue[tuple[Sequence[EngineRequest], Any, asyncio.Future] | None] = (
            queue.SimpleQueue()
        )
        self.thread: threading.Thread | None = None

    def start(self) -> None:
        self.thread = threading.Thread(target=self._run, name="standin-admission", daemon=True)
        self.thread.start()

    async def admit(self, reqs: Sequence[EngineRequest]) -> None:
        """Returns once every request of `reqs` is running in the engine; raises what submit did."""
        loop = asyncio.get_running_loop()
        admitted = loop.create_future()
        self.jobs.put((reqs, loop, admitted))
        await admitted

    def stop(self) -> None:
        """After `engine.close()` (which makes every waiting submit fail at once); idempotent."""
        self.jobs.put(None)
        if self.thread is not None:
            self.thread.join()

    def _run(self) -> None:
        while (job := self.jobs.get()) is not None:
            reqs, loop, admitted = job
            submitted: list[EngineRequest] = []
            try:
                for req in reqs:
                    self.engine.submit(req)
                    submitted.append(req)
            except Exception as exc:  # noqa: BLE001 - fails this job only (RequestError: a 400)
                for req in submitted:
                    self.engine.cancel(req)
                settle(loop, admitted, exc=exc)
            else:
                settle(loop, admitted)


class AppThread:
    """An aiohttp application served from an event loop in a thread of its own."""

    def __init__(self, host: str, port: int) -> None:
        # Bound (and listening) here, so `url` is known before `start`; port 0 picks a free one.
        self.sock = socket.create_server((host, port), backlog=LISTEN_BACKLOG)
        self.loop: asyncio.AbstractEventLoop | None = None
        self.thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host, port = self.sock.getsockname()[:2]
        return f"http://{host}:{port}"

    def start(self, app: web.Application) -> None:
        """Returns once the loop accepts connections (or raises why it cannot)."""
        ready = threading.Event()
        failed: list[BaseException] = []

        def serve() -> None:
            loop = asyncio.new_event_loop()
            asyncio.set_event_loop(loop)
            runner = web.AppRunner(
                app, access_log=None, handle_signals=False, shutdown_timeout=SHUTDOWN_GRACE_S
            )
            try:
                loop.run_until_complete(runner.setup())
                loop.run_until_complete(web.SockSite(runner, self.sock, backlog=LISTEN_BACKLOG).start())
            except BaseException as exc:
                failed.append(exc)
                ready.set()
                loop.close()
                return
            self.loop = loop
            ready.set()
            try:
                loop.run_forever()
            finally:
                loop.run_until_complete(runner.cleanup())  # handlers get SHUTDOWN_GRACE_S to answer
                loop.close()

        self.thread = threading.Thread(target=serve, name="standin-http", daemon=True)
        self.thread.start()
        ready.wait()
        if failed:
            raise failed[0]

    def stop(self) -> None:
        """Stop serving and close the socket; idempotent."""
        loop, self.loop = self.loop, None
        if loop is not None:
            loop.call_soon_threadsafe(loop.stop)
        if self.thread is not None:
            self.thread.join()
        self.sock.close()
