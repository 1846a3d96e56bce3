"""HTTP/JSON client side of the `sglang` generator: wire types, one call, and the server fleet.

Place in the data flow: `generator.py` (the generator) asks the `Fleet` for the least-loaded server
in service, sends it one native /generate per sample and the weight-update control calls
(/pause_generation, /update_weights_from_disk, /model_info, /continue_generation). The wire shapes
are our own msgspec types written from /work/shared/SGLANG_API.md; `sglang` is never imported.

HTTP (`Fleet.call`) is native asyncio: one aiohttp `ClientSession` per Fleet, made on the event
loop that first calls (aiohttp is imported then, not at import) and closed by `Fleet.close`. Its
connector keeps connections alive and reuses them, so a sample costs one request on an open
socket, not a connect, a thread and a teardown; a thousand samples in flight are a thousand
sockets and coroutines on one loop, with no thread per request. Each HTTP/1.1 connection carries
one request at a time, so the pool's size is the number of requests on the wire:

- no cap by default (`generators.options.max_connections = 0`): the generator already bounds its
  samples (`max_concurrency`), and a second, lower bound here would hold samples back from the
  server's batch and could leave a weight update's /continue_generation queued behind samples that
  a paused server holds, which only that call would release. A cap, when set, must leave room for
  the control calls (`options.py` checks it);
- idle connections are closed after `KEEPALIVE_S`, before the server's own keep-alive timeout
  (SGLang runs uvicorn with timeout_keep_alive=5), so a request does not go out on a socket the
  server is about to close (which would look like a cut connection and quarantine it).

Failures: a server that refuses connections, cuts one, times out (`timeout_s`, the whole call) or
answers 5xx raises `ServerUnavailable`, and the caller quarantines it (no new samples); a
background health check (`GET /health` every `health_interval_s`, a timer, not a sync) readmits
it once it answers and its weights are current (`on_readmit` pushes them first). 4xx answers are
returned: they are the caller's mistake, which it raises as `SGLangRequestError`, never a reason
to quarantine. A cut connection fails exactly the call that used it: the pool drops it.

`http_call` is the blocking stdlib exchange (one connection per call) kept for code that runs
outside the event loop: launch.py's readiness wait and `wait_until_healthy` in `setup`.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import msgspec

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------- wire types (SGLANG_API.md 1.3)
class GenerateRequest(msgspec.Struct, kw_only=True, omit_defaults=True):
    input_ids: list[int]
    sampling_params: dict[str, Any]
    rid: str
    return_logprob: bool  # no default: omit_defaults must never drop it (the server's default is false)
    return_sampling_mask: bool = False
    sampling_logprobs_mode: str | None = None
    lora_path: str | None = None  # the LoRA adapter's name (learner.lora.publish = "adapter")
    stream: bool = False
    # >= 0: also score the prompt from this position (`input_token_logprobs`; the canary's use)
    logprob_start_len: int | None = None


class VersionSpan(msgspec.Struct):
    version: str
    start: int
    end: int


class MetaInfo(msgspec.Struct):
    id: str = ""
    finish_reason: dict[str, Any] | None = None
    weight_version: str | None = None
    weight_versions: list[VersionSpan] | None = None  # absent before sglang 0.5.20
    output_token_logprobs: list[tuple[float, int, str | None]] = []
    output_token_sampling_logprobs: list[float] | None = None
    # With logprob_start_len >= 0: [log-prob (null at the first position), token, text] per
    # prompt position from there, plain log_softmax (no temperature)
    input_token_logprobs: list[tuple[float | None, int, str | None]] = []


class GenerateResponse(msgspec.Struct):
    meta_info: MetaInfo
    text: str = ""
    output_ids: list[int] = []


class ModelInfo(msgspec.Struct):
    weight_version: str | None = None
    model_path: str = ""


class UpdateResult(msgspec.Struct):
    success: bool = False
    message: str = ""


_decode_generate = msgspec.json.Decoder(GenerateResponse)
_decode_model_info = msgspec.json.Decoder(ModelInfo)
_decode_update = msgspec.json.Decoder(UpdateResult)
_encode = msgspec.json.Encoder()
_JSON_HEADERS = {"Content-Type": "application/json"}
# Idle pooled connections close after this long: under the server's keep-alive timeout (SGLang
# runs uvicorn with timeout_keep_alive=5), so the client never reuses a socket the server is closing.
KEEPALIVE_S = 4.0


class ServerUnavailable(ConnectionError):
    """The server did not answer usefully (refused, cut, timed out, 5xx): retry elsewhere."""


class SGLangRequestError(ValueError):
    """The server rejected the request (4xx): retrying cannot help; the message says why."""


def error_message(body: bytes) -> str:
    """The error text of an SGLang 4xx body: `{"error": str}`, `{"error": {"message"}}`,
    `{"message"}` or `{"detail"}`."""
    try:
        obj = json.loads(body)
    except ValueError:
        return body.decode(errors="replace").strip()
    if isinstance(obj, dict):
        err = obj.get("error", obj.get("message", obj.get("detail")))
        if isinstance(err, dict):
            err = err.get("message", err)
        if err is not None:
            return str(err)
    return str(obj)


def check_url(url: str) -> str:
    parts = urlsplit(url)
    if parts.scheme != "http" or not parts.hostname or not parts.port:
        raise ValueError(
            f"SGLang server URL {url!r} must look like http://HOST:PORT (generators.options.urls, comma-separated)"
        )
    return f"http://{parts.hostname}:{parts.port}"


def auth_headers(api_key: str) -> dict[str, str]:
    """What SGLang's `--api-key` asks of every call (SGLANG_API.md 2): a Bearer token."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def http_call(
    url: str, method: str, path: str, body: bytes | None, timeout_s: float, *, api_key: str = ""
) -> tuple[int, bytes]:
    """One blocking HTTP exchange; ServerUnavailable when there is no usable answer."""
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout_s)
    try:
        headers = {"Content-Type": "application/json"} if body is not None else {}
        headers.update(auth_headers(api_key))
        conn.request(method, path, body=body, headers=headers)
        resp = conn.getresponse()
        data = resp.read()
    except (OSError, http.client.HTTPException) as exc:
        raise ServerUnavailable(f"{url}{path}: {type(exc).__name__}: {exc}") from None
    finally:
        conn.close()
    if resp.status >= 500:
        raise ServerUnavailable(f"{url}{path}: HTTP {resp.status}: {error_message(data)}")
    return resp.status, data


