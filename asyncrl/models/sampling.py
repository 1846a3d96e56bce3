"""Batched sampling with a KV cache from a Hugging Face causal LM, with exact behavior log-probs.

Pure with respect to the system: a model and token ids in, token ids, log-probs and versions out.
The log-prob recorded for each sampled token is taken from exactly the distribution it was
sampled from: softmax(logits / temperature), renormalised over the top-p nucleus when top_p < 1.
Greedy decoding (temperature 0) records log_softmax(logits).

Randomness is per sample: a sample's j-th sampled token takes the j-th uniform of its own stream,
seeded by `sample_seed(run_seed, group_id, sample_index)`, and is picked by inverse CDF, so which
other samples share its batch changes none of its draws. The stream is drawn up front, one
`torch.rand` call per sample (a generator seeded once gives the same numbers in one call as one
at a time), since a sample draws at most `max_new_tokens` (more only after an `abort` restart).

Continuous batching (`Sampler`): samples join a running batch between decode steps (prefilled
on their own, their KV cache aligned to the batch's: `kv_batch.py`) and leave it as soon as they
finish, so none waits for the slowest of its batch. A sample's tokens and log-probs depend only
on its seed and the weights; which rows share its batch changes the shapes of the matmuls and
the padding its attention skips, hence its log-probs by float rounding only (ids are equal
unless a uniform falls within rounding of a CDF boundary). `generate` is the batch-at-a-time
case: every sample starts together and finished ones stay in the batch, fed pad tokens, as
before.

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
ids, masks and positions go to the model's device; the uniforms come from CPU `torch.Generator`s
(float64) and are moved to the logits, so a sample draws the same uniforms on every device. The
per-sample record (tokens, log-probs, versions so far) is kept in CPU tensors, filled from one
copy off the device per decode step; what comes back is plain Python.

Legend: B sequences, K extra samples per position, T tokens per sample (max_new_tokens), V vocab,
W uniforms drawn per sample.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable, Sequence
from typing import Any, Literal, NamedTuple

import torch

from asyncrl.kernels.logprobs import nucleus_keep
from asyncrl.models.kv_batch import DecodeBatch, forward_parameters
from asyncrl.models.kv_batch import _cache_keyword as _cache_keyword  # re-exported for tests
from asyncrl.models.kv_batch import _cache_of as _cache_of
from asyncrl.models.kv_batch import left_pad as left_pad

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


class SampleRequest(NamedTuple):
    """One sample to draw: `key` is the caller's handle, returned with the finished sample."""

    key: Any
    prompt_ids: Sequence[int]
    seed: int  # see `sample_seed`


class FinishedSample(NamedTuple):
    key: Any
    completion_ids: list[int]  # sampled tokens, ending with eos when one was emitted
    logprobs: list[float]  # behavior log-prob of each completion token
    versions: list[int]  # policy_version that produced each completion token
    finish_reason: str  # "stop" (eos) or "length"
    extra_ids: list[list[int]] | None = None  # [T][K] with num_extra_samples = K > 0
    extra_logprobs: list[list[float]] | None = None


