"""Terminal reporters: the record-driven rich dashboard, and plain log lines.

Place in the data flow: in `asyncrl launch` the launcher's hub (monitor/stream.py) hands every
record to `Dashboard.on_record`; in `asyncrl monitor` the attach loop (monitor/attach.py) does
the same with records from the PUB socket or metrics.jsonl. `on_record` only folds the record
into a `RunView` (O(1)); rich's Live thread redraws at `refresh_per_second`, so rendering costs
the same whatever the record rate. A lock keeps the redraw thread from reading a half-updated
view. `PlainReporter` prints one line per learner step (pipes, CI, `--no-tui`).
"""

from __future__ import annotations

import sys
import threading
import time

from rich.console import Console
from rich.live import Live

from asyncrl.monitor.aggregate import RunView
from asyncrl.monitor.panels import render_dashboard, sparkline

__all__ = ["Dashboard", "LiveReporter", "PlainReporter", "sparkline"]


class Dashboard:
    """Rich Live dashboard over a RunView; a launcher Reporter and a record sink. Context manager."""

    def __init__(
        self,
        console: Console | None = None,
        *,
        refresh_per_second: float = 4.0,
        title: str = "asyncrl",
        view: RunView | None = None,
    ) -> None:
        self.console = console or Console()
        self.view = view or RunView()
        self.title = title
        self.lock = threading.Lock()
        self.aggregate_s = 0.0  # time spent folding records in (the dashboard's cost on the record path)
        self.build_s = 0.0  # time spent building renderables (rich's own drawing comes on top)
        self.num_builds = 0
        self.live = Live(
            console=self.console,
            refresh_per_second=refresh_per_second,
            get_renderable=self._renderable,
            redirect_stdout=False,
            redirect_stderr=False,
        )

    # Reporter protocol (scheduler/records.py) -------------------------------------------
    def update(self, state) -> None:
        """Records drive the view; before the first record, show the launcher's phase."""
        if self.view.num_records == 0:
            with self.lock:
                self.view.phase = state.phase

    def event(self, text: str) -> None:
        """Events before the stream opens (afterwards they arrive as `event` records)."""
        with self.lock:
            self.view.events.append(text)
            self.view.revision += 1

    # Record sink ---------------------------------------------------------------------------
    def on_record(self, record: dict) -> None:
        t0 = time.perf_counter()
        with self.lock:
            self.view.add(record)
        self.aggregate_s += time.perf_counter() - t0

    def apply(self, fn) -> None:
        """Run `fn(view)` under the lock (summary/config updates from the attach loop)."""
        with self.lock:
            fn(self.view)

    # Rendering -----------------------------------------------------------------------------
    def _renderable(self):
        t0 = time.perf_counter()
        with self.lock:
            size = self.console.size
            renderable = render_dashboard(self.view, width=size.width, height=size.height, title=self.title)
        self.build_s += time.perf_counter() - t0
        self.num_builds += 1
        return renderable

    def print_once(self) -> None:
        """Print the current dashboard once (non-terminal output, finished runs)."""
        self.console.print(self._renderable())

    def refresh(self) -> None:
        self.live.refresh()

    def __enter__(self) -> Dashboard:
        self.live.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.live.__exit__(*exc)


LiveReporter = Dashboard  # the name `asyncrl launch` used before the dashboard grew panels


class PlainReporter:
    """One log line per learner step and per event (for pipes, CI and --no-tui)."""

    def __init__(self, stream=None) -> None:
        self.stream = stream or sys.stdout
        self.last_step = -1
        self.start = time.perf_counter()

    def __enter__(self) -> PlainReporter:
        return self

    def __exit__(self, *exc) -> None:
        pass

    def update(self, state) -> None:
        if state.step != self.last_step and state.step > 0:
            self.last_step = state.step
            print(
                f"step {state.step}/{state.total_steps} reward {state.last_reward:.3f} loss {state.last_loss:+.4f} "
                f"staleness {state.max_staleness}/{state.max_staleness_bound} "
                f"samples/s {state.trajectories_trained / max(state.elapsed_s, 1e-9):.1f}",
                file=self.stream,
                flush=True,
            )

    def event(self, text: str) -> None:
        print(text, file=self.stream, flush=True)
