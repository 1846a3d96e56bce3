"""Prompt selection: uniform is today's stream (group j samples prompt j); the dispatcher admits
the prompts a selector chooses without changing group ids, windows or assignment."""

from __future__ import annotations

from collections.abc import Sequence

import msgspec
import pytest

from asyncrl.config_load import load_config
from asyncrl.config_sections import ConfigError
from asyncrl.messages import PromptTask, SamplingParams, TaskDone
from asyncrl.scheduler.dispatch import Dispatcher
from asyncrl.scheduler.modes import WindowMode
from asyncrl.scheduler.prompt_stats import PromptRecord, PromptStats, prompt_key
from asyncrl.scheduler.selection import Selection, Selector, UniformSelector, make_selection
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


# -- adaptive strategies (sampling.selection) ------------------------------------------------------

M = 6  # training prompts of SetTask


class SetTask(IndexTask):
    """A finite training set: stream index i is prompt "q{i % M}" (no shuffle)."""

    num_train = M

    def train_problem(self, index: int) -> Problem:
        row = index % M
        return Problem(index=index, prompt=f"q{row}", answer=str(row), extras={"i": row})


def key(row: int) -> str:
    return prompt_key(SetTask().train_problem(row))


def make(strategy: str, *sets: str) -> Selection:
    config = load_config(overrides=[f"sampling.selection={strategy}", "task.kind=dataset", *sets])
    return make_selection(config, SetTask())


def record(stats: PromptStats, row: int, successes: float, failures: float, *, groups: int = 1) -> None:
    stats.records[key(row)] = PromptRecord(successes=successes, failures=failures, groups=groups, index=row)


def test_skip_passes_over_solved_and_hopeless_prompts_and_rechecks_them():
    selection = make("skip", "sampling.selection_recheck=2")
    record(selection.stats, 1, 8, 0)  # mean 0.9: solved
    record(selection.stats, 4, 0, 8)  # mean 0.1: hopeless
    record(selection.stats, 2, 4, 4)  # 0.5: kept
    picked = selection.selector.select(range(16))
    rows = [i % M for i in picked]
    # Prompts 1 and 4 are passed over twice (epochs 0 and 1), then re-checked in epoch 2.
    assert rows == [0, 2, 3, 5, 0, 2, 3, 5, 0, 1, 2, 3, 4, 5, 0, 2]
    assert picked[:4] == [0, 2, 3, 5] and picked[8:10] == [12, 13]  # stream indices, in order


def test_priority_follows_the_learning_signal_passes_over_prompts_in_flight_and_is_seeded():
    selection = make("priority", "run.seed=3")
    for row in range(M):
        record(selection.stats, row, 200, 1)  # all solved: p (1 - p) near 0
    record(selection.stats, 3, 50, 50)  # p near 0.5: the largest signal by far
    again = make("priority", "run.seed=3")
    again.stats.records = dict(selection.stats.records)
    first = make("priority", "run.seed=3")
    first.stats.records = dict(selection.stats.records)
    picks = first.selector.select(range(M))
    assert picks[0] == 3 and sorted(picks) == list(range(M))  # distinct while prompts are free
    assert again.selector.select(range(M)) == picks  # the same seed, the same draws
    other = make("priority", "run.seed=4")
    other.stats.records = dict(selection.stats.records)
    assert other.selector.select(range(M))[0] == 3
    first.stats.admitted(99, 3, key(3), 0)  # prompt 3 in flight: the next group gets another
    assert first.selector.select([6])[0] != 3


def test_curriculum_is_easiest_unsolved_first_then_solved_with_ties_by_groups_and_index():
    selection = make("curriculum")
    record(selection.stats, 0, 3, 1)  # 4/6 = 0.667
    record(selection.stats, 2, 9, 0)  # 10/11: solved, last
    record(selection.stats, 3, 1, 3)  # 2/6 = 0.333
    record(selection.stats, 5, 1, 1, groups=2)  # 0.5, but sampled twice: after the unseen 0.5s
    assert selection.selector.select(range(M)) == [0, 1, 4, 5, 3, 2]
    selection.stats.admitted(50, 0, key(0), 0)  # prompt 0 in flight: passed over
    assert selection.selector.select(range(2)) == [1, 4]


def test_replay_re_admits_the_most_uncertain_prompt_at_its_share():
    selection = make("replay", "sampling.selection_replay_fraction=0.5")
    record(selection.stats, 4, 4, 4)  # Beta(5, 5): std 0.15, uncertain
    record(selection.stats, 5, 20, 0)  # Beta(21, 1): std 0.04, settled
    # Every second group replays: prompt 4 once; then it is taken in this admission, so the later
    # replay turns fall back to the stream (which reaches prompt 4 in its own order: never skipped).
    assert selection.selector.select(range(6)) == [0, 4, 1, 2, 3, 4]
    assert selection.selector.state() == {"cursor": 5, "count": 6}


