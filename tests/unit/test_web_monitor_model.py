"""The web monitor's pure parts: bounded series, the timeline, what a run's page state holds
(hand-written records, the launcher's record types and #34's `eval` records), and who may read it."""

from __future__ import annotations

import math

import pytest

from asyncrl.monitor.web.access import Access, is_loopback, read_token_file
from asyncrl.monitor.web.model import WebRun
from asyncrl.monitor.web.series import Buckets, Lanes


def test_buckets_stay_bounded_and_keep_the_mean_min_and_max_of_every_point():
    b = Buckets(capacity=8)
    ys = [float(i % 7) for i in range(1000)]
    ys[500] = 1e6  # a spike must survive the merging
    for i, y in enumerate(ys):
        b.add(i, y)
    points = b.points()
    assert len(points) <= 8 + 1  # full buckets below capacity, plus a partial one
    assert b.count == 1000
    assert points[-1][0] == 999  # a bucket's x is its last point's
    assert max(p[3] for p in points) == 1e6
    assert min(p[2] for p in points) == 0.0
    # the buckets' means, weighted by their sizes, are the mean of every point
    sizes = []
    prev = -1
    for p in points:
        sizes.append(p[0] - prev)
        prev = p[0]
    total = sum(mean * n for (_, mean, _, _), n in zip(points, sizes, strict=True))
    assert total == pytest.approx(sum(ys), rel=1e-4)


def test_buckets_skip_nan_and_keep_every_point_while_under_capacity():
    b = Buckets(capacity=512)
    for i in range(5):
        b.add(i, math.nan if i == 2 else float(i))
    assert b.points() == [[0, 0, 0, 0], [1, 1, 1, 1], [3, 3, 3, 3], [4, 4, 4, 4]]
    with pytest.raises(ValueError, match="even number"):
        Buckets(capacity=3)


def test_lanes_merge_touching_spans_and_keep_only_the_window():
    lanes = Lanes(window_s=10.0)
    lanes.add("gen-0", 0.0, 1.0, "decoding")
    lanes.add("gen-0", 0.5, 2.0, "decoding")  # overlaps: one span 0..2
    lanes.add("gen-0", 2.0, 2.1, "loading")
    lanes.add("gen-0", 3.0, 4.0, "decoding")  # a gap: idle, a new span
    lanes.add("learner", 1.0, 1.5, "training")
    view = lanes.view()
    gen = next(lane for lane in view["lanes"] if lane["name"] == "gen-0")
    assert gen["spans"] == [[0.0, 2.0, "decoding"], [2.0, 2.1, "loading"], [3.0, 4.0, "decoding"]]
    assert [lane["name"] for lane in view["lanes"]] == ["learner", "gen-0"]  # the learner first
    lanes.add("gen-0", 20.0, 21.0, "decoding")  # 21 - 10 = 11: everything before is out
    view = lanes.view()
    assert view["t0"] == 11.0 and view["t1"] == 21.0
    assert next(lane for lane in view["lanes"] if lane["name"] == "gen-0")["spans"] == [
        [20.0, 21.0, "decoding"]
    ]


def step_records(s: int) -> list[dict]:
    """Step `s` of the run below: its group's TaskDone, its StepDone, the publish and the load."""
    t = 2.0 + s
    step = dict(type="step", step=s, version=s + 1, num_trajectories=2, num_tokens=9, loss=0.1)
    step.update(mean_reward=0.5 + 0.1 * s, max_staleness=min(s, 1), mean_staleness=0.5, clip_fraction=0.0)
    step.update(grad_norm=1.0, step_s=0.3, idle_s=0.1, stats={}, rewards={"exact": 0.4 + s * 0.1})
    step.update(lengths={"generated": 5.0, "trained": 4.5, "evicted": None})
    step.update(length_samples={"generated": 2, "trained": 2, "evicted": 0})
    step.update(staleness_bound=1 if s < 2 else 2, skipped_nonfinite=s == 1, time_s=t)
    quantiles = {"q10": 0.1 * s, "q25": 0.25, "q50": 0.5, "q75": 0.75, "q90": 0.9}
    step.update(pass_rate_quantiles=quantiles, degenerate_fraction=None if s == 1 else 0.5 / (s + 1))
    task = dict(type="task", task_id=s, generator_id="gen-0", num_trajectories=2, num_tokens=10)
    task.update(generate_s=0.5, mean_reward=0.5, time_s=t - 0.2)
    publish = dict(
        type="publish", version=s + 1, num_bytes=2**20, publish_s=0.02, transport="shards", time_s=t
    )
    loaded = dict(type="loaded", generator_id="gen-0", version=s + 1, load_s=0.05, time_s=t + 0.1)
    return [task, step, publish, loaded]


