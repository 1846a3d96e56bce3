"""The dashboard driven by recorded metrics: each panel shows the right figures (rich capture)."""

from __future__ import annotations

import io

from rich.console import Console

from asyncrl.monitor.aggregate import RunView
from asyncrl.monitor.live import Dashboard
from asyncrl.monitor.panels import render_dashboard


def recorded_run() -> list[dict]:
    """Two learner steps of a run with 2 generators, as the launcher writes them."""
    launcher = {
        "type": "launcher",
        "phase": "training",
        "mode": "async",
        "policy": "tis",
        "total_steps": 4,
        "groups_per_step": 2,
        "samples_per_group": 4,
        "num_generators": 2,
        "max_staleness_bound": 2,
        "step": 0,
        "groups_admitted": 6,
        "groups_in_flight": 3,
        "credits_used": 5,
        "credits_total": 6,
        "credits_free": 1,
        "restarts": None,
        "failure": None,
        "time_s": 0.0,
    }
    task = {"type": "task", "num_trajectories": 4, "generate_s": 0.1, "mean_reward": 0.5}
    stats = {"ess_ratio": 0.9, "masked_fraction": 0.125, "mismatch_k3": 0.0625, "max_staleness": 1.0}
    step = {"type": "step", "num_trajectories": 8, "num_tokens": 30, "clip_fraction": 0.125}
    step.update(grad_norm=0.5, step_s=0.2, idle_s=0.0, lr_scale=1.0, stats=stats)
    return [
        launcher,
        {**task, "task_id": 0, "generator_id": "gen-0", "num_tokens": 10, "time_s": 0.5},
        {**task, "task_id": 1, "generator_id": "gen-1", "num_tokens": 20, "time_s": 0.6},
        {**task, "task_id": 2, "generator_id": "gen-0", "num_tokens": 10, "time_s": 0.9},
        {
            **step,
            "step": 0,
            "version": 1,
            "loss": 0.25,
            "mean_reward": 0.5,
            "max_staleness": 0,
            "mean_staleness": 0.0,
            "time_s": 1.0,
        },
        {
            "type": "publish",
            "version": 1,
            "transport": "safetensors",
            "location": "w",
            "num_bytes": 2 << 20,
            "publish_s": 0.01,
            "time_s": 1.0,
        },
        {"type": "loaded", "generator_id": "gen-0", "version": 1, "load_s": 0.02, "time_s": 1.03},
        {"type": "loaded", "generator_id": "gen-1", "version": 1, "load_s": 0.04, "time_s": 1.05},
        {
            "type": "metrics",
            "source": "learner",
            "learner/idle_ratio": 0.25,
            "learner/duplicates": 0.0,
            "learner/rejected_frames": 2.0,
            "time_s": 1.0,
        },
        {"type": "metrics", "source": "gen-0", "gen/busy_ratio": 0.6, "gen/version": 1.0, "time_s": 1.1},
        {**task, "task_id": 3, "generator_id": "gen-1", "num_tokens": 20, "time_s": 1.5},
        {
            **step,
            "step": 1,
            "version": 2,
            "loss": -0.5,
            "mean_reward": 0.75,
            "max_staleness": 1,
            "mean_staleness": 0.5,
            "time_s": 2.0,
            "pass_rate_quantiles": {"q10": 0.2, "q25": 0.3, "q50": 0.5, "q75": 0.7, "q90": 0.85},
            "degenerate_fraction": 0.25,
        },
        {"type": "event", "text": "started gen-1 (pid 42)", "time_s": 0.2},
    ]


def screen(view: RunView, width: int = 90, height: int = 120) -> str:
    console = Console(width=width, height=height, record=True, file=io.StringIO())
    console.print(render_dashboard(view, width=width, height=height))
    return console.export_text()


def squeeze(text: str) -> str:
    return " ".join(text.split())


def view_of(records: list[dict]) -> RunView:
    view = RunView()
    for r in records:
        view.add(r)
    return view


