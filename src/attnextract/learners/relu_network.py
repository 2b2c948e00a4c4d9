"""Exact extraction of a bias-free one-hidden-layer ReLU network from single-vector queries.

Model (docs/algorithms.md, "ReLU network"): F(x) = sum_i w_i ReLU(a_i^T x), A (m, d), w (m,),
queried as length-1 sequences [x]. Only the function is identifiable: hidden units
can be permuted and rescaled, (a_i, w_i) -> (c a_i, w_i / c) with c > 0. The
canonical form returned has unit rows a_i and the scale carried by w; it has
m (d + 1) - m = m d free parameters.

Identities. F is positively homogeneous and piecewise linear; its kinks lie on the
hyperplanes a_i^T x = 0 through the origin, and on each open cone C between them

    F(y) = g_C^T y   for every y in C   (no offset: F(0) = 0 and F is linear on C).

So one point x in C and d - 1 steps x + h u_k (h below the distance from x to every
hyperplane, u_k orthonormal in x^perp) give g_C exactly up to rounding with d queries:
g_C^T x = F(x), g_C^T u_k = (F(x + h u_k) - F(x)) / h.

Algorithm.
1. Kinks. In a random plane span(p, q) (orthonormal), the half circle of directions
   from p to -p crosses every hyperplane exactly once (general position), so it
   meets exactly m kinks: that is how m is found. We walk the polyline p -> q -> -p,
   on which F is piecewise linear in the path parameter t, and bracket the kinks
   by bisection on slope changes (slopes from chords of length CHORD): an interval
   whose end slopes differ is cut where the two end lines intersect; if F there
   equals the lines' common value AND the chords on either side of the cut have the
   two end slopes, the interval holds exactly one kink, located at the cut
   (generically; two kinks closer than a chord merge and are caught in step 2),
   otherwise it is split there. All intervals of a round go to the black box as one
   batch. First, F(2x) = 2 F(x) is checked on the initial points (biases fail it).
2. Gradients. The m kinks cut the half circle into m + 1 cones (the last one is the
   antipode of the first). Their gradients, d queries each, give the jumps
   J_k = g_k - g_{k-1} = +-w_i a_i of every unit. A measurement is accepted when
   the step stays inside its cone for all the hyperplanes found and when the
   kink is a root of J_k^T x on the path (x(t_k) lies on the hyperplane of J_k);
   a failing cone is measured again with a smaller step. Kinks that stay
   inconsistent (merged kinks) send the learner to a second random plane.
3. Signs. A jump does not say on which side of its hyperplane the unit is active:
   w ReLU(a^T x) and -w ReLU(-a^T x) differ by the linear function w a^T x. The
   units active at the first cone's centre x_0 are those that switch off along the
   walk, so g_0 = -sum_{k in S} J_k. S is the 0/1 solution of J s = -g_0: a linear
   solve when m <= d (the J_k are independent), a 0/1 linear program when
   d < m <= 2d (generically the 0/1 solution is unique, since a signed subset sum
   of generic vectors is never zero). This uses no extra queries. (The reference
   description fits ReLU(+-n_i^T x) by least squares on random queries instead; that needs extra
   queries and is singular for m > d, where the 2m functions are dependent.)
4. Polish (optional, on by default). A gradient is exact up to rounding amplified by
   |x| / h and by |g| / |J_k| (a jump is a difference of two larger gradients). Once
   A is known, every unit is measured again where that is small: for m <= d on the
   cone where unit k alone is active (every sign pattern is a non-empty cone), whose
   gradient is w_k a_k itself, at x = A^+ sigma_k, at distance 1 / |x| from every
   hyperplane (m d queries); for m > d across its hyperplane at the point a linear
   program puts farthest from the others (2 m d queries).

Queries: (m + 1) d for the gradients plus about 3 per kink-search point (a few per
kink), against a floor of m d free parameters; the polish adds m d (2 m d when
m > d); then held-out verification. Measured worst parameter errors: about 2^-26 to
2^-31 without the polish, 2^-42 to 2^-47 with it, for d = m = 32..64
(benchmarks/bench_one_layer.py).
"""

from __future__ import annotations

import math
import time
from typing import Any, Protocol

import numpy as np

from ..errors import InputError, ModelMismatchError, NotIdentifiableError
from ..models import ReLUNetwork
from ..oracle import QueryAccess
from ..report import (
    DEFAULT_VERIFY_TOLERANCE,
    ExtractionResult,
    Report,
    Verification,
    verification_count,
)
from ..verification import design, safe_norm, scaled_relative_errors

