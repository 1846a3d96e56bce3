"""Data-parallel learner ranks: rank 0 (the learner service) starts ranks 1..R-1 and feeds them.

Place in the data flow: generators push every trajectory to rank 0, which validates and
deduplicates it and forwards the groups of rank r (group_id % R, `loop.rank_of_group`) to rank r
over a loopback PUSH socket. Every rank streams its own groups into its own `Trainer`; at the end
of a step each rank's summed gradient and unit count meet in one all-reduce (gloo on CPU, NCCL
on GPU), so every rank applies the same update to the same parameters. Per-trajectory backwards
never touch the group (the manual equivalent of DDP `no_sync` plus one reduction per step).
Only rank 0 publishes weights and talks to the launcher.

Process rules: rank 0 starts the workers, and only rank 0 signals them (Shutdown, then SIGTERM,
then SIGKILL, by pid). A worker exits when rank 0 disappears. A worker that dies fails the run
with its log's last lines. The group rendezvous uses its own TCPStore on loopback, separate from
the weight-update group's store (`asyncrl.transport.broadcast`).

Run (by rank 0 only) as `python -m asyncrl.learner.ranks --rank R --world W --store-port P
--feed ADDR --run-dir DIR --model PATH`.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import zmq

from asyncrl.learner.loop import StepLoop, build_trainer, load_policy_model, local_window_size
from asyncrl.learner.step import sample_from_message
from asyncrl.messages import Shutdown, Trajectory
from asyncrl.transport.zmq_io import Endpoint

log = logging.getLogger(__name__)

POLL_S = 0.2
STOP_GRACE_S = 5.0


def _backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def _timeout(config) -> datetime.timedelta:
    return datetime.timedelta(seconds=config.monitor.heartbeat_timeout_s)


class RankGroup:
    """Rank 0's handle on ranks 1..R-1: their processes, their feeds and the process group."""

    def __init__(self, ctx, model_path: Path) -> None:
        self.ctx = ctx
        self.config = ctx.config
        self.world_size = self.config.learner.world_size
        self.model_path = model_path
        self.store = dist.TCPStore(
            "127.0.0.1",
            0,
            self.world_size,
            is_master=True,
            timeout=_timeout(self.config),
            wait_for_workers=False,
        )
        self.feeds: dict[int, Endpoint] = {}
        for rank in range(1, self.world_size):
            feed = Endpoint(ctx.zmq_ctx, zmq.PUSH, name=f"learner.feed{rank}")
            feed.bind_loopback()
            self.feeds[rank] = feed
        self.procs: dict[int, subprocess.Popen] = {}
        self.logs: dict[int, Path] = {}
        self.process_group = None

    async def start(self) -> None:
        """Start the workers and join the group with them (returns when all have joined)."""
        logs = self.ctx.run_dir / "logs"
        logs.mkdir(exist_ok=True)
        for rank, feed in self.feeds.items():
            self.logs[rank] = logs / f"learner-rank{rank}.log"
            cmd = [
                sys.executable, "-m", "asyncrl.learner.ranks", "--rank", str(rank),
                "--world", str(self.world_size), "--store-port", str(self.store.port),
                "--feed", feed.address, "--run-dir", str(self.ctx.run_dir), "--model", str(self.model_path),
            ]  # fmt: skip
            with open(self.logs[rank], "ab") as out:
                self.procs[rank] = subprocess.Popen(
                    cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
                )
        await asyncio.to_thread(
            dist.init_process_group,
            _backend(),
            store=self.store,
            rank=0,
            world_size=self.world_size,
            timeout=_timeout(self.config),
        )
        self.process_group = dist.group.WORLD
        log.info("learner: %d data-parallel ranks joined (%s)", self.world_size, _backend())

    async def forward(self, rank: int, msg: Trajectory, tensors) -> None:
        await self.feeds[rank].send(msg, tensors)

    async def supervise(self) -> None:
        """A worker that exits before it is told to stop fails the learner (and so the run)."""
        while True:
            for rank, proc in self.procs.items():
                code = proc.poll()
                if code is not None:
                    try:
                        tail = "\n".join(self.logs[rank].read_text(errors="replace").splitlines()[-10:])
                    except OSError:
                        tail = ""
                    raise RuntimeError(
                        f"learner rank {rank} (pid {proc.pid}) exited with code {code}; see {self.logs[rank]}\n{tail}"
                    )
            await asyncio.sleep(POLL_S)  # polling exit codes; no message to wait for

    async def stop(self) -> None:
        for feed in self.feeds.values():
            try:
                await asyncio.wait_for(feed.send(Shutdown(reason="learner stopping")), timeout=1.0)
            except (TimeoutError, zmq.ZMQError):
                pass
        deadline = time.monotonic() + STOP_GRACE_S
        for sig in (None, "terminate", "kill"):
            alive = [p for p in self.procs.values() if p.poll() is None]
            if not alive:
                break
            if sig is not None:
                for p in alive:
                    getattr(p, sig)()
                deadline = time.monotonic() + STOP_GRACE_S
            while time.monotonic() < deadline and any(p.poll() is None for p in alive):
                await asyncio.sleep(0.05)  # waiting for exit codes
        for feed in self.feeds.values():
            feed.close()
        if dist.is_initialized():
            dist.destroy_process_group()


