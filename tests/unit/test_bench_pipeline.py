"""`asyncrl bench pipeline`: throughput from step records, efficiency/speedup, the JSON shape, the
replay generator's matching; one slow run of the whole command on a tiny workload."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest

from asyncrl.benchmarks.pipeline_figures import (
    VARIANTS,
    balanced_batch_groups,
    run_figures,
    stage_cpus,
    steady_rate,
    summarize,
    variant_command,
    variant_sets,
)
from asyncrl.benchmarks.replay import Recording, ReplayGenerator
from asyncrl.generators.base import GeneratorContext
from asyncrl.messages import PromptTask, SamplingParams


def _steps(times, n=10):
    return [{"type": "step", "step": i, "num_trajectories": n, "time_s": t} for i, t in enumerate(times)]


def test_steady_rate_skips_leading_steps():
    steps = _steps([5.0, 6.0, 7.0, 9.0])  # slow first step (start-up), then 10 samples per 1-2 s
    assert steady_rate(steps, skip=0) == pytest.approx(40 / 9.0)
    assert steady_rate(steps, skip=1) == pytest.approx(30 / 4.0)  # steps 1..3 after step 0's end at 5 s
    assert steady_rate(steps, skip=2) == pytest.approx(20 / 3.0)
    assert steady_rate(list(reversed(steps)), skip=2) == pytest.approx(20 / 3.0)  # order-independent


def test_steady_rate_rejects_too_few_steps_and_no_progress():
    with pytest.raises(ValueError, match="need more than skip"):
        steady_rate(_steps([1.0, 2.0]), skip=2)
    with pytest.raises(ValueError, match="no measurable progress"):
        steady_rate(_steps([1.0, 1.0]), skip=1)
    with pytest.raises(ValueError, match="skip must be >= 0"):
        steady_rate(_steps([1.0]), skip=-1)


def test_steady_rate_in_tokens_and_run_figures_tps():
    steps = _steps([1.0, 3.0, 5.0])
    for r, tokens in zip(steps, (99, 40, 20), strict=True):
        r["num_tokens"] = tokens
    assert steady_rate(steps, skip=1, count="num_tokens") == pytest.approx(60 / 4.0)
    assert run_figures(steps, skip=1)["tps"] == pytest.approx(60 / 4.0)
    assert "tps" not in run_figures(_steps([1.0, 3.0, 5.0]), skip=1)  # older records: no tokens


def test_run_figures_learner_and_generator_ratios():
    records = _steps([2.0, 4.0, 6.0])
    for t, idle, tail in [(2.0, 1.5, 0.3), (4.0, 2.0, 0.1), (6.0, 2.5, 0.2)]:
        records.append(
            {
                "type": "metrics",
                "source": "learner",
                "time_s": t,
                "learner/idle_s": idle,
                "learner/tail_s": tail,
            }
        )
    records += [
        {"type": "metrics", "source": "gen-0", "time_s": 1.0, "gen/busy_ratio": 0.2},
        {"type": "metrics", "source": "gen-0", "time_s": 5.0, "gen/busy_ratio": 0.8},  # last one counts
        {"type": "metrics", "source": "gen-1", "time_s": 5.0, "gen/busy_ratio": 0.6},
        {"type": "task", "time_s": 3.0},
    ]
    fig = run_figures(records, skip=1)
    assert fig["sps"] == pytest.approx(20 / 4.0)
    assert fig["learner_tail_s"] == pytest.approx(0.15)  # median of steps 1 and 2
    assert fig["learner_idle_ratio"] == pytest.approx((2.5 - 1.5) / (6.0 - 2.0))
    assert fig["gen_busy_ratio"] == pytest.approx(0.7)


def _rep(gen, learn, sync, async_):
    return {
        v: {"sps": x, "learner_tail_s": 0.1}
        for v, x in zip(VARIANTS, (gen, learn, sync, async_), strict=True)
    }


def test_summarize_medians_ratios_and_json_shape():
    result = summarize([_rep(100, 80, 50, 72), _rep(110, 90, 40, 81), _rep(90, 70, 45, 60)])
    assert result["gen_only_sps"] == 100 and result["learn_only_sps"] == 80
    assert result["sync_sps"] == 45 and result["async_sps"] == 72
    assert result["efficiency"] == pytest.approx(72 / 80)  # async / min(gen_only, learn_only)
    assert result["speedup"] == pytest.approx(72 / 45)
    assert result["bound"] == "learner" and result["balance"] == pytest.approx(0.8)
    assert [r["efficiency"] for r in result["per_repeat"]] == pytest.approx([0.9, 0.9, 60 / 70])
    assert [r["speedup"] for r in result["per_repeat"]] == pytest.approx([72 / 50, 81 / 40, 60 / 45])
    assert result["async_learner_tail_s"] == pytest.approx(0.1)
    assert json.loads(json.dumps(result)) == result  # plain JSON
    assert "efficiency_tokens" not in result  # no token rates given


def test_summarize_efficiency_in_tokens():
    reps = [_rep(100, 80, 50, 90), _rep(100, 80, 50, 90)]
    for rep in reps:  # gen_only's answers are longer: 5 tokens per sample against async's 4
        for v, per_sample in zip(VARIANTS, (5, 5, 4, 4), strict=True):
            rep[v]["tps"] = rep[v]["sps"] * per_sample
    result = summarize(reps)
    assert result["efficiency"] == pytest.approx(90 / 80)  # above 1 in samples/s ...
    assert result["efficiency_tokens"] == pytest.approx(360 / 400)  # ... not in tokens/s
    assert result["gen_only_tps"] == 500 and result["async_tps"] == 360
    with pytest.raises(ValueError, match="lacks variants"):
        summarize([{"gen_only": {"sps": 1.0}}])
    with pytest.raises(ValueError, match="no repeats"):
        summarize([])


def test_variant_sets():
    assert variant_sets("gen_only") == [] and variant_command("gen_only") == ["bench", "record"]
    assert variant_command("async") == variant_command("learn_only") == ["launch"]
    assert "mode=sync" in variant_sets("sync") and "learner.streaming=off" in variant_sets("sync")
    sets = variant_sets("learn_only", recording="/r/trajectories.jsonl")
    assert "generators.kind=asyncrl.benchmarks.replay:ReplayGenerator" in sets
    with pytest.raises(ValueError, match="recording"):
        variant_sets("learn_only")
    with pytest.raises(ValueError, match="unknown variant"):
        variant_sets("fast")
    # A trained policy: the single-stage variants start from it, sync and async never do.
    trained = Path("/runs/trained-policy/final_model")
    assert 'model.path="/runs/trained-policy/final_model"' in variant_sets("gen_only", policy=trained)
    assert any(
        s.startswith("model.path=") for s in variant_sets("learn_only", recording="/r", policy=trained)
    )
    assert not any(s.startswith("model.path=") for s in variant_sets("async", policy=trained))


def _task(group_id, prompt, num_samples=2):
    return PromptTask(
        task_id=group_id + 100,
        group_id=group_id,
        prompt_ids=prompt,
        num_samples=num_samples,
        sampling=SamplingParams(max_new_tokens=2),
        dataset_index=group_id,
        window=0,
        answer="",
    )


def _write_recording(path):
    rows = [
        {
            "step": 0,
            "group_id": g,
            "sample_index": k,
            "prompt_ids": [1, 2 + g],
            "completion_ids": [5, 6][: k + 1],
            "behavior_logprobs": [-0.5, -0.25][: k + 1],
            "token_versions": [0] * (k + 1),
            "reward": float(k),
        }
        for g in (0, 1)
        for k in (0, 1)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_replay_generator_answers_from_the_recording(tmp_path):
    path = tmp_path / "trajectories.jsonl"
    _write_recording(path)
    gen = ReplayGenerator()
    ctx = GeneratorContext(
        generator_id="g", model_path="", sampling=None, task=None, seed=0, options={"replay_path": str(path)}
    )
    gen.setup(ctx)
    asyncio.run(gen.load_weights(3, "unused"))
    rollouts = asyncio.run(gen.generate([_task(1, [1, 3])]))
    assert [(r.task_id, r.sample_index, r.completion_ids, r.reward) for r in rollouts] == [
        (101, 0, [5], 0.0),
        (101, 1, [5, 6], 1.0),
    ]
    assert rollouts[1].behavior_logprobs == [-0.5, -0.25]
    assert rollouts[1].token_versions == [3, 3]  # stamped with the version it holds
    assert [r.finish_reason for r in rollouts] == ["stop", "length"]
    applied = []
    gen.offer_weights(5, {}, applied.append)
    assert gen.apply_pending() and applied == [5] and gen.version == 5
    with pytest.raises(ValueError, match="prompt differs"):
        asyncio.run(gen.generate([_task(1, [1, 9])]))
    with pytest.raises(ValueError, match="no sample 2 of group 0"):
        asyncio.run(gen.generate([_task(0, [1, 2], num_samples=3)]))


def test_replay_rejects_missing_or_malformed_recordings(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        Recording.load(tmp_path / "none.jsonl")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"group_id": 0}\n')
    with pytest.raises(ValueError, match="line 1"):
        Recording.load(bad)
    ctx = GeneratorContext(generator_id="g", model_path="", sampling=None, task=None, seed=0)
    with pytest.raises(ValueError, match="replay_path"):
        ReplayGenerator().setup(ctx)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_bench_pipeline_command_tiny_workload(tiny_model_dir, tmp_path):
    args = [
        sys.executable,
        "-m",
        "asyncrl",
        "bench",
        "pipeline",
        "--json",
        "--repeats=1",
        "--steps=3",
        "--skip=1",
        "--groups-per-step=2",
        "--samples-per-group=4",
        "--max-new-tokens=4",
        "--set",
        f'model.path="{tiny_model_dir}"',
        "--out-dir",
        str(tmp_path / "bench"),
    ]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=850)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(proc.stdout)
    for key in ("gen_only_sps", "learn_only_sps", "sync_sps", "async_sps", "efficiency", "speedup"):
        assert result[key] > 0, key
    assert len(result["per_repeat"]) == 1
    # --max-batch-groups auto (the default): calibrated first, within 1..groups_per_step.
    cal = result["calibration"]
    assert cal["learn_only_sps"] > 0 and all(v > 0 for v in cal["gen_only_sps"].values())
    assert result["max_batch_groups"] == cal["chosen"] in (1, 2)
    assert "generators.max_batch_groups=" + str(cal["chosen"]) in result["workload"]
    assert all(v > 0 for v in result["per_repeat"][0].values())
    assert result["efficiency_tokens"] > 0
    # --ignore-eos (the default): every answer is max_new_tokens long, in every variant.
    assert "sampling.ignore_eos=true" in result["workload"]
    for v in VARIANTS:
        assert result[f"{v}_tps"] == pytest.approx(4 * result[f"{v}_sps"]), v
    # The single-stage runs started from the policy one sync run trained first.
    assert result["standalone_policy"] == "trained"
    trained = tmp_path / "bench" / "trained-policy" / "final_model"
    for v in ("gen_only", "learn_only"):
        config = json.loads((tmp_path / "bench" / f"r0-{v}" / "config.json").read_text())
        assert config["model"]["path"] == str(trained), v
    # --pin (the default): each stage on its own CPUs, the same in every variant.
    from asyncrl.runtime import available_cpus

    placement = stage_cpus(available_cpus())
    if placement is None:
        assert result["cpus"] is None
    else:
        assert result["cpus"] == {"learner": placement[0], "generators": placement[1]}
        for v in VARIANTS:
            config = json.loads((tmp_path / "bench" / f"r0-{v}" / "config.json").read_text())
            assert (config["learner"]["cpus"], config["generators"]["cpus"]) == placement, v
    # The learner-only run trained on the recording the generator-only run made.
    assert (tmp_path / "bench" / "r0-gen_only" / "trajectories.jsonl").stat().st_size > 0
    assert (
        json.loads((tmp_path / "bench" / "r0-learn_only" / "summary.json").read_text())["status"]
        == "completed"
    )


def test_stage_cpus_splits_the_machine_between_the_stages():
    assert stage_cpus({0}) is None  # one CPU: nothing to split
    assert stage_cpus({1, 0}) == ([0], [1])
    assert stage_cpus([4, 5, 6]) == ([4], [5, 6])
    assert stage_cpus(range(8)) == ([0, 1, 2, 3], [4, 5, 6, 7])


def _gen_rate(m: int) -> float:
    """A generator whose batch of m groups (8 samples each) takes 2 ms + 3 ms per group."""
    return 8 * m / (0.002 + 0.003 * m)


@pytest.mark.parametrize(("learn_sps", "expected"), [(2000.0, 2), (2286.0, 4), (1600.0, 1), (9999.0, 32)])
def test_balanced_batch_groups_inverts_the_batch_cost_model(learn_sps, expected):
    # Two measured points determine the model exactly; the pick is the batch size whose
    # predicted rate is nearest the learner's (1: the generator cannot be slowed further;
    # 32: the largest allowed, still slower than the learner).
    points = {8: _gen_rate(8), 2: _gen_rate(2)}
    assert balanced_batch_groups(points, learn_sps, largest=32) == expected


def test_balanced_batch_groups_without_a_usable_fit():
    # One point (the generator was already the slower stage at 8), or noise that makes smaller
    # batches look faster: the measured batch size nearest by ratio.
    assert balanced_batch_groups({8: 1000.0}, 1500.0, largest=32) == 8
    # A measured batch size above the step's groups is not a valid pick.
    assert balanced_batch_groups({8: 1000.0}, 1500.0, largest=2) == 2
    assert balanced_batch_groups({8: 1700.0, 2: 1800.0}, 1500.0, largest=32) == 8
    assert balanced_batch_groups({8: 1700.0, 2: 1450.0}, 1500.0, largest=32) in (2, 3)
    with pytest.raises(ValueError, match="positive"):
        balanced_batch_groups({8: 0.0}, 1500.0, largest=32)


def test_bench_pipeline_rejects_bad_options():
    from typer.testing import CliRunner

    from asyncrl.benchmarks.cli import bench_app

    runner = CliRunner()
    out = runner.invoke(bench_app, ["pipeline", "--steps=2", "--skip=2"])
    assert out.exit_code != 0 and "--skip" in out.output
    out = runner.invoke(bench_app, ["pipeline", "--set", "learner.lrr=1"])
    assert out.exit_code != 0 and "learner.lrr" in out.output
    out = runner.invoke(bench_app, ["pipeline", "--max-batch-groups=many"])
    assert out.exit_code != 0 and "whole number or 'auto'" in out.output
    out = runner.invoke(bench_app, ["pipeline", "--max-batch-groups=0"])
    assert out.exit_code != 0 and "--max-batch-groups must be >= 1" in out.output
