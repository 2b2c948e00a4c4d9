"""Multi-head boxes whose base rows crowd or hide a head (grid boxes that were refused
or missed 1e-10: d = 8, H = 8 and d = 16, H = 8 and 10 at W scale 3).

A crowded base row pins two close steps to 1e-6 to 1e-4, so its perturbations gave
W_h q_0 0.3 to 50 times off; a head whose height is small in a row and whose step falls
near another's hides in that row, and two such rows agreed on one head too few.
"""

from __future__ import annotations

import numpy as np
import pytest

import attnextract.learners.multi_head as multi_head
from attnextract import Oracle
from attnextract.adapters.targets import random_multi_head
from attnextract.learners.multi_head import canonical_error, extract_multi_head, paper2_count
from attnextract.learners.multi_head.design import least_uncertain_row
from test_multi_head_float32 import _base_stage


def _grid_box(d, H, scale, seed):
    """The box of benchmarks/bench_multi_head.py's cell (d, H, scale), target seed."""
    box = random_multi_head(H, d, seed=10_000 * H + 100 * d + seed, w_scale=scale / np.sqrt(d))
    box.truth = box
    return box


def _true_columns(run, box):
    """W_h q_0 (d, H) in the base row's labels (its steps in position order)."""
    Y = np.einsum("hij,j->ih", box.W, run.q_0)
    return Y[:, np.argsort(run.u_0 @ Y)]


def test_least_uncertain_row_places_only_the_pinned_heads():
    """H = d: a row placing every head is fixed by the estimate, so two columns 50x off
    steer the whole row. Placing only the pinned heads: those hit their positions, and
    the row does not depend on the other columns' estimates at all."""
    rng = np.random.default_rng(4)
    d = H = 8
    Y0, V = rng.standard_normal((d, H)), rng.standard_normal((d, H))
    cov = np.eye(d)
    positions = np.linspace(-4.0, 4.0, H)
    pinned = np.arange(H) < 6
    u = least_uncertain_row(Y0, V, cov, positions, np.random.default_rng(0), jitter=0.3,
                            placed=pinned)
    off = u @ Y0[:, pinned]
    assert np.all(np.min(np.abs(off[:, None] - positions[None]), axis=1) <= 0.3 + 1e-9)
    wrong = Y0.copy()
    wrong[:, ~pinned] *= 50.0
    again = least_uncertain_row(wrong, V, cov, positions, np.random.default_rng(0),
                                jitter=0.3, placed=pinned)
    assert np.array_equal(u, again)


def test_crowded_base_row_estimate_is_refined(monkeypatch):
    """d = H = 8, s = 3, seed 4: the first base row's close steps (0.07 apart) left
    W_h q_0 predicted 0.4 off (two columns near 1: no guide to a design). A row
    placing only the pinned heads, perturbed again, brings the estimate below
    RECENTRE_ABOVE, and the truth within 10x of that prediction. (Seed 9, whose two
    close steps have opposite heights 0.006 apart, does so under five of the eight
    kernel and SIMD configurations of benchmarks/check_kernels.py only: not a test.)"""
    d, H, seed, learner_seed = 8, 8, 4, 503014685
    box = _grid_box(d, H, 3.0, seed)
    run = _base_stage(monkeypatch, box, H, learner_seed).run
    Y0, _ = run.base_estimate()
    det = run.details
    assert det["base estimate relative error (first row)"] > 0.1
    predicted = det["base estimate relative error"]
    assert predicted <= multi_head.RECENTRE_ABOVE
    actual = np.linalg.norm(Y0 - _true_columns(run, box), axis=0) / np.linalg.norm(Y0, axis=0)
    assert np.max(actual) <= 10 * predicted
    # within paper 2's count, with room for the main rows and the verification
    assert run.affordable(run.main_cost(H), H)


def test_told_count_below_h_needs_more_rows(monkeypatch):
    """d = 16, H = 8, s = 3: in each of the first two base rows one head has a height
    below 1e-2 of the others and its step sits within 0.07 of another's, so both rows fit
    7 steps to the noise; told 8 heads, two such rows no longer settle a count below 8
    (further rows show the eighth step)."""
    box = _grid_box(16, 8, 3.0, 10)
    stage = _base_stage(monkeypatch, box, 8, 1155106621)
    assert stage.heads == 8, stage.run.details["head counts of the base rows"]


@pytest.mark.slow
def test_grid_box_with_a_hidden_head_is_recovered():
    """The box of test_told_count_below_h_needs_more_rows, whole: refused on main (7
    heads counted, no design of 7 steps fits), now within 1e-10 and paper 2's count.
    (d = 8, H = 8, s = 3 seed 4, 2.2e-10 on main and 4.5e-11 now, misses 1e-10 with
    numpy's SIMD up to X86_V3: the crowded d = H = 8 boxes stay near 1e-10.)"""
    d, H, seed, learner_seed = 16, 8, 10, 1155106621
    box = _grid_box(d, H, 3.0, seed)
    result = extract_multi_head(Oracle(box, d), heads=H, seed=learner_seed)
    assert canonical_error(result.model, box) <= 1e-10
    spent = result.report.breakdown["recovery"] + result.report.breakdown["verification"]
    assert spent <= paper2_count(H, d) == 4 * H * d * d - 2 * H + 1
