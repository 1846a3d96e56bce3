"""The launcher's task book (scheduler/tasks.py): exact re-queue after a generator dies, and the
ledger's lost / duplicated accounting from TaskDone and StepDone."""

from __future__ import annotations

import pytest

from asyncrl.messages import PromptTask, SamplingParams
from asyncrl.scheduler.tasks import TaskBook

B, N = 2, 4  # groups per step, samples per group


def task(j: int, *, num_samples: int = N) -> PromptTask:
    return PromptTask(
        task_id=j,
        group_id=j,
        prompt_ids=[1, 2, 3],
        num_samples=num_samples,
        sampling=SamplingParams(),
        dataset_index=j,
        window=j // B,
        answer="5",
    )


def book_with(num_tasks: int, generator: str = "gen-0") -> TaskBook:
    book = TaskBook(groups_per_step=B, samples_per_group=N)
    for j in range(num_tasks):
        book.admit(task(j))
        book.dispatched(j, generator)
    return book


def test_clean_run_has_nothing_lost_or_duplicated():
    book = book_with(4)
    for j in range(4):
        book.done(j, "gen-0")
    book.trained(0)
    book.trained(1)
    s = book.summary(at_end=True)
    assert (s.num_samples_expected, s.num_samples_trained) == (16, 16)
    assert (s.num_samples_lost, s.num_duplicated, s.num_requeues) == (0, 0, 0)
    assert not book.open and book.in_flight() == []


def test_dead_generator_tasks_are_requeued_exactly_once_and_redispatched():
    book = book_with(2, "gen-0")
    book.admit(task(2))
    book.dispatched(2, "gen-1")
    assert book.generator_failed("gen-0") == [0, 1]
    assert book.generator_failed("gen-0") == []  # a repeated report re-queues nothing
    assert book.in_flight() == [2]
    first, second = book.pop_requeued(), book.pop_requeued()
    assert (first.task_id, second.task_id) == (0, 1) and book.pop_requeued() is None
    assert first == task(0)  # the same task: the re-run produces the same traj_ids
    book.dispatched(0, "gen-1")
    book.dispatched(1, "gen-1")
    for j in range(3):
        book.done(j, "gen-1")
    book.trained(0)
    s = book.summary()
    assert s.num_requeues == 2 and s.num_samples_trained == 8 and s.num_samples_lost == 0


def test_taskdone_from_the_dead_generator_is_refused_after_requeue():
    book = book_with(1, "gen-0")
    book.generator_failed("gen-0")
    book.dispatched(book.pop_requeued().task_id, "gen-0-r1")
    with pytest.raises(ValueError, match="from gen-0, which was not running it"):
        book.done(0, "gen-0")
    book.done(0, "gen-0-r1")
    with pytest.raises(ValueError, match="task 0, which is not open"):
        book.done(0, "gen-0-r1")


def test_step_trained_before_the_requeued_rerun_finishes():
    """The dead generator had pushed every sample before dying: the learner trains the step while
    the task is being re-run; the re-run's TaskDone then adds nothing."""
    book = book_with(2, "gen-0")
    book.done(1, "gen-0")
    book.generator_failed("gen-0")  # task 0 was in flight
    book.dispatched(book.pop_requeued().task_id, "gen-1")
    book.trained(0)
    assert book.summary().num_samples_pending == 0
    book.done(0, "gen-1")
    s = book.summary(at_end=True)
    assert s.num_samples_trained == 8 and s.num_samples_lost == 0 and s.num_duplicated == 0


def test_samples_never_trained_count_as_lost_at_the_end():
    book = book_with(2, "gen-0")
    book.done(0, "gen-0")
    book.done(1, "gen-0")
    s = book.summary()
    assert (s.num_samples_pending, s.num_samples_lost) == (8, 0)  # live until trained
    assert book.summary(at_end=True).num_samples_lost == 8


def test_requeued_task_waiting_at_the_end_is_pending_not_lost_mid_run():
    book = book_with(1, "gen-0")
    book.generator_failed("gen-0")
    assert book.summary().num_samples_pending == N and book.summary().num_samples_lost == 0
    assert book.summary(at_end=True).num_samples_lost == N


def test_steps_must_be_reported_in_order_once():
    book = book_with(4)
    with pytest.raises(ValueError, match="StepDone for step 1, expected step 0"):
        book.trained(1)
    book.trained(0)
    with pytest.raises(ValueError, match="expected step 1"):
        book.trained(0)


def test_task_with_the_wrong_sample_count_is_refused():
    book = TaskBook(groups_per_step=B, samples_per_group=N)
    with pytest.raises(ValueError, match="learner.samples_per_group is 4"):
        book.admit(task(0, num_samples=3))


def test_pool_steps_record_first_uses_replays_and_drops():
    """Pool mode: groups trained in any order, replays counted (also after their task is
    compacted), dropped groups evicted by reason, and the rest pending, none lost."""
    book = book_with(5)
    for j in (0, 1, 2):
        book.done(j, "gen-0")
    book.trained_pool(0, trained=[2, 0], replayed=[])
    book.evicted_pool({"staleness": [1]})  # dropped, never trained
    book.trained_pool(1, trained=[3], replayed=[2])  # 3 trained before its TaskDone came
    book.done(3, "gen-0")
    s = book.summary()
    assert s.num_samples_trained == 3 * N and s.num_samples_evicted == N
    assert s.evicted_by_reason == {"staleness": N} and s.num_replays == N
    assert s.num_samples_lost == 0 and s.num_duplicated == 0
    assert s.num_samples_pending == N  # group 4: still in flight when the run ends
    with pytest.raises(ValueError, match="expected step 2"):
        book.trained_pool(3, trained=[], replayed=[])
