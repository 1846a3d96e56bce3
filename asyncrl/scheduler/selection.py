"""Prompt selection (pure): which training-stream prompt each newly admitted group samples.

Place in the data flow: the dispatcher (`scheduler/dispatch.py`) admits groups by id (the admission
mode decides how many and which ids); before rendering them it asks the run's `Selection` which
index of the task's training stream each group's prompt is (`task.train_problem(index)`,
`PromptTask.dataset_index`). Group ids, windows, the staleness bound, the admission credits and the
task book are unchanged by selection: it only chooses the prompt. The launcher hands every TaskDone
to `Selection.observe`, which keeps the per-prompt record (`scheduler/prompt_stats.py`) the
adaptive strategies read; the launcher's checkpoint saves `Selection.state()` and a resume
restores it, so a resumed sync run admits exactly the prompts the uninterrupted one does.

Strategies (`sampling.selection`, chosen once; docs/tasks.md, "Prompt selection"):
  uniform     group j samples prompt j: the task's own order (the dataset task shuffles each epoch
              with its seed), every prompt once per epoch. The default; bitwise today's stream.
  skip        the uniform stream, passing over prompts estimated solved (posterior mean >=
              sampling.selection_solved) or hopeless (<= sampling.selection_hopeless); a prompt
              passed over sampling.selection_recheck times in a row is admitted at its next turn
              (a re-check), so none is excluded forever.
  priority    the prompt of the training set (the first epoch's indices 0..N-1) with the largest
              theta (1 - theta), theta drawn from each prompt's Beta posterior (Thompson sampling
              of the expected learning signal p (1 - p)); prompts already in flight are passed over.
  curriculum  easiest first: the unsolved prompt (mean < selection_solved) with the highest
              posterior mean, fewest groups, lowest index; solved prompts come after every unsolved
              one; prompts in flight are passed over. Deterministic, no random draws.
  replay      the uniform stream, except that a fraction (sampling.selection_replay_fraction) of
              the groups re-admit the sampled prompt, not in flight, whose posterior standard
              deviation is largest and at least sampling.selection_replay_std (its estimate is
              still uncertain); with none that uncertain, the stream's next prompt.
  domain_gap  (distillation, several domains) each group's domain is drawn with probability
              `domain_weights`: floor / D + (1 - floor) x gap_d / sum of gaps, gap_d the domain's
              latest measured distillation gap (the generators' `opd/kl/domain/<d>`, clipped at 0;
              floor = sampling.selection_domain_floor), uniform over the D domains until every
              domain has a measurement (or while every gap is 0); then the domain's next prompt in
              stream order. The domains are the values of opd.route_field over the training set.
Random draws (priority, domain_gap) come from a generator seeded by run.seed whose state is
checkpointed; domain_gap's gaps, cursors and counts are checkpointed with it. domain_gap's gaps
arrive with the generators' periodic metrics, so its choices in a launched run depend on when
they arrive (a resume restores its state; it does not replay the uninterrupted run's reports).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import msgspec
import numpy as np

from asyncrl.scheduler.budget import Budget, posterior_std
from asyncrl.scheduler.prompt_stats import PromptStats, StatsState, prompt_key
from asyncrl.tasks.base import Task

if TYPE_CHECKING:
    from asyncrl.config import Config
    from asyncrl.messages import PromptTask, TaskDone

STRATEGIES = ("uniform", "skip", "priority", "curriculum", "replay", "domain_gap")
NEEDS_TRAINING_SET = ("priority", "curriculum", "domain_gap")  # they choose among the N training prompts


@runtime_checkable
class Selector(Protocol):
    """Chooses the training-stream index of each admitted group's prompt."""

    def select(self, groups: Sequence[int]) -> list[int]:
        """The stream index (`task.train_problem`'s argument) of each group in `groups`, in order.
        Called once per admission, with the groups in admission order."""


