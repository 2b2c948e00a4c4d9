"""One attention head from vector answers: W, b, O = W_o W_v and c in about 2d queries.

Model (docs/algorithms.md, "Vector outputs"; ALGORITHMS.md section 10). At the last
position a single head answers

    F(X) = O X^T alpha + c,   alpha = softmax(X (W x_N + b)),        F in R^m,

and at every position j the same with x_N replaced by x_j (causal: over i <= j only).

Identities. One token: F([x]) = O x + c, so c = F([0]) and O e_k = F([e_k]) - c
(d + 1 queries, one batch). Let r = rank(O), O = U_r S_r V_r^T, and send the tokens
x_i = q + t z_i (i = 1..r) then x_N = q, with V_r^T z_i = e_i. Then

    S_r^{-1} U_r^T (F - c) = V_r^T X^T alpha = V_r^T q + t (alpha_1, ..., alpha_r),
    alpha_N = 1 - sum_i alpha_i,   ln(alpha_i / alpha_N) = t z_i^T (W q + b),

the common score q^T (W q + b) cancelling in the ratio. So ONE query of r + 1 tokens
gives r linear functionals of the vector g(q) = W q + b. Full rank (r = d, m >= d):
z_i = e_i and one query gives the whole g(q). Rank r < d (m < d, or W_v rank
deficient): z_i = v_i + w_i with w_i in the kernel of O (invisible in the answer but
not in the scores), ceil(d / r) queries per point. Then q = 0 gives b and q = s e_k
gives s W e_k + b: d + 1 points, [W | b] exactly (Theorem: for a single head with O of
rank r, the 1 + d + (d + 1) ceil(d / r) queries above determine (W, b, O, c), and
every head agreeing with the box on them equals it; at r = d that is 2d + 2, against
d^2 + 2d + 1 for one number per sequence).

Every position, r = d: the tokens t e_1, ..., t e_d, 0 in one query give at position k
ln(alpha_i / alpha_0) = t (W t e_k + b)_i for every i, at the zero token t b_i: W and b
from ONE query (d + 2 in all). Causal: position k sees only its prefix, so the same
tokens are sent in both orders (forward: the functionals i < k, and b at the last
position; reversed: those with i > k and the zero token): d + 3 queries.

Conditioning by design. A logit is read from alpha_i / alpha_N, so every alpha must stay
far above the rounding: the probe scales are set so that the largest |logit| of each
probe is TARGET_LOGIT, from a pilot (the bias probe and the first column, kept as
measurements when they land in [LOW_LOGIT, HIGH_LOGIT]). A point's scale s (q = s e_k)
is balanced against the bias: s |W e_k| >= |b| where possible, and s^2 |W e_k| ~ 1,
since the box's own score rounding is eps |x_i| |W q + b| while the signal is
t s |W e_k|. Probes outside the band, or far from their column's balance, are asked
again at the designed scale (counted as "rescaling"). The readout solve uses the
orthonormal V_r and S_r^{-1}: its error is cond(O) times the answers' rounding.

Error bars. Every answer number is taken to be off by at most its precision (float64
rounding, the stated ``tolerance``, or a forward pass in ``output_dtype``) times the
answer's magnitude; that is propagated to first order through the readout (||O^+||, the
error of O from the single tokens), the ratio alpha_i / alpha_N, the functional solve
and the division by the point scale s. The bars are per part (W's columns, b, O, c) and
the largest is the model's bar given to held-out verification.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass

import numpy as np

from ..errors import InputError, ModelMismatchError, NotIdentifiableError
from ..models import VectorAttention
from ..oracle import Oracle
from ..precision import check_precision_options
from ..report import (DEFAULT_VERIFY_TOLERANCE, ExtractionResult, Report, checked_result,
                      verification_count, verify_model)
from ..verification import root_oracle, safe_norm
from .noisy import FORWARD_RHO

log = logging.getLogger(__name__)

EPS = float(np.finfo(float).eps)
TARGET_LOGIT = 1.0        # aim the largest |logit| of a probe here: alpha ratios <= e^2
LOW_LOGIT = 0.05          # a probe whose largest |logit| is below is probed again larger
HIGH_LOGIT = 6.0          # ... above, smaller (a probe is readable to ~30)
BALANCE = 8.0             # a column probed at s more than this x off its design: again
MAX_TRIES = 8             # re-probes of one point before the box is refused
MAX_GROWTH = 1e6          # largest growth of a scale in one step
SHRINK_UNREADABLE = 1e-3  # scale factor for a probe whose weights are unreadable
NOISE_FACTOR = 8.0        # logits within this x their bar are noise (a bias of 0)
RANK_GAP = 1e3            # singular values of O below this x their error bar are 0
SAFETY = 4.0              # rounding bars: this many units per operation
PILOT_SCALE = 1.0         # the pilots' token scales before anything is known
# a forward pass in a low precision: its relative level per number (design level of the
# scalar learners) plus the accumulation over the N tokens of a sequence (unit roundoff)
ACCUMULATION = {"float64": EPS / 2, "float32": 2.0 ** -24, "bfloat16": 2.0 ** -24,
                "float16": 2.0 ** -24}


@dataclass(frozen=True)
class AnswerPrecision:
    """What one answer number may be off by: ``relative`` x the answer's magnitude
    (per token of the sequence, ``per_token``) + ``absolute``; ``score`` the relative
    rounding of the box's scores (eps |x_i| |W q + b|)."""

    name: str
    relative: float
    absolute: float = 0.0
    per_token: float = 0.0
    score: float = SAFETY * EPS

    def level(self, magnitude: float, tokens: int) -> float:
        return (self.relative + tokens * self.per_token) * magnitude + self.absolute


