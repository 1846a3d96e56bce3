"""The built-in `sglang` generator: a token-in/token-out client for one or more SGLang servers.

Place in the data flow: the generator service feeds it samples (`generate_stream`: up to
`max_concurrency` in flight, a new one as soon as one is done) or PromptTasks (`generate`); it
sends one native /generate per sample (`input_ids`, `return_logprob`) to the least-loaded healthy
server, reads the sampled ids, behavior log-probs and per-token weight versions
(`meta_info.weight_versions` spans) from the answer, and hands each Rollout, scored by the task
(`generators/rollouts.py`), back as soon as its own answer is in. It attaches to
running servers (`urls`) or starts them itself (`launch`, `launch.py`; stopped on close).
Weights: safetensors shards go pause -> /update_weights_from_disk -> /model_info check ->
continue on every server (SGLANG_API.md section 6); with weights.transport=broadcast the servers
join the learner's weight update group and take every version over it (`group.py`, the
learner's side in `publisher.py`, found through the `asyncrl.publishers` plugin registry). A
version published as a LoRA adapter (learner.lora.publish = "adapter") is loaded into every server
with /load_lora_adapter and named by each new request's `lora_path` (`adapters.py`); the servers
then need `--enable-lora --max-lora-rank R` (launch_args, or however they were started).

Options (`generators.options.*`; either `urls` or `launch`, the rest optional; checked by
`options.py` when the job is loaded):

| option | default | meaning |
|---|---|---|
| `urls` | - | comma-separated `http://HOST:PORT` of running servers (one per GPU, or routers) |
| `launch` | - | start this many servers instead, one per GPU, on free ports of cluster.bind_host (loopback) |
| `model_path` | the job's model | launch: `--model-path` of the servers |
| `launch_command` | `python -m sglang.launch_server` | launch: the server program (`python` = this interpreter) |
| `launch_args` | `""` | launch: more server flags, e.g. `"--disable-cuda-graph --log-level warning"` |
| `gpus` | CUDA_VISIBLE_DEVICES or `0..N-1` | launch: comma-separated device per server (its CUDA_VISIBLE_DEVICES) |
| `mem_fraction_static` | server default | launch: `--mem-fraction-static` |
| `max_concurrency` | 64 | samples in flight at once over all servers |
| `request_timeout_s` | 600 | one /generate (a paused server holds requests) |
| `startup_timeout_s` | 120 (urls), 600 (launch) | wait for every server's /health (/health_generate when launched) |
| `health_interval_s` | 2 | how often a quarantined server is checked for readmission |
| `max_retries` | 2 | re-issues of one sample after server failures before the batch fails |
| `pause_mode` | from `weights.inflight` | `in_place` (keep), `retract` (retract) or `abort` (abort) |
| `verify_shards` | true | check the shards' checksums (weights.checksum) before servers load them |
| `extra_sampling_params` | `{}` | JSON object merged into `sampling_params` (e.g. `{"top_k": 20}`) |
| `ignore_eos` | false | sample to `max_new_tokens` (benchmarks; also `sampling.ignore_eos`) |
| `api_key_env` | `""` | name of an env var holding the servers' API key: launched servers get `--api-key`, every call `Authorization: Bearer` |

Launched servers get `--model-path`, `--host` (cluster.bind_host), `--port`, `--weight-version 0`
(and `--mem-fraction-static`), then `launch_args`; their logs are `<run>/logs/sglang-<generator>-<i>.log`
and `<run>/logs/sglang-<generator>.json` lists their urls and pids. With `launch` and with
weights.transport=broadcast, generators.num_generators must be 1.

No duplicates: a sample is one coroutine that produces exactly one Rollout. A request that fails
(connection refused or cut, timeout, 5xx) is abandoned (best-effort /abort_request of its rid) and
re-issued, with a new rid and the same seed, on another server; its answer, if any, is never read.
An `abort` answer (a server paused in abort mode) keeps its partial tokens and continues from them
(or restarts, with `weights.inflight = abort`).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import tempfile
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from asyncrl.generators.base import GeneratorContext, Rollout
from asyncrl.generators.feed import concurrent_stream
from asyncrl.generators.rollouts import RolloutBuilder
from asyncrl.generators.sglang.adapters import (
    AdapterBook,
    Unloader,
    cut_requests,
    is_adapter_dir,
    load_adapter,
)
from asyncrl.generators.sglang.client import (
    Fleet,
    GenerateRequest,
    GenerateResponse,
    Server,
    ServerUnavailable,
    SGLangRequestError,
    decode_generate,
    decode_model_info,
    decode_update,
    wait_until_healthy,
)
from asyncrl.generators.sglang.options import (
    OPTIONS,
    PAUSE_MODES,
    check_config,
    parse_options,
    resolve_api_key,
)
from asyncrl.messages import BroadcastPublished, CanaryScores, PromptTask, SamplingParams
from asyncrl.transport import security

if TYPE_CHECKING:
    from asyncrl.config import Config
    from asyncrl.generators.episode_runner import TurnOutput, TurnRequest
    from asyncrl.generators.feed import SampleFeed

log = logging.getLogger(__name__)

__all__ = ["OPTIONS", "PAUSE_MODES", "SGLangGenerator", "parse_options", "segment_seed", "verify_shards"]

CONTROL_TIMEOUT_S = 600.0  # pause waits for in-flight requests; a disk load reads the whole model
MAX_ABORTS_PER_SAMPLE = 1000  # a server paused in abort mode forever would otherwise spin


def segment_seed(base_seed: int, num_tokens_so_far: int) -> int:
    """The seed of a continuation after an abort: fresh uniforms for the new tokens, still
    deterministic. The first segment uses the sample's own seed (as the torch generator does)."""
    if num_tokens_so_far == 0:
        return base_seed
    digest = hashlib.sha256(f"{base_seed}:{num_tokens_so_far}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


class SGLangGenerator:
    """Samples on SGLang servers over HTTP; see the module docstring."""

    def __init__(self) -> None:
        self._version = 0
        self._ctx: GeneratorContext | None = None
        self._weights: tuple[int, str] | None = None  # (version, directory) the servers should hold
        self._weights_lock: asyncio.Lock | None = None
        self._slots: asyncio.Semaphore | None = None
        self._launched: list = []  # launch.ServerProcess, when the generator started them
        self._ready_lock: asyncio.Lock | None = None
        self._ready = False
        self._group = None  # group.GroupUpdater, once the servers joined a weight update group
        self._adapters: AdapterBook | None = None  # LoRA adapters on the servers (adapters.py)
        self._unloader: Unloader | None = None
        self._closed = False
        self.num_reissues = 0
        self.num_aborted_segments = 0
        self._episodes = None  # env.kind set: generators/episodes.py, turns through `turn`
        self._stop_ids: list[int] = []
        self._turns_issued = 0

    @staticmethod
    def check_config(config: Config) -> None:
        """`asyncrl launch` calls this before any process starts: options and their conflicts."""
        check_config(config)
        if config.env.kind:
            from asyncrl.environments.base import resolve_environment

            resolve_environment(config.env.kind)

    def setup(self, ctx: GeneratorContext) -> None:
        from transformers import AutoTokenizer

        self._ctx = ctx
        self.opts = parse_options(dict(ctx.options), ctx.inflight)
        if ctx.opd is not None and getattr(ctx.opd, "enabled", False):
            raise ValueError(
                "the sglang generator does not score with an OPD teacher yet; use generators.kind=torch"
            )
        # Launch first: the servers load their model while this process loads its tokenizer. The
        # wait for them is in `_servers_ready`, after Hello, so a slow start never looks like a
        # generator that hangs.
        self._api_key = resolve_api_key(self.opts)  # generators.options.api_key_env, read on this host
        try:
            urls = self._launch(ctx) if self.opts["launch"] else self.opts["urls"]
            self.fleet = Fleet(
                urls,
                api_key=self._api_key,
                max_connections=self.opts["max_connections"],
                health_interval_s=float(self.opts["health_interval_s"]),
                wait_timeout_s=float(self.opts["request_timeout_s"]),
            )
            self.fleet.on_readmit = self._bring_up_to_date
            self._adapters = AdapterBook(ctx.generator_id)
            self._unloader = Unloader(self.fleet.call, self.fleet.servers, self._adapters)
            tokenizer = AutoTokenizer.from_pretrained(ctx.model_path)
            self._rollouts = RolloutBuilder.for_task(ctx.task, tokenizer)
            if ctx.env is not None and ctx.env.kind:
                from asyncrl.generators.episodes import Episodes, stop_token_ids

                self._stop_ids = list(stop_token_ids(tokenizer, list(ctx.env.stop_tokens)))
                self._episodes = Episodes(ctx, self, tokenizer)
        except BaseException:
            if self._launched:  # nobody will call close() on a generator whose setup failed
                from asyncrl.generators.sglang.launch import stop_servers

                stop_servers(self._launched)
            raise
        if not self._launched:
            wait_until_healthy(
                [s.url for s in self.fleet.servers],
                float(self.opts["startup_timeout_s"]),
                api_key=self._api_key,
            )
            self._ready = True

    def _launch(self, ctx: GeneratorContext) -> list[str]:
        from asyncrl.generators.sglang.launch import LaunchSpec, launch_servers, write_record

        log_dir = (
            Path(ctx.run_dir) / "logs" if ctx.run_dir else Path(tempfile.mkdtemp(prefix="asyncrl-sglang-"))
        )
        name = f"sglang-{ctx.generator_id}"
        spec = LaunchSpec(
            command=tuple(self.opts["launch_command"]),
            model_path=self.opts["model_path"] or ctx.model_path,
            num_servers=self.opts["launch"],
            log_dir=log_dir,
            name=name,
            gpus=self.opts["gpus"],
            extra_args=tuple(self.opts["launch_args"]),
            mem_fraction_static=self.opts["mem_fraction_static"],
            host=security.current().bind_host,  # cluster.bind_host (installed by run_child)
            advertise_host=security.current().advertise_host,
            api_key=self._api_key,
        )
        self._launched = launch_servers(spec)
        write_record(self._launched, log_dir / f"{name}.json")
        return [s.url for s in self._launched]

    async def _servers_ready(self) -> None:
        """Launched servers: wait (once) until all answer /health_generate; on failure stop them."""
        if self._ready:
            return
        from asyncrl.generators.sglang.launch import stop_servers, wait_ready

        if self._ready_lock is None:
            self._ready_lock = asyncio.Lock()
        async with self._ready_lock:
            if self._ready:
                return
            try:
                await asyncio.to_thread(wait_ready, self._launched, float(self.opts["startup_timeout_s"]))
            except BaseException:
                await asyncio.to_thread(stop_servers, self._launched)
                raise
            self._ready = True

    @property
    def version(self) -> int:
        return self._version

    # ------------------------------------------------------------------ sampling
    def _label_version(self, label: str, server: Server) -> int:
        if label == "default":
            return 0
        if label.isdigit():
            return int(label)
        raise ValueError(
            f"SGLang server {server.url} reports weight version {label!r}; asyncrl needs integer labels "
            "(launch servers with --weight-version 0, or leave the default)"
        )

    def _sampling_params(self, of: SamplingParams | PromptTask, budget: int, seed: int) -> dict[str, Any]:
        """The request's `sampling_params` for sampling params `of` (or a task's)."""
        s = of.sampling if isinstance(of, PromptTask) else of
        params: dict[str, Any] = {
            "max_new_tokens": budget,
            "temperature": float(s.temperature),
            "top_p": float(s.top_p),
            "sampling_seed": seed,
            "no_stop_trim": True,
            "skip_special_tokens": False,
        }
        if self.opts["ignore_eos"] or s.ignore_eos:
            params["ignore_eos"] = True
        return {**params, **self.opts["extra_sampling_params"]}

    def _tokens(self, resp: GenerateResponse, server: Server) -> tuple[list[int], list[float], list[int]]:
        """(ids, behavior log-probs, versions) of one answer, checked for consistency."""
        meta = resp.meta_info
        ids = [t for _, t, _ in meta.output_token_logprobs]
        logps = [lp for lp, _, _ in meta.output_token_logprobs]
        if meta.output_token_sampling_logprobs is not None:  # exact truncated (top-p/top-k) distribution
            logps = [float(x) for x in meta.output_token_sampling_logprobs]
        if len(logps) != len(ids) or (resp.output_ids and resp.output_ids != ids):
            raise ValueError(
                f"SGLang server {server.url} answered inconsistent output_ids and log-probs ({meta.id})"
            )
        versions = [self._version] * len(ids)
        if meta.weight_versions:
            for span in meta.weight_versions:
                v = self._label_version(span.version, server)
                versions[span.start : span.end] = [v] * (span.end - span.start)
        elif ids:
            log.warning(
                "SGLang server %s sends no weight_versions (sglang < 0.5.20?); using weight_version",
                server.url,
            )
            versions = [self._label_version(meta.weight_version or "default", server)] * len(ids)
        return ids, logps, versions

    async def _request(self, server: Server, body: GenerateRequest) -> GenerateResponse:
        status, data = await self.fleet.call(
            server, "POST", "/generate", body, timeout_s=float(self.opts["request_timeout_s"])
        )
        if status != 200:
            raise SGLangRequestError(
                f"SGLang server {server.url} rejected /generate (HTTP {status}): {_short(data)}. "
                "Check generators.options.extra_sampling_params and sampling.* against the server's "
                "sampling_params (SGLANG_API.md section 1.2)."
            )
        return decode_generate(data)

    async def _sample(self, task: PromptTask, k: int) -> Rollout:
        """Sample `k` of `task` on a server slot (`_decode`), scored and built into a Rollout."""
        from asyncrl.models.sampling import sample_seed

        assert self._ctx is not None
        base_seed = sample_seed(self._ctx.run_seed, task.group_id, k, task.attempt)
        ids, logps, versions, finish = await self._decode(
            list(task.prompt_ids),
            task.sampling,
            task.sampling.max_new_tokens,
            base_seed,
            label=f"t{task.task_id}-s{k}",
        )
        return self._rollouts.build(
            task,
            k,
            completion_ids=ids,
            behavior_logprobs=logps,
            token_versions=versions,
            finish_reason=finish,
        )

    async def turn(self, request: TurnRequest) -> TurnOutput:
        """One model turn of an agentic episode (`generators/episode_runner.py`): the episode's ids in,
        the turn's ids, behavior log-probs and versions out; it ends at eos, a stop token
        (`env.stop_tokens`, sent as `stop_token_ids`) or its budget. Holds a slot only while it decodes."""
        from asyncrl.generators.episode_runner import TurnOutput

        self._turns_issued += 1
        out = await self._decode(
            request.ids,
            request.sampling,
            request.max_new_tokens,
            request.seed,
            label=f"turn{self._turns_issued}",
            stop_ids=self._stop_ids,
        )
        return TurnOutput(*out)

    async def _decode(
        self,
        prompt_ids: list[int],
        sampling: SamplingParams,
        max_new: int,
        base_seed: int,
        *,
        label: str,
        stop_ids: Sequence[int] = (),
    ) -> tuple[list[int], list[float], list[int], str]:
        """(ids, behavior log-probs, versions, finish_reason) of up to `max_new` tokens after
        `prompt_ids`, on a server slot: one request per segment, re-issued on another server when
        one fails, resumed after an abort (an in-flight weight update) with the tokens so far, or
        restarted under `weights.inflight = "abort"`."""
        assert self._ctx is not None and self._slots is not None
        ids: list[int] = []
        logps: list[float] = []
        versions: list[int] = []
        failures = aborts = attempt = 0
        use_mask = sampling.top_p < 1.0 and sampling.temperature > 0
        async with self._slots:
            while True:
                rid = f"{self._ctx.generator_id}-{label}-a{attempt}"
                attempt += 1
                adapter = self._adapters.acquire() if self._adapters is not None else None
                body = self._request_body(
                    prompt_ids, sampling, max_new, ids, base_seed, rid=rid, adapter=adapter, use_mask=use_mask
                )
                if stop_ids:
                    body.sampling_params["stop_token_ids"] = list(stop_ids)
                try:
                    server = await self.fleet.acquire()
                except BaseException:
                    self._release_adapter(adapter)
                    raise
                try:
                    resp = await self._request(server, body)
                except ServerUnavailable as exc:
                    failures += 1
                    self._reissue(label, server, rid, exc, failures)
                    continue
                finally:
                    self.fleet.release(server)
                    self._release_adapter(adapter)
                new_ids, new_logps, new_versions = self._tokens(resp, server)
                if adapter is not None:  # every token came from the adapter the request named
                    new_versions = [adapter[0]] * len(new_ids)
                finish = (resp.meta_info.finish_reason or {}).get("type", "")
                if finish == "abort":
                    aborts += 1
                    self.num_aborted_segments += 1
                    if aborts > MAX_ABORTS_PER_SAMPLE:
                        raise ServerUnavailable(f"{label} was aborted {aborts} times")
                    if self._ctx.inflight == "abort":
                        ids, logps, versions = [], [], []
                        continue
                ids += new_ids
                logps += new_logps
                versions += new_versions
                if finish == "abort" and len(ids) < max_new:
                    continue
                if finish not in ("stop", "length", "abort"):
                    raise ValueError(
                        f"SGLang server {server.url} answered finish_reason {finish!r} for {rid}"
                    )
                break
        return ids, logps, versions, "stop" if finish == "stop" else "length"

    def _request_body(
        self,
        prompt_ids: list[int],
        sampling: SamplingParams,
        max_new: int,
        ids: list[int],
        base_seed: int,
        *,
        rid: str,
        adapter,
        use_mask: bool,
    ) -> GenerateRequest:
        """The request of one segment: the prompt and the tokens so far, the rest of the budget,
        the segment's seed (from the tokens so far, so a resumed sample draws as an unbroken one)."""
        return GenerateRequest(
            input_ids=prompt_ids + ids,
            sampling_params=self._sampling_params(
                sampling, max_new - len(ids), segment_seed(base_seed, len(ids))
            ),
            rid=rid,
            return_logprob=True,
            return_sampling_mask=use_mask,
            sampling_logprobs_mode="selected" if use_mask else None,
            lora_path=adapter[1] if adapter else None,
        )

    def _reissue(self, label: str, server, rid: str, exc: ServerUnavailable, failures: int) -> None:
        """A server failed a segment: quarantine it, abort the request there, and let the caller
        re-issue it, unless the sample has failed more than `max_retries` times (raised)."""
        self.fleet.quarantine(server, str(exc))
        asyncio.get_running_loop().create_task(self._abort_quietly(server, rid))
        if failures > self.opts["max_retries"]:
            raise ServerUnavailable(
                f"{label} failed {failures} times "
                f"(generators.options.max_retries = {self.opts['max_retries']}); last: {exc}"
            ) from None
        self.num_reissues += 1
        log.warning("re-issuing %s after: %s", label, exc)

    def _release_adapter(self, adapter: tuple[int, str] | None) -> None:
        if adapter is not None and self._adapters is not None and self._unloader is not None:
            self._unloader.start(self._adapters.release(adapter[1]))

    async def _abort_quietly(self, server: Server, rid: str) -> None:
        """Best effort: a failed request must not keep a server busy (its answer is never read)."""
        try:
            await self.fleet.call(server, "POST", "/abort_request", {"rid": rid}, timeout_s=5.0)
        except ServerUnavailable:
            pass

    @property
    def env_counters(self) -> dict[str, float]:
        """The episode counters (`env/...` metrics); empty without an environment."""
        return {} if self._episodes is None else self._episodes.counters()

    async def generate(self, tasks: Sequence[PromptTask]) -> list[Rollout]:
        await self._servers_ready()
        if self._slots is None:
            self._slots = asyncio.Semaphore(int(self.opts["max_concurrency"]))
        if self._episodes is not None:
            return await self._episodes.generate(tasks, self._episodes.stream)
        jobs = [self._sample(task, k) for task in tasks for k in range(task.num_samples)]
        return list(await asyncio.gather(*jobs))

    async def generate_stream(self, feed: SampleFeed) -> AsyncIterator[list[Rollout]]:
        """Keep up to `max_concurrency` samples of `feed` in flight and yield each one's Rollout
        as soon as its answer is in (those done together in one list); ends when nothing is in
        flight and the feed gives nothing. A sample that fails for good ends the stream with its
        error, and the others in flight are cancelled."""
        await self._servers_ready()
        if self._slots is None:
            self._slots = asyncio.Semaphore(int(self.opts["max_concurrency"]))
        if self._episodes is not None:  # every sample an episode; a turn holds a slot while it decodes
            async for rollouts in self._episodes.stream(feed):
                yield rollouts
            return
        async for rollouts in concurrent_stream(
            feed, int(self.opts["max_concurrency"]), lambda d: self._sample(d.task, d.sample_index)
        ):
            yield rollouts

    # ------------------------------------------------------------------ weights
    async def _control(self, server: Server, path: str, body: dict[str, Any]) -> None:
        status, data = await self.fleet.call(server, "POST", path, body, timeout_s=CONTROL_TIMEOUT_S)
        if status != 200:
            raise SGLangRequestError(f"{server.url}{path} answered HTTP {status}: {_short(data)}")

    async def server_version(self, server: Server) -> str | None:
        status, data = await self.fleet.call(server, "GET", "/model_info", timeout_s=30.0)
        if status != 200:
            raise SGLangRequestError(f"{server.url}/model_info answered HTTP {status}: {_short(data)}")
        return decode_model_info(data).weight_version

    async def _push(self, server: Server, version: int, directory: str) -> None:
        """pause -> load from disk -> check /model_info -> continue, on one server; a LoRA
        adapter directory is loaded alongside the base weights instead (`adapters.py`)."""
        if is_adapter_dir(Path(directory)):
            assert self._adapters is not None
            await load_adapter(
                self.fleet.call, server, self._adapters.name(version), directory, self._adapters
            )
            return
        mode = self.opts["pause_mode"]
        await self._control(server, "/pause_generation", {"mode": mode})
        try:
            status, data = await self.fleet.call(
                server,
                "POST",
                "/update_weights_from_disk",
                {
                    "model_path": directory,
                    "weight_version": str(version),
                    "abort_all_requests": False,
                    "flush_cache": mode != "in_place",  # in_place keeps live KV: a flush would fail
                },
                timeout_s=CONTROL_TIMEOUT_S,
            )
            result = decode_update(data) if data.strip().startswith(b"{") else None
            if status != 200 or result is None or not result.success:
                raise SGLangRequestError(
                    f"{server.url} could not load weights version {version} from {directory}: {_short(data)}"
                )
            reported = await self.server_version(server)
            if reported != str(version):
                raise SGLangRequestError(
                    f"{server.url} reports weight version {reported!r} after loading version {version}"
                )
        finally:
            await self._control(server, "/continue_generation", {})

    def _lock(self) -> asyncio.Lock:
        """Serialises weight pushes (a load and a readmission never interleave on a server)."""
        if self._weights_lock is None:
            self._weights_lock = asyncio.Lock()
        return self._weights_lock

    async def _bring_up_to_date(self, server: Server) -> bool:
        """Readmission check: the server must hold the weights the others hold (pushed if not)."""
        async with self._lock():
            try:
                label = await self.server_version(server)
                if label is not None and label.isdigit() and int(label) == self._version:
                    return True
                if self._weights is None:
                    return label == "default" and self._version == 0
                await self._push(server, *self._weights)
                return True
            except (ServerUnavailable, SGLangRequestError) as exc:
                server.last_error = str(exc)
                return False

    async def load_weights(self, version: int, location: str) -> None:
        from asyncrl.transport.retention import version_dir

        await self._servers_ready()
        if self.opts["verify_shards"]:
            await asyncio.to_thread(verify_shards, Path(location), version)
        directory = str(version_dir(Path(location), version))
        async with self._lock():
            servers = self.fleet.in_service()
            results = await asyncio.gather(
                *(self._push(s, version, directory) for s in servers), return_exceptions=True
            )
            loaded = 0
            errors = []
            for server, result in zip(servers, results, strict=True):
                if isinstance(result, ServerUnavailable | SGLangRequestError):
                    self.fleet.quarantine(server, f"weights version {version}: {result}")
                    errors.append(str(result))
                elif isinstance(result, BaseException):
                    raise result
                else:
                    loaded += 1
            if loaded == 0:
                from asyncrl.transport.manifest import WeightsCorruptError

                if servers and all("could not load" in e for e in errors):  # every server refused the files
                    raise WeightsCorruptError(
                        f"no SGLang server could load weights version {version}: {errors[0]}"
                    )
                raise ServerUnavailable(
                    f"no SGLang server took weights version {version}: {'; '.join(errors) or 'none in service'}"
                )
            self._weights = (version, directory)
            self._version = version
            if is_adapter_dir(Path(directory)):
                await self._switch_adapter(
                    version, [s for s, r in zip(servers, results, strict=True) if r is None]
                )

    async def _switch_adapter(self, version: int, servers: list[Server]) -> None:
        """New requests name adapter `version` from now on; with pause_mode retract or abort the
        servers' running requests are cut so they continue (or restart) under it."""
        assert self._adapters is not None and self._unloader is not None
        self._unloader.start(self._adapters.switch(version, self._adapters.name(version)))
        if self.opts["pause_mode"] == "in_place":
            return
        results = await asyncio.gather(
            *(cut_requests(self.fleet.call, s) for s in servers), return_exceptions=True
        )
        for server, result in zip(servers, results, strict=True):
            if isinstance(result, ServerUnavailable | SGLangRequestError):
                self.fleet.quarantine(server, f"cutting requests for adapter version {version}: {result}")
            elif isinstance(result, BaseException):
                raise result

    async def receive_broadcast(self, msg: BroadcastPublished) -> None:
        """weights.transport=broadcast: the servers take version `msg.version` over the learner's
        weight update group, joining it on the founding announcement (`group.py`)."""
        from asyncrl.generators.sglang.group import GroupUpdater

        assert self._ctx is not None
        await self._servers_ready()
        async with self._lock():
            if self._group is None:
                group = GroupUpdater(
                    self.fleet.call, generator_id=self._ctx.generator_id, pause_mode=self.opts["pause_mode"]
                )
                # Every server is a rank: quarantined ones too (the learner sends to all of them).
                await group.join(msg, self.fleet.servers)
                self._group = group
            await self._group.update(msg)
            self._weights = None  # no directory holds this version: readmission cannot push it
            self._version = msg.version

    async def score_canary(self, ids: Sequence[Sequence[int]]) -> list[CanaryScores]:
        """The weight-load canary (`generators/canary.py`), on every server in service, under the
        weights loaded last (and the adapter new requests name, held while it is scored)."""
        from asyncrl.generators.sglang.canary import score_on_servers

        assert self._ctx is not None
        adapter = self._adapters.acquire() if self._adapters is not None else None
        try:
            return await score_on_servers(
                self.fleet,
                ids,
                name=self._ctx.generator_id,
                adapter=adapter[1] if adapter else None,
                timeout_s=float(self.opts["request_timeout_s"]),
            )
        finally:
            self._release_adapter(adapter)

    async def close(self) -> None:
        """Leave the weight update group, stop the HTTP side, stop launched servers; idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._episodes is not None:
                await self._episodes.aclose()
            if self._group is not None:
                await self._group.leave()
            if self._unloader is not None:
                await self._unloader.close()
            if hasattr(self, "fleet"):
                await self.fleet.close()
        finally:
            if self._launched:
                from asyncrl.generators.sglang.launch import stop_servers

                await asyncio.to_thread(stop_servers, self._launched)


def verify_shards(root: Path, version: int) -> None:
    """Check every file of a published version against its manifest (size and checksum) without
    loading tensors; raises WeightsCorruptError / FileNotFoundError like `read_shards`."""
    from asyncrl.transport.shard_read import verify_files

    verify_files(root, version)


def _short(data: bytes, limit: int = 600) -> str:
    from asyncrl.generators.sglang.client import error_message

    text = error_message(data)
    return text if len(text) <= limit else text[:limit] + "..."
