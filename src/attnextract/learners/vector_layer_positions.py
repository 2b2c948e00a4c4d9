"""A standard attention layer from every-position answers: the scores read at every position.

Model (docs/algorithms.md, "Vector outputs"): at every position j

    F_j(X) = sum_h O_h X^T softmax(X (W_h x_j + b_h)) + c        in R^m,

(causal: position j's softmax runs over i <= j only), the heads' output ranges R_h =
range(O_h) independent, as in :mod:`attnextract.learners.vector_layer`, whose pieces this
learner shares. Every position changes four stages: O, the rough ranges (every position
of a query reads every head's sign), the scores, and the fine ranges.

O in about k + (d - k) / T queries, not d + 1 (from d = 32, where circles fit). The
circles need only c, O on the pilot's two tokens and range(O), whose basis E is read
from the answers to two queries of random tokens (every F_j - c lies in it). Then O on a
random k-dimensional subspace S_1 from single tokens (one token takes all of every
head's weight: F = c + O u), the score queries whose tokens lie in S_1, and from them the
layer restricted to S_1 (W'_h = S_1^T W_h S_1, b'_h). With W', T query tokens q_t in S_1
and T selectors z_t in S_1 are designed so that at q_t EVERY head scores a margin on z_t
and 0 on the other selectors (H T <= 0.75 k score vectors g'_h(q_t), each margin in
proportion to |g'_h(q_t)|). A payload v orthogonal to S_1 on selector t moves the
scores by v^T g_h(q_t), which S_1 does not see: about |g'_h| / sqrt(k) (at most 4.6
times that on MiniLM). Payloads sized so that 8 times that shift is 60, against margins
of 200, leave every head saturated, so F_t(v) - F_t(0) = a O v exactly: T directions of
O per query. k and T
minimise k + 1 + ceil((d - k) / T) with k at least twice the core tokens (which lie in
S_1: W_h restricted to S_1 must show its column space well conditioned): MiniLM 80
single tokens and 62 designed queries of 5 directions, where d + 1 single tokens took
385. O's error grows by the ratio of
selector to payload (about 30): MiniLM's W within 3e-11, as against 1.3e-11. Once O is
known its own range must be the one read first (else the learner starts again with O
from single tokens).

Rough ranges (:mod:`attnextract.learners.circle_ranges`). Two selectors +-T u, then
query tokens on a circle: at a saturated position j every head takes the selector of the
sign of u^T g_h(q_j), so F_j - c = T sum_h +-O_h u, and positions between which only head
h changes sign differ by 2 T O_h u. Design queries place the positions between the heads'
sign changes; 1 + K queries with u + eps_k w_k (eps_k measured: a query whose signs move
is asked again with a smaller one) read each head's O_h w_k by least squares over the
positions, hence its range; the next circle checks the blocks (two of its heads in one
block: they split). About 50 queries on MiniLM where random selector sets read at every
position took d + 3 = 387. Where no circle fits (max_length below 14, d < 16) or the
circles give up, vector_layer's random selector sets, read at every position: at the
position of selector i every head is saturated on some token too, so F_i(delta) - F_i(0)
= A_i delta with A_i = sum_h kappa_h,i O_h, kappa in the known set {0, mu}; each
position has its own choices, so the eigenspaces of all n + 1 positions split the
blocks together. Positions whose answers are not linear in the payload are passed over.

Identity. With projectors L_h (L_h O_g = 0 for g != h) and C_h = L_h O,

    L_h (F_j - c) = C_h X^T alpha^h_j        at EVERY position j,

so one query of p + 1 tokens (p <= r_h, the solve C_h (X - x_ref)^T a = L_h (F_j - c) -
C_h x_ref is tall) gives, for every head at once, the weights at each of its p + 1
positions: ln(alpha_i / alpha_ref) = (x_i - x_ref)^T g_h(x_j), g_h(x) = W_h x + b_h. A
query reads the bilinear form of [W_h | b_h] on its own tokens.

Design: core and fillers. Tokens are the zero token (its position reads g_h(0) = b_h),
K = max r_h + 3 core tokens in groups of a and at least d filler tokens in groups of f,
a + f = p, all of one norm s. The query of (core group, filler group) is [0, core group,
filler group]. A core token meets every filler group: its position reads g_h(x_k)
through at least d functionals, whole; W_h x_k (k = 1..K) and b_h span W_h's column
space K_h (rank <= r_h + 1, a drop of the singular values). A filler meets every core
group: f + K functionals read g_h(x) - b_h in K_h (about 1.5 x its rank). Then W_h from
W_h x at K + d tokens spanning R^d, by least squares. Cost ceil(K / a) ceil(d / f)
queries; all-MiniLM-L6-v2 (d = 384, r_h = 32, p = 24, a = f = 12): 3 x 32 = 96, where
the last position spends 1,306 on the scores.

Causal answers: the same queries in a second order, reversed with the zero token last;
a token's position sees the tokens before it in one order and those after it in the
other, and the zero token's position sees all of them (2x the queries). Each position's
logits are read against its largest weight, each row weighted by its weight over that
largest (ln a_i is read to rounding / a_i).

Fine ranges (:func:`fine_ranges_positions`). With every g_h known, H query tokens q_t and
H selectors designed so that at q_t head h is saturated on selector (h + t) mod H; a payload
orthogonal to every g_h(q_t) moves no score there, so it is as large as the selectors, and
the H positions q_t give H independent combinations of the O_h delta: every head's O_h
delta from one query, its range from max r_h + 4 payloads (the last position: d + 2).
Needs H^2 + max r_h + 4 <= d; otherwise vector_layer's designed selectors. The score
answers are then read again through the final projectors (no new query).

Conditioning by design: s from a pilot query (its largest ln(a_max / a_min) brought to
TARGET_SPREAD), the token directions orthonormal frames, the best of FRAME_TRIES by the
worst condition number of the weight solves; the error bar is the measured misfit of the
filler and core solves (more numbers than unknowns) times their condition numbers.
Refusals: weights outside (0, 1), a misfit above MISFIT_LIMIT (answers that are not a
bilinear form of the tokens: a position-dependent term, a causal box told bidirectional
or the reverse), designed ranges of the wrong rank, held-out verification at every
position and channel.

A head whose W_h has a rank above its output rank + 2 (heads whose scores share
directions: W_1 = 0.7 W_0 + 0.3 W_1 has rank 2 r) shows no rank drop within the core
tokens: the score queries are asked again with 2 rank + 3 core tokens.

Limits: heads of output rank 2 or less (no tall weight solve with a core and a filler
token) and heads whose W_h shows no rank drop within d core tokens are extracted from
the last position instead (said in the report). Below d = 32, or where circles do not
fit or give up, or the restricted scores leave fewer than two directions per designed
query, O comes from d + 1 single tokens.
"""