def answer_precision(output_dtype=None, tolerance=None) -> AnswerPrecision:
    """The precision model for float64 answers, a forward pass in ``output_dtype``, or
    answers accurate to +-``tolerance`` per number."""
    if tolerance is not None:
        if not (isinstance(tolerance, (int, float, np.floating)) and math.isfinite(tolerance)
                and tolerance >= 0):
            raise InputError(f"tolerance must be a finite number >= 0, got {tolerance!r}")
        return AnswerPrecision(f"+-{float(tolerance):.3g}", SAFETY * EPS, float(tolerance),
                               SAFETY * EPS)
    if output_dtype in (None, "float64"):
        return AnswerPrecision("float64", SAFETY * EPS, 0.0, SAFETY * EPS)
    rho = FORWARD_RHO[output_dtype]
    return AnswerPrecision(output_dtype, rho, 0.0, SAFETY * ACCUMULATION[output_dtype], rho)


@dataclass
class Readout:
    """c, O and what reads V_r^T X^T alpha back from an answer.

    ``P`` (r, m) = S_r^{-1} U_r^T; ``V`` (d, r); ``Z`` (J, r, d) the token directions of
    the J queries per point (V_r^T z = e_i); ``Zinv`` (d, J r) the solve for g from
    the J r functionals; ``O_error`` the 2-norm bound of O's error; ``pinv_norm`` ||O^+||.
    """

    c: np.ndarray
    O: np.ndarray
    rank: int
    V: np.ndarray
    P: np.ndarray
    Z: np.ndarray
    Zinv: np.ndarray
    A_inv: np.ndarray
    O_error: float
    c_error: float
    pinv_norm: float
    precision: AnswerPrecision
    O_norm: float = 0.0

    @property
    def blocks(self) -> int:
        return self.Z.shape[0]


def simplex_edges(r: int) -> np.ndarray:
    """A (r, r): column i is z_i - z_0 for the vertices z_0..z_r of a regular simplex
    of unit circumradius centred at 0 in R^r.

    Why a simplex and not the corner q + t e_i: the weight of the query token, alpha_N =
    1 - sum_i alpha_i, collects the rounding of every other weight, so with the corner
    design every logit shares an error sqrt(r) times theirs; with the tokens at the
    vertices of a regular simplex every weight is read alike (the system [A; 1^T] has
    orthogonal rows of nearly equal norm)."""
    n = r + 1
    w = np.ones(n) / math.sqrt(n)
    w[-1] -= 1.0                      # Householder reflection taking 1/sqrt(n) to e_n
    H = np.eye(n) - 2.0 * np.outer(w, w) / (w @ w)
    vertices = (np.eye(n) - 1.0 / n) @ H[:, :r] * math.sqrt(n / r)   # (n, r), rows z_i
    return (vertices[1:] - vertices[0]).T


