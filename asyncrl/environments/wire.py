"""The pipe protocol between an environment pool (`pool.py`) and its worker processes (`worker.py`).

A private channel between a generator and the children it started (their stdin and a dedicated
stdout descriptor), not one of the run's sockets: length-prefixed msgpack frames of these tagged
Structs, decoded with one `Decoder` per side. A frame that does not decode ends the worker (the
pool counts a lost worker and replaces it); nothing is unpickled.
"""

from __future__ import annotations

import struct
from typing import Literal

import msgspec

from asyncrl.environments.base import Action, EnvironmentContext, EpisodeStart, Observation, StepResult
from asyncrl.environments.jail import JailReport, JailSpec

HEADER = struct.Struct("<I")
MAX_FRAME_BYTES = 64 << 20  # an observation larger than this is malformed


class WorkerSetup(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    """The pool's first frame: which environment to serve and the jail to enter."""

    kind: str  # env.kind
    context: EnvironmentContext
    jail: JailSpec


class WorkerReady(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    pid: int
    jail: JailReport


class EnvCall(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    call_id: int
    op: Literal["open", "step", "close"]
    episode: int
    start: EpisodeStart | None = None
    action: Action | None = None


class EnvReply(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    """`kind` "" = success (with `observation` for open, `result` for step), else a failure kind
    of `host.FAILURE_KINDS` with `error` (and the exception's class in `exc_type`)."""

    call_id: int
    kind: str = ""
    error: str = ""
    exc_type: str = ""
    observation: Observation | None = None
    result: StepResult | None = None


ToWorker = WorkerSetup | EnvCall
FromWorker = WorkerReady | EnvReply


def frame(msg: msgspec.Struct, encoder: msgspec.msgpack.Encoder) -> bytes:
    body = encoder.encode(msg)
    return HEADER.pack(len(body)) + body
