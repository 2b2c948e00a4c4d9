"""Noisy, rounded and sign-only black boxes: wrappers, error bars, the paper's method, CLI."""

import json
import os

import numpy as np
import pytest

from attnextract import (InputError, ModelMismatchError, NotIdentifiableError, Oracle,
                         SingleHeadAttention, extract_single_head)
from attnextract.learners.noisy import NoiseModel, extract_noisy, paper_bound
from attnextract.oracle import (BOUNDED_PATTERNS, AdversarialNoise, BoundedNoise, GaussianNoise,
                                RoundedOutputs, SignOnly)
from attnextract.report import verification_count
from attnextract.learners.sign_only import extract_sign_only, label_check_count
from attnextract.adapters.targets import hostile_single_heads, random_single_head

from conftest import rel_err, run_cli

FLOAT32 = dict(tolerance=2.0 ** -150, relative_tolerance=2.0 ** -24)


def errors(result, target):
    return (float(np.linalg.norm(result.model.W - target.W)),
            float(np.linalg.norm(result.model.v - target.v)))


def bars(result):
    return result.report.details["error_bar_W"], result.report.details["error_bar_v"]


def adversaries(target, tau, seed):
    """Every noise kind with |eta| <= tau: fixed patterns and adversaries with goals."""
    rng = np.random.default_rng(seed)
    d = target.dim
    out = {p: BoundedNoise(target, tau, p, seed=seed) for p in BOUNDED_PATTERNS}
    out["decoy W x 1.5"] = AdversarialNoise(target, tau, decoy=SingleHeadAttention(1.5 * target.W, target.v))
    out["decoy W + E"] = AdversarialNoise(
        target, tau, decoy=SingleHeadAttention(target.W + rng.standard_normal((d, d)), target.v))
    out["decoy v x 1.1"] = AdversarialNoise(target, tau, decoy=SingleHeadAttention(target.W, 1.1 * target.v))
    out["against W = 0"] = AdversarialNoise(
        target, tau, against=SingleHeadAttention(np.zeros((d, d)), target.v))
    return out


# -- wrappers -------------------------------------------------------------------------

def test_wrappers_respect_their_stated_bounds(rng):
    target = random_single_head(6, seed=1)
    X = rng.standard_normal((500, 3, 6))
    clean = target(X)
    for name, box in adversaries(target, 1e-3, 0).items():
        eta = box(X) - clean
        assert np.all(np.abs(eta) <= 1e-3 * (1 + 1e-12)), name
        assert np.abs(eta).max() > 0.5e-3, name            # the noise is really there
    assert np.all(np.abs(BoundedNoise(target, 1e-3, "sign", seed=0)(X) - clean) == pytest.approx(1e-3))
    for precision in ("float32", "float16", 4, 2):
        box = RoundedOutputs(target, precision)
        err = np.abs(box(X) - clean)
        assert np.all(err <= box.tolerance + box.relative_tolerance * np.abs(clean)), precision
        assert err.max() > 0.1 * box.relative_tolerance * np.abs(clean).max(), precision
    assert np.allclose(RoundedOutputs(target, 4)(X), [float(f"{c:.3e}") for c in clean],
                       rtol=1e-15, atol=0)
    g = GaussianNoise(target, 0.01, seed=3)(X) - clean
    assert 0.009 < g.std() < 0.011 and abs(g.mean()) < 0.002
    labels = SignOnly(target)(X)
    assert set(np.unique(labels)) == {0.0, 1.0} and np.all((labels == 1.0) == (clean > 0))
    assert SignOnly(target, threshold=0.5)(X[0]) == float(clean[0] > 0.5)
    assert isinstance(BoundedNoise(target, 1e-3)(X[0]), float)


@pytest.mark.parametrize("make", [
    lambda t: BoundedNoise(t, -1.0), lambda t: BoundedNoise(t, 1e-3, "spiky"),
    lambda t: BoundedNoise(t, float("nan")), lambda t: RoundedOutputs(t, "float8"),
    lambda t: RoundedOutputs(t, 0), lambda t: AdversarialNoise(t, 1e-3),
    lambda t: AdversarialNoise(t, 1e-3, decoy=t, against=t), lambda t: GaussianNoise(t, -2),
    lambda t: SignOnly(t, threshold=float("inf")), lambda t: BoundedNoise("nope", 1e-3)])
def test_wrapper_bad_input(make):
    with pytest.raises(InputError):
        make(random_single_head(3, seed=0))