from __future__ import annotations

import copy
import logging
import math
import time
from typing import cast

import numpy as np

from ..errors import InputError, ModelMismatchError, RecoveryFailedError
from ..models import VectorAttention
from ..oracle import Oracle, on_scaled_outputs
from ..report import (
    DEFAULT_VERIFY_TOLERANCE,
    ExtractionResult,
    Report,
    checked_result,
    verification_count,
    verify_model,
)
from ..verification import misfit_bar
from .circle_ranges import circle_ranges, circles_fit
from .vector_layer import (
    BIAS_COLUMN,
    DESIGN_MARGIN,
    FRAME_TRIES,
    K_EXTRA,
    LINEARITY_TOL,
    MAX_SETS,
    PAYLOAD,
    PAYLOAD_CUT,
    ROUGH_RETRIES,
    ROUGH_SLACK,
    SELECT_LOGIT,
    SELECTORS,
    SINGLE_SCALE,
    TOKEN_SHARE,
    Blocks,
    _column_space,
    _cond,
    _last,
    _orth,
    _rotation,
    _unit,
    block_eigenspaces,
    check_found,
    check_options,
    extract_vector_layer,
    fine_ranges,
    logit_scale,
    parameter_count,
    payload_directions,
    projectors,
    random_selectors,
    reading_rows,
    selector_probes,
)

log = logging.getLogger(__name__)

EPS = float(np.finfo(float).eps)
TARGET_SPREAD = 1.0       # the pilot query's largest ln(a_max / a_min) at a position
PILOT_BAND = (0.5, 4.0)   # ... a pilot within this band is kept
PILOT_TRIES = 8           # pilot rescalings before the box is refused
MISFIT_LIMIT = 1e-5       # relative misfit of a score solve above this: not the model
MIN_POSITIONS = 16        # a selector set read at this many positions splits every head
RANGE_EXTRA = 4           # designed payloads beyond the widest output rank
RANGE_GAP = 1e-8          # O_h delta with a singular value r_h + 1 above this: mismatch
BAR_SAFETY = 10.0         # error bar: this many times the measured misfit x condition
STAGE_MIN_DIM = 32        # below: d + 1 single tokens cost about what O by design saves
RANGE_QUERIES = 2         # range(O) before O: queries of random tokens at least
RANGE_AGREE = 1e-4        # ... O's own range this near it (the circles' blocks are rough),
                          # or start again with O from single tokens
MIN_SUBSPACE = 16         # single tokens at least before O is read by design
DESIGN_SHARE = 0.75       # designed output reads: H T <= this x k (G's condition ~ 15)
SPLIT_SAVING = 8          # O by design only where it saves this many single tokens
DESIGN_TOL = 1e-6         # designed scores this far (x the margin) from their targets:
                          # the design does not exist (a head's W_h of low rank)
DESIGN_COND = 1e4         # ... G's condition at most (else single tokens; MiniLM: 15 to 56)
PAYLOAD_SHIFT = 60.0      # ... a payload's score shift at most (DESIGN_MARGIN = 200)
PAYLOAD_SAFETY = 8.0      # ... x the typical |v^T g_h| of a payload direction (MiniLM: at
                          # most 4.6 x |g'_h| / sqrt(k))
QUERY_BOOSTS = (4.0, 2.0, 1.0)   # ... query tokens of norm this / sqrt(|W_h q| / |q|)
QUERY_LOGIT_MAX = 25.0    # ... their own scores at most this (a margin of 200 beside)


# -- the ranges, one selector set read at every position -------------------------------

def split_ranges_positions(oracle: Oracle, O, blocks: Blocks, rng, q, scale: float,
                           payload: float) -> tuple[bool, int]:
    """One random selector set (vector_layer's identity 2), read at EVERY position: at the
    position of selector i, as at the last one, every head is saturated on one token (its
    largest score against g_h(x_i)), so F_i(delta) - F_i(0) = A_i delta with A_i = sum_h
    kappa_h,i O_h, kappa in the set {0, mu}; but each position has its own choices, so the
    eigenspaces of all n + 1 positions split the blocks together (heads that pick alike at
    one position part at another). A position whose answers are not linear in the payload
    (a margin within the payload's reach) or whose eigenvalues miss the set {mu} is passed
    over. Returns (whether a block split, positions used); no position usable: mismatch."""
    d, E = oracle.dim, blocks.E
    n = min(SELECTORS, (oracle.max_length or SELECTORS + 1) - 1)
    mu = np.concatenate([[0.0], rng.permutation(np.linspace(1.0, 2.0, n))])
    L = blocks.left_inverse()
    P = payload * scale * payload_directions(rng, d, [Lk @ E.T @ O for Lk in L])
    X = selector_probes(random_selectors(rng, n, d, scale), q, P, mu[1:])
    y = np.asarray(oracle.query(X), dtype=np.float64)              # (1 + p, n + 1, m)
    Z = E.T @ (O @ P)
    before, used = len(blocks.R), 0
    for j in range(n, -1, -1):                   # the last position first: it sees all
        Y = E.T @ (y[1:, j] - y[0, j]).T
        new: list[np.ndarray] = []
        try:
            for Rk, Lk in zip(blocks.R, L):
                Mk = (Lk @ Y) @ np.linalg.pinv(Lk @ Z)
                misfit = np.linalg.norm(Lk @ Y - Mk @ (Lk @ Z)) / np.linalg.norm(Lk @ Y)
                if not misfit <= LINEARITY_TOL:
                    raise ModelMismatchError("not linear in the payload")
                new.extend(Rk @ S for _, S in block_eigenspaces(Mk, mu, ROUGH_SLACK))
        except ModelMismatchError:
            continue
        used += 1
        if len(new) > len(blocks.R):
            blocks.R = new
            L = blocks.left_inverse()
    if not used:
        raise ModelMismatchError(
            "the answers to saturated selector probes are linear in the payload with one "
            "coefficient per head at no position: not saturated softmax attention")
    return len(blocks.R) > before, used


