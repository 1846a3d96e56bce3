"""The `dataset` task: users' own prompts from local files, through Hugging Face `datasets`.

Data flow: the `task` config section -> `dataset_task` reads `task.dataset.path` (JSONL, JSON,
CSV, parquet or a `save_to_disk` directory; never the hub) and checks every row once, so a bad
file stops the run at load with a ValueError naming the file, the row and the fix -> the launcher
calls `prepare(tokenizer)` once (every prompt rendered, length-checked against
`task.prompt.max_tokens`, its ids cached) -> then per dispatch `train_problem(i)` and `render`
(a cache lookup). Evaluation reads `eval_problems`; generators score with the configured rewards
(`task.rewards`), `score` being only the exact-match fallback.

The training stream is epochs over the training rows: index i is row `order(epoch)[i % N]` of
epoch `i // N`, the order a permutation seeded by (task.seed, epoch) when `dataset.shuffle` is on,
else file order; the same i always gives the same prompt, so a resumed run admits exactly what
it would have. `fingerprint()` identifies the rows and their order for that resume check.

Self-distillation (`opd.teacher = "self"`, docs/opd.md): with `task.dataset.solution_field` the
column of each row's worked solution is loaded too (checked like the answers), and
`privileged_render` puts it in the prompt through `task.dataset.privileged_template`: raw text as
a whole, or a chat prompt's last user turn.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from asyncrl.tasks.base import Problem
from asyncrl.tasks.dataset_files import Table, describe_type, load_tables
from asyncrl.tasks.rendering import PromptCache, prompt_limit, render_problems

EPOCH_CACHE = 2  # shuffled epoch orders kept (a run asks epochs in order; retries may reach back one)
# The privileged prompt of self-distillation: the solution, then the prompt the student saw (a
# chat prompt: its last user turn), so the completion reads on from the same text.
PRIVILEGED_TEMPLATE = "Reference solution:\n{solution}\n\n{prompt}"

# -- rows -------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Row:
    """One validated row: what a `Problem` carries, plus where it came from (for error messages)."""

    prompt: str
    answer: str
    extras: dict[str, Any]
    messages: tuple[dict[str, Any], ...] | None
    where: str  # "data.jsonl line 7", "data.csv row 3"
    solution: str | None = None  # task.dataset.solution_field, when set

    def problem(self, index: int) -> Problem:
        return Problem(
            index=index,
            prompt=self.prompt,
            answer=self.answer,
            extras=self.extras,
            messages=self.messages,
            solution=self.solution,
        )


def _answer_text(value: Any) -> str | None:
    """The answer as text (42 -> "42", 2.0 -> "2", 2.5 -> "2.5"); None when it is not a scalar."""
    if isinstance(value, str):
        return value
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return ""
        return str(int(value)) if value.is_integer() else repr(value)
    return None


def _messages(value: Any, where: str, field: str) -> tuple[tuple[dict[str, Any], ...], str]:
    """A row's chat list, checked, and the content of its last user turn."""
    fix = (
        f"{where}: {field!r} (task.dataset.messages_field) must be a non-empty list of "
        '{"role": ..., "content": ...} objects'
    )
    if value is None or (isinstance(value, list) and not value):
        raise ValueError(f"{fix}; it is {'null' if value is None else 'empty'}. Fix or remove the row")
    if not isinstance(value, list):
        raise ValueError(f"{fix}; it is {describe_type(value)}")
    messages = []
    for n, message in enumerate(value, 1):
        if not isinstance(message, dict):
            raise ValueError(f"{fix}; message {n} is {describe_type(message)}")
        role, content = message.get("role"), message.get("content")
        if not isinstance(role, str) or not role or not isinstance(content, str):
            raise ValueError(
                f"{fix}; message {n} has role {describe_type(role)} and content {describe_type(content)} "
                "(both must be strings)"
            )
        # Keys absent from this row but present in others arrive as None (one Arrow schema per file).
        messages.append({k: v for k, v in message.items() if v is not None})
    users = [m["content"] for m in messages if m["role"] == "user"]
    if not users:
        raise ValueError(f"{fix}; it has no message with role 'user' (the prompt)")
    return tuple(messages), users[-1]


