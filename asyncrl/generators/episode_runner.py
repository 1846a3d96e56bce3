"""The episode runner: one sample as a multi-turn episode over one token stream, on any backend.

Place in the data flow: a generator (torch or sglang) hands each `Draw` it takes from its feed to
`EpisodeRunner.run`, which returns one `Rollout`. The runner knows no backend: it asks a
`TurnBackend` for "the next turn from these ids" (the backend decodes until eos, a stop token or
the turn's budget, and gives each sampled token's behavior log-prob and policy_version), and an
`EnvHost` (`host.py`, `pool.py`) for the environment's answer. Many episodes run at once as
coroutines; an episode waiting on its environment holds no decoding slot.

Token fidelity: the episode is `prompt_ids + completion`, where the completion is the model's
tokens exactly as sampled and each observation's ids exactly as rendered once (`render.py`);
nothing is ever decoded and tokenised again, so the learner scores the very ids the model sampled
in. Per completion token:
  model tokens        behavior log-prob and version from the backend, loss_mask True
  environment tokens  log-prob 0.0, the version of the model token before them, loss_mask False
(an environment token's version never lowers the episode's oldest version, so the staleness
bound holds per token).

Budgets (`env.max_turns`, `env.max_tokens`, `env.max_episode_s`, and the model's context) end an
episode with finish_reason "length" and the reward gathered so far; each reason is counted.
Environment failures (`host.EnvFailure`) are counted by kind; the episode is retried from its start
(`env.on_failure = "retry"`, fresh seeds, at most `env.max_retries` times) or failed: a failed
episode is sent with reward `env.failure_reward`, finish_reason "abort" and no token trained (it
still takes its place in its group, so nothing is lost or duplicated).
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

from asyncrl.environments.base import Action, EpisodeStart, Observation, StepResult
from asyncrl.environments.host import EnvFailure, EnvHost
from asyncrl.environments.render import BadObservation, ObservationRenderer
from asyncrl.generators.base import Rollout
from asyncrl.messages import PromptTask, SamplingParams

log = logging.getLogger(__name__)


class TurnRequest(NamedTuple):
    """Decode one model turn after `ids` (the whole episode so far)."""

    ids: list[int]
    max_new_tokens: int
    seed: int
    sampling: SamplingParams


class TurnOutput(NamedTuple):
    ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: str  # "stop" (eos or a stop token) or "length"


class TurnBackend(Protocol):
    """What a generator backend gives the runner: one turn at a time, many concurrently."""

    @property
    def version(self) -> int: ...

    async def turn(self, request: TurnRequest) -> TurnOutput: ...


@dataclass(frozen=True, kw_only=True)
class Budgets:
    """Per-episode limits (the `env` config section) and the model's context (0 = unknown)."""

    max_turns: int = 8
    max_tokens: int = 256
    max_episode_s: float = 300.0
    max_context: int = 0
    on_failure: str = "retry"
    max_retries: int = 1
    failure_reward: float = 0.0

    @classmethod
    def from_config(cls, env: Any, *, max_context: int = 0) -> Budgets:
        return cls(
            max_turns=env.max_turns,
            max_tokens=env.max_tokens,
            max_episode_s=env.max_episode_s,
            max_context=max_context,
            on_failure=env.on_failure,
            max_retries=env.max_retries,
            failure_reward=env.failure_reward,
        )


@dataclass
class EnvCounters:
    """Cumulative episode counters of one generator, reported as `env/<name>` metrics."""

    counts: Counter = field(default_factory=Counter)
    env_s: float = 0.0  # time episodes spent waiting on their environment (summed over episodes)

    def add(self, name: str, n: float = 1) -> None:
        self.counts[name] += n

    def values(self) -> dict[str, float]:
        out = {f"env/{k}": float(v) for k, v in sorted(self.counts.items())}
        out["env/env_s"] = self.env_s
        return out


