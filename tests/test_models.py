import numpy as np
import pytest

from attnextract import InputError, SingleHeadAttention
from attnextract.models import softmax
from attnextract.learners.single_head import probe_pair
from attnextract.adapters.targets import random_single_head


def naive_single_head(W, v, X):
    """One sequence, written out token by token: the definition in ALGORITHMS.md, section 1."""
    x_last = X[-1]
    scores = np.array([x @ W @ x_last for x in X])
    alpha = np.exp(scores - scores.max())
    alpha /= alpha.sum()
    return float(sum(a * (x @ v) for a, x in zip(alpha, X)))


def test_batch_matches_naive_definition(rng):
    model = random_single_head(7, seed=1)
    X = rng.standard_normal((20, 5, 7))
    out = model(X)
    assert out.shape == (20,)
    expected = [naive_single_head(model.W, model.v, x) for x in X]
    np.testing.assert_allclose(out, expected, rtol=1e-13, atol=1e-13)
    assert model(X[3]) == pytest.approx(expected[3], rel=1e-13)


def test_softmax_is_stable_for_huge_scores():
    weights = softmax(np.array([[1e300, 1e300 - 1e285, -1e300]]))
    assert np.all(np.isfinite(weights))
    assert weights.sum() == pytest.approx(1.0)


def test_length_one_identity(rng):
    model = random_single_head(6, seed=2)
    x = rng.standard_normal(6)
    assert model(x[None]) == pytest.approx(model.v @ x, rel=1e-14)


@pytest.mark.parametrize("seed", range(5))
def test_length_two_probe_identity(seed):
    """f(P(u, q)) = v^T q + sigma(u^T W q) v^T u (ALGORITHMS.md, section 2)."""
    rng = np.random.default_rng(seed)
    d = 9
    model = random_single_head(d, seed=seed, w_scale=rng.uniform(0.1, 3))
    u, q = rng.standard_normal(d), rng.standard_normal(d)
    sigma = 1.0 / (1.0 + np.exp(-(u @ model.W @ q)))
    expected = model.v @ q + sigma * (model.v @ u)
    assert model(probe_pair(u, q)) == pytest.approx(expected, rel=1e-12, abs=1e-12)


def test_probe_pair_shapes():
    u = np.ones((4, 3))
    q = np.arange(3.0)
    P = probe_pair(u, q)
    assert P.shape == (4, 2, 3)
    np.testing.assert_array_equal(P[:, 1], np.broadcast_to(q, (4, 3)))
    np.testing.assert_array_equal(P[:, 0] - P[:, 1], u)


@pytest.mark.parametrize("W, v", [
    (np.zeros((2, 3)), np.zeros(2)),
    (np.zeros((2, 2)), np.zeros(3)),
    (np.full((2, 2), np.nan), np.zeros(2)),
])
def test_model_rejects_bad_parameters(W, v):
    with pytest.raises(InputError):
        SingleHeadAttention(W, v)


def test_model_rejects_wrong_width():
    with pytest.raises(InputError, match="expected a sequence"):
        random_single_head(4, seed=0)(np.zeros((2, 5)))
