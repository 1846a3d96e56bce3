"""The generator service's side of weight sync, in-process on loopback sockets: the test plays the
launcher (ROUTER) and the learner (PULL, and the shard writer) around one real GeneratorService
with the torch generator on the tiny model.

Pinned behaviour (docs/weights.md): a corrupt shard never reaches the model (the old version keeps
serving, the error is counted in gen/weights_load_errors, no ack for it), the generator keeps
taking tasks, takes the next good version, retries a failed one until it loads or the retry timeout
fails the run; a generator that starts after versions were published loads the one it is sent; a
fetch that hangs is given up at weights.update_deadline_s (old version kept, error counted) and the
version is retried; a corrupt delta is counted like a corrupt shard and the full version is read
instead.
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest
import torch
import zmq
import zmq.asyncio

from asyncrl.config_load import load_config
from asyncrl.messages import (
    Hello,
    Metrics,
    PromptTask,
    PromptTasks,
    SamplingParams,
    ShardsPublished,
    Shutdown,
    TasksDone,
    Trajectories,
    WeightsLoaded,
    WorkerArgs,
)
from asyncrl.transport.codec import split_trajectories
from asyncrl.transport.retention import version_dir
from asyncrl.transport.shards import write_shards
from asyncrl.transport.zmq_io import Endpoint

pytestmark = pytest.mark.timeout(120)


def state_of_version(model_dir: Path, version: int) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    sd = AutoModelForCausalLM.from_pretrained(model_dir).state_dict()
    return {n: (t + 0.01 * version if t.is_floating_point() else t).contiguous() for n, t in sd.items()}


def publish(root: Path, model_dir: Path, version: int) -> ShardsPublished:
    write_shards(state_of_version(model_dir, version), root, version, max_shard_bytes=16 << 10, fsync=False)
    return ShardsPublished(version=version, root=str(root), num_bytes=0)


def corrupt(root: Path, version: int) -> tuple[Path, bytes]:
    """Flip the last byte of one shard; returns the file and its good bytes (to repair it)."""
    path = sorted(version_dir(root, version).glob("*.safetensors"))[0]
    good = path.read_bytes()
    path.write_bytes(good[:-1] + bytes([good[-1] ^ 0xFF]))
    return path, good


def holds(service, expected: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(p, expected[n]) for n, p in service.gen.model.named_parameters())


class Harness:
    def __init__(self, tmp_path: Path, model_dir: Path, *overrides: str) -> None:
        from asyncrl.generators.service import GeneratorService
        from asyncrl.runtime import ChildContext

        self.zctx = zmq.asyncio.Context()
        self.router = Endpoint(self.zctx, zmq.ROUTER, name="test.launcher")
        address = self.router.bind()
        self.pull = Endpoint(self.zctx, zmq.PULL, name="test.learner")
        data_address = self.pull.bind()
        dealer = Endpoint(self.zctx, zmq.DEALER, name="gen-0.ctrl", identity="gen-0")
        dealer.connect(address)
        config = load_config(overrides=[f'model.path="{model_dir}"', *overrides])
        ctx = ChildContext(
            "generator",
            "gen-0",
            config,
            tmp_path,
            self.zctx,
            dealer,
            WorkerArgs(model=str(model_dir), data=data_address, index=0),
        )
        self.service = GeneratorService(ctx)
        self.dealer = dealer
        self.seen: list = []

    async def __aenter__(self):
        self.task = asyncio.create_task(self.service.run())
        assert isinstance(await self.next(), Hello)
        return self

    async def __aexit__(self, *exc) -> None:
        if not self.task.done():
            await self.send(Shutdown())
            await asyncio.wait_for(self.task, 60)
        self.dealer.close()
        self.router.close()
        self.pull.close()
        self.zctx.term()

    async def send(self, msg) -> None:
        await self.router.send(msg, to=b"gen-0")

    async def next(self):
        _, msg, _ = await self.router.recv()
        self.seen.append(msg)
        return msg

    async def expect(self, kind, pred=lambda m: True):
        while True:
            msg = await self.next()
            if isinstance(msg, kind) and pred(msg):
                return msg


def prompt_task(model_dir: Path, task_id: int) -> PromptTask:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    return PromptTask(
        task_id=task_id,
        group_id=task_id,
        prompt_ids=tok("12+30=")["input_ids"],
        num_samples=2,
        sampling=SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=3),
        dataset_index=task_id,
        window=0,
        answer="42",
    )


def errors(msg) -> bool:
    return isinstance(msg, Metrics) and msg.values.get("gen/weights_load_errors", 0) >= 1


def test_corrupt_shard_keeps_old_weights_and_next_version_loads(tmp_path, tiny_model_dir) -> None:
    asyncio.run(_corrupt_shard_keeps_old_weights_and_next_version_loads(tmp_path, tiny_model_dir))


async def _corrupt_shard_keeps_old_weights_and_next_version_loads(tmp_path, tiny_model_dir) -> None:
    root = tmp_path / "weights"
    v0 = state_of_version(tiny_model_dir, 0)
    async with Harness(tmp_path, tiny_model_dir, "weights.load_retry_timeout_s=600") as h:
        bad = publish(root, tiny_model_dir, 1)
        corrupt(root, 1)
        await h.send(bad)
        await h.expect(Metrics, lambda m: errors(m))
        assert h.service.gen.version == 0 and holds(h.service, v0)
        # still serving: a task is sampled with version 0 (admission is not stalled by this generator)
        await h.send(PromptTasks(tasks=[prompt_task(tiny_model_dir, 7)]))
        (done,) = (await h.expect(TasksDone)).items
        assert done.task_id == 7 and done.num_trajectories == 2
        _, batch, frames = await h.pull.recv()  # the batch's samples travel in one message
        items = split_trajectories(batch, frames)
        assert isinstance(batch, Trajectories) and len(items) == 2
        for traj, (ids, _, versions) in items:
            assert traj.task_id == 7 and versions.tolist() == [0] * len(ids)
        await h.send(publish(root, tiny_model_dir, 2))
        loaded = await h.expect(WeightsLoaded)
        assert loaded.version == 2 and loaded.generator_id == "gen-0"
        assert h.service.gen.version == 2 and holds(h.service, state_of_version(tiny_model_dir, 2))
        assert not any(isinstance(m, WeightsLoaded) and m.version == 1 for m in h.seen)
        assert h.service.weights.num_load_errors >= 1


def test_a_dispatch_is_one_batch_with_one_tasks_done(tmp_path, tiny_model_dir) -> None:
    asyncio.run(_a_dispatch_is_one_batch_with_one_tasks_done(tmp_path, tiny_model_dir))


async def _a_dispatch_is_one_batch_with_one_tasks_done(tmp_path, tiny_model_dir) -> None:
    """PromptTasks with 5 tasks and max_batch_groups 3: two batches (3 + 2), each reported by one
    TasksDone that lists its tasks in order and sent with its samples in one Trajectories."""
    async with Harness(tmp_path, tiny_model_dir, "generators.max_batch_groups=3") as h:
        await h.send(PromptTasks(tasks=[prompt_task(tiny_model_dir, i) for i in range(5)]))
        reports = [await h.expect(TasksDone) for _ in range(2)]
        assert [[d.task_id for d in r.items] for r in reports] == [[0, 1, 2], [3, 4]]
        assert all(d.num_trajectories == 2 and d.generator_id == "gen-0" for r in reports for d in r.items)
        for expected in ([0, 1, 2], [3, 4]):
            _, batch, frames = await h.pull.recv()
            assert sorted({t.task_id for t, _ in split_trajectories(batch, frames)}) == expected


def test_failed_version_is_retried_until_it_loads(tmp_path, tiny_model_dir) -> None:
    asyncio.run(_failed_version_is_retried_until_it_loads(tmp_path, tiny_model_dir))


async def _failed_version_is_retried_until_it_loads(tmp_path, tiny_model_dir) -> None:
    """A shard that is repaired (a lagging shared directory) is taken without a new publish."""
    root = tmp_path / "weights"
    async with Harness(tmp_path, tiny_model_dir, "weights.load_retry_timeout_s=600") as h:
        msg = publish(root, tiny_model_dir, 1)
        path, good = corrupt(root, 1)
        await h.send(msg)
        await h.expect(Metrics, lambda m: errors(m))
        path.write_bytes(good)
        loaded = await h.expect(WeightsLoaded)
        assert loaded.version == 1 and holds(h.service, state_of_version(tiny_model_dir, 1))


def test_unloadable_version_fails_after_the_retry_timeout(tmp_path, tiny_model_dir) -> None:
    asyncio.run(_unloadable_version_fails_after_the_retry_timeout(tmp_path, tiny_model_dir))


async def _unloadable_version_fails_after_the_retry_timeout(tmp_path, tiny_model_dir) -> None:
    from asyncrl.generators.weights import WeightsUnavailable

    root = tmp_path / "weights"
    async with Harness(tmp_path, tiny_model_dir, "weights.load_retry_timeout_s=0.5") as h:
        msg = publish(root, tiny_model_dir, 1)
        corrupt(root, 1)
        await h.send(msg)
        with pytest.raises(ExceptionGroup) as info:
            await asyncio.wait_for(h.task, 60)
        assert info.group_contains(WeightsUnavailable, match="fails its xxh3 check")
        assert h.service.gen.version == 0


def test_missing_version_is_an_error_not_a_crash(tmp_path, tiny_model_dir) -> None:
    asyncio.run(_missing_version_is_an_error_not_a_crash(tmp_path, tiny_model_dir))


async def _missing_version_is_an_error_not_a_crash(tmp_path, tiny_model_dir) -> None:
    root = tmp_path / "weights"
    async with Harness(tmp_path, tiny_model_dir, "weights.load_retry_timeout_s=600") as h:
        await h.send(ShardsPublished(version=4, root=str(root), num_bytes=0))
        await h.expect(Metrics, lambda m: errors(m))
        assert "not published" in h.service.weights.last_error and h.service.gen.version == 0


def test_late_joiner_loads_the_version_it_is_sent(tmp_path, tiny_model_dir) -> None:
    asyncio.run(_late_joiner_loads_the_version_it_is_sent(tmp_path, tiny_model_dir))


async def _late_joiner_loads_the_version_it_is_sent(tmp_path, tiny_model_dir) -> None:
    """The launcher re-sends the latest WeightsPublished to a generator whose Hello comes after
    publishes (scheduler/service.py); the generator loads it and acks it."""
    root = tmp_path / "weights"
    announcements = [publish(root, tiny_model_dir, v) for v in (1, 2, 3)]
    async with Harness(tmp_path, tiny_model_dir) as h:
        await h.send(announcements[-1])
        loaded = await h.expect(WeightsLoaded)
        assert loaded.version == 3 and holds(h.service, state_of_version(tiny_model_dir, 3))


def test_a_fetch_that_hangs_is_given_up_at_the_deadline_and_retried(tmp_path, tiny_model_dir) -> None:
    asyncio.run(_a_fetch_that_hangs_is_given_up_at_the_deadline_and_retried(tmp_path, tiny_model_dir))


async def _a_fetch_that_hangs_is_given_up_at_the_deadline_and_retried(tmp_path, tiny_model_dir) -> None:
    """Issue #25: a load that hangs (a stuck filesystem) must not hold the generator: past the
    update's deadline it keeps serving its version, reports the error, and retries."""
    root = tmp_path / "weights"
    v0 = state_of_version(tiny_model_dir, 0)
    release = threading.Event()
    overrides = ("weights.update_deadline_s=0.5", "weights.load_retry_timeout_s=600")
    async with Harness(tmp_path, tiny_model_dir, *overrides) as h:
        real_fetch = h.service.receiver.fetch
        calls: list[int] = []

        def fetch(msg):
            calls.append(msg.version)
            if len(calls) == 1:
                release.wait(120)  # the first fetch hangs until the test ends
            return real_fetch(msg)

        h.service.receiver.fetch = fetch
        try:
            await h.send(publish(root, tiny_model_dir, 1))
            await h.expect(Metrics, lambda m: errors(m))
            assert "weights.update_deadline_s = 0.5" in h.service.weights.last_error
            assert h.service.gen.version == 0 and holds(h.service, v0)
            loaded = await h.expect(WeightsLoaded)  # the retry, in a new thread
            assert loaded.version == 1 and calls == [1, 1]
            assert holds(h.service, state_of_version(tiny_model_dir, 1))
        finally:
            release.set()  # the hung thread finishes into tensors nobody takes


