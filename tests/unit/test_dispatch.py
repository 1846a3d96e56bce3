"""The dispatcher without sockets or processes: re-queue first, admission, assignment, resume."""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from asyncrl.messages import GroupsLeft, SamplingParams, StepDone
from asyncrl.scheduler.checkpoint import snapshot
from asyncrl.scheduler.dispatch import INTERRUPTED_RUN, Dispatcher
from asyncrl.scheduler.modes import AdmissionMode, PoolMode, WindowMode
from asyncrl.scheduler.tasks import TaskBook
from asyncrl.tasks.base import Problem

B, N, K, STEPS = 2, 3, 1, 10


class CountingTask:
    """Prompt j is "j?"; rendering counts its calls (one per dispatch)."""

    eval_problems: Sequence[Problem] = ()

    def __init__(self) -> None:
        self.num_renders = 0

    def train_problem(self, index: int) -> Problem:
        return Problem(index=index, prompt=f"{index}?", answer=str(index))

    def render(self, problems: Sequence[Problem], tokenizer) -> list[list[int]]:
        self.num_renders += 1
        return [[p.index, 7] for p in problems]

    def score(self, prompt: str, completion: str, answer: str) -> float:
        return float(completion == answer)


def dispatcher(mode: AdmissionMode | None = None) -> Dispatcher:
    mode = mode or WindowMode(groups_per_step=B, max_staleness=K, total_steps=STEPS)
    return Dispatcher(
        book=TaskBook(groups_per_step=B, samples_per_group=N),
        mode=mode,
        task=CountingTask(),
        sampling=SamplingParams(max_new_tokens=4),
        max_staleness=K,
    )


def ids(by_peer) -> dict[str, list[int]]:
    return {peer: [t.task_id for t in tasks] for peer, tasks in by_peer.items()}


def test_admitted_groups_carry_the_task_prompt_and_are_spread_by_outstanding_count():
    d = dispatcher()
    plan = d.plan(loaded_version=0, serving=["a", "b"])
    # Bound K=1 at version 0: steps 0 and 1, 2 groups each; fewest outstanding first, ties in order.
    assert ids(plan.by_peer) == {"a": [0, 2], "b": [1, 3]} and plan.num_admitted == 4
    task = plan.by_peer["b"][1]
    assert (task.prompt_ids, task.answer, task.window, task.num_samples) == ([3, 7], "3", 1, N)
    assert d.task.num_renders == 1  # one render call per dispatch
    assert d.outstanding == {"a": 2, "b": 2}
    assert all(d.book.ledger.is_in_flight(t, "a") for t in (0, 2))
    # Nothing new until the generators load a newer version.
    assert d.plan(loaded_version=0, serving=["a", "b"]).by_peer == {}


def test_a_busier_generator_gets_fewer_new_tasks():
    d = dispatcher()
    d.outstanding["a"] = 3
    assert ids(d.plan(loaded_version=0, serving=["a", "b"]).by_peer) == {"b": [0, 1, 2], "a": [3]}


def test_requeued_tasks_go_first_and_wait_while_beyond_the_bound():
    d = dispatcher()
    d.plan(loaded_version=0, serving=["a", "b"])
    d.done(0, "a")
    assert d.generator_failed("b") == [1, 3]
    assert "b" not in d.outstanding
    plan = d.plan(loaded_version=1, serving=["a", "c"])
    # The re-queued tasks first, then the groups of step 2 (the bound moved by one version).
    assert ids(plan.by_peer) == {"c": [1, 4], "a": [3, 5]} and plan.num_admitted == 2

    # A group re-admitted on resume for step 3 waits until version 2 is loaded (bound K = 1).
    d = dispatcher()
    late = d.admit([6], loaded_version=0)
    d.book.requeued.append(late[0].task_id)
    d.mode.admission.num_admitted = 8  # the interrupted run had admitted groups 0-7
    assert d.plan(loaded_version=1, serving=["a"]).by_peer == {} and list(d.book.requeued) == [6]
    assert ids(d.plan(loaded_version=2, serving=["a"]).by_peer) == {"a": [6]}


def test_with_no_generator_serving_tasks_wait_in_the_requeue():
    d = dispatcher()
    plan = d.plan(loaded_version=0, serving=[])
    assert plan.by_peer == {} and plan.num_admitted == 4 and list(d.book.requeued) == [0, 1, 2, 3]
    assert ids(d.plan(loaded_version=0, serving=["a"]).by_peer) == {"a": [0, 1, 2, 3]}


def test_a_task_done_from_the_wrong_generator_changes_nothing():
    d = dispatcher()
    d.plan(loaded_version=0, serving=["a", "b"])
    try:
        d.done(1, "a")
    except ValueError:
        pass
    else:
        raise AssertionError("TaskDone from a generator not running the task was accepted")
    assert d.outstanding == {"a": 2, "b": 2} and 1 in d.book.open


