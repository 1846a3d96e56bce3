"""A learner step's schedule, as a record (no sockets): what `asyncrl replay` re-executes.

Place in the data flow: the step loop (`loop.StepLoop`) describes each step it ran as a
`StepSchedule` (the step's trajectories in offer order, the offered count at each `work()` call,
whether it trained one whole batch, and the thread count) and hands it to the callback the
learner service gave it; with `run.record_schedule = true` that callback is
`ScheduleRecorder.write`, which writes `<run>/schedule/step-<step>.pt`. The replay tool
(`asyncrl/replay.py`, the app layer) reads the files back with `read_step`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

import torch

from asyncrl.learner.step import TrainSample


class StepSchedule(NamedTuple):
    """What one step did, in the order it did it."""

    step: int
    samples: Sequence[TrainSample]  # in offer order
    calls: Sequence[int]  # the offered count at each `work()` call
    whole: bool  # trained one whole batch (`batch_backward`)
    threads: int  # data-parallel threads it trained on


SCHEDULE_DIR = "schedule"
FORMAT = 1


def schedule_path(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / SCHEDULE_DIR / f"step-{step:08d}.pt"


def _sample_state(sample: TrainSample) -> dict:
    fields = {f.name: getattr(sample, f.name) for f in dataclasses.fields(sample)}
    fields["prompt_ids"] = [int(t) for t in sample.prompt_ids]
    return fields


class ScheduleRecorder:
    """Learner side: writes each step's schedule when the step ends (the step loop's callback)."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = Path(run_dir)
        (self.run_dir / SCHEDULE_DIR).mkdir(parents=True, exist_ok=True)

    def write(self, schedule: StepSchedule) -> None:
        path = schedule_path(self.run_dir, schedule.step)
        tmp = path.with_name(f".{path.name}.tmp")
        record = {
            "format": FORMAT,
            "step": schedule.step,
            "threads": schedule.threads,
            "whole": schedule.whole,
            "calls": [int(c) for c in schedule.calls],
            "samples": [_sample_state(s) for s in schedule.samples],
        }
        torch.save(record, tmp)
        tmp.replace(path)  # a step re-run after a resume replaces its record


def read_step(run_dir: Path, step: int) -> dict:
    path = schedule_path(run_dir, step)
    if not path.is_file():
        raise ValueError(
            f"{run_dir} has no schedule for step {step} ({path} missing): record runs with "
            "--set run.record_schedule=true; a run stopped early has a schedule up to where it stopped"
        )
    try:
        record = torch.load(path, weights_only=True)
    except (OSError, RuntimeError, ValueError) as exc:
        raise ValueError(f"schedule file {path} cannot be read: {exc}") from None
    if record.get("format") != FORMAT or record.get("step") != step:
        raise ValueError(f"schedule file {path} is not a format-{FORMAT} record of step {step}")
    return record
