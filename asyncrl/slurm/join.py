"""Helpers the batch script runs on the head node (script.py): `python -m asyncrl.slurm.join`.

  RUN_DIR --pid PID [--timeout S]   prints the launcher's control address (what `asyncrl worker
                                    --join` takes) once the launcher has written RUN_DIR/
                                    learner_join.json; exit 1, saying why, when launcher PID has
                                    exited first or the timeout passes
  --free-port                       prints a free TCP port of this host (torchrun's rendezvous)
  --state RUN_DIR                   prints how an allocation starts the run: fresh (no checkpoint),
                                    resume (a complete checkpoint before the last step) or
                                    complete (an earlier allocation trained every step)

Place in the data flow: with learner.start = "torchrun" the launcher writes the join file when it
is ready for the learner's ranks (`scheduler/spawner.py: JoinSpawner`); its `ctrl` is the control
socket that workers join too. The script removes a stale file before it starts the launcher.
"""

from __future__ import annotations

import argparse
import socket
import sys
import time
from pathlib import Path

from asyncrl.monitor.attach import pid_alive
from asyncrl.runtime import JOIN_FILE, read_join_info

POLL_S = 0.2


def wait_for_join(run_dir: Path, *, pid: int, timeout_s: float) -> str:
    """The control address in the join file, once it is there; ValueError saying why not."""
    path = run_dir / JOIN_FILE
    deadline = time.monotonic() + timeout_s
    while not path.is_file():
        if not pid_alive(pid):
            raise ValueError(f"the launcher (pid {pid}) exited before it wrote {path}; see its log")
        if time.monotonic() > deadline:
            raise ValueError(
                f"no {path} after {timeout_s:g} s: the launcher did not get as far as the learner"
            )
        time.sleep(POLL_S)  # another process writes the file; there is nothing to wait on
    return read_join_info(path).ctrl


def run_state(run_dir: Path) -> str:
    """fresh, resume or complete, by the checkpoints with both halves (as `asyncrl launch
    --resume` picks them) against the run's learner.steps."""
    # Here, not at the top: the learner's checkpoint module imports torch, which the other
    # helpers (run on the head node while the launcher starts) do without.
    from asyncrl.config_load import load_resolved_config
    from asyncrl.learner.checkpoint import learner_checkpoint_versions
    from asyncrl.scheduler.checkpoint import checkpoint_dir

    launcher = {int(p.stem.split("-")[1]) for p in checkpoint_dir(run_dir).glob("launcher-*.json")}
    if not launcher:
        return "fresh"
    both = launcher & set(learner_checkpoint_versions(run_dir))
    steps = load_resolved_config(run_dir / "config.json").learner.steps
    return "complete" if both and max(both) >= steps else "resume"


def free_port() -> int:
    """A port the kernel has free now, for torchrun's rendezvous (asked on loopback: nothing is
    served here, and the package binds beyond loopback only under CURVE)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m asyncrl.slurm.join")
    parser.add_argument("run_dir", nargs="?", type=Path)
    parser.add_argument("--pid", type=int, default=0, help="the launcher's pid")
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--free-port", action="store_true")
    parser.add_argument("--state", action="store_true", help="fresh, resume or complete")
    args = parser.parse_args(argv)
    if args.free_port:
        print(free_port())
        return 0
    if args.state and args.run_dir is not None:
        print(run_state(args.run_dir))
        return 0
    if args.run_dir is None or not args.pid:
        parser.error("RUN_DIR and --pid are needed (or --free-port)")
    try:
        print(wait_for_join(args.run_dir, pid=args.pid, timeout_s=args.timeout))
    except ValueError as exc:
        print(f"asyncrl.slurm.join: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
