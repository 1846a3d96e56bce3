"""Rewards: the built-ins on hand cases, resolution of config entries, the load-time check, and
the Scorer's weighted sum, parts and failures (asyncrl/rewards/)."""

from __future__ import annotations

import asyncio
import math

import pytest

from asyncrl.config_sections import RewardConfig, ScoringConfig, TaskConfig
from asyncrl.rewards import RewardInput, Scorer, check_rewards, make_scorer, resolve_reward, reward_mode
from asyncrl.rewards.builtin import exact_match, last_boxed, length_penalty, math_verify, regex


def sample(completion: str, answer: str = "", num_tokens: int = 0, max_new_tokens: int = 100) -> RewardInput:
    return RewardInput("prompt", completion, answer, {}, num_tokens, "stop", max_new_tokens)


# ---------------------------------------------------------------- exact_match


@pytest.mark.parametrize(
    ("options", "completion", "answer", "expected"),
    [
        ({}, " 42\n", "42", 1.0),
        ({}, "42", "43", 0.0),
        ({"normalize": []}, " 42", "42", 0.0),
        ({"normalize": ["lower"]}, "Paris", "paris", 1.0),
        ({"normalize": ["strip"]}, "Paris", "paris", 0.0),
        ({"normalize": ["whitespace"]}, "New   York\n City", "New York City", 1.0),
        ({"normalize": ["strip", "punctuation"]}, '"Paris."', "Paris", 1.0),
        ({"normalize": ["strip", "punctuation"]}, "Paris!?", "Paris", 1.0),
        ({"normalize": ["strip", "punctuation"]}, "Pa.ris", "Paris", 0.0),
        ({"normalize": ["strip", "number"]}, "14.0", "14", 1.0),
        ({"normalize": ["strip", "number"]}, "1,000", "1000", 1.0),
        ({"normalize": ["strip", "number"]}, "1/2", "0.5", 1.0),
        ({"normalize": ["strip", "number"]}, "14.5", "14", 0.0),
        ({"normalize": ["strip", "number"]}, "abc", "abc", 1.0),  # not numbers: compared as text
        ({"normalize": ["strip"]}, "14.0", "14", 0.0),
    ],
)
def test_exact_match_normalisation(options, completion, answer, expected):
    assert exact_match(**options)(sample(completion, answer)) == expected


@pytest.mark.parametrize(
    ("extract", "completion", "answer", "expected"),
    [
        ("last_number", "3 apples and 5 pears make 8", "8", 1.0),
        ("last_number", "it costs $1,250.", "1250", 1.0),
        ("last_number", "the answer is -3", "-3", 1.0),
        ("last_number", "no digits here", "0", 0.0),
        ("boxed", r"so \boxed{\frac{1}{2}} done", r"\frac{1}{2}", 1.0),
        ("boxed", r"\boxed{1} then \boxed{2}", "2", 1.0),
        ("boxed", r"\boxed{1} then \boxed{2}", "1", 0.0),
        ("boxed", r"\boxed{x^{2}}", "x^{2}", 1.0),
        ("boxed", r"\boxed{cut", "cut", 0.0),
        ("boxed", "no box 7", "7", 0.0),
        ("after:####", "work 12\n#### 72", "72", 1.0),
        ("after:####", "#### 1 #### 2", "2", 1.0),
        ("after:####", "72", "72", 0.0),
        ("all", "72", "72", 1.0),
    ],
)
def test_exact_match_extraction(extract, completion, answer, expected):
    assert exact_match(extract=extract)(sample(completion, answer)) == expected


def test_last_boxed_keeps_nested_braces():
    assert last_boxed(r"\boxed{\frac{a}{b+\{c\}}}") == r"\frac{a}{b+\{c\}}"
    assert last_boxed(r"\fbox{3}") == "3"
    assert last_boxed("nothing") is None