def make_readout(c, O, precision: AnswerPrecision, O_error: float, c_error: float,
                 rank=None) -> Readout:
    """SVD of O, its numerical rank (singular values above RANK_GAP x O's error bar, or
    ``rank`` when stated) and the token directions for the functionals of g."""
    m, d = O.shape
    Uo, sv, Vt = np.linalg.svd(O, full_matrices=True)
    if rank is None:
        r = int(np.sum(sv > max(RANK_GAP * O_error, 64 * EPS * sv[0])))
    else:
        r = int(rank)
    if r < 1 or not np.any(O):
        raise NotIdentifiableError("O = 0: no answer depends on the attention, so W and b "
                                   "cannot be identified")
    if r == d:                       # full column rank: no kernel to reach
        V = np.eye(d)
    else:
        V = Vt[:r].T
    K = Vt[r:].T                     # kernel of O: seen by the scores, not by the answers
    A = simplex_edges(r)             # (r, r): V^T of the r token offsets of one query
    J = 1 + math.ceil((d - r) / r)
    Z = np.repeat((V @ A).T[None], J, axis=0)
    for j in range(1, J):
        cols = K[:, (j - 1) * r: j * r]
        Z[j, :cols.shape[1]] += cols.T
    P = V.T @ Vt[:r].T @ (Uo[:, :r] / sv[:r]).T      # V^T O^+, shape (r, m)
    Zinv = np.linalg.pinv(Z.reshape(-1, d))
    return Readout(c=c, O=O, rank=r, V=V, P=P, Z=Z, Zinv=Zinv, A_inv=np.linalg.inv(A),
                   O_error=O_error,
                   c_error=c_error, pinv_norm=float(1.0 / sv[r - 1]), precision=precision,
                   O_norm=float(sv[0]))


def measure_single_tokens(oracle, precision: AnswerPrecision, last) -> tuple:
    """c = F([0]) and O e_k = F([e_k]) - c: d + 1 one-token queries, one batch.

    Returns (c (m,), O (m, d), error bound of O (2-norm), error bound of c (2-norm))."""
    d = oracle.dim
    X = np.concatenate([np.zeros((1, 1, d)), np.eye(d)[:, None, :]])
    F = last(oracle.query(X))
    c, O = F[0], (F[1:] - F[0]).T
    m = F.shape[1]
    level = precision.level(max(float(np.abs(F).max()), 1.0 * float(np.abs(F - F[0]).max())), 1)
    return c, O, 2.0 * level * math.sqrt(m * d), level * math.sqrt(m)


@dataclass
class Points:
    """Measurements of g(q) = W q + b at points q."""

    q: np.ndarray            # (n, d)
    t: np.ndarray            # (n,) token scale of each point's probes
    g: np.ndarray            # (n, d)
    peak: np.ndarray         # (n,) largest |logit|, inf where unreadable
    bound: np.ndarray        # (n,) 2-norm error bound of g


def measure_points(oracle, R: Readout, q: np.ndarray, t: np.ndarray, last) -> Points:
    """g(q_p) for each point q_p (n, d) at token scale t_p: J queries of r + 1 tokens
    per point (x_i = q + t z_i, then q), all in one batch."""
    n, d = q.shape
    J, r = R.Z.shape[0], R.rank
    X = np.empty((n, J, r + 1, d))
    X[:, :, :r, :] = q[:, None, None, :] + t[:, None, None, None] * R.Z[None]
    X[:, :, r, :] = q[:, None, :]
    F = last(oracle.query(X.reshape(n * J, r + 1, d))).reshape(n, J, -1)
    y = (F - R.c) @ R.P.T                                         # (n, J, r)
    alpha = ((y - (q @ R.V)[:, None, :]) @ R.A_inv.T) / t[:, None, None]
    alpha_N = 1.0 - alpha.sum(axis=2)
    readable = np.all(alpha > 0, axis=2) & (alpha_N > 0)
    with np.errstate(divide="ignore", invalid="ignore"):
        logits = np.log(np.where(alpha > 0, alpha, 1.0)) - np.log(
            np.where(alpha_N > 0, alpha_N, 1.0))[:, :, None]
    ok = readable.all(axis=1)
    peak = np.where(ok, np.abs(logits).max(axis=(1, 2)), np.inf)
    g = (logits.reshape(n, J * r) / t[:, None]) @ R.Zinv.T
    # error bound (first order): answers off by their precision, O by O_error
    p = R.precision
    mag_x = np.linalg.norm(q, axis=1) + t * float(np.linalg.norm(R.Z, axis=2).max())
    # an answer's rounding is relative to the sizes summed in it, not to its own size
    answer = np.maximum(np.abs(F).max(axis=(1, 2)), R.O_norm * mag_x + float(np.abs(R.c).max()))
    level = np.array([p.level(a, r + 1) for a in answer])
    XTa = np.linalg.norm(q, axis=1) + t * math.sqrt(r)           # |X^T alpha| bound
    m = F.shape[2]
    dy = R.pinv_norm * (math.sqrt(m) * (level + R.c_error / math.sqrt(m))
                        + R.O_error * XTa)
    a_min = np.where(ok, np.minimum(alpha.min(axis=(1, 2)), alpha_N.min(axis=1)), 1.0)
    dscore = p.score * math.sqrt(d) * mag_x * np.linalg.norm(
        np.where(np.isfinite(g), g, 0.0), axis=1)
    spread = float(np.linalg.norm(R.A_inv, 2)) + float(np.linalg.norm(R.A_inv.sum(axis=0)))
    dlogit = spread * dy / (t * a_min) + 2.0 * dscore
    bound = float(np.linalg.norm(R.Zinv, 2)) * math.sqrt(J * r) * dlogit / t
    return Points(q=q, t=t, g=np.where(ok[:, None], g, np.nan), peak=peak, bound=bound)


