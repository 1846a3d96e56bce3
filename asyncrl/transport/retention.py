"""Version directories of the shards path: naming, listing, and which ones may be deleted.

Place in the data flow: the process that publishes shards (learner rank 0, or the scheduler on its
behalf) records every `WeightsPublished` with `publish(v)` and every generator's `WeightsLoaded` with
`ack(generator_id, v)`; after each publish it calls `prune(root, retention)`. A version is deleted
only when it is outside the last `keep_last` versions (which the snapshot-based old-logit strategy
and late loaders need) AND older than the version every registered generator has acked, so a version
some generator still samples with (or is about to load) is never deleted.

`VersionRetention` is pure bookkeeping. The rest names and lists version directories
(`root/v{version:08d}`; hidden `.tmp-*` directories are work in progress) and deletes them; what
goes inside one version directory is the business of `shards.py` (writing) and `shard_read.py`
(reading). `prune(..., keep_spare=True)` keeps one deleted version as a hidden spare whose files the
next `write_shards` rewrites in place.
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import shutil
from pathlib import Path

logger = logging.getLogger(__name__)

TMP_PREFIX = ".tmp-"  # directories being written or deleted; never listed as versions
_SPARE = "spare"  # temporary_dir purpose of a pruned version kept for its files (`spare_dirs`)
_VERSION_DIR_RE = re.compile(r"^v(\d{8,})$")


def version_dir(root: Path, version: int) -> Path:
    """Where `version` is (or would be) published under `root`."""
    if version < 0:
        raise ValueError(f"version must be >= 0, got {version}")
    return Path(root) / f"v{version:08d}"


def list_versions(root: Path) -> list[int]:
    """Published versions under `root`, ascending (temporary directories are skipped)."""
    root = Path(root)
    if not root.is_dir():
        return []
    versions = []
    for entry in os.scandir(root):
        match = _VERSION_DIR_RE.match(entry.name)
        if match and entry.is_dir():
            versions.append(int(match.group(1)))
    return sorted(versions)


def latest_version(root: Path) -> int | None:
    """The newest published version under `root`, or None when there is none."""
    versions = list_versions(root)
    return versions[-1] if versions else None


def temporary_dir(root: Path, purpose: str) -> Path:
    """A fresh hidden directory name under `root` that `list_versions` ignores."""
    return Path(root) / f"{TMP_PREFIX}{purpose}-{os.getpid()}-{secrets.token_hex(4)}"


def spare_dirs(root: Path) -> list[Path]:
    """Pruned versions kept by `prune(..., keep_spare=True)` for `write_shards` to reuse."""
    root = Path(root)
    if not root.is_dir():
        return []
    prefix = f"{TMP_PREFIX}{_SPARE}-"
    return sorted(Path(e.path) for e in os.scandir(root) if e.name.startswith(prefix) and e.is_dir())


def claim_spare(root: Path, tmp_dir: Path, file_names: list[str]) -> set[str]:
    """Make `tmp_dir` (a version being written) from a spare (`prune(..., keep_spare=True)`) if
    there is one, else empty; returns the names of `file_names` that already exist in it, for the
    writer to overwrite.

    The spare's `*.safetensors` files are renamed, in order, to `file_names` (shards are planned the
    same way every version, so sizes match closely); its other files, surplus shards and any file
    with a hard link elsewhere (that copy must not change) are deleted.
    """
    for spare in spare_dirs(root):
        try:
            os.rename(spare, tmp_dir)  # atomic: one claim wins
        except FileNotFoundError:
            continue
        break
    else:
        tmp_dir.mkdir()
        return set()
    old = []
    for entry in sorted(os.scandir(tmp_dir), key=lambda e: e.name):
        if (
            entry.name.endswith(".safetensors")
            and entry.is_file(follow_symlinks=False)
            and entry.stat(follow_symlinks=False).st_nlink == 1  # a hard link elsewhere must not change
        ):
            old.append(entry.name)
        elif entry.is_dir(follow_symlinks=False):
            shutil.rmtree(entry.path)
        else:
            os.unlink(entry.path)
    if old != file_names[: len(old)]:  # two passes, so no new name lands on an old file not yet moved
        for i, name in enumerate(old):
            os.rename(tmp_dir / name, tmp_dir / f"{TMP_PREFIX}recycle-{i}")
        old = [f"{TMP_PREFIX}recycle-{i}" for i in range(len(old))]
        for name, new_name in zip(old, file_names, strict=False):
            os.rename(tmp_dir / name, tmp_dir / new_name)
    for name in old[len(file_names) :]:
        os.unlink(tmp_dir / name)
    return set(file_names[: len(old)])


class VersionRetention:
    """Published versions and per-generator acked versions; decides what is deletable."""

    def __init__(self, keep_last: int) -> None:
        if keep_last < 1:
            raise ValueError(f"keep_last must be >= 1 (the newest version is always kept), got {keep_last}")
        self.keep_last = keep_last
        self._published: list[int] = []  # ascending, still on disk
        self._acked: dict[str, int] = {}  # generator_id -> version it samples with (or will load)

    @property
    def published(self) -> list[int]:
        """Versions published and not yet deleted, ascending."""
        return list(self._published)

    @property
    def acked(self) -> dict[str, int]:
        """generator_id -> its pinned version."""
        return dict(self._acked)

    def publish(self, version: int) -> None:
        """Record a newly published version; versions must increase."""
        if version < 0:
            raise ValueError(f"version must be >= 0, got {version}")
        if self._published and version <= self._published[-1]:
            raise ValueError(
                f"published version {version} is not newer than the latest, {self._published[-1]}"
            )
        self._published.append(version)

    def register(self, generator_id: str) -> None:
        """Pin the latest published version for a generator that has not acked yet.

        A generator that joins loads the latest version, so from registration on that version (and
        anything newer) must stay until the generator acks. Registering an already known generator
        changes nothing.
        """
        if generator_id not in self._acked:
            self._acked[generator_id] = self._published[-1] if self._published else 0

    def ack(self, generator_id: str, version: int) -> None:
        """A generator now samples with `version` (its `WeightsLoaded`); older versions are free for it.

        The last ack wins, also when it goes backwards (a restarted generator that loaded an older
        version really does use that one).
        """
        latest = self._published[-1] if self._published else None
        if latest is None or version > latest:
            raise ValueError(
                f"generator {generator_id!r} acked version {version}, which was never published (latest: {latest})"
            )
        self._acked[generator_id] = version

    def forget(self, generator_id: str) -> None:
        """A generator left (or died); it no longer pins any version. Unknown ids are ignored."""
        self._acked.pop(generator_id, None)

    def in_use(self) -> set[int]:
        """Versions some generator pins."""
        return set(self._acked.values())

    def deletable(self) -> list[int]:
        """Versions older than the last `keep_last` AND older than every generator's pinned version."""
        kept_from = self._published[-self.keep_last] if len(self._published) >= self.keep_last else None
        if kept_from is None:
            return []
        floor = min([kept_from, *self._acked.values()])
        return [v for v in self._published if v < floor]

    def deleted(self, version: int) -> None:
        """Record that `version`'s directory is gone (called by `prune`)."""
        if version in self.in_use():
            raise ValueError(f"version {version} is still in use and cannot have been deleted")
        if version not in self._published:
            raise ValueError(f"version {version} is not a published version on disk")
        self._published.remove(version)


