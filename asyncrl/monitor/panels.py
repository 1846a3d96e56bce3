"""Rich renderables for the dashboard, computed from a `RunView` (monitor/aggregate.py).

Place in the data flow: records -> RunView (aggregate) -> `render_dashboard` (here) -> rich Live
(monitor/live.py). Rendering reads the view and never mutates it; a figure that no component
reports yet is shown as "-" (never a made-up zero). The layout picks 1, 2 or 3 columns from the
terminal width and shortens lists and sparklines when the terminal is short or narrow.
"""

from __future__ import annotations

from rich.cells import cell_len, set_cell_size
from rich.console import Group, RenderableType
from rich.segment import Segment
from rich.style import Style
from rich.text import Text

from asyncrl.monitor.aggregate import RunView, median

SPARK = "▁▂▃▄▅▆▇█"
DASH = "-"
BAR = "█"


def sparkline(values, width: int = 40) -> str:
    vals = list(values)[-width:]
    if not vals:
        return ""
    lo, hi = min(vals), max(vals)
    span = hi - lo or 1.0
    return "".join(SPARK[min(len(SPARK) - 1, int((v - lo) / span * (len(SPARK) - 1)))] for v in vals)


def fmt(value, spec: str = ".3f", suffix: str = "") -> str:
    """`value` formatted, or a dash when the figure does not exist (None or NaN)."""
    if value is None or (isinstance(value, float) and value != value):
        return DASH
    return f"{value:{spec}}{suffix}"