def test_a_corrupt_delta_is_counted_and_the_full_version_loads_instead(tmp_path, tiny_model_dir) -> None:
    asyncio.run(_a_corrupt_delta_is_counted_and_the_full_version_loads_instead(tmp_path, tiny_model_dir))


async def _a_corrupt_delta_is_counted_and_the_full_version_loads_instead(tmp_path, tiny_model_dir) -> None:
    """Issue #25: a flipped byte in a delta never reaches the model; the error is counted and
    reported, the old version keeps serving, and the retry reads the version's full shards."""
    from asyncrl.transport.delta import DeltaBase
    from asyncrl.transport.shard_read import read_manifest

    root = tmp_path / "weights"
    base = DeltaBase()
    for version in (1, 2):
        state = state_of_version(tiny_model_dir, version)
        write_shards(state, root, version, max_shard_bytes=16 << 10, fsync=False, delta_base=base)
    delta = read_manifest(root, 2).delta.files[0]
    path = version_dir(root, 2) / delta.name
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    announce = [ShardsPublished(version=v, root=str(root), num_bytes=0) for v in (1, 2)]
    async with Harness(tmp_path, tiny_model_dir, "weights.load_retry_timeout_s=600") as h:
        await h.send(announce[0])
        assert (await h.expect(WeightsLoaded)).version == 1
        await h.send(announce[1])
        await h.expect(Metrics, lambda m: errors(m))
        assert "delta" in h.service.weights.last_error and h.service.gen.version == 1
        assert holds(h.service, state_of_version(tiny_model_dir, 1))
        loaded = await h.expect(WeightsLoaded)  # the retry reads the full shards
        assert loaded.version == 2 and holds(h.service, state_of_version(tiny_model_dir, 2))
        assert h.service.receiver.num_delta_fetches == 0
