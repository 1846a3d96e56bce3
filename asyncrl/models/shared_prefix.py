"""Shared-prefix forward: rows that begin with the same tokens run those tokens once.

Place in the data flow: `PolicyLM` (the learner's forward) plans a layout for each micro-batch
with `plan_layout` and, when it pays, runs the decoder on the layout's flat tokens instead of the
right-padded [B, L] rows. A GRPO group's samples share their prompt token for token, so a
micro-batch of whole groups computes each prompt once instead of once per sample, and no
padding at all.

Why it is exact: a causal decoder's hidden state at position t depends on tokens 0..t only, so
rows equal on tokens 0..k-1 have equal hidden states there. The layout keeps, per cluster of
rows, the shared prefix once, then each row's remaining tokens (its suffix); every token keeps
its position id (rotary embeddings see the same positions); attention is the only operator that
mixes tokens, and `shared_prefix_attention` gives each suffix query exactly the keys the padded
row would have given it (its cluster's prefix, then its own suffix, causally). Gradients flow
back through the gathers, so a prefix token's gradient is the sum over the rows that share it:
the padded batch's gradient up to summation order (tests/unit/test_shared_prefix.py).

How clusters are chosen: rows are sorted lexicographically and cut into contiguous runs by
dynamic programming maximising the tokens saved, sum over runs of (rows - 1) x their common
prefix (a one-level prefix tree). Trailing padding beyond each row's length is dropped too.

Where it applies: the attention implementation is registered with Hugging Face's
`AttentionInterface` under `ATTENTION_NAME`; `enable` switches a model to it only from "sdpa"
(what the learner loads), on a causal decoder with no sliding window or attention soft-capping.
Without a layout in the call it is exactly "sdpa" (the same function and mask), so evaluation and
every other forward of the same model are unchanged.

Legend: B rows, L padded width, N flat tokens, C clusters, K longest prefix, R rows with a
suffix, S longest suffix, J = K + S keys per suffix row, H heads, E head size.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

ATTENTION_NAME = "asyncrl_shared_prefix"
# A layout replaces the padded forward when its flat tokens are at most this share of B x L
# (the gathers cost a little; a layout that saves less is not worth planning around).
MAX_FLAT_SHARE = 0.9
# ... and when its attention mask, rows x S x J, has at most this many elements: the mask is
# materialised, so long sequences keep the padded forward and its fused attention kernels.
MAX_MASK_ELEMENTS = 1 << 22
# Attention scores (rows x heads x queries x keys) at most this many per layer are computed with
# batched matmuls on the CPU, where the fused kernel's per-problem overhead dominates tiny
# problems; above it, and on GPUs (whose fused kernel keeps no scores for the backward), the
# fused kernel takes the same additive mask.
MATMUL_MAX_SCORES = 1 << 22


@dataclass(frozen=True)
class AttentionIndex:
    """A layout's gathers and masks on one device and dtype (what every layer's attention uses)."""

    prefix_at_CK: torch.Tensor | None  # flat index of each cluster's prefix token (None: no prefix)
    prefix_bias: torch.Tensor | None  # [C, 1, K, K]: causal, 0 or -inf
    prefix_real_at: torch.Tensor | None  # indices into [C x K] of real prefix tokens, flat order
    suffix_at_RS: torch.Tensor  # flat index of each row's suffix token (padding: 0)
    keys_at_RJ: torch.Tensor  # the row's cluster prefix, then its own suffix
    suffix_bias: torch.Tensor  # [R, 1, S, J]: 0 where suffix query s may attend to key j, else -inf
    suffix_real_at: torch.Tensor  # indices into [R x S] of real suffix tokens, flat order


@dataclass(frozen=True)
class PrefixLayout:
    """Where every token of a micro-batch lives in the flat sequence, and who attends to whom."""

    flat_ids_N: torch.Tensor
    positions_N: torch.Tensor
    hidden_at_BL: torch.Tensor  # flat index of the hidden state at (b, t) (padding: the row's last)
    arrays: dict  # numpy index arrays, see `on`
    _cache: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def num_tokens(self) -> int:
        return int(self.flat_ids_N.shape[0])

    def on(self, device: torch.device, dtype: torch.dtype) -> AttentionIndex:
        """The attention's index tensors on `device`, biases in `dtype` (built once per forward)."""
        key = (device, dtype)
        if key not in self._cache:
            a = self.arrays

            def long(name):
                return torch.from_numpy(np.ascontiguousarray(a[name], dtype=np.int64)).to(device)

            def bias(name):
                allowed = torch.from_numpy(np.ascontiguousarray(a[name])).to(device)
                zero = torch.zeros((), dtype=dtype, device=device)
                return torch.where(allowed, zero, torch.tensor(float("-inf"), dtype=dtype, device=device))

            has_prefix = a["prefix_at"] is not None
            self._cache[key] = AttentionIndex(
                prefix_at_CK=long("prefix_at") if has_prefix else None,
                prefix_bias=bias("prefix_allowed") if has_prefix else None,
                prefix_real_at=long("prefix_real_at") if has_prefix else None,
                suffix_at_RS=long("suffix_at"),
                keys_at_RJ=long("keys_at"),
                suffix_bias=bias("suffix_allowed"),
                suffix_real_at=long("suffix_real_at"),
            )
        return self._cache[key]


