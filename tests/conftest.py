"""Shared fixtures: a tiny untrained model directory (built once per session, no download), a
pid liveness check for tests that must leave no process behind, and short launched jobs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


@pytest.fixture(scope="session", autouse=True)
def float64_rms_norms():
    """Float64 models compute their RMSNorm in float64 in the tests. Hugging Face's RMSNorm runs
    in float32 whatever the model's dtype, so a float64 model is float32 there, and the exactness
    tests (streamed == batch, micro-batching changes nothing, ...) would compare float32
    roundings: the learner's shared-prefix forward sums a prefix's gradient over rows before the
    norm, the padded forward after it (docs/learner.md, "Shared prefixes"). Other dtypes take
    the original forward unchanged."""
    import torch
    from transformers.models.llama import modeling_llama
    from transformers.models.qwen2 import modeling_qwen2

    patched = []
    for cls in (modeling_llama.LlamaRMSNorm, modeling_qwen2.Qwen2RMSNorm):
        original = cls.forward

        def forward(self, hidden, _original=original):
            if hidden.dtype != torch.float64:
                return _original(self, hidden)
            variance = hidden.pow(2).mean(-1, keepdim=True)
            return self.weight * (hidden * torch.rsqrt(variance + self.variance_epsilon))

        cls.forward = forward
        patched.append((cls, original))
    yield
    for cls, original in patched:
        cls.forward = original


@pytest.fixture(scope="module")
def one_torch_thread():
    """Small matmuls: intra-op threads only add OpenMP contention on a busy 2-core machine
    (`pytestmark = pytest.mark.usefixtures("one_torch_thread")` in a module that wants it)."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


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


def short_job_args(model_dir: Path, out_dir: Path, *extra: str, name: str = "t") -> list[str]:
    """`asyncrl launch` arguments for a short job on the tiny model (later `--set`s win)."""
    sets = [
        f'model.path="{model_dir}"',
        f'run.out_dir="{out_dir}"',
        f'run.name="{name}"',
        "learner.steps=3",
        "learner.groups_per_step=2",
        "learner.samples_per_group=4",
        "sampling.max_new_tokens=4",
        "task.num_eval=0",
        *extra,
    ]
    args = [sys.executable, "-m", "asyncrl", "launch", "--no-tui"]
    for s in sets:
        args += ["--set", s]
    return args


def gated_job(
    model_dir: Path,
    tmp_path: Path,
    plugin: str,
    *extra: str,
    steps: int,
    groups: int,
    samples: int,
    name: str,
) -> tuple[list[str], dict[str, str], Path]:
    """A short job whose generator is `plugin` (the source of `gated_plugin.GatedGenerator`, which
    holds late steps until the file `gate` exists): (launch arguments, environment, gate)."""
    (tmp_path / "gated_plugin.py").write_text(plugin)
    gate = tmp_path / "gate"
    env = {
        **os.environ,
        "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
        "ASYNCRL_TEST_GATE": str(gate),
    }
    args = short_job_args(
        model_dir,
        tmp_path,
        f"learner.steps={steps}",
        f"learner.groups_per_step={groups}",
        f"learner.samples_per_group={samples}",
        'generators.kind="gated_plugin:GatedGenerator"',
        "generators.max_batch_groups=1",  # a batch mixing steps would hold the earlier one back
        *extra,
        name=name,
    )
    return args, env, gate


def read_records(run_dir: Path, kind: str | None = None) -> list[dict]:
    """The run's metrics.jsonl records (of one `type` if given)."""
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(x) for x in lines if x.strip()]
    return [r for r in records if kind is None or r["type"] == kind]


@pytest.fixture
def run_short_job(tiny_model_dir, tmp_path):
    """Runs a short job to completion: `run_short_job(*sets) -> (CompletedProcess, run_dir)`."""

    def run(*extra: str, timeout: float = 180, name: str = "t", check: bool = True):
        proc = subprocess.run(
            short_job_args(tiny_model_dir, tmp_path, *extra, name=name),
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if check:
            assert proc.returncode == 0, proc.stdout + proc.stderr
        return proc, tmp_path / name

    return run


def start_standin_server(model_dir: Path, *extra: str) -> tuple[subprocess.Popen, str]:
    """The stand-in SGLang server as a process, once it listens (`start_standin_process`)."""
    from tests.support.sglang.process import start_standin_process

    return start_standin_process(model_dir, *extra)


def set_up_generator(cls, model_dir, **fields):
    """A generator of class `cls` set up on `model_dir` as a generator process would be: id
    "g0", the default sampling and task sections, seed 0; `fields` sets any other
    `GeneratorContext` field (run_seed, inflight, options, opd, batching, ...)."""
    from asyncrl.config_sections import SamplingConfig, TaskConfig
    from asyncrl.generators.base import GeneratorContext

    gen = cls()
    gen.setup(
        GeneratorContext(
            generator_id="g0",
            model_path=str(model_dir),
            sampling=SamplingConfig(),
            task=TaskConfig(),
            seed=0,
            **fields,
        )
    )
    return gen


@pytest.fixture
def gate(tmp_path):
    """A shut gate (tests/support/gate.py: a FIFO) that the test opens with `gate.open()`, for
    plugins in the run's processes to wait on; let go of at the end of the test."""
    from tests.support.gate import Gate

    g = Gate(tmp_path / "gate")
    yield g
    g.close()


@pytest.fixture
def launch_streamed():
    """Starts a process (an `asyncrl launch`) with its output, errors included, read as it comes:
    `launch_streamed(args, env=None) -> LineStream` (tests/support/waiting.py). A launcher still
    running when the test ends is killed, by pid; its children follow it (they watch their parent)."""
    from tests.support.waiting import LineStream

    started: list[subprocess.Popen] = []

    def start(args: list[str], env: dict[str, str] | None = None) -> LineStream:
        proc = subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        started.append(proc)
        return LineStream(proc)

    yield start
    for proc in started:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
