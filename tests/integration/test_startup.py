"""Start-up: the launcher checks the config and the task without torch, its workers come from the
fork server (`run.spawn = "fork"`) or fresh processes ("exec") alike, and the held-out evaluation
in the learner (`Config.evaluates_in_learner`) gives the launcher's figures."""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys

import pytest

from asyncrl.config_load import load_config

LAUNCHER_PATH = """
import sys
from asyncrl.config_load import load_config
from asyncrl.job import load_task, model_path
from asyncrl.messages import Hello, StepDone
from asyncrl.monitor.live import PlainReporter
from asyncrl.scheduler.service import Launcher
from asyncrl.transport.codec import decode, encode
from asyncrl.generators.base import resolve_generator
from asyncrl.monitor.sinks import check_sinks
cfg = load_config(None, [])
resolve_generator(cfg.generators.kind)
check_sinks(cfg.monitor.sinks)
task, tokenizer, stats = load_task(cfg, model_path(cfg))
msg, tensors = decode(encode(Hello(role="learner", peer_id="learner")))
assert isinstance(msg, Hello) and tensors == []
print("torch" in sys.modules)
"""


def test_the_launcher_checks_config_and_task_without_torch():
    """What runs before the workers start never imports torch (about 1 s of a 2-core start-up,
    taken from the fork server importing it meanwhile): the staleness policies validate by name
    and parameters, the generator class resolves, the tokenizer loads by its class."""
    out = subprocess.run([sys.executable, "-c", LAUNCHER_PATH], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_where_the_evaluation_runs():
    assert load_config(None, []).evaluates_in_learner
    for override in (
        "task.eval_device=cpu",  # not where the learner's model lives (learner.device = auto)
        "task.num_eval=0",
        "learner.mixed_precision=bf16",
        "learner.world_size=2",
        "learner.lora.rank=4",
    ):
        assert not load_config(None, [override]).evaluates_in_learner, override


def _summary(tmp_path, name: str, *sets: str) -> tuple[dict, str]:
    args = ["learner.steps=3", "task.num_eval=100", "mode=sync", f"run.name={name}", *sets]
    proc = subprocess.run(
        [sys.executable, "-m", "asyncrl", "launch", "--no-tui", *(x for s in args for x in ("--set", s))],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads((tmp_path / "runs" / name / "summary.json").read_text()), proc.stdout


@pytest.mark.timeout(300)
def test_forked_workers_and_learner_evaluation_match_fresh_workers_and_launcher_evaluation(tmp_path):
    """The same sync job twice: workers forked from the fork server with the evaluation in the
    learner, then fresh `python -m` workers with the evaluation in the launcher (a model loaded
    from final_model/). Sync training is deterministic, so both runs end with the same weights and
    must report the same held-out accuracy before and after."""
    forked, out_forked = _summary(tmp_path, "forked")
    fresh, out_fresh = _summary(tmp_path, "fresh", "run.spawn=exec", "task.eval_device=cpu")
    for key in ("eval_before", "eval_after", "trajectories_trained", "trajectories_lost"):
        assert forked[key] == fresh[key], key
    assert forked["trajectories_lost"] == 0
    assert 0.0 <= forked["eval_before"] <= 1.0
    for out in (out_forked, out_fresh):
        assert "held-out accuracy before training:" in out
        assert "held-out accuracy after training:" in out
        assert "learner: streaming per-trajectory gradients" in out


def _wait_gone(pid: int, timeout_s: float) -> bool:
    """Whether process `pid` (not our child) has exited within `timeout_s` (a pidfd becomes
    readable when it does; no polling)."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        ready, _, _ = select.select([fd], [], [], timeout_s)
        return bool(ready)
    finally:
        os.close(fd)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("spawn", ["fork", "exec"])
def test_workers_stop_when_the_launcher_is_killed(tmp_path, spawn):
    """SIGKILL to the launcher (no chance to stop anything): its learner and generator notice
    that their parent is gone and exit, whether they were forked from the fork server (which must
    exit with the launcher, not live on with its workers) or started as fresh processes."""
    sets = ["learner.steps=1000", "task.num_eval=0", f"run.spawn={spawn}", "run.name=k"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "asyncrl", "launch", "--no-tui", *(x for s in sets for x in ("--set", s))],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=tmp_path,
    )
    try:
        for line in proc.stdout:  # training has started once the first step is reported
            if line.startswith("step 1/"):
                break
        else:
            pytest.fail(f"the launcher ended before its first step (exit {proc.wait()})")
        spawned = [
            r["pid"]
            for r in map(json.loads, (tmp_path / "runs" / "k" / "metrics.jsonl").read_text().splitlines())
            if r.get("type") == "spawn"
        ]
        assert len(spawned) == 2, spawned  # the learner and gen-0
    finally:
        proc.kill()  # the launcher this test started
        proc.wait()
    for pid in spawned:
        assert _wait_gone(pid, timeout_s=60), f"worker {pid} outlived its launcher"
