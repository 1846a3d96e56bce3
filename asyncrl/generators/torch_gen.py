"""The built-in `torch` generator: an in-process Hugging Face causal LM sampling in batches.

Loads the model from a local directory, samples every task's group in one batched, KV-cached
call (off the event loop), scores completions with the task's exact verifier, and swaps in new
weights whenever they are offered: between batches, or mid-generation between decode steps, where
the in-flight mode (`keep`, `retract`, `abort`; see `sampling.py`) decides how the batch goes on.

Weights arrive verified in fresh CPU tensors (`offer_weights`, from the service's fetcher, or
`load_weights` from a shard directory) and are copied into the model's parameters only when
complete, so a corrupt or missing shard never leaves the model half-updated.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Mapping, Sequence
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
        self._lock = threading.Lock()  # guards _pending (offered from the loop, applied by the sampler)
        self._pending: tuple[int, Mapping, Callable[[int], None] | None] | None = None
        self.num_inflight_updates = 0

    def setup(self, ctx: GeneratorContext) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        torch.set_num_threads(ctx.threads)
        self._ctx = ctx
        self._tokenizer = AutoTokenizer.from_pretrained(ctx.model_path)
        self._model = AutoModelForCausalLM.from_pretrained(ctx.model_path, dtype=torch.float32).eval()
        self._run_seed = ctx.run_seed
        self._inflight = ctx.inflight
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
        from asyncrl.generators.sampling import generate, sample_seed

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
            seeds=[sample_seed(self._run_seed, task.group_id, k) for task, k in owners],
            current_version=lambda: self._version,
            poll_update=self.apply_pending,
            inflight=self._inflight,
        )
        self.num_inflight_updates += out.num_weight_updates
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

    # ------------------------------------------------------------------ weights
    def _check_state(self, version: int, state: Mapping) -> None:
        """Every parameter must be there with its shape and dtype, before anything is copied."""
        params = dict(self._model.named_parameters())
        missing = [n for n in params if n not in state]
        if missing:
            raise ValueError(f"weights version {version} lacks parameters: {missing[:5]}")
        for name, target in [*params.items(), *self._model.named_buffers()]:
            t = state.get(name)
            if t is not None and (t.shape != target.shape or t.dtype != target.dtype):
                raise ValueError(
                    f"weights version {version}: {name} is {t.dtype}{list(t.shape)}, "
                    f"the model has {target.dtype}{list(target.shape)}"
                )

    def offer_weights(
        self, version: int, state: Mapping, on_applied: Callable[[int], None] | None = None
    ) -> None:
        """Thread-safe: hold verified weights for `version` until the next safe point applies them.

        A newer offer replaces an older one not yet applied; an offer not newer than what the
        model holds is dropped. `on_applied(version)` runs in the thread that applies.
        """
        self._check_state(version, state)
        with self._lock:
            if version > self._version and (self._pending is None or version > self._pending[0]):
                self._pending = (version, state, on_applied)

    def apply_pending(self) -> bool:
        """Copy offered weights into the model now, if any; True when the weights changed.

        Called by the sampler between decode steps and by the service between batches; never
        concurrently with a forward pass (both run on the thread that owns the model).
        """
        import torch

        with self._lock:
            pending, self._pending = self._pending, None
        if pending is None:
            return False
        version, state, on_applied = pending
        targets = {**dict(self._model.named_buffers()), **dict(self._model.named_parameters())}
        with torch.no_grad():
            for name, tensor in state.items():
                target = targets.get(name)
                if target is not None:
                    target.copy_(tensor)
        self._version = version
        if on_applied is not None:
            on_applied(version)
        return True

    def load_weights_sync(self, version: int, location: str) -> None:
        from asyncrl.transport.shards import read_shards

        state = read_shards(Path(location), version, verify=True)  # raises before the model is touched
        self.offer_weights(version, state)
        self.apply_pending()

    async def load_weights(self, version: int, location: str) -> None:
        await asyncio.to_thread(self.load_weights_sync, version, location)

    async def close(self) -> None:
        self._model = None
