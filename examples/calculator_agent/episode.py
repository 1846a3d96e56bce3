"""The calculator episode as a pure state machine over token ids (no model, no torch).

The task is the built-in addition prompt `a+b=`; the episode is at most `max_turns` turns:

  turn 1   the model answers after the prompt's `=`; its `<eos>` ends the turn and submits the
           answer (the digits after the last `=` of the turn).
  checker  a wrong answer with turns left: the environment re-poses the question, appending
           `<bos>a+b` (no `=`), and the model takes another turn.
  `=`      in any turn, the model calls the calculator by writing `=`: the calculator evaluates
           what was written since the previous `=` of the turn (digits joined by `+`) and appends
           the value's digits; the model goes on writing after them.

Model tokens are trained (`loss_mask` True); everything the environment appends (calculator
values, re-posed questions) is masked out. The completion is the plain concatenation of model and
environment token ids in order, so the learner scores exactly the context the model sampled in.

Reward: 1 for a correct answer in turn 1, `retry_reward` for a correct answer in a later turn,
0 otherwise (wrong, or a turn that ran past its token budget). The default model writes `=`
after `<bos>a+b` by habit, so on a retry it calls the calculator and has to learn to stop cleanly
after the value (its habit is a stray `0`), and in turn 1 to add without the stray `0`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

_EXPRESSION = re.compile(r"\d+(\+\d+)*")


def calculate(expression: str) -> str | None:
    """The calculator: the decimal value of `12+30+7`-style sums, None for anything else."""
    if not _EXPRESSION.fullmatch(expression):
        return None
    return str(sum(int(term) for term in expression.split("+")))


def submitted_answer(turn_text: str) -> str | None:
    """The answer a turn submits: the digits after its last `=`, None without one."""
    _, eq, tail = turn_text.rpartition("=")
    if not eq or not tail.isdigit():
        return None
    return tail


@dataclass(frozen=True, kw_only=True)
class Vocab:
    """The token ids the episode needs, from the model's tokenizer."""

    bos: int
    eos: int
    equals: int
    id_of: dict[str, int]  # single characters (digits, '+') -> id
    char_of: dict[int, str]  # id -> character, for every character the episode reads

    def encode(self, text: str) -> list[int]:
        return [self.id_of[c] for c in text]


@dataclass(kw_only=True)
class Episode:
    """One sample's episode. Feed it each sampled token with `on_model_token`; it returns the ids
    the environment appends (possibly none) and sets `done`."""

    vocab: Vocab
    question: str  # "a+b" (the prompt without its trailing '=')
    answer: str
    max_turns: int = 2
    retry_reward: float = 0.5
    max_turn_tokens: int = 8
    turn: int = 1
    turn_text: str = ""
    turn_tokens: int = 0
    done: bool = False
    reward: float = 0.0
    finish_reason: str = "length"
    completion_ids: list[int] = field(default_factory=list)
    model_token: list[bool] = field(default_factory=list)  # per completion token: sampled by the model?

    def __post_init__(self) -> None:
        self.turn_text = self.question + "="  # turn 1 starts after the prompt's '='

    def on_model_token(self, token_id: int) -> list[int]:
        assert not self.done, "the episode is over"
        self._append([token_id], by_model=True)
        self.turn_tokens += 1
        v = self.vocab
        if token_id == v.eos:
            return self._end_turn()
        char = v.char_of.get(token_id)
        self.turn_text += char if char is not None else "?"
        if token_id == v.equals:
            expression = self.turn_text[:-1].rpartition("=")[2]
            value = calculate(expression)
            if value is not None:
                self.turn_text += value
                return self._append(v.encode(value), by_model=False)
        if self.turn_tokens >= self.max_turn_tokens:
            self.done, self.finish_reason, self.reward = True, "length", 0.0
        return []

    def _end_turn(self) -> list[int]:
        if submitted_answer(self.turn_text) == self.answer:
            self.done, self.finish_reason = True, "stop"
            self.reward = 1.0 if self.turn == 1 else self.retry_reward
            return []
        if self.turn >= self.max_turns:
            self.done, self.finish_reason, self.reward = True, "stop", 0.0
            return []
        self.turn += 1
        self.turn_text, self.turn_tokens = self.question, 0
        return self._append([self.vocab.bos, *self.vocab.encode(self.question)], by_model=False)

    def _append(self, ids: list[int], *, by_model: bool) -> list[int]:
        self.completion_ids += ids
        self.model_token += [by_model] * len(ids)
        return ids


def make_vocab(tokenizer) -> Vocab:
    """The episode's ids from a Hugging Face tokenizer; ValueError naming what is missing."""
    chars = "0123456789+="
    id_of = {}
    for c in chars:
        ids = tokenizer.convert_tokens_to_ids([c])
        if not ids or ids[0] is None or ids[0] == tokenizer.unk_token_id:
            raise ValueError(f"the calculator agent needs a single token for {c!r} in the model's vocabulary")
        id_of[c] = ids[0]
    if tokenizer.bos_token_id is None or tokenizer.eos_token_id is None:
        raise ValueError("the calculator agent needs <bos> and <eos> tokens in the model's tokenizer")
    return Vocab(
        bos=tokenizer.bos_token_id,
        eos=tokenizer.eos_token_id,
        equals=id_of["="],
        id_of=id_of,
        char_of={i: c for c, i in id_of.items()},
    )
