"""Environment worker processes: the `EnvHost` for environments that compute or run code.

Place in the data flow: a generator's episode runner opens, steps and closes episodes here; each
episode lives in one of `env.workers` worker processes (`worker.py`, the least loaded when it
opens), jailed (`jail.py`: CPU, memory and file-size limits, a private temporary directory, no
network, nothing of the run visible). Calls go over the worker's pipe (`wire.py`) and run
concurrently on its event loop, so many episodes step at once while the generator decodes.

Failures (counted, never fatal to the run):
  a call past `env.step_timeout_s`   the worker is killed (by pid) and replaced; the call is a
                                     `timeout`, the worker's other episodes `worker_lost`
  a worker that dies                 its episodes' calls are `worker_lost`; a new worker starts
                                     when the next episode opens
  an error or malformed answer       the worker's reply says so (`error`, `bad_observation`)
The runner turns each into a retry or a failed episode (`env.on_failure`). Worker logs (the
environment's prints and tracebacks) are `<run>/logs/env-<generator>-<slot>.log`.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import shutil
import sys
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

import msgspec

from asyncrl.environments.base import Action, EnvironmentContext, EpisodeStart, Observation, StepResult
from asyncrl.environments.host import EnvFailure
from asyncrl.environments.jail import JailSpec, default_read_paths
from asyncrl.environments.wire import (
    HEADER,
    MAX_FRAME_BYTES,
    EnvCall,
    EnvReply,
    FromWorker,
    WorkerReady,
    WorkerSetup,
    frame,
)

log = logging.getLogger(__name__)

START_TIMEOUT_S = 60.0  # a worker imports its environment and enters its jail within this


class _Worker:
    """One worker process, its pipe, its pending calls and the episodes it hosts."""

    def __init__(self, slot: int, proc: asyncio.subprocess.Process, workdir: str, log_file) -> None:
        self.slot = slot
        self.proc = proc
        self.workdir = workdir
        self.log_file = log_file
        self.pending: dict[int, asyncio.Future] = {}
        self.episodes: set[int] = set()
        self.alive = True
        self.ready: asyncio.Future = asyncio.get_running_loop().create_future()
        self.reader: asyncio.Task | None = None


class ProcessPoolHost:
    """See the module docstring. Workers start on demand (in the event loop that uses them)."""

    def __init__(self, env: Any, ctx: EnvironmentContext, *, run_dir: str = "", name: str = "gen") -> None:
        self.kind = env.kind
        self.ctx = ctx
        self.num_workers = env.workers
        self.timeout_s = env.step_timeout_s
        self.sandbox = env.sandbox
        self.log_dir = Path(run_dir) / "logs" if run_dir else None
        self.name = name
        self.workers: dict[int, _Worker] = {}
        self.episode_worker: dict[int, _Worker] = {}
        self.counts: Counter = Counter()
        self.jail_reports: list[Any] = []
        self._ids = itertools.count()
        self._calls = itertools.count()
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(FromWorker)
        self._starting: asyncio.Lock | None = None

    def counter_values(self) -> dict[str, float]:
        return {f"env/{k}": float(v) for k, v in self.counts.items()}

    # ------------------------------------------------------------------ workers
    async def _start(self, slot: int) -> _Worker:
        workdir = tempfile.mkdtemp(prefix=f"asyncrl-env-{self.name}-{slot}-")
        log_file = self._log_file(slot)
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "asyncrl.environments.worker",
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=log_file,
            env=_worker_env(workdir),
            cwd=workdir,
            start_new_session=True,  # Ctrl-C reaches the launcher only
            limit=MAX_FRAME_BYTES + HEADER.size,
        )
        worker = _Worker(slot, proc, workdir, log_file)
        spec = JailSpec(
            workdir=workdir,
            read_paths=default_read_paths(),
            cpu_s=self.sandbox.cpu_s,
            memory_mb=self.sandbox.memory_mb,
            file_mb=self.sandbox.file_mb,
            network=self.sandbox.network,
        )
        proc.stdin.write(frame(WorkerSetup(kind=self.kind, context=self.ctx, jail=spec), self._encoder))
        worker.reader = asyncio.create_task(self._read(worker), name=f"env-worker-{slot}")
        self.counts["workers_started"] += 1
        try:
            ready: WorkerReady = await asyncio.wait_for(asyncio.shield(worker.ready), START_TIMEOUT_S)
        except (TimeoutError, EnvFailure) as exc:
            await self._kill(worker, "worker_lost", "it did not start")
            raise EnvFailure(
                "worker_lost", f"environment worker {slot} did not start ({exc}); see its log"
            ) from None
        self.jail_reports.append(ready.jail)
        if ready.jail.missing:
            log.warning("environment worker %d runs without: %s", slot, "; ".join(ready.jail.missing))
        self.counts["jail_netns"] = int(ready.jail.netns)
        self.counts["jail_landlock_abi"] = ready.jail.landlock
        return worker

    def _log_file(self, slot: int):
        if self.log_dir is None:
            return asyncio.subprocess.DEVNULL
        self.log_dir.mkdir(parents=True, exist_ok=True)
        return open(self.log_dir / f"env-{self.name}-{slot}.log", "ab")  # noqa: SIM115 (the worker's stderr)

    async def _read(self, worker: _Worker) -> None:
        """Replies in, until the pipe closes; then every pending call is `worker_lost`."""
        stream = worker.proc.stdout
        try:
            while True:
                head = await stream.readexactly(HEADER.size)
                (size,) = HEADER.unpack(head)
                if size > MAX_FRAME_BYTES:
                    break
                msg = self._decoder.decode(await stream.readexactly(size))
                if isinstance(msg, WorkerReady):
                    if not worker.ready.done():
                        worker.ready.set_result(msg)
                elif (fut := worker.pending.pop(msg.call_id, None)) is not None and not fut.done():
                    fut.set_result(msg)
        except (asyncio.IncompleteReadError, msgspec.DecodeError, ConnectionError):
            pass
        if worker.alive:  # it died on its own (or sent garbage)
            self.counts["worker_deaths"] += 1
            await self._kill(worker, "worker_lost", "its process exited")

    async def _kill(self, worker: _Worker, kind: str, why: str) -> None:
        """End `worker` (SIGKILL by pid, its own process group), fail its calls, forget it."""
        worker.alive = False
        if self.workers.get(worker.slot) is worker:
            del self.workers[worker.slot]
        if worker.proc.returncode is None:
            try:
                os.killpg(worker.proc.pid, 9)
            except ProcessLookupError:
                pass
        await worker.proc.wait()
        code = worker.proc.returncode
        for fut in [worker.ready, *worker.pending.values()]:
            if not fut.done():
                fut.set_exception(
                    EnvFailure(
                        kind, f"environment worker {worker.slot} (pid {worker.proc.pid}): {why}, exit {code}"
                    )
                )
        worker.pending.clear()
        if worker.log_file not in (None, asyncio.subprocess.DEVNULL):
            worker.log_file.close()
        shutil.rmtree(worker.workdir, ignore_errors=True)

    async def _least_loaded(self) -> _Worker:
        if self._starting is None:
            self._starting = asyncio.Lock()
        async with self._starting:  # one start at a time: concurrent opens share new workers
            for slot in range(self.num_workers):
                if slot not in self.workers:
                    self.workers[slot] = await self._start(slot)
        return min(self.workers.values(), key=lambda w: len(w.episodes))

    # ------------------------------------------------------------------ calls
    async def _call(self, worker: _Worker, call: EnvCall) -> EnvReply:
        if not worker.alive:
            raise EnvFailure(
                "worker_lost", f"environment worker {worker.slot} was replaced; the episode's state is gone"
            )
        fut = asyncio.get_running_loop().create_future()
        worker.pending[call.call_id] = fut
        if not self._send(worker, call):  # its process is gone; the reader has not seen it yet
            worker.pending.pop(call.call_id, None)
            self.counts["worker_deaths"] += 1
            await self._kill(worker, "worker_lost", "its process exited")
            raise EnvFailure(
                "worker_lost", f"environment worker {worker.slot} exited; the episode's state is gone"
            )
        try:
            reply: EnvReply = await asyncio.wait_for(asyncio.shield(fut), self.timeout_s)
        except TimeoutError:
            worker.pending.pop(call.call_id, None)
            if not worker.alive:  # another call's timeout killed it at the same moment
                raise EnvFailure("worker_lost", f"environment worker {worker.slot} was killed") from None
            self.counts["workers_killed"] += 1
            await self._kill(worker, "worker_lost", f"killed: a call took longer than {self.timeout_s:g} s")
            raise EnvFailure(
                "timeout", f"{call.op} took longer than env.step_timeout_s = {self.timeout_s:g}"
            ) from None
        if reply.kind:
            raise EnvFailure(reply.kind, reply.error, reply.exc_type)
        return reply

    async def open(self, start: EpisodeStart) -> tuple[int, Observation]:
        worker = await self._least_loaded()
        handle = next(self._ids)
        worker.episodes.add(handle)
        self.episode_worker[handle] = worker
        reply = await self._call(
            worker, EnvCall(call_id=next(self._calls), op="open", episode=handle, start=start)
        )
        assert reply.observation is not None
        return handle, reply.observation

    async def step(self, handle: int, action: Action) -> StepResult:
        worker = self.episode_worker[handle]
        reply = await self._call(
            worker, EnvCall(call_id=next(self._calls), op="step", episode=handle, action=action)
        )
        assert reply.result is not None
        return reply.result

    async def close_episode(self, handle: int) -> None:
        worker = self.episode_worker.pop(handle, None)
        if worker is None:
            return
        worker.episodes.discard(handle)
        if worker.alive:  # no reply awaited: closing is best effort, the episode is over either way
            self._send(worker, EnvCall(call_id=next(self._calls), op="close", episode=handle))

    def _send(self, worker: _Worker, call: EnvCall) -> bool:
        """Write `call` to `worker`; False when its pipe is already closed (the process died and
        the reader has not noticed yet: it will count and replace the worker)."""
        stdin = worker.proc.stdin
        if stdin.is_closing():
            return False
        try:
            stdin.write(frame(call, self._encoder))
        except (RuntimeError, ConnectionError):
            return False
        return True

    async def aclose(self) -> None:
        for worker in list(self.workers.values()):
            await self._kill(worker, "worker_lost", "the pool closed")
            if worker.reader is not None:
                worker.reader.cancel()


def _worker_env(workdir: str) -> dict[str, str]:
    """A worker's environment: what Python needs, none of the parent's secrets."""
    keep = ("PATH", "LANG", "LC_ALL", "PYTHONPATH", "PYTHONHASHSEED", "VIRTUAL_ENV")
    env = {k: os.environ[k] for k in keep if k in os.environ}
    env.update(HOME=workdir, TMPDIR=workdir, PYTHONDONTWRITEBYTECODE="1", PYTHONUNBUFFERED="1")
    cwd = os.getcwd()  # plugins named by a path from the run's directory (`examples.x:f`) import from it
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [env.get("PYTHONPATH", ""), cwd]))
    return env
