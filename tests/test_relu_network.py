"""The bias-free ReLU network model and its learner from single-vector queries."""

import math

import numpy as np
import pytest

from attnextract import Oracle
from attnextract.errors import (BudgetExceededError, InputError, ModelMismatchError,
                                NotIdentifiableError)
from attnextract.models import MODEL_CLASSES, ReLUNetwork
from attnextract.learners.relu_network import (align_relu_networks, canonical_relu, extract_relu_network,
                                      random_relu_network)
from attnextract.report import ExtractionResult, load_model, save_result


# ----------------------------------------------------------------------------- model
def test_model_computes_relu_of_last_token(rng):
    A, w = rng.standard_normal((5, 3)), rng.standard_normal(5)
    net = ReLUNetwork(A, w)
    X = rng.standard_normal((4, 6, 3))
    expected = np.array([w @ np.maximum(A @ X[b, -1], 0.0) for b in range(4)])
    assert np.allclose(net(X), expected, rtol=1e-14, atol=0)
    assert isinstance(net(X[0]), float) and net(X[0]) == pytest.approx(expected[0], rel=1e-14)
    assert net.dim == 3 and net.width == 5 and MODEL_CLASSES["relu-network"] is ReLUNetwork


@pytest.mark.parametrize("A, w", [(np.ones((2, 3)), np.ones(3)), (np.ones(3), np.ones(1)),
                                  (np.full((1, 2), np.nan), np.ones(1)), (np.ones((0, 2)), np.ones(0))])
def test_model_rejects_bad_parameters(A, w):
    with pytest.raises(InputError):
        ReLUNetwork(A, w)


def test_model_round_trips_through_result_file(tmp_path, rng):
    net = random_relu_network(4, 3, seed=1)
    from attnextract.report import Report
    report = Report(kind=net.kind, dim=4, queries=7, breakdown={}, floor=12, verification=None,
                    seconds=0.0, black_box_seconds=0.0)
    save_result(tmp_path / "r.npz", ExtractionResult(net, 7, report))
    back = load_model(tmp_path / "r.npz")
    assert isinstance(back, ReLUNetwork) and np.array_equal(back.A, net.A)
    X = rng.standard_normal((5, 2, 4))
    assert np.array_equal(back(X), net(X))


# ----------------------------------------------------------------------------- alignment
def test_alignment_ignores_permutation_and_positive_scale(rng):
    truth = random_relu_network(6, 5, seed=2)
    perm = rng.permutation(5)
    c = rng.uniform(0.1, 10.0, size=5)
    same = ReLUNetwork(truth.A[perm] * c[:, None], truth.w[perm] / c)
    out = align_relu_networks(same, truth)
    assert out["max_error"] < 1e-14 and out["bits"] > 46
    assert np.array_equal(out["permutation"], perm)


def test_alignment_sees_a_sign_flip_and_a_missing_unit():
    truth = random_relu_network(6, 5, seed=3)
    flipped = ReLUNetwork(truth.A * np.array([-1, 1, 1, 1, 1.0])[:, None], truth.w)
    assert align_relu_networks(flipped, truth)["max_error"] > 0.1
    fewer = ReLUNetwork(truth.A[:4], truth.w[:4])
    out = align_relu_networks(fewer, truth)
    assert out["units"] == (4, 5) and math.isinf(out["max_error"]) and out["bits"] == 0.0


def test_canonical_form_drops_dead_units():
    A, w = canonical_relu(np.array([[3.0, 4.0], [0.0, 0.0], [1.0, 0.0]]), np.array([2.0, 1.0, 0.0]))
    assert np.allclose(A, [[0.6, 0.8]]) and np.allclose(w, [10.0])


# ----------------------------------------------------------------------------- learner
def check_recovered(result, truth, oracle, min_bits):
    m, d = truth.A.shape
    model = result.model
    assert model.width == m                                  # m found by the learner
    assert np.allclose(np.linalg.norm(model.A, axis=1), 1.0, rtol=0, atol=1e-14)
    out = align_relu_networks(model, truth)
    assert out["bits"] >= min_bits, out
    assert result.report.verification.passed
    assert result.queries == oracle.queries == result.report.queries
    b = result.report.breakdown
    assert b["recovery"] + b["verification"] == result.queries
    assert b["recovery"] == b["kink search"] + b["cone gradients"] + b["re-measured"] + b.get("polish", 0)
    assert b["cone gradients"] == (m + 1) * d                # (m + 1) cones, d queries each
    assert result.report.floor == m * d
    return out


