"""Files over ZeroMQ for hosts without the launcher's filesystem: the initial model and every
published weights version, chunked and checked against checksums.

Place in the data flow: the launcher (node A, where the learner writes its shards) runs a
`FileServer` on a ROUTER socket of its own (never the control socket: a transfer must not hold up
control messages) with two roots, "model" (the initial model directory) and "weights" (the weights
root). A worker that joins from another host (`asyncrl worker`, docs/multi-host.md) fetches the
model with `fetch_tree` before it starts its generators; each of those generators fetches every
version it loads with `NetworkWeights.fetch` (called by `receiver.WeightsReceiver` in its fetch
thread) into a local cache directory (the worker's scratch directory, /dev/shm where there is one),
then reads it there exactly as local shards are read (`shard_read.read_shards`, verified again).

Protocol: `FileRequest(root, name, offset, max_bytes)` -> `FileChunk(offset, total_bytes, data)`.
The server answers requests one at a time in arrival order (its reads in a worker thread, so the
launcher's loop stays free), so a client keeps `WINDOW` requests outstanding and gets the chunks
back in order; it hashes each chunk as it writes it (the manifest's checksum kind, xxh3 by default)
and moves the file into place only when its size and checksum match. Integrity: a version's
manifest vouches for every shard, delta and extra file; the manifest itself is the root of trust
(as on a shared filesystem), and the socket is CURVE-protected beyond loopback (`zmq_io.Endpoint`).
Names are confined to their root: no absolute paths, no `..`, no hidden (`.tmp-*`) entries, no
symlink that leads outside.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import shutil
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import zmq

from asyncrl.messages import FileChunk, FileEntry, FileRequest
from asyncrl.transport.checksum import new_hasher
from asyncrl.transport.fence import UpdateFailed
from asyncrl.transport.retention import TMP_PREFIX, list_versions, version_dir
from asyncrl.transport.zmq_io import Endpoint

if TYPE_CHECKING:  # the manifest module imports torch, which the launcher never loads
    from asyncrl.transport.manifest import ShardManifest

log = logging.getLogger(__name__)

__all__ = ["FileServer", "NetworkWeights", "fetch_tree", "list_tree"]

# Bytes per FileChunk: large enough that per-message costs vanish, well below
# cluster.max_message_mb (64 MiB by default) and the codec's 16 MiB header cap.
CHUNK_BYTES = 4 << 20
# Requests a client keeps outstanding (the pipe stays full while the server reads the next chunk).
WINDOW = 4
# A server that does not answer a request for this long is gone: the fetch fails (and is retried).
REPLY_TIMEOUT_S = 60.0


class FileServer:
    """Serves the files under named roots, read-only, to whoever can reach its socket."""

    def __init__(self, roots: Mapping[str, Path]) -> None:
        self.roots = {name: Path(root) for name, root in roots.items()}
        self.num_requests = 0
        self.num_errors = 0
        self.bytes_served = 0

    def resolve(self, root: str, name: str) -> Path:
        """The file `name` under `root`; ValueError for a name outside it."""
        base = self.roots.get(root)
        if base is None:
            raise ValueError(f"unknown root {root!r}")
        parts = name.split("/")
        if not name or name.startswith("/") or any(p in ("", ".", "..") or p.startswith(".") for p in parts):
            raise ValueError(f"{name!r} is not a plain relative path")
        path = base.joinpath(*parts)
        if not path.resolve().is_relative_to(base.resolve()):
            raise ValueError(f"{name!r} leads outside its root")
        return path

    def answer(self, msg: FileRequest) -> FileChunk:
        """One request's answer (blocking file I/O: called in a worker thread)."""
        try:
            path = self.resolve(msg.root, msg.name)
            if msg.offset < 0 or msg.max_bytes <= 0:
                raise ValueError(f"bad range offset={msg.offset} max_bytes={msg.max_bytes}")
            with open(path, "rb") as f:
                total = os.fstat(f.fileno()).st_size
                data = os.pread(f.fileno(), min(msg.max_bytes, CHUNK_BYTES), msg.offset)
        except (OSError, ValueError) as exc:
            self.num_errors += 1
            error = "no such file" if isinstance(exc, FileNotFoundError) else str(exc)
            return FileChunk(root=msg.root, name=msg.name, offset=msg.offset, error=error)
        self.bytes_served += len(data)
        return FileChunk(root=msg.root, name=msg.name, offset=msg.offset, total_bytes=total, data=data)

    async def serve(self, ep: Endpoint) -> None:
        """Answer requests on `ep` (a ROUTER that accepts FileRequest), in order, until cancelled."""
        while True:
            sender, msg, _ = await ep.recv()
            self.num_requests += 1
            reply = await asyncio.to_thread(self.answer, msg)
            try:
                await ep.send(reply, to=sender)
            except zmq.ZMQError as exc:  # the client left (a given-up fetch): nothing to answer
                log.info("file server: %s left before its chunk was sent: %s", sender, exc)


