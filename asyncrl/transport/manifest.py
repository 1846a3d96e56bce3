"""The manifest of a published weights version and the dtype names it uses (pure data format).

Place in the data flow: `shards.py` writes a `ShardManifest` as `manifest.json` next to every
version's safetensors shards and `shard_read.py` verifies files against it; `TensorMeta` lists derived
from it describe tensors for broadcast announcements.

Schema 2 records each file's checksum under the manifest's `checksum_kind` (`checksum.py`) and, for a
version published as a delta too, the delta files (`delta.py`). Schema 1 manifests (a `sha256` per
file) still load: `from_json` reads them as `checksum_kind = "sha256"`.
"""

from __future__ import annotations

from collections.abc import Callable

import msgspec
import torch

from asyncrl.messages import TensorMeta
from asyncrl.transport.checksum import CHECKSUM_KINDS
from asyncrl.transport.retention import TMP_PREFIX

MANIFEST_NAME = "manifest.json"
INDEX_NAME = "model.safetensors.index.json"
MANIFEST_SCHEMA = 2
_SCHEMA_SHA256_FILES = 1  # before checksum kinds: every file has a `sha256`

# torch dtype -> safetensors dtype code (the safetensors format specification's names).
SAFETENSORS_CODES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.uint16: "U16",
    torch.uint32: "U32",
    torch.uint64: "U64",
}


class WeightsCorruptError(ValueError):
    """A published weights version is missing a file or a file does not match its manifest."""


CorruptFn = Callable[[str], WeightsCorruptError]


class ManifestTensor(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    name: str
    dtype: str  # torch dtype name without "torch.", as in TensorMeta and SGLang's `dtypes`
    shape: tuple[int, ...]
    file: str


class ManifestFile(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, omit_defaults=True):
    name: str
    size_bytes: int
    checksum: str = ""  # hex digest of the whole file, of the manifest's `checksum_kind`
    sha256: str = ""  # schema 1 only (read as `checksum`), as `sha256sum` prints it


class DeltaFile(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One shard's delta: zstd of (the shard's safetensors header, then its data bytes XOR the base
    version's bytes of the same tensors). Applying it gives the shard file `shard` exactly; the
    result is checked against that file's checksum."""

    name: str  # the delta file, in the version directory
    shard: str  # the shard file it rebuilds
    size_bytes: int  # of the delta file (compressed)
    checksum: str  # of the delta file's bytes, of the manifest's `checksum_kind`


class ManifestDelta(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """This version is also published as a difference from `base_version`; a reader that holds
    that version's bytes (and whose copy has `base_checksums`, the base's shard checksums in shard
    order) may apply the delta instead of reading the shards."""

    base_version: int
    base_checksums: tuple[str, ...]
    encoding: str = "xor-zstd"
    files: tuple[DeltaFile, ...]


class ShardManifest(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Everything a reader needs to verify one published version (written as `manifest.json`)."""

    schema: int = MANIFEST_SCHEMA
    version: int
    total_size_bytes: int  # sum of tensor bytes; equals the index's metadata.total_size
    tensors: tuple[ManifestTensor, ...]  # in state-dict order
    files: tuple[ManifestFile, ...]  # shard files, in shard order
    extra_files: tuple[ManifestFile, ...] = ()
    checksum_kind: str = "sha256"  # the hash of every `checksum` here (`checksum.py`)
    delta: ManifestDelta | None = None
    # The publisher keeps this version's bytes to publish the next one as a delta from it: a
    # reader that may take deltas keeps its copy of this version (`delta.DeltaBase`).
    delta_next: bool = False

    def to_json(self) -> bytes:
        return msgspec.json.format(msgspec.json.encode(self), indent=1)

    @classmethod
    def from_json(cls, data: bytes | str) -> ShardManifest:
        """Decode and check a manifest; raises ValueError (msgspec.DecodeError) if malformed."""
        manifest = msgspec.json.decode(data, type=cls)
        if manifest.schema == _SCHEMA_SHA256_FILES:
            manifest = _from_schema_1(manifest)
        elif manifest.schema != MANIFEST_SCHEMA:
            raise ValueError(
                f"manifest schema {manifest.schema} is not supported (expected {MANIFEST_SCHEMA})"
            )
        if manifest.checksum_kind not in CHECKSUM_KINDS:
            raise ValueError(f"manifest checksum kind {manifest.checksum_kind!r} is not supported")
        records = (*manifest.files, *manifest.extra_files)
        for record in records:
            check_file_name(record.name)  # a tampered manifest must not point outside its directory
            if not record.checksum:
                raise ValueError(f"manifest file {record.name!r} has no checksum")
        if manifest.delta is not None:
            shard_names = {f.name for f in manifest.files}
            for d in manifest.delta.files:
                check_file_name(d.name)
                if d.shard not in shard_names or d.name in shard_names:
                    raise ValueError(f"manifest delta file {d.name!r} names no shard of this version")
        file_names = {f.name for f in manifest.files}
        for t in manifest.tensors:
            dtype_from_name(t.dtype)
            if t.file not in file_names:
                raise ValueError(f"manifest tensor {t.name!r} refers to unknown file {t.file!r}")
        return manifest

    def metas(self) -> list[TensorMeta]:
        """The tensors as wire metadata, in state-dict order (e.g. for a broadcast announcement)."""
        return [TensorMeta(name=t.name, dtype=t.dtype, shape=t.shape) for t in self.tensors]


def _from_schema_1(manifest: ShardManifest) -> ShardManifest:
    """A schema 1 manifest (sha256 per file, no kind) as schema 2."""

    def convert(records: tuple[ManifestFile, ...]) -> tuple[ManifestFile, ...]:
        return tuple(ManifestFile(name=r.name, size_bytes=r.size_bytes, checksum=r.sha256) for r in records)

    if manifest.delta is not None or manifest.checksum_kind != "sha256":
        raise ValueError("a schema 1 manifest has no checksum kind and no delta")
    return msgspec.structs.replace(
        manifest,
        schema=MANIFEST_SCHEMA,
        files=convert(manifest.files),
        extra_files=convert(manifest.extra_files),
    )


def dtype_name(dtype: torch.dtype) -> str:
    """`torch.bfloat16` -> "bfloat16" (the name used by TensorMeta and SGLang)."""
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    """Name -> dtype ("bfloat16" -> `torch.bfloat16`); ValueError for anything that is not a torch dtype."""
    dtype = getattr(torch, name, None) if name.isidentifier() else None
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown torch dtype name {name!r}")
    return dtype


def safetensors_code(dtype: torch.dtype, name: str) -> str:
    code = SAFETENSORS_CODES.get(dtype)
    if code is None:
        supported = ", ".join(sorted(dtype_name(d) for d in SAFETENSORS_CODES))
        raise ValueError(
            f"tensor {name!r} has dtype {dtype_name(dtype)}, not storable in safetensors ({supported})"
        )
    return code


def check_file_name(name: str) -> None:
    """A plain file name inside a version directory (a tampered manifest must not escape it)."""
    if not name or name in (".", "..") or "/" in name or "\\" in name or name.startswith(TMP_PREFIX):
        raise ValueError(f"file name {name!r} must be a plain file name")
