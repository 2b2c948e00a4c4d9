"""benchmarks/check_kernels.py: the numpy SIMD levels it runs really take effect."""

import importlib.util
import os
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "check_kernels.py"


def load():
    spec = importlib.util.spec_from_file_location("check_kernels", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_simd_levels_are_cumulative_from_the_top_and_take_effect():
    kernels = load()
    env = {k: v for k, v in os.environ.items()
           if k not in ("NPY_DISABLE_CPU_FEATURES", "OPENBLAS_CORETYPE")}
    full = kernels.probe(env)
    assert "error" not in full, full
    levels = kernels.simd_levels(env)
    assert len(levels) == len(full["enabled"])          # one level below each feature
    for (name, disabled), k in zip(levels, range(len(full["enabled"]) - 1, -1, -1)):
        assert disabled.split() == full["enabled"][k:]
        seen = kernels.probe({**env, "NPY_DISABLE_CPU_FEATURES": disabled})
        assert "error" not in seen, (name, seen)
        assert seen["enabled"] == full["enabled"][:k], (name, seen)
    if levels:                                   # the last level leaves the baseline only
        assert levels[-1][0].startswith("baseline")


def test_markdown_table_lists_every_configuration():
    kernels = load()
    rows = [{"configuration": "OpenBLAS Zen", "OPENBLAS_CORETYPE": "Zen",
             "NPY_DISABLE_CPU_FEATURES": "", "openblas reports": "Haswell",
             "numpy SIMD enabled": "X86_V3", "passed": False, "summary": "1 failed",
             "failures": ["FAILED tests/x.py::t"], "seconds": 1.0}]
    table = kernels.markdown(rows, ["tests/x.py"], "2.4")
    assert "| OpenBLAS Zen | Zen | - | Haswell | X86_V3 | FAIL |" in table
    assert "FAILED tests/x.py::t" in table


def test_every_test_file_is_classified():
    """A new test file must be put in the kernel check (or said not to be numerical)."""
    kernels = load()
    files = {f"tests/{p.name}" for p in (SCRIPT.parents[1] / "tests").glob("test_*.py")}
    assert not set(kernels.ALL_TESTS) & set(kernels.NOT_NUMERICAL)
    assert files == set(kernels.ALL_TESTS) | set(kernels.NOT_NUMERICAL)
    assert {f for f in files if f.startswith("tests/test_multi_head")} <= set(kernels.DEFAULT_TESTS)
