"""A one-hidden-layer ReLU network WITH biases, from single-vector queries (critical points on lines).

Model: F(x) = sum_i w_i ReLU(p_i^T x + b_i) + c0, P (m, d), b (m,), w (m,), c0 scalar,
queried as length-1 sequences [x] (Carlini, Jagielski and Mironov 2020, one hidden
layer). Identifiable: the function, so the units up to permutation and positive
rescaling (p_i, b_i, w_i) -> (c p_i, c b_i, w_i / c), c > 0; units with p_i = 0 are
constants and merge into c0. Canonical form: rows p_i of unit norm, the scale in w.
Free parameters: m (d + 1) + 1.

Identities. F is piecewise affine; its kinks lie on the hyperplanes p_i^T x + b_i = 0
(not through the origin, so the half-circle walk of the bias-free learner does not
apply). A line x(t) = c + t L q meets every hyperplane once (general position);
inside each interval between kinks F(x) = g^T x + e exactly, and g, e are measured
with d + 1 queries (x and d steps inside the interval). Crossing the kink of unit i
the affine piece jumps by (J, j) = +-w_i (p_i, b_i), + when the walk enters the
unit's active side. With sigma = sign(J^T q) (= sign w_i either way),

    phi(x) = sigma ReLU(sigma (J^T x + j))

is w_i ReLU(p_i^T x + b_i) when the walk entered the active side, and that minus the
affine function w_i (p_i^T x + b_i) = -(J^T x + j) when it left it. Hence, for the
units found on any lines,

    F(x) = sum_k phi_k(x) + lambda^T x + c,     lambda = -sum_{k in D} J_k,

D the units whose line left their active side. lambda is read off every measured
interval (g minus the gradients of the phi_k there): all intervals of all lines must
give the same lambda and c, which is how a missing unit (a hyperplane no line met
within reach) is noticed, and more lines are walked. D is then the 0/1 solution of
J s = -lambda (a linear solve for m <= d, a 0/1 linear program for d < m <= 2d;
unique for generic units), and c0 = c + sum_{k in D} j_k.

Two hyperplanes crossing a line at (almost) one point give one kink whose jump is the
signed sum of both units'; a unit with a small |w_i| can be measured twice, less
precisely than the repeat check. Either shows as more units than the far count; the
dependent triple (or near pair) is found and the unit whose removal lets one affine
function explain every interval is dropped (:meth:`_Units.drop_merged`).

Queries: per line the kink search (a few per kink) and d + 1 per interval next to a
kink no earlier line explained (a kink of a known unit sits where that unit predicts
it); so about m (d + 1) for the affine pieces, against the floor m (d + 1) + 1.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..errors import ModelMismatchError, NotIdentifiableError
from ..oracle import QueryAccess
from ..verification import safe_norm
from .relu_network import (
    CHORD,
    EPS,
    ROOT_SLACK,
    SLOPE_NOISE,
    _find_kinks,
    _Path,
    _query_vectors,
    _resolve_signs,
)

LINE_REACH = 4.0        # half length of a line, in units of its scale * sqrt(d)
MIN_LINES = 2
MAX_LINES = 24          # line l has scale * 2^(l // 2): hyperplanes far out are reached too
MAX_KINKS = 4096        # more kinks than this on one path: not a ReLU network
FAR_RADIUS = 1e6        # the half circle at this radius (times scale) counts the units
FIRST_STEP = 0.02       # first step h: this fraction of the interval's half length / sqrt(d)
STEP_FRACTION = 0.25    # re-measured step: this fraction of the interval's margin
MAX_REMEASURE = 5
REPEAT_TOLERANCE = 1e-4  # a unit found again less precisely than SAME_UNIT (too many units)
MAX_MERGED = 4          # units beyond the far count looked at as merged kinks (else: not a ReLU net)
SAME_UNIT = 1e-6        # two measured hyperplanes closer than this are the same unit
POLISH_AGREEMENT = 1e-5  # a polished unit must agree with the first pass this well
AFFINE_TOLERANCE = 1e-7  # lambda, c from all intervals must agree this well (relative)
# rounded answers (relative noise nu per answer, e.g. float32):
KINK_SIGMAS = 8.0       # a slope change counts as a kink beyond this many nu max|F| / chord
KINK_RESOLUTION = 1e-4  # ... which the chord sets to this fraction of max|F| per unit t,
LONG_CHORD = 2e-3       # ... unless longer than this (of t in [0, 2]; more merged kinks),
COARSE_RESOLUTION = 1e-3  # ... when it may grow until the fraction is this
MAX_CHORD = 0.02        # longer chords merge too many kinks: too noisy
NOISY_SAME_UNIT = 1e4   # two hyperplanes within this x nu (at most 1e-2) are one unit
NOISY_AFFINE = 30.0     # lambda, c of every interval within this many expected errors
NOISY_POLISH = 0.1      # a polished unit agrees with the first pass this well
NOISE_FLOOR = 0.1       # rounding never below this x the largest answers' (line, fit)
CONFIRM_AGREEMENT = 0.1  # a unit's jump across its own hyperplane agrees this well (relative)
NOISY_KINKS = 2         # rounded answers: more kinks on a line than this x the far count + d:
                        # not a ReLU network (a smooth F shows kinks wherever the chords go)
NOISY_RETRY_NOISE = 4.0  # a line with too many kinks is searched again allowing this x the noise
NOISY_RETRIES = 2       # more lines after a joint fit that misses a unit, at most this often
NOISY_MIN_LINES = 4     # rounded answers: at least this many lines, and with a far count
NOISY_LINES = 8         # not met, this many (the joint fit's misfit then judges)
MAX_NOISY_ANGLE = 1e-2  # a jump whose direction is less certain than this (rad) is not a unit
NOISY_FIT = 30.0        # the joint fit's weighted residual may exceed the noise this much
ERROR_BAR_SIGMAS = 5.0  # the joint fit's bar: this many standard errors of its worst parameter
REFINE_ROUNDS = 20      # Gauss-Newton rounds of the joint fit to every answer,
REFINE_TRIES = 8        # ... each with up to this many dampings
FIT_ANSWERS = 20        # the joint fit uses at most this many answers per parameter
MAX_WEAK_UNITS = 2      # units sought between known kinks (too weak for the kink search)
WEAK_FIT = 3.0          # ... when the joint fit misfits by more than this x the noise,
WEAK_GAIN = 0.5         # ... and kept when they bring its misfit down by this factor
WEAK_LINES = 1          # ... on this many x d lines, each sampled at 2 m + WEAK_POINTS
WEAK_POINTS = 24        # ... evenly spaced points; a line counts where one free knot
WEAK_EXPLAINED = 0.1    # ... leaves at most this share of the known knots' misfit
KNOT_MOVE = 0.02        # ... the known knots free to move this far (of t in [-1, 1])
LOCAL_POINTS = 16       # answers per short line around a weak unit's kink
LOCAL_ROOM = 1e-2       # ... whose ball free of known kinks is at least this (x |y0|, >= 1)
LOCAL_TRIES = 3         # candidates tried (the roomiest first)
LOCAL_NEAR = 0.05        # ... first this close to the candidate (x the room), then a fifth of it
WEAK_SIGNIFICANCE = 10.0  # ... one hinge fitted to all of them, its w this many standard errors
NEAR_ADDED = 10.0       # ... and this x the offset error of a unit just added
NEAR_PLANE = 1e-3       # the joint fit starts without answers this close to a hyperplane


@dataclass(frozen=True)
class Tolerances:
    """Thresholds of the stage. ``noise`` is the relative error nu of one answer: 0 for
    float64 answers (the defaults, exact up to eps), else :func:`noisy_tolerances`."""

    noise: float = 0.0
    chord: float = CHORD
    kink_noise: float = SLOPE_NOISE * EPS
    same_unit: float = SAME_UNIT
    repeat: float = REPEAT_TOLERANCE
    polish: float = POLISH_AGREEMENT
    affine: float = AFFINE_TOLERANCE


def noisy_tolerances(noise: float) -> Tolerances:
    """Thresholds for answers off by ``noise`` relative (rounded or computed in float32).

    A kink is a change of slope, and slopes come from chords: rounding nu |F| makes a
    chord of length h off by about nu |F| / h, while a ReLU network is exactly linear
    between its kinks, so a long chord costs nothing there, but two kinks closer than a
    few chords merge. The chord is chosen so that KINK_SIGMAS times its rounding is
    KINK_RESOLUTION of max |F| per unit t (slope jumps smaller than that, relative, are
    not seen on that line), unless that chord is longer than LONG_CHORD: then it is
    LONG_CHORD, or as long as COARSE_RESOLUTION needs. Raises
    :class:`RecoveryFailedError` when that chord would exceed MAX_CHORD.
    """
    from ..errors import RecoveryFailedError

    kink_noise = KINK_SIGMAS * noise
    chord = min(kink_noise / KINK_RESOLUTION, max(LONG_CHORD, kink_noise / COARSE_RESOLUTION))
    if chord > MAX_CHORD:
        raise RecoveryFailedError(
            f"answers off by {noise:.1e} relative are too coarse for the critical-point search "
            f"of the single-token FFN: its chords would have to be {chord:.2g} of a line")
    same = min(1e-2, NOISY_SAME_UNIT * noise)
    return Tolerances(noise, chord, kink_noise, same, 10.0 * same, NOISY_POLISH, NOISY_AFFINE)


class BiasedReLUNetwork:
    """F(x) = w^T ReLU(P x + b) + c0 on vectors; called on sequences it reads x_N.

    Parameters
    ----------
    P : array (m, d)
    b, w : arrays (m,)
    c0 : float
    """

    def __init__(self, P, b, w, c0):
        self.P, self.b, self.w, self.c0 = (np.asarray(P, float), np.asarray(b, float),
                                           np.asarray(w, float), float(c0))

    @property
    def width(self) -> int:
        return self.P.shape[0]

    def forward(self, x: np.ndarray) -> np.ndarray:
        """F on vectors x (..., d) -> (...)."""
        return np.maximum(x @ self.P.T + self.b, 0.0) @ self.w + self.c0

    def pre_activations(self, x: np.ndarray) -> np.ndarray:
        return x @ self.P.T + self.b


class _Line:
    """x(t) = centre + (t - 1) L q, t in [0, 2]: the path object of the kink search."""

    def __init__(self, centre: np.ndarray, direction: np.ndarray, half_length: float):
        self.centre, self.q, self.L = centre, direction, half_length

    def points(self, t) -> np.ndarray:
        t = np.asarray(t, float)
        return self.centre[None] + ((t - 1.0) * self.L)[:, None] * self.q[None]


def affine_pieces(oracle: QueryAccess, points: np.ndarray, steps: np.ndarray,
                  basis: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Affine piece (g, e) of F at each row of ``points`` (R, d): F(x) = g^T x + e nearby.

    Probes x and x + h_r u_k (u_k the orthonormal columns of ``basis``): d + 1 queries
    per point, one batch. Returns g (R, d), e (R,).
    """
    R, d = points.shape
    probes = points[:, None, :] + steps[:, None, None] * basis.T[None]
    X = np.concatenate([points[:, None, :], probes], axis=1).reshape(R * (d + 1), d)
    f = _query_vectors(oracle, X).reshape(R, d + 1)
    g = ((f[:, 1:] - f[:, :1]) / steps[:, None]) @ basis.T
    return g, f[:, 0] - np.einsum("rd,rd->r", g, points)


