"""The pure parts of `asyncrl bench pipeline` (asyncrl/benchmarks/pipeline.py has what it measures):
the four variants' `--set` overrides, steady-state figures from metrics.jsonl records, medians and
ratios over repeats, the batch size that balances the two stages, the CPU split of `--pin`.
No processes, no clocks: the runs are in pipeline_run.py."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Any

VARIANTS = ("gen_only", "learn_only", "sync", "async")
REPLAY_KIND = "asyncrl.benchmarks.replay:ReplayGenerator"
# Batch sizes (generators.max_batch_groups) the calibration measures the generator at: the larger
# always, the smaller when the generator outruns the learner at the larger.
CALIBRATION_BATCH_GROUPS = (8, 2)


# ---------------------------------------------------------------------------- pure figures
def steady_rate(steps: list[dict], *, skip: int, count: str = "num_trajectories") -> float:
    """Samples per second over steps after the first `skip`: samples trained in steps
    skip+1.. divided by the time from the end of step `skip` to the end of the last one.

    `steps` are metrics.jsonl records of type "step" (`step`, `num_trajectories`, `num_tokens`,
    `time_s`, the seconds since training began); `skip=0` measures from the start of training.
    `count="num_tokens"` gives generated tokens per second instead.
    """
    steps = sorted(steps, key=lambda r: r["step"])
    if skip < 0:
        raise ValueError(f"skip must be >= 0, got {skip}")
    if len(steps) <= skip:
        raise ValueError(f"{len(steps)} step records; need more than skip={skip} (raise --steps)")
    start_s = steps[skip - 1]["time_s"] if skip > 0 else 0.0
    samples = sum(r[count] for r in steps[skip:])
    elapsed_s = steps[-1]["time_s"] - start_s
    if elapsed_s <= 0 or samples <= 0:
        raise ValueError(f"no measurable progress after step {skip} ({samples} samples in {elapsed_s:.3f} s)")
    return samples / elapsed_s


def run_figures(records: list[dict], *, skip: int) -> dict[str, float]:
    """Throughput and stage figures of one run from its metrics.jsonl records.

    sps: steady-state samples/s (`steady_rate`); tps: the same for generated tokens (when the step
    records count them); learner_tail_s: median over the steady steps of
    `learner/tail_s` (last trajectory of the step's window in -> update done); learner_idle_ratio:
    the learner's idle seconds over wall seconds in the same window (from the cumulative
    `learner/idle_s`); gen_busy_ratio: the generators' last `gen/busy_ratio` (cumulative since each
    generator started), averaged over generators.
    """
    steps = [r for r in records if r.get("type") == "step"]
    out = {"sps": steady_rate(steps, skip=skip)}
    if steps and all("num_tokens" in r for r in steps):
        out["tps"] = steady_rate(steps, skip=skip, count="num_tokens")
    learner = [r for r in records if r.get("type") == "metrics" and r.get("source") == "learner"]
    if len(learner) > skip:
        steady = learner[skip:]
        out["learner_tail_s"] = statistics.median(r["learner/tail_s"] for r in steady)
        ref = learner[skip - 1] if skip > 0 else {"learner/idle_s": 0.0, "time_s": 0.0}
        span_s = learner[-1]["time_s"] - ref["time_s"]
        if span_s > 0:
            idle_s = learner[-1]["learner/idle_s"] - ref["learner/idle_s"]
            out["learner_idle_ratio"] = min(1.0, max(0.0, idle_s / span_s))
    busy: dict[str, float] = {}
    for r in records:
        if r.get("type") == "metrics" and "gen/busy_ratio" in r:
            busy[r["source"]] = r["gen/busy_ratio"]
    if busy:
        out["gen_busy_ratio"] = statistics.fmean(busy.values())
    return out


def summarize(runs: list[dict[str, dict[str, float]]]) -> dict[str, Any]:
    """Per-repeat figures -> the result object: medians of each variant's samples/s, efficiency
    (async / min(gen_only, learn_only)), speedup (async / sync), per-repeat values, and the async
    runs' learner tail, learner idle ratio and generator busy ratio (medians).

    `runs[i][variant]` is `run_figures` of repeat i's run of that variant.
    """
    if not runs:
        raise ValueError("no repeats to summarize")
    per_repeat: list[dict[str, float]] = []
    for rep in runs:
        missing = [v for v in VARIANTS if v not in rep]
        if missing:
            raise ValueError(f"a repeat lacks variants {missing}")
        row = {f"{v}_sps": rep[v]["sps"] for v in VARIANTS}
        row["efficiency"] = row["async_sps"] / min(row["gen_only_sps"], row["learn_only_sps"])
        row["speedup"] = row["async_sps"] / row["sync_sps"]
        per_repeat.append(row)
    med = {f"{v}_sps": statistics.median(r[f"{v}_sps"] for r in per_repeat) for v in VARIANTS}
    result: dict[str, Any] = {
        **med,
        # Ratios of the medians (each repeat's own ratios are in per_repeat).
        "efficiency": med["async_sps"] / min(med["gen_only_sps"], med["learn_only_sps"]),
        "speedup": med["async_sps"] / med["sync_sps"],
        "bound": "generators" if med["gen_only_sps"] < med["learn_only_sps"] else "learner",
        "balance": min(med["gen_only_sps"], med["learn_only_sps"])
        / max(med["gen_only_sps"], med["learn_only_sps"]),
    }
    for key in ("learner_tail_s", "learner_idle_ratio", "gen_busy_ratio"):
        values = [rep["async"][key] for rep in runs if key in rep["async"]]
        if values:
            result[f"async_{key}"] = statistics.median(values)
    # The same ratio in generated tokens/s: a check that the single-stage variants saw answers as
    # long as async's (with --stop-at-eos see `variant_sets`'s `policy`), else efficiency in
    # samples/s is biased.
    if all("tps" in rep[v] for rep in runs for v in VARIANTS):
        tps = {v: statistics.median(rep[v]["tps"] for rep in runs) for v in VARIANTS}
        result.update({f"{v}_tps": tps[v] for v in VARIANTS})
        result["efficiency_tokens"] = tps["async"] / min(tps["gen_only"], tps["learn_only"])
    result["median_efficiency_per_repeat"] = statistics.median(r["efficiency"] for r in per_repeat)
    result["median_speedup_per_repeat"] = statistics.median(r["speedup"] for r in per_repeat)
    result["per_repeat"] = per_repeat
    result["per_run"] = [{v: rep[v] for v in VARIANTS} for rep in runs]
    return result


def balanced_batch_groups(gen_sps: dict[int, float], learn_sps: float, *, largest: int) -> int:
    """The `generators.max_batch_groups` (1..largest) at which the generator alone runs at
    `learn_sps`, the learner's own rate, from generator-only rates measured at a few batch sizes.

    Model: a batch of m groups takes a + b*m seconds (per-decode-step overhead plus a cost per
    group), so 1/rate is linear in 1/m: 1/g(m) = alpha/m + beta, fitted by least squares. The
    pick is the m whose predicted rate is nearest `learn_sps` by ratio. With one point, or a fit
    that says smaller batches are not slower (noise), the measured batch size nearest by ratio
    (at most `largest`).
    """
    if not gen_sps or learn_sps <= 0 or any(v <= 0 for v in gen_sps.values()):
        raise ValueError(f"need positive rates, got gen_sps={gen_sps}, learn_sps={learn_sps}")

    def miss(rate: float) -> float:
        return abs(math.log(rate / learn_sps))

    nearest = min(min(gen_sps, key=lambda m: miss(gen_sps[m])), largest)
    if len(gen_sps) < 2:
        return nearest
    xs = [1.0 / m for m in gen_sps]
    ys = [1.0 / v for v in gen_sps.values()]
    mean_x, mean_y = statistics.fmean(xs), statistics.fmean(ys)
    var_x = sum((x - mean_x) ** 2 for x in xs)
    alpha = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True)) / var_x if var_x else 0.0
    beta = mean_y - alpha * mean_x
    if alpha <= 0:
        return nearest
    predicted = {m: 1.0 / (alpha / m + beta) for m in range(1, largest + 1) if alpha / m + beta > 0}
    return min(predicted, key=lambda m: miss(predicted[m])) if predicted else nearest


def stage_cpus(available: set[int] | list[int]) -> tuple[list[int], list[int]] | None:
    """`--pin`'s placement: the learner on the first half of the CPUs this process may use, the
    generators on the rest, so that each stage has its own cores (as each has its own GPUs on a
    GPU host) and neither's threads preempt the other's; None with fewer than 2 CPUs."""
    cpus = sorted(available)
    if len(cpus) < 2:
        return None
    half = len(cpus) // 2
    return cpus[:half], cpus[half:]


def workload_sets(
    *,
    steps: int,
    groups_per_step: int,
    samples_per_group: int,
    max_new_tokens: int,
    ignore_eos: bool,
    max_staleness: int,
    placement: tuple[list[int], list[int]] | None,
    extra: list[str],
) -> list[str]:
    """The workload every variant runs, as `--set` overrides: one generator process on one thread,
    a one-thread learner, evaluation off; `placement` (`stage_cpus`) pins the two stages; the
    user's `extra` overrides come last, so they win."""
    workload = [
        f"learner.steps={steps}",
        f"learner.groups_per_step={groups_per_step}",
        f"learner.samples_per_group={samples_per_group}",
        f"sampling.max_new_tokens={max_new_tokens}",
        f"sampling.ignore_eos={str(ignore_eos).lower()}",
        f"staleness.max_staleness={max_staleness}",
        "generators.num_generators=1",
        "generators.threads=1",
        "learner.threads=1",
        "task.num_eval=0",
    ]
    if placement is not None:
        workload += [f"learner.cpus={placement[0]}", f"generators.cpus={placement[1]}"]
    return workload + extra


