"""Weight sync end to end between real processes on 127.0.0.1, for each transport: the learner's
publisher (asyncrl.transport.publisher) in the test process, two generator processes running the
generator-side receiver (asyncrl.transport.receiver), the test forwarding announcements as the
launcher does. After every version each generator holds bitwise the learner's tensors; retention
never deletes a version a generator still uses. Processes are started and ended by this test only.
"""

from __future__ import annotations

import asyncio
import hashlib
import multiprocessing as mp
import traceback
from multiprocessing.connection import Connection
from pathlib import Path

import msgspec
import pytest
import torch

from asyncrl.messages import BroadcastPublished, ShardsPublished, WeightsPublished
from asyncrl.transport.publisher import BroadcastPublisher, ShardPublisher
from asyncrl.transport.retention import list_versions, spare_dirs

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]
GENERATORS = ("gen-0", "gen-1")


def state(version: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(version)
    f32 = torch.randn(33, 17, generator=g)
    f32[0, :3] = torch.tensor([float("nan"), -0.0, float("inf")])
    return {
        "model.embed_tokens.weight": torch.randn(64, 16, generator=g).to(torch.bfloat16),
        "model.layers.0.mlp.weight": f32,
        "model.layers.0.norm.weight": torch.randn(16, generator=g),
        "model.layers.0.count": torch.randint(0, 1 << 40, (3,), generator=g),
        "lm_head.weight": torch.randn(20000, generator=g),  # > bucket: a bucket of its own
    }


def digest(tensors: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def generator(conn: Connection, generator_id: str) -> None:
    """Acts on each forwarded announcement in order; reports what it fetched as a digest."""
    from asyncrl.transport.receiver import WeightsReceiver

    receiver = WeightsReceiver(generator_id)
    try:
        while (raw := conn.recv_bytes()) != b"stop":
            msg = msgspec.json.decode(raw, type=WeightsPublished)
            if not receiver.plan(msg):
                conn.send_bytes(msgspec.json.encode({"version": msg.version, "skipped": True}))
                continue
            got = receiver.fetch(msg)
            conn.send_bytes(msgspec.json.encode({"version": msg.version, "digest": digest(got)}))
        receiver.close()
    except Exception:
        conn.send_bytes(msgspec.json.encode({"error": traceback.format_exc()}))
        raise


@pytest.fixture
def generators():
    ctx = mp.get_context("spawn")
    procs, conns = [], []
    for gid in GENERATORS:
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=generator, args=(child, gid), name=f"test-{gid}", daemon=True)
        proc.start()
        child.close()
        procs.append(proc)
        conns.append(parent)
    yield conns
    for conn in conns:
        try:
            conn.send_bytes(b"stop")
        except OSError:
            pass
    for proc in procs:  # only the processes this fixture started
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()
            proc.join()


async def publish_and_collect(publisher, conns, version: int) -> list[dict]:
    """One publish; the announcements go to every generator (as the launcher forwards them)."""
    sent: list[WeightsPublished] = []

    async def announce(msg: WeightsPublished) -> None:
        sent.append(msg)
        for conn in conns:
            conn.send_bytes(msgspec.json.encode(msg))

    await publisher.publish(state(version), version, announce)
    replies = []
    for conn in conns:
        for _ in sent:
            reply = msgspec.json.decode(await asyncio.to_thread(conn.recv_bytes))
            assert "error" not in reply, reply["error"]
            replies.append(reply)
    return replies


def shard_publisher(root: Path, *, catchup: bool = False) -> ShardPublisher:
    return ShardPublisher(
        root, extra_files={}, keep_last=1, generator_ids=GENERATORS, max_shard_bytes=4096, catchup=catchup
    )


def test_shards_give_every_generator_bitwise_identical_weights(tmp_path, generators) -> None:
    """From version 3 on each version is written into the files of a pruned one (recycled)."""

    async def scenario() -> None:
        publisher = shard_publisher(tmp_path)
        for version in (1, 2, 3, 4):
            replies = await publish_and_collect(publisher, generators, version)
            assert [r["digest"] for r in replies] == [digest(state(version))] * len(GENERATORS)
            for gid in GENERATORS:
                publisher.on_loaded(gid, version)
        assert list_versions(tmp_path) == [4] and len(spare_dirs(tmp_path)) == 1

    asyncio.run(scenario())


def test_broadcast_gives_every_generator_bitwise_identical_weights(tmp_path, generators) -> None:
    async def scenario() -> None:
        publisher = BroadcastPublisher(
            generator_ids=GENERATORS,
            bucket_bytes=4096,
            timeout_s=60,
            catchup=shard_publisher(tmp_path, catchup=True),
        )
        try:
            for version in (1, 2, 3):
                replies = await publish_and_collect(publisher, generators, version)
                fetched = [r for r in replies if not r.get("skipped")]
                # members take the bytes over the group and skip the catch-up copy
                assert [r["digest"] for r in fetched] == [digest(state(version))] * len(GENERATORS)
                assert sum(1 for r in replies if r.get("skipped")) == len(GENERATORS)
                for gid in GENERATORS:
                    publisher.on_loaded(gid, version)
            assert list_versions(tmp_path) == [3]  # catch-up shards kept for late joiners
        finally:
            publisher.close()

    asyncio.run(scenario())


def test_retention_never_deletes_a_version_in_use(tmp_path) -> None:
    async def scenario() -> None:
        publisher = shard_publisher(tmp_path)  # keep_last=1

        async def announce(msg: WeightsPublished) -> None:
            pass

        for version in (1, 2, 3):
            await publisher.publish(state(version), version, announce)
        assert list_versions(tmp_path) == [1, 2, 3]  # gen-0 and gen-1 are pinned at version 0
        publisher.on_loaded("gen-0", 3)
        publisher.on_loaded("gen-1", 2)
        assert list_versions(tmp_path) == [2, 3]  # 2 is still in use by gen-1
        await publisher.publish(state(4), 4, announce)
        publisher.on_loaded("gen-0", 4)
        assert list_versions(tmp_path) == [2, 3, 4]
        publisher.on_loaded("gen-1", 4)
        assert list_versions(tmp_path) == [4]

    asyncio.run(scenario())


def test_late_generator_outside_the_group_takes_catch_up_shards(tmp_path) -> None:
    """A generator whose first announcement is not the group's founding one cannot join the group
    (a group cannot grow): it skips broadcasts and loads the catch-up shards."""
    from asyncrl.transport.receiver import WeightsReceiver
    from asyncrl.transport.shards import write_shards

    write_shards(state(3), tmp_path, 3, max_shard_bytes=4096, fsync=False)
    receiver = WeightsReceiver("gen-0")
    broadcast = BroadcastPublished(
        version=3,
        store_address="127.0.0.1:1",
        num_bytes=0,
        tensors=(),
        bucket_bytes=1 << 20,
        group_name="late",
        group_backend="gloo",
        group_members=GENERATORS,
        group_first_version=1,
    )
    catchup = ShardsPublished(version=3, root=str(tmp_path), num_bytes=0, catchup=True)
    assert not receiver.plan(broadcast)
    assert receiver.plan(catchup)
    assert digest(receiver.fetch(catchup)) == digest(state(3))
