"""Prompt selection: uniform is today's stream (group j samples prompt j); the dispatcher admits
the prompts a selector chooses without changing group ids, windows or assignment."""

from __future__ import annotations

from collections.abc import Sequence

import msgspec
import pytest

from asyncrl.messages import PromptTask, SamplingParams
from asyncrl.scheduler.dispatch import Dispatcher
from asyncrl.scheduler.modes import WindowMode
from asyncrl.scheduler.selection import Selector, UniformSelector
from asyncrl.scheduler.tasks import TaskBook
from asyncrl.tasks.base import Problem

B, N, K, STEPS = 2, 3, 1, 10
SAMPLING = SamplingParams(max_new_tokens=4)


class IndexTask:
    """Prompt i is "i?" with answer "i" and extras {"i": i}; rendered as [i, 7]."""

    eval_problems: Sequence[Problem] = ()

    def train_problem(self, index: int) -> Problem:
        return Problem(index=index, prompt=f"{index}?", answer=str(index), extras={"i": index})

    def render(self, problems: Sequence[Problem], tokenizer) -> list[list[int]]:
        return [[p.index, 7] for p in problems]

    def score(self, prompt: str, completion: str, answer: str) -> float:
        return float(completion == answer)


class ShiftSelector:
    """Group j samples stream index j + 100."""

    def select(self, groups: Sequence[int]) -> list[int]:
        return [j + 100 for j in groups]


def dispatcher(selector: Selector | None = None, *, room: int = 0) -> Dispatcher:
    return Dispatcher(
        book=TaskBook(groups_per_step=B, samples_per_group=N),
        mode=WindowMode(groups_per_step=B, max_staleness=K, total_steps=STEPS),
        task=IndexTask(),
        sampling=SAMPLING,
        max_staleness=K,
        room=room,
        selector=selector,
    )


def test_uniform_selects_each_group_its_own_index_in_order():
    assert isinstance(UniformSelector(), Selector)
    groups = [4, 2, 9]
    selected = UniformSelector().select(groups)
    assert selected == [4, 2, 9] and selected is not groups


def expected_task(j: int, window: int) -> PromptTask:
    """The PromptTask the dispatcher admitted for group j before selection existed."""
    return PromptTask(
        task_id=j,
        group_id=j,
        prompt_ids=[j, 7],
        num_samples=N,
        sampling=SAMPLING,
        dataset_index=j,
        window=window,
        answer=str(j),
        extras={"i": j},
        privileged_ids=[],
    )


@pytest.mark.parametrize("selector", [None, UniformSelector()], ids=["default", "uniform"])
def test_uniform_dispatches_todays_prompt_tasks_bitwise(selector):
    d = dispatcher(selector)
    plans = [d.plan(loaded_version=v, serving=["a", "b"]) for v in range(3)]
    sent = [t for plan in plans for peer in ("a", "b") for t in plan.by_peer.get(peer, [])]
    got = sorted(sent, key=lambda t: t.task_id)
    # Bound K = 1: version 0 admits steps 0-1, versions 1 and 2 one step more each: groups 0..7.
    assert [t.task_id for t in got] == list(range(8))
    encode = msgspec.msgpack.encode
    assert [encode(t) for t in got] == [encode(expected_task(j, window=j // B)) for j in range(8)]


def test_a_selector_chooses_the_prompt_and_nothing_else():
    shifted, uniform = dispatcher(ShiftSelector()), dispatcher()
    plan = shifted.plan(loaded_version=0, serving=["a", "b"])
    base = uniform.plan(loaded_version=0, serving=["a", "b"])
    for peer in ("a", "b"):
        for task, same in zip(plan.by_peer[peer], base.by_peer[peer], strict=True):
            j = task.task_id
            assert (task.task_id, task.group_id, task.window) == (same.task_id, same.group_id, same.window)
            assert (task.dataset_index, task.prompt_ids, task.answer) == (j + 100, [j + 100, 7], str(j + 100))
    assert plan.num_admitted == base.num_admitted == 4


def test_a_prompt_too_long_is_named_by_its_stream_index():
    d = dispatcher(ShiftSelector(), room=1)
    with pytest.raises(ValueError, match="training problem 100: its prompt is 2 tokens"):
        d.plan(loaded_version=0, serving=["a"])
