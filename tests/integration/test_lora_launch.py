"""LoRA adapters from the learner to SGLang servers (learner.lora.publish = "adapter").

The first tests drive the `sglang` generator against in-process stand-in servers
(`tests.support.sglang.server.StandInServer`, loopback, threads of this process): each published
adapter version is loaded with /load_lora_adapter, new samples name it with `lora_path`, their tokens
carry its version and its log-probs, an older adapter is unloaded once no request names it, and the
in-flight modes hold. The last test launches the default job's model with two stand-in server
processes (`--enable-lora --max-lora-rank 8`) and `--set learner.lora.rank=8 learner.lora.publish=adapter`,
and checks that the servers loaded the adapter versions the learner published and the run completed.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import time
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from asyncrl.messages import PromptTask, SamplingParams
from tests.conftest import read_records, set_up_generator, short_job_args, start_standin_server

pytest.importorskip("peft")

PROMPT = [1, 5, 6, 15, 7, 8, 17]  # "<bos>12+34="


def load(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def publish(model_dir, root: Path, versions: list[int]) -> dict[int, dict[str, torch.Tensor]]:
    """Adapter versions as the learner publishes them (each a different adapter); returns the
    merged weights each one serves."""
    from asyncrl.learner import lora
    from asyncrl.transport.publisher import AdapterPublisher

    model = lora.apply_lora(
        load(model_dir), SimpleNamespace(rank=4, alpha=8.0, dropout=0.0, target_modules=[]), seed=0
    )
    publisher = AdapterPublisher(
        root, adapter_config=lora.adapter_config(model), keep_last=len(versions), generator_ids=["g0"]
    )
    served = {}

    async def announce(msg):
        assert msg.adapter

    async def go():
        for v in versions:
            g = torch.Generator().manual_seed(v)
            with torch.no_grad():
                for name, p in model.named_parameters():
                    if "lora_B" in name:
                        p.copy_(0.2 * torch.randn(p.shape, generator=g))
            served[v] = lora.serving_state(model)
            await publisher.publish(lora.adapter_state(model), v, announce)

    asyncio.run(go())
    return served


def reference_logprobs(model_dir, state, ids: list[int]) -> list[float]:
    model = load(model_dir)
    if state is not None:
        model.load_state_dict(state)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([PROMPT + ids])).logits[0]
    logp = torch.log_softmax(logits[len(PROMPT) - 1 : -1], dim=-1)
    return logp.gather(1, torch.tensor(ids)[:, None]).squeeze(1).tolist()


def make_gen(model_dir, urls: list[str], *, inflight: str = "keep", **options):
    from asyncrl.generators.sglang import SGLangGenerator

    gen = set_up_generator(
        SGLangGenerator,
        model_dir,
        run_seed=7,
        inflight=inflight,
        options={"urls": ",".join(urls), "health_interval_s": 0.05, "ignore_eos": True, **options},
    )
    return gen


def task(task_id: int = 0, *, num_samples: int = 2, max_new_tokens: int = 6) -> PromptTask:
    return PromptTask(
        task_id=task_id,
        group_id=task_id,
        prompt_ids=PROMPT,
        num_samples=num_samples,
        sampling=SamplingParams(temperature=1.0, max_new_tokens=max_new_tokens),
        dataset_index=task_id,
        window=0,
        answer="46",
    )


@pytest.fixture
def servers(tiny_model_dir):
    from tests.support.sglang.lora import LoraSettings
    from tests.support.sglang.server import StandInServer

    started = []

    def start(n: int = 1, *, enabled: bool = True):
        for _ in range(n):
            lora = LoraSettings(enabled=enabled, max_rank=8)
            started.append(StandInServer(str(tiny_model_dir), skip_tokenizer_init=True, lora=lora).start())
        return started[-n:]

    yield start
    for s in started:
        s.stop()


def test_adapter_versions_load_tag_and_unload(tiny_model_dir, servers, tmp_path):
    a, b = servers(2)
    served = publish(tiny_model_dir, tmp_path / "w", [1, 2])
    gen = make_gen(tiny_model_dir, [a.url, b.url])

    async def go():
        try:
            await gen.load_weights(1, str(tmp_path / "w"))
            first = await gen.generate([task(0, num_samples=4)])
            await gen.load_weights(2, str(tmp_path / "w"))
            second = await gen.generate([task(1, num_samples=4)])
            # v1 is unloaded in the background once nothing names it
            await gen._unloader.settled()
            return first, second
        finally:
            await gen.close()

    first, second = asyncio.run(go())
    assert gen.version == 2
    names = {v: gen._adapters.name(v) for v in (1, 2)}
    for server in (a, b):
        e = server.engine
        assert e.lora_events == [("load", names[1]), ("load", names[2]), ("unload", names[1])]
        assert e.loaded_adapters() == {names[2]: str(tmp_path / "w" / "v00000002")}
        assert e.weight_version == "default"  # the base weights never changed
    counts = [s.engine.lora_requests for s in (a, b)]
    assert sum(c.get(names[1], 0) for c in counts) == 4 and sum(c.get(names[2], 0) for c in counts) == 4
    for version, rollouts in ((1, first), (2, second)):
        for r in rollouts:
            assert r.token_versions == [version] * len(r.completion_ids)
            ref = reference_logprobs(tiny_model_dir, served[version], r.completion_ids)
            assert r.behavior_logprobs == pytest.approx(ref, abs=1e-4)


@pytest.mark.parametrize("inflight", ["keep", "retract"])
def test_inflight_adapter_switch(tiny_model_dir, servers, tmp_path, inflight):
    """An adapter lands while a sample is mid-generation. keep: the request finishes on the
    weights it started with (all version 0); retract: it is cut and continues under the adapter,
    so the tokens after the switch carry version 1 and the adapter's log-probs."""
    (a,) = servers(1)
    served = publish(tiny_model_dir, tmp_path / "w", [1])
    gen = make_gen(tiny_model_dir, [a.url], inflight=inflight)
    a.engine.hold_at_tokens = 3

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
    calls = [name for name, _ in a.engine.control_log]
    if inflight == "keep":
        assert calls == ["load_lora_adapter"]
        assert r.token_versions == [0] * 8
        assert r.behavior_logprobs == pytest.approx(
            reference_logprobs(tiny_model_dir, None, r.completion_ids), abs=1e-4
        )
        return
    assert calls == ["load_lora_adapter", "pause_generation", "continue_generation"]
    assert a.engine.control_log[1][1] == {"mode": "abort"}
    assert r.token_versions == [0, 0, 0, 1, 1, 1, 1, 1]
    old = reference_logprobs(tiny_model_dir, None, r.completion_ids)
    new = reference_logprobs(tiny_model_dir, served[1], r.completion_ids)
    assert r.behavior_logprobs[:3] == pytest.approx(old[:3], abs=1e-4)
    assert r.behavior_logprobs[3:] == pytest.approx(new[3:], abs=1e-4)


