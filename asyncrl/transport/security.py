"""Where a process's sockets bind, and how they are protected: the run's keys, the roles bound to
them, the size cap. Set once per process (`install`), read by every `Endpoint`.

A run's key material (`asyncrl keys DIR`, `write_keys`) is one CURVE keypair for the servers (the
processes that bind: launcher, learner) and one per role of a connecting process (learner,
generator, worker, monitor, launcher). Each keypair is two files in ZeroMQ's certificate format
(z85 keys): `NAME.key` (public) and `NAME.key_secret` (public + secret), all written 0600 in a 0700
directory. A host gets the public server key and the secret keys of the roles it runs
(docs/multi-host.md, "Keys").

With CURVE on, every socket that binds is a CURVE server, and every socket that connects a CURVE
client with its role's keypair. Each binding process runs a ZAP handler (`asyncrl.transport.zap`)
that admits only the roles' public keys it holds and names the role as the connection's User-Id;
a receiving `Endpoint` then rejects (and counts) any message that role may not send (`may_send`):
a generator cannot speak as the learner. Loopback with the defaults needs nothing: no keys, no
handler, only the size cap.

The size cap (ZMQ_MAXMSGSIZE, `cluster.max_message_mb`) applies to every frame on every socket; a
peer that sends a larger frame is disconnected by ZeroMQ before the frame is buffered.
"""

from __future__ import annotations

import os
import socket
import stat
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import zmq

from asyncrl.config_sections import is_loopback_host, keys_dir_problem

if TYPE_CHECKING:
    from asyncrl.config_sections import ClusterConfig

# Roles that hold a keypair. "launcher" and "learner" also bind (with the server keypair).
ROLES = ("launcher", "learner", "generator", "worker", "monitor")
SERVER = "server"
PUBLIC_SUFFIX = ".key"
SECRET_SUFFIX = ".key_secret"
ZAP_DOMAIN = "asyncrl"
# cluster.max_message_mb's default, for a process that installed nothing (tests, tools).
DEFAULT_MAX_MESSAGE_BYTES = 64 << 20

# Who may send each message type (by class name) to a socket that binds (a CURVE server), by the
# sender's key role; what a server sends its clients is trusted by the server key. Every type in
# `asyncrl.messages.Message` is listed (tests/unit/test_security.py keeps it so): a new message
# must say who sends it, or a CURVE run rejects it.
_ANY = frozenset(ROLES)
_GENERATORS = frozenset({"generator", "worker"})
_LEARNER = frozenset({"learner"})
SENDERS: dict[str, frozenset[str]] = {
    "Hello": _ANY,
    "Heartbeat": _ANY,
    "Metrics": _ANY,
    "Fatal": _ANY,
    "PromptTask": frozenset({"launcher"}),
    "PromptTasks": frozenset({"launcher"}),
    "Shutdown": frozenset({"launcher", "learner"}),  # learner: rank 0 stops its ranks
    "Trajectory": _GENERATORS | _LEARNER,  # learner: rank 0 feeds its ranks
    "Trajectories": _GENERATORS | _LEARNER,
    "TaskDone": _GENERATORS,
    "TasksDone": _GENERATORS,
    "WeightsLoaded": _GENERATORS | {"launcher"},
    "ShardsPublished": _LEARNER,  # the two WeightsPublished variants
    "BroadcastPublished": _LEARNER,
    "DataEndpoint": _LEARNER | {"launcher"},
    "Evaluated": _LEARNER,
    "EvalDue": _LEARNER,
    "StepDone": _LEARNER,
    "GroupsLeft": _LEARNER,
    # Workers that join from other hosts (docs/multi-host.md).
    "Join": frozenset({"worker"}),
    "Welcome": frozenset({"launcher"}),
    "JoinRefused": frozenset({"launcher"}),
    "FileRequest": _GENERATORS | _LEARNER,
    "FileChunk": frozenset({"launcher", "learner"}),
    # The shared OPD teacher (opd.placement = "service") runs with the generator key.
    "TeacherRequest": _GENERATORS,
    "TeacherScores": frozenset({"generator"}),
}
# What a key role may call itself in a message's `role` field (Hello, Fatal).
SPEAKS_AS: dict[str, frozenset[str]] = {
    "launcher": frozenset({"scheduler"}),
    "learner": frozenset({"learner"}),
    "generator": frozenset({"generator"}),
    "worker": frozenset({"generator", "worker"}),
    "monitor": frozenset({"monitor"}),
}


def may_send(role: str, msg: object) -> bool:
    """Whether a peer holding `role`'s key may send `msg` (type, and the role it claims)."""
    if role not in SENDERS.get(type(msg).__name__, ()):
        return False
    claimed = getattr(msg, "role", None)
    return claimed is None or claimed in SPEAKS_AS.get(role, ())


