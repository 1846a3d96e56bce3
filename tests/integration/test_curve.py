"""ZeroMQ CURVE on real sockets (on 127.0.0.1 with CURVE forced on, so no namespaces needed): a peer
without the run's key is refused and counted, a role cannot send what its key does not allow,
garbage from an authenticated peer is rejected and counted, and a frame past the size cap is
dropped before the receiver buffers it."""

from __future__ import annotations

import asyncio
import contextlib
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import zmq

from asyncrl.messages import Heartbeat, Hello, ShardsPublished, StepDone, Trajectories
from asyncrl.transport import security, zap
from asyncrl.transport.codec import encode
from asyncrl.transport.zmq_io import Endpoint
from tests.integration.test_fuzz import NUM_MESSAGES, any_step_done, malformed_messages

TIMEOUT_S = 20.0


@pytest.fixture
def keys(tmp_path) -> Path:
    security.write_keys(tmp_path / "keys")
    return tmp_path / "keys"


def _policy(keys_dir: Path, role: str, **kw) -> security.SocketPolicy:
    return security.SocketPolicy(role=role, curve=security.CurveKeys.load(keys_dir, role=role), **kw)


def _client_event(sock: zmq.Socket, wanted: int) -> zmq.Socket:
    """A monitor on a client socket (before it connects), waited on with `_await_event`."""
    url = f"inproc://test.monitor.{id(sock)}"
    sock.monitor(url, wanted)
    mon = sock.context.socket(zmq.PAIR)
    mon.connect(url)
    return mon


def _await_event(mon: zmq.Socket) -> None:
    assert mon.poll(int(TIMEOUT_S * 1000)), "no monitor event"
    mon.recv_multipart()
    mon.close(linger=0)


@pytest.fixture
def contexts():
    """A server's and a client's ZeroMQ context, destroyed after the test (linger 0)."""
    server_ctx, client_ctx = zmq.Context(), zmq.Context()
    yield server_ctx, client_ctx
    client_ctx.destroy(linger=0)
    server_ctx.destroy(linger=0)


@pytest.mark.timeout(60)
def test_a_peer_with_a_wrong_or_missing_key_is_refused_counted_and_changes_nothing(keys, tmp_path, contexts):
    security.write_keys(tmp_path / "other")  # another run's keys
    run = security.CurveKeys.load(keys, role="generator")
    public, secret = zmq.curve_keypair()
    unknown_key = security.SocketPolicy(
        role="generator", curve=security.CurveKeys(run.server_public, None, public, secret)
    )
    other_run = _policy(tmp_path / "other", "generator")  # and so another server key
    server_ctx, client_ctx = contexts

    async def scenario() -> None:
        router = Endpoint(
            server_ctx, zmq.ROUTER, name="launcher.ctrl", accept=None, policy=_policy(keys, "launcher")
        )
        address = router.bind()
        before = zap.auth_failures()
        peers = [
            Endpoint(client_ctx, zmq.DEALER, name=name, identity="g0", policy=policy)
            for name, policy in (
                ("unknown", unknown_key),
                ("other", other_run),
                ("none", security.SocketPolicy()),
            )
        ]
        refused = _client_event(peers[0].sock, zmq.EVENT_HANDSHAKE_FAILED_AUTH)
        for peer in peers:
            peer.connect(address)
            await peer.send(Hello(role="generator", peer_id="g0", pid=1))
        _await_event(refused)  # the ZAP handler said no to the key it does not know
        total = sum(before.values())
        assert await asyncio.to_thread(zap.wait_auth_failures, total + 3, timeout_s=TIMEOUT_S)
        after = zap.auth_failures()
        assert after.get("unknown key", 0) > before.get("unknown key", 0)  # asked ZAP, refused
        assert after.get("handshake failed", 0) >= before.get("handshake failed", 0) + 2  # never got that far

        good = Endpoint(client_ctx, zmq.DEALER, name="good", identity="g1", policy=_policy(keys, "generator"))
        good.connect(address)
        await good.send(Hello(role="generator", peer_id="g1", pid=2))
        sender, msg, _ = await asyncio.wait_for(router.recv(), TIMEOUT_S)
        # Nothing from the refused peers arrived, before or after the good one.
        assert (sender, msg) == (b"g1", Hello(role="generator", peer_id="g1", pid=2))
        assert router.sock.poll(0) == 0 and router.num_rejected == 0
        for ep in (*peers, good, router):
            ep.close()

    asyncio.run(scenario())


