"""A standard attention layer from vector answers: every head's QK and OV circuits.

Model (docs/algorithms.md, "Vector outputs", several heads). At the last position

    F(X) = sum_h O_h X^T softmax(X (W_h x_N + b_h)) + c        in R^m,

with O_h = W_o,h W_v,h (m x d, rank r_h) whose ranges R_h = range(O_h) are independent
(sum_h r_h <= m: true when W_o is invertible, as in BERT and MiniLM), and
W_h = W_k,h^T W_q,h / sqrt(d_h), b_h = W_k,h^T b_q,h / sqrt(d_h). Every-position answers
are read at their last position, which sees every token whether the box is causal or not;
the model returned answers as the box does (held-out verification compares every position).

Identities used, in order:

1. Single tokens: F([0]) = c, (F([t e_k]) - c) / t = O e_k with O = sum_h O_h (d + 1
   queries; one token takes every head's whole weight, so this is exact for any t).
2. Ranges by selectors. A sequence of n "selector" tokens x_i = q + Delta_i + mu_i delta
   (|Delta_i| huge) and the query token q: each head's softmax is saturated on one token
   i(h) (its largest score Delta_i^T (W_h q + b_h), or q itself), and a small payload
   delta does not move any saturated weight (a change of exp(-margin)). So

       F(delta) - F(0) = sum_h mu_i(h) O_h delta = A delta,   A = sum_h kappa_h O_h,

   exactly linear in delta, with kappa_h in the known set {0, mu_1, ..., mu_n}. In the
   coordinates of range(O), M = (A P)(O P)^+ has eigenvalue kappa_h on R_h: the
   eigenspaces are the ranges. Random selectors (rough ranges): heads that pick the same
   token share an eigenspace, later sets (new q, payloads for the widest block only)
   split them, until three agreement tests in a row (3 queries each, :func:`heads_agree`)
   find every block's heads taking one selector weight; H is the number found. The sets' query tokens have norm sqrt(d)
   (:func:`rough_query_norm`): where b_h dominates W_h q every set sees the same
   scores. Eigenvalues off the set {mu} mean the answers are not saturated softmax
   attention: refused.
3. Projectors. With R = [R_1 ... R_H] and L = R^+, C_h = L_h O, so O_h = R_h C_h and
   L_h (F - c) = C_h X^T alpha^h: H single-head problems measured by the same queries.
4. Scores. For X = [q + tau u_1, ..., q + tau u_p, q] (p < r_h),
   C_h U a = (L_h (F - c) - C_h q) / tau gives the p weights a (alpha_N = 1 - sum a), and
   ln(a_i / alpha_N) = tau u_i^T (W_h q + b_h): p logits of every head from one query.
   q = 0 gives b_h; q = s q_k gives W_h q_k. W_h has rank <= r_h: K = (sqrt(r) + 1)^2
   directions (r = max r_h; :func:`k_stage_directions`), each read whole through a frame
   of ceil(d / p) blocks, and b_h (which is W_k,h^T b_q,h / sqrt(d_h), in the same space)
   give its column space K_h (the smallest singular value of the K columns in K_h grows
   as sqrt(K) - sqrt(r), and K_h's error is what the W-stage carries into every column
   of W_h); every other direction costs ceil(1.5 rank / p) queries through a frame
   conditioned against every K_h.
5. Designed selectors (fine ranges). With every g_h = W_h q + b_h known, selectors
   Delta = margin G^+ make head h pick token h alone, and payloads orthogonal to every
   g_h(q) move no score at all, so they are as large as the selectors (no precision lost
   to F(delta) - F(0)); two query tokens q_1, q_2 cover R^d with d + 2 queries. These
   answers give A = sum_h mu_h O_h (payloads well conditioned), and

       A - mu_h O = sum_{g != h} (mu_g - mu_h) O_g

   has range the other heads' ranges: its r_h smallest left singular vectors are L_h
   (L_h O_g = 0 for g != h up to A's rounding), and R = [L_1; ...; L_H]^-1. No O^{-1}
   is involved (M = A (O P)^+ reads every range through cond(O) ~1e5 on MiniLM: a head's
   read leaked 2e-12 of the others, now 1e-13). The eigenvalues of M still check the
   ranks. The score answers of 4 are then read again (no new query) through these
   orthonormal L_h themselves: rows of R^-1 carry cond(R) x the inverse's rounding
   (MiniLM layer 5, cond(R) 7e4: a leak of 2.5e-12 against 4.7e-14). Payload weights
   mu_h centred on 0 halve the answers' size for the same differences mu_g - mu_h.

Conditioning by design: scales come from a pilot (the even part of two-token answers
gives the logit scale), probe logits are kept of order one, frames and payloads are
orthonormal and chosen by the condition numbers of C_h U and U^T K_h. The error bar is
measured: the W-stage reads 1.5x as many numbers as W_h q has unknowns, and their misfit
times cond(U^T K_h) bounds what reaches W.

Low precision (``output_dtype``: a forward pass in float32, bfloat16, float16). The
random selector sets read their payload's effect against the answers' rounding at the
selectors' size, rho / payload, and the eigenvalues of M carry that times the
conditioning of the pencil (A, O) (about cond(O)): payloads of 3e-2 (a set whose margins
fail is asked again at the same size), 0.1 for the first set (it reads all of range(O)
through one pencil; halved on a retry, down to 3e-2), 8 selectors (weights 1/7 apart),
eigenvalues grouped by gaps, each group's range from the left null space of
L_k (A - mu O) P as in step 5, until LOW_QUIET_SETS sets in a row split nothing. Only
eigenvalues whose measured noise is small and that lie on a weight form groups; the few
that O reads weakly (0.2 to 30 spacings of noise at cond(O) ~1e5) join the nearest group
(:func:`resolved_parts`). The rounding is measured, not assumed: a sequence and
the same sequence with the tokens before the query token reversed have the same exact
answer, so their difference is the box's rounding. ROUNDING_SEQUENCES such pairs give
its level; READ_NOISE_ROWS W-stage rows asked again reordered give what it does to the
reads, and the W-stage misfit must stay within MISFIT_LIMIT x that (a misfit the
rounding does not explain is the box's: refused). The error bar is BAR_SAFETY x
max(W-stage spread, rounding), or, if larger, what the measured rounding does to the
O_h through the designed selectors' ranges (resampled: oblique ranges amplify it);
held-out verification allows LOW_VERIFY x the rounding plus twice the bar. A refusal in
steps 2 to 5 starts them again with new random sets (LOW_RESTARTS times). The designed
selectors run twice (LOW_FINE_PAYLOADS): a small payload first, since the first W (read
through the random sets' projectors) may be far off when cond(O) is large, then W again
and a full payload. Measured (nn.MultiheadAttention(64, 8), float32, default
initialisation, seeds 0..199): 200 within their bars (errors 6.9e-5 .. 4.2e-3, at most
0.12 of the bar; bars 1.2e-3 .. 4.9e-2; 1,168 .. 2,871 queries, median 1,288), none
refused; the layer of the most oblique ranges (seed 198: cond(O) 4.2e5, orthonormal
range bases' condition 3.7e4) with learner seeds 1000..1011: 11 within, 1 refused.

Limits: every-position answers are read at their last row only (the cost is that of the
last position). On MiniLM (cond(O) ~1e5, cond(R) up to 7e4) every head's W_h is within
4.2e-11 of its own norm (layers 0 to 5, seeds 0, 1, 2, 5, 7; layer 0's head of the
largest W_h and weakest O_h gets the end of the payload scale,
:func:`ordered_payloads`). A head-isolating probe design (tokens in
K_h = cap_{g != h} ker O_g: the other heads vanish from the answer) reads only r_h
numbers per query, 12x too few for the 2x budget; an alternating least-squares refit of
K_h from W-stage frames covering R^d did not help (measured).
"""

from __future__ import annotations

import itertools
import logging
import math
import time
from dataclasses import dataclass

import numpy as np
import scipy.linalg

from ..errors import InputError, ModelMismatchError, RecoveryFailedError
from ..models import VectorAttention
from ..oracle import Oracle, on_scaled_outputs
from ..precision import check_precision_options
from ..report import (
    DEFAULT_VERIFY_TOLERANCE,
    ExtractionResult,
    Report,
    checked_result,
    verification_count,
    verify_model,
)
from ..verification import misfit_bar
from .noisy import FORWARD_RHO

log = logging.getLogger(__name__)

EPS = np.finfo(float).eps
SINGLE_SCALE = 1024.0     # single tokens t e_k: c's rounding is 1/t of O's
RANK_TOL = 1e-9           # singular values below this x the largest: no direction
SPAN_GAP = 1e3            # W_h's column space ends at a drop of its singular values this big
DESIGN_MARGIN = 200.0     # designed selectors: each head's winning score margin
SELECTORS = 192           # selector tokens per set (heads picking one token share a block)
ROUGH_RESTARTS = 2        # float64: the whole random-selector stage started again
ROUGH_RETRIES = 2         # a random selector set that fails is asked again this often
MAX_SETS = 4              # selector sets at most (the last one must split nothing)
AGREE_TESTS = 3           # float64: agreement tests in a row that end the random sets
AGREE_PAYLOADS = 2        # ... payloads of one (and the base sequence: 3 queries)
AGREE_TOL = 1e-5          # ... a block's answers off one multiple of its payload images by
                          # more than this (relative): its heads took different selectors
                          # (weights 1/191 apart: 1e-3 and up; clean sets 1e-14 .. 1e-9)
SELECT_LOGIT = 4e4        # typical score of a selector token (margins far above 40)
PAYLOAD = 1e-3            # payload size beside a selector (its score moves <= 1e-3 of it)
LINEARITY_CHECKS = 2      # payloads beyond the widest block: their misfit tests linearity
LINEARITY_TOL = 1e-7      # ... relative misfit above which a set is refused (then retried):
                          # clean sets misfit 1e-14 .. 1.3e-9 (MiniLM layers, cond(O) ~1e5);
                          # a near-tie (a head not saturated) leaves 1e-5 .. 1e-4, and a
                          # first set taken at 3.4e-5 spoiled every later set's projectors
                          # (a d = 64, H = 8 layer was then refused as not softmax)
