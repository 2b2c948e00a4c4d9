"""Low-rank single heads: rank(W) = r << d (arXiv 2601.16873, Theorem 5.1).

The mathematics: docs/algorithms.md, "Low-rank head".

Identity. With v known (d queries f([e_i]) = v_i), the
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
    (the top-r part of (1/m) sum_l t_l a_l b_l^T, whose expectation is W), then
    preconditioned nonlinear conjugate gradients with an exact (quartic) line
    search, float32 passes over the probes and a float64 residual (``rop_solve``).
    Every iteration costs four passes of O(m d r); on exact data the fit converges
    to float64 accuracy, ~7 iterations per digit at C = 2. The fit is checked
    against the measurements and against ROP_HOLDOUT measurements it did not use; a
    fit that fails either raises RecoveryFailedError. The paper does not state C;
    the benchmark measures it. Nuclear-norm minimisation (``solver="nuclear"``) is
    an optional reference that needs cvxpy, small d only.

Biases (``biases=True``, adaptive only; docs/algorithms.md, "Biases"). A deployed head
computes f(X) = softmax(X (W x_N + b))^T X v + c with b = W p in W's column space. With
every column token at one fixed scale s, the probe P(c u_i, s E e_j) measures
c s (u_i^T W E e_j + u_i^T b / s): the matrix K = M + beta 1^T / s (beta = U^T b) is
W's matrix shifted by a rank-one term inside its own column space, so K has rank r and
the cross approximation learns it at r(2d - r) entries, rescuing probes by c alone
(s stays fixed). beta lies in K's column space: beta = K[:, J] K[I, J]^{-1} beta_I, with
beta_I measured by r probes [c u_i; 0] at the pivot rows. Then M = K - beta 1^T / s,
W = U M E^T, b = U beta, c = f([0]): d + r(2d - r) + r + 1 queries, the floor, plus the
rank checks and 2 x SCOUT_PROBES calibration probes that choose s (|beta| / s near |M|).

Rank tolerance. A residual counts as zero when it is at most RANK_TOL times the
largest measured |M_ij| (or the logit noise floor NOISE_LOGIT / scale): measured
entries are accurate to about 1e-13 relative, so a target whose (r+1)-th
singular value sits below ~1e-10 of the largest is treated as rank r.
"""

from __future__ import annotations

import logging
import math
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from scipy.linalg import solve_triangular

from ..errors import InputError, ModelMismatchError, NotIdentifiableError, RecoveryFailedError
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
from .single_head import (
    FIRST_SCALE,
    MAX_GROWTH,
    MAX_LOGIT,
    MAX_RESCALES,
    MIN_FIRST_LOGIT,
    NOISE_LOGIT,
    TARGET_LOGIT,
    bias_logits,
    constant_and_values,
    logit,
    probe_basis,
    split_scale,
)

log = logging.getLogger(__name__)

RANK_TOL = 1e-10           # residual / largest |M_ij| below which an entry counts as zero
CONFIRM_PROBES = 8         # random extra entries that confirm a rank
SCOUT_PROBES = 8           # entries of the first column that find the logit scale
ROP_HOLDOUT = 16           # ROP measurements kept out of the fit, to check it
ROP_FIRST_BATCH = 32       # ROP measurements that set the logit scale
IMPRECISE_FRACTION = 0.01  # ROP measurements with |v^T a| below this x the median are left out
DEFAULT_OVERSAMPLING = 2.0  # C of the ROP method, m = C r 2d: 100% of seeds in the benchmark
RESTARTS, RESTARTS_SMALL, SMALL_PROBLEM = 8, 32, 1 << 22   # ROP solver: random restarts
MAX_NCG = 5000             # ROP solver: iterations per attempt (stalls end attempts far sooner)
STALL_ITERATIONS = 60      # ROP solver: restart when the best fit has not halved in this many
PLATEAU_ITERATIONS, PLATEAU_FACTOR = 4, 0.8   # ROP solver: below ROP_FIT_TOL, stop when 4
                                              # iterations gained less than 20% (a floor)
