"""The web monitor in a real headless browser (Debian's chromium + chromium-driver, selenium),
against a real launch of the default job, its finished run directory, and a 100,000-step run
directory; the terminal dashboard's figures are checked against the same records.

Install the browser with `.ci/setup-browser` (as root: apt-get install chromium chromium-driver).
With ASYNCRL_WEB_SCREENSHOTS=DIR the test saves the screenshots docs/monitor.md shows there.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.conftest import read_records

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
# The acceptance bound of issue #40: a 100,000-step run's page is interactive within 2 s.
INTERACTIVE_BOUND_MS = 2000
BIG_STEPS = 100_000
URL = re.compile(r"web monitor: (http://\S+)")
SCREENSHOTS = os.environ.get("ASYNCRL_WEB_SCREENSHOTS")

pytestmark = [pytest.mark.slow]


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    webdriver = pytest.importorskip("selenium.webdriver", reason="pip install -e '.[test]' (selenium)")
    if not (CHROMIUM.exists() and CHROMEDRIVER.exists()):
        pytest.skip(
            "no chromium: run .ci/setup-browser (apt-get install -y chromium chromium-driver) as root"
        )
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    for flag in (
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--window-size=1280,2300",
        f"--user-data-dir={tmp_path_factory.mktemp('chromium-profile')}",
    ):
        options.add_argument(flag)
    options.binary_location = str(CHROMIUM)
    driver = webdriver.Chrome(options=options, service=Service(str(CHROMEDRIVER)))
    yield driver
    driver.quit()


class Served:
    """A command that prints the web monitor's URL; its output is collected by a thread."""

    def __init__(self, args: list[str], deadline_s: float) -> None:
        self.started = time.monotonic()
        self.proc = subprocess.Popen(
            args,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, "COLUMNS": "160"},
        )
        self.lines: list[str] = []
        self.url_seen = threading.Event()
        self.reader = threading.Thread(target=self._read, name="served-output", daemon=True)
        self.reader.start()
        if not self.url_seen.wait(deadline_s):
            self.stop()
            raise AssertionError("no web monitor URL in the output:\n" + "".join(self.lines[-40:]))
        self.ready_s = time.monotonic() - self.started
        self.url = next(m.group(1) for line in self.lines if (m := URL.search(line)))

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)
            if URL.search(line):
                self.url_seen.set()

    def output(self) -> str:
        return "".join(self.lines)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()  # this test's own process, by its pid
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def wait_for(driver, condition, timeout_s: float, what: str):
    """`condition(driver)` once truthy, polled; on timeout, what the page said and logged."""
    from selenium.common.exceptions import TimeoutException
    from selenium.webdriver.support.ui import WebDriverWait

    try:
        return WebDriverWait(driver, timeout_s, poll_frequency=0.1).until(condition)
    except TimeoutException:
        status = driver.execute_script("return document.getElementById('status')?.textContent")
        console = [entry["message"] for entry in driver.get_log("browser")]
        raise AssertionError(
            f"{what}: not within {timeout_s} s; page status {status!r}, console {console}"
        ) from None


def figures(driver) -> dict:
    """The first run's headline figures, chart point counts and timeline lanes, read from the DOM."""
    return driver.execute_script(
        """
        const sec = document.querySelector("section.run");
        if (!sec || !document.body.dataset.ready) return null;
        const head = {};
        for (const b of sec.querySelectorAll("[data-k]")) head[b.dataset.k] = b.textContent;
        return {
          head,
          badge: sec.querySelector(".badge").textContent,
          throughput: Number(sec.querySelector("svg[data-chart=throughput]").dataset.points || 0),
          lanes: (sec.querySelector("[data-panel=timeline] svg").dataset.lanes || "").split(","),
          kinds: [...sec.querySelectorAll("[data-panel=timeline] path")].map((p) => p.dataset.kind),
          updates: Number(sec.dataset.updates || 0),
        };
        """
    )


def step_of(fig) -> int:
    return int(fig["head"]["step"].split("/")[0]) if fig else -1


def screenshot(driver, name: str) -> None:
    if SCREENSHOTS:
        Path(SCREENSHOTS).mkdir(parents=True, exist_ok=True)
        driver.save_screenshot(str(Path(SCREENSHOTS) / name))


