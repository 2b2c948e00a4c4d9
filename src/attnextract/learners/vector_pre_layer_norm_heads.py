"""Several pre-LayerNorm heads answering vectors (GPT-2 style), on the sphere.

On the sphere S = {x : 1^T x = 0, |x| = rho} LayerNorm is affine and the block is
(:mod:`attnextract.learners.vector_pre_layer_norm`, :class:`VectorSphereAttention`)

    F(X) = R x_N + sum_h O'_h X^T softmax(X y_h) + c',   y_h = W'_h x_N + b'_h.

The heads are separated by their output ranges R_h = range(O'_h P), which must be
independent (sum of their dimensions d_h at most m; a standard layer's W_o invertible
makes them so). For tokens a, q in S with u = a - q and t_h = u^T y_h(q):

1. Single tokens at the d vertices of a simplex: c' and M = (R + sum_h O'_h) P (d queries).
2. The ratio sequences [a x k, q x (L - k)], k = 1..L - 1 (r = k / (L - k)) answer
       Phi(r) = F - c' - M q = sum_h r E_h / (1 + r E_h) v_h,   E_h = e^{t_h}, v_h = O'_h u,
   and E = sum_h E_h Pi_h (Pi_h the projector onto R_h along the others) satisfies
       E (Phi(r_i) - Phi(r_j)) = Phi(r_j) / r_j - Phi(r_i) / r_i,
   an H x H eigenproblem on span{v_h}: every head's v_h and t_h at one direction u,
   with L = H + 3. This start is ill-conditioned when the E_h are close (a Cauchy-like
   matrix): a direction whose nearest logits are closer than MIN_GAP x their spread is
   skipped; it only needs to label the heads.
3. Labels across directions: a third token a'' on the circle through q, a_1 and a_k
   has u'' = alpha u_1 + beta u_k, so each head's v''_h = alpha v_h(u_1) + beta v_h(u_k):
   the decomposition of v'' over [v(u_1), v(u_k)] pairs the heads of u_k with those of
   u_1. The heads' vectors at K directions span the ranges R_h (ranks d_h read off).
2'. The covariance start, when no probe separates the logits (they are then small: 8 or
   12 heads at GPT-2's initial scale, logits a few 1e-3 apart): to first order in the
   logits, [x x k, -x x k, q] answers p sum_h O'_h x x^T y_h(q) plus terms free of x,
   so 2 F(s) - F(u) - F(e) (u orthogonal to e, s = (u + e) / sqrt(2)) is p T_q u with
   T_q = sum_h (e^T y_h(q)) O'_h + a part in V(e) = span{O'_h e}. Modulo V(e), T_q at
   SLICES tokens q is a pencil B diag(c_h(q) I) O-bar (c_h(q) = e^T y_h(q), of order one
   relative to each other however small the logits): Jennrich's eigenvectors grouped
   by (c_h(q_j))_j give each head's covectors vanishing on O'_h e, a second e the
   missing one (:func:`covariance_start`; its error is the first-order truncation,
   1e-3 to 4e-2 of the ranges at GPT-2's initial scale, measured). The polish (4)
   takes it from there on 3 (max d_h + 1) pairs of directions labelled by it.
4. The ranges polished: in coordinates L = [L_1; ...; L_H] (L_h a basis of covectors of
   head h), every head's coordinates of the ratio answers must be s(t + log r_j) w with
   one t and one w per direction. A Gauss-Newton step mixes the other heads' coordinates
   into L_h (variable projection: t, w refitted); it decouples by head. Its misfit at the
   answers' rounding is the certificate of the separation.
5. Each head through its coordinates: [a, a, q] and [a, q, q] at the n tangent directions
   of q_0 give O'_h P and y_h(q_0) (identity 2 of the single head, per head; 2n queries);
   queries [a_1 .. a_k, q_j] with k = min_h d_h / 2 tokens read k logits of every head
   at once (L_h O'_h U^T is d_h x k, of rank k; half the smallest width keeps it
   well-conditioned): y_h(q_j) at the other n vertices.
6. W'_h, b'_h from y_h(q_j) at the d vertices (identity 4), R P = M - sum_h O'_h P.
7. Error bars: first order from the answers' rounding and the ranges' bound (the
   polish's misfit over its conditioning) through each solve's measured conditioning.
   Verification: held-out sequences on the sphere, every channel, and rescaled or
   shifted copies off it (:func:`attnextract.verification.verify_vector_on_sphere`).

Not covered: heads of output rank d_h <= 2 whose logits are too close for the ratio
start (8 heads at d = 16, GPT-2's initial scale): the covariance start matches a head's
two covector subspaces by the d_h - 2 dimensions they share, none there; refused as not
identifiable, never answered wrong. Logits too close for the ratio start yet too large
for the first-order covariance start: 8 heads at d = 32 with weights N(0, 0.04) and
N(0, 0.07) were learnt (3 of 3 each), N(0, 0.1) refused 2 of 3 and N(0, 0.2) 3 of 3
(5 to 10 times GPT-2's initial scale; a trained layer's logits may sit there), as not
identifiable.
"""

from __future__ import annotations

import logging
import math
import time

import numpy as np
from scipy.cluster.hierarchy import fcluster, linkage
from scipy.optimize import linear_sum_assignment

from ..errors import ModelMismatchError, NotIdentifiableError
from ..models import VectorSphereAttention
from ..report import ExtractionResult, Report, checked_result, verification_count
from ..sphere import (
    column_probes,
    hyperplane_basis,
    hyperplane_rotation,
    simplex_columns,
    sphere_radius,
    tangent_simplex,
)
from ..verification import INVARIANCE_SHARE, last_answers, verify_vector_on_sphere
from .pre_layer_norm import MAX_LOGIT, MAX_RESCALES, _shorter, _solve_on_hyperplane

log = logging.getLogger(__name__)

EPS = float(np.finfo(float).eps)
ROUNDING = 4.0            # error bars: ulps of rounding per answer number
CHORD = 1.7               # probes' chord |a - q| / rho: the heads' logits as far apart as allowed
RANK_TOL = 1e-12          # a head's vectors below this x its largest singular value: no direction
POLISH_STEPS = 12         # Gauss-Newton steps on the ranges (converges in 3 to 5)
POLISH_LEVEL = 1e3        # the polish is done when its misfit is this x the rounding level
MATCH_TOL = 1e-3          # a head's pairing coefficient off by more than this: not labelled
TOKEN_SHARE = 2           # tokens a column query: half the smallest head width (conditioning)
CANDIDATES = 6            # ratio probes' directions: at most this x (d - 1); a direction is
                          # skipped where two heads' logits nearly meet (GPT-2 d = 16, 4 heads,
                          # default init: with 3, 1 of 20 layers ran out of directions; 6: 40/40)
