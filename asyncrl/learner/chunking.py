"""`learner.min_chunk = "auto"`: stream a window in chunks, or train it whole, chosen by measurement
(pure; the step loop feeds it).

Place in the data flow: `StepLoop.run_step` (`loop.py`) asks `ChunkChoice.min_chunk()` before
each step of one plain streaming rank and reports the step's wall time after it
(`ChunkChoice.observe`).

Why measure: streaming trains chunks while the window still arrives, so a learner that waits
for its generators finishes each step one chunk after the last arrival instead of one whole
window after it; but a chunk may cost more per trajectory than a whole window (smaller matrix
products, more calls), so a learner that never waits would pay that and gain nothing. Which wins depends on the workload and the machine, so the learner tries both:
after `WARMUP_STEPS`, the next 2 x `TRIAL_STEPS` steps alternate between chunks of
`STREAM_CHUNK` and whole windows, then every later step takes the way whose median step time
(arrivals included: what a user waits for) was lower; streaming keeps ties within `MARGIN`
(the lower tail is worth a little). `choice` says what was chosen and why, the learner reports
it (docs/learner.md, "Streaming or whole windows"), and the choice is revisited every
`REVISIT_STEPS` steps the same way.
"""

from __future__ import annotations

import statistics

STREAM_CHUNK = 64  # trajectories per streamed chunk, at least (the fixed learner.min_chunk default)
WARMUP_STEPS = 1  # steps before the first trial (start-up, the first weights)
TRIAL_STEPS = 3  # steps measured each way
MARGIN = 0.02  # whole windows must be this much faster to be chosen
REVISIT_STEPS = 200  # steps between trials


class ChunkChoice:
    def __init__(self, window: int, *, chunk: int = STREAM_CHUNK) -> None:
        self.window = window
        self.chunk = min(chunk, window)
        self.steps = 0  # steps observed
        self.trial_start = WARMUP_STEPS
        self.times: dict[str, list[float]] = {"stream": [], "whole": []}
        self.way = "stream"  # the way chosen (until the first trial ends: streaming)
        self.choice = ""  # the last decision, in words ("" before the first)

    def _trial_way(self) -> str | None:
        """The way the current step is a trial of, or None outside a trial."""
        k = self.steps - self.trial_start
        if 0 <= k < 2 * TRIAL_STEPS:
            return "stream" if k % 2 == 0 else "whole"
        return None

    def min_chunk(self) -> int:
        """`min_chunk` for the step about to train."""
        way = self._trial_way() or self.way
        return self.chunk if way == "stream" else self.window

    def observe(self, step_s: float) -> str | None:
        """The step just trained took `step_s` (start to update, waiting included); returns the
        decision in words when this step ended a trial."""
        way = self._trial_way()
        self.steps += 1
        if way is None:
            return None
        self.times[way].append(step_s)
        if self.steps - self.trial_start < 2 * TRIAL_STEPS:
            return None
        stream, whole = (statistics.median(self.times[w]) for w in ("stream", "whole"))
        self.way = "whole" if whole < stream * (1 - MARGIN) else "stream"
        self.times = {"stream": [], "whole": []}
        self.trial_start = self.steps + REVISIT_STEPS
        chosen = (
            f"whole windows of {self.window}"
            if self.way == "whole"
            else f"streaming in chunks of {self.chunk}"
        )
        self.choice = (
            f"learner: {chosen} (median step {stream:.3f} s streaming in chunks of {self.chunk}, "
            f"{whole:.3f} s in whole windows of {self.window}; next trial after {REVISIT_STEPS} steps)"
        )
        return self.choice


def fixed_min_chunk(value: int | str) -> int:
    """`learner.min_chunk` as a number where no trial runs (lockstep ranks, the pool)."""
    return STREAM_CHUNK if value == "auto" else int(value)
