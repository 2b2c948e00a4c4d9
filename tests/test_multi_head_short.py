"""Short probes of the multi-head learner (``precision="full"``, float64 answers).

The rest of paper 2's count goes to two-token probes on fresh rows, then the joint
polish runs over every answer. Query counts are exact; the error is compared with the
same run without short probes (its wide columns), with a margin far from the last bits.
"""

import numpy as np

import attnextract.learners.multi_head as multi_head
from attnextract import Oracle
from attnextract.adapters.targets import random_multi_head
from attnextract.learners.multi_head import canonical_error, extract_multi_head, paper2_count
from attnextract.oracle import RoundedOutputs
from attnextract.report import verification_count


def test_short_probes_lower_the_error_within_paper2_count(monkeypatch):
    d, H, seed = 8, 4, 1
    target = random_multi_head(H, d, seed=10_000 * H + 100 * d + seed, w_scale=1 / np.sqrt(d))
    oracle = Oracle(target, d)
    result = extract_multi_head(oracle, heads=H, seed=seed)
    b, det = result.report.breakdown, result.report.details
    # every short probe is one query; d per round-robin of the rows, all that paper 2's
    # count leaves after the verification (less than one more per row)
    assert det["short probes"].endswith("kept")
    assert b["short probes"] > 0 and b["short probes"] % d == 0
    assert b["recovery"] + verification_count(H * (d * d + d)) == oracle.queries
    assert paper2_count(H, d) - d < oracle.queries <= paper2_count(H, d)
    error = canonical_error(result.model, target)
    assert error <= det["error bar"]

    # the same run without them: the wide columns take the count
    # the budget reads it (the base stage's share, the short probes' need per row)
    monkeypatch.setattr(multi_head.budget, "SHORT_OVERSAMPLE", np.inf)
    plain = extract_multi_head(Oracle(target, d), heads=H, seed=seed)
    assert "short probes" not in plain.report.breakdown
    assert error < canonical_error(plain.model, target) / 2     # measured 3.6x


def test_fast_precision_and_rounded_answers_send_no_short_probes():
    d, H = 4, 2
    target = random_multi_head(H, d, seed=3)
    fast = extract_multi_head(Oracle(target, d), heads=H, seed=0, precision="fast")
    assert "short probes" not in fast.report.breakdown
    assert "short probes" not in fast.report.details
    rounded = extract_multi_head(Oracle(RoundedOutputs(target), d), heads=H, seed=0)
    assert rounded.report.details["short probes"] == "skipped (rounded answers)"
    assert "short probes" not in rounded.report.breakdown
    assert canonical_error(rounded.model, target) <= rounded.report.details["error bar"]


def test_even_height_rows_have_equal_heights_and_span():
    rng = np.random.default_rng(0)
    for d, H in [(8, 6), (8, 8), (16, 3)]:
        V = rng.standard_normal((d, H))
        U = multi_head.design.even_height_rows(V, rng)
        heights = U @ (V / np.linalg.norm(V, axis=0))
        assert np.allclose(np.abs(heights), 1.0)
        assert np.linalg.cond(U) < 1e3
