"""Tools: plain Python functions with a JSON schema, the tool-call parser, and a tool environment.

Place in the data flow: a task renders the tools into its prompt (`tools_prompt`: the chat
template's own tool rendering, for tokenizers whose template takes `tools`); the model writes
calls in the Hermes / Qwen format, `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
(end its turn there with `env.stop_tokens = ["</tool_call>"]` when that is one token);
`ToolEnvironment.step` parses them (`parse_tool_calls`), runs each tool and answers with one
`tool` message per call (rendered by the chat template, `render.py`) or, for a model without a
template, `<tool_response>...</tool_response>` text. A turn with no call is the final answer:
`score(answer_text, start)` is the episode's reward. A malformed call is answered with its error
(the model sees it, as with any tool error): only the environment failing is a failure.

Schemas come from the function's signature: `int` -> integer, `float` -> number, `str` -> string,
`bool` -> boolean, `list` -> array, `dict` -> object; parameters without a default are required;
the docstring's first line is the description.
"""

from __future__ import annotations

import inspect
import json
import re
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, get_type_hints

from asyncrl.environments.base import Action, EpisodeStart, Observation, StepResult

JSON_TYPES: dict[Any, str] = {
    int: "integer",
    float: "number",
    str: "string",
    bool: "boolean",
    list: "array",
    dict: "object",
}
TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


class ToolCall(NamedTuple):
    name: str
    arguments: dict[str, Any]


class ToolCallError(ValueError):
    """A call the model wrote that cannot be run (bad JSON, unknown tool, bad arguments)."""


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict[str, Any]  # JSON schema of the arguments object
    fn: Callable[..., Any]

    @classmethod
    def from_function(cls, fn: Callable[..., Any], *, name: str = "") -> Tool:
        hints = get_type_hints(fn)
        props, required = {}, []
        for pname, param in inspect.signature(fn).parameters.items():
            json_type = JSON_TYPES.get(hints.get(pname, str))
            if json_type is None:
                raise ValueError(
                    f"tool {fn.__name__}: parameter {pname!r} has type {hints[pname]}, not a JSON type"
                )
            props[pname] = {"type": json_type}
            if param.default is inspect.Parameter.empty:
                required.append(pname)
        doc = (inspect.getdoc(fn) or "").strip().splitlines()
        schema = {"type": "object", "properties": props, "required": required}
        return cls(name=name or fn.__name__, description=doc[0] if doc else "", parameters=schema, fn=fn)

    def spec(self) -> dict[str, Any]:
        """The OpenAI-style function spec chat templates take as `tools`."""
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }

    def check(self, arguments: dict[str, Any]) -> None:
        props = self.parameters["properties"]
        unknown = sorted(set(arguments) - set(props))
        missing = [p for p in self.parameters["required"] if p not in arguments]
        if unknown or missing:
            raise ToolCallError(f"{self.name}: unknown arguments {unknown}, missing {missing}")
        for key, value in arguments.items():
            want = props[key]["type"]
            ok = {
                "integer": isinstance(value, int) and not isinstance(value, bool),
                "number": isinstance(value, int | float) and not isinstance(value, bool),
                "string": isinstance(value, str),
                "boolean": isinstance(value, bool),
                "array": isinstance(value, list),
                "object": isinstance(value, dict),
            }[want]
            if not ok:
                raise ToolCallError(
                    f"{self.name}: argument {key!r} must be {want}, got {type(value).__name__}"
                )

    async def call(self, arguments: dict[str, Any]) -> str:
        self.check(arguments)
        result = self.fn(**arguments)
        if inspect.isawaitable(result):
            result = await result
        return result if isinstance(result, str) else json.dumps(result)


def tool(fn: Callable[..., Any]) -> Tool:
    """Decorator: `@tool def add(a: int, b: int) -> int: "Add two integers." ...`."""
    return Tool.from_function(fn)


def parse_tool_calls(text: str) -> list[ToolCall]:
    """The `<tool_call>{json}</tool_call>` calls in `text`, in order; ToolCallError for one that
    is not `{"name": str, "arguments": object}`."""
    calls = []
    for body in TOOL_CALL.findall(text):
        try:
            data = json.loads(body)
        except json.JSONDecodeError as exc:
            raise ToolCallError(f"a tool call is not JSON: {exc}") from None
        if not isinstance(data, dict) or not isinstance(data.get("name"), str):
            raise ToolCallError('a tool call must be {"name": ..., "arguments": {...}}')
        args = data.get("arguments", {})
        if not isinstance(args, dict):
            raise ToolCallError(f"{data['name']}: arguments must be an object")
        calls.append(ToolCall(data["name"], args))
    return calls


def tools_prompt(tokenizer: Any, messages: Sequence[dict[str, str]], tools: Sequence[Tool]) -> list[int]:
    """Prompt ids of `messages` with `tools` rendered by the tokenizer's chat template (for a
    task's `render`); ValueError when the tokenizer has no template."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("the model's tokenizer has no chat template: describe the tools in the prompt text")
    text = tokenizer.apply_chat_template(
        list(messages), tools=[t.spec() for t in tools], add_generation_prompt=True, tokenize=False
    )
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


class ToolEnvironment:
    """An Environment from tools and a scorer; see the module docstring."""

    def __init__(
        self,
        tools: Sequence[Tool],
        *,
        score: Callable[[str, EpisodeStart], float | Awaitable[float]],
        messages: bool = True,
    ) -> None:
        self.tools = {t.name: t for t in tools}
        self.score = score
        self.messages = messages
        self.start: EpisodeStart | None = None

    async def reset(self, start: EpisodeStart) -> Observation:
        self.start = start
        return Observation()

    async def step(self, action: Action) -> StepResult:
        try:
            calls = parse_tool_calls(action.text)
        except ToolCallError as exc:
            return self._answer([f"error: {exc}"])
        if not calls:
            assert self.start is not None
            reward = self.score(action.text, self.start)
            if inspect.isawaitable(reward):
                reward = await reward
            return StepResult(reward=float(reward), done=True)
        results = []
        for call in calls:
            t = self.tools.get(call.name)
            try:
                if t is None:
                    raise ToolCallError(f"unknown tool {call.name!r}; tools: {', '.join(self.tools)}")
                results.append(await t.call(call.arguments))
            except ToolCallError as exc:
                results.append(f"error: {exc}")
        return self._answer(results, info={"tool_calls": float(len(calls))})

    def _answer(self, results: list[str], info: dict[str, float] | None = None) -> StepResult:
        if self.messages:
            obs = Observation(messages=[{"role": "tool", "content": r} for r in results])
        else:
            obs = Observation(text="".join(f"<tool_response>{r}</tool_response>" for r in results))
        return StepResult(observation=obs, info=info or {})
