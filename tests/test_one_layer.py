"""One-layer Transformer: model, odd-part oracle, end-to-end learner, mismatches, CLI."""

import json
import textwrap

import numpy as np
import pytest

from attnextract import Oracle
from attnextract.errors import BudgetExceededError, ModelMismatchError, NotIdentifiableError
from attnextract.models import MODEL_CLASSES, OneLayerTransformer, SingleHeadAttention, softmax
from attnextract.learners.one_layer import (OddPartOracle, compare_one_layer, extract_one_layer,
                                   random_one_layer)

from conftest import rel_err, run_cli


# ----------------------------------------------------------------------------- model
def test_model_matches_the_formula(rng):
    d, m = 4, 3
    W, A, w = rng.standard_normal((d, d)), rng.standard_normal((m, d)), rng.standard_normal(m)
    model = OneLayerTransformer(W, A, w)
    X = rng.standard_normal((5, 7, d))
    expected = []
    for x in X:
        h = x.T @ softmax(x @ W @ x[-1])
        expected.append(w @ np.maximum(A @ h, 0.0))
    assert np.allclose(model(X), expected, rtol=1e-13, atol=0)
    assert model(X[0][:1]) == pytest.approx(w @ np.maximum(A @ X[0, 0], 0.0), rel=1e-14)
    assert MODEL_CLASSES["one-layer"] is OneLayerTransformer and model.width == m


def test_model_rejects_mismatched_shapes():
    with pytest.raises(ValueError):
        OneLayerTransformer(np.eye(3), np.ones((2, 4)), np.ones(2))
    with pytest.raises(ValueError):
        OneLayerTransformer(np.ones((3, 2)), np.ones((2, 3)), np.ones(2))


def test_odd_part_is_a_single_head_with_v_equal_A_transpose_w(rng):
    model = random_one_layer(5, 4, seed=1)
    head = SingleHeadAttention(model.W, model.A.T @ model.w)
    X = rng.standard_normal((9, 6, 5))
    assert np.allclose(model(X) - model(-X), head(X), rtol=1e-12, atol=1e-14)


# ----------------------------------------------------------------------------- odd-part oracle
def test_odd_part_oracle_counts_two_queries_per_probe_in_one_batch(rng):
    model = random_one_layer(4, 3, seed=2)
    base = Oracle(model, 4)
    odd = OddPartOracle(base)
    X = rng.standard_normal((10, 3, 4))
    g = odd.query(X)
    assert np.allclose(g, model(X) - model(-X), rtol=0, atol=0)
    assert base.queries == 20 and base.calls == 1 and odd.queries == 10
    odd.query_ragged([rng.standard_normal((n, 4)) for n in (1, 2, 2, 5)])
    assert base.queries == 28 and base.calls == 4 and odd.queries == 14


def test_odd_part_oracle_budget_is_the_real_one():
    base = Oracle(random_one_layer(4, 3, seed=2), 4, budget=10)
    odd = OddPartOracle(base)
    with pytest.raises(BudgetExceededError):
        odd.query(np.ones((6, 2, 4)))              # 12 real queries > 10
    assert base.queries == 0


# ----------------------------------------------------------------------------- learner
def check_one_layer(result, truth, oracle):
    d, m = truth.dim, truth.width
    model = result.model
    assert isinstance(model, OneLayerTransformer) and model.width == m
    assert np.allclose(np.linalg.norm(model.A, axis=1), 1.0, rtol=0, atol=1e-14)
    out = compare_one_layer(model, truth, count=64)
    assert out["relative_error_W"] < 1e-9, out
    assert out["max_output_error"] < 1e-8, out
    assert out["bits"] > 35, out
    assert result.report.verification.passed
    assert result.queries == oracle.queries == result.report.queries
    b = result.report.breakdown
    assert b["ffn"] + b["attention"] + b["verification"] == result.queries
    # the attention stage: d^2 + d probes (+ rescaling) plus the head's verification, x2,
    # but for the replays: the head's check re-asks up to 1/8 of its count of the black
    # box itself (one query each), so the stage's count need not be even
    assert b["attention"] >= 2 * (d * d + d)
    assert result.report.floor == d * d + m * d
    return out


