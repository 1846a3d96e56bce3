"""The stand-in SGLang server's request contract: `sampling_params` validation and the per-token
sampling math.

Place in the data flow: `generate.py` parses a /generate body, this module turns its
`sampling_params` into a `SamplingSpec` (or the exact error SGLang 0.5.22+ gives, see
/work/shared/SGLANG_API.md sections 1.2 and 1.6), and `engine.py` calls `pick_token` once per
sampled token. The math reuses `asyncrl.models.sampling` (the torch generator's), so a stand-in
server and the torch generator draw the same token from the same logits and uniform:

- reported log-prob (`output_token_logprobs`): log_softmax(logits / T) over the whole vocabulary,
  before top-k/top-p/min-p truncation, as SGLang reports it (plain log_softmax when greedy);
- sampling log-prob (`output_token_sampling_logprobs`, with `return_sampling_mask`): the log-prob
  under the truncated, renormalised distribution the token was drawn from.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from asyncrl.models.sampling import inverse_cdf_sample, next_token_logprobs

# Below this temperature SGLang samples greedily (top_k=1, temperature=1).
GREEDY_TEMPERATURE = 1e-6
DEFAULT_MAX_NEW_TOKENS = 128


class ContractError(ValueError):
    """The body breaks the typed JSON contract: HTTP 400 `{"error": "<serde-style message>"}`."""


class RequestError(ValueError):
    """A value the server rejects: HTTP 400 `{"error": {"message": "..."}}`."""


# key -> expected type: i64, f64, bool, str, strs (str or list of str), ints (list of int), map, any.
# Nullable keys accept JSON null as well.
SAMPLING_KEYS: dict[str, str] = {
    "max_new_tokens": "i64?",
    "min_new_tokens": "i64",
    "temperature": "f64",
    "top_p": "f64",
    "top_k": "i64",
    "min_p": "f64",
    "frequency_penalty": "f64",
    "presence_penalty": "f64",
    "repetition_penalty": "f64",
    "stop": "strs?",
    "stop_token_ids": "ints?",
    "stop_regex": "strs?",
    "ignore_eos": "bool",
    "no_stop_trim": "bool",
    "skip_special_tokens": "bool",
    "spaces_between_special_tokens": "bool",
    "n": "i64",
    "sampling_seed": "i64?",
    "logit_bias": "map?",
    "json_schema": "str?",
    "regex": "str?",
    "ebnf": "str?",
    "structural_tag": "str?",
    "stream_interval": "i64?",
    "custom_params": "map?",
    "beam_width": "i64?",
    "watermark": "any",
    "choice": "any",
}

# Known keys whose non-default values this stand-in does not implement (rejected, never ignored).
UNIMPLEMENTED_DEFAULTS: dict[str, Any] = {
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.0,
    "stop_regex": None,
    "json_schema": None,
    "regex": None,
    "ebnf": None,
    "structural_tag": None,
    "custom_params": None,
    "beam_width": None,
}


def _describe(value: Any) -> str:
    """How serde names a JSON value in an `invalid type` message."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"boolean `{str(value).lower()}`"
    if isinstance(value, int):
        return f"integer `{value}`"
    if isinstance(value, float):
        return f"floating point `{value!r}`"
    if isinstance(value, str):
        return f'string "{value}"'
    if isinstance(value, list):
        return "sequence"
    return "map"


def _check_type(key: str, value: Any, kind: str) -> None:
    nullable = kind.endswith("?")
    kind = kind.rstrip("?")
    if value is None and nullable or kind == "any":
        return
    is_int = isinstance(value, int) and not isinstance(value, bool)
    ok = {
        "i64": is_int,
        "f64": is_int or isinstance(value, float),
        "bool": isinstance(value, bool),
        "str": isinstance(value, str),
        "strs": isinstance(value, str)
        or (isinstance(value, list) and all(isinstance(v, str) for v in value)),
        "ints": isinstance(value, list)
        and all(isinstance(v, int) and not isinstance(v, bool) for v in value),
        "map": isinstance(value, dict),
    }[kind]
    if not ok:
        expected = {
            "i64": "i64",
            "f64": "f64",
            "bool": "a boolean",
            "str": "a string",
            "strs": "a string or a sequence of strings",
            "ints": "a sequence of i64",
            "map": "a map",
        }[kind]
        raise ContractError(f"invalid type: {_describe(value)}, expected {expected} (sampling_params.{key})")


@dataclass(frozen=True, kw_only=True)
class SamplingSpec:
    """Validated sampling parameters of one request."""

    max_new_tokens: int | None = DEFAULT_MAX_NEW_TOKENS
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: all tokens
    min_p: float = 0.0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    n: int = 1
    sampling_seed: int | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE


