"""The `sglang` generator against in-process stand-in SGLang servers on loopback (CPU, real model).

Each server is `tests.support.sglang.server.StandInServer` on a free 127.0.0.1 port, in a
thread of the test process: nothing is spawned, nothing to kill.

With `ASYNCRL_SGLANG_URL` (a running real SGLang server) and `ASYNCRL_SGLANG_MODEL` (the model
directory it serves) set, the tests that need no stand-in hooks run against that server instead
(log-probs compared with a bf16-sized tolerance) and the others are skipped; see
`bench/gpu_sglang_check.sh`.
"""

from __future__ import annotations

import asyncio
import os
import socket
from pathlib import Path

import msgspec
import pytest
import torch

from asyncrl.messages import PromptTask, SamplingParams
from tests.conftest import set_up_generator

pytest.importorskip("transformers")

REAL_URL = os.environ.get("ASYNCRL_SGLANG_URL", "")
stand_in_only = pytest.mark.skipif(bool(REAL_URL), reason="uses the stand-in server's test hooks")
# Log-prob agreement with a float32 reference forward: exact math on the stand-in; a real server
# computes in bf16/fp16 on a GPU.
LOGPROB_ABS = 0.1 if REAL_URL else 1e-4


@pytest.fixture
def tiny_model_dir(tiny_model_dir):
    """The served model: the session's tiny model, or the real server's (ASYNCRL_SGLANG_MODEL)."""
    if REAL_URL:
        return Path(os.environ["ASYNCRL_SGLANG_MODEL"])
    return tiny_model_dir


class RealServer:
    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")


async def readmitted(fleet, *servers, timeout_s: float = 30.0) -> None:
    """Until every server of `servers` is in service again: the fleet's health loop readmits a
    server under its condition and notifies it, which is what this waits on (the deadline is a
    hang guard)."""
    changed = fleet._ensure_started()
    async with changed:
        await asyncio.wait_for(changed.wait_for(lambda: all(s.in_service for s in servers)), timeout_s)


def count_acquired(fleet, n: int) -> asyncio.Event:
    """An event set once `n` requests have taken a server of `fleet` (its `acquire`, observed)."""
    reached = asyncio.Event()
    acquire = fleet.acquire
    num_acquired = 0

    async def counting_acquire():
        nonlocal num_acquired
        server = await acquire()
        num_acquired += 1
        if num_acquired >= n:
            reached.set()
        return server

    fleet.acquire = counting_acquire
    return reached


@pytest.fixture
def servers(tiny_model_dir):
    from tests.support.sglang.server import StandInServer

    started = []

    def start(n: int = 1, **kw):
        if REAL_URL:
            assert n == 1, "one real server: tests with more are stand-in only"
            return [RealServer(REAL_URL)]
        for _ in range(n):
            started.append(StandInServer(str(tiny_model_dir), **kw).start())
        return started[-n:]

    yield start
    for s in started:
        s.stop()


def make_gen(model_dir: Path, urls: list[str], *, inflight: str = "retract", **options):
    from asyncrl.generators.sglang import SGLangGenerator

    gen = set_up_generator(
        SGLangGenerator,
        model_dir,
        run_seed=7,
        inflight=inflight,
        options={"urls": ",".join(urls), "health_interval_s": 0.05, **options},
    )
    return gen


def task(
    task_id: int = 0, *, num_samples: int = 4, max_new_tokens: int = 6, top_p: float = 1.0
) -> PromptTask:
    return PromptTask(
        task_id=task_id,
        group_id=task_id,
        prompt_ids=[1, 5, 6, 15, 7, 8, 17],  # "<bos>12+34="
        num_samples=num_samples,
        sampling=SamplingParams(temperature=1.0, top_p=top_p, max_new_tokens=max_new_tokens),
        dataset_index=task_id,
        window=0,
        answer="46",
    )


def check_rollouts(rollouts, tasks_) -> None:
    """One rollout per (task, sample index), with aligned ids / log-probs / versions."""
    got = sorted((r.task_id, r.sample_index) for r in rollouts)
    assert got == sorted((t.task_id, k) for t in tasks_ for k in range(t.num_samples))
    for r in rollouts:
        assert len(r.completion_ids) == len(r.behavior_logprobs) == len(r.token_versions) > 0
        assert all(lp <= 0 for lp in r.behavior_logprobs)
        assert r.token_versions == sorted(r.token_versions)


