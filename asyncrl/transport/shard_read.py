"""Reading and verifying published shards: the generator end of the shards weight path.

Place in the data flow: learner rank 0 publishes a version with `shards.write_shards` and announces
`ShardsPublished(version, root=root)`; a generator calls `read_shards`
(the torch generator, `receiver.WeightsReceiver`) or `read_manifest` (the SGLang generator checks the
files before it hands the directory to `/update_weights_from_disk`), then acks with `WeightsLoaded`.

Nothing is trusted that the manifest does not vouch for: every safetensors header is checked
against the manifest (names, dtypes, shapes, offsets that tile the data with no hole or overlap)
and, with `verify`, every file's checksum (the manifest's `checksum_kind`: xxh3, blake3 or sha256)
is computed chunk by chunk as it is read, while the chunk is in cache, one file per thread. A
missing, truncated or altered file raises `WeightsCorruptError` naming the file and the version, so
a generator keeps its current weights instead of loading wrong ones. A reader that holds the base of
a version published as a delta (`held`) rebuilds the shards from the delta files instead
(`delta.apply_delta_shard`), checked against the same checksums.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from asyncrl.transport.checksum import Hasher, new_hasher
from asyncrl.transport.delta import HeldVersion, apply_delta_shard
from asyncrl.transport.manifest import (
    MANIFEST_NAME,
    SAFETENSORS_CODES,
    CorruptFn,
    ManifestFile,
    ManifestTensor,
    ShardManifest,
    WeightsCorruptError,
    dtype_from_name,
    dtype_name,
)
from asyncrl.transport.retention import version_dir
from asyncrl.transport.shard_io import CHUNK_BYTES, byte_view, fresh_cpu_bytes, pool_size
from asyncrl.transport.shard_plan import largest_first

__all__ = ["read_manifest", "read_shards", "verify_files"]


def read_manifest(root: Path, version: int) -> ShardManifest:
    """The manifest of a published version; FileNotFoundError if the version is not published."""
    vdir = version_dir(root, version)
    if not vdir.is_dir():
        raise FileNotFoundError(f"weights version {version} is not published under {Path(root)}")
    path = vdir / MANIFEST_NAME
    try:
        manifest = ShardManifest.from_json(path.read_bytes())
    except FileNotFoundError as e:
        raise WeightsCorruptError(f"weights version {version}: {MANIFEST_NAME} is missing in {vdir}") from e
    except ValueError as e:
        raise WeightsCorruptError(
            f"weights version {version}: {MANIFEST_NAME} in {vdir} is malformed: {e}"
        ) from e
    if manifest.version != version:
        raise WeightsCorruptError(
            f"weights version {version}: {path} says version {manifest.version}; "
            "the directory was tampered with"
        )
    return manifest


def _read_exact(fd: int, view: memoryview, hasher: Hasher | None, corrupt: CorruptFn) -> None:
    """Fill `view` from `fd`, hashing each chunk right after it is read (while it is in cache)."""
    pos = 0
    while pos < len(view):
        n = os.readv(fd, [view[pos : pos + CHUNK_BYTES]])
        if n == 0:
            raise corrupt("ends early")
        if hasher is not None:
            hasher.update(view[pos : pos + n])  # releases the GIL: shards are verified in parallel threads
        pos += n


def _read_header(fd: int, hasher: Hasher | None, corrupt: CorruptFn, size_bytes: int) -> tuple[dict, int]:
    """The parsed safetensors header (without `__metadata__`) and the offset where data starts."""
    if size_bytes < 8:
        raise corrupt("is too short for a safetensors header")
    raw_len = bytearray(8)
    _read_exact(fd, memoryview(raw_len), hasher, corrupt)
    (header_len,) = struct.unpack("<Q", raw_len)
    if 8 + header_len > size_bytes:
        raise corrupt("has a header longer than the file")
    raw = bytearray(header_len)
    _read_exact(fd, memoryview(raw), hasher, corrupt)
    return _parse_header(raw, corrupt), 8 + header_len


def _parse_header(raw: bytes | bytearray, corrupt: CorruptFn) -> dict:
    try:
        header = json.loads(raw)
    except ValueError as e:
        raise corrupt(f"has a malformed header: {e}") from e
    if not isinstance(header, dict):
        raise corrupt("has a header that is not a JSON object")
    header.pop("__metadata__", None)
    return header


def _check_entries(
    header: dict, expected: list[ManifestTensor], corrupt: CorruptFn, data_bytes: int
) -> list[tuple[ManifestTensor, int, int]]:
    """(tensor, begin, end) in file order; the header must agree with the manifest and tile the data."""
    if set(header) != {t.name for t in expected}:
        raise corrupt("holds different tensors than the manifest lists")
    entries = []
    for t in expected:
        info = header[t.name]
        try:
            code, shape, (begin, end) = info["dtype"], tuple(info["shape"]), info["data_offsets"]
        except (KeyError, TypeError, ValueError) as e:
            raise corrupt(f"has a malformed header entry for {t.name!r}") from e
        if not (isinstance(begin, int) and isinstance(end, int) and 0 <= begin <= end):
            raise corrupt(f"has malformed data offsets for {t.name!r}")
        dtype = dtype_from_name(t.dtype)
        if code != SAFETENSORS_CODES.get(dtype) or shape != t.shape:
            raise corrupt(
                f"stores {t.name!r} as {code}{list(shape)}, the manifest says {t.dtype}{list(t.shape)}"
            )
        if end - begin != math.prod(t.shape) * dtype.itemsize:
            raise corrupt(f"has data offsets for {t.name!r} that do not match its shape")
        entries.append((t, begin, end))
    entries.sort(key=lambda e: (e[1], e[2]))  # an empty tensor sorts before its neighbour
    pos = 0
    for t, begin, end in entries:
        if begin != pos:
            raise corrupt(f"has a hole or overlap before {t.name!r}")
        pos = end
    if pos != data_bytes:
        raise corrupt(f"holds {data_bytes} data bytes, its header describes {pos}")
    return entries


def _corrupt_fn(version: int, name: str) -> CorruptFn:
    def corrupt(why: str) -> WeightsCorruptError:
        return WeightsCorruptError(f"weights version {version}: file {name} {why}")

    return corrupt


def _views(buf: torch.Tensor, entries: list[tuple[ManifestTensor, int, int]]) -> dict[str, torch.Tensor]:
    """The tensors of one shard's data bytes `buf`, as views where aligned."""
    tensors = {}
    for t, begin, end in entries:
        dtype = dtype_from_name(t.dtype)
        raw = buf[begin:end] if begin % dtype.itemsize == 0 else buf[begin:end].clone()
        tensors[t.name] = raw.view(dtype).reshape(t.shape)
    return tensors


