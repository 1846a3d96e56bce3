"""The config tree's sections: one frozen msgspec Struct per `[section]` of a config file, with its
defaults and the comment that documents each key (README's table follows these), and the checks
a section makes of itself (`__post_init__`).

Place in the data flow: a leaf. `config.py` joins the sections into `Config`, the whole tree, with
the checks that span sections; `config_load.py` builds it from a file and `--set` overrides;
`config_objective.py` holds the checks that need the built staleness policy. Every component takes
its own section from here.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

import msgspec
from msgspec import Meta

if TYPE_CHECKING:
    from asyncrl.learner.policy_losses import PolicyLoss

PosInt = Annotated[int, Meta(gt=0)]
NonNegInt = Annotated[int, Meta(ge=0)]
PosFloat = Annotated[float, Meta(gt=0)]
Probability = Annotated[float, Meta(gt=0, le=1)]
# A filesystem path: written relative in a config file, it is relative to that file's directory
# (config_load.py resolves it at load); "" = unset. A `keywords` entry names values that are not
# paths (opd.teacher = "self").
PathStr = Annotated[str, Meta(extra={"path": True})]
# model.path: a directory, or "prepared:NAME" for one `asyncrl models prepare` wrote (models/prepare.py)
ModelPathStr = Annotated[str, Meta(extra={"path": True, "prefixes": ("prepared:",)})]
TeacherPath = Annotated[str, Meta(extra={"path": True, "keywords": ["self"]})]


class ConfigError(ValueError):
    """A user mistake in the configuration; the message names the field and the fix."""


class Section(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """A config section: frozen, keyword-only, and a misspelt key is an error naming the valid ones."""


class RunConfig(Section, frozen=True, kw_only=True):
    name: str = ""  # run directory name; empty = a timestamp
    out_dir: PathStr = "runs"  # parent of run directories
    seed: int = 0
    # Checkpoint (learner and launcher state) every this many versions, on the last step and when
    # stopped early; `asyncrl launch --resume RUN_DIR` continues from the newest one. 0 = only
    # on the last step and when stopped early.
    checkpoint_every: NonNegInt = 10
    # A learner that dies (exits, is killed, hangs or fails) is recovered inside the run up to this
    # many times: every process stops and the run goes on from the newest complete checkpoint, as
    # `asyncrl launch --resume` would, without a user (asyncrl/job.py). 0 = the run fails.
    recover_learner: NonNegInt = 0
    # How the launcher starts its workers: "fork" forks them from a fork server that imported
    # torch, transformers and the worker modules while the launcher checked the config and task
    # (faster start-up; scheduler/spawner.py); "exec" runs each as a fresh `python -m` process.
    spawn: Literal["fork", "exec"] = "fork"
    # Settings-linter rules (asyncrl/lint.py, docs/safety.md) whose errors this run accepts: each
    # is reported as a warning instead of refusing the config.
    allow_unsafe: list[str] = []
    # Record the learner's schedule (each step's trajectories in offer order, its work calls and
    # thread count) under <run>/schedule/, so that `asyncrl replay RUN_DIR` reproduces the run's
    # parameters bitwise (asyncrl/replay.py). One plain learner rank, window admission.
    record_schedule: bool = False


class ModelConfig(Section, frozen=True, kw_only=True):
    # A local Hugging Face directory; "prepared:NAME" = one `asyncrl models prepare NAME` wrote;
    # empty = the embedded default checkpoint.
    path: ModelPathStr = ""


class DatasetConfig(Section, frozen=True, kw_only=True):
    """`task.kind = "dataset"`: prompts from local files through Hugging Face `datasets` (docs/tasks.md)."""

    # A .jsonl / .json / .csv / .parquet file, or a directory written by `save_to_disk`.
    path: PathStr = ""
    format: Literal["auto", "jsonl", "json", "csv", "parquet", "disk"] = "auto"  # auto: by suffix
    split: str = "train"  # the split to train on when `path` holds several (a DatasetDict)
    prompt_field: str = "prompt"  # a text prompt (ignored when messages_field is set)
    messages_field: str = ""  # a chat list [{"role", "content"}, ...] instead; needs prompt.template = "chat"
    answer_field: str = "answer"  # the ground truth the rewards check
    extra_fields: list[str] = []  # passed through to every reward (RewardInput.extras)
    # Self-distillation (opd.teacher = "self", docs/opd.md): the column of each row's worked
    # solution, and how it is put in the teacher's prompt ({solution} somewhere, ending {prompt}).
    solution_field: str = ""
    privileged_template: str = "Reference solution:\n{solution}\n\n{prompt}"
    shuffle: bool = True  # a fresh seeded order (task.seed, epoch) every epoch
    # The held-out split (evaluated before and after training; at most task.num_eval rows), one of:
    eval_path: PathStr = ""  # a separate file or save_to_disk directory
    eval_split: str = ""  # a named split of `path`
    eval_fraction: Annotated[float, Meta(ge=0, lt=1)] = 0.0  # a seeded (task.eval_seed) fraction of `path`


class PromptConfig(Section, frozen=True, kw_only=True):
    """How a dataset row becomes prompt token ids."""

    template: Literal["raw", "chat"] = "raw"  # chat: tokenizer.apply_chat_template, generation prompt added
    system: str = ""  # chat: a system message put first ("" = none)
    max_tokens: NonNegInt = 0  # longest rendered prompt allowed; 0 = no limit
    too_long: Literal["error", "drop"] = "error"  # a longer prompt: stop at load, or drop it and count it


class RewardConfig(Section, frozen=True, kw_only=True):
    """One reward of a task; the sample's reward is the weighted sum (docs/tasks.md)."""

    # Registry name (entry point `asyncrl.rewards`: exact_match, math_verify, regex, length_penalty,
    # remote) or `pkg.mod:fn` (fn(sample) -> float, sync or async; with options, a factory).
    kind: str
    name: str = ""  # its name in metrics and summary.json; "" = kind
    weight: float = 1.0
    options: dict[str, Any] = {}
    # Where a sync reward runs: "process" (the worker pool: a hang is killed), "thread", or "auto"
    # (built-in cheap rewards in a thread, the rest in the pool).
    runs_in: Literal["auto", "process", "thread"] = "auto"


class ScoringConfig(Section, frozen=True, kw_only=True):
    """How rewards run in each generator, and what a failing reward costs."""

    workers: PosInt = 2  # reward worker processes per generator
    # A sample still unscored this long after it reached the reward pool (or half this after its call
    # began, if later) is a failure: its worker is killed.
    timeout_s: PosFloat = 30.0
    # While calls hang (wait past 0.25 s, or half timeout_s), more workers start, up to this many, so
    # a hung call holds up no other sample: it costs its timeout once, overlapped (rewards/pool.py).
    max_workers: PosInt = 64
    # A reward that raises or times out: "zero" scores that reward 0; "regenerate" samples the
    # completion again (up to max_regenerations times, then zero). Each is counted either way.
    on_failure: Literal["zero", "regenerate"] = "zero"
    max_regenerations: NonNegInt = 2
    # The run stops with the reason once more than this fraction of scored samples had a failing
    # reward (judged after failure_budget_min_samples samples); 1 = never.
    failure_budget: Annotated[float, Meta(ge=0, le=1)] = 0.25
    failure_budget_min_samples: PosInt = 256
    eval_reward: str = ""  # the reward whose held-out mean is "held-out accuracy"; "" = the first
    # Completions cut at sampling.max_new_tokens: "keep" them, or "mask" them out of the loss
    # (the length_penalty reward is the soft option). Counted either way.
    overlong: Literal["keep", "mask"] = "keep"