MIN_GAP = 0.05            # ratio start: two heads' logits closer than this x their spread: skipped
PAIR_COPIES = 8           # covariance start: copies of x and of -x before the query token (the
                          # query's weight 1 / 17 keeps the first-order terms' error small)
REFERENCES = 4            # covariance start: references w whose spans V(e) + V(w) meet in V(e)
SLICES = 5                # covariance start: query tokens, one pencil matrix each
TIED_PAIRS = 3            # covariance start: the polish's pairs of directions, x (max d_h + 1)
PENCIL_DRAWS = 6          # covariance start: random ratios of the pencil tried (best fit kept)


class LogitsTooClose(NotIdentifiableError):
    """The ratio start found no probe where the heads' logits are far enough apart."""


def three_token_sequences(A: np.ndarray, q: np.ndarray) -> np.ndarray:
    """(2k, 3, d): [a_k, a_k, q] for every probe a_k (A (k, d)), then [a_k, q, q]."""
    k = A.shape[0]
    X = np.empty((2 * k, 3, A.shape[1]))
    X[:k, 0], X[:k, 1], X[:k, 2] = A, A, q
    X[k:, 0], X[k:, 1], X[k:, 2] = A, q, q
    return X


def three_token_solve(gA: np.ndarray, gB: np.ndarray):
    """(h, t, k) from g_A = sigma(t + log 2) h and g_B = sigma(t - log 2) h, rows (k, m).

    k = g_B / g_A is read by projection (g_A, g_B parallel); h = 3 g_B / (4 k - 1) (k, m),
    t = log((4 k - 1) / (2 (1 - k))) (k,); t is not finite when k is outside (1/4, 1)."""
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        k = np.einsum("km,km->k", gA, gB) / np.einsum("km,km->k", gA, gA)
        h = 3.0 * gB / (4.0 * k - 1.0)[:, None]
        t = np.log((4.0 * k - 1.0) / (2.0 * (1.0 - k)))
    return h, t, k


def sigmoid(x: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + np.tanh(0.5 * x))


def ratio_sequences(a: np.ndarray, q: np.ndarray, length: int) -> np.ndarray:
    """(L - 1, L, d): [a x k, q x (L - k)] for k = 1 .. L - 1."""
    X = np.empty((length - 1, length, a.shape[0]))
    for k in range(1, length):
        X[k - 1, :k], X[k - 1, k:] = a, q
    return X


def ratio_eigen(Phi: np.ndarray, ratios: np.ndarray, heads: int):
    """Every head's (t_h, v_h) at one direction from its ratio answers Phi (J, m).

    Returns t (H,), V (m, H) (columns v_h, sum_h v_h = z = O' u) and the relative misfit
    of the rebuilt answers. Raises ModelMismatchError when the eigenvalues are not real
    and positive (no sum of H heads)."""
    H_ = heads
    D = (Phi[1:] - Phi[0]).T                                   # (m, J - 1)
    Pm = (Phi[0] / ratios[0] - Phi[1:] / ratios[1:, None]).T
    S = np.linalg.svd(D, full_matrices=False)[0][:, :heads]    # span{v_h}
    E = (S.T @ Pm) @ np.linalg.pinv(S.T @ D)
    lam, vec = np.linalg.eig(E)
    if np.any(np.abs(lam.imag) > 1e-6 * np.abs(lam)) or np.any(lam.real <= 0):
        raise ModelMismatchError("the black box is not a sum of pre-LayerNorm heads: its "
                                 "ratio probes imply attention weights that are not those "
                                 f"of {heads} softmax heads")
    lam, vec = lam.real, vec.real
    order = np.argsort(lam)
    lam, vec = lam[order], vec[:, order]
    # z from every ratio: z = Phi_j + E^{-1} Phi_j / r_j (in span coordinates)
    coords = S.T @ Phi.T                                        # (H, J)
    try:
        zc = (coords + np.linalg.solve(E, coords / ratios)).mean(axis=1)
        beta = np.linalg.solve(vec, zc)
    except np.linalg.LinAlgError:
        raise NotIdentifiableError("the ratio probes' eigenproblem is singular at this "
                                   "direction") from None
    V = S @ (vec * beta)                                        # (m, H)
    t = np.log(lam)
    gaps = np.diff(t)
    if H_ > 1 and np.min(gaps) < MIN_GAP * (t[-1] - t[0]):
        raise NotIdentifiableError("two heads' logits too close at this direction")
    rebuilt = (ratios[:, None] * lam / (1.0 + ratios[:, None] * lam)) @ V.T
    misfit = np.linalg.norm(rebuilt - Phi) / max(np.linalg.norm(Phi), np.finfo(float).tiny)
    return t, V, misfit


def fit_head(C: np.ndarray, logs: np.ndarray, t0: float, steps: int = 8):
    """(t, w) with C (J, k) = s(t + logs_j) w^T in least squares, by Gauss-Newton on t
    (w eliminated). Returns t, w (k,), residual (J, k)."""
    t = float(t0)
    for _ in range(steps):
        s = sigmoid(t + logs)
        w = s @ C / (s @ s)
        ds = s * (1.0 - s)
        res = C - np.outer(s, w)
        # d res / dt = -(ds w^T + s dw^T), dw/dt from the normal equations
        dw = (ds @ C - 2.0 * (s @ ds) * w) / (s @ s)
        J = -(np.outer(ds, w) + np.outer(s, dw)).ravel()
        step = -(J @ res.ravel()) / max(J @ J, np.finfo(float).tiny)
        t += step
        if abs(step) < 1e-15 * max(1.0, abs(t)):
            break
    s = sigmoid(t + logs)
    w = s @ C / (s @ s)
    return t, w, C - np.outer(s, w)