EPS = np.finfo(float).eps
CHORD = 2.0 ** -20          # path step of the slope chords (path length 2): two kinks
                            # closer than this may merge (a second plane then runs)
INITIAL_POINTS = 8          # interior sample points per segment before bisection
HOMOGENEITY_TOLERANCE = 1e-9  # |F(2x) - 2F(x)| / max|F| beyond this: not homogeneous
MAX_ROUNDS = 80             # bisection rounds (each one batch)
CHORD_MIX = 0.05           # a chord may straddle a kink located to within this fraction of it
SLOPE_NOISE = 64            # slope tolerance, in units of eps * max|F| / CHORD
ROOT_SLACK = 4.0            # a kink must be a root of J^T x(t) within this many location errors
MAX_REMEASURE = 5           # rounds of re-measuring cones whose steps were too large
FIRST_STEP = 0.05           # first step h, in units of sin(cone half-angle) / sqrt(d)
STEP_FRACTION = 0.25        # a re-measured cone's step, as a fraction of its margin
POLISH_AGREEMENT = 1e-5     # a polished unit must agree with the first pass this well
BLOCK_FLOATS = 1 << 22      # probe floats per gradient batch (32 MB)
PLANES = 2                  # random planes tried before declaring a mismatch
SIGN_TOLERANCE = 1e-6       # the 0/1 solution must be this close to integers
MILP_SECONDS = 60.0


# --------------------------------------------------------------------------- targets
def random_relu_network(dim: int, width: int, seed=None, *, scale: float = 1.0) -> ReLUNetwork:
    """A generic bias-free ReLU network: A (m, d) and w (m,) with N(0, 1) entries, A / sqrt(d).

    ``scale`` multiplies both A and w (so F by scale^2).
    """
    rng = np.random.default_rng(seed)
    A = scale * rng.standard_normal((width, dim)) / math.sqrt(dim)
    w = scale * rng.standard_normal(width)
    return ReLUNetwork(A, w)


