"""A pre-LayerNorm block with H >= 2 heads, on the sphere where LayerNorm is affine.

On S = {x : 1^T x = 0, |x| = R} the block is (docs/algorithms.md, "Pre-LayerNorm layer")

    f(X) = r^T x_N + sum_h softmax(X (W_h x_N + b_h))^T X v_h + c,   x_i in S,

with W_h, b_h, v_h the LayerNorm-folded parameters. Identified: P W_h P, P b_h, P v_h
(the canonical heads, up to order), P r and c: H (m^2 + 2m) + m + 1 numbers, m = d - 1.

Why the multi-head learner cannot be run through a view: it probes pairs (q + u, q)
with u and q free (scaled rows, q = 0 for the biases), and a map z -> S that turned
its box into a biased multi-head box in z would have to be affine (the heights u^T v_h
must be linear in u for every q), which no map onto a sphere is. Its identity holds on
S all the same: for a, q in S and k copies of a followed by n copies of q,

    g := f - c - q^T w = sum_h h_h sigma(t_h + lambda),   lambda = ln(k / n),
    h_h = (a - q)^T v_h,   t_h = (a - q)^T y_h(q),   y_h(q) = W_h q + b_h,

w = P (sum_h v_h + r) from single tokens. Unlike the multi-head learner, the top
asymptote sum_h h_h is not known (r is separated from the v_h only here), so every
fit leaves it free. Each pair is a sum of H sigmoid steps in lambda; the keys a are
points of S, the only knob the angle to q (LayerNorm divides each token by its norm).

Algorithm, per column q_j (the d vertices of a random regular simplex on S):

1. Base pair: a key a_0 at chord |a_0 - q_j| = kappa R in a random tangent direction,
   scanned on a uniform lambda grid (8H + 8 probes of up to LENGTH tokens);
   the fewest steps that fit to the answers' precision is the count (column 0 sets it,
   every other column must agree). The chord is rescaled (new scan) until the steps
   lie inside the window, and the direction redrawn while two crowd (after
   CROWDED_TRIES scans the widest gap seen is taken: the sphere bounds the logits).
2. Perturbations: m - 1 keys a_k = a_0 moved by eps R along an orthonormal tangent
   basis at a_0, sampled around the base steps (3H + 2 probes each) and fitted from the
   base steps, so every step keeps its label; the pairs' differences u_k = a_k - q_j
   span the hyperplane, and solving U y_h = t_h, U v_h = h_h gives a rough y_h(q_j)
   and v_h (to about the answers' precision over eps). Columns j >= 1 label their base
   steps by their heights predicted from column 0's v_h (the base key is chosen among
   random ones for well separated predicted heights).
3. Designed pairs: ceil(1.5 m) keys per column, chosen greedily among random keys
   (:func:`design_keys`, no query) for predicted steps apart, heights not small and a
   well conditioned U. Each is sampled at its predicted steps +-0.6, the midpoints and
   both ends (3H + 1 probes) and fitted from the prediction (free when that start
   ends above the answers' precision).
4. Labels: each pair's fitted steps are assigned to heads by position and height
   against the prediction (:func:`_label`), first the rough one, then, until no label
   changes, the solves of all pairs (more pairs than unknowns: a mislabelled pair
   disagrees). Every solve is weighted by each fit's first-order standard deviation
   (:func:`_step_std`): two nearly coincident steps pin their logits and heights poorly.
   v_h from every pair's heights; the logits refitted with the heights known;
   y_h(q_j) per column; then b_h = mean_j y_h(q_j) and
   W_h = m / (R^2 d) sum_j y_h(q_j) q_j^T (the simplex's exact affine solve),
   r = w - sum_h v_h.

Verification as for one head (:func:`attnextract.verification.verify_on_sphere`): held-out
sequences on S against the model, and rescaled or shifted copies off S against the
box's own answers.
"""

from __future__ import annotations

import logging
import math
import time

