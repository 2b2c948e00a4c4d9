"""Low-rank single heads: rank(W) = r << d (arXiv 2601.16873, Theorem 5.1; ALGORITHMS.md s. 4).

Identity (ALGORITHMS.md, section 2). With v known (d queries f([e_i]) = v_i), the
length-2 probe P(c u, s q) = [s q + c u; s q] measures one bilinear form of W:

    c s u^T W q = logit((f - s v^T q) / (c v^T u)),      needs v^T u != 0.

A rank-r d x d matrix has r(2d - r) degrees of freedom, so d + r(2d - r) queries is
the floor for a rank-r head (against d^2 + d for a full one). Two learners:

``method="adaptive"`` (default; reaches the floor, r need not be known).
    Work in random orthonormal coordinates: M = U^T W E, with E Haar-random and
    U = O H (O Haar-random, H the Householder probe basis of O^T v) so that every
    |u_i^T v| = |v| / sqrt(d). M has W's rank and, whatever zeros or dependent
    columns W has, is a generic rank-r matrix. Entry M_ij costs one probe
    P(c u_i, s E e_j). Adaptive cross approximation (ACA, partial pivoting) builds
    M from pivot columns J and pivot rows I:

        M = M[:, J] M[I, J]^{-1} M[I, :]        exactly when |I| = |J| = rank M.

    Step k (k pivots known) measures the d - k new entries of column j and the
    d - k - 1 new entries of the row i* where its residual is largest; summed over
    k < r that is r(2d - r) entries. Before a column is measured, one entry of it
    in a free row is probed first: if its residual against the current cross is
    above the rank tolerance, it is simply the column's first entry (no query
    wasted); if not, the rank is confirmed by CONFIRM_PROBES random entries of the
    free block. Recovery therefore costs d + r(2d - r) + 1 + CONFIRM_PROBES queries
    on a generic rank-r target (r < d), and d^2 + d when r = d (then every entry
    of M is measured and W = U M E^T is the full single-head learner's answer).
    A confirmation that fails only sends ACA on (from the worst residual): a wrong
    rank is never returned.

``method="rop"`` (the paper's, non-adaptive; r must be given).
    m = ceil(C r 2d) rank-one projections t_l = a_l^T W b_l with a_l, b_l ~ N(0, I)
    (Cai and Zhang 2015), then a rank-r matrix X Y^T fitted to them: spectral start
    (the top-r part of (1/m) sum_l t_l a_l b_l^T, whose expectation is W),
    alternating least squares (float32) until the fit is within 5%, then
    Gauss-Newton steps whose corrections are preconditioned-CG solves (float32, the
    residual in float64); random restarts if it stalls. Every CG iteration costs
    O(m d r); on exact data the fit converges to float64 accuracy. The fit is
    checked against the measurements and against ROP_HOLDOUT measurements it did
    not use; a fit that fails either raises RecoveryFailedError. The paper does not
    state C; the benchmark measures it. Nuclear-norm minimisation
    (``solver="nuclear"``) is an optional reference that needs cvxpy, small d only.

Rank tolerance. A residual counts as zero when it is at most RANK_TOL times the
largest measured |M_ij| (or the logit noise floor NOISE_LOGIT / scale): measured
entries are accurate to about 1e-13 relative, so a target whose (r+1)-th
singular value sits below ~1e-10 of the largest is treated as rank r.
"""

from __future__ import annotations

import math
import time

import numpy as np
from scipy.linalg import solve_triangular

from .errors import InputError, ModelMismatchError, NotIdentifiableError, RecoveryFailedError
from .models import SingleHeadAttention
from .oracle import Oracle
from .report import (DEFAULT_VERIFY_TOLERANCE, ExtractionResult, Report, checked_result, token_scale,
                     verification_count, verify_model)
from .single_head import (FIRST_SCALE, MAX_GROWTH, MAX_LOGIT, MAX_RESCALES, MIN_FIRST_LOGIT,
                          NOISE_LOGIT, TARGET_LOGIT, logit, probe_basis,
                          split_scale)

