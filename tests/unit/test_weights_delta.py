"""Fast integrity and delta updates of published weights (asyncrl.transport.checksum, delta,
shards, shard_read, receiver): every checksum kind catches a flipped byte, schema 1 manifests still
load, a delta gives exactly the full version's bytes or is refused, and a reader whose base does
not match reads the full version."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from asyncrl.messages import ShardsPublished
from asyncrl.transport.checksum import CHECKSUM_KINDS, checksum_of
from asyncrl.transport.delta import DeltaBase, HeldVersion
from asyncrl.transport.manifest import ShardManifest, WeightsCorruptError
from asyncrl.transport.receiver import WeightsReceiver
from asyncrl.transport.retention import version_dir
from asyncrl.transport.shard_read import read_manifest, read_shards, verify_files
from asyncrl.transport.shards import write_shards

SHARD_BYTES = 4096  # several shards, so deltas are per file


def initial_state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "model.embed_tokens.weight": torch.randn(64, 16, generator=g).to(torch.bfloat16),
        "model.layers.0.mlp.weight": torch.randn(40, 24, generator=g),
        "model.layers.0.norm.weight": torch.ones(24),
        "model.layers.0.count": torch.zeros(3, dtype=torch.int64),
        "model.layers.0.mask": torch.tensor([True, False, True]),
        "lm_head.weight": torch.randn(3000, generator=g).to(torch.float16),
    }


def train_step(state: dict[str, torch.Tensor], step: int) -> dict[str, torch.Tensor]:
    """A small update to every floating tensor (as an optimizer step with a small lr), the counter
    incremented, the rest unchanged; new tensors, as a learner publishes."""
    g = torch.Generator().manual_seed(1000 + step)
    out = {}
    for name, t in state.items():
        if t.is_floating_point():
            noise = torch.randn(t.shape, generator=g) * 1e-3
            out[name] = (t.float() + noise).to(t.dtype)
        elif t.dtype == torch.int64:
            out[name] = t + 1
        else:
            out[name] = t.clone()
    return out


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def assert_bitwise(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert list(got) == list(expected)
    bad = [
        n for n, t in expected.items() if got[n].dtype != t.dtype or not torch.equal(bits(got[n]), bits(t))
    ]
    assert not bad


def announce(root: Path, version: int) -> ShardsPublished:
    return ShardsPublished(version=version, root=str(root), num_bytes=0)


def flip_byte(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def publish_versions(root: Path, num_versions: int, *, checksum: str = "xxh3") -> list[dict]:
    base = DeltaBase()
    states = [initial_state()]
    for _ in range(num_versions):
        states.append(train_step(states[-1], len(states)))
    for version, state in enumerate(states):
        write_shards(
            state, root, version, max_shard_bytes=SHARD_BYTES, fsync=False, checksum=checksum, delta_base=base
        )
    return states


# ---------------------------------------------------------------------------------------------- integrity


@pytest.mark.parametrize("kind", CHECKSUM_KINDS)
def test_every_checksum_kind_is_of_the_bytes_on_disk_and_verified_in_parallel(
    tmp_path: Path, kind: str
) -> None:
    state = initial_state()
    manifest = write_shards(state, tmp_path, 1, max_shard_bytes=SHARD_BYTES, checksum=kind, fsync=False)
    assert manifest.checksum_kind == kind and len(manifest.files) > 2
    vdir = version_dir(tmp_path, 1)
    for record in (*manifest.files, *manifest.extra_files):
        assert checksum_of(kind, (vdir / record.name).read_bytes()) == record.checksum
    assert_bitwise(read_shards(tmp_path, 1, num_threads=2), state)
    assert verify_files(tmp_path, 1) == manifest
    flip_byte(vdir / manifest.files[-1].name, -1)
    with pytest.raises(WeightsCorruptError, match=f"fails its {kind} check"):
        verify_files(tmp_path, 1)


def test_an_unknown_checksum_kind_is_an_error_before_anything_is_written(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown checksum kind 'md5'"):
        write_shards(initial_state(), tmp_path, 1, max_shard_bytes=SHARD_BYTES, checksum="md5")
    assert not list(tmp_path.iterdir())


def test_a_schema_1_manifest_with_sha256_still_loads_and_is_checked(tmp_path: Path) -> None:
    """Versions published before checksum kinds (a `sha256` per file, schema 1) keep loading."""
    state = initial_state()
    manifest = write_shards(state, tmp_path, 4, max_shard_bytes=SHARD_BYTES, checksum="sha256", fsync=False)
    old = json.loads(manifest.to_json())
    old["schema"] = 1
    for key in ("checksum_kind", "delta", "delta_next"):
        del old[key]
    for record in (*old["files"], *old["extra_files"]):
        record["sha256"] = record.pop("checksum")
    vdir = version_dir(tmp_path, 4)
    (vdir / "manifest.json").write_text(json.dumps(old))
    read = read_manifest(tmp_path, 4)
    assert read.checksum_kind == "sha256" and read.files == manifest.files
    assert_bitwise(read_shards(tmp_path, 4), state)
    flip_byte(vdir / manifest.files[0].name, -1)
    with pytest.raises(WeightsCorruptError, match="fails its sha256 check"):
        read_shards(tmp_path, 4)


def test_a_manifest_without_checksums_or_with_a_stray_delta_is_rejected() -> None:
    base = {
        "schema": 2,
        "version": 1,
        "total_size_bytes": 4,
        "checksum_kind": "xxh3",
        "tensors": [{"name": "w", "dtype": "float32", "shape": [1], "file": "a.safetensors"}],
        "files": [{"name": "a.safetensors", "size_bytes": 80, "checksum": "00"}],
    }
    ShardManifest.from_json(json.dumps(base))
    with pytest.raises(ValueError, match="no checksum"):
        ShardManifest.from_json(json.dumps({**base, "files": [{"name": "a.safetensors", "size_bytes": 80}]}))
    with pytest.raises(ValueError, match="checksum kind"):
        ShardManifest.from_json(json.dumps({**base, "checksum_kind": "crc32"}))
    stray = {
        "base_version": 0,
        "base_checksums": ["00"],
        "files": [{"name": "b.xor.zst", "shard": "nope.safetensors", "size_bytes": 1, "checksum": "00"}],
    }
    with pytest.raises(ValueError, match="names no shard"):
        ShardManifest.from_json(json.dumps({**base, "delta": stray}))


# ---------------------------------------------------------------------------------------------- deltas


def test_twenty_delta_updates_leave_the_reader_bitwise_equal_to_the_learner(tmp_path: Path) -> None:
    states = publish_versions(tmp_path, 20)
    receiver = WeightsReceiver("gen-0")
    for version, state in enumerate(states):
        manifest = read_manifest(tmp_path, version)
        assert manifest.delta_next and (manifest.delta is None) == (version == 0)
        got = receiver.fetch(announce(tmp_path, version))
        assert_bitwise(got, state)
        assert receiver.last_fetch_delta == (version > 0)
        if version > 0:
            delta_bytes = sum(d.size_bytes for d in manifest.delta.files)
            assert receiver.last_fetch_bytes == delta_bytes < sum(f.size_bytes for f in manifest.files)
    assert receiver.num_delta_fetches == 20


def test_the_delta_path_reads_no_full_shard(tmp_path: Path) -> None:
    """With the base held, the shards are rebuilt from the deltas alone (here the full files are
    gone) and checked against the full files' checksums."""
    states = publish_versions(tmp_path, 1)
    receiver = WeightsReceiver("gen-0")
    receiver.fetch(announce(tmp_path, 0))
    for record in read_manifest(tmp_path, 1).files:
        (version_dir(tmp_path, 1) / record.name).unlink()
    assert_bitwise(receiver.fetch(announce(tmp_path, 1)), states[1])


