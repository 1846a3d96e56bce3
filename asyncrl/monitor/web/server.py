"""The web monitor's HTTP server (aiohttp): one page, its static files, and each run's state.

Place in the data flow: `RunSource`s (one per run: a `WebRun` fed from a thread that follows the
run, or in process by `asyncrl launch --web`) -> this server -> the browser. Routes, all GET:
  /                          the page (static/index.html; script and style beside it)
  /api/runs                  [{"id", "label"}], the runs shown side by side
  /api/runs/{id}/state       the run's whole view (`WebRun.state()`), bounded in size
  /api/runs/{id}/config      the resolved config (config.json), or {}
  /api/runs/{id}/stream      server-sent events: the view again whenever it changed, at most
                             `MAX_MESSAGES_PER_S` per second per page, whatever the record rate
Every request first passes `Access.check` (access.py). Nothing here writes to a run.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from importlib import resources

from aiohttp import web

from asyncrl.monitor.web.access import COOKIE, Access
from asyncrl.monitor.web.model import WebRun

MAX_MESSAGES_PER_S = 2  # stream messages per page and run; each one carries the whole (bounded) view
KEEPALIVE_S = 15.0  # a comment line this often on a quiet stream, so a closed page is noticed
STATIC = {"index.html": "text/html", "app.js": "text/javascript", "style.css": "text/css"}
SECURITY_HEADERS = {
    # Everything the page loads is its own: no inline script, nothing from the network.
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",  # the token may be in the address
    "Cache-Control": "no-store",
}


class RunSource:
    """One run's `WebRun` behind a lock (records come from another thread), and its JSON."""

    def __init__(self, run: WebRun) -> None:
        self.run = run
        self.lock = threading.Lock()
        self._cache: tuple[int, bytes] = (-1, b"")

    def add(self, record: dict) -> None:
        with self.lock:
            self.run.add(record)

    def apply(self, fn) -> None:
        with self.lock:
            fn(self.run)

    @property
    def revision(self) -> int:
        return self.run.revision

    def state_json(self) -> bytes:
        """The view as JSON, built once per revision however many pages read it."""
        with self.lock:
            revision = self.run.revision
            if self._cache[0] != revision:
                self._cache = (revision, json.dumps(self.run.state(), separators=(",", ":")).encode())
            return self._cache[1]

    def config_json(self) -> bytes:
        with self.lock:
            return json.dumps(self.run.config or {}).encode()


def _static(name: str) -> bytes:
    return resources.files("asyncrl.monitor.web").joinpath("static", name).read_bytes()


def build_app(sources: list[RunSource], access: Access) -> web.Application:
    @web.middleware
    async def guard(request: web.Request, handler):
        presented = [
            request.query.get("token", ""),
            request.cookies.get(COOKIE, ""),
            request.headers.get("Authorization", "").removeprefix("Bearer ").strip(),
        ]
        refused = access.check(host_header=request.host, presented=presented)
        if refused is not None:
            status, why = refused
            return web.Response(status=status, text=f"asyncrl monitor: {why}\n", headers=SECURITY_HEADERS)
        response = await handler(request)
        response.headers.update(SECURITY_HEADERS)
        token = request.query.get("token")
        if access.token is not None and token == access.token:
            response.set_cookie(COOKIE, token, httponly=True, samesite="Strict")
        return response

    def source(request: web.Request) -> RunSource:
        try:
            return sources[int(request.match_info["run"])]
        except (ValueError, IndexError):
            raise web.HTTPNotFound(text=f"no run {request.match_info['run']!r}") from None

    async def page(request: web.Request) -> web.Response:
        return web.Response(body=_static("index.html"), content_type="text/html")

    async def static(request: web.Request) -> web.Response:
        name = request.match_info["name"]
        if name not in STATIC:
            raise web.HTTPNotFound()
        return web.Response(body=_static(name), content_type=STATIC[name])

    async def runs(request: web.Request) -> web.Response:
        return web.json_response([{"id": i, "label": s.run.label} for i, s in enumerate(sources)])

    async def state(request: web.Request) -> web.Response:
        return web.Response(body=source(request).state_json(), content_type="application/json")

    async def config(request: web.Request) -> web.Response:
        return web.Response(body=source(request).config_json(), content_type="application/json")

    async def stream(request: web.Request) -> web.StreamResponse:
        return await serve_stream(request, source(request))

    app = web.Application(middlewares=[guard])
    app.router.add_get("/", page)
    app.router.add_get("/static/{name}", static)
    app.router.add_get("/api/runs", runs)
    app.router.add_get("/api/runs/{run}/state", state)
    app.router.add_get("/api/runs/{run}/config", config)
    app.router.add_get("/api/runs/{run}/stream", stream)
    return app


async def serve_stream(request: web.Request, src: RunSource) -> web.StreamResponse:
    """Server-sent events: the run's view when its revision moved, at most MAX_MESSAGES_PER_S a
    second (a pause after each message: the bound holds whatever the record rate)."""
    response = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-store", **SECURITY_HEADERS}
    )
    await response.prepare(request)
    interval_s = 1.0 / MAX_MESSAGES_PER_S
    sent_revision, last_write = -1, time.monotonic()
    try:
        while True:
            if src.revision != sent_revision:
                sent_revision = src.revision
                payload = await asyncio.to_thread(src.state_json)
                await response.write(b"event: state\ndata: " + payload + b"\n\n")
                last_write = time.monotonic()
            elif time.monotonic() - last_write >= KEEPALIVE_S:
                await response.write(b": keepalive\n\n")
                last_write = time.monotonic()
            await asyncio.sleep(interval_s)  # the rate bound, not a synchronisation
    except ConnectionResetError:  # the page went away (a server stopping cancels the loop instead)
        pass
    return response


class ServerThread:
    """The app served from a thread of its own (its own event loop); `start()` returns once the
    socket is bound, `url` names it. Used by `asyncrl monitor --web` and `asyncrl launch --web`."""

    def __init__(self, app: web.Application, host: str, port: int) -> None:
        self.app, self.host, self.port = app, host, port
        self.url = ""
        self.error: BaseException | None = None
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._run, name="web-monitor", daemon=True)

    def start(self) -> str:
        self._thread.start()
        self._ready.wait()
        if self.error is not None:
            raise ValueError(
                f"the web monitor cannot listen on {self.host}:{self.port}: {self.error} "
                "(choose another port with --port / --web-port; 0 takes a free one)"
            )
        return self.url

    def _run(self) -> None:
        asyncio.run(self._serve())

    async def _serve(self) -> None:
        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        runner = web.AppRunner(self.app, handle_signals=False, access_log=None, shutdown_timeout=1.0)
        try:
            await runner.setup()
            site = web.TCPSite(runner, self.host, self.port)
            await site.start()
        except OSError as exc:
            self.error = exc
            self._ready.set()
            await runner.cleanup()
            return
        host, port = runner.addresses[0][:2]
        self.url = f"http://{'[' + host + ']' if ':' in host else host}:{port}/"
        self._ready.set()
        await self._stop.wait()
        await runner.cleanup()

    def stop(self) -> None:
        if self._loop is not None and self._stop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout=5.0)
