"""The offline teacher-score cache (config `opd.cache`): a teacher's scores of a token sequence,
computed once, kept on disk and reused by every later request for the same sequence.

Place in the data flow: a generator's teacher (`teachers.py`, the shared service's client, or
one of several routed teachers, `teacher_routing.py`) is wrapped in a `CachingTeacher`. Before
a batch goes to the teacher, each sample's key is looked up in the `ScoreStore`
(<run>/teacher_cache/ unless `opd.cache_dir` names another directory); only the misses are
scored, and their scores are stored. Later epochs over the same prompts, a resumed run, a
repeated run pointed at the same directory, and `asyncrl opd prescore` (which scores a task's
reference completions before training) all read the same store.

The key (`record_key`) is a SHA-256 over
* the teacher's identity (`TeacherIdentity`): a content hash of its model files (config.json
  and the weight files; for `opd.teacher = "self"` with `self_weights = "initial"`, the run's
  initial model) and its kind;
* the scoring settings: the teacher temperature, the dtype it is loaded in, and every `opd` key
  except those that only the learner reads (`LEARNER_ONLY_KEYS`), so a key added later for the
  scoring (top-K, ...) is part of the key by default;
* the exact context the teacher reads (the prompt, or the privileged prompt of
  self-distillation) and the [T, N] ids it scores, as int64 bytes with their shape.

A score is one record: whatever the wrapped teacher returns for a sample (a float32 [T, N]
tensor today; a mapping or a dataclass of tensors, e.g. with top-K fields) is stored field by
field in one safetensors file, and a hit gives back the same type with bitwise the same tensors.
A self-teacher that follows the policy (`self_weights` current / lagged / ewma) changes with the
weights, and its version-v weights differ between runs (and between a generator and its restart,
for ewma): caching it is refused at load (`config_sections.OpdConfig`), not keyed on the version.

Files are content-addressed and written atomically (a temporary file, then `os.replace`), so
generators sharing a directory never see half a record, and two writes of one key write the same
scores or equally valid ones (a record is the first forward's, equal to a fresh one's to float
rounding: padding with other sequences changes the last bits).
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import json
import logging
import os
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from asyncrl.messages import PromptTask

log = logging.getLogger(__name__)

# Bump when the key or the record layout changes: old records are then never read.
CACHE_FORMAT = 1
# The files of a model directory that decide its scores (the tokenizer does not: ids are scored).
MODEL_FILE_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")
# `opd` keys that change what the learner does with the scores, never the scores themselves.
LEARNER_ONLY_KEYS = frozenset(
    {
        "estimator",
        "clip_eps",
        "reward",
        "reward_weight",
        "kl_weight",
        "pass_reward",
        "select",
        "select_fraction",
        "placement",
        "service_window_ms",
        "service_timeout_s",
        "cache",
        "cache_dir",
        "teachers",
        "route_field",
        "teacher",  # the teacher's identity is its files' content hash, not its path
        "position_decay",
        "teachability",
        "horizon_gap",
    }
)
READ_CHUNK = 1 << 20


def directory_fingerprint(path: Path) -> str:
    """SHA-256 over a model directory's config.json and weight files (names, sizes, contents)."""
    files = sorted(
        p
        for p in path.rglob("*")
        if p.is_file() and (p.name == "config.json" or p.suffix in MODEL_FILE_SUFFIXES)
    )
    if not files:
        raise ValueError(f"opd.cache: no model files under {path} to identify the teacher by")
    digest = hashlib.sha256()
    for p in files:
        digest.update(f"{p.relative_to(path).as_posix()}\0{p.stat().st_size}\0".encode())
        with p.open("rb") as f:
            while chunk := f.read(READ_CHUNK):
                digest.update(chunk)
    return digest.hexdigest()


