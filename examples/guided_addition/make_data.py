"""Writes this example's data (deterministic): two-digit sums the default model mostly solves, and
three-digit ones (100..199 + 0..99) it never solves (0 of 8 samples on each of 50 such prompts).

    python examples/guided_addition/make_data.py
"""

from __future__ import annotations

import json
import random
from pathlib import Path


def rows(rng: random.Random, count: int, first: tuple[int, int]) -> list[dict]:
    out = []
    for _ in range(count):
        a, b = rng.randint(*first), rng.randint(0, 99)
        out.append({"prompt": f"{a}+{b}=", "answer": str(a + b), "solution": str(a + b)})
    return out


def main() -> None:
    here = Path(__file__).parent / "data"
    here.mkdir(exist_ok=True)
    rng = random.Random(37)
    train = rows(rng, 48, (10, 99)) + rows(rng, 48, (100, 199))
    test = rows(rng, 100, (100, 199))
    for name, data in (("train", train), ("test", test)):
        (here / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in data))


if __name__ == "__main__":
    main()
