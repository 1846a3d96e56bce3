"""Bring your own task, in real launches: a dataset from a local file, rewards as `pkg.mod:fn`
callables, and hostile inputs (bad rows, rewards that raise or hang, a verifier that is down and
comes back, a stall). Each run either completes with the failures counted and the ledger exact, or
stops with one clear line; none hangs.

The dataset is addition prompts (the tiny model's tokenizer reads digits and `+=`), one row per
group, with a `row` extra field that the test rewards (tests/byo_rewards.py) misbehave on."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys

import pytest
from conftest import read_records, short_job_args

from tests.support.waiting import RunRecords

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

NUM_ROWS = 20
GROUPS, SAMPLES = 4, 4
STEPS = NUM_ROWS // GROUPS  # one epoch


def write_rows(path, num_rows=NUM_ROWS):
    with open(path, "w") as f:
        for i in range(num_rows):
            a, b = (7 * i) % 50, (3 * i + 1) % 50
            f.write(json.dumps({"q": f"{a}+{b}=", "a": str(a + b), "row": i}) + "\n")
    return path


def dataset_sets(path, *extra):
    return [
        "task.kind=dataset",
        f'task.dataset.path="{path}"',
        'task.dataset.prompt_field="q"',
        'task.dataset.answer_field="a"',
        'task.dataset.extra_fields=["row"]',
        f"learner.steps={STEPS}",
        f"learner.groups_per_step={GROUPS}",
        f"learner.samples_per_group={SAMPLES}",
        *extra,
    ]


def reward(kind, name="verifier", **options):
    opts = ", ".join(f'{k} = "{v}"' if isinstance(v, str) else f"{k} = {v}" for k, v in options.items())
    return f'task.rewards=[{{kind = "{kind}", name = "{name}", options = {{{opts}}}}}]'


def launch(tiny_model_dir, tmp_path, *sets, name="byo", timeout=300):
    return subprocess.run(
        short_job_args(tiny_model_dir, tmp_path, *sets, name=name),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def launch_ok(tiny_model_dir, tmp_path, *sets) -> dict:
    """Launch to completion (exit 0); the run's summary.json."""
    proc = launch(tiny_model_dir, tmp_path, *sets)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads((tmp_path / "byo" / "summary.json").read_text())


def exact_ledger(summary, *, steps=STEPS):
    assert summary["status"] == "completed", summary
    assert summary["steps"] == steps
    assert summary["trajectories_trained"] == summary["trajectories_generated"] == steps * GROUPS * SAMPLES
    assert summary["trajectories_lost"] == 0 and summary["trajectories_duplicated"] == 0
    assert summary["duplicates"] == 0


