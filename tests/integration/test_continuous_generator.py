"""The built-in generators' streams (`generate_stream`, what the service feeds them through), on
the CPU with real models: the torch generator under continuous and batch batching returns every
sample of every task exactly once, each equal to the same sample drawn by `generate` (same seed:
the same tokens, log-probs to float tolerance), and takes weights offered mid-stream; the sglang
generator, against in-process stand-in servers, hands a sample back while another server still
holds the rest of the batch."""

from __future__ import annotations

import asyncio

import pytest
import torch

from asyncrl.generators.feed import SampleFeed
from asyncrl.messages import PromptTask, SamplingParams
from tests.conftest import set_up_generator

LOGPROB_ABS = 1e-5
DEADLINE_S = 60.0


def tasks(num: int, *, n: int = 4, max_new_tokens: int = 8, temperature: float = 2.0) -> list[PromptTask]:
    prompts = [[1, 5, 6, 15, 7, 8, 17], [1, 9, 15, 4, 17], [1, 3, 3, 15, 6, 17]]
    return [
        PromptTask(
            task_id=i,
            group_id=i,
            prompt_ids=prompts[i % len(prompts)],
            num_samples=n,
            sampling=SamplingParams(temperature=temperature, max_new_tokens=max_new_tokens),
            dataset_index=i,
            window=0,
            answer="46",
        )
        for i in range(num)
    ]


def torch_gen(model_dir, batching: str):
    from asyncrl.generators.torch_gen import TorchGenerator

    gen = set_up_generator(
        TorchGenerator,
        model_dir,
        run_seed=3,
        batching=batching,
        max_batch_groups=2,
    )
    return gen


async def drain(stream, on_first=None) -> list[list]:
    out = []
    async for rollouts in stream:
        if not out and on_first is not None:
            on_first()
        out.append(rollouts)
    return out


@pytest.mark.parametrize("batching", ["continuous", "batch"])
def test_torch_stream_returns_every_sample_once_equal_to_generate(tiny_model_dir, batching):
    gen = torch_gen(tiny_model_dir, batching)
    work = tasks(7)
    feed = SampleFeed()
    feed.put(work)
    arrivals = asyncio.run(asyncio.wait_for(drain(gen.generate_stream(feed)), DEADLINE_S))
    got = {(r.task_id, r.sample_index): r for rollouts in arrivals for r in rollouts}
    assert sum(len(x) for x in arrivals) == len(got) == 7 * 4  # every sample once
    assert len(arrivals) > 2  # handed on over several steps, not as one batch
    for t in work:
        for ref in gen.generate_sync([t]):
            r = got[(t.task_id, ref.sample_index)]
            assert r.completion_ids == ref.completion_ids and r.reward == ref.reward
            assert r.behavior_logprobs == pytest.approx(ref.behavior_logprobs, abs=LOGPROB_ABS)
    lengths = {len(r.completion_ids) for r in got.values()}
    assert len(lengths) > 1  # samples of different lengths: some left the batch early


class CountingFeed(SampleFeed):
    """Records how many samples each take handed out."""

    def __init__(self) -> None:
        super().__init__()
        self.takes: list[int] = []

    def take(self, max_samples, **kw):
        out = super().take(max_samples, **kw)
        if out:
            self.takes.append(len(out))
        return out


def test_continuous_batching_takes_samples_into_a_running_batch(tiny_model_dir):
    """With long-tailed lengths (temperature 3), continuous batching takes new samples while
    others still run (takes smaller than a whole batch); batch-at-a-time takes whole batches."""
    takes = {}
    for batching in ("continuous", "batch"):
        gen = torch_gen(tiny_model_dir, batching)
        feed = CountingFeed()
        feed.put(tasks(16, max_new_tokens=24, temperature=3.0))
        arrivals = asyncio.run(asyncio.wait_for(drain(gen.generate_stream(feed)), DEADLINE_S))
        assert sum(len(x) for x in arrivals) == 16 * 4
        takes[batching] = feed.takes
    capacity = 2 * 4
    assert takes["batch"] == [capacity] * 8
    assert any(n < capacity for n in takes["continuous"])
    assert len(takes["continuous"]) > len(takes["batch"])