@pytest.mark.timeout(60)
def test_a_role_cannot_send_what_its_key_does_not_allow(keys, contexts):
    server_ctx, client_ctx = contexts

    async def scenario() -> None:
        router = Endpoint(
            server_ctx, zmq.ROUTER, name="launcher.ctrl", accept=None, policy=_policy(keys, "launcher")
        )
        address = router.bind()
        gen = Endpoint(client_ctx, zmq.DEALER, name="gen", identity="g0", policy=_policy(keys, "generator"))
        learner = Endpoint(
            client_ctx, zmq.DEALER, name="learner", identity="learner", policy=_policy(keys, "learner")
        )
        gen.connect(address)
        learner.connect(address)
        published = ShardsPublished(version=9, root="/etc", num_bytes=1)
        forged = [any_step_done(), published, Hello(role="learner", peer_id="learner", pid=1)]
        for msg in forged:  # a generator speaking as the learner
            await gen.send(msg)
        await gen.send(Heartbeat(peer_id="g0", time_s=1.0))  # the same connection: after the forged ones
        sender, msg, _ = await asyncio.wait_for(router.recv(), TIMEOUT_S)
        assert (sender, type(msg)) == (b"g0", Heartbeat)
        assert router.num_rejected == len(forged)
        assert all(key.startswith("not allowed for the sender's key") for key in router.rejected)

        await learner.send(any_step_done())  # the learner's key may
        sender, msg, _ = await asyncio.wait_for(router.recv(), TIMEOUT_S)
        assert (sender, type(msg)) == (b"learner", StepDone)
        for ep in (gen, learner, router):
            ep.close()

    asyncio.run(scenario())


@pytest.mark.timeout(120)
def test_malformed_frames_from_an_authenticated_peer_are_rejected_and_counted(keys, tmp_path, contexts):
    server_ctx, client_ctx = contexts
    garbage = malformed_messages(random.Random(7), wrong_types=[any_step_done()], canary=tmp_path / "canary")
    assert len(garbage) == NUM_MESSAGES

    async def scenario() -> None:
        pull = Endpoint(server_ctx, zmq.PULL, name="learner.data", policy=_policy(keys, "learner"))
        address = pull.bind()
        push = client_ctx.socket(zmq.PUSH)  # raw: sends whatever it is given
        _policy(keys, "generator").apply_client(push)
        push.connect(address)
        for frames in garbage:
            push.send_multipart(frames)
        push.send_multipart(encode(Trajectories(items=[])))  # after the garbage, on the same connection
        _, msg, _ = await asyncio.wait_for(pull.recv(), 60)
        assert msg == Trajectories(items=[])
        assert pull.num_rejected == NUM_MESSAGES, dict(pull.rejected)
        push.close(linger=0)
        pull.close()

    asyncio.run(scenario())
    assert not (tmp_path / "canary").exists()


CAP_BYTES = 1 << 20
OVERSIZE_BYTES = 96 << 20
_SENDER = textwrap.dedent(
    """
    import sys, zmq
    from asyncrl.transport import security
    keys, address, size = sys.argv[1], sys.argv[2], int(sys.argv[3])
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    security.SocketPolicy(role="generator", curve=security.CurveKeys.load(keys, role="generator")).apply_client(push)
    push.monitor("inproc://mon", zmq.EVENT_DISCONNECTED)
    mon = ctx.socket(zmq.PAIR)
    mon.connect("inproc://mon")
    push.connect(address)
    push.send(bytes(size))
    print("disconnected" if mon.poll(30_000) else "still connected", flush=True)
    ctx.destroy(linger=0)
    """
)


def _peak_rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