def finish(d: Dispatcher, tasks: list[PromptTask], v: int) -> dict[int, int]:
    """Every task finishes, with rewards that depend on its prompt and the version; group -> index."""
    for task in tasks:
        total = float((task.dataset_index * 7 + v) % (N + 1))  # 0..N successes
        done = TaskDone(
            task_id=task.task_id,
            generator_id="a",
            num_trajectories=N,
            num_tokens=0,
            generate_s=0.0,
            mean_reward=total / N,
        )
        d.done(task.task_id, "a", result=done)
    return {task.group_id: task.dataset_index for task in tasks}


def drive(selection: Selection, versions: range, d: Dispatcher | None = None) -> tuple[Dispatcher, dict]:
    """Plan `versions` in order (sync: bound 0); after each, every task sent finishes and the
    window's groups are trained. Returns the dispatcher and group -> index."""
    d = d or Dispatcher(
        book=TaskBook(groups_per_step=B, samples_per_group=N),
        mode=WindowMode(groups_per_step=B, max_staleness=0, total_steps=STEPS),
        task=SetTask(),
        sampling=SAMPLING,
        max_staleness=0,
        selection=selection,
    )
    chosen: dict[int, int] = {}
    for v in versions:
        chosen |= finish(d, d.plan(loaded_version=v, serving=["a"]).by_peer.get("a", []), v)
        selection.trained(range(v * B, (v + 1) * B))
    return d, chosen


@pytest.mark.parametrize("strategy", ["uniform", "skip", "priority", "curriculum", "replay"])
def test_a_resumed_run_selects_what_the_uninterrupted_one_does_record_included(strategy):
    whole = make(strategy)
    _, whole_chosen = drive(whole, range(STEPS))

    first = make(strategy)
    d, chosen = drive(first, range(4))
    # The checkpoint after step 3: step 4's groups admitted and finished, not trained (sync mode:
    # the next step's TaskDones can come before the StepDone). A resume admits them again.
    finish(d, d.plan(loaded_version=4, serving=["a"]).by_peer["a"], 4)
    saved = {
        "admission": {"num_admitted": d.mode.admission.num_admitted},
        "selection": msgspec.json.decode(msgspec.json.encode(first.state())),
    }
    resumed = make(strategy)
    resumed.restore(saved["selection"], where="test")
    d2 = Dispatcher(
        book=TaskBook(groups_per_step=B, samples_per_group=N),
        mode=WindowMode(groups_per_step=B, max_staleness=0, total_steps=STEPS, resume_version=4),
        task=SetTask(),
        sampling=SAMPLING,
        max_staleness=0,
        selection=resumed,
    )
    readmitted = d2.readmit(saved, resume_version=4)
    assert [t.dataset_index for t in readmitted] == [whole_chosen[j] for j in (8, 9)]
    _, rest = drive(resumed, range(4, STEPS), d2)
    assert {**chosen, **rest} == whole_chosen
    assert resumed.stats.records == whole.stats.records
    assert msgspec.json.encode(resumed.state()) == msgspec.json.encode(whole.state())


def test_a_checkpoint_of_another_strategy_is_refused_naming_both():
    saved = msgspec.json.decode(msgspec.json.encode(make("skip").state()))
    with pytest.raises(
        ValueError, match="written with sampling.selection = 'skip', the config now says 'priority'"
    ):
        make("priority").restore(saved, where="the checkpoint")


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        (
            ["sampling.selection_recheck=3"],
            "sampling.selection_recheck applies with sampling.selection = 'skip'",
        ),
        (
            ["sampling.selection=replay", "sampling.selection_solved=0.8"],
            "selection_solved applies with sampling.selection = 'skip' or 'curriculum', and it is 'replay'",
        ),
        (
            ["sampling.selection=skip", "sampling.selection_hopeless=0.95"],
            "selection_hopeless = 0.95 must be below sampling.selection_solved = 0.9",
        ),
        (["sampling.selection=priority"], "the addition task's stream is unbounded"),
        (["sampling.selection=random"], "sampling.selection"),
    ],
)
def test_bad_selection_settings_are_refused_at_load(sets, message):
    with pytest.raises(ConfigError, match=message):
        load_config(overrides=sets)


def test_a_plugin_task_without_a_training_set_is_refused_for_priority():
    config = load_config(overrides=["sampling.selection=curriculum", "task.kind=dataset"])
    with pytest.raises(ValueError, match="chooses among a finite training set, and task 'dataset' has none"):
        make_selection(config, IndexTask())