def _read_shard_file(
    path: Path,
    record: ManifestFile,
    expected: list[ManifestTensor],
    version: int,
    *,
    verify: bool,
    out: Mapping[str, torch.Tensor] | None,
    checksum_kind: str,
) -> dict[str, torch.Tensor]:
    """Read one shard: into `out`'s tensors if given, else into one fresh buffer the tensors view."""
    corrupt = _corrupt_fn(version, record.name)
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError as e:
        raise corrupt("is missing") from e
    hasher = new_hasher(checksum_kind) if verify else None
    tensors: dict[str, torch.Tensor] = {}
    try:
        size_bytes = os.fstat(fd).st_size
        if size_bytes != record.size_bytes:
            raise corrupt(f"has {size_bytes} bytes, the manifest says {record.size_bytes}")
        header, data_start = _read_header(fd, hasher, corrupt, size_bytes)
        entries = _check_entries(header, expected, corrupt, size_bytes - data_start)
        if out is None:
            buf = fresh_cpu_bytes(size_bytes - data_start)
            _read_exact(fd, memoryview(buf.numpy()), hasher, corrupt)
            tensors = _views(buf, entries)
        else:
            for t, begin, end in entries:
                dest = out[t.name]
                direct = dest.device.type == "cpu" and dest.is_contiguous()
                stage = dest if direct else torch.empty(t.shape, dtype=dest.dtype)
                if end > begin:
                    _read_exact(fd, byte_view(stage), hasher, corrupt)
                if not direct:
                    dest.copy_(stage)
                tensors[t.name] = dest
    finally:
        os.close(fd)
    if hasher is not None and hasher.hexdigest() != record.checksum:
        raise corrupt(f"fails its {checksum_kind} check")
    return tensors


def _apply_delta_file(
    vdir: Path, manifest: ShardManifest, index: int, expected: list[ManifestTensor], held: HeldVersion
) -> dict[str, torch.Tensor]:
    """Rebuild shard `index` of `manifest` from its delta and the held base (always verified)."""
    record = manifest.files[index]
    delta = next(d for d in manifest.delta.files if d.shard == record.name)
    corrupt = _corrupt_fn(manifest.version, record.name)

    def parse(raw: bytes, data_bytes: int) -> list[tuple[str, int, int]]:
        entries = _check_entries(_parse_header(raw, corrupt), expected, corrupt, data_bytes)
        return [(t.name, begin, end) for t, begin, end in entries]

    entries, buf = apply_delta_shard(vdir, delta, record, held, manifest.checksum_kind, corrupt, parse)
    by_name = {t.name: t for t in expected}
    return _views(buf, [(by_name[n], begin, end) for n, begin, end in entries])


def _check_out(manifest: ShardManifest, out: Mapping[str, torch.Tensor]) -> None:
    missing = [t.name for t in manifest.tensors if t.name not in out]
    if missing:
        raise ValueError(
            f"out lacks {len(missing)} tensors of version {manifest.version}, e.g. {missing[:3]}"
        )
    for t in manifest.tensors:
        dest = out[t.name]
        if dtype_name(dest.dtype) != t.dtype or tuple(dest.shape) != t.shape:
            raise ValueError(
                f"out[{t.name!r}] is {dtype_name(dest.dtype)}{list(dest.shape)}, "
                f"version {manifest.version} has {t.dtype}{list(t.shape)}"
            )


