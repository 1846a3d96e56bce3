"""The launcher side of the metrics stream: one PUB socket, in-process sinks, launcher snapshots.

Place in the data flow. Children never talk to a monitor: they send typed `Metrics`, `StepDone`,
`TasksDone` (a `TaskDone` per group), `WeightsPublished` and `WeightsLoaded` messages to the
launcher over the existing control channel (that is the aggregation path: one ordered stream, no
extra sockets per child).
The launcher turns each into one record in `Launcher.write_record`, appends it to
`<run>/metrics.jsonl`, and hands it to `MonitorHub.publish`, which
  - sends it on a PUB socket bound on 127.0.0.1 (address in `<run>/monitor.json`) as two frames
    `[seq, json]`; `seq` is the record's 0-based line number in metrics.jsonl, so a subscriber
    that misses records (slow joiner, HWM drop) fills the gap from the file;
  - passes it to in-process sinks: the `asyncrl launch` dashboard, and TensorBoard / wandb
    (offline) when `monitor.sinks` asks for them.
The hub also wraps the launcher's reporter so that events (text lines) and periodic `launcher`
snapshots (phase, admission credits, in-flight groups, restarts, failure) become records too;
this is what lets a monitor that attaches later, or replays the file, show the same panels.

Delivery: PUB never blocks the launcher; a subscriber that cannot keep up loses messages past
the send HWM (and repairs the gap from metrics.jsonl). Detaching a subscriber changes nothing
for the run.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import zmq

from asyncrl.monitor.sinks import make_sinks

if TYPE_CHECKING:
    from asyncrl.scheduler.service import Launcher, RunState

log = logging.getLogger(__name__)

MONITOR_FILE = "monitor.json"
STREAM_PROTOCOL = 1
# Records queued per subscriber before PUB drops them (the subscriber then reads the file).
SEND_HWM = 10_000


class RecordSink(Protocol):
    def on_record(self, record: dict) -> None: ...


def count_lines(path: Path) -> int:
    """Complete lines already in `path` (a resumed run appends to its metrics.jsonl)."""
    if not path.is_file():
        return 0
    with open(path, "rb") as f:
        return sum(chunk.count(b"\n") for chunk in iter(lambda: f.read(1 << 20), b""))


def write_monitor_file(run_dir: Path, info: dict) -> None:
    """Atomic: a monitor never reads a half-written monitor.json."""
    tmp = run_dir / f".{MONITOR_FILE}.tmp"
    tmp.write_text(json.dumps(info, indent=2) + "\n")
    os.replace(tmp, run_dir / MONITOR_FILE)


class MonitorHub:
    """Fans every record out to the PUB socket and the in-process sinks."""

    def __init__(
        self,
        *,
        pub: zmq.Socket | None,
        sinks: list[RecordSink],
        external_sinks: list | None = None,
        first_seq: int = 0,
    ) -> None:
        self.pub = pub
        self.sinks = list(sinks)
        self.external_sinks = list(external_sinks or [])
        self.seq = first_seq
        self.num_dropped = 0
        self.closed = False

    def publish(self, record: dict, line: str) -> None:
        """Called by `Launcher.write_record` after the line is in metrics.jsonl."""
        seq = self.seq
        self.seq += 1
        if self.pub is not None:
            try:
                self.pub.send_multipart([str(seq).encode(), line.encode()], flags=zmq.NOBLOCK)
            except zmq.Again:  # PUB drops rather than blocks; counted for the curious
                self.num_dropped += 1
        for sink in self.sinks:
            sink.on_record(record)
        for sink in list(self.external_sinks):
            try:
                sink.on_record(record)
            except Exception as exc:  # noqa: BLE001 - a third-party logger must not stop training
                log.warning("monitor sink %s failed and is disabled: %s", type(sink).__name__, exc)
                self.external_sinks.remove(sink)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for sink in self.external_sinks:
            sink.close()
        if self.pub is not None:
            self.pub.close(linger=0)


def launcher_snapshot(launcher: Launcher, *, final: bool = False) -> dict:
    """What only the launcher knows, as one record: run shape, phase, admission, health."""
    from asyncrl.scheduler.admission import admission_limit

    cfg, st = launcher.cfg, launcher.state
    groups_per_step = cfg.learner.groups_per_step
    bound = cfg.effective_max_staleness
    admitted = launcher.admission.num_admitted
    loaded = min((st.loaded_versions.get(g, 0) for g in launcher.generator_ids), default=0)
    limit = admission_limit(
        loaded_version=loaded,
        groups_per_step=groups_per_step,
        max_staleness=bound,
        total_groups=launcher.admission.total_groups,
    )
    used = max(0, admitted - st.step * groups_per_step)
    if launcher.pool_mode:  # credits come back as groups leave the buffer (CreditAdmission)
        used = launcher.admission.outstanding
        limit = admitted + launcher.admission.capacity - used
    restarts = getattr(st, "generator_restarts", None)  # set by supervision when it restarts a generator
    snap = {
        "phase": st.phase,
        "mode": cfg.mode,
        "policy": cfg.staleness.policy,
        "total_steps": st.total_steps,
        "groups_per_step": groups_per_step,
        "samples_per_group": cfg.learner.samples_per_group,
        "num_generators": cfg.generators.num_generators,
        "max_staleness_bound": bound,
        "step": st.step,
        "policy_version": st.policy_version,
        "trajectories_generated": st.trajectories_generated,
        "trajectories_trained": st.trajectories_trained,
        "tokens_generated": st.tokens_generated,
        "groups_admitted": st.groups_admitted,
        "groups_in_flight": st.groups_in_flight,
        # Credits: groups admitted but not yet trained, against the staleness bound's window.
        "credits_used": used,
        "credits_total": (bound + 1) * groups_per_step,
        "credits_free": max(0, limit - admitted),
        "restarts": restarts if isinstance(restarts, int) else None,
        "failure": launcher.failure,
    }
    if final:
        snap["final"] = True
        snap["status"] = (
            "failed" if launcher.failure else "interrupted" if launcher.interrupted else "completed"
        )
        snap["phase"] = snap["status"]
    return snap


class ReporterTee:
    """Wraps the launcher's reporter: events become `event` records and state updates become
    throttled `launcher` snapshots. A record-driven reporter (one with `on_record`) gets events
    as records only, so it never shows one twice."""

    def __init__(self, inner, launcher: Launcher, snapshot_s: float) -> None:
        self.inner = inner
        self.launcher = launcher
        self.snapshot_s = snapshot_s
        self.record_driven = hasattr(inner, "on_record")
        self.last_phase: str | None = None
        self.last_snapshot = float("-inf")

    def update(self, state: RunState) -> None:
        self.inner.update(state)
        now = time.monotonic()
        if state.phase != self.last_phase or now - self.last_snapshot >= self.snapshot_s:
            self.snapshot()

    def snapshot(self, *, final: bool = False) -> None:
        self.last_phase = self.launcher.state.phase
        self.last_snapshot = time.monotonic()
        self.launcher.write_record("launcher", launcher_snapshot(self.launcher, final=final))

    def event(self, text: str) -> None:
        if not self.record_driven:
            self.inner.event(text)
        self.launcher.write_record("event", {"text": text})


class LauncherMonitor:
    """What `Launcher.run` holds: the hub (`publish`) and the teardown (`close`)."""

    def __init__(self, launcher: Launcher, hub: MonitorHub, tee: ReporterTee, endpoint: str | None) -> None:
        self.launcher = launcher
        self.hub = hub
        self.tee = tee
        self.endpoint = endpoint

    def publish(self, record: dict, line: str) -> None:
        self.hub.publish(record, line)

    def close(self) -> None:
        """Final snapshot, then restore the reporter and close sockets; idempotent."""
        if self.hub.closed:
            return
        self.tee.snapshot(final=True)
        self.launcher.reporter = self.tee.inner
        self.hub.close()
        if self.endpoint is not None:
            write_monitor_file(
                self.launcher.run_dir,
                {"endpoint": self.endpoint, "pid": os.getpid(), "protocol": STREAM_PROTOCOL, "live": False},
            )


def open_hub(launcher: Launcher, zctx) -> LauncherMonitor:
    """Set up the stream for one run (called once at the start of `Launcher.run`).

    `zctx` is the launcher's zmq.Context; the PUB socket is a plain (blocking-API) socket, so
    `write_record` publishes synchronously without awaiting."""
    cfg = launcher.cfg.monitor
    run_dir = launcher.run_dir
    pub = endpoint = None
    if cfg.stream:
        pub = zctx.socket(zmq.PUB)
        pub.setsockopt(zmq.SNDHWM, SEND_HWM)
        pub.setsockopt(zmq.LINGER, 0)  # undelivered records are in metrics.jsonl anyway
        port = pub.bind_to_random_port("tcp://127.0.0.1")
        endpoint = f"tcp://127.0.0.1:{port}"
    first_seq = count_lines(run_dir / "metrics.jsonl")
    reporter = launcher.reporter
    sinks = [reporter] if hasattr(reporter, "on_record") else []
    hub = MonitorHub(
        pub=pub, sinks=sinks, external_sinks=make_sinks(cfg.sinks, run_dir, launcher.cfg), first_seq=first_seq
    )
    tee = ReporterTee(reporter, launcher, cfg.snapshot_s)
    launcher.reporter = tee
    monitor = LauncherMonitor(launcher, hub, tee, endpoint)
    if endpoint is not None:
        write_monitor_file(
            run_dir,
            {
                "endpoint": endpoint,
                "pid": os.getpid(),
                "protocol": STREAM_PROTOCOL,
                "live": True,
                "first_seq": first_seq,
            },
        )
        log.info("metrics stream on %s (see %s)", endpoint, run_dir / MONITOR_FILE)
    return monitor