RANK_TOL = 1e-10           # residual / largest |M_ij| below which an entry counts as zero
CONFIRM_PROBES = 8         # random extra entries that confirm a rank
SCOUT_PROBES = 8           # entries of the first column that find the logit scale
ROP_HOLDOUT = 16           # ROP measurements kept out of the fit, to check it
ROP_FIRST_BATCH = 32       # ROP measurements that set the logit scale
DEFAULT_OVERSAMPLING = 2.0  # C of the ROP method, m = C r 2d: 100% of seeds in the benchmark
STALL_FACTOR, STALL_STEPS = 0.9, 6   # ROP solver: restart after 6 steps without -10%
GN_SWITCH, MAX_ALS = 0.05, 30          # ROP solver: ALS until the fit is within 5%
FORCING_FLOOR = 1e-3       # ROP solver: deepest CG reduction (norm) per Gauss-Newton step (float32 limit)
FLOAT32_FIT = 1e-3         # ROP solver: fits above this are checked with float32 products
NOISE_FIT = 1e-11          # ROP solver: a fit stalled below this has reached the data's noise
ROP_FIT_TOL = 1e-10        # relative measurement residual accepted from the ROP solver
BLOCK_FLOATS = 1 << 21     # probe floats per oracle batch (16 MB)
METHODS = ("adaptive", "rop")


def low_rank_floor(d: int, r: int) -> int:
    """Degrees of freedom of a rank-r head: d (for v) + r(2d - r) (for W)."""
    return d + r * (2 * d - r)


def haar_orthogonal(d: int, rng: np.random.Generator) -> np.ndarray:
    """A Haar-random orthogonal matrix (d, d): the Q factor (R with positive diagonal)
    of a Gaussian matrix.

    Computed by CholeskyQR2 (Q = G R^{-1} from the Cholesky factor of G^T G, twice)
    rather than Householder QR: the same Q, but built from a matrix product and
    triangular solves, which stay fast when the BLAS threads are contended
    (multithreaded LAPACK QR was measured 10-25 times slower on a loaded 2-core box).
    """
    while True:
        Q = rng.standard_normal((d, d))
        try:
            for _ in range(2):
                L = np.linalg.cholesky(Q.T @ Q)
                Q = solve_triangular(L, Q.T, lower=True).T
        except np.linalg.LinAlgError:   # a Gaussian matrix this ill-conditioned: draw again
            continue
        if np.abs(Q.T @ Q - np.eye(d)).max() < 1e-12:
            return Q


