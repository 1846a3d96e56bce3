"""An environment worker process: serves the episodes of one pool slot, inside the jail.

Place in the data flow: started by `pool.ProcessPoolHost` as `python -m asyncrl.environments.worker`
with its stdin and stdout as the pool's pipe (`wire.py`). It reads the `WorkerSetup`, imports the
environment plugin, moves the pipe's output off stdout (the environment's prints go to stderr,
the worker's log), enters the jail (`jail.py`) and says `WorkerReady`; then it runs every call on
its event loop, one environment instance per open episode. A reset or step that raises is an
`error` reply, a malformed answer a `bad_observation` reply; a hang or a crash is the pool's to
see (it kills and replaces the worker). Modules an environment imports lazily after the jail is
entered must live under the interpreter's own directories (the jail's read paths).
"""

from __future__ import annotations

import asyncio
import os
import sys
import tempfile

import msgspec

from asyncrl.environments.base import Environment, make_environment, resolve_environment
from asyncrl.environments.host import EnvFailure, check_result
from asyncrl.environments.jail import die_with_parent, enter_jail
from asyncrl.environments.wire import HEADER, EnvCall, EnvReply, ToWorker, WorkerReady, WorkerSetup, frame


class Worker:
    def __init__(self, setup: WorkerSetup, out_fd: int) -> None:
        self.factory = resolve_environment(setup.kind)
        self.context = setup.context
        self.out_fd = out_fd
        self.encoder = msgspec.msgpack.Encoder()
        self.envs: dict[int, Environment] = {}

    def send(self, msg: msgspec.Struct) -> None:
        data = frame(msg, self.encoder)
        while data:
            data = data[os.write(self.out_fd, data) :]

    async def handle(self, call: EnvCall) -> None:
        try:
            reply = await self.run(call)
        except EnvFailure as exc:
            reply = EnvReply(call_id=call.call_id, kind=exc.kind, error=str(exc), exc_type=exc.exc_type)
        except Exception as exc:  # the environment's own error: a reply, never the worker's end
            reply = EnvReply(
                call_id=call.call_id,
                kind="error",
                error=f"{type(exc).__name__}: {exc}",
                exc_type=type(exc).__name__,
            )
        try:
            self.send(reply)
        except (TypeError, ValueError, OverflowError) as exc:  # it does not encode: malformed
            self.send(
                EnvReply(call_id=call.call_id, kind="bad_observation", error=f"unencodable answer: {exc}")
            )

    async def run(self, call: EnvCall) -> EnvReply:
        if call.op == "open":
            env = make_environment(self.factory, self.context)
            self.envs[call.episode] = env
            obs = check_result(await env.reset(call.start), "reset")
            return EnvReply(call_id=call.call_id, observation=obs)
        if call.op == "step":
            result = check_result(await self.envs[call.episode].step(call.action), "step")
            return EnvReply(call_id=call.call_id, result=result)
        env = self.envs.pop(call.episode, None)
        if (close := getattr(env, "close", None)) is not None:
            await close()
        return EnvReply(call_id=call.call_id)


def read_frame(stream) -> bytes | None:
    head = stream.read(HEADER.size)
    if len(head) < HEADER.size:
        return None
    (size,) = HEADER.unpack(head)
    body = stream.read(size)
    return body if len(body) == size else None


async def serve(worker: Worker) -> None:
    loop = asyncio.get_running_loop()
    decoder = msgspec.msgpack.Decoder(ToWorker)
    stdin = sys.stdin.buffer
    tasks: set[asyncio.Task] = set()
    while (body := await loop.run_in_executor(None, read_frame, stdin)) is not None:
        call = decoder.decode(body)
        if isinstance(call, EnvCall):
            task = asyncio.create_task(worker.handle(call))
            tasks.add(task)
            task.add_done_callback(tasks.discard)


def main() -> None:
    die_with_parent()
    body = read_frame(sys.stdin.buffer)
    if body is None:
        return
    setup = msgspec.msgpack.decode(body, type=WorkerSetup)
    out_fd = os.dup(1)  # the pipe; the environment's prints go to the log
    os.dup2(2, 1)
    worker = Worker(setup, out_fd)  # imports the plugin before the jail hides the code's directories
    workdir = setup.jail.workdir or tempfile.mkdtemp(prefix="asyncrl-env-")
    report = enter_jail(msgspec.structs.replace(setup.jail, workdir=workdir))
    worker.context = msgspec.structs.replace(worker.context, workdir=workdir)
    worker.send(WorkerReady(pid=os.getpid(), jail=report))
    asyncio.run(serve(worker))


if __name__ == "__main__":
    main()
