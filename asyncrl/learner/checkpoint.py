"""The learner's half of a resumable checkpoint: model, optimizer, RNG and version, what the
staleness policy tracks (the EWMA of the weights, the snapshots of recent versions), and the
buffered trajectories: those received for later steps and not trained yet (in async mode the
generators run ahead, so the learner holds part of the next windows when it checkpoints).

On resume the held trajectories go back into the learner's buffer exactly as they were (same
tokens, behavior log-probs and versions), so the resumed run trains on the samples the interrupted
one had; the launcher re-admits their groups all the same, and the regenerated copies are dropped
by traj_id (counted as `learner/resume_regenerated`, not as duplicates).

Place in the data flow: the learner service calls `save_learner_checkpoint` after publishing
version v when v is a multiple of `run.checkpoint_every`, on the last step, and when it is told to
stop early; then it sends its StepDone, so the launcher writes its half
(`asyncrl/scheduler/checkpoint.py`) for the same version after the learner's file exists. A
resume (`asyncrl launch --resume RUN_DIR`) takes the newest version with both halves.

File: `<run_dir>/checkpoints/learner-{version:08d}.pt`, written with `torch.save` to a temporary
file, fsynced and renamed (atomic). It is read with `torch.load(weights_only=True)`, which
unpickles tensors and plain containers only, never arbitrary objects.
"""

from __future__ import annotations

import dataclasses
import os
import random
import re
from collections.abc import Iterable
from pathlib import Path

import torch

from asyncrl.learner.step import TrainSample

FORMAT = 1
KEEP = 2  # learner checkpoints kept on disk (each holds the model and the optimizer state)
_NAME_RE = re.compile(r"^learner-(\d{8,})\.pt$")


def learner_checkpoint_path(run_dir: Path, version: int) -> Path:
    return run_dir / "checkpoints" / f"learner-{version:08d}.pt"


def learner_checkpoint_versions(run_dir: Path) -> list[int]:
    folder = run_dir / "checkpoints"
    if not folder.is_dir():
        return []
    return sorted(int(m.group(1)) for p in folder.iterdir() if (m := _NAME_RE.match(p.name)))


def _held_state(step: int, sample: TrainSample, extra: dict | None = None) -> dict:
    fields = {f.name: getattr(sample, f.name) for f in dataclasses.fields(sample)}
    fields["prompt_ids"] = [int(t) for t in sample.prompt_ids]
    return {"step": step, "sample": fields, "extra": dict(extra or {})}


def save_learner_checkpoint(run_dir: Path, version: int, trainer, held: Iterable[tuple] = ()) -> Path:
    """Atomically write the trainer's state after `version` updates, with the (step, sample)
    pairs the learner holds for later steps (or (step, sample, extra) triples: pool mode keeps
    each group's reuse count and freshness in `extra`)."""
    path = learner_checkpoint_path(run_dir, version)
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {
        "format": FORMAT,
        "version": version,
        "model": {k: v.detach().clone() for k, v in trainer.model.state_dict().items()},
        "optimizer": trainer.optimizer.state_dict(),
        "torch_rng": torch.get_rng_state(),
        "python_rng": list(random.getstate()[1]),
        "ewma": None
        if trainer.ewma is None
        else {"params": trainer.ewma.params, "total": trainer.ewma.total},
        "snapshots": {str(v): s for v, s in trainer.snapshots.items()},
        "held": [_held_state(*entry) for entry in held],
    }
    tmp = path.with_name(f".{path.name}.tmp")
    torch.save(state, tmp)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)
    # Keep the newest KEEP: the launcher's half of the newest may not be written yet.
    for old in learner_checkpoint_versions(run_dir)[:-KEEP]:
        learner_checkpoint_path(run_dir, old).unlink(missing_ok=True)
    return path


def load_learner_checkpoint(run_dir: Path, version: int, trainer, *, extras: bool = False) -> list[tuple]:
    """Restore a trainer (built from the same config and model) to `version`; returns the held
    (step, sample) pairs to put back into the learner's buffer ((step, sample, extra) triples
    with `extras`)."""
    from asyncrl.staleness.ewma import EwmaParams

    path = learner_checkpoint_path(run_dir, version)
    try:
        state = torch.load(path, weights_only=True)
    except (OSError, RuntimeError, ValueError) as exc:
        raise ValueError(f"learner checkpoint {path} cannot be read: {exc}") from None
    if state.get("format") != FORMAT or state.get("version") != version:
        raise ValueError(
            f"learner checkpoint {path} is not a format-{FORMAT} checkpoint of version {version}"
        )
    trainer.model.load_state_dict(state["model"], strict=True)
    trainer.optimizer.load_state_dict(state["optimizer"])
    torch.set_rng_state(state["torch_rng"])
    random.setstate((3, tuple(state["python_rng"]), None))
    if state["ewma"] is not None:
        trainer.ewma = EwmaParams(state["ewma"]["params"], float(state["ewma"]["total"]))
    trainer.snapshots = {int(v): s for v, s in state["snapshots"].items()}
    held = [(int(h["step"]), TrainSample(**h["sample"]), h.get("extra", {})) for h in state.get("held", [])]
    return held if extras else [(step, sample) for step, sample, _ in held]
