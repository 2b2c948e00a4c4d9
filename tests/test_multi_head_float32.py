"""Multi-head on coarse answers (issue 22, item 4): float32 forward passes computed in
numpy (no torch needed) and answers rounded to a few decimals. Each test targets one
failure class measured on float32 ``nn.MultiheadAttention`` modules
(benchmarks/bench_float32_torch.py; the run is in the git history)."""

from __future__ import annotations

import numpy as np
import pytest

import attnextract.learners.multi_head as multi_head
from attnextract import Oracle, extract
from attnextract.adapters.targets import Float32MultiHeadBlackBox, random_multi_head
from attnextract.errors import RecoveryFailedError
from attnextract.learners.multi_head import canonical_error, extract_multi_head, paper2_count
from attnextract.report import verification_count
from attnextract.verification import verify_model


class _AfterBaseRow(Exception):
    """Raised in place of the designs: the run as it stands after the head count."""

    def __init__(self, run, heads):
        super().__init__(heads)
        self.run, self.heads = run, heads


def _base_stage(monkeypatch, box, heads, seed, **options):
    """The run after its base-row search (count and base row), no design measured."""
    def stop(run, found):
        raise _AfterBaseRow(run, found)
    monkeypatch.setattr(multi_head._Extraction, "attempts", stop)
    with pytest.raises(_AfterBaseRow) as stopped:
        extract_multi_head(Oracle(box, box.truth.W.shape[1]), heads=heads, seed=seed,
                           **options)
    return stopped.value


def test_float32_box_is_a_float32_forward_pass():
    box = Float32MultiHeadBlackBox(4, 16, seed=0)
    X = np.random.default_rng(0).standard_normal((64, 40, 16))
    y, exact = box(X), box.truth(X)
    assert y.dtype == np.float64 and np.array_equal(y.astype(np.float32), y)
    relative = np.abs(y - exact) / np.sqrt(np.mean(exact ** 2))
    assert 0 < np.max(relative) < 1e-5                 # rounded, and only by float32
    assert np.linalg.matrix_rank(box.truth.W[0]) == 4   # rank hd = d / H, as in PyTorch


@pytest.mark.slow        # 4 s: the hook's fast multi-head tests stay within 50 s
@pytest.mark.parametrize("seed", [18, 31])
def test_coarse_base_rows_see_every_head(monkeypatch, seed):
    """Base rows scaled by another row's spread showed too few float32 steps (the others
    sank below the rounding beyond the window or merged with a neighbour), and the
    count the rows agreed on was 3 (seed 18) or 1 (seed 31) of 4: every design then
    failed. Each row is now scanned at its own scale, and a row whose steps are pinned
    proves its count."""
    box = Float32MultiHeadBlackBox(4, 16, seed=seed)
    stage = _base_stage(monkeypatch, box, 4, seed, output_dtype="float32")
    assert stage.heads == 4, stage.run.details["head counts of the base rows"]
    run = stage.run
    assert run.coarse
    # the kept row's steps all inside the window, pinned to a fraction of their gap
    assert multi_head.base_row.base_quality(run.base_fit, run.half_window) <= multi_head.constants.PINNED_STEPS


@pytest.mark.slow
def test_unpinned_perturbation_keeps_the_estimate_finite(monkeypatch):
    """A perturbed base row with a step its samples do not pin has an infinite logit
    error; it reached LAPACK as NaN ("SVD did not converge") and cost a whole design.
    Such a step's error is bounded by the window: the predicted error stays finite."""
    box = Float32MultiHeadBlackBox(4, 16, seed=3)
    run = _base_stage(monkeypatch, box, 4, 3, output_dtype="float32").run
    real = multi_head.fit.refit_steps

    def unpinned(*args, **kwargs):
        steps = real(*args, **kwargs)
        steps.t_std[0] = np.inf
        return steps

    monkeypatch.setattr(multi_head.fit, "refit_steps", unpinned)
    Y0, V0, error = run.base_perturbations()
    assert np.isfinite(error) and np.all(np.isfinite(Y0)) and np.all(np.isfinite(V0))


