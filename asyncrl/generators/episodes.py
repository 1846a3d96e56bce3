"""Agentic episodes in a generator: the stream of episodes over the feed, and the torch turn server.

Place in the data flow: with `env.kind` set, the torch and sglang generators' `generate_stream`
is `episode_stream`: it keeps up to `env.max_episodes` episodes in flight (coroutines of
`environments.runner.EpisodeRunner`), takes a new sample from the feed as soon as one ends and
yields each episode's Rollout when it ends. Each backend gives the runner one turn at a time:
SGLang sends one /generate per turn (`sglang/generator.py: turn`); the torch generator has a
`TorchTurnServer`, a decoding thread with continuous batching whose rows are turns, not episodes:
a turn joins the batch when its episode asks for it and leaves it when it ends, so an episode
waiting on its environment holds no row.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from typing import TYPE_CHECKING, Any

from asyncrl.generators.episode_runner import Budgets, EnvCounters, EpisodeRunner, TurnOutput, TurnRequest
from asyncrl.generators.feed import concurrent_stream

if TYPE_CHECKING:
    from asyncrl.environments.host import EnvHost
    from asyncrl.generators.base import GeneratorContext, Rollout
    from asyncrl.generators.feed import SampleFeed
    from asyncrl.messages import PromptTask


def stop_token_ids(tokenizer: Any, texts: list[str]) -> dict[int, str]:
    """id -> text of each `env.stop_tokens` entry; ValueError when one is not a single token."""
    out = {}
    for text in texts:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) != 1:
            raise ValueError(
                f"env.stop_tokens: {text!r} is {len(ids)} tokens of the model's tokenizer ({ids}); "
                "each stop token must be exactly one token"
            )
        out[ids[0]] = text
    return out


def open_host(ctx: GeneratorContext) -> EnvHost:
    """The environment host of `ctx.env`: worker processes (`env.workers` > 0) or this event loop."""
    from asyncrl.environments.base import EnvironmentContext, resolve_environment

    env = ctx.env
    factory = resolve_environment(env.kind)
    env_ctx = EnvironmentContext(options=dict(env.options), model_path=ctx.model_path)
    if env.workers:
        from asyncrl.environments.pool import ProcessPoolHost

        return ProcessPoolHost(env, env_ctx, run_dir=ctx.run_dir, name=ctx.generator_id)
    from asyncrl.environments.host import InProcessHost

    return InProcessHost(factory, env_ctx, timeout_s=env.step_timeout_s)


class Episodes:
    """A generator's agentic side (`env.kind` set): its runner, and the stream of episodes."""

    def __init__(self, ctx: GeneratorContext, backend: Any, tokenizer: Any, *, max_context: int = 0) -> None:
        self.runner = EpisodeRunner(
            backend,
            open_host(ctx),
            tokenizer,
            Budgets.from_config(ctx.env, max_context=max_context),
            stop_texts=stop_token_ids(tokenizer, list(ctx.env.stop_tokens)),
            counters=EnvCounters(),
        )
        self.max_episodes = ctx.env.max_episodes
        self.run_seed = ctx.run_seed

    def seed_of(self, draw: Any) -> int:
        from asyncrl.models.sampling import sample_seed

        return sample_seed(self.run_seed, draw.task.group_id, draw.sample_index, draw.task.attempt)

    def stream(self, feed: SampleFeed) -> AsyncIterator[list[Rollout]]:
        return episode_stream(feed, self.runner, max_episodes=self.max_episodes, seed_of=self.seed_of)

    async def generate(
        self, tasks: Sequence[PromptTask], stream: Callable[[SampleFeed], Any]
    ) -> list[Rollout]:
        """Every sample of `tasks` as an episode, through `stream` (the generator's own)."""
        from asyncrl.generators.feed import SampleFeed

        feed = SampleFeed()
        feed.put(tasks)
        return [r async for batch in stream(feed) for r in batch]

    def counters(self) -> dict[str, float]:
        host_counts = getattr(
            self.runner.host, "counter_values", dict
        )()  # a pool's workers started, killed, ...
        return {**self.runner.counters.values(), **host_counts}

    async def aclose(self) -> None:
        await self.runner.host.aclose()


def episode_stream(
    feed: SampleFeed, runner: EpisodeRunner, *, max_episodes: int, seed_of: Callable[[Any], int]
) -> AsyncIterator[list[Rollout]]:
    """Up to `max_episodes` episodes of `feed`'s samples in flight; each Rollout yielded as its
    episode ends (`feed.concurrent_stream`). An episode that raises (a backend failure, never
    its environment's) ends the stream with its error."""
    return concurrent_stream(
        feed, max_episodes, lambda d: runner.run(d.task, d.sample_index, seed_of(d)), label="episode"
    )


