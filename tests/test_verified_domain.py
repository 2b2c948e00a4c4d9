"""The verified domain is what was measured: a token norm or a length counts only where
a held-out sequence gave such tokens real attention weight (or made them the query
token) and the answer was compared; the held-out set puts weight on tiny and large
tokens, and the report states the domain."""

from __future__ import annotations

import math

import numpy as np
import pytest

from attnextract import Oracle
from attnextract.adapters.targets import random_multi_head, random_single_head
from attnextract.models import MultiHeadAttention
from attnextract.report import Report, verify_model
from attnextract.verification import (
    WEIGHT_SHARE,
    design,
    token_norms,
    verified_domain,
    weighted_tokens,
)

D = 8


def _weights(model, X):
    s = X @ (model.W @ X[-1])
    a = np.exp(s - s.max())
    return a / a.sum()


def test_a_token_without_weight_is_not_in_the_domain_but_the_query_token_is():
    model = random_single_head(D, seed=0)
    rng = np.random.default_rng(0)
    X = 0.5 * rng.standard_normal((6, D))
    w = model.W @ X[-1]
    big = -1e3 * w / np.linalg.norm(w)          # a huge token whose score is far below
    X[0] = big
    assert _weights(model, X)[0] < 1e-12
    keep = weighted_tokens(model, X)
    assert not keep[0] and keep[-1]
    (_, hi), reach = verified_domain(model, [X])
    assert hi < 100 and reach <= 5              # the huge token is not verified
    # the same token as the query token counts
    (_, hi), _ = verified_domain(model, [np.vstack([X[1:], big[None]])])
    assert hi >= 999


def test_an_even_spread_over_a_long_sequence_is_read_in_full():
    model = MultiHeadAttention(np.zeros((2, D, D)), np.ones((2, D)))
    X = np.random.default_rng(1).standard_normal((4096, D))
    assert 1.0 / 4096 < WEIGHT_SHARE and weighted_tokens(model, X).all()
    assert verified_domain(model, [X])[1] == 4096


def test_the_norms_family_puts_weight_on_tiny_and_large_tokens():
    for d, model in ((8, random_single_head(8, seed=2)), (16, random_multi_head(3, 16, seed=2))):
        held = design(d, 64, np.random.default_rng(3), 0.5, model=model)
        norms = [x for x, f in zip(held.sequences, held.family) if f == "norms"]
        typical = 0.5 * math.sqrt(d)
        read = [x[weighted_tokens(model, x)] for x in norms]
        smallest = min(float(np.linalg.norm(r, axis=1).min()) for r in read)
        largest = max(float(np.linalg.norm(r, axis=1).max()) for r in read)
        assert smallest < 1e-1 * typical and largest > 1e2 * typical
        # a tiny token carries most of some sequence's weight (as a key, not the query)
        heavy = []
        for x in norms:
            W = model.W if model.W.ndim == 2 else model.W[0]
            a = _weights(type("H", (), {"W": W})(), x)
            small = np.linalg.norm(x, axis=1) < 1e-1 * typical
            small[-1] = False
            heavy.append(float(a[small].sum()) if small.any() else 0.0)
        assert max(heavy) > 0.25


def test_the_report_states_the_domain_read_and_sent():
    model = random_single_head(D, seed=4)
    check = verify_model(Oracle(model, D), model, count=64, seed=0)
    assert check.passed
    lo, hi = check.norms
    sent_lo, sent_hi = check.norms_sent
    assert sent_lo <= lo < hi <= sent_hi
    report = Report(kind="single-head", dim=D, queries=64, floor=72, breakdown={}, seconds=0.0,
                    black_box_seconds=0.0, verification=check)
    assert "tokens the answers read" in report.render()
    out = report.to_dict()["verification"]
    assert out["norms"] == [lo, hi] and out["norms_sent"] == [sent_lo, sent_hi]
    assert token_norms([np.ones((1, D))])[0] == math.sqrt(D)


def test_coverage_is_stated_per_family_and_more_sequences_buy_a_stronger_one():
    from attnextract.report import coverage_share, draws_for_coverage
    assert abs(coverage_share(24) - (1 - 0.05 ** (1 / 24))) < 1e-15
    assert draws_for_coverage(coverage_share(59)) == 59
    model = random_single_head(D, seed=5)
    small = verify_model(Oracle(model, D), model, count=64, seed=0)
    oracle = Oracle(model, D)
    oracle.verify_sequences = 640
    large = verify_model(oracle, model, count=64, seed=0)
    assert small.passed and large.passed and large.sequences >= 640
    for name, n in small.family_sequences.items():        # re-asks are not draws
        assert small.coverage.get(name, coverage_share(n)) == coverage_share(n)
    assert "batch re-asks" not in small.coverage
    assert small.family_sequences["all"] + small.family_sequences["batch re-asks"] == small.sequences
    assert large.coverage["ordinary"] < small.coverage["ordinary"] / 4
    report = Report(kind="single-head", dim=D, queries=64, floor=72, breakdown={}, seconds=0.0,
                    black_box_seconds=0.0, verification=small)
    assert "95% confidence" in report.render(verbose=True)
    assert report.to_dict()["verification"]["coverage"] == small.coverage


@pytest.mark.parametrize("d", [8, 16])
def test_a_region_of_five_percent_is_refused_or_honestly_reported(d):
    """A deviation on about 5% of inputs (a cone of query tokens): a small check may miss
    it, and then its report must not claim a coverage that would have caught it; a
    check bought to cover 1% refuses it."""
    from attnextract.testing.impostors import Cone
    from attnextract.report import draws_for_coverage
    for seed in range(3):
        model = random_single_head(d, seed=seed)
        box = Cone(model, np.random.default_rng(seed), 0.05)
        small = verify_model(Oracle(box, d), model, count=24, seed=seed)
        assert not small.passed or small.coverage["all"] > 0.05
        oracle = Oracle(box, d)
        oracle.verify_sequences = draws_for_coverage(0.01) * 4 // 3   # a batch share apart
        large = verify_model(oracle, model, count=24, seed=seed)
        assert large.coverage["all"] <= 0.01 and not large.passed


def test_cli_verify_sequences_buys_the_stated_coverage(tmp_path):
    import json

    from conftest import run_cli
    target = tmp_path / "box.py"
    target.write_text("from attnextract.adapters.targets import random_single_head\n"
                      "box = random_single_head(4, 1)\n")
    proc = run_cli("extract", "--target", f"{target}:box", "--dim", 4, "--out",
                   tmp_path / "r.npz", "--json", "--no-progress", "--no-journal",
                   "--verify-sequences", 400, check=0, timeout=120)
    check = json.loads(proc.stdout)["verification"]
    drawn = check["family_sequences"]
    assert check["sequences"] >= 400
    assert drawn["all"] + drawn["batch re-asks"] == check["sequences"]
    assert check["coverage"]["all"] < 0.01
