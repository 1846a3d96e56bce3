"""Versioned safetensors shards (asyncrl.transport.shards, shard_read, shard_io): layout, round trips,
atomicity, corruption."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file

from asyncrl.transport import shards
from asyncrl.transport.checksum import CHECKSUM_KINDS, checksum_of
from asyncrl.transport.manifest import ShardManifest, WeightsCorruptError
from asyncrl.transport.retention import (
    latest_version,
    list_versions,
    temporary_dir,
    version_dir,
)
from asyncrl.transport.shard_io import fresh_cpu_bytes
from asyncrl.transport.shard_plan import plan_shards
from asyncrl.transport.shard_read import read_manifest, read_shards
from asyncrl.transport.shards import collect_config_files, write_shards

INDEX = "model.safetensors.index.json"


def state_dict() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    f32 = torch.randn(33, 17, generator=g)
    f32[0, :3] = torch.tensor([float("nan"), -0.0, float("inf")])
    return {
        "model.embed_tokens.weight": torch.randn(50, 8, generator=g).to(torch.bfloat16),
        "model.layers.0.self_attn.q_proj.weight": f32,
        "model.layers.0.self_attn.q_proj.bias": torch.randn(17, generator=g).to(torch.float16),
        "model.layers.0.step": torch.randint(-(2**62), 2**62, (3,), generator=g, dtype=torch.int64),
        "model.layers.0.mask": torch.tensor([True, False, True]),
        "model.layers.0.fp8": torch.randn(5, generator=g).to(torch.float8_e4m3fn),
        "model.layers.1.transposed": torch.randn(7, 5, generator=g).t(),  # non-contiguous
        "model.layers.1.empty": torch.empty(0, 3),
        "model.norm.scalar": torch.tensor(1.5, dtype=torch.float64),
        "lm_head.weight": torch.randn(50, 8, generator=g).to(torch.bfloat16),
    }


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(
        a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8)
    )


def assert_same(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert list(got) == list(expected)
    bad = [n for n in expected if not same_bits(got[n], expected[n])]
    assert not bad


def test_round_trip_is_bitwise_and_keeps_order(tmp_path: Path) -> None:
    sd = state_dict()
    manifest = write_shards(sd, tmp_path, 3, max_shard_bytes=600)
    assert len(manifest.files) > 1
    assert_same(read_shards(tmp_path, 3), sd)
    assert_same(read_shards(tmp_path, 3, verify=False), sd)


def test_large_shards_are_read_into_huge_page_buffers_bitwise(tmp_path: Path) -> None:
    """Fresh read buffers of 2 MiB or more come from `fresh_cpu_bytes` (an anonymous mapping with
    transparent huge pages where the kernel allows them); tensors are views that keep it alive."""
    g = torch.Generator().manual_seed(5)
    sd = {"big": torch.randn(1 << 20, generator=g), "small": torch.randn(3, generator=g).to(torch.bfloat16)}
    write_shards(sd, tmp_path, 1, max_shard_bytes=16 << 20)
    got = read_shards(tmp_path, 1)
    assert_same(got, sd)
    big = got.pop("big")
    del got
    assert same_bits(big, sd["big"])  # still valid with the other views gone
    buf = fresh_cpu_bytes(3 << 20)
    assert buf.dtype == torch.uint8 and buf.shape == (3 << 20,) and not buf.is_shared()
    buf.fill_(7)
    assert int(buf[-1]) == 7 and fresh_cpu_bytes(10).numel() == 10


def test_read_into_existing_tensors(tmp_path: Path) -> None:
    sd = state_dict()
    write_shards(sd, tmp_path, 1, max_shard_bytes=600)
    out = {n: torch.zeros_like(t) for n, t in sd.items()}
    out["model.layers.1.transposed"] = torch.zeros(7, 5).t()  # non-contiguous: staged, then copied
    out["unrelated.extra"] = torch.zeros(2)  # names the version lacks are left alone
    got = read_shards(tmp_path, 1, out=out)
    assert all(got[n] is out[n] for n in sd)
    assert_same(got, sd)
    with pytest.raises(ValueError, match="lacks"):
        read_shards(tmp_path, 1, out={"lm_head.weight": out["lm_head.weight"]})
    wrong = dict(out, **{"lm_head.weight": torch.zeros(8, 50, dtype=torch.bfloat16)})
    with pytest.raises(ValueError, match="lm_head.weight"):
        read_shards(tmp_path, 1, out=wrong)


def test_layout_is_standard_hugging_face(tmp_path: Path) -> None:
    sd = state_dict()
    manifest = write_shards(sd, tmp_path, 7, max_shard_bytes=600)
    vdir = tmp_path / "v00000007"
    num = len(manifest.files)
    names = sorted(p.name for p in vdir.glob("*.safetensors"))
    assert names == [f"model-{i:05d}-of-{num:05d}.safetensors" for i in range(1, num + 1)]
    index = json.loads((vdir / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in sd.values())
    assert set(index["weight_map"]) == set(sd)
    loaded = {}
    for file in names:  # the reference reader agrees with the index and the bytes
        part = load_file(vdir / file)
        assert all(index["weight_map"][n] == file for n in part)
        loaded.update(part)
    assert all(same_bits(loaded[n], t) for n, t in sd.items())
    assert manifest.checksum_kind == "xxh3"  # weights.checksum's default
    for record in manifest.files:  # checksums are those of the files on disk
        assert checksum_of("xxh3", (vdir / record.name).read_bytes()) == record.checksum
        assert (vdir / record.name).stat().st_size == record.size_bytes
    assert ShardManifest.from_json((vdir / "manifest.json").read_bytes()) == manifest
    assert [(m.name, m.dtype, m.shape) for m in manifest.metas()][0] == (
        "model.embed_tokens.weight",
        "bfloat16",
        (50, 8),
    )


def test_versions_are_listed_and_published_atomically(tmp_path: Path) -> None:
    sd = {"w": torch.ones(4)}
    assert list_versions(tmp_path / "missing") == [] and latest_version(tmp_path) is None
    for v in (2, 10, 5):
        write_shards(sd, tmp_path, v, max_shard_bytes=1 << 20)
    assert list_versions(tmp_path) == [2, 5, 10] and latest_version(tmp_path) == 10
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []
    with pytest.raises(FileExistsError):
        write_shards(sd, tmp_path, 5, max_shard_bytes=1 << 20)


def test_failed_write_publishes_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = shards._write_shard_file
    calls = []

    def fail_on_second(*args: object, **kwargs: object) -> object:
        calls.append(1)
        if len(calls) == 2:
            raise OSError("disk full")
        return real(*args, **kwargs)

    monkeypatch.setattr(shards, "_write_shard_file", fail_on_second)
    with pytest.raises(OSError, match="disk full"):
        write_shards(state_dict(), tmp_path, 4, max_shard_bytes=600, num_threads=1)
    assert list(tmp_path.iterdir()) == []


def test_stale_temporary_directories_are_ignored(tmp_path: Path) -> None:
    write_shards({"w": torch.ones(2)}, tmp_path, 1, max_shard_bytes=64)
    stale = temporary_dir(tmp_path, "v00000002")
    stale.mkdir()
    (tmp_path / "v00000003").write_text("a file, not a version directory")
    assert list_versions(tmp_path) == [1]


def flip_byte(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("kind", CHECKSUM_KINDS)
def test_corrupt_missing_or_truncated_shard_is_detected(tmp_path: Path, kind: str) -> None:
    sd = state_dict()
    manifest = write_shards(sd, tmp_path, 9, max_shard_bytes=600, checksum=kind)
    assert manifest.checksum_kind == kind
    vdir = version_dir(tmp_path, 9)
    victim = manifest.files[1].name
    flip_byte(vdir / victim, -1)  # last data byte: only the checksum can notice
    with pytest.raises(WeightsCorruptError, match=rf"version 9: file {victim} fails its {kind} check"):
        read_shards(tmp_path, 9)
    read_shards(tmp_path, 9, verify=False)  # unverified reads do not look
    flip_byte(vdir / victim, -1)
    read_shards(tmp_path, 9)

    data = (vdir / victim).read_bytes()
    (vdir / victim).write_bytes(data[:-3])
    with pytest.raises(WeightsCorruptError, match=rf"version 9: file {victim} has"):
        read_shards(tmp_path, 9, verify=False)
    (vdir / victim).unlink()
    with pytest.raises(WeightsCorruptError, match=rf"version 9: file {victim} is missing"):
        read_shards(tmp_path, 9)


def test_corrupt_header_or_manifest_is_detected(tmp_path: Path) -> None:
    manifest = write_shards(state_dict(), tmp_path, 2, max_shard_bytes=1 << 20)
    vdir = version_dir(tmp_path, 2)
    shard = vdir / manifest.files[0].name
    flip_byte(shard, 12)  # inside the JSON header
    with pytest.raises(WeightsCorruptError, match="version 2"):
        read_shards(tmp_path, 2, verify=False)
    (vdir / "manifest.json").write_text("{not json")
    with pytest.raises(WeightsCorruptError, match=r"version 2: manifest.json .* malformed"):
        read_shards(tmp_path, 2)
    (vdir / "manifest.json").unlink()
    with pytest.raises(WeightsCorruptError, match="manifest.json is missing"):
        read_shards(tmp_path, 2)
    with pytest.raises(FileNotFoundError, match="version 3 is not published"):
        read_shards(tmp_path, 3)


def test_manifest_of_another_version_is_rejected(tmp_path: Path) -> None:
    write_shards({"w": torch.ones(2)}, tmp_path, 1, max_shard_bytes=64)
    write_shards({"w": torch.zeros(2)}, tmp_path, 2, max_shard_bytes=64)
    (version_dir(tmp_path, 2) / "manifest.json").write_bytes(
        (version_dir(tmp_path, 1) / "manifest.json").read_bytes()
    )
    with pytest.raises(WeightsCorruptError, match="says version 1"):
        read_manifest(tmp_path, 2)


def test_extra_files_are_written_and_checked(tmp_path: Path) -> None:
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text('{"model_type": "llama"}')
    (model_dir / "tokenizer.json").write_text("{}")
    (model_dir / "model.safetensors").write_bytes(b"old weights")
    extra = collect_config_files(model_dir)
    assert sorted(extra) == ["config.json", "tokenizer.json"]
    manifest = write_shards({"w": torch.ones(2)}, tmp_path / "out", 1, max_shard_bytes=64, extra_files=extra)
    assert [f.name for f in manifest.extra_files] == ["config.json", "tokenizer.json"]
    vdir = version_dir(tmp_path / "out", 1)
    assert (vdir / "config.json").read_text() == '{"model_type": "llama"}'
    (vdir / "tokenizer.json").write_text("[]")
    with pytest.raises(WeightsCorruptError, match="tokenizer.json fails"):
        read_shards(tmp_path / "out", 1)


@pytest.mark.parametrize(
    "name", ["", "../x", "a/b", "manifest.json", "model.safetensors.index.json", "x.safetensors"]
)
def test_bad_extra_file_names_are_rejected(tmp_path: Path, name: str) -> None:
    with pytest.raises(ValueError, match="file name"):
        write_shards({"w": torch.ones(1)}, tmp_path, 1, max_shard_bytes=8, extra_files={name: b""})


def test_bad_input_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="empty"):
        write_shards({}, tmp_path, 1, max_shard_bytes=8)
    with pytest.raises(ValueError, match="not storable"):
        write_shards({"c": torch.zeros(2, dtype=torch.complex128)}, tmp_path, 1, max_shard_bytes=8)
    with pytest.raises(ValueError, match="not a torch.Tensor"):
        write_shards({"w": [1.0]}, tmp_path, 1, max_shard_bytes=8)  # type: ignore[dict-item]
    with pytest.raises(ValueError, match="version must be >= 0"):
        write_shards({"w": torch.ones(1)}, tmp_path, -1, max_shard_bytes=8)
    with pytest.raises(ValueError, match="max_shard_bytes"):
        write_shards({"w": torch.ones(1)}, tmp_path, 1, max_shard_bytes=0)
    assert list(tmp_path.iterdir()) == []


def test_plan_shards_is_greedy_in_order() -> None:
    assert plan_shards([4, 4, 4, 10, 1, 1], max_shard_bytes=8) == [[0, 1], [2], [3], [4, 5]]
    assert plan_shards([], max_shard_bytes=8) == []
    assert plan_shards([0, 0, 9], max_shard_bytes=8) == [[0, 1], [2]]


_MIB = 1 << 20


def test_plan_shards_is_even_and_a_multiple_of_the_threads() -> None:
    """Regression: greedy filling gave 3 shards of 67/59/59 MB and one of 16 MB for two threads (one
    thread hashed 117 MB while the other idled after 83), and with the 512 MiB default a model under
    512 MiB was one file, hashed by one thread while the other core idled."""
    assert plan_shards([1] * 10, max_shard_bytes=6) == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]]  # not 6 + 4
    sizes = [50 * _MIB] + [8 * _MIB, 4096] * 18  # the bench's model: an embedding, matrices, norms

    def shard_mib(plan: list[list[int]]) -> list[float]:
        return [sum(sizes[i] for i in shard) / _MIB for shard in plan]

    two = shard_mib(plan_shards(sizes, max_shard_bytes=512 * _MIB, num_parallel=2))
    assert len(two) == 2 and max(two) - min(two) <= 8
    four = shard_mib(plan_shards(sizes, max_shard_bytes=64 * _MIB, num_parallel=2))  # 3 at the limit
    assert len(four) == 4 and max(four) <= 64 and max(four) - min(four) <= 8
    # too little to be worth a second file, whatever the threads
    assert plan_shards([1000] * 4, max_shard_bytes=1 << 30, num_parallel=2) == [[0, 1, 2, 3]]
    with pytest.raises(ValueError, match="num_parallel"):
        plan_shards([1], max_shard_bytes=8, num_parallel=0)


def _greedy(sizes: list[int], limit: int) -> list[list[int]]:
    """Reference: fill each shard up to the limit, in order."""
    plan: list[list[int]] = []
    for i, size in enumerate(sizes):
        if plan and sum(sizes[j] for j in plan[-1]) + size <= limit:
            plan[-1].append(i)
        else:
            plan.append([i])
    return plan


@settings(max_examples=200, deadline=None)
@given(
    sizes_mib=st.lists(st.integers(0, 40), max_size=30),
    limit_mib=st.integers(1, 100),
    num_parallel=st.integers(1, 4),
)
def test_plan_shards_keeps_order_and_limit_and_never_worsens_the_largest_shard(
    sizes_mib: list[int], limit_mib: int, num_parallel: int
) -> None:
    sizes = [m * _MIB for m in sizes_mib]
    limit = limit_mib * _MIB
    plan = plan_shards(sizes, max_shard_bytes=limit, num_parallel=num_parallel)
    greedy = _greedy(sizes, limit)
    assert [i for shard in plan for i in shard] == list(range(len(sizes)))
    assert all(shard and (sum(sizes[i] for i in shard) <= limit or len(shard) == 1) for shard in plan)
    largest = max((sum(sizes[i] for i in shard) for shard in plan), default=0)
    assert largest <= max((sum(sizes[i] for i in shard) for shard in greedy), default=0)
    step = num_parallel if sum(sizes) >= num_parallel * 8 * _MIB else 1
    assert len(greedy) <= len(plan) <= -(-len(greedy) // step) * step


def reversed_bytes(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Same names, dtypes and shapes, other bits: every tensor's bytes in reverse order."""
    out = {}
    for name, t in sd.items():
        raw = t.contiguous().reshape(-1).view(torch.uint8).flip(0)
        out[name] = raw.view(t.dtype).reshape(t.shape) if t.numel() else t.clone()
    return out


