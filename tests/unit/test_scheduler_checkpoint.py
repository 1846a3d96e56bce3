"""The launcher's checkpoint (scheduler/checkpoint.py): exact round trip, atomic files, and a
resume that neither skips nor repeats a prompt."""

from __future__ import annotations

import json
import os

import pytest

from asyncrl.messages import PromptTask, SamplingParams
from asyncrl.scheduler.admission import Admission
from asyncrl.scheduler.checkpoint import (
    latest_launcher_checkpoint,
    load_launcher_checkpoint,
    save_launcher_checkpoint,
    snapshot,
)
from asyncrl.scheduler.tasks import TaskBook

B, N, K, STEPS = 2, 3, 1, 6


def task(j: int) -> PromptTask:
    return PromptTask(
        task_id=j,
        group_id=j,
        prompt_ids=[j, j + 1],
        num_samples=N,
        sampling=SamplingParams(temperature=0.7),
        dataset_index=j,
        window=j // B,
        answer=str(j),
    )


def mid_run() -> tuple[Admission, TaskBook]:
    """Step 0 trained; groups 2..5 admitted: 2 done, 3 on gen-0, 4 on gen-1, 5 re-queued."""
    admission = Admission(groups_per_step=B, max_staleness=K, total_steps=STEPS)
    book = TaskBook(groups_per_step=B, samples_per_group=N)
    for j in admission.admit(loaded_version=1):
        book.admit(task(j))
    assert book.open.keys() == set(range(6))
    for j, gen in [(0, "gen-0"), (1, "gen-1"), (2, "gen-0"), (3, "gen-0"), (4, "gen-1"), (5, "gen-2")]:
        book.dispatched(j, gen)
    for j, gen in [(0, "gen-0"), (1, "gen-1"), (2, "gen-0")]:
        book.done(j, gen)
    book.trained(0)
    assert book.generator_failed("gen-2") == [5]
    return admission, book


def load(path):
    return load_launcher_checkpoint(
        path, groups_per_step=B, samples_per_group=N, max_staleness=K, total_steps=STEPS
    )


def test_round_trip_keeps_everything_and_requeues_in_flight_tasks(tmp_path):
    admission, book = mid_run()
    path = save_launcher_checkpoint(tmp_path, admission, book)
    assert path == tmp_path / "checkpoints" / "launcher-00000001.json"
    doc = json.loads(path.read_text())
    assert doc["next_group"] == 6 and doc["steps_trained"] == 1
    assert doc["requeued"] == [5] and doc["in_flight"] == {"gen-0": [3], "gen-1": [4]}
    assert [t["task_id"] for t in doc["open_tasks"]] == [3, 4, 5]

    admission2, book2 = load(path)
    assert admission2.num_admitted == 6
    assert {t: book2.open[t] for t in book2.open} == {t: task(t) for t in (3, 4, 5)}  # exact tasks
    # Re-queued first (was waiting), then the in-flight ones (their processes are gone).
    assert list(book2.requeued) == [5, 3, 4]
    before, after = book.summary(), book2.summary()
    assert after.num_samples_trained == before.num_samples_trained == B * N
    assert after.num_requeues == before.num_requeues + 2


def test_resume_neither_skips_nor_repeats_a_prompt(tmp_path):
    admission, book = mid_run()
    admission, book = load(save_launcher_checkpoint(tmp_path, admission, book))
    sent = []
    while (t := book.pop_requeued()) is not None:
        book.dispatched(t.task_id, "gen-0-new")
        sent.append(t.task_id)
    for version in range(1, STEPS):
        for j in admission.admit(loaded_version=version):
            book.admit(task(j))
            book.dispatched(j, "gen-0-new")
            sent.append(j)
    for j in sent:
        book.done(j, "gen-0-new")
    for step in range(1, STEPS):
        book.trained(step)
    trained_before = {0, 1, 2}  # done before the checkpoint
    assert sorted(sent + sorted(trained_before)) == list(range(B * STEPS))  # each prompt exactly once
    s = book.summary(at_end=True)
    assert s.num_samples_lost == 0 and s.num_duplicated == 0
    assert s.num_samples_trained == s.num_samples_expected == B * STEPS * N


def test_write_is_atomic_and_latest_is_found(tmp_path):
    admission, book = mid_run()
    first = save_launcher_checkpoint(tmp_path, admission, book)
    book.done(3, "gen-0")
    book.done(4, "gen-1")
    book.dispatched(book.pop_requeued().task_id, "gen-0")
    book.done(5, "gen-0")
    book.trained(1)
    second = save_launcher_checkpoint(tmp_path, admission, book)
    (tmp_path / "checkpoints" / ".tmp-launcher-00000009.json-1").write_text("{half")  # a crashed write
    assert latest_launcher_checkpoint(tmp_path) == second != first
    assert [p.name for p in sorted((tmp_path / "checkpoints").iterdir()) if not p.name.startswith(".")] == [
        first.name,
        second.name,
    ]
    assert latest_launcher_checkpoint(tmp_path / "nowhere") is None
    assert snapshot(*load(second)) == snapshot(admission, book)  # saved state equals live state


def test_mismatched_job_or_corrupt_file_is_a_clear_error(tmp_path):
    path = save_launcher_checkpoint(tmp_path, *mid_run())
    with pytest.raises(ValueError, match="different learner.groups_per_step"):
        load_launcher_checkpoint(path, groups_per_step=4, samples_per_group=N, max_staleness=K, total_steps=3)
    with pytest.raises(ValueError, match="different staleness.max_staleness"):
        load_launcher_checkpoint(
            path, groups_per_step=B, samples_per_group=N, max_staleness=0, total_steps=STEPS
        )
    with pytest.raises(ValueError, match="different learner.steps"):
        load_launcher_checkpoint(path, groups_per_step=B, samples_per_group=N, max_staleness=K, total_steps=9)
    path.write_text(path.read_text()[:100])
    with pytest.raises(ValueError, match="cannot be read"):
        load(path)
    doc = json.loads(save_launcher_checkpoint(tmp_path, *mid_run()).read_text())
    doc["format"] = 99
    path.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match="format 99"):
        load(path)
    assert not [p for p in os.listdir(tmp_path / "checkpoints") if p.startswith(".tmp")]
