"""A generator plugin with one straggler (`generators.kind =
"tests.support.straggler_generator:StragglerGenerator"`): the first generator to get group
`ASYNCRL_TEST_STRAGGLER_GROUP` (it creates the file `ASYNCRL_TEST_STRAGGLER_MARK`) holds it until
the test opens a gate (tests/support/gate.py), as a host many times slower than its peers would
for that task. Every other group, and the same group on any other generator (a hedge), is
generated as the torch generator does.
"""

from __future__ import annotations

import asyncio
import os
import threading

from asyncrl.generators.torch_gen import TorchGenerator
from tests.support.gate import GATE_ENV, wait_until_open

GROUP_ENV = "ASYNCRL_TEST_STRAGGLER_GROUP"
MARK_ENV = "ASYNCRL_TEST_STRAGGLER_MARK"  # holds the straggler's peer id once one took the group


class StragglerGenerator(TorchGenerator):
    def setup(self, ctx) -> None:
        self.peer_id = ctx.generator_id
        super().setup(ctx)

    async def generate(self, tasks):
        if any(t.group_id == int(os.environ[GROUP_ENV]) for t in tasks) and self._first():
            await self._gate_opened()
        return await super().generate(tasks)

    def _first(self) -> bool:
        """Whether this generator is the first to get the group (it then straggles)."""
        try:
            fd = os.open(os.environ[MARK_ENV], os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            return False
        os.write(fd, self.peer_id.encode())
        os.close(fd)
        return True

    def _gate_opened(self) -> asyncio.Future:
        loop = asyncio.get_running_loop()
        opened = loop.create_future()

        def wait() -> None:
            wait_until_open(os.environ[GATE_ENV])
            loop.call_soon_threadsafe(lambda: opened.done() or opened.set_result(None))

        threading.Thread(target=wait, name="test-straggler", daemon=True).start()
        return opened
