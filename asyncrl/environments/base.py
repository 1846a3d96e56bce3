"""The Environment seam: what an agentic episode talks to between the model's turns.

Place in the data flow: a generator's episode runner (`generators/episode_runner.py`) owns one episode per sample.
It calls `reset(start)` once, then, after each model turn, `step(action)`; the environment answers
with an `Observation` (appended to the episode as masked token ids), a reward contribution and
whether the episode is done. An environment instance serves one episode at a time (it may keep
per-episode state on itself): the host (`host.py`: in-process, or `pool.py`: worker processes)
makes one instance per episode with the factory the registry gives.

Plugins: a registry name of the entry-point group `asyncrl.environments` or a `pkg.mod:obj` path
in `env.kind`; the object is called with an `EnvironmentContext` and returns an `Environment`.
Lookup happens when the generator starts (and in `asyncrl launch` before any process starts).
The values crossing the seam are msgspec Structs, so a pool worker can send them over its pipe.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import msgspec

from asyncrl.plugins import available, load_plugin

ENTRY_POINT_GROUP = "asyncrl.environments"


class EpisodeStart(msgspec.Struct, frozen=True, kw_only=True):
    """What `reset` gets: the problem of the episode's prompt (the task's rendering of it is
    already the start of the token stream) and the sample it is."""

    prompt: str  # the prompt as text (decoded prompt ids)
    answer: str
    extras: dict[str, Any] = {}
    task_id: int = 0
    sample_index: int = 0
    seed: int = 0  # per sample: derived from run.seed, group and sample index


class Observation(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """What the environment shows the model next; at most one of the three forms.

    `ids`: token ids, appended exactly as given (the environment knows the tokenizer).
    `text`: plain text, tokenised on its own (no special tokens added) and appended.
    `messages`: chat messages ({"role": "tool" | "user" | "system", "content": ...}), rendered
    with the tokenizer's chat template as the continuation of the conversation (`render.py`).
    All empty: nothing is appended (the model takes the next turn right after its own).
    """

    ids: list[int] | None = None
    text: str | None = None
    messages: list[dict[str, str]] | None = None


class Action(msgspec.Struct, frozen=True, kw_only=True):
    """One model turn as the environment sees it: the sampled ids, their text (special tokens
    kept, so an end-of-turn marker is visible), why the turn ended, and the turn's number."""

    ids: list[int]
    text: str
    finish_reason: str  # "stop" (eos or a stop token) or "length" (the turn's token budget)
    turn: int  # 0 for the first model turn
    stop: str = ""  # the token that ended the turn (eos or a stop token, as text); "" at "length"


class StepResult(msgspec.Struct, frozen=True, kw_only=True):
    """The environment's answer to an action. `reward` is added to the episode's reward."""

    observation: Observation = Observation()
    reward: float = 0.0
    done: bool = False
    info: dict[str, float] = {}  # numbers summed into the generator's env/ metrics


class EnvironmentContext(msgspec.Struct, frozen=True, kw_only=True):
    """What an environment factory gets: its options (`env.options`), the model directory (to
    load the tokenizer when it answers with ids) and, in a pool worker, its private directory."""

    options: dict[str, Any] = {}
    model_path: str = ""
    workdir: str = ""  # a private temporary directory ("" = none; in-process hosts)


@runtime_checkable
class Environment(Protocol):
    """Implement these two to plug in an environment (a tool-using task, a game, a judge)."""

    async def reset(self, start: EpisodeStart) -> Observation:
        """Begin an episode; the observation (often empty) follows the prompt."""

    async def step(self, action: Action) -> StepResult:
        """The environment's answer to one model turn."""


def available_environments() -> dict[str, str]:
    """Registry name -> `module:object` for every installed environment plugin."""
    return available(ENTRY_POINT_GROUP)


def resolve_environment(kind: str) -> Any:
    """The environment factory for a registry name or a `pkg.mod:obj` path; ValueError if unknown."""
    return load_plugin(ENTRY_POINT_GROUP, kind, field="env.kind", what="environment")


def make_environment(factory: Any, ctx: EnvironmentContext) -> Environment:
    """One environment from `factory(ctx)`; ValueError when what it returns is not one."""
    env = factory(ctx)
    if not isinstance(env, Environment):
        raise ValueError(
            f"environment plugin {factory!r} returned {type(env).__name__}, which is not an Environment "
            "(it needs async reset(start) and async step(action); asyncrl/environments/base.py)"
        )
    return env
