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

Verification (:func:`verify_on_sphere`): held-out sequences on S against the model, at
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
from ..models import SphereAttention, VectorSphereAttention
from ..oracle import QueryAccess, live_queries
from ..report import (
    DEFAULT_VERIFY_TOLERANCE,
    ExtractionResult,
    Report,
    Verification,
    checked_result,
    verification_count,
)
from ..verification import (
    CONSISTENCY_FLOOR,
    MAX_ERROR_BAR,
    length_grid,
    longest_length,
    max_length_of,
    root_oracle,
    safe_norm,
    safe_rms,
)
from .single_head import logit

log = logging.getLogger(__name__)

TARGET_LOGIT = 2.0       # a rescaled column aims its largest |t_k| at this
MAX_LOGIT = 4.0          # beyond it sigma' < 0.02: the column is probed again, shorter chord
MAX_RESCALES = 8
# held-out check off the sphere: rescaling tokens and shifting them along 1 must leave
# the attention unchanged up to LayerNorm's eps (relative change ~ eps d / R^2)
INVARIANCE_TOLERANCE = 1e-3
INVARIANCE_SHARE = 0.25
# the error bars here are first-order bounds, not estimates: honest held-out errors on the
# sphere were at most 0.035 of the bar (median 0.006; 60 runs, d = 8, 16, 32), so the
# tolerance is tightened to 10 x the bar (the other learners' estimates get 1000 x)
BOUND_FACTOR = 10.0
SMALL_HEIGHT = 1.0 / 8   # column 0's probes with |h_k| below this x the largest: re-probed
TILT = 0.5               # ... tilted this much towards v's tangential part
VALUE_ROUNDING = 64.0    # pair answers within this many ulps of c + q^T w: P v = 0
ROUNDING = 4.0           # error bars: ulps of rounding per answer
EPS = np.finfo(float).eps


def sphere_radius(d: int, radius) -> float:
    """The tokens' norm R on the sphere (sqrt(d), LayerNorm's image, unless given)."""
    R = math.sqrt(d) if radius is None else float(radius)
    if not (math.isfinite(R) and R > 0):
        raise InputError(f"radius must be positive and finite, got {radius!r}")
    return R


def hyperplane_basis(dim: int) -> np.ndarray:
    """An orthonormal basis (d, d - 1) of the hyperplane 1^T x = 0."""
    return np.linalg.qr(np.eye(dim)[:, :-1] - 1.0 / dim)[0]


def hyperplane_rotation(dim: int, rng: np.random.Generator) -> np.ndarray:
    """A random orthogonal (d, d) that fixes the all-ones direction (maps 1^T x = 0 to itself)."""
    basis = hyperplane_basis(dim)
    G, R = np.linalg.qr(rng.standard_normal((dim - 1, dim - 1)))
    G *= np.sign(np.diag(R))
    return basis @ G @ basis.T + 1.0 / dim


def simplex_columns(dim: int, radius: float, rng: np.random.Generator) -> np.ndarray:
    """The d vertices (d, d), one per column, of a randomly rotated regular simplex on
    S: q_j = radius * Rot (e_j - 1/d) / sqrt(1 - 1/d); q_i^T q_j = -radius^2 / (d - 1)."""
    vertices = (np.eye(dim) - 1.0 / dim) / math.sqrt(1.0 - 1.0 / dim)
    return radius * hyperplane_rotation(dim, rng) @ vertices


def tangent_simplex(Q: np.ndarray, j: int) -> np.ndarray:
    """A regular m-simplex (d, m) of unit vectors in the tangent space at q_j (orthogonal
    to q_j and to 1): the other vertices' components orthogonal to q_j, normalised."""
    unit = Q / np.linalg.norm(Q[:, j])
    m = Q.shape[1] - 1
    return (np.delete(unit, j, axis=1) + unit[:, [j]] / m) / math.sqrt(1.0 - 1.0 / m ** 2)


