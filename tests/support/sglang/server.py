"""A stand-in SGLang server: the HTTP contract of /work/shared/SGLANG_API.md over a real torch model.

Place in the data flow: stands where a real SGLang server stands, between the `sglang` generator
(`asyncrl/generators/sglang/generator.py`, or any SGLang client) and a model, on a loopback port. Its
outputs are real samples with exact log-probs (`engine.py`, `params.py`), so tests of the client check
numbers, not mocks. This module is the HTTP side: routes, status codes, injected faults and the
process entry point; the /generate bodies are parsed and built by `generate.py`, weight update
groups live in `groups.py`.

Serving (`serving.py`): aiohttp on an asyncio loop in one thread, so thousands of /generate
requests can wait at once without a thread each (the client's concurrency test holds 1,000). A
/generate handler parses its body on the loop, hands its engine requests to the admission thread
(`Engine.submit` blocks while the server is paused or a weight update waits, which the loop must
not) and awaits futures that the engine's `on_done` callbacks resolve. Every other route runs its
blocking code in a thread of its own, per call, so a blocked /generate (paused server) never
blocks a control call.

Implemented: POST|PUT /generate (input_ids or text, batches and n, return_logprob,
logprob_start_len, top_logprobs_num, return_sampling_mask, the strict sampling_params contract and
its error shapes), /pause_generation, /continue_generation, /abort_request,
/update_weights_from_disk, /update_weight_version, /begin_weight_update, /end_weight_update
(and the session rule: updates from the group or from tensors outside a session are 400),
/init_weights_update_group, /update_weights_from_distributed (gloo only; tensors really arrive
over the group and are loaded into the model, `groups.py`), /destroy_weights_update_group,
/get_weights_by_name, /flush_cache, GET /health, /health_generate, /ready, /model_info,
/server_info (and their /get_* aliases), /v1/loads; /get_weight_version is 404 as in 0.5.21+.
`--api-key KEY` (`api_key=`): every route but /health* answers 401 without `Authorization: Bearer KEY`.
LoRA (`lora.py`): /load_lora_adapter, /unload_lora_adapter and `lora_path` on /generate, with
`--enable-lora`, `--max-lora-rank` and `--lora-target-modules`; /server_info's `internal_states`
add `loaded_adapters`, `lora_events` (loads and unloads in order) and `lora_requests` (per name).
Not implemented: streaming (400), /update_weights_from_tensor (400), the flattened_bucket load
format, multimodal inputs, /load_lora_adapter_from_tensors, `--lora-paths` at launch.

Run it as a process from the repository root (it is test support, not in the installed package;
it prints `SGLANG_STANDIN_URL http://127.0.0.1:PORT` once it listens):

    python -m tests.support.sglang.server --model-path DIR --port 0 [--weight-version 0]

It takes the flags asyncrl passes to `python -m sglang.launch_server` when it launches servers
(`--host`, `--skip-tokenizer-init`, `--log-level`, `--tp-size 1`), ignores GPU-only ones
(`--mem-fraction-static`, `--disable-cuda-graph`, ...) and warns about unknown ones, so
`generators.options.launch_command="python -m tests.support.sglang.server"` launches it through
the same code path as a real server.

or in-process: `with StandInServer(model_dir) as server: ... server.url ...`. In-process tests
can also inject faults (`server.faults.append("disconnect")`: the next /generate is cut after its
first token, with no response) and mark the server unhealthy (`server.healthy = False`).

Counters (not SGLang's; for tests and benchmarks): `num_generate_in_flight` (/generate requests
received and not yet answered) and its peak `max_generate_in_flight`; in-process,
`wait_for_generate_in_flight(n, timeout_s)` blocks until n are in flight at once; over HTTP,
`GET /standin/in_flight` reads both and `POST /standin/in_flight` also resets the peak to the
current count.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import functools
import hmac
import json
import logging
import signal
import sys
import threading
import time
from typing import Any

from aiohttp import web

from tests.support.sglang.engine import Engine, EngineRequest
from tests.support.sglang.generate import generate_response, parse_generate
from tests.support.sglang.groups import GroupError, WeightGroups
from tests.support.sglang.lora import LoraSettings
from tests.support.sglang.params import ContractError, RequestError
from tests.support.sglang.serving import Admission, AppThread, in_thread, json_response, settle

log = logging.getLogger(__name__)
SERVER_VERSION = "0.5.23-standin"
# sglang.launch_server flags that mean nothing on the CPU stand-in: accepted, ignored.
IGNORED_FLAGS_WITH_VALUE = (
    "--mem-fraction-static",
    "--base-gpu-id",
    "--dtype",
    "--context-length",
    "--attention-backend",
    "--random-seed",
    "--max-running-requests",
    "--chunked-prefill-size",
    "--max-loras-per-batch",  # GPU memory slots for adapters: the stand-in has no such limit
    "--lora-backend",
)
IGNORED_SWITCHES = (
    "--enable-deterministic-inference",
    "--disable-cuda-graph",
    "--skip-server-warmup",
    "--trust-remote-code",
    "--enable-metrics",
)
MAX_BODY_BYTES = 1 << 30  # aiohttp's default of 1 MiB would refuse large batches; SGLang has no such cap


class _Reply(Exception):
    """Answer with `status` and JSON `body` (or text) and stop handling."""

    def __init__(self, status: int, body: Any) -> None:
        super().__init__(status)
        self.status = status
        self.body = body


class _Disconnect(Exception):
    """Close the connection without an answer (an injected fault)."""


class StandInServer:
    """The HTTP front of an `Engine`; a context manager that serves on a loopback thread."""

    def __init__(
        self,
        model_dir: str,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        weight_version: str = "default",
        threads: int = 1,
        skip_tokenizer_init: bool = False,
        lora: LoraSettings | None = None,
        api_key: str = "",
    ) -> None:
        # As `--api-key` in SGLang: every route but /health* wants `Authorization: Bearer <key>`.
        self.api_key = api_key
        self.num_unauthorized = 0  # requests refused for a missing or wrong key (tests)
        self.engine = Engine(
            model_dir,
            weight_version=weight_version,
            threads=threads,
            skip_tokenizer_init=skip_tokenizer_init,
            lora=lora,
        )
        self.groups = WeightGroups()
        self.faults: collections.deque[str] = collections.deque()  # "disconnect" or "error500"
        self.healthy = True
        self.started = time.time()
        self.num_generate_in_flight = 0
        self.max_generate_in_flight = 0
        self.in_flight_changed = threading.Condition()
        self.http = AppThread(host, port)  # binds now: `url` is known before `start`
        self.admission = Admission(self.engine)

    @property
    def url(self) -> str:
        return self.http.url

    def start(self) -> StandInServer:
        """Serve from now on (returns once connections are accepted)."""
        self.admission.start()
        try:
            self.http.start(self._app())
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Abort what runs (handlers answer it), stop serving, close the socket; idempotent."""
        self.engine.close()  # running requests finish as aborted; waiting admissions fail
        self.admission.stop()
        self.http.stop()
        self.groups.close()

    def __enter__(self) -> StandInServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ------------------------------------------------------------------ routes
    def get(self, path: str) -> Any:
        e = self.engine
        match path:
            case "/health" | "/health_generate":
                raise _Reply(200 if self.healthy and not e.closed else 503, None)
            case "/ready":
                raise _Reply(200 if self.healthy and e.paused is None else 503, None)
            case "/model_info" | "/get_model_info":
                return {
                    "model_path": e.model_path,
                    "served_model_name": e.model_path,
                    "tokenizer_path": e.initial_path,
                    "is_generation": True,
                    "preferred_sampling_params": None,
                    "weight_version": e.weight_version,
                    "load_format": None,
                    "reasoning_parser": None,
                    "tool_call_parser": None,
                    "disaggregation_mode": "null",
                    "has_image_understanding": False,
                    "has_audio_understanding": False,
                    "model_type": getattr(e.model.config, "model_type", None),
                    "architectures": getattr(e.model.config, "architectures", None),
                }
            case "/server_info" | "/get_server_info":
                return {
                    "model_path": e.initial_path,
                    "tp_size": 1,
                    "dp_size": 1,
                    "max_req_input_len": e.context_len - 1,
                    "launch_command": " ".join(sys.argv),
                    "startup_time": self.started,
                    "internal_states": [
                        {
                            "num_generate_requests": e.num_generate_requests,
                            "paused": e.paused,
                            "loaded_adapters": e.loaded_adapters(),
                            "lora_events": [list(ev) for ev in e.lora_events],
                            "lora_requests": dict(e.lora_requests),
                        }
                    ],
                    "enable_lora": e.lora.enabled,
                    "max_lora_rank": e.lora.max_rank,
                    "lora_target_modules": list(e.lora.target_modules) or None,
                    "version": SERVER_VERSION,
                    "frontend": "python",
                }
            case "/v1/loads":
                return {"timestamp": time.time(), "version": SERVER_VERSION, "loads": [e.loads()]}
            case "/flush_cache":
                return self.flush_cache()
        raise _Reply(404, {"detail": "Not Found"})

    def flush_cache(self) -> Any:
        if self.engine.running and self.engine.paused != "retract":
            raise _Reply(400, "Timed out waiting for idle state.")
        raise _Reply(200, "Cache flushed.\nPlease check backend logs for more details.")

    def post(self, path: str, body: dict[str, Any]) -> Any:
        """Every POST route but /generate (`generate`, on the loop); blocking, run in a thread."""
        e = self.engine
        match path:
            case "/pause_generation":
                mode = body.get("mode", "abort")
                if mode not in ("abort", "retract", "in_place"):
                    raise _Reply(
                        400, {"error": {"message": f"mode must be abort, retract or in_place, got {mode!r}"}}
                    )
                e.pause(mode)
                return {"message": "Generation paused successfully.", "status": "ok"}
            case "/continue_generation":
                e.resume()
                return {"message": "Generation continued successfully.", "status": "ok"}
            case "/abort_request":
                e.abort(str(body.get("rid", "")), bool(body.get("abort_all", False)))
                raise _Reply(200, "")
            case "/update_weights_from_disk":
                if not isinstance(body.get("model_path"), str):
                    raise _Reply(400, {"success": False, "message": "model_path (a string) is required"})
                version = body.get("weight_version")
                ok, message, num_paused = e.update_weights_from_disk(
                    body["model_path"],
                    weight_version=None if version is None else str(version),
                    abort_all=bool(body.get("abort_all_requests", False)),
                    flush_cache=bool(body.get("flush_cache", True)),
                )
                reply = {"success": ok, "message": message, "num_paused_requests": num_paused}
                raise _Reply(200 if ok else 400, reply)
            case "/update_weight_version":
                new = body.get("new_version")
                if new is None:
                    raise _Reply(400, {"success": False, "message": "new_version is required"})
                e.update_weight_version(str(new), abort_all=bool(body.get("abort_all_requests", True)))
                return {
                    "success": True,
                    "message": f"Weight version updated to {new}",
                    "new_version": str(new),
                }
            case "/begin_weight_update" | "/end_weight_update":
                ok, message = e.begin_session() if path == "/begin_weight_update" else e.end_session()
                raise _Reply(200 if ok else 400, {"success": ok, "message": message})
            case "/update_weights_from_distributed" | "/update_weights_from_tensor":
                name = path.lstrip("/")
                if not e.session_open:
                    message = f"{name} must run between begin_weight_update() and end_weight_update()"
                    raise _Reply(400, {"success": False, "message": message})
                if name == "update_weights_from_tensor":
                    message = f"{name} is not implemented by the stand-in server; use update_weights_from_distributed"
                    raise _Reply(400, {"success": False, "message": message})
                return self.update_from_distributed(body)
            case "/init_weights_update_group":
                return self._group_call(lambda: self.groups.init(body))
            case "/destroy_weights_update_group":
                name = str(body.get("group_name", "weight_update_group"))
                return self._group_call(lambda: self.groups.destroy(name))
            case "/get_weights_by_name":
                return self.weights_by_name(body)
            case "/load_lora_adapter" | "/unload_lora_adapter":
                return self.lora_call(path, body)
            case "/flush_cache":
                return self.flush_cache()
        raise _Reply(404, {"detail": "Not Found"})

    # ------------------------------------------------------------------ LoRA adapters
    def lora_call(self, path: str, body: dict[str, Any]) -> Any:
        """/load_lora_adapter {lora_name, lora_path} or /unload_lora_adapter {lora_name}: 200 on
        success, 400 with `error_message` otherwise (SGLang's LoRAUpdateOutput shape)."""
        required = ("lora_name", "lora_path") if path == "/load_lora_adapter" else ("lora_name",)
        missing = [k for k in required if not isinstance(body.get(k), str)]
        if missing:  # FastAPI's validation error of a required field
            detail = [{"type": "missing", "loc": ["body", k], "msg": "Field required"} for k in missing]
            raise _Reply(422, {"detail": detail})
        if path == "/load_lora_adapter":
            ok, error = self.engine.load_lora_adapter(body["lora_name"], body["lora_path"])
        else:
            ok, error = self.engine.unload_lora_adapter(body["lora_name"])
        reply = {
            "rid": None,
            "http_worker_ipc": None,
            "success": ok,
            "error_message": error,
            "loaded_adapters": self.engine.loaded_adapters() if ok else None,
        }
        raise _Reply(200 if ok else 400, reply)

    # ------------------------------------------------------------------ weight groups
    def _group_call(self, action: Any) -> Any:
        try:
            message = action()
        except GroupError as exc:
            raise _Reply(400, {"success": False, "message": str(exc)}) from None
        return {"success": True, "message": message}

    def update_from_distributed(self, body: dict[str, Any]) -> Any:
        """Receive the listed tensors over the group, then load them (SGLANG_API.md 2.4)."""
        try:
            state = self.groups.receive(body)
        except GroupError as exc:
            raise _Reply(400, {"success": False, "message": str(exc)}) from None
        version = body.get("weight_version")
        ok, message, _ = self.engine.update_weights_from_tensors(
            state,
            weight_version=None if version is None else str(version),
            abort_all=bool(body.get("abort_all_requests", False)),
            flush_cache=bool(body.get("flush_cache", True)),
        )
        raise _Reply(200 if ok else 400, {"success": ok, "message": message})

    def weights_by_name(self, body: dict[str, Any]) -> Any:
        """The first `truncate_size` rows (elements of a 1-D tensor) of a parameter, as JSON."""
        name = body.get("name")
        t = self.engine.weights_by_name(name) if isinstance(name, str) else None
        if t is None:
            raise _Reply(400, {"error": {"message": f"Parameter {name!r} not found in the model."}})
        truncate = body.get("truncate_size", 100)
        values = t.tolist()
        return values[:truncate] if isinstance(values, list) and isinstance(truncate, int) else values

    # ------------------------------------------------------------------ /generate
    async def generate(self, body: dict[str, Any]) -> Any:
        """Parse, admit (the admission thread), await every item's `on_done`, answer; on the loop."""
        e = self.engine
        try:
            reqs, batched = parse_generate(e, body)
        except ContractError as exc:
            raise _Reply(400, {"error": str(exc)}) from None
        except RequestError as exc:
            raise _Reply(400, {"error": {"message": str(exc)}}) from None
        fault = self.faults.popleft() if self.faults else None
        if fault == "error500":
            raise _Reply(500, {"detail": "injected fault"})
        loop = asyncio.get_running_loop()
        finished = []
        for req in reqs:  # before admission: a request may finish before submit returns
            fut = loop.create_future()
            req.on_done = functools.partial(settle, loop, fut, None)
            finished.append(fut)
        try:
            await self.admission.admit(reqs)
        except RequestError as exc:
            raise _Reply(400, {"error": {"message": str(exc)}}) from None
        if fault == "disconnect":
            await in_thread(self._wait_first_token, reqs[0])
            for req in reqs:
                e.cancel(req)
            raise _Disconnect
        await asyncio.gather(*finished)
        failed = [r for r in reqs if r.status_code >= 400]
        if failed:
            raise _Reply(failed[0].status_code, {"error": {"message": failed[0].finish.get("message", "")}})
        out = [generate_response(e, r) for r in reqs]
        return out if batched else out[0]

    def _wait_first_token(self, req: EngineRequest) -> None:
        with self.engine.cond:
            self.engine.cond.wait_for(lambda: bool(req.output_ids) or req.done.is_set())

    # ------------------------------------------------------------------ counters (test hooks)
    def _count_generate(self, delta: int) -> None:
        with self.in_flight_changed:
            self.num_generate_in_flight += delta
            self.max_generate_in_flight = max(self.max_generate_in_flight, self.num_generate_in_flight)
            self.in_flight_changed.notify_all()

    def wait_for_generate_in_flight(self, n: int, timeout_s: float) -> bool:
        """Block until at least `n` /generate requests are in flight at once (False on timeout)."""
        with self.in_flight_changed:
            return self.in_flight_changed.wait_for(lambda: self.num_generate_in_flight >= n, timeout_s)

    def in_flight(self, *, reset_peak: bool) -> dict[str, int]:
        with self.in_flight_changed:
            counts = {
                "generate_in_flight": self.num_generate_in_flight,
                "generate_in_flight_peak": self.max_generate_in_flight,
            }
            if reset_peak:
                self.max_generate_in_flight = self.num_generate_in_flight
            return counts

    # ------------------------------------------------------------------ HTTP
    def _app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY_BYTES)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        return app

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        path, method = request.path, request.method
        if method not in ("GET", "POST", "PUT"):
            return json_response(501, {"detail": f"Unsupported method ({method})"})
        if self.api_key and not path.startswith("/health") and not _authorized(request, self.api_key):
            self.num_unauthorized += 1
            return json_response(401, {"error": "Unauthorized"})
        raw = await request.read()
        if path == "/standin/in_flight":
            return json_response(200, self.in_flight(reset_peak=method != "GET"))
        try:
            if method == "GET" and path != "/get_weights_by_name":
                result = await in_thread(self.get, path)
            else:
                try:
                    body = json.loads(raw) if raw.strip() else {}
                except json.JSONDecodeError as exc:
                    raise _Reply(400, {"error": {"message": f"the body is not valid JSON: {exc}"}}) from None
                if not isinstance(body, dict):
                    raise _Reply(400, {"error": "invalid type: expected a JSON object at the top level"})
                if path == "/generate":
                    self._count_generate(+1)
                    try:
                        result = await self.generate(body)
                    finally:
                        self._count_generate(-1)
                else:
                    result = await in_thread(self.post, path, body)
            return json_response(200, result)
        except _Reply as reply:
            return json_response(reply.status, reply.body)
        except _Disconnect:  # close without an answer: the client sees the connection cut
            if request.transport is not None:
                request.transport.close()
            request.protocol.force_close()
            return web.Response()