# -- error bars ---------------------------------------------------------------------

@pytest.mark.parametrize("d", [2, 8])
@pytest.mark.slow
def test_bounded_error_bar_holds_for_every_noise_kind(d):
    """The worst-case bar is a proof: it must hold in every trial, adversaries included."""
    trials = 0
    for seed in range(6):
        target = random_single_head(d, seed=seed)
        for tau in (1e-9, 1e-6, 1e-4):
            for name, box in adversaries(target, tau, seed).items():
                result = extract_noisy(Oracle(box, d), tolerance=tau, seed=seed)
                (eW, ev), (bW, bv) = errors(result, target), bars(result)
                assert eW <= bW and ev <= bv, (d, seed, tau, name, eW, bW, ev, bv)
                assert bW <= 0.1 * np.linalg.norm(target.W) or tau > 1e-6
                trials += 1
    assert trials == 6 * 3 * 10


def test_bounded_error_bar_is_not_vacuous():
    """Bars within a factor 10 of the worst adversary's error at d = 16."""
    target = random_single_head(16, seed=4)
    worst = 0.0
    for name, box in adversaries(target, 1e-6, 4).items():
        result = extract_noisy(Oracle(box, 16), tolerance=1e-6, seed=1)
        worst = max(worst, errors(result, target)[0])
        bar = bars(result)[0]
    assert worst <= bar <= 10 * worst


def test_hostile_targets_under_bounded_noise():
    for seed in range(2):
        for name, target in hostile_single_heads(8, seed).items():
            box = BoundedNoise(target, 1e-7, "sign", seed=seed)
            if name == "tiny v (~1e-9)":
                with pytest.raises(NotIdentifiableError):
                    extract_noisy(Oracle(box, 8), tolerance=1e-7)
                continue
            result = extract_noisy(Oracle(box, 8), tolerance=1e-7, seed=seed)
            (eW, ev), (bW, bv) = errors(result, target), bars(result)
            assert eW <= bW and ev <= bv, name


@pytest.mark.parametrize("repeats", [1, 4])
@pytest.mark.slow
def test_random_error_bar_holds_over_many_seeds(repeats):
    d, std, misses, trials = 6, 1e-5, 0, 60
    for seed in range(trials):
        target = random_single_head(d, seed=100 + seed)
        box = GaussianNoise(target, std, seed=seed)
        result = extract_noisy(Oracle(box, d), tolerance=std, noise="random", repeats=repeats,
                               seed=seed)
        (eW, ev), (bW, bv) = errors(result, target), bars(result)
        misses += (eW > bW) + (ev > bv)
        assert result.queries == repeats * (d * d + d) + verification_count(
            d * d + d, repeats * (d * d + d))
    assert misses <= 0.01 * 2 * trials


def test_repeats_average_random_noise():
    target = random_single_head(8, seed=2)
    err = {}
    for repeats in (1, 16):
        runs = [errors(extract_noisy(Oracle(GaussianNoise(target, 1e-5, seed=s), 8), tolerance=1e-5,
                                     noise="random", repeats=repeats, seed=s), target)[0]
                for s in range(4)]
        err[repeats] = np.mean(runs)
    assert err[16] < err[1] / 2.5      # ~ 1/sqrt(16) = 1/4


def test_float32_outputs_give_1e4_at_d64():
    for seed in range(2):
        target = random_single_head(64, seed=seed)
        result = extract_noisy(Oracle(RoundedOutputs(target, "float32"), 64), **FLOAT32, seed=seed)
        assert rel_err(result.model.W, target.W) <= 1e-4
        assert errors(result, target)[0] <= bars(result)[0]
        assert result.report.details["error_bar_W_relative"] <= 1e-3


def test_four_significant_digits_usable_within_bar():
    d = 8
    for seed in range(5):
        target = random_single_head(d, seed=seed)
        box = RoundedOutputs(target, 4)
        worst = extract_noisy(Oracle(box, d), tolerance=0.0, relative_tolerance=5e-4, seed=seed)
        (eW, ev), (bW, bv) = errors(worst, target), bars(worst)
        assert eW <= bW and ev <= bv
        assert rel_err(worst.model.W, target.W) < 0.05
        # dithered repeats average the rounding errors: more queries, smaller error
        dithered = extract_noisy(Oracle(box, d), tolerance=0.0, relative_tolerance=5e-4,
                                 noise="random", repeats=8, seed=seed)
        assert dithered.report.breakdown["recovery"] == 8 * (d * d + d)
        assert errors(dithered, target)[0] <= bars(dithered)[0]
        assert bars(dithered)[0] < bW


