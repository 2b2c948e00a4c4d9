"""Multi-head without heads=: the count from rows that agree, quick refusals that suggest
--heads; float32 PyTorch modules at H = 4, with the dtype stated or detected (issue 22,
items 3 and 4)."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import grid

from attnextract import Oracle
from attnextract.adapters.targets import random_multi_head
from attnextract.errors import ModelMismatchError, RecoveryFailedError
from attnextract.learners.multi_head import canonical_error, extract_multi_head, paper2_count
from attnextract.learners.multi_head.base_row import _agreed_count, _more_lambdas
from attnextract.learners.multi_head.budget import _scan_size
from attnextract.learners.multi_head.constants import COUNT_MARGIN, MORE_STEPS_VOTES, SCALE_ROUNDS
from attnextract.learners.multi_head.design import base_lambdas, copy_counts, realised_lambda
from attnextract.models import MultiHeadAttention


def test_agreed_count_is_the_largest_count_two_rows_give():
    assert _agreed_count([3, 4, 4, 3, None]) == 4
    assert _agreed_count([2, 3, None, 5]) is None
    assert _agreed_count([None, None]) is None
    assert _agreed_count([0, 0, 1]) == 0


def test_a_scan_grows_by_the_larger_grid_points_it_lacks():
    """A row scanned for k steps and then for k + 1 keeps its samples and gets the larger
    grid's points it has no copy count for, farthest first: nothing measured twice, no gap
    wider than the smaller grid's spacing, the same length as the larger grid."""
    length, half = 2048, np.log(2047)
    assert np.array_equal(_more_lambdas(np.zeros(0), 12, half, length), base_lambdas(12, half))
    measured = realised_lambda(copy_counts(base_lambdas(12, half), length), length)
    for size in (16, 20, 40):
        more = _more_lambdas(measured, size, half, length)
        assert more.size == size - measured.size
        both = np.sort(np.append(measured, more))
        assert not set(copy_counts(more, length)) & set(copy_counts(measured, length))
        assert np.all(np.abs(more) <= half)
        assert np.max(np.diff(both)) <= np.max(np.diff(measured)) + 1e-12
    assert _more_lambdas(measured, 12, half, length).size == 0


@pytest.mark.parametrize("seed,scale", [(s, w) for s in grid(range(10), range(2))
                                        for w in grid((1, 3), (1,))])
def test_one_head_counted_at_about_a_told_runs_cost(seed, scale):
    """d = 8, H = 1 (the grid's boxes): the count search's scans held 4 x 8 + 8 = 40
    samples (sized for 8 heads), 1.28x (up to 1.54x) the queries of a run told H = 1 on
    the same box. A scan now holds the samples of the count it shows plus COUNT_MARGIN
    steps: only the base scans cost more than told (the rows must agree without H, where
    a told run may accept one), and the run stays within 1.15x of the told one."""
    d = 8
    box = random_multi_head(1, d, seed=10_000 + 100 * d + seed, w_scale=scale / np.sqrt(d))
    told = extract_multi_head(Oracle(box, d), heads=1, seed=seed)
    free = extract_multi_head(Oracle(box, d), seed=seed)
    assert free.model.heads == 1
    assert canonical_error(free.model, box) <= 1e-10
    # the wide columns (d probes each) take what paper 2's count leaves after the rest
    base = ("base scale", "base rows", "recovery", "main wide columns")
    later = lambda r: {k: n for k, n in r.report.breakdown.items() if k not in base}
    assert later(free) == later(told)
    assert free.report.queries <= 1.15 * told.report.queries
    wide = lambda r: r.report.breakdown.get("main wide columns", 0)
    assert told.report.queries <= paper2_count(1, d) and wide(told) % d == 0
    if (free.report.details["head counts of the base rows"] == [1, 1]   # the first rows agree
            and free.report.breakdown["base rows"] == _scan_size(1 + COUNT_MARGIN)):
        # (each read at the first size: a row whose 1-step fit first missed grows its scan)
        # the search's 3 x 4 COUNT_MARGIN more base samples leave fewer wide columns
        assert (free.report.queries - wide(free)
                == told.report.queries - wide(told) + 3 * 4 * COUNT_MARGIN)
        assert free.report.queries <= paper2_count(1, d)


