"""The recording learner of `asyncrl bench record` (see `record.py`): the real learner service,
whose step loop hands every complete window to `record_window` instead of the trainer."""

from __future__ import annotations

import json
import sys

from asyncrl.benchmarks.record import RECORDING_FILE, check_recordable, sample_record
from asyncrl.learner.service import LearnerService
from asyncrl.learner.step import TrainSample
from asyncrl.learner.trainer import StepResult
from asyncrl.runtime import ChildContext, run_child


class RecordingLearner(LearnerService):
    def __init__(self, ctx: ChildContext) -> None:
        check_recordable(ctx.config)
        super().__init__(ctx)

    def setup(self) -> None:
        super().setup()
        self.loop.sink = self.record_window  # the step loop trains each whole window with this

    def record_window(self, step: int, samples: list[TrainSample]) -> StepResult:
        """Append the window to <run>/trajectories.jsonl; the step's report says nothing trained."""
        with open(self.ctx.run_dir / RECORDING_FILE, "a") as out:
            for s in samples:
                out.write(json.dumps(sample_record(step, s)) + "\n")
        return StepResult(
            step=step,
            num_trajectories=len(samples),
            num_tokens=sum(len(s.completion_ids) for s in samples),
            loss=0.0,
            mean_reward=sum(s.reward for s in samples) / len(samples),
            max_staleness=0,
            mean_staleness=0.0,
            clip_fraction=0.0,
            grad_norm=0.0,
            lr_scale=1.0,
            policy_stats={},
            streamed=0,
            deferred=0,
            peak_stream_bytes=0,
            fallback="recording (asyncrl bench record)",
        )


async def main(ctx: ChildContext) -> None:
    await RecordingLearner(ctx).run()


if __name__ == "__main__":
    run_child("learner", main)
    sys.exit(0)
