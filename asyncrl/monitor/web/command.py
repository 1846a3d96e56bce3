"""`asyncrl monitor --web TARGET...` and `asyncrl launch --web`: the web monitor's two shells.

Place in the data flow:
  monitor --web   each target (a run directory or tcp://HOST:PORT) gets a `RunSource` and a
                  follower thread: attach.py's `Follower` (metrics.jsonl, then the PUB socket
                  while the run is live), the same one the terminal monitor uses; a finished run
                  is read once, with its config.json and summary.json.
  launch --web    `WebReporter` wraps the launch's reporter: the launcher's hub hands it every
                  record in process (it is the reporter), it folds them into one `RunSource` and
                  passes them on to the terminal dashboard or the plain lines.
Either way server.py serves the page; nothing here can change a run.
"""

from __future__ import annotations

import json
import sys
import threading
from pathlib import Path

from asyncrl.monitor.attach import POLL_MS, Follower, Target, resolve_target
from asyncrl.monitor.web.access import Access
from asyncrl.monitor.web.model import WebRun
from asyncrl.monitor.web.server import RunSource, ServerThread, build_app

DEFAULT_PORT = 8750


def _load_json(path: Path) -> dict | None:
    try:
        value = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return value if isinstance(value, dict) else None


def announce(url: str, access: Access, *, made_up: bool, out=None) -> None:
    """Print where the page is, and the token once when it was made up here."""
    out = out or sys.stderr
    if access.token is not None and made_up:
        print(f"web monitor: {url}?token={access.token}", file=out, flush=True)
        print("  (the token is shown only now; --token-file FILE to choose one)", file=out, flush=True)
    elif access.token is not None:
        print(f"web monitor: {url} (open {url}?token=<the token in your token file>)", file=out, flush=True)
    else:
        print(f"web monitor: {url}", file=out, flush=True)


def last_time_s(path: Path) -> float | None:
    """`time_s` of the last complete record in metrics.jsonl (read from its end), or None."""
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            start = max(0, f.tell() - 65536)
            f.seek(start)
            lines = f.read().split(b"\n")
    except OSError:
        return None
    # The last piece is a torn line or empty; the first one is torn when the read began mid-file.
    for line in reversed(lines[1 if start else 0 : -1]):
        try:
            t = json.loads(line).get("time_s")
        except (ValueError, AttributeError):
            continue
        if isinstance(t, int | float):
            return float(t)
    return None


class RunFollower:
    """A thread feeding one target's records to its source until the run ends or `stop()`."""

    def __init__(self, target: Target, source: RunSource) -> None:
        self.target, self.source = target, source
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, name=f"follow-{source.run.label}", daemon=True)

    def read_past(self) -> None:
        """Everything already recorded (config, records, summary), before the server starts."""
        run_dir = self.target.run_dir
        if run_dir is not None and (config := _load_json(run_dir / "config.json")):
            self.source.apply(lambda run: run.apply_config(config))
        self.follower = Follower(self.target, self.source.add)
        if run_dir is not None and (last := last_time_s(run_dir / "metrics.jsonl")) is not None:
            self.source.apply(lambda run: run.skip_timeline_before(last))
        self.follower.catch_up()
        self._summary()

    def _summary(self) -> bool:
        path = self.target.run_dir / "summary.json" if self.target.run_dir is not None else None
        if path is not None and (summary := _load_json(path)):
            self.source.apply(lambda run: run.apply_summary(summary))
            return True
        return False

    def _run(self) -> None:
        try:
            while self.target.live and not self.stopping.is_set():
                self.follower.poll(POLL_MS)
                if self.source.run.view.final and self._summary():
                    self.follower.catch_up()
                    break
        finally:
            self.follower.close()

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.stopping.set()
        self.thread.join(timeout=2.0)


def run_web(targets: list[str], *, host: str, port: int, token_file: Path | None) -> int:
    """The `asyncrl monitor --web` command: serve until Ctrl-C. ValueError for bad targets."""
    if not targets:
        raise ValueError("name at least one run directory (runs/NAME) or tcp://HOST:PORT endpoint")
    resolved = [resolve_target(t) for t in targets]
    access, made_up = Access.for_bind(host, token_file)
    followers = []
    for arg, target in zip(targets, resolved, strict=True):
        label = target.run_dir.name if target.run_dir is not None else arg
        source = RunSource(WebRun(label, live=target.live))
        follower = RunFollower(target, source)
        follower.read_past()
        followers.append(follower)
    server = ServerThread(build_app([f.source for f in followers], access), host, port)
    url = server.start()
    announce(url, access, made_up=made_up)
    for follower in followers:
        follower.start()
    try:
        threading.Event().wait()  # serve until Ctrl-C
    except KeyboardInterrupt:
        pass
    finally:
        for follower in followers:
            follower.stop()
        server.stop()
    return 0


class WebReporter:
    """`asyncrl launch --web`: a reporter (and record sink) that serves the run's page while the
    job runs and hands everything on to `inner` (the terminal dashboard or plain lines)."""

    def __init__(self, inner, *, label: str, config: dict, host: str, port: int, token_file: Path | None):
        self.inner = inner
        self.source = RunSource(WebRun(label, live=True))
        self.source.apply(lambda run: run.apply_config(config))
        self.access, self.made_up = Access.for_bind(host, token_file)  # ValueError: a bad token file
        self.server = ServerThread(build_app([self.source], self.access), host, port)
        self.inner_takes_records = hasattr(inner, "on_record")

    def __enter__(self) -> WebReporter:
        url = self.server.start()
        announce(url, self.access, made_up=self.made_up)
        self.inner.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        try:
            self.inner.__exit__(*exc)
        finally:
            self.server.stop()

    def update(self, state) -> None:
        self.inner.update(state)

    def event(self, text: str) -> None:
        """Lines told before the records begin (run directory, settings warnings): listed as events."""
        self.source.apply(lambda run: run.early_event(text))
        self.inner.event(text)

    def on_record(self, record: dict) -> None:
        self.source.add(record)
        if self.inner_takes_records:
            self.inner.on_record(record)
        elif record.get("type") == "event":  # the hub tells events to its sinks only
            self.inner.event(str(record.get("text", "")))


def web_reporter(inner, config, *, host: str, port: int, token_file: Path | None) -> WebReporter:
    """`asyncrl launch --web`: `inner` wrapped, for the run of `config` (a `Config`)."""
    import msgspec

    return WebReporter(
        inner,
        label=config.run.name or "launch",
        config=msgspec.to_builtins(config),
        host=host,
        port=port,
        token_file=token_file,
    )