def test_server_without_lora_refuses_the_adapter(tiny_model_dir, servers, tmp_path):
    from asyncrl.generators.sglang.client import ServerUnavailable

    (a,) = servers(1, enabled=False)
    publish(tiny_model_dir, tmp_path / "w", [1])
    gen = make_gen(tiny_model_dir, [a.url])

    async def go():
        try:
            await gen.load_weights(1, str(tmp_path / "w"))
        finally:
            await gen.close()

    with pytest.raises(ServerUnavailable, match="LoRA is not enabled. Please set `--enable-lora`"):
        asyncio.run(go())
    assert gen.version == 0


# ---------------------------------------------------------------------- the launched job
def start_server(model_dir) -> tuple[subprocess.Popen, str]:
    return start_standin_server(
        model_dir, "--enable-lora", "--max-lora-rank", "8", "--lora-target-modules", "all"
    )


def server_state(url: str) -> dict:
    with urllib.request.urlopen(f"{url}/server_info", timeout=30) as resp:
        return json.loads(resp.read())["internal_states"][0]


@pytest.mark.slow
def test_default_model_trains_lora_and_servers_load_the_adapters(tmp_path, pid_alive):
    from asyncrl.models.default import DEFAULT_MODEL_DIR

    started: list[subprocess.Popen] = []
    try:
        urls = []
        for _ in range(2):
            proc, url = start_server(DEFAULT_MODEL_DIR)
            started.append(proc)
            urls.append(url)
        args = short_job_args(
            DEFAULT_MODEL_DIR,
            tmp_path,
            'generators.kind="sglang"',
            f'generators.options.urls="{",".join(urls)}"',
            "generators.options.health_interval_s=0.2",
            "learner.lora.rank=8",
            'learner.lora.publish="adapter"',
            # max_staleness 0: step s is admitted only once the generator acked version s, so every
            # version but the last was loaded by the servers before the run ended.
            "staleness.max_staleness=0",
        )
        proc = subprocess.run(args, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        run_dir = tmp_path / "t"
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["status"] == "completed" and summary["policy_versions"] == 3, summary
        assert summary["trajectories_lost"] == 0 and summary["trajectories_duplicated"] == 0
        publishes = read_records(run_dir, "publish")
        assert sorted(p["version"] for p in publishes) == [1, 2, 3]
        assert all(p["adapter"] and p["transport"] == "shards" for p in publishes)
        # rank 8 on every linear of the 2 decoder layers (hidden 128, MLP 256), float32
        adapter_bytes = 2 * 8 * 4 * (4 * (128 + 128) + 3 * (128 + 256))
        assert {p["num_bytes"] for p in publishes} == {adapter_bytes}
        loaded = [r["version"] for r in read_records(run_dir, "loaded") if r["generator_id"] == "gen-0"]
        assert loaded[:2] == [1, 2], loaded
        for url in urls:
            state = server_state(url)
            loads = [name for op, name in state["lora_events"] if op == "load"]
            assert [n.split(".")[1] for n in loads[:2]] == ["v1", "v2"], loads
            assert all(n.startswith("gen-0.") for n in loads)
            assert sum(state["lora_requests"].values()) > 0
            assert len(state["loaded_adapters"]) <= 2  # older versions were unloaded
    finally:
        for p in started:
            p.terminate()
        deadline = time.monotonic() + 30
        for p in started:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
    assert not any(pid_alive(p.pid) for p in started)
