"""`asyncrl bench baseline` and the plain loop: the training-phase rate from step records, medians
and ratios on hand-made figures, the plain loop's GRPO math against asyncrl's own (an independent
implementation of the same objective), its on-policy ratio, one short real run of the plain loop
and one of the whole command."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from functools import partial

import pytest
import torch

from asyncrl.benchmarks.baseline import (
    VARIANTS,
    median,
    ratio,
    repeat_order,
    summarize,
    train_figures,
    training_start_s,
    variant_sets,
)
from asyncrl.benchmarks.plain_loop import (
    _scores,
    clipped_surrogate_token_mean,
    completion_mask,
    grpo_advantages,
    json_safe,
    policy_logprobs,
    sample_batch,
    token_logprobs,
    train_step,
    unsupported,
)
from asyncrl.config_load import load_config


def _records(start_s: float, ends_s: list[float], n: int = 256) -> list[dict]:
    """Step records as the launcher writes them: `samples_per_s` counts from `start_s`, the
    moment training began (time_s 0 is the launcher's creation), rounded as metrics.jsonl is."""
    records: list[dict] = [{"type": "launcher", "phase": "starting learner", "time_s": 0.5}]
    for i, end in enumerate(ends_s):
        records.append({"type": "task", "num_trajectories": 8, "time_s": end - 0.1})
        records.append(
            {
                "type": "step",
                "step": i,
                "num_trajectories": n,
                "samples_per_s": n * (i + 1) / (end - start_s),
                "time_s": round(end, 4),
            }
        )
    return records


def test_training_start_is_recovered_from_the_step_records():
    records = _records(7.25, [8.0, 8.5, 9.25])
    steps = [r for r in records if r["type"] == "step"]
    assert training_start_s(steps) == pytest.approx(7.25, abs=1e-4)
    assert training_start_s(list(reversed(steps))) == pytest.approx(7.25, abs=1e-4)  # any order
    # 768 samples from training's start (7.25 s) to the last step's end (9.25 s); other records ignored.
    figures = train_figures(records)
    assert figures["samples"] == 768
    assert figures["train_s"] == pytest.approx(2.0, abs=1e-4)
    assert figures["sps"] == pytest.approx(384.0, rel=1e-4)
    # The last version's publish ends training: its StepDone waits for the final checkpoint,
    # the model's save and the held-out evaluation.
    for r in records:
        if r["type"] == "step":
            r["version"] = r["step"] + 1
    records.insert(-1, {"type": "publish", "version": 3, "time_s": 8.95})
    records.insert(-1, {"type": "publish", "version": 2, "time_s": 8.4})
    assert train_figures(records)["train_s"] == pytest.approx(1.7, abs=1e-4)


def test_train_figures_rejects_runs_without_training():
    with pytest.raises(ValueError, match="no step records"):
        train_figures([{"type": "launcher", "time_s": 1.0}])
    bad = _records(1.0, [2.0])
    bad[-1]["samples_per_s"] = 0.0
    with pytest.raises(ValueError, match="samples_per_s"):
        train_figures(bad)


def test_median_and_ratio_skip_what_is_not_a_number():
    assert median([3.0, 1.0, 2.0]) == 2.0
    assert median([1.0, 4.0]) == 2.5
    assert median([1.0, math.nan, None, 5.0]) == 3.0  # no held-out set: NaN (None in JSON)
    assert math.isnan(median([math.nan, None]))
    assert ratio(3.0, 2.0) == 1.5
    assert math.isnan(ratio(1.0, 0.0)) and math.isnan(ratio(1.0, math.nan))


def _figures(sps: float, job_s: float, before: float = 0.2, after: float = 0.9) -> dict[str, float]:
    return {"sps": sps, "train_s": 1000.0 / sps, "job_s": job_s, "eval_before": before, "eval_after": after}


def test_summarize_medians_ratios_and_json_shape():
    runs = [
        {"plain": _figures(1000, 10), "async": _figures(1200, 20), "sync": _figures(800, 22)},
        {"plain": _figures(2000, 12), "async": _figures(1000, 21, after=0.95), "sync": _figures(900, 24)},
        {
            "plain": _figures(1500, 11),
            "async": _figures(1500, 25),
            "sync": _figures(1000, 23, after=math.nan),
        },
    ]
    result = summarize(runs)
    assert (result["plain_sps"], result["async_sps"], result["sync_sps"]) == (1500, 1200, 900)
    assert (result["plain_job_s"], result["async_job_s"], result["sync_job_s"]) == (11, 21, 23)
    assert result["async_eval_after"] == 0.9 and result["sync_eval_after"] == 0.9  # NaN left out
    assert result["plain_eval_before"] == 0.2
    # Ratios of the medians; each repeat's own ratios and their median alongside.
    assert result["async_vs_plain"] == pytest.approx(1200 / 1500)
    assert result["sync_vs_plain"] == pytest.approx(900 / 1500)
    assert result["async_vs_sync"] == pytest.approx(1200 / 900)
    assert result["async_job_vs_plain"] == pytest.approx(21 / 11)
    per = result["per_repeat"]
    assert [r["async_vs_plain"] for r in per] == pytest.approx([1.2, 0.5, 1.0])
    assert result["median_async_vs_plain_per_repeat"] == pytest.approx(1.0)
    assert per[1]["plain_sps"] == 2000 and per[2]["sync_job_s"] == 23
    required = [f"{v}_{f}" for v in VARIANTS for f in ("sps", "job_s", "eval_after", "eval_before")]
    assert all(k in result for k in [*required, "async_vs_plain", "sync_vs_plain"])
    text = json.dumps(json_safe(result))  # strict JSON: NaN becomes null
    assert "NaN" not in text and json.loads(text)["per_repeat"][2]["sync_eval_after"] is None


def test_summarize_rejects_incomplete_repeats():
    with pytest.raises(ValueError, match="no repeats"):
        summarize([])
    with pytest.raises(ValueError, match="lacks variants"):
        summarize([{"plain": _figures(1, 1), "async": _figures(1, 1)}])


def test_variants_rotate_and_set_the_mode():
    orders = [repeat_order(r) for r in range(len(VARIANTS))]
    assert orders[0] == VARIANTS
    assert all(sorted(o) == sorted(VARIANTS) for o in orders)
    assert {o[0] for o in orders} == set(VARIANTS)  # each variant leads one round in three
    assert repeat_order(3) == repeat_order(0)
    assert variant_sets("plain") == []
    assert variant_sets("async") == ["mode=async"] and variant_sets("sync") == ["mode=sync"]
    with pytest.raises(ValueError, match="unknown variant"):
        variant_sets("ray")


# ---------------------------------------------------------------------------- the plain loop's math
def test_plain_grpo_advantages_match_asyncrl_and_a_hand_computed_case():
    from asyncrl.learner.advantages import grpo_advantages as asyncrl_grpo

    rewards_GN = torch.tensor([[1.0, 0.0], [1.0, 1.0], [0.3, 0.3]])
    adv_GN = grpo_advantages(rewards_GN)
    half = 0.5 / (math.sqrt(0.5) + 1e-6)  # mean 0.5, unbiased std sqrt(0.5)
    assert adv_GN[0].tolist() == pytest.approx([half, -half])
    assert adv_GN[1:].abs().sum() == 0  # equal rewards: exactly zero
    gen = torch.Generator().manual_seed(0)
    rewards_GN = (torch.rand(64, 8, generator=gen) < 0.4).float()
    rewards_GN[:4] = 1.0
    torch.testing.assert_close(grpo_advantages(rewards_GN), asyncrl_grpo(rewards_GN))


def test_plain_surrogate_matches_asyncrl_token_mean_loss_and_gradient():
    from asyncrl.learner.losses import clipped_surrogate

    gen = torch.Generator().manual_seed(1)
    logp_old_BT = -torch.rand(6, 5, generator=gen) * 3
    logp_BT = (logp_old_BT + 0.4 * torch.randn(6, 5, generator=gen)).requires_grad_()
    mask_BT = torch.rand(6, 5, generator=gen) < 0.7
    logp_old_BT = torch.where(mask_BT, logp_old_BT, -math.inf)  # masked: anything, even -inf
    adv_B = torch.randn(6, generator=gen)
    ours = clipped_surrogate_token_mean(logp_BT, logp_old_BT, adv_B, mask_BT, clip_low=0.2, clip_high=0.28)
    (grad_ours,) = torch.autograd.grad(ours, logp_BT)
    theirs, _ = clipped_surrogate(
        logp_BT,
        logp_old_BT,
        adv_B[:, None].expand(6, 5),
        mask_BT,
        clip_low=0.2,
        clip_high=0.28,
        mode="token-mean",
        num_tokens_global=mask_BT.sum(),
    )
    (grad_theirs,) = torch.autograd.grad(theirs, logp_BT)
    torch.testing.assert_close(ours, theirs)
    torch.testing.assert_close(grad_ours, grad_theirs)
    assert torch.isfinite(grad_ours).all() and grad_ours[~mask_BT].abs().sum() == 0


def test_plain_surrogate_at_ratio_one_is_reinforce():
    logp_BT = torch.tensor([[-1.0, -2.0], [-0.5, -3.0]], requires_grad=True)
    mask_BT = torch.tensor([[True, True], [True, False]])
    adv_B = torch.tensor([1.0, -2.0])
    loss = clipped_surrogate_token_mean(
        logp_BT, logp_BT.detach(), adv_B, mask_BT, clip_low=0.2, clip_high=0.2
    )
    (grad,) = torch.autograd.grad(loss, logp_BT)
    # -A / num_tokens on every valid token (3 of them), 0 elsewhere.
    torch.testing.assert_close(grad, torch.tensor([[-1 / 3, -1 / 3], [2 / 3, 0.0]]))


def test_completion_mask_ends_at_the_first_eos():
    completion_BT = torch.tensor([[5, 6, 2, 0, 0], [5, 2, 2, 7, 0], [5, 6, 7, 8, 9]])
    assert completion_mask(completion_BT, eos_token_id=2).tolist() == [
        [True, True, True, False, False],
        [True, True, False, False, False],
        [True, True, True, True, True],
    ]


def test_token_logprobs_against_cross_entropy_and_over_a_nucleus():
    gen = torch.Generator().manual_seed(2)
    logits_BTV = torch.randn(3, 4, 7, generator=gen)
    tokens_BT = torch.randint(0, 7, (3, 4), generator=gen)
    expected = -torch.nn.functional.cross_entropy(logits_BTV.transpose(1, 2), tokens_BT, reduction="none")
    torch.testing.assert_close(token_logprobs(logits_BTV, tokens_BT), expected)
    keep_BTV = torch.zeros(3, 4, 7, dtype=torch.bool).scatter(-1, tokens_BT[..., None], True)
    keep_BTV[..., 0] = True
    kept = torch.where(keep_BTV, logits_BTV, -math.inf)
    torch.testing.assert_close(
        token_logprobs(logits_BTV, tokens_BT, keep_BTV=keep_BTV),
        torch.log_softmax(kept, -1).gather(-1, tokens_BT[..., None]).squeeze(-1),
    )


def test_the_plain_loop_scores_with_the_task_rewards_as_asyncrl_does():
    """With task.rewards the plain loop's rewards are the weighted sums asyncrl's scorer gives."""
    from asyncrl.models.sft import Completion
    from asyncrl.tasks.base import make_task

    rewards = [
        "task.rewards=[{kind='exact_match', name='right', options={extract='last_number'}},"
        " {kind='regex', name='short', weight=0.5, options={pattern='^.{1,3}$'}}]"
    ]
    config = load_config(None, ["task.num_eval=0", *rewards])
    task = make_task(config.task)
    problem = task.train_problem(0)
    done = [
        (problem, Completion(problem.answer, 3, "stop")),  # right and short: 1 + 0.5
        (problem, Completion(f"it is {problem.answer}", 5, "stop")),  # right, long: 1
        (problem, Completion("nope, it is -1", 5, "length")),  # neither: 0
    ]
    assert _scores(config, task, done) == [1.5, 1.0, 0.0]
    assert _scores(load_config(None, ["task.num_eval=0"]), task, done[:1]) == [1.0]  # task.score


def test_unsupported_lists_what_the_plain_loop_does_not_implement():
    assert unsupported(load_config(None, [])) == []
    assert unsupported(load_config(None, ["learner.optimizer=sgd", "sampling.top_p=0.9"])) == []
    refused = unsupported(
        load_config(None, ["learner.loss=cispo", "learner.kl_coef=0.1", "opd.enabled=true"])
    )
    assert len(refused) == 3 and any("learner.loss" in r for r in refused)


@pytest.mark.parametrize("top_p", [1.0, 0.8])
def test_plain_loop_batch_is_on_policy_and_a_step_trains(top_p):
    """The training forward (left-padded as generate saw it) gives back the log-probs generate
    sampled from, so the PPO ratio is 1 up to rounding; then one step changes the weights."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from asyncrl.job import model_path
    from asyncrl.tasks.base import make_task

    config = load_config(None, [f"sampling.top_p={top_p}", "sampling.temperature=0.9", "task.num_eval=0"])
    path = model_path(config)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    task = make_task(config.task)
    problems = [task.train_problem(j) for j in range(4)]
    torch.manual_seed(0)
    batch = sample_batch(
        model,
        tokenizer,
        task,
        problems,
        samples_per_group=4,
        sampling=config.sampling,
        device="cpu",
        score=partial(_scores, config, task),
    )
    assert batch.rewards_GN.shape == (4, 4) and batch.completion_BT.shape[0] == 16
    assert batch.mask_BT[:, 0].all() and (batch.keep_BTV is None) == (top_p == 1.0)
    with torch.no_grad():
        logp_BT = policy_logprobs(model, batch, temperature=0.9)
    valid = batch.mask_BT
    assert torch.isfinite(batch.logp_old_BT[valid]).all()
    torch.testing.assert_close(logp_BT[valid], batch.logp_old_BT[valid], atol=1e-4, rtol=0)
    before = [p.detach().clone() for p in model.parameters()]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.99))
    batch = batch._replace(rewards_GN=torch.tensor([[1.0, 0.0, 0.0, 1.0]] * 4))  # a signal in every group
    loss = train_step(
        model, optimizer, batch, temperature=0.9, clip_low=0.2, clip_high=0.2, max_grad_norm=1.0
    )
    assert math.isfinite(loss)
    assert any(not torch.equal(b, p) for b, p in zip(before, model.parameters(), strict=True))


PLAIN_FIELDS = (
    "train_s",
    "samples_per_s",
    "tokens_per_s",
    "num_samples",
    "num_tokens",
    "steps",
    "eval_before",
    "eval_after",
    "eval_problems",
    "mean_rewards",
    "threads",
    "job_s",
)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_plain_loop_runs_the_short_job_as_a_process():
    args = [sys.executable, "-m", "asyncrl.benchmarks.plain_loop", "--json", "--threads=1"]
    args += ["--set", "learner.steps=3", "--set", "task.num_eval=20"]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(proc.stdout)
    assert all(k in result for k in PLAIN_FIELDS), sorted(result)
    assert result["num_samples"] == 3 * 32 * 8 and result["steps"] == 3 and result["eval_problems"] == 20
    assert result["samples_per_s"] == pytest.approx(result["num_samples"] / result["train_s"])
    assert 0 < result["train_s"] < result["job_s"]
    assert 0.0 <= result["eval_before"] <= 1.0 and 0.0 <= result["eval_after"] <= 1.0
    # It learns: 3 steps at the default lr already raise the mean training reward (seeded run).
    rewards = result["mean_rewards"]
    assert len(rewards) == 3 and rewards[-1] > rewards[0]


def test_plain_loop_refuses_what_it_does_not_implement():
    from asyncrl.benchmarks.plain_loop import main

    assert main(["--set", "learner.loss=gspo"]) == 2
    assert main(["--set", "learner.lrr=1"]) == 2


def test_bench_baseline_rejects_bad_options():
    from typer.testing import CliRunner

    from asyncrl.benchmarks.cli import bench_app

    runner = CliRunner()
    out = runner.invoke(bench_app, ["baseline", "--repeats=0"])
    assert out.exit_code != 0 and "--repeats" in out.output
    out = runner.invoke(bench_app, ["baseline", "--plain-threads=0"])
    assert out.exit_code != 0 and "--plain-threads" in out.output
    out = runner.invoke(bench_app, ["baseline", "--set", "learner.lrr=1"])
    assert out.exit_code != 0 and "learner.lrr" in out.output
    out = runner.invoke(bench_app, ["baseline", "--set", "learner.loss=cispo"])
    assert out.exit_code != 0 and "does not implement" in out.output


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_bench_baseline_command_prints_the_required_json(tmp_path):
    args = [sys.executable, "-m", "asyncrl", "bench", "baseline", "--repeats", "1", "--json"]
    args += ["--set", "learner.steps=3", "--set", "task.num_eval=20", "--out-dir", str(tmp_path / "b")]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(proc.stdout)
    for key in ("plain_sps", "async_sps", "sync_sps", "plain_job_s", "async_job_s", "sync_job_s"):
        assert result[key] > 0, key
    for key in ("async_vs_plain", "sync_vs_plain"):
        assert result[key] == pytest.approx(result[key.replace("_vs_plain", "_sps")] / result["plain_sps"])
    for v in VARIANTS:
        assert 0.0 <= result[f"{v}_eval_after"] <= 1.0 and 0.0 <= result[f"{v}_eval_before"] <= 1.0
    assert len(result["per_repeat"]) == 1 and result["plain_threads"] == os.cpu_count()
    assert result["samples_trained"] == {v: 768 for v in VARIANTS}
    # Each variant ran in its own directory; the asyncrl ones in the mode they name.
    for v in ("async", "sync"):
        config = json.loads((tmp_path / "b" / f"r0-{v}" / "config.json").read_text())
        assert config["mode"] == v
    assert (tmp_path / "b" / "r0-plain" / "result.json").stat().st_size > 0
