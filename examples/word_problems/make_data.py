"""Write the word-problem data set: data/train.jsonl and data/test.jsonl (deterministic, disjoint).

Each row is one short multi-step arithmetic word problem:

    {"question": "Mia has 23 shells. She finds 9, then gives away 4. How many now?",
     "answer": "28", "steps": 2, "numbers": [23, 9, -4]}

`steps` is the number of operations (2 or 3, each + or -), `numbers` the start amount followed by
the signed changes; every running total stays within 0..60. `worked_solution(row)` is the answer a
careful solver writes (`23+9=32,32-4=28 \\boxed{28}`); build_model.py fine-tunes on it.

    python examples/word_problems/make_data.py            # from the repository root
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

HERE = Path(__file__).resolve().parent

NAMES = {
    "she": ["Ann", "Cara", "Eva", "Gia", "Ivy", "Kim", "Mia", "Pia", "Rosa", "Tara", "Zoe", "Lily"],
    "he": ["Ben", "Dan", "Finn", "Hugo", "Jack", "Leo", "Nick", "Omar", "Sam", "Tom", "Max", "Raj"],
}
OBJECTS = ["apples", "pens", "books", "coins", "cards", "eggs", "stamps", "shells", "marbles", "cookies"]
# Present and past forms of the verbs of each sign.
GAIN = [("buys", "bought"), ("finds", "found"), ("gets", "got"), ("wins", "won"), ("picks up", "picked up")]
LOSS = [
    ("gives away", "gave away"),
    ("loses", "lost"),
    ("sells", "sold"),
    ("uses", "used"),
    ("drops", "dropped"),
]

MAX_START = 40  # the start amount is 5..MAX_START
MAX_VALUE = 60  # every running total stays in 0..MAX_VALUE
MAX_CHANGE = 9  # each change is 1..MAX_CHANGE


def _changes(rng: random.Random, start: int, steps: int) -> list[int] | None:
    """`steps` signed changes keeping the running total in 0..MAX_VALUE, both signs present."""
    total, out = start, []
    for _ in range(steps):
        sign = rng.choice((1, -1))
        room = MAX_VALUE - total if sign > 0 else total
        if room < 1:
            sign, room = -sign, (total if sign > 0 else MAX_VALUE - total)
        amount = rng.randint(1, min(MAX_CHANGE, room))
        total += sign * amount
        out.append(sign * amount)
    if all(c > 0 for c in out) or all(c < 0 for c in out):
        return None
    return out


def _verb(rng: random.Random, change: int, past: bool) -> str:
    present, past_form = rng.choice(GAIN if change > 0 else LOSS)
    return f"{past_form if past else present} {abs(change)}"


def _join(parts: list[str], last: str = ", then") -> str:
    """'a, then b' or 'a, b, then c' (`last` joins the last part)."""
    return ", ".join(parts[:-1]) + f"{last} {parts[-1]}"


def make_question(rng: random.Random, start: int, changes: list[int]) -> str:
    pronoun = rng.choice(("she", "he"))
    name = rng.choice(NAMES[pronoun])
    obj = rng.choice(OBJECTS)
    template = rng.randrange(3)
    if template == 0:
        verbs = _join([_verb(rng, c, past=False) for c in changes])
        return f"{name} has {start} {obj}. {pronoun.capitalize()} {verbs}. How many now?"
    verbs = _join([_verb(rng, c, past=True) for c in changes], last=" and")
    if template == 1:
        return f"{name} had {start} {obj}, {verbs}. How many are left?"
    return f"At first {name} had {start} {obj}. Then {pronoun} {verbs}. How many now?"


def make_row(rng: random.Random) -> dict:
    steps = rng.choice((2, 3))
    while True:
        start = rng.randint(5, MAX_START)
        changes = _changes(rng, start, steps)
        if changes is not None:
            break
    return {
        "question": make_question(rng, start, changes),
        "answer": str(start + sum(changes)),
        "steps": steps,
        "numbers": [start, *changes],
    }


def intermediates(row: dict) -> list[int]:
    """The running totals after each operation; the last is the answer."""
    total, out = row["numbers"][0], []
    for change in row["numbers"][1:]:
        total += change
        out.append(total)
    return out


def worked_solution(row: dict, boxed: str | None = None) -> str:
    """`23+9=32,32-4=28 \\boxed{28}`; `boxed` overrides what the box holds (a sloppy solver)."""
    total, lines = row["numbers"][0], []
    for change in row["numbers"][1:]:
        new = total + change
        lines.append(f"{total}{'+' if change > 0 else '-'}{abs(change)}={new}")
        total = new
    return ",".join(lines) + f" \\boxed{{{total if boxed is None else boxed}}}"


def generate(num_train: int, num_test: int, seed: int) -> tuple[list[dict], list[dict]]:
    """Test rows first (distinct questions), then train rows whose arithmetic (numbers) never
    matches a test row's, so the two sets share no problem even with a different wording."""
    rng = random.Random(f"word-problems:{seed}")
    test, seen_q, test_numbers = [], set(), set()
    while len(test) < num_test:
        row = make_row(rng)
        if row["question"] not in seen_q:
            seen_q.add(row["question"])
            test_numbers.add(tuple(row["numbers"]))
            test.append(row)
    train = []
    while len(train) < num_train:
        row = make_row(rng)
        if row["question"] not in seen_q and tuple(row["numbers"]) not in test_numbers:
            seen_q.add(row["question"])
            train.append(row)
    return train, test


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def read_jsonl(path: Path) -> list[dict]:
    with path.open() as f:
        return [json.loads(line) for line in f if line.strip()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-train", type=int, default=4000)
    parser.add_argument("--num-test", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=HERE / "data")
    args = parser.parse_args()
    train, test = generate(args.num_train, args.num_test, args.seed)
    write_jsonl(args.out / "train.jsonl", train)
    write_jsonl(args.out / "test.jsonl", test)
    lengths = [len(r["question"]) for r in train + test]
    print(
        f"wrote {len(train)} train and {len(test)} test rows to {args.out} "
        f"(question length {min(lengths)}-{max(lengths)} chars)"
    )


if __name__ == "__main__":
    main()