@pytest.mark.parametrize("dim, width", [(2, 1), (2, 2), (4, 3), (8, 8), (16, 5), (16, 16)])
@pytest.mark.parametrize("seed", range(4))
def test_recovers_networks_across_widths_and_seeds(dim, width, seed):
    truth = random_relu_network(dim, width, seed=100 * dim + width + seed)
    oracle = Oracle(truth, dim)
    result = extract_relu_network(oracle, seed=seed)
    check_recovered(result, truth, oracle, min_bits=40)
    assert result.report.breakdown["polish"] == width * dim
    # every batch carries many queries: no call per query
    assert oracle.calls <= 60 and oracle.queries >= 5 * oracle.calls


@pytest.mark.parametrize("dim, width", [(3, 6), (6, 12), (8, 13)])
@pytest.mark.parametrize("seed", range(3))
def test_recovers_wider_than_tall_networks_by_a_01_program(dim, width, seed):
    truth = random_relu_network(dim, width, seed=7 * seed + width)
    oracle = Oracle(truth, dim)
    result = extract_relu_network(oracle, seed=seed)
    check_recovered(result, truth, oracle, min_bits=36)
    assert result.report.details["signs"] == "0/1 linear program"
    assert result.report.breakdown["polish"] == 2 * width * dim   # two cones per unit
    quick = extract_relu_network(Oracle(truth, dim), seed=seed, polish=False)
    assert align_relu_networks(quick.model, truth)["bits"] >= 28


@pytest.mark.parametrize("scale_A, scale_w", [(1e3, 1.0), (1e-4, 1.0), (1.0, 1e6), (1.0, 1e-8),
                                              (1e5, 1e-5)])
def test_scale_does_not_matter(scale_A, scale_w):
    base = random_relu_network(8, 6, seed=5)
    truth = ReLUNetwork(scale_A * base.A, scale_w * base.w)
    oracle = Oracle(truth, 8)
    check_recovered(extract_relu_network(oracle, seed=1), truth, oracle, min_bits=40)


def test_units_of_very_different_sizes():
    rng = np.random.default_rng(9)
    A = rng.standard_normal((8, 10)) * 10.0 ** rng.uniform(-3, 3, size=(8, 1))
    w = rng.standard_normal(8) * 10.0 ** rng.uniform(-3, 0, size=8)
    truth = ReLUNetwork(A, w)
    oracle = Oracle(truth, 10)
    check_recovered(extract_relu_network(oracle, seed=2), truth, oracle, min_bits=30)


def test_polish_costs_exactly_m_d_queries_and_buys_precision():
    truth = random_relu_network(12, 12, seed=4)
    fast, slow = Oracle(truth, 12), Oracle(truth, 12)
    quick = extract_relu_network(fast, seed=3, polish=False)
    full = extract_relu_network(slow, seed=3)
    assert full.queries - quick.queries == 12 * 12
    bits_quick = align_relu_networks(quick.model, truth)["bits"]
    bits_full = align_relu_networks(full.model, truth)["bits"]
    assert bits_quick >= 25 and bits_full >= bits_quick + 3


def test_seed_makes_runs_reproducible():
    truth = random_relu_network(6, 4, seed=8)
    a = extract_relu_network(Oracle(truth, 6), seed=11)
    b = extract_relu_network(Oracle(truth, 6), seed=11)
    assert a.queries == b.queries and np.array_equal(a.model.A, b.model.A)


# ----------------------------------------------------------------------------- mismatches
def biased(net, b):
    return lambda X: np.maximum(X[:, -1] @ net.A.T + b, 0.0) @ net.w


@pytest.mark.parametrize("bias", [1.0, 1e-3, 1e-6])
def test_biases_are_a_mismatch_never_a_success(bias):
    net = random_relu_network(8, 6, seed=1)
    b = bias * np.random.default_rng(0).standard_normal(6)
    oracle = Oracle(biased(net, b), 8)
    with pytest.raises(ModelMismatchError, match="homogeneous"):
        extract_relu_network(oracle, seed=0)
    assert oracle.queries < 200                       # caught before the gradients