import numpy as np
from scipy.optimize import linear_sum_assignment
from scipy.special import expit

from ..errors import InputError, ModelMismatchError, NotIdentifiableError, RecoveryFailedError
from ..models import SphereAttention
from ..oracle import QueryAccess
from ..report import (
    DEFAULT_VERIFY_TOLERANCE,
    ExtractionResult,
    Report,
    checked_result,
    verification_count,
)
from ..sphere import column_probes, hyperplane_basis, simplex_columns, sphere_radius
from ..verification import INVARIANCE_SHARE, verify_on_sphere
from .multi_head.design import copy_counts, measure, probe_lengths, realised_lambda
from .multi_head.fit import (
    fit_logits,
    levenberg_marquardt,
    rational_steps,
    sigmoid_and_slope,
    unit_std,
)

log = logging.getLogger(__name__)

LENGTH = 2048            # longest probe: lambda in +-ln(2047) = +-7.6
EDGE = 1.5               # steps kept this far inside the window
SPREAD = 0.6             # designed steps span +-SPREAD x the half window
MIN_GAP = 0.6            # a base pair's steps closer than this (in lambda) crowd
CROWDED_TRIES = 4        # ... the widest gap after this many scans is taken,
LEAST_GAP = 0.05         # if at least this
MOVE = 0.15              # perturbations move a step by at most this x the smallest gap
MAX_ATTEMPTS = 24        # base scans per column (chord rescaled or direction redrawn)
FIT_NOISE = 256.0        # a fit reaches the answers' precision: rms <= this x ulps
FIXED_SHARE = 0.75       # a designed key's part fixed by its steps: at most this x R (the
                         # free rest, in the steps' null space, keeps the keys' U conditioned)
MAX_RELABEL = 6          # rounds of relabelling the designed pairs from their solves
EXTRA_KEYS = 0.5         # designed keys per column: (1 + this) m
GOOD_GAP = 1.5           # designed steps this far apart (in lambda) are apart enough
DESIGN_CANDIDATES = 256  # random keys scored per designed key
CANDIDATES = 32          # random free parts tried per designed key
EPS = np.finfo(float).eps


def parameter_count(heads: int, dim: int) -> int:
    """Numbers identified on the sphere: H (m^2 + 2m) + m + 1, m = d - 1."""
    m = dim - 1
    return heads * (m * m + 2 * m) + m + 1


def design_count(m: int) -> int:
    """Designed keys per column: more than the m a square solve needs, so that U (random
    keys, greedily chosen) is well conditioned in least squares."""
    return m + math.ceil(EXTRA_KEYS * m)


def base_samples(heads: int) -> int:
    return 8 * heads + 8


def _fit(lam: np.ndarray, g: np.ndarray, t0: np.ndarray, c0: np.ndarray | None = None):
    """Steps (t, h, rms) of one pair's scan, started at positions ``t0`` (heights solved
    linearly when ``c0`` is None); the top asymptote sum_h h_h is free. The steps keep
    the start's order."""
    scale = max(float(np.max(np.abs(g))), 1e-300)
    gs = g / scale
    H = t0.size
    if c0 is None:
        c0 = np.linalg.lstsq(expit(t0[None, :] + lam[:, None]), gs, rcond=None)[0]
    else:
        c0 = c0 / scale

    def fun(x):
        s, ds = sigmoid_and_slope(x[:H][None, :] + lam[:, None])
        return s @ x[H:] - gs, np.hstack([ds * x[H:][None, :], s])

    x, r, _ = levenberg_marquardt(fun, np.concatenate([t0, c0]))
    return x[:H], x[H:] * scale, float(np.sqrt(np.mean(r ** 2))) * scale


def _free_fit(lam: np.ndarray, g: np.ndarray, count: int, half: float):
    """A free fit of ``count`` steps, started at the poles of a rational fit."""
    scale = max(float(np.max(np.abs(g))), 1e-300)
    t = rational_steps(lam, g / scale, count)
    edges = np.linspace(-half - 1.0, half + 1.0, count - t.size + 2)[1:-1]
    t = np.sort(np.concatenate([t, edges]))
    t, c, rms = _fit(lam, g, t)
    order = np.argsort(t)
    return t[order], c[order], rms


