"""What the web page shows of one run, folded from its records (pure, no I/O).

Place in the data flow: records (metrics.jsonl, the PUB socket, or in process) -> `WebRun.add`
-> `WebRun.state()`, the JSON the page draws (server.py sends it). The headline figures come from
the same `RunView` (monitor/aggregate.py) the terminal dashboard folds, so both dashboards show
the same numbers; the web page adds histories (series.py: bounded, downsampled) and a timeline.

What each panel is made of, all read from records the launcher writes:
  throughput      `step`: trained samples per second between two step records; `task`: generated
                  tokens over the same interval
  timeline        `step` (learner: `idle_s` waiting, then `step_s` training, ending when the
                  launcher received the StepDone), `task` (a generator decoding a group: its
                  `generate_s` up to the TaskDone), `loaded` (loading weights: `load_s`),
                  `publish` (a mark per version; `publish_s`). A lane's gaps are idle time. The
                  learner's waiting and training interleave within a streamed step; the record
                  carries their sums, so the bar shows the waiting first.
  staleness       RunView's histogram; `step.staleness_bound` (the bound in force), a mark where
                  it moved (the closed-loop controller's decisions)
  rewards         `step.mean_reward`; `step.rewards` (each reward's running mean, task.rewards)
  evaluation      `eval` records (version, accuracy, pass_at_k); the held-out accuracy before and
                  after training (`event` records' `held_out` field, or summary.json)
  lengths         `step.lengths` (mean completion length generated / trained / evicted per step)
  prompts         the launcher's per-prompt record (scheduler/prompt_stats.py): `step.pass_rate_
                  quantiles` (q10-q90 of the prompts' estimated pass rates, after each step) and
                  `step.degenerate_fraction` (groups all failed or all solved since the last step)
  weight sync     `publish` (publish_s, num_bytes) and `loaded` (load_s, the slowest generator)
  events          `event`, `restart`, `error`, `fatal`, `rejected`, `refused` records, skipped
                  steps, the settings linter's warnings (summary.json `lint`)
"""

from __future__ import annotations

from collections import deque

from asyncrl.monitor.aggregate import NUMBER, RunView
from asyncrl.monitor.web.series import Buckets, Lanes

TIMELINE_S = 180.0  # the Gantt chart shows the last three minutes of the run
MAX_EVENTS = 60
MAX_EVALS = 2000
MAX_DECISIONS = 200


def _num(value, default: float = float("nan")) -> float:
    if type(value) is float:  # the common case first: this runs a dozen times per step record
        return value
    return float(value) if isinstance(value, NUMBER) and not isinstance(value, bool) else default


