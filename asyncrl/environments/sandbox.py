"""Run code a model wrote, sandboxed: a fresh interpreter in the jail, with its own limits.

Place in the data flow: a code tool (e.g. `python` in examples/python_agent) calls `run_python`
from its environment's step; the program runs in a new process that enters the jail
(`jail.py`: CPU seconds, address space, file size, a private temporary directory that is
removed afterwards, no network, nothing of the filesystem but the interpreter) before it reads
the program from its stdin, and is killed (its whole process group) past `wall_s`. What comes
back is its exit status, stdout and stderr (each cut at `max_output_bytes`) and why it ended.
Nothing in the program can reach the run: it starts from `python -I` (no environment variables
read, no user site), with an empty environment besides PATH, in a directory of its own.

The jail's code is handed to the new interpreter as source (`jail.py` is self-contained, read
when this module is imported), so a sandbox works from inside an environment worker, whose own
jail hides the project's files.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import os
import shutil
import signal
import sys
import tempfile
from typing import NamedTuple

import msgspec

from asyncrl.environments import jail
from asyncrl.environments.jail import JailSpec, default_read_paths

_BOOT = """
import json as _json, sys as _sys
_spec = JailSpec(**_json.loads(_sys.argv[1]))
_report = enter_jail(_spec)
if _spec.network is False and not (_report.netns or _report.landlock_net):
    _sys.exit("sandbox: no way to cut the network here")
_code = _sys.stdin.read()
del _json, _spec, _report
exec(compile(_code, "<sandbox>", "exec"), {"__name__": "__main__"})
"""


class SandboxLimits(msgspec.Struct, frozen=True, kw_only=True):
    cpu_s: int = 5
    memory_mb: int = 512
    file_mb: int = 8
    wall_s: float = 10.0
    max_output_bytes: int = 16384


class SandboxResult(NamedTuple):
    exit_code: int  # negative: killed by that signal
    stdout: str
    stderr: str
    reason: str  # "exit", "wall_timeout" (killed past wall_s), "cpu_limit" (SIGXCPU/SIGKILL at RLIMIT_CPU)


# Read at import: a worker imports its environment (and this) before its own jail hides the
# project's files, so the source must be in memory by then.
_JAIL_SOURCE = inspect.getsource(jail)


def _boot_source() -> str:
    return _JAIL_SOURCE + _BOOT


async def run_python(code: str, limits: SandboxLimits | None = None) -> SandboxResult:
    """Run `code` as a Python program in the sandbox; see the module docstring."""
    limits = limits or SandboxLimits()
    workdir = tempfile.mkdtemp(prefix="asyncrl-sandbox-")
    spec = JailSpec(
        workdir=workdir,
        read_paths=default_read_paths(),
        cpu_s=limits.cpu_s,
        memory_mb=limits.memory_mb,
        file_mb=limits.file_mb,
        network=False,
        netns_inherited=jail.CURRENT is not None and jail.CURRENT.netns,
    )
    try:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-I",
            "-c",
            _boot_source(),
            json.dumps(msgspec.to_builtins(spec)),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            cwd=workdir,
            env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")},
            start_new_session=True,
        )
        reason = "exit"
        try:
            out, err = await asyncio.wait_for(proc.communicate(code.encode()), limits.wall_s)
        except TimeoutError:
            reason = "wall_timeout"
            _kill_group(proc.pid)
            out, err = await proc.communicate()
        if proc.returncode in (-signal.SIGXCPU, -signal.SIGKILL) and reason == "exit":
            reason = "cpu_limit"
        cut = limits.max_output_bytes
        return SandboxResult(
            proc.returncode, out[:cut].decode(errors="replace"), err[:cut].decode(errors="replace"), reason
        )
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