def test_fine_answers_are_not_coarse(monkeypatch):
    """float64 answers keep the float64 path: no per-row rescans."""
    M = random_multi_head(2, 8, seed=1)
    M.truth = M
    stage = _base_stage(monkeypatch, M, 2, 1)
    assert not stage.run.coarse and stage.heads == 2


@pytest.mark.parametrize("seed", [1, 2])
def test_decimals_stay_within_paper2_count(seed):
    """--decimals 5 at d = 8, H = 2: the base-row search spent what paper 2's count left
    after the plan and then verified beyond it (543 of 509); it now reserves the
    held-out verification."""
    d, H = 8, 2
    M = random_multi_head(H, d, seed=seed)
    oracle = Oracle(lambda X: np.round(M(X), 5), d)
    result = extract_multi_head(oracle, heads=H, seed=seed, decimals=5)
    assert oracle.queries <= paper2_count(H, d)
    assert result.report.breakdown["verification"] >= verification_count(H * (d * d + d))
    assert canonical_error(result.model, M) <= result.report.details["error bar"]



@pytest.mark.parametrize("H", [2, 4])
def test_six_decimals_are_judged_in_the_box_units(H):
    """Answers rounded to 6 decimals are off by up to 5e-7 in the box's units, which no
    relative level states where answers are small (tokens of norm 1e-6 on the held-out
    check): in-class boxes were refused as mismatches (8 of 16 torch-initialised boxes
    at d = 8, H = 2 and 4) and the true model itself missed by 15.9 times the tolerance.
    Every box here is returned within its bar, and the truth passes the run's check."""
    d = 8
    for seed in range(4):
        M = random_multi_head(H, d, seed=100 * H + seed)
        oracle = Oracle(lambda X, M=M: np.round(M(X), 6), d)
        result = extract_multi_head(oracle, heads=H, seed=seed, decimals=6)
        assert canonical_error(result.model, M) <= result.report.details["error bar"]
        truth = verify_model(Oracle(lambda X, M=M: np.round(M(X), 6), d), M, count=300,
                             seed=seed, tolerance=1e-6, absolute_noise=0.5e-6)
        # the rounding alone reaches at most half of an allowance of twice it (without
        # the absolute term the truth missed by 34 to 237 times the tolerance)
        # (judged: each error scaled to its sequence's allowance)
        assert truth.judged_error <= 0.55 * truth.judged_tolerance, seed


@pytest.mark.slow        # about 40 s (d = 16, H = 4, up to three designs)
def test_traded_base_estimate_gives_way_to_a_fresh_design(monkeypatch):
    """Measured on float32 nn.MultiheadAttention, H = 4 (lowp4b trials 37, 55, 80): where
    two base steps lay about one logit apart, the base estimate traded their heights
    (predicted +-100 to +-260 against measured values below 15) and misplaced their
    positions; 10 to 15 of 16 main rows merged two steps, rows redesigned from that
    estimate merged again, and the row fits were singular (error bar inf). Here the
    first estimate is traded so on purpose: the design must give way to a fresh one, and
    the run must end within its bar or in a refusal that blames the learner and names
    the option, within paper 2's count."""
    d, H, seed = 16, 4, 0
    box = Float32MultiHeadBlackBox(H, d, seed=seed)
    original = multi_head._Extraction.base_estimate
    traded = []

    def traded_once(run):
        traded.append(run.oracle.queries)
        Y0, V0 = original(run)
        if len(traded) == 1:
            rng = np.random.default_rng(0)
            x, y = rng.standard_normal((2, d))
            x *= 20 * np.max(np.linalg.norm(V0, axis=0)) / np.linalg.norm(x)
            y *= 0.6 * np.max(np.linalg.norm(Y0, axis=0)) / np.linalg.norm(y)
            pair = np.array([1.0, -1.0] + [0.0] * (H - 2))
            V0, Y0 = V0 + np.outer(x, pair), Y0 + np.outer(y, pair)
        return Y0, V0

    monkeypatch.setattr(multi_head._Extraction, "base_estimate", traded_once)
    oracle = Oracle(box, d)
    try:
        result = extract(oracle, "multi-head", heads=H, seed=seed, output_dtype="float32")
    except RecoveryFailedError as exc:
        message = str(exc)
        assert "output-dtype" in message and "is not multi-head attention" not in message
        failures = message
    else:
        assert canonical_error(result.model, box.truth) <= result.report.details["error bar"]
        failures = result.report.details["failed designs"][0]
    # the traded estimate shows either in the base estimate's own check or as row fits
    # that do not pin the heads (under OpenBLAS Sandybridge); never as the box's fault
    assert ("the learner's base estimate failed" in failures
            or "the samples do not pin the heads down" in failures), failures
    assert "is not multi-head attention" not in failures
    assert len(traded) >= 2                        # a second design was measured
    assert oracle.queries <= paper2_count(H, d)


