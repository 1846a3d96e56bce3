"""Micro-batches by sequences and padded tokens: hand-computed splits and properties over random
lengths (every index once, in order, within both bounds, fewest contiguous micro-batches)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncrl.learner.microbatch import padded_tokens, part_cost, split_lengths, split_microbatches
from asyncrl.learner.step import TrainSample
from asyncrl.models.shared_prefix import MAX_MASK_ELEMENTS


def make_sample(prompt_len: int, completion_len: int, traj_id: int = 0) -> TrainSample:
    return TrainSample(
        traj_id=traj_id,
        group_id=0,
        sample_index=traj_id,
        prompt_ids=list(range(prompt_len)),
        completion_ids=torch.zeros(completion_len, dtype=torch.int64),
        behavior_logprobs=torch.zeros(completion_len),
        token_versions=torch.zeros(completion_len, dtype=torch.int64),
        reward=0.0,
    )


def test_hand_computed_split_counts_prompt_and_completion_padded_to_the_longest():
    # Rows of 3+2=5, 1+1=2, 4+4=8, 2+1=3 tokens; budget 16: [5, 2] costs 2*5=10, adding 8 would
    # cost 3*8=24; [8] then [8, 3] costs 2*8=16 (fits exactly).
    samples = [make_sample(3, 2), make_sample(1, 1), make_sample(4, 4), make_sample(2, 1)]
    assert split_microbatches(samples, max_seqs=8, max_tokens=16) == [[0, 1], [2, 3]]
    assert split_microbatches(samples, max_seqs=8, max_tokens=15) == [[0, 1], [2], [3]]
    assert split_microbatches(samples, max_seqs=3, max_tokens=0) == [[0, 1, 2], [3]]
    assert split_microbatches(samples, max_seqs=1, max_tokens=100) == [[0], [1], [2], [3]]


def test_no_token_bound_splits_by_sequences_only():
    assert split_lengths([100, 1, 7, 3, 9], max_seqs=2, max_tokens=0) == [[0, 1], [2, 3], [4]]


def test_a_row_over_the_budget_trains_alone():
    assert split_lengths([2, 2, 50, 2, 2], max_seqs=8, max_tokens=10) == [[0, 1], [2], [3, 4]]
    assert split_lengths([50], max_seqs=8, max_tokens=10) == [[0]]
    assert split_lengths([50, 60], max_seqs=8, max_tokens=10) == [[0], [1]]


def test_empty_input_and_bad_bounds():
    assert split_microbatches([], max_seqs=4, max_tokens=16) == []
    with pytest.raises(ValueError, match="max_seqs"):
        split_lengths([1], max_seqs=0, max_tokens=0)
    with pytest.raises(ValueError, match="max_tokens"):
        split_lengths([1], max_seqs=1, max_tokens=-1)


def _fewest_contiguous(lengths: list[int], max_seqs: int, max_tokens: int) -> int:
    """The fewest micro-batches of any split into contiguous slices (dynamic programming)."""
    inf = len(lengths) + 1
    best = [0] + [inf] * len(lengths)
    for end in range(1, len(lengths) + 1):
        for start in range(end - 1, -1, -1):
            rows = end - start
            cost = rows * max(lengths[start:end])
            alone = rows == 1
            if rows > max_seqs or (max_tokens and cost > max_tokens and not alone):
                break  # longer slices ending here cost more
            best[end] = min(best[end], best[start] + 1)
    return best[-1]


@settings(max_examples=300, deadline=None)
@given(
    lengths=st.lists(st.integers(min_value=1, max_value=40), max_size=30),
    max_seqs=st.integers(min_value=1, max_value=8),
    max_tokens=st.one_of(st.just(0), st.integers(min_value=1, max_value=120)),
)
def test_split_properties(lengths, max_seqs, max_tokens):
    parts = split_lengths(lengths, max_seqs=max_seqs, max_tokens=max_tokens)
    # Every index exactly once, in input order, each micro-batch non-empty.
    assert [i for part in parts for i in part] == list(range(len(lengths)))
    assert all(parts)
    for part in parts:
        assert len(part) <= max_seqs
        within = max_tokens == 0 or padded_tokens(lengths, part) <= max_tokens
        assert within or (len(part) == 1 and lengths[part[0]] > max_tokens)
    # Deterministic, and no contiguous split has fewer micro-batches.
    assert split_lengths(lengths, max_seqs=max_seqs, max_tokens=max_tokens) == parts
    assert len(parts) == _fewest_contiguous(lengths, max_seqs, max_tokens)


@settings(max_examples=50, deadline=None)
@given(shapes=st.lists(st.tuples(st.integers(0, 12), st.integers(1, 12)), max_size=12))
def test_samples_cost_prompt_plus_completion(shapes):
    samples = [make_sample(p, c, traj_id=i) for i, (p, c) in enumerate(shapes)]
    lengths = [p + c for p, c in shapes]
    assert split_microbatches(samples, max_seqs=3, max_tokens=30) == split_lengths(
        lengths, max_seqs=3, max_tokens=30
    )


def test_packed_micro_batches_are_bounded_by_real_tokens():
    """Packing: a micro-batch costs its real tokens (no row pads to the longest), so a long
    row shares its micro-batch with short ones up to the bound, which padded splits cannot do."""
    lengths = [100, 4, 4, 4, 4, 30, 30]
    assert split_lengths(lengths, max_seqs=8, max_tokens=120) == [[0], [1, 2, 3, 4], [5, 6]]
    packed = split_lengths(lengths, max_seqs=8, max_tokens=120, packed=True)
    assert packed == [[0, 1, 2, 3, 4], [5, 6]]
    assert all(sum(lengths[i] for i in p) <= 120 for p in packed)
    assert split_lengths(lengths, max_seqs=2, max_tokens=120, packed=True) == [[0, 1], [2, 3], [4, 5], [6]]


def test_packed_micro_batches_stay_within_the_layout_bound_without_a_token_bound():
    """Issue #36: a held-back window trained at once (256 rows, no token bound) was one
    micro-batch whose flat layout passed the mask bound, so it ran padded, several times the cost
    of the packed chunks the same rows made when streamed. Packed micro-batches are now cut where
    the layout would stop packing; unpacked ones still split by sequences only."""
    longest = 100
    rows_fit = MAX_MASK_ELEMENTS // (2 * longest * longest)  # the most rows of this length that pack
    lengths = [longest] * (2 * rows_fit + 3)
    packed = split_lengths(lengths, max_seqs=10_000, max_tokens=0, packed=True)
    assert [len(p) for p in packed] == [rows_fit, rows_fit, 3]
    assert all(part_cost(len(p), longest, longest * len(p), packed=True) == longest * len(p) for p in packed)
    assert split_lengths(lengths, max_seqs=10_000, max_tokens=0) == [list(range(len(lengths)))]
    # A row over the bound on its own still trains, alone.
    huge = int((MAX_MASK_ELEMENTS / 2) ** 0.5) + 1
    assert split_lengths([10, huge, 10], max_seqs=8, max_tokens=0, packed=True) == [[0], [1], [2]]


def test_packed_bound_keeps_the_padded_cost_where_the_layout_may_run_padded():
    """Rows so long that the flat layout's attention mask could pass its bound run padded:
    those micro-batches are bounded by rows x longest, as without packing."""
    long = 1500  # 2 rows: 2 x 2 x 1500^2 > MAX_MASK_ELEMENTS
    assert part_cost(2, long, long + 10, packed=True) == 2 * long
    assert part_cost(2, 40, 50, packed=True) == 50
    assert split_lengths([long, 10], max_seqs=8, max_tokens=long + 10, packed=True) == [[0], [1]]
    assert split_lengths([100, 10], max_seqs=8, max_tokens=110, packed=True) == [[0, 1]]


def test_the_engine_packs_micro_batches_unless_asked_for_padded_ones(tiny_model_dir):
    """The trainer's engine bounds real tokens with `learner.shared_prefix`, padded tokens
    without it and for forwards on padded rows (`padded=True`: the optimal baseline's norms),
    whatever the step's other forwards do."""
    from tests.unit.test_trainer import _model, _trainer

    model = _model(tiny_model_dir)
    engine = _trainer(model, "learner.streaming=off").engine
    assert engine.packed_microbatches
    engine.actor.share_prefixes = False  # what learner.shared_prefix = false builds
    assert not engine.packed_microbatches
    opob = _trainer(model, "staleness.policy=vcpo", "staleness.vcpo_baseline=opob").engine
    assert opob.packed_microbatches
    opob.max_tokens_per_microbatch = 16  # the hand-computed case above: padded [[0, 1], [2, 3]]
    samples = [make_sample(3, 2), make_sample(1, 1), make_sample(4, 4), make_sample(2, 1)]
    assert opob.microbatches(samples, padded=True) == [[0, 1], [2, 3]]
    assert opob.microbatches(samples) == [[0, 1, 2], [3]]  # 15 real tokens, then 3