@pytest.mark.timeout(600)
def test_live_default_job_then_its_finished_run_directory(browser, tmp_path):
    """The default job with --web: the page loads, its step counter and throughput chart advance
    while the run trains, the timeline has learner and generator lanes; then the finished run's
    page from its run directory alone, and both dashboards' figures against the records."""
    args = [sys.executable, "-m", "asyncrl", "launch", "--no-tui", "--web", "--web-port", "0"]
    args += ["--set", f'run.out_dir="{tmp_path}"', "--set", 'run.name="live"']
    if not SCREENSHOTS:  # the default job, shortened (the documentation's screenshots: all of it)
        args += ["--set", "learner.steps=30", "--set", "task.num_eval=100"]
    launch = Served(args, deadline_s=240)  # a deadline: a loaded machine takes long to import
    try:
        browser.get(launch.url)
        wait_for(browser, lambda d: d.execute_script("return document.body.dataset.ready"), 30, "the page")
        first = wait_for(browser, lambda d: (f := figures(d)) and step_of(f) >= 1 and f, 240, "a first step")
        later = wait_for(
            browser,
            lambda d: (
                (f := figures(d))
                and step_of(f) > step_of(first)
                and f["throughput"] > first["throughput"]
                and f
            ),
            60,
            "the step counter and the throughput chart advance",
        )
        total = int(later["head"]["step"].split("/")[1])
        assert step_of(later) < total and later["badge"] == "live", later  # still training
        assert later["updates"] >= 1  # by the stream, not by reloading
        assert "learner" in later["lanes"] and "gen-0" in later["lanes"], later["lanes"]
        assert {"training", "decoding"} <= set(later["kinds"]), later["kinds"]
        if SCREENSHOTS:  # the documentation's picture: halfway through
            wait_for(browser, lambda d: step_of(figures(d)) >= total // 2, 120, "halfway")
            screenshot(browser, "web_monitor_live.png")
        assert launch.proc.wait(timeout=180) == 0, launch.output()[-3000:]
    except AssertionError as exc:
        exc.add_note("the launch's output, last lines:\n" + launch.output()[-3000:])
        raise
    finally:
        launch.stop()
    run_dir = tmp_path / "live"
    check_finished_run(browser, run_dir)
    check_terminal_dashboard(run_dir)


def expected_from_records(run_dir: Path) -> dict:
    steps = read_records(run_dir, "step")
    held_out = {
        r["held_out"]["phase"]: r["held_out"]["accuracy"]
        for r in read_records(run_dir, "event")
        if "held_out" in r
    }
    return {
        "steps": len(steps),
        "trained": sum(r["num_trajectories"] for r in steps),
        "generated": sum(r["num_trajectories"] for r in read_records(run_dir, "task")),
        "max_staleness": max(r["max_staleness"] for r in steps),
        "before": held_out["before"],
        "after": held_out["after"],
        # the per-prompt record's charts: a point per quantile per step, and per step with groups
        "pass_rate_points": sum(len(r.get("pass_rate_quantiles") or {}) for r in steps),
        "degenerate_points": sum(r.get("degenerate_fraction") is not None for r in steps),
    }


def check_finished_run(browser, run_dir: Path) -> None:
    """The finished run's page, from its run directory alone, beside a second run directory."""
    expected = expected_from_records(run_dir)
    other = run_dir.parent / "other"  # the run's records again, under another name
    other.mkdir()
    for name in ("config.json", "metrics.jsonl", "summary.json"):
        shutil.copy(run_dir / name, other / name)
    args = [sys.executable, "-m", "asyncrl", "monitor", "--web", "--port", "0", str(run_dir), str(other)]
    served = Served(args, 60)
    try:
        browser.get(served.url)
        fig = wait_for(browser, figures, 30, "the finished run's page")
        labels = browser.execute_script(
            "return [...document.querySelectorAll('section.run h2')].map((h) => h.firstChild.textContent)"
        )
        assert labels == [run_dir.name, "other"]  # side by side, in the order given
        head = fig["head"]
        assert head["step"] == f"{expected['steps']}/{expected['steps']}"
        assert head["phase"] == "completed" and fig["badge"] == "completed"
        assert head["trained"] == f"{expected['trained']} / generated {expected['generated']}"
        assert head["held-out"] == f"{expected['before']:.3f} → {expected['after']:.3f}"
        assert head["staleness"].startswith(f"max {expected['max_staleness']} bound 2")
        assert fig["throughput"] >= 2 and "learner" in fig["lanes"] and "gen-0" in fig["lanes"]
        prompts = browser.execute_script(
            "const p = document.querySelector('section.run [data-panel=prompts]');"
            "return [...p.querySelectorAll('svg')].map((s) => [s.dataset.chart, Number(s.dataset.points),"
            " [...s.querySelectorAll('polyline')].map((l) => l.dataset.name)]);"
        )
        assert expected["degenerate_points"] >= 1, expected
        assert prompts == [
            ["pass_rates", expected["pass_rate_points"], ["q10", "q25", "q50", "q75", "q90"]],
            ["degenerate", expected["degenerate_points"], ["degenerate groups"]],
        ]
        screenshot(browser, "web_monitor_finished.png")
    finally:
        served.stop()


def check_terminal_dashboard(run_dir: Path) -> None:
    """The terminal dashboard at 160 columns (the issue's terminal): the same figures."""
    expected = expected_from_records(run_dir)
    proc = subprocess.run(
        [sys.executable, "-m", "asyncrl", "monitor", "--once", str(run_dir)],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "COLUMNS": "160", "LINES": "48"},
    )
    assert proc.returncode == 0, proc.stderr
    screen = " ".join(proc.stdout.split())
    n = expected["steps"]
    assert f"step {n}/{n}" in screen
    assert f"samples {expected['trained']} trained / {expected['trained']}" in screen
    assert f"held-out acc before {expected['before']:.3f} after {expected['after']:.3f}" in screen
    assert f"max {expected['max_staleness']} (bound 2)" in screen
    assert "credits …" not in screen and "trajectorie…" not in screen  # labels no longer cut
    assert screen.count("clip fraction") == 1 and "IS weights clipped" in screen
    last = read_records(run_dir, "step")[-1]  # the per-prompt record's rows, from the last step
    q = last["pass_rate_quantiles"]
    assert f"pass rates q10 {q['q10']:.2f} q50 {q['q50']:.2f} q90 {q['q90']:.2f}" in screen
    frac = last["degenerate_fraction"]
    assert f"degenerate {'-' if frac is None else format(frac, '.2f')} of the step's groups" in screen


