"""Transformer layer (attention + ReLU FFN with biases, issue 14): recovery, impostors, files, CLI."""

import json
import math

import numpy as np
import pytest

from attnextract import ModelMismatchError, Oracle, TransformerLayer, extract_transformer_layer, load_model
from attnextract.learners.biased_relu import extract_biased_relu
from attnextract.learners.transformer_layer import (compare_transformer_layer, free_parameters,
                                                    random_transformer_layer)
from attnextract.models import attention_output
from conftest import grid, run_cli

TOL = 1e-8


def extract(truth, seed, **kw):
    oracle = Oracle(truth, truth.dim)
    result = extract_transformer_layer(oracle, seed=seed, **kw)
    assert result.queries == oracle.queries
    return result, compare_transformer_layer(result.model, truth, seed=seed)


def assert_recovered(result, cmp, truth):
    assert cmp["units"] == (truth.width, truth.width)
    assert cmp["error_W"] <= TOL, cmp              # attention canonically equal to the truth
    assert cmp["max_error"] <= TOL, cmp            # every canonical array
    assert cmp["max_output_error"] <= TOL, cmp
    assert result.report.verification.passed
    assert result.report.verification.max_relative_error <= TOL
    # queries against the free-parameter floor of the canonical form
    assert result.report.floor == free_parameters(truth)
    assert result.report.floor < result.queries <= 8 * result.report.floor
    d = truth.dim
    if "method" not in result.report.details:       # the bias-free residual path has its own
        assert result.report.breakdown["copy probes"] >= 2 * d * d + d


# --------------------------------------------------------------------------- every case, small
@pytest.mark.parametrize("case, options", [
    ("bias-free, H = 1", {}),
    ("bias-free, H = 2", {"heads": 2}),
    ("biases N(0,1), c0, H = 1", {"bias_scale": 1.0, "c0": 0.6}),
    ("biases 1e-6, c0, H = 2", {"heads": 2, "bias_scale": 1e-6, "c0": -0.3}),
    ("residual + biases, H = 1", {"bias_scale": 1.0, "c0": 0.2, "residual": True}),
    ("residual + biases, H = 2", {"heads": 2, "bias_scale": 1.0, "c0": 0.2, "residual": True}),
])
@pytest.mark.parametrize("seed", range(2))
def test_each_case_small(case, options, seed):
    """Issue 14's cases at d = 8, m = 12 (the d = 16 / 32 sweeps are slow tests and
    benchmarks/bench_transformer_layer.py): canonically equal to the truth, every array."""
    truth = random_transformer_layer(8, 12, seed=seed, **options)
    result, cmp = extract(truth, seed, heads=options.get("heads", 1))
    assert result.model.heads == truth.heads and result.model.residual == truth.residual
    assert cmp["units"] == (12, 12)
    assert cmp["error_W"] <= TOL and cmp["max_error"] <= TOL, cmp
    assert cmp["max_output_error"] <= TOL, cmp
    assert ("none" in result.report.details["biases b"]) == ("bias_scale" not in options)


# --------------------------------------------------------------------------- (1) bias-free
@pytest.mark.parametrize("width", [16, 32])
@pytest.mark.parametrize("seed", grid(range(20), range(4)))
@pytest.mark.slow
def test_bias_free_single_head(width, seed):
    truth = random_transformer_layer(16, width, seed=seed)
    result, cmp = extract(truth, seed)
    assert_recovered(result, cmp, truth)
    assert result.model.residual is False
    assert np.all(result.model.b == 0.0)          # detected as absent: exactly zero
    assert "none detected" in result.report.details["biases b"]


@pytest.mark.slow
@pytest.mark.parametrize("width", [16, 32])
@pytest.mark.parametrize("heads", [2, 3, 4])
@pytest.mark.parametrize("seed", range(2))
def test_bias_free_multi_head(heads, width, seed):
    """Heads from the odd part through extract_multi_head, then A V_h split per unit."""
    truth = random_transformer_layer(16, width, seed=seed, heads=heads, c0=0.25 * seed)
    result, cmp = extract(truth, seed, heads=heads)
    assert result.model.heads == heads
    assert cmp["units"] == (width, width)
    assert cmp["error_W"] <= TOL and cmp["error_P"] <= TOL, cmp
    assert cmp["max_error"] <= TOL and cmp["max_output_error"] <= TOL, cmp
    assert result.report.verification.passed
    assert result.report.floor == free_parameters(truth) < result.queries


