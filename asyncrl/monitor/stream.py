"""The launcher side of the metrics stream: one PUB socket and the in-process sinks.

Place in the data flow. Workers never talk to a monitor: they send typed `Metrics`, `StepDone`,
`TasksDone` (a `TaskDone` per group), `WeightsPublished` and `WeightsLoaded` messages to the
launcher over the existing control channel (that is the aggregation path: one ordered stream, no
extra sockets per worker). The scheduler turns each into one record (`scheduler/records.py`),
appends it to `<run>/metrics.jsonl`, and hands it to `MonitorHub.publish`, which
  - sends it on a PUB socket bound on cluster.bind_host (address in `<run>/monitor.json`) as two frames
    `[seq, json]`; `seq` is the record's 0-based line number in metrics.jsonl, so a subscriber
    that misses records (slow joiner, HWM drop) fills the gap from the file;
  - passes it to in-process sinks: the `asyncrl launch` dashboard, and TensorBoard / wandb
    (offline) when `monitor.sinks` asks for them.
The scheduler also writes its log lines as `event` records and throttled `launcher` records (a
`LauncherSnapshot`: phase, admission credits, in-flight groups, restarts, failure); this is what
lets a monitor that attaches later, or replays the file, show the same panels. The hub is a pure
consumer: it knows records, not the launcher, and the app layer (`asyncrl/job.py`) opens it for
the launcher with `open_hub`.

Delivery: PUB never blocks the launcher; a subscriber that cannot keep up loses messages past
the send HWM (and repairs the gap from metrics.jsonl). Detaching a subscriber changes nothing
for the run.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import zmq

from asyncrl.monitor.sinks import make_sinks
from asyncrl.transport import security

if TYPE_CHECKING:
    from asyncrl.config import Config

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
    """Fans every record out to the PUB socket and the in-process sinks (a scheduler
    `RecordStream`). With `run_dir`, closing it marks `<run>/monitor.json` as no longer live."""

    def __init__(
        self,
        *,
        pub: zmq.Socket | None,
        sinks: list[RecordSink],
        external_sinks: list | None = None,
        first_seq: int = 0,
        run_dir: Path | None = None,
        endpoint: str | None = None,
        feeds_reporter: bool = False,
    ) -> None:
        self.pub = pub
        self.sinks = list(sinks)
        self.external_sinks = list(external_sinks or [])
        self.seq = first_seq
        self.num_dropped = 0
        self.closed = False
        self.run_dir = run_dir
        self.endpoint = endpoint
        # The run's reporter is one of `sinks`: it sees events as records (the scheduler does not
        # tell it twice).
        self.feeds_reporter = feeds_reporter

    def publish(self, record: dict, line: str) -> None:
        """Called by the scheduler's records after the line is in metrics.jsonl."""
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
        if self.endpoint is not None and self.run_dir is not None:
            write_monitor_file(
                self.run_dir,
                {"endpoint": self.endpoint, "pid": os.getpid(), "protocol": STREAM_PROTOCOL, "live": False},
            )


def open_hub(zctx: zmq.Context, *, run_dir: Path, config: Config, reporter: Any = None) -> MonitorHub:
    """Set up the stream for one run, on the launcher's zmq.Context (`config` is the run's whole
    config; `reporter`, when it takes records (`on_record`), becomes one of the sinks).

    The PUB socket is a plain (blocking-API) socket, so `publish` sends without awaiting."""
    cfg = config.monitor
    pub = endpoint = None
    if cfg.stream:
        pub = zctx.socket(zmq.PUB)
        pub.setsockopt(zmq.SNDHWM, SEND_HWM)
        pub.setsockopt(zmq.LINGER, 0)  # undelivered records are in metrics.jsonl anyway
        policy = security.current()  # cluster.bind_host, and CURVE (subscribers need the monitor key)
        policy.apply(pub)
        policy.apply_server(pub)
        port = pub.bind_to_random_port(policy.bind_url)
        endpoint = policy.endpoint(port)
    first_seq = count_lines(run_dir / "metrics.jsonl")
    feeds_reporter = hasattr(reporter, "on_record")
    hub = MonitorHub(
        pub=pub,
        sinks=[reporter] if feeds_reporter else [],
        external_sinks=make_sinks(cfg.sinks, run_dir, config),
        first_seq=first_seq,
        run_dir=run_dir,
        endpoint=endpoint,
        feeds_reporter=feeds_reporter,
    )
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
    return hub
