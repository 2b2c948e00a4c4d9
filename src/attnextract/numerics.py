"""Numerics shared by the learners, the held-out check and the report: norms that neither
overflow nor underflow, a residual to twice the working precision, and the tests of
whether answers look rounded (float32, decimals).

Depends on numpy only, so that every other module can use it.
"""

from __future__ import annotations

import math

import numpy as np


def safe_norm(x: np.ndarray, axis=None):
    """Euclidean norm of x (the whole array, or along ``axis``) without overflow or
    underflow: each vector is divided by its largest entry first, as np.hypot does, so
    entries of 1e200 or 1e-300 give the norm numpy's would give in exact
    arithmetic. Shape: x's shape without ``axis`` (a float for axis=None)."""
    x = np.asarray(x, dtype=float)
    m = np.abs(x).max(axis=axis, keepdims=True) if x.size else np.zeros(
        [1 if axis is None or i == axis % x.ndim else n for i, n in enumerate(x.shape)])
    safe = np.where((m > 0) & np.isfinite(m), m, 1.0)
    with np.errstate(over="ignore", invalid="ignore"):    # an inf entry: the norm is inf
        out = np.squeeze(m, axis=axis) * np.sqrt(np.sum((x / safe) ** 2, axis=axis))
    return float(out) if axis is None else out


def safe_rms(x: np.ndarray) -> float:
    """Root mean square of x's entries without overflow or underflow (see safe_norm)."""
    x = np.asarray(x, dtype=float)
    return safe_norm(x) / math.sqrt(x.size) if x.size else 0.0


def residual(F: np.ndarray, M: np.ndarray, y: np.ndarray) -> np.ndarray:
    """F - y M^T to about eps^2 |y| |M| (float64 would give eps |y| |M|).

    F (n, m), M (m, k), y (n, k). Ozaki's error-free splitting: every row of y and of M
    is scaled by a power of two to a largest entry in [0.5, 1) and cut into a head on the
    grid 2^(beta - 52), beta = ceil((53 + log2 k) / 2), and the rest. The heads' product
    is then exact in float64 whatever the order of the sums (any BLAS kernel gives the
    same bits), and the three products with a rest carry only eps 2^(beta - 52) of
    |y| |M|. Why: a solve y = M^+ F read from answers that cancel to a small residual
    (an ill-conditioned M) loses cond(M) x the residual's rounding; with this residual one
    correction y + M^+ (F - y M^T) leaves the answers' own rounding only."""
    F, M, y = (np.asarray(a, dtype=float) for a in (F, M, y))
    k = y.shape[1]
    ey = np.frexp(np.abs(y).max(axis=1))[1] if k else np.zeros(len(y), dtype=int)
    eM = np.frexp(np.abs(M).max(axis=1))[1] if k else np.zeros(len(M), dtype=int)
    ys, Ms = np.ldexp(y, -ey[:, None]), np.ldexp(M, -eM[:, None])
    sigma = 2.0 ** math.ceil((53 + math.log2(max(k, 1))) / 2)
    y1, M1 = (ys + sigma) - sigma, (Ms + sigma) - sigma
    y2, M2 = ys - y1, Ms - M1
    scale = ey[:, None] + eM[None, :]
    with np.errstate(over="ignore", under="ignore"):
        Fs = np.ldexp(F, -scale)
        rest = y1 @ M2.T + y2 @ M1.T + y2 @ M2.T
        return np.ldexp((Fs - y1 @ M1.T) - rest, scale)


# the share of answers that must be float32 numbers to call the box's precision float32
FLOAT32_SHARE = 0.9


def float32_share(answers) -> float:
    """The share of the nonzero finite answers (an array, or an object array of arrays)
    that float32 represents exactly (0 with none): nearly all for a float32 forward pass,
    almost none for float64 answers."""
    answers = np.asarray(answers)
    y = (np.concatenate([np.ravel(a) for a in answers]) if answers.dtype == object and
         answers.size else np.ravel(answers)).astype(float)
    y = y[np.isfinite(y) & (y != 0)]
    if not y.size:
        return 0.0
    with np.errstate(over="ignore"):
        return float(np.mean(y.astype(np.float32).astype(np.float64) == y))


def answers_look_rounded(observed) -> bool:
    """Whether the black box's answers show rounding: (nearly) all of them exactly
    representable in float32 (so also bfloat16, float16), or whole multiples of 10^-K
    for some K <= 12. Float64 answers of a real computation almost never are; only
    then does a failed check suggest ``--output-dtype`` / ``--decimals``."""
    if isinstance(observed, np.ndarray) and observed.dtype == object:
        observed = np.concatenate([np.ravel(a) for a in observed]) if len(observed) else []
    y = np.ravel(np.asarray(observed, dtype=float))
    y = y[np.isfinite(y) & (y != 0)]
    if y.size < 4:
        return False
    if float32_share(y) >= FLOAT32_SHARE:
        return True
    for k in range(13):
        z = y * 10.0 ** k
        if np.abs(z).max() >= 1e12:
            break
        # a multiple of 10^-k is a nonzero one: answers of 1e-150 are near 0, not rounded
        if np.mean((np.abs(z - np.round(z)) <= 1e-6) & (np.round(z) != 0)) >= 0.9:
            return True
    return False


def looks_like_rounding(error: float, rounded: bool = True) -> bool:
    """A failed check is worth the precision hint only when the answers show rounding
    (``rounded``, :func:`answers_look_rounded`) and the error is of rounding's size
    (float32 ~1e-7 .. 1e-3, bfloat16 ~1e-2, a few decimals)."""
    return bool(rounded) and 0.0 < error < 3e-2