def list_tree(root: Path, checksum_kind: str) -> list[FileEntry]:
    """Every regular file under `root` (hidden ones skipped) with its size and checksum."""
    root = Path(root)
    entries = []
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root)
        if any(p.startswith(".") for p in rel.parts) or not path.is_file():
            continue
        hasher = new_hasher(checksum_kind)
        with open(path, "rb") as f:
            while chunk := f.read(CHUNK_BYTES):
                hasher.update(chunk)
        entries.append(
            FileEntry(name=rel.as_posix(), size_bytes=path.stat().st_size, checksum=hasher.hexdigest())
        )
    return entries


class FileClient:
    """One DEALER to a `FileServer`, owned by one task; fetches one file at a time."""

    def __init__(self, zctx: zmq.Context, address: str, *, name: str) -> None:
        self.address = address
        self.ep = Endpoint(zctx, zmq.DEALER, name=name, accept=(FileChunk,))
        self.ep.connect(address)

    def close(self) -> None:
        self.ep.close()

    async def fetch(
        self,
        root: str,
        name: str,
        dest: Path,
        *,
        size_bytes: int | None = None,
        checksum: str = "",
        checksum_kind: str = "xxh3",
        timeout_s: float = REPLY_TIMEOUT_S,
    ) -> int:
        """Fetch `root`/`name` into `dest` (atomically); its size in bytes. Raises
        FileNotFoundError (the server has no such file), WeightsCorruptError (wrong size or
        checksum) or UpdateFailed (the server did not answer within `timeout_s`)."""
        from asyncrl.transport.manifest import WeightsCorruptError

        where = f"{root}/{name} from {self.address}"
        tmp = dest.with_name(f"{TMP_PREFIX}{dest.name}-{secrets.token_hex(4)}")
        hasher = new_hasher(checksum_kind) if checksum else None
        total, asked, received, outstanding = size_bytes, 0, 0, 0
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            while True:
                while outstanding < WINDOW and (asked == 0 or (total is not None and asked < total)):
                    await self.ep.send(FileRequest(root=root, name=name, offset=asked, max_bytes=CHUNK_BYTES))
                    asked += CHUNK_BYTES
                    outstanding += 1
                if outstanding == 0:
                    break
                try:
                    _, msg, _ = await asyncio.wait_for(self.ep.recv(), timeout_s)
                except TimeoutError:
                    raise UpdateFailed(f"{where}: no answer for {timeout_s:g} s") from None
                outstanding -= 1
                if msg.error:
                    if msg.error == "no such file":
                        raise FileNotFoundError(f"{where}: no such file")
                    raise ValueError(f"{where}: {msg.error}")
                if msg.root != root or msg.name != name or msg.offset != received:
                    raise WeightsCorruptError(
                        f"{where}: chunk at {msg.offset} of {msg.name!r} came, expected {received}"
                    )
                if total is None:
                    total = msg.total_bytes
                elif msg.total_bytes != total:
                    raise WeightsCorruptError(f"{where}: has {msg.total_bytes} bytes, expected {total}")
                if not msg.data and received < total:
                    raise WeightsCorruptError(f"{where}: ends early at {received} of {total} bytes")
                os.write(fd, msg.data)
                if hasher is not None:
                    hasher.update(msg.data)
                received += len(msg.data)
        finally:
            os.close(fd)
            if received != total or outstanding:
                tmp.unlink(missing_ok=True)
        if hasher is not None and hasher.hexdigest() != checksum:
            tmp.unlink(missing_ok=True)
            raise WeightsCorruptError(f"{where}: fails its {checksum_kind} check")
        os.replace(tmp, dest)
        return received


