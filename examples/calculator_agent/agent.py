"""CalculatorAgent: a multi-turn, tool-using generator plugin for asyncrl (a worked example).

Select it with `--set generators.kind=examples.calculator_agent.agent:CalculatorAgent` (from the
repository root), or `pip install examples/calculator_agent` and `--set generators.kind=calculator`.

Each sample is one episode (`episode.py`): the model samples token by token from a KV-cached
Hugging Face causal LM; when the episode appends environment tokens (a calculator value, a
re-posed question) they are fed to the model as ids and continue the same cache, so the context
the model samples in is exactly prompt + completion, token for token: no re-tokenisation, and the
learner's log-probs of the model tokens are computed on the same sequence.

Per completion token the rollout carries:
  model tokens        the exact behavior log-prob (softmax(logits / T), nucleus-renormalised with
                      top_p < 1), the version that sampled it, loss_mask True
  environment tokens  log-prob 0.0 and the current version (ignored: loss_mask False)

Randomness is per sample (`sample_seed(run_seed, group_id, sample_index)`, one uniform per model
token), so a sample does not depend on which others share its batch. Sampling runs in a worker
thread, off the event loop. Weights arrive between batches through `load_weights`.

Options (`generators.options.*`): `max_turns` (2), `retry_reward` (0.5).
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Sequence
from pathlib import Path

from asyncrl.generators.base import GeneratorContext, Rollout
from asyncrl.messages import PromptTask

from .episode import Episode, make_vocab

OPTIONS = {"max_turns": int, "retry_reward": float}


class CalculatorAgent:
    def __init__(self) -> None:
        self._version = 0
        self._model = None

    def setup(self, ctx: GeneratorContext) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        unknown = sorted(set(ctx.options) - set(OPTIONS))
        if unknown:
            raise ValueError(f"{unknown} not calculator-agent options; valid: {', '.join(OPTIONS)}")
        opts = {k: OPTIONS[k](v) for k, v in ctx.options.items()}
        self.max_turns = opts.get("max_turns", 2)
        self.retry_reward = opts.get("retry_reward", 0.5)
        if self.max_turns < 1:
            raise ValueError(f"generators.options.max_turns must be >= 1, got {self.max_turns}")
        torch.set_num_threads(ctx.threads)
        self._ctx = ctx
        self._tokenizer = AutoTokenizer.from_pretrained(ctx.model_path)
        self._vocab = make_vocab(self._tokenizer)
        self._model = AutoModelForCausalLM.from_pretrained(ctx.model_path, dtype=torch.float32).eval()
        params = inspect.signature(self._model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"  # transformers 5 / 4

    @property
    def version(self) -> int:
        return self._version

    async def generate(self, tasks: Sequence[PromptTask]) -> list[Rollout]:
        return await asyncio.to_thread(self._generate_sync, tasks)

    def _generate_sync(self, tasks: Sequence[PromptTask]) -> list[Rollout]:
        from asyncrl.models.sampling import sample_seed

        return [
            self._episode(task, k, sample_seed(self._ctx.run_seed, task.group_id, k))
            for task in tasks
            for k in range(task.num_samples)
        ]

    def _episode(self, task: PromptTask, sample_index: int, seed: int) -> Rollout:
        import torch

        from asyncrl.models.sampling import inverse_cdf_sample, next_token_logprobs

        prompt_text = self._tokenizer.decode(task.prompt_ids, skip_special_tokens=True)
        episode = Episode(
            vocab=self._vocab,
            question=prompt_text.rstrip().removesuffix("="),
            answer=task.answer,
            max_turns=self.max_turns,
            retry_reward=self.retry_reward,
            max_turn_tokens=task.sampling.max_new_tokens,
        )
        rng = torch.Generator().manual_seed(seed)
        temperature, top_p = task.sampling.temperature, task.sampling.top_p
        logprobs: list[float] = []
        cache, feed = None, list(task.prompt_ids)
        with torch.no_grad():
            while not episode.done:
                kwargs = {} if cache is None else {self._cache_kw: cache}
                out = self._model(input_ids=torch.tensor([feed]), use_cache=True, **kwargs)
                cache = out.past_key_values if getattr(out, "cache", None) is None else out.cache
                logp_V = next_token_logprobs(out.logits[:, -1], temperature=temperature, top_p=top_p)[0]
                if temperature > 0:
                    u = torch.rand((1,), generator=rng, dtype=torch.float64)
                    token = int(inverse_cdf_sample(logp_V[None], u)[0])
                else:
                    token = int(logp_V.argmax())
                logprobs.append(float(logp_V[token]))
                appended = episode.on_model_token(token)
                logprobs += [0.0] * len(appended)
                feed = [token, *appended]
        n = len(episode.completion_ids)
        return Rollout(
            task_id=task.task_id,
            sample_index=sample_index,
            completion_ids=episode.completion_ids,
            behavior_logprobs=logprobs,
            token_versions=[self._version] * n,
            reward=episode.reward,
            finish_reason=episode.finish_reason,
            loss_mask=list(episode.model_token),
        )

    async def load_weights(self, version: int, location: str) -> None:
        await asyncio.to_thread(self._load_sync, version, location)

    def _load_sync(self, version: int, location: str) -> None:
        import torch

        from asyncrl.transport.shard_read import read_shards

        state = read_shards(Path(location), version, verify=True)  # raises before the model changes
        params = dict(self._model.named_parameters())
        missing = [name for name in params if name not in state]
        if missing:
            raise ValueError(f"weights version {version} lacks parameters {missing[:5]}")
        with torch.no_grad():
            for name, target in [*self._model.named_buffers(), *params.items()]:
                if name in state:
                    target.copy_(state[name])
        self._version = version

    async def close(self) -> None:
        self._model = None
