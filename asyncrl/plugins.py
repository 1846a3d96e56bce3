"""Finding plugins: a registry name (an entry point of a group) or a `pkg.mod:obj` path.

A leaf shared by every plugin seam (generators, tasks, weight publishers). Lookup happens when a
run starts, never at import; a name that is unknown, or a plugin that fails to import, is a
ValueError naming the config field, the plugin and the valid names.
"""

from __future__ import annotations

import importlib
from importlib.metadata import entry_points
from typing import Any


def available(group: str) -> dict[str, str]:
    """Registry name -> `module:object` for every installed plugin of entry-point `group`."""
    return {ep.name: ep.value for ep in entry_points(group=group)}


def load_plugin(group: str, kind: str, *, field: str, what: str) -> Any:
    """The object registered as `kind` in `group`, or at the `pkg.module:obj` path `kind`."""
    if ":" in kind:
        target = kind
    else:
        names = available(group)
        if kind not in names:
            valid = ", ".join(sorted(names)) or "(none installed)"
            raise ValueError(
                f"unknown {what} {kind!r} ({field}); valid names: {valid}, or a 'pkg.module:Class' path"
            )
        target = names[kind]
    module_name, _, attr = target.partition(":")
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"{what} plugin {kind!r} could not be loaded from {target!r}: {exc}") from None
