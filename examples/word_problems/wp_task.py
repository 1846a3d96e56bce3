"""A temporary Task plugin for the word-problem example (until the built-in `dataset` task lands).

It reads data/train.jsonl and data/test.jsonl, renders each question with the tokenizer's chat
template (generation prompt added) and scores 1.0 for a completion whose last \\boxed{...} holds
the answer, else 0.0. From the repository root:

    python -m asyncrl launch --set task.kind=examples.word_problems.wp_task:word_problems_task \\
        --set model.path=examples/word_problems/model --set sampling.max_new_tokens=36

Options (`--set task.options.KEY=VALUE`): `train_path`, `eval_path` (default: this directory's
data/), `system` (a system message, "" = none; must match what build_model.py trained with),
`verifier`: "boxed" (the default, above) or "math_verify" (math_verify's verdict plus 0.1 when a
\boxed{integer} is present, what config.toml's rewards compute; held-out accuracy then counts
the 0.1 too).
`task.num_eval` caps the held-out set; `task.seed` seeds the training order.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from asyncrl.tasks.base import Problem

HERE = Path(__file__).resolve().parent
BOXED = re.compile(r"\\boxed\{([^{}]*)\}")


def boxed_answer(completion: str) -> str | None:
    """The content of the last \\boxed{...} in `completion`, stripped; None when there is none."""
    found = BOXED.findall(completion)
    return found[-1].strip() if found else None


def boxed_match(completion: str, answer: str) -> float:
    """1.0 when the last boxed value is the integer `answer`, else 0.0."""
    boxed = boxed_answer(completion)
    if boxed is None or not re.fullmatch(r"-?\d+", boxed):
        return 0.0
    return 1.0 if int(boxed) == int(answer) else 0.0


def math_verify_score(completion: str, answer: str) -> float:
    """math_verify's verdict (1 or 0) plus 0.1 when a \\boxed{integer} is present."""
    from math_verify import parse, verify

    # No signal-based timeouts: generators score in a worker thread.
    gold, pred = parse(answer, parsing_timeout=None), parse(completion, parsing_timeout=None)
    correct = 1.0 if verify(gold, pred, timeout_seconds=None) else 0.0
    return correct + (0.1 if re.search(r"\\boxed\{\d+\}", completion) else 0.0)


def chat_messages(question: str, system: str = "") -> list[dict[str, str]]:
    messages = [{"role": "system", "content": system}] if system else []
    return [*messages, {"role": "user", "content": question}]


def chat_prompt_text(tokenizer: Any, question: str, system: str = "") -> str:
    """The chat-rendered prompt, generation prompt included, as text."""
    return tokenizer.apply_chat_template(
        chat_messages(question, system), add_generation_prompt=True, tokenize=False
    )


def chat_prompt_ids(tokenizer: Any, question: str, system: str = "") -> list[int]:
    """`apply_chat_template(..., add_generation_prompt=True, tokenize=True)` as a list of ids
    (transformers 5 returns a BatchEncoding, 4.x a list)."""
    out = tokenizer.apply_chat_template(
        chat_messages(question, system), add_generation_prompt=True, tokenize=True
    )
    if isinstance(out, dict) or hasattr(out, "keys"):
        out = out["input_ids"]
    return list(out)


def read_rows(path: Path) -> list[dict]:
    with Path(path).open() as f:
        return [json.loads(line) for line in f if line.strip()]


class WordProblemsTask:
    """Training rows in a fresh seeded order every epoch; the first `num_eval` test rows held out."""

    def __init__(
        self,
        *,
        train_path: Path,
        eval_path: Path,
        num_eval: int,
        seed: int,
        system: str = "",
        verifier: str = "boxed",
    ) -> None:
        if verifier not in ("boxed", "math_verify"):
            raise ValueError(f"task.options.verifier must be 'boxed' or 'math_verify', got {verifier!r}")
        self.system = system
        self.verifier = verifier
        self.seed = seed
        self.rows = read_rows(train_path)
        if not self.rows:
            raise ValueError(f"no training rows in {train_path}")
        held = read_rows(eval_path)[:num_eval]
        held_questions = {r["question"] for r in held}
        overlap = sum(r["question"] in held_questions for r in self.rows)
        if overlap:
            raise ValueError(f"{overlap} training questions are also held out; regenerate the data")
        self.eval_problems = [self._problem(-1 - i, r) for i, r in enumerate(held)]
        self._orders: dict[int, list[int]] = {}

    def _problem(self, index: int, row: dict) -> Problem:
        return Problem(
            index=index,
            prompt=row["question"],
            answer=str(row["answer"]),
            extras={"steps": row.get("steps")},
            messages=tuple(chat_messages(row["question"], self.system)),
        )

    def _order(self, epoch: int) -> list[int]:
        if epoch not in self._orders:
            order = list(range(len(self.rows)))
            random.Random(f"{self.seed}:{epoch}").shuffle(order)
            self._orders = {epoch: order}  # one epoch at a time is all a stream needs
        return self._orders[epoch]

    def train_problem(self, index: int) -> Problem:
        epoch, pos = divmod(index, len(self.rows))
        return self._problem(index, self.rows[self._order(epoch)[pos]])

    def render(self, problems: Sequence[Problem], tokenizer: Any) -> list[list[int]]:
        if not problems:
            return []
        texts = [chat_prompt_text(tokenizer, p.prompt, self.system) for p in problems]
        return tokenizer(texts, add_special_tokens=False)["input_ids"]  # one call for the batch

    def score(self, prompt: str, completion: str, answer: str) -> float:
        if self.verifier == "math_verify":
            return math_verify_score(completion, answer)
        return boxed_match(completion, answer)


def word_problems_task(section: Any) -> WordProblemsTask:
    """The factory `task.kind` names: builds the task from the `task` config section."""
    opts = dict(section.options)
    valid = ("train_path", "eval_path", "system", "verifier")
    unknown = sorted(set(opts) - set(valid))
    if unknown:
        raise ValueError(f"unknown task.options {unknown}; valid: {', '.join(valid)}")
    return WordProblemsTask(
        train_path=Path(opts.get("train_path", HERE / "data" / "train.jsonl")),
        eval_path=Path(opts.get("eval_path", HERE / "data" / "test.jsonl")),
        num_eval=section.num_eval,
        seed=section.seed,
        system=str(opts.get("system", "")),
        verifier=str(opts.get("verifier", "boxed")),
    )
