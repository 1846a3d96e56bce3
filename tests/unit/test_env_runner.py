"""The episode runner on a scripted backend (no model): token accounting, versions, budgets and
the failure policy, with the calculator example and small test environments in-process."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

from asyncrl.environments.base import EnvironmentContext, Observation, StepResult
from asyncrl.environments.host import InProcessHost
from asyncrl.generators.episode_runner import Budgets, EpisodeRunner, TurnOutput
from asyncrl.messages import PromptTask, SamplingParams

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
from examples.calculator_agent.environment import calculate, calculator, submitted_answer  # noqa: E402

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    from asyncrl.models.default import DEFAULT_MODEL_DIR

    return AutoTokenizer.from_pretrained(DEFAULT_MODEL_DIR)


class Scripted:
    """A backend that answers each turn with the next scripted text (a version per turn)."""

    def __init__(self, tok, turns: list[str], *, versions: list[int] | None = None, stops=("=",)) -> None:
        self.tok = tok
        self.turns = list(turns)
        self.versions = versions or [0] * len(turns)
        self.stops = {tok.convert_tokens_to_ids(s) for s in stops} | {tok.eos_token_id}
        self.requests = []
        self.version = 0

    async def turn(self, request):
        self.requests.append(request)
        text = self.turns.pop(0)
        ids = self.tok(text, add_special_tokens=False)["input_ids"]
        self.version = self.versions[len(self.requests) - 1]
        finish = "stop" if ids and ids[-1] in self.stops else "length"
        return TurnOutput(ids, [-0.5] * len(ids), [self.version] * len(ids), finish)


def task(tok, text="12+34=", answer="46", max_new_tokens=6) -> PromptTask:
    return PromptTask(
        task_id=3,
        group_id=3,
        prompt_ids=tok(text)["input_ids"],
        num_samples=1,
        sampling=SamplingParams(max_new_tokens=max_new_tokens),
        dataset_index=0,
        window=0,
        answer=answer,
    )


def runner(tok, backend, factory=calculator, options=None, timeout_s=5.0, **budgets):
    host = InProcessHost(factory, EnvironmentContext(options=options or {}), timeout_s=timeout_s)
    stops = {tok.convert_tokens_to_ids("="): "="}
    return EpisodeRunner(backend, host, tok, Budgets(**budgets), stop_texts=stops)


def play(r, t):
    return asyncio.run(r.run(t, 0, base_seed=11))


def test_calculator_helpers():
    assert calculate("12+30+7") == "49" and calculate("5") == "5"
    assert calculate("") is None and calculate("1++2") is None
    assert submitted_answer("12+34=46") == "46" and submitted_answer("12+34") is None


def test_right_first_answer_is_one_turn_with_full_reward(tok):
    r = runner(tok, Scripted(tok, ["46<eos>"]))
    out = play(r, task(tok))
    assert out.reward == 1.0 and out.finish_reason == "stop"
    assert (
        out.loss_mask == [True] * 3
        and out.completion_ids == tok("46<eos>", add_special_tokens=False)["input_ids"]
    )
    assert r.counters.counts["model_tokens"] == 3 and r.counters.counts["env_tokens"] == 0


def test_wrong_answer_reposes_the_question_then_the_calculator_answers(tok):
    backend = Scripted(tok, ["460<eos>", "=", "<eos>"], versions=[4, 5, 5])
    r = runner(tok, backend)
    out = play(r, task(tok))
    enc = lambda s: tok(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    assert out.completion_ids == enc("460<eos>") + enc("<bos>12+34") + enc("=") + enc("46") + enc("<eos>")
    assert out.loss_mask == [True] * 4 + [False] * 6 + [True] + [False] * 2 + [True]
    assert out.reward == 0.5
    # Environment tokens: log-prob 0 and the version of the model token before them.
    assert out.behavior_logprobs == [-0.5] * 4 + [0.0] * 6 + [-0.5] + [0.0] * 2 + [-0.5]
    assert out.token_versions == [4] * 4 + [4] * 6 + [5] + [5] * 2 + [5]
    # Every turn decodes after the whole episode so far, as ids (never re-tokenised).
    prompt = task(tok).prompt_ids
    assert [req.ids for req in backend.requests] == [
        prompt,
        prompt + out.completion_ids[:10],
        prompt + out.completion_ids[:13],
    ]
    assert r.counters.counts["env_tokens"] == 8 and r.counters.counts["model_tokens"] == 6


def test_turn_budget_ends_a_runaway_episode(tok):
    r = runner(tok, Scripted(tok, ["1="] * 10), max_turns=3)
    out = play(r, task(tok))
    assert out.finish_reason == "length" and r.counters.counts["budget_turns"] == 1
    assert sum(out.loss_mask) == 6  # three turns of two model tokens


def test_token_budget_limits_each_turn_and_ends_the_episode(tok):
    backend = Scripted(tok, ["1=", "1=", "1"])
    r = runner(tok, backend, max_tokens=5)
    out = play(r, task(tok))
    assert [req.max_new_tokens for req in backend.requests] == [5, 3, 1]
    assert out.finish_reason == "length" and r.counters.counts["budget_tokens"] == 1


def test_context_budget(tok):
    backend = Scripted(tok, ["1=", "1="])
    r = runner(tok, backend, max_context=12)
    out = play(r, task(tok))  # prompt of 7, then 1= (2) and the value 1 (1): 10, then 2 left
    assert [req.max_new_tokens for req in backend.requests] == [5, 2]
    assert out.finish_reason == "length" and r.counters.counts["budget_context"] == 1


class Raising:
    async def reset(self, start):
        return Observation()

    async def step(self, action):
        raise RuntimeError("boom")


class Malformed(Raising):
    async def step(self, action):
        return StepResult(observation=Observation(ids=[10**9]))


class Hanging(Raising):
    async def step(self, action):
        await asyncio.Event().wait()


@pytest.mark.parametrize(
    ("env", "kind"), [(Raising, "error"), (Malformed, "bad_observation"), (Hanging, "timeout")]
)
def test_failing_environment_is_retried_then_failed_with_nothing_trained(tok, env, kind):
    backend = Scripted(tok, ["46<eos>"] * 3)
    r = runner(tok, backend, factory=lambda ctx: env(), timeout_s=0.05, max_retries=2, failure_reward=-1.0)
    out = play(r, task(tok))
    assert r.counters.counts[f"failures_{kind}"] == 3 and r.counters.counts["retried"] == 2
    assert r.counters.counts["failed"] == 1 and len(backend.requests) == 3
    assert out.finish_reason == "abort" and out.reward == -1.0 and not any(out.loss_mask)
    assert (
        len(out.completion_ids) == len(out.behavior_logprobs) == len(out.token_versions) == len(out.loss_mask)
    )
    assert r.counters.counts["failed_tokens"] == len(out.completion_ids)


def test_fail_policy_fails_at_once(tok):
    backend = Scripted(tok, ["46<eos>"])
    r = runner(tok, backend, factory=lambda ctx: Raising(), on_failure="fail", max_retries=5)
    out = play(r, task(tok))
    assert out.finish_reason == "abort" and r.counters.counts["retried"] == 0 and len(backend.requests) == 1


def test_a_failing_reset_still_gives_one_rollout(tok):
    class BadReset(Raising):
        async def reset(self, start):
            raise ValueError("no")

    r = runner(tok, Scripted(tok, []), factory=lambda ctx: BadReset(), on_failure="fail")
    out = play(r, task(tok))
    assert (
        out.completion_ids == [tok.eos_token_id] and out.loss_mask == [False] and out.finish_reason == "abort"
    )


def test_messages_need_a_chat_template(tok):
    from asyncrl.environments.render import BadObservation, ObservationRenderer

    renderer = ObservationRenderer(tok)
    with pytest.raises(BadObservation, match="chat template"):
        renderer.render(Observation(messages=[{"role": "tool", "content": "4"}]))
    with pytest.raises(BadObservation, match="one of"):
        renderer.render(Observation(text="1", ids=[1]))
    assert renderer.render(Observation(ids=[5, 6])) == [5, 6] and renderer.render(Observation()) == []


def test_messages_render_as_the_templates_continuation(tok):
    """A tool message after a model turn that ended with its eos: the template's text after
    that eos, up to the next assistant turn's start (the model's own eos is not repeated)."""
    from asyncrl.environments.render import ObservationRenderer

    chat = tok.__class__.from_pretrained(tok.name_or_path)
    chat.chat_template = (
        "{% for m in messages %}[{{ m.role }}]{{ m.content }}{{ eos_token }}\n{% endfor %}"
        "{% if add_generation_prompt %}[assistant]{% endif %}"
    )
    renderer = ObservationRenderer(chat)
    text = renderer.continuation_text([{"role": "tool", "content": "46"}])
    assert text == "\n[tool]46<eos>\n[assistant]"
    assert (
        renderer.render(Observation(messages=[{"role": "tool", "content": "46"}]))
        == chat(text, add_special_tokens=False)["input_ids"]
    )
