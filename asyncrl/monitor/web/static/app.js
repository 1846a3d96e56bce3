// asyncrl web monitor: draws each run's view (GET api/runs/ID/state, then server-sent events on
// api/runs/ID/stream) as hand-written SVG. No library, nothing from the network; the server has
// already downsampled every series (a few hundred points), so redrawing a chart is cheap.
// Text from the run goes in through textContent only, never as markup.
"use strict";

const SVG = "http://www.w3.org/2000/svg";
const COLORS = ["var(--c0)", "var(--c1)", "var(--c2)", "var(--c3)", "var(--c4)", "var(--c5)"];
const KINDS = ["training", "waiting", "decoding", "loading"];

function el(tag, attrs, parent, text) {
  const node = tag.startsWith("svg:") ? document.createElementNS(SVG, tag.slice(4)) : document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
  if (text !== undefined) node.textContent = text;
  if (parent) parent.appendChild(node);
  return node;
}

function fmt(x, digits) {
  if (x === null || x === undefined || Number.isNaN(x)) return "-";
  if (typeof x !== "number") return String(x);
  if (digits !== undefined) return x.toFixed(digits);
  if (Number.isInteger(x) && Math.abs(x) < 1e6) return String(x);
  const a = Math.abs(x);
  if (a >= 1e6) return (x / 1e6).toPrecision(3) + "M";
  if (a >= 1e4) return (x / 1e3).toPrecision(3) + "k";
  return a >= 100 ? x.toFixed(0) : a >= 1 ? x.toFixed(2) : a === 0 ? "0" : x.toPrecision(3);
}

function duration(s) {
  if (s === null || s === undefined) return "-";
  s = Math.round(s);
  const h = Math.floor(s / 3600), m = Math.floor((s % 3600) / 60), r = s % 60;
  return (h ? h + ":" + String(m).padStart(2, "0") : m) + ":" + String(r).padStart(2, "0");
}

// A chart canvas: an <svg> sized to its container, emptied. Returns {svg, w, h}.
function canvas(svg, height) {
  const w = Math.max(200, Math.round(svg.parentNode.getBoundingClientRect().width || 480));
  svg.setAttribute("viewBox", `0 0 ${w} ${height}`);
  svg.setAttribute("height", height);
  svg.replaceChildren();
  return { svg, w, h: height };
}

function extent(values, pad) {
  let lo = Infinity, hi = -Infinity;
  for (const v of values) { if (v < lo) lo = v; if (v > hi) hi = v; }
  if (lo === Infinity) return [0, 1];
  if (lo === hi) { lo -= pad || 0.5; hi += pad || 0.5; }
  return [lo, hi];
}

