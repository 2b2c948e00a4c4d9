"""Exact single-head extraction at the d^2 + d floor (arXiv 2601.16873, Theorem 4.1).

Identities (docs/algorithms.md, "Single head"). For one token, f([x]) = v^T x. For the
length-2 probe P(u, q) = [q + u; q] the two scores differ by u^T W q, so

    f(P(u, q)) = v^T q + sigma(u^T W q) v^T u
    =>  u^T W q = logit((f - v^T q) / (v^T u)),     needs v^T u != 0.

Algorithm: v_i = f([e_i]) (d queries); then for an invertible U and
every column j, the d probes P(c u_k, s e_j) give T = c s U^T W, so W = U^{-T} T / (c s)
(d^2 queries). d^2 + d is the number of free parameters: no learner can do with
fewer queries on a generic target.

Conditioning. An output error delta becomes a logit error of about
delta / (|v^T u| a (1 - a)) with a = sigma(u^T W q), so we want |v^T u| large and
|u^T W q| of order one. U is the Householder reflection that maps v/|v| onto
+-(1, ..., 1)/sqrt(d): orthogonal (condition number 1) with |u_k^T v| = |v|/sqrt(d)
for every k, whatever zeros or tiny entries v has. The logit scale G = c s of each
block of columns is set from the columns already measured (the first column uses
a fixed guess); a column whose probes saturate is probed again at a smaller scale.
Those extra queries only happen when W is far larger than the first guess, and
the report counts them.

Biases (``biases=True``; docs/algorithms.md, "Biases"). A deployed head computes
f(X) = softmax(X (W x_N + b))^T X v + c. Then f([0]) = c, f([x]) = v^T x + c, and the
two scores of [q + u; q] differ by u^T (W q + b):

    c u^T b      = logit((f([c u; 0]) - c) / (c v^T u))            (q = 0)
    G u^T W e_j  = logit((f(P(c u, s e_j)) - c - s v_j) / (c v^T u)) - c u^T b.

So c (1 query), v (d), b (d probes [c u_k; 0]) and W (the d^2 probes above, minus the
known c u_k^T b) cost exactly d^2 + 2d + 1, the number of free parameters. The bias
term c u_k^T b is kept below BIAS_LOGIT by capping c (and enlarging s), so that its
rounding never swamps the logit of W.
"""

from __future__ import annotations

import logging
import math
import time

import numpy as np

from ..errors import ModelMismatchError, NotIdentifiableError
from ..models import BiasedSingleHeadAttention, SingleHeadAttention
from ..oracle import QueryAccess
from ..report import (
    DEFAULT_VERIFY_TOLERANCE,
    ExtractionResult,
    Report,
    checked_result,
    token_scale,
    verification_count,
    verify_model,
)
from ..verification import safe_norm

log = logging.getLogger(__name__)

FIRST_SCALE = 1.0 / 64     # logit scale of the first column, before anything is known
TARGET_LOGIT = 0.5         # aim for |u^T W q| about this large
MAX_LOGIT = 12.0           # beyond it a(1 - a) < 1e-5: probe again, smaller
MIN_FIRST_LOGIT = 2e-6     # below it the first column is probed again, larger
NOISE_LOGIT = 1e-12        # logits below it are rounding noise, not a scale
MAX_RESCALES = 6
MAX_GROWTH = 1e6          # largest one-step growth of a tiny first column's scale
BLOCK_FLOATS = 1 << 20     # probe floats per batch (8 MB: stays in cache)
SMALL_LOGIT = 1e-4 * TARGET_LOGIT   # a column this far below the target is probed again
GROW_FLOOR = np.finfo(float).eps   # ... and above one ulp (a 1e14 range is ~5e-15)
GROW_STEPS = 3
SMALL_ROW = 1e-4           # rows this much smaller than the largest are measured again
ROUNDING_SAFETY = 4.0      # rounding bars: this many ulps per operation, d operations
BIAS_LOGIT = 1.0           # biases: largest bias logit c |u_k^T b| in a probe of W


