"""A pre-LayerNorm attention block (GPT-2 style) on the sphere where LayerNorm is affine.

The block f(X) = r^T x_N + g(LN(X)), g a biased attention head, is identifiable only
through LN's output. On the sphere S = {x : 1^T x = 0, |x| = R} LayerNorm is the affine
map x -> A x + beta (A = diag(gamma) / sqrt(R^2 / d + eps)), and the block there is

    f(X) = r^T x_N + softmax(X (W x_N + b))^T X v + c,     x_i in S,

a biased head plus the residual readout (:meth:`PreLayerNormAttention.on_sphere`). Only
the restriction of W, b, v, r to the hyperplane 1^T x = 0 is seen, and c: with
m = d - 1, m^2 + 3m + 1 = d^2 + d - 1 numbers (docs/algorithms.md, "Pre-LayerNorm
layer"). LN divides every token by its own norm, so token scales carry nothing: the
probes must lie on S, and the only knob left is the angle between two tokens.

Identities, for tokens a, q in S and the sequence of n copies of a, then q:

    f = c + q^T (v + r) + sigma(t + log n) h,   t = (a - q)^T (W q + b),  h = (a - q)^T v.

Algorithm (m + 1 columns q_j, the vertices of a regular simplex in S, randomly rotated):

1. c and w = P (v + r) from the m + 1 single tokens [q_j] (their sum is 0, their
   outer products sum to R^2 (m + 1) / m P): m + 1 queries.
2. Column q_0: m probes a_k at counts n = 1 and 2 (2m queries). With g_n = f - c - q^T w,
   1 / g_n = (1 + e^{-t} / n) / h, so h = g_1 g_2 / (2 g_1 - g_2) and
   t = log((2 g_1 - g_2) / (2 (g_2 - g_1))): h_k gives v, r = w - v, and t_k W q_0 + b.
3. Columns q_1..q_m: m probes each at n = 1, t_k = logit(g / h_k): m^2 queries.
4. [W | b] from y_j = W q_j + b at the m + 1 vertices (an exact affine solve).

Total m^2 + 3m + 1, the number of identifiable parameters. Probes of a column q:
a_k = R (cos theta q_hat + sin theta e_k), e_k the regular m-simplex of the tangent
space at q (at the simplex angle, a_k are the other vertices). The logits grow with the
chord |a - q|, so a column whose largest |t_k| exceeds MAX_LOGIT is probed again at a
shorter chord (reported as "rescaling"); a short chord leaves the normal direction
q_hat with a component |a - q|^2 / (2R) only, so it is shortened no more than needed.
Once v is known, each column's simplex is reflected so that no height h_k is small
(:func:`balanced_tangents`); column 0's probes with a small height are probed again,
tilted towards v.

Verification (:func:`attnextract.verification.verify_on_sphere`): held-out sequences on S against the model, at
10 x its error bound, and rescaled or shifted copies off S against the box's own answers
(a box with LayerNorm in front cannot see either). Several heads:
:mod:`.pre_layer_norm_heads` (``heads`` >= 2).
"""

from __future__ import annotations

import logging
import math
import time

import numpy as np

from ..errors import InputError, ModelMismatchError, NotIdentifiableError
from ..models import SphereAttention
from ..numerics import safe_norm
from ..oracle import QueryAccess
from ..report import (
    DEFAULT_VERIFY_TOLERANCE,
    ExtractionResult,
    Report,
    checked_result,
    verification_count,
)
from ..sphere import (
    column_probes,
    hyperplane_basis,
    simplex_columns,
    sphere_radius,
    tangent_simplex,
)
from ..verification import INVARIANCE_SHARE, verify_on_sphere
from .pre_layer_norm_heads import extract_pre_layer_norm_heads
from .single_head import logit

log = logging.getLogger(__name__)

TARGET_LOGIT = 2.0       # a rescaled column aims its largest |t_k| at this
MAX_LOGIT = 4.0          # beyond it sigma' < 0.02: the column is probed again, shorter chord
MAX_RESCALES = 8
SMALL_HEIGHT = 1.0 / 8   # column 0's probes with |h_k| below this x the largest: re-probed
TILT = 0.5               # ... tilted this much towards v's tangential part
VALUE_ROUNDING = 64.0    # pair answers within this many ulps of c + q^T w: P v = 0
ROUNDING = 4.0           # error bars: ulps of rounding per answer
EPS = np.finfo(float).eps