def _send(oracle, w, c, keys, q, lam):
    """Copy probes of the keys (P, d) against the column q (d,) at lambdas (P, S):
    returns (realised lambdas (P, S), g (P, S), their rounding scale (P, S))."""
    P, S = lam.shape
    lam = lam.ravel()
    lengths = probe_lengths(lam, LENGTH)
    copies = copy_counts(lam, lengths)
    U = np.repeat(keys - q, S, axis=0)
    answers = measure(oracle, w, U, np.broadcast_to(q, U.shape).copy(), copies, lengths)
    g = answers - c
    rounding = EPS * (np.abs(answers) + abs(c) + abs(q @ w)) * np.sqrt(lengths)
    return realised_lambda(copies, lengths).reshape(P, S), g.reshape(P, S), rounding.reshape(P, S)


def _around(t: np.ndarray, half: float) -> np.ndarray:
    """Lambdas around steps at -t: each step +-0.6, the midpoints and both ends."""
    s = np.sort(-t)
    lam = np.concatenate([s - 0.6, s + 0.6, (s[1:] + s[:-1]) / 2, [-half + 0.3, half - 0.3]])
    return np.sort(np.clip(lam, -half, half))


def _label(t: np.ndarray, h: np.ndarray, t_pred: np.ndarray, h_pred: np.ndarray):
    """Fitted steps (n, H) of n pairs, reordered so that column k is head k's: the
    assignment to the predicted steps (positions, and heights against the pair's largest
    predicted height) of least total distance."""
    t, h = t.copy(), h.copy()
    for i in range(len(t)):
        top = max(float(np.abs(h_pred[i]).max()), 1e-300)
        _, order = linear_sum_assignment(np.abs(t_pred[i][:, None] - t[i][None, :])
                                         + np.abs(h_pred[i][:, None] - h[i][None, :]) / top)
        t[i], h[i] = t[i][order], h[i][order]
    return t, h


def _step_std(lam: np.ndarray, t: np.ndarray, h: np.ndarray, noise: float,
              heights: bool = True):
    """First-order standard deviations of one pair's steps (t (H,), h (H,)) at output
    noise ``noise``: (std_t, std_h), or std_t alone with the heights known."""
    s, ds = sigmoid_and_slope(t[None, :] + lam[:, None])
    J = np.hstack([ds * h[None, :], s]) if heights else ds * h[None, :]
    std = np.maximum(unit_std(J), 1e-300) * max(noise, 1e-300)
    H = t.size
    return (std[:H], std[H:]) if heights else std


def _smallest_gap(x: np.ndarray) -> float:
    """The smallest distance between two entries of x (inf for one entry)."""
    return float(np.min(np.diff(np.sort(x)))) if x.size > 1 else math.inf


