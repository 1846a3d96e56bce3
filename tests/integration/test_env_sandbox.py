"""The sandbox for model-written code (`run_python`) and the jail of environment workers, on this
kernel: what a program may not do is refused by the kernel, and the limits end it with a reason."""

from __future__ import annotations

import asyncio
import socket
import sys
from pathlib import Path

import pytest

from asyncrl.environments.sandbox import SandboxLimits, run_python

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux jail")
LIMITS = SandboxLimits(cpu_s=2, memory_mb=256, wall_s=5.0)


def run(code: str, limits: SandboxLimits = LIMITS):
    return asyncio.run(run_python(code, limits))


def test_a_program_runs_and_its_output_comes_back():
    out = run("import os; print(sum(range(10))); print(' '.join(sorted(os.environ))); print(os.listdir('.'))")
    assert out.exit_code == 0 and out.reason == "exit"
    total, names, listing = out.stdout.splitlines()
    assert total == "45" and listing == "[]"  # a fresh, empty directory of its own
    # None of the run's environment: PATH, the jail's HOME/TMPDIR, and what Python's locale
    # coercion may add.
    assert {"PATH", "HOME", "TMPDIR"} <= set(names.split()) <= {"PATH", "HOME", "TMPDIR", "LC_CTYPE"}


def test_the_run_and_the_filesystem_are_out_of_reach(tmp_path):
    secret = tmp_path / "run" / "server.key"
    secret.parent.mkdir()
    secret.write_text("k")
    assert "PermissionError" in run(f"open({str(secret)!r}).read()").stderr
    assert "PermissionError" in run(f"open({str(tmp_path / 'out')!r}, 'w').write('x')").stderr
    assert "PermissionError" in run("open('/tmp/asyncrl-sandbox-escape', 'w')").stderr
    assert list(tmp_path.iterdir()) == [secret.parent] and not Path("/tmp/asyncrl-sandbox-escape").exists()


def test_no_network():
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    listener.setblocking(False)
    out = run(
        f"import socket; socket.create_connection(('127.0.0.1', {listener.getsockname()[1]}), timeout=2)"
    )
    assert out.exit_code == 1 and ("PermissionError" in out.stderr or "unreachable" in out.stderr)
    with pytest.raises(BlockingIOError):
        listener.accept()
    listener.close()


def test_limits_end_a_program_with_a_reason():
    assert "MemoryError" in run("x = bytearray(1 << 30)").stderr
    spin = run(
        "while True: pass", SandboxLimits(cpu_s=1, wall_s=120.0)
    )  # a loaded machine: CPU time comes slowly
    assert spin.reason == "cpu_limit" and spin.exit_code < 0
    # The sandboxed program under test outlives its wall limit (not a synchronisation: the sandbox
    # must end it at 0.5 s, long before its sleep would).
    sleeper = run("import time; time.sleep(60)", SandboxLimits(wall_s=0.5))
    assert sleeper.reason == "wall_timeout"
    big = run("open('f', 'wb').write(b'x' * (9 << 20))")  # file_mb 8
    assert big.exit_code != 0
    assert len(run("print('x' * 100000)").stdout) == LIMITS.max_output_bytes
