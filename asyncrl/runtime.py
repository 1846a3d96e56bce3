"""Process plumbing shared by every child role (generator, learner): the imperative shell.

A child process: parses its few command-line arguments (the control address, its peer id, the
run directory with the resolved config, and its `WorkerArgs` as one JSON argument), ignores
SIGINT (the launcher owns Ctrl-C and tells children to stop), connects a DEALER to the launcher's
ROUTER, says Hello, sends Heartbeats, exits when its parent disappears, and turns any exception
into a `Fatal` message before exiting non-zero.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
import time
import traceback
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import msgspec
import zmq

from asyncrl.config import Config
from asyncrl.config_load import load_resolved_config
from asyncrl.messages import Fatal, Heartbeat, Hello, Role, WorkerArgs
from asyncrl.transport.zmq_io import Endpoint

log = logging.getLogger(__name__)

PARENT_POLL_S = 0.5
# What a worker that the launcher did not start reads to join a run (`asyncrl.learner.torchrun`).
JOIN_FILE = "learner_join.json"


class JoinInfo(msgspec.Struct, frozen=True, kw_only=True):
    """JOIN_FILE's content (JSON): what `child_args` would have been given on the command line."""

    ctrl: str  # the launcher's control address
    peer_id: str
    args: WorkerArgs


def read_join_info(path: Path) -> JoinInfo:
    return msgspec.json.decode(path.read_bytes(), type=JoinInfo)


@dataclass
class ChildContext:
    role: Role
    peer_id: str
    config: Config
    run_dir: Path
    zmq_ctx: zmq.Context
    ctrl: Endpoint
    args: WorkerArgs  # what the launcher started it with (model, endpoints, slot, resume point)

    async def hello(self, **fields) -> None:
        await self.ctrl.send(Hello(role=self.role, peer_id=self.peer_id, pid=os.getpid(), **fields))


def worker_argv(*, ctrl_address: str, peer_id: str, run_dir: Path | str, args: WorkerArgs) -> list[str]:
    """The command-line arguments `child_args` parses (after `python -m <module>`)."""
    return [
        "--ctrl", ctrl_address,
        "--peer-id", peer_id,
        "--run-dir", str(run_dir),
        "--args", msgspec.json.encode(args).decode(),
    ]  # fmt: skip


def _decode_args(text: str) -> WorkerArgs:
    try:
        return msgspec.json.decode(text, type=WorkerArgs)
    except msgspec.DecodeError as exc:  # argparse turns this into a usage error naming --args
        raise argparse.ArgumentTypeError(f"not the launcher's worker arguments: {exc}") from None


def child_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--ctrl", required=True)
    p.add_argument("--peer-id", required=True)
    p.add_argument("--run-dir", required=True)
    p.add_argument(
        "--args", dest="worker_args", type=_decode_args, default=WorkerArgs(), help="WorkerArgs as JSON"
    )
    return p.parse_args(argv)


async def _heartbeats(ctx: ChildContext) -> None:
    while True:
        await ctx.ctrl.send(Heartbeat(peer_id=ctx.peer_id, time_s=time.time()))
        await asyncio.sleep(ctx.config.monitor.heartbeat_s)  # a timer, not a synchronisation


class ParentGone(Exception):
    """The launcher died without telling us to stop (e.g. it was SIGKILLed)."""


async def _watch_parent(parent_pid: int) -> None:
    while os.getppid() == parent_pid:
        await asyncio.sleep(PARENT_POLL_S)
    raise ParentGone()


def _leaf(exc: BaseException) -> BaseException:
    """The first real exception inside (possibly nested) exception groups."""
    while isinstance(exc, BaseExceptionGroup):
        exc = exc.exceptions[0]
    return exc


