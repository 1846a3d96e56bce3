"""Window or pool admission, chosen once (pure): the only place the scheduler reads `buffer.mode`.

Place in the data flow: the launcher (`scheduler/service.py`) holds one `AdmissionMode` and asks
it, without knowing which it is, how many groups may be admitted now, which window a group's task
carries, what a StepDone or GroupsLeft means for the task book, which groups a resume admits
again, and how many admission credits are used and free (for the monitor's snapshot).

  window (buffer.mode = "window"): group j trains in step j // B; `Admission` lets groups in up
      to (v_loaded + K + 1) x B (scheduler/admission.py states the bound and its proof). Every
      group of step s is trained by StepDone(s); the learner never sends GroupsLeft.
  pool (buffer.mode = "pool"): groups train in any order; `CreditAdmission` hands out
      (K + 1) x B credits, returned by GroupsLeft once the generators hold the version it names.
      A task carries the version the generators held when it was admitted (the buffer's
      `windowed` order reads it); StepDone lists the groups trained and replayed.
"""

from __future__ import annotations

import logging
from typing import Protocol

import msgspec

from asyncrl.buffer.ledger import Ledger, LedgerSnapshot
from asyncrl.config import Config
from asyncrl.messages import GroupsLeft, StepDone
from asyncrl.scheduler.admission import Admission, CreditAdmission, admission_limit, step_of
from asyncrl.scheduler.control import ControlSettings, Signal, StalenessController
from asyncrl.scheduler.tasks import TaskBook

log = logging.getLogger(__name__)


class AdmissionMode(Protocol):
    """What differs between window and pool admission; `make_mode` picks one per run."""

    # The counters a launcher checkpoint saves (scheduler/checkpoint.py).
    admission: Admission | CreditAdmission
    # A completed run has trained every sample it admitted (pool mode ends with the buffer's
    # lead admitted and not trained: pending, not lost).
    trains_every_admitted_sample: bool

    def admit(self, loaded_version: int) -> range:
        """Group indices admitted now, given the oldest version a serving generator holds."""

    def task_window(self, group_id: int, *, loaded_version: int) -> int:
        """The `window` of the group's PromptTask when it is admitted at `loaded_version`: the
        step that trains it (window mode), or `loaded_version`, at most the last step (pool mode)."""

    def readmit(self, saved: dict) -> list[int]:
        """Resume: the groups of a launcher checkpoint (decoded JSON) to admit again; advances
        the counters past every group that checkpoint had admitted."""

    def on_step_done(self, book: TaskBook, msg: StepDone) -> str:
        """Record in the ledger what the step trained; returns a decision this changed, in words
        (the closed-loop staleness bound), or ""."""

    def on_groups_left(self, book: TaskBook, msg: GroupsLeft) -> None:
        """Groups left the learner's buffer: record the dropped ones, return their credits;
        ValueError (a protocol violation) when this mode expects no GroupsLeft."""

    def credits(self, *, steps_trained: int, loaded_version: int) -> tuple[int, int]:
        """(used, free) admission credits, for the `launcher` snapshot."""


