"""The launcher's control inbox: how messages from the control socket reach their handler.

Place in the data flow: one task (`receive`) owns the launcher's ROUTER socket
(`scheduler/service.py`). During start-up the launcher waits for conditions (the learner's
Hello, every generator serving) one message at a time: `receive` queues what arrives and
`handle_one` takes the next, or returns after a timeout so the caller can look at the clock.
Once training starts (`go_inline`), the queue is drained in arrival order and `receive` hands
every message to the handler itself, with no queue and no future per message (there is a
message per group). After the run has finished, messages are only queued.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

from asyncrl.transport.zmq_io import Endpoint

Handler = Callable[[bytes, Any], Awaitable[None]]


class Inbox:
    def __init__(self, ctrl: Endpoint, handler: Handler, finished: asyncio.Event) -> None:
        self.ctrl = ctrl
        self.handler = handler
        self.finished = finished
        self.queue: asyncio.Queue = asyncio.Queue()
        self.inline = False

    async def receive(self) -> None:
        """The socket's only reader; runs as its own task until cancelled."""
        while True:
            item = await self.ctrl.recv()
            if self.inline and not self.finished.is_set():
                await self.handler(item[0], item[1])
            else:
                self.queue.put_nowait(item)

    async def handle_one(self, timeout_s: float) -> None:
        """Handle the next message, waiting up to `timeout_s` (or until the run finishes)."""
        if not self.queue.empty():  # one is queued: no futures, no timer
            sender, msg, _ = self.queue.get_nowait()
            await self.handler(sender, msg)
            return
        getter = asyncio.ensure_future(self.queue.get())
        stop = asyncio.ensure_future(self.finished.wait())
        done, _ = await asyncio.wait({getter, stop}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
        stop.cancel()
        if getter in done:
            sender, msg, _ = getter.result()
            await self.handler(sender, msg)
        else:
            getter.cancel()

    async def wait_until(self, ready: Callable[[], bool], *, timeout_s: float | None = None) -> bool:
        """Handle messages until `ready()` or the run has finished (True), or until `timeout_s`
        has passed (False). Without a timeout, supervision bounds the wait (restarts, budget)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not ready() and not self.finished.is_set():
            if deadline is None:
                await self.handle_one(1.0)
                continue
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            await self.handle_one(remaining)
        return True

    async def go_inline(self) -> None:
        """Handle what is queued, in arrival order, then let `receive` handle each message."""
        while not self.queue.empty() and not self.finished.is_set():
            await self.handle_one(0.0)
        self.inline = True