async def fetch_tree(
    zctx: zmq.Context, address: str, root: str, entries: Iterable[FileEntry], dest: Path, checksum_kind: str
) -> int:
    """Fetch the files `entries` of `root` into the directory `dest`; bytes fetched."""
    client = FileClient(zctx, address, name=f"files.{root}")
    total = 0
    try:
        for e in entries:
            path = dest.joinpath(*e.name.split("/"))
            if ".." in e.name.split("/") or e.name.startswith("/"):
                raise ValueError(f"file name {e.name!r} is not a plain relative path")
            path.parent.mkdir(parents=True, exist_ok=True)
            total += await client.fetch(
                root, e.name, path, size_bytes=e.size_bytes, checksum=e.checksum, checksum_kind=checksum_kind
            )
    finally:
        client.close()
    return total


class NetworkWeights:
    """A generator's local copy of the versions it loads, fetched from the launcher's FileServer.

    `fetch` is blocking (the receiver calls it in its fetch thread) and runs its own event loop
    and socket there, so a fetch given up at its deadline never shares a socket with the next.
    Only the newest fetched version stays in the cache (the receiver holds a version's tensors in
    memory once read, and keeps a delta's base there, not on disk)."""

    def __init__(self, zctx: zmq.Context, address: str, cache_dir: Path) -> None:
        self.zctx = zctx
        self.address = address
        self.cache_dir = Path(cache_dir)
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        self.bytes_fetched = 0

    def fetch(self, version: int, use_delta: Callable[[ShardManifest], bool]) -> Path:
        """Fetch `version` (its manifest, then its delta files if `use_delta(manifest)`, else its
        shards, and its extra files) into the cache; the cache root, to read it from."""
        return asyncio.run(self._fetch(version, use_delta))

    async def _fetch(self, version: int, use_delta: Callable[[ShardManifest], bool]) -> Path:
        from asyncrl.transport.manifest import MANIFEST_NAME, ShardManifest, WeightsCorruptError

        vname = version_dir(Path("."), version).name
        work = self.cache_dir / f"{TMP_PREFIX}{vname}-{secrets.token_hex(4)}"
        work.mkdir()
        client = FileClient(self.zctx, self.address, name=f"files.{vname}")
        try:
            await client.fetch("weights", f"{vname}/{MANIFEST_NAME}", work / MANIFEST_NAME)
            try:
                manifest = ShardManifest.from_json((work / MANIFEST_NAME).read_bytes())
            except ValueError as exc:
                raise WeightsCorruptError(
                    f"weights version {version}: fetched manifest is malformed: {exc}"
                ) from exc
            if manifest.delta is not None and use_delta(manifest):
                records = [(d.name, d.size_bytes, d.checksum) for d in manifest.delta.files]
            else:
                records = [(f.name, f.size_bytes, f.checksum) for f in manifest.files]
            records += [(f.name, f.size_bytes, f.checksum) for f in manifest.extra_files]
            for name, size, checksum in records:
                self.bytes_fetched += await client.fetch(
                    "weights",
                    f"{vname}/{name}",
                    work / name,
                    size_bytes=size,
                    checksum=checksum,
                    checksum_kind=manifest.checksum_kind,
                )
        except BaseException:
            shutil.rmtree(work, ignore_errors=True)
            raise
        finally:
            client.close()
        final = version_dir(self.cache_dir, version)
        shutil.rmtree(final, ignore_errors=True)  # an earlier, failed attempt
        work.rename(final)
        for old in list_versions(self.cache_dir):
            if old < version:
                shutil.rmtree(version_dir(self.cache_dir, old), ignore_errors=True)
        return self.cache_dir