def read_shards(
    root: Path,
    version: int,
    *,
    verify: bool = True,
    device: str | torch.device = "cpu",
    out: Mapping[str, torch.Tensor] | None = None,
    num_threads: int | None = None,
    held: HeldVersion | None = None,
    manifest: ShardManifest | None = None,
) -> dict[str, torch.Tensor]:
    """Load a published version as {name: tensor} in state-dict order.

    With `verify` every file's checksum is checked against the manifest, hashing each chunk as it
    is read (files in parallel threads). A missing, truncated, corrupt or inconsistent file raises
    WeightsCorruptError naming the file and version; an unpublished (or already deleted) version
    raises FileNotFoundError. `manifest`: the version's manifest when the caller has read it.

    Without `out`, each shard is read into one fresh CPU buffer and the tensors are views into it
    (then moved to `device` if that is not the CPU). With `held`, the base of the version's delta
    (`HeldVersion.matches`), each shard is rebuilt from its delta file and the held tensors instead
    (always verified; a corrupt delta raises WeightsCorruptError: read the full version then). With
    `out` (name -> existing tensor, e.g. a generator's parameters; extra names are ignored) the
    bytes are read straight into those tensors, staged through CPU memory only when a tensor is not
    contiguous CPU memory, and `device` and `held` are unused. If WeightsCorruptError is raised,
    `out` holds partly updated weights: load another version.
    """
    manifest = manifest if manifest is not None else read_manifest(root, version)
    vdir = version_dir(root, version)
    target = torch.device(device)
    if out is not None:
        _check_out(manifest, out)
    by_file: dict[str, list[ManifestTensor]] = {f.name: [] for f in manifest.files}
    for t in manifest.tensors:
        by_file[t.file].append(t)
    use_delta = out is None and held is not None and held.matches(manifest.delta)
    with_delta = {d.shard for d in manifest.delta.files} if use_delta else set()

    def load(i: int) -> dict[str, torch.Tensor]:
        record = manifest.files[i]
        if record.name in with_delta:
            tensors = _apply_delta_file(vdir, manifest, i, by_file[record.name], held)
        else:
            tensors = _read_shard_file(
                vdir / record.name,
                record,
                by_file[record.name],
                version,
                verify=verify,
                out=out,
                checksum_kind=manifest.checksum_kind,
            )
        if out is None and target.type != "cpu":
            tensors = {n: t.to(target) for n, t in tensors.items()}
        return tensors

    num_workers = pool_size(num_threads, len(manifest.files))
    order = largest_first([f.size_bytes for f in manifest.files])
    with ThreadPoolExecutor(num_workers, thread_name_prefix="read-shard") as pool:
        loaded: dict[str, torch.Tensor] = {}
        for part in pool.map(load, order):
            loaded.update(part)
    if verify:
        for record in manifest.extra_files:
            _verify_file(vdir, record, manifest)
    return {t.name: loaded[t.name] for t in manifest.tensors}


def _verify_file(vdir: Path, record: ManifestFile, manifest: ShardManifest) -> None:
    """Check one file's size and checksum, reading it in chunks (no tensors made)."""
    corrupt = _corrupt_fn(manifest.version, record.name)
    try:
        fd = os.open(vdir / record.name, os.O_RDONLY)
    except FileNotFoundError as e:
        raise corrupt("is missing") from e
    hasher = new_hasher(manifest.checksum_kind)
    try:
        size_bytes = os.fstat(fd).st_size
        if size_bytes != record.size_bytes:
            raise corrupt(f"has {size_bytes} bytes, the manifest says {record.size_bytes}")
        buf = bytearray(min(size_bytes, CHUNK_BYTES))
        view = memoryview(buf)
        remaining = size_bytes
        while remaining:
            n = os.readv(fd, [view[: min(remaining, len(view))]])
            if n == 0:
                raise corrupt("ends early")
            hasher.update(view[:n])
            remaining -= n
    finally:
        os.close(fd)
    if hasher.hexdigest() != record.checksum:
        raise corrupt(f"fails its {manifest.checksum_kind} check")


def verify_files(root: Path, version: int, *, num_threads: int | None = None) -> ShardManifest:
    """Check every file of a published version against its manifest (size and checksum) without
    loading tensors, files in parallel threads (for servers that load the directory themselves);
    returns the manifest. Raises WeightsCorruptError / FileNotFoundError like `read_shards`."""
    manifest = read_manifest(root, version)
    vdir = version_dir(root, version)
    records = [*manifest.files, *manifest.extra_files]
    with ThreadPoolExecutor(pool_size(num_threads, len(records)), thread_name_prefix="verify-shard") as pool:
        for _ in pool.map(lambda r: _verify_file(vdir, r, manifest), records):
            pass
    return manifest