def held_out_event(phase: str, accuracy: float, t: float) -> dict:
    text = f"held-out accuracy {phase} training: {accuracy:.3f}"
    return dict(
        type="event", text=text, time_s=t, held_out={"phase": phase, "accuracy": accuracy, "rewards": {}}
    )


def records() -> list[dict]:
    """A short run as the launcher writes it: snapshot, tasks, steps, publishes, loads, events,
    and a periodic evaluation (#34's `eval` record)."""
    launcher = dict(type="launcher", phase="training", mode="async", policy="none", total_steps=3)
    launcher.update(groups_per_step=1, samples_per_group=2, num_generators=1, max_staleness_bound=1)
    launcher.update(step=0, time_s=1.0)
    evaluation = dict(type="eval", version=2, accuracy=0.5, rewards={"exact": 0.5}, n=100, time_s=4.5)
    evaluation["pass_at_k"] = {"1": 0.5, "4": 0.75}
    return [
        launcher,
        held_out_event("before", 0.25, 1.1),
        *(r for s in range(3) for r in step_records(s)),
        evaluation,
        held_out_event("after", 0.6, 4.6),
    ]


def test_page_state_holds_what_the_records_say():
    run = WebRun("r", live=True)
    for record in records():
        run.add(record)
    state = run.state()
    head = state["head"]
    assert head["step"] == 3 and head["total_steps"] == 3 and head["trained"] == 6
    assert head["eval_before"] == 0.25 and head["eval_after"] == 0.6
    series = state["series"]
    # trained samples/s between steps: 2 samples in 1 s; tokens: 10 generated between two steps
    assert [p[1] for p in series["samples_per_s"]] == [2.0, 2.0]
    assert [p[1] for p in series["tokens_per_s"]] == [10.0, 10.0]
    assert [p[1] for p in series["reward"]] == [0.5, 0.6, 0.7]
    assert [p[1] for p in series["reward/exact"]] == [0.4, 0.5, 0.6]
    assert [p[1] for p in series["length/trained"]] == [4.5, 4.5, 4.5]
    assert "length/evicted" not in series or series["length/evicted"] == []  # None: not a point
    assert [p[1] for p in series["sync/publish_ms"]] == [20.0, 20.0, 20.0]
    # the per-prompt record: each quantile over steps; a step with no group observed (None) skipped
    assert [p[:2] for p in series["pass_rate/q10"]] == [[0, 0.0], [1, 0.1], [2, 0.2]]
    assert {k for k in series if k.startswith("pass_rate/")} == {
        f"pass_rate/q{q}" for q in (10, 25, 50, 75, 90)
    }
    assert [p[:2] for p in series["degenerate_fraction"]] == [[0, 0.5], [2, 0.16667]]
    assert [p[1] for p in series["sync/load_ms"]] == [50.0, 50.0, 50.0]
    # the bound moved from 1 to 2 at step 2: one decision marked
    assert state["staleness"]["decisions"] == [[2, 1, 2]]
    assert state["staleness"]["counts"] == {"0": 1, "1": 2}
    assert state["evals"] == [
        {
            "version": 2,
            "accuracy": 0.5,
            "rewards": {"exact": 0.5},
            "pass_at_k": {"1": 0.5, "4": 0.75},
            "n": 100,
        }
    ]
    kinds = [e[1] for e in state["events"]]
    assert "skipped" in kinds  # the non-finite step of step 1
    lanes = {lane["name"]: lane["spans"] for lane in state["timeline"]["lanes"]}
    assert set(lanes) == {"learner", "publish", "gen-0"}
    # step 0 ended at 2.0 after 0.1 s waiting and 0.3 s training
    assert lanes["learner"][:2] == [[1.6, 1.7, "waiting"], [1.7, 2.0, "training"]]
    assert [1.3, 1.8, "decoding"] in lanes["gen-0"] and [2.05, 2.1, "loading"] in lanes["gen-0"]


def test_access_rules():
    assert is_loopback("127.0.0.1") and is_loopback("localhost:8750") and is_loopback("[::1]:80")
    assert not is_loopback("0.0.0.0") and not is_loopback("example.com") and not is_loopback("10.1.2.3:8750")
    loop, made_up = Access.for_bind("127.0.0.1", None)
    assert loop.token is None and not made_up
    assert loop.check(host_header="127.0.0.1:8750", presented=[]) is None
    assert loop.check(host_header="evil.example:8750", presented=[])[0] == 403  # DNS rebinding
    wide, made_up = Access.for_bind("0.0.0.0", None)
    assert made_up and wide.token and len(wide.token) >= 16
    assert wide.check(host_header="10.0.0.5:8750", presented=["", ""])[0] == 401
    assert wide.check(host_header="10.0.0.5:8750", presented=["nope"])[0] == 403
    assert wide.check(host_header="10.0.0.5:8750", presented=["", wide.token]) is None


