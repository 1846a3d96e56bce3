"""Update deadlines on the learner's side (asyncrl.transport.fence, publisher.AckDeadlines): past a
version's deadline the learner says which generators have not acknowledged it, and says so again
when a late ack comes."""

from __future__ import annotations

import asyncio
import logging

import pytest

from asyncrl.transport.fence import AckWatch
from asyncrl.transport.publisher import AckDeadlines


def test_a_version_is_overdue_only_for_generators_that_acked_neither_it_nor_newer() -> None:
    watch = AckWatch(["gen-1", "gen-0", "gen-2"])
    watch.published(1, now_s=10.0)
    watch.published(2, now_s=20.0)
    watch.acked("gen-0", 2)  # a newer ack covers version 1
    watch.acked("gen-1", 1)
    late = watch.overdue(1, now_s=40.0)
    assert late is not None and late.generator_ids == ("gen-2",) and late.waited_s == 30.0
    assert watch.overdue(2, now_s=40.0).generator_ids == ("gen-1", "gen-2")
    watch.acked("gen-1", 0)  # an old ack arriving late never lowers what gen-1 holds
    assert watch.waiting_for(1) == ("gen-2",)
    assert watch.acked("gen-2", 2) == 20.0  # reported late: its publish time comes back
    assert watch.overdue(1, now_s=50.0) is None
    assert watch.overdue(2, now_s=50.0).generator_ids == ("gen-1",)
    watch.acked("gen-1", 2)
    assert watch.overdue(2, now_s=60.0) is None


def test_nothing_is_overdue_when_every_ack_is_in() -> None:
    watch = AckWatch(["gen-0"])
    watch.published(3, now_s=0.0)
    assert watch.acked("gen-0", 3) is None
    assert watch.overdue(3, now_s=100.0) is None


def test_the_learner_names_the_generators_it_waits_for_past_the_deadline(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def go() -> AckDeadlines:
        deadlines = AckDeadlines(["gen-0", "gen-1"], deadline_s=3600.0)
        deadlines.published(5)
        deadlines.acked("gen-0", 5)
        deadlines._check(5)  # what the timer calls at the deadline
        deadlines.acked("gen-1", 5)
        deadlines.close()
        return deadlines

    with caplog.at_level(logging.WARNING, logger="asyncrl.transport.publisher"):
        deadlines = asyncio.run(go())
    assert deadlines.num_overdue == 1
    text = caplog.text
    assert "weights version 5: no WeightsLoaded from gen-1" in text and "gen-0," not in text
    assert "gen-1 acknowledged it" in text and "past the deadline" in text
