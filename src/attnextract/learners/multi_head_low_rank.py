"""Multi-head attention with low-rank heads, as in a real layer (W_h = A_h B_h^T, sum r_h <= d).

Model: f(X) = sum_h softmax(X W_h x_N)^T X v_h, h = 1..H, with W_h of rank r_h and
sum_h r_h <= d (a BERT layer: H r = d, e.g. MiniLM-L6 with d = 384, H = 12, r = 32).
Canonical form as in :mod:`attnextract.learners.multi_head`: heads with equal W merge,
heads with v_h = 0 drop.

Identity. The probe [q + u; q] (u = a - q) gives

    g(u, q) := f - v^T q = sum_h c_h(u) sigma(t_h(u, q)),   c_h = u^T v_h,  t_h = u^T W_h q,

with v = sum_h v_h from d single tokens (f([x]) = x^T v). The learner never fits
overlapping sigmoid steps; it makes every measurement a single-head one:

1. **Values by saturation.** On a half circle u(theta) = rho (cos theta u_0 + sin theta u_1)
   at a large radius rho, every sigma is 0 or 1 (to e^-28), so g(u) = u^T V_S(u) with
   V_S = sum_{h in S} v_h, S(u) = {h : u^T W_h q > 0}: g is linear inside each cone and
   changes its gradient by +-v_h where the half circle crosses the hyperplane
   u^T W_h q = 0 (once per head). Crossings are bracketed by bisection on the in-plane
   gradient (three queries a point, one of them at 2 rho to check saturation); the
   full gradient V_S of every cell between crossings costs d + 2 queries. Consecutive
   gradients differ by +-v_h; the signs follow from sum_h v_h = v (a linear solve with
   an exact +-1 answer). Heads with equal W cross together (their v add: the canonical
   merge), heads with v_h = 0 make no jump (dropped): the canonical heads come out.
2. **Query spaces.** For u in R_h = {u : u^T v_g = 0 for g != h} only head h has a
   height, so g = c_h sigma(t_h): one query measures t_h(u, q) exactly (a single head).
   r_h + 1 rows u in R_h against d columns q give r_h + 1 rows of u^T W_h, whose span
   is the query space span(W_h^T) = span(B_h) (its dimension is the rank r_h; the extra
   row checks it).
3. **Isolation columns.** For q in I_h = {q : B_g^T q = 0 for g != h} (dimension
   d - sum_{g != h} r_g >= r_h) every other head's logit is 0, so for ANY row u,
   g = c_h(u) sigma(t_h) + (c(u) - c_h(u)) / 2: again one query per entry. d rows
   against r_h columns Z_h of I_h give Y_h = W_h Z_h, and
   W_h = Y_h (P_h^T Z_h)^{-1} P_h^T  (P_h an orthonormal basis of span(B_h)).
4. **Exact heights, then re-solves.** A column solving u^T W_h q = +-40 for every head
   (current W: head j positive, the others negative) makes every sigma 0 or 1 to e^-40,
   so g = c_j(u) exactly: H d queries give the values to rounding. The measurements of
   stages 2 and 3 are kept (:class:`Block`) and solved again with the other heads'
   sigmoids predicted from the current estimates (:func:`resolve`), a few passes, no
   new queries: the first pass's ~1e-8 (finite-difference values) becomes ~1e-11.

Queries: d (v) + about (H + 1)(d + 2) + 5 x bisection points (values) + sum_h (r_h + 1) d
(query spaces) + d sum_h r_h (isolation columns) + H d (heights) = 2 d^2 + O(H d) when
H r = d, against the floor sum_h (d + r_h (2d - r_h)) (= 2 d^2 + H d - d r) and the multi-head paper's
4 H d^2 - 2 H + 1 (MiniLM: 309,8xx against 287,232 and 7,077,865).

Conditioning (reported). Values: the smallest angular gap between crossings sets the
finite-difference step of the gradients (error ~ eps / step). Query spaces: the
smallest singular value of the normalised values [v_1 .. v_H] (how far each v_h is from
the span of the others) scales the heights in R_h; the spread of the measured rows
(sigma_1 / sigma_r) sets the error of span(B_h). Isolation: the smallest singular value
of P_h^T Z_h is the sine of the angle between head h's query space and the others'
(the head separation): errors of the other heads' query spaces are divided by it.
The predicted parameter error is eps x row spread / head separation after the
re-solves (the first pass's, with the value errors, is reported beside it); the
held-out verification measures the real one. Above MAX_PREDICTED = 1e-7 the answer is
refused: that is where the method breaks, read off the report. The method needs sum_h r_h <= d (else the
isolation spaces are empty: refused) and linearly independent v_h (else R_h holds no
height of head h: refused).

Low precision (``output_dtype=``, ``decimals=``, or rounding detected in the d single-
token answers; docs/low-precision.md). The answers' relative noise e is measured where
they are exactly linear (g(2u) = 2 g(u) at the saturated radius; median of 8 pairs, x 4,
never below the stated or detected rounding) and every threshold follows it
(:class:`Tolerances`): finite-difference angle 1e4 e on a half circle 30x larger
(RHO_NOISY: narrower transitions), crossings 10 such angles apart,
jumps and checks a margin above the noise, the rank at the steepest drop of the rows'
spectrum. The error bar is 20 e x row spread / query-space separation (above 5%:
refused); the held-out check allows 30 e + 2 x bar (at most 1e-2). Measured noise above
1e-3 (a bfloat16 forward pass) is refused.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np
from scipy.linalg import null_space
from scipy.special import expit

from ..errors import (
    AttnExtractError,
    InputError,
    ModelMismatchError,
    NotIdentifiableError,
    RecoveryFailedError,
)
from ..models import BiasedMultiHeadAttention, MultiHeadAttention
from ..oracle import QueryAccess
from ..precision import OutputPrecision, name_the_options, precision_of
from ..report import (
    DEFAULT_VERIFY_TOLERANCE,
    ExtractionResult,
    Report,
    checked_result,
    token_scale,
    verification_count,
    verify_model,
)
from ..verification import safe_norm, safe_rms
from .low_rank import haar_orthogonal, random_probe_basis
from .single_head import constant_and_values, logit, split_scale

EPS = np.finfo(float).eps
SATURATION_TOL = 1e-12   # |g(2u) - 2 g(u)| / |g(2u)|: a point counts as saturated below it
SATURATION_TRIES = 40    # radius x 4 at most this many times
SATURATION_POINTS = 8    # random points of the radius search (3/4 must be saturated)
MIN_GAP = 2e-5           # crossings closer than this (radians) are not separated
ETA = 2e-6               # angular offset of the two points of an in-plane gradient
PLANE_CHECK = 1e-8       # relative change of (a, b) between radii rho and 2 rho allowed
JUMP_TOL = 1e-6          # in-plane gradient change / |v| that counts as a crossing
BRACKET_FRACTION = 0.25  # brackets are narrowed to this fraction of the cells beside them
GRID_PER_HEAD = 4        # first grid: this many points per head on the half circle
STEP_FRACTION = 0.03     # gradient step / (radius x angular margin of the cell)
STEP_TRIES = 3           # gradient steps tried per cell, each 16 x smaller
CHECK_TOL = 1e-8         # relative misfit of a cell's gradient checks
RANK_TOL = 1e-9          # singular value / largest counted in a rank
TARGET_LOGIT = 1.0       # aim for |logit| about this
MAX_LOGIT = 12.0         # beyond it sigma' < 1e-5: probed again, smaller
PRECISE_LOGIT = 4.0      # beyond it a(1 - a) < 0.018: the logit's rounding (and the other heads'
                         # predicted background) grow by cosh^2(t / 2) > 14: redone smaller
                         # (MiniLM layer 5, seed 0: one isolation entry kept at 11.9 cost
                         # head 9 1.6e-8 in W_h and b_h, against 4e-12..6.5e-11 elsewhere)
MAX_RESCALES = 6
SATURATED = 40.0         # logits of the exact-height probes (sigma within e^-40 of 0 or 1)
REFINE_ITERATIONS = 4    # re-solves of the stored blocks with the other heads predicted
MIN_SEPARATION = 1e-12   # query-space separation below which no isolation column exists
MAX_PREDICTED = 1e-7     # predicted parameter error above which the answer is refused
SCOUT = 8                # entries that set the logit scale of a block
BIAS_LOGIT = 1.0         # biases: rows u are shortened until |u^T b_h| <= this
BIAS_GROWTH = 1e4        # biases: largest c of a row's second bias probe
BIASED_REFINE_ITERATIONS = 12   # biases: the root q_0 converges with the heads (MiniLM
                                # layer 2: changes 3.8e-5, 1.7e-4, 1.4e-8, 3.8e-10, ...)
BIASED_RANK_TOL = 1e-7   # biases: first-pass rank tolerance (a bias of 5 |W| costs the values
                         # ~100x: a row's 9th singular value measured at 1.2e-9, d = 96, H = 12)
ISOLATION_TARGET = 0.5   # biases: isolation blocks put the scouts' peak at this x TARGET_LOGIT
BIAS_BAR = 10.0          # biases: predicted error x dilution x shortening x this covered
                         # every measured error (240 random runs, |b_h| up to 10 |W_h|,
                         # benchmarks/results/bench_mhlr_large_biases.md: at most 0.68 of the
                         # bar, median 0.13; without the 10, up to 6.8 times the bar)
BLOCK_FLOATS = 1 << 21   # probe floats per oracle batch (16 MB)


@dataclass(frozen=True)
class Tolerances:
    """The thresholds of one run, set by the relative noise ``noise`` of the answers.

    Exact (float64) answers use the module constants. Rounded answers, or a forward pass
    in low precision, move every threshold with the noise e: the in-plane gradients are
    finite differences over an angle ``eta`` (error ~ e / eta, and no truncation error:
    g is linear inside a cell), so ``eta`` grows with e and the crossings must lie
    ``min_gap`` = 10 eta apart to be told apart; checks and jumps are a margin above the
    noise they would otherwise mistake for a misfit or a crossing. The middle point's
    distance from the sinusoid (``on_curve``) is an interpolation, not a difference:
    its noise is e, so it stays tight and catches the pairs that straddle a crossing.
    """

    noise: float = EPS
    saturation: float = SATURATION_TOL
    eta: float = ETA
    min_gap: float = MIN_GAP
    plane_check: float = PLANE_CHECK
    on_curve: float = PLANE_CHECK
    jump: float = JUMP_TOL
    check: float = CHECK_TOL
    sign: float = 1e-6
    rank: float = RANK_TOL
    max_logit: float = MAX_LOGIT
    max_predicted: float = MAX_PREDICTED

    @classmethod
    def for_noise(cls, noise: float) -> "Tolerances":
        """Thresholds for answers off by ``noise`` relative (EPS or less: the exact ones)."""
        if noise <= EPS:
            return cls()
        eta = min(max(ETA, 1e4 * noise), 1e-2)
        return cls(noise=noise, saturation=max(SATURATION_TOL, 30.0 * noise), eta=eta,
                   min_gap=max(MIN_GAP, 10.0 * eta),
                   plane_check=max(PLANE_CHECK, 30.0 * noise / eta),
                   on_curve=max(PLANE_CHECK, 100.0 * noise),
                   jump=max(JUMP_TOL, 30.0 * noise / eta),
                   check=max(CHECK_TOL, 100.0 * noise), sign=max(1e-6, min(0.1, 1e4 * noise)),
                   rank=max(RANK_TOL, min(1e-2, 3e4 * noise)), max_logit=min(MAX_LOGIT, 6.0),
                   max_predicted=MAX_NOISY_PREDICTED)


EXACT = Tolerances()
# rounded or low-precision answers: the noise is measured on saturated probes (where the
# answer is linear in u), never assumed; this many times the measured level sets e
NOISE_MARGIN = 4.0
RHO_NOISY = 30.0           # noisy answers: the radius this much larger (narrower transitions)
RANK_GAP = 100.0           # noisy rows: the rank ends at a drop of the spectrum this steep
GIVEN_RANK_FLOOR = 1e-2    # noisy rows: singular values below this (relative) fit a given rank
LOW_PRECISION_BAR = 20.0   # error bar = this x measured noise x row spread / separation
MAX_NOISE = 1e-3           # measured relative noise above which nothing is attempted
MAX_VERIFY_NOISY = 1e-2    # the held-out tolerance of noisy answers never exceeds this
MAX_NOISY_PREDICTED = 0.05  # rounded or low-precision answers: a larger error bar is refused


def _tolerances(precision: OutputPrecision, v: np.ndarray) -> tuple[Tolerances, float]:
    """(thresholds, noise floor) for answers of this precision (not float64): the noise
    is then measured by :func:`find_values`, never below the floor.

    Rounding seen in the answers may be the last step of a forward pass run in that
    dtype, whose errors are larger: the level of one rounding is a floor, not the noise.
    A stated forward pass's assumed level only tells saturation apart."""
    # an absolute rounding (k decimals) relative to the size of single-token answers
    size = safe_rms(v)              # answers of 1e200 would overflow when squared
    noise = precision.relative + precision.absolute / max(size, 1e-300)
    if precision.forward:
        return Tolerances.for_noise(noise), 2.0 ** -24 if precision.name == "float32" else noise
    return Tolerances.for_noise(noise), noise


