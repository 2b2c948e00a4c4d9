"""Vector answers at the door: the oracle's kinds, typed errors, costs, verification of
every channel and position, result files, and the dispatch to a vector learner."""

import numpy as np
import pytest

import attnextract
from attnextract import Oracle
from attnextract.errors import InputError, MalformedOutputError, NonFiniteOutputError
from attnextract.models import VectorAttention
from attnextract.registry import LEARNERS, register
from attnextract.report import (ExtractionResult, Report, checked_result, load_model,
                                save_result)
from attnextract.verification import verify_model


def layer(seed=0, d=6, m=5, H=2, positions="last", causal=False, scale=0.4):
    rng = np.random.default_rng(seed)
    return VectorAttention(scale * rng.standard_normal((H, d, d)), rng.standard_normal((H, m, d)),
                           rng.standard_normal((H, d)), rng.standard_normal(m),
                           positions=positions, causal=causal)


def probes(seed=1, B=3, N=4, d=6):
    return np.random.default_rng(seed).standard_normal((B, N, d))


def test_model_formula_last_and_every_position():
    model, X = layer(), probes()
    expected = np.zeros((3, 5)) + model.c
    for W, O, b in zip(model.W, model.O, model.b):
        s = np.einsum("bnd,bd->bn", X, X[:, -1] @ W.T + b)
        a = np.exp(s - s.max(1, keepdims=True))
        a /= a.sum(1, keepdims=True)
        expected += np.einsum("bn,bnd->bd", a, X) @ O.T
    assert np.allclose(model(X), expected, rtol=1e-13, atol=1e-13)
    every = VectorAttention(model.W, model.O, model.b, model.c, positions="all")
    causal = VectorAttention(model.W, model.O, model.b, model.c, positions="all", causal=True)
    assert np.allclose(every(X)[:, -1], expected, rtol=1e-13, atol=1e-13)
    for j in range(X.shape[1]):       # causal position j is the last position of the prefix
        assert np.allclose(causal(X)[:, j], model(X[:, :j + 1]), rtol=1e-13, atol=1e-13)
    assert not np.allclose(every(X)[:, 0], causal(X)[:, 0])
    assert model(X[0]).shape == (5,) and every(X[0]).shape == (4, 5)


def test_kind_found_from_the_first_answer_and_counted_in_three_units():
    for positions, shape in (("last", (3, 5)), ("all", (3, 4, 5))):
        box = layer(positions=positions)
        plain = lambda X, box=box: box(X)          # declares nothing
        oracle = Oracle(plain, 6)
        assert oracle.outputs is None
        assert oracle.query(probes()).shape == shape
        assert (oracle.outputs, oracle.out_dim) == (positions, 5)
        assert oracle.queries == 3 and oracle.tokens == 12
        assert oracle.numbers == int(np.prod(shape))
        assert oracle.summary()["numbers"] == oracle.numbers


def test_a_model_declares_its_kind_and_a_scalar_box_stays_scalar():
    assert Oracle(layer(positions="all", causal=True), 6).outputs == "all"
    assert Oracle(layer(positions="all", causal=True), 6).causal is True
    v = np.ones(6)
    scalar = Oracle(lambda X: X[:, -1] @ v, 6)
    assert scalar.query(probes()).shape == (3,) and scalar.outputs == "scalar"
    assert scalar.numbers == 3


def test_per_sequence_vector_boxes():
    box = layer()

    def one(x):
        if x.ndim != 2:
            raise ValueError("one sequence at a time")
        return box(x)

    oracle = Oracle(one, 6)
    assert np.allclose(oracle.query(probes()), box(probes()), rtol=1e-14, atol=1e-14)
    assert oracle.per_sequence and oracle.outputs == "last"
    # a box for one sequence that answers (N, d) @ v on a batch is not a vector box
    v = np.arange(6.0)
    quirky = Oracle(lambda x: x @ v if x.ndim == 3 else float(x[-1] @ v), 6)
    assert quirky.query(probes()).shape == (3,) and quirky.outputs == "scalar"


@pytest.mark.parametrize("make, error, match", [
    (lambda: Oracle(layer(), 6, outputs="scalar"), MalformedOutputError, "expected \\(3,\\)"),
    (lambda: Oracle(lambda X: layer()(X), 6, out_dim=4), MalformedOutputError, "m = 5"),
    (lambda: Oracle(lambda X: layer(positions="all")(X), 6, outputs="last"),
     MalformedOutputError, "at every position"),
    (lambda: Oracle(lambda X: np.full((len(X), 5), np.nan), 6), NonFiniteOutputError,
     "non-finite"),
    (lambda: Oracle(lambda X: np.full((len(X), 5), "0.5"), 6), MalformedOutputError,
     "strings"),
])
def test_bad_vector_answers_are_typed_errors(make, error, match):
    with pytest.raises(error, match=match):
        make().query(probes())