def test_pool_tasks_carry_the_loaded_version_and_wait_for_credits():
    d = dispatcher(PoolMode(groups_per_step=B, max_staleness=K, total_steps=STEPS))
    plan = d.plan(loaded_version=0, serving=["a"])
    assert plan.num_admitted == (K + 1) * B and {t.window for t in plan.by_peer["a"]} == {0}
    assert d.plan(loaded_version=0, serving=["a"]).by_peer == {}  # no credit left
    d.mode.on_groups_left(d.book, GroupsLeft(version=1, released=[0, 1]))
    assert d.plan(loaded_version=0, serving=["a"]).by_peer == {}  # back once version 1 is loaded
    plan = d.plan(loaded_version=1, serving=["a"])
    assert [t.task_id for t in plan.by_peer["a"]] == [4, 5] and {t.window for t in plan.by_peer["a"]} == {1}


def test_resume_readmits_what_the_checkpoint_had_admitted_and_not_trained():
    before = dispatcher()
    before.plan(loaded_version=0, serving=["a"])  # groups 0-3 (steps 0 and 1)
    for t in range(B):
        before.done(t, "a")
    before.mode.on_step_done(before.book, step_done(0))
    saved = msgspec.json.decode(msgspec.json.encode(snapshot(before.mode.admission, before.book)))

    after = dispatcher(WindowMode(groups_per_step=B, max_staleness=K, total_steps=STEPS, resume_version=1))
    after.book.num_steps_trained = 1
    tasks = after.readmit(saved, resume_version=1)
    assert [t.task_id for t in tasks] == [2, 3] and [t.window for t in tasks] == [1, 1]
    assert list(after.book.requeued) == [2, 3] and not after.book.ledger.is_in_flight(2, INTERRUPTED_RUN)
    assert after.mode.admission.num_admitted == 4
    # Version 1 loaded: the re-admitted groups go first, then step 2's.
    assert ids(after.plan(loaded_version=1, serving=["a"]).by_peer) == {"a": [2, 3, 4, 5]}


def test_pool_resume_readmits_the_open_groups_on_credits():
    before = dispatcher(PoolMode(groups_per_step=B, max_staleness=K, total_steps=STEPS))
    before.plan(loaded_version=0, serving=["a"])  # groups 0-3
    for t in (0, 2):
        before.done(t, "a")
    before.mode.on_step_done(before.book, step_done(0, trained=[0, 2]))
    saved = msgspec.json.decode(msgspec.json.encode(snapshot(before.mode.admission, before.book)))

    after = dispatcher(PoolMode(groups_per_step=B, max_staleness=K, total_steps=STEPS))
    after.book.num_steps_trained = 1
    tasks = after.readmit(saved, resume_version=1)
    assert [t.task_id for t in tasks] == [1, 3]
    adm = after.mode.admission
    assert (adm.num_admitted, adm.outstanding) == (4, 2)
    # Two credits free: the re-queued groups, then two new ones.
    assert ids(after.plan(loaded_version=1, serving=["a"]).by_peer) == {"a": [1, 3, 4, 5]}


def step_done(step: int, *, trained: list[int] | None = None) -> StepDone:
    return StepDone(
        step=step,
        version=step + 1,
        num_trajectories=B * N,
        num_tokens=0,
        loss=0.0,
        mean_reward=0.0,
        max_staleness=0,
        mean_staleness=0.0,
        clip_fraction=0.0,
        grad_norm=0.0,
        step_s=0.0,
        idle_s=0.0,
        groups_trained=trained or [],
    )


def test_a_requeued_task_keeps_the_bound_it_was_admitted_under():
    """staleness.max_staleness = "auto": a task admitted under bound 0 and re-queued (its
    generator died) is sent again only within 0, also after the bound rose to 2."""
    from asyncrl.scheduler.control import ControlSettings, StalenessController

    control = StalenessController(ControlSettings(cap=3, start=0))
    mode = WindowMode(groups_per_step=B, max_staleness=3, total_steps=STEPS, control=control)
    d = dispatcher(mode)
    mode.admission.num_admitted = 2 * B  # steps 0 and 1 trained
    plan = d.plan(loaded_version=2, serving=["a"])  # bound 0 at version 2: step 2's groups
    assert ids(plan.by_peer) == {"a": [4, 5]} and d.bound_of(4) == 0
    mode.admission.max_staleness = 2  # the controller raised the bound
    assert d.generator_failed("a") == [4, 5]
    # A generator serving an older version (1): step 2 is within the new bound, not within 0.
    sent = ids(d.plan(loaded_version=1, serving=["b"]).by_peer)["b"]
    assert 4 not in sent and 5 not in sent and list(d.book.requeued) == [4, 5]
    assert ids(d.plan(loaded_version=2, serving=["b"]).by_peer)["b"][:2] == [4, 5]
