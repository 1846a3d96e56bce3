"""Endpoint (plain sockets with NOBLOCK operations, waiting on the descriptor only when they cannot
proceed): order kept, nothing lost when the queue fills, other tasks not starved by a long burst,
packed frames decoded on arrival, and two-way sockets that send and receive at once."""

from __future__ import annotations

import asyncio

import torch
import uvloop
import zmq
import zmq.asyncio

from asyncrl.messages import WeightsLoaded
from asyncrl.transport.codec import tensor_ref
from asyncrl.transport.zmq_io import RECV_STREAK, Endpoint


def _traj(step: int, payload: torch.Tensor):
    from asyncrl.messages import TensorRef, Trajectory

    return Trajectory(
        traj_id=step,
        group_id=0,
        task_id=0,
        sample_index=0,
        window=step,
        num_samples=1,
        prompt_ids=[1],
        completion_ids=tensor_ref(0, payload),
        behavior_logprobs=TensorRef(frame=1, dtype="float32", shape=(0,)),
        token_versions=TensorRef(frame=2, dtype="int64", shape=(0,)),
        reward=0.0,
        finish_reason="stop",
        generator_id="g",
    )


def _pair(ctx: zmq.asyncio.Context, *, hwm: int | None = None) -> tuple[Endpoint, Endpoint]:
    pull = Endpoint(ctx, zmq.PULL, name="pull", accept=None)
    push = Endpoint(ctx, zmq.PUSH, name="push")
    if hwm is not None:
        for ep in (pull, push):
            ep.sock.setsockopt(zmq.SNDHWM, hwm)
            ep.sock.setsockopt(zmq.RCVHWM, hwm)
    push.connect(pull.bind())
    return push, pull


def test_order_kept_and_nothing_lost_when_the_queue_fills():
    async def main():
        ctx = zmq.asyncio.Context()
        push, pull = _pair(ctx, hwm=4)
        n = 200
        payload = torch.zeros(1 << 14)  # 64 KiB each: the queues and the kernel's buffers fill
        received: list[int] = []

        async def consume():
            while len(received) < n:
                _, msg, tensors = await pull.recv()
                assert torch.equal(tensors[0], payload)
                received.append(msg.window)

        task = asyncio.create_task(consume())
        for v in range(n):
            await push.send(_traj(v, payload), (payload, torch.zeros(0), torch.zeros(0, dtype=torch.int64)))
        await asyncio.wait_for(task, 60)
        assert received == list(range(n))
        assert push.waited_sends > 0  # the waiting path was taken, and kept the order
        push.close()
        pull.close()
        ctx.term()

    uvloop.run(main())


def test_a_long_burst_yields_to_other_tasks():
    async def main():
        ctx = zmq.asyncio.Context()
        push, pull = _pair(ctx)
        n = 4 * RECV_STREAK
        for v in range(n):
            await push.send(WeightsLoaded(generator_id="g", version=v))
        ticks: list[int] = []
        got = 0

        async def ticker():
            while True:
                ticks.append(got)
                await asyncio.sleep(0)

        t = asyncio.create_task(ticker())
        await asyncio.sleep(0)
        while got < n:
            await pull.recv()
            got += 1
        t.cancel()
        # The ticker ran between streaks, not only before the first message and after the last.
        assert any(0 < g < n for g in ticks), ticks[:10]
        push.close()
        pull.close()
        ctx.term()

    uvloop.run(main())


def test_tensors_arrive_packed_and_intact():
    from asyncrl.messages import Trajectory

    async def main():
        ctx = zmq.asyncio.Context()
        push, pull = _pair(ctx)
        ids = torch.tensor([7, 8, 9], dtype=torch.int64)
        logps = torch.tensor([-0.5, -0.25, -1.0])
        versions = torch.tensor([2, 2, 3], dtype=torch.int64)
        msg = Trajectory(
            traj_id=1,
            group_id=0,
            task_id=0,
            sample_index=1,
            window=0,
            num_samples=2,
            prompt_ids=[1, 2],
            completion_ids=tensor_ref(0, ids),
            behavior_logprobs=tensor_ref(1, logps),
            token_versions=tensor_ref(2, versions),
            reward=1.0,
            finish_reason="stop",
            generator_id="g",
        )
        await push.send(msg, (ids, logps, versions))
        frames = pull.sock.recv_multipart()  # raw (blocking): the wire layout
        assert len(frames) == 2
        await push.send(msg, (ids, logps, versions))
        _, out, tensors = await pull.recv()
        assert out == msg
        assert [t.tolist() for t in tensors] == [ids.tolist(), logps.tolist(), versions.tolist()]
        push.close()
        pull.close()
        ctx.term()

    uvloop.run(main())