def design_keys(q: np.ndarray, Y: np.ndarray, V: np.ndarray, chord: float, count: int,
                half: float, rng: np.random.Generator) -> np.ndarray:
    """``count`` keys (count, d) on q's sphere for pairs with the column q (d,), chosen
    greedily among random ones (no query), from Y (H, d) = rough y_h(q) and V (H, d) =
    rough v_h. Each key first keeps its predicted steps apart (t_h = (a - q)^T y_h:
    smallest gap up to GOOD_GAP, within 0.8 of the best candidate's, all inside the
    window; close steps are what no fit splits), then maximises its smallest height
    |(a - q)^T v_h| / |v_h| (against R chord / 4) times the part of u = a - q outside
    the span of the keys chosen before (against |u|).

    Linear conditions cannot place the steps: the part of a they fix is about q's part
    in span(y_h), often most of R, and the rest (the keys' spread outside that span)
    would be too small for U to be well conditioned. Random keys at chords around the
    base pair's (whose steps were inside the window) need no such part.
    """
    d = q.size
    R = float(np.linalg.norm(q))
    H = Y.shape[0]
    v_norm = np.maximum(np.linalg.norm(V, axis=1), 1e-300)
    chosen = np.zeros((0, d))
    for _ in range(count):
        E = np.array([_tangent(q, rng.standard_normal(d)) for _ in range(DESIGN_CANDIDATES)])
        chords = np.minimum(chord * rng.uniform(0.5, 1.5, DESIGN_CANDIDATES), 1.95)
        A = np.array([column_probes(q, e[:, None], k)[0] for e, k in zip(E, chords)])
        U = A - q
        T = U @ Y.T                                                   # (C, H)
        peak = np.max(np.abs(T), axis=1)
        if H > 1:
            gaps = np.min(np.diff(np.sort(T, axis=1), axis=1), axis=1)
            gap_score = np.minimum(gaps / GOOD_GAP, 1.0)
        else:
            gap_score = np.ones(len(A))
        height = np.min(np.abs(U @ V.T) / v_norm, axis=1) / (R * chord / 4.0)
        if chosen.shape[0]:
            B = np.linalg.qr(chosen.T)[0]
            outside = np.linalg.norm(U - (U @ B) @ B.T, axis=1) / np.linalg.norm(U, axis=1)
        else:
            outside = np.ones(len(A))
        inside = peak <= half - EDGE
        # the steps' gap first (close steps are what a fit cannot split), then the rest
        apart = inside & (gap_score >= 0.8 * np.max(np.where(inside, gap_score, 0.0)))
        score = np.where(apart, np.minimum(height, 1.0) * outside, -1.0)
        chosen = np.vstack([chosen, U[int(np.argmax(score))]])
    return chosen + q


def _tangent(q: np.ndarray, x: np.ndarray) -> np.ndarray:
    """The unit part of x orthogonal to q and to 1."""
    x = x - x.mean()
    x = x - (x @ q) / (q @ q) * q
    return x / np.linalg.norm(x)