@dataclasses.dataclass(frozen=True)
class TeacherIdentity:
    """What decides a teacher's scores besides the tokens: its kind ("model" or "self-initial"),
    its files' fingerprint and the scoring settings (module docstring)."""

    kind: str
    fingerprint: str
    settings: Mapping[str, Any]

    def digest(self) -> bytes:
        text = json.dumps(
            {
                "format": CACHE_FORMAT,
                "kind": self.kind,
                "fingerprint": self.fingerprint,
                "settings": self.settings,
            },
            sort_keys=True,
            default=str,
        )
        return hashlib.sha256(text.encode()).digest()

    def describe(self) -> dict[str, Any]:
        return {"format": CACHE_FORMAT, **dataclasses.asdict(self)}


def scoring_settings(opd: Any, *, dtype: str, temperature: float) -> dict[str, Any]:
    """The settings in a key: the teacher temperature, its dtype, and every `opd` key the learner
    alone does not read (`LEARNER_ONLY_KEYS`), as JSON builtins."""
    import msgspec

    section = {k: v for k, v in msgspec.to_builtins(opd).items() if k not in LEARNER_ONLY_KEYS}
    return {"temperature": temperature, "dtype": dtype, "opd": section}


def record_key(identity: bytes, context_ids: Sequence[int], ids_TN: torch.Tensor) -> str:
    """The hex key of one sample: SHA-256 of the identity digest, the context ids and the [T, N]
    ids the teacher scores (int64 bytes, with their shapes)."""
    context = torch.tensor(list(context_ids), dtype=torch.int64)
    ids = ids_TN.to(torch.int64).contiguous()
    digest = hashlib.sha256(identity)
    digest.update(f"{context.numel()}|{ids.shape[0]}x{ids.shape[1]}|".encode())
    digest.update(context.numpy().tobytes())
    digest.update(ids.numpy().tobytes())
    return digest.hexdigest()


# ---------------------------------------------------------------------------- records
def to_record(score: Any) -> tuple[dict[str, torch.Tensor], str]:
    """(named tensors, kind) of one sample's score: a tensor, a mapping of tensors, or a
    NamedTuple or dataclass whose fields are tensors or None (kind: "tensor", "mapping", or
    "module:QualName"; None fields are left out and come back as their defaults)."""
    if isinstance(score, torch.Tensor):
        return {"score": score}, "tensor"
    if isinstance(score, Mapping):
        return dict(score), "mapping"
    if isinstance(score, tuple) and hasattr(score, "_fields"):
        fields = dict(zip(score._fields, score, strict=True))
    elif dataclasses.is_dataclass(score) and not isinstance(score, type):
        fields = {f.name: getattr(score, f.name) for f in dataclasses.fields(score)}
    else:
        raise TypeError(f"opd.cache cannot store a teacher score of type {type(score).__name__}")
    kind = f"{type(score).__module__}:{type(score).__qualname__}"
    return {k: v for k, v in fields.items() if v is not None}, kind


def from_record(tensors: dict[str, torch.Tensor], kind: str) -> Any:
    if kind == "tensor":
        return tensors["score"]
    if kind == "mapping":
        return tensors
    module, _, name = kind.partition(":")
    cls: Any = importlib.import_module(module)
    for part in name.split("."):
        cls = getattr(cls, part)
    return cls(**tensors)


class ScoreStore:
    """Records on disk: <root>/<identity>/<key[:2]>/<key>.safetensors, one per sample, with the
    teacher's description in <root>/<identity>/identity.json."""

    def __init__(self, root: Path, identity: TeacherIdentity) -> None:
        self.identity = identity
        self.digest = identity.digest()
        self.num_unreadable = 0  # damaged records found (each scored again and rewritten)
        self.dir = Path(root) / self.digest.hex()[:16]
        self.dir.mkdir(parents=True, exist_ok=True)
        described = self.dir / "identity.json"
        if not described.exists():
            _atomic_write(described, json.dumps(identity.describe(), indent=2, default=str).encode())

    def path(self, key: str) -> Path:
        return self.dir / key[:2] / f"{key}.safetensors"

    def get(self, key: str) -> tuple[Any, int | None] | None:
        """(the score, the teacher version it was stored with), or None for a miss."""
        from safetensors import safe_open

        path = self.path(key)
        if not path.exists():
            return None
        try:
            with safe_open(str(path), framework="pt") as f:
                meta = f.metadata() or {}
                tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 (safe_open has no iteration)
            version = meta.get("teacher_version", "")
            return from_record(tensors, meta["kind"]), (int(version) if version else None)
        except Exception as exc:  # a damaged file (disk full, truncated copy): scored again, rewritten
            self.num_unreadable += 1
            log.warning("opd.cache: record %s unreadable (%s); the teacher scores it again", path, exc)
            return None

    def put(self, key: str, score: Any, version: int | None) -> None:
        from safetensors.torch import save

        tensors, kind = to_record(score)
        meta = {"kind": kind, "teacher_version": "" if version is None else str(version)}
        data = save({k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}, metadata=meta)
        _atomic_write(self.path(key), data)


