"""The `dataset` task (asyncrl/tasks/dataset.py): users' prompts from local files.

Every file is written by the test into tmp_path; the tokenizer is a local character tokenizer
(like asyncrl/models/tiny.py) with a small chat template, so nothing touches the network.
"""

from __future__ import annotations

import csv
import json
import string
from pathlib import Path

import pytest

from asyncrl.config_sections import DatasetConfig, PromptConfig, TaskConfig
from asyncrl.tasks.base import Problem, Task, make_task
from asyncrl.tasks.dataset import DatasetTask, dataset_task

CHAT_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)
ROWS = [{"prompt": f"q{i}: {i}+{i}=", "answer": str(2 * i), "level": i % 3} for i in range(12)]


def char_tokenizer(chat_template: str | None = CHAT_TEMPLATE):
    """A character tokenizer over printable ASCII (one token per character, no specials added)."""
    from tokenizers import Regex, Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<bos>", "<eos>", "<unk>"]
    vocab = {tok: i for i, tok in enumerate(specials + sorted(set(string.printable)))}
    core = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>", unk_token="<unk>"
    )
    tokenizer.chat_template = chat_template
    return tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return char_tokenizer()


def write(path: Path, rows: list[dict], fmt: str) -> Path:
    """`rows` as a file (or save_to_disk directory) of format `fmt`."""
    if fmt == "jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif fmt == "json":
        path.write_text(json.dumps(rows, indent=2))
    elif fmt == "csv":
        with open(path, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    elif fmt == "parquet":
        import pandas as pd

        pd.DataFrame(rows).to_parquet(path)
    elif fmt == "disk":
        import datasets

        datasets.Dataset.from_list(rows).save_to_disk(str(path))
    return path


def section(path: Path | str, prompt: PromptConfig | None = None, **options) -> TaskConfig:
    top = {k: options.pop(k) for k in ("seed", "eval_seed", "num_eval") if k in options}
    return TaskConfig(
        kind="dataset",
        dataset=DatasetConfig(path=str(path), **options),
        prompt=prompt or PromptConfig(),
        **top,
    )


def stream(task: DatasetTask, count: int) -> list[tuple]:
    return [(p.prompt, p.answer, dict(p.extras)) for p in map(task.train_problem, range(count))]


@pytest.mark.parametrize("fmt", ["jsonl", "json", "csv", "parquet", "disk"])
def test_every_format_loads_the_same_rows(tmp_path: Path, fmt: str) -> None:
    suffix = "" if fmt == "disk" else f".{fmt}"
    task = dataset_task(section(write(tmp_path / f"data{suffix}", ROWS, fmt), extra_fields=["level"]))
    reference = dataset_task(section(write(tmp_path / "ref.jsonl", ROWS, "jsonl"), extra_fields=["level"]))
    assert isinstance(task, Task) and task.num_train == len(ROWS)
    assert stream(task, 30) == stream(reference, 30)
    assert sorted(stream(task, 12)) == sorted((r["prompt"], r["answer"], {"level": r["level"]}) for r in ROWS)
    assert task.fingerprint() == reference.fingerprint()


def test_registered_and_answers_become_text(tmp_path: Path) -> None:
    import pandas as pd

    pd.DataFrame({"prompt": ["a", "b"], "answer": [42, 7]}).to_parquet(tmp_path / "ints.parquet")
    task = make_task(section(tmp_path / "ints.parquet", shuffle=False))
    assert [task.train_problem(i).answer for i in range(2)] == ["42", "7"]
    (tmp_path / "zeros.csv").write_text('prompt,answer\n"x, y",007\nz,2.50\n')
    task = dataset_task(section(tmp_path / "zeros.csv", shuffle=False))
    assert stream(task, 2) == [("x, y", "007", {}), ("z", "2.50", {})]
    # A .json file may also hold JSON lines (rows numbered by line, blank lines skipped).
    (tmp_path / "lines.json").write_text('{"prompt": "a", "answer": 1}\n\n{"prompt": "b", "answer": 2.0}\n')
    task = dataset_task(section(tmp_path / "lines.json", shuffle=False, num_eval=0))
    assert stream(task, 2) == [("a", "1", {}), ("b", "2", {})]


def test_messages_field_maps_chat_rows_and_extras(tmp_path: Path, tokenizer) -> None:
    rows = [
        {"chat": [{"role": "system", "content": "be terse"}, {"role": "user", "content": "1+1="}], "gt": "2", "id": 0},
        {"chat": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"},
                  {"role": "user", "content": "2+2="}], "gt": "4", "id": 1},
    ]  # fmt: skip
    config = section(
        write(tmp_path / "chat.jsonl", rows, "jsonl"),
        PromptConfig(template="chat", system="SYS"),
        messages_field="chat",
        answer_field="gt",
        extra_fields=["id"],
        shuffle=False,
    )
    task = dataset_task(config)
    first, second = task.train_problem(0), task.train_problem(1)
    assert (first.prompt, first.answer, dict(first.extras)) == ("1+1=", "2", {"id": 0})
    assert second.prompt == "2+2=" and [m["role"] for m in second.messages] == ["user", "assistant", "user"]
    texts = [tokenizer.decode(ids) for ids in task.render([first, second], tokenizer)]
    # The row's own system message wins; a row without one gets task.prompt.system first.
    assert texts[0] == "<system>be terse\n<user>1+1=\n<assistant>"
    assert texts[1] == "<system>SYS\n<user>hi\n<assistant>yo\n<user>2+2=\n<assistant>"


