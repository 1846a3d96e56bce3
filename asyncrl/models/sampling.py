"""Batched sampling with a KV cache from a Hugging Face causal LM, with exact behavior log-probs.

Pure with respect to the system: a model and token ids in, token ids, log-probs and versions out.
The log-prob recorded for each sampled token is taken from exactly the distribution it was
sampled from: softmax(logits / temperature), renormalised over the top-p nucleus when top_p < 1.
Greedy decoding (temperature 0) records log_softmax(logits).

Randomness is per sample: row i draws one uniform per sampled token from its own generator, seeded
by `sample_seed(run_seed, group_id, sample_index)`, and picks the token by inverse CDF, so a sample's
completion does not depend on which other samples share its batch.

In-flight weight updates: `poll_update` is called between decode steps (after a token is sampled,
before the forward that reads it); when it swaps the model's weights and returns True, the batch
goes on by the `inflight` mode:
  keep     continue on the KV cache built so far; later forwards use the new weights
  retract  recompute the KV cache of prompt + tokens so far under the new weights, then continue
  abort    drop the unfinished samples' tokens and restart them from their prompts
A token's version is the version of the weights whose forward produced the logits it was sampled
from, and its log-prob is taken from exactly those logits, in every mode.

Extra samples (on-policy distillation's multi-sample cache, docs/opd.md): with
`num_extra_samples = K > 0`, every sampled position also draws K more tokens, with replacement,
from the same distribution the token was sampled from (the same logits, temperature and nucleus),
and records their log-probs. They come from a second per-sample generator seeded by
`extra_sample_seed(seed)`, so they never consume the main stream's uniforms: a completion is the
same with or without extras. Under greedy decoding (temperature 0) extras are drawn from
log_softmax(logits), the distribution whose log-probs greedy decoding records.

Devices: the model may live anywhere (`resolve_device` turns a config setting into one). Token
ids, masks and positions go to the model's device; the per-sample generators stay CPU
`torch.Generator`s and their float64 uniforms are moved to the logits, so a sample draws the same
uniforms on every device. What comes back (ids, log-probs, versions) is plain Python, copied off
the device once per decode step.

Legend: B sequences, K extra samples per position, L prompt length (left-padded), V vocab.
"""

from __future__ import annotations

import hashlib
import inspect
import struct
from collections.abc import Callable, Sequence
from typing import Literal, NamedTuple

import torch

from asyncrl.kernels.logprobs import nucleus_keep

InflightMode = Literal["keep", "retract", "abort"]
INFLIGHT_MODES: tuple[str, ...] = ("keep", "retract", "abort")


class SampleOutput(NamedTuple):
    completion_ids: list[list[int]]  # sampled tokens, ending with eos when one was emitted
    logprobs: list[list[float]]  # behavior log-prob of each completion token
    versions: list[list[int]]  # policy_version that produced each completion token
    finish_reasons: list[str]  # "stop" (eos) or "length"
    num_decode_steps: int
    num_weight_updates: int = 0  # updates applied mid-generation
    # With num_extra_samples = K > 0: per completion token, K more ids drawn from the same
    # distribution ([T][K]) and their log-probs under it ([T][K]); None otherwise.
    extra_ids: list[list[list[int]]] | None = None
    extra_logprobs: list[list[list[float]]] | None = None


def device_setting(setting: str) -> str:
    """A device setting with "auto" made concrete: "cuda" when torch sees a GPU, else "cpu";
    anything else ("cpu", "cuda", "cuda:1") as given."""
    if setting == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return setting


def resolve_device(setting: str, *, field: str) -> torch.device:
    """The torch device of a config setting ("auto", "cpu", "cuda", "cuda:N"); ValueError naming
    `field` (the config key, e.g. "generators.device") when CUDA is asked for and torch has none."""
    device = torch.device(device_setting(setting))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            f"{field} = {setting!r} but torch sees no CUDA device here (torch.cuda.is_available() is "
            f"False); set --set {field}=cpu, or {field}=auto to use a GPU only where there is one"
        )
    return device