def table_rows(table: Table, dataset: Any, *, use_messages: bool, solution_field: str = "") -> list[Row]:
    """Every row of `table` as a `Row`, with the fields of `task.dataset` (and the solution
    column, `task.dataset.solution_field`) mapped and checked."""
    columns = table.data.column_names
    text_field = dataset.messages_field if use_messages else dataset.prompt_field
    text_key = "task.dataset.messages_field" if use_messages else "task.dataset.prompt_field"
    wanted = [(text_field, text_key)]
    if dataset.answer_field:
        wanted.append((dataset.answer_field, "task.dataset.answer_field"))
    if solution_field:
        wanted.append((solution_field, "task.dataset.solution_field"))
    wanted += [(name, "task.dataset.extra_fields") for name in dataset.extra_fields]
    for name, key in wanted:
        if name not in columns:
            fix = (
                "fix the name or drop it from the list"
                if key.endswith("s")
                else f"set {key} to the right one"
            )
            raise ValueError(
                f"{table.label} has no field {name!r} ({key}); its fields are: {', '.join(columns)}; {fix}"
            )
    if len(table.data) == 0:
        raise ValueError(f"{table.label} has no rows; point {table.key} at a file with prompts in it")
    names = list(dict.fromkeys(name for name, _ in wanted))
    data = table.data.select_columns(names)[:]
    texts = data[text_field]
    answers = data[dataset.answer_field] if dataset.answer_field else None
    solutions = data[solution_field] if solution_field else None
    extra_columns = [(name, data[name]) for name in dataset.extra_fields]
    rows = []
    for k, text in enumerate(texts):
        where = table.where(k)
        messages = None
        if use_messages:
            messages, prompt = _messages(text, where, text_field)
        elif isinstance(text, str) and text.strip():
            prompt = text
        elif text is None or isinstance(text, str):
            raise ValueError(
                f"{where}: the prompt {text_field!r} (task.dataset.prompt_field) is "
                f"{'null or missing' if text is None else 'empty'}; every row needs a prompt. Fix or remove the row"
            )
        else:
            raise ValueError(
                f"{where}: the prompt {text_field!r} (task.dataset.prompt_field) must be a string, got "
                f"{describe_type(text)}; for a chat list set task.dataset.messages_field instead"
            )
        answer = ""
        if answers is not None:
            answer = _text_cell(
                answers[k],
                where,
                f"the answer {dataset.answer_field!r} (task.dataset.answer_field)",
                'fix or remove the row (or set task.dataset.answer_field = "" when your rewards need no answer)',
            )
        extras = {name: column[k] for name, column in extra_columns}
        solution = None
        if solutions is not None:
            solution = _text_cell(
                solutions[k],
                where,
                f"the solution {solution_field!r} (task.dataset.solution_field)",
                "self-distillation needs every row's solution: fix or remove the row",
            )
        rows.append(
            Row(
                prompt=prompt, answer=answer, extras=extras, messages=messages, where=where, solution=solution
            )
        )
    return rows


def _text_cell(raw: Any, where: str, what: str, fix: str) -> str:
    """An answer or solution cell as text; ValueError naming the row when it is missing, empty or
    not a string or number (`what` names the field and its key, `fix` what to do when empty)."""
    text = _answer_text(raw)
    if text is None and raw is not None:
        raise ValueError(
            f"{where}: {what} must be a string or a number, got {describe_type(raw)}. Fix the row"
        )
    if not text or not text.strip():
        raise ValueError(f"{where}: {what} is {'null or missing' if raw is None else 'empty'}; {fix}")
    return text