def test_a_reader_that_missed_a_version_reads_the_full_one_not_a_wrong_delta(tmp_path: Path) -> None:
    states = publish_versions(tmp_path, 3)
    receiver = WeightsReceiver("gen-0")
    receiver.fetch(announce(tmp_path, 1))  # a late joiner: holds 1, skips 2
    got = receiver.fetch(announce(tmp_path, 3))  # 3 is a delta from 2: not for this reader
    assert not receiver.last_fetch_delta and receiver.num_delta_fetches == 0
    assert_bitwise(got, states[3])
    assert read_manifest(tmp_path, 3).delta.base_version == 2


def test_a_held_base_with_other_bytes_is_refused_by_the_rebuilt_checksum(tmp_path: Path) -> None:
    """Exactness does not rest on the version number: a base whose bytes differ from what was
    published (here one element changed after it was verified) rebuilds bytes the full file's
    checksum refuses."""
    publish_versions(tmp_path, 1)
    held = read_shards(tmp_path, 0)
    held["model.layers.0.mlp.weight"][0, 0] += 1.0
    base = HeldVersion.of(read_manifest(tmp_path, 0), held)
    with pytest.raises(WeightsCorruptError, match="rebuilt from its delta fails its xxh3 check"):
        read_shards(tmp_path, 1, held=base)


