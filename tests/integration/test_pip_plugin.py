"""A generator in a separate package, installed with pip, is found by its entry-point name and
used by `asyncrl launch`.

The package is built from a `pyproject.toml` in tmp_path and installed with
`pip install --no-deps --no-build-isolation --target <tmp>/site`; the launched job (and, through
the inherited environment, its generator process) sees it via PYTHONPATH. The test venv is never
touched.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from tests.conftest import short_job_args

PLUGIN = '''
"""A plugin author's generator: the built-in torch sampler, announcing itself in the log."""
import logging

from asyncrl.generators.torch_gen import TorchGenerator

log = logging.getLogger(__name__)


class PipGenerator(TorchGenerator):
    def setup(self, ctx):
        super().setup(ctx)
        log.warning("pip-installed generator %s ready", type(self).__name__)
'''


@pytest.mark.slow
def test_pip_installed_generator_is_used_by_launch(tiny_model_dir, tmp_path):
    src = tmp_path / "src"
    (src / "pip_gen_plugin").mkdir(parents=True)
    (src / "pip_gen_plugin" / "__init__.py").write_text(textwrap.dedent(PLUGIN))
    (src / "pyproject.toml").write_text(
        textwrap.dedent(
            """
            [build-system]
            requires = ["setuptools>=68"]
            build-backend = "setuptools.build_meta"

            [project]
            name = "pip-gen-plugin"
            version = "0.1"

            [project.entry-points."asyncrl.generators"]
            pipgen = "pip_gen_plugin:PipGenerator"

            [tool.setuptools]
            packages = ["pip_gen_plugin"]
            """
        )
    )
    site = tmp_path / "site"
    pip = [sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index"]
    out = subprocess.run([*pip, "--target", str(site), str(src)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert list(site.glob("pip_gen_plugin-0.1.dist-info/entry_points.txt"))

    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")])),
    }
    listed = subprocess.run(
        [sys.executable, "-m", "asyncrl", "generators"], env=env, capture_output=True, text=True, timeout=120
    )
    assert listed.returncode == 0 and "pipgen" in listed.stdout, listed.stdout + listed.stderr

    proc = subprocess.run(
        short_job_args(tiny_model_dir, tmp_path, "generators.kind=pipgen", name="pip"),
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    run_dir = tmp_path / "pip"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["trajectories_lost"] == 0
    assert "pip-installed generator PipGenerator ready" in (run_dir / "logs" / "gen-0.log").read_text()


@pytest.mark.slow
def test_the_example_agent_installs_as_a_plugin(tmp_path):
    """`pip install examples/calculator_agent` registers it as environment `calculator` (a copy is built, so
    the repository gets no build artefacts)."""
    import shutil
    from pathlib import Path

    example = Path(__file__).resolve().parents[2] / "examples" / "calculator_agent"
    src = tmp_path / "calculator_agent"
    shutil.copytree(example, src, ignore=shutil.ignore_patterns("__pycache__", "build", "*.egg-info"))
    site = tmp_path / "site"
    pip = [sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index"]
    out = subprocess.run([*pip, "--target", str(site), str(src)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    code = (
        "from asyncrl.environments.base import resolve_environment; "
        "obj = resolve_environment('calculator'); print(obj.__module__, obj.__qualname__)"
    )
    env = {**os.environ, "PYTHONPATH": str(site)}
    got = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert got.returncode == 0, got.stderr
    assert got.stdout.split() == ["calculator_agent.environment", "calculator"]