def _check_section(section: Any) -> None:
    """Config mistakes that need no file: ValueError naming the keys and the fix."""
    dataset, prompt = section.dataset, section.prompt
    if not dataset.path:
        raise ValueError(
            "task.dataset.path is empty; set it to a .jsonl/.json/.csv/.parquet file or a save_to_disk "
            "directory of your prompts"
        )
    if dataset.messages_field and prompt.template == "raw":
        raise ValueError(
            f"task.dataset.messages_field = {dataset.messages_field!r} gives chat prompts, which need a chat "
            "template; set task.prompt.template = 'chat' (or use task.dataset.prompt_field for raw text)"
        )
    if not dataset.messages_field and not dataset.prompt_field:
        raise ValueError(
            "task.dataset.prompt_field is empty; name the field with the prompt text (or set messages_field)"
        )
    sources = [
        name
        for name, value in (
            ("eval_path", dataset.eval_path),
            ("eval_split", dataset.eval_split),
            ("eval_fraction", dataset.eval_fraction),
        )
        if value
    ]
    if len(sources) > 1:
        raise ValueError(
            f"task.dataset sets {' and '.join(sources)}; the held-out split comes from one of eval_path, "
            "eval_split or eval_fraction, so keep one"
        )


def _privileged_options(section: Any) -> tuple[str, str]:
    """(solution column, privileged template) from `task.dataset`; ValueError naming the key."""
    field, template = section.dataset.solution_field, section.dataset.privileged_template
    if not isinstance(template, str) or "{solution}" not in template or not template.endswith("{prompt}"):
        raise ValueError(
            "task.dataset.privileged_template must be a string that contains {solution} and ends with "
            "{prompt} (the completion follows the prompt the student saw), e.g. "
            f"{PRIVILEGED_TEMPLATE!r}"
        )
    try:
        template.format(solution="", prompt="")
    except (KeyError, IndexError, ValueError) as exc:
        raise ValueError(
            f"task.dataset.privileged_template: {exc!r}; use only {{solution}} and {{prompt}} "
            "(write {{ and }} for literal braces)"
        ) from None
    return field, template


def _split(tables: dict[str, Table], name: str, *, path: str, key: str) -> Table:
    if name not in tables:
        raise ValueError(
            f"{path} has no split {name!r} ({key}); its splits are: {', '.join(tables)}. Set {key} to one of them"
        )
    return tables[name]


def _load(section: Any, solution_field: str = "") -> tuple[list[Row], list[Row]]:
    """(training rows, held-out rows), checked, in file order (held-out: the order they are evaluated).
    An eval_fraction is held out of training even with task.num_eval = 0, so the training rows do
    not depend on whether a run evaluates; eval_split/eval_path are not read then."""
    dataset = section.dataset
    use_messages = bool(dataset.messages_field)
    text_fields = [
        name
        for name in ("" if use_messages else dataset.prompt_field, dataset.answer_field, solution_field)
        if name
    ]
    tables, has_splits = load_tables(
        dataset.path, dataset.format, key="task.dataset.path", text_fields=text_fields
    )
    if has_splits:
        train_table = _split(tables, dataset.split, path=dataset.path, key="task.dataset.split")
    elif dataset.split != "train":
        raise ValueError(
            f"task.dataset.split = {dataset.split!r}, but {dataset.path} holds a single split; remove "
            "task.dataset.split, or point task.dataset.path at a save_to_disk directory with splits"
        )
    else:
        train_table = tables["train"]
    # The solutions of the training rows only: the held-out rows are never distilled on.
    train = table_rows(train_table, dataset, use_messages=use_messages, solution_field=solution_field)
    held: list[Row] = []
    if dataset.eval_fraction:
        count = math.ceil(dataset.eval_fraction * len(train))
        if count >= len(train):
            raise ValueError(
                f"task.dataset.eval_fraction = {dataset.eval_fraction} holds out {count} of the {len(train)} rows "
                f"of {dataset.path}, leaving none to train on; lower task.dataset.eval_fraction"
            )
        chosen = set(random.Random(f"eval:{section.eval_seed}").sample(range(len(train)), count))
        held = [row for k, row in enumerate(train) if k in chosen]
        train = [row for k, row in enumerate(train) if k not in chosen]
    elif dataset.eval_split and section.num_eval:
        if not has_splits:
            raise ValueError(
                f"task.dataset.eval_split = {dataset.eval_split!r} needs task.dataset.path to be a save_to_disk "
                f"directory with splits, but {dataset.path} holds a single split; use task.dataset.eval_path or "
                "task.dataset.eval_fraction instead"
            )
        if dataset.eval_split == dataset.split:
            raise ValueError(
                f"task.dataset.eval_split = {dataset.eval_split!r} is the training split (task.dataset.split); "
                "name a different split to hold out"
            )
        held = table_rows(
            _split(tables, dataset.eval_split, path=dataset.path, key="task.dataset.eval_split"),
            dataset,
            use_messages=use_messages,
        )
    elif dataset.eval_path and section.num_eval:
        eval_tables, eval_splits = load_tables(
            dataset.eval_path, dataset.format, key="task.dataset.eval_path", text_fields=text_fields
        )
        if eval_splits and len(eval_tables) > 1:
            raise ValueError(
                f"task.dataset.eval_path {dataset.eval_path} holds splits {', '.join(eval_tables)}; save one split "
                "there, or point task.dataset.path at it and set task.dataset.eval_split"
            )
        held = table_rows(next(iter(eval_tables.values())), dataset, use_messages=use_messages)
    return train, held