def tied_fit(C: np.ndarray, logs: np.ndarray, pairs: np.ndarray, t0: np.ndarray,
             steps: int = 10):
    """One head's logits and value coordinates at every direction, tied by the circle
    points: C (D, J, k) its coordinates of the ratio answers at D = 1 + 2P directions
    (u_1, then u_k and u''_k = alpha_k u_1 + beta_k u_k per pair, ``pairs`` (P, 2) the
    (alpha, beta)); C[i] = s(t_i + logs) w_i^T with t, w free at u_1 and every u_k and
    linear at u''_k. Gauss-Newton from ``t0`` (the free directions' logits, (1 + P,)).

    Returns the residual (D J k,) and the Jacobian (D J k, (1 + P)(k + 1)) at the fit."""
    D, J, k = C.shape
    P = len(pairs)
    free = 1 + P
    t = np.array(t0, dtype=float)
    s0 = sigmoid(t[:, None] + logs)                           # (free, J)
    own = np.r_[0, 1 + 2 * np.arange(P)]                      # the free directions' rows
    w = np.einsum("fj,fjk->fk", s0, C[own]) / np.sum(s0 * s0, axis=1)[:, None]
    A = np.zeros((D, free))                                   # direction = A @ free ones
    A[own, np.arange(free)] = 1.0
    A[2 + 2 * np.arange(P), 0] = pairs[:, 0]
    A[2 + 2 * np.arange(P), 1 + np.arange(P)] = pairs[:, 1]
    for it in range(steps + 1):
        td, wd = A @ t, A @ w                                  # (D,), (D, k)
        sd = sigmoid(td[:, None] + logs)                       # (D, J)
        res = (C - sd[:, :, None] * wd[:, None, :]).ravel()
        ds = sd * (1.0 - sd)
        # d pred / d t_f = A[:, f] ds w^T ; d pred / d w_f = A[:, f] s (x) I
        Jt = (A[:, None, None, :] * (ds[:, :, None] * wd[:, None, :])[..., None])
        Jw = (A[:, None, None, :, None] * sd[:, :, None, None, None]
              * np.eye(k)[None, None, :, None, :])
        Jac = np.concatenate([Jt.reshape(D * J * k, free),
                              Jw.reshape(D * J * k, free * k)], axis=1)
        if it == steps:
            break
        step = np.linalg.lstsq(Jac, res, rcond=None)[0]
        t = t + step[:free]
        w = w + step[free:].reshape(free, k)
        if np.max(np.abs(step[:free])) < 1e-15 * max(1.0, np.max(np.abs(t))):
            td, wd = A @ t, A @ w
            sd = sigmoid(td[:, None] + logs)
            res = (C - sd[:, :, None] * wd[:, None, :]).ravel()
            break
    return res, Jac, t


def polish_ranges(L: np.ndarray, widths: list[int], tied: tuple, pairs_AB: np.ndarray,
                  steps: int = POLISH_STEPS, level: float = 0.0):
    """Gauss-Newton on every head's covectors L_h (rows of L, (m_tot, m)).

    ``tied`` = (Phis (D, J, m), logs (J,), pairs (P, 2), logits (1 + P, H)): each head's
    coordinates L_h Phi must be s(t + logs_j) w^T with t and w linear across the circle
    points (:func:`tied_fit`). ``pairs_AB`` (n, 2, m): the answers g_A, g_B of [a, a, q]
    and [a, q, q]; each head's two coordinate vectors must be parallel (with the weights
    s(t +- log 2) of one t): the residual is the part of nu^T C (nu orthogonal to the
    weights in R^2) orthogonal to the fitted w.

    L_h moves by X_h L_rest (the other heads' rows: a head's own rows only rescale its
    w); t and w are refitted (variable projection); the heads decouple. Returns (L,
    misfit per head relative to its coordinates, the smallest relative singular value
    of each head's step matrix: the polish's conditioning, the misfit history)."""
    starts = np.cumsum([0] + widths)
    H = len(widths)
    Phis, logs, pairs, logits = tied
    logits = np.array(logits, dtype=float)
    history = []
    for _ in range(steps + 1):
        updates, misfit, conditioning = [], np.zeros(H), np.zeros(H)
        C = np.einsum("rm,djm->djr", L, Phis)                  # (D, J, m_tot)
        CP = np.einsum("rm,njm->njr", L, pairs_AB)             # (n, 2, m_tot)
        for h in range(H):
            own = slice(starts[h], starts[h + 1])
            rest = np.r_[0:starts[h], starts[h + 1]:starts[-1]]
            dh = widths[h]
            Ch = C[:, :, own]
            res, Jac, logits[:, h] = tied_fit(Ch, logs, pairs, logits[:, h], steps=3)
            Qt = np.linalg.qr(Jac)[0]
            D, J = Ch.shape[:2]
            G = np.einsum("djp,ik->djikp", C[:, :, rest], np.eye(dh)).reshape(D * J * dh, -1)
            G = G - Qt @ (Qt.T @ G)
            r = res - Qt @ (Qt.T @ res)
            normal, rhs = G.T @ G, G.T @ r
            total, size = float(r @ r), float(np.sum(Ch * Ch))
            # the pairs, every direction at once
            a, b = CP[:, 0, own], CP[:, 1, own]                  # (n, d_h)
            _, t, _ = three_token_solve(a, b)
            t = np.nan_to_num(t)
            s1, s2 = sigmoid(t + math.log(2.0)), sigmoid(t - math.log(2.0))
            norm = np.hypot(s1, s2)
            nu = np.stack([-s2, s1], axis=1) / norm[:, None]    # (n, 2)
            w = (s1[:, None] * a + s2[:, None] * b) / norm[:, None]
            w /= np.maximum(np.linalg.norm(w, axis=1), np.finfo(float).tiny)[:, None]
            proj = np.eye(dh)[None] - w[:, :, None] * w[:, None, :]          # (n, d_h, d_h)
            rp = np.einsum("nik,nk->ni", proj, np.einsum("nj,njk->nk", nu, CP[:, :, own]))
            z = np.einsum("nj,njp->np", nu, CP[:, :, rest])                  # (n, p)
            Gp = np.einsum("nik,np->nikp", proj, z).reshape(len(a) * dh, -1)
            normal += Gp.T @ Gp
            rhs += Gp.T @ rp.ravel()
            total += float(np.sum(rp * rp))
            size += float(np.sum(a * a) + np.sum(b * b))
            misfit[h] = math.sqrt(total / max(size, np.finfo(float).tiny))
            ev = np.linalg.eigvalsh(normal)
            conditioning[h] = math.sqrt(max(ev[0], 0.0) / ev[-1]) if ev[-1] > 0 else 0.0
            X = -np.linalg.solve(normal, rhs).reshape(dh, -1)
            updates.append((own, rest, X))
        history.append(float(misfit.max()))
        if misfit.max() <= level or (len(history) > 2 and history[-1] >= 0.5 * history[-2]):
            break
        new = L.copy()
        for own, rest, X in updates:
            new[own] = L[own] + X @ L[rest]
        L = new
    return L, misfit, conditioning, history


