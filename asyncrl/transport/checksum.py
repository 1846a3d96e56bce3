"""Per-file integrity checksums of published weights (`weights.checksum`): which hash, and one
object to feed it chunk by chunk.

Place in the data flow: the shard writer (`shards.py`, learner rank 0) feeds every chunk it writes
to a `new_hasher(kind)` while the chunk is in cache (never a second pass over the bytes), records
the digest and the kind in the manifest, and every reader (`shard_read.py`, `delta.py`) recomputes
it the same way while it loads, one file per thread.

Kinds (their speeds, measured by `asyncrl bench weights`, and why xxh3 is the default:
docs/weights.md, "Integrity"):

- `xxh3` (default): XXH3-128 (the `xxhash` package), faster than one memcpy, so integrity costs a
  few percent of a load. Not cryptographic: it guards against corruption (a flipped bit, a
  truncated or torn file, a lagging shared directory), not against someone who can write the
  weights root (who could rewrite the manifest too).
- `blake3`: cryptographic and still fast.
- `sha256`: cryptographic, the slowest: what manifests of schema 1 carry.
"""

from __future__ import annotations

import hashlib
from typing import Literal, Protocol

__all__ = ["CHECKSUM_KINDS", "ChecksumKind", "Hasher", "checksum_of", "new_hasher"]

ChecksumKind = Literal["xxh3", "blake3", "sha256"]
CHECKSUM_KINDS: tuple[str, ...] = ("xxh3", "blake3", "sha256")
DEFAULT_CHECKSUM: ChecksumKind = "xxh3"


class Hasher(Protocol):
    def update(self, data: bytes | memoryview, /) -> None: ...

    def hexdigest(self) -> str: ...


def new_hasher(kind: str) -> Hasher:
    """A fresh hasher of `kind`; every kind releases the GIL on large chunks, so files hash in
    parallel threads. ValueError for an unknown kind."""
    if kind == "xxh3":
        import xxhash

        return xxhash.xxh3_128()
    if kind == "blake3":
        import blake3

        return blake3.blake3()
    if kind == "sha256":
        return hashlib.sha256()
    raise ValueError(f"unknown checksum kind {kind!r}; expected one of {', '.join(CHECKSUM_KINDS)}")


def checksum_of(kind: str, data: bytes | memoryview) -> str:
    """The hex digest of `kind` over `data` in one go (small files: index, manifest, configs)."""
    hasher = new_hasher(kind)
    hasher.update(data)
    return hasher.hexdigest()