def constant_and_values(oracle: QueryAccess, biases: bool) -> tuple[float, np.ndarray]:
    """Length-1 identities f([x]) = x^T v + c in one batch: c = f([0]) (0 without
    ``biases``) and v (d,) from the d single tokens e_i. d queries, d + 1 with biases."""
    d = oracle.dim
    tokens = np.eye(d)[:, None, :]
    if not biases:
        return 0.0, oracle.query(tokens)
    out = oracle.query(np.concatenate([np.zeros((1, 1, d)), tokens]))
    return float(out[0]), out[1:] - out[0]


def probe_basis(v: np.ndarray) -> np.ndarray:
    """Orthogonal U (d, d) with u_k^T v = +-|v| / sqrt(d) for every column u_k.

    The Householder reflection I - 2 w w^T / (w^T w) that maps v/|v| onto
    c (1, ..., 1)/sqrt(d), with the sign c chosen against cancellation in w.
    """
    d = v.shape[0]
    unit = v / safe_norm(v)            # |v| of answers near 1e300 would overflow
    c = -1.0 if unit.sum() >= 0 else 1.0
    w = unit - c / np.sqrt(d)
    return np.eye(d) - (2.0 / (w @ w)) * np.outer(w, w)


def split_scale(scale: float | np.ndarray,
                max_c: float = np.inf) -> tuple[np.ndarray, np.ndarray]:
    """Split logit scales G = c s of probes P(c u, s q): (c, s), each of shape of ``scale``.

    c = 1, s = G for G <= 1; above, c is the power of two with s = G / c in (1/2, 1].
    q = s e_j stays small beside u, so neither v^T q nor q^T W q swamps the signal,
    and c changes (and c u is rescaled, exactly) only when G crosses a power of two.
    ``max_c`` (biases: the bias logit c u^T b grows with c) caps c; s = G / c then.
    """
    scale = np.asarray(scale, dtype=np.float64)
    c = np.where(scale > 1.0, 2.0 ** np.ceil(np.log2(np.maximum(scale, 1.0))), 1.0)
    c = np.minimum(c, max_c)
    return c, scale / c