def test_overshot_scale_comes_back_between(monkeypatch):
    """Float32MultiHeadBlackBox(2, 16, seed=14): the first row's two steps sit 0.01 apart
    with opposite heights (the sum 0.0026) and were read as one step near 0; the scale
    that followed (1e3x) put both beyond the window and below float32's rounding, and the
    scale rounds, reading a flat row as too small tokens, grew it 30x each time: every
    row flat, 0 heads, refused as a held-out mismatch. A flat row above a scale that
    showed steps now overshot: the next scale lies between the two."""
    box = Float32MultiHeadBlackBox(2, 16, seed=14)
    stage = _base_stage(monkeypatch, box, 2, 14)
    run = stage.run
    assert stage.heads == 2, run.details["head counts of the base rows"]
    assert run.coarse and run.saw_steps
    assert run.details["base scale"] < 1e3        # between the shown 1 and the flat 1e3
    assert run.in_window((2, run.u_0, run.base_fit))


@pytest.mark.slow        # 1 s
def test_overshot_scale_box_is_recovered_within_its_bar():
    box = Float32MultiHeadBlackBox(2, 16, seed=14)
    result = extract_multi_head(Oracle(box, 16), heads=2, seed=14)
    assert canonical_error(result.model, box.truth) <= result.report.details["error bar"]


def test_rows_flat_after_steps_were_seen_blame_the_learner():
    """A box whose answers stay flat (g = 0) once any token is long, after the first
    scan showed steps: every row at the scale chosen is flat. Steps were seen, so the
    box has heads: the learner searches again (new rows and scales) while the count
    allows, then refuses as its own failure (RecoveryFailedError naming --output-dtype),
    never a model of no heads refused as a mismatch."""
    inner = Float32MultiHeadBlackBox(2, 16, seed=14)

    def box(X):
        X = np.asarray(X, dtype=np.float64)
        y = inner(X)
        long_tokens = np.max(np.linalg.norm(X, axis=2), axis=1) > 3.0
        last = (X[:, -1] @ inner.truth.v.sum(axis=0)).astype(np.float32).astype(np.float64)
        return np.where(long_tokens, last, y)

    oracle = Oracle(box, 16)
    with pytest.raises(RecoveryFailedError) as refused:
        extract_multi_head(oracle, heads=2, seed=14)
    message = str(refused.value)
    assert "--output-dtype" in message and "was not judged" in message
    assert "is not multi-head attention" not in message
    # the learner searched again by itself, within paper 2's count, and asks for no seed
    assert "seed" not in message and "every base row was flat" in message
    assert len(refused.value.result.report.details["count searches failed"]) >= 1
    assert oracle.queries <= paper2_count(2, 16)


def test_row_with_a_step_at_the_edge_is_scanned_again_inside(monkeypatch):
    """Float32MultiHeadBlackBox(4, 16, seed=15), not told H: 6 of 7 base rows hid a head
    (a height of 0.01 % to 2 % of the row's there, or two steps 0.04 to 0.45 apart), and
    the one row of 4 steps had its fourth (0.2 % of the heights) at 8.0, beyond the
    window's 6.2, too near the edge to be pinned: the rows agreed on 3 and every design
    failed. That row is now scanned again shorter, all four steps inside and pinned,
    and proves the count. (Which rows hide a head depends on the last bits: the rows
    give [3, 3, 4, 2, 3, 3, 3, 4] in 592 queries by default and under Haswell and numpy's
    SIMD up to X86_V3, [4, 4, 4, 2, 3, 3, 3, 4, 4, 4] in 448 under OpenBLAS's
    Sandybridge kernels; the count, the kept row and the room left do not.)"""
    box = Float32MultiHeadBlackBox(4, 16, seed=15)
    stage = _base_stage(monkeypatch, box, None, 15)
    run = stage.run
    assert stage.heads == 4 and run.coarse
    assert run.in_window((4, run.u_0, run.base_fit))
    assert multi_head.base_row.base_quality(run.base_fit, run.half_window) <= multi_head.constants.PINNED_STEPS
    assert run.affordable(run.attempt_cost(4, least=True), 4)