def test_chat_template_wraps_text_prompts_and_raw_renders_text(tmp_path: Path, tokenizer) -> None:
    path = write(tmp_path / "d.jsonl", ROWS[:3], "jsonl")
    chat = dataset_task(section(path, PromptConfig(template="chat", system="S"), shuffle=False))
    ids = chat.render([chat.train_problem(0)], tokenizer)[0]
    assert isinstance(ids, list) and all(type(t) is int for t in ids)
    assert tokenizer.decode(ids) == "<system>S\n<user>q0: 0+0=\n<assistant>"
    raw = dataset_task(section(path, shuffle=False))
    problems = [raw.train_problem(i) for i in range(3)]
    assert raw.render(problems, tokenizer) == tokenizer([p.prompt for p in problems])["input_ids"]


def test_chat_template_missing_is_a_clear_error(tmp_path: Path) -> None:
    task = dataset_task(section(write(tmp_path / "d.jsonl", ROWS, "jsonl"), PromptConfig(template="chat")))
    with pytest.raises(ValueError, match=r"no chat_template.*template = 'raw'"):
        task.prepare(char_tokenizer(chat_template=None))


class CountingTokenizer:
    """Wraps a tokenizer and counts the calls that render prompts."""

    def __init__(self, inner) -> None:
        self.inner, self.calls = inner, 0
        self.chat_template = inner.chat_template

    def __call__(self, texts):
        self.calls += 1
        return self.inner(texts)

    def apply_chat_template(self, *args, **kwargs):
        self.calls += 1
        return self.inner.apply_chat_template(*args, **kwargs)


@pytest.mark.parametrize("template", ["raw", "chat"])
def test_prepare_caches_so_render_is_a_lookup(tmp_path: Path, tokenizer, template: str) -> None:
    rows = [{"m": [{"role": "user", "content": r["prompt"]}], **r} for r in ROWS]
    path = write(tmp_path / "d.jsonl", rows, "jsonl")
    field = {"messages_field": "m"} if template == "chat" else {}
    task = dataset_task(section(path, PromptConfig(template=template), eval_fraction=0.25, **field))
    counting = CountingTokenizer(tokenizer)
    stats = task.prepare(counting)
    assert stats["train_rows"] == 9 and stats["eval_rows"] == 3 and stats["dropped_too_long"] == 0
    calls = counting.calls
    problems = [task.train_problem(i) for i in range(20)] + list(task.eval_problems)
    expected = task.render(problems, tokenizer)  # another tokenizer object: rendered afresh
    assert task.render(problems, counting) == expected and counting.calls == calls
    fresh = Problem(index=0, prompt="new one", answer="1", messages=({"role": "user", "content": "new one"},))
    assert task.render([fresh], counting) == task.render([fresh], tokenizer) and counting.calls == calls + 1


