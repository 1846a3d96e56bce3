"""Shared fixtures: a tiny untrained model directory (built once per session, no download)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    from asyncrl.models.hf import quiet_offline
    from asyncrl.models.tiny import create_base

    quiet_offline()
    return create_base(
        tmp_path_factory.mktemp("tiny") / "model", hidden_size=32, num_layers=1, num_heads=2, seed=0
    )
