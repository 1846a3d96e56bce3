"""Context limits checked at load: a prompt plus `sampling.max_new_tokens` beyond the model's
positions is refused naming the row and the fix, or dropped and counted (task.prompt.too_long).

The models are the word-problems example's (256 positions, one token per character) and, when it
is prepared, SmolLM2-135M-Instruct (8192 positions, a BPE tokenizer).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from asyncrl.config_load import load_config
from asyncrl.job import load_task
from asyncrl.models.hf import context_length, prompt_room
from asyncrl.scheduler.dispatch import Dispatcher
from tests.support.real_model import real_model_dir

WORD_PROBLEMS = Path(__file__).resolve().parents[2] / "examples" / "word_problems"
MODEL = WORD_PROBLEMS / "model"


def _job(tmp_path: Path, rows: list[dict], model: Path, *sets: str):
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return load_config(
        None,
        [
            f"model.path={model}",
            "task.kind=dataset",
            f"task.dataset.path={data}",
            "task.num_eval=0",
            "task.prompt.template=chat",
            "learner.groups_per_step=2",
            *sets,
        ],
    )


def _rows(long_prompt_words: int) -> list[dict]:
    short = [{"prompt": f"Ann has {i} cards. How many?", "answer": str(i)} for i in range(4)]
    long = {"prompt": "Ann has cards. " * long_prompt_words + "How many?", "answer": "1"}
    return [*short[:2], long, *short[2:]]


def test_the_context_is_read_from_the_model_config() -> None:
    assert context_length(MODEL) == 256
    assert prompt_room(MODEL, 36) == 220
    with pytest.raises(ValueError, match="sampling.max_new_tokens = 256 leaves no room for a prompt"):
        prompt_room(MODEL, 256)


def test_a_prompt_beyond_the_context_is_refused_naming_the_row_and_the_fix(tmp_path: Path) -> None:
    # 10,003 characters = 10,003 tokens for this model's character tokenizer, which has 256 positions.
    rows = [*_rows(0)[:2], {"prompt": "x" * 10_003, "answer": "1"}]
    config = _job(tmp_path, rows, MODEL, "sampling.max_new_tokens=36")
    with pytest.raises(ValueError) as info:
        load_task(config, MODEL)
    message = str(info.value)
    assert "line 3" in message and "over the 220 tokens the model's context leaves" in message
    assert "lower sampling.max_new_tokens" in message and "too_long = 'drop'" in message


def test_room_left_by_max_new_tokens_is_what_counts_and_drop_counts_the_row(tmp_path: Path) -> None:
    # The long prompt renders to about 130 tokens: it fits 256 positions with 36 new tokens, and not
    # with 200 (56 left), where too_long = "drop" drops exactly that row and counts it.
    rows = _rows(long_prompt_words=8)
    fits = _job(tmp_path, rows, MODEL, "sampling.max_new_tokens=36")
    _, _, stats = load_task(fits, MODEL)
    assert stats["dropped_too_long"] == 0 and stats["train_rows"] == 5
    assert 56 < stats["max_prompt_tokens"] <= 220
    tight = _job(tmp_path, rows, MODEL, "sampling.max_new_tokens=200", "task.prompt.too_long=drop")
    task, _, stats = load_task(tight, MODEL)
    assert stats["dropped_too_long"] == 1 and stats["train_rows"] == 4
    assert all("cards. Ann" not in task.train_problem(j).prompt for j in range(4))


def test_the_tighter_of_max_tokens_and_the_context_names_itself(tmp_path: Path) -> None:
    rows = _rows(long_prompt_words=8)
    config = _job(tmp_path, rows, MODEL, "sampling.max_new_tokens=36", "task.prompt.max_tokens=60")
    with pytest.raises(ValueError, match=r"over task.prompt.max_tokens = 60; raise task.prompt.max_tokens"):
        load_task(config, MODEL)


def test_admission_refuses_a_plugin_prompt_the_context_cannot_hold() -> None:
    from asyncrl.messages import SamplingParams

    dispatcher = Dispatcher.__new__(Dispatcher)
    dispatcher.room = 100
    dispatcher.sampling = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=156, ignore_eos=False)
    dispatcher.check_room(7, [0] * 100, [])
    with pytest.raises(ValueError, match=r"training problem 7: its prompt is 101 tokens, over the 100"):
        dispatcher.check_room(7, [0] * 101, [])
    with pytest.raises(ValueError, match=r"its privileged prompt \(opd.teacher = 'self'\) is 140 tokens"):
        dispatcher.check_room(7, [0] * 10, [0] * 140)


def test_the_real_model_context_bounds_its_prompts(tmp_path: Path) -> None:
    model = real_model_dir()
    assert context_length(model) == 8192
    rows = [*_rows(0)[:2], {"prompt": "Ann has cards. " * 2000, "answer": "1"}]
    config = _job(tmp_path, rows, model, "sampling.max_new_tokens=256")
    with pytest.raises(ValueError, match=r"line 3: the prompt renders to \d+ tokens, over the 7936 tokens"):
        load_task(config, model)
    dropped = _job(tmp_path, rows, model, "sampling.max_new_tokens=256", "task.prompt.too_long=drop")
    _, _, stats = load_task(dropped, model)
    assert stats["dropped_too_long"] == 1 and stats["train_rows"] == 2
