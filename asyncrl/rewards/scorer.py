"""The Scorer: every `task.rewards[i]` over a batch of finished samples -> one `Score` each.

Data flow: generator batch done -> `Scorer.score(samples)` -> `Score` per sample (weighted sum,
unweighted parts, failures) -> Trajectory. Each reward runs where its shape and `runs_in` say,
never on the event loop itself:

| reward                                   | runs                                    | a call past timeout_s        |
|------------------------------------------|-----------------------------------------|------------------------------|
| sync, cheap built-in or runs_in="thread" | one thread per batch (a daemon thread)  | that sample fails; the rest  |
|                                          |                                         | go on in a fresh thread      |
| sync, otherwise                          | the worker pool (pool.py)               | its worker is killed         |
| async                                    | awaited, each sample concurrently       | cancelled                    |
| batch (score_batch)                      | a call per batch_size slice, in parallel| the slice fails              |

The Scorer reports failures per sample and reward; what they cost (zero, regenerate, the failure
budget) is the caller's decision (task.scoring.on_failure).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from asyncrl.config_sections import TaskConfig
from asyncrl.rewards.base import (
    RewardFailure,
    RewardInput,
    check_value,
    describe_exception,
    in_slices,
    is_cheap,
    resolve_reward,
    reward_mode,
    reward_name,
)
from asyncrl.rewards.pool import RewardPool

log = logging.getLogger(__name__)

_ASYNC_CONCURRENCY = 64  # async reward calls in flight per reward and batch

Column = list[float | RewardFailure]


@dataclass
class Score:
    """One sample's rewards."""

    reward: float  # sum of weight * part; a failed part contributes 0
    parts: dict[str, float] = field(default_factory=dict)  # reward name -> unweighted value (failed: 0.0)
    failures: dict[str, str] = field(
        default_factory=dict
    )  # name -> "timeout" | "raised: ..." | "invalid: ..."

    @property
    def failed(self) -> bool:
        return bool(self.failures)


@dataclass
class _Route:
    where: str  # "thread" | "process" | "async" | "batch"
    reward: Any
    pool_index: int = -1


