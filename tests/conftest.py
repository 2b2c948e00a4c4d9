import numpy as np
import pytest


def rel_err(a, b) -> float:
    """Relative Frobenius error of a against the truth b."""
    return float(np.linalg.norm(np.asarray(a) - np.asarray(b)) / np.linalg.norm(b))


@pytest.fixture
def rng():
    return np.random.default_rng(12345)
