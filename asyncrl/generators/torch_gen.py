"""The built-in `torch` generator: an in-process Hugging Face causal LM sampling in batches.

Loads the model from a local directory, samples in batched, KV-cached decode steps (off the event
loop, on a worker thread), scores completions with the task's exact verifier, and swaps in new
weights whenever they are offered: between batches, or mid-generation between decode steps, where
the in-flight mode (`keep`, `retract`, `abort`; see `asyncrl/models/sampling.py`) decides how the batch goes on.

The service feeds it through `generate_stream` (`base.StreamingGenerator`): samples come from the
service's feed and every finished sample is handed on at once. `generators.batching` says when
new samples join the decoding batch: "continuous" (continuous batching, as inference servers
do): new samples fill the free slots of its max_batch_groups x num_samples once taking them pays
(`refill.py`: enough slots free, and the samples running will keep the batch going long enough
for the new ones to ride along), so a finished sample's slot soon holds a new one; "batch": a batch of up to max_batch_groups
groups at a time, run until its last sample is done. `generate(tasks)` (the plugin API) samples
whole groups in one batch.

With `opd.enabled` the generator also samples N - 1 extra tokens per position next to each
generated one and has a teacher (`teachers.py`) score all N with one batched forward per batch,
so every rollout carries the [T, N] arrays of on-policy distillation (`generators/opd.py`,
docs/opd.md). The teacher is a directory loaded here once and never updated (`opd.teacher`, or
the shipped `asyncrl/assets/teacher_model`), the teacher process every generator shares
(`opd.placement = "service"`, `teacher_client.py`), or the policy itself on the task's privileged
prompts (`opd.teacher = "self"`), whose weights follow the updates this generator applies.

Weights arrive verified in fresh CPU tensors (`offer_weights`, from the service's fetcher, or
`load_weights` from a shard directory) and are copied into the model's parameters only when
complete, so a corrupt or missing shard never leaves the model half-updated. Once applied, a
version's weight-load canary is scored before the next decode step (`score_canary`,
docs/weights.md "Canary").

Placement: the model (and the teacher) live on `GeneratorContext.device` (`generators.device`,
resolved: a GPU when there is one) in `GeneratorContext.dtype` (the learner's publish dtype).
Offered weights stay on the CPU until applied, then are copied into the device's parameters.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from asyncrl.generators.base import GeneratorContext, Rollout
from asyncrl.generators.feed import Draw, SampleFeed
from asyncrl.generators.refill import RefillPolicy
from asyncrl.generators.rollouts import OpdArrays, RolloutBuilder
from asyncrl.generators.teacher_routing import GapTally
from asyncrl.messages import CanaryScores, PromptTask

if TYPE_CHECKING:  # at run time in `_make_teacher`: resolving the class must not import torch
    from asyncrl.generators.teachers import Teacher

log = logging.getLogger(__name__)

PROMPT_TEXTS_KEPT = 4096  # decoded prompts remembered per stream (one per task)


def load_teacher(path: str, student_tokenizer, *, device: str = "cpu", dtype: str = "float32"):
    """The OPD teacher from `path` (empty: the shipped teacher), in eval mode, on `device` in
    `dtype` (the student's: the generator's device and the publish dtype).

    Its tokenizer (when its directory has one) must be the student's: the teacher scores the
    student's token ids, so the ids must mean the same strings.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from asyncrl.models.default import TEACHER_MODEL_DIR

    teacher_dir = Path(path) if path else TEACHER_MODEL_DIR
    if not (teacher_dir / "config.json").is_file():
        raise ValueError(
            f"opd.teacher: no Hugging Face model at {teacher_dir} (config.json missing); build the shipped "
            "one with `asyncrl sft --teacher --out asyncrl/assets/teacher_model` or point opd.teacher at one"
        )
    if (teacher_dir / "tokenizer_config.json").is_file():
        teacher_tok = AutoTokenizer.from_pretrained(teacher_dir)
        if teacher_tok.get_vocab() != student_tokenizer.get_vocab():
            raise ValueError(
                f"opd.teacher: the tokenizer at {teacher_dir} differs from the student's; "
                "the teacher must share the student's vocabulary"
            )
    teacher = AutoModelForCausalLM.from_pretrained(teacher_dir, dtype=getattr(torch, dtype)).eval()
    if teacher.get_output_embeddings().weight.shape[0] < len(student_tokenizer):
        raise ValueError(
            f"opd.teacher: the model at {teacher_dir} has {teacher.get_output_embeddings().weight.shape[0]} "
            f"output tokens, fewer than the student's {len(student_tokenizer)}"
        )
    teacher.requires_grad_(False)
    teacher.to(device)
    log.info("OPD teacher loaded from %s on %s in %s", teacher_dir, device, dtype)
    return teacher


