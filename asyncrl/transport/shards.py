"""Versioned safetensors shards: the disk path of weight sync (learner -> generators), writing end.

Place in the data flow: after an optimizer step, learner rank 0 calls `write_shards` to publish the
full Hugging Face-named state dict as `root/v{version:08d}/`, announces `ShardsPublished(version,
root=root)` over ZMQ, and each generator loads it with
`shard_read.read_shards` (torch generator) or hands the directory to SGLang's
`/update_weights_from_disk`, then acks with `WeightsLoaded`. `retention.py` decides when old version
directories may be deleted; `shard_io.py` holds the byte-level helpers both ends share.

Layout of one version directory (the standard Hugging Face sharded checkpoint, plus our manifest):

    v00000042/
      model-00001-of-00003.safetensors ...   shards of at most `max_shard_bytes` tensor bytes
      model.safetensors.index.json           {"metadata": {"total_size": N}, "weight_map": {name: file}}
      manifest.json                          ShardManifest: version, tensors, per-file checksum and size
      config.json, tokenizer.json, ...       optional `extra_files`, so `from_pretrained` works
      model-00001-of-00003.safetensors.xor.zst ...  with a `delta_base`: each shard as a delta (delta.py)

Publication is atomic: everything is written and fsynced in a hidden temporary directory under `root`
and then renamed to `v{version:08d}`, so a reader never sees a half-written version. Checksums
(`checksum.py`, `weights.checksum`: xxh3 by default) are computed while writing (each chunk is
hashed and written while it is hot in cache, and XORed into the delta then), never by reading files
back. A hash is sequential within a file, so shards are planned even and as many as a multiple of
the threads (`shard_plan.py`), and each thread hashes its own files.
The temporary directory is a pruned version's recycled directory when retention kept one
(`retention.prune(..., keep_spare=True)`): its files are overwritten in place, which on tmpfs
costs far less than allocating new pages.

Shard files are written by this module directly in the safetensors format (8-byte little-endian
header length, JSON header padded to 8 bytes, raw little-endian tensor bytes) so that tensor memory
goes to the file with no intermediate serialized copy (raw bytes are written as they lie in memory,
so like safetensors itself this assumes a little-endian host).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import struct
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

import torch

from asyncrl.transport.checksum import DEFAULT_CHECKSUM, checksum_of, new_hasher
from asyncrl.transport.delta import DeltaBase, DeltaSink, delta_file_name
from asyncrl.transport.manifest import (
    INDEX_NAME,
    MANIFEST_NAME,
    DeltaFile,
    ManifestDelta,
    ManifestFile,
    ManifestTensor,
    ShardManifest,
    check_file_name,
    dtype_name,
    safetensors_code,
)
from asyncrl.transport.retention import claim_spare, temporary_dir, version_dir
from asyncrl.transport.shard_io import CHUNK_BYTES, byte_view, pool_size
from asyncrl.transport.shard_plan import largest_first, plan_shards

__all__ = ["collect_config_files", "write_shards"]

logger = logging.getLogger(__name__)

# The safetensors header is padded so that tensor data starts 8-byte aligned.
_HEADER_ALIGN_BYTES = 8
# Files in a model directory that `collect_config_files` never copies (weights and our own outputs).
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf")

# ---------------------------------------------------------------------------------------------- config files


def collect_config_files(model_dir: Path) -> dict[str, bytes]:
    """Non-weight top-level files of a Hugging Face model directory (config, tokenizer, ...).

    Pass the result as `write_shards(..., extra_files=...)` once and reuse it for every version.
    """
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise ValueError(f"model directory {model_dir} does not exist")
    files = {}
    for path in sorted(model_dir.iterdir()):
        if (
            path.is_file()
            and not path.name.endswith(_WEIGHT_SUFFIXES)
            and not path.name.endswith(".index.json")
            and path.name != MANIFEST_NAME
        ):
            files[path.name] = path.read_bytes()
    return files


# ---------------------------------------------------------------------------------------------- write


class StreamedState(Mapping):
    """Weights to publish that are produced once, in order, while they are written: a sharded
    learner gathers each full tensor only when its shard is written, so the publishing rank holds
    one shard's tensors at a time, never the whole model (docs/learner.md).

    As a Mapping it holds meta tensors (name -> shape and dtype, no data), known before anything
    is gathered; `produce()` yields (name, tensor) in the same order, exactly once. `write_shards`
    takes it directly; a publisher that needs the tensors more than once calls `materialize()`."""

    def __init__(self, metas: Mapping[str, torch.Tensor], produce: Callable[[], Iterator]) -> None:
        if any(t.device.type != "meta" for t in metas.values()):
            raise ValueError("StreamedState metas must be meta tensors (shape and dtype only)")
        self.metas = dict(metas)
        self._produce = produce
        self._used = False

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.metas[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.metas)

    def __len__(self) -> int:
        return len(self.metas)

    def produce(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The tensors, in `metas` order; checked against their metas as they come."""
        if self._used:
            raise RuntimeError("a StreamedState is produced once")
        self._used = True
        names = iter(self.metas)
        for name, t in self._produce():
            expected = next(names, None)
            meta = self.metas.get(name)
            if name != expected or meta is None or t.shape != meta.shape or t.dtype != meta.dtype:
                raise ValueError(
                    f"streamed weights out of step: got {name!r} {t.dtype}{list(t.shape)}, expected "
                    f"{expected!r}"
                )
            yield name, t
        if next(names, None) is not None:
            raise ValueError("streamed weights ended early")

    def materialize(self) -> dict[str, torch.Tensor]:
        return dict(self.produce())


