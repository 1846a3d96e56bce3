"""Several distillation teachers, each scoring its own domains (config `opd.teachers`), and the
teacher a generator is given (one, several, either behind the score cache).

Place in the data flow: the torch generator builds its teacher with `build_teacher` at setup.
With `opd.teachers` each entry becomes a teacher (`make_one(path, name)`: a directory in this
process, the entry's shared service, or the policy itself), and a `RoutedTeacher` sends every
sample to the teacher of its prompt's domain: the value of the field `opd.route_field` in
`PromptTask.extras` (a dataset task's `task.dataset.extra_fields`, a plugin's Problem.extras). A
domain no entry names goes to the entry without domains, if there is one; otherwise it is an
error naming the domain, the field and the teachers. Each sample's scores, teacher version and
teacher id come back in the sample's order (`score_routed`), and the id goes on its trajectory
(`Trajectory.teacher_id`). With `opd.cache` every teacher is wrapped in a `CachingTeacher` of
its own identity (`teacher_cache.py`).

`GapTally` keeps, per teacher and per domain, the sampled-token estimate of the gap the
distillation closes: mean over scored tokens of log mu(y_t) - log pi_T(y_t), whose expectation
under the behaviour student mu is KL(mu || pi_T) per token. The generator reports it with its
metrics (`opd/kl/teacher/<name>`, `opd/kl/domain/<domain>`, the mean since the last report, and
the tokens behind it), so the records show which domain is furthest from its teacher.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from asyncrl.messages import PromptTask

if TYPE_CHECKING:  # the launcher's side imports this module; torch is the generator's
    import torch

# The domain of a prompt that has no `opd.route_field` in its extras.
NO_DOMAIN = ""


class RoutingError(ValueError):
    pass


@dataclasses.dataclass(frozen=True)
class Router:
    """Domain -> teacher name, from `opd.teachers` (config-checked: each domain one teacher, at
    most one fallback without domains)."""

    field: str
    owners: dict[str, str]
    fallback: str | None
    names: tuple[str, ...]

    @classmethod
    def from_config(cls, opd: Any) -> Router:
        owners = {d: t.name for t in opd.teachers for d in t.domains}
        fallback = next((t.name for t in opd.teachers if not t.domains), None)
        return cls(opd.route_field, owners, fallback, tuple(t.name for t in opd.teachers))

    def domain(self, task: PromptTask) -> str:
        value = task.extras.get(self.field)
        return NO_DOMAIN if value is None else str(value)

    def teacher_for(self, task: PromptTask) -> str:
        domain = self.domain(task)
        name = self.owners.get(domain, self.fallback)
        if name is None:
            what = f"domain {domain!r}" if domain != NO_DOMAIN else f"no field {self.field!r} in its extras"
            raise RoutingError(
                f"opd.teachers: the prompt of group {task.group_id} has {what}, and no teacher scores it "
                f"(teachers {', '.join(self.names)} name domains {sorted(self.owners)}); add the domain "
                f"to a teacher's domains, or a teacher without domains (opd.route_field = {self.field!r})"
            )
        return name


class RoutedTeacher:
    """`teachers.Teacher` over several teachers: each sample scored by its domain's teacher, one
    call per teacher per batch, answers back in the samples' order."""

    def __init__(self, teachers: dict[str, Any], router: Router) -> None:
        self.teachers = teachers
        self.router = router

    @property
    def version(self) -> int:
        """The self-teacher's version (-1 when no teacher is the policy)."""
        return max((getattr(t, "version", -1) for t in self.teachers.values()), default=-1)

    def on_weights(self, version: int, state: Any) -> None:
        for teacher in self.teachers.values():
            if (follow := getattr(teacher, "on_weights", None)) is not None:
                follow(version, state)

    def score_routed(
        self, tasks: Sequence[PromptTask], ids_TN: Sequence[torch.Tensor]
    ) -> tuple[list[Any], list[int | None], list[str]]:
        """(each sample's scores, its teacher's version, its teacher's name), in order."""
        names = [self.router.teacher_for(t) for t in tasks]
        scores: list[Any] = [None] * len(tasks)
        versions: list[int | None] = [None] * len(tasks)
        for name in dict.fromkeys(names):  # first-seen order: deterministic calls
            rows = [i for i, n in enumerate(names) if n == name]
            got, version = self.teachers[name].score([tasks[i] for i in rows], [ids_TN[i] for i in rows])
            for i, score in zip(rows, got, strict=True):
                scores[i], versions[i] = score, version
        return scores, versions, names

    def score(
        self, tasks: Sequence[PromptTask], ids_TN: Sequence[torch.Tensor]
    ) -> tuple[list[Any], int | None]:
        scores, versions, _ = self.score_routed(tasks, ids_TN)
        return scores, next((v for v in versions if v is not None), None)

    def counters(self) -> dict[str, float]:
        """The cache counters of every cached teacher, by teacher (`teacher_cache/<name>/...`)."""
        out: dict[str, float] = {}
        for name, teacher in self.teachers.items():
            if (c := getattr(teacher, "counters", None)) is not None:
                out |= c.values(f"teacher_cache/{name}/")
        return out


