"""Every staleness policy and every objective variant selectable in the config runs a shortened
job to completion, with its diagnostics in the metrics."""

from __future__ import annotations

import json
import math

import pytest
from conftest import read_records

from asyncrl.config import LEARNER_PROVIDES
from asyncrl.staleness.registry import POLICIES, make_policy

pytestmark = pytest.mark.slow

SELECTABLE = sorted(n for n in POLICIES if all(x in LEARNER_PROVIDES for x in make_policy(n).needs))

OBJECTIVES = {
    "dr_grpo": ["learner.advantage=dr_grpo", 'learner.agg="seq-mean-token-sum-norm"'],
    "rloo": ["learner.advantage=rloo", 'learner.agg="seq-mean-token-mean"'],
    "mc_grpo": ["learner.advantage=mc_grpo", "learner.samples_per_group=5"],
    "dapo": ["learner.clip_high=0.28", "learner.drop_degenerate_groups=true"],
    "dual_clip": ["learner.dual_clip=3.0"],
    "gspo": ["learner.loss=gspo", 'learner.agg="seq-mean-token-mean"'],
    "cispo": ["learner.loss=cispo"],
    "kl_k3_loss": ["learner.kl_coef=0.01", "learner.kl_estimator=k3"],
    "kl_k1_reward": ["learner.kl_coef=0.01", "learner.kl_estimator=k1", "learner.kl_placement=reward"],
    # On-policy distillation of the shipped student by the shipped teacher (same tokenizer).
    "opd_reverse_kl": ['model.path=""', "opd.enabled=true"],
    "opd_mc_reverse_kl": [
        'model.path=""',
        "opd.enabled=true",
        "opd.estimator=mc_reverse_kl",
        "opd.num_samples=3",
    ],
    "opd_forward_kl": ['model.path=""', "opd.enabled=true", "opd.estimator=forward_kl", "opd.num_samples=3"],
}

CASES = {f"policy-{p}": [f"staleness.policy={p}"] for p in SELECTABLE} | {
    f"objective-{k}": v for k, v in OBJECTIVES.items()
}


@pytest.mark.timeout(200)
@pytest.mark.parametrize("case", sorted(CASES))
def test_short_job_runs(run_short_job, case):
    proc, run_dir = run_short_job("staleness.max_staleness=1", *CASES[case])
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["trajectories_lost"] == 0
    steps = read_records(run_dir, "step")
    assert len(steps) == 3
    assert all(math.isfinite(r["grad_norm"]) and math.isfinite(r["loss"]) for r in steps)
    diagnostic = "opd_kl" if case.startswith("objective-opd") else "max_staleness"
    assert diagnostic in steps[-1]["stats"]  # the policy's (or OPD's) diagnostics reach the metrics
    learner = [r for r in read_records(run_dir, "metrics") if r["source"] == "learner"]
    assert learner and "learner/tail_s" in learner[-1]