class TorchTurnServer:
    """Decodes turns for the torch generator on one thread, with continuous batching.

    `turn` (on the event loop) queues a request and awaits its output; the thread adds queued
    turns to its `Sampler` between decode steps (up to `capacity` rows; turns with other sampling
    params wait until the batch empties), steps, and resolves each finished turn's future. New
    weights are applied between decode steps (the Sampler's `poll_update`, `weights.inflight`
    per turn) and before a turn joins an empty batch. A turn longer than its request's budget (the
    batch decodes up to the sampling's `max_new_tokens`) is cut to its budget, finish "length".
    """

    def __init__(self, gen: Any, *, stop_ids: list[int], capacity: int) -> None:
        self.gen = gen
        self.stop_ids = stop_ids
        self.capacity = capacity
        self._cond = threading.Condition()
        self._queue: deque[tuple[TurnRequest, asyncio.Future, asyncio.AbstractEventLoop]] = deque()
        self._stopped = False
        self._thread: threading.Thread | None = None
        self._decoding: dict[int, tuple] = {}  # id(future) -> key, of the turns in the Sampler
        self.idle_s = 0.0  # time the thread had no turn to decode (benchmarks: generator idle fraction)

    @property
    def version(self) -> int:
        return self.gen.version

    def start(self) -> None:
        """Start the decoding thread (once per stream; `stop` ends it)."""
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="torch-turns", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def wake(self) -> None:
        """New weights were offered: an idle thread applies them now."""
        with self._cond:
            self._cond.notify_all()

    async def turn(self, request: TurnRequest) -> TurnOutput:
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        with self._cond:
            if self._stopped:
                raise RuntimeError("the torch turn server is stopped")
            self._queue.append((request, fut, loop))
            self._cond.notify_all()
        return await fut

    def _take(self, running: int, params) -> list[tuple[TurnRequest, asyncio.Future, Any]]:
        """Queued turns that join the batch now (called with the lock held)."""
        out = []
        while self._queue and running + len(out) < self.capacity:
            req = self._queue[0][0]
            if params is not None and running and req.sampling != params:
                break
            if out and req.sampling != out[0][0].sampling:
                break
            out.append(self._queue.popleft())
        return out

    def _run(self) -> None:
        import torch

        sampler = params = None
        try:
            with torch.no_grad():
                while True:
                    running = 0 if sampler is None else sampler.num_running
                    with self._cond:
                        if not self._stopped and not self._queue and running == 0:
                            began = time.perf_counter()
                            self._cond.wait()  # a turn, new weights or stop wakes it
                            self.idle_s += time.perf_counter() - began
                        if self._stopped:
                            break
                        joining = self._take(running, params)
                    if running == 0:
                        # Nothing decoding: a safe point for offered weights (outside the lock, so
                        # `turn` on the event loop never waits for a weights copy or the canary).
                        self.gen.apply_pending()
                    if joining:
                        sampler, params = self._admit(joining, sampler, params, running)
                    if sampler is not None and sampler.num_running:
                        for done in sampler.step():
                            self._resolve(done)
        except BaseException as exc:  # the model failed: every waiting episode gets the error
            self._fail_all(exc)
            raise

    def _admit(self, joining, sampler, params, running: int):
        """Add `joining` turns to the batch (a new Sampler when the batch is empty and they sample
        with other params); the sampler and its params."""
        from asyncrl.models.sampling import SampleRequest

        if running == 0 and params != joining[0][0].sampling:
            params = joining[0][0].sampling
            sampler = self.gen.turn_sampler(params, self.stop_ids)
        self._decoding.update((id(key[1]), key) for key in joining)
        sampler.add([SampleRequest(key, key[0].ids, key[0].seed) for key in joining])
        return sampler, params

    def _resolve(self, done) -> None:
        self._decoding.pop(id(done.key[1]), None)
        req, fut, loop = done.key
        n = min(len(done.completion_ids), req.max_new_tokens)
        finish = done.finish_reason if n == len(done.completion_ids) else "length"
        out = TurnOutput(done.completion_ids[:n], done.logprobs[:n], done.versions[:n], finish)
        loop.call_soon_threadsafe(_set_result, fut, out)

    def _fail_all(self, exc: BaseException) -> None:
        with self._cond:
            self._stopped = True
            waiting = list(self._queue)
            self._queue.clear()
        for _, fut, loop in [*waiting, *self._decoding.values()]:
            loop.call_soon_threadsafe(_set_exception, fut, exc)


def _set_result(fut: asyncio.Future, value: Any) -> None:
    if not fut.done():
        fut.set_result(value)


def _set_exception(fut: asyncio.Future, exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(RuntimeError(f"the torch turn server failed: {exc!r}"))
