"""Copies of the policy's weights that a staleness policy reads (no sockets): an EWMA of the
parameters (PPO-EWMA) and snapshots of the last max_staleness + 1 versions (exact old logits),
each scored with one scratch model.

On lockstep ranks (an FSDP2-wrapped model, `parallel.py`) the copies are sharded like the model:
each rank keeps its own shard of the EWMA and of every snapshot (plain tensors, updated from its
own parameter shards, never gathered), and the scratch model is a sharded copy of the policy
(`parallel.sharded_copy`) whose forwards are collectives like the policy's. So every rank runs as
many scratch forwards as the rank with the most, over the versions any rank needs (one small
all-reduce each), and a rank with no rows takes part with empty forwards (`join`).

Place in the data flow: the engine (`engine.py`) asks `inputs` for the extra `TokenBatch` fields
of a packed batch before the policy corrects it; the trainer calls `after_update` once a step's
update is applied; the learner checkpoint saves and restores `state_dict` (`checkpoint.py`).

Legend: B sequences, L packed length.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable

import torch
import torch.distributed as dist

from asyncrl.learner.parallel import is_sharded, load_local, local, sharded_copy
from asyncrl.learner.state import StalenessViolation
from asyncrl.learner.step import PackedBatch
from asyncrl.staleness.base import StalenessPolicy
from asyncrl.staleness.ewma import EwmaParams
from asyncrl.staleness.exact import assemble_old_train_logp, versions_needed


class WeightCopies:
    """What the staleness policy needs beyond the current forward (`policy.needs`)."""

    def __init__(
        self, actor: torch.nn.Module, policy: StalenessPolicy, *, max_staleness: int, micro_batch_size: int
    ) -> None:
        self.needs_ewma = "ewma" in policy.needs
        self.needs_snapshots = "old_train" in policy.needs
        self.max_staleness = max_staleness
        self.micro_batch_size = micro_batch_size
        self.lockstep = is_sharded(actor)
        self.pad_token_id = 0  # a lockstep rank's empty forward (any id: its output is unused)
        self.ewma: EwmaParams | None = None
        self.snapshots: dict[int, dict[str, torch.Tensor]] = {}
        self.scratch = None
        self._scratch_lock = threading.Lock()  # one scratch model: data-parallel pieces take turns
        if self.needs_ewma or self.needs_snapshots:
            self.scratch = (
                sharded_copy(actor) if self.lockstep else copy.deepcopy(actor).eval().requires_grad_(False)
            )
        if self.needs_ewma:
            if policy.ewma_decay is None:
                raise ValueError(
                    f"staleness policy {policy.name!r} needs 'ewma' inputs but declares no ewma_decay"
                )
            self.ewma_decay: float = policy.ewma_decay
            self.ewma = EwmaParams.init(_shards(actor.lm))
        if self.needs_snapshots:
            self.snapshots[0] = _snapshot(actor.lm)

    @property
    def active(self) -> bool:
        """Whether the policy reads any copy (else `inputs` is empty and runs no forward)."""
        return self.scratch is not None

    @property
    def names(self) -> list[str]:
        """The `TokenBatch` fields `inputs` fills."""
        return (["logp_ewma_BT"] if self.ewma is not None else []) + (
            ["logp_old_train_BT"] if self.needs_snapshots else []
        )

    def inputs(
        self,
        batch: PackedBatch,
        step: int,
        dtype: torch.dtype,
        logp: Callable[[torch.nn.Module, torch.Tensor], torch.Tensor],
    ) -> dict[str, torch.Tensor]:
        """The optional TokenBatch inputs of `batch` at `step`; `logp(model, ids_BL)` scores."""
        extra = {}
        ids_BL = batch.input_ids_BL
        if self.ewma is not None:
            extra["logp_ewma_BT"] = self.logp_of(self._ewma_state(dtype), ids_BL, logp)
        if self.needs_snapshots:
            mask = batch.completion_mask_BL
            by_version = {
                v: self.logp_of(self.snapshots[v], ids_BL, logp)
                for v in self._versions(versions_needed(batch.versions_BL, mask), step)
            }
            extra["logp_old_train_BT"] = assemble_old_train_logp(
                batch.versions_BL, by_version, mask, dtype=dtype
            )
        return extra

    def join(self, step: int, dtype: torch.dtype, logp) -> None:
        """A lockstep rank with no rows: its part in the scratch forwards of `inputs`."""
        if self.ewma is not None:
            self.logp_of(self._ewma_state(dtype), None, logp)
        if self.needs_snapshots:
            for v in self._versions([], step):
                self.logp_of(self.snapshots[v], None, logp)

    def _ewma_state(self, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        return {k: v.to(dtype) if v.is_floating_point() else v for k, v in self.ewma.params.items()}

    def _versions(self, mine: list[int], step: int) -> list[int]:
        """The snapshot versions to score: this batch's, or on lockstep ranks those any rank's
        batch needs (every rank runs the same forwards). Raises for a version with no snapshot."""
        if self.lockstep:
            # Versions admission allows lie in [step - max_staleness, step]; one slot more
            # stands for anything older, so that every rank raises together.
            width = self.max_staleness + 2
            present = torch.zeros(width, dtype=torch.int64)
            for v in mine:
                present[min(max(step - v, 0), width - 1)] = 1
            device = _device(self.scratch)
            present = present.to(device)
            dist.all_reduce(present, op=dist.ReduceOp.MAX)
            found = [step - k for k in range(width - 1) if present[k]]
            if present[width - 1]:
                found.append(min([v for v in mine if step - v >= width - 1], default=step - width + 1))
            mine = sorted(found)
        for v in mine:
            if v not in self.snapshots:
                raise StalenessViolation(
                    f"step {step}: no snapshot of version {v} (kept: {sorted(self.snapshots)})"
                )
        return mine

    def logp_of(self, state: dict[str, torch.Tensor], ids_BL: torch.Tensor | None, logp):
        """The scratch model's `logp(model, ids)` of `ids_BL` under the weights `state` (None: a
        lockstep rank's empty part in the forwards)."""
        mb = self.micro_batch_size
        starts = [] if ids_BL is None else list(range(0, ids_BL.shape[0], mb))
        with self._scratch_lock, torch.no_grad():
            if not self.lockstep:
                self.scratch.lm.load_state_dict(state, strict=True)
                return torch.cat([logp(self.scratch, ids_BL[i : i + mb]) for i in starts])
            load_local(self.scratch.lm, state)
            count = torch.tensor([len(starts)], dtype=torch.int64, device=_device(self.scratch))
            dist.all_reduce(count, op=dist.ReduceOp.MAX)  # as many forwards as the busiest rank
            out = [logp(self.scratch, ids_BL[i : i + mb]) for i in starts]
            empty = torch.full((1, 2), self.pad_token_id, dtype=torch.long)
            for _ in range(int(count) - len(starts)):
                logp(self.scratch, empty)
            return torch.cat(out) if out else None

    def after_update(self, model: torch.nn.Module, version: int) -> None:
        """Track the new version `version` (the EWMA moves, a snapshot is taken, old ones go)."""
        if self.ewma is not None:
            self.ewma = self.ewma.update(_shards(model), decay=self.ewma_decay)
        if self.needs_snapshots:
            self.snapshots[version] = _snapshot(model)
            for old in [v for v in self.snapshots if v < version - self.max_staleness]:
                del self.snapshots[old]

    def state_dict(self) -> dict:
        """What a learner checkpoint keeps of the copies."""
        return {
            "ewma": None if self.ewma is None else {"params": self.ewma.params, "total": self.ewma.total},
            "snapshots": {str(v): s for v, s in self.snapshots.items()},
        }

    def load_state_dict(self, state: dict) -> None:
        if state.get("ewma") is not None:
            self.ewma = EwmaParams(state["ewma"]["params"], float(state["ewma"]["total"]))
        self.snapshots = {int(v): s for v, s in state.get("snapshots", {}).items()}


def _shards(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """`model`'s state dict as this rank's shards (the whole tensors on an unsharded model)."""
    return {k: local(v.detach()) for k, v in model.state_dict().items()}


def _snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in _shards(model).items()}


def _device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device
