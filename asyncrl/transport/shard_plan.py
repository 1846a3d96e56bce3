"""Which tensors go into which shard file (pure): the plan `shards.write_shards` writes by.

Place in the data flow: the learner's shard writer plans each version's files with `plan_shards`
and hands them to its threads in `largest_first` order; generators' readers take the files in the
same order. One thread hashes one file at a time (sha256 of a file is sequential), so the plan
decides how evenly the writer's and every reader's cores are used.
"""

from __future__ import annotations

# Splitting a version into more shards (for parallel hashing) stops below this size per shard: small
# models stay in one file, where a second thread would save less than its start-up costs.
_MIN_PARALLEL_SHARD_BYTES = 8 << 20


def _fill(sizes_bytes: list[int], capacity_bytes: int) -> list[list[int]]:
    """Tensors in order into shards, a new one whenever the next tensor would pass `capacity_bytes`."""
    shards: list[list[int]] = []
    current: list[int] = []
    current_bytes = 0
    for i, size in enumerate(sizes_bytes):
        if current and current_bytes + size > capacity_bytes:
            shards.append(current)
            current, current_bytes = [], 0
        current.append(i)
        current_bytes += size
    if current:
        shards.append(current)
    return shards


def plan_shards(sizes_bytes: list[int], *, max_shard_bytes: int, num_parallel: int = 1) -> list[list[int]]:
    """Split tensors (by index, in order) into even shards of at most `max_shard_bytes` tensor bytes.

    The number of shards is the fewest that keep to the limit (greedy in state-dict order, like
    transformers' `save_pretrained`), rounded up to a multiple of `num_parallel` (the threads that
    write and verify them, one file each at a time: sha256 of one file is sequential) as long as each
    shard keeps at least `_MIN_PARALLEL_SHARD_BYTES`. Of the in-order splits into that many shards,
    the one with the smallest largest shard is taken, so the threads finish together. A tensor larger
    than the limit gets a shard of its own.
    """
    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be > 0, got {max_shard_bytes}")
    if num_parallel <= 0:
        raise ValueError(f"num_parallel must be > 0, got {num_parallel}")
    fewest = _fill(sizes_bytes, max_shard_bytes)
    total_bytes = sum(sizes_bytes)
    step = num_parallel if total_bytes >= num_parallel * _MIN_PARALLEL_SHARD_BYTES else 1
    num_shards = -(-len(fewest) // step) * step
    if num_shards <= 1:
        return fewest
    # The fill's shard count only falls as the capacity grows: bisect for the smallest capacity that
    # needs at most `num_shards` shards (the limit itself always does).
    low = min(-(-total_bytes // num_shards), max_shard_bytes)
    high = max_shard_bytes
    while low < high:
        mid = (low + high) // 2
        if len(_fill(sizes_bytes, mid)) <= num_shards:
            high = mid
        else:
            low = mid + 1
    return _fill(sizes_bytes, low)


def largest_first(sizes_bytes: list[int]) -> list[int]:
    """Indices, largest first: the order to hand files to a thread pool so no thread finishes last
    with a big file still to go."""
    return sorted(range(len(sizes_bytes)), key=lambda i: -sizes_bytes[i])
