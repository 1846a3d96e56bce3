"""Placement of the built-in torch generator, its OPD teacher and the held-out evaluation
(`generators.device`, `task.eval_device`, `task.eval_batch_size`), checked without a GPU.

A model on another device is played by a stand-in that says it lives on the meta device, refuses
any input that is not there (as CUDA refuses a CPU tensor), and takes its logits from a fixed
table: `generate` must run with it exactly as with the same stand-in on the CPU.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import msgspec
import pytest
import torch

from asyncrl.models.sampling import device_setting, generate, resolve_device

NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error of a host without CUDA")
VOCAB = 7
EOS, PAD = 2, 0


class _PlacedLM(torch.nn.Module):
    """A causal-LM stand-in on `device` that records (name, shape) of every tensor it is fed and
    fails on one that is elsewhere. Call k's logits are row k of a fixed CPU table, whatever the
    inputs hold (meta tensors hold no values), so two stand-ins fed alike return alike."""

    def __init__(self, device: str) -> None:
        super().__init__()
        self.device = torch.device(device)  # Hugging Face models expose the same attribute
        self.table_CV = 2.0 * torch.randn(64, VOCAB, generator=torch.Generator().manual_seed(0))
        self.fed: list[tuple[str, tuple[int, ...]]] = []
        self.logits_kept: list[int] = []

    def forward(
        self, input_ids, attention_mask, position_ids, use_cache, past_key_values=None, logits_to_keep=0
    ):
        for name, t in (
            ("input_ids", input_ids),
            ("attention_mask", attention_mask),
            ("position_ids", position_ids),
        ):
            if t.device != self.device:
                raise RuntimeError(f"{name} is on {t.device}, the model on {self.device}")
            self.fed.append((name, tuple(t.shape)))
        num_calls = len(self.logits_kept)
        self.logits_kept.append(logits_to_keep)
        num_rows, width = input_ids.shape
        kept = logits_to_keep or width
        logits_BLV = self.table_CV[num_calls % len(self.table_CV)].expand(num_rows, kept, VOCAB)
        return SimpleNamespace(logits=logits_BLV, past_key_values=("cache", num_calls))


def _sample(model: _PlacedLM):
    polls = iter(range(100))
    prompts = [[1, 5, 6, 4], [1, 3], [1, 6, 5]]  # different lengths: left padding
    return generate(
        model,
        prompts,
        max_new_tokens=5,
        temperature=1.0,
        top_p=0.9,
        eos_token_id=EOS,
        pad_token_id=PAD,
        seeds=[11, 12, 13],
        poll_update=lambda: next(polls) == 1,  # one update, after the second token: a re-prefill
        inflight="retract",
        num_extra_samples=2,
    )


def test_generate_feeds_the_model_on_its_own_device():
    elsewhere, here = _PlacedLM("meta"), _PlacedLM("cpu")
    out = _sample(elsewhere)
    assert out == _sample(here)  # the device changes nothing drawn or recorded
    assert out.num_weight_updates == 1 and out.extra_ids is not None
    assert elsewhere.fed == here.fed
    # Off the CPU two prefills (the start, the retract) keep only the last position's logits (on
    # it, none: bit-for-bit as before); decode steps feed one token and a mask one column wider.
    assert elsewhere.logits_kept.count(1) == 2 and set(here.logits_kept) == {0}
    widths = [shape[1] for name, shape in elsewhere.fed if name == "attention_mask"]
    assert widths[:3] == [4, 5, 6] and len(widths) == out.num_decode_steps


def test_generate_returns_plain_python():
    out = _sample(_PlacedLM("meta"))
    for ids, logps, extras in zip(out.completion_ids, out.logprobs, out.extra_logprobs, strict=True):
        assert all(type(t) is int for t in ids)
        assert all(type(lp) is float for lp in logps)
        assert all(type(lp) is float for row in extras for lp in row)


def test_auto_means_cuda_only_where_there_is_one():
    assert device_setting("auto") == ("cuda" if torch.cuda.is_available() else "cpu")
    assert device_setting("cpu") == "cpu" and device_setting("cuda:1") == "cuda:1"
    assert resolve_device("cpu", field="task.eval_device") == torch.device("cpu")


@NO_CUDA
def test_generator_on_cuda_without_cuda_is_a_clear_error(tiny_model_dir):
    from asyncrl.generators.torch_gen import TorchGenerator
    from asyncrl.testing.contract import make_context

    gen = TorchGenerator()
    with pytest.raises(ValueError, match=r"generators\.device = 'cuda'.*generators\.device=cpu"):
        gen.setup(make_context(tiny_model_dir, device="cuda"))
    assert gen.model is None  # refused before loading anything


@NO_CUDA
def test_evaluation_on_cuda_without_cuda_is_a_clear_error():
    from asyncrl.config_load import load_config
    from asyncrl.config_sections import ConfigError
    from asyncrl.job import evaluate
    from asyncrl.models.default import DEFAULT_MODEL_DIR
    from asyncrl.tasks.base import make_task

    # At load time, naming the key and the fix ...
    with pytest.raises(
        ConfigError, match=r"config error at task\.eval_device: 'cuda'.*task\.eval_device=cpu"
    ):
        load_config(overrides=["task.eval_device=cuda", "task.num_eval=4"])
    # ... and where it is used, for a config that skipped that check (a resolved config.json).
    config = load_config(overrides=["task.num_eval=4"])
    config = msgspec.structs.replace(config, task=msgspec.structs.replace(config.task, eval_device="cuda"))
    with pytest.raises(ValueError, match=r"task\.eval_device = 'cuda'.*task\.eval_device=cpu"):
        evaluate(config, DEFAULT_MODEL_DIR, make_task(config.task))


def test_no_held_out_prompts_skips_evaluation():
    from asyncrl.config_load import load_config
    from asyncrl.job import evaluate
    from asyncrl.tasks.base import make_task

    config = load_config(overrides=["task.num_eval=0", "task.eval_device=cuda"])
    accuracy, rewards = evaluate(config, Path("/nonexistent/model"), make_task(config.task))
    assert accuracy != accuracy and rewards == {}  # NaN, and nothing was loaded or placed


def test_eval_batch_size_does_not_change_the_completions():
    """Batch 1 against 64 (two batches, the second ragged): every prompt is padded differently."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from asyncrl.config_sections import TaskConfig
    from asyncrl.models.default import DEFAULT_MODEL_DIR
    from asyncrl.models.sft import greedy_completions
    from asyncrl.tasks.base import make_task

    model = AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL_DIR, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(DEFAULT_MODEL_DIR)
    task = make_task(TaskConfig(num_eval=96))
    assert len({len(p.prompt) for p in task.eval_problems}) > 1  # else padding is never exercised
    one = greedy_completions(model, tokenizer, task, max_new_tokens=5, batch_size=1)
    batched = greedy_completions(model, tokenizer, task, max_new_tokens=5, batch_size=64)
    assert len(one) == 96 and one == batched


def test_offered_cpu_weights_are_copied_into_a_model_elsewhere(tiny_model_dir):
    from asyncrl.generators.torch_gen import TorchGenerator
    from asyncrl.testing.contract import make_context

    gen = TorchGenerator()
    gen.setup(make_context(tiny_model_dir))
    gen.model.to("meta")  # unties tied weights (a CUDA move keeps them): name what is there now
    state = {name: torch.zeros(p.shape, dtype=p.dtype) for name, p in gen.model.named_parameters()}
    gen.offer_weights(1, state)
    assert gen.apply_pending() and gen.version == 1
    assert {p.device.type for p in gen.model.parameters()} == {"meta"}


def test_teacher_goes_to_the_device_and_dtype_asked_for():
    from transformers import AutoTokenizer

    from asyncrl.generators.torch_gen import load_teacher
    from asyncrl.models.default import DEFAULT_MODEL_DIR

    teacher = load_teacher(
        "", AutoTokenizer.from_pretrained(DEFAULT_MODEL_DIR), device="meta", dtype="bfloat16"
    )
    assert {(p.device.type, p.dtype) for p in teacher.parameters()} == {("meta", torch.bfloat16)}