@pytest.mark.slow
@pytest.mark.parametrize("heads", [2, 3])
@pytest.mark.parametrize("seed", range(2))
def test_bias_free_multi_head_residual(heads, seed):
    """Residual term: the odd part minus u^T x_N (u = A^T w) goes to extract_multi_head."""
    truth = random_transformer_layer(16, 16, seed=seed, heads=heads, c0=0.3, residual=True)
    result, cmp = extract(truth, seed, heads=heads)
    assert result.model.residual is True and result.model.heads == heads
    assert cmp["error_W"] <= TOL and cmp["error_A"] <= TOL and cmp["error_P"] <= TOL, cmp
    assert cmp["max_error"] <= TOL and cmp["max_output_error"] <= TOL, cmp


@pytest.mark.parametrize("seed", range(2))
def test_biased_multi_head_residual_small(seed):
    """Biases, the residual term and two heads: u = A^T w from single tokens minus the
    heads' summed readout of [s p; 0], the large-token view minus u^T z_N."""
    truth = random_transformer_layer(8, 12, seed=seed, heads=2, bias_scale=1.0, c0=0.3,
                                     residual=True)
    result, cmp = extract(truth, seed, heads=2)
    assert result.model.residual is True and result.model.heads == 2
    assert cmp["error_W"] <= TOL and cmp["error_A"] <= TOL and cmp["error_P"] <= TOL, cmp
    assert cmp["max_error"] <= TOL and cmp["max_output_error"] <= TOL, cmp
    assert result.report.breakdown["residual readout"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(2))
def test_biased_multi_head_residual(seed):
    truth = random_transformer_layer(16, 32, seed=seed, heads=3, bias_scale=1.0, c0=0.3,
                                     residual=True)
    result, cmp = extract(truth, seed, heads=3)
    assert result.model.residual is True and result.model.heads == 3
    assert cmp["error_W"] <= TOL and cmp["error_A"] <= TOL and cmp["error_P"] <= TOL, cmp
    assert cmp["max_error"] <= TOL and cmp["max_output_error"] <= TOL, cmp


# --------------------------------------------------------------------------- (2) biases, H > 1
@pytest.mark.parametrize("width", [8, 12])
@pytest.mark.parametrize("seed", range(2))
def test_biased_multi_head_small(width, seed):
    """Heads from the large-token odd part (rounded, rough), refined per cell, split per unit."""
    truth = random_transformer_layer(8, width, seed=seed, heads=2, bias_scale=1.0, c0=0.5 - seed)
    result, cmp = extract(truth, seed, heads=2)
    assert result.model.heads == 2 and result.model.residual is False
    assert cmp["units"] == (width, width)
    assert cmp["error_W"] <= TOL and cmp["error_P"] <= TOL, cmp
    assert cmp["max_error"] <= TOL and cmp["max_output_error"] <= TOL, cmp
    assert "detected" in result.report.details["biases b"]
    assert "none" not in result.report.details["biases b"]
    assert abs(result.model.c0 - truth.c0) <= TOL * max(1.0, abs(truth.c0))
    assert result.report.verification.passed
    assert result.report.floor == free_parameters(truth) < result.queries
    # what of V_h is identified (m >= d): V_h = (sum_k V_k)^{-1} V_h,true, sum_h V_h = I
    V = result.model.V
    order = [int(np.argmin([np.abs(W - T).max() for T in truth.W])) for W in result.model.W]
    expected = np.linalg.solve(truth.V.sum(axis=0), truth.V[order].transpose(1, 0, 2).reshape(8, -1))
    assert np.abs(V.sum(axis=0) - np.eye(8)).max() <= 1e-8
    assert np.abs(V.transpose(1, 0, 2).reshape(8, -1) - expected).max() <= 1e-7 * np.abs(expected).max()


@pytest.mark.slow
@pytest.mark.parametrize("bias_scale", [1.0, 1e-6])
@pytest.mark.parametrize("seed", range(2))
def test_biased_multi_head(bias_scale, seed):
    """Issue 14, item 2: H = 3, d = 16, m = 32, biases N(0, 1) and down to 1e-6, and c0."""
    truth = random_transformer_layer(16, 32, seed=seed, heads=3, bias_scale=bias_scale, c0=0.7)
    result, cmp = extract(truth, seed, heads=3)
    assert result.model.heads == 3
    assert cmp["units"] == (32, 32)
    assert cmp["error_W"] <= TOL and cmp["error_P"] <= TOL, cmp
    assert cmp["max_error"] <= TOL and cmp["max_output_error"] <= TOL, cmp
    assert "none" not in result.report.details["biases b"]
    assert result.report.floor == free_parameters(truth) < result.queries <= 10 * result.report.floor