def test_max_tokens_error_names_the_row_and_drop_counts(tmp_path: Path, tokenizer) -> None:
    rows = [{"prompt": "short", "answer": "1"}, {"prompt": "x" * 40, "answer": "2"}] * 3
    path = write(tmp_path / "d.jsonl", rows, "jsonl")
    task = dataset_task(section(path, PromptConfig(max_tokens=10)))
    with pytest.raises(ValueError, match=r"d\.jsonl line 2: .*40 tokens.*max_tokens = 10.*too_long = 'drop'"):
        task.prepare(tokenizer)
    task = dataset_task(section(path, PromptConfig(max_tokens=10, too_long="drop")))
    assert task.num_train == 6
    stats = task.prepare(tokenizer)
    assert stats == {
        "train_rows": 3,
        "eval_rows": 0,
        "dropped_too_long": 3,
        "dropped_too_long_eval": 0,
        "max_prompt_tokens": 5,
    }
    assert task.num_train == 3 and {task.train_problem(i).prompt for i in range(9)} == {"short"}
    everything = dataset_task(section(path, PromptConfig(max_tokens=3, too_long="drop")))
    with pytest.raises(ValueError, match=r"every one of the 6 training rows.*raise task.prompt.max_tokens"):
        everything.prepare(tokenizer)


def test_shuffle_covers_each_epoch_once_in_a_seeded_order(tmp_path: Path) -> None:
    path = write(tmp_path / "d.jsonl", ROWS, "jsonl")
    task = dataset_task(section(path, seed=5))
    n = task.num_train
    epochs = [[task.train_problem(e * n + k).prompt for k in range(n)] for e in range(3)]
    for order in epochs:
        assert sorted(order) == sorted(r["prompt"] for r in ROWS)
    assert len({tuple(order) for order in epochs}) == 3
    assert task.position(2 * n + 4) == (2, 4) and task.train_problem(2 * n + 4).index == 2 * n + 4
    again = dataset_task(section(path, seed=5))
    assert [again.train_problem(i).prompt for i in reversed(range(3 * n))] == [
        p for order in epochs for p in order
    ][::-1]
    other = dataset_task(section(path, seed=6))
    assert [other.train_problem(k).prompt for k in range(n)] != epochs[0]
    assert other.fingerprint() != task.fingerprint() == again.fingerprint()
    plain = dataset_task(section(path, shuffle=False))
    assert [plain.train_problem(k).prompt for k in range(2 * n)] == [r["prompt"] for r in ROWS] * 2


def test_eval_fraction_is_seeded_disjoint_and_capped(tmp_path: Path) -> None:
    path = write(tmp_path / "d.jsonl", ROWS, "jsonl")
    task = dataset_task(section(path, eval_fraction=0.25, eval_seed=3))
    held = [p.prompt for p in task.eval_problems]
    train = {task.train_problem(i).prompt for i in range(task.num_train)}
    assert len(held) == 3 and task.num_train == 9 and not train & set(held)
    assert train | set(held) == {r["prompt"] for r in ROWS}
    assert [p.index for p in task.eval_problems] == [0, 1, 2]
    assert [
        p.prompt for p in dataset_task(section(path, eval_fraction=0.25, eval_seed=3)).eval_problems
    ] == held
    capped = dataset_task(section(path, eval_fraction=0.25, eval_seed=3, num_eval=2))
    assert [p.prompt for p in capped.eval_problems] == held[:2] and capped.num_train == 9
    none = dataset_task(section(path, eval_fraction=0.25, num_eval=0))
    assert none.eval_problems == [] and none.num_train == 9
    assert dataset_task(section(path)).eval_problems == []


def test_eval_split_and_eval_path(tmp_path: Path) -> None:
    import datasets

    splits = datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(ROWS[:8]), "test": datasets.Dataset.from_list(ROWS[8:])}
    )
    splits.save_to_disk(str(tmp_path / "dd"))
    task = dataset_task(section(tmp_path / "dd", eval_split="test", num_eval=3))
    assert task.num_train == 8 and [p.prompt for p in task.eval_problems] == [r["prompt"] for r in ROWS[8:11]]
    with pytest.raises(
        ValueError, match=r"dd has no split 'dev' \(task.dataset.split\); its splits are: train, test"
    ):
        dataset_task(section(tmp_path / "dd", split="dev"))
    with pytest.raises(ValueError, match=r"no split 'valid' \(task.dataset.eval_split\)"):
        dataset_task(section(tmp_path / "dd", eval_split="valid"))
    train = write(tmp_path / "train.jsonl", ROWS[:8], "jsonl")
    held = write(tmp_path / "held.jsonl", ROWS[8:], "jsonl")
    task = dataset_task(section(train, eval_path=str(held), num_eval=10))
    assert task.num_train == 8 and [p.prompt for p in task.eval_problems] == [r["prompt"] for r in ROWS[8:]]
    with pytest.raises(ValueError, match=r"eval_split = 'test' needs .* holds a single split"):
        dataset_task(section(train, eval_split="test"))


