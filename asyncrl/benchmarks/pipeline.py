"""`asyncrl bench pipeline`: one workload measured four ways in one run (bench/README.md, "Pipeline").

  gen_only    the generators alone: `asyncrl bench record` (the learner records each window to
              <run>/trajectories.jsonl and trains nothing; versions still advance)
  learn_only  the learner alone: the same workload replayed from that recording by
              `asyncrl.benchmarks.replay:ReplayGenerator`, which answers every task at once
  sync        the whole pipeline, generate-then-train: `mode=sync`, `learner.streaming=off`
  async       the whole pipeline, overlapped, gradient streaming (the defaults)

Each variant is an `asyncrl launch` (gen_only: `asyncrl bench record`) subprocess (isolated, evaluation off); the four run interleaved
in every repeat so that machine noise hits them alike. By default the generator's batch size
(`generators.max_batch_groups`) is calibrated first so that the two stages run at about the same
rate on this machine (`balanced_batch_groups`): overlap can at best double the throughput of two
equal stages, and an unbalanced workload measures the imbalance instead of the overlap. Throughput is steady state, from the step
records in metrics.jsonl: samples trained after step `skip` divided by the time from step `skip`'s
end to the last step's end (process start-up, model loading and pipeline fill are not counted).
Every answer is sampled to `max_new_tokens` (`sampling.ignore_eos`, as inference throughput
benchmarks do) so that the four variants do the same work per sample: answers that end at eos
follow the policy, which learns in sync and async but not in gen_only and learn_only
(`--stop-at-eos` measures that way; the tokens/s ratio then shows the difference). The default
length, 16 tokens, makes each sample's model work dominate the pipeline's per-sample messaging
and bookkeeping, as on any real model; at 5 tokens (the default job's max_new_tokens) that
overhead is a share of all CPU no real model's samples come near (figures: bench/README.md).

This module is the command (its options and their checks); the pure parts (figures from records,
medians, ratios, each variant's overrides) are in pipeline_figures.py, the runs in pipeline_run.py.
Importing it is cheap: subprocesses and rich load when the command runs.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from asyncrl.benchmarks.pipeline_figures import VARIANTS, stage_cpus, variant_sets, workload_sets


def _int_option(name: str, value: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise typer.BadParameter(f"{name} must be a whole number or 'auto', got {value!r}") from None


# The command's longer options, declared once here so that its signature reads as a list.
_MaxNewTokens = Annotated[
    int, typer.Option(help="sampling.max_new_tokens: every answer's length (with --ignore-eos)")
]
_IgnoreEos = Annotated[
    bool,
    typer.Option(
        "--ignore-eos/--stop-at-eos",
        help="every answer max_new_tokens long (sampling.ignore_eos), so that the four variants do "
        "the same work per sample, or answers end at eos (lengths then follow each variant's policy)",
    ),
]
_MaxBatchGroups = Annotated[
    str,
    typer.Option(
        help="generators.max_batch_groups, or 'auto': measured first so that the two stages run "
        "at about the same rate on this machine"
    ),
]
_TrainedPolicy = Annotated[
    bool,
    typer.Option(
        "--trained-policy/--initial-policy",
        help="gen_only and learn_only run a policy trained first by one sync run (its answers are "
        "as long as those sync and async produce once learning), or the initial model",
    ),
]
_Pin = Annotated[
    bool,
    typer.Option(
        "--pin/--no-pin",
        help="run the learner on the first half of this machine's CPUs and the generators on the "
        "rest (learner.cpus, generators.cpus) in every variant, or let the OS place them",
    ),
]
_Sets = Annotated[
    list[str] | None,
    typer.Option("--set", help="extra config override for every run, e.g. --set model.path=DIR"),
]
_OutDir = Annotated[
    Path | None, typer.Option(help="keep the run directories here (default: a temporary directory)")
]


def command(
    steps: Annotated[int, typer.Option(help="optimizer steps per run (learner.steps)")] = 20,
    groups_per_step: Annotated[int, typer.Option(help="learner.groups_per_step")] = 32,
    samples_per_group: Annotated[int, typer.Option(help="learner.samples_per_group")] = 8,
    max_new_tokens: _MaxNewTokens = 16,
    ignore_eos: _IgnoreEos = True,
    max_batch_groups: _MaxBatchGroups = "auto",
    max_staleness: Annotated[int, typer.Option(help="staleness.max_staleness (async variants)")] = 2,
    skip: Annotated[int, typer.Option(help="leading steps left out of the steady-state throughput")] = 2,
    repeats: Annotated[int, typer.Option(help="rounds of the four variants; medians reported")] = 3,
    trained_policy: _TrainedPolicy = True,
    pin: _Pin = True,
    set_: _Sets = None,
    out_dir: _OutDir = None,
    as_json: Annotated[bool, typer.Option("--json", help="print the result as JSON")] = False,
) -> None:
    """Pipeline: generators alone, learner alone, sync and async on one workload."""
    batch_groups = None if max_batch_groups == "auto" else _int_option("--max-batch-groups", max_batch_groups)
    _check_sizes(
        steps=steps,
        groups_per_step=groups_per_step,
        samples_per_group=samples_per_group,
        max_new_tokens=max_new_tokens,
        batch_groups=batch_groups,
        repeats=repeats,
        max_staleness=max_staleness,
        skip=skip,
    )
    from asyncrl.runtime import available_cpus

    placement = stage_cpus(available_cpus()) if pin else None
    workload = workload_sets(
        steps=steps,
        groups_per_step=groups_per_step,
        samples_per_group=samples_per_group,
        max_new_tokens=max_new_tokens,
        ignore_eos=ignore_eos,
        max_staleness=max_staleness,
        placement=placement,
        extra=set_ or [],
    )
    _check_config(workload, batch_groups)
    from asyncrl.benchmarks.pipeline_run import print_table, run_pipeline_bench

    result = run_pipeline_bench(
        workload,
        repeats=repeats,
        skip=skip,
        out_dir=out_dir,
        max_batch_groups=batch_groups,
        largest_batch_groups=groups_per_step,
        trained_policy=trained_policy,
        progress=lambda text: typer.echo(text, err=True),
    )
    result["cpus"] = {"learner": placement[0], "generators": placement[1]} if placement else None
    if as_json:
        typer.echo(json.dumps(result, indent=2))
    else:
        print_table(result)


def _check_sizes(
    *,
    steps: int,
    groups_per_step: int,
    samples_per_group: int,
    max_new_tokens: int,
    batch_groups: int | None,
    repeats: int,
    max_staleness: int,
    skip: int,
) -> None:
    """The command's numeric options in range, else typer.BadParameter naming the option."""
    for name, value, low in (
        ("--steps", steps, 1),
        ("--groups-per-step", groups_per_step, 1),
        ("--samples-per-group", samples_per_group, 2),
        ("--max-new-tokens", max_new_tokens, 1),
        ("--max-batch-groups", 1 if batch_groups is None else batch_groups, 1),
        ("--repeats", repeats, 1),
    ):
        if value < low:
            raise typer.BadParameter(f"{name} must be >= {low}, got {value}")
    if max_staleness < 0 or skip < 0:
        raise typer.BadParameter("--max-staleness and --skip must be >= 0")
    if steps <= skip:
        raise typer.BadParameter(f"--steps ({steps}) must be greater than --skip ({skip})")


def _check_config(workload: list[str], batch_groups: int | None) -> None:
    """Fail on a bad --set before any process starts: every variant's config loads."""
    from asyncrl.config_load import load_config
    from asyncrl.config_sections import ConfigError

    try:
        for v in VARIANTS:
            load_config(None, [*workload, *variant_sets(v, recording=Path("recording.jsonl"))])
        if batch_groups is not None:
            load_config(None, [*workload, f"generators.max_batch_groups={batch_groups}"])
    except ConfigError as exc:
        raise typer.BadParameter(str(exc)) from None