@pytest.mark.slow
def test_biased_four_heads_with_a_loose_rough_stage():
    """H = 4 (seed 0): the rounded view's heads come with an error bar of 6.5e-4, above the
    multi-head learner's float32 default; they only start the refinement, which ends at
    about 1e-11."""
    truth = random_transformer_layer(16, 32, seed=0, heads=4, bias_scale=1.0, c0=0.5)
    result, cmp = extract(truth, 0, heads=4)
    assert result.model.heads == 4
    assert cmp["error_W"] <= TOL and cmp["max_error"] <= TOL, cmp
    assert cmp["max_output_error"] <= TOL, cmp


def test_large_token_view_is_the_bias_free_odd_part():
    """The view's answer is sum_h v_h^T Z^T softmax(Z W_h z_N), v_h = P_h^T w, to float32,
    also for last tokens next to a unit's hyperplane (moved off it and extrapolated)."""
    from attnextract.learners.biased_relu import BiasedReLUNetwork
    from attnextract.learners.transformer_layer import LargeTokenOddOracle
    from attnextract.models import MultiHeadAttention
    truth = random_transformer_layer(8, 12, seed=3, heads=2, bias_scale=1.0, c0=0.4)
    P_h = truth.head_maps()
    P = P_h.sum(axis=0)
    n = np.linalg.norm(P, axis=1)
    net = BiasedReLUNetwork(P / n[:, None], truth.b / n, truth.w * n, truth.c0)
    heads = MultiHeadAttention(truth.W, np.einsum("hmd,m->hd", P_h, truth.w))
    rng = np.random.default_rng(0)
    Z = rng.standard_normal((40, 6, 8))
    Z[:10, -1] -= np.einsum("bd,d->b", Z[:10, -1], net.P[0])[:, None] * net.P[0]  # on unit 0's
    Z[:10, -1] += 1e-7 * net.P[0]                                                  # hyperplane
    oracle = Oracle(truth, 8)
    view = LargeTokenOddOracle(oracle, net)
    g = view.query(Z)
    assert view.moved >= 10
    assert np.abs(g - heads(Z)).max() <= 1e-6 * np.abs(heads(Z)).max()
    assert np.array_equal(g, g.astype(np.float32).astype(np.float64))


# --------------------------------------------------------------------------- (2) biases
@pytest.mark.parametrize("bias_scale", [1.0, 1e-3, 1e-6])
@pytest.mark.parametrize("seed", grid(range(6), range(2)))
@pytest.mark.slow
def test_biases_single_head(bias_scale, seed):
    truth = random_transformer_layer(32, 32, seed=seed, bias_scale=bias_scale, c0=0.7 - 0.4 * seed)
    result, cmp = extract(truth, seed)
    assert_recovered(result, cmp, truth)
    assert "detected" in result.report.details["biases b"]
    assert "none" not in result.report.details["biases b"]
    assert abs(result.model.c0 - truth.c0) <= TOL * max(1.0, abs(truth.c0))


@pytest.mark.parametrize("seed", range(4))
def test_output_bias_only(seed):
    truth = random_transformer_layer(16, 32, seed=seed, c0=-1.5)
    result, cmp = extract(truth, seed)
    assert_recovered(result, cmp, truth)
    assert np.all(result.model.b == 0.0)


# --------------------------------------------------------------------------- (3) residual
@pytest.mark.parametrize("bias_scale", [1.0, 0.0])
@pytest.mark.parametrize("seed", grid(range(6), range(3)))
@pytest.mark.slow
def test_residual(bias_scale, seed):
    truth = random_transformer_layer(16, 32, seed=seed, bias_scale=bias_scale, c0=0.3,
                                     residual=True)
    result, cmp = extract(truth, seed)
    assert result.model.residual is True
    assert cmp["error_A"] <= TOL, cmp              # residual weights identified
    assert_recovered(result, cmp, truth)
    # m >= d and A of full column rank: V itself is the true V
    V = result.model.V[0]
    scale = np.linalg.norm(result.model.A + result.model.A @ V, axis=1)  # unit rows
    assert np.abs(V - truth.V[0]).max() <= 1e-7 * np.abs(truth.V[0]).max()
    assert np.allclose(scale, 1.0)