def low_rank_multi_head_floor(d: int, ranks) -> int:
    """Free parameters of heads of ranks r_h: sum_h (d + r_h (2d - r_h))."""
    return int(sum(d + r * (2 * d - r) for r in ranks))


def paper_two_count(d: int, heads: int) -> int:
    """Queries of the multi-head paper's multi-head algorithm: 4 H d^2 - 2 H + 1."""
    return 4 * heads * d * d - 2 * heads + 1


# ---------------------------------------------------------------------------
# probes
# ---------------------------------------------------------------------------

def _pair_outputs(oracle: QueryAccess, first: np.ndarray, last: np.ndarray) -> np.ndarray:
    """f([first_l; last_l]) for rows (n, d) each, in batches of BLOCK_FLOATS floats."""
    n, d = first.shape
    out = np.empty(n)
    step = max(1, BLOCK_FLOATS // (2 * d))
    for lo in range(0, n, step):
        hi = min(n, lo + step)
        X = np.empty((hi - lo, 2, d))
        X[:, 0] = first[lo:hi]
        X[:, 1] = last[lo:hi]
        out[lo:hi] = oracle.query(X)
    return out


def _copy_gap(oracle: QueryAccess, v: np.ndarray, q: np.ndarray, U: np.ndarray) -> np.ndarray:
    """g(u_l, q) = f([q + u_l; q]) - v^T q for rows U (n, d) and one q (d,)."""
    last = np.broadcast_to(q, U.shape)
    return _pair_outputs(oracle, q + U, last) - q @ v


def _weights_to_logits(out, query_part, c, height, background):
    """logit of the attention weight (f - s v^T q - c background) / (c height); NaN outside (0, 1)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        weight = (out - query_part - c * background) / (c * height)
    inside = (weight > 0.0) & (weight < 1.0)
    return np.where(inside, logit(np.where(inside, weight, 0.5)), np.nan)


class Block:
    """Stored single-head measurements of one head: rows (n, d) against columns (d, m).

    ``scale`` and ``outputs`` (n, m) are every entry's logit scale G and the black box's
    answer, kept so that the entries can be solved again with better knowledge of the
    other heads (:func:`resolve`) without new queries.
    """

    # set by head_matrix: a block with an offset column, its rows' shortening (or None)
    offset_column: bool
    row_lengths: np.ndarray | None

    def __init__(self, head, rows, cols, scale, outputs, origin=None):
        self.head, self.rows, self.cols = head, rows, cols
        self.scale, self.outputs = scale.reshape(len(rows), -1), outputs.reshape(len(rows), -1)
        self.origin = origin        # biases: the token every probe was translated by (d,)


def resolve(block: Block, v, values, W, offsets=None) -> np.ndarray:
    """Logits t_h (n, m) of a block, every other head's sigmoid predicted from (values, W).

    f = s v^T q + c sum_g c_g(u) sigma(G t_g(u, q)): the other heads' terms use the
    current estimates (their heights are tiny in R_h, their logits tiny on I_h).
    ``offsets`` (biases, (H, d)): W_g o + b_g = W_g (o - q_0) for the block's origin o
    (:func:`query_offsets`); a probe translated by o has t_g = u^T W_g q + u^T W_g (o - q_0) / s.
    The returned logits of the block's own head keep that offset (the caller removes it).
    """
    U, C, G = block.rows, block.cols, block.scale
    c, s = split_scale(G)
    heights = U @ values.T                                   # (n, H)
    background = np.zeros_like(G)
    for g in range(len(values)):
        if g != block.head:
            logits = (U @ W[g]) @ C if len(U) < C.shape[1] else U @ (W[g] @ C)
            if offsets is not None:
                logits = logits + (U @ offsets[g])[:, None] / s
            background += heights[:, g, None] * expit(G * logits)
    t = _weights_to_logits(block.outputs, s * (v @ C)[None, :], c,
                           heights[:, block.head, None], background)
    return t / G


def _sensitivity(t) -> np.ndarray:
    """1 / (a (1 - a)) = 4 cosh^2(t / 2) at logits t: how much a logit's error exceeds
    its attention weight's (the weight's rounding becomes this much logit error)."""
    return 4.0 * np.cosh(np.minimum(np.abs(t), 50.0) / 2.0) ** 2


class LogitMeter:
    """Measures one head's logits t_h(u, q) = u^T W_h q where it is the only sigmoid left.

    Probe [s q + c u; s q] with G = c s (``split_scale``):
    f = s v^T q + c (background(u) + c_h(u) sigma(G t_h)); ``background`` is what the
    other heads add at logit 0 (sum_{g != h} c_g(u) / 2, or 0 where they have no height).
    Probes whose logit leaves |G t| <= PRECISE_LOGIT are redone at a smaller scale (one
    still beyond it after two tries is kept up to MAX_LOGIT; :attr:`steepest` and the
    RMS sensitivity 1 / (a (1 - a)) of the kept entries enter the error bar).
    """

    def __init__(self, oracle: QueryAccess, v: np.ndarray, tol: Tolerances = EXACT):
        self.oracle, self.v, self.tol = oracle, v, tol
        self.rescued = 0
        self.steepest = 0.0     # largest |G t| of a kept entry
        # sum over kept entries of (1 / (a (1 - a)))^2 and their count: the RMS sensitivity
        # of the logits to the answers' rounding (the error bar grows with it)
        self.sensitivity, self.entries = 0.0, 0

    def _logits(self, U, Qc, height, background, scale):
        c, s = split_scale(scale)
        out = _pair_outputs(self.oracle, s[:, None] * Qc + c[:, None] * U, s[:, None] * Qc)
        self.outputs = out
        return _weights_to_logits(out, s * (Qc @ self.v), c, height, background)

    def scale_for(self, U, Qc, height, background, rng) -> float:
        """A logit scale G putting the largest of SCOUT random entries near TARGET_LOGIT."""
        pick = rng.choice(len(U), min(SCOUT, len(U)), replace=False)
        scale = 1.0
        for _ in range(MAX_RESCALES + 4):
            t = self._logits(U[pick], Qc[pick], height[pick], background[pick],
                             np.full(len(pick), scale))
            self.rescued += len(pick)
            if not np.all(np.isfinite(t)) or np.max(np.abs(t)) > self.tol.max_logit:
                scale *= 2.0 ** -8
                continue
            peak = float(np.max(np.abs(t)))
            if peak < 1e-6:
                scale *= 1e6
                continue
            return scale * TARGET_LOGIT / peak
        return scale

    def measure(self, U, Qc, height, background, scale: float | np.ndarray) -> np.ndarray:
        """t_h(u_l, q_l) for rows U, Qc (n, d), heights c_h(u_l) (n,), background (n,)."""
        scale = np.broadcast_to(np.asarray(scale, dtype=float), (len(U),)).copy()
        t = self._logits(U, Qc, height, background, scale)
        outputs = self.outputs
        # entries beyond PRECISE_LOGIT are redone smaller; one that stays beyond it (a
        # logit offset no scale removes) is kept if within max_logit, and the error bar
        # grows with the steepest kept entry (:attr:`steepest`)
        precise = min(PRECISE_LOGIT, self.tol.max_logit)
        for attempt in range(MAX_RESCALES + 1):
            bad = ~(np.abs(t) <= precise)
            if not bad.any() or (attempt >= 2 and np.all(np.abs(t) <= self.tol.max_logit)):
                self.last_scale, self.last_outputs = scale, outputs
                self.steepest = max(self.steepest, float(np.max(np.abs(t), initial=0.0)))
                self.sensitivity += float(np.sum(_sensitivity(t) ** 2))
                self.entries += len(t)
                return t / scale
            if attempt == MAX_RESCALES:
                bad = ~(np.abs(t) <= self.tol.max_logit)
                break
            ok = np.isfinite(t[bad])
            with np.errstate(divide="ignore", invalid="ignore"):
                factor = np.where(ok, TARGET_LOGIT / np.abs(np.where(ok, t[bad], 1.0)), 2.0 ** -10)
            scale[bad] *= factor
            t[bad] = self._logits(U[bad], Qc[bad], height[bad], background[bad], scale[bad])
            outputs[bad] = self.outputs
            self.rescued += int(bad.sum())
        raise ModelMismatchError(
            f"the black box is not multi-head attention with these heads: {int(bad.sum())} "
            f"single-head probe(s) imply attention weights outside (0, 1) after "
            f"{MAX_RESCALES} rescalings")

    def _shortened_logits(self, U, height, background, scale):
        """Raw logits c lengths u^T beta of probes [c lengths u; 0] (see
        :meth:`measure_shortening`): (logits (n,), scales (n,), lengths (n,), outputs (n,))."""
        n = len(U)
        scale = np.broadcast_to(np.asarray(scale, dtype=float), (n,)).copy()
        lengths = np.ones(n)
        zeros = np.zeros_like(U)
        t = self._logits(U, zeros, height, background, scale)
        outputs = self.outputs
        precise = min(PRECISE_LOGIT, self.tol.max_logit)
        for _ in range(MAX_RESCALES):
            bad = ~(np.abs(t) <= precise)
            if not bad.any():
                break
            ok = np.isfinite(t[bad])
            with np.errstate(divide="ignore", invalid="ignore"):
                factor = np.where(ok, 2.0 ** np.floor(np.log2(
                    TARGET_LOGIT / np.abs(np.where(ok, t[bad], 1.0)))), 2.0 ** -8)
            # the logit is c lengths u^T beta: shrink c (G above 1) first, then the row
            multiplier = split_scale(scale[bad])[0] * lengths[bad] * factor
            scale[bad] = np.maximum(multiplier, 1.0)
            lengths[bad] = np.minimum(multiplier, 1.0)
            m = lengths[bad]
            t[bad] = self._logits(m[:, None] * U[bad], zeros[bad], m * height[bad],
                                  m * background[bad], scale[bad])
            outputs[bad] = self.outputs
            self.rescued += int(bad.sum())
        bad = ~(np.abs(t) <= precise)
        if bad.any():
            raise ModelMismatchError(
                f"the black box is not multi-head attention with these heads: "
                f"{int(bad.sum())} bias probe(s) [c u; 0] imply attention weights outside "
                f"(0, 1) for rows shortened {MAX_RESCALES} times")
        return t, scale, lengths, outputs

    def measure_shortening(self, U, height, background, scale) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`measure` on the column q = 0 (biases: u^T b_h; offsets: u^T W_h (o_h - q_0)).

        The probe [c u; 0] has the logit c u^T beta, with no part that the column's s
        could shrink, and c >= 1 (:func:`single_head.split_scale`): a bias logit beyond
        PRECISE_LOGIT at c = 1 (a bias 10 |W| long: |u^T b_h| up to 30 on unit rows)
        would stay there through every rescaling of G. Here c is lowered first, then the
        row itself is shortened, by powers of two (exact), until the logit is precise.
        Returns (t (n,), lengths (n,)): t as :meth:`measure` returns it for the rows
        ``lengths[:, None] * U`` (their heights and backgrounds scale with them), the
        lengths powers of two <= 1.
        """
        t, scale, lengths, outputs = self._shortened_logits(U, height, background, scale)
        self.last_scale, self.last_outputs = scale, outputs
        self.steepest = max(self.steepest, float(np.max(np.abs(t), initial=0.0)))
        self.sensitivity += float(np.sum(_sensitivity(t) ** 2))
        self.entries += len(t)
        return t / scale, lengths


