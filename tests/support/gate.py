"""A gate that a test opens and code in a run's child processes waits on: a named pipe.

The test makes the FIFO (the gate is shut) and opens the gate by holding the FIFO's write end
open (`Gate.open`, until `close`). A child waits with `wait_until_open`: a blocking open of the
read end, which the kernel completes once a writer exists, and at once for every later call while
the test holds it. One FIFO serves any number of waiting processes, including ones started after
the gate opened; nothing polls a file and nothing sleeps.

`GatedGenerator` (tests/support/gated_generator.py) is the plugin that uses it; the gate's FIFO
reaches it through the environment (`GATE_ENV`).
"""

from __future__ import annotations

import os
from pathlib import Path

GATE_ENV = "ASYNCRL_TEST_GATE"


class Gate:
    """The test's side of the gate: a FIFO at `path`, shut until `open()`."""

    def __init__(self, path: Path) -> None:
        self.path = path
        os.mkfifo(path, 0o600)
        self._writer: int | None = None

    def open(self) -> None:
        """Open the gate for every waiter, now and later; idempotent. O_RDWR, because opening a
        FIFO read-write never blocks on Linux (opening only its write end would wait for a
        reader), and the descriptor counts as the writer that completes the waiters' opens."""
        if self._writer is None:
            self._writer = os.open(self.path, os.O_RDWR)

    def close(self) -> None:
        """Drop the writer (a child that waits after this would wait forever); idempotent."""
        if self._writer is not None:
            os.close(self._writer)
            self._writer = None


def wait_until_open(path: str | os.PathLike) -> None:
    """Blocks until the gate at `path` is open (see the module docstring)."""
    os.close(os.open(path, os.O_RDONLY))