PAYLOAD_OVERSAMPLE = 1.25  # later random sets: payloads per block width
PAYLOAD_CUT = 3.0        # a set that failed is asked again with a payload this much smaller
ROUGH_SLACK = 0.25        # ... for random selectors (read through rough projectors)
EIGEN_SLACK = 1e-2        # eigenvalue this far (x the gap of the mu) from every mu: refuse
TARGET_LOGIT = 2.0        # largest |logit| of a score probe
PEAK_BAND = 2.0           # a row whose largest |logit| exceeds PEAK_BAND x it is asked again
PILOT_SCALES = 2.0 ** np.arange(-40, 41, 8)   # pilot token scales (x the token norm)
TOKEN_SHARE = 0.75        # score probes resolve this share of the narrowest head's rank:
                          # C_h U is then a tall, well-conditioned r_h x p matrix
OVERSAMPLE = 1.5          # W-stage frames read 1.5 rho numbers of a rank-rho column space
Q_SCALE = 1.0             # query tokens of norm Q_SCALE / sqrt(|W_h q| / |q|)
FRAME_TRIES = 16          # random frames tried for the W-stage; the best conditioned kept
BAR_SAFETY = 10.0         # error bar: this many times the measured misfit
MAX_RESCALES = 4
NOISE_GROWTH = 1e3         # a row's scale grown this much with its logits not doubled: noise
BIAS_COLUMN = 1e-3        # b_h joins W_h's K-stage columns above this x their size
K_EXTRA = 3               # K-stage directions beyond the widest rank, at least
TINY_LOGIT = 1e-12         # a score row whose largest |logit| is below this x the target:
                          # g ~ 0 there (any scale reads it)
# low precision (a forward pass in float32, bfloat16, float16): the levels below are
# multiples of the dtype's relative level rho (noisy.FORWARD_RHO, float32: 3.8e-6)
LOW_PAYLOAD = 3e-2         # random selectors' payload: the answers' rounding is rho / payload
LOW_FIRST_PAYLOAD = 0.1    # ... the first set's: it reads all of range(O) through one
                          # pencil, and its eigenvalues' noise (x 1 / payload) decides the
                          # parts every later set refines; halved on each retry down to
                          # LOW_PAYLOAD (a payload this large fails the margins of some
                          # layers' sets every time: nn.MultiheadAttention(64, 8) seed 17
                          # in float32 failed 9 first sets in a row, then was refused)
LOW_SELECTORS = 8          # fewer selectors: selector weights 1/7 apart, eigenvalues grouped
LOW_RETRIES = 8            # a set whose margins fail is asked again (new selectors, same size)
LOW_SETS = 12             # ... and heads sharing a selector split over more sets
LOW_QUIET_SETS = 2         # ... the sets end after this many in a row split nothing
LOW_LINEARITY_TOL = 1e-4   # low precision: the least misfit allowed (then x its rounding)
LOW_LINEARITY = 30.0       # selector sets: misfit allowed, x its rounding estimate
LOW_TINY = 300.0           # score rows at logits below this x rho: g ~ 0 there
LOW_EIGEN_SLACK = 3e4      # designed selectors: eigenvalue slack, x rho (0.11 at float32)
LOW_GROUP_SLACK = 3.0      # random selectors: a readable eigenvalue this many spacings from a mu
LOW_RESOLVED = 0.25        # ... readable: its noise (measured) below this many spacings
LOW_VERIFY = 30.0          # held-out tolerance: this x the measured rounding, plus twice
                          # the error bar
ROUNDING_SEQUENCES = 4     # low precision: pairs of permuted sequences measuring the rounding
ROUNDING_LENGTH = 8
READ_NOISE_ROWS = 4        # low precision: W-stage rows asked again reordered
MISFIT_LIMIT = 100.0       # ... the W-stage misfit may be this x their change, not more
ORDER_LIMIT = 1e-2         # answers moving more than this with the order: not attention
ORDER_ROUNDING = 10.0      # ... nor more than this x rho: a float32 forward pass moves by
                          # 1.0e-7 .. 3.2e-7 (0.03 .. 0.08 rho; nn.MultiheadAttention(64, 8),
                          # seeds 0..199); rotary positions at d = 32 moved by 5e-3, were
                          # taken as rounding and accepted with a bar of 1.6
LOW_RESTARTS = 2           # selector sets, scores and designed selectors asked anew after a
                          # refusal (random sets grouped wrongly through rounding)
LOW_FINE_PAYLOADS = (1 / 8, 1.0)   # designed selectors' payloads (x the selectors' size),
                          # one pass each, W read again between: the first W (through
                          # the random sets' projectors) was off by up to 0.9 per head
                          # at cond(O) 2e5, and a full payload then moved scores by up to
                          # 660 against margins of 200 (nn.MultiheadAttention(64, 8) seed 24)
RANGE_SAMPLES = 4          # low precision: draws of the rounding through the ranges' reads
                          # (the measured rounding, a largest deviation, taken as every
                          # number's: 5 to 11 times the O_h error, nn.MultiheadAttention(64,
                          # 8) seeds 0, 13, 24, 29, 39, 92, 162)
FIRST_PASS_SLACK = 0.25    # ... a smaller payload's eigenvalues: slack / payload, at most this
                          # (below half a spacing: still one mu per eigenvalue); the last
                          # pass, at full payload, checks at the design's slack


@dataclass(frozen=True)
class Design:
    """The probe design and the checks' slack for one answer precision.

    ``rho`` the answers' relative level (float64: 0, exact up to rounding); the rest as
    the module constants of the same names. Low precision changes the random selector
    sets (larger payloads, fewer selectors, eigenvalues grouped by gaps, parts split by
    left null spaces), the slack of every check, scaled to rho, and the designed
    selectors, asked twice (a small payload, then a full one)."""

    name: str = "float64"
    rho: float = 0.0
    payload: float = PAYLOAD
    first_payload: float | None = None     # the first random set's, if not ``payload``
    payload_cut: float = PAYLOAD_CUT
    selectors: int = SELECTORS
    retries: int = ROUGH_RETRIES
    max_sets: int = MAX_SETS
    linearity_tol: float = LINEARITY_TOL
    rough_slack: float = ROUGH_SLACK
    eigen_slack: float = EIGEN_SLACK
    tiny_logit: float = TINY_LOGIT
    grouped: bool = False      # random selectors: eigenvalues grouped by gaps, not by mu
    fine_payloads: tuple[float, ...] = (1.0,)   # designed selectors' passes (payload sizes)

    @property
    def exact(self) -> bool:
        return self.rho == 0.0


FLOAT64 = Design()


def layer_design(output_dtype=None) -> Design:
    """The design for float64 answers (None, "float64") or a forward pass in a low
    precision."""
    check_precision_options(output_dtype, None)
    if output_dtype in (None, "float64"):
        return FLOAT64
    rho = float(FORWARD_RHO[output_dtype])
    return Design(name=output_dtype, rho=rho, payload=LOW_PAYLOAD,
                  first_payload=LOW_FIRST_PAYLOAD, payload_cut=1.0,
                  selectors=LOW_SELECTORS, retries=LOW_RETRIES, max_sets=LOW_SETS,
                  linearity_tol=LOW_LINEARITY_TOL, rough_slack=LOW_GROUP_SLACK,
                  eigen_slack=max(EIGEN_SLACK, LOW_EIGEN_SLACK * rho),
                  tiny_logit=LOW_TINY * rho, grouped=True, fine_payloads=LOW_FINE_PAYLOADS)


# -- small helpers ---------------------------------------------------------------------

def _last(oracle: Oracle, X: np.ndarray) -> np.ndarray:
    """Answers at the last position, (B, m), whatever the box answers (every position:
    its last row, which sees every token, causal or not)."""
    out = oracle.query(X)
    return out[:, -1, :] if out.ndim == 3 else out


def _orth(A: np.ndarray, tol: float = RANK_TOL) -> np.ndarray:
    """Orthonormal basis (n, k) of the column space of A (relative rank tolerance)."""
    U, s, _ = np.linalg.svd(A, full_matrices=False)
    return U[:, : int(np.sum(s > tol * s[0]))] if s.size and s[0] > 0 else U[:, :0]


def _column_space(A: np.ndarray) -> np.ndarray:
    """Orthonormal basis of the column space of A (d, K) measured with noise: cut at the
    largest drop of the singular values if it exceeds SPAN_GAP (the noise floor lies far
    below the signal), else every column."""
    U, s, _ = np.linalg.svd(A, full_matrices=False)
    if s[0] == 0:
        return U[:, :0]
    drops = s[:-1] / np.maximum(s[1:], s[0] * 1e-300)
    k = int(np.argmax(drops)) + 1
    return U[:, :k] if drops[k - 1] > SPAN_GAP else U


def _unit(rng, d: int) -> np.ndarray:
    v = rng.standard_normal(d)
    return v / np.linalg.norm(v)


def _rotation(rng: np.random.Generator, d: int) -> np.ndarray:
    """A random orthogonal (d, d) matrix."""
    Q, R = np.linalg.qr(rng.standard_normal((d, d)))
    return Q * np.sign(np.diag(R))


def _cond(A: np.ndarray) -> float:
    s = np.linalg.svd(A, compute_uv=False)
    return float(s[0] / s[-1]) if s.size and s[-1] > 0 else np.inf


# -- stage 1: c and O ------------------------------------------------------------------

def constant_and_outputs(oracle: Oracle) -> tuple[np.ndarray, np.ndarray]:
    """c = F([0]) (m,) and O = sum_h O_h (m, d) from (F([t e_k]) - c) / t: d + 1 queries,
    one batch. One token takes all of every head's weight, so the answer is exactly linear
    in t; a large t (a power of two: exact division) keeps c's rounding out of O's small
    directions."""
    d = oracle.dim
    tokens = SINGLE_SCALE * np.eye(d)[:, None, :]
    out = _last(oracle, np.concatenate([np.zeros((1, 1, d)), tokens]))
    return out[0], (out[1:] - out[0]).T / SINGLE_SCALE


# -- pilot: the logit scale --------------------------------------------------------------

