"""The reward worker pool: sync rewards that may be slow or hang, run in worker processes.

Data flow: Scorer.score -> `RewardPool.run(reward_index, samples)` -> chunks of samples over a
pipe to idle workers (worker.py) -> one result frame per sample back -> `list[float | RewardFailure]`.

- Workers are fresh interpreters (`python -c`, never a fork: the parent holds torch threads, and
  not multiprocessing's spawn either, which would re-import the parent's `__main__` and so torch).
  Each builds the reward functions from their configs itself, so rewards need not pickle; it
  gets the parent's sys.path, so `pkg.mod:fn` paths import as they do in the parent. Once the
  pool's fork server (zygote.py, itself such an interpreter, with the rewards' modules imported)
  is ready, further workers are forked from it: milliseconds, not an interpreter start.
- One result per sample pins a hang to one sample: a call still running `timeout_s` after its
  sample reached the pool (`run()`), or half that after the call began if later, is a `timeout`
  failure; its worker is SIGKILLed and replaced, and the rest of its chunk re-queued. Start-up
  has its own bound, so slow start-up imports are not a timeout.
- A reward that raises is a `raised` failure, one that returns a non-finite or non-number value
  `invalid`; the worker carries on.
- Pipes are non-blocking and read by `loop.add_reader`, so nothing blocks the event loop.
- A hung call costs its timeout once, overlapped with everything else: a call running past
  `slow_s` while its process sleeps or blocks (not runnable: /proc state other than R; a call
  that computes is only slow, and more workers would only share the CPU) is presumed stuck; the samples queued behind it in its chunk go back to the front of
  the queue for other workers, and the pool starts workers beyond `workers` (up to `max_workers`)
  so that `workers` are free of stuck calls while work waits. Such a worker is retired once its
  call ends (it would go on with the samples taken from it); extra workers retire when idle.
- `workers` processes; they start at `start()` or on the first `run()`, and once in use
  a killed one is replaced at once. Workers start from the thread that runs the event loop:
  PR_SET_PDEATHSIG fires when the *thread* that started a worker ends.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import subprocess
import sys
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

from asyncrl.config_sections import RewardConfig
from asyncrl.rewards.base import RewardFailure, RewardInput, describe_exception
from asyncrl.rewards.worker import BOOT_CODE, PATH_ENV, READ_BYTES, Chunk, Init, Ready, Result, frame, to_wire
from asyncrl.rewards.zygote import ForkedProc, ForkServer

_MAX_CHUNK = 64  # samples per frame: large enough to amortise a frame, small enough to balance
_CHUNKS_PER_WORKER = 4  # a batch is cut into about this many chunks per worker (load balance)
# A call running this long (or half the timeout, if less) while its process is not computing is
# presumed stuck: its chunk's other samples go to other workers, and another worker may start.
# Reward calls are meant to take milliseconds; one that only waited long (a slow remote service)
# costs a worker fork, nothing else. Every hang is found this long after its call began, so this
# is what a hang costs beyond its timeout.
_SLOW_CALL_S = 0.25


@dataclass(eq=False)
class _Job:
    """One `run()` call: its samples and results as they arrive."""

    samples: Sequence[RewardInput]
    results: list[Any]
    remaining: int
    future: asyncio.Future
    submitted: float  # when run() was called, on the loop's clock: the samples' timeouts count from it


@dataclass(eq=False)
class _Task:
    """Consecutive samples of one job, sent to one worker as one frame."""

    job: _Job
    reward_index: int
    positions: list[int]


@dataclass(eq=False)
class _Worker:
    proc: subprocess.Popen | ForkedProc
    to_fd: int
    from_fd: int
    call_started: float  # when the current call (or start-up) began, on the loop's clock
    inbuf: bytearray = field(default_factory=bytearray)
    outbuf: bytearray = field(default_factory=bytearray)
    ready: bool = False
    task: _Task | None = None
    num_done: int = 0  # results received for `task`
    timer: asyncio.TimerHandle | None = None
    slow_timer: asyncio.TimerHandle | None = None
    stuck: bool = False  # its current call has run past `slow_s`
    robbed: bool = False  # samples of its chunk went to others: retire it when its call ends


def _computing(pid: int) -> bool:
    """Whether process `pid` is running or waiting for a CPU (state R in /proc) rather than
    sleeping or blocked: a call that computes is slow, one that waits (a lock, a socket, a sleep)
    is presumed stuck. False where /proc cannot say."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return False
    return stat[stat.rfind(b")") + 2 : stat.rfind(b")") + 3] == b"R"


