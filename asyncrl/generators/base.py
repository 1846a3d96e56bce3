"""The Generator and RewardFn plugin interfaces, and how plugins are found.

A generator turns `PromptTask`s into `Rollout`s: sampled token ids with, for every completion
token, the behavior log-prob (under the distribution it was sampled from) and the policy_version
that produced it, plus a reward. The generator service (`service.py`) owns the sockets and calls
these methods; a plugin never touches ZeroMQ.

Two ways to be fed: `generate(tasks)` returns whole groups, and the service calls it on batches of
up to `generators.max_batch_groups` groups; a generator that also has `generate_stream(feed)`
(`StreamingGenerator`) takes samples from the service's feed whenever it has room and hands each
rollout on as soon as it is done (the built-in torch and sglang generators), so no sample waits
for the slowest of its batch.

Plugins are found by registry name (entry-point group `asyncrl.generators`) or by a
`pkg.mod:obj` path. Lookup happens at startup, never at import.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from asyncrl.messages import BroadcastPublished, PromptTask
from asyncrl.plugins import available, load_plugin

if TYPE_CHECKING:
    from asyncrl.generators.feed import SampleFeed

BATCHING_MODES = ("continuous", "batch")


@dataclass(frozen=True, kw_only=True)
class Rollout:
    """One sampled completion of one task. `loss_mask` marks tokens the learner trains on
    (all True for single-turn; tool output in multi-turn episodes is False)."""

    task_id: int
    sample_index: int
    completion_ids: list[int]
    behavior_logprobs: list[float]
    token_versions: list[int]
    reward: float
    finish_reason: str
    loss_mask: list[bool] | None = None
    # On-policy distillation (config `opd`), [T][N] each, all or none: column 0 is the generated
    # token, columns 1.. are N - 1 more ids drawn at that position from the behavior student;
    # their behavior log-probs and the teacher's log-probs of the same ids (docs/opd.md).
    opd_ids: list[list[int]] | None = None
    opd_behavior_logprobs: list[list[float]] | None = None
    teacher_logprobs: list[list[float]] | None = None
    # The policy_version of the weights that scored `teacher_logprobs` when the teacher is the
    # policy itself (opd.teacher = "self"); None for a teacher outside the policy.
    teacher_version: int | None = None
    # opd.teacher_top_k = K > 0: the teacher's K most likely ids per position and their log-probs,
    # [T][K] each (docs/opd.md, "Teacher top-K"); None otherwise.
    teacher_top_ids: list[list[int]] | None = None
    teacher_top_logprobs: list[list[float]] | None = None
    # opd.teachers: the name of the teacher that scored it (its domain's); "" = the one teacher.
    teacher_id: str = ""
    # With task.rewards configured, the service scores (asyncrl/rewards/) and `reward` is NaN
    # until then: `RolloutBuilder` leaves the decoded texts here for it.
    prompt_text: str | None = None
    completion_text: str | None = None
    # With task.rewards: each reward's unweighted value in task.rewards order (`Trajectory.reward_parts`).
    reward_parts: list[float] | None = None
    # Guided (sampling.guidance): the leading completion tokens that were forced (`Trajectory.guided_prefix`).
    guided_prefix: int = 0


@dataclass(frozen=True, kw_only=True)
class GeneratorContext:
    """What a generator gets at setup: its id, the model directory and its config sub-trees."""

    generator_id: str
    model_path: str
    sampling: Any  # asyncrl.config_sections.SamplingConfig
    task: Any  # asyncrl.config_sections.TaskConfig
    seed: int
    threads: int = 1
    run_seed: int = 0  # run.seed: per-sample RNG seeds derive from (run_seed, group_id, sample_index)
    inflight: str = "keep"  # weights.inflight: keep, retract or abort (for generators that can)
    opd: Any = None  # asyncrl.config_sections.OpdConfig: when enabled, rollouts carry the teacher's scores
    # opd.placement = "service": the shared teacher (`teacher_client.TeacherClient`, made by the
    # service), which the generator scores with instead of loading a teacher itself.
    teacher: Any = None
    options: dict[str, Any] = field(default_factory=dict)
    run_dir: str = ""  # the run directory (logs/ for server logs); empty outside `asyncrl launch`
    # The dtype the learner publishes weights in (learner.serving_dtype): load the model in it.
    dtype: str = "float32"
    # Where to run the model (generators.device with "auto" made concrete): "cpu", "cuda" or
    # "cuda:N". Published weights arrive as CPU tensors; a generator copies them over itself.
    device: str = "cpu"
    # generators.batching: "continuous" (a finished sample's slot takes a new one at once) or
    # "batch" (a batch of up to max_batch_groups groups at a time), for generators that batch.
    batching: str = "continuous"
    max_batch_groups: int = 16  # generators.max_batch_groups: groups (x their samples) decoded at once
    # The `env` section (asyncrl.config_sections.EnvConfig): with `env.kind` set, every sample is an
    # agentic episode (generators/episodes.py); None or kind "" = single-turn sampling.
    env: Any = None


@runtime_checkable
class RewardFn(Protocol):
    def __call__(self, prompt: str, completion: str, answer: str) -> float: ...


@runtime_checkable
class Generator(Protocol):
    """Implement these to plug in your own rollout logic (agents, tools, other engines)."""

    def setup(self, ctx: GeneratorContext) -> None:
        """Load models and tokenizers; called once in the generator process."""

    @property
    def version(self) -> int:
        """The policy_version the generator samples with now."""

    async def generate(self, tasks: Sequence[PromptTask]) -> list[Rollout]:
        """All `num_samples` rollouts of every task (any order)."""

    async def load_weights(self, version: int, location: str) -> None:
        """Switch to the weights published for `version` (a safetensors directory)."""

    async def close(self) -> None: ...


@runtime_checkable
class StreamingGenerator(Protocol):
    """Optional: generators that take samples one at a time and hand each rollout on when it is
    done. The service calls `generate_stream` whenever its feed has work (and no weights load is
    waiting for the generator to be idle); it runs until the feed gives nothing and no sample is
    in flight. A `Draw` from `feed.take(n)` is (task, sample_index), the task's `attempt` the one
    to draw with; every draw must come back as exactly one Rollout.
    """

    def generate_stream(self, feed: SampleFeed) -> AsyncIterator[list[Rollout]]:
        """Yield rollouts as they finish (a list of those that finished together)."""


def streams(gen: object) -> bool:
    """Whether the service feeds `gen` through `generate_stream`: it has one, and `generate` (and
    `generate_sync`) resolve to the ones of the class that defines it. A subclass that overrides
    `generate` or `generate_sync` alone (a gate, a fault injector) asked for that code to run, so
    it is served in batches through `generate`."""
    if not isinstance(gen, StreamingGenerator):
        return False
    cls = type(gen)
    owner = next(c for c in cls.__mro__ if "generate_stream" in vars(c))
    return all(
        getattr(cls, name, None) is getattr(owner, name, None) for name in ("generate", "generate_sync")
    )


@runtime_checkable
class StagedWeights(Protocol):
    """Optional: generators that take verified weights from the service and apply them at a safe
    point of their own choosing (between decode steps, for in-flight updates). Needed for
    `weights.transport = "broadcast"`; without it the service calls `load_weights` between batches.
    """

    def offer_weights(
        self, version: int, state: Mapping[str, Any], on_applied: Callable[[int], None] | None = None
    ) -> None:
        """Thread-safe: hold `state` ({name: CPU tensor}, complete and verified) for `version`; a
        newer offer replaces an older unapplied one; call `on_applied(version)` once applied."""

    def apply_pending(self) -> bool:
        """Apply an offered version now (called between batches, off the event loop)."""


@runtime_checkable
class GroupWeights(Protocol):
    """Optional: generators whose inference servers are themselves ranks of the learner's weight
    update group (the sglang generator with `weights.transport = "broadcast"`). The service hands
    them every broadcast announcement they are a member of, in order, instead of receiving the
    bytes itself, and acks the version once `receive_broadcast` returns. Catch-up shards still go
    to `load_weights`. A generator class may also define `check_config(config)`, which
    `asyncrl launch` calls before any process starts (ValueError = a config error).
    """

    async def receive_broadcast(self, msg: BroadcastPublished) -> None:
        """Have the servers take `msg.version` over the group (joining it on the founding one)."""


ENTRY_POINT_GROUP = "asyncrl.generators"


def available_generators() -> dict[str, str]:
    """Registry name -> `module:object` for every installed generator plugin."""
    return available(ENTRY_POINT_GROUP)


def resolve_generator(kind: str) -> type:
    """The generator class for a registry name or a `pkg.mod:obj` path; ValueError if unknown."""
    return load_plugin(ENTRY_POINT_GROUP, kind, field="generators.kind", what="generator")