def logit_scale(oracle: Oracle, O: np.ndarray, c: np.ndarray, q: np.ndarray,
                u: np.ndarray) -> float:
    """kappa with scores (tau u)^T (W_h q + b_h) about tau kappa, from two-token probes.

    The even part S = F([q + t u; q]) + F([q - t u; q]) - 2 (c + O q) equals
    t sum_h tanh(t u^T g_h / 2) O_h u, g_h = W_h q + b_h: about t^2/2 (u^T g) |O u| while
    the logits are small, and t |O u| once saturated. Over a ladder of t, the ratio
    rho = |S| / (t |O u|) read where it is small but far above rounding gives kappa ~ 2 rho / t.
    """
    ts = PILOT_SCALES
    X = np.stack([np.stack([q + s * t * u, q]) for t in ts for s in (1.0, -1.0)])
    y = _last(oracle, X).reshape(len(ts), 2, -1)
    S = y.sum(axis=1) - 2 * (c + O @ q)
    rho = np.linalg.norm(S, axis=1) / (ts * np.linalg.norm(O @ u))
    usable = np.flatnonzero((rho > 1e-6) & (rho < 0.05))
    if usable.size:     # the largest such scale: smaller ones are read through rounding
        return float(2 * rho[usable[-1]] / ts[usable[-1]])
    saturated = np.flatnonzero(rho >= 0.05)
    if saturated.size:                       # the smallest scale already saturates
        return float(2 * 0.05 / ts[saturated[0]] * 1e3)
    raise RecoveryFailedError(
        "the answers of two-token probes show no dependence on the scores at any scale "
        f"from {ts[0]:.0e} to {ts[-1]:.0e} (every head attends uniformly?)")


# -- stage 2: the ranges -----------------------------------------------------------------

class Blocks:
    """A split of range(O) into independent blocks, in coordinates of an orthonormal basis
    E (m, D) of range(O): block k has coordinate basis R[k] (D, k_k)."""

    def __init__(self, E: np.ndarray):
        self.E = E
        self.R = [np.eye(E.shape[1])]

    @property
    def widths(self) -> list[int]:
        return [R.shape[1] for R in self.R]

    def left_inverse(self) -> list[np.ndarray]:
        """L_k (k_k, D): coordinates of a vector of range(O) in block k's basis."""
        L = np.linalg.inv(np.concatenate(self.R, axis=1))
        bounds = np.cumsum([0] + self.widths)
        return [L[a:b] for a, b in itertools.pairwise(bounds)]


def selector_probes(Delta: np.ndarray, q: np.ndarray, payloads: np.ndarray,
                    mu: np.ndarray) -> np.ndarray:
    """Sequences [q + Delta_i + mu_i delta_j (i = 1..n); q] for delta_0 = 0 and every
    payload delta_j (columns of ``payloads``): shape (1 + p, n + 1, d)."""
    n, d = Delta.shape
    deltas = np.concatenate([np.zeros((1, d)), payloads.T])          # (1 + p, d)
    X = np.empty((len(deltas), n + 1, d))
    X[:, :n] = q + Delta[None] + mu[None, :, None] * deltas[:, None, :]
    X[:, n] = q
    return X


def rough_query_norm(d: int) -> float:
    """The norm of the random selector sets' query tokens: sqrt(d), the norm of a
    LayerNorm'd token of unit gain, where a real layer's query tokens live.

    Heads whose g_h = W_h q + b_h point alike pick the same random selector set after set,
    and two heads left in one block are refused later by the designed selectors. The bias
    part does not change with q: at |q| = 1 it dominated MiniLM's g_h (cosines across
    heads: median 0.46, largest 0.79 on layer 1; at |q| = sqrt(d) 0.12 and 0.45), and
    layer 1 at seed 1 and layer 2 at seed 5 were refused that way."""
    return math.sqrt(d)


def random_selectors(rng, n: int, d: int, scale: float) -> np.ndarray:
    """n random selectors (n, d) of norm ``scale``."""
    Delta = rng.standard_normal((n, d))
    return Delta * (scale / np.linalg.norm(Delta, axis=1, keepdims=True))


def payload_directions(rng, d: int, C: list[np.ndarray]) -> np.ndarray:
    """Orthonormal payload directions (d, p): every block k must see its whole range
    through C_k P (k_k x p). One block (the first set): p = d, a rotation (cond(O P) =
    cond(O)). Several: p = PAYLOAD_OVERSAMPLE x the widest (at most d), the best of FRAME_TRIES
    random sets by the worst cond(C_k P)."""
    widest = max(Ck.shape[0] for Ck in C)
    if len(C) == 1:         # a rotation, and LINEARITY_CHECKS more: the misfit shows
        extra = rng.standard_normal((d, LINEARITY_CHECKS))
        return np.concatenate([_rotation(rng, d), extra / np.linalg.norm(extra, axis=0)], 1)
    p = min(d + LINEARITY_CHECKS, math.ceil(PAYLOAD_OVERSAMPLE * widest) + LINEARITY_CHECKS)
    if p > d:
        extra = rng.standard_normal((d, p - d))
        return np.concatenate([_rotation(rng, d), extra / np.linalg.norm(extra, axis=0)], 1)
    tries = [_rotation(rng, d)[:, :p] for _ in range(FRAME_TRIES)]
    return min(tries, key=lambda P: max(_cond(Ck @ P) for Ck in C))


def block_eigenspaces(M: np.ndarray, mu: np.ndarray,
                      slack: float = EIGEN_SLACK) -> list[tuple[float, np.ndarray]]:
    """Eigenspaces of M (k, k), whose eigenvalues must lie in the set ``mu``: (value, basis).

    Each eigenvalue is matched to the nearest mu; a distance above ``slack`` times the
    spacing of the mu (or a complex pair) is not a sum of saturated heads: ModelMismatch.
    (Low precision groups the eigenvalues by their measured noise instead:
    :func:`resolved_parts`.)"""
    values = np.linalg.eigvals(M)
    spacing = float(np.min(np.diff(np.sort(mu))))
    nearest = mu[np.argmin(np.abs(values[:, None] - mu[None, :]), axis=1)]
    off = float(np.max(np.abs(values - nearest))) / spacing
    log.debug("eigenvalues: %.3g spacings off (allowed %.3g)", off, slack)
    if off > slack:
        raise ModelMismatchError(
            f"the answers to saturated selector probes are not linear in the payload with "
            f"one coefficient per head: an eigenvalue lies {off:.2g} spacings from every "
            f"selector weight (softmax attention gives exactly one)")
    spaces = []
    for value in np.unique(nearest.real):
        k = int(np.sum(nearest.real == value))
        # gesvd: the divide-and-conquer driver fails to converge on some nearly
        # defective matrices, and these are nearly defective by design (repeated values)
        _, _, Vt = scipy.linalg.svd(M - value * np.eye(len(M)), lapack_driver="gesvd")
        spaces.append((float(value), Vt[-k:].T))
    return spaces


def resolved_parts(LY: np.ndarray, LZ: np.ndarray, L: np.ndarray, mu: np.ndarray,
                   slack: float) -> list[np.ndarray]:
    """Low precision: one block's parts (coordinate bases (k, k_i)) from its answers
    LY = L_k A P and LZ = L_k O P (k, p), L_k (k, D) its rows in range coordinates: the
    eigenvalues of M = LY LZ^+ grouped by gaps above half the spacing of the weights
    ``mu``, each group's basis from the left null space of LY - (its mean) LZ
    (:func:`kernel_blocks`: no LZ^+, whose condition number would multiply the rounding).

    Only eigenvalues the rounding leaves readable form groups. Each eigenvalue's noise is
    sigma_j = eps |l_j L_k| |LZ^+ x_j| (left and right eigenvectors, l_j x_j = 1), eps
    the noise of one answer number, measured by the fit's residual over the p - k
    payloads beyond the block's width. Measured (nn.MultiheadAttention(64, 8) in float32,
    cond(O) 6e4 to 4e5, first sets): most eigenvalues carry below 1e-2 spacings, the few
    of directions O reads weakly 0.2 to 30, and land anywhere. Grouped with the others,
    such an eigenvalue bridged two heads' groups (a part of two heads, split at a value
    between their weights: not their ranges) or made a part of one direction; every
    later set then found a part not linear in the payload, or the score reads could not
    read the one-direction part, and the layer was refused on every restart. Readable:
    sigma_j below LOW_RESOLVED spacings and within LOW_RESOLVED spacings of a weight; any
    other eigenvalue joins the group of the nearest mean (a head split or joined wrongly
    that way is read again by the designed selectors, which merge a split head). The
    precise eigenvalues must lie within ``slack`` spacings of a weight, and the groups'
    members of their mean (else ModelMismatch). A block with no precise eigenvalue (its
    residual high: eps large) is checked the same way on all of them, and kept whole.
    Exact answers (eps = 0): every eigenvalue readable, grouped by gaps."""
    k, p = LY.shape
    pinv = np.linalg.pinv(LZ)
    M = LY @ pinv
    values, X = np.linalg.eig(M)
    try:
        left = np.linalg.inv(X)
    except np.linalg.LinAlgError:       # defective: no eigenvalue's noise can be told
        left = np.full_like(X, np.inf)
    spacing = float(np.min(np.diff(np.sort(mu))))
    eps = (float(np.linalg.norm(LY - M @ LZ)) / float(np.linalg.norm(L))
           / math.sqrt(max(p - k, 1)))
    sigma = eps * np.linalg.norm(left @ L, axis=1) * np.linalg.norm(pinv @ X, axis=0)
    precise = sigma <= LOW_RESOLVED * spacing
    # a precise eigenvalue lies on a weight; one between weights (within the slack) is
    # grouped as a noisy one (a near-multiple eigenvalue's own eigenvectors are not
    # defined, and neither is its sigma: measured, a part of one direction 0.43 spacings
    # from every weight, which the score reads could not read)
    dist = np.min(np.abs(values[:, None] - mu[None, :]), axis=1) / spacing
    readable = precise & (dist <= LOW_RESOLVED)
    if not precise.any():       # checked as before (every group near a weight), not split
        readable[:] = True
    off = float(np.max(dist[precise])) if precise.any() else 0.0
    if readable.any():
        order = np.flatnonzero(readable)[np.argsort(values.real[readable])]
        groups = np.split(order, np.flatnonzero(np.diff(values.real[order]) > spacing / 2) + 1)
        means = np.array([values[g].real.mean() for g in groups])
        centre = mu[np.argmin(np.abs(means[:, None] - mu[None, :]), axis=1)]
        off = max(off, float(max(np.max(np.abs(means - centre)),
                                 max(np.max(np.abs(values[g] - m))
                                     for g, m in zip(groups, means)))) / spacing)
    else:
        groups, means = [], np.empty(0)
    log.debug("eigenvalue groups (size, mean, spread / spacing): %s; off %.3g (allowed %.3g); "
              "others at %s (sigma %s spacings)",
              [(len(g), round(float(m), 3), round(float(np.ptp(values[g].real)) / spacing, 3))
               for g, m in zip(groups, means)], off, slack,
              np.round(values[~readable].real, 3), np.round(sigma[~readable] / spacing, 2))
    if off > slack:
        raise ModelMismatchError(
            f"the answers to saturated selector probes are not linear in the payload with "
            f"one coefficient per head: an eigenvalue lies {off:.2g} spacings from every "
            f"selector weight (softmax attention gives exactly one)")
    if len(groups) <= 1 or not precise.any():
        return [np.eye(k)]
    # an unreadable eigenvalue joins the group of the nearest mean
    joins = np.argmin(np.abs(values.real[~readable, None] - means[None, :]), axis=1)
    sizes = [len(g) + int(np.sum(joins == i)) for i, g in enumerate(groups)]
    return kernel_blocks(LY, LZ, means, sizes)


