"""A real pretrained LLM through the pipeline: SmolLM2-135M-Instruct (49,152-token BPE vocabulary,
a chat template with a system prompt, tied embeddings), prepared by `asyncrl models prepare`.

Without the prepared model these tests skip naming the command (.ci/run prepares it and makes a
missing model fail instead).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from asyncrl.messages import PromptTask, SamplingParams
from tests.conftest import read_records, set_up_generator
from tests.support.real_model import real_model_dir

pytestmark = pytest.mark.slow

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "smollm2_arithmetic"
# float32 on the CPU: the learner's forward over the whole sequence against the generator's
# KV-cached decode steps (other kernels, other summation orders).
LOGPROB_TOLERANCE_F32 = 2e-4


def _chat_prompts(tokenizer, questions: list[str]) -> list[list[int]]:
    system = "Solve the problem, then give the final answer as \\boxed{N}."
    out = []
    for q in questions:
        ids = tokenizer.apply_chat_template(
            [{"role": "system", "content": system}, {"role": "user", "content": q}],
            add_generation_prompt=True,
        )
        out.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return out


def test_learner_logprobs_equal_the_generators_behavior_logprobs() -> None:
    """Token in, token out: the learner scores exactly the ids the generator sampled (no detour
    through text) and gets the generator's log-probs, within the float32 tolerance."""
    from asyncrl.generators.torch_gen import TorchGenerator
    from asyncrl.models.policy import PolicyLM

    model_dir = real_model_dir()
    gen = set_up_generator(TorchGenerator, model_dir, run_seed=5, batching="batch", max_batch_groups=2)
    prompts = _chat_prompts(gen.tokenizer, ["What is 7 + 5?", "Mia has 9 pens and loses 4. How many now?"])
    sampling = SamplingParams(temperature=1.0, max_new_tokens=48)
    work = [
        PromptTask(
            task_id=i,
            group_id=i,
            prompt_ids=p,
            num_samples=2,
            sampling=sampling,
            dataset_index=i,
            window=0,
            answer="1",
        )
        for i, p in enumerate(prompts)
    ]
    rollouts = gen.generate_sync(work)
    policy = PolicyLM(gen.model)
    worst = 0.0
    with torch.no_grad():
        for r in rollouts:
            prompt = work[r.task_id].prompt_ids
            ids = torch.tensor([[*prompt, *r.completion_ids]])
            logp = policy(ids, temperature=1.0).logp[0, len(prompt) :]
            behavior = torch.tensor(r.behavior_logprobs)
            assert logp.shape == behavior.shape
            worst = max(worst, float((logp - behavior).abs().max()))
    assert sum(len(r.completion_ids) for r in rollouts) > 4 * 20  # real completions, not just an eos
    assert worst < LOGPROB_TOLERANCE_F32, worst


def test_a_short_sync_run_on_the_real_model(tmp_path: Path) -> None:
    """The example's job, cut to 2 steps of 2 groups x 2 samples and 24 new tokens: it completes,
    nothing lost or duplicated, and in sync mode the learner's log-probs match the behaviour's
    (the staleness policy's mismatch KL is float noise)."""
    real_model_dir()
    done = subprocess.run(
        [
            sys.executable, "-m", "asyncrl", "launch", str(EXAMPLE / "config.toml"), "--no-tui",
            "--set", f"run.out_dir={tmp_path}", "--set", "run.name=real",
            "--set", "mode=sync", "--set", "learner.steps=2",
            "--set", "learner.groups_per_step=2", "--set", "learner.samples_per_group=2",
            "--set", "sampling.max_new_tokens=24", "--set", "task.num_eval=2",
        ],
        capture_output=True,
        text=True,
        timeout=400,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    run = tmp_path / "real"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["policy_versions"] == 2
    assert summary["trajectories_lost"] == 0 and summary["trajectories_duplicated"] == 0
    steps = read_records(run, "step")
    assert len(steps) == 2
    for step in steps:
        assert step["stats"]["mismatch_k3"] < 1e-6, step["stats"]
    assert "held-out accuracy before training" in done.stdout + done.stderr
    canary = summary["canary"]  # the example's weight-load canary: every version checked, none refused
    assert canary["checked"] >= 1 and canary["refused"] == 0, canary
    assert canary["max_abs_delta"] < LOGPROB_TOLERANCE_F32 * 10