# -- the paper's method ---------------------------------------------------------------

def test_paper_method_bound_holds_and_default_is_10x_better_at_equal_queries():
    d, tau = 16, 1e-6
    for seed in range(8):
        target = random_single_head(d, seed=seed)
        B = float(np.linalg.norm(target.W))
        box = BoundedNoise(target, tau, "sign", seed=seed)
        paper = extract_noisy(Oracle(box, d), tolerance=tau, method="paper", norm_bound=B, seed=seed)
        robust = extract_noisy(Oracle(box, d), tolerance=tau, norm_bound=B, seed=seed)
        assert paper.queries == robust.queries == d * d + d + verification_count(d * d + d, d * d + d)
        eP, eR = errors(paper, target)[0], errors(robust, target)[0]
        mu = float(np.min(np.abs(paper.model.v))) - tau
        assert eP <= paper_bound(d, tau * (1 + 1e-9), B, mu)[0]
        assert eP <= bars(paper)[0] and eR <= bars(robust)[0]
        assert eR * 10 <= eP, (seed, eR, eP)


def test_paper_method_needs_its_assumptions():
    target = random_single_head(4, seed=0)
    with pytest.raises(InputError, match="norm_bound"):
        extract_noisy(Oracle(target, 4), tolerance=1e-6, method="paper")
    v = target.v.copy()
    v[1] = 0.0                                      # margin 0: Theorem 6.1 does not apply
    with pytest.raises(NotIdentifiableError, match="margin"):
        extract_noisy(Oracle(SingleHeadAttention(target.W, v), 4), tolerance=1e-6,
                      method="paper", norm_bound=10.0)
    result = extract_noisy(Oracle(SingleHeadAttention(target.W, v), 4), tolerance=1e-6)
    assert errors(result, SingleHeadAttention(target.W, v))[0] <= bars(result)[0]


@pytest.mark.parametrize("kwargs", [
    dict(tolerance=-1.0), dict(tolerance=1e-3, noise="pink"), dict(tolerance=1e-3, method="magic"),
    dict(tolerance=1e-3, repeats=0), dict(tolerance=1e-3, relative_tolerance=0.7),
    dict(tolerance=1e-3, norm_bound=-2.0), dict(tolerance=1e-3, token_norm=0.0),
    dict(tolerance=1e-3, method="paper", norm_bound=3.0, repeats=2)])
def test_bad_options(kwargs):
    with pytest.raises(InputError):
        extract_noisy(Oracle(random_single_head(3, seed=0), 3), **kwargs)


# -- dispatch, mismatch, verification -------------------------------------------------

def test_extract_dispatches_single_head_on_tolerance():
    from attnextract import extract
    target = random_single_head(8, seed=9)
    box = BoundedNoise(target, 1e-6, "uniform", seed=1)
    result = extract(Oracle(box, 8), "single-head", tolerance=1e-6, seed=2)
    assert errors(result, target)[0] <= bars(result)[0]
    assert result.report.verification.passed
    assert result.options["model"] == "noisy" and result.options["tolerance"] == 1e-6
    paper = extract(Oracle(box, 8), tolerance=1e-6, method="paper", norm_bound=10.0)
    assert paper.report.details["method"].startswith("the single-head paper, Theorem 6.1")
    with pytest.raises(InputError, match="does not apply to model 'single-head'"):
        extract(Oracle(box, 8), method="paper")
    with pytest.raises(InputError, match="tolerance applies to 'single-head'"):
        extract(Oracle(box, 8), "low-rank", tolerance=1e-6)
    with pytest.raises(ModelMismatchError):       # exact-data verification rejects noisy outputs
        extract_single_head(Oracle(box, 8))


def test_mismatch_is_still_a_mismatch():
    d = 6
    target = random_single_head(d, seed=3)

    def two_heads(X):
        other = SingleHeadAttention(np.eye(d), np.ones(d))
        return target(X) + 0.3 * other(X)

    for box in (two_heads, lambda X: np.tanh(X[:, -1, :] @ target.v)):
        with pytest.raises(ModelMismatchError) as info:
            extract_noisy(Oracle(box, d), tolerance=1e-6)
        assert info.value.result is None or not info.value.result.report.verification.passed
    # noise ten times larger than the declared tolerance is caught by the held-out check
    with pytest.raises(ModelMismatchError):
        extract_noisy(Oracle(BoundedNoise(target, 1e-3, "sign", seed=0), d), tolerance=1e-6)


