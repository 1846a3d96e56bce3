"""Terminal reporters for `asyncrl launch`: a rich live view, or plain log lines.

The launcher calls `update(state)` on every message and `event(text)` for notable events;
`update` only stores the state, and rich redraws at a fixed rate, so rendering costs the same
whatever the message rate.
"""

from __future__ import annotations

import sys
import time

from rich.console import Console, Group
from rich.live import Live
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

SPARK = "▁▂▃▄▅▆▇█"


def sparkline(values: list[float], width: int = 40) -> str:
    vals = values[-width:]
    if not vals:
        return ""
    lo, hi = min(vals), max(vals)
    span = hi - lo or 1.0
    return "".join(SPARK[min(len(SPARK) - 1, int((v - lo) / span * (len(SPARK) - 1)))] for v in vals)


def render(state, events: list[str]) -> Group:
    table = Table.grid(padding=(0, 2))
    table.add_column(style="bold cyan")
    table.add_column()
    elapsed = state.elapsed_s
    trained = state.trajectories_trained
    table.add_row("phase", state.phase)
    table.add_row("step", f"{state.step}/{state.total_steps}   policy_version {state.policy_version}")
    table.add_row("reward", f"{state.last_reward:.3f}  {sparkline(state.rewards)}")
    table.add_row("loss / clip", f"{state.last_loss:+.4f} / {state.last_clip_fraction:.3f}")
    table.add_row(
        "throughput",
        f"{trained / max(elapsed, 1e-9):.1f} samples/s trained, {state.tokens_generated / max(elapsed, 1e-9):.1f} tokens/s generated",
    )
    table.add_row("staleness", f"max {state.max_staleness} (bound {state.max_staleness_bound})")
    table.add_row("groups", f"admitted {state.groups_admitted}, in flight {state.groups_in_flight}")
    versions = ", ".join(f"{g}: v{v}" for g, v in sorted(state.loaded_versions.items())) or "-"
    table.add_row("generators", versions)
    idle = state.metrics.get("learner/idle_ratio")
    if idle is not None:
        table.add_row("learner idle", f"{idle:.2f}")
    log = Text("\n".join(events[-6:]), style="dim")
    return Group(Panel(table, title="asyncrl", border_style="blue"), log)


class LiveReporter:
    """Rich Live dashboard; use as a context manager."""

    def __init__(self, console: Console | None = None, refresh_per_second: float = 4.0) -> None:
        self.console = console or Console()
        self.state = None
        self.events: list[str] = []
        self.live = Live(
            console=self.console, refresh_per_second=refresh_per_second, get_renderable=self._renderable
        )

    def _renderable(self):
        if self.state is None:
            return Text("\n".join(self.events[-6:]) or "starting ...")
        return render(self.state, self.events)

    def __enter__(self) -> LiveReporter:
        self.live.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.live.__exit__(*exc)

    def update(self, state) -> None:
        self.state = state

    def event(self, text: str) -> None:
        self.events.append(text)


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
