"""The learner's pure choices from measurement: its core share (learner.threads = "auto") and
streaming chunks or whole windows (learner.min_chunk = "auto"), on hand-computed sequences."""

from __future__ import annotations

import pytest

from asyncrl.learner.chunking import (
    MARGIN,
    REVISIT_STEPS,
    TRIAL_STEPS,
    WARMUP_STEPS,
    ChunkChoice,
    fixed_min_chunk,
)
from asyncrl.learner.cores import GROW_IDLE, SHRINK_IDLE, CoreShare, resolve_threads


def test_core_share_gives_back_a_thread_when_idle_and_takes_it_back_when_bound():
    share = CoreShare(3)
    assert share.observe(0.0, 1.0) == 3  # bound: already at the most
    # Idle half the time: smoothed 0.3 * 0.5 + 0.7 * 0 = 0.15 > SHRINK_IDLE -> one back.
    assert share.observe(0.5, 0.5) == 2
    assert share.idle_ratio == pytest.approx((SHRINK_IDLE + GROW_IDLE) / 2)
    # 0.3 * 0.2 + 0.7 * 0.06 = 0.102 > 0.10 -> another back; never below one.
    assert share.observe(0.2, 0.8) == 1
    assert share.observe(1.0, 0.0) == 1  # smoothed 0.3 + 0.7 * 0.06 = 0.342
    # Never idle: 0.342 * 0.7^k drops below GROW_IDLE at k = 8 (0.0282 at k = 7, 0.0197 at 8).
    assert [share.observe(0.0, 1.0) for _ in range(8)] == [1] * 7 + [2]
    assert share.observe(0.0, 0.0) == 2  # nothing measured: unchanged
    with pytest.raises(ValueError, match="at least one thread"):
        CoreShare(0)
    assert resolve_threads(3) == 3
    assert resolve_threads("auto", cpus=[0, 1, 2, 3], world_size=2) == 2
    assert resolve_threads("auto", cpus=[5], world_size=4) == 1


def _trial(choice: ChunkChoice, stream_s: float, whole_s: float) -> tuple[list[int], str | None]:
    """Run one trial: the min_chunk of each of its steps, and the decision at its end."""
    chunks, said = [], None
    for k in range(2 * TRIAL_STEPS):
        chunks.append(choice.min_chunk())
        said = choice.observe(stream_s if k % 2 == 0 else whole_s)
        if k < 2 * TRIAL_STEPS - 1:
            assert said is None
    return chunks, said


def test_chunk_choice_tries_both_ways_then_keeps_the_faster():
    choice = ChunkChoice(256)
    for _ in range(WARMUP_STEPS):  # warm-up steps stream and decide nothing
        assert choice.min_chunk() == 64
        assert choice.observe(9.0) is None
    chunks, said = _trial(choice, stream_s=0.120, whole_s=0.110)
    assert chunks == [64, 256] * TRIAL_STEPS  # alternating, streaming first
    assert choice.way == "whole" and "whole windows of 256" in said and "0.120" in said and "0.110" in said
    for _ in range(REVISIT_STEPS):  # kept until the next trial
        assert choice.min_chunk() == 256
        assert choice.observe(5.0) is None
    # Within the margin streaming keeps the step (whole must be > MARGIN faster).
    _, said = _trial(choice, stream_s=0.100, whole_s=0.100 * (1 - MARGIN / 2))
    assert choice.way == "stream" and "streaming in chunks of 64" in said
    assert choice.min_chunk() == 64


def test_chunk_choice_uses_medians_and_small_windows():
    choice = ChunkChoice(32)  # a window smaller than a chunk: the chunk is the window
    assert choice.chunk == 32
    choice = ChunkChoice(256)
    for _ in range(WARMUP_STEPS):
        choice.observe(1.0)
    # One slow outlier in the streaming trials does not decide it: medians 0.10 vs 0.11.
    times = [0.10, 0.11, 5.0, 0.11, 0.10, 0.11][: 2 * TRIAL_STEPS]
    for t in times:
        said = choice.observe(t)
    assert choice.way == "stream", said
    assert fixed_min_chunk("auto") == 64 and fixed_min_chunk(8) == 8