class UniformSelector:
    """Group j samples stream index j: the task's order, each prompt once per epoch."""

    def select(self, groups: Sequence[int]) -> list[int]:
        return list(groups)

    def state(self) -> dict:
        return {}

    def restore(self, state: dict) -> None:
        pass


class SkipSelector:
    """The uniform stream without prompts estimated solved or hopeless, each re-checked after
    `recheck` consecutive passes."""

    def __init__(
        self,
        stats: PromptStats,
        key_of: Callable[[int], str],
        *,
        solved: float,
        hopeless: float,
        recheck: int,
    ) -> None:
        self.stats, self.key_of = stats, key_of
        self.solved, self.hopeless, self.recheck = solved, hopeless, recheck
        self.cursor = 0  # the next stream index to consider
        self.passed: dict[str, int] = {}  # prompt key -> times passed over in a row

    def excluded(self, key: str) -> bool:
        if key not in self.stats.records:
            return False
        mean = self.stats.mean(key)
        return mean >= self.solved or mean <= self.hopeless

    def next_index(self) -> int:
        while True:
            index, self.cursor = self.cursor, self.cursor + 1
            key = self.key_of(index)
            if self.excluded(key) and self.passed.get(key, 0) < self.recheck:
                self.passed[key] = self.passed.get(key, 0) + 1
                continue
            self.passed.pop(key, None)
            return index

    def select(self, groups: Sequence[int]) -> list[int]:
        return [self.next_index() for _ in groups]

    def state(self) -> dict:
        return {"cursor": self.cursor, "passed": dict(sorted(self.passed.items()))}

    def restore(self, state: dict) -> None:
        self.cursor = int(state["cursor"])
        self.passed = {str(k): int(v) for k, v in state["passed"].items()}


