"""The example configs load and validate as users would run them (`asyncrl launch FILE`): keys,
rewards, generator options. The GPU recipe's model and data are the user's own downloads, so
only the config is checked here, never a file it names."""

from __future__ import annotations

from pathlib import Path

import pytest

from asyncrl.config_load import load_config
from asyncrl.generators.base import resolve_generator

ROOT = Path(__file__).resolve().parents[2]
RECIPES = sorted((ROOT / "examples" / "recipes").glob("*.toml"))


@pytest.mark.parametrize("path", RECIPES, ids=[p.name for p in RECIPES])
def test_gpu_recipe_validates(path):
    config = load_config(path)
    assert config.task.kind == "dataset" and config.task.rewards
    check = getattr(resolve_generator(config.generators.kind), "check_config", None)
    if check is not None:
        check(config)


def test_there_is_a_gpu_recipe():
    assert RECIPES


def test_word_problems_config_loads_its_shipped_data(monkeypatch, tmp_path):
    """Its paths are relative to the file, so it loads from any directory (it used to need the
    repository root: "model.path examples/word_problems/model is not a Hugging Face model directory")."""
    from asyncrl.tasks.base import make_task

    monkeypatch.chdir(tmp_path)
    config = load_config(ROOT / "examples" / "word_problems" / "config.toml")
    task = make_task(config.task)
    assert task.num_train >= 1000 and len(task.eval_problems) == config.task.num_eval
    assert Path(config.model.path, "config.json").is_file()
