"""The verified domain is what was measured: a token norm or a length counts only where
a held-out sequence gave such tokens real attention weight (or made them the query
token) and the answer was compared; the held-out set puts weight on tiny and large
tokens, and the report states the domain."""

from __future__ import annotations

import math

import numpy as np

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