def parse_sampling_params(raw: Any, *, vocab_size: int) -> SamplingSpec:
    """A `SamplingSpec` from a request's `sampling_params`, or the error SGLang would answer."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ContractError(f"invalid type: {_describe(raw)}, expected a map (sampling_params)")
    for key, value in raw.items():
        if key not in SAMPLING_KEYS:
            expected = ", ".join(f"`{k}`" for k in SAMPLING_KEYS)
            raise ContractError(f"unknown field `{key}`, expected one of {expected}")
        _check_type(key, value, SAMPLING_KEYS[key])
    for key, default in UNIMPLEMENTED_DEFAULTS.items():
        if key in raw and raw[key] != default:
            raise RequestError(
                f"sampling_params.{key} = {raw[key]!r} is valid for SGLang but not implemented by the "
                f"stand-in server (tests.support.sglang); leave it at its default ({default!r})"
            )
    max_new = raw.get("max_new_tokens", DEFAULT_MAX_NEW_TOKENS)
    temperature = float(raw.get("temperature", 1.0))
    top_p = float(raw.get("top_p", 1.0))
    top_k = int(raw.get("top_k", -1))
    min_p = float(raw.get("min_p", 0.0))
    n = int(raw.get("n", 1))
    if max_new is not None and max_new < 0:
        raise RequestError(f"max_new_tokens must be at least 0, got {max_new}.")
    if temperature < 0:
        raise RequestError(f"temperature must be non-negative, got {temperature}.")
    if not 0 < top_p <= 1:
        raise RequestError(f"top_p must be in (0, 1], got {top_p}.")
    if top_k == 0 or top_k < -1:
        raise RequestError(f"top_k must be -1 (disable) or at least 1, got {top_k}.")
    if not 0 <= min_p <= 1:
        raise RequestError(f"min_p must be in [0, 1], got {min_p}.")
    if n < 1:
        raise RequestError(f"n must be at least 1, got {n}.")
    stop = raw.get("stop") or ()
    stop_ids = tuple(raw.get("stop_token_ids") or ())
    for t in stop_ids:
        if not 0 <= t < vocab_size:
            raise RequestError(f"stop_token_ids has {t}, outside the vocabulary [0, {vocab_size}).")
    bias = []
    for k, v in (raw.get("logit_bias") or {}).items():
        if not (k.isdigit() and int(k) < vocab_size) or not isinstance(v, int | float):
            raise RequestError(f"logit_bias: {k!r}: {v!r} must map a token id (as a string) to a number.")
        bias.append((int(k), float(v)))
    return SamplingSpec(
        max_new_tokens=max_new,
        min_new_tokens=int(raw.get("min_new_tokens", 0)),
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        min_p=min_p,
        stop=(stop,) if isinstance(stop, str) else tuple(stop),
        stop_token_ids=stop_ids,
        ignore_eos=bool(raw.get("ignore_eos", False)),
        skip_special_tokens=bool(raw.get("skip_special_tokens", True)),
        n=n,
        sampling_seed=raw.get("sampling_seed"),
        logit_bias=tuple(bias),
    )


@dataclass(frozen=True)
class Pick:
    token: int
    logprob: float  # full-vocabulary log_softmax(logits / T) (plain log_softmax when greedy)
    sampling_logprob: float  # under the truncated distribution actually sampled from
    support: list[int]  # ids with non-zero probability after truncation
    support_logprobs: list[float]
    full_logp_V: torch.Tensor  # for top_logprobs


def pick_token(
    logits_V: torch.Tensor, spec: SamplingSpec, rng: torch.Generator, *, banned: list[int]
) -> Pick:
    """Sample one token as SGLang does, drawing one uniform from `rng` unless greedy."""
    logits_V = logits_V.float().clone()
    for tok, bias in spec.logit_bias:
        logits_V[tok] += bias
    if banned:  # min_new_tokens not reached: stop tokens cannot be sampled
        logits_V[banned] = -torch.inf
    if spec.greedy:
        full_V = torch.log_softmax(logits_V, dim=-1)
        tok = int(full_V.argmax())
        return Pick(tok, float(full_V[tok]), 0.0, [tok], [0.0], full_V)
    full_V = torch.log_softmax(logits_V / spec.temperature, dim=-1)
    masked_V = logits_V
    if 0 < spec.top_k < logits_V.shape[0]:
        kth = logits_V.topk(spec.top_k).values[-1]
        masked_V = torch.where(logits_V >= kth, logits_V, torch.full_like(logits_V, -torch.inf))
    trunc_V = next_token_logprobs(masked_V[None], temperature=spec.temperature, top_p=spec.top_p)[0]
    if spec.min_p > 0:
        floor = trunc_V.max() + torch.log(torch.tensor(spec.min_p))
        trunc_V = torch.where(trunc_V >= floor, trunc_V, torch.full_like(trunc_V, -torch.inf))
        trunc_V = trunc_V - torch.logsumexp(trunc_V, dim=-1)
    u = torch.rand((1,), generator=rng, dtype=torch.float64)
    tok = int(inverse_cdf_sample(trunc_V[None], u)[0])
    support = torch.nonzero(torch.isfinite(trunc_V)).flatten()
    return Pick(
        tok,
        float(full_V[tok]),
        float(trunc_V[tok]),
        support.tolist(),
        trunc_V[support].tolist(),
        full_V,
    )