class _Units:
    """Hyperplanes found so far: jumps J (k, d), offsets j (k,), signs sigma (k,), and for
    rounded answers the expected errors dJ (k,) (2-norm) and dj (k,) of J and j."""

    def __init__(self, d: int, tol: Tolerances = Tolerances()):
        self.J, self.j, self.sigma = np.empty((0, d)), np.empty(0), np.empty(0)
        self.dJ, self.dj = np.empty(0), np.empty(0)
        # 0: not checked, 1: has a jump across its own hyperplane, 2: its own jump
        self.confirmed = np.empty(0, dtype=int)
        self.tol = tol

    def normals(self) -> tuple[np.ndarray, np.ndarray]:
        norm = safe_norm(self.J, axis=1)
        return self.J / norm[:, None], self.j / norm

    def known(self, n: np.ndarray, beta: float, dn: float = 0.0, dbeta: float = 0.0) -> bool:
        """Is the hyperplane n^T x + beta = 0 (unit n; its expected errors dn in angle and
        dbeta in offset, rounded answers only) one of the units found?"""
        if not len(self.j):
            return False
        N, B = self.normals()
        cos = N @ n
        if self.tol.noise:
            dN, dB = self.plane_errors()
            angle = np.sqrt(np.maximum(2.0 * (1.0 - np.abs(cos)), 0.0))
            same = angle <= ROOT_SLACK * (dn + dN) + self.tol.same_unit
            close = (np.abs(B - np.sign(cos) * beta)
                     <= ROOT_SLACK * (dbeta + dB) + self.tol.same_unit * (1.0 + abs(beta)))
            return bool(np.any(same & close))
        same = np.abs(np.abs(cos) - 1.0) <= self.tol.same_unit
        close = np.abs(B - np.sign(cos) * beta) <= self.tol.same_unit * (1.0 + abs(beta))
        return bool(np.any(same & close))

    def plane_errors(self) -> tuple[np.ndarray, np.ndarray]:
        """Expected errors of the unit normals (angle) and offsets (rounded answers)."""
        norm = safe_norm(self.J, axis=1)
        return self.dJ / norm, (self.dj + np.abs(self.j) * self.dJ / norm) / norm

    def add(self, J, j, sigma, dJ: float = 0.0, dj: float = 0.0) -> None:
        self.J = np.vstack([self.J, J[None]])
        self.j = np.append(self.j, j)
        self.sigma = np.append(self.sigma, sigma)
        self.dJ, self.dj = np.append(self.dJ, dJ), np.append(self.dj, dj)
        self.confirmed = np.append(self.confirmed, 0)

    def sum_triple(self):
        """Three units (k, i, j) with T_k = +-T_i +-T_j (T = (J, j)), or None.

        Two hyperplanes that cross a line within the kink search's resolution give one
        kink whose jump is the signed sum of both units' jumps; its hyperplane passes
        through that crossing too, so it passes the location check. Once both units are
        also found on other lines, the three are linearly dependent like this (a generic
        network has no such triple); which one is the merged kink the affine residual
        tells (:meth:`drop_merged`).
        """
        T = np.hstack([self.J, self.j[:, None]])
        n = len(T)
        if n < 3:
            return None
        norm = safe_norm(T, axis=1)
        err = np.hypot(self.dJ, self.dj)          # rounded answers: the jumps' own errors
        signed = np.vstack([T, -T])                                       # (2n, d + 1)
        idx = np.tile(np.arange(n), 2)
        for k in range(n):
            rest = T[k][None] - signed                                    # T_k - s_i T_i
            gap = safe_norm(rest[:, None, :] - signed[None], axis=2)  # (2n, 2n)
            same = (idx[:, None] == idx[None, :]) | (idx[:, None] == k) | (idx[None, :] == k)
            gap[same] = np.inf
            a, b = np.unravel_index(np.argmin(gap), gap.shape)
            if gap[a, b] <= self.tol.same_unit * norm[k] + ROOT_SLACK * (
                    err[k] + err[idx[a]] + err[idx[b]]):
                return k, int(idx[a]), int(idx[b])
        return None

    def without(self, k: int) -> "_Units":
        out = _Units(self.J.shape[1], self.tol)
        keep = np.arange(len(self.j)) != k
        out.J, out.j, out.sigma = self.J[keep], self.j[keep], self.sigma[keep]
        out.dJ, out.dj, out.confirmed = self.dJ[keep], self.dj[keep], self.confirmed[keep]
        return out

    def near_pair(self):
        """Two units on nearly the same hyperplane (normals and offsets within
        REPEAT_TOLERANCE), or None: one unit measured twice, less precisely than
        SAME_UNIT (a small |w_i| makes its jump small against the rounding)."""
        if len(self.j) < 2:
            return None
        N, B = self.normals()
        cos = N @ N.T
        gap = np.abs(np.abs(cos) - 1.0) + np.abs(B[:, None] - np.sign(cos) * B[None, :]) / (
            1.0 + np.abs(B)[:, None])
        np.fill_diagonal(gap, np.inf)
        i, k = np.unravel_index(np.argmin(gap), gap.shape)
        return (int(i), int(k)) if gap[i, k] <= self.tol.repeat else None

    def drop_merged(self, samples, limit: int) -> int:
        """Remove merged kinks and repeats (at most ``limit``): of each dependent triple
        (or near pair), the unit whose removal leaves the smallest spread of the affine
        residual. Returns how many were removed."""
        dropped = 0
        while dropped < limit and (triple := self.sum_triple() or self.near_pair()) is not None:
            best = min(triple, key=lambda k: _affine_residual(self.without(k), samples,
                                                              self.tol)[2])
            reduced = self.without(best)
            self.J, self.j, self.sigma = reduced.J, reduced.j, reduced.sigma
            self.dJ, self.dj, self.confirmed = reduced.dJ, reduced.dj, reduced.confirmed
            dropped += 1
        return dropped

    def phi_gradient(self, x: np.ndarray) -> np.ndarray:
        """Sum over units of grad phi_k at the rows of x (R, d)."""
        on = self.sigma[None] * (x @ self.J.T + self.j[None]) > 0
        return on.astype(float) @ self.J

    def phi(self, x: np.ndarray) -> np.ndarray:
        u = x @ self.J.T + self.j[None]
        return (self.sigma[None] * np.maximum(self.sigma[None] * u, 0.0)).sum(axis=1)


