"""Builds the two domain teachers of docs/opd.md's several-teachers table from the shipped student
(asyncrl/assets/default_model), by SFT on correct demonstrations of one domain each (the shipped
teacher's recipe, `tasks/arithmetic_model.py: TeacherSettings`, on other pairs):

* <out>/two: two-operand sums `a+b=` only (what the shipped teacher knows);
* <out>/three: three-operand sums `a+b+c=` only, which the student has never seen.

Demonstrations never include a prompt of data/mixed_test.jsonl. Prints each model's greedy accuracy
on each domain of the test file (and the student's).

    python examples/mixed_addition/build_teachers.py --out /tmp/mixed_teachers
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path
from types import SimpleNamespace

HERE = Path(__file__).resolve().parent


def demonstrations(num_operands: int, count: int, *, seed: int, exclude: set[str]) -> list[tuple[str, str]]:
    rng = random.Random(seed)
    out = []
    while len(out) < count:
        operands = [rng.randint(0, 99) for _ in range(num_operands)]
        prompt = "+".join(map(str, operands)) + "="
        if prompt not in exclude:
            out.append((prompt, str(sum(operands))))
    return out


def domain_accuracy(model_dir: Path, test: list[dict]) -> dict[str, float]:
    """Greedy exact-match accuracy per domain of `test` (rows of data/mixed_test.jsonl)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from asyncrl.models.sft import greedy_completions
    from asyncrl.tasks.base import Problem, raw_prompt_ids

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = {}
    for domain in sorted({r["domain"] for r in test}):
        rows = [r for r in test if r["domain"] == domain]
        task = SimpleNamespace(
            eval_problems=[
                Problem(index=i, prompt=r["prompt"], answer=r["answer"]) for i, r in enumerate(rows)
            ],
            render=raw_prompt_ids,
        )
        done = greedy_completions(model, tokenizer, task, max_new_tokens=5)
        out[domain] = sum(c.text.strip() == p.answer for p, c in done) / len(done)
    return out


def main() -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from asyncrl.models.default import DEFAULT_MODEL_DIR
    from asyncrl.models.sft import sft
    from asyncrl.tasks.arithmetic_model import TeacherSettings

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=HERE / "teachers")
    parser.add_argument("--steps", type=int, default=TeacherSettings().steps)
    args = parser.parse_args()
    settings = TeacherSettings()
    test = [json.loads(x) for x in (HERE / "data" / "mixed_test.jsonl").read_text().splitlines()]
    exclude = {r["prompt"] for r in test}
    print("student", domain_accuracy(DEFAULT_MODEL_DIR, test), flush=True)
    for name, operands in (("two", 2), ("three", 3)):
        torch.manual_seed(settings.seed)
        tokenizer = AutoTokenizer.from_pretrained(DEFAULT_MODEL_DIR)
        model = AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL_DIR, dtype=torch.float32)
        pairs = demonstrations(operands, settings.num_demonstrations, seed=settings.seed, exclude=exclude)
        recipe = {"batch_size": settings.batch_size, "lr": settings.lr, "seed": settings.seed}
        sft(model, tokenizer, pairs, steps=args.steps, **recipe)
        out = args.out / name
        out.mkdir(parents=True, exist_ok=True)
        tokenizer.save_pretrained(out)
        model.save_pretrained(out, safe_serialization=True)
        print(name, domain_accuracy(out, test), flush=True)


if __name__ == "__main__":
    main()
