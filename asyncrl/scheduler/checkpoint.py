"""The launcher's half of a resumable checkpoint: admission, dataset position, ledger, open tasks.

Place in the data flow: the launcher (`scheduler/service.py`) calls `save_launcher_checkpoint`
after a StepDone that `checkpoint_due` picks, and once more when a run stops early (the learner
writes model, optimizer and RNG state for the same version on its side). `asyncrl launch --resume
RUN_DIR` (`asyncrl/job.py`) resumes at the newest version with both halves: the launcher reads its
half back (`read_launcher_checkpoint`) and admits again every group it had admitted and not
trained (`scheduler/dispatch.py`). `load_launcher_checkpoint` rebuilds admission and the task book
from a file with every check.

Format (`<run_dir>/checkpoints/launcher-{steps_trained:08d}.json`, one JSON object, format 1):

    format          1
    steps_trained   learner steps whose StepDone the launcher had processed (= policy_version)
    admission       {groups_per_step, max_staleness, total_groups, num_admitted}
    next_group      dataset position: the index of the next group to admit (== num_admitted;
                    group j is prompt j of the task's seeded stream, so the index is the position)
    open_tasks      PromptTasks admitted and not finished (in flight or re-queued), with every
                    field, tagged {"type": "PromptTask", ...}; a resume dispatches them again as they
                    are, so their traj_ids (group_id * num_samples + sample_index) do not change
    requeued        ids of open tasks that were waiting for a generator, in order
    in_flight       {generator peer id: [task ids]} of the others (for the record: on resume those
                    processes are gone, so these tasks are re-queued too, after `requeued`)
    ledger          the `asyncrl.buffer.ledger` snapshot (LedgerSnapshot fields, JSON)
    task_fingerprint  the task's rows and order (`fingerprint()`, the dataset task), or ""
    selection       `sampling.selection`'s state (`scheduler/selection.py` SelectionState): the
                    strategy, its own state (cursor, random generator), the stream index of every
                    group admitted and not trained (a resume re-admits each with its own prompt),
                    and the per-prompt record (`scheduler/prompt_stats.py`); null in older files

Every group below `next_group` is either trained (its step is < steps_trained), or open. A resume
therefore neither skips a prompt (open tasks are re-sent, admission continues at next_group) nor
repeats one (trained groups are never re-admitted). Writes are atomic: a temporary file in the
same directory, fsynced, then renamed over the final name, and the directory fsynced; a reader
never sees a half-written checkpoint, and a crash mid-write leaves the previous one intact.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import msgspec

from asyncrl.buffer.ledger import Ledger, LedgerSnapshot, TaskState
from asyncrl.messages import PromptTask
from asyncrl.scheduler.admission import Admission, CreditAdmission
from asyncrl.scheduler.selection import SelectionState
from asyncrl.scheduler.tasks import TaskBook

FORMAT = 1
_NAME_RE = re.compile(r"^launcher-(\d{8,})\.json$")


class AdmissionState(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    groups_per_step: int
    max_staleness: int
    total_groups: int
    num_admitted: int


class LauncherCheckpoint(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    format: int
    steps_trained: int
    admission: AdmissionState
    next_group: int
    open_tasks: list[PromptTask]
    requeued: list[int]
    in_flight: dict[str, list[int]]
    ledger: LedgerSnapshot
    # The task's `fingerprint()` (the dataset task: its rows, their order and the shuffle seed),
    # checked on resume: a changed dataset would make the saved position mean other prompts.
    task_fingerprint: str = ""
    selection: SelectionState | None = None


def checkpoint_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def checkpoint_due(step: int, version: int, *, total_steps: int, every: int) -> bool:
    """Whether the launcher saves its half after StepDone(step) (the learner has saved its own
    for `version` before sending it): every `every` versions (0: never), and after the last step."""
    return step + 1 >= total_steps or bool(every and version % every == 0)


def snapshot(
    admission: Admission | CreditAdmission,
    book: TaskBook,
    *,
    task_fingerprint: str = "",
    selection: SelectionState | None = None,
) -> LauncherCheckpoint:
    """The launcher state as one value (pure)."""
    ledger = msgspec.msgpack.decode(book.ledger.to_bytes(), type=LedgerSnapshot)
    waiting = set(book.requeued)
    in_flight: dict[str, list[int]] = {}
    for task in ledger.tasks:
        if task.state == TaskState.IN_FLIGHT and task.task_id not in waiting:
            in_flight.setdefault(task.generator_id, []).append(task.task_id)
    return LauncherCheckpoint(
        format=FORMAT,
        steps_trained=book.num_steps_trained,
        admission=AdmissionState(
            groups_per_step=admission.groups_per_step,
            max_staleness=admission.max_staleness,
            total_groups=admission.total_groups,
            num_admitted=admission.num_admitted,
        ),
        next_group=admission.num_admitted,
        open_tasks=[book.open[t] for t in sorted(book.open)],
        requeued=list(book.requeued),
        in_flight={g: sorted(ids) for g, ids in sorted(in_flight.items())},
        ledger=ledger,
        task_fingerprint=task_fingerprint,
        selection=selection,
    )


def save_launcher_checkpoint(
    run_dir: Path,
    admission: Admission | CreditAdmission,
    book: TaskBook,
    *,
    task_fingerprint: str = "",
    selection: SelectionState | None = None,
) -> Path:
    """Write `launcher-{steps_trained:08d}.json` atomically; returns its path."""
    state = snapshot(admission, book, task_fingerprint=task_fingerprint, selection=selection)
    directory = checkpoint_dir(run_dir)
    directory.mkdir(parents=True, exist_ok=True)
    final = directory / f"launcher-{state.steps_trained:08d}.json"
    tmp = directory / f".tmp-{final.name}-{os.getpid()}"
    data = msgspec.json.format(msgspec.json.encode(state), indent=1) + b"\n"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, final)
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # the rename itself survives a power cut
    finally:
        os.close(dir_fd)
    return final


def read_launcher_checkpoint(run_dir: Path, version: int) -> dict:
    """The launcher checkpoint of `version`, decoded JSON as written (a resume reads it back)."""
    return msgspec.json.decode((checkpoint_dir(run_dir) / f"launcher-{version:08d}.json").read_bytes())


def latest_launcher_checkpoint(run_dir: Path) -> Path | None:
    """The checkpoint with the most steps trained, or None (temporary files are ignored)."""
    directory = checkpoint_dir(run_dir)
    if not directory.is_dir():
        return None
    found = [(int(m.group(1)), p) for p in directory.iterdir() if (m := _NAME_RE.match(p.name))]
    return max(found)[1] if found else None


def load_launcher_checkpoint(
    path: Path, *, groups_per_step: int, samples_per_group: int, max_staleness: int, total_steps: int
) -> tuple[Admission, TaskBook]:
    """Rebuild admission and the task book from a checkpoint written for the same job shape.

    Tasks that were in flight are re-queued (their generators are gone), after the ones already
    waiting; raises ValueError naming the field when the file or the job shape does not match.
    """
    try:
        state = msgspec.json.decode(Path(path).read_bytes(), type=LauncherCheckpoint)
    except (OSError, msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ValueError(f"launcher checkpoint {path} cannot be read: {exc}") from None
    if state.format != FORMAT:
        raise ValueError(f"launcher checkpoint {path} has format {state.format}; this asyncrl reads {FORMAT}")
    expected = {
        "learner.groups_per_step": (state.admission.groups_per_step, groups_per_step),
        "staleness.max_staleness": (state.admission.max_staleness, max_staleness),
        "learner.steps": (state.admission.total_groups, groups_per_step * total_steps),
    }
    for key, (saved, now) in expected.items():
        if saved != now:
            raise ValueError(
                f"launcher checkpoint {path} was written with a different {key} "
                f"(it implies {saved}, the config now {now}); resume with the run's own config"
            )
    if state.next_group != state.admission.num_admitted:
        raise ValueError(f"launcher checkpoint {path}: next_group != admission.num_admitted (corrupt)")
    admission = Admission(
        groups_per_step=groups_per_step, max_staleness=max_staleness, total_steps=total_steps
    )
    admission.num_admitted = state.admission.num_admitted
    book = TaskBook(groups_per_step=groups_per_step, samples_per_group=samples_per_group)
    book.ledger = Ledger.from_bytes(msgspec.msgpack.encode(state.ledger))
    book.num_steps_trained = state.steps_trained
    book.open = {t.task_id: t for t in state.open_tasks}
    unknown = [
        t
        for t in [*state.requeued, *(i for ids in state.in_flight.values() for i in ids)]
        if t not in book.open
    ]
    if unknown:
        raise ValueError(f"launcher checkpoint {path}: tasks {unknown} are queued but not open (corrupt)")
    book.requeued.extend(state.requeued)
    for generator_id in sorted(state.in_flight):
        book.generator_failed(generator_id)
    return admission, book
