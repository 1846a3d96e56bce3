"""`asyncrl report RUN_DIR`: PNG plots and a one-page markdown summary of a run, after the fact.

Place in the data flow: reads what the launcher wrote (metrics.jsonl, config.json,
summary.json) and nothing else; the live path is monitor/stream.py -> aggregate -> panels.
Series extraction is pure (`series`), plotting uses matplotlib's Agg backend (no display).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from asyncrl.monitor.aggregate import iter_records, median, replay

PLOTS = ("reward", "throughput", "staleness", "idle")
TOKEN_BINS = 30  # time bins for the generated-tokens rate


def series(records: list[dict]) -> dict:
    """Per-step, per-time and per-source series of a run's records (pure)."""
    steps = [r for r in records if r.get("type") == "step"]
    out: dict = {
        "step": [int(r["step"]) + 1 for r in steps],
        "step_time_s": [float(r["time_s"]) for r in steps],
        "reward": [float(r.get("mean_reward", math.nan)) for r in steps],
        "loss": [float(r.get("loss", math.nan)) for r in steps],
        "max_staleness": [int(r.get("max_staleness", 0)) for r in steps],
        "mean_staleness": [float(r.get("mean_staleness", math.nan)) for r in steps],
        "accuracy": {},  # key -> (time_s list, value list)
        "idle": {},  # stage -> (time_s list, idle ratio list)
    }
    rates_t, rates = [], []
    for prev, cur in zip(steps, steps[1:], strict=False):
        dt = float(cur["time_s"]) - float(prev["time_s"])
        if dt > 0:
            rates_t.append(float(cur["time_s"]))
            rates.append(int(cur.get("num_trajectories", 0)) / dt)
    out["samples_rate_t"], out["samples_rate"] = rates_t, rates
    tasks = [(float(r["time_s"]), int(r.get("num_tokens", 0))) for r in records if r.get("type") == "task"]
    out["tokens_rate_t"], out["tokens_rate"] = _binned_rate(tasks, TOKEN_BINS)
    for r in records:
        if r.get("type") != "metrics":
            continue
        source, t = str(r.get("source", "?")), float(r.get("time_s", 0.0))
        for key, value in r.items():
            if not isinstance(value, int | float) or key == "time_s":
                continue
            if key.endswith("idle_ratio"):
                stage = source
            elif key == "gen/busy_ratio":
                stage, value = source, 1.0 - value
            elif "accuracy" in key:
                ts, vs = out["accuracy"].setdefault(key, ([], []))
                ts.append(t)
                vs.append(float(value))
                continue
            else:
                continue
            ts, vs = out["idle"].setdefault(stage, ([], []))
            ts.append(t)
            vs.append(float(value))
    return out


def _binned_rate(events: list[tuple[float, int]], bins: int) -> tuple[list[float], list[float]]:
    """(bin centre, amount per second) of (time, amount) events over their time span."""
    if len(events) < 2:
        return [], []
    t0, t1 = min(t for t, _ in events), max(t for t, _ in events)
    width = (t1 - t0) / bins or 1.0
    sums = [0.0] * bins
    for t, amount in events:
        sums[min(bins - 1, int((t - t0) / width))] += amount
    return [t0 + (i + 0.5) * width for i in range(bins)], [s / width for s in sums]


