import numpy as np
import pytest

from attnextract import (BlackBoxError, BudgetExceededError, InputError, MalformedOutputError,
                         NonFiniteOutputError, Oracle)
from attnextract.adapters.targets import random_single_head


def test_counts_queries_tokens_and_calls():
    oracle = Oracle(random_single_head(3, seed=0), 3, max_batch=4)
    out = oracle.query(np.ones((10, 2, 3)))
    assert out.shape == (10,)
    assert (oracle.queries, oracle.tokens, oracle.calls) == (10, 20, 3)
    oracle.query(np.ones((5, 3)))          # one sequence of length 5
    assert (oracle.queries, oracle.tokens, oracle.calls) == (11, 25, 4)


def test_budget_is_enforced_before_sending():
    calls = []

    def box(X):
        calls.append(len(X))
        return np.zeros(len(X))

    oracle = Oracle(box, 2, budget=5)
    oracle.query(np.ones((3, 1, 2)))
    with pytest.raises(BudgetExceededError) as info:
        oracle.query(np.ones((3, 1, 2)))
    assert info.value.needed == 3 and info.value.remaining == 2
    assert calls == [3] and oracle.queries == 3      # nothing sent past the budget
    oracle.query(np.ones((2, 1, 2)))
    assert oracle.remaining == 0


def test_budget_split_batches_never_half_sent():
    sent = []
    oracle = Oracle(lambda X: sent.append(len(X)) or np.zeros(len(X)), 2, budget=5, max_batch=2)
    with pytest.raises(BudgetExceededError):
        oracle.query(np.ones((6, 1, 2)))
    assert sent == []


def test_plan_checks_budget():
    oracle = Oracle(lambda X: np.zeros(len(X)), 2, budget=10)
    with pytest.raises(BudgetExceededError, match="needs 11 queries"):
        oracle.plan(11, "a test")


@pytest.mark.parametrize("answer, error, match", [
    (lambda X: np.zeros((len(X), 2)), MalformedOutputError, r"shape \(3, 2\)"),
    (lambda X: np.zeros(len(X) + 1), MalformedOutputError, "expected"),
    (lambda X: ["a"] * len(X), MalformedOutputError, "not an array of numbers"),
    (lambda X: None, MalformedOutputError, "shape"),
    (lambda X: np.array([1.0, np.nan, 2.0]), NonFiniteOutputError, "index 1"),
    (lambda X: np.array([np.inf, 0.0, 0.0]), NonFiniteOutputError, "non-finite"),
])
def test_malformed_outputs_are_typed_errors(answer, error, match):
    oracle = Oracle(answer, 2, outputs="scalar")
    with pytest.raises(error, match=match):
        oracle.query(np.ones((3, 1, 2)))


def test_black_box_exceptions_are_wrapped():
    def broken(X):
        raise ConnectionError("server unreachable")

    oracle = Oracle(broken, 2)
    with pytest.raises(BlackBoxError, match="ConnectionError: server unreachable"):
        oracle.query(np.ones((1, 1, 2)))


def test_black_box_cannot_modify_probes():
    """The black box gets a writable copy: what it writes never reaches the learner."""
    seen = []

    def scribbler(X):
        seen.append(X)
        X[:] = 0.0
        return np.ones(len(X))

    oracle = Oracle(scribbler, 2)
    X = np.ones((2, 1, 2))
    assert np.all(oracle.query(X) == 1.0)
    assert np.all(X == 1.0) and seen[0] is not X


def test_torch_as_tensor_takes_the_batch_without_a_warning():
    import warnings

    import torch

    def box(X):
        assert X.flags.writeable        # torch warns once per process: check the cause too
        return torch.as_tensor(X, dtype=torch.float32).sum(dim=(1, 2)).double().numpy()

    with warnings.catch_warnings():
        warnings.simplefilter("error")           # the read-only warning would fail here
        out = Oracle(box, 3).query(np.ones((2, 2, 3)))
    assert np.all(out == 6.0)


@pytest.mark.parametrize("X", [np.ones((2, 1, 3)), np.ones((2, 0, 2)), np.ones(2),
                               np.full((1, 1, 2), np.nan)])
def test_bad_queries_are_rejected(X):
    oracle = Oracle(lambda X: np.zeros(len(X)), 2)
    with pytest.raises(InputError):
        oracle.query(X)
    assert oracle.queries == 0


@pytest.mark.parametrize("kwargs", [{"dim": 0}, {"dim": 2, "budget": -1},
                                    {"dim": 2, "max_batch": 0}, {"dim": 2.5}])
def test_bad_oracle_options(kwargs):
    with pytest.raises(InputError):
        Oracle(lambda X: X, **kwargs)


def test_ragged_queries_come_back_in_order():
    model = random_single_head(3, seed=4)
    oracle = Oracle(model, 3)
    rng = np.random.default_rng(0)
    seqs = [rng.standard_normal((n, 3)) for n in (3, 1, 3, 2, 1)]
    out = oracle.query_ragged(seqs)
    np.testing.assert_allclose(out, [model(s) for s in seqs], rtol=1e-14)
    assert oracle.queries == 5 and oracle.calls == 3


def test_progress_callback_sees_plan():
    seen = []
    oracle = Oracle(lambda X: np.zeros(len(X)), 2, progress=lambda a, b: seen.append((a, b)))
    oracle.plan(4)
    oracle.query(np.ones((3, 1, 2)))
    oracle.query(np.ones((1, 1, 2)))
    assert seen == [(3, 4), (4, 4)]
