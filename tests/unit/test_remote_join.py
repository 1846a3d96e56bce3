"""The launcher's side of workers that join from other hosts (scheduler/remote.py), without sockets:
which slots wait, who gets them, what a Welcome carries, when a wait is too long."""

from __future__ import annotations

import asyncio
import time

import msgspec
import pytest

from asyncrl.config import Config
from asyncrl.config_load import load_config
from asyncrl.messages import Join, JoinRefused, Welcome, WorkerArgs
from asyncrl.scheduler.remote import OFFER_FRESH_S, JoinDesk, RemoteHandle


class FakeRecords:
    def __init__(self) -> None:
        self.records: list[tuple[str, dict]] = []
        self.events: list[str] = []

    def write(self, kind: str, record: dict) -> None:
        self.records.append((kind, record))

    def event(self, text: str) -> None:
        self.events.append(text)


class LocalStarts:
    def __init__(self) -> None:
        self.started: list[str] = []

    def start(self, peer_id, module, *, ctrl_address, args):
        self.started.append(peer_id)
        return object()


def _desk(tmp_path, *sets: str) -> tuple[JoinDesk, LocalStarts, Config]:
    cfg = load_config(None, ["generators.num_generators=3", "generators.remote=2", *sets])
    inner = LocalStarts()
    desk = JoinDesk(
        cfg, inner, FakeRecords(), lambda peer: peer.split("-r")[0], model_path=tmp_path, run_dir=tmp_path
    )
    return desk, inner, cfg


def _join(count: int, **kw) -> Join:
    return Join(role="generator", count=count, host="node-b", **{"pid": 42, **kw})


def test_the_last_slots_wait_for_workers_and_the_first_are_started_here(tmp_path):
    desk, inner, _ = _desk(tmp_path)
    handles = [
        desk.spawner.start(p, "m", ctrl_address="tcp://x:1", args=WorkerArgs(index=int(p[-1])))
        for p in ("gen-0", "gen-1", "gen-2")
    ]
    assert inner.started == ["gen-0"]
    assert all(isinstance(h, RemoteHandle) and not h.joined and h.exit_code() is None for h in handles[1:])


def test_a_join_takes_waiting_slots_and_a_second_is_told_the_run_is_full(tmp_path):
    desk, _, cfg = _desk(tmp_path)
    for p in ("gen-1", "gen-2"):
        desk.spawner.start(
            p, "m", ctrl_address="tcp://x:1", args=WorkerArgs(index=int(p[-1]), model="/a/model")
        )
    desk.files_address = "tcp://10.0.0.1:5"
    reply, handles = asyncio.run(desk.answer(_join(1)))
    assert isinstance(reply, Welcome) and [a.peer_id for a in reply.assignments] == ["gen-1"]
    assert reply.assignments[0].args == WorkerArgs(index=1, model="/a/model", files="tcp://10.0.0.1:5")
    assert msgspec.json.decode(reply.config_json, type=Config) == cfg  # the resolved config, whole
    assert handles[0].joined and handles[0].worker == "node-b (pid 42)"
    reply, _ = asyncio.run(desk.answer(_join(4)))
    assert [a.peer_id for a in reply.assignments] == ["gen-2"]
    reply, handles = asyncio.run(desk.answer(_join(1)))
    assert isinstance(reply, JoinRefused) and reply.full and not handles
    # What a waiting worker pre-fetches meanwhile: the run's initial model, where the Welcome names it.
    assert reply.run_name == cfg.run.name and reply.files_endpoint == "tcp://10.0.0.1:5"


@pytest.mark.parametrize(
    "join, why",
    [(_join(1, protocol_version=1), "protocol version"), (_join(0), "cannot serve")],
)
def test_a_bad_join_is_refused_for_good(tmp_path, join, why):
    desk, _, _ = _desk(tmp_path)
    desk.spawner.start("gen-1", "m", ctrl_address="tcp://x:1", args=WorkerArgs())
    reply, handles = asyncio.run(desk.answer(join))
    assert isinstance(reply, JoinRefused) and why in reply.reason and not reply.full and not handles
    assert len(desk.spawner.waiting) == 1  # the slot still waits


def test_a_slot_that_waits_too_long_fails_the_run_naming_the_command(tmp_path):
    desk, _, _ = _desk(tmp_path, "generators.remote_join_timeout_s=30")
    desk.ctrl_address = "tcp://10.0.0.1:7"
    h = desk.spawner.start("gen-1", "m", ctrl_address="tcp://x:1", args=WorkerArgs())
    assert desk.tick() is None
    h.waiting_since = time.monotonic() - 31
    reason = desk.tick()
    assert "gen-1 waited 30 s" in reason and "asyncrl worker --join tcp://10.0.0.1:7 --count 1" in reason
    h.kill()  # given up (the run stops anyway): no longer waiting
    assert desk.tick() is None


def test_a_given_up_remote_handle_is_gone_and_is_told_to_stop_once_joined():
    told: list[str] = []
    h = RemoteHandle("gen-1", WorkerArgs(), told.append)
    h.kill()
    assert h.exit_code() == 0 and told == []  # never joined: nobody to tell
    h = RemoteHandle("gen-1-r1", WorkerArgs(), told.append)
    h.worker = "node-b (pid 1)"
    h.kill()
    h.kill()
    assert told == ["gen-1-r1"] and asyncio.run(h.wait()) == 0