def test_exact_match_rejects_bad_options():
    with pytest.raises(ValueError, match="normalize.*unknown.*'upper'"):
        exact_match(normalize=["upper"])
    with pytest.raises(ValueError, match="after:<marker>"):
        exact_match(extract="first_number")


def test_builtins_declare_cheapness():
    assert exact_match().asyncrl_cheap and regex("x").asyncrl_cheap and length_penalty().asyncrl_cheap
    assert not getattr(math_verify(), "asyncrl_cheap", False)


# ---------------------------------------------------------------- math_verify


@pytest.mark.parametrize(
    ("completion", "answer", "expected"),
    [
        (r"so the answer is \boxed{1/2}", "0.5", 1.0),
        (r"\boxed{0.5}", r"\frac{1}{2}", 1.0),
        (r"\boxed{\frac{\sqrt{2}}{2}}", r"\frac{1}{\sqrt{2}}", 1.0),
        (r"\boxed{2x + x^2}", "x^2+2x", 1.0),
        (r"\boxed{1000}", "1,000", 1.0),
        (r"\boxed{3}", "4", 0.0),
        ("the answer is 1/2", "0.5", 0.0),  # extract="boxed": no box, no credit
    ],
)
def test_math_verify_boxed(completion, answer, expected):
    assert math_verify()(sample(completion, answer)) == expected


def test_math_verify_all_finds_an_unboxed_answer():
    reward = math_verify(extract="all")
    assert reward(sample("the answer is 1/2", "0.5")) == 1.0
    assert reward(sample("the answer is 1/3", "0.5")) == 0.0


# ---------------------------------------------------------------- regex


def test_regex_format_reward():
    think = regex(r"<think>.*</think>\s*<answer>.*</answer>", mode="fullmatch", flags="s", reward=0.5)
    assert think(sample("<think>a\nb</think> <answer>3</answer>")) == 0.5
    assert think(sample("<answer>3</answer>")) == 0.0
    assert regex("ANSWER", flags="i", otherwise=-1.0)(sample("the answer")) == 1.0
    assert regex("ANSWER", otherwise=-1.0)(sample("the answer")) == -1.0


def test_regex_rejects_bad_patterns_and_flags():
    with pytest.raises(ValueError, match=r"pattern = '\(unclosed'"):
        regex("(unclosed")
    with pytest.raises(ValueError, match="unknown flag 'q'"):
        regex("x", flags="q")
    with pytest.raises(ValueError, match="mode"):
        regex("x", mode="match")


# ---------------------------------------------------------------- length_penalty


@pytest.mark.parametrize(
    ("num_tokens", "expected"),
    [
        (0, 0.0),
        (80, 0.0),  # L <= Lmax - Lc = 100 - 20
        (81, -1 / 20),  # (80 - 81) / 20
        (90, -0.5),
        (100, -1.0),  # L = Lmax: the full penalty, continuously
        (101, -1.0),  # beyond Lmax
    ],
)
def test_length_penalty_formula(num_tokens, expected):
    reward = length_penalty(max_tokens=100, buffer_tokens=20)
    assert reward(sample("x", num_tokens=num_tokens)) == pytest.approx(expected)


def test_length_penalty_defaults_to_the_samples_cap_and_a_fifth_buffer():
    reward = length_penalty(penalty=2.0)  # Lmax = max_new_tokens = 50, Lc = 10
    assert reward(sample("x", num_tokens=40, max_new_tokens=50)) == 0.0
    assert reward(sample("x", num_tokens=45, max_new_tokens=50)) == pytest.approx(-1.0)  # -5/10 * 2
    assert reward(sample("x", num_tokens=50, max_new_tokens=50)) == pytest.approx(-2.0)


def test_length_penalty_rejects_a_buffer_past_the_cap():
    with pytest.raises(ValueError, match="buffer_tokens = 200 exceeds max_tokens = 100"):
        length_penalty(max_tokens=100, buffer_tokens=200)