@pytest.mark.timeout(120)
def test_a_frame_past_the_size_cap_is_dropped_before_it_is_buffered(keys, contexts):
    """The receiver's peak memory does not grow by the oversized frame: ZeroMQ reads the frame's
    size, finds it past ZMQ_MAXMSGSIZE and drops the connection. The socket keeps working."""
    try:
        Path("/proc/self/clear_refs").write_text("5")  # reset the peak-RSS mark (VmHWM)
    except OSError:
        pytest.skip("cannot reset the peak RSS mark here")
    server_ctx, client_ctx = contexts
    policy = _policy(keys, "learner", max_message_bytes=CAP_BYTES)

    async def scenario() -> None:
        pull = Endpoint(server_ctx, zmq.PULL, name="learner.data", policy=policy)
        address = pull.bind()
        baseline = _peak_rss_bytes()
        sender = subprocess.run(
            [sys.executable, "-c", _SENDER, str(keys), address, str(OVERSIZE_BYTES)],
            capture_output=True,
            text=True,
            timeout=90,
        )
        assert sender.stdout.strip() == "disconnected", sender.stderr
        assert pull.sock.poll(0) == 0  # nothing was delivered
        growth = _peak_rss_bytes() - baseline
        assert growth < OVERSIZE_BYTES // 4, f"peak RSS grew by {growth >> 20} MiB"

        # The socket still serves well-behaved peers.
        push = Endpoint(client_ctx, zmq.PUSH, name="gen.data", policy=_policy(keys, "generator"))
        push.connect(address)
        await push.send(Trajectories(items=[]))
        _, msg, _ = await asyncio.wait_for(pull.recv(), TIMEOUT_S)
        assert msg == Trajectories(items=[])
        push.close()
        pull.close()

    asyncio.run(scenario())


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_run_with_curve_refuses_peers_without_the_key_and_is_unchanged(
    tiny_model_dir, tmp_path, keys, gate, launch_streamed
):
    """A whole launched run with CURVE on (loopback, curve forced on): peers without the run's key
    (none, unknown, another run's) connect to the launcher's control socket and the learner's
    trajectory socket mid-run; they are refused and counted, and the run is a clean run. A
    generator's key speaking as the learner reaches the launcher and is rejected and counted.
    Mid-run by construction: the generator holds step 2's groups until the test opens the gate."""
    import json

    from tests.conftest import read_records as records
    from tests.integration.test_fuzz import GATED_STEP, GROUPS, SAMPLES, STEPS, WAIT_S, worker_addresses
    from tests.support.gated_generator import gated_job_args
    from tests.support.waiting import RunRecords

    args, env = gated_job_args(
        tiny_model_dir,
        tmp_path,
        gate.path,
        "cluster.curve=on",
        f'cluster.keys_dir="{keys}"',
        first_held=GATED_STEP * GROUPS,
        steps=STEPS,
        groups=GROUPS,
        samples=SAMPLES,
        name="curve",
    )
    run_dir = tmp_path / "curve"
    security.write_keys(tmp_path / "other")
    run = security.CurveKeys.load(keys, role="generator")
    public, secret = zmq.curve_keypair()
    strangers = [
        security.SocketPolicy(),  # no CURVE at all
        security.SocketPolicy(
            role="generator", curve=security.CurveKeys(run.server_public, None, public, secret)
        ),
        _policy(tmp_path / "other", "generator"),  # another run's keys
    ]
    lines = launch_streamed(args, env)
    lines.wait_for(r"^step 1/", timeout_s=WAIT_S, what="the first step")
    spawned = {m[1]: int(m[2]) for m in lines.matches(r"^started (\S+) \(pid (\d+)\)")}
    addresses = worker_addresses(lines.proc.pid, spawned["learner"], run_dir)

    async def intrude() -> None:
        ctx = zmq.Context()
        try:
            for policy in strangers:
                # A stranger's handshake fails, and its socket may have no connection by the time
                # it sends (a loaded host: the failure came first): its send then waits for one
                # that never comes. The connection attempt is what the launcher must refuse.
                ctrl = Endpoint(ctx, zmq.DEALER, name="stranger", identity="gen-0", policy=policy)
                ctrl.connect(addresses["ctrl"])
                await _try_send(ctrl, any_step_done())
                data = Endpoint(ctx, zmq.PUSH, name="stranger.data", policy=policy)
                data.connect(addresses["data"])
                await _try_send(data, Trajectories(items=[]))
            forger = Endpoint(
                ctx, zmq.DEALER, name="forger", identity="forger", policy=_policy(keys, "generator")
            )
            forger.connect(addresses["ctrl"])
            await forger.send(any_step_done())  # reaches the launcher: rejected by role
        finally:
            ctx.destroy(linger=2000)

    with RunRecords(run_dir, lines) as stream:
        asyncio.run(intrude())
        stream.wait_for(
            lambda r: any(x["num_refused"] >= len(strangers) for x in r.of("refused")),
            timeout_s=WAIT_S,
            what="the launcher to count the refused peers",
        )
        stream.wait_for(
            lambda r: bool(r.of("rejected")), timeout_s=WAIT_S, what="the forged StepDone's rejection"
        )
    gate.open()
    code = lines.wait_exit(timeout_s=200)
    assert code == 0, lines.tail()
    refused = records(run_dir, "refused")[-1]["by_reason"]
    assert refused.get("unknown key", 0) >= 1 and refused.get("handshake failed", 0) >= 2, refused
    assert "refused a connection" in (run_dir / "logs" / "learner.log").read_text(errors="replace")
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed"
    by_reason = summary["rejected_frames"]["launcher_by_reason"]
    assert summary["rejected_frames"]["learner"] == 0, summary["rejected_frames"]
    assert list(by_reason) == ["not allowed for the sender's key"], by_reason
    assert summary["trajectories_trained"] == STEPS * GROUPS * SAMPLES
    assert summary["trajectories_lost"] == 0 and summary["trajectories_duplicated"] == 0
    assert summary["duplicates"] == 0 and summary["generator_restarts"] == 0


async def _try_send(ep: Endpoint, msg) -> None:
    """`ep.send(msg)`, given up after a few seconds (a refused peer may never get a connection)."""
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(ep.send(msg), timeout=5.0)
