"""The learner's optimizer-step engine (no sockets): streamed or whole-batch gradients, one update.

Place in the data flow: the learner service (`service.py`, and every other rank in `ranks.py`)
hands each received trajectory of the current step to `Trainer.offer`, calls `Trainer.work` while
there is work, and `Trainer.finish_step` once every trajectory of the step is in. The model,
optimizer and the staleness policy's extra inputs (EWMA parameters, snapshots of recent versions)
live here; what RL and on-policy distillation do differently inside a step lives in the recipe
the trainer picks once, from its objective (`recipes.py`).

Streaming (ALGORITHMS.md 5; `objective.py` says when it applies), on one plain rank. A step holds
three kinds of trajectory: streamed (one forward and backward on arrival, folded into the group's
S0/S1 sums of `StreamingAccumulator`), waiting (not yet processed) and deferred (its gradient
depends on sign(A): it waits for its group). `work` does one unit, preferring groups whose
rewards are all in: their waiting members train in one batched backward with known advantages,
and their streamed members fold. Otherwise it streams one waiting trajectory of an open group. So
the last reward of a step costs about one trajectory's (or one group's) backward.

Lockstep (several ranks, or an FSDP2-wrapped model: `parallel.py`, docs/learner.md). Every rank
sees every trajectory in the same order; `work` trains this rank's share of the next chunk of
complete groups, chosen from that order alone, so every rank runs the same forwards and backwards
and FSDP2's collectives pair up; the backward reduces the gradient over the ranks.

Whole-batch fallback: `batch_backward` trains the complete step at once (batch-global
corrections need every trajectory; lockstep ranks each train their share). Every path produces
the *sum* of per-trajectory loss gradients; `finish_step` all-reduces the step's scalar sums
(lockstep), divides by the global Z, clips, scales the learning rate (VCPO) and steps the
optimizer, unless the loss or the gradient norm is not finite (the step is skipped and counted;
`learner.max_nonfinite_steps` in a row raise `NonFiniteError`). With `learner.epochs` E > 1
(whole batches only) it then re-runs the batch E - 1 times under the updated model
(`epoch_plans`, filled by the recipe), each time with the same anchor log-probs (the policy at the
step's start), corrections and advantages, and steps again.
"""

from __future__ import annotations

import copy
import itertools
import logging
import math
import os
import threading
from collections import defaultdict
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, wait

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from asyncrl.learner.cores import CoreShare
from asyncrl.learner.microbatch import split_microbatches
from asyncrl.learner.objective import CombinedObjective, Objective
from asyncrl.learner.parallel import is_sharded
from asyncrl.learner.recipes import Recipe, make_recipe
from asyncrl.learner.step import PackedBatch, StepResult, StepTotals, TrainSample, staleness_B
from asyncrl.learner.streaming import StreamingAccumulator, flatten_grads, write_flat_grad
from asyncrl.models.policy import PolicyLM
from asyncrl.staleness.base import Correction, StalenessPolicy, TokenBatch, with_current_as_prox
from asyncrl.staleness.ewma import EwmaParams
from asyncrl.staleness.exact import assemble_old_train_logp, versions_needed
from asyncrl.staleness.freshness import freshness_score

log = logging.getLogger(__name__)


class StalenessViolation(AssertionError):
    """A trajectory older than the configured bound reached the learner (an admission bug)."""


