"""Multi-head attention: the model, twins, canonical form, and both learners.

The full sweep (H <= 4, d <= 32, 20 seeds each) is in benchmarks/bench_multi_head.py;
here the 20-seed sweeps run at small d so that the file stays fast.
"""

import json
import textwrap

import numpy as np
import pytest

from attnextract import Oracle
from attnextract.errors import InputError, ModelMismatchError
from attnextract.models import MODEL_CLASSES, MultiHeadAttention, SingleHeadAttention
from attnextract.learners.multi_head import (canonical_error, canonical_form, copy_ratios,
                                    extract_multi_head, match_heads, non_identifiable_twin,
                                    output_precision, twin_difference)
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
def test_copy_count_identity(seed):
    """f(m copies of a, n of q) = v^T a - sum_h c_h kappa_h / (mu + kappa_h)."""
    rng = np.random.default_rng(seed)
    H, d = 3, 6
    M = random_multi_head(H, d, seed=seed, w_scale=0.7)
    a, q = rng.standard_normal(d), rng.standard_normal(d)
    u = a - q
    kappa = np.exp(-np.einsum("i,hij,j->h", u, M.W, q))
    c = M.v @ u
    for m, n in [(0, 1), (1, 1), (2, 1), (1, 3), (4, 5), (7, 2)]:
        X = np.array([a] * m + [q] * n)
        mu = m / n
        predicted = M.v.sum(0) @ a - np.sum(c * kappa / (mu + kappa))
        assert abs(M(X) - predicted) <= 1e-12 * (1 + abs(predicted))


def test_copy_ratios_fit_in_length_2H_plus_1():
    for H in range(1, 7):
        ratios = copy_ratios(2 * H - 1, max_length=2 * H + 1)
        assert len(set(m / n for m, n in ratios)) == 2 * H - 1
        assert max(m + n for m, n in ratios) <= 2 * H + 1
        assert all(m >= 1 and n >= 1 for m, n in ratios)
    with pytest.raises(InputError):
        copy_ratios(50, max_length=5)


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
# paper 2: no subspace assumption
# ---------------------------------------------------------------------------

def check_extraction(M, seed, heads=None, tol=1e-8):
    d = M.dim
    oracle = Oracle(M, d)
    result = extract_multi_head(oracle, heads=heads, seed=seed)
    truth = canonical_form(M)
    assert result.model.heads == truth.heads
    assert canonical_error(result.model, truth) <= tol
    assert result.queries == oracle.queries
    recovery = result.report.breakdown["recovery"]
    H = max(truth.heads, 1)
    assert recovery <= paper2_count(H, d), (recovery, paper2_count(H, d))
    assert result.report.verification.passed
    return result


@pytest.mark.parametrize("H,d,seeds", [(1, 4, 20), (2, 4, 20), (3, 4, 20), (2, 7, 20),
                                       (4, 4, 6), (4, 6, 4)])
@pytest.mark.slow
def test_generic_heads_recovered_within_paper2_count(H, d, seeds):
    for seed in range(seeds):
        check_extraction(random_multi_head(H, d, seed=1000 * H + seed), seed)


# Benchmark seeds (target seed 10000 H + 100 d + s, extraction seed s) that failed before
# the row repair: a probe with two nearly coincident logits fitted the wrong way round
# bent its row's residues so that no probe stood out as a misfit, and the rows were
# linked with the bent logits (seeds 0, 2, 5, 15); or the polish drifted along the flat
# direction of a coincident-pole probe whose own pair pinned it (seed 3: there head 1's
# residue on that row is also 5e-4 of the largest).
@pytest.mark.parametrize("seed", [0, 2, 3, 5, 15])
@pytest.mark.slow
def test_previously_failing_four_head_seeds(seed):
    result = check_extraction(random_multi_head(4, 4, seed=10_000 * 4 + 100 * 4 + seed), seed)
    assert result.report.breakdown["recovery"] <= paper2_count(4, 4)


@pytest.mark.parametrize("H", [2, 3])
@pytest.mark.parametrize("name", ["merged heads (W_1 = W_0)", "dead head (v = 0)",
                                  "heads sharing v", "non-orthogonal heads (correlated W, v)",
                                  "one head 10x larger W", "v = sum of v_h = 0"])
