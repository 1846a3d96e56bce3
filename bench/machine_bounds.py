"""What this machine's CPU can do, for the stage bounds in bench/README.md (the real-model job).

    python bench/machine_bounds.py

- float32 matmul [4096, 576] x [576, 1536] (SmolLM2-135M's hidden and MLP widths) in GFLOP/s, on
  one thread and on two;
- the decode-time shape: a batch of 16 rows times the LM head's [49152, 576] float32 weights,
  as GB/s of weights read (a decode step reads every weight once);
- a 268 MB memcpy on one thread in GB/s.
Best and median of repeated timings after a warm-up.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch


def timings(run: Callable[[], object], repeats: int) -> tuple[float, float]:
    """(best, median) seconds of `repeats` calls of `run`, after one warm-up call."""
    run()
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        seconds.append(time.perf_counter() - start)
    return min(seconds), statistics.median(seconds)


def main() -> None:
    for threads in (1, 2):
        torch.set_num_threads(threads)
        a, b = torch.randn(4096, 576), torch.randn(576, 1536)
        flops = 2 * a.shape[0] * a.shape[1] * b.shape[1]
        best, med = timings(lambda a=a, b=b: a @ b, 7)
        print(
            f"matmul fp32, {threads} thread(s): best {flops / best / 1e9:.1f} GFLOP/s, median {flops / med / 1e9:.1f}"
        )
        head, rows = torch.randn(49152, 576), torch.randn(16, 576)
        best, med = timings(lambda h=head, r=rows: r @ h.T, 15)
        size = head.numel() * head.element_size()
        print(
            f"  batch 16 x LM head ({size / 1e6:.0f} MB): best {size / best / 1e9:.1f} GB/s of weights read, median {size / med / 1e9:.1f}"
        )
    torch.set_num_threads(1)
    src = torch.ones(2**28, dtype=torch.uint8)
    dst = torch.empty_like(src)
    best, med = timings(lambda: dst.copy_(src), 7)
    print(
        f"memcpy, 1 thread, {src.numel() / 1e6:.0f} MB: best {src.numel() / best / 1e9:.1f} GB/s, median {src.numel() / med / 1e9:.1f}"
    )


if __name__ == "__main__":
    main()
