"""What the fork server imports before it forks any worker (`spawner.prewarm`, `ForkSpawner`).

Importing this module imports `PRELOAD`, each on its own: a module that fails here (a backend
that is not installed, a broken plugin) is skipped, so the fork server always comes up; the
worker that needs it imports it again after the fork and reports the error as it would have.
Nothing here may start a thread or touch a GPU: workers are forked from this state.
"""

from __future__ import annotations

import importlib
import logging

# What every worker imports first; another backend's modules are imported by the worker.
PRELOAD = (
    "torch",
    "transformers",
    "transformers.modeling_utils",
    "transformers.models.llama.modeling_llama",
    "transformers.models.qwen2.modeling_qwen2",
    "asyncrl.learner.service",
    "asyncrl.generators.service",
    "asyncrl.generators.torch_gen",
    "asyncrl.generators.teacher_service",
    "asyncrl.models.sampling",
)

preloaded: list[str] = []
for _name in PRELOAD:
    try:
        importlib.import_module(_name)
        preloaded.append(_name)
    except Exception as _exc:  # noqa: BLE001 - see the module docstring
        logging.getLogger(__name__).debug("fork server: %s not preloaded: %s", _name, _exc)