class _Probing:
    """The per-column stages of :func:`extract_pre_layer_norm_heads` and what they share:
    the count of heads seen (fixed by the first column), the rough values V (from the
    first column's perturbations) and, per column, the designed pairs' answers."""

    def __init__(self, oracle: QueryAccess, w: np.ndarray, c: float, Q: np.ndarray, R: float,
                 basis: np.ndarray, rng: np.random.Generator, heads: int, half: float,
                 counts: dict):
        self.oracle, self.w, self.c, self.Q, self.R, self.basis = oracle, w, c, Q, R, basis
        self.rng, self.heads, self.half, self.counts = rng, heads, half, counts
        self.d = int(Q.shape[0])
        self.count: int | None = None
        self.V_rough: np.ndarray | None = None
        self.designed: list = []            # per column: (keys, lam, g, rounding, y_rough)

    def solve(self, U: np.ndarray, T: np.ndarray) -> np.ndarray:
        """y (k, d) in 1^perp with U y_i = T[:, i] (U (n, d), n >= m rows spanning 1^perp;
        least squares for n > m)."""
        return (self.basis @ np.linalg.lstsq(U @ self.basis, T, rcond=None)[0]).T

    def column(self, j: int) -> None:
        """Column j: its base pair, the perturbations around it, its designed pairs."""
        q = self.Q[:, j]
        a0, t0, h0, self.count = self.base_pair(j, q)
        if self.V_rough is not None:            # label the steps by predicted heights
            predicted = self.V_rough @ (a0 - q)
            top = max(np.abs(predicted).max(), 1e-300)
            _, order = linear_sum_assignment(np.abs(predicted[:, None] - h0[None, :]) / top)
            t0, h0 = t0[order], h0[order]
        y_rough = self.perturbations(j, q, a0, t0, h0)
        self.designed_pairs(j, q, a0, y_rough)

    def base_pair(self, j: int, q: np.ndarray):
        """1. A base key a0 whose copy-count scan shows the heads' steps inside the window
        and apart: (a0, steps t0, heights h0, steps counted)."""
        oracle, w, c, rng, d = self.oracle, self.w, self.c, self.rng, self.d
        H, half, count, V_rough = self.heads, self.half, self.count, self.V_rough
        m = d - 1
        kappa = 2.0 / math.sqrt(m)
        base = best_base = None
        for attempt in range(MAX_ATTEMPTS):
            if V_rough is None:
                e = _tangent(q, rng.standard_normal(d))
            else:                      # well separated predicted heights: labels by height
                best = -1.0
                for _ in range(CANDIDATES):
                    cand = _tangent(q, rng.standard_normal(d))
                    a = column_probes(q, cand[:, None], kappa)[0]
                    hts = V_rough @ (a - q)
                    gap = _smallest_gap(hts) / max(np.abs(hts).max(), 1e-300)
                    if gap > best:
                        best, e = gap, cand
            a0 = column_probes(q, e[:, None], kappa)[0]
            lam = np.linspace(-half, half, base_samples(H))[None]
            lam, g, rounding = _send(oracle, w, c, a0[None], q, lam)
            lam, g, rounding = lam[0], g[0], rounding[0]
            self.counts["base"] += lam.size
            allowed = FIT_NOISE * float(rounding.max())
            if np.max(np.abs(g)) <= allowed:
                if V_rough is None:
                    raise NotIdentifiableError(
                        "no head's value is seen on the sphere (P v_h = 0 for every head, "
                        "or the attention never moves): W_h and b_h do not reach the outputs")
                kappa = min(2.0 * kappa, 1.9)
                continue
            fits = {}
            for k in ([count] if count is not None else range(1, H + 1)):
                fits[k] = _free_fit(lam, g, k, half)
                if fits[k][2] <= allowed:
                    break
            k, (t, h, rms) = min(fits.items(), key=lambda item: item[1][2])
            log.debug("column %d, scan %d at chord %.3g: %d steps at %s, rms %.2g (allowed %.2g)",
                      j, attempt, kappa, k, np.round(-t, 2), rms, allowed)
            if rms > allowed:
                # steps beyond the window fit badly: a shorter chord (or not the class)
                if attempt >= MAX_ATTEMPTS // 2:
                    raise ModelMismatchError(
                        f"the black box is not a pre-LayerNorm block of at most {H} heads: "
                        f"no pair's copy-count scan fits {count or H} sigmoid steps (rms {rms:.2g} "
                        f"against a precision of {allowed:.2g})")
                kappa *= 0.5
                continue
            if count is not None and k != count:
                raise ModelMismatchError(f"columns disagree on the heads seen ({count} and {k})")
            peak = float(np.max(np.abs(t)))
            if peak > half - EDGE or peak < 0.3 * half:
                kappa = min(kappa * SPREAD * half / max(peak, 1e-3), 1.9)
                if peak > half - EDGE:
                    continue
            # crowded steps: another direction; the sphere bounds the logits (|t| <=
            # 2 R |y|), so after CROWDED_TRIES the widest gap seen is taken
            spacing = _smallest_gap(t)
            if best_base is None or spacing > best_base[0]:
                best_base = (spacing, (a0, t, h, k))
            if spacing >= MIN_GAP or (attempt >= CROWDED_TRIES
                                      and best_base[0] >= LEAST_GAP):
                base = best_base[1]
                break
        if base is None:
            raise RecoveryFailedError(
                f"column {j}: no pair with {count or H} steps inside the lambda window and "
                f"apart in {MAX_ATTEMPTS} scans; the learner could not design its probes")
        return base

    def perturbations(self, j: int, q: np.ndarray, a0: np.ndarray, t0: np.ndarray,
                      h0: np.ndarray) -> np.ndarray:
        """2. Perturbations of the base key along a tangent basis at a0: the rough logit
        vectors y_h of column j (count, d), and the rough values V from the first column."""
        oracle, w, c, rng, d, half = self.oracle, self.w, self.c, self.rng, self.d, self.half
        count, m = self.count, self.d - 1
        assert count is not None                     # set by this column's base pair
        R = self.R
        gap = _smallest_gap(t0) if count > 1 else 1.0
        u0 = a0 - q
        ynorm = 3.0 * float(np.max(np.abs(t0))) / np.linalg.norm(u0) + 1e-300
        frame = np.column_stack([a0, np.ones(d), rng.standard_normal((d, m - 1))])
        tangents = np.linalg.qr(frame)[0][:, 2:]            # orthogonal to a0 and to 1
        eps = np.full(m - 1, MOVE * gap / (R * ynorm))
        T, C, Urows = np.empty((m, count)), np.empty((m, count)), np.empty((m, d))
        T[0], C[0], Urows[0] = t0, h0, u0
        todo = np.arange(m - 1)
        for _ in range(8):
            if todo.size == 0:
                break
            keys = a0[None] + (eps[todo, None] * R) * tangents[:, todo].T
            keys = R * keys / np.linalg.norm(keys, axis=1, keepdims=True)
            lam = np.tile(_around(t0, half), (todo.size, 1))
            lam, g, rounding = _send(oracle, w, c, keys, q, lam)
            self.counts["perturbations"] += lam.size
            failed = []
            for i, p in enumerate(todo):
                t, h, rms = _fit(lam[i], g[i], t0, h0)
                if rms > FIT_NOISE * rounding[i].max() or np.max(np.abs(t - t0)) > 0.4 * gap:
                    failed.append(p)
                    continue
                T[p + 1], C[p + 1], Urows[p + 1] = t, h, keys[i] - q
            todo = np.array(failed, dtype=int)
            eps[todo] *= 0.25
        if todo.size:
            raise RecoveryFailedError(f"column {j}: perturbed pairs lost their steps' labels")
        y_rough = self.solve(Urows, T)                        # (count, d)
        log.debug("column %d: base steps' smallest gap %.3g, perturbations %.2g", j, gap,
                  eps.min())
        if self.V_rough is None:
            self.V_rough = self.solve(Urows, C)
        return y_rough

    def designed_pairs(self, j: int, q: np.ndarray, a0: np.ndarray,
                       y_rough: np.ndarray) -> None:
        """3. Designed pairs of column j: steps apart, heights not small, U well
        conditioned; their scans kept for the labelling (:func:`_labels_and_logits`)."""
        R = self.R
        chord = float(np.linalg.norm(a0 - q)) / R
        assert self.V_rough is not None              # set by the first column
        keys = design_keys(q, y_rough, self.V_rough, chord, design_count(self.d - 1),
                           self.half, self.rng)
        log.debug("column %d designed: cond %.3g, smallest gap %.3g", j,
                  np.linalg.cond((keys - q) @ self.basis),
                  min(_smallest_gap(y_rough @ (k - q)) for k in keys))
        lams = [_around(y_rough @ (key - q), self.half) for key in keys]
        keys = np.array(keys)
        lam, g, rounding = _send(self.oracle, self.w, self.c, keys, q, np.array(lams))
        self.counts["designed"] += lam.size
        self.designed.append((keys, lam, g, rounding, y_rough))