def rough_ranges_positions(oracle: Oracle, O, E, rng, q, scale: float,
                           blocks: Blocks | None = None) -> tuple[Blocks, int]:
    """vector_layer's rough ranges with every set read at every position: a first set with
    payloads spanning R^d; one set read at MIN_POSITIONS positions or more is enough (two
    distinct heads choose alike at every one of them only by attending alike, and then
    they are one canonical head); otherwise sets at new query tokens with payloads for the
    widest block, until one splits nothing (at most MAX_SETS). ``blocks``: a split to
    refine (the circles', when some heads changed sign on none of them). Returns the blocks
    and the sets."""
    blocks = Blocks(E) if blocks is None else blocks
    for sets in range(1, MAX_SETS + 1):
        if sets > 1:
            q = _unit(rng, len(q))
        for attempt in range(ROUGH_RETRIES + 1):
            try:
                split, used = split_ranges_positions(oracle, O, blocks, rng, q, scale,
                                                     PAYLOAD / PAYLOAD_CUT ** attempt)
                break
            except ModelMismatchError:
                if attempt == ROUGH_RETRIES:
                    raise
                q = _unit(rng, len(q))
        if (sets > 1 and not split) or used >= MIN_POSITIONS:
            break
    return blocks, sets


# -- the ranges again, by design, read at T = H designed query tokens ----------------------

def fine_ranges_positions(oracle: Oracle, E, W, b, widths, rng, s: float):
    """The ranges, now that every g_h = W_h q + b_h is known: H query tokens q_t and H
    selectors designed so that at q_t head h is saturated on selector (h + t) mod H
    (score DESIGN_MARGIN, every other selector 0). A payload mu_i delta on selector i
    (mu_i = i + 1) orthogonal to every g_h(q_t) moves no score at these positions, so it is
    as large as the selectors, and position q_t answers

        F_t(delta) - F_t(0) = sum_h mu_(h + t mod H) O_h delta:

    H positions, H independent combinations (a circulant of distinct mu): O_h delta of
    every head from one query. R_h is the span of O_h delta over max r_h + RANGE_EXTRA
    payloads: that many queries and one more, against d + 2 at the last position. Needs
    H^2 + max r_h + RANGE_EXTRA <= d (payloads orthogonal to the H^2 vectors g_h(q_t)) and
    H independent g_h(q_t) per head (W_h of rank H - 1 or more); returns None otherwise.
    Returns (coordinate bases R_h in E (D, r_h), queries)."""
    H, d = len(widths), oracle.dim
    K = max(widths) + RANGE_EXTRA
    if H * H + K > d:
        return None
    qs = s * np.stack([_unit(rng, d) for _ in range(H)])
    G = np.concatenate([(W @ q + b).T for q in qs], axis=1)       # (d, H * H): (t, h)
    pick = (np.arange(H)[None, :] + np.arange(H)[:, None]) % H    # [t, h]: selector picked
    target = np.zeros((H, H * H))
    target[pick.reshape(-1), np.arange(H * H)] = DESIGN_MARGIN
    Delta = target @ np.linalg.pinv(G)                              # (H, d)
    if np.max(np.abs(Delta @ G - target)) > DESIGN_TOL * DESIGN_MARGIN:
        return None        # a head's g_h(q_t) span fewer than H dimensions (rank of W_h)
    mu = 1.0 + np.arange(H)
    free = np.linalg.svd(G, full_matrices=True)[0][:, H * H:]       # g_h(q_t)^perp
    P = free @ _rotation(rng, free.shape[1])[:, :K]
    P *= float(np.max(np.linalg.norm(Delta, axis=1)))
    deltas = np.concatenate([np.zeros((1, d)), P.T])               # (1 + K, d)
    X = np.empty((1 + K, 2 * H, d))
    X[:, :H] = Delta[None] + mu[None, :, None] * deltas[:, None, :]
    X[:, H:] = qs[None]                  # selectors first: causal positions q_t see them
    y = np.asarray(oracle.query(X), dtype=np.float64)[:, H:]       # (1 + K, T, m)
    kappa = mu[pick]                                                # (T, H)
    V = np.linalg.solve(kappa, (y[1:] - y[0]).transpose(1, 0, 2).reshape(H, -1))
    V = V.reshape(H, K, -1)                                         # [h, k] = O_h delta_k
    R = []
    for h, r in enumerate(widths):
        U, sv, _ = np.linalg.svd(E.T @ V[h].T, full_matrices=False)
        if sv.size > r and sv[r] > RANGE_GAP * sv[0]:
            raise ModelMismatchError(
                f"designed selectors give head {h} an output of rank above {r} (singular "
                f"value {r + 1} at {sv[r] / sv[0]:.1e} of the first): not independent heads "
                f"of saturated softmax attention")
        R.append(U[:, :r])
    return R, len(X)


def complement_rows(R: list[np.ndarray]) -> list[np.ndarray]:
    """Per head, orthonormal rows (r_h, D) vanishing on every other head's range (the
    blocks' coordinate bases R_h (D, r_h) span range coordinates together)."""
    rows = []
    for h in range(len(R)):
        others = np.concatenate([Rg for g, Rg in enumerate(R) if g != h], axis=1)
        U = np.linalg.svd(others, full_matrices=True)[0]
        rows.append(U[:, others.shape[1]:].T)
    return rows


# -- O on a subspace from single tokens, on the rest by design ------------------------------

class SubspaceOutputs:
    """O known on a subspace: an orthonormal basis U (d, k) and OU = O U (m, k), read from
    single tokens SINGLE_SCALE u (one token takes every head's whole weight, so F = c + O u
    exactly; a power of two divides exactly)."""

    def __init__(self, d: int, m: int):
        self.U = np.zeros((d, 0))
        self.OU = np.zeros((m, 0))

    @property
    def complete(self) -> bool:
        return self.U.shape[1] == self.U.shape[0]

    def matrix(self) -> np.ndarray:
        """O on span(U), zero on its complement (m, d)."""
        return self.OU @ self.U.T

    def complement(self) -> np.ndarray:
        """Orthonormal basis (d, d - k) of span(U)'s complement."""
        return np.linalg.svd(self.U, full_matrices=True)[0][:, self.U.shape[1]:]

    def add(self, V: np.ndarray, OV: np.ndarray) -> None:
        self.U = np.concatenate([self.U, V], axis=1)
        self.OU = np.concatenate([self.OU, OV], axis=1)

    def ask(self, oracle: Oracle, c: np.ndarray, V: np.ndarray) -> int:
        """Single tokens along the columns of V (d, n), orthonormal to U: n queries."""
        if V.shape[1]:
            out = _last(oracle, SINGLE_SCALE * V.T[:, None, :])
            self.add(V, (out - c).T / SINGLE_SCALE)
        return V.shape[1]