class WebRun:
    """One run's page state; `add(record)` in record order, `state()` for the page."""

    def __init__(self, label: str, *, live: bool) -> None:
        self.label = label
        self.live = live
        self.view = RunView()
        self.series: dict[str, Buckets] = {}
        self.lanes = Lanes(TIMELINE_S)
        self.decisions: deque[list] = deque(maxlen=MAX_DECISIONS)  # [step, old bound, new bound]
        self.evals: deque[dict] = deque(maxlen=MAX_EVALS)
        self.events: deque[list] = deque(maxlen=MAX_EVENTS)  # [time_s, kind, text]
        self.lint: list[str] = []
        self.config: dict | None = None
        self.revision = 0
        self._last_step_t: float | None = None
        self._tokens_since_step = 0
        self._bound: int | None = None
        self._load_by_version: dict[int, float] = {}

    # ------------------------------------------------------------------ input
    def add(self, record: dict) -> None:
        self.revision += 1
        self.view.add(record)
        handler = self._handlers.get(record.get("type"))
        if handler is not None:
            handler(self, record)

    def _point(self, name: str, x: float, y: float) -> None:
        try:
            self.series[name].add(x, y)
        except KeyError:
            self.series[name] = Buckets()
            self.series[name].add(x, y)

    def skip_timeline_before(self, last_time_s: float) -> None:
        """A replay that knows its last record's time: older spans never reach the timeline."""
        self.lanes.skip_before = last_time_s - self.lanes.window_s

    def _on_step(self, r: dict) -> None:
        t, step = _num(r.get("time_s"), self.view.time_s), int(r.get("step", 0))
        step_s, idle_s = _num(r.get("step_s"), 0.0), _num(r.get("idle_s"), 0.0)
        self.lanes.add("learner", t - step_s - idle_s, t - step_s, "waiting")
        self.lanes.add("learner", t - step_s, t, "training")
        if self._last_step_t is not None and t > self._last_step_t:
            dt = t - self._last_step_t
            self._point("samples_per_s", t, _num(r.get("num_trajectories"), 0.0) / dt)
            self._point("tokens_per_s", t, self._tokens_since_step / dt)
        self._last_step_t, self._tokens_since_step = t, 0
        self._point("reward", step, _num(r.get("mean_reward")))
        for name, value in (r.get("rewards") or {}).items():
            self._point(f"reward/{name}", step, _num(value))
        self._point("staleness_max", step, _num(r.get("max_staleness")))
        self._point("staleness_mean", step, _num(r.get("mean_staleness")))
        bound = r.get("staleness_bound")
        if isinstance(bound, int):
            self._point("staleness_bound", step, bound)
            if self._bound is not None and bound != self._bound:
                self.decisions.append([step, self._bound, bound])
            self._bound = bound
        for kind, value in (r.get("lengths") or {}).items():
            self._point(f"length/{kind}", step, _num(value))
        for q, value in (r.get("pass_rate_quantiles") or {}).items():
            self._point(f"pass_rate/{q}", step, _num(value))
        self._point("degenerate_fraction", step, _num(r.get("degenerate_fraction")))
        if r.get("skipped_nonfinite"):
            self.events.append([t, "skipped", f"step {step}: update skipped (non-finite loss or gradient)"])

    def _on_task(self, r: dict) -> None:
        t = _num(r.get("time_s"), self.view.time_s)
        gen = str(r.get("generator_id", "?"))
        self.lanes.add(gen, t - _num(r.get("generate_s"), 0.0), t, "decoding")
        self._tokens_since_step += int(_num(r.get("num_tokens"), 0.0))

    def _on_publish(self, r: dict) -> None:
        t, version = _num(r.get("time_s"), self.view.time_s), int(r.get("version", 0))
        self.lanes.add("publish", t - _num(r.get("publish_s"), 0.0), t, "publish")
        self._point("sync/publish_ms", version, _num(r.get("publish_s")) * 1e3)
        self._point("sync/mib", version, _num(r.get("num_bytes")) / 2**20)

    def _on_loaded(self, r: dict) -> None:
        t, load_s = _num(r.get("time_s"), self.view.time_s), _num(r.get("load_s"), 0.0)
        self.lanes.add(str(r.get("generator_id", "?")), t - load_s, t, "loading")
        version = int(r.get("version", 0))
        slowest = max(self._load_by_version.get(version, 0.0), load_s)
        self._load_by_version[version] = slowest
        for old in [v for v in self._load_by_version if v < version - 8]:  # bounded bookkeeping
            del self._load_by_version[old]
        self._point("sync/load_ms", version, slowest * 1e3)

    def _on_event(self, r: dict) -> None:
        kind = str(r.get("type"))
        text = r.get("text") or r.get("error") or r.get("reason") or kind
        self.events.append([_num(r.get("time_s"), 0.0), kind, str(text)])

    def _on_refusals(self, r: dict) -> None:
        """Frames a socket rejected (`rejected`) or peers refused at the handshake (`refused`)."""
        t = _num(r.get("time_s"), 0.0)
        if r.get("type") == "rejected":
            text = f"{r.get('socket', '?')}: {r.get('num_rejected', '?')} frames rejected so far"
        else:
            text = f"{r.get('num_refused', '?')} peers refused at the handshake ({r.get('by_reason') or {}})"
        self.events.append([t, str(r.get("type")), text])

    def _on_eval(self, r: dict) -> None:
        """Periodic held-out evaluation (`eval` records, docs/monitor.md "Evaluation curve"):
        version, accuracy, pass_at_k, rewards, problems, samples."""
        point = {"version": int(_num(r.get("version"), 0.0)), "accuracy": _num(r.get("accuracy"))}
        for key in ("rewards", "pass_at_k"):
            if isinstance(r.get(key), dict):
                point[key] = {k: _num(v) for k, v in r[key].items()}
        for key in ("n", "problems", "samples"):  # how many problems and completions it took
            if isinstance(r.get(key), int):
                point[key] = r[key]
        self.evals.append(point)

    _handlers = {
        "step": _on_step,
        "task": _on_task,
        "publish": _on_publish,
        "loaded": _on_loaded,
        "event": _on_event,
        "restart": _on_event,
        "error": _on_event,
        "fatal": _on_event,
        "eval": _on_eval,
        "rejected": _on_refusals,
        "refused": _on_refusals,
    }

    def apply_config(self, config: dict) -> None:
        self.revision += 1
        self.config = config
        self.view.apply_config(config)

    def apply_summary(self, summary: dict) -> None:
        self.revision += 1
        self.view.apply_summary(summary)
        self.lint = [lint_line(w) for w in summary.get("lint") or []]

    def early_event(self, text: str) -> None:
        """A line the launch told before its records began (`asyncrl launch --web`): the run
        directory, the settings linter's warnings."""
        self.revision += 1
        self.events.append([0.0, "launch", text])

    # ------------------------------------------------------------------ output
    def state(self) -> dict:
        """The page's whole view of the run: bounded in size whatever the run's length."""
        return {
            "label": self.label,
            "live": self.live and not self.view.final,
            "revision": self.revision,
            "head": head_figures(self.view),
            "series": {name: s.points() for name, s in sorted(self.series.items())},
            "timeline": self.lanes.view(),
            "staleness": {
                "unit": self.view.staleness_hist_unit,
                "counts": {str(k): n for k, n in sorted(self.view.staleness_hist.items())},
                "bound": self.view.staleness_bound,
                "decisions": list(self.decisions),
            },
            "evals": list(self.evals),
            "events": list(self.events),
            "lint": list(self.lint),
        }