# ---------------------------------------------------------------------- fleet
@dataclass(eq=False)
class Server:
    url: str
    in_service: bool = True
    outstanding: int = 0
    num_requests: int = 0
    num_failures: int = 0
    last_error: str = ""


class Fleet:
    """The servers of one generator: least-outstanding choice, quarantine, readmission, and the
    pooled HTTP session every call goes through (one event loop per Fleet)."""

    def __init__(
        self,
        urls: list[str],
        *,
        max_connections: int = 0,
        health_interval_s: float,
        wait_timeout_s: float,
        max_workers: int | None = None,
        api_key: str = "",
    ) -> None:
        """`max_connections`: the most requests on the wire at once over all servers (0: no cap;
        see the module docstring). `max_workers` is its former name (it sized the thread pool
        that carried the calls), still accepted. `api_key`: sent as a Bearer token on every call
        (servers started with `--api-key`; generators.options.api_key_env)."""
        # Headers of a call without and with a JSON body.
        self._headers = auth_headers(api_key) or None
        self._json_headers = {**_JSON_HEADERS, **auth_headers(api_key)}
        if not urls:
            raise ValueError("the sglang generator needs at least one server: set generators.options.urls")
        self.servers = [Server(check_url(u)) for u in urls]
        if len({s.url for s in self.servers}) != len(self.servers):
            raise ValueError(f"generators.options.urls lists a server twice: {urls}")
        self.max_connections = max_workers if max_workers is not None else max_connections
        if self.max_connections < 0:
            raise ValueError(f"max_connections must be >= 0 (0: no cap), got {self.max_connections}")
        self.health_interval_s = health_interval_s
        self.wait_timeout_s = wait_timeout_s
        self.on_readmit: Callable[[Server], Awaitable[bool]] | None = None
        self._changed: asyncio.Condition | None = None
        self._health_task: asyncio.Task | None = None
        self._session: Any = None  # aiohttp.ClientSession, made on the loop of the first call
        self._session_loop: asyncio.AbstractEventLoop | None = None
        self._timeouts: dict[float, Any] = {}  # timeout_s -> aiohttp.ClientTimeout
        self._closed = False
        self.num_quarantines = 0

    def _ensure_started(self) -> asyncio.Condition:
        if self._changed is None:
            self._changed = asyncio.Condition()
            self._health_task = asyncio.get_running_loop().create_task(
                self._health_loop(), name="sglang-health"
            )
        return self._changed

    def _http(self) -> Any:
        """The session, made on first use on the running loop (its connections belong to it)."""
        loop = asyncio.get_running_loop()
        if self._session is not None:
            if self._session_loop is not loop:
                raise RuntimeError("a Fleet serves the event loop that first used it; make one per loop")
            return self._session
        if self._closed:
            raise ServerUnavailable("the SGLang fleet is closed")
        import aiohttp  # here, not at import: only a process that talks to SGLang pays for it

        connector = aiohttp.TCPConnector(
            limit=self.max_connections, limit_per_host=0, keepalive_timeout=KEEPALIVE_S
        )
        self._session = aiohttp.ClientSession(connector=connector, cookie_jar=aiohttp.DummyCookieJar())
        self._session_loop = loop
        return self._session

    def _timeout(self, timeout_s: float) -> Any:
        timeout = self._timeouts.get(timeout_s)
        if timeout is None:
            import aiohttp

            timeout = self._timeouts[timeout_s] = aiohttp.ClientTimeout(total=timeout_s)
        return timeout

    async def call(
        self, server: Server, method: str, path: str, body: Any = None, *, timeout_s: float
    ) -> tuple[int, bytes]:
        """One HTTP exchange on a pooled connection: (status, body) for 2xx-4xx answers;
        ServerUnavailable when refused, cut, over `timeout_s` (connect to last byte) or 5xx."""
        import aiohttp

        session = self._http()
        data = None if body is None else _encode.encode(body)
        try:
            async with session.request(
                method,
                server.url + path,
                data=data,
                headers=self._json_headers if data is not None else self._headers,
                timeout=self._timeout(timeout_s),
            ) as resp:
                status = resp.status
                payload = await resp.read()
        except TimeoutError as exc:  # aiohttp's timeouts are TimeoutErrors, some also ClientErrors
            raise ServerUnavailable(
                f"{server.url}{path}: {type(exc).__name__}: no answer within {timeout_s:g} s"
            ) from None
        except (aiohttp.ClientError, OSError) as exc:
            raise ServerUnavailable(f"{server.url}{path}: {type(exc).__name__}: {exc}") from None
        if status >= 500:
            raise ServerUnavailable(f"{server.url}{path}: HTTP {status}: {error_message(payload)}")
        return status, payload

    def in_service(self) -> list[Server]:
        return [s for s in self.servers if s.in_service]

    async def acquire(self) -> Server:
        """The in-service server with the fewest outstanding requests; waits while none is."""
        changed = self._ensure_started()
        if not any(s.in_service for s in self.servers):  # the common case skips the lock and the timer
            async with changed:
                try:
                    await asyncio.wait_for(
                        changed.wait_for(lambda: bool(self.in_service())), self.wait_timeout_s
                    )
                except TimeoutError:
                    reasons = "; ".join(f"{s.url}: {s.last_error}" for s in self.servers)
                    raise ServerUnavailable(
                        f"no SGLang server has been healthy for {self.wait_timeout_s:g} s ({reasons})"
                    ) from None
        # No await since the check: the pick sees the servers in service now.
        server = min(self.in_service(), key=lambda s: (s.outstanding, s.num_requests))
        server.outstanding += 1
        server.num_requests += 1
        return server

    def release(self, server: Server) -> None:
        server.outstanding -= 1

    def quarantine(self, server: Server, reason: str) -> None:
        server.num_failures += 1
        server.last_error = reason
        if server.in_service:
            server.in_service = False
            self.num_quarantines += 1
            log.warning("SGLang server %s quarantined: %s", server.url, reason)

    async def _readmit(self, server: Server) -> None:
        changed = self._ensure_started()
        async with changed:
            server.in_service = True
            changed.notify_all()
        log.info("SGLang server %s readmitted", server.url)

    async def check(self, server: Server) -> bool:
        """Healthy and, via `on_readmit`, holding the current weights."""
        try:
            status, _ = await self.call(
                server, "GET", "/health", timeout_s=min(30.0, 5 * self.health_interval_s + 5)
            )
        except ServerUnavailable as exc:
            server.last_error = str(exc)
            return False
        if status != 200:
            server.last_error = f"/health answered {status}"
            return False
        return self.on_readmit is None or await self.on_readmit(server)

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.health_interval_s)  # a timer between checks, not a sync
            for server in [s for s in self.servers if not s.in_service]:
                if await self.check(server):
                    await self._readmit(server)

    async def close(self) -> None:
        """Stop the health loop and close the pooled connections; idempotent. Calls after this
        raise ServerUnavailable."""
        self._closed = True
        if self._health_task is not None:
            self._health_task.cancel()
            try:
                await self._health_task
            except asyncio.CancelledError:
                pass
            self._health_task = None
        session, self._session = self._session, None
        if session is not None:
            await session.close()


def wait_until_healthy(urls: list[str], timeout_s: float, *, api_key: str = "") -> None:
    """Blocking: poll every server's /health until all answer 200, or raise naming the laggards."""
    deadline = time.monotonic() + timeout_s
    pending = list(urls)
    last: dict[str, str] = {}
    while pending:
        for url in list(pending):
            try:
                status, _ = http_call(url, "GET", "/health", None, timeout_s=10.0, api_key=api_key)
                if status == 200:
                    pending.remove(url)
                else:
                    last[url] = f"HTTP {status}"
            except ServerUnavailable as exc:
                last[url] = str(exc)
        if pending and time.monotonic() > deadline:
            details = "; ".join(f"{u}: {last.get(u, '?')}" for u in pending)
            raise ServerUnavailable(
                f"SGLang servers not healthy after {timeout_s:g} s (generators.options.startup_timeout_s): {details}"
            )
        if pending:
            time.sleep(0.2)  # poll interval while servers start; the deadline above bounds it


def decode_generate(body: bytes) -> GenerateResponse:
    return _decode_generate.decode(body)


def decode_model_info(body: bytes) -> ModelInfo:
    return _decode_model_info.decode(body)


def decode_update(body: bytes) -> UpdateResult:
    return _decode_update.decode(body)
