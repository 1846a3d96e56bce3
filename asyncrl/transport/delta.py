"""Delta updates (`weights.delta`): a version published also as the XOR of its bytes with the
previous version's, compressed with zstd, which generators holding that version apply instead of
reading the full shards.

Place in the data flow: learner rank 0's `ShardPublisher` keeps a `DeltaBase` (the last published
version's tensor bytes, one copy of the model in host memory) and hands it to `write_shards`, whose
threads write, for every shard, the full file and, in the same pass over each chunk, a `DeltaSink`
stream next to it (`model-00001-of-00002.safetensors.xor.zst`), then record both in the manifest
(`ManifestDelta`). The full version is always written: late joiners, restarted generators and any
reader whose base does not match read it. On the generator, `receiver.WeightsReceiver` keeps the
last version it fetched as a `HeldVersion` when the manifest says the next one may be a delta
(`delta_next`), and `shard_read.read_shards(..., held=...)` applies the delta when the manifest's
`base_version` and `base_checksums` are exactly what it holds (`apply_delta_shard`).

Exactness: a delta file is the shard's safetensors header, then its data bytes XOR the base's bytes
of the same tensors, zstd-compressed. Applying it rebuilds the shard file byte for byte, and the
rebuilt bytes are hashed and compared with the full file's checksum in the manifest (and the delta
file with its own), so a delta either gives exactly the full version's bytes or raises
`WeightsCorruptError` and changes nothing the generator serves.

Why XOR: unchanged bytes (an element that did not move, the sign and exponent bytes of one that
moved a little) become zero and compress to almost nothing; the XOR is exact for every dtype and
needs no arithmetic on the values. bench/README.md has the bytes per update.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

from asyncrl.transport.checksum import new_hasher
from asyncrl.transport.manifest import CorruptFn, DeltaFile, ManifestDelta, ManifestFile, ShardManifest
from asyncrl.transport.shard_io import CHUNK_BYTES, byte_view, fresh_cpu_bytes

__all__ = [
    "DELTA_ENCODING",
    "DeltaBase",
    "DeltaSink",
    "HeldVersion",
    "apply_delta_shard",
    "delta_file_name",
]

DELTA_ENCODING = "xor-zstd"
_DELTA_SUFFIX = ".xor.zst"
# zstd level 1: the fastest level that keeps the bytes (levels compared in docs/weights.md, "Delta updates").
_ZSTD_LEVEL = 1
# The decompressor reads the delta file in pieces of this size (read_size of its stream reader).
_READ_BYTES = 1 << 20


def delta_file_name(shard_name: str) -> str:
    return shard_name + _DELTA_SUFFIX


def _xor_into(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """out = a ^ b over uint8 views, 8 bytes at a time where the lengths allow it."""
    n = a.numel()
    if n % 8 == 0 and all(t.data_ptr() % 8 == 0 for t in (out, a, b)):
        torch.bitwise_xor(a.view(torch.int64), b.view(torch.int64), out=out[:n].view(torch.int64))
    else:
        torch.bitwise_xor(a, b, out=out[:n])
    return out[:n]


# ---------------------------------------------------------------------------------------------- learner


@dataclass
class DeltaBase:
    """Learner side: the bytes of the last version published (`version`, None: no usable base),
    per tensor as flat uint8 CPU tensors, and its shard checksums. `write_shards` updates it in
    the pass that writes the next version; a write that fails leaves it unusable (`version` None),
    so the next version is published full only."""

    version: int | None = None
    checksums: tuple[str, ...] = ()
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    layout: dict[str, tuple[str, tuple[int, ...]]] = field(default_factory=dict)

    def prepare(self, layout: Mapping[str, tuple[str, tuple[int, ...]]]) -> bool:
        """Before a version is written: whether a delta can be written against the held version
        (same names, dtypes and shapes in the same order); if not, fresh buffers for the new
        layout. Either way the base is unusable until `commit`."""
        usable = self.version is not None and list(self.layout.items()) == list(layout.items())
        if not usable:
            self.layout = dict(layout)
            self.tensors = {}
        self.version = None  # until commit: the buffers are being overwritten
        return usable

    def buffer(self, name: str, num_bytes: int) -> torch.Tensor:
        """The base's flat bytes of `name`, allocated once per layout (by the writing thread)."""
        buf = self.tensors.get(name)
        if buf is None or buf.numel() != num_bytes:
            buf = self.tensors[name] = fresh_cpu_bytes(num_bytes)
        return buf

    def commit(self, version: int, checksums: tuple[str, ...]) -> None:
        self.version = version
        self.checksums = checksums


class DeltaSink:
    """Writes one shard's delta file while the shard is written: `raw` for the header bytes, then
    `xor` for every data chunk with the base's bytes at the same place; hashes what it writes."""

    def __init__(self, path: Path, checksum_kind: str, *, reuse: bool = False) -> None:
        import zstandard

        self.path = path
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | (os.O_TRUNC if reuse else os.O_EXCL), 0o644)
        self._compressor = zstandard.ZstdCompressor(level=_ZSTD_LEVEL).compressobj()
        self._hasher = new_hasher(checksum_kind)
        self._scratch = torch.empty(CHUNK_BYTES, dtype=torch.uint8)
        self.size_bytes = 0

    def _emit(self, data: bytes) -> None:
        if data:
            self._hasher.update(data)
            view = memoryview(data)
            while view:
                view = view[os.write(self._fd, view) :]
            self.size_bytes += len(data)

    def raw(self, data: bytes | memoryview) -> None:
        self._emit(self._compressor.compress(data))  # releases the GIL: shards go in parallel

    def xor(self, chunk: torch.Tensor, base_chunk: torch.Tensor) -> None:
        """`chunk` and `base_chunk`: uint8 views of the same length, at most CHUNK_BYTES."""
        self.raw(byte_view(_xor_into(self._scratch, chunk, base_chunk)))

    def close(self, shard_name: str) -> DeltaFile:
        try:
            self._emit(self._compressor.flush())
        finally:
            os.close(self._fd)
        return DeltaFile(
            name=self.path.name,
            shard=shard_name,
            size_bytes=self.size_bytes,
            checksum=self._hasher.hexdigest(),
        )

    def abort(self) -> None:
        os.close(self._fd)