def recycle_version(root: Path, version: int) -> Path:
    """Prune `version` with keep_spare, as ShardPublisher does once every generator moved past it."""
    from asyncrl.transport.retention import VersionRetention, prune, spare_dirs

    retention = VersionRetention(keep_last=1)
    retention.publish(version)
    retention.publish(version + 1)  # need not exist on disk: only `version` is pruned
    retention.ack("gen", version + 1)
    assert prune(root, retention, keep_spare=True) == [version]
    (spare,) = spare_dirs(root)
    return spare


def test_a_pruned_version_is_rewritten_in_place_for_the_next_one(tmp_path: Path) -> None:
    sd = state_dict()
    write_shards(sd, tmp_path, 1, max_shard_bytes=600, extra_files={"config.json": b"{}"})
    spare = recycle_version(tmp_path, 1)
    assert list_versions(tmp_path) == []
    inodes = sorted(p.stat().st_ino for p in spare.glob("*.safetensors"))
    new = reversed_bytes(sd)
    manifest = write_shards(new, tmp_path, 3, max_shard_bytes=600)
    vdir = version_dir(tmp_path, 3)
    assert sorted(p.stat().st_ino for p in vdir.glob("*.safetensors")) == inodes  # no new files
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # the spare was used up
    names = [f.name for f in manifest.files]
    assert sorted(p.name for p in vdir.iterdir()) == sorted([*names, "manifest.json", INDEX])
    for record in manifest.files:  # nothing of the old version's bytes survives, not even a tail
        data = (vdir / record.name).read_bytes()
        assert len(data) == record.size_bytes and checksum_of("xxh3", data) == record.checksum
    assert_same(read_shards(tmp_path, 3), new)
    loaded = {}
    for name in names:
        loaded.update(load_file(vdir / name))
    assert all(same_bits(loaded[n], t) for n, t in new.items())