class TaskConfig(Section, frozen=True, kw_only=True):
    # Registry name (entry point `asyncrl.tasks`: addition, dataset) or `pkg.mod:obj`; the object
    # gets this section.
    kind: str = "addition"
    options: dict[str, Any] = {}  # for task plugins
    max_operand: PosInt = 99  # addition
    seed: int = 1  # prompt stream seed (addition: the problems; dataset: the shuffle)
    num_eval: NonNegInt = 500  # held-out prompts for greedy accuracy before/after (0 = skip)
    eval_seed: int = 2  # held-out stream seed (addition), held-out fraction seed (dataset)
    eval_device: Literal["auto", "cpu", "cuda"] = "auto"  # greedy evaluation before/after
    eval_batch_size: PosInt = 64  # held-out prompts decoded together
    dataset: DatasetConfig = DatasetConfig()
    prompt: PromptConfig = PromptConfig()
    # Rewards summed with their weights; [] = the task's own score (addition: exact match).
    rewards: list[RewardConfig] = []
    scoring: ScoringConfig = ScoringConfig()


class GuidanceConfig(Section, frozen=True, kw_only=True):
    """Guided rollouts for prompts nobody solves (docs/algorithms.md, "Guided rollouts")."""

    enabled: bool = False
    # A prompt is guided once this many of its groups in a row had no sample with reward >= pass_reward.
    after_failures: PosInt = 2
    pass_reward: float = 1.0
    samples: PosInt = 1  # guided members of such a prompt's group (< learner.samples_per_group)
    # The guided members' completion starts with this fraction of the worked solution's tokens
    # (Problem.solution), forced; the policy samples the rest.
    prefix_fraction: Annotated[float, Meta(gt=0, le=1)] = 0.5
    # The forced prefix tokens: "mask" (no gradient) or "shaped" (LUFFY: -A p / (p + gamma)).
    prefix_loss: Literal["mask", "shaped"] = "mask"
    gamma: PosFloat = 0.1


class SamplingConfig(Section, frozen=True, kw_only=True):
    temperature: Annotated[float, Meta(ge=0)] = 1.0
    top_p: Probability = 1.0
    max_new_tokens: PosInt = 5
    # Sample max_new_tokens every time, on past an eos (SGLang's ignore_eos): every answer the same
    # length, as throughput benchmarks want. The verifier reads the answer up to its first eos;
    # the learner trains on every sampled token.
    ignore_eos: bool = False
    guidance: GuidanceConfig = GuidanceConfig()
    # Which prompt each admitted group samples (scheduler/selection.py; docs/tasks.md, "Prompt
    # selection"), from a per-prompt Beta pass-rate record: "uniform" (the task's stream, the
    # default), "skip" (passes over prompts estimated solved or hopeless, re-checked), "priority"
    # (Thompson sampling of p (1 - p)), "curriculum" (easiest unsolved first), "replay" (a share
    # of the groups re-admits the most uncertain prompt), "domain_gap" (OPD with opd.route_field:
    # each group's domain drawn by the domain's latest measured gap, opd/kl/domain/<d>, then the
    # domain's next prompt in stream order). Never changes how many groups are admitted.
    selection: Literal["uniform", "skip", "priority", "curriculum", "replay", "domain_gap"] = "uniform"
    selection_solved: Annotated[float, Meta(gt=0, lt=1)] = 0.9  # posterior mean >= this: solved
    selection_hopeless: Annotated[float, Meta(gt=0, lt=1)] = 0.1  # skip: posterior mean <= this: hopeless
    selection_recheck: PosInt = 4  # skip: a prompt passed over this many times in a row is re-checked
    selection_replay_fraction: Probability = 0.25  # replay: the share of groups that replay
    # replay: a prompt's estimate is uncertain while its posterior standard deviation is >= this
    selection_replay_std: Annotated[float, Meta(gt=0, lt=0.5)] = 0.1
    # domain_gap: the share of groups spread uniformly over the domains (each domain's probability
    # is at least this / number of domains), so no domain starves
    selection_domain_floor: Probability = 0.2
    # How many samples each group gets (scheduler/budget.py; docs/tasks.md, "Rollout budgets"):
    # "fixed" (learner.samples_per_group each, the default) or "uncertainty" (each step's
    # groups_per_step x samples_per_group samples split over its groups in proportion to the
    # posterior std of their prompts' pass rates, budget_min..budget_max per group).
    budget: Literal["fixed", "uncertainty"] = "fixed"
    budget_min: Annotated[int, Meta(ge=2)] = 2  # "uncertainty": fewest samples in a group
    budget_max: Annotated[int, Meta(ge=2)] = 16  # "uncertainty": most samples in a group

    def __post_init__(self) -> None:
        self._check_selection()
        self._check_budget()

    def _check_budget(self) -> None:
        if self.budget == "fixed" and (self.budget_min, self.budget_max) != (2, 16):
            raise ValueError(
                "sampling.budget_min / budget_max apply with sampling.budget = 'uncertainty', and it is "
                "'fixed': set sampling.budget = 'uncertainty', or leave them at their defaults"
            )
        if self.budget_min > self.budget_max:
            raise ValueError(
                f"sampling.budget_min = {self.budget_min} is above sampling.budget_max = {self.budget_max}: "
                "a group's size must fit between them"
            )

    def _check_selection(self) -> None:
        if self.selection_hopeless >= self.selection_solved:
            raise ValueError(
                f"sampling.selection_hopeless = {self.selection_hopeless} must be below sampling.selection_solved = "
                f"{self.selection_solved}: a prompt cannot be both hopeless and solved"
            )
        default = {f.name: f.default for f in msgspec.structs.fields(SamplingConfig)}
        for name, strategies in SELECTION_OPTIONS.items():
            if self.selection not in strategies and getattr(self, name) != default[name]:
                raise ValueError(
                    f"sampling.{name} applies with sampling.selection = {' or '.join(map(repr, strategies))}, and "
                    f"it is {self.selection!r}: set sampling.selection, or leave sampling.{name} at its default"
                )


# Each selection option, and the strategies that read it (the others refuse it at load).
SELECTION_OPTIONS = {
    "selection_solved": ("skip", "curriculum"),
    "selection_hopeless": ("skip",),
    "selection_recheck": ("skip",),
    "selection_replay_fraction": ("replay",),
    "selection_replay_std": ("replay",),
    "selection_domain_floor": ("domain_gap",),
}