def fmt_duration(seconds: float | None) -> str:
    if seconds is None:
        return DASH
    seconds = int(round(seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


def fmt_ms(seconds: float | None) -> str:
    return DASH if seconds is None else f"{seconds * 1e3:.1f} ms"


class Rows:
    """A panel body: label/value rows. Drawn straight to segments with its box (`box_lines`):
    no table measurement, no wrapping, no markup parsing; the dashboard redraws every frame."""

    def __init__(self) -> None:
        self.rows: list[tuple[str, str | Text]] = []

    def add_row(self, label: str, value: str | Text) -> None:
        self.rows.append((label, value))


BORDER = Style(color="blue")
LABEL = Style(color="cyan", bold=True)
TITLE = Style(bold=True)


def _fit(text: str, width: int) -> str:
    """`text` padded or cut (with an ellipsis) to exactly `width` cells."""
    if width <= 0:
        return ""
    if cell_len(text) <= width:
        return set_cell_size(text, width)
    return set_cell_size(text, width - 1) + "…"


def box_lines(title: str, body: Rows, width: int) -> list[list[Segment]]:
    """One panel of exactly `width` cells: a rounded box titled `title` around `body`'s rows."""
    inner = max(1, width - 4)
    # Labels share one column, at most half the panel wide; only a label longer than that is cut
    # (the column's padding never is), so the figure next to it keeps its room.
    label_w = min(max((cell_len(label) for label, _ in body.rows), default=0), max(0, inner // 2 - 1))
    head = _fit(f" {title} ", min(width - 3, cell_len(title) + 2))
    lines = [
        [
            Segment("╭─", BORDER),
            Segment(head, TITLE),
            Segment("─" * (width - 3 - cell_len(head)) + "╮", BORDER),
        ]
    ]
    for label, value in body.rows:
        plain, style = (value.plain, value.style or None) if isinstance(value, Text) else (value, None)
        if isinstance(style, str):
            style = Style.parse(style)
        lab = _fit(label, label_w) + " " if label_w else ""
        lines.append(
            [
                Segment("│ ", BORDER),
                Segment(lab, LABEL),
                Segment(_fit(plain, inner - cell_len(lab)), style),
                Segment(" │", BORDER),
            ]
        )
    lines.append([Segment("╰" + "─" * (width - 2) + "╯", BORDER)])
    return lines


def _grid() -> Rows:
    return Rows()


def _bar(fraction: float, width: int) -> str:
    fraction = min(1.0, max(0.0, fraction))
    return BAR * int(round(fraction * width)) + "·" * (width - int(round(fraction * width)))


class Layout:
    """Sizes derived from the terminal: columns, list lengths, sparkline width."""

    def __init__(self, width: int, height: int) -> None:
        self.width = width
        self.height = height
        self.columns = 3 if width >= 150 else 2 if width >= 96 else 1
        col_width = width // self.columns
        self.spark = max(8, min(60, col_width - 30))
        self.bar = max(6, min(30, col_width - 26))
        tall = height >= (40 if self.columns > 1 else 70)
        self.rows = 8 if tall else 3  # per-generator rows, histogram rows, diagnostics, events


# ---------------------------------------------------------------------------- panels
def progress_panel(v: RunView, lay: Layout) -> Rows:
    t = _grid()
    t.add_row("phase", f"{v.phase}" + (f"  ({v.mode}, policy {v.policy})" if v.mode else ""))
    total = v.total_steps
    frac = v.step / total if total else 0.0
    t.add_row("step", f"{v.step}/{fmt(total, 'd')}  {_bar(frac, lay.bar)}")
    t.add_row("version", f"policy_version {v.policy_version}")
    t.add_row("samples", f"{v.trajectories_trained} trained / {fmt(v.total_samples, 'd')}")
    t.add_row("elapsed", f"{fmt_duration(v.elapsed_s())}   ETA {fmt_duration(v.eta_s())}")
    if v.final or v.status:
        t.add_row("status", f"{v.status or DASH}")
    return t


def throughput_panel(v: RunView, lay: Layout) -> Rows:
    t = _grid()
    t.add_row(
        "samples/s",
        f"{fmt(v.samples_per_s(), '.1f')} trained (last steps {fmt(v.recent_samples_per_s(), '.1f')})",
    )
    t.add_row("tokens/s", f"{fmt(v.tokens_per_s(), '.1f')} generated")
    t.add_row("generated", f"{v.trajectories_generated} samples, {v.tokens_generated} tokens")
    for gen_id in sorted(v.generators)[: lay.rows]:
        gen = v.generators[gen_id]
        sps, tps = v.generator_rates(gen)
        t.add_row(
            f" {gen_id}",
            f"{fmt(sps, '.1f')} samples/s  {fmt(tps, '.1f')} tokens/s  v{fmt(gen.version, 'd')}",
        )
    if len(v.generators) > lay.rows:
        t.add_row("", f"... {len(v.generators) - lay.rows} more generators")
    return t


def reward_panel(v: RunView, lay: Layout) -> Rows:
    t = _grid()
    last = v.rewards[-1] if v.rewards else None
    recent = list(v.rewards)[-10:]
    t.add_row(
        "reward",
        f"{fmt(last)}  (mean last {len(recent)}: {fmt(sum(recent) / len(recent) if recent else None)})",
    )
    t.add_row("", sparkline(v.rewards, lay.spark) or DASH)
    for key in sorted(v.accuracy)[: lay.rows]:
        series = v.accuracy[key]
        t.add_row(key, f"{fmt(series[-1])}  {sparkline(series, lay.spark)}")
    t.add_row("held-out acc", f"before {fmt(v.eval_before)}  after {fmt(v.eval_after)}")
    if v.last_eval is not None:
        t.add_row("eval", f"{fmt(v.last_eval[1])} at policy_version {v.last_eval[0]}")
    prompt_rows(t, v.last_step or {})
    return t


def prompt_rows(t: Rows, step: dict) -> None:
    """The launcher's per-prompt record (scheduler/prompt_stats.py), from the last step record:
    the estimated pass rates' quantiles and the step's fraction of degenerate groups."""
    quantiles = step.get("pass_rate_quantiles")
    if quantiles is None:  # a record from before the per-prompt record existed
        return
    shown = [f"{q} {fmt(quantiles.get(q), '.2f')}" for q in ("q10", "q50", "q90")]
    t.add_row("pass rates", "  ".join(shown) if quantiles else DASH)
    t.add_row("degenerate", f"{fmt(step.get('degenerate_fraction'), '.2f')} of the step's groups")


LENGTH_ROW = (("gen", "generated"), ("train", "trained"), ("drop", "evicted"))


def staleness_panel(v: RunView, lay: Layout) -> Rows:
    t = _grid()
    bound = v.staleness_bound
    t.add_row("max", f"{v.max_staleness} (bound {fmt(bound, 'd')})  mean {fmt(v.mean_staleness, '.2f')}")
    lengths = v.completion_lengths  # length bias: what was generated vs trained vs dropped
    t.add_row(
        "length",
        " ".join(f"{name} {fmt(lengths.get(kind), '.1f')}" for name, kind in LENGTH_ROW),
    )
    hist = v.staleness_hist
    if not hist:
        t.add_row("histogram", DASH)
        return t
    unit = "steps by max staleness" if v.staleness_hist_unit == "steps" else "samples"
    t.add_row("histogram", f"({unit})")
    top = max(max(hist), bound or 0)
    keys = list(range(top + 1))
    if len(keys) > lay.rows:  # keep the largest staleness values: they are the ones to watch
        keys = keys[-lay.rows :]
    peak = max(hist.values())
    for k in keys:
        t.add_row(f" {k}", f"{_bar(hist.get(k, 0) / peak, lay.bar)} {hist.get(k, 0)}")
    return t


def freshness_panel(v: RunView, lay: Layout) -> Rows:
    t = _grid()
    if not v.freshness and not v.freshness_hist:
        t.add_row("freshness", DASH)
        return t
    for key in sorted(v.freshness)[: lay.rows]:
        t.add_row(key, fmt(v.freshness[key]))
    if v.freshness_hist:
        peak = max(v.freshness_hist.values()) or 1.0
        for bin_name in sorted(v.freshness_hist)[: lay.rows]:
            count = v.freshness_hist[bin_name]
            t.add_row(f" {bin_name}", f"{_bar(count / peak, lay.bar)} {count:g}")
    return t


def pipeline_panel(v: RunView, lay: Layout) -> Rows:
    t = _grid()
    if v.buffer:
        for key in sorted(v.buffer)[: lay.rows]:  # "buffer/held_trajectories" -> "held trajectories"
            t.add_row(key.rsplit("/", 1)[-1].replace("_", " "), f"{v.buffer[key]:g}")
    else:
        t.add_row("buffer depth", DASH)
    t.add_row("in flight", f"{fmt(v.groups_in_flight, 'd')} groups   admitted {fmt(v.groups_admitted, 'd')}")
    if v.credits_total:
        used = v.credits_used or 0
        t.add_row("credits", f"{used}/{v.credits_total} used  {fmt(v.credits_free, 'd')} free")
        t.add_row("", _bar(used / v.credits_total, lay.bar))
    else:
        t.add_row("credits", DASH)
    return t


def sync_panel(v: RunView, lay: Layout) -> Rows:
    t = _grid()
    if not v.sync:
        t.add_row("weight sync", DASH)
        return t
    for transport, s in sorted(v.sync.items()):
        t.add_row(transport, f"{s.publishes} versions, {s.num_bytes / 2**20:.2f} MiB each")
        t.add_row(
            " publish",
            f"median {fmt_ms(median(s.publish_s))}  last {fmt_ms(s.publish_s[-1] if s.publish_s else None)}",
        )
        t.add_row(
            " load", f"median {fmt_ms(median(s.load_s))}  last {fmt_ms(s.load_s[-1] if s.load_s else None)}"
        )
        t.add_row(
            " announce→loaded",
            f"median {fmt_ms(median(s.latency_s))}  last {fmt_ms(s.latency_s[-1] if s.latency_s else None)}",
        )
    return t


def idle_panel(v: RunView, lay: Layout) -> Rows:
    t = _grid()
    if not v.idle:
        t.add_row("idle ratio", DASH)
        return t
    stages = sorted(v.idle, key=lambda s: (not s.startswith("learner"), s))
    for stage in stages[: lay.rows + 1]:
        ratio = v.idle[stage]
        t.add_row(stage, f"{_bar(ratio, lay.bar)} {ratio:.0%} idle")
    return t


# `StepDone.stats` keys whose names say less than the figure: the staleness policy's clip fraction
# counts importance weights it truncated, not tokens the loss clipped (StepDone.clip_fraction).
STAT_LABELS = {"clip_fraction": "IS weights clipped"}


def diagnostics_panel(v: RunView, lay: Layout) -> Rows:
    t = _grid()
    s = v.last_step
    if s is None:
        t.add_row("loss", DASH)
        return t
    t.add_row("loss", fmt(s.get("loss"), "+.4f"))
    t.add_row("", sparkline(v.losses, lay.spark))  # its own row: beside the figure it was cut at the end
    t.add_row("grad norm", f"{fmt(s.get('grad_norm'), '.3f')}   lr scale {fmt(s.get('lr_scale'), '.3g')}")
    t.add_row("loss clip fraction", fmt(s.get("clip_fraction"), ".4f"))
    # Staleness is its own panel; the policy's `clip_fraction` is another figure than the loss's.
    keys = [k for k in sorted(v.diagnostics) if k not in ("max_staleness", "mean_staleness")]
    rows = lay.rows + 2
    for key in keys[:rows]:
        t.add_row(f" {STAT_LABELS.get(key, key)}", fmt(v.diagnostics[key], ".4g"))
    if len(keys) > rows:
        t.add_row("", f"... {len(keys) - rows} more")
    return t


def health_panel(v: RunView, lay: Layout) -> Rows:
    t = _grid()
    t.add_row("restarts", fmt(v.restarts, "d"))
    errors = {k: c for k, c in v.error_counts.items() if c}
    t.add_row(
        "errors",
        f"{v.num_error_records} records, {sum(errors.values()):g} counted"
        if (errors or v.num_error_records)
        else "0",
    )
    for key in sorted(errors)[: lay.rows]:
        t.add_row(f" {key}", f"{errors[key]:g}")
    if v.failure:
        t.add_row("failure", Text(v.failure.splitlines()[0], style="bold red"))
    for line in list(v.events)[-lay.rows :]:
        t.add_row("", Text(line, style="dim"))
    return t


PANELS = {
    "progress": progress_panel,
    "throughput": throughput_panel,
    "reward": reward_panel,
    "staleness": staleness_panel,
    "freshness": freshness_panel,
    "pipeline": pipeline_panel,
    "weight sync": sync_panel,
    "idle": idle_panel,
    "loss & policy": diagnostics_panel,
    "health": health_panel,
}
COLUMNS = {
    1: [list(PANELS)],
    2: [
        ["progress", "throughput", "reward", "staleness", "freshness"],
        ["pipeline", "weight sync", "idle", "loss & policy", "health"],
    ],
    3: [
        ["progress", "throughput", "reward"],
        ["staleness", "freshness", "pipeline", "weight sync"],
        ["idle", "loss & policy", "health"],
    ],
}


class _Columns:
    """Panels stacked in columns of equal width, drawn line by line as segments."""

    def __init__(self, columns: list[list[tuple[str, Rows]]]) -> None:
        self.columns = columns

    def __rich_console__(self, console, options):
        width = options.max_width
        n = len(self.columns)
        widths = [width // n + (1 if i < width % n else 0) for i in range(n)]
        rendered = [
            [line for title, body in col for line in box_lines(title, body, w)]
            for col, w in zip(self.columns, widths, strict=True)
        ]
        height = max(len(lines) for lines in rendered)
        blank = [[Segment(" " * w)] for w in widths]
        for i in range(height):
            for c, lines in enumerate(rendered):
                yield from lines[i] if i < len(lines) else blank[c]
            yield Segment.line()


def render_dashboard(view: RunView, *, width: int, height: int, title: str = "asyncrl") -> RenderableType:
    lay = Layout(width, height)
    columns = [[(name, PANELS[name](view, lay)) for name in col] for col in COLUMNS[lay.columns]]
    header = Text(f" {title} ", style="bold white on blue")
    return Group(header, _Columns(columns))
