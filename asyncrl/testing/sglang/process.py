"""Start the stand-in server as its own process (what tests and benchmarks do), cheaply importable."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def start_standin_process(model_dir: Path | str, *extra: str) -> tuple[subprocess.Popen, str]:
    """`python -m asyncrl.testing.sglang.server` on a free port (with `extra` flags, e.g. LoRA's):
    (its process, its URL), once it listens. The caller stops it (by this pid only). RuntimeError
    if it exits before it listens."""
    cmd = [sys.executable, "-m", "asyncrl.testing.sglang.server", "--model-path", str(model_dir)]
    proc = subprocess.Popen(
        [*cmd, "--port", "0", *extra], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
    )
    line = proc.stdout.readline()  # blocks until the server listens (or exits: empty line)
    if not line.startswith("SGLANG_STANDIN_URL "):
        proc.kill()
        proc.wait()
        raise RuntimeError(f"the stand-in server did not start: {line!r}")
    return proc, line.split()[1]