def split_ranges(oracle: Oracle, O: np.ndarray, c: np.ndarray, blocks: Blocks, rng,
                 q: np.ndarray, scale: float, payload: float = PAYLOAD, *,
                 design: Design = FLOAT64) -> tuple[bool, int]:
    """One selector set: refine every block by the eigenspaces of its A O^+ (in the block:
    (L_k A P)(L_k O P)^+). Returns (whether a block split, queries)."""
    d, E = oracle.dim, blocks.E
    L = blocks.left_inverse()
    n = min(design.selectors, (oracle.max_length or design.selectors + 1) - 1)
    mu = np.concatenate([[0.0], rng.permutation(np.linspace(1.0, 2.0, n))])   # 0: q wins
    P = payload * scale * payload_directions(rng, d, [Lk @ E.T @ O for Lk in L])
    y, Y, Z = selector_reads(oracle, O, E, rng, q, scale, P, mu[1:])
    split = False
    new: list[np.ndarray] = []
    for Rk, Lk in zip(blocks.R, L):
        Mk = (Lk @ Y) @ np.linalg.pinv(Lk @ Z)                     # k x k, diag(kappa) in R_h
        misfit = np.linalg.norm(Lk @ Y - Mk @ (Lk @ Z)) / np.linalg.norm(Lk @ Y)
        tol = design.linearity_tol
        if not design.exact:
            # the misfit rounding alone leaves: every answer number off by rho |y|, read
            # through L_k, over the p - k_k directions the fit does not absorb
            p, k = Y.shape[1], Rk.shape[1]
            noise = (math.sqrt(2.0 * max(p - k, 1)) * design.rho * float(np.abs(y).max())
                     * float(np.linalg.norm(Lk)) / float(np.linalg.norm(Lk @ Y)))
            tol = max(tol, LOW_LINEARITY * noise)
        log.debug("selector set: width %d, misfit %.2e, allowed %.2e", Rk.shape[1], misfit, tol)
        if not misfit <= tol:       # more payloads than the block is wide
            raise ModelMismatchError(
                f"the answers to selector probes are not linear in the payload (misfit "
                f"{misfit:.1e}): a weight moved with it (no saturation, or not softmax)")
        if design.grouped:
            parts = resolved_parts(Lk @ Y, Lk @ Z, Lk, mu, design.rough_slack)
            split |= len(parts) > 1
            new.extend(Rk @ S for S in parts)
        else:
            spaces = block_eigenspaces(Mk, mu, design.rough_slack)
            split |= len(spaces) > 1
            new.extend(Rk @ S for _, S in spaces)
    blocks.R = new
    return split, len(y)


def selector_reads(oracle: Oracle, O: np.ndarray, E: np.ndarray, rng, q: np.ndarray,
                   scale: float, P: np.ndarray, mu: np.ndarray):
    """One random selector set at query token ``q`` (len(mu) selectors of norm ``scale``,
    weights ``mu``) asked with payloads P (d, p) and without: the answers y (1 + p, m),
    Y = A P and Z = O P in range coordinates (D, p)."""
    X = selector_probes(random_selectors(rng, len(mu), oracle.dim, scale), q, P, mu)
    y = _last(oracle, X)
    return y, E.T @ (y[1:] - y[0]).T, E.T @ (O @ P)


def designed_selectors(G: np.ndarray, margin: float) -> np.ndarray:
    """Selectors Delta (H, d) with Delta_i^T g_h = margin [i = h] for the columns g_h of
    G (d, H): head h's largest score is on token h, ``margin`` above every other."""
    return margin * np.linalg.pinv(G)


def fine_ranges(oracle: Oracle, O, E, W, b, widths, rng, s: float, *,
                design: Design = FLOAT64, payload: float = 1.0, regroup: bool = False,
                exposure: np.ndarray | None = None):
    """The ranges again, now that every g_h = W_h q + b_h is known (identity 2 by design).

    Two selector sets at query tokens q_1, q_2, selector h scoring DESIGN_MARGIN on head h
    alone, payload mu_h (:func:`payload_weights`) on it. Payloads orthogonal to every
    g_h(q_k) do not move any score, so they are as large as the selectors (no precision is
    lost to the difference F(delta) - F(0)): set 1 spans g(q_1)^perp, set 2 the rest of
    R^d from g(q_2)^perp. Then M = (A P)(O P)^+ = sum_h mu_h P_h: R_h = ker(M - mu_h).
    d + 2 queries.

    ``payload`` scales the payloads (x the selectors' size). A payload is orthogonal to
    the g_h as *estimated*: against the true ones it scores |P| mu_h |g_h error|, which
    a full payload makes larger than the margin when W is far off (read through rough
    projectors); a smaller payload keeps the selectors saturated at the price of its
    answers' rounding (rounding / payload), so its eigenvalue slack is
    ``design.eigen_slack`` / payload, at most FIRST_PASS_SLACK (never below the full
    payload's: bfloat16's is wider than that).

    ``regroup`` (a pass that another one follows): ranks that merge blocks (some
    selector taken by no head, the others' ranks at least their blocks' widths, the
    same total) are the heads', not a contradiction. Random selectors read through rounding
    may split one head's range (measured: 1 + 7 for a head of rank 8, at cond(O) 1e5),
    and a block that holds part of a head reads no W of its own; the designed selectors,
    each taken by the head whose g_h it was built from, see the whole range. The next
    pass must find the same ranks.
    Returns the blocks' coordinate bases (as many as the heads found), the queries, the
    answers read (:class:`DesignedReads`: what rounding does to the ranges) and every
    head's reading rows (:func:`null_rows`, the score reads' projectors)."""
    H, d = len(widths), oracle.dim
    mu = payload_weights(H, centred=design.exact)
    if exposure is not None and design.exact:
        mu = ordered_payloads(mu, exposure)
    qs = s * np.stack([v / np.linalg.norm(v) for v in rng.standard_normal((2, d))])
    G = [(W @ q + b).T for q in qs]                                  # (d, H) each
    full = np.linalg.svd(G[0], full_matrices=True)[0]
    # set 2: g(q_1)'s directions, made orthogonal to g(q_2)
    payloads = [full[:, H:], _orth(G[0] - G[1] @ np.linalg.lstsq(G[1], G[0], rcond=None)[0])]
    Ys, Z, Ps, asked = [], [], [], 0
    for q, Gk, P in zip(qs, G, payloads):
        Delta = designed_selectors(Gk, DESIGN_MARGIN)
        P = P * np.max(np.linalg.norm(Delta, axis=1)) * payload
        y = _last(oracle, selector_probes(Delta, q, P, mu))
        Ys.append(E.T @ (y[1:] - y[0]).T)
        Z.append(E.T @ (O @ P))
        Ps.append(P)
        asked += len(y)
    Y = np.concatenate(Ys, axis=1)
    M = Y @ np.linalg.pinv(np.concatenate(Z, axis=1))
    slack = design.eigen_slack if payload >= 1.0 else \
        max(design.eigen_slack, min(FIRST_PASS_SLACK, design.eigen_slack / payload))
    spaces = dict(block_eigenspaces(M, np.concatenate([[0.0], mu]), slack))
    counts = [spaces[m].shape[1] if m in spaces else 0 for m in mu]
    merged = (regroup and sum(counts) == sum(widths)
              and all(n == 0 or n >= w for n, w in zip(counts, widths)))
    if counts != list(widths) and not merged:
        raise ModelMismatchError(f"designed selectors give ranks {counts} where the first "
                                 f"selectors found {list(widths)}: not independent heads")
    if merged:
        mu, widths = mu[np.array(counts) > 0], [n for n in counts if n]
    reads = DesignedReads(Y, np.linalg.pinv(np.concatenate(Ps, axis=1)), E.T @ O, mu,
                          list(widths), float(np.abs(y).max()))
    rows = null_rows(reads.Y @ reads.P_inv, reads.O, mu, widths)
    return blocks_of_rows(rows, widths), asked, reads, rows