def test_remote_generators_config_is_checked():
    with pytest.raises(ValueError, match="more than generators.num_generators"):
        load_config(None, ["generators.remote=2"])
    with pytest.raises(ValueError, match="broadcast"):
        load_config(None, ["generators.remote=1", "weights.transport=broadcast"])


class _Child:
    spawned = 0.0


def test_a_worker_refused_because_every_slot_is_served_waits_and_gets_the_first_that_frees(tmp_path):
    """Issue #36: a replacement started before the loss was noticed was refused thirty times and
    gave up, so nobody took the slot when it freed. Now it waits and is offered the slot at once."""
    desk, _, _ = _desk(tmp_path)
    children = {p: _Child() for p in ("gen-1", "gen-2", "gen-1-r1")}
    for p in ("gen-1", "gen-2"):
        desk.spawner.start(p, "m", ctrl_address="tcp://x:1", args=WorkerArgs(index=int(p[-1])))
    assert isinstance(asyncio.run(desk.on_join(_join(2), children, "w1")), Welcome)
    assert asyncio.run(desk.on_join(_join(2), children, "w1")) is None  # asked again meanwhile: stale
    early = asyncio.run(desk.on_join(_join(1, pid=7), children, "w2"))
    assert isinstance(early, JoinRefused) and early.full
    later = asyncio.run(desk.on_join(_join(1, pid=8), children, "w3"))
    assert list(desk.waiting_workers) == ["w2", "w3"]
    asyncio.run(desk.on_join(_join(1, pid=7), children, "w2"))  # asking again keeps its place
    assert list(desk.waiting_workers) == ["w2", "w3"] and later.full
    assert asyncio.run(desk.offers(children)) == []  # nothing free yet
    # gen-1 is lost; its replacement's slot waits for a worker: the oldest waiter gets it, unasked.
    desk.spawner.start("gen-1-r1", "m", ctrl_address="tcp://x:1", args=WorkerArgs(index=1))
    ((identity, welcome, handles),) = asyncio.run(desk.offers(children))
    assert identity == "w2" and [a.peer_id for a in welcome.assignments] == ["gen-1-r1"]
    assert list(desk.waiting_workers) == ["w3"] and not desk.spawner.waiting
    # The Welcome could not be delivered (w2 died while it waited): the slot goes to the next one.
    desk.undelivered(identity, handles)
    ((identity, welcome, _),) = asyncio.run(desk.offers(children))
    assert identity == "w3" and [a.peer_id for a in welcome.assignments] == ["gen-1-r1"]
    assert desk.num_joins == 2  # w1 and w3
    joined = [r for kind, r in desk.records.records if kind == "join" and r["slots"]]
    assert [(r["pid"], r["slots"]) for r in joined] == [
        (42, ["gen-1", "gen-2"]),
        (7, ["gen-1-r1"]),
        (8, ["gen-1-r1"]),
    ]


def test_a_waiting_worker_not_heard_from_is_forgotten_and_the_rest_are_told_the_run_ended(tmp_path):
    desk, _, _ = _desk(tmp_path)
    asyncio.run(desk.on_join(_join(1), {}, "w1"))
    asyncio.run(desk.on_join(_join(1), {}, "w2"))
    desk.waiting_workers["w1"].last_seen -= 60
    desk.tick()
    assert list(desk.waiting_workers) == ["w2"]
    assert desk.ended() == ["w2"] and not desk.waiting_workers


def test_a_freed_slot_skips_a_waiting_worker_gone_quiet_and_goes_to_one_that_asks(tmp_path):
    """A Welcome sent to a waiting worker that died (it stopped asking) held the slot until the
    start-up bound. A freed slot is offered only to waiters heard from lately; a quiet one still
    gets a slot when it asks again."""
    desk, _, _ = _desk(tmp_path)
    children = {p: _Child() for p in ("gen-1", "gen-1-r1")}
    desk.spawner.start("gen-1", "m", ctrl_address="tcp://x:1", args=WorkerArgs(index=1))
    asyncio.run(desk.on_join(_join(1), children, "w1"))  # serves gen-1
    asyncio.run(desk.on_join(_join(1, pid=7), children, "quiet"))
    asyncio.run(desk.on_join(_join(1, pid=8), children, "fresh"))
    desk.waiting_workers["quiet"].last_seen -= OFFER_FRESH_S + 1
    desk.spawner.start("gen-1-r1", "m", ctrl_address="tcp://x:1", args=WorkerArgs(index=1))
    ((identity, welcome, _),) = asyncio.run(desk.offers(children))
    assert identity == "fresh" and [a.peer_id for a in welcome.assignments] == ["gen-1-r1"]
    assert list(desk.waiting_workers) == ["quiet"]  # still waiting: it is forgotten only when stale
    desk.spawner.start("gen-2-r1", "m", ctrl_address="tcp://x:1", args=WorkerArgs(index=2))
    children["gen-2-r1"] = _Child()
    assert asyncio.run(desk.offers(children)) == []  # not offered while quiet...
    reply = asyncio.run(desk.on_join(_join(1, pid=7), children, "quiet"))  # ...but it asks again
    assert isinstance(reply, Welcome) and [a.peer_id for a in reply.assignments] == ["gen-2-r1"]
