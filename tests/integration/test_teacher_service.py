"""The shared OPD teacher (opd.placement = "service"): one teacher process that every generator
asks for scores.

In-process on loopback sockets (the test plays the launcher's ROUTER around one real
TeacherService, and a generator's TeacherClient): scores equal a local forward of the same
teacher; requests that arrive within the window share one forward; a malformed request is
answered with an error and the service goes on; a client whose teacher is gone fails with an
error naming it instead of hanging. Launched: two generators share one teacher process and the
run completes with every sample scored by it; a teacher killed mid-run stops the run with a
message naming it.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
from pathlib import Path

import pytest
import torch
import zmq
import zmq.asyncio

from asyncrl.config_load import load_config
from asyncrl.generators.opd import teacher_logprobs
from asyncrl.generators.teacher_client import TeacherClient, TeacherUnavailable
from asyncrl.messages import (
    Hello,
    Metrics,
    PromptTask,
    SamplingParams,
    Shutdown,
    TeacherRequest,
    TeacherScores,
)
from asyncrl.transport.codec import tensor_ref
from asyncrl.transport.zmq_io import Endpoint
from tests.conftest import gated_job, read_records, short_job_args

pytestmark = pytest.mark.timeout(240)

PROMPTS = [[1, 5, 6, 14, 7, 17], [1, 9, 14, 11, 17], [1, 4, 14, 4, 17]]


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory):
    """A second tiny model, same tokenizer, different weights."""
    from asyncrl.models.tiny import create_base

    return create_base(
        tmp_path_factory.mktemp("teacher") / "model", hidden_size=32, num_layers=1, num_heads=2, seed=1
    )


def completions(seed: int, num_samples: int = 3) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(4, 22, (length, num_samples), generator=g) for length in (4, 1, 3)]


def local_scores(teacher_dir, prompts, ids_TN) -> list[torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(teacher_dir).eval()
    return [
        teacher_logprobs(model, [p], [x], pad_token_id=0)[0] for p, x in zip(prompts, ids_TN, strict=True)
    ]


class Harness:
    """One TeacherService on this loop, its control DEALER connected to the test's ROUTER."""

    def __init__(self, tmp_path, model_dir, teacher_dir, *overrides: str) -> None:
        from asyncrl.generators.teacher_service import TeacherService
        from asyncrl.messages import WorkerArgs
        from asyncrl.runtime import ChildContext

        self.zctx = zmq.asyncio.Context()
        self.router = Endpoint(self.zctx, zmq.ROUTER, name="test.launcher")
        address = self.router.bind()
        self.dealer = Endpoint(self.zctx, zmq.DEALER, name="opd-teacher.ctrl", identity="opd-teacher")
        self.dealer.connect(address)
        config = load_config(
            overrides=[
                f'model.path="{model_dir}"',
                "opd.enabled=true",
                "opd.placement=service",
                f'opd.teacher="{teacher_dir}"',
                *overrides,
            ]
        )
        ctx = ChildContext(
            "generator",
            "opd-teacher",
            config,
            tmp_path,
            self.zctx,
            self.dealer,
            WorkerArgs(model=str(model_dir)),
        )
        self.service = TeacherService(ctx)

    async def __aenter__(self):
        self.task = asyncio.create_task(self.service.run())
        _, hello, _ = await self.router.recv()
        assert isinstance(hello, Hello) and hello.endpoint == self.service.address
        self.endpoint = hello.endpoint
        return self

    async def __aexit__(self, *exc) -> None:
        if not self.task.done():
            await self.router.send(Shutdown(), to=b"opd-teacher")
            await asyncio.wait_for(self.task, 30)
        self.dealer.close()
        self.router.close()
        self.zctx.destroy(linger=0)


