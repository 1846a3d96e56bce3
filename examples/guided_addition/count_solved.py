"""Per-prompt outcomes of runs of this example, from their metrics.jsonl task records.

Also the mean log-probability of the held-out answers (answer then eos, data/test.jsonl) under the
initial and the final model: a finer signal than accuracy, which stays 0 on three-digit sums.

A prompt is *never solved at the start* when its first two groups had no correct unguided sample,
and *became solved* when a later group of it had one (guided samples never count: a task record's
`guided_reward_sum` is taken out of its reward sum). Prints, per run and per kind of prompt
(two-digit or three-digit first operand), how many prompts were never solved at the start, how
many of those became solved, and the guided and unguided samples' counts and mean rewards.

    python examples/guided_addition/count_solved.py RUN_DIR [RUN_DIR ...]
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path

from asyncrl.config_load import config_from_tree
from asyncrl.models.default import DEFAULT_MODEL_DIR
from asyncrl.tasks.base import make_task


def outcomes(run: Path) -> dict[str, dict[str, float]]:
    task = make_task(config_from_tree(json.loads((run / "config.json").read_text()), lint=False).task)
    groups: dict[str, list[float]] = defaultdict(list)  # prompt -> unguided successes per group
    kinds: dict[str, str] = {}
    samples = {"guided": [0, 0.0], "unguided": [0, 0.0]}
    for line in (run / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if rec.get("type") != "task":
            continue
        prompt = task.train_problem(rec["dataset_index"]).prompt
        kinds[prompt] = "3-digit" if len(prompt.split("+")[0]) == 3 else "2-digit"
        total = (
            sum(rec["reward_sums"].values())
            if rec["reward_sums"]
            else rec["mean_reward"] * rec["num_trajectories"]
        )
        guided, guided_sum = rec.get("num_guided", 0), rec.get("guided_reward_sum", 0.0)
        groups[prompt].append(total - guided_sum)
        samples["guided"][0] += guided
        samples["guided"][1] += guided_sum
        samples["unguided"][0] += rec["num_trajectories"] - guided
        samples["unguided"][1] += total - guided_sum
    out: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for prompt, successes in groups.items():
        row = out[kinds[prompt]]
        row["prompts"] += 1
        if len(successes) > 2 and not any(successes[:2]):
            row["never_solved_at_start"] += 1
            row["became_solved"] += any(successes[2:])
    for kind, (n, total) in samples.items():
        out["samples"][f"{kind}_n"] = n
        out["samples"][f"{kind}_mean_reward"] = round(total / n, 3) if n else float("nan")
    return out


def answer_logprob(model_dir: str | Path, rows: list[dict]) -> float:
    """Mean over `rows` of log p(answer, eos | prompt) under the model in `model_dir`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    total = 0.0
    for row in rows:
        prompt = tok(row["prompt"])["input_ids"]
        answer = tok(row["answer"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        ids = torch.tensor([prompt + answer])
        with torch.no_grad():
            logp = model(ids).logits[0, :-1].float().log_softmax(-1)
        targets = ids[0, len(prompt) :]
        total += float(logp[len(prompt) - 1 :].gather(1, targets[:, None]).sum())
    return total / len(rows)


def main() -> None:
    here = Path(__file__).parent
    rows = [json.loads(line) for line in (here / "data" / "test.jsonl").read_text().splitlines()]
    for run in map(Path, sys.argv[1:]):
        out = {k: dict(v) for k, v in outcomes(run).items()}
        initial = json.loads((run / "config.json").read_text())["model"]["path"] or DEFAULT_MODEL_DIR
        out["test_answer_logprob"] = {
            "initial": round(answer_logprob(initial, rows), 3),
            "final": round(answer_logprob(run / "final_model", rows), 3),
        }
        print(run.name, json.dumps(out))


if __name__ == "__main__":
    main()