@pytest.mark.parametrize(
    "content, expect",
    [
        ('{"q": "1+2=", "a": "3", "row": 0}\n{"q": "2+2=", "a": "4", "row": 1\n', ["line 2"]),
        ('{"q": "1+2=", "row": 0}\n', ["'a'", "task.dataset.answer_field"]),
        ("", ["empty"]),
    ],
    ids=["malformed-line", "missing-field", "empty-file"],
)
def test_bad_data_stops_before_any_process_with_one_clear_line(tiny_model_dir, tmp_path, content, expect):
    data = tmp_path / "data.jsonl"
    data.write_text(content)
    proc = launch(tiny_model_dir, tmp_path, *dataset_sets(data), timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    err = proc.stderr.strip()
    assert "Traceback" not in proc.stdout + proc.stderr
    assert str(data) in err and all(e in err for e in expect), err
    assert "started learner" not in proc.stdout + proc.stderr
    assert not (tmp_path / "byo").exists() or not (tmp_path / "byo" / "metrics.jsonl").exists()


def test_dataset_smaller_than_a_step_is_refused_at_load(tiny_model_dir, tmp_path):
    data = write_rows(tmp_path / "data.jsonl", num_rows=3)
    proc = launch(tiny_model_dir, tmp_path, *dataset_sets(data), timeout=120)
    assert proc.returncode == 2 and "learner.groups_per_step" in proc.stderr, proc.stdout + proc.stderr


def test_a_reward_that_raises_on_ten_percent_is_counted_and_the_run_completes(tiny_model_dir, tmp_path):
    data = write_rows(tmp_path / "data.jsonl")
    summary = launch_ok(
        tiny_model_dir,
        tmp_path,
        *dataset_sets(data, reward("tests.byo_rewards:raises_on_tenth")),
    )
    exact_ledger(summary)
    # Rows 0 and 10 raise: 2 groups x 4 samples, each scored 0 for that reward.
    assert summary["reward_failures"] == {"verifier": 2 * SAMPLES}
    assert summary["samples_scored"] == NUM_ROWS * SAMPLES
    assert summary["samples_with_failed_reward"] == 2 * SAMPLES
    assert set(summary["reward_means"]) == {"verifier"}


def test_regenerate_draws_failed_samples_again_and_counts_them(tiny_model_dir, tmp_path):
    data = write_rows(tmp_path / "data.jsonl")
    summary = launch_ok(
        tiny_model_dir,
        tmp_path,
        *dataset_sets(
            data,
            reward("tests.byo_rewards:raises_on_tenth"),
            "task.scoring.on_failure=regenerate",
            "task.scoring.max_regenerations=1",
        ),
    )
    exact_ledger(summary)
    # The failure is deterministic (the row), so each failed sample is drawn once more and fails again.
    assert summary["samples_regenerated"] == 2 * SAMPLES
    assert summary["reward_failures"] == {"verifier": 2 * 2 * SAMPLES}
    assert summary["samples_scored"] == (NUM_ROWS + 2) * SAMPLES


def test_a_reward_that_hangs_times_out_and_the_run_completes(tiny_model_dir, tmp_path):
    data = write_rows(tmp_path / "data.jsonl")
    summary = launch_ok(
        tiny_model_dir,
        tmp_path,
        *dataset_sets(data, reward("tests.byo_rewards:hangs_on_tenth"), "task.scoring.timeout_s=1.0"),
    )
    exact_ledger(summary)
    assert summary["reward_failures"] == {"verifier": 2 * SAMPLES}  # rows 3 and 13


def test_failures_past_the_budget_stop_the_run_with_one_line(tiny_model_dir, tmp_path):
    data = write_rows(tmp_path / "data.jsonl")
    proc = launch(
        tiny_model_dir,
        tmp_path,
        *dataset_sets(
            data,
            reward("tests.byo_rewards:raises_on_tenth"),
            "task.scoring.failure_budget=0.01",
            "task.scoring.failure_budget_min_samples=1",
        ),
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "task.scoring.failure_budget" in proc.stderr and "verifier" in proc.stderr, proc.stderr
    summary = json.loads((tmp_path / "byo" / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["trajectories_lost"] == 0


def test_a_stalled_run_stops_naming_what_it_waits_for(tiny_model_dir, tmp_path):
    """A reward that never returns with no reward timeout to speak of: the generator stays alive
    and keeps its heartbeat, and nothing moves; the watchdog ends the run."""
    data = write_rows(tmp_path / "data.jsonl")
    proc = launch(
        tiny_model_dir,
        tmp_path,
        *dataset_sets(
            data,
            reward("tests.byo_rewards:hangs_on_tenth"),
            "task.scoring.timeout_s=100000",
            "monitor.stall_timeout_s=5",
        ),
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "stalled" in proc.stderr and "monitor.stall_timeout_s" in proc.stderr, proc.stderr
    assert "gen-0" in proc.stderr and "--resume" in proc.stderr, proc.stderr


def test_resume_trains_every_prompt_of_the_epoch_exactly_once(tiny_model_dir, tmp_path, launch_streamed):
    data = write_rows(tmp_path / "data.jsonl")
    scored = tmp_path / "scored.txt"
    sets = dataset_sets(
        data,
        reward("tests.byo_rewards:recording", path=str(scored)),
        "run.checkpoint_every=1",
        "mode=sync",
    )
    run_dir = tmp_path / "crash"
    lines = launch_streamed(short_job_args(tiny_model_dir, tmp_path, *sets, name="crash"))
    learner_pid = int(lines.wait_for(r"^started learner \(pid (\d+)\)", timeout_s=200)[1])
    # The launcher saves its checkpoint of version 2 before it reports step 3 (sync mode,
    # checkpoint_every = 1): wait for that line.
    lines.wait_for(r"^step 3/", timeout_s=200)
    assert (run_dir / "checkpoints" / "launcher-00000002.json").exists()
    os.kill(learner_pid, signal.SIGKILL)
    assert lines.wait_exit(timeout_s=120) != 0
    resumed = subprocess.run(
        [sys.executable, "-m", "asyncrl", "launch", "--no-tui", "--resume", str(run_dir)],
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    resumed_from = summary["resumed_from"]
    assert resumed_from >= 2 and summary["status"] == "completed" and summary["steps"] == STEPS
    assert summary["trajectories_trained"] == (STEPS - resumed_from) * GROUPS * SAMPLES
    assert summary["trajectories_lost"] == 0 and summary["trajectories_duplicated"] == 0
    assert summary["dataset_position"] == {"next_group": NUM_ROWS, "epoch": 1, "row_in_epoch": 0}
    # Every step is in the records (a step the crashed run trained past its last checkpoint is
    # trained again from the checkpoint: its weights died with the learner).
    assert sorted({r["step"] for r in read_records(run_dir, "step")}) == list(range(STEPS))
    # Every row of the epoch was generated and scored (a group re-run after the crash may be
    # scored twice; the ledger above says each group was trained exactly once).
    rows = [int(line.split()[0]) for line in scored.read_text().splitlines()]
    assert sorted(set(rows)) == list(range(NUM_ROWS))
    assert all(rows.count(r) % SAMPLES == 0 for r in set(rows))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_remote_verifier_that_is_down_then_comes_back(tiny_model_dir, tmp_path, launch_streamed):
    """Down at the start (nothing listens on its port): samples scored meanwhile fail, counted;
    once a failure is on record the verifier starts, and later groups score again."""
    port = _free_port()
    data = write_rows(tmp_path / "data.jsonl")
    steps = 4 * STEPS  # four epochs: long enough to see the verifier come back
    sets = dataset_sets(
        data,
        reward(
            "remote",
            name="remote",
            url=f"http://127.0.0.1:{port}/score",
            timeout_s=2.0,
            retries=1,
            backoff_s=0.1,
        ),
        f"learner.steps={steps}",
        "task.scoring.failure_budget=1.0",
    )
    run_dir = tmp_path / "byo"
    lines = launch_streamed(short_job_args(tiny_model_dir, tmp_path, *sets, name="byo"))
    lines.wait_for(r"^started learner ", timeout_s=200)  # the record stream is up
    with RunRecords(run_dir, lines) as records:  # the failure is on record there, not in the output
        records.wait_for(
            lambda r: any(t["reward_failures"] for t in r.of("task")),
            timeout_s=200,
            what="a failed remote reward on record",
        )
    verifier = subprocess.Popen(
        [sys.executable, "-m", "asyncrl.testing.verifier", "--port", str(port)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert verifier.stdout.readline().startswith("http://127.0.0.1:")
        code = lines.wait_exit(timeout_s=300)
    finally:
        verifier.kill()  # the verifier this test started
        verifier.wait()
    assert code == 0, lines.tail()
    summary = json.loads((run_dir / "summary.json").read_text())
    exact_ledger(summary, steps=steps)
    failed = summary["reward_failures"]["remote"]
    assert 0 < failed < steps * GROUPS * SAMPLES
    tasks = read_records(run_dir, "task")
    assert not tasks[-1]["reward_failures"] and "remote" in tasks[-1]["reward_sums"]


def test_dynamic_sampling_keeps_every_step_full_in_pool_mode(tiny_model_dir, tmp_path):
    """DAPO dynamic sampling: groups whose rewards are all equal leave as they complete and
    are replaced by new prompts, so every step trains groups_per_step informative groups."""
    data = write_rows(tmp_path / "data.jsonl")
    summary = launch_ok(
        tiny_model_dir,
        tmp_path,
        *dataset_sets(
            data,
            reward("tests.byo_rewards:degenerate_on_even_rows"),
            "buffer.mode=pool",
            "learner.drop_degenerate_groups=true",
        ),
    )
    assert summary["status"] == "completed" and summary["steps"] == STEPS
    assert summary["trajectories_lost"] == 0 and summary["trajectories_duplicated"] == 0
    steps = read_records(tmp_path / "byo", "step")
    assert [len(r["groups_trained"]) for r in steps] == [GROUPS] * STEPS
    assert summary["trajectories_trained"] == STEPS * GROUPS * SAMPLES
    # Even rows are degenerate: about half of the admitted groups left, each counted.
    dropped = summary["evicted_by_reason"]["degenerate"]
    assert dropped >= STEPS * GROUPS * SAMPLES // 2 and dropped % SAMPLES == 0


def test_dynamic_sampling_stops_when_no_group_has_a_signal(tiny_model_dir, tmp_path):
    """The untrained tiny model never adds correctly: every group scores all 0, over-sampling
    cannot fill a step, and the run stops with the reason instead of generating forever."""
    data = write_rows(tmp_path / "data.jsonl")
    proc = launch(
        tiny_model_dir,
        tmp_path,
        *dataset_sets(
            data,
            reward("exact_match"),
            "buffer.mode=pool",
            "learner.drop_degenerate_groups=true",
            "learner.max_degenerate_per_step=1",
        ),
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "learner.max_degenerate_per_step" in proc.stderr, proc.stderr


def test_a_sample_the_learner_would_reject_is_drawn_again(tiny_model_dir, tmp_path):
    """Sample 0 of every group first comes back with a NaN log-prob: the generator draws it
    again instead of sending it (a rejected trajectory would leave its step waiting forever)."""
    data = write_rows(tmp_path / "data.jsonl")
    summary = launch_ok(
        tiny_model_dir,
        tmp_path,
        *dataset_sets(data, "generators.kind=tests.byo_generators:NanOnFirstDraw"),
    )
    exact_ledger(summary)
    assert summary["samples_invalid_redrawn"] == summary["samples_regenerated"] == NUM_ROWS
