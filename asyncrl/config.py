"""`Config`: the whole typed tree, one section per `[section]` of a config file, and the checks
that span sections and need nothing but the tree (`__post_init__`), with the values derived from
several sections (the effective staleness bound, the admission window, where evaluation runs).

Place in the data flow: a leaf, validated once when the launcher loads the config
(`config_load.py`: defaults, a TOML file, `--set` overrides, one `msgspec.convert` into this
class); the sections are in `config_sections.py`, the checks that need the built staleness policy
in `config_objective.py`. Each component receives only its own sub-tree.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from asyncrl.config_budget import check_budget
from asyncrl.config_sections import (
    BufferConfig,
    ClusterConfig,
    EnvConfig,
    EvalConfig,
    GeneratorConfig,
    LearnerConfig,
    ModelConfig,
    MonitorConfig,
    OpdConfig,
    RunConfig,
    SamplingConfig,
    Section,
    StalenessConfig,
    TaskConfig,
    WeightsConfig,
)


class Config(Section, frozen=True, kw_only=True):
    mode: Literal["async", "sync"] = "async"
    run: RunConfig = RunConfig()
    model: ModelConfig = ModelConfig()
    task: TaskConfig = TaskConfig()
    sampling: SamplingConfig = SamplingConfig()
    generators: GeneratorConfig = GeneratorConfig()
    env: EnvConfig = EnvConfig()
    learner: LearnerConfig = LearnerConfig()
    staleness: StalenessConfig = StalenessConfig()
    opd: OpdConfig = OpdConfig()
    buffer: BufferConfig = BufferConfig()
    weights: WeightsConfig = WeightsConfig()
    monitor: MonitorConfig = MonitorConfig()
    eval: EvalConfig = EvalConfig()
    cluster: ClusterConfig = ClusterConfig()

    def __post_init__(self) -> None:
        lrn = self.learner
        self._check_loss()
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

        if lrn.world_size > 1 and lrn.kl_coef > 0 and lrn.lora.rank:
            raise ValueError(
                "learner.kl_coef > 0 with learner.lora on several learner ranks: the reference model is a "
                "sharded copy built from the model's config, which a LoRA model has no constructor for; "
                "use learner.world_size = 1, or learner.kl_coef = 0"
            )
        if lrn.minibatches > 1:
            self._check_minibatches()
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
        if self.sampling.selection in ("priority", "curriculum") and self.task.kind == "addition":
            raise ValueError(
                f"sampling.selection = {self.sampling.selection!r} chooses among a finite training set, and the "
                "addition task's stream is unbounded: use a dataset task, or sampling.selection = 'skip' or 'replay'"
            )
        if self.sampling.selection == "domain_gap":
            self._check_domain_gap()
        if self.sampling.budget != "fixed":
            check_budget(self)
        if self.env.kind and self.opd.enabled:
            raise ValueError(
                "env.kind with opd.enabled is not supported yet: episodes carry no teacher scores; "
                "drop one of them"
            )
        if self.env.kind and self.task.rewards:
            raise ValueError(
                "env.kind is set and so is task.rewards: an environment's episodes carry their own "
                "reward (StepResult.reward); drop task.rewards or env.kind"
            )
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

    def _check_minibatches(self) -> None:
        lrn = self.learner
        if lrn.groups_per_step % lrn.minibatches:
            raise ValueError(
                f"learner.minibatches = {lrn.minibatches} cuts a step's {lrn.groups_per_step} groups into equal "
                "minibatches: choose a divisor of learner.groups_per_step"
            )
        for what, bad in (
            ("learner.epochs > 1", lrn.epochs > 1),
            ("opd.enabled", self.opd.enabled),
            ("staleness.vcpo_baseline other than 'group_mean'", self.staleness.vcpo_baseline != "group_mean"),
            ("buffer.mode = 'pool'", self.buffer.mode == "pool"),
        ):
            if bad:
                raise ValueError(
                    f"learner.minibatches > 1 with {what} is not supported: use learner.minibatches = 1"
                )

    def _check_loss(self) -> None:
        """learner.loss names a registered policy loss (asyncrl/learner/policy_losses.py), and the
        clip keys and learner.loss_params set are ones that loss takes."""
        lrn = self.learner
        try:
            entry = lrn.policy_loss()
        except ValueError as exc:
            raise ValueError(f"learner.loss: {exc}") from None
        try:
            params = entry.resolve_params(lrn.loss_params)
        except ValueError as exc:
            raise ValueError(f"learner.loss_params: {exc}") from None
        if self.staleness.vcpo_baseline != "group_mean" and not entry.ever_linear(params):
            raise ValueError(
                f"staleness.vcpo_baseline = {self.staleness.vcpo_baseline!r} needs each trajectory's loss "
                f"linear in its advantage, which learner.loss = {lrn.loss!r} with {params} never is "
                "(docs/algorithms.md); choose another loss, its parameters, or vcpo_baseline = 'group_mean'"
            )
        clip = lrn.clip_range()
        if clip is None and (lrn.clip_low is not None or lrn.clip_high is not None):
            raise ValueError(
                f"learner.loss = {lrn.loss!r} never clips the ratio; "
                "remove learner.clip_low and learner.clip_high"
            )
        if clip is not None and (clip[0] > 1.0 or (clip[0] == 1.0 and not entry.clip_low_may_be_one)):
            raise ValueError("learner.clip_low must be < 1 (the ratio's lower bound is 1 - clip_low)")
        if lrn.dual_clip is not None and not entry.dual_clip:
            from asyncrl.learner.policy_losses import POLICY_LOSSES

            takers = " or ".join(repr(e.name) for e in POLICY_LOSSES.values() if e.dual_clip)
            raise ValueError(f"learner.dual_clip applies to loss {takers} only, not {lrn.loss!r}; remove it")

    def _check_domain_gap(self) -> None:
        """sampling.selection = "domain_gap" reads the distillation gap per domain (docs/opd.md)."""
        opd, task = self.opd, self.task
        if not opd.enabled or not opd.route_field:
            raise ValueError(
                "sampling.selection = 'domain_gap' draws domains by their distillation gap (opd/kl/domain/<d>): "
                "it needs opd.enabled = true and opd.route_field naming the prompts' domain field"
            )
        if task.kind == "addition" or (
            task.kind == "dataset" and opd.route_field not in task.dataset.extra_fields
        ):
            raise ValueError(
                f"sampling.selection = 'domain_gap' needs prompts carrying the field opd.route_field = "
                f"{opd.route_field!r}: use a dataset task with {opd.route_field!r} in task.dataset.extra_fields"
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