SYNC_DROP = 1e-5           # ROP solver: recompute the float64 residual when the fit fell this much
GRAM_EVERY = 4             # ROP solver: iterations between refreshes of the preconditioner
PROBE_CHUNK = 8192         # ROP probe rows per random generator (fixed: same draw on any machine)
RESIDUAL_CHUNK = 4096      # ROP probe rows converted to float64 at a time
NOISE_FIT = 1e-6           # ROP solver: a stall below this is noise (spurious points sit higher)
ROP_FIT_TOL = 1e-10        # relative measurement residual accepted from the ROP solver
ROP_SOLVE_TOL = 1e-11      # ROP solver's target fit: W within ~3e-11 (a digit: ~7 iterations)
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

    def __init__(self, oracle: QueryAccess, v: np.ndarray, const: float = 0.0):
        self.oracle, self.v = oracle, v
        self.const = const                      # biases: the output constant c = f([0])
        self.fixed_s: float | None = None       # biases: every column token at this scale
        self.rescued = 0
        self.largest_scale = 0.0
        self.last_scale = np.empty(0)           # scales finally used by the last measure()

    def logits(self, u: np.ndarray, q: np.ndarray, scale: np.ndarray) -> np.ndarray:
        """Logits G u^T W q for u, q (n, d) at scales G (n,); NaN where not measurable."""
        n, d = u.shape
        if self.fixed_s is None:
            c, s = split_scale(scale)
        else:                                   # biases: only c moves (K stays one matrix)
            s = np.full(n, self.fixed_s)
            c = np.asarray(scale, dtype=float) / s
        vu, vq, out = np.empty(n), np.empty(n), np.empty(n)
        step = max(1, BLOCK_FLOATS // (2 * d))
        for lo in range(0, n, step):            # one oracle batch per block of probes
            hi = min(n, lo + step)
            ub, qb = u[lo:hi].astype(np.float64), q[lo:hi].astype(np.float64)  # float32 rows too
            vu[lo:hi], vq[lo:hi] = ub @ self.v, qb @ self.v
            X = np.empty((hi - lo, 2, d))
            X[:, 1, :] = s[lo:hi, None] * qb
            X[:, 0, :] = X[:, 1, :] + c[lo:hi, None] * ub
            out[lo:hi] = self.oracle.query(X)
        with np.errstate(divide="ignore", invalid="ignore"):
            weight = (out - self.const - s * vq) / (c * vu)
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
        # the total is not known before the rank is: show where the cross stands
        _phase(state.meter.oracle, f"columns {len(state.cols)}/{d}, rank so far {len(state.rows)}")
        free_rows = state.free_rows()
        if state.rows:                          # one entry first: does column col add rank?
            probe_row = int(rng.choice(free_rows))
            if np.isnan(state.M[probe_row, col]):
                state.measure([probe_row], [col])
            if abs(state.residual([probe_row], [col])[0]) <= state.tolerance():
                confirmed, (_, col) = _confirm_rank(state, rng)
                if confirmed:
                    log.info("rank %d confirmed after %d columns", len(state.rows), len(state.cols))
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


def _phase(oracle, text: str) -> None:
    """Show the learner's phase (an oracle wrapper without ``phase`` ignores it)."""
    show = getattr(oracle, "phase", None)
    if show is not None:
        show(text)


def _cross_matrix(state: _CrossState) -> np.ndarray:
    """M from its cross: M[:, J] M[I, J]^{-1} M[I, :] (or M itself when all is measured)."""
    I, J = state.rows, state.cols
    if len(I) == state.d:
        return state.M.copy()
    if not I:
        return np.zeros((state.d, state.d))
    return state.M[:, J] @ np.linalg.solve(state.M[np.ix_(I, J)], state.M[I, :])


def _extract_adaptive(oracle, v, rng, const=None):
    d = oracle.dim
    biased = const is not None
    meter = BilinearMeter(oracle, v, const or 0.0)
    state = _CrossState(meter, random_probe_basis(v, rng), haar_orthogonal(d, rng))
    calibration = _calibrate_bias_scale(state, rng) if biased else 0
    _adaptive_cross(state, rng)
    K = _cross_matrix(state)
    rank = len(state.rows)
    bias = None
    if biased:          # beta = U^T b in K's column space, from the pivot rows (r probes)
        I, J = state.rows, state.cols
        beta_I, extra = bias_logits(oracle, state.U[:, I], v, const)
        meter.rescued += extra
        if rank == d:
            beta = np.empty(d)
            beta[I] = beta_I
        elif rank:
            beta = K[:, J] @ np.linalg.solve(K[np.ix_(I, J)], beta_I)
        else:
            beta = np.zeros(d)
        assert meter.fixed_s is not None      # set by the scouts (biases)
        K = K - beta[:, None] / meter.fixed_s
        bias = state.U @ beta
    W = state.U @ K @ state.E.T
    measured = int(np.isfinite(state.M).sum())
    cross = rank * (2 * d - rank)
    breakdown = {"recovery": d + cross + (rank + 1 if biased else 0),
                 "rank checks": measured - cross, "rescaling": meter.rescued}
    if biased:
        breakdown["calibration"] = calibration
    details = {"rank": rank,
               "rank check": (f"{measured - cross} extra entries, residuals <= "
                              f"{RANK_TOL:.0e} x largest |M_ij|") if rank < d
               else "full rank: every entry measured"}
    if biased:
        details["biases"] = (f"column tokens at s = {meter.fixed_s:.3g}; beta at the {rank} "
                             f"pivot rows; |b| = {float(np.linalg.norm(bias)):.3g}")
    return W, rank, breakdown, details, meter.largest_scale, bias


def _calibrate_bias_scale(state: _CrossState, rng) -> int:
    """Biases: choose the fixed column scale s from SCOUT_PROBES entries and their biases.

    Entries of the first column at s = 1 give K = M + beta; the same rows' biases
    (probes [c u; 0]) give beta, so M. s = max(G_M, |beta| / |M|) (G_M = TARGET_LOGIT /
    |M|, the bias-free scale), at most max(1, |beta| / |M|): then |beta| / s stays near or
    below |M| (the shift does not swamp W) and c |beta| near or below TARGET_LOGIT (the
    bias does not saturate the probes). Returns the queries spent (not recovery).
    """
    meter, d = state.meter, state.d
    before = meter.oracle.queries
    scouts = rng.choice(d, min(d, SCOUT_PROBES), replace=False)
    beta, _ = bias_logits(meter.oracle, state.U[:, scouts], meter.v, meter.const)
    meter.fixed_s = 1.0
    K0 = meter.measure(state.U[:, scouts].T, np.tile(state.E[:, 0], (len(scouts), 1)),
                       FIRST_SCALE, grow_tiny=True)
    peak_m = float(np.max(np.abs(K0 - beta)))
    peak_b = float(np.max(np.abs(beta)))
    if peak_m > 0:
        ratio = peak_b / peak_m
        meter.fixed_s = min(max(TARGET_LOGIT / peak_m, ratio), max(1.0, ratio))
    meter.rescued = 0
    state.scale = TARGET_LOGIT / max(float(np.max(np.abs(K0 - beta + beta / meter.fixed_s))),
                                     1e-300) if peak_m > 0 else FIRST_SCALE
    return meter.oracle.queries - before


# --------------------------------------------------------------------------------------
# the paper's method: Gaussian rank-one projections + a fast rank-r solver
# --------------------------------------------------------------------------------------

def gaussian_probes(m: int, d: int, rng: np.random.Generator) -> np.ndarray:
    """m standard Gaussian rows of width d, float32, filled by two threads.

    float32 values are exact in float64, so the probes sent, the float64 fit
    checks and the float32 passes of the solver all see the same numbers (and the
    solver needs no float64 copy: half the memory). Rows come in fixed chunks, each
    from its own generator spawned from ``rng``: the draw does not depend on timing.
    """
    out = np.empty((m, d), dtype=np.float32)
    starts = range(0, m, PROBE_CHUNK)
    seeds = np.random.SeedSequence(int(rng.integers(2 ** 63))).spawn(len(starts))

    def fill(k):    # numpy releases the GIL while it fills: the threads run in parallel
        # SFC64: float32 normals 2.3x faster than the default PCG64 (measured)
        np.random.Generator(np.random.SFC64(seeds[k])).standard_normal(
            out=out[starts[k]:starts[k] + PROBE_CHUNK], dtype=np.float32)

    with ThreadPoolExecutor(2) as pool:
        list(pool.map(fill, range(len(starts))))
    return out


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


def _rowdot(P: np.ndarray, Q: np.ndarray) -> np.ndarray:
    return np.einsum("mr,mr->m", P, Q)


def rop_residual(A, B, X, Y, t):
    """a_l^T X Y^T b_l - t_l in float64, shape (m,), with float32 copies of A X and B Y.

    Chunk by chunk, so a float32 A is never copied whole to float64.
    Returns (residual (m,), AX (m, r) float32, BY (m, r) float32).
    """
    m, r = A.shape[0], X.shape[1]
    res = np.empty(m)
    AX, BY = np.empty((m, r), np.float32), np.empty((m, r), np.float32)
    for lo in range(0, m, RESIDUAL_CHUNK):
        part = slice(lo, lo + RESIDUAL_CHUNK)
        ax = A[part].astype(np.float64) @ X
        by = B[part].astype(np.float64) @ Y
        res[part] = _rowdot(ax, by) - t[part]
        AX[part], BY[part] = ax, by
    return res, AX, BY


def _line_minimum(c1: float, c2: float, c3: float, c4: float) -> float:
    """The alpha minimising c1 a + c2 a^2 + c3 a^3 + c4 a^4 (a quartic with c4 >= 0)."""
    coefficients = [4 * c4, 3 * c3, 2 * c2, c1] if c4 > 0 else [2 * c2, c1]
    roots = np.roots(coefficients)
    real = roots[np.abs(roots.imag) <= 1e-9 * np.maximum(1.0, np.abs(roots))].real
    if real.size == 0:
        return 0.0
    return float(real[np.argmin(c1 * real + c2 * real ** 2 + c3 * real ** 3 + c4 * real ** 4)])


def _spectral_start(A32, B32, t, rank, rng):
    """Top-r part of (1/m) sum_l t_l a_l b_l^T (expectation W) as factors X, Y (d, r)."""
    m, d = A32.shape
    t32 = t.astype(np.float32)
    Omega = rng.standard_normal((d, min(d, rank + 8))).astype(np.float32)
    Q = np.linalg.qr(A32.T @ (t32[:, None] * (B32 @ Omega)))[0]          # range of W0
    Q = np.linalg.qr(A32.T @ (t32[:, None] * (B32 @ (B32.T @ (t32[:, None] * (A32 @ Q))))))[0]
    small = (((A32 @ Q) * t32[:, None]).T @ B32).astype(np.float64) / m  # Q^T W0 (k, d)
    Us, S, Vt = np.linalg.svd(small, full_matrices=False)
    root = np.sqrt(S[:rank])
    return Q.astype(np.float64) @ Us[:, :rank] * root, Vt[:rank].T * root


def rop_solve(A: np.ndarray, B: np.ndarray, t: np.ndarray, rank: int,
              rng: np.random.Generator, *, tolerance: float = ROP_SOLVE_TOL,
              max_iterations: int = MAX_NCG, restarts: int | None = None, callback=None):
    """Rank-r fit X Y^T (X, Y of shape (d, r)) to t_l = a_l^T W b_l.

    Minimises f(X, Y) = 1/2 sum_l (a_l^T X Y^T b_l - t_l)^2 by preconditioned
    nonlinear conjugate gradients (Polak-Ribiere+) from the spectral start.

    * Exact line search: along (X + s PX, Y + s PY) the residual is the quadratic
      res + s s1 + s^2 s2 (s1, s2 from A PX and B PY), so f is a quartic in s,
      minimised exactly. An iteration is four passes of O(m d r) over A and B
      (gradient: A^T(res * BY), B^T(res * AX); line: A PX, B PY), the least any
      Krylov method needs; unlike Gauss-Newton with inner CG solves there are no
      restarts of the Krylov process, so no iterations are lost to them.
    * Preconditioner: the expectation of the Gauss-Newton matrix over Gaussian
      probes is the Frobenius metric of dW = dX Y^T + X dY^T. Its block-diagonal
      part is dX -> dX (Y^T B^T B Y); the columns of dX inside span(X) (and of dY
      inside span(Y)) both move the same "core" U M V^T, so they are halved:
      zX = (I - P_X / 2) gX (Y^T B^T B Y)^{-1}. This is the Riemannian metric
      of the rank-r manifold; it removes the doubled core from the spectrum.
    * Mixed precision: passes in float32 (A, B as float32, exact when the probes
      were drawn in float32); the residual res is carried in float64 and updated
      exactly from the quartic; every time the fit falls by SYNC_DROP it is
      recomputed from X, Y in float64 (``rop_residual``), which stops the drift
      of the float32 products. On exact data the fit reaches ~1e-13.

    Near the solution the rate is that of CG on the sampled Gauss-Newton matrix, a
    Marchenko-Pastur-like spread of condition ~37 at m = 4 r d (C = 2): ~7
    iterations per decimal digit. Below ROP_FIT_TOL (an acceptable fit) a fit that
    gained less than 20% in PLATEAU_ITERATIONS iterations has met the measurements'
    own rounding (at d = 1024 that floor lies between 1e-12 and a few 1e-11) and the
    run ends. A run whose best fit has not halved in STALL_ITERATIONS iterations (a
    spurious stationary point when m is close to the degrees of freedom) starts
    again from random factors, at most ``restarts`` times; a stall below NOISE_FIT
    is the data's noise, which a restart would meet again: the run ends.

    Parameters
    ----------
    A, B : ndarray (m, d)
        Probe rows a_l, b_l (float32 or float64).
    t : ndarray (m,)
        Measurements a_l^T W b_l.
    rank : int
        r.
    restarts : int, optional
        Random restarts allowed after a stall; default RESTARTS_SMALL (32) when
        m d r <= SMALL_PROBLEM (2^22), else RESTARTS (8).
    callback : callable, optional
        Called as ``callback(iteration, fit)`` after every iteration (progress).

    Returns
    -------
    (X, Y, relative residual ||res|| / ||t||, iterations in all, residual (m,))
    """
    m, d = A.shape
    if restarts is None:    # small problems: restarts cost nothing, spurious minima are likelier
        restarts = RESTARTS_SMALL if m * d * rank <= SMALL_PROBLEM else RESTARTS
    A32 = A if A.dtype == np.float32 else A.astype(np.float32)
    B32 = B if B.dtype == np.float32 else B.astype(np.float32)
    norm_t = float(np.linalg.norm(t))
    if norm_t == 0.0:
        X = np.zeros((d, rank))
        return X, X.copy(), 0.0, 0, np.zeros(m)
    total = 0
    best_fit: tuple[np.ndarray, np.ndarray, float, np.ndarray] | None = None
    # (m, r) float32 buffers reused by every iteration (64 MB each at d = 1024)
    work, APX, BPY = (np.empty((m, rank), np.float32) for _ in range(3))
    for attempt in range(restarts + 1):
        if attempt == 0:
            X, Y = _spectral_start(A32, B32, t, rank, rng)
        else:   # random factors, scaled (and signed) to fit t best along their ray
            X, Y = rng.standard_normal((d, rank)), rng.standard_normal((d, rank))
        # float32 products suffice while the fit is far above their rounding (~1e-7)
        AX = A32 @ np.asfortranarray(X, dtype=np.float32)
        BY = B32 @ np.asfortranarray(Y, dtype=np.float32)
        if attempt > 0:
            p = _rowdot(AX, BY).astype(np.float64)
            c = float(t @ p) / max(float(p @ p), 1e-300)
            sx, sy = math.copysign(math.sqrt(abs(c)), c), math.sqrt(abs(c))
            X, Y, AX, BY = X * sx, Y * sy, AX * np.float32(sx), BY * np.float32(sy)
        res = _rowdot(AX, BY).astype(np.float64) - t
        fit = synced = best = float(np.linalg.norm(res)) / norm_t
        exact, best_at, PX, history = False, 0, None, [fit]
        # the previous iteration's direction and gradient: read from the second on
        PY, zg_old, gX_old, gY_old = np.zeros_like(Y), 0.0, np.zeros_like(X), np.zeros_like(Y)
        for it in range(1, max_iterations + 1):
            res32 = res.astype(np.float32)
            gX = (A32.T @ np.multiply(res32[:, None], BY, out=work)).astype(np.float64)
            gY = (B32.T @ np.multiply(res32[:, None], AX, out=work)).astype(np.float64)
            if (it - 1) % GRAM_EVERY == 0:     # the metric drifts slowly: refresh it now and then
                gram_y = np.linalg.pinv((BY.T @ BY).astype(np.float64))
                gram_x = np.linalg.pinv((AX.T @ AX).astype(np.float64))
            zX, zY = gX @ gram_y, gY @ gram_x
            zX -= 0.5 * X @ np.linalg.lstsq(X.T @ X, X.T @ zX, rcond=None)[0]   # halve the core
            zY -= 0.5 * Y @ np.linalg.lstsq(Y.T @ Y, Y.T @ zY, rcond=None)[0]
            zg = float(np.sum(zX * gX) + np.sum(zY * gY))
            beta = 0.0
            if PX is not None and zg_old > 0:
                beta = max(0.0, (zg - float(np.sum(zX * gX_old) + np.sum(zY * gY_old))) / zg_old)
            if beta == 0.0 or PX is None:             # (beta > 0 needs the previous PX)
                PX, PY = -zX, -zY
            else:
                PX, PY = beta * PX - zX, beta * PY - zY
            if np.sum(PX * gX) + np.sum(PY * gY) >= 0.0:      # not downhill: steepest descent
                PX, PY = -zX, -zY
            zg_old, gX_old, gY_old = zg, gX, gY
            np.matmul(A32, np.asfortranarray(PX, dtype=np.float32), out=APX)
            np.matmul(B32, np.asfortranarray(PY, dtype=np.float32), out=BPY)
            s1 = (_rowdot(AX, BPY) + _rowdot(APX, BY)).astype(np.float64)
            s2 = _rowdot(APX, BPY).astype(np.float64)
            step = _line_minimum(2 * float(res @ s1), float(s1 @ s1) + 2 * float(res @ s2),
                                 2 * float(s1 @ s2), float(s2 @ s2))
            X, Y = X + step * PX, Y + step * PY
            AX += np.multiply(APX, np.float32(step), out=work)   # (BLAS saxpy: slower passes)
            BY += np.multiply(BPY, np.float32(step), out=work)
            res += step * s1 + step * step * s2
            fit = float(np.linalg.norm(res)) / norm_t
            exact = False
            if fit <= SYNC_DROP * synced or fit <= tolerance:
                res, AX, BY = rop_residual(A, B, X, Y, t)     # float64 again
                fit = synced = float(np.linalg.norm(res)) / norm_t
                exact = True
            history.append(fit)
            if callback is not None:
                callback(total + it, fit)
            if fit <= tolerance:
                return X, Y, fit, total + it, res
            if fit <= ROP_FIT_TOL and fit > PLATEAU_FACTOR * history[-1 - PLATEAU_ITERATIONS:][0]:
                break       # good enough, and now fitting the measurements' rounding
            if fit <= 0.5 * best:
                best, best_at = fit, it
            elif it - best_at >= STALL_ITERATIONS:
                break       # stalled: a spurious stationary point, or noisy data
        total += it
        if not exact:
            res, AX, BY = rop_residual(A, B, X, Y, t)
            fit = float(np.linalg.norm(res)) / norm_t
        if best_fit is None or fit < best_fit[2]:
            best_fit = (X, Y, fit, res)
        if fit <= NOISE_FIT:    # stalled this low: the data's noise, which a restart meets again
            break
    assert best_fit is not None                # at least one attempt ran
    X, Y, fit, res = best_fit
    return X, Y, fit, total, res


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


def _extract_rop(oracle, v, rank, oversampling, solver, rng, fit_progress=None):
    d = oracle.dim
    m = int(math.ceil(oversampling * rank * 2 * d))
    meter = BilinearMeter(oracle, v)
    A = gaussian_probes(m + ROP_HOLDOUT, d, rng)
    B = gaussian_probes(m + ROP_HOLDOUT, d, rng)
    t = rop_measure(meter, A, B)
    # A probe with a small v^T a is measured imprecisely: its logit is divided by
    # c v^T a, so its rounding grows like 1 / |v^T a| (1e-9 relative, not 1e-13, at
    # |v^T a| ~ 1e-4 of the median), and at m near the degrees of freedom one such
    # measurement is enough to spoil the fit. It is left out by zeroing its row: a zero
    # probe row with t = 0 measures nothing. (0.5% of Gaussian probes; queries counted.)
    va = np.abs(A @ v.astype(np.float32))              # float32: plenty for a threshold
    imprecise = va < IMPRECISE_FRACTION * np.median(va)
    A[imprecise], t[imprecise] = 0.0, 0.0
    fit, check = slice(0, m), slice(m, m + ROP_HOLDOUT)
    start = time.perf_counter()
    if solver == "nuclear":
        W = nuclear_norm_solve(A[fit].astype(np.float64), B[fit].astype(np.float64), t[fit])
        residual = np.einsum("md,de,me->m", A.astype(np.float64), W, B.astype(np.float64)) - t
        iterations = None
    else:
        X, Y, _, iterations, fit_residual = rop_solve(A[fit], B[fit], t[fit], rank, rng,
                                                      callback=fit_progress)
        W = X @ Y.T
        held_out = rop_residual(A[check], B[check], X, Y, t[check])[0]
        residual = np.concatenate([fit_residual, held_out])
    solve_seconds = time.perf_counter() - start
    fit_err = float(np.linalg.norm(residual[fit]) / np.linalg.norm(t[fit]))
    check_err = float(np.linalg.norm(residual[check]) / max(np.linalg.norm(t[check]), 1e-300))
    details = {"rank": rank, "measurements": f"m = {m} = ceil({oversampling:g} r 2d) + "
               f"{ROP_HOLDOUT} held out of the fit",
               "imprecise": f"{int(imprecise.sum())} measurement(s) with |v^T a| below "
                            f"{IMPRECISE_FRACTION:g} of the median left out of the fit and check",
               "solver": f"{solver}: {solve_seconds:.2f} s" + (f", {iterations} iterations"
                                                             if iterations else ""),
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

def extract_low_rank(oracle: QueryAccess, rank: int | None = None, method: str = "adaptive", *,
                     seed=None, verify_tolerance: float = DEFAULT_VERIFY_TOLERANCE,
                     oversampling: float = DEFAULT_OVERSAMPLING,
                     solver: str = "ncg", fit_progress=None,
                     biases: bool = False) -> ExtractionResult:
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
    solver : {"ncg", "nuclear"}
        ROP solver: preconditioned nonlinear conjugate gradients on the factors
        (default, see ``rop_solve``), or nuclear-norm minimisation with cvxpy
        (optional extra; small d only).
    fit_progress : callable, optional
        ``method="rop"``: called as ``fit_progress(iteration, relative_residual)``
        after every solver iteration (the fit of a d = 1024 head takes ~1.5 min).
    biases : bool
        The head has query, value and output biases (a deployed layer), b in W's
        column space: recovers (W, v, b, c) at the floor d + r(2d - r) + r + 1 (+ rank
        checks and 16 calibration probes). ``method="adaptive"`` only.

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
    if solver not in ("ncg", "nuclear"):
        raise InputError(f"solver must be 'ncg' or 'nuclear', got {solver!r}")
    d = oracle.dim
    if rank is not None and (not isinstance(rank, (int, np.integer)) or not 1 <= rank <= d):
        raise InputError(f"rank must be an integer in 1..{d}, got {rank!r}")
    if biases and method != "adaptive":
        raise InputError("biases=True needs method='adaptive' (the ROP fit has no bias term)")
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
        assert rank is not None                # checked above
        planned = d + int(math.ceil(oversampling * rank * 2 * d)) + ROP_HOLDOUT
    else:
        planned = low_rank_floor(d, planned_rank) + (1 + CONFIRM_PROBES if planned_rank < d else 0)
        if biases:
            planned += planned_rank + 1 + 2 * SCOUT_PROBES
    oracle.plan(planned + verification_count(low_rank_floor(d, planned_rank),
                                             low_rank_floor(d, planned_rank)),
                f"low-rank extraction ({method})")

    log.info("low-rank (%s) at d = %d: v from %d single tokens", method, d, d)
    const: float | None
    const, v = constant_and_values(oracle, biases)
    const = const if biases else None           # None: the bias-free path
    if not np.any(v):
        raise NotIdentifiableError(
            "v = 0: every output is zero whatever W is, so W cannot be identified")
    bias = None
    if method == "adaptive":
        W, found, breakdown, details, largest_scale, bias = _extract_adaptive(oracle, v, rng,
                                                                              const)
    else:
        W, found, breakdown, details, largest_scale = _extract_rop(
            oracle, v, rank, float(oversampling), solver, rng, fit_progress)

    # bias and const are measured exactly when biases (the adaptive path)
    model = (BiasedSingleHeadAttention(W, v, bias, const) if bias is not None and const is not None
             else SingleHeadAttention(W, v))
    log.info("rank %d recovered with %d queries; held-out verification", found, oracle.queries - start_queries)
    _phase(oracle, "held-out verification")
    floor = low_rank_floor(d, found) + (found + 1 if biases else 0)
    n_verify = verification_count(floor, floor)    # within 5% of the recovery (d >= 32)
    recovery_total = sum(breakdown.values())
    verification = verify_model(oracle, model, count=n_verify, seed=seeds[1],
                                tolerance=verify_tolerance,
                                scale=min(token_scale(model), np.sqrt(max(largest_scale, 1e-300))),
                                expected_error="measured")
    # the check's own count: --verify-sequences and the batch-invariance re-asks add to it
    breakdown["verification"] = verification.sequences
    details = {"method": method, **details,
               "floors": (f"d + r(2d - r) + r + 1 = {floor} (rank {found}, biases)" if biases
                          else f"d + r(2d - r) = {floor} (rank {found})")
               + f"; d^2 + d = {d * d + d} (full head)",
               "vs floors": f"{recovery_total} queries before verification = "
                            f"{recovery_total / floor:.4f} x low-rank floor, "
                            f"{recovery_total / (d * d + d):.4f} x full floor"}
    notes = []
    if rank is not None and method == "adaptive" and rank != found:
        notes.append(f"rank {rank} was given; the target's rank is {found}")
    report = Report(kind=model.kind, dim=d, queries=oracle.queries - start_queries,
                    breakdown=breakdown, floor=floor, verification=verification,
                    seconds=time.perf_counter() - start,
                    black_box_seconds=oracle.black_box_seconds - start_bb,
                    notes=notes, details=details)
    assert report.queries == recovery_total + verification.sequences
    return checked_result(model, report, "a single-head attention regressor of this kind")