# --------------------------------------------------------------------------- comparison
def canonical_relu(A: np.ndarray, w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Canonical form: rows of A scaled to unit norm, the scale moved into w.

    Units with a zero row or zero output weight compute nothing and are dropped.
    Returns (A (m', d), w (m',)).
    """
    A, w = np.asarray(A, float), np.asarray(w, float)
    norms = safe_norm(A, axis=1)
    keep = (norms > 0) & (w != 0)
    return A[keep] / norms[keep, None], w[keep] * norms[keep]


def align_relu_networks(recovered, truth) -> dict:
    """Align the hidden units of ``recovered`` to ``truth`` and measure parameter errors.

    Both are put in canonical form (:func:`canonical_relu`); units are matched by the
    Hungarian method on 1 - cos(a_i, a_j) (positive rescaling only: ReLU(a^T x) and
    ReLU(-a^T x) are different units).

    Parameters
    ----------
    recovered, truth : objects with arrays ``A`` (m, d) and ``w`` (m,)

    Returns
    -------
    dict
        ``permutation`` (truth unit of each recovered unit), ``units`` (recovered,
        true), ``max_error_A`` (largest entry error of the unit rows),
        ``max_error_w`` (largest error of w relative to max |w|), ``relative_error_A``,
        ``relative_error_w`` (Frobenius), ``max_error`` (the larger max error) and
        ``bits`` = -log2(max_error), the precision measure of Carlini, Jagielski and
        Mironov (2020). With different unit counts the errors are infinite.
    """
    from scipy.optimize import linear_sum_assignment

    Ar, wr = canonical_relu(recovered.A, recovered.w)
    At, wt = canonical_relu(truth.A, truth.w)
    out: dict[str, Any] = {"units": (len(wr), len(wt))}
    if len(wr) != len(wt):
        out.update(permutation=None, max_error_A=math.inf, max_error_w=math.inf,
                   relative_error_A=math.inf, relative_error_w=math.inf, max_error=math.inf,
                   bits=0.0)
        return out
    rows, cols = linear_sum_assignment(1.0 - Ar @ At.T)
    perm = np.empty(len(wr), dtype=int)
    perm[rows] = cols
    At, wt = At[perm], wt[perm]
    err_A = float(np.abs(Ar - At).max())
    err_w = float(np.abs(wr - wt).max() / np.abs(wt).max())
    worst = max(err_A, err_w)
    out.update(permutation=perm, max_error_A=err_A, max_error_w=err_w,
               relative_error_A=float(safe_norm(Ar - At) / safe_norm(At)),
               relative_error_w=float(safe_norm(wr - wt) / safe_norm(wt)),
               max_error=worst, bits=float(-math.log2(worst)) if worst > 0 else 53.0)
    return out


# --------------------------------------------------------------------------- the path
class _KinkPath(Protocol):
    """What the kink search reads of a path: its points x(t) (n, d) at t (n,) in [0, 2]
    (:class:`_Path`, or the biased learner's straight lines)."""

    def points(self, t: np.ndarray) -> np.ndarray: ...


class _Path:
    """The polyline p -> q -> -p, t in [0, 2], and its conversion to angles.

    Points are x(t) = alpha(t) p + beta(t) q with (alpha, beta) = (1 - t, t) on the
    first segment and (-(t - 1), 2 - t) on the second; the formulas extend past
    the ends so that slope chords at t = 0 and t = 2 are defined.
    """

    def __init__(self, p: np.ndarray, q: np.ndarray):
        self.p, self.q = p, q

    @staticmethod
    def coords(t: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        t = np.asarray(t, float)
        return 1.0 - t, np.where(t <= 1.0, t, 2.0 - t)     # alpha = 1 - t on both segments

    def points(self, t: np.ndarray) -> np.ndarray:
        alpha, beta = self.coords(t)
        return alpha[:, None] * self.p[None] + beta[:, None] * self.q[None]

    def angle(self, t: np.ndarray) -> np.ndarray:
        alpha, beta = self.coords(t)
        return np.arctan2(beta, alpha)

    def direction(self, t: np.ndarray) -> np.ndarray:
        """Unit points on the circle at the angles of x(t)."""
        theta = self.angle(t)
        return np.cos(theta)[:, None] * self.p[None] + np.sin(theta)[:, None] * self.q[None]


def _query_vectors(oracle: QueryAccess, x: np.ndarray) -> np.ndarray:
    """F at the rows of x (n, d): one batch of length-1 sequences."""
    return oracle.query(x[:, None, :])


def _sample(oracle: QueryAccess, path: _KinkPath, t: np.ndarray, chord: float = CHORD):
    """F(x(t)) and its left and right chord slopes at each t: 3 queries per point, one batch."""
    t = np.asarray(t, float)
    grid = np.concatenate([t - chord, t, t + chord])
    # The chord on the far side of the vertex t = 1 must use the second segment:
    # x(t) handles that, since the formulas switch at t = 1.
    f = _query_vectors(oracle, path.points(grid)).reshape(3, len(t))
    left = (f[1] - f[0]) / chord
    right = (f[2] - f[1]) / chord
    return f[1], left, right


def _find_kinks(oracle: QueryAccess, path: _KinkPath, rng: np.random.Generator, *,
                homogeneous: bool = True, max_kinks: int | None = None,
                chord: float = CHORD, noise: float = SLOPE_NOISE * EPS):
    """Locate every kink of F on the path (bisection on slope changes, batched per round).

    ``path`` is any object whose ``points(t)`` is piecewise linear in t on [0, 1] and
    [1, 2]; ``homogeneous=False`` skips the F(2x) = 2 F(x) check (biased networks);
    more than ``max_kinks`` kinks (a smooth F looks like kinks everywhere) is a mismatch.
    ``chord`` is the length of the slope chords (in t) and ``noise`` the error of one answer
    allowed for, relative to max |F| (defaults: float64 answers; rounded answers need a
    chord long enough that noise / chord stays below the smallest slope jump).

    Returns (sorted kink parameters t_k, their location errors, number of rounds).
    """
    interior = [np.sort(rng.uniform(0.02, 0.98, INITIAL_POINTS)) + offset for offset in (0.0, 1.0)]
    t0 = np.concatenate([[0.0], interior[0], [1.0], interior[1], [2.0]])
    f0, left0, right0 = _sample(oracle, path, t0, chord)
    magnitude = max(float(np.abs(f0).max()), float(np.abs(np.concatenate([left0, right0])).max())
                    * chord)
    if magnitude == 0.0:
        return np.empty(0), np.empty(0), 1
    # F must be positively homogeneous (no biases): F(2x) = 2 F(x), up to rounding
    doubled = _query_vectors(oracle, 2.0 * path.points(t0)) if homogeneous else 2.0 * f0
    gap = float(np.abs(doubled - 2.0 * f0).max())
    if gap > HOMOGENEITY_TOLERANCE * magnitude:
        raise ModelMismatchError(
            f"F(2x) differs from 2 F(x) by {gap / magnitude:.2e} relative to max |F|: the "
            f"black box is not positively homogeneous, so not a bias-free ReLU network "
            f"(biases?)")
    slope_tol = noise * magnitude / chord
    # open intervals: (a, b, F(a), F(b), right slope at a, left slope at b); t = 1 is a
    # sample point, so no interval straddles the vertex of the polyline
    intervals = [(t0[i], t0[i + 1], f0[i], f0[i + 1], right0[i], left0[i + 1])
                 for i in range(len(t0) - 1)]
    kinks: list[tuple[float, float]] = []
    rounds = 1
    while True:
        open_ = [iv for iv in intervals if abs(iv[5] - iv[4]) > slope_tol]
        if not open_:
            break
        if max_kinks is not None and len(open_) + len(kinks) > max_kinks:
            raise ModelMismatchError(
                f"more than {max_kinks} kinks on one path: F is not piecewise linear with few "
                f"pieces (a smooth activation?)")
        if rounds >= MAX_ROUNDS:
            raise ModelMismatchError(
                f"kink search did not converge in {MAX_ROUNDS} rounds: F is not piecewise "
                f"linear with finitely many kinks on the path")
        cuts, predicted = [], []
        for a, b, fa, fb, sa, sb in open_:
            # intersection of the end lines fa + sa (t - a) and fb + sb (t - b)
            t_star = a + (fb - fa - sb * (b - a)) / (sa - sb)
            if b - a > 4 * chord and a + 0.5 * chord < t_star < b - 0.5 * chord:
                cuts.append(t_star)
                predicted.append(fa + sa * (t_star - a))
            else:
                cuts.append(0.5 * (a + b))
                predicted.append(math.nan)
        cut = np.array(cuts)
        f, left, right = _sample(oracle, path, cut, chord)
        rounds += 1
        next_intervals = [iv for iv in intervals if abs(iv[5] - iv[4]) <= slope_tol]
        for (a, b, fa, fb, sa, sb), tc, fc, lc, rc, pc in zip(open_, cut, f, left, right,
                                                                predicted):
            # One kink at tc: F(tc) is on both end lines AND the chords on either side of
            # tc have the end slopes. (The value alone is not enough: beyond the last of
            # several kinks F follows the second line, which meets the first at tc.)
            value_tol = slope_tol * (b - a) + noise * magnitude
            chord_tol = slope_tol + CHORD_MIX * abs(sb - sa)
            if (not math.isnan(pc) and abs(fc - pc) <= value_tol
                    and abs(lc - sa) <= chord_tol and abs(rc - sb) <= chord_tol):
                # located to within the slope noise over the interval; a chord that
                # straddles the kink tells how far from tc it is (in chords)
                straddle = max(abs(lc - sa), abs(rc - sb)) / abs(sb - sa)
                error = slope_tol * (b - a) / abs(sb - sa) + 2.0 * straddle * chord
                if min(tc - a, b - tc) < 1.5 * chord:
                    error += chord       # cut one chord past an end whose chord straddled it
                kinks.append((float(tc), error))  # exactly one kink in (a, b), at tc
            elif b - a <= 4 * chord:
                kinks.append((float(tc), b - a))  # bracketed to within a few chords
            else:
                next_intervals += [(a, tc, fa, fc, sa, lc), (tc, b, fc, fb, rc, sb)]
        intervals = next_intervals
    kinks.sort()
    located = np.array(kinks).reshape(-1, 2)
    return located[:, 0], located[:, 1], rounds


# --------------------------------------------------------------------------- gradients
def _complement_bases(x: np.ndarray) -> np.ndarray:
    """For unit rows x (R, d): orthonormal bases (R, d, d - 1) of each x^perp.

    Columns 2..d of the Householder reflection that maps e_1 to +-x.
    """
    R, d = x.shape
    sign = np.where(x[:, 0] >= 0, 1.0, -1.0)
    v = x.copy()
    v[:, 0] += sign                                  # no cancellation in v
    H = np.eye(d)[None] - (2.0 / np.einsum("rd,rd->r", v, v))[:, None, None] * (
        v[:, :, None] * v[:, None, :])
    return H[:, :, 1:]


def _cone_gradients(oracle: QueryAccess, centres: np.ndarray, steps: np.ndarray) -> np.ndarray:
    """Gradients (R, d) of F on the cones around unit centres (R, d): d queries per cone.

    Probes of a cone: its centre x and x + h u_k for an orthonormal basis u_k of x^perp.
    All cones go in one batch, or in blocks of at most BLOCK_FLOATS probe floats
    (one batch each) when d is large.
    """
    R, d = centres.shape
    block = max(1, BLOCK_FLOATS // (d * d))
    grads = np.empty((R, d))
    for lo in range(0, R, block):
        x, h = centres[lo:lo + block], steps[lo:lo + block]
        bases = _complement_bases(x)                      # (r, d, d - 1)
        probes = x[:, None, :] + h[:, None, None] * np.swapaxes(bases, 1, 2)
        X = np.concatenate([x[:, None, :], probes], axis=1).reshape(len(x) * d, d)
        f = _query_vectors(oracle, X).reshape(len(x), d)
        along = (f[:, 1:] - f[:, :1]) / h[:, None]       # g^T u_k
        grads[lo:lo + block] = f[:, :1] * x + np.einsum("rdk,rk->rd", bases, along)
    return grads


def _resolve_signs(J: np.ndarray, g0: np.ndarray) -> tuple[np.ndarray, str]:
    """0/1 vector s with J s = -g0 (J (d, m) jumps as columns). Returns (s, method)."""
    d, m = J.shape
    target = -g0
    scale = np.abs(J).sum(axis=1) + np.abs(target)
    tol = 1e-7 * scale + 1e-300
    if m <= d:
        s = np.linalg.lstsq(J, target, rcond=None)[0]
        rounded = s.round()
        ok = (np.all(np.abs(s - rounded) <= SIGN_TOLERANCE) and np.all((rounded == 0) | (rounded == 1))
              and np.all(np.abs(J @ rounded - target) <= tol))
        if ok:
            return rounded, "linear solve"
    from scipy.optimize import Bounds, LinearConstraint, milp

    res = milp(np.zeros(m), constraints=LinearConstraint(J, target - tol, target + tol),
               integrality=np.ones(m), bounds=Bounds(0, 1),
               options={"time_limit": MILP_SECONDS})
    if res.x is None or res.status != 0:
        raise _PlaneFailure(
            "no subset of the measured gradient jumps explains the gradient at the first "
            "cone: the black box is not a bias-free ReLU network in general position "
            f"(0/1 program: {res.message})")
    return np.round(res.x), "0/1 linear program"


# --------------------------------------------------------------------------- learner
class _PlaneFailure(Exception):
    """One random plane gave an inconsistent picture (merged kinks, unexplained jumps)."""


def extract_relu_network(oracle: QueryAccess, *, seed=None,
                         verify_tolerance: float = DEFAULT_VERIFY_TOLERANCE,
                         polish: bool = True, max_norm: float | None = None) -> ExtractionResult:
    """Recover F(x) = w^T ReLU(A x) (bias-free) from single-vector queries.

    Parameters
    ----------
    oracle : Oracle
        Door to the black box, queried with length-1 sequences only; ``oracle.dim`` is
        d >= 2.
    seed : int, optional
        Seed of the random plane(s) of the kink search and of the held-out vectors.
    verify_tolerance : float
        Largest held-out relative output error accepted as a match.
    polish : bool
        Measure every unit again where its measurement is best conditioned: for
        m <= d alone on the cone where it is the only active unit (:func:`_polish`,
        m d queries), for m > d across its hyperplane at a point far from all others
        (:func:`_polish_wide`, 2 m d queries). About 10-15 more bits of precision;
        False gives the fewest queries.
    max_norm : float, optional
        Largest norm of a held-out vector (default: the held-out design's full range,
        about 1e-5 to 1e5). Only for a map that is a bias-free ReLU network inside a
        ball and not beyond it, such as the residual learner's sequences with uniform
        attention (:mod:`attnextract.learners.residual`); a single-token map is
        homogeneous and is checked at every scale.

    Returns
    -------
    ExtractionResult
        ``model`` a :class:`ReLUNetwork` in canonical form: A (m, d) with unit rows,
        w (m,); m is the number of hidden units found (units with w_i = 0 or a_i = 0
        are invisible and not counted). ``report.details`` has m, the kink-search
        rounds, the sign method and the planes used.

    Raises
    ------
    NotIdentifiableError
        F is identically zero on the probes.
    ModelMismatchError
        The black box is not a bias-free ReLU network in general position (F(2x) !=
        2 F(x), i.e. biases;
        a linear part no set of units explains, verification failed) on
        ``PLANES`` random planes; ``.result`` holds the last best-effort extraction
        when one was built.
    BudgetExceededError
        The budget cannot cover the next batch (checked before sending it).
    InputError
        d < 2.
    """
    start, start_queries = time.perf_counter(), oracle.queries
    start_bb = oracle.black_box_seconds
    d = oracle.dim
    if d < 2:
        raise InputError("the ReLU network learner needs token width d >= 2 (it walks a plane)")
    if max_norm is not None and not (math.isfinite(max_norm) and max_norm > 0):
        raise InputError(f"max_norm must be a positive number, got {max_norm!r}")
    rng = np.random.default_rng(seed)
    counts = {"kink search": 0, "cone gradients": 0, "re-measured": 0, "verification": 0}
    failures: list[str] = []
    result = None
    for plane in range(PLANES):
        try:
            model, info = _extract_on_plane(oracle, rng, counts, polish)
        except _PlaneFailure as exc:
            failures.append(str(exc))
            continue
        verification = verify_relu(oracle, model, count=verification_count(model.width * (d + 1)),
                                   seed=rng, tolerance=verify_tolerance, max_norm=max_norm)
        counts["verification"] += verification.sequences
        worst = verification.max_relative_error
        report = Report(
            kind=ReLUNetwork.kind, dim=d, queries=oracle.queries - start_queries,
            breakdown={"recovery": oracle.queries - start_queries - counts["verification"],
                       **counts},
            floor=model.width * d, verification=verification,
            seconds=time.perf_counter() - start,
            black_box_seconds=oracle.black_box_seconds - start_bb,
            notes=[f"plane {i + 1} rejected: {why}" for i, why in enumerate(failures)],
            details={**info, "planes": plane + 1,
                     "output bits": f"{-math.log2(worst) if worst > 0 else 53.0:.1f} "
                                    f"(-log2 of the largest held-out relative error)"})
        result = ExtractionResult(model=model, queries=report.queries, report=report)
        if verification.passed:
            return result
        failures.append(f"held-out relative error {worst:.2e} > tolerance {verify_tolerance:.0e}")
    raise ModelMismatchError(
        f"the black box is not a bias-free ReLU network in general position: "
        f"{len(failures)} random plane(s) failed ({'; '.join(failures)})", result=result)


def _extract_on_plane(oracle: QueryAccess, rng: np.random.Generator, counts: dict,
                      polish: bool):
    """Kinks on one random half circle, cone gradients, jumps, signs: (model, details).

    Raises _PlaneFailure when this plane's measurements are inconsistent, and
    NotIdentifiableError / ModelMismatchError when F is zero / linear.
    """
    d = oracle.dim
    frame, _ = np.linalg.qr(rng.standard_normal((d, 2)))
    path = _Path(frame[:, 0], frame[:, 1])
    oracle.require(3 * (2 * INITIAL_POINTS + 3), "the kink search")
    before = oracle.queries
    kinks, kink_error, rounds = _find_kinks(oracle, path, rng)
    counts["kink search"] += oracle.queries - before
    m = len(kinks)

    # cones between consecutive kinks on the unit circle of the plane; the last cone
    # is the antipode of the first (the half circle meets every hyperplane once)
    theta = path.angle(kinks)
    if m == 0:
        bounds = np.array([0.0, math.pi])
    else:
        bounds = np.concatenate([[theta[-1] - math.pi], theta, [theta[0] + math.pi]])
    mid = 0.5 * (bounds[:-1] + bounds[1:])
    half = 0.5 * (bounds[1:] - bounds[:-1])
    centres = np.cos(mid)[:, None] * path.p[None] + np.sin(mid)[:, None] * path.q[None]
    R = len(centres)
    polish_queries = (m * d if m <= d else 2 * m * d) if polish else 0
    oracle.plan(R * d + polish_queries + verification_count(m * (d + 1)),
                "ReLU network extraction (cone gradients, polish, verification)")
    steps = np.clip(FIRST_STEP * np.sin(half) / math.sqrt(d), 1e-12, 0.25)
    grads = _cone_gradients(oracle, centres, steps)
    counts["cone gradients"] += R * d

    kink_points = path.points(kinks)
    tangent = np.where((kinks <= 1.0)[:, None], (path.q - path.p)[None], (-path.p - path.q)[None])
    previous_bad = 0
    for attempt in range(MAX_REMEASURE + 1):
        jumps = grads[1:] - grads[:-1]                            # (m, d): J_k
        norms = safe_norm(jumps, axis=1)     # slopes of outputs near 1e300 overflow squared
        normals = jumps / np.where(norms > 0, norms, 1.0)[:, None]
        # the kink must be a root of J^T x(t) on its segment; J^T x(t_k + u) = J^T x(t_k) + u J^T tau
        with np.errstate(divide="ignore", invalid="ignore"):
            offset = np.abs(np.einsum("kd,kd->k", normals, kink_points)
                            / np.einsum("kd,kd->k", normals, tangent))
        bad_kink = ~(offset <= ROOT_SLACK * kink_error) | (norms == 0)
        margins = np.abs(centres @ normals.T).min(axis=1) if m else np.ones(R)
        too_far = steps >= 0.5 * margins
        redo = too_far.copy()
        redo[:-1] |= bad_kink
        redo[1:] |= bad_kink
        if not redo.any() or attempt == MAX_REMEASURE or (
                attempt and bad_kink.sum() >= previous_bad > 0):
            break                 # done, or smaller steps do not make the kinks consistent
        previous_bad = int(bad_kink.sum())
        # a step that crossed a hyperplane found: a quarter of the margin; a cone next
        # to an inconsistent kink may have crossed the kink's own hyperplane: step / 16
        steps = np.where(too_far, STEP_FRACTION * margins, np.where(redo, steps / 16.0, steps))
        steps = np.maximum(steps, 1e-12)
        idx = np.flatnonzero(redo)
        oracle.require(len(idx) * d, "re-measuring cone gradients")
        grads[idx] = _cone_gradients(oracle, centres[idx], steps[idx])
        counts["re-measured"] += len(idx) * d

    if m == 0:
        if not np.any(grads):
            raise NotIdentifiableError("F is zero on every probe: no hidden unit can be identified")
        raise ModelMismatchError(
            "F has no kink on a random half circle but is not zero: the black box is linear, "
            "not a bias-free ReLU network in general position")
    if bad_kink.any():
        raise _PlaneFailure(
            f"{int(bad_kink.sum())} of {m} kinks do not lie on the hyperplane of their gradient "
            f"jump (kinks off the origin, i.e. biases, or two kinks merged)")

    # signs: the units active at the first cone's centre switch off along the walk
    s, sign_method = _resolve_signs(jumps.T, grads[0])
    active_first = s == 1
    v = np.where(active_first[:, None], -jumps, jumps)          # w_k a_k
    size = safe_norm(v, axis=1)
    a = v / size[:, None]
    want = np.where(active_first, 1.0, -1.0)                    # sign of a_k^T x_0
    flip = np.sign(a @ centres[0]) * want
    A, w = a * flip[:, None], size * flip
    info = {"hidden units": m, "kink rounds": rounds, "signs": sign_method,
            "steps h": f"{steps.min():.3g} .. {steps.max():.3g}"}
    if polish:
        A, w, info["polish"] = (_polish(oracle, A, w, counts) if m <= d
                                else _polish_wide(oracle, A, w, counts))
    return ReLUNetwork(A, w), info


def _polish(oracle: QueryAccess, A: np.ndarray, w: np.ndarray, counts: dict):
    """Measure every unit alone: on the cone where only unit k is active, grad F = w_k a_k.

    For m <= d every activation pattern is a non-empty cone; x_k = A^+ sigma_k with
    sigma_k = -1 except +1 at k has a_j^T x_k = sigma_kj, so x_k / |x_k| is at distance
    1 / |x_k| from every hyperplane. The gradient there is w_k a_k itself (no
    difference of two large gradients), measured with d queries and a step a quarter
    of that distance: typically far larger than the first pass's steps. A polished
    unit replaces the first-pass one only if the two agree to POLISH_AGREEMENT.

    Returns (A (m, d), w (m,), summary string).
    """
    m, d = A.shape
    sigma = -np.ones((m, m)) + 2.0 * np.eye(m)
    X = np.linalg.lstsq(A, sigma.T, rcond=None)[0].T          # (m, d): rows x_k = A^+ sigma_k
    reach = safe_norm(X, axis=1)
    if not np.all(np.isfinite(reach)) or not np.all(reach > 0):
        return A, w, "skipped (degenerate unit directions)"
    centres = X / reach[:, None]
    steps = STEP_FRACTION / reach
    oracle.require(m * d, "polishing the hidden units")
    v = _cone_gradients(oracle, centres, steps)
    counts["polish"] = counts.get("polish", 0) + m * d
    first = w[:, None] * A
    agree = safe_norm(v - first, axis=1) <= POLISH_AGREEMENT * safe_norm(first, axis=1)
    size = safe_norm(v, axis=1)
    A_new = np.where(agree[:, None], v * np.sign(w)[:, None] / np.where(size > 0, size, 1)[:, None], A)
    w_new = np.where(agree, size * np.sign(w), w)
    return A_new, w_new, (f"{int(agree.sum())} of {m} units measured alone (steps "
                          f"{steps.min():.3g} .. {steps.max():.3g})")


def _polish_wide(oracle: QueryAccess, A: np.ndarray, w: np.ndarray, counts: dict):
    """Polish for m > d: each unit's jump measured across its hyperplane at a fat point.

    For unit k a linear program finds y on the hyperplane a_k^T y = 0, inside the cell
    of a sign pattern that switches most other units off (the pattern of y0, the
    projection of -sum_j a_j onto the hyperplane), as far as possible (r) from every
    other hyperplane. The gradients at y +- (r / 2) a_k differ by exactly w_k a_k;
    2 d queries per unit, steps a quarter of the cones' margins. A polished unit
    replaces the first-pass one only if the two agree to POLISH_AGREEMENT.

    Returns (A (m, d), w (m,), summary string).
    """
    from scipy.optimize import linprog

    m, d = A.shape
    found_points, margins, found_units = [], [], []
    total = A.sum(axis=0)
    for k in range(m):
        others = np.delete(np.arange(m), k)
        y0 = -(total - A[k] * (A[k] @ total))
        sigma = np.where(A[others] @ y0 >= 0, 1.0, -1.0)
        # maximise r subject to sigma_j a_j^T y >= r (j != k), a_k^T y = 0, |y_i| <= 1
        res = linprog(np.concatenate([np.zeros(d), [-1.0]]),
                      A_ub=np.hstack([-sigma[:, None] * A[others], np.ones((m - 1, 1))]),
                      b_ub=np.zeros(m - 1), A_eq=np.concatenate([A[k], [0.0]])[None],
                      b_eq=[0.0], bounds=[(-1, 1)] * d + [(0, 1)], method="highs")
        if res.status != 0 or not res.x[-1] > 0:
            continue
        y, r = res.x[:d], res.x[-1]
        found_units.append(k)
        found_points += [y + 0.5 * r * A[k], y - 0.5 * r * A[k]]
        margins += [0.5 * r] * 2      # distance of y +- (r/2) a_k to every hyperplane >= r/2
    if not found_units:
        return A, w, "skipped (no cell found)"
    points = np.array(found_points)
    reach = safe_norm(points, axis=1)
    centres = points / reach[:, None]
    steps = STEP_FRACTION * np.array(margins) / reach
    oracle.require(len(points) * d, "polishing the hidden units")
    grads = _cone_gradients(oracle, centres, steps)
    counts["polish"] = counts.get("polish", 0) + len(points) * d
    units = np.array(found_units)
    v = grads[0::2] - grads[1::2]                     # w_k a_k for the polished units
    first = w[units, None] * A[units]
    agree = safe_norm(v - first, axis=1) <= POLISH_AGREEMENT * safe_norm(first, axis=1)
    A, w = A.copy(), w.copy()
    size = safe_norm(v, axis=1)
    keep = units[agree]
    A[keep] = v[agree] * np.sign(w[keep])[:, None] / size[agree][:, None]
    w[keep] = size[agree] * np.sign(w[keep])
    return A, w, (f"{int(agree.sum())} of {m} units measured across their hyperplanes "
                  f"(steps {steps.min():.3g} .. {steps.max():.3g})")


def verify_relu(oracle: QueryAccess, model: ReLUNetwork, *, count: int, seed=None,
                tolerance: float = DEFAULT_VERIFY_TOLERANCE,
                max_norm: float | None = None) -> Verification:
    """Compare ``model`` with the black box on ``count`` held-out single vectors: the last
    tokens of :func:`attnextract.verification.design`'s sequences (scale 1), so tiny to
    large, sparse and one-hot vectors and a constant coordinate (F is homogeneous: the
    scales check that too). Single tokens, because this learner also serves the
    single-token map of the one-layer learners, whose longer sequences mean attention.

    ``max_norm`` (optional): vectors longer than this are pulled back onto the sphere of
    that radius, directions unchanged; for maps that are a ReLU network only inside it.
    """
    rng = seed if isinstance(seed, np.random.Generator) else np.random.default_rng(seed)
    vectors = np.stack([s[-1] for s in design(oracle.dim, count, rng, 1.0).sequences])
    if max_norm is not None:
        length = safe_norm(vectors, axis=1)
        vectors *= np.minimum(1.0, max_norm / np.maximum(length, np.finfo(float).tiny))[:, None]
    observed = _query_vectors(oracle, vectors)
    norms = safe_norm(vectors, axis=1)
    err = scaled_relative_errors(model.forward(vectors), observed, norms)
    return Verification(sequences=len(vectors), max_relative_error=float(err.max()),
                        median_relative_error=float(np.median(err)), tolerance=tolerance,
                        lengths=(1, 1))
