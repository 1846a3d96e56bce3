"""The reward worker process and the frames between it and its RewardPool (pool.py).

Data flow: RewardPool -> `Init(specs)` once, then `Chunk(reward_index, samples)` frames -> this
process (a fresh interpreter started with `BOOT_CODE`) builds the rewards from their configs,
replies `Ready`, then scores each chunk and streams back one `Result` per sample, so a hang is
pinned to the one sample being scored. The same entry runs the pool's fork server (`zygote`,
zygote.py), whose forked children serve their pipes the same way.

Frames are a 4-byte little-endian length and a msgpack Struct, private to a pool and its own
workers. The worker dies with its parent (PR_SET_PDEATHSIG) and exits on pipe EOF.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import sys
from typing import Any

import msgspec

from asyncrl.config_sections import RewardConfig
from asyncrl.rewards.base import (
    RewardFailure,
    RewardInput,
    check_value,
    describe_exception,
    resolve_reward,
    reward_mode,
)

READ_BYTES = 1 << 16
PATH_ENV = "ASYNCRL_REWARD_SYS_PATH"  # the parent's sys.path, so `pkg.mod:fn` imports the same
BOOT_CODE = (
    "import json, os, sys; "
    f"sys.path[:0] = [p for p in json.loads(os.environ.pop({PATH_ENV!r}, '[]')) if p not in sys.path]; "
    "from asyncrl.rewards.worker import main; main()"
)

WireSample = tuple[str, str, str, dict[str, Any], int, str, int]


class Init(msgspec.Struct, tag="init", array_like=True):
    specs: list[RewardConfig]


class Chunk(msgspec.Struct, tag="chunk", array_like=True):
    reward_index: int
    samples: list[WireSample]


class Ready(msgspec.Struct, tag="ready", array_like=True):
    pid: int


class Result(msgspec.Struct, tag="result", array_like=True, omit_defaults=True):
    value: float = 0.0
    kind: str = ""  # "" = value is the reward; else a RewardFailure kind, with detail
    detail: str = ""


def frame(payload: bytes) -> bytes:
    return len(payload).to_bytes(4, "little") + payload


def to_wire(sample: RewardInput) -> WireSample:
    extras = sample.extras if isinstance(sample.extras, dict) else dict(sample.extras)
    return (
        sample.prompt,
        sample.completion,
        sample.answer,
        extras,
        sample.num_tokens,
        sample.finish_reason,
        sample.max_new_tokens,
    )


def _die_with_parent(parent_pid: int) -> None:
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG = 1
        except (OSError, AttributeError):
            pass  # pipe EOF still ends us
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(0)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _build(specs: list[RewardConfig]) -> list[Any]:
    """Each spec's reward function, or the error text that every sample of it will report."""
    built: list[Any] = []
    for spec in specs:
        try:
            fn = resolve_reward(spec)
        except ValueError as exc:
            built.append(f"could not build the reward in its worker: {exc}")
            continue
        built.append(fn if reward_mode(fn) == "sync" else f"{spec.kind!r} is not a sync reward")
    return built


def _call(fn: Any, sample: RewardInput) -> Result:
    if isinstance(fn, str):
        return Result(kind="raised", detail=fn)
    try:
        value = check_value(fn(sample))
    except (Exception, SystemExit) as exc:  # the reward's own failure: reported, the worker carries on
        return Result(kind="raised", detail=describe_exception(exc))
    if isinstance(value, RewardFailure):
        return Result(kind=value.kind, detail=value.detail)
    return Result(value=value)


def main() -> None:
    """Entry of a worker (`python -c BOOT_CODE <parent pid> <read fd> <write fd>`), or of the pool's
    fork server (`... <parent pid> -1 -1 <socket fd>`: `zygote`)."""
    parent_pid, read_fd, write_fd, *server = (int(arg) for arg in sys.argv[1:])
    _die_with_parent(parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the launcher's; the parent ends us
    if server:
        zygote(server[0])
    else:
        serve(read_fd, write_fd)


def serve(read_fd: int, write_fd: int) -> None:
    """Build the rewards `Init` names, say `Ready`, then score each `Chunk`, one `Result` per
    sample, until EOF."""
    decoder = msgspec.msgpack.Decoder(Init | Chunk)
    encoder = msgspec.msgpack.Encoder()
    fns: list[Any] = []
    with os.fdopen(read_fd, "rb", buffering=READ_BYTES) as pipe:
        while True:
            header = pipe.read(4)
            if len(header) < 4:
                return  # EOF: the pool closed or the parent died
            payload = pipe.read(int.from_bytes(header, "little"))
            match decoder.decode(payload):
                case Init(specs=specs):
                    fns = _build(specs)
                    _write_all(write_fd, frame(encoder.encode(Ready(pid=os.getpid()))))
                case Chunk(reward_index=index, samples=samples):
                    fn = fns[index]
                    for wire in samples:
                        result = _call(fn, RewardInput(*wire))
                        _write_all(write_fd, frame(encoder.encode(result)))


def _reap_children(*_: object) -> None:
    """SIGCHLD in the fork server: collect every worker that ended."""
    try:
        while os.waitpid(-1, os.WNOHANG)[0]:
            pass
    except ChildProcessError:
        pass


def zygote(sock_fd: int) -> None:
    """The fork server (zygote.py): build the rewards once (their modules imported), say "ready",
    then fork a worker per request (its two pipe ends come with it) and answer its pid and a pidfd;
    exit when the pool closes the socket."""
    sock = socket.socket(fileno=sock_fd)
    init = msgspec.msgpack.decode(sock.recv(1 << 20)[4:], type=Init)  # the pool's Init frame
    _build(init.specs)
    signal.signal(signal.SIGCHLD, _reap_children)
    sock.send(b"ready")
    me = os.getpid()
    while True:
        try:
            msg, fds, _, _ = socket.recv_fds(sock, 16, 2)
        except OSError:  # the pool closed the socket
            return
        if not msg or len(fds) != 2:
            return
        # SIGCHLD waits until the pidfd is open: a worker reaped before it could be another process.
        old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCHLD})
        pid = os.fork()
        if pid == 0:
            try:
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
                sock.close()
                _die_with_parent(me)
                serve(*fds)
            finally:
                os._exit(0)
        try:
            pidfd = os.pidfd_open(pid)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
            for fd in fds:
                os.close(fd)
        socket.send_fds(sock, [str(pid).encode()], [pidfd])
        os.close(pidfd)