def _clusters(lcp: np.ndarray) -> list[tuple[int, int, int]]:
    """Contiguous runs [i, j) of sorted rows and their shared length, maximising the tokens
    saved: sum over runs of (j - i - 1) x min(lcp[i .. j-2]). `lcp[i]` is the common prefix of
    sorted rows i and i + 1."""
    count = len(lcp) + 1
    best = np.zeros(count + 1, dtype=np.int64)
    start = np.zeros(count + 1, dtype=np.int64)
    for j in range(1, count + 1):
        best[j], start[j] = best[j - 1], j - 1  # row j-1 alone
        if j >= 2:
            mins = np.minimum.accumulate(lcp[j - 2 :: -1])  # mins[m] = min lcp[j-2-m .. j-2]
            starts = np.arange(j - 2, -1, -1)
            values = best[starts] + (j - 1 - starts) * mins
            m = int(np.argmax(values))
            if values[m] > best[j]:
                best[j], start[j] = values[m], starts[m]
    runs = []
    j = count
    while j > 0:
        i = int(start[j])
        runs.append((i, j, int(lcp[i : j - 1].min()) if j - i >= 2 else 0))
        j = i
    return runs[::-1]


def plan_layout(ids_BL: torch.Tensor, lengths_B: torch.Tensor | None = None) -> PrefixLayout | None:
    """The flat layout of `ids_BL` (rows of `lengths_B` real tokens, right-padded; all L when
    None), or None when it would save too little to pay for itself."""
    rows, width = ids_BL.shape
    ids = ids_BL.cpu().numpy()
    lengths = np.full(rows, width) if lengths_B is None else lengths_B.cpu().numpy().astype(np.int64)
    if rows < 2 or lengths.min() < 1:
        return None
    order, runs, shared, cluster, prefix_len = _cluster_rows(ids, lengths)
    suffix_len = lengths - shared
    num_flat = int(prefix_len.sum() + suffix_len.sum())
    if num_flat > MAX_FLAT_SHARE * rows * width:
        return None

    # Flat order: every cluster's prefix, then every row's suffix (both in their own order).
    prefix_start = np.concatenate([[0], np.cumsum(prefix_len)[:-1]])
    suffix_start = prefix_len.sum() + np.concatenate([[0], np.cumsum(suffix_len)[:-1]])
    k_max, s_max = max(int(prefix_len.max()), 1), max(int(suffix_len.max()), 1)
    if rows * s_max * (k_max + s_max) > MAX_MASK_ELEMENTS:
        return None
    ar_k, ar_s = np.arange(k_max), np.arange(s_max)
    prefix_real = ar_k[None, :] < prefix_len[:, None]
    prefix_at = np.where(prefix_real, prefix_start[:, None] + ar_k[None, :], 0)
    suffix_real = ar_s[None, :] < suffix_len[:, None]
    suffix_at = np.where(suffix_real, suffix_start[:, None] + ar_s[None, :], 0)

    flat_ids = np.empty(num_flat, dtype=ids.dtype)
    positions = np.empty(num_flat, dtype=np.int64)
    first = np.array([order[i] for i, _, _ in runs])  # a row holding each cluster's prefix
    flat_ids[prefix_at[prefix_real]] = ids[first][:, :k_max][prefix_real]
    positions[prefix_at[prefix_real]] = np.broadcast_to(ar_k, prefix_real.shape)[prefix_real]
    suffix_cols = shared[:, None] + ar_s[None, :]
    flat_ids[suffix_at[suffix_real]] = np.take_along_axis(ids, np.minimum(suffix_cols, width - 1), 1)[
        suffix_real
    ]
    positions[suffix_at[suffix_real]] = suffix_cols[suffix_real]

    # Suffix query s of row r sees its cluster's prefix keys (all of them: they come before it)
    # and its own suffix keys up to s. Padding queries see at least their own slot, so no row of
    # the attention is empty (an empty row would put NaN into the backward). Rows whose tokens
    # are all in their cluster's prefix have no suffix and no row here.
    has_suffix = suffix_len > 0
    keys_at, suffix_allowed = _suffix_keys(prefix_at, prefix_real, suffix_at, cluster[has_suffix], has_suffix)
    cols = np.minimum(np.arange(width)[None, :], lengths[:, None] - 1)
    hidden_at = np.where(
        cols < shared[:, None],
        prefix_at[cluster[:, None], np.minimum(cols, k_max - 1)],
        suffix_at[np.arange(rows)[:, None], np.clip(cols - shared[:, None], 0, s_max - 1)],
    )
    with_prefix = prefix_len > 0  # the clusters whose prefix tokens attend among themselves
    arrays = {
        "prefix_at": prefix_at[with_prefix] if with_prefix.any() else None,
        "prefix_allowed": np.broadcast_to(
            ar_k[None, None, None, :] <= ar_k[None, None, :, None], (int(with_prefix.sum()), 1, k_max, k_max)
        ),
        "prefix_real_at": np.flatnonzero(prefix_real[with_prefix]),
        "suffix_at": suffix_at[has_suffix],
        "keys_at": keys_at,
        "suffix_allowed": suffix_allowed[:, None],
        "suffix_real_at": np.flatnonzero(suffix_real[has_suffix]),
    }
    as_long = lambda a: torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64))  # noqa: E731
    return PrefixLayout(
        flat_ids_N=as_long(flat_ids),
        positions_N=as_long(positions),
        hidden_at_BL=as_long(hidden_at),
        arrays=arrays,
    )


