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