def _sequential_plan(sizes: list[int], max_shard_bytes: int) -> list[list[int]]:
    """Contiguous runs of tensors in order, each under `max_shard_bytes` unless one tensor is
    larger (a streamed state is produced in order, so its shards must follow that order)."""
    plan: list[list[int]] = []
    total = 0
    for i, size in enumerate(sizes):
        if not plan or (total + size > max_shard_bytes and plan[-1]):
            plan.append([])
            total = 0
        plan[-1].append(i)
        total += size
    return plan


def _as_cpu_contiguous(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    if t.device.type != "cpu":
        t = t.to("cpu")
    return t if t.is_contiguous() else t.contiguous()


def _header_bytes(entries: list[tuple[str, torch.Tensor]]) -> bytes:
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, t in entries:
        nbytes = t.numel() * t.element_size()
        header[name] = {
            "dtype": safetensors_code(t.dtype, name),
            "shape": list(t.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % _HEADER_ALIGN_BYTES)
    return struct.pack("<Q", len(raw)) + raw


def _write_all(fd: int, data: memoryview) -> None:
    while data:
        written = os.write(fd, data)
        data = data[written:]


def _open_shard(path: Path, *, reuse: bool) -> int:
    if reuse:
        try:
            return os.open(path, os.O_WRONLY)
        except PermissionError:  # not ours to rewrite after all: write a new file instead
            os.unlink(path)
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)


def _write_shard_file(
    path: Path,
    entries: list[tuple[str, torch.Tensor]],
    *,
    fsync: bool,
    reuse: bool = False,
    checksum: str = DEFAULT_CHECKSUM,
    base: DeltaBase | None = None,
    delta: bool = False,
) -> tuple[ManifestFile, DeltaFile | None]:
    """Write and hash one shard; with `reuse`, `path` is a recycled file, overwritten and cut to size.

    With `base`, each chunk is also copied into the base's bytes of its tensor (the next version's
    delta base) and, with `delta`, XORed with what the base held there (the version before) and
    written to the shard's delta file, in the same pass.
    """
    # Largest element size first: with no padding between tensors every offset stays aligned to its
    # own element size (sizes are powers of two), which zero-copy readers rely on.
    entries = sorted(entries, key=lambda e: -e[1].element_size())
    entries = [(name, _as_cpu_contiguous(t)) for name, t in entries]
    hasher = new_hasher(checksum)
    size_bytes = 0
    sink = DeltaSink(path.with_name(delta_file_name(path.name)), checksum) if delta else None
    fd = _open_shard(path, reuse=reuse)
    try:
        header = memoryview(_header_bytes(entries))
        hasher.update(header)
        _write_all(fd, header)
        if sink is not None:
            sink.raw(header)
        size_bytes += len(header)
        for name, t in entries:
            if t.numel() == 0:
                continue
            data = byte_view(t)
            flat = t.reshape(-1).view(torch.uint8)
            base_bytes = base.buffer(name, len(data)) if base is not None else None
            for start in range(0, len(data), CHUNK_BYTES):
                chunk = data[start : start + CHUNK_BYTES]
                hasher.update(chunk)  # releases the GIL: shards are hashed in parallel threads
                _write_all(fd, chunk)
                if base_bytes is not None:
                    piece, base_piece = (
                        flat[start : start + len(chunk)],
                        base_bytes[start : start + len(chunk)],
                    )
                    if sink is not None:
                        sink.xor(piece, base_piece)
                    base_piece.copy_(piece)
            size_bytes += len(data)
        if reuse:
            os.ftruncate(fd, size_bytes)  # the recycled file may have been longer
        if fsync:
            os.fsync(fd)
        delta_record = sink.close(path.name) if sink is not None else None
        sink = None
    finally:
        os.close(fd)
        if sink is not None:
            sink.abort()
    record = ManifestFile(name=path.name, size_bytes=size_bytes, checksum=hasher.hexdigest())
    return record, delta_record


def _write_small_file(
    path: Path, data: bytes, *, fsync: bool, checksum: str = DEFAULT_CHECKSUM
) -> ManifestFile:
    with open(path, "xb") as f:
        f.write(data)
        if fsync:
            f.flush()
            os.fsync(f.fileno())
    return ManifestFile(name=path.name, size_bytes=len(data), checksum=checksum_of(checksum, data))


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _check_extra_name(name: str) -> None:
    check_file_name(name)
    if name in (MANIFEST_NAME, INDEX_NAME) or name.endswith(".safetensors"):
        raise ValueError(f"extra file name {name!r} clashes with the weights files")


def _check_state(state_dict: Mapping[str, torch.Tensor], extra: Mapping[str, bytes]) -> list[str]:
    """The state dict's names, after checking every name, tensor, dtype and extra file name."""
    if not state_dict:
        raise ValueError("state_dict is empty; there are no weights to publish")
    names = list(state_dict)
    for name in names:
        if not isinstance(name, str) or not name:
            raise ValueError(f"state_dict keys must be non-empty strings, got {name!r}")
        t = state_dict[name]
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"state_dict[{name!r}] is a {type(t).__name__}, not a torch.Tensor")
        safetensors_code(t.dtype, name)
    for name in extra:
        _check_extra_name(name)
    return names