def symmetric_sequences(X: np.ndarray, q: np.ndarray, copies: int) -> np.ndarray:
    """(K, 2 copies + 1, d): [x x copies, -x x copies, q] for every row x of X (K, d)."""
    K, d = X.shape
    S = np.empty((K, 2 * copies + 1, d))
    S[:, :copies], S[:, copies:2 * copies], S[:, -1] = X[:, None], -X[:, None], q
    return S


def covariance_start(ask, Q: np.ndarray, heads: int, rng: np.random.Generator):
    """Every head's covectors L_h, to first order in the logits (the covariance start).

    A sequence [x x k, -x x k, q] (x, q in S) has mean (1 - p) q and covariance
    p x x^T + p (1 - p) q q^T, p = 2k / (2k + 1); to first order in the logits its answer
    is F(x, q) = R q + c + (1 - p) O' q + p (1 - p) sum_h O'_h q q^T y_h(q)
    + p sum_h O'_h x x^T y_h(q). Differences between two x cancel all but the last term
    (its error: the logits' size over 2k + 1, and their square). With e, u orthogonal
    and s = (e + u) / sqrt(2), 2 F(s) - F(u) - F(e) - [the same with a reference w] is

        p T_q u = p sum_h (e^T y_h(q)) O'_h u + p sum_h O'_h e (u^T y_h(q)),

    and the last sum lies in V(e) = span{O'_h e} (H dimensions; the spans of F(e, q) -
    F(w, q) over q, V(e) + V(w), meet there). Modulo V(e) the ranges stay independent,
    R_h / <O'_h e> of dimension d_h - 1, and T_q = B diag(c_h(q) I) O-bar with
    c_h(q) = e^T y_h(q): a pencil over SLICES query tokens whose matrices share their
    block-diagonal factors (Jennrich). Its left eigenvectors, grouped by the direction of
    (c_h(q_j))_j and refined as the left null space of the pencil's misfit at that
    direction, give each head's covectors vanishing on O'_h e; a second e gives the
    missing one (the two (d_h - 1)-dimensional subspaces of one head share d_h - 2
    dimensions, those of two heads none: heads matched by that).

    Unlike the ratio start this needs no gap between the heads' logits: the heads are
    told apart by their ranges and by e^T y_h(q), whose ratios across heads are of order
    one however small the logits. It is a start: its error is of the logits' order over
    2k + 1 and their square (1e-4 to 1e-3 at GPT-2's initial scale); the range polish
    takes it to the answers' rounding.

    Returns
    -------
    L : (m_tot, m)
        Every head's covectors (rows, head by head).
    widths : list of int
        d_h.
    queries : int
        Queries spent.
    """
    d = Q.shape[0]
    n, H = d - 1, int(heads)
    rho = float(np.linalg.norm(Q[:, 0]))
    if n < REFERENCES + 3:
        raise NotIdentifiableError(f"d = {d} is too small for the covariance start")
    frame = rho * (hyperplane_rotation(d, rng) @ hyperplane_basis(d))       # (d, n)
    directions, refs = frame[:, :2].T, frame[:, 2:2 + REFERENCES].T
    slices = min(SLICES, d)
    k = PAIR_COPIES
    spans = np.concatenate([symmetric_sequences(np.vstack([directions, refs]), Q[:, j], k)
                            for j in range(d)])
    others = [np.delete(frame, a, axis=1).T for a in range(2)]            # (n - 1, d) each
    middles = [(o + directions[a]) / math.sqrt(2.0) for a, o in enumerate(others)]
    pencil = np.concatenate([symmetric_sequences(np.vstack([others[a], middles[a]]),
                                                 Q[:, j], k)
                             for a in range(2) for j in range(slices)])
    answers = ask(np.concatenate([spans, pencil]))
    queries = len(answers)
    m = answers.shape[1]
    if m < 2 * H:
        raise NotIdentifiableError(f"answers of width m = {m} < 2H = {2 * H}")
    span_answers = answers[:len(spans)].reshape(d, 2 + REFERENCES, m)
    pencil_answers = answers[len(spans):].reshape(2, slices, 2 * (n - 1), m)
    subspaces = []
    for a in range(2):
        Fe = span_answers[:, a]                                            # (d, m)
        projector = np.zeros((m, m))
        for i in range(REFERENCES):
            U = np.linalg.svd((Fe - span_answers[:, 2 + i]).T, full_matrices=False)[0]
            projector += U[:, :2 * H] @ U[:, :2 * H].T
        complement = np.linalg.eigh(projector)[1][:, :m - H]             # V(e)'s complement
        slabs = []
        for j in range(slices):
            Fu, Fs = pencil_answers[a, j, :n - 1], pencil_answers[a, j, n - 1:]
            slabs.append(complement.T @ (2.0 * Fs - Fu - Fe[j]).T)
        T = np.array(slabs)                                                # (J, m - H, n - 1)
        # the quotient's part the heads reach (m_tot - H dimensions)
        U, sv, _ = np.linalg.svd(np.concatenate(list(T), axis=1), full_matrices=False)
        rank = gap_rank(np.diag(sv)) if sv[-1] < 1e-2 * sv[0] else len(sv)
        T = np.einsum("ar,jab->jrb", U[:, :rank], T)
        lift = complement @ U[:, :rank]                                    # (m, rank)
        subspaces.append([lift @ f for f in pencil_covectors(T, H, rng)])
    return match_covectors(subspaces[0], subspaces[1], H, m) + (queries,)