def turn_seed(base_seed: int, turn: int, retry: int) -> int:
    """The seed of one turn: fresh uniforms per turn and per retry, still deterministic."""
    digest = hashlib.sha256(f"{base_seed}:turn{turn}:retry{retry}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


@dataclass
class _Stream:
    """The completion so far: ids, behavior log-probs, versions, loss mask, all aligned."""

    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    mask: list[bool] = field(default_factory=list)
    model_tokens: int = 0
    reward: float = 0.0

    def add_model(self, out: TurnOutput) -> None:
        self.ids += out.ids
        self.logprobs += out.logprobs
        self.versions += out.versions
        self.mask += [True] * len(out.ids)
        self.model_tokens += len(out.ids)

    def add_env(self, ids: Sequence[int], version: int) -> None:
        self.ids += ids
        self.logprobs += [0.0] * len(ids)
        self.versions += [self.versions[-1] if self.versions else version] * len(ids)
        self.mask += [False] * len(ids)


class _BudgetEnd(Exception):
    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class EpisodeRunner:
    """Runs episodes on `backend` against `host`; see the module docstring."""

    def __init__(
        self,
        backend: TurnBackend,
        host: EnvHost,
        tokenizer: Any,
        budgets: Budgets,
        *,
        stop_texts: dict[int, str] | None = None,
        counters: EnvCounters | None = None,
    ) -> None:
        self.backend = backend
        self.host = host
        self.tokenizer = tokenizer
        self.renderer = ObservationRenderer(tokenizer)
        self.budgets = budgets
        self.stop_texts = {tokenizer.eos_token_id: tokenizer.eos_token or "", **(stop_texts or {})}
        self.counters = counters if counters is not None else EnvCounters()

    async def run(self, task: PromptTask, sample_index: int, base_seed: int) -> Rollout:
        """The episode of sample `sample_index` of `task`: exactly one Rollout, whatever happens."""
        start = EpisodeStart(
            prompt=self.tokenizer.decode(task.prompt_ids, skip_special_tokens=True),
            answer=task.answer,
            extras=dict(task.extras),
            task_id=task.task_id,
            sample_index=sample_index,
            seed=base_seed,
        )
        self.counters.add("episodes")
        retry = 0
        while True:
            stream = _Stream()
            try:
                finish = await self._episode(task, start, stream, seed=base_seed, retry=retry)
            except EnvFailure as exc:
                self.counters.add(f"failures_{exc.kind}")
                if exc.exc_type:
                    self.counters.add(f"errors_{exc.exc_type}")
                if self.budgets.on_failure == "retry" and retry < self.budgets.max_retries:
                    retry += 1
                    self.counters.add("retried")
                    log.warning(
                        "episode of sample %d of task %d: %s; retrying", sample_index, task.task_id, exc
                    )
                    continue
                self.counters.add("failed")
                log.warning("episode of sample %d of task %d failed: %s", sample_index, task.task_id, exc)
                failed = self._failed(task, sample_index, stream)
                self.counters.add("failed_tokens", len(failed.completion_ids))
                return failed
            self.counters.add("model_tokens", stream.model_tokens)  # sent episodes only: the
            self.counters.add("env_tokens", len(stream.ids) - stream.model_tokens)  # trained/masked split
            return Rollout(
                task_id=task.task_id,
                sample_index=sample_index,
                completion_ids=stream.ids,
                behavior_logprobs=stream.logprobs,
                token_versions=stream.versions,
                reward=stream.reward,
                finish_reason=finish,
                loss_mask=stream.mask,
            )

    async def _episode(
        self, task: PromptTask, start: EpisodeStart, stream: _Stream, *, seed: int, retry: int
    ) -> str:
        """Play one episode into `stream`; its finish_reason. EnvFailure when the environment fails."""
        b = self.budgets
        began = time.monotonic()
        handle, first = await self._env_call(self.host.open(start))
        try:
            stream.add_env(self._render(first), self.backend.version)
            for turn in range(b.max_turns):
                try:
                    budget, bound = self._turn_budget(task, stream, began)
                except _BudgetEnd as end:
                    return self._ended(end.reason, stream)
                history = list(task.prompt_ids) + stream.ids
                out = await self.backend.turn(
                    TurnRequest(history, budget, turn_seed(seed, turn, retry), task.sampling)
                )
                stream.add_model(out)
                self.counters.add("turns")
                if bound and out.finish_reason == "length" and len(out.ids) >= budget:
                    return self._ended(bound, stream)  # cut by the episode's budget, not the turn's
                stop = self.stop_texts.get(out.ids[-1], "") if out.ids and out.finish_reason == "stop" else ""
                action = Action(
                    ids=out.ids,
                    text=self.tokenizer.decode(out.ids, skip_special_tokens=False),
                    finish_reason=out.finish_reason,
                    turn=turn,
                    stop=stop,
                )
                result: StepResult = await self._env_call(self.host.step(handle, action))
                stream.reward += float(result.reward)
                for name, value in result.info.items():
                    self.counters.add(f"info_{name}", value)
                if result.done:
                    return "stop" if out.finish_reason == "stop" else "length"
                stream.add_env(self._render(result.observation), self.backend.version)
            return self._ended("turns", stream)
        finally:
            await self.host.close_episode(handle)

    async def _env_call(self, coro):
        began = time.monotonic()
        try:
            return await coro
        finally:
            self.counters.env_s += time.monotonic() - began

    def _render(self, obs: Observation) -> list[int]:
        try:
            return self.renderer.render(obs)
        except BadObservation as exc:
            raise EnvFailure("bad_observation", str(exc)) from None

    def _turn_budget(self, task: PromptTask, stream: _Stream, began: float) -> tuple[int, str]:
        """Model tokens the next turn may take, and which episode budget bounds it ("" when the
        turn's own `max_new_tokens` does); _BudgetEnd when the episode has none left."""
        b = self.budgets
        if time.monotonic() - began > b.max_episode_s:
            raise _BudgetEnd("wall")
        budget, bound = task.sampling.max_new_tokens, ""
        for reason, left in (
            ("tokens", b.max_tokens - stream.model_tokens),
            ("context", b.max_context - len(task.prompt_ids) - len(stream.ids) if b.max_context else budget),
        ):
            if left <= 0:
                raise _BudgetEnd(reason)
            if left < budget:
                budget, bound = left, reason
        return budget, bound

    def _ended(self, reason: str, stream: _Stream) -> str:
        self.counters.add(f"budget_{reason}")
        if not stream.ids or not any(stream.mask):
            raise EnvFailure(
                "error", f"the episode's {reason} budget ended it before the model's first token"
            )
        return "length"

    def _failed(self, task: PromptTask, sample_index: int, stream: _Stream) -> Rollout:
        """A failed episode: its tokens so far, none trained (one masked eos when it has none)."""
        ids = stream.ids or [self.tokenizer.eos_token_id]
        n = len(ids)
        return Rollout(
            task_id=task.task_id,
            sample_index=sample_index,
            completion_ids=ids,
            behavior_logprobs=stream.logprobs or [0.0],
            token_versions=stream.versions or [self.backend.version],
            reward=self.budgets.failure_reward,
            finish_reason="abort",
            loss_mask=[False] * n,
        )
