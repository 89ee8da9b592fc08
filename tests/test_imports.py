"""Imports between Parrot's packages point one way: no module of `parrot` or `loadtests`
imports, directly or through others, a module that imports it back, and the parts of `parrot`
import each other only downwards (``LAYERS``).

The graph is read from the source with `ast`, not by importing, so it counts every import: at
module level, inside functions (the lazy imports that hide a cycle from Python) and under
``if TYPE_CHECKING`` (a cycle of types is still two modules that need each other).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("parrot", "loadtests")
# Which parts of parrot each part may import (a part is parrot's first-level module or package).
# Upwards arrows (the tokenizer importing the engine, the engine importing the HTTP server) are
# what make a piece impossible to reuse or test alone.
LAYERS = {
    "parrot": set(),  # the package's __init__: environment set-up only
    "parrot.drafting": set(),  # pure Python over token ids
    "parrot.gguf_file": set(),  # the one GGUF reader: header, metadata, tensors
    "parrot.tokenizer": {"parrot.gguf_file"},
    "parrot.constrain": {"parrot.tokenizer"},
    "parrot.config": {"parrot.drafting"},  # validates drafter names against the registry
    "parrot.engine": {"parrot.config", "parrot.drafting", "parrot.tokenizer", "parrot.constrain", "parrot.gguf_file"},
    "parrot.server": {"parrot.config", "parrot.engine", "parrot.drafting", "parrot.tokenizer", "parrot.constrain"},
    "parrot.cli": {"parrot.config", "parrot.engine", "parrot.server"},
}


def module_files() -> dict[str, Path]:
    """Dotted module name -> file, for every module of the packages (a package is its __init__)."""
    modules: dict[str, Path] = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join(parts)] = path
    return modules


def imported_modules(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The modules of the packages that ``name`` imports, resolved to the most specific module:
    ``from parrot.tokenizer.budget import TokenBudget`` -> parrot.tokenizer.budget, ``from
    parrot.server.routes import tasks`` -> parrot.server.routes.tasks, ``from parrot.tokenizer import
    Tokenizer`` -> parrot.tokenizer."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()

    def add(target: str) -> None:
        while target and target not in modules:
            target = target.rpartition(".")[0]
        if target and target != name:
            found.add(target)

    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                source = ".".join([*base, node.module] if node.module else base)
            else:
                source = node.module or ""
            for alias in node.names:
                add(f"{source}.{alias.name}" if f"{source}.{alias.name}" in modules else source)
    return found


def import_graph() -> dict[str, set[str]]:
    modules = module_files()
    return {name: imported_modules(name, path, modules) for name, path in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (``[a, b, ..., a]``) through each strongly connected group of modules."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[set[str]] = []

    def connect(node: str) -> None:  # Tarjan's algorithm; the graph is small enough to recurse
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in sorted(graph[node]):
            if target not in index:
                connect(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            group = set()
            while True:
                member = stack.pop()
                group.add(member)
                if member == node:
                    break
            if len(group) > 1:
                groups.append(group)

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return [_cycle_in(group, graph) for group in groups]


def _cycle_in(group: set[str], graph: dict[str, set[str]]) -> list[str]:
    """The shortest cycle through the group's first module (breadth-first within the group)."""
    start = min(group)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for target in sorted(graph[node] & group):
                if target == start:
                    return [*paths[node], start]
                if target not in paths:
                    paths[target] = [*paths[node], target]
                    following.append(target)
        frontier = following
    raise AssertionError(f"{sorted(group)} is not strongly connected")


def test_graph_resolves_relative_absolute_and_function_level_imports(tmp_path):
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    files = {
        "pkg/__init__.py": "from pkg.a import A\n",
        "pkg/a.py": "import os\nfrom . import b\nfrom .sub import c\nA = 1\n",
        "pkg/b.py": "def f():\n    from pkg.sub.c import C\n",
        "pkg/sub/__init__.py": "",
        "pkg/sub/c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..a import A\nC = 1\n",
    }
    for relative, text in files.items():
        (tmp_path / relative).write_text(text)
    modules = {"pkg": package / "__init__.py", "pkg.a": package / "a.py", "pkg.b": package / "b.py",
               "pkg.sub": package / "sub" / "__init__.py", "pkg.sub.c": package / "sub" / "c.py"}
    graph = {name: imported_modules(name, path, modules) for name, path in modules.items()}
    assert graph == {"pkg": {"pkg.a"}, "pkg.a": {"pkg.b", "pkg.sub.c"}, "pkg.b": {"pkg.sub.c"},
                     "pkg.sub": set(), "pkg.sub.c": {"pkg.a"}}
    assert cycles(graph) == [["pkg.a", "pkg.sub.c", "pkg.a"]]


def test_no_import_cycles_in_parrot_and_loadtests():
    graph = import_graph()
    assert "parrot.server.app" in graph and "parrot.tokenizer.budget" in graph and "loadtests.peers" in graph  # found them all
    found = cycles(graph)
    assert not found, "import cycles:\n" + "\n".join(" -> ".join(cycle) for cycle in found)


def part(module: str) -> str | None:
    """parrot's first-level part a module belongs to (None outside parrot)."""
    parts = module.split(".")
    return None if parts[0] != "parrot" else ".".join(parts[:2])


def test_parts_of_parrot_import_only_downwards():
    graph = import_graph()
    assert set(LAYERS) == {part(m) for m in graph if part(m)}, "a new part of parrot needs its row in LAYERS"
    upwards = sorted(f"{source} -> {target}" for source, targets in graph.items() if part(source)
                     for target in targets if part(target) != part(source) and part(target) not in LAYERS[part(source)])
    assert not upwards, "imports against the layering:\n" + "\n".join(upwards)