class Scorer:
    """Runs a task's rewards (`section.rewards`, `section.scoring`); see the module docstring."""

    def __init__(self, section: TaskConfig) -> None:
        self.scoring = section.scoring
        self.names = [reward_name(cfg) for cfg in section.rewards]
        self.weights = [float(cfg.weight) for cfg in section.rewards]
        self.eval_name = self.scoring.eval_reward or (self.names[0] if self.names else "")
        self._routes: list[_Route] = []
        pool_specs = []
        for i, cfg in enumerate(section.rewards):
            reward = resolve_reward(cfg, index=i)
            mode = reward_mode(reward)
            if mode != "sync":
                self._routes.append(_Route(mode, reward))
            elif cfg.runs_in == "thread" or (cfg.runs_in == "auto" and is_cheap(reward)):
                self._routes.append(_Route("thread", reward))
            else:
                self._routes.append(_Route("process", reward, pool_index=len(pool_specs)))
                pool_specs.append(cfg)
        self.pool = (
            RewardPool(
                pool_specs,
                workers=self.scoring.workers,
                max_workers=max(self.scoring.workers, self.scoring.max_workers),
                timeout_s=self.scoring.timeout_s,
            )
            if pool_specs
            else None
        )
        self._sync_loop: asyncio.AbstractEventLoop | None = None
        self._closed = False

    async def score(self, samples: Sequence[RewardInput]) -> list[Score]:
        """Every reward over `samples`; one Score per sample, in order."""
        if self._closed:
            raise RuntimeError("the scorer is closed")
        samples = list(samples)
        if not samples:
            return []
        columns = await asyncio.gather(*(self._run(route, samples) for route in self._routes))
        scores = []
        for k in range(len(samples)):
            total, parts, failures = 0.0, {}, {}
            for name, weight, column in zip(self.names, self.weights, columns, strict=True):
                value = column[k]
                if isinstance(value, RewardFailure):
                    parts[name] = 0.0
                    failures[name] = value.describe()
                else:
                    parts[name] = value
                    total += weight * value
            scores.append(Score(total, parts, failures))
        return scores

    def score_sync(self, samples: Sequence[RewardInput]) -> list[Score]:
        """`score` for callers without a running event loop (evaluation); uses a private loop."""
        self._no_running_loop("score_sync()", "await scorer.score(samples)")
        if self._sync_loop is None:
            self._sync_loop = asyncio.new_event_loop()
        return self._sync_loop.run_until_complete(self.score(samples))

    async def aclose(self) -> None:
        """Stop the pool's workers and close rewards that hold resources (HTTP sessions)."""
        if self._closed:
            return
        self._closed = True
        if self.pool is not None:
            await self.pool.aclose()
        await self._close_rewards()
        if self._sync_loop is not None and self._sync_loop is not asyncio.get_running_loop():
            self._sync_loop.close()
            self._sync_loop = None

    def close(self) -> None:
        """`aclose()` for callers without a running event loop. Idempotent."""
        if self._closed:
            return
        self._no_running_loop("close()", "await scorer.aclose()")
        loop = self._sync_loop or asyncio.new_event_loop()
        self._sync_loop = None
        try:
            loop.run_until_complete(self.aclose())
        finally:
            loop.close()

    # -------------------------------------------------------------- per reward shape

    async def _run(self, route: _Route, samples: list[RewardInput]) -> Column:
        if route.where == "thread":
            return await self._in_threads(route.reward, samples)
        if route.where == "process":
            assert self.pool is not None
            return await self.pool.run(route.pool_index, samples)
        if route.where == "async":
            return await self._awaited(route.reward, samples)
        return await self._batched(route.reward, samples)

    async def _in_threads(self, fn: Any, samples: list[RewardInput]) -> Column:
        """One daemon thread scores the batch. A call that runs past timeout_s (seen by a watchdog
        that wakes every timeout_s) is left running: that sample fails, a fresh thread takes the
        rest. Own threads, not the default executor, so a hung call cannot starve other work."""
        loop = asyncio.get_running_loop()
        results: Column = [None] * len(samples)  # type: ignore[list-item]
        start = 0
        while start < len(samples):
            current = [start]  # the index the thread is on
            abandoned = threading.Event()
            done = loop.create_future()
            threading.Thread(
                target=_score_in_thread,
                args=(fn, samples, results, start, current, abandoned, loop, done),
                name=f"reward-{getattr(fn, '__name__', 'fn')}",
                daemon=True,
            ).start()
            last_seen = -1
            while True:
                finished, _ = await asyncio.wait({done}, timeout=self.scoring.timeout_s)
                if finished:
                    return results
                if current[0] == last_seen:  # no progress for a whole period: >= timeout_s on one call
                    abandoned.set()
                    results[last_seen] = RewardFailure(
                        "timeout",
                        f"the call ran past task.scoring.timeout_s = {self.scoring.timeout_s}s in a "
                        "thread, where it cannot be killed; runs_in = 'process' kills it",
                    )
                    start = last_seen + 1
                    break
                last_seen = current[0]
        return results

    async def _awaited(self, fn: Any, samples: list[RewardInput]) -> Column:
        semaphore = asyncio.Semaphore(_ASYNC_CONCURRENCY)
        timeout_s = self.scoring.timeout_s

        async def one(sample: RewardInput) -> float | RewardFailure:
            async with semaphore:
                try:
                    return check_value(await asyncio.wait_for(fn(sample), timeout_s))
                except TimeoutError:
                    return RewardFailure(
                        "timeout", f"the call ran past task.scoring.timeout_s = {timeout_s}s"
                    )
                except Exception as exc:  # the reward's own failure, reported for this sample
                    return RewardFailure("raised", describe_exception(exc))

        return list(await asyncio.gather(*(one(sample) for sample in samples)))

    async def _batched(self, reward: Any, samples: list[RewardInput]) -> Column:
        size = int(getattr(reward, "batch_size", 0) or len(samples))
        timeout_s = max(self.scoring.timeout_s, float(getattr(reward, "max_duration_s", 0.0)))

        async def one(part: Sequence[RewardInput]) -> Column:
            try:
                values = await asyncio.wait_for(reward.score_batch(part), timeout_s)
            except TimeoutError:
                failure = RewardFailure("timeout", f"score_batch ran past {timeout_s}s")
                return [failure] * len(part)
            except Exception as exc:  # e.g. the verifier is down after its retries: this slice fails
                return [RewardFailure("raised", describe_exception(exc))] * len(part)
            if not isinstance(values, Sequence) or len(values) != len(part):
                got = len(values) if isinstance(values, Sequence) else type(values).__name__
                failure = RewardFailure(
                    "invalid", f"score_batch returned {got} rewards for {len(part)} samples"
                )
                return [failure] * len(part)
            return [check_value(v) for v in values]

        parts = await asyncio.gather(*(one(part) for part in in_slices(samples, size)))
        return [value for part in parts for value in part]

    # -------------------------------------------------------------- helpers

    async def _close_rewards(self) -> None:
        for route in self._routes:
            closer = getattr(route.reward, "aclose", None) or getattr(route.reward, "close", None)
            if route.where == "thread" or not callable(closer):
                continue
            try:
                result = closer()
                if inspect.isawaitable(result):
                    await result
            except Exception:  # one reward's failed close must not keep the others open
                log.exception("closing reward %r failed", route.reward)

    @staticmethod
    def _no_running_loop(what: str, instead: str) -> None:
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return
        raise RuntimeError(f"Scorer.{what} was called on a running event loop; use `{instead}` there")


