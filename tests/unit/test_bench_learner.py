"""`asyncrl bench learner` (asyncrl/benchmarks/learner.py): its report has every figure, at small
sizes. Memory comparisons only; nothing is timed."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from asyncrl.benchmarks.learner import RESULT_PREFIX, logprob_path_memory


def test_logprob_path_report_at_small_sizes():
    out = logprob_path_memory(vocab=8000, tokens=128, chunk_size=16, hidden=16)
    assert (out["vocab"], out["tokens"], out["chunk_size"]) == (8000, 128, 16)
    assert out["logits_bytes"] == 128 * 8000 * 4 and out["chunk_logits_bytes"] == 16 * 8000 * 4
    for name in ("policy", "policy_candidates", "full_logits"):
        assert set(out[name]) == {"peak_bytes", "largest_tensor_bytes", "seconds"}
    assert (
        out["policy"]["largest_tensor_bytes"]
        < out["logits_bytes"]
        <= out["full_logits"]["largest_tensor_bytes"]
    )
    assert out["policy_vs_full"] == out["policy"]["peak_bytes"] / out["full_logits"]["peak_bytes"] < 0.5


@pytest.mark.slow
def test_quick_run_reports_both_figures_from_the_command_line():
    """`python -m asyncrl.benchmarks.learner --quick --json`: rank processes (1, then 2 with FSDP2
    on gloo; each without and with weight copies), the log-prob figure and packed vs padded
    tokens/s; about a minute on 2 busy cores."""
    proc = subprocess.run(
        [sys.executable, "-m", "asyncrl.benchmarks.learner", "--quick", "--json"],
        capture_output=True,
        text=True,
        timeout=280,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert RESULT_PREFIX not in proc.stdout  # rank lines stay inside the bench
    result = json.loads(proc.stdout)
    assert result["quick"] is True and result["seconds"] > 0
    lp = result["logprobs"]
    assert lp["policy"]["peak_bytes"] < lp["full_logits"]["peak_bytes"]
    ranks = result["ranks"]
    for key in (
        "num_params",
        "peak_rss_bytes_1rank",
        "peak_rss_bytes_2rank",
        "fsdp_per_rank_ratio",
        "fsdp_per_rank_ratio_net_of_imports",
    ):
        assert key in ranks
    assert len(ranks["peak_rss_bytes_2rank"]) == 2 and ranks["peak_rss_bytes_1rank"] > 0
    assert ranks["fsdp_per_rank_ratio"] == max(ranks["peak_rss_bytes_2rank"]) / ranks["peak_rss_bytes_1rank"]
    # The same batch gives the same step on 1 rank and on 2 sharded ranks.
    assert ranks["loss_1rank"] == pytest.approx(ranks["loss_2rank"], rel=1e-5)
    assert ranks["grad_norm_1rank"] == pytest.approx(ranks["grad_norm_2rank"], rel=1e-5)
    for rank in ranks["ranks"]["2"]:
        assert rank["world_size"] == 2 and rank["peak_rss_bytes"] >= rank["rss_after_setup_bytes"]
    # With the weight copies of ewma + exact: each layout's peak, per rank.
    assert ranks["copies_peak_rss_bytes_1rank"] > 0 and len(ranks["copies_peak_rss_bytes_2rank"]) == 2
    assert (
        ranks["copies_extra_bytes_1rank"]
        == ranks["copies_peak_rss_bytes_1rank"] - ranks["peak_rss_bytes_1rank"]
    )
    # Packed vs padded: both workloads, the layout used, fewer real tokens than padded slots.
    for name in ("distinct_prompts", "groups_of_8"):
        packing = result["packing"][name]
        assert packing["packed_tokens_per_s"] > 0 and packing["padded_tokens_per_s"] > 0
        assert packing["real_tokens"] < packing["padded_tokens"]
        assert packing["microbatches_packed"].split("/")[0] != "0"
