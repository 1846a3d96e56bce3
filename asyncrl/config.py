"""One typed config tree, validated once at load time.

Sources, in order: built-in defaults, a TOML file, `--set a.b=c` overrides; then one
`msgspec.convert` into `Config`. Every error names the field path (`$.learner.lr`) and says how to
fix it. Each component receives only its own sub-tree. The resolved config is written to the run
directory as `config.toml`-compatible JSON (`config.json`).
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal, get_args, get_origin

import msgspec
from msgspec import Meta

PosInt = Annotated[int, Meta(gt=0)]
NonNegInt = Annotated[int, Meta(ge=0)]
PosFloat = Annotated[float, Meta(gt=0)]
Probability = Annotated[float, Meta(gt=0, le=1)]


class ConfigError(ValueError):
    """A user mistake in the configuration; the message names the field and the fix."""


class _Section(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    pass


class RunConfig(_Section, frozen=True, kw_only=True):
    name: str = ""  # run directory name; empty = a timestamp
    out_dir: str = "runs"  # parent of run directories
    seed: int = 0


class ModelConfig(_Section, frozen=True, kw_only=True):
    path: str = ""  # local Hugging Face directory; empty = the embedded default checkpoint


class TaskConfig(_Section, frozen=True, kw_only=True):
    kind: Literal["addition"] = "addition"
    max_operand: PosInt = 99
    seed: int = 1  # prompt stream seed (training prompts)
    num_eval: NonNegInt = 500  # held-out prompts for greedy accuracy before/after (0 = skip)
    eval_seed: int = 2  # held-out stream seed, disjoint from training by construction


class SamplingConfig(_Section, frozen=True, kw_only=True):
    temperature: Annotated[float, Meta(ge=0)] = 1.0
    top_p: Probability = 1.0
    max_new_tokens: PosInt = 5


class GeneratorConfig(_Section, frozen=True, kw_only=True):
    kind: str = "torch"  # registry name (entry point `asyncrl.generators`) or `pkg.mod:obj`
    num_generators: PosInt = 1
    max_batch_groups: PosInt = 16  # groups sampled together in one batched generate call
    threads: PosInt = 1  # torch intra-op threads per generator process


class LearnerConfig(_Section, frozen=True, kw_only=True):
    steps: PosInt = 60  # optimizer steps (= final policy_version)
    groups_per_step: PosInt = 32
    samples_per_group: Annotated[int, Meta(ge=2)] = 8
    lr: PosFloat = 3e-4
    weight_decay: Annotated[float, Meta(ge=0)] = 0.0
    max_grad_norm: PosFloat = 1.0
    clip_low: Annotated[float, Meta(ge=0)] = 0.2
    clip_high: Annotated[float, Meta(ge=0)] = 0.2
    advantage: Literal["grpo"] = "grpo"
    micro_batch_size: PosInt = 256  # sequences per forward/backward
    threads: PosInt = 1


class StalenessConfig(_Section, frozen=True, kw_only=True):
    max_staleness: NonNegInt = 2  # versions between the token's policy and the step that trains on it
    policy: str = "none"  # off-policy correction; see docs/staleness.md for names and parameters
    params: dict[str, float | int | bool | str] = {}  # keyword parameters of the policy


class WeightsConfig(_Section, frozen=True, kw_only=True):
    transport: Literal["safetensors"] = "safetensors"
    dir: str = ""  # empty = <run_dir>/weights (use /dev/shm/... for speed on one host)
    keep_last: PosInt = 2


class MonitorConfig(_Section, frozen=True, kw_only=True):
    tui: bool = True  # live rich view when stdout is a terminal
    heartbeat_s: PosFloat = 1.0
    # A child silent for this long (no heartbeat, no message) is hung: the run stops with an error.
    heartbeat_timeout_s: PosFloat = 60.0


class Config(_Section, frozen=True, kw_only=True):
    mode: Literal["async", "sync"] = "async"
    run: RunConfig = RunConfig()
    model: ModelConfig = ModelConfig()
    task: TaskConfig = TaskConfig()
    sampling: SamplingConfig = SamplingConfig()
    generators: GeneratorConfig = GeneratorConfig()
    learner: LearnerConfig = LearnerConfig()
    staleness: StalenessConfig = StalenessConfig()
    weights: WeightsConfig = WeightsConfig()
    monitor: MonitorConfig = MonitorConfig()

    def __post_init__(self) -> None:
        if self.learner.clip_low >= 1.0:
            raise ValueError("learner.clip_low must be < 1 (the ratio's lower bound is 1 - clip_low)")

    @property
    def effective_max_staleness(self) -> int:
        """`sync` mode is strictly on-policy whatever the configured bound."""
        return 0 if self.mode == "sync" else self.staleness.max_staleness


def _parse_value(text: str) -> Any:
    """A `--set` value in TOML syntax (1, 0.5, true, "x", [1, 2]); bare words are strings."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def apply_override(tree: dict[str, Any], assignment: str) -> None:
    key, sep, value = assignment.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"--set {assignment!r}: expected KEY=VALUE, e.g. --set learner.lr=3e-4")
    parts = [p for p in key.strip().split(".") if p]
    node = tree
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"--set {assignment!r}: {'.'.join(parts[:-1])} is a value, not a section")
        node = child
    node[parts[-1]] = _parse_value(value.strip())


