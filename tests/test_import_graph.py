"""The package's import graph, drawn from its source (ast): no circle, and no import of an
attnextract module inside a function (the way a circle hides). Only the optional
third-party packages are imported lazily, inside the functions that need them."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = "attnextract"
# optional dependencies: imported where used, so that numpy and scipy are all an install needs
OPTIONAL = {"torch", "transformers", "ray", "safetensors", "matplotlib", "cvxpy", "tqdm"}


def module_files(root: Path, package: str = PACKAGE) -> dict[str, tuple[Path, bool]]:
    """Dotted module name -> (file, is a package's __init__) for every module under root."""
    out = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        out[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return out


def _targets(node, module: str, is_package: bool, modules: dict, package: str) -> list[str]:
    """The package's modules an import statement loads by name: ``from pkg import sub``
    names the submodule (not the package's own body), ``from pkg import name`` the package."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        if node.level:
            base = module.split(".") if is_package else module.split(".")[:-1]
            base = base[:len(base) - (node.level - 1)]
            origin = ".".join(base + ([node.module] if node.module else []))
        else:
            origin = node.module or ""
        names = [f"{origin}.{a.name}" if f"{origin}.{a.name}" in modules else origin
                 for a in node.names]
    out = []
    for name in names:
        if name.split(".")[0] != package:
            continue
        while name not in modules and "." in name:   # ``import pkg.mod.attr``: its module
            name = name.rsplit(".", 1)[0]
        out.append(name)
    return out


def _is_type_checking(test) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


class _Imports(ast.NodeVisitor):
    """Module-level imports (the graph's edges, ``if TYPE_CHECKING:`` blocks left out: they
    never run) and imports inside functions, with their line numbers."""

    def __init__(self):
        self.depth, self.top, self.local = 0, [], []

    def visit_FunctionDef(self, node):
        self.depth += 1
        self.generic_visit(node)
        self.depth -= 1

    visit_AsyncFunctionDef = visit_Lambda = visit_FunctionDef

    def visit_If(self, node):
        if _is_type_checking(node.test):
            for child in node.orelse:
                self.visit(child)
        else:
            self.generic_visit(node)

    def visit_Import(self, node):
        (self.local if self.depth else self.top).append(node)

    visit_ImportFrom = visit_Import


def import_graph(root: Path, package: str = PACKAGE):
    """(edges {module: set of modules it imports at load}, function-level imports
    [(module, line, imported)]). A module that needs an optional dependency to load (one
    imported at its top, or through such a module) may be imported inside a function:
    that is the optional dependency's lazy import."""
    modules = module_files(root, package)
    edges, optional, local = {}, set(), []
    for module, (path, is_package) in modules.items():
        found = _Imports()
        found.visit(ast.parse(path.read_text(), filename=str(path)))
        edges[module] = {t for node in found.top
                         for t in _targets(node, module, is_package, modules, package)
                         if t != module}
        if any(name.split(".")[0] in OPTIONAL for node in found.top
               for name in _third_party(node)):
            optional.add(module)
        for node in found.local:
            for name in sorted(set(_targets(node, module, is_package, modules, package))):
                local.append((module, node.lineno, name))
    grown = True
    while grown:                   # a module loading an optional module is optional too
        needs = {m for m, out in edges.items() if out & optional} - optional
        optional |= needs
        grown = bool(needs)
    return edges, [entry for entry in local if entry[2] not in optional]


def _third_party(node) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    return [] if node.level else [node.module or ""]


def cycles(edges: dict) -> list[list[str]]:
    """Every strongly connected component of more than one module (Tarjan), each with a
    circle through it spelled out: [a, b, ..., a]."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
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
                found.append(_circle(edges, set(component)))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def _circle(edges: dict, component: set) -> list[str]:
    """A shortest circle through the component's first module (breadth first)."""
    start = min(component)
    previous, frontier = {start: None}, [start]
    while frontier:
        following = []
        for v in frontier:
            for w in sorted(edges[v] & component):
                if w == start:
                    path = [v]
                    while previous[path[-1]] is not None:
                        path.append(previous[path[-1]])
                    return path[::-1] + [start]
                if w not in previous:
                    previous[w] = v
                    following.append(w)
        frontier = following
    return sorted(component)


def test_no_import_circle():
    edges, _ = import_graph(SRC)
    assert len(edges) > 50 and "attnextract.verification" in edges["attnextract.report"]
    assert cycles(edges) == [], "import circles: " + "; ".join(
        " -> ".join(c) for c in cycles(edges))


def test_no_function_level_import_of_the_package():
    _, local = import_graph(SRC)
    assert local == [], "imports inside functions (move the shared piece down instead): " + \
        ", ".join(f"{m}:{line} imports {name}" for m, line, name in local)


def test_lazy_imports_are_optional_dependencies_only():
    """Third-party packages imported inside functions are the optional ones (or the core:
    numpy, scipy, threadpoolctl); any other would be a dependency the install lacks."""
    core = {"numpy", "scipy", "threadpoolctl"}
    lazy = set()
    for path, _ in module_files(SRC).values():
        found = _Imports()
        found.visit(ast.parse(path.read_text()))
        for node in found.local:
            if isinstance(node, ast.ImportFrom) and node.level:
                continue
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module]
            lazy |= {n.split(".")[0] for n in names}
    third_party = {n for n in lazy - {PACKAGE} if n not in sys.stdlib_module_names}
    assert third_party <= OPTIONAL | core, sorted(third_party - OPTIONAL - core)


def _write(root: Path, files: dict) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


@pytest.mark.parametrize("files, circle", [
    # a -> b -> a through a relative import of a name
    ({"a.py": "from .b import f\n", "b.py": "from .a import g\n"}, ["pkg.a", "pkg.b", "pkg.a"]),
    # a subpackage's module importing a name from its own package's __init__
    ({"sub/__init__.py": "from .x import f\n", "sub/x.py": "from . import y\nfrom ..sub import g\n",
      "sub/y.py": ""}, ["pkg.sub", "pkg.sub.x", "pkg.sub"]),
    # absolute imports count the same
    ({"a.py": "import pkg.b\n", "b.py": "from pkg.c import h\n", "c.py": "from pkg import a\n"},
     ["pkg.a", "pkg.b", "pkg.c", "pkg.a"]),
])
def test_the_check_sees_a_circle(tmp_path, files, circle):
    _write(tmp_path / "pkg", {"__init__.py": "", **files})
    edges, _ = import_graph(tmp_path, "pkg")
    assert cycles(edges) == [circle]


def test_the_check_passes_what_is_no_circle(tmp_path):
    """Submodules taken from their package (``from . import y``), imports only a type
    checker runs, and a chain without a way back are not circles."""
    _write(tmp_path / "pkg", {
        "__init__.py": "from .a import f\n",
        "a.py": "from typing import TYPE_CHECKING\nfrom . import b\nif TYPE_CHECKING:\n"
                "    from .c import C\n",
        "b.py": "import numpy\n", "c.py": "from .a import f\n"})
    edges, local = import_graph(tmp_path, "pkg")
    assert cycles(edges) == [] and local == []
    assert edges["pkg.a"] == {"pkg.b"} and edges["pkg.c"] == {"pkg.a"}


def test_the_check_sees_a_function_level_import(tmp_path):
    """Imports of the package inside functions are found; those of a module that needs an
    optional dependency to load (c: torch at its top; d: through c) are the lazy imports
    allowed, as is the optional dependency's own."""
    _write(tmp_path / "pkg", {
        "__init__.py": "", "a.py": "def f():\n    from .b import g\n    return g\n",
        "b.py": "def g():\n    import torch\n    import pkg.a\n    return 1\n",
        "c.py": "try:\n    import torch\nexcept ImportError:\n    raise\n",
        "d.py": "from .c import torch\n",
        "e.py": "def f():\n    from . import d\n    from .c import torch\n    return d, torch\n"})
    edges, local = import_graph(tmp_path, "pkg")
    assert sorted(local) == [("pkg.a", 2, "pkg.b"), ("pkg.b", 3, "pkg.a")]
    assert edges["pkg.a"] == edges["pkg.b"] == edges["pkg.e"] == set()
    assert edges["pkg.d"] == {"pkg.c"}