def test_more_heads_than_searched_is_refused_after_a_few_rows(seed=0):
    """Ten heads at d = 8 (the search goes up to min(d, 12) = 8): rows that fit no count
    up to 8 agree that the box has more, so the search stops after MORE_STEPS_VOTES of
    them (it scanned all 14 of paper 2's share before) and the refusal says that more
    than d heads are beyond the learner (it suggested --heads, which heads > d refuses)."""
    d = 8
    oracle = Oracle(random_multi_head(10, d, seed=seed), d)
    with pytest.raises((ModelMismatchError, RecoveryFailedError)) as refusal:
        extract_multi_head(oracle, seed=seed)
    assert "beyond this learner" in str(refusal.value)
    assert "give heads=" not in str(refusal.value)
    scan = 4 * 8 + 8
    assert oracle.queries <= d + (SCALE_ROUNDS + MORE_STEPS_VOTES) * scan


def test_count_found_without_heads_within_the_queries_of_a_told_run():
    """Not told H, the count is the one two base rows agree on (the report lists every
    row's count), and the run spends at most 1.5x the queries of a run told H."""
    d, H = 8, 3
    box = random_multi_head(H, d, seed=100)
    told = extract_multi_head(Oracle(box, d), heads=H, seed=5)
    free = extract_multi_head(Oracle(box, d), seed=5)
    assert told.model.heads == free.model.heads == H
    assert free.report.details["head counts of the base rows"].count(H) >= 2
    assert canonical_error(free.model, box) <= 1e-10
    assert free.report.queries <= 1.5 * told.report.queries


def _torch_box(seed, heads, dtype):
    import torch
    from attnextract.adapters.torch_target import TorchAttentionBlackBox, merged_head_parameters
    torch.manual_seed(seed)
    module = torch.nn.MultiheadAttention(16, heads, bias=False, batch_first=True)
    box = TorchAttentionBlackBox(module, readout=seed, dtype=dtype)
    W, v = zip(*(merged_head_parameters(module, box.readout, h) for h in range(heads)))
    return box, MultiHeadAttention(np.array(W), np.array(v))


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1])
def test_float32_torch_module_with_four_heads(seed):
    """nn.MultiheadAttention(16, 4) in PyTorch's float32: stated or detected, the heads
    come back within the stated bar, and a stated dtype gives the same model as the
    detected one (the thresholds follow the precision, not how it was learned); detection
    is said in the notes."""
    box, truth = _torch_box(seed, 4, None)
    stated = extract_multi_head(Oracle(box, 16), heads=4, seed=seed, output_dtype="float32")
    found = extract_multi_head(Oracle(box, 16), heads=4, seed=seed)
    for result in (stated, found):
        assert result.report.details["output precision"] == "float32"
        assert canonical_error(result.model, truth) <= result.report.details["error bar"] <= 1e-2
    assert any("detected as rounded to float32" in n for n in found.report.notes)
    assert np.array_equal(stated.model.W, found.model.W)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_stated_precision_too_coarse_for_the_steps_is_refused_after_the_single_tokens(dtype):
    """A stated bfloat16 / float16 forward pass: 30 times a base scan's rounding is 2.2 /
    0.28 of the answers, so no step can be told from the rounding. The learner refuses
    after the d single tokens, as its own limit (RecoveryFailedError, naming the
    precision), instead of returning a model with no heads that the held-out check then
    blamed on the box."""
    d = 8
    oracle = Oracle(random_multi_head(2, d, seed=7), d)
    with pytest.raises(RecoveryFailedError, match=r"too coarse for this learner") as refusal:
        extract_multi_head(oracle, heads=2, seed=0, output_dtype=dtype)
    assert dtype in str(refusal.value)
    assert oracle.queries == d


def test_rows_with_a_step_far_beyond_the_window_do_not_vote():
    """A row whose head sits far outside the window shows a sigmoid's tail, which spurious
    steps fit: its count does not vote. Steps up to WINDOW_MARGIN beyond the edge still
    show (float32 rows of 4 real steps at |t| = 9 to 12.4 with a window of 7.6)."""
    from types import SimpleNamespace
    from attnextract.learners.multi_head import _Extraction
    from attnextract.learners.multi_head.constants import WINDOW_MARGIN
    run = _Extraction.__new__(_Extraction)
    run.v, run.half_window = np.ones(8), 7.6
    row = lambda count, t, c: (count, np.ones(8), SimpleNamespace(t=np.array(t), c=np.array(c)), 1.0)
    rows = [row(1, [-6.1], [3.9]),
            row(3, [-3.5e6, -32.0, -14.1], [5.7, 18.3, 0.0]),     # far: no vote
            row(3, [-866.0, -15.0, -4.0], [45.5, 0.0, 0.0]),      # far: no vote
            row(1, [7.7], [-4.7]),
            row(4, [-9.5, -4.0, -1.5, 7.6 + WINDOW_MARGIN - 0.1], [1.0, 2.0, 1.0, 1.0]),
            row(2, [0.1, 7.6 + WINDOW_MARGIN + 0.1], [1.0, 1e-4])]  # a negligible far step
    assert run.votes(rows) == [1, 1, 4, 2]
    assert run.votes(rows, window=False) == [1, 3, 3, 1, 4, 2]


