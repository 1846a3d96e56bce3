"""The KV-cached decode state of a batch of sequences whose rows can leave and join.

Place in the data flow: `sampling.py` feeds a Hugging Face causal LM through this state (prefill,
then one token per row per decode step) and reads each row's next-token logits from it. Pure with
respect to the system: a model, token ids and row indices in, logits out.

Layout: rows are left-padded, so the last column holds every row's newest position; `attn_BL`
masks the padding and `next_pos_B` holds each row's next position id. Positions count real
tokens only, so padding never shifts a row's rotary phase.

Rows leave (`select`): the cache keeps the chosen rows, and leading columns that are padding in
every row left are dropped, so the cache is never longer than its longest row. Rows join
(`merge`): they are prefilled on their own, then the shorter cache is left-padded with zeros
under a 0 mask to the other's length and the two are stacked. A masked key gets exactly zero
attention weight, so padding changes no value a row attends to; what it can change is float
rounding (a reduction over more columns, a matmul of another shape), so a row decoded next to
other rows equals the same row decoded alone up to float tolerance, not bit for bit.

Caches: `select` and `merge` need a dynamic full-attention cache (Hugging Face `DynamicCache`:
`layers[i].keys/values` in transformers >= 4.56, `key_cache`/`value_cache` lists before). Other
caches (sliding-window layers, recurrent state) raise ValueError there; prefill and decode steps
work with any cache the model returns.

Legend: B rows, L cache columns, V vocab; cache tensors are [B, heads, L, head_dim].
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence

import torch
import torch.nn.functional as F

UNSUPPORTED_CACHE = (
    "rows can leave or join a decoding batch only with a dynamic full-attention KV cache "
    "(transformers DynamicCache without sliding-window layers); this model's cache is {kind}: "
    "set generators.batching = 'batch'"
)


def left_pad(prompt_ids: Sequence[Sequence[int]], pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids_BL, attn_BL) int64: every sequence right-aligned, padding (and a 0 mask) before it.
    One tensor is built from one flat list: a tensor per row costs more than the whole prefill
    of a short prompt batch."""
    lengths = [len(p) for p in prompt_ids]
    if 0 in lengths:
        i = lengths.index(0)
        raise ValueError(f"prompt {i} is empty: every prompt needs at least one token (e.g. <bos>)")
    width = max(lengths)
    flat: list[int] = []
    for p, n in zip(prompt_ids, lengths, strict=True):
        flat += [pad_token_id] * (width - n)
        flat += p
    ids = torch.tensor(flat, dtype=torch.long).view(len(lengths), width)
    attn = torch.arange(width) >= torch.tensor([width - n for n in lengths])[:, None]
    return ids, attn.to(torch.long)


def forward_parameters(model) -> frozenset[str]:
    """The argument names of `model.forward` (look them up once per model: a signature costs
    more than a small decode step)."""
    return frozenset(inspect.signature(model.forward).parameters)


def _cache_keyword(model, params: frozenset[str] | None = None) -> str:
    """transformers >= 5.x names the KV cache argument `cache`; 4.x calls it `past_key_values`."""
    return "cache" if "cache" in (params or forward_parameters(model)) else "past_key_values"


def _last_logits_only(model, device: torch.device, params: frozenset[str] | None = None) -> dict:
    """The prefill needs the logits of the last position only; off the CPU, where [B, L, V] logits
    of a long prompt batch would not fit, ask for those alone (`logits_to_keep`, transformers >=
    4.50). On the CPU every position's are kept: a [B, D] @ [D, V] product can differ in the last
    bit from the last rows of a [B * L, D] one, and CPU runs stay bit-for-bit what they were."""
    if device.type == "cpu" or "logits_to_keep" not in (params or forward_parameters(model)):
        return {}
    return {"logits_to_keep": 1}


def _cache_of(out):
    cache = getattr(out, "cache", None)
    return cache if cache is not None else out.past_key_values


