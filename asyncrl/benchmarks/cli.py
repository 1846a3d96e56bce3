"""The `asyncrl bench` sub-command group: one command per module in `asyncrl.benchmarks`."""

from __future__ import annotations

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

from asyncrl.benchmarks import baseline  # noqa: E402

bench_app.command("baseline")(baseline.command)

from asyncrl.benchmarks import control  # noqa: E402

bench_app.command("staleness")(control.command)
