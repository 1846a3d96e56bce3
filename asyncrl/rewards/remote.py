"""The `remote` reward: a verifier service over HTTP (a batch reward).

Data flow: Scorer -> `RemoteVerifier.score_batch(samples)` -> POST `url` with JSON
`{"items": [{"prompt", "completion", "answer", "extras"}, ...]}` (at most batch_size items a
request, requests in parallel over one pooled aiohttp session) -> `{"rewards": [float, ...]}`.

A request that fails to connect, times out (timeout_s) or gets a 5xx is retried after
backoff_s * 2**attempt, up to `retries` times; then `RemoteRewardError` is raised, and the Scorer
fails every sample of that request. A 4xx or a malformed response is not retried. A stand-in
server for tests: asyncrl.testing.verifier.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Mapping, Sequence
from typing import Any
from urllib.parse import urlsplit

import msgspec

from asyncrl.rewards.base import RewardInput, in_slices


class RemoteRewardError(RuntimeError):
    """The verifier at a URL could not score a request."""


class _Item(msgspec.Struct):
    prompt: str
    completion: str
    answer: str
    extras: dict[str, Any]


class _Request(msgspec.Struct):
    items: list[_Item]


class _Retryable(Exception):
    pass


class RemoteVerifier:
    """A batch reward that POSTs samples to `url`; see the module docstring."""

    def __init__(
        self,
        url: str,
        *,
        timeout_s: float,
        retries: int,
        backoff_s: float,
        batch_size: int,
        headers: Mapping[str, str] | None,
    ) -> None:
        self.url = url
        self.timeout_s = timeout_s
        self.retries = retries
        self.backoff_s = backoff_s
        self.batch_size = batch_size  # the Scorer sends one slice this size per score_batch call
        self.headers = {"Content-Type": "application/json", **(headers or {})}
        self.num_retries = 0  # requests sent again after a failure
        self._session: Any = None  # aiohttp.ClientSession, made on the loop that first needs it
        self._session_loop: asyncio.AbstractEventLoop | None = None

    @property
    def max_duration_s(self) -> float:
        """Longest one request can take with every retry (the Scorer's timeout for a slice)."""
        waits = sum(self.backoff_s * 2**attempt for attempt in range(self.retries))
        return self.timeout_s * (self.retries + 1) + waits

    async def score_batch(self, samples: Sequence[RewardInput]) -> list[float]:
        """One reward per sample, in order; RemoteRewardError when a request fails for good."""
        if not samples:
            return []
        parts = await asyncio.gather(*(self._post(part) for part in in_slices(samples, self.batch_size)))
        return [reward for part in parts for reward in part]

    async def close(self) -> None:
        """Close the pooled session (idempotent)."""
        session, self._session = self._session, None
        if session is not None and self._session_loop is asyncio.get_running_loop():
            await session.close()
        self._session_loop = None

    aclose = close

    def _client(self) -> Any:
        import aiohttp  # here, not at import: only runs with a remote reward pay for it

        loop = asyncio.get_running_loop()
        if self._session is None or self._session_loop is not loop or self._session.closed:
            # A session belongs to the loop it was made on; a different loop (score_sync after
            # score) gets its own.
            self._session = aiohttp.ClientSession(
                headers=self.headers,
                timeout=aiohttp.ClientTimeout(total=self.timeout_s),
                raise_for_status=False,
            )
            self._session_loop = loop
        return self._session

    async def _post(self, samples: Sequence[RewardInput]) -> list[float]:
        import aiohttp

        body = msgspec.json.encode(
            _Request([_Item(s.prompt, s.completion, s.answer, dict(s.extras)) for s in samples])
        )
        last = ""
        for attempt in range(self.retries + 1):
            if attempt:
                self.num_retries += 1
                await asyncio.sleep(self.backoff_s * 2 ** (attempt - 1))  # backoff, not a synchronisation
            try:
                return await self._once(body, len(samples))
            except _Retryable as exc:
                last = str(exc)
            except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as exc:
                last = f"{type(exc).__name__}: {exc}"
            except TimeoutError:
                last = f"no response within timeout_s = {self.timeout_s}s"
        raise RemoteRewardError(
            f"verifier {self.url} failed {self.retries + 1} attempts (retries = {self.retries}); last: {last}"
        )

    async def _once(self, body: bytes, num_samples: int) -> list[float]:
        async with self._client().post(self.url, data=body) as response:
            payload = await response.read()
            if response.status >= 500:
                raise _Retryable(f"HTTP {response.status}: {payload[:200]!r}")
            if response.status != 200:
                raise RemoteRewardError(
                    f"verifier {self.url} rejected the request: HTTP {response.status}: {payload[:200]!r}"
                )
        return _rewards(payload, num_samples, self.url)


def _rewards(payload: bytes, num_samples: int, url: str) -> list[float]:
    try:
        decoded = msgspec.json.decode(payload)
    except msgspec.DecodeError as exc:
        raise RemoteRewardError(f"verifier {url} sent a response that is not JSON: {exc}") from None
    rewards = decoded.get("rewards") if isinstance(decoded, dict) else None
    if not isinstance(rewards, list) or len(rewards) != num_samples:
        got = f"{len(rewards)} rewards" if isinstance(rewards, list) else repr(payload[:120])
        raise RemoteRewardError(
            f'verifier {url} must answer {{"rewards": [float, ...]}} with {num_samples} numbers; got {got}'
        )
    out = []
    for value in rewards:
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise RemoteRewardError(f"verifier {url} sent a reward that is not a finite number: {value!r}")
        out.append(float(value))
    return out


def remote(
    url: str,
    timeout_s: float = 10.0,
    retries: int = 3,
    backoff_s: float = 0.5,
    batch_size: int = 64,
    headers: Mapping[str, str] | None = None,
) -> RemoteVerifier:
    """Factory of the `remote` reward (options: url, timeout_s, retries, backoff_s, batch_size,
    headers)."""
    parts = urlsplit(url) if isinstance(url, str) else None
    if parts is None or parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(
            f"url = {url!r} must be an http:// or https:// URL, e.g. 'http://127.0.0.1:8000/score'"
        )
    if not (timeout_s > 0 and math.isfinite(timeout_s)):
        raise ValueError(f"timeout_s = {timeout_s} must be a positive number of seconds")
    if not isinstance(retries, int) or retries < 0:
        raise ValueError(f"retries = {retries!r} must be an integer >= 0")
    if not (backoff_s >= 0 and math.isfinite(backoff_s)):
        raise ValueError(f"backoff_s = {backoff_s} must be >= 0 seconds")
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size = {batch_size!r} must be an integer >= 1")
    if headers is not None and not all(isinstance(k, str) and isinstance(v, str) for k, v in headers.items()):
        raise ValueError("headers must map header names to string values")
    return RemoteVerifier(
        url, timeout_s=timeout_s, retries=retries, backoff_s=backoff_s, batch_size=batch_size, headers=headers
    )