def _walk_line(oracle, line: _Line, rng, units: _Units, basis, counts,
               max_kinks: int = MAX_KINKS) -> list:
    """Kinks of one line; measures the intervals next to unexplained kinks; adds their units.

    Returns the measured (points, g, e) of this line (for the lambda check).
    """
    before = oracle.queries
    tol = units.tol
    try:
        kinks, kink_error, _ = _find_kinks(oracle, line, rng, homogeneous=False,
                                           max_kinks=max_kinks, chord=tol.chord,
                                           noise=tol.kink_noise)
    except ModelMismatchError:
        if not tol.noise:
            raise
        # a forward pass in low precision rounds its terms: where they cancel, F is
        # rounded by more than the measured noise relative to it and false kinks appear.
        # The line is searched once more allowing NOISY_RETRY_NOISE times the noise (a
        # smooth F still shows its kinks everywhere and is refused)
        kinks, kink_error, _ = _find_kinks(oracle, line, rng, homogeneous=False,
                                           max_kinks=max_kinks, chord=tol.chord,
                                           noise=NOISY_RETRY_NOISE * tol.kink_noise)
    counts["kink search"] = counts.get("kink search", 0) + oracle.queries - before
    K = len(kinks)
    ends = np.concatenate([[0.0], kinks, [2.0]])
    mid_t = 0.5 * (ends[:-1] + ends[1:])
    half = 0.5 * (ends[1:] - ends[:-1]) * line.L           # half interval length in x units
    kink_points = line.points(kinks) if K else np.empty((0, oracle.dim))
    # kinks a known unit explains: it crosses the line there
    new = np.ones(K, dtype=bool)
    if K and len(units.j):
        N, B = units.normals()
        with np.errstate(divide="ignore", invalid="ignore"):
            t_pred = 1.0 - (N @ line.centre + B) / (line.L * (N @ line.q))
        for j in range(K):
            new[j] = not np.any(np.abs(t_pred - kinks[j]) <= ROOT_SLACK * kink_error[j] + 1e-12)
    measure = np.zeros(K + 1, dtype=bool)
    measure[0] = True
    measure[:-1] |= new
    measure[1:] |= new
    idx = np.flatnonzero(measure)
    points = line.points(mid_t[idx])
    steps = np.maximum(FIRST_STEP * half[idx] / math.sqrt(oracle.dim), 1e-12)
    oracle.require(len(idx) * (oracle.dim + 1), "affine pieces of the line's intervals")
    g, e = affine_pieces(oracle, points, steps, basis)
    counts["affine pieces"] = counts.get("affine pieces", 0) + len(idx) * (oracle.dim + 1)
    slot = {r: i for i, r in enumerate(idx)}
    tangent = line.L * line.q
    new_k = np.flatnonzero(new)
    previous_bad = None
    for attempt in range(MAX_REMEASURE + 1):
        J = np.array([g[slot[k + 1]] - g[slot[k]] for k in new_k]).reshape(-1, oracle.dim)
        jj = np.array([e[slot[k + 1]] - e[slot[k]] for k in new_k])
        norms = safe_norm(J, axis=1)
        with np.errstate(divide="ignore", invalid="ignore"):
            n = J / norms[:, None]
            beta = jj / norms
            offset = (np.abs(np.einsum("kd,kd->k", n, kink_points[new_k]) + beta)
                      / np.abs(n @ tangent))
        slack = ROOT_SLACK * kink_error[new_k] + 1e-12
        if tol.noise:
            # the jump's own rounding: both gradients, carried from their points to the kink
            dg = _gradient_noise(tol, g, e, points, steps)
            lo, hi = [slot[k] for k in new_k], [slot[k + 1] for k in new_k]
            reach = (dg[lo] * safe_norm(kink_points[new_k] - points[lo], axis=1)
                     + dg[hi] * safe_norm(kink_points[new_k] - points[hi], axis=1))
            with np.errstate(divide="ignore", invalid="ignore"):
                slack = slack + ROOT_SLACK * reach / (norms * np.abs(n @ tangent))
        bad = ~(offset <= slack) | (norms == 0)
        # margins of the measured points to every hyperplane known or just measured
        planes_n = np.vstack([units.normals()[0], n[~bad]]) if len(units.j) else n[~bad]
        planes_b = np.concatenate([units.normals()[1], beta[~bad]]) if len(units.j) else beta[~bad]
        margins = (np.abs(points @ planes_n.T + planes_b[None]).min(axis=1)
                   if len(planes_b) else np.full(len(idx), np.inf))
        too_far = steps >= 0.5 * margins
        redo = too_far.copy()
        for k, b_ in zip(new_k, bad):
            if b_:
                redo[slot[k]] = redo[slot[k + 1]] = True
        if not redo.any() or attempt == MAX_REMEASURE or (
                previous_bad is not None and bad.sum() >= previous_bad > 0 and not too_far.any()):
            break
        previous_bad = int(bad.sum())
        if tol.noise:
            # rounded answers: a shorter step only adds rounding; a kink that fails its
            # location check is left to the other lines (its intervals are not trusted)
            redo = too_far
            if not redo.any():
                break
        steps = np.where(too_far, STEP_FRACTION * margins, np.where(redo, steps / 16.0, steps))
        steps = np.maximum(steps, 1e-12)
        r = np.flatnonzero(redo)
        oracle.require(len(r) * (oracle.dim + 1), "re-measuring affine pieces")
        g[r], e[r] = affine_pieces(oracle, points[r], steps[r], basis)
        counts["re-measured"] = counts.get("re-measured", 0) + len(r) * (oracle.dim + 1)
    dJ, dj = np.zeros(len(new_k)), np.zeros(len(new_k))
    if tol.noise and len(new_k):
        dg = _gradient_noise(tol, g, e, points, steps)
        de = dg * safe_norm(points, axis=1) + tol.noise * np.abs(e + np.einsum(
            "rd,rd->r", g, points))
        lo, hi = [slot[k] for k in new_k], [slot[k + 1] for k in new_k]
        dJ, dj = np.hypot(dg[lo], dg[hi]), de[lo] + de[hi]
    for i in range(len(new_k)):
        with np.errstate(divide="ignore", invalid="ignore"):
            dn, dbeta = dJ[i] / norms[i], (dj[i] + abs(jj[i]) * dJ[i] / norms[i]) / norms[i]
        if bad[i] or dn > MAX_NOISY_ANGLE or units.known(n[i], beta[i], dn, dbeta):
            continue            # merged kinks (another line separates them) or a repeat
        units.add(J[i], jj[i], float(np.sign(J[i] @ line.q)), dJ[i], dj[i])
    # intervals next to a rejected kink may straddle an unseen hyperplane: not used
    trusted = np.ones(len(idx), dtype=bool)
    for k, b_ in zip(new_k, bad):
        if b_:
            trusted[slot[k]] = trusted[slot[k + 1]] = False
    if tol.noise:
        return [(points[trusted], g[trusted], e[trusted],
                 _gradient_noise(tol, g, e, points, steps)[trusted], steps[trusted])]
    return [(points[trusted], g[trusted], e[trusted])]