# ---------------------------------------------------------------- resolution and the load-time check


def test_resolve_registry_name_calls_the_factory_with_options():
    reward = resolve_reward(RewardConfig(kind="exact_match", options={"extract": "last_number"}))
    assert reward(sample("so 7", "7")) == 1.0


def test_resolve_path_without_options_is_the_function_itself():
    from tests import reward_fixtures

    assert resolve_reward(RewardConfig(kind="tests.reward_fixtures:length")) is reward_fixtures.length


def test_resolve_path_with_options_is_a_factory():
    reward = resolve_reward(RewardConfig(kind="tests.reward_fixtures:scaled", options={"factor": 3.0}))
    assert reward(sample("ab")) == 6.0


def test_resolve_unknown_name_lists_the_valid_ones():
    with pytest.raises(ValueError, match=r"task\.rewards\[2\]\.kind.*exact_match.*math_verify"):
        resolve_reward(RewardConfig(kind="exact_mtach"), index=2)


def test_resolve_bad_options_name_the_key_and_the_valid_options():
    with pytest.raises(
        ValueError, match=r"task\.rewards\[0\]\.options.*unexpected keyword.*normalize, extract"
    ):
        resolve_reward(RewardConfig(kind="exact_match", options={"mode": "x"}), index=0)
    with pytest.raises(ValueError, match=r"task\.rewards\[1\]\.options.*http:// or https://"):
        resolve_reward(RewardConfig(kind="remote", options={"url": "ftp://x"}), index=1)
    with pytest.raises(ValueError, match=r"task\.rewards\[0\]\.options.*cannot build"):
        resolve_reward(RewardConfig(kind="tests.reward_fixtures:failing_factory", options={"a": 1}), index=0)


def test_resolve_rejects_a_factory_that_returns_no_reward():
    with pytest.raises(ValueError, match=r"task\.rewards\[0\]\.kind.*resolved to int, which is neither"):
        resolve_reward(RewardConfig(kind="tests.reward_fixtures:number_factory", options={"n": 7}), index=0)


def test_resolve_missing_module_names_the_key():
    with pytest.raises(ValueError, match=r"task\.rewards\[0\]\.kind.*no_such_module"):
        resolve_reward(RewardConfig(kind="no_such_module:fn"), index=0)


def test_reward_modes():
    from tests import reward_fixtures

    assert reward_mode(reward_fixtures.length) == "sync"
    assert reward_mode(reward_fixtures.async_misbehave) == "async"
    assert reward_mode(reward_fixtures.AsyncCallable()) == "async"
    assert reward_mode(resolve_reward(RewardConfig(kind="remote", options={"url": "http://h:1/"}))) == "batch"


def _task(*rewards: RewardConfig, **scoring) -> TaskConfig:
    return TaskConfig(rewards=list(rewards), scoring=ScoringConfig(**scoring))


def test_check_rewards_accepts_a_valid_section():
    check_rewards(
        _task(
            RewardConfig(kind="exact_match"),
            RewardConfig(kind="regex", name="format", weight=0.1, options={"pattern": "x"}),
            eval_reward="format",
        )
    )


@pytest.mark.parametrize(
    ("section", "message"),
    [
        (
            _task(RewardConfig(kind="exact_match"), RewardConfig(kind="exact_match")),
            r"task\.rewards\[1\]\.name",
        ),
        (_task(RewardConfig(kind="exact_match", weight=math.inf)), r"task\.rewards\[0\]\.weight"),
        (_task(RewardConfig(kind="exact_match"), eval_reward="acc"), r"eval_reward = 'acc'.*exact_match"),
        (
            _task(RewardConfig(kind="tests.reward_fixtures:async_misbehave", runs_in="process")),
            r"task\.rewards\[0\]\.runs_in.*async",
        ),
        (_task(RewardConfig(kind="nope")), r"task\.rewards\[0\]\.kind"),
    ],
)
def test_check_rewards_rejects(section, message):
    with pytest.raises(ValueError, match=message):
        check_rewards(section)


