"""Weight-sync benchmark script: a thin wrapper around `asyncrl bench weights`
(asyncrl/benchmarks/weights.py, implementation in asyncrl/benchmarks/weights_run.py).

    python bench/bench_weights.py --json
    python bench/bench_weights.py --num-params 20000000 --generators 1 --repeats 9
"""

from __future__ import annotations

import typer

from asyncrl.benchmarks.weights import command
from asyncrl.benchmarks.weights_run import run_weights_bench  # noqa: F401 - re-exported for scripts

if __name__ == "__main__":
    typer.run(command)
