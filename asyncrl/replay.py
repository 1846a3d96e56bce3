"""Bitwise replay of an asynchronous run: its learner schedule, recorded and re-executed.

What makes two runs of the same config differ is timing, and timing reaches the weights only
through what the learner did and when: which trajectories a step trained, in which order they
were offered to the trainer, at which points the trainer was told to work (how many had arrived
then decides how they are chunked and packed), and on how many data-parallel threads
(`learner.threads = "auto"` moves it between steps). With `run.record_schedule = true` the learner
writes exactly that, one file per step, to `<run>/schedule/step-<step>.pt`, when the step ends:
the step's trajectories in offer order (tokens, behaviour log-probs, the version of every token,
rewards, distillation tensors), the offered count at each `work()` call, whether the step trained
one whole batch, and the thread count.

`asyncrl replay RUN_DIR` re-runs the learner from the run's initial weights on that schedule, with
no generator and no timing left to chance, and writes the parameters and the training values of
every step; they are bitwise those of the recorded run (tests/integration/test_replay.py). With
`--until N` it stops after step N - 1 with a learner checkpoint of version N, to look at the state
where a run diverged; `--resume DIR` continues such a checkpoint to the end, equal to the original.

Scope: generation is recorded, not re-executed: the trajectories (and the version that sampled each
token) are the schedule's data. One plain learner rank with window admission (what the config
loader allows with `run.record_schedule`). Files are written with `torch.save` and read with
`torch.load(weights_only=True)`, as the learner's checkpoints are.
"""

from __future__ import annotations

import contextlib
import json
import math
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec
import torch

from asyncrl.learner.schedule import read_step
from asyncrl.learner.step import StepResult, TrainSample

if TYPE_CHECKING:
    from asyncrl.config import Config

# The StepDone fields that are training values (what a replay must reproduce): everything but
# timings and the learner's own notes.
TRAINING_FIELDS = (
    "step",
    "version",
    "num_trajectories",
    "num_tokens",
    "loss",
    "mean_reward",
    "max_staleness",
    "mean_staleness",
    "clip_fraction",
    "grad_norm",
    "lr_scale",
    "stats",
    "skipped_nonfinite",
)


def replay_step(trainer, record: dict) -> StepResult:
    """Re-execute one recorded step on `trainer`: the same offers, work calls and thread count."""
    step = int(record["step"])
    samples = [TrainSample(**s) for s in record["samples"]]
    trainer.engine.force_threads(int(record["threads"]))
    trainer.begin_step(step, window_groups=len(samples) // trainer.group_size)
    if record["whole"]:
        trainer.batch_backward(samples)
    else:
        offered = 0
        for count in record["calls"]:
            while offered < count:
                trainer.offer(samples[offered])
                offered += 1
            trainer.work()
        for sample in samples[offered:]:  # offered after the last work call (none in practice)
            trainer.offer(sample)
    return trainer.finish_step()


def training_values(record: dict) -> dict:
    """A StepDone (as a metrics.jsonl step record or a dict) reduced to its training values."""
    return {k: record[k] for k in TRAINING_FIELDS if k in record}


def same_values(a: dict, b: dict) -> bool:
    """Equal training values, NaN equal to NaN (a statistic a policy does not report)."""

    def norm(x):
        if isinstance(x, float) and math.isnan(x):
            return "nan"
        if isinstance(x, dict):
            return {k: norm(v) for k, v in x.items()}
        return x

    return norm(training_values(a)) == norm(training_values(b))


def write_jsonl(path: Path, rows: Sequence[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def run_replay(
    run_dir: Path,
    out_dir: Path,
    config: Config,
    model_path: Path,
    *,
    until: int | None = None,
    resume: Path | None = None,
) -> dict:
    """Replay `run_dir`'s schedule from its initial weights (or from the replay checkpoint in
    `resume`) into `out_dir`: `metrics.jsonl` (one step record of training values per step),
    `final_params.safetensors` (float32, the model's own names) and, with `until`, a learner
    checkpoint of version `until`. Returns a summary (steps replayed, where it stopped)."""
    from safetensors.torch import save_file

    from asyncrl.learner.checkpoint import load_learner_checkpoint, save_learner_checkpoint
    from asyncrl.learner.loop import build_trainer, load_policy_model

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    total = config.learner.steps
    end = total if until is None else until
    if not 0 < end <= total:
        raise ValueError(f"--until {until}: the run has steps 1..{total}")
    actor, tokenizer = load_policy_model(model_path, config)
    trainer = build_trainer(config, actor, pad_token_id=tokenizer.pad_token_id)
    start = 0
    if resume is not None:
        from asyncrl.learner.checkpoint import learner_checkpoint_versions

        versions = learner_checkpoint_versions(Path(resume))
        if not versions:
            raise ValueError(f"--resume {resume}: no replay checkpoint there (write one with --until N)")
        start = versions[-1]
        with _one_process():
            load_learner_checkpoint(Path(resume), start, trainer)
        if start >= end:
            raise ValueError(f"--resume {resume} is at version {start}; nothing left to replay up to {end}")
    rows = []
    for step in range(start, end):
        result = replay_step(trainer, read_step(run_dir, step))
        rows.append(training_values(msgspec.to_builtins(result.step_done(step_s=0.0, idle_s=0.0))))
    write_jsonl(out_dir / "metrics.jsonl", rows)
    if until is not None:
        with _one_process():
            save_learner_checkpoint(out_dir, until, trainer)
    state = {
        k: v.detach().to("cpu", torch.float32).contiguous() for k, v in trainer.actor.lm.state_dict().items()
    }
    save_file(_untied(state), str(out_dir / "final_params.safetensors"))
    return {"run_dir": str(run_dir), "out_dir": str(out_dir), "from_version": start, "to_version": end}


@contextlib.contextmanager
def _one_process():
    """torch.distributed.checkpoint without a process group warns that it assumes one process:
    that is what a replay is."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield


def _untied(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """safetensors refuses tensors that share memory (tied embeddings): each saved once, cloned."""
    seen: dict[int, str] = {}
    out = {}
    for name, t in state.items():
        ptr = t.data_ptr()
        out[name] = t.clone() if ptr in seen else t
        seen.setdefault(ptr, name)
    return out