def _band(peak: np.ndarray) -> np.ndarray:
    return (peak >= LOW_LOGIT) & (peak <= HIGH_LOGIT)


def _rescaled(t: np.ndarray, peak: np.ndarray) -> np.ndarray:
    """The token scale that puts a probe's largest logit at TARGET_LOGIT when its logits
    are linear in t (fixed q); unreadable probes shrink by SHRINK_UNREADABLE."""
    finite = np.isfinite(peak) & (peak > 0)
    factor = np.where(finite, TARGET_LOGIT / np.where(finite, peak, 1.0), SHRINK_UNREADABLE)
    return t * np.clip(factor, 1.0 / MAX_GROWTH, MAX_GROWTH)


def column_design(w: np.ndarray, beta: float) -> tuple[np.ndarray, np.ndarray]:
    """(s, t) for columns with |W e_k|_inf = w (k,) beside a bias of |b|_inf = beta.

    s^2 w ~ TARGET (the score rounding eps (s + t) |g| against the signal t s w is then
    balanced), raised to beta / w where the bias is larger (W e_k = (g - b) / s must not
    drown in b); t puts the largest logit t |s W e_k + b| at TARGET."""
    w = np.maximum(w, np.finfo(float).tiny)
    s = np.maximum(np.sqrt(TARGET_LOGIT / w), beta / w)
    t = TARGET_LOGIT / (s * w + beta)
    return s, t


def _last_answer(oracle):
    if oracle.outputs == "all":
        return lambda F: np.asarray(F)[:, -1, :]
    return lambda F: np.asarray(F)


def _noise(points: Points) -> np.ndarray:
    """Whether a point's logits are rounding noise (g indistinguishable from 0)."""
    return np.isfinite(points.peak) & (points.peak <= NOISE_FACTOR * points.bound * points.t)