def random_probe_basis(v: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Random orthogonal U (d, d) with |u_k^T v| = |v| / sqrt(d) for every column u_k."""
    O = haar_orthogonal(v.shape[0], rng)
    return O @ probe_basis(O.T @ v)


class BilinearMeter:
    """Measures u^T W q for batches of (u, q) through the oracle, with v known.

    Probe P(c u, s q) with logit scale G = c s split by ``split_scale`` (q stays
    small beside u). Values whose logit saturates (beyond MAX_LOGIT, or an
    implied attention weight outside (0, 1)) are probed again at a smaller scale;
    ``rescued`` counts those extra queries.
    """

    def __init__(self, oracle: Oracle, v: np.ndarray):
        self.oracle, self.v = oracle, v
        self.rescued = 0
        self.largest_scale = 0.0
        self.last_scale = np.empty(0)           # scales finally used by the last measure()

    def logits(self, u: np.ndarray, q: np.ndarray, scale: np.ndarray) -> np.ndarray:
        """Logits G u^T W q for u, q (n, d) at scales G (n,); NaN where not measurable."""
        n, d = u.shape
        c, s = split_scale(scale)
        vu, vq = u @ self.v, q @ self.v
        out = np.empty(n)
        step = max(1, BLOCK_FLOATS // (2 * d))
        for lo in range(0, n, step):            # one oracle batch per block of probes
            hi = min(n, lo + step)
            X = np.empty((hi - lo, 2, d))
            X[:, 1, :] = s[lo:hi, None] * q[lo:hi]
            X[:, 0, :] = X[:, 1, :] + c[lo:hi, None] * u[lo:hi]
            out[lo:hi] = self.oracle.query(X)
        with np.errstate(divide="ignore", invalid="ignore"):
            weight = (out - s * vq) / (c * vu)
        inside = (weight > 0.0) & (weight < 1.0)
        self.largest_scale = max(self.largest_scale, float(scale.max(initial=0.0)))
        return np.where(inside, logit(np.where(inside, weight, 0.5)), np.nan)

    def measure(self, u: np.ndarray, q: np.ndarray, scale, grow_tiny: bool = False) -> np.ndarray:
        """u_l^T W q_l for every row l, shape (n,); saturated probes are redone smaller.

        ``grow_tiny``: a batch whose logits are all below MIN_FIRST_LOGIT (the scale
        guess was far too small) is probed once more at a larger scale.
        """
        scale = np.broadcast_to(np.asarray(scale, dtype=float), (u.shape[0],)).copy()
        t = self.logits(u, q, scale)
        if grow_tiny and u.shape[0]:
            peak = np.nanmax(np.abs(t)) if np.isfinite(t).any() else np.inf
            if peak < MIN_FIRST_LOGIT:
                scale *= min(TARGET_LOGIT / max(peak, NOISE_LOGIT * 1e-6), MAX_GROWTH)
                t = self.logits(u, q, scale)
                self.rescued += u.shape[0]
        for _ in range(MAX_RESCALES):
            bad = ~(np.abs(t) <= MAX_LOGIT)
            if not bad.any():
                self.last_scale = scale
                return t / scale
            ok = np.isfinite(t[bad])
            with np.errstate(divide="ignore", invalid="ignore"):
                factor = np.where(ok, TARGET_LOGIT / np.abs(np.where(ok, t[bad], 1.0)), 2.0 ** -10)
            scale[bad] *= factor
            t[bad] = self.logits(u[bad], q[bad], scale[bad])
            self.rescued += int(bad.sum())
        bad = ~(np.abs(t) <= MAX_LOGIT)
        if bad.any():
            raise ModelMismatchError(
                f"the black box is not a single-head attention regressor: after "
                f"{MAX_RESCALES} rescalings, {int(bad.sum())} probe(s) still imply attention "
                f"weights outside (0, 1) or logits beyond {MAX_LOGIT}")
        self.last_scale = scale
        return t / scale


# --------------------------------------------------------------------------------------
# adaptive cross approximation at the floor
# --------------------------------------------------------------------------------------

class _CrossState:
    """Entries of M = U^T W E measured so far and the ACA factors of the cross."""

    def __init__(self, meter: BilinearMeter, U: np.ndarray, E: np.ndarray):
        d = U.shape[0]
        self.meter, self.U, self.E, self.d = meter, U, E, d
        self.M = np.full((d, d), np.nan)        # NaN = not measured
        self.rows: list[int] = []               # pivot rows I
        self.cols: list[int] = []               # pivot columns J
        self.A = np.zeros((d, 0))               # ACA: cross = A @ B
        self.B = np.zeros((0, d))
        self.scale = FIRST_SCALE                # logit scale of the next probes
        self.pivots: list[float] = []           # |pivot residual| / largest |M_ij|, per step
        self.confirmed_residual = np.nan        # largest confirmation residual / largest |M_ij|

    def measure(self, rows, cols, grow_tiny=False) -> np.ndarray:
        rows, cols = np.asarray(rows, dtype=int), np.asarray(cols, dtype=int)
        if rows.size == 0:
            return rows
        self.M[rows, cols] = self.meter.measure(self.U[:, rows].T, self.E[:, cols].T,
                                                self.scale, grow_tiny=grow_tiny)
        used = self.meter.last_scale
        largest = float(np.nanmax(np.abs(self.M)))
        if largest * self.scale > NOISE_LOGIT:  # aim the next probes at |logit| ~ 1/2
            self.scale = TARGET_LOGIT / largest
        return used

    def largest(self) -> float:
        return float(np.nanmax(np.abs(self.M))) if np.isfinite(self.M).any() else 0.0

    def tolerance(self) -> float:
        return max(RANK_TOL * self.largest(), NOISE_LOGIT / self.scale)

    def residual(self, rows, cols) -> np.ndarray:
        rows, cols = np.asarray(rows, dtype=int), np.asarray(cols, dtype=int)
        return self.M[rows, cols] - np.einsum("nk,kn->n", self.A[rows], self.B[:, cols])

    def free_rows(self) -> np.ndarray:
        return np.setdiff1d(np.arange(self.d), self.rows)

    def free_cols(self) -> np.ndarray:
        return np.setdiff1d(np.arange(self.d), self.cols)


def _confirm_rank(state: _CrossState, rng: np.random.Generator):
    """Probe up to CONFIRM_PROBES unmeasured random entries of the free block.

    Returns (confirmed, worst) with ``worst`` the (row, column) of the largest
    residual among every measured entry of the free block.
    """
    rows, cols = state.free_rows(), state.free_cols()
    block = state.M[np.ix_(rows, cols)]
    unknown = np.argwhere(np.isnan(block))
    if len(unknown) > CONFIRM_PROBES:
        unknown = unknown[rng.choice(len(unknown), CONFIRM_PROBES, replace=False)]
    state.measure(rows[unknown[:, 0]], cols[unknown[:, 1]])
    known = np.argwhere(~np.isnan(state.M[np.ix_(rows, cols)]))
    res = np.abs(state.residual(rows[known[:, 0]], cols[known[:, 1]]))
    worst = int(np.argmax(res))
    state.confirmed_residual = float(res[worst]) / max(state.largest(), 1e-300)
    return bool(res[worst] <= state.tolerance()), (int(rows[known[worst, 0]]),
                                                    int(cols[known[worst, 1]]))


def _adaptive_cross(state: _CrossState, rng: np.random.Generator) -> None:
    """Grow the cross (pivot rows and columns of M) until the rank is confirmed."""
    d = state.d
    col = 0
    # Scouts: a few entries of the first column at the guessed scale (grown if all
    # tiny) set the logit scale; they are probed again at that scale if the guess
    # was far too small (small logits carry larger relative rounding errors).
    scouts = rng.choice(d, min(d, SCOUT_PROBES), replace=False)
    used = state.measure(scouts, np.zeros_like(scouts), grow_tiny=True)
    again = scouts[used < state.scale / 4]
    state.measure(again, np.zeros_like(again))
    state.meter.rescued += again.size
    while len(state.rows) < d:
        free_rows = state.free_rows()
        if state.rows:                          # one entry first: does column col add rank?
            probe_row = int(rng.choice(free_rows))
            if np.isnan(state.M[probe_row, col]):
                state.measure([probe_row], [col])
            if abs(state.residual([probe_row], [col])[0]) <= state.tolerance():
                confirmed, (_, col) = _confirm_rank(state, rng)
                if confirmed:
                    return
        unknown = free_rows[np.isnan(state.M[free_rows, col])]
        state.measure(unknown, np.full(unknown.size, col), grow_tiny=not state.rows)
        a = state.M[:, col] - state.A @ state.B[:, col]
        a[state.rows] = 0.0
        pivot_row = int(free_rows[np.argmax(np.abs(a[free_rows]))])
        if abs(a[pivot_row]) <= state.tolerance():
            # the whole column lies in the cross: only when the cross is still empty
            # (W ~ 0 along this direction); the free block decides
            confirmed, (pivot_row, col) = _confirm_rank(state, rng)
            if confirmed:
                return
            unknown = free_rows[np.isnan(state.M[free_rows, col])]
            state.measure(unknown, np.full(unknown.size, col))
            a = state.M[:, col] - state.A @ state.B[:, col]
            a[state.rows] = 0.0
            pivot_row = int(free_rows[np.argmax(np.abs(a[free_rows]))])
        free_cols = state.free_cols()
        unknown = free_cols[np.isnan(state.M[pivot_row, free_cols])]
        state.measure(np.full(unknown.size, pivot_row), unknown)
        b = (state.M[pivot_row] - state.A[pivot_row] @ state.B) / a[pivot_row]
        b[state.cols + [col]] = 0.0
        state.pivots.append(abs(float(a[pivot_row])) / state.largest())
        state.A = np.column_stack([state.A, a])
        state.B = np.vstack([state.B, b])
        state.rows.append(pivot_row)
        state.cols.append(col)
        if len(state.cols) < d:
            rest = state.free_cols()
            col = int(rest[np.argmax(np.abs(b[rest]))])


def _cross_matrix(state: _CrossState) -> np.ndarray:
    """M from its cross: M[:, J] M[I, J]^{-1} M[I, :] (or M itself when all is measured)."""
    I, J = state.rows, state.cols
    if len(I) == state.d:
        return state.M.copy()
    if not I:
        return np.zeros((state.d, state.d))
    return state.M[:, J] @ np.linalg.solve(state.M[np.ix_(I, J)], state.M[I, :])


def _extract_adaptive(oracle, v, rng):
    d = oracle.dim
    meter = BilinearMeter(oracle, v)
    state = _CrossState(meter, random_probe_basis(v, rng), haar_orthogonal(d, rng))
    _adaptive_cross(state, rng)
    W = state.U @ _cross_matrix(state) @ state.E.T
    rank = len(state.rows)
    measured = int(np.isfinite(state.M).sum())
    cross = rank * (2 * d - rank)
    breakdown = {"recovery": d + cross, "rank checks": measured - cross,
                 "rescaling": meter.rescued}
    details = {"rank": rank,
               "rank check": (f"{measured - cross} extra entries, residuals <= "
                              f"{RANK_TOL:.0e} x largest |M_ij|") if rank < d
               else "full rank: every entry measured"}
    return W, rank, breakdown, details, meter.largest_scale


# --------------------------------------------------------------------------------------
# the paper's method: Gaussian rank-one projections + a fast rank-r solver
# --------------------------------------------------------------------------------------

def rop_measure(meter: BilinearMeter, A: np.ndarray, B: np.ndarray) -> np.ndarray:
    """t_l = a_l^T W b_l for Gaussian rows a_l, b_l (m, d); the first batch sets the scale."""
    m = A.shape[0]
    t = np.empty(m)
    first = min(m, ROP_FIRST_BATCH)
    t[:first] = meter.measure(A[:first], B[:first], FIRST_SCALE / A.shape[1], grow_tiny=True)
    rms = math.sqrt(float(np.mean(t[:first] ** 2)))
    scale = TARGET_LOGIT / rms if rms > 0 else FIRST_SCALE
    if first < m:
        t[first:] = meter.measure(A[first:], B[first:], scale)
    return t


def rop_residual(A, B, X, Y, t) -> np.ndarray:
    """a_l^T X Y^T b_l - t_l for every measurement, shape (m,)."""
    return np.einsum("mr,mr->m", A @ X, B @ Y) - t


def _pcg_factor(A, CB, t, X, iterations: int) -> np.ndarray:
    """A few preconditioned CG steps on min_X sum_l (a_l^T X c_l - t_l)^2, from X.

    Normal operator N(X) = A^T diag(.) : X -> sum_l a_l a_l^T X c_l c_l^T, whose
    expectation over Gaussian a_l is X (CB^T CB); its inverse is the preconditioner.
    """
    gram_inv = np.linalg.pinv(CB.T @ CB)

    def normal(Z):
        return A.T @ (np.einsum("mr,mr->m", A @ Z, CB)[:, None] * CB)

    R = A.T @ ((t - np.einsum("mr,mr->m", A @ X, CB))[:, None] * CB)
    Z = R @ gram_inv
    P = Z.copy()
    rz = float(np.sum(R * Z))
    for _ in range(iterations):
        if rz <= 0.0:
            break
        NP = normal(P)
        alpha = rz / float(np.sum(P * NP))
        X = X + alpha * P
        R = R - alpha * NP
        Z = R @ gram_inv
        rz_new = float(np.sum(R * Z))
        P = Z + (rz_new / rz) * P
        rz = rz_new
    return X


def _rowdot(P: np.ndarray, Q: np.ndarray) -> np.ndarray:
    return np.einsum("mr,mr->m", P, Q)


def _gauss_newton_step(A32, B32, X, Y, DA, CB, t, max_cg: int, forcing: float):
    """One Gauss-Newton step for min sum_l (a_l^T X Y^T b_l - t_l)^2.

    The linearised problem in (dX, dY), J(dX, dY)_l = a_l^T dX c_l + d_l^T dY^T b_l
    with c_l = Y^T b_l, d_l = X^T a_l, is solved by conjugate gradients on the normal
    equations, preconditioned block-diagonally by the expectation of J^T J over
    Gaussian a_l, b_l: dX -> dX (C^T C), dY -> dY (D^T D). Stops when the normal
    residual fell by ``forcing`` (inexact Newton) or after ``max_cg`` iterations.

    Mixed precision: the residual t - a^T X Y^T b is formed in float64 from
    DA = A X and CB = B Y (float64, (m, r), kept by the caller from its residual
    check, so no extra float64 pass); the correction is solved in float32 (A32,
    B32: half the memory traffic). A float32 correction is accurate to ~1e-5
    relative, so each step still shrinks the float64 residual by that factor and
    the iteration converges to float64 accuracy.
    """
    res = (t - _rowdot(DA, CB)).astype(np.float32)
    CB32, DA32 = CB.astype(np.float32), DA.astype(np.float32)
    gx = np.linalg.pinv(CB.T @ CB).astype(np.float32)
    gy = np.linalg.pinv(DA.T @ DA).astype(np.float32)

    def normal(PX, PY):
        z = _rowdot(A32 @ PX, CB32) + _rowdot(DA32, B32 @ PY)
        return A32.T @ (z[:, None] * CB32), B32.T @ (z[:, None] * DA32)

    RX, RY = A32.T @ (res[:, None] * CB32), B32.T @ (res[:, None] * DA32)
    ZX, ZY = RX @ gx, RY @ gy
    PX, PY = ZX.copy(), ZY.copy()
    dX, dY = np.zeros(X.shape), np.zeros(Y.shape)
    rz = float(np.sum(RX * ZX, dtype=np.float64) + np.sum(RY * ZY, dtype=np.float64))
    target = forcing * rz
    for _ in range(max_cg):
        if rz <= target or rz <= 0.0:
            break
        NX, NY = normal(PX, PY)
        alpha = rz / float(np.sum(PX * NX, dtype=np.float64) + np.sum(PY * NY, dtype=np.float64))
        dX += alpha * PX
        dY += alpha * PY
        RX -= np.float32(alpha) * NX
        RY -= np.float32(alpha) * NY
        ZX, ZY = RX @ gx, RY @ gy
        rz_new = float(np.sum(RX * ZX, dtype=np.float64) + np.sum(RY * ZY, dtype=np.float64))
        beta = np.float32(rz_new / rz)
        PX, PY = ZX + beta * PX, ZY + beta * PY
        rz = rz_new
    return X + dX, Y + dY


def _balance(X, Y):
    """Same product X Y^T, factors with equal singular values (keeps the steps well scaled).

    Returns X', Y' (d, r) and the r x r maps Tx, Ty with X' = X Tx, Y' = Y Ty, so
    that cached products A X, B Y follow without another pass over A, B.
    """
    Qx, Rx = np.linalg.qr(X)
    Qy, Ry = np.linalg.qr(Y)
    u, s, vt = np.linalg.svd(Rx @ Ry.T)
    root = np.sqrt(s)
    Tx = solve_triangular(Rx, u * root)        # Rx^{-1} u diag(root)
    Ty = solve_triangular(Ry, vt.T * root)
    return Qx @ u * root, Qy @ vt.T * root, Tx, Ty


def rop_solve(A: np.ndarray, B: np.ndarray, t: np.ndarray, rank: int,
              rng: np.random.Generator, *, tolerance: float = 1e-12,
              max_steps: int = 60, als_sweeps: int = 3, max_cg: int = 60,
              restarts: int = 3):
    """Rank-r fit X Y^T (X, Y of shape (d, r)) to t_l = a_l^T W b_l.

    Spectral start: the top-r part of (1/m) sum_l t_l a_l b_l^T (its expectation is
    W), from a randomised range finder (passes of O(m d r)). A few sweeps of
    alternating least squares (each half step three preconditioned CG iterations)
    bring it near; then Gauss-Newton steps (quadratic convergence on exact data)
    until the relative measurement residual is below ``tolerance``. A run that
    stalls (no halving of the residual in 4 steps: a spurious stationary point,
    met when m is near the degrees of freedom and the spectral start is poor)
    starts again from random factors, at most ``restarts`` times.

    Returns (X, Y, relative residual, steps taken in all).
    """
    m, d = A.shape
    norm_t = float(np.linalg.norm(t))
    A32, B32, t32 = A.astype(np.float32), B.astype(np.float32), t.astype(np.float32)
    total = 0
    best_fit = None
    for attempt in range(restarts + 1):
        if attempt == 0:
            k = min(d, rank + 8)
            Omega = rng.standard_normal((d, k))
            Q = np.linalg.qr(A.T @ (t[:, None] * (B @ Omega)))[0]         # range of W0
            Q = np.linalg.qr(A.T @ (t[:, None] * (B @ (B.T @ (t[:, None] * (A @ Q))))))[0]
            small = ((A @ Q) * t[:, None]).T @ B / m                        # Q^T W0 (k, d)
            Us, S, Vt = np.linalg.svd(small, full_matrices=False)
            X = Q @ Us[:, :rank] * np.sqrt(S[:rank])
            Y = Vt[:rank].T * np.sqrt(S[:rank])
        else:
            X = np.zeros((d, rank))
            Y = rng.standard_normal((d, rank))
        best, stalled, newton = np.inf, 0, False
        AX = BY = None     # set at the end of every step; Gauss-Newton starts after one
        for step in range(1, max_steps + 1):
            # alternating least squares (monotone, robust far away) until the fit is
            # within GN_SWITCH, then Gauss-Newton (fast, but only near a solution)
            newton = newton or (step > als_sweeps and best <= GN_SWITCH) or step > MAX_ALS
            if not newton:     # far from the solution float32 is plenty (and 2x faster)
                X = _pcg_factor(A32, B32 @ Y.astype(np.float32), t32,
                                X.astype(np.float32), 3).astype(np.float64)
                Y = _pcg_factor(B32, A32 @ X.astype(np.float32), t32,
                                Y.astype(np.float32), 3).astype(np.float64)
            else:
                # inexact Newton: shrink the normal residual by min(1e-2, residual),
                # but not below what a float32 solve can deliver
                X, Y = _gauss_newton_step(A32, B32, X, Y, AX, BY, t, max_cg,
                                          forcing=max(min(1e-2, best), FORCING_FLOOR) ** 2)
            X_unbalanced, Y_unbalanced = X, Y
            X, Y, Tx, Ty = _balance(X, Y)
            # A X and B Y once per step: the residual check and the next Gauss-Newton
            # step share them (balancing is an r x r map on the right). While the fit
            # is far above float32 rounding (~1e-7 of |t|) float32 products are enough
            # and cost half a float64 pass.
            if best > FLOAT32_FIT:
                AX = (A32 @ X_unbalanced.astype(np.float32)).astype(np.float64) @ Tx
                BY = (B32 @ Y_unbalanced.astype(np.float32)).astype(np.float64) @ Ty
            else:
                AX, BY = (A @ X_unbalanced) @ Tx, (B @ Y_unbalanced) @ Ty
            rel = float(np.linalg.norm(_rowdot(AX, BY) - t)) / norm_t
            stalled = stalled + 1 if rel > STALL_FACTOR * best else 0
            best = min(best, rel)
            if rel <= tolerance or (stalled >= 2 and best <= NOISE_FIT):
                return X, Y, rel, total + step       # converged (to the data's noise)
            if stalled >= STALL_STEPS:
                break
        total += step
        if best_fit is None or rel < best_fit[2]:
            best_fit = (X, Y, rel)
    return best_fit + (total,)


def nuclear_norm_solve(A, B, t):
    """Reference solver (small d only): min ||W||_* subject to a_l^T W b_l = t_l. Needs cvxpy."""
    try:
        import cvxpy as cp
    except ImportError as exc:
        raise InputError("solver 'nuclear' needs cvxpy: pip install 'attnextract[cvx]'") from exc
    d = A.shape[1]
    Wv = cp.Variable((d, d))
    problem = cp.Problem(cp.Minimize(cp.normNuc(Wv)),
                         [cp.sum(cp.multiply(A @ Wv, B), axis=1) == t])
    problem.solve()
    if Wv.value is None:
        raise RecoveryFailedError(f"nuclear-norm solver returned no solution ({problem.status})")
    return np.asarray(Wv.value)


def _extract_rop(oracle, v, rank, oversampling, solver, rng):
    d = oracle.dim
    m = int(math.ceil(oversampling * rank * 2 * d))
    meter = BilinearMeter(oracle, v)
    A = rng.standard_normal((m + ROP_HOLDOUT, d))
    B = rng.standard_normal((m + ROP_HOLDOUT, d))
    t = rop_measure(meter, A, B)
    fit, check = slice(0, m), slice(m, m + ROP_HOLDOUT)
    start = time.perf_counter()
    if solver == "nuclear":
        W = nuclear_norm_solve(A[fit], B[fit], t[fit])
        residual = np.einsum("md,de,me->m", A, W, B) - t
        sweeps = None
    else:
        X, Y, _, sweeps = rop_solve(A[fit], B[fit], t[fit], rank, rng)
        W = X @ Y.T
        residual = rop_residual(A, B, X, Y, t)
    solve_seconds = time.perf_counter() - start
    fit_err = float(np.linalg.norm(residual[fit]) / np.linalg.norm(t[fit]))
    check_err = float(np.linalg.norm(residual[check]) / max(np.linalg.norm(t[check]), 1e-300))
    details = {"rank": rank, "measurements": f"m = {m} = ceil({oversampling:g} r 2d) + "
               f"{ROP_HOLDOUT} held out of the fit",
               "solver": f"{solver}: {solve_seconds:.2f} s" + (f", {sweeps} sweeps" if sweeps else ""),
               "fit": f"relative residual {fit_err:.1e} on the fit, {check_err:.1e} on the "
                      f"{ROP_HOLDOUT} held-out measurements"}
    if not (fit_err <= ROP_FIT_TOL and check_err <= ROP_FIT_TOL):
        raise RecoveryFailedError(
            f"ROP recovery failed: relative measurement residual {fit_err:.1e} on the fit, "
            f"{check_err:.1e} held out (need <= {ROP_FIT_TOL:.0e}); m = {m} measurements "
            f"(C = {oversampling:g}) may be too few for rank {rank}, or the rank is larger")
    breakdown = {"recovery": d + m, "fit check": ROP_HOLDOUT, "rescaling": meter.rescued}
    return W, rank, breakdown, details, meter.largest_scale


# --------------------------------------------------------------------------------------

def extract_low_rank(oracle: Oracle, rank: int | None = None, method: str = "adaptive", *,
                     seed=None, verify_tolerance: float = DEFAULT_VERIFY_TOLERANCE,
                     oversampling: float = DEFAULT_OVERSAMPLING,
                     solver: str = "als") -> ExtractionResult:
    """Recover (W, v) of a single head whose W has low rank r.

    Parameters
    ----------
    oracle : Oracle
        Door to the black box; ``oracle.dim`` is the token width d.
    rank : int, optional
        Rank r of W. Required by ``method="rop"``. For ``"adaptive"`` it only sizes
        the up-front budget check; the rank is found (and a different one is noted).
    method : {"adaptive", "rop"}
        ``"adaptive"``: cross approximation at the floor d + r(2d - r) (+ 9 checks).
        ``"rop"``: the paper's Gaussian rank-one projections, m = C r 2d of them.
    seed : int, optional
        Seed of the learner's random choices and of the held-out verification.
    verify_tolerance : float
        Largest held-out relative output error accepted as a match.
    oversampling : float
        C of the ROP method (m = ceil(C r 2d)); ignored by ``"adaptive"``.
    solver : {"als", "nuclear"}
        ROP solver: alternating least squares (default), or nuclear-norm
        minimisation with cvxpy (optional extra; small d only).

    Returns
    -------
    ExtractionResult
        ``model`` a :class:`SingleHeadAttention` with W (d, d) of rank r and v (d,);
        the report's details give the rank and the queries against both floors,
        d + r(2d - r) and d^2 + d.

    Raises
    ------
    InputError
        Unknown method or solver, rank outside 1..d, ROP without a rank, C <= 0.
    NotIdentifiableError
        v = 0.
    RecoveryFailedError
        The ROP fit does not match its measurements (C too small or rank too low).
    ModelMismatchError
        The black box is not a single-head attention regressor.
    BudgetExceededError
        The budget cannot cover the planned queries (checked before sending; with
        ``method="adaptive"`` and no ``rank`` only the rank-1 cost can be checked up
        front, and a batch that would overrun the budget raises before it is sent).
    """
    if method not in METHODS:
        raise InputError(f"method must be one of {METHODS}, got {method!r}")
    if solver not in ("als", "nuclear"):
        raise InputError(f"solver must be 'als' or 'nuclear', got {solver!r}")
    d = oracle.dim
    if rank is not None and (not isinstance(rank, (int, np.integer)) or not 1 <= rank <= d):
        raise InputError(f"rank must be an integer in 1..{d}, got {rank!r}")
    if method == "rop":
        if rank is None:
            raise InputError("method 'rop' needs the rank r (m = C r 2d measurements)")
        if not (isinstance(oversampling, (int, float)) and oversampling > 0):
            raise InputError(f"oversampling C must be a positive number, got {oversampling!r}")
    start, start_queries = time.perf_counter(), oracle.queries
    start_bb = oracle.black_box_seconds
    seeds = np.random.SeedSequence(seed).spawn(2) if seed is not None else [None, None]
    rng = np.random.default_rng(seeds[0])
    planned_rank = rank or 1
    if method == "rop":
        planned = d + int(math.ceil(oversampling * rank * 2 * d)) + ROP_HOLDOUT
    else:
        planned = low_rank_floor(d, planned_rank) + (1 + CONFIRM_PROBES if planned_rank < d else 0)
    oracle.plan(planned + verification_count(low_rank_floor(d, planned_rank)),
                f"low-rank extraction ({method})")

    v = oracle.query(np.eye(d)[:, None, :])
    if not np.any(v):
        raise NotIdentifiableError(
            "v = 0: every output is zero whatever W is, so W cannot be identified")
    if method == "adaptive":
        W, found, breakdown, details, largest_scale = _extract_adaptive(oracle, v, rng)
    else:
        W, found, breakdown, details, largest_scale = _extract_rop(
            oracle, v, rank, float(oversampling), solver, rng)

    model = SingleHeadAttention(W, v)
    floor = low_rank_floor(d, found)
    n_verify = verification_count(floor)
    recovery_total = sum(breakdown.values())
    verification = verify_model(oracle, model, count=n_verify, seed=seeds[1],
                                tolerance=verify_tolerance,
                                scale=min(token_scale(model), np.sqrt(max(largest_scale, 1e-300))))
    breakdown["verification"] = n_verify
    details = {"method": method, **details,
               "floors": f"d + r(2d - r) = {floor} (rank {found}); d^2 + d = {d * d + d} (full head)",
               "vs floors": f"{recovery_total} queries before verification = "
                            f"{recovery_total / floor:.4f} x low-rank floor, "
                            f"{recovery_total / (d * d + d):.4f} x full floor"}
    notes = []
    if rank is not None and method == "adaptive" and rank != found:
        notes.append(f"rank {rank} was given; the target's rank is {found}")
    report = Report(kind=SingleHeadAttention.kind, dim=d, queries=oracle.queries - start_queries,
                    breakdown=breakdown, floor=floor, verification=verification,
                    seconds=time.perf_counter() - start,
                    black_box_seconds=oracle.black_box_seconds - start_bb,
                    notes=notes, details=details)
    assert report.queries == recovery_total + n_verify
    return checked_result(model, report, "a single-head attention regressor of this kind")
