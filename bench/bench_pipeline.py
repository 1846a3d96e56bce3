"""Pipeline benchmark script: a thin wrapper around `asyncrl bench pipeline`
(asyncrl/benchmarks/pipeline.py; the runs in asyncrl/benchmarks/pipeline_run.py).

    python bench/bench_pipeline.py --json
    python bench/bench_pipeline.py --repeats 5 --max-batch-groups 8 --set sampling.temperature=0.8
"""

from __future__ import annotations

import typer

from asyncrl.benchmarks.pipeline import command

if __name__ == "__main__":
    typer.run(command)