class Trainer:
    def __init__(
        self,
        actor: PolicyLM | torch.nn.Module,
        objective: Objective,
        policy: StalenessPolicy,
        *,
        lr: float,
        weight_decay: float,
        optimizer: str = "adamw",
        max_grad_norm: float,
        temperature: float,
        top_p: float = 1.0,
        pad_token_id: int,
        group_size: int,
        micro_batch_size: int,
        max_open_groups: int,
        max_staleness: int,
        max_tokens_per_microbatch: int = 0,
        chunk_groups: int = 1,
        max_nonfinite_steps: int = 3,
        threads: int = 1,
        adaptive_threads: bool = False,
    ) -> None:
        if not isinstance(actor, PolicyLM):
            actor = PolicyLM(actor)  # a bare Hugging Face model (tests, plugins)
        self.actor = actor  # the policy network's forwards (log-probs); maybe FSDP2-wrapped (`parallel.py`)
        self.model = actor.lm  # the Hugging Face model: state_dict names, save_pretrained
        self.params = [p for p in actor.parameters() if p.requires_grad]
        self.device = self.params[0].device
        # Several ranks (or a wrapped model) train complete groups in lockstep: every rank sees
        # every trajectory and trains its share of each chunk (`recipes.py`); the gradient is
        # reduced by the backward itself. One plain rank streams per trajectory.
        self.lockstep = is_sharded(actor)
        self.rank = dist.get_rank() if self.lockstep else 0
        self.world_size = dist.get_world_size() if self.lockstep else 1
        self.chunk_groups = chunk_groups
        # Data-parallel threads (one plain CPU rank): a micro-batch's pieces train concurrently,
        # each on one torch thread (`backward_pieces`). Elsewhere torch's own threads do the work.
        self.threads = threads if not self.lockstep and self.device.type == "cpu" else 1
        # With "auto" threads, how many the next step trains on (revisited by `observe_idle`).
        self.core_share = CoreShare(self.threads) if adaptive_threads else None
        self._pieces = None
        if self.threads > 1:
            torch.set_num_threads(1)  # every thread of the process that trains: one torch thread
            self._pieces = ThreadPoolExecutor(
                self.threads, "learner-piece", initializer=torch.set_num_threads, initargs=(1,)
            )
        self.max_tokens_per_microbatch = max_tokens_per_microbatch
        self.max_nonfinite_steps = max_nonfinite_steps
        self.nonfinite_in_a_row = 0
        self.nonfinite_total = 0
        self.fault_steps = _fault_steps(os.environ.get(FAULT_ENV, ""))
        self.objective = objective
        self.policy = policy
        self.lr = lr
        self.max_grad_norm = max_grad_norm
        self.temperature = max(temperature, 1e-6)
        self.top_p = top_p  # the generators' nucleus: log-probs are renormalised over it
        self.pad_token_id = pad_token_id
        self.group_size = group_size
        self.micro_batch_size = micro_batch_size
        self.max_open_groups = max_open_groups
        self.max_staleness = max_staleness
        if optimizer == "sgd":
            self.optimizer = torch.optim.SGD(self.params, lr=lr, weight_decay=weight_decay)
        else:
            self.optimizer = torch.optim.AdamW(
                self.params, lr=lr, weight_decay=weight_decay, betas=(0.9, 0.99)
            )
        self.fallback = objective.fallback_reason(policy) or ""
        # Per-trajectory S0/S1 streaming (one plain rank; bounded by max_open_groups).
        self.streams_per_trajectory = not self.fallback and not self.lockstep
        # Extra policy inputs: an EWMA of the parameters (PPO-EWMA) or snapshots of the last
        # max_staleness + 1 versions (exact old logits), each with a scratch model for forwards.
        self.ewma = None
        self.snapshots: dict[int, dict[str, torch.Tensor]] = {}
        self.scratch = None
        self._scratch_lock = threading.Lock()
        if "ewma" in policy.needs or "old_train" in policy.needs:
            self.scratch = copy.deepcopy(actor).eval().requires_grad_(False)
        if "ewma" in policy.needs:
            if policy.ewma_decay is None:
                raise ValueError(
                    f"staleness policy {policy.name!r} needs 'ewma' inputs but declares no ewma_decay"
                )
            self.ewma_decay: float = policy.ewma_decay
            self.ewma = EwmaParams.init(self.model.state_dict())
        if "old_train" in policy.needs:
            self.snapshots[0] = _snapshot(self.model)
        self.dtype = self.params[0].dtype
        self.epochs = objective.epochs
        self.step = -1
        self.recipe: Recipe = make_recipe(self)  # RL or distillation, for the trainer's lifetime

    # ------------------------------------------------------------------ step state
    def begin_step(self, step: int, *, window_groups: int | None = None) -> None:
        """Start step `step`; `window_groups` is how many groups it will offer (None: unknown,
        e.g. the pool). Lockstep ranks train a step's last, shorter chunk once that many are in."""
        self.step = step
        self.window_groups = window_groups
        self.completed: list[int] = []  # group ids in the order their last member was offered
        self.arrivals: list[TrainSample] = []  # every offered trajectory, in offer order
        self.totals = StepTotals()
        # What later epochs re-run (learner.epochs > 1), appended by the recipe.
        self.epoch_plans: list[Callable[[], object]] = []
        self.members: dict[int, list[TrainSample]] = defaultdict(list)
        self.waiting: dict[int, list[TrainSample]] = defaultdict(list)
        self.recipe.begin_step()
        for p in self.params:
            p.grad = None

    @property
    def acc(self) -> StreamingAccumulator | None:
        """The step's group S0/S1 buffers (streaming RL); None otherwise."""
        return self.recipe.acc

    def offer(self, sample: TrainSample) -> None:
        self.members[sample.group_id].append(sample)
        self.waiting[sample.group_id].append(sample)
        self.arrivals.append(sample)
        if len(self.members[sample.group_id]) == self.group_size:
            self.completed.append(sample.group_id)

    def num_waiting(self) -> int:
        """Trajectories offered this step and not trained yet."""
        return sum(len(w) for w in self.waiting.values())

    def has_work(self) -> bool:
        return self.recipe.has_work()

    def work(self) -> bool:
        """One unit of streaming work; False if there is nothing to do until more data arrives."""
        return self.recipe.work()

    def batch_backward(self, samples: Sequence[TrainSample]) -> None:
        """The whole step at once (the fallback): corrections see every trajectory of this rank.
        Packed in trajectory-id order, so the arithmetic does not depend on arrival order."""
        self.recipe.batch_backward(sorted(samples, key=lambda s: s.traj_id))

    # ------------------------------------------------------------------ shared pieces
    def _scratch_logp(self, state: dict[str, torch.Tensor], ids_BL: torch.Tensor) -> torch.Tensor:
        mb = self.micro_batch_size
        with self._scratch_lock, torch.no_grad():  # one scratch model: pieces take turns
            self.scratch.lm.load_state_dict(state, strict=True)
            return torch.cat(
                [self.logp(self.scratch, ids_BL[i : i + mb]) for i in range(0, ids_BL.shape[0], mb)]
            )

    def _policy_inputs(self, batch: PackedBatch) -> dict[str, torch.Tensor]:
        """The optional TokenBatch inputs the policy needs beyond the current forward."""
        extra = {}
        if self.ewma is not None:
            state = {k: v.to(self.dtype) if v.is_floating_point() else v for k, v in self.ewma.params.items()}
            extra["logp_ewma_BT"] = self._scratch_logp(state, batch.input_ids_BL)
        if "old_train" in self.policy.needs:
            mask = batch.completion_mask_BL
            by_version = {}
            for v in versions_needed(batch.versions_BL, mask):
                if v not in self.snapshots:
                    raise StalenessViolation(
                        f"step {self.step}: no snapshot of version {v} (kept: {sorted(self.snapshots)})"
                    )
                by_version[v] = self._scratch_logp(self.snapshots[v], batch.input_ids_BL)
            extra["logp_old_train_BT"] = assemble_old_train_logp(
                batch.versions_BL, by_version, mask, dtype=self.dtype
            )
        return extra

    def _after_update(self) -> None:
        """Track the new version for the EWMA and snapshot policies."""
        if self.ewma is not None:
            self.ewma = self.ewma.update(self.model.state_dict(), decay=self.ewma_decay)
        if "old_train" in self.policy.needs:
            version = self.step + 1
            self.snapshots[version] = _snapshot(self.model)
            for old in [v for v in self.snapshots if v < version - self.max_staleness]:
                del self.snapshots[old]

    def correct(self, batch: PackedBatch, logp_now_BL: torch.Tensor, adv_B: torch.Tensor) -> Correction:
        """The staleness policy's correction of a packed batch (current log-probs detached)."""
        mask = batch.completion_mask_BL
        token_batch = with_current_as_prox(
            TokenBatch(
                logp_BT=logp_now_BL,
                logp_behav_BT=batch.behavior_logp_BL.to(self.dtype),
                mask_BT=mask,
                versions_BT=batch.versions_BL,
                adv_BT=torch.where(mask, adv_B.to(self.dtype)[:, None], 0.0),
                policy_version=self.step,
                **self._policy_inputs(batch),
            )
        )
        corr = self.policy.correct(token_batch)
        if math.isnan(float(corr.stats.mean_freshness)):
            # Freshness is a metric whether or not it weights the loss: the same score
            # (staleness/freshness.py, default lambdas) over this batch's sequences.
            valid_B = mask.any(dim=1)
            f_B = freshness_score(
                logp_now_BL.detach(), token_batch.logp_behav_BT, mask, lambda_roll=1.0, lambda_sup=1.0
            )
            mean_f = f_B[valid_B].mean() if bool(valid_B.any()) else f_B.new_tensor(float("nan"))
            corr = corr._replace(stats=corr.stats._replace(mean_freshness=mean_f))
        return corr

    def account(
        self, batch: PackedBatch, samples, stats: dict[str, float], *, tokens: float, clipped: float
    ) -> None:
        """Add trained samples to the step's totals, asserting the staleness bound."""
        stale_B = staleness_B(batch, self.step).cpu()
        # A down-weighted group (buffer.action = "downweight") is past the bound by design.
        bounded_B = torch.tensor([s.weight == 1.0 for s in samples])
        if bool(bounded_B.any()) and int(stale_B[bounded_B].max()) > self.max_staleness:
            raise StalenessViolation(
                f"step {self.step}: a trajectory is {int(stale_B.max())} versions stale, above the bound "
                f"{self.max_staleness}"
            )
        self.totals.add_samples(samples, stale_B)
        self.totals.tokens += tokens
        self.totals.clipped_tokens += clipped
        self.totals.add_stats(stats, tokens)

    def logp(
        self, actor: PolicyLM, ids_BL: torch.Tensor, lengths_B: torch.Tensor | None = None
    ) -> torch.Tensor:
        """log pi(x_t | x_<t) under `actor` (a `PolicyLM`), on the learner's device (`lengths_B`:
        real tokens per row, so the forward can skip the padding)."""
        out = actor(
            ids_BL.to(self.device), temperature=self.temperature, top_p=self.top_p, lengths_B=lengths_B
        )
        return out.logp

    def microbatches(self, samples: Sequence[TrainSample]) -> list[list[int]]:
        """Indices of `samples` per forward/backward: at most `micro_batch_size` sequences and
        `max_tokens_per_microbatch` padded tokens. Lockstep ranks all run as many as the rank
        with the most (the others pad with empty ones: `None` here, see `dummy_backward`)."""
        parts = split_microbatches(
            samples, max_seqs=self.micro_batch_size, max_tokens=self.max_tokens_per_microbatch
        )
        if self.lockstep:
            count = torch.tensor([len(parts)], dtype=torch.int64, device=self.device)
            dist.all_reduce(count, op=dist.ReduceOp.MAX)  # (a device tensor: NCCL has no CPU ones)
            parts = parts + [None] * (int(count) - len(parts))
        return parts

    def dummy_backward(self) -> None:
        """A forward and backward that changes no gradient: a lockstep rank with nothing to train
        in this micro-batch still takes part in its collectives."""
        ids = torch.full((1, 2), self.pad_token_id, dtype=torch.long)
        (self.logp(self.actor, ids) * 0.0).sum().backward()

    def share(self, samples: Sequence[TrainSample]) -> list[TrainSample]:
        """This rank's part of `samples` (every rank sees all of them, in the same order)."""
        return list(samples[self.rank :: self.world_size])

    def backward_pieces(self, samples: Sequence, loss_of: Callable[[Sequence], tuple]) -> None:
        """The summed loss gradient of `samples` (trajectories, or rows of a packed batch) into
        `.grad`. `loss_of(piece)` returns a piece's loss (a sum over its rows) and a callable that
        accounts for it.

        With `threads` > 1 the samples are cut into contiguous pieces trained concurrently, each
        on one torch thread (data parallelism inside the process: no collective, and the threads
        meet once per micro-batch, where an intra-op team waits at every op for its slowest
        thread, which a generator on the same core slows). Each piece's gradient comes back as
        its own tensors and is added to `.grad` in piece order, then accounted for, so the result
        does not depend on which thread finished first. The pieces of a micro-batch hold at most
        its activations."""
        pieces = self._cut(samples)
        if len(pieces) == 1:
            loss, account = loss_of(samples)
            loss.backward()
            account()
            return
        futures = [self._pieces.submit(self._piece_grads, loss_of, piece) for piece in pieces]
        wait(futures)
        for future in futures:
            grads, account = future.result()
            for p, g in zip(self.params, grads, strict=True):
                if g is None:
                    continue
                if p.grad is None:
                    p.grad = g
                else:
                    p.grad.add_(g)
            account()

    @property
    def active_threads(self) -> int:
        """The data-parallel threads the next micro-batches train on."""
        return self.core_share.threads if self.core_share is not None else self.threads

    def observe_idle(self, idle_s: float, busy_s: float) -> None:
        """A step's waiting and working time ("auto" threads: revisits the core share)."""
        if self.core_share is not None:
            self.core_share.observe(idle_s, busy_s)

    def _cut(self, samples: Sequence) -> list[Sequence]:
        """Contiguous pieces, one per active thread, at least `MIN_PIECE` trajectories each. (Two
        per thread, so that a thread slowed by a busy core would take fewer, measured slower:
        larger pieces run larger matrix products; bench/README.md, "Learner step".)"""
        threads = self.active_threads
        count = min(threads, len(samples) // MIN_PIECE) if threads > 1 else 1
        if count <= 1:
            return [samples]
        bounds = [round(i * len(samples) / count) for i in range(count + 1)]
        return [samples[a:b] for a, b in itertools.pairwise(bounds)]

    def _piece_grads(self, loss_of, piece):
        loss, account = loss_of(piece)
        return torch.autograd.grad(loss, self.params, allow_unused=True), account

    def _apply_gradient(self, scale: float, lr_scale: float, loss: float) -> tuple[float, bool]:
        """Scale the reduced gradient in `.grad`, clip, step; returns (the norm before clipping,
        whether the update was applied). A non-finite loss or norm skips the step: gradients are
        dropped, parameters and optimizer state stay as they were."""
        grads = [p.grad for p in self.params if p.grad is not None]
        if self.step in self.fault_steps:
            for g in grads:
                g.fill_(float("nan"))  # fault injection (ASYNCRL_FAULT_NONFINITE), for tests
        torch._foreach_mul_(grads, scale)
        norm_t = torch.nn.utils.get_total_norm(grads) if grads else None
        norm = _local(norm_t) if norm_t is not None else 0.0
        applied = math.isfinite(norm) and math.isfinite(loss)
        if applied:
            if norm_t is not None:
                torch.nn.utils.clip_grads_with_norm_(self.params, self.max_grad_norm, norm_t)
            for group in self.optimizer.param_groups:
                group["lr"] = self.lr * lr_scale
            self.optimizer.step()
            if not _all_finite(self.params):
                raise NonFiniteError(
                    f"step {self.step}: the optimizer step made a parameter non-finite; resume from the "
                    "last checkpoint with a lower learner.lr"
                )
        for p in self.params:
            p.grad = None
        return norm, applied

    # ------------------------------------------------------------------ the update
    def finish_step(self) -> StepResult:
        t = self.totals
        if self.waiting and any(self.waiting.values()):
            raise RuntimeError(f"step {self.step}: trajectories still waiting at the step boundary")
        self.recipe.end_step()
        if self.acc is not None:
            units_local = float(self.acc.num_units)
            grad_P, stream_stats = self.acc.finish(1.0)  # the streamed groups' summed loss gradient
            grad_P = grad_P + flatten_grads(self.params, dtype=self.dtype)  # plus complete groups'
            write_flat_grad(self.params, grad_P)
            peak = stream_stats.peak_memory_bytes
        else:
            units_local = t.units
            peak = 0
        summed = torch.tensor(
            [
                units_local,
                t.loss,
                t.clipped_tokens,
                t.tokens,
                t.reward,
                t.seqs,
                t.staleness_sum,
                t.distill_loss,
            ],
            dtype=torch.float64,
        )
        if self.lockstep:  # the gradient was reduced by each backward; the sums meet here
            summed = summed.to(self.device)  # NCCL reduces device tensors only
            dist.all_reduce(summed)
            summed = summed.cpu()
        units, loss, clipped, tokens, reward, seqs, stale_sum, distill_loss = summed.tolist()
        denominator = self.objective.denominator(units)
        scale = 1.0 / denominator if denominator > 0 else 0.0
        grad_norm, applied = self._apply_gradient(scale, t.lr_scale, loss)
        for _ in range(1, self.epochs if applied else 1):  # the same Z: the masks do not change
            for rerun in self.epoch_plans:
                rerun()
            grad_norm, applied = self._apply_gradient(scale, t.lr_scale, loss)
            if not applied:
                break
        self.epoch_plans = []
        self._count_nonfinite(applied, loss=loss * scale, grad_norm=grad_norm)
        if applied:
            self._after_update()
        stats = {k: v / max(t.stats_tokens, 1e-12) for k, v in t.stats.items()}
        if self.objective.distills:  # the step's loss, split into its two parts (they add up to it)
            stats |= t.distill.report() if t.distill is not None else {}
            stats["opd_distill_loss"] = distill_loss * scale
            if isinstance(self.objective, CombinedObjective):
                stats["opd_reward_loss"] = (loss - distill_loss) * scale
        return StepResult(
            step=self.step,
            num_trajectories=int(seqs),
            num_tokens=int(tokens),
            loss=loss * scale,
            mean_reward=reward / max(seqs, 1.0),
            max_staleness=t.max_staleness,
            mean_staleness=stale_sum / max(seqs, 1.0),
            clip_fraction=clipped / max(tokens, 1.0),
            grad_norm=grad_norm,
            lr_scale=t.lr_scale,
            policy_stats=stats,
            streamed=t.streamed,
            deferred=t.deferred,
            peak_stream_bytes=peak,
            fallback=self.fallback,
            skipped_nonfinite=not applied,
        )

    def _count_nonfinite(self, applied: bool, *, loss: float, grad_norm: float) -> None:
        """Count a skipped step; too many in a row end the run (`NonFiniteError`): the weights are
        still those before the first of them, which the caller checkpoints."""
        if applied:
            self.nonfinite_in_a_row = 0
            return
        self.nonfinite_in_a_row += 1
        self.nonfinite_total += 1
        log.error(
            "step %d skipped: loss %s, gradient norm %s (%d in a row; learner.max_nonfinite_steps = %d)",
            self.step, loss, grad_norm, self.nonfinite_in_a_row, self.max_nonfinite_steps,
        )  # fmt: skip
        if self.nonfinite_in_a_row >= self.max_nonfinite_steps:
            raise NonFiniteError(
                f"{self.nonfinite_in_a_row} steps in a row had a non-finite loss or gradient (last: step "
                f"{self.step}, loss {loss}, gradient norm {grad_norm}); the checkpoint at version "
                f"{self.step + 1 - self.nonfinite_in_a_row} holds the weights before the first. Lower "
                "learner.lr, check the rewards and data, or raise learner.max_nonfinite_steps"
            )


class NonFiniteError(RuntimeError):
    """Training cannot go on: too many non-finite steps in a row, or a non-finite parameter."""


FAULT_ENV = "ASYNCRL_FAULT_NONFINITE"
# Fewest trajectories in one data-parallel piece: below it the per-forward overhead dominates.
MIN_PIECE = 16


def _fault_steps(text: str) -> set[int] | _Every:
    """Steps whose gradient a test poisons with NaN: "" none, "all", or "3,5"."""
    text = text.strip()
    if text == "all":
        return _Every()
    return {int(x) for x in text.split(",") if x.strip()}


class _Every:
    def __contains__(self, step: object) -> bool:
        return True


def _local(t: torch.Tensor) -> float:
    return float(t.full_tensor() if isinstance(t, DTensor) else t)


def _all_finite(params: Sequence[torch.Tensor]) -> bool:
    """Every parameter finite, on every rank (this rank's shards, then an all-reduce)."""
    bad = torch.tensor(
        [sum(int(not bool(torch.isfinite(_shard(p)).all())) for p in params)],
        dtype=torch.int64,
        device=params[0].device,
    )
    if dist.is_initialized() and any(isinstance(p, DTensor) for p in params):
        dist.all_reduce(bad)
    return int(bad) == 0


def _shard(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if isinstance(p, DTensor) else p


def _snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}
