"""Write this example's data: short arithmetic word problems with a worked solution each.

    python examples/smollm2_arithmetic/make_data.py     # data/train.jsonl, data/test.jsonl

Seeded, so the shipped files are reproduced byte for byte. One or two operations on small numbers
(every total within 0-50): the 135M instruct model solves some of them when it reads them, and
boxes few answers, so RL has both a format and a correctness to improve. Each row:

    {"question": "...", "answer": "17", "solution": "12 + 5 = 17. The answer is \\boxed{17}.", "steps": 1}

`solution` is the privileged context of self-distillation (opd.teacher = "self"). Train and test
share no question.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

NAMES = ["Sam", "Mia", "Leo", "Ava", "Noah", "Zoe", "Omar", "Lily", "Ben", "Ivy", "Max", "Ella"]
THINGS = ["apples", "pens", "cards", "stickers", "marbles", "books", "coins", "shells"]
GAIN = ["buys {n} more", "finds {n} more", "gets {n} more", "is given {n} more"]
LOSS = ["gives away {n}", "loses {n}", "uses {n}", "sells {n}"]


def problem(rng: random.Random) -> dict:
    """One problem: a start amount, then one or two changes, every running total within 0-50."""
    name, thing = rng.choice(NAMES), rng.choice(THINGS)
    total = rng.randint(3, 30)
    start, clauses, work = total, [], []
    for _ in range(rng.choice((1, 1, 2))):
        n = rng.randint(1, 9)
        if total - n >= 0 and (rng.random() < 0.5 or total + n > 50):
            clauses.append(rng.choice(LOSS).format(n=n))
            work.append(f"{total} - {n} = {total - n}")
            total -= n
        else:
            clauses.append(rng.choice(GAIN).format(n=n))
            work.append(f"{total} + {n} = {total + n}")
            total += n
    changes = clauses[0] if len(clauses) == 1 else f"{clauses[0]}, then {clauses[1]}"
    question = f"{name} has {start} {thing}. {name} {changes}. How many {thing} does {name} have now?"
    solution = f"{', '.join(work)}. The answer is \\boxed{{{total}}}."
    return {"question": question, "answer": str(total), "solution": solution, "steps": len(work)}


def make(seed: int, num_train: int, num_test: int) -> tuple[list[dict], list[dict]]:
    rng = random.Random(seed)
    seen: set[str] = set()
    rows: list[dict] = []
    while len(rows) < num_train + num_test:
        row = problem(rng)
        if row["question"] not in seen:
            seen.add(row["question"])
            rows.append(row)
    return rows[num_test:], rows[:num_test]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--train", type=int, default=2000)
    parser.add_argument("--test", type=int, default=200)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "data")
    args = parser.parse_args()
    train, test = make(args.seed, args.train, args.test)
    args.out.mkdir(parents=True, exist_ok=True)
    for name, rows in (("train", train), ("test", test)):
        with open(args.out / f"{name}.jsonl", "w") as fh:
            fh.writelines(json.dumps(r) + "\n" for r in rows)
    print(f"wrote {len(train)} training and {len(test)} test rows to {args.out}")


if __name__ == "__main__":
    main()