@pytest.mark.parametrize("dim, width", [(2, 2), (4, 4), (8, 3), (8, 8), (12, 12)])
@pytest.mark.parametrize("seed", range(3))
def test_recovers_one_layer_transformers(dim, width, seed):
    truth = random_one_layer(dim, width, seed=1000 + 10 * dim + seed)
    oracle = Oracle(truth, dim)
    check_one_layer(extract_one_layer(oracle, seed=seed), truth, oracle)
    assert oracle.calls <= 80


@pytest.mark.parametrize("w_scale, ffn_scale", [(1e-3, 1.0), (3.0, 1.0), (0.3, 1e-4), (0.3, 1e3)])
def test_scales_of_attention_and_ffn(w_scale, ffn_scale):
    truth = random_one_layer(6, 5, seed=7, w_scale=w_scale, ffn_scale=ffn_scale)
    oracle = Oracle(truth, 6)
    check_one_layer(extract_one_layer(oracle, seed=1), truth, oracle)


def test_wider_ffn_than_tokens():
    truth = random_one_layer(5, 9, seed=3)
    oracle = Oracle(truth, 5)
    result = extract_one_layer(oracle, seed=2)
    out = compare_one_layer(result.model, truth, count=64)
    assert out["relative_error_W"] < 1e-9 and out["max_output_error"] < 1e-8 and out["bits"] > 28


def test_compare_is_zero_against_itself_and_sees_a_wrong_W():
    truth = random_one_layer(5, 4, seed=4)
    assert compare_one_layer(truth, truth)["max_output_error"] == 0.0
    off = OneLayerTransformer(truth.W * 1.01, truth.A, truth.w)
    out = compare_one_layer(off, truth)
    assert out["relative_error_W"] == pytest.approx(0.01) and out["max_output_error"] > 1e-5


# ----------------------------------------------------------------------------- mismatches
def with_ffn_bias(model, b):
    return lambda X: np.maximum(model.attend(X) @ model.A.T + b, 0.0) @ model.w


def with_residual(model):
    return lambda X: np.maximum((X[:, -1] + model.attend(X)) @ model.A.T, 0.0) @ model.w


@pytest.mark.parametrize("bias", [0.5, 1e-5])
@pytest.mark.parametrize("seed", range(2))
def test_ffn_biases_are_a_mismatch(bias, seed):
    model = random_one_layer(6, 5, seed=seed)
    b = bias * np.random.default_rng(seed).standard_normal(5)
    with pytest.raises(ModelMismatchError, match="FFN biases"):
        extract_one_layer(Oracle(with_ffn_bias(model, b), 6), seed=seed)


@pytest.mark.parametrize("seed", range(3))
def test_residual_connection_is_a_mismatch(seed):
    model = random_one_layer(6, 5, seed=seed)
    with pytest.raises(ModelMismatchError, match="residual"):
        extract_one_layer(Oracle(with_residual(model), 6), seed=seed)


def test_two_heads_before_the_ffn_is_a_mismatch():
    a, b = random_one_layer(5, 4, seed=1), random_one_layer(5, 4, seed=2)

    def two_heads(X):
        return np.maximum((a.attend(X) + b.attend(X)) @ a.A.T, 0.0) @ a.w
    with pytest.raises(ModelMismatchError):
        extract_one_layer(Oracle(two_heads, 5), seed=0)