def test_error_bars_in_saved_json(tmp_path):
    target = random_single_head(4, seed=0)
    result = extract_noisy(Oracle(GaussianNoise(target, 1e-8, seed=0), 4), tolerance=1e-8,
                           noise="random")
    result.save(tmp_path / "r.npz")
    with np.load(tmp_path / "r.npz") as data:
        report = json.loads(str(data["report"]))
    assert report["details"]["error_bar_W"] == pytest.approx(bars(result)[0])
    assert report["details"]["error_bar_v"] == pytest.approx(bars(result)[1])
    assert report["verification"]["passed"] is True


# -- sign-only ------------------------------------------------------------------------

@pytest.mark.parametrize("d", [1, 2, 8, 16])
def test_sign_only_bisection(d):
    for seed in range(3):
        target = random_single_head(d, seed=seed)
        oracle = Oracle(SignOnly(target), d)
        result = extract_sign_only(oracle, seed=seed, bits=36)
        direction = target.v / np.linalg.norm(target.v)
        assert np.linalg.norm(result.model.v) == pytest.approx(1.0)
        assert np.linalg.norm(result.model.v - direction) <= 1e-12
        assert rel_err(result.model.W, target.W) <= 1e-8
        assert np.linalg.norm(result.model.W - target.W) <= result.report.details["error_bar_W"]
        assert any("positive scale" in note for note in result.report.notes)
        assert result.queries == oracle.queries
        extra = result.report.breakdown["rescaling"]
        v_queries = 2 if d == 1 else 2 + (d - 1) * (24 + 48)
        assert result.queries == (v_queries + d * d * 37 + extra
                                  + label_check_count(d, v_queries + d * d * 37))


def test_sign_only_verify_sequences_buys_more_labels_and_coverage():
    """--verify-sequences N (oracle.verify_sequences) holds for labels too: N labels, a
    fifth of them hinge labels, and the coverage they buy stated per family."""
    oracle = Oracle(SignOnly(random_single_head(4, seed=0)), 4)
    oracle.verify_sequences = 400
    v = extract_sign_only(oracle, seed=0).report.verification
    assert v.sequences == 400 and v.family_sequences["hinge"] == 80
    assert v.coverage["all"] < 0.01 and v.coverage["hinge"] < 0.04


@pytest.mark.parametrize("threshold", [0.3, -0.7, 2.0, -50.0])
def test_sign_only_nonzero_threshold_recovers_the_scale(threshold):
    """With a known threshold t != 0 the crossing of lam v^T x = t fixes |v|: v and W exact."""
    for d in (1, 3, 8):
        for seed in range(3):
            target = random_single_head(d, seed=seed)
            result = extract_sign_only(Oracle(SignOnly(target, threshold), d), threshold=threshold,
                                       seed=seed)
            details = result.report.details
            assert np.linalg.norm(result.model.v - target.v) <= details["error_bar_v"]
            assert np.linalg.norm(result.model.W - target.W) <= details["error_bar_W"]
            assert rel_err(result.model.v, target.v) <= 1e-12
            # a threshold far beyond |v| needs large offsets, hence small probes: less precise
            assert rel_err(result.model.W, target.W) <= (1e-8 if abs(threshold) <= 2 else 1e-6)
            assert "with their scale" in result.report.notes[0]


def test_sign_only_hostile_and_errors():
    for name, target in hostile_single_heads(6, 1).items():
        result = extract_sign_only(Oracle(SignOnly(target), 6), seed=0)
        assert np.linalg.norm(result.model.W - target.W) <= result.report.details["error_bar_W"], name
    with pytest.raises(NotIdentifiableError):
        extract_sign_only(Oracle(SignOnly(SingleHeadAttention(np.eye(3), np.zeros(3))), 3))
    with pytest.raises(ModelMismatchError, match="labels"):
        extract_sign_only(Oracle(random_single_head(3, seed=0), 3))
    with pytest.raises(InputError):
        extract_sign_only(Oracle(SignOnly(random_single_head(3, seed=0)), 3), threshold=float("nan"))
    with pytest.raises(InputError):
        extract_sign_only(Oracle(SignOnly(random_single_head(3, seed=0)), 3), bits=2)


# -- CLI ------------------------------------------------------------------------------

