"""The real pretrained model of the suite, SmolLM2-135M-Instruct, when it is prepared.

Tests that need it call `real_model_dir()`: without the prepared directory they skip, naming the
command that prepares it, unless ASYNCRL_REQUIRE_REAL_MODEL=1 (set by .ci/run, which prepares it),
where a missing model fails the test instead of hiding it.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from asyncrl.models.prepare import PROVENANCE, models_home

NAME = "smollm2-135m-instruct"
PREPARE = f"pip install -e '.[gguf]' && asyncrl models prepare {NAME}"


def real_model_dir() -> Path:
    path = models_home() / NAME
    if (path / PROVENANCE).is_file():
        return path
    message = f"the real model is not prepared at {path}: run `{PREPARE}`"
    if os.environ.get("ASYNCRL_REQUIRE_REAL_MODEL") == "1":
        pytest.fail(message)
    pytest.skip(message)
