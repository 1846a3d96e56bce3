"""Loading the config: built-in defaults <- a TOML file <- `--set a.b=c` overrides, then one
`msgspec.convert` into `Config` and the checks that need more than the tree (plugins that must
import, a CUDA device that must exist, CURVE keys on disk, the staleness policy, the settings
linter). Every error is a `ConfigError` naming the key (`learner.lr`) and the fix. The resolved
config is written to the run directory as JSON (`config.json`) and read back exactly.

Place in the data flow: the launcher (`asyncrl launch`), the worker and the benchmarks load here,
once, before any process starts; children read the resolved `config.json`.

Two rules about values, both driven by the schema (`config_sections.py`), so no list of keys is
kept here:
* A relative path written in a config file is relative to the file's directory (as Cargo and
  docker compose read theirs): the keys typed `PathStr` are resolved when the file is read.
  A `--set` value is used as written, so a relative one is relative to the current directory.
* A `--set` value is read by the type of the key it sets: a string key takes the text as written
  (`--set run.name=nan` is the name "nan"); any other key reads it in TOML syntax (1, 0.5, true,
  [1, 2], "x"), a bare word as a string.
"""

from __future__ import annotations

import os
import re
import tomllib
import types
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import msgspec

from asyncrl.config import Config
from asyncrl.config_objective import check_objective_config, check_policy_fit, check_staleness_policy
from asyncrl.config_sections import ClusterConfig, ConfigError, TaskConfig, keys_dir_problem


def load_config(
    path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = (), *, lint: bool = True
) -> Config:
    """Defaults <- TOML file <- overrides, validated once. Raises ConfigError on any mistake (and on
    the settings linter's errors unless `lint` is false: `asyncrl lint` lists them itself)."""
    tree: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {p} does not exist")
        try:
            tree = tomllib.loads(p.read_text())
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {p} is not valid TOML: {exc}") from None
        resolve_file_paths(tree, Path(os.path.abspath(p)).parent)  # lexical, as the shell's `cd ..`
    return config_from_tree(tree, overrides, lint=lint)


def config_from_tree(
    tree: dict[str, Any], overrides: list[str] | tuple[str, ...] = (), *, lint: bool = True
) -> Config:
    """A config tree (parsed TOML, or `config_to_dict` of a config) <- overrides, validated once."""
    for assignment in overrides:
        apply_override(tree, assignment)
    try:
        config = msgspec.convert(tree, Config)
    except msgspec.ValidationError as exc:
        raise ConfigError(_friendly(exc)) from None
    config = resolve_prepared_model(config)
    check_task_kind(config.task)
    check_rewards(config.task)
    check_eval(config)
    check_cuda(config)
    check_cluster(config.cluster)
    policy = check_staleness_policy(config.staleness)
    check_objective_config(config, policy)  # distillation mixing, OPOB
    check_policy_fit(config, policy)  # the policy against the buffer and the learner ranks
    check_lint(config, refuse=lint)
    return config


def resolve_prepared_model(config: Config) -> Config:
    """`model.path = "prepared:NAME"` becomes the prepared directory's path (config.json records
    the path), or a ConfigError naming the command that prepares it."""
    from asyncrl.models.prepare import PREFIX, PrepareError, prepared_dir

    if not config.model.path.startswith(PREFIX):
        return config
    try:
        path = prepared_dir(config.model.path)
    except PrepareError as exc:
        raise ConfigError(str(exc)) from None
    return msgspec.structs.replace(config, model=msgspec.structs.replace(config.model, path=str(path)))


# ------------------------------------------------------------------------------ the schema
def _field_type(path: list[str]) -> Any:
    """The declared type of the key at `path` (`["learner", "lr"]`), or None for no such key.
    Sections, dict values and optional sections are walked through; the last type is as declared."""
    kind: Any = Config
    for i, part in enumerate(path):
        if i:
            kind = _container(kind)
        if isinstance(kind, type) and issubclass(kind, msgspec.Struct):
            kind = {f.name: f.type for f in msgspec.structs.fields(kind)}.get(part)
        elif get_origin(kind) is dict:
            kind = get_args(kind)[1]
        else:
            return None
        if kind is None:
            return None
    return kind


def _container(kind: Any) -> Any:
    """`kind` as something keys can be looked up in: Annotated and `X | None` unwrapped."""
    if get_origin(kind) is Annotated:
        kind = get_args(kind)[0]
    if get_origin(kind) in (Union, types.UnionType):
        members = [m for m in get_args(kind) if m is not type(None)]
        if len(members) == 1:
            return _container(members[0])
    return kind


def _section_at(path: list[str]) -> type[msgspec.Struct] | None:
    kind = _field_type(path) if path else Config
    return kind if isinstance(kind, type) and issubclass(kind, msgspec.Struct) else None


def _path_marker(kind: Any) -> dict[str, Any] | None:
    """The `extra` of a `config_sections.PathStr`-like type, None for a key that is not a path."""
    if get_origin(kind) is not Annotated:
        return None
    for meta in get_args(kind)[1:]:
        if isinstance(meta, msgspec.Meta) and meta.extra and meta.extra.get("path"):
            return meta.extra
    return None


def _struct_items(kind: Any) -> type[msgspec.Struct] | None:
    """The Struct type of a `list[Struct]` key (a list of tables), None for any other key."""
    kind = _container(kind)
    if get_origin(kind) is list and (args := get_args(kind)):
        item = args[0]
        if isinstance(item, type) and issubclass(item, msgspec.Struct):
            return item
    return None


