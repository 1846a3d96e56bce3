"""The offline teacher-score cache (opd.cache, generators/teacher_cache.py): records come back
bitwise, keys change with everything that changes a score, a restarted generator (a resumed or
repeated run) reuses the stored scores without a teacher forward, and the config refuses what
cannot be cached."""

from __future__ import annotations

from typing import NamedTuple

import pytest
import torch

from asyncrl.generators.teacher_cache import (
    CachingTeacher,
    ScoreStore,
    TeacherIdentity,
    from_record,
    record_key,
    to_record,
)
from tests.conftest import set_up_generator

PROMPTS = [[1, 5, 6, 14, 7], [1, 9, 14, 11, 17]]


class TeacherScoring(NamedTuple):
    """A score record with optional fields, as a teacher with top-K returns (`opd.TeacherScoring`)."""

    logprobs: torch.Tensor
    top_ids: torch.Tensor | None = None
    top_logprobs: torch.Tensor | None = None


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory):
    from asyncrl.models.tiny import create_base

    return create_base(
        tmp_path_factory.mktemp("teacher") / "model", hidden_size=32, num_layers=1, num_heads=2, seed=1
    )


def identity(**settings) -> TeacherIdentity:
    return TeacherIdentity("model", "f" * 64, {"temperature": 1.0, "dtype": "float32", **settings})


def task(i: int, prompt: list[int], **extras):
    from asyncrl.messages import PromptTask, SamplingParams

    return PromptTask(
        task_id=i,
        group_id=10 + i,
        prompt_ids=prompt,
        num_samples=3,
        sampling=SamplingParams(temperature=0.8, top_p=1.0, max_new_tokens=5),
        dataset_index=i,
        window=0,
        answer="0",
        extras=extras,
    )


class Counting:
    """A stand-in teacher: scores = ids / 7 - 3 (float32), counting what it scored."""

    def __init__(self) -> None:
        self.scored: list[list[int]] = []

    def score(self, tasks, ids_TN):
        self.scored.append([t.task_id for t in tasks])
        return [TeacherScoring(x.to(torch.float32) / 7 - 3) for x in ids_TN], None


class Refusing:
    def score(self, tasks, ids_TN):
        raise AssertionError("the teacher was asked although every score is cached")


# ----------------------------------------------------------------------------- records and keys
@pytest.mark.parametrize(
    "score",
    [
        torch.randn(4, 3),
        TeacherScoring(torch.randn(4, 3)),
        TeacherScoring(torch.randn(4, 3), torch.randint(0, 50, (4, 5)), torch.randn(4, 5)),
        {"logprobs": torch.randn(2, 1), "extra": torch.arange(3)},
    ],
)
def test_a_record_comes_back_bitwise_as_its_type(tmp_path, score):
    store = ScoreStore(tmp_path, identity())
    store.put("ab" * 32, score, 7)
    got, version = store.get("ab" * 32)
    assert version == 7 and type(got) is type(score)
    want, _ = to_record(score)
    have, _ = to_record(got)
    assert want.keys() == have.keys()
    for k in want:
        assert want[k].dtype == have[k].dtype and torch.equal(want[k], have[k])
    assert store.get("cd" * 32) is None


def test_none_fields_stay_none():
    tensors, kind = to_record(TeacherScoring(torch.zeros(2, 1)))
    assert set(tensors) == {"logprobs"}
    back = from_record(tensors, kind)
    assert back.top_ids is None and back.top_logprobs is None


def test_the_key_changes_with_every_input():
    ids = torch.tensor([[3, 4], [5, 6]])
    base = record_key(identity().digest(), [1, 2], ids)
    assert base == record_key(identity().digest(), [1, 2], ids.clone())
    changed = [
        record_key(identity().digest(), [1, 2, 0], ids),  # context
        record_key(
            identity().digest(), [1], torch.tensor([[2, 3], [4, 5], [6, 0]])
        ),  # same bytes, other split
        record_key(identity().digest(), [1, 2], torch.tensor([[3, 4], [5, 7]])),  # an extra id
        record_key(identity().digest(), [1, 2], ids.reshape(1, 4)),  # shape
        record_key(identity(dtype="bfloat16").digest(), [1, 2], ids),  # scoring settings
        record_key(TeacherIdentity("model", "e" * 64, identity().settings).digest(), [1, 2], ids),  # weights
    ]
    assert len({base, *changed}) == len(changed) + 1