def _kv_layers(cache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(keys, values) of every layer, [B, heads, L, head_dim] each; ValueError for other caches."""
    layers = getattr(cache, "layers", None)
    if layers is not None:
        if any(getattr(layer, "is_sliding", False) or not hasattr(layer, "keys") for layer in layers):
            raise ValueError(UNSUPPORTED_CACHE.format(kind=type(cache).__name__ + " with non-dynamic layers"))
        return [(layer.keys, layer.values) for layer in layers]
    if hasattr(cache, "key_cache") and hasattr(cache, "value_cache"):
        return list(zip(cache.key_cache, cache.value_cache, strict=True))
    raise ValueError(UNSUPPORTED_CACHE.format(kind=type(cache).__name__))


def _set_kv_layers(cache, kvs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
    layers = getattr(cache, "layers", None)
    if layers is not None:
        for layer, (keys, values) in zip(layers, kvs, strict=True):
            layer.keys, layer.values = keys, values
        return
    cache.key_cache = [k for k, _ in kvs]
    cache.value_cache = [v for _, v in kvs]
    if hasattr(cache, "_seen_tokens") and kvs:  # transformers < 4.56 counts positions here too
        cache._seen_tokens = kvs[0][0].shape[-2]


def _pad_left(t: torch.Tensor, num: int, dim_from_end: int) -> torch.Tensor:
    """`t` with `num` zeros before its data along the dimension `dim_from_end` from the end."""
    if num == 0:
        return t
    return F.pad(t, (0, 0) * (dim_from_end - 1) + (num, 0))


class DecodeBatch:
    """A batch's KV cache, attention mask, next positions and last logits, on `device` (the
    model's). Built by prefilling `seqs` (each at least one token); `params` are the model's
    `forward_parameters` when the caller has them. Equal sequences (a group's samples share
    their prompt) are prefilled once and their rows copied from it."""

    def __init__(
        self,
        model,
        seqs: Sequence[Sequence[int]],
        pad_token_id: int,
        device: torch.device,
        params: frozenset[str] | None = None,
    ) -> None:
        params = params or forward_parameters(model)
        self.model = model
        self.pad_token_id = pad_token_id
        self.device = device
        self.cache_kw = _cache_keyword(model, params)
        first: dict[tuple[int, ...], int] = {}
        rows = [first.setdefault(tuple(s), len(first)) for s in seqs]
        ids_BL, attn_BL = left_pad(list(first) if len(first) < len(rows) else seqs, pad_token_id)
        ids_BL, self.attn_BL = ids_BL.to(device), attn_BL.to(device)
        pos_BL = (self.attn_BL.cumsum(dim=1) - 1).clamp(min=0)
        out = model(
            input_ids=ids_BL,
            attention_mask=self.attn_BL,
            position_ids=pos_BL,
            use_cache=True,
            **_last_logits_only(model, device, params),
        )
        self.cache = _cache_of(out)
        self.logits_BV = out.logits[:, -1]
        self.next_pos_B = pos_BL[:, -1] + 1
        if len(first) < len(rows):
            self.select(torch.tensor(rows, dtype=torch.long))

    def step(self, tok_B: torch.Tensor) -> None:
        """Feed one token per row; the logits become those of the next position."""
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

    def select(self, rows_B: torch.Tensor) -> None:
        """Keep rows `rows_B` (indices, in the order given; at least one) and drop the leading
        columns that are padding in all of them."""
        idx_B = rows_B.to(self.device)
        kvs = [(k.index_select(0, idx_B), v.index_select(0, idx_B)) for k, v in _kv_layers(self.cache)]
        attn_BL = self.attn_BL.index_select(0, idx_B)
        # Leading columns with no real token in any row left: the cumulative product of "column
        # is empty" stays 1 exactly over them.
        lead = int((attn_BL.sum(dim=0) == 0).to(torch.int32).cumprod(dim=0).sum())
        if lead:
            attn_BL = attn_BL[:, lead:]
            kvs = [(k[..., lead:, :], v[..., lead:, :]) for k, v in kvs]
        _set_kv_layers(self.cache, kvs)
        self.attn_BL = attn_BL
        self.next_pos_B = self.next_pos_B.index_select(0, idx_B)
        self.logits_BV = self.logits_BV.index_select(0, idx_B)

    def merge(self, other: DecodeBatch) -> None:
        """Append `other`'s rows after these, both caches left-padded to the longer one."""
        len_a, len_b = self.attn_BL.shape[1], other.attn_BL.shape[1]
        width = max(len_a, len_b)
        kvs = [
            (
                torch.cat([_pad_left(ka, width - len_a, 2), _pad_left(kb, width - len_b, 2)]),
                torch.cat([_pad_left(va, width - len_a, 2), _pad_left(vb, width - len_b, 2)]),
            )
            for (ka, va), (kb, vb) in zip(_kv_layers(self.cache), _kv_layers(other.cache), strict=True)
        ]
        _set_kv_layers(self.cache, kvs)
        self.attn_BL = torch.cat(
            [_pad_left(self.attn_BL, width - len_a, 1), _pad_left(other.attn_BL, width - len_b, 1)]
        )
        self.next_pos_B = torch.cat([self.next_pos_B, other.next_pos_B])
        self.logits_BV = torch.cat([self.logits_BV, other.logits_BV.to(self.logits_BV.dtype)])
