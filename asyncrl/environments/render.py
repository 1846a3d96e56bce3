"""Observations to token ids, once each: the environment's part of an episode's token stream.

Place in the data flow: the episode runner (`generators/episode_runner.py`) appends what `render` returns after the
model's turn, as masked ids; nothing already in the episode is ever tokenised again. `ids` are
taken as given (checked against the vocabulary); `text` is tokenised on its own, with no special
tokens added; `messages` go through the tokenizer's chat template as the continuation of a
conversation whose last turn was the model's (`continuation_text`), so a chat model sees exactly
the markers it would see in a rendered conversation (e.g. `<|im_start|>tool ... <|im_start|>assistant`).

A malformed observation (more than one form, ids outside the vocabulary, a message without a
string role and content, messages for a tokenizer without a chat template) raises
`BadObservation`, which the runner counts and handles as an environment failure.
"""

from __future__ import annotations

from typing import Any

from asyncrl.environments.base import Observation

PLACEHOLDER = "\x00ASYNCRL-TURN\x00"  # a model turn's content in the template probe; never real text


class BadObservation(ValueError):
    """The environment answered something that cannot be appended to the episode."""


class ObservationRenderer:
    """Renders observations with one tokenizer (the model's)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = len(tokenizer)
        self.has_template = bool(getattr(tokenizer, "chat_template", None))

    def render(self, obs: Any) -> list[int]:
        if not isinstance(obs, Observation):
            raise BadObservation(f"an observation must be an Observation, got {type(obs).__name__}")
        forms = [f for f in ("ids", "text", "messages") if getattr(obs, f) is not None]
        if len(forms) > 1:
            raise BadObservation(f"an observation has one of ids, text or messages; got {', '.join(forms)}")
        if obs.ids is not None:
            return self._checked_ids(obs.ids)
        if obs.text is not None:
            return self._encode(obs.text)
        if obs.messages is not None:
            return self._encode(self.continuation_text(obs.messages))
        return []

    def _checked_ids(self, ids: Any) -> list[int]:
        bad = [
            t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < self.vocab_size
        ]
        if bad:
            raise BadObservation(
                f"observation ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})"
            )
        return list(ids)

    def _encode(self, text: Any) -> list[int]:
        if not isinstance(text, str):
            raise BadObservation(f"observation text must be a string, got {type(text).__name__}")
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def continuation_text(self, messages: Any) -> str:
        """The template's text for `messages` after a finished model turn, up to the next model
        turn's start: the template rendered with and without them, after a probe assistant turn,
        minus what the model itself wrote (the probe's content and its end-of-turn token)."""
        if not isinstance(messages, list) or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages
        ):
            raise BadObservation("observation messages must be a list of {'role': str, 'content': str}")
        if not self.has_template:
            raise BadObservation(
                "the environment answered chat messages, but the model's tokenizer has no chat template; "
                "answer with text or ids"
            )
        probe = [{"role": "user", "content": "?"}, {"role": "assistant", "content": PLACEHOLDER}]
        full = self.tokenizer.apply_chat_template(
            [*probe, *messages], tokenize=False, add_generation_prompt=True
        )
        start = full.index(PLACEHOLDER) + len(PLACEHOLDER)
        eos = self.tokenizer.eos_token or ""
        if eos and full.startswith(eos, start):  # the model's own end-of-turn token was sampled, not rendered
            start += len(eos)
        return full[start:]