// Lines of [x, mean, min, max] points; marks: [{x, label}] drawn as dashed verticals.
function lineChart(svg, lines, opts) {
  const { w, h } = canvas(svg, opts.height || 150);
  const m = { l: 44, r: 8, t: 18, b: 18 };
  lines = lines.filter((l) => l.pts && l.pts.length);
  svg.dataset.points = lines.reduce((n, l) => n + l.pts.length, 0);
  if (!lines.length) {
    el("svg:text", { x: w / 2, y: h / 2, "text-anchor": "middle", class: "empty" }, svg, opts.empty || "no data yet");
    return;
  }
  const xs = lines.flatMap((l) => l.pts.map((p) => p[0]));
  const ys = lines.flatMap((l) => l.pts.flatMap((p) => (opts.band ? [p[2], p[3]] : [p[1]])));
  const [x0, x1] = extent(xs.concat(opts.xInclude || []));
  let [y0, y1] = extent(ys.concat(opts.yInclude || []));
  if (opts.zero && y0 > 0) y0 = 0;
  const X = (x) => m.l + ((x - x0) / (x1 - x0)) * (w - m.l - m.r);
  const Y = (y) => h - m.b - ((y - y0) / (y1 - y0)) * (h - m.t - m.b);
  el("svg:rect", { x: m.l, y: m.t, width: w - m.l - m.r, height: h - m.t - m.b, class: "axis" }, svg);
  for (const y of [y0, (y0 + y1) / 2, y1]) {
    el("svg:text", { x: m.l - 4, y: Y(y) + 3, "text-anchor": "end" }, svg, fmt(y));
  }
  el("svg:text", { x: m.l, y: h - 4 }, svg, fmt(x0));
  el("svg:text", { x: w - m.r, y: h - 4, "text-anchor": "end" }, svg, `${fmt(x1)} ${opts.xlabel || ""}`);
  for (const mark of opts.marks || []) {
    if (mark.x < x0 || mark.x > x1) continue;
    el("svg:line", { x1: X(mark.x), x2: X(mark.x), y1: m.t, y2: h - m.b, class: "mark" }, svg);
    el("svg:text", { x: X(mark.x) + 2, y: m.t + 10 }, svg, mark.label);
  }
  lines.forEach((line, i) => {
    const color = line.color || COLORS[i % COLORS.length];
    if (opts.band && line.pts.some((p) => p[2] !== p[3])) {
      const top = line.pts.map((p) => `${X(p[0])},${Y(p[3])}`);
      const bottom = line.pts.map((p) => `${X(p[0])},${Y(p[2])}`).reverse();
      el("svg:polygon", { points: top.concat(bottom).join(" "), class: "band", fill: color }, svg);
    }
    const pts = line.pts.map((p) => `${X(p[0]).toFixed(1)},${Y(p[1]).toFixed(1)}`).join(" ");
    el("svg:polyline", { points: pts, class: "line", stroke: color, "data-name": line.name }, svg);
    if (line.pts.length < 40) {
      for (const p of line.pts) el("svg:circle", { cx: X(p[0]), cy: Y(p[1]), r: 2.5, fill: color }, svg);
    }
  });
  legend(svg, lines.map((l, i) => [l.name, l.color || COLORS[i % COLORS.length]]), w, m);
}

function legend(svg, items, w, m) {
  let x = m.l + 6;
  for (const [name, color] of items) {
    el("svg:rect", { x, y: m.t - 14, width: 9, height: 9, fill: color }, svg);
    el("svg:text", { x: x + 12, y: m.t - 6 }, svg, name);
    x += 20 + 6 * name.length;
  }
}

// The Gantt chart: one row per process, spans [start, end, kind] over [t0, t1].
function gantt(svg, timeline) {
  const lanes = timeline.lanes || [];
  const row = 18, m = { l: 70, r: 8, t: 4, b: 18 };
  const { w, h } = canvas(svg, m.t + m.b + row * Math.max(1, lanes.length) + 16);
  svg.dataset.lanes = lanes.map((l) => l.name).join(",");
  if (!lanes.length) {
    el("svg:text", { x: w / 2, y: h / 2, "text-anchor": "middle", class: "empty" }, svg, "no activity yet");
    return;
  }
  const t0 = timeline.t0, t1 = Math.max(timeline.t1, t0 + 1e-3);
  const X = (t) => m.l + ((t - t0) / (t1 - t0)) * (w - m.l - m.r);
  lanes.forEach((lane, i) => {
    const y = m.t + i * row;
    const g = el("svg:g", { "data-lane": lane.name }, svg);
    el("svg:text", { x: m.l - 4, y: y + 12, "text-anchor": "end" }, g, lane.name);
    el("svg:line", { x1: m.l, x2: w - m.r, y1: y + row - 1, y2: y + row - 1, class: "axis" }, g);
    const paths = {};
    for (const [s, e, kind] of lane.spans) {
      const key = lane.name === "publish" ? "publish" : kind;
      const x = X(s), width = Math.max(1, X(e) - x);
      paths[key] = (paths[key] || "") + `M${x.toFixed(1)} ${y + 3}h${width.toFixed(1)}v${row - 7}h${(-width).toFixed(1)}z`;
    }
    for (const [kind, d] of Object.entries(paths)) {
      el("svg:path", { d, fill: `var(--${KINDS.includes(kind) ? kind : "publish"})`, "data-kind": kind }, g);
    }
  });
  const yAxis = m.t + lanes.length * row;
  el("svg:text", { x: m.l, y: yAxis + 12 }, svg, `${fmt(t0, 1)} s`);
  el("svg:text", { x: w - m.r, y: yAxis + 12, "text-anchor": "end" }, svg, `${fmt(t1, 1)} s (launcher clock)`);
  const keys = KINDS.concat(["publish"]).map((k) => [k, `var(--${k})`]);
  let x = m.l + 80;
  for (const [name, color] of keys) {
    el("svg:rect", { x, y: yAxis + 4, width: 9, height: 9, fill: color }, svg);
    el("svg:text", { x: x + 12, y: yAxis + 12 }, svg, name);
    x += 22 + 6 * name.length;
  }
}

