"""Endpoint fast paths (synchronous NOBLOCK shadow on PUSH/PULL): order kept, nothing lost when the
queue fills, other tasks not starved by a long burst, and packed frames decoded on arrival."""

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
        step=step,
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
    push.connect(pull.bind_loopback())
    return push, pull


def test_order_kept_and_nothing_lost_when_the_queue_fills():
    async def main():
        ctx = zmq.asyncio.Context()
        push, pull = _pair(ctx, hwm=4)
        n = 200
        payload = torch.zeros(1 << 14)  # 64 KiB each: the queues and the kernel's buffers fill
        waited = 0
        real_send = push.sock.send_multipart

        def counting_send(*args, **kwargs):
            nonlocal waited
            waited += 1  # only sends that could not go at once come here
            return real_send(*args, **kwargs)

        push.sock.send_multipart = counting_send
        received: list[int] = []

        async def consume():
            while len(received) < n:
                _, msg, tensors = await pull.recv()
                assert torch.equal(tensors[0], payload)
                received.append(msg.step)

        task = asyncio.create_task(consume())
        for v in range(n):
            await push.send(_traj(v, payload), (payload, torch.zeros(0), torch.zeros(0, dtype=torch.int64)))
        await asyncio.wait_for(task, 60)
        assert received == list(range(n))
        assert waited > 0  # the waiting path was taken, and kept the order
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
            step=0,
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
        frames = await pull.sock.recv_multipart()  # raw: the wire layout
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
        push.connect(pull.bind_loopback())
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