def prune(root: Path, retention: VersionRetention, *, keep_spare: bool = False) -> list[int]:
    """Delete the directories of `retention.deletable()` versions under `root`; returns them.

    Each directory is first renamed to a hidden temporary name (atomic, so `list_versions` never
    lists a half-deleted version) and then removed. A version whose directory is already gone is
    recorded as deleted too.

    With `keep_spare`, while `root` holds no spare, the first directory pruned is kept as one
    (renamed, hidden, not removed): `write_shards` overwrites its files for the next version
    instead of creating new ones. On tmpfs writing a new file costs several times the CPU of
    overwriting one (bench/README.md, "Weight sync") (a new file's pages are allocated, zeroed and charged one by one), and the
    pruned version's pages are never freed only to be allocated again. The price is one version's
    worth of space while no version is being written. Retention guarantees that no generator still
    needs a pruned version, so nothing may keep its files open: a reader that did would see them
    change (a sha256 mismatch) instead of keeping the old bytes.
    """
    removed = []
    for version in retention.deletable():
        path = version_dir(root, version)
        if path.is_dir():
            if keep_spare and not spare_dirs(root):
                os.rename(path, temporary_dir(root, _SPARE))
            else:
                doomed = temporary_dir(root, f"delete-v{version:08d}")
                os.rename(path, doomed)
                shutil.rmtree(doomed)
        else:
            logger.warning("weights version %d was already deleted from %s", version, root)
        retention.deleted(version)
        removed.append(version)
    if removed:
        logger.info("pruned weights versions %s from %s", removed, root)
    return removed
