"""`lazy_module`: a module-level name for a heavy module, imported on first use.

For modules that the launcher imports to validate a config (the staleness policies) but whose
math only the learner runs: the launcher never pays for torch (about 1 s of CPU at start-up).
On first attribute access the real module is imported and replaces the placeholder in the
owner's globals, so later accesses cost nothing extra.
"""

from __future__ import annotations

import importlib
from typing import Any


class _LazyModule:
    def __init__(self, name: str, owner: dict[str, Any], binding: str) -> None:
        self._name = name
        self._owner = owner
        self._binding = binding

    def __getattr__(self, attr: str) -> Any:
        module = importlib.import_module(self._name)
        self._owner[self._binding] = module  # the owner's later lookups find the module itself
        return getattr(module, attr)

    def __repr__(self) -> str:
        return f"<lazy module {self._name!r}>"


def lazy_module(name: str, owner: dict[str, Any], binding: str | None = None) -> Any:
    """A placeholder for module `name`, bound in `owner` (a module's `globals()`) as `binding`
    (default: the module's last dotted part), that imports it on first use."""
    return _LazyModule(name, owner, binding or name.rpartition(".")[2])
