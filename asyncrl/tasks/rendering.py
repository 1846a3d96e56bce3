"""Prompt rendering: `Problem`s to prompt token ids, as raw text or through a chat template.

Sits between a task's rows and the launcher's dispatch: the `dataset` task (`tasks/dataset.py`)
renders every prompt once in `prepare` into a `PromptCache` (so dispatch is a lookup) and any
problem it has not seen on demand.
Raw text is tokenized in one batched call (`tokenizer(texts)`); chat prompts go through
`tokenizer.apply_chat_template(..., add_generation_prompt=True, tokenize=True)` in batches, with
whatever it returns (a list, or a dict/BatchEncoding in recent transformers) normalised to plain
`list[int]`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from asyncrl.tasks.base import Problem


class PromptLimit(NamedTuple):
    """The longest prompt a run takes (0 = no limit), what sets it, and how to lift it."""

    tokens: int
    text: str
    fix: str


def prompt_limit(max_tokens: int, room: int) -> PromptLimit:
    """The tighter of task.prompt.max_tokens and `room`, the model's context less
    sampling.max_new_tokens (either 0 = none)."""
    if room and (not max_tokens or room < max_tokens):
        return PromptLimit(
            room,
            f"the {room} tokens the model's context leaves beside sampling.max_new_tokens",
            "lower sampling.max_new_tokens, shorten the prompt, or use a model with a longer context",
        )
    return PromptLimit(max_tokens, f"task.prompt.max_tokens = {max_tokens}", "raise task.prompt.max_tokens")


CHAT_BATCH = 512  # conversations per apply_chat_template call (bounds the memory of one call)


def check_chat_template(tokenizer: Any) -> None:
    """ValueError unless `tokenizer` can render chat prompts (task.prompt.template = "chat")."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"task.prompt.template = 'chat' but the tokenizer ({type(tokenizer).__name__}) has no "
            "chat_template; set task.prompt.template = 'raw' or use a tokenizer with a chat_template"
        )


def chat_messages(problem: Problem, system: str) -> list[dict[str, Any]]:
    """The conversation of `problem`: its own messages, or one user turn with its prompt; `system`
    (task.prompt.system) goes first unless empty or the row brings a system message of its own."""
    if problem.messages is not None:
        messages = [dict(m) for m in problem.messages]
    else:
        messages = [{"role": "user", "content": problem.prompt}]
    if system and not any(m.get("role") == "system" for m in messages):
        messages.insert(0, {"role": "system", "content": system})
    return messages


def _plain(ids: Any) -> list[int]:
    return [int(t) for t in ids]


def _input_ids(result: Any) -> Any:
    """`input_ids` of a tokenizer result: a BatchEncoding/dict (recent transformers) or the ids."""
    if isinstance(result, Mapping) or hasattr(result, "keys"):
        return result["input_ids"]
    return result


def render_texts(texts: Sequence[str], tokenizer: Any) -> list[list[int]]:
    """Raw prompts, tokenized in one call (one call per prompt costs several times the CPU)."""
    if not texts:
        return []
    return [_plain(ids) for ids in _input_ids(tokenizer(list(texts)))]


def render_chats(conversations: Sequence[list[dict[str, Any]]], tokenizer: Any) -> list[list[int]]:
    """Conversations through the tokenizer's chat template, generation prompt added, in batches."""
    out: list[list[int]] = []
    for start in range(0, len(conversations), CHAT_BATCH):
        batch = list(conversations[start : start + CHAT_BATCH])
        ids = _input_ids(tokenizer.apply_chat_template(batch, add_generation_prompt=True, tokenize=True))
        ids = list(ids)
        if len(batch) == 1 and ids and isinstance(ids[0], int):
            ids = [ids]  # one flat list for a single conversation
        if len(ids) != len(batch):
            raise ValueError(
                f"asyncrl/tasks/rendering.py: apply_chat_template returned {len(ids)} prompts for "
                f"{len(batch)} conversations; this tokenizer's chat template is not supported"
            )
        out.extend(_plain(row) for row in ids)
    return out


def render_problems(
    problems: Sequence[Problem], tokenizer: Any, *, template: str, system: str
) -> list[list[int]]:
    """The prompt ids of `problems`, in order: `template` "raw" (prompt text) or "chat"."""
    if not problems:
        return []
    if template == "raw":
        return render_texts([p.prompt for p in problems], tokenizer)
    check_chat_template(tokenizer)
    return render_chats([chat_messages(p, system) for p in problems], tokenizer)


class PromptCache:
    """Prompt ids rendered once with one tokenizer, so the launcher's dispatch path is a lookup.

    Text prompts are keyed by their text (they render the same way every time); chat rows by the
    identity of their messages tuple, which a task shares between its stored row and every Problem
    it hands out (the cache keeps that tuple alive, so its id cannot be reused by another object)."""

    def __init__(self, tokenizer: Any, *, template: str, system: str) -> None:
        if template == "chat":
            check_chat_template(tokenizer)
        self.tokenizer = tokenizer
        self.template, self.system = template, system
        self._by_prompt: dict[str, list[int]] = {}
        self._by_messages: dict[int, tuple[tuple, list[int]]] = {}

    def get(self, problem: Problem) -> list[int] | None:
        if problem.messages is None:
            return self._by_prompt.get(problem.prompt)
        entry = self._by_messages.get(id(problem.messages))
        return entry[1] if entry is not None and entry[0] is problem.messages else None

    def _put(self, problem: Problem, ids: list[int]) -> None:
        if problem.messages is None:
            self._by_prompt[problem.prompt] = ids
        else:
            self._by_messages[id(problem.messages)] = (problem.messages, ids)

    def render(self, problems: Sequence[Problem]) -> list[list[int]]:
        """Ids of `problems` in order: cached ones copied, the others rendered now (not cached)."""
        out = [self.get(p) for p in problems]
        missing = [k for k, ids in enumerate(out) if ids is None]
        fresh = self._render([problems[k] for k in missing])
        for k, ids in zip(missing, fresh, strict=True):
            out[k] = ids
        return [list(ids) for ids in out]  # type: ignore[arg-type]

    def _render(self, problems: Sequence[Problem]) -> list[list[int]]:
        return render_problems(problems, self.tokenizer, template=self.template, system=self.system)

    def admit(
        self,
        problems: Sequence[Problem],
        where: Sequence[str],
        *,
        wanted: int,
        limit: PromptLimit,
        too_long: str,
    ) -> tuple[list[int], int, int]:
        """Render `problems` in order until `wanted` of them fit `limit` and cache those. Returns
        (their positions, how many were too long, the longest kept length); with too_long =
        "error" the first longer prompt raises, naming `where[k]`, the limit and the fix."""
        kept: list[int] = []
        dropped = longest = start = 0
        while len(kept) < wanted and start < len(problems):
            stop = min(len(problems), start + max(wanted - len(kept), 256))
            for k, ids in zip(range(start, stop), self._render(problems[start:stop]), strict=True):
                if len(kept) == wanted:
                    break
                if limit.tokens and len(ids) > limit.tokens:
                    if too_long == "error":
                        raise ValueError(
                            f"{where[k]}: the prompt renders to {len(ids)} tokens, over {limit.text}; "
                            f"{limit.fix}, or set task.prompt.too_long = 'drop'"
                        )
                    dropped += 1
                    continue
                kept.append(k)
                longest = max(longest, len(ids))
                self._put(problems[k], ids)
            start = stop
        return kept, dropped, longest
