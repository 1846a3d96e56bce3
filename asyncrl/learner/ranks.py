"""Learner ranks 1..R-1: the process group, the feed of trajectories from rank 0, and the worker
loop that trains in lockstep with rank 0.

Place in the data flow: generators push every trajectory to rank 0 (the learner service), which
validates and deduplicates it and forwards it to every other rank over a PUSH socket, in the
order it offers it to its own trainer. Every rank therefore sees the same sequence of
trajectories, and the trainer picks its chunks of complete groups from that sequence alone
(`plans.py`), so every rank runs the same forwards and backwards in the same order, each on its
share of the chunk: FSDP2's collectives (`parallel.py`) pair up. After each step every rank takes
part in the same gathers and checkpoint writes as rank 0 (`after_step`). Only rank 0 publishes
weights and talks to the launcher.

Two ways to start the ranks, one protocol:

* `asyncrl launch` (learner.start = "launch"): rank 0 starts ranks 1..R-1 as its child processes
  (`RankGroup.spawn`), with a TCPStore of its own on loopback; it alone signals them (Shutdown,
  then SIGTERM, then SIGKILL, by pid), and a worker that dies fails the run with its log's tail.
* `torchrun` (learner.start = "torchrun", `asyncrl.learner.torchrun`): every rank is started by
  torchrun and joins through env:// (across hosts with --nnodes); rank 0 runs the learner service.

Either way rank 0 puts each worker's feed address in the group's store (`feed_key`), the worker
reads it there and connects, and a worker exits when rank 0 says Shutdown or its feed's sender is
gone.

Run (by rank 0 only, in launch mode) as `python -m asyncrl.learner.ranks --rank R --world W
--store-port P --run-dir DIR --model PATH --resume-version V`.
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
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import zmq

from asyncrl.learner.checkpoint import (
    learner_checkpoint_path,
    load_learner_checkpoint,
    save_learner_checkpoint,
)
from asyncrl.learner.chunking import fixed_min_chunk
from asyncrl.learner.loop import StepLoop, build_trainer, canonical_chunk, load_policy_model, window_size
from asyncrl.learner.parallel import backend_for, iter_full_state, resolve_device, serving_dtype
from asyncrl.learner.step import sample_from_message
from asyncrl.learner.update import NonFiniteError
from asyncrl.messages import Shutdown, Trajectory
from asyncrl.transport.shards import StreamedState
from asyncrl.transport.zmq_io import Endpoint

if TYPE_CHECKING:
    from asyncrl.config import Config
    from asyncrl.config_sections import LearnerConfig
    from asyncrl.learner.trainer import Trainer

log = logging.getLogger(__name__)

POLL_S = 0.2
STOP_GRACE_S = 5.0


def feed_key(rank: int) -> str:
    return f"asyncrl/learner/feed/{rank}"


def group_timeout(config: Config) -> datetime.timedelta:
    return datetime.timedelta(
        seconds=max(config.monitor.heartbeat_timeout_s, config.learner.startup_timeout_s)
    )


def checkpoint_due(config: Config, version: int) -> bool:
    """Whether the learner checkpoints after reaching `version` (every rank decides the same)."""
    every = config.run.checkpoint_every
    return version == config.learner.steps or bool(every and version % every == 0)


def gather_serving(trainer: Trainer, lrn: LearnerConfig) -> dict[str, torch.Tensor]:
    """The weights generators load, gathered on every rank (a collective on a sharded model:
    every rank calls it at the same point, in state-dict order); rank 0 publishes them (or
    `publish_state`'s stream of the same gathers), the others drop them."""
    return dict(serving_items(trainer.model, lrn))


def publish_state(trainer: Trainer, lrn: LearnerConfig, *, streams: bool) -> Mapping[str, torch.Tensor]:
    """What rank 0 hands the publisher, while the other ranks run `gather_serving`: with FSDP2
    sharding and a publisher that `streams` (shards), a `StreamedState` whose tensors are gathered
    as the publisher writes each shard (rank 0 holds one shard of full tensors, not the model);
    otherwise the gathered weights (a replicated or single rank has them in memory anyway)."""
    if not (streams and lrn.sharding == "fsdp" and not lrn.lora.rank):
        return gather_serving(trainer, lrn)
    dtype = serving_dtype(lrn)
    metas = {
        name: torch.empty(t.shape, dtype=dtype if t.is_floating_point() else t.dtype, device="meta")
        for name, t in trainer.model.state_dict(keep_vars=True).items()
    }
    return StreamedState(metas, lambda: iter_full_state(trainer.model, dtype))


def finish_version(
    trainer: Trainer, config: Config, run_dir: Path, version: int, *, final_to=None, eval_to=None, held=()
) -> None:
    """After the publish of `version`, on every rank: gather the float32 weights on the last step
    (rank 0 hands them to `final_to`) or when a background evaluation is due (to `eval_to`), and
    checkpoint when due (each a collective when sharded)."""
    lrn = config.learner
    last = version == lrn.steps
    if last or eval_due(config, version):
        weights = dict(serving_items(trainer.model, lrn, dtype=None, adapter=False))
        to = final_to if last else eval_to
        if to is not None:
            to(version, weights)
    if checkpoint_due(config, version):
        save_learner_checkpoint(run_dir, version, trainer, held)


def eval_snapshot_dir(run_dir: Path, version: int) -> Path:
    """Where `version`'s weights wait for the background evaluation."""
    return Path(run_dir) / "eval" / f"v{version:08d}"


def eval_due(config: Config, version: int) -> bool:
    """Whether `version`'s weights go to the background evaluation (`eval.every`); the last
    version is evaluated as the final model."""
    every = config.eval.every
    return bool(every) and version % every == 0 and version < config.learner.steps


def after_step(trainer: Trainer, config: Config, run_dir: Path, version: int) -> None:
    """What a worker rank does after reaching `version`: rank 0's gathers and checkpoint, in
    rank 0's order (`service.close_step`: gather, publish, then `finish_version`)."""
    gather_serving(trainer, config.learner)
    finish_version(trainer, config, run_dir, version)


def keep_before_fault(run_dir: Path, version: int, trainer, loop) -> None:
    """Too many non-finite steps in a row: checkpoint version `version` (its weights are those
    before the first skipped step) unless it is the start or already on disk. Every rank calls it."""
    if version > 0 and not learner_checkpoint_path(run_dir, version).exists():
        held = loop.held(after_step=version - 1) if loop is not None else ()
        save_learner_checkpoint(run_dir, version, trainer, held)


def serving_items(
    lm, lrn: LearnerConfig, *, dtype: torch.dtype | None | str = "serving", adapter: bool | None = None
):
    """(name, full tensor) pairs of what generators load: the weights under the base model's
    names, gathered one at a time (`parallel.iter_full_state`), with LoRA merged in; or, with
    `learner.lora.publish = "adapter"`, the adapter alone. In the serving dtype by default."""
    dtype = serving_dtype(lrn) if dtype == "serving" else dtype
    if not lrn.lora.rank:
        return iter_full_state(lm, dtype)
    from asyncrl.learner import lora  # never sharded: learner.lora with fsdp is rejected at load

    use_adapter = lrn.lora.publish == "adapter" if adapter is None else adapter
    pick = lora.adapter_state if use_adapter else lora.serving_state
    return iter(pick(lm, dtype).items())


class RankGroup:
    """Rank 0's handle on ranks 1..R-1: their feeds, and their processes when it started them."""

    def __init__(self, ctx, model_path: Path) -> None:
        self.ctx = ctx
        self.config = ctx.config
        self.world_size = self.config.learner.world_size
        self.model_path = model_path
        self.feeds: dict[int, Endpoint] = {}
        for rank in range(1, self.world_size):
            feed = Endpoint(ctx.zmq_ctx, zmq.PUSH, name=f"learner.feed{rank}")
            feed.bind()  # ranks on other hosts: issue #23 (workers that join over TCP)
            self.feeds[rank] = feed
        self.procs: dict[int, subprocess.Popen] = {}
        self.logs: dict[int, Path] = {}

    async def start(self) -> None:
        """Join the process group with ranks 1..R-1 (starting them first unless torchrun did) and
        tell each where its feed is. Returns when every rank has joined."""
        device = resolve_device(self.config.learner.device)
        if not dist.is_initialized():
            # (The store listens on every interface whatever the host: docs/multi-host.md, "Security".)
            store = dist.TCPStore(
                self.config.cluster.bind_host, 0, self.world_size, is_master=True,
                timeout=group_timeout(self.config), wait_for_workers=False,
            )  # fmt: skip
            self.spawn(store.port)
            await asyncio.to_thread(
                dist.init_process_group,
                backend_for(device),
                store=store,
                rank=0,
                world_size=self.world_size,
                timeout=group_timeout(self.config),
            )
        store = dist.distributed_c10d._get_default_store()
        for rank, feed in self.feeds.items():
            store.set(feed_key(rank), feed.address)
        log.info("learner: %d ranks joined (%s)", self.world_size, backend_for(device))

    def spawn(self, store_port: int) -> None:
        logs = self.ctx.run_dir / "logs"
        logs.mkdir(exist_ok=True)
        for rank in self.feeds:
            self.logs[rank] = logs / f"learner-rank{rank}.log"
            cmd = [
                sys.executable, "-m", "asyncrl.learner.ranks", "--rank", str(rank),
                "--world", str(self.world_size), "--store-port", str(store_port),
                "--run-dir", str(self.ctx.run_dir), "--model", str(self.model_path),
                "--resume-version", str(self.ctx.args.resume_version),
            ]  # fmt: skip
            env = {**os.environ, "LOCAL_RANK": str(rank)}  # its GPU on a GPU host
            with open(self.logs[rank], "ab") as out:
                self.procs[rank] = subprocess.Popen(
                    cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env
                )

    async def forward(self, msg: Trajectory, tensors) -> None:
        """Every other rank gets every trajectory, in rank 0's order."""
        for feed in self.feeds.values():
            await feed.send(msg, tensors)

    async def supervise(self) -> None:
        """A worker rank 0 started that exits before it is told to stop fails the run. (Ranks
        that torchrun started are its to watch; a dead one breaks the next collective.)"""
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


# ---------------------------------------------------------------------- the worker


async def run_worker(rank: int, config: Config, run_dir: Path, model_path: Path, resume_version: int) -> None:
    """Rank `rank` (> 0) of a joined process group: train every step in lockstep with rank 0."""
    store = dist.distributed_c10d._get_default_store()
    address = (await asyncio.to_thread(store.get, feed_key(rank))).decode()
    policy, tokenizer = await asyncio.to_thread(load_policy_model, model_path, config)
    trainer = build_trainer(config, policy, pad_token_id=tokenizer.pad_token_id)
    if resume_version:
        await asyncio.to_thread(load_learner_checkpoint, run_dir, resume_version, trainer)
        # Rank 0 republishes the resumed version first: take part in its gather.
        await asyncio.to_thread(gather_serving, trainer, config.learner)
    zctx = zmq.Context()
    feed = Endpoint(zctx, zmq.PULL, name=f"learner.rank{rank}", accept=(Trajectory, Shutdown))
    feed.connect(address)
    loop = StepLoop(
        trainer,
        lambda step: window_size(config.learner),
        min_chunk=fixed_min_chunk(config.learner.min_chunk),
        canonical_chunk=canonical_chunk(config),
    )
    stopped = asyncio.Event()

    async def receive() -> None:
        while True:
            _, msg, tensors = await feed.recv()
            if isinstance(msg, Trajectory):
                loop.add(msg.window, sample_from_message(msg, tensors))
            elif isinstance(msg, Shutdown):
                loop.stop()
                stopped.set()
                return

    async def watch_parent() -> None:
        parent = os.getppid()  # rank 0, or torchrun's agent
        while os.getppid() == parent:
            await asyncio.sleep(0.5)  # polling the parent pid
        # An orphan rank may sit inside a collective rank 0 will never join: exit now.
        log.warning("rank %d: the process that started it is gone; exiting", rank)
        os._exit(3)

    receiver = asyncio.create_task(receive())
    watcher = asyncio.create_task(watch_parent())
    try:
        for step in range(resume_version, config.learner.steps):
            try:
                if await loop.run_step(step) is None:
                    break
            except NonFiniteError:  # rank 0 raises it at the same step: checkpoint together
                await asyncio.to_thread(keep_before_fault, run_dir, step, trainer, None)
                raise
            await asyncio.to_thread(after_step, trainer, config, run_dir, step + 1)
        await stopped.wait()  # rank 0 says when the run is over
    finally:
        receiver.cancel()
        watcher.cancel()
        feed.close()
        zctx.term()


def main(argv: list[str] | None = None) -> None:
    import uvloop

    from asyncrl.config_load import load_resolved_config
    from asyncrl.models.hf import quiet_offline

    quiet_offline()
    p = argparse.ArgumentParser()
    for name in ("--rank", "--world", "--store-port", "--resume-version"):
        p.add_argument(name, type=int, required=True)
    for name in ("--run-dir", "--model"):
        p.add_argument(name, required=True)
    args = p.parse_args(argv)
    logging.basicConfig(
        level=os.environ.get("ASYNCRL_LOG_LEVEL", "WARNING"),
        format=f"%(asctime)s learner-rank{args.rank} %(levelname)s %(name)s: %(message)s",
    )
    config = load_resolved_config(Path(args.run_dir) / "config.json")
    from asyncrl.transport.security import advertised_host, install_from_config

    install_from_config(config.cluster, role="learner")  # its feed socket: CURVE with the learner key
    store = dist.TCPStore(
        advertised_host(config.cluster),
        args.store_port,
        args.world,
        is_master=False,
        timeout=group_timeout(config),
    )
    device = resolve_device(config.learner.device, local_rank=int(os.environ.get("LOCAL_RANK", args.rank)))
    dist.init_process_group(
        backend_for(device), store=store, rank=args.rank, world_size=args.world, timeout=group_timeout(config)
    )
    try:
        uvloop.run(run_worker(args.rank, config, Path(args.run_dir), Path(args.model), args.resume_version))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
