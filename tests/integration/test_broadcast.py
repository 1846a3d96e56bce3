"""Weight update group over gloo on 127.0.0.1 with real processes (asyncrl.transport.broadcast).

Rank 0 plays the learner and sends; the other ranks play generators and receive. Every process
builds the same deterministic tensors itself and reports only comparisons, so no tensor crosses the
result queue. Processes are started by the test and ended only by it. The bucket planner, which is
pure, is tested first.
"""

from __future__ import annotations

import multiprocessing as mp
import socket
import traceback
from collections.abc import Callable

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncrl.messages import TensorMeta
from asyncrl.transport.broadcast import Bucket, layout_fingerprint, plan_buckets

TIMEOUT_S = 60.0  # gloo and store timeout inside the workers; the pytest timeout is the outer guard
BUCKET_BYTES = 4096


def free_ports(n: int) -> list[int]:
    """`n` distinct free loopback ports (all held open at once, so they differ)."""
    socks = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def weights() -> dict[str, torch.Tensor]:
    """Mixed dtypes, odd sizes, special float bits, an empty tensor, a scalar, a non-contiguous one."""
    g = torch.Generator().manual_seed(1234)
    f32 = torch.randn(37, 29, generator=g)
    f32[0, :4] = torch.tensor([float("nan"), float("inf"), -0.0, float("-inf")])
    return {
        "model.embed_tokens.weight": torch.randn(101, 7, generator=g).to(torch.bfloat16),
        "model.layers.0.self_attn.q_proj.weight": f32,
        "model.layers.0.mlp.up_proj.weight": torch.randn(13, 3, generator=g).to(torch.bfloat16),
        "model.layers.0.counter": torch.randint(-(2**62), 2**62, (5,), generator=g, dtype=torch.int64),
        "model.layers.0.norm.weight": torch.randn(3, generator=g),
        "model.layers.1.big": torch.randn(1531, generator=g),  # > BUCKET_BYTES: a bucket of its own
        "model.layers.1.transposed": torch.randn(9, 11, generator=g).t(),  # non-contiguous
        "model.layers.1.empty": torch.empty(0, 4, dtype=torch.bfloat16),
        "model.layers.1.scalar": torch.tensor(7, dtype=torch.int64),
        "lm_head.weight": torch.randn(17, 5, generator=g).to(torch.bfloat16),
    }


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(
        a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8)
    )


_DTYPE_NAMES = ["float64", "float32", "bfloat16", "float16", "int64", "int32", "int8", "bool", "uint8"]


def meta(name: str, dtype: str, *shape: int) -> TensorMeta:
    return TensorMeta(name=name, dtype=dtype, shape=shape)


@settings(max_examples=200, deadline=None)
@given(
    specs=st.lists(
        st.tuples(st.sampled_from(_DTYPE_NAMES), st.lists(st.integers(0, 9), max_size=3)),
        min_size=1,
        max_size=12,
    ),
    bucket_bytes=st.integers(1, 300),
)
def test_buckets_are_aligned_gapless_and_cover_every_tensor_once(specs: list, bucket_bytes: int) -> None:
    metas = [meta(f"t{i}", dtype, *shape) for i, (dtype, shape) in enumerate(specs)]
    buckets = plan_buckets(metas, bucket_bytes=bucket_bytes)
    names = [e.name for b in buckets for e in b.entries]
    assert sorted(names) == sorted(m.name for m in metas)
    for bucket in buckets:
        offset = 0
        for e in bucket.entries:
            itemsize = getattr(torch, e.dtype).itemsize
            assert e.offset_bytes == offset and e.offset_bytes % itemsize == 0
            offset += e.num_bytes
        assert bucket.num_bytes == offset
        assert bucket.num_bytes <= bucket_bytes or len(bucket.entries) == 1


def test_small_tensors_share_buckets_across_large_ones() -> None:
    metas = [
        meta("a", "float32", 2),
        meta("big1", "bfloat16", 64),
        meta("b", "int8", 3),
        meta("big2", "int64", 20),
    ]
    buckets = plan_buckets(metas, bucket_bytes=100)
    assert [[e.name for e in b.entries] for b in buckets] == [["big1"], ["big2"], ["a", "b"]]
    assert [(e.offset_bytes, e.num_bytes) for e in buckets[2].entries] == [(0, 8), (8, 3)]
    assert [(e.name, e.dtype, list(e.shape)) for e in buckets[2].entries] == [
        ("a", "float32", [2]),
        ("b", "int8", [3]),
    ]