def _labels_and_logits(probe: _Probing) -> tuple[np.ndarray, np.ndarray]:
    """4. Labels, heights and logits: Y (d, count, d), y_h(q_j) per column, and V
    (count, d).

    Each pair is fitted from its predicted steps (free when that start was too far off);
    which fitted step is which head is the assignment to the prediction (position and
    height at once), first from the rough estimates, then, until no label changes, from
    the solves of every column's pairs (more pairs than unknowns: a mislabelled pair
    disagrees with the others)."""
    Q, basis, designed, count, V_rough = (probe.Q, probe.basis, probe.designed, probe.count,
                                          probe.V_rough)
    d, H, half = probe.d, probe.heads, probe.half
    assert count is not None and V_rough is not None     # set by the first column
    Y = np.zeros((d, H, d))                 # y_h(q_j): column j, head h
    raw = []                                 # per column: U (n, d), t (n, H), h (n, H)
    for j, (keys, lam, g, rounding, y_rough) in enumerate(designed):
        U = keys - Q[:, j]
        t_col, h_col = np.empty((len(keys), count)), np.empty((len(keys), count))
        for i in range(len(keys)):
            t_pred, h_pred = U[i] @ y_rough.T, V_rough @ U[i]
            t, h, rms = _fit(lam[i], g[i], t_pred, h_pred)
            if rms > FIT_NOISE * rounding[i].max():       # a start too far off: free fit
                free = _free_fit(lam[i], g[i], count, half)
                if free[2] < rms:
                    t, h, rms = free
            if rms > FIT_NOISE * rounding[i].max():
                raise ModelMismatchError(
                    f"the black box is not a pre-LayerNorm block of at most {H} heads: a "
                    f"pair's copy-count scan at column {j} fits no {count} sigmoid steps "
                    f"(rms {rms:.2g} against a precision of {rounding[i].max():.2g})")
            t_col[i], h_col[i] = t, h
        raw.append((U, t_col, h_col))
    lams = [lam for _, lam, _, _, _ in designed]
    noises = [rounding.max(axis=1) for _, _, _, rounding, _ in designed]

    def weighted(U, T, S):
        """y (k, d) in 1^perp from U y_k = T[:, k], row i weighted by 1 / S[i, k]: a pair
        whose steps nearly coincide pins their logits and heights poorly."""
        out = np.empty((T.shape[1], d))
        for k in range(T.shape[1]):
            w8 = 1.0 / S[:, k]
            out[k] = basis @ np.linalg.lstsq((U @ basis) * w8[:, None], T[:, k] * w8,
                                             rcond=None)[0]
        return out

    def stds(j, T, C):
        both = [_step_std(lams[j][i], T[i], C[i], noises[j][i]) for i in range(len(T))]
        return np.array([b[0] for b in both]), np.array([b[1] for b in both])

    labelled = [(U, *_label(t_col, h_col, U @ y_rough.T, U @ V_rough.T))
                for (U, t_col, h_col), (_, _, _, _, y_rough) in zip(raw, designed)]
    for _ in range(MAX_RELABEL):
        spreads = [stds(j, T, C) for j, (_, T, C) in enumerate(labelled)]
        V = weighted(np.concatenate([U for U, _, _ in labelled]),
                     np.concatenate([C for _, _, C in labelled]),
                     np.concatenate([sc for _, sc in spreads]))
        relabelled = [(U, *_label(t_col, h_col, U @ weighted(U, T, st).T, U @ V.T))
                      for (U, t_col, h_col), (_, T, _), (st, _) in zip(raw, labelled, spreads)]
        changed = any(np.any(a[1] != b[1]) for a, b in zip(relabelled, labelled))
        labelled = relabelled
        if not changed:
            break
    for j, ((_, lam, g, _, _), (U, T, _)) in enumerate(zip(designed, labelled)):
        t = fit_logits(lam, g, U @ V.T, T, bound=0.5)
        st = np.array([_step_std(lam[i], t[i], U[i] @ V.T, noises[j][i], heights=False)
                       for i in range(len(t))])
        Y[j, :count] = weighted(U, t, st)
        log.debug("column %d: largest weighted residual of the pairs' logits %.2g", j,
                  np.max(np.abs(U @ Y[j, :count].T - t) / st))
    return Y[:, :count], V