def test_scores_batching_and_bad_requests(tmp_path, tiny_model_dir, teacher_dir):
    """Two generators' requests share one forward: the window (a minute here) closes as soon as
    each generator has one in."""

    async def scenario():
        async with Harness(
            tmp_path,
            tiny_model_dir,
            teacher_dir,
            "opd.service_window_ms=60000",
            "generators.num_generators=2",
        ) as h:
            a = TeacherClient(h.zctx, h.endpoint, peer_id="g0", timeout_s=60)
            b = TeacherClient(h.zctx, h.endpoint, peer_id="g1", timeout_s=60)
            first, second = completions(1), completions(2)
            got = await asyncio.gather(a.request(PROMPTS, first), b.request(PROMPTS[::-1], second))
            assert (h.service.num_batches, h.service.num_requests, h.service.num_sequences) == (1, 2, 6)
            for prompts, ids, scores in ((PROMPTS, first, got[0]), (PROMPTS[::-1], second, got[1])):
                for mine, local in zip(scores, local_scores(teacher_dir, prompts, ids), strict=True):
                    torch.testing.assert_close(mine, local, atol=1e-5, rtol=0)

            # A malformed request is answered at once with its problem; the service goes on.
            raw = Endpoint(h.zctx, zmq.DEALER, name="test.raw")
            raw.connect(h.endpoint)
            flat = torch.zeros(5, 2, dtype=torch.int64)
            bad = TeacherRequest(request_id=7, prompt_ids=[[1, 4]], lengths=[4], ids=tensor_ref(0, flat))
            await raw.send(bad, [flat])
            _, reply, frames = await raw.recv()
            assert isinstance(reply, TeacherScores) and reply.request_id == 7 and not frames
            assert "do not fill the 5 rows" in reply.error
            raw.close()

            # A generator's sampling thread blocks on the loop's answer (never the loop itself).
            task = PromptTask(
                task_id=0,
                group_id=0,
                prompt_ids=PROMPTS[0],
                num_samples=1,
                sampling=SamplingParams(),
                dataset_index=0,
                window=0,
                answer="",
            )
            ids = completions(3)[:1]
            (scores, version), _ = await asyncio.gather(
                asyncio.to_thread(a.score, [task], ids), b.request(PROMPTS, second)
            )
            assert version is None and h.service.num_batches == 2
            local = local_scores(teacher_dir, PROMPTS[:1], ids)[0]
            torch.testing.assert_close(scores[0], local, atol=1e-5, rtol=0)
            with pytest.raises(RuntimeError, match="off the event loop"):
                a.score([task], ids)
            await h.service.send_metrics()
            while True:  # the reports so far, up to this one
                _, msg, _ = await h.router.recv()
                if isinstance(msg, Metrics) and msg.values["teacher/requests"] == 4.0:
                    break
            assert msg.values["teacher/bad_requests"] == 1.0 and msg.values["teacher/sequences"] == 10.0
            a.close()
            b.close()
        assert h.task.done() and h.task.exception() is None  # Shutdown ended it

    asyncio.run(scenario())


def test_a_generator_that_has_gone_does_not_stop_the_teacher(tmp_path, tiny_model_dir, teacher_dir):
    """Regression: the teacher's ROUTER refuses to send to a peer it does not know (a generator
    killed and replaced while its request was scored); that answer is dropped and counted, and
    the service goes on serving."""

    async def scenario():
        async with Harness(tmp_path, tiny_model_dir, teacher_dir, "opd.service_window_ms=50") as h:
            assert not await h.service.reply(b"\x00gone", TeacherScores(request_id=3, error="x"))
            assert h.service.num_undeliverable == 1
            early = Endpoint(h.zctx, zmq.DEALER, name="test.early")
            early.connect(h.endpoint)
            flat = torch.cat(completions(4))
            ask = TeacherRequest(request_id=0, prompt_ids=PROMPTS, lengths=[4, 1, 3], ids=tensor_ref(0, flat))
            await early.send(ask, [flat])
            early.close()  # gone before its answer
            client = TeacherClient(h.zctx, h.endpoint, peer_id="g1", timeout_s=60)
            ids = completions(5)
            for mine, local in zip(
                await client.request(PROMPTS, ids), local_scores(teacher_dir, PROMPTS, ids), strict=True
            ):
                torch.testing.assert_close(mine, local, atol=1e-5, rtol=0)
            assert not h.task.done()
            client.close()

    asyncio.run(scenario())


def test_a_teacher_that_is_gone_is_an_error_not_a_hang():
    async def scenario():
        zctx = zmq.asyncio.Context()
        nobody = Endpoint(zctx, zmq.ROUTER, name="test.silent")  # bound, never answers
        client = TeacherClient(zctx, nobody.bind(), peer_id="g0", timeout_s=0.5)
        with pytest.raises(
            TeacherUnavailable, match=r"did not answer within opd\.service_timeout_s = 0\.5 s"
        ):
            await client.request(PROMPTS, completions(1))
        client.close()
        nobody.close()
        zctx.destroy(linger=0)

    asyncio.run(scenario())


