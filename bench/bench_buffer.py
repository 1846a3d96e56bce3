"""Buffer throughput versus size: a thin wrapper around `asyncrl bench buffer`
(asyncrl/benchmarks/buffer.py), kept so `python bench/bench_buffer.py [--json ...]` still works.

    python bench/bench_buffer.py                 # table: fifo, freshest, windowed at 10^4..10^6
    python bench/bench_buffer.py --json          # one JSON document on stdout
    python bench/bench_buffer.py --size 1000000 --order freshest
"""

from __future__ import annotations

import typer

from asyncrl.benchmarks.buffer import command, run_buffer_bench  # noqa: F401 - re-exported

if __name__ == "__main__":
    typer.run(command)