class _Layout(NamedTuple):
    """Which tensor goes to which file: `plan[s]` are the indices into `names` of file
    `file_names[s]`, in the order they are written."""

    names: list[str]
    sizes: list[int]  # tensor bytes, by index into names
    plan: list[list[int]]
    file_names: list[str]
    indexed: bool  # with model.safetensors.index.json (not for one named file)

    @property
    def file_of(self) -> dict[str, str]:
        return {self.names[i]: self.file_names[s] for s, idx in enumerate(self.plan) for i in idx}


def _plan_files(
    state_dict: Mapping[str, torch.Tensor],
    names: list[str],
    *,
    single_file: str | None,
    extra: Mapping[str, bytes],
    max_shard_bytes: int,
    max_threads: int,
) -> _Layout:
    """One named file, contiguous runs in order for a streamed state, else shards planned even
    for `max_threads` writers."""
    sizes = [state_dict[n].numel() * state_dict[n].element_size() for n in names]
    if single_file is not None:
        check_file_name(single_file)
        if not single_file.endswith(".safetensors") or single_file in extra:
            raise ValueError(f"single_file must be a new *.safetensors file name, got {single_file!r}")
        return _Layout(names, sizes, [list(range(len(sizes)))], [single_file], indexed=False)
    if isinstance(state_dict, StreamedState):
        plan = _sequential_plan(sizes, max_shard_bytes)
    else:
        plan = plan_shards(sizes, max_shard_bytes=max_shard_bytes, num_parallel=max_threads)
    file_names = [f"model-{i + 1:05d}-of-{len(plan):05d}.safetensors" for i in range(len(plan))]
    return _Layout(names, sizes, plan, file_names, indexed=True)