def test_plan_rejects_bad_input_and_fingerprints_differ() -> None:
    with pytest.raises(ValueError, match="bucket_bytes"):
        plan_buckets([meta("a", "float32", 1)], bucket_bytes=0)
    with pytest.raises(ValueError, match="twice"):
        plan_buckets([meta("a", "float32", 1), meta("a", "float32", 1)], bucket_bytes=8)
    with pytest.raises(ValueError, match="dtype"):
        plan_buckets([meta("a", "float33", 1)], bucket_bytes=8)
    with pytest.raises(ValueError, match="negative"):
        plan_buckets([meta("a", "float32", -1)], bucket_bytes=8)
    metas = [meta("a", "float32", 4), meta("b", "float32", 3)]
    plan: list[Bucket] = plan_buckets(metas, bucket_bytes=64)
    assert layout_fingerprint(plan) == layout_fingerprint(plan_buckets(metas, bucket_bytes=64))
    assert layout_fingerprint(plan) != layout_fingerprint(plan_buckets(metas, bucket_bytes=8))
    assert layout_fingerprint(plan) != layout_fingerprint(plan_buckets(metas[::-1], bucket_bytes=64))
    assert layout_fingerprint(plan) != layout_fingerprint(plan, p2p=True) > 0


def metas_of(tensors: dict[str, torch.Tensor]) -> list[TensorMeta]:
    from asyncrl.transport.broadcast import tensor_metas

    return tensor_metas(tensors)


def run_exchange(
    pg: object, rank: int, *, bucket_bytes: int, into: bool, p2p: bool = False, local: str = "shm"
) -> list[str]:
    """Rank 0 sends weights() (receivers on this host through the shared-memory ring unless
    `local` is "gloo"); other ranks receive; returns the names that arrived wrong."""
    from asyncrl.transport.broadcast import broadcast_tensors, receive_tensors

    expected = weights()
    if rank == 0:
        broadcast_tensors(pg, expected, bucket_bytes=bucket_bytes, p2p=p2p, local=local)
        return []
    if into:  # existing tensors, one of them non-contiguous (received through staging)
        out = {n: torch.full_like(t, 3) for n, t in expected.items()}
        out["model.layers.1.transposed"] = torch.zeros(9, 11).t()
        got = receive_tensors(pg, metas_of(expected), bucket_bytes=bucket_bytes, out=out, p2p=p2p)
        bad = [n for n in expected if got[n] is not out[n]]
    else:
        got = receive_tensors(pg, metas_of(expected), bucket_bytes=bucket_bytes, p2p=p2p)
        bad = []
    bad += [n for n, t in expected.items() if not same_bits(got[n], t)]
    if list(got) != list(expected):
        bad.append("<order>")
    return bad


