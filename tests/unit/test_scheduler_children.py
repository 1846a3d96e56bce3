"""Supervision talks to worker handles only: health and the stop sequence against a fake handle
(no processes), so a second spawner (workers joining over TCP) gets the same supervision."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from asyncrl.scheduler.children import Child, health, stop_all
from asyncrl.scheduler.spawner import LocalProcess, WorkerHandle


class FakeWorker:
    """Exits when told to by `exit_on` ("terminate" or "kill"), or never."""

    def __init__(self, pid: int, log_path: Path, *, exit_on: str = "kill") -> None:
        self.pid = pid
        self.log_path = log_path
        self.exit_on = exit_on
        self.code: int | None = None
        self.calls: list[str] = []

    def exit_code(self) -> int | None:
        return self.code

    def terminate(self) -> None:
        self.calls.append("terminate")
        if self.exit_on == "terminate":
            self.code = -15

    def kill(self) -> None:
        self.calls.append("kill")
        self.code = -9

    async def wait(self) -> int:
        assert self.code is not None
        return self.code


def test_both_handles_satisfy_the_protocol():
    handle: WorkerHandle = FakeWorker(1, Path("x"))
    assert isinstance(handle.pid, int)
    assert {"pid", "log_path", "exit_code", "terminate", "kill", "wait"} <= set(dir(LocalProcess))


def test_health_names_exit_silence_and_a_missing_hello(tmp_path):
    log = tmp_path / "gen-0.log"
    log.write_text("line 1\nTraceback: boom\n")
    worker = FakeWorker(4242, log)
    child = Child("gen-0", "generator", worker, ready=True)
    kw = {"heartbeat_timeout_s": 5.0, "startup_timeout_s": 60.0}
    assert health(child, **kw) is None
    child.last_seen = time.monotonic() - 9
    assert "sent nothing for 9 s (pid 4242; monitor.heartbeat_timeout_s = 5)" in health(child, **kw)
    worker.code = 3
    reason = health(child, **kw)
    assert reason.startswith("exited with code 3 (pid 4242).") and reason.endswith("Traceback: boom")
    child.last_error = "RuntimeError: x"
    assert health(child, **kw) == "failed: RuntimeError: x"

    late = Child("gen-1", "generator", FakeWorker(7, log))
    late.spawned = time.monotonic() - 61
    assert health(late, **kw).startswith("did not say Hello within 60 s (pid 7)")
    late.role = "learner"  # the learner's start-up has the launcher's own wait
    assert health(late, **kw) is None


def test_stop_all_escalates_only_for_workers_still_running(tmp_path):
    gone = FakeWorker(1, tmp_path / "a")
    gone.code = 0
    polite = FakeWorker(2, tmp_path / "b", exit_on="terminate")
    stubborn = FakeWorker(3, tmp_path / "c", exit_on="kill")
    children = [Child(f"w{w.pid}", "generator", w) for w in (gone, polite, stubborn)]
    asyncio.run(stop_all(children, grace_s=0.0, term_grace_s=0.0))
    assert gone.calls == [] and polite.calls == ["terminate"] and stubborn.calls == ["terminate", "kill"]


def test_a_process_ended_by_a_signal_is_named_by_its_signal():
    """Issue #36: "learner learner exited with code -9" did not say it was killed, nor how to go on."""
    from asyncrl.scheduler.children import exit_phrase

    assert exit_phrase(-9) == "was killed by SIGKILL (exit code -9)"
    assert exit_phrase(-15) == "was killed by SIGTERM (exit code -15)"
    assert exit_phrase(3) == "exited with code 3"
