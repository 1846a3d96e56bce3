"""Child processes as the launcher sees them: start one, judge its health, reap it.

Place in the data flow: the launcher (`scheduler/service.py`) starts the learner and the
generators here, records in `Child` what it hears from each (Hello, last message), and asks
`health` on every supervision tick whether a child has exited or fallen silent; what to do about
it (restart a generator, fail the run) is the launcher's decision. Only processes started here are
ever signalled, by pid.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

# How often a reaper looks for the exit status of a process that was killed or exited.
REAP_POLL_S = 0.05


@dataclass
class Child:
    peer_id: str
    role: str
    proc: subprocess.Popen
    log_path: Path
    ready: bool = False
    outstanding: int = 0
    stopping: bool = False
    last_seen: float = field(default_factory=time.monotonic)
    spawned: float = field(default_factory=time.monotonic)
    slot: str = ""  # generators: the slot this process serves (supervision.py)
    last_error: str = ""  # a generator's Fatal: supervision kills (if need be) and restarts it

    def tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


def start_child(
    peer_id: str, role: str, module: str, *, ctrl_address: str, run_dir: Path, extra: dict[str, str]
) -> Child:
    """`python -m module` with the child arguments of `asyncrl.runtime`; output to logs/<peer>.log."""
    logs = run_dir / "logs"
    logs.mkdir(exist_ok=True)
    log_path = logs / f"{peer_id}.log"
    cmd = [
        sys.executable,
        "-m",
        module,
        "--ctrl",
        ctrl_address,
        "--peer-id",
        peer_id,
        "--run-dir",
        str(run_dir),
    ]
    for k, v in extra.items():
        cmd += ["--extra", f"{k}={v}"]
    with open(log_path, "ab") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    return Child(peer_id, role, proc, log_path)


def health(child: Child, *, heartbeat_timeout_s: float, startup_timeout_s: float) -> str | None:
    """Why `child` is dead or hung (a phrase that follows its name), or None while it is fine.

    A generator that never says Hello within `startup_timeout_s` counts as hung too (the learner's
    start-up has its own wait in the launcher).
    """
    if child.last_error:
        # It said Fatal: dead for our purposes, whether or not its process has exited yet.
        return f"failed: {child.last_error}"
    code = child.proc.poll()
    if code is not None:
        return f"exited with code {code} (pid {child.proc.pid}).\nLast lines of {child.log_path}:\n{child.tail()}"
    if child.ready:
        silent_s = time.monotonic() - child.last_seen
        if silent_s > heartbeat_timeout_s:
            return (
                f"sent nothing for {silent_s:.0f} s (pid {child.proc.pid}; monitor.heartbeat_timeout_s = "
                f"{heartbeat_timeout_s:g}): it is hung; see {child.log_path}"
            )
    elif child.role == "generator" and time.monotonic() - child.spawned > startup_timeout_s:
        return (
            f"did not say Hello within {startup_timeout_s:.0f} s (pid {child.proc.pid}); see {child.log_path}"
        )
    return None


async def reap(child: Child) -> None:
    """Wait for the exit status of a child that exited or was SIGKILLed (which cannot be ignored)."""
    while child.proc.poll() is None:
        await asyncio.sleep(REAP_POLL_S)  # waiting for an exit code; there is no message to wait for