def worker(rank: int, port: int, dp_port: int | None, results: mp.Queue) -> None:
    """Ranks 0..2 form the weight group. With `dp_port`, ranks 0 and 1 also form a 2-rank default
    (data-parallel) group and use it before, between and after weight updates."""
    import torch.distributed as dist

    from asyncrl.transport.broadcast import init_weight_update_group

    report: dict[str, object] = {"rank": rank, "bad_p2p": []}
    in_dp = dp_port is not None and rank < 2
    if in_dp:  # default-group ranks are the reverse of weight-group ranks: `src` must be group-local
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{dp_port}", rank=1 - rank, world_size=2)
        x = torch.tensor([rank + 1.0])
        dist.all_reduce(x)  # default group works before the weight group exists
        report["dp_before"] = x.item()
    pg = init_weight_update_group(
        master_addr="127.0.0.1",
        master_port=port,
        rank=rank,
        world_size=3,
        group_name="weight_update_group",
        timeout_s=TIMEOUT_S,
    )
    # Small buckets: multi-tensor buckets (staged), one-tensor buckets (direct) and an empty tensor.
    report["bad_small_buckets"] = run_exchange(pg, rank, bucket_bytes=BUCKET_BYTES, into=rank == 2)
    if in_dp:
        y = torch.tensor([10.0 * (rank + 1)])
        dist.all_reduce(y)  # default group still works between two weight updates
        report["dp_between"] = y.item()
        report["dp_world"] = (dist.get_rank(), dist.get_world_size())
        report["name_taken"] = _group_name_is_taken("weight_update_group")
    report["bad_large_buckets"] = run_exchange(pg, rank, bucket_bytes=1 << 20, into=rank == 1)
    # Point to point (what gloo groups use): more buckets in flight than staging slots, both ways,
    # over gloo's sends and through the shared-memory ring (the default on one host).
    # Buckets of 256 bytes leave the non-contiguous tensor (396 bytes) alone in a staged bucket
    # larger than any shared one: regression, the staging buffer was sized by shared buckets only
    # and the view into it failed.
    for local in ("gloo", "shm"):
        report["bad_p2p"] += run_exchange(
            pg, rank, bucket_bytes=BUCKET_BYTES // 16, into=rank == 1, p2p=True, local=local
        )
        report["bad_p2p"] += run_exchange(
            pg, rank, bucket_bytes=BUCKET_BYTES, into=rank == 2, p2p=True, local=local
        )
    report["bad_p2p"] += run_exchange(pg, rank, bucket_bytes=BUCKET_BYTES // 16, into=rank == 2)
    # A receiver that broadcasts while the others send point to point: an error everywhere, no hang.
    try:
        run_exchange(pg, rank, bucket_bytes=BUCKET_BYTES, into=False, p2p=rank != 1)
        report["p2p_mismatch_error"] = ""
    except ValueError as e:
        report["p2p_mismatch_error"] = str(e)
    # A receiver planning with a different bucket size must make every rank fail, not hang.
    try:
        run_exchange(pg, rank, bucket_bytes=BUCKET_BYTES * (2 if rank == 2 else 1), into=False)
        report["mismatch_error"] = ""
    except ValueError as e:
        report["mismatch_error"] = str(e)
    dist.destroy_process_group(pg)
    if in_dp:
        z = torch.tensor([1.0])
        dist.all_reduce(z)  # and after the weight group is gone
        report["dp_end"] = z.item()
        dist.destroy_process_group()
    results.put(report)


def _group_name_is_taken(name: str) -> bool:
    from asyncrl.transport.broadcast import init_weight_update_group

    try:
        init_weight_update_group(
            master_addr="127.0.0.1", master_port=1, rank=0, world_size=1, group_name=name, timeout_s=1.0
        )
    except ValueError:
        return True
    return False


def _entry(target: Callable[..., None], *args: object) -> None:
    results = args[-1]
    try:
        target(*args)
    except BaseException:  # report any failure to the parent instead of leaving it waiting
        results.put({"rank": args[0], "error": traceback.format_exc()})
        raise


def run_ranks(target: Callable[..., None], world_size: int, *extra: object) -> list[dict]:
    # fork, not spawn: a spawned child re-imports torch, which takes ~5 s per process on a loaded
    # 2-core machine. The parent never initialises torch.distributed, and torch resets its intra-op
    # thread pool in a forked child, so the children start clean.
    ctx = mp.get_context("fork")
    results = ctx.Queue()
    procs = [
        ctx.Process(target=_entry, args=(target, rank, *extra, results), name=f"rank{rank}", daemon=True)
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()
    try:
        reports = [results.get(timeout=TIMEOUT_S * 2) for _ in procs]
        for p in procs:
            p.join(timeout=TIMEOUT_S)
    finally:
        for p in procs:  # only the processes this test started
            if p.is_alive():
                p.kill()
                p.join()
    errors = [r["error"] for r in reports if "error" in r]
    assert not errors, "\n".join(errors)
    return sorted(reports, key=lambda r: r["rank"])


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_receivers_get_bitwise_identical_tensors() -> None:
    reports = run_ranks(worker, 3, *free_ports(1), None)
    assert [(r["bad_small_buckets"], r["bad_large_buckets"], r["bad_p2p"]) for r in reports] == [
        ([], [], [])
    ] * 3
    # an exchange planned different buckets on rank 2, another mixed p2p and broadcast: every rank
    # raised instead of hanging
    assert all("layout differs" in r["mismatch_error"] for r in reports), reports
    assert all("layout differs" in r["p2p_mismatch_error"] for r in reports), reports


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_weight_group_coexists_with_default_group() -> None:
    reports = run_ranks(worker, 3, *free_ports(2))
    assert [(r["bad_small_buckets"], r["bad_large_buckets"]) for r in reports] == [([], [])] * 3
    for r in reports[:2]:
        assert (r["dp_before"], r["dp_between"], r["dp_end"]) == (3.0, 30.0, 2.0)
        assert r["dp_world"] == (1 - r["rank"], 2)
        assert r["name_taken"]
    assert "dp_before" not in reports[2]
