"""The package's layering, read from the source: every import of every jaxpar module (at
module level and inside functions) goes to the same layer or one below, and no chain of
imports comes back to where it started. Also: no module shadows a standard-library name,
and no package attribute hides a submodule of the same name.

The layer order is written here once; docs/reference/layout.md describes each layer.
"""

from __future__ import annotations

import ast
import importlib
import pkgutil
import sys
from pathlib import Path

import pytest

import jaxpar

LAYERS = ("errors", "storage", "data", "sharding", "parallel", "models", "training",
          "adapters", "checkpoint", "hf", "config", "planner", "analysis", "runs", "cli")
"""jaxpar's layers, lowest first: a module may import from its own layer and those before
it. ``jaxpar/__init__.py`` (the public facade) sits above them all."""

ROOT = Path(jaxpar.__file__).parent


def module_names() -> dict[str, Path]:
    """Every jaxpar module's dotted name -> its file."""
    out = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def imports_of(name: str, path: Path, modules: set[str]) -> set[str]:
    """The jaxpar modules ``name`` imports, at any depth of its code. ``from pkg import x``
    counts as importing ``pkg.x`` when that is a module, else ``pkg``."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == "jaxpar")
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against this module's package
                anchor = package.split(".")
                anchor = anchor[:len(anchor) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            if base.split(".")[0] != "jaxpar":
                continue
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.add(sub if sub in modules else base)
    return {m for m in found if m in modules and m != name}


def import_graph() -> dict[str, set[str]]:
    modules = module_names()
    return {name: imports_of(name, path, set(modules)) for name, path in modules.items()}


def layer(module: str) -> int:
    """Index of a module's layer; the facade ``jaxpar`` is above every layer."""
    if module == "jaxpar":
        return len(LAYERS)
    return LAYERS.index(module.split(".")[1])


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """``a -> b`` for each import of a higher layer (or of the facade) by a lower one."""
    return sorted(f"{a} -> {b}" for a, targets in graph.items() for b in targets
                  if a != "jaxpar" and layer(b) > layer(a))


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import cycles of ``graph``: one per strongly connected component of two or more
    modules (Tarjan's algorithm), each listed sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_every_module_is_in_a_layer():
    stray = [m for m in module_names() if m != "jaxpar"
             and m.split(".")[1] not in LAYERS]
    assert not stray, f"modules outside every layer (add the package to LAYERS): {stray}"


def test_no_module_imports_a_higher_layer():
    assert upward_imports(import_graph()) == []


def test_no_import_cycles():
    assert cycles(import_graph()) == []


def test_the_checks_catch_a_reverse_import_and_a_cycle():
    graph = import_graph()
    graph["jaxpar.sharding.plan"] = graph["jaxpar.sharding.plan"] | {"jaxpar.runs.loop"}
    assert upward_imports(graph) == ["jaxpar.sharding.plan -> jaxpar.runs.loop"]
    assert any("jaxpar.sharding.plan" in c for c in cycles(graph))
    graph = {"jaxpar.parallel.a": {"jaxpar.parallel.b"}, "jaxpar.parallel.b": {"jaxpar.parallel.a"}}
    assert cycles(graph) == [["jaxpar.parallel.a", "jaxpar.parallel.b"]]


def test_function_level_imports_are_read(tmp_path):
    source = tmp_path / "mod.py"
    source.write_text("def f():\n    from jaxpar.runs import loop\n    import jaxpar.cli\n")
    modules = {"jaxpar.runs", "jaxpar.runs.loop", "jaxpar.cli", "jaxpar.sharding.mod"}
    assert imports_of("jaxpar.sharding.mod", source, modules) == {"jaxpar.runs.loop",
                                                                   "jaxpar.cli"}


def test_no_module_is_named_after_the_standard_library():
    clash = [m for m in module_names() if m.rpartition(".")[2] in sys.stdlib_module_names]
    assert clash == []


@pytest.mark.parametrize("package", sorted(
    m for m, p in module_names().items() if p.name == "__init__.py"))
def test_no_package_attribute_hides_a_submodule(package):
    pkg = importlib.import_module(package)
    for info in pkgutil.iter_modules(pkg.__path__):
        if info.name == "__main__":
            continue
        sub = importlib.import_module(f"{package}.{info.name}")
        assert getattr(pkg, info.name) is sub, (
            f"{package}.{info.name} names {getattr(pkg, info.name)!r}, not the module")


def test_the_plan_module_and_the_planner_search_have_separate_names():
    import jaxpar.sharding.plan as plan_module

    assert plan_module.Plan is jaxpar.Plan
    assert callable(jaxpar.plan) and jaxpar.plan is jaxpar.planner.plan