def test_torch_stream_applies_weights_offered_mid_stream(tiny_model_dir):
    """Weights offered while the stream runs are applied between decode steps; later tokens carry
    the new version, every version list is non-decreasing, and the ack comes once."""
    gen = torch_gen(tiny_model_dir, "continuous")
    state = {k: v + 0.01 for k, v in gen.model.state_dict().items()}
    acked = []
    feed = SampleFeed()
    feed.put(tasks(6, max_new_tokens=10, temperature=1.0))
    arrivals = asyncio.run(
        asyncio.wait_for(
            drain(gen.generate_stream(feed), on_first=lambda: gen.offer_weights(1, state, acked.append)),
            DEADLINE_S,
        )
    )
    rollouts = [r for x in arrivals for r in x]
    assert len(rollouts) == 24 and acked == [1] and gen.version == 1
    assert all(r.token_versions == sorted(r.token_versions) for r in rollouts)
    assert any(1 in r.token_versions for r in rollouts) and any(r.token_versions[0] == 0 for r in rollouts)
    assert gen.num_inflight_updates == 1
    with torch.no_grad():
        assert torch.equal(gen.model.state_dict()["lm_head.weight"], state["lm_head.weight"])


def test_sglang_stream_hands_back_a_sample_while_another_server_holds_the_rest(tiny_model_dir):
    from asyncrl.generators.sglang import SGLangGenerator
    from tests.support.sglang.server import StandInServer

    servers = [StandInServer(str(tiny_model_dir)).start() for _ in range(2)]
    held = servers[0]
    gen = set_up_generator(
        SGLangGenerator,
        tiny_model_dir,
        run_seed=7,
        options={"urls": ",".join(s.url for s in servers), "health_interval_s": 0.05},
    )
    work = tasks(1, n=4, max_new_tokens=4, temperature=1.0)

    async def go():
        feed = SampleFeed()
        feed.put(work)
        held.engine.hold()  # its requests are admitted and wait
        stream = gen.generate_stream(feed)
        first = await asyncio.wait_for(anext(stream), DEADLINE_S)
        waiting = len(held.engine.running)  # still held while the first came back
        held.engine.release()
        rest = [r for x in await asyncio.wait_for(drain(stream), DEADLINE_S) for r in x]
        reference = await gen.generate(work)
        return first, waiting, rest, reference

    try:
        first, waiting, rest, reference = asyncio.run(go())
    finally:
        asyncio.run(gen.close())
        for s in servers:
            s.stop()
    assert first and waiting == 2  # least-loaded placement: 2 of the 4 samples on the held server
    got = {(r.task_id, r.sample_index): r for r in [*first, *rest]}
    assert len(first) + len(rest) == len(got) == 4
    for ref in reference:  # same seeds: the same samples
        assert got[(ref.task_id, ref.sample_index)].completion_ids == ref.completion_ids


def test_torch_stream_ships_the_same_opd_cache_as_batches(tiny_model_dir, tmp_path):
    """On-policy distillation under continuous batching: each streamed sample carries the same
    [T, N] ids, behavior log-probs and teacher log-probs as the same sample drawn in a batch (the
    teacher scores each decode step's finished samples in one forward)."""
    from asyncrl.config_sections import OpdConfig
    from asyncrl.generators.torch_gen import TorchGenerator
    from asyncrl.models.tiny import create_base

    teacher_dir = create_base(tmp_path / "teacher", hidden_size=32, num_layers=1, num_heads=2, seed=1)
    gen = set_up_generator(
        TorchGenerator,
        tiny_model_dir,
        run_seed=5,
        opd=OpdConfig(enabled=True, teacher=str(teacher_dir), num_samples=3),
        batching="continuous",
        max_batch_groups=1,
    )
    work = tasks(4, n=3, max_new_tokens=8, temperature=2.0)
    feed = SampleFeed()
    feed.put(work)
    arrivals = asyncio.run(asyncio.wait_for(drain(gen.generate_stream(feed)), DEADLINE_S))
    got = {(r.task_id, r.sample_index): r for x in arrivals for r in x}
    assert len(got) == 12
    for ref in gen.generate_sync(work):
        r = got[(ref.task_id, ref.sample_index)]
        assert r.opd_ids == ref.opd_ids and len(r.opd_ids) == len(r.completion_ids)
        for name in ("opd_behavior_logprobs", "teacher_logprobs"):
            for row, ref_row in zip(getattr(r, name), getattr(ref, name), strict=True):
                assert row == pytest.approx(ref_row, abs=LOGPROB_ABS)