def test_one_head_whose_rows_mostly_miss_the_window_is_counted_as_one():
    """d = 8, H = 1, s = 3 (the grid's target seed 3) with a learner seed whose base rows
    put the head at |t| = 14 to 3.5e6 in most rows: two of them fitted 3 spurious steps and
    outvoted seven rows of 1 (refused, error bar inf). Not told H, the head comes back."""
    d = 8
    box = random_multi_head(1, d, seed=10_000 + 100 * d + 3, w_scale=3 / np.sqrt(d))
    result = extract_multi_head(Oracle(box, d), seed=770732276)
    assert result.model.heads == 1
    assert canonical_error(result.model, box) <= 1e-10


def _scan_of(t, c, noise, rng):
    """A base row's scan on the uniform grid of 28 samples (N = 2048): steps (t, c) and
    answers off by Gaussian noise of rms ``noise``."""
    from attnextract.learners.multi_head.fit import sigmoid_and_slope
    half = np.log(2047)
    lam = realised_lambda(copy_counts(base_lambdas(28, half), 2048), 2048)
    g = sigmoid_and_slope(np.asarray(t)[None, :] + lam[:, None])[0] @ np.asarray(c)
    return lam, g + noise * rng.standard_normal(lam.size), half


def test_a_row_with_a_duplicated_step_counts_one_fewer():
    """A row of 4 steps whose free fit of 4 ended in a wrong basin reads 5: its fit of 5
    has two steps on one logit, their heights not told from zero by the fit's own
    covariance. _fewest_steps refits 4 from it without one of them, which reaches the
    noise: the row counts 4, at the true steps. A row whose steps are all resolved is
    read as it stands (5 real steps stay 5; 4 steps fitted as 4 stay 4)."""
    from attnextract.learners.multi_head.base_row import _fewest_steps
    from attnextract.learners.multi_head.constants import NOISE_FACTOR
    from attnextract.learners.multi_head.fit import refit_steps
    rng = np.random.default_rng(3)
    t, c, noise = np.array([-6.9, -6.0, 0.76, 5.4]), np.array([0.03, 0.2, 0.17, 0.84]), 1e-6
    lam, g, half = _scan_of(t, c, noise, rng)
    fits = lambda steps: steps.rms <= NOISE_FACTOR * noise
    doubled = refit_steps(lam, g, c.sum(), np.sort(np.append(t, 0.74)), floor=noise)
    assert fits(doubled) and not np.all(np.abs(doubled.c) > 3 * doubled.c_std)
    fewest = _fewest_steps(lam, g, c.sum(), doubled, noise, fits)
    assert fewest.t.size == 4 and fits(fewest)
    assert np.max(np.abs(fewest.t - t)) < 1e-2
    four = refit_steps(lam, g, c.sum(), t, floor=noise)
    assert _fewest_steps(lam, g, c.sum(), four, noise, fits) is four
    t5, c5 = np.array([-6.0, -3.0, 0.0, 3.0, 6.0]), np.array([0.3, -0.2, 0.4, 0.25, -0.3])
    lam, g, half = _scan_of(t5, c5, noise, rng)
    five = refit_steps(lam, g, c5.sum(), t5, floor=noise)
    assert _fewest_steps(lam, g, c5.sum(), five, noise, fits).t.size == 5


@pytest.mark.parametrize("seed", [24] + grid(list(range(8)), [0]))
def test_float32_box_without_heads_finds_its_count(monkeypatch, seed):
    """A float32 forward pass (nn.MultiheadAttention's arithmetic, d = 16, H = 4) without
    heads=: the rows' counts agree on 4. Seed 24 is adversarial: two of its rows fitted
    5 steps (one a duplicate of another, from a wrong basin of the 4-step fit) and the
    largest count two rows shared was 5; every design of 5 heads then failed."""
    from test_multi_head_float32 import _base_stage
    from attnextract.adapters.targets import Float32MultiHeadBlackBox
    stage = _base_stage(monkeypatch, Float32MultiHeadBlackBox(4, 16, seed=seed), None, seed)
    assert stage.heads == 4, stage.run.details["head counts of the base rows"]