def model_device(model) -> torch.device:
    """Where `model`'s forward wants its inputs: its `device` attribute (Hugging Face models have
    one), else the device of its first parameter, else the CPU."""
    device = getattr(model, "device", None)
    if isinstance(device, torch.device):
        return device
    first = next(iter(model.parameters()), None) if hasattr(model, "parameters") else None
    return torch.device("cpu") if first is None else first.device


def sample_seed(run_seed: int, group_id: int, sample_index: int, attempt: int = 0) -> int:
    """The RNG seed of one sample: a hash of (run seed, group, index), so batching cannot change it.
    A sample drawn again (`PromptTask.attempt` > 0: its reward failed) gets fresh uniforms."""
    packed = struct.pack("<qqq", run_seed, group_id, sample_index)
    if attempt:
        packed += struct.pack("<q", attempt)
    digest = hashlib.sha256(packed).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def extra_sample_seed(seed: int) -> int:
    """The seed of a sample's second generator, which draws only the extra (OPD cache) tokens."""
    digest = hashlib.sha256(b"opd-extra" + struct.pack("<q", seed)).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def inverse_cdf_sample_many(logp_BV: torch.Tensor, u_BK: torch.Tensor) -> torch.Tensor:
    """K tokens per row, each the one whose CDF interval holds its uniform in [0, 1); never a
    zero-prob token. One CDF per row serves all K draws."""
    probs_BV = logp_BV.double().exp()
    cdf_BV = probs_BV.cumsum(dim=-1)
    target_BK = u_BK.double() * cdf_BV[:, -1:]
    tok_BK = torch.searchsorted(cdf_BV, target_BK, right=True)
    # Rounding can put the target at the very top: take the last token with mass then.
    last_B = probs_BV.shape[1] - 1 - (probs_BV.flip(-1) > 0).to(torch.int8).argmax(dim=-1)
    return torch.minimum(tok_BK, last_B[:, None])


def inverse_cdf_sample(logp_BV: torch.Tensor, u_B: torch.Tensor) -> torch.Tensor:
    """Token per row whose CDF interval holds `u_B` (uniforms in [0, 1)); never a zero-prob token."""
    return inverse_cdf_sample_many(logp_BV, u_B[:, None]).squeeze(1)


def left_pad(prompt_ids: Sequence[Sequence[int]], pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompt_ids)
    ids = torch.full((len(prompt_ids), width), pad_token_id, dtype=torch.long)
    attn = torch.zeros((len(prompt_ids), width), dtype=torch.long)
    for i, p in enumerate(prompt_ids):
        if len(p) == 0:
            raise ValueError(f"prompt {i} is empty: every prompt needs at least one token (e.g. <bos>)")
        ids[i, width - len(p) :] = torch.tensor(p, dtype=torch.long)
        attn[i, width - len(p) :] = 1
    return ids, attn


def _nucleus_logprobs(logp_BV: torch.Tensor, top_p: float) -> torch.Tensor:
    """Log-probs renormalised over the smallest set whose mass reaches top_p (others -inf); the
    learner renormalises its own log-probs over the same rule (`nucleus_keep`)."""
    keep_BV = nucleus_keep(logp_BV, top_p)
    kept_BV = torch.where(keep_BV, logp_BV, torch.full_like(logp_BV, -torch.inf))
    return kept_BV - torch.logsumexp(kept_BV, dim=-1, keepdim=True)


def next_token_logprobs(logits_BV: torch.Tensor, *, temperature: float, top_p: float) -> torch.Tensor:
    logits_BV = logits_BV.float()
    if temperature > 0:
        logits_BV = logits_BV / temperature
    logp_BV = torch.log_softmax(logits_BV, dim=-1)
    if top_p < 1.0:
        logp_BV = _nucleus_logprobs(logp_BV, top_p)
    return logp_BV