@pytest.mark.parametrize("old_max_shard_bytes", [64, 1 << 20])  # more files than needed; fewer
def test_a_spare_of_another_shape_still_gives_an_exact_version(
    tmp_path: Path, old_max_shard_bytes: int
) -> None:
    sd = state_dict()
    write_shards(sd, tmp_path, 1, max_shard_bytes=old_max_shard_bytes)
    spare = recycle_version(tmp_path, 1)
    kept = tmp_path / "kept-elsewhere.safetensors"
    first = sorted(spare.glob("*.safetensors"))[0]
    os.link(first, kept)  # e.g. someone's snapshot: a hard-linked file must not change
    kept_bytes = kept.read_bytes()
    new = reversed_bytes(sd)
    manifest = write_shards(new, tmp_path, 3, max_shard_bytes=600)
    assert len(manifest.files) > 1
    assert kept.read_bytes() == kept_bytes
    vdir = version_dir(tmp_path, 3)
    assert sorted(p.name for p in vdir.glob("*.safetensors")) == [f.name for f in manifest.files]
    assert_same(read_shards(tmp_path, 3), new)


def test_a_spare_is_left_alone_without_reuse(tmp_path: Path) -> None:
    write_shards(state_dict(), tmp_path, 1, max_shard_bytes=600)
    spare = recycle_version(tmp_path, 1)
    write_shards(state_dict(), tmp_path, 3, max_shard_bytes=600, reuse_spare=False)
    assert spare.is_dir() and list_versions(tmp_path) == [3]


