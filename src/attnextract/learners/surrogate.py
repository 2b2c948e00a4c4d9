"""The baseline users run today: a surrogate fitted to random query/answer pairs.

Model-stealing tools (Knockoff Nets, Tramer et al. 2016, ART's extraction attacks)
query the black box on random inputs and fit a model of the assumed class by
gradient-based optimisation. Here: a single-head attention model fitted by scipy's
L-BFGS to the mean squared output error on random sequences (lengths 1..16, tokens
N(0, d^{-1/2} I)), the same input distribution for training and held-out testing.

Gradients (one sequence, s_i = x_i^T W x_N, alpha = softmax(s), f = sum_i alpha_i x_i^T v):

    df/dv = sum_i alpha_i x_i,     df/dW = sum_i alpha_i (x_i^T v - f) x_i x_N^T
"""

from __future__ import annotations

import time

import numpy as np
from scipy.optimize import minimize

from ..models import SingleHeadAttention, softmax
from ..oracle import QueryAccess, by_length, evaluate_ragged
from ..report import (
    ExtractionResult,
    Report,
    Verification,
    held_out_sequences,
    relative_errors,
    verification_count,
)


def _loss_and_grad(theta, groups, targets, d):
    W, v = theta[: d * d].reshape(d, d), theta[d * d:]
    loss, gW, gv, count = 0.0, np.zeros((d, d)), np.zeros(d), len(targets)
    for idx, X in groups:
        last = X[:, -1, :]                                    # (B, d)
        alpha = softmax(np.einsum("bnd,bd->bn", X, last @ W.T))
        values = X @ v                                        # (B, N)
        f = np.einsum("bn,bn->b", alpha, values)
        r = f - targets[idx]
        loss += float(r @ r)
        gv += 2.0 * np.einsum("b,bn,bnd->d", r, alpha, X)
        g_scores = 2.0 * r[:, None] * alpha * (values - f[:, None])   # dL/ds (B, N)
        gW += np.einsum("bn,bnd,be->de", g_scores, X, last)
    return loss / count, np.concatenate([gW.ravel(), gv]) / count


def train_surrogate(oracle: QueryAccess, queries: int, *, seed=None, max_iter: int = 3000,
                    test_queries: int | None = None) -> ExtractionResult:
    """Fit a single head to ``queries`` random query/answer pairs by L-BFGS.

    Parameters
    ----------
    oracle : Oracle
        Door to the black box (width ``oracle.dim`` = d).
    queries : int
        Training queries (random sequences).
    test_queries : int, optional
        Held-out sequences for the reported output error (default max(64, 1% of d^2 + d)).

    Returns
    -------
    ExtractionResult
        The fitted :class:`SingleHeadAttention`; the report's ``verification`` is the
        held-out output error (the surrogate is a baseline: it is returned, pass or
        fail, and ``details`` gives the optimiser's final training loss).
    """
    start, q0, bb0 = time.perf_counter(), oracle.queries, oracle.black_box_seconds
    d = oracle.dim
    n_test = test_queries or verification_count(d * d + d)
    oracle.plan(queries + n_test, "surrogate training and testing")
    rng = np.random.default_rng(seed)
    scale = d ** -0.25
    train = held_out_sequences(d, queries, rng, scale)
    y = oracle.query_ragged(train)
    groups = by_length(train)
    theta0 = np.concatenate([0.01 * rng.standard_normal(d * d), np.zeros(d)])
    fit = minimize(_loss_and_grad, theta0, args=(groups, y, d), jac=True, method="L-BFGS-B",
                   options={"maxiter": max_iter, "maxfun": 2 * max_iter, "gtol": 1e-14,
                            "ftol": 1e-16})
    model = SingleHeadAttention(fit.x[: d * d].reshape(d, d), fit.x[d * d:])

    test = held_out_sequences(d, n_test, rng, scale)
    observed = oracle.query_ragged(test)
    err = relative_errors(evaluate_ragged(model, test), observed)
    verification = Verification(sequences=n_test, max_relative_error=float(err.max()),
                                median_relative_error=float(np.median(err)), tolerance=1e-3)
    report = Report(kind="surrogate", dim=d, queries=oracle.queries - q0,
                    breakdown={"training": queries, "verification": n_test},
                    floor=d * d + d, verification=verification,
                    seconds=time.perf_counter() - start,
                    black_box_seconds=oracle.black_box_seconds - bb0,
                    details={"training loss": float(fit.fun), "iterations": int(fit.nit),
                             "optimiser": f"L-BFGS-B: {fit.message}"})
    return ExtractionResult(model=model, queries=report.queries, report=report)
