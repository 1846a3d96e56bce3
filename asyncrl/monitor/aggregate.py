"""Incremental aggregation of metric records into what the dashboard shows (pure, no I/O).

Place in the data flow: the launcher writes every record to `<run>/metrics.jsonl` and publishes it
(monitor/stream.py); a `RunView` folds the records, one at a time and in order, into counters,
short series and histograms. The same `RunView` is fed live (in `asyncrl launch`), from the PUB
socket (`asyncrl monitor`), or from the JSONL file (replay), so a live and a replayed run render
the same. Every `add` is O(1) amortised; series keep only their last `series_len` points.

Record types (the `type` field): `step` (StepDone), `task` (TaskDone), `publish`
(WeightsPublished), `loaded` (WeightsLoaded), `metrics` (a child's Metrics, flat keys),
`launcher` (the launcher's periodic snapshot: phase, admission, in-flight, restarts, failure),
`event` (a line of text; the held-out evaluation's also carries `held_out`: phase, accuracy,
rewards), `eval` (a periodic held-out evaluation: version, accuracy, rewards, pass_at_k, n),
`restart` / `error` (counted). Unknown types are counted and ignored, so new components can add
records without breaking older monitors.

Panels whose data no component produces yet stay `None` here and render as a dash. Metric-name
conventions the view picks up from `metrics` records and from `step.stats`:
  *freshness*          freshness diagnostics (latest value per key; `freshness_hist/<bin>` counts)
  *buffer*             buffer depth and friends (latest value per key)
  staleness_hist/<k>   token or sample counts at staleness k (else: steps by their max staleness)
  *idle_ratio, gen/busy_ratio   per-stage idle ratios
  *restarts            restart counters;  *rejected_frames, *duplicates, *invalid*  error counters
  *accuracy*           accuracy series (besides the held-out accuracy in summary.json)
"""

from __future__ import annotations

import functools
import json
import re
import statistics
from collections import Counter, deque
from dataclasses import dataclass, field
from pathlib import Path

HIST_KEY = re.compile(r"(?:^|/)staleness_hist[/_](\d+)$")
FRESH_HIST_KEY = re.compile(r"(?:^|/)freshness_hist[/_](.+)$")
ERROR_SUFFIXES = ("rejected_frames", "duplicates", "invalid_trajectories")
STEP_WINDOW = 10  # steps used for the recent rate and the ETA
SYNC_WINDOW = 20  # weight-sync latencies kept per transport
# isinstance's class tuple: `int | float` written in a check builds a union object at every call,
# and the checks run several times per record.
NUMBER = (int, float)


@dataclass
class GeneratorStats:
    samples: int = 0
    tokens: int = 0
    tasks: int = 0
    generate_s: float = 0.0
    busy_ratio: float | None = None
    version: int | None = None
    restarts: int | None = None


@dataclass
class SyncStats:
    """Weight-sync figures for one transport, in seconds."""

    publishes: int = 0
    num_bytes: int = 0
    publish_s: deque = field(default_factory=lambda: deque(maxlen=SYNC_WINDOW))
    load_s: deque = field(default_factory=lambda: deque(maxlen=SYNC_WINDOW))
    # announce -> the last generator loaded it (includes waiting behind generation)
    latency_s: deque = field(default_factory=lambda: deque(maxlen=SYNC_WINDOW))


@functools.lru_cache(maxsize=4096)
def key_route(key: str) -> tuple[str | None, int | str | None]:
    """Which panel a metric name feeds (the conventions in the module docstring), and the
    histogram bin it names; cached, as a run repeats the same few dozen names on every record."""
    low = key.lower()
    if m := HIST_KEY.search(low):
        return "hist", int(m.group(1))
    if m := FRESH_HIST_KEY.search(low):
        return "fresh_hist", m.group(1)
    for route, hit in (
        ("freshness", "freshness" in low),
        ("buffer", "buffer" in low),
        ("idle", low.endswith("idle_ratio")),
        ("restarts", low.endswith("restarts")),
        ("error", low.endswith(ERROR_SUFFIXES)),
        ("accuracy", "accuracy" in low),
    ):
        if hit:
            return route, None
    return None, None