# ---------------------------------------------------------------------- the worker process


async def _worker(args: argparse.Namespace, config, trainer) -> None:
    lrn = config.learner
    zctx = zmq.Context()
    feed = Endpoint(zctx, zmq.PULL, name=f"learner.rank{args.rank}")
    feed.connect(args.feed)
    loop = StepLoop(
        trainer,
        lambda step: local_window_size(
            step,
            rank=args.rank,
            world_size=args.world,
            groups_per_step=lrn.groups_per_step,
            group_size=lrn.samples_per_group,
        ),
        min_chunk=lrn.min_chunk,
    )
    parent = os.getppid()

    async def receive() -> None:
        while True:
            _, msg, tensors = await feed.recv()
            if isinstance(msg, Trajectory):
                loop.add(msg.step, sample_from_message(msg, tensors))
            elif isinstance(msg, Shutdown):
                loop.stop()
                return

    async def watch_parent() -> None:
        while os.getppid() == parent:
            await asyncio.sleep(0.5)  # polling the parent pid
        log.warning("rank %d: rank 0 is gone; exiting", args.rank)
        loop.stop()

    tasks = [asyncio.create_task(receive()), asyncio.create_task(watch_parent())]
    try:
        for step in range(lrn.steps):
            if await loop.run_step(step) is None:
                break
    finally:
        for t in tasks:
            t.cancel()
        feed.close()
        zctx.term()


def main(argv: list[str] | None = None) -> None:
    import uvloop

    from asyncrl.config import load_resolved_config
    from asyncrl.models.hf import quiet_offline

    quiet_offline()
    p = argparse.ArgumentParser()
    for name in ("--rank", "--world", "--store-port"):
        p.add_argument(name, type=int, required=True)
    for name in ("--feed", "--run-dir", "--model"):
        p.add_argument(name, required=True)
    args = p.parse_args(argv)
    logging.basicConfig(
        level=os.environ.get("ASYNCRL_LOG_LEVEL", "WARNING"),
        format=f"%(asctime)s learner-rank{args.rank} %(levelname)s %(name)s: %(message)s",
    )
    config = load_resolved_config(Path(args.run_dir) / "config.json")
    store = dist.TCPStore("127.0.0.1", args.store_port, args.world, is_master=False, timeout=_timeout(config))
    dist.init_process_group(
        _backend(), store=store, rank=args.rank, world_size=args.world, timeout=_timeout(config)
    )
    model, tokenizer = load_policy_model(Path(args.model), config.learner.threads, config.run.seed)
    trainer = build_trainer(
        config, model, pad_token_id=tokenizer.pad_token_id, process_group=dist.group.WORLD
    )
    try:
        uvloop.run(_worker(args, config, trainer))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
