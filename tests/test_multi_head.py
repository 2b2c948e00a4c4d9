"""Multi-head attention: the model, twins, canonical form, and both learners.

The full grid (H <= 8, d in {8, 16, 32}, 20 seeds each) is benchmarks/bench_multi_head.py;
here a few seeds per cell at d = 8 and 16 (the larger ones marked slow). Every assertion
on the copy-probe learner is either exact (query counts, head counts) or against the
learner's own error bar, so it holds under every BLAS kernel (benchmarks/check_kernels.py).
"""

import json
import re
import textwrap

import numpy as np
import pytest

from attnextract import Oracle
from attnextract.errors import InputError, ModelMismatchError
from attnextract.models import MODEL_CLASSES, MultiHeadAttention, SingleHeadAttention
from attnextract.errors import NotIdentifiableError, RecoveryFailedError
from attnextract.learners.multi_head import (canonical_error, canonical_form, extract_multi_head,
                                             match_heads, non_identifiable_twin, output_precision,
                                             twin_difference)
from attnextract.learners.multi_head import design
from attnextract.learners.multi_head.design import (LENGTH_CLASSES, RARE_COPIES, copy_counts,
                                                    probe_lengths, realised_lambda,
                                                    window_length)
from attnextract.oracle import RoundedOutputs
from attnextract.report import load_model
from attnextract.adapters.targets import hostile_multi_heads, random_multi_head

from conftest import run_cli


def paper2_count(H, d):
    return 4 * H * d * d - 2 * H + 1


# ---------------------------------------------------------------------------
# the model and the identity
# ---------------------------------------------------------------------------

def test_model_is_sum_of_single_heads_and_registered(rng):
    M = random_multi_head(3, 5, seed=1)
    X = rng.standard_normal((7, 4, 5))
    parts = sum(SingleHeadAttention(W, v)(X) for W, v in zip(M.W, M.v))
    np.testing.assert_allclose(M(X), parts, rtol=1e-13, atol=1e-13)
    assert isinstance(M(X[0]), float)
    assert MODEL_CLASSES["multi-head"] is MultiHeadAttention
    assert MultiHeadAttention(np.zeros((0, 5, 5)), np.zeros((0, 5)))(X).tolist() == [0.0] * 7
    with pytest.raises(InputError):
        MultiHeadAttention(np.zeros((2, 3, 3)), np.zeros((3, 3)))
    with pytest.raises(InputError):
        MultiHeadAttention(np.zeros((3, 3)), np.zeros((3,)))


@pytest.mark.parametrize("seed", range(5))
def test_copy_probe_identity(seed):
    """f(m copies of q + u, then N - m of q) = v^T q + sum_h c_h sigma(t_h + ln(m / (N - m)))."""
    rng = np.random.default_rng(seed)
    H, d, N = 3, 6, 40
    M = random_multi_head(H, d, seed=seed, w_scale=0.7)
    u, q = rng.standard_normal(d), rng.standard_normal(d)
    t = np.einsum("i,hij,j->h", u, M.W, q)
    c = M.v @ u
    for m in (1, 3, 20, 39):
        X = np.array([q + u] * m + [q] * (N - m))
        lam = float(realised_lambda(np.array([m]), N)[0])
        predicted = M.v.sum(0) @ q + np.sum(c / (1 + np.exp(-(t + lam))))
        assert abs(M(X) - predicted) <= 1e-12 * (1 + abs(predicted))


def test_copy_counts_realise_the_nearest_lambda():
    N = 256
    lam = np.linspace(-5, 5, 41)
    m = copy_counts(lam, N)
    assert m.min() >= 1 and m.max() <= N - 1
    got = realised_lambda(m, N)
    # the realisable lambdas are ln(m / (N - m)): nearest within half a step
    step = np.abs(realised_lambda(m + 1, N) - got)
    assert np.all(np.abs(got - lam) <= step)
    assert copy_counts(np.array([-50.0, 50.0]), N).tolist() == [1, N - 1]


