"""The /generate wire format of the stand-in SGLang server: JSON body in, engine requests, JSON out.

Place in the data flow: `server.py` receives a POST /generate and passes its JSON body to
`parse_generate`, which checks it against the contract of /work/shared/SGLANG_API.md section 1
(one of text or input_ids, batches, `n`, per-item options, `lora_path` adapter names,
`sampling_params` via `params.py`) and returns one `EngineRequest` per sample, or raises
`ContractError` / `RequestError` for the server to answer 400 with SGLang's error shape. `server.py` submits the requests to `engine.py`, waits
for them, and turns each finished one into its response item with `generate_response` (text,
output_ids and `meta_info`: finish reason, weight-version spans, log-prob triples, sampling masks).
No HTTP here: the handler's status codes and sockets stay in `server.py`.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from tests.support.sglang.engine import Engine, EngineRequest, new_request, version_spans
from tests.support.sglang.params import ContractError, RequestError, parse_sampling_params

__all__ = ["generate_response", "parse_generate"]


def _as_list(value: Any, n: int, name: str) -> list[Any]:
    """`value` once per batch item: a list must have `n` entries, anything else is repeated."""
    if isinstance(value, list):
        if len(value) != n:
            raise RequestError(f"{name} has {len(value)} entries for a batch of {n}.")
        return value
    return [value] * n


def parse_generate(engine: Engine, body: dict[str, Any]) -> tuple[list[EngineRequest], bool]:
    """The engine requests a /generate body asks for (`n` per prompt) and whether the response
    is a list; raises ContractError or RequestError, having submitted nothing."""
    given = [k for k in ("text", "input_ids", "input_embeds") if body.get(k) is not None]
    if len(given) != 1:
        raise RequestError("Either text, input_ids or input_embeds should be provided (exactly one).")
    if given[0] == "input_embeds":
        raise RequestError("input_embeds is not implemented by the stand-in server.")
    if body.get("stream"):
        raise RequestError("stream=true is not implemented by the stand-in server; send stream=false.")
    if given[0] == "text":
        if engine.tokenizer is None:
            raise RequestError("text input needs a tokenizer; send input_ids.")
        texts = body["text"] if isinstance(body["text"], list) else [body["text"]]
        prompts = [engine.tokenizer(t)["input_ids"] for t in texts]
        batched = isinstance(body["text"], list)
    else:
        ids = body["input_ids"]
        if not isinstance(ids, list):
            raise ContractError(f"invalid type: {type(ids).__name__}, expected a sequence (input_ids)")
        batched = bool(ids) and isinstance(ids[0], list)
        prompts = ids if batched else [ids]
        for p in prompts:
            if not isinstance(p, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in p):
                raise ContractError("invalid type: expected a sequence of i64 (input_ids)")
    params = _as_list(body.get("sampling_params") or {}, len(prompts), "sampling_params")
    specs = [parse_sampling_params(p, vocab_size=engine.vocab_size) for p in params]
    n = specs[0].n
    batched = batched or n > 1
    rid = body.get("rid")
    if isinstance(rid, list):
        rids = _as_list(rid, len(prompts), "rid")
    elif rid is not None and batched:
        rids = [f"{rid}_{i}" for i in range(len(prompts))]
    else:
        rids = [rid] * len(prompts)
    options = {
        "return_logprob": body.get("return_logprob", False),
        "logprob_start_len": body.get("logprob_start_len", -1),
        "top_logprobs_num": body.get("top_logprobs_num", 0),
        "return_sampling_mask": body.get("return_sampling_mask", False),
    }
    mode = body.get("sampling_logprobs_mode")
    if mode is not None and not options["return_sampling_mask"]:
        raise RequestError("sampling_logprobs_mode needs return_sampling_mask=true.")
    if mode not in (None, "selected", "support"):
        raise RequestError(f"sampling_logprobs_mode must be 'selected' or 'support', got {mode!r}.")
    per_item = {k: _as_list(v, len(prompts), k) for k, v in options.items()}
    loras = _as_list(body.get("lora_path"), len(prompts), "lora_path")  # adapter names (or None)
    for lora in loras:
        if lora is not None and not isinstance(lora, str):
            raise RequestError(f"lora_path must be an adapter name (a string) or null, got {lora!r}.")
    reqs = []
    for i, (prompt, spec) in enumerate(zip(prompts, specs, strict=True)):
        engine.check_input(prompt, spec)
        start = per_item["logprob_start_len"][i]
        if start > len(prompt):
            raise RequestError(
                f"logprob_start_len ({start}) is larger than the prompt ({len(prompt)} tokens)."
            )
        for _ in range(n):
            reqs.append(
                new_request(
                    prompt,
                    spec,
                    rid=uuid.uuid4().hex if n > 1 else rids[i],
                    return_logprob=bool(per_item["return_logprob"][i]),
                    logprob_start_len=int(start),
                    top_logprobs_num=int(per_item["top_logprobs_num"][i]),
                    return_sampling_mask=bool(per_item["return_sampling_mask"][i]),
                    sampling_logprobs_mode=mode
                    or ("selected" if per_item["return_sampling_mask"][i] else None),
                    lora=loras[i],
                )
            )
    return reqs, batched


def generate_response(engine: Engine, req: EngineRequest) -> dict[str, Any]:
    """The response item of a finished request: text, output_ids and `meta_info`."""
    spans = version_spans(req.labels)
    meta: dict[str, Any] = {
        "id": req.rid,
        "finish_reason": req.finish,
        "weight_version": spans[-1]["version"] if spans else engine.weight_version,
        "num_retractions": req.num_retractions,
        "reasoning_tokens": 0,
        "completion_tokens": len(req.output_ids),
        "weight_versions": spans,
        "e2e_latency": time.perf_counter() - req.created,
    }
    if req.finish.get("message") != "Abort in waiting queue":
        meta["prompt_tokens"] = len(req.input_ids)
        meta["cached_tokens"] = 0
    if req.return_logprob:
        meta["output_token_logprobs"] = [[p.logprob, p.token, None] for p in req.picks]
        meta["input_token_logprobs"] = req.input_logprobs or []
        meta["output_token_logprobs_length"] = len(req.picks)
        if req.top_logprobs_num > 0:
            meta["output_top_logprobs"] = [
                [
                    [float(v), int(t), None]
                    for v, t in zip(*p.full_logp_V.topk(req.top_logprobs_num), strict=True)
                ]
                for p in req.picks
            ]
    if req.return_sampling_mask:
        meta["output_token_sampling_mask"] = [p.support for p in req.picks]
        meta["output_token_sampling_mask_length"] = len(req.picks)
        if req.sampling_logprobs_mode == "support":
            meta["output_token_sampling_logprobs"] = [p.support_logprobs for p in req.picks]
        else:
            meta["output_token_sampling_logprobs"] = [p.sampling_logprob for p in req.picks]
    text = ""
    if engine.tokenizer is not None:
        text = engine.tokenizer.decode(req.output_ids, skip_special_tokens=req.spec.skip_special_tokens)
    return {"text": text, "output_ids": list(req.output_ids), "meta_info": meta}
