"""Connection-level failure detection (scheduler/liveness.py, issue #36): which peers lost their
connection, from the socket monitor's events, each message's source connection and failed sends."""

from __future__ import annotations

from asyncrl.scheduler.connections import keepalive_options
from asyncrl.scheduler.liveness import Liveness


def test_a_peer_whose_connection_closed_is_lost_after_the_grace_and_not_before():
    live = Liveness()
    live.accepted(15, 0.0)
    live.heard("gen-0", 15, 1.0)
    live.accepted(16, 0.0)
    live.heard("gen-1", 16, 1.0)
    assert live.disconnected(15, 10.0) == "gen-0"
    assert live.lost(11.0, 1.5) == []
    assert live.lost(11.5, 1.5) == [("gen-0", 10.0)]  # gen-1 never lost its connection
    live.forget("gen-0")
    assert live.lost(20.0, 1.5) == []


def test_a_message_the_dead_connection_delivered_late_does_not_revive_it():
    live = Liveness()
    live.accepted(15, 0.0)
    live.heard("gen-0", 15, 1.0)
    live.disconnected(15, 10.0)
    live.heard("gen-0", 15, 10.1)  # read after the monitor's event, sent before the close
    assert live.lost(12.0, 1.5) == [("gen-0", 10.0)]


def test_a_peer_that_reconnects_and_speaks_on_the_new_connection_is_not_lost():
    live = Liveness()
    live.accepted(15, 0.0)
    live.heard("gen-0", 15, 1.0)
    live.disconnected(15, 10.0)
    live.accepted(15, 10.2)  # the same descriptor number, a new connection
    live.heard("gen-0", 15, 10.9)
    assert live.lost(20.0, 1.5) == []


def test_a_failed_send_is_evidence_and_unknown_descriptors_are_ignored():
    live = Liveness()
    assert live.disconnected(99, 1.0) is None  # a connection nobody spoke on (a file request, say)
    live.heard("gen-0", -1, 1.0)  # libzmq gave no descriptor: nothing recorded
    assert live.by_fd == {}
    live.unreachable("gen-0", 5.0)
    live.unreachable("gen-0", 6.0)  # the first evidence counts
    assert live.lost(6.5, 1.5) == [("gen-0", 5.0)]


def test_keepalive_closes_a_silent_connection_within_the_timeout():
    import zmq

    opts = keepalive_options(3.0)
    assert opts[zmq.HEARTBEAT_TIMEOUT] == 3000 and opts[zmq.HEARTBEAT_IVL] == 1000
    assert opts[zmq.TCP_KEEPALIVE_IDLE] + opts[zmq.TCP_KEEPALIVE_INTVL] * opts[zmq.TCP_KEEPALIVE_CNT] <= 3
