"""Client CPU per /generate request of the `sglang` generator: the old thread-pool path against the
pooled aiohttp path, side by side, against one stand-in SGLang server.

    asyncrl bench sglang-client                          # 1, 64 and 1,000 concurrent requests
    asyncrl bench sglang-client --json                   # one JSON object on stdout
    asyncrl bench sglang-client --concurrency 64 1000 --requests 4000 --repeats 5
    (or `python -m asyncrl.benchmarks.sglang_client ...`; from a checkout's root, see below)

What is timed: N /generate requests (8 prompt ids, max_new_tokens 1, return_logprob) made by C
worker coroutines on one event loop, each taking the next request as soon as its last one is
answered, so C are in flight at once (a semaphore over N coroutines would do the same, but
asyncio's wakes a burst of waiters in quadratic time and would be what is measured); each request
builds and encodes its msgspec body, makes one HTTP exchange and decodes the answer into the
generator's wire type. The two paths:

  threads  the client before the pooled one (kept here only as the baseline): `http_call`
           (stdlib http.client, a new connection per request) in a ThreadPoolExecutor of C + 2
           workers (the old Fleet's sizing: max_concurrency + 2 per server), via run_in_executor;
  pooled   `Fleet.call` (asyncrl/generators/sglang/client.py): one aiohttp session, keep-alive
           connections, no thread.

Figures, per path and concurrency, medians of --repeats (3) timed runs after one untimed warm-up
run (which also opens the pooled path's connections, as a running generator has them open):

  requests/s        N / wall time; bounded by the server (a separate process on the same cores),
                    so it says more about the server than about the client;
  client CPU ms/req `time.process_time()` of this process (all its threads) over the run, / N;
  max in flight     the most /generate requests the server held at once (its counter,
                    `/standin/in_flight`; "-" for a real server);
  client threads    threads of this process at the end of a run.

The server is `python -m tests.support.sglang.server --skip-tokenizer-init` on the tiny model
`asyncrl.models.tiny` builds (or --model-path), a separate process started here and stopped by its
pid. The stand-in is test support in the repository, not in the installed package, so this runs
from a checkout's root; --url attaches to a running server instead, from anywhere (a real SGLang
server, say; prompt ids are drawn below --vocab-size, 20).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import msgspec

from asyncrl.generators.sglang.client import (
    Fleet,
    GenerateRequest,
    decode_generate,
    http_call,
)

PATHS = ("threads", "pooled")
# The stand-in SGLang server is test support of the repository (tests/support/sglang/), not part of
# the installed package: without --url this benchmark runs from a checkout's root.
STANDIN_MODULE = "tests.support.sglang.server"
_encode = msgspec.json.Encoder().encode
TIMEOUT_S = 600.0  # per request, as generators.options.request_timeout_s
PROMPT_LEN = 8


def build_model(root: Path) -> Path:
    from asyncrl.models.hf import quiet_offline
    from asyncrl.models.tiny import create_base

    quiet_offline()
    return create_base(root / "model", hidden_size=32, num_layers=1, num_heads=2, seed=0)


def start_standin(model_dir: Path) -> tuple[subprocess.Popen, str]:
    """The stand-in server as a process on a free port, from the current directory (a checkout's
    root): (its process, its URL) once it listens. The caller stops it, by this pid only."""
    cmd = [sys.executable, "-m", STANDIN_MODULE, "--model-path", str(model_dir), "--port", "0"]
    proc = subprocess.Popen(
        [*cmd, "--skip-tokenizer-init", "--log-level", "warning"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    line = proc.stdout.readline()  # blocks until the server listens (or exits: empty line)
    if not line.startswith("SGLANG_STANDIN_URL "):
        proc.kill()
        proc.wait()
        raise SystemExit(
            f"could not start the stand-in SGLang server (python -m {STANDIN_MODULE}): it is test "
            "support in a repository checkout; run this from the checkout's root, or pass --url"
        )
    return proc, line.split()[1]


def in_flight_peak(url: str, *, reset: bool) -> int | None:
    """The stand-in's peak of /generate requests in flight (POST also resets it); None elsewhere."""
    req = urllib.request.Request(f"{url}/standin/in_flight", data=b"{}" if reset else None)
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return int(json.loads(resp.read())["generate_in_flight_peak"])
    except (urllib.error.HTTPError, KeyError, ValueError):
        return None


def body(i: int, vocab_size: int) -> GenerateRequest:
    return GenerateRequest(
        input_ids=[1 + (i + j) % (vocab_size - 1) for j in range(PROMPT_LEN)],
        sampling_params={"max_new_tokens": 1, "temperature": 1.0, "sampling_seed": i},
        rid=f"bench-{i}",
        return_logprob=True,
    )


