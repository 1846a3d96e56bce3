"""Micro-batches by a sequence bound and a padded-token budget (pure).

Place in the data flow: the learner's trainer splits each step's (or streaming chunk's) samples
into the micro-batches it runs one forward and backward on (`learner.micro_batch_size`,
`learner.max_tokens_per_microbatch`). Activation memory grows with the padded micro-batch, so
bounding its tokens bounds the step's peak whatever the completion lengths are.

Cost model: `pack` right-pads every row of a micro-batch to its longest row, so a micro-batch
of r rows whose longest has n = len(prompt) + len(completion) tokens costs r * n tokens.

The rule: walk the samples in order and extend the current micro-batch while it stays within
both bounds; otherwise start a new one. A sample longer than `max_tokens` on its own trains
alone (it cannot be split: the forward needs the whole sequence).

With packing (`learner.shared_prefix`, the flat layout of `models/shared_prefix.py`: no padding,
attention confined to each row), a micro-batch costs its real tokens, sum_i n_i, and `packed=True`
bounds that instead. A packed micro-batch is also cut before its flat layout's attention mask could
pass the layout's bound (rows x 2 longest^2 > `MAX_MASK_ELEMENTS`), with or without a token
bound: past it the layout runs padded, and a whole window of a few hundred rows run padded costs
several times the packed micro-batches it makes (a held-back window trained at once after a wait
did, where the same rows streamed in chunks ran packed). A row over the bound on its own still
goes alone, and then costs its padded tokens. (A layout that saves under 10% also runs padded, at
most 1/0.9 of its real tokens.)

Why in order, not sorted by length: sorting would pad less, but it would reorder the gradient
sums (a different float result from the unsplit batch), scatter a group's samples over
micro-batches and make the split depend on every other sample of the step. In order, each
micro-batch is a contiguous slice, the split is deterministic and the concatenation of the
micro-batches is the input. Among splits into contiguous slices, greedy has the fewest
micro-batches: removing rows never raises a slice's cost, so if an optimal split's k-th slice
ends at o_k and greedy's (k-1)-th ended at or after o_(k-1), greedy's k-th slice is allowed to
reach o_k and ends at or after it (induction on k).
"""

from __future__ import annotations

from collections.abc import Sequence

from asyncrl.learner.step import TrainSample
from asyncrl.models.shared_prefix import MAX_MASK_ELEMENTS


def sample_tokens(sample: TrainSample) -> int:
    """Tokens one row of a packed batch holds before padding: prompt + completion."""
    return len(sample.prompt_ids) + len(sample.completion_ids)


def packable(rows: int, longest: int) -> bool:
    """Whether the flat layout of `rows` rows, the longest `longest` tokens, is within the mask
    bound whatever their shared prefixes (`plan_layout` needs rows x s x (k + s) with the
    longest suffix s and prefix k, each at most `longest`)."""
    return rows * 2 * longest * longest <= MAX_MASK_ELEMENTS


def part_cost(rows: int, longest: int, total: int, *, packed: bool) -> int:
    """Tokens a micro-batch of `rows` rows (the longest `longest`, `total` real tokens) runs:
    padded, rows x longest; packed, its real tokens unless its layout may run padded."""
    if packed and packable(rows, longest):
        return total
    return rows * longest


def split_lengths(
    lengths: Sequence[int], *, max_seqs: int, max_tokens: int, packed: bool = False
) -> list[list[int]]:
    """Indices into `lengths`, as contiguous micro-batches of at most `max_seqs` rows and
    `max_tokens` tokens as they run (`part_cost`: padded, rows x longest; `packed`, their real
    tokens, and each within the layout's mask bound; 0 = no token bound); a row longer than
    `max_tokens` goes alone."""
    if max_seqs < 1:
        raise ValueError(f"max_seqs must be >= 1, got {max_seqs}")
    if max_tokens < 0:
        raise ValueError(f"max_tokens must be >= 0 (0 = no token bound), got {max_tokens}")
    parts: list[list[int]] = []
    current: list[int] = []
    longest = total = 0
    for index, length in enumerate(lengths):
        if length < 0:
            raise ValueError(f"sample {index} has a negative length {length}")
        grown = max(longest, length)
        cost = part_cost(len(current) + 1, grown, total + length, packed=packed)
        fits = (
            len(current) < max_seqs
            and (max_tokens == 0 or cost <= max_tokens)
            and (not packed or packable(len(current) + 1, grown))
        )
        if current and not fits:
            parts.append(current)
            current, grown, total = [], length, 0
        current.append(index)
        longest = grown
        total += length
    if current:
        parts.append(current)
    return parts


def split_microbatches(
    samples: Sequence[TrainSample], *, max_seqs: int, max_tokens: int, packed: bool = False
) -> list[list[int]]:
    """Indices into `samples`, one list per micro-batch, in input order (see the module docstring)."""
    lengths = [sample_tokens(s) for s in samples]
    return split_lengths(lengths, max_seqs=max_seqs, max_tokens=max_tokens, packed=packed)


def padded_tokens(lengths: Sequence[int], part: Sequence[int]) -> int:
    """The cost of one micro-batch: rows * the longest row's tokens."""
    return len(part) * max((lengths[i] for i in part), default=0)
