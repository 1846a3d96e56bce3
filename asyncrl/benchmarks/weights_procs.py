"""Parent <-> child plumbing of `asyncrl bench weights`: the parent process plays learner rank 0,
spawned processes play generators, and they talk over a pipe in small JSON messages (`op` plus
figures). Shared by the shards rows (weights_shards.py) and the broadcast rows (weights_broadcast.py).
"""

from __future__ import annotations

import multiprocessing as mp
from multiprocessing.connection import Connection

import msgspec
import torch


def send(conn: Connection, **fields: object) -> None:
    """One message to the other end: `op` and its figures, as JSON."""
    conn.send_bytes(msgspec.json.encode(fields))


def receive(conn: Connection) -> dict:
    return msgspec.json.decode(conn.recv_bytes())


def expect(conn: Connection, op: str) -> dict:
    """The next message, which must be `op`; RuntimeError with the child's traceback otherwise."""
    msg = receive(conn)
    if msg["op"] != op:
        raise RuntimeError(f"bench child sent {msg['op']!r} instead of {op!r}: {msg.get('traceback', '')}")
    return msg


def start_child(
    ctx: mp.context.SpawnContext, target: object, *args: object, name: str
) -> tuple[mp.Process, Connection]:
    """`target(conn, *args)` in a spawned process; (the process, the parent's end of its pipe)."""
    parent_end, child_end = ctx.Pipe()
    proc = ctx.Process(target=target, args=(child_end, *args), name=name, daemon=True)
    proc.start()
    child_end.close()
    return proc, parent_end


def stop_children(procs: list[mp.Process]) -> None:
    """Join the processes this bench started (only those), killing one that does not end."""
    for proc in procs:
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()
            proc.join()


def copy_into(params: dict[str, torch.Tensor], state: dict[str, torch.Tensor]) -> None:
    """What the torch generator's `apply_pending` does with offered weights: copy into the model."""
    with torch.no_grad():
        for name, tensor in state.items():
            params[name].copy_(tensor)