class WindowMode:
    trains_every_admitted_sample = True

    def __init__(
        self,
        *,
        groups_per_step: int,
        max_staleness: int,
        total_steps: int,
        resume_version: int = 0,
        control: StalenessController | None = None,
    ) -> None:
        self.control = control  # staleness.max_staleness = "auto": it moves the bound
        self.admission = Admission(
            groups_per_step=groups_per_step,
            max_staleness=max_staleness if control is None else control.bound,
            total_steps=total_steps,
        )
        # Resuming at version v: groups [0, v*B) were trained; every later one is admitted again.
        self.admission.num_admitted = resume_version * groups_per_step

    def admit(self, loaded_version: int) -> range:
        return self.admission.admit(loaded_version)

    def task_window(self, group_id: int, *, loaded_version: int) -> int:
        return step_of(group_id, groups_per_step=self.admission.groups_per_step)

    def readmit(self, saved: dict) -> list[int]:
        admitted = saved["admission"]["num_admitted"]
        again = list(range(self.admission.num_admitted, admitted))
        self.admission.num_admitted = max(self.admission.num_admitted, admitted)
        return again

    def on_step_done(self, book: TaskBook, msg: StepDone) -> str:
        try:
            book.trained(msg.step)
        except ValueError as exc:  # a bookkeeping bug must show in the log, not stop training
            log.error("ledger: %s", exc)
        if self.control is None:
            return ""
        signal = Signal.from_step(
            step=msg.step,
            step_s=msg.step_s,
            idle_s=msg.idle_s,
            clip_fraction=msg.clip_fraction,
            stats=msg.stats,
        )
        decision = self.control.observe(signal)
        if decision is None:
            return ""
        # From now on; groups already admitted keep the bound they were admitted under.
        self.admission.max_staleness = decision.new
        return decision.line()

    def on_groups_left(self, book: TaskBook, msg: GroupsLeft) -> None:
        raise ValueError("GroupsLeft is not expected: the learner's buffer.mode is 'window'")

    def credits(self, *, steps_trained: int, loaded_version: int) -> tuple[int, int]:
        adm = self.admission
        limit = admission_limit(
            loaded_version=loaded_version,
            groups_per_step=adm.groups_per_step,
            max_staleness=adm.max_staleness,
            total_groups=adm.total_groups,
        )
        used = max(0, adm.num_admitted - steps_trained * adm.groups_per_step)
        return used, max(0, limit - adm.num_admitted)


class PoolMode:
    trains_every_admitted_sample = False

    def __init__(self, *, groups_per_step: int, max_staleness: int, total_steps: int) -> None:
        self.admission = CreditAdmission(
            groups_per_step=groups_per_step, max_staleness=max_staleness, total_steps=total_steps
        )
        self.total_steps = total_steps

    def admit(self, loaded_version: int) -> range:
        return self.admission.admit(loaded_version)

    def task_window(self, group_id: int, *, loaded_version: int) -> int:
        return min(loaded_version, self.total_steps - 1)

    def readmit(self, saved: dict) -> list[int]:
        # Pool mode trains groups in any order: every group the checkpoint's ledger still has open
        # (admitted, neither trained nor dropped) is admitted again, each on a credit, and the
        # prompt stream continues after the last one admitted.
        admitted = saved["admission"]["num_admitted"]
        snap = msgspec.convert(saved["ledger"], LedgerSnapshot)
        again = Ledger.from_bytes(msgspec.msgpack.encode(snap)).open_tasks()
        self.admission.num_admitted = admitted
        self.admission.num_returned = admitted - len(again)
        return again

    def on_step_done(self, book: TaskBook, msg: StepDone) -> str:
        try:
            book.trained_pool(msg.step, trained=msg.groups_trained, replayed=msg.groups_replayed)
        except ValueError as exc:  # a bookkeeping bug must show in the log, not stop training
            log.error("ledger: %s", exc)
        return ""

    def on_groups_left(self, book: TaskBook, msg: GroupsLeft) -> None:
        try:
            book.evicted_pool(msg.evicted)
        except ValueError as exc:  # as in on_step_done; the credits come back regardless
            log.error("ledger: %s", exc)
        self.admission.release(len(msg.released), version=msg.version)

    def credits(self, *, steps_trained: int, loaded_version: int) -> tuple[int, int]:
        used = self.admission.outstanding
        return used, max(0, self.admission.capacity - used)


def make_mode(config: Config, *, resume_version: int = 0) -> AdmissionMode:
    """The run's admission mode (`buffer.mode`), positioned at `resume_version`."""
    shape = {
        "groups_per_step": config.learner.groups_per_step,
        "max_staleness": config.effective_max_staleness,
        "total_steps": config.learner.steps,
    }
    if config.buffer.mode == "pool":
        return PoolMode(**shape)
    control = StalenessController(control_settings(config)) if config.auto_staleness else None
    return WindowMode(**shape, resume_version=resume_version, control=control)


def control_settings(config: Config) -> ControlSettings:
    """The closed-loop bound's settings: from 1 within [1, cap] (0 is `mode = "sync"`, a choice of
    its own: the controller keeps the pipeline overlapped); a cap of 0 pins it at 0."""
    cap = config.effective_max_staleness
    return ControlSettings(cap=cap, start=min(1, cap), floor=min(1, cap))
