"""Waiting on what a launched run does, never by sleeping: the helpers the integration tests share.

- `LineStream`: a process's output read line by line as it comes (a reader thread); a test waits
  with a deadline for a line that matches (the launcher prints "started <peer> (pid N)", "step
  k/n ...", its events and its errors), or for the process to end.
- `RunRecords`: the run's records as the launcher writes them, from the metrics PUB socket named
  in <run>/monitor.json, as `asyncrl monitor` reads them (`asyncrl.monitor.attach.Follower`: the
  records written before the subscription, and any a slow subscriber missed, come from
  metrics.jsonl by line number); a test waits with a deadline for a predicate over them.
- `wait_for_log_text`: a worker's log, woken by the kernel on every write to it (inotify), for
  what a worker reports nowhere else in time: the learner's rejected-frame count, which its
  metrics record carries only at the end of a step (test_fuzz needs it while a step is held).

Every wait blocks on something that happens (a line, a ZeroMQ message, a write) and has a
deadline only as a hang guard; a wait that cannot succeed any more (the process ended) fails at
once, saying what it waited for and showing the end of the output.
"""

from __future__ import annotations

import ctypes
import os
import re
import select
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import zmq

from asyncrl.monitor.attach import Follower, resolve_target

T = TypeVar("T")

# How long one blocking wait (on the PUB socket, on inotify) lasts before the test looks whether
# the launcher is still alive (a killed launcher sends no final record); an event ends it at once.
EXIT_CHECK_S = 1.0
TAIL_CHARS = 3000  # of output shown with a failed wait


class LineStream:
    """The lines `proc` writes on its stdout (start it with stdout=PIPE, stderr=STDOUT, text=True
    to see its errors too), read as they come by a daemon thread, which also keeps the pipe from
    filling up and blocking the process."""

    def __init__(self, proc: subprocess.Popen) -> None:
        assert proc.stdout is not None, "start the process with stdout=subprocess.PIPE"
        self.proc = proc
        self.lines: list[str] = []
        self.ended = False  # the pipe reached end of file: the process (and its children) closed it
        self._changed = threading.Condition()
        self._reader = threading.Thread(target=self._read, name=f"lines-{proc.pid}", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            with self._changed:
                self.lines.append(line)
                self._changed.notify_all()
        with self._changed:
            self.ended = True
            self._changed.notify_all()

    @property
    def text(self) -> str:
        with self._changed:
            return "".join(self.lines)

    def matches(self, pattern: str) -> list[re.Match]:
        """Every line so far that matches `pattern` (re.search), in order."""
        with self._changed:
            return [m for line in self.lines if (m := re.search(pattern, line))]

    def wait_for(self, pattern: str, *, timeout_s: float, what: str | None = None) -> re.Match:
        """The first line (from the start of the output) that matches `pattern`, once there is one."""
        what = what or repr(pattern)
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while True:
                if found := next((m for line in self.lines if (m := re.search(pattern, line))), None):
                    return found
                if self.ended:
                    raise AssertionError(f"the output ended before {what}:\n{self.tail()}")
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise AssertionError(
                        f"timed out after {timeout_s:g} s waiting for {what}:\n{self.tail()}"
                    )
                self._changed.wait(remaining)

    def wait_exit(self, *, timeout_s: float) -> int:
        """The process's exit code, once its output has ended and it has exited."""
        deadline = time.monotonic() + timeout_s
        with self._changed:
            if not self._changed.wait_for(lambda: self.ended, timeout=timeout_s):
                raise AssertionError(f"the process did not end within {timeout_s:g} s:\n{self.tail()}")
        return self.proc.wait(timeout=max(0.0, deadline - time.monotonic()))

    def tail(self) -> str:
        """The end of the output so far (shown with a failed wait)."""
        with self._changed:  # reentrant: also called inside the waits above
            return "".join(self.lines)[-TAIL_CHARS:]


class RunRecords:
    """The records of the live run in `run_dir`, in order, each once (`records`), following the
    launcher's metrics PUB socket. Make it once the launcher has printed "started learner": the
    stream (and monitor.json) is up from then on."""

    def __init__(self, run_dir: Path, lines: LineStream | None = None) -> None:
        target = resolve_target(str(run_dir))
        assert target.live and target.endpoint, f"{run_dir} has no live metrics stream"
        self.lines = lines  # the launcher's output: shown when a wait fails, and its exit noticed
        self.records: list[dict] = []
        self._zctx = zmq.Context()
        self._follower = Follower(target, self.records.append, zctx=self._zctx)
        self._follower.catch_up()  # what was written before the subscription

    def __enter__(self) -> RunRecords:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._follower.close()
        self._zctx.term()

    def of(self, kind: str) -> list[dict]:
        return [r for r in self.records if r["type"] == kind]

    @property
    def ended(self) -> bool:
        """The launcher wrote its final record (the stream ends with it)."""
        # The last record only: a resumed run's file also holds the first segment's final record.
        return any(r["type"] == "launcher" and r.get("final") for r in self.records[-1:])

    def wait_for(self, predicate: Callable[[RunRecords], T], *, timeout_s: float, what: str) -> T:
        """`predicate(self)` once it is truthy, re-evaluated as records arrive."""
        deadline = time.monotonic() + timeout_s
        sub = self._follower.sub
        while not (value := predicate(self)):
            if self.ended:
                self._fail(f"the run ended before {what}")
            if self.lines is not None and self.lines.proc.poll() is not None:
                self._follower.catch_up()  # the last records, in case PUB dropped some
                if value := predicate(self):
                    return value
                self._fail(f"the launcher exited (code {self.lines.proc.returncode}) before {what}")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self._fail(f"timed out after {timeout_s:g} s waiting for {what}")
            if sub.poll(int(1000 * min(remaining, EXIT_CHECK_S))):
                while True:
                    try:
                        frames = sub.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self._follower.on_frames(frames)  # fills a gap in the line numbers from the file
        return value

    def _fail(self, why: str) -> None:
        tail = self.lines.tail() if self.lines is not None else ""
        raise AssertionError(f"{why}\nlast records: {self.records[-5:]}\n{tail}")


IN_MODIFY = 0x2  # inotify(7): the watched file was written


def wait_for_log_text(
    path: Path, text: str, *, timeout_s: float, lines: LineStream | None = None, what: str | None = None
) -> None:
    """Until the file at `path` (it must exist) contains `text`: the file is read again each time
    the kernel reports a write to it. `lines`: the launcher's output, whose end fails the wait."""
    what = what or f"{text!r} in {path.name}"
    libc = ctypes.CDLL(None, use_errno=True)
    fd = libc.inotify_init1(os.O_CLOEXEC | os.O_NONBLOCK)
    if fd < 0:
        raise OSError(ctypes.get_errno(), "inotify_init1")
    try:
        if libc.inotify_add_watch(fd, os.fsencode(path), IN_MODIFY) < 0:
            raise OSError(ctypes.get_errno(), f"inotify_add_watch {path}")
        deadline = time.monotonic() + timeout_s
        # Watched first, read second: a write between the two is in the file or wakes the select.
        found = text in path.read_text(errors="replace")
        while not found:
            if lines is not None and lines.proc.poll() is not None:
                raise AssertionError(f"the launcher exited before {what}:\n{lines.tail()}")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}")
            if select.select([fd], [], [], min(remaining, EXIT_CHECK_S))[0]:
                os.read(fd, 64 * 1024)  # the events themselves say nothing more than "written"
                found = text in path.read_text(errors="replace")  # read again only when written
    finally:
        os.close(fd)
