"""The web monitor's HTTP server in process, on 127.0.0.1: what it serves, who it refuses, and
how often its stream speaks however fast records come."""

from __future__ import annotations

import asyncio
import json
import threading
import time

from aiohttp.test_utils import TestClient, TestServer

from asyncrl.monitor.web.access import COOKIE, Access
from asyncrl.monitor.web.model import WebRun
from asyncrl.monitor.web.server import MAX_MESSAGES_PER_S, RunSource, build_app

TOKEN = "0123456789abcdef-token"


def step(i: int) -> dict:
    return {
        "type": "step",
        "step": i,
        "version": i + 1,
        "num_trajectories": 8,
        "num_tokens": 20,
        "loss": 0.1,
        "mean_reward": 0.5,
        "max_staleness": 0,
        "mean_staleness": 0.0,
        "step_s": 0.01,
        "idle_s": 0.0,
        "time_s": 1.0 + i * 0.01,
    }


def serve(access: Access, body):
    """Run `body(client, source)` against a server on 127.0.0.1 with one run."""
    source = RunSource(WebRun("run-a", live=True))
    source.apply(lambda run: run.apply_config({"learner": {"steps": 5}}))

    async def main():
        async with TestClient(TestServer(build_app([source], access), host="127.0.0.1")) as client:
            return await body(client, source)

    return asyncio.run(main())


def test_loopback_serves_the_page_and_the_run_read_only():
    async def body(client, source):
        source.add(step(0))
        page = await client.get("/")
        assert page.status == 200 and "asyncrl monitor" in await page.text()
        assert "default-src 'self'" in page.headers["Content-Security-Policy"]
        for name in ("app.js", "style.css"):
            assert (await client.get(f"/static/{name}")).status == 200
        assert (await client.get("/static/../server.py")).status == 404
        assert await (await client.get("/api/runs")).json() == [{"id": 0, "label": "run-a"}]
        state = await (await client.get("/api/runs/0/state")).json()
        assert state["head"]["step"] == 1
        assert await (await client.get("/api/runs/0/config")).json() == {"learner": {"steps": 5}}
        assert (await client.get("/api/runs/7/state")).status == 404
        # read-only: nothing but GET is routed
        assert (await client.post("/api/runs/0/state", data=b"{}")).status == 405
        assert (await client.delete("/api/runs/0/state")).status == 405
        # a page elsewhere reaching this server through DNS rebinding names its own host
        assert (await client.get("/api/runs", headers={"Host": "evil.example:80"})).status == 403

    serve(Access(token=None, loopback_only=True), body)


def test_a_token_server_refuses_without_it_and_serves_with_it():
    """Beyond loopback (here: the rule a non-loopback bind gets, served on 127.0.0.1)."""

    async def body(client, source):
        for path in ("/", "/static/app.js", "/api/runs", "/api/runs/0/state", "/api/runs/0/stream"):
            missing = await client.get(path)
            assert missing.status == 401, path
            assert "token is required" in await missing.text()
            assert (await client.get(path, params={"token": "wrong-token-wrong"})).status == 403, path
        assert (await client.get("/api/runs", headers={"Authorization": f"Bearer {TOKEN}"})).status == 200
        page = await client.get("/", params={"token": TOKEN})
        assert page.status == 200
        assert page.cookies[COOKIE].value == TOKEN and page.cookies[COOKIE]["httponly"]
        # the page's own requests carry the cookie, not the token
        client.session.cookie_jar.update_cookies({COOKIE: TOKEN})
        assert (await client.get("/static/app.js")).status == 200
        assert (await client.get("/api/runs/0/state")).status == 200

    serve(Access(token=TOKEN, loopback_only=False), body)


def test_the_stream_stays_within_its_rate_whatever_the_record_rate():
    window_s = 2.5

    async def body(client, source):
        stop = threading.Event()
        added = [0]

        def feed():  # records as fast as a busy run writes them
            while not stop.is_set():
                source.add(step(added[0]))
                added[0] += 1
                stop.wait(0.0005)

        feeder = threading.Thread(target=feed, name="feeder")
        feeder.start()
        try:
            response = await client.get("/api/runs/0/stream")
            assert response.headers["Content-Type"].startswith("text/event-stream")
            messages, steps = 0, []
            start = time.monotonic()
            while time.monotonic() - start < window_s:
                line = await asyncio.wait_for(response.content.readline(), timeout=5.0)
                if line.startswith(b"data: "):
                    messages += 1
                    steps.append(json.loads(line[6:])["head"]["step"])
            elapsed = time.monotonic() - start
            response.close()
        finally:
            stop.set()
            feeder.join()
        return messages, steps, elapsed, added[0]

    messages, steps, elapsed, num_records = serve(Access(token=None, loopback_only=True), body)
    assert num_records > 10 * messages  # far more records than messages
    assert 2 <= messages <= MAX_MESSAGES_PER_S * elapsed + 1
    assert steps == sorted(steps) and steps[-1] > steps[0]  # each message a newer view


def test_an_endpoint_alone_is_followed_from_its_pub_socket():
    """`asyncrl monitor --web tcp://HOST:PORT`: no run directory, the PUB socket's records only."""
    import zmq

    from asyncrl.monitor.attach import resolve_target
    from asyncrl.monitor.web.command import RunFollower

    pub = zmq.Context.instance().socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    target = resolve_target(f"tcp://127.0.0.1:{port}")
    source = RunSource(WebRun(f"tcp://127.0.0.1:{port}", live=target.live))
    follower = RunFollower(target, source)
    follower.read_past()
    follower.start()
    try:
        deadline = time.monotonic() + 30
        seq = 0
        while source.run.view.step < 1:  # PUB drops what it sends before the SUB has joined: resend
            assert time.monotonic() < deadline, "no record arrived through the PUB socket"
            pub.send_multipart([str(seq).encode(), json.dumps(step(0)).encode()])
            seq += 1
            follower.stopping.wait(0.05)
        state = json.loads(source.state_json())
        assert state["live"] and state["head"]["step"] == 1 and state["label"] == f"tcp://127.0.0.1:{port}"
    finally:
        follower.stop()
        pub.close()
    assert not follower.thread.is_alive()