class GeneratorConfig(Section, frozen=True, kw_only=True):
    kind: str = "torch"  # registry name (entry point `asyncrl.generators`) or `pkg.mod:obj`
    num_generators: PosInt = 1
    # Groups sampled together (one batched generate call, or the slots of continuous batching).
    # "auto": one learner step's groups shared by the generators (ceil(groups_per_step /
    # num_generators)), so a generator never leaves admitted work of the step in progress waiting
    # for a slot (docs/safety.md, "Closed-loop staleness").
    max_batch_groups: PosInt | Literal["auto"] = 16
    # How the built-in torch generator batches samples (docs in torch_gen.py): "continuous" (a
    # finished sample leaves the decoding batch and new samples take its slot, as inference
    # servers do) or "batch" (up to max_batch_groups groups at a time, each run to its end).
    # Either way every rollout is sent as soon as its reward is in.
    batching: Literal["continuous", "batch"] = "continuous"
    threads: PosInt = 1  # torch intra-op threads per generator process
    device: Literal["auto", "cpu", "cuda"] = "auto"  # the built-in torch generator (and OPD teacher)
    # Restarts allowed per generator (a process that exits, raises or hangs is killed, restarted
    # and its in-flight tasks re-queued); one more failure past this ends the run.
    max_restarts: NonNegInt = 3
    # Hedged stragglers (scheduler/hedge.py): a task outstanding more than hedge_factor times the
    # median time of recent tasks (and at least hedge_min_s) is sent to a second generator; the first
    # copy done wins, the other is dropped and counted. 0 = off.
    hedge_factor: Annotated[float, Meta(ge=0)] = 0.0
    hedge_min_s: Annotated[float, Meta(ge=0)] = 1.0
    # CPUs each generator process (and the processes it starts) may run on, e.g. [1] or [2, 3];
    # [] = wherever the OS schedules it. On a shared CPU host this gives each stage its own cores,
    # as GPUs do on a GPU host (learner.cpus for the learner).
    cpus: list[NonNegInt] = []
    # Keyword options for the plugin, handed to its setup() as GeneratorContext.options
    # (e.g. `--set generators.options.replay_path=RUN/trajectories.jsonl` for the replay generator).
    options: dict[str, str | int | float | bool] = {}
    # Across hosts (docs/multi-host.md): how many of the num_generators slots (the last ones) are
    # served by workers on other hosts that join the run (`asyncrl worker --join tcp://HOST:PORT`,
    # HOST:PORT the launcher's control address, shown at start); the launcher starts none of them.
    remote: NonNegInt = 0
    # How long a remote slot waits for a worker to join it, at start and after its worker was lost,
    # before the run fails naming it; 0 = forever. The other generators serve meanwhile.
    remote_join_timeout_s: Annotated[float, Meta(ge=0)] = 600.0
    # A remote worker that is lost (exits, falls silent past monitor.heartbeat_timeout_s): its tasks
    # are re-queued once and its slot "wait"s for a replacement to join (counted against
    # max_restarts), or is "drop"ped: the run goes on with fewer generators (it fails when none is left).
    remote_lost: Literal["wait", "drop"] = "wait"
    # How remote workers get the initial model and each published version: "network" (fetched from
    # the launcher's file socket, chunked and checked against the manifest's checksums, into the
    # worker's scratch directory) or "shared" (a shared filesystem: the same paths as here).
    remote_weights: Literal["network", "shared"] = "network"


class EnvSandboxConfig(Section, frozen=True, kw_only=True):
    """Limits of every environment worker process and of the code it runs (docs/environments.md)."""

    # CPU seconds per worker process over its life (RLIMIT_CPU: one that spends them dies and is
    # replaced, its episodes with it); code the sandbox runs has limits of its own.
    cpu_s: PosInt = 600
    memory_mb: PosInt = 2048  # address space per worker process (RLIMIT_AS)
    file_mb: PosInt = 16  # largest file a worker may write (RLIMIT_FSIZE)
    # Workers run with no network (their own network namespace where the kernel allows, and
    # Landlock TCP rules); true lets an environment that calls a service reach the network.
    network: bool = False


class EnvConfig(Section, frozen=True, kw_only=True):
    """Agentic episodes (docs/environments.md): "" = single-turn sampling."""

    # Registry name (entry point `asyncrl.environments`) or `pkg.mod:obj`: a factory called with an
    # EnvironmentContext, returning an Environment (asyncrl/environments/base.py).
    kind: str = ""
    options: dict[str, Any] = {}  # for the environment plugin (EnvironmentContext.options)
    # Environment worker processes per generator (jailed: sandbox limits, private directory, no
    # network); 0 = environments run in the generator's event loop (async, I/O-bound ones).
    workers: NonNegInt = 2
    max_episodes: PosInt = 64  # episodes in flight per generator (decoding or waiting on their environment)
    max_turns: PosInt = 8  # model turns per episode
    max_tokens: PosInt = 256  # model tokens per episode (each turn also stops at sampling.max_new_tokens)
    max_episode_s: PosFloat = 300.0  # wall-clock per episode
    step_timeout_s: PosFloat = 30.0  # one reset or step; past it the worker is killed and replaced
    # An episode whose environment raised, hung, died or answered malformed: "retry" it from the
    # start (up to max_retries times, then fail), or "fail" it: reward failure_reward, no token trained.
    on_failure: Literal["retry", "fail"] = "retry"
    max_retries: NonNegInt = 1
    failure_reward: float = 0.0
    # Tokens that end a model turn besides eos (e.g. "</tool_call>", or "=" for the calculator); each
    # must be one token of the model's vocabulary.
    stop_tokens: list[str] = []
    sandbox: EnvSandboxConfig = EnvSandboxConfig()


class LoraConfig(Section, frozen=True, kw_only=True):
    """LoRA RL (peft): train low-rank adapters only; rank 0 = off (docs/learner.md)."""

    rank: NonNegInt = 0
    alpha: PosFloat = 16.0
    dropout: Annotated[float, Meta(ge=0, lt=1)] = 0.0
    # Module names to adapt; [] = every linear layer of the attention and MLP blocks.
    target_modules: list[str] = []
    # What generators receive: "merged" weights (base + adapter, the base's names and shapes) or
    # the "adapter" alone (generators that load adapters: SGLang's LoRA endpoints).
    publish: Literal["merged", "adapter"] = "merged"


