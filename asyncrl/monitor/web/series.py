"""Bounded shapes of a run's history for the web page (pure, no I/O).

Place in the data flow: records -> `WebRun` (model.py) -> these -> JSON for the page. A run of
100,000 steps must reach the browser as a few hundred points per chart, and a live run must cost
the same per record however long it has run, so:
  `Buckets`  a series of (x, y) points held in at most `capacity` buckets; when the buckets are
             full, neighbours merge pairwise and every later bucket covers twice as many points.
             Each bucket keeps the last x, the mean, min and max of y: O(1) amortised per point,
             memory and output bounded, and a spike stays visible (min/max) after merging.
  `Lanes`    the timeline: per process, spans (start, end, kind) of the last `window_s` seconds;
             a span that touches or overlaps the lane's last one of the same kind extends it.
"""

from __future__ import annotations

from collections import deque

import numpy as np

SERIES_CAPACITY = 512  # buckets per series: about one per horizontal pixel of a chart
FLUSH_POINTS = 256  # points a series gathers before they go into buckets, in bulk
LANE_SPANS = 4000  # spans kept per lane (beyond the window they are dropped first)
VIEW_SPANS = 600  # a lane with more spans than this in its window is sent binned
VIEW_BINS = 1000  # slices of the window a binned lane is sent as (about one per pixel)
MERGE_LOOKBACK = 4  # spans of other kinds may lie between two that merge (the learner alternates)
MERGE_GAP_S = 0.002  # spans closer than this read as one (far below a pixel of a minutes-wide chart)


def _round(value: float) -> float:
    """Five significant digits: what a chart can show, and a fraction of the JSON size."""
    return float(f"{value:.5g}")


class Buckets:
    """A downsampled series: `add(x, y)` in order of x; `points()` -> [[x, mean, min, max], ...].

    `add` only appends to a pending list (a replay folds 100,000 steps into a dozen series); full
    buckets are made from it in bulk (numpy) once `FLUSH_POINTS` wait."""

    __slots__ = ("capacity", "width", "done", "xs", "ys", "count")

    def __init__(self, capacity: int = SERIES_CAPACITY) -> None:
        if capacity < 2 or capacity % 2:
            raise ValueError(f"Buckets capacity must be an even number >= 2, got {capacity}")
        self.capacity = capacity
        self.width = 1  # points per full bucket
        self.done: list[list[float]] = []  # full buckets: [x, sum, n, min, max]
        self.xs: list[float] = []  # points not in a bucket yet
        self.ys: list[float] = []
        self.count = 0  # points added

    def add(self, x: float, y: float) -> None:
        if y != y:  # NaN: not a point (a figure that was not measured)
            return
        self.count += 1
        self.xs.append(x)
        self.ys.append(y)
        if len(self.xs) >= max(FLUSH_POINTS, self.width):
            self._flush()

    def _groups(self, xs: list[float], ys: list[float]) -> list[list[float]]:
        """`xs, ys` cut into buckets of `width` points (the last one may be short)."""
        w, n = self.width, len(xs)
        if w == 1:
            return [[x, y, 1, y, y] for x, y in zip(xs, ys, strict=True)]
        y = np.asarray(ys, dtype=np.float64)
        full = n - n % w
        out = []
        if full:
            g = y[:full].reshape(-1, w)
            for i, (total, lo, hi) in enumerate(zip(g.sum(1), g.min(1), g.max(1), strict=True)):
                out.append([xs[(i + 1) * w - 1], float(total), w, float(lo), float(hi)])
        if full < n:
            rest = y[full:]
            out.append([xs[-1], float(rest.sum()), n - full, float(rest.min()), float(rest.max())])
        return out

    def _flush(self) -> None:
        keep = len(self.xs) % self.width
        cut = len(self.xs) - keep
        self.done += self._groups(self.xs[:cut], self.ys[:cut])
        self.xs, self.ys = self.xs[cut:], self.ys[cut:]
        while len(self.done) >= self.capacity:
            self._halve()

    def _halve(self) -> None:
        done = self.done
        merged = [
            [b[0], a[1] + b[1], a[2] + b[2], min(a[3], b[3]), max(a[4], b[4])]
            for a, b in zip(done[0:-1:2], done[1::2], strict=True)
        ]
        if len(done) % 2:  # an odd one out stays as it is, at the end
            merged.append(done[-1])
        self.done = merged
        self.width *= 2

    def points(self) -> list[list[float]]:
        buckets = self.done + (self._groups(self.xs, self.ys) if self.xs else [])
        return [[_round(x), _round(s / n), _round(lo), _round(hi)] for x, s, n, lo, hi in buckets]