def test_only_AV_is_identified_without_residual():
    """(A G, G^{-1} V) is the same black box: the learner returns A V with V = I."""
    truth = random_transformer_layer(16, 16, seed=5, bias_scale=0.5)
    G = np.random.default_rng(0).standard_normal((16, 16))
    twin = TransformerLayer(truth.W, np.linalg.solve(G, truth.V[0]), truth.A @ G, truth.b,
                            truth.w, truth.c0)
    X = np.random.default_rng(1).standard_normal((50, 5, 16))
    assert np.abs(twin(X) - truth(X)).max() <= 1e-10 * np.abs(truth(X)).max()
    r1, _ = extract(truth, 3)
    r2, _ = extract(twin, 3)
    assert np.array_equal(r1.model.V[0], np.eye(16)) and np.array_equal(r2.model.V[0], np.eye(16))
    assert np.abs(r1.model.A - r2.model.A).max() <= 1e-9


def test_merged_kinks_are_dropped():
    """A kink where two hyperplanes cross a line measures +-J_i +- J_j: of the dependent
    triple, the unit whose removal lets one affine function explain the samples goes."""
    from attnextract.learners.biased_relu import _Units
    rng = np.random.default_rng(0)
    d, m = 6, 5
    P, b, w = rng.standard_normal((m, d)), rng.standard_normal(m), rng.standard_normal(m)
    F = lambda X: np.maximum(X @ P.T + b, 0.0) @ w                  # noqa: E731
    units = _Units(d)
    for k in range(m):
        units.add(w[k] * P[k], w[k] * b[k], np.sign(w[k]))
    units.add(-(w[1] * P[1] + w[3] * P[3]), -(w[1] * b[1] + w[3] * b[3]), -np.sign(w[1]))
    # exact affine pieces at random points (what the line walk measures)
    X = 3.0 * rng.standard_normal((200, d))
    G = ((X @ P.T + b > 0) * w) @ P
    samples = [(X, G, F(X) - np.einsum("rd,rd->r", G, X))]
    assert units.sum_triple() is not None
    assert units.drop_merged(samples, 1) == 1
    assert len(units.j) == m and np.allclose(units.J, w[:, None] * P)
    assert units.sum_triple() is None
    # a unit found again, less precisely (small |w_i|): the repeat goes
    units.add(w[2] * P[2] * (1 + 1e-5) + 1e-6 * rng.standard_normal(d), w[2] * b[2] * (1 - 2e-5),
              np.sign(w[2]))
    assert units.near_pair() is not None
    assert units.drop_merged(samples, 1) == 1 and len(units.j) == m
    assert np.allclose(units.J, w[:, None] * P, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("seed, d, options", [
    (19, 16, {"bias_scale": 1.0, "residual": True}),     # two hyperplanes cross a line at once
    (11, 32, {"bias_scale": 1e-6}),                      # |w_i| = 0.009: its unit found twice
])
def test_ffn_with_a_merged_kink_or_a_repeat(seed, d, options):
    """Issue 14 items 2 and 3 over 20 seeds: the two seeds whose FFN stage once found one
    unit too many (a merged kink, a repeat) are recovered, nothing refused."""
    truth = random_transformer_layer(d, 32, seed=seed, c0=0.5, **options)
    result, cmp = extract(truth, seed)
    assert cmp["max_error"] <= TOL and cmp["max_output_error"] <= TOL, cmp


# --------------------------------------------------------------------------- biased FFN alone
@pytest.mark.parametrize("seed", range(6))
def test_biased_relu_network(seed):
    rng = np.random.default_rng(seed)
    d, m = 16, 24
    P = rng.standard_normal((m, d)) / 4
    b, w, c0 = 2.0 * rng.standard_normal(m), rng.standard_normal(m), float(rng.standard_normal())
    oracle = Oracle(lambda X: np.maximum(X[:, -1] @ P.T + b, 0) @ w + c0, d)
    net, info = extract_biased_relu(oracle, np.random.default_rng(seed))
    assert info["hidden units"] == m
    n = np.linalg.norm(P, axis=1)
    order = np.argmax(net.P @ (P / n[:, None]).T, axis=1)
    assert sorted(order) == list(range(m))
    assert np.abs(net.P - P[order] / n[order, None]).max() <= 1e-9
    assert np.abs(net.b - b[order] / n[order]).max() <= 1e-9
    assert np.abs(net.w - w[order] * n[order]).max() <= 1e-9 * np.abs(w * n).max()
    assert abs(net.c0 - c0) <= 1e-9


# --------------------------------------------------------------------------- (5) impostors
def _gelu(z):
    from scipy.special import erf
    return 0.5 * z * (1.0 + erf(z / math.sqrt(2.0)))


def impostors(d=16, m=32, seed=0, heads=1, bias_scale=0.5):
    base = random_transformer_layer(d, m, seed=seed, bias_scale=bias_scale, c0=0.2, heads=heads)
    P = base.head_maps()

    def gelu_ffn(X):
        z = sum(attention_output(X, base.W[h]) @ P[h].T for h in range(heads))
        return _gelu(z + base.b) @ base.w + base.c0

    def layer_norm_first(X):
        y = sum(attention_output(X, base.W[h]) @ base.V[h].T for h in range(heads))
        y = (y - y.mean(axis=1, keepdims=True)) / np.sqrt(y.var(axis=1, keepdims=True) + 1e-5)
        return np.maximum(y @ base.A.T + base.b, 0.0) @ base.w + base.c0

    first = random_transformer_layer(d, m, seed=seed + 1, bias_scale=0.5, residual=True)
    out_proj = np.random.default_rng(seed + 2).standard_normal((d, m)) / math.sqrt(m)

    def two_layers(X):
        # layer 1 on every position: residual attention, then a residual ReLU FFN
        B, N, _ = X.shape
        H = np.empty_like(X)
        for i in range(N):
            prefix = X[:, :i + 1]
            y = X[:, i] + attention_output(prefix, first.W[0]) @ first.V[0].T
            H[:, i] = y + np.maximum(y @ first.A.T + first.b, 0.0) @ out_proj.T
        return base(H)

    return {"GELU FFN": gelu_ffn, "LayerNorm before the FFN": layer_norm_first,
            "two stacked layers": two_layers}


@pytest.mark.parametrize("name", ["GELU FFN", "LayerNorm before the FFN", "two stacked layers"])
@pytest.mark.parametrize("seed", range(2))
def test_impostors_refused(name, seed):
    box = impostors(seed=seed)[name]
    oracle = Oracle(box, 16)
    with pytest.raises(ModelMismatchError):
        extract_transformer_layer(oracle, seed=seed)


@pytest.mark.parametrize("name", ["GELU FFN", "LayerNorm before the FFN", "two stacked layers"])
@pytest.mark.parametrize("bias_scale", [0.5, 0.0])
def test_impostors_refused_multi_head(name, bias_scale):
    """The same impostors built on two heads, with and without FFN biases, asked for H = 2."""
    box = impostors(d=8, m=12, seed=1, heads=2, bias_scale=bias_scale)[name]
    oracle = Oracle(box, 8)
    with pytest.raises(ModelMismatchError):
        extract_transformer_layer(oracle, heads=2, seed=1)


@pytest.mark.parametrize("name", ["GELU FFN", "LayerNorm before the FFN", "two stacked layers"])
def test_impostors_refused_bias_free(name):
    box = impostors(seed=3, bias_scale=0.0)[name]
    with pytest.raises(ModelMismatchError):
        extract_transformer_layer(Oracle(box, 16), seed=3)


# --------------------------------------------------------------------------- files and CLI
def test_result_file_round_trip(tmp_path):
    truth = random_transformer_layer(16, 32, seed=2, bias_scale=1.0, c0=0.5, residual=True)
    result, _ = extract(truth, 2)
    path = tmp_path / "layer.npz"
    result.save(path)
    with np.load(path) as data:
        assert {"W", "V", "A", "b", "w", "c0", "residual", "kind"} <= set(data.files)
        assert data["W"].shape == (1, 16, 16) and data["V"].shape == (1, 16, 16)
        assert data["A"].shape == (32, 16) and data["b"].shape == (32,)
        assert bool(data["residual"]) is True
    model = load_model(path)
    X = np.random.default_rng(0).standard_normal((20, 7, 16))
    out = model(X)
    assert out.shape == (20,)
    assert np.abs(out - truth(X)).max() <= 1e-8 * np.abs(truth(X)).max()


@pytest.mark.slow
def test_cli_transformer_layer(tmp_path):
    target = tmp_path / "target.py"
    target.write_text(
        "from attnextract.learners.transformer_layer import random_transformer_layer\n"
        "layer = random_transformer_layer(16, 16, seed=4, bias_scale=1.0, c0=0.25)\n")
    out = tmp_path / "r.npz"
    proc = run_cli("extract", "--target", f"{target}:layer", "--dim", 16, "--model",
                   "transformer-layer", "--heads", 1, "--seed", 1, "--out", out, "--json",
                   check=0, cwd=tmp_path)
    report = json.loads(proc.stdout)
    assert report["ok"] and report["kind"] == "transformer-layer"
    assert report["verification"]["passed"]
    model = load_model(out)
    assert isinstance(model, TransformerLayer) and model.heads == 1
    proc = run_cli("extract", "--target", f"{target}:layer", "--dim", 16, "--model",
                   "transformer-layer", "--rank", 2, "--out", out, check=2, cwd=tmp_path)
    # two heads with FFN biases, through the CLI
    target.write_text(
        "from attnextract.learners.transformer_layer import random_transformer_layer\n"
        "layer = random_transformer_layer(8, 8, seed=2, heads=2, bias_scale=1.0, c0=0.4)\n")
    out2 = tmp_path / "r2.npz"                     # its own journal (another d)
    proc = run_cli("extract", "--target", f"{target}:layer", "--dim", 8, "--model",
                   "transformer-layer", "--heads", 2, "--seed", 2, "--out", out2, "--json",
                   check=0, cwd=tmp_path)
    report = json.loads(proc.stdout)
    assert report["ok"] and report["verification"]["passed"]
    model = load_model(out2)
    assert model.heads == 2 and np.abs(model.b).max() > 0.1


@pytest.mark.slow
def test_bench_section_rows_and_table():
    from attnextract.bench import markdown, section_transformer_layer
    rows = section_transformer_layer(True, lambda message: None)
    assert len(rows) == 7                      # a row per model, H > 1 with biases included
    for r in rows:
        # the biased multi-head row pays four queries per probe of the multi-head learner
        ratio = 12 if "biases" in r["learner"] and r["heads"] > 1 else 8
        assert r["floor"] < r["recovery_queries"] <= ratio * r["floor"]
        assert r["bits"] > 30 and r["output_error"] <= TOL    # Carlini et al. 2020: 25 bits
    table = markdown(rows)
    assert "| (biases 1e-6) |" in table and "2^-25" in table
    assert "| (biases N(0,1), c0, H = 3) | 8 | 8 | 3 |" in table


def test_bad_input_and_budget_are_typed_errors():
    from attnextract import BudgetExceededError, InputError
    truth = random_transformer_layer(8, 8, seed=1, bias_scale=1.0)
    for kwargs in ({"heads": 0}, {"heads": 1.5}, {"scale": -1.0}, {"scale": float("nan")}):
        oracle = Oracle(truth, 8)
        with pytest.raises(InputError):
            extract_transformer_layer(oracle, **kwargs)
        assert oracle.queries == 0
    oracle = Oracle(truth, 8, budget=400)
    with pytest.raises(BudgetExceededError):
        extract_transformer_layer(oracle, seed=0)
    assert oracle.queries <= 400


@pytest.mark.slow
def test_cli_verify_recovered_layer(tmp_path):
    target = tmp_path / "target.py"
    target.write_text(
        "from attnextract.learners.transformer_layer import random_transformer_layer\n"
        "layer = random_transformer_layer(8, 16, seed=6, bias_scale=1.0, residual=True)\n")
    out = tmp_path / "r.npz"
    run_cli("extract", "--target", f"{target}:layer", "--dim", 8, "--model", "transformer-layer",
            "--out", out, check=0, cwd=tmp_path)
    proc = run_cli("verify", "--target", f"{target}:layer", "--result", out, "--json", check=0,
                   cwd=tmp_path)
    assert json.loads(proc.stdout)["ok"]


@pytest.mark.parametrize("seed", [1, 4])
def test_one_unit_active_only_far_out(seed):
    """m = 1 with a large negative bias: the probes go out until the unit is active, and
    saturated copy probes (both weights at rounding level) are not mistaken for logits."""
    truth = random_transformer_layer(8, 1, seed=seed, bias_scale=3.0)
    result, cmp = extract(truth, seed)
    assert cmp["error_W"] <= TOL and cmp["max_error"] <= TOL, cmp
    assert "far verification" in result.report.details
