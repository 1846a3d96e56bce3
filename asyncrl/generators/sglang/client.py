"""HTTP/JSON client side of the `sglang` generator: wire types, one call, and the server fleet.

Place in the data flow: `generator.py` (the generator) asks the `Fleet` for the least-loaded server
in service, sends it one native /generate per sample and the weight-update control calls
(/pause_generation, /update_weights_from_disk, /model_info, /continue_generation). The wire shapes
are our own msgspec types written from /work/shared/SGLANG_API.md; `sglang` is never imported.

HTTP is stdlib `http.client`, one connection per call, run in a thread pool (`Fleet.call`): no
dependency, nothing to keep alive across a paused server, and a cut connection fails exactly the
call that used it. A server that refuses connections, cuts one, times out or answers 5xx is
quarantined (no new samples); a background health check (`GET /health` every
`health_interval_s`, a timer, not a sync) readmits it once it answers and its weights are current
(`on_readmit` pushes them first). 4xx answers are the caller's mistake and raise
`SGLangRequestError`, never quarantine.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import logging
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
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


def http_call(url: str, method: str, path: str, body: bytes | None, timeout_s: float) -> tuple[int, bytes]:
    """One blocking HTTP exchange; ServerUnavailable when there is no usable answer."""
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout_s)
    try:
        headers = {"Content-Type": "application/json"} if body is not None else {}
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
    """The servers of one generator: least-outstanding choice, quarantine, readmission."""

    def __init__(
        self, urls: list[str], *, max_workers: int, health_interval_s: float, wait_timeout_s: float
    ) -> None:
        if not urls:
            raise ValueError("the sglang generator needs at least one server: set generators.options.urls")
        self.servers = [Server(check_url(u)) for u in urls]
        if len({s.url for s in self.servers}) != len(self.servers):
            raise ValueError(f"generators.options.urls lists a server twice: {urls}")
        self.pool = ThreadPoolExecutor(max_workers, thread_name_prefix="sglang-http")
        self.health_interval_s = health_interval_s
        self.wait_timeout_s = wait_timeout_s
        self.on_readmit: Callable[[Server], Awaitable[bool]] | None = None
        self._changed: asyncio.Condition | None = None
        self._health_task: asyncio.Task | None = None
        self.num_quarantines = 0

    def _ensure_started(self) -> asyncio.Condition:
        if self._changed is None:
            self._changed = asyncio.Condition()
            self._health_task = asyncio.get_running_loop().create_task(
                self._health_loop(), name="sglang-health"
            )
        return self._changed

    async def call(
        self, server: Server, method: str, path: str, body: Any = None, *, timeout_s: float
    ) -> tuple[int, bytes]:
        data = None if body is None else _encode.encode(body)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.pool, http_call, server.url, method, path, data, timeout_s)

    def in_service(self) -> list[Server]:
        return [s for s in self.servers if s.in_service]

    async def acquire(self) -> Server:
        """The in-service server with the fewest outstanding requests; waits while none is."""
        changed = self._ensure_started()
        async with changed:
            try:
                await asyncio.wait_for(changed.wait_for(lambda: bool(self.in_service())), self.wait_timeout_s)
            except TimeoutError:
                reasons = "; ".join(f"{s.url}: {s.last_error}" for s in self.servers)
                raise ServerUnavailable(
                    f"no SGLang server has been healthy for {self.wait_timeout_s:g} s ({reasons})"
                ) from None
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
        if self._health_task is not None:
            self._health_task.cancel()
            try:
                await self._health_task
            except asyncio.CancelledError:
                pass
        self.pool.shutdown(wait=False, cancel_futures=True)


def wait_until_healthy(urls: list[str], timeout_s: float) -> None:
    """Blocking: poll every server's /health until all answer 200, or raise naming the laggards."""
    deadline = time.monotonic() + timeout_s
    pending = list(urls)
    last: dict[str, str] = {}
    while pending:
        for url in list(pending):
            try:
                status, _ = http_call(url, "GET", "/health", None, timeout_s=10.0)
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