# ---------------------------------------------------------------------------------- key files
def key_files(keys_dir: str | Path, name: str) -> tuple[Path, Path]:
    """(public, secret) files of keypair `name` ("server" or a role) in `keys_dir`."""
    base = Path(keys_dir).expanduser()
    return base / f"{name}{PUBLIC_SUFFIX}", base / f"{name}{SECRET_SUFFIX}"


def _certificate(public: bytes, secret: bytes | None) -> str:
    """ZeroMQ's certificate text (what `zmq.auth.load_certificate` reads)."""
    lines = [
        "#   ****  Generated by asyncrl keys  ****",
        "#   ZeroMQ CURVE " + ("secret" if secret else "public") + " certificate",
        "",
        "metadata",
        "curve",
        f'    public-key = "{public.decode()}"',
    ]
    if secret:
        lines.append(f'    secret-key = "{secret.decode()}"')
    return "\n".join(lines) + "\n"


def _write_private(path: Path, text: str, *, force: bool) -> None:
    """Create `path` readable and writable by its owner only (never world-readable, not even for
    an instant: the mode is given to open)."""
    flags = os.O_WRONLY | os.O_CREAT | (os.O_TRUNC if force else os.O_EXCL)
    fd = os.open(path, flags, 0o600)
    try:
        os.fchmod(fd, 0o600)  # an existing file (--force) keeps its mode otherwise
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def write_keys(keys_dir: str | Path, *, force: bool = False) -> list[Path]:
    """A run's key material in `keys_dir` (created 0700): the server keypair and one per role.
    Refuses to overwrite existing key files unless `force`. Returns the files written."""
    base = Path(keys_dir).expanduser()
    names = (SERVER, *ROLES)
    existing = [p for name in names for p in key_files(base, name) if p.exists()]
    if existing and not force:
        raise FileExistsError(
            f"{base} already holds keys ({existing[0].name}, ...): every host of a run must share one set; "
            "use --force to replace them (and copy the new files to every host)"
        )
    base.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(base, 0o700)
    written = []
    for name in names:
        public, secret = zmq.curve_keypair()
        pub_path, sec_path = key_files(base, name)
        _write_private(pub_path, _certificate(public, None), force=force)
        _write_private(sec_path, _certificate(public, secret), force=force)
        written += [pub_path, sec_path]
    return written


def _read_keypair(path: Path, *, secret: bool) -> tuple[bytes, bytes | None]:
    """(public, secret) from a certificate file; a secret file readable by others is refused."""
    if secret:
        mode = path.stat().st_mode
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise ValueError(
                f"{path} is readable by other users (mode {stat.S_IMODE(mode):o}): run `chmod 600 {path}`"
            )
    import zmq.auth

    try:
        public, sec = zmq.auth.load_certificate(str(path))
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path} is not a key file written by `asyncrl keys`: {exc}") from None
    if public is None or len(public) != 40 or (secret and (sec is None or len(sec) != 40)):
        raise ValueError(f"{path} does not hold a z85 CURVE key{'pair' if secret else ''}")
    return public, sec


def check_keys_dir(keys_dir: str) -> None:
    """ValueError naming the fix when `keys_dir` cannot serve a CURVE run."""
    problem = keys_dir_problem(keys_dir)
    if problem:
        raise ValueError(problem)
    _read_keypair(key_files(keys_dir, SERVER)[0], secret=False)


# ---------------------------------------------------------------------------------- policy
@dataclass(frozen=True)
class CurveKeys:
    """What one process holds of the run's keys."""

    server_public: bytes
    server_secret: bytes | None = None  # only where a process binds (the head node)
    public: bytes | None = None  # this process's role keypair, for the sockets it connects
    secret: bytes | None = None
    clients: Mapping[bytes, str] = field(default_factory=dict)  # public key (z85) -> role

    @classmethod
    def load(cls, keys_dir: str | Path, *, role: str) -> CurveKeys:
        """The keys in `keys_dir` for a process of `role`: the server's public key (required),
        the server secret and every role's public key where present (a binding host), and the
        role's own keypair (required unless the process only binds)."""
        check_keys_dir(str(keys_dir))
        server_public, _ = _read_keypair(key_files(keys_dir, SERVER)[0], secret=False)
        server_secret = None
        sec_path = key_files(keys_dir, SERVER)[1]
        if sec_path.is_file():
            _, server_secret = _read_keypair(sec_path, secret=True)
        public = secret = None
        role_secret = key_files(keys_dir, role)[1]
        if role_secret.is_file():
            public, secret = _read_keypair(role_secret, secret=True)
        elif role not in ("launcher",):  # the launcher only binds; every other role connects
            raise ValueError(
                f"{role_secret} is missing: a {role} needs its role's secret key; copy it from the host where "
                "`asyncrl keys` ran"
            )
        clients: dict[bytes, str] = {}
        if server_secret is not None:
            for name in ROLES:
                pub_path = key_files(keys_dir, name)[0]
                if pub_path.is_file():
                    clients[_read_keypair(pub_path, secret=False)[0]] = name
        return cls(server_public, server_secret, public, secret, clients)


