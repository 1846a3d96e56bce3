"""sampling.selection = "domain_gap": each group's domain drawn by the domains' latest measured
distillation gap (with a floor, uniform before every domain is measured), then the domain's next
prompt in stream order; seeded, and its state survives a checkpoint."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import msgspec
import numpy as np
import pytest

from asyncrl.config_load import load_config
from asyncrl.config_sections import ConfigError
from asyncrl.messages import GeneratorMetrics, SamplingParams, TaskDone
from asyncrl.scheduler.dispatch import Dispatcher
from asyncrl.scheduler.modes import WindowMode
from asyncrl.scheduler.selection import DomainGapSelector, Selection, domain_weights, make_selection
from asyncrl.scheduler.tasks import TaskBook
from asyncrl.tasks.base import Problem

DOMAIN_GAP = [
    "sampling.selection=domain_gap",
    "task.kind=dataset",
    "opd.enabled=true",
    'task.dataset.extra_fields=["domain"]',
]
M = 9  # training prompts; row r's domain is ROW_DOMAINS[r]: runs of one domain, unevenly
ROW_DOMAINS = "aabbbcacc"


class DomainTask:
    """Stream index i is row i % M (every epoch the same order)."""

    num_train = M
    eval_problems: Sequence[Problem] = ()

    def train_problem(self, index: int) -> Problem:
        row = index % M
        return Problem(index=index, prompt=f"q{row}", answer=str(row), extras={"domain": ROW_DOMAINS[row]})

    def render(self, problems: Sequence[Problem], tokenizer) -> list[list[int]]:
        return [[p.index, 7] for p in problems]


def domain_of(index: int) -> str:
    return DomainTask().train_problem(index).extras["domain"]


def make(*sets: str) -> Selection:
    return make_selection(load_config(overrides=[*DOMAIN_GAP, *sets]), DomainTask())


def gaps(**kl: float) -> dict[str, float]:
    """A generator record's values: each domain's gap measured on 10 tokens."""
    out = {}
    for d, value in kl.items():
        out[f"opd/kl/domain/{d}"] = value
        out[f"opd/kl_tokens/domain/{d}"] = 10.0
    return out


def test_the_weights_are_the_floor_plus_the_clipped_gap_share_by_hand():
    # floor 0.2 over 3 domains: 0.2 / 3 each; the rest 0.8 by gap share 0.3 : 0.1 : 0 (c clipped).
    w = domain_weights(["a", "b", "c"], {"a": 0.3, "b": 0.1, "c": -0.5}, 0.2)
    np.testing.assert_allclose(w, [0.2 / 3 + 0.8 * 0.75, 0.2 / 3 + 0.8 * 0.25, 0.2 / 3], rtol=0, atol=1e-15)
    assert w.sum() == pytest.approx(1.0)


def test_a_domain_without_gap_keeps_the_floor_and_floor_one_is_uniform():
    w = domain_weights(["a", "b"], {"a": 2.0, "b": 0.0}, 0.1)
    assert w.tolist() == pytest.approx([0.95, 0.05])  # b: 0.1 / 2, never starved
    assert domain_weights(["a", "b"], {"a": 2.0, "b": 0.0}, 1.0).tolist() == [0.5, 0.5]


@pytest.mark.parametrize("measured", [{}, {"a": 0.4, "b": 0.2}, {"a": 0.0, "b": -0.1, "c": 0.0}])
def test_uniform_until_every_domain_has_a_measurement_or_while_no_gap_is_positive(measured):
    assert domain_weights(["a", "b", "c"], measured, 0.2).tolist() == pytest.approx([1 / 3] * 3)


def test_the_drawn_domain_frequencies_follow_the_weights_and_the_seed():
    sel = DomainGapSelector(domain_of, ["a", "b", "c"], floor=0.2, seed=5)
    sel.observe(gaps(a=0.3, b=0.1, c=0.0))
    draws = 6000
    counts = Counter(domain_of(i) for i in sel.select(range(draws)))
    expected = domain_weights(["a", "b", "c"], sel.gaps, 0.2)
    freq = np.array([counts[d] / draws for d in "abc"])
    # each frequency within 4 binomial standard deviations (at most 0.0061 here) of its weight
    assert np.all(np.abs(freq - expected) < 4 * np.sqrt(expected * (1 - expected) / draws)), (freq, expected)
    assert sel.chosen == {d: counts[d] for d in "abc"}

    def first(seed: int) -> list[int]:
        other = DomainGapSelector(domain_of, ["a", "b", "c"], floor=0.2, seed=seed)
        other.observe(gaps(a=0.3, b=0.1, c=0.0))
        return other.select(range(40))

    assert first(5) == first(5) != first(6)


def test_each_domain_takes_its_next_prompt_in_stream_order():
    sel = make()
    chosen = sel.choose(range(60))
    for d in "abc":
        mine = [i for i in chosen if domain_of(i) == d]
        # the domain's prompts exactly as the stream orders them, none skipped, none repeated
        assert mine == [i for i in range(max(mine) + 1) if domain_of(i) == d]
    assert len(set(chosen)) == 60


def test_a_generator_record_feeds_the_gaps_latest_measured_wins():
    sel = make()
    required = {f.name: 0 for f in msgspec.structs.fields(GeneratorMetrics) if f.required}
    opd = {**gaps(a=0.5, b=0.25), "opd/kl/domain/z": 9.0, "opd/kl_tokens/domain/z": 3.0}
    record = GeneratorMetrics(**required, opd=opd)
    sel.observe_metrics(record.values())
    assert sel.selector.gaps == {"a": 0.5, "b": 0.25}  # z is not a training domain
    sel.observe_metrics(gaps(a=0.125))
    sel.observe_metrics({"opd/kl/domain/b": 7.0, "opd/kl_tokens/domain/b": 0.0})  # no tokens: no measurement
    assert sel.selector.gaps == {"a": 0.125, "b": 0.25}
    fields = sel.step_fields()
    assert fields["selection"] == "domain_gap" and fields["domain_gap"] == {"a": 0.125, "b": 0.25}
    assert fields["domain_weights"] == {"a": 1 / 3, "b": 1 / 3, "c": 1 / 3}  # c not measured yet


B, N, STEPS = 2, 2, 8


def sync_dispatcher(selection: Selection, resume_version: int = 0) -> Dispatcher:
    mode = WindowMode(groups_per_step=B, max_staleness=0, total_steps=STEPS, resume_version=resume_version)
    book = TaskBook(groups_per_step=B, samples_per_group=N)
    sampling = SamplingParams(max_new_tokens=4)
    return Dispatcher(
        book=book, mode=mode, task=DomainTask(), sampling=sampling, max_staleness=0, selection=selection
    )


def drive(selection: Selection, versions: range, d: Dispatcher | None = None) -> tuple[Dispatcher, dict]:
    """Sync: plan each version, finish its tasks, feed a gap record, train the window."""
    d = d or sync_dispatcher(selection)
    chosen: dict[int, int] = {}
    for v in versions:
        for task in d.plan(loaded_version=v, serving=["g"]).by_peer.get("g", []):
            done = TaskDone(
                task_id=task.task_id,
                generator_id="g",
                num_trajectories=N,
                num_tokens=0,
                generate_s=0.0,
                mean_reward=0.5,
            )
            d.done(task.task_id, "g", result=done)
            chosen[task.group_id] = task.dataset_index
        selection.observe_metrics(gaps(a=0.1 * v, b=0.05, c=1.0 / (v + 1)))
        selection.trained(range(v * B, (v + 1) * B))
    return d, chosen


def test_a_resumed_run_draws_what_the_uninterrupted_one_does_gaps_included():
    whole = make()
    _, whole_chosen = drive(whole, range(STEPS))

    first = make()
    d, chosen = drive(first, range(4))
    saved = {
        "admission": {"num_admitted": d.mode.admission.num_admitted},
        "selection": msgspec.json.decode(msgspec.json.encode(first.state())),
    }
    assert saved["selection"]["selector"]["gaps"] == {"a": 0.30000000000000004, "b": 0.05, "c": 0.25}
    resumed = make()
    resumed.restore(saved["selection"], where="test")
    assert resumed.selector.gaps == first.selector.gaps and resumed.selector.cursors == first.selector.cursors
    d2 = sync_dispatcher(resumed, resume_version=4)
    d2.readmit(saved, resume_version=4)
    _, rest = drive(resumed, range(4, STEPS), d2)
    assert {**chosen, **rest} == whole_chosen
    assert msgspec.json.encode(resumed.state()) == msgspec.json.encode(whole.state())


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        (
            ["sampling.selection=domain_gap", "task.kind=dataset"],
            "needs opd.enabled = true and opd.route_field",
        ),
        (
            ["sampling.selection=domain_gap", "task.kind=dataset", "opd.enabled=true"],
            "use a dataset task with 'domain' in task.dataset.extra_fields",
        ),
        (["sampling.selection=domain_gap", "opd.enabled=true"], "needs prompts carrying the field"),
        (
            ["sampling.selection_domain_floor=0.5"],
            "selection_domain_floor applies with sampling.selection = 'domain_gap'",
        ),
        ([*DOMAIN_GAP, "sampling.selection_domain_floor=0"], "selection_domain_floor"),
    ],
)
def test_bad_domain_gap_settings_are_refused_at_load(sets, message):
    with pytest.raises(ConfigError, match=message):
        load_config(overrides=sets)


class NoDomainTask(DomainTask):
    def train_problem(self, index: int) -> Problem:
        problem = super().train_problem(index)
        return problem if index != 4 else Problem(index=index, prompt="q", answer="0")


def test_a_task_whose_prompt_lacks_the_field_is_refused_at_launcher_start_naming_it():
    config = load_config(overrides=DOMAIN_GAP)
    with pytest.raises(
        ValueError, match="training prompt 4 of task 'dataset' has no field opd.route_field = 'domain'"
    ):
        make_selection(config, NoDomainTask())