def test_settings_ignore_learner_only_keys():
    from asyncrl.config_sections import OpdConfig
    from asyncrl.generators.teacher_cache import scoring_settings

    a = scoring_settings(OpdConfig(enabled=True), dtype="float32", temperature=1.0)
    b = scoring_settings(
        OpdConfig(enabled=True, kl_weight=2.0, estimator="forward_kl", cache=True),
        dtype="float32",
        temperature=1.0,
    )
    c = scoring_settings(OpdConfig(enabled=True, num_samples=2), dtype="float32", temperature=1.0)
    assert a == b and a != c


# ----------------------------------------------------------------------------- the wrapper
def test_misses_are_scored_once_and_hits_reused(tmp_path):
    tasks = [task(0, PROMPTS[0]), task(1, PROMPTS[1]), task(2, PROMPTS[0])]
    ids = [torch.tensor([[3], [4]]), torch.tensor([[3], [4]]), torch.tensor([[3], [4]])]
    inner = Counting()
    cached = CachingTeacher(inner, ScoreStore(tmp_path, identity()), context=lambda t: t.prompt_ids)
    first, _ = cached.score(tasks, ids)
    assert inner.scored == [[0, 1]]  # task 2 has task 0's key: scored once
    c = cached.counters
    assert (c.misses, c.hits, c.miss_tokens, c.hit_tokens, c.teacher_calls) == (2, 1, 4, 2, 1)
    # A restarted process (a resumed or repeated run): a new wrapper over the same directory.
    again = CachingTeacher(Refusing(), ScoreStore(tmp_path, identity()), context=lambda t: t.prompt_ids)
    second, _ = again.score(tasks[::-1], ids[::-1])
    for a, b in zip(first, second[::-1], strict=True):
        assert torch.equal(a.logprobs, b.logprobs)
    assert (again.counters.hits, again.counters.misses, again.counters.calls_saved) == (3, 0, 1)


def test_a_resumed_generator_reuses_the_scores_bitwise(tiny_model_dir, teacher_dir, tmp_path):
    """Two generator processes of one run (the second as after a resume or in a repeated run):
    the same samples, and the second's teacher never runs."""
    from asyncrl.config_sections import OpdConfig
    from asyncrl.generators.torch_gen import TorchGenerator

    opd = OpdConfig(enabled=True, teacher=str(teacher_dir), num_samples=3, cache=True)

    def generator():
        return set_up_generator(TorchGenerator, tiny_model_dir, run_seed=5, opd=opd, run_dir=str(tmp_path))

    batch = [task(0, PROMPTS[0]), task(1, PROMPTS[1])]
    first_gen = generator()
    first = first_gen.generate_sync(batch)
    counts = first_gen.opd_metrics()
    assert counts["teacher_cache/misses"] + counts["teacher_cache/hits"] == 6
    assert counts["teacher_cache/misses"] >= 1 and counts["teacher_cache/teacher_calls"] == 1
    second_gen = generator()
    second_gen.teacher.inner = Refusing()  # any teacher call fails now
    second = second_gen.generate_sync(batch)
    for a, b in zip(first, second, strict=True):
        assert a.opd_ids == b.opd_ids and a.teacher_logprobs == b.teacher_logprobs  # bitwise (float32 lists)
    c = second_gen.opd_metrics()
    assert (c["teacher_cache/hits"], c["teacher_cache/misses"], c["teacher_cache/teacher_calls"]) == (6, 0, 0)
    assert (tmp_path / "teacher_cache").is_dir()


