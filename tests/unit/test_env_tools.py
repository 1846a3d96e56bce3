"""Tools with JSON schemas, the tool-call parser and the tool environment (pure, no model)."""

from __future__ import annotations

import asyncio

import pytest

from asyncrl.environments.base import Action, EpisodeStart
from asyncrl.environments.tools import Tool, ToolCall, ToolCallError, ToolEnvironment, parse_tool_calls, tool


@tool
def add(a: int, b: int, scale: float = 1.0) -> float:
    """Add two integers, then scale.

    More words."""
    return (a + b) * scale


def test_schema_from_the_signature():
    assert add.spec() == {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers, then scale.",
            "parameters": {
                "type": "object",
                "properties": {
                    "a": {"type": "integer"},
                    "b": {"type": "integer"},
                    "scale": {"type": "number"},
                },
                "required": ["a", "b"],
            },
        },
    }
    with pytest.raises(ValueError, match="not a JSON type"):
        Tool.from_function(_takes_a_set)


def _takes_a_set(x: set) -> int:
    return len(x)


def test_arguments_are_checked():
    assert asyncio.run(add.call({"a": 2, "b": 3})) == "5.0"
    for args, msg in [
        ({"a": 2}, "missing"),
        ({"a": 1, "b": 2, "c": 3}, "unknown"),
        ({"a": "2", "b": 3}, "integer"),
    ]:
        with pytest.raises(ToolCallError, match=msg):
            asyncio.run(add.call(args))


def test_parse_tool_calls():
    text = 'I will add. <tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call> and <tool_call>{"name": "x"}</tool_call>'
    assert parse_tool_calls(text) == [ToolCall("add", {"a": 1, "b": 2}), ToolCall("x", {})]
    assert parse_tool_calls("no calls") == []
    for bad in [
        "<tool_call>{oops</tool_call>",
        '<tool_call>["add"]</tool_call>',
        '<tool_call>{"name": "a", "arguments": 3}</tool_call>',
    ]:
        with pytest.raises(ToolCallError):
            parse_tool_calls(bad)


def act(text: str, turn: int = 0) -> Action:
    return Action(ids=[1], text=text, finish_reason="stop", turn=turn)


def test_tool_environment_runs_calls_and_scores_the_answer():
    env = ToolEnvironment([add], score=lambda text, start: float(start.answer in text))

    async def episode():
        await env.reset(EpisodeStart(prompt="1+2", answer="3"))
        first = await env.step(act('<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'))
        bad = await env.step(act('<tool_call>{"name": "mul", "arguments": {}}</tool_call>', 1))
        last = await env.step(act("The answer is 3.", 2))
        return first, bad, last

    first, bad, last = asyncio.run(episode())
    assert first.observation.messages == [{"role": "tool", "content": "3.0"}] and not first.done
    assert first.info == {"tool_calls": 1.0}
    assert "unknown tool 'mul'" in bad.observation.messages[0]["content"] and not bad.done
    assert last.done and last.reward == 1.0


def test_text_responses_for_models_without_a_template():
    env = ToolEnvironment([add], score=lambda text, start: 0.0, messages=False)
    asyncio.run(env.reset(EpisodeStart(prompt="", answer="")))
    out = asyncio.run(env.step(act('<tool_call>{"name": "add", "arguments": {"a": 1, "b": 1}}</tool_call>')))
    assert out.observation.text == "<tool_response>2.0</tool_response>"


def test_tools_render_through_a_template_that_takes_them():
    from transformers import AutoTokenizer

    from asyncrl.environments.tools import tools_prompt
    from asyncrl.models.default import DEFAULT_MODEL_DIR

    tok = AutoTokenizer.from_pretrained(DEFAULT_MODEL_DIR)
    with pytest.raises(ValueError, match="no chat template"):
        tools_prompt(tok, [{"role": "user", "content": "1+2"}], [add])
    # a template that renders each tool as its number of required arguments, then "="
    tok.chat_template = (
        "{% for t in tools %}{{ t.function.parameters.required | length }}={% endfor %}"
        "{% for m in messages %}{{ m.content }}{% endfor %}"
    )
    ids = tools_prompt(tok, [{"role": "user", "content": "1+2"}], [add])
    assert tok.decode(ids) == "2=1+2"