class LearnerConfig(Section, frozen=True, kw_only=True):
    steps: PosInt = 60  # optimizer steps (= final policy_version)
    groups_per_step: PosInt = 32
    samples_per_group: Annotated[int, Meta(ge=2)] = 8
    lr: PosFloat = 3e-4
    # "adamw" (betas 0.9/0.99) or plain "sgd" (the update is -lr times the clipped gradient, which
    # makes a run's final weights a direct readout of its gradient; the DP parity test uses it).
    optimizer: Literal["adamw", "sgd"] = "adamw"
    weight_decay: Annotated[float, Meta(ge=0)] = 0.0
    max_grad_norm: PosFloat = 1.0
    # The objective (docs/algorithms.md): advantage estimator, policy loss, aggregation, KL.
    # gdpo: each of task.rewards normalised within its group, then weighted and summed (whole batches).
    advantage: Literal["grpo", "dr_grpo", "rloo", "mc_grpo", "gdpo"] = "grpo"
    # A name in the policy-loss registry (asyncrl/learner/policy_losses.py; docs/algorithms.md),
    # checked when the config loads; loss_params are that loss's own hyperparameters beyond the
    # clip range (e.g. sapo's tau_pos, tau_neg), unset ones at the registry's defaults.
    loss: str = "ppo"
    loss_params: dict[str, float] = {}
    agg: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"] = (
        "token-mean"
    )
    norm_constant: PosFloat | None = None  # seq-mean-token-sum-norm's Z; None = sampling.max_new_tokens
    # Clip range of the ratio; None = the loss's own default (its registry entry: ppo 0.2/0.2, ...);
    # a loss that never clips (sapo) takes none.
    clip_low: Annotated[float, Meta(ge=0)] | None = None
    clip_high: Annotated[float, Meta(ge=0)] | None = None
    dual_clip: Annotated[float, Meta(gt=1)] | None = None  # ppo only: bound on -A r for A < 0
    # DAPO dynamic sampling: groups with equal rewards leave the batch. With buffer.mode = "pool"
    # each one is replaced by a newly admitted prompt, so every step trains groups_per_step
    # informative groups; with "window" the step trains on fewer (docs/buffer.md).
    drop_degenerate_groups: bool = False
    # pool mode: at most this many x groups_per_step groups dropped as degenerate in one step
    # before the run stops (a task the model always or never solves cannot fill a batch).
    max_degenerate_per_step: PosInt = 10
    kl_coef: Annotated[float, Meta(ge=0)] = 0.0  # KL to the initial model; 0 = off
    kl_estimator: Literal["k1", "k2", "k3", "k1+", "k3+"] = "k3"
    kl_placement: Literal["loss", "reward"] = "loss"  # "reward" takes k1 only (the unbiased choice)
    # Gradient streaming: "auto" streams per trajectory where exact and falls back otherwise.
    streaming: Literal["auto", "off"] = "auto"
    # Optimizer updates per batch (PPO epochs): each later epoch re-runs the batch under the updated
    # model against the same anchor (the policy at the step's start). > 1 trains whole batches.
    epochs: PosInt = 1
    # Optimizer updates per batch by minibatches (AReaL's ppo_n_minibatches): the batch's groups cut
    # into this many equal minibatches, each its own update against the same anchor (the policy at
    # the step's start, decoupled PPO's proximal policy). > 1 trains whole batches.
    minibatches: PosInt = 1
    # One rank streams each trajectory into its group's S0/S1 buffers (ALGORITHMS.md 5); the
    # groups open at once are bounded by this many MiB of buffers (the bound, in groups, is logged
    # and in summary.json). Several ranks train complete groups in lockstep and hold no such buffers.
    stream_memory_mb: PosFloat = 1024.0
    # Learner ranks (torch.distributed: gloo on CPU, NCCL on GPU). Every rank sees every trajectory
    # and trains its share of each complete group; "fsdp" shards parameters, gradients and optimizer
    # state over the ranks (FSDP2, per transformer block), "none" replicates them (data parallel).
    world_size: PosInt = 1
    # Who starts the ranks: "launch" (asyncrl launch starts them all) or "torchrun": the launcher
    # waits for them, started with `torchrun --nproc-per-node R -m asyncrl.learner.torchrun RUN_DIR`.
    start: Literal["launch", "torchrun"] = "launch"
    sharding: Literal["none", "fsdp"] = "none"
    device: Literal["auto", "cpu", "cuda"] = "auto"  # auto: cuda when there is one
    # Mixed precision: forward/backward in bf16 (or fp16) with fp32 master weights, optimizer state
    # and gradient reduction; "none" = everything in float32.
    mixed_precision: Literal["none", "bf16", "fp16"] = "none"
    # The dtype published weights are shipped in (what the generators serve); "auto" = the
    # mixed-precision compute dtype, float32 without it.
    serving_dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    cpu_offload: bool = False  # fsdp: keep sharded parameters and optimizer state in host memory
    activation_checkpointing: bool = False  # recompute each transformer block in the backward
    micro_batch_size: PosInt = 256  # sequences per forward/backward (at most)
    # Tokens (prompt + completion) per forward/backward, at most: real ones when the forward
    # packs (shared_prefix), else padded; 0 = no token bound. A longer sequence trains alone.
    max_tokens_per_microbatch: NonNegInt = 0
    # Tokens per chunk of [tokens, vocab] logits in every learner forward (training, entropy,
    # the distillation teacher's scores): the full-vocabulary logits of a micro-batch never exist.
    logprob_chunk_size: PosInt = 256
    # Rows of a micro-batch that begin with the same tokens (a group's prompt) run those tokens
    # once, and padding not at all (models/shared_prefix.py; exact: the same log-probs and
    # gradient up to summation order). Needs the model's "sdpa" attention, no sliding window.
    shared_prefix: bool = True
    # A step whose loss, gradient norm or updated parameters are not finite is skipped (no update,
    # optimizer state untouched, counted); this many consecutive skips end the run with a checkpoint
    # from before the fault.
    max_nonfinite_steps: PosInt = 3
    # How long the learner (model load, rank start, process group) may take to say hello to the
    # launcher; a 7B checkpoint on a cold disk takes minutes.
    startup_timeout_s: PosFloat = 600.0
    lora: LoraConfig = LoraConfig()
    # Streaming: while more of the step's window is still to come, the learner starts training
    # only once this many trajectories wait (then trains all it can); the window's last
    # `min_chunk` - 1 train as they arrive, so a step still ends one arrival after its last
    # trajectory. Larger chunks cost less per trajectory (bench/README.md, "min_chunk"), and a
    # learner that keeps up leaves its CPU free. 1 = train every arrival at once. "auto": one
    # streaming rank tries chunks of 64 and whole windows for a few steps and keeps the faster
    # (learner/chunking.py, docs/learner.md "Streaming or whole windows"); elsewhere 64.
    min_chunk: PosInt | Literal["auto"] = "auto"
    # CPU threads the learner trains on. On one plain CPU rank they are data-parallel: each trains
    # pieces of a micro-batch on one torch thread (`Trainer.backward_pieces`); elsewhere they are
    # torch's intra-op threads. "auto": every CPU the learner may use (learner.cpus, else its
    # affinity; shared by its ranks), revisited after each step from the learner's idle time, so
    # a learner that outpaces its generators gives cores back (docs/learner.md, "Cores").
    threads: PosInt | Literal["auto"] = "auto"
    cpus: list[NonNegInt] = []  # CPUs the learner's processes may run on; [] = any (see generators.cpus)
    # Sync mode (mode = "sync") only: "canonical" offers each window's trajectories to the trainer
    # in traj-id order, each followed by all the work it makes possible, so two runs of one config
    # train bitwise alike; a trajectory that arrives early waits for those before it (cost:
    # docs/learner.md, "Reproducible sync runs"). "arrival" streams them as they arrive, as async
    # mode always does.
    sync_order: Literal["canonical", "arrival"] = "canonical"

    @property
    def publish_dtype(self) -> str:
        """The torch dtype name weights are published (and generators load them) in."""
        if self.serving_dtype != "auto":
            return self.serving_dtype
        return {"none": "float32", "bf16": "bfloat16", "fp16": "float16"}[self.mixed_precision]

    def policy_loss(self) -> PolicyLoss:
        """The registry entry of `loss` (ValueError listing the valid names on an unknown one)."""
        from asyncrl.learner.policy_losses import policy_loss  # a pure leaf module; no torch at import

        return policy_loss(self.loss)

    def clip_range(self) -> tuple[float, float] | None:
        """(clip_low, clip_high): the set values over the loss's defaults; None: the loss never clips."""
        defaults = self.policy_loss().clip
        if defaults is None:
            return None
        return (
            defaults[0] if self.clip_low is None else self.clip_low,
            defaults[1] if self.clip_high is None else self.clip_high,
        )


