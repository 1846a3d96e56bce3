"""`asyncrl monitor RUN_DIR_OR_ENDPOINT`: attach a dashboard to a running job, or replay a finished one.

Place in the data flow: a read-only subscriber at the very end of the metrics stream.
  run directory, run live   -> SUB to the endpoint in <run>/monitor.json, and catch up from
                               <run>/metrics.jsonl: each PUB message carries its line number
                               (`seq`), so records already read are skipped and a gap (slow
                               joiner, HWM drop) is filled from the file;
  run directory, finished   -> replay metrics.jsonl (+ config.json, summary.json): final state;
  tcp://host:port           -> SUB only (records from now on; `launcher` snapshots fill totals).
The monitor never sends anything to the run: its socket is a SUB, and leaving (q, Ctrl-C, or a
crash) just closes it. The launcher's PUB neither blocks nor notices.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import re
import select
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import msgspec
import zmq

from asyncrl.monitor.stream import MONITOR_FILE

log = logging.getLogger(__name__)

ENDPOINT = re.compile(r"^tcp://[^:/\s]+:\d{1,5}$")
POLL_MS = 250  # how long one wait for PUB messages lasts (and how often q is checked)
FILE_CATCHUP_S = 1.0  # with no PUB traffic, look at the file this often anyway
READ_CHUNK_BYTES = 8 << 20  # metrics.jsonl is read this much at a time
# msgspec's JSON decoder: the same dicts as json.loads, several times faster (a replay reads every line)
_decode = msgspec.json.Decoder().decode


@dataclass
class Target:
    run_dir: Path | None
    endpoint: str | None
    live: bool

    @property
    def label(self) -> str:
        where = str(self.run_dir) if self.run_dir is not None else str(self.endpoint)
        return f"asyncrl monitor · {where} · {'live' if self.live else 'replay'}"


def pid_alive(pid: int) -> bool:
    """Whether process `pid` exists (one of another user's counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def resolve_target(arg: str) -> Target:
    """A run directory or a `tcp://host:port` endpoint; ValueError with a clear message otherwise."""
    if "://" in arg:
        if not ENDPOINT.match(arg):
            raise ValueError(
                f"{arg!r} is not a monitor endpoint; expected tcp://HOST:PORT (see <run>/monitor.json)"
            )
        return Target(run_dir=None, endpoint=arg, live=True)
    run_dir = Path(arg)
    if not run_dir.exists():
        raise ValueError(f"{arg}: no such run directory (nor an endpoint like tcp://127.0.0.1:5555)")
    if not run_dir.is_dir():
        raise ValueError(f"{arg} is a file, not a run directory")
    if not (run_dir / "metrics.jsonl").is_file() and not (run_dir / "config.json").is_file():
        raise ValueError(
            f"{arg} is not an asyncrl run directory (no metrics.jsonl or config.json); "
            "pass a directory that `asyncrl launch` created, e.g. runs/<name>"
        )
    info_path = run_dir / MONITOR_FILE
    endpoint, live = None, False
    if info_path.is_file():
        try:
            info = json.loads(info_path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"{info_path} is unreadable ({exc}); replay only: remove it") from None
        endpoint = info.get("endpoint")
        live = bool(info.get("live")) and pid_alive(int(info.get("pid", 0)))
    live = live and not (run_dir / "summary.json").is_file()
    return Target(run_dir=run_dir, endpoint=endpoint, live=live)


def _monitor_policy(target: Target):
    """The socket policy of a subscriber: the process's, or for a run directory whose run uses
    CURVE (cluster.curve), one with the monitor's key from its cluster.keys_dir (docs/multi-host.md)."""
    from asyncrl.transport import security

    policy = security.current()
    config_path = target.run_dir / "config.json" if target.run_dir is not None else None
    if policy.curve is None and config_path is not None and config_path.is_file():
        from asyncrl.config_load import load_resolved_config

        cluster = load_resolved_config(config_path).cluster
        if cluster.curve_enabled:
            # This subscriber's own policy, not installed for the process: a process that follows
            # several runs (a test, a dashboard of many runs) must not carry one run's keys into
            # the next subscription (a later run without CURVE then got no live records).
            policy = security.policy_from_config(cluster, role="monitor")
    return policy


class FileFollower:
    """Reads complete new lines of metrics.jsonl, numbering them from 0 (= the PUB `seq`)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0
        self.num_lines = 0
        self.partial = b""
        self.num_bad = 0
        self.more = False  # the last read stopped at its size limit, not at the end of the file

    def read_new(self, from_seq: int, max_bytes: int = READ_CHUNK_BYTES) -> list[tuple[int, dict]]:
        """New complete lines in the next `max_bytes` of the file (`more`: the file had more);
        only those numbered >= `from_seq` are decoded and returned."""
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read(max_bytes)
        except FileNotFoundError:
            return []
        self.more = len(data) == max_bytes
        self.offset += len(data)
        *complete, self.partial = (self.partial + data).split(b"\n")
        out = []
        for i, line in enumerate(complete, start=self.num_lines):
            if i >= from_seq and line and not line.isspace():
                try:
                    record = _decode(line)
                except msgspec.DecodeError:
                    self.num_bad += 1
                    continue
                if isinstance(record, dict):
                    out.append((i, record))
                else:
                    self.num_bad += 1
        self.num_lines += len(complete)
        return out


class Follower:
    """Feeds records, in order and once each, from the file and the PUB socket to `sink(record)`."""

    def __init__(self, target: Target, sink, zctx: zmq.Context | None = None) -> None:
        self.target = target
        self.sink = sink
        self.next_seq = 0
        self.file = FileFollower(target.run_dir / "metrics.jsonl") if target.run_dir else None
        self.sub = None
        self.num_bad_frames = 0
        self.last_file_read = 0.0
        # Asked between records: once true (the q key), reading stops where it is, so a monitor
        # behind a fast run (folding a backlog, each record waiting for the dashboard's lock while
        # it renders) still detaches at once. Records read and not yet folded wait in `unfolded`.
        self.should_stop: Callable[[], bool] = lambda: False
        self.unfolded: collections.deque[tuple[int, dict]] = collections.deque()
        if target.live and target.endpoint:
            self.ctx = zctx or zmq.Context.instance()
            self.sub = self.ctx.socket(zmq.SUB)
            self.sub.setsockopt(zmq.LINGER, 0)
            self.sub.setsockopt(zmq.SUBSCRIBE, b"")
            policy = _monitor_policy(target)  # CURVE with the monitor key where the run uses it
            policy.apply(self.sub)
            policy.apply_client(self.sub)
            self.sub.connect(target.endpoint)

    def catch_up(self) -> int:
        """What the file held past what was seen when this call began; returns how many records
        were new. Read a piece at a time (a long run's records are folded, not all held at once)
        and only up to the size the file had at the start: a run that writes faster than this
        reads cannot keep the caller (and the q key) waiting."""
        self.last_file_read = time.monotonic()
        if self.file is None:
            return 0
        try:
            end = self.file.path.stat().st_size
        except FileNotFoundError:
            return 0
        num_new = 0
        while True:
            if not self.unfolded:
                self.unfolded.extend(self.file.read_new(self.next_seq))
            while self.unfolded:
                if self.should_stop():  # checked per record: folding one can wait for a render
                    return num_new
                seq, record = self.unfolded.popleft()
                self.sink(record)
                self.next_seq = seq + 1
                num_new += 1
            if not self.file.more or self.file.offset >= end or self.should_stop():
                return num_new

    def on_frames(self, frames: list[bytes]) -> None:
        try:
            if len(frames) != 2:
                raise ValueError(f"expected 2 frames [seq, json], got {len(frames)}")
            seq = int(frames[0])
            record = json.loads(frames[1])
            if not isinstance(record, dict):
                raise ValueError("the record is not a JSON object")
        except (ValueError, IndexError) as exc:  # json.JSONDecodeError is a ValueError
            self.num_bad_frames += 1
            log.warning("malformed metrics frame dropped: %s", exc)
            return
        if seq < self.next_seq:
            return  # already read from the file
        if seq > self.next_seq and self.file is not None:
            self.catch_up()  # the file has every line the PUB socket skipped
            if seq < self.next_seq:
                return
        self.sink(record)
        self.next_seq = seq + 1

    def poll(self, timeout_ms: int) -> None:
        """Wait up to `timeout_ms` for records; read the file when the socket is quiet. Takes at
        most `timeout_ms` of frames at a time: a run that publishes faster than this folds them
        must not keep the caller (and the q key) waiting."""
        if self.sub is not None and self.sub.poll(timeout_ms):
            until = time.monotonic() + timeout_ms / 1000
            while time.monotonic() < until and not self.should_stop():
                try:
                    frames = self.sub.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                self.on_frames(frames)
        elif self.sub is None:
            time.sleep(timeout_ms / 1000)  # file-only follow: a poll interval, not a synchronisation
        if time.monotonic() - self.last_file_read >= FILE_CATCHUP_S:
            self.catch_up()

    def close(self) -> None:
        if self.sub is not None:
            self.sub.close(linger=0)
            self.sub = None


class KeyReader:
    """Reads single keys from a terminal stdin in a daemon thread; `q` sets `quit`."""

    def __init__(self) -> None:
        self.quit = threading.Event()
        self.saved = None
        self.thread: threading.Thread | None = None

    def __enter__(self) -> KeyReader:
        if not sys.stdin.isatty():
            return self
        import termios
        import tty

        fd = sys.stdin.fileno()
        self.saved = termios.tcgetattr(fd)
        # Keys without Enter; Ctrl-C still raises KeyboardInterrupt. TCSANOW, not the default
        # TCSAFLUSH, which would discard a key typed while the monitor started.
        tty.setcbreak(fd, termios.TCSANOW)
        self.thread = threading.Thread(target=self._run, args=(fd,), name="monitor-keys", daemon=True)
        self.thread.start()
        return self

    def _run(self, fd: int) -> None:
        while not self.quit.is_set():
            ready, _, _ = select.select([fd], [], [], 0.2)
            if ready and os.read(fd, 1) in (b"q", b"Q"):
                self.quit.set()

    def __exit__(self, *exc) -> None:
        self.quit.set()
        if self.thread is not None:
            self.thread.join(timeout=1.0)
        if self.saved is not None:
            import termios

            termios.tcsetattr(sys.stdin.fileno(), termios.TCSADRAIN, self.saved)


def _load_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def run_monitor(arg: str, *, once: bool = False, console=None) -> int:
    """The `asyncrl monitor` command. Returns the exit code (0: detached or replayed)."""
    from rich.console import Console

    from asyncrl.monitor.live import Dashboard

    target = resolve_target(arg)
    console = console or Console()
    once = once or not console.is_terminal
    dash = Dashboard(console, title=target.label)
    if target.run_dir is not None and (config := _load_json(target.run_dir / "config.json")):
        dash.apply(lambda v: v.apply_config(config))
    follower = Follower(target, dash.on_record)
    summary_path = target.run_dir / "summary.json" if target.run_dir else None
    try:
        follower.catch_up()
        if once or not target.live:
            if summary_path is not None and (summary := _load_json(summary_path)):
                dash.apply(lambda v: v.apply_summary(summary))
            if once:
                dash.print_once()
                return 0
        with KeyReader() as keys, dash:
            follower.should_stop = keys.quit.is_set
            summary_seen = False
            while not keys.quit.is_set():
                follower.poll(POLL_MS)
                if dash.view.final and not summary_seen and summary_path is not None:
                    if summary := _load_json(summary_path):
                        dash.apply(lambda v: v.apply_summary(summary))
                        summary_seen = True
    except KeyboardInterrupt:
        pass
    finally:
        follower.close()
    return 0
