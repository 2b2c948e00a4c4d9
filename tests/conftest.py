import numpy as np
import pytest


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
