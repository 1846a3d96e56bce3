"""Learner ranks started by torchrun: `torchrun --nproc-per-node R -m asyncrl.learner.torchrun RUN_DIR`.

Place in the data flow: with `learner.start = "torchrun"` the launcher (`asyncrl launch`) starts
no learner; it writes `RUN_DIR/learner_join.json` (its control address, the learner's peer id and
arguments) and waits up to `learner.startup_timeout_s` for the learner's Hello. Every process
torchrun starts joins the process group through env:// (MASTER_ADDR, RANK, WORLD_SIZE), then
rank 0 runs the learner service exactly as `asyncrl launch` would have started it, and ranks
1..R-1 run the same worker loop as spawned ranks (`ranks.run_worker`).

The launcher's run directory must be readable by every rank (the resolved config and the join
file are read from it, and each rank writes its shard of every checkpoint there): learner ranks
on several nodes share a filesystem, as sharded checkpoints need anyway. They meet through
torchrun's rendezvous (`--nnodes N --node-rank K --master-addr NODE0`); rank 0's feed sockets
bind on `cluster.bind_host`, with CURVE beyond loopback (docs/multi-host.md). Tested with two
nodes on one machine (tests/integration/test_sharded_learner.py).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch.distributed as dist

from asyncrl.runtime import JOIN_FILE, JoinInfo, read_join_info, worker_argv

JOIN_POLL_S = 0.2
JOIN_TIMEOUT_S = 600.0  # how long ranks wait for `asyncrl launch` to write the join file


class JoinError(SystemExit):
    """A user mistake in how the ranks were started: one line, no traceback."""


def read_join(run_dir: Path, timeout_s: float) -> JoinInfo:
    """The launcher's join file, waiting for it to appear (torchrun may start first; the
    wait is ASYNCRL_JOIN_TIMEOUT_S, 600 s by default)."""
    path = run_dir / JOIN_FILE
    deadline = time.monotonic() + timeout_s
    while not path.is_file():
        if time.monotonic() > deadline:
            raise JoinError(
                f"asyncrl.learner.torchrun: no {path} after {timeout_s:.0f} s; start `asyncrl launch` with "
                "--set learner.start=torchrun for this run directory first"
            )
        time.sleep(JOIN_POLL_S)  # another process writes it; there is nothing to wait on
    return read_join_info(path)


def main(argv: list[str] | None = None) -> None:
    import uvloop

    from asyncrl.config_load import load_resolved_config
    from asyncrl.config_sections import ConfigError
    from asyncrl.learner import parallel
    from asyncrl.learner.ranks import group_timeout, run_worker
    from asyncrl.models.hf import quiet_offline

    quiet_offline()
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        raise JoinError("usage: torchrun --nproc-per-node R -m asyncrl.learner.torchrun RUN_DIR")
    run_dir = Path(args[0])
    # The launcher writes the config, then the join file: torchrun may have started first.
    join = read_join(run_dir, float(os.environ.get("ASYNCRL_JOIN_TIMEOUT_S", JOIN_TIMEOUT_S)))
    try:
        config = load_resolved_config(run_dir / "config.json")
    except ConfigError as exc:
        raise JoinError(f"asyncrl.learner.torchrun: {exc}; is {run_dir} a run directory?") from None
    lrn = config.learner
    if "RANK" not in os.environ:
        raise JoinError("asyncrl.learner.torchrun: no RANK in the environment; start it with torchrun")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if lrn.start != "torchrun" or world != lrn.world_size:
        raise JoinError(
            f"asyncrl.learner.torchrun: the run at {run_dir} has learner.start = {lrn.start!r} and "
            f"learner.world_size = {lrn.world_size}, torchrun started {world} ranks; launch with "
            f"--set learner.start=torchrun --set learner.world_size={world}"
        )
    device = parallel.resolve_device(lrn.device, local_rank=parallel.local_rank())
    dist.init_process_group(parallel.backend_for(device), timeout=group_timeout(config))
    if rank == 0:
        from asyncrl.learner.service import main as service_main
        from asyncrl.runtime import run_child

        argv0 = worker_argv(ctrl_address=join.ctrl, peer_id=join.peer_id, run_dir=run_dir, args=join.args)
        run_child("learner", service_main, argv0)  # destroys the group when the service stops
        return
    try:
        resume = join.args.resume_version
        uvloop.run(run_worker(rank, config, run_dir, Path(join.args.model), resume))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
