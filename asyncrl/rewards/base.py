"""The reward seam: what a reward sees (`RewardInput`), what it returns, and how a config entry
becomes a callable.

Data flow: a generator finishes a batch of completions -> one `RewardInput` per sample ->
`Scorer` (scorer.py) runs every `task.rewards[i]` over the batch -> a `Score` per sample rides on
its Trajectory. A reward is one of three shapes, told apart once at resolution (`reward_mode`):

- sync   `fn(sample: RewardInput) -> float`        (a thread, or the worker pool in pool.py)
- async  `async def fn(sample) -> float`            (awaited on the generator's loop)
- batch  an object with `async score_batch(samples) -> list[float]` (remote.py is one)

Resolution (`resolve_reward`): a registry name (entry point group `asyncrl.rewards`) is a
factory called with `**options`; a `pkg.mod:fn` path is the reward itself when `options` is
empty, else a factory called with `**options`. Nothing is looked up at import.
"""

from __future__ import annotations

import inspect
import math
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from asyncrl.config_sections import RewardConfig, TaskConfig
from asyncrl.plugins import load_plugin

ENTRY_POINT_GROUP = "asyncrl.rewards"

RewardMode = Literal["sync", "async", "batch"]
FailureKind = Literal["timeout", "raised", "invalid"]


@dataclass(frozen=True, slots=True)
class RewardInput:
    """One finished sample, as every reward sees it."""

    prompt: str
    completion: str
    answer: str  # the ground truth (task.dataset.answer_field)
    extras: Mapping[str, Any]  # the row's task.dataset.extra_fields
    num_tokens: int  # completion tokens
    finish_reason: str  # "stop" | "length" | "abort"
    max_new_tokens: int  # the sampling cap this completion ran under


@dataclass(frozen=True, slots=True)
class RewardFailure:
    """One reward call that produced no usable number; it scores 0 and is counted by the caller."""

    kind: FailureKind
    detail: str

    def describe(self) -> str:
        """`timeout`, `raised: <detail>` or `invalid: <detail>` (Score.failures values)."""
        return self.kind if self.kind == "timeout" else f"{self.kind}: {self.detail}"


def reward_name(cfg: RewardConfig) -> str:
    """The reward's name in metrics and summaries: `name`, or its `kind` when unnamed."""
    return cfg.name or cfg.kind


def reward_mode(reward: Any) -> RewardMode:
    """Which of the three reward shapes `reward` is (see the module docstring)."""
    if callable(getattr(reward, "score_batch", None)):
        return "batch"
    # an async def, or an object whose class defines `async def __call__`
    call = next((k.__dict__["__call__"] for k in type(reward).__mro__ if "__call__" in k.__dict__), None)
    if inspect.iscoroutinefunction(reward) or inspect.iscoroutinefunction(call):
        return "async"
    return "sync"


def is_cheap(reward: Any) -> bool:
    """True for rewards that declare themselves cheap and pure (`fn.asyncrl_cheap = True`)."""
    return bool(getattr(reward, "asyncrl_cheap", False))


def check_value(value: Any) -> float | RewardFailure:
    """A reward's return value as a float, or the `invalid` failure that says why it is not one."""
    if isinstance(value, numbers.Real):  # int, float, bool, Fraction, numpy scalars
        number = float(value)
        if math.isfinite(number):
            return number
        return RewardFailure("invalid", f"returned {number} (rewards must be finite)")
    return RewardFailure("invalid", f"returned {type(value).__name__} {value!r:.80}, not a number")


def describe_exception(exc: BaseException) -> str:
    """`ValueError: message`, cut to a length that fits a metric record."""
    text = f"{type(exc).__name__}: {exc}"
    return text if len(text) <= 500 else text[:497] + "..."


def _field(index: int | None) -> str:
    return f"task.rewards[{index}]" if index is not None else "task.rewards[]"


def _option_names(factory: Any) -> str:
    try:
        params = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError):
        return "(unknown)"
    names = [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    return ", ".join(names) or "(none)"


def resolve_reward(cfg: RewardConfig, *, index: int | None = None) -> Any:
    """The reward `cfg` names, built with its options; ValueError naming the config key if not."""
    field = _field(index)
    try:
        target = load_plugin(ENTRY_POINT_GROUP, cfg.kind, field=f"{field}.kind", what="reward")
    except ValueError as exc:
        message = str(exc)
        raise ValueError(message if field in message else f"{field}.kind: {message}") from None
    if ":" in cfg.kind and not cfg.options:
        reward = target
    else:
        if not callable(target):
            raise ValueError(f"{field}.kind = {cfg.kind!r} is not a callable reward factory")
        try:
            reward = target(**cfg.options)
        except Exception as exc:  # a factory's rejection of its options, reported as a config error
            raise ValueError(
                f"{field}.options {dict(cfg.options)!r} rejected by reward {cfg.kind!r}: "
                f"{describe_exception(exc)} (its options: {_option_names(target)})"
            ) from None
    if not (callable(reward) or reward_mode(reward) == "batch"):
        raise ValueError(
            f"{field}.kind = {cfg.kind!r} resolved to {type(reward).__name__}, which is neither "
            "fn(sample) -> float, an async fn, nor an object with async score_batch(samples); "
            "with options set, a 'pkg.mod:fn' path must be a factory that returns one"
        )
    return reward


def check_rewards(section: TaskConfig) -> None:
    """Config-load check of `task.rewards` and `task.scoring`: every reward resolves, names are
    unique, weights finite, `runs_in` fits the reward's shape and `eval_reward` names a reward."""
    seen: dict[str, int] = {}
    for i, cfg in enumerate(section.rewards):
        if not math.isfinite(cfg.weight):
            raise ValueError(f"task.rewards[{i}].weight = {cfg.weight} must be a finite number")
        reward = resolve_reward(cfg, index=i)
        mode = reward_mode(reward)
        if mode != "sync" and cfg.runs_in != "auto":
            raise ValueError(
                f"task.rewards[{i}].runs_in = {cfg.runs_in!r} applies to sync rewards only; "
                f"{cfg.kind!r} is {'an async' if mode == 'async' else 'a batch'} reward awaited on the "
                "generator's event loop: remove runs_in"
            )
        name = reward_name(cfg)
        if name in seen:
            raise ValueError(
                f"task.rewards[{i}] is named {name!r} like task.rewards[{seen[name]}]; "
                f"set a distinct task.rewards[{i}].name"
            )
        seen[name] = i
    eval_reward = section.scoring.eval_reward
    if eval_reward and eval_reward not in seen:
        names = ", ".join(seen) or "(no task.rewards configured)"
        raise ValueError(f"task.scoring.eval_reward = {eval_reward!r} names no reward; valid: {names}")


def in_slices(items: Sequence[Any], size: int) -> list[Sequence[Any]]:
    """`items` cut into consecutive slices of at most `size`."""
    return [items[i : i + size] for i in range(0, len(items), size)]
