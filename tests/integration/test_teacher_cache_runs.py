"""Launched runs with the teacher-score cache and several teachers (docs/opd.md).

* A repeated sync run (same config and seed: its samples are the first run's) pointed at the
  first run's cache asks no teacher for anything and trains bitwise alike: every step's loss and
  gradient norm equal the first run's, the summary counts every sample as a hit.
* Two teachers placed as services on a task of two domains: one teacher process each, every
  generator sample routed, the gap per domain and the cache counters per teacher in the records.
"""

from __future__ import annotations

import json
import subprocess

import pytest

from tests.conftest import read_records, short_job_args

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory):
    from asyncrl.models.tiny import create_base

    return create_base(
        tmp_path_factory.mktemp("teacher") / "model", hidden_size=32, num_layers=1, num_heads=2, seed=1
    )


def launch(args):
    proc = subprocess.run(args, capture_output=True, text=True, timeout=200)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def steps(run_dir):
    return [(r["step"], r["loss"], r["grad_norm"]) for r in read_records(run_dir, "step")]


def test_a_repeated_run_reuses_every_teacher_score_bitwise(tiny_model_dir, teacher_dir, tmp_path):
    sets = (
        "mode=sync",
        "opd.enabled=true",
        f'opd.teacher="{teacher_dir}"',
        "opd.num_samples=2",
        "opd.cache=true",
        f'opd.cache_dir="{tmp_path / "cache"}"',
    )
    launch(short_job_args(tiny_model_dir, tmp_path, *sets, name="first"))
    launch(short_job_args(tiny_model_dir, tmp_path, *sets, name="again"))
    first = json.loads((tmp_path / "first" / "summary.json").read_text())
    again = json.loads((tmp_path / "again" / "summary.json").read_text())
    assert first["teacher_cache"]["misses"] > 0
    assert (
        first["teacher_cache"]["hits"] + first["teacher_cache"]["misses"] == first["trajectories_generated"]
    )
    assert again["teacher_cache"]["misses"] == 0 and again["teacher_cache"]["teacher_calls"] == 0
    assert (
        again["teacher_cache"]["hits"] == again["trajectories_generated"] == first["trajectories_generated"]
    )
    assert steps(tmp_path / "again") == steps(tmp_path / "first")  # bitwise: JSON floats round-trip exactly


def test_two_teacher_services_score_their_domains(tiny_model_dir, teacher_dir, tmp_path):
    rows = [
        {"prompt": f"{a}+{a + 1}=", "answer": str(2 * a + 1), "domain": "low" if a < 5 else "high"}
        for a in range(10)
    ]
    data = tmp_path / "mixed.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = short_job_args(
        tiny_model_dir,
        tmp_path,
        "task.kind=dataset",
        f'task.dataset.path="{data}"',
        'task.dataset.extra_fields=["domain"]',
        "opd.enabled=true",
        "opd.placement=service",
        "opd.cache=true",
        f'opd.teachers=[{{name="lo", path="{teacher_dir}", domains=["low"]}}, {{name="hi", path="{tiny_model_dir}", domains=["high"]}}]',
        "learner.steps=3",
    )
    launch(args)
    run_dir = tmp_path / "t"
    spawned = {r["peer_id"]: r["role"] for r in read_records(run_dir, "spawn")}
    assert spawned["opd-teacher-lo"] == spawned["opd-teacher-hi"] == "teacher"
    assert "opd-teacher" not in spawned
    gen = [r for r in read_records(run_dir, "metrics") if r["source"].startswith("gen")]
    keys = set().union(*gen)
    assert {"opd/kl/domain/low", "opd/kl/domain/high", "opd/kl/teacher/lo", "opd/kl/teacher/hi"} <= keys
    summary = json.loads((run_dir / "summary.json").read_text())
    counts = summary["teacher_cache"]
    assert counts["hits"] + counts["misses"] == summary["trajectories_generated"]
    served = {
        r["source"]: r["teacher/sequences"]
        for r in read_records(run_dir, "metrics")
        if r["source"].startswith("opd-")
    }
    assert set(served) <= {"opd-teacher-lo", "opd-teacher-hi"} and sum(served.values()) <= counts["misses"]