def start_outputs(oracle: Oracle, V: np.ndarray):
    """c = F([0]) and O on span(V) (V (d, n) orthonormal; the identity: all of O, as
    :func:`attnextract.learners.vector_layer.constant_and_outputs`): n + 1 queries, one
    batch."""
    d = oracle.dim
    out = _last(oracle, np.concatenate([np.zeros((1, 1, d)), SINGLE_SCALE * V.T[:, None, :]]))
    known = SubspaceOutputs(d, out.shape[1])
    known.add(V, (out[1:] - out[0]).T / SINGLE_SCALE)
    return out[0], known


def output_range(oracle: Oracle, c: np.ndarray, known: SubspaceOutputs, rng,
                 kappa: float) -> np.ndarray:
    """An orthonormal basis E (m, D) of range(O) before O is known: every answer F_j - c
    lies in it. Tokens: the rows of an orthonormal frame of R^d at logits of order one
    (the positions' weights differ, so a query's answers reach what its tokens span), in
    RANGE_QUERIES queries or more (max_length), with the single tokens' O U."""
    d = oracle.dim
    n_max = oracle.max_length or d
    queries = max(RANGE_QUERIES, math.ceil(d / min(d, n_max)))
    n = math.ceil(d / queries)
    frame = np.concatenate([_rotation(rng, d), _rotation(rng, d)])[:queries * n]
    X = math.sqrt(TARGET_SPREAD / max(kappa, 1e-300)) * frame.reshape(queries, n, d)
    y = np.asarray(oracle.query(X), dtype=np.float64).reshape(-1, len(c)) - c
    return _orth(np.concatenate([known.OU, y.T], axis=1))


