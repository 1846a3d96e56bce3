"""Workers as the launcher sees them: what it heard from each, its health, and stopping them all.

Place in the data flow: the launcher (`scheduler/service.py`) starts each worker through a
spawner (`scheduler/spawner.py`), keeps its handle in a `Child` with what it hears from it (Hello,
the time of its last message, a Fatal), and asks `health` on every supervision tick whether a
child has exited or fallen silent; what to do about it (restart a generator, fail the run) is the
launcher's decision. Everything here talks to the `WorkerHandle`, never to a process.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from asyncrl.scheduler.spawner import WorkerHandle

# How often `stop_all` looks whether the workers it asked to stop have gone.
STOP_POLL_S = 0.05
# After SIGTERM, how long a worker gets before SIGKILL.
TERM_GRACE_S = 5.0


@dataclass
class Child:
    peer_id: str
    role: str
    handle: WorkerHandle
    ready: bool = False
    stopping: bool = False
    last_seen: float = field(default_factory=time.monotonic)
    spawned: float = field(default_factory=time.monotonic)
    slot: str = ""  # generators: the slot this process serves (supervision.py)
    last_error: str = ""  # a generator's Fatal: supervision kills (if need be) and restarts it

    @property
    def log_path(self) -> Path:
        return self.handle.log_path

    def tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


def exit_phrase(code: int) -> str:
    """How a process ended, in words: its signal's name when a signal ended it (code -N)."""
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"was killed by {name} (exit code {code})"
    return f"exited with code {code}"


def health(child: Child, *, heartbeat_timeout_s: float, startup_timeout_s: float) -> str | None:
    """Why `child` is dead or hung (a phrase that follows its name), or None while it is fine.

    A generator that never says Hello within `startup_timeout_s` counts as hung too (the learner's
    start-up has its own wait in the launcher).
    """
    if child.last_error:
        # It said Fatal: dead for our purposes, whether or not its process has exited yet.
        return f"failed: {child.last_error}"
    pid = child.handle.pid
    code = child.handle.exit_code()
    if code is not None:
        return f"{exit_phrase(code)} (pid {pid}).\nLast lines of {child.log_path}:\n{child.tail()}"
    if child.ready:
        silent_s = time.monotonic() - child.last_seen
        if silent_s > heartbeat_timeout_s:
            return (
                f"sent nothing for {silent_s:.0f} s (pid {pid}; monitor.heartbeat_timeout_s = "
                f"{heartbeat_timeout_s:g}): it is hung; see {child.log_path}"
            )
    elif child.role == "generator" and time.monotonic() - child.spawned > startup_timeout_s:
        return f"did not say Hello within {startup_timeout_s:.0f} s (pid {pid}); see {child.log_path}"
    return None


async def stop_all(children: Iterable[Child], *, grace_s: float, term_grace_s: float = TERM_GRACE_S) -> None:
    """Wait up to `grace_s` for the children (already told to shut down) to exit, then terminate
    the rest and wait `term_grace_s`, then kill what is left and wait as long again."""
    children = list(children)
    deadline = time.monotonic() + grace_s
    escalation: list[Callable[[WorkerHandle], None] | None] = [
        None,
        lambda h: h.terminate(),
        lambda h: h.kill(),
    ]
    for stop in escalation:
        alive = [c for c in children if c.handle.exit_code() is None]
        if not alive:
            return
        if stop is not None:
            for c in alive:
                stop(c.handle)
            deadline = time.monotonic() + term_grace_s
        while time.monotonic() < deadline and any(c.handle.exit_code() is None for c in alive):
            await asyncio.sleep(STOP_POLL_S)  # waiting for exit codes
