"""Byte-level helpers shared by the shard writer, the shard reader and the broadcast receiver.

Place in the data flow: below both ends of the shards path. `shards.py` (learner rank 0) and
`shard_read.py` (generators) move tensor bytes between memory and files in `CHUNK_BYTES` pieces,
hashing each piece while it is in cache, and size their thread pools with `pool_size`;
`shard_read.py` and `broadcast.py` read new weights into `fresh_cpu_bytes` buffers. Nothing here
knows the shard format or the version directories.
"""

from __future__ import annotations

import contextlib
import mmap
import os

import torch

__all__ = ["CHUNK_BYTES", "byte_view", "fresh_cpu_bytes", "pool_size"]

# Hashing and file IO go chunk by chunk so that a chunk is still in cache for the second pass.
CHUNK_BYTES = 4 << 20
# Fresh buffers from this size on get transparent huge pages (`fresh_cpu_bytes`): one huge page.
_HUGE_PAGE_MIN_BYTES = 2 << 20


def fresh_cpu_bytes(num_bytes: int) -> torch.Tensor:
    """A new uint8 CPU tensor of `num_bytes` (contents undefined), cheap to fill for the first time.

    Memory fresh from `torch.empty` takes a page fault per 4 KiB page when first written, which
    costs several times the copy itself (bench/README.md, "Weight sync"). Buffers of
    `_HUGE_PAGE_MIN_BYTES` or more are mapped with transparent huge pages where the kernel allows them
    (`madvise` or `always` mode; else this is plain memory, as from `torch.empty`). The mapping lives
    as long as any view of the tensor.
    """
    if num_bytes < _HUGE_PAGE_MIN_BYTES or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.empty(num_bytes, dtype=torch.uint8)
    mapping = mmap.mmap(-1, num_bytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    with contextlib.suppress(OSError):  # THP "never" or not built in: plain pages
        mapping.madvise(mmap.MADV_HUGEPAGE)
    return torch.frombuffer(mapping, dtype=torch.uint8)


def byte_view(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def pool_size(num_threads: int | None, num_jobs: int) -> int:
    """Threads for `num_jobs` files: `num_threads` (default: CPU count), never more than the jobs."""
    if num_threads is not None and num_threads <= 0:
        raise ValueError(f"num_threads must be > 0, got {num_threads}")
    return max(1, min(num_jobs, num_threads or os.cpu_count() or 1))
