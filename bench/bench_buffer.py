"""Buffer throughput versus size: per-op cost of `put` and `sample` at 10^4, 10^5, 10^6 items.

For each ordering and each size n the buffer is filled to n items (groups of `--group-size`,
random freshness, a staleness bound so the eviction heaps are maintained too), then, at that
steady size, `--ops` items are put and the same number sampled back (whole groups), repeated
`--repeats` times; the best repeat is reported, as `timeit` does. The cyclic garbage collector is
paused inside timed sections (also as `timeit` does) unless `--gc` is given; with a million live
objects a full collection is an O(n) pause that says nothing about the data structure.

    python bench/bench_buffer.py            # table
    python bench/bench_buffer.py --json     # one JSON document on stdout

The last column is the per-op cost at this size over the cost at the smallest size: O(log n) or
better shows as a small factor (log2(10^6)/log2(10^4) = 1.5 for a pure heap; cache misses add some).
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import time
from typing import NamedTuple

from asyncrl.buffer.store import Buffer, BufferItem


class Row(NamedTuple):
    order: str
    num_items: int
    fill_s: float
    put_ns_per_item: float
    sample_ns_per_group: float
    sample_ns_per_item: float
    put_ratio: float  # vs the smallest size, same order
    sample_ratio: float


def make_items(
    first_traj: int, num_items: int, group_size: int, rng: random.Random
) -> list[BufferItem[None]]:
    items = []
    for traj_id in range(first_traj, first_traj + num_items):
        group_id = traj_id // group_size
        items.append(
            BufferItem(
                traj_id=traj_id,
                group_id=group_id,
                num_samples=group_size,
                step=0,
                min_version=0,
                freshness=rng.uniform(0.05, 1.0),
                num_tokens=256,
                payload=None,
            )
        )
    return items


def timed(fn, *, keep_gc: bool) -> float:
    if not keep_gc:
        gc.disable()
    try:
        start = time.perf_counter_ns()
        fn()
        return float(time.perf_counter_ns() - start)
    finally:
        gc.enable()


def bench_one(order: str, num_items: int, *, ops: int, repeats: int, group_size: int, keep_gc: bool) -> Row:
    rng = random.Random(num_items)
    buf: Buffer[None] = Buffer(order=order, max_staleness=1_000_000, freshness_floor=0.01)
    fill = make_items(0, num_items, group_size, rng)
    start = time.perf_counter()
    for item in fill:
        buf.put(item)
    fill_s = time.perf_counter() - start
    del fill
    best_put = best_sample = float("inf")
    next_traj = num_items
    num_groups = ops // group_size
    for _ in range(repeats):
        batch = make_items(next_traj, num_groups * group_size, group_size, rng)
        next_traj += len(batch)

        def do_put(batch=batch) -> None:
            put = buf.put
            for item in batch:
                put(item)

        def do_sample() -> None:
            sample = buf.sample
            for _ in range(num_groups):
                sample(1)

        best_put = min(best_put, timed(do_put, keep_gc=keep_gc) / len(batch))
        best_sample = min(best_sample, timed(do_sample, keep_gc=keep_gc) / num_groups)
        assert len(buf) == num_items, (len(buf), num_items)
    return Row(order, num_items, fill_s, best_put, best_sample, best_sample / group_size, 1.0, 1.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[10**4, 10**5, 10**6])
    parser.add_argument("--orders", nargs="+", default=["fifo", "freshest", "windowed"])
    parser.add_argument("--ops", type=int, default=40_000, help="items put and sampled per repeat")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--gc", action="store_true", help="keep the garbage collector on while timing")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args()

    rows: list[Row] = []
    for order in args.orders:
        base: Row | None = None
        for num_items in sorted(args.sizes):
            row = bench_one(
                order,
                num_items,
                ops=args.ops,
                repeats=args.repeats,
                group_size=args.group_size,
                keep_gc=args.gc,
            )
            base = base or row
            row = row._replace(
                put_ratio=row.put_ns_per_item / base.put_ns_per_item,
                sample_ratio=row.sample_ns_per_group / base.sample_ns_per_group,
            )
            rows.append(row)
            if not args.json:
                print_row(row, header=len(rows) == 1)
    if args.json:
        print(
            json.dumps(
                {"group_size": args.group_size, "gc": args.gc, "rows": [r._asdict() for r in rows]}, indent=2
            )
        )


def print_row(row: Row, *, header: bool) -> None:
    if header:
        print(
            f"{'order':<9} {'items':>9} {'fill s':>7} {'put ns/item':>12} {'sample ns/group':>16} "
            f"{'ns/item':>8} {'put x':>6} {'sample x':>9}"
        )
    print(
        f"{row.order:<9} {row.num_items:>9,} {row.fill_s:>7.2f} {row.put_ns_per_item:>12.0f} "
        f"{row.sample_ns_per_group:>16.0f} {row.sample_ns_per_item:>8.0f} {row.put_ratio:>6.2f} {row.sample_ratio:>9.2f}",
        flush=True,
    )


if __name__ == "__main__":
    main()
