"""How many cores the learner trains on, on a CPU host it shares with the generators (pure).

Place in the data flow: `load_policy_model` and `build_trainer` (`loop.py`) resolve
`learner.threads` once; the learner service tells `CoreShare` each step's idle and busy time
(`service.py`), and the trainer trains the next step's micro-batches on as many data-parallel
threads as it says (`Trainer.backward_pieces`).

The policy (docs/learner.md, "Cores"). A stage that waits uses no CPU, so on a host whose
stages run concurrently the question is only who gets the cores while both have work:

* the learner starts on every core it may use (`learner.cpus`, else the process's affinity):
  on the default job a learner step costs about three times the generation of its samples, so
  the learner bounds the run and each core it leaves idle is lost;
* after every step it is revisited from what the step measured: a learner that waited for
  trajectories for more than `SHRINK_IDLE` of its recent time is not the bound stage, and
  every thread it trains on takes time from the generators that are, so it gives one back;
  one that waited less than `GROW_IDLE` bounds the run and takes one more (up to the start
  value). The idle ratio is smoothed (`SMOOTHING`) so one slow arrival does not flip it.

The same rule holds with several generators: each is one more claimant on the shared cores,
and the learner's idle time is what says whether they keep up. A GPU learner trains on its
device (one CPU thread); there the analogous choice, how many devices train and how many
generate, is the placement's (docs/learner.md, "Cores").
"""

from __future__ import annotations

import os
from collections.abc import Sequence

SHRINK_IDLE = 0.10  # smoothed idle ratio above which the learner gives a thread back
GROW_IDLE = 0.02  # ... below which it takes one more
SMOOTHING = 0.3  # weight of the newest step in the smoothed idle ratio


def available_cpus(cpus: Sequence[int] = ()) -> int:
    """CPUs this process may run on: the configured list, else its affinity mask."""
    if cpus:
        return len(cpus)
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def resolve_threads(threads: int | str, *, cpus: Sequence[int] = (), world_size: int = 1) -> int:
    """`learner.threads` as a number: "auto" = the CPUs it may use, shared by its ranks."""
    if threads == "auto":
        return max(1, available_cpus(cpus) // world_size)
    return int(threads)


class CoreShare:
    """The learner's thread count, revisited after every step from its idle ratio."""

    def __init__(self, most: int) -> None:
        if most < 1:
            raise ValueError(f"a core share needs at least one thread, got {most}")
        self.most = most
        self.threads = most
        self.idle_ratio: float | None = None  # smoothed

    def observe(self, idle_s: float, busy_s: float) -> int:
        """One step's waiting and working time; returns the thread count for the next step."""
        total = idle_s + busy_s
        if total <= 0:
            return self.threads
        ratio = idle_s / total
        if self.idle_ratio is None:
            self.idle_ratio = ratio
        else:
            self.idle_ratio = SMOOTHING * ratio + (1 - SMOOTHING) * self.idle_ratio
        if self.idle_ratio > SHRINK_IDLE and self.threads > 1:
            self.threads -= 1
            self.idle_ratio = (SHRINK_IDLE + GROW_IDLE) / 2  # judge the new count afresh
        elif self.idle_ratio < GROW_IDLE and self.threads < self.most:
            self.threads += 1
            self.idle_ratio = (SHRINK_IDLE + GROW_IDLE) / 2
        return self.threads