@dataclass(frozen=True)
class DesignedReads:
    """The answers of the designed selectors (range coordinates): Y = A P (D, p), P^+
    (p, d), O (D, d), the weights mu and widths of the blocks, and the largest answer."""

    Y: np.ndarray
    P_inv: np.ndarray
    O: np.ndarray
    mu: np.ndarray
    widths: list[int]
    answer_size: float

    def range_spread(self, level: float, samples: int = RANGE_SAMPLES) -> float:
        """What rounding at ``level`` (relative to the largest answer, every answer
        number and every number of O) does to the heads' O_h = R_h L_h O through
        :func:`kernel_blocks`: the largest relative change (Frobenius, all heads) over
        ``samples`` draws (a fixed generator: no query, the same bar every run).
        Oblique ranges make it large (the projectors' norm reaches 1/angle):
        nn.MultiheadAttention(64, 8) seed 162, ranges 2e-4 apart, O_h off by 3.4e-3
        with a W-stage bar of 2e-3."""
        rng = np.random.default_rng(0)

        def heads(A, O):
            R = kernel_blocks(A, O, self.mu, self.widths)
            L = np.linalg.inv(np.concatenate(R, axis=1))
            bounds = np.cumsum([0] + self.widths)
            return np.stack([Rk @ L[a:b] @ O for Rk, (a, b)
                             in zip(R, itertools.pairwise(bounds))])

        base = heads(self.Y @ self.P_inv, self.O)
        worst = 0.0
        for _ in range(samples):
            dY = math.sqrt(2.0) * level * self.answer_size * rng.standard_normal(self.Y.shape)
            dO = level * float(np.abs(self.O).max()) * rng.standard_normal(self.O.shape)
            moved = heads((self.Y + dY) @ self.P_inv, self.O + dO)
            worst = max(worst, float(np.linalg.norm(moved - base) / np.linalg.norm(base)))
        return worst


def payload_weights(H: int, centred: bool = True) -> np.ndarray:
    """Designed selectors' payload weights mu_h (H,): ``centred``, -H/2 .. H/2 without 0
    (at least 1 apart and 1 from the query token's 0), else 1 .. H. The answers' rounding
    is relative to their size, which the largest |mu_h| sets, while the null spaces of
    A - mu_h O see the differences mu_g - mu_h only: centred weights halve the size for
    the same differences (MiniLM layer 0, seed 0: worst head's W 1.3e-10 with 1 .. H,
    8e-11 centred). Low precision keeps 1 .. H: a float32 nn.MultiheadAttention(64, 8)
    (seed 13) read through centred weights gave M an eigenvalue at -90, where 1 .. H
    gave 1.00 .. 8.00 (its rounding through cond(O) 5e5 is not 1e-11 but of order one)."""
    if not centred:
        return 1.0 + np.arange(H)
    mu = np.arange(H) - H // 2.0
    mu[mu >= 0] += 1.0
    return mu


def ordered_payloads(mu: np.ndarray, exposure: np.ndarray) -> np.ndarray:
    """The weights ``mu`` (H,) given to the heads in the order of their ``exposure`` (H,):
    the most exposed head the largest mu, at the end of the scale.

    A head's reading rows (:func:`null_rows`) leak the other heads' ranges by the rounding
    of A over mu_g - mu_h, and a head reads its scores through them at its own output's
    size against the others' outputs: a head of large W_h and small O_h (exposure
    |W_h| / |O_h|) suffers most. At the end of the scale it has one neighbour at 1 instead
    of two, every other head at least 2 away but one, and its neighbours are the next most
    exposed (MiniLM layer 0, seed 0: the worst head's W 8.0e-11 at mu in block order,
    3.1e-11 in exposure order; with its true rows 3.4e-11)."""
    rank = np.argsort(np.argsort(np.asarray(exposure, dtype=float), kind="stable"),
                      kind="stable")
    return np.sort(mu)[rank]


def kernel_blocks(A: np.ndarray, O: np.ndarray, mu: np.ndarray, widths) -> list[np.ndarray]:
    """The blocks' coordinate bases from A = sum_h mu_h O_h and O = sum_h O_h (range
    coordinates, (D, d) each) without inverting O: A - mu_h O = sum_g (mu_g - mu_h) O_g has
    range the other heads' ranges, so its r_h smallest left singular vectors are L_h (up to
    a basis change), with L_h O_g = 0 for g != h up to rounding of A (M = A (O P)^+ instead
    reads every range through O^{-1}: cond(O) x that rounding). R = [L_1; ...; L_H]^-1."""
    return blocks_of_rows(null_rows(A, O, mu, widths), widths)


def null_rows(A: np.ndarray, O: np.ndarray, mu: np.ndarray, widths) -> list[np.ndarray]:
    """Per head, the orthonormal rows (r_h, D) of the left null space of A - mu_h O (range
    coordinates, as :func:`kernel_blocks`): they vanish on every other head's range."""
    return [scipy.linalg.svd(A - m * O, lapack_driver="gesvd")[0][:, O.shape[0] - w:].T
            for m, w in zip(mu, widths)]        # gesvd: gesdd may fail to converge here


def blocks_of_rows(rows: list[np.ndarray], widths) -> list[np.ndarray]:
    """The blocks' coordinate bases R = [L_1; ...; L_H]^-1 from the rows of
    :func:`null_rows`."""
    R = np.linalg.inv(np.concatenate(rows, axis=0))
    bounds = np.cumsum([0] + list(widths))
    return [R[:, a:b] for a, b in itertools.pairwise(bounds)]


# -- stage 3: the scores ------------------------------------------------------------------

def score_probes(q: np.ndarray, U: np.ndarray, tau: np.ndarray) -> np.ndarray:
    """[q_b + tau_b u_1, ..., q_b + tau_b u_p, q_b] for every row q_b: (B, p + 1, d)."""
    B, d = q.shape
    X = np.empty((B, U.shape[1] + 1, d))
    X[:, :-1] = q[:, None, :] + tau[:, None, None] * U.T[None]
    X[:, -1] = q
    return X


def weight_logits(a: np.ndarray) -> np.ndarray:
    """ln(a_i / alpha_N) (B, p) from the weights a (B, p) of the first p tokens
    (alpha_N = 1 - sum a); a weight outside (0, 1) gives NaN."""
    last = 1.0 - a.sum(axis=1, keepdims=True)
    ok = (a > 0) & (last > 0)
    return np.where(ok, np.log(np.where(ok, a, 1.0) / np.where(last > 0, last, 1.0)), np.nan)


class Projected:
    """Reads every head's weights through the oblique projectors: L_h (y - c) - C_h q =
    tau C_h U a, a by least squares (p < r_h)."""

    def __init__(self, c, L, C):
        self.c, self.L, self.C = c, L, C

    def __call__(self, y, q, U, tau) -> list[np.ndarray]:
        out = []
        for Lh, Ch in zip(self.L, self.C):
            w = (Lh @ (y - self.c).T - Ch @ q.T) / tau            # (r_h, B)
            out.append(weight_logits(np.linalg.lstsq(Ch @ U, w, rcond=None)[0].T))
        return out


class ScoreReads:
    """Score probes of many q's through the blocks U_j of a frame, one query per (q, block),
    kept (q, tau, answers): they are read again once the projectors are known better."""

    def __init__(self, oracle: Oracle, c: np.ndarray, blocks: list[np.ndarray]):
        self.oracle, self.c, self.blocks = oracle, c, blocks
        self.frame = np.concatenate(blocks, axis=1)
        self.q = np.empty((0, oracle.dim))
        self.tau = np.empty(0)
        self.y = np.empty((len(blocks), 0, len(c)))

    def _answers(self, q, tau) -> np.ndarray:
        if len(q) == 0:                 # nothing to ask (a small d can leave no new row)
            return np.empty((len(self.blocks), 0, len(self.c)))
        X = np.concatenate([score_probes(q, U, tau) for U in self.blocks])
        return _last(self.oracle, X).reshape(len(self.blocks), len(q), -1)

    def ask(self, q: np.ndarray, tau: np.ndarray) -> np.ndarray:
        """Ask every block for the rows q (B, d); returns their row indices."""
        rows = np.arange(len(self.q), len(self.q) + len(q))
        self.q, self.tau = np.concatenate([self.q, q]), np.concatenate([self.tau, tau])
        self.y = np.concatenate([self.y, self._answers(q, tau)], axis=1)
        return rows

    def reordered(self, rows: np.ndarray) -> np.ndarray:
        """The probes of ``rows`` again with the tokens before the query token reversed:
        the same exact answers (softmax attention does not see their order), the box's
        rounding taken again. (blocks, len(rows), m)."""
        q, tau = self.q[rows], self.tau[rows]
        X = np.concatenate([score_probes(q, U, tau) for U in self.blocks])
        X[:, :-1] = X[:, -2::-1].copy()
        return _last(self.oracle, X).reshape(len(self.blocks), len(rows), -1)

    def reask(self, rows: np.ndarray, tau: np.ndarray) -> None:
        self.tau[rows] = tau
        self.y[:, rows] = self._answers(self.q[rows], tau)

    def scores(self, reader, rows=slice(None), answers=None) -> list[np.ndarray]:
        """Per head, frame^T g_h(q) (B, frame width) for the given rows, the weights read
        by ``reader`` (:class:`Projected`) from the answers kept (or ``answers``,
        (blocks, B, m))."""
        q, tau = self.q[rows], self.tau[rows]
        y = self.y[:, rows] if answers is None else answers
        per_block = [reader(yk, q, U, tau) for U, yk in zip(self.blocks, y)]
        return [np.concatenate([b[h] for b in per_block], axis=1) / tau[:, None]
                for h in range(len(per_block[0]))]