def _cache_keyword(model) -> str:
    """transformers >= 5.x names the KV cache argument `cache`; 4.x calls it `past_key_values`."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _last_logits_only(model, device: torch.device) -> dict:
    """The prefill needs the logits of the last position only; off the CPU, where [B, L, V] logits
    of a long prompt batch would not fit, ask for those alone (`logits_to_keep`, transformers >=
    4.50). On the CPU every position's are kept: a [B, D] @ [D, V] product can differ in the last
    bit from the last rows of a [B * L, D] one, and CPU runs stay bit-for-bit what they were."""
    if device.type == "cpu" or "logits_to_keep" not in inspect.signature(model.forward).parameters:
        return {}
    return {"logits_to_keep": 1}


def _cache_of(out):
    cache = getattr(out, "cache", None)
    return cache if cache is not None else out.past_key_values


class _Decode:
    """The KV-cached state of a batch: cache, attention mask, next positions, last logits. The
    tensors it feeds the model live on `device`, the model's."""

    def __init__(self, model, seqs: Sequence[Sequence[int]], pad_token_id: int, device: torch.device) -> None:
        self.model = model
        self.pad_token_id = pad_token_id
        self.device = device
        self.cache_kw = _cache_keyword(model)
        ids_BL, attn_BL = left_pad(seqs, pad_token_id)
        ids_BL, self.attn_BL = ids_BL.to(device), attn_BL.to(device)
        pos_BL = (self.attn_BL.cumsum(dim=1) - 1).clamp(min=0)
        out = model(
            input_ids=ids_BL,
            attention_mask=self.attn_BL,
            position_ids=pos_BL,
            use_cache=True,
            **_last_logits_only(model, device),
        )
        self.cache = _cache_of(out)
        self.logits_BV = out.logits[:, -1]
        self.next_pos_B = pos_BL[:, -1] + 1

    def step(self, tok_B: torch.Tensor) -> None:
        tok_B = tok_B.to(self.device)
        ones_B1 = torch.ones((tok_B.shape[0], 1), dtype=self.attn_BL.dtype, device=self.device)
        self.attn_BL = torch.cat([self.attn_BL, ones_B1], dim=1)
        out = self.model(
            input_ids=tok_B[:, None],
            attention_mask=self.attn_BL,
            position_ids=self.next_pos_B[:, None],
            use_cache=True,
            **{self.cache_kw: self.cache},
        )
        self.cache = _cache_of(out)
        self.logits_BV = out.logits[:, -1]
        self.next_pos_B = self.next_pos_B + 1


