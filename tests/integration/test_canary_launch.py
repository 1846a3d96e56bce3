"""The weight-load canary in launched runs on the shipped default model (docs/weights.md, "Canary").

A test fault (ASYNCRL_FAULT_CANARY=v, learner/canary.py) makes the learner publish every version
from v on with one matrix negated before the shards are written, so their checksums are those of
the wrong bytes and pass. Each run is on-policy (staleness.max_staleness = 0), so each generator
loads and acks every version before it samples for the next step: which versions are judged is
fixed, not a race.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import read_records

from asyncrl.learner.canary import FAULT_ENV

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

# Honest float32 scores are the learner's to rounding: the torch generator runs the same kernel on
# the same bytes; the stand-in server its own forward (left padding, explicit positions).
HONEST_TORCH = 1e-6
HONEST_STANDIN = 1e-4


def _launch(
    tmp_path: Path, name: str, *sets: str, fault: str = ""
) -> tuple[subprocess.CompletedProcess, Path]:
    """A short run of the default job (the shipped model and task), on-policy, with the canary."""
    args = [sys.executable, "-m", "asyncrl", "launch", "--no-tui"]
    for s in (
        f'run.out_dir="{tmp_path}"',
        f'run.name="{name}"',
        "learner.groups_per_step=2",
        "learner.samples_per_group=4",
        "task.num_eval=0",
        "staleness.max_staleness=0",
        "weights.canary=true",  # off by default (docs/weights.md, "Canary": its cost)
        *sets,
    ):
        args += ["--set", s]
    env = {k: v for k, v in os.environ.items() if k != FAULT_ENV}
    if fault:
        env[FAULT_ENV] = fault
    out = subprocess.run(args, capture_output=True, text=True, timeout=360, env=env)
    return out, tmp_path / name


def _load_errors(run_dir: Path) -> list[float]:
    return [
        r["gen/weights_load_errors"]
        for r in read_records(run_dir, "metrics")
        if "gen/weights_load_errors" in r
    ]


def test_wrong_weights_under_correct_checksums_are_refused_naming_the_generator(tmp_path):
    """Version 2 on is published wrong: gen-0 acks version 1 (accepted), is refused version 2 and
    restarted, its replacement is refused it again and the run fails naming it; no load error was
    ever counted (every checksum passed)."""
    out, run_dir = _launch(tmp_path, "fault", "learner.steps=6", fault="2")
    text = out.stdout + out.stderr
    assert out.returncode == 1, text
    for part in (
        "generator gen-0: weights version 2 failed the weight-load canary 2 times in a row",
        "weights.canary_tolerance.float32",
        "on torch",
    ):
        assert part in text, (part, text)
    judged = [(r["generator"], r["version"], r["outcome"]) for r in read_records(run_dir, "canary")]
    assert judged == [("gen-0", 1, "accepted"), ("gen-0", 2, "refused"), ("gen-0", 2, "refused")], judged
    records = read_records(run_dir, "canary")
    assert records[0]["mean_abs_delta"] <= HONEST_TORCH
    assert all(r["mean_abs_delta"] > 100 * r["tolerance"] for r in records[1:]), records
    restarts = read_records(run_dir, "restart")
    assert [(r["slot"], r["new_peer_id"]) for r in restarts] == [("gen-0", "gen-0-r1")]
    assert "weight-load canary at weights version 2" in restarts[0]["reason"]
    assert _load_errors(run_dir) and not any(_load_errors(run_dir))  # the checksums passed
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "failed" and "weight-load canary" in summary["error"]
    assert summary["trajectories_lost"] == 0 and summary["trajectories_duplicated"] == 0


def test_async_nothing_sampled_with_a_refused_version_is_trained(tmp_path):
    """With generation ahead of learning (staleness.max_staleness = 2, the default), the generator
    applies version 2 while it samples; what it samples with it waits for the verdict, is never
    sent, and its tasks are drawn again: no trained sample has a token of version 2 or later."""
    out, run_dir = _launch(
        tmp_path,
        "async",
        "learner.steps=6",
        # long answers: generation is the slower stage, so the generator is still sampling the
        # groups admitted earlier when version 2 lands, and samples with it mid-stream
        "learner.groups_per_step=16",
        "sampling.max_new_tokens=40",
        "sampling.ignore_eos=true",
        "staleness.max_staleness=2",
        "run.record_schedule=true",
        fault="2",
    )
    text = out.stdout + out.stderr
    assert out.returncode == 1 and "generator gen-0: weights version" in text, text
    assert "failed the weight-load canary 2 times in a row" in text, text
    steps = sorted((run_dir / "schedule").glob("step-*.pt"))
    assert steps, "no step trained before the refusals"
    newest = max(
        int(s["token_versions"].max()) for p in steps for s in torch.load(p, weights_only=True)["samples"]
    )
    assert newest <= 1, newest
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["trajectories_lost"] == 0 and summary["trajectories_duplicated"] == 0


def test_an_honest_run_reports_its_canary_per_generator_and_version(tmp_path):
    out, run_dir = _launch(tmp_path, "honest", "learner.steps=3", "generators.num_generators=2")
    assert out.returncode == 0, out.stdout + out.stderr
    records = read_records(run_dir, "canary")
    judged = {(r["generator"], r["version"]) for r in records}
    # on-policy: both generators ack versions 1 and 2 before step 2 and 3 are admitted
    assert {("gen-0", 1), ("gen-0", 2), ("gen-1", 1), ("gen-1", 2)} <= judged, judged
    for r in records:
        assert r["outcome"] == "accepted" and r["engine"] == "torch" and r["num_tokens"] > 0, r
        assert r["dtype"] == "float32" and r["tolerance"] == 0.01
        assert r["max_abs_delta"] <= HONEST_TORCH, r
    (summary,) = read_records(run_dir, "canary_summary")
    assert summary["checked"] == len(records) and summary["refused"] == summary["unchecked"] == 0
    assert set(summary["by_generator"]) == {"gen-0", "gen-1"}
    assert summary["max_abs_delta"] == max(r["max_abs_delta"] for r in records)


def test_sglang_servers_score_the_canary_and_a_wrong_version_is_refused_naming_the_server(tmp_path):
    """The SGLang generator with one stand-in server it starts: version 1 is scored on the server
    (input_token_logprobs) and accepted; version 2, published wrong, is refused naming the server,
    then again on the server of the restarted generator, and the run fails."""
    out, run_dir = _launch(
        tmp_path,
        "sglang",
        "learner.steps=5",
        'generators.kind="sglang"',
        "generators.options.launch=1",
        'generators.options.launch_command="python -m tests.support.sglang.server"',
        'generators.options.launch_args="--log-level warning --skip-tokenizer-init"',
        fault="2",
    )
    text = out.stdout + out.stderr
    assert out.returncode == 1, text
    records = read_records(run_dir, "canary")
    assert [(r["version"], r["outcome"]) for r in records] == [
        (1, "accepted"),
        (2, "refused"),
        (2, "refused"),
    ]
    # engine = the server's URL; the restarted generator started a server of its own
    assert records[0]["engine"] == records[1]["engine"], records
    assert all(r["engine"].startswith("http://127.0.0.1:") for r in records), records
    assert records[0]["mean_abs_delta"] <= HONEST_STANDIN
    assert f"on {records[2]['engine']}" in text and "generator gen-0: weights version 2" in text, text


STANDIN_LORA = (
    'generators.kind="sglang"',
    "generators.options.launch=1",
    'generators.options.launch_command="python -m tests.support.sglang.server"',
    'generators.options.launch_args="--log-level warning --skip-tokenizer-init --enable-lora --max-lora-rank 8"',
    'learner.lora.publish="adapter"',
)


@pytest.mark.parametrize("publish", ["merged", "adapter"])
def test_lora_versions_are_checked(tmp_path, publish):
    """learner.lora.rank = 8: merged weights on the torch generator (the reference is the learner's
    adapter model, the scores the merged copy: equal to rounding), or adapters on the stand-in
    server (scored with the version's adapter named)."""
    sets = ("learner.steps=3", "learner.lora.rank=8", *(STANDIN_LORA if publish == "adapter" else ()))
    out, run_dir = _launch(tmp_path, publish, *sets)
    assert out.returncode == 0, out.stdout + out.stderr
    records = read_records(run_dir, "canary")
    assert {1, 2} <= {r["version"] for r in records}, records
    assert all(r["outcome"] == "accepted" and r["mean_abs_delta"] <= HONEST_STANDIN for r in records), records


@pytest.mark.parametrize("generator", ["torch", "sglang"])
def test_broadcast_versions_are_checked(tmp_path, generator):
    """weights.transport = "broadcast": the announcement carries the reference, the members score
    after the broadcast (the torch generator as it applies it, the stand-in server's generator
    after its servers took it over the group)."""
    standin = (
        'generators.kind="sglang"',
        "generators.options.launch=1",
        'generators.options.launch_command="python -m tests.support.sglang.server"',
        'generators.options.launch_args="--log-level warning --skip-tokenizer-init"',
    )
    sets = ("learner.steps=3", 'weights.transport="broadcast"', *(standin if generator == "sglang" else ()))
    out, run_dir = _launch(tmp_path, generator, *sets)
    assert out.returncode == 0, out.stdout + out.stderr
    assert {p["transport"] for p in read_records(run_dir, "publish")} >= {"broadcast"}
    records = read_records(run_dir, "canary")
    assert {1, 2} <= {r["version"] for r in records}, records
    assert all(r["outcome"] == "accepted" and r["mean_abs_delta"] <= HONEST_STANDIN for r in records), records
