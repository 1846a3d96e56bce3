"""A learner step from offered trajectories to one optimizer update (no sockets): the composition
of plan, engine, work, update and weight copies, each chosen once when the trainer is built.

Place in the data flow: the step loop (`loop.py`, `pool.py`; `ranks.py` on every other rank)
calls `begin_step`, hands each received trajectory of the step to `offer`, calls `work` while
`has_work` (streaming plans), or `batch_backward` with the whole window (the whole-batch plan),
and `finish_step` once every trajectory of the step is in.

    offer -> StepState <- plan.next_unit (pure decision) -> work.run(unit) -> engine (forward,
             correction, loss of the objective, backward into .grad)   ... -> updater.update

* the plan (`plans.py`): streaming on one plain rank, lockstep across ranks, or whole batch;
* the work (`rl_work.py`: `RLWork`, `OpobWork`; `distill_work.py`: `DistillWork`): what each unit
  computes for the objective's kind (`objective.py`: the losses themselves are pure);
* the engine (`engine.py`): forwards, micro-batches, pieces over threads, collectives;
* the update (`update.py`): reduce the step's sums, normalise by Z, clip, step, guard;
* the weight copies (`copies.py`): what the staleness policy reads (EWMA, snapshots).
Every path produces the *sum* of per-trajectory loss gradients; the update divides by the global Z.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from asyncrl.learner.copies import WeightCopies
from asyncrl.learner.distill_work import DistillWork
from asyncrl.learner.engine import Engine
from asyncrl.learner.ghost import unsupported as ghost_unsupported
from asyncrl.learner.objective import CombinedObjective, DistillationObjective, Objective
from asyncrl.learner.plans import StepPlan, choose_plan
from asyncrl.learner.rl_work import OpobBatchWork, OpobWork, RLWork
from asyncrl.learner.state import StepState, StepTotals
from asyncrl.learner.step import StepResult, TrainSample
from asyncrl.learner.streaming import StreamingAccumulator, flatten_grads, write_flat_grad
from asyncrl.learner.update import StepSums, Updater, reduce_stats, reduce_sums
from asyncrl.models.policy import PolicyLM
from asyncrl.staleness.base import StalenessPolicy

if TYPE_CHECKING:
    from collections.abc import Sequence


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
        self.actor = actor
        self.model = actor.lm  # the Hugging Face model: state_dict names, save_pretrained
        self.objective = objective
        self.group_size = group_size
        self.max_open_groups = max_open_groups
        self.max_staleness = max_staleness
        self.copies = WeightCopies(
            actor, policy, max_staleness=max_staleness, micro_batch_size=micro_batch_size
        )
        self.engine = Engine(
            actor,
            policy,
            temperature=temperature,
            top_p=top_p,
            pad_token_id=pad_token_id,
            micro_batch_size=micro_batch_size,
            max_tokens_per_microbatch=max_tokens_per_microbatch,
            threads=threads,
            adaptive_threads=adaptive_threads,
            copies=self.copies,
        )
        self.updater = Updater(
            self.engine.params,
            optimizer=optimizer,
            lr=lr,
            weight_decay=weight_decay,
            max_grad_norm=max_grad_norm,
            max_nonfinite_steps=max_nonfinite_steps,
        )
        # Why the objective cannot stream ("" when it streams): the whole-batch plan.
        self.fallback = objective.fallback_reason(policy) or ""
        grouped = not isinstance(objective, DistillationObjective)
        opob = grouped and objective.opob
        opob, opob_batched = self._opob_path(opob, top_p)
        self.plan: StepPlan = choose_plan(
            grouped=grouped,
            lockstep=self.engine.lockstep,
            whole_batch=bool(self.fallback),
            each=opob,
            chunk_groups=chunk_groups,
            micro_batch_size=micro_batch_size,
        )
        # Per-trajectory streaming on one plain rank (bounded by max_open_groups).
        self.streams_per_trajectory = not self.fallback and not self.engine.lockstep
        self.runner = self._runner(objective, grouped, opob, opob_batched, max_open_groups)
        self.state: StepState | None = None

    def _opob_path(self, opob: bool, top_p: float) -> tuple[bool, bool]:
        """(per-trajectory, batched) optimal baseline: its norms from one batched backward where
        the model allows it (`ghost.unsupported`), else one backward per trajectory (one plain
        rank only). The batched path trains whole batches (`self.fallback` says why)."""
        why = ghost_unsupported(self.model, top_p=top_p) if opob else None
        if opob and why is not None and self.engine.lockstep:
            raise ValueError(
                "staleness.vcpo_baseline = 'opob' on lockstep ranks takes the per-trajectory gradient norms "
                f"from a batched backward, which this model does not allow: {why}"
            )
        if not opob or why is not None:
            return opob, False
        self.fallback = self.fallback or (
            "the optimal baseline weighs each trajectory by its gradient norm, taken for the whole batch "
            "in one backward"
        )
        return False, True

    def _runner(self, objective, grouped: bool, opob: bool, opob_batched: bool, max_open_groups: int):
        if not grouped:
            return DistillWork(self.engine, objective)
        if opob:
            return OpobWork(self.engine, objective, max_open_groups=max_open_groups)
        work = OpobBatchWork if opob_batched else RLWork
        return work(
            self.engine, objective, streams=self.streams_per_trajectory, max_open_groups=max_open_groups
        )

    # ------------------------------------------------------------------ what the loops read
    @property
    def lockstep(self) -> bool:
        return self.engine.lockstep

    @property
    def rank(self) -> int:
        return self.engine.rank

    @property
    def world_size(self) -> int:
        return self.engine.world_size

    @property
    def params(self) -> list[torch.Tensor]:
        return self.engine.params

    @property
    def policy(self) -> StalenessPolicy:
        return self.engine.policy

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.updater.optimizer

    @property
    def nonfinite_total(self) -> int:
        return self.updater.nonfinite_total

    @property
    def active_threads(self) -> int:
        return self.engine.active_threads

    def observe_idle(self, idle_s: float, busy_s: float) -> None:
        self.engine.observe_idle(idle_s, busy_s)

    @property
    def step(self) -> int:
        return -1 if self.state is None else self.state.step

    @property
    def acc(self) -> StreamingAccumulator | None:
        """The step's group S0/S1 buffers (streaming RL); None otherwise."""
        return None if self.state is None else self.state.acc

    @property
    def totals(self) -> StepTotals:
        return self.state.totals

    # ------------------------------------------------------------------ the step
    def begin_step(self, step: int, *, window_groups: int | None = None) -> None:
        """Start step `step`; `window_groups` is how many groups it will offer (None: unknown,
        e.g. the pool). Lockstep ranks train a step's last, shorter chunk once that many are in."""
        self.state = StepState(
            step,
            group_size=self.group_size,
            window_groups=window_groups,
            max_staleness=self.max_staleness,
            acc=self.runner.accumulator(self.group_size),
        )
        for p in self.engine.params:
            p.grad = None

    def offer(self, sample: TrainSample) -> None:
        self.state.offer(sample)

    def num_waiting(self) -> int:
        """Trajectories offered this step and not trained yet."""
        return self.state.num_waiting()

    def has_work(self) -> bool:
        return self.plan.next_unit(self.state) is not None

    def work(self) -> bool:
        """One unit of streaming work; False if there is nothing to do until more data arrives."""
        unit = self.plan.next_unit(self.state)
        if unit is None:
            return False
        self.runner.run(unit, self.state)
        return True

    def batch_backward(self, samples: Sequence[TrainSample]) -> None:
        """The whole step at once (the whole-batch plan): corrections see every trajectory of this
        rank. Packed in trajectory-id order, so the arithmetic does not depend on arrival order."""
        self.runner.whole(self.state, sorted(samples, key=lambda s: s.traj_id))

    def finish_step(self) -> StepResult:
        state = self.state
        if state.any_waiting():
            raise RuntimeError(f"step {state.step}: trajectories still waiting at the step boundary")
        self.runner.end(state)
        params = self.engine.params
        if state.acc is not None:
            units_local = float(state.acc.num_units)
            grad_P, stream_stats = state.acc.finish(1.0)  # the streamed groups' summed loss gradient
            grad_P = grad_P + flatten_grads(params, dtype=self.engine.dtype)  # plus complete groups'
            write_flat_grad(params, grad_P)
            peak = stream_stats.peak_memory_bytes
        else:
            units_local = state.totals.units
            peak = 0
        sums = reduce_sums(
            state.totals, units_local, lockstep=self.engine.lockstep, device=self.engine.device
        )
        denominator = self.objective.denominator(sums.units)
        scale = 1.0 / denominator if denominator > 0 else 0.0
        grad_norm, applied = self.updater.update(
            state,
            scale=scale,
            loss=sums.loss,
            epochs=self.objective.epochs,
            denominator=self.objective.denominator,
        )
        if applied:
            self.copies.after_update(self.model, state.step + 1)
        return StepResult(
            step=state.step,
            num_trajectories=int(sums.seqs),
            num_tokens=int(sums.tokens),
            loss=sums.loss * scale,
            mean_reward=sums.reward / max(sums.seqs, 1.0),
            max_staleness=state.totals.max_staleness,
            mean_staleness=sums.staleness_sum / max(sums.seqs, 1.0),
            clip_fraction=sums.clipped / max(sums.tokens, 1.0),
            grad_norm=grad_norm,
            lr_scale=state.totals.lr_scale,
            policy_stats=self._stats(state.totals, sums, scale),
            streamed=state.totals.streamed,
            deferred=state.totals.deferred,
            peak_stream_bytes=peak,
            fallback=self.fallback,
            skipped_nonfinite=not applied,
        )

    def _stats(self, t: StepTotals, sums: StepSums, scale: float) -> dict[str, float]:
        """The policy's token-weighted diagnostics, and a distilling objective's loss parts."""
        if self.engine.lockstep:
            stats = reduce_stats(t, device=self.engine.device)
        else:
            stats = {k: v / max(t.stats_tokens, 1e-12) for k, v in t.stats.items()}
        if self.objective.distills:  # the step's loss, split into its two parts (they add up to it)
            stats |= t.distill.report() if t.distill is not None else {}
            stats["opd_distill_loss"] = sums.distill_loss * scale
            if isinstance(self.objective, CombinedObjective):
                stats["opd_reward_loss"] = (sums.loss - sums.distill_loss) * scale
        return stats