def _gradient_noise(tol: Tolerances, g, e, points, steps) -> np.ndarray:
    """Expected error (2-norm) of gradients from d forward differences of rounded answers
    (relative noise tol.noise), per measured point (R,)."""
    F = np.abs(e + np.einsum("rd,rd->r", g, points))
    # a forward pass rounds its terms, not its sum: where F nearly cancels, the error is
    # that of the line's larger answers
    F = np.maximum(F, NOISE_FLOOR * F.max(initial=0.0))
    return math.sqrt(2.0 * points.shape[1]) * tol.noise * F / steps


def _count_far(oracle: QueryAccess, rng, scale: float, counts: dict,
               tol: Tolerances = Tolerances()) -> int:
    """Units seen on a half circle of radius FAR_RADIUS * scale: far out the biases hardly
    move the kinks, and a half circle meets every hyperplane's direction once, so this
    counts the units (generically) however far from the origin their hyperplanes lie."""
    frame, _ = np.linalg.qr(rng.standard_normal((oracle.dim, 2)))
    radius = FAR_RADIUS * scale
    path = _Path(radius * frame[:, 0], radius * frame[:, 1])
    before = oracle.queries
    kinks, _, _ = _find_kinks(oracle, path, rng, homogeneous=False, max_kinks=MAX_KINKS,
                              chord=tol.chord, noise=tol.kink_noise)
    counts["far count"] = counts.get("far count", 0) + oracle.queries - before
    return len(kinks)


def _affine_residual(units: _Units, samples,
                     tol: Tolerances = Tolerances()) -> tuple[np.ndarray, float, float]:
    """lambda, c from every measured interval, and their spread: relative for exact
    answers; in expected errors of each interval's gradient for rounded ones."""
    if tol.noise and len(units.j):
        # rounded answers: a piece measured across a hyperplane found since (its steps
        # reach it, allowing for the hyperplanes' own errors) is no sample (exact
        # answers re-measure such pieces while walking)
        N, B = units.normals()
        dN, dB = units.plane_errors()
        samples = [(s[0][k], s[1][k], s[2][k], s[3][k], s[4][k]) for s in samples
                   for k in [np.all(np.abs(s[0] @ N.T + B) - ROOT_SLACK * (
                       dB + np.outer(safe_norm(s[0], axis=1), dN)) > s[4][:, None], axis=1)]]
    X = np.vstack([s[0] for s in samples])
    G = np.vstack([s[1] for s in samples])
    E = np.concatenate([s[2] for s in samples])
    F = E + np.einsum("rd,rd->r", G, X)
    if len(units.j):
        lam_r = G - units.phi_gradient(X)
        c_r = F - units.phi(X) - np.einsum("rd,rd->r", lam_r, X)
    else:
        lam_r, c_r = G, E
    if not len(c_r):        # no sample left (e.g. every one overflowed): nothing fits
        return np.zeros(X.shape[1] if np.ndim(X) == 2 else 0), 0.0, math.inf
    lam = np.median(lam_r, axis=0)
    c = float(np.median(c_r))
    scale_g = max(float(np.abs(G).max(initial=0.0)),
                  float(np.abs(units.J).max(initial=0.0)) if len(units.j) else 0.0, 1e-300)
    scale_f = max(float(np.abs(F).max(initial=0.0)), 1e-300)
    if tol.noise:
        # each interval's gradient error plus every unit's (their phi_k enter lambda, c)
        dg = np.concatenate([s[3] for s in samples]) + safe_norm(units.dJ)
        dc = dg * safe_norm(X, axis=1) + units.dj.sum() + tol.noise * np.abs(F)
        with np.errstate(divide="ignore", invalid="ignore"):
            spread = max(float(np.max(safe_norm(lam_r - lam, axis=1) / dg, initial=0.0)),
                         float(np.max(np.abs(c_r - c) / dc, initial=0.0)))
        return lam, c, spread
    spread = max(float(np.abs(lam_r - lam).max(initial=0.0)) / scale_g,
                 float(np.abs(c_r - c).max(initial=0.0)) / scale_f)
    return lam, c, spread