def _section_at(path: list[str]) -> type[msgspec.Struct] | None:
    kind: Any = Config
    for part in path:
        fields = {f.name: f.type for f in msgspec.structs.fields(kind)}
        kind = fields.get(part)
        if not (isinstance(kind, type) and issubclass(kind, msgspec.Struct)):
            return None
    return kind


def _field_type(path: list[str]) -> Any:
    section = _section_at(path[:-1])
    if section is None:
        return None
    return {f.name: f.type for f in msgspec.structs.fields(section)}.get(path[-1])


def _friendly(err: msgspec.ValidationError) -> str:
    text = str(err)
    message, _, where = text.rpartition(" - at `")
    if not _:
        message, where = text, "$"
    path = [p for p in where.rstrip("`").removeprefix("$").split(".") if p]
    unknown = re.match(r"Object contains unknown field `(.+)`", message)
    if unknown:
        section = _section_at(path)
        valid = ", ".join(f.name for f in msgspec.structs.fields(section)) if section else ""
        key = ".".join([*path, unknown.group(1)])
        return f"config error: unknown key {key!r}; valid keys here: {valid}"
    if message.startswith("Invalid enum value"):
        kind = _field_type(path)
        choices = ", ".join(repr(c) for c in get_args(kind)) if get_origin(kind) is Literal else ""
        return f"config error at {'.'.join(path)}: {message}; valid values: {choices}"
    if not path:
        return f"config error: {message}"
    return f"config error at {'.'.join(path)}: {message}"


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Defaults <- TOML file <- overrides, validated once. Raises ConfigError on any mistake."""
    tree: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {p} does not exist")
        try:
            tree = tomllib.loads(p.read_text())
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {p} is not valid TOML: {exc}") from None
    for assignment in overrides:
        apply_override(tree, assignment)
    try:
        config = msgspec.convert(tree, Config)
    except msgspec.ValidationError as exc:
        raise ConfigError(_friendly(exc)) from None
    check_staleness_policy(config.staleness)
    return config


# Optional policy inputs the learner computes today ("prox" is the step-start forward).
LEARNER_PROVIDES = ("prox",)


def check_staleness_policy(section: StalenessConfig):
    """Build the configured policy once, so a misspelled name or parameter fails at load time."""
    from asyncrl.staleness.registry import make_policy

    try:
        policy = make_policy(section.policy, **section.params)
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"config error at staleness.policy: {exc}") from None
    missing = [n for n in policy.needs if n not in LEARNER_PROVIDES]
    if missing:
        raise ConfigError(
            f"config error at staleness.policy: {section.policy!r} needs {', '.join(missing)} log-probs, "
            "which the learner does not compute yet; choose another policy"
        )
    return policy


def config_to_dict(config: Config) -> dict[str, Any]:
    return msgspec.to_builtins(config)


def write_resolved_config(config: Config, path: Path) -> None:
    """The resolved config as JSON; `load_resolved_config` reads it back exactly."""
    path.write_bytes(msgspec.json.format(msgspec.json.encode(config), indent=2) + b"\n")


def load_resolved_config(path: Path) -> Config:
    try:
        return msgspec.json.decode(Path(path).read_bytes(), type=Config)
    except (OSError, msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise ConfigError(f"resolved config {path} cannot be read: {exc}") from None