# ---------------------------------------------------------------------------
# stage 1: the heads' values from saturated crossings
# ---------------------------------------------------------------------------

class _HalfCircle:
    """Saturated probes on the half circle u(theta) = rho (cos theta u_0 + sin theta u_1)."""

    def __init__(self, oracle, v, q, u0, u1, tol: Tolerances = EXACT):
        self.oracle, self.v, self.q, self.u0, self.u1 = oracle, v, q, u0, u1
        self.tol = tol
        self.misfit = 0.0     # |g(2u) - 2 g(u)| / scale at the saturated radius: the noise
        self.rho = 1.0
        self.points = 0
        self.v_norm = safe_norm(v) + 1e-300

    def at(self, theta, rho):
        theta = np.asarray(theta, dtype=float)
        return rho * (np.cos(theta)[..., None] * self.u0 + np.sin(theta)[..., None] * self.u1)

    def gap(self, U):
        self.points += len(U)
        return _copy_gap(self.oracle, self.v, self.q, U)

    def find_radius(self, rng) -> None:
        """Smallest radius (x 4 steps) at which 3/4 of random points are saturated, x 8."""
        theta = rng.uniform(0.0, math.pi, SATURATION_POINTS)
        rho = 1.0
        for _ in range(SATURATION_TRIES):
            U = self.at(theta, rho)
            g = self.gap(np.concatenate([U, 2.0 * U]))
            one, two = g[:len(theta)], g[len(theta):]
            misfit = np.abs(two - 2.0 * one) / (np.abs(two) + rho * self.v_norm)
            if np.mean(misfit <= self.tol.saturation) >= 0.75:
                self.rho = 8.0 * rho
                if self.tol.noise > EPS:     # the noise, where every point is saturated
                    U = self.at(theta, self.rho)
                    g = self.gap(np.concatenate([U, 2.0 * U]))
                    one, two = g[:len(theta)], g[len(theta):]
                    # the median: one point left near a crossing is not the noise
                    self.misfit = float(np.median(np.abs(two - 2.0 * one)
                                                  / (np.abs(two) + self.rho * self.v_norm)))
                return
            rho *= 4.0
        raise RecoveryFailedError(
            "the black box never saturates along the probe circle (no radius up to "
            f"{rho:.1e} makes g(2u) = 2 g(u)): not softmax attention with finite logits")

    def plane_gradients(self, theta, rho):
        """In-plane gradients (a, b) = (u_0^T V_S, u_1^T V_S) at angles theta (n,).

        Five probes a point: rho u(theta -+ ETA) give (a, b); the same at 2 rho must give
        the same (a, b) (saturation: near a crossing the sigmoid's slope, multiplied by
        the radius, would show), and rho u(theta) must lie on the sinusoid (a crossing
        between theta - ETA and theta + ETA would put it off by half the jump).
        Returns (ab (n, 2), saturated (n,) bool).
        """
        theta = np.asarray(theta, dtype=float)
        n = len(theta)
        eta = self.tol.eta
        U = np.concatenate([self.at(theta - eta, rho), self.at(theta + eta, rho)])
        g = self.gap(np.concatenate([U, 2.0 * U, self.at(theta, rho)]))
        middle, g = g[4 * n:] / rho, g[:4 * n]
        sn = math.sin(2.0 * eta)
        ab = []
        for factor, (g1, g2) in ((1.0, (g[:n], g[n:2 * n])), (2.0, (g[2 * n:3 * n], g[3 * n:]))):
            g1, g2 = g1 / (factor * rho), g2 / (factor * rho)
            ab.append(np.column_stack([(g1 * np.sin(theta + eta) - g2 * np.sin(theta - eta)) / sn,
                                       (g2 * np.cos(theta - eta) - g1 * np.cos(theta + eta)) / sn]))
        scale = np.abs(ab[0]).sum(axis=1) + self.v_norm
        on_curve = np.abs(middle - np.cos(theta) * ab[0][:, 0] - np.sin(theta) * ab[0][:, 1])
        saturated = ((np.abs(ab[0] - ab[1]).max(axis=1) <= self.tol.plane_check * scale)
                     & (on_curve <= self.tol.on_curve * scale))
        return ab[0], saturated


def _sample(circle, theta, rho, lo, hi):
    """In-plane gradient at theta (nudged inside (lo, hi) until saturated)."""
    th = np.array(theta, dtype=float)
    ab, ok = circle.plane_gradients(th, rho)
    for k in range(4):
        if ok.all():
            break
        bad = ~ok
        frac = (0.31, 0.69, 0.17, 0.83)[k]
        th[bad] = lo[bad] + frac * (hi[bad] - lo[bad])
        ab[bad], ok[bad] = circle.plane_gradients(th[bad], rho)
    return th, ab, ok


def _adjacent_cells(theta, jumps) -> np.ndarray:
    """For every interval of the grid theta: the width of the narrower cell next to it
    (cells: the spans between bracketed crossings; the first and last cells join across
    theta = 0 and pi, which are antipodal)."""
    idx = np.flatnonzero(jumps)
    out = np.full(len(jumps), np.inf)
    if not len(idx):
        return out
    starts, ends = theta[idx], theta[idx + 1]
    cells = np.empty(len(idx) + 1)
    cells[1:-1] = starts[1:] - ends[:-1]
    cells[0] = cells[-1] = starts[0] + math.pi - ends[-1]
    out[idx] = np.minimum(cells[:-1], cells[1:])
    return out


