"""Start the stand-in server as its own process (what tests and benchmarks do), cheaply importable."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

# The repository root: `tests.support` is importable from there (it is not in the installed package).
REPO_ROOT = Path(__file__).resolve().parents[3]


def start_standin_process(model_dir: Path | str, *extra: str) -> tuple[subprocess.Popen, str]:
    """`python -m tests.support.sglang.server` on a free port (with `extra` flags, e.g. LoRA's):
    (its process, its URL), once it listens. It runs in the repository root, wherever the caller
    is. The caller stops it (by this pid only). RuntimeError if it exits before it listens."""
    cmd = [sys.executable, "-m", "tests.support.sglang.server", "--model-path", str(model_dir)]
    proc = subprocess.Popen(
        [*cmd, "--port", "0", *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        cwd=REPO_ROOT,
    )
    line = proc.stdout.readline()  # blocks until the server listens (or exits: empty line)
    if not line.startswith("SGLANG_STANDIN_URL "):
        proc.kill()
        proc.wait()
        raise RuntimeError(f"the stand-in server did not start: {line!r}")
    return proc, line.split()[1]