@dataclass(frozen=True)
class SocketPolicy:
    """How this process's sockets bind and connect (`install` sets it process-wide)."""

    bind_host: str = "127.0.0.1"
    advertise_host: str = "127.0.0.1"  # the address written into an endpoint peers connect to
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    role: str = ""  # this process's key role (ROLES); "" where CURVE is off
    curve: CurveKeys | None = None
    insecure: bool = False  # cluster.allow_insecure: may bind beyond loopback without CURVE

    def __post_init__(self) -> None:
        # The invariant the static guard in tests/integration/test_fuzz.py relies on.
        if self.curve is None and not self.insecure and not is_loopback_host(self.bind_host):
            raise ValueError(
                f"binding on {self.bind_host} (beyond loopback) needs CURVE keys, or cluster.allow_insecure = true"
            )

    def apply(self, sock: zmq.Socket) -> None:
        """Options every socket gets, whatever it does next."""
        sock.setsockopt(zmq.MAXMSGSIZE, self.max_message_bytes)

    def apply_server(self, sock: zmq.Socket) -> None:
        """Before `bind`: make `sock` a CURVE server (with CURVE on) that asks ZAP about each client."""
        if self.curve is None:
            return
        if self.curve.server_secret is None:
            raise ValueError(
                f"this host cannot bind a CURVE socket: {SERVER}{SECRET_SUFFIX} is not in cluster.keys_dir "
                "(it belongs on the head node only: the launcher and learner)"
            )
        from asyncrl.transport import zap

        zap.ensure_guard(sock.context, self.curve.clients)
        zap.watch(sock)
        sock.setsockopt(zmq.CURVE_SERVER, 1)
        sock.setsockopt(zmq.CURVE_SECRETKEY, self.curve.server_secret)
        sock.setsockopt_string(zmq.ZAP_DOMAIN, ZAP_DOMAIN)
        # No ZAP handler answering = no connection (never silently unauthenticated).
        sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)

    def apply_client(self, sock: zmq.Socket) -> None:
        """Before `connect`: make `sock` a CURVE client with this process's role keypair."""
        if self.curve is None:
            return
        if self.curve.secret is None or self.curve.public is None:
            raise ValueError(f"a {self.role or 'launcher'} connecting with CURVE needs its role's secret key")
        sock.setsockopt(zmq.CURVE_SERVERKEY, self.curve.server_public)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, self.curve.public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, self.curve.secret)

    @property
    def bind_url(self) -> str:
        return f"tcp://{self.bind_host}"

    def endpoint(self, port: int) -> str:
        """The address peers connect to for a socket bound on `port`."""
        return f"tcp://{self.advertise_host}:{port}"


_current = SocketPolicy()


def install(policy: SocketPolicy) -> None:
    """Set this process's policy; every Endpoint created afterwards uses it."""
    global _current
    _current = policy


def current() -> SocketPolicy:
    return _current


def advertised_host(section: ClusterConfig) -> str:
    """The address peers reach this host by: cluster.advertise_host, else bind_host, else (for a
    wildcard bind) the address of the interface the default route leaves by."""
    if section.advertise_host:
        return section.advertise_host
    if section.bind_host not in ("0.0.0.0", "*"):
        return section.bind_host
    try:
        # No packet is sent: connecting a UDP socket only picks the outgoing interface.
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect(("192.0.2.1", 9))  # TEST-NET-1, never routed anywhere real
            return probe.getsockname()[0]
    except OSError:
        return socket.gethostbyname(socket.gethostname())


def policy_from_config(section: ClusterConfig, *, role: str, keys_dir: str = "") -> SocketPolicy:
    """The policy for a process of `role` (a key role, ROLES) from the `cluster` section;
    `keys_dir` overrides cluster.keys_dir (a host that keeps its keys elsewhere)."""
    if role not in ROLES:
        raise ValueError(f"unknown role {role!r}; one of {', '.join(ROLES)}")
    curve = None
    if section.curve_enabled:
        curve = CurveKeys.load(keys_dir or section.keys_dir, role=role)
    return SocketPolicy(
        bind_host=section.bind_host,
        advertise_host=advertised_host(section),
        max_message_bytes=section.max_message_bytes,
        role=role if curve is not None else "",
        curve=curve,
        insecure=section.allow_insecure,
    )


def install_from_config(section: ClusterConfig, *, role: str, keys_dir: str = "") -> SocketPolicy:
    """`install(policy_from_config(...))`, returning the policy. `role` may be a message Role
    ("scheduler" means the launcher)."""
    policy = policy_from_config(section, role="launcher" if role == "scheduler" else role, keys_dir=keys_dir)
    install(policy)
    return policy