class ThreadsClient:
    """The old path: a blocking stdlib exchange per request, each in a pool thread."""

    def __init__(self, url: str, concurrency: int) -> None:
        self.url = url
        self.pool = ThreadPoolExecutor(concurrency + 2, thread_name_prefix="sglang-http")

    async def generate(self, req: GenerateRequest) -> None:
        data = _encode(req)
        loop = asyncio.get_running_loop()
        status, payload = await loop.run_in_executor(
            self.pool, http_call, self.url, "POST", "/generate", data, TIMEOUT_S
        )
        assert status == 200, payload
        decode_generate(payload)

    async def close(self) -> None:
        self.pool.shutdown(wait=True)


class PooledClient:
    """The new path: `Fleet.call` on the Fleet's pooled aiohttp session."""

    def __init__(self, url: str, concurrency: int) -> None:
        self.fleet = Fleet([url], max_connections=0, health_interval_s=60.0, wait_timeout_s=TIMEOUT_S)
        self.server = self.fleet.servers[0]

    async def generate(self, req: GenerateRequest) -> None:
        status, payload = await self.fleet.call(self.server, "POST", "/generate", req, timeout_s=TIMEOUT_S)
        assert status == 200, payload
        decode_generate(payload)

    async def close(self) -> None:
        await self.fleet.close()


async def one_run(client, *, url: str, num_requests: int, concurrency: int, start: int, vocab_size: int):
    todo = iter(range(start, start + num_requests))  # shared: each worker takes the next index

    async def worker() -> None:
        for i in todo:
            await client.generate(body(i, vocab_size))

    in_flight_peak(url, reset=True)
    cpu0, wall0 = time.process_time(), time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(min(concurrency, num_requests))))
    cpu_s, wall_s = time.process_time() - cpu0, time.perf_counter() - wall0
    return {
        "requests_per_s": num_requests / wall_s,
        "client_cpu_ms_per_request": 1e3 * cpu_s / num_requests,
        "max_in_flight": in_flight_peak(url, reset=False),
        "client_threads": threading.active_count(),
    }


async def measure(
    path: str, args: argparse.Namespace, url: str, concurrency: int, counter: list[int]
) -> dict:
    num_requests = args.requests or max(500, 3 * concurrency)
    client = (ThreadsClient if path == "threads" else PooledClient)(url, concurrency)
    runs = []
    try:
        for i in range(args.repeats + 1):  # run 0 warms up (threads started, connections open)
            run = await one_run(
                client,
                url=url,
                num_requests=num_requests,
                concurrency=concurrency,
                start=counter[0],
                vocab_size=args.vocab_size,
            )
            counter[0] += num_requests  # rids stay unique across runs
            if i > 0:
                runs.append(run)
    finally:
        await client.close()
    peaks = [r["max_in_flight"] for r in runs if r["max_in_flight"] is not None]
    return {
        "path": path,
        "concurrency": concurrency,
        "requests": num_requests,
        "requests_per_s": statistics.median(r["requests_per_s"] for r in runs),
        "client_cpu_ms_per_request": statistics.median(r["client_cpu_ms_per_request"] for r in runs),
        "max_in_flight": max(peaks) if peaks else None,
        "client_threads": max(r["client_threads"] for r in runs),
        "runs": runs,
    }


async def bench(args: argparse.Namespace, url: str) -> list[dict]:
    results = []
    counter = [0]
    for concurrency in args.concurrency:
        for path in PATHS:
            results.append(await measure(path, args, url, concurrency, counter))
            if not args.json:
                print(row(results[-1]), flush=True)
    return results


HEADER = (
    "| concurrent | path | requests/s | client CPU ms/request | max in flight | client threads |\n"
    "|---:|---|---:|---:|---:|---:|"
)


def row(r: dict) -> str:
    peak = "-" if r["max_in_flight"] is None else str(r["max_in_flight"])
    return (
        f"| {r['concurrency']} | {r['path']} | {r['requests_per_s']:.0f} | "
        f"{r['client_cpu_ms_per_request']:.3f} | {peak} | {r['client_threads']} |"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 64, 1000])
    parser.add_argument(
        "--requests", type=int, default=0, help="per run (default: max(500, 3 x concurrency))"
    )
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per path and concurrency")
    parser.add_argument("--url", default="", help="a running server instead of a stand-in started here")
    parser.add_argument("--model-path", default="", help="the stand-in's model (default: a tiny one)")
    parser.add_argument("--vocab-size", type=int, default=20, help="prompt ids are drawn below this")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    args = parser.parse_args(argv)
    if args.repeats < 1 or min(args.concurrency) < 1:
        parser.error("--repeats and every --concurrency must be >= 1")

    proc = None
    with tempfile.TemporaryDirectory(prefix="bench-sglang-client-") as tmp:
        url = args.url.rstrip("/")
        if not url:
            model_dir = Path(args.model_path) if args.model_path else build_model(Path(tmp))
            proc, url = start_standin(model_dir)
        try:
            if not args.json:
                print(HEADER, flush=True)
            results = asyncio.run(bench(args, url))
        finally:
            if proc is not None:
                proc.terminate()
                proc.wait(timeout=30)
    if args.json:
        print(json.dumps({"server": "stand-in" if proc else url, "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
