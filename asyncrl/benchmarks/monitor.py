"""`asyncrl bench monitor`: what the live dashboard costs.

Place in the data flow: measures the monitor end of the metrics stream (monitor/aggregate.py,
monitor/panels.py, monitor/live.py) in isolation, then inside the default job.
  1. aggregate: microseconds to fold one record into a RunView (a realistic record mix);
  2. render: milliseconds per full frame (build the panels + rich layout to ANSI text) at the
     given terminal size, on a view holding a whole default run;
  3. job (unless --job-steps 0): the default job run in this process, alternately with the
     dashboard (drawing to /dev/null as a terminal) and with plain lines; reports trained
     samples/s of each, and the dashboard's CPU time (records folded in + frames drawn) as a
     share of the job's CPU time (launcher + children, from getrusage).
Acceptance (issue #8): the dashboard costs < 2% of the default job's throughput.
"""

from __future__ import annotations

import json
import statistics
import time
from typing import Annotated

import typer

REFRESH_HZ = 4.0  # the default monitor.refresh_per_second


def synthetic_records(*, num_steps: int, groups_per_step: int = 32, num_generators: int = 1) -> list[dict]:
    """The record mix of a default run: per step, one task per group, a publish, a loaded per
    generator, a step with policy stats, metrics from each child, and launcher snapshots."""
    out: list[dict] = []
    t = 0.0
    for step in range(num_steps):
        for g in range(groups_per_step):
            t += 0.01
            out += _group_records(
                step, g, groups_per_step=groups_per_step, num_generators=num_generators, t=t
            )
        out.append(_publish_record(step, t=t))
        out += [_loaded_record(step, i, t=t) for i in range(num_generators)]
        out.append(_step_record(step, t=t))
        out.append(_learner_metrics_record(t=t))
        out.append(
            _launcher_record(
                step, num_steps=num_steps, groups_per_step=groups_per_step, num_generators=num_generators, t=t
            )
        )
    return out


def _group_records(step: int, g: int, *, groups_per_step: int, num_generators: int, t: float) -> list[dict]:
    """Group `g`'s task record, and every eighth group its generator's metrics."""
    out = [
        {
            "type": "task",
            "task_id": step * groups_per_step + g,
            "generator_id": f"gen-{g % num_generators}",
            "num_trajectories": 8,
            "num_tokens": 32,
            "generate_s": 0.05,
            "mean_reward": 0.5,
            "time_s": t,
        }
    ]
    if g % 8 == 0:
        out.append(
            {
                "type": "metrics",
                "source": f"gen-{g % num_generators}",
                "gen/samples": 8.0 * g,
                "gen/tokens": 32.0 * g,
                "gen/busy_ratio": 0.6,
                "gen/version": float(step),
                "gen/rejected_frames": 0.0,
                "time_s": t,
            }
        )
    return out


def _publish_record(step: int, *, t: float) -> dict:
    return {
        "type": "publish",
        "version": step + 1,
        "transport": "safetensors",
        "location": "w",
        "num_bytes": 1_335_808,
        "publish_s": 0.006,
        "time_s": t,
    }


def _loaded_record(step: int, i: int, *, t: float) -> dict:
    return {
        "type": "loaded",
        "generator_id": f"gen-{i}",
        "version": step + 1,
        "load_s": 0.007,
        "time_s": t + 0.01,
    }


def _step_record(step: int, *, t: float) -> dict:
    stats = {
        "num_valid_tokens": 1000.0,
        "masked_fraction": 0.0,
        "clip_fraction": 0.0,
        "ess_ratio": 1.0,
        "mean_weight": 1.0,
        "max_weight": 1.0,
        "mismatch_k3": 0.1,
        "max_staleness": 2.0,
    }
    return {
        "type": "step",
        "step": step,
        "version": step + 1,
        "num_trajectories": 256,
        "num_tokens": 1000,
        "loss": 0.03,
        "mean_reward": 0.5,
        "max_staleness": 2,
        "mean_staleness": 2.0,
        "clip_fraction": 0.1,
        "grad_norm": 1.0,
        "step_s": 0.3,
        "idle_s": 0.0,
        "lr_scale": 1.0,
        "stats": stats,
        "samples_per_s": 500.0,
        "time_s": t,
    }


def _learner_metrics_record(*, t: float) -> dict:
    return {
        "type": "metrics",
        "source": "learner",
        "learner/idle_ratio": 0.5,
        "learner/duplicates": 0.0,
        "learner/publish_s": 0.006,
        "time_s": t,
    }


def _launcher_record(
    step: int, *, num_steps: int, groups_per_step: int, num_generators: int, t: float
) -> dict:
    return {
        "type": "launcher",
        "phase": "training",
        "total_steps": num_steps,
        "groups_per_step": groups_per_step,
        "samples_per_group": 8,
        "num_generators": num_generators,
        "max_staleness_bound": 2,
        "step": step + 1,
        "groups_in_flight": 12,
        "groups_admitted": (step + 3) * groups_per_step,
        "credits_used": 96,
        "credits_total": 96,
        "credits_free": 0,
        "restarts": 0,
        "time_s": t,
    }


