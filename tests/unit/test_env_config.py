"""The `env` config section: checks at load, and what the generators check before any process starts."""

from __future__ import annotations

import pytest

from asyncrl.config_load import load_config


def test_defaults_are_single_turn():
    cfg = load_config(overrides=[])
    assert cfg.env.kind == "" and cfg.env.workers == 2 and cfg.env.on_failure == "retry"


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        (['env.kind="x:y"', 'task.rewards=[{kind="exact_match"}]'], "carry their own reward"),
        (["env.max_turns=0"], "max_turns"),
        (['env.on_failure="ignore"'], "on_failure"),
        (["env.sandbox.memory_mb=-1"], "memory_mb"),
    ],
)
def test_bad_settings_fail_at_load(sets, message):
    with pytest.raises(ValueError, match=message):
        load_config(overrides=sets)


def test_an_unknown_environment_fails_before_any_process_starts():
    from asyncrl.generators.sglang import SGLangGenerator
    from asyncrl.generators.torch_gen import TorchGenerator

    cfg = load_config(overrides=['env.kind="no_such_environment"'])
    with pytest.raises(ValueError, match="unknown environment 'no_such_environment'.*env.kind"):
        TorchGenerator.check_config(cfg)
    cfg = load_config(
        overrides=[
            'env.kind="asyncrl.nowhere:env"',
            'generators.options.urls="http://127.0.0.1:1"',
            'generators.kind="sglang"',
        ]
    )
    with pytest.raises(ValueError, match="could not be loaded"):
        SGLangGenerator.check_config(cfg)


def test_stop_tokens_must_be_single_tokens():
    from transformers import AutoTokenizer

    from asyncrl.generators.episodes import stop_token_ids
    from asyncrl.models.default import DEFAULT_MODEL_DIR

    tok = AutoTokenizer.from_pretrained(DEFAULT_MODEL_DIR)
    assert stop_token_ids(tok, ["="]) == {tok.convert_tokens_to_ids("="): "="}
    with pytest.raises(ValueError, match="env.stop_tokens: '12' is 2 tokens"):
        stop_token_ids(tok, ["12"])
