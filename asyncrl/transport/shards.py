"""Versioned safetensors shards: the disk path of weight sync (learner -> generators).

Place in the data flow: after an optimizer step, learner rank 0 calls `write_shards` to publish the
full Hugging Face-named state dict as `root/v{version:08d}/`, announces `WeightsPublished(version,
transport="safetensors", location=<that dir>)` over ZMQ, and each generator calls `read_shards`
(torch generator) or hands the directory to SGLang's `/update_weights_from_disk`, then acks with
`WeightsLoaded`. `retention.py` decides when old version directories may be deleted.

Layout of one version directory (the standard Hugging Face sharded checkpoint, plus our manifest):

    v00000042/
      model-00001-of-00003.safetensors ...   shards of at most `max_shard_bytes` tensor bytes
      model.safetensors.index.json           {"metadata": {"total_size": N}, "weight_map": {name: file}}
      manifest.json                          ShardManifest: version, tensors, per-file sha256 and size
      config.json, tokenizer.json, ...       optional `extra_files`, so `from_pretrained` works

Publication is atomic: everything is written and fsynced in a hidden temporary directory under `root`
and then renamed to `v{version:08d}`, so a reader never sees a half-written version. Checksums are
computed while writing (each chunk is hashed and written while it is hot in cache), never by reading
files back. sha256 dominates the cost and is sequential within a file, so shards are planned even
and as many as a multiple of the threads (`shard_plan.py`), and each thread hashes its own files.
The temporary directory is a pruned version's recycled directory when retention kept one
(`retention.prune(..., keep_spare=True)`): its files are overwritten in place, which on tmpfs
costs far less than allocating new pages.

Shard files are written by this module directly in the safetensors format (8-byte little-endian
header length, JSON header padded to 8 bytes, raw little-endian tensor bytes) so that tensor memory
goes to the file with no intermediate serialized copy (raw bytes are written as they lie in memory,
so like safetensors itself this assumes a little-endian host).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import mmap
import os
import shutil
import struct
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from asyncrl.transport.manifest import (
    INDEX_NAME,
    MANIFEST_NAME,
    SAFETENSORS_CODES,
    CorruptFn,
    ManifestFile,
    ManifestTensor,
    ShardManifest,
    WeightsCorruptError,
    check_file_name,
    dtype_from_name,
    dtype_name,
    safetensors_code,
)
from asyncrl.transport.retention import (
    claim_spare,
    latest_version,
    list_versions,
    remove_incomplete,
    temporary_dir,
    version_dir,
)
from asyncrl.transport.shard_plan import largest_first, plan_shards

__all__ = [
    "ManifestFile",
    "ManifestTensor",
    "ShardManifest",
    "WeightsCorruptError",
    "collect_config_files",
    "dtype_from_name",
    "dtype_name",
    "fresh_cpu_bytes",
    "latest_version",
    "list_versions",
    "plan_shards",
    "read_manifest",
    "read_shards",
    "remove_incomplete",
    "version_dir",
    "write_shards",
]

logger = logging.getLogger(__name__)

# Hashing and writing go chunk by chunk so that a chunk is still in cache for the second pass.
_CHUNK_BYTES = 4 << 20
# Fresh buffers from this size on get transparent huge pages (`fresh_cpu_bytes`): one huge page.
_HUGE_PAGE_MIN_BYTES = 2 << 20
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


def fresh_cpu_bytes(num_bytes: int) -> torch.Tensor:
    """A new uint8 CPU tensor of `num_bytes` (contents undefined), cheap to fill for the first time.

    Memory fresh from `torch.empty` takes a page fault per 4 KiB page when first written, which
    costs several times the copy itself (bench/README.md, "Weight sync"). Buffers of `_HUGE_PAGE_MIN_BYTES` or more are mapped
    with transparent huge pages where the kernel allows them (`madvise` or `always` mode; else this
    is plain memory, as from `torch.empty`). The mapping lives as long as any view of the tensor.
    """
    if num_bytes < _HUGE_PAGE_MIN_BYTES or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.empty(num_bytes, dtype=torch.uint8)
    mapping = mmap.mmap(-1, num_bytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    with contextlib.suppress(OSError):  # THP "never" or not built in: plain pages
        mapping.madvise(mmap.MADV_HUGEPAGE)
    return torch.frombuffer(mapping, dtype=torch.uint8)


def _byte_view(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


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
    path: Path, entries: list[tuple[str, torch.Tensor]], *, fsync: bool, reuse: bool = False
) -> ManifestFile:
    """Write and hash one shard; with `reuse`, `path` is a recycled file, overwritten and cut to size."""
    # Largest element size first: with no padding between tensors every offset stays aligned to its
    # own element size (sizes are powers of two), which zero-copy readers rely on.
    entries = sorted(entries, key=lambda e: -e[1].element_size())
    entries = [(name, _as_cpu_contiguous(t)) for name, t in entries]
    hasher = hashlib.sha256()
    size_bytes = 0
    fd = _open_shard(path, reuse=reuse)
    try:
        header = memoryview(_header_bytes(entries))
        hasher.update(header)
        _write_all(fd, header)
        size_bytes += len(header)
        for _, t in entries:
            if t.numel() == 0:
                continue
            data = _byte_view(t)
            for start in range(0, len(data), _CHUNK_BYTES):
                chunk = data[start : start + _CHUNK_BYTES]
                hasher.update(chunk)  # releases the GIL: shards are hashed in parallel threads
                _write_all(fd, chunk)
            size_bytes += len(data)
        if reuse:
            os.ftruncate(fd, size_bytes)  # the recycled file may have been longer
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)
    return ManifestFile(name=path.name, size_bytes=size_bytes, sha256=hasher.hexdigest())


def _write_small_file(path: Path, data: bytes, *, fsync: bool) -> ManifestFile:
    with open(path, "xb") as f:
        f.write(data)
        if fsync:
            f.flush()
            os.fsync(f.fileno())
    return ManifestFile(name=path.name, size_bytes=len(data), sha256=hashlib.sha256(data).hexdigest())


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


def _num_threads(num_threads: int | None, num_jobs: int) -> int:
    if num_threads is not None and num_threads <= 0:
        raise ValueError(f"num_threads must be > 0, got {num_threads}")
    return max(1, min(num_jobs, num_threads or os.cpu_count() or 1))


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
) -> ShardManifest:
    """Publish `state_dict` (Hugging Face names) atomically as `root/v{version:08d}`.

    Tensors may live on any device and need not be contiguous (they are copied to contiguous CPU
    memory one shard at a time); contiguous CPU tensors are written with no copy. `extra_files`
    (file name -> bytes, e.g. from `collect_config_files`) are written alongside so the directory is a
    complete `from_pretrained` / SGLang `update_weights_from_disk` model directory. Shards are written
    by up to `num_threads` threads (default: CPU count), each hashing a shard as it writes it; the
    shards are planned even, and as many as a multiple of the threads, so the threads finish
    together. With `reuse_spare`, a spare left by `retention.prune(..., keep_spare=True)` is taken
    and its files overwritten rather than new ones created. Raises FileExistsError if the version
    is already published and ValueError for bad input; on any failure nothing is published.
    """
    root = Path(root)
    final_dir = version_dir(root, version)
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
    extra = dict(extra_files or {})
    for name in extra:
        _check_extra_name(name)
    if final_dir.exists():
        raise FileExistsError(f"weights version {version} is already published at {final_dir}")

    sizes = [state_dict[n].numel() * state_dict[n].element_size() for n in names]
    max_threads = _num_threads(num_threads, len(names))
    plan = plan_shards(sizes, max_shard_bytes=max_shard_bytes, num_parallel=max_threads)
    num_shards = len(plan)
    file_names = [f"model-{i + 1:05d}-of-{num_shards:05d}.safetensors" for i in range(num_shards)]

    root.mkdir(parents=True, exist_ok=True)
    tmp_dir = temporary_dir(root, f"v{version:08d}")
    try:
        if reuse_spare:
            reused = claim_spare(root, tmp_dir, file_names)
        else:
            tmp_dir.mkdir()
            reused = set()
        with ThreadPoolExecutor(min(max_threads, num_shards), thread_name_prefix="write-shard") as pool:
            futures = {
                s: pool.submit(
                    _write_shard_file,
                    tmp_dir / file_names[s],
                    [(names[i], state_dict[names[i]]) for i in plan[s]],
                    fsync=fsync,
                    reuse=file_names[s] in reused,
                )
                for s in largest_first([sum(sizes[i] for i in idx) for idx in plan])
            }
            shard_files = tuple(futures[s].result() for s in range(num_shards))
        file_of = {names[i]: file_names[s] for s, idx in enumerate(plan) for i in idx}
        total_size_bytes = sum(sizes)
        index = {"metadata": {"total_size": total_size_bytes}, "weight_map": file_of}
        _write_small_file(tmp_dir / INDEX_NAME, json.dumps(index, indent=2).encode(), fsync=fsync)
        extra_records = tuple(
            _write_small_file(tmp_dir / n, data, fsync=fsync) for n, data in sorted(extra.items())
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
                for n in names
            ),
            files=shard_files,
            extra_files=extra_records,
        )
        # The manifest is written last: its presence inside the temporary directory marks it complete.
        _write_small_file(tmp_dir / MANIFEST_NAME, manifest.to_json(), fsync=fsync)
        if fsync:
            _fsync_dir(tmp_dir)
        os.rename(tmp_dir, final_dir)  # the atomic publish
        if fsync:
            _fsync_dir(root)
    except BaseException:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise
    logger.info(
        "published weights version %d: %d tensors, %d bytes in %d shards at %s",
        version,
        len(names),
        total_size_bytes,
        num_shards,
        final_dir,
    )
    return manifest


# ---------------------------------------------------------------------------------------------- read


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
            f"weights version {version}: {path} says version {manifest.version}; the directory was tampered with"
        )
    return manifest


def _read_exact(fd: int, view: memoryview, hasher: hashlib._Hash | None, corrupt: CorruptFn) -> None:
    """Fill `view` from `fd`, hashing each chunk right after it is read (while it is in cache)."""
    pos = 0
    while pos < len(view):
        n = os.readv(fd, [view[pos : pos + _CHUNK_BYTES]])
        if n == 0:
            raise corrupt("ends early")
        if hasher is not None:
            hasher.update(view[pos : pos + n])  # releases the GIL: shards are verified in parallel threads
        pos += n


def _read_header(
    fd: int, hasher: hashlib._Hash | None, corrupt: CorruptFn, size_bytes: int
) -> tuple[dict, int]:
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
    try:
        header = json.loads(raw)
    except ValueError as e:
        raise corrupt(f"has a malformed header: {e}") from e
    if not isinstance(header, dict):
        raise corrupt("has a header that is not a JSON object")
    header.pop("__metadata__", None)
    return header, 8 + header_len


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


def _read_shard_file(
    path: Path,
    record: ManifestFile,
    expected: list[ManifestTensor],
    version: int,
    *,
    verify: bool,
    out: Mapping[str, torch.Tensor] | None,
) -> dict[str, torch.Tensor]:
    """Read one shard: into `out`'s tensors if given, else into one fresh buffer the tensors view."""

    def corrupt(why: str) -> WeightsCorruptError:
        return WeightsCorruptError(f"weights version {version}: file {record.name} {why}")

    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError as e:
        raise corrupt("is missing") from e
    hasher = hashlib.sha256() if verify else None
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
            for t, begin, end in entries:
                dtype = dtype_from_name(t.dtype)
                raw = buf[begin:end] if begin % dtype.itemsize == 0 else buf[begin:end].clone()
                tensors[t.name] = raw.view(dtype).reshape(t.shape)
        else:
            for t, begin, end in entries:
                dest = out[t.name]
                direct = dest.device.type == "cpu" and dest.is_contiguous()
                stage = dest if direct else torch.empty(t.shape, dtype=dest.dtype)
                if end > begin:
                    _read_exact(fd, _byte_view(stage), hasher, corrupt)
                if not direct:
                    dest.copy_(stage)
                tensors[t.name] = dest
    finally:
        os.close(fd)
    if hasher is not None and hasher.hexdigest() != record.sha256:
        raise corrupt("fails its sha256 check")
    return tensors


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
) -> dict[str, torch.Tensor]:
    """Load a published version as {name: tensor} in state-dict order.

    With `verify` every file's sha256 is checked against the manifest, hashing each chunk as it is
    read. A missing, truncated, corrupt or inconsistent file raises WeightsCorruptError naming the file
    and version; an unpublished (or already deleted) version raises FileNotFoundError.

    Without `out`, each shard is read into one fresh CPU buffer and the tensors are views into it
    (then moved to `device` if that is not the CPU). With `out` (name -> existing tensor, e.g. a
    generator's parameters; extra names are ignored) the bytes are read straight into those tensors,
    staged through CPU memory only when a tensor is not contiguous CPU memory, and `device` is unused.
    If WeightsCorruptError is raised, `out` holds partly updated weights: load another version.
    """
    manifest = read_manifest(root, version)
    vdir = version_dir(root, version)
    target = torch.device(device)
    if out is not None:
        _check_out(manifest, out)
    by_file: dict[str, list[ManifestTensor]] = {f.name: [] for f in manifest.files}
    for t in manifest.tensors:
        by_file[t.file].append(t)

    def load(record: ManifestFile) -> dict[str, torch.Tensor]:
        tensors = _read_shard_file(
            vdir / record.name, record, by_file[record.name], version, verify=verify, out=out
        )
        if out is None and target.type != "cpu":
            tensors = {n: t.to(target) for n, t in tensors.items()}
        return tensors

    num_workers = _num_threads(num_threads, len(manifest.files))
    order = largest_first([f.size_bytes for f in manifest.files])
    with ThreadPoolExecutor(num_workers, thread_name_prefix="read-shard") as pool:
        loaded: dict[str, torch.Tensor] = {}
        for part in pool.map(load, [manifest.files[i] for i in order]):
            loaded.update(part)
    if verify:
        for record in manifest.extra_files:
            path = vdir / record.name
            if not path.is_file():
                raise WeightsCorruptError(f"weights version {version}: file {record.name} is missing")
            if hashlib.sha256(path.read_bytes()).hexdigest() != record.sha256:
                raise WeightsCorruptError(
                    f"weights version {version}: file {record.name} fails its sha256 check"
                )
    return {t.name: loaded[t.name] for t in manifest.tensors}