# ----------------------------------------------------------------------------- config
@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"cache": True}, r"opd\.cache needs opd\.enabled"),
        ({"enabled": True, "cache_dir": "x"}, r"opd\.cache_dir applies with opd\.cache = true"),
        (
            {"enabled": True, "teacher": "self", "self_weights": "current", "cache": True},
            r"self_weights = 'initial'",
        ),
        (
            {"enabled": True, "teacher": "self", "self_weights": "ewma", "cache": True},
            r"self_weights = 'initial'",
        ),
        (
            {"enabled": True, "cache": True, "horizon": 2, "horizon_schedule": "linear"},
            r"horizon_schedule = 'linear'",
        ),
    ],
)
def test_config_refuses(fields, match):
    from asyncrl.config_sections import OpdConfig

    with pytest.raises(ValueError, match=match):
        OpdConfig(**fields)


def test_a_self_teacher_on_its_initial_weights_is_cached():
    from asyncrl.config_sections import OpdConfig

    assert OpdConfig(enabled=True, teacher="self", cache=True).cache


# ----------------------------------------------------------------------------- asyncrl opd prescore
def test_prescore_fills_the_keys_a_generator_looks_up(tiny_model_dir, teacher_dir, tmp_path):
    from transformers import AutoTokenizer

    from asyncrl.config_load import load_config
    from asyncrl.generators.prescore import prescore, reference_ids, reference_tasks
    from asyncrl.generators.teacher_routing import with_cache
    from asyncrl.tasks.base import make_task
    from tests.unit.test_teacher_routing import fresh_scores

    cfg = load_config(
        None,
        [
            f'model.path="{tiny_model_dir}"',
            "opd.enabled=true",
            f'opd.teacher="{teacher_dir}"',
            "opd.cache=true",
            f'opd.cache_dir="{tmp_path / "cache"}"',
        ],
    )
    first = prescore(cfg, tiny_model_dir, num_prompts=6)
    assert (first.prompts, first.scored + first.already_cached) == (6, 6) and first.scored >= 1
    # A generator of the run that samples the reference completion finds it (no teacher call).
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    task_ = make_task(cfg.task)
    tasks = reference_tasks(cfg, task_, tok, range(6))
    ids = [torch.tensor(reference_ids(task_.train_problem(i).solution, tok))[:, None] for i in range(6)]
    cached = with_cache(
        Refusing(),
        str(teacher_dir),
        opd=cfg.opd,
        dtype="float32",
        policy_path=str(tiny_model_dir),
        run_dir="",
    )
    scores, _ = cached.score(tasks, ids)
    for t, x, s in zip(tasks, ids, scores, strict=True):
        torch.testing.assert_close(
            getattr(s, "logprobs", s), fresh_scores(teacher_dir, t.prompt_ids, x), atol=1e-5, rtol=0
        )
    again = prescore(cfg, tiny_model_dir, num_prompts=6)
    assert (again.scored, again.already_cached) == (0, 6)


def test_prescore_refuses_extra_draws():
    from asyncrl.config_load import load_config
    from asyncrl.generators.prescore import check_prescore_config

    cfg = load_config(None, ["opd.enabled=true", "opd.cache=true", 'opd.cache_dir="x"', "opd.num_samples=2"])
    with pytest.raises(ValueError, match=r"opd\.num_samples = 2.*needs opd\.num_samples = 1"):
        check_prescore_config(cfg)
    with pytest.raises(ValueError, match=r"opd\.cache_dir = DIR"):
        check_prescore_config(load_config(None, ["opd.enabled=true"]))


def test_a_damaged_record_is_scored_again(tmp_path):
    store = ScoreStore(tmp_path, identity())
    inner = Counting()
    cached = CachingTeacher(inner, store, context=lambda t: t.prompt_ids)
    ids = [torch.tensor([[3], [4]])]
    first, _ = cached.score([task(0, PROMPTS[0])], ids)
    key = record_key(store.digest, PROMPTS[0], ids[0])
    store.path(key).write_bytes(store.path(key).read_bytes()[:20])  # truncated
    again, _ = cached.score([task(0, PROMPTS[0])], ids)
    assert inner.scored == [[0], [0]] and store.num_unreadable == 1
    assert torch.equal(first[0].logprobs, again[0].logprobs)
    assert store.get(key) is not None  # rewritten
