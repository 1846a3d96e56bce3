"""The calculator example's episode state machine, driven by scripted model tokens (pure)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from examples.calculator_agent.episode import Episode, Vocab, calculate, submitted_answer  # noqa: E402

CHARS = "0123456789+="
VOCAB = Vocab(
    bos=1,
    eos=2,
    equals=4 + CHARS.index("="),
    id_of={c: 4 + i for i, c in enumerate(CHARS)},
    char_of={4 + i: c for i, c in enumerate(CHARS)},
)


def play(text_tokens: list[str], **kw) -> Episode:
    ep = Episode(vocab=VOCAB, question="12+34", answer="46", **kw)
    for t in text_tokens:
        assert not ep.done
        ep.on_model_token(VOCAB.eos if t == "<eos>" else VOCAB.id_of[t])
    return ep


def decode(ep: Episode) -> list[str]:
    names = {VOCAB.bos: "<bos>", VOCAB.eos: "<eos>", **VOCAB.char_of}
    return [names[i] for i in ep.completion_ids]


def test_calculator_and_submit_helpers():
    assert calculate("12+30+7") == "49" and calculate("5") == "5"
    assert calculate("") is None and calculate("1++2") is None
    assert submitted_answer("12+34=46") == "46" and submitted_answer("12+34") is None


def test_right_first_answer_ends_with_full_reward():
    ep = play(["4", "6", "<eos>"])
    assert ep.done and ep.reward == 1.0 and ep.finish_reason == "stop"
    assert ep.model_token == [True, True, True]


def test_wrong_answer_gets_the_question_again_then_the_calculator():
    ep = play(["4", "6", "0", "<eos>", "=", "<eos>"])
    assert decode(ep) == ["4", "6", "0", "<eos>", "<bos>", "1", "2", "+", "3", "4", "=", "4", "6", "<eos>"]
    assert ep.model_token == [True] * 4 + [False] * 6 + [True] + [False] * 2 + [True]
    assert ep.done and ep.reward == 0.5 and ep.turn == 2


def test_stray_digit_after_the_calculator_value_is_wrong():
    ep = play(["9", "<eos>", "=", "0", "<eos>"])
    assert ep.done and ep.reward == 0.0


def test_turn_budget_ends_the_episode():
    ep = play(["1"] * 3, max_turn_tokens=3)
    assert ep.done and ep.finish_reason == "length" and ep.reward == 0.0


@pytest.mark.parametrize("max_turns", [1, 3])
def test_turns_are_bounded(max_turns):
    ep = Episode(vocab=VOCAB, question="12+34", answer="46", max_turns=max_turns)
    turns = 0
    while not ep.done:
        ep.on_model_token(VOCAB.eos)  # submits nothing: always wrong
        turns += 1
    assert turns == max_turns and ep.reward == 0.0
