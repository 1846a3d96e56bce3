"""The Python-tool agent of examples/python_agent: calls go from a jailed environment worker into
the sandbox and their output comes back; on the real pretrained model (when prepared) its
episodes keep the sampled tokens (the learner's log-probs equal the behavior log-probs)."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

from asyncrl.config_sections import EnvConfig
from asyncrl.environments.base import Action, EnvironmentContext, EpisodeStart

REPO = Path(__file__).resolve().parents[2]
KIND = "examples.python_agent.environment:python_agent"
pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux jail")


def call(code: str) -> str:
    import json

    return (
        "<tool_call>" + json.dumps({"name": "python", "arguments": {"code": code}}) + "</tool_call><|im_end|>"
    )


def test_tool_calls_run_in_the_sandbox_from_a_jailed_worker(monkeypatch, tmp_path):
    from asyncrl.environments.pool import ProcessPoolHost

    monkeypatch.chdir(REPO)  # the worker imports the example from the run's directory
    env = EnvConfig(kind=KIND, workers=1, step_timeout_s=60)
    host = ProcessPoolHost(env, EnvironmentContext(options={"wall_s": 20}), run_dir=str(tmp_path), name="g")
    secret = tmp_path / "secret.txt"
    secret.write_text("key")

    async def episode():
        try:
            handle, _ = await host.open(EpisodeStart(prompt="What is 12 * 8?", answer="96"))
            steps = []
            for turn, text in enumerate(
                [
                    call("print(12 * 8)"),
                    call(f"print(open({str(secret)!r}).read())"),
                    "It is \\boxed{96}.<|im_end|>",
                ]
            ):
                steps.append(
                    await host.step(handle, Action(ids=[1], text=text, finish_reason="stop", turn=turn))
                )
            return steps
        finally:
            await host.aclose()

    ran, refused, answered = asyncio.run(episode())
    assert ran.observation.messages == [{"role": "tool", "content": "96"}] and not ran.done
    assert refused.observation.messages[0]["content"].startswith("error: PermissionError")
    assert answered.done and answered.reward == 1.0


@pytest.mark.slow
def test_python_agent_episodes_on_the_real_model_keep_the_sampled_tokens(monkeypatch):
    from tests.integration.test_env_tokens import check_fidelity_on
    from tests.support.real_model import real_model_dir

    model_dir = real_model_dir()
    monkeypatch.chdir(REPO)
    monkeypatch.syspath_prepend(str(REPO))
    env = EnvConfig(kind=KIND, workers=1, max_turns=2, step_timeout_s=60)
    check_fidelity_on(model_dir, env, max_new_tokens=16, mixed=False)  # the model may answer at once