def test_a_shape_that_changes_between_calls_is_refused():
    box = layer()
    widths = iter([5, 4])

    def changing(X):
        return box(X)[:, :next(widths)]

    oracle = Oracle(changing, 6)
    oracle.query(probes())
    with pytest.raises(MalformedOutputError, match="expected \\(3, 5\\)"):
        oracle.query(probes())


def test_oracle_options_are_validated():
    with pytest.raises(InputError, match="outputs must be one of"):
        Oracle(layer(), 6, outputs="vector")
    with pytest.raises(InputError, match="out_dim"):
        Oracle(layer(), 6, out_dim=0)
    with pytest.raises(InputError, match="contradicts"):
        Oracle(layer(), 6, outputs="scalar", out_dim=3)


@pytest.mark.parametrize("positions, causal", [("last", False), ("all", False), ("all", True)])
def test_verification_compares_every_channel_and_position(positions, causal):
    truth = layer(seed=3, positions=positions, causal=causal)
    exact = verify_model(Oracle(truth, 6), truth, count=64, seed=1, max_length=64)
    assert exact.passed and exact.max_relative_error <= 1e-12
    # one channel of one head off by 1e-5 of its size: seen
    O = truth.O.copy()
    O[1, 4] += 1e-5 * np.linalg.norm(O[1, 4])
    off = VectorAttention(truth.W, O, truth.b, truth.c, positions=positions, causal=causal)
    assert not verify_model(Oracle(truth, 6), off, count=64, seed=1, max_length=64).passed
    if positions == "all":      # a box causal when the model is not, or the reverse
        flipped = VectorAttention(truth.W, truth.O, truth.b, truth.c, positions="all",
                                  causal=not causal)
        check = verify_model(Oracle(truth, 6), flipped, count=64, seed=1, max_length=64)
        assert not check.passed and check.max_relative_error > 1e-2


def test_vector_results_save_and_load(tmp_path):
    model = layer(positions="all", causal=True)
    report = Report("vector-attention", 6, 10, {"probes": 10}, 10, None, 0.0, 0.0)
    path = save_result(tmp_path / "r", ExtractionResult(model, 10, report))
    back = load_model(path)
    assert isinstance(back, VectorAttention) and back.causal and back.positions == "all"
    assert all(np.array_equal(getattr(back, k), getattr(model, k)) for k in "WObc")


def _reference_learner(oracle, *, seed=None, verify_tolerance=None):
    """A stand-in vector learner for dispatch tests: reads the truth off a known box."""
    truth = oracle.black_box.truth
    oracle.query(np.zeros((1, 1, oracle.dim)))
    check = verify_model(oracle, truth, count=24, seed=seed)
    report = Report("vector-attention", oracle.dim, oracle.queries, {"zero": 1}, 1, check,
                    0.0, 0.0)
    return checked_result(truth, report, "a vector attention layer")


class _Box:
    def __init__(self, truth):
        self.truth = truth

    def __call__(self, X):
        return self.truth(X)


def test_extract_runs_the_vector_twin_and_counts_the_first_batch(monkeypatch):
    saved = dict(LEARNERS)
    try:
        register("vector-test", _reference_learner, "test", vectors=True)
        monkeypatch.setattr(LEARNERS["single-head"], "with_vectors", "vector-test")
        truth = layer(seed=4)
        stated = attnextract.extract(Oracle(_Box(truth), 6, outputs="last"), model="single-head",
                                     seed=0)
        assert stated.options["model"] == "vector-test"
        assert "answers found to be vectors" not in stated.report.breakdown
        found = attnextract.extract(Oracle(_Box(truth), 6), model="single-head", seed=0)
        assert found.options["model"] == "vector-test"
        spent = found.report.breakdown["answers found to be vectors"]
        assert spent >= 1 and found.queries == stated.queries + spent
        assert found.report.details["numbers received"] == 5 * (found.queries)
        with pytest.raises(InputError, match="reads one number per sequence"):
            attnextract.extract(Oracle(_Box(truth), 6, outputs="last"), model="one-layer")
    finally:
        LEARNERS.clear()
        LEARNERS.update(saved)


def test_empty_batch_before_a_declared_vector_box_answers():
    """A box that declares vector answers but not their width: an empty batch asked
    before its first answer is an empty array (m is not known yet), not a failure."""
    def box(X):
        return np.zeros((len(X), 3))
    box.output_kind = "last"
    oracle = Oracle(box, 2)
    out = oracle.query(np.empty((0, 4, 2)))
    assert out.shape == (0,) and oracle.queries == 0
    assert oracle.query(np.ones((2, 4, 2))).shape == (2, 3)     # then m is known
    assert oracle.query(np.empty((0, 4, 2))).shape == (0, 3)