def test_manifest_from_json_rejects_garbage() -> None:
    with pytest.raises(ValueError):
        ShardManifest.from_json(b'{"version": 1}')
    bad_ref = (
        b'{"version": 1, "total_size_bytes": 4, "files": [],'
        b' "tensors": [{"name": "w", "dtype": "float32", "shape": [1], "file": "nope"}]}'
    )
    with pytest.raises(ValueError, match="unknown file"):
        ShardManifest.from_json(bad_ref)
    escape = bad_ref.replace(b'"files": []', b'"files": [{"name": "../x", "size_bytes": 1, "sha256": ""}]')
    with pytest.raises(ValueError, match="plain file name"):
        ShardManifest.from_json(escape)
    with pytest.raises(ValueError, match="dtype"):
        ShardManifest.from_json(bad_ref.replace(b"float32", b"float33"))


_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int8, torch.bool, torch.float64]


@settings(max_examples=25, deadline=None)
@given(
    specs=st.lists(
        st.tuples(st.sampled_from(_DTYPES), st.lists(st.integers(0, 6), max_size=3)), min_size=1, max_size=8
    ),
    max_shard_bytes=st.integers(1, 200),
    seed=st.integers(0, 2**16),
)
def test_any_state_dict_round_trips(specs: list, max_shard_bytes: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    sd = {
        f"t{i}": (torch.randn(shape, generator=g) * 100).to(dtype) for i, (dtype, shape) in enumerate(specs)
    }
    with tempfile.TemporaryDirectory() as root:
        write_shards(sd, Path(root), 0, max_shard_bytes=max_shard_bytes)
        assert_same(read_shards(Path(root), 0), sd)
        assert_same(read_shards(Path(root), 0, out={n: torch.empty_like(t) for n, t in sd.items()}), sd)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_transformers_loads_a_published_version(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    config_dir = tmp_path / "config"
    config.save_pretrained(config_dir)
    sd = {n: t.to(torch.bfloat16) for n, t in model.state_dict().items()}
    write_shards(
        sd, tmp_path / "weights", 12, max_shard_bytes=4096, extra_files=collect_config_files(config_dir)
    )
    # No dtype argument (its name changed across transformers versions); bf16 -> fp32 -> bf16 is exact.
    loaded = transformers.AutoModelForCausalLM.from_pretrained(version_dir(tmp_path / "weights", 12))
    got = loaded.state_dict()
    assert set(got) == set(sd)
    assert all(same_bits(got[n].to(torch.bfloat16), t) for n, t in sd.items())


def _streamed(state: dict[str, torch.Tensor], live: list[int]):
    """A StreamedState over copies of `state`'s tensors, recording how many produced tensors are
    alive (not yet freed) each time one more is produced."""
    import weakref

    from asyncrl.transport.shards import StreamedState

    alive: set[int] = set()

    def produce():
        for i, (name, t) in enumerate(state.items()):
            copy = t.clone()
            alive.add(i)
            weakref.finalize(copy, alive.discard, i)
            live.append(len(alive))
            yield name, copy
            del copy

    metas = {n: torch.empty(t.shape, dtype=t.dtype, device="meta") for n, t in state.items()}
    return StreamedState(metas, produce)


def test_a_streamed_state_is_written_shard_by_shard_as_it_is_produced(tmp_path: Path) -> None:
    """The sharded learner's publish: full tensors are produced one at a time while their shard is
    written, so at most one shard's tensors exist at once; the files read back bitwise."""
    g = torch.Generator().manual_seed(0)
    state = {f"layers.{i}.weight": torch.randn(64, 64, generator=g) for i in range(12)}  # 16 KiB each
    state["head.bias"] = torch.arange(7, dtype=torch.int64)
    live: list[int] = []
    manifest = write_shards(_streamed(state, live), tmp_path, 3, max_shard_bytes=3 * 16384, reuse_spare=False)
    assert len(manifest.files) == 5  # 12 tensors by 3, then the bias alone
    assert max(live) <= 4  # one shard's three, and the first of the next
    back = read_shards(tmp_path, 3)
    assert list(back) == list(state)  # shards follow the production order
    assert all(torch.equal(back[n], state[n]) for n in state)


def test_a_streamed_state_out_of_step_is_an_error(tmp_path: Path) -> None:
    from asyncrl.transport.shards import StreamedState

    state = {"a": torch.zeros(2), "b": torch.ones(3)}
    metas = {n: torch.empty(t.shape, dtype=t.dtype, device="meta") for n, t in state.items()}
    swapped = StreamedState(metas, lambda: iter([("b", state["b"]), ("a", state["a"])]))
    with pytest.raises(ValueError, match="streamed weights out of step: got 'b'"):
        write_shards(swapped, tmp_path, 1, max_shard_bytes=1 << 20, reuse_spare=False)
    assert not any(tmp_path.iterdir()) or not (tmp_path / "v00000001").exists()  # nothing published
