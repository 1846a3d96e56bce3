"""Shared fixtures: a tiny untrained model directory (built once per session, no download) and a
pid liveness check for tests that must leave no process behind."""

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


def _pid_alive(pid: int) -> bool:
    """True while `pid` runs; a zombie (exited, not yet reaped) counts as gone."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


@pytest.fixture
def pid_alive():
    return _pid_alive
