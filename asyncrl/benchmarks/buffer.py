"""`asyncrl bench buffer`: the trajectory buffer's insert and sample cost versus how much it holds.

Place in the data flow: measures `asyncrl.buffer.store.Buffer` (the learner's freshness-scored
store) alone, no processes. For each ordering and each size n (default 10^4, 10^5, 10^6
trajectories) the buffer is filled to n items (groups of `--group-size`, random freshness, a
staleness and a freshness bound so the eviction heaps are maintained too); then, at that steady
size, `--ops` items are put and as many sampled back (whole groups), `--repeats` times. Reported:
the median per-op cost over the repeats, throughput (items/s), and each cost at size n over the
cost at the smallest size: O(log n) shows as a small factor (log2(10^6) / log2(10^4) = 1.5 for a
binary heap; cache misses on a large working set add some), O(n) as about 100.

The cyclic garbage collector is paused inside timed sections unless `--gc` (as `timeit` does):
with a million live objects one full collection is an O(n) pause that says nothing about the data
structure. Asserts nothing; tests never time anything.
"""

from __future__ import annotations

import json
import statistics
import time
from typing import Annotated, NamedTuple

import typer

DEFAULT_SIZES = (10_000, 100_000, 1_000_000)
ORDERS = ("fifo", "freshest", "windowed")


class Row(NamedTuple):
    order: str
    num_items: int  # items held while timing
    fill_s: float  # building the buffer up to num_items (not a per-op figure)
    put_ns: float  # median per put, one item
    sample_ns_per_group: float  # median per sample(1)
    sample_ns: float  # the same per item
    put_items_per_s: float
    sample_items_per_s: float
    put_scaling: float  # put_ns over put_ns at the smallest size, same order
    sample_scaling: float


def _items(first: int, count: int, group_size: int, rng):
    from asyncrl.buffer.store import BufferItem

    return [
        BufferItem(
            traj_id=t,
            group_id=t // group_size,
            num_samples=group_size,
            step=0,
            min_version=0,
            freshness=rng.uniform(0.05, 1.0),
            num_tokens=256,
            payload=None,
        )
        for t in range(first, first + count)
    ]


def _timed_ns(fn, *, keep_gc: bool) -> float:
    import gc

    if not keep_gc:
        gc.disable()
    try:
        start = time.perf_counter_ns()
        fn()
        return float(time.perf_counter_ns() - start)
    finally:
        gc.enable()


def measure(order: str, num_items: int, *, ops: int, repeats: int, group_size: int, keep_gc: bool) -> Row:
    """One (order, size) cell; scaling columns are filled in by `run_buffer_bench`."""
    import gc
    import random

    from asyncrl.buffer.store import Buffer

    if num_items % group_size or ops < group_size:
        raise ValueError(
            f"sizes must be multiples of --group-size ({group_size}) and --ops at least one group"
        )
    rng = random.Random(num_items)
    buf = Buffer(order=order, max_staleness=1_000_000, freshness_floor=0.01)
    fill = _items(0, num_items, group_size, rng)
    start = time.perf_counter()
    for item in fill:
        buf.put(item)
    fill_s = time.perf_counter() - start
    del fill
    gc.collect()
    num_groups = ops // group_size
    put_ns, sample_ns = [], []
    next_id = num_items
    for _ in range(repeats):
        batch = _items(next_id, num_groups * group_size, group_size, rng)
        next_id += len(batch)

        def put_all(batch=batch) -> None:
            put = buf.put
            for item in batch:
                put(item)

        def sample_all() -> None:
            sample = buf.sample
            for _ in range(num_groups):
                sample(1)

        put_ns.append(_timed_ns(put_all, keep_gc=keep_gc) / len(batch))
        sample_ns.append(_timed_ns(sample_all, keep_gc=keep_gc) / num_groups)
        if len(buf) != num_items:
            raise AssertionError(f"buffer holds {len(buf)} items, expected {num_items}")
    put, per_group = statistics.median(put_ns), statistics.median(sample_ns)
    return Row(
        order=order,
        num_items=num_items,
        fill_s=fill_s,
        put_ns=put,
        sample_ns_per_group=per_group,
        sample_ns=per_group / group_size,
        put_items_per_s=1e9 / put,
        sample_items_per_s=1e9 * group_size / per_group,
        put_scaling=1.0,
        sample_scaling=1.0,
    )


def run_buffer_bench(
    *,
    sizes=DEFAULT_SIZES,
    orders=ORDERS,
    ops: int = 40_000,
    repeats: int = 5,
    group_size: int = 8,
    keep_gc: bool = False,
    on_row=None,
) -> dict:
    """Every (order, size) cell, smallest size first; `on_row(row)` is called as each finishes."""
    unknown = [o for o in orders if o not in ORDERS]
    if unknown:
        raise ValueError(f"unknown buffer order(s) {unknown}; valid: {', '.join(ORDERS)}")
    rows: list[Row] = []
    for order in orders:
        base: Row | None = None
        for n in sorted(sizes):
            row = measure(order, n, ops=ops, repeats=repeats, group_size=group_size, keep_gc=keep_gc)
            base = base or row
            row = row._replace(
                put_scaling=row.put_ns / base.put_ns,
                sample_scaling=row.sample_ns_per_group / base.sample_ns_per_group,
            )
            rows.append(row)
            if on_row is not None:
                on_row(row)
    return {
        "group_size": group_size,
        "ops": ops,
        "repeats": repeats,
        "gc": keep_gc,
        "rows": [r._asdict() for r in rows],
    }


def _print_row(row: Row, *, header: bool) -> None:
    if header:
        typer.echo(
            f"{'order':<9} {'items':>9} {'fill s':>7} {'put ns':>7} {'put/s':>10} "
            f"{'sample ns/group':>15} {'sample items/s':>14} {'put x':>6} {'sample x':>8}"
        )
    typer.echo(
        f"{row.order:<9} {row.num_items:>9,} {row.fill_s:>7.2f} {row.put_ns:>7.0f} {row.put_items_per_s:>10,.0f} "
        f"{row.sample_ns_per_group:>15.0f} {row.sample_items_per_s:>14,.0f} {row.put_scaling:>6.2f} "
        f"{row.sample_scaling:>8.2f}"
    )


def command(
    size: Annotated[
        list[int] | None, typer.Option("--size", help="Items held while timing (repeatable)")
    ] = None,
    order: Annotated[
        list[str] | None, typer.Option("--order", help="fifo, freshest, windowed (repeatable)")
    ] = None,
    ops: Annotated[int, typer.Option(help="Items put and sampled per repeat", min=1)] = 40_000,
    repeats: Annotated[int, typer.Option(help="Repeats per cell (the median is reported)", min=1)] = 5,
    group_size: Annotated[int, typer.Option(help="Samples per group", min=1)] = 8,
    gc: Annotated[bool, typer.Option("--gc", help="Keep the garbage collector on while timing")] = False,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print one JSON document instead of a table")
    ] = False,
) -> None:
    """Buffer insert and sample throughput at 10^4..10^6 trajectories held, and the cost scaling."""
    rows_seen: list[Row] = []

    def on_row(row: Row) -> None:
        rows_seen.append(row)
        if not as_json:
            _print_row(row, header=len(rows_seen) == 1)

    try:
        result = run_buffer_bench(
            sizes=tuple(size or DEFAULT_SIZES),
            orders=tuple(order or ORDERS),
            ops=ops,
            repeats=repeats,
            group_size=group_size,
            keep_gc=gc,
            on_row=on_row,
        )
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    if as_json:
        typer.echo(json.dumps(result, indent=2))