def test_best_conditioned_rows_beat_the_single_draw():
    """The row design measured on coarse answers is the best conditioned of several
    draws (scaled rows: U^-1 carries each row's relative error into every head); a
    single draw from the same generator state is one of them."""
    rng = np.random.default_rng(3)
    Y0, V0 = rng.standard_normal((8, 4)), rng.standard_normal((8, 4))
    Y0[:, 3] = Y0[:, 2] + 0.05 * Y0[:, 3]            # W_h q_0 nearly dependent: cond 60
    positions = multi_head.design.step_positions(4, 4.0)
    single = multi_head.design.design_rows(Y0, V0, positions, np.random.default_rng(5),
                                           jitter=1.0)
    best = multi_head.design.best_conditioned_rows(Y0, V0, positions,
                                                   np.random.default_rng(5), 32, jitter=1.0)
    assert np.array_equal(multi_head.design.design_rows(
        Y0, V0, positions, np.random.default_rng(5), jitter=1.0), single)
    condition = multi_head.design.row_design_condition
    assert condition(best) < 0.7 * condition(single)


@pytest.mark.parametrize("seed", [2, 5])
def test_float32_small_head_dim_within_the_default_tolerance(seed):
    """float32 forward pass, d = 8, H = 4 (head dim 2), told H: a row design measured
    as drawn (cond(U) up to 130) and a base search that spent 14 scans on rows never
    pinned to BASE_QUALITY left bars of 1.3e-2 to 9e-2, refused against the default
    9.5e-3 (seeds 2 and 5: 5.9e-3 and 4.0e-3 predicted). The best conditioned of
    COARSE_ROW_DRAWS designs is measured and the search ends at a row of 4 steps pinned
    to PINNED_STEPS, the queries left going to the wide columns
    (measured with benchmarks/check_f32_heads.py; the run is in the git history)."""
    box = Float32MultiHeadBlackBox(4, 8, seed=seed)
    oracle = Oracle(box, 8)
    result = extract_multi_head(oracle, heads=4, seed=seed)
    details = result.report.details
    error, bar = canonical_error(result.model, box.truth), details["error bar"]
    assert error <= bar <= 9.5e-3
    assert details["base scans"] < multi_head.constants.SCALE_ROUNDS + multi_head.constants.BASE_CANDIDATES
    assert oracle.queries <= paper2_count(4, 8)


def test_polish_predicting_more_than_the_row_fits_sets_the_bar():
    """Coarse answers: a joint polish not kept because it predicts a larger error than
    the row fits (2x to 2.5x in the runs whose error came nearest the bar, float32
    nn.MultiheadAttention, d = 8, H = 2, not told; one outside at 1.04x its bar) is a
    second estimate of the same uncertainty: the larger sets the bar
    (measured with benchmarks/check_f32_heads.py; the run is in the git history). Here 3.4e-4 to 3.9e-4 against 7.9e-5 to
    8.6e-5 under the OpenBLAS and SIMD configurations (a box where the polish predicts
    far more: seed 10's 1.65x fell below GROWTH = 1.5 under some, and the polish was kept)."""
    box = Float32MultiHeadBlackBox(2, 8, seed=16)
    result = extract_multi_head(Oracle(box, 8), seed=16)
    details = result.report.details
    polished = details["predicted relative error (polish, not kept)"]
    assert polished > details["predicted relative error (row fits)"]
    assert details["error bar"] == multi_head.constants.ERROR_BAR_FACTOR * polished
    assert canonical_error(result.model, box.truth) <= details["error bar"]