def _cluster_rows(ids, lengths):
    """Rows sorted by their tokens and cut into clusters (`_clusters`): (the sort order, each
    cluster's (first, end, prefix length) in that order, each row's shared prefix length and
    cluster, each cluster's prefix length)."""
    rows, width = ids.shape
    order = np.lexsort(ids.T[::-1])
    sorted_ids, sorted_len = ids[order], lengths[order]
    differ = sorted_ids[1:] != sorted_ids[:-1]
    lcp = np.where(differ.any(axis=1), differ.argmax(axis=1), width)
    lcp = np.minimum(lcp, np.minimum(sorted_len[1:], sorted_len[:-1]))
    runs = _clusters(lcp)
    shared = np.zeros(rows, dtype=np.int64)
    cluster = np.zeros(rows, dtype=np.int64)
    for c, (i, j, k) in enumerate(runs):
        shared[order[i:j]] = k
        cluster[order[i:j]] = c
    prefix_len = np.array([k for _, _, k in runs], dtype=np.int64)
    return order, runs, shared, cluster, prefix_len


def _suffix_keys(prefix_at, prefix_real, suffix_at, cluster_R, has_suffix):
    """For the rows with a suffix (R of them): the flat positions of the keys each sees (its
    cluster's prefix, then its own suffix) [R, K + S], and which of them each of its suffix
    queries may attend to [R, S, K + S] (the whole prefix, its own suffix up to itself)."""
    k_max, s_max = prefix_at.shape[1], suffix_at.shape[1]
    num = int(has_suffix.sum())
    keys_at = np.concatenate([prefix_at[cluster_R], suffix_at[has_suffix]], axis=1)
    ar_s = np.arange(s_max)
    allowed = np.concatenate(
        [
            np.broadcast_to(prefix_real[cluster_R][:, None, :], (num, s_max, k_max)),
            np.broadcast_to(ar_s[None, None, :] <= ar_s[None, :, None], (num, s_max, s_max)),
        ],
        axis=2,
    )
    return keys_at, allowed


