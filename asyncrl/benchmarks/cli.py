"""The `asyncrl bench` sub-command group: one command per benchmark module in `asyncrl.benchmarks`.

Two kinds: typer commands (`weights`, `pipeline`, ...), and benchmarks with their own argparse
`main(argv)` (`generate`, `gpu-check`, ...), which `asyncrl bench NAME ARGS` runs with ARGS as
they are (`--help` included), as `python -m asyncrl.benchmarks.MODULE ARGS` also does.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import typer

bench_app = typer.Typer(
    name="bench",
    help="Throughput benchmarks, measured side by side in one run (medians, ratios).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

# Each benchmark module registers itself here, one line each:
#   from asyncrl.benchmarks import weights
#   bench_app.command("weights")(weights.command)

from asyncrl.benchmarks import monitor  # noqa: E402 - registration after bench_app exists

bench_app.command("monitor")(monitor.command)

from asyncrl.benchmarks import weights  # noqa: E402

bench_app.command("weights")(weights.command)

from asyncrl.benchmarks import buffer  # noqa: E402

bench_app.command("buffer")(buffer.command)

from asyncrl.benchmarks import pipeline  # noqa: E402

bench_app.command("pipeline")(pipeline.command)

from asyncrl.benchmarks import record  # noqa: E402

bench_app.command("record")(record.command)

from asyncrl.benchmarks import learner  # noqa: E402

bench_app.command("learner")(learner.command)

from asyncrl.benchmarks import learner_step  # noqa: E402

bench_app.command("learner-step")(learner_step.command)

from asyncrl.benchmarks import baseline  # noqa: E402

bench_app.command("baseline")(baseline.command)

from asyncrl.benchmarks import control  # noqa: E402

bench_app.command("staleness")(control.command)


# Benchmarks with their own argparse `main(argv)`: (command, module, help).
SCRIPT_BENCHMARKS = (
    ("generate", "generate", "The torch generator's sampling against HF generate, continuous vs batch."),
    ("batching", "batching", "Continuous vs batch-at-a-time generation in whole runs."),
    ("logprobs", "logprobs", "Peak memory and time of per-token log-probs: full, chunked, fused."),
    ("policies", "policies", "Staleness policies side by side under a high staleness bound."),
    ("env", "env", "Agentic episodes with heavy-tailed environment steps: env-level async vs lockstep."),
    (
        "sglang-client",
        "sglang_client",
        "The sglang generator's HTTP client CPU per request (from a checkout).",
    ),
    ("gpu-check", "gpu_check", "The learner on one GPU: throughput, memory and exactness in one run."),
)


def _script_command(name: str, module: str, help_text: str) -> Callable[[typer.Context], None]:
    def command(ctx: typer.Context) -> None:
        import importlib

        main = importlib.import_module(f"asyncrl.benchmarks.{module}").main
        argv0, sys.argv[0] = sys.argv[0], f"asyncrl bench {name}"  # argparse's prog in usage lines
        try:
            code = main(list(ctx.args))
        finally:
            sys.argv[0] = argv0
        raise typer.Exit(code or 0)

    command.__doc__ = help_text + " Options: asyncrl bench " + name + " --help."
    return command


for _name, _module, _help in SCRIPT_BENCHMARKS:
    bench_app.command(
        _name,
        context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
        add_help_option=False,
    )(_script_command(_name, _module, _help))