def _plot(out_dir: Path, s: dict, summary: dict, bound: int | None) -> dict[str, Path]:
    """The four figures, each drawn by its own function, saved as report_<name>.png."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figures = {
        "reward": _plot_reward(plt, s, summary),
        "throughput": _plot_throughput(plt, s),
        "staleness": _plot_staleness(plt, s, bound),
        "idle": _plot_idle(plt, s),
    }
    paths: dict[str, Path] = {}
    for name, fig in figures.items():
        fig.tight_layout()
        paths[name] = out_dir / f"report_{name}.png"
        fig.savefig(paths[name], dpi=110)
        plt.close(fig)
    return paths


def _plot_reward(plt, s: dict, summary: dict):
    """Mean reward by step and by wall time, `*accuracy*` series, held-out accuracy before/after."""
    fig, (ax_step, ax_time) = plt.subplots(1, 2, figsize=(10, 3.6))
    for ax, x, label in ((ax_step, s["step"], "learner step"), (ax_time, s["step_time_s"], "time (s)")):
        ax.plot(x, s["reward"], marker=".", label="mean reward (training samples)")
        ax.set_xlabel(label)
        ax.set_ylim(-0.02, 1.02 if all(0 <= r <= 1 for r in s["reward"]) else None)
        ax.grid(alpha=0.3)
    for key, (ts, vs) in s["accuracy"].items():
        ax_time.plot(ts, vs, label=key)
    for name, x_step, marker in (("eval_before", 0, "v"), ("eval_after", s["step"][-1], "^")):
        value = summary.get(name)
        if isinstance(value, int | float) and not math.isnan(value):
            ax_step.scatter(
                [x_step],
                [value],
                marker=marker,
                s=60,
                color="C3",
                zorder=3,
                label=f"held-out accuracy ({name[5:]})",
            )
    ax_step.set_ylabel("reward / accuracy")
    ax_step.legend(fontsize=8, loc="best")
    ax_step.set_title("reward and accuracy vs steps")
    ax_time.set_title("vs wall time")
    return fig


def _plot_throughput(plt, s: dict):
    fig, ax = plt.subplots(figsize=(10, 3.6))
    ax.plot(s["samples_rate_t"], s["samples_rate"], marker=".", label="trained samples/s (per step)")
    ax.set_xlabel("time (s)")
    ax.set_ylabel("samples/s")
    ax.grid(alpha=0.3)
    if s["tokens_rate"]:
        ax2 = ax.twinx()
        ax2.plot(s["tokens_rate_t"], s["tokens_rate"], color="C1", alpha=0.7, label="generated tokens/s")
        ax2.set_ylabel("tokens/s")
        ax2.legend(fontsize=8, loc="lower right")
    ax.legend(fontsize=8, loc="upper left")
    ax.set_title("throughput")
    return fig


def _plot_staleness(plt, s: dict, bound: int | None):
    fig, (ax_line, ax_hist) = plt.subplots(1, 2, figsize=(10, 3.6))
    ax_line.step(s["step"], s["max_staleness"], where="mid", label="max")
    ax_line.plot(s["step"], s["mean_staleness"], marker=".", label="mean")
    if bound is not None:
        ax_line.axhline(bound, color="C3", linestyle="--", label=f"bound {bound}")
    ax_line.set_xlabel("learner step")
    ax_line.set_ylabel("staleness (versions)")
    ax_line.legend(fontsize=8)
    ax_line.grid(alpha=0.3)
    values = sorted(set(s["max_staleness"]))
    ax_hist.bar(values, [s["max_staleness"].count(v) for v in values])
    ax_hist.set_xlabel("max staleness of the step")
    ax_hist.set_ylabel("steps")
    ax_hist.set_xticks(values)
    fig.suptitle("staleness")
    return fig


def _plot_idle(plt, s: dict):
    fig, ax = plt.subplots(figsize=(10, 3.6))
    for stage, (ts, vs) in sorted(s["idle"].items()):
        ax.plot(ts, vs, marker=".", label=stage)
    ax.set_ylim(-0.02, 1.02)
    ax.set_xlabel("time (s)")
    ax.set_ylabel("idle ratio (cumulative)")
    ax.grid(alpha=0.3)
    if s["idle"]:
        ax.legend(fontsize=8)
    else:
        ax.text(0.5, 0.5, "no idle-ratio metrics in this run", ha="center", transform=ax.transAxes)
    ax.set_title("per-stage idle ratio")
    return fig


def _cell(value, spec: str = ".3f") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, float):
        return f"{value:{spec}}"
    return (
        f"{value:{spec}}"
        if isinstance(value, int) and not isinstance(value, bool) and spec == "d"
        else str(value)
    )


def write_report(run_dir: Path, out: Path | None = None) -> Path:
    """Writes report_*.png and report.md into `out` (default RUN_DIR/report); returns report.md."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ValueError(f"{run_dir}: no such run directory")
    metrics = run_dir / "metrics.jsonl"
    if not metrics.is_file():
        raise ValueError(f"{run_dir} is not an asyncrl run directory (no metrics.jsonl)")
    records = list(iter_records(metrics))
    s = series(records)
    if not s["step"]:
        raise ValueError(f"{run_dir} has no learner steps in metrics.jsonl yet: nothing to plot")
    view = replay(run_dir)
    summary = (
        json.loads((run_dir / "summary.json").read_text()) if (run_dir / "summary.json").is_file() else {}
    )
    out = Path(out) if out is not None else run_dir / "report"
    out.mkdir(parents=True, exist_ok=True)
    paths = _plot(out, s, summary, view.staleness_bound)

    rows = [
        ("status", summary.get("status", view.status or "running (no summary.json yet)")),
        ("mode / staleness policy", f"{view.mode or '-'} / {view.policy or '-'}"),
        ("steps", f"{view.step} / {_cell(view.total_steps, 'd')}"),
        ("trained samples", view.trajectories_trained),
        ("lost samples", summary.get("trajectories_lost")),
        (
            "held-out accuracy before -> after",
            f"{_cell(summary.get('eval_before'))} -> {_cell(summary.get('eval_after'))}",
        ),
        ("reward first -> last step", f"{_cell(s['reward'][0])} -> {_cell(s['reward'][-1])}"),
        ("training wall time (s)", summary.get("train_wall_s", view.elapsed_s())),
        ("trained samples/s", summary.get("samples_per_s", view.samples_per_s())),
        ("generated tokens/s", summary.get("tokens_per_s", view.tokens_per_s())),
        ("max staleness (bound)", f"{view.max_staleness} ({_cell(view.staleness_bound, 'd')})"),
    ]
    for transport, sync in sorted(view.sync.items()):
        rows.append(
            (
                f"weight sync {transport}: publish / announce->loaded (median ms)",
                f"{_cell(_ms(median(sync.publish_s)), '.1f')} / {_cell(_ms(median(sync.latency_s)), '.1f')}",
            )
        )
    for stage, ratio in sorted(view.idle.items()):
        rows.append((f"idle ratio {stage} (final)", f"{ratio:.2f}"))
    lines = [f"# Run report: {run_dir.name}", "", "| | |", "|---|---|"]
    lines += [f"| {k} | {_cell(v)} |" for k, v in rows]
    captions = {
        "reward": "Mean reward of the trained samples per step and over time; triangles: held-out greedy accuracy before and after training.",
        "throughput": "Trained samples per second per step interval; generated tokens per second (binned).",
        "staleness": "Max and mean staleness per step against the bound; steps by their max staleness.",
        "idle": "Cumulative idle ratio of each stage (learner waiting for data; generators waiting for work or weights).",
    }
    for name in PLOTS:
        lines += ["", f"## {name}", "", captions[name], "", f"![{name}]({paths[name].name})"]
    path = out / "report.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1e3