def measure_columns(oracle, R: Readout, b: np.ndarray, b_bound: float, beta_known: bool,
                    last, counts: dict) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """W e_k from g(s_k e_k) = s_k W e_k + b for every k: a pilot (column 0 at the
    pilot scale), then every other column at the scales designed from it (column 0
    again unless the pilot was in band and balanced), then columns out of band or off
    their balance asked again. Returns W (d, d), s (d,), the 2-norm error bound of
    each column (d,); ``counts`` gets "columns" (d J) and the rest as "rescaling"."""
    d = oracle.dim
    beta = float(np.abs(b).max()) if beta_known else 0.0
    eye = np.eye(d)
    s, t = np.full(d, PILOT_SCALE), np.full(d, PILOT_SCALE)
    if beta > 0:                   # the bias alone would put the logits at TARGET / 2
        t[:] = 0.5 * TARGET_LOGIT / beta
    g = np.full((d, d), np.nan)
    peak, bound = np.full(d, np.inf), np.full(d, np.inf)
    asked = 0

    def ask(cols):
        nonlocal asked
        pts = measure_points(oracle, R, s[cols, None] * eye[cols], t[cols], last)
        g[cols], peak[cols], bound[cols] = pts.g, pts.peak, pts.bound
        asked += len(cols) * R.blocks

    def column_noise():
        # |s W e_k| within its bar: W e_k = 0 as far as these probes tell
        size = np.linalg.norm(np.where(np.isfinite(g), g - b, np.inf), axis=1)
        return np.isfinite(peak) & (size <= NOISE_FACTOR * (bound + b_bound))

    first = np.array([0])
    ask(first)
    # the pilot sets the design of the others: grow or shrink it until readable
    for _ in range(MAX_TRIES):
        if np.isfinite(peak[0]) and (peak[0] >= LOW_LOGIT or column_noise()[0]):
            break
        if np.isfinite(peak[0]):
            factor = _rescaled(t[:1], peak[:1])[0] / t[0]
            s[0], t[0] = s[0] * math.sqrt(factor), t[0] * math.sqrt(factor)
        else:
            s[0], t[0] = s[0] * SHRINK_UNREADABLE, t[0] * SHRINK_UNREADABLE
        ask(first)
    readable0 = bool(np.isfinite(peak[0]))
    w0 = float(np.abs((g[0] - b) / s[0]).max()) if readable0 and not column_noise()[0] else 0.0
    s_design, t_design = column_design(np.full(d, w0 if w0 > 0 else 1.0 / beta
                                               if beta > 0 else 1.0), beta)
    keep0 = readable0 and bool(_band(peak[:1])[0]) and bool(_balanced(s[0], s_design[0]))
    todo = np.arange(1 if keep0 else 0, d)
    s[todo], t[todo] = s_design[todo], t_design[todo]
    if todo.size:
        ask(todo)
    for _ in range(MAX_TRIES):
        readable = np.isfinite(peak)
        zero = column_noise()
        w = np.where(readable & ~zero, np.abs((g - b) / s[:, None]).max(axis=1), np.nan)
        sd, td = column_design(w, beta)
        fix = readable & ~zero
        redo = ~readable | (fix & (~_band(peak) | ~_balanced(s, sd)))
        cols = np.flatnonzero(redo)
        if not cols.size:
            break
        s[cols] = np.where(fix[cols], sd[cols], s[cols] * np.where(readable[cols], 1.0,
                                                                    SHRINK_UNREADABLE))
        t[cols] = np.where(fix[cols], td[cols], t[cols] * np.where(readable[cols], 1.0,
                                                                    SHRINK_UNREADABLE))
        ask(cols)
    bad = int(np.sum(~np.isfinite(peak)))
    if bad:
        raise ModelMismatchError(
            f"the black box is not a single attention head: after {MAX_TRIES} "
            f"rescalings, probes of {bad} column(s) still imply attention weights "
            f"outside (0, 1)")
    counts["columns"] += d * R.blocks
    counts["rescaling"] += asked - d * R.blocks
    W = ((g - b) / s[:, None]).T
    return W, s, (bound + b_bound) / s


def _balanced(s, s_design) -> np.ndarray:
    ratio = np.asarray(s) / np.asarray(s_design)
    with np.errstate(invalid="ignore"):
        return ~((ratio > BALANCE) | (ratio < 1.0 / BALANCE))


def measure_bias(oracle, R: Readout, last, counts: dict) -> Points:
    """g(0) = b: J queries of the tokens t z_i and 0; t from the pilot scale, then
    rescaled exactly (the logits t z_i^T b are linear in t) until in band or noise."""
    d = oracle.dim
    t = np.array([PILOT_SCALE])
    pts = measure_points(oracle, R, np.zeros((1, d)), t, last)
    counts["bias"] = R.blocks
    for _ in range(MAX_TRIES):
        if _band(pts.peak)[0] or _noise(pts)[0]:
            return pts
        t = _rescaled(t, pts.peak)
        pts = measure_points(oracle, R, np.zeros((1, d)), t, last)
        counts["rescaling"] += R.blocks
    if not np.isfinite(pts.peak[0]):
        raise ModelMismatchError(
            f"the black box is not a single attention head: after {MAX_TRIES} rescalings "
            f"the bias probe still implies attention weights outside (0, 1)")
    return pts


# -- every position ------------------------------------------------------------------