function histogram(svg, st) {
  const { w, h } = canvas(svg, 130);
  const m = { l: 34, r: 8, t: 18, b: 18 };
  const counts = st.counts || {};
  const keys = Object.keys(counts).map(Number);
  const top = Math.max(0, ...keys, st.bound || 0);
  svg.dataset.bars = keys.length;
  if (!keys.length) {
    el("svg:text", { x: w / 2, y: h / 2, "text-anchor": "middle", class: "empty" }, svg, "no steps yet");
    return;
  }
  const peak = Math.max(...Object.values(counts), 1);
  const bw = (w - m.l - m.r) / (top + 1);
  el("svg:rect", { x: m.l, y: m.t, width: w - m.l - m.r, height: h - m.t - m.b, class: "axis" }, svg);
  for (let k = 0; k <= top; k++) {
    const n = counts[k] || 0, bh = ((h - m.t - m.b) * n) / peak;
    el("svg:rect", { x: m.l + k * bw + 2, y: h - m.b - bh, width: Math.max(1, bw - 4), height: bh, class: "bar" }, svg);
    el("svg:text", { x: m.l + (k + 0.5) * bw, y: h - 4, "text-anchor": "middle" }, svg, String(k));
    if (n) el("svg:text", { x: m.l + (k + 0.5) * bw, y: h - m.b - bh - 2, "text-anchor": "middle" }, svg, String(n));
  }
  el("svg:text", { x: m.l, y: m.t - 6 }, svg, `${st.unit} by staleness`);
  if (st.bound !== null && st.bound !== undefined) {
    const x = m.l + (st.bound + 1) * bw;
    el("svg:line", { x1: x, x2: x, y1: m.t, y2: h - m.b, class: "mark" }, svg);
    el("svg:text", { x: x - 3, y: m.t - 6, "text-anchor": "end" }, svg, `bound ${st.bound}`);
  }
}

const PANELS = [
  ["throughput", "Throughput", "pair", "trained samples/s (between step records) and generated tokens/s, by launcher time"],
  ["timeline", "Timeline (last 3 minutes)", "gantt", "learner: waiting then training per step; generators: decoding groups, loading weights; gaps are idle"],
  ["staleness", "Staleness", "pair", "histogram with the bound in force; max and mean per step, the bound, and where it moved"],
  ["rewards", "Rewards", "one", "mean reward of each step's samples; each reward's running mean (task.rewards)"],
  ["evaluation", "Held-out evaluation", "one", "accuracy by policy_version: before and after training, and eval records"],
  ["lengths", "Completion lengths", "one", "mean tokens per completion, per step: generated, trained, dropped"],
  ["prompts", "Prompt record", "pair", "estimated pass rates of the prompts sampled so far (q10-q90, after each step); fraction of each step's groups all failed or all solved (no learning signal)"],
  ["sync", "Weight sync", "pair", "per version: publish time and the slowest generator's load time (ms); MiB published"],
  ["events", "Events", "events", ""],
  ["config", "Resolved config", "config", ""],
];

