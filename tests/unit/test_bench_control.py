"""`asyncrl bench staleness` (asyncrl/benchmarks/control.py): its pure parts."""

from __future__ import annotations

import math

import pytest

from asyncrl.benchmarks.control import rotated, summarize, variant_sets


def _fig(sps, acc):
    return {"sps": sps, "eval_after": acc}


def test_summary_picks_the_best_fixed_bound_and_compares_auto_with_it():
    runs = [
        {"k0": _fig(100, 0.9), "k2": _fig(150, 0.92), "auto": _fig(147, 0.93)},
        {"k0": _fig(110, 0.9), "k2": _fig(140, 0.90), "auto": _fig(150, 0.91)},
        {"k0": _fig(90, 0.9), "k2": _fig(160, 0.94), "auto": _fig(140, 0.92)},
    ]
    result = summarize(runs, [0, 2])
    assert result["k2"] == {"sps": 150, "eval_after": 0.92}
    assert result["best_fixed"] == 2
    assert result["auto_vs_best"] == pytest.approx(147 / 150)
    assert result["auto_eval_minus_best"] == pytest.approx(0.92 - 0.92)


def test_variants_and_order():
    assert variant_sets("auto", cap=4) == [
        "staleness.max_staleness=auto",
        "staleness.max_staleness_cap=4",
        "generators.max_batch_groups=auto",
    ]
    assert variant_sets(1, cap=4) == ["staleness.max_staleness=1"]
    assert rotated([0, 1, "auto"], 1) == [1, "auto", 0]
    assert math.isnan(summarize([{"k0": _fig(0, 0.5), "auto": _fig(1, 0.5)}], [0])["auto_vs_best"])