def score_routed(teacher: Any, tasks: Sequence[PromptTask], ids_TN: Sequence[torch.Tensor]):
    """(scores, versions, teacher ids) per sample from any teacher: a `RoutedTeacher`'s own, or
    one teacher's answer with its version for every sample and the id "" (the single teacher)."""
    if isinstance(teacher, RoutedTeacher):
        return teacher.score_routed(tasks, ids_TN)
    scores, version = teacher.score(tasks, ids_TN)
    return scores, [version] * len(scores), [""] * len(scores)


# ---------------------------------------------------------------------------- shared teacher processes
# With opd.teachers, the generator's command line carries every shared teacher's address as
# "name=address" items joined by this (addresses are tcp://host:port, never containing it).
# ---------------------------------------------------------------------------- building
def teacher_identity(path: str, *, opd: Any, dtype: str, policy_path: str):
    """The cache identity of a teacher at `path` ("" = the shipped one, "self" = the initial policy)."""
    from asyncrl.generators.opd import TEACHER_TEMPERATURE
    from asyncrl.generators.teacher_cache import TeacherIdentity, directory_fingerprint, scoring_settings
    from asyncrl.models.default import TEACHER_MODEL_DIR

    settings = scoring_settings(opd, dtype=dtype, temperature=TEACHER_TEMPERATURE)
    if path == "self":
        return TeacherIdentity("self-initial", directory_fingerprint(Path(policy_path)), settings)
    return TeacherIdentity(
        "model", directory_fingerprint(Path(path) if path else TEACHER_MODEL_DIR), settings
    )


def cache_root(opd: Any, run_dir: str) -> Path:
    if opd.cache_dir:
        return Path(opd.cache_dir)
    if not run_dir:
        raise ValueError("opd.cache: no run directory to keep the cache in; set opd.cache_dir")
    return Path(run_dir) / "teacher_cache"


# The run's tally of cache counters: one JSON file per generator process and teacher, rewritten
# after every teacher call, summed into summary.json's `teacher_cache` (`read_cache_counts`).
COUNTS_DIR = "teacher_cache_counts"


def counts_writer(run_dir: str, owner: str) -> Callable[[Any], None] | None:
    """Writes a `CacheCounters` to <run>/teacher_cache_counts/<owner>-<pid>.json (None outside a run)."""
    if not run_dir:
        return None
    path = Path(run_dir) / COUNTS_DIR / f"{owner}-{os.getpid()}.json"
    path.parent.mkdir(parents=True, exist_ok=True)

    def write(counters: Any) -> None:
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(dataclasses.asdict(counters)))
        os.replace(tmp, path)

    return write