def aggregate_us_per_record(records: list[dict], repeats: int = 5) -> float:
    from asyncrl.monitor.aggregate import RunView

    times = []
    for _ in range(repeats):
        view = RunView()
        t0 = time.perf_counter()
        for r in records:
            view.add(r)
        times.append((time.perf_counter() - t0) / len(records))
    return statistics.median(times) * 1e6


def render_ms_per_frame(records: list[dict], *, width: int, height: int, frames: int = 40) -> float:
    import io

    from rich.console import Console

    from asyncrl.monitor.aggregate import RunView
    from asyncrl.monitor.panels import render_dashboard

    view = RunView()
    for r in records:
        view.add(r)
    console = Console(
        file=io.StringIO(), width=width, height=height, force_terminal=True, color_system="truecolor"
    )
    times = []
    for _ in range(frames):
        t0 = time.perf_counter()
        console.print(render_dashboard(view, width=width, height=height))
        times.append(time.perf_counter() - t0)
        console.file = io.StringIO()
    return statistics.median(times) * 1e3


def _cpu_s() -> float:
    import resource

    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def run_job_once(
    steps: int, out_dir: str, name: str, *, dashboard: bool, width: int, height: int, frame_ms: float
) -> dict:
    import os

    from rich.console import Console

    from asyncrl.config_load import load_config
    from asyncrl.job import run_job
    from asyncrl.monitor.live import Dashboard, PlainReporter

    cfg = load_config(
        None, [f"learner.steps={steps}", "task.num_eval=0", f'run.out_dir="{out_dir}"', f'run.name="{name}"']
    )
    with open(os.devnull, "w") as sink:
        if dashboard:
            console = Console(
                file=sink, width=width, height=height, force_terminal=True, color_system="truecolor"
            )
            reporter = Dashboard(console, refresh_per_second=cfg.monitor.refresh_per_second)
        else:
            reporter = PlainReporter(stream=sink)
        cpu0 = _cpu_s()
        with reporter:
            summary = run_job(cfg, reporter)
        job_cpu = _cpu_s() - cpu0
    row = {
        "dashboard": dashboard,
        "samples_per_s": summary.samples_per_s,
        "train_wall_s": summary.train_wall_s,
        "job_cpu_s": job_cpu,
    }
    if dashboard:
        # Rich draws each frame in its refresh thread: frames drawn x the measured full-frame cost,
        # plus the time spent folding records in (measured in place).
        dash_cpu = reporter.aggregate_s + reporter.num_builds * frame_ms / 1e3
        row.update(frames=reporter.num_builds, dashboard_cpu_s=dash_cpu, dashboard_share=dash_cpu / job_cpu)
    return row


def command(
    job_steps: Annotated[int, typer.Option(help="Steps of the default job for the A/B runs (0 = skip)")] = 60,
    repeats: Annotated[int, typer.Option(help="A/B pairs of the job")] = 1,
    width: Annotated[int, typer.Option(help="Terminal width for rendering")] = 160,
    height: Annotated[int, typer.Option(help="Terminal height for rendering")] = 50,
) -> None:
    """Dashboard cost: per record, per frame, and inside the default job (with vs without)."""
    import tempfile

    from asyncrl.models.hf import quiet_offline

    quiet_offline()
    records = synthetic_records(num_steps=60)
    agg_us = aggregate_us_per_record(records)
    frame_ms = render_ms_per_frame(records, width=width, height=height)
    result: dict = {
        "records": len(records),
        "aggregate_us_per_record": round(agg_us, 2),
        "render_ms_per_frame": round(frame_ms, 3),
        "refresh_per_second": REFRESH_HZ,
        "render_share_of_one_core": round(REFRESH_HZ * frame_ms / 1e3, 4),
    }
    typer.echo(json.dumps(result, indent=2))
    if job_steps <= 0:
        return
    rows = []
    with tempfile.TemporaryDirectory(prefix="asyncrl-bench-monitor-") as tmp:
        for i in range(repeats):
            for dashboard in (False, True):  # alternate so drift (other load) hits both sides
                row = run_job_once(
                    job_steps,
                    tmp,
                    f"{'dash' if dashboard else 'plain'}-{i}",
                    dashboard=dashboard,
                    width=width,
                    height=height,
                    frame_ms=frame_ms,
                )
                rows.append(row)
                typer.echo(json.dumps(row))
    plain = statistics.median(r["samples_per_s"] for r in rows if not r["dashboard"])
    dash = statistics.median(r["samples_per_s"] for r in rows if r["dashboard"])
    share = statistics.median(r["dashboard_share"] for r in rows if r["dashboard"])
    typer.echo(
        json.dumps(
            {
                "job_steps": job_steps,
                "repeats": repeats,
                "samples_per_s_plain_median": round(plain, 1),
                "samples_per_s_dashboard_median": round(dash, 1),
                "throughput_ratio_dashboard_over_plain": round(dash / plain, 4),
                "dashboard_cpu_share_of_job_median": round(share, 5),
                "acceptance_dashboard_share_below_2pct": share < 0.02,
            },
            indent=2,
        )
    )
