"""Stretch: the one-layer Transformer with a residual connection, up to functional equivalence."""

import json
import textwrap

import numpy as np
import pytest

from attnextract import Oracle
from attnextract.errors import InputError, ModelMismatchError, NotIdentifiableError
from attnextract.models import MODEL_CLASSES, ReLUNetwork
from attnextract.learners.one_layer import random_one_layer
from attnextract.learners.relu_network import align_relu_networks
from attnextract.learners.residual import (ResidualOneLayer, extract_one_layer_residual,
                                  random_residual_one_layer)
from attnextract.report import held_out_sequences

from conftest import run_cli


def test_model_is_the_residual_formula(rng):
    d, m = 5, 4
    W, V = rng.standard_normal((d, d)), rng.standard_normal((d, d))
    A, w = rng.standard_normal((m, d)), rng.standard_normal(m)
    model = ResidualOneLayer.from_value_matrix(W, V, A, w)
    for X in held_out_sequences(d, 8, rng):
        s = X @ W @ X[-1]
        alpha = np.exp(s - s.max()) / np.exp(s - s.max()).sum()
        h = X[-1] + V.T @ (X.T @ alpha)
        assert model(X) == pytest.approx(w @ np.maximum(A @ h, 0.0), rel=1e-12, abs=1e-14)
    # V is determined by B = A V^T only when A has full column rank (m >= d)
    square = ResidualOneLayer.from_value_matrix(W, V, rng.standard_normal((d, d)), np.ones(d))
    assert np.allclose(square.value_matrix(), V, atol=1e-10)
    assert MODEL_CLASSES["one-layer-residual"] is ResidualOneLayer


def aligned_bits(model, truth):
    stack = lambda M: ReLUNetwork(np.hstack([M.A, M.B]), M.w)  # noqa: E731
    return align_relu_networks(stack(model), stack(truth))["bits"]


@pytest.mark.parametrize("dim, width", [(4, 4), (6, 3), (8, 8)])
@pytest.mark.parametrize("seed", range(3))
def test_recovers_residual_models_up_to_functional_equivalence(dim, width, seed):
    truth = random_residual_one_layer(dim, width, seed=50 + seed)
    oracle = Oracle(truth, dim)
    result = extract_one_layer_residual(oracle, seed=seed)
    model = result.model
    assert model.width == width and result.queries == oracle.queries
    assert np.linalg.norm(model.W - truth.W) / np.linalg.norm(truth.W) < 1e-8
    assert aligned_bits(model, truth) > 30
    rng = np.random.default_rng(seed)
    for X in held_out_sequences(dim, 32, rng, 0.7):
        assert model(X) == pytest.approx(truth(X), rel=1e-7, abs=1e-9 * abs(truth.w).max())
    b = result.report.breakdown
    assert sum(b.values()) == result.queries


def test_plain_model_is_the_case_A_zero():
    truth = random_one_layer(6, 5, seed=3)
    result = extract_one_layer_residual(Oracle(truth, 6), seed=1)
    assert np.abs(result.model.A).max() < 1e-9
    assert np.linalg.norm(result.model.W - truth.W) / np.linalg.norm(truth.W) < 1e-9


def test_ffn_biases_and_two_heads_are_mismatches():
    truth = random_residual_one_layer(6, 5, seed=4)
    b = 0.3 * np.ones(5)
    with pytest.raises(ModelMismatchError):
        extract_one_layer_residual(Oracle(lambda X: _residual_with_bias(truth, X, b), 6), seed=0)
    other = random_residual_one_layer(6, 5, seed=5)
    with pytest.raises(ModelMismatchError):
        extract_one_layer_residual(Oracle(lambda X: truth(X) + other(X), 6), seed=0)


def _residual_with_bias(model, X, b):
    s = np.einsum("bnd,bd->bn", X, X[:, -1] @ model.W.T)
    a = np.exp(s - s.max(1, keepdims=True))
    a /= a.sum(1, keepdims=True)
    z = np.einsum("bn,bnd->bd", a, X)
    return np.maximum(X[:, -1] @ model.A.T + z @ model.B.T + b, 0.0) @ model.w


def test_no_attention_path_is_not_identifiable_and_small_d_is_refused():
    truth = random_residual_one_layer(5, 4, seed=6)
    no_attention = ResidualOneLayer(truth.W, truth.A, np.zeros_like(truth.B), truth.w)
    with pytest.raises(NotIdentifiableError):
        extract_one_layer_residual(Oracle(no_attention, 5), seed=0)
    with pytest.raises(InputError):
        extract_one_layer_residual(Oracle(random_residual_one_layer(3, 2, seed=0), 3))


@pytest.mark.slow
def test_cli_kind(tmp_path):
    target = tmp_path / "t.py"
    target.write_text(textwrap.dedent("""
        from attnextract.learners.residual import random_residual_one_layer
        secret = random_residual_one_layer(5, 4, seed=8)
    """))
    out = tmp_path / "r.npz"
    proc = run_cli("extract", "--target", f"{target}:secret", "--dim", "5", "--model",
                   "one-layer-residual", "--out", str(out), "--json", timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["kind"] == "one-layer-residual"
    with np.load(out) as data:
        assert {"W", "A", "B", "w", "queries"} <= set(data.files)
    proc = run_cli("verify", "--target", f"{target}:secret", "--result", str(out), timeout=300)
    assert proc.returncode == 0 and "MATCH" in proc.stdout