def _attend(q_NHE, k_NHE, v_NHE, q_at, kv_at, bias, scaling, dropout):
    """Attention of the queries at `q_at` [rows, Q] to the keys at `kv_at` [rows, J] with an
    additive `bias` [rows, 1, Q, J] (0 or -inf) -> [rows, Q, H, E]; see MATMUL_MAX_SCORES."""
    rows, width = q_at.shape
    heads, size = q_NHE.shape[1:]
    q = q_NHE.index_select(0, q_at.reshape(-1)).view(rows, width, heads, size).transpose(1, 2)
    keys = kv_at.shape[1]
    kv_heads = k_NHE.shape[1]
    k = k_NHE.index_select(0, kv_at.reshape(-1)).view(rows, keys, kv_heads, size).transpose(1, 2)
    v = v_NHE.index_select(0, kv_at.reshape(-1)).view(rows, keys, kv_heads, size).transpose(1, 2)
    if q.is_cuda or rows * heads * width * keys > MATMUL_MAX_SCORES:
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=bias, dropout_p=dropout, scale=scaling, enable_gqa=kv_heads != heads
        )
        return out.transpose(1, 2)
    if kv_heads != heads:  # grouped-query attention: each key head serves heads / kv_heads
        k = k.repeat_interleave(heads // k.shape[1], dim=1)
        v = v.repeat_interleave(heads // v.shape[1], dim=1)
    scale = scaling if scaling is not None else size**-0.5
    wide = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype  # as "eager" does
    probs = torch.softmax(torch.matmul(q, k.transpose(-1, -2)) * scale + bias, dim=-1, dtype=wide)
    probs = F.dropout(probs.to(q.dtype), p=dropout, training=dropout > 0)
    return torch.matmul(probs, v).transpose(1, 2)


def shared_prefix_attention(
    module, query, key, value, attention_mask, *, scaling=None, dropout=0.0, **kwargs
):
    """Hugging Face attention-interface function: "sdpa" without a `shared_prefix` layout in the
    call, the layout's attention with one. query [1, H, N, E], key/value [1, Hkv, N, E]; returns
    [1, N, H, E] as every interface function does."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    layout: PrefixLayout | None = kwargs.pop("shared_prefix", None)
    if layout is None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs
        )
    q_NHE, k_NHE, v_NHE = (x[0].transpose(0, 1) for x in (query, key, value))
    dev = layout.on(q_NHE.device, q_NHE.dtype)
    parts = []
    if dev.prefix_at_CK is not None:
        out = _attend(
            q_NHE, k_NHE, v_NHE, dev.prefix_at_CK, dev.prefix_at_CK, dev.prefix_bias, scaling, dropout
        )
        parts.append(out.reshape(-1, *out.shape[2:]).index_select(0, dev.prefix_real_at))
    if dev.suffix_at_RS.shape[0]:  # (none when every row is a copy of its cluster's prefix)
        out = _attend(
            q_NHE, k_NHE, v_NHE, dev.suffix_at_RS, dev.keys_at_RJ, dev.suffix_bias, scaling, dropout
        )
        parts.append(out.reshape(-1, *out.shape[2:]).index_select(0, dev.suffix_real_at))
    return torch.cat(parts)[None], None


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    if ATTENTION_NAME not in AttentionInterface._global_mapping:
        AttentionInterface.register(ATTENTION_NAME, shared_prefix_attention)
        AttentionMaskInterface.register(ATTENTION_NAME, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])


def unsupported_reason(lm: torch.nn.Module) -> str | None:
    """Why `lm` cannot take shared-prefix layouts (None: it can)."""
    config = getattr(lm, "config", None)
    if config is None:
        return "the model has no Hugging Face config"
    impl = getattr(config, "_attn_implementation", None)
    if impl not in ("sdpa", ATTENTION_NAME):
        return f"its attention implementation is {impl!r} (only 'sdpa' is switched)"
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    sliding = "sliding_attention" in (getattr(text, "layer_types", None) or ())
    if sliding or (getattr(text, "sliding_window", None) and getattr(text, "use_sliding_window", True)):
        return "it has sliding-window attention"
    if getattr(text, "attn_logit_softcapping", None):
        return "it soft-caps attention logits"
    if not getattr(text, "is_causal", True) or getattr(text, "is_encoder_decoder", False):
        return "it is not a causal decoder"
    return None


def enable(lm: torch.nn.Module) -> bool:
    """Switch `lm` to the shared-prefix attention where it supports it; True if it did."""
    if unsupported_reason(lm) is not None:
        return False
    _register()
    lm.config._attn_implementation = ATTENTION_NAME
    return lm.config._attn_implementation == ATTENTION_NAME


def decoder_inputs(layout: PrefixLayout, device: torch.device) -> dict:
    """Keyword arguments of the decoder's forward for `layout` (the 4D placeholder mask makes
    Hugging Face's mask builder return it untouched; the attention above ignores it)."""
    return {
        "input_ids": layout.flat_ids_N.to(device)[None],
        "position_ids": layout.positions_N.to(device)[None],
        "attention_mask": torch.ones((1, 1, 1, 1), dtype=torch.bool, device=device),
        "shared_prefix": layout,
    }
