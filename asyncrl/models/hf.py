"""Hugging Face settings for every asyncrl process: offline, quiet."""

from __future__ import annotations

import os


def quiet_offline() -> None:
    """Never reach a hub (checkpoints load from local directories) and keep logs to errors.

    Call before importing transformers; child processes inherit the environment.
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:
        return
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
