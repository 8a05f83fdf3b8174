"""The import layers (README "Layout"): no import cycle inside specmesh/, between its modules or its packages, and
the services stay apart. Every import counts, a function-level (lazy) one too. Reads the source with `ast`; imports
nothing it checks.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SERVICES = ("gateway", "verifier_service", "draft_service")
TOP = ("specmesh", *SERVICES, "kvstore")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for top in TOP for p in sorted((ROOT / top).rglob("*.py"))}


MODULES = _modules()


def _known(name: str) -> str | None:
    """The longest prefix of a dotted name that is one of our modules."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _imports(module: str, path: Path) -> set[str]:
    """Our modules this one imports, anywhere in its body."""
    out: set[str] = set()
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names: Iterable[str] = (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, *([node.module] if node.module else [])])
            names = (f"{base}.{alias.name}" for alias in node.names)
        else:
            continue
        out.update(m for m in map(_known, names) if m and m != module)
    return out


GRAPH = {m: _imports(m, p) for m, p in MODULES.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

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


def _layer(module: str) -> str:
    """specmesh's package a module belongs to (specmesh.engine, specmesh.spec, ...); a top-level module (config) is
    its own."""
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 2 or (ROOT / Path(*parts)).is_dir() else module


def _specmesh_graph() -> dict[str, set[str]]:
    return {m: {d for d in deps if d.startswith("specmesh")} for m, deps in GRAPH.items() if m.startswith("specmesh")}


def test_the_graph_is_read() -> None:
    assert "specmesh.spec.tree" in GRAPH["specmesh.engine.model_runner"]
    assert "specmesh.config_help" in GRAPH["specmesh.config"]           # a function-level import counts


def test_no_module_cycle_in_specmesh() -> None:
    assert _cycles(_specmesh_graph()) == []


def test_no_package_cycle_in_specmesh() -> None:
    packages: dict[str, set[str]] = {}
    for module, deps in _specmesh_graph().items():
        packages.setdefault(_layer(module), set()).update(_layer(d) for d in deps if _layer(d) != _layer(module))
    packages.pop("specmesh", None)         # the root package's __init__ (a version string) imports nothing
    assert _cycles(packages) == []


LAYERS = (("specmesh.config_help",), ("specmesh.config",), ("specmesh.spec", "specmesh.models", "specmesh.telemetry"),
          ("specmesh.engine",), ("specmesh.rpc",), ("specmesh.ops",))
"""specmesh's packages bottom to top (README "Layout"): each imports only from the rows below it."""


def test_layers_point_down() -> None:
    rank = {package: i for i, row in enumerate(LAYERS) for package in row}
    graph = _specmesh_graph()
    assert {_layer(m) for m in graph} - {"specmesh"} == set(rank), "a new specmesh package needs its row in LAYERS"
    wrong = sorted(f"{m} -> {d}" for m, deps in graph.items() for d in deps
                   if _layer(m) != _layer(d) and "specmesh" not in (_layer(m), _layer(d))
                   and rank[_layer(d)] >= rank[_layer(m)])
    assert wrong == []


@pytest.mark.parametrize("importer", [*TOP])
def test_services_stay_apart(importer: str) -> None:
    """A service never imports another; kvstore is the gateway's alone; specmesh imports no service."""
    allowed = {"specmesh", importer} | ({"kvstore"} if importer == "gateway" else set())
    wrong = sorted(f"{m} -> {d}" for m, deps in GRAPH.items() if m.split(".")[0] == importer
                   for d in deps if d.split(".")[0] not in allowed)
    assert wrong == []
