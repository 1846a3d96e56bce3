"""The built-in verifiable task: two-number addition with an exact verifier.

Prompts are `"<a>+<b>="`, the answer is the decimal sum, rendered as raw text. Registered as the
task `addition` (entry point `asyncrl.tasks`); the launcher, generators and evaluation reach it
only through the `Task` seam (`tasks/base.py`). Its privileged prompt (self-distillation,
`privileged_render`) is the problem worked once, then asked again: `<bos>12+39=51<eos>12+39=`.

The warm-start corpus ends with demonstrations from a deliberately sloppy teacher that usually
appends a stray 0 to its answer (`12+39=510`). A model fine-tuned on it can add (it learned from
correct demonstrations first) but has picked up the habit, so its greedy accuracy is low while
the correct, cleanly ended answers keep real probability mass: RL with the exact reward has to
discover which of its habits cost reward, which is what it is good at.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from asyncrl.tasks.base import Problem, raw_prompt_ids


def make_problem(index: int, *, seed: int, max_operand: int) -> Problem:
    """Problem number `index` of the stream for `seed`; the same (seed, index) gives the same problem."""
    rng = random.Random(f"{seed}:{index}")
    a = rng.randint(0, max_operand)
    b = rng.randint(0, max_operand)
    return Problem(index=index, prompt=f"{a}+{b}=", answer=str(a + b), solution=str(a + b))


def problems(start: int, count: int, *, seed: int, max_operand: int) -> list[Problem]:
    return [make_problem(i, seed=seed, max_operand=max_operand) for i in range(start, start + count)]


class AdditionTask:
    """Training prompts and a held-out evaluation set that never appears in training.

    Held-out problems are the first `num_eval` distinct problems of the `eval_seed` stream; the
    training stream (`seed`) skips any prompt in that set, deterministically.
    """

    def __init__(self, *, seed: int, eval_seed: int, num_eval: int, max_operand: int) -> None:
        possible = (max_operand + 1) ** 2
        if num_eval > possible // 2:
            raise ValueError(
                f"task.num_eval={num_eval} would hold out more than half of the {possible} possible "
                f"problems for max_operand={max_operand}; lower num_eval or raise max_operand"
            )
        self.seed = seed
        self.max_operand = max_operand
        held: dict[str, Problem] = {}
        i = 0
        while len(held) < num_eval:
            p = make_problem(i, seed=eval_seed, max_operand=max_operand)
            held.setdefault(p.prompt, p)
            i += 1
        self.eval_problems = list(held.values())
        self.held_out = frozenset(held)

    def train_problem(self, index: int) -> Problem:
        attempt = 0
        while True:
            p = make_problem(index, seed=self.seed * 1_000_003 + attempt, max_operand=self.max_operand)
            if p.prompt not in self.held_out:
                return Problem(index=index, prompt=p.prompt, answer=p.answer, solution=p.solution)
            attempt += 1

    def render(self, problems: Sequence[Problem], tokenizer: Any) -> list[list[int]]:
        return raw_prompt_ids(problems, tokenizer)

    def privileged_render(self, problems: Sequence[Problem], tokenizer: Any) -> list[list[int]]:
        """The worked answer in context: each problem solved once and ended (eos), then asked
        again, so the completion follows the same prompt text: `<bos>12+39=51<eos>12+39=`."""
        if not problems:
            return []
        worked = raw_prompt_ids(
            [replace(p, prompt=p.prompt + (p.solution or p.answer)) for p in problems], tokenizer
        )
        asked = tokenizer([p.prompt for p in problems], add_special_tokens=False)["input_ids"]
        return [w + [tokenizer.eos_token_id] + a for w, a in zip(worked, asked, strict=True)]

    def score(self, prompt: str, completion: str, answer: str) -> float:
        return exact_match(completion, answer)


def addition_task(section: Any) -> AdditionTask:
    """The registered factory: the `addition` task from the `task` config section."""
    return AdditionTask(
        seed=section.seed,
        eval_seed=section.eval_seed,
        num_eval=section.num_eval,
        max_operand=section.max_operand,
    )


def demonstrations(
    count: int, *, seed: int, max_operand: int, stray_zero_prob: float, exclude: frozenset[str] = frozenset()
) -> list[tuple[str, str]]:
    """(prompt, completion) pairs for warm-start SFT. With probability `stray_zero_prob` the
    demonstrator appends a stray 0 to the sum (`12+39=510`): a systematic slip. Prompts in
    `exclude` (the held-out evaluation set) are never demonstrated."""
    rng = random.Random(f"demo:{seed}")
    pairs = []
    while len(pairs) < count:
        a = rng.randint(0, max_operand)
        b = rng.randint(0, max_operand)
        if f"{a}+{b}=" in exclude:
            continue
        answer = str(a + b)
        if rng.random() < stray_zero_prob:
            answer += "0"
        pairs.append((f"{a}+{b}=", answer))
    return pairs


def exact_match(completion: str, answer: str) -> float:
    return 1.0 if completion.strip() == answer else 0.0