TARGET_FILE = """
from attnextract.oracle import BoundedNoise, SignOnly
from attnextract.adapters.targets import random_single_head
_m = random_single_head(6, seed=11)
noisy = BoundedNoise(_m, 1e-6, "sign", seed=0)
labels = SignOnly(_m)
labels_at = SignOnly(_m, 0.25)
"""


def extract_in(tmp_path, *args):
    """``attnextract extract`` run in tmp_path (where t.py holds the targets)."""
    (tmp_path / "t.py").write_text(TARGET_FILE)
    env = dict(os.environ)
    src = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")
    env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
    # one --out for several black boxes: no journal (a journal beside it would refuse them)
    return run_cli("extract", "--dim", "6", "--out", tmp_path / "r.npz", "--json", "--no-journal",
                   *args, cwd=tmp_path, env=env, timeout=120)


@pytest.mark.slow
def test_cli_tolerance_paper_and_sign_only(tmp_path):
    target = random_single_head(6, seed=11)
    proc = extract_in(tmp_path, "--target", "t.py:noisy", "--tolerance", "1e-6")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["ok"] and out["queries"] == 42 + verification_count(42, 42)
    assert np.linalg.norm(np.load(tmp_path / "r.npz")["W"] - target.W) <= out["details"]["error_bar_W"]

    proc = extract_in(tmp_path, "--target", "t.py:noisy", "--tolerance", "1e-6", "--noise-method", "paper",
                   "--norm-bound", "10")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["details"]["method"].startswith("the single-head paper")

    proc = extract_in(tmp_path, "--target", "t.py:noisy", "--tolerance", "1e-6", "--noise-method", "paper")
    assert proc.returncode == 2 and "norm_bound" in proc.stderr

    proc = extract_in(tmp_path, "--target", "t.py:noisy")          # exact-data check: mismatch
    assert proc.returncode == 1

    proc = extract_in(tmp_path, "--target", "t.py:labels", "--sign-only", "--bits", "30")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert "positive scale" in out["notes"][0]
    v = np.load(tmp_path / "r.npz")["v"]
    assert np.linalg.norm(v - target.v / np.linalg.norm(target.v)) < 1e-12

    proc = extract_in(tmp_path, "--target", "t.py:labels_at", "--sign-only", "--threshold", "0.25",
                   "--bits", "30")
    assert proc.returncode == 0, proc.stderr
    assert np.linalg.norm(np.load(tmp_path / "r.npz")["v"] - target.v) < 1e-12


def test_adversary_against_the_learners_own_estimate():
    """The adversary knows what the learner will predict (its estimate from a first run)
    and pushes every answer away from it; the worst-case bar must still hold."""
    d, tau = 8, 1e-5
    for seed in range(4):
        target = random_single_head(d, seed=seed)
        first = extract_noisy(Oracle(BoundedNoise(target, tau, "sign", seed=seed), d),
                              tolerance=tau, seed=seed)
        for against in (first.model, SingleHeadAttention(first.model.W, target.v)):
            box = AdversarialNoise(target, tau, against=against)
            result = extract_noisy(Oracle(box, d), tolerance=tau, seed=seed)
            (eW, ev), (bW, bv) = errors(result, target), bars(result)
            assert eW <= bW and ev <= bv


def test_noise_model_bound_covers_the_observed_side(rng):
    """|eta| <= tau + rho |f| must be covered by the bound computed from y = f + eta."""
    model = NoiseModel(1e-3, 0.1)
    f = rng.standard_normal(10_000) * 10.0 ** rng.uniform(-6, 3, 10_000)
    eta = rng.choice([-1.0, 1.0], f.size) * (1e-3 + 0.1 * np.abs(f))
    assert np.all(np.abs(eta) <= model.bound(f + eta))


def test_budget_is_checked_before_any_query():
    from attnextract import BudgetExceededError
    target = random_single_head(4, seed=0)
    need = 3 * 20 + verification_count(20, 3 * 20)
    oracle = Oracle(GaussianNoise(target, 1e-6, seed=0), 4, budget=need - 1)
    with pytest.raises(BudgetExceededError):
        extract_noisy(oracle, tolerance=1e-6, noise="random", repeats=3)
    assert oracle.queries == 0
    oracle = Oracle(SignOnly(target), 4, budget=100)
    with pytest.raises(BudgetExceededError):
        extract_sign_only(oracle)
    assert oracle.queries == 0
    result = extract_noisy(Oracle(GaussianNoise(target, 1e-6, seed=0), 4, budget=need),
                           tolerance=1e-6, noise="random", repeats=3)
    assert result.queries == need