def _atomic_write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


# ---------------------------------------------------------------------------- the teacher wrapper
@dataclasses.dataclass
class CacheCounters:
    """Samples and tokens found in the cache (their teacher forward saved) or scored by the
    teacher, and the teacher calls made or saved (a call whose every sample was found)."""

    hits: int = 0
    misses: int = 0
    hit_tokens: int = 0
    miss_tokens: int = 0
    teacher_calls: int = 0
    calls_saved: int = 0

    def add(self, other: CacheCounters) -> None:
        for f in dataclasses.fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    def values(self, prefix: str = "teacher_cache/") -> dict[str, float]:
        return {f"{prefix}{k}": float(v) for k, v in dataclasses.asdict(self).items()}


def _tokens(score_ids: torch.Tensor) -> int:
    return int(score_ids.shape[0])


class CachingTeacher:
    """`teachers.Teacher` with a `ScoreStore` in front: each sample is looked up by its key;
    the misses (one each, however many samples share a key) go to `inner` in one call, in
    order, and are stored. `context(task)` is the token context the teacher reads."""

    def __init__(
        self,
        inner: Any,
        store: ScoreStore,
        *,
        context: Callable[[PromptTask], Sequence[int]],
        on_counts: Callable[[CacheCounters], None] | None = None,
    ) -> None:
        self.inner = inner
        self.store = store
        self.context = context
        self.counters = CacheCounters()
        self.on_counts = on_counts  # called with the counters after every call (the run's tally)

    @property
    def version(self) -> int:
        return getattr(self.inner, "version", -1)

    def __getattr__(self, name: str) -> Any:  # on_weights, close, ... of the wrapped teacher
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    def score(
        self, tasks: Sequence[PromptTask], ids_TN: Sequence[torch.Tensor]
    ) -> tuple[list[Any], int | None]:
        keys = [record_key(self.store.digest, self.context(t), x) for t, x in zip(tasks, ids_TN, strict=True)]
        found: dict[str, tuple[Any, int | None]] = {}
        todo: dict[str, int] = {}  # key -> the first sample with it, for keys not in the store
        for i, key in enumerate(keys):
            if key in found or key in todo:
                continue
            cached = self.store.get(key)
            if cached is None:
                todo[key] = i
            else:
                found[key] = cached
        version = None
        if todo:
            first = list(todo.values())
            scores, version = self.inner.score([tasks[i] for i in first], [ids_TN[i] for i in first])
            for key, score in zip(todo, scores, strict=True):
                self.store.put(key, score, version)
                found[key] = (score, version)
            self.counters.teacher_calls += 1
        else:
            self.counters.calls_saved += 1
        scored = set(todo)
        for key, x in zip(keys, ids_TN, strict=True):
            if key in scored:
                self.counters.misses += 1
                self.counters.miss_tokens += _tokens(x)
                scored.discard(key)  # a repeat of it in this batch is a hit
            else:
                self.counters.hits += 1
                self.counters.hit_tokens += _tokens(x)
        if version is None:
            version = next((v for _, v in found.values() if v is not None), None)
        if self.on_counts is not None:
            self.on_counts(self.counters)
        return [found[k][0] for k in keys], version