def frame_blocks(rng, d: int, p: int, C: list[np.ndarray]) -> list[np.ndarray]:
    """An orthonormal frame of R^d cut into ceil(d / p) blocks of p columns (the last filled
    up with columns of another rotation): the best of FRAME_TRIES random ones by the worst
    condition number of C_h U_j over heads and blocks (each block reads every head)."""
    nb = -(-d // p)
    best, best_cond = None, np.inf
    for _ in range(FRAME_TRIES):
        F = np.concatenate([_rotation(rng, d), _rotation(rng, d)[:, : nb * p - d]], axis=1)
        blocks = [F[:, k * p:(k + 1) * p] for k in range(nb)]
        worst = max(_cond(Ch @ U) for Ch in C for U in blocks)
        if worst < best_cond:
            best, best_cond = blocks, worst
    assert best is not None                 # some frame has a finite condition number
    return best


def scaled_reads(reads: ScoreReads, q: np.ndarray, guess: float, L, C, *,
                 tiny_logit: float = TINY_LOGIT) -> np.ndarray:
    """Ask the rows q with tau set so that the largest |logit| is about TARGET_LOGIT: first
    tau = TARGET_LOGIT / guess, then rows whose logits came out unreadable (a weight outside
    (0, 1): saturated, or a small weight swamped by the first projectors' error) or far from
    the target asked again: at the measured scale, never again at or above a scale that
    failed. Returns the rows."""
    rows = reads.ask(q, np.full(len(q), TARGET_LOGIT / guess))
    failed = np.full(len(q), np.inf)              # smallest tau that gave unreadable weights
    before = np.full((2, len(q)), np.nan)         # the last (tau, peak) of each row
    for _ in range(MAX_RESCALES):
        tau = reads.tau[rows]
        scores = reads.scores(Projected(reads.c, L, C), rows)
        peak = np.max([np.abs(s).max(axis=1) for s in scores], axis=0) * tau
        # g ~ 0: any scale reads it. Either below the tiny level, or a read's own noise:
        # the logits u^T g tau grow with tau, noise does not (a bias-free layer's row
        # q = 0 read 2.2e-11 at tau 79 and 1.7e-11 at tau 7e12: refused as not softmax)
        with np.errstate(invalid="ignore", divide="ignore"):
            flat = (tau > NOISE_GROWTH * before[0]) & (peak < 2.0 * before[1])
        tiny = (peak < tiny_logit * TARGET_LOGIT) | flat
        before = np.array([tau, peak])
        lost = ~np.isfinite(peak)
        failed[lost] = np.minimum(failed[lost], tau[lost])
        bad = lost | (peak > PEAK_BAND * TARGET_LOGIT) | ((peak < TARGET_LOGIT / 64) & ~tiny)
        if not bad.any():
            return rows
        want = np.where(lost, tau / 4, TARGET_LOGIT * tau / np.maximum(peak, 1e-300))
        reads.reask(rows[bad], np.minimum(want, failed / 2)[bad])
    raise ModelMismatchError("score probes imply attention weights outside (0, 1), or "
                             "logits far from their target, at every scale tried: not "
                             "softmax attention")


def best_frame(rng, d: int, width: int, bases: list[np.ndarray], C: list[np.ndarray],
               p: int) -> tuple[list[np.ndarray], float]:
    """width / p blocks of p orthonormal columns, the best of FRAME_TRIES random ones by the
    worst condition number of U^T B_h (reading g_h in its column space) and C_h U_j
    (reading a head's weights). Returns (blocks, that condition number)."""
    best, best_cond = None, np.inf
    for _ in range(FRAME_TRIES):
        F = np.concatenate([_rotation(rng, d), _rotation(rng, d)], axis=1)[:, :width]
        blocks = [F[:, k * p:(k + 1) * p] for k in range(width // p)]
        worst = max([_cond(F.T @ B) for B in bases if B.shape[1]]
                    + [_cond(Ch @ U) for Ch in C for U in blocks])
        if worst < best_cond:
            best, best_cond = blocks, worst
    assert best is not None                 # some frame has a finite condition number
    return best, best_cond


def k_stage_directions(rank: int, d: int) -> int:
    """How many directions the K-stage reads whole for W_h of rank up to ``rank``:
    (sqrt(rank) + 1)^2, at least rank + K_EXTRA, at most d.

    K_h's error is what the W-stage carries into every column of W_h, and it falls as the
    smallest singular value of the K columns within K_h grows: about sqrt(K) - sqrt(rank)
    times a column's size (a rank x K Gaussian matrix), 1 here, 0.26 at rank + 3 for rank
    32. MiniLM layer 0 with rank + 3 (35): a head's W_h off by 1.1e-10 on one run in five,
    the rest within 4.7e-11; with 45, every head within 3.4e-11 over five seeds, 147
    queries more (2,802 to 2,923 with the held-out check, the floor 1,474)."""
    return min(max(rank + K_EXTRA, math.ceil((math.sqrt(rank) + 1.0) ** 2)), d)


class ScorePlan:
    """The score probes of identity 4 (K-stage and W-stage reads) and how to solve them.

    K-stage: q = 0 (b_h) and K = max r_h + 1 directions s q_k, each read whole through a
    frame of ceil(d / p) blocks; W_h q_k spans W_h's column space K_h. W-stage: every other
    direction, read through a frame conditioned against every K_h (OVERSAMPLE x rank)."""

    def __init__(self, oracle: Oracle, c, L, C, rng, kappa: float, widths: list[int], *,
                 tiny_logit: float = TINY_LOGIT):
        d = oracle.dim
        self.tiny_logit = tiny_logit
        self.p = max(1, int(TOKEN_SHARE * min(widths)))
        self.K = k_stage_directions(max(widths), d)
        self.Qq = _rotation(rng, d)
        self.k_reads = ScoreReads(oracle, c, frame_blocks(rng, d, self.p, C))
        scaled_reads(self.k_reads, np.stack([np.zeros(d), self.Qq[:, 0]]), kappa, L, C,
                     tiny_logit=tiny_logit)
        b, w1 = self._first(L, C)
        omega = float(np.max(np.linalg.norm(w1, axis=1)))
        if omega == 0:
            raise RecoveryFailedError("the scores do not depend on the query token (W = 0)")
        self.s = Q_SCALE / math.sqrt(omega)
        guess = float(np.max(np.abs(self.k_reads.frame.T @ (b + self.s * w1).T)))
        scaled_reads(self.k_reads, (self.Qq[:, 1:self.K] * self.s).T, guess, L, C,
                     tiny_logit=tiny_logit)
        bases = self.column_spaces(Projected(c, L, C))[1]
        rho = max(B.shape[1] for B in bases)
        width = min(-(-math.ceil(OVERSAMPLE * rho) // self.p), -(-d // self.p)) * self.p
        blocks, self.cond_W = best_frame(rng, d, width, bases, C, self.p)
        self.w_reads = ScoreReads(oracle, c, blocks)
        scaled_reads(self.w_reads, (self.Qq[:, self.K:] * self.s).T, guess, L, C,
                     tiny_logit=tiny_logit)
        self.cond_K = max(_cond(Ch @ U) for Ch in C for U in self.k_reads.blocks)

    def _first(self, L, C):
        solve = np.linalg.pinv(self.k_reads.frame.T)
        first = self.k_reads.scores(Projected(self.k_reads.c, L, C), slice(0, 2))
        b = np.stack([solve @ f[0] for f in first])
        return b, np.stack([solve @ f[1] for f in first]) - b

    def column_spaces(self, reader):
        """b (H, d), the K-stage columns W_h q_k (H, d, K) and bases of their spans (a span
        as wide as K: no rank deficiency seen, the whole R^d)."""
        d = self.Qq.shape[0]
        solve = np.linalg.pinv(self.k_reads.frame.T)
        g = [s @ solve.T for s in self.k_reads.scores(reader)]       # (K + 1, d) per head
        b = np.stack([gh[0] for gh in g])
        cols = np.stack([(gh[1:] - gh[0]).T for gh in g])
        # b_h = W_k,h^T b_q,h / sqrt(d_h) lies in W_h's column space: one more column
        # when it is of the columns' size (a b_h ~ 0 read as rounding would add a
        # direction of noise to the span, and W-stage width with it)
        bases = [_column_space(np.concatenate([ch, bh[:, None]], axis=1)
                               if np.linalg.norm(bh) > BIAS_COLUMN * np.abs(ch).max()
                               else ch) for ch, bh in zip(cols, b)]
        return b, [B if B.shape[1] < self.K else np.eye(d) for B in bases], cols

    def solve(self, reader):
        """W (H, d, d), b (H, d) and the ranks of the W_h, from every read (weights read
        by ``reader``)."""
        b, bases, cols = self.column_spaces(reader)
        F = self.w_reads.frame
        more = self.w_reads.scores(reader)
        norms = np.concatenate([[1.0], np.full(len(self.Qq) - 1, self.s)])
        W = np.empty((len(b),) + self.Qq.shape)
        self.spread = self.misfit = 0.0
        for h, (B, seen) in enumerate(zip(bases, more)):
            target = (seen - F.T @ b[h]).T                        # F^T W_h q, (width, B)
            beta = np.linalg.lstsq(F.T @ B, target, rcond=None)[0]
            W[h] = (np.concatenate([cols[h], B @ beta], axis=1) / norms) @ self.Qq.T
            # the misfit of width numbers by rank(W_h) unknowns: the reads' own noise,
            # amplified by cond(F^T B) into beta
            # (no rows beyond the columns at a small d: nothing misfits)
            misfit = (float(np.linalg.norm(F.T @ B @ beta - target) / np.linalg.norm(target))
                      if np.any(target) else 0.0)
            self.spread = max(self.spread, misfit * _cond(F.T @ B))
            self.misfit = max(self.misfit, misfit)
        return W, b, [B.shape[1] for B in bases]

    def read_noise(self, reader, b: np.ndarray, rows: int = READ_NOISE_ROWS) -> float:
        """The W-stage reads' own rounding, measured: the first ``rows`` rows asked again
        with their tokens reordered (rows x blocks queries), read by ``reader``; the
        largest relative change of F^T W_h q over the heads. What the W-stage misfit may
        be if the box is the model: its rounding."""
        if not len(self.w_reads.q):     # K = d: every direction read whole, no misfit
            return 0.0
        picked = np.arange(min(rows, len(self.w_reads.q)))
        again = self.w_reads.reordered(picked)
        F = self.w_reads.frame
        first = self.w_reads.scores(reader, picked)
        second = self.w_reads.scores(reader, picked, again)
        return max(float(np.linalg.norm(s2 - s1) / np.linalg.norm(s1 - F.T.dot(bh).T))
                   for s1, s2, bh in zip(first, second, b))

    @property
    def condition(self) -> float:
        return max(self.cond_K, self.cond_W)


def check_options(oracle: Oracle, heads, biases, ranks) -> None:
    if oracle.outputs == "scalar":
        raise InputError("vector-layer reads vector answers; this black box answers one "
                         "number per sequence (use multi-head-low-rank)")
    if heads is not None and (not isinstance(heads, (int, np.integer)) or heads < 1):
        raise InputError(f"heads must be a positive integer, got {heads!r}")
    if biases not in (None, True, False):
        raise InputError(f"biases must be True, False or None (found), got {biases!r}")
    if ranks is not None and (np.ndim(ranks) > 1 or np.any(np.asarray(ranks) < 1)):
        raise InputError(f"ranks must be a positive integer or one per head, got {ranks!r}")


def check_found(widths: list[int], heads, ranks, c, b, biases, W_scale,
                b_tol: float = 1e-9) -> None:
    """What was found against what the user stated: refuse a contradiction (b_h above
    ``b_tol`` x the largest |W| entry is a query bias)."""
    if heads is not None and len(widths) != heads:
        raise ModelMismatchError(f"{len(widths)} independent output ranges were found where "
                                 f"{heads} heads were stated")
    if ranks is not None:
        stated = sorted(np.broadcast_to(np.asarray(ranks), (len(widths),)).tolist()) \
            if np.ndim(ranks) == 0 or len(np.atleast_1d(ranks)) == len(widths) else None
        if stated is None or stated != sorted(widths):
            raise ModelMismatchError(f"the heads' output ranks are {sorted(widths)}, not "
                                     f"the stated {ranks}")
    if biases is False and (np.any(np.abs(c) > 0) or np.max(np.abs(b)) > b_tol * W_scale):
        raise ModelMismatchError("the black box has biases (F([0]) != 0 or query biases) "
                                 "where none were stated: extract with biases=None or True")


def parameter_count(d: int, m: int, widths, ranks_W, biases: bool) -> int:
    """Free parameters of the canonical layer: per head r(m + d - r) for O_h,
    rho(2d - rho) for W_h (rank rho), rho for b_h; m for c."""
    total = m
    for r, rho in zip(widths, ranks_W):
        total += r * (m + d - r) + rho * (2 * d - rho) + (rho if biases else 0)
    return total


def extract_vector_layer(oracle: Oracle, *, seed=None,
                         verify_tolerance: float = DEFAULT_VERIFY_TOLERANCE, heads=None,
                         biases=None, ranks=None,
                         output_dtype: str | None = None) -> ExtractionResult:
    """Recover a standard attention layer (several heads, independent output ranges) from
    vector answers: every head's canonical W_h, b_h, O_h and the constant c.

    Parameters
    ----------
    oracle : Oracle
        Door to the black box: answers (B, m) at the last position or (B, N, m) at every
        position (then ``oracle.causal`` must be stated).
    seed : int, optional
        Seed of the random probe designs and of the held-out verification.
    verify_tolerance : float
        Largest held-out relative output error accepted as a match.
    heads : int, optional
        H, if known: the number of ranges found is checked against it.
    biases : bool, optional
        None: found (c and b_h are measured either way); False: a box with biases is
        refused; True: biases expected.
    ranks : int or sequence of int, optional
        The heads' output ranks r_h, if known: checked against those found.
    output_dtype : {"float64", "float32", "bfloat16", "float16"}, optional
        The box runs its forward pass in this dtype (a PyTorch module in float32, say):
        the random selector sets use larger payloads and fewer selectors, every check's
        slack is scaled to the dtype's level, the error bar is measured from the score
        reads' misfit, and held-out verification allows that level (LOW_VERIFY x it)
        plus twice the bar. Default: float64 answers.

    Returns
    -------
    ExtractionResult
        ``model`` a :class:`VectorAttention` with W (H, d, d), O (H, m, d), b (H, d),
        c (m,), answering as the box does (last or every position, causal as stated).

    Raises
    ------
    ModelMismatchError
        The answers are not those of such a layer (selector probes not linear in the
        payload, weights outside (0, 1), held-out verification failed, a stated H or
        rank contradicted).
    RecoveryFailedError
        The answers show no dependence on the scores, or W = 0.
    """
    check_options(oracle, heads, biases, ranks)
    design = layer_design(output_dtype)
    # answers of any size (1e-300 .. 1e300) are learned on an exact 2^k rescaling
    return on_scaled_outputs(oracle, lambda view: _extract_vector_layer(
        view, seed=seed, verify_tolerance=verify_tolerance, heads=heads, biases=biases,
        ranks=ranks, design=design))


def _extract_vector_layer(oracle, *, seed, verify_tolerance, heads, biases, ranks,
                          design: Design):
    """:func:`extract_vector_layer` on the (rescaled) view ``oracle``."""
    start, start_q, start_bb = time.perf_counter(), oracle.queries, oracle.black_box_seconds
    start_numbers, start_tokens = oracle.numbers, oracle.tokens
    rng = np.random.default_rng(seed)
    d = oracle.dim
    c, O = constant_and_outputs(oracle)
    if oracle.outputs == "all" and oracle.causal is None:
        raise InputError("every-position answers: state whether the box is causal "
                         "(Oracle(..., causal=True/False), --causal)")
    E = _orth(O)
    if E.shape[1] == 0:
        raise RecoveryFailedError("O = 0: every head's output is zero, nothing to recover")
    counts = {"c and O (single tokens)": oracle.queries - start_q}
    q_pilot, u_pilot = (v / np.linalg.norm(v) for v in rng.standard_normal((2, d)))
    kappa = logit_scale(oracle, O, c, q_pilot, u_pilot)
    counts["pilot"] = oracle.queries - start_q - sum(counts.values())
    for attempt in range(1 + (0 if design.exact else LOW_RESTARTS)):
        try:
            blocks, sets = rough_ranges(oracle, O, c, E, rng, rough_query_norm(d) * q_pilot,
                                        SELECT_LOGIT / kappa,
                                        design=design)
            counts["ranges (random selectors)"] = (counts.get("ranges (random selectors)", 0)
                                                   + oracle.queries - start_q
                                                   - sum(counts.values()))
            widths = blocks.widths
            L, C, R = projectors(E, blocks, O)
            plan = ScorePlan(oracle, c, L, C, rng, kappa, widths,
                             tiny_logit=design.tiny_logit)
            counts["scores (W_h, b_h)"] = (counts.get("scores (W_h, b_h)", 0) + oracle.queries
                                           - start_q - sum(counts.values()))
            W, b, _ = plan.solve(Projected(c, L, C))
            for k, payload in enumerate(design.fine_payloads):  # low precision: small first
                if k:   # W through the last pass's ranges: g_h for the next selectors
                    L, C, R = projectors(E, blocks, O)
                    if blocks.widths != widths:
                        # blocks merged (a head's range had been split): the score probes
                        # again, sized for the heads' ranks (a block of rank 1 had made
                        # them one token wide, where reordering measures no rounding)
                        widths = blocks.widths
                        plan = ScorePlan(oracle, c, L, C, rng, kappa, widths,
                                         tiny_logit=design.tiny_logit)
                    W, b, _ = plan.solve(Projected(c, L, C))
                blocks.R, _, designed, rows = fine_ranges(
                    oracle, O, E, W, b, blocks.widths, rng, plan.s, design=design,
                    payload=payload, regroup=k + 1 < len(design.fine_payloads),
                    exposure=head_exposure(W, C, R))
            widths = blocks.widths
            counts["ranges (designed selectors)"] = (
                counts.get("ranges (designed selectors)", 0) + oracle.queries - start_q
                - sum(counts.values()))
            break
        except ModelMismatchError as refusal:
            log.debug("attempt %d refused: %s", attempt, refusal)
            # low precision: a random selector set read through an ill-conditioned O may
            # group its eigenvalues wrongly (a head's range split), and the score reads
            # then fail; new random sets from the start. An impostor fails every time.
            if attempt == LOW_RESTARTS or design.exact:
                raise
            counts["restarts (low precision)"] = (counts.get("restarts (low precision)", 0)
                                                  + oracle.queries - start_q
                                                  - sum(counts.values()))
    L, C, R = projectors(E, blocks, O)
    O_h = np.stack([Rh @ Ch for Rh, Ch in zip(R, C)])
    # the same answers, final ranges, read through the orthonormal null-space rows: rows
    # of R^-1 carry cond(R) x the rounding of the inverse (MiniLM layer 5, cond(R) 7e4:
    # another head leaked 2.5e-12 into a read, 4.7e-14 through the orthonormal rows)
    L, C = reading_rows(E, rows, O)
    W, b, ranks_W = plan.solve(Projected(c, L, C))
    rounding = 0.0
    if not design.exact:
        # what low precision may widen is set by the box's measured rounding alone: the
        # W-stage misfit must be what reordered reads show, or the misfit is the box's
        # (a float64 box off the model by 1e-4, stated as float32, is refused here)
        noise = plan.read_noise(Projected(c, L, C), b)
        if not plan.misfit <= MISFIT_LIMIT * noise:
            raise ModelMismatchError(
                f"the score reads misfit a layer's scores by {plan.misfit:.1e} (relative) "
                f"where the box's own rounding (the same reads with reordered tokens) "
                f"moves them by {noise:.1e}: the misfit is not the {design.name} rounding")
        rounding = permutation_rounding(oracle, rng, plan.s,
                                        limit=min(ORDER_LIMIT, ORDER_ROUNDING * design.rho))
        counts["rounding (reordered tokens)"] = (oracle.queries - start_q
                                                 - sum(counts.values()))
    bar = error_bar(plan, rounding)
    if not design.exact:
        # O_h's own error: the rounding carried through the ranges (oblique ranges
        # amplify it), which the W-stage misfit does not see
        bar = max(bar, designed.range_spread(rounding))
    check_found(widths, heads, ranks, c, b, biases, float(np.max(np.abs(W))),
                b_tol=1e-9 if design.exact else BAR_SAFETY * bar)
    positions = "all" if oracle.outputs == "all" else "last"
    model = VectorAttention(W, O_h, b, c, positions=positions,
                            causal=bool(oracle.causal) if positions == "all" else False)
    has_biases = bool(np.any(c) or np.any(b)) if biases is None else biases
    params = parameter_count(d, O.shape[0], widths, ranks_W, has_biases)
    counts["recovery"] = oracle.queries - start_q
    n_verify = verification_count(params, counts["recovery"])
    if not design.exact:
        # the box itself is off from any exact model by its own rounding: held-out
        # tolerance LOW_VERIFY x its level plus twice the measured bar (the same rule as
        # vector-single-head's)
        verify_tolerance = max(verify_tolerance, LOW_VERIFY * rounding + 2.0 * bar)
    # in float64 the bar is measured from the reads' own misfit (misfit_bar); in low
    # precision it comes from the measured rounding, and the design refuses a misfit beyond it
    verification = verify_model(oracle, model, count=n_verify, seed=seed,
                                tolerance=verify_tolerance,
                                expected_error=misfit_bar(bar, verify_tolerance)
                                if design.exact else bar)
    report = Report(
        kind=model.kind, dim=d, queries=oracle.queries - start_q,
        breakdown={**counts, "verification": n_verify}, floor=-(-params // O.shape[0]),
        verification=verification, seconds=time.perf_counter() - start,
        black_box_seconds=oracle.black_box_seconds - start_bb,
        details={"numbers received": oracle.numbers - start_numbers,
                 "tokens sent": oracle.tokens - start_tokens,
                 "heads found": len(widths), "output ranks r_h": widths,
                 "ranks of W_h": ranks_W, "random selector sets": sets,
                 "parameters": params, "error bar": bar, "frame condition": plan.condition,
                 "precision": design.name, "measured rounding": rounding,
                 "floor": f"{params} parameters / {O.shape[0]} numbers per query"})
    return checked_result(model, report, "a standard attention layer with independent "
                          "head output ranges")


def rough_ranges(oracle, O, c, E, rng, q, scale, *,
                 design: Design = FLOAT64) -> tuple[Blocks, int]:
    """Identity 2 with random selectors: a first set with payloads spanning R^d, then sets
    (each at a new unit query token) with payloads for the widest block, until one splits
    nothing (at most MAX_SETS; ``design`` for low precision).

    In float64 a set refused after its retries starts the stage again from a new first
    set (at most ROUGH_RESTARTS times): a near-tie in an accepted set (a head not quite
    saturated) leaks into the blocks' projectors, and every later set then misfits by
    that leak, whatever its own selectors (measured: a first set at misfit 3.4e-9 left
    later sets at 1e-8 .. 2.6e-7; with 16x the selector scale, 1e-12).
    Returns the blocks and the number of sets."""
    for _ in range(ROUGH_RESTARTS if design.exact else 0):
        try:
            return _selector_sets(oracle, O, c, E, rng, q, scale, design)
        except ModelMismatchError:
            q = rough_query_norm(len(q)) * _unit(rng, len(q))
    return _selector_sets(oracle, O, c, E, rng, q, scale, design)


def _selector_sets(oracle, O, c, E, rng, q, scale, design: Design) -> tuple[Blocks, int]:
    """The selector sets of :func:`rough_ranges`, from one first set.

    Float64: after a set, AGREE_TESTS agreement tests in a row (:func:`heads_agree`, 3
    queries each) end the stage; a test that finds a block whose heads took different
    selectors asks another full set. Two heads whose g_h point alike take the same
    random selector often (all-MiniLM-L6-v2: some pair shares one in half the first
    sets), and a full set that happened to split nothing used to end the stage with the
    pair in one block (layer 1 seed 15: refused by the designed selectors); three tests
    at new query tokens cost 9 queries against a full set's 43.
    Low precision: sets until LOW_QUIET_SETS in a row split nothing. With 8 selectors two
    heads take one now and then, and a stage that ended at the first set splitting
    nothing left such a pair in one block, which the designed selectors refused, and
    every stage started again (about 1,500 queries): float32 nn.MultiheadAttention(64, 8),
    seeds 0..199, runs above 2,500 queries went from 10 to 1, the mean from 1,368 to
    1,320."""
    d = len(q)
    blocks = Blocks(E)
    agreed, sets, quiet = 0, 0, 0
    while sets < design.max_sets:
        if sets and design.exact and agreed < AGREE_TESTS:
            q = rough_query_norm(d) * _unit(rng, d)
            if heads_agree(oracle, O, blocks, rng, q, scale, design.payload):
                agreed += 1
                continue
        elif sets and design.exact:
            break
        if sets:        # a new query token: heads whose scores agree at one q part at another
            q = rough_query_norm(d) * _unit(rng, d)
        for attempt in range(design.retries + 1):
            payload = design.payload / design.payload_cut ** attempt
            if not sets and design.first_payload:   # halved down to the others' on a retry
                payload = max(payload, design.first_payload / 2.0 ** attempt)
            try:
                split, _ = split_ranges(oracle, O, c, blocks, rng, q, scale, payload,
                                        design=design)
                break
            except ModelMismatchError as refusal:
                log.debug("selector set %d, try %d refused (widths %s): %s", sets, attempt,
                          blocks.widths, refusal)
                # random selectors leave a margin below the payload's reach now and then:
                # new selectors at a new q, a smaller payload; an impostor fails every time
                if attempt == design.retries:
                    raise
                q = rough_query_norm(d) * _unit(rng, d)
        sets += 1
        agreed = 0
        quiet = 0 if split else quiet + 1
        if sets > 1 and quiet >= LOW_QUIET_SETS and not design.exact:
            break
    return blocks, sets


def heads_agree(oracle: Oracle, O: np.ndarray, blocks: Blocks, rng, q: np.ndarray,
                scale: float, payload: float) -> bool:
    """One agreement test: a random selector set at query token ``q`` with AGREE_PAYLOADS
    payloads (3 queries). In a block whose heads all took selectors of one weight kappa,
    L_k (A delta) = kappa L_k (O delta) for every payload; heads that took different
    weights (or the query token, weight 0) leave a misfit of order the weights' spacing.
    Returns whether every block is one multiple of its payload images to AGREE_TOL (of
    |L_k O delta|: a block whose heads all took the query token answers 0)."""
    d = oracle.dim
    n = min(SELECTORS, (oracle.max_length or SELECTORS + 1) - 1)
    mu = rng.permutation(np.linspace(1.0, 2.0, n))
    P = payload * scale * _orth(rng.standard_normal((d, AGREE_PAYLOADS)))
    _, Y, Z = selector_reads(oracle, O, blocks.E, rng, q, scale, P, mu)
    for Lk in blocks.left_inverse():
        LY, LZ = Lk @ Y, Lk @ Z
        kappa = float(np.vdot(LZ, LY) / np.vdot(LZ, LZ))
        misfit = float(np.linalg.norm(LY - kappa * LZ) / np.linalg.norm(LZ))
        log.debug("agreement test: width %d, kappa %.4f, misfit %.2e", Lk.shape[0], kappa,
                  misfit)
        if not misfit <= AGREE_TOL:
            return False
    return True


def permutation_rounding(oracle: Oracle, rng, scale: float, sequences: int = ROUNDING_SEQUENCES,
                         length: int = ROUNDING_LENGTH, limit: float = ORDER_LIMIT) -> float:
    """The answers' own rounding, measured: softmax attention does not depend on the
    order of the tokens before the query token, so a sequence and the same sequence with
    those tokens reversed have the same exact answer; what differs is the box's rounding
    (its sums taken in another order). Returns the largest difference relative to the
    largest answer, over ``sequences`` pairs of ``length`` tokens of norm ``scale``
    (2 x ``sequences`` queries, one batch). A float64 box told low precision measures
    ~1e-16 here, so its bar and held-out tolerance stay those of float64.

    A box whose answers depend on that order by more than ``limit`` (relative) is not
    softmax attention, nor rounding: refused."""
    d = oracle.dim
    length = min(length, oracle.max_length or length)
    X = rng.standard_normal((sequences, length, d))
    X *= scale / np.linalg.norm(X, axis=2, keepdims=True)
    swapped = X.copy()
    swapped[:, :-1] = X[:, -2::-1]
    y = _last(oracle, np.concatenate([X, swapped]))
    size = float(np.abs(y).max())
    level = float(np.abs(y[:sequences] - y[sequences:]).max()) / size if size > 0 else 0.0
    if not level <= limit:
        raise ModelMismatchError(
            f"the answers change by {level:.1e} (relative) when the tokens before the query "
            f"token are reordered: softmax attention does not depend on their order")
    return level


def projectors(E: np.ndarray, blocks: Blocks, O: np.ndarray):
    """L_h (r_h, m) with L_h O_g = 0 for g != h, C_h = L_h O (r_h, d) and range bases
    R_h (m, r_h): O_h = R_h C_h."""
    L = [Lk @ E.T for Lk in blocks.left_inverse()]
    return L, [Lh @ O for Lh in L], [E @ Rk for Rk in blocks.R]


def head_exposure(W: np.ndarray, C: list[np.ndarray], R: list[np.ndarray]) -> np.ndarray:
    """|W_h|_F / |O_h|_2 per head (H,) from the current estimates (O_h = R_h C_h, as
    :func:`projectors` gives them): how much a head's score reads suffer from another
    head's leak (:func:`ordered_payloads`)."""
    size = np.array([np.linalg.norm(Rh @ Ch, 2) for Rh, Ch in zip(R, C)])
    return np.linalg.norm(W, axis=(1, 2)) / np.maximum(size, np.finfo(float).tiny)


def reading_rows(E: np.ndarray, rows: list[np.ndarray], O: np.ndarray):
    """The score reads' projectors from orthonormal null-space rows (:func:`null_rows`,
    range coordinates): L_h = rows_h E^T (r_h, m), with L_h O_g = 0 for g != h, and
    C_h = L_h O. The same rows of R^-1 up to a basis change per head (which the reads'
    least squares do not see), without the inverse's rounding."""
    L = [Rw @ E.T for Rw in rows]
    return L, [Lh @ O for Lh in L]


def error_bar(plan: ScorePlan, rounding: float = 0.0) -> float:
    """Relative parameter error bar, measured: the W-stage reads more numbers (OVERSAMPLE x
    the rank) than each W_h q has unknowns, so their misfit is the reads' own noise (range
    errors leaking through the projectors, rounding), amplified by cond(F^T K_h) into W.
    BAR_SAFETY covers the K-stage columns and b, read by the same probes."""
    return float(BAR_SAFETY * max(plan.spread, EPS, rounding))