def column_probes(q: np.ndarray, tangents: np.ndarray, chord: float) -> np.ndarray:
    """Probe tokens a_k (k, d) of column q at chord |a_k - q| = chord |q|: q rotated
    towards the unit tangents e_k (d, k) by the angle 2 asin(chord / 2)."""
    theta = 2.0 * math.asin(min(chord / 2.0, 1.0))
    return math.cos(theta) * q[None] + np.linalg.norm(q) * math.sin(theta) * tangents.T


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
        from .pre_layer_norm_heads import extract_pre_layer_norm_heads
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


def sphere_tokens(count: int, dim: int, radius: float, rng: np.random.Generator) -> np.ndarray:
    """``count`` random tokens (count, d) with zero mean and norm ``radius``."""
    X = rng.standard_normal((count, dim))
    X -= X.mean(axis=1, keepdims=True)
    return radius * X / np.linalg.norm(X, axis=1, keepdims=True)


def held_out_on_sphere(count: int, dim: int, radius: float, rng: np.random.Generator,
                       longest: int) -> tuple[list, list]:
    """Held-out sequences on the sphere and their family: "ordinary" (lengths 1..16, the
    first a single token), "long" (lengths stratified in log over 2..L, L itself first)
    and "close" (tokens a small angle from the last one: their scores differ little, the
    softmax at its most sensitive)."""
    kinds = [("ordinary", "long", "close")[i % 3] for i in range(count)]
    n_long = kinds.count("long")
    grid = length_grid(longest)
    spots = math.log(2) + (math.log(max(longest, 2)) - math.log(2)) * (
        rng.permutation(n_long) + rng.uniform(size=n_long)) / max(n_long, 1)
    long_lengths = list(grid[np.abs(np.log(grid)[None, :] - spots[:, None]).argmin(axis=1)])
    if long_lengths:
        long_lengths[0] = longest
    sequences = []
    for i, kind in enumerate(kinds):
        n = (int(max(long_lengths.pop(), 2)) if kind == "long"
             else 1 if i == 0 else int(rng.integers(1, 17)))
        X = sphere_tokens(n, dim, radius, rng)
        if kind == "close":
            near = X[-1] + rng.uniform(0.01, 0.3) * X
            near -= near.mean(axis=1, keepdims=True)
            X = radius * near / np.linalg.norm(near, axis=1, keepdims=True)
        sequences.append(X)
    return sequences, kinds


def extreme_sequences(model: SphereAttention, rng: np.random.Generator) -> list:
    """Sequences where the model's output is at its extremes on the sphere: the single
    tokens +-R v_hat and +-R w_hat (w = v + r: f([x]) = c + x^T w), and 16 keys near
    +-R v_hat before a random query (the attention output y^T v + c at its ends). A box
    that differs only at large outputs (clipping) shows there if anywhere."""
    d, R = model.dim, model.radius
    v = model.v.sum(axis=0)
    out = []
    for u in (v, v + model.r):
        norm = safe_norm(u)
        if norm > 0:
            out += [R * u[None] / norm, -R * u[None] / norm]
    norm = safe_norm(v)
    if norm > 0:
        for sign in (1.0, -1.0):
            keys = sign * v / norm + 0.05 * sphere_tokens(16, d, 1.0, rng)
            keys -= keys.mean(axis=1, keepdims=True)
            keys = R * keys / np.linalg.norm(keys, axis=1, keepdims=True)
            out.append(np.concatenate([keys, sphere_tokens(1, d, R, rng)]))
    return out