def available_cpus() -> set[int]:
    """The CPUs this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return set(os.sched_getaffinity(0))
    return set(range(os.cpu_count() or 1))


def check_cpus(config: Config) -> None:
    """ValueError naming the key when `learner.cpus` or `generators.cpus` lists a CPU this process
    cannot use (checked by the launcher before any process starts)."""
    have = available_cpus()
    for key, cpus in (("learner.cpus", config.learner.cpus), ("generators.cpus", config.generators.cpus)):
        if cpus and not hasattr(os, "sched_setaffinity"):
            raise ValueError(f"{key}: this platform cannot pin processes to CPUs; leave it empty")
        missing = sorted(set(cpus) - have)
        if missing:
            raise ValueError(
                f"{key} = {list(cpus)}: CPU {', '.join(map(str, missing))} is not available here "
                f"(available: {', '.join(map(str, sorted(have)))}); list available CPUs, or leave it "
                "empty to run anywhere"
            )


def pin_process(cpus: list[int]) -> None:
    """Restrict every thread of this process, and every thread and process it starts later, to
    `cpus` (nothing to do for an empty list)."""
    if not cpus:
        return
    try:
        threads = [int(tid) for tid in os.listdir("/proc/self/task")]
    except OSError:
        threads = [0]  # no /proc: the calling thread (later threads inherit its mask)
    for tid in threads:
        try:
            os.sched_setaffinity(tid, cpus)
        except ProcessLookupError:
            pass  # a thread that ended meanwhile


def run_child(
    role: Role, main: Callable[[ChildContext], Awaitable[None]], argv: list[str] | None = None
) -> None:
    """Entry point of a child process: runs `main(ctx)` on uvloop until it returns or fails."""
    import uvloop

    from asyncrl.models.hf import quiet_offline

    quiet_offline()
    args = child_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(
        level=os.environ.get("ASYNCRL_LOG_LEVEL", "WARNING"),
        format=f"%(asctime)s {args.peer_id} %(levelname)s %(name)s: %(message)s",
    )
    run_dir = Path(args.run_dir)
    config = load_resolved_config(run_dir / "config.json")
    from asyncrl.transport.security import install_from_config

    # Every socket of this process binds and connects as cluster.* says (CURVE with this role's key).
    install_from_config(config.cluster, role=role)
    pin_process(config.learner.cpus if role == "learner" else config.generators.cpus)
    parent_pid = os.getppid()

    async def amain() -> int:
        zctx = zmq.Context()
        ctrl = Endpoint(zctx, zmq.DEALER, name=f"{args.peer_id}.ctrl", identity=args.peer_id)
        ctrl.connect(args.ctrl)
        ctx = ChildContext(role, args.peer_id, config, run_dir, zctx, ctrl, args.worker_args)
        code = 0
        try:
            async with asyncio.TaskGroup() as tg:
                helpers = [
                    tg.create_task(_heartbeats(ctx), name="heartbeats"),
                    tg.create_task(_watch_parent(parent_pid), name="watch-parent"),
                ]

                async def main_then_stop() -> None:
                    try:
                        await main(ctx)
                    finally:
                        for h in helpers:
                            h.cancel()

                tg.create_task(main_then_stop(), name=f"{role}-main")
        except* ParentGone:
            log.warning("%s: the launcher is gone; exiting", args.peer_id)
            code = 3
        except* Exception as group:
            exc = _leaf(group)
            tb = "".join(traceback.format_exception(exc))
            log.error("%s failed:\n%s", args.peer_id, tb)
            try:
                await asyncio.wait_for(
                    ctrl.send(
                        Fatal(
                            role=role,
                            peer_id=args.peer_id,
                            error=f"{type(exc).__name__}: {exc}",
                            traceback=tb,
                        )
                    ),
                    timeout=2.0,
                )
            except TimeoutError:
                pass
            code = 1
        finally:
            ctrl.close()
            # destroy, not term: a socket some code path left open must not block the exit.
            zctx.destroy(linger=0)
        return code

    sys.exit(uvloop.run(amain()))
