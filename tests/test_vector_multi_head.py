"""Full-rank multi-head attention from vector answers (learner "vector-multi-head").

Every head's O_h is a full-rank m x d matrix, so the heads' output ranges overlap and
only their shared sigmoid steps separate them. The grid (d = 8, 16, 32; H = 1..d/2;
20 seeds; the scalar learner on the same boxes) is benchmarks/bench_vector_multi_head.py.
Assertions are against fixed bounds far from the measured values (canonical errors of
1e-14 to 5e-12 against 1e-10; the learner's own error bar) or exact (head counts,
refusal types), so they hold under every BLAS kernel.
"""

import numpy as np
import pytest
from scipy.special import expit, softmax

from attnextract import Oracle, extract
from attnextract.errors import InputError, ModelMismatchError, RecoveryFailedError
from attnextract.learners.vector_canonical import vector_canonical_errors
from attnextract.learners.vector_multi_head import extract_vector_multi_head
from attnextract.learners.vector_multi_head.labels import (
    label_counts,
    match_weights,
    pair_predictions,
)
from attnextract.learners.vector_multi_head.steps import (
    copy_lambdas,
    projection_jacobian,
    projection_residual,
    scan_counts,
    scan_probes,
    step_matrix,
    step_positions,
)
from attnextract.models import VectorAttention
from attnextract.registry import get_learner

REFUSED = (ModelMismatchError, RecoveryFailedError)


def parameters(seed, d, H, m=None, biases=True):
    rng = np.random.default_rng(1000 + seed)
    m = m or d
    W = rng.standard_normal((H, d, d)) / np.sqrt(d)
    O = rng.standard_normal((H, m, d))
    b = 0.5 * rng.standard_normal((H, d)) if biases else np.zeros((H, d))
    c = rng.standard_normal(m) if biases else np.zeros(m)
    return W, O, b, c


def box(seed, d, H, **kw):
    return VectorAttention(*parameters(seed, d, H, **kw))


def check(result, truth, bound=1e-10):
    errors = vector_canonical_errors(result.model, truth)
    assert errors["heads"][0] == errors["heads"][1]
    assert errors["max"] <= bound, errors
    assert errors["max"] <= result.report.details["error_bar"], errors
    return errors


# ---------------------------------------------------------------------------
# the identity the scans rest on
# ---------------------------------------------------------------------------

def test_copy_scan_identity_and_step_positions():
    """(F - c - O q0) / t = sum_h sigma(lambda + t v^T z_h) O_h v; the positions are the
    zeros of the distance to the scan's row space."""
    d, H = 6, 3
    W, O, b, c = parameters(0, d, H)
    M = VectorAttention(W, O, b, c)
    rng = np.random.default_rng(0)
    q0, v = rng.standard_normal(d) / np.sqrt(d), np.linalg.qr(rng.standard_normal((d, 1)))[0]
    n = scan_counts(8)
    lam, t = copy_lambdas(n), np.array([1.5])
    Y = (M(scan_probes(q0, v, t, n)) - c - O.sum(axis=0) @ q0).T / t[0]     # (m, K)
    p = t[0] * (v[:, 0] @ (np.einsum("hij,j->hi", W, q0) + b).T)
    expected = np.einsum("hk,hmd,d->mk", expit(lam[None, :] + p[:, None]), O, v[:, 0])
    np.testing.assert_allclose(Y, expected, rtol=1e-11, atol=1e-11)
    np.testing.assert_allclose(step_positions(Y, lam, H), np.sort(p), atol=1e-10)


def test_step_fit_jacobian_matches_differences():
    """The closed-form Jacobian of the projected residual (both Golub-Pereyra terms) is
    the derivative: central differences agree to 1e-6 of its size, also at coinciding
    positions (the SVD keeps it finite)."""
    rng = np.random.default_rng(3)
    lam = copy_lambdas(scan_counts(14))
    p = np.sort(rng.uniform(-2.0, 2.0, 5))
    Y = rng.standard_normal((11, 5)) @ step_matrix(lam, p + 0.2) \
        + 1e-2 * rng.standard_normal((11, len(lam)))
    J = projection_jacobian(Y, lam, p)
    e = 1e-5
    numeric = np.stack([(projection_residual(Y, lam, p + e * u)
                         - projection_residual(Y, lam, p - e * u)) / (2 * e)
                        for u in np.eye(5)], axis=1)
    assert np.max(np.abs(J - numeric)) <= 1e-6 * np.max(np.abs(J))
    p[1] = p[0]
    assert np.all(np.isfinite(projection_jacobian(Y, lam, p)))