def extract_pre_layer_norm_heads(oracle: QueryAccess, heads: int, *, seed=None,
                                 verify_tolerance: float = DEFAULT_VERIFY_TOLERANCE,
                                 radius: float | None = None) -> ExtractionResult:
    """Recover a pre-LayerNorm block with several heads on the sphere where LN is affine.

    Parameters
    ----------
    oracle : Oracle
        Door to f(X) = r^T x_N + sum_h softmax(Y (W_h y_N + b_h))^T Y v_h + c, Y = LN(X)
        (:class:`attnextract.models.PreLayerNormAttention`).
    heads : int
        The block's number of heads, an upper bound on the heads seen on the sphere.
    seed : int, optional
    verify_tolerance : float
        Largest held-out error on the sphere, relative to the outputs' RMS.
    radius : float, optional
        Norm R of every probe token (default sqrt(d)).

    Returns
    -------
    ExtractionResult
        ``model`` a :class:`attnextract.models.SphereAttention` with W (H', d, d),
        b (H', d), v (H', d), c, r projected on 1^T x = 0 (H' <= heads the heads seen).

    Raises
    ------
    NotIdentifiableError
        d < 4, or no head's value is seen on the sphere (P v_h = 0 for all h).
    ModelMismatchError
        No base pair fits ``heads`` steps or fewer, columns disagree on the count, or the
        held-out check on or off the sphere failed.
    RecoveryFailedError
        No base pair with steps inside the window and apart was found.
    """
    start, start_queries, start_bb = time.perf_counter(), oracle.queries, oracle.black_box_seconds
    d = oracle.dim
    H = int(heads)
    if H < 1:
        raise InputError(f"heads must be positive, got {heads!r}")
    if d < 4:
        raise NotIdentifiableError(f"several heads on the sphere of 1^T x = 0 need d >= 4, got {d}")
    m = d - 1
    R = sphere_radius(d, radius)
    half = math.log(LENGTH - 1)
    rng = np.random.default_rng(seed)
    basis = hyperplane_basis(d)
    Q = simplex_columns(d, R, rng)
    floor = parameter_count(H, d)
    planned = d + d * (base_samples(H) + (m - 1) * (3 * H + 2) + design_count(m) * (3 * H + 1))
    n_verify = verification_count(floor, floor)
    n_invariance = max(4, int(INVARIANCE_SHARE * n_verify))
    oracle.plan(planned + n_verify + n_invariance,
                f"pre-LayerNorm block with {H} heads on the sphere")

    singles = oracle.query(Q.T[:, None, :])
    c = float(singles.mean())                              # the vertices sum to 0
    w = (m / (R * R * d)) * (Q @ (singles - c))            # P (sum_h v_h + r)
    counts = {"base": 0, "perturbations": 0, "designed": 0}
    probe = _Probing(oracle, w, c, Q, R, basis, rng, H, half, counts)
    for j in range(d):
        probe.column(j)
    Y, V = _labels_and_logits(probe)
    count = probe.count
    assert count is not None
    b = Y.mean(axis=0)                                        # (count, d)
    W = (m / (R * R * d)) * np.einsum("jhd,ej->hde", Y, Q)
    model = SphereAttention(W, b, V, c, w - V.sum(axis=0), R)
    recovery = oracle.queries - start_queries
    verification = verify_on_sphere(oracle, model, count=n_verify, invariance=n_invariance,
                                    rng=rng, tolerance=verify_tolerance)
    report = Report(
        kind=model.kind, dim=d, queries=oracle.queries - start_queries,
        breakdown={"singles": d, **counts, "verification": verification.sequences},
        floor=parameter_count(count, d), verification=verification,
        seconds=time.perf_counter() - start,
        black_box_seconds=oracle.black_box_seconds - start_bb,
        details={"sphere": f"tokens with 1^T x = 0 and |x| = {R:.6g} (the model is "
                           f"defined there only)",
                 "heads seen": f"{count} of at most {H}",
                 "recovery queries": recovery,
                 "identified": "P W_h P, P b_h, P v_h (canonical heads, any order), P r and "
                               "c of the block on the sphere (gamma, beta, eps and the raw "
                               "weights are not identifiable)"})
    return checked_result(model, report, f"a pre-LayerNorm block of at most {H} heads")
