"""The import contract: asyncrl's layers, checked on the source's import graph.

  app     cli, job, evaluator, worker, slurm, benchmarks,      may import anything; nothing imports them
          testing, __main__
  roles   scheduler, learner, generators, monitor   leaves, infra and their own package only
  infra   transport, runtime                        leaves and infra only
  leaves  messages, config, config_sections,        leaves only
          config_load, config_objective, config_budget, lint,
          plugins, lazy, tasks, rewards,
          kernels, staleness, buffer, models,
          environments

So roles meet only through messages (and the shared leaves): a capability that needs two roles
to agree adds a message, not an import. Every import counts, lazy ones inside functions and
`TYPE_CHECKING` ones included (a type-only import of another role is still a dependency).
docs/architecture.md draws the same picture.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import NamedTuple

import pytest

import asyncrl

PACKAGE_ROOT = Path(asyncrl.__file__).resolve().parent

APP = frozenset({"cli", "job", "replay", "evaluator", "worker", "slurm", "benchmarks", "testing", "__main__"})
ROLES = frozenset({"scheduler", "learner", "generators", "monitor"})
INFRA = frozenset({"transport", "runtime"})
LEAVES = frozenset(
    {
        "messages",
        "config",
        "config_sections",
        "config_load",
        "config_objective",
        "config_budget",
        "lint",
        "plugins",
        "lazy",
        "tasks",
        "rewards",
        "kernels",
        "staleness",
        "buffer",
        "models",
        "environments",
    }
)
# Pure modules inside a role's package that are leaves themselves (STYLE.md: "the pure modules of
# staleness/ and learner/"): the policy losses and their registry, which the config checks
# `learner.loss` against at load time. They import only leaves.
LEAF_MODULES = frozenset({"asyncrl.learner.losses", "asyncrl.learner.policy_losses"})


class Import(NamedTuple):
    source: str  # the importing module, e.g. "asyncrl.monitor.stream"
    target: str  # the imported module, e.g. "asyncrl.scheduler.service"
    where: str  # path:line


def component(module: str) -> str:
    """`asyncrl.monitor.stream` -> `monitor`; the package itself is `asyncrl`."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "asyncrl"


def layer(name: str) -> str:
    for label, names in (("app", APP), ("role", ROLES), ("infra", INFRA), ("leaf", LEAVES)):
        if name in names:
            return label
    if name == "asyncrl":
        return "leaf"  # the package __init__: a docstring and the version
    raise AssertionError(
        f"asyncrl.{name} is in no layer: add it to one of APP, ROLES, INFRA, LEAVES in {__file__} "
        "and to docs/architecture.md"
    )


def module_layer(module: str) -> str:
    return "leaf" if module in LEAF_MODULES else layer(component(module))


def module_name(path: Path, root: Path = PACKAGE_ROOT) -> str:
    rel = path.relative_to(root.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path, root: Path = PACKAGE_ROOT) -> list[Import]:
    """Every `asyncrl` import in one file of the package at `root`, at any depth of its syntax tree."""
    source = module_name(path, root)
    package = source if path.name == "__init__.py" else source.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                targets = [".".join([*base, *([node.module] if node.module else [])])]
            else:
                targets = [node.module or ""]
        for target in targets:
            if target == "asyncrl" or target.startswith("asyncrl."):
                found.append(Import(source, target, f"{path.relative_to(root.parent)}:{node.lineno}"))
    return found


def import_graph(root: Path = PACKAGE_ROOT) -> list[Import]:
    return [imp for path in sorted(root.rglob("*.py")) for imp in imports_of(path, root)]


def violation(imp: Import) -> str | None:
    """Why `imp` breaks the layering, or None if it is allowed."""
    src, dst = component(imp.source), component(imp.target)
    src_layer, dst_layer = module_layer(imp.source), module_layer(imp.target)
    if src == dst and not (src_layer == "leaf" and dst_layer != "leaf"):
        return None
    if dst_layer == "app" and src_layer != "app":
        return f"{src} ({src_layer}) imports the app layer ({dst}); nothing below the CLI may"
    if src_layer == "app":
        return None
    if src_layer == "leaf" and dst_layer != "leaf":
        return f"leaf {src} imports {dst_layer} {dst}; leaves import only leaves"
    if src_layer == "infra" and dst_layer == "role":
        return f"infrastructure {src} imports role {dst}; it may import leaves and infrastructure"
    if src_layer == "role" and dst_layer == "role":
        return f"role {src} imports role {dst}; roles meet through messages (asyncrl/messages.py) and leaves"
    return None


def test_every_import_respects_the_layers():
    broken = [
        f"{imp.where}: {imp.source} -> {imp.target}: {why}"
        for imp in import_graph()
        if (why := violation(imp)) is not None
    ]
    assert not broken, "import contract broken:\n" + "\n".join(broken)


def test_every_package_is_in_a_layer():
    names = {component(module_name(p)) for p in PACKAGE_ROOT.rglob("*.py")}
    for name in names:
        layer(name)


@pytest.mark.parametrize(
    ("source", "target"),
    [
        ("asyncrl.monitor.stream", "asyncrl.scheduler.service"),  # the old monitor <-> launcher cycle
        ("asyncrl.scheduler.service", "asyncrl.monitor.stream"),
        ("asyncrl.config", "asyncrl.learner.objective"),
        ("asyncrl.models.sampling", "asyncrl.generators.base"),
        ("asyncrl.generators.torch_gen", "asyncrl.learner.trainer"),
        ("asyncrl.kernels.logprobs", "asyncrl.learner.trainer"),
        ("asyncrl.transport.publisher", "asyncrl.generators.sglang"),
        ("asyncrl.learner.service", "asyncrl.cli"),
        ("asyncrl.learner.policy_losses", "asyncrl.learner.trainer"),  # a leaf module stays a leaf
    ],
)
def test_the_cross_role_imports_the_issue_named_are_refused(source, target):
    assert violation(Import(source, target, "x.py:1")) is not None


@pytest.mark.parametrize(
    ("source", "target"),
    [
        ("asyncrl.learner.trainer", "asyncrl.staleness.base"),
        ("asyncrl.generators.service", "asyncrl.transport.zmq_io"),
        ("asyncrl.scheduler.service", "asyncrl.tasks.base"),
        ("asyncrl.cli", "asyncrl.scheduler.service"),
        ("asyncrl.transport.codec", "asyncrl.messages"),
        ("asyncrl.config", "asyncrl.learner.policy_losses"),
        ("asyncrl.learner.objective", "asyncrl.learner.policy_losses"),
    ],
)
def test_imports_along_the_layers_are_allowed(source, target):
    assert violation(Import(source, target, "x.py:1")) is None


def test_lazy_and_type_checking_imports_are_seen(tmp_path):
    pkg = tmp_path / "asyncrl" / "monitor"
    pkg.mkdir(parents=True)
    (tmp_path / "asyncrl" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "probe.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from asyncrl.scheduler.service import Launcher\n"
        "def f():\n    from ..learner import trainer\n"
    )
    found = {imp.target for imp in imports_of(pkg / "probe.py", tmp_path / "asyncrl")}
    assert found == {"asyncrl.scheduler.service", "asyncrl.learner"}