class TorchGenerator:
    """Samples with `asyncrl.models.sampling.generate` from a `transformers` model."""

    def __init__(self) -> None:
        self._version = 0
        self._model = None
        self._tokenizer = None
        self._ctx: GeneratorContext | None = None
        self._lock = threading.Lock()  # guards _pending (offered from the loop, applied by the sampler)
        self._pending: tuple[int, Mapping, Callable[[int], None] | None] | None = None
        self.num_inflight_updates = 0
        self._teacher: Teacher | None = None
        self._opd_samples = 0  # N cached ids per position; 0 = OPD off
        self.teacher_s = 0.0  # time spent in teacher forwards
        self._router = None  # opd.teachers: the domain -> teacher routing (teacher_routing.Router)
        self._gap = GapTally()  # ... and the gap per teacher and domain since the last report
        self._refill: RefillPolicy | None = None  # continuous batching: when to take samples
        self._refill_key: tuple | None = None
        self._turns = None  # env.kind set: the TorchTurnServer that decodes episodes' turns
        self._episodes = None  # ... and their EpisodeRunner (generators/episodes.py)

    @staticmethod
    def check_config(config) -> None:
        """`asyncrl launch` calls this before any process starts: the environment must load."""
        if config.env.kind:
            from asyncrl.environments.base import resolve_environment

            resolve_environment(config.env.kind)

    def setup(self, ctx: GeneratorContext) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from asyncrl.models.sampling import resolve_device

        device = resolve_device(ctx.device, field="generators.device")  # before loading anything
        torch.set_num_threads(ctx.threads)
        self._ctx = ctx
        self._tokenizer = AutoTokenizer.from_pretrained(ctx.model_path)
        model = AutoModelForCausalLM.from_pretrained(ctx.model_path, dtype=getattr(torch, ctx.dtype)).eval()
        self._model = model.to(device)
        log.info("generator %s: model on %s in %s", ctx.generator_id, device, ctx.dtype)
        self._run_seed = ctx.run_seed
        self._inflight = ctx.inflight
        self._rollouts = RolloutBuilder.for_task(ctx.task, self._tokenizer)
        if ctx.opd is not None and ctx.opd.samples_per_position:
            from asyncrl.generators.teacher_routing import Router, build_teacher

            # One teacher, or several routed by domain (opd.teachers), each cached with opd.cache.
            self._teacher = build_teacher(ctx, lambda path, name: self._make_teacher(ctx, device, path, name))
            self._router = Router.from_config(ctx.opd)  # domains for the gap, with one teacher too
            self._opd_samples = ctx.opd.samples_per_position
        if ctx.env is not None and ctx.env.kind:
            self._setup_episodes(ctx)

    def _setup_episodes(self, ctx: GeneratorContext) -> None:
        """Agentic episodes (`env.kind`): turns decode on a TorchTurnServer, episodes run on the
        event loop (`generators/episodes.py`)."""
        from asyncrl.generators.episodes import Episodes, TorchTurnServer, stop_token_ids

        if self._teacher is not None:
            raise ValueError(
                "env.kind with opd.enabled is not supported yet: episodes carry no teacher scores"
            )
        stops = list(stop_token_ids(self._tokenizer, list(ctx.env.stop_tokens)))
        self._turns = TorchTurnServer(self, stop_ids=stops, capacity=ctx.env.max_episodes)
        max_context = int(getattr(self._model.config, "max_position_embeddings", 0) or 0)
        self._episodes = Episodes(ctx, self._turns, self._tokenizer, max_context=max_context)

    def turn_sampler(self, params, stop_ids):
        """The Sampler of episode turns: a turn also ends at any of `stop_ids`."""
        return self._sampler(params, stop_ids)

    @property
    def env_counters(self) -> dict[str, float]:
        """The episode counters (`env/...` metrics); empty without an environment."""
        return {} if self._episodes is None else self._episodes.counters()

    async def _episode_stream(self, feed: SampleFeed) -> AsyncIterator[list[Rollout]]:
        assert self._episodes is not None and self._turns is not None
        self._turns.start()
        try:
            async for rollouts in self._episodes.stream(feed):
                yield rollouts
        finally:
            await asyncio.to_thread(self._turns.stop)

    def _make_teacher(self, ctx: GeneratorContext, device, path: str, name: str) -> Teacher:
        """The teacher at `path` (opd.teacher, or the entry `name` of opd.teachers)."""
        from asyncrl.generators.teachers import Horizon, ModelTeacher, SelfTeacher

        opd, pad = ctx.opd, self._tokenizer.pad_token_id
        if path == "self":
            return SelfTeacher(
                self._model,
                weights=opd.self_weights,
                lag=opd.self_lag,
                ewma_decay=opd.self_ewma_decay,
                pad_token_id=pad,
                top_k=opd.teacher_top_k,
                horizon=Horizon.from_config(opd),
            )
        if opd.placement == "service":
            if ctx.teacher is None:
                raise ValueError(
                    "opd.placement = 'service': this generator was given no shared teacher "
                    "(GeneratorContext.teacher); `asyncrl launch` starts one and connects every generator"
                )
            return ctx.teacher[name] if name else ctx.teacher
        model = load_teacher(path, self._tokenizer, device=str(device), dtype=ctx.dtype)
        return ModelTeacher(
            model, pad_token_id=pad, top_k=opd.teacher_top_k, horizon=Horizon.from_config(opd)
        )

    @property
    def version(self) -> int:
        return self._version

    @property
    def model(self):
        return self._model

    @property
    def teacher(self) -> Teacher | None:
        return self._teacher

    @property
    def teacher_version(self) -> int:
        """The self-teacher's policy_version now; -1 for a teacher outside the policy (or none)."""
        return getattr(self._teacher, "version", -1)

    @property
    def tokenizer(self):
        return self._tokenizer

    # ------------------------------------------------------------------ streaming
    async def generate_stream(self, feed: SampleFeed) -> AsyncIterator[list[Rollout]]:
        """Sample what `feed` hands out, on a worker thread; yield each decode step's finished
        samples as Rollouts. Ends when nothing is running and the feed gives nothing. With an
        environment, every sample is an episode (`_episode_stream`)."""
        if self._episodes is not None:
            async for rollouts in self._episode_stream(feed):
                yield rollouts
            return
        loop = asyncio.get_running_loop()
        arrived: asyncio.Queue[list[Rollout] | None] = asyncio.Queue()
        stop = threading.Event()

        def emit(rollouts: list[Rollout]) -> None:  # on the sampling thread
            loop.call_soon_threadsafe(arrived.put_nowait, rollouts)

        worker = asyncio.ensure_future(asyncio.to_thread(self.stream_sync, feed, emit, stop))
        # After every emit: the thread's return reaches the loop behind its emits.
        worker.add_done_callback(lambda _: arrived.put_nowait(None))
        try:
            while (rollouts := await arrived.get()) is not None:
                yield rollouts
            await worker  # raises what the sampling thread raised
        finally:
            stop.set()  # the consumer went away: the thread stops at its next step

    def stream_sync(
        self, feed: SampleFeed, emit: Callable[[list[Rollout]], None], stop: threading.Event
    ) -> None:
        """The sampling thread of `generate_stream`: admit draws by `generators.batching`, step,
        emit finished samples; return when idle (or when `stop` is set)."""
        import torch

        from asyncrl.models.sampling import SampleRequest, sample_seed

        assert self._ctx is not None and self._tokenizer is not None, "setup() was not called"
        continuous = self._ctx.batching == "continuous"
        max_groups = self._ctx.max_batch_groups
        sampler = params = None  # the Sampler and the SamplingParams it samples with
        capacity = 0  # rows: max_batch_groups x the samples of a group
        texts: dict[int, str] = {}
        with torch.no_grad():
            while not stop.is_set():
                running = 0 if sampler is None else sampler.num_running
                draws: list[Draw] = []
                if running == 0:
                    self.apply_pending()  # nothing in flight: a safe point for new weights
                    draws = feed.take(sys.maxsize, max_groups=max_groups)
                    if draws:
                        # rollout budgets: groups of unequal sizes; the largest sets the rows
                        capacity = max_groups * max(d.task.num_samples for d in draws)
                        if sampler is None or params != draws[0].task.sampling:
                            params = draws[0].task.sampling
                            sampler = self._sampler(params)
                        self._refill_policy(params, capacity)
                elif continuous and self._refill.should_take(running, sampler.tokens_so_far()):
                    draws = feed.take(capacity - running, like=params)
                if draws:
                    assert sampler is not None
                    sampler.add(
                        [
                            SampleRequest(
                                d,
                                d.task.prompt_ids,
                                sample_seed(self._run_seed, d.task.group_id, d.sample_index, d.task.attempt),
                            )
                            for d in draws
                        ]
                    )
                if sampler is None or sampler.num_running == 0:
                    return
                updates = sampler.num_weight_updates
                finished = sampler.step()
                self.num_inflight_updates += sampler.num_weight_updates - updates
                if finished:
                    self._refill.observe([len(f.completion_ids) for f in finished])
                    if len(texts) > PROMPT_TEXTS_KEPT:
                        texts.clear()
                    emit(self._finished_rollouts(finished, texts))

    def _refill_policy(self, params, capacity: int) -> None:
        """The continuous batching policy of these params and slots, kept across streams (it
        learns the lengths the model samples)."""
        key = (params, capacity)
        if self._refill_key != key:
            self._refill_key = key
            self._refill = RefillPolicy(max_new_tokens=params.max_new_tokens, capacity=capacity)

    def _sampler(self, params, stop_ids=()):
        from asyncrl.models.sampling import Sampler

        tok = self._tokenizer
        return Sampler(
            self._model,
            max_new_tokens=params.max_new_tokens,
            temperature=params.temperature,
            top_p=params.top_p,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
            current_version=lambda: self._version,
            poll_update=self.apply_pending,
            inflight=self._inflight,
            num_extra_samples=max(0, self._opd_samples - 1),
            ignore_eos=params.ignore_eos,
            stop_token_ids=stop_ids,
        )

    def _finished_rollouts(self, finished, texts: dict[int, str]) -> list[Rollout]:
        """Rollouts of a step's finished samples (`Sampler.step`, keys are `Draw`s), scored by
        the task and, with OPD, by the teacher in one forward."""
        draws: list[Draw] = [f.key for f in finished]
        opd = None
        if self._teacher is not None:
            opd = self._score_with_teacher(
                [d.task for d in draws],
                [f.completion_ids for f in finished],
                [f.logprobs for f in finished],
                [f.extra_ids for f in finished],
                [f.extra_logprobs for f in finished],
            )
        out = []
        for j, (d, f) in enumerate(zip(draws, finished, strict=True)):
            if d.task.task_id not in texts:
                texts[d.task.task_id] = self._rollouts.prompt_text(d.task)
            out.append(
                self._rollouts.build(
                    d.task,
                    d.sample_index,
                    completion_ids=f.completion_ids,
                    behavior_logprobs=f.logprobs,
                    token_versions=f.versions,
                    finish_reason=f.finish_reason,
                    prompt_text=texts[d.task.task_id],
                    opd=None if opd is None else opd[j],
                )
            )
        return out

    # ------------------------------------------------------------------ batches
    def generate_sync(self, tasks: Sequence[PromptTask]) -> list[Rollout]:
        from asyncrl.models.sampling import generate, sample_seed

        assert self._ctx is not None and self._tokenizer is not None, "setup() was not called"
        tok = self._tokenizer
        prompts, owners = [], []
        for task in tasks:
            for k in range(task.num_samples):
                prompts.append(task.prompt_ids)
                owners.append((task, k))
        s = tasks[0].sampling
        out = generate(
            self._model,
            prompts,
            max_new_tokens=s.max_new_tokens,
            temperature=s.temperature,
            top_p=s.top_p,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
            seeds=[sample_seed(self._run_seed, task.group_id, k, task.attempt) for task, k in owners],
            current_version=lambda: self._version,
            poll_update=self.apply_pending,
            inflight=self._inflight,
            num_extra_samples=max(0, self._opd_samples - 1),
            ignore_eos=s.ignore_eos,
        )
        self.num_inflight_updates += out.num_weight_updates
        opd = None
        if self._teacher is not None:
            num = len(prompts)
            opd = self._score_with_teacher(
                [task for task, _ in owners],
                out.completion_ids,
                out.logprobs,
                out.extra_ids or [None] * num,
                out.extra_logprobs or [None] * num,
            )
        prompt_texts = {t.task_id: self._rollouts.prompt_text(t) for t in tasks}
        return [
            self._rollouts.build(
                task,
                k,
                completion_ids=ids,
                behavior_logprobs=logps,
                token_versions=versions,
                finish_reason=finish,
                prompt_text=prompt_texts[task.task_id],
                opd=None if opd is None else opd[j],
            )
            for j, ((task, k), ids, logps, versions, finish) in enumerate(
                zip(owners, out.completion_ids, out.logprobs, out.versions, out.finish_reasons, strict=True)
            )
        ]

    def _score_with_teacher(self, tasks, ids, logps, extra_ids, extra_logps) -> list[OpdArrays]:
        """The [T][N] arrays of on-policy distillation, per sample (one teacher call); sample i
        is a completion of `tasks[i]`."""
        from asyncrl.generators.opd import as_scoring, cache_arrays
        from asyncrl.generators.teacher_routing import gap_keys, score_routed

        assert self._teacher is not None
        start = time.perf_counter()
        caches = [cache_arrays(*sample) for sample in zip(ids, logps, extra_ids, extra_logps, strict=True)]
        scores, versions, teacher_ids = score_routed(self._teacher, tasks, [ids_TN for ids_TN, _ in caches])
        self.teacher_s += time.perf_counter() - start
        out = []
        for task, (ids_TN, behav_TN), scored, version, teacher_id in zip(
            tasks, caches, scores, versions, teacher_ids, strict=True
        ):
            scored = as_scoring(scored)
            keys = gap_keys(self._router, task, teacher_id)
            self._gap.add(keys, behav_TN[:, 0], scored.logprobs[:, 0])
            out.append(OpdArrays.of(ids_TN, behav_TN, scored, version)._replace(teacher_id=teacher_id))
        return out

    def opd_metrics(self) -> dict[str, float]:
        """The teacher cache's counters and, with several teachers, the gap per teacher and per
        domain since the last call (`teacher_routing.GapTally`)."""
        from asyncrl.generators.teacher_routing import cache_counters

        return {} if self._teacher is None else cache_counters(self._teacher) | self._gap.take()

    async def generate(self, tasks: Sequence[PromptTask]) -> list[Rollout]:
        if self._episodes is not None:  # whole groups of episodes, through the same stream
            return await self._episodes.generate(tasks, self._episode_stream)
        if len({t.sampling for t in tasks}) > 1:
            # One batched call samples with one set of parameters; split mixed batches.
            out: list[Rollout] = []
            for t in tasks:
                out += await asyncio.to_thread(self.generate_sync, [t])
            return out
        return await asyncio.to_thread(self.generate_sync, tasks)

    # ------------------------------------------------------------------ weights
    def _check_state(self, version: int, state: Mapping) -> None:
        """Every parameter must be there with its shape and dtype, before anything is copied (on
        any device: the copy in `apply_pending` moves them)."""
        params = dict(self._model.named_parameters())
        missing = [n for n in params if n not in state]
        if missing:
            raise ValueError(f"weights version {version} lacks parameters: {missing[:5]}")
        for name, target in [*params.items(), *self._model.named_buffers()]:
            t = state.get(name)
            if t is not None and (t.shape != target.shape or t.dtype != target.dtype):
                raise ValueError(
                    f"weights version {version}: {name} is {t.dtype}{list(t.shape)}, "
                    f"the model has {target.dtype}{list(target.shape)}"
                )

    def offer_weights(
        self, version: int, state: Mapping, on_applied: Callable[[int], None] | None = None
    ) -> None:
        """Thread-safe: hold verified weights for `version` until the next safe point applies them.

        A newer offer replaces an older one not yet applied; an offer not newer than what the
        model holds is dropped. `on_applied(version)` runs in the thread that applies.
        """
        self._check_state(version, state)
        with self._lock:
            if version > self._version and (self._pending is None or version > self._pending[0]):
                self._pending = (version, state, on_applied)
        if self._turns is not None:
            self._turns.wake()  # an idle turn server applies them now

    def apply_pending(self) -> bool:
        """Copy offered weights into the model now, if any; True when the weights changed.

        Called by the sampler between decode steps and by the service between batches; never
        concurrently with a forward pass (both run on the thread that owns the model). The CPU
        tensors are copied into the parameters wherever these live; the copies are blocking, so
        the weights are in place when `on_applied` acks them.
        """
        import torch

        with self._lock:
            pending, self._pending = self._pending, None
        if pending is None:
            return False
        version, state, on_applied = pending
        targets = {**dict(self._model.named_buffers()), **dict(self._model.named_parameters())}
        with torch.no_grad():
            for name, tensor in state.items():
                target = targets.get(name)
                if target is not None:
                    target.copy_(tensor)
        self._version = version
        if (follow := getattr(self._teacher, "on_weights", None)) is not None:
            follow(version, state)  # a self-teacher's weights follow the policy's (opd.self_weights)
        if on_applied is not None:
            on_applied(version)
        return True

    def score_canary(self, ids: Sequence[Sequence[int]]) -> list[CanaryScores]:
        """The weight-load canary (`generators/canary.py`): log-probs of `ids` under the weights in
        the model now, one batched forward. Called on the thread that applied them (it owns the
        model), before the next decode step."""
        from asyncrl.kernels.canary import sequence_logprobs

        assert self._model is not None and self._tokenizer is not None, "setup() was not called"
        pad = self._tokenizer.pad_token_id or 0
        return [CanaryScores(engine="torch", logprobs=sequence_logprobs(self._model, ids, pad_token_id=pad))]

    def load_weights_sync(self, version: int, location: str) -> None:
        from asyncrl.transport.shard_read import read_shards

        state = read_shards(Path(location), version, verify=True)  # raises before the model is touched
        self.offer_weights(version, state)
        self.apply_pending()

    async def load_weights(self, version: int, location: str) -> None:
        await asyncio.to_thread(self.load_weights_sync, version, location)

    async def close(self) -> None:
        if self._episodes is not None:
            await self._episodes.aclose()
            self._episodes = None
        self._model = None