@pytest.mark.slow
def test_hostile_heads(H, name):
    for seed in range(3):
        M = hostile_multi_heads(H, 5, seed=seed)[name]
        result = check_extraction(M, seed)
        if name in ("merged heads (W_1 = W_0)", "dead head (v = 0)"):
            assert result.model.heads == H - 1


@pytest.mark.slow
def test_upper_bound_and_exact_head_count():
    M = random_multi_head(2, 5, seed=3)
    for heads in (2, 3, 5):
        check_extraction(M, seed=1, heads=heads)
    merged = hostile_multi_heads(3, 5, seed=1)["merged heads (W_1 = W_0)"]
    assert check_extraction(merged, seed=2, heads=3).model.heads == 2


@pytest.mark.slow
def test_too_small_bound_is_a_mismatch():
    M = random_multi_head(3, 5, seed=4)
    with pytest.raises(ModelMismatchError) as info:
        extract_multi_head(Oracle(M, 5), heads=2, seed=0)
    assert info.value.result is not None


@pytest.mark.slow
def test_not_multi_head_is_a_mismatch():
    M = random_multi_head(2, 4, seed=5)

    def squashed(X):                       # a nonlinearity after the heads
        return np.tanh(M(X))

    with pytest.raises(ModelMismatchError):
        extract_multi_head(Oracle(squashed, 4), seed=0)


def test_zero_model_has_no_canonical_heads():
    M = MultiHeadAttention(np.random.default_rng(0).standard_normal((2, 4, 4)), np.zeros((2, 4)))
    result = extract_multi_head(Oracle(M, 4), seed=0)
    assert result.model.heads == 0


def test_probes_are_batched_one_query_per_length():
    M = random_multi_head(3, 6, seed=6)
    oracle = Oracle(M, 6)
    result = extract_multi_head(oracle, seed=0)
    # a round sends one batch per sequence length: far fewer calls than queries
    assert oracle.calls <= 100 and result.queries > 3 * oracle.calls
    lengths = result.report.details["sequence lengths"].split("probes [")[1].rstrip("]")
    assert max(int(n) for n in lengths.split(",")) <= 2 * 3 + 1


def test_query_count_for_one_head_is_the_single_head_floor_plus_overhead():
    d = 6
    M = random_multi_head(1, d, seed=7)
    result = extract_multi_head(Oracle(M, d), seed=0)
    b = result.report.breakdown
    assert b["main probes"] == d * d and b["row links"] == d - 1 and b["v tokens"] == d
    assert b["recovery"] == sum(v for k, v in b.items() if k not in ("recovery", "verification"))


def test_bad_options():
    oracle = Oracle(random_multi_head(2, 3, seed=0), 3)
    for heads in (0, -1, 1.5):
        with pytest.raises(InputError):
            extract_multi_head(oracle, heads=heads)
    with pytest.raises(InputError):
        extract_multi_head(oracle, rank_tol=2.0)


# ---------------------------------------------------------------------------
# float32-rounded outputs: what precision survives
# ---------------------------------------------------------------------------

def test_output_precision_detection():
    x = np.random.default_rng(0).standard_normal(8)
    assert output_precision(x)[1] == "float64"
    assert output_precision(x.astype(np.float32))[1] == "float32"
    assert output_precision(x.astype(np.float16))[1] == "float16"


@pytest.mark.slow
def test_float32_outputs_one_and_two_heads():
    """Rounding to float32 leaves ~1e-6 on the parameters of one or two heads (measured)."""
    for H in (1, 2):
        for seed in range(4):
            M = random_multi_head(H, 5, seed=seed + 10)
            box = lambda X, M=M: M(X).astype(np.float32)
            try:
                result = extract_multi_head(Oracle(box, 5), seed=seed, verify_tolerance=1e-4)
            except ModelMismatchError as exc:       # honest failure, never a silent one
                assert H == 2 and exc.result.report.verification.max_relative_error > 1e-4
                continue
            assert result.report.details["output precision"] == "float32"
            err = canonical_error(result.model, M)
            assert 1e-9 < err < 1e-4               # float32 leaves float32-level errors


@pytest.mark.slow
def test_float32_outputs_never_return_a_wrong_model_silently():
    for seed in range(4):
        M = random_multi_head(3, 5, seed=seed)
        box = lambda X, M=M: M(X).astype(np.float32)
        try:
            result = extract_multi_head(Oracle(box, 5), seed=seed, verify_tolerance=1e-4)
        except ModelMismatchError:
            continue
        assert canonical_error(result.model, M) < 1e-2


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