def test_a_data_socket_carries_trajectories_and_groups_of_them():
    import array

    from asyncrl.messages import Trajectories
    from asyncrl.transport.codec import batch_trajectories, split_trajectories

    async def main():
        ctx = zmq.asyncio.Context()
        pull = Endpoint(ctx, zmq.PULL, name="pull")  # the socket kind's default message types
        push = Endpoint(ctx, zmq.PUSH, name="push")
        push.connect(pull.bind())
        # Sent as a generator sends: arrays for the frames (tensors on arrival).
        group = [
            (
                _traj(k, torch.tensor([k, k + 1])),
                [array.array("q", [k, k + 1]), array.array("f"), array.array("q")],
            )
            for k in (1, 2)
        ]
        await push.send(WeightsLoaded(generator_id="g", version=1))  # not carried here: rejected
        lone_msg, lone_tensors = (
            _traj(0, torch.tensor([5])),
            [torch.tensor([5]), torch.zeros(0), torch.zeros(0).long()],
        )
        await push.send(lone_msg, lone_tensors)
        [(batch, tensors)] = batch_trajectories(group)
        await push.send(batch, tensors)
        _, first, first_tensors = await pull.recv()
        _, second, second_tensors = await pull.recv()
        assert first == lone_msg and first_tensors[0].tolist() == [5]
        assert isinstance(second, Trajectories)
        items = split_trajectories(second, second_tensors)
        assert [m.traj_id for m, _ in items] == [1, 2]
        assert [t[0].tolist() for _, t in items] == [[1, 2], [2, 3]]
        assert pull.num_rejected == 1
        push.close()
        pull.close()
        ctx.term()

    uvloop.run(main())


def test_two_way_sockets_send_while_their_receive_waits():
    """ROUTER and DEALER each send while a receive waits on the same socket, with queues small
    enough to fill: a send can take the descriptor's signal that the waiting receive needs (and a
    receive the one a waiting send needs). Every message must arrive, in order, without a hang."""
    from asyncrl.messages import Heartbeat

    async def main():
        ctx = zmq.Context()
        router = Endpoint(ctx, zmq.ROUTER, name="router", accept=None)
        dealer = Endpoint(ctx, zmq.DEALER, name="dealer", identity="d", accept=None)
        for ep in (router, dealer):
            ep.sock.setsockopt(zmq.SNDHWM, 2)
            ep.sock.setsockopt(zmq.RCVHWM, 2)
        dealer.connect(router.bind())
        n = 500
        payload = torch.zeros(1 << 12)  # 16 KiB: the small queues fill, sends wait
        echoed: list[int] = []
        beats: list[int] = []

        async def serve():  # the router echoes each request and, in between, sends its own
            for k in range(n):
                sender, msg, tensors = await router.recv()
                await router.send(msg, tensors, to=sender)
                await router.send(Heartbeat(peer_id="router", time_s=float(k)), to=sender)

        async def listen():
            while len(echoed) < n or len(beats) < n:
                _, msg, tensors = await dealer.recv()
                if isinstance(msg, Heartbeat):
                    beats.append(int(msg.time_s))
                else:
                    assert torch.equal(tensors[0], payload)
                    echoed.append(msg.window)

        async def request():
            for k in range(n):
                await dealer.send(
                    _traj(k, payload), (payload, torch.zeros(0), torch.zeros(0, dtype=torch.int64))
                )

        await asyncio.wait_for(asyncio.gather(serve(), listen(), request()), 20)
        assert echoed == list(range(n)) and beats == list(range(n))
        assert router.waited_sends + dealer.waited_sends > 0  # the queues did fill
        router.close()
        dealer.close()
        ctx.term()

    uvloop.run(main())


def test_close_cancels_a_waiting_receive():
    async def main():
        ctx = zmq.Context()
        push, pull = _pair(ctx)
        waiting = asyncio.create_task(pull.recv())
        await asyncio.sleep(0)  # the receive finds nothing queued and waits
        pull.close()
        try:
            await waiting
        except asyncio.CancelledError:
            pass
        else:
            raise AssertionError("the receive returned after its socket closed")
        push.close()
        ctx.term()

    uvloop.run(main())