def pencil_covectors(T: np.ndarray, heads: int, rng: np.random.Generator) -> list:
    """The heads' covector subspaces of a pencil T (J, r, k) = B diag(c_h(j) I) O-bar:
    (r, s_h) bases, one per head (s_h its block's size).

    Jennrich's eigenvectors of a ratio of two random combinations, grouped by the
    direction of (c_h(j))_j, then each group's subspace refined as the left null space of
    (I - c c^T) applied to the pencil (and c as the top direction of its answers). Two
    heads whose eigenvalues nearly meet in one ratio mix their eigenvectors: of PENCIL_DRAWS
    random ratios, the grouping whose refined subspaces fit the pencil best is kept."""
    J, r, k = T.shape
    scale = float(np.sum(T * T))
    best, best_misfit = None, math.inf
    for _ in range(PENCIL_DRAWS):
        num = np.tensordot(rng.standard_normal(J), T, axes=1)
        den = np.tensordot(rng.standard_normal(J), T, axes=1)
        try:
            F = np.linalg.inv(np.linalg.eig(num @ np.linalg.pinv(den))[1])   # (r, r) rows
        except np.linalg.LinAlgError:
            continue
        G = np.einsum("ia,jab->ijb", F, T)                                 # (r, J, k)
        phis = np.array([np.linalg.svd(g, full_matrices=False)[0][:, 0] for g in G],
                        dtype=complex)
        top = phis[np.arange(r), np.argmax(np.abs(phis), axis=1)]
        phis *= np.exp(-1j * np.angle(top))[:, None]
        similarity = np.abs(phis.conj() @ phis.T)
        distance = np.clip(1.0 - similarity[np.triu_indices(r, 1)], 0.0, None)
        labels = fcluster(linkage(distance, "average"), heads, criterion="maxclust")
        if len(set(labels)) != heads:
            continue
        bases, misfit = [], 0.0
        for label in range(1, heads + 1):
            members = np.flatnonzero(labels == label)
            c = np.real(phis[members].mean(axis=0))
            for _ in range(3):
                c /= np.linalg.norm(c)
                N = np.concatenate(list(np.tensordot(np.eye(J) - np.outer(c, c), T, axes=1)),
                                   axis=1)                                  # (r, J k)
                U, sv, _ = np.linalg.svd(N, full_matrices=False)
                basis = U[:, r - len(members):]                             # (r, s)
                stacked = np.einsum("as,jab->jsb", basis, T).reshape(J, -1)
                c = np.linalg.svd(stacked, full_matrices=False)[0][:, 0]
            misfit += float(np.sum(sv[r - len(members):] ** 2))
            bases.append(basis)
        if misfit < best_misfit:
            best, best_misfit = bases, misfit
    if best is None:
        raise NotIdentifiableError(f"the covariance start could not group its covectors "
                                   f"into {heads} heads")
    log.debug("covariance start: pencil misfit %.3g", math.sqrt(best_misfit / scale))
    return best


def match_covectors(first: list, second: list, heads: int, m: int):
    """Every head's covectors (L, widths) from its subspaces of two covariance starts
    (``first``, ``second``: (m, s_h) bases, covectors vanishing on O'_h e and O'_h e'):
    a head's two subspaces share s_h - 1 dimensions, two heads' none."""
    sizes = [b.shape[1] for b in first]
    if min(sizes) < 2 or sorted(sizes) != sorted(b.shape[1] for b in second):
        raise NotIdentifiableError(
            f"the covariance start's groups of covectors {sizes} cannot be matched (heads "
            f"of output rank 2 or less, or groups that disagree)")
    ortho = [[np.linalg.qr(b)[0] for b in group] for group in (first, second)]
    cost = np.array([[1.0 - np.linalg.svd(a.T @ b, compute_uv=False)[0] for b in ortho[1]]
                     for a in ortho[0]])
    rows, cols = linear_sum_assignment(cost)
    blocks, widths = [], []
    for h, g in zip(rows, cols):
        width = first[h].shape[1] + 1
        rows_h = np.linalg.svd(np.concatenate([ortho[0][h], ortho[1][g]], axis=1).T,
                               full_matrices=False)[2][:width]
        blocks.append(rows_h)
        widths.append(width)
    L = np.concatenate(blocks)
    if L.shape[0] > m:
        raise ModelMismatchError(f"the heads' output ranks {widths} add up to more than "
                                 f"m = {m}")
    return L, widths


def tied_probes(phi, q0: np.ndarray, probes: np.ndarray, L: np.ndarray, widths: list[int],
                logs: np.ndarray):
    """The range polish's tied data from known covectors L (m_tot, m): ratio answers at
    probes[0], and per pair k = 1 .. max(d_h) + 1 at probes[k] and at the circle point
    between them; each head's logits at the free directions fitted in its coordinates.

    Returns Phis (list of (J, m)), ts ((1 + P, H) logits), pairs ((P, 2) the circle
    points' (alpha, beta))."""
    P = TIED_PAIRS * (max(widths) + 1)
    extra = [circle_point(q0, probes[0], probes[k]) for k in range(1, P + 1)]
    answers = phi(np.concatenate([probes[:P + 1], np.array([p for p, _ in extra])]))
    Phis = [answers[0]]
    for k in range(1, P + 1):
        Phis.extend([answers[k], answers[P + k]])
    starts = np.cumsum([0] + widths)
    ts = np.array([[fit_head(answers[i] @ L[starts[h]:starts[h + 1]].T, logs, 0.0)[0]
                    for h in range(len(widths))] for i in range(P + 1)])
    return Phis, ts, [coef for _, coef in extra]


def gap_rank(V: np.ndarray) -> int:
    """The rank of V at the largest drop of its singular values (at least 1), or full."""
    sv = np.linalg.svd(V, compute_uv=False)
    sv = sv[sv > RANK_TOL * sv[0]] if sv[0] > 0 else sv[:1]
    if len(sv) < 2:
        return 1
    drops = sv[1:] / sv[:-1]
    k = int(np.argmin(drops))
    return k + 1 if drops[k] < 1e-3 else len(sv)


def head_ranks(Vh: list[np.ndarray], total: int) -> list[int] | None:
    """Every head's rank d_h from its vectors Vh[h] (m, K): the counts of singular values
    above one relative threshold, the largest threshold at which they add up to the
    rank ``total`` of all the vectors together (None when no threshold does)."""
    svs = [np.linalg.svd(V, compute_uv=False) for V in Vh]
    for level in np.logspace(-1, -11, 41):
        ranks = [int(np.sum(sv > level * sv[0])) for sv in svs]
        if sum(ranks) == total:
            return ranks
    return None


def circle_point(q: np.ndarray, a1: np.ndarray, a2: np.ndarray):
    """A token a'' on the circle of S through q, a1, a2 (the arc's point between a1 and
    a2), and (alpha, beta) with a'' - q = alpha (a1 - q) + beta (a2 - q)."""
    U = np.stack([a1 - q, a2 - q], axis=1)                     # (d, 2)
    basis = np.linalg.qr(U)[0]
    centre = q - basis @ (basis.T @ q)                         # the sphere's centre 0 onto the plane
    radius = np.linalg.norm(q - centre)
    middle = 0.5 * (a1 + a2) - centre
    point = centre + radius * middle / np.linalg.norm(middle)
    coef = np.linalg.lstsq(U, point - q, rcond=None)[0]
    return point, coef