class TeacherSpec(Section, frozen=True, kw_only=True):
    """One of several distillation teachers (`opd.teachers`, docs/opd.md "Several teachers")."""

    # Its id on every trajectory it scores (Trajectory.teacher_id) and in the metrics: letters,
    # digits, "_", "-" or ".".
    name: str
    # A local Hugging Face directory; "" = the shipped teacher checkpoint; "self" = the policy on
    # the task's privileged prompts (opd.self_weights applies).
    path: TeacherPath = ""
    # The task domains it scores: the values of the prompt's field `opd.route_field`
    # (PromptTask.extras). [] = every domain no other teacher names (at most one such teacher).
    domains: list[str] = []


class OpdConfig(Section, frozen=True, kw_only=True):
    """On-policy distillation: a teacher scores the student's tokens (docs/algorithms.md)."""

    enabled: bool = False  # train on the teacher's per-token signal instead of the task reward
    # A local Hugging Face directory; empty = the shipped teacher checkpoint; "self" = the policy
    # itself scores each completion under a privileged prompt the task builds (self-distillation,
    # docs/opd.md; the task must have `privileged_render`).
    teacher: TeacherPath = ""
    # opd.teacher = "self": whose weights score: "initial" (a frozen copy of the weights the run
    # starts from), "current" (the weights that sampled the trajectory), "lagged" (self_lag
    # versions behind them), "ewma" (an EWMA, decay self_ewma_decay, of the versions received).
    self_weights: Literal["initial", "current", "lagged", "ewma"] = "initial"
    self_lag: PosInt = 1
    self_ewma_decay: Annotated[float, Meta(gt=0, lt=1)] = 0.9
    # Where a teacher directory runs: "generator" = a copy in every generator process; "service" =
    # one teacher process, started by the launcher and shared by every generator, which scores the
    # requests that arrive within service_window_ms in one forward (docs/opd.md).
    placement: Literal["generator", "service"] = "generator"
    service_window_ms: Annotated[float, Meta(ge=0)] = 2.0
    # A generator waits this long for the service's scores, then fails naming the teacher.
    service_timeout_s: PosFloat = 60.0
    # reverse_kl: A_t = log pi_T - sg(log pi) at the sampled token; forward_kl: token-level
    # forward KL over the N cached tokens; mc_reverse_kl: multi-sample Monte Carlo reverse KL.
    # topk_forward_kl: sum over the teacher's top-K ids of p_T (log p_T - log p_S) (teacher_top_k > 0).
    estimator: Literal["reverse_kl", "forward_kl", "mc_reverse_kl", "topk_forward_kl"] = "reverse_kl"
    num_samples: PosInt = 1  # N tokens per position in the cache (>= 2 for mc_reverse_kl)
    clip_eps: PosFloat = 0.2  # AsyncOPD's pg_clip_eps on pi / mu
    # Distillation with the task reward (docs/opd.md, "Distillation with rewards and token
    # selection"): "off" = the distillation signal replaces the reward; "add" = reward_weight x the
    # RL objective (learner.*, staleness.*) + kl_weight x the distillation loss; "gate_failed" =
    # distil only trajectories with reward < pass_reward; "weight_failed" = distil each with weight
    # clamp((pass_reward - reward) / pass_reward, 0, 1). Both parts are reported in the step stats.
    reward: Literal["off", "add", "gate_failed", "weight_failed"] = "off"
    reward_weight: Annotated[float, Meta(ge=0)] = 1.0  # the RL part's weight (opd.reward != "off")
    kl_weight: Annotated[float, Meta(ge=0)] = 1.0  # the distillation part's weight
    pass_reward: PosFloat = 1.0  # gate_failed / weight_failed: a reward >= this passed
    # Token-selective distillation: the OPD loss on each sequence's top select_fraction of tokens by
    # teacher-student "disagreement" or student "entropy" (the rest are not distilled); "all" = every token.
    select: Literal["all", "disagreement", "entropy"] = "all"
    select_fraction: Probability = 1.0
    # The teacher's K most likely ids and log-probs per position, shipped [T, K] with each trajectory
    # (docs/opd.md, "Teacher top-K"); 0 = none (the cache is the student's N draws only).
    teacher_top_k: NonNegInt = 0
    # Horizon and token control (docs/opd.md, "Horizon and token control"): distil the first
    # `horizon` trained tokens of each completion only (0 = every token); the horizon grows by
    # horizon_growth per step ("linear") or after a step whose distillation KL is <= horizon_gap
    # ("gap"), up to horizon_max (0 = no limit).
    horizon: NonNegInt = 0
    horizon_schedule: Literal["fixed", "linear", "gap"] = "fixed"
    horizon_growth: PosInt = 1
    horizon_max: NonNegInt = 0
    horizon_gap: PosFloat = 0.05
    # Weight gamma^t on the t-th trained token of a completion (1 = uniform).
    position_decay: Probability = 1.0
    # "overlap": weight each position by the student's mass on the teacher's top-K (teacher_top_k > 0).
    teachability: Literal["off", "overlap"] = "off"
    # The offline teacher-score cache (docs/opd.md "Teacher-score cache"): every teacher score is
    # kept on disk, keyed by a content hash of the teacher, the scoring settings and the exact
    # tokens scored, and reused instead of a teacher forward (epochs, resumed and repeated runs,
    # `asyncrl opd prescore`). cache_dir "" = <run>/teacher_cache.
    cache: bool = False
    cache_dir: PathStr = ""
    # Several teachers, routed by the task's domain (docs/opd.md "Several teachers"); [] = the one
    # teacher of opd.teacher. route_field: the prompt's field (task.dataset.extra_fields, a task
    # plugin's Problem.extras) whose value is its domain.
    teachers: list[TeacherSpec] = []
    route_field: str = "domain"

    # What the run's distillation asks of each role, described once (roles read these, not the
    # flags they combine).
    @property
    def self_teacher(self) -> bool:
        """Self-distillation: prompts carry privileged ids, the policy scores under them (the
        teacher, or one of several)."""
        return self.enabled and "self" in self.teacher_paths

    @property
    def teacher_paths(self) -> list[str]:
        """Every teacher's path ("" = the shipped teacher, "self"), opd.teachers' or opd.teacher."""
        return [t.path for t in self.teachers] if self.teachers else [self.teacher]

    @property
    def teacher_service(self) -> bool:
        """One shared teacher process, started by the launcher before the generators."""
        return self.enabled and self.placement == "service"

    @property
    def samples_per_position(self) -> int:
        """Cached tokens per position a generator sends with each trajectory (0: no cache)."""
        return self.num_samples if self.enabled else 0

    def __post_init__(self) -> None:
        self._check_mixing()
        self._check_teacher()
        self._check_teachers()
        self._check_cache()
        self._check_control()

    def _check_control(self) -> None:
        """The teacher top-K, horizon, position and teachability keys (docs/opd.md)."""
        changed = {f.name for f in msgspec.structs.fields(self) if getattr(self, f.name) != f.default}
        keys = {"teacher_top_k", "horizon", "horizon_schedule", "horizon_growth", "horizon_max"}
        keys |= {"horizon_gap"}
        if not self.enabled and (stray := sorted(changed & (keys | {"position_decay", "teachability"}))):
            raise ValueError(f"opd.{stray[0]} applies to distillation, which needs opd.enabled = true")
        if self.teacher_top_k == 0:
            needs_top = (self.estimator == "topk_forward_kl", self.teachability != "off")
            for key, bad in zip(("estimator", "teachability"), needs_top, strict=True):
                if bad:
                    raise ValueError(
                        f"opd.{key} = {getattr(self, key)!r} reads the teacher's top-K: set opd.teacher_top_k > 0 (e.g. 8)"
                    )
        elif self.placement == "service":
            raise ValueError(
                "opd.teacher_top_k > 0 with opd.placement = 'service': the shared teacher returns no top-K; "
                "use opd.placement = 'generator' or opd.teacher_top_k = 0"
            )
        if self.horizon == 0 and (stray := sorted(changed & (keys - {"teacher_top_k", "horizon"}))):
            raise ValueError(
                f"opd.{stray[0]} applies with a distillation horizon: set opd.horizon > 0 or remove it"
            )
        growth = sorted(changed & {"horizon_growth", "horizon_max"})
        if self.horizon_schedule == "fixed" and (stray := growth):
            raise ValueError(f"opd.{stray[0]} applies with opd.horizon_schedule = 'linear' or 'gap'")
        if self.horizon_schedule != "gap" and "horizon_gap" in changed:
            raise ValueError("opd.horizon_gap applies with opd.horizon_schedule = 'gap' only")
        if 0 < self.horizon_max < self.horizon:
            raise ValueError(f"opd.horizon_max = {self.horizon_max} is below opd.horizon = {self.horizon}")
        if self.horizon_schedule != "fixed" and self.reward != "off":
            raise ValueError(
                "opd.horizon_schedule grows the horizon at the end of each pure-distillation step: use it with "
                "opd.reward = 'off', or a fixed horizon"
            )

    def _check_mixing(self) -> None:
        """The reward-mixing and token-selection keys (cross-section checks: `config_objective.py`)."""
        on = [k for k, off in (("reward", self.reward == "off"), ("select", self.select == "all")) if not off]
        if on and not self.enabled:
            raise ValueError(
                f"opd.{on[0]} = {getattr(self, on[0])!r} changes the distillation objective, which needs "
                "opd.enabled = true; enable it or remove the key"
            )
        if self.reward == "off" and self.reward_weight != 1.0:
            raise ValueError(
                "opd.reward_weight weighs the task reward's part: set opd.reward (e.g. 'add') or remove it"
            )
        if self.reward not in ("gate_failed", "weight_failed") and self.pass_reward != 1.0:
            raise ValueError(
                "opd.pass_reward applies with opd.reward = 'gate_failed' or 'weight_failed' only"
            )
        if self.select == "all" and self.select_fraction != 1.0:
            raise ValueError(
                "opd.select_fraction applies with opd.select = 'disagreement' or 'entropy' only; set one or remove it"
            )
        if self.enabled and self.kl_weight == 0.0:
            raise ValueError(
                "opd.kl_weight = 0 leaves no distillation: use opd.enabled = false to train on the reward alone"
            )
        if self.reward == "add" and self.reward_weight == 0.0:
            raise ValueError(
                "opd.reward = 'add' with opd.reward_weight = 0 is plain distillation: use opd.reward = 'off'"
            )

    def _check_teacher(self) -> None:
        """The self-distillation and teacher-placement keys (the task's side: `tasks.base.check_privileged`)."""
        changed = {f.name for f in msgspec.structs.fields(self) if getattr(self, f.name) != f.default}
        if "self" in self.teacher_paths:
            if self.placement == "service" and not self.teachers:
                raise ValueError(
                    "opd.teacher = 'self' scores with the policy's own weights inside each generator, and "
                    "opd.placement = 'service' holds one fixed teacher: set opd.placement = 'generator'"
                )
        elif stray := sorted(changed & {"self_weights", "self_lag", "self_ewma_decay"}):
            raise ValueError(
                f"opd.{stray[0]} applies with opd.teacher = 'self' only (or a 'self' entry of opd.teachers); "
                "set it or remove the key"
            )
        if self.self_weights != "lagged" and "self_lag" in changed:
            raise ValueError("opd.self_lag applies with opd.self_weights = 'lagged' only")
        if self.self_weights != "ewma" and "self_ewma_decay" in changed:
            raise ValueError("opd.self_ewma_decay applies with opd.self_weights = 'ewma' only")
        if self.placement != "service" and (
            stray := sorted(changed & {"service_window_ms", "service_timeout_s"})
        ):
            raise ValueError(
                f"opd.{stray[0]} applies with opd.placement = 'service' only; set it or remove the key"
            )

    def _check_teachers(self) -> None:
        """opd.teachers: names, domains and routing (teacher_routing.py reads them as checked)."""
        if not self.teachers:
            if self.route_field != "domain":
                raise ValueError("opd.route_field routes between opd.teachers: set opd.teachers or remove it")
            return
        if not self.enabled:
            raise ValueError("opd.teachers needs opd.enabled = true; enable it or remove the key")
        if self.teacher:
            raise ValueError(
                "opd.teacher and opd.teachers both name teachers: keep opd.teachers (one entry per teacher)"
            )
        names = [t.name for t in self.teachers]
        for name in names:
            if not re.fullmatch(r"[A-Za-z0-9_.-]+", name):
                raise ValueError(
                    f"opd.teachers: name {name!r} must be letters, digits, '_', '-' or '.' (it names metrics)"
                )
        if dup := sorted({n for n in names if names.count(n) > 1}):
            raise ValueError(f"opd.teachers: the name {dup[0]!r} is given twice; each teacher needs its own")
        owner: dict[str, str] = {}
        for t in self.teachers:
            for domain in t.domains:
                if domain in owner:
                    raise ValueError(
                        f"opd.teachers: domain {domain!r} is routed to both {owner[domain]!r} and {t.name!r}; "
                        "give each domain one teacher"
                    )
                owner[domain] = t.name
        if len(fallbacks := [t.name for t in self.teachers if not t.domains]) > 1:
            raise ValueError(
                f"opd.teachers: {fallbacks[0]!r} and {fallbacks[1]!r} both have no domains (each would "
                "score every unclaimed domain); give all but one of them domains"
            )
        if self.teacher_paths.count("self") > 1:
            raise ValueError("opd.teachers: 'self' is the path of one teacher at most")
        if self.placement == "service" and self.teacher_paths == ["self"]:
            raise ValueError(
                "opd.placement = 'service' shares teacher directories, and opd.teachers has only 'self': "
                "set opd.placement = 'generator'"
            )
        if not self.route_field:
            raise ValueError("opd.route_field is empty: name the prompt field that holds the domain")

    def _check_cache(self) -> None:
        """opd.cache: a teacher that follows the policy's weights cannot be cached."""
        if self.cache_dir and not self.cache:
            raise ValueError("opd.cache_dir applies with opd.cache = true; set it or remove the key")
        if not self.cache:
            return
        if not self.enabled:
            raise ValueError("opd.cache needs opd.enabled = true; enable it or remove the key")
        if "self" in self.teacher_paths and self.self_weights != "initial":
            raise ValueError(
                f"opd.cache with a 'self' teacher needs opd.self_weights = 'initial' (got {self.self_weights!r}): "
                "a teacher that follows the policy scores differently at every version, and its version-v "
                "weights differ between runs, so its scores are never reused; turn opd.cache off"
            )
        if self.horizon and self.horizon_schedule == "linear":
            raise ValueError(
                "opd.cache with opd.horizon_schedule = 'linear': the teacher scores a horizon that grows "
                "with the policy version, which the cache's key does not hold, so a score cached at one "
                "version would be reused at another; use a 'fixed' or 'gap' horizon, or turn opd.cache off"
            )


