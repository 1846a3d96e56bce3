"""The engine of the stand-in SGLang server: a real torch causal LM under SGLang's scheduling rules.

Place in the data flow: `server.py` (HTTP) hands each /generate item to `Engine.submit` and
waits for it to finish; one scheduler thread steps every running request together, one token per
step, and the control endpoints (pause, continue, abort, weight updates) act on the same state.
What it reproduces (/work/shared/SGLANG_API.md sections 1-3):

- continuous batching: requests join and leave between steps; a token's weight-version label is
  the label of the weights whose forward produced its logits, reported as `weight_versions` spans;
- `pause_generation` modes: `abort` finishes every running request with its partial output
  (finish_reason abort), `retract` and `in_place` stop stepping and keep requests alive; in every
  mode new requests block until `continue_generation`;
- weight updates: when not paused, an update takes the writer lock (waits for running requests to
  drain while new ones wait); when paused it runs at once; `flush_cache` fails in `in_place` mode
  with requests alive, as SGLang's does;
- the weight-update session (`begin_weight_update` / `end_weight_update`) rules;
- LoRA adapters (`lora.py`): load and unload by name, requests that name one run under it, an
  unload waits for the requests that use the adapter.

Every step recomputes each sequence from scratch (no KV cache): exact, simple, and fast enough for
the small models tests use. So `retract` and `in_place` produce the same numbers here (both read
prompt + tokens so far under the current weights); only the flush rule tells them apart.

Test hooks (in-process only, not HTTP): `hold_at_tokens` freezes stepping once any request has that
many output tokens, and `hold()` freezes it at once, until `release()`; `wait_until_running(n)`
waits for n admitted requests; `control_log` records control calls in order; `rids` records every
admitted rid.

A finished request sets its `done` event and calls its `on_done` callback (from whichever thread
finished it, under the engine lock): the asyncio HTTP front wakes its handler with it, so a thousand
waiting requests need no thread each.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from asyncrl.models.sampling import left_pad
from tests.support.sglang.lora import NOT_ENABLED, Adapter, LoraSettings, forward, read_adapter
from tests.support.sglang.params import Pick, RequestError, SamplingSpec, pick_token

log = logging.getLogger(__name__)


@dataclass(eq=False)
class EngineRequest:
    rid: str
    input_ids: list[int]
    spec: SamplingSpec
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    return_sampling_mask: bool = False
    sampling_logprobs_mode: str | None = None
    lora: str | None = None  # the adapter the request names (`lora_path`); resolved at submit
    adapter: Adapter | None = None
    rng: torch.Generator = field(default_factory=torch.Generator)
    output_ids: list[int] = field(default_factory=list)
    picks: list[Pick] = field(default_factory=list)
    labels: list[str] = field(default_factory=list)  # weight-version label per output token
    input_logprobs: list[list[Any]] | None = None
    finish: dict[str, Any] | None = None
    status_code: int = 200
    num_retractions: int = 0
    created: float = field(default_factory=time.perf_counter)
    done: threading.Event = field(default_factory=threading.Event)
    on_done: Callable[[], None] | None = None  # called once done is set; must not block


def version_spans(labels: list[str]) -> list[dict[str, Any]]:
    """Contiguous `{"version", "start", "end"}` runs over output-token indices."""
    spans: list[dict[str, Any]] = []
    for i, label in enumerate(labels):
        if spans and spans[-1]["version"] == label:
            spans[-1]["end"] = i + 1
        else:
            spans.append({"version": label, "start": i, "end": i + 1})
    return spans


class Engine:
    def __init__(
        self,
        model_dir: str | Path,
        *,
        weight_version: str = "default",
        threads: int = 1,
        skip_tokenizer_init: bool = False,
        lora: LoraSettings | None = None,
    ) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        torch.set_num_threads(threads)
        self.model_path = str(model_dir)
        self.initial_path = self.model_path
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.tokenizer = None  # as with --skip-tokenizer-init: no text in or out, no stop strings
        if not skip_tokenizer_init:
            try:
                self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
            except (OSError, ValueError):
                pass
        self.vocab_size = int(self.model.get_output_embeddings().weight.shape[0])
        self.context_len = int(getattr(self.model.config, "max_position_embeddings", 0) or 1 << 30)
        self.eos_ids = self._eos_ids()
        self.pad_id = (
            0
            if self.tokenizer is None or self.tokenizer.pad_token_id is None
            else self.tokenizer.pad_token_id
        )
        self.weight_version = weight_version
        self.cond = threading.Condition()
        self.running: dict[str, EngineRequest] = {}
        self.paused: str | None = None  # pause mode while paused
        self.writers_waiting = 0
        self.stepping = False
        self.session_open = False
        self.closed = False
        self.hold_at_tokens: int | None = None
        self.held = False
        self.held_event = threading.Event()  # set with `held`: a test waits on it from any thread
        self.control_log: list[tuple[str, dict[str, Any]]] = []
        self.rids: list[str] = []
        self.num_generate_requests = 0
        self.lora = lora or LoraSettings()
        self.adapters: dict[str, Adapter] = {}  # loaded, by name
        self.lora_events: list[tuple[str, str]] = []  # ("load" | "unload", name), in order
        self.lora_requests: dict[str, int] = {}  # admitted requests per adapter name
        self.thread = threading.Thread(target=self._loop, name="standin-scheduler", daemon=True)
        self.thread.start()

    def _eos_ids(self) -> tuple[int, ...]:
        gen_cfg = getattr(self.model, "generation_config", None)
        eos = getattr(gen_cfg, "eos_token_id", None)
        if eos is None and self.tokenizer is not None:
            eos = self.tokenizer.eos_token_id
        if eos is None:
            eos = getattr(self.model.config, "eos_token_id", None)
        if eos is None:
            return ()
        return tuple(eos) if isinstance(eos, list | tuple) else (int(eos),)

    # ------------------------------------------------------------------ requests
    def check_input(self, input_ids: list[int], spec: SamplingSpec) -> None:
        if not input_ids:
            raise RequestError("input_ids cannot be empty.")
        bad = [t for t in input_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise RequestError(
                f"input_ids has token ids outside the vocabulary [0, {self.vocab_size}): {bad[:5]}"
            )
        if len(input_ids) >= self.context_len:
            raise RequestError(
                f"The input ({len(input_ids)} tokens) is longer than the model's context length "
                f"({self.context_len} tokens)."
            )

    def submit(self, req: EngineRequest) -> None:
        """Admit a request; blocks while paused or while a weight update waits (writer preference)."""
        with self.cond:
            self.cond.wait_for(lambda: self.closed or (self.paused is None and self.writers_waiting == 0))
            if self.closed:
                raise RequestError("The server is shutting down.")
            if req.rid in self.running:
                raise RequestError(f"Duplicate request ID detected: {req.rid}")
            if req.lora is not None:
                if not self.lora.enabled:
                    raise RequestError(NOT_ENABLED)
                if req.lora not in self.adapters:
                    raise RequestError(
                        f"The following requested LoRA adapters are not loaded: {req.lora}\n"
                        f"Loaded adapters: {list(self.adapters)}."
                    )
                req.adapter = self.adapters[req.lora]
                self.lora_requests[req.lora] = self.lora_requests.get(req.lora, 0) + 1
            self.running[req.rid] = req
            self.rids.append(req.rid)
            self.num_generate_requests += 1
            self.cond.notify_all()

    def _finish(self, req: EngineRequest, finish: dict[str, Any], status_code: int = 200) -> None:
        """Under `cond`: the request leaves the engine and its waiter wakes."""
        if self.running.get(req.rid) is req:
            del self.running[req.rid]
        req.finish = finish
        req.status_code = status_code
        req.done.set()
        if req.on_done is not None:
            req.on_done()
        self.cond.notify_all()

    def _abort(self, req: EngineRequest) -> None:
        if req.output_ids or req.picks:
            self._finish(req, {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None})
        else:
            self._finish(req, {"type": "abort", "message": "Abort in waiting queue"})

    def abort(self, rid: str = "", abort_all: bool = False) -> None:
        with self.cond:
            self.control_log.append(("abort_request", {"rid": rid, "abort_all": abort_all}))
            targets = (
                list(self.running.values())
                if abort_all
                else [self.running[rid]]
                if rid in self.running
                else []
            )
            for req in targets:
                self._abort(req)

    def cancel(self, req: EngineRequest) -> None:
        """The client went away: abort its request if it is still running."""
        with self.cond:
            if self.running.get(req.rid) is req:
                self._abort(req)

    # ------------------------------------------------------------------ control
    def pause(self, mode: str) -> None:
        with self.cond:
            self.control_log.append(("pause_generation", {"mode": mode}))
            self.paused = mode
            if mode == "abort":
                for req in list(self.running.values()):
                    self._abort(req)
            elif mode == "retract":
                for req in self.running.values():
                    if req.output_ids:
                        req.num_retractions += 1
            self.cond.notify_all()
            self.cond.wait_for(lambda: not self.stepping)  # no forward is running when pause returns

    def resume(self) -> None:
        with self.cond:
            self.control_log.append(("continue_generation", {}))
            self.paused = None
            self.cond.notify_all()

    def hold(self) -> None:
        """Test hook: no step starts from now on (one that runs finishes) until `release()`;
        requests are still admitted and wait, in flight."""
        with self.cond:
            self.held = True
            self.held_event.set()
            self.cond.notify_all()

    def wait_until_running(self, n: int, timeout_s: float) -> bool:
        """Test hook: block until at least `n` requests are admitted and unfinished (False on timeout)."""
        with self.cond:
            return self.cond.wait_for(lambda: len(self.running) >= n, timeout_s)

    def release(self) -> None:
        """Test hook: lift `hold()` and `hold_at_tokens`."""
        with self.cond:
            self.hold_at_tokens = None
            self.held = False
            self.held_event.clear()
            self.cond.notify_all()

    @contextlib.contextmanager
    def _exclusive(self, name: str, body: dict[str, Any], abort_all: bool) -> Iterator[None]:
        """A weight change: at once when paused, else after running requests drain (writer lock,
        new requests wait meanwhile)."""
        with self.cond:
            self.control_log.append((name, body))
            if abort_all:
                for req in list(self.running.values()):
                    self._abort(req)
            writer = self.paused is None
            self.writers_waiting += writer
            try:
                self.cond.wait_for(lambda: not self.stepping and (not writer or not self.running))
                yield
            finally:
                self.writers_waiting -= writer
                self.cond.notify_all()

    def update_weights_from_disk(
        self, model_path: str, *, weight_version: str | None, abort_all: bool, flush_cache: bool
    ) -> tuple[bool, str, int]:
        """(success, message, num_paused_requests), with SGLang's messages."""
        from safetensors.torch import load_file

        body = {"model_path": model_path, "weight_version": weight_version, "flush_cache": flush_cache}
        with self._exclusive("update_weights_from_disk", body, abort_all):
            files = sorted(Path(model_path).glob("*.safetensors")) if Path(model_path).is_dir() else []
            if not files:
                return False, f"Failed to get weights iterator: no *.safetensors files in {model_path}.", 0
            state: dict[str, torch.Tensor] = {}
            try:
                for f in files:
                    state.update(load_file(f))
            except (OSError, ValueError, RuntimeError) as exc:  # a truncated or corrupt file
                return False, f"Failed to update weights: {exc}. Rolling back to the original weights.", 0
            problem = self._mismatch(state)
            if problem:
                return False, f"Failed to update weights: {problem}. Rolling back to the original weights.", 0
            self._copy_in(state)
            self.model_path = model_path
            return self._loaded("Succeeded to update model weights.", weight_version, flush_cache)

    def update_weights_from_tensors(
        self,
        state: dict[str, torch.Tensor],
        *,
        weight_version: str | None,
        abort_all: bool,
        flush_cache: bool,
    ) -> tuple[bool, str, int]:
        """The load half of /update_weights_from_distributed (the tensors were received already):
        (success, message, num_paused_requests)."""
        body = {"names": list(state), "weight_version": weight_version, "flush_cache": flush_cache}
        with self._exclusive("update_weights_from_distributed", body, abort_all):
            problem = self._mismatch(state)
            if problem:
                return False, f"Failed to update weights: {problem}. Please discard the whole weights.", 0
            self._copy_in(state)
            return self._loaded("Succeeded to update parameter online.", weight_version, flush_cache)

    def _mismatch(self, state: dict[str, torch.Tensor]) -> str:
        """Why `state` cannot be loaded into the model ("" if it can): an unknown name or a shape."""
        params = self.model.state_dict()
        for name, t in state.items():
            if name not in params:
                return f"{name} is not a parameter of the model"
            if params[name].shape != t.shape:
                return f"{name} has shape {list(t.shape)}, the model has {list(params[name].shape)}"
        return ""

    def _copy_in(self, state: dict[str, torch.Tensor]) -> None:
        params = self.model.state_dict()
        with torch.no_grad():
            for name, t in state.items():
                params[name].copy_(t)

    def _loaded(self, message: str, weight_version: str | None, flush_cache: bool) -> tuple[bool, str, int]:
        """Under `_exclusive`, after a load: the version label and SGLang's cache-flush rule."""
        if weight_version is not None:
            self.weight_version = weight_version
            message += f" Weight version updated to {weight_version}."
        num_paused = len(self.running)
        if flush_cache and self.paused == "in_place" and self.running:
            return (
                False,
                (
                    "Weights were updated, but the cache was not flushed because requests are still "
                    "running or queued; pass flush_cache=false or pause in retract mode."
                ),
                num_paused,
            )
        return True, message, num_paused

    def weights_by_name(self, name: str) -> torch.Tensor | None:
        """A parameter's current values (a copy), or None for an unknown name."""
        t = self.model.state_dict().get(name)
        with self.cond:
            return None if t is None else t.detach().clone()

    # ------------------------------------------------------------------ LoRA adapters
    def loaded_adapters(self) -> dict[str, str]:
        with self.cond:
            return {name: a.path for name, a in self.adapters.items()}

    def load_lora_adapter(self, name: str, path: str) -> tuple[bool, str]:
        """(success, error_message): read and check the adapter, then register it under `name`."""
        with self.cond:
            self.control_log.append(("load_lora_adapter", {"lora_name": name, "lora_path": path}))
            if name in self.adapters:
                return False, f"LoRA with name {name} already exists. Loaded LoRAs: {list(self.adapters)}"
        try:
            adapter = read_adapter(self.model, name, path, self.lora)
        except RequestError as exc:
            return False, str(exc)
        with self.cond:
            if name in self.adapters:  # a concurrent load of the same name won
                return False, f"LoRA with name {name} already exists. Loaded LoRAs: {list(self.adapters)}"
            self.adapters[name] = adapter
            self.lora_events.append(("load", name))
        return True, ""

    def unload_lora_adapter(self, name: str) -> tuple[bool, str]:
        """(success, error_message): new requests can no longer name it at once; returns when no
        running request uses it any more."""
        with self.cond:
            self.control_log.append(("unload_lora_adapter", {"lora_name": name}))
            if not self.lora.enabled:
                return False, NOT_ENABLED
            adapter = self.adapters.pop(name, None)
            if adapter is None:
                return False, f"LoRA with name {name} does not exist. Loaded LoRAs: {list(self.adapters)}"
            self.cond.wait_for(
                lambda: self.closed or all(r.adapter is not adapter for r in self.running.values())
            )
            self.lora_events.append(("unload", name))
        return True, ""

    def update_weight_version(self, new_version: str, *, abort_all: bool) -> None:
        body = {"new_version": new_version, "abort_all_requests": abort_all}
        with self._exclusive("update_weight_version", body, abort_all):
            self.weight_version = new_version

    def begin_session(self) -> tuple[bool, str]:
        with self.cond:
            self.control_log.append(("begin_weight_update", {}))
            if self.session_open:
                return False, "a weight-update session is already open; call end_weight_update() first"
            self.session_open = True
            return True, "Success"

    def end_session(self) -> tuple[bool, str]:
        with self.cond:
            self.control_log.append(("end_weight_update", {}))
            if not self.session_open:
                return False, "no weight-update session is open; call begin_weight_update() first"
            self.session_open = False
            return True, "Success"

    def loads(self) -> dict[str, int]:
        with self.cond:
            waiting = sum(1 for r in self.running.values() if not r.picks)
            return {
                "dp_rank": 0,
                "num_running_reqs": len(self.running) - waiting,
                "num_waiting_reqs": waiting,
            }

    def close(self) -> None:
        with self.cond:
            self.closed = True
            for req in list(self.running.values()):
                self._abort(req)
            self.cond.notify_all()
        self.thread.join(timeout=10)

    # ------------------------------------------------------------------ scheduler
    def _can_step(self) -> bool:
        return self.closed or (bool(self.running) and self.paused is None and not self.held)

    def _loop(self) -> None:
        while True:
            with self.cond:
                self.cond.wait_for(self._can_step)
                if self.closed:
                    return
                batch = list(self.running.values())
                label = self.weight_version
                self.stepping = True
            try:
                results = self._step(batch)
                error = None
            except Exception as exc:  # a bug or a bad model must not hang the waiters: report it
                log.exception("stand-in engine step failed")
                results, error = {}, exc
            with self.cond:
                self.stepping = False
                for req in batch:
                    if self.running.get(req.rid) is not req:
                        continue  # aborted while the step ran: its partial output was returned
                    if error is not None:
                        self._finish(req, {"type": "abort", "message": str(error), "status_code": 500}, 500)
                        continue
                    pick = results.get(req.rid)
                    if pick is not None:
                        req.output_ids.append(pick.token)
                        req.picks.append(pick)
                        req.labels.append(label)
                    finish = self._finish_reason(req)
                    if finish is not None:
                        self._finish(req, finish)
                    elif self.hold_at_tokens is not None and len(req.output_ids) >= self.hold_at_tokens:
                        self.held = True
                        self.held_event.set()
                self.cond.notify_all()

    def _budget(self, req: EngineRequest) -> int:
        limit = self.context_len - len(req.input_ids)
        max_new = req.spec.max_new_tokens
        return limit if max_new is None else min(max_new, limit)

    def _finish_reason(self, req: EngineRequest) -> dict[str, Any] | None:
        if req.output_ids:
            tok = req.output_ids[-1]
            if tok in req.spec.stop_token_ids or (tok in self.eos_ids and not req.spec.ignore_eos):
                return {"type": "stop", "matched": tok}
            if req.spec.stop and self.tokenizer is not None:
                text = self.tokenizer.decode(req.output_ids)
                for s in req.spec.stop:
                    if s in text:
                        return {"type": "stop", "matched": s}
        if len(req.output_ids) >= self._budget(req):
            return {"type": "length", "length": len(req.output_ids)}
        return None

    def _forward_last(self, seqs: list[list[int]], adapter: Adapter | None = None) -> torch.Tensor:
        ids_BL, attn_BL = left_pad(seqs, self.pad_id)
        pos_BL = (attn_BL.cumsum(dim=1) - 1).clamp(min=0)
        return forward(
            self.model, adapter, input_ids=ids_BL, attention_mask=attn_BL, position_ids=pos_BL
        ).logits

    @torch.no_grad()
    def _step(self, batch: list[EngineRequest]) -> dict[str, Pick]:
        for req in batch:
            if req.logprob_start_len >= 0 and req.input_logprobs is None:
                req.input_logprobs = self._input_logprobs(req)
        active = [r for r in batch if len(r.output_ids) < self._budget(r)]
        by_adapter: dict[int, list[EngineRequest]] = {}  # one forward per adapter (None: the base)
        for req in active:
            by_adapter.setdefault(id(req.adapter), []).append(req)
        out = {}
        for group in by_adapter.values():
            logits_BLV = self._forward_last([r.input_ids + r.output_ids for r in group], group[0].adapter)
            for i, req in enumerate(group):
                banned = []
                if len(req.output_ids) < req.spec.min_new_tokens:
                    banned = sorted({*self.eos_ids, *req.spec.stop_token_ids})
                out[req.rid] = pick_token(logits_BLV[i, -1], req.spec, req.rng, banned=banned)
        return out

    def _input_logprobs(self, req: EngineRequest) -> list[list[Any]]:
        """Prompt log-probs from position `logprob_start_len`, plain log_softmax (no temperature)."""
        ids = req.input_ids
        logits_LV = self._forward_last([ids], req.adapter)[0].float()
        logp_LV = torch.log_softmax(logits_LV, dim=-1)
        rows: list[list[Any]] = []
        for pos in range(req.logprob_start_len, len(ids)):
            value = None if pos == req.logprob_start_len or pos == 0 else float(logp_LV[pos - 1, ids[pos]])
            rows.append([value, ids[pos], None])
        return rows


def new_request(
    input_ids: list[int], spec: SamplingSpec, *, rid: str | None = None, **kw: Any
) -> EngineRequest:
    rng = torch.Generator()
    rng.manual_seed(spec.sampling_seed if spec.sampling_seed is not None else int(uuid.uuid4().int >> 65))
    return EngineRequest(rid=rid or uuid.uuid4().hex, input_ids=list(input_ids), spec=spec, rng=rng, **kw)