def find_values(oracle: QueryAccess, v: np.ndarray, heads: int, rng: np.random.Generator,
                tol: Tolerances = EXACT, noise_floor: float | None = None):
    """The canonical heads' values v_h (H', d) from the gradient jumps along a saturated half circle.

    ``tol`` holds the thresholds for the answers' noise; with ``noise_floor`` (a
    forward pass in low precision) the noise is measured at the saturated radius
    (NOISE_MARGIN x the misfit of g(2u) = 2 g(u), at least the floor) and the
    thresholds follow it.
    Returns (values (H', d), info dict with the crossing brackets and conditioning;
    ``info["tolerances"]`` the thresholds used).
    """
    d = int(v.shape[0])
    if heads == 1:                       # one head at most: its value is v
        return v[None].copy(), {"crossings": 0, "smallest gap": math.pi, "sign misfit": 0.0,
                                "gradient step": 1.0, "circle queries": 0, "tolerances": tol}
    basis = haar_orthogonal(d, rng)
    q, u0, u1 = basis[:, 0], basis[:, 1], basis[:, 2]
    circle = _HalfCircle(oracle, v, q, u0, u1, tol)
    circle.find_radius(rng)
    if noise_floor is not None:
        noise = max(noise_floor, NOISE_MARGIN * circle.misfit)
        if noise > MAX_NOISE:
            raise RecoveryFailedError(
                f"saturated probes agree only to {noise:.1e} (relative): too noisy to "
                f"bracket the heads' crossings")
        tol = Tolerances.for_noise(noise)
        circle.tol = tol
    phi_ref = math.pi / (4.0 * max(heads, 1))
    rho = circle.rho * phi_ref / tol.min_gap * (RHO_NOISY if tol.noise > EPS else 1.0)
    v_plane = float(np.hypot(u0 @ v, u1 @ v)) + float(safe_norm(v)) * 1e-3

    # bracket the crossings: sample a grid, bisect every interval whose ends differ
    grid = np.linspace(0.0, math.pi, GRID_PER_HEAD * max(heads, 1) + 1)
    theta, ab, ok = _sample(circle, grid, rho, grid - 1e-3, grid + 1e-3)
    # a jump is measured against the gradients seen (the heads' values may cancel in v)
    jump_tol = tol.jump * max(v_plane, float(np.abs(ab).max(initial=0.0)))
    if not ok.all():
        raise RecoveryFailedError("probes on the half circle do not saturate: cannot bracket "
                                  "the heads' crossings")
    while True:
        jumps = safe_norm(np.diff(ab, axis=0), axis=1) > jump_tol
        widths = np.diff(theta)
        if jumps.sum() > heads:
            raise ModelMismatchError(
                f"the black box is not attention with at most {heads} heads: the saturated "
                f"probes change gradient at {int(jumps.sum())} separate angles")
        if jumps.sum() < heads:          # crossings may still share a bracket: split all
            split = jumps & (widths > tol.min_gap)
        else:                            # all found: narrow brackets beside narrow cells
            split = jumps & (widths > tol.min_gap) & (widths > BRACKET_FRACTION
                                                  * _adjacent_cells(theta, jumps))
        if not split.any():
            break
        idx = np.flatnonzero(split)
        th_new, ab_new, saturated = _sample(circle, 0.5 * (theta[idx] + theta[idx + 1]), rho,
                                            theta[idx], theta[idx + 1])
        if not saturated.any():          # nothing left that can be split
            break
        theta = np.concatenate([theta, th_new[saturated]])
        ab = np.concatenate([ab, ab_new[saturated]])
        order = np.argsort(theta)
        theta, ab = theta[order], ab[order]
    jumps = np.flatnonzero(safe_norm(np.diff(ab, axis=0), axis=1) > jump_tol)
    brackets = [(float(theta[i]), float(theta[i + 1])) for i in jumps]
    info = {"crossings": len(brackets), "radius": rho, "tolerances": tol}
    if not brackets:
        return np.zeros((0, d)), {**info, "smallest gap": math.pi, "sign misfit": 0.0,
                                  "gradient step": 1.0, "circle queries": circle.points}

    # full gradients of the cells between crossings (the last cell is v minus the first)
    # cell 0 holds theta = 0 and continues below it (its antipode is the last cell)
    cells = [(brackets[-1][1] - math.pi, brackets[0][0])]
    cells += [(brackets[i][1], brackets[i + 1][0]) for i in range(len(brackets) - 1)]
    mids = np.array([0.5 * (a + b) for a, b in cells])
    margins = np.array([0.5 * (b - a) for a, b in cells])
    smallest_gap = float(2.0 * margins.min())
    gradients, steps = [], []
    for mid, margin in zip(mids, margins):
        margin = max(margin, tol.min_gap / 4)
        rho_c = rho * max(1.0, 2.0 * tol.min_gap / margin)
        u = circle.at(mid, rho_c)
        fraction = STEP_FRACTION
        for _ in range(STEP_TRIES):      # the cone may be narrower off the plane: smaller steps
            delta = fraction * margin * rho_c
            w = rng.standard_normal(d)
            w /= safe_norm(w)
            U = np.vstack([u[None], u[None] + delta * np.eye(d), 2.0 * u[None],
                           u[None] + 3.0 * delta * w[None]])
            g = circle.gap(U)
            V = (g[1:d + 1] - g[0]) / delta
            scale_g = rho_c * (safe_norm(V) + circle.v_norm)
            checks = np.array([g[0] - u @ V, g[d + 1] - 2.0 * (u @ V),
                               g[d + 2] - (u + 3.0 * delta * w) @ V])
            limit = tol.check * max(1.0, 1e-4 / (fraction * margin))
            if tol.noise > EPS:     # the noise of d differences over the step, summed along u
                limit = max(limit, 30.0 * math.sqrt(d) * tol.noise / (fraction * margin))
            if np.max(np.abs(checks)) <= limit * scale_g:
                break
            fraction /= 16.0
        else:
            raise RecoveryFailedError(
                "a saturated cell's gradient failed its checks (a crossing closer than "
                f"{tol.min_gap:.0e} rad or logits that do not saturate): values not separated")
        gradients.append(V)
        steps.append(fraction * margin)
    gradients.append(v - gradients[0])
    G = np.array(gradients)
    D = np.diff(G, axis=0)                                   # +- v_h, (H', d)
    signs = np.linalg.lstsq(D.T, v, rcond=None)[0]
    rounded = np.where(signs >= 0, 1.0, -1.0)
    misfit = float(safe_norm(D.T @ rounded - v) / max(safe_norm(v), 1e-300))
    if np.max(np.abs(signs - rounded)) > tol.sign or misfit > tol.sign:
        raise RecoveryFailedError(
            "the gradient jumps along the half circle do not add up to v with signs +-1 "
            f"(largest sign deviation {np.max(np.abs(signs - rounded)):.1e}): a head whose "
            "logits never cross (W_h q = 0) or crossings that were not separated")
    values = rounded[:, None] * D
    info.update({"smallest gap": smallest_gap, "sign misfit": misfit,
                 "gradient step": float(min(steps)), "circle queries": circle.points})
    return values, info


# ---------------------------------------------------------------------------
# stages 2 and 3: query spaces and isolation columns
# ---------------------------------------------------------------------------

def _rows_in(space: np.ndarray, value: np.ndarray, count: int, rng) -> np.ndarray:
    """``count`` orthonormal rows (count, d) in the column span of ``space`` (d, k), each with
    the same height |u^T value| (the largest they can share)."""
    inner = space.T @ value
    if not np.any(inner):
        raise RecoveryFailedError("a head's value lies in the span of the other heads' values: "
                                  "no row sees that head alone")
    basis = random_probe_basis(inner, rng)[:, :count]
    return (space @ basis).T


