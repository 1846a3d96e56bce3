"""The Python-tool agent: the model writes code, the sandbox runs it, the output comes back.

Select it with `--set env.kind=examples.python_agent.environment:python_agent` from the
repository root (config.toml does, on the prepared SmolLM2-135M-Instruct and the arithmetic word
problems of examples/smollm2_arithmetic). Each model turn may call the one tool,

    <tool_call>{"name": "python", "arguments": {"code": "print(12 * 7)"}}</tool_call>

whose program runs in the sandbox (`asyncrl/environments/sandbox.py`: a fresh jailed interpreter,
no network, a private directory, CPU/memory/file/wall limits from the options) and whose output
(stdout, or the last line of the error) comes back as a `tool` message through the model's chat
template. A turn without a call is the final answer: reward 1 when its `\\boxed{N}` is the
problem's answer, else 0. Options (`env.options.*`): `cpu_s` (5), `memory_mb` (256), `wall_s` (10).
"""

from __future__ import annotations

import re

from asyncrl.environments.base import EnvironmentContext, EpisodeStart
from asyncrl.environments.sandbox import SandboxLimits, run_python
from asyncrl.environments.tools import Tool, ToolEnvironment

OPTIONS = {"cpu_s": int, "memory_mb": int, "wall_s": float}
BOXED = re.compile(r"\\boxed\{\s*(-?[\d,.]+)\s*\}")


def boxed_answer(text: str) -> str | None:
    """The last `\\boxed{N}` of `text`, without thousands separators or a trailing '.0'."""
    found = BOXED.findall(text)
    if not found:
        return None
    value = found[-1].replace(",", "")
    return value[:-2] if value.endswith(".0") else value


def score(answer_text: str, start: EpisodeStart) -> float:
    return float(boxed_answer(answer_text) == start.answer.strip())


def python_tool(limits: SandboxLimits) -> Tool:
    async def python(code: str) -> str:
        """Run a Python program and return what it prints."""
        out = await run_python(code, limits)
        if out.reason != "exit":
            return f"error: the program was stopped ({out.reason})"
        if out.exit_code != 0:
            lines = out.stderr.strip().splitlines()
            return f"error: {lines[-1] if lines else f'exit status {out.exit_code}'}"
        return out.stdout.strip() or "(no output)"

    return Tool.from_function(python)


def python_agent(ctx: EnvironmentContext) -> ToolEnvironment:
    """The factory (`env.kind`): a ToolEnvironment with the sandboxed `python` tool."""
    unknown = sorted(set(ctx.options) - set(OPTIONS))
    if unknown:
        raise ValueError(f"{unknown} are not python_agent options (env.options); valid: {', '.join(OPTIONS)}")
    limits = SandboxLimits(**{k: OPTIONS[k](v) for k, v in ctx.options.items()})
    return ToolEnvironment([python_tool(limits)], score=score)