def lint_line(warning) -> str:
    """A summary.json `lint` entry (asyncrl/lint.py `Finding.to_json`) as the launcher's line."""
    if not isinstance(warning, dict):
        return str(warning)
    w = {k: warning.get(k, "?") for k in ("level", "rule", "key", "problem", "fix")}
    return f"{w['level']} [{w['rule']}] at {w['key']}: {w['problem']}; {w['fix']}"


def head_figures(v: RunView) -> dict:
    """The headline numbers, the same figures the terminal dashboard prints (None = not reported)."""

    def finite(x):
        return None if x is None or x != x else round(float(x), 6)

    return {
        "phase": v.phase,
        "status": v.status,
        "mode": v.mode,
        "policy": v.policy,
        "step": v.step,
        "total_steps": v.total_steps,
        "policy_version": v.policy_version,
        "trained": v.trajectories_trained,
        "generated": v.trajectories_generated,
        "tokens_generated": v.tokens_generated,
        "samples_per_s": finite(v.samples_per_s()),
        "recent_samples_per_s": finite(v.recent_samples_per_s()),
        "tokens_per_s": finite(v.tokens_per_s()),
        "elapsed_s": round(v.elapsed_s(), 3),
        "eta_s": finite(v.eta_s()),
        "eval_before": finite(v.eval_before),
        "eval_after": finite(v.eval_after),
        "max_staleness": v.max_staleness,
        "mean_staleness": finite(v.mean_staleness),
        "staleness_bound": v.staleness_bound,
        "lengths": {k: finite(x) for k, x in v.completion_lengths.items()},
        "restarts": v.restarts,
        "errors": v.error_total() + v.num_error_records,
        "failure": v.failure,
        "generators": sorted(v.generators),
    }