def extract_biased_relu(oracle: QueryAccess, rng: np.random.Generator, *, scale: float = 1.0,
                        counts: dict | None = None, polish: bool = True,
                        tolerances: Tolerances = Tolerances()) -> tuple[BiasedReLUNetwork, dict]:
    """Recover F(x) = w^T ReLU(P x + b) + c0 from single-vector queries.

    Parameters
    ----------
    oracle : Oracle
        Door to the black box (or a derived oracle), queried with length-1 sequences.
    rng : numpy Generator
        Random lines (centres N(0, scale^2 I), random directions) and step bases.
    scale : float
        Where the hyperplanes are: lines reach LINE_REACH * scale * sqrt(d) either
        side of their centre.
    counts : dict, optional
        Query counts per step are added to it.
    polish : bool
        Measure every unit again across its hyperplane far from the others
        (:func:`_polish`, 2 m (d + 1) queries): from about 2^-28 to about 2^-40.
    tolerances : Tolerances
        The stage's thresholds; the default is for float64 answers. For rounded answers
        (:func:`noisy_tolerances`) the chords are longer, the checks allow the measured
        gradients' rounding, and every answer of the stage then enters one joint
        least-squares fit of all parameters (:func:`refine_network`, no extra queries);
        ``info["error bar"]`` is its bound on the largest canonical parameter error.

    Returns
    -------
    (BiasedReLUNetwork, dict)
        The network in canonical form (rows of P of unit norm) and details (units,
        lines walked, sign method, spread of the affine residual).

    Raises
    ------
    NotIdentifiableError
        F is constant on every line (no unit seen).
    ModelMismatchError
        No set of units explains F (the affine residual differs between intervals after
        MAX_LINES lines, or no 0/1 sign pattern fits): not a ReLU network in general
        position.
    """
    counts = {} if counts is None else counts
    tol = tolerances
    if tol.noise:
        oracle = _Recorder(oracle)           # every answer enters the joint fit at the end
    d = oracle.dim
    m_far = _count_far(oracle, rng, scale, counts, tol)
    units = _Units(d, tol)
    samples = []
    spread = math.inf
    lines = merged = 0
    min_lines, retries = NOISY_MIN_LINES, 0
    while True:     # once for exact answers; rounded ones may walk more lines
        while lines < MAX_LINES:
            line_scale = scale * 2.0 ** (lines // 2)
            centre = line_scale * rng.standard_normal(d)
            direction = rng.standard_normal(d)
            direction /= safe_norm(direction)
            basis = np.linalg.qr(rng.standard_normal((d, d)))[0]
            line = _Line(centre, direction, LINE_REACH * line_scale * math.sqrt(d))
            samples += _walk_line(oracle, line, rng, units, basis, counts,
                                  NOISY_KINKS * m_far + d if tol.noise else MAX_KINKS)
            lines += 1
            if m_far < len(units.j) <= m_far + MAX_MERGED:   # one more per merged kink
                merged += units.drop_merged(samples, len(units.j) - m_far)
            lam, c, spread = _affine_residual(units, samples, tol)
            if (tol.noise and lines >= MIN_LINES and spread > tol.affine and len(units.j) >= m_far
                    and _confirm_units(oracle, units, rng, scale, counts)):
                lam, c, spread = _affine_residual(units, samples, tol)
            if lines >= MIN_LINES and spread <= tol.affine and len(units.j) >= m_far and (
                    not tol.noise or lines >= min_lines):
                break
            if tol.noise and lines >= max(NOISY_LINES, min_lines) and spread <= tol.affine:
                break       # rounded answers: the far count may miss a weak kink or see two
        if tol.noise and _confirm_units(oracle, units, rng, scale, counts, ghosts=True):
            # a unit with no jump across its own hyperplane (a false kink of the rounding)
            # would start the joint fit from a wrong minimum
            lam, c, spread = _affine_residual(units, samples, tol)
        m = len(units.j)
        if m == 0:
            if spread <= tol.affine and not np.any(lam):
                raise NotIdentifiableError("F is constant on every line: no hidden unit can be identified")
            raise ModelMismatchError("F has no kink on any line but is not constant: not a ReLU network")
        if spread > tol.affine or (m < m_far and not tol.noise):
            raise ModelMismatchError(
                f"after {lines} lines the {m} units found (of {m_far} seen far out) leave a residual "
                f"that is not one affine function (spread {spread:.1e}): not a one-hidden-layer "
                f"ReLU network")
        try:
            s, method = (_resolve_signs(units.J.T, lam) if not tol.noise else
                         _closest_signs(units.J.T, lam))
        except Exception as exc:       # the bias-free learner's plane failure: no 0/1 pattern
            raise ModelMismatchError(f"no sign pattern of the {m} units explains the linear part of F "
                                     f"({exc})") from exc
        norm = safe_norm(units.J, axis=1)
        orient = units.sigma * (1.0 - 2.0 * s)
        P = orient[:, None] * units.J / norm[:, None]
        b = orient * units.j / norm
        w = units.sigma * norm
        c0 = c + float(units.j @ s)
        net = BiasedReLUNetwork(P, b, w, c0)
        info = {"hidden units": m, "units far out": m_far, "lines": lines, "signs": method,
                "merged kinks dropped": merged,
                "affine residual spread": f"{spread:.1e}"}
        if polish:
            net, info["polish"] = _polish(oracle, net, rng, scale, counts, tol.polish)
        if tol.noise:
            assert isinstance(oracle, _Recorder)     # wrapped above when tol.noise
            X, F = oracle.answers()
            # the hyperplanes as measured, before the joint fit: a fit that lacks a unit
            # pulls the others off to absorb it, and their knots then leave a misfit that
            # the search between known kinks takes for a new unit
            measured = net
            net, fit = refine_network(net, X, F, tol.noise)
            info.update(fit)
            retries += 1
            weak = 0
            while not fit["measured noise"] <= WEAK_FIT * tol.noise and weak < MAX_WEAK_UNITS:
                # a unit too weak for the kink search, sought where the others' kinks are
                # known; kept only if the fit improves by WEAK_GAIN (a forward pass in low
                # precision also misfits by several times the stated rounding)
                found = _weak_unit(oracle, measured, rng, scale, tol, counts)
                if found is None:
                    break
                X, F = oracle.answers()
                starts = [_with_unit(base, sign, *found[0]) for base in (measured, net)
                          for sign in (1.0, -1.0)]
                better, refit = min((refine_network(start, X, F, tol.noise, found[1])
                                     for start in starts),
                                    key=lambda out: out[1]["measured noise"])
                if not refit["measured noise"] <= WEAK_GAIN * fit["measured noise"]:
                    break
                measured = starts[0]
                net, fit = better, refit
                info.update(fit)
                weak += 1
            # a unit whose w_i is within its own bar explains nothing (a false kink, or one
            # unit taken twice): dropped, and the rest fitted again
            keep = np.abs(net.w) > fit["unit bars"][1]
            if not keep.all() and keep.any():
                net = BiasedReLUNetwork(net.P[keep], net.b[keep], net.w[keep], net.c0)
                net, fit = refine_network(net, *oracle.answers(), tol.noise)
                info.update(fit)
                info["units dropped (w within its bar)"] = int((~keep).sum())
            if weak or not keep.all():
                info["hidden units"] = net.width
            if weak:
                info["weak units found between known kinks"] = weak
            if (not fit["measured noise"] <= NOISY_FIT * tol.noise and lines < MAX_LINES
                    and retries <= NOISY_RETRIES):
                # a unit too weak for the lines so far (its jump within their rounding), or
                # one taken for two: more lines, until one more unit is found
                m_far, min_lines = max(m_far, m + 1), lines + NOISY_MIN_LINES
                continue
            if not fit["measured noise"] <= NOISY_FIT * tol.noise:
                from ..errors import RecoveryFailedError
                raise RecoveryFailedError(
                    f"the {net.width} units found do not fit the answers to their rounding "
                    f"(weighted residual {fit['measured noise']:.1e}, rounding {tol.noise:.1e}) "
                    f"after {lines} lines and the search between known kinks: a unit whose "
                    f"kinks stay within the rounding on every line "
                    f"(the learner's limit at this precision), or not a one-hidden-layer ReLU "
                    f"network; nothing is returned. Answers in float64 avoid the limit")
        break
    return net, info


def _weak_unit(oracle, net: BiasedReLUNetwork, rng, scale: float, tol: Tolerances,
               counts: dict):
    """Rounded answers: one unit the kink search missed, found between the known kinks.

    A unit with a small |w_i| changes the slope of F by less than the kink search can
    tell from the rounding of F (its threshold is relative to max |F| on a line, and two
    kinks within a chord merge). Once the other units are known, so are their crossings
    of any line: on WEAK_LINES d random lines, each sampled at 2 m + WEAK_POINTS evenly
    spaced points, F is fitted by the continuous piecewise-linear function with knots at
    those crossings (each free to move by KNOT_MOVE: the fitted units are pulled off by
    the missing one), then with one more free knot. Where that knot explains most of the
    misfit and leaves only the rounding, it is a candidate point on the missing unit's
    hyperplane. Around the candidate farthest from the known hyperplanes,
    :func:`_local_plane` measures the hyperplane and w on short lines.
    Returns ((n, beta, w) of the unit, unit normal n (d,); the bar of its offset), or None.
    """
    from scipy.optimize import least_squares

    m, d = net.P.shape
    n_lines = WEAK_LINES * d
    centres = scale * rng.standard_normal((n_lines, d))
    dirs = rng.standard_normal((n_lines, d))
    dirs /= safe_norm(dirs, axis=1)[:, None]
    half = LINE_REACH * scale * math.sqrt(d)
    n_points = 2 * m + WEAK_POINTS
    t = np.linspace(-1.0, 1.0, n_points)
    X = centres[:, None, :] + (half * t)[None, :, None] * dirs[:, None, :]
    oracle.require(n_lines * n_points, "seeking a weak unit on lines with known kinks")
    F = _query_vectors(oracle, X.reshape(-1, d)).reshape(n_lines, n_points)
    counts["weak-unit lines"] = counts.get("weak-unit lines", 0) + n_lines * n_points
    weight = 1.0 / (np.abs(F) + NOISE_FLOOR * np.median(np.abs(F)) + 1e-300)
    with np.errstate(divide="ignore", invalid="ignore"):
        knots = -(centres @ net.P.T + net.b) / (half * dirs @ net.P.T)      # (lines, m)
    points, qs = [], []
    for line in range(n_lines):
        wl, f = weight[line], F[line] * weight[line]
        known = knots[line][np.abs(knots[line]) < 1.0]

        def fit(s):
            """Weighted residual and coefficients of the spline with knots s."""
            M = np.column_stack([np.ones_like(t), t, np.maximum(t[:, None] - s[None], 0.0)])
            M = M * wl[:, None]
            c = np.linalg.lstsq(M, f, rcond=None)[0]
            return M @ c - f, c

        def free(s0):
            """The knots s0 moved (each by at most KNOT_MOVE) to fit F best."""
            if not len(s0):
                return s0
            return least_squares(lambda s: fit(s)[0], s0, bounds=(s0 - KNOT_MOVE, s0 + KNOT_MOVE),
                                 x_scale=KNOT_MOVE, xtol=1e-12).x

        known = free(known)
        spline = float(np.sum(fit(known)[0] ** 2))
        mids = 0.5 * (t[1:-2] + t[2:-1])
        extra = mids[int(np.argmin([np.sum(fit(np.append(known, s))[0] ** 2) for s in mids]))]
        knots_all = free(np.append(known, extra))
        sse = float(np.sum(fit(knots_all)[0] ** 2))
        dof = max(n_points - len(knots_all) * 2 - 2, 1)
        if (sse <= WEAK_EXPLAINED * spline
                and spline > (KINK_SIGMAS * tol.noise) ** 2 * dof
                and sse <= (NOISY_FIT * tol.noise) ** 2 * dof):
            points.append(centres[line] + half * knots_all[-1] * dirs[line])
            qs.append(dirs[line])
    # the candidates farthest from every known hyperplane first: the short lines around
    # them see no other kink
    norm = safe_norm(net.P, axis=1)
    room = [float((np.abs(net.P @ y + net.b) / norm).min()) for y in points]
    for k in np.argsort(room)[::-1][:LOCAL_TRIES]:
        found = _local_plane(oracle, net, points[k], qs[k], tol, counts)
        if found is not None:
            n, beta, w, off = found
            break
    else:
        return None
    return (n, beta, w), off


def _with_unit(net: BiasedReLUNetwork, sign: float, n, beta: float, w: float):
    """``net`` with the unit w ReLU(sign (n^T x + beta)) added: w ReLU(z) and w ReLU(-z)
    have the same kinks (they differ by the affine w z), the joint fit tells them apart."""
    return BiasedReLUNetwork(np.vstack([net.P, sign * n]), np.append(net.b, sign * beta),
                             np.append(net.w, w), net.c0)


def _local_plane(oracle, net: BiasedReLUNetwork, y0, q, tol: Tolerances, counts: dict):
    """The hyperplane of the one kink near y0 along q, from short lines around it.

    ``room``, y0's distance to the known hyperplanes, bounds a ball with no other kink:
    the lines y0 +- rho v_k + s q (v_k an orthonormal basis of q's complement, rho
    LOCAL_NEAR of the room, |s| up to 0.7 of it) each cross the new hyperplane once; one
    hinge fitted to each (LOCAL_POINTS answers) gives 2 d - 1 points on it, total least
    squares a first plane, and one hinge fitted to all answers at once a better one
    (:func:`_joint_hinge`). 2 d - 2 more lines a fifth of the room out, each centred on
    that plane, and the joint fit to every answer give (n (d,), beta). Returns (n, beta,
    w, the bar of its offset at y0); None when the room is too small, fewer than d + 1
    lines show their hinge at the rounding, or a joint fit finds no hinge.
    """
    d = len(y0)
    norm = safe_norm(net.P, axis=1)
    room = float((np.abs(net.P @ y0 + net.b) / norm).min())
    if not room > LOCAL_ROOM * max(1.0, safe_norm(y0)):
        return None
    V = np.linalg.svd(np.eye(d) - np.outer(q, q))[0][:, :d - 1]        # q's complement
    reach = 0.7 * room
    s = np.linspace(-reach, reach, LOCAL_POINTS)

    def short_lines(starts):
        X = starts[:, None, :] + s[None, :, None] * q[None, None, :]
        oracle.require(X.shape[0] * LOCAL_POINTS, "measuring a weak unit's hyperplane")
        F = _query_vectors(oracle, X.reshape(-1, d)).reshape(X.shape[:2])
        counts["weak-unit lines"] = counts.get("weak-unit lines", 0) + X.size // d
        return X, F

    # first lines close to y0 (LOCAL_NEAR of the room): a hyperplane at a small angle to q
    # still crosses each within its reach (one it misses leaves n's component along that
    # line's offset free, and a wrong plane fits as well)
    starts = np.vstack([y0, y0 + LOCAL_NEAR * room * V.T, y0 - LOCAL_NEAR * room * V.T])
    X, F = short_lines(starts)
    first = _knot_plane(X, F, s, q, starts, tol)
    if first is None:
        return None
    first = _joint_hinge(X, F, s, first[0], first[1], first[2], y0, tol)     # from (n, beta, w)
    if first is None:
        return None
    # then lines a fifth of the room out, each moved along q to cross the plane found at
    # its middle: the plane's direction from knots farther apart, fitted to all answers
    n1, beta1 = first[:2]
    starts = np.vstack([y0 + 0.2 * room * V.T, y0 - 0.2 * room * V.T])
    with np.errstate(divide="ignore", invalid="ignore"):
        shift = -(starts @ n1 + beta1) / (n1 @ q)
    starts = starts + np.clip(np.nan_to_num(shift), -0.5 * reach, 0.5 * reach)[:, None] * q[None]
    X2, F2 = short_lines(starts)
    return _joint_hinge(np.concatenate([X, X2]), np.concatenate([F, F2]), s,
                        first[0], first[1], first[2], y0, tol)


def _knot_plane(X, F, s, q, starts, tol: Tolerances):
    """One hinge fitted to each short line alone, total least squares through its knots:
    the start (n, beta, w) of :func:`_joint_hinge`, or None (fewer than d + 1 lines show
    their hinge at the rounding)."""
    from scipy.optimize import minimize_scalar

    d = X.shape[2]
    reach = float(s[-1])
    points, slopes = [], []
    for f in F:
        wl = 1.0 / (np.abs(f) + NOISE_FLOOR * np.median(np.abs(f)) + 1e-300)

        def misfit(knot, slope=False):
            M = np.column_stack([np.ones_like(s), s, np.maximum(s - knot, 0.0)]) * wl[:, None]
            c = np.linalg.lstsq(M, f * wl, rcond=None)[0]
            return c[-1] if slope else float(np.sum((M @ c - f * wl) ** 2))

        mids = 0.5 * (s[1:-2] + s[2:-1])
        j = int(np.argmin([misfit(k) for k in mids]))
        knot = float(minimize_scalar(misfit, bounds=(s[j], s[j + 3]), method="bounded",
                                     options={"xatol": 1e-12 * reach}).x)
        fits = misfit(knot) <= (NOISY_FIT * tol.noise) ** 2 * (LOCAL_POINTS - 4)
        points.append(knot if fits else np.nan)
        slopes.append(misfit(knot, slope=True))
    ok = np.isfinite(points)
    if ok.sum() < d + 1:
        return None
    Y = starts[ok] + np.array(points)[ok, None] * q[None]
    mean = Y.mean(axis=0)
    n = np.linalg.svd(Y - mean, full_matrices=False)[2][-1]
    # each knot alone is located only to the rounding over the hinge's slope change, which
    # for a weak unit is a sizeable share of the room: this is a start only
    return n, -float(n @ mean), float(np.median(np.array(slopes)[ok]) / (n @ q))


def _joint_hinge(X, F, s, n0, beta0, w0, y0, tol: Tolerances):
    """One hinge w ReLU(n^T x + beta) shared by the short lines X (L, P, d) with answers F
    (L, P) at positions s (P,) along each, plus an affine part per line, fitted to all
    answers (weighted like :func:`refine_network`), from (n0, beta0, w0).

    Returns (n, beta, w, the offset's bar at y0: ERROR_BAR_SIGMAS standard errors of
    n^T y0 + beta) or None: the fit misfits beyond NOISY_FIT x the noise, w is within
    WEAK_SIGNIFICANCE standard errors of zero (no hinge there: a knot of the rounding), or
    the hyperplane does not cross the lines.
    """
    from scipy.optimize import least_squares

    L, npts, d = X.shape
    x = X.reshape(-1, d)
    f = F.reshape(-1)
    weight = 1.0 / (np.abs(f) + NOISE_FLOOR * np.median(np.abs(f)) + 1e-300)
    line = np.repeat(np.arange(L), npts)
    ss = np.tile(s, L)
    design = np.zeros((len(f), 2 * L))
    design[np.arange(len(f)), line] = 1.0
    design[np.arange(len(f)), L + line] = ss

    def split(theta):
        nn = theta[:d] / safe_norm(theta[:d])
        return nn, theta[d], theta[d + 1], theta[d + 2:]

    def residual(theta):
        nn, beta, w, affine = split(theta)
        return (design @ affine + w * np.maximum(x @ nn + beta, 0.0) - f) * weight

    def jacobian(theta):
        nn, beta, w, _ = split(theta)
        on = (x @ nn + beta > 0).astype(float)
        dn = (w * on)[:, None] * (x - np.outer(x @ nn, nn)) / safe_norm(theta[:d])
        return np.column_stack([dn, w * on, np.maximum(x @ nn + beta, 0.0),
                                design]) * weight[:, None]

    hinge = np.maximum(x @ n0 + beta0, 0.0)
    affine0 = np.linalg.lstsq(design, f - w0 * hinge, rcond=None)[0]
    fit = least_squares(residual, np.concatenate([n0, [beta0, w0], affine0]), jac=jacobian,
                        x_scale="jac", xtol=1e-12, ftol=1e-12)
    nn, beta, w, _ = split(fit.x)
    dof = max(len(f) - (d + 2 * L + 1), 1)
    sigma = math.sqrt(2.0 * fit.cost / dof)
    if not sigma <= NOISY_FIT * tol.noise:
        return None
    J = jacobian(fit.x)
    # the norm of n is a gauge: its direction dropped from the covariance
    gauge = np.concatenate([nn, np.zeros(J.shape[1] - d)])
    cov = sigma ** 2 * np.linalg.pinv(J.T @ J + np.outer(gauge, gauge) * float(np.sum(J ** 2)))
    dw = math.sqrt(max(cov[d + 1, d + 1], 0.0))
    grad = np.concatenate([y0 - (y0 @ nn) * nn, [1.0]])       # of n^T y0 + beta in (n, beta)
    doff = math.sqrt(max(float(grad @ cov[:d + 1, :d + 1] @ grad), 0.0))
    if not abs(w) > WEAK_SIGNIFICANCE * dw or not np.any(x @ nn + beta > 0) or np.all(
            x @ nn + beta > 0):
        return None
    return nn, float(beta), float(w), ERROR_BAR_SIGMAS * doff


def crossing_points(net: BiasedReLUNetwork, rng, scale: float):
    """For every unit k a point y_k on its hyperplane, as far (r_k) from all others as a
    linear program finds inside the cell of the others' sign pattern at a random point's
    projection, with |y_i| <= max(4 scale, 3 max |b|). Rows of net.P must have unit norm.

    Returns (units (n,), y (n, d), r (n,)): the units for which a cell was found.
    """
    from scipy.optimize import linprog

    m, d = net.P.shape
    box = max(4.0 * scale, 3.0 * float(np.abs(net.b).max()))
    points, radii, units = [], [], []
    for k in range(m):
        others = np.delete(np.arange(m), k)
        z = scale * rng.standard_normal(d)
        y0 = z - (net.P[k] @ z + net.b[k]) * net.P[k]
        sigma = np.where(net.P[others] @ y0 + net.b[others] >= 0, 1.0, -1.0)
        # maximise r: sigma_j (p_j^T y + b_j) >= r (|p_j| = 1), p_k^T y = -b_k
        res = linprog(np.concatenate([np.zeros(d), [-1.0]]),
                      A_ub=np.hstack([-sigma[:, None] * net.P[others], np.ones((m - 1, 1))]),
                      b_ub=sigma * net.b[others], A_eq=np.concatenate([net.P[k], [0.0]])[None],
                      b_eq=[-net.b[k]], bounds=[(-box, box)] * d + [(0, None)], method="highs")
        if res.status != 0 or not res.x[-1] > 0:
            continue
        units.append(k)
        points.append(res.x[:d])
        radii.append(res.x[-1])
    return np.array(units, dtype=int), np.array(points).reshape(-1, d), np.array(radii)


def _polish(oracle: QueryAccess, net: BiasedReLUNetwork, rng, scale: float, counts: dict,
            agreement: float = POLISH_AGREEMENT):
    """Measure every unit again across its hyperplane, at the point farthest from the others.

    For unit k a linear program finds y on p_k^T y + b_k = 0, inside the cell of the
    sign pattern of the others at a random point's projection, at the largest distance
    r from every other hyperplane (|y_i| <= 4 scale). The affine pieces at
    y +- (r / 2) p_k differ by exactly w_k (p_k, b_k) (the + side is the active one):
    2 (d + 1) queries per unit, steps r / 4. c0 is read again at those 2m points. A
    polished unit replaces the first one only if the two agree to POLISH_AGREEMENT.
    """
    m, d = net.P.shape
    measured = _across(oracle, net, rng, scale, counts, "polish")
    if measured is None:
        return net, "skipped (no cell found)"
    units, points, steps, g, e, Jp, jp = measured
    first = net.w[units, None] * np.hstack([net.P[units], net.b[units, None]])
    new = np.hstack([Jp, jp[:, None]])
    agree = (safe_norm(new - first, axis=1)
             <= agreement * safe_norm(first, axis=1))
    P, b, w = net.P.copy(), net.b.copy(), net.w.copy()
    keep = units[agree]
    size = safe_norm(Jp[agree], axis=1)
    P[keep] = Jp[agree] * np.sign(w[keep])[:, None] / size[:, None]
    b[keep] = jp[agree] * np.sign(w[keep]) / size
    w[keep] = size * np.sign(w[keep])
    polished = BiasedReLUNetwork(P, b, w, 0.0)
    F = e + np.einsum("rd,rd->r", g, points)
    c0 = float(np.median(F - polished.forward(points))) if agree.all() else net.c0
    return BiasedReLUNetwork(P, b, w, c0), (
        f"{int(agree.sum())} of {m} units measured across their hyperplanes "
        f"(steps {steps.min():.3g} .. {steps.max():.3g})")


def _across(oracle: QueryAccess, net: BiasedReLUNetwork, rng, scale: float, counts: dict,
            name: str):
    """The affine pieces either side of each unit's hyperplane, at the point farthest
    from the others (:func:`crossing_points`): 2 (d + 1) queries per unit found a cell,
    steps a quarter of its room, counted as ``name``. Returns None (no cell) or (units,
    points (2k, d), steps (2k,), g, e, Jp (k, d), jp (k,)) with (Jp, jp) = w_k (p_k, b_k)
    measured."""
    d = net.P.shape[1]
    units, y, r = crossing_points(net, rng, scale)
    if not len(units):
        return None
    half = 0.5 * r[:, None] * net.P[units]
    points = np.stack([y + half, y - half], axis=1).reshape(-1, d)
    steps = np.repeat(STEP_FRACTION * r, 2)
    oracle.require(len(points) * (d + 1), "measuring the hidden units across their hyperplanes")
    basis = np.linalg.qr(rng.standard_normal((d, d)))[0]
    g, e = affine_pieces(oracle, points, steps, basis)
    counts[name] = counts.get(name, 0) + len(points) * (d + 1)
    return units, points, steps, g, e, g[0::2] - g[1::2], e[0::2] - e[1::2]


def _confirm_units(oracle: QueryAccess, units: _Units, rng, scale: float, counts: dict,
                   ghosts: bool = False) -> int:
    """Rounded answers: every unit not yet confirmed is measured across its own hyperplane
    far from the others (:func:`_across`); one whose jump there is not its own (within
    CONFIRM_AGREEMENT) is removed. A kink where two hyperplanes cross a line at nearly one
    point has the sum of both jumps and passes the location check when the check is as
    loose as far-out rounding makes it; across its own "hyperplane" elsewhere it jumps
    by nothing like that sum. ``ghosts``: only a unit whose jump there is within
    ROOT_SLACK x its rounding of zero is removed (no kink at all: a false kink of the
    rounding); a real unit far from every other crossing still jumps. Returns the number
    removed."""
    level = 1 if ghosts else 2
    todo = np.flatnonzero(units.confirmed < level)
    if not len(todo):
        return 0
    N, B = units.normals()
    net = BiasedReLUNetwork(N, B, safe_norm(units.J, axis=1), 0.0)
    measured = _across(oracle, net, rng, scale, counts, "confirming units")
    if measured is None:
        return 0
    found, points, steps, g, e, Jp = measured[:6]
    own = units.J[found]
    off = np.minimum(safe_norm(Jp - own, axis=1), safe_norm(Jp + own, axis=1))
    wrong = off > CONFIRM_AGREEMENT * safe_norm(own, axis=1)
    if ghosts:
        dg = _gradient_noise(units.tol, g, e, points, steps)
        wrong &= safe_norm(Jp, axis=1) <= ROOT_SLACK * np.hypot(dg[0::2], dg[1::2])
    wrong = set(found[wrong].tolist())
    units.confirmed[found] = np.maximum(units.confirmed[found], level)
    for k in sorted(wrong, reverse=True):
        reduced = units.without(k)
        units.__dict__.update(reduced.__dict__)
    return len(wrong)


def _closest_signs(J: np.ndarray, g0: np.ndarray) -> tuple[np.ndarray, str]:
    """Rounded answers: the 0/1 vector s minimising |J s + g0|_1 (J (d, m) the jumps as
    columns), a mixed-integer program. No tolerance decides: a unit with a small |w_i|
    moves J s by little, and any fixed tolerance would admit both its signs (the joint
    fit that follows tells a wrong pattern by its misfit). Returns (s, method)."""
    from scipy.optimize import Bounds, LinearConstraint, milp

    from .relu_network import MILP_SECONDS

    d, m = J.shape
    # variables (s (m), e (d)): minimise sum e with -e <= J s + g0 <= e
    eye = np.eye(d)
    rows = np.vstack([np.hstack([J, -eye]), np.hstack([J, eye])])
    bounds = np.concatenate([np.full(d, -np.inf), -g0]), np.concatenate([-g0, np.full(d, np.inf)])
    res = milp(np.concatenate([np.zeros(m), np.ones(d)]),
               constraints=LinearConstraint(rows, bounds[0], bounds[1]),
               integrality=np.concatenate([np.ones(m), np.zeros(d)]),
               bounds=Bounds(np.concatenate([np.zeros(m), np.zeros(d)]),
                             np.concatenate([np.ones(m), np.full(d, np.inf)])),
               options={"time_limit": MILP_SECONDS})
    if res.x is None:
        raise ModelMismatchError(f"no sign pattern of the units found ({res.message})")
    return np.round(res.x[:m]), "closest 0/1 pattern (L1)"


class _Recorder:
    """The oracle, keeping every single-token probe and its answer (for the joint fit)."""

    def __init__(self, oracle):
        self.base, self.dim = oracle, oracle.dim
        self._x, self._f = [], []

    def __getattr__(self, name):
        return getattr(self.base, name)

    def query(self, X) -> np.ndarray:
        X = np.asarray(X, dtype=np.float64)
        f = self.base.query(X)
        self._x.append(X[:, -1, :].copy())
        self._f.append(np.asarray(f, dtype=np.float64).copy())
        return f

    def answers(self) -> tuple[np.ndarray, np.ndarray]:
        """Every probe x (n, d) and its answer (n,)."""
        return np.vstack(self._x), np.concatenate(self._f)


def refine_network(net: BiasedReLUNetwork, X: np.ndarray, F: np.ndarray, noise: float,
                   last_unit_error: float = 0.0):
    """Joint least-squares fit of every parameter to the answers F (n,) at X (n, d).

    Rounding of relative size ``noise`` is at most a few bits per answer, so the fit
    weights each answer by 1 / (|F| + median |F| / 10) (relative rounding, with a floor
    where F passes through zero). Gauss-Newton from ``net`` (whose hyperplanes must
    already be close: samples on the wrong side of one are few and move as it moves);
    the unit scale is fixed after every step (rows of P of unit norm).

    Returns (network, info) with ``info["measured noise"]`` the weighted residual's rms
    (the answers' relative error, measured) and ``info["error bar"]`` ERROR_BAR_SIGMAS
    standard errors of the worst canonical parameter (P entries, w relative to max |w|,
    b relative to max(max |b|, 1), c0 relative to max(|c0|, max |w|)), from the fit's
    covariance at the measured noise; ``info["unit bars"]`` the same per unit, absolute:
    (largest P entry's (m,), w's (m,)).
    """
    keep = np.all(np.isfinite(X), axis=1) & np.isfinite(F)
    X, F = X[keep], F[keep]
    m, d = net.P.shape
    cap = FIT_ANSWERS * (m * (d + 2) + 1)
    if len(X) > cap:        # evenly spaced in the order asked: every stage keeps its share
        pick = np.linspace(0, len(X) - 1, cap).astype(int)
        X, F = X[pick], F[pick]
    # first without the answers within NEAR_PLANE of a hyperplane (relative to |x|): the
    # kink search put many there, and the side a start a little off gives them pulls
    # the whole fit into a wrong minimum; then with every answer
    pre = np.abs(net.pre_activations(X))
    near = pre.min(axis=1) < NEAR_PLANE * (1.0 + safe_norm(X, axis=1))
    # a unit just added (``last_unit_error``: its hyperplane's expected offset error) has
    # the answers measured around it within that error: they wait for the second fit too
    near |= pre[:, -1] < NEAR_ADDED * last_unit_error
    net, _ = _joint_fit(net, X[~near], F[~near])
    return _joint_fit(net, X, F)


def _joint_fit(net: BiasedReLUNetwork, X: np.ndarray, F: np.ndarray):
    """:func:`refine_network` on the answers given."""
    m, d = net.P.shape
    weight = 1.0 / (np.abs(F) + NOISE_FLOOR * np.median(np.abs(F)) + 1e-300)
    P, b, w, c0 = net.P.copy(), net.b.copy(), net.w.copy(), net.c0

    def jacobian(P, b, w):
        z = X @ P.T + b
        on = (z > 0).astype(float)
        cols = [(w * on)[:, :, None] * X[:, None, :], w * on, np.maximum(z, 0.0),
                np.ones((len(X), 1))]
        return np.hstack([cols[0].reshape(len(X), m * d), cols[1], cols[2], cols[3]])

    def residual(P, b, w, c0):
        return (F - (np.maximum(X @ P.T + b, 0.0) @ w + c0)) * weight

    r = residual(P, b, w, c0)
    cost = float(r @ r)
    damping = 0.0
    for _ in range(REFINE_ROUNDS):
        J = jacobian(P, b, w) * weight[:, None]
        # normal equations: one product per round, the dampings then cost little
        JtJ, Jtr = J.T @ J, J.T @ r
        # columns scaled to unit norm: a unit with a tiny |w| has columns of order |w|,
        # and unscaled normal equations would drop its direction as rounding (it would
        # then move by a sliver per round)
        unit = 1.0 / np.sqrt(np.maximum(np.diag(JtJ), 1e-300))
        scaled, rhs = unit[:, None] * JtJ * unit[None, :], unit * Jtr
        for _ in range(REFINE_TRIES):
            # Levenberg-Marquardt: a sample that changes sides of a hyperplane makes the
            # Gauss-Newton step overshoot; damping shortens it until the misfit drops
            step = unit * np.linalg.lstsq(scaled + damping * np.eye(len(unit)), rhs,
                                          rcond=None)[0]
            Pn = P + step[:m * d].reshape(m, d)
            bn, wn = b + step[m * d:m * d + m], w + step[m * d + m:m * d + 2 * m]
            c0n = c0 + step[-1]
            norm = safe_norm(Pn, axis=1)
            Pn, bn, wn = Pn / norm[:, None], bn / norm, wn * norm
            rn = residual(Pn, bn, wn, c0n)
            new_cost = float(rn @ rn)
            if new_cost < cost:
                break
            damping = max(10.0 * damping, 1e-4)
        else:
            break
        damping /= 10.0 if damping > 1e-4 else math.inf
        done = new_cost > (1.0 - 1e-6) * cost
        P, b, w, c0, r, cost = Pn, bn, wn, c0n, rn, new_cost
        if done:
            break
    J = jacobian(P, b, w) * weight[:, None]
    # the scale of each unit is fixed (unit rows): drop that direction from the covariance
    gauge = np.zeros((m, J.shape[1]))
    for i in range(m):
        gauge[i, i * d:(i + 1) * d] = P[i]
        gauge[i, m * d + i] = b[i]
        gauge[i, m * d + m + i] = -w[i]
    Jg = np.vstack([J, gauge])
    u, sv, vt = np.linalg.svd(Jg, full_matrices=False)
    dof = max(len(X) - (m * (d + 1) + 1), 1)
    sigma = math.sqrt(cost / dof)
    std = sigma * np.sqrt(((vt / sv[:, None]) ** 2).sum(axis=0))
    # a forward pass in low precision rounds its terms, not F: its errors are not one
    # size relative to |F| as the weights assume. The sandwich (heteroscedasticity-
    # consistent) covariance uses each answer's own residual; the larger of the two counts
    influence = (vt.T / sv) @ u[:len(X)].T                      # (parameters, answers)
    std = np.maximum(std, np.sqrt((influence ** 2) @ (r * r) * len(X) / dof))
    worst = max(float(std[:m * d].max()),
                float(std[m * d:m * d + m].max()) / max(float(np.abs(b).max()), 1.0),
                float(std[m * d + m:m * d + 2 * m].max()) / float(np.abs(w).max()),
                float(std[-1]) / max(abs(c0), float(np.abs(w).max())))
    info = {"joint fit": f"{len(X)} answers, {m * (d + 2) + 1} parameters",
            "measured noise": sigma, "error bar": ERROR_BAR_SIGMAS * worst,
            # per unit, absolute: the largest P entry's and w's (for derived parameters)
            "unit bars": (ERROR_BAR_SIGMAS * std[:m * d].reshape(m, d).max(axis=1),
                          ERROR_BAR_SIGMAS * std[m * d + m:m * d + 2 * m])}
    return BiasedReLUNetwork(P, b, w, c0), info
