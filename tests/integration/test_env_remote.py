"""The remote environment (HTTP) against the environment server on loopback: episodes on the torch
generator, retries that never step an episode twice, and failures by kind."""

from __future__ import annotations

import asyncio

import pytest

from asyncrl.config_sections import EnvConfig
from asyncrl.environments.base import Action, EnvironmentContext, EpisodeStart
from asyncrl.environments.host import EnvFailure
from asyncrl.environments.remote import RemoteEnv, remote
from asyncrl.environments.server import EnvServer
from tests.conftest import set_up_generator
from tests.support.env_envs import digits


@pytest.fixture
def server():
    s = EnvServer(digits)
    s.start()
    yield s
    s.stop()


def test_episodes_run_against_a_remote_environment(server, tiny_model_dir):
    from asyncrl.generators.torch_gen import TorchGenerator
    from asyncrl.testing.contract import default_tasks, make_context

    env = EnvConfig(kind="asyncrl.environments.remote:remote", workers=0, options={"url": server.url})
    gen = set_up_generator(TorchGenerator, tiny_model_dir, env=env)
    tasks = default_tasks(make_context(tiny_model_dir))

    async def go():
        try:
            return await gen.generate(tasks)
        finally:
            await gen.close()

    rollouts = asyncio.run(go())
    assert len(rollouts) == sum(t.num_samples for t in tasks)
    assert all(r.finish_reason in ("stop", "length") and not all(r.loss_mask) for r in rollouts)
    assert server.num_steps == 3 * len(rollouts)  # three steps per digits episode
    assert server.envs == {}  # every episode closed


def test_retries_never_step_an_episode_twice(server):
    env = RemoteEnv(server.url, retries=2, backoff_s=0.01)
    act = Action(ids=[5], text="1", finish_reason="stop", turn=0)

    async def go():
        await env.reset(EpisodeStart(prompt="1+1=", answer="2"))
        server.fail_next = 2
        first = await env.step(act)
        again = await env.step(act)  # the same seq, as a retry whose first answer was lost
        await env.close()
        return first, again

    first, again = asyncio.run(go())
    assert first == again and server.num_steps == 1 and env.num_retries == 2


def test_failures_by_kind(server):
    async def step_with(fail_next: int, retries: int, env_raises: bool = False):
        env = RemoteEnv(server.url, retries=retries, backoff_s=0.01)
        await env.reset(EpisodeStart(prompt="", answer=""))
        if env_raises:
            server.envs[env.episode_id] = None  # its step raises on the server (AttributeError)
        server.fail_next = fail_next
        try:
            await env.step(Action(ids=[5], text="1", finish_reason="stop", turn=0))
        finally:
            server.fail_next = 0
            await env.close()

    with pytest.raises(EnvFailure, match="failed 2 attempts.*HTTP 503") as err:
        asyncio.run(step_with(fail_next=5, retries=1))
    assert err.value.kind == "error"
    with pytest.raises(EnvFailure, match="HTTP 422.*AttributeError") as err:
        asyncio.run(step_with(fail_next=0, retries=3, env_raises=True))
    assert err.value.kind == "error"
    dead = RemoteEnv("http://127.0.0.1:9", retries=0, timeout_s=2)
    with pytest.raises(EnvFailure, match="ClientConnectorError|Connect"):
        asyncio.run(dead.reset(EpisodeStart(prompt="", answer="")))


def test_options_are_checked():
    with pytest.raises(ValueError, match="need url"):
        remote(EnvironmentContext(options={"timeout": 3}))
    assert remote(EnvironmentContext(options={"url": "http://h:1/", "retries": "4"})).retries == 4
