"""Distributed weight updates into stand-in SGLang servers (gloo on 127.0.0.1), and server launching.

The servers are real processes started by `asyncrl.generators.sglang.launch` (the generator's own
launcher, with the stand-in as the launch command); the learner's publisher
(`generators/sglang/publisher.py`) and the generator's HTTP side (`generators/sglang/group.py`) run in
the test process, as rank 0 and as the client. Only the launched pids are ended (stop_servers).
"""

from __future__ import annotations

import asyncio
import json
import sys
import urllib.request

import pytest
import torch

from asyncrl.generators.sglang.client import Fleet, SGLangRequestError
from asyncrl.generators.sglang.group import GroupUpdater
from asyncrl.generators.sglang.launch import (
    LaunchSpec,
    ServerLaunchError,
    launch_servers,
    stop_servers,
    wait_ready,
)
from asyncrl.generators.sglang.publisher import SGLangGroupPublisher
from asyncrl.messages import BroadcastPublished, TensorMeta

pytest.importorskip("transformers")
pytestmark = pytest.mark.slow

STANDIN = ("python", "-m", "tests.support.sglang.server")
TIMEOUT_S = 60.0  # group rendezvous and collectives; pytest-timeout is the outer guard


def post_json(url: str, body: dict) -> tuple[int, dict | list]:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}, method="POST"
    )
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def server_weights(url: str, name: str, like: torch.Tensor) -> torch.Tensor:
    status, values = post_json(f"{url}/get_weights_by_name", {"name": name, "truncate_size": like.shape[0]})
    assert status == 200, values
    # JSON floats round-trip float32 values exactly (repr of the exact float64 widening).
    return torch.tensor(values, dtype=like.dtype).reshape(like.shape)


@pytest.fixture
def launched(tiny_model_dir, tmp_path, pid_alive):
    spec = LaunchSpec(
        command=STANDIN,
        model_path=str(tiny_model_dir),
        num_servers=2,
        log_dir=tmp_path / "logs",
        name="sglang-test",
        extra_args=("--log-level", "warning", "--mem-fraction-static", "0.3"),
    )
    servers = launch_servers(spec)
    try:
        wait_ready(servers, timeout_s=120)
        yield servers
    finally:
        stop_servers(servers)
    assert not any(pid_alive(s.pid) for s in servers)


def perturbed_state(model_dir, version: int) -> dict[str, torch.Tensor]:
    """The model's weights moved by a version-dependent amount (tied tensors stay tied)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    g = torch.Generator().manual_seed(version)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.01)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_distributed_update_lands_bitwise_on_every_server(launched, tiny_model_dir):
    urls = [s.url for s in launched]

    async def run() -> None:
        fleet = Fleet(urls, max_workers=8, health_interval_s=1.0, wait_timeout_s=TIMEOUT_S)
        publisher = SGLangGroupPublisher(
            rank_owners=("gen-0", "gen-0"), bucket_bytes=4096, timeout_s=TIMEOUT_S, catchup=None
        )
        updater = GroupUpdater(fleet.call, generator_id="gen-0", pause_mode="retract")
        applied: list[asyncio.Task] = []

        async def announce(msg: BroadcastPublished) -> None:  # what the generator does on receipt
            async def apply() -> None:
                if updater.group_name is None:
                    await updater.join(msg, fleet.servers)
                await updater.update(msg)

            applied.append(asyncio.create_task(apply()))

        try:
            for version in (1, 2):
                state = perturbed_state(tiny_model_dir, version)
                msg = await publisher.publish(state, version, announce)
                await applied[-1]
                assert msg.group_members == ("gen-0", "gen-0") and msg.transport == "broadcast"
                for url in urls:
                    info = json.loads(urllib.request.urlopen(f"{url}/model_info", timeout=30).read())
                    assert info["weight_version"] == str(version)
                    for name, expected in state.items():
                        got = server_weights(url, name, expected)
                        assert torch.equal(got.view(torch.int32), expected.view(torch.int32)), (url, name)
            assert publisher.group is not None  # one group for every version
        finally:
            await updater.leave()
            publisher.close()
            await fleet.close()

    asyncio.run(run())
    # leaving dropped the servers' group: a second destroy is the contract's 400
    status, body = post_json(f"{urls[0]}/destroy_weights_update_group", {"group_name": "x"})
    assert status == 400 and body["message"] == "The group to be destroyed does not exist."


def test_session_rule_errors_surface(tiny_model_dir):
    """SGLang >= 0.5.21: a distributed update outside begin/end is 400, and a second begin too;
    the generator's updater names the server, the call and the server's reason, and leaves the
    server serving (not paused) without closing a session it did not open."""
    from tests.support.sglang.server import StandInServer

    with StandInServer(str(tiny_model_dir)) as server:
        body = {"names": ["lm_head.weight"], "dtypes": ["float32"], "shapes": [[4]], "group_name": "g"}
        status, reply = post_json(f"{server.url}/update_weights_from_distributed", body)
        assert status == 400 and reply == {
            "success": False,
            "message": "update_weights_from_distributed must run between begin_weight_update() and "
            "end_weight_update()",
        }
        assert post_json(f"{server.url}/begin_weight_update", {})[0] == 200  # someone else's session

        async def run() -> None:
            fleet = Fleet([server.url], max_workers=4, health_interval_s=1.0, wait_timeout_s=10.0)
            updater = GroupUpdater(fleet.call, generator_id="gen-0", pause_mode="retract")
            updater.servers, updater.group_name = list(fleet.servers), "g"
            msg = BroadcastPublished(
                version=1,
                store_address="127.0.0.1:1",
                num_bytes=16,
                tensors=(TensorMeta(name="lm_head.weight", dtype="float32", shape=(4,)),),
                bucket_bytes=1024,
                group_name="g",
                group_backend="gloo",
                group_members=("gen-0",),
                group_first_version=1,
            )
            try:
                with pytest.raises(SGLangRequestError) as err:
                    await updater.update(msg)
            finally:
                await fleet.close()
            text = str(err.value)
            assert server.url in text and "/begin_weight_update" in text and "already open" in text

        asyncio.run(run())
        assert server.engine.paused is None and server.engine.session_open
        names = [name for name, _ in server.engine.control_log]
        assert names[-2:] == ["begin_weight_update", "continue_generation"]


def test_launch_reports_a_server_that_dies_or_never_answers(tmp_path, pid_alive):
    dies = LaunchSpec(
        command=(sys.executable, "-c", "import sys; print('no GPU for this model'); sys.exit(3)"),
        model_path="unused",
        num_servers=1,
        log_dir=tmp_path,
        name="dies",
    )
    servers = launch_servers(dies)
    try:
        with pytest.raises(ServerLaunchError) as err:
            wait_ready(servers, timeout_s=60)
    finally:
        stop_servers(servers)
    assert "exited with code 3" in str(err.value) and "no GPU for this model" in str(err.value)

    silent = LaunchSpec(
        command=(sys.executable, "-c", "import time; time.sleep(300)"),
        model_path="unused",
        num_servers=1,
        log_dir=tmp_path,
        name="silent",
    )
    servers = launch_servers(silent)
    try:
        with pytest.raises(ServerLaunchError) as err:
            wait_ready(servers, timeout_s=1.0)
    finally:
        stop_servers(servers, grace_s=5.0)
    assert "did not answer /health_generate with 200 within 1 s" in str(err.value)
    assert str(servers[0].log_path) in str(err.value)
    assert not pid_alive(servers[0].pid)