def test_A_transpose_w_zero_is_not_identifiable():
    # five units in R^4 with A^T w = 0: the FFN is even, f(X) = f(-X), the odd part is 0
    rng = np.random.default_rng(5)
    A = rng.standard_normal((5, 4))
    w = np.linalg.svd(A.T)[2][-1]                      # the null vector of A^T (4 x 5)
    assert np.linalg.norm(A.T @ w) < 1e-12 and np.all(w != 0)
    model = OneLayerTransformer(rng.standard_normal((4, 4)) / 2, A, w)
    with pytest.raises(NotIdentifiableError, match="A\\^T w = 0"):
        extract_one_layer(Oracle(model, 4), seed=0)


def test_budget_is_checked_before_sending():
    truth = random_one_layer(6, 4, seed=6)
    oracle = Oracle(truth, 6, budget=200)
    with pytest.raises(BudgetExceededError):
        extract_one_layer(oracle, seed=0)
    assert oracle.queries <= 200


# ----------------------------------------------------------------------------- CLI
TARGETS = textwrap.dedent("""
    import numpy as np
    from attnextract.learners.one_layer import random_one_layer

    secret = random_one_layer(5, 4, seed=21)

    def residual(X):
        h = X[:, -1] + secret.attend(X)
        return np.maximum(h @ secret.A.T, 0.0) @ secret.w

    def ffn_only(X):                       # a ReLU network on the last token
        return np.maximum(X[:, -1] @ secret.A.T, 0.0) @ secret.w
""")


def run(*args, check=None):
    return run_cli(*args, check=check)


@pytest.fixture
def target_file(tmp_path):
    path = tmp_path / "targets.py"
    path.write_text(TARGETS)
    return path


@pytest.mark.slow
def test_cli_extracts_one_layer_and_verifies(tmp_path, target_file):
    out = tmp_path / "result.npz"
    proc = run("extract", "--target", f"{target_file}:secret", "--dim", "5", "--model",
               "one-layer", "--seed", "1", "--out", str(out), "--json", check=0)
    report = json.loads(proc.stdout)
    assert report["ok"] and report["kind"] == "one-layer" and report["verification_error"] < 1e-9
    truth = random_one_layer(5, 4, seed=21)
    with np.load(out) as data:
        assert data["W"].shape == (5, 5) and data["A"].shape == (4, 5) and data["w"].shape == (4,)
        assert int(data["queries"]) == report["queries"]
        assert rel_err(data["W"], truth.W) < 1e-9
        assert np.allclose(np.linalg.norm(data["A"], axis=1), 1.0)
    proc = run("verify", "--target", f"{target_file}:secret", "--result", str(out), check=0)
    assert "MATCH" in proc.stdout and "one-layer" in proc.stdout
    proc = run("verify", "--target", f"{target_file}:residual", "--result", str(out), check=1)
    assert "MISMATCH" in proc.stderr


@pytest.mark.slow
def test_cli_residual_is_a_mismatch_with_one_line(tmp_path, target_file):
    out = tmp_path / "r.npz"
    proc = run("extract", "--target", f"{target_file}:residual", "--dim", "5", "--model",
               "one-layer", "--out", str(out), check=1)
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("attnextract: ModelMismatchError") and not out.exists()


@pytest.mark.slow
def test_cli_relu_network_kind_and_no_polish(tmp_path, target_file):
    full, quick = tmp_path / "full.npz", tmp_path / "quick.npz"
    a = json.loads(run("extract", "--target", f"{target_file}:ffn_only", "--dim", "5", "--model",
                       "relu-network", "--seed", "2", "--out", str(full), "--json", check=0).stdout)
    b = json.loads(run("extract", "--target", f"{target_file}:ffn_only", "--dim", "5", "--model",
                       "relu-network", "--seed", "2", "--no-polish", "--out", str(quick),
                       "--json", check=0).stdout)
    assert a["kind"] == "relu-network" and a["queries"] - b["queries"] == 4 * 5
    with np.load(full) as data:
        assert data["A"].shape == (4, 5) and str(data["kind"]) == "relu-network"
    run("verify", "--target", f"{target_file}:ffn_only", "--result", str(full), check=0)