def subspace_split(d: int, H: int, cap: int, max_length: int | None, k_min: int):
    """(k, T): O read on k dimensions from single tokens, on the other d - k by designed
    queries reading T directions each (T <= DESIGN_SHARE k / H: the design's H T score
    vectors in k dimensions, well conditioned; T <= ``cap``, the heads' score ranks;
    k >= ``k_min``). Minimises k + 1 + ceil((d - k) / T); None where that saves fewer
    than SPLIT_SAVING queries on d single tokens."""
    n_max = (max_length or 2 * d) // 2
    best: tuple[int, int, int] | None = None
    for k in range(max(2 * H, MIN_SUBSPACE, k_min), d):
        T = min(int(DESIGN_SHARE * k) // H, cap, n_max)
        if T < 2:
            continue
        cost = k + 1 + math.ceil((d - k) / T)
        if best is None or cost < best[0]:
            best = (cost, k, T)
    if best is None or best[0] > d - SPLIT_SAVING:
        return None
    return best[1], best[2]


def designed_outputs(oracle: Oracle, W1: np.ndarray, b1: np.ndarray, first: np.ndarray,
                     second: np.ndarray, rng, T: int) -> tuple[np.ndarray, int] | None:
    """O on the complement of S_1 = span(first), from the scores restricted to S_1.

    With g'_h(q) = W1_h q + b1_h (first^T g_h(first q), k coordinates) known, T query tokens
    q_t in S_1 and T selectors z_t in S_1 designed so that at q_t EVERY head scores
    DESIGN_MARGIN on z_t and 0 on the other selectors (z = target G^+, G the H T vectors
    g'_h(q_t): DESIGN_SHARE k >= H T). A payload v in the complement on selector t moves a
    score by v^T g_h(q_t), which S_1 does not see; payloads of size a with a |v^T g| far
    below the margin (PAYLOAD_SHIFT, with PAYLOAD_SAFETY over the typical |g'| / sqrt(k))
    leave every head saturated on z_t + v, so position q_t answers exactly

        F_t(v) - F_t(0) = a O v:

    T directions of O per query, against one per single token. ceil((d - k) / T) queries
    and the payload-free one. Returns (O second (m, d - k), queries), or None (no query
    asked) where no design of G within DESIGN_COND was found."""
    H, k = W1.shape[0], W1.shape[1]
    d, n = oracle.dim, second.shape[1]
    omega = float(np.max(np.linalg.norm(W1 @ _unit(rng, k), axis=1)))
    best = np.inf
    # larger query tokens: W_h q outweighs b_h and G is better conditioned, as long as the
    # query tokens' own scores stay far below the margin
    for boost in QUERY_BOOSTS:
        s = boost / math.sqrt(max(omega, 1e-300))
        for _ in range(FRAME_TRIES):
            qs = s * np.stack([_unit(rng, k) for _ in range(T)])
            G = np.concatenate([(W1 @ q + b1).T for q in qs], axis=1)    # (k, T H): (t, h)
            cond = _cond(G)
            if cond < best and np.max(np.abs(qs @ G)) <= QUERY_LOGIT_MAX:
                best, q_best, G_best = cond, qs, G
    if not best <= DESIGN_COND:          # single tokens then
        log.debug("designed output reads: condition %.1e, not used", best)
        return None
    # each score's margin in proportion to |g'_h(q_t)|: a payload moves it by about
    # |g'_h(q_t)| / sqrt(k), so one payload size suits every head, however unequal
    norms = np.linalg.norm(G_best, axis=0)
    target = np.kron(np.eye(T), np.ones((1, H))) * (DESIGN_MARGIN * norms / norms.min())
    Z = target @ np.linalg.pinv(G_best)                                  # (T, k)
    a = PAYLOAD_SHIFT * math.sqrt(k) / (PAYLOAD_SAFETY * float(norms.min()))
    Q = math.ceil(n / T)
    X = np.zeros((Q + 1, 2 * T, d))
    X[:, :T] = Z @ first.T              # selectors first: causal positions q_t see them
    X[:, T:] = q_best @ first.T
    P = np.zeros((Q * T, d))
    P[:n] = a * second.T
    X[1:, :T] += P.reshape(Q, T, d)
    y = np.asarray(oracle.query(X), dtype=np.float64)[:, T:]           # (Q + 1, T, m)
    OV = ((y[1:] - y[0]) / a).reshape(Q * T, -1)[:n].T
    log.debug("designed output reads: k %d, T %d, condition %.1e, payload / selector %.2e",
              k, T, best, a / float(np.max(np.linalg.norm(Z, axis=1))))
    return OV, Q + 1


# -- the scores, read at every position ---------------------------------------------------

def group_sizes(p: int, K: int, d: int) -> tuple[int, int]:
    """(a, f), a + f = p, minimising the query count ceil(K / a) ceil(d / f)."""
    return min(((a, p - a) for a in range(1, p)),
               key=lambda af: (math.ceil(K / af[0]) * math.ceil(d / af[1]), -af[1]))


class PositionReads:
    """The core and filler queries and their answers (kept: read again through the final
    projectors).

    ``tokens`` (n, d): row 0 the zero token, then the K' core tokens, then the fillers;
    ``queries`` (Q, p) token indices (core group then filler group) of each query; the
    sequences are [0, tokens] (and, causal, [reversed tokens, 0]).

    ``first`` (d, k) and ``second`` (d, d - k): orthonormal bases of a subspace S_1 and its
    complement. The core tokens and the first fillers (``fill_first``, at least k of them)
    lie in S_1, the other fillers in its complement; the queries of the first fillers come
    first (``first_rows``): they need O on S_1 only, the others O on all of R^d. Token
    directions are chosen per part (:meth:`choose_first`, :meth:`choose_second`)."""

    def __init__(self, oracle: Oracle, d: int, K: int, p: int, causal: bool,
                 first: np.ndarray, second: np.ndarray):
        self.oracle, self.causal = oracle, causal
        self.first, self.second = first, second
        a, f = group_sizes(p, K, d)
        n_core = math.ceil(K / a)
        n_first = math.ceil(first.shape[1] / f)
        n_fill = n_first + math.ceil(second.shape[1] / f)
        self.a, self.f = a, f
        self.core = np.arange(1, 1 + n_core * a)
        self.fill = np.arange(1 + n_core * a, 1 + n_core * a + n_fill * f)
        self.fill_first = self.fill[:n_first * f]
        # filler group major: the first fillers' queries are rows 0 .. first_rows - 1
        self.queries = np.array([np.concatenate([self.core[i * a:(i + 1) * a],
                                                 self.fill[j * f:(j + 1) * f]])
                                 for j in range(n_fill) for i in range(n_core)])
        self.first_rows = n_first * n_core
        self.units = np.zeros((1 + len(self.core) + len(self.fill), d))
        self.s = 1.0
        self.F: np.ndarray = np.zeros((0, 1, 0, 0))   # (Q, orders, p + 1, m), read later

    def _choose(self, rng, C, groups: list[np.ndarray], basis: np.ndarray, rows) -> None:
        """Directions of the token ``groups`` (each its own): rows of orthonormal frames of
        span(``basis``), the best of FRAME_TRIES by the worst condition number of the
        weight solves C_h (X - x_0)^T over the queries ``rows`` and the heads."""
        k = basis.shape[1]
        tokens = np.concatenate(groups)
        best = np.inf
        for _ in range(FRAME_TRIES):
            for group in groups:
                frame = np.concatenate([_rotation(rng, k) for _ in range(len(group) // k + 1)])
                self.units[group] = frame[:len(group)] @ basis.T
            worst = max(_cond(Ch @ self.units[q].T) for Ch in C for q in self.queries[rows])
            if worst < best:
                best, chosen = worst, self.units[tokens].copy()
        self.units[tokens] = chosen

    def choose_first(self, rng, C) -> None:
        """Core and first filler directions (C_h = L_h O needed on S_1 only)."""
        self._choose(rng, C, [self.core, self.fill_first], self.first,
                     np.arange(self.first_rows))

    def choose_second(self, rng, C) -> None:
        """The other fillers' directions (C_h on all of R^d)."""
        if self.first_rows < len(self.queries):
            self._choose(rng, C, [self.fill[len(self.fill_first):]], self.second,
                         np.arange(self.first_rows, len(self.queries)))

    def restricted(self) -> PositionReads:
        """The first queries in coordinates of S_1 (tokens ``units @ first``): the layer
        restricted to S_1, W_h as first^T W_h first, b_h as first^T b_h."""
        view = copy.copy(self)
        view.units = self.units @ self.first
        view.queries = self.queries[:self.first_rows]
        view.F = self.F[:self.first_rows]
        view.fill = self.fill_first
        return view

    @property
    def count(self) -> int:
        return len(self.queries) * (2 if self.causal else 1)

    def sequences(self, rows) -> np.ndarray:
        """(len(rows) x orders, p + 1, d): [0, tokens] then, causal, [tokens reversed, 0]."""
        X = self.s * self.units
        idx = np.concatenate([np.zeros((len(rows), 1), dtype=int), self.queries[rows]], axis=1)
        seqs = [X[idx]]
        if self.causal:
            seqs.append(X[np.concatenate([idx[:, :0:-1], idx[:, :1]], axis=1)])
        return np.stack(seqs, axis=1).reshape(-1, idx.shape[1], X.shape[1])

    def ask(self, rows) -> np.ndarray:
        out = np.asarray(self.oracle.query(self.sequences(rows)), dtype=np.float64)
        if out.ndim != 3:
            raise InputError("vector-layer at every position reads (B, N, m) answers")
        return out.reshape(len(rows), 2 if self.causal else 1, *out.shape[1:])

    def orders(self, row: int) -> list[tuple[np.ndarray, np.ndarray]]:
        """[(token index per position, answers (p + 1, m))] for each order of query ``row``."""
        toks = np.concatenate([[0], self.queries[row]])
        out = [(toks, self.F[row, 0])]
        if self.causal:
            out.append((np.concatenate([toks[:0:-1], toks[:1]]), self.F[row, 1]))
        return out

    def equations(self, c, L, C, rows=None):
        """Per head, the logit equations read from every position of the queries ``rows``
        (default all): lists of (point index, functional rows D (k, d), values (k,)) with
        D^T g_h(point) = values; NaN values where a weight came out outside (0, 1). Also
        the worst relative misfit of the weight solves and the largest logit spread
        ln(a_max / a_min) at a position (inf when a weight is unreadable)."""
        X = self.s * self.units
        heads = [[] for _ in L]
        misfit = spread = 0.0
        for row in range(len(self.queries)) if rows is None else rows:
            for toks, F in self.orders(row):
                for j in range(len(toks)):
                    seen = np.arange(j + 1) if self.causal else np.arange(len(toks))
                    if len(seen) < 2:
                        continue
                    ref = 0 if toks[seen[0]] == 0 else j   # the zero token if seen, else own
                    others = seen[seen != ref]
                    D = X[toks[others]] - X[toks[ref]]            # (k, d)
                    for h, (Lh, Ch) in enumerate(zip(L, C)):
                        w = Lh @ (F[j] - c) - Ch @ X[toks[ref]]
                        A = Ch @ D.T
                        sol, *_ = np.linalg.lstsq(A, w, rcond=None)
                        scale = np.linalg.norm(w) + np.linalg.norm(Ch @ X[toks[ref]])
                        misfit = max(misfit, float(np.linalg.norm(A @ sol - w))
                                     / max(scale, np.finfo(float).tiny))
                        last = 1.0 - sol.sum()
                        if not (np.all(sol > 0) and last > 0):
                            heads[h].append((toks[j], D, np.full(len(sol), np.nan)))
                            spread = math.inf
                            continue
                        # logits against the largest weight, each row weighted by its
                        # weight over the largest: ln a_i is read to (rounding) / a_i, so
                        # a small weight's row counts for what it is worth
                        a = np.append(sol, last)
                        pts = np.append(others, ref)
                        top = int(np.argmax(a))
                        rest = np.arange(len(a)) != top
                        rel = a[rest] / a[top]
                        Dw = (X[toks[pts[rest]]] - X[toks[pts[top]]]) * rel[:, None]
                        heads[h].append((toks[j], Dw, np.log(rel) * rel))
                        spread = max(spread, -float(np.log(rel.min())))
        return heads, misfit, spread


def solve_head(reads: PositionReads, eqs, strict: bool = True):
    """W (d, d), b (d,), the rank of W's column space, the spread (misfit x condition) and
    whether that column space was found (a rank drop within the core tokens), from one
    head's equations. ``strict``: a misfit above MISFIT_LIMIT is a mismatch (not while the
    projectors are the first, rough ones)."""
    X = reads.s * reads.units
    d = X.shape[1]
    by_point: dict[int, list] = {}
    for t, D, v in eqs:
        by_point.setdefault(int(t), []).append((D, v))
    spread = 0.0
    # misfits are judged against the head's logit scale (a point where every logit is 0,
    # b = 0 at the zero token, has nothing else to be relative to)
    values = [v for _, _, v in eqs if np.all(np.isfinite(v))]
    level = max((float(np.abs(v).max()) for v in values), default=0.0)

    def gather(t):
        rows = by_point.get(t, [])
        return (np.concatenate([r[0] for r in rows]), np.concatenate([r[1] for r in rows]))

    def fit(A, y):
        nonlocal spread
        if not np.all(np.isfinite(y)):
            raise ModelMismatchError("every-position score probes imply attention weights "
                                     "outside (0, 1): not softmax attention over these tokens")
        sol, *_ = np.linalg.lstsq(A, y, rcond=None)
        misfit = float(np.linalg.norm(A @ sol - y)) / max(float(np.linalg.norm(y)),
                                                          level * math.sqrt(len(y)), 1e-300)
        if strict and misfit > MISFIT_LIMIT:
            raise ModelMismatchError(
                f"the logits read at every position are not a bilinear form of the tokens "
                f"(relative misfit {misfit:.1e}): a position-dependent term, or the causal "
                f"mask stated wrongly")
        spread = max(spread, misfit * _cond(A))
        return sol

    A, y = gather(0)
    b = fit(A, y)
    core_g = np.stack([fit(*gather(int(k))) for k in reads.core])
    cols = (core_g - b).T                                    # W_h x_k, (d, K')
    with_b = np.linalg.norm(b) > BIAS_COLUMN * np.abs(cols).max() if np.any(cols) else False
    B = _column_space(np.concatenate([cols, b[:, None]], axis=1) if with_b else cols)
    found = B.shape[1] < len(reads.core)
    if not found:
        return np.zeros((d, d)), b, B.shape[1], spread, False
    fill_g = []
    for t in reads.fill:
        A, y = gather(int(t))
        beta = fit(A @ B, y - A @ b)
        fill_g.append(B @ beta)
    pts = np.concatenate([X[reads.core], X[reads.fill]])     # (K' + F', d)
    G = np.concatenate([cols.T, np.stack(fill_g)])            # W_h x per point
    W = np.linalg.lstsq(pts, G, rcond=None)[0].T
    return W, b, B.shape[1], spread, True


def solve_all(reads: PositionReads, c, L, C, strict: bool = True):
    """Every head's W, b through the projectors L, C: (W (H, d, d), b (H, d), ranks,
    spread, whether every column space was found, the weight solves' misfit)."""
    heads, weight_misfit, _ = reads.equations(c, L, C)
    out = [solve_head(reads, eqs, strict) for eqs in heads]
    W = np.stack([o[0] for o in out])
    b = np.stack([o[1] for o in out])
    return W, b, [o[2] for o in out], max(o[3] for o in out), all(o[4] for o in out), \
        weight_misfit


def pilot_scale(reads: PositionReads, c, L, C, kappa: float) -> int:
    """Set the token norm s so that the first query's largest |logit| is about TARGET_SPREAD:
    quadratic in s for W, linear for b (the rescaling assumes the larger). Returns the
    queries spent; the last pilot's answers are the first query's."""
    reads.s = math.sqrt(TARGET_SPREAD / max(kappa, 1e-300))
    spent = 0
    for _ in range(PILOT_TRIES):
        F = reads.ask([0])
        spent += F.shape[0] * F.shape[1]
        reads.F = F
        _, _, peak = reads.equations(c, L, C, rows=[0])
        if not math.isfinite(peak):
            reads.s /= 4.0
            continue
        if PILOT_BAND[0] * TARGET_SPREAD <= peak <= PILOT_BAND[1] * TARGET_SPREAD:
            return spent
        reads.s *= math.sqrt(TARGET_SPREAD / max(peak, 1e-300)) if peak > 0 else 1e3
    raise ModelMismatchError("the every-position pilot query never gave readable attention "
                             "weights with logits of order one: not softmax attention")


def extract_vector_layer_positions(oracle: Oracle, *, seed=None,
                                   verify_tolerance: float = DEFAULT_VERIFY_TOLERANCE,
                                   heads=None, biases=None, ranks=None) -> ExtractionResult:
    """Recover a standard attention layer from answers at every position: every head's
    canonical W_h, b_h, O_h and c, the scores read at every position.

    Parameters
    ----------
    oracle : Oracle
        Door to the black box: answers (B, N, m) at every position, ``oracle.causal``
        stated (True: position j sees i <= j only).
    seed, verify_tolerance, heads, biases, ranks
        As :func:`attnextract.learners.vector_layer.extract_vector_layer`.

    Returns
    -------
    ExtractionResult
        ``model`` a :class:`VectorAttention` (W (H, d, d), O (H, m, d), b (H, d), c (m,)),
        answering at every position, causal as stated.

    Raises
    ------
    InputError
        The box does not answer every position, or ``causal`` is not stated.
    ModelMismatchError
        The answers are not those of such a layer (weights outside (0, 1), logits that are
        not a bilinear form of the tokens, held-out verification at every position failed,
        a stated H, rank or absence of biases contradicted).
    RecoveryFailedError
        The answers show no dependence on the scores, or O = 0.
    """
    check_options(oracle, heads, biases, ranks)
    if oracle.outputs != "all":
        raise InputError("the every-position layer learner reads answers at every position "
                         "(Oracle(..., outputs='all')); use vector-layer for the last one")
    if oracle.causal is None:
        raise InputError("every-position answers: state whether the box is causal "
                         "(Oracle(..., causal=True/False), --causal)")
    start_q = oracle.queries
    try:
        return _extract_positions(oracle, seed, verify_tolerance, heads, biases, ranks,
                                  staged=True)
    except _RangeMissed as missed:
        log.debug("%s: O from single tokens", missed)
        spent = oracle.queries - start_q
        result = _extract_positions(oracle, seed, verify_tolerance, heads, biases, ranks,
                                    staged=False)
        result.queries += spent
        result.report.queries += spent
        result.report.breakdown["range of O missed (asked again)"] = spent
        result.report.notes.append(f"{missed}: O read again from single tokens")
        return result


def _extract_positions(oracle: Oracle, seed, verify_tolerance, heads, biases, ranks, *,
                       staged: bool) -> ExtractionResult:
    """The every-position learner (:func:`extract_vector_layer_positions`); ``staged``: O on
    a subspace from single tokens and on the rest by design, where circles fit."""
    start, start_q, start_bb = time.perf_counter(), oracle.queries, oracle.black_box_seconds
    start_numbers, start_tokens = oracle.numbers, oracle.tokens
    rng = np.random.default_rng(seed)
    d = oracle.dim
    counts: dict[str, int] = {}

    def step(name):
        counts[name] = counts.get(name, 0) + oracle.queries - start_q - sum(counts.values())

    q_pilot, u_pilot = (v / np.linalg.norm(v) for v in rng.standard_normal((2, d)))
    # O on a subspace first where circles can give the ranges without it (the rest of O
    # is then read by design: T directions per query); else O from d + 1 single tokens
    staged = staged and d >= STAGE_MIN_DIM and circles_fit(oracle)
    if staged:
        # O on span(q, u), the pilot's tokens
        c, known = start_outputs(oracle, np.linalg.qr(np.stack([q_pilot, u_pilot], axis=1))[0])
    else:
        c, known = start_outputs(oracle, np.eye(d))
    step("c and O (single tokens)")
    kappa = logit_scale(oracle, known.matrix(), c, q_pilot, u_pilot)
    step("pilot")
    if staged:
        E = output_range(oracle, c, known, rng, kappa)
        step("range of O")
    else:
        E = _orth(known.OU)
    if E.shape[1] == 0:
        raise RecoveryFailedError("O = 0: every head's output is zero, nothing to recover")
    circled = circle_ranges(oracle, c, E, rng, kappa)
    sets = circles = 0
    blocks = Blocks(E)
    if circled is not None:
        blocks.R, complete, _, circles = circled
    step("ranges (circle)")
    if circled is None or not complete:
        # random selector sets read O on all of R^d: the rest of it from single tokens
        known.ask(oracle, c, known.complement())
        step("c and O (single tokens)")
        if circled is None:
            E, start_blocks = _orth(known.matrix()), None
        else:
            E, start_blocks = _recoordinated(known, E, blocks)
        blocks, sets = rough_ranges_positions(oracle, known.matrix(), E, rng, q_pilot,
                                              SELECT_LOGIT / kappa, start_blocks)
        step("ranges (random selectors)")
    widths = blocks.widths
    # p < r_h tokens beside the zero token (a tall, well-conditioned weight solve; square
    # ones at r_h = 2 lost 1e-10), at least one core and one filler
    p = int(TOKEN_SHARE * min(widths))
    notes = []
    if p < 2:
        notes.append(f"a head of output rank {min(widths)}: too narrow for every-position "
                     f"score reads (a core and a filler token, read by a tall solve); "
                     f"extracted from the last position")
        return _fallback(oracle, start_q, seed, verify_tolerance, heads, biases, ranks, notes)
    # the core tokens lie in S_1: twice as many dimensions as cores keep W_h on S_1 well
    # conditioned (d = 64, r_h = 16 at k = 16: W off by 4.2e-10, with O read exactly too)
    split = None if known.complete else subspace_split(
        d, len(widths), min(widths) + 1, oracle.max_length,
        2 * min(max(widths) + K_EXTRA, d))
    if split is None:
        known.ask(oracle, c, known.complement())
    else:
        extra = known.complement() @ _rotation(rng, d - known.U.shape[1])
        known.ask(oracle, c, extra[:, :split[0] - known.U.shape[1]])
    step("c and O (single tokens)")
    L, C, _ = projectors(E, blocks, known.matrix())
    K = min(max(widths) + K_EXTRA, d)
    first = np.eye(d) if known.complete else known.U
    reads = PositionReads(oracle, d, K, p, bool(oracle.causal), first,
                          known.complement() if split else np.zeros((d, 0)))
    reads.choose_first(rng, C)
    pilot_scale(reads, c, L, C, kappa)
    F0 = reads.F
    reads.F = np.concatenate([F0, reads.ask(np.arange(1, reads.first_rows))])
    step("scores at every position")
    design = None
    if not known.complete:
        # the scores on S_1 (first^T W_h first): the design that reads O on the rest
        view = reads.restricted()
        W1, b1, ranks1, _, found, _ = solve_all(view, c, L, [Ch @ first for Ch in C],
                                                 strict=False)
        T = min(split[1], min(ranks1)) if split else 0
        V = known.complement()
        read = designed_outputs(oracle, W1, b1, first, V, rng, T) if found and T >= 2 \
            else None
        if read is not None:
            known.add(V, read[0])
            design = f"{read[1]} queries of {2 * T} tokens ({T} directions each)"
            step("O by design")
        else:
            known.ask(oracle, c, V)
            step("c and O (single tokens)")
        E, blocks = _recoordinated(known, E, blocks)
        L, C, _ = projectors(E, blocks, known.matrix())
    O = known.matrix()
    reads.choose_second(rng, C)
    if reads.first_rows < len(reads.queries):
        reads.F = np.concatenate([reads.F, reads.ask(np.arange(reads.first_rows,
                                                               len(reads.queries)))])
    step("scores at every position")
    W, b, ranks_W, _, found, _ = solve_all(reads, c, L, C, strict=False)
    while not found and K < d:
        # a W_h of rank above its output rank + 2 (heads whose scores share directions):
        # more core tokens, the score queries asked again with the same token norm
        K = min(d, 2 * max(ranks_W) + K_EXTRA)
        s = reads.s
        reads = PositionReads(oracle, d, K, p, bool(oracle.causal), np.eye(d),
                              np.zeros((d, 0)))
        reads.choose_first(rng, C)
        reads.s = s
        reads.F = reads.ask(np.arange(len(reads.queries)))
        step("scores at every position")
        W, b, ranks_W, _, found, _ = solve_all(reads, c, L, C, strict=False)
    if not found:
        notes.append("a head's W_h showed no rank drop within d core tokens: extracted from "
                     "the last position")
        return _fallback(oracle, start_q, seed, verify_tolerance, heads, biases, ranks, notes)
    omega = float(np.max(np.linalg.norm(W @ _unit(rng, d), axis=1)))
    if omega == 0:
        raise RecoveryFailedError("the scores do not depend on the query token (W = 0)")
    designed = fine_ranges_positions(oracle, E, W, b, widths, rng, 1.0 / math.sqrt(omega))
    if designed is None:       # too narrow for H designed query tokens: the last position
        designed = fine_ranges(oracle, O, E, W, b, widths, rng, 1.0 / math.sqrt(omega))
    blocks.R = designed[0]
    step("ranges (designed selectors)")
    L, C, R = projectors(E, blocks, O)
    O_h = np.stack([Rh @ Ch for Rh, Ch in zip(R, C)])
    # the scores read again through orthonormal rows that vanish on the other heads'
    # ranges, not rows of R^-1 (whose rounding leaks cond(R) x more of the other heads)
    L, C = reading_rows(E, complement_rows(designed[0]), O)
    W, b, ranks_W, spread, found, weight_misfit = solve_all(reads, c, L, C)
    check_found(widths, heads, ranks, c, b, biases, float(np.max(np.abs(W))))
    model = VectorAttention(W, O_h, b, c, positions="all", causal=bool(oracle.causal))
    has_biases = bool(np.any(c) or np.any(b)) if biases is None else biases
    params = parameter_count(d, O.shape[0], widths, ranks_W, has_biases)
    recovery = oracle.queries - start_q
    bar = float(BAR_SAFETY * max(spread, EPS))
    n_verify = verification_count(params, recovery)
    # the bar is measured from the reads' own misfit (cubic scores and a hidden head of
    # 1e-8 passed through an unchecked one)
    verification = verify_model(oracle, model, count=n_verify, seed=seed,
                                tolerance=verify_tolerance,
                                expected_error=misfit_bar(bar, verify_tolerance))
    report = Report(
        kind=model.kind, dim=d, queries=oracle.queries - start_q,
        breakdown={**counts, "recovery": recovery, "verification": n_verify},
        floor=-(-params // (O.shape[0] * (d + 1))),
        verification=verification, seconds=time.perf_counter() - start,
        black_box_seconds=oracle.black_box_seconds - start_bb, notes=notes,
        details={"numbers received": oracle.numbers - start_numbers,
                 "tokens sent": oracle.tokens - start_tokens,
                 "outputs": "every position" + (" (causal)" if oracle.causal else ""),
                 "heads found": len(widths), "output ranks r_h": widths,
                 "ranks of W_h": ranks_W, "random selector sets": sets,
                 "circles": circles,
                 "O read": f"{known.U.shape[1] if design is None else d - V.shape[1]} "
                           f"single tokens" + (f", the rest by design: {design}"
                                               if design else ""),
                 "score design": f"{len(reads.queries)} queries of {p + 1} tokens (zero "
                                 f"token, {reads.a} core, {reads.f} filler)"
                                 + (", both orders" if oracle.causal else ""),
                 "token norm": reads.s, "weight-solve misfit": weight_misfit,
                 "parameters": params, "error bar": bar,
                 "floor": f"{params} parameters / ({O.shape[0]} numbers x {d + 1} positions "
                          f"of a query of d + 1 tokens)"})
    return checked_result(model, report, "a standard attention layer with independent "
                          "head output ranges, answering at every position")


def _recoordinated(known: SubspaceOutputs, E: np.ndarray, blocks: Blocks):
    """range(O)'s basis from O itself once it is known on all of R^d, and the (rough)
    blocks in its coordinates. Raises _RangeMissed where the basis read from random
    tokens' answers (:func:`output_range`) is not range(O): another rank, or a subspace
    more than RANGE_AGREE away."""
    E_new = _orth(known.matrix())
    if E_new.shape[1] != E.shape[1]:
        raise _RangeMissed(f"range(O) of rank {E_new.shape[1]} read as of rank {E.shape[1]}")
    angle = float(np.linalg.norm(E_new - E @ (E.T @ E_new), 2))
    if angle > RANGE_AGREE:
        raise _RangeMissed(f"range(O) read {angle:.1e} away from O's own")
    moved = Blocks(E_new)
    moved.R = [E_new.T @ (E @ Rk) for Rk in blocks.R]
    return E_new, moved


class _RangeMissed(Exception):
    """range(O) read from random tokens' answers missed a direction: the learner starts
    again with O from single tokens."""


def _fallback(oracle, start_q, seed, verify_tolerance, heads, biases, ranks, notes):
    """The last-position learner, the queries already spent added to its count."""
    spent = oracle.queries - start_q
    result = extract_vector_layer(oracle, seed=seed, verify_tolerance=verify_tolerance,
                                  heads=heads, biases=biases, ranks=ranks)
    result.queries += spent
    result.report.queries += spent
    result.report.breakdown["every-position attempt"] = spent
    result.report.notes.extend(notes)
    return result


def extract_standard_layer(oracle: Oracle, *, seed=None,
                           verify_tolerance: float = DEFAULT_VERIFY_TOLERANCE, heads=None,
                           biases=None, ranks=None,
                           output_dtype: str | None = None) -> ExtractionResult:
    """The ``vector-layer`` learner: every-position answers go to
    :func:`extract_vector_layer_positions`, last-position ones to
    :func:`attnextract.learners.vector_layer.extract_vector_layer` (same options;
    ``output_dtype``, a forward pass in low precision, is read at the last position only).

    Raises
    ------
    InputError
        ``output_dtype`` other than float64 with answers at every position.
    """
    if getattr(oracle, "outputs", None) == "all":
        if output_dtype not in (None, "float64"):
            raise InputError(f"output_dtype={output_dtype!r}: a forward pass in low precision "
                             f"is read from last-position answers (outputs='last'); the "
                             f"every-position learner needs float64 answers")
        # answers of any size (1e-300 .. 1e300) are learned on an exact 2^k rescaling
        # (the view counts, budgets and states the answers' kind as the Oracle under it)
        return on_scaled_outputs(oracle, lambda view: extract_vector_layer_positions(
            cast(Oracle, view), seed=seed, verify_tolerance=verify_tolerance, heads=heads, biases=biases,
            ranks=ranks))
    return extract_vector_layer(oracle, seed=seed, verify_tolerance=verify_tolerance,
                                heads=heads, biases=biases, ranks=ranks,
                                output_dtype=output_dtype)
