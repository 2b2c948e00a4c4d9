"""One attention head from vector answers: W, b, O = W_o W_v and c in about 2d queries.

Model (docs/vector-outputs.md and docs/learners/vector-single-head.md). At the last
position a single head answers

    F(X) = O X^T alpha + c,   alpha = softmax(X (W x_N + b)),        F in R^m,

and at every position j the same with x_N replaced by x_j (causal: over i <= j only).

Identities. One token: F([x]) = O x + c, so c = F([0]) and O e_k = F([e_k]) - c
(d + 1 queries, one batch). Let r = rank(O), O = U_r S_r V_r^T, and send the tokens
x_i = q + t z_i (i = 1..r) then x_N = q, with V_r^T z_i = a_i, the edges z_i - z_0 of a
regular simplex (columns of A, :func:`simplex_edges`). Then

    S_r^{-1} U_r^T (F - c) = V_r^T X^T alpha = V_r^T q + t A (alpha_1, ..., alpha_r),
    alpha_N = 1 - sum_i alpha_i,   ln(alpha_i / alpha_N) = t z_i^T (W q + b),

the common score q^T (W q + b) cancelling in the ratio. So ONE query of r + 1 tokens
gives r linear functionals of the vector g(q) = W q + b. Full rank (r = d, m >= d): one
query gives the whole g(q) (the same with extra tokens q +- t v_j, whose logits
+-t v_j^T g(q) are functions of the same g: see Conditioning). Rank r < d (m < d, or
W_v rank deficient): z_i = V_r a_i + w_i with w_i in the kernel of O (invisible in the
answer, not in the scores),
ceil(d / r) queries per point. Then q = 0 gives b and q = s_k e_k gives s_k W e_k + b:
d + 1 points, [W | b] exactly.

Theorem (identifiability and count). For one head with O of rank r the
1 + d + (d + 1) ceil(d / r) queries above determine (W, b, O, c) (b, c: the canonical
query bias and output constant; W, b never identifiable beyond this since the key bias
cancels); at r = d that is 2d + 2, against d^2 + 2d + 1 for one number per sequence,
and the floor is ceil((d^2 + d + r(m + d - r) + m) / m) queries (2d + 2 at m = d).

Every position, r = d: the tokens t z_0, ..., t z_d at the vertices of a regular simplex
(sum z_k = 0, Z^T Z = (d + 1)/d I) in one query give at position k the log-weights
ln alpha_i = t z_i^T g(t z_k) + const, so g(t z_k) = d / ((d + 1) t) Z^T ln alpha with
no reference token; b is the mean of the g's and W = d / ((d + 1) t) G^T Z: W and b
from ONE query (d + 2 in all). Causal: position k sees only its prefix, so the same
tokens are sent in both orders (token k sees 0..k in one, k..d in the other; the two
share token k, which aligns their constants): d + 3 queries. When O has weak directions
(the pairs below, sigma_j < sigma_1 / PAIR_CONDITION) the probe is asked once more with
the pairs +-t rho_j v_j first in the sequence (a rescaled probe carries them at once):
d + 3 queries (causal d + 5). Then g_k minimises the convex sum over the position's
token sets of ln sum e^(x_i^T g) - g^T y (y its answer read back, projected on the set's
affine hull; :func:`_softmax_mean_solve`). Measured (square Gaussian O, cond(O) up to
9.8e3, 20 seeds per d), worst at d = 8, 16, 32, 64: bidirectional 2.3e-14, 4.1e-14,
3.6e-14, 2.3e-13 (without the pairs 1.4e-13, 1.9e-13, 4.4e-13, 6.8e-12); causal 2.1e-14,
2.8e-14, 3.9e-14, 1.7e-13 (2.2e-13, 1.4e-13, 3.9e-13, 4.5e-12).

Conditioning by design. A logit is read from alpha_i / alpha_N, so every alpha must stay
far above the rounding: the probe scales are set so that the largest |logit| of each
probe is TARGET_LOGIT, from pilots (the bias probe and the first column, kept as
measurements when they land in [LOW_LOGIT, HIGH_LOGIT]). A point's scale s (q = s e_k)
is balanced against the bias: s |W e_k| >= |b| where possible, and s^2 |W e_k| ~ 1,
since the box's own score rounding is eps |x_i| |W q + b| while the signal is
t s |W e_k|. Probes outside the band, or far from their column's balance, are asked
again at the designed scale (counted as "rescaling"). The readout solve uses the
orthonormal V_r and S_r^{-1}; at full column rank it is corrected once with the residual
F - c - O y to twice the working precision (:meth:`Readout.read`), so that it adds
nothing to what the answers' own rounding costs: eps (|c| + s |O e_k|) per number, read
through S^{-1}, so 1 / sigma_j along v_j. Against that, the probes at full rank carry
pairs of extra tokens q +- t v_j on the directions with sigma_j < sigma_1 /
PAIR_CONDITION (:func:`pair_counts`, at most d extra tokens): they add weight along v_j,
not size, so the weights' mean moves more with g there while no logit grows (their
offsets are scaled by rho to keep their logits below PAIR_LOGIT and the simplex's,
:func:`_pair_fit`); the weights are then read by Newton on a concave dual
(:func:`_pair_solve`). Measured (square Gaussian O, 50 seeds per d, 2d + 2 queries),
worst at d = 8, 16, 32, 64: 1.4e-13, 2.0e-13, 2.4e-13, 6.5e-13 (cond(O) up to 9.8e3);
with the corrected readout
and no pairs 5.5e-13, 1.2e-12, 1.7e-12, 2.0e-11; with a float64 product with O^+
1.9e-12, 2.5e-12, 5.1e-12, 4.9e-11. Whitening the simplex instead (V^T z_i = S^-p a_i)
measured worse (docs/maintainers/algorithms.md): it makes tokens larger along v_j,
and their logits with them. ``max_condition`` (default for low precision) reads the
ill-conditioned directions through kernel-like offsets instead, at more queries.

Error bars. Every answer number is taken to be off by its precision (float64 rounding,
the stated ``tolerance``, or a forward pass in ``output_dtype``, whose level is then
measured from dithered repeats) times the magnitudes summed in it; that is propagated
to first order through the readout (||O^+||, the error of O from the single tokens), the
log-weights' Jacobian, the functional solve and the division by the point scale s, and
multiplied by BAR_FACTOR. The bars are per part (W's columns, b, O, c); the largest is
the model's bar given to held-out verification.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field, replace

import numpy as np

from ..errors import (
    InputError,
    ModelMismatchError,
    NotIdentifiableError,
    RecoveryFailedError,
)
from ..models import VectorAttention
from ..numerics import residual
from ..oracle import Oracle
from ..precision import check_precision_options
from ..report import (
    DEFAULT_VERIFY_TOLERANCE,
    ExtractionResult,
    Report,
    checked_result,
    verification_count,
    verify_model,
)
from ..verification import root_oracle, safe_norm
from .noisy import FORWARD_RHO

log = logging.getLogger(__name__)

EPS = float(np.finfo(float).eps)
TARGET_LOGIT = 2.0        # aim the largest |logit| of a probe here: alpha ratios <= e^4
LOW_LOGIT = 0.05          # a probe whose largest |logit| is below is probed again larger
HIGH_LOGIT = 6.0          # ... above, smaller: alpha ratios of e^12 cost their precision
# every position: the one probe that carries W and b is asked again unless this close
EVERY_BAND = (0.25 * TARGET_LOGIT, HIGH_LOGIT)
BALANCE = 8.0             # a column probed at s more than this x off its design: again
MAX_TRIES = 8             # re-probes of one point before the box is refused
MAX_GROWTH = 1e6          # largest growth of a scale in one step
SHRINK_UNREADABLE = 1e-3  # scale factor for a probe whose weights are unreadable
NOISE_FACTOR = 8.0        # logits within this x their bar are noise (a bias of 0)
RANK_GAP = 30.0           # singular values of O below this x their error level are 0
SAFETY = 4.0              # rounding levels: this many units per operation
BAR_FACTOR = 10.0         # error bars: this x the first-order error estimate
MAX_BAR = 0.1             # a head known to worse than this is not returned (verification's limit)
CONDITION_NOTE = 1e3      # a readout this ill-conditioned is said in the report
LOW_PRECISION_CONDITION = 30.0   # low precision: the readout's largest condition number
LOW_PRECISION_VERIFY = 30.0   # held-out tolerance: this x a low precision's level
PILOT_SCALE = 1.0         # the pilots' token scales before anything is known
# full rank: right singular directions of O below sigma_1 / PAIR_CONDITION get pairs of
# extra tokens q +- t v (at most d extra tokens, PAIR_DIRECTIONS directions)
PAIR_CONDITION = 100.0
PAIR_DIRECTIONS = 8
PAIR_ITERATIONS = 60      # Newton steps of the pair readout (5 to 8 on benchmark boxes)
PAIR_FIT = 0.5            # the pilot column's pairs brought below this x: no pairs for the rest
PAIR_LOGIT = 1.0          # the pairs' logits are kept below this and the simplex's largest
# a forward pass in a low precision: its relative level per number (design level of the
# scalar learners) plus the accumulation over the N tokens of a sequence (unit roundoff)
ROUNDOFF = {"float32": 2.0 ** -24, "bfloat16": 2.0 ** -9, "float16": 2.0 ** -11}
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

    unit: float = EPS / 2     # the unit roundoff of the answers (rank decisions)

    def level(self, magnitude: float, tokens: int) -> float:
        return (self.relative + tokens * self.per_token) * magnitude + self.absolute


def answer_precision(output_dtype=None, tolerance=None) -> AnswerPrecision:
    """The precision model for float64 answers, a forward pass in ``output_dtype``, or
    answers accurate to +-``tolerance`` per number."""
    if tolerance is not None:
        if not (isinstance(tolerance, (int, float, np.floating)) and math.isfinite(tolerance)
                and tolerance >= 0):
            raise InputError(f"tolerance must be a finite number >= 0, got {tolerance!r}")
        return AnswerPrecision(f"+-{float(tolerance):.3g}", relative=SAFETY * EPS,
                               absolute=float(tolerance), unit=float(tolerance))
    if output_dtype in (None, "float64"):
        return AnswerPrecision("float64", relative=SAFETY * EPS)
    rho = FORWARD_RHO[output_dtype]
    return AnswerPrecision(output_dtype, relative=rho, per_token=SAFETY * ACCUMULATION[output_dtype],
                           score=rho, unit=ROUNDOFF[output_dtype])


@dataclass
class Readout:
    """c, O and what reads V_r^T X^T alpha back from an answer.

    ``P`` (r, m) = S_r^{-1} U_r^T; ``V`` (d, r); ``Z`` (J, r, d) the token directions of
    the J queries per point (V_r^T z = e_i); ``Zinv`` (d, J r) the solve for g from
    the J r functionals; ``O_error`` and ``c_error`` the error levels of their entries
    (per number); ``pinv_norm`` ||O^+||.
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
    P_norm: float = 0.0       # ||P||_F: the readout's gain on independent answer errors
    calibration: float = 1.0  # measured error / estimated error (low precision: dithered repeats)
    # pairs of extra tokens q +- t v_j (full rank only): directions (p, d), counts (p,)
    pair_dirs: np.ndarray = field(default_factory=lambda: np.empty((0, 0)))
    pair_counts: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=int))

    @property
    def blocks(self) -> int:
        return self.Z.shape[0]

    @property
    def pairs(self) -> int:
        """The number of extra tokens q + t v_j (as many q - t v_j) per probe."""
        return int(self.pair_counts.sum())

    def offsets(self) -> np.ndarray:
        """(J, r + 2 pairs, d): every probe token's offset from q, in units of t."""
        if not self.pairs:
            return self.Z
        extra = np.concatenate([np.repeat(sign * self.pair_dirs, self.pair_counts, axis=0)
                                for sign in (1.0, -1.0)])
        return np.concatenate([self.Z, np.broadcast_to(
            extra, (self.Z.shape[0],) + extra.shape)], axis=1)

    def read(self, F: np.ndarray) -> np.ndarray:
        """V_r^T O^+ (F - c) for answers F (..., m): shape (..., r).

        Full column rank: corrected once with the residual F - c - O y to twice the
        working precision (:func:`attnextract.numerics.residual`). The answers carry
        O q + c, far larger than the part that moved with the weights, and a float64
        product with O^+ (or a float64 residual) rounds at eps |F| x ||O^+||: cond(O)
        times the answers' relative rounding, several times what the answers' own
        rounding costs through O^+ (d = 64, cond(O) = 1e4: 5e-11 against 2e-11)."""
        F = np.asarray(F, dtype=float)
        y = (F - self.c) @ self.P.T
        if self.rank == self.O.shape[1] and np.all(np.isfinite(F)):
            flat_F, flat_y = F.reshape(-1, F.shape[-1]), y.reshape(-1, self.rank)
            M = np.column_stack([self.O, self.c])                     # F = O y + c
            r = residual(flat_F, M, np.column_stack([flat_y, np.ones(len(flat_y))]))
            if np.all(np.isfinite(r)):
                y = y + (r @ self.P.T).reshape(y.shape)
        return y


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
                 rank=None, max_condition: float = math.inf, extra_tokens: int = 0) -> Readout:
    """SVD of O, its numerical rank (singular values above RANK_GAP x O's error bar, or
    ``rank`` when stated) and the token directions for the functionals of g.

    ``max_condition``: the readout uses only the right singular directions whose singular
    value is at least sigma_1 / max_condition (r' of them) and reaches the others through
    the kernel-like offsets w_i (O w_i lies in the left singular directions the readout
    drops, so it reads them as 0 exactly): ceil(d / r') queries per point instead of
    1, and the readout's condition number at most max_condition. Low precision answers
    use it: a forward pass in float32 read through cond(O) = 1e4 loses 1e4 x (d + 1)
    of its 6e-8.

    ``extra_tokens``: at full column rank, up to this many extra tokens per probe go to
    the directions v_j of O with sigma_j < sigma_1 / PAIR_CONDITION, in pairs q +- t v_j
    (:func:`pair_counts`)."""
    m, d = O.shape
    Uo, sv, Vt = np.linalg.svd(O, full_matrices=True)
    if rank is None:
        # ~ ||error of O||_2 at the answers' unit roundoff (the design level of a low
        # precision is far above what it rounds: cond(O) of 1e3 must stay full rank)
        level = O_error * precision.unit / max(precision.relative, precision.unit)
        noise = level * (math.sqrt(m) + math.sqrt(d))
        r = int(np.sum(sv > max(RANK_GAP * noise, 64 * EPS * sv[0])))
    else:
        r = int(rank)
    r = min(r, max(1, int(np.sum(sv >= sv[0] / max_condition))))
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
    dirs, counts = np.empty((0, d)), np.empty(0, dtype=int)
    if r == d and extra_tokens >= 2:
        k = pair_counts(sv[:d], extra_tokens // 2)
        if k.any():
            dirs, counts = Vt[:d][k > 0], k[k > 0]
    return Readout(c=c, O=O, rank=r, V=V, P=P, Z=Z, Zinv=Zinv, A_inv=np.linalg.inv(A),
                   O_error=O_error,
                   c_error=c_error, pinv_norm=float(1.0 / sv[r - 1]), precision=precision,
                   O_norm=float(sv[0]), P_norm=float(np.linalg.norm(P)), pair_dirs=dirs,
                   pair_counts=counts)


def pair_counts(sv: np.ndarray, budget: int) -> np.ndarray:
    """k_j pairs of extra tokens q +- t v_j for the right singular directions of O
    (singular values ``sv``, descending), at most ``budget`` pairs in all.

    Why: a probe's answer shows the weights' mean sum_i alpha_i x_i through O, so its
    component along v_j is read with the answers' rounding over sigma_j. Its sensitivity
    to g is the weights' covariance along v_j: t^2 / d from the simplex, plus 2 k_j t^2 /
    N from k_j pairs at +- t v_j (N tokens in all). The pairs add weight, not size: their
    logits +- t v_j^T g are no larger than the simplex's, so the probe's scale stays.
    Greedy: a pair to the direction of the largest 1 / (sigma_j (1 + 2 k_j)) until every
    one is at most PAIR_CONDITION / sigma_1, the budget is spent, or PAIR_DIRECTIONS
    directions have pairs. Measured: d = 64, cond(O) = 9.8e3, W's error 1.7e-11 without
    pairs, 2.4e-12 with 4 and 7.8e-13 with 16 pairs on v_d."""
    k = np.zeros(len(sv), dtype=int)
    if not len(sv) or not sv[0] > 0:
        return k
    limit = PAIR_CONDITION / sv[0]
    with np.errstate(divide="ignore"):
        for _ in range(budget):
            weight = 1.0 / (sv * (1 + 2 * k))
            if np.count_nonzero(k) >= PAIR_DIRECTIONS:
                weight = np.where(k > 0, weight, 0.0)
            j = int(np.argmax(weight))
            if not weight[j] > limit:
                break
            k[j] += 1
    return k


def _woodbury(Dinv: np.ndarray, C: np.ndarray, x: np.ndarray) -> tuple:
    """(diag(1 / Dinv) + C C^T)^-1 x for each row: Dinv (n, r), C (n, r, p), x (n, 2, r);
    returns the two solves (n, r) each. Woodbury: O(r p^2) per row, not r^3."""
    K = np.eye(C.shape[2]) + np.einsum("nij,ni,nil->njl", C, Dinv, C)
    y = Dinv[:, None, :] * x                                     # (n, 2, r)
    try:
        z = np.linalg.solve(K[:, None], np.einsum("nij,nki->nkj", C, y)[..., None])[..., 0]
    except np.linalg.LinAlgError:                    # singular (non-finite weights): unreadable
        return np.full_like(x[:, 0], np.nan), np.full_like(x[:, 0], np.nan)
    out = y - Dinv[:, None, :] * np.einsum("nij,nkj->nki", C, z)
    return out[:, 0], out[:, 1]


def halved_steps(x: np.ndarray, step: np.ndarray, value: np.ndarray, objective,
                 small: np.ndarray, *, maximise: bool, halvings: int = 60):
    """One damped Newton move for every row at once: each row's ``step`` (n, k) halved
    until ``objective`` (x -> (values (n,), extra)) improves on ``value`` (n,) up to
    rounding (8 eps relative), or at once where the step is already ``small`` (n,).
    Returns (x + lambda step, their values, the rows accepted, the objective's extra)."""
    lam = np.ones(len(x))
    for _ in range(halvings):
        x1 = x + lam[:, None] * step
        v1, extra = objective(x1)
        slack = 8 * EPS * np.abs(value)
        better = v1 >= value - slack if maximise else v1 <= value + slack
        ok = np.isfinite(v1) & (better | small)
        if ok.all():
            break
        lam = np.where(ok, lam, 0.5 * lam)
    return x1, v1, ok, extra


def _pair_solve(a0: np.ndarray, B: np.ndarray, k: np.ndarray):
    """The weights of probes with pairs, from a0 = A^-1 (V^T x-bar - V^T q) / t (n, r),
    B = rho A^-1 V_p^T (n, r, p) (pairs at q +- t rho v_j) and the pair counts k (p,).

    In the simplex logits l (l_i = t z_i^T g), the pairs' logits are +-B_j^T l and
    a0 = alpha + B u, alpha_i = e^(l_i) / Z, u_j = k_j (e^(B_j^T l) - e^(-B_j^T l)) / Z,
    Z = 1 + sum_i e^(l_i) + sum_j k_j (e^(B_j^T l) + e^(-B_j^T l)): a0 is the gradient of
    ln Z, so l maximises the concave a0^T l - ln Z. Newton from l = 0 with halved steps;
    its Hessian diag(alpha) + B diag(P) B^T - w w^T (P_j the pairs' weight, w = a0 at
    the solution) is solved by Woodbury in O(r p^2). A mean outside the tokens' hull
    (weights not a softmax's) does not converge: rows of nan.

    Returns (l (n, r), alpha (n, r), alpha_N (n,), the pairs' logits B^T l (n, p))."""
    n, r = a0.shape
    lk = np.log(k.astype(float))

    def parts(l):
        hp = np.einsum("nr,nrp->np", l, B)
        terms = np.concatenate([np.zeros((n, 1)), l, hp + lk, -hp + lk], axis=1)
        top = terms.max(axis=1, keepdims=True)
        e = np.exp(terms - top)
        Zs = e.sum(axis=1)
        logZ = top[:, 0] + np.log(Zs)
        p = len(k)
        alpha = e[:, 1:r + 1] / Zs[:, None]
        plus, minus = e[:, r + 1:r + 1 + p] / Zs[:, None], e[:, r + 1 + p:] / Zs[:, None]
        return hp, logZ, e[:, 0] / Zs, alpha, plus - minus, plus + minus

    l = np.zeros((n, r))
    hp, logZ, aN, alpha, u, P = parts(l)
    value = (a0 * l).sum(axis=1) - logZ
    done = np.zeros(n, dtype=bool)
    for _ in range(PAIR_ITERATIONS):
        w = alpha + np.einsum("np,nrp->nr", u, B)
        grad = a0 - w
        # H = diag(alpha) + C C^T - w w^T, C = B diag(sqrt P): Woodbury, then Sherman-Morrison
        C = B * np.sqrt(P)[:, None, :]                           # (n, r, p)
        with np.errstate(all="ignore"):                          # underflowed weights: inf
            Dinv = 1.0 / alpha
            Mg, Mw = _woodbury(Dinv, C, np.stack([grad, w], axis=1))
            step = Mg + Mw * ((w * Mg).sum(axis=1) / (1.0 - (w * Mw).sum(axis=1)))[:, None]
        # quadratic convergence: a step this small leaves rounding once taken
        small = np.abs(step).max(axis=1) <= 1e-9 * np.maximum(np.abs(l).max(axis=1), 1.0)
        step[done | ~np.all(np.isfinite(step), axis=1)] = 0.0
        if done.all():
            break
        l1, v1, ok, _ = halved_steps(
            l, step, value, lambda x: ((a0 * x).sum(axis=1) - parts(x)[1], None), small,
            maximise=True)
        keep = ok & ~done
        l = np.where(keep[:, None], l1, l)
        value = np.where(keep, v1, value)
        done |= small & keep
        hp, logZ, aN, alpha, u, P = parts(l)
    # converged where the mean is reproduced: a0 = alpha + B u to rounding
    fit = (np.abs(a0 - alpha - np.einsum("np,nrp->nr", u, B)).max(axis=1)
           <= 1e-9 * np.maximum(np.abs(a0).max(axis=1), 1e-300))
    good = done & fit & np.all(np.isfinite(l), axis=1)
    bad = ~good[:, None]
    return (np.where(bad, np.nan, l), np.where(bad, np.nan, alpha), np.where(good, aN, np.nan),
            np.where(bad, np.nan, hp))


def measure_single_tokens(oracle, precision: AnswerPrecision, last) -> tuple:
    """c = F([0]) and O e_k = F([e_k]) - c: d + 1 one-token queries, one batch.

    Returns (c (m,), O (m, d), the error level of O's entries and of c's)."""
    d = oracle.dim
    X = np.concatenate([np.zeros((1, 1, d)), np.eye(d)[:, None, :]])
    F = last(oracle.query(X))
    c, O = F[0], (F[1:] - F[0]).T
    level = precision.level(float(np.abs(F).max()), 1)
    return c, O, math.sqrt(2.0) * level, level


@dataclass
class Points:
    """Measurements of g(q) = W q + b at points q."""

    q: np.ndarray            # (n, d)
    t: np.ndarray            # (n,) token scale of each point's probes
    g: np.ndarray            # (n, d)
    peak: np.ndarray         # (n,) largest |logit|, inf where unreadable
    bound: np.ndarray        # (n,) 2-norm error bound of g
    rho: np.ndarray          # (n,) the pairs' offsets q +- t rho v_j
    pair_peak: np.ndarray    # (n,) the pairs' largest |logit| (0 without pairs)
    simplex_peak: np.ndarray  # (n,) the simplex tokens' largest |logit|


def _pair_fit(points: Points) -> np.ndarray:
    """rho that brings the pairs' largest logit down to min(PAIR_LOGIT, the simplex's):
    k pairs at logits +-x weigh 2 k cosh(x), so a g far along v_j (x large) would give
    them the attention the simplex needs (its weights, hence its logits' precision,
    shrink by that much)."""
    cap = np.minimum(PAIR_LOGIT, points.simplex_peak)
    over = np.isfinite(points.pair_peak) & (points.pair_peak > cap) & (cap > 0)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(over, points.rho * cap / points.pair_peak, points.rho)


def measure_points(oracle, R: Readout, q: np.ndarray, t: np.ndarray, last,
                   rho: np.ndarray | None = None) -> Points:
    """g(q_p) for each point q_p (n, d) at token scale t_p: J queries of r + 1 tokens
    per point (x_i = q + t z_i, then q), and the pairs q +- t rho_p v_j when the readout
    has them (rho (n,), default 1), all in one batch."""
    n, d = q.shape
    J, r = R.Z.shape[0], R.rank
    rho = np.ones(n) if rho is None else np.asarray(rho, dtype=float)
    offsets = R.offsets()                                         # (J, r + 2 pairs, d)
    tokens = offsets.shape[1] + 1
    X = np.empty((n, J, tokens, d))
    X[:, :, :-1, :] = q[:, None, None, :] + t[:, None, None, None] * offsets[None]
    X[:, :, r:-1, :] = q[:, None, None, :] + (t * rho)[:, None, None, None] * offsets[None, :, r:]
    X[:, :, -1, :] = q[:, None, :]
    F = last(oracle.query(X.reshape(n * J, tokens, d))).reshape(n, J, -1)
    y = R.read(F)                                                 # (n, J, r)
    alpha = ((y - (q @ R.V)[:, None, :]) @ R.A_inv.T) / t[:, None, None]
    pair_peak = np.zeros(n)
    if R.pairs:                                                   # full rank: J = 1
        B = rho[:, None, None] * (R.A_inv @ R.pair_dirs.T)[None]  # (n, r, p)
        l, alpha0, alpha_N, hp = _pair_solve(alpha[:, 0], B, R.pair_counts)
        readable = np.isfinite(alpha_N)[:, None]
        alpha = np.where(readable[:, :, None], alpha0[:, None, :], 1.0)
        alpha_N = np.where(readable, alpha_N[:, None], 1.0)
        logits = np.where(readable[:, :, None], l[:, None, :], 0.0)
        pair_peak = np.where(readable[:, 0], np.abs(hp).max(axis=1), 0.0)
    else:
        alpha_N = 1.0 - alpha.sum(axis=2)
        readable = np.all(alpha > 0, axis=2) & (alpha_N > 0)
        with np.errstate(divide="ignore", invalid="ignore"):
            logits = np.log(np.where(alpha > 0, alpha, 1.0)) - np.log(
                np.where(alpha_N > 0, alpha_N, 1.0))[:, :, None]
    ok = readable.all(axis=1)
    simplex_peak = np.where(ok, np.abs(logits).max(axis=(1, 2)), np.inf)
    pair_peak = np.where(ok, pair_peak, np.inf)
    peak = np.maximum(simplex_peak, pair_peak)
    g = (logits.reshape(n, J * r) / t[:, None]) @ R.Zinv.T
    # error estimate (first order, errors independent per number): an answer number is
    # off by sigma_F, O's entries and c's by their levels; through y = P (F - c) (rows of
    # P of norm <= ||O^+||), alpha = A^-1 (y - V^T q) / t, the logits' Jacobian
    # L = diag(1 / alpha) + 1 1^T / alpha_N, and g = Zinv (logits / t). With pairs the
    # same from the simplex's (diluted) weights: the pairs lower the error along v_j only
    p = R.precision
    mag_x = np.linalg.norm(q, axis=1) + t * float(np.linalg.norm(offsets, axis=2).max())
    # an answer's rounding is relative to the sizes summed in it, not to its own size
    answer = np.maximum(np.abs(F).max(axis=(1, 2)), R.O_norm * mag_x + float(np.abs(R.c).max()))
    XTa = np.linalg.norm(q, axis=1) + t                           # |X^T alpha| <= this
    # hypot: answers of 1e200 must not overflow when squared
    sigma = np.hypot(np.hypot(np.array([p.level(a, tokens) for a in answer]), R.c_error),
                     R.O_error * XTa)
    safe_alpha = np.where(readable[:, :, None], alpha, 1.0)
    safe_N = np.where(readable, alpha_N, 1.0)
    # ||L A^-1||_F^2 = sum_i |a_i|^2 / alpha_i^2 + 2 (a_i . s) / (alpha_i alpha_N)
    #                  + r |s|^2 / alpha_N^2, a_i the rows of A^-1, s their sum
    rows2 = np.sum(R.A_inv ** 2, axis=1)
    colsum = R.A_inv.sum(axis=0)
    cross = R.A_inv @ colsum
    N_ = safe_N[..., None]
    gain2 = (rows2 / safe_alpha ** 2 + 2 * cross / (safe_alpha * N_)).sum(axis=2) \
        + r * float(colsum @ colsum) / safe_N ** 2
    gain = np.sqrt(np.maximum(gain2, 0.0).sum(axis=1))           # ||blockdiag(L A^-1)||_F
    zinv = float(np.linalg.norm(R.Zinv, 2))
    # independent errors: ||L A^-1 P||_F ~ ||L A^-1||_F ||P||_F / sqrt(r)
    from_answers = zinv * gain * R.P_norm * sigma / (math.sqrt(r) * t ** 2)
    # the box's own score rounding: eps |x_i| |W q + b| per logit
    dscore = p.score * mag_x * np.linalg.norm(np.where(np.isfinite(g), g, 0.0), axis=1)
    bound = R.calibration * np.hypot(from_answers, zinv * math.sqrt(2 * J * r) * dscore / t)
    return Points(q=q, t=t, g=np.where(ok[:, None], g, np.nan), peak=peak, bound=bound,
                  rho=rho, pair_peak=pair_peak, simplex_peak=simplex_peak)


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
    return (np.isfinite(points.peak) & (points.peak < LOW_LOGIT)
            & (points.peak <= NOISE_FACTOR * points.bound * points.t))


def measure_columns(oracle, R: Readout, b: np.ndarray, b_bound: float, beta_known: bool,
                    last, counts: dict) -> tuple:
    """W e_k from g(s_k e_k) = s_k W e_k + b for every k: a pilot (column 0 at the
    pilot scale), then every other column at the scales designed from it (column 0
    again unless the pilot was in band and balanced), then columns out of band or off
    their balance asked again. Pairs (R.pairs) stay at the offsets rho that keep their
    logits below PAIR_LOGIT and the simplex's (the pilot's for all, then each column's
    on a re-ask); a pilot that asks for rho < PAIR_FIT drops them for the rest. Returns
    W (d, d), s (d,), the 2-norm error bound of each column (d,) and the readout the
    columns used; ``counts`` gets "columns" (d J) and the rest as "rescaling"."""
    d = oracle.dim
    beta = float(np.abs(b).max()) if beta_known else 0.0
    eye = np.eye(d)
    s, t = np.full(d, PILOT_SCALE), np.full(d, PILOT_SCALE)
    if beta > 0:                   # the bias alone would put the logits at TARGET / 2
        t[:] = 0.5 * TARGET_LOGIT / beta
    g = np.full((d, d), np.nan)
    peak, bound = np.full(d, np.inf), np.full(d, np.inf)
    rho, fit = np.ones(d), np.ones(d)     # the pairs' offsets, and what the probes ask of them
    asked = 0

    def ask(cols):
        nonlocal asked
        pts = measure_points(oracle, R, s[cols, None] * eye[cols], t[cols], last, rho[cols])
        g[cols], peak[cols], bound[cols] = pts.g, pts.peak, pts.bound
        fit[cols] = _pair_fit(pts)
        asked += len(cols) * R.blocks

    def column_noise():
        # |s W e_k| within its bar: W e_k = 0 as far as these probes tell
        size = np.linalg.norm(np.where(np.isfinite(g), g - b, np.inf), axis=1)
        return np.isfinite(peak) & (peak <= HIGH_LOGIT) & (size <= NOISE_FACTOR * (bound + b_bound))

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
    rho[todo] = fit[0]                # the pilot's g along v_j stands for the others'
    if R.pairs and fit[0] < PAIR_FIT:
        # g far along the weak directions: pairs small enough for its logits add little
        # covariance there, and they still dilute the simplex's weights
        R = replace(R, pair_dirs=np.empty((0, d)), pair_counts=np.empty(0, dtype=int))
        rho[:] = 1.0
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
        rho[cols] = fit[cols]
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
    # columns whose s W e_k is within its bar of 0 are 0 (as a bias at its noise is):
    # the probes cannot tell them from 0, and an exact 0 is what a W = 0 box has
    W = np.where(column_noise()[None, :], 0.0, ((g - b) / s[:, None]).T)
    return W, s, np.hypot(bound, b_bound) / s, R


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
        rho = _pair_fit(pts)            # pairs above the simplex: brought down, t for the rest
        t = _rescaled(t, np.where(rho < pts.rho, pts.simplex_peak, pts.peak))
        pts = measure_points(oracle, R, np.zeros((1, d)), t, last, rho)
        counts["rescaling"] += R.blocks
    if not np.isfinite(pts.peak[0]):
        raise ModelMismatchError(
            f"the black box is not a single attention head: after {MAX_TRIES} rescalings "
            f"the bias probe still implies attention weights outside (0, 1)")
    return pts


# -- every position ------------------------------------------------------------------

def simplex_vertices(d: int) -> np.ndarray:
    """Z (d + 1, d): the vertices z_k of a regular simplex of unit circumradius centred at
    0 (sum_k z_k = 0, Z^T Z = (d + 1) / d I)."""
    A = simplex_edges(d)
    z0 = -A.sum(axis=1) / (d + 1)                   # sum_k z_k = 0 fixes z_0
    return np.vstack([z0, z0 + A.T])


def every_position_probe(oracle, R: Readout, t: float, causal: bool):
    """g(t z_k) = t W z_k + b at the d + 1 vertices of a regular simplex (rows of G),
    from the tokens t z_0, ..., t z_d: one query (bidirectional) or two (causal: both
    orders).

    At position k, ln alpha_i = t z_i^T g_k + const, and since sum_i z_i = 0 and
    Z^T Z = (d + 1) / d I, g_k = d / ((d + 1) t) Z^T ln alpha: no token is the
    reference, so no weight carries the others' rounding. Bidirectional: alpha from
    y = O^+ (F_k - c) = t Z^T alpha, sum alpha = 1 (orthogonal parts). Causal: position
    k of the forward order sees tokens 0..k, of the reversed order tokens k..d; the two
    sets of log-weights share token k, which aligns their constants.

    Returns (G (d + 1, d), largest |t z_i^T g_k|, error estimate of each row (d + 1,))."""
    d = oracle.dim
    Z = simplex_vertices(d)
    tokens = t * Z
    X = np.stack([tokens, tokens[::-1]]) if causal else tokens[None]
    F = np.asarray(oracle.query(X))                                 # (B, d + 1, m)
    Y = R.read(F) / t                                               # Z^T alpha per position
    logs = np.full((d + 1, d + 1), np.nan)                          # ln alpha_i at position k
    amin = np.zeros(d + 1)                                          # smallest weight read
    with np.errstate(divide="ignore", invalid="ignore"):
        if not causal:
            alpha = (d / (d + 1)) * Y[0] @ Z.T + 1.0 / (d + 1)      # (k, i)
            logs = np.log(np.where(alpha > 0, alpha, np.nan))
            amin = alpha.min(axis=1)
        else:
            fwd, rev = Y[0], Y[1][::-1]        # rev[k]: the position holding token k
            for k in range(d + 1):
                part = []
                for seen, y in ((np.arange(k + 1), fwd[k]), (np.arange(k, d + 1), rev[k])):
                    M = np.vstack([Z[seen].T, np.ones((1, seen.size))])
                    a = np.linalg.lstsq(M, np.append(y, 1.0), rcond=None)[0]
                    la = np.log(np.where(a > 0, a, np.nan))
                    part.append((seen, la - la[0 if seen[0] == k else -1]))
                    amin[k] = min(amin[k], a.min()) if amin[k] > 0 else a.min()
                for seen, la in part:
                    logs[k, seen] = la
    ok = bool(np.all(np.isfinite(logs)))
    G = (d / ((d + 1) * t)) * logs @ Z                              # rows g_k
    worst = float(np.abs(t * G @ Z.T).max()) if ok else np.inf
    # error estimate: d ln alpha_i = d alpha_i / alpha_i, alpha's rows from y through
    # sqrt(d / (d + 1)) Z (orthonormal columns scaled), y = P (F - c) / t
    p = R.precision
    level = p.level(max(float(np.abs(F).max()), R.O_norm * t + float(np.abs(R.c).max())), d + 1)
    sigma = math.hypot(level, R.c_error, R.O_error * t)     # no overflow at answers of 1e200
    if not ok:                             # unreadable: no estimate
        return G, worst, np.full(d + 1, np.inf)
    inv_alpha = 1.0 / np.maximum(amin, np.finfo(float).tiny)
    chain = 2.0 if causal else 1.0         # causal rows join two solves
    da = R.P_norm * sigma / t
    dlog = chain * inv_alpha * da
    g_norm = np.linalg.norm(G, axis=1)
    dscore = p.score * t * g_norm
    bound = R.calibration * math.sqrt(d / (d + 1)) * np.hypot(dlog, 2 * math.sqrt(d) * dscore) / t
    return G, worst, bound


def _softmax_mean_solve(X: np.ndarray, y: np.ndarray, seen: np.ndarray):
    """g with sum_f X_f^T softmax(X_f g) = sum_f y_f, for each position (rows of y).

    X (N, d) the tokens; y (n, S, d) the answers read back (the weights' means, S sets
    per position: 1 bidirectional, 2 causal); seen (n, S, N) which tokens each set
    attends to. sum_f ln sum_{i in f} e^(x_i^T g) - g^T y_f is convex (its Hessian the
    sum of the sets' covariances H), so Newton with halved steps from g = 0 finds its
    minimiser; each y_f is first projected on the affine hull of its set (a component
    outside it is rounding only, no softmax's mean). A mean outside the tokens' hull
    (weights not a softmax's) does not converge: rows of nan.

    Returns (g (n, d), ||H^-1||_2 (n,), the smallest weight of each position (n,))."""
    n, S, _ = seen.shape
    d = X.shape[1]
    target = np.zeros((n, d))
    hulls: dict = {}                                # one per distinct token set
    for k in range(n):
        for f in range(S):
            key = seen[k, f].tobytes()
            if key not in hulls:
                idx = np.flatnonzero(seen[k, f])
                D = X[idx[1:]] - X[idx[0]]          # repeated tokens: rank below rows
                U, sv = np.linalg.svd(D.T, full_matrices=False)[:2]
                Q = U[:, :int(np.sum(sv > 1e-8 * sv[0]))] if len(idx) > 1 and sv[0] > 0 \
                    else np.zeros((d, 0))
                hulls[key] = (X[idx[0]], Q)
            x0, Q = hulls[key]
            target[k] += x0 + Q @ (Q.T @ (y[k, f] - x0))

    def hessian(a, mean):
        # sum_f X^T diag(a_f) X - mean_f mean_f^T, as one batched product
        return (X.T[None] * a.sum(axis=1)[:, None, :]) @ X \
            - np.einsum("nsj,nsk->njk", mean, mean)

    def parts(g):
        logits = np.where(seen, (g @ X.T)[:, None, :], -np.inf)          # (n, S, N)
        top = logits.max(axis=2, keepdims=True)
        e = np.exp(logits - top)
        Zs = e.sum(axis=2, keepdims=True)
        a = e / Zs
        value = (top[..., 0] + np.log(Zs[..., 0])).sum(axis=1) - (g * target).sum(axis=1)
        return value, a

    g = np.zeros((n, d))
    value, a = parts(g)
    done = np.zeros(n, dtype=bool)
    for _ in range(PAIR_ITERATIONS):
        mean = a @ X                                                      # (n, S, d)
        grad = mean.sum(axis=1) - target
        H = hessian(a, mean)
        with np.errstate(all="ignore"):
            try:
                step = -np.linalg.solve(H, grad[..., None])[..., 0]
            except np.linalg.LinAlgError:
                break
        small = np.abs(step).max(axis=1) <= 1e-10 * np.maximum(np.abs(g).max(axis=1), 1e-300)
        step[done | ~np.all(np.isfinite(step), axis=1)] = 0.0
        if done.all():
            break
        g1, v1, ok, a1 = halved_steps(g, step, value, parts, small, maximise=False)
        keep = ok & ~done
        g = np.where(keep[:, None], g1, g)
        value = np.where(keep, v1, value)
        a = np.where(keep[:, None, None], a1, a)
        done |= small & keep
    mean = a @ X
    H = hessian(a, mean)
    fit = (np.abs(mean.sum(axis=1) - target).max(axis=1)
           <= 1e-9 * max(float(np.abs(X).max()), 1e-300))
    good = done & fit & np.all(np.isfinite(g), axis=1)
    with np.errstate(all="ignore"):
        h_inv = np.where(good, 1.0 / np.linalg.eigvalsh(np.where(
            good[:, None, None], H, np.eye(d)))[:, 0], np.inf)
    amin = np.where(seen, a, np.inf).min(axis=(1, 2))
    return np.where(good[:, None], g, np.nan), h_inv, amin


def every_position_pair_probe(oracle, R: Readout, t: float, rho: np.ndarray, causal: bool):
    """The every-position probe with R's pairs of extra tokens +-t rho_j v_j first (k_j of
    each; rho (p,)), then the simplex t z_0..t z_d (causal: in both orders). The pairs add
    weight along O's weak directions v_j, where the readout is worst, so the weights'
    mean moves more with g there (:func:`pair_counts`); g_k at each simplex position from
    :func:`_softmax_mean_solve`. Returns what :func:`every_position_probe` returns."""
    d = oracle.dim
    Z = simplex_vertices(d)
    dirs = np.repeat(rho[:, None] * R.pair_dirs, R.pair_counts, axis=0)
    pairs = t * np.concatenate([dirs, -dirs])                        # (2 p, d)
    P = len(pairs)
    tokens = t * Z
    orders = [np.arange(d + 1), np.arange(d + 1)[::-1]] if causal else [np.arange(d + 1)]
    X = np.stack([np.vstack([pairs, tokens[o]]) for o in orders])
    F = np.asarray(oracle.query(X))                                 # (S, P + d + 1, m)
    Y = R.read(F)[:, P:]                                             # simplex positions
    Xall = np.vstack([pairs, tokens])                                # token k at P + k
    S = len(orders)
    y = np.empty((d + 1, S, d))
    seen = np.zeros((d + 1, S, P + d + 1), dtype=bool)
    seen[:, :, :P] = True
    for f, o in enumerate(orders):
        where = np.argsort(o)                     # the position holding token k
        y[:, f] = Y[f][where] @ R.V.T
        for k in range(d + 1):
            pos = where[k]
            visible = o[:pos + 1] if causal else o
            seen[k, f, P + visible] = True
    G, h_inv, amin = _softmax_mean_solve(Xall, y, seen)
    ok = bool(np.all(np.isfinite(G)))
    worst = float(np.abs(t * G @ Z.T).max()) if ok else np.inf
    pair_peak = float(np.abs(G @ pairs.T).max()) if ok and P else 0.0
    if not ok:
        return G, np.inf, np.full(d + 1, np.inf), 0.0
    p = R.precision
    level = p.level(max(float(np.abs(F).max()), R.O_norm * t + float(np.abs(R.c).max())),
                    P + d + 1)
    sigma = math.hypot(level, R.c_error, R.O_error * t)
    # first order: dg = H^-1 dy, |dy| <= ||P||_F sigma per set; the box's score rounding
    # eps t |g| per logit moves the mean by at most t times it
    dy = math.sqrt(S) * R.P_norm * sigma
    dscore = p.score * t * np.linalg.norm(G, axis=1)
    bound = R.calibration * h_inv * np.hypot(dy, math.sqrt(S) * t * dscore * math.sqrt(P + d + 1))
    return G, worst, bound, pair_peak


def every_position_scale(W: np.ndarray, b: np.ndarray) -> float:
    """t with max_k,i |t z_i^T (t W z_k + b)| = TARGET_LOGIT (bisection in log t)."""
    Z = simplex_vertices(W.shape[0])
    ZWZ, Zb = Z @ W @ Z.T, Z @ b

    def peak(t):
        return float(np.abs(t * (t * ZWZ + Zb[:, None])).max())
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


def _pair_offsets(R: Readout, t: float, W: np.ndarray, b: np.ndarray) -> np.ndarray:
    """rho (p,) for the pairs +-t rho_j v_j of a probe at scale t, from the W, b known so
    far: their logits t rho_j |v_j^T g_k| (g_k = t W z_k + b) are kept below min(PAIR_LOGIT,
    the simplex's largest) at every position (:func:`_pair_fit`'s reason)."""
    Z = simplex_vertices(W.shape[0])
    G = t * Z @ W.T + b
    cap = min(PAIR_LOGIT, float(np.abs(t * G @ Z.T).max()))
    reach = np.abs(t * G @ R.pair_dirs.T).max(axis=0)                # (p,) at rho = 1
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(reach > cap, cap / reach, 1.0)


def measure_every_position(oracle, R: Readout, causal: bool, counts: dict):
    """W, b from the every-position probes: a pilot at PILOT_SCALE, kept when its
    largest logit is in band, else asked again at the scale designed from it; when R has
    pairs (O ill-conditioned) the probe that is kept carries them: the pilot in band is
    asked once more with them, a rescaled probe carries them at once.

    Returns (G (d + 1, d), t, error bounds of G's rows (d + 1,), whether G's probe had
    pairs)."""
    d = oracle.dim
    Z = simplex_vertices(d)
    per = 2 if causal else 1
    t = PILOT_SCALE
    G, worst, bound = every_position_probe(oracle, R, t, causal)
    counts["every-position probes"] = per
    paired = False
    for _ in range(MAX_TRIES):
        in_band = EVERY_BAND[0] <= worst <= EVERY_BAND[1]
        if in_band and (paired or not R.pairs):
            break
        readable = bool(np.isfinite(worst))
        if readable:
            b = G.mean(axis=0)
            W = (d / ((d + 1) * t)) * G.T @ Z
        if in_band:
            # the same probe again with the pairs; kept only when it reads in band too
            G2, worst2, bound2, _ = every_position_pair_probe(
                oracle, R, t, _pair_offsets(R, t, W, b), causal)
            counts["every-position pairs"] = per
            if np.isfinite(worst2) and EVERY_BAND[0] <= worst2 <= EVERY_BAND[1]:
                G, bound, paired = G2, bound2, True
            break
        if readable:
            if worst <= NOISE_FACTOR * bound.max() * t and worst < LOW_LOGIT:
                new = t * MAX_GROWTH ** 0.5            # W, b at the noise: look larger
            else:
                new = every_position_scale(W, b)
                new = min(max(new, t / MAX_GROWTH), t * MAX_GROWTH)
        else:
            new = t * SHRINK_UNREADABLE
        t = new
        if R.pairs and readable:
            G, worst, bound, _ = every_position_pair_probe(
                oracle, R, t, _pair_offsets(R, t, W, b), causal)
            paired = True
        else:
            G, worst, bound = every_position_probe(oracle, R, t, causal)
            paired = False
        counts["rescaling"] += per
    if not np.isfinite(worst):
        raise ModelMismatchError(
            f"the black box is not a single attention head: after {MAX_TRIES} rescalings "
            f"the every-position probes still imply attention weights outside (0, 1)")
    return G, t, bound, paired


# -- the learner ----------------------------------------------------------------------

def extract_vector_single_head(oracle: Oracle, *, seed=None,
                               verify_tolerance: float = DEFAULT_VERIFY_TOLERANCE,
                               biases: bool | None = None, rank: int | None = None,
                               output_rank: int | None = None,
                               output_dtype: str | None = None,
                               tolerance: float | None = None,
                               max_condition: float | None = None) -> ExtractionResult:
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
        rank(W) as stated to the low-rank learner (whose vector twin this is): W is
        measured whole whatever its rank (d + 1 points serve any W), and a W whose
        singular value sigma_{rank+1} stands above its error bar is refused
        (``ModelMismatchError``: not a head of that rank).
    output_rank : int, optional
        rank(O) when known (default: the numerical rank of the measured O).
    output_dtype : {"float64", "float32", "bfloat16", "float16"}, optional
        The box runs its forward pass in this dtype: error bars from its precision.
    tolerance : float, optional
        Every answer number is accurate to +-tolerance.
    max_condition : float, optional
        Largest condition number of the readout through O (:func:`make_readout`): the
        directions of O below sigma_1 / max_condition are reached through offsets the
        readout drops, at ceil(d / r') queries per point. Default: no limit for float64
        answers (2d + 2 queries; the error grows with cond(O)), LOW_PRECISION_CONDITION
        for low precision or noisy answers.

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
    # what the box answers and the cost in numbers and tokens live on the root Oracle
    # (a learner's view of it need not carry them)
    start_bb, start_numbers, start_tokens = root.black_box_seconds, root.numbers, root.tokens
    d = oracle.dim
    every = root.outputs == "all"
    last = _last_answer(root)
    counts = {"constant and O": d + 1, "rescaling": 0, "columns": 0}
    # the nominal count (full-rank O, pilots in band) and the held-out check must fit
    oracle.plan((d + 5 if every else 2 * d + 2) + verification_count(d * d, 2 * d + 2),
                "vector single-head extraction (recovery + verification)")

    notes = []
    # low precision: the error level is measured from dithered repeats, not assumed
    calibrate = output_dtype not in (None, "float64")
    c, O, O_error, c_error = measure_single_tokens(oracle, precision, last)
    m = O.shape[0]
    c_noise = not np.any(c) if tolerance is None else bool(np.abs(c).max() <= 3 * tolerance)
    if biases is False and not c_noise:
        raise ModelMismatchError(
            f"the black box answers F([0]) = c with |c| = {safe_norm(c):.3g} where a head "
            f"without biases answers 0: it has value or output biases; extract with "
            f"biases=None (detect) or biases=True")
    if max_condition is None:
        max_condition = (LOW_PRECISION_CONDITION if calibrate or tolerance is not None
                         else math.inf)
    elif not (isinstance(max_condition, (int, float)) and max_condition >= 1):
        raise InputError(f"max_condition must be a number >= 1, got {max_condition!r}")
    if rank is not None and not (isinstance(rank, (int, np.integer)) and 1 <= rank <= d):
        raise InputError(f"rank must be an integer in 1..{d}, got {rank!r}")
    if output_rank is not None and not (isinstance(output_rank, (int, np.integer))
                                        and 1 <= output_rank <= min(d, O.shape[0])):
        raise InputError(f"output_rank must be an integer in 1..{min(d, O.shape[0])}, got "
                         f"{output_rank!r}")
    # room for extra tokens (pairs on O's ill-read directions): up to d, within max_length
    longest = getattr(oracle, "max_length", None) or root.max_length
    extra = d if longest is None else max(0, min(d, int(longest) - d - 1))
    R = make_readout(c, O, precision, O_error, c_error, output_rank, float(max_condition),
                     extra_tokens=extra)
    condition = float(np.linalg.norm(R.O, 2)) * R.pinv_norm
    if condition > CONDITION_NOTE and math.isinf(max_condition):
        notes.append(f"the readout through O has condition number {condition:.3g}: the errors "
                     f"grow with it (with the extra tokens on O's weak directions, d = 64, "
                     f"cond 1e3 to 1e4: up to 6.5e-13; without room for them 1e-12 to "
                     f"2e-11); "
                     f"max_condition=100 reads the ill-conditioned directions through extra "
                     f"offsets (d = 64: 2d + 2 to 3d + 3 queries, errors below 1e-12)")
    causal = bool(root.causal) if every and root.causal is not None else None
    if every and causal is None:
        causal = _detect_causal(oracle, R, counts)
        notes.append(f"causal mask {'found' if causal else 'absent'}: position 1's answer "
                     f"{'equals' if causal else 'differs from'} its token's own (state "
                     f"causal= to skip this query)")
    if every and R.rank == d:
        assert causal is not None             # stated, or detected above
        G, t, bound, paired = measure_every_position(oracle, R, causal, counts)
        if calibrate:
            G, bound, note = _calibrate_every(oracle, R, causal, t, G, bound, counts)
            notes.append(note)
        Z = simplex_vertices(d)
        # g_k = t W z_k + b: b is the mean (sum_k z_k = 0), W = d / ((d + 1) t) G^T Z
        b_raw = G.mean(axis=0)
        b_bound = float(np.linalg.norm(bound)) / (d + 1)
        b_zero = biases is False or (biases is None and float(np.abs(t * b_raw).max())
                                     <= NOISE_FACTOR * b_bound * t)
        b = np.zeros(d) if b_zero else b_raw
        W = (d / ((d + 1) * t)) * G.T @ Z
        W_ref = TARGET_LOGIT / t ** 2
        # each column of W is a combination of every row of G with weights |z_k| ~ 1
        col_bounds = np.full(d, (d / ((d + 1) * t)) * float(np.linalg.norm(bound))
                             / math.sqrt(d))
        design = (f"tokens t z_k at the vertices of a regular simplex, t = {t:.3g} "
                  f"({'both orders (causal)' if causal else 'one query'})"
                  + (f", with {R.pairs} pairs +-t rho v on "
                     f"{len(R.pair_counts)} direction(s) of O below sigma_1 / "
                     f"{PAIR_CONDITION:g}" if paired else ""))
    else:
        if every:
            notes.append(f"rank(O) = {R.rank} < d = {d}: every-position answers read at the "
                         f"last position only")
        if calibrate:
            notes.append(_calibrate_last(oracle, R, last, counts))
        if biases is False:
            b, b_bound, b_zero = np.zeros(d), 0.0, True
        else:
            pts = measure_bias(oracle, R, last, counts)
            b_zero = biases is None and bool(_noise(pts)[0])
            b = np.zeros(d) if b_zero else pts.g[0]
            b_bound = 0.0 if b_zero else float(pts.bound[0])
        W, s, col_bounds, R = measure_columns(oracle, R, b, b_bound, not b_zero, last, counts)
        # the size of W that scores of order one at the probes' scales would reveal
        W_ref = TARGET_LOGIT / float(s.max() * max(float(np.abs(R.Z).max()), 1.0))
        design = (f"points q = s_k e_k at s {s.min():.3g} .. {s.max():.3g}, "
                  f"{R.blocks} quer{'y' if R.blocks == 1 else 'ies'} of "
                  f"{R.rank + 1 + 2 * R.pairs} tokens per point"
                  + (f" ({R.pairs} pairs q +- t v on {len(R.pair_counts)} direction(s) of O "
                     f"below sigma_1 / {PAIR_CONDITION:g})" if R.pairs else ""))
    if biases is None and c_noise and b_zero or biases is False:
        c = np.zeros(m)
    biased = not (b_zero and not np.any(c))
    if rank is not None and rank < d:
        sv = np.linalg.svd(W, compute_uv=False)
        # W is known to ||dW|| <= bar ||W||: a larger sigma_{rank+1} is W's, not the error's
        bar_W = BAR_FACTOR * float(np.linalg.norm(col_bounds))
        if sv[rank] > RANK_GAP * bar_W:
            raise ModelMismatchError(
                f"the black box's W has rank above the stated {rank}: singular value "
                f"{rank + 1} is {sv[rank]:.3g} against an error bar of {bar_W:.1e} (of "
                f"{sv[0]:.3g}); extract without rank= (W is measured whole anyway)")
        notes.append(f"rank(W) <= {rank} as stated: sigma_{rank + 1} = {sv[rank]:.2g} is "
                     f"within the error bar")
    model = VectorAttention(W[None], R.O[None], b[None], c, positions=root.outputs,
                            causal=bool(causal) if every else bool(root.causal))

    # error bars (relative, per part): BAR_FACTOR x the first-order error estimates; the
    # model's bar for verification takes b and c against the sizes they are judged at
    # (b beside the scores' |W| |x| at the token scale sqrt(2 / |W|), c beside O)
    tiny = np.finfo(float).tiny
    W_norm, O_norm = float(safe_norm(W)), float(safe_norm(R.O))     # O of 1e200: no overflow
    col_rel = BAR_FACTOR * col_bounds / np.maximum(np.linalg.norm(W, axis=0), W_ref / math.sqrt(d))
    O_abs = BAR_FACTOR * R.O_error * math.sqrt(m * d)
    b_abs = 0.0 if b_zero else BAR_FACTOR * b_bound
    c_abs = 0.0 if not np.any(c) else BAR_FACTOR * R.c_error * math.sqrt(m)
    # W's bar is relative to |W|, or to the W that the probes' scales would show (a W far
    # below it, W = 0 included, is known to its absolute error there, not relatively)
    bars = {"W": BAR_FACTOR * float(np.linalg.norm(col_bounds)) / max(W_norm, W_ref, tiny),
            "O": O_abs / max(O_norm, tiny),
            "b": b_abs / max(float(np.linalg.norm(b)), tiny) if b_abs else 0.0,
            "c": c_abs / max(float(safe_norm(c)), tiny) if c_abs else 0.0}
    bar = max(bars["W"], bars["O"], b_abs / max(float(np.linalg.norm(b)),
                                                math.sqrt(2 * W_norm), tiny),
              c_abs / max(float(safe_norm(c)), O_norm, tiny))
    rank_params = R.rank * (m + d - R.rank)
    parameters = d * d + rank_params + ((d + m) if biased else 0)
    per_query = m * (d + 1) if every else m
    floor = math.ceil(parameters / per_query)
    recovery = oracle.queries - start_queries
    numbers, tokens = root.numbers - start_numbers, root.tokens - start_tokens
    n_verify = verification_count(parameters, recovery)
    if not bar <= MAX_BAR:
        raise RecoveryFailedError(
            f"the error bar of the recovered head is {bar:.1e} (W {bars['W']:.1e}, b "
            f"{bars['b']:.1e}, O {bars['O']:.1e}; condition of O "
            f"{float(np.linalg.norm(R.O, 2)) * R.pinv_norm:.3g}), above {MAX_BAR:.0e}: the "
            f"answers ({precision.name}) are too coarse for this head; nothing is returned")
    # float64 answers: verification widens the check by at most the bar its tolerance
    # assumes (the bar here is a bound from the probes' design, up to 700x the model's
    # real error: a causal head at d = 8, bar 3.2e-8, held-out errors 4.5e-11)
    verify_bar, rounded = bar, output_dtype not in (None, "float64") or tolerance is not None
    if rounded:
        # rounded answers: the box itself is off from any exact model by its precision
        # (held-out tolerance LOW_PRECISION_VERIFY x it, plus twice the bar), and by its
        # score rounding, which grows with the scores (the bar is at least that level:
        # verification widens each sequence's allowance by bar x the scores' reach)
        level = precision.relative + (precision.absolute / max(float(np.abs(R.O).max()), tiny)
                                      if precision.absolute else 0.0)
        verify_tolerance = max(verify_tolerance, LOW_PRECISION_VERIFY * level + 2.0 * bar)
        verify_bar = max(bar, precision.score)
    verification = verify_model(oracle, model, count=n_verify, seed=seed,
                                tolerance=verify_tolerance, expected_error=verify_bar,
                                rounded_answers=rounded)
    breakdown = {k: v for k, v in counts.items() if v}
    breakdown["verification"] = verification.sequences
    assert sum(v for k, v in counts.items()) == recovery, (counts, recovery)
    report = Report(
        kind=model.kind, dim=d, queries=oracle.queries - start_queries, breakdown=breakdown,
        floor=floor, verification=verification, seconds=time.perf_counter() - start,
        black_box_seconds=root.black_box_seconds - start_bb, notes=notes,
        recovery=recovery,
        details={"outputs": ("every position" + (" (causal)" if causal else "") if every
                             else "last position") + f", m = {m}",
                 "rank of O": R.rank, "condition of O": float(np.linalg.norm(R.O, 2)
                                                             * R.pinv_norm),
                 "design": design, "precision": precision.name,
                 "extra tokens per probe": 2 * R.pairs,     # of the column probes
                 "numbers received (recovery)": int(numbers),
                 "tokens sent (recovery)": int(tokens),
                 "parameters": parameters,
                 "floor": f"ceil({parameters} parameters / {per_query} numbers per query)",
                 "biases": ("detected" if biased else "none detected (b = 0, c = 0 exactly)")
                 if biases is None else ("measured" if biases else "none (stated)"),
                 "error_bar_W": bars["W"], "error_bar_W_columns": float(col_rel.max()),
                 "W reference": (f"{W_ref:.3g}: W's bar is relative to max(|W|, this), the "
                                 f"W whose scores are of order one at the probes' scales"),
                 "error_bar_b": bars["b"], "error_bar_O": bars["O"], "error_bar_c": bars["c"],
                 "error_bar": bar})
    return checked_result(model, report, "a single attention head with vector answers")


DITHER = 0.8125           # repeats for calibration: scales x this (new roundings)
MIN_CALIBRATION = 1e-4    # a measured level this far below the estimate is not believed


def _calibrate_last(oracle, R: Readout, last, counts: dict) -> str:
    """Measure g(0) = b twice, at token scales 1 and DITHER: the difference of the two is
    the answers' real error; ``R.calibration`` becomes its ratio to the estimated one
    (a forward pass in low precision rounds far less than its assumed level, or more).
    2 J queries."""
    d = oracle.dim
    a = measure_points(oracle, R, np.zeros((2, d)), np.array([1.0, DITHER]), last)
    counts["calibration"] = counts.get("calibration", 0) + 2 * R.blocks
    if not np.all(np.isfinite(a.peak)):
        return "calibration probes unreadable: the assumed precision level is kept"
    ratio = float(np.linalg.norm(a.g[0] - a.g[1]) / np.hypot(a.bound[0], a.bound[1]))
    R.calibration = max(ratio, MIN_CALIBRATION)
    return (f"error level measured from two bias probes at scales 1 and {DITHER}: "
            f"{R.calibration:.2g} x the level assumed for {R.precision.name}")


def _calibrate_every(oracle, R: Readout, causal: bool, t: float, G, bound, counts: dict):
    """The every-position probe again at t x DITHER: W and b from both, their difference
    against the estimated errors sets ``R.calibration``; returns the first probe's G and
    bounds rescaled, and a note."""
    d = oracle.dim
    Z = simplex_vertices(d)
    G2, worst, bound2 = every_position_probe(oracle, R, t * DITHER, causal)
    counts["calibration"] = counts.get("calibration", 0) + (2 if causal else 1)
    if not np.isfinite(worst):
        return G, bound, "calibration probe unreadable: the assumed precision level is kept"
    W1, W2 = (d / ((d + 1) * t)) * G.T @ Z, (d / ((d + 1) * t * DITHER)) * G2.T @ Z
    diff = math.hypot(float(np.linalg.norm(W1 - W2)) * t,
                      float(np.linalg.norm(G.mean(axis=0) - G2.mean(axis=0))))
    pred = math.hypot(float(np.linalg.norm(bound)), float(np.linalg.norm(bound2)))
    R.calibration = max(diff / pred, MIN_CALIBRATION)
    return G, bound * R.calibration, (
        f"error level measured from a repeat at scale x {DITHER}: {R.calibration:.2g} x "
        f"the level assumed for {R.precision.name}")


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