def balanced_tangents(E: np.ndarray, z: np.ndarray, spread: float, shift: float) -> np.ndarray:
    """The regular simplex E (d, m) (unit columns, sum 0) reflected so that the heights
    h_k = spread e_k^T z / |z| + shift take two values of the largest smallest size.

    The projections p_k = e_k^T z of a regular simplex sum to 0 with sum p_k^2 =
    m / (m - 1) |z|^2, and any such p is reached: zeta = (m - 1) / m sum_k s_k e_k has
    e_k^T zeta = s_k for every s with sum s_k = 0, and the Householder reflection taking
    zeta / |zeta| to z / |z| maps the simplex onto one with p = s |z| / |zeta|. With n
    of the s_k equal to P_1 and m - n equal to -P_2 (n P_1 = (m - n) P_2), the heights are
    P_1 + shift and shift - P_2: n (and the sign) is chosen for the largest smaller one.
    """
    m = E.shape[1]
    norm = safe_norm(z)
    if m < 2 or norm == 0 or spread == 0:
        return E
    shift = shift / spread                                # the pattern only sees the ratio
    total = m / (m - 1)                                   # sum_k (p_k / |z|)^2
    best = (-1.0, 1, 1.0)
    for n in range(1, m):
        P1, P2 = math.sqrt(total * (m - n) / (n * m)), math.sqrt(total * n / ((m - n) * m))
        for sign in (1.0, -1.0):                          # -1: the pattern mirrored
            low = min(abs(sign * P1 + shift), abs(shift - sign * P2))
            if low > best[0]:
                best = (low, n, sign)
    _, n, sign = best
    pattern = sign * np.where(np.arange(m) < n, float(m - n), -float(n))   # sums to 0
    zeta = (m - 1) / m * (E @ pattern)
    w = zeta / safe_norm(zeta) - z / norm
    if safe_norm(w) < 1e-12:
        return E
    return E - (2.0 / (w @ w)) * np.outer(w, w @ E)


def copy_sequences(A: np.ndarray, q: np.ndarray, copies: int) -> np.ndarray:
    """(k, copies + 1, d): ``copies`` copies of a_k, then q."""
    X = np.repeat(A[:, None, :], copies + 1, axis=1)
    X[:, -1, :] = q
    return X