function buildRun(info) {
  const sec = el("section", { class: "run", "data-run": info.id }, document.getElementById("runs"));
  const title = el("h2", {}, sec, info.label);
  const badge = el("span", { class: "badge" }, title, "…");
  const head = el("div", { class: "head" }, sec);
  const parts = { sec, badge, head, figs: {}, svgs: {} };
  for (const [key, label, kind, note] of PANELS) {
    const panel = el("div", { class: "panel", "data-panel": key }, sec);
    el("h3", {}, panel, label);
    if (kind === "pair") {
      const pair = el("div", { class: "pair" }, panel);
      parts.svgs[key] = [el("svg:svg", {}, el("div", {}, pair)), el("svg:svg", {}, el("div", {}, pair))];
    } else if (kind === "events") {
      parts.events = el("ul", { class: "events" }, panel);
    } else if (kind === "config") {
      const details = el("details", {}, panel);
      el("summary", {}, details, "config.json");
      parts.config = el("pre", {}, details, "-");
    } else {
      parts.svgs[key] = [el("svg:svg", { "data-chart": key }, el("div", {}, panel))];
    }
    if (note) parts.notes = el("p", { class: "note" }, panel, note);
  }
  parts.svgs.throughput[0].dataset.chart = "throughput";
  [parts.svgs.prompts[0].dataset.chart, parts.svgs.prompts[1].dataset.chart] = ["pass_rates", "degenerate"];
  return parts;
}

const HEAD = [
  ["step", (h) => `${h.step}/${fmt(h.total_steps)}`],
  ["phase", (h) => h.status || h.phase],
  ["policy_version", (h) => h.policy_version],
  ["samples/s", (h) => `${fmt(h.samples_per_s, 1)} (last ${fmt(h.recent_samples_per_s, 1)})`],
  ["tokens/s", (h) => fmt(h.tokens_per_s, 1)],
  ["trained", (h) => `${h.trained} / generated ${h.generated}`],
  ["elapsed", (h) => `${duration(h.elapsed_s)} ETA ${duration(h.eta_s)}`],
  ["held-out", (h) => `${fmt(h.eval_before, 3)} → ${fmt(h.eval_after, 3)}`],
  ["staleness", (h) => `max ${h.max_staleness} bound ${fmt(h.staleness_bound)} mean ${fmt(h.mean_staleness, 2)}`],
  ["restarts", (h) => fmt(h.restarts)],
  ["errors", (h) => fmt(h.errors)],
];

function renderHead(parts, s) {
  const h = s.head;
  for (const [name, value] of HEAD) {
    let node = parts.figs[name];
    if (!node) {
      const div = el("div", {}, parts.head);
      el("span", {}, div, name);
      node = parts.figs[name] = el("b", { "data-k": name }, div);
    }
    node.textContent = value(h);
  }
  parts.sec.dataset.step = h.step;
  parts.badge.textContent = s.live ? "live" : h.status || "replay";
  parts.badge.className = "badge" + (s.live ? " live" : "");
}

function pick(series, prefix) {
  return Object.keys(series).filter((k) => k.startsWith(prefix)).sort()
    .map((k) => ({ name: k.slice(prefix.length), pts: series[k] }));
}

function evalLines(s) {
  const h = s.head, pts = [];
  if (h.eval_before !== null) pts.push([0, h.eval_before, h.eval_before, h.eval_before]);
  for (const e of s.evals) if (!Number.isNaN(e.accuracy)) pts.push([e.version, e.accuracy, e.accuracy, e.accuracy]);
  if (h.eval_after !== null) pts.push([h.policy_version, h.eval_after, h.eval_after, h.eval_after]);
  pts.sort((a, b) => a[0] - b[0]);
  const lines = [{ name: "accuracy", pts }];
  // pass@1 is the accuracy itself (docs/monitor.md, "Evaluation curve"): only k > 1 gets a line
  const ks = new Set(s.evals.flatMap((e) => Object.keys(e.pass_at_k || {}).filter((k) => k !== "1")));
  for (const k of [...ks].sort()) {
    const kp = s.evals.filter((e) => e.pass_at_k && k in e.pass_at_k).map((e) => [e.version, e.pass_at_k[k], e.pass_at_k[k], e.pass_at_k[k]]);
    lines.push({ name: `pass@${k}`, pts: kp });
  }
  return lines;
}

