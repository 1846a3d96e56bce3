"""LoRA adapters on the `sglang` generator's servers (learner.lora.publish = "adapter").

Place in the data flow: the learner publishes each version as a PEFT adapter directory
(`transport.publisher.AdapterPublisher`, announced with `ShardsPublished.adapter`). The generator's
`load_weights` sees the directory is an adapter (`is_adapter_dir`) and, instead of replacing the
servers' weights, loads it into every server under a name of its own:

    POST /load_lora_adapter {lora_name, lora_path}     every server in service, at once
    (switch: new samples send lora_path = that name; their tokens carry that version)
    POST /pause_generation {mode: abort}, /continue_generation
                                                       only with pause_mode retract or abort
    POST /unload_lora_adapter {lora_name}              each older adapter, once no request of
                                                       ours names it any more (in the background)

The base weights never change, so the servers' weight-version label does not either: a token's
version is the version of the adapter its request named, known here exactly (no server span
needed). In-flight modes: with `in_place` (weights.inflight = keep) a request keeps the adapter it
started with, to its end; with `retract` or `abort` the generator cuts every running request once
the new adapter is in use, and `generator.py` continues each from its tokens so far under the new
adapter (retract: the prefix is recomputed under it) or restarts it (abort).

`AdapterBook` is the bookkeeping (no I/O): the current adapter, requests in flight per adapter,
adapters retired and waiting to be unloaded, what each server holds. Adapter names are unique per
generator process (`<generator id>.v<version>.<nonce>`), so two generators sharing servers, or a
restarted generator, never collide; a name a server already holds was loaded by this process for
the same version, so "already exists" counts as loaded.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from asyncrl.generators.sglang.client import Server, ServerUnavailable, SGLangRequestError, error_message

log = logging.getLogger(__name__)

ADAPTER_CONFIG_NAME = "adapter_config.json"  # learner.lora.ADAPTER_CONFIG_NAME (no learner import here)
CONTROL_TIMEOUT_S = 600.0  # an unload waits for the server's requests that use the adapter

Call = Callable[..., Awaitable[tuple[int, bytes]]]


class LoraUpdateResult(msgspec.Struct):
    """SGLang's answer to /load_lora_adapter and /unload_lora_adapter."""

    success: bool = False
    error_message: str = ""
    loaded_adapters: dict[str, str] | None = None


_decode_result = msgspec.json.Decoder(LoraUpdateResult)


def is_adapter_dir(directory: Path) -> bool:
    """Whether a published version directory holds a PEFT adapter rather than full weights."""
    return (Path(directory) / ADAPTER_CONFIG_NAME).is_file()


@dataclass
class AdapterBook:
    """Which adapter new requests name, which requests still name older ones, what to unload."""

    generator_id: str
    nonce: str = field(default_factory=lambda: secrets.token_hex(3))
    current: tuple[int, str] | None = None  # (version, name); None: the base model (version 0)
    in_flight: dict[str, int] = field(default_factory=dict)  # name -> requests naming it now
    retired: set[str] = field(default_factory=set)  # older adapters not yet unloaded
    loaded: dict[str, set[str]] = field(default_factory=dict)  # server url -> names it holds

    def name(self, version: int) -> str:
        return f"{self.generator_id}.v{version}.{self.nonce}"

    def acquire(self) -> tuple[int, str] | None:
        """The adapter a new request names (counted until `release`); None for the base model."""
        if self.current is not None:
            name = self.current[1]
            self.in_flight[name] = self.in_flight.get(name, 0) + 1
        return self.current

    def release(self, name: str) -> list[str]:
        """A request naming `name` returned; the adapters now free to unload."""
        self.in_flight[name] -= 1
        if self.in_flight[name] == 0:
            del self.in_flight[name]
        return self.unloadable()

    def switch(self, version: int, name: str) -> list[str]:
        """New requests name `name` from now on; the adapters now free to unload."""
        if self.current is not None and self.current[1] != name:
            self.retired.add(self.current[1])
        self.current = (version, name)
        return self.unloadable()

    def unloadable(self) -> list[str]:
        """Retired adapters no request names any more (each handed out once)."""
        free = sorted(n for n in self.retired if n not in self.in_flight)
        self.retired.difference_update(free)
        return free

    def holders(self, name: str) -> list[str]:
        """The server urls that hold `name` (forgotten here: the caller unloads it from them)."""
        urls = [url for url, names in self.loaded.items() if name in names]
        for url in urls:
            self.loaded[url].discard(name)
        return urls


async def load_adapter(call: Call, server: Server, name: str, directory: str, book: AdapterBook) -> None:
    """POST /load_lora_adapter on one server; SGLangRequestError if it refuses."""
    status, data = await call(
        server,
        "POST",
        "/load_lora_adapter",
        {"lora_name": name, "lora_path": directory},
        timeout_s=CONTROL_TIMEOUT_S,
    )
    result = _decode_result.decode(data) if data.strip().startswith(b"{") else None
    if result is None or not (status == 200 and result.success):
        message = result.error_message if result is not None else error_message(data)
        if "already exists" not in message:
            # Not "could not load": the files passed their sha256 check, so a refusal is the
            # server's configuration (--enable-lora, --max-lora-rank, ...), which no retry fixes.
            raise SGLangRequestError(
                f"{server.url} refused LoRA adapter {name} from {directory} (HTTP {status}): {message}"
            )
    book.loaded.setdefault(server.url, set()).add(name)


async def cut_requests(call: Call, server: Server) -> None:
    """Abort the server's running requests (they return their partial tokens) and resume it."""
    for path, body in (("/pause_generation", {"mode": "abort"}), ("/continue_generation", {})):
        status, data = await call(server, "POST", path, body, timeout_s=CONTROL_TIMEOUT_S)
        if status != 200:
            raise SGLangRequestError(f"{server.url}{path} answered HTTP {status}: {error_message(data)}")


async def unload_adapters(
    call: Call, servers: dict[str, Server], book: AdapterBook, names: list[str]
) -> None:
    """Unload `names` from every server that holds them; failures are logged, never raised (an
    adapter left loaded costs memory, not correctness)."""
    for name in names:
        for url in book.holders(name):
            server = servers.get(url)
            if server is None:
                continue
            try:
                status, data = await call(
                    server, "POST", "/unload_lora_adapter", {"lora_name": name}, timeout_s=CONTROL_TIMEOUT_S
                )
            except ServerUnavailable as exc:
                log.warning("could not unload LoRA adapter %s from %s: %s", name, url, exc)
                continue
            if status != 200:
                log.warning("%s kept LoRA adapter %s (HTTP %d): %s", url, name, status, error_message(data))


class Unloader:
    """Background unloads (named tasks), awaited on close."""

    def __init__(self, call: Call, servers: list[Server], book: AdapterBook) -> None:
        self.call = call
        self.servers = {s.url: s for s in servers}
        self.book = book
        self.tasks: set[asyncio.Task[Any]] = set()

    def start(self, names: list[str]) -> None:
        if not names:
            return
        task = asyncio.get_running_loop().create_task(
            unload_adapters(self.call, self.servers, self.book, names), name=f"sglang-unload-{names[0]}"
        )
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def settled(self) -> None:
        """Until every unload started so far has finished (its outcome is logged, not raised)."""
        await asyncio.gather(*self.tasks, return_exceptions=True)

    async def close(self) -> None:
        for task in list(self.tasks):
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