@torch.no_grad()
def generate(
    model,
    prompt_ids: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    temperature: float,
    eos_token_id: int,
    pad_token_id: int,
    top_p: float = 1.0,
    rng: torch.Generator | None = None,
    seeds: Sequence[int] | None = None,
    current_version: Callable[[], int] = lambda: 0,
    poll_update: Callable[[], bool] | None = None,
    inflight: InflightMode = "keep",
    num_extra_samples: int = 0,
    ignore_eos: bool = False,
) -> SampleOutput:
    """Sample up to `max_new_tokens` per prompt. The eos token, when emitted, is part of the
    completion's log-probs (it was sampled too) but not of `completion_ids`' text; its position is
    the last entry of `logprobs[i]` and `versions[i]`, and `completion_ids[i]` then ends with it.
    With `ignore_eos` every completion is `max_new_tokens` long: sampling goes on past an eos
    (SGLang's `ignore_eos`; `answer_ids` is the part a verifier reads).

    `seeds[i]` seeds row i's generator (see `sample_seed`); without `seeds`, row seeds are drawn
    from `rng` (or torch's global generator). `current_version` names the weights the model holds
    now; `poll_update` may swap them between decode steps (returns True when it did), handled by
    `inflight` as the module docstring says. `num_extra_samples` extra tokens per position are
    drawn and returned as the module docstring says.
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if inflight not in INFLIGHT_MODES:
        raise ValueError(f"inflight must be one of {', '.join(INFLIGHT_MODES)}, got {inflight!r}")
    if num_extra_samples < 0:
        raise ValueError(f"num_extra_samples must be >= 0, got {num_extra_samples}")
    num_seqs = len(prompt_ids)
    if seeds is None:
        seeds = torch.randint(0, 1 << 62, (num_seqs,), generator=rng).tolist()
    if len(seeds) != num_seqs:
        raise ValueError(f"got {len(seeds)} seeds for {num_seqs} prompts; pass one per prompt")
    rngs = [torch.Generator().manual_seed(int(s)) for s in seeds]
    num_extra = num_extra_samples
    extra_rngs = (
        [torch.Generator().manual_seed(extra_sample_seed(int(s))) for s in seeds] if num_extra else []
    )
    extra_ids: list[list[list[int]]] = [[] for _ in range(num_seqs)]
    extra_logprobs: list[list[list[float]]] = [[] for _ in range(num_seqs)]
    completions: list[list[int]] = [[] for _ in range(num_seqs)]
    logprobs: list[list[float]] = [[] for _ in range(num_seqs)]
    versions: list[list[int]] = [[] for _ in range(num_seqs)]
    done = [False] * num_seqs
    logits_version = current_version()
    device = model_device(model)
    state = _Decode(model, prompt_ids, pad_token_id, device)
    steps = 0
    num_updates = 0
    while True:
        steps += 1
        active = [i for i in range(num_seqs) if not done[i]]
        logp_BV = next_token_logprobs(state.logits_BV, temperature=temperature, top_p=top_p)
        if temperature > 0:
            u_B = torch.zeros(num_seqs, dtype=torch.float64)
            for i in active:  # one draw per sampled token, from the sample's own generator
                u_B[i] = torch.rand((), generator=rngs[i], dtype=torch.float64)
            tok_B = inverse_cdf_sample(logp_BV, u_B.to(logp_BV.device))
        else:
            tok_B = logp_BV.argmax(dim=-1)
        tok_logp_B = logp_BV.gather(1, tok_B[:, None]).squeeze(1)
        if num_extra:
            u_BK = torch.zeros((num_seqs, num_extra), dtype=torch.float64)
            for i in active:
                u_BK[i] = torch.rand((num_extra,), generator=extra_rngs[i], dtype=torch.float64)
            extra_BK = inverse_cdf_sample_many(logp_BV, u_BK.to(logp_BV.device))
            extra_ids_BK = extra_BK.tolist()  # one copy off the device per step, not one per row
            extra_logp_BK = logp_BV.gather(1, extra_BK).tolist()
            for i in active:
                extra_ids[i].append(extra_ids_BK[i])
                extra_logprobs[i].append(extra_logp_BK[i])
        tok_list, tok_logp_list = tok_B.tolist(), tok_logp_B.tolist()
        for i in active:
            tok = tok_list[i]
            completions[i].append(tok)
            logprobs[i].append(tok_logp_list[i])
            versions[i].append(logits_version)
            done[i] = (tok == eos_token_id and not ignore_eos) or len(completions[i]) >= max_new_tokens
        if all(done):
            break
        if poll_update is not None and poll_update():
            num_updates += 1
            logits_version = current_version()
            if inflight != "keep":
                if inflight == "abort":
                    for i in range(num_seqs):
                        if not done[i]:
                            completions[i].clear()
                            logprobs[i].clear()
                            versions[i].clear()
                            extra_ids[i].clear()
                            extra_logprobs[i].clear()
                seqs = [list(p) + c for p, c in zip(prompt_ids, completions, strict=True)]
                state = _Decode(model, seqs, pad_token_id, device)
                continue
        done_B = torch.tensor(done, device=tok_B.device)
        tok_B = torch.where(done_B, torch.full_like(tok_B, pad_token_id), tok_B)
        logits_version = current_version()
        state.step(tok_B)

    finish = ["stop" if c and c[-1] == eos_token_id and not ignore_eos else "length" for c in completions]
    if not num_extra:
        return SampleOutput(completions, logprobs, versions, finish, steps, num_updates)
    return SampleOutput(
        completions, logprobs, versions, finish, steps, num_updates, extra_ids, extra_logprobs
    )


def strip_eos(ids: Sequence[int], eos_token_id: int) -> list[int]:
    return list(ids[:-1]) if ids and ids[-1] == eos_token_id else list(ids)


def answer_ids(ids: Sequence[int], eos_token_id: int | None) -> list[int]:
    """The answer a verifier reads: the completion up to its first eos. Without `ignore_eos` an
    eos can only be the last token; with it, what was sampled past the eos is not the answer."""
    ids = list(ids)
    if eos_token_id is not None and eos_token_id in ids:
        return ids[: ids.index(eos_token_id)]
    return ids