def extract_heads_on_sphere(oracle, heads: int, *, seed, verify_tolerance,
                            radius) -> ExtractionResult:
    """:func:`attnextract.learners.vector_pre_layer_norm.extract_vector_pre_layer_norm`
    for ``heads`` >= 2 on the (rescaled) view ``oracle`` (module docstring): recovery,
    held-out verification on the sphere and off it, the report.

    Parameters
    ----------
    oracle : QueryAccess
        Answers (B, m) at the last position (or (B, N, m), read at the last position).
    heads : int
        H >= 2, the block's number of heads.
    seed : int or None
        Seed of the simplex's rotation, the extra probe directions and the held-out check.
    verify_tolerance : float
        Largest held-out error on the sphere, relative to the RMS of F - c.
    radius : float or None
        Norm of every probe token (default sqrt(d)).

    Returns
    -------
    ExtractionResult
        ``model`` a :class:`VectorSphereAttention`: W (H, d, d), b (H, d), O (H, m, d),
        c (m,), R (m, d), projected on 1^T x = 0; the report's details hold the error
        bars ("error bar" the largest), the heads' output ranks, the polish's misfit and
        conditioning.

    Raises
    ------
    NotIdentifiableError
        d < 3, m < 2H, the heads could not be labelled (logits too close at every probe
        and the covariance start's groups of covectors disagree or have fewer than two
        dimensions), the polish did not reach the answers' rounding, a singular system.
    ModelMismatchError
        The answers are not those of H softmax heads with independent output ranges, or
        held-out verification failed (``.result`` holds the extraction).
    """
    start, start_queries, start_bb = time.perf_counter(), oracle.queries, oracle.black_box_seconds
    d, H = oracle.dim, int(heads)
    n = d - 1
    oracle.plan(d + 6 * H * d + 4 * d,
                f"vector pre-LayerNorm block of {H} heads on the sphere (an estimate)",
                need=d)
    try:
        model, counts, info = recover_heads(oracle, H, seed=seed, radius=radius)
    except np.linalg.LinAlgError as exc:
        # a singular system: the answers did not determine the heads' separation
        raise NotIdentifiableError(f"the {H} heads could not be separated: a singular "
                                   f"system ({exc})") from None
    m = model.out_dim
    rng = np.random.default_rng(None if seed is None else [int(seed), 1])
    recovery = oracle.queries - start_queries
    n_verify = verification_count(recovery, recovery)
    n_invariance = max(4, int(INVARIANCE_SHARE * n_verify))
    bars = info["bars"]
    verification = verify_vector_on_sphere(oracle, model, count=n_verify,
                                           invariance=n_invariance, rng=rng,
                                           tolerance=verify_tolerance,
                                           error_bar=max(bars.values()))
    floor = math.ceil((H * (n * n + n) + 2 * m * n + m) / m)
    report = Report(
        kind=model.kind, dim=d, queries=oracle.queries - start_queries,
        breakdown={**counts, "verification": verification.sequences},
        floor=floor, verification=verification, seconds=time.perf_counter() - start,
        black_box_seconds=oracle.black_box_seconds - start_bb,
        details={"sphere": f"tokens with 1^T x = 0 and |x| = {model.radius:.6g} (the model "
                           f"is defined there only)",
                 "heads": H, "out_dim": m, "output ranks d_h": info["widths"],
                 "chord |a - q| / R": f"{info['chord']:.3g}",
                 "start": info["start"],
                 "ratio directions skipped": info["skipped"],
                 "range polish misfit": float(np.max(info["misfit"])),
                 "range polish conditioning": float(np.min(info["conditioning"])),
                 "column reads' condition": float(info["worst"]),
                 "identified": "P W_h P, P b_h, O_h P per head, R P and c on the sphere "
                               "(gamma, beta, eps and the raw weights are not identifiable)",
                 "error bar": max(bars.values()), **bars})
    try:
        return checked_result(model, report,
                              f"a pre-LayerNorm block of {H} heads (vector answers)")
    except ModelMismatchError as exc:
        if verification.family_errors.get("invariance", 0.0) > verification.tolerance:
            exc.args = (exc.args[0] + "; off the sphere, rescaling the tokens or shifting "
                        "them along (1, ..., 1) changed the answers: no LayerNorm in front "
                        "of the attention",)
        raise


