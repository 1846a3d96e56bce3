"""Weights and the initial model over the network (transport/serve.py), on loopback: a FileServer
on a ROUTER, fetched into a local cache in chunks, checked against the manifest's checksums."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest
import torch
import zmq

from asyncrl.messages import FileChunk, FileRequest
from asyncrl.transport.delta import DeltaBase
from asyncrl.transport.manifest import WeightsCorruptError
from asyncrl.transport.receiver import WeightsReceiver
from asyncrl.transport.retention import list_versions, version_dir
from asyncrl.transport.serve import CHUNK_BYTES, FileServer, NetworkWeights, fetch_tree, list_tree
from asyncrl.transport.shard_read import read_shards
from asyncrl.transport.shards import write_shards
from asyncrl.transport.zmq_io import Endpoint


def _state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    # Larger than a chunk, so a shard takes several FileChunks (and a window of requests).
    return {
        "big.weight": torch.randn(3 * CHUNK_BYTES // 4 + 17, generator=g),
        "small.bias": torch.randn(5, generator=g),
    }


async def _serving(roots: dict[str, Path], body):
    """Run `body(zctx, address, server)` against a FileServer serving `roots` on loopback."""
    zctx = zmq.Context()
    server = FileServer(roots)
    ep = Endpoint(zctx, zmq.ROUTER, name="test.files", accept=(FileRequest,))
    address = ep.bind()
    task = asyncio.create_task(server.serve(ep))
    try:
        return await body(zctx, address, server)
    finally:
        task.cancel()
        ep.close()
        zctx.destroy(linger=0)


def test_a_version_fetched_over_the_network_reads_like_local_shards(tmp_path):
    root = tmp_path / "weights"
    state = _state(0)
    write_shards(state, root, 1, max_shard_bytes=CHUNK_BYTES, extra_files={"config.json": b"{}"})
    write_shards(_state(1), root, 2, max_shard_bytes=CHUNK_BYTES)

    async def body(zctx, address, server):
        net = NetworkWeights(zctx, address, tmp_path / "cache")
        cache = await asyncio.to_thread(net.fetch, 1, lambda m: False)
        got = read_shards(cache, 1, verify=True)
        assert got.keys() == state.keys() and all(torch.equal(got[k], state[k]) for k in state)
        assert (version_dir(cache, 1) / "config.json").read_bytes() == b"{}"
        await asyncio.to_thread(net.fetch, 2, lambda m: False)
        assert list_versions(cache) == [2]  # only the newest stays
        assert net.bytes_fetched == server.bytes_served - sum(
            len((version_dir(root, v) / "manifest.json").read_bytes()) for v in (1, 2)
        )
        with pytest.raises(FileNotFoundError):  # pruned on the server, or never published
            await asyncio.to_thread(net.fetch, 7, lambda m: False)
        assert not [p for p in (tmp_path / "cache").iterdir() if p.name.startswith(".")]  # no leftovers

    asyncio.run(_serving({"weights": root}, body))


def test_a_corrupt_shard_on_the_server_is_refused_and_the_receiver_keeps_nothing(tmp_path):
    root = tmp_path / "weights"
    manifest = write_shards(_state(0), root, 1, max_shard_bytes=CHUNK_BYTES)
    shard = version_dir(root, 1) / manifest.files[0].name
    with open(shard, "r+b") as f:  # one flipped byte in the data
        f.seek(os.path.getsize(shard) - 3)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))

    async def body(zctx, address, server):
        receiver = WeightsReceiver("gen-0")
        receiver.remote = NetworkWeights(zctx, address, tmp_path / "cache")
        from asyncrl.messages import ShardsPublished

        msg = ShardsPublished(version=1, root="/not/on/this/host", num_bytes=0)
        with pytest.raises(WeightsCorruptError, match="check"):
            await asyncio.to_thread(receiver.fetch, msg)
        assert list_versions(tmp_path / "cache") == []

    asyncio.run(_serving({"weights": root}, body))


def test_deltas_travel_instead_of_shards_when_the_receiver_holds_the_base(tmp_path):
    root = tmp_path / "weights"
    base = DeltaBase()
    s1, s2 = _state(0), _state(0)
    s2["small.bias"] = s2["small.bias"] + 1
    write_shards(s1, root, 1, max_shard_bytes=CHUNK_BYTES, delta_base=base)
    write_shards(s2, root, 2, max_shard_bytes=CHUNK_BYTES, delta_base=base)
    from asyncrl.messages import ShardsPublished

    async def body(zctx, address, server):
        receiver = WeightsReceiver("gen-0")
        receiver.remote = NetworkWeights(zctx, address, tmp_path / "cache")
        for v, want in ((1, s1), (2, s2)):
            msg = ShardsPublished(version=v, root=str(root), num_bytes=0)
            got = await asyncio.to_thread(receiver.fetch, msg)
            assert all(torch.equal(got[k], want[k]) for k in want)
        assert receiver.num_delta_fetches == 1
        assert receiver.last_fetch_bytes < CHUNK_BYTES  # the delta, not the shards

    asyncio.run(_serving({"weights": root}, body))


def test_the_model_tree_is_fetched_and_checked_and_names_stay_in_their_root(tmp_path):
    model = tmp_path / "model"
    (model / "sub").mkdir(parents=True)
    (model / "config.json").write_text('{"a": 1}')
    (model / "sub" / "tok.json").write_bytes(os.urandom(CHUNK_BYTES + 5))
    (model / ".hidden").write_text("not served")
    (tmp_path / "secret").write_text("outside")
    entries = list_tree(model, "xxh3")
    assert [e.name for e in entries] == ["config.json", "sub/tok.json"]

    async def body(zctx, address, server):
        dest = tmp_path / "copy"
        n = await fetch_tree(zctx, address, "model", entries, dest, "xxh3")
        assert n == sum(e.size_bytes for e in entries)
        for e in entries:
            assert (dest / e.name).read_bytes() == (model / e.name).read_bytes()
        bad = [entries[0].__class__(name="config.json", size_bytes=entries[0].size_bytes, checksum="0" * 32)]
        with pytest.raises(WeightsCorruptError):
            await fetch_tree(zctx, address, "model", bad, tmp_path / "bad", "xxh3")
        client = Endpoint(zctx, zmq.DEALER, name="test.client", accept=(FileChunk,))
        client.connect(address)
        for name in ("../secret", "/etc/passwd", ".hidden", "sub/../../secret"):
            await client.send(FileRequest(root="model", name=name, offset=0, max_bytes=100))
            _, reply, _ = await client.recv()
            assert reply.error and not reply.data, name
        client.close()
        assert server.num_errors == 4

    asyncio.run(_serving({"model": model}, body))