function render(parts, s) {
  const se = s.series;
  renderHead(parts, s);
  const [thr, tok] = parts.svgs.throughput;
  lineChart(thr, [{ name: "trained samples/s", pts: se.samples_per_s }], { xlabel: "s", zero: true, band: true });
  lineChart(tok, [{ name: "generated tokens/s", pts: se.tokens_per_s, color: COLORS[1] }], { xlabel: "s", zero: true, band: true });
  gantt(parts.svgs.timeline[0], s.timeline);
  const [hist, stl] = parts.svgs.staleness;
  histogram(hist, s.staleness);
  const marks = s.staleness.decisions.map(([step, old, now]) => ({ x: step, label: `${old}→${now}` }));
  lineChart(stl, [
    { name: "max", pts: se.staleness_max }, { name: "mean", pts: se.staleness_mean },
    { name: "bound", pts: se.staleness_bound, color: COLORS[4] },
  ], { xlabel: "step", zero: true, marks });
  lineChart(parts.svgs.rewards[0], [{ name: "mean reward", pts: se.reward }].concat(pick(se, "reward/")), { xlabel: "step", band: true });
  const versions = [0].concat(s.head.total_steps ? [s.head.total_steps] : []);  // the whole run's span
  lineChart(parts.svgs.evaluation[0], evalLines(s), { xlabel: "version", xInclude: versions, empty: "no held-out evaluation recorded" });
  lineChart(parts.svgs.lengths[0], pick(se, "length/"), { xlabel: "step", zero: true });
  const [passRates, degenerate] = parts.svgs.prompts;
  const bounds = { yInclude: [0, 1], xlabel: "step", empty: "no groups observed yet" };
  lineChart(passRates, pick(se, "pass_rate/"), bounds);
  lineChart(degenerate, [{ name: "degenerate groups", pts: se.degenerate_fraction, color: COLORS[3] }], bounds);
  const [syncTime, syncSize] = parts.svgs.sync;
  lineChart(syncTime, [
    { name: "publish ms", pts: se["sync/publish_ms"] }, { name: "load ms (slowest)", pts: se["sync/load_ms"] },
  ], { xlabel: "version", zero: true, band: true });
  lineChart(syncSize, [{ name: "MiB", pts: se["sync/mib"], color: COLORS[2] }], { xlabel: "version", zero: true, band: true });
  renderEvents(parts, s);
}

function renderEvents(parts, s) {
  const items = s.events.map(([t, kind, text]) => [t, kind, text]).concat(s.lint.map((w) => [null, "lint", w]));
  parts.events.replaceChildren();
  for (const [t, kind, text] of items.slice().reverse()) {
    const li = el("li", { class: kind }, parts.events);
    el("span", {}, li, t === null ? "lint" : `${fmt(t, 1)}s`);
    li.appendChild(document.createTextNode(text));
  }
  if (!items.length) el("li", {}, parts.events, "none");
}

async function getJSON(url) {
  const response = await fetch(url, { credentials: "same-origin" });
  if (!response.ok) throw new Error(`${url}: ${response.status} ${await response.text()}`);
  return response.json();
}

async function follow(info, status) {
  const parts = buildRun(info);
  const base = `api/runs/${info.id}`;
  getJSON(`${base}/config`).then((c) => { parts.config.textContent = JSON.stringify(c, null, 2); });
  const first = await getJSON(`${base}/state`);
  render(parts, first);
  if (!first.live) return;
  const source = new EventSource(`${base}/stream`);
  source.addEventListener("state", (e) => {
    try {
      const s = JSON.parse(e.data);
      render(parts, s);
      parts.sec.dataset.updates = Number(parts.sec.dataset.updates || 0) + 1;
      if (!s.live) source.close();
    } catch (err) {
      status.textContent = `${info.label}: ${err}`;  // shown, and the next message tries again
      console.error(err);
    }
  });
  source.onerror = () => { status.textContent = `stream of ${info.label} interrupted; retrying`; };
  source.onopen = () => { status.textContent = "live"; };
}

async function main() {
  const status = document.getElementById("status");
  try {
    const runs = await getJSON("api/runs");
    await Promise.all(runs.map((info) => follow(info, status)));
    status.textContent = `${runs.length} run(s)`;
    document.body.dataset.ready = "1";
    document.body.dataset.readyMs = String(Math.round(performance.now()));
  } catch (err) {
    status.textContent = String(err);
    console.error(err);
  }
}

main();
