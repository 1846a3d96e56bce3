"""Every wire type between asyncrl processes, as tagged, frozen msgspec Structs.

This module is a leaf: it imports nothing from asyncrl. The codec in `asyncrl.transport.codec`
encodes these Structs with msgspec (never pickle) and carries large arrays as separate
zero-copy frames described by `TensorRef`.

Data flow (see asyncrl/__init__.py for the whole picture):
  scheduler -> generator : Hello, DataEndpoint, PromptTasks (a dispatch's PromptTask each),
                           WeightsPublished, WeightsLoaded (its weight-load canary accepted), Shutdown
  generator -> learner   : Trajectories (samples that finished together) or Trajectory (+ tensor frames)
  generator -> scheduler : Hello, TasksDone (a TaskDone per task whose last sample was sent), WeightsLoaded,
                           Metrics, Heartbeat, Fatal
  learner   -> scheduler : Hello, Evaluated, EvalDue, WeightsPublished, StepDone, Metrics, Heartbeat, Fatal
  scheduler -> learner   : Hello, WeightsLoaded (all generators at a version), Shutdown
  scheduler -> monitor   : LauncherSnapshot (a `launcher` record of the metrics stream, JSON)
  worker    -> scheduler : Join (`asyncrl worker --join`, from another host); back: Welcome or JoinRefused
  generator -> scheduler : FileRequest on the launcher's file socket; back: FileChunk (the initial
                           model and weights versions for hosts without the weights root)
  generator -> teacher   : TeacherRequest on the shared teacher's socket (opd.placement = "service");
                           back: TeacherScores
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

import msgspec

# 2: PromptTasks and TasksDone; 3: DataEndpoint, Evaluated; 4: Join, files; 5: the shared teacher
# (TeacherRequest, TeacherScores), self-distillation (PromptTask.privileged_ids, Trajectory.teacher_version);
# 6: WeightsPublished split into ShardsPublished | BroadcastPublished, each with its own fields;
# 7: the weight-load canary (WeightsPublished.canary, WeightsLoaded.canary, WorkerArgs.canary_ids);
# 8: Trajectory.reward_parts (per-reward values, GDPO) and Trajectory.guided_prefix (guided samples),
# Trajectory fields at their defaults omitted on the wire; 9: PromptTask.sample_stride (rollout budgets)
PROTOCOL_VERSION = 9

Role = Literal["scheduler", "generator", "learner", "monitor"]


class _Msg(msgspec.Struct, frozen=True, kw_only=True, tag_field="type"):
    """Base: every message carries its class name as the `type` tag."""


class TensorRef(msgspec.Struct, frozen=True, kw_only=True):
    """Describes one tensor that travels as its own frame after the Struct frame."""

    frame: int  # index of the frame, counted from the first frame after the Struct
    dtype: str  # torch dtype name without the "torch." prefix, e.g. "float32"
    shape: tuple[int, ...]


class TensorMeta(msgspec.Struct, frozen=True, kw_only=True):
    """Name, dtype and shape of one model tensor (weight manifests and broadcast metadata)."""

    name: str
    dtype: str
    shape: tuple[int, ...]


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True):
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 16
    ignore_eos: bool = False  # sample max_new_tokens every time, past an eos (benchmarks)


class Hello(_Msg, frozen=True, kw_only=True):
    role: Role
    peer_id: str
    protocol_version: int = PROTOCOL_VERSION
    pid: int = 0
    endpoint: str = ""  # the learner's trajectory endpoint (PULL), announced at start
    note: str = ""  # the learner: how it turns trajectories into gradients (shown as an event)


class PromptTask(_Msg, frozen=True, kw_only=True):
    """One group: `num_samples` completions of one prompt, all in the same admission window."""

    task_id: int
    group_id: int
    prompt_ids: list[int]
    num_samples: int
    sampling: SamplingParams
    dataset_index: int
    # The admission window the group belongs to, a policy_version. buffer.mode = "window": the
    # learner step that trains it (step s trains at policy_version s). buffer.mode = "pool": the
    # version the generators held when it was admitted (the pool's `windowed` order reads it).
    window: int
    answer: str  # what the task's verifier checks against
    extras: dict[str, Any] = {}  # the dataset row's extra fields, for the rewards (task.dataset.extra_fields)
    attempt: int = 0  # > 0: samples drawn again (a reward failed): seeds fold it in
    # opd.teacher = "self": the privileged prompt (`Task.privileged_render`: the problem with, e.g.,
    # its worked solution) under which the policy scores each completion; empty otherwise.
    privileged_ids: list[int] = []
    # A generator's own guided variant (sampling.guidance, generators/guidance.py; never sent): the
    # last `guided_prefix` of prompt_ids are a forced prefix of the worked solution. 0 otherwise.
    guided_prefix: int = 0
    # Rollout budgets (sampling.budget): sample k's traj_id is group_id * sample_stride + k, the
    # stride being sampling.budget_max, so groups of unequal sizes never share an id; 0 = num_samples.
    sample_stride: int = 0

    def traj_id(self, sample_index: int) -> int:
        return self.group_id * (self.sample_stride or self.num_samples) + sample_index


class PromptTasks(_Msg, frozen=True, kw_only=True):
    """The tasks one dispatch gives one generator, in order: one message for a window's worth
    (each message costs both ends a wake-up, a decode and a send, so one per task would cost the
    launcher CPU per sample)."""

    tasks: list[PromptTask]


class Trajectory(_Msg, frozen=True, kw_only=True, omit_defaults=True):
    """One sampled completion. Per-token arrays travel as tensor frames (see TensorRef).

    `behavior_logprobs` are log-probs of the sampled tokens under the distribution they were
    sampled from (after temperature); `token_versions` is the policy_version that produced each
    completion token.
    """

    traj_id: int
    group_id: int
    task_id: int
    sample_index: int
    window: int  # its task's PromptTask.window
    num_samples: int
    prompt_ids: list[int]
    completion_ids: TensorRef  # int64 [T]
    behavior_logprobs: TensorRef  # float32 [T]
    token_versions: TensorRef  # int64 [T]
    reward: float
    finish_reason: Literal["stop", "length", "abort"]
    generator_id: str
    generate_s: float = 0.0
    # On-policy distillation (config `opd`), frames 3-5 when present. Column 0 of each [T, N]
    # array is the generated token; columns 1.. are N-1 more tokens drawn at the same position
    # from the behavior student (the multi-sample Monte Carlo estimator's cache).
    teacher_logprobs: TensorRef | None = None  # float32 [T, N]: teacher log-probs of opd_ids
    opd_ids: TensorRef | None = None  # int64 [T, N]
    opd_behavior_logprobs: TensorRef | None = None  # float32 [T, N]: behavior student log-probs
    # bool [T]: tokens the learner trains on (multi-turn episodes mask tool output out); absent =
    # every token. Its frame follows the others.
    loss_mask: TensorRef | None = None
    # The policy_version of the weights that computed `teacher_logprobs` when the teacher is the
    # policy itself (opd.teacher = "self"); None for a teacher outside the policy.
    teacher_version: int | None = None
    # opd.teacher_top_k = K > 0: the teacher's K most likely ids per position (descending) and their
    # log-probs, [T, K] each, frames after the OPD ones (docs/opd.md, "Teacher top-K").
    teacher_top_ids: TensorRef | None = None  # int64 [T, K]
    teacher_top_logprobs: TensorRef | None = None  # float32 [T, K]
    # opd.teachers: the name of the teacher that scored it (its domain's, docs/opd.md "Several
    # teachers"); "" = the one teacher of opd.teacher (omitted on the wire).
    teacher_id: str = ""
    # With task.rewards: each reward's unweighted value, in task.rewards order (a failed reward 0),
    # for per-reward normalisation (learner.advantage = "gdpo"); empty without task.rewards.
    reward_parts: list[float] = []
    # A guided sample (sampling.guidance): its first `guided_prefix` completion tokens are the task's
    # worked solution, forced, not sampled (off-policy); 0 = an ordinary, unguided sample.
    guided_prefix: int = 0


class Trajectories(_Msg, frozen=True, kw_only=True):
    """Several trajectories in one message (a generator sends the samples that finished together this way).

    Each item's TensorRefs number its own frames from 0, as in a lone Trajectory; the message's
    frames are the items' frames in item order (`asyncrl.transport.codec.split_trajectories`
    gives each item its own). One message instead of one per sample saves both ends the
    per-message cost (bench/README.md, "Pipeline").
    """

    items: list[Trajectory]


class TaskDone(_Msg, frozen=True, kw_only=True):
    """A generator finished every sample of a task (the samples went to the learner)."""

    task_id: int
    generator_id: str
    num_trajectories: int
    num_tokens: int
    generate_s: float
    mean_reward: float
    # With task.rewards: each reward's sum over the group's samples, unweighted (by reward name).
    reward_sums: dict[str, float] = {}
    # Reward calls that failed (by reward name), each counted, also when the sample was drawn again.
    reward_failures: dict[str, int] = {}
    num_scored: int = 0  # samples scored, redraws included (the failure budget's denominator)
    num_score_failed: int = 0  # of those, samples with at least one failed reward
    num_regenerated: int = 0  # samples drawn again after a failed reward (scoring.on_failure)
    num_overlong: int = 0  # samples cut at sampling.max_new_tokens
    num_invalid: int = 0  # samples drawn again because the learner would reject them
    num_guided: int = 0  # guided members (sampling.guidance): their rewards are not the policy's own
    guided_reward_sum: float = 0.0  # ... their rewards' sum (mean_reward includes them)


class TasksDone(_Msg, frozen=True, kw_only=True):
    """The TaskDones of the tasks one send completed, in order (one message, as PromptTasks)."""

    items: list[TaskDone]


class CanaryReference(msgspec.Struct, frozen=True, kw_only=True):
    """The weight-load canary of one version, as the learner computed it (docs/weights.md,
    "Canary"): fixed token sequences built from the task's prompts, and the learner's own
    log-prob of every token after each sequence's first, `logprobs[i][t]` = log pi(ids[i][t + 1] |
    ids[i][: t + 1]) under the weights it publishes. Every value, not a digest: the launcher
    compares token by token (a sum would let errors of opposite sign cancel), and a few hundred
    floats per version cost nothing next to the weights."""

    ids: list[list[int]]
    logprobs: list[list[float]]


class CanaryScores(msgspec.Struct, frozen=True, kw_only=True):
    """A generator's log-probs of the canary's tokens (`CanaryReference` layout) under the version
    it loaded, from one engine: its in-process model ("torch"), or one server (its URL)."""

    engine: str
    logprobs: list[list[float]]


class ShardsPublished(_Msg, frozen=True, kw_only=True):
    """New weights for `version` as shards: `root` is the directory holding `v{version:08d}/`
    (weights.transport = "shards", or a broadcast version's catch-up copy)."""

    transport: ClassVar[str] = "shards"  # the weights.transport it announces (not on the wire)

    version: int
    root: str
    num_bytes: int
    publish_s: float = 0.0
    catchup: bool = False  # a copy of a broadcast version, for generators outside the group
    # The version directory is a PEFT LoRA adapter (adapter_model.safetensors + adapter_config.json)
    # for the base model the generators started from, not full weights (learner.lora.publish =
    # "adapter"; only generators that load adapters take it).
    adapter: bool = False
    canary: CanaryReference | None = None  # weights.canary: None when off (or not computable)


class BroadcastPublished(_Msg, frozen=True, kw_only=True):
    """New weights for `version` over the weight update group: the bytes follow over the group
    right after this message, laid out by `tensors` and `bucket_bytes`. `store_address` is the
    group's store `host:port`; `group_members[i]` is group rank i + 1 and may join only on the
    announcement of `group_first_version` (later joiners catch up from shards)."""

    transport: ClassVar[str] = "broadcast"  # the weights.transport it announces (not on the wire)

    version: int
    store_address: str
    num_bytes: int
    publish_s: float = 0.0
    tensors: tuple[TensorMeta, ...]  # what is sent, in order
    bucket_bytes: int
    group_name: str
    group_backend: Literal["gloo", "nccl"]
    group_members: tuple[str, ...]  # generator ids, rank i + 1
    group_first_version: int  # the version whose announcement founds the group
    group_timeout_s: float = 300.0
    canary: CanaryReference | None = None  # weights.canary: None when off (or not computable)


# New weights exist: one variant per transport (a Decoder of `Message` tells them by their tag).
WeightsPublished = ShardsPublished | BroadcastPublished


class WeightsLoaded(_Msg, frozen=True, kw_only=True):
    """A generator (or, scheduler -> learner, every generator) now samples with `version`;
    scheduler -> generator: the canary of `version` it sent was accepted (it may send what it
    sampled with that version)."""

    generator_id: str
    version: int
    load_s: float = 0.0
    # The announcement had a canary: the generator's log-probs of it under `version`, one entry
    # per engine it samples with (empty: its plugin cannot score one, or there was none).
    canary: list[CanaryScores] = []


class DataEndpoint(_Msg, frozen=True, kw_only=True):
    """Where a generator sends its trajectories: the learner's PULL endpoint. Generators start
    while the learner does, before it is known; the launcher passes it on once the learner said
    Hello (a generator started later gets it on its command line)."""

    endpoint: str


class Evaluated(_Msg, frozen=True, kw_only=True):
    """The learner's held-out evaluation of the model it trains (`Config.evaluates_in_learner`):
    `phase` "before" the first update or "after" the last; `accuracy` the mean score, NaN when
    nothing is held out."""

    phase: Literal["before", "after"]
    accuracy: float
    means: dict[str, float] = {}
    eval_s: float = 0.0


class EvalDue(_Msg, frozen=True, kw_only=True):
    """Background evaluation (`eval.every`): the learner wrote `version`'s weights, as a Hugging
    Face directory at `path`, for the launcher's evaluator; the evaluator removes it when done."""

    version: int
    path: str


class StepDone(_Msg, frozen=True, kw_only=True):
    """The learner finished optimizer step `step`; `version` = step + 1 is the new policy_version."""

    step: int
    version: int
    num_trajectories: int
    num_tokens: int
    loss: float
    mean_reward: float
    max_staleness: int
    mean_staleness: float
    clip_fraction: float
    grad_norm: float
    step_s: float
    idle_s: float
    lr_scale: float = 1.0
    stats: dict[str, float] = {}  # staleness-policy diagnostics (ESS, masked fraction, ...)
    # buffer.mode = "pool" (empty otherwise): groups trained for the first time, and again (replays).
    groups_trained: list[int] = []
    groups_replayed: list[int] = []
    # A non-finite loss or gradient norm: the update was skipped (the version still advances).
    skipped_nonfinite: bool = False
    # A decision the learner made at this step, in words, for the run's events (e.g. streaming
    # chunks or whole windows, learner.min_chunk = "auto"); "" = none.
    note: str = ""


class GroupsLeft(_Msg, frozen=True, kw_only=True):
    """buffer.mode = "pool": groups that left the learner's buffer (last use, dropped or
    withheld), sent when it happens (a step's end, or a group withheld as it arrives). The
    launcher gives their admission credits back once every generator has loaded `version`;
    `evicted` (reason -> group ids) are the ones dropped without being trained."""

    version: int
    released: list[int]
    evicted: dict[str, list[int]] = {}


class _MetricRecord(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True, tag_field="kind"):
    """Base of a process's metric record. Each field's encoded name is its flat metric name
    ("learner/idle_s", "gen/version", ...): metrics.jsonl and the monitor show `values()`, a view
    of the record; code that decides reads the typed fields."""

    def values(self) -> dict[str, float]:
        """The flat view: metric name -> float (dict fields hold names of their own, and are
        flattened into the view)."""
        out: dict[str, float] = {}
        for name, value in msgspec.to_builtins(self).items():
            if name == "kind":
                continue
            if isinstance(value, dict):
                out.update((k, float(v)) for k, v in value.items())
            else:
                out[name] = float(value)
        return out


def _named(prefix: str):
    return lambda field: f"{prefix}/{field}"


class LearnerMetrics(_MetricRecord, frozen=True, kw_only=True, tag="learner", rename=_named("learner")):
    """The learner's counters after each step (cumulative unless the name says otherwise)."""

    idle_ratio: float  # idle / (idle + busy) of the learner's loop
    busy_s: float
    idle_s: float
    tail_s: float  # the step's end: from its last trajectory to its update
    threads: int
    streaming: bool  # this step streamed gradients per trajectory (False: whole batches)
    streamed: int
    deferred: int
    stream_peak_bytes: int
    # Groups a streaming rank may hold open (learner.stream_memory_mb); 0 = lockstep ranks, or
    # whole batches: no per-group buffers.
    open_group_bound: int
    skipped_nonfinite: int
    duplicates: int  # copies received and dropped (a re-run of a group a dead generator had begun)
    resume_restored: int
    resume_regenerated: int
    invalid_trajectories: int  # rejected before buffering (the launcher's stall message names them)
    rejected_frames: int
    auth_failures: int
    publish_s: float
    # Received for later steps (async: the generators' lead), not trained yet.
    held_trajectories: int = msgspec.field(name="buffer/held_trajectories")
    held_windows: int = msgspec.field(name="buffer/held_windows")
    # buffer.mode = "pool": the buffer's counters, by their own flat names ("buffer/withheld", ...).
    buffer: dict[str, float] = {}
    # Self-distillation (opd.teacher = "self"): the teacher's staleness since the last report.
    teacher_staleness_mean: float | None = msgspec.field(default=None, name="opd/teacher_staleness_mean")
    teacher_staleness_max: float | None = msgspec.field(default=None, name="opd/teacher_staleness_max")


class GeneratorMetrics(_MetricRecord, frozen=True, kw_only=True, tag="generator", rename=_named("gen")):
    """A generator's counters (cumulative), sent every few seconds."""

    samples: int
    tokens: int
    busy_ratio: float
    version: int  # the policy_version it samples with
    rejected_frames: int
    weights_load_errors: int
    weights_load_s: float  # the last load
    weights_fetch_bytes: int  # the last load
    weights_delta_fetches: int
    weights_refused_locations: int
    weights_network_bytes: int
    inflight_updates: int
    teacher_s: float
    teacher_version: int  # -1: no self-distillation teacher
    # OPD: the teacher-score cache's counters (`teacher_cache/hits`, ...; per teacher with
    # opd.teachers) and the gap per teacher and domain (`opd/kl/domain/<d>`, docs/opd.md).
    opd: dict[str, float] = {}
    # Agentic episodes (env.kind): the episode runner's counters by their own flat names
    # ("env/turns", "env/failures_timeout", "env/budget_tokens", ...; docs/environments.md).
    env: dict[str, float] = {}


class TeacherMetrics(_MetricRecord, frozen=True, kw_only=True, tag="teacher", rename=_named("teacher")):
    """The shared OPD teacher's counters (opd.placement = "service")."""

    requests: int
    batches: int
    sequences: int
    bad_requests: int
    undeliverable: int
    # Requests refused before decoding or by the sender's key role (bad ones included).
    rejected_frames: int
    busy_ratio: float


MetricRecord = LearnerMetrics | GeneratorMetrics | TeacherMetrics


class Metrics(_Msg, frozen=True, kw_only=True):
    """One process's metric record (typed; `values` is its flat view, as metrics.jsonl shows it)."""

    source: str
    time_s: float
    record: MetricRecord

    @property
    def values(self) -> dict[str, float]:
        return self.record.values()


class Heartbeat(_Msg, frozen=True, kw_only=True):
    peer_id: str
    time_s: float


class Fatal(_Msg, frozen=True, kw_only=True):
    """A process failed; `error` is the message shown to the user, `traceback` the details."""

    role: Role
    peer_id: str
    error: str
    traceback: str = ""


class Shutdown(_Msg, frozen=True, kw_only=True):
    reason: str = "done"


class Join(_Msg, frozen=True, kw_only=True):
    """A worker started on another host (`asyncrl worker --join`) offers to serve `count` slots
    of `role`; the launcher answers Welcome (the slots it may serve, and what it needs to) or
    JoinRefused."""

    role: Literal["generator"]
    count: int
    host: str  # the worker's host name (records, events)
    pid: int
    protocol_version: int = PROTOCOL_VERSION


class FileEntry(msgspec.Struct, frozen=True, kw_only=True):
    """One file a joining worker fetches (a path relative to its root, `/`-separated)."""

    name: str
    size_bytes: int
    checksum: str  # hex digest of the Welcome's `checksum_kind`


# The shared OPD teachers of a run, as `WorkerArgs.teacher` names them.
ENDPOINT_SEPARATOR = ";"


def service_teachers(opd: Any, *, peer: str) -> dict[str, str]:
    """Peer id -> teacher name ("" = opd.teacher) of each shared teacher process a run starts:
    one for opd.teacher, or one per entry of opd.teachers that is not "self" (the policy scores in
    its generator), with opd.placement = "service"; none otherwise."""
    if not opd.teacher_service:
        return {}
    if not opd.teachers:
        return {peer: ""}
    return {f"{peer}-{t.name}": t.name for t in opd.teachers if t.path != "self"}


def join_endpoints(endpoints: dict[str, str]) -> str:
    """`WorkerArgs.teacher` of a generator: the one teacher's address, or "name=address;..."."""
    if set(endpoints) <= {""}:
        return endpoints.get("", "")
    return ENDPOINT_SEPARATOR.join(f"{name}={address}" for name, address in sorted(endpoints.items()))


def split_endpoints(text: str) -> dict[str, str]:
    """The inverse of `join_endpoints` for several teachers: name -> address."""
    out = {}
    for item in filter(None, text.split(ENDPOINT_SEPARATOR)):
        name, sep, address = item.partition("=")
        if not sep or not name or not address:
            raise ValueError(
                f"WorkerArgs.teacher: {item!r} is not name=address (opd.teachers' shared teachers)"
            )
        out[name] = address
    return out


class WorkerArgs(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True, forbid_unknown_fields=True):
    """What a worker process is started with besides its control address, peer id and run
    directory: one JSON argument on its command line (`asyncrl.runtime.worker_argv`), also written
    to the torchrun join file and handed to a worker that joins from another host (Assignment).
    Each role reads the fields it needs; the others keep their defaults."""

    model: str = ""  # the initial model directory (every role)
    # generator
    index: int = 0  # its slot's index (seeds its sampling)
    data: str = ""  # the learner's trajectory endpoint; "" until known (a DataEndpoint brings it)
    # the shared OPD teacher's address (opd.placement = "service"); with opd.teachers, every shared
    # teacher's as "name=address;..." (`join_endpoints`). A teacher process: the
    # name of the opd.teachers entry it serves ("" = opd.teacher).
    teacher: str = ""
    files: str = ""  # the launcher's file socket, for a worker on a host without the weights root
    # learner
    generators: tuple[str, ...] = ()  # the generator slots (its weights retention pins versions per slot)
    resume_version: int = 0  # the policy_version the run resumes at (0: a fresh run)
    # weights.canary: the canary's token sequences (the launcher builds them from the task's
    # prompts); the learner scores them at every version it publishes
    canary_ids: list[list[int]] = []


class Assignment(msgspec.Struct, frozen=True, kw_only=True):
    """One slot a joined worker serves: the peer id its process says Hello with, and the
    arguments a local one would have had."""

    peer_id: str
    args: WorkerArgs = WorkerArgs()


class Welcome(_Msg, frozen=True, kw_only=True):
    """The launcher's answer to a Join: what a worker needs to serve without the launcher's run
    directory: the resolved config (config.json's JSON), its slots, and where to fetch files
    (`files_endpoint`, a FileRequest/FileChunk socket): the initial model (`model_files`,
    root "model") and, with `weights_network`, every published version (root "weights")."""

    run_name: str
    config_json: str
    assignments: list[Assignment]
    files_endpoint: str
    checksum_kind: str
    model_files: list[FileEntry] = []
    weights_network: bool = True
    weights_root: str = (
        ""  # the launcher's weights root (generators.remote_weights = "shared": the same path there)
    )


class JoinRefused(_Msg, frozen=True, kw_only=True):
    reason: str
    full: bool = False  # every slot is served now; one may free up (a worker lost): try again later
    # With `full` (and network weights): what a waiting worker pre-fetches while it waits, as in the
    # Welcome it will get (the initial model), so taking a freed slot starts the generator at once.
    run_name: str = ""
    files_endpoint: str = ""
    checksum_kind: str = ""
    model_files: list[FileEntry] = []


class FileRequest(_Msg, frozen=True, kw_only=True):
    """Up to `max_bytes` of file `name` under `root` ("model": the initial model directory;
    "weights": the weights root, names like `v00000003/model-00001-of-00001.safetensors`)."""

    root: Literal["model", "weights"]
    name: str
    offset: int
    max_bytes: int


class FileChunk(_Msg, frozen=True, kw_only=True):
    """The answer to a FileRequest: `data` from `offset` (empty at the end), the file's size, or
    `error` (no such file, a name outside the root)."""

    root: str
    name: str
    offset: int
    total_bytes: int = 0
    data: bytes = b""
    error: str = ""


class TeacherRequest(_Msg, frozen=True, kw_only=True):
    """A generator asks the shared teacher (opd.placement = "service") to score completions:
    sequence i is `prompt_ids[i]` followed by `lengths[i]` completion tokens, whose rows of the
    frame `ids` ([sum of lengths, N] int64) are the N ids to score at each position (column 0 the
    generated token, which is also the context of the positions after it)."""

    request_id: int
    prompt_ids: list[list[int]]
    lengths: list[int]
    ids: TensorRef  # int64 [sum(lengths), N]


class TeacherScores(_Msg, frozen=True, kw_only=True):
    """The answer to a TeacherRequest: log pi_T of each id of its `ids`, in the same layout, or
    `error` (a request the teacher could not score) and no frame."""

    request_id: int
    logprobs: TensorRef | None = None  # float32 [sum(lengths), N]
    error: str = ""


class LauncherSnapshot(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """What only the launcher knows, for the monitor: run shape, phase, admission credits, health.

    The scheduler builds it (`scheduler/records.py`) and writes it as a `launcher` record to
    metrics.jsonl and the monitor's stream (JSON, `type` and `time_s` added there); monitors read
    it back as a record and never import the scheduler. Untagged: the record's `type` names it.
    """

    phase: str  # the launcher's phase; the final snapshot's status once the run has ended
    mode: str
    policy: str  # the staleness policy
    total_steps: int
    groups_per_step: int
    samples_per_group: int
    num_generators: int
    max_staleness_bound: int
    step: int
    policy_version: int
    trajectories_generated: int
    trajectories_trained: int
    tokens_generated: int
    groups_admitted: int
    groups_in_flight: int
    # Credits: groups admitted but not yet trained (window) or not yet out of the pool (pool),
    # against (max_staleness + 1) x groups_per_step.
    credits_used: int
    credits_total: int
    credits_free: int
    restarts: int
    failure: str | None
    waiting_workers: int = 0  # workers on other hosts waiting for a remote generator slot to free
    final: bool = False  # the last snapshot of the run (omitted from the record otherwise)
    status: str = ""  # final only: "completed", "failed" or "interrupted"


Message = (
    Hello
    | PromptTask
    | PromptTasks
    | Trajectory
    | Trajectories
    | TaskDone
    | TasksDone
    | WeightsPublished
    | WeightsLoaded
    | DataEndpoint
    | Evaluated
    | EvalDue
    | StepDone
    | GroupsLeft
    | Metrics
    | Heartbeat
    | Fatal
    | Shutdown
    | Join
    | Welcome
    | JoinRefused
    | FileRequest
    | FileChunk
    | TeacherRequest
    | TeacherScores
)
