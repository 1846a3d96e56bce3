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

Layout: `<run_dir>/checkpoints/learner-{version:08d}/`, a torch.distributed.checkpoint (DCP)
directory. Every learner rank writes its own shards of the model and optimizer state (collective:
all ranks call `save_learner_checkpoint` at the same step), keyed by parameter name, so a
checkpoint loads on the same or a different number of ranks, sharded or not: DCP reads each
rank's slices of each tensor. Rank 0 adds `extras.pt` (version, RNG, EWMA, snapshots, held
trajectories), written with `torch.save` and read with `torch.load(weights_only=True)` (tensors
and plain containers only). The directory is written under a temporary name and renamed by rank 0
once every rank's shards are in (atomic).
"""

from __future__ import annotations

import dataclasses
import os
import random
import re
import shutil
import warnings
from collections.abc import Iterable
from pathlib import Path

import torch

from asyncrl.learner.opd_control import control_state, restore_control
from asyncrl.learner.step import TrainSample

FORMAT = 2
KEEP = 2  # learner checkpoints kept on disk (each holds the model and the optimizer state)
_NAME_RE = re.compile(r"^learner-(\d{8,})$")
EXTRAS = "extras.pt"
COPIES = "copies-rank{rank}.pt"  # lockstep ranks' shards of the staleness policy's weight copies
# What DCP warns at every save and load without a process group; one learner rank means exactly
# that, and the warning would be what the launcher shows as the learner's last lines.
_SINGLE_PROCESS_WARNING = r"torch\.distributed is disabled, unavailable or uninitialized"


def learner_checkpoint_path(run_dir: Path, version: int) -> Path:
    return run_dir / "checkpoints" / f"learner-{version:08d}"


def learner_checkpoint_versions(run_dir: Path) -> list[int]:
    folder = run_dir / "checkpoints"
    if not folder.is_dir():
        return []
    return sorted(
        int(m.group(1)) for p in folder.iterdir() if (m := _NAME_RE.match(p.name)) and (p / EXTRAS).is_file()
    )


def _held_state(step: int, sample: TrainSample, extra: dict | None = None) -> dict:
    fields = {f.name: getattr(sample, f.name) for f in dataclasses.fields(sample)}
    fields["prompt_ids"] = [int(t) for t in sample.prompt_ids]
    return {"step": step, "sample": fields, "extra": dict(extra or {})}


def _model_and_optim(trainer):
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(trainer.actor, trainer.optimizer)
    return {"model": model_sd, "optim": optim_sd}


def _dcp(call, state: dict, path: Path) -> None:
    """`dcp.save` or `dcp.load` of `state` at `path`: collective over the ranks of the process
    group, or explicitly single-process (`no_dist`) without one, its warning silenced (that
    message only, for this call only)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        call(state, checkpoint_id=path)
        return
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_SINGLE_PROCESS_WARNING)
        call(state, checkpoint_id=path, no_dist=True)


def _after_rank0(trainer) -> None:
    import torch.distributed as dist

    if trainer.world_size > 1 and dist.is_available() and dist.is_initialized():
        dist.barrier()


