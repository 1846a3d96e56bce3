"""The jail a process puts itself in before it runs environment or model code (Linux).

Place in the data flow: an environment worker (`worker.py`) calls `enter_jail` once its code is
imported and before it makes any environment; the code tool (`sandbox.py`) calls it in a fresh
interpreter before it runs the model's program. Everything here applies to the calling process
and is inherited by whatever it starts, and none of it can be undone from inside:

  limits     RLIMIT_CPU (CPU seconds), RLIMIT_AS (address space: an allocation past it fails),
             RLIMIT_FSIZE (largest file written), RLIMIT_CORE 0
  network    a new user + network namespace (only a loopback that is down: every connection
             fails), where the kernel allows unprivileged user namespaces and the process is
             single-threaded; and Landlock's TCP rules (ABI >= 4): no TCP bind or connect
  files      Landlock (ABI >= 1): read and execute only under `read_paths` (the interpreter and
             its libraries), read and write only under `workdir` (a private temporary
             directory); nothing else of the filesystem is visible, the run directory and its keys
             included. No privileges can be gained (PR_SET_NO_NEW_PRIVS).

Why this and not containers: it needs no root, no setuid helper and no daemon, works for the
user who runs `asyncrl launch`, and each layer is a kernel mechanism that holds against code that
tries to undo it. `JailReport` says which layers took: on a kernel without Landlock or user
namespaces a layer is missing and the report (logged, and in the env/ metrics) says so.
"""

from __future__ import annotations

import ctypes
import os
import resource
import sys
from typing import NamedTuple

import msgspec

# x86_64 and aarch64 share these syscall numbers (landlock is in the generic table).
SYS_LANDLOCK_CREATE_RULESET = 444
SYS_LANDLOCK_ADD_RULE = 445
SYS_LANDLOCK_RESTRICT_SELF = 446
LANDLOCK_CREATE_RULESET_VERSION = 1
LANDLOCK_RULE_PATH_BENEATH = 1
PR_SET_NO_NEW_PRIVS = 38
PR_SET_PDEATHSIG = 1
CLONE_NEWUSER = 0x10000000
CLONE_NEWNET = 0x40000000

# Landlock filesystem rights, by ABI version (each adds to the one before).
FS_EXECUTE, FS_WRITE_FILE, FS_READ_FILE, FS_READ_DIR = 1 << 0, 1 << 1, 1 << 2, 1 << 3
FS_ALL_V1 = (1 << 13) - 1  # execute .. make_sym
FS_REFER, FS_TRUNCATE, FS_IOCTL_DEV = 1 << 13, 1 << 14, 1 << 15
FS_READ = FS_EXECUTE | FS_READ_FILE | FS_READ_DIR
FS_FILE_RIGHTS = (
    FS_EXECUTE | FS_WRITE_FILE | FS_READ_FILE | FS_TRUNCATE | FS_IOCTL_DEV
)  # what a file rule may hold
NET_BIND_TCP, NET_CONNECT_TCP = 1 << 0, 1 << 1
DEVICES_RW = ("/dev/null", "/dev/zero", "/dev/urandom", "/dev/random")


class JailSpec(msgspec.Struct, frozen=True, kw_only=True):
    """What to confine a process to (`env.sandbox` limits, its directory, what it may read)."""

    workdir: str
    read_paths: list[str]
    cpu_s: int = 60
    memory_mb: int = 2048
    file_mb: int = 16
    network: bool = False
    # Already in a jail's network namespace (a sandbox started by a jailed worker): keep it; a
    # process inside Landlock cannot write its own uid map, so it could not make a new one.
    netns_inherited: bool = False


class JailReport(msgspec.Struct, frozen=True, kw_only=True):
    """Which layers took: `netns` (own network namespace), `landlock` (the ABI used, 0 = none),
    `landlock_net` (TCP rules applied), and why a layer is missing."""

    netns: bool = False
    landlock: int = 0
    landlock_net: bool = False
    missing: list[str] = []


def default_read_paths() -> list[str]:
    """The interpreter, its standard library and installed packages, and the system's libraries
    and programs: what a Python process needs to go on running (and to start another)."""
    roots = {sys.prefix, sys.base_prefix, sys.exec_prefix, os.path.dirname(os.path.realpath(sys.executable))}
    roots |= {"/usr", "/lib", "/lib64", "/bin", "/etc"}
    return sorted(p for p in roots if os.path.exists(p))


class _Syscalls(NamedTuple):
    libc: ctypes.CDLL

    def call(self, number: int, *args) -> int:
        self.libc.syscall.restype = ctypes.c_long
        result = self.libc.syscall(number, *args)
        if result < 0:
            raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
        return int(result)


