"""A receiver keeps working after garbage on its socket: malformed frames are counted, not fatal."""

from __future__ import annotations

import asyncio

import pytest
import zmq
import zmq.asyncio

from asyncrl.messages import WeightsLoaded
from asyncrl.transport.codec import encode
from asyncrl.transport.zmq_io import Endpoint


@pytest.mark.timeout(30)
def test_malformed_frames_do_not_kill_receiver():
    async def scenario():
        ctx = zmq.asyncio.Context()
        pull = Endpoint(ctx, zmq.PULL, name="test.pull", accept=(WeightsLoaded,))
        address = pull.bind()
        raw = ctx.socket(zmq.PUSH)
        raw.setsockopt(zmq.LINGER, 0)
        raw.connect(address)
        garbage = [[b""], [b"\xff\xfe"], [b"\x92\x01\x02"], [b"{}", b"x" * 10], [b"\x81\xa4type\xa3Bad"]]
        for frames in garbage:
            await raw.send_multipart(frames)
        # Same connection, so it arrives after the garbage (ZeroMQ keeps per-connection order).
        await raw.send_multipart(encode(WeightsLoaded(generator_id="g", version=7)))
        _, msg, _ = await asyncio.wait_for(pull.recv(), timeout=10)
        assert msg == WeightsLoaded(generator_id="g", version=7)
        assert pull.num_rejected == len(garbage)
        raw.close()
        pull.close()
        ctx.term()

    asyncio.run(scenario())