def _hide_a_head(monkeypatch):
    """Make the count search settle one head low by design: its result is read as the
    base row with its smallest-height step left out (a row that hid a head, as the rows
    of torch nn.MultiheadAttention(8, 8) trial 9 hid two: [7, 6, 6] agreed on 6), and
    every row it scanned as showing that count."""
    from attnextract.learners.multi_head import _Extraction, design, fit
    search = _Extraction.search_count

    def low(self):
        heads = search(self)
        keep = np.argsort(np.abs(self.base_fit.c))[1:]
        keep.sort()
        b = self.base_fit
        hidden = fit.StepFit(t=b.t[keep], c=b.c[keep], rms=b.rms, t_std=b.t_std[keep],
                             c_std=b.c_std[keep])
        self.adopt_base(self.u_0, hidden)
        self.count_rows = [(heads - 1, self.u_0, hidden)]
        self.spare_rows = []
        self.max_heads = self.count_level = heads - 1
        self.base_grid = design.base_lambdas(_scan_size(heads - 1), self.half_window)
        return heads - 1

    monkeypatch.setattr(_Extraction, "search_count", low)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_count_found_low_is_reopened_after_its_design_fails(monkeypatch, seed):
    """Not told H, base rows that agreed on one head too few (by construction) make a
    design of H - 1 steps fail; a scan measured after it (a missed column, the base row
    or a main row rescanned) shows H steps, and the run goes on under H's multi-head paper's count
    and recovers the box (before: refused, the refusal naming the learner's count)."""
    d, H = 8, 3
    box = random_multi_head(H, d, seed=300 + seed)
    _hide_a_head(monkeypatch)
    result = extract_multi_head(Oracle(box, d), seed=seed)
    details = result.report.details
    assert details["head count reopened"] == [(H - 1, H)]
    assert result.model.heads == H
    assert canonical_error(result.model, box) <= details["error bar"] <= 1e-6
    assert result.report.queries <= paper2_count(H, d)
    assert any("reopened" in note for note in result.report.notes)


def test_a_design_failing_at_the_right_count_does_not_raise_it(monkeypatch):
    """A not-told design that fails as a low count would (a base estimate refused) on a
    box whose count is right: the scans after it show no more steps, so the count stays,
    the retry recovers H heads (never more)."""
    from attnextract.learners.multi_head import _Extraction
    from attnextract.learners.multi_head.budget import _Redesign
    d, H = 8, 3
    box = random_multi_head(H, d, seed=300)
    estimate, calls = _Extraction.base_estimate, []

    def fails_once(self):
        calls.append(1)
        if len(calls) == 1:
            self.designed_column()
            raise _Redesign(RecoveryFailedError, "a base estimate refused (test)",
                            low_count=True)
        return estimate(self)

    monkeypatch.setattr(_Extraction, "base_estimate", fails_once)
    result = extract_multi_head(Oracle(box, d), seed=0)
    assert len(calls) == 2
    assert "head count reopened" not in result.report.details
    assert result.model.heads == H
    assert canonical_error(result.model, box) <= result.report.details["error bar"]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_rows_that_never_agree_give_the_count_of_their_best_pinned_row(monkeypatch, seed):
    """Not told H, base rows that never agree (d = 16, H = 8, W scale 3 gave [8, None x 5,
    6, None, 7, None]: most rows' steps beyond the window) were refused; a row within the
    window whose steps are pinned to PINNED_STEPS of their gap shows no more steps than
    the box has heads, so the largest such row gives the count. Here no two rows may
    agree (by construction): the run is recovered at H, never above it."""
    from attnextract.learners.multi_head import base_row
    monkeypatch.setattr(base_row, "_agreed_count", lambda counts: None)
    monkeypatch.setattr(base_row.BaseRowStage, "agreed", lambda self, found: None)
    d, H = 8, 3
    box = random_multi_head(H, d, seed=400 + seed)
    result = extract_multi_head(Oracle(box, d), seed=seed)
    assert result.model.heads == H
    assert canonical_error(result.model, box) <= result.report.details["error bar"] <= 1e-6
    assert any("no two base rows agreed" in note for note in result.report.notes)
