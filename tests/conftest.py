import os

import numpy as np
import pytest

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
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