def test_output_bias_is_a_mismatch():
    net = random_relu_network(6, 4, seed=2)
    with pytest.raises(ModelMismatchError):
        extract_relu_network(Oracle(lambda X: net(X) + 0.5, 6), seed=0)


def test_two_layer_network_is_a_mismatch():
    rng = np.random.default_rng(3)
    A1, A2, w = rng.standard_normal((6, 6)), rng.standard_normal((5, 6)), rng.standard_normal(5)
    deep = lambda X: np.maximum(np.maximum(X[:, -1] @ A1.T, 0) @ A2.T, 0) @ w  # noqa: E731
    with pytest.raises(ModelMismatchError) as info:
        extract_relu_network(Oracle(deep, 6), seed=0)
    assert "not a bias-free ReLU network" in str(info.value)


def test_noisy_black_box_is_a_mismatch():
    net = random_relu_network(6, 4, seed=4)
    noise = np.random.default_rng(5)
    noisy = lambda X: net(X) + 1e-6 * noise.standard_normal(len(X))  # noqa: E731
    with pytest.raises(ModelMismatchError):
        extract_relu_network(Oracle(noisy, 6), seed=0)


def test_max_norm_bounds_the_held_out_vectors_and_nothing_else():
    """A map that is the network only inside a ball (a norm trigger at 100) is a mismatch
    by default; with max_norm inside the ball no held-out vector leaves it and it passes."""
    net = random_relu_network(8, 6, seed=7)
    asked = []

    def inside_ball(X):
        norms = np.linalg.norm(X[:, -1], axis=1)
        asked.append(norms.max())
        return net(X) * np.where(norms > 100.0, 1.0 + 1e-3, 1.0)
    with pytest.raises(ModelMismatchError, match="held-out"):
        extract_relu_network(Oracle(inside_ball, 8), seed=0)
    assert max(asked) > 100.0
    asked.clear()
    result = extract_relu_network(Oracle(inside_ball, 8), seed=0, max_norm=50.0)
    assert result.report.verification.passed and max(asked) <= 50.0 * (1 + 1e-12)
    assert align_relu_networks(result.model, net)["max_error"] <= 1e-9
    for bad in (0.0, -1.0, math.inf, math.nan):
        with pytest.raises(InputError, match="max_norm"):
            extract_relu_network(Oracle(net, 8), seed=0, max_norm=bad)


def test_linear_black_box_is_a_mismatch_and_zero_is_not_identifiable():
    v = np.arange(1.0, 5.0)
    with pytest.raises(ModelMismatchError, match="linear"):
        extract_relu_network(Oracle(lambda X: X[:, -1] @ v, 4), seed=0)
    with pytest.raises(NotIdentifiableError):
        extract_relu_network(Oracle(lambda X: np.zeros(len(X)), 4), seed=0)


def test_width_one_tokens_and_budget_are_refused_cleanly():
    with pytest.raises(InputError):
        extract_relu_network(Oracle(lambda X: X[:, -1, 0], 1))
    truth = random_relu_network(8, 8, seed=6)
    oracle = Oracle(truth, 8, budget=150)
    with pytest.raises(BudgetExceededError):
        extract_relu_network(oracle, seed=0)
    assert oracle.queries <= 150


def test_parallel_and_dead_units_merge_into_the_function_they_compute():
    rng = np.random.default_rng(0)
    A, w = rng.standard_normal((6, 8)), rng.standard_normal(6)
    # unit 7 is unit 1 scaled by 3 (same hyperplane, same side), unit 8 has w = 0
    net = ReLUNetwork(np.vstack([A, 3 * A[0], rng.standard_normal(8)]), np.append(w, [0.7, 0.0]))
    result = extract_relu_network(Oracle(net, 8), seed=1)
    merged = ReLUNetwork(A, w + np.eye(6)[0] * 0.7 * 3)
    assert result.model.width == 6 and align_relu_networks(result.model, merged)["bits"] > 40


def test_antiparallel_units_are_reported_not_guessed():
    # a unit on the same hyperplane as another but active on the other side leaves a
    # linear part that no set of units explains: a documented limitation, a mismatch
    rng = np.random.default_rng(0)
    A, w = rng.standard_normal((6, 8)), rng.standard_normal(6)
    net = ReLUNetwork(np.vstack([A, -2 * A[0]]), np.append(w, 0.5))
    with pytest.raises(ModelMismatchError, match="general position"):
        extract_relu_network(Oracle(net, 8), seed=1)