class TrainingSetSelector(ABC):
    """A strategy choosing among the N training prompts (stream indices 0..N-1, the first epoch's
    order), passing over those in flight; each strategy says which one is next (`pick`)."""

    def __init__(self, stats: PromptStats, keys: Sequence[str]) -> None:
        self.stats = stats
        self.keys = list(keys)

    def counts(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(alpha, beta, groups) of every training prompt, in index order."""
        a = np.empty(len(self.keys))
        b = np.empty(len(self.keys))
        n = np.zeros(len(self.keys))
        for i, key in enumerate(self.keys):
            a[i], b[i] = self.stats.posterior(key)
            rec = self.stats.records.get(key)
            n[i] = rec.groups if rec is not None else 0
        return a, b, n

    def busy(self) -> np.ndarray:
        """Whether each training prompt is in flight now."""
        open_keys = self.stats.open_keys()
        return np.array([k in open_keys for k in self.keys], dtype=bool)

    def select(self, groups: Sequence[int]) -> list[int]:
        a, b, n = self.counts()
        busy = self.busy()
        chosen = []
        for _ in groups:
            if busy.all():  # more groups in flight than prompts: repeats are unavoidable
                busy[:] = False
            index = self.pick(a, b, n, busy)
            busy[index] = True
            chosen.append(index)
        return chosen

    @abstractmethod
    def pick(self, a: np.ndarray, b: np.ndarray, n: np.ndarray, busy: np.ndarray) -> int:
        """The next prompt's index, from every prompt's posterior (a, b), groups n and in-flight mask."""


class PrioritySelector(TrainingSetSelector):
    """Thompson sampling of p (1 - p): one draw per prompt from its Beta posterior, per group."""

    def __init__(self, stats: PromptStats, keys: Sequence[str], *, seed: int) -> None:
        super().__init__(stats, keys)
        self.rng = np.random.Generator(np.random.PCG64([seed, 37]))

    def pick(self, a: np.ndarray, b: np.ndarray, n: np.ndarray, busy: np.ndarray) -> int:
        theta = self.rng.beta(a, b)
        signal = np.where(busy, -1.0, theta * (1.0 - theta))
        return int(np.argmax(signal))

    def state(self) -> dict:
        return rng_state(self.rng)

    def restore(self, state: dict) -> None:
        restore_rng(self.rng, state)


def rng_state(rng: np.random.Generator) -> dict:
    """A PCG64 generator's state as JSON-safe values (its 128-bit integers as strings)."""
    s = rng.bit_generator.state
    inner = s["state"]
    return {
        "state": str(inner["state"]),
        "inc": str(inner["inc"]),
        "has_uint32": int(s["has_uint32"]),
        "uinteger": int(s["uinteger"]),
    }


def restore_rng(rng: np.random.Generator, state: dict) -> None:
    rng.bit_generator.state = {
        "bit_generator": "PCG64",
        "state": {"state": int(state["state"]), "inc": int(state["inc"])},
        "has_uint32": int(state["has_uint32"]),
        "uinteger": int(state["uinteger"]),
    }


class CurriculumSelector(TrainingSetSelector):
    """Easiest unsolved prompt first (posterior mean), then fewest groups, then lowest index;
    solved prompts after every unsolved one."""

    def __init__(self, stats: PromptStats, keys: Sequence[str], *, solved: float) -> None:
        super().__init__(stats, keys)
        self.solved = solved

    def pick(self, a: np.ndarray, b: np.ndarray, n: np.ndarray, busy: np.ndarray) -> int:
        mean = a / (a + b)
        # np.lexsort: the last key is the primary one; index order breaks the remaining ties.
        order = np.lexsort((np.arange(len(mean)), n, -mean, mean >= self.solved, busy))
        return int(order[0])

    def state(self) -> dict:
        return {}

    def restore(self, state: dict) -> None:
        pass


class ReplaySelector:
    """The uniform stream, with a fraction of the groups re-admitting the most uncertain prompt."""

    def __init__(
        self, stats: PromptStats, key_of: Callable[[int], str], *, fraction: float, min_std: float
    ) -> None:
        self.stats, self.key_of, self.fraction, self.min_std = stats, key_of, fraction, min_std
        self.cursor = 0  # the next stream index of the uniform part
        self.count = 0  # groups selected so far (the replay share is counted on it)

    def most_uncertain(self, taken: set[str]) -> int | None:
        """The stream index of the sampled prompt, not in flight or `taken`, with the largest
        posterior standard deviation, if it reaches `min_std` (ties: the key's order)."""
        best: tuple[float, str] | None = None
        for key in self.stats.records:
            if key in taken:
                continue
            a, b = self.stats.posterior(key)
            std = math.sqrt(a * b / ((a + b) ** 2 * (a + b + 1)))
            if std >= self.min_std and (best is None or (-std, key) < (-best[0], best[1])):
                best = (std, key)
        return None if best is None else self.stats.records[best[1]].index

    def select(self, groups: Sequence[int]) -> list[int]:
        taken = self.stats.open_keys()
        chosen = []
        for _ in groups:
            replay = math.floor((self.count + 1) * self.fraction) > math.floor(self.count * self.fraction)
            self.count += 1
            index = self.most_uncertain(taken) if replay else None
            if index is None:
                index, self.cursor = self.cursor, self.cursor + 1
            taken.add(self.key_of(index))
            chosen.append(index)
        return chosen

    def state(self) -> dict:
        return {"cursor": self.cursor, "count": self.count}

    def restore(self, state: dict) -> None:
        self.cursor, self.count = int(state["cursor"]), int(state["count"])


GAP_PREFIX = "opd/kl/domain/"  # a generator's per-domain gap (generators/teacher_routing.py GapTally)
TOKENS_PREFIX = "opd/kl_tokens/domain/"  # the tokens behind it since its last report


def domain_weights(domains: Sequence[str], gaps: Mapping[str, float], floor: float) -> np.ndarray:
    """Each domain's probability: floor / D + (1 - floor) x max(gap_d, 0) / sum of them; uniform
    (1 / D each) while a domain has no measurement or every clipped gap is 0."""
    uniform = np.full(len(domains), 1.0 / len(domains))
    if any(d not in gaps for d in domains):
        return uniform
    g = np.array([max(float(gaps[d]), 0.0) for d in domains])
    total = g.sum()
    if not total > 0:
        return uniform
    return floor * uniform + (1.0 - floor) * g / total


class DomainGapSelector:
    """Draws each group's domain by its latest measured distillation gap (`domain_weights`), then
    takes the domain's next prompt in stream order."""

    def __init__(
        self, domain_of: Callable[[int], str], domains: Sequence[str], *, floor: float, seed: int
    ) -> None:
        self.domain_of = domain_of  # a stream index's domain (the prompt's opd.route_field value)
        self.domains = list(domains)
        self.floor = floor
        self.rng = np.random.Generator(np.random.PCG64([seed, 39]))
        self.gaps: dict[str, float] = {}  # domain -> its latest measured gap
        self.cursors = dict.fromkeys(self.domains, 0)  # domain -> the next stream index to consider
        self.chosen = dict.fromkeys(self.domains, 0)  # domain -> groups admitted for it

    def observe(self, values: Mapping[str, float]) -> None:
        """A generator's metric record: every domain gap measured on at least one token replaces
        that domain's gap."""
        for name, value in values.items():
            domain = name[len(GAP_PREFIX) :] if name.startswith(GAP_PREFIX) else None
            if domain in self.cursors and values.get(TOKENS_PREFIX + domain, 0) > 0:
                self.gaps[domain] = float(value)

    def weights(self) -> np.ndarray:
        return domain_weights(self.domains, self.gaps, self.floor)

    def next_index(self, domain: str) -> int:
        """The domain's next stream index (each epoch holds every domain, so this ends within one)."""
        index = self.cursors[domain]
        while self.domain_of(index) != domain:
            index += 1
        self.cursors[domain] = index + 1
        return index

    def select(self, groups: Sequence[int]) -> list[int]:
        chosen = []
        for _ in groups:
            cumulative = np.cumsum(self.weights())
            k = int(np.searchsorted(cumulative, self.rng.random() * cumulative[-1], side="right"))
            domain = self.domains[min(k, len(self.domains) - 1)]
            self.chosen[domain] += 1
            chosen.append(self.next_index(domain))
        return chosen

    def step_fields(self) -> dict:
        """The step record's view: each domain's gap, probability now and groups admitted so far."""
        return {
            "domain_gap": {d: self.gaps[d] for d in self.domains if d in self.gaps},
            "domain_weights": dict(zip(self.domains, self.weights().tolist(), strict=True)),
            "domain_groups": dict(self.chosen),
        }

    def state(self) -> dict:
        return {
            "rng": rng_state(self.rng),
            "gaps": dict(self.gaps),
            "cursors": dict(self.cursors),
            "chosen": dict(self.chosen),
        }

    def restore(self, state: dict) -> None:
        restore_rng(self.rng, state["rng"])
        self.gaps = {str(d): float(g) for d, g in state["gaps"].items()}
        self.cursors = {d: int(state["cursors"].get(d, 0)) for d in self.domains}
        self.chosen = {d: int(state["chosen"].get(d, 0)) for d in self.domains}


class SelectionState(msgspec.Struct, kw_only=True, frozen=True):
    """The launcher checkpoint's `selection` field."""

    strategy: str
    selector: dict[str, Any]  # the strategy's own state (cursor, random generator, ...)
    indices: dict[int, int]  # group id -> stream index, for every group admitted and not trained
    stats: StatsState
    budget: str = "fixed"  # sampling.budget (scheduler/budget.py)
    sizes: dict[int, int] = {}  # "uncertainty": group id -> its size, admitted and not trained


class Selection:
    """The run's selector and per-prompt record, as the dispatcher and the launcher use them."""

    def __init__(
        self,
        strategy: str,
        selector: Any,
        stats: PromptStats,
        *,
        reward_name: str = "",
        budget: Budget | None = None,
    ) -> None:
        self.strategy = strategy
        self.budget = budget  # each group's size (sampling.budget); None: the book's samples_per_group
        self.selector = selector if selector is not None else UniformSelector()
        self.stats = stats
        self.reward_name = reward_name  # the primary reward (prompt_stats.py); "" = the task's score
        self.indices: dict[int, int] = {}  # group id -> stream index, admitted and not trained
        self.readmitted: dict[int, int] = {}  # resume: group id -> the stream index it had

    def choose(self, groups: Sequence[int]) -> list[int]:
        """The stream index of each group: the saved one for a group re-admitted on resume, else
        the selector's (asked once, for the new groups only)."""
        fresh = [j for j in groups if j not in self.readmitted]
        chosen = iter(self.selector.select(fresh) if fresh else [])
        return [self.readmitted.pop(j) if j in self.readmitted else next(chosen) for j in groups]

    def sizes(self, groups: Sequence[int], keys: Sequence[str], default: int) -> list[int]:
        """Each group's number of samples (`scheduler/budget.py`), from its prompt's record."""
        if self.budget is None or not self.budget.adaptive:
            return [default] * len(groups)
        return self.budget.allocate(groups, [posterior_std(*self.stats.posterior(k)) for k in keys])

    def admitted(self, task: PromptTask, key: str) -> None:
        self.indices[task.group_id] = task.dataset_index
        self.stats.admitted(task.group_id, task.dataset_index, key, task.window)

    def observe(self, task: PromptTask, msg: TaskDone) -> None:
        """A group's TaskDone: its primary reward's sum goes into its prompt's record (once: a
        group already observed, e.g. one re-generated after a restart, is not counted again)."""
        if task.group_id not in self.stats.open:
            return
        if self.reward_name and self.reward_name in msg.reward_sums:
            total = msg.reward_sums[self.reward_name]
        else:
            total = msg.mean_reward * msg.num_trajectories
        self.stats.observe(
            task.group_id,
            total=total,
            num_samples=msg.num_trajectories,
            num_guided=msg.num_guided,
            guided_total=msg.guided_reward_sum,
        )

    def trained(self, groups: Iterable[int]) -> None:
        """Groups the learner trained (or, in pool mode, dropped): a resume never admits them again,
        so their rewards go into the record a checkpoint saves."""
        groups = list(groups)
        for group_id in groups:
            self.indices.pop(group_id, None)
        self.stats.groups_trained(groups)
        if self.budget is not None:
            self.budget.trained(groups)

    def observe_metrics(self, values: Mapping[str, float]) -> None:
        """A metric record reaching the launcher (domain_gap reads the generators' domain gaps)."""
        observe = getattr(self.selector, "observe", None)
        if observe is not None:
            observe(values)

    def step_fields(self) -> dict:
        own = getattr(self.selector, "step_fields", dict)()
        return {"selection": self.strategy, **self.stats.step_fields(), **own}

    def state(self) -> SelectionState:
        selector_state = getattr(self.selector, "state", dict)()
        return SelectionState(
            strategy=self.strategy,
            selector=selector_state,
            indices=dict(sorted(self.indices.items())),
            stats=self.stats.state(),
            budget=self.budget_name,
            sizes=dict(sorted(self.budget.sizes.items())) if self.budget is not None else {},
        )

    @property
    def budget_name(self) -> str:
        return "uncertainty" if self.budget is not None and self.budget.adaptive else "fixed"

    def restore(self, saved: dict, *, where: str) -> None:
        """Resume from a checkpoint's decoded `selection` field; ValueError when it was written by
        another strategy. Every group admitted and not trained keeps its index for its re-admission."""
        state = msgspec.convert(saved, SelectionState, strict=False)  # JSON object keys are strings
        if state.strategy != self.strategy:
            raise ValueError(
                f"{where} was written with sampling.selection = {state.strategy!r}, the config now says "
                f"{self.strategy!r}; resume with the run's own config"
            )
        if state.budget != self.budget_name:
            raise ValueError(
                f"{where} was written with sampling.budget = {state.budget!r}, the config now says "
                f"{self.budget_name!r}; resume with the run's own config"
            )
        if self.budget is not None:
            self.budget.restore(state.sizes)
        self.selector.restore(state.selector)
        self.stats.restore(state.stats)  # the resume admits the open groups again, with these indices
        self.readmitted = dict(state.indices)


def primary_reward(config: Config) -> str:
    """The reward whose group sums feed the pass-rate posterior (prompt_stats.py): the held-out
    accuracy's reward; "" = the task's own score."""
    rewards = config.task.rewards
    if not rewards:
        return ""
    if config.sampling.guidance.enabled and (len(rewards) > 1 or rewards[0].weight != 1.0):
        # TaskDone's guided_reward_sum is of the weighted sum: the record takes that sum for every
        # group, so the guided members' share subtracts in the same units (prompt_stats.py)
        return ""
    return config.task.scoring.eval_reward or rewards[0].name


def make_selection(config: Config, task: Task) -> Selection:
    """The run's `sampling.selection`; ValueError when a strategy needs what the task lacks."""
    s = config.sampling
    stats = PromptStats()
    key_of = lambda i: prompt_key(task.train_problem(i))  # noqa: E731
    if s.selection in NEEDS_TRAINING_SET:
        num_train = getattr(task, "num_train", None)
        if not num_train:
            raise ValueError(
                f"sampling.selection = {s.selection!r} chooses among a finite training set, and task "
                f"{config.task.kind!r} has none (no num_train); use a dataset task, or sampling.selection = "
                "'uniform', 'skip' or 'replay'"
            )
        if s.selection == "domain_gap":  # chooses by domain: no per-prompt keys
            selector = domain_gap_selector(config, task, num_train)
            return Selection(
                s.selection, selector, stats, reward_name=primary_reward(config), budget=make_budget(config)
            )
        keys = [key_of(i) for i in range(num_train)]
    selectors: dict[str, Callable[[], Any]] = {
        "uniform": UniformSelector,
        "skip": lambda: SkipSelector(
            stats,
            key_of,
            solved=s.selection_solved,
            hopeless=s.selection_hopeless,
            recheck=s.selection_recheck,
        ),
        "priority": lambda: PrioritySelector(stats, keys, seed=config.run.seed),
        "curriculum": lambda: CurriculumSelector(stats, keys, solved=s.selection_solved),
        "replay": lambda: ReplaySelector(
            stats, key_of, fraction=s.selection_replay_fraction, min_std=s.selection_replay_std
        ),
    }
    return Selection(
        s.selection,
        selectors[s.selection](),
        stats,
        reward_name=primary_reward(config),
        budget=make_budget(config),
    )


def make_budget(config: Config) -> Budget:
    """The run's `sampling.budget` (checked at load: config_budget.py)."""
    s, lrn = config.sampling, config.learner
    return Budget(
        groups_per_step=lrn.groups_per_step,
        samples_per_group=lrn.samples_per_group,
        lo=s.budget_min,
        hi=s.budget_max,
        adaptive=s.budget == "uncertainty",
    )


def domain_gap_selector(config: Config, task: Task, num_train: int) -> DomainGapSelector:
    """The domain_gap selector over the training set's domains; ValueError when a training prompt
    lacks the field opd.route_field."""
    field = config.opd.route_field
    cache: dict[int, str] = {}

    def domain_of(index: int) -> str:
        if index not in cache:
            value = task.train_problem(index).extras.get(field)
            if value is None:
                raise ValueError(
                    f"sampling.selection = 'domain_gap': training prompt {index} of task {config.task.kind!r} has no "
                    f"field opd.route_field = {field!r} in its extras; give every prompt a domain (a dataset "
                    f"task: {field!r} in each row and in task.dataset.extra_fields)"
                )
            cache[index] = str(value)
        return cache[index]

    domains = sorted({domain_of(i) for i in range(num_train)})
    return DomainGapSelector(
        domain_of, domains, floor=config.sampling.selection_domain_floor, seed=config.run.seed
    )