class Lanes:
    """Timeline spans per lane over the last `window_s` seconds of the run's clock."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self.lanes: dict[str, deque[list]] = {}
        self.end_s = 0.0  # the latest time any span reached
        # Spans ending before this are outside the window for good: a replay that knows its
        # last record's time sets it, and skips the bookkeeping of everything older.
        self.skip_before = float("-inf")

    def add(self, lane: str, start_s: float, end_s: float, kind: str) -> None:
        if end_s < self.skip_before:
            return
        if end_s < start_s:
            start_s, end_s = end_s, start_s
        spans = self.lanes.setdefault(lane, deque(maxlen=LANE_SPANS))
        self.end_s = max(self.end_s, end_s)
        for i in range(1, min(len(spans), MERGE_LOOKBACK) + 1):  # a recent span of this kind
            span = spans[-i]
            if span[2] == kind:
                if start_s <= span[1] + MERGE_GAP_S and end_s >= span[0] - MERGE_GAP_S:
                    span[0], span[1] = min(span[0], start_s), max(span[1], end_s)
                    return
                break
        spans.append([start_s, end_s, kind])
        horizon = self.end_s - self.window_s
        while spans and spans[0][1] < horizon:
            spans.popleft()

    def view(self) -> dict:
        """{"t0", "t1", "lanes": [{"name", "spans": [[start, end, kind], ...]}]}, the window only;
        a lane with more than `VIEW_SPANS` spans comes binned (`binned`)."""
        t1 = self.end_s
        t0 = max(0.0, t1 - self.window_s)
        order = sorted(self.lanes, key=lambda name: (name != "learner", name != "publish", name))
        lanes = []
        for name in order:
            spans = [(max(s, t0), e, k) for s, e, k in self.lanes[name] if e >= t0]
            if len(spans) > VIEW_SPANS:
                spans = binned(spans, t0, t1, marks=name == "publish")
            lanes.append({"name": name, "spans": [[round(s, 3), round(e, 3), k] for s, e, k in spans]})
        return {"t0": round(t0, 3), "t1": round(t1, 3), "lanes": lanes}


def _covered_s(starts: np.ndarray, ends: np.ndarray, edges: np.ndarray) -> np.ndarray:
    """Span time before each edge: sum over spans of clip(edge - start, 0, end - start), from
    sorted starts and ends and their prefix sums (no spans x edges matrix)."""
    s, e = np.sort(starts), np.sort(ends)
    sum_s, sum_e = np.concatenate(([0.0], np.cumsum(s))), np.concatenate(([0.0], np.cumsum(e)))
    num_s, num_e = np.searchsorted(s, edges), np.searchsorted(e, edges)
    return edges * num_s - sum_s[num_s] - edges * num_e + sum_e[num_e]


def binned(spans: list[tuple[float, float, str]], t0: float, t1: float, *, marks: bool) -> list[tuple]:
    """The lane as `VIEW_BINS` slices of [t0, t1] (about a pixel each), each slice the kind that
    took most of its time, or idle when idle time was the most; runs of one kind joined. With
    `marks` (publishes: moments, not states) a slice shows a kind whenever one touched it."""
    width = (t1 - t0) / VIEW_BINS
    if width <= 0:
        return spans
    edges = t0 + width * np.arange(VIEW_BINS + 1)
    kinds = sorted({k for _, _, k in spans})
    busy = np.empty((len(kinds), VIEW_BINS))
    for row, kind in enumerate(kinds):
        starts = np.array([s for s, _, k in spans if k == kind])
        ends = np.array([e for _, e, k in spans if k == kind])
        if marks:  # spans touching slice i: started before its end, not ended before its start
            busy[row] = np.searchsorted(np.sort(starts), edges[1:], "right") - np.searchsorted(
                np.sort(ends), edges[:-1], "left"
            )
        else:
            busy[row] = np.diff(_covered_s(starts, ends, edges))
    top = busy.argmax(axis=0)
    most = busy.max(axis=0)
    shown = most > 0 if marks else (most > 0) & (most >= width - busy.sum(axis=0))
    out: list[list] = []
    for i in np.flatnonzero(shown):
        kind = kinds[top[i]]
        if out and out[-1][2] == kind and out[-1][1] >= edges[i] - 1e-9:
            out[-1][1] = float(edges[i + 1])
        else:
            out.append([float(edges[i]), float(edges[i + 1]), kind])
    return [tuple(span) for span in out]