def write_big_run(run_dir: Path, num_steps: int) -> None:
    """A finished-looking run directory with `num_steps` step records (each with a publish and a
    load, as a real run writes them), without running anything."""
    run_dir.mkdir(parents=True)
    stats = {"ess_ratio": 1.0, "clip_fraction": 0.0, "mismatch_k3": 0.01, "mean_freshness": 0.94}
    template = {
        "type": "step", "step": -1, "version": -2, "num_trajectories": 256, "num_tokens": 1035,
        "loss": 0.02, "mean_reward": 0.5, "max_staleness": 1, "mean_staleness": 1.0, "clip_fraction": 0.03,
        "grad_norm": 0.5, "step_s": 0.1, "idle_s": 0.01, "lr_scale": 1.0, "stats": stats,
        "lengths": {"generated": 4.1, "trained": 4.0, "evicted": None},
        "length_samples": {"generated": 256, "trained": 256, "evicted": 0}, "staleness_bound": 2,
        "time_s": -3.0,
    }  # fmt: skip
    head, rest = json.dumps(template).split('"step": -1, "version": -2,')
    middle = rest.rsplit('"time_s": -3.0}', 1)[0]
    with open(run_dir / "metrics.jsonl", "w") as f:
        for i in range(num_steps):
            t = 3.0 + 0.12 * i
            f.write(f'{head}"step": {i}, "version": {i + 1},{middle}"time_s": {t:.4f}}}\n')
            f.write(
                f'{{"type": "publish", "version": {i + 1}, "num_bytes": 1335808, "publish_s": 0.02, '
                f'"transport": "shards", "time_s": {t:.4f}}}\n'
            )
            f.write(
                f'{{"type": "loaded", "generator_id": "gen-0", "version": {i + 1}, "load_s": 0.01, "time_s": {t + 0.01:.4f}}}\n'
            )
    config = {
        "mode": "async",
        "learner": {"steps": num_steps, "groups_per_step": 32, "samples_per_group": 8},
        "generators": {"num_generators": 1},
        "staleness": {"max_staleness": 2, "policy": "none"},
    }
    (run_dir / "config.json").write_text(json.dumps(config))


@pytest.mark.timeout(300)
def test_a_100k_step_run_directory_is_interactive_within_2_s(browser, tmp_path):
    run_dir = tmp_path / "big"
    write_big_run(run_dir, BIG_STEPS)
    served = Served([sys.executable, "-m", "asyncrl", "monitor", "--web", "--port", "0", str(run_dir)], 240)
    try:
        browser.get("about:blank")
        start = time.monotonic()
        browser.get(served.url)
        fig = wait_for(browser, figures, 30, "the 100k-step run's page")
        wall_ms = (time.monotonic() - start) * 1e3
        ready_ms = int(browser.execute_script("return document.body.dataset.readyMs"))
        print(
            f"\n100k steps: server read the run directory in {served.ready_s:.2f} s; page interactive "
            f"{ready_ms} ms after navigation ({wall_ms:.0f} ms seen by the test, driver round trips included)"
        )
        assert fig["head"]["step"] == f"{BIG_STEPS}/{BIG_STEPS}"
        assert 100 <= fig["throughput"] <= 2 * 512  # downsampled on the server
        assert ready_ms < INTERACTIVE_BOUND_MS
        # interactive: the page answers an input at once (the config panel opens)
        browser.execute_script("document.querySelector('[data-panel=config] summary').click()")
        assert browser.execute_script("return document.querySelector('[data-panel=config] details').open")
    finally:
        served.stop()
    shutil.rmtree(run_dir)