def _score_in_thread(
    fn: Any,
    samples: list[RewardInput],
    results: Column,
    start: int,
    current: list[int],
    abandoned: threading.Event,
    loop: asyncio.AbstractEventLoop,
    done: asyncio.Future,
) -> None:
    for k in range(start, len(samples)):
        if abandoned.is_set():
            return
        current[0] = k
        try:
            value = check_value(fn(samples[k]))
        except Exception as exc:  # the reward's own failure, reported for this sample
            value = RewardFailure("raised", describe_exception(exc))
        if abandoned.is_set():
            return  # the watchdog gave up on this thread; its results are no longer wanted
        results[k] = value
    try:
        loop.call_soon_threadsafe(_resolve, done)
    except RuntimeError:
        pass  # the loop closed while we ran


def _resolve(done: asyncio.Future) -> None:
    if not done.done():
        done.set_result(None)


def make_scorer(section: TaskConfig) -> Scorer | None:
    """The task's Scorer, or None when `task.rewards` is empty (the task's own score applies)."""
    return Scorer(section) if section.rewards else None


def score_completions(
    section: TaskConfig, done: Sequence[tuple[Any, Any]], *, max_new_tokens: int
) -> tuple[list[Score], list[str]]:
    """Score (problem, completion) pairs outside a run (held-out evaluation, the plain loop) with
    `section.rewards`, as the generators score samples; a completion has `text`, `num_tokens` and
    `finish_reason`. Returns the scores and the rewards' names; the scorer is closed after."""
    scorer = Scorer(section)
    try:
        inputs = [
            RewardInput(
                prompt=p.prompt,
                completion=c.text,
                answer=p.answer,
                extras=p.extras,
                num_tokens=c.num_tokens,
                finish_reason=c.finish_reason,
                max_new_tokens=max_new_tokens,
            )
            for p, c in done
        ]
        return scorer.score_sync(inputs), list(scorer.names)
    finally:
        scorer.close()


def reward_means(scores: Sequence[Score], names: Sequence[str]) -> dict[str, float]:
    """Each reward's mean over `scores`, and "total" (the weighted sum's)."""
    means = {name: sum(s.parts.get(name, 0.0) for s in scores) / len(scores) for name in names}
    means["total"] = sum(s.reward for s in scores) / len(scores)
    return means
