"""The reward pool's fork server: new reward workers in milliseconds instead of an interpreter start.

Data flow: RewardPool -> `ForkServer(init_payload)` starts one fresh interpreter (`BOOT_CODE` with
a socket fd: worker.py `zygote`) that builds the rewards once (so their modules are imported) and
answers `ready`; then `ForkServer.fork(read_fd, write_fd)` passes a new worker's two pipe ends over
the socket (SCM_RIGHTS), the server forks, and the child serves those pipes exactly as a started
worker does (it gets `Init`, builds its own rewards, replies `Ready`). The child's pid and a pidfd
come back, so the pool can signal it and see it end without being its parent.

Why: while reward calls hang the pool starts a worker per stuck call and per sample queued behind
one (pool.py); each interpreter start costs a tenth of a second of CPU, taken from the generator
on a busy host, and delays the moment every hang is found. A fork costs milliseconds.

The server dies with the pool's process (PR_SET_PDEATHSIG), its workers with the server, so it
lives until the pool closes; it reaps its workers itself. Anything that goes wrong with it (it
died, it did not answer, no pidfd on this kernel) turns it off (`off`): the pool starts
interpreters as before.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys

from asyncrl.rewards.worker import BOOT_CODE, PATH_ENV

FORK_TIMEOUT_S = 5.0  # a fork answered later than this turns the server off (it may be stuck)


class ForkedProc:
    """A worker forked by the server: the part of `subprocess.Popen` the pool uses, over a pidfd.
    Its exit status is the server's to collect, so `poll()` says only whether it ended (-1)."""

    def __init__(self, pid: int, pidfd: int) -> None:
        self.pid = pid
        self.pidfd = pidfd
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None and select.select([self.pidfd], [], [], 0)[0]:
            self._ended()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int | None:
        if self.returncode is None and select.select([self.pidfd], [], [], timeout)[0]:
            self._ended()
        return self.returncode

    def kill(self) -> None:
        if self.returncode is None:
            try:
                signal.pidfd_send_signal(self.pidfd, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def _ended(self) -> None:
        self.returncode = -1
        os.close(self.pidfd)


class ForkServer:
    """One fork-server process for a RewardPool; see the module docstring."""

    def __init__(self, init_payload: bytes) -> None:
        self.sock: socket.socket | None = None
        self.proc: subprocess.Popen | None = None
        self.ready = False
        self.off = False  # no more forks from it (it failed once); it lives on for its workers
        if not hasattr(os, "pidfd_open"):
            return
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        paths = [os.path.abspath(p) if p else os.getcwd() for p in sys.path]
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", BOOT_CODE, str(os.getpid()), "-1", "-1", str(theirs.fileno())],
                pass_fds=(theirs.fileno(),),
                stdin=subprocess.DEVNULL,
                env={**os.environ, PATH_ENV: json.dumps(paths)},
            )
        except OSError:
            ours.close()
            return
        finally:
            theirs.close()
        self.sock = ours
        try:
            ours.send(init_payload)
        except OSError:
            self.close()

    def fork(self, read_fd: int, write_fd: int) -> ForkedProc | None:
        """A worker serving these pipe ends (the caller closes its copies), or None: not ready yet,
        or the server is off."""
        if not self._is_ready():
            return None
        assert self.sock is not None
        try:
            self.sock.settimeout(FORK_TIMEOUT_S)
            socket.send_fds(self.sock, [b"fork"], [read_fd, write_fd])
            msg, fds, _, _ = socket.recv_fds(self.sock, 64, 1)
        except OSError:
            self.off = True
            return None
        if not msg or len(fds) != 1:
            for fd in fds:
                os.close(fd)
            self.off = True
            return None
        return ForkedProc(int(msg), fds[0])

    def _is_ready(self) -> bool:
        """True once the server has built the rewards (its `ready` read without blocking)."""
        if self.off or self.sock is None:
            return False
        if self.ready:
            return True
        self.sock.setblocking(False)
        try:
            msg = self.sock.recv(64)
        except BlockingIOError:
            return False
        except OSError:
            msg = b""
        self.ready = msg == b"ready"
        self.off = not self.ready
        return self.ready

    def close(self) -> subprocess.Popen | None:
        """End the server (and so its workers: the pool closes); the killed process, to reap."""
        self.ready, self.off = False, True
        if self.sock is not None:
            self.sock.close()
            self.sock = None
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            proc.kill()
        return proc