def test_every_panel_shows_the_recorded_figures():
    text = squeeze(screen(view_of(recorded_run())))
    # progress: steps, samples, ETA from the step interval (1 s per step, 2 steps left)
    assert "step 2/4" in text and "policy_version 2" in text
    assert "samples 16 trained / 32" in text
    assert "elapsed 0:02 ETA 0:02" in text
    assert "(async, policy tis)" in text
    # throughput: 16 trained / 2 s; 60 tokens / 2 s; per generator 8 samples and 20 or 40 tokens
    assert "samples/s 8.0 trained (last steps 8.0)" in text
    assert "tokens/s 30.0 generated" in text
    assert "gen-0 4.0 samples/s 10.0 tokens/s v1" in text
    assert "gen-1 4.0 samples/s 20.0 tokens/s v1" in text
    # reward trend
    assert "reward 0.750 (mean last 2: 0.625)" in text
    # the per-prompt record, from the last step record
    assert "pass rates q10 0.20 q50 0.50 q90 0.85" in text
    assert "degenerate 0.25 of the step's groups" in text
    # staleness: histogram of steps by max staleness (one at 0, one at 1), bound 2
    assert "max 1 (bound 2) mean 0.50" in text
    assert "(steps by max staleness)" in text
    assert "0 ██████████████████████████████ 1" in text.replace("·", "")
    # pipeline and admission credits, from the launcher snapshot
    assert "in flight 3 groups admitted 6" in text
    assert "credits 5/6 used 1 free" in text
    # weight sync: publish 10 ms; loads 20 and 40 ms; announce -> last generator loaded 50 ms
    assert "safetensors 1 versions, 2.00 MiB each" in text
    assert "publish median 10.0 ms" in text
    assert "load median 30.0 ms last 40.0 ms" in text
    assert "announce→loaded median 50.0 ms" in text
    # idle ratios: learner reported 0.25; gen-0 busy 0.6 -> 40 % idle
    assert "25% idle" in text and "40% idle" in text
    # loss and staleness-policy diagnostics, whatever keys StepDone.stats carries
    assert "loss -0.5000" in text and "loss clip fraction 0.1250" in text
    assert "ess_ratio 0.9" in text and "masked_fraction 0.125" in text and "mismatch_k3 0.0625" in text
    # health: no restart data -> dash; learner's rejected frames counted; the event listed
    assert "restarts -" in text
    assert "learner:learner/rejected_frames 2" in text
    assert "started gen-1 (pid 42)" in text


def test_panels_without_data_show_a_dash_not_zero():
    text = squeeze(screen(view_of(recorded_run())))
    assert "freshness -" in text
    assert "buffer depth -" in text
    empty = squeeze(screen(RunView()))
    for label in (
        "reward -",
        "loss -",
        "weight sync -",
        "idle ratio -",
        "histogram -",
        "credits -",
        "restarts -",
    ):
        assert label in empty, label
    assert "in flight - groups admitted -" in empty


def test_panels_light_up_when_components_add_metrics():
    records = recorded_run() + [
        {
            "type": "metrics",
            "source": "learner",
            "buffer/depth": 17.0,
            "freshness/mean": 0.82,
            "freshness_hist/0.9-1.0": 5.0,
            "staleness_hist/0": 3.0,
            "staleness_hist/2": 9.0,
            "time_s": 2.1,
        },
        {
            "type": "launcher",
            "phase": "training",
            "restarts": 2,
            "failure": "gen-1 exited with code 9",
            "time_s": 2.2,
        },
    ]
    text = squeeze(screen(view_of(records)).replace("·", ""))
    assert "depth 17" in text and "buffer/depth" not in text  # the key without its prefix
    assert "freshness/mean 0.820" in text and "0.9-1.0" in text
    # a reported staleness histogram replaces the per-step fallback
    assert "(samples)" in text and "2 ██████████████████████████████ 9" in text
    assert "restarts 2" in text
    assert "failure gen-1 exited with code 9" in text