def test_token_file_errors_name_the_fix(tmp_path):
    with pytest.raises(ValueError, match="no such file"):
        read_token_file(tmp_path / "missing")
    short = tmp_path / "short"
    short.write_text("abc\n")
    with pytest.raises(ValueError, match="at least 16"):
        read_token_file(short)
    good = tmp_path / "good"
    good.write_text("0123456789abcdef0123\n")
    access, made_up = Access.for_bind("0.0.0.0", good)
    assert access.token == "0123456789abcdef0123" and not made_up


class FakeReporter:
    """Stands in for the launch's terminal reporter: what it is told."""

    def __init__(self, takes_records: bool) -> None:
        self.events: list[str] = []
        self.records: list[dict] = []
        if takes_records:
            self.on_record = self.records.append

    def event(self, text: str) -> None:
        self.events.append(text)

    def update(self, state) -> None:
        pass


def test_launch_reporter_folds_records_and_hands_everything_on():
    """`launch --web` wraps the terminal reporter: it must still see every event (plain lines)
    or every record (the dashboard), as without --web."""
    from asyncrl.monitor.web.command import WebReporter

    for takes_records in (False, True):
        inner = FakeReporter(takes_records)
        web = WebReporter(
            inner, label="x", config={"learner": {"steps": 3}}, host="127.0.0.1", port=0, token_file=None
        )
        web.event("run directory: runs/x")  # told before the records begin
        for record in records():
            web.on_record(record)
        state = web.source.run.state()
        assert state["head"]["step"] == 3 and state["head"]["total_steps"] == 3
        assert state["events"][0] == [0.0, "launch", "run directory: runs/x"]
        if takes_records:
            assert inner.records == records() and inner.events == ["run directory: runs/x"]
        else:
            texts = [r["text"] for r in records() if r["type"] == "event"]
            assert inner.events == ["run directory: runs/x", *texts]


def test_refusals_and_lint_warnings_are_events():
    run = WebRun("r", live=False)
    run.add({"type": "rejected", "socket": "ctrl", "num_rejected": 3, "time_s": 2.0})
    run.add({"type": "refused", "num_refused": 1, "by_reason": {"unknown key": 1}, "time_s": 2.5})
    lint = {"rule": "r1", "level": "warning", "key": "learner.epochs", "problem": "stale", "fix": "set x"}
    run.apply_summary({"status": "completed", "lint": [lint]})
    state = run.state()
    assert state["events"] == [
        [2.0, "rejected", "ctrl: 3 frames rejected so far"],
        [2.5, "refused", "1 peers refused at the handshake ({'unknown key': 1})"],
    ]
    assert state["lint"] == ["warning [r1] at learner.epochs: stale; set x"]
    assert state["head"]["status"] == "completed" and not state["live"]


def test_a_crowded_timeline_is_sent_as_one_span_per_slice_at_most():
    """Thousands of spans in the window: each slice (about a pixel) shows what took most of it."""
    from asyncrl.monitor.web.series import VIEW_BINS

    lanes = Lanes(window_s=100.0)
    for i in range(2000):  # 0.05 s steps: 0.04 s training, 0.01 s waiting
        t = i * 0.05
        lanes.add("learner", t, t + 0.01, "waiting")
        lanes.add("learner", t + 0.01, t + 0.05, "training")
        lanes.add("gen-0", t, t + 0.005, "loading")  # busy a tenth of the time: idle at this scale
        lanes.add("publish", t + 0.049, t + 0.05, "publish")  # moments: always shown
    view = {lane["name"]: lane["spans"] for lane in lanes.view()["lanes"]}
    assert view["learner"] == [[0.0, 100.0, "training"]]
    assert view["gen-0"] == []
    assert view["publish"] == [[0.0, 100.0, "publish"]]
    lanes.add("gen-0", 100.0, 150.0, "decoding")  # the window moves on: 50..150
    view = {lane["name"]: lane["spans"] for lane in lanes.view()["lanes"]}
    assert view["gen-0"][-1] == [100.0, 150.0, "decoding"] and len(view["learner"]) <= VIEW_BINS