# ---------------------------------------------------------------------------------------------- generator


@dataclass(frozen=True)
class HeldVersion:
    """Generator side: a version's tensors as fetched (verified), and its shard checksums: the base a
    delta of the next version applies to. The tensors must not change while held (the service
    hands them to the generator, which copies them into its model)."""

    version: int
    checksums: tuple[str, ...]
    tensors: Mapping[str, torch.Tensor]

    @classmethod
    def of(cls, manifest: ShardManifest, tensors: Mapping[str, torch.Tensor]) -> HeldVersion:
        return cls(manifest.version, tuple(f.checksum for f in manifest.files), tensors)

    def matches(self, delta: ManifestDelta | None) -> bool:
        return (
            delta is not None
            and delta.encoding == DELTA_ENCODING
            and delta.base_version == self.version
            and tuple(delta.base_checksums) == self.checksums
        )


class _HashingFile:
    """The delta file as zstd's stream reader sees it: hashes every byte read, counts them."""

    def __init__(self, fd: int, checksum_kind: str) -> None:
        self.fd = fd
        self.hasher = new_hasher(checksum_kind)
        self.num_bytes = 0

    def read(self, size: int = -1) -> bytes:
        data = os.read(self.fd, size if size > 0 else _READ_BYTES)
        self.hasher.update(data)
        self.num_bytes += len(data)
        return data


def apply_delta_shard(
    vdir: Path,
    delta: DeltaFile,
    record: ManifestFile,
    held: HeldVersion,
    checksum_kind: str,
    corrupt: CorruptFn,
    parse_header,
) -> tuple[dict, torch.Tensor]:
    """Rebuild shard `record` from `delta` and the held base: returns (the parsed header, the data
    bytes in a fresh buffer), both checked: the delta file against its checksum and size, the
    rebuilt file against `record`'s checksum and size. `parse_header(raw, data_bytes)` checks the
    header against the manifest and returns its entries (name, begin, end) in file order."""
    import zstandard

    try:
        fd = os.open(vdir / delta.name, os.O_RDONLY)
    except FileNotFoundError as e:
        raise corrupt(f"has no delta file {delta.name}") from e
    source = _HashingFile(fd, checksum_kind)
    rebuilt = new_hasher(checksum_kind)
    try:
        if os.fstat(fd).st_size != delta.size_bytes:
            raise corrupt(f"has a delta file {delta.name} of the wrong size")
        reader = zstandard.ZstdDecompressor().stream_reader(source, read_size=_READ_BYTES)

        def read_into(view: memoryview) -> None:
            pos = 0
            while pos < len(view):
                n = reader.readinto(view[pos:])
                if n == 0:
                    raise corrupt(f"has a delta file {delta.name} that ends early")
                pos += n

        prefix = bytearray(8)
        read_into(memoryview(prefix))
        (header_len,) = struct.unpack("<Q", prefix)
        data_bytes = record.size_bytes - 8 - header_len
        if data_bytes < 0:
            raise corrupt(f"has a delta file {delta.name} with a header longer than the shard")
        raw = bytearray(header_len)
        read_into(memoryview(raw))
        entries = parse_header(bytes(raw), data_bytes)
        rebuilt.update(prefix)
        rebuilt.update(raw)
        buf = fresh_cpu_bytes(data_bytes)
        view = memoryview(buf.numpy())
        for name, begin, end in entries:
            base = held.tensors[name]
            base_bytes = base.reshape(-1).view(torch.uint8)
            if base_bytes.numel() != end - begin:
                raise corrupt(f"has a delta for {name!r} that does not fit the held version")
            for start in range(begin, end, CHUNK_BYTES):
                stop = min(start + CHUNK_BYTES, end)
                read_into(view[start:stop])
                piece = buf[start:stop]
                _xor_into(piece, piece, base_bytes[start - begin : stop - begin])
                rebuilt.update(view[start:stop])  # in cache: the hash of the rebuilt bytes
        if reader.read(1):
            raise corrupt(f"has a delta file {delta.name} longer than its shard")
        while source.read(_READ_BYTES):  # the hash covers the whole file
            pass
    except zstandard.ZstdError as e:
        raise corrupt(f"has a delta file {delta.name} that does not decompress: {e}") from e
    finally:
        os.close(fd)
    if source.num_bytes != delta.size_bytes or source.hasher.hexdigest() != delta.checksum:
        raise corrupt(f"has a delta file {delta.name} that fails its {checksum_kind} check")
    if rebuilt.hexdigest() != record.checksum:
        raise corrupt(f"rebuilt from its delta fails its {checksum_kind} check")
    return entries, buf