# ------------------------------------------------------------------------------ file paths
def resolve_file_paths(table: dict[str, Any], base: Path, kind: type[msgspec.Struct] = Config) -> None:
    """Make each relative path in `table` (a config file's parsed TOML, or one of its sections)
    relative to `base`, the file's directory, in place. Absolute paths, `~/...`, "" (unset) and a
    key's keywords (opd.teacher = "self") stay as written; keys the schema does not know are left
    for the schema to refuse."""
    fields = {f.name: f.type for f in msgspec.structs.fields(kind)}
    for key, value in table.items():
        declared = fields.get(key)
        section = _container(declared)
        if isinstance(value, dict) and isinstance(section, type) and issubclass(section, msgspec.Struct):
            resolve_file_paths(value, base, section)
        elif isinstance(value, list) and (item := _struct_items(declared)) is not None:
            for entry in value:  # a list of tables (opd.teachers)
                if isinstance(entry, dict):
                    resolve_file_paths(entry, base, item)
        elif isinstance(value, str) and (marker := _path_marker(declared)) is not None:
            keep = not value or value in marker.get("keywords", ()) or value.startswith("~")
            keep = keep or value.startswith(tuple(marker.get("prefixes", ())))
            if not keep and not Path(value).is_absolute():
                table[key] = os.path.normpath(base / value)


# ------------------------------------------------------------------------------ --set
def _parse_value(text: str, kind: Any = None) -> Any:
    """A `--set` value by the type `kind` of the key it sets: a string key takes the text as written
    (`nan`, `true`, `1e3` stay strings; a TOML string `"x"` is unquoted); any other key (numbers,
    booleans, lists, unions, a key the schema does not know) reads it in TOML syntax, bare words as
    strings."""
    try:
        value = tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text
    if get_origin(kind) is Annotated:
        kind = get_args(kind)[0]
    if kind is str and not isinstance(value, str):
        return text
    return value


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
    node[parts[-1]] = _parse_value(value.strip(), _field_type(parts))


# ------------------------------------------------------------------------------ errors and checks
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


def check_lint(config: Config, *, refuse: bool = True) -> None:
    """`run.allow_unsafe` names real rules; with `refuse`, the settings linter's errors refuse the
    config (asyncrl/lint.py, docs/safety.md)."""
    from asyncrl.lint import check_allowed, lint

    try:
        check_allowed(config.run.allow_unsafe)
    except ValueError as exc:
        raise ConfigError(f"config error at run.allow_unsafe: {exc}") from None
    errors = [f for f in lint(config) if f.level == "error"] if refuse else []
    if errors:
        first = errors[0]
        raise ConfigError(
            f"config error at {first.key}: {first.problem}; {first.fix} (or accept the risk: "
            f"--set 'run.allow_unsafe=[\"{first.rule}\"]'; docs/safety.md)"
            + "".join(f"\n  also: {f.line()}" for f in errors[1:])
        )


def check_cuda(config: Config) -> None:
    """A device set to 'cuda' on a host without one fails at load time, naming the key. (Not
    `learner.device`: learner ranks started by torchrun may run on other hosts; each rank checks.)"""
    cuda_keys = [
        key
        for key, setting, used in (
            ("generators.device", config.generators.device, config.generators.kind == "torch"),
            ("task.eval_device", config.task.eval_device, config.task.num_eval > 0),
        )
        if used and setting == "cuda"
    ]
    if cuda_keys:
        import torch  # only when a GPU is asked for: CPU configs and --help stay torch-free

        if not torch.cuda.is_available():
            raise ConfigError(
                f"config error at {cuda_keys[0]}: 'cuda' but torch sees no CUDA device on this host; "
                f"use --set {cuda_keys[0]}=cpu, or auto (a GPU only where there is one)"
            )


def check_cluster(section: ClusterConfig) -> None:
    """With CURVE on, `cluster.keys_dir` holds the run's keys (checked on the host that loads the
    config; every process checks its own files again when it starts)."""
    if section.curve_enabled and (problem := keys_dir_problem(section.keys_dir)):
        raise ConfigError(f"config error at cluster.keys_dir: {problem}")


def check_eval(config: Config) -> None:
    """Background evaluation needs held-out problems and versions to evaluate."""
    every = config.eval.every
    if every and not config.task.num_eval:
        raise ConfigError(
            f"eval.every = {every} evaluates held-out problems, and task.num_eval = 0 holds none out; "
            "set task.num_eval, or eval.every = 0"
        )


def check_task_kind(section: TaskConfig) -> None:
    """A misspelled task name (or a plugin that does not import) fails at load time."""
    from asyncrl.plugins import load_plugin
    from asyncrl.tasks.base import ENTRY_POINT_GROUP

    try:
        load_plugin(ENTRY_POINT_GROUP, section.kind, field="task.kind", what="task")
    except ValueError as exc:
        raise ConfigError(f"config error at task.kind: {exc}") from None


def check_rewards(section: TaskConfig) -> None:
    """Each of task.rewards resolves (a misspelled name, a bad pattern, a bad URL) at load time."""
    if not section.rewards:
        if section.scoring.eval_reward:
            raise ConfigError(
                f"config error at task.scoring.eval_reward: {section.scoring.eval_reward!r} names a reward, "
                "but task.rewards is empty; add the reward or remove eval_reward"
            )
        return
    from asyncrl.rewards.base import check_rewards as check

    try:
        check(section)
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"config error at task.rewards: {exc}") from None


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
