"""The torch generator's sampling cost: ours against Hugging Face `generate`, continuous vs batch.

    asyncrl bench generate                  # 1 and 2 threads, 7 interleaved repeats
    asyncrl bench generate --json           # one JSON object on stdout
    asyncrl bench generate --threads 1 --repeats 15 --max-batch-groups 4
    asyncrl bench generate --simulate       # forwards per sample of each refill rule

Workloads (the shipped model, asyncrl/assets/default_model; prompts of the addition task, the
default job's batch: 32 groups x 8 samples, seeds as a run draws them):
  default    sampling.max_new_tokens = 5, temperature 1.0 (answers 3-5 tokens)
  long_tail  max_new_tokens = 48, temperature 3.0: most answers 3-5 tokens, a few 10-40

Variants, each timed on the whole workload, interleaved round by round, medians of the repeats:
  ours        `asyncrl.models.sampling.generate` on all 256 prompts in one batch (behavior
              log-probs included)
  hf          `model.generate(do_sample=True, temperature=..., max_new_tokens=..., top_k=0,
              top_p=1.0)` on the same left-padded batch (token ids only; top_k=0 and top_p=1 switch
              its warpers off, so it samples from the same distribution as ours)
  batch       the torch generator as the service runs it (`TorchGenerator.stream_sync` over a
              feed: sampling, rollouts, the task's verifier) with generators.batching = "batch",
              max_batch_groups groups (16 by default: 128 samples) at a time
  continuous  the same with generators.batching = "continuous" (max_batch_groups x 8 slots,
              refilled when `asyncrl/generators/refill.py` says so)
For batch and continuous also: the median and 90th percentile of the time from the start to each
sample's hand-over (what the learner waits for). For ours and hf also the forwards (sampled
positions: the batch's longest sample sets them, and the two draw different samples) and the time
per forward, the fair comparison when their longest samples differ (long_tail).
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time

import torch

WORKLOADS = {
    "default": {"max_new_tokens": 5, "temperature": 1.0},
    "long_tail": {"max_new_tokens": 48, "temperature": 4.0},
}
GROUPS, SAMPLES = 32, 8
MAX_BATCH_GROUPS = 16  # generators.max_batch_groups (the default); --max-batch-groups


def build(threads: int, max_batch_groups: int = MAX_BATCH_GROUPS):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from asyncrl.config_sections import SamplingConfig, TaskConfig
    from asyncrl.generators.base import GeneratorContext
    from asyncrl.generators.torch_gen import TorchGenerator
    from asyncrl.models.default import DEFAULT_MODEL_DIR
    from asyncrl.tasks.base import make_task

    tok = AutoTokenizer.from_pretrained(DEFAULT_MODEL_DIR)
    model = AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL_DIR).eval()
    task = make_task(TaskConfig())
    problems = [task.train_problem(j) for j in range(GROUPS)]
    prompts = task.render(problems, tok)
    gens = {}
    for batching in ("batch", "continuous"):
        gen = TorchGenerator()
        gen.setup(
            GeneratorContext(
                generator_id=batching,
                model_path=str(DEFAULT_MODEL_DIR),
                sampling=SamplingConfig(),
                task=TaskConfig(),
                seed=0,
                threads=threads,
                batching=batching,
                max_batch_groups=max_batch_groups,
            )
        )
        gens[batching] = gen
    return tok, model, problems, prompts, gens


def tasks_of(problems, prompts, params):
    from asyncrl.messages import PromptTask

    return [
        PromptTask(
            task_id=j,
            group_id=j,
            prompt_ids=ids,
            num_samples=SAMPLES,
            sampling=params,
            dataset_index=j,
            window=0,
            answer=p.answer,
        )
        for j, (p, ids) in enumerate(zip(problems, prompts, strict=True))
    ]


def run_ours(model, tok, flat, seeds, w):
    from asyncrl.models.sampling import generate

    with torch.no_grad():
        out = generate(
            model, flat, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, seeds=seeds, **w
        )
    return {"forwards": out.num_decode_steps}  # the prefill and a decode step per token but the last


def run_hf(model, tok, ids_BL, attn_BL, w):
    with torch.no_grad():
        out = model.generate(
            input_ids=ids_BL,
            attention_mask=attn_BL,
            do_sample=True,
            temperature=w["temperature"],
            max_new_tokens=w["max_new_tokens"],
            top_k=0,
            top_p=1.0,
            pad_token_id=tok.pad_token_id,
            eos_token_id=tok.eos_token_id,
        )
    return {"forwards": out.shape[1] - ids_BL.shape[1]}  # as ours: one per sampled position


def run_stream(gen, tasks) -> dict:
    """The generator's own path, on this thread; per-sample hand-over times."""
    from asyncrl.generators.feed import SampleFeed

    feed = SampleFeed()
    feed.put(tasks)
    times: list[float] = []
    start = time.perf_counter()

    def emit(rollouts) -> None:
        now = time.perf_counter() - start
        times.extend(now for _ in rollouts)

    gen.stream_sync(feed, emit, threading.Event())
    assert len(times) == len(tasks) * SAMPLES
    times.sort()
    return {"p50_handover_s": times[len(times) // 2], "p90_handover_s": times[int(0.9 * len(times))]}


def measure(threads: int, repeats: int, max_batch_groups: int = MAX_BATCH_GROUPS) -> dict:
    from asyncrl.messages import SamplingParams
    from asyncrl.models.sampling import left_pad, sample_seed

    torch.set_num_threads(threads)
    tok, model, problems, prompts, gens = build(threads, max_batch_groups)
    torch.set_num_threads(threads)  # setup() set it too
    flat = [p for p in prompts for _ in range(SAMPLES)]
    seeds = [sample_seed(0, j, k) for j in range(GROUPS) for k in range(SAMPLES)]
    ids_BL, attn_BL = left_pad(flat, tok.pad_token_id)
    result: dict = {
        "threads": threads,
        "repeats": repeats,
        "max_batch_groups": max_batch_groups,
        "workloads": {},
    }
    for name, w in WORKLOADS.items():
        params = SamplingParams(temperature=w["temperature"], max_new_tokens=w["max_new_tokens"])
        tasks = tasks_of(problems, prompts, params)
        variants = {
            "ours": lambda w=w: run_ours(model, tok, flat, seeds, w),
            "hf": lambda w=w: run_hf(model, tok, ids_BL, attn_BL, w),
            "batch": lambda tasks=tasks: run_stream(gens["batch"], tasks),
            "continuous": lambda tasks=tasks: run_stream(gens["continuous"], tasks),
        }
        for fn in variants.values():  # warm-up (and the refill policy sees some lengths)
            fn()
        times: dict[str, list[float]] = {v: [] for v in variants}
        extra: dict[str, list[dict]] = {v: [] for v in variants}
        for _ in range(repeats):
            for v, fn in variants.items():
                begin = time.perf_counter()
                out = fn()
                times[v].append(time.perf_counter() - begin)
                if isinstance(out, dict):
                    extra[v].append(out)
        rows = {}
        for v in variants:
            median_s = statistics.median(times[v])
            row = {"median_s": median_s, "samples_per_s": len(flat) / median_s}
            for key in ("p50_handover_s", "p90_handover_s", "forwards"):
                if extra[v] and key in extra[v][0]:
                    row[key] = statistics.median(e[key] for e in extra[v])
            if "forwards" in row:
                per = [t / e["forwards"] for t, e in zip(times[v], extra[v], strict=True)]
                row["ms_per_forward"] = 1e3 * statistics.median(per)
            rows[v] = row
        rows["ratio_ours_over_hf"] = rows["ours"]["median_s"] / rows["hf"]["median_s"]
        rows["ratio_per_forward"] = rows["ours"]["ms_per_forward"] / rows["hf"]["ms_per_forward"]
        result["workloads"][name] = rows
    return result


# Length distributions for the refill simulation: {length: weight}. The first three are the
# shipped model's on the addition task at temperature 1 (max 5), 3 and 4 (512 samples each).
SIM_LENGTHS = {
    "default job, 3-5 tokens": {3: 101, 4: 248, 5: 154},
    "temperature 3, mostly 3-5, up to 26": {
        2: 1,
        3: 99,
        4: 215,
        5: 140,
        6: 26,
        7: 15,
        8: 6,
        9: 1,
        11: 2,
        13: 1,
        14: 1,
        16: 1,
        17: 1,
        18: 2,
        26: 1,
    },
    "geometric, mean 20, cut at 64": {k: 0.95 ** (k - 1) * (0.05 if k < 64 else 1) for k in range(1, 65)},
    "temperature 4, mostly 3-5, up to 37": {
        1: 2,
        2: 4,
        3: 92,
        4: 172,
        5: 109,
        6: 29,
        7: 37,
        8: 19,
        9: 4,
        10: 2,
        11: 11,
        12: 2,
        13: 2,
        14: 6,
        16: 2,
        17: 4,
        18: 5,
        19: 3,
        20: 2,
        21: 2,
        26: 1,
        32: 1,
        37: 1,
    },
    "uniform 10-40": dict.fromkeys(range(10, 41), 1),
    "90% 4 tokens, 10% 40": {4: 90, 40: 10},
    "always 16 (ignore_eos)": {16: 1},
}


# A prefill of the samples that join costs about this many decode steps of the batch (the profile
# behind it: bench/README.md, "Continuous batching").
PREFILL_COST = 1.25


def simulate(num_samples: int = 4096, capacity: int = 128, seed: int = 0) -> dict[str, dict[str, float]]:
    """Forward cost (a decode step 1, a prefill PREFILL_COST) per `capacity` samples when a feed
    that never runs dry is sampled with lengths drawn from each distribution: batch-at-a-time,
    takes at a fixed fraction of free slots, and `RefillPolicy` (learning the lengths as it goes)."""
    import random

    from asyncrl.generators.refill import RefillPolicy

    def run(lengths: dict[int, float], rule) -> float:
        rng = random.Random(seed)
        values, weights = list(lengths), list(lengths.values())
        policy = RefillPolicy(max_new_tokens=max(values), capacity=capacity)
        left, running, forwards = num_samples, [], 0.0  # running: [tokens so far, length]
        while left or running:
            free = capacity - len(running)
            if not running:
                take = min(capacity, left)
            elif rule == "policy":
                so_far = torch.tensor([n for n, _ in running])
                take = min(free, left) if policy.should_take(len(running), so_far) else 0
            elif rule is not None and free >= max(1, round(rule * capacity)):
                take = min(free, left)
            else:
                take = 0
            if take:
                running += [[0, n] for n in rng.choices(values, weights, k=take)]
                left -= take
                forwards += PREFILL_COST
            forwards += 1
            for row in running:
                row[0] += 1
            policy.observe([n for n, length in running if n == length])
            running = [row for row in running if row[0] < row[1]]
        return forwards * capacity / num_samples

    rules = {"batch": None, "take at 1/4 free": 0.25, "at 1/2 free": 0.5, "RefillPolicy": "policy"}
    return {
        name: {r: run(lengths, rule) for r, rule in rules.items()} for name, lengths in SIM_LENGTHS.items()
    }


def render_simulation(table: dict[str, dict[str, float]]) -> str:
    rules = list(next(iter(table.values())))
    title = f"Simulated forward cost per 128 samples (128 slots; a prefill costs {PREFILL_COST} decode steps)"
    lines = [title, "| lengths | " + " | ".join(rules) + " |"]
    lines.append("|---" * (len(rules) + 1) + "|")
    for name, row in table.items():
        lines.append(f"| {name} | " + " | ".join(f"{row[r]:.1f}" for r in rules) + " |")
    return "\n".join(lines)


def render(results: list[dict]) -> str:
    lines = []
    for res in results:
        lines.append(
            f"## {res['threads']} thread(s), max_batch_groups {res['max_batch_groups']}, "
            f"medians of {res['repeats']} interleaved repeats"
        )
        for name, rows in res["workloads"].items():
            lines.append(f"### {name}: {GROUPS} groups x {SAMPLES} samples, {WORKLOADS[name]}")
            lines.append(
                "| variant | median ms | samples/s | forwards | ms/forward | p50 hand-over ms | p90 hand-over ms |"
            )
            lines.append("|---|---|---|---|---|---|---|")
            for v, row in rows.items():
                if v.startswith("ratio"):
                    continue
                cells = [f"{1e3 * row['median_s']:.1f}", f"{row['samples_per_s']:.0f}"]
                cells.append(f"{row['forwards']:.0f}" if "forwards" in row else "")
                cells.append(f"{row['ms_per_forward']:.2f}" if "ms_per_forward" in row else "")
                for key in ("p50_handover_s", "p90_handover_s"):
                    cells.append(f"{1e3 * row[key]:.1f}" if key in row else "")
                lines.append(f"| {v} | " + " | ".join(cells) + " |")
            lines.append(
                f"ours / hf = {rows['ratio_ours_over_hf']:.2f} (per forward: {rows['ratio_per_forward']:.2f})"
            )
            lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", default="1,2", help="comma-separated torch thread counts")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument(
        "--max-batch-groups", type=int, default=MAX_BATCH_GROUPS, help="for batch and continuous"
    )
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--simulate", action="store_true", help="only the refill simulation (no timing)")
    parser.add_argument("--json", action="store_true", help="one JSON object on stdout")
    args = parser.parse_args(argv)
    if args.simulate:
        table = simulate()
        if args.json:
            print(json.dumps({"bench": "refill-simulation", "forwards_per_128_samples": table}, indent=1))
        else:
            print(render_simulation(table))
        return 0
    for name in set(WORKLOADS) - set(args.workloads.split(",")):
        del WORKLOADS[name]
    results = [measure(int(t), args.repeats, args.max_batch_groups) for t in args.threads.split(",")]
    if args.json:
        print(json.dumps({"bench": "generate", "results": results}, indent=1))
    else:
        print(render(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