def expect_error(tmp_path: Path, text: str, pattern: str, name: str = "d.jsonl", **options) -> None:
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ValueError, match=pattern):
        dataset_task(section(path, **options))


def test_load_errors_name_the_file_the_row_and_the_fix(tmp_path: Path) -> None:
    good = '{"prompt": "a", "answer": "1"}\n'
    with pytest.raises(ValueError, match=r"task.dataset.path = '.*nope.jsonl': no such file"):
        dataset_task(section(tmp_path / "nope.jsonl"))
    expect_error(
        tmp_path, good + "\n" + '{"prompt": "b", "answer": }\n', r"d\.jsonl line 3 is not valid JSON"
    )
    expect_error(tmp_path, good + "[1, 2]\n", r"d\.jsonl line 2 is list .*not an object")
    expect_error(
        tmp_path, good, r"d\.jsonl has no field 'question' \(task.dataset.prompt_field\); its fields are: prompt, answer",
        prompt_field="question",
    )  # fmt: skip
    expect_error(tmp_path, good, r"no field 'topic' \(task.dataset.extra_fields\)", extra_fields=["topic"])
    expect_error(
        tmp_path, good + '{"prompt": null, "answer": "2"}\n', r"d\.jsonl line 2: the prompt 'prompt' .*null"
    )
    expect_error(
        tmp_path, good + '{"prompt": "b"}\n', r"d\.jsonl line 2: the answer 'answer' .*null or missing"
    )
    expect_error(tmp_path, good + '{"prompt": "b", "answer": " "}\n', r"line 2: the answer .* is empty")
    expect_error(
        tmp_path, good + '{"prompt": 5, "answer": "2"}\n', r"line 2: the prompt .* must be a string, got int"
    )
    expect_error(tmp_path, good + '{"prompt": "b", "answer": [1]}\n', r"line 2: the answer .* got list")
    chat = {"messages_field": "m"}
    prompt = PromptConfig(template="chat")
    for bad, why in [([], "empty"), ("hi", "str 'hi'"), ([{"role": "user"}], "message 1 has role")]:
        (tmp_path / "m.jsonl").write_text(json.dumps({"m": bad, "answer": "1"}) + "\n")
        with pytest.raises(ValueError, match=rf"line 1: 'm' \(task.dataset.messages_field\) .*{why}"):
            dataset_task(section(tmp_path / "m.jsonl", prompt, **chat))
    expect_error(tmp_path, "\n\n", r"d\.jsonl has no rows")
    expect_error(
        tmp_path,
        '[{"prompt": "a", "answer": 1},\n {"prompt": "b" "answer": 2}]',
        r"d\.json is not valid JSON .* line 2",
        name="d.json",
    )
    expect_error(
        tmp_path, '{"prompt": "a",\n "answer": 1}\n', r"d\.json holds dict .*list of rows", name="d.json"
    )
    expect_error(
        tmp_path, "prompt,answer\na,1\n,2\n", r"e\.csv row 2 \(after the header\): the prompt", name="e.csv"
    )
    expect_error(tmp_path, "prompt,answer\n", r"e\.csv has no rows", name="e.csv")
    expect_error(
        tmp_path, good, r"can't tell the format from the suffix '\.txt'.*jsonl, json, csv", name="d.txt"
    )
    expect_error(tmp_path, good, r"messages_field = 'm' .*set task.prompt.template = 'chat'", **chat)
    expect_error(tmp_path, good, r"sets eval_path and eval_fraction", eval_path="x.jsonl", eval_fraction=0.1)
    expect_error(
        tmp_path, good, r"eval_fraction = 0.5 holds out 1 of the 1 rows .*leaving none", eval_fraction=0.5
    )
    expect_error(tmp_path, good, r"split = 'test', but .*d\.jsonl holds a single split", split="test")


def test_score_is_an_exact_match_fallback(tmp_path: Path) -> None:
    task = dataset_task(section(write(tmp_path / "d.jsonl", ROWS, "jsonl")))
    assert task.score("p", " 42\n", "42") == 1.0 and task.score("p", "41", "42") == 0.0
