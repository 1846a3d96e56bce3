"""Hedged stragglers (scheduler/hedge.py, issue #36): which tasks get a second copy, and what each
TaskDone means once one has two; with the real TaskBook and Dispatcher bookkeeping."""

from __future__ import annotations

from asyncrl.scheduler.hedge import MIN_DONE, HedgeBook
from asyncrl.scheduler.tasks import TaskBook


def _warm(book: HedgeBook, *, each_s: float = 1.0) -> None:
    """MIN_DONE tasks (ids 100+) done in `each_s` each."""
    for i in range(MIN_DONE):
        book.dispatched(100 + i, "gen-1", 0.0)
        book.done(100 + i, "gen-1", each_s)


def test_nothing_is_hedged_off_before_enough_tasks_or_within_the_factor():
    off = HedgeBook(factor=0, min_s=0)
    _warm(off)
    off.dispatched(1, "gen-0", 0.0)
    assert off.due(100.0, {"gen-0": 1, "gen-1": 0}) == []
    book = HedgeBook(factor=4, min_s=0.5)
    book.dispatched(1, "gen-0", 0.0)
    assert book.due(100.0, {"gen-0": 1, "gen-1": 0}) == []  # no median yet
    _warm(book)
    book.dispatched(2, "gen-0", 10.0)
    assert book.due(14.0, {"gen-0": 2, "gen-1": 0}) == [(1, "gen-0", "gen-1")]  # 2 is within 4 x 1 s
    assert book.due(14.5, {"gen-0": 2, "gen-1": 0}) == [(2, "gen-0", "gen-1")]  # 1 is hedged already
    assert book.due(100.0, {"gen-0": 2}) == []  # nobody else serves


def test_the_least_loaded_other_generator_gets_the_copy():
    book = HedgeBook(factor=2, min_s=0)
    _warm(book)
    book.dispatched(1, "gen-0", 0.0)
    book.dispatched(2, "gen-0", 0.0)
    serving = {"gen-0": 2, "gen-1": 3, "gen-2": 0}
    assert book.due(10.0, serving) == [(1, "gen-0", "gen-2"), (2, "gen-0", "gen-2")]
    assert serving["gen-2"] == 2


def test_the_first_copy_done_closes_the_task_once_and_the_other_is_wasted():
    tasks = TaskBook(groups_per_step=1, samples_per_group=2)
    from asyncrl.messages import PromptTask, SamplingParams

    tasks.admit(
        PromptTask(
            task_id=0,
            group_id=0,
            prompt_ids=[1],
            num_samples=2,
            sampling=SamplingParams(),
            dataset_index=0,
            window=0,
            answer="",
        )
    )
    tasks.dispatched(0, "gen-0")
    book = HedgeBook(factor=2, min_s=0)
    _warm(book)
    book.dispatched(0, "gen-0", 0.0)
    assert book.due(5.0, {"gen-0": 1, "gen-1": 0}) == [(0, "gen-0", "gen-1")]
    # The hedge finishes first: it closes the task in the ledger; gen-0's copy is wasted.
    assert book.copy_of(0, "gen-1") == "hedge"
    tasks.done(0, "gen-1", hedge=True)
    assert book.done(0, "gen-1", 6.0) == "gen-0"
    assert book.copy_of(0, "gen-0") == "wasted"
    book.wasted_done(0, "gen-0", 2)
    assert book.copy_of(0, "gen-0") == ""
    tasks.trained(0)
    summary = tasks.summary(at_end=True)
    assert summary.num_samples_trained == 2 and summary.num_samples_lost == 0 and summary.num_duplicated == 0
    assert (book.counts.tasks_hedged, book.counts.hedges_won, book.counts.hedges_wasted) == (1, 1, 1)
    assert book.counts.samples_wasted == 2


def test_a_dead_generator_s_hedged_task_passes_to_its_hedge_instead_of_being_requeued():
    book = HedgeBook(factor=2, min_s=0)
    _warm(book)
    book.dispatched(0, "gen-0", 0.0)
    book.dispatched(1, "gen-0", 0.0)
    book.due(5.0, {"gen-0": 2, "gen-1": 0})  # both hedged on gen-1
    book.dispatched(2, "gen-1", 5.0)
    assert book.generator_failed("gen-0", [0, 1]) == {0: "gen-1", 1: "gen-1"}
    assert book.copy_of(0, "gen-1") == ""  # the only copy now: an ordinary TaskDone
    # gen-1 dies in turn: its own tasks are re-queued as usual, nothing passes anywhere.
    assert book.generator_failed("gen-1", [0, 1, 2]) == {}
