"""Hugging Face settings for every asyncrl process: offline, quiet."""

from __future__ import annotations

import os
import sys


def quiet_offline() -> None:
    """Never reach a hub (checkpoints load from local directories) and keep logs to errors.

    Call before importing transformers; child processes inherit the environment.
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # transformers reads the variables above when it is imported; only a process that imported it
    # already needs telling (importing it here would cost a process that needs no model ~1 s).
    if "transformers" in sys.modules:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()


def load_tokenizer(path):
    """The tokenizer of the model directory `path`, as `AutoTokenizer.from_pretrained` loads it.

    When tokenizer_config.json names its class, that class is loaded directly: the same object
    AutoTokenizer resolves to, without AutoTokenizer's import of the model-config machinery, which
    pulls in torch (about 2 s of CPU at start-up in a process, the launcher, that needs no torch).
    Otherwise (no class named, or one transformers does not export) AutoTokenizer decides.
    """
    import json
    from pathlib import Path

    import transformers

    config_file = Path(path) / "tokenizer_config.json"
    name = None
    if config_file.is_file():
        try:
            name = json.loads(config_file.read_text()).get("tokenizer_class")
        except (OSError, ValueError, AttributeError):
            name = None  # AutoTokenizer reports an unreadable config in its own words
    cls = None
    if isinstance(name, str) and name.isidentifier():
        try:
            cls = getattr(transformers, name, None)
        except (ImportError, RuntimeError):  # a lazy export whose backend is missing
            cls = None
    if cls is None or not hasattr(cls, "from_pretrained"):
        cls = transformers.AutoTokenizer
    return cls.from_pretrained(path)


CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")


def context_length(path) -> int:
    """The number of positions the model at `path` reads (its config.json), 0 when it names none."""
    import json
    from pathlib import Path

    try:
        config = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return 0
    config = config.get("text_config", config)  # a multimodal wrapper names the language model's
    return next((int(config[k]) for k in CONTEXT_KEYS if isinstance(config.get(k), int)), 0)


def prompt_room(path, max_new_tokens: int) -> int:
    """The longest prompt the model at `path` can take with `max_new_tokens` generated after it
    (0: the model names no context length, no limit). ValueError when there is no room at all."""
    context = context_length(path)
    if not context:
        return 0
    if max_new_tokens >= context:
        raise ValueError(
            f"sampling.max_new_tokens = {max_new_tokens} leaves no room for a prompt: the model at {path} "
            f"reads {context} positions (max_position_embeddings); lower sampling.max_new_tokens"
        )
    return context - max_new_tokens
