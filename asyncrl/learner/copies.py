"""Copies of the policy's weights that a staleness policy reads (no sockets): an EWMA of the
parameters (PPO-EWMA) and snapshots of the last max_staleness + 1 versions (exact old logits),
each scored with one scratch model.

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
        self.ewma: EwmaParams | None = None
        self.snapshots: dict[int, dict[str, torch.Tensor]] = {}
        self.scratch = None
        self._scratch_lock = threading.Lock()  # one scratch model: data-parallel pieces take turns
        if self.needs_ewma or self.needs_snapshots:
            self.scratch = copy.deepcopy(actor).eval().requires_grad_(False)
        if self.needs_ewma:
            if policy.ewma_decay is None:
                raise ValueError(
                    f"staleness policy {policy.name!r} needs 'ewma' inputs but declares no ewma_decay"
                )
            self.ewma_decay: float = policy.ewma_decay
            self.ewma = EwmaParams.init(actor.lm.state_dict())
        if self.needs_snapshots:
            self.snapshots[0] = _snapshot(actor.lm)

    def inputs(
        self,
        batch: PackedBatch,
        step: int,
        dtype: torch.dtype,
        logp: Callable[[torch.nn.Module, torch.Tensor], torch.Tensor],
    ) -> dict[str, torch.Tensor]:
        """The optional TokenBatch inputs of `batch` at `step`; `logp(model, ids_BL)` scores."""
        extra = {}
        if self.ewma is not None:
            state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in self.ewma.params.items()}
            extra["logp_ewma_BT"] = self._scratch_logp(state, batch.input_ids_BL, logp)
        if self.needs_snapshots:
            mask = batch.completion_mask_BL
            by_version = {}
            for v in versions_needed(batch.versions_BL, mask):
                if v not in self.snapshots:
                    raise StalenessViolation(
                        f"step {step}: no snapshot of version {v} (kept: {sorted(self.snapshots)})"
                    )
                by_version[v] = self._scratch_logp(self.snapshots[v], batch.input_ids_BL, logp)
            extra["logp_old_train_BT"] = assemble_old_train_logp(
                batch.versions_BL, by_version, mask, dtype=dtype
            )
        return extra

    def _scratch_logp(self, state: dict[str, torch.Tensor], ids_BL: torch.Tensor, logp) -> torch.Tensor:
        mb = self.micro_batch_size
        with self._scratch_lock, torch.no_grad():
            self.scratch.lm.load_state_dict(state, strict=True)
            return torch.cat([logp(self.scratch, ids_BL[i : i + mb]) for i in range(0, ids_BL.shape[0], mb)])

    def after_update(self, model: torch.nn.Module, version: int) -> None:
        """Track the new version `version` (the EWMA moves, a snapshot is taken, old ones go)."""
        if self.ewma is not None:
            self.ewma = self.ewma.update(model.state_dict(), decay=self.ewma_decay)
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


def _snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}
