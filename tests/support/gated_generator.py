"""A generator plugin that holds late tasks until the test opens a gate (`generators.kind =
"tests.support.gated_generator:GatedGenerator"`), so a test can act in the middle of a run
however fast or loaded the machine is.

Which tasks wait comes from the environment the test gives the run (`gate_env`): groups numbered
`first_held` or more wait for the gate (tests/support/gate.py); in window mode, step s's groups
are numbered from s * groups_per_step. The wait is a blocking open of the gate's FIFO in a
daemon thread: the event loop keeps serving heartbeats and other tasks meanwhile, and a process
that exits with the gate still shut is not held up by the thread.
"""

from __future__ import annotations

import asyncio
import os
import threading
from pathlib import Path

from asyncrl.generators.torch_gen import TorchGenerator
from tests.support.gate import GATE_ENV, wait_until_open

HELD_ENV = "ASYNCRL_TEST_GATE_FIRST_HELD"  # the first group number that waits


def gate_env(gate_path: Path, *, first_held: int) -> dict[str, str]:
    """The variables a run's environment needs for `GatedGenerator` to hold groups numbered
    `first_held` or more until the gate at `gate_path` opens."""
    return {GATE_ENV: str(gate_path), HELD_ENV: str(first_held)}


class GatedGenerator(TorchGenerator):
    _opened: asyncio.Future | None = None

    async def generate(self, tasks):
        if any(t.group_id >= int(os.environ[HELD_ENV]) for t in tasks):
            # shield: a cancelled generate (a shutdown) must not cancel the one shared wait
            await asyncio.shield(self._gate_opened())
        return await super().generate(tasks)

    def _gate_opened(self) -> asyncio.Future:
        """One future per process, set when the gate opens (a thread blocks on its FIFO)."""
        if self._opened is None:
            loop = asyncio.get_running_loop()
            opened = self._opened = loop.create_future()

            def wait() -> None:
                wait_until_open(os.environ[GATE_ENV])
                loop.call_soon_threadsafe(lambda: opened.done() or opened.set_result(None))

            threading.Thread(target=wait, name="test-gate", daemon=True).start()
        return self._opened


def gated_job_args(
    model_dir: Path,
    out_dir: Path,
    gate_path: Path,
    *extra: str,
    first_held: int,
    steps: int,
    groups: int,
    samples: int,
    name: str,
) -> tuple[list[str], dict[str, str]]:
    """(launch arguments, environment) of a short job on `GatedGenerator`, holding groups
    numbered `first_held` or more until the gate at `gate_path` opens."""
    from tests.conftest import short_job_args

    root = str(Path(__file__).resolve().parents[2])  # the repository: `tests.support` importable
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([root, *filter(None, [os.environ.get("PYTHONPATH")])]),
        **gate_env(gate_path, first_held=first_held),
    }
    args = short_job_args(
        model_dir,
        out_dir,
        f"learner.steps={steps}",
        f"learner.groups_per_step={groups}",
        f"learner.samples_per_group={samples}",
        'generators.kind="tests.support.gated_generator:GatedGenerator"',
        "generators.max_batch_groups=1",  # a batch mixing held and free tasks would hold both
        *extra,
        name=name,
    )
    return args, env