def two_count_logits(g1: np.ndarray, g2: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(h, t) from g_n = sigma(t + log n) h at n = 1, 2: 1/g_n = (1 + e^{-t}/n) / h."""
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        h = g2 / (2.0 - g2 / g1)               # g1 g2 / (2 g1 - g2), no product to overflow
        t = np.log((2.0 * g1 - g2) / (2.0 * (g2 - g1)))
    return h, t


def extract_pre_layer_norm(oracle: QueryAccess, heads: int | None = None, *, seed=None,
                           verify_tolerance: float = DEFAULT_VERIFY_TOLERANCE,
                           radius: float | None = None) -> ExtractionResult:
    """Recover a pre-LayerNorm attention block on the sphere where LN is affine.

    One head (``heads`` None or 1) here, at d^2 + d - 1 queries; ``heads`` >= 2 runs
    :func:`attnextract.learners.pre_layer_norm_heads.extract_pre_layer_norm_heads`.

    Parameters
    ----------
    oracle : Oracle
        Door to the black box f(X) = r^T x_N + softmax(Y (W y_N + b))^T Y v + c with
        Y = LN(X) (:class:`attnextract.models.PreLayerNormAttention`, one head).
    heads : int, optional
        The block's number of heads (default 1: a block with more is refused).
    seed : int, optional
        Seed of the simplex's rotation and of the held-out verification.
    verify_tolerance : float
        Largest held-out error on the sphere, relative to the outputs' RMS.
    radius : float, optional
        Norm R of every probe token (default sqrt(d): LayerNorm's unit-variance tokens).

    Returns
    -------
    ExtractionResult
        ``model`` a :class:`attnextract.models.SphereAttention`: W (1, d, d), b, v (1, d),
        c and r, projected on 1^T x = 0, valid on the sphere of ``radius`` only;
        ``queries`` d^2 + d - 1 at the floor, plus rescaling and verification.

    Raises
    ------
    NotIdentifiableError
        P v = 0: the outputs never depend on W or b.
    ModelMismatchError
        The box is not a pre-LayerNorm head: its pair probes imply no attention weight,
        or the held-out check on the sphere, or off it (token scale and shift along 1
        must not matter), failed; ``.result`` holds the extraction.
    """
    if heads is not None and (int(heads) != heads or heads < 1):
        raise InputError(f"heads must be a positive integer, got {heads!r}")
    if heads is not None and heads >= 2:
        return extract_pre_layer_norm_heads(oracle, int(heads), seed=seed,
                                            verify_tolerance=verify_tolerance, radius=radius)
    start, start_queries, start_bb = time.perf_counter(), oracle.queries, oracle.black_box_seconds
    d = oracle.dim
    if d < 3:
        raise NotIdentifiableError(f"the sphere of 1^T x = 0 in d = {d} holds two tokens only")
    m = d - 1
    R = sphere_radius(d, radius)
    floor = m * m + 3 * m + 1
    n_verify = verification_count(floor, floor)
    n_invariance = max(4, int(INVARIANCE_SHARE * n_verify))
    oracle.plan(floor + n_verify + n_invariance,
                "pre-LayerNorm head on the sphere (d^2 + d - 1 + verification)")
    rng = np.random.default_rng(seed)
    Q = simplex_columns(d, R, rng)

    log.info("pre-LN head at d = %d, tokens of norm %.3g: c and v + r from %d single tokens",
             d, R, d)
    singles = oracle.query(Q.T[:, None, :])
    c = float(singles.mean())                                  # the vertices sum to 0
    w = (m / (R * R * d)) * (Q @ (singles - c))                # P (v + r)

    # at chord 2 / sqrt(m) the probe differences u_k are a tight frame (condition 1): the
    # normal component R chord^2 / 2 of each matches the tangential simplex's spread
    chords = np.full(d, 2.0 / math.sqrt(m))
    Y = np.empty((d, d))            # columns y_j = W q_j + b (in 1^perp)
    rescaled = 0

    basis = hyperplane_basis(d)
    offset = float(np.abs(singles).max()) + abs(c)             # rounding of c and q^T w

    def measure(j: int, copies: int, tangents: np.ndarray):
        """u_k (k, d), g_k = f - c - q^T w, and the answers' rounding (k,)."""
        A = column_probes(Q[:, j], tangents, chords[j])
        out = oracle.query(copy_sequences(A, Q[:, j], copies))
        rounding = ROUNDING * EPS * (np.abs(out) + offset + abs(Q[:, j] @ w))
        return A - Q[:, j], out - c - Q[:, j] @ w, rounding

    def one_count_logits(U, g, rounding):
        """t_k = logit(g_k / h_k), h_k = u_k^T v, and their error bars (answers, v)."""
        h = U @ v
        share = g / h                                          # sigma(t_k)
        with np.errstate(divide="ignore", invalid="ignore"):
            error = (rounding / (np.abs(h) * share * (1.0 - share))
                     + np.linalg.norm(U, axis=1) * v_error / np.abs(h * (1.0 - share)))
        return logit(share), error

    def balanced(j: int) -> np.ndarray:          # v known: no small height u_k^T v
        q = Q[:, j] / R
        theta = 2.0 * math.asin(min(chords[j] / 2.0, 1.0))
        z = v - (v @ q) * q                       # u_k^T v = R sin(theta) e_k^T z + shift
        return balanced_tangents(tangent_simplex(Q, j), z, R * math.sin(theta) * safe_norm(z),
                                 R * (math.cos(theta) - 1.0) * (v @ q))

    # column 0 at two counts: the heights h_k = u_k^T v and the logits at once
    for attempt in range(MAX_RESCALES + 1):
        U, g1, round1 = measure(0, 1, tangent_simplex(Q, 0))
        _, g2, round2 = measure(0, 2, tangent_simplex(Q, 0))
        h, t = two_count_logits(g1, g2)
        peak = float(np.max(np.abs(t))) if np.all(np.isfinite(t)) else math.inf
        if peak <= MAX_LOGIT or attempt == MAX_RESCALES:
            break
        chords[0] = _shorter(chords[0], peak)
        rescaled += 2 * m
    # P v = 0: every pair answers c + q^T w, to rounding
    if np.max(np.abs(np.concatenate([g1, g2]))) <= VALUE_ROUNDING * np.finfo(float).eps * (
            np.max(np.abs(singles)) + abs(c)):
        raise NotIdentifiableError("P v = 0 (v orthogonal to the sphere's hyperplane): the "
                                   "outputs never depend on W or b")
    _require_finite(t, "column 0", g1, g2)
    v, spread = _solve_on_hyperplane(U, h, basis)
    # first-order error bars of the two-count solve (see two_count_logits)
    D, E = 2.0 * g1 - g2, g2 - g1
    t_error = round1 * np.abs(2.0 / D + 1.0 / E) + round2 * np.abs(1.0 / D + 1.0 / E)
    v_error = spread * safe_norm(round1 * (g2 / D) ** 2 + round2 * 2.0 * (g1 / D) ** 2)
    # the logits of probes with a small height |h_k| carry its rounding magnified: those
    # probes are replaced by ones tilted towards v (their other rows are kept)
    small = np.flatnonzero(np.abs(h) < SMALL_HEIGHT * np.abs(h).max())
    if small.size:
        q = Q[:, 0] / R
        z = v - (v @ q) * q
        E = tangent_simplex(Q, 0)[:, small]
        E += TILT * np.where(z @ E < 0, -1.0, 1.0) * (z / safe_norm(z))[:, None]
        E /= np.linalg.norm(E, axis=0)
        U[small], g, rounding = measure(0, 1, E)
        t[small], t_error[small] = one_count_logits(U[small], g, rounding)
        rescaled += small.size
    _require_finite(t, "column 0", g1, g2)
    Y[:, 0], spread = _solve_on_hyperplane(U, t, basis)
    Y_error = np.empty(d)           # |error of y_j|, first order
    Y_error[0] = spread * safe_norm(t_error)
    chords[1:] = chords[0]

    log.info("W q_j + b at %d more vertices: %d probes of length 2", m, m * m)
    for j in range(1, d):
        for attempt in range(MAX_RESCALES + 1):
            U, g, rounding = measure(j, 1, balanced(j))
            t, t_error = one_count_logits(U, g, rounding)
            peak = float(np.max(np.abs(t))) if np.all(np.isfinite(t)) else math.inf
            if peak <= MAX_LOGIT or attempt == MAX_RESCALES:
                break
            chords[j] = _shorter(chords[j], peak)
            rescaled += m
        _require_finite(t, f"column {j}", g, U @ v)
        Y[:, j], spread = _solve_on_hyperplane(U, t, basis)
        Y_error[j] = spread * safe_norm(t_error)

    # y_j = W q_j + b at the vertices: sum_j q_j = 0, sum_j q_j q_j^T = R^2 d / m P
    b = Y.mean(axis=1)
    W = (m / (R * R * d)) * (Y @ Q.T)
    model = SphereAttention(W[None], b[None], v[None], c, w - v, R)
    # W = m / (R^2 d) Y Q^T with |Q|_2 = R sqrt(d / m); b = Y 1 / d; b against R |W| (b may be 0)
    W_norm = max(safe_norm(W), np.finfo(float).tiny)
    bars = {"error_bar_W": math.sqrt(m / d) * float(np.linalg.norm(Y_error)) / R / W_norm,
            "error_bar_b": float(np.linalg.norm(Y_error)) / math.sqrt(d)
            / max(safe_norm(b), R * W_norm),
            "error_bar_v": v_error / safe_norm(v)}
    recovery = oracle.queries - start_queries
    assert recovery == floor + rescaled
    verification = verify_on_sphere(oracle, model, count=n_verify, invariance=n_invariance,
                                     rng=rng, tolerance=verify_tolerance,
                                     error_bar=max(bars.values()))
    report = Report(
        kind=model.kind, dim=d, queries=oracle.queries - start_queries,
        breakdown={"recovery": floor, "rescaling": rescaled,
                   "verification": verification.sequences},
        floor=floor, verification=verification, seconds=time.perf_counter() - start,
        black_box_seconds=oracle.black_box_seconds - start_bb,
        details={"sphere": f"tokens with 1^T x = 0 and |x| = {R:.6g} (the model is "
                           f"defined there only)",
                 "chord |a - q| / R": f"{chords.min():.3g} .. {chords.max():.3g}",
                 "identified": "P W P, P b, P v, P r and c of the head on the sphere "
                               "(gamma, beta, eps and the raw weights are not identifiable)",
                 **bars})
    try:
        return checked_result(model, report, "a pre-LayerNorm attention head")
    except ModelMismatchError as exc:
        families = verification.family_errors
        on_sphere = max((e for f, e in families.items() if f != "invariance"), default=0.0)
        hints = []
        if on_sphere > verification.tolerance:
            hints.append("if the block has several heads, pass heads=H (--heads H)")
        if families.get("invariance", 0.0) > verification.tolerance:
            hints.append(f"off the sphere, rescaling the tokens or shifting them along "
                         f"(1, ..., 1) changed the answers: no LayerNorm in front of the "
                         f"attention, or an eps too large for tokens of norm {R:.3g} (try a "
                         f"larger --radius)")
        exc.args = ("; ".join([exc.args[0]] + hints),)
        raise


def _shorter(chord: float, peak: float) -> float:
    """The chord that brings a column's largest logit ``peak`` to about TARGET_LOGIT
    (logits grow about linearly with the chord); 1/8 of it for a saturated column."""
    return chord * (TARGET_LOGIT / peak if math.isfinite(peak) else 0.125)


def _solve_on_hyperplane(U: np.ndarray, t: np.ndarray, basis: np.ndarray):
    """y in 1^perp with U y = t (U (m, d), rows in 1^perp, independent; ``basis`` (d, m)
    orthonormal in 1^perp), and 1 / sigma_min(U): how much U magnifies an error of t."""
    restricted = U @ basis
    return (basis @ np.linalg.solve(restricted, t),
            1.0 / np.linalg.svd(restricted, compute_uv=False)[-1])


def _require_finite(t: np.ndarray, where: str, *answers) -> None:
    if not np.all(np.isfinite(t)):
        raise ModelMismatchError(
            f"the black box is not a pre-LayerNorm attention head: its pair probes of "
            f"{where} imply no attention weight in (0, 1) (or saturate at every chord); if the "
            f"block has several heads, pass heads=H (--heads H)")