@pytest.mark.parametrize("seed", range(4))
def test_pairing_read_from_the_weights_of_crowded_steps(seed):
    """Eight steps per direction, several within 0.05 of each other: the mixed probes'
    answers (exact, from the pair predictions of a hidden permutation) give each step's
    weight, and the assignment by those weights is the permutation."""
    rng = np.random.default_rng(seed)
    H, m, L = 8, 16, 1024
    p1 = np.sort(rng.uniform(-1.0, 1.0, H))
    pk = np.sort(np.concatenate([rng.uniform(-1.0, 1.0, H - 2), [0.3, 0.33]]))
    w1, wk = rng.standard_normal((m, H)), rng.standard_normal((m, H))
    perm = rng.permutation(H)                     # step perm[h] of k is head h of 1
    counts = label_counts(H // 2 + 2, L, rng)
    target = np.zeros((H, H))
    target[np.arange(H), perm] = 1.0
    ref, other = (p1, w1, 1.3), (pk, wk, 0.7)
    answers = np.einsum("jmhk,hk->jm", pair_predictions(ref, other, counts), target)
    found, miss = match_weights(ref, other, counts, answers)
    np.testing.assert_array_equal(found, perm)
    assert miss <= 1e-12


# ---------------------------------------------------------------------------
# recovery
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("d,H,seed", [(8, 1, 0), (8, 2, 1), (8, 3, 2), (8, 4, 3), (16, 4, 0),
                                      (16, 4, 5), (16, 2, 7)])
def test_recovers_canonical_heads(d, H, seed):
    truth = box(seed, d, H)
    result = extract_vector_multi_head(Oracle(truth, d), seed=seed)
    check(result, truth)
    report = result.report
    assert report.verification.passed
    assert report.details["heads"] == H
    params = H * (d * d + d * d + d) + d            # W, O (m = d), b; and c
    assert report.details["parameters"] == params and report.floor == -(-params // d)
    assert report.details["numbers received"] == d * result.queries    # m per answer
    assert report.details["tokens sent"] > result.queries


def test_sixteen_four_is_ten_times_below_the_scalar_learner():
    """The scalar learner spends 4,092 recovery queries on this box (measured, heads
    told, biases); vector answers need under a tenth."""
    truth = box(0, 16, 4)
    result = extract_vector_multi_head(Oracle(truth, 16), seed=0)
    check(result, truth)
    assert result.queries <= 409


def test_eight_heads_in_sixteen_channels():
    """H = m / 2 = 8 at d = 16, H not told: eight steps share every scan's window. The
    fits, the count and the pairing must hold where steps crowd (every one of 20 such
    boxes was refused before the scans spread them and paired them by their weights)."""
    truth = box(0, 16, 8)
    result = extract_vector_multi_head(Oracle(truth, 16), seed=0)
    check(result, truth)
    assert result.report.details["heads"] == 8
    assert result.queries <= 1000


@pytest.mark.parametrize("seed", range(2))
def test_without_biases_and_told_heads(seed):
    truth = box(seed, 8, 3, biases=False)
    result = extract_vector_multi_head(Oracle(truth, 8), seed=seed, biases=False, heads=3)
    check(result, truth)
    assert not np.any(result.model.b) and not np.any(result.model.c)
    assert result.report.breakdown["values"] == 8          # no F([0]) without biases


def test_more_outputs_than_width():
    truth = box(4, 6, 3, m=11)
    check(extract_vector_multi_head(Oracle(truth, 6), seed=4), truth)


def test_heads_with_equal_attention_merge():
    """Two heads with the same (W, b) are one canonical head with O_1 + O_2."""
    W, O, b, c = parameters(3, 8, 3)
    W[2], b[2] = W[0], b[0]
    truth = VectorAttention(W, O, b, c)
    result = extract_vector_multi_head(Oracle(truth, 8), seed=3)
    assert result.model.heads == 2
    check(result, truth)


def test_every_position_answers_read_at_the_last():
    truth = VectorAttention(*parameters(2, 8, 2), positions="all")
    result = extract_vector_multi_head(Oracle(truth, 8), seed=2)
    check(result, truth)
    assert result.model.positions == "all"


def test_registered_as_the_vector_twin_of_multi_head():
    entry = get_learner("vector-multi-head")
    assert entry.vectors and get_learner("multi-head").with_vectors == "vector-multi-head"
    truth = box(1, 8, 2)
    result = extract(Oracle(truth, 8), "multi-head", seed=1)
    assert result.options["model"] == "vector-multi-head"
    check(result, truth)


def test_scalar_answers_are_an_input_error():
    truth = box(0, 6, 2)
    with pytest.raises(InputError):
        extract_vector_multi_head(Oracle(lambda X: truth(X)[:, 0], 6, outputs="scalar"))


def test_deterministic_query_count():
    """Same seed, same box: the same queries (no wall clock, no global state)."""
    truth = box(6, 8, 2)
    counts = {extract_vector_multi_head(Oracle(truth, 8), seed=6).queries for _ in range(2)}
    assert len(counts) == 1


# ---------------------------------------------------------------------------
# impostors: refused, never returned
# ---------------------------------------------------------------------------

def impostor(kind, seed, d=8, H=2):
    W, O, b, c = parameters(seed, d, H)

    def answer(X):
        X = np.asarray(X, dtype=float)
        out = np.broadcast_to(c, (len(X), len(c))).copy()
        for Wh, Oh, bh in zip(W, O, b):
            s = np.einsum("bnd,bd->bn", X, X[:, -1] @ Wh.T + bh)
            if kind == "relu":
                a = np.maximum(s, 0.0) / X.shape[1]
            elif kind == "sigmoid":
                a = expit(s) / X.shape[1]
            else:                                   # soft-capped logits
                a = softmax(2.0 * np.tanh(s / 2.0), axis=1)
            out += np.einsum("bn,bnd->bd", a, X) @ Oh.T
        return out
    return answer


@pytest.mark.parametrize("kind", ["relu", "sigmoid", "softcap"])
@pytest.mark.parametrize("seed", range(2))
def test_impostors_refused(kind, seed):
    with pytest.raises(REFUSED):
        extract_vector_multi_head(Oracle(impostor(kind, seed), 8), seed=seed)


@pytest.mark.parametrize("seed", range(2))
def test_extra_head_beyond_the_count_refused(seed):
    with pytest.raises(ModelMismatchError):
        extract_vector_multi_head(Oracle(box(seed, 8, 3), 8), seed=seed, heads=2)


def test_faint_hidden_head_refused_or_recovered():
    """A head 1e-7 as large as the others: found and recovered, or refused; never a
    model without it."""
    W, O, b, c = parameters(0, 8, 3)
    O[2] *= 1e-7
    truth = VectorAttention(W, O, b, c)
    try:
        result = extract_vector_multi_head(Oracle(truth, 8), seed=0)
    except REFUSED:
        return
    assert result.model.heads == 3


# ---------------------------------------------------------------------------
# grids (benchmarks/bench_vector_multi_head.py runs the full ones)
# ---------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("seed", range(20))
def test_sixteen_four_grid(seed):
    truth = box(seed, 16, 4)
    result = extract_vector_multi_head(Oracle(truth, 16), seed=seed)
    check(result, truth)
    assert result.queries <= 520


@pytest.mark.slow
@pytest.mark.parametrize("H", [1, 2, 4])
def test_thirty_two(H):
    truth = box(H, 32, H)
    check(extract_vector_multi_head(Oracle(truth, 32), seed=H), truth)


@pytest.mark.slow
@pytest.mark.parametrize("H,biases", [(1, False), (2, False), (2, True)])
def test_small_layers_of_every_seed(H, biases):
    """d = 8, 40 seeds each: every box recovered within its bar. Two were refused in
    class: a short random query token left the scans' first and largest scales 2.9x
    apart (two close steps could not be spread), and a bar of 3e-6 (true error 4.3e-11,
    cond(O) 4.6e3) was above the largest stated bar. That box's W is off by 4.3e-11 on
    one BLAS kernel and 1.06e-10 on another (its conditioning, not the learner), so the
    bound here is 1e-9 and the box's own bar."""
    for seed in range(40):
        truth = box(seed, 8, H, biases=biases)
        check(extract_vector_multi_head(Oracle(truth, 8), seed=seed, biases=biases), truth,
              bound=1e-9)


@pytest.mark.slow
@pytest.mark.parametrize("H,biases,seed", [(6, True, 0), (6, True, 10), (7, True, 0),
                                           (7, True, 1), (7, False, 11), (8, True, 1),
                                           (8, True, 2), (8, True, 3), (8, False, 0),
                                           (8, False, 5)])
def test_crowded_windows(H, biases, seed):
    """d = 16, H = 6..8 (m / 2 at most): recovered within 1e-10 and the bar (refused
    before: H = 6 box 10 at the pairing, most of H = 7, every one of H = 8)."""
    truth = box(seed, 16, H, biases=biases)
    result = extract_vector_multi_head(Oracle(truth, 16), seed=seed, biases=biases)
    check(result, truth)
    assert result.report.details["heads"] == H
    assert result.queries <= 1000


@pytest.mark.slow
def test_thirty_two_eight_heads():
    truth = box(0, 32, 8)
    result = extract_vector_multi_head(Oracle(truth, 32), seed=0)
    check(result, truth)
    assert result.report.details["heads"] == 8