def read_cache_counts(run_dir: Path) -> dict[str, int]:
    """The cache counters of every generator process of the run (a resumed run's earlier ones
    included), summed; {} when the run had no cache."""
    out: dict[str, int] = {}
    for path in sorted((Path(run_dir) / COUNTS_DIR).glob("*.json")):
        for key, value in json.loads(path.read_text()).items():
            out[key] = out.get(key, 0) + int(value)
    return out


def with_cache(
    teacher: Any, path: str, *, opd: Any, dtype: str, policy_path: str, run_dir: str, owner: str = "gen"
) -> Any:
    """`teacher` behind the score cache when `opd.cache` (module docstring), else itself; its
    counters go to the run's tally as `owner`."""
    if not opd.cache:
        return teacher
    from asyncrl.generators.teacher_cache import CachingTeacher, ScoreStore

    identity = teacher_identity(path, opd=opd, dtype=dtype, policy_path=policy_path)
    store = ScoreStore(cache_root(opd, run_dir), identity)
    context = (lambda t: t.privileged_ids) if path == "self" else (lambda t: t.prompt_ids)
    return CachingTeacher(teacher, store, context=context, on_counts=counts_writer(run_dir, owner))


def build_teacher(ctx: Any, make_one: Callable[[str, str], Any]) -> Any:
    """The generator's teacher (`GeneratorContext` ctx): `make_one(path, name)` for `opd.teacher`
    or for each of `opd.teachers` (then routed), each behind the cache with `opd.cache`."""
    opd = ctx.opd

    def one(path: str, name: str) -> Any:
        return with_cache(
            make_one(path, name),
            path,
            opd=opd,
            dtype=ctx.dtype,
            policy_path=ctx.model_path,
            run_dir=ctx.run_dir,
            owner="-".join(filter(None, (ctx.generator_id, name))),
        )

    if not opd.teachers:
        return one(opd.teacher, "")
    return RoutedTeacher({t.name: one(t.path, t.name) for t in opd.teachers}, Router.from_config(opd))


def cache_counters(teacher: Any) -> dict[str, float]:
    """`teacher_cache/...` counters of a generator's teacher (empty without the cache)."""
    if isinstance(teacher, RoutedTeacher):
        return teacher.counters()
    if (c := getattr(teacher, "counters", None)) is not None:
        return c.values()
    return {}


# ---------------------------------------------------------------------------- the gap
@dataclasses.dataclass
class GapTally:
    """Per teacher and per domain: the sum of log mu - log pi_T at the sampled tokens and their
    count, since the last `take` (module docstring)."""

    sums: dict[str, float] = dataclasses.field(default_factory=dict)
    tokens: dict[str, int] = dataclasses.field(default_factory=dict)

    def add(self, keys: Sequence[str], behavior_T: torch.Tensor, teacher_T: torch.Tensor) -> None:
        gap = float((behavior_T.double() - teacher_T.double()).sum())
        for key in keys:
            self.sums[key] = self.sums.get(key, 0.0) + gap
            self.tokens[key] = self.tokens.get(key, 0) + int(behavior_T.numel())

    def take(self) -> dict[str, float]:
        """`opd/kl/<key>` (mean per token) and `opd/kl_tokens/<key>` since the last take."""
        out = {}
        for key, total in self.sums.items():
            n = self.tokens[key]
            out[f"opd/kl/{key}"] = total / n if n else 0.0
            out[f"opd/kl_tokens/{key}"] = float(n)
        self.sums.clear()
        self.tokens.clear()
        return out


def gap_keys(router: Router | None, task: PromptTask, teacher_id: str) -> list[str]:
    """The tallies a sample counts in: its teacher's (several teachers) and its domain's (when
    teachers are routed, or when the prompt has the field `opd.route_field` with one teacher)."""
    if router is None:
        return []
    keys = [f"teacher/{teacher_id}"] if teacher_id else []
    domain = router.domain(task)
    if domain != NO_DOMAIN or router.names:
        keys.append(f"domain/{domain or '-'}")
    return keys