def variant_command(variant: str) -> list[str]:
    """The `asyncrl` sub-command that runs `variant`: the recording learner for gen_only."""
    return ["bench", "record"] if variant == "gen_only" else ["launch"]


def variant_sets(variant: str, *, recording: Path | None = None, policy: Path | None = None) -> list[str]:
    """The `--set` overrides that make a run of the workload into `variant` (applied last).

    `policy`: a trained model directory that the single-stage variants (gen_only, learn_only) start
    from instead of the workload's model. Their policy never learns, and with answers that end at
    eos (`--stop-at-eos`) an untrained policy's answers are longer than those of the policy that
    sync and async train along the way (bench/README.md has how many more tokens), so without it they measure a costlier
    workload. (The default `--ignore-eos` makes every answer the same length in every variant.)
    """
    model = [f"model.path={json.dumps(str(policy))}"] if policy is not None else []
    match variant:
        case "gen_only":
            return model  # run by `asyncrl bench record` (variant_command)
        case "learn_only":
            if recording is None:
                raise ValueError("learn_only needs the gen_only run's recording")
            return [
                f"generators.kind={REPLAY_KIND}",
                f"generators.options.replay_path={json.dumps(str(recording))}",
                *model,
            ]
        case "sync":
            return ["mode=sync", "learner.streaming=off"]
        case "async":
            return ["mode=async", "learner.streaming=auto"]
    raise ValueError(f"unknown variant {variant!r}; valid: {', '.join(VARIANTS)}")
