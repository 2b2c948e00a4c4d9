"""The vector-layer learner: a standard attention layer (independent head output ranges)
from vector answers, against canonical truths; impostors refused."""

import numpy as np
import pytest

from attnextract import extract
from attnextract.errors import ModelMismatchError, RecoveryFailedError
from attnextract.learners.vector_canonical import vector_canonical_errors
from attnextract.learners.vector_layer import extract_vector_layer
from attnextract.models import VectorAttention
from attnextract.oracle import Oracle


def standard_layer(seed, d, H, m=None, biases=True, positions="last", causal=False):
    """A random layer as deployed: W_h = K_h^T Q_h / sqrt(r), b_h = K_h^T b_q,h / sqrt(r),
    O_h = W_o,h V_h, c = W_o b_v + b_o, r = d / H."""
    rng = np.random.default_rng(seed)
    m, r = m or d, d // H
    Wq, Wk, Wv = (rng.standard_normal((d, d)) / np.sqrt(d) for _ in range(3))
    Wo = rng.standard_normal((m, d)) / np.sqrt(d)
    bq, bv, bo = (0.5 * rng.standard_normal(n) for n in (d, d, m))
    rows = [slice(h * r, (h + 1) * r) for h in range(H)]
    W = np.stack([Wk[s].T @ Wq[s] / np.sqrt(r) for s in rows])
    b = np.stack([Wk[s].T @ bq[s] / np.sqrt(r) for s in rows]) if biases else None
    O = np.stack([Wo[:, s] @ Wv[s] for s in rows])
    c = Wo @ bv + bo if biases else None
    return VectorAttention(W, O, b, c, positions=positions, causal=causal)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("biases", [True, False])
def test_random_layers_within_1e10(seed, biases):
    box = standard_layer(seed, 16, 4, biases=biases)
    result = extract_vector_layer(Oracle(box, 16), seed=seed)
    errors = vector_canonical_errors(result.model, box)
    assert errors["heads"] == (4, 4)
    assert errors["max"] <= 1e-10, errors
    assert result.report.verification.passed