class DatasetTask:
    """Prompts from a local dataset file (the `dataset` task; see the module docstring).

    The launcher always calls `prepare(tokenizer)` before the first `train_problem`: it drops rows
    over `task.prompt.max_tokens` (too_long = "drop"), which changes `num_train` and the stream.
    Before it, `train_problem` walks the unfiltered rows."""

    def __init__(self, section: Any) -> None:
        _check_section(section)
        self.path: str = section.dataset.path
        self._seed = section.seed
        self._shuffle = section.dataset.shuffle
        self._num_eval = section.num_eval
        self._prompt = section.prompt
        self._solution_field, self._privileged_template = _privileged_options(section)
        self._all_train, self._held = _load(section, self._solution_field)
        self._set_rows(self._all_train, self._held[: self._num_eval])
        self._cache: PromptCache | None = None  # filled by `prepare`

    def _set_rows(self, train: list[Row], held: list[Row]) -> None:
        self._train = train
        self._eval = [row.problem(k) for k, row in enumerate(held)]
        self._orders: dict[int, list[int]] = {}
        self._fingerprint: str | None = None

    # -- the Task protocol -------------------------------------------------------------------

    @property
    def eval_problems(self) -> list[Problem]:
        """The held-out problems (at most task.num_eval), index = position in this list."""
        return self._eval

    @property
    def num_train(self) -> int:
        """Training rows (one epoch of the stream); after `prepare`, without the dropped ones."""
        return len(self._train)

    def position(self, index: int) -> tuple[int, int]:
        """(epoch, position within that epoch) of stream index `index`."""
        if index < 0:
            raise ValueError(f"asyncrl/tasks/dataset.py: stream index {index} is negative")
        return divmod(index, len(self._train))

    def train_problem(self, index: int) -> Problem:
        epoch, pos = self.position(index)
        order = self._order(epoch)
        return self._train[order[pos] if order is not None else pos].problem(index)

    def render(self, problems: Sequence[Problem], tokenizer: Any) -> list[list[int]]:
        """Prompt ids of `problems`: those `prepare` rendered with this tokenizer are looked up, any
        other problem is rendered now (raw text or the chat template)."""
        if self._cache is not None and tokenizer is self._cache.tokenizer:
            return self._cache.render(problems)
        prompt = self._prompt
        return render_problems(problems, tokenizer, template=prompt.template, system=prompt.system)

    def privileged_render(self, problems: Sequence[Problem], tokenizer: Any) -> list[list[int]]:
        """Prompt ids of `problems` with their worked solution in context (module docstring),
        rendered with the prompt's template; never cached (only self-distillation asks)."""
        if not self._solution_field:
            raise ValueError(
                "opd.teacher = 'self' shows the teacher each row's worked solution, and the dataset task "
                'knows no solution column: set task.dataset.solution_field = "<column>"'
            )
        shown = [self._privileged_problem(p) for p in problems]
        prompt = self._prompt
        return render_problems(shown, tokenizer, template=prompt.template, system=prompt.system)

    def _privileged_problem(self, problem: Problem) -> Problem:
        """`problem` with its solution put in by the privileged template (chat: the last user turn)."""
        if problem.solution is None:
            raise ValueError(
                f"problem {problem.index} of {self.path} has no solution (task.dataset.solution_field)"
            )
        fill = lambda text: self._privileged_template.format(solution=problem.solution, prompt=text)  # noqa: E731
        if problem.messages is None:
            return replace(problem, prompt=fill(problem.prompt))
        messages = [dict(m) for m in problem.messages]
        last = max(k for k, m in enumerate(messages) if m["role"] == "user")
        messages[last]["content"] = fill(messages[last]["content"])
        return replace(problem, prompt=messages[last]["content"], messages=tuple(messages))

    def score(self, prompt: str, completion: str, answer: str) -> float:
        """Fallback exact match (stripped); the real scoring is the configured task.rewards."""
        return 1.0 if completion.strip() == answer.strip() else 0.0

    # -- extras the launcher uses -------------------------------------------------------------

    def prepare(self, tokenizer: Any, room: int = 0) -> dict[str, int]:
        """Render every training and held-out prompt once with `tokenizer` (later `render` calls for
        them are lookups) and enforce task.prompt.max_tokens and `room` (the longest prompt the
        model's context leaves beside sampling.max_new_tokens; 0 = none), the tighter of the two, by
        task.prompt.too_long. Returns counts for the run log."""
        prompt = self._prompt
        cache = PromptCache(tokenizer, template=prompt.template, system=prompt.system)
        limits = {"limit": prompt_limit(prompt.max_tokens, room), "too_long": prompt.too_long}
        kept = {}
        for name, rows, wanted in (
            ("train", self._all_train, len(self._all_train)),
            ("eval", self._held, self._num_eval),
        ):
            positions, dropped, longest = cache.admit(
                [row.problem(0) for row in rows], [row.where for row in rows], wanted=wanted, **limits
            )
            kept[name] = ([rows[k] for k in positions], dropped, longest)
        train, dropped, longest = kept["train"]
        if not train:
            raise ValueError(
                f"every one of the {len(self._all_train)} training rows of {self.path} renders longer than "
                f"{limits['limit'].text}; {limits['limit'].fix}"
            )
        held, dropped_eval, longest_eval = kept["eval"]
        self._set_rows(train, held)
        self._cache = cache
        return {
            "train_rows": len(train),
            "eval_rows": len(held),
            "dropped_too_long": dropped,
            "dropped_too_long_eval": dropped_eval,
            "max_prompt_tokens": max(longest, longest_eval),
        }

    def fingerprint(self) -> str:
        """A short hex digest of the training rows in file order plus the shuffle seed: a resumed run
        compares it to the original's to check it trains on the same stream (take it after `prepare`)."""
        if self._fingerprint is None:
            digest = hashlib.blake2b(digest_size=8)
            digest.update(
                f"shuffle={self._seed if self._shuffle else 'off'};rows={len(self._train)}\n".encode()
            )
            for row in self._train:
                record = [row.prompt, row.answer, row.messages, row.extras]
                digest.update(json.dumps(record, sort_keys=True, default=str, ensure_ascii=False).encode())
                digest.update(b"\n")
            self._fingerprint = digest.hexdigest()
        return self._fingerprint

    def _order(self, epoch: int) -> list[int] | None:
        """Row order of `epoch` (None = file order), seeded by (task.seed, epoch); cached."""
        if not self._shuffle:
            return None
        order = self._orders.get(epoch)
        if order is None:
            order = list(range(len(self._train)))
            random.Random(f"{self._seed}:{epoch}").shuffle(order)
            while len(self._orders) >= EPOCH_CACHE:
                self._orders.pop(min(self._orders))
            self._orders[epoch] = order
        return order


def dataset_task(section: Any) -> DatasetTask:
    """The registered factory (`task.kind = "dataset"`): load and check `task.dataset.path`."""
    return DatasetTask(section)