def _authorized(request: web.Request, api_key: str) -> bool:
    given = request.headers.get("Authorization", "")
    return hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description="A stand-in SGLang server on a torch model (tests.support.sglang). Takes the flags "
        "asyncrl passes to `python -m sglang.launch_server`; GPU-only flags are accepted and ignored."
    )
    parser.add_argument(
        "--model-path", "--model", dest="model", required=True, help="Hugging Face model directory"
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port")
    parser.add_argument("--weight-version", default="default")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--skip-tokenizer-init", action="store_true", help="no tokenizer: token ids only")
    parser.add_argument(
        "--log-level", default="info", choices=["debug", "info", "warning", "error", "critical"]
    )
    parser.add_argument("--tp-size", "--tensor-parallel-size", dest="tp_size", type=int, default=1)
    parser.add_argument("--api-key", default="", help="require `Authorization: Bearer KEY` (not on /health*)")
    parser.add_argument("--enable-lora", action="store_true", help="accept /load_lora_adapter and lora_path")
    parser.add_argument("--max-lora-rank", type=int, default=None, help="largest adapter rank accepted")
    parser.add_argument(
        "--lora-target-modules", nargs="+", default=[], help="modules adapters may target ('all': any)"
    )
    for flag in IGNORED_FLAGS_WITH_VALUE:
        parser.add_argument(flag, default=None, help=argparse.SUPPRESS)
    for flag in IGNORED_SWITCHES:
        parser.add_argument(flag, action="store_true", help=argparse.SUPPRESS)
    args, unknown = parser.parse_known_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    if args.tp_size != 1:
        parser.error(
            f"the stand-in server runs one process per model: --tp-size must be 1, got {args.tp_size}"
        )
    if unknown:
        log.warning("ignoring flags the stand-in server does not know: %s", " ".join(unknown))
    server = StandInServer(
        args.model,
        host=args.host,
        port=args.port,
        weight_version=args.weight_version,
        threads=args.threads,
        skip_tokenizer_init=args.skip_tokenizer_init,
        lora=LoraSettings(
            enabled=args.enable_lora,
            max_rank=args.max_lora_rank,
            target_modules=tuple(args.lora_target_modules),
        ),
        api_key=args.api_key,
    )
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    server.start()
    print(f"SGLANG_STANDIN_URL {server.url}", flush=True)
    stop.wait()
    server.stop()


if __name__ == "__main__":
    main()