def reference_logprobs(model_dir, state, prompt, ids, *, temperature: float = 1.0) -> list[float]:
    """log_softmax(logits / T) of each sampled token, by one plain forward of prompt + ids."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    if state is not None:
        model.load_state_dict(state, strict=False)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + ids])).logits[0]
    logp = torch.log_softmax(logits[len(prompt) - 1 : -1] / temperature, dim=-1)
    return logp.gather(1, torch.tensor(ids)[:, None]).squeeze(1).tolist()


@stand_in_only
def test_samples_are_real_and_balanced(tiny_model_dir, servers):
    a, b = servers(2)
    gen = make_gen(tiny_model_dir, [a.url, b.url])

    async def go():
        try:
            return await gen.generate([task(0), task(1)])
        finally:
            await gen.close()

    rollouts = asyncio.run(go())
    check_rollouts(rollouts, [task(0), task(1)])
    assert a.engine.num_generate_requests > 0 and b.engine.num_generate_requests > 0
    assert a.engine.num_generate_requests + b.engine.num_generate_requests == 8
    r = rollouts[0]
    ref = reference_logprobs(tiny_model_dir, None, task(0).prompt_ids, r.completion_ids)
    assert r.behavior_logprobs == pytest.approx(ref, abs=LOGPROB_ABS)
    assert all(v == 0 for r in rollouts for v in r.token_versions)


def test_top_p_uses_the_sampling_mask_logprobs(tiny_model_dir, servers):
    """With top_p < 1 the behavior log-prob is the renormalised nucleus one (as sampled), which is
    larger than the full-vocabulary log-prob SGLang reports in output_token_logprobs."""
    (a,) = servers(1)
    gen = make_gen(tiny_model_dir, [a.url])

    async def go():
        try:
            return await gen.generate([task(0, top_p=0.5)])
        finally:
            await gen.close()

    rollouts = asyncio.run(go())
    check_rollouts(rollouts, [task(0)])
    r = rollouts[0]
    full = reference_logprobs(tiny_model_dir, None, task(0).prompt_ids, r.completion_ids)
    assert all(b > f + 1e-3 for b, f in zip(r.behavior_logprobs, full, strict=True))


def test_sampling_ignore_eos_reaches_the_server(tiny_model_dir, servers):
    """`sampling.ignore_eos` (the task's SamplingParams) samples every answer to its budget, as the
    generator option does for every task."""
    (a,) = servers(1)
    gen = make_gen(tiny_model_dir, [a.url])
    t = msgspec.structs.replace(
        task(0, num_samples=8), sampling=SamplingParams(max_new_tokens=6, ignore_eos=True)
    )

    async def go():
        try:
            return await gen.generate([t])
        finally:
            await gen.close()

    assert gen._sampling_params(t, 6, 0)["ignore_eos"] is True
    assert "ignore_eos" not in gen._sampling_params(task(0), 6, 0)
    rollouts = asyncio.run(go())
    check_rollouts(rollouts, [t])
    assert all(len(r.completion_ids) == 6 and r.finish_reason == "length" for r in rollouts)


@stand_in_only
def test_server_failing_mid_request_reissues_once_without_duplicates(tiny_model_dir, servers):
    a, b = servers(2)
    a.faults.append("disconnect")  # a's first /generate is cut after its first token
    gen = make_gen(tiny_model_dir, [a.url, b.url], max_concurrency=1)

    async def go():
        try:
            rollouts = await gen.generate([task(0, num_samples=3)])
            # a is healthy, so the health check readmits it
            await readmitted(gen.fleet, *gen.fleet.servers)
            return rollouts
        finally:
            await gen.close()

    rollouts = asyncio.run(go())
    check_rollouts(rollouts, [task(0, num_samples=3)])
    assert gen.num_reissues == 1
    cut = a.engine.rids[0]
    assert cut.endswith("-a0")
    reissued = cut[:-1] + "1"
    assert reissued in b.engine.rids  # the same sample, re-issued once, on the other server
    all_rids = a.engine.rids + b.engine.rids
    assert len(all_rids) == 3 + 1 and len(set(all_rids)) == 4
    assert ("abort_request", {"rid": cut, "abort_all": False}) in a.engine.control_log or not a.engine.running


def test_unknown_sampling_parameter_is_a_clear_error(tiny_model_dir, servers):
    from asyncrl.generators.sglang.client import SGLangRequestError

    (a,) = servers(1)
    gen = make_gen(tiny_model_dir, [a.url], extra_sampling_params='{"max_tokens": 4}')

    async def go():
        try:
            await gen.generate([task(0, num_samples=1)])
        finally:
            await gen.close()

    with pytest.raises(SGLangRequestError, match=r"unknown field `max_tokens`.*extra_sampling_params"):
        asyncio.run(go())
    assert all(s.in_service for s in gen.fleet.servers)  # a 4xx is our mistake, not the server's


def test_bad_options_fail_at_setup(tiny_model_dir):
    with pytest.raises(ValueError, match="urls"):
        make_gen(tiny_model_dir, [])
    with pytest.raises(ValueError, match="not an sglang generator option; valid: urls"):
        make_gen(tiny_model_dir, ["http://127.0.0.1:1"], max_concurency=3)
    with pytest.raises(ValueError, match="max_connections = 65 is too small.* = 66"):
        make_gen(tiny_model_dir, ["http://127.0.0.1:1"], max_connections=65)


@stand_in_only
def test_fleet_call_failures_are_server_unavailable(servers):
    """Over the pooled session: refused, 5xx, cut and over-the-timeout calls raise ServerUnavailable
    (the caller quarantines), a 4xx is an answer, and a closed fleet makes no more calls."""
    from asyncrl.generators.sglang.client import Fleet, GenerateRequest, ServerUnavailable, decode_generate

    (a,) = servers(1)
    closed_port = socket.socket()  # bound, never listening: connections to it are refused
    closed_port.bind(("127.0.0.1", 0))
    fleet = Fleet(
        [a.url, f"http://127.0.0.1:{closed_port.getsockname()[1]}"], health_interval_s=60, wait_timeout_s=10
    )
    up, down = fleet.servers

    def body(rid: str) -> GenerateRequest:
        return GenerateRequest(
            input_ids=[1, 5, 6], sampling_params={"max_new_tokens": 2}, rid=rid, return_logprob=True
        )

    async def go():
        try:
            with pytest.raises(ServerUnavailable, match="/health: ClientConnectorError"):
                await fleet.call(down, "GET", "/health", timeout_s=10)
            a.faults.append("error500")
            with pytest.raises(ServerUnavailable, match="/generate: HTTP 500: injected fault"):
                await fleet.call(up, "POST", "/generate", body("r500"), timeout_s=30)
            a.faults.append("disconnect")
            with pytest.raises(ServerUnavailable, match="/generate: ServerDisconnectedError"):
                await fleet.call(up, "POST", "/generate", body("rcut"), timeout_s=30)
            a.engine.hold()
            with pytest.raises(ServerUnavailable, match="no answer within 0.2 s"):
                await fleet.call(up, "POST", "/generate", body("rheld"), timeout_s=0.2)
            a.engine.release()
            ok = {"input_ids": [1], "sampling_params": {"max_new_tokens": 1}}
            status, data = await fleet.call(up, "POST", "/generate", ok, timeout_s=30)
            assert status == 200 and decode_generate(data).meta_info.finish_reason is not None
            status, data = await fleet.call(
                up,
                "POST",
                "/generate",
                {"input_ids": [1], "sampling_params": {"max_tokens": 1}},
                timeout_s=30,
            )
            assert status == 400 and b"unknown field" in data
        finally:
            await fleet.close()
            await fleet.close()  # idempotent
        with pytest.raises(ServerUnavailable, match="closed"):
            await fleet.call(up, "GET", "/health", timeout_s=10)

    try:
        asyncio.run(go())
    finally:
        closed_port.close()


def perturbed_state(model_dir) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    g = torch.Generator().manual_seed(3)
    return {n: (p + 0.5 * torch.randn(p.shape, generator=g)).detach() for n, p in model.state_dict().items()}


@stand_in_only
@pytest.mark.parametrize("inflight", ["retract", "keep"])
def test_inflight_update_pauses_and_tags_versions(tiny_model_dir, servers, tmp_path, inflight):
    """A weight update lands while a sample is mid-generation: pause -> load -> check -> continue on
    the server, tokens before the switch carry version 0 and after it version 1, and every log-prob
    comes from the weights that sampled it."""
    from asyncrl.transport.shards import write_shards

    (a,) = servers(1)
    state = perturbed_state(tiny_model_dir)
    write_shards(state, tmp_path / "w", 1, max_shard_bytes=1 << 20, fsync=False)
    gen = make_gen(tiny_model_dir, [a.url], inflight=inflight, ignore_eos=True)
    a.engine.hold_at_tokens = 3  # the scheduler stops stepping once the sample has 3 tokens

    async def go():
        try:
            job = asyncio.create_task(gen.generate([task(0, num_samples=1, max_new_tokens=8)]))
            assert await asyncio.to_thread(a.engine.held_event.wait, 30), "the request never reached the hold"
            await gen.load_weights(1, str(tmp_path / "w"))
            a.engine.release()
            return await job
        finally:
            await gen.close()

    (r,) = asyncio.run(go())
    mode = {"retract": "retract", "keep": "in_place"}[inflight]
    calls = [name for name, _ in a.engine.control_log]
    assert calls == ["pause_generation", "update_weights_from_disk", "continue_generation"]
    assert a.engine.control_log[0][1] == {"mode": mode}
    assert gen.version == 1
    assert r.token_versions == [0, 0, 0, 1, 1, 1, 1, 1]
    prompt = task(0).prompt_ids
    old = reference_logprobs(tiny_model_dir, None, prompt, r.completion_ids)
    new = reference_logprobs(tiny_model_dir, state, prompt, r.completion_ids)
    assert r.behavior_logprobs[:3] == pytest.approx(old[:3], abs=LOGPROB_ABS)
    assert r.behavior_logprobs[3:] == pytest.approx(new[3:], abs=LOGPROB_ABS)


def test_requests_wait_while_paused(tiny_model_dir, servers):
    """A /generate sent to a paused server blocks until continue_generation (SGLANG_API.md 1.6)."""
    (a,) = servers(1)
    gen = make_gen(tiny_model_dir, [a.url])

    async def go():
        try:
            await gen._control(gen.fleet.servers[0], "/pause_generation", {"mode": "retract"})
            acquired = count_acquired(gen.fleet, 2)
            job = asyncio.create_task(gen.generate([task(0, num_samples=2)]))
            await asyncio.wait_for(acquired.wait(), 30)  # both requests are out (a hang guard)
            assert gen.fleet.servers[0].outstanding == 2
            assert not job.done()
            if not REAL_URL:
                assert a.engine.num_generate_requests == 0
            await gen._control(gen.fleet.servers[0], "/continue_generation", {})
            return await job
        finally:
            await gen.close()

    check_rollouts(asyncio.run(go()), [task(0, num_samples=2)])


@stand_in_only
def test_abort_mode_pause_continues_from_partial_output(tiny_model_dir, servers):
    """An abort-mode pause returns partial tokens; the client continues from them (new rid)."""
    (a,) = servers(1)
    gen = make_gen(tiny_model_dir, [a.url], ignore_eos=True)
    a.engine.hold_at_tokens = 2

    async def go():
        try:
            job = asyncio.create_task(gen.generate([task(0, num_samples=1, max_new_tokens=6)]))
            assert await asyncio.to_thread(a.engine.held_event.wait, 30), "the request never reached the hold"
            a.engine.pause("abort")
            a.engine.release()
            a.engine.resume()
            return await job
        finally:
            await gen.close()

    (r,) = asyncio.run(go())
    assert len(r.completion_ids) == 6 and gen.num_aborted_segments == 1
    assert [rid[-2:] for rid in a.engine.rids] == ["a0", "a1"]
    ref = reference_logprobs(tiny_model_dir, None, task(0).prompt_ids, r.completion_ids)
    assert r.behavior_logprobs == pytest.approx(ref, abs=LOGPROB_ABS)


@stand_in_only
def test_server_behind_on_weights_is_quarantined_and_caught_up(tiny_model_dir, servers, tmp_path):
    """A server that fails a weight push leaves service; once healthy it is brought to the current
    version before it gets samples again."""
    from asyncrl.transport.shards import write_shards

    a, b = servers(2)
    write_shards(perturbed_state(tiny_model_dir), tmp_path / "w", 1, max_shard_bytes=1 << 20, fsync=False)
    gen = make_gen(tiny_model_dir, [a.url, b.url])
    b.healthy = False
    b_server = gen.fleet.servers[1]

    async def go():
        try:
            gen.fleet.quarantine(b_server, "test: marked down")
            await gen.load_weights(1, str(tmp_path / "w"))
            assert a.engine.weight_version == "1" and b.engine.weight_version == "default"
            b.healthy = True
            await gen.generate([task(0, num_samples=1)])  # starts the health loop
            await readmitted(gen.fleet, b_server)
            return await gen.generate([task(1, num_samples=4)])
        finally:
            await gen.close()

    rollouts = asyncio.run(go())
    assert b.engine.weight_version == "1"
    assert all(v == 1 for r in rollouts for v in r.token_versions)


@stand_in_only
def test_corrupt_shards_never_reach_the_servers(tiny_model_dir, servers, tmp_path):
    from asyncrl.transport.manifest import WeightsCorruptError
    from asyncrl.transport.shards import write_shards

    (a,) = servers(1)
    write_shards(perturbed_state(tiny_model_dir), tmp_path / "w", 1, max_shard_bytes=1 << 20, fsync=False)
    shard = next((tmp_path / "w" / "v00000001").glob("*.safetensors"))
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    gen = make_gen(tiny_model_dir, [a.url])

    async def go():
        try:
            await gen.load_weights(1, str(tmp_path / "w"))
        finally:
            await gen.close()

    with pytest.raises(WeightsCorruptError, match="fails its xxh3 check"):
        asyncio.run(go())
    assert a.engine.control_log == [] and gen.version == 0


def test_samples_match_a_reference_forward(tiny_model_dir, servers):
    (a,) = servers(1)
    gen = make_gen(tiny_model_dir, [a.url])

    async def go():
        try:
            return await gen.generate([task(0, num_samples=2)])
        finally:
            await gen.close()

    rollouts = asyncio.run(go())
    check_rollouts(rollouts, [task(0, num_samples=2)])
    for r in rollouts:
        ref = reference_logprobs(tiny_model_dir, None, task(0).prompt_ids, r.completion_ids)
        assert r.behavior_logprobs == pytest.approx(ref, abs=LOGPROB_ABS)


def test_weight_update_from_disk_switches_versions(tiny_model_dir, servers, tmp_path):
    """Last in the file: on a real server it leaves version 1 loaded. Pause, load from the shards,
    check /model_info, continue; later samples carry version 1 and the new weights' log-probs."""
    from asyncrl.transport.shards import collect_config_files, write_shards

    (a,) = servers(1)
    state = perturbed_state(tiny_model_dir)
    extra = collect_config_files(Path(tiny_model_dir))
    write_shards(state, tmp_path / "w", 1, max_shard_bytes=1 << 20, extra_files=extra, fsync=False)
    gen = make_gen(tiny_model_dir, [a.url])

    async def go():
        try:
            await gen.load_weights(1, str(tmp_path / "w"))
            return await gen.generate([task(0, num_samples=2)])
        finally:
            await gen.close()

    rollouts = asyncio.run(go())
    assert gen.version == 1
    assert all(v == 1 for r in rollouts for v in r.token_versions)
    for r in rollouts:
        ref = reference_logprobs(tiny_model_dir, state, task(0).prompt_ids, r.completion_ids)
        assert r.behavior_logprobs == pytest.approx(ref, abs=LOGPROB_ABS)
