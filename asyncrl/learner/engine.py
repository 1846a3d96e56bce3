"""The learner's engine (no sockets): forwards, micro-batches and backwards over pieces, threads
and ranks, and the staleness correction of a packed batch. It holds the model, never a step.

Place in the data flow: a step's work (`rl_work.py`, `distill_work.py`) packs the trajectories
of one unit, asks the engine for their log-probs and correction, builds the loss from the
objective, and hands `backward_pieces` a function from a piece of rows to its loss; the engine
runs the backward and leaves the summed gradient in `.grad`.

Execution, chosen once from the model and the config:
* one plain rank: with `threads` > 1 (CPU) a micro-batch is cut into contiguous pieces trained
  concurrently, each on one torch thread, their gradients added in piece order (so the result
  does not depend on which thread finished first);
* lockstep ranks (several ranks, or an FSDP2-wrapped model: `parallel.py`): every rank runs as
  many micro-batches as the rank with the most (`microbatches` pads with `None`, which
  `dummy_backward` serves), so FSDP2's collectives pair up; the backward reduces the gradient.

Legend: B sequences, L packed length, N cached ids per position.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, wait

import torch
import torch.distributed as dist

from asyncrl.learner.copies import WeightCopies
from asyncrl.learner.cores import CoreShare
from asyncrl.learner.microbatch import split_microbatches
from asyncrl.learner.parallel import is_sharded
from asyncrl.learner.step import PackedBatch, TrainSample, pack
from asyncrl.models.policy import PolicyLM
from asyncrl.staleness.base import Correction, StalenessPolicy, TokenBatch, with_current_as_prox
from asyncrl.staleness.freshness import freshness_score

# Fewest trajectories in one data-parallel piece: below it the per-forward overhead dominates.
MIN_PIECE = 16


class Engine:
    def __init__(
        self,
        actor: PolicyLM,
        policy: StalenessPolicy,
        *,
        temperature: float,
        top_p: float,
        pad_token_id: int,
        micro_batch_size: int,
        max_tokens_per_microbatch: int,
        threads: int,
        adaptive_threads: bool,
        copies: WeightCopies,
    ) -> None:
        self.actor = actor  # the policy network's forwards (log-probs); maybe FSDP2-wrapped
        self.params = [p for p in actor.parameters() if p.requires_grad]
        self.device = self.params[0].device
        self.dtype = self.params[0].dtype
        self.policy = policy
        self.copies = copies
        self.lockstep = is_sharded(actor)
        self.rank = dist.get_rank() if self.lockstep else 0
        self.world_size = dist.get_world_size() if self.lockstep else 1
        self.temperature = max(temperature, 1e-6)
        self.top_p = top_p  # the generators' nucleus: log-probs are renormalised over it
        self.pad_token_id = pad_token_id
        self.micro_batch_size = micro_batch_size
        self.max_tokens_per_microbatch = max_tokens_per_microbatch
        # Whether some unit of this trainer runs its forwards on padded rows (the optimal
        # baseline's norms): its micro-batches are then bounded by padded tokens.
        # Data-parallel threads (one plain CPU rank); elsewhere torch's own threads do the work.
        self.threads = threads if not self.lockstep and self.device.type == "cpu" else 1
        # With "auto" threads, how many the next step trains on (revisited by `observe_idle`).
        self.core_share = CoreShare(self.threads) if adaptive_threads else None
        self._pieces = None
        if self.threads > 1:
            torch.set_num_threads(1)  # every thread of the process that trains: one torch thread
            self._pieces = ThreadPoolExecutor(
                self.threads, "learner-piece", initializer=torch.set_num_threads, initargs=(1,)
            )

    # ------------------------------------------------------------------ forwards
    def logp(
        self, actor: PolicyLM, ids_BL: torch.Tensor, lengths_B: torch.Tensor | None = None
    ) -> torch.Tensor:
        """log pi(x_t | x_<t) under `actor`, on the learner's device (`lengths_B`: real tokens
        per row, so the forward can skip the padding)."""
        out = actor(
            ids_BL.to(self.device), temperature=self.temperature, top_p=self.top_p, lengths_B=lengths_B
        )
        return out.logp

    def candidate_logp(
        self, ids_BL: torch.Tensor, ids_BLN: torch.Tensor, lengths_B: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The student's log-probs of the cached ids [B, L, N] (column 0: the sampled tokens)."""
        return self.actor(
            ids_BL.to(self.device), temperature=self.temperature, candidates_BLN=ids_BLN, lengths_B=lengths_B
        )

    def pack(self, samples: Sequence[TrainSample], *, require_complete: bool = False) -> PackedBatch:
        """`samples` packed on the learner's device."""
        return pack(samples, pad_token_id=self.pad_token_id, require_complete=require_complete).to(
            self.device
        )

    def correct(
        self, batch: PackedBatch, logp_now_BL: torch.Tensor, adv_B: torch.Tensor, step: int
    ) -> Correction:
        """The staleness policy's correction of a packed batch at `step` (log-probs detached)."""
        extra = self.copies.inputs(batch, step, self.dtype, self.logp)
        return self._correct(batch, logp_now_BL, adv_B, step, extra)

    def correct_rows(
        self,
        whole: PackedBatch,
        rows: Sequence[int],
        batch: PackedBatch,
        logp_now_BL: torch.Tensor,
        adv_whole_B: torch.Tensor,
        step: int,
    ) -> Correction:
        """The correction of this rank's rows `rows` of a whole step's batch `whole` (`batch`:
        those rows packed, `logp_now_BL` their step-start log-probs, `adv_whole_B` every row's
        advantage). A batch-global policy on lockstep ranks (M2PO's mask, VCPO's ESS, self-
        normalised weights) sees the whole batch, exactly as one rank does: the ranks sum their
        rows' detached log-probs (and the weight copies' log-probs) into the whole batch's layout,
        every rank corrects the whole batch (same masks, thresholds, ties) and keeps its rows.
        Elsewhere the rows' own correction is the same thing, without the exchange."""
        sl = torch.as_tensor(list(rows), dtype=torch.long, device=self.device)
        extra = {}
        if rows:
            extra = self.copies.inputs(batch, step, self.dtype, self.logp)
        elif self.copies.active:
            self.copies.join(step, self.dtype, self.logp)
        if not (self.lockstep and self.policy.batch_global):
            return self._correct(batch, logp_now_BL, adv_whole_B[sl.cpu()], step, extra) if rows else None
        whole = whole.to(self.device)
        width = batch.input_ids_BL.shape[1] if rows else 0
        mine = {"logp_now": logp_now_BL, **extra}
        gathered = {}
        for name in ["logp_now", *self.copies.names]:
            full = torch.zeros(whole.input_ids_BL.shape, dtype=self.dtype, device=self.device)
            if rows:
                full[sl, :width] = mine[name].to(self.dtype)
            dist.all_reduce(full)  # each row is one rank's, the others add zeros: exact
            gathered[name] = full
        corr = self._correct(whole, gathered.pop("logp_now"), adv_whole_B.to(self.device), step, gathered)
        return _rows_of(corr, sl, width) if rows else None

    def _correct(
        self,
        batch: PackedBatch,
        logp_now_BL: torch.Tensor,
        adv_B: torch.Tensor,
        step: int,
        extra: dict[str, torch.Tensor],
    ) -> Correction:
        mask = batch.completion_mask_BL
        token_batch = with_current_as_prox(
            TokenBatch(
                logp_BT=logp_now_BL,
                logp_behav_BT=batch.behavior_logp_BL.to(self.dtype),
                mask_BT=mask,
                versions_BT=batch.versions_BL,
                adv_BT=torch.where(mask, adv_B.to(self.dtype)[:, None], 0.0),
                policy_version=step,
                **extra,
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

    # ------------------------------------------------------------------ ranks and micro-batches
    def microbatches(self, samples: Sequence[TrainSample], *, padded: bool = False) -> list[list[int] | None]:
        """Indices of `samples` per forward/backward: at most `micro_batch_size` sequences and
        `max_tokens_per_microbatch` tokens (real ones where the forwards pack: `microbatch.py`;
        `padded`: for forwards on right-padded rows whatever the layout). Lockstep ranks all run as many as the rank
        with the most (the others pad with empty ones: `None` here, see `dummy_backward`)."""
        parts = split_microbatches(
            samples,
            max_seqs=self.micro_batch_size,
            max_tokens=self.max_tokens_per_microbatch,
            packed=self.packed_microbatches and not padded,
        )
        if self.lockstep:
            count = torch.tensor([len(parts)], dtype=torch.int64, device=self.device)
            dist.all_reduce(count, op=dist.ReduceOp.MAX)  # (a device tensor: NCCL has no CPU ones)
            parts = parts + [None] * (int(count) - len(parts))
        return parts

    def dummy_backward(self, join_step: int | None = None) -> None:
        """A forward and backward that changes no gradient: a lockstep rank with nothing to train
        in this micro-batch still takes part in its collectives (with `join_step`, also in the
        weight copies' forwards that the other ranks' corrections run between the two)."""
        ids = torch.full((1, 2), self.pad_token_id, dtype=torch.long)
        logp = self.logp(self.actor, ids)
        if join_step is not None and self.copies.active:  # a unit's correction, between its two
            self.copies.join(join_step, self.dtype, self.logp)
        (logp * 0.0).sum().backward()

    def dummy_forward(self, model: torch.nn.Module | None = None) -> None:
        """A no-grad forward's part in the collectives of `model` (default the policy), for a
        lockstep rank with no rows."""
        with torch.no_grad():
            self.logp(model or self.actor, torch.full((1, 2), self.pad_token_id, dtype=torch.long))

    def share(self, samples: Sequence[TrainSample]) -> list[TrainSample]:
        """This rank's part of `samples` (every rank sees all of them, in the same order)."""
        return list(samples[self.rank :: self.world_size])

    # ------------------------------------------------------------------ backward
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

    def flat_grad(self, loss: torch.Tensor, *, retain_graph: bool = False) -> torch.Tensor:
        """The gradient of `loss` as one flat vector [P] (zeros for unused parameters), leaving
        `.grad` alone (it holds the step's sum over complete groups)."""
        grads = torch.autograd.grad(loss, self.params, allow_unused=True, retain_graph=retain_graph)
        return torch.cat(
            [
                (g if g is not None else torch.zeros_like(p)).reshape(-1)
                for g, p in zip(grads, self.params, strict=True)
            ]
        )

    @property
    def active_threads(self) -> int:
        """The data-parallel threads the next micro-batches train on."""
        return self.core_share.threads if self.core_share is not None else self.threads

    def force_threads(self, threads: int) -> None:
        """Train on exactly `threads` data-parallel threads (a replay re-runs a recorded count)."""
        if threads > max(self.threads, 1):
            raise ValueError(
                f"the recorded step trained on {threads} data-parallel threads; this replay's learner has "
                f"{self.threads}: run it with --set learner.threads={threads} or on a host with as many CPUs"
            )
        if self.core_share is not None:
            self.core_share.threads = threads
        else:
            self.threads = threads

    def observe_idle(self, idle_s: float, busy_s: float) -> None:
        """A step's waiting and working time ("auto" threads: revisits the core share)."""
        if self.core_share is not None:
            self.core_share.observe(idle_s, busy_s)

    @property
    def packed_microbatches(self) -> bool:
        """Whether micro-batches are bounded by their real tokens: the forwards pack (the
        shared-prefix flat layout; `microbatches(padded=True)` for a unit's forwards that pad)."""
        return bool(getattr(self.actor, "share_prefixes", False))

    def pieces(self, rows: Sequence) -> list[Sequence]:
        """`rows` cut into the contiguous pieces the data-parallel threads take (one if none)."""
        return self._cut(rows)

    def each(self, fn: Callable, items: Sequence) -> list:
        """fn(item) for each item, concurrently on the data-parallel threads where there are
        several (each on one torch thread), results in item order."""
        if len(items) <= 1 or self.threads <= 1:
            return [fn(item) for item in items]
        futures = [self._pieces.submit(fn, item) for item in items]
        wait(futures)
        return [f.result() for f in futures]

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


def _rows_of(corr: Correction, sl: torch.Tensor, width: int) -> Correction:
    """The rows `sl` of a whole batch's correction, cut at `width` columns (their packed width)."""
    return corr._replace(
        logp_anchor_BT=corr.logp_anchor_BT[sl, :width],
        weight_BT=corr.weight_BT[sl, :width],
        mask_BT=corr.mask_BT[sl, :width],
    )
