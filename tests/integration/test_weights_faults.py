"""Transactional weight updates between real processes on 127.0.0.1 (issue #25): the learner's
publisher in the test process, generator processes running the generator-side receiver, the test
forwarding announcements as the launcher does. Faults are injected inside the generator processes:

- a broadcast member that dies mid-transfer, over gloo and through the same-host shared-memory
  ring (weights.broadcast_local): the learner finishes the transfer to the others, drops only that
  member (no rank waits for it), writes the catch-up shards, and the next version still goes over
  the group; a restarted generator takes catch-up shards;
- a generator killed mid-load of a delta update: the learner's deadline names it, retention keeps
  the version it holds, and the restarted generator loads the full version (not a delta whose
  base it does not hold), then takes deltas again;
- twenty delta updates leave every generator bitwise equal to the learner.

Processes are started and ended by this test only (by their handles).
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing as mp
import os
import traceback
from multiprocessing.connection import Connection
from pathlib import Path

import msgspec
import pytest
import torch

from asyncrl.messages import ShardsPublished, WeightsPublished
from asyncrl.transport.publisher import BroadcastPublisher, ShardPublisher
from asyncrl.transport.retention import list_versions
from tests.integration.test_weights_sync import digest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]
GENERATORS = ("gen-0", "gen-1")
# Far longer than the test's own timeout: a rank that waited for a dead one would fail the test.
GROUP_TIMEOUT_S = 900.0
DIED = 17


def state(version: int) -> dict[str, torch.Tensor]:
    """Version 0 drawn at random, each later one a small step from it (as training with a small lr)."""
    g = torch.Generator().manual_seed(0)
    sd = {
        "model.embed_tokens.weight": torch.randn(64, 16, generator=g).to(torch.bfloat16),
        "model.layers.0.mlp.weight": torch.randn(33, 17, generator=g),
        "model.layers.0.count": torch.randint(0, 1 << 40, (3,), generator=g),
        "lm_head.weight": torch.randn(20000, generator=g),  # > bucket: buckets of its own
    }
    step = torch.Generator().manual_seed(version)
    return {
        n: (t.float() + 1e-3 * version * torch.randn(t.shape, generator=step)).to(t.dtype)
        if t.is_floating_point()
        else t + version
        for n, t in sd.items()
    }


def generator(conn: Connection, generator_id: str, fault: dict) -> None:
    """Acts on each forwarded announcement in order and replies with a digest of what it fetched.

    `fault`: {"die_in_receive": [version, n]}: exit at the n-th gloo receive of that version's
    broadcast; {"die_in_ring": [version, n]}: exit at the n-th chunk of that version taken from the
    shared-memory ring; {"hang_in_read": version}: tell the test it is reading that version, then
    hang."""
    import torch.distributed as dist

    from asyncrl.transport import shard_read, shm_ring
    from asyncrl.transport.receiver import WeightsReceiver

    current = {"version": -1, "receives": 0}
    if "die_in_ring" in fault:
        die_version, die_at = fault["die_in_ring"]
        real_next_chunk = shm_ring.RecvRing._next_chunk

        def next_chunk(self):
            if current["version"] == die_version:
                current["receives"] += 1
                if current["receives"] == die_at:
                    os._exit(DIED)  # dies mid-transfer, as a crash would: no cleanup
            return real_next_chunk(self)

        shm_ring.RecvRing._next_chunk = next_chunk
    if "die_in_receive" in fault:
        die_version, die_at = fault["die_in_receive"]
        real_irecv = dist.irecv

        def irecv(*args, **kwargs):
            if current["version"] == die_version:
                current["receives"] += 1
                if current["receives"] == die_at:
                    os._exit(DIED)  # dies mid-transfer, as a crash would: no cleanup
            return real_irecv(*args, **kwargs)

        dist.irecv = irecv
    if "hang_in_read" in fault:
        real_read = shard_read.read_shards

        def read_shards(root, version, **kwargs):
            if version == fault["hang_in_read"]:
                conn.send_bytes(msgspec.json.encode({"version": version, "loading": True}))
                conn.recv_bytes()  # never answered: the test kills this process here
            return real_read(root, version, **kwargs)

        shard_read.read_shards = read_shards

    receiver = WeightsReceiver(generator_id)
    try:
        while (raw := conn.recv_bytes()) != b"stop":
            msg = msgspec.json.decode(raw, type=WeightsPublished)
            current["version"] = msg.version
            if not receiver.plan(msg):
                conn.send_bytes(msgspec.json.encode({"version": msg.version, "skipped": True}))
                continue
            got = receiver.fetch(msg)
            reply = {"version": msg.version, "digest": digest(got), "delta": receiver.last_fetch_delta}
            conn.send_bytes(msgspec.json.encode(reply))
        receiver.close()
    except Exception:
        conn.send_bytes(msgspec.json.encode({"error": traceback.format_exc()}))
        raise


class Generators:
    """The generator processes of one test, by id; restart = a new process under the same id."""

    def __init__(self) -> None:
        self.ctx = mp.get_context("spawn")
        self.procs: dict[str, mp.Process] = {}
        self.conns: dict[str, Connection] = {}
        self.ended: list[mp.Process] = []

    def start(self, gid: str, **fault: object) -> None:
        parent, child = self.ctx.Pipe()
        proc = self.ctx.Process(target=generator, args=(child, gid, fault), name=f"test-{gid}", daemon=True)
        proc.start()
        child.close()
        if gid in self.procs:
            self.ended.append(self.procs[gid])
        self.procs[gid], self.conns[gid] = proc, parent

    def forward(self, msg: WeightsPublished, to: list[str]) -> None:
        for gid in to:
            try:
                self.conns[gid].send_bytes(msgspec.json.encode(msg))
            except OSError:  # a generator that died: the launcher's send would go nowhere too
                pass

    async def reply(self, gid: str) -> dict:
        reply = msgspec.json.decode(await asyncio.to_thread(self.conns[gid].recv_bytes))
        assert "error" not in reply, reply["error"]
        return reply

    def kill(self, gid: str) -> int:
        proc = self.procs[gid]
        proc.kill()
        proc.join()
        return proc.exitcode

    def close(self) -> None:
        for conn in self.conns.values():
            try:
                conn.send_bytes(b"stop")
            except OSError:
                pass
        for proc in [*self.procs.values(), *self.ended]:  # only the processes this test started
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
                proc.join()


@pytest.fixture
def gens():
    gens = Generators()
    yield gens
    gens.close()


async def publish(publisher, gens: Generators, version: int, to: list[str]) -> list[WeightsPublished]:
    sent: list[WeightsPublished] = []

    async def announce(msg: WeightsPublished) -> None:
        sent.append(msg)
        gens.forward(msg, to)

    await publisher.publish(state(version), version, announce)
    return sent


def shard_publisher(root: Path, **kwargs) -> ShardPublisher:
    return ShardPublisher(
        root, extra_files={}, keep_last=1, generator_ids=GENERATORS, max_shard_bytes=4096, **kwargs
    )


# gen-1's 3rd gloo receive of version 2 is its 2nd bucket (the 1st is the layout verdict); its 3rd
# chunk from the ring starts 8 KiB into the version's 84 KB (slots of one 4 KiB bucket).
@pytest.mark.parametrize(("local", "fault"), [("gloo", "die_in_receive"), ("shm", "die_in_ring")])
def test_a_broadcast_member_that_dies_mid_transfer_is_dropped_alone(
    tmp_path, gens, caplog, local, fault
) -> None:
    async def scenario() -> None:
        gens.start("gen-0")
        gens.start("gen-1", **{fault: [2, 3]})
        publisher = BroadcastPublisher(
            generator_ids=GENERATORS,
            bucket_bytes=4096,
            timeout_s=GROUP_TIMEOUT_S,
            catchup=shard_publisher(tmp_path, catchup=True),
            local=local,
        )
        try:
            sent = await publish(publisher, gens, 1, list(GENERATORS))
            for gid in GENERATORS:  # broadcast taken, catch-up copy skipped
                assert (await gens.reply(gid))["digest"] == digest(state(1))
                assert (await gens.reply(gid))["skipped"] and len(sent) == 2
            # gen-1 dies mid-transfer of version 2; the publish returns (nobody waits on it)
            await publish(publisher, gens, 2, list(GENERATORS))
            gens.procs["gen-1"].join(timeout=60)
            assert gens.procs["gen-1"].exitcode == DIED
            assert publisher.lost == {"gen-1"} and not publisher.failed and publisher.group is not None
            assert (await gens.reply("gen-0"))["digest"] == digest(state(2))  # the others got every byte
            assert (await gens.reply("gen-0"))["skipped"]
            assert "lost gen-1" in caplog.text
            # the run goes on: version 3 over the group to gen-0; gen-1, restarted, joins late and
            # takes the catch-up shards
            gens.start("gen-1")
            sent = await publish(publisher, gens, 3, list(GENERATORS))
            assert [m.transport for m in sent] == ["broadcast", "shards"]
            assert (await gens.reply("gen-0"))["digest"] == digest(state(3))
            assert (await gens.reply("gen-0"))["skipped"]
            assert (await gens.reply("gen-1"))["skipped"]  # the broadcast: not a member
            assert (await gens.reply("gen-1"))["digest"] == digest(state(3))  # the catch-up shards
        finally:
            publisher.close()

    with caplog.at_level(logging.ERROR, logger="asyncrl.transport.publisher"):
        asyncio.run(scenario())


class _Said(logging.Handler):
    """Sets an asyncio event (thread-safely) when a record containing `text` is logged."""

    def __init__(self, text: str, loop: asyncio.AbstractEventLoop, event: asyncio.Event) -> None:
        super().__init__(logging.WARNING)
        self.text, self.loop, self.event = text, loop, event

    def emit(self, record: logging.LogRecord) -> None:
        if self.text in record.getMessage():
            self.loop.call_soon_threadsafe(self.event.set)


def test_a_generator_killed_mid_load_is_named_and_its_restart_loads_the_full_version(tmp_path, gens) -> None:
    async def scenario() -> None:
        gens.start("gen-0")
        gens.start("gen-1", hang_in_read=2)
        publisher = shard_publisher(tmp_path, delta=True, deadline_s=0.5)
        named = asyncio.Event()
        handler = _Said("weights version 2: no WeightsLoaded from gen-1", asyncio.get_running_loop(), named)
        logging.getLogger("asyncrl.transport.publisher").addHandler(handler)
        try:
            await publish(publisher, gens, 1, list(GENERATORS))
            for gid in GENERATORS:
                assert (await gens.reply(gid))["digest"] == digest(state(1))
                publisher.on_loaded(gid, 1)
            await publish(publisher, gens, 2, list(GENERATORS))
            reply = await gens.reply("gen-0")
            assert reply["digest"] == digest(state(2)) and reply["delta"]
            publisher.on_loaded("gen-0", 2)
            assert (await gens.reply("gen-1"))["loading"]
            gens.kill("gen-1")  # mid-load
            # the learner says whom it waits for, and keeps the version gen-1 still holds
            await asyncio.wait_for(named.wait(), 60)
            assert list_versions(tmp_path) == [1, 2]
            # restarted, gen-1 is sent the latest announcement (as the launcher does): it holds no
            # base, so it reads the full version 2, then takes version 3 as a delta
            gens.start("gen-1")
            gens.forward(msg_of(tmp_path, 2), ["gen-1"])
            reply = await gens.reply("gen-1")
            assert reply["digest"] == digest(state(2)) and not reply["delta"]
            publisher.on_loaded("gen-1", 2)
            assert list_versions(tmp_path) == [2]
            await publish(publisher, gens, 3, list(GENERATORS))
            for gid in GENERATORS:
                reply = await gens.reply(gid)
                assert reply["digest"] == digest(state(3)) and reply["delta"]
        finally:
            logging.getLogger("asyncrl.transport.publisher").removeHandler(handler)
            publisher.close()

    asyncio.run(scenario())


def msg_of(root: Path, version: int) -> ShardsPublished:
    return ShardsPublished(version=version, root=str(root), num_bytes=0)


def test_twenty_delta_updates_leave_every_generator_bitwise_equal(tmp_path, gens) -> None:
    async def scenario() -> None:
        for gid in GENERATORS:
            gens.start(gid)
        publisher = shard_publisher(tmp_path, delta=True)
        try:
            for version in range(21):
                await publish(publisher, gens, version, list(GENERATORS))
                for gid in GENERATORS:
                    reply = await gens.reply(gid)
                    assert reply["digest"] == digest(state(version))
                    assert reply["delta"] == (version > 0)
                    publisher.on_loaded(gid, version)
            assert 0 < publisher.num_delta_bytes < publisher.num_bytes_written
        finally:
            publisher.close()

    asyncio.run(scenario())