# ---------------------------------------------------------------- the Scorer (threads and async)


def test_make_scorer_is_none_without_rewards():
    assert make_scorer(TaskConfig()) is None


def test_scorer_weighted_sum_and_parts():
    section = _task(
        RewardConfig(kind="exact_match", name="correct"),
        RewardConfig(kind="regex", name="format", weight=0.5, options={"pattern": r"^\d+$"}),
        RewardConfig(kind="length_penalty", weight=2.0, options={"max_tokens": 10, "buffer_tokens": 4}),
    )
    scorer = Scorer(section)
    try:
        assert scorer.names == ["correct", "format", "length_penalty"]
        assert scorer.eval_name == "correct"
        a, b, c = scorer.score_sync(
            [sample("7", "7", num_tokens=3), sample("x7", "7", num_tokens=8), sample("8", "7", num_tokens=20)]
        )
    finally:
        scorer.close()
    assert (a.reward, a.parts, a.failed) == (
        1.5,
        {"correct": 1.0, "format": 1.0, "length_penalty": 0.0},  # unweighted
        False,
    )
    assert b.parts == {"correct": 0.0, "format": 0.0, "length_penalty": pytest.approx(-0.5)}  # (6 - 8) / 4
    assert b.reward == pytest.approx(2.0 * -0.5)
    assert c.reward == pytest.approx(0.5 - 2.0)


def test_scorer_thread_reward_failures_are_per_sample():
    section = _task(
        RewardConfig(kind="tests.reward_fixtures:misbehave", runs_in="thread", name="m", weight=2.0),
        RewardConfig(kind="exact_match", name="em"),
    )
    with_scorer = Scorer(section)
    try:
        scores = with_scorer.score_sync(
            [sample("ab", "ab"), sample("raise", "x"), sample("nan", "nan"), sample("str")]
        )
    finally:
        with_scorer.close()
    assert scores[0].reward == 5.0 and not scores[0].failed
    assert scores[1].failures == {"m": "raised: ValueError: bad sample"}
    assert scores[1].parts == {"m": 0.0, "em": 0.0}
    assert scores[2].failures["m"].startswith("invalid: returned nan")
    assert scores[2].reward == 1.0  # the failed part adds 0; exact match still counts
    assert scores[3].failures["m"].startswith("invalid: returned str")


def test_scorer_thread_reward_that_hangs_fails_that_sample_only():
    section = _task(RewardConfig(kind="tests.reward_fixtures:misbehave", runs_in="thread"), timeout_s=0.2)
    scorer = Scorer(section)
    try:
        scores = scorer.score_sync([sample("a"), sample("hang"), sample("ccc")])
    finally:
        scorer.close()
    assert [s.reward for s in scores] == [1.0, 0.0, 3.0]
    assert scores[1].failures == {"tests.reward_fixtures:misbehave": "timeout"}


def test_scorer_async_reward_timeout_and_raise():
    section = _task(RewardConfig(kind="tests.reward_fixtures:async_misbehave", name="a"), timeout_s=0.2)

    async def main():
        scorer = Scorer(section)
        try:
            return await scorer.score([sample("ab"), sample("hang"), sample("raise"), sample("abc")])
        finally:
            await scorer.aclose()

    scores = asyncio.run(main())
    assert [s.parts["a"] for s in scores] == [2.0, 0.0, 0.0, 3.0]
    assert scores[1].failures == {"a": "timeout"}
    assert scores[2].failures == {"a": "raised: RuntimeError: async bad sample"}


def test_score_sync_refuses_a_running_loop():
    scorer = Scorer(_task(RewardConfig(kind="exact_match")))

    async def main():
        with pytest.raises(RuntimeError, match="await scorer.score"):
            scorer.score_sync([sample("1", "1")])

    asyncio.run(main())
    scorer.close()