def query_space(meter: LogitMeter, values, h, columns, rank, rng, biases=False):
    """Orthonormal basis P_h (d, r_h) of span(W_h^T) from rows in R_h; and its conditioning.

    The measured rows beyond the rank are noise: their share of the spectrum is
    ``info["residual"]`` (the error bar's base where noisy rows were held to a given
    rank, ``info["forced"]``).

    ``biases``: every logit also holds u^T b_h (t_h = u^T (W_h q + b_h)), measured first
    on the column q = 0 (a probe [c u; 0] per row at c = 1, then one at the row's own
    scale c ~ 1 / |u^T b_h|, kept as ``info["bias block"]``) and taken off:
    T = t - u^T b_h / s. ``info["bias"]`` holds u^T b_h of every row."""
    d, H = columns.shape[0], len(values)
    others = np.delete(values, h, axis=0)
    space = null_space(others) if len(others) else np.eye(d)
    room = space.shape[1]
    count = min(room, (rank + 1) if rank is not None else max(2, -(-d // max(H, 1)) + 1))
    forced = False           # noisy rows held to the given rank: their residual is error
    while True:
        U = _rows_in(space, values[h], count, rng)
        height = U @ values[h]
        if biases:      # u^T b_h on the column q = 0 (the logit is c u^T b_h)
            beta, lengths = meter.measure_shortening(U, height, np.zeros(count), 1.0)
            beta = beta * split_scale(meter.last_scale)[1] / lengths
            peak = float(np.max(np.abs(beta)))
            shortening = max(1.0, peak / BIAS_LOGIT)
            if peak > BIAS_LOGIT:
                # a bias logit near saturation would cost every probe of these rows its
                # precision (a(1 - a) ~ e^-|u^T b_h|): shorter rows (one length for all,
                # which keeps the rows' spread)
                U, height = U * (BIAS_LOGIT / peak), height * (BIAS_LOGIT / peak)
                beta = beta * (BIAS_LOGIT / peak)
            # every row's bias again at its own scale c ~ BIAS_LOGIT / |u^T b_h|: the
            # logit's rounding shrinks by c, and it is taken off every entry of the row
            # (an error common to the row does not average out over its d columns)
            grow = np.clip(BIAS_LOGIT / np.maximum(np.abs(beta), 1e-300), 1.0, BIAS_GROWTH)
            beta = meter.measure(U, np.zeros_like(U), height, np.zeros(count), grow)
            beta = beta * split_scale(meter.last_scale)[1]
            meter.rescued += count
            bias_block = Block(h, U, np.zeros((d, 1)), meter.last_scale, meter.last_outputs)
        rows = np.repeat(U, d, axis=0)
        cols = np.tile(columns.T, (count, 1))
        hts, bg = np.repeat(height, d), np.zeros(count * d)
        scale = meter.scale_for(rows, cols, hts, bg, rng)
        T = meter.measure(rows, cols, hts, bg, scale)
        if biases:
            total = T * meter.last_scale                    # the logits measured
            T = T - np.repeat(beta, d) / split_scale(meter.last_scale)[1]
            # the W part is read beside the bias logit c u^T b_h: each logit's rounding
            # is this many times larger against it than against a logit of W alone
            dilution = max(1.0, safe_rms(total) / max(safe_rms(T * meter.last_scale), 1e-300))
        T = T.reshape(count, d) @ columns.T                                 # rows u^T W_h
        block = Block(h, U, columns, meter.last_scale, meter.last_outputs)
        s = np.linalg.svd(T, compute_uv=False)
        rank_tol = max(meter.tol.rank, BIASED_RANK_TOL) if biases else meter.tol.rank
        found = int(np.sum(s > rank_tol * s[0])) if s[0] > 0 else 0
        if meter.tol.noise > EPS and s[0] > 0 and len(s) > 1:
            found = _rank_at_gap(s, rank_tol)
            if (rank is not None and rank < len(s) and found != rank
                    and s[rank] <= GIVEN_RANK_FLOOR * s[0]):
                found, forced = rank, True   # the given rank, unless far above the noise
        if found < count or count == room:
            break
        if rank is not None:
            raise ModelMismatchError(
                f"head {h} has rank above the given {rank} ({count} independent rows)")
        count = min(room, 2 * count)
    if found == count and count == room and room < d:
        raise RecoveryFailedError(f"head {h}: rank {found} fills the rows that see it alone")
    _, sv, Vt = np.linalg.svd(T, full_matrices=False)
    spread = float(sv[0] / sv[found - 1]) if found else 1.0
    residual = float(sv[found] / sv[0]) if 0 < found < len(sv) else 0.0
    info = {"rows": count, "rank": found, "spread": spread, "residual": residual,
            "forced": forced,
            "height": float(np.min(np.abs(height)) / safe_norm(values[h]))}
    if biases:
        info["bias"], info["bias block"], info["row logits"] = beta, bias_block, T
        info["dilution"], info["shortening"] = dilution, shortening
    return Vt[:found].T, block, info


def _rank_at_gap(s: np.ndarray, floor: float) -> int:
    """Rank of noisy rows with singular values ``s`` (descending): where the steepest drop
    (>= RANK_GAP, down to below ``floor`` x s[0]) is; none: every row counts.

    A threshold alone counts noise that the logit conditioning lifts above it; the drop
    from the last signal value to the noise is what sets the rank apart."""
    ratios = s[:-1] / np.maximum(s[1:], 1e-300 * s[0])
    i = int(np.argmax(ratios))
    if ratios[i] >= RANK_GAP and s[i + 1] <= floor * s[0]:
        return i + 1
    return len(s)


def space_from_logits(block: Block, T: np.ndarray, rank: int) -> np.ndarray:
    """P_h (d, r_h): orthonormal basis of the span of the measured rows u^T W_h = T C^T."""
    _, _, Vt = np.linalg.svd(T @ block.cols.T, full_matrices=False)
    return Vt[:rank].T


def matrix_from_logits(block: Block, T: np.ndarray, P: np.ndarray) -> np.ndarray:
    """W_h = Y (P^T Z)^{-1} P^T with Y = W_h Z = U T (U the orthogonal rows of the block).

    A block whose last column is 0 (biases: probes translated by o_h, where head h keeps
    the offset u^T W_h (o_h - q_0)) measured that offset alone there: t_k0 = off_k / s_k0,
    and every entry t_kj = u_k^T W_h z_j + off_k / s_kj loses it first.
    """
    Z, U = block.cols, block.rows
    if getattr(block, "offset_column", False):
        s = split_scale(block.scale)[1]
        T = T[:, :-1] - T[:, -1:] * s[:, -1:] / s[:, :-1]
        Z = Z[:, :-1]
    lengths = getattr(block, "row_lengths", None)
    if lengths is not None:
        # rows lengths_k u_k (shortened by powers of two: exact): u_k^T W_h z = t_k / lengths_k
        U, T = U / lengths[:, None], T / lengths[:, None]
    return (U.T @ T) @ np.linalg.solve(P.T @ Z, P.T)


def common_root(spaces, row_list, bias_list, dim):
    """The common root q_0 (d,) of the heads' biased queries, W_h q_0 + b_h = 0 for every h.

    With b_h = W_h p_h (a real layer: b_h = W_k,h^T b_q,h lies in W_h's column space), a
    measured row y = W_h^T u has u^T b_h = y^T p_h = (P_h^T y)^T kappa_h, kappa_h = P_h^T p_h:
    r_h + 1 rows give kappa_h by least squares. q_0 solves P_h^T q_0 = -kappa_h for all h
    (sum_h r_h <= d equations: minimum norm). Returns (q_0, misfit, kappas): the largest
    relative residual of the bias fits, in token units |A kappa - beta| / |A| (a bias outside
    W_h's column space shows there).
    """
    kappas, misfit = [], 0.0
    for P, Y, beta in zip(spaces, row_list, bias_list):
        A = Y @ P
        kappa = np.linalg.lstsq(A, beta, rcond=None)[0]
        kappas.append(kappa)
        # in token units: how far the measured biases are from any shift p_h
        misfit = max(misfit, float(safe_norm(A @ kappa - beta))
                     / max(float(np.linalg.norm(A, 2)), 1e-300))
    if not spaces:
        return np.zeros(dim), misfit, kappas
    stack = np.hstack(spaces).T                              # (sum r_h, d)
    root = np.linalg.lstsq(stack, -np.concatenate(kappas), rcond=None)[0]
    return root, misfit, kappas


def kappas_from_offsets(blocks, values, W, spaces, kappas) -> list:
    """kappa_h (r_h,) of every head, from the offset columns of all isolation blocks at once.

    Every block ran translated by the same origin o (the first estimate of q_0), where
    head g's query is W_g o + b_g = W_g P_g a_g, a_g = P_g^T o + kappa_g: within the
    estimate's error of 0, so the offset probes [o + c u; o] see no bias, and their
    answers c sum_g c_g(u) sigma(c u^T W_g P_g a_g) give every a_g as precisely as logits
    of W alone (Gauss-Newton from ``kappas``; the logits are tiny, so two steps reach
    the rounding). The query-space rows give kappa_h only to their own precision, read
    beside bias logits |b_h| / |W_h| times larger than their W part, and at o every head
    then keeps a query of that error times |q_0|: each isolation block's background
    (the other heads) carries it, amplified at its steep entries (|b_h| = 10 |W_h|,
    d = 32, H = 4: heads at 1e-8). One head's offsets cannot be fitted alone: the
    other heads' heights are as large in its rows. Returns kappas in the bases ``spaces``.
    """
    origin = blocks[0].origin
    A = [Wg @ P for Wg, P in zip(W, spaces)]                 # W_g P_g, (d, r_g)
    a = np.concatenate([P.T @ origin + k for P, k in zip(spaces, kappas)])
    rows = np.vstack([b.rows for b in blocks])               # (H d, d)
    c = np.concatenate([split_scale(b.scale[:, -1])[0] for b in blocks])
    out = np.concatenate([b.outputs[:, -1] for b in blocks])
    heights = rows @ values.T                                # (H d, H)
    RA = [rows @ Ag for Ag in A]                             # (H d, r_g)
    cuts = np.cumsum([Ag.shape[1] for Ag in A])[:-1]
    for _ in range(3):
        x = [c * (R @ ag) for R, ag in zip(RA, np.split(a, cuts))]
        resid = out - c * sum(heights[:, g] * expit(x[g]) for g in range(len(A)))
        J = np.hstack([(c * c * heights[:, g] * expit(x[g]) * expit(-x[g]))[:, None] * RA[g]
                       for g in range(len(A))])
        step = np.linalg.lstsq(J, resid, rcond=None)[0]
        if not np.all(np.isfinite(step)):
            return kappas
        a = a + step
    return [ag - P.T @ origin for ag, P in zip(np.split(a, cuts), spaces)]


def common_root_of(spaces, kappas, dim) -> np.ndarray:
    """q_0 (d,): the minimum-norm token with P_h^T q_0 = -kappa_h for every head."""
    if not spaces:
        return np.zeros(dim)
    return np.linalg.lstsq(np.hstack(spaces).T, -np.concatenate(kappas), rcond=None)[0]


def query_offsets(W, spaces, kappas, origin) -> np.ndarray:
    """W_g o + b_g = W_g P_g (P_g^T o + kappa_g) for every head, shape (H, d).

    The same as W_g (o - q_0), but computed without q_0: q_0 can be long (MiniLM layer 0:
    176), and W_g's small error times q_0 would swamp these small vectors."""
    return np.array([Wg @ (P @ (P.T @ origin + k)) for Wg, P, k in zip(W, spaces, kappas)])


class _Translated:
    """The oracle seen from a translated origin (biases): answers f(X + 1 o^T) - const.

    With o = q_0 (every head's biased query W_h x + b_h vanishes there) and const =
    c + v^T q_0 this is multi-head attention without biases: the translation adds the
    same b_h^T-free term to every score of a sequence, which the softmax cancels.
    """

    def __init__(self, base, origin, const):
        self.base, self.origin, self.const = base, np.asarray(origin, dtype=float), float(const)

    def query(self, X):
        return self.base.query(np.asarray(X, dtype=np.float64) + self.origin) - self.const

    def __getattr__(self, name):
        return getattr(self.base, name)


def head_matrix(meter: LogitMeter, v, values, spaces, h, rng, offset_column=False):
    """W_h (d, d) from d rows against r_h columns of the isolation space I_h
    (``offset_column``: one more column, 0, see :func:`matrix_from_logits`)."""
    d = v.shape[0]
    P = spaces[h]
    r = P.shape[1]
    if r == 0:
        return np.zeros((d, d)), 1.0
    others = [spaces[g] for g in range(len(spaces)) if g != h and spaces[g].shape[1]]
    iso = null_space(np.hstack(others).T) if others else np.eye(d)
    if iso.shape[1] < r:
        raise RecoveryFailedError(
            f"head {h}: the other heads' query spaces leave {iso.shape[1]} < r = {r} "
            "dimensions (sum of ranks > d): no column isolates the head")
    _, sv, Vt = np.linalg.svd(P.T @ iso)
    Z = iso @ Vt[:r].T                               # (d, r): the best-isolated columns
    separation = float(sv[r - 1])
    if separation < MIN_SEPARATION:
        raise RecoveryFailedError(f"head {h}: its query space lies within the others' "
                                  f"(separation {separation:.1e})")
    U = random_probe_basis(values[h], rng)           # (d, d), |u_k^T v_h| = |v_h| / sqrt(d)
    if offset_column:
        Z = np.column_stack([Z, np.zeros(d)])
        r += 1
    rows = np.repeat(U.T, r, axis=0)
    cols = np.tile(Z.T, (d, 1))
    height = rows @ values[h]
    background = 0.5 * (rows @ v - height)
    scale = meter.scale_for(rows, cols, height, background, rng)
    block_rows, lengths = U.T, None
    if offset_column:
        # from q_0 nothing but W_h's part is left in these logits, and it spreads more
        # widely over the d random rows than SCOUT entries show: at the scouts' peak
        # TARGET_LOGIT, 1,230 of MiniLM layer 1's 152,064 isolation entries went beyond
        # PRECISE_LOGIT and were measured again (1.1017x the floor); at half of it, in 4
        # real heads of 4 layers through a 128-dim subspace, 0 .. 3 of 16,896 (from
        # 0 .. 242), the heads' errors unchanged
        scale *= ISOLATION_TARGET
        T, scales, outputs, lengths = _offset_first(meter, rows, cols, height, background,
                                                    scale, d, r)
        block_rows = lengths[:, None] * U.T
    else:
        T = meter.measure(rows, cols, height, background, scale).reshape(d, r)
        scales, outputs = meter.last_scale, meter.last_outputs
    block = Block(h, block_rows, Z, scales, outputs)
    block.offset_column, block.row_lengths = offset_column, lengths
    return matrix_from_logits(block, T, P), block, separation


def _offset_first(meter: LogitMeter, rows, cols, height, background, scale: float, d: int,
                  r: int):
    """An isolation block with an offset column (biases), the offsets measured first.

    Entry (k, j) has the logit G u_k^T W_h z_j + c u_k^T w_h (w_h = W_h (o_h - q_0), G = c s):
    the offset part is common to row k and grows with c, not with the columns. One scale
    for the whole block (set by a few random entries) leaves the rows whose offset is
    large beyond PRECISE_LOGIT, each entry measured again smaller (MiniLM layer 5: 2,505
    of 152,064 isolation entries, 3,847 probes, when the block ran from o_h rather than
    q_0). So the offset column (z = 0, the last) is measured first, at the block's
    scale, and a row whose offset logit there exceeds
    PRECISE_LOGIT / 2 has its other entries measured at the scale that brings the offset
    to TARGET_LOGIT (c shrinks with G above G = 1). An offset still beyond the precise
    range at c = 1 (a bias 10 |W_h| long) shortens its row by a power of two
    (:meth:`LogitMeter.measure_shortening`); that row's entries keep c = 1 and the
    largest s <= 1 that keeps their W part at the block's. Same probes, two batches.
    Returns (T (d, r), scales, outputs, row lengths (d,)) in the block's entry order
    (row-major, offset column last), T for the shortened rows.
    """
    at = np.arange(d * r).reshape(d, r)
    last, rest = at[:, -1], at[:, :-1].ravel()
    T = np.empty((d, r))
    scales, outputs = np.empty(d * r), np.empty(d * r)
    T[:, -1], lengths = meter.measure_shortening(rows[last], height[last], background[last],
                                                 scale)
    scales[last], outputs[last] = meter.last_scale, meter.last_outputs
    each = np.repeat(lengths, r)
    rows, height, background = each[:, None] * rows, each * height, each * background
    # t_k0 = u_k^T w_h / s: the offset u_k^T w_h, whose logit at scale G is c(G) u_k^T w_h.
    # A row whose offset takes more than half of PRECISE_LOGIT at G is brought to
    # TARGET_LOGIT (c(G_k) |u_k^T w_h| in [1, 2)); the others keep G (a smaller scale
    # would only shrink their W part)
    offset = np.abs(T[:, -1] * split_scale(scales[last])[1])
    at_block_scale = split_scale(scale)[0] * offset
    with np.errstate(divide="ignore", invalid="ignore"):
        row_scale = np.where(at_block_scale > 0.5 * PRECISE_LOGIT,
                             np.minimum(scale, TARGET_LOGIT / offset), scale)
    row_scale = np.where(np.isfinite(row_scale) & (row_scale > 0), row_scale, scale)
    # shortened rows (their offset at c = 1 is within [TARGET / 2, TARGET]): c = 1, and
    # s = G / lengths up to 1 gives their W part the block's logit
    row_scale = np.where(lengths < 1.0, np.minimum(1.0, scale / lengths), row_scale)
    T[:, :-1] = meter.measure(rows[rest], cols[rest], height[rest], background[rest],
                              np.repeat(row_scale, r - 1)).reshape(d, r - 1)
    scales[rest], outputs[rest] = meter.last_scale, meter.last_outputs
    return T, scales, outputs, lengths


def exact_heights(oracle: QueryAccess, v, values, W, rng) -> np.ndarray:
    """The heads' values again, each height measured alone in one saturated query.

    For a row u_k and head j, the column q_kj solves u_k^T W_h q = SATURATED (2 [h = j] - 1)
    for every head h with the current W (minimum norm): at those logits every sigmoid
    is 0 or 1 to e^-40, so g = c_j(u_k) exactly, whatever small error W has.
    Returns values (H, d) from H d queries.
    """
    d, H = v.shape[0], len(values)
    U = haar_orthogonal(d, rng)
    A = np.stack([U.T @ Wh for Wh in W], axis=1)            # rows W_h^T u_k: (d, H, d)
    target = SATURATED * (2.0 * np.eye(H) - 1.0)             # (j, h)
    coef = np.linalg.solve(A @ A.transpose(0, 2, 1), np.broadcast_to(target.T, (d, H, H)))
    Qk = np.einsum("khe,khj->kje", A, coef)                  # q_kj: (d, H, d)
    alpha = np.maximum(1.0, 1e3 * safe_norm(Qk, axis=2))  # |u| large beside |q|
    first = (U.T[:, None, :] * alpha[..., None] + Qk / alpha[..., None]).reshape(-1, d)
    last = (Qk / alpha[..., None]).reshape(-1, d)
    g = _pair_outputs(oracle, first, last) - last @ v
    heights = (g / alpha.reshape(-1)).reshape(d, H)          # c_j(u_k)
    return (U @ heights).T


# ---------------------------------------------------------------------------
# the learner
# ---------------------------------------------------------------------------

def extract_multi_head_low_rank(oracle: QueryAccess, heads: int | None = None,
                                rank: int | None = None, *,
                                seed=None, progress=None,
                                verify_tolerance: float = DEFAULT_VERIFY_TOLERANCE,
                                output_dtype: str | None = None, decimals: int | None = None,
                                biases: bool = False) -> ExtractionResult:
    """Recover the canonical heads of multi-head attention with low-rank heads.

    Parameters
    ----------
    oracle : Oracle
        Door to the black box; ``oracle.dim`` is the token width d.
    heads : int
        Number of heads H (an upper bound on the canonical heads).
    rank : int, optional
        Rank r of every head (checked with one extra row per head); found per head if
        not given. The ranks must satisfy sum_h r_h <= d.
    seed : int, optional
        Seed of the learner's random choices and of the held-out verification.
    progress : callable, optional
        Called with a short text at the start of every stage.
    verify_tolerance : float
        Largest held-out relative output error accepted (rounded or low-precision
        answers add their measured noise and the error bar).
    output_dtype : {"float32", "bfloat16", "float16"}, optional
        The black box runs its forward pass in this dtype: the thresholds follow the
        noise measured on saturated probes (see :class:`Tolerances`), the error bar is
        LOW_PRECISION_BAR x that noise x row spread / query-space separation
        (``report.details["error bar"]``).
    decimals : int, optional
        The answers are rounded to this many decimals. Without either option, answers
        rounded to float16/float32 or to k <= 12 decimals are detected (and said in the
        report's notes).
    biases : bool
        The layer has query, value and output biases (a deployed layer):
        f(X) = sum_h softmax(X (W_h x_N + b_h))^T X v_h + c with b_h in W_h's column
        space. c from f([0]); each row of the query-space stage gains two probes on the
        column q = 0 (u^T b_h, the second at the row's own scale); the biases give the
        common root q_0 of the heads' queries (W_h q_0 + b_h = 0), and the isolation
        columns run translated to where the other heads have no biases.
        Floor sum_h (d + r_h (2d - r_h) + r_h) + 1 (docs/algorithms.md, "Biases").

    Returns
    -------
    ExtractionResult
        ``model`` a :class:`MultiHeadAttention` with W (H', d, d), v (H', d), H' <= H the
        canonical heads (with ``biases`` a :class:`BiasedMultiHeadAttention`, also b
        (H', d) and c); the report gives the queries against the floor
        sum_h (d + r_h (2d - r_h)) and the multi-head paper's 4 H d^2 - 2 H + 1, and the conditioning.

    Raises
    ------
    InputError
        heads < 1 or a rank outside 1..d.
    NotIdentifiableError
        v = sum_h v_h = 0 and no output ever changes.
    RecoveryFailedError
        The design cannot separate the heads (ranks summing above d, values linearly
        dependent, crossings closer than 1e-5 rad); nothing wrong is returned.
    ModelMismatchError
        The black box is not such a model (held-out verification, or probes that no
        such model can answer).

    A refusal names ``output_dtype`` / ``decimals`` in its message (the precision
    detected or stated, and what to state).
    """
    precision: list[OutputPrecision] = []       # filled once the first answers are in
    try:
        return _extract_low_rank_heads(oracle, heads, rank, seed, progress, verify_tolerance,
                                       output_dtype, decimals, precision, biases)
    except (RecoveryFailedError, ModelMismatchError) as exc:
        name_the_options(exc, precision[0] if precision else None)
        raise


def _no_heads_found(precision) -> AttnExtractError:
    """Why a half circle with no crossing is refused (v = sum_h v_h is nonzero)."""
    # the box has a head: a half circle with no crossing means the answers hid them
    # (bfloat16 answers detected as float16 were judged at float16's rounding and showed
    # none), not "0 heads"
    if precision.exact:
        return ModelMismatchError(
            "the black box is not multi-head attention with low-rank heads: its "
            "single-token answers v = sum_h v_h are nonzero, yet no head's logit "
            "crosses zero on the saturated half circle")
    return RecoveryFailedError(
        f"no head's crossing could be told from the rounding on the saturated half "
        f"circle, although the single-token answers (v = sum_h v_h nonzero) show the "
        f"box has heads: answers in {precision.name} "
        f"({'stated' if precision.stated else 'detected'}, relative "
        f"{precision.relative:.1e}) are too coarse for this learner here, and the black "
        f"box was not judged; if it runs its forward pass in a coarser precision than "
        f"detected, state it with --output-dtype float32|bfloat16 (API: output_dtype=); "
        f"float32 or finer answers are needed")


def _isolation_stage(oracle, meter: LogitMeter, v, values, spaces, origins, const, tol,
                     rng, biases: bool):
    """Stage 3: W_h from each head's isolation columns (from q_0 with biases).

    Returns the (H, d, d) W, the head separations, the stored blocks and the meter (with
    biases a new meter a head, carrying the counts of the last)."""
    H, d = len(values), oracle.dim
    W, separations, column_blocks = np.zeros((H, d, d)), [], []
    for h in range(H):
        if biases:
            kept = meter.rescued, meter.steepest, meter.sensitivity, meter.entries
            meter = LogitMeter(_Translated(oracle, origins[h], const + v @ origins[h]), v, tol)
            meter.rescued, meter.steepest, meter.sensitivity, meter.entries = kept
        W[h], block, sep = head_matrix(meter, v, values, spaces, h, rng, offset_column=biases)
        block.origin = origins[h]
        column_blocks.append(block)
        separations.append(sep)
    return W, separations, column_blocks, meter


def _biased_pass(v, values, W, spaces, kappas, space_blocks, space_info, column_blocks,
                 ranks, d):
    """One re-solve of every stored block with biases; the root q_0 moves with the heads.

    Returns the new W, query spaces, offsets kappa_h (kappa_h = P_h^T p_h: one basis),
    root and the root fit's misfit, or None when a logit is not finite."""
    at_zero = query_offsets(W, spaces, kappas, np.zeros(d))      # the biases b_g
    betas = [resolve(i["bias block"], v, values, W, at_zero)[:, 0]
             * split_scale(i["bias block"].scale[:, 0])[1] for i in space_info]
    logits = [resolve(b, v, values, W, at_zero) - beta[:, None]
              / split_scale(b.scale)[1] for b, beta in zip(space_blocks, betas)]
    if not all(np.all(np.isfinite(T)) for T in logits):
        return None       # answers no H low-rank heads give: verification refuses
    new_spaces = [space_from_logits(b, T, r) for b, T, r in zip(space_blocks, logits, ranks)]
    root, root_misfit, new_kappas = common_root(
        new_spaces, [T @ b.cols.T for b, T in zip(space_blocks, logits)], betas, d)
    column_logits = [resolve(b, v, values, W, query_offsets(W, spaces, kappas, b.origin))
                     for b in column_blocks]
    new_W = np.array([matrix_from_logits(b, T, P) for b, T, P in
                      zip(column_blocks, column_logits, new_spaces)])
    if np.all(np.isfinite(new_W)) and all(np.all(np.isfinite(T)) for T in column_logits):
        new_kappas = kappas_from_offsets(column_blocks, values, new_W, new_spaces, new_kappas)
        root = common_root_of(new_spaces, new_kappas, d)
    return new_W, new_spaces, new_kappas, root, root_misfit


def _refine_heads(v, values, W, spaces, kappas, root, root_misfit, space_blocks,
                  space_info, column_blocks, ranks, biases: bool):
    """Stage 4's re-solves: every stored block solved again with the other heads' sigmoids
    predicted from the current estimates (no new queries), until W stops changing.

    Returns W, spaces, kappas, root, root_misfit and W's relative change at each pass."""
    d = W.shape[1]
    changes: list[float] = []
    for _ in range(BIASED_REFINE_ITERATIONS if biases else REFINE_ITERATIONS):
        if biases:
            step = _biased_pass(v, values, W, spaces, kappas, space_blocks, space_info,
                                column_blocks, ranks, d)
            if step is None:
                break
            new_W, spaces, kappas, root, root_misfit = step
        else:
            logits = [resolve(b, v, values, W) for b in space_blocks]
            if not all(np.all(np.isfinite(T)) for T in logits):
                break       # answers no H low-rank heads give: verification refuses
            new_spaces = [space_from_logits(b, T, r)
                          for b, T, r in zip(space_blocks, logits, ranks)]
            new_W = np.array([matrix_from_logits(b, resolve(b, v, values, W), P)
                              for b, P in zip(column_blocks, new_spaces)])
        if not np.all(np.isfinite(new_W)):
            break
        change = float(np.max(safe_norm(new_W - W, axis=(1, 2))
                              / np.maximum(safe_norm(W, axis=(1, 2)), 1e-300)))
        changes.append(change)
        W = new_W
        if change < 1e-14:
            break
        if biases and len(changes) >= 2 and change < 1e-10 and change > 0.5 * changes[-2]:
            break       # at the measurements' rounding: more passes change nothing
    return W, spaces, kappas, root, root_misfit, changes


def _error_bar(value_info, value_sep, space_info, separations, changes, meter: LogitMeter,
               precision, tol, verify_tolerance, biases: bool, H: int) -> dict:
    """The predicted parameter error (and the first pass's) from the measured conditioning.

    Returns a dict: predicted, first_pass, verify_tolerance (widened for low precision),
    residual, bias_factors, and the conditioning numbers spread, min_sep, min_height."""
    spread = max((i["spread"] for i in space_info), default=1.0)
    min_sep = min(separations, default=1.0)
    min_height = min((i["height"] for i in space_info), default=1.0)
    # first pass: value errors (finite-difference step) leak through the heights in R_h;
    # after the exact heights only the rounding of the logits is left, amplified by the
    # spread of the measured rows and divided by the head separation
    value_error = EPS / max(value_info.get("gradient step", 1.0), EPS)
    first_pass = (value_error / max(value_sep, EPS) + EPS / max(min_height, EPS)) * spread / min_sep
    predicted = EPS * spread / min_sep if changes else first_pass
    # a kept entry at logit t is 1 / (a (1 - a)) = 4 cosh^2(t / 2) times as sensitive to
    # the answer's rounding and to the other heads' predicted background: the bar grows
    # with the entries' RMS sensitivity over that of a logit TARGET_LOGIT (MiniLM layer
    # 5, seed 0, before PRECISE_LOGIT: one entry at 11.9 among 12,672 of head 9's block
    # set its W_h error, 44x the bar that ignored it)
    steepness = (math.sqrt(meter.sensitivity / max(meter.entries, 1))
                 / float(_sensitivity(TARGET_LOGIT)))
    predicted, first_pass = predicted * max(1.0, steepness), first_pass * max(1.0, steepness)
    residual = max((i["residual"] for i in space_info), default=0.0)
    if not precision.exact:
        # the error bar from what was measured: the noise of the saturated probes (several
        # heads), else or where rows were held to the given rank the residual of the
        # extra query-space rows
        forced = any(i["forced"] for i in space_info)
        measured = tol.noise if (H > 1 and not forced) else max(tol.noise, residual)
        first_pass = max(first_pass, LOW_PRECISION_BAR * measured * spread / min_sep)
        predicted = max(predicted, LOW_PRECISION_BAR * measured * spread / min_sep)
        verify_tolerance = max(verify_tolerance, min(MAX_VERIFY_NOISY, 30.0 * max(
            tol.noise, precision.relative) + 2.0 * predicted))
    bias_factors = {}
    if biases and H:
        # the query-space rows read u^T W_h q beside u^T b_h (|b_h| = 10 |W_h|, d = 16: a W
        # part 1/50 .. 1/150 of the logit), on rows shortened until |u^T b_h| <= BIAS_LOGIT
        # (heights as much smaller): their rounding grows by both ratios. The isolation
        # blocks run from q_0 and take their offsets from their own probes
        # (kappas_from_offsets): they add no factor of their own (MiniLM layer 0, |q_0| =
        # 176: heads within 6.2e-11 against 3.6e-11 without either factor)
        dilution = max(i["dilution"] for i in space_info)
        shortening = max(i["shortening"] for i in space_info)
        bias_factors = {"dilution": dilution, "shortening": shortening}
        factor = BIAS_BAR * dilution * shortening
        predicted, first_pass = predicted * factor, first_pass * factor
    return {"predicted": predicted, "first_pass": first_pass,
            "verify_tolerance": verify_tolerance, "residual": residual,
            "bias_factors": bias_factors, "spread": spread, "min_sep": min_sep,
            "min_height": min_height}


def _low_rank_report(model, verification, counts: dict, bar: dict, value_info, value_sep,
                     changes, precision, tol, rescued: int, biases: bool, root, root_misfit,
                     heads: int, ranks, timing: tuple) -> Report:
    """The report: queries by stage, floor, conditioning, error bar and verification.

    ``counts``: queries by stage ("values", "query spaces", "isolation", "heights",
    "recovery", "verification", "total") and the "floor"; ``bar``: :func:`_error_bar`'s
    dict with the steepest logit kept; ``timing``: (seconds, black-box seconds)."""
    d, H = model.dim, len(ranks)
    recovery, n_verify, floor = counts["recovery"], counts["verification"], counts["floor"]
    predicted, first_pass, residual = bar["predicted"], bar["first_pass"], bar["residual"]
    spread, min_sep, min_height = bar["spread"], bar["min_sep"], bar["min_height"]
    bias_factors = bar["bias_factors"]
    paper = paper_two_count(d, int(heads))
    details = {
        "method": "saturated crossings (values), single-head rows (query spaces), "
                  "isolation columns (W_h)",
        "heads": H,
        "ranks": ranks,
        "recovery queries": recovery,
        "floor": f"sum_h (d + r_h (2d - r_h)) = {floor}; recovery {recovery / floor:.3f}x",
        "multi-head paper's count": f"4 H d^2 - 2 H + 1 = {paper}; recovery {recovery / paper:.4f}x",
        "conditioning": (f"smallest crossing gap {value_info.get('smallest gap', math.pi):.2e} rad, "
                         f"value separation {value_sep:.2e}, smallest height in R_h "
                         f"{min_height:.2e}, row spread {spread:.2e}, query-space "
                         f"separation {min_sep:.2e}"),
        "predicted error": (f"{predicted:.1e} (relative, parameters; first pass "
                            f"{first_pass:.1e})"),
        "refinement": ("changes " + ", ".join(f"{c:.1e}" for c in changes)) if changes else "none",
        "output precision": precision.name,
    }
    if not precision.exact:       # a bar from measured noise (float64: the prediction only)
        details["error bar"] = float(predicted)
    # "(rescaled)": scout and rescaled probes, already counted in "query spaces" and "isolation"
    breakdown = {"values": d + counts["values"], "query spaces": counts["query spaces"],
                 "isolation": counts["isolation"], "heights": counts["heights"],
                 "(rescaled)": rescued,
                 "recovery": recovery, "verification": n_verify}
    if biases:
        breakdown = {"constant": 1, **breakdown}
        details["biases"] = (f"c = f([0]); two probes [c u; 0] per query-space row; common root "
                             f"|q_0| = {float(safe_norm(root)) if root is not None else 0.0:.3g}, "
                             f"isolation columns translated by q_0, "
                             f"bias-fit residual {root_misfit:.1e} (token units)")
    report = Report(kind=model.kind, dim=d, queries=counts["total"],
                    breakdown=breakdown, floor=floor, verification=verification,
                    seconds=timing[0], black_box_seconds=timing[1], details=details,
                    notes=[] if precision.exact else [
                        precision.describe() + f"; measured noise {tol.noise:.1e} relative, "
                        f"query-space residual {residual:.1e}"])
    report.details["conditioning_numbers"] = {
        "smallest_crossing_gap": value_info.get("smallest gap", math.pi),
        "value_separation": value_sep, "smallest_height": min_height,
        "row_spread": spread, "query_space_separation": min_sep,
        "predicted_error": float(predicted), "first_pass_error": float(first_pass),
        "query_space_residual": residual, "noise": float(tol.noise),
        "steepest_logit": float(bar["steepest"])}
    if biases and H:
        report.details["conditioning_numbers"].update(
            {"bias_" + k: float(x) for k, x in bias_factors.items()})
    return report


def _extract_low_rank_heads(oracle, heads, rank, seed, progress, verify_tolerance,
                            output_dtype, decimals, precision_out: list,
                            biases: bool = False) -> ExtractionResult:
    """The learner (see :func:`extract_multi_head_low_rank`); the precision it uses is
    appended to ``precision_out`` as soon as it is known."""
    d = oracle.dim
    if not isinstance(heads, (int, np.integer)) or heads < 1:
        raise InputError(f"heads must be a positive integer (the number of heads H, an upper "
                         f"bound), got {heads!r}")
    if rank is not None and (not isinstance(rank, (int, np.integer)) or not 1 <= rank <= d):
        raise InputError(f"rank must be an integer in 1..{d}, got {rank!r}")
    precision_of(np.zeros(0), output_dtype, decimals)          # bad options before any query
    say = progress or (lambda text: None)
    start, q0, bb0 = time.perf_counter(), oracle.queries, oracle.black_box_seconds
    seeds = np.random.SeedSequence(seed).spawn(2) if seed is not None else [None, None]
    rng = np.random.default_rng(seeds[0])
    r_plan = rank or max(1, d // heads)
    planned = (d + (heads + 1) * (d + 3) + heads * (r_plan + 1) * d + heads * r_plan * d)
    if biases:
        planned += 1 + 2 * heads * (r_plan + 1) + heads * d     # + an offset column a head
    oracle.plan(planned + verification_count(low_rank_multi_head_floor(d, [r_plan] * heads)),
                "low-rank multi-head extraction")

    say("v = sum of the heads' values (d single tokens" + (", c = f([0]))" if biases else ")"))
    const, v = constant_and_values(oracle, biases)
    view = _Translated(oracle, np.zeros(d), const) if biases else oracle
    if not np.any(v):
        raise NotIdentifiableError("v = sum_h v_h = 0 on every token: no probe here can see "
                                   "the heads apart")
    precision = precision_of(v, output_dtype, decimals)
    precision_out.append(precision)
    tol, noise_floor = (EXACT, None) if precision.exact else _tolerances(precision, v)
    say("values of the heads (saturated half circle)")
    before = oracle.queries
    values, value_info = find_values(view, v, int(heads), rng, tol, noise_floor)
    tol = value_info["tolerances"]
    value_queries = oracle.queries - before
    H = len(values)
    if H == 0:
        raise _no_heads_found(precision)
    norms = safe_norm(values, axis=1)
    value_sep = (float(np.linalg.svd(values / norms[:, None], compute_uv=False)[-1])
                 if H else 1.0)

    meter = LogitMeter(view, v, tol)
    columns = haar_orthogonal(d, rng)
    say(f"query spaces of {H} heads")
    before = oracle.queries
    spaces, space_info, space_blocks = [], [], []
    for h in range(H):
        P, block, info = query_space(meter, values, h, columns, rank, rng, biases)
        spaces.append(P)
        space_blocks.append(block)
        space_info.append(info)
    space_queries = oracle.queries - before
    ranks = [P.shape[1] for P in spaces]
    if sum(ranks) > d:
        raise RecoveryFailedError(f"the heads' ranks {ranks} sum to {sum(ranks)} > d = {d}: "
                                  "no column isolates a head (use the full-rank learner)")
    root, root_misfit, origins, kappas = None, 0.0, [None] * H, []
    if biases:
        # the common root q_0 (W_h q_0 + b_h = 0 for every h): translated by q_0 no head has
        # a bias, and the isolation columns of every head run from there. Translating only
        # as far as the other heads' queries vanish (the shortest such o_h) leaves head h
        # the offset W_h (o_h - q_0), as long as the bias: its W part must then be read
        # beside a logit |b_h| / |W_h| times larger. Measured, heads' errors: MiniLM layer 0
        # (|q_0| = 176, |o_h| <= 39) 1.3e-8 -> 7.1e-10; random rank-2 heads with
        # |b_h| = 10 |W_h|, d = 16, 8 seeds: 6e-12 .. 3.2e-10 -> 8e-13 .. 1.8e-11.
        root, root_misfit, kappas = common_root(spaces, [i["row logits"] for i in space_info],
                                                [i["bias"] for i in space_info], d)
        origins = [root] * H
    say("isolation columns")
    before = oracle.queries
    W, separations, column_blocks, meter = _isolation_stage(oracle, meter, v, values, spaces,
                                                            origins, const, tol, rng, biases)
    column_queries = oracle.queries - before

    # refinement: exact heights, then every stored block solved again with the other
    # heads' sigmoids predicted from the current estimates (no new queries)
    before = oracle.queries
    changes: list[float] = []
    if H and min(ranks) > 0:
        say("exact heights and refinement")
        values = exact_heights(_Translated(oracle, root, const + v @ root) if biases else oracle,
                               v, values, W, rng)
        W, spaces, kappas, root, root_misfit, changes = _refine_heads(
            v, values, W, spaces, kappas, root, root_misfit, space_blocks, space_info,
            column_blocks, ranks, biases)
    height_queries = oracle.queries - before
    if not (np.all(np.isfinite(W)) and np.all(np.isfinite(values))):
        raise ModelMismatchError(f"the black box is not multi-head attention with {H} low-rank "
                                 f"head(s): its answers give no finite heads")
    if biases:
        # b_h = W_h P_h kappa_h (= -W_h q_0, without q_0's length)
        model: MultiHeadAttention | BiasedMultiHeadAttention = BiasedMultiHeadAttention(
            W, values, query_offsets(W, spaces, kappas, np.zeros(d)) if H else np.zeros((0, d)),
            const)
    else:
        model = MultiHeadAttention(W, values)

    recovery = oracle.queries - q0
    floor = low_rank_multi_head_floor(d, ranks) if H else d
    if biases:
        floor += sum(ranks) + 1
    n_verify = verification_count(floor)
    bar = _error_bar(value_info, value_sep, space_info, separations, changes, meter,
                     precision, tol, verify_tolerance, biases, H)
    predicted, verify_tolerance = bar["predicted"], bar["verify_tolerance"]
    spread, min_sep = bar["spread"], bar["min_sep"]
    if predicted > tol.max_predicted:
        raise RecoveryFailedError(
            f"the heads are too close to pin down: predicted parameter error {predicted:.1e} "
            f"> {tol.max_predicted:.0e} (query-space separation {min_sep:.1e}, row spread "
            f"{spread:.1e}); nothing is returned")
    say("held-out verification")
    verification = verify_model(oracle, model, count=n_verify, seed=seeds[1],
                                tolerance=verify_tolerance,
                                scale=token_scale(model) if H else None,
                                expected_error=predicted if H >= 2 else None,
                                rounded_answers=not precision.exact)
    counts = {"values": value_queries, "query spaces": space_queries,
              "isolation": column_queries, "heights": height_queries, "recovery": recovery,
              "verification": n_verify, "floor": floor, "total": oracle.queries - q0}
    report = _low_rank_report(model, verification, counts, {**bar, "steepest": meter.steepest},
                              value_info, value_sep, changes, precision, tol, meter.rescued,
                              biases, root, root_misfit, int(heads), ranks,
                              (time.perf_counter() - start, oracle.black_box_seconds - bb0))
    return checked_result(model, report, f"multi-head attention with {H} low-rank head(s)")