@pytest.mark.parametrize("window", [128, 512, 2048, 8192, 32768, 3000])
def test_probes_are_as_long_as_their_lambda_needs(window):
    """Each copy probe is window / 2^k tokens (k < LENGTH_CLASSES), the shortest such that
    the rarer token keeps RARE_COPIES copies; the window only near its edge."""
    lam = np.linspace(-np.log(window - 1), np.log(window - 1), 2001)
    N = probe_lengths(lam, window)
    classes = [window // 2 ** k for k in range(LENGTH_CLASSES)]
    assert set(N.tolist()) <= set(classes) and N.max() == window
    assert np.array_equal(N, probe_lengths(-lam, window))                 # symmetric
    assert np.all(np.diff(N[lam >= 0]) >= 0)                               # grows with |lambda|
    m = copy_counts(lam, N)
    rare = np.minimum(m, N - m)
    short = N < window
    assert np.all(rare[short] >= RARE_COPIES)
    # ... and half of it would not leave them (unless the classes stop it)
    halved = N > classes[-1]
    need = RARE_COPIES * (1 + np.exp(np.abs(lam)))
    assert np.all(need[halved] > N[halved] / 2)
    # the realised lambda is exact for its counts and near the designed one
    got = realised_lambda(m, N)
    assert np.allclose(np.log(m / (N - m)), got, rtol=0, atol=1e-12)
    assert np.all(np.abs(got[short] - lam[short]) <= 1.0 / RARE_COPIES)
    # the cost is in the long probes: steps spread over the window's lambdas take a
    # fraction of the window's tokens
    assert N.mean() <= 0.75 * window


def test_probes_of_several_lengths_answer_as_built_one_by_one():
    """design.measure sends one batch per length (in rising order) and returns the
    answers in the probes' order, each the box's answer to its own sequence."""
    rng = np.random.default_rng(3)
    d, P = 4, 30
    M = random_multi_head(2, d, seed=3)
    calls = []
    box = lambda X: (calls.append(X.shape[:2]), M(X))[1]
    u, q = rng.standard_normal((P, d)), rng.standard_normal((P, d))
    lengths = rng.choice([16, 64, 256], size=P)
    m = rng.integers(1, 16, size=P)
    g = design.measure(Oracle(box, d), M.v.sum(0), u, q, m, lengths)
    assert [n for _, n in calls] == [16, 64, 256]
    assert sum(b for b, _ in calls) == P
    for p in range(P):
        X = np.array([q[p] + u[p]] * m[p] + [q[p]] * (lengths[p] - m[p]))
        expected = M(X) - q[p] @ M.v.sum(0)
        assert abs(g[p] - expected) <= 1e-12 * (1 + abs(expected))


# ---------------------------------------------------------------------------
# canonical form and twins
# ---------------------------------------------------------------------------

def test_canonical_form_merges_equal_W_and_drops_dead_heads():
    rng = np.random.default_rng(0)
    W = rng.standard_normal((4, 3, 3))
    v = rng.standard_normal((4, 3))
    W[2] = W[0]                     # merges with head 0
    v[3] = 0.0                      # dead
    canon = canonical_form(MultiHeadAttention(W, v))
    assert canon.heads == 2
    np.testing.assert_allclose(canon.v[0], v[0] + v[2])
    np.testing.assert_allclose(canon.W[1], W[1])
    # heads that cancel (equal W, opposite v) vanish
    assert canonical_form(MultiHeadAttention(W[[0, 0]], np.stack([v[0], -v[0]]))).heads == 0


@pytest.mark.parametrize("seed", range(10))
def test_twin_differs_in_parameters_but_not_in_outputs(seed):
    M = random_multi_head(1 + seed % 4, 4 + seed % 3, seed=seed)
    twin = non_identifiable_twin(M, seed=seed + 100)
    assert twin.heads == M.heads + 2
    # no permutation of the twin's heads equals the original parameter set
    assert twin.heads != M.heads or not np.allclose(twin.v, M.v)
    gap = np.linalg.norm(twin.v[:, None] - M.v[None], axis=2).min(axis=1).max()
    assert gap > 0.1
    diff = twin_difference(M, twin, count=300, seed=seed)
    assert diff["max_relative"] < 1e-12
    assert canonical_error(twin, M) < 1e-12
    # the checker does see a real difference
    other = random_multi_head(M.heads, M.dim, seed=seed + 1)
    assert twin_difference(M, other, count=100, seed=seed)["max_relative"] > 1e-3


def test_match_heads_reports_permutation_and_errors():
    M = random_multi_head(3, 4, seed=2)
    P = MultiHeadAttention(M.W[[2, 0, 1]], M.v[[2, 0, 1]] * (1 + 1e-6))
    order, w_err, v_err = match_heads(P, M)
    assert order.tolist() == [1, 2, 0]
    assert w_err == 0.0 and 5e-7 < v_err < 2e-6
    assert match_heads(MultiHeadAttention(M.W[:2], M.v[:2]), M)[1] == np.inf


@pytest.mark.slow
def test_twins_command_line():
    proc = run_cli("twins", "--heads", "3", "--dim", "5", "--seed", "4", "--json", timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["twin_heads"] == 5 and out["twin_canonical_heads"] == 3
    assert out["max_relative_output_difference"] < 1e-12
    assert out["largest_v_mismatch"] > 0.1
    text = run_cli("twins", "--seed", "1", timeout=120).stdout
    assert "no black-box query can tell them apart" in text


# ---------------------------------------------------------------------------
# copy probes at designed steps (issue 12)
# ---------------------------------------------------------------------------

def check_extraction(M, seed, heads=None, tol=1e-10, **options):
    """Extract M; the canonical heads, within the learner's own error bar and ``tol``."""
    d = M.dim
    oracle = Oracle(M, d)
    result = extract_multi_head(oracle, heads=heads, seed=seed, **options)
    truth = canonical_form(M)
    details = result.report.details
    error = canonical_error(result.model, truth)
    assert result.model.heads == truth.heads
    assert error <= details["error bar"] and error <= tol, (error, details["error bar"])
    assert result.queries == oracle.queries
    recovery = result.report.breakdown["recovery"]
    H = max(truth.heads, 1)
    asked = heads or min(d, 12)            # the learner's H: the count it can plan for
    assert recovery <= paper2_count(asked, d), (recovery, paper2_count(asked, d))
    assert details["multi-head paper's count"] == paper2_count(H, d)
    assert details["floor H(d^2 + d)"] == H * (d * d + d)
    assert result.report.verification.passed
    return result


@pytest.mark.parametrize("H,d,seeds", [(1, 8, 4), (2, 8, 4), (3, 8, 3), (4, 8, 2), (2, 16, 2)])
@pytest.mark.slow
def test_generic_heads_recovered_within_paper2_count(H, d, seeds):
    for seed in range(seeds):
        check_extraction(random_multi_head(H, d, seed=1000 * H + 10 * d + seed), seed, heads=H)


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.slow
def test_seed_sweep_three_heads_both_scales(seed):
    """Entries N(0, 1/d) and N(0, 9/d), one seed each per scale."""
    w_scale = (1.0 if seed % 2 == 0 else 3.0) / np.sqrt(8)
    M = random_multi_head(3, 8, seed=500 + seed, w_scale=w_scale)
    check_extraction(M, seed, heads=3)


@pytest.mark.slow
@pytest.mark.parametrize("H,d,seed", [(5, 8, 0), (6, 8, 0), (6, 8, 1), (6, 8, 2), (4, 16, 0),
                                      (4, 16, 1)])
def test_many_heads(H, d, seed):
    """The peer's case (d = 8, 6 heads) and four heads at d = 16."""
    result = check_extraction(random_multi_head(H, d, seed=1000 * H + 10 * d + seed), seed,
                              heads=H)
    assert result.report.details["smallest head separation"] > 0


# Four heads: the previous learner failed seed 3 of this set on AMD (Zen) and Haswell
# kernels. The assertions here are exact or against the learner's own error bar, so no
# kernel's rounding decides them. (Four heads at d = 4, H = d, are refused: with no
# freedom left in the designed rows some heights vanish.)
@pytest.mark.parametrize("seed", [0, 2, 3])
@pytest.mark.slow
def test_previously_failing_four_head_seeds(seed):
    result = check_extraction(random_multi_head(4, 8, seed=10_000 * 4 + 100 * 4 + seed), seed,
                              heads=4)
    assert result.report.breakdown["recovery"] <= paper2_count(4, 8)


def test_query_counts_are_exact_per_stage():
    d, H = 8, 3
    result = extract_multi_head(Oracle(random_multi_head(H, d, seed=7), d), heads=H, seed=0)
    b = result.report.breakdown
    s0 = 4 * H + 8                                   # base scan samples
    assert b["v tokens"] == d
    assert b["main rows"] == d * (2 * H + 1)         # steps, midpoints and both ends
    assert b["main columns"] == d * d * (H + 1)      # d columns a row, H steps + a spare
    assert b["base perturbations"] == (d - 1) * (2 * H + 3)   # a uniform grid
    assert b["base scale"] % s0 == 0 and b["base rows"] % s0 == 0
    # a crowded base row: H + 1 random columns and one to three designed ones, 3H + 1 each
    columns = b.get("base columns", 0)
    assert columns == 0 or (columns % (3 * H + 1) == 0
                            and H + 2 <= columns // (3 * H + 1) <= H + 4)
    assert b["recovery"] == sum(v for k, v in b.items() if k not in ("recovery", "verification"))
    assert b["verification"] == max(64, H * (d * d + d) // 100)


@pytest.mark.parametrize("seed", range(3))
def test_one_head_stays_within_paper2_count(seed):
    """One head at d = 8: paper 2's count 4d^2 - 1 = 255 holds the floor 72 and the 64
    held-out queries, so the whole run must fit in it (with a spare midpoint in every
    column probe the smallest one-head design needed 295). The column probes sample the
    step alone, d^2 of them; the rest of the count goes to wide columns."""
    d = 8
    M = random_multi_head(1, d, seed=10_000 + 100 * d + seed,
                          w_scale=(1 + 2 * (seed % 2)) / np.sqrt(d))
    result = check_extraction(M, seed, heads=1)
    b = result.report.breakdown
    assert result.queries <= paper2_count(1, d), result.queries
    assert b["main rows"] == 3 * d and b["main columns"] == d * d
    assert b["verification"] == 64


@pytest.mark.parametrize("d", [6, 7])
def test_one_head_below_d8_takes_the_single_head_identities(d):
    """At d = 6 and 7 the smallest one-head design (185, 207) exceeds paper 2's count (143,
    195) while the floor plus the verification fit it: a run told H = 1 on float64
    answers takes the d^2 two-token probes of the single-head identities, exactly
    d + d^2 + 64 queries, within its bar; a two-head box told H = 1 is refused."""
    for seed in range(3):
        M = random_multi_head(1, d, seed=10_000 + 100 * d + seed, w_scale=1 / np.sqrt(d))
        result = check_extraction(M, seed, heads=1)
        assert result.queries == d * d + d + 64 <= paper2_count(1, d)
        assert result.report.breakdown["two-token probes"] == d * d
    with pytest.raises(ModelMismatchError):
        extract_multi_head(Oracle(random_multi_head(2, d, seed=0), d), heads=1, seed=0)
    # not told: after a search that found one head the identities replace the design,
    # within the count at d = 7; at d = 6 the search leaves too little and the note says so
    M = random_multi_head(1, d, seed=10_000 + 100 * d, w_scale=1 / np.sqrt(d))
    free = check_extraction(M, 0)
    assert free.report.breakdown["two-token probes"] == d * d
    if d == 7:
        assert free.queries <= paper2_count(1, d)
    else:
        assert free.queries > paper2_count(1, d)
        assert "the head count search" in free.report.notes[-1]


def test_float32_one_head_within_its_bar_and_the_count():
    """A float32 one-head layer (as nn.MultiheadAttention(8, 1) computes it): within its
    error bar and paper 2's count; its hull check holds to float32 rounding (a model
    within its bar was refused as "a second head" by the float64 hull tolerance)."""
    from attnextract.adapters.targets import Float32MultiHeadBlackBox
    d = 8
    box = Float32MultiHeadBlackBox(1, d, seed=3)
    oracle = Oracle(box, d)
    result = extract_multi_head(oracle, heads=1, seed=3)
    error = canonical_error(result.model, box.truth)
    assert result.report.details["output precision"] == "float32"
    assert error <= result.report.details["error bar"] <= 1e-3
    assert oracle.queries <= paper2_count(1, d)


def test_probes_are_batched(monkeypatch):
    """Every round of copy probes is one design.measure: one call to the box per probe
    length in it (at most LENGTH_CLASSES, rising), and the rounds are few and large."""
    d, H = 8, 2
    oracle = Oracle(random_multi_head(H, d, seed=6), d)
    rounds, sent = [], design.measure

    def measure(view, v, u, q, m, length):
        calls = oracle.calls
        out = sent(view, v, u, q, m, length)
        rounds.append((oracle.calls - calls, np.unique(length).size, len(m)))
        return out

    monkeypatch.setattr(design, "measure", measure)
    result = extract_multi_head(oracle, heads=H, seed=0)
    assert all(calls == lengths <= LENGTH_CLASSES for calls, lengths, _ in rounds)
    assert len(rounds) <= 40 and result.queries > 10 * len(rounds)
    b = result.report.breakdown
    assert sum(p for _, _, p in rounds) == b["recovery"] - b["v tokens"]


def test_report_states_conditioning_and_counts():
    d, H = 8, 2
    result = extract_multi_head(Oracle(random_multi_head(H, d, seed=8), d), heads=H, seed=1)
    det = result.report.details
    for key in ("predicted relative error", "error bar", "held-out error",
                "smallest head separation", "row fit condition (max)", "multi-head paper's count",
                "floor H(d^2 + d)", "recovery / floor"):
        assert key in det
    assert det["error bar"] == pytest.approx(4 * det["predicted relative error"])
    assert det["recovery / floor"] == result.report.breakdown["recovery"] / (H * (d * d + d))
    assert "error bar" in result.report.render()


@pytest.mark.parametrize("H", [2, 3])
@pytest.mark.parametrize("name", ["merged heads (W_1 = W_0)", "dead head (v = 0)",
                                  "heads sharing v", "non-orthogonal heads (correlated W, v)",
                                  "one head 10x larger W", "v = sum of v_h = 0"])
@pytest.mark.slow
def test_hostile_heads(H, name):
    """Adversarial targets: recovered within the bar, or refused; never a wrong model."""
    for seed in range(2):
        M = hostile_multi_heads(H, 6, seed=seed)[name]
        try:
            result = check_extraction(M, seed, heads=H, tol=1e-8)
        except RecoveryFailedError:
            assert name in ("one head 10x larger W",)
            continue
        if name in ("merged heads (W_1 = W_0)", "dead head (v = 0)"):
            assert result.model.heads == H - 1      # canonical merge / drop


@pytest.mark.parametrize("factor", [1e-2, 1e-3])
def test_tiny_head_is_recovered_within_its_bar_or_refused(factor):
    """A head with v_h 100-1000x smaller than the others: its steps are that much lower."""
    M = random_multi_head(3, 8, seed=11)
    M.v[2] *= factor
    try:
        check_extraction(M, seed=0, heads=3, tol=1e-6)
    except (ModelMismatchError, RecoveryFailedError) as exc:
        assert "times the" in str(exc) or "error bar" in str(exc)   # says what misfit


def test_saturating_heads_recovered_or_refused():
    """W entries N(0, 100/d): the design scales the probes down, the steps stay in the window."""
    M = random_multi_head(2, 8, seed=12, w_scale=10 / np.sqrt(8))
    check_extraction(M, seed=0, heads=2)


@pytest.mark.slow
def test_upper_bound_and_exact_head_count():
    M = random_multi_head(2, 6, seed=3)
    for heads in (2, 3):
        check_extraction(M, seed=1, heads=heads)
    merged = hostile_multi_heads(3, 6, seed=1)["merged heads (W_1 = W_0)"]
    assert check_extraction(merged, seed=2, heads=3).model.heads == 2


def test_two_head_box_asked_as_one_head_is_refused():
    M = random_multi_head(2, 6, seed=4)
    with pytest.raises(ModelMismatchError):
        extract_multi_head(Oracle(M, 6), heads=1, seed=0)


def test_head_plus_mlp_is_refused():
    M = random_multi_head(1, 6, seed=5)
    A = np.random.default_rng(5).standard_normal((4, 6))

    def head_plus_mlp(X):
        return M(X) + np.maximum(X[:, -1, :] @ A.T, 0.0).sum(axis=1)

    with pytest.raises(ModelMismatchError):
        extract_multi_head(Oracle(head_plus_mlp, 6), heads=2, seed=0)


def test_squashed_heads_are_refused():
    M = random_multi_head(2, 6, seed=5)
    with pytest.raises(ModelMismatchError):
        extract_multi_head(Oracle(lambda X: np.tanh(M(X)), 6), heads=2, seed=0)


def test_zero_model_has_no_canonical_heads():
    M = MultiHeadAttention(np.random.default_rng(0).standard_normal((2, 4, 4)), np.zeros((2, 4)))
    result = extract_multi_head(Oracle(M, 4), heads=2, seed=0)
    assert result.model.heads == 0


def test_twin_black_box_gives_the_same_canonical_heads():
    M = random_multi_head(2, 6, seed=9)
    twin = non_identifiable_twin(M, seed=1)               # 4 stored heads, 2 canonical
    result = extract_multi_head(Oracle(twin, 6), heads=4, seed=0)
    assert result.model.heads == 2
    assert canonical_error(result.model, M) <= result.report.details["error bar"]


def test_bad_options():
    oracle = Oracle(random_multi_head(2, 3, seed=0), 3)
    for heads in (0, -1, 1.5, True):
        with pytest.raises(InputError):
            extract_multi_head(oracle, heads=heads)
    with pytest.raises(RecoveryFailedError, match="at most d = 3 canonical heads") as info:
        extract_multi_head(oracle, heads=4)                 # more heads than d
    assert "not judged" in str(info.value) and "not multi-head" not in str(info.value)
    assert info.value.result.model.heads == 0 and oracle.queries == 0
    for bar in (0.0, 2.0, "x"):
        with pytest.raises(InputError):
            extract_multi_head(oracle, heads=2, max_error_bar=bar)


# ---------------------------------------------------------------------------
# float32-rounded outputs: an honest error bar or a refusal
# ---------------------------------------------------------------------------

def test_output_precision_detection():
    x = np.random.default_rng(0).standard_normal(8)
    assert output_precision(x)[1] == "float64"
    assert output_precision(x.astype(np.float32))[1] == "float32"
    assert output_precision(x.astype(np.float16))[1] == "float16"


def float32_trial(H, d, seed):
    """(error, bar) of one float32 extraction, or None when refused."""
    M = random_multi_head(H, d, seed=7000 + 100 * H + seed)
    try:
        result = extract_multi_head(Oracle(RoundedOutputs(M), d), heads=H, seed=seed)
    except (ModelMismatchError, RecoveryFailedError, NotIdentifiableError):
        return None
    assert result.report.details["output precision"] == "float32"
    return canonical_error(result.model, M), result.report.details["error bar"]


@pytest.mark.parametrize("H", [1, 2])
def test_float32_outputs_within_the_error_bar(H):
    outcomes = [float32_trial(H, 8, seed) for seed in range(3)]
    done = [o for o in outcomes if o is not None]
    assert len(done) >= 2
    for error, bar in done:
        assert 1e-10 < error <= bar <= 1e-3


@pytest.mark.slow
@pytest.mark.parametrize("H", [3, 4])
def test_float32_outputs_d16_within_the_error_bar(H):
    for seed in range(3):
        outcome = float32_trial(H, 16, seed)
        if outcome is not None:
            error, bar = outcome
            assert error <= bar


# ---------------------------------------------------------------------------
# paper 1: known orthogonal subspaces
# ---------------------------------------------------------------------------

def subspace_model(d, sizes, seed, rotate=True):
    rng = np.random.default_rng(seed)
    R = np.linalg.qr(rng.standard_normal((d, d)))[0] if rotate else np.eye(d)
    W, v, bases, lo = [], [], [], 0
    for r in sizes:
        B = R[:, lo:lo + r]
        W.append(B @ rng.standard_normal((r, r)) @ B.T / np.sqrt(r))
        v.append(B @ rng.standard_normal(r))
        bases.append(B)
        lo += r
    return MultiHeadAttention(np.array(W), np.array(v)), bases


@pytest.mark.parametrize("seed", range(10))
def test_known_subspaces(seed):
    sizes = [2, 3, 1][: 1 + seed % 3]
    M, bases = subspace_model(7, sizes, seed)
    oracle = Oracle(M, 7)
    result = extract_multi_head(oracle, subspaces=bases, seed=seed)
    assert canonical_error(result.model, M) < 1e-9
    floor = sum(r * r + r for r in sizes)
    assert result.report.breakdown["recovery"] >= floor
    assert result.report.floor == floor
    assert result.queries == oracle.queries          # the restricted views count honestly


def test_known_coordinate_subspaces_and_dead_head():
    M, _ = subspace_model(6, [2, 2, 2], 3, rotate=False)
    M.v[1] = 0.0
    result = extract_multi_head(Oracle(M, 6), subspaces=[[0, 1], [2, 3], [4, 5]], seed=0)
    assert result.model.heads == 2
    assert canonical_error(result.model, M) < 1e-9
    assert any("dead head" in n for n in result.report.notes)


def test_bad_subspaces():
    oracle = Oracle(random_multi_head(2, 4, seed=0), 4)
    with pytest.raises(InputError):
        extract_multi_head(oracle, subspaces=[[0, 1], [1, 2]])          # overlap
    with pytest.raises(InputError):
        extract_multi_head(oracle, subspaces=[np.ones((4, 1)), np.eye(4)[:, :1]])
    with pytest.raises(InputError):
        extract_multi_head(oracle, subspaces=[[0, 7]])
    with pytest.raises(InputError):
        extract_multi_head(oracle, subspaces=[])


def test_wrong_subspaces_are_a_mismatch():
    M = random_multi_head(2, 4, seed=1)                 # heads read everything
    with pytest.raises(ModelMismatchError):
        extract_multi_head(Oracle(M, 4), subspaces=[[0, 1], [2, 3]], seed=0)


# ---------------------------------------------------------------------------
# command line
# ---------------------------------------------------------------------------

@pytest.mark.slow
def test_cli_extract_multi_head(tmp_path):
    target = tmp_path / "target.py"
    target.write_text(textwrap.dedent("""
        from attnextract.adapters.targets import random_multi_head
        box = random_multi_head(2, 4, seed=21)
    """))
    out = tmp_path / "RESULT.npz"
    proc = run_cli("extract", "--target", f"{target}:box", "--dim", "4", "--model", "multi-head",
                   "--heads", "2", "--seed", "0", "--out", str(out), "--json", timeout=120)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["ok"] and report["details"]["heads"] == 2
    assert report["details"]["paper_count"] == paper2_count(2, 4)   # JSON keys are snake_case
    with np.load(out) as data:
        assert data["W"].shape == (2, 4, 4) and data["v"].shape == (2, 4)
        assert int(data["queries"]) == report["queries"]
    model = load_model(out)
    assert canonical_error(model, random_multi_head(2, 4, seed=21)) < 1e-8
    verify = run_cli("verify", "--target", f"{target}:box", "--result", str(out), timeout=120)
    assert verify.returncode == 0 and "MATCH" in verify.stdout
    bad = run_cli("extract", "--target", f"{target}:box", "--dim", "4", "--heads", "2", "--out",
                  str(tmp_path / "x.npz"), timeout=120)
    assert bad.returncode == 2 and "--heads does not apply" in bad.stderr


# ---------------------------------------------------------------------------
# the measurement design's pieces: poles, labels, samples, base rows
# ---------------------------------------------------------------------------

def _steps(t, c, lam):
    return (1.0 / (1.0 + np.exp(-(t[None, :] + lam[:, None])))) @ c


@pytest.mark.parametrize("H", [2, 4, 8])
def test_rational_fit_locates_steps_without_a_start(H):
    """In x = e^lambda a sum of H steps is rational of degree H: its poles are the steps.
    Over 20 random rows (positions filling the window, heights of both signs) every
    step is found, to better than 1e-4, with no start and no random restart."""
    from attnextract.learners.multi_head.fit import rational_steps
    lam = np.linspace(-7.6, 7.6, 4 * H + 8)
    worst = 0.0
    for seed in range(20):
        rng = np.random.default_rng(seed)
        t = np.sort(rng.uniform(-6.0, 6.0, H))
        if H > 1 and np.min(np.diff(t)) < 0.2:
            t = np.linspace(-6.0, 6.0, H) + rng.uniform(-0.3, 0.3, H)
        c = rng.standard_normal(H) + np.sign(rng.standard_normal(H))
        found = rational_steps(lam, _steps(t, c, lam), H)
        assert found.size == H
        worst = max(worst, float(np.max(np.abs(found - t))))
    assert worst < 1e-4, worst


def test_free_step_fit_finds_the_head_count_and_polishes():
    from attnextract.learners.multi_head.fit import fit_free_steps
    lam = np.linspace(-7.6, 7.6, 40)
    t = np.array([-5.0, -2.1, 0.3, 2.2, 4.9])
    c = np.array([1.0, -2.0, 0.7, 1.5, -0.4])
    g = _steps(t, c, lam)
    fits = fit_free_steps(lam, g, c.sum(), 8, 7.6, 1e-15, enough=lambda f: f.rms <= 1e-12)
    assert len(fits) == 5                            # stops at the first count that fits
    assert np.max(np.abs(fits[-1].t + 0.0 - t)) < 1e-9
    assert np.max(np.abs(fits[-1].c - c)) < 1e-9


def test_steps_are_labelled_by_position_and_height_together():
    from attnextract.learners.multi_head.fit import label_steps
    t_pred = np.array([-3.0, -1.0, 1.0, 3.0])
    c_pred = np.array([2.0, -1.0, 0.5, 3.0])
    perm = np.array([2, 0, 3, 1])
    order = label_steps(t_pred[perm] + 0.3, c_pred[perm] * 1.1, t_pred, c_pred, 2.0)
    assert np.array_equal(perm[order], np.arange(4))


def test_row_and_column_samples_sit_at_steps_and_midpoints():
    from attnextract.learners.multi_head.design import column_lambdas, row_lambdas
    t = np.array([-4.0, -1.0, 2.0, 5.0])
    lam = row_lambdas(t, 7.0)
    assert lam.size == 2 * t.size + 1
    for step in -t:
        assert np.any(np.isclose(lam, step))
    assert np.any(np.isclose(lam, -0.5 * (t[0] + t[1])))
    assert np.all(np.abs(lam) <= 7.0)
    cols = [column_lambdas(t, j, 7.0, 1) for j in range(6)]
    assert all(c.size == t.size + 1 for c in cols)
    assert len({float(c[-1]) for c in cols}) == 3    # the spare rotates over the midpoints


def test_base_rows_with_a_step_at_the_window_edge_are_not_chosen():
    from attnextract.learners.multi_head.base_row import base_quality
    from attnextract.learners.multi_head.fit import StepFit
    inside = StepFit(t=np.array([-3.0, 0.0, 3.0]), c=np.ones(3), rms=0.0,
                     t_std=np.full(3, 1e-9), c_std=np.zeros(3))
    edge = StepFit(t=np.array([-3.0, 0.0, 7.2]), c=np.ones(3), rms=0.0,
                   t_std=np.full(3, 1e-12), c_std=np.zeros(3))
    assert base_quality(inside, 7.6) == pytest.approx(1e-9 / 3.0)
    assert base_quality(edge, 7.6) == np.inf


@pytest.mark.slow
def test_wide_columns_run_when_small_moves_limit_the_precision(monkeypatch):
    """Eight heads at d = 8: round 3 (designed wide columns) runs, costs up to d^2 (H + 1)
    queries (d (H + 1) per column per row), and the total stays within paper 2's count.
    (Short probes, which take the count first when it leaves room, are switched off.)"""
    import attnextract.learners.multi_head as multi_head
    # the budget reads it (the base stage's share, the short probes' need per row)
    monkeypatch.setattr(multi_head.budget, "SHORT_OVERSAMPLE", np.inf)
    d, H = 8, 8
    M = random_multi_head(H, d, seed=80_800)
    oracle = Oracle(M, d)
    result = extract_multi_head(oracle, heads=H, seed=0)
    b = result.report.breakdown
    # as many wide columns per row as the count leaves, up to d
    assert b["main wide columns"] % (d * (H + 1)) == 0
    assert 0 < b["main wide columns"] <= d * d * (H + 1)
    assert b["recovery"] <= paper2_count(H, d)
    det = result.report.details
    assert det["predicted relative error"] < det["predicted relative error (small moves)"]
    assert canonical_error(result.model, M) <= det["error bar"]


@pytest.mark.slow
@pytest.mark.parametrize("H,d,seed", [(7, 8, 0), (8, 8, 0), (8, 8, 1), (8, 16, 0)])
def test_up_to_eight_heads(H, d, seed):
    """Eight heads at d = 8 (every row's positions fixed by the design: H = d)."""
    check_extraction(random_multi_head(H, d, seed=1000 * H + 10 * d + seed), seed, heads=H)


@pytest.mark.slow
@pytest.mark.parametrize("seed", [13, 22])
def test_float32_large_tokens_judged_at_the_models_own_precision(seed):
    """Two d = 16 one-head boxes with float32 outputs whose held-out check used to fail
    on the 'norms' family (tokens 1e3 x larger: scores 1e6 x, known to bar x 1e6): the
    check now allows 4 x bar x the model's score spread there, and the model comes back
    within its bar."""
    d = 16
    M = random_multi_head(1, d, seed=10_000 + 100 * d + seed, w_scale=1 / np.sqrt(d))
    result = extract_multi_head(Oracle(RoundedOutputs(M), d), heads=1, seed=seed)
    assert result.report.verification.passed
    assert canonical_error(result.model, M) <= result.report.details["error bar"]


def test_least_uncertain_row_hits_its_positions_where_the_estimate_is_sure():
    """A row designed from an estimate: u^T y_h are the designed positions (one order, one
    offset), and the free directions avoid those where the estimate of y_h is unsure:
    its predicted position variance is far below a row designed without the covariance."""
    from attnextract.learners.multi_head.design import design_rows, least_uncertain_row
    rng = np.random.default_rng(3)
    d, H = 12, 4
    Y0, V = rng.standard_normal((d, H)), rng.standard_normal((d, H))
    unsure = rng.standard_normal((d, 3))
    cov = unsure @ unsure.T + 1e-8 * np.eye(d)
    positions = np.linspace(-4.0, 4.0, H)
    u = least_uncertain_row(Y0, V, cov, positions, np.random.default_rng(0), jitter=0.3)
    t = np.sort(u @ Y0)
    assert np.allclose(np.diff(t), np.diff(positions), atol=1e-9)
    assert abs(np.mean(t)) <= 0.3 + 1e-9                   # the offset stays within the jitter
    plain = design_rows(Y0, V, positions, np.random.default_rng(0), count=5)
    assert u @ cov @ u < 1e-3 * min(r @ cov @ r for r in plain)


@pytest.mark.slow
@pytest.mark.parametrize("seed", [15, 19])
def test_crowded_base_row_moves_to_a_designed_column(seed):
    """Eight heads at d = 12: the first base row's steps crowd (perturbations around it
    gave W_h q_0 to 0.04-0.7 only), so the row is scanned at random columns and moved
    to a column that spaces its steps evenly; the perturbations run once, around it,
    and the recovery stays within paper 2's count and its own error bar. (Seed 15
    failed under the Haswell and Zen kernels when the estimate of the crowded row
    decided the design.) How many designed scans the row takes, and so the base
    estimate's error, depends on the last bits (seed 19: one scan and 9.2e-7 by
    default, two and 2.4e-5 under OpenBLAS's Haswell kernels, both recovered to 4e-15);
    the main rows correct estimates far rougher than 1e-4."""
    d, H = 12, 8
    M = random_multi_head(H, d, seed=1000 * H + 10 * d + seed)
    result = check_extraction(M, seed, heads=H)
    det, b = result.report.details, result.report.breakdown
    assert (det["designed column smallest step gap"]
            > det["base row smallest step gap (first row)"])
    assert det["base estimate relative error"] <= 1e-4
    assert b["base perturbations"] == (d - 1) * (2 * H + 3)         # one pass
    assert canonical_error(result.model, M) <= det["error bar"]


def test_refusals_after_measuring_keep_the_best_effort():
    """A refusal by the error bar (RecoveryFailedError) carries the measured result, like
    a mismatch: its report has the queries and the conditioning, the H asked with its
    floor and multi-head paper's count, and every design tried (each new design measured again
    while that count allowed)."""
    d, H = 8, 2
    oracle = Oracle(random_multi_head(H, d, seed=8), d)
    with pytest.raises(RecoveryFailedError) as info:
        extract_multi_head(oracle, heads=H, seed=1, max_error_bar=1e-30)
    result = info.value.result
    assert result is not None and result.queries == oracle.queries
    det = result.report.details
    assert det["error bar"] > 1e-30
    assert det["heads asked"] == H and "heads" not in det
    assert det["multi-head paper's count"] == paper2_count(H, d)
    assert det["floor H(d^2 + d)"] == H * (d * d + d)
    assert det["designs tried"] == len(det["failed designs"]) >= 1
    assert "exceeds the largest error bar accepted (max_error_bar" in str(info.value) and "no room for another" in str(info.value)
    spent = result.report.breakdown["recovery"] + result.report.breakdown["verification"]
    assert spent <= paper2_count(H, d)
    text = result.report.render(verbose=True)
    assert "heads 0" not in text
    # the stage and its count apart ("base perturbations189" before)
    assert re.search(r"[0-9] +base perturbations|base perturbations +[0-9]", text)
    assert not re.search(r"perturbations[0-9]", text)


def test_a_failed_row_fit_is_redesigned_not_refused(monkeypatch):
    """The first main row's joint fit is spoiled on purpose (the learner's own failure,
    a wrong basin): the learner replaces that row by a new designed one, measures it
    again (the other rows' samples kept) within paper 2's count, and returns the right
    model."""
    from attnextract.learners.multi_head import fit as fit_module
    real, calls = fit_module.fit_row, []

    def spoiled_once(*args):
        row = real(*args)
        calls.append(1)
        if len(calls) == 1:
            row.residual = row.residual + 1.0            # a fit in a wrong basin
        return row

    monkeypatch.setattr(fit_module, "fit_row", spoiled_once)
    d, H = 8, 2
    M = random_multi_head(H, d, seed=31)
    result = check_extraction(M, seed=3, heads=H)
    det, b = result.report.details, result.report.breakdown
    assert det["main rows redesigned"] == 1 and "designs tried" not in det
    assert b["main rows"] == (d + 1) * (2 * H + 1)
    assert b["main columns"] == (d + 1) * d * (H + 1)


@pytest.mark.parametrize("case", ["zero v_h", "equal W", "saturating"])
def test_adversarial_boxes_recovered_without_refusal(case):
    """A dead head (v_h = 0: dropped), two heads with the same W (merged), W entries
    N(0, 100/d): each comes back with its canonical heads within the bar."""
    d, H = 8, 3
    scale = (10.0 if case == "saturating" else 1.0) / np.sqrt(d)
    M = random_multi_head(H, d, seed=41, w_scale=scale)
    if case == "zero v_h":
        M.v[1] = 0.0
    elif case == "equal W":
        M.W[2] = M.W[0]
    result = check_extraction(M, seed=5, heads=H, tol=1e-6)
    assert result.model.heads == canonical_form(M).heads


@pytest.mark.slow               # subprocesses (the hook runs the fast tests within 50 s)
def test_same_seed_is_bit_identical_whatever_the_hash_seed():
    """Three processes with different PYTHONHASHSEED (so different heap layouts, which
    changed MINPACK's last bits before) give the same bits for the same seed."""
    import os
    import subprocess
    import sys
    code = textwrap.dedent("""
        import hashlib
        from attnextract import Oracle
        from attnextract.learners.multi_head import extract_multi_head
        from attnextract.adapters.targets import random_multi_head
        M = random_multi_head(4, 8, seed=102)
        r = extract_multi_head(Oracle(M, 8), seed=2)
        print(r.queries, hashlib.sha256(r.model.W.tobytes() + r.model.v.tobytes()).hexdigest())
    """)
    outs = set()
    for hash_seed in ("1", "2", "3"):
        env = {**os.environ, "PYTHONHASHSEED": hash_seed}
        proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                              text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr
        outs.add(proc.stdout.strip())
    assert len(outs) == 1, outs


def test_head_count_found_from_agreeing_rows():
    """Without heads=: the count is the largest that two base rows agree on, and the run
    costs at most 1.5 x the queries of a run told H."""
    d, H = 8, 3
    M = random_multi_head(H, d, seed=51)
    found = check_extraction(M, seed=4)
    told = check_extraction(M, seed=4, heads=H)
    counts = found.report.details["head counts of the base rows"]
    assert counts.count(H) >= 2 and found.model.heads == H
    assert found.report.queries <= 1.5 * told.report.queries


def test_count_not_found_is_refused_quickly_with_a_hint():
    """A box that is no sum of sigmoid steps, asked without heads=, is refused before the
    main rounds, and the message suggests giving the count."""
    M = random_multi_head(2, 6, seed=5)
    oracle = Oracle(lambda X: np.tanh(3 * M(X)) + 0.5 * np.sin(4 * M(X)), 6)
    with pytest.raises(ModelMismatchError, match="heads=") as info:
        extract_multi_head(oracle, seed=0)
    assert oracle.queries < 1000
    assert "main rows" not in info.value.result.report.breakdown


def test_precision_and_rounding_options():
    d, H = 8, 4
    M = random_multi_head(H, d, seed=61)
    fast = check_extraction(M, seed=0, heads=H, precision="fast")
    full = check_extraction(M, seed=0, heads=H, precision="full")
    # full: the rest of paper 2's count as short probes (float64 answers, room for them)
    # or, where a crowded base row's designed column leaves too few, as wide columns
    assert "short probes" not in fast.report.breakdown
    assert ("short probes" in full.report.breakdown
            or "main wide columns" in full.report.breakdown)
    assert full.report.queries >= fast.report.queries
    assert full.report.details["error bar"] <= fast.report.details["error bar"]
    told = extract_multi_head(Oracle(RoundedOutputs(M), d), heads=H, seed=0,
                              output_dtype="float32")
    assert told.report.details["output precision"] == "float32"
    assert canonical_error(told.model, M) <= told.report.details["error bar"]
    rounded = extract_multi_head(Oracle(lambda X: np.round(M(X), 9), d), heads=H, seed=0,
                                 decimals=9)
    assert canonical_error(rounded.model, M) <= rounded.report.details["error bar"]
    assert any("9 decimals" in n for n in rounded.report.notes)
    oracle = Oracle(M, d)
    for bad in ({"precision": "best"}, {"output_dtype": "int8"}, {"decimals": -1},
                {"decimals": 1.5}):
        with pytest.raises(InputError):
            extract_multi_head(oracle, heads=H, **bad)
    assert oracle.queries == 0


def _torch_box(seed, dtype, heads=2, dim=16):
    import torch
    from attnextract.adapters.torch_target import TorchAttentionBlackBox, merged_head_parameters
    torch.manual_seed(seed)
    module = torch.nn.MultiheadAttention(dim, heads, bias=False)
    box = TorchAttentionBlackBox(module, readout=seed, dtype=dtype)
    W, v = zip(*(merged_head_parameters(box.module, box.readout, h) for h in range(heads)))
    return box, MultiHeadAttention(np.array(W), np.array(v))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_torch_module_without_heads(seed):
    """A real nn.MultiheadAttention(16, 2, bias=False) in float64 behind a fixed readout,
    no heads=: both heads found and recovered within the bar, at most 1.5 x the queries
    of a run told H = 2 (issue 22 measured 15 minutes and refusals before)."""
    box, truth = _torch_box(seed, "float64")
    found = extract_multi_head(Oracle(box, 16), seed=seed)
    told = extract_multi_head(Oracle(box, 16), heads=2, seed=seed)
    assert found.model.heads == 2
    assert canonical_error(found.model, truth) <= found.report.details["error bar"] <= 1e-10
    assert found.report.queries <= 1.5 * told.report.queries


@pytest.mark.parametrize("seed", [0, 1])
def test_float32_torch_module_within_its_bar(seed):
    """PyTorch's default dtype: the forward pass runs in float32 (errors accumulated
    inside the model, not one rounding of the output). Detected from the outputs, said
    in the report, and the model comes back within its (wider) error bar."""
    box, truth = _torch_box(seed, "float32")
    result = extract_multi_head(Oracle(box, 16), heads=2, seed=seed)
    assert result.report.details["output precision"] == "float32"
    assert any("float32" in n for n in result.report.notes)
    assert canonical_error(result.model, truth) <= result.report.details["error bar"] <= 1e-3


def test_window_keeps_designed_steps_apart_up_to_twelve_heads():
    """The main window grows with H so the designed spacing 2 (ln(N - 1) - 1.5) / H stays
    >= 1.45 (a sigmoid's width is ~4) up to H = 12; the base stages use 2048 tokens up to
    8 heads and the main window beyond."""
    from attnextract.learners.multi_head.design import base_length
    for H in range(1, 13):
        N = window_length(H)
        assert 2 * (np.log(N - 1) - 1.5) / H >= 1.45, H
        assert base_length(H) == (2048 if H <= 8 else N)


@pytest.mark.slow
def test_eight_heads_at_d8_seed_18_below_1e_10():
    """The previous learner's one d = 8 miss (1.1e-10, cond(U) 497): with 100 candidate
    orders per row at H = d, it is inside the 1e-10 goal."""
    d, H, seed = 8, 8, 18
    M = random_multi_head(H, d, seed=10_000 * H + 100 * d + seed, w_scale=1 / np.sqrt(d))
    result = extract_multi_head(Oracle(M, d), heads=H, seed=seed)
    assert canonical_error(result.model, M) <= 1e-10


def test_flat_base_rows_do_not_vote_for_zero_heads():
    """One head with large W (s = 3): the first row's scale can put the other rows' steps
    outside the window (flat rows). With v nonzero some head exists, so flat rows do not
    vote: every learner seed recovers the head (one seed was refused as a 0-head box)."""
    M = random_multi_head(1, 8, seed=10812, w_scale=3 / np.sqrt(8))
    for seed in range(12, 18):
        check_extraction(M, seed, heads=1)
    rows = [(0, np.ones(8), None), (1, np.ones(8), type("F", (), {"c": np.ones(1)})())]
    from attnextract.learners.multi_head import _Extraction
    run = _Extraction.__new__(_Extraction)
    run.v = np.zeros(8)                      # v = 0: a flat row may be a box with no head
    assert run.votes(rows) == [0, 1]
    run.v = np.ones(8)
    assert run.votes(rows) == [1]


@pytest.mark.parametrize("ratio, seed", [(1e-3, 2), (1e-3, 5), (1e-4, 0), (1e-4, 3)])
def test_head_a_thousand_times_weaker_is_recovered(ratio, seed):
    """d = 8, H = 2, one head's value 1e-3 or 1e-4 of the other's: every step fit pins the
    weak step (1e-11 where the strong one is 2e-14), but the column fits freed both
    logits at once and the weak one absorbed the strong one's misfit (the row fits then
    walked off: refused as a wrong basin, 10 of 12 such boxes). Heads freed strongest
    first (fit.fit_logits): recovered within the bar, which grows as 1 / ratio."""
    M = random_multi_head(2, 8, seed=700 + seed)
    v = M.v.copy()
    v[1] *= ratio
    box = MultiHeadAttention(M.W, v)
    oracle = Oracle(box, 8)
    result = extract_multi_head(oracle, heads=2, seed=seed)
    bar = result.report.details["error bar"]
    assert canonical_error(result.model, box) <= min(bar, 1e-7)
    assert oracle.queries <= paper2_count(2, 8)