def _libc() -> _Syscalls:
    return _Syscalls(ctypes.CDLL(None, use_errno=True))


def die_with_parent() -> None:
    """The kernel kills this process when its parent dies (PR_SET_PDEATHSIG, Linux)."""
    import signal

    if sys.platform.startswith("linux"):
        _libc().libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)


def set_limits(spec: JailSpec) -> None:
    mb = 1 << 20
    resource.setrlimit(resource.RLIMIT_CPU, (spec.cpu_s, spec.cpu_s + 1))
    resource.setrlimit(resource.RLIMIT_AS, (spec.memory_mb * mb, spec.memory_mb * mb))
    resource.setrlimit(resource.RLIMIT_FSIZE, (spec.file_mb * mb, spec.file_mb * mb))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def _private_network() -> str:
    """Enter a new user + network namespace; "" on success, else why not."""
    uid, gid = os.getuid(), os.getgid()
    try:
        _libc().call(_unshare_number(), CLONE_NEWUSER | CLONE_NEWNET)
    except OSError as exc:
        return f"network namespace: unshare failed ({exc.strerror}; a multi-threaded process or no user namespaces)"
    # Map our own ids, so files we create in the work directory are ours.
    with open("/proc/self/setgroups", "w") as f:
        f.write("deny")
    with open("/proc/self/uid_map", "w") as f:
        f.write(f"{uid} {uid} 1")
    with open("/proc/self/gid_map", "w") as f:
        f.write(f"{gid} {gid} 1")
    return ""


def _unshare_number() -> int:
    import platform

    return {"x86_64": 272, "aarch64": 97}.get(platform.machine(), 272)


def _landlock(spec: JailSpec) -> tuple[int, bool, str]:
    """Restrict this process with Landlock: (ABI used, TCP rules applied, why not)."""
    sc = _libc()
    try:
        abi = sc.call(SYS_LANDLOCK_CREATE_RULESET, None, 0, LANDLOCK_CREATE_RULESET_VERSION)
    except OSError as exc:
        return 0, False, f"landlock: unavailable ({exc.strerror})"
    handled = FS_ALL_V1 | (FS_REFER if abi >= 2 else 0) | (FS_TRUNCATE if abi >= 3 else 0)
    handled |= FS_IOCTL_DEV if abi >= 5 else 0
    net = abi >= 4 and not spec.network
    attr = (ctypes.c_uint64 * 2)(handled, (NET_BIND_TCP | NET_CONNECT_TCP) if net else 0)
    size = 16 if abi >= 4 else 8
    ruleset = sc.call(SYS_LANDLOCK_CREATE_RULESET, ctypes.byref(attr), size, 0)
    try:
        rules = [(p, FS_READ) for p in spec.read_paths] + [(spec.workdir, handled)]
        rules += [(d, FS_READ_FILE | FS_WRITE_FILE) for d in DEVICES_RW]
        for path, rights in rules:
            _add_path_rule(sc, ruleset, path, rights & handled)
        sc.libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
        sc.call(SYS_LANDLOCK_RESTRICT_SELF, ruleset, 0)
    finally:
        os.close(ruleset)
    return abi, net, ""


def _add_path_rule(sc: _Syscalls, ruleset: int, path: str, rights: int) -> None:
    try:
        fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
    except OSError:
        return  # nothing there: nothing to allow
    try:
        if not os.path.isdir(path):
            rights &= FS_FILE_RIGHTS
        # struct landlock_path_beneath_attr { __u64 allowed_access; __s32 parent_fd; } (packed)
        buf = rights.to_bytes(8, "little") + fd.to_bytes(4, "little", signed=True)
        sc.call(SYS_LANDLOCK_ADD_RULE, ruleset, LANDLOCK_RULE_PATH_BENEATH, ctypes.c_char_p(buf), 0)
    finally:
        os.close(fd)


def enter_jail(spec: JailSpec) -> JailReport:
    """Confine this process (and everything it starts) as the module docstring says; chdir to
    the work directory. Layers the kernel does not offer are reported, not faked."""
    global CURRENT
    missing = []
    netns = spec.netns_inherited
    if not spec.network and not netns:
        why = _private_network()
        netns = not why
        if why:
            missing.append(why)
    abi, landlock_net, why = _landlock(spec)
    if why:
        missing.append(why)
    set_limits(spec)
    os.chdir(spec.workdir)
    os.environ["HOME"] = os.environ["TMPDIR"] = spec.workdir
    CURRENT = JailReport(netns=netns, landlock=abi, landlock_net=landlock_net, missing=missing)
    return CURRENT


CURRENT: JailReport | None = None  # this process's jail, once it entered one
