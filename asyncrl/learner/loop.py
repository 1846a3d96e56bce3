"""The per-step data flow shared by every learner rank: an inbox per step and the loop that feeds
a `Trainer` as trajectories arrive.

Place in the data flow: the learner service (rank 0, `service.py`) and the data-parallel rank
workers (`ranks.py`) each receive trajectories on their own socket and `add` them here; their
train loops await `run_step(step)` for every step. Window s (the groups admitted for step s) is
trained at policy_version s: its trajectories wait in the inbox until step s - 1 is done, then
each is trained as soon as the trainer can take it (streaming), or, when the objective cannot
stream, all at once when the rank's share of the window is complete. Streaming trains in chunks:
while more of the window is to come, a run of work starts once `min_chunk` trajectories wait
(`learner.min_chunk`), and the window's last ones train as they arrive, so the step still ends
about one arrival after its last trajectory.

Data parallelism: group j belongs to rank j % world_size (all of its samples, so S0/S1 never
cross ranks); `local_window_size` counts a rank's trajectories of one step.

`StepLoop` is also the learner service's step source for `buffer.mode = "window"`; the pool mode's
`PoolLoop` (`pool.py`) has the same interface, so the service chooses one at start and never asks
which: `accepts`, `resume`, `overlap_close`, `step_report`, `take_left` and `metrics` say what the
service does differently.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from asyncrl.learner.chunking import ChunkChoice, fixed_min_chunk
from asyncrl.learner.cores import resolve_threads
from asyncrl.learner.schedule import StepSchedule
from asyncrl.learner.step import StepResult, TrainSample
from asyncrl.learner.trainer import Trainer
from asyncrl.models.policy import PolicyLM

if TYPE_CHECKING:
    from asyncrl.config import Config
    from asyncrl.config_sections import LearnerConfig
    from asyncrl.learner.objective import Objective

log = logging.getLogger(__name__)


def window_size(lrn: LearnerConfig) -> int:
    """Trajectories of one step's window. Every rank sees all of them (lockstep ranks each train
    their share of every chunk, `plans.py`)."""
    return lrn.groups_per_step * lrn.samples_per_group


def canonical_order(config: Config) -> bool:
    """Whether the step loops offer each window in traj-id order (sync runs, `learner.sync_order`):
    every rank of a run decides the same."""
    return (
        config.mode == "sync" and config.buffer.mode == "window" and config.learner.sync_order == "canonical"
    )


def canonical_chunk(config: Config) -> int:
    """Trajectories per chunk a canonical-order step loop offers at once (0: arrival order): the
    whole window unless `learner.min_chunk` names a size (a window in one chunk trains at 0.95x
    arrival order's speed on the default sync job, chunks of 64 at 0.71x: docs/learner.md)."""
    if not canonical_order(config):
        return 0
    lrn = config.learner
    return window_size(lrn) if lrn.min_chunk == "auto" else lrn.min_chunk


def sample_stride(config: Config) -> int:
    """PromptTask.sample_stride of the run: sampling.budget_max with rollout budgets, else 0."""
    s = config.sampling
    return s.budget_max if s.budget == "uncertainty" else 0


def load_policy_model(path: Path, config: Config) -> tuple[PolicyLM, object]:
    """The learner's policy on its device, wrapped for its ranks and precision (`parallel.py`),
    and the tokenizer. On a wrapped model every rank calls this, in the same order."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from asyncrl.learner import parallel

    lrn = config.learner
    torch.set_num_threads(resolve_threads(lrn.threads, cpus=lrn.cpus, world_size=lrn.world_size))
    torch.manual_seed(config.run.seed)
    tokenizer = AutoTokenizer.from_pretrained(path)
    lm = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    lm.train()
    if lrn.lora.rank:
        from asyncrl.learner.lora import apply_lora

        lm = apply_lora(lm, lrn.lora, seed=config.run.seed)
    policy = PolicyLM(lm, chunk_size=lrn.logprob_chunk_size, share_prefixes=lrn.shared_prefix)
    device = parallel.resolve_device(lrn.device, local_rank=parallel.local_rank())
    if parallel.is_wrapped(lrn):
        parallel.init_single_rank_group(device, config.monitor.heartbeat_timeout_s)  # no-op with ranks
        parallel.parallelize(
            policy,
            world_size=lrn.world_size,
            sharding=lrn.sharding,
            mixed_precision=lrn.mixed_precision,
            cpu_offload=lrn.cpu_offload,
            activation_checkpointing=lrn.activation_checkpointing,
            device=device,
        )
    else:
        if lrn.activation_checkpointing:
            lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        policy.to(device)
    return policy, tokenizer


def gradient_mode(fallback: str) -> str:
    """How the learner turns trajectories into gradients, as the log and the launcher state it."""
    if fallback:
        return f"learner: whole-batch steps (no gradient streaming): {fallback}"
    return "learner: streaming per-trajectory gradients"


def build_trainer(config: Config, actor: PolicyLM, *, pad_token_id: int) -> Trainer:
    from asyncrl.config_objective import check_objective_config, check_staleness_policy
    from asyncrl.learner.objective import Objective

    lrn = config.learner
    policy = check_staleness_policy(config.staleness)
    check_objective_config(config, policy)  # also at load; here for a config that skipped it
    objective = Objective.from_config(config)
    streams = not objective.fallback_reason(policy)
    trainer = Trainer(
        actor,
        objective,
        policy,
        lr=lrn.lr,
        optimizer=lrn.optimizer,
        weight_decay=lrn.weight_decay,
        max_grad_norm=lrn.max_grad_norm,
        temperature=config.sampling.temperature,
        top_p=config.sampling.top_p,
        pad_token_id=pad_token_id,
        group_size=lrn.samples_per_group,
        micro_batch_size=lrn.micro_batch_size,
        max_open_groups=max_open_groups(lrn, actor, objective),
        max_staleness=config.effective_max_staleness,
        max_tokens_per_microbatch=lrn.max_tokens_per_microbatch,
        chunk_groups=-(-fixed_min_chunk(lrn.min_chunk) // lrn.samples_per_group),
        threads=resolve_threads(lrn.threads, cpus=lrn.cpus, world_size=lrn.world_size),
        # A canonical-order stream (reproducible sync runs) keeps its thread count, so its pieces
        # too (whole-batch steps adapt as before: a sync learner waits, and shrinks to one thread).
        adaptive_threads=lrn.threads == "auto" and not (canonical_order(config) and streams),
        max_nonfinite_steps=lrn.max_nonfinite_steps,
    )
    from asyncrl.learner.distill_work import install_control

    install_control(trainer, config)  # opd: horizon, position and teachability weights (opd_control.py)
    return trainer


def max_open_groups(lrn: LearnerConfig, actor: PolicyLM, objective: Objective) -> int:
    """Open groups a streaming rank may hold: learner.stream_memory_mb over one group's buffers
    (parameter-sized, float32, `BUFFERS_PER_OPEN_GROUP` of them for the estimator), at least 1."""
    from asyncrl.learner.streaming import BUFFERS_PER_OPEN_GROUP

    per_group = BUFFERS_PER_OPEN_GROUP.get(getattr(objective, "stream_estimator", "opd"), 0)
    trainable = sum(p.numel() for p in actor.parameters() if p.requires_grad)
    group_bytes = per_group * trainable * 4
    if group_bytes == 0:
        return lrn.groups_per_step
    return max(1, int(lrn.stream_memory_mb * 2**20 // group_bytes))


class StepLoop:
    # The next step may train while the last version is published and reported: its update
    # waits for that (`before_update`), so the weights stay put meanwhile.
    overlap_close = True

    def __init__(
        self,
        trainer: Trainer,
        window_size: Callable[[int], int],
        *,
        sink: Callable[[int, list[TrainSample]], StepResult] | None = None,
        before_update: Callable[[], Awaitable[None]] | None = None,
        min_chunk: int = 1,
        chunking: ChunkChoice | None = None,
        on_step_end: Callable[[StepSchedule], None] | None = None,
        canonical_chunk: int = 0,
        sample_stride: int = 0,
    ) -> None:
        if min_chunk < 1:
            raise ValueError(f"min_chunk must be >= 1, got {min_chunk}")
        self.trainer = trainer
        # min_chunk "auto": streaming chunks or whole windows, by measurement (`chunking.py`).
        self.chunking = chunking
        self.note = ""  # the decision the last step made, for its StepDone
        # Streaming starts a run of work once this many trajectories wait, or once fewer than
        # this many of the window are still to come (`learner.min_chunk`).
        self.min_chunk = min_chunk
        # Awaited before each optimizer update: the learner service's publish of the previous
        # version reads the weights while this step's gradients accumulate, not after.
        self.before_update = before_update
        self.window_size = functools.cache(window_size)  # asked once per trajectory
        self.sink = sink
        self.inbox: dict[int, list[TrainSample]] = {}
        self.taken_step = -1  # the step being trained and what it took from the inbox so far
        self.taken: list[TrainSample] = []
        self.received: dict[int, int] = {}  # trajectories received per step
        self.last_arrival: dict[int, float] = {}  # when each step's last trajectory arrived
        self.arrived = asyncio.Event()
        self.stopping = False
        self.idle_s = 0.0
        self.busy_s = 0.0
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="learner-compute")
        # Given each step's schedule (offers, work calls, threads) when it ends, off the loop
        # (run.record_schedule: `schedule.ScheduleRecorder.write`, for `asyncrl replay`).
        self.on_step_end = on_step_end
        # > 0: offer a window's trajectories in traj-id order, in chunks of this many (rounded up
        # to whole groups), each followed by all the work it makes possible (learner.sync_order =
        # "canonical" in sync mode, `canonical_chunk`): two runs train bitwise alike.
        self.canonical_chunk = canonical_chunk
        self.canonical = canonical_chunk > 0
        self.next_id = 0  # canonical order: the traj id due next
        # Rollout budgets (sampling.budget): traj ids are group_id * sample_stride + sample_index
        # and groups differ in size; 0: a window's traj ids are consecutive.
        self.sample_stride = sample_stride

    def add(self, step: int, sample: TrainSample) -> None:
        """Loop thread: a validated, deduplicated trajectory of `step` arrived."""
        self.inbox.setdefault(step, []).append(sample)
        self.received[step] = self.received.get(step, 0) + 1
        if self.received[step] == self.window_size(step):
            self.last_arrival[step] = time.perf_counter()
        self.arrived.set()

    def accepts(self, step: int, version: int) -> bool:
        """Whether a trajectory admitted for `step` can still be trained at `version`: a window
        is trained at its own version, so one for a past step never is."""
        return step >= version

    def resume(self, version: int, held: list[tuple[int, TrainSample, dict]]) -> None:
        """Resume at `version`: put a checkpoint's held trajectories back into the inbox."""
        for step, sample, _ in held:
            self.add(step, sample)

    def step_report(self) -> dict:
        """StepDone's mode-specific fields for the step just finished: a decision of
        `chunking`, if this step made one."""
        note, self.note = self.note, ""
        return {"note": note} if note else {}

    def take_left(self) -> dict | None:
        """GroupsLeft's fields for what left the learner's buffer since the last call, or None
        (always None here: GroupsLeft is a pool-mode message)."""
        return None

    def metrics(self) -> dict[str, float]:
        """Mode-specific buffer metrics (none for windows beyond `depth`)."""
        return {}

    def held(self, after_step: int) -> list[tuple[int, TrainSample]]:
        """Loop thread: the (step, sample) pairs received for steps after `after_step` and not
        trained into an applied update, in arrival order (what a checkpoint must keep). Includes
        what an unfinished step `after_step + 1` had already taken from the inbox."""
        out = [(self.taken_step, s) for s in self.taken] if self.taken_step > after_step else []
        return out + [(step, s) for step in sorted(self.inbox) if step > after_step for s in self.inbox[step]]

    def depth(self) -> tuple[int, int]:
        """(trajectories waiting in the inbox, windows they belong to): the learner's buffer."""
        return sum(len(v) for v in self.inbox.values()), sum(1 for v in self.inbox.values() if v)

    def stop(self) -> None:
        self.stopping = True
        self.arrived.set()

    async def _wait_for_data(self) -> None:
        start = time.perf_counter()
        self.arrived.clear()
        await self.arrived.wait()
        self.idle_s += time.perf_counter() - start

    async def _busy(self, fn, *args):
        start = time.perf_counter()
        out = await self.compute(fn, *args)
        self.busy_s += time.perf_counter() - start
        return out

    def compute(self, fn, *args) -> Awaitable:
        """Run `fn(*args)` on the learner's one compute thread. One thread, not the event loop's
        pool: torch's intra-op thread team belongs to the thread that calls it, and training that
        hops between pool threads runs several teams on the same cores (learner.threads = 2
        then trained slower than 1; bench/README.md, "Baseline")."""
        return asyncio.get_running_loop().run_in_executor(self._executor, functools.partial(fn, *args))

    async def run_step(self, step: int) -> StepResult | None:
        """Train step `step` and apply its update; None when stopping first."""
        trainer = self.trainer
        expected = self.window_size(step)
        trainer.begin_step(step, window_groups=expected // trainer.group_size)
        self.taken_step, self.taken = step, []
        whole_window = self.sink is not None or bool(trainer.fallback)
        threads = trainer.active_threads if self.on_step_end is not None else 0
        calls: list[int] = []  # the offered count at each `work()` call (the replay schedule)
        begin = time.perf_counter()
        if whole_window:
            samples = await self._whole_window(step, expected)
            if samples is None:
                return None
            if self.sink is not None:
                return await self.compute(self.sink, step, samples)
            await self._busy(trainer.batch_backward, samples)
        elif not await self._stream(step, expected, calls):
            return None
        if self.before_update is not None:
            await self.before_update()
        result = await self._busy(trainer.finish_step)
        if self.on_step_end is not None:
            await asyncio.to_thread(
                self.on_step_end, StepSchedule(step, self.taken, calls, whole_window, threads)
            )
        if self.chunking is not None and (choice := self.chunking.observe(time.perf_counter() - begin)):
            log.info("%s", choice)
            self.note = choice
        return result

    async def _whole_window(self, step: int, expected: int) -> list[TrainSample] | None:
        """The step's whole window, once it is in; None when stopping first."""
        while not self.stopping:
            if len(self.inbox.get(step, ())) == expected:
                samples = self.inbox.pop(step, [])
                self.taken.extend(samples)
                return samples
            await self._wait_for_data()
        return None

    async def _stream(self, step: int, expected: int, calls: list[int]) -> bool:
        """Offer the step's trajectories as they come and train what the trainer can; False
        when stopping first. In canonical order each chunk is offered whole and followed by all
        the work it makes possible, so the units (and the arithmetic) do not depend on when
        trajectories arrived."""
        trainer = self.trainer
        min_chunk = self.chunking.min_chunk() if self.chunking is not None else self.min_chunk
        # window mode: the window's traj ids are consecutive (with budgets: its groups are)
        self.next_id = step * (expected // trainer.group_size * self.sample_stride or expected)
        offered = 0
        draining = False  # a run of work started, continued while there is work
        while not self.stopping:
            chunks = self._take(step, expected)
            for chunk in chunks:
                for sample in chunk:
                    trainer.offer(sample)
                    self.taken.append(sample)
                offered += len(chunk)
                while self.canonical and trainer.has_work():
                    calls.append(offered)
                    await self._busy(trainer.work)
            if chunks and self.canonical:
                continue  # what arrived while it trained is taken before waiting for more
            # Lockstep ranks train the chunks the trainer picks from the offered sequence alone.
            if trainer.has_work() and (
                trainer.lockstep
                or draining
                or trainer.num_waiting() >= min_chunk
                or expected - offered < min_chunk
            ):
                draining = True
                calls.append(offered)
                if await self._busy(trainer.work):
                    continue
            draining = False
            if offered == expected:
                self.inbox.pop(step, None)
                return True
            await self._wait_for_data()
        return False

    def _take(self, step: int, expected: int) -> list[list[TrainSample]]:
        """What to offer now of the step's received trajectories: all of them in arrival order
        (one chunk), or in canonical order the complete chunks of whole groups in traj-id order
        from the next one due (`canonical_chunk` rounded up to whole groups; the window's last
        chunk may be shorter); the rest wait in the inbox (a checkpoint keeps them, `held`)."""
        if not self.canonical:
            fresh = self.inbox.pop(step, [])
            return [fresh] if fresh else []
        if self.sample_stride:
            return self._take_groups(step, expected)
        group = self.trainer.group_size
        size = -(-self.canonical_chunk // group) * group
        end = step * expected + expected
        by_id = {s.traj_id: s for s in self.inbox.get(step, ())}
        chunks = []
        while self.next_id < end:
            ids = range(self.next_id, min(self.next_id + size, end))
            if any(i not in by_id for i in ids):
                break
            chunks.append([by_id.pop(i) for i in ids])
            self.next_id = ids.stop
        self.inbox[step] = list(by_id.values())
        return chunks

    def _take_groups(self, step: int, expected: int) -> list[list[TrainSample]]:
        """`_take` in canonical order with groups of unequal sizes (rollout budgets, traj ids
        `group_id * sample_stride + sample_index`): chunks of ceil(canonical_chunk /
        samples_per_group) whole groups in group order, each group's members by sample index,
        a group complete once its own size's members are in."""
        group_size = self.trainer.group_size
        per_chunk = -(-self.canonical_chunk // group_size)
        end = (step + 1) * (expected // group_size)
        by_group: dict[int, list[TrainSample]] = {}
        for s in self.inbox.get(step, ()):
            by_group.setdefault(s.group_id, []).append(s)

        def complete(gid: int) -> bool:
            members = by_group.get(gid)
            return bool(members) and len(members) == (members[0].group_size or group_size)

        chunks = []
        group = self.next_id // self.sample_stride
        while group < end:
            gids = range(group, min(group + per_chunk, end))
            if not all(complete(g) for g in gids):
                break
            chunks.append([s for g in gids for s in sorted(by_group.pop(g), key=lambda s: s.sample_index)])
            group = gids.stop
        self.next_id = group * self.sample_stride
        self.inbox[step] = [s for members in by_group.values() for s in members]
        return chunks

    def tail_s(self, step: int, begin: float, end: float) -> float:
        """From the step's last trajectory arriving (or the step's start, if later) to `end`."""
        self.received.pop(step, None)
        return end - max(self.last_arrival.pop(step, begin), begin)
