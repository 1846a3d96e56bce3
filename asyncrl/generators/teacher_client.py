"""A generator's side of the shared OPD teacher (opd.placement = "service").

Place in the data flow: the torch generator's sampling thread has a batch of samples to score
(`teachers.Teacher.score`); this client sends them to the teacher process
(`teacher_service.py`) as one `TeacherRequest` (prompts, completion lengths, and the [T, N] ids
of every sample stacked into one int64 frame) and blocks that thread until the `TeacherScores`
come back ([T, N] float32 log-probs in the same layout). The socket (a DEALER connected to the
teacher's ROUTER, its address on the generator's command line) belongs to the generator
process's event loop: the sampling thread hands each request to the loop and waits on the
answer, so the socket is only ever touched by the loop.

No hang when the teacher is gone: a request unanswered after `opd.service_timeout_s` raises
`TeacherUnavailable` naming the teacher, which fails the generator (and the launcher, watching
the teacher's process, reports why it went).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
from collections.abc import Sequence
from typing import Any

import torch
import zmq

from asyncrl.messages import PromptTask, TeacherRequest, TeacherScores, service_teachers, split_endpoints
from asyncrl.transport.codec import tensor_ref
from asyncrl.transport.zmq_io import Endpoint

log = logging.getLogger(__name__)


class TeacherUnavailable(RuntimeError):
    """The shared teacher did not answer in time, or could not score a request."""


class TeacherClient:
    """Scores samples with the shared teacher (module docstring); made on the generator's loop."""

    def __init__(self, zmq_ctx: zmq.Context, endpoint: str, *, peer_id: str, timeout_s: float) -> None:
        self.endpoint = endpoint
        self.timeout_s = timeout_s
        self.loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()  # made on the loop: its thread must never block here
        self.sock = Endpoint(zmq_ctx, zmq.DEALER, name=f"{peer_id}.teacher", accept=(TeacherScores,))
        self.sock.connect(endpoint)
        self._ids = itertools.count()
        self._waiting: dict[int, asyncio.Future] = {}
        self._receiver: asyncio.Task | None = None
        self.num_requests = 0
        self.request_bytes = 0  # tensor bytes sent (the ids) and received (the scores)
        self.reply_bytes = 0

    # ------------------------------------------------------------------ the sampling thread
    def score(
        self, tasks: Sequence[PromptTask], ids_TN: Sequence[torch.Tensor]
    ) -> tuple[list[torch.Tensor], int | None]:
        """`teachers.Teacher.score`: blocks the calling thread (never the loop's) until the
        teacher has answered; TeacherUnavailable past opd.service_timeout_s."""
        if threading.get_ident() == self._loop_thread:
            raise RuntimeError("TeacherClient.score blocks: call it off the event loop (the sampling thread)")
        prompts = [list(t.prompt_ids) for t in tasks]
        future = asyncio.run_coroutine_threadsafe(self.request(prompts, ids_TN), self.loop)
        # The coroutine gives up at timeout_s itself; this bound only guards a loop that has stopped.
        return future.result(timeout=self.timeout_s + 5.0), None

    # ------------------------------------------------------------------ the loop
    async def request(self, prompts: list[list[int]], ids_TN: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Send one request and wait for its answer; the scores split per sample."""
        if self._receiver is None:
            self._receiver = asyncio.create_task(self._receive(), name="gen-teacher-recv")
        lengths = [int(x.shape[0]) for x in ids_TN]
        flat = torch.cat([x.to(torch.int64) for x in ids_TN]).contiguous()
        request_id = next(self._ids)
        waiter = self.loop.create_future()
        self._waiting[request_id] = waiter
        try:
            msg = TeacherRequest(
                request_id=request_id, prompt_ids=prompts, lengths=lengths, ids=tensor_ref(0, flat)
            )
            await self.sock.send(msg, [flat])
            self.num_requests += 1
            self.request_bytes += flat.numel() * flat.element_size()
            try:
                reply, frames = await asyncio.wait_for(waiter, self.timeout_s)
            except TimeoutError:
                raise TeacherUnavailable(
                    f"the shared OPD teacher at {self.endpoint} did not answer within opd.service_timeout_s = "
                    f"{self.timeout_s:g} s (is its process alive? see logs/opd-teacher.log)"
                ) from None
        finally:
            self._waiting.pop(request_id, None)
        if reply.error:
            raise TeacherUnavailable(f"the shared OPD teacher could not score a request: {reply.error}")
        scores = frames[0] if frames else None
        if scores is None or tuple(scores.shape) != tuple(flat.shape) or scores.dtype != torch.float32:
            got = None if scores is None else f"{scores.dtype}{list(scores.shape)}"
            raise TeacherUnavailable(
                f"the shared OPD teacher answered {got} for ids of shape {list(flat.shape)}; expected float32 of that shape"
            )
        self.reply_bytes += scores.numel() * scores.element_size()
        return [x.clone() for x in scores.split(lengths)]  # out of the received frame

    async def _receive(self) -> None:
        while True:
            _, msg, frames = await self.sock.recv()
            waiter = self._waiting.get(msg.request_id)
            if waiter is None or waiter.done():
                self.sock.reject(
                    f"unknown request: TeacherScores for request {msg.request_id} nobody waits for"
                )
                continue
            waiter.set_result((msg, frames))

    def close(self) -> None:
        if self._receiver is not None:
            self._receiver.cancel()
        for waiter in self._waiting.values():
            if not waiter.done():
                waiter.set_exception(TeacherUnavailable("the generator is closing"))
        self.sock.close()


class TeacherClients(dict):
    """opd.teachers with opd.placement = "service": teacher name -> its `TeacherClient`."""

    def close(self) -> None:
        for client in self.values():
            client.close()


def open_teacher(ctx: Any) -> TeacherClient | TeacherClients | None:
    """The client of the shared teacher for a generator process (`runtime.ChildContext`), when
    the run has one (opd.enabled with opd.placement = "service"), or one per shared teacher of
    opd.teachers by name; the launcher passes the addresses as `WorkerArgs.teacher`."""
    opd = ctx.config.opd
    if not opd.teacher_service:
        return None
    endpoint = ctx.args.teacher
    if not endpoint:
        raise ValueError(
            "opd.placement = 'service', but this generator was started without the shared teacher's "
            "address (WorkerArgs.teacher; `asyncrl launch` passes it)"
        )
    if not opd.teachers:
        return TeacherClient(ctx.zmq_ctx, endpoint, peer_id=ctx.peer_id, timeout_s=opd.service_timeout_s)
    addresses = split_endpoints(endpoint)
    if missing := sorted(set(service_teachers(opd, peer="").values()) - set(addresses)):
        raise ValueError(
            f"opd.teachers: this generator was given no address for the shared teacher {missing[0]!r}"
        )
    return TeacherClients(
        (name, TeacherClient(ctx.zmq_ctx, address, peer_id=ctx.peer_id, timeout_s=opd.service_timeout_s))
        for name, address in addresses.items()
    )
