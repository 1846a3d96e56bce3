"""The built-in verifiable task: two-number addition with an exact verifier.

Prompts are `"<a>+<b>="`, the answer is the decimal sum. The scheduler owns the prompt dataset;
generators score completions with `AdditionReward`.

The warm-start corpus comes from a deliberately imperfect demonstrator that forgets the carry on
most problems that need one. A model fine-tuned on it knows how to carry (it has seen it) but
prefers not to, so its greedy accuracy on carry problems is low while correct answers keep real
probability mass: the situation where RL with an exact reward helps most, and fast.
"""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Problem:
    index: int
    prompt: str
    answer: str


def make_problem(index: int, *, seed: int, max_operand: int) -> Problem:
    """Problem number `index` of the stream for `seed`; the same (seed, index) gives the same problem."""
    rng = random.Random(f"{seed}:{index}")
    a = rng.randint(0, max_operand)
    b = rng.randint(0, max_operand)
    return Problem(index=index, prompt=f"{a}+{b}=", answer=str(a + b))


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
                return Problem(index=index, prompt=p.prompt, answer=p.answer)
            attempt += 1


def needs_carry(a: int, b: int) -> bool:
    return any(x + y >= 10 for x, y in zip(_digits(a), _digits(b), strict=False))


def _digits(n: int) -> list[int]:
    out = []
    while True:
        out.append(n % 10)
        n //= 10
        if n == 0:
            return out


def forgetful_sum(a: int, b: int) -> int:
    """Digit-wise sum that drops every carry (the demonstrator's mistake)."""
    da, db = _digits(a), _digits(b)
    width = max(len(da), len(db))
    da += [0] * (width - len(da))
    db += [0] * (width - len(db))
    return int("".join(str((x + y) % 10) for x, y in zip(reversed(da), reversed(db), strict=True)))


def demonstrations(
    count: int, *, seed: int, max_operand: int, forget_carry_prob: float, exclude: frozenset[str] = frozenset()
) -> list[tuple[str, str]]:
    """(prompt, completion) pairs from the forgetful demonstrator, for warm-start SFT.
    Prompts in `exclude` (the held-out evaluation set) are never demonstrated."""
    rng = random.Random(f"demo:{seed}")
    pairs = []
    while len(pairs) < count:
        a = rng.randint(0, max_operand)
        b = rng.randint(0, max_operand)
        if f"{a}+{b}=" in exclude:
            continue
        if needs_carry(a, b) and rng.random() < forget_carry_prob:
            answer = forgetful_sum(a, b)
        else:
            answer = a + b
        pairs.append((f"{a}+{b}=", str(answer)))
    return pairs


class AdditionReward:
    """Exact verifier: 1.0 when the completion (up to end-of-sequence) equals the answer, else 0.0."""

    name = "addition"

    def __call__(self, prompt: str, completion: str, answer: str) -> float:
        return 1.0 if completion.strip() == answer else 0.0
