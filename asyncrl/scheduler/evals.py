"""Background evaluation, the launcher's half (`eval.every`; docs/monitor.md, "Evaluation curve").

Place in the data flow: the learner writes a due version's weights and says so (`EvalDue`); the
launcher hands it here (`submit`). One evaluator process (`python -m asyncrl.evaluator`) runs at
a time, at a lower CPU priority than training (`eval.nice`, and on Linux the idle scheduling
class, `eval.idle_class`); versions that come due meanwhile
wait, at most `eval.max_pending` of them (past that the oldest waiting one is skipped and its
weights removed), so evaluation never holds training back. Each result becomes an `eval` record and a point of the
curve (`curve`), kept in summary.json; at the end of a run `drain` waits for what is left, up to a
deadline. A failed evaluation is an event, not a failed run.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import sys
from collections import deque
from collections.abc import Callable
from functools import partial
from pathlib import Path

from asyncrl.messages import EvalDue


def lower_priority(nice: int, *, idle_class: bool) -> None:
    """In the evaluator's process before it runs: nice it by `nice` and, where the platform has it
    (Linux) and `idle_class` says so, move it to SCHED_IDLE, where it runs only on a core that every
    normal-class process leaves idle (a niced process still takes a share of a busy core)."""
    if nice:
        os.nice(nice)
    if idle_class and hasattr(os, "SCHED_IDLE"):
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))


class BackgroundEvals:
    def __init__(
        self,
        run_dir: Path,
        *,
        max_pending: int,
        nice: int = 10,
        idle_class: bool = True,
        on_result: Callable[[dict], None],
        on_event: Callable[[str], None],
        command: tuple[str, ...] = (sys.executable, "-m", "asyncrl.evaluator"),
    ) -> None:
        self.run_dir = Path(run_dir)
        self.max_pending = max_pending
        self.nice = nice
        self.idle_class = idle_class
        self.on_result = on_result
        self.on_event = on_event
        self.command = command
        self.pending: deque[EvalDue] = deque()
        self.running: asyncio.Task | None = None
        self.process: asyncio.subprocess.Process | None = None
        self.curve: dict[int, dict] = {}  # version -> its result (a resumed run's earlier ones too)
        self.skipped: list[int] = []
        self.failed: list[int] = []
        self.idle = asyncio.Event()
        self.idle.set()

    def restore(self, records: list[dict], *, up_to: int) -> None:
        """A resumed run keeps its curve: the `eval` records of versions up to `up_to` (the
        checkpoint it resumes from; later ones are evaluated again)."""
        for r in records:
            if r.get("version", up_to + 1) <= up_to:
                self.curve[int(r["version"])] = {k: v for k, v in r.items() if k not in ("type", "time_s")}

    def submit(self, due: EvalDue) -> None:
        self.pending.append(due)
        while len(self.pending) > self.max_pending:
            dropped = self.pending.popleft()
            shutil.rmtree(dropped.path, ignore_errors=True)
            self.skipped.append(dropped.version)
            self.on_event(
                f"evaluation of version {dropped.version} skipped: {self.max_pending} newer versions "
                "wait for the evaluator (eval.max_pending)"
            )
        self._next()

    def _next(self) -> None:
        if self.running is None and self.pending:
            self.idle.clear()
            self.running = asyncio.create_task(self._run(self.pending.popleft()), name="launcher-eval")
        elif self.running is None:
            self.idle.set()

    async def _run(self, due: EvalDue) -> None:
        try:
            result = await self._evaluate(due)
            if result is not None:
                self.curve[due.version] = result
                self.on_result(result)
        finally:
            self.running = None
            self.process = None
            self._next()

    async def _evaluate(self, due: EvalDue) -> dict | None:
        args = (*self.command, str(self.run_dir), str(due.version), due.path)
        self.process = await asyncio.create_subprocess_exec(
            *args,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            preexec_fn=partial(lower_priority, self.nice, idle_class=self.idle_class),
        )
        out, err = await self.process.communicate()
        code = self.process.returncode
        lines = out.decode(errors="replace").strip().splitlines()
        try:
            if code == 0 and lines:
                return json.loads(lines[-1])
        except ValueError:
            pass
        shutil.rmtree(due.path, ignore_errors=True)
        self.failed.append(due.version)
        said = (err.decode(errors="replace").strip().splitlines() or [f"exit code {code}"])[-1]
        self.on_event(f"evaluation of version {due.version} failed: {said}")
        return None

    async def drain(self, timeout_s: float) -> None:
        """Wait for the waiting and running evaluations, at most `timeout_s`; then stop them."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.idle.wait(), timeout_s)
        if not self.idle.is_set():
            self.on_event(f"background evaluation unfinished after {timeout_s:g} s at the end of the run")
        await self.close()

    async def close(self) -> None:
        """Stop the running evaluator (this launcher's own child) and drop what waits."""
        for due in self.pending:
            shutil.rmtree(due.path, ignore_errors=True)
        self.pending.clear()
        if self.process is not None and self.process.returncode is None:
            self.process.kill()
        if self.running is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self.running

    def points(self) -> list[dict]:
        return [self.curve[v] for v in sorted(self.curve)]