def test_restart_records_from_supervision_count_restarts_not_errors():
    restart = {
        "type": "restart",
        "slot": 1,
        "peer_id": "gen-1",
        "new_peer_id": "gen-1.r1",
        "reason": "gen-1 exited with code 9",
        "generator_restarts": 1,
        "time_s": 2.15,
    }
    view = view_of(recorded_run() + [restart])
    text = squeeze(screen(view))
    assert view.restarts == 1 and view.num_error_records == 0
    assert "restarts 1" in text and "restart: gen-1 exited with code 9" in text


def test_layout_adapts_to_the_terminal():
    view = view_of(recorded_run())
    wide = screen(view, width=160, height=50)
    narrow = screen(view, width=90, height=120)
    titles = (
        "progress",
        "throughput",
        "reward",
        "staleness",
        "freshness",
        "pipeline",
        "weight sync",
        "idle",
        "loss & policy",
        "health",
    )
    for text in (wide, narrow):
        assert all(f"─ {t} ─" in text for t in titles)
    # three panels side by side on a wide terminal, one per row on a narrow one
    assert any(line.count("╭─") == 3 for line in wide.splitlines())
    assert max(line.count("╭─") for line in narrow.splitlines()) == 1
    for width, text in ((160, wide), (90, narrow)):
        assert max(len(line) for line in text.splitlines()) <= width
    # a short terminal lists fewer diagnostics rows (5 of 10 here; a tall one all 10)
    many = {**recorded_run()[-2], "step": 2, "stats": {f"k{i}": float(i) for i in range(10)}}
    view.add(many)
    short = squeeze(screen(view, width=90, height=30))
    assert "k4 4" in short and "k5 5" not in short and "... 5 more" in short
    assert "k9 9" in squeeze(screen(view, width=90, height=120))


def test_dashboard_is_a_record_sink_and_a_reporter():
    console = Console(width=90, height=120, record=True, file=io.StringIO())
    dash = Dashboard(console)
    dash.event("run directory: runs/x")  # before the stream opens: straight to the view
    for r in recorded_run():
        dash.on_record(r)
    dash.print_once()
    text = squeeze(console.export_text())
    assert "run directory: runs/x" in text and "step 2/4" in text
    assert dash.view.num_records == len(recorded_run())


def test_replayed_summary_sets_status_and_held_out_accuracy():
    view = view_of(recorded_run())
    view.apply_summary({"status": "completed", "eval_before": 0.18, "eval_after": 0.93, "error": None})
    text = squeeze(screen(view))
    assert "status completed" in text
    assert "held-out acc before 0.180 after 0.930" in text
    assert "ETA -" in text  # a finished run has no ETA


def test_rates_count_from_the_start_of_training_on_the_launch_clock():
    # Records carry seconds since launch; start-up (8 s here) is not part of training.
    view = view_of(
        [
            {"type": "event", "time_s": 1.0, "text": "started learner"},
            {"type": "launcher", "time_s": 8.0, "phase": "training"},
            {"type": "step", "time_s": 10.0, "step": 0, "num_trajectories": 100},
        ]
    )
    assert view.elapsed_s() == 2.0
    assert view.samples_per_s() == 50.0
    # A run recorded with the older clock (restarted at 0 when training began) reads the same.
    old = view_of(
        [
            {"type": "event", "time_s": 7.5, "text": "started learner"},
            {"type": "launcher", "time_s": 0.0, "phase": "training"},
            {"type": "step", "time_s": 2.0, "step": 0, "num_trajectories": 100},
        ]
    )
    assert old.elapsed_s() == 2.0 and old.samples_per_s() == 50.0


def test_pool_mode_drops_show_as_events():
    view = view_of(
        [
            {"type": "left", "version": 3, "released": [4, 5], "evicted": {}, "time_s": 1.0},
            {
                "type": "left",
                "version": 4,
                "released": [6, 7],
                "evicted": {"freshness": [6, 7]},
                "time_s": 2.5,
            },
        ]
    )
    assert list(view.events) == ["    2.5s  buffer dropped groups: 2 (freshness)"]
    assert view.num_unknown == 0