@functools.lru_cache(maxsize=256)
def routed_keys(keys: tuple[str, ...]) -> tuple[tuple[str, str, int | str | None], ...]:
    """(key, route, bin) of the keys that feed a panel; a record's key set repeats, so cached."""
    return tuple((key, *route) for key in keys if (route := key_route(key))[0] is not None)


def median(values) -> float | None:
    return statistics.median(values) if values else None


class RunView:
    """Everything the dashboard renders, updated one record at a time."""

    def __init__(self, *, series_len: int = 240) -> None:
        self.series_len = series_len
        self.num_records = 0
        self.num_unknown = 0
        self.revision = 0  # bumps on every add; renderers cache on it
        # run shape (from `launcher` snapshots or config.json)
        self.total_steps: int | None = None
        self.groups_per_step: int | None = None
        self.samples_per_group: int | None = None
        self.staleness_bound: int | None = None
        self._length_sums: dict[str, tuple[float, int]] = {}  # kind -> (length x samples, samples)
        self.num_generators: int | None = None
        self.mode: str | None = None
        self.policy: str | None = None
        self.phase = "-"
        self.status: str | None = None  # from summary.json or the final snapshot
        self.final = False
        self.time_s = 0.0  # latest record time (the launcher's clock, from launch)
        self.train_t0 = 0.0  # the record time at which training started: rates count from there
        self.training = False
        # progress
        self.step = 0
        self.policy_version = 0
        self.trajectories_trained = 0
        self.tokens_trained = 0
        self.step_times: deque[float] = deque(maxlen=STEP_WINDOW + 1)
        self.step_sizes: deque[int] = deque(maxlen=STEP_WINDOW + 1)
        self.first_step_time: float | None = None
        # generation
        self.trajectories_generated = 0
        self.tokens_generated = 0
        self.generators: dict[str, GeneratorStats] = {}
        self.first_task_time: float | None = None
        # reward, accuracy, loss
        self.rewards: deque[float] = deque(maxlen=series_len)
        self.losses: deque[float] = deque(maxlen=series_len)
        self.accuracy: dict[str, deque[float]] = {}
        self.eval_before: float | None = None
        self.eval_after: float | None = None
        self.last_eval: tuple[int, float] | None = None  # (policy_version, accuracy) of an `eval` record
        self.last_step: dict | None = None
        self.diagnostics: dict[str, float] = {}
        # staleness and freshness
        self.staleness_hist: Counter[int] = Counter()
        self.staleness_hist_unit = "steps"  # "steps" (by max staleness) or "samples" (reported)
        self.max_staleness = 0
        self.mean_staleness: float | None = None
        self.freshness: dict[str, float] = {}
        self.freshness_hist: dict[str, float] = {}
        # pipeline
        self.buffer: dict[str, float] = {}
        self.groups_admitted: int | None = None
        self.groups_in_flight: int | None = None
        self.credits_used: int | None = None
        self.credits_total: int | None = None
        self.credits_free: int | None = None
        # weight sync
        self.sync: dict[str, SyncStats] = {}
        self._announced: dict[int, tuple[str, float]] = {}  # version -> (transport, time_s)
        self._loaded_by: dict[int, set[str]] = {}
        # idle ratios: stage name -> ratio in [0, 1]
        self.idle: dict[str, float] = {}
        # health
        self.restarts: int | None = None
        self.failure: str | None = None
        self.error_counts: dict[str, float] = {}
        self.num_error_records = 0
        self.events: deque[str] = deque(maxlen=50)
        self.metrics: dict[str, dict[str, float]] = {}  # source -> latest values

    # ------------------------------------------------------------------ input
    def add(self, record: dict) -> None:
        self.num_records += 1
        self.revision += 1
        kind = record.get("type")
        if not self.training and (
            kind in ("task", "step") or (kind == "launcher" and record.get("phase") == "training")
        ):
            # Elapsed time and rates count from the start of training. (Runs recorded before the
            # launcher's clock ran on from launch restarted it at 0 here; both read the same.)
            self.training = True
            self.time_s = 0.0
            t = record.get("time_s")
            self.train_t0 = float(t) if isinstance(t, NUMBER) else 0.0
        t = record.get("time_s")
        if isinstance(t, NUMBER):
            self.time_s = max(self.time_s, float(t))
        handler = self._handlers.get(kind)
        if handler is None:
            self.num_unknown += 1
            return
        handler(self, record)

    def _on_step(self, r: dict) -> None:
        self.step = max(self.step, int(r["step"]) + 1)
        self.policy_version = max(self.policy_version, int(r.get("version", self.step)))
        n = int(r.get("num_trajectories", 0))
        self.trajectories_trained += n
        self.tokens_trained += int(r.get("num_tokens", 0))
        t = float(r.get("time_s", self.time_s))
        if self.first_step_time is None:
            self.first_step_time = t
        self.step_times.append(t)
        self.step_sizes.append(n)
        self.rewards.append(float(r.get("mean_reward", 0.0)))
        self.losses.append(float(r.get("loss", 0.0)))
        max_st = int(r.get("max_staleness", 0))
        self.max_staleness = max(self.max_staleness, max_st)
        if isinstance(r.get("staleness_bound"), int):  # the bound in force (moves when "auto")
            self.staleness_bound = r["staleness_bound"]
        counts = r.get("length_samples") or {}
        for kind, value in (r.get("lengths") or {}).items():
            if value is not None:  # the run's mean completion lengths, weighted by samples
                total, count = self._length_sums.get(kind, (0.0, 0))
                k = int(counts.get(kind, 0))
                self._length_sums[kind] = (total + value * k, count + k)
        self.mean_staleness = r.get("mean_staleness")
        self.last_step = r
        stats = r.get("stats") or {}
        self.diagnostics = dict(stats)
        reported = self._take_keys(stats, "learner")
        if not reported and self.staleness_hist_unit == "steps":
            self.staleness_hist[max_st] += 1

    def _on_task(self, r: dict) -> None:
        gen = self._generator(str(r.get("generator_id", "?")))
        n, tokens = int(r.get("num_trajectories", 0)), int(r.get("num_tokens", 0))
        gen.samples += n
        gen.tokens += tokens
        gen.tasks += 1
        gen.generate_s += float(r.get("generate_s", 0.0))
        self.trajectories_generated += n
        self.tokens_generated += tokens
        if self.first_task_time is None:
            self.first_task_time = float(r.get("time_s", self.time_s))

    def _on_publish(self, r: dict) -> None:
        transport = str(r.get("transport", "?"))
        sync = self.sync.setdefault(transport, SyncStats())
        sync.publishes += 1
        sync.num_bytes = int(r.get("num_bytes", 0))
        sync.publish_s.append(float(r.get("publish_s", 0.0)))
        version = int(r["version"])
        self._announced[version] = (transport, float(r.get("time_s", self.time_s)))
        self._loaded_by[version] = set()
        for old in [v for v in self._announced if v < version - 8]:  # bounded bookkeeping
            self._announced.pop(old, None)
            self._loaded_by.pop(old, None)

    def _on_loaded(self, r: dict) -> None:
        gen_id, version = str(r.get("generator_id", "?")), int(r["version"])
        self._generator(gen_id).version = version
        announced = self._announced.get(version)
        if announced is None:
            return
        transport, t0 = announced
        sync = self.sync[transport]
        sync.load_s.append(float(r.get("load_s", 0.0)))
        loaded = self._loaded_by[version]
        loaded.add(gen_id)
        expected = self.num_generators or len(self.generators) or 1
        latency = float(r.get("time_s", self.time_s)) - t0
        if len(loaded) >= expected and latency >= 0:
            sync.latency_s.append(latency)

    def _on_metrics(self, r: dict) -> None:
        source = str(r.get("source", "?"))
        values = {k: v for k, v in r.items() if k not in ("type", "time_s", "source")}
        self.metrics.setdefault(source, {}).update(values)
        if source.startswith("gen") and source != "generators":
            gen = self._generator(source)
            if "gen/busy_ratio" in values:
                gen.busy_ratio = float(values["gen/busy_ratio"])
                self.idle[source] = 1.0 - gen.busy_ratio
            if "gen/version" in values:
                gen.version = int(values["gen/version"])
        self._take_keys(values, source)

    def _on_launcher(self, r: dict) -> None:
        for name in ("total_steps", "groups_per_step", "samples_per_group", "num_generators"):
            if isinstance(r.get(name), int):
                setattr(self, name, r[name])
        if isinstance(r.get("max_staleness_bound"), int):
            self.staleness_bound = r["max_staleness_bound"]
        self.mode = r.get("mode", self.mode)
        self.policy = r.get("policy", self.policy)
        self.phase = str(r.get("phase", self.phase))
        # A monitor that joined late (endpoint only) has missed records: the snapshot's totals win.
        self.step = max(self.step, int(r.get("step", 0)))
        self.policy_version = max(self.policy_version, int(r.get("policy_version", 0)))
        self.trajectories_trained = max(self.trajectories_trained, int(r.get("trajectories_trained", 0)))
        self.trajectories_generated = max(
            self.trajectories_generated, int(r.get("trajectories_generated", 0))
        )
        self.tokens_generated = max(self.tokens_generated, int(r.get("tokens_generated", 0)))
        for name in ("groups_admitted", "groups_in_flight", "credits_used", "credits_total", "credits_free"):
            if isinstance(r.get(name), int):
                setattr(self, name, r[name])
        if isinstance(r.get("restarts"), int):
            self.restarts = r["restarts"]
        if r.get("failure"):
            self.failure = str(r["failure"])
        if r.get("final"):
            self.final = True
            self.status = r.get("status", self.status)

    def _on_event(self, r: dict) -> None:
        self.events.append(f"{float(r.get('time_s', 0.0)):7.1f}s  {r.get('text', '')}")
        held_out = r.get("held_out")
        if isinstance(held_out, dict) and held_out.get("phase") in ("before", "after"):
            accuracy = held_out.get("accuracy")
            if isinstance(accuracy, NUMBER) and accuracy == accuracy:  # NaN: nothing held out
                setattr(self, f"eval_{held_out['phase']}", float(accuracy))

    def _on_eval(self, r: dict) -> None:
        accuracy, version = r.get("accuracy"), r.get("version")
        if isinstance(accuracy, NUMBER) and isinstance(version, int):
            self.last_eval = (version, float(accuracy))

    def _on_error(self, r: dict) -> None:
        if r.get("type") == "restart":
            total = r.get("generator_restarts")
            self.restarts = int(total) if isinstance(total, int) else (self.restarts or 0) + 1
        else:
            self.num_error_records += 1
        text = r.get("text") or r.get("error") or r.get("reason") or r.get("type")
        self.events.append(f"{float(r.get('time_s', 0.0)):7.1f}s  {r.get('type')}: {text}")

    def _on_left(self, r: dict) -> None:
        """Pool mode: groups that left the learner's buffer; drops are worth an event line."""
        evicted = r.get("evicted") or {}
        if isinstance(evicted, dict) and evicted:
            what = ", ".join(
                f"{len(g)} ({reason})" for reason, g in sorted(evicted.items()) if isinstance(g, list)
            )
            self.events.append(f"{float(r.get('time_s', 0.0)):7.1f}s  buffer dropped groups: {what}")

    _handlers = {
        "step": _on_step,
        "left": _on_left,
        "task": _on_task,
        "publish": _on_publish,
        "loaded": _on_loaded,
        "metrics": _on_metrics,
        "launcher": _on_launcher,
        "event": _on_event,
        "eval": _on_eval,
        "restart": _on_error,
        "error": _on_error,
        "fatal": _on_error,
    }

    def _take_keys(self, values: dict, source: str) -> bool:
        """Route conventional metric names to their panels; True if a staleness histogram came in."""
        got_hist = False
        for key, route, arg in routed_keys(tuple(values)):
            value = values[key]
            if not isinstance(value, NUMBER):
                continue
            if route == "hist":
                if not got_hist and self.staleness_hist_unit == "steps":
                    self.staleness_hist.clear()  # reported counts replace the per-step fallback
                self.staleness_hist_unit = "samples"
                self.staleness_hist[arg] += int(value)
                got_hist = True
            elif route == "fresh_hist":
                self.freshness_hist[arg] = self.freshness_hist.get(arg, 0.0) + float(value)
            elif route == "freshness":
                self.freshness[key] = float(value)
            elif route == "buffer":
                self.buffer[key] = float(value)
            elif route == "idle":
                self.idle[source] = float(value)
            elif route == "restarts":
                self.restarts = max(self.restarts or 0, int(value))
            elif route == "error":
                self.error_counts[f"{source}:{key}"] = float(value)
            elif route == "accuracy":
                self.accuracy.setdefault(key, deque(maxlen=self.series_len)).append(float(value))
        return got_hist

    def _generator(self, gen_id: str) -> GeneratorStats:
        gen = self.generators.get(gen_id)
        if gen is None:
            gen = self.generators[gen_id] = GeneratorStats()
        return gen

    def apply_summary(self, summary: dict) -> None:
        """A finished run's summary.json: status and the held-out accuracy before/after."""
        self.revision += 1
        self.final = True
        self.status = summary.get("status", self.status)
        for name in ("eval_before", "eval_after"):
            value = summary.get(name)
            if isinstance(value, NUMBER) and value == value:  # NaN means "not evaluated"
                setattr(self, name, float(value))
        if summary.get("error"):
            self.failure = str(summary["error"])
        if self.phase in ("-", "training", "stopping"):
            self.phase = str(self.status)

    def apply_config(self, config: dict) -> None:
        """config.json of the run: the run's shape, for runs whose records carry no snapshot."""
        learner, gens = config.get("learner", {}), config.get("generators", {})
        self.total_steps = self.total_steps or learner.get("steps")
        self.groups_per_step = self.groups_per_step or learner.get("groups_per_step")
        self.samples_per_group = self.samples_per_group or learner.get("samples_per_group")
        self.num_generators = self.num_generators or gens.get("num_generators")
        self.mode = self.mode or config.get("mode")
        self.policy = self.policy or config.get("staleness", {}).get("policy")
        if self.staleness_bound is None:
            section = config.get("staleness", {})
            bound = section.get("max_staleness")
            bound = section.get("max_staleness_cap") if bound == "auto" else bound
            self.staleness_bound = 0 if self.mode == "sync" else bound

    # ------------------------------------------------------------------ derived figures
    @property
    def completion_lengths(self) -> dict[str, float]:
        """Mean completion length generated / trained / evicted so far (from the step records)."""
        return {k: total / count for k, (total, count) in self._length_sums.items() if count}

    @property
    def total_samples(self) -> int | None:
        if None in (self.total_steps, self.groups_per_step, self.samples_per_group):
            return None
        return self.total_steps * self.groups_per_step * self.samples_per_group

    def elapsed_s(self) -> float:
        """Seconds of training so far (launch time before training starts)."""
        return max(0.0, self.time_s - self.train_t0)

    def samples_per_s(self) -> float | None:
        """Trained samples per second over the whole run so far."""
        elapsed = self.elapsed_s()
        if self.first_step_time is None or elapsed <= 0:
            return None
        return self.trajectories_trained / elapsed

    def recent_samples_per_s(self) -> float | None:
        """Trained samples per second over the last STEP_WINDOW steps."""
        if len(self.step_times) < 2:
            return None
        span = self.step_times[-1] - self.step_times[0]
        return sum(list(self.step_sizes)[1:]) / span if span > 0 else None

    def tokens_per_s(self) -> float | None:
        elapsed = self.elapsed_s()
        return self.tokens_generated / elapsed if elapsed > 0 and self.tokens_generated else None

    def eta_s(self) -> float | None:
        if self.total_steps is None or len(self.step_times) < 2 or self.final:
            return None
        per_step = (self.step_times[-1] - self.step_times[0]) / (len(self.step_times) - 1)
        return max(0, self.total_steps - self.step) * per_step

    def generator_rates(self, gen: GeneratorStats) -> tuple[float | None, float | None]:
        """(samples/s, tokens/s) of one generator over the run's generation time so far."""
        elapsed = self.elapsed_s()
        if elapsed <= 0 or gen.samples == 0:
            return None, None
        return gen.samples / elapsed, gen.tokens / elapsed

    def error_total(self) -> float:
        return sum(self.error_counts.values())


def iter_records(path: Path):
    """Records of a metrics.jsonl file; a torn last line (a run still writing) is skipped."""
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.endswith("\n") and line.strip():
                yield json.loads(line)


def replay(run_dir: Path, view: RunView | None = None) -> RunView:
    """A RunView of a run directory's records, config and (if finished) summary."""
    view = view or RunView()
    config = run_dir / "config.json"
    if config.is_file():
        view.apply_config(json.loads(config.read_text()))
    for record in iter_records(run_dir / "metrics.jsonl"):
        view.add(record)
    summary = run_dir / "summary.json"
    if summary.is_file():
        view.apply_summary(json.loads(summary.read_text()))
    return view