def recover_heads(oracle, heads: int, *, seed, radius):
    """The recovery of :func:`extract_heads_on_sphere` (stages 1 to 6).

    Returns
    -------
    model : VectorSphereAttention
    counts : dict
        Queries per stage.
    info : dict
        ``bars`` (the error bars), ``L`` (m_tot, m) (the heads' covectors), ``widths``
        (d_h), ``misfit``, ``conditioning``, ``history`` (the polish), ``level`` (the
        answers' relative rounding), ``worst`` (the column reads' largest condition
        number), ``chord``, ``skipped`` (ratio directions not labelled), ``start`` (which
        start labelled the heads: the ratio eigenproblem or the covariance start).
    """

    def ask(X: np.ndarray) -> np.ndarray:
        return last_answers(oracle.query(X))
    d, H = oracle.dim, int(heads)
    if d < 3:
        raise NotIdentifiableError(f"the sphere of 1^T x = 0 in d = {d} holds two tokens only")
    n = d - 1
    rho = sphere_radius(d, radius)
    rng = np.random.default_rng(seed)
    Q = simplex_columns(d, rho, rng)
    basis = hyperplane_basis(d)
    counts = {}

    singles = ask(Q.T[:, None, :])                                        # (d, m)
    m = singles.shape[1]
    counts["constant and R + O"] = d
    c = singles.mean(axis=0)
    M = (n / (rho * rho * d)) * (singles - c).T @ Q.T                      # (m, d)
    scale = float(np.abs(singles).max()) + float(np.abs(c).max())
    if m < 2 * H:
        raise NotIdentifiableError(f"answers of width m = {m} < 2H = {2 * H}: the heads' "
                                   f"vectors at two directions cannot be told apart")
    q0 = Q[:, 0]
    length = H + 3
    ratios = np.array([k / (length - k) for k in range(1, length)])
    logs = np.log(ratios)
    tangents = tangent_simplex(Q, 0)
    chord = CHORD
    # the ratio probes' directions: the tangent simplex, then random unit tangents (any
    # direction will do; a direction where two heads' logits nearly meet is skipped)
    extra_tangents = rng.standard_normal((d, (CANDIDATES - 1) * n))
    extra_tangents -= extra_tangents.mean(axis=0)
    extra_tangents -= np.outer(q0, q0 @ extra_tangents) / (rho * rho)
    extra_tangents /= np.linalg.norm(extra_tangents, axis=0)
    candidates = np.concatenate([tangents, extra_tangents], axis=1)        # (d, CANDIDATES n)
    total = candidates.shape[1]
    probes = column_probes(q0, candidates, chord)

    def phi(tokens: np.ndarray) -> list[np.ndarray]:
        """Ratio answers Phi (J, m) of every token in ``tokens`` (one batch)."""
        X = np.concatenate([ratio_sequences(a, q0, length) for a in tokens])
        out = ask(X) - c - M @ q0
        return list(out.reshape(len(tokens), length - 1, m))

    # stage 2-3: heads at directions 0, 1, ... labelled through circle points
    # the reference direction: of the first candidates, the one whose heads' logits are
    # furthest apart (its vectors label every other direction's); a chord whose logits
    # exceed MAX_LOGIT is shortened (logits grow with the chord)
    counts["ratio probes"] = 0
    start = "ratio eigenproblem"
    try:
        step = max(2, -(-m // H))
        trial = min(total, 2 * step)
        rescales = 0
        while True:
            answers = phi(probes[:trial])
            counts["ratio probes"] += trial * (length - 1)
            best, gap = None, -1.0
            for i, Phi in enumerate(answers):
                try:
                    t_i, V_i, _ = ratio_eigen(Phi, ratios, H)
                except (ModelMismatchError, NotIdentifiableError):
                    continue
                if np.min(np.diff(t_i)) > gap:
                    best, gap = (i, t_i, V_i, Phi), float(np.min(np.diff(t_i)))
            if best is None:
                raise LogitsTooClose(
                    "the heads could not be told apart at any probe of q_0: their logits are "
                    "too close for the ratio probes")
            first_probe, t0, V0, Phi0 = best
            peak = float(np.max(np.abs(t0)))
            if peak <= MAX_LOGIT:
                break
            if rescales == MAX_RESCALES:
                raise NotIdentifiableError(f"the heads' logits stay above {MAX_LOGIT} at every "
                                           f"chord down to {chord:.3g}")
            chord, rescales = _shorter(chord, peak), rescales + 1
            probes = column_probes(q0, candidates, chord)
        Phis = [Phi0]
        probes = np.roll(probes, -first_probe, axis=0)
        ts, Vs = [t0], [V0]
        used, skipped = 1, 0
        pairs = []
        while True:
            new = list(range(used, min(total, used + step)))
            extra = []
            for k in new:
                point, coef = circle_point(q0, probes[0], probes[k])
                extra.append((point, coef))
            batch = np.concatenate([probes[new], np.array([p for p, _ in extra])])
            answers = phi(batch)
            counts["ratio probes"] += len(batch) * (length - 1)
            for i in range(len(new)):
                try:
                    tk, Vk, _ = ratio_eigen(answers[i], ratios, H)
                    t2, V2, _ = ratio_eigen(answers[len(new) + i], ratios, H)
                except (ModelMismatchError, NotIdentifiableError):
                    skipped += 1                     # too close to label here: next direction
                    continue
                alpha, beta = extra[i][1]
                coefs = np.linalg.lstsq(np.concatenate([V0, Vk], axis=1), V2, rcond=None)[0]
                first = np.argmax(np.abs(coefs[:H]), axis=0)
                second = np.argmax(np.abs(coefs[H:]), axis=0)
                others = np.abs(coefs).copy()
                others[first, range(H)] = 0.0
                others[H + second, range(H)] = 0.0
                if (sorted(first) != list(range(H)) or sorted(second) != list(range(H))
                        or np.max(np.abs(coefs[first, range(H)] - alpha)) > MATCH_TOL * abs(alpha)
                        or np.max(np.abs(coefs[H + second, range(H)] - beta))
                        > MATCH_TOL * abs(beta)
                        or others.max() > MATCH_TOL * max(abs(alpha), abs(beta))):
                    skipped += 1
                    continue
                order = np.empty(H, dtype=int)
                order[first] = second                     # head first[i] of u_1 is second[i] of u_k
                ts.append(tk[order])
                Vs.append(Vk[:, order])
                order2 = np.empty(H, dtype=int)
                order2[first] = np.arange(H)
                Vs.append(V2[:, order2])
                Phis.extend([answers[i], answers[len(new) + i]])
                pairs.append((alpha, beta))
            used = new[-1] + 1 if new else used
            ranks = head_ranks([np.stack([V[:, h] for V in Vs], axis=1) for h in range(H)],
                               gap_rank(np.concatenate(Vs, axis=1)))
            labelled = (len(Vs) - 1) // 2 + 1
            if (ranks is not None and all(r + 2 <= labelled for r in ranks)) or used >= total:
                break
        if ranks is None or any(r + 2 > labelled for r in ranks):
            raise LogitsTooClose(
                "the heads could not be labelled across directions: their logits are too "
                "close for the ratio probes")
        widths = ranks
        bases = []
        for h in range(H):
            left = np.linalg.svd(np.stack([V[:, h] for V in Vs], axis=1), full_matrices=False)[0]
            bases.append(left[:, :widths[h]])
        B = np.concatenate(bases, axis=1)                                      # (m, m_tot)
        m_tot = B.shape[1]
        sv = np.linalg.svd(B, compute_uv=False)
        if m_tot > m or sv[-1] < 1e-6 * sv[0]:
            raise ModelMismatchError(
                f"the black box is not a sum of {H} pre-LayerNorm heads with independent output "
                f"ranges: their ranks {widths} overlap in R^{m}")
        span = np.linalg.svd(B, full_matrices=False)[0]
        L = np.linalg.solve(span.T @ B, span.T)                                # (m_tot, m)
    except LogitsTooClose as exc:
        # no probe separates the heads' logits: they are small, and to first order the
        # heads are told apart by their ranges (the covariance start)
        log.info("%s: the covariance start instead", exc)
        L, widths, counts["covariance start"] = covariance_start(
            ask, Q, H, np.random.default_rng(None if seed is None else [int(seed), 2]))
        Phis, ts, pairs = tied_probes(phi, q0, probes, L, widths, logs)
        counts["ratio probes"] += len(Phis) * (length - 1)
        span = np.linalg.svd(np.concatenate(Phis).T, full_matrices=False)[0][:, :L.shape[0]]
        skipped, start = 0, "covariance (no probe separates the logits)"
    level = ROUNDING * EPS * math.sqrt(m) * scale / max(
        float(np.max([np.abs(P).max() for P in Phis])), np.finfo(float).tiny)
    # stage 5's answers first: [a, a, q] and [a, q, q] at the n tangent probes of q_0
    tangent_probes = column_probes(q0, tangents, chord)
    g = ask(three_token_sequences(tangent_probes, q0)) - c - M @ q0
    counts["O and column 0"] = 2 * n
    gA, gB = g[:n], g[n:]
    L, misfit, conditioning, history = polish_ranges(
        L, widths, (np.array(Phis), logs, np.array(pairs), np.array(ts)),
        np.stack([gA, gB], axis=1), level=level)
    if misfit.max() > POLISH_LEVEL * level:
        raise NotIdentifiableError(
            f"the heads' output ranges did not separate: the polish ends at a misfit of "
            f"{misfit.max():.3g} against the answers' rounding {level:.3g}")
    counts["polish"] = 0
    starts = np.cumsum([0] + widths)
    Ls = [L[starts[h]:starts[h + 1]] for h in range(H)]                 # (d_h, m) each
    B = span @ np.linalg.inv(L @ span)                                     # (m, m_tot)
    Bs = [B[:, starts[h]:starts[h + 1]] for h in range(H)]

    def differences(out: np.ndarray, q: np.ndarray) -> np.ndarray:
        return out - c - q @ M.T

    # stage 5: O'_h P and y_h(q_0) per head from the pair answers
    U0 = tangent_probes - q0
    restricted = U0 @ basis
    spread0 = 1.0 / np.linalg.svd(restricted, compute_uv=False)[-1]
    O = np.empty((H, m, d))
    Y = np.empty((H, d, d))
    O_error = np.zeros(H)
    t_error = np.zeros((H, d))
    level_abs = ROUNDING * EPS * math.sqrt(m) * scale
    range_error = float(np.max(misfit / np.maximum(conditioning, np.finfo(float).tiny)))
    for h in range(H):
        hc, t, kk = three_token_solve(gA @ Ls[h].T, gB @ Ls[h].T)        # (n, d_h), (n,)
        # first order, as the single head's: the pair's coordinates off by the rounding
        # through L_h and the leak at the polish's bound
        e_pair = (level_abs * np.linalg.norm(Ls[h], 2)
                  + range_error * np.linalg.norm(gA, axis=1))
        normA = np.linalg.norm(gA @ Ls[h].T, axis=1)
        k_err = e_pair * (np.abs(kk) + 1.0) / normA
        t_error[h, 0] = float(np.linalg.norm(
            k_err * (4.0 / np.abs(4.0 * kk - 1.0) + 1.0 / np.abs(1.0 - kk))))
        h_err = (3.0 * e_pair + 12.0 * np.linalg.norm(gB @ Ls[h].T, axis=1) * k_err
                 / np.abs(4.0 * kk - 1.0)) / np.abs(4.0 * kk - 1.0)
        O_error[h] = spread0 * float(np.linalg.norm(h_err)) * np.linalg.norm(Bs[h], 2)
        _require_finite(t, "q_0")
        O[h] = Bs[h] @ (basis @ np.linalg.solve(restricted, hc)).T
        Y[h][:, 0], _ = _solve_on_hyperplane(U0, t, basis)
    Oc = [Ls[h] @ O[h] for h in range(H)]                                 # (d_h, d)

    # stage 5b: every other vertex, k tokens a query, k logits of every head at once
    k = max(1, min(widths) // TOKEN_SHARE)
    groups = [np.arange(s_, min(s_ + k, n)) for s_ in range(0, n, k)]
    groups[-1] = np.arange(n - k, n)                 # the last group overlaps: one length
    sequences, owners = [], []
    for j in range(1, d):
        P = column_probes(Q[:, j], tangent_simplex(Q, j), chord)
        for group in groups:
            sequences.append(np.vstack([P[group], Q[:, j]]))
            owners.append((j, group, P))
    column_answers = ask(np.stack(sequences))
    counts["columns"] = len(sequences)
    logits = np.zeros((H, d, n))
    worst = 0.0

    for answer, (j, group, P) in zip(column_answers, owners):
        gj = differences(answer[None], Q[:, j])[0]
        U = P[group] - Q[:, j]
        for h in range(H):
            A_ = Oc[h] @ U.T                                               # (d_h, k)
            alpha = np.linalg.lstsq(A_, Ls[h] @ gj, rcond=None)[0]
            last = 1.0 - alpha.sum()
            with np.errstate(divide="ignore", invalid="ignore"):
                logits[h, j, group] = np.log(alpha / last)
            sv = np.linalg.svd(A_, compute_uv=False)
            worst = max(worst, sv[0] / sv[-1] if sv[-1] > 0 else math.inf)
            # first order: the coordinates' error (rounding through L_h, and the other
            # heads' leak at the polish's bound) through A^+, then through the logs
            coord_error = (level_abs * np.linalg.norm(Ls[h], 2)
                           + range_error * np.linalg.norm(gj)) / sv[-1]
            t_error[h, j] = max(t_error[h, j], coord_error * float(
                np.linalg.norm(1.0 / alpha) + math.sqrt(len(alpha)) / abs(last)))
    spreads = np.full(d, spread0)
    for h in range(H):
        for j in range(1, d):
            _require_finite(logits[h, j], f"q_{j}")
            U = column_probes(Q[:, j], tangent_simplex(Q, j), chord) - Q[:, j]
            Y[h][:, j], spreads[j] = _solve_on_hyperplane(U, logits[h, j], basis)
    b = Y.mean(axis=2)                                                     # (H, d)
    W = (n / (rho * rho * d)) * np.einsum("hdj,ej->hde", Y, Q)
    R = M - O.sum(axis=0)
    model = VectorSphereAttention(W, b, O, c, R, rho)
    Y_error = np.sqrt(np.sum((spreads[None] * t_error) ** 2, axis=1))    # (H,)
    W_norm = np.maximum(np.linalg.norm(model.W, axis=(1, 2)), np.finfo(float).tiny)
    O_norm = np.maximum(np.linalg.norm(model.O, axis=(1, 2)), np.finfo(float).tiny)
    bars = {"error_bar_W": float(np.max(math.sqrt(n / d) * Y_error / rho / W_norm)),
            "error_bar_b": float(np.max(Y_error / math.sqrt(d) / np.maximum(
                np.linalg.norm(model.b, axis=1), rho * W_norm))),
            "error_bar_O": float(np.max(O_error / O_norm)),
            "error_bar_ranges": range_error}
    return model, counts, dict(bars=bars, L=L, widths=widths, misfit=misfit, conditioning=conditioning,
                               history=history, level=level, worst=worst, chord=chord,
                               skipped=skipped, start=start)


def _require_finite(t: np.ndarray, where: str) -> None:
    if not np.all(np.isfinite(t)):
        raise ModelMismatchError(
            f"the black box is not a sum of pre-LayerNorm heads: its probes at {where} "
            f"imply no attention weights in (0, 1)")