def scheduled_horizon(horizon: int, schedule: str, growth: int, horizon_max: int, version: int) -> int:
    """opd.horizon at policy version `version` (0 = every position): `fixed` H, `linear`
    min(H + growth * version, horizon_max or no limit), `gap` 0 here (the learner grows it from the
    measured gap, which the generators do not see, so they score every position)."""
    if horizon == 0 or schedule == "gap":
        return 0
    if schedule == "fixed":
        return horizon
    grown = horizon + growth * max(version, 0)
    return min(grown, horizon_max) if horizon_max > 0 else grown


class StalenessConfig(Section, frozen=True, kw_only=True):
    # Versions between the token's policy and the step that trains on it, at most. "auto": the
    # launcher moves the bound between 1 and max_staleness_cap from the learner's idle time and
    # the off-policy signal (scheduler/control.py, docs/safety.md "Closed-loop staleness").
    max_staleness: NonNegInt | Literal["auto"] = 2
    max_staleness_cap: NonNegInt = 4  # "auto": the hard cap (asserted where tokens are trained)
    policy: str = "none"  # off-policy correction; see docs/staleness.md for names and parameters
    params: dict[str, float | int | bool | str] = {}  # keyword parameters of the policy
    # Per-sample freshness score as a loss weight on top of the policy (docs/staleness.md):
    # None = off; {} = on with defaults; keys lambda_roll, lambda_sup, f_min, self_normalize.
    freshness: dict[str, float | bool] | None = None
    # The policy-gradient baseline of each group (docs/staleness.md, "Off-policy optimal baseline"):
    # "group_mean" (GRPO's mean reward); "opob" = VCPO's off-policy optimal baseline
    # sum W R / sum W with W_i = ||g_i||^2, g_i trajectory i's weighted score gradient (one backward
    # per trajectory, streamed exactly); "opob_released" = the released code's W_i (IS weight twice).
    vcpo_baseline: Literal["group_mean", "opob", "opob_released"] = "group_mean"