class Sampler:
    """A decoding batch that samples can join and leave between decode steps.

    `add` prefills new samples and merges them into the batch; `step` samples one token for
    every running sample, returns the ones that finished (eos or `max_new_tokens`), lets
    `poll_update` swap the weights (handled by `inflight`, as the module docstring says), and
    runs the decode forward that gives the next logits. With `compact` (continuous batching) a
    finished sample leaves the batch and its KV cache at once; without it, it stays in the batch
    fed pad tokens until every sample is done and `add` is refused meanwhile (the shapes
    `generate` has always fed the model, with any cache the model returns).

    Per-row state lives in CPU tensors, one row per sample, selected and stacked with the cache:
    tokens, log-probs and versions so far ([B, T], T = max_new_tokens), the sample's uniforms
    (drawn up front, one `torch.rand` per sample: [B, W], W >= T) and the column of the next one.
    """

    def __init__(
        self,
        model,
        *,
        max_new_tokens: int,
        temperature: float,
        eos_token_id: int,
        pad_token_id: int,
        top_p: float = 1.0,
        current_version: Callable[[], int] = lambda: 0,
        poll_update: Callable[[], bool] | None = None,
        inflight: InflightMode = "keep",
        num_extra_samples: int = 0,
        ignore_eos: bool = False,
        compact: bool = True,
        stop_token_ids: Sequence[int] = (),
    ) -> None:
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if inflight not in INFLIGHT_MODES:
            raise ValueError(f"inflight must be one of {', '.join(INFLIGHT_MODES)}, got {inflight!r}")
        if num_extra_samples < 0:
            raise ValueError(f"num_extra_samples must be >= 0, got {num_extra_samples}")
        self.model = model
        self.device = model_device(model)
        self._forward_params = forward_parameters(model)
        self.max_new_tokens = max_new_tokens
        self.temperature = temperature
        self.top_p = top_p
        self.eos_token_id = eos_token_id
        self.pad_token_id = pad_token_id
        self.current_version = current_version
        self.poll_update = poll_update
        self.inflight = inflight
        self.num_extra = num_extra_samples
        self.ignore_eos = ignore_eos
        self.compact = compact
        # More tokens that end a sample, as eos does (an agent's end of turn or tool-call close).
        self.stop_token_ids = frozenset(int(t) for t in stop_token_ids)
        self._stop_T = torch.tensor(sorted(self.stop_token_ids), dtype=torch.long)
        self.num_steps = 0  # decode steps taken (tokens sampled per running sample)
        self.num_weight_updates = 0
        self.num_running = 0  # samples not finished yet
        self._width = max_new_tokens  # uniforms drawn per sample (grows when `abort` restarts)
        self._batch: DecodeBatch | None = None
        self._keys: list[Any] = []
        self._prompts: list[list[int]] = []
        self._seeds: list[int] = []
        self._rows: dict[str, torch.Tensor] = {}
        self._live_B = torch.zeros(0, dtype=torch.bool)  # False: finished, kept only without compact

    def tokens_so_far(self) -> torch.Tensor:
        """[running] int64: how many tokens each running sample has (CPU)."""
        if self._batch is None:
            return torch.zeros(0, dtype=torch.long)
        return self._rows["n"][self._live_B]

    # ------------------------------------------------------------------ rows
    def _uniforms(self, seeds: Sequence[int], width: int) -> dict[str, torch.Tensor]:
        """The first `width` uniforms of every sample's stream (and K x width of its extra
        stream): seeding one generator per sample and drawing them in one call gives the same
        numbers as drawing them one at a time, so how many are drawn up front changes nothing."""
        gen = torch.Generator()
        out = {}
        if self.temperature > 0:
            u_BW = torch.empty((len(seeds), width), dtype=torch.float64)
            for i, seed in enumerate(seeds):
                torch.rand(width, generator=gen.manual_seed(seed), dtype=torch.float64, out=u_BW[i])
            out["u"] = u_BW
        if self.num_extra:
            xu_BWK = torch.empty((len(seeds), width, self.num_extra), dtype=torch.float64)
            for i, seed in enumerate(seeds):
                gen.manual_seed(extra_sample_seed(seed))
                torch.rand((width, self.num_extra), generator=gen, dtype=torch.float64, out=xu_BWK[i])
            out["xu"] = xu_BWK
        return out

    def _new_rows(self, seeds: Sequence[int], version: int) -> dict[str, torch.Tensor]:
        num, t, k = len(seeds), self.max_new_tokens, self.num_extra
        rows = {
            "n": torch.zeros(num, dtype=torch.long),  # tokens so far
            "col": torch.zeros(num, dtype=torch.long),  # the next uniform (counts aborted tokens too)
            "lv": torch.full((num,), version, dtype=torch.long),  # version of the current logits
            "ids": torch.zeros((num, t), dtype=torch.long),
            "logp": torch.zeros((num, t), dtype=torch.float32),
            "ver": torch.zeros((num, t), dtype=torch.long),
            **self._uniforms(seeds, self._width),
        }
        if k:
            rows["xids"] = torch.zeros((num, t, k), dtype=torch.long)
            rows["xlogp"] = torch.zeros((num, t, k), dtype=torch.float32)
        return rows

    @torch.no_grad()
    def add(self, requests: Sequence[SampleRequest]) -> None:
        """Prefill `requests` with the weights held now and add them to the batch."""
        if not requests:
            return
        if not self.compact and self._batch is not None:
            raise ValueError("a Sampler without compact takes new samples only once the batch is done")
        prompts = [list(r.prompt_ids) for r in requests]
        seeds = [int(r.seed) for r in requests]
        batch = DecodeBatch(self.model, prompts, self.pad_token_id, self.device, self._forward_params)
        rows = self._new_rows(seeds, self.current_version())
        if self._batch is None:
            self._batch, self._rows = batch, rows
            self._live_B = torch.ones(len(requests), dtype=torch.bool)
        else:
            self._batch.merge(batch)
            self._rows = {name: torch.cat([t, rows[name]]) for name, t in self._rows.items()}
            self._live_B = torch.cat([self._live_B, torch.ones(len(requests), dtype=torch.bool)])
        self._keys += [r.key for r in requests]
        self._prompts += prompts
        self._seeds += seeds
        self.num_running += len(requests)

    def _keep(self, keep_B: torch.Tensor) -> None:
        """Only rows `keep_B` (bool) stay, cache included."""
        if not bool(keep_B.any()):
            self._batch, self._rows, self._keys, self._prompts, self._seeds = None, {}, [], [], []
            self._live_B = torch.zeros(0, dtype=torch.bool)
            return
        idx_B = keep_B.nonzero()[:, 0]
        assert self._batch is not None
        self._batch.select(idx_B)
        self._rows = {name: t.index_select(0, idx_B) for name, t in self._rows.items()}
        self._live_B = self._live_B.index_select(0, idx_B)
        idx = idx_B.tolist()
        self._keys = [self._keys[i] for i in idx]
        self._prompts = [self._prompts[i] for i in idx]
        self._seeds = [self._seeds[i] for i in idx]

    def _finished(self, done_B: torch.Tensor) -> list[FinishedSample]:
        idx_B = done_B.nonzero()[:, 0]
        r = self._rows
        lengths = r["n"][idx_B].tolist()
        ids, logps, versions = (r[name][idx_B].tolist() for name in ("ids", "logp", "ver"))
        extra_ids = r["xids"][idx_B].tolist() if self.num_extra else None
        extra_logps = r["xlogp"][idx_B].tolist() if self.num_extra else None
        out = []
        for j, (i, n) in enumerate(zip(idx_B.tolist(), lengths, strict=True)):
            tokens = ids[j][:n]
            stop = tokens[-1] in self.stop_token_ids or (
                tokens[-1] == self.eos_token_id and not self.ignore_eos
            )
            out.append(
                FinishedSample(
                    self._keys[i],
                    tokens,
                    logps[j][:n],
                    versions[j][:n],
                    "stop" if stop else "length",
                    None if extra_ids is None else extra_ids[j][:n],
                    None if extra_logps is None else extra_logps[j][:n],
                )
            )
        return out

    # ------------------------------------------------------------------ decoding
    @torch.no_grad()
    def step(self) -> list[FinishedSample]:
        """One token for every running sample; the samples that finished with it."""
        if self.num_running == 0:
            return []
        assert self._batch is not None
        self.num_steps += 1
        r = self._rows
        logp_BV = next_token_logprobs(self._batch.logits_BV, temperature=self.temperature, top_p=self.top_p)
        rows_B = torch.arange(logp_BV.shape[0])
        if self.temperature > 0:
            # Each sample's next uniform (a finished row, still in the batch without compact,
            # may have used all of its own: it reads the last, and what it draws is dropped).
            u_B = r["u"][rows_B, r["col"].clamp(max=self._width - 1)]
            tok_B = inverse_cdf_sample(logp_BV, u_B.to(logp_BV.device))
        else:
            tok_B = logp_BV.argmax(dim=-1)
        tok_logp_B = logp_BV.gather(1, tok_B[:, None]).squeeze(1)
        live_B = self._live_B
        all_live = self.num_running == len(live_B)
        live_idx = rows_B if all_live else live_B.nonzero()[:, 0]
        pos_B = r["n"][live_idx]
        tok_cpu_B = tok_B.cpu()  # the one copy off the device per step
        r["ids"][live_idx, pos_B] = tok_cpu_B[live_idx]
        r["logp"][live_idx, pos_B] = tok_logp_B.cpu()[live_idx]
        r["ver"][live_idx, pos_B] = r["lv"][live_idx]
        if self.num_extra:
            xu_BK = r["xu"][rows_B, r["col"].clamp(max=self._width - 1)]
            extra_BK = inverse_cdf_sample_many(logp_BV, xu_BK.to(logp_BV.device))
            r["xids"][live_idx, pos_B] = extra_BK.cpu()[live_idx]
            r["xlogp"][live_idx, pos_B] = logp_BV.gather(1, extra_BK).cpu()[live_idx]
        r["n"][live_idx] += 1
        r["col"][live_idx] += 1
        done_B = r["n"] >= self.max_new_tokens
        if not self.ignore_eos:
            done_B |= tok_cpu_B == self.eos_token_id
        if self.stop_token_ids:
            done_B |= torch.isin(tok_cpu_B, self._stop_T)
        done_B &= live_B
        finished: list[FinishedSample] = []
        if bool(done_B.any()):
            finished = self._finished(done_B)
            self.num_running -= len(finished)
            if self.num_running == 0:
                self._keep(torch.zeros_like(done_B))
                return finished
            if self.compact:
                self._keep(~done_B)
                tok_B = tok_B[(~done_B).to(tok_B.device)]
            else:
                self._live_B = live_B & ~done_B
        if self.poll_update is not None and self.poll_update():
            self.num_weight_updates += 1
            if self.inflight != "keep":
                self._recompute()
                return finished
        if not self.compact:  # finished rows are fed pad tokens
            live_dev_B = self._live_B.to(tok_B.device)
            tok_B = torch.where(live_dev_B, tok_B, torch.full_like(tok_B, self.pad_token_id))
        version = self.current_version()
        self._batch.step(tok_B)
        r = self._rows
        r["lv"].fill_(version)
        return finished

    @torch.no_grad()
    def _recompute(self) -> None:
        """`retract`: the cache of prompt + tokens so far again, under the weights just loaded;
        `abort`: unfinished samples restart from their prompts (their uniforms go on)."""
        r = self._rows
        if self.inflight == "abort":
            r["n"][self._live_B] = 0
            need = int(r["col"].max()) + self.max_new_tokens
            if need > self._width:  # restarted samples may draw past the uniforms drawn so far
                self._width = max(need, 2 * self._width)
                r.update(self._uniforms(self._seeds, self._width))
        lengths = r["n"].tolist()
        ids = r["ids"].tolist()
        seqs = [p + row[:n] for p, row, n in zip(self._prompts, ids, lengths, strict=True)]
        self._batch = DecodeBatch(self.model, seqs, self.pad_token_id, self.device, self._forward_params)
        r["lv"].fill_(self.current_version())


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
    """Sample up to `max_new_tokens` per prompt, all in one batch (a `Sampler` without compact).
    The eos token, when emitted, is part of the completion's log-probs (it was sampled too) but
    not of `completion_ids`' text; its position is the last entry of `logprobs[i]` and
    `versions[i]`, and `completion_ids[i]` then ends with it. With `ignore_eos` every completion
    is `max_new_tokens` long: sampling goes on past an eos (SGLang's `ignore_eos`; `answer_ids`
    is the part a verifier reads).

    `seeds[i]` seeds row i's generator (see `sample_seed`); without `seeds`, row seeds are drawn
    from `rng` (or torch's global generator). `current_version` names the weights the model holds
    now; `poll_update` may swap them between decode steps (returns True when it did), handled by
    `inflight` as the module docstring says. `num_extra_samples` extra tokens per position are
    drawn and returned as the module docstring says.
    """
    sampler = Sampler(
        model,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        top_p=top_p,
        current_version=current_version,
        poll_update=poll_update,
        inflight=inflight,
        num_extra_samples=num_extra_samples,
        ignore_eos=ignore_eos,
        compact=False,
    )
    num_seqs = len(prompt_ids)
    if seeds is None:
        seeds = torch.randint(0, 1 << 62, (num_seqs,), generator=rng).tolist()
    if len(seeds) != num_seqs:
        raise ValueError(f"got {len(seeds)} seeds for {num_seqs} prompts; pass one per prompt")
    sampler.add([SampleRequest(i, p, s) for i, (p, s) in enumerate(zip(prompt_ids, seeds, strict=True))])
    done: list[FinishedSample | None] = [None] * num_seqs
    while sampler.num_running:
        for sample in sampler.step():
            done[sample.key] = sample
    out = [s for s in done if s is not None]
    assert len(out) == num_seqs, "every sample finishes"
    fields = (
        [s.completion_ids for s in out],
        [s.logprobs for s in out],
        [s.versions for s in out],
        [s.finish_reason for s in out],
        sampler.num_steps,
        sampler.num_weight_updates,
    )
    if not num_extra_samples:
        return SampleOutput(*fields)
    return SampleOutput(*fields, [s.extra_ids for s in out], [s.extra_logprobs for s in out])


def answer_ids(ids: Sequence[int], eos_token_id: int | None) -> list[int]:
    """The answer a verifier reads: the completion up to its first eos. Without `ignore_eos` an
    eos can only be the last token; with it, what was sampled past the eos is not the answer."""
    ids = list(ids)
    if eos_token_id is not None and eos_token_id in ids:
        return ids[: ids.index(eos_token_id)]
    return ids