@pytest.mark.parametrize("kind", CHECKSUM_KINDS)
@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_a_flipped_byte_in_a_delta_is_caught_and_the_full_version_is_taken_next(
    tmp_path: Path, kind: str, where: str
) -> None:
    states = publish_versions(tmp_path, 2, checksum=kind)
    receiver = WeightsReceiver("gen-0")
    receiver.fetch(announce(tmp_path, 0))
    receiver.fetch(announce(tmp_path, 1))
    delta = max(read_manifest(tmp_path, 2).delta.files, key=lambda d: d.size_bytes)
    offset = {"first": 0, "middle": delta.size_bytes // 2, "last": delta.size_bytes - 1}[where]
    flip_byte(version_dir(tmp_path, 2) / delta.name, offset)
    with pytest.raises(WeightsCorruptError, match=f"version 2: file {delta.shard} .*delta"):
        receiver.fetch(announce(tmp_path, 2))
    assert receiver.held is None  # the delta is not tried again
    got = receiver.fetch(announce(tmp_path, 2))  # the retry reads the full shards
    assert not receiver.last_fetch_delta
    assert_bitwise(got, states[2])


def test_a_missing_delta_file_is_an_error_not_wrong_weights(tmp_path: Path) -> None:
    publish_versions(tmp_path, 1)
    held = HeldVersion.of(read_manifest(tmp_path, 0), read_shards(tmp_path, 0))
    delta = read_manifest(tmp_path, 1).delta.files[0]
    (version_dir(tmp_path, 1) / delta.name).unlink()
    with pytest.raises(WeightsCorruptError, match="has no delta file"):
        read_shards(tmp_path, 1, held=held)


def test_a_new_layout_is_published_full_only(tmp_path: Path) -> None:
    base = DeltaBase()
    state = initial_state()
    write_shards(state, tmp_path, 0, max_shard_bytes=SHARD_BYTES, delta_base=base)
    grown = {**state, "model.layers.1.norm.weight": torch.ones(24)}
    assert write_shards(grown, tmp_path, 1, max_shard_bytes=SHARD_BYTES, delta_base=base).delta is None
    assert write_shards(train_step(grown, 2), tmp_path, 2, max_shard_bytes=SHARD_BYTES, delta_base=base).delta


def test_a_failed_write_publishes_the_next_version_full(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The base is overwritten while a version is written: a write that fails leaves it unusable,
    so no delta is ever based on half-updated bytes."""
    from asyncrl.transport import shards

    base = DeltaBase()
    states = publish_versions(tmp_path, 0)
    write_shards(states[0], tmp_path / "w", 0, max_shard_bytes=SHARD_BYTES, delta_base=base)
    real = shards._write_small_file

    def fail_on_manifest(path, *args, **kwargs):
        if path.name == "manifest.json":
            raise OSError("disk full")
        return real(path, *args, **kwargs)

    monkeypatch.setattr(shards, "_write_small_file", fail_on_manifest)
    with pytest.raises(OSError, match="disk full"):
        write_shards(
            train_step(states[0], 1), tmp_path / "w", 1, max_shard_bytes=SHARD_BYTES, delta_base=base
        )
    monkeypatch.undo()
    assert base.version is None
    v2 = train_step(train_step(states[0], 1), 2)
    assert write_shards(v2, tmp_path / "w", 2, max_shard_bytes=SHARD_BYTES, delta_base=base).delta is None
    v3 = train_step(v2, 3)
    assert (
        write_shards(v3, tmp_path / "w", 3, max_shard_bytes=SHARD_BYTES, delta_base=base).delta.base_version
        == 2
    )