class BufferConfig(Section, frozen=True, kw_only=True):
    """Where each step's trajectories come from (docs/buffer.md).

    "window": step s trains exactly the groups admitted for it (their samples, once each); the
    staleness bound holds by construction and a resume is exact. "pool": every step takes
    learner.groups_per_step whole groups from a freshness-scored buffer, in `order`; groups past
    staleness.max_staleness (or under `freshness_floor`) are withheld, down-weighted or dropped
    (`action`), each counted; a group may be trained again up to `max_replays` times. The other
    keys apply to "pool" only.
    """

    mode: Literal["window", "pool"] = "window"
    order: Literal["fifo", "freshest", "windowed"] = "fifo"
    window: NonNegInt = 0  # "windowed": groups admitted at versions v - window .. v
    action: Literal["withhold", "downweight", "drop"] = "withhold"
    downweight: Annotated[float, Meta(gt=0, lt=1)] = 0.5  # the loss weight of a group past a bound
    freshness_floor: Annotated[float, Meta(ge=0, le=1)] = 0.0  # 0 = no freshness bound
    freshness_half_life: PosFloat = 2.0  # staleness at which a group's freshness score halves
    max_replays: NonNegInt = 0  # extra uses of a group after its first
    replay_decay: Probability = 0.5  # freshness multiplier per replay
    # Trajectories held at most; None = twice the admission window ((max_staleness + 1) x
    # groups_per_step x samples_per_group). Withheld groups are dropped oldest first to make room.
    max_items: PosInt | None = None


class CanaryTolerance(Section, frozen=True, kw_only=True):
    """weights.canary_tolerance: the largest mean |generator - learner| log-prob over the canary's
    tokens a loaded version may show, per publish dtype (learner.publish_dtype); docs/weights.md,
    "Canary", has the honest figures these sit above and what a fault gives."""

    float32: PosFloat = 0.01
    bfloat16: PosFloat = 0.5
    float16: PosFloat = 0.1

    def of(self, dtype: str) -> float:
        """The tolerance for publish dtype `dtype` ("float32", "bfloat16" or "float16")."""
        return {"float32": self.float32, "bfloat16": self.bfloat16, "float16": self.float16}[dtype]


class WeightsConfig(Section, frozen=True, kw_only=True):
    """Weight sync learner -> generators (docs/weights.md)."""

    # "shards": versioned safetensors directories; "broadcast": a torch.distributed group (gloo on
    # CPU, NCCL on GPU) from learner rank 0 to every generator. "safetensors" is an alias of "shards".
    transport: Literal["shards", "broadcast", "safetensors"] = "shards"
    dir: PathStr = ""  # empty = <run_dir>/weights (use /dev/shm/... for speed on one host)
    keep_last: PosInt = 2
    max_shard_bytes: PosInt = 512 << 20  # shards: tensor bytes per safetensors file
    bucket_bytes: PosInt = 4 << 20  # broadcast: flat bucket size (gloo: a few MiB; NCCL: hundreds)
    # broadcast: also write shards after each broadcast, so a generator that joins late catches up.
    catchup_shards: bool = True
    group_timeout_s: PosFloat = 300.0  # broadcast: rendezvous and collective timeout
    # broadcast on CPU (gloo): how generators on the learner's host get the bytes. "shm": through a
    # shared-memory ring (two memcpys that overlap), falling back to gloo where it cannot be set up;
    # "gloo": gloo's point-to-point sends, one loopback TCP stream each. Generators on other hosts
    # always take gloo, NCCL groups NCCL. docs/weights.md, "Speed".
    broadcast_local: Literal["shm", "gloo"] = "shm"
    # Weights that land mid-generation: keep (continue on the KV cache), retract (recompute the
    # prefix under the new weights, then continue), abort (restart unfinished samples).
    inflight: Literal["keep", "retract", "abort"] = "keep"
    # A generator that cannot load a version retries (and takes any newer one); after this long
    # without a loadable version it fails the run with the reason instead of stalling admission.
    load_retry_timeout_s: PosFloat = 300.0
    # Per-file integrity hash, computed while the shards are written and checked while they are
    # read: "xxh3" (XXH3-128, guards against corruption), "blake3" or "sha256" (cryptographic).
    # Speeds and the choice: docs/weights.md, "Integrity".
    checksum: Literal["xxh3", "blake3", "sha256"] = "xxh3"
    # shards (and catch-up shards): also publish each version as zstd(XOR with the previous
    # version); generators holding that version apply it, everyone else reads the full shards.
    delta: bool = False
    # Every update's deadline: a generator whose fetch of a version takes longer gives it up (keeps
    # serving the version it has, reports, retries), and the learner logs which generators have not
    # acknowledged a version this long after publishing it.
    update_deadline_s: PosFloat = 120.0
    # The weight-load canary (docs/weights.md, "Canary"): after loading a version each generator
    # scores fixed sequences built from the task's first training prompts (and their answers),
    # about `canary_tokens` tokens; the launcher compares with the learner's own log-probs and
    # refuses a version beyond `canary_tolerance` (the generator is restarted and reloads it);
    # `canary_max_refusals` refusals in a row for one generator fail the run. Off by default: on
    # the default job its forwards are several % of the work (docs/weights.md, "Canary").
    canary: bool = False
    canary_tokens: Annotated[int, Meta(ge=2, le=4096)] = 32
    canary_tolerance: CanaryTolerance = CanaryTolerance()
    canary_max_refusals: PosInt = 2

    @property
    def kind(self) -> str:
        """The transport with aliases resolved: "shards" or "broadcast"."""
        return "shards" if self.transport == "safetensors" else self.transport