def _delta_from(
    delta_base: DeltaBase | None, state_dict: Mapping[str, torch.Tensor], names: list[str], version: int
) -> tuple[int | None, tuple[str, ...]]:
    """(version, file checksums) the delta of `version` is taken from; (None, ()) when none is
    written (no base, another layout, or the base already holds `version`)."""
    if delta_base is None:
        return None, ()
    held = delta_base.version, delta_base.checksums
    layout = {n: (dtype_name(state_dict[n].dtype), tuple(state_dict[n].shape)) for n in names}
    if delta_base.prepare(layout) and held[0] != version:
        return held
    return None, ()


def _write_tensor_files(
    state_dict: Mapping[str, torch.Tensor],
    layout: _Layout,
    tmp_dir: Path,
    *,
    reused: set[str],
    max_threads: int,
    shard_kwargs: dict,
) -> list[tuple[ManifestFile, DeltaFile | None]]:
    """Every tensor file of the layout, in its order: a streamed state one file at a time as its
    tensors are produced, any other on up to `max_threads` threads, the largest shards first."""
    names, plan, file_names = layout.names, layout.plan, layout.file_names
    if isinstance(state_dict, StreamedState):  # one shard's tensors at a time, produced in order
        produced = state_dict.produce()
        written = [
            _write_shard_file(
                tmp_dir / file_names[s],
                [next(produced) for _ in plan[s]],
                reuse=file_names[s] in reused,
                **shard_kwargs,
            )
            for s in range(len(plan))
        ]
        for _ in produced:  # the producer checks that nothing was left over
            pass
        return written
    with ThreadPoolExecutor(min(max_threads, len(plan)), thread_name_prefix="write-shard") as pool:
        futures = {
            s: pool.submit(
                _write_shard_file,
                tmp_dir / file_names[s],
                [(names[i], state_dict[names[i]]) for i in plan[s]],
                reuse=file_names[s] in reused,
                **shard_kwargs,
            )
            for s in largest_first([sum(layout.sizes[i] for i in idx) for idx in plan])
        }
        return [futures[s].result() for s in range(len(plan))]


def _write_metadata(
    state_dict: Mapping[str, torch.Tensor],
    layout: _Layout,
    tmp_dir: Path,
    version: int,
    *,
    written: list[tuple[ManifestFile, DeltaFile | None]],
    extra: Mapping[str, bytes],
    fsync: bool,
    checksum: str,
    delta_from: tuple[int | None, tuple[str, ...]],
    delta_next: bool,
) -> ShardManifest:
    """The index (when the layout has one), the extra files and, last, the manifest, whose presence
    inside the temporary directory marks the version complete; returns the manifest."""
    file_of = layout.file_of
    total_size_bytes = sum(layout.sizes)
    if layout.indexed:
        index = {"metadata": {"total_size": total_size_bytes}, "weight_map": file_of}
        index_bytes = json.dumps(index, indent=2).encode()
        _write_small_file(tmp_dir / INDEX_NAME, index_bytes, fsync=fsync, checksum=checksum)
    extra_records = tuple(
        _write_small_file(tmp_dir / n, data, fsync=fsync, checksum=checksum)
        for n, data in sorted(extra.items())
    )
    base_version, base_checksums = delta_from
    delta = None
    if base_version is not None:
        delta = ManifestDelta(
            base_version=base_version,
            base_checksums=base_checksums,
            files=tuple(d for _, d in written if d is not None),
        )
    manifest = ShardManifest(
        version=version,
        total_size_bytes=total_size_bytes,
        tensors=tuple(
            ManifestTensor(
                name=n,
                dtype=dtype_name(state_dict[n].dtype),
                shape=tuple(state_dict[n].shape),
                file=file_of[n],
            )
            for n in layout.names
        ),
        files=tuple(record for record, _ in written),
        extra_files=extra_records,
        checksum_kind=checksum,
        delta=delta,
        delta_next=delta_next,
    )
    _write_small_file(tmp_dir / MANIFEST_NAME, manifest.to_json(), fsync=fsync, checksum=checksum)
    return manifest


def _rename_into_place(tmp_dir: Path, final_dir: Path, *, fsync: bool) -> None:
    """The atomic publish: the complete temporary directory becomes the version directory."""
    if fsync:
        _fsync_dir(tmp_dir)
    os.rename(tmp_dir, final_dir)
    if fsync:
        _fsync_dir(final_dir.parent)


