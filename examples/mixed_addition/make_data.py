"""The datasets of docs/opd.md's teacher-cache and several-teachers measurements (seeded; the
shipped files are reproduced byte for byte):

* data/train.jsonl: 64 addition problems `a+b=` (a, b in 0..99), each with its sum as the answer
  and a domain, "carry" when the units digits carry and "plain" otherwise (the cache's epochs);
* data/mixed_train.jsonl (512 rows) and data/mixed_test.jsonl (200 rows, no prompt of the
  training file): half two-operand problems `a+b=` (domain "two"), half three-operand ones
  `a+b+c=` (domain "three"), which the shipped student never saw: the mixed task of the
  several-teachers table (`opd.route_field = "domain"`);
* data/mixed2_train.jsonl (512 rows) and data/mixed2_test.jsonl (200 rows, no prompt of the
  training file): half `a+b=` (domain "two"), half two-operand subtractions `a-b=` with a >= b
  (domain "sub"), which the shipped student does not solve but a teacher of its size learns by a
  short SFT: the mixed task of the routed table that tests routing.

    python examples/mixed_addition/make_data.py
"""

from __future__ import annotations

import json
import random
from pathlib import Path

HERE = Path(__file__).resolve().parent
NUM_ROWS = 64
SEED = 0


def rows(num: int = NUM_ROWS, seed: int = SEED) -> list[dict[str, str]]:
    rng = random.Random(seed)
    out = []
    for _ in range(num):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        domain = "carry" if (a % 10 + b % 10) >= 10 else "plain"
        out.append({"prompt": f"{a}+{b}=", "answer": str(a + b), "domain": domain})
    return out


def mixed_rows(num_train: int = 512, num_test: int = 200, seed: int = 1) -> tuple[list[dict], list[dict]]:
    """(train, test): alternating two- and three-operand problems, each prompt once."""
    rng = random.Random(seed)
    seen: set[str] = set()
    out: list[dict[str, str]] = []
    while len(out) < num_train + num_test:
        operands = [rng.randint(0, 99) for _ in range(2 if len(out) % 2 == 0 else 3)]
        prompt = "+".join(map(str, operands)) + "="
        if prompt in seen:
            continue
        seen.add(prompt)
        out.append(
            {
                "prompt": prompt,
                "answer": str(sum(operands)),
                "domain": "two" if len(operands) == 2 else "three",
            }
        )
    return out[:num_train], out[num_train:]


def mixed2_rows(num_train: int = 512, num_test: int = 200, seed: int = 2) -> tuple[list[dict], list[dict]]:
    """(train, test): alternating `a+b=` and `a-b=` (a >= b) problems, each prompt once."""
    rng = random.Random(seed)
    seen: set[str] = set()
    out: list[dict[str, str]] = []
    while len(out) < num_train + num_test:
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        domain = "two" if len(out) % 2 == 0 else "sub"
        if domain == "sub":
            a, b = max(a, b), min(a, b)
        prompt = f"{a}+{b}=" if domain == "two" else f"{a}-{b}="
        if prompt in seen:
            continue
        seen.add(prompt)
        out.append({"prompt": prompt, "answer": str(a + b if domain == "two" else a - b), "domain": domain})
    return out[:num_train], out[num_train:]


def write(name: str, table: list[dict]) -> None:
    path = HERE / "data" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in table))
    print(f"wrote {path}")


def main() -> None:
    write("train.jsonl", rows())
    train, test = mixed_rows()
    write("mixed_train.jsonl", train)
    write("mixed_test.jsonl", test)
    train, test = mixed2_rows()
    write("mixed2_train.jsonl", train)
    write("mixed2_test.jsonl", test)


if __name__ == "__main__":
    main()
