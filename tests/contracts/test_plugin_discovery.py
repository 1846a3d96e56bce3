"""A generator shipped in a separate distribution is found by its entry-point name.

The distribution is a `.dist-info` directory with `entry_points.txt` next to its package in a
temporary directory put on PYTHONPATH of a child interpreter: exactly what `pip install` leaves
in site-packages, without touching the test venv.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap


def test_entry_point_plugin_is_found_by_name(tmp_path):
    pkg = tmp_path / "echo_generator"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(
        textwrap.dedent(
            '''
            class EchoGenerator:
                """Returns the prompt as its completion (a plugin author's first generator)."""
                def setup(self, ctx): self.ctx = ctx
                @property
                def version(self): return 0
                async def generate(self, tasks): return []
                async def load_weights(self, version, location): pass
                async def close(self): pass
            '''
        )
    )
    dist = tmp_path / "echo_generator-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: echo-generator\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[asyncrl.generators]\necho = echo_generator:EchoGenerator\n")
    code = (
        "import json; from asyncrl.generators.base import available_generators, resolve_generator, Generator;"
        "cls = resolve_generator('echo');"
        "print(json.dumps({'names': sorted(available_generators()), 'cls': cls.__qualname__,"
        " 'protocol': isinstance(cls(), Generator)}))"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert "echo" in got["names"] and got["cls"] == "EchoGenerator" and got["protocol"]
