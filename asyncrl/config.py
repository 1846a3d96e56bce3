"""One typed config tree, validated once at load time.

Sources, in order: built-in defaults, a TOML file, `--set a.b=c` overrides; then one
`msgspec.convert` into `Config`. Every error names the field path (`$.learner.lr`) and says how to
fix it. Each component receives only its own sub-tree. The resolved config is written to the run
directory as `config.toml`-compatible JSON (`config.json`). The sections themselves (one Struct per
`[section]`, each key's default and comment) are in `config_sections.py`; import them from here.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import msgspec

from asyncrl.config_objective import check_objective_config
from asyncrl.config_sections import (
    LOOPBACK_HOSTS,
    BufferConfig,
    ClusterConfig,
    ConfigError,
    DatasetConfig,
    GeneratorConfig,
    LearnerConfig,
    LoraConfig,
    ModelConfig,
    MonitorConfig,
    NonNegInt,
    OpdConfig,
    PosFloat,
    PosInt,
    Probability,
    PromptConfig,
    RewardConfig,
    RunConfig,
    SamplingConfig,
    ScoringConfig,
    StalenessConfig,
    TaskConfig,
    WeightsConfig,
    _Section,
    is_loopback_host,
)

# The sections live in config_sections.py; everything is imported from here.
__all__ = [
    "BufferConfig",
    "ClusterConfig",
    "Config",
    "ConfigError",
    "DatasetConfig",
    "GeneratorConfig",
    "LOOPBACK_HOSTS",
    "LearnerConfig",
    "LoraConfig",
    "ModelConfig",
    "MonitorConfig",
    "NonNegInt",
    "OpdConfig",
    "PosFloat",
    "PosInt",
    "Probability",
    "PromptConfig",
    "RewardConfig",
    "RunConfig",
    "SERVER_PUBLIC_KEY",
    "SamplingConfig",
    "ScoringConfig",
    "StalenessConfig",
    "TaskConfig",
    "WeightsConfig",
    "apply_override",
    "check_cluster",
    "check_cuda",
    "check_rewards",
    "check_staleness_policy",
    "check_task_kind",
    "config_from_tree",
    "config_to_dict",
    "is_loopback_host",
    "keys_dir_problem",
    "load_config",
    "load_resolved_config",
    "needs_one_rank",
    "write_resolved_config",
]


class Config(_Section, frozen=True, kw_only=True):
    mode: Literal["async", "sync"] = "async"
    run: RunConfig = RunConfig()
    model: ModelConfig = ModelConfig()
    task: TaskConfig = TaskConfig()
    sampling: SamplingConfig = SamplingConfig()
    generators: GeneratorConfig = GeneratorConfig()
    learner: LearnerConfig = LearnerConfig()
    staleness: StalenessConfig = StalenessConfig()
    opd: OpdConfig = OpdConfig()
    buffer: BufferConfig = BufferConfig()
    weights: WeightsConfig = WeightsConfig()
    monitor: MonitorConfig = MonitorConfig()
    cluster: ClusterConfig = ClusterConfig()

    def __post_init__(self) -> None:
        lrn = self.learner
        clip_low, _ = lrn.clip_range()
        if clip_low > 1.0 or (clip_low == 1.0 and lrn.loss != "cispo"):
            raise ValueError("learner.clip_low must be < 1 (the ratio's lower bound is 1 - clip_low)")
        if lrn.dual_clip is not None and lrn.loss != "ppo":
            raise ValueError(f"learner.dual_clip applies to loss 'ppo' only, not {lrn.loss!r}; remove it")
        if lrn.kl_placement == "reward" and lrn.kl_estimator != "k1":
            raise ValueError(
                "learner.kl_placement = 'reward' takes kl_estimator = 'k1' (the unbiased choice); "
                "use kl_placement = 'loss' for the others"
            )
        if self.opd.estimator == "mc_reverse_kl" and self.opd.num_samples < 2:
            raise ValueError(
                "opd.estimator = 'mc_reverse_kl' needs opd.num_samples >= 2 (tokens cached per "
                "position); set e.g. --set opd.num_samples=4"
            )
        if lrn.advantage == "mc_grpo" and lrn.samples_per_group % 2 == 0:
            raise ValueError(
                "learner.advantage = 'mc_grpo' needs an odd learner.samples_per_group (G + 1 rollouts, "
                f"one is the median pivot); got {lrn.samples_per_group}"
            )

        if lrn.world_size > 1 and lrn.kl_coef > 0 and lrn.kl_placement == "loss":
            raise ValueError(
                "learner.kl_coef > 0 with kl_placement = 'loss' keeps an unsharded reference model per "
                "rank, which several learner ranks do not support yet; use learner.world_size = 1 or "
                "kl_placement = 'reward'"
            )
        if lrn.lora.rank and lrn.lora.publish == "adapter":
            if self.generators.kind == "torch":
                raise ValueError(
                    "learner.lora.publish = 'adapter' needs generators that load LoRA adapters "
                    "(generators.kind = 'sglang'); the torch generator takes merged weights: set "
                    "learner.lora.publish = 'merged'"
                )
            if self.weights.kind != "shards":
                raise ValueError(
                    "learner.lora.publish = 'adapter' ships each version as an adapter directory: use "
                    "weights.transport = 'shards', or learner.lora.publish = 'merged' to broadcast "
                    "merged weights"
                )
        if lrn.lora.rank and lrn.sharding == "fsdp":
            raise ValueError(
                "learner.lora with learner.sharding = 'fsdp' is not supported yet: the adapters are "
                "small, so use learner.sharding = 'none' (replicated ranks) with LoRA"
            )
        self._check_remote()
        if self.auto_staleness and self.buffer.mode == "pool":
            raise ValueError(
                "staleness.max_staleness = 'auto' moves window admission's bound; buffer.mode = 'pool' "
                "keeps its own (buffer.action): set a number, or buffer.mode = 'window'"
            )
        for key, cpus in (("learner.cpus", lrn.cpus), ("generators.cpus", self.generators.cpus)):
            if len(set(cpus)) != len(cpus):
                raise ValueError(f"{key} = {list(cpus)} lists a CPU twice; list each CPU once")
        self._check_buffer()
        if self.run.record_schedule and (lrn.world_size > 1 or self.buffer.mode == "pool"):
            raise ValueError(
                "run.record_schedule records one learner rank's window steps: use learner.world_size = 1 "
                "and buffer.mode = 'window' (or leave run.record_schedule off)"
            )

    def _check_remote(self) -> None:
        gen = self.generators
        if not gen.remote:
            return
        if gen.remote > gen.num_generators:
            raise ValueError(
                f"generators.remote = {gen.remote} is more than generators.num_generators = "
                f"{gen.num_generators}: remote slots are some of the generators; raise num_generators"
            )
        if self.weights.kind == "broadcast":
            raise ValueError(
                "generators.remote > 0 with weights.transport = 'broadcast': remote generators take "
                "shards (served over the network, generators.remote_weights); use weights.transport = 'shards'"
            )
        if self.opd.enabled and gen.remote_weights == "network":
            raise ValueError(
                "opd.enabled with remote generators needs the teacher on their host: set "
                "generators.remote_weights = 'shared' (a shared filesystem), or run the generators here"
            )

    def _check_buffer(self) -> None:
        buf, lrn = self.buffer, self.learner
        if buf.mode == "window":
            changed = [
                f.name
                for f in msgspec.structs.fields(buf)
                if f.name != "mode" and getattr(buf, f.name) != f.default
            ]
            if changed:
                raise ValueError(
                    f"buffer.{changed[0]} applies with buffer.mode = 'pool' only; add --set buffer.mode=pool "
                    "or remove it"
                )
            return
        if lrn.world_size > 1:
            raise ValueError("buffer.mode = 'pool' runs one learner rank: use learner.world_size = 1")
        if buf.action == "downweight" and self.opd.enabled:
            raise ValueError(
                "buffer.action = 'downweight' weighs advantages, which OPD does not use; use withhold or drop"
            )
        # Groups waiting for a replay hold no credit but stay in the buffer (at most one admission
        # window of them: a replay stays within the staleness bound), and cannot be reclaimed.
        need = self.admission_window_items * (2 if buf.max_replays else 1)
        if buf.max_items is not None and buf.max_items < need:
            raise ValueError(
                f"buffer.max_items = {buf.max_items} cannot hold {need} trajectories: the admission window "
                "((max_staleness + 1) x groups_per_step x samples_per_group), twice over with "
                "buffer.max_replays > 0; raise it or leave it unset"
            )

    @property
    def admission_window_items(self) -> int:
        lrn = self.learner
        return (self.effective_max_staleness + 1) * lrn.groups_per_step * lrn.samples_per_group

    @property
    def effective_max_staleness(self) -> int:
        """`sync` mode is strictly on-policy whatever the configured bound; with the closed-loop
        bound (`staleness.max_staleness = "auto"`) this is its hard cap, which the learner asserts."""
        if self.mode == "sync":
            return 0
        bound = self.staleness.max_staleness
        return self.staleness.max_staleness_cap if bound == "auto" else bound

    @property
    def batch_groups(self) -> int:
        """`generators.max_batch_groups` resolved: "auto" = ceil(groups_per_step / num_generators)."""
        gen = self.generators
        if gen.max_batch_groups == "auto":
            return -(-self.learner.groups_per_step // gen.num_generators)
        return gen.max_batch_groups

    @property
    def auto_staleness(self) -> bool:
        """Whether the launcher moves the staleness bound (scheduler/control.py)."""
        return self.mode != "sync" and self.staleness.max_staleness == "auto"

    @property
    def evaluates_in_learner(self) -> bool:
        """Whether the held-out evaluation runs in the learner, on the model it trains and where it
        lives (before the first update, overlapped with the generators' start-up; after the last):
        one plain float32 rank started by the launcher, evaluating on the learner's device, scored
        by the task. Otherwise the launcher loads the checkpoint and evaluates it (docs/learner.md)."""
        lrn = self.learner
        return (
            self.task.num_eval > 0
            and not self.task.rewards
            and lrn.world_size == 1
            and lrn.start == "launch"
            and lrn.sharding == "none"
            and lrn.mixed_precision == "none"
            and lrn.lora.rank == 0
            and self.task.eval_device == lrn.device
        )


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
    check_task_kind(config.task)
    check_rewards(config.task)
    check_cuda(config)
    check_cluster(config.cluster)
    policy = check_staleness_policy(config.staleness)
    check_objective_config(config, policy)  # distillation mixing, OPOB (config_objective.py)
    if config.buffer.action == "downweight" and "old_train" in policy.needs:
        raise ConfigError(
            f"config error at buffer.action: staleness policy {policy.name!r} keeps the last "
            "max_staleness + 1 versions, and 'downweight' trains groups older than that; use withhold or drop"
        )
    kept = sorted({"ewma", "old_train"} & set(policy.needs))
    if config.learner.world_size > 1 and kept and not config.opd.enabled:
        raise ConfigError(
            f"config error at learner.world_size: staleness policy {policy.name!r} keeps {' and '.join(kept)} "
            "copies of the weights, which several learner ranks do not shard yet; use learner.world_size = 1"
        )
    if needs_one_rank(policy, world_size=config.learner.world_size, distills=config.opd.enabled):
        raise ConfigError(
            f"config error at learner.world_size: staleness policy {policy.name!r} takes statistics "
            "of the whole batch, which needs every trajectory on one rank; use learner.world_size = 1"
        )
    check_lint(config, refuse=lint)
    return config


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


# The server's public key in cluster.keys_dir (`asyncrl keys`; transport/security.py names the rest).
SERVER_PUBLIC_KEY = "server.key"


def keys_dir_problem(keys_dir: str) -> str | None:
    """What stops `keys_dir` from serving a CURVE run, naming the fix; None if nothing does
    (its files are parsed where they are used, `transport/security.py`)."""
    if not keys_dir:
        return (
            "CURVE is on (cluster.curve, or cluster.bind_host beyond loopback) but no keys are set: run "
            "`asyncrl keys DIR` and --set cluster.keys_dir=DIR"
        )
    base = Path(keys_dir).expanduser()
    if not base.is_dir():
        return f"{keys_dir!r} is not a directory: run `asyncrl keys {keys_dir}` (or fix the path)"
    if not (base / SERVER_PUBLIC_KEY).is_file():
        return f"{base / SERVER_PUBLIC_KEY} is missing: copy it from the host where `asyncrl keys` ran (or run it here)"
    return None


def check_cluster(section: ClusterConfig) -> None:
    """With CURVE on, `cluster.keys_dir` holds the run's keys (checked on the host that loads the
    config; every process checks its own files again when it starts)."""
    if section.curve_enabled and (problem := keys_dir_problem(section.keys_dir)):
        raise ConfigError(f"config error at cluster.keys_dir: {problem}")


def needs_one_rank(policy, *, world_size: int, distills: bool) -> bool:
    """A batch-global correction (the policy says so) on several data-parallel ranks: each rank
    would see only its share of the batch. Distillation applies no staleness correction."""
    return world_size > 1 and not distills and bool(policy.batch_global)


def check_staleness_policy(section: StalenessConfig):
    """Build the configured policy once, so a misspelled name or parameter fails at load time."""
    from asyncrl.staleness import LEARNER_PROVIDES
    from asyncrl.staleness.registry import make_policy

    try:
        policy = make_policy(section.policy, freshness=section.freshness, **section.params)
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"config error at staleness.policy: {exc}") from None
    missing = [n for n in policy.needs if n not in LEARNER_PROVIDES]
    if missing:
        raise ConfigError(
            f"config error at staleness.policy: {section.policy!r} needs {', '.join(missing)} log-probs, "
            "which the learner does not compute yet; choose another policy"
        )
    return policy


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
