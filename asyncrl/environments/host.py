"""Where environments run: the `EnvHost` interface, its failures, and the in-process host.

Place in the data flow: the episode runner (`generators/episode_runner.py`) opens one episode per sample on a host,
steps it after every model turn and closes it. Two hosts: `InProcessHost` (here: environments are
coroutines on the generator's event loop, for I/O-bound ones; `env.workers = 0`) and
`pool.ProcessPoolHost` (worker processes in a jail, for anything that computes or runs code).

Every failure of an environment reaches the runner as one `EnvFailure` whose `kind` names it:
  error            reset or step raised (the message is the exception's)
  timeout          it took longer than `env.step_timeout_s`
  worker_lost      its worker process died (a pool host; the episode's state died with it)
  bad_observation  it answered something that is not a StepResult/Observation (`render.py` too)
so the runner counts each kind and applies one policy (`env.on_failure`).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from typing import Any, Protocol

from asyncrl.environments.base import (
    Action,
    Environment,
    EnvironmentContext,
    EpisodeStart,
    Observation,
    StepResult,
    make_environment,
)

log = logging.getLogger(__name__)

FAILURE_KINDS = ("error", "timeout", "worker_lost", "bad_observation")


class EnvFailure(Exception):
    """An environment failed one call; `kind` is one of FAILURE_KINDS."""

    def __init__(self, kind: str, message: str, exc_type: str = "") -> None:
        assert kind in FAILURE_KINDS, kind
        super().__init__(f"{kind}: {message}")
        self.kind = kind
        self.exc_type = exc_type  # the environment's exception class, for `error`


class EnvHost(Protocol):
    """Runs environments, one instance per open episode, identified by the handle `open` returns."""

    async def open(self, start: EpisodeStart) -> tuple[int, Observation]: ...

    async def step(self, handle: int, action: Action) -> StepResult: ...

    async def close_episode(self, handle: int) -> None: ...

    async def aclose(self) -> None: ...


def check_result(result: Any, what: str) -> Any:
    """`result` if it is what `what` ("reset" or "step") must return; else EnvFailure."""
    want = Observation if what == "reset" else StepResult
    if not isinstance(result, want):
        raise EnvFailure("bad_observation", f"{what} returned {type(result).__name__}, not {want.__name__}")
    if isinstance(result, StepResult):
        if not isinstance(result.reward, int | float) or result.reward != result.reward:
            raise EnvFailure("bad_observation", f"step returned reward {result.reward!r}")
        if not isinstance(result.observation, Observation):
            raise EnvFailure(
                "bad_observation", "step returned a StepResult whose observation is not an Observation"
            )
    return result


class InProcessHost:
    """Environments as coroutines on this event loop, each call bounded by `timeout_s`. A call
    that overruns is cancelled (a coroutine that never awaits cannot be: use worker processes for
    environments that compute)."""

    def __init__(self, factory: Any, ctx: EnvironmentContext, *, timeout_s: float) -> None:
        self.factory = factory
        self.ctx = ctx
        self.timeout_s = timeout_s
        self._envs: dict[int, Environment] = {}
        self._ids = itertools.count()

    async def _call(self, what: str, coro) -> Any:
        try:
            result = await asyncio.wait_for(coro, self.timeout_s)
        except TimeoutError:
            raise EnvFailure(
                "timeout", f"{what} took longer than env.step_timeout_s = {self.timeout_s}"
            ) from None
        except EnvFailure:
            raise
        except Exception as exc:  # the environment's own error: counted by the runner, never fatal
            raise EnvFailure(
                "error", f"{what} raised {type(exc).__name__}: {exc}", type(exc).__name__
            ) from exc
        return check_result(result, what)

    async def open(self, start: EpisodeStart) -> tuple[int, Observation]:
        try:
            env = make_environment(self.factory, self.ctx)
        except Exception as exc:
            raise EnvFailure("error", f"the environment factory raised {type(exc).__name__}: {exc}") from exc
        handle = next(self._ids)
        self._envs[handle] = env
        return handle, await self._call("reset", env.reset(start))

    async def step(self, handle: int, action: Action) -> StepResult:
        return await self._call("step", self._envs[handle].step(action))

    async def close_episode(self, handle: int) -> None:
        env = self._envs.pop(handle, None)
        close = getattr(env, "close", None)
        if close is not None:
            try:
                await asyncio.wait_for(close(), self.timeout_s)
            except Exception as exc:  # closing is best effort: the episode is over either way
                log.debug("closing an environment failed: %r", exc)

    async def aclose(self) -> None:
        for handle in list(self._envs):
            await self.close_episode(handle)
