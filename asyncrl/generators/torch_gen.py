"""The built-in `torch` generator: an in-process Hugging Face causal LM sampling in batches.

Loads the model from a local directory, samples every task's group in one batched, KV-cached
call (off the event loop), scores completions with the task's exact verifier, and swaps in new
weights from versioned safetensors shards between batches.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from pathlib import Path

from asyncrl.generators.base import GeneratorContext, Rollout
from asyncrl.messages import PromptTask

log = logging.getLogger(__name__)


def make_reward(task_kind: str):
    if task_kind == "addition":
        from asyncrl.tasks.arithmetic import AdditionReward

        return AdditionReward()
    raise ValueError(f"unknown task kind {task_kind!r}; valid: addition")


class TorchGenerator:
    """Samples with `asyncrl.generators.sampling.generate` from a `transformers` model."""

    def __init__(self) -> None:
        self._version = 0
        self._model = None
        self._tokenizer = None
        self._ctx: GeneratorContext | None = None

    def setup(self, ctx: GeneratorContext) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        torch.set_num_threads(ctx.threads)
        self._ctx = ctx
        self._tokenizer = AutoTokenizer.from_pretrained(ctx.model_path)
        self._model = AutoModelForCausalLM.from_pretrained(ctx.model_path, dtype=torch.float32).eval()
        self._rng = torch.Generator().manual_seed(ctx.seed)
        self._reward = make_reward(ctx.task.kind)

    @property
    def version(self) -> int:
        return self._version

    @property
    def model(self):
        return self._model

    @property
    def tokenizer(self):
        return self._tokenizer

    def generate_sync(self, tasks: Sequence[PromptTask]) -> list[Rollout]:
        from asyncrl.generators.sampling import generate

        assert self._ctx is not None and self._tokenizer is not None, "setup() was not called"
        tok = self._tokenizer
        prompts, owners = [], []
        for task in tasks:
            for k in range(task.num_samples):
                prompts.append(task.prompt_ids)
                owners.append((task, k))
        s = tasks[0].sampling
        out = generate(
            self._model,
            prompts,
            max_new_tokens=s.max_new_tokens,
            temperature=s.temperature,
            top_p=s.top_p,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
            rng=self._rng,
            current_version=lambda: self._version,
        )
        rollouts = []
        for (task, k), ids, logps, versions, finish in zip(
            owners, out.completion_ids, out.logprobs, out.versions, out.finish_reasons, strict=True
        ):
            text = tok.decode(ids, skip_special_tokens=True)
            prompt_text = tok.decode(task.prompt_ids, skip_special_tokens=True)
            rollouts.append(
                Rollout(
                    task_id=task.task_id,
                    sample_index=k,
                    completion_ids=ids,
                    behavior_logprobs=logps,
                    token_versions=versions,
                    reward=float(self._reward(prompt_text, text, task.answer)),
                    finish_reason=finish,
                )
            )
        return rollouts

    async def generate(self, tasks: Sequence[PromptTask]) -> list[Rollout]:
        if len({t.sampling for t in tasks}) > 1:
            # One batched call samples with one set of parameters; split mixed batches.
            out: list[Rollout] = []
            for t in tasks:
                out += await asyncio.to_thread(self.generate_sync, [t])
            return out
        return await asyncio.to_thread(self.generate_sync, tasks)

    def load_weights_sync(self, version: int, location: str) -> None:
        from asyncrl.transport.shards import read_shards

        params = dict(self._model.named_parameters())
        buffers = dict(self._model.named_buffers())
        state = read_shards(Path(location), version, verify=True, num_threads=1)
        missing = [n for n in params if n not in state]
        if missing:
            raise ValueError(f"weights version {version} lacks parameters: {missing[:5]}")
        import torch

        with torch.no_grad():
            for name, tensor in state.items():
                target = params.get(name, buffers.get(name))
                if target is not None:
                    target.copy_(tensor)
        self._version = version

    async def load_weights(self, version: int, location: str) -> None:
        await asyncio.to_thread(self.load_weights_sync, version, location)

    async def close(self) -> None:
        self._model = None
