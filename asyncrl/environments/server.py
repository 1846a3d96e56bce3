"""Serve any environment over HTTP: the service side of `asyncrl/environments/remote.py`.

    python -m asyncrl.environments.server pkg.mod:factory [--port N] [--options JSON]

prints `ASYNCRL_ENV_URL http://127.0.0.1:PORT` and serves POST /reset, /step, /close (the protocol
in remote.py's docstring): one environment per episode id, made by the factory with the options;
a repeated (episode_id, seq) step gets the reply it got before; a reset or step that raises is a
422 whose body says why. In-process: `EnvServer(factory).start()` -> URL; `stop()`.

Stdlib HTTP (a thread per request) in front of one event loop on its own thread, on which every
environment coroutine runs, so an environment's state stays on one loop.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import msgspec

from asyncrl.environments.base import (
    Action,
    EnvironmentContext,
    EpisodeStart,
    make_environment,
    resolve_environment,
)

_POLL_S = 0.05  # how often serve_forever checks for shutdown


class _Call(msgspec.Struct):
    episode_id: str
    seq: int = -1
    start: EpisodeStart | None = None
    action: Action | None = None


class EnvServer:
    def __init__(
        self, factory: Any, ctx: EnvironmentContext | None = None, host: str = "127.0.0.1", port: int = 0
    ) -> None:
        self.factory = factory
        self.ctx = ctx or EnvironmentContext()
        self.host, self.port = host, port
        self.envs: dict[str, Any] = {}
        self.replies: dict[str, tuple[int, bytes]] = {}  # episode_id -> (seq, last step reply)
        self.num_steps = 0  # steps run (repeats answered from the record do not count)
        self.fail_next = 0  # test hook: answer the next N requests 503
        self.loop = asyncio.new_event_loop()
        self._loop_thread = threading.Thread(
            target=self.loop.run_forever, name="env-server-loop", daemon=True
        )
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> str:
        self._loop_thread.start()
        server = ThreadingHTTPServer((self.host, self.port), _handler(self))
        server.daemon_threads = True
        self._server, self.port = server, server.server_address[1]
        self._thread = threading.Thread(
            target=server.serve_forever, kwargs={"poll_interval": _POLL_S}, daemon=True
        )
        self._thread.start()
        return self.url

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._loop_thread.join()

    def handle(self, path: str, body: bytes) -> tuple[int, bytes]:
        call = msgspec.json.decode(body, type=_Call)
        if path == "/reset":
            env = make_environment(self.factory, self.ctx)
            self.envs[call.episode_id] = env
            obs = self._run(env.reset(call.start))
            return 200, msgspec.json.encode({"observation": obs})
        if path == "/step":
            seq, reply = self.replies.get(call.episode_id, (-1, b""))
            if seq == call.seq:
                return 200, reply
            result = self._run(self.envs[call.episode_id].step(call.action))
            self.num_steps += 1
            reply = msgspec.json.encode(result)
            self.replies[call.episode_id] = (call.seq, reply)
            return 200, reply
        if path == "/close":
            self.envs.pop(call.episode_id, None)
            self.replies.pop(call.episode_id, None)
            return 200, b"{}"
        return 404, b'{"error": "unknown path"}'

    def _run(self, coro) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()


def _handler(server: EnvServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self) -> None:  # noqa: N802 (http.server's name)
            body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            if server.fail_next > 0:
                server.fail_next -= 1
                status, data = 503, b'{"error": "scripted failure"}'
            else:
                try:
                    status, data = server.handle(self.path, body)
                except (msgspec.DecodeError, msgspec.ValidationError, KeyError) as exc:
                    status, data = 400, json.dumps({"error": f"bad request: {exc}"}).encode()
                except Exception as exc:  # the environment raised: the client's episode fails
                    status, data = 422, json.dumps({"error": f"{type(exc).__name__}: {exc}"}).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: Any) -> None:  # quiet
            pass

    return Handler


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m asyncrl.environments.server", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("kind", help="the environment: a registry name or pkg.mod:factory")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--options", default="{}", help="JSON object: the factory's EnvironmentContext.options")
    args = p.parse_args(argv)
    server = EnvServer(
        resolve_environment(args.kind),
        EnvironmentContext(options=json.loads(args.options)),
        args.host,
        args.port,
    )
    print("ASYNCRL_ENV_URL", server.start(), flush=True)
    threading.Event().wait()  # until killed
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
