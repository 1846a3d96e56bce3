"""The `remote` environment: an environment served over HTTP by another process or host.

Use it as `env.kind = "asyncrl.environments.remote:remote"` with `env.options.url = "http://HOST:PORT"`
(and `timeout_s`, `retries`, `backoff_s`, `api_key_env`); run it with `env.workers = 0` (it only
waits on the network) or in workers with `env.sandbox.network = true`. The service side, for any
`Environment` factory: `asyncrl.environments.server` (`python -m asyncrl.environments.server
pkg.mod:factory --port N`).

The protocol (reset/step over HTTP, as OpenEnv's servers expose them, with an episode id so one
service hosts many episodes), JSON bodies with the Structs of `base.py`:

  POST /reset  {"episode_id", "start": EpisodeStart}         -> {"observation": Observation}
  POST /step   {"episode_id", "seq", "action": Action}       -> StepResult
  POST /close  {"episode_id"}                                -> {}

`seq` is the action's turn: a service answers a repeated (episode_id, seq) with the reply it gave,
so a retried request never steps an episode twice. A connection that fails, a timeout or a 5xx is
retried (backoff_s x 2^attempt, up to `retries` times), then the call fails as `timeout` or
`error`; a 4xx (the environment raised: the body says why) fails at once as `error`; a body that
is not the protocol fails as `bad_observation`. Every episode has its own keep-alive connection.
"""

from __future__ import annotations

import asyncio
import os
import uuid
from typing import Any

import msgspec

from asyncrl.environments.base import Action, EnvironmentContext, EpisodeStart, Observation, StepResult
from asyncrl.environments.host import EnvFailure

OPTIONS = {"url": str, "timeout_s": float, "retries": int, "backoff_s": float, "api_key_env": str}


class ResetReply(msgspec.Struct, frozen=True):
    observation: Observation


class RemoteEnv:
    """One episode of the environment at `url`; see the module docstring."""

    def __init__(
        self,
        url: str,
        *,
        timeout_s: float = 30.0,
        retries: int = 2,
        backoff_s: float = 0.5,
        api_key: str = "",
    ) -> None:
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        self.retries = retries
        self.backoff_s = backoff_s
        self.headers = {"Content-Type": "application/json"}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"
        self.episode_id = uuid.uuid4().hex
        self.session: Any = None
        self.num_retries = 0

    async def reset(self, start: EpisodeStart) -> Observation:
        data = await self._post("/reset", {"episode_id": self.episode_id, "start": start})
        return _decode(data, ResetReply, "reset").observation

    async def step(self, action: Action) -> StepResult:
        data = await self._post(
            "/step", {"episode_id": self.episode_id, "seq": action.turn, "action": action}
        )
        return _decode(data, StepResult, "step")

    async def close(self) -> None:
        if self.session is None:
            return
        try:
            await self._post("/close", {"episode_id": self.episode_id}, retries=0)
        except EnvFailure:
            pass  # the episode is over either way; the service forgets it on its own
        finally:
            await self.session.close()
            self.session = None

    async def _post(self, path: str, body: dict, *, retries: int | None = None) -> bytes:
        import aiohttp  # here: only runs with a remote environment pay for it

        if self.session is None:
            self.session = aiohttp.ClientSession(
                headers=self.headers, timeout=aiohttp.ClientTimeout(total=self.timeout_s)
            )
        payload = msgspec.json.encode(body)
        kind, last = "error", ""
        for attempt in range((self.retries if retries is None else retries) + 1):
            if attempt:
                self.num_retries += 1
                await asyncio.sleep(self.backoff_s * 2 ** (attempt - 1))  # backoff, not a synchronisation
            try:
                async with self.session.post(self.url + path, data=payload) as response:
                    data = await response.read()
                    if response.status == 200:
                        return data
                    last = f"HTTP {response.status}: {data[:300].decode(errors='replace')}"
                    if response.status < 500:
                        raise EnvFailure("error", f"{self.url}{path}: {last}")
                    kind = "error"
            except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as exc:
                kind, last = "error", f"{type(exc).__name__}: {exc}"
            except TimeoutError:
                kind, last = "timeout", f"no answer within {self.timeout_s:g} s"
        raise EnvFailure(kind, f"{self.url}{path} failed {attempt + 1} attempts; last: {last}")


def _decode(data: bytes, cls: type, what: str) -> Any:
    try:
        return msgspec.json.decode(data, type=cls)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise EnvFailure("bad_observation", f"the remote {what} answer is not the protocol: {exc}") from None


def remote(ctx: EnvironmentContext) -> RemoteEnv:
    """The factory (`env.kind`); options as the module docstring says."""
    unknown = sorted(set(ctx.options) - set(OPTIONS))
    if unknown or "url" not in ctx.options:
        raise ValueError(
            f"env.options for the remote environment: need url; unknown {unknown}; valid: {', '.join(OPTIONS)}"
        )
    opts = {k: OPTIONS[k](v) for k, v in ctx.options.items()}
    key_env = opts.pop("api_key_env", "")
    return RemoteEnv(opts.pop("url"), api_key=os.environ.get(key_env, "") if key_env else "", **opts)
