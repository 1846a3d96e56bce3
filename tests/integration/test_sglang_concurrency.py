"""A thousand samples in flight at once through the `sglang` generator, without a thread each.

The generator's HTTP client (`asyncrl/generators/sglang/client.py`) sends every /generate as a
coroutine on one pooled aiohttp session. This test starts an in-process stand-in server
(`tests.support.sglang.server.StandInServer`, 127.0.0.1, a free port; its HTTP side is one
asyncio thread), freezes its engine (`Engine.hold`) and asks the generator for 1,000 samples. Once
the server counts all 1,000 /generate requests in flight at once, the test process must still run
only a handful of threads; then the engine is released and every sample must come back exactly
once, with the tokens its own seed draws and the log-probs of a reference forward.

Regression: the client ran each request in a thread of a pool sized by max_concurrency, so 1,000
samples in flight meant 1,000 threads in the generator process.
"""

from __future__ import annotations

import asyncio
import resource
import threading

import pytest
import torch

from asyncrl.messages import PromptTask, SamplingParams
from tests.conftest import set_up_generator

pytest.importorskip("transformers")

NUM_TASKS = 10
SAMPLES_PER_TASK = 100
NUM_SAMPLES = NUM_TASKS * SAMPLES_PER_TASK
MAX_NEW_TOKENS = 2
RUN_SEED = 7
# Threads the test process may gain while the samples are in flight, whatever their number: the
# stand-in's admission thread, the default executor's worker that waits on the server's counter,
# and slack for a logging or torch helper. A thread per request would add a thousand.
EXTRA_THREADS = 4
# Two sockets per request in one process (client and server ends), plus the usual files.
NEEDED_FDS = 2 * NUM_SAMPLES + 512


@pytest.fixture
def enough_fds():
    """Raise the soft open-files limit for this test (many CI shells default to 1024)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < NEEDED_FDS:
        pytest.skip(f"needs {NEEDED_FDS} open files; the hard limit is {hard}")
    if soft != resource.RLIM_INFINITY and soft < NEEDED_FDS:
        resource.setrlimit(resource.RLIMIT_NOFILE, (NEEDED_FDS, hard))
    yield
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def prompt(task_id: int) -> list[int]:
    """Seven ids (bos first), different for every task: a mixed-up answer shows in its log-probs."""
    return [1] + [4 + (task_id * 7 + 3 * j) % 17 for j in range(6)]


def tasks() -> list[PromptTask]:
    return [
        PromptTask(
            task_id=t,
            group_id=t,
            prompt_ids=prompt(t),
            num_samples=SAMPLES_PER_TASK,
            sampling=SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=MAX_NEW_TOKENS),
            dataset_index=t,
            window=0,
            answer="46",
        )
        for t in range(NUM_TASKS)
    ]


def make_gen(model_dir, url: str):
    from asyncrl.generators.sglang import SGLangGenerator

    # every sample to its budget: the expected tokens below are exactly MAX_NEW_TOKENS
    gen = set_up_generator(
        SGLangGenerator,
        model_dir,
        run_seed=RUN_SEED,
        inflight="retract",
        options={"urls": url, "max_concurrency": NUM_SAMPLES, "ignore_eos": True},
    )
    return gen


def expected_samples(model_dir, gen, rollouts) -> None:
    """Each rollout holds the tokens its own seed draws from a reference forward (the stand-in's
    own pick, `params.pick_token`, replayed) and their full-vocabulary log-probs."""
    from transformers import AutoModelForCausalLM

    from asyncrl.models.sampling import sample_seed
    from tests.support.sglang.params import parse_sampling_params, pick_token

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    by_task = {t.task_id: t for t in tasks()}
    seqs = [prompt(r.task_id) + list(r.completion_ids) for r in rollouts]  # all the same length
    with torch.no_grad():
        logits_BLV = model(input_ids=torch.tensor(seqs)).logits
    start = len(prompt(0)) - 1
    for b, r in enumerate(rollouts):
        seed = sample_seed(RUN_SEED, r.task_id, r.sample_index)
        spec = parse_sampling_params(
            gen._sampling_params(by_task[r.task_id], MAX_NEW_TOKENS, seed), vocab_size=logits_BLV.shape[-1]
        )
        rng = torch.Generator().manual_seed(seed)
        picks = [pick_token(logits_BLV[b, start + i], spec, rng, banned=[]) for i in range(MAX_NEW_TOKENS)]
        assert list(r.completion_ids) == [p.token for p in picks], (r.task_id, r.sample_index)
        assert r.behavior_logprobs == pytest.approx([p.logprob for p in picks], abs=1e-4)


def test_a_thousand_samples_in_flight_on_one_loop(tiny_model_dir, enough_fds):
    from tests.support.sglang.server import StandInServer

    server = StandInServer(str(tiny_model_dir), skip_tokenizer_init=True).start()
    try:
        server.engine.hold()  # no step runs: every request waits at the server, in flight
        gen = make_gen(tiny_model_dir, server.url)
        baseline = threading.active_count()

        async def go():
            try:
                job = asyncio.create_task(gen.generate(tasks()))
                reached = await asyncio.to_thread(server.wait_for_generate_in_flight, NUM_SAMPLES, 60)
                assert reached, f"only {server.num_generate_in_flight} requests reached the server"
                threads = threading.enumerate()
                assert len(threads) <= baseline + EXTRA_THREADS, [t.name for t in threads]
                assert await asyncio.to_thread(server.engine.wait_until_running, NUM_SAMPLES, 60)
                assert len(server.engine.running) == NUM_SAMPLES and not job.done()
                assert gen.fleet.servers[0].outstanding == NUM_SAMPLES
                server.engine.release()
                return await job
            finally:
                await gen.close()

        rollouts = asyncio.run(go())
        assert server.max_generate_in_flight == NUM_SAMPLES
        assert server.num_generate_in_flight == 0
    finally:
        server.stop()
    # exactly once: one rollout per (task, sample index), one request per sample, none re-issued
    got = sorted((r.task_id, r.sample_index) for r in rollouts)
    assert got == [(t, k) for t in range(NUM_TASKS) for k in range(SAMPLES_PER_TASK)]
    assert len(server.engine.rids) == len(set(server.engine.rids)) == NUM_SAMPLES
    assert all(rid.endswith("-a0") for rid in server.engine.rids)
    assert gen.num_reissues == 0 and gen.fleet.num_quarantines == 0
    assert all(r.token_versions == [0] * MAX_NEW_TOKENS for r in rollouts)
    expected_samples(tiny_model_dir, gen, rollouts)