class RewardPool:
    """Up to `workers` processes running the sync rewards `specs`; see the module docstring."""

    def __init__(
        self,
        specs: Sequence[RewardConfig],
        *,
        workers: int,
        timeout_s: float,
        startup_timeout_s: float = 120.0,
        max_workers: int | None = None,
    ) -> None:
        if workers < 1:
            raise ValueError(f"task.scoring.workers = {workers}: the reward pool needs at least 1 worker")
        if max_workers is not None and max_workers < workers:
            raise ValueError(
                f"task.scoring.max_workers = {max_workers} is below task.scoring.workers = {workers}"
            )
        if not (timeout_s > 0 and math.isfinite(timeout_s)):
            raise ValueError(f"task.scoring.timeout_s = {timeout_s} must be a positive number of seconds")
        self.specs = list(specs)
        self.num_workers = workers
        self.max_workers = workers if max_workers is None else max_workers
        self.timeout_s = timeout_s
        self.slow_s = min(_SLOW_CALL_S, timeout_s / 2)
        self.num_stuck = 0  # calls presumed stuck (past slow_s) so far
        self.startup_timeout_s = startup_timeout_s
        self.num_timeouts = 0  # workers killed for a call past timeout_s
        self.num_worker_exits = 0  # workers that died on their own
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(Ready | Result)
        self._init_frame = frame(self._encoder.encode(Init(specs=self.specs)))
        # Workers beyond the first are forked from here when it is ready (zygote.py); it starts
        # with the first workers, if the pool may grow or replace a worker.
        self._server: ForkServer | None = None
        self._workers: list[_Worker] = []
        self._dead: list[subprocess.Popen | ForkedProc] = []  # killed, not yet reaped
        self._queue: deque[_Task] = deque()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False
        self._start_failures = 0  # in a row, since the last worker became ready or run() began
        self._start_error = ""

    @property
    def pids(self) -> list[int]:
        """Process ids of the live workers."""
        return [w.proc.pid for w in self._workers]

    def start(self) -> None:
        """Start every worker now rather than on the first `run()`."""
        self._check_open()
        while len(self._workers) < self.num_workers:
            self._spawn()

    async def run(self, reward_index: int, samples: Sequence[RewardInput]) -> list[float | RewardFailure]:
        """Reward `self.specs[reward_index]` of every sample, in order; failures in place."""
        self._check_open()
        if not 0 <= reward_index < len(self.specs):
            raise IndexError(f"reward_index {reward_index} not in 0..{len(self.specs) - 1}")
        if not samples:
            return []
        loop = asyncio.get_running_loop()
        self._bind(loop)
        job = _Job(samples, [None] * len(samples), len(samples), loop.create_future(), loop.time())
        size = max(1, min(_MAX_CHUNK, -(-len(samples) // (self.num_workers * _CHUNKS_PER_WORKER))))
        for first in range(0, len(samples), size):
            positions = list(range(first, min(first + size, len(samples))))
            self._queue.append(_Task(job, reward_index, positions))
        self._start_failures = 0
        self._pump()
        return await job.future  # cancelling run() cancels the future; its queued chunks are dropped

    def close(self) -> None:
        """Kill and reap every worker; pending `run()` calls get failures. Idempotent."""
        self._shut()
        self._reap(block=True)

    async def aclose(self) -> None:
        """`close()` with the reaping off the event loop."""
        self._shut()
        await asyncio.to_thread(self._reap, block=True)

    # -------------------------------------------------------------- internals

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the reward pool is closed")

    def _shut(self) -> None:
        if self._closed:
            return
        self._closed = True
        pending: list[tuple[_Job, list[int]]] = [(t.job, t.positions) for t in self._queue]
        pending += [(w.task.job, w.task.positions[w.num_done :]) for w in self._workers if w.task]
        self._queue.clear()
        for worker in list(self._workers):
            self._retire(worker)
        if self._server is not None and (proc := self._server.close()) is not None:
            self._dead.append(proc)
        closed = RewardFailure("raised", "PoolClosed: the reward pool was closed")
        for job, positions in pending:
            for pos in positions:
                self._deliver(job, pos, closed)

    def _reap(self, block: bool = False) -> None:
        if block:
            for proc in self._dead:
                proc.wait()
        self._dead = [proc for proc in self._dead if proc.poll() is None]

    def _bind(self, loop: asyncio.AbstractEventLoop) -> None:
        """Watch the workers' pipes on `loop` (the loop of the latest run())."""
        if self._loop is loop:
            return
        old, self._loop = self._loop, loop
        for w in self._workers:
            if old is not None and not old.is_closed():
                old.remove_reader(w.from_fd)
                old.remove_writer(w.to_fd)
            for timer in (w.timer, w.slow_timer):
                if timer is not None:
                    timer.cancel()
            w.timer = w.slow_timer = None
            self._watch(w)

    def _watch(self, w: _Worker) -> None:
        assert self._loop is not None
        self._loop.add_reader(w.from_fd, self._on_readable, w)
        if w.outbuf:
            self._loop.add_writer(w.to_fd, self._on_writable, w)
        if not w.ready:
            w.call_started = self._loop.time()
        self._arm(w)
        if w.task is not None:
            self._arm_slow(w)

    def _spawn(self) -> None:
        to_read, to_write = os.pipe()
        from_read, from_write = os.pipe()
        if self._server is None:
            self._server = ForkServer(self._init_frame)
        try:
            proc = self._server.fork(to_read, from_write) or self._start(to_read, from_write)
        except OSError as exc:
            for fd in (to_read, to_write, from_read, from_write):
                os.close(fd)
            self._start_failures += 1
            self._start_error = f"could not start a reward worker: {describe_exception(exc)}"
            return
        os.close(to_read)
        os.close(from_write)
        os.set_blocking(to_write, False)
        os.set_blocking(from_read, False)
        started = self._loop.time() if self._loop is not None else 0.0
        w = _Worker(proc, to_write, from_read, started)
        self._workers.append(w)
        self._write(w, self._init_frame)
        if self._loop is not None:
            self._watch(w)

    @staticmethod
    def _start(to_read: int, from_write: int) -> subprocess.Popen:
        """A fresh interpreter serving these pipe ends."""
        paths = [os.path.abspath(p) if p else os.getcwd() for p in sys.path]
        return subprocess.Popen(
            [sys.executable, "-c", BOOT_CODE, str(os.getpid()), str(to_read), str(from_write)],
            pass_fds=(to_read, from_write),
            stdin=subprocess.DEVNULL,  # stdout/stderr: inherited, so rewards' prints reach our log
            env={**os.environ, PATH_ENV: json.dumps(paths)},
        )

    def _retire(self, w: _Worker) -> None:
        """Kill `w` (if still running), stop watching it and close its pipes."""
        self._workers.remove(w)
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(w.from_fd)
            self._loop.remove_writer(w.to_fd)
        for timer in (w.timer, w.slow_timer):
            if timer is not None:
                timer.cancel()
        os.close(w.to_fd)
        os.close(w.from_fd)
        if w.proc.poll() is None:
            w.proc.kill()
            self._dead.append(w.proc)

    def _pump(self) -> None:
        """Hand queued chunks to idle workers; keep the pool at `num_workers` processes."""
        if self._closed:
            return
        while self._queue and self._queue[0].job.future.done():
            self._queue.popleft()
        for w in self._workers:
            if not self._queue:
                break
            if w.ready and w.task is None:
                self._send(w, self._queue.popleft())
                while self._queue and self._queue[0].job.future.done():
                    self._queue.popleft()
        # Once in use, the pool keeps `num_workers` running, so a killed worker's replacement
        # starts (and imports) before the next batch needs it; and while work waits, as many
        # more as are stuck on a call (up to max_workers), so a hung call holds up nothing else.
        while self._start_failures < self.num_workers and (
            len(self._workers) < self.num_workers
            or (len(self._workers) < self.max_workers and self._free_capacity() < self._wanted_capacity())
        ):
            self._spawn()
        if not self._queue:  # extra workers retire when idle
            idle = [w for w in self._workers if w.ready and w.task is None]
            for w in idle[: max(0, self._free_capacity() - self.num_workers)]:
                self._retire(w)
        if self._queue and not self._workers:  # nothing can serve them: fail rather than wait
            failure = RewardFailure("raised", f"WorkerStartFailed: {self._start_error}")
            while self._queue:
                task = self._queue.popleft()
                for pos in task.positions:
                    self._deliver(task.job, pos, failure)
        self._reap()

    def _free_capacity(self) -> int:
        """Workers not stuck on a call."""
        return sum(1 for w in self._workers if not w.stuck)

    def _wanted_capacity(self) -> int:
        """Workers free of stuck calls that the pool wants: `num_workers`, always (a stuck call's
        worker is replaced at once, so ordinary samples never wait for a process to start); while
        any call is stuck, one more per queued sample (up to max_workers): a hang among them is
        found out by its own worker, at once and in parallel, not one after another."""
        if len(self._workers) == self._free_capacity():  # nothing stuck
            return self.num_workers
        return self.num_workers + sum(len(t.positions) for t in self._queue)

    def _send(self, w: _Worker, task: _Task) -> None:
        assert self._loop is not None
        w.task, w.num_done = task, 0
        samples = [to_wire(task.job.samples[pos]) for pos in task.positions]
        self._write(w, frame(self._encoder.encode(Chunk(task.reward_index, samples))))
        w.call_started = self._loop.time()
        self._arm(w)
        self._arm_slow(w)

    def _arm_slow(self, w: _Worker) -> None:
        """Watch `w`'s current call (it began at `w.call_started`) for running past `slow_s`."""
        if w.slow_timer is not None:
            w.slow_timer.cancel()
        w.stuck = False
        assert self._loop is not None
        w.slow_timer = self._loop.call_at(w.call_started + self.slow_s, self._on_slow, w)

    def _on_slow(self, w: _Worker) -> None:
        """`w`'s call has run past `slow_s`: the rest of its chunk goes to others, and the pool
        may grow while work waits (`_pump`)."""
        w.slow_timer = None
        if w not in self._workers or w.task is None or not self._read(w) or w.task is None:
            return  # gone, or the results already in the pipe finished its chunk
        if self._loop is not None and self._loop.time() < w.call_started + self.slow_s:
            self._arm_slow(w)  # a result came in the pipe: a new call began
            return
        if _computing(w.proc.pid):  # slow, not stuck: more workers would only share the CPU
            assert self._loop is not None
            w.slow_timer = self._loop.call_later(self.slow_s, self._on_slow, w)
            return
        w.stuck = True
        self.num_stuck += 1
        task = w.task
        rest = task.positions[w.num_done + 1 :]
        if rest:
            del task.positions[w.num_done + 1 :]
            w.robbed = True
            self._queue.appendleft(_Task(task.job, task.reward_index, rest))
        # While a call is stuck, every queued sample goes alone, to a worker of its own (the pool
        # grows, `_wanted_capacity`): another hang among them is found at once, in parallel.
        self._queue = deque(_Task(t.job, t.reward_index, [p]) for t in self._queue for p in t.positions)
        self._pump()

    def _write(self, w: _Worker, data: bytes) -> None:
        if not w.outbuf:
            try:
                data = data[os.write(w.to_fd, data) :]
            except BlockingIOError:
                pass
            except BrokenPipeError:
                return  # the worker is gone; its EOF on the other pipe reports it
            if not data:
                return
            if self._loop is not None:
                self._loop.add_writer(w.to_fd, self._on_writable, w)
        w.outbuf += data

    def _on_writable(self, w: _Worker) -> None:
        try:
            del w.outbuf[: os.write(w.to_fd, w.outbuf)]
        except BlockingIOError:
            return
        except BrokenPipeError:
            w.outbuf.clear()
        if not w.outbuf and self._loop is not None:
            self._loop.remove_writer(w.to_fd)

    def _read(self, w: _Worker) -> bool:
        """Take what the pipe holds now; False once the worker is gone."""
        while True:
            try:
                data = os.read(w.from_fd, READ_BYTES)
            except BlockingIOError:
                return True
            if not data:
                self._on_exit(w)
                return False
            w.inbuf += data
            if not self._parse(w):
                return False
            if len(data) < READ_BYTES:
                return True

    def _on_readable(self, w: _Worker) -> None:
        self._read(w)

    def _parse(self, w: _Worker) -> bool:
        buf, offset = w.inbuf, 0
        while len(buf) - offset >= 4:
            size = int.from_bytes(buf[offset : offset + 4], "little")
            if len(buf) - offset - 4 < size:
                break
            msg = self._decoder.decode(buf[offset + 4 : offset + 4 + size])
            offset += 4 + size
            if isinstance(msg, Ready):
                w.ready = True
                self._start_failures = 0
                if w.timer is not None:  # the start-up deadline no longer applies
                    w.timer.cancel()
                    w.timer = None
                self._pump()
            else:
                self._on_result(w, msg)
        del buf[:offset]
        return w in self._workers

    def _on_result(self, w: _Worker, msg: Result) -> None:
        task = w.task
        assert task is not None, "a reward worker sent a result it was not asked for"
        value = msg.value if not msg.kind else RewardFailure(msg.kind, msg.detail)  # type: ignore[arg-type]
        self._deliver(task.job, task.positions[w.num_done], value)
        w.num_done += 1
        w.call_started = self._loop.time() if self._loop is not None else 0.0
        if w.num_done < len(task.positions):
            self._arm_slow(w)
            return
        w.task = None
        w.stuck = False
        if w.slow_timer is not None:
            w.slow_timer.cancel()
            w.slow_timer = None
        if w.robbed:  # it would go on with the samples given to others
            self._retire(w)
        self._pump()

    @staticmethod
    def _deliver(job: _Job, pos: int, value: float | RewardFailure) -> None:
        if job.future.done():
            return  # run() was cancelled or the pool closed
        job.results[pos] = value
        job.remaining -= 1
        if job.remaining == 0:
            job.future.set_result(job.results)

    def _deadline(self, w: _Worker) -> float:
        """When `w`'s current call (or start-up) is cut off, on the loop's clock. A call ends
        `timeout_s` after its sample reached the pool, so samples queued behind a hang (found only
        `slow_s` after its call began) do not push their own hangs' ends later: a batch's hangs
        end together. A call that began late still runs at least half the timeout."""
        if not w.ready:
            return w.call_started + self.startup_timeout_s
        if w.task is None:
            return w.call_started + self.timeout_s
        return max(w.task.job.submitted + self.timeout_s, w.call_started + self.timeout_s / 2)

    def _arm(self, w: _Worker) -> None:
        if w.timer is None and self._loop is not None:
            w.timer = self._loop.call_at(self._deadline(w), self._on_timer, w)

    def _on_timer(self, w: _Worker) -> None:
        w.timer = None
        if w not in self._workers or not self._read(w):  # results already in the pipe count
            return
        if w.ready and w.task is None:
            return  # idle; re-armed by the next chunk
        assert self._loop is not None
        if self._loop.time() < self._deadline(w):
            self._arm(w)
        elif not w.ready:
            self._retire(w)
            self._start_failures += 1
            self._start_error = (
                f"a reward worker (pid {w.proc.pid}) did not finish building its rewards within "
                f"{self.startup_timeout_s}s"
            )
            self._pump()
        else:
            self.num_timeouts += 1
            self._fail_current(
                w,
                RewardFailure(
                    "timeout",
                    f"the call ran past task.scoring.timeout_s = {self.timeout_s}s; "
                    f"its worker (pid {w.proc.pid}) was killed and replaced",
                ),
            )

    def _on_exit(self, w: _Worker) -> None:
        """EOF from a worker that was not being retired: it died on its own."""
        code = w.proc.poll()
        status = "" if code is None or isinstance(w.proc, ForkedProc) else f" (status {code})"
        self.num_worker_exits += 1
        if w.task is not None:
            self._fail_current(
                w,
                RewardFailure(
                    "raised",
                    f"WorkerExited: the reward worker (pid {w.proc.pid}) exited while scoring this "
                    f"sample{status}; see its stderr in this process's log",
                ),
            )
            return
        if not w.ready:
            self._start_failures += 1
            self._start_error = (
                f"a reward worker (pid {w.proc.pid}) exited during start-up{status}; "
                "see its stderr in this process's log"
            )
        self._retire(w)
        self._pump()

    def _fail_current(self, w: _Worker, failure: RewardFailure) -> None:
        """The sample `w` is on fails; `w` is replaced; the rest of its chunk goes first in line."""
        task = w.task
        assert task is not None
        self._deliver(task.job, task.positions[w.num_done], failure)
        rest = task.positions[w.num_done + 1 :]
        self._retire(w)
        if rest:
            self._queue.appendleft(_Task(task.job, task.reward_index, rest))
        self._pump()