@pytest.mark.slow
@pytest.mark.parametrize("curve", [False, True])
def test_two_generators_share_one_teacher_process(tiny_model_dir, teacher_dir, tmp_path, curve):
    """With CURVE on, the teacher binds as a CURVE server with the run's keys (it holds the
    generator key) and the generators' requests pass its role check."""
    from asyncrl.transport import security

    keys = []
    if curve:
        security.write_keys(tmp_path / "keys")
        keys = ["cluster.curve=on", f'cluster.keys_dir="{tmp_path / "keys"}"']
    args = short_job_args(
        tiny_model_dir,
        tmp_path,
        "opd.enabled=true",
        "opd.placement=service",
        f'opd.teacher="{teacher_dir}"',
        "opd.num_samples=2",
        "generators.num_generators=2",
        "learner.steps=4",
        *keys,
    )
    proc = subprocess.run(args, capture_output=True, text=True, timeout=200)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    run_dir = tmp_path / "t"
    spawned = {r["peer_id"]: r["role"] for r in read_records(run_dir, "spawn")}
    assert spawned == {
        "opd-teacher": "teacher",
        "learner": "learner",
        "gen-0": "generator",
        "gen-1": "generator",
    }
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["trajectories_lost"] == 0
    teacher = [r for r in read_records(run_dir, "metrics") if r["source"] == "opd-teacher"]
    # Every sample either generator made was scored by the one teacher (reports come at most once
    # a second, and on exit the last may be missing: at least one, never more than were made).
    assert teacher and 0 < teacher[-1]["teacher/sequences"] <= summary["trajectories_generated"]
    assert teacher[-1]["teacher/bad_requests"] == 0
    assert teacher[-1]["teacher/rejected_frames"] == 0  # with CURVE: every request passed the role check
    tasks = read_records(run_dir, "task")
    assert {r["generator_id"] for r in tasks} == {"gen-0", "gen-1"}
    assert (run_dir / "logs" / "opd-teacher.log").is_file()


GATED_PLUGIN = """
import asyncio
import os
from pathlib import Path

from asyncrl.generators.torch_gen import TorchGenerator

class GatedGenerator(TorchGenerator):
    async def generate(self, tasks):
        gate = Path(os.environ["ASYNCRL_TEST_GATE"])
        if any(t.group_id >= 4 for t in tasks) and not gate.exists():
            await asyncio.Event().wait()  # never set (the test opens no gate): the run cannot finish
        return await super().generate(tasks)
"""


@pytest.mark.slow
def test_a_teacher_killed_mid_run_stops_the_run_naming_it(tiny_model_dir, teacher_dir, tmp_path, pid_alive):
    args, env, _ = gated_job(
        tiny_model_dir,
        tmp_path,
        GATED_PLUGIN,
        "opd.enabled=true",
        "opd.placement=service",
        f'opd.teacher="{teacher_dir}"',
        "opd.service_timeout_s=20",
        steps=4,
        groups=2,
        samples=2,
        name="t",
    )
    run_dir = tmp_path / "t"
    proc = subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    pid = None
    try:
        # Readiness by message: the launcher prints "started <peer> (pid N)" and a line per step;
        # step 1 is the last one the gate lets through, so by then the teacher has served groups.
        for line in proc.stdout:
            if m := re.search(r"started opd-teacher \(pid (\d+)\)", line):
                pid = int(m.group(1))
            if line.startswith("step 1/"):
                break
        assert pid is not None, "the teacher never started"
        # This run's teacher: its output goes to the run's log of it (a forked worker's command
        # line is the fork server's).
        assert Path(os.readlink(f"/proc/{pid}/fd/1")) == (run_dir / "logs" / "opd-teacher.log").resolve()
        os.kill(pid, signal.SIGKILL)
        out = proc.communicate(timeout=120)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 1, out
    assert "teacher opd-teacher was killed by SIGKILL (exit code -9)" in out
    assert not pid_alive(pid)
    for record in read_records(run_dir, "spawn"):
        assert not pid_alive(record["pid"]), f"{record['peer_id']} outlived the run"
