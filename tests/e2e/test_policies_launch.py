"""Every staleness policy and every objective variant selectable in the config runs a shortened
job to completion, with its diagnostics in the metrics."""

from __future__ import annotations

import json
import math

import pytest
from conftest import read_records

from asyncrl.staleness import LEARNER_PROVIDES
from asyncrl.staleness.registry import POLICIES, make_policy

pytestmark = pytest.mark.slow

SELECTABLE = sorted(n for n in POLICIES if all(x in LEARNER_PROVIDES for x in make_policy(n).needs))

# Objective variants, each run together with one staleness policy (a launched job costs ~20 s of
# process start-up, so pairs halve the suite's time; the math of every combination is covered by
# tests/unit/test_trainer.py). Every selectable policy and every variant appears once.
OBJECTIVES = [
    ["learner.advantage=dr_grpo", 'learner.agg="seq-mean-token-sum-norm"'],
    ["learner.advantage=rloo", 'learner.agg="seq-mean-token-mean"'],
    ["learner.advantage=mc_grpo", "learner.samples_per_group=5"],
    ["learner.clip_high=0.28", "learner.drop_degenerate_groups=true"],  # DAPO
    ["learner.dual_clip=3.0", "learner.epochs=2"],  # PPO epochs: the dual clip binds in the second pass
    ["learner.loss=gspo", 'learner.agg="seq-mean-token-mean"'],
    ["learner.loss=cispo"],
    ["learner.kl_coef=0.01", "learner.kl_estimator=k3"],
    ["learner.kl_coef=0.01", "learner.kl_estimator=k1", "learner.kl_placement=reward"],
]
assert len(OBJECTIVES) >= len(SELECTABLE), "every policy needs a partner objective"

OPD = {
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

CASES = {
    f"policy-{p}+{objective[0].split('=')[0].split('.')[-1]}-{k}": [f"staleness.policy={p}", *objective]
    for k, (p, objective) in enumerate(zip(SELECTABLE, OBJECTIVES, strict=False))
} | {f"objective-{k}": v for k, v in OPD.items()}
leftover = OBJECTIVES[len(SELECTABLE) :]
CASES |= {f"objective-extra-{k}": v for k, v in enumerate(leftover)}


@pytest.mark.timeout(200)
@pytest.mark.parametrize("case", sorted(CASES))
def test_short_job_runs(run_short_job, case):
    proc, run_dir = run_short_job("staleness.max_staleness=1", *CASES[case])
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["trajectories_lost"] == 0
    # The launcher states how the learner trains: fallbacks with their reason.
    whole_batch = "learner: whole-batch steps (no gradient streaming)" in proc.stdout
    assert whole_batch or "learner: streaming per-trajectory gradients" in proc.stdout
    if "learner.epochs=2" in CASES[case] or "staleness.policy=m2po" in CASES[case]:
        assert whole_batch
    steps = read_records(run_dir, "step")
    assert len(steps) == 3
    assert all(math.isfinite(r["grad_norm"]) and math.isfinite(r["loss"]) for r in steps)
    diagnostic = "opd_kl" if case.startswith("objective-opd") else "max_staleness"
    assert diagnostic in steps[-1]["stats"]  # the policy's (or OPD's) diagnostics reach the metrics
    learner = [r for r in read_records(run_dir, "metrics") if r["source"] == "learner"]
    assert learner and "learner/tail_s" in learner[-1]