def verify_on_sphere(oracle, model: SphereAttention | VectorSphereAttention, *, count: int, invariance: int,
                     rng: np.random.Generator, tolerance: float,
                     error_bar: float | None = None, extremes=None, residual=None,
                     answers=None) -> Verification:
    """The held-out check of a pre-LN model: ``count`` sequences on its sphere against the
    model, then ``invariance`` of them with every token rescaled (x 1/2 .. 2) and the
    keys shifted along 1 (a box with LayerNorm in front cannot see either, except the
    residual r^T x_N of the rescaled last token), against the box's own answers.

    Errors are relative to the RMS of f - c over the set; the invariance errors are
    scaled by tolerance / INVARIANCE_TOLERANCE (LayerNorm's eps moves them slightly).
    The model's own relative error bar e (``error_bar``) tightens the tolerance on the
    sphere to max(BOUND_FACTOR e, CONSISTENCY_FLOOR), as
    :func:`attnextract.verification.verify_model` does with its estimates: a model known
    to 1e-12 that misses the box by 1e-8 is not the box's model.

    The same check serves a model answering vectors: ``extremes(model, rng)`` builds its
    extreme sequences (default :func:`extreme_sequences`), ``residual(X)`` is the residual
    term of the last token (default r^T x_N), ``answers(observed)`` reads the box's
    answers (default as they come); a sequence's error is then its largest channel error.
    """
    extremes = extreme_sequences if extremes is None else extremes
    if residual is None:
        assert isinstance(model, SphereAttention)     # a vector model passes its own
        r = model.r

        def residual(X: np.ndarray) -> np.ndarray:
            return X[-1] @ r
    requested = tolerance
    if error_bar is not None and math.isfinite(error_bar) and 0 <= error_bar <= MAX_ERROR_BAR:
        tolerance = min(tolerance, max(BOUND_FACTOR * error_bar, CONSISTENCY_FLOOR))
    d, R = model.dim, model.radius
    root = root_oracle(oracle)
    longest = longest_length(getattr(root, "longest", None), max_length_of(oracle), d)
    extreme = extremes(model, rng)
    sequences, family = held_out_on_sphere(count - len(extreme), d, R, rng, longest)
    sequences, family = sequences + extreme, family + ["extreme"] * len(extreme)
    moved, last_scale = [], rng.uniform(0.5, 2.0, size=invariance)
    for X, lam in zip(sequences[:invariance], last_scale):
        scales = rng.uniform(0.5, 2.0, size=len(X))
        scales[-1] = lam
        shifts = rng.uniform(-1.0, 1.0, size=len(X)) * R / math.sqrt(d)
        shifts[-1] = 0.0                   # the residual would see a shift of x_N along 1
        moved.append(scales[:, None] * X + shifts[:, None])
    oracle.require(count + invariance, "held-out verification on the sphere")
    with live_queries(oracle):
        observed = oracle.query_ragged(sequences + moved)
    if answers is not None:
        observed = answers(observed)
    on_sphere, off_sphere = observed[:count], observed[count:]
    predicted = np.array([model(X) for X in sequences])
    # scale-safe: answers of 1e200 must not overflow into an infinite K (every error 0)
    K = max(safe_rms(on_sphere - model.c), np.finfo(float).tiny)

    def worst(difference):                 # per sequence: the largest channel's error
        difference = np.abs(difference)
        return difference.max(axis=1) if difference.ndim == 2 else difference

    errors = worst(predicted - on_sphere) / K
    grow = (last_scale - 1.0).reshape((-1,) + (1,) * (on_sphere.ndim - 1))
    expected = on_sphere[:invariance] + grow * np.array(
        [residual(X) for X in sequences[:invariance]])
    drift = worst(off_sphere - expected) / K * (tolerance / INVARIANCE_TOLERANCE)
    errors, family = np.concatenate([errors, drift]), family + ["invariance"] * invariance
    family_errors: dict = {}
    for f, e in zip(family, errors):
        family_errors[f] = max(family_errors.get(f, 0.0), float(e))
    lengths = [len(X) for X in sequences]
    norms = [np.linalg.norm(X, axis=1) for X in sequences + moved]
    return Verification(sequences=count + invariance, max_relative_error=float(errors.max()),
                        median_relative_error=float(np.median(errors)), tolerance=tolerance,
                        requested_tolerance=requested if tolerance < requested else 0.0,
                        error_bar=0.0 if error_bar is None else float(error_bar),
                        lengths=(min(lengths), max(lengths)),
                        worst_family=family[int(np.argmax(errors))], family_errors=family_errors,
                        norms=(float(min(n.min() for n in norms)), float(max(n.max() for n in norms))),
                        max_length=longest)