class EvalConfig(Section, frozen=True, kw_only=True):
    """Held-out evaluation while training goes on (docs/monitor.md, "Evaluation curve"): every
    `every` versions the learner writes that version's weights and an evaluator process of the
    launcher's scores task.num_eval held-out problems on them, off the training path. Before and
    after training are evaluated whatever this says (task.num_eval > 0)."""

    every: NonNegInt = 0  # versions between evaluations; 0 = only before and after
    # Samples per problem: 1 = greedy (accuracy = pass@1); k > 1 = k samples at
    # sampling.temperature, reported as pass@k, pass@1 and each reward's mean.
    samples: PosInt = 1
    threads: PosInt = 1  # the evaluator process's torch threads
    # The evaluator's CPU priority below training's (an os.nice increment, 0-19): where it shares
    # cores with training, training keeps them and the evaluation takes what is left.
    nice: Annotated[int, Meta(ge=0, le=19)] = 10
    # On Linux, also the idle scheduling class (SCHED_IDLE): the evaluator runs only on a core that
    # training leaves idle; a niced process still takes a small share of a busy one.
    idle_class: bool = True
    # Versions written and waiting for the evaluator at most; past that the oldest waiting one is
    # skipped (its weights removed) and counted: evaluation never holds the run back.
    max_pending: PosInt = 2


class MonitorConfig(Section, frozen=True, kw_only=True):
    tui: bool = True  # live rich view when stdout is a terminal
    heartbeat_s: PosFloat = 1.0
    # A child silent for this long (no heartbeat, no message) is hung: a generator is killed and
    # restarted (generators.max_restarts), a hung learner ends the run with an error.
    heartbeat_timeout_s: PosFloat = 60.0
    # Failure detection on the launcher's connections (scheduler/liveness.py): ZeroMQ's heartbeats
    # and TCP keepalive close a connection silent for connection_timeout_s (a dead host, a cut
    # network); a generator whose connection closed (or that a send could not reach) and that is not
    # back on a new one within reconnect_grace_s is lost: its tasks are re-queued and its slot
    # restarted or left waiting for a worker, without waiting for heartbeat_timeout_s.
    connection_timeout_s: Annotated[float, Meta(ge=1.0)] = 3.0
    reconnect_grace_s: PosFloat = 1.5
    # No silent stalls: when the learner's next step has received nothing (no trajectory, no
    # finished group, no step) for this long, the run stops with a resumable checkpoint and one
    # line naming what it waits for. 0 = never.
    stall_timeout_s: Annotated[float, Meta(ge=0)] = 300.0
    # Publish every metrics record on a loopback PUB socket (address in <run>/monitor.json) so
    # `asyncrl monitor` can attach; the records are in metrics.jsonl either way.
    stream: bool = True
    sinks: list[Literal["tensorboard", "wandb"]] = []  # extra sinks (wandb runs offline)
    snapshot_s: PosFloat = 0.5  # at most this often, a `launcher` record (admission, in-flight)
    refresh_per_second: PosFloat = 4.0  # dashboard redraws; records are folded in as they come

    def __post_init__(self) -> None:
        if self.reconnect_grace_s <= self.heartbeat_s:
            raise ValueError(
                f"monitor.reconnect_grace_s = {self.reconnect_grace_s:g} must be above monitor.heartbeat_s = "
                f"{self.heartbeat_s:g}: a generator that reconnects is known to be back by its next heartbeat"
            )


LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")

# The server's public key in cluster.keys_dir (`asyncrl keys`; transport/security.py names the rest).
SERVER_PUBLIC_KEY = "server.key"


def is_loopback_host(host: str) -> bool:
    """Whether `host` (a name or an address) is this machine's loopback interface only."""
    import ipaddress

    if host in LOOPBACK_HOSTS:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name other than localhost: assume it reaches beyond this machine


class ClusterConfig(Section, frozen=True, kw_only=True):
    """Where a run's sockets bind and how they are protected (docs/multi-host.md)."""

    # The address every ZeroMQ socket, rendezvous store and launched SGLang server binds: the
    # loopback default keeps a run on this machine; a private interface's address (or 0.0.0.0)
    # lets workers on other hosts join.
    bind_host: str = "127.0.0.1"
    # The address peers are told to connect to; "" = bind_host, or this host's address when
    # bind_host is 0.0.0.0.
    advertise_host: str = ""
    # ZeroMQ CURVE (encryption + a key per role) on every socket: "auto" = on whenever bind_host is
    # not loopback; "on" also on loopback; "off" beyond loopback needs allow_insecure = true.
    curve: Literal["auto", "on", "off"] = "auto"
    # Lets curve = "off" bind beyond loopback: anyone who reaches the ports can drive the run.
    allow_insecure: bool = False
    # The directory `asyncrl keys DIR` wrote (server and per-role keypairs); needed when CURVE is on.
    keys_dir: PathStr = ""
    # Largest ZeroMQ message frame a socket accepts (ZMQ_MAXMSGSIZE): a peer sending a larger one
    # is disconnected before it is buffered. The largest legitimate frames are a header (the codec
    # caps them at 16 MiB) and one trajectory tensor (a few MiB at 100k tokens); weight bytes
    # never travel on these sockets. Chunked transfers must keep each frame below it.
    max_message_mb: PosFloat = 64.0

    def __post_init__(self) -> None:
        if not self.bind_host.strip():
            raise ValueError(
                "cluster.bind_host is empty: use 127.0.0.1 (one host) or this host's private address"
            )
        if self.curve == "off" and not self.loopback and not self.allow_insecure:
            raise ValueError(
                f"cluster.curve = 'off' with cluster.bind_host = {self.bind_host!r} (beyond loopback) would let "
                "anyone who reaches the ports drive the run: use curve = 'auto' with keys from `asyncrl keys DIR`, "
                "or set cluster.allow_insecure = true if the network is private and you accept that"
            )

    @property
    def loopback(self) -> bool:
        """Whether the run binds only on this machine's loopback interface."""
        return is_loopback_host(self.bind_host)

    @property
    def curve_enabled(self) -> bool:
        """Whether every ZeroMQ socket of the run uses CURVE."""
        return self.curve == "on" or (self.curve == "auto" and not self.loopback)

    @property
    def max_message_bytes(self) -> int:
        return int(self.max_message_mb * (1 << 20))


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
