"""The calculator agent as an asyncrl environment (a worked example; docs/environments.md).

Select it with `--set env.kind=examples.calculator_agent.environment:calculator` (from the
repository root, as config.toml does), or `pip install examples/calculator_agent` and
`--set env.kind=calculator`. It runs on any generator backend (torch, sglang): the episode runner
decodes the model's turns and appends what this environment answers, as token ids, masked.

The task is the built-in addition prompt `a+b=`. A model turn ends at `<eos>` or at `=`
(`env.stop_tokens = ["="]`):

  `=`      the model called the calculator: it evaluates what was written since the previous `=`
           of the answer (digits joined by `+`) and the value's digits are appended; the model
           goes on writing after them (a new turn of the same answer).
  `<eos>`  the model submits its answer (the digits after the answer's last `=`). A wrong answer
           with answers left makes the environment re-pose the question: `<bos>a+b` (no `=`).
  length   a turn that ran out of tokens (sampling.max_new_tokens) ends the episode, reward 0.

Reward: 1 for a correct first answer, `retry_reward` for a correct later one, else 0.
Options (`env.options.*`): `max_answers` (2), `retry_reward` (0.5).
"""

from __future__ import annotations

import re

from asyncrl.environments.base import Action, EnvironmentContext, EpisodeStart, Observation, StepResult

_EXPRESSION = re.compile(r"\d+(\+\d+)*")
OPTIONS = {"max_answers": int, "retry_reward": float}


def calculate(expression: str) -> str | None:
    """The calculator: the decimal value of `12+30+7`-style sums, None for anything else."""
    if not _EXPRESSION.fullmatch(expression):
        return None
    return str(sum(int(term) for term in expression.split("+")))


def submitted_answer(answer_text: str) -> str | None:
    """The answer a turn submits: the digits after its last `=`, None without one."""
    _, eq, tail = answer_text.rpartition("=")
    if not eq or not tail.isdigit():
        return None
    return tail


class CalculatorEnv:
    """One episode's state: the question, the current answer's text so far, answers given."""

    def __init__(self, *, max_answers: int = 2, retry_reward: float = 0.5) -> None:
        if max_answers < 1:
            raise ValueError(f"env.options.max_answers must be >= 1, got {max_answers}")
        self.max_answers = max_answers
        self.retry_reward = retry_reward
        self.question = ""
        self.answer = ""
        self.text = ""  # the current answer: the question, '=', what the model and calculator wrote
        self.answers = 0

    async def reset(self, start: EpisodeStart) -> Observation:
        self.question = start.prompt.rstrip().removesuffix("=")
        self.answer = start.answer
        self.text = self.question + "="  # the first answer starts after the prompt's '='
        self.answers = 0
        return Observation()

    async def step(self, action: Action) -> StepResult:
        written = action.text.removesuffix(action.stop) if action.stop else action.text
        self.text += written
        if action.finish_reason == "length":
            return StepResult(done=True)
        if action.stop == "=":
            self.text += "="
            value = calculate(self.text[:-1].rpartition("=")[2])
            if value is None:
                return StepResult()  # not a sum: no value, the model writes on
            self.text += value
            return StepResult(observation=Observation(text=value), info={"calculator_calls": 1})
        self.answers += 1  # <eos>: the answer is submitted
        if submitted_answer(self.text) == self.answer:
            return StepResult(reward=1.0 if self.answers == 1 else self.retry_reward, done=True)
        if self.answers >= self.max_answers:
            return StepResult(done=True)
        self.text = self.question
        return StepResult(observation=Observation(text="<bos>" + self.question))


def calculator(ctx: EnvironmentContext) -> CalculatorEnv:
    """The environment factory (`env.kind`): options checked, one environment per episode."""
    unknown = sorted(set(ctx.options) - set(OPTIONS))
    if unknown:
        raise ValueError(f"{unknown} are not calculator options (env.options); valid: {', '.join(OPTIONS)}")
    return CalculatorEnv(**{k: OPTIONS[k](v) for k, v in ctx.options.items()})
