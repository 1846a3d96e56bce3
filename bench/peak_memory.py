"""Peak resident memory of every process of an `asyncrl launch`, from /proc (Linux).

    python bench/peak_memory.py [CONFIG] [--set key=value ...]

Runs the launch (`--no-tui`, `run.spawn=exec` so that each process is found by its command line)
in a temporary run directory (or the one `--set run.out_dir=... --set run.name=...` names, kept)
and, until it exits, reads `VmHWM` (the kernel's high-water mark of
the process's resident set) of the launcher and each of its descendants every `PERIOD_S`. A
process's figure is its highest reading: its high-water mark up to at most `PERIOD_S` before it
ended (an exited child not yet reaped reads 0 and is skipped). Prints one line per process (its
role from the command line, its peak in MB) and the launch's own exit status. The figures for the real-model job are in bench/README.md.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

PERIOD_S = 0.2
ROLES = (  # a substring of the command line -> the role it names, first match wins
    ("asyncrl.learner.service", "learner"),
    ("asyncrl.generators.teacher_service", "teacher service"),
    ("asyncrl.generators.service", "generator"),
    ("asyncrl.rewards.worker", "reward worker"),
    ("asyncrl.evaluator", "evaluator"),
    ("torchrun", "torchrun"),
)


def children_of(pid: int) -> list[int]:
    """Every descendant of `pid` alive now (from each thread's children list in /proc)."""
    found, todo = [], [pid]
    while todo:
        parent = todo.pop()
        for task in Path(f"/proc/{parent}/task").glob("*"):
            try:
                kids = [int(k) for k in (task / "children").read_text().split()]
            except OSError:  # the thread or the process ended meanwhile
                continue
            found.extend(kids)
            todo.extend(kids)
    return found


def reading(pid: int) -> tuple[str, int] | None:
    """(role, VmHWM in kB) of a live process, None if it is gone."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    hwm = next((int(line.split()[1]) for line in status.splitlines() if line.startswith("VmHWM:")), 0)
    role = next((name for key, name in ROLES if key in cmdline), None)
    if role is None:
        role = "launcher" if "asyncrl" in cmdline and "launch" in cmdline else cmdline.split(" ")[0]
    return role, hwm


def watch(launch: subprocess.Popen, stop: threading.Event) -> dict[int, tuple[str, int]]:
    """pid -> (role, last VmHWM) of the launch and its descendants, until `stop` is set."""
    peaks: dict[int, tuple[str, int]] = {}
    while not stop.is_set():
        for pid in (launch.pid, *children_of(launch.pid)):
            seen = reading(pid)
            if seen is not None and seen[1] >= peaks.get(pid, ("", 0))[1]:  # not an exited child's 0
                peaks[pid] = seen
        stop.wait(PERIOD_S)  # the sampling period, not a synchronisation
    return peaks


def main(argv: list[str]) -> int:
    with tempfile.TemporaryDirectory(prefix="asyncrl-peak-memory-") as out:
        command = [sys.executable, "-m", "asyncrl", "launch", *argv, "--no-tui", "--set", "run.spawn=exec"]
        if not any(arg.startswith("run.out_dir=") for arg in argv):
            command += ["--set", f"run.out_dir={out}", "--set", "run.name=run"]
        launch = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        stop = threading.Event()
        result: dict[int, tuple[str, int]] = {}
        sampler = threading.Thread(target=lambda: result.update(watch(launch, stop)), daemon=True)
        sampler.start()
        _, err = launch.communicate()
        stop.set()
        sampler.join()
    for pid, (role, kb) in sorted(result.items(), key=lambda item: -item[1][1]):
        if kb == 0:  # seen only after it exited
            continue
        print(f"{role:16s} pid {pid:7d}  peak {kb / 1024:8.0f} MB")
    if launch.returncode:
        print(err.strip().splitlines()[-1] if err.strip() else "", file=sys.stderr)
    print(f"launch exit status {launch.returncode}")
    return launch.returncode


if __name__ == "__main__":
    if not os.path.isdir("/proc/self/task"):
        sys.exit("bench/peak_memory.py reads /proc: Linux only")
    sys.exit(main(sys.argv[1:]))