def every_position_probe(oracle, R: Readout, t: float, causal: bool):
    """g at t e_1, ..., t e_d (W t e_k + b, rows 0..d-1) and at 0 (b, row d) from the
    tokens t e_1, ..., t e_d, 0: one query (bidirectional) or two (causal, both
    orders). Returns (G (d + 1, d), largest |logit|, 2-norm error bound per row)."""
    d = oracle.dim
    tokens = np.vstack([t * np.eye(d), np.zeros((1, d))])          # (d + 1, d)
    if causal:
        X = np.stack([tokens, tokens[::-1]])
    else:
        X = tokens[None]
    F = np.asarray(oracle.query(X))                                 # (B, d + 1, m)
    Y = (F - R.c) @ R.P.T                                           # (B, d + 1, d)
    p = R.precision
    m = F.shape[2]
    level = p.level(max(float(np.abs(F).max()), R.O_norm * t + float(np.abs(R.c).max())), d + 1)
    dy = R.pinv_norm * (math.sqrt(m) * level + R.c_error + R.O_error * t * math.sqrt(d))
    G = np.full((d + 1, d), np.nan)
    worst = 0.0
    a_min = 1.0
    with np.errstate(divide="ignore", invalid="ignore"):
        if not causal:
            alpha = Y[0] / t                                        # (positions, d)
            alpha0 = 1.0 - alpha.sum(axis=1)
            ok = np.all(alpha > 0, axis=1) & (alpha0 > 0)
            L = np.log(alpha) - np.log(alpha0)[:, None]
            G = np.where(ok[:, None], L / t, np.nan)
            worst = float(np.abs(L).max()) if ok.all() else np.inf
            a_min = float(min(alpha.min(), alpha0.min())) if ok.all() else 0.0
        else:
            fwd = Y[0] / t               # position k (0-based) sees tokens 0..k
            rev = Y[1] / t               # position j holds token d - j (0: the zero token)
            ok = True
            # b from the forward pass's last position (every token seen)
            a_last, a0 = fwd[d], 1.0 - fwd[d].sum()
            ok &= bool(np.all(a_last > 0) and a0 > 0)
            G[d] = (np.log(a_last) - np.log(a0)) / t
            logs = [np.abs(np.log(a_last) - np.log(a0)).max()] if ok else []
            mins = [a_last.min(), a0] if ok else []
            for k in range(d):
                af = fwd[k, :k + 1]                                  # tokens 0..k
                pos = d - k                                          # token k's position
                ar = rev[pos, k:]                                    # tokens k..d-1
                ar0 = 1.0 - ar.sum()
                if not (np.all(af > 0) and np.all(ar > 0) and ar0 > 0):
                    ok = False
                    continue
                gkk = -(np.log(ar0) - np.log(ar[0])) / t
                row = np.empty(d)
                row[k] = gkk
                row[:k] = (np.log(af[:k]) - np.log(af[k])) / t + gkk
                row[k + 1:] = (np.log(ar[1:]) - np.log(ar[0])) / t + gkk
                G[k] = row
                logs.append(max(np.abs(t * row).max(), abs(t * gkk)))
                mins += [af.min(), ar.min(), ar0]
            worst = float(max(logs)) if ok else np.inf
            a_min = float(min(mins)) if ok else 0.0
    g_norm = float(np.linalg.norm(np.where(np.isfinite(G), G, 0.0), axis=1).max())
    dscore = p.score * math.sqrt(d) * 2.0 * t * g_norm
    factor = 3.0 if causal else 2.0          # causal rows chain two logits
    dlogit = factor * math.sqrt(d) * dy / (t * max(a_min, np.finfo(float).tiny)) + 2 * dscore
    bound = np.full(d + 1, math.sqrt(d) * dlogit / t)
    return G, worst, bound


def every_position_scale(W: np.ndarray, b: np.ndarray) -> float:
    """t with max_k,i |t (t W_ik + b_i)| = TARGET_LOGIT (bisection in log t)."""
    def peak(t):
        return float(np.abs(t * (t * W + b[:, None])).max())
    if not (np.any(W) or np.any(b)):
        return PILOT_SCALE * MAX_GROWTH
    lo, hi = 1e-300, 1e300
    for _ in range(200):
        mid = math.sqrt(lo * hi)
        if peak(mid) > TARGET_LOGIT:
            hi = mid
        else:
            lo = mid
        if hi / lo < 1 + 1e-6:
            break
    return lo


def measure_every_position(oracle, R: Readout, causal: bool, counts: dict):
    """W, b from the every-position probes: a pilot at PILOT_SCALE, kept when its
    largest logit is in band, else asked again at the scale designed from it."""
    d = oracle.dim
    per = 2 if causal else 1
    t = PILOT_SCALE
    G, worst, bound = every_position_probe(oracle, R, t, causal)
    counts["every-position probes"] = per
    for _ in range(MAX_TRIES):
        if LOW_LOGIT <= worst <= HIGH_LOGIT:
            break
        if np.isfinite(worst):
            b = G[d]
            W = (G[:d] - b).T / t
            if worst <= NOISE_FACTOR * bound.max() * t and worst < LOW_LOGIT:
                new = t * MAX_GROWTH ** 0.5            # W, b at the noise: look larger
            else:
                new = every_position_scale(W, b)
                new = min(max(new, t / MAX_GROWTH), t * MAX_GROWTH)
        else:
            new = t * SHRINK_UNREADABLE
        t = new
        G, worst, bound = every_position_probe(oracle, R, t, causal)
        counts["rescaling"] += per
    if not np.isfinite(worst):
        raise ModelMismatchError(
            f"the black box is not a single attention head: after {MAX_TRIES} rescalings "
            f"the every-position probes still imply attention weights outside (0, 1)")
    return G, t, bound


