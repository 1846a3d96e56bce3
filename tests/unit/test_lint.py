"""The settings linter (asyncrl/lint.py): each rule fires on its unsafe combination and stays
quiet on the nearest safe one; errors refuse the config unless `run.allow_unsafe` accepts them."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from asyncrl.config_load import load_config
from asyncrl.config_sections import ConfigError
from asyncrl.lint import RULES, STALE_UNCORRECTED_ERROR, STALE_UNCORRECTED_WARN, lint
from asyncrl.models.default import DEFAULT_MODEL_DIR, TEACHER_MODEL_DIR


def found(*overrides: str) -> dict[str, str]:
    """rule -> level for a config loaded without refusing."""
    return {f.rule: f.level for f in lint(load_config(overrides=list(overrides), lint=False))}


def test_the_default_job_is_clean():
    assert found() == {}


# rule -> (unsafe overrides, level, the nearest safe overrides)
CASES = {
    "stale-uncorrected": (
        [f"staleness.max_staleness={STALE_UNCORRECTED_ERROR + 1}"],
        "error",
        [f"staleness.max_staleness={STALE_UNCORRECTED_ERROR + 1}", "staleness.policy=decoupled"],
    ),
    "epochs-stale-uncorrected": (
        ["learner.epochs=2"],
        "warning",
        ["learner.epochs=2", "mode=sync"],
    ),
    "decoupled-one-update": (
        ["staleness.policy=decoupled", "staleness.max_staleness=8"],
        "warning",
        ["staleness.policy=decoupled", "staleness.max_staleness=8", "learner.minibatches=4"],
    ),
    "greedy-groups": (["sampling.temperature=0"], "error", ["sampling.temperature=0.5"]),
    "top-p-plugin": (
        ["sampling.top_p=0.9", "generators.kind=my_pkg.gen:MyGenerator"],
        "warning",
        ["sampling.top_p=0.9"],
    ),
    "opd-top-p": (["opd.enabled=true", "sampling.top_p=0.9"], "warning", ["opd.enabled=true"]),
    "opd-temperature": (
        ["opd.enabled=true", "sampling.temperature=0.7"],
        "warning",
        ["sampling.temperature=0.7"],
    ),
    "drop-degenerate-window": (
        ["learner.drop_degenerate_groups=true"],
        "warning",
        ["learner.drop_degenerate_groups=true", "buffer.mode=pool"],
    ),
    "length-biased-agg": (["learner.agg=seq-mean-token-mean"], "warning", ["learner.agg=token-mean"]),
    "ignore-eos-training": (["sampling.ignore_eos=true"], "warning", ["sampling.ignore_eos=false"]),
}


@pytest.mark.parametrize("rule", sorted(CASES))
def test_each_rule_fires_on_its_combination_only(rule):
    unsafe, level, safe = CASES[rule]
    assert found(*unsafe).get(rule) == level
    assert rule not in found(*safe)


def test_every_rule_has_a_case_and_a_line_in_the_docs():
    from pathlib import Path

    docs = (Path(__file__).resolve().parents[2] / "docs" / "safety.md").read_text()
    for rule in RULES:
        assert rule in CASES or rule == "opd-tokenizer", f"rule {rule} has no test case"
        assert f"`{rule}`" in docs, f"rule {rule} is not listed in docs/safety.md"


def test_the_stale_bound_warns_then_refuses():
    assert "stale-uncorrected" not in found(f"staleness.max_staleness={STALE_UNCORRECTED_WARN}")
    assert found(f"staleness.max_staleness={STALE_UNCORRECTED_WARN + 1}")["stale-uncorrected"] == "warning"
    assert found(f"staleness.max_staleness={STALE_UNCORRECTED_ERROR}")["stale-uncorrected"] == "warning"
    assert found(f"staleness.max_staleness={STALE_UNCORRECTED_ERROR + 1}")["stale-uncorrected"] == "error"
    # sync mode trains on-policy whatever the bound says
    assert "stale-uncorrected" not in found("staleness.max_staleness=20", "mode=sync")


def test_an_error_refuses_the_config_naming_the_setting_and_the_fix():
    with pytest.raises(ConfigError) as exc:
        load_config(overrides=["sampling.temperature=0"])
    text = str(exc.value)
    assert "sampling.temperature" in text and "temperature > 0" in text
    assert 'run.allow_unsafe=["greedy-groups"]' in text


def test_allow_unsafe_turns_an_error_into_a_warning():
    config = load_config(overrides=["sampling.temperature=0", 'run.allow_unsafe=["greedy-groups"]'])
    assert {f.rule: f.level for f in lint(config)} == {"greedy-groups": "warning"}


def test_allow_unsafe_rejects_a_rule_that_does_not_exist():
    with pytest.raises(ConfigError, match="unknown rule.*'greedy'.*greedy-groups"):
        load_config(overrides=['run.allow_unsafe=["greedy"]'])


def _model_copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_a_teacher_with_another_tokenizer_is_refused(tmp_path):
    teacher = _model_copy(TEACHER_MODEL_DIR, tmp_path / "teacher")
    overrides = ["opd.enabled=true", f"opd.teacher={teacher}"]
    assert "opd-tokenizer" not in found(*overrides)  # a copy of the shipped teacher: same tokenizer
    tok = json.loads((teacher / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    first, second = sorted(vocab, key=vocab.get)[4:6]  # swap two characters' ids
    vocab[first], vocab[second] = vocab[second], vocab[first]
    (teacher / "tokenizer.json").write_text(json.dumps(tok))
    assert found(*overrides)["opd-tokenizer"] == "error"
    with pytest.raises(ConfigError, match="opd.teacher.*different tokenizer"):
        load_config(overrides=overrides)


def test_a_student_directory_without_tokenizer_files_is_left_to_load_time(tmp_path):
    student = tmp_path / "student"
    student.mkdir()
    (student / "config.json").write_text((DEFAULT_MODEL_DIR / "config.json").read_text())
    assert "opd-tokenizer" not in found("opd.enabled=true", f"model.path={student}")


def test_asyncrl_lint_lists_findings_and_fails_on_an_error():
    run = [sys.executable, "-m", "asyncrl", "lint", "--set", "learner.epochs=2"]
    warned = subprocess.run(run, capture_output=True, text=True, timeout=120)
    assert warned.returncode == 0, warned.stderr
    assert "warning [epochs-stale-uncorrected] at learner.epochs" in warned.stdout
    refused = subprocess.run(
        [*run, "--set", "sampling.temperature=0"], capture_output=True, text=True, timeout=120
    )
    assert refused.returncode == 1
    assert "error [greedy-groups] at sampling.temperature" in refused.stdout
