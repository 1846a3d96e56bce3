"""Who may read the web monitor (pure): loopback by default, a token beyond it.

Place in the data flow: every HTTP request to the web monitor (server.py) passes `check` first.
  - Bound to a loopback address (the default, 127.0.0.1): anyone on this machine may read it, as
    they may read the run directory; an SSH tunnel brings it to another machine. The Host header
    must name a loopback host, so a web page elsewhere cannot read it through DNS rebinding.
  - Bound beyond loopback: a token is required (from `--token-file`, or made up and printed once).
    A request without it gets 401, with a wrong one 403. The token comes as `?token=` (the link
    printed at start) or `Authorization: Bearer`; a page opened with it gets a cookie
    (HttpOnly, SameSite=Strict) so its own script, style and stream requests carry it.
The monitor is read-only either way: every route is a GET.
"""

from __future__ import annotations

import hmac
import ipaddress
import secrets
from dataclasses import dataclass
from pathlib import Path

COOKIE = "asyncrl_monitor_token"
MIN_TOKEN_CHARS = 16
LOOPBACK_NAMES = ("localhost",)


def is_loopback(host: str) -> bool:
    """`host` (an address or name, an optional :port or [v6] brackets stripped) is loopback."""
    name = host.strip()
    if name.startswith("["):  # [::1]:8750
        name = name[1 : name.find("]")] if "]" in name else name[1:]
    elif name.count(":") == 1:  # 127.0.0.1:8750, localhost:8750
        name = name.split(":", 1)[0]
    if name.lower() in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def read_token_file(path: Path) -> str:
    """The token in `path` (its first line, stripped); ValueError naming the fix otherwise."""
    try:
        token = path.read_text(encoding="utf-8").strip().splitlines()[0].strip() if path.is_file() else None
    except (OSError, UnicodeDecodeError, IndexError) as exc:
        raise ValueError(f"--token-file {path}: unreadable ({exc})") from None
    if token is None:
        raise ValueError(
            f"--token-file {path}: no such file; write a token into it (e.g. `openssl rand -hex 24`)"
        )
    if len(token) < MIN_TOKEN_CHARS:
        raise ValueError(
            f"--token-file {path}: the token has {len(token)} characters, at least {MIN_TOKEN_CHARS} are needed"
        )
    return token


@dataclass(frozen=True)
class Access:
    """The rule every request is checked against. `token` None: no token asked (loopback only)."""

    token: str | None
    loopback_only: bool

    @classmethod
    def for_bind(cls, host: str, token_file: Path | None) -> tuple[Access, bool]:
        """(the rule for a server bound on `host`, whether the token was made up here and must be
        shown to the user once)."""
        loopback = is_loopback(host)
        if token_file is not None:
            return cls(token=read_token_file(token_file), loopback_only=loopback), False
        if loopback:
            return cls(token=None, loopback_only=True), False
        return cls(token=secrets.token_urlsafe(24), loopback_only=False), True

    def check(self, *, host_header: str, presented: list[str]) -> tuple[int, str] | None:
        """None when the request may be served, else (HTTP status, why)."""
        if self.loopback_only and not is_loopback(host_header):
            return 403, f"this monitor serves loopback only; Host {host_header!r} is not (use an SSH tunnel)"
        if self.token is None:
            return None
        given = [p for p in presented if p]
        if not given:
            return 401, "a token is required: open the link the monitor printed (…/?token=...)"
        if any(hmac.compare_digest(p.encode(), self.token.encode()) for p in given):
            return None
        return 403, "wrong token"