def save_learner_checkpoint(run_dir: Path, version: int, trainer, held: Iterable[tuple] = ()) -> Path:
    """Write the trainer's state after `version` updates (every rank: its shards), with the
    (step, sample) pairs the learner holds for later steps (or (step, sample, extra) triples:
    pool mode keeps each group's reuse count and freshness in `extra`), kept by rank 0."""
    import torch.distributed.checkpoint as dcp

    path = learner_checkpoint_path(run_dir, version)
    tmp = path.with_name(f".{path.name}.tmp")
    rank0 = trainer.rank == 0
    if rank0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    # DCP's writer creates the folder on every rank before its first collective: the other ranks
    # wait until rank 0 has cleared a stale one, or rank 0 would remove what they just made.
    _after_rank0(trainer)
    if trainer.lockstep and trainer.copies.active:  # copies sharded like the model: each rank its own
        torch.save(trainer.copies.state_dict(), tmp / COPIES.format(rank=trainer.rank))
    _dcp(dcp.save, _model_and_optim(trainer), tmp)  # (its collectives: every rank's file is in)
    if not rank0:
        return path
    extras = {
        "format": FORMAT,
        "version": version,
        "world_size": trainer.world_size,
        "torch_rng": torch.get_rng_state(),
        "python_rng": list(random.getstate()[1]),
        **({} if trainer.lockstep else trainer.copies.state_dict()),  # "ewma" and "snapshots"
        "nonfinite_total": trainer.updater.nonfinite_total,
        "held": [_held_state(*entry) for entry in held],
        **control_state(trainer),  # opd: the gap horizon's next value
    }
    torch.save(extras, tmp / EXTRAS)
    for f in tmp.iterdir():
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())
    shutil.rmtree(path, ignore_errors=True)
    os.replace(tmp, path)
    # Keep the newest KEEP: the launcher's half of the newest may not be written yet.
    for old in learner_checkpoint_versions(run_dir)[:-KEEP]:
        shutil.rmtree(learner_checkpoint_path(run_dir, old), ignore_errors=True)
    return path


def load_learner_checkpoint(run_dir: Path, version: int, trainer, *, extras: bool = False) -> list[tuple]:
    """Restore a trainer (built from the same config and model, on any number of ranks) to
    `version`; every rank calls it. Returns the held (step, sample) pairs to put back into the
    learner's buffer ((step, sample, extra) triples with `extras`)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    path = learner_checkpoint_path(run_dir, version)
    try:
        state = torch.load(path / EXTRAS, weights_only=True)
    except (OSError, RuntimeError, ValueError) as exc:
        raise ValueError(f"learner checkpoint {path} cannot be read: {exc}") from None
    if state.get("format") != FORMAT or state.get("version") != version:
        raise ValueError(
            f"learner checkpoint {path} is not a format-{FORMAT} checkpoint of version {version}"
        )
    target = _model_and_optim(trainer)
    try:
        _dcp(dcp.load, target, path)
    except Exception as exc:  # DCP raises CheckpointException (a BaseException subclass) among others
        raise ValueError(f"learner checkpoint {path} cannot be loaded into this model: {exc}") from None
    set_state_dict(
        trainer.actor, trainer.optimizer, model_state_dict=target["model"], optim_state_dict=target["optim"]
    )
    torch.set_rng_state(state["torch_rng"])
    random.setstate((3, tuple(state["python_rng"]), None))
    trainer.copies.load_state_dict(_copies_state(path, state, trainer))
    trainer.updater.restore(nonfinite_total=int(state.get("nonfinite_total", 0)))
    restore_control(trainer, state)
    held = [(int(h["step"]), TrainSample(**h["sample"]), h.get("extra", {})) for h in state.get("held", [])]
    return held if extras else [(step, sample) for step, sample, _ in held]


def _copies_state(path: Path, extras: dict, trainer) -> dict:
    """The weight copies' state for this rank: rank 0's extras (one plain rank), or this rank's
    own shards (lockstep ranks), which load only on as many ranks as wrote them."""
    files = sorted(path.glob(COPIES.format(rank="*")))
    if not files and trainer.lockstep and trainer.copies.active:
        raise ValueError(
            f"learner checkpoint {path} was written by one plain learner rank, and the staleness policy's "
            "weight copies are not resharded: resume it with learner.world_size = 1"
        )
    if not files:
        return extras
    if not trainer.lockstep or len(files) != trainer.world_size:
        raise ValueError(
            f"learner checkpoint {path} holds the staleness policy's weight copies sharded over "
            f"{len(files)} learner ranks: resume it with learner.world_size = {len(files)} and "
            "learner.sharding = 'fsdp' (the copies are not resharded)"
        )
    return torch.load(path / COPIES.format(rank=trainer.rank), weights_only=True)