# -- the learner ----------------------------------------------------------------------

def extract_vector_single_head(oracle: Oracle, *, seed=None,
                               verify_tolerance: float = DEFAULT_VERIFY_TOLERANCE,
                               biases: bool | None = None, rank: int | None = None,
                               output_dtype: str | None = None,
                               tolerance: float | None = None) -> ExtractionResult:
    """Recover (W, b, O, c) of one attention head whose box answers vectors.

    Parameters
    ----------
    oracle : Oracle
        Door to the black box; ``oracle.outputs`` is "last" (answers (B, m)) or "all"
        (answers (B, N, m), ``oracle.causal`` stated or found at the first probe).
    seed : int, optional
        Seed of the held-out verification.
    verify_tolerance : float
        Largest held-out relative output error accepted (tightened to the model's error
        bar, see :func:`attnextract.verification.verify_model`).
    biases : bool, optional
        None: detect them (c = F([0]) != 0, b != 0 beyond its error bar; a box without
        them gets b = 0 and c = 0 exactly). False: b = c = 0 (a box with c != 0 is
        refused). True: measure b and c whatever they are.
    rank : int, optional
        rank(O) when known (default: the numerical rank of the measured O).
    output_dtype : {"float64", "float32", "bfloat16", "float16"}, optional
        The box runs its forward pass in this dtype: error bars from its precision.
    tolerance : float, optional
        Every answer number is accurate to +-tolerance.

    Returns
    -------
    ExtractionResult
        ``model`` a :class:`VectorAttention` with one head: W (1, d, d), O (1, m, d),
        b (1, d), c (m,), positions and causal as the box answers.

    Raises
    ------
    NotIdentifiableError
        O = 0 (no answer depends on the attention).
    ModelMismatchError
        The box is not one attention head (unreadable weights, c != 0 with
        ``biases=False``, or held-out verification failed); ``.result`` holds the
        best-effort extraction.
    """
    check_precision_options(output_dtype, None)
    if output_dtype is not None and tolerance is not None:
        raise InputError("give output_dtype= or tolerance=, not both")
    if biases not in (None, True, False):
        raise InputError(f"biases must be True, False or None, got {biases!r}")
    root = root_oracle(oracle)
    if getattr(root, "outputs", None) not in ("last", "all"):
        raise InputError("vector-single-head reads vector answers: the oracle must answer "
                         "(B, m) or (B, N, m) (Oracle(..., outputs='last' or 'all'))")
    precision = answer_precision(output_dtype, tolerance)
    start, start_queries = time.perf_counter(), oracle.queries
    start_bb, start_numbers, start_tokens = oracle.black_box_seconds, oracle.numbers, oracle.tokens
    d = oracle.dim
    every = oracle.outputs == "all"
    last = _last_answer(oracle)
    counts = {"constant and O": d + 1, "rescaling": 0, "columns": 0}

    c, O, O_error, c_error = measure_single_tokens(oracle, precision, last)
    m = O.shape[0]
    c_noise = not np.any(c) if tolerance is None else bool(np.abs(c).max() <= 3 * tolerance)
    if biases is False and not c_noise:
        raise ModelMismatchError(
            f"the black box answers F([0]) = c with |c| = {safe_norm(c):.3g} where a head "
            f"without biases answers 0: it has value or output biases; extract with "
            f"biases=None (detect) or biases=True")
    R = make_readout(c, O, precision, O_error, c_error, rank)
    notes = []
    causal = bool(root.causal) if every and root.causal is not None else None
    if every and causal is None:
        causal = _detect_causal(oracle, R, counts)
        notes.append(f"causal mask {'found' if causal else 'absent'}: position 1's answer "
                     f"{'equals' if causal else 'differs from'} its token's own (state "
                     f"causal= to skip this query)")
    if every and R.rank == d:
        G, t, bound = measure_every_position(oracle, R, causal, counts)
        b_raw, b_bound = G[d], float(bound[d])
        peak_b = float(np.abs(t * b_raw).max())
        b_zero = biases is False or (biases is None and peak_b <= NOISE_FACTOR * b_bound * t)
        b = np.zeros(d) if b_zero else b_raw
        W = (G[:d] - b).T / t
        col_bounds = (bound[:d] + (0.0 if b_zero else b_bound)) / t
        design = (f"tokens t e_1 .. t e_d, 0 at t = {t:.3g} "
                  f"({'both orders (causal)' if causal else 'one query'})")
    else:
        if every:
            notes.append(f"rank(O) = {R.rank} < d = {d}: every-position answers read at the "
                         f"last position only")
        if biases is False:
            b, b_bound, b_zero = np.zeros(d), 0.0, True
        else:
            pts = measure_bias(oracle, R, last, counts)
            b_zero = biases is None and bool(_noise(pts)[0])
            b = np.zeros(d) if b_zero else pts.g[0]
            b_bound = 0.0 if b_zero else float(pts.bound[0])
        W, s, col_bounds = measure_columns(oracle, R, b, b_bound, not b_zero, last, counts)
        design = (f"points q = s_k e_k at s {s.min():.3g} .. {s.max():.3g}, "
                  f"{R.blocks} quer{'y' if R.blocks == 1 else 'ies'} of {R.rank + 1} tokens "
                  f"per point")
    if biases is None and c_noise and b_zero:
        c = np.zeros(m)
    elif biases is False:
        c = np.zeros(m)
    biased = not (b_zero and not np.any(c))
    model = VectorAttention(W[None], R.O[None], b[None], c, positions=oracle.outputs,
                            causal=bool(causal) if every else False)

    # error bars (relative, per part) and the model's bar for verification
    W_norm = float(np.linalg.norm(W))
    col_rel = col_bounds / np.maximum(np.linalg.norm(W, axis=0), np.finfo(float).tiny)
    bars = {"W": float(np.linalg.norm(col_bounds)) / max(W_norm, np.finfo(float).tiny),
            "O": R.O_error / max(float(np.linalg.norm(R.O, 2)), np.finfo(float).tiny),
            "b": 0.0 if b_zero else b_bound / max(float(np.linalg.norm(b)), W_norm * 1e-300,
                                                  np.finfo(float).tiny),
            "c": 0.0 if not np.any(c) else R.c_error / float(np.linalg.norm(c))}
    bar = max(bars["W"], bars["O"], min(bars["b"], 1.0), min(bars["c"], 1.0))
    rank_params = R.rank * (m + d - R.rank)
    parameters = d * d + rank_params + ((d + m) if biased else 0)
    per_query = m * (d + 1) if every else m
    floor = math.ceil(parameters / per_query)
    recovery = oracle.queries - start_queries
    n_verify = verification_count(parameters, recovery)
    verification = verify_model(oracle, model, count=n_verify, seed=seed,
                                tolerance=verify_tolerance, expected_error=bar)
    breakdown = {k: v for k, v in counts.items() if v}
    breakdown["verification"] = verification.sequences
    assert sum(v for k, v in counts.items()) == recovery, (counts, recovery)
    report = Report(
        kind=model.kind, dim=d, queries=oracle.queries - start_queries, breakdown=breakdown,
        floor=floor, verification=verification, seconds=time.perf_counter() - start,
        black_box_seconds=oracle.black_box_seconds - start_bb, notes=notes,
        recovery=recovery,
        details={"outputs": f"{'every position' + (' (causal)' if causal else '') if every else 'last position'}, m = {m}",
                 "rank of O": R.rank, "condition of O": float(np.linalg.norm(R.O, 2)
                                                             * R.pinv_norm),
                 "design": design, "precision": precision.name,
                 "numbers received": int(oracle.numbers - start_numbers),
                 "tokens sent": int(oracle.tokens - start_tokens),
                 "parameters": parameters,
                 "floor": f"ceil({parameters} parameters / {per_query} numbers per query)",
                 "biases": ("detected" if biased else "none detected (b = 0, c = 0 exactly)")
                 if biases is None else ("measured" if biases else "none (stated)"),
                 "error_bar_W": bars["W"], "error_bar_W_columns": float(col_rel.max()),
                 "error_bar_b": bars["b"], "error_bar_O": bars["O"], "error_bar_c": bars["c"],
                 "error_bar": bar})
    return checked_result(model, report, "a single attention head with vector answers")


def _detect_causal(oracle, R: Readout, counts: dict) -> bool:
    """One query [a; b] (two unit tokens): a causal box answers O a + c at position 1
    (it attends to a alone), a bidirectional one mixes in b (their scores differ unless
    W and b vanish on them; then either answer is the model's)."""
    d = oracle.dim
    rng = np.random.default_rng(0x0CA5)
    X = rng.standard_normal((1, 2, d))
    X /= np.linalg.norm(X, axis=2, keepdims=True)
    F = np.asarray(oracle.query(X))[0]
    counts["causal test"] = 1
    alone = R.O @ X[0, 0] + R.c
    level = R.precision.level(float(np.abs(F).max()), 2) * 1e3 + R.O_error
    return bool(np.abs(F[0] - alone).max() <= level)