def logit(y: np.ndarray) -> np.ndarray:
    """log(y / (1 - y)), accurate near y = 1/2 (where 2y - 1 and 1 - y are exact)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        upper = np.log1p((2.0 * y - 1.0) / (1.0 - y))
        lower = -np.log1p((1.0 - 2.0 * y) / y)
    return np.where(y >= 0.5, upper, lower)


def probe_pair(u: np.ndarray, q: np.ndarray) -> np.ndarray:
    """The length-2 probe P(u, q) = [q + u; q], shape (..., 2, d) for u, q of shape (..., d)."""
    return np.stack(np.broadcast_arrays(q + u, q), axis=-2)


class ColumnProbes:
    """Builds the probes P(c u_k, s e_j), all k, for a block of columns j.

    The logit scale G = c s is split by :func:`split_scale`.

    A block's probes differ from the previous block's only where the column marks
    s e_j sit (and where c changed), so one buffer (block, d, 2, d) is filled once
    and then patched: O(block * d) writes per block instead of O(block * d^2).
    """

    def __init__(self, U: np.ndarray, block: int, const: float = 0.0,
                 bias_logits: np.ndarray | None = None, max_c: float = np.inf):
        d = U.shape[0]
        self.U = U
        # biases: the output constant c and u_k^T b, subtracted from every answer/logit
        self.const, self.max_c = const, max_c
        self.bias_logits = np.zeros(d) if bias_logits is None else bias_logits
        self.X = np.empty((block, d, 2, d))
        self.X[:, :, 0, :] = U.T[None]
        self.X[:, :, 1, :] = 0.0
        self.c = np.ones(block)                 # c of each slot
        self.marked = np.full(block, -1)        # column marked in each slot, -1 for none

    def __call__(self, columns: np.ndarray, scale: np.ndarray) -> np.ndarray:
        """Probes for ``columns`` at logit scales ``scale``, shape (len(columns) * d, 2, d)."""
        X, U, n = self.X, self.U, len(columns)
        slots = np.arange(n)
        c, s = split_scale(scale, self.max_c)
        old = slots[self.marked[:n] >= 0]       # wipe the previous marks
        X[old, :, 0, self.marked[old]] = self.c[old, None] * U[self.marked[old], :]
        X[old, :, 1, self.marked[old]] = 0.0
        moved = slots[c != self.c[:n]]
        if moved.size:
            X[moved, :, 0, :] = c[moved, None, None] * U.T[None]
        self.c[:n], self.marked[:n] = c, columns
        X[slots, :, 0, columns] += s[:, None]   # token 1: c u_k + s e_j
        X[slots, :, 1, columns] = s[:, None]    # token 2: s e_j
        return X[:n].reshape(n * U.shape[0], 2, U.shape[0])


def column_logits(oracle: QueryAccess, probes: ColumnProbes, v: np.ndarray, columns: np.ndarray,
                  scale: np.ndarray) -> np.ndarray:
    """Measure t_kj = G_j u_k^T W e_j for the given columns, shape (d, len(columns)).

    Entries whose implied attention weight falls outside (0, 1) come back as NaN.
    """
    U = probes.U
    c, s = split_scale(scale, probes.max_c)
    f = oracle.query(probes(columns, scale)).reshape(len(columns), U.shape[0])
    weight = (f - probes.const - (v[columns] * s)[:, None]) / (c[:, None] * (U.T @ v)[None, :])
    inside = (weight > 0.0) & (weight < 1.0)
    t = np.where(inside, logit(np.where(inside, weight, 0.5)), np.nan)
    return (t - c[:, None] * probes.bias_logits[None, :]).T


def bias_logits(oracle: QueryAccess, U: np.ndarray, v: np.ndarray, const: float) -> tuple[np.ndarray, int]:
    """u_k^T b for every column u_k of U (d, n): probes [a u_k; 0] (q = 0), shape (n,).

    The logit of [a u; 0] is a u^T b, read from (f - c) / (a u^T v). The first round
    uses a = 1 (n queries); probes that saturate are asked again smaller and a round whose
    logits are all tiny (but above rounding) is asked again larger. Returns (u_k^T b,
    extra queries beyond the first n).
    """
    n = U.shape[1]
    vu = U.T @ v
    scale = np.ones(n)
    extra = 0

    def ask(rows):
        X = np.zeros((len(rows), 2, U.shape[0]))        # [a u_k; 0]: the query token is 0
        X[:, 0, :] = scale[rows, None] * U.T[rows]
        f = oracle.query(X)
        with np.errstate(divide="ignore", invalid="ignore"):
            weight = (f - const) / (scale[rows] * vu[rows])
        inside = (weight > 0.0) & (weight < 1.0)
        return np.where(inside, logit(np.where(inside, weight, 0.5)), np.nan)

    t = ask(np.arange(n))
    peak = float(np.max(np.abs(t))) if np.all(np.isfinite(t)) else np.inf
    if NOISE_LOGIT < peak < SMALL_LOGIT:            # b tiny beside the guess: grow once
        scale *= min(TARGET_LOGIT / peak, MAX_GROWTH)
        t = ask(np.arange(n))
        extra += n
    for _ in range(MAX_RESCALES):
        bad = np.flatnonzero(~(np.abs(t) <= MAX_LOGIT))
        if not bad.size:
            return t / scale, extra
        ok = np.isfinite(t[bad])
        scale[bad] *= np.where(ok, TARGET_LOGIT / np.abs(np.where(ok, t[bad], 1.0)), 2.0 ** -10)
        t[bad] = ask(bad)
        extra += bad.size
    raise ModelMismatchError(
        f"the black box is not a biased single-head attention regressor: after {MAX_RESCALES} "
        f"rescalings, {int(np.sum(~(np.abs(t) <= MAX_LOGIT)))} bias probe(s) [a u; 0] still "
        f"imply attention weights outside (0, 1)")


def extract_single_head(oracle: QueryAccess, *, seed=None,
                        verify_tolerance: float = DEFAULT_VERIFY_TOLERANCE,
                        biases: bool = False) -> ExtractionResult:
    """Recover (W, v) of a single-head attention black box with d^2 + d queries.

    Parameters
    ----------
    oracle : Oracle
        Door to the black box; ``oracle.dim`` is the token width d.
    seed : int, optional
        Seed of the held-out verification sequences.
    verify_tolerance : float
        Largest held-out relative output error accepted as a match. For outputs that
        are accurate to +-tolerance only, use ``attnextract.extract(oracle,
        tolerance=...)`` (the noisy learner, with error bars).
    biases : bool
        The head has query, value and output biases (a deployed layer):
        f(X) = softmax(X (W x_N + b))^T X v + c. Recovers (W, v, b, c) with
        d^2 + 2d + 1 queries (+ verification).

    Returns
    -------
    ExtractionResult
        ``model`` a :class:`SingleHeadAttention` with W (d, d) and v (d,) (with
        ``biases``: a :class:`BiasedSingleHeadAttention`, also b (d,) and c); ``queries``
        every query sent (recovery, any rescaling, verification).

    Raises
    ------
    NotIdentifiableError
        v = 0: the output never depends on W.
    ModelMismatchError
        The black box is not a single-head attention regressor (verification failed
        or its outputs imply attention weights outside (0, 1)); ``.result`` holds
        the best-effort extraction.
    BudgetExceededError
        The budget cannot cover recovery plus verification (raised before any query).
    """
    start, start_queries = time.perf_counter(), oracle.queries
    start_bb = oracle.black_box_seconds
    d = oracle.dim
    floor = d * d + 2 * d + 1 if biases else d * d + d
    n_verify = verification_count(floor, floor)    # within 5% of the recovery (d >= 32)
    oracle.plan(floor + n_verify, "single-head extraction (d^2 + d recovery + verification)"
                if not biases else "biased single-head extraction (d^2 + 2d + 1 + verification)")

    bias, bias_rescaled, max_c, beta = None, 0, np.inf, None
    if biases:
        log.info("biased single head at d = %d: c from f([0]), v from %d single tokens", d, d)
    else:
        log.info("single head at d = %d: v from %d single tokens", d, d)
    const, v = constant_and_values(oracle, biases)
    if not np.any(v):
        raise NotIdentifiableError(
            "v = 0: every output is zero whatever W is, so W cannot be identified")
    U = probe_basis(v)
    if biases:
        log.info("b from %d probes [a u_k; 0]", d)
        beta, bias_rescaled = bias_logits(oracle, U, v, const)
        bias = U @ beta
        peak_bias = float(np.max(np.abs(beta)))
        max_c = BIAS_LOGIT / peak_bias if peak_bias > 0 else np.inf
    log.info("W column by column: %d probes of length 2", d * d)
    W, scale, bars, rescaled = measure_weights(oracle, U, v, const, bias, beta, max_c)
    rescaled += bias_rescaled
    model = BiasedSingleHeadAttention(W, v, bias, const) if bias is not None else SingleHeadAttention(W, v)
    log.info("W recovered (%d columns re-probed); held-out verification on %d sequences",
             rescaled // d, n_verify)
    recovery = oracle.queries - start_queries
    # Held-out tokens at the scale where W's scores are of order one, but no larger
    # than the probes reached: beyond it W is known only to its noise floor (W ~ 0).
    verification = verify_model(oracle, model, count=n_verify, seed=seed,
                                tolerance=verify_tolerance,
                                scale=min(token_scale(model), np.sqrt(scale.max())),
                                expected_error=_model_error_bar(bars))
    report = Report(
        kind=model.kind, dim=d, queries=oracle.queries - start_queries,
        breakdown={"recovery": floor, "rescaling": rescaled, "verification": n_verify},
        floor=floor, verification=verification,
        seconds=time.perf_counter() - start, black_box_seconds=oracle.black_box_seconds - start_bb,
        details={"logit scale": f"{scale.min():.3g} .. {scale.max():.3g}",
                 "error_bar_W_columns": float(bars["W_columns"].max()),
                 "error_bar_W_rows": float(bars["W_rows"].max()),
                 "|v^T u_k|": f"{safe_norm(v) / np.sqrt(d):.3g} (every probe)"})
    if beta is not None:                            # biases
        report.details["biases"] = (f"c = f([0]); b from {d} probes [a u_k; 0], largest "
                                    f"|u_k^T b| = {float(np.max(np.abs(beta))):.3g}; floor "
                                    f"d^2 + 2d + 1 = {floor}")
    assert recovery == floor + rescaled   # rescaling includes re-probed small columns
    return checked_result(model, report, "a biased single-head attention regressor" if biases
                          else "a single-head attention regressor")


def measure_weights(oracle: QueryAccess, U: np.ndarray, v: np.ndarray, const: float = 0.0,
                    bias=None, beta=None, max_c: float = np.inf):
    """W from the d^2 probes P(c u_k, s e_j) (with biases, u_k^T b known as ``beta``).

    Columns go in blocks of at most BLOCK_FLOATS probe floats; the first block is a
    single column, so that its measured logits set the scale of all later blocks.

    Returns W (d, d), the logit scales (d,), the float64 rounding bars
    (:func:`rounding_bars`) and the queries beyond d^2 (rescaled and re-probed columns
    and rows)."""
    d = U.shape[0]
    T = np.empty((d, d))
    scale = np.empty(d)
    block = min(d, max(1, BLOCK_FLOATS // (2 * d * d)))
    probes = ColumnProbes(U, block, const, beta, max_c)
    starts = [0] + list(range(1, d, block))
    rescaled = 0
    for b, lo in enumerate(starts):
        cols = np.arange(lo, min(d, lo + block) if b else 1)
        scale[cols] = _next_scale(T[:, :lo], scale[:lo])
        T[:, cols] = column_logits(oracle, probes, v, cols, scale[cols])
        rescaled += _rescue_columns(oracle, probes, v, T, scale, cols, first=(lo == 0))

    if d > 1:
        rescaled += _grow_small_columns(oracle, probes, v, T, scale)

    W = np.linalg.solve(U.T, T / scale[None, :])
    bars = rounding_bars(W, scale)
    if d > 1:
        W, extra, row_bars = _reprobe_small_rows(oracle, v, W, const, bias)
        rescaled += extra
        bars["W_rows"] = np.where(np.isnan(row_bars), bars["W_rows"], row_bars)
    return W, scale, bars, rescaled


def _grow_small_columns(oracle, probes, v, T, scale) -> int:
    """Probe again, at their own scale, columns whose logits are far below the others'.

    A block's scale comes from the largest column seen so far, so a column 1e12 times
    smaller than another is measured at logits ~1e-12, where rounding leaves ~1e-4 of
    it. Columns with a peak logit below SMALL_LOGIT (but above rounding, GROW_FLOOR)
    are measured again with their scale grown to TARGET_LOGIT (at most MAX_GROWTH per
    step, GROW_STEPS steps). Returns the extra queries (d per column per step).
    """
    extra = 0
    for _ in range(GROW_STEPS):
        peak = np.abs(T).max(axis=0)
        small = np.flatnonzero((peak < SMALL_LOGIT) & (peak > GROW_FLOOR))
        if not small.size or not np.any(peak >= SMALL_LOGIT):
            break
        for lo in range(0, len(small), probes.X.shape[0]):
            cols = small[lo:lo + probes.X.shape[0]]
            old_T, old_scale = T[:, cols].copy(), scale[cols].copy()
            scale[cols] *= np.minimum(TARGET_LOGIT / peak[cols], MAX_GROWTH)
            T[:, cols] = column_logits(oracle, probes, v, cols, scale[cols])
            extra += len(cols) * probes.U.shape[0]
            bad = ~np.isfinite(T[:, cols]).all(axis=0)     # overshot: keep the first measurement
            if bad.any():
                T[:, cols[bad]], scale[cols[bad]] = old_T[:, bad], old_scale[bad]
    return extra


def _reprobe_small_rows(oracle, v, W, const=0.0, b=None):
    """Measure again the rows of W far smaller than the largest (ratio < SMALL_ROW).

    Every logit u_k^T W e_j of the first pass mixes all rows, so a row 1e12 times
    smaller than another is left with the large row's rounding (~1e-4 of it). Here the
    key difference u ranges over an orthonormal basis of the small rows' coordinates
    only (u^T v != 0 by :func:`probe_basis` on that block), so the logits hold the
    small rows alone, at their own scale; q = s e_j is kept small (s^2 |W_jj| tiny) so
    that the large entries do not round the scores. m d queries for m small rows.
    Returns (W, extra queries, per-row relative bars (d,), NaN for rows not re-probed).
    """
    d = W.shape[0]
    rows = np.linalg.norm(W, axis=1)
    S = np.flatnonzero(rows < SMALL_ROW * rows.max())
    bars = np.full(d, np.nan)
    if not S.size or S.size == d or not np.any(v[S]) or not np.any(rows[S]):
        return W, 0, bars
    m = len(S)
    U_S = np.zeros((d, m))
    U_S[S] = probe_basis(v[S])
    vu = U_S.T @ v                                       # all +-|v_S| / sqrt(m)
    peak = np.abs(U_S.T @ W).max(axis=0)
    G = TARGET_LOGIT / np.where(peak > 0, peak, np.median(peak[peak > 0]) if np.any(peak) else 1.0)
    s = np.minimum(1.0, np.sqrt(1e-8 * TARGET_LOGIT / np.maximum(np.abs(np.diag(W)), 1e-300)))
    s = np.minimum(s, G)
    c = G / s
    bias = np.zeros(m) if b is None else U_S.T @ b          # biases: u^T b of every row
    if float(np.max(c)) * float(np.max(np.abs(bias))) > BIAS_LOGIT:
        return W, 0, bars          # the bias would swamp these probes: keep the first pass
    T = np.empty((m, d))
    block = max(1, BLOCK_FLOATS // (2 * m * d))
    for lo in range(0, d, block):
        cols = np.arange(lo, min(d, lo + block))
        q = np.zeros((len(cols), d))
        q[np.arange(len(cols)), cols] = s[cols]
        X = np.empty((len(cols), m, 2, d))
        X[:, :, 1, :] = q[:, None, :]
        X[:, :, 0, :] = q[:, None, :] + c[cols, None, None] * U_S.T[None]
        f = oracle.query(X.reshape(-1, 2, d)).reshape(len(cols), m)
        weight = (f - const - (v[cols] * s[cols])[:, None]) / (c[cols, None] * vu[None, :])
        inside = (weight > 0.0) & (weight < 1.0)
        T[:, cols] = ((np.where(inside, logit(np.where(inside, weight, 0.5)), np.nan)
                       - c[cols, None] * bias[None, :]) / G[cols, None]).T
    extra = m * d
    if not np.all(np.isfinite(T)):
        return W, extra, bars
    W = W.copy()
    W[S] = U_S[S] @ T
    t = np.abs(T * G[None, :]).max(axis=0)
    weight = 0.25 * np.exp(-np.minimum(t, MAX_LOGIT))
    beta = ROUNDING_SAFETY * d * np.finfo(float).eps * (np.linalg.norm(T, axis=0) + 1.0 / (weight * G))
    bars[S] = np.linalg.norm(beta) / np.maximum(np.linalg.norm(W[S], axis=1), 1e-300)
    return W, extra, bars


def rounding_bars(W: np.ndarray, scale: np.ndarray) -> dict:
    """Per-column and per-row relative error bars of W from float64 rounding, shapes (d,).

    The logit of probe (k, j) carries the rounding of the black box's scores, about
    eps G_j |W e_j| (the score x^T W q with q = s e_j), and of its output, about eps
    / a(1 - a); divided by G_j an entry of column j is off by at most
    beta_j = ROUNDING_SAFETY eps (|W e_j| + 1 / (a(1 - a) G_j)), a(1 - a) >= 1/4 e^-|t|
    at the largest measured logit t. Columns: sqrt(d) beta_j / |W e_j|; rows:
    |beta| / |W^T e_i| (every row of an orthogonal U spreads the errors evenly).
    A row much smaller than the others gets the large rows' rounding: the bar says so.
    """
    d = W.shape[0]
    eps = np.finfo(float).eps
    col = np.linalg.norm(W, axis=0)
    t = np.abs(W).max(axis=0) * scale * math.sqrt(d)             # bound on the measured logits
    weight = 0.25 * np.exp(-np.minimum(t, MAX_LOGIT))
    beta = ROUNDING_SAFETY * d * eps * (col + 1.0 / (weight * scale))
    with np.errstate(divide="ignore", invalid="ignore"):
        cols = np.where(col > 0, math.sqrt(d) * beta / col, np.inf)
        rows_norm = np.linalg.norm(W, axis=1)
        rows = np.where(rows_norm > 0, np.linalg.norm(beta) / rows_norm, np.inf)
    return {"W_columns": cols, "W_rows": rows, "beta": beta}


def _next_scale(T_known: np.ndarray, scale_known: np.ndarray) -> float:
    """Logit scale for the next block: TARGET_LOGIT over the largest |u^T W e_j| seen.

    Columns whose logits are all at the noise floor tell nothing about W's size;
    if no column has told anything yet, keep the largest scale used so far.
    """
    if not scale_known.size:
        return FIRST_SCALE
    peak = np.abs(T_known).max(axis=0)
    signal = peak > NOISE_LOGIT
    if not signal.any():
        return float(scale_known.max())
    return float(TARGET_LOGIT / np.max(peak[signal] / scale_known[signal]))


def _rescue_columns(oracle, probes, v, T, scale, cols, first: bool) -> int:
    """Probe again the columns whose logits saturated (or, in the first block, are tiny).

    Returns the number of extra queries. Raises ModelMismatchError when a column
    still implies attention weights outside (0, 1) after MAX_RESCALES tries.
    """
    extra = 0
    for attempt in range(MAX_RESCALES + 1):
        peak = np.abs(T[:, cols]).max(axis=0)           # NaN where a weight was outside (0, 1)
        bad = ~(peak <= MAX_LOGIT)
        if first and attempt == 0:   # grow a tiny first column once; W may be ~0 there
            bad |= peak < MIN_FIRST_LOGIT
        if not bad.any():
            return extra
        if attempt == MAX_RESCALES:
            break
        redo = cols[bad]
        ok = np.isfinite(peak[bad])
        # measured logits rescale exactly (growth capped); unmeasurable ones shrink by 2^10
        with np.errstate(divide="ignore"):
            factor = np.minimum(TARGET_LOGIT / np.where(ok, peak[bad], 1.0), MAX_GROWTH)
        scale[redo] *= np.where(ok, factor, 2.0 ** -10)
        T[:, redo] = column_logits(oracle, probes, v, redo, scale[redo])
        extra += len(redo) * probes.U.shape[0]
    raise ModelMismatchError(
        f"the black box is not a single-head attention regressor: after {MAX_RESCALES} "
        f"rescalings, probes of {int(bad.sum())} column(s) still imply attention weights "
        f"outside (0, 1) or logits beyond {MAX_LOGIT}")


def _model_error_bar(bars: dict) -> float | None:
    """The model's relative error bar for verification: the largest per-column or per-row
    rounding bar of W (v is measured directly, to float64 rounding)."""
    values = [float(np.nanmax(bars[k])) for k in ("W_columns", "W_rows") if np.size(bars[k])]
    bar = max(values, default=float("nan"))
    return bar if math.isfinite(bar) else None