def _fresh_dir(tmp_dir: Path) -> set[str]:
    """A new, empty temporary directory (no recycled files in it)."""
    tmp_dir.mkdir()
    return set()


def _log_published(manifest: ShardManifest, final_dir: Path, *, num_files: int) -> None:
    delta = manifest.delta
    logger.info(
        "published weights version %d: %d tensors, %d bytes in %d shards at %s%s",
        manifest.version,
        len(manifest.tensors),
        manifest.total_size_bytes,
        num_files,
        final_dir,
        f" (delta from {delta.base_version}: {sum(d.size_bytes for d in delta.files)} bytes)"
        if delta
        else "",
    )


def write_shards(
    state_dict: Mapping[str, torch.Tensor],
    root: Path,
    version: int,
    *,
    max_shard_bytes: int,
    extra_files: Mapping[str, bytes] | None = None,
    num_threads: int | None = None,
    fsync: bool = True,
    reuse_spare: bool = True,
    single_file: str | None = None,
    checksum: str = DEFAULT_CHECKSUM,
    delta_base: DeltaBase | None = None,
) -> ShardManifest:
    """Publish `state_dict` (Hugging Face names) atomically as `root/v{version:08d}`.

    Tensors may live on any device and need not be contiguous (they are copied to contiguous CPU
    memory one shard at a time); contiguous CPU tensors are written with no copy. `extra_files`
    (file name -> bytes, e.g. from `collect_config_files`) are written alongside so the directory is a
    complete `from_pretrained` / SGLang `update_weights_from_disk` model directory. Shards are written
    by up to `num_threads` threads (default: CPU count), each hashing a shard as it writes it; the
    shards are planned even, and as many as a multiple of the threads, so the threads finish
    together. With `reuse_spare`, a spare left by `retention.prune(..., keep_spare=True)` is taken
    and its files overwritten rather than new ones created. With `single_file` (a name ending in
    `.safetensors`), every tensor goes into that one file and no index is written: the layout of a
    PEFT adapter directory (`adapter_model.safetensors`), which readers find by name. Every file's
    `checksum` (a `checksum.py` kind) is computed as it is written. With `delta_base` (the
    publisher's `delta.DeltaBase`) the version is also written as a delta from the version the base
    holds, when it has the same tensors (`ManifestDelta`), and the base then holds this version;
    the manifest says so (`delta_next`), so readers keep their copy. Raises
    FileExistsError if the version is already published and ValueError for bad input; on any
    failure nothing is published.
    """
    root = Path(root)
    final_dir = version_dir(root, version)
    extra = dict(extra_files or {})
    names = _check_state(state_dict, extra)
    if final_dir.exists():
        raise FileExistsError(f"weights version {version} is already published at {final_dir}")
    max_threads = 1 if isinstance(state_dict, StreamedState) else pool_size(num_threads, len(names))
    layout = _plan_files(
        state_dict,
        names,
        single_file=single_file,
        extra=extra,
        max_shard_bytes=max_shard_bytes,
        max_threads=max_threads,
    )
    new_hasher(checksum)  # an unknown kind fails before anything is written
    delta_from = _delta_from(delta_base, state_dict, names, version)
    root.mkdir(parents=True, exist_ok=True)
    tmp_dir = temporary_dir(root, f"v{version:08d}")
    shard_kwargs = dict(fsync=fsync, checksum=checksum, base=delta_base, delta=delta_from[0] is not None)
    try:
        reused = claim_spare(root, tmp_dir, layout.file_names) if reuse_spare else _fresh_dir(tmp_dir)
        written = _write_tensor_files(
            state_dict, layout, tmp_dir, reused=reused, max_threads=max_threads, shard_kwargs=shard_kwargs
        )
        manifest = _write_metadata(
            state_dict,
            layout,
            tmp_dir,
            version,
            written=written,
            extra=extra,
            fsync=fsync,
            checksum=checksum,
            delta_from=delta_from,
            delta_next=delta_base is not None,
        )
        _rename_into_place(tmp_dir, final_dir, fsync=fsync)
        if delta_base is not None:
            delta_base.commit(version, tuple(f.checksum for f in manifest.files))
    except BaseException:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise
    _log_published(manifest, final_dir, num_files=len(layout.plan))
    return manifest
