"""A Transformer layer: attention followed by a ReLU feed-forward layer with biases.

Model (:class:`attnextract.models.TransformerLayer`):

    y(X) = [x_N +] sum_h V_h X^T softmax(X W_h x_N),    f(X) = w^T ReLU(A y(X) + b) + c0,

W_h, V_h (d, d), A (m, d), b, w (m,), c0 a scalar; the residual term x_N present or not.

What is identifiable. A and V_h enter only through the products P_h = A V_h (and A
itself through the residual term):
- hidden units: permutation and positive rescaling (a_i, P_h,i, b_i, w_i) ->
  (c a_i, c P_h,i, c b_i, w_i / c), c > 0, nothing else; units with w_i = 0 are
  invisible. Units are found from single tokens, so a unit whose single-token row
  (a_i [with the residual term] + sum_h P_h,i) is zero is outside what this learner finds;
- heads: the canonical form of docs/algorithms.md, "Multi-head" (heads with equal W_h merge,
  adding their P_h; heads with P_h = 0 are invisible; any order); W_h is identified exactly
  for every canonical head;
- without the residual term, A and V_h are never separated: (A G, G^{-1} V_h) gives the
  same f for every invertible G (d, d). Only P_h = A V_h is identified. When A has full
  column rank (m >= d) that is all the freedom: the returned A = D A_true sum_k V_k
  (D > 0 diagonal, the unit scale) and V_h = (sum_k V_k)^{-1} V_h,true, so sum_h V_h = I
  (V = I for one head); when m < d, V_h is known only modulo the null space of A as well;
- with the residual term, A is identified (up to the unit symmetries) and V_h modulo
  the null space of A: V_h itself exactly when A has full column rank (m >= d).

The canonical form returned (the parameters in the result file):
- W_h: the canonical heads' query-key matrices, exactly;
- no residual: A = sum_h P_h with unit rows (the FFN that single tokens see), b and w in
  that unit scale, c0, and V_h the minimum-norm solution of A V_h = P_h (V = I for one
  head: the true layer with A replaced by A V and V by I);
- residual: the rows of A + sum_h P_h have unit norm (the single-token FFN), b, w, c0 in
  that scale, A the residual-stream weights, V_h = A^+ P_h (minimum norm; the true V_h
  when A has full column rank).

Identities (one head; alpha = softmax(X W x_N), B = A V, R = A with the residual term
and R = 0 without it; pre-activations pi(X) = R x_N + B X^T alpha + b):
1. Single tokens: pi([x]) = (R + B) x + b, so f([x]) is a biased ReLU network, recovered
   by :func:`attnextract.learners.biased_relu.extract_biased_relu` (critical points on
   lines, Carlini, Jagielski and Mironov 2020); b = 0 and c0 = 0 are found, not assumed.
2. Last token zero: all scores vanish, alpha is uniform, pi([p; 0]) = B p / 2 + b. Without
   the residual term this equals pi([p / 2]) (that is how the residual term is detected,
   with a few queries); with it, [p; 0] gives a second biased network with the same b
   and w. The products w_i b_i do not depend on the unit scale and match the units of
   the two networks (biases must be non-zero; without biases the bias-free residual
   learner :mod:`attnextract.learners.residual` runs instead).
3. Copy probes. For q with pi([q]) at a margin from every kink and u small enough that
   pi moves by less than half that margin, the whole family [q + u; ...; q + u; q]
   (n copies of q + u) stays in one linear piece of the FFN:

       f - f([q]) = a_n * kappa,   a_n = n e^t / (n e^t + 1),   t = u^T W q,

   with kappa = w_S^T B_S u unknown (S the active units). Two copy counts give the ratio
   rho = a_2 / a_1 = 2 (e^t + 1) / (2 e^t + 1), so e^t = (2 - rho) / (2 rho - 2): t
   without using the FFN's parameters at all. For each of d orthogonal q_j and d
   directions u_jk (a Householder basis with |u^T g_j| equal for all k, g_j = B_S^T w_S)
   this gives W q_j, hence W: 2 d^2 + d queries. The biases only move the linear pieces,
   so the same probes serve b = 0 and b != 0.
Several heads (H > 1; bias-free with or without the residual term, or with FFN biases):
4. Odd part: scores do not change under X -> -X and ReLU(z) - ReLU(-z) = z, so
   f(X) - f(-X) = [u^T x_N +] sum_h softmax(X W_h x_N)^T X (P_h^T w), u = A^T w: with the
   residual term u comes from single tokens ((A + sum_h P_h)^T w) minus sum_h P_h^T w
   (odd parts of [e_i; 0], uniform attention: 2d queries) and is subtracted. That is
   multi-head attention with readouts v_h = P_h^T w, handed to
   :func:`attnextract.learners.multi_head.extract_multi_head` (``heads`` is its upper
   bound; it returns the canonical heads) through
   :class:`attnextract.learners.one_layer.OddPartOracle`; sum_h v_h must agree.
5. Split of the heads' rows per unit (:func:`_split_heads`): in the two cells either side
   of unit k's hyperplane, probes [q + delta; q] with chosen logits delta^T W_h q give
   every head's readout P_h,S^T w_S by least squares; across the hyperplane they jump by
   w_k P_h,k. 2 m (1 + (H + 1) d) queries (2 m (1 + 2 H d) with the residual term, whose
   cells' gradients also carry A: then A = (single-token rows) - sum_h P_h).
6. With FFN biases the odd part is not linear (ReLU(a + b) - ReLU(-a + b) is 2a, 0 or
   a +- b by piece), but it is a + sign(a) b once |a| >= |b|. Shifting every token along
   the last one, X = L z_N + eps Z with eps (L + eps) = 1, keeps every head's scores
   (z_i^T W_h z_N plus a constant) and makes a = L P z_N + eps (...): with L chosen per
   probe so that each biased unit is past its kink, the odd part minus that of [L z_N] is
   eps times the bias-free odd part, exactly (:class:`LargeTokenOddOracle`, four queries
   per probe). Its rounding grows like L^2 eps_mach, so its outputs are rounded to float32
   and the multi-head learner returns the heads to about 1e-6; a last token within an
   angle 1e-3 of a unit's hyperplane (L would be huge) is moved off it and the answer
   extrapolated back (Richardson, O(eta^4)).
7. Refinement, with biases (``refine`` of :func:`_split_heads`): in each cell (scaled out
   until the two biased cells of unit k differ in unit k only), (2 H + 1) d probes fit
   k_h = W_h q jointly with all H readouts (Gauss-Newton from the rough heads); W_h is
   then the least-squares solution over the 2m cells (to about 1e-11), and the readouts'
   jumps give P_h as in 5. 2 m (1 + (2 H + 1) d) queries.
8. Biases and the residual term (H > 1): the view of 6 then sees u^T z_N + the heads
   (u = A^T w; the shift gives a = L (A + P) z_N + eps (A z_N + ...), A + P the known
   single-token rows). u = (A + P)^T w - sum_h v_h, and sum_h v_h comes from [s p; 0]
   (uniform attention, x_N = 0): its odd part is (s / 2) v^T p + a constant once s is
   past every kink; at s ~ 1e10 a unit still inside its kink adds at most 2 |w_i b_i| / s
   (:func:`_uniform_readout`, 6 d queries). The
   split then fits all H readouts per cell (the FFN's gradient also carries A) and
   A = (single-token rows) - sum_h P_h.

Everything is verified against the black box on held-out sequences
(:func:`attnextract.report.checked_result`); a GELU, a LayerNorm before the FFN or two
stacked layers fail one of the identities or the verification: ModelMismatchError.
"""

from __future__ import annotations

import functools
import math
import time
from typing import Any

import numpy as np

from ..errors import (
    InputError,
    ModelMismatchError,
    NotIdentifiableError,
    RecoveryFailedError,
    RefusalWithResult,
)
from ..models import TransformerLayer
from ..oracle import OracleView, QueryAccess, on_scaled_outputs
from ..precision import precision_of, stated_precision
from ..report import (
    DEFAULT_VERIFY_TOLERANCE,
    ExtractionResult,
    Report,
    checked_result,
    token_scale,
    verification_count,
    verify_model,
)
from ..verification import merge_verifications, safe_norm, safe_rms
from .biased_relu import (
    ERROR_BAR_SIGMAS,
    NOISY_FIT,
    BiasedReLUNetwork,
    Tolerances,
    crossing_points,
    extract_biased_relu,
    noisy_tolerances,
)
from .residual import _MappedOracle, _ResidualOddOracle, counted_stage, extract_one_layer_residual
from .single_head import probe_basis

RESIDUAL_PROBES = 4          # random p: f([p; 0]) against f([p / 2]) decides the residual term
RESIDUAL_TOLERANCE = 1e-9    # relative difference beyond which the residual term is present
BIAS_ZERO = 1e-9             # |b_i| (unit rows, over scale) below this is no bias (a zero, rounded)
MARGIN_FRACTION = 0.5        # the copy probes move pi by at most this fraction of its margin
MAX_PROBE_ROUNDS = 8
SIGNAL_FLOOR = 1e-6          # y1 and y2 - y1 of a copy probe must exceed this times |f|
WELL_CONDITIONED_LOGIT = 6.0  # |t| beyond this: the probe is repeated with u / 8
CANDIDATE_BASES = 32         # random bases whose roomiest vectors become the probe points
TARGET_LOGIT = 0.5           # the pilot column sets the probe radius for median |t| about this
MAX_RADIUS = 1e3             # largest probe radius, in units of scale
RADIUS_DOUBLINGS = 30        # probe points further out while no active unit reads the attention
SPLIT_LOGIT = 3.0            # head-split probes: logits uniform in [-this, this] per head
MATCH_TOLERANCE = 1e-6       # w_i b_i of matched units agree this well (relative to max)
MATCH_BARS = 10.0            # ... plus this x the two FFN fits' error bars (rounded answers)
KINK_MARGIN = 1.25           # large-token probes: L |p_i^T z_N| >= this times (|b_i| + the
                             # attention term's bound), so no unit is near a kink
HEAD_BOUND = 3.0             # bound on |P_h,i z| / (|z| |p_i|) assumed for that margin
ROUGH_HEADS_TOLERANCE = 1e-2  # the heads' readouts from the rounded view: sum_h v_h this close
READOUT_SUM_TOLERANCE = 1e-6  # refined readouts of a cell add up to the FFN's gradient this well
ROUGH_ERROR_BAR = 1e-2       # the rounded view's heads only start the per-cell refinement
ROUGH_VERIFY_TOLERANCE = 1e-3  # the rounded view's own held-out check (its outputs carry
                               # L^2 eps_mach of rounding; the layer is verified at the end)
MAX_LOSS = 1e8               # large-token probes losing more (L^2 |z_N| / max |z|) than this...
UNIFORM_SCALE = 1e10         # token scale of the [s p; 0] probes, times (1 + max |b| max |w|)
MOVE = 1e-3                  # ...with z_N this close (angle) to a hyperplane are moved off it
REFINE_ROUNDS = 8            # Gauss-Newton rounds per cell (quadratic from ~1e-6)


def random_transformer_layer(dim: int, width: int, seed=None, *, heads: int = 1,
                             bias_scale: float = 0.0, c0: float = 0.0,
                             residual: bool = False) -> TransformerLayer:
    """A generic layer: W_h, V_h, A ~ N(0, 1/d), w ~ N(0, 1), b ~ N(0, bias_scale^2)."""
    rng = np.random.default_rng(seed)
    W = rng.standard_normal((heads, dim, dim)) / math.sqrt(dim)
    V = rng.standard_normal((heads, dim, dim)) / math.sqrt(dim)
    A = rng.standard_normal((width, dim)) / math.sqrt(dim)
    w = rng.standard_normal(width)
    b = bias_scale * rng.standard_normal(width)
    return TransformerLayer(W, V, A, b, w, c0, residual)


# answers rounded (or computed) coarser than this, relative, take the low-precision path
# (one head; a residual term only with FFN biases; else refused): the float64
# single-token stage fits exact
# affine pieces between the FFN's kinks, and rounding makes kinks of its own
# (float32-rounded answers at d = 8, m = 8: 500-900 "units" found for 8 real ones;
# 12 decimals already fail, 13 mostly pass)
MAX_RELATIVE_NOISE = 1e-13
NOISE_POINTS = 16            # low precision: second differences at this many points measure
NOISE_STEP = 1e-4            # the answers' noise (step in units of scale; 3 queries each)
UNIT_ROUNDING = {"float32": 2.0 ** -24, "bfloat16": 2.0 ** -9, "float16": 2.0 ** -12}
NOISE_BOUND = 4.0            # the noise is at least the stated or detected bound / this
RESIDUAL_NOISE = 1e3         # low precision: the residual test's gap allows this x the noise
SIGNAL_NOISE = 1e3           # low precision: copy-probe signals must exceed this x the noise
VERIFY_NOISE = 30.0          # low precision: held-out tolerance, this x (noise + error bar)
MAX_NOISY_BAR = 1e-2         # low precision: a larger error bar is refused
FIT_PROBES = 4               # low precision: W fitted jointly to this x d^2 sequences
FIT_ROUNDS = 10              # ... by at most this many Gauss-Newton rounds
FIT_LOGIT = 1.0              # ... whose tokens make the median |logit| about this


def _detect_residual(oracle: QueryAccess, rng) -> tuple[bool, float, np.ndarray]:
    """f([p; 0]) = f([p / 2]) for every p exactly when there is no residual term.
    Returns (residual present, relative gap, the answers (2 RESIDUAL_PROBES,))."""
    d = oracle.dim
    P = rng.standard_normal((RESIDUAL_PROBES, d))
    oracle.require(2 * RESIDUAL_PROBES, "detecting the residual connection")
    pairs = oracle.query(np.stack([P, np.zeros_like(P)], axis=1))
    halves = oracle.query(0.5 * P[:, None, :])
    gap = float(np.abs(pairs - halves).max() / max(np.abs(halves).max(), np.abs(pairs).max(),
                                                     1e-300))
    return gap > RESIDUAL_TOLERANCE, gap, np.concatenate([pairs, halves])


def _without_biases(oracle: QueryAccess, net: BiasedReLUNetwork) -> BiasedReLUNetwork:
    """The FFN with b = 0 (detected absent) and c0 = f([0]), exact then (one query).

    The fitted c0 is a few eps off; f - c0 would then not be homogeneous at tiny
    tokens, which the bias-free learners read as a bias.
    """
    oracle.require(1, "the output bias at the origin")
    c0 = float(oracle.query(np.zeros((1, 1, oracle.dim)))[0])
    return BiasedReLUNetwork(net.P, np.zeros(net.width), net.w, c0)


class _FFN:
    """The layer's pre-activations for one head: pi = R x_N + B z + b (units in one scale)."""

    def __init__(self, R, B, b, w, c0):
        self.R, self.B, self.b, self.w, self.c0 = R, B, b, w, c0


def _probe_points(ffn: _FFN, rng, radius: float, d: int) -> tuple[np.ndarray, float]:
    """d well-spread probe points q_j (rows) with large room rho(q) = min_i |pi_i(q)| / |B_i|.

    Candidates: CANDIDATE_BASES random orthonormal bases scaled to ``radius``, those where
    some active unit reads the attention output; the roomiest are taken greedily, each
    keeping at least half its norm orthogonal to
    those already taken (so the q_j stay well conditioned). Where too few candidates see
    the attention output the radius doubles. Returns (Q (d, d), the radius used).
    """
    for _ in range(RADIUS_DOUBLINGS):
        points = _roomy_points(ffn, rng, radius, d)
        if points is not None:
            return points, radius
        radius *= 2.0                  # every point reads nothing: the active units lie further out
    raise NotIdentifiableError("no active unit reads the attention output at any probe point")


def _roomy_points(ffn: _FFN, rng, radius: float, d: int):
    cand = np.vstack([radius * np.linalg.qr(rng.standard_normal((d, d)))[0].T
                      for _ in range(CANDIDATE_BASES)])
    pre = cand @ (ffn.R + ffn.B).T + ffn.b
    room = (np.abs(pre) / safe_norm(ffn.B, axis=1)).min(axis=1)
    # a point where no active unit reads the attention output sees nothing of W
    readout = safe_norm(((pre > 0) * ffn.w) @ ffn.B, axis=1)
    room[~(readout > 1e-6 * readout.max())] = -np.inf
    for keep in (0.5, 0.3, 0.1):                  # the first that yields d points
        chosen, basis = [], np.zeros((d, 0))
        for i in np.argsort(-room):
            if room[i] == -np.inf:
                break
            rest = cand[i] - basis @ (basis.T @ cand[i])
            if safe_norm(rest) >= keep * radius:
                chosen.append(i)
                basis = np.hstack([basis, (rest / safe_norm(rest))[:, None]])
                if len(chosen) == d:
                    return cand[chosen]
    return None


def _measure_columns(oracle: QueryAccess, ffn: _FFN, Q: np.ndarray, counts: dict,
                     noise: float = 0.0):
    """Logits t_jk = s_jk u_jk^T W q_j of the copy probes at the rows q_j of Q (n, d).

    ``noise``: the answers' relative error (0: float64); a probe's signal must then
    exceed SIGNAL_NOISE times it, and its logit's error is propagated.
    Returns (t (n, d), s (n, d), U (n, d, d), dt (n, d)) with U[j][:, k] = u_jk and dt the
    logits' expected errors (0 for float64).
    """
    n, d = Q.shape
    pre = Q @ (ffn.R + ffn.B).T + ffn.b                         # (n, m): pi at each q_j
    G = ((pre > 0) * ffn.w) @ ffn.B                              # rows g_j = B_S^T w_S
    if not np.all(safe_norm(G, axis=1) > 0):
        raise NotIdentifiableError("no active unit reads the attention output at a probe point")
    U = np.stack([probe_basis(g) for g in G])                    # (n, d, d)
    moves = np.abs(np.einsum("me,jek->jkm", ffn.B, U))           # |B u_jk| per unit
    with np.errstate(divide="ignore"):
        s = MARGIN_FRACTION * np.min(np.abs(pre)[:, None, :] / moves, axis=2)
    s = np.minimum(s, safe_norm(Q, axis=1)[:, None])
    oracle.require(n, "single tokens at the probe points")
    F0 = oracle.query(Q[:, None, :])
    counts["copy probes"] = counts.get("copy probes", 0) + n
    t = np.full((n, d), np.nan)
    dt = np.zeros((n, d))
    floor = max(SIGNAL_FLOOR, SIGNAL_NOISE * noise)
    todo = np.ones((n, d), dtype=bool)
    for _ in range(MAX_PROBE_ROUNDS):
        jj, kk = np.nonzero(todo)
        if not len(jj):
            break
        q = Q[jj]
        a = q + s[jj, kk, None] * U[jj, :, kk]
        oracle.require(2 * len(jj), "copy probes")
        y1 = oracle.query(np.stack([a, q], axis=1)) - F0[jj]
        y2 = oracle.query(np.stack([a, a, q], axis=1)) - F0[jj]
        counts["copy probes"] += 2 * len(jj)
        with np.errstate(divide="ignore", invalid="ignore"):
            rho = y2 / y1
            t_new = np.log((2.0 - rho) / (2.0 * rho - 2.0))
        # a saturated probe (weight on q + u near 0 or 1 for both copy counts) leaves y1,
        # y2 - y1 at the outputs' rounding, and its ratio is noise: probed again, smaller
        size = np.maximum(np.maximum(np.abs(F0[jj]), np.abs(y1 + F0[jj])), np.abs(y2 + F0[jj]))
        level = floor * size
        good = (np.isfinite(t_new) & (np.abs(t_new) <= WELL_CONDITIONED_LOGIT)
                & (np.abs(y1) > level) & (np.abs(y2 - y1) > level))
        t[jj[good], kk[good]] = t_new[good]
        if noise:
            # each answer off by noise * size: rho = y2 / y1, dt / drho = -1/(2 - rho) -
            # 1/(rho - 1)
            with np.errstate(divide="ignore", invalid="ignore"):
                drho = noise * size * np.sqrt(2.0 + 2.0 * rho * rho) / np.abs(y1)
                dt_new = drho * (1.0 / np.abs(2.0 - rho) + 1.0 / np.abs(rho - 1.0))
            dt[jj[good], kk[good]] = dt_new[good]
        todo[jj[good], kk[good]] = False
        s[jj[~good], kk[~good]] /= 8.0
    if todo.any():
        raise ModelMismatchError(
            f"{int(todo.sum())} copy probes gave no logit (the ratio of two copy counts must lie "
            f"in (1, 2)): not an attention layer followed by a ReLU FFN")
    return t, s, U, dt


def _copy_logits(oracle: QueryAccess, ffn: _FFN, rng, scale: float, counts: dict,
                 noise: float = 0.0):
    """W from the copy probes of identity 3: 2 d^2 + d queries, plus a pilot column.

    The pilot column (2 d + 1 queries) sets the probe radius: far from the origin the
    FFN's pieces are wider (their room grows with |q|) and the logits grow like |q|^2,
    so the radius is raised until the median logit is about TARGET_LOGIT.
    ``noise`` (the answers' relative error, 0 for float64) also gives the details
    "W error bar": ERROR_BAR_SIGMAS times the logits' propagated error, relative to max |W|.
    Returns (W (d, d), the largest probe radius, details).
    """
    d = oracle.dim
    Q, radius = _probe_points(ffn, rng, scale, d)
    t, s, U, _ = _measure_columns(oracle, ffn, Q[:1], counts, noise)
    typical = float(np.median(np.abs(t)))
    radius *= float(np.clip(math.sqrt(TARGET_LOGIT / max(typical, 1e-300)), 1.0, MAX_RADIUS))
    Q, radius = _probe_points(ffn, rng, radius, d)
    t, s, U, dt = _measure_columns(oracle, ffn, Q, counts, noise)
    # column j: W q_j = U_j (t_j / s_j); W = (W Q^T) (Q^T)^{-1}
    WQ = np.einsum("jek,jk->ej", U, t / s)
    W = np.linalg.solve(Q, WQ.T).T
    details: dict[str, Any] = {"copy probe radius": f"{radius:.3g}",
               "copy probe steps": f"{s.min():.3g} .. {s.max():.3g}",
               "copy probe logits": f"{np.abs(t).min():.2g} .. {np.abs(t).max():.2g}"}
    if noise:
        # U_j orthonormal: column j of W Q^T is off by |dt_j / s_j|; W by at most that
        # (Frobenius) times |Q^{-1}|
        column = safe_norm(dt / s, axis=1)
        spread = safe_norm(column) / np.linalg.svd(Q, compute_uv=False)[-1]
        details["W error bar"] = ERROR_BAR_SIGMAS * float(spread) / float(np.abs(W).max())
    return W, radius, details


def _fit_logits(oracle: QueryAccess, ffn: _FFN, W: np.ndarray, rng, noise: float):
    """W fitted to FIT_PROBES d^2 random sequences (lengths 2 and 3) with the FFN known
    (rounded answers: one head, V = I, pre-activations R x_N + B y + b).

    The copy probes keep to one linear piece of the FFN, so their signal is a small part
    of each answer, and rounding of relative size ``noise`` spoils their logits by
    1e-5 to 1e-3. Once the FFN is known to about 1e-6, nothing needs to stay in one piece:
    f(X) = w^T ReLU(R x_N + B X^T softmax(X W x_N) + b) + c0 is fitted to sequences of
    tokens whose logits are of order FIT_LOGIT, where the attention moves each answer by
    as much as the answer itself (Gauss-Newton from the copy probes' W, each answer
    weighted by 1 / (|f| + median |f| / 10)). Returns (W, details) with "W fit noise" the
    weighted residual's rms and "W error bar" ERROR_BAR_SIGMAS standard errors of the
    worst entry of W relative to max |W|, at that measured noise.
    """
    d = oracle.dim
    n = FIT_PROBES * d * d
    lengths = np.where(np.arange(n) % 2 == 0, 2, 3)
    Z = rng.standard_normal((n, 3, d)) / math.sqrt(d)
    # token size: median |logit| about FIT_LOGIT under the copy probes' W
    logits = np.abs(np.einsum("nid,de,ne->ni", Z[:, :2], W, Z[:, -1]))
    Z *= math.sqrt(FIT_LOGIT / max(float(np.median(logits)), 1e-300))
    seqs = [z[3 - L:] for z, L in zip(Z, lengths)]
    oracle.require(n, "fitting W to the answers")
    f = np.asarray(oracle.query_ragged(seqs), dtype=np.float64)
    weight = 1.0 / (np.abs(f) + 0.1 * float(np.median(np.abs(f))) + 1e-300)
    mask = np.ones((n, 3), dtype=bool)
    mask[lengths == 2, 0] = False                 # Z[:, 0] is padding for length 2
    last = Z[:, -1]

    def model(W):
        s = np.einsum("nid,de,ne->ni", Z, W, last)
        s = np.where(mask, s, -np.inf)
        a = np.exp(s - s.max(axis=1, keepdims=True))
        a /= a.sum(axis=1, keepdims=True)
        y = np.einsum("ni,nid->nd", a, Z)
        pre = last @ ffn.R.T + y @ ffn.B.T + ffn.b
        out = np.maximum(pre, 0.0) @ ffn.w + ffn.c0
        g = ((pre > 0) * ffn.w) @ ffn.B                           # (n, d): df / dy
        # df / dW = sum_i a_i (g^T (z_i - y)) z_i last^T
        coef = a * np.einsum("nd,nid->ni", g, Z - y[:, None, :])
        J = np.einsum("ni,nid,ne->nde", coef, Z, last).reshape(n, d * d)
        return out, J

    out, J = model(W)
    r = (f - out) * weight
    cost = float(r @ r)
    for _ in range(FIT_ROUNDS):
        step = np.linalg.lstsq(J * weight[:, None], r, rcond=None)[0].reshape(d, d)
        out_new, J_new = model(W + step)
        r_new = (f - out_new) * weight
        new_cost = float(r_new @ r_new)
        if not new_cost < cost:
            break
        done = new_cost > 0.999 * cost
        W, J, r, cost = W + step, J_new, r_new, new_cost
        if done:
            break
    sigma = math.sqrt(cost / max(n - d * d, 1))
    sv = np.linalg.svd(J * weight[:, None], full_matrices=False)
    std = sigma * np.sqrt(((sv[2] / sv[1][:, None]) ** 2).sum(axis=0))
    return W, {"W fit": f"{n} sequences of lengths 2, 3",
               "W fit noise": sigma,
               "W error bar": ERROR_BAR_SIGMAS * float(std.max()) / float(np.abs(W).max())}


def _match_by_bias(net1: BiasedReLUNetwork, net2: BiasedReLUNetwork):
    """Units of net2 matched to net1 by w_i b_i (scale-free); (perm, worst mismatch)."""
    from scipy.optimize import linear_sum_assignment

    o1, o2 = net1.w * net1.b, net2.w * net2.b
    cost = np.abs(o1[:, None] - o2[None, :])
    rows, cols = linear_sum_assignment(cost)
    perm = np.empty(len(rows), dtype=int)
    perm[rows] = cols
    return perm, float(cost[rows, cols].max() / max(np.abs(o1).max(), 1e-300))


def extract_transformer_layer(oracle: QueryAccess, heads: int = 1, *, seed=None,
                              verify_tolerance: float = DEFAULT_VERIFY_TOLERANCE,
                              scale: float = 1.0, output_dtype: str | None = None,
                              decimals: int | None = None) -> ExtractionResult:
    """Recover a Transformer layer (attention + ReLU FFN with biases) up to functional equivalence.

    Parameters
    ----------
    oracle : Oracle
        Door to the black box; ``oracle.dim`` is d >= 2 (d >= 4 with a residual term).
    heads : int
        Upper bound H on the number of heads. H = 1 runs the copy probes of the module
        docstring; H > 1 goes through the multi-head learner (identities 4-8).
    seed : int, optional
        Seed of every random choice (lines, probe bases) and of the held-out sequences.
    verify_tolerance : float
        Largest held-out relative output error accepted as a match.
    scale : float
        Token scale of the probes (where the FFN's hyperplanes and the scores are of
        order one).
    output_dtype, decimals : optional
        The precision of the black box's answers (a forward pass in float32 / bfloat16 /
        float16, or answers rounded to k decimals); without them, rounding is detected in
        the first answers. Answers coarser than MAX_RELATIVE_NOISE (1e-13) relative take
        the low-precision path (one head; a residual connection only with FFN biases):
        the noise is measured, the FFN and W are fitted to the answers, and
        ``report.details["error bar"]`` bounds the canonical parameter error. Several
        heads, a residual connection without FFN biases and answers too coarse for the
        chords (bfloat16, float16, fewer than about 6 decimals) are refused
        (:class:`RecoveryFailedError`; several heads or a coarse dtype before any query
        when ``output_dtype`` is stated). Finer rounding (e.g. 14 decimals) widens the
        held-out tolerance by its level and is stated in the report's notes.

    Returns
    -------
    ExtractionResult
        ``model`` a :class:`TransformerLayer` in the canonical form of the module
        docstring; ``report.details`` says which biases and whether a residual term were
        detected.

    Raises
    ------
    NotIdentifiableError
        The FFN is constant, or no active unit reads the attention output.
    ModelMismatchError
        The black box is not such a layer (a stage fails, or held-out verification);
        ``.result`` holds the best-effort extraction when one was built.
    BudgetExceededError
        The budget cannot cover the next batch.
    """
    precision_notes: list[str] = []
    try:
        # on answers rescaled to order one (exactly, by a power of two): the learner's
        # thresholds are absolute; answers of 1e-300 or 1e300 must not move them. Not
        # with decimals, an absolute rounding in the black box's own units.
        result = (_extract_layer(oracle, heads, seed, verify_tolerance, scale, output_dtype,
                                 decimals, precision_notes) if decimals is not None else
                  on_scaled_outputs(oracle, lambda view: _extract_layer(
                      view, heads, seed, verify_tolerance, scale, output_dtype, decimals,
                      precision_notes)))
    except RefusalWithResult as exc:
        if exc.result is not None:
            exc.result.report.notes.extend(precision_notes)
        raise
    result.report.notes.extend(precision_notes)
    return result


def _extract_layer(oracle, heads, seed, verify_tolerance, scale, output_dtype, decimals,
                   precision_notes: list) -> ExtractionResult:
    """The learner (see :func:`extract_transformer_layer`); a precision short of float64
    but fine enough is said in ``precision_notes``."""
    if not isinstance(heads, (int, np.integer)) or heads < 1:
        raise InputError(f"heads must be a positive integer, got {heads!r}")
    if not (isinstance(scale, (int, float)) and math.isfinite(scale) and scale > 0):
        raise InputError(f"scale must be a positive number, got {scale!r}")
    start, start_queries, start_bb = time.perf_counter(), oracle.queries, oracle.black_box_seconds
    d = oracle.dim
    if d < 2:
        raise InputError("the Transformer layer learner needs d >= 2")
    stated = stated_precision(output_dtype, decimals)    # bad options before any query
    if stated is not None and stated.forward:            # refused before any query:
        if heads > 1:                                    # several heads,
            _refuse_low_precision(stated, "several heads", 0, heads=True)
        floor = UNIT_ROUNDING[stated.name]               # or a dtype too coarse at its best
        _noisy_tolerances(floor / NOISE_BOUND, stated, floor, 0)
    seeds = np.random.SeedSequence(seed).spawn(5)
    counts: dict[str, int] = {}

    stage = functools.partial(_stage, oracle, counts)

    residual, gap, answers = stage("residual check", lambda: _detect_residual(
        oracle, np.random.default_rng(seeds[0])))
    precision = precision_of(answers, output_dtype, decimals)
    noise = _relative_noise(precision, answers)
    tolerances = Tolerances()
    if noise > MAX_RELATIVE_NOISE:
        tolerances, noise, residual = _low_precision(
            oracle, precision, noise, seeds, scale, heads, gap, oracle.queries - start_queries,
            precision_notes, counts)
    elif not precision.exact:
        verify_tolerance = max(verify_tolerance, 30.0 * noise)
        precision_notes.append(f"{precision.describe()}: {noise:.1e} relative, within what "
                               f"this learner needs; held-out tolerance widened to "
                               f"{verify_tolerance:.1e}")
    if heads > 1:
        return _extract_heads(oracle, heads, residual, seeds, counts, start, start_queries,
                              start_bb, verify_tolerance, scale)
    ffn_counts: dict[str, int] = {}
    net1, info1 = stage("single tokens", lambda: extract_biased_relu(
        oracle, np.random.default_rng(seeds[1]), scale=scale, counts=ffn_counts,
        tolerances=tolerances))
    bar = info1.get("error bar", 0.0)              # low precision: the joint fit's bar
    biased = bool(np.abs(net1.b).max() > max(BIAS_ZERO * scale, bar))
    if not biased:
        net1 = stage("single tokens", lambda: _without_biases(oracle, net1))
    details = {"hidden units": net1.width, "residual": f"{residual} (f([p; 0]) vs f([p/2]): "
                                                      f"{gap:.1e})",
               "biases b": (f"detected, max |b_i| = {np.abs(net1.b).max():.3g}" if biased
                            else "none detected"),
               "output bias c0": f"{net1.c0:.6g}",
               "FFN lines": info1["lines"], "FFN signs": info1["signs"]}
    if "weak units found between known kinks" in info1:
        details["FFN weak units"] = info1["weak units found between known kinks"]
    if residual and not biased and tolerances.noise:
        _refuse_low_precision(precision, "a residual connection and no FFN biases (the "
                              "bias-free residual learner's stages need float64 answers)",
                              oracle.queries - start_queries, early=False)
    if residual and not biased:
        return _bias_free_residual(oracle, net1, seeds, counts, details, start, start_queries,
                                   start_bb, verify_tolerance)
    if residual:
        zero_last = _MappedOracle(oracle, lambda P: np.stack([P, np.zeros_like(P)], axis=1),
                                  "sequences [p; 0]")
        net2, info2 = stage("last token zero", lambda: extract_biased_relu(
            zero_last, np.random.default_rng(seeds[2]), scale=scale, counts={},
            tolerances=tolerances))
        if net2.width != net1.width:
            raise NotIdentifiableError(_unmatched_units(net1, net2, info1, info2))
        perm, mismatch = _match_by_bias(net1, net2)
        bar2 = info2.get("error bar", 0.0)
        details["unit matching"] = f"w_i b_i agree to {mismatch:.1e}"
        # rounded answers: w_i b_i of either network is off by about its fit's bar
        if mismatch > MATCH_TOLERANCE + MATCH_BARS * (bar + bar2):
            raise ModelMismatchError(
                f"not a residual Transformer layer: the units of [x] and [p; 0] do not share "
                f"their w_i b_i (worst {mismatch:.1e})")
        # net1: w1 (p1, b1) = w ((R + B)_i, b_i); net2: w2 (p2, b2) = w (B_i / 2, b_i)
        B = 2.0 * (net2.w[perm, None] * net2.P[perm]) / net1.w[:, None]
        R = net1.P - B
        if tolerances.noise:
            bar = max(bar, bar2, _residual_bar(net1, net2, perm, B, R, info1, info2))
    else:
        B, R = net1.P, np.zeros_like(net1.P)
    ffn = _FFN(R, B, net1.b, net1.w, net1.c0)
    W, reach, probe_info = stage("copy probes", lambda: _copy_logits(
        oracle, ffn, np.random.default_rng(seeds[3]), scale, {}, tolerances.noise))
    details.update(probe_info)
    expected = "measured"
    if tolerances.noise:
        W, fit_info = stage("joint fit of W", lambda: _fit_logits(
            oracle, ffn, W, np.random.default_rng(seeds[3].spawn(1)[0]), noise))
        probe_info.pop("W error bar")
        details.update(fit_info)
        # the FFN's own error (its bar) enters every answer of the fit besides the rounding
        if not fit_info["W fit noise"] <= NOISY_FIT * (noise + bar):
            raise ModelMismatchError(
                f"no W fits the answers to their rounding with the FFN found (weighted "
                f"residual {fit_info['W fit noise']:.1e}, noise {noise:.1e}, the FFN's error "
                f"bar {bar:.1e}): not an attention layer followed by a ReLU FFN")
        bar = max(bar, fit_info["W error bar"])
        if not bar <= MAX_NOISY_BAR:
            raise RecoveryFailedError(
                f"the layer's error bar is {bar:.1e} (largest canonical parameter error, from "
                f"the fits at the measured noise {noise:.1e}), above {MAX_NOISY_BAR:.0e}: the "
                f"answers are too coarse for this layer; nothing is returned. Serve the black "
                f"box in float64")
        verify_tolerance = max(verify_tolerance, VERIFY_NOISE * (noise + bar))
        details["measured noise"] = f"{noise:.1e} relative"
        details["error bar"] = bar
        # a unit whose w_i is within the bar of zero cannot be told from no unit: the
        # fits absorb it (the learner also drops a found unit whose w_i is within its bar)
        details["detection limit"] = bar
        expected = bar
        precision_notes.append(
            f"error bar {bar:.1e} (largest canonical parameter error, {ERROR_BAR_SIGMAS:g} "
            f"standard errors of the fits at the measured noise {noise:.1e}); held-out "
            f"tolerance {verify_tolerance:.1e}")
        precision_notes.append(
            f"detection limit {bar:.1e}: hidden units whose output weight |w_i| is below "
            f"{bar:.1e} of the largest (canonical form, rows of unit norm) are within the "
            f"error bar of a zero weight: this precision cannot tell them from no unit, and "
            f"they may be missing; {net1.width} units found. The error bar covers the units "
            f"found and, for a unit missing, its weight taken as zero")
    if residual:
        V = np.linalg.lstsq(R, B, rcond=None)[0]
        model = TransformerLayer(W, V, R, net1.b, net1.w, net1.c0, residual=True)
    else:
        model = TransformerLayer(W, np.eye(d), B, net1.b, net1.w, net1.c0)
    details["FFN queries"] = ", ".join(f"{k} {v}" for k, v in ffn_counts.items())
    return _finish(oracle, model, counts, details, seeds, start, start_queries, start_bb,
                   verify_tolerance, reach, expected, tolerances.noise)


def _unmatched_units(net1, net2, info1: dict, info2: dict) -> str:
    """The refusal's message when the single-token and the [p; 0] FFN fits found different
    unit counts: the counts, and how weak the larger network's weakest unit is against
    its own bar (a unit near the detection limit is seen by one fit only)."""
    message = f"{net1.width} units found on single tokens but {net2.width} on [p; 0]"
    more, info = (net1, info1) if net1.width > net2.width else (net2, info2)
    if "unit bars" not in info:         # float64 answers: no unit is near a detection limit
        return (message + ": units that read only the residual stream or only the "
                "attention output are not supported")
    k = int(np.argmin(np.abs(more.w)))
    weakest = float(np.abs(more.w[k]) / np.abs(more.w).max())
    which = "single tokens" if more is net1 else "[p; 0]"
    return (message + f" (both fits match their answers to the rounding): the weakest unit on {which} "
            f"has |w_i| {weakest:.1e} of the largest, {abs(more.w[k]) / info['unit bars'][1][k]:.2g} "
            f"x its own bar at the measured noise; a unit this weak is seen in one stream's "
            f"answers and not in the other's, so the two fits cannot be matched unit by "
            f"unit. Nothing is returned; answers with less rounding (the black box served "
            f"in float64) lower the detection limit")


def _residual_bar(net1, net2, perm, B, R, info1: dict, info2: dict) -> float:
    """Rounded answers, residual term: the error bar of B = 2 w2 P2 / w1 and R = P1 - B
    in the canonical form (rows of R + B = P1 of unit norm), from the two FFN fits' bars
    per unit (``unit bars`` of :func:`attnextract.learners.biased_relu.refine_network`):
    B_i is off by |B_i| (dw2_i / |w2_i| + dw1_i / |w1_i|) + 2 |w2_i / w1_i| dP2_i and R_i
    by that plus dP1_i; each relative to the largest entry of B, R."""
    (dP1, dw1), (dP2, dw2) = info1["unit bars"], info2["unit bars"]
    dP2, dw2 = dP2[perm], dw2[perm]
    w1, w2 = np.abs(net1.w), np.abs(net2.w[perm])
    off = safe_norm(B, axis=1) * (dw2 / w2 + dw1 / w1) + 2.0 * w2 / w1 * dP2      # (m,)
    return float(max(off.max() / np.abs(B).max(),
                     (off + dP1).max() / max(np.abs(R).max(), 1e-300)))


def _relative_noise(precision, answers) -> float:
    """The answers' relative error as stated or detected (0 for float64)."""
    if precision.exact:
        return 0.0
    size = safe_rms(answers)        # answers of 1e200 would overflow when squared
    return precision.relative + precision.absolute / max(size, 1e-300)


def _refuse_low_precision(precision, why: str, spent: int, early: bool = True,
                          heads: bool = False):
    """RecoveryFailedError for a layer outside the low-precision path; ``early``: stating
    the precision would have refused it before any query (several heads). ``heads``: the
    reason is several heads (the measured limits of those stages are said)."""
    stages = (
        "its stages for several heads (the odd part of large tokens, whose rounding grows "
        "like the square of their size, the multi-head learner, the per-cell head split) "
        "have no low-precision path: measured with answers off by e relative (e = 1e-14 to "
        "1e-10, d = 8 and 16, two heads), they return parameters off by 1e4 e to 2e6 e and "
        "refuse most layers from e = 1e-11 on (at d = 16 from 1e-13), while float32 answers "
        "are off by 6e-8 (one rounding) or more (a forward pass)"
        if heads else
        f"its other stages (the bias-free residual learner) need answers accurate to "
        f"{MAX_RELATIVE_NOISE:.0e} relative")
    raise RecoveryFailedError(
        f"the transformer-layer learner takes low-precision answers ({precision.describe()}) "
        f"only for one head (--heads 1), with a residual connection only when the FFN has "
        f"biases: {stages}; this layer has {why}; refused after {spent} queries, nothing is "
        f"returned. Serve the black box in float64 (without --output-dtype or --decimals)" + (
            "" if precision.stated or not early else
            "; stating --output-dtype float32|bfloat16 or --decimals K (API output_dtype=, "
            "decimals=) refuses before any query"))


def _low_precision(oracle, precision, noise, seeds, scale, heads, gap, spent, notes, counts):
    """Answers coarser than MAX_RELATIVE_NOISE: the noise measured, the single-token
    stage's thresholds set from it (:func:`noisy_tolerances`); several heads are refused
    (:class:`RecoveryFailedError`). Returns (tolerances, noise, residual term present:
    the residual check's gap beyond RESIDUAL_NOISE times the noise)."""
    if heads > 1:
        _refuse_low_precision(precision, f"{heads} heads asked for", spent, heads=True)
    if precision.forward:
        noise = UNIT_ROUNDING[precision.name]
    measured = _stage(oracle, counts, "noise", lambda: _measure_noise(
        oracle, np.random.default_rng(seeds[0].spawn(1)[0]), scale))
    # the measured spread, not the stated or detected bound: one rounding to float32 is
    # off by at most 6e-8 relative but by 2.5e-8 typically; a forward pass by more
    noise = max(noise / NOISE_BOUND, measured)
    tolerances = _noisy_tolerances(noise, precision, measured, spent + 3 * NOISE_POINTS)
    notes.append(f"{precision.describe()}; measured noise {measured:.1e} relative: the "
                 f"single-token stage ran with chords of {tolerances.chord:.2g} and a joint "
                 f"least-squares fit")
    # f([p; 0]) = f([p / 2]) up to the rounding exactly when there is no residual term
    return tolerances, noise, gap > RESIDUAL_NOISE * noise


def _noisy_tolerances(noise, precision, measured, spent):
    """:func:`noisy_tolerances`, its refusal naming the precision and the queries spent."""
    try:
        return noisy_tolerances(noise)
    except RecoveryFailedError as exc:
        bits = {"float32": 24, "bfloat16": 8, "float16": 11}.get(precision.name)
        why = (f" ({precision.name} keeps {bits} significant bits: a kink must change the "
               f"slope by more than the rounding over a chord, and two kinks within a chord "
               f"merge)" if precision.forward and bits else "")
        raise RecoveryFailedError(f"{exc}{why} ({precision.describe()}, noise {measured:.1e}); "
                                  f"refused after {spent} queries, nothing is returned. Serve "
                                  f"the black box in float64, or in float32") from None


def _measure_noise(oracle, rng, scale: float) -> float:
    """The answers' relative noise: second differences F(x + h u) - 2 F(x) + F(x - h u) of
    single tokens vanish for a piecewise-linear F except across a kink (rare at a short
    step h), so their median is rounding alone. 3 NOISE_POINTS queries."""
    d = oracle.dim
    x = scale * rng.standard_normal((NOISE_POINTS, d))
    u = rng.standard_normal((NOISE_POINTS, d))
    u *= NOISE_STEP * scale / safe_norm(u, axis=1)[:, None]
    oracle.require(3 * NOISE_POINTS, "measuring the answers' noise")
    f = oracle.query(np.concatenate([x - u, x, x + u])[:, None, :]).reshape(3, NOISE_POINTS)
    second = np.abs(f[0] - 2.0 * f[1] + f[2]) / np.maximum(np.abs(f).max(axis=0), 1e-300)
    # |D| of three independent errors of std s has median 0.6745 sqrt(6) s
    return float(np.median(second)) / (0.6745 * math.sqrt(6.0))


def free_parameters(model: TransformerLayer) -> int:
    """Free parameters of the canonical form: heads H (d^2) and P_h (H m d), A (m d) with a
    residual term, b and w (2 m), c0 (1), minus one scale per unit."""
    H, d, m = model.heads, model.dim, model.width
    return H * d * d + H * m * d + (m * d if model.residual else 0) + m + 1


def _finish(oracle, model, counts, details, seeds, start, start_queries, start_bb,
            verify_tolerance, reach: float = 0.0, expected="measured",
            noise: float = 0.0) -> ExtractionResult:
    """Held-out verification (also far out, where the probes or the FFN's hyperplanes
    were, when that is beyond the usual token scale), the report, the checked result."""

    d = oracle.dim
    floor = free_parameters(model)
    n_verify = verification_count(floor)
    rng = np.random.default_rng(seeds[4])
    near = token_scale(model)
    far = max(reach, 2.0 * float(np.abs(model.b).max(initial=0.0))) / math.sqrt(d)
    n_far = n_verify // 2 if far > 2.0 * near else 0
    oracle.require(n_verify + n_far, "held-out verification of the Transformer layer")
    verification = verify_model(oracle, model, count=n_verify, seed=rng,
                                tolerance=verify_tolerance, scale=near, expected_error=expected,
                                answer_noise=noise)
    if n_far:
        # a unit active only far out is invisible near the origin: look where it is
        far_check = verify_model(oracle, model, count=n_far, seed=rng,
                                 tolerance=verify_tolerance, scale=far, expected_error=expected,
                                 answer_noise=noise)
        verification = merge_verifications(verification, far_check)
        details["far verification"] = (f"{n_far} sequences at token scale {far:.3g}: max "
                                       f"relative error {far_check.max_relative_error:.1e}")
    n_verify += n_far
    counts["verification"] = n_verify
    total = oracle.queries - start_queries
    report = Report(
        kind=TransformerLayer.kind, dim=d, queries=total,
        breakdown={"recovery": total - n_verify, **counts}, floor=floor,
        verification=verification, seconds=time.perf_counter() - start,
        black_box_seconds=oracle.black_box_seconds - start_bb,
        notes=["single tokens: the FFN x -> w^T ReLU(A V x + b) + c0 (critical points on "
               "lines, then signs); copy probes: [q + u; q] and [q + u; q + u; q] inside one "
               "linear piece of the FFN give u^T W q"],
        details=details)
    return checked_result(model, report, "a Transformer layer (attention + ReLU FFN)")


def _bias_free_residual(oracle, net1, seeds, counts, details, start, start_queries, start_bb,
                        verify_tolerance) -> ExtractionResult:
    """Residual term, no biases: the residual learner on f - c0 (its units match across
    streams by direction, which w_i b_i = 0 cannot do)."""
    c0 = net1.c0
    shifted = _ShiftedOracle(oracle, c0)
    before = oracle.queries
    try:
        res = extract_one_layer_residual(shifted, seed=int(seeds[2].generate_state(1)[0]))
    except ModelMismatchError as exc:
        raise ModelMismatchError(f"not a Transformer layer (residual, no biases): {exc}",
                                 result=exc.result) from exc
    finally:
        counts["residual learner"] = oracle.queries - before
    r = res.model
    unit = safe_norm(r.A + r.B, axis=1)          # the canonical scale: single-token rows
    A, B = r.A / unit[:, None], r.B / unit[:, None]
    V = np.linalg.lstsq(A, B, rcond=None)[0]
    model = TransformerLayer(r.W, V, A, np.zeros(r.width), r.w * unit, c0, residual=True)
    details["method"] = "bias-free residual learner on f - c0"
    return _finish(oracle, model, counts, details, seeds, start, start_queries, start_bb,
                   verify_tolerance)


class _ShiftedOracle(OracleView):
    """The black box minus a constant, behind the Oracle interface (same query counts)."""

    def __init__(self, oracle: QueryAccess, offset: float):
        super().__init__(oracle)
        self.offset = offset

    def query(self, X) -> np.ndarray:
        return self.base.query(X) - self.offset

    def query_ragged(self, sequences) -> np.ndarray:
        return self.base.query_ragged(sequences) - self.offset


class LargeTokenOddOracle(OracleView):
    """Multi-head attention sum_h v_h^T Z^T softmax(Z W_h z_N) read off a layer with FFN biases.

    A probe Z (B, N, d) is sent as X = L z_N + eps Z (every token shifted along the last
    one), with eps (L + eps) = 1: x_i^T W_h x_N = z_i^T W_h z_N + (a constant over i), so
    every head attends as it would to Z. The pre-activations are a + b with
    a = L P z_N + eps sum_h P_h Z^T alpha_h (P = sum_h P_h), and

        ReLU(a_i + b_i) - ReLU(-a_i + b_i) = a_i + sign(a_i) b_i    when |a_i| >= |b_i|.

    L is chosen per probe so that L |p_i^T z_N| exceeds KINK_MARGIN (|b_i| + the eps term's
    bound) for every unit with b_i != 0; then sign(a_i) = sign(p_i^T z_N) and

        [f(X) - f(-X) - f([L z_N]) + f([-L z_N])] / eps = sum_h v_h^T Z^T alpha_h,

    v_h = P_h^T w: exactly the bias-free odd part (with the residual term, plus
    u^T z_N, u = A^T w: ``residual_readout`` u is subtracted). Four queries per probe (two lengths,
    one batch each). The large tokens cost precision (rounding of order L^2 eps_mach):
    outputs are rounded to float32, so the multi-head learner's precision model (it
    detects rounded outputs) covers them; its heads are a start, refined in cells
    (:func:`_split_heads` with ``refine``).

    Parameters
    ----------
    oracle : Oracle
        The black box.
    net : BiasedReLUNetwork
        The single-token FFN (rows of P of unit norm, b, w).
    residual_readout : array (d,), optional
        u = A^T w of a layer with the residual term: u^T z_N is subtracted.

    A probe moved off a hyperplane costs 16 queries; ``require`` and ``plan`` count 4
    (the oracle's own budget check still holds).
    """

    def __init__(self, oracle: QueryAccess, net: BiasedReLUNetwork, residual_readout=None):
        super().__init__(oracle, "large-token odd part")
        self.P, self.b = net.P, net.b
        self.u = residual_readout
        self.largest_shift = 0.0
        self.moved = 0

    def require(self, n: int, what: str = "this step") -> None:
        self.base.require(4 * n, self._named(f"{what} (four queries per probe)"))

    def plan(self, n: int, what: str = "the extraction", need: int | None = None) -> None:
        self.base.plan(4 * n, self._named(f"{what} (four queries per probe)"),
                       None if need is None else 4 * need)

    def shifts(self, Z: np.ndarray) -> np.ndarray:
        """L per probe (B,): every biased unit's kink out of reach of the attention term."""
        last = Z[:, -1]
        s = np.abs(last @ self.P.T)                                      # (B, m)
        reach = KINK_MARGIN * HEAD_BOUND * safe_norm(Z, axis=2).max(axis=1)[:, None]
        gap = KINK_MARGIN * np.abs(self.b)[None]
        # L s >= margin (|b| + bound / L), eps <= 1 / L: L^2 s - gap L - reach >= 0
        with np.errstate(divide="ignore", invalid="ignore"):
            L = (gap + np.sqrt(gap * gap + 4.0 * s * reach)) / (2.0 * s)
        L = np.where(np.abs(self.b)[None] > 0, L, 0.0)
        return L.max(axis=1, initial=0.0)

    def query(self, Z) -> np.ndarray:
        Z = np.asarray(Z, dtype=np.float64)
        if Z.ndim == 2:
            Z = Z[None]
        B = Z.shape[0]
        L = self.shifts(Z)
        # the probe's signal eps z sits L^2 |z_N| / max|z| below the tokens' size (float64
        # rounding of that much); where that is large because z_N is within an angle
        # MOVE / 2 of unit i's hyperplane, z_N moves off it along p_i by k eta (k = +-1,
        # +-2; eta = MOVE |z_N|) and the answer is extrapolated to eta = 0 (Richardson on
        # the symmetric means: error O(eta^4))
        last = Z[:, -1]
        size = safe_norm(last, axis=1)
        loss = L * L * size / np.maximum(safe_norm(Z, axis=2).max(axis=1), 1e-300)
        with np.errstate(divide="ignore", invalid="ignore"):
            need = np.abs(self.b)[None] / np.abs(last @ self.P.T)
        worst = np.argmax(np.where(np.abs(self.b)[None] > 0, need, -np.inf), axis=1)
        angle = np.abs(np.einsum("bd,bd->b", last, self.P[worst])) / np.maximum(size, 1e-300)
        near = np.flatnonzero((loss > MAX_LOSS) & (angle < 0.5 * MOVE))
        if not len(near):
            return self._odd(Z, L).astype(np.float32).astype(np.float64)
        worst = worst[near]
        eta = MOVE * size[near]
        moved = np.repeat(Z[near], 4, axis=0)
        steps = np.tile([-2.0, -1.0, 1.0, 2.0], len(near)) * np.repeat(eta, 4)
        moved[:, -1] += steps[:, None] * np.repeat(self.P[worst], 4, axis=0)
        keep = np.setdiff1d(np.arange(B), near)
        both = np.concatenate([Z[keep], moved])
        out = self._odd(both, self.shifts(both))
        g = np.empty(B)
        g[keep] = out[:len(keep)]
        h = out[len(keep):].reshape(len(near), 4)
        one, two = 0.5 * (h[:, 1] + h[:, 2]), 0.5 * (h[:, 0] + h[:, 3])
        g[near] = (4.0 * one - two) / 3.0
        self.moved += len(near)
        return g.astype(np.float32).astype(np.float64)

    def _odd(self, Z: np.ndarray, L: np.ndarray) -> np.ndarray:
        """The four-query identity of the class docstring at shifts L (B,)."""
        B = Z.shape[0]
        if not np.all(np.isfinite(L)):
            raise ModelMismatchError("a large-token probe has its last token on a unit's "
                                     "hyperplane through the origin")
        self.largest_shift = max(self.largest_shift, float(L.max(initial=0.0)))
        eps = 2.0 / (L + np.sqrt(L * L + 4.0))                           # eps (L + eps) = 1
        X = L[:, None, None] * Z[:, -1:, :] + eps[:, None, None] * Z
        f = self.base.query(np.concatenate([X, -X]))
        one = (L[:, None] * Z[:, -1])[:, None, :]
        f1 = self.base.query(np.concatenate([one, -one]))
        g = (f[:B] - f[B:] - f1[:B] + f1[B:]) / eps
        return g if self.u is None else g - Z[:, -1] @ self.u

    def query_ragged(self, sequences) -> np.ndarray:
        from ..oracle import evaluate_ragged
        return evaluate_ragged(self.query, [np.asarray(s, dtype=np.float64) for s in sequences])


def _uniform_readout(oracle: QueryAccess, net: BiasedReLUNetwork, rng) -> np.ndarray:
    """sum_h v_h = sum_h P_h^T w from [s p; 0] (a zero last token: uniform attention).

    pi([s p; 0]) = (s / 2) P p + b with P = sum_h P_h (the residual term sees x_N = 0).
    Each unit's odd part is affine in s on either side of its kink, so
    2 (odd(2 s p) - odd(s p)) / s = v^T p except for units still inside |s P_i p / 2| <
    |b_i| at both scales, which add at most 2 |w_i b_i| / s. P is not known yet, so s is
    huge (UNIFORM_SCALE: the error is below 1e-10, and dividing by s keeps the rounding
    relative); a kink crossed between s and 4 s shows as disagreement of the two
    differences (not a ReLU FFN: ModelMismatchError). d orthonormal p, 6 d queries.
    """
    d = oracle.dim
    basis = np.linalg.qr(rng.standard_normal((d, d)))[0].T                      # rows p_j
    s = UNIFORM_SCALE * (1.0 + float(np.abs(net.b).max()) * float(np.abs(net.w).max()))
    X = np.concatenate([k * s * basis for k in (1.0, 2.0, 4.0)])[:, None, :]
    X = np.concatenate([X, np.zeros_like(X)], axis=1)                          # [s p; 0]
    oracle.require(6 * d, "the heads' summed readout from [s p; 0]")
    f = oracle.query(np.concatenate([X, -X]))
    odd = (f[:3 * d] - f[3 * d:]).reshape(3, d)
    first, second = 2.0 * (odd[1] - odd[0]) / s, (odd[2] - odd[1]) / s
    if not np.all(np.abs(first - second) <= 1e-9 * np.abs(odd[2]).max() / s):
        raise ModelMismatchError("the odd part of [s p; 0] is not linear in s: not a residual "
                                 "Transformer layer with a ReLU FFN")
    return np.linalg.solve(basis, second)


def _stage(oracle, counts: dict, name: str, run):
    """Run one stage of the learner (:func:`.residual.counted_stage`)."""
    return counted_stage(oracle, counts, name, run, "a Transformer layer")


def _extract_heads(oracle, heads, residual, seeds, counts, start, start_queries, start_bb,
                   verify_tolerance, scale) -> ExtractionResult:
    """H > 1: FFN from single tokens, heads from the odd part, then the P_h split per unit."""
    from .multi_head import extract_multi_head
    from .one_layer import OddPartOracle

    d = oracle.dim

    stage = functools.partial(_stage, oracle, counts)

    net, info = stage("single tokens", lambda: extract_biased_relu(
        oracle, np.random.default_rng(seeds[1]), scale=scale))
    biased = bool(np.abs(net.b).max() > BIAS_ZERO * scale)
    if not biased:
        net = stage("single tokens", lambda: _without_biases(oracle, net))
    heads_oracle: QueryAccess                  # the heads' view of the box (below)
    if biased and residual:
        # u = A^T w from single tokens ((A + sum_h P_h)^T w) minus sum_h v_h, read off
        # [s p; 0] (uniform attention) past every kink at two scales
        readout = stage("residual readout", lambda: _uniform_readout(
            oracle, net, np.random.default_rng(seeds[1].spawn(1)[0])))
        heads_oracle = LargeTokenOddOracle(oracle, net, net.P.T @ net.w - readout)
    elif biased:
        readout = net.P.T @ net.w
        heads_oracle = LargeTokenOddOracle(oracle, net)
    elif residual:
        # the odd part is u^T x_N + multi-head attention, u = A^T w; [e_i; 0] (uniform
        # attention, x_N = 0) give sum_h v_h / 2, single tokens u + sum_h v_h
        odd = OddPartOracle(oracle)
        before = oracle.queries
        E = np.eye(d)
        readout = 2.0 * odd.query(np.stack([E, np.zeros_like(E)], axis=1))
        counts["residual readout"] = oracle.queries - before
        u = net.P.T @ net.w - readout
        heads_oracle = _ResidualOddOracle(oracle, u)
    else:
        readout = net.P.T @ net.w
        heads_oracle = OddPartOracle(oracle)
    rough = {"verify_tolerance": ROUGH_VERIFY_TOLERANCE,
             "max_error_bar": ROUGH_ERROR_BAR} if biased else {"verify_tolerance": verify_tolerance}
    attention = stage("attention (odd part)", lambda: extract_multi_head(
        heads_oracle, heads=int(heads), seed=int(seeds[2].generate_state(1)[0]), **rough)).model
    v_error = float(safe_norm(attention.v.sum(axis=0) - readout) / safe_norm(readout))
    P_h, W, reach, split_info = stage("head split", lambda: _split_heads(
        oracle, net, attention.W, np.random.default_rng(seeds[3]), scale,
        known_sum=not residual, refine=biased))
    if biased:
        assert isinstance(heads_oracle, LargeTokenOddOracle)      # the biased branches' view
        split_info["largest token shift L"] = f"{heads_oracle.largest_shift:.3g}"
        split_info["probes extrapolated off a hyperplane"] = heads_oracle.moved
    if residual:
        A = net.P - P_h.sum(axis=0)
        V = np.stack([np.linalg.lstsq(A, P, rcond=None)[0] for P in P_h])
        model = TransformerLayer(W, V, A, net.b, net.w, net.c0, residual=True)
    else:
        # A V_h = P_h in least squares weighted by |w_k|: unit k's row was measured as the
        # jump w_k P_h,k, so its error goes like 1 / |w_k| (unweighted, a weak unit's
        # noise would spread over every row through the projection onto range(A))
        V = np.stack([np.linalg.lstsq(net.w[:, None] * net.P, net.w[:, None] * P,
                                      rcond=None)[0] for P in P_h])
        model = TransformerLayer(W, V, net.P, net.b, net.w, net.c0)
    details = {"hidden units": net.width, "canonical heads": attention.heads,
               "residual": str(residual),
               "biases b": (f"detected, max |b_i| = {np.abs(net.b).max():.3g}" if biased
                            else "none detected"),
               "output bias c0": f"{net.c0:.6g}", "FFN lines": info["lines"],
               "sum_h v_h vs A^T w": f"{v_error:.1e} relative", **split_info}
    if v_error > (ROUGH_HEADS_TOLERANCE if biased else 1e-6):
        raise ModelMismatchError(
            f"not a Transformer layer: the heads' readouts add up to {v_error:.1e} (relative) off "
            f"the single-token FFN's A^T w")
    return _finish(oracle, model, counts, details, seeds, start, start_queries, start_bb,
                   verify_tolerance, reach)


def _split_heads(oracle: QueryAccess, net: BiasedReLUNetwork, W: np.ndarray, rng, scale: float,
                 known_sum: bool = True, refine: bool = False):
    """P_h = A V_h per unit, once the heads W_h (H, d, d) and P = sum_h P_h are known.

    For every unit k two cells of the FFN touch across its hyperplane only
    (:func:`attnextract.learners.biased_relu.crossing_points` on the cones of P; with
    biases each pair is scaled out (:func:`_biased_scales`) until its two biased cells
    differ in unit k only and hold the probes). In a cell S around q the
    probe [q + delta; q] stays in S for small delta, and

        f([q + delta; q]) - f([q]) = sum_h sigma(tau_h) delta^T r_h,   tau_h = delta^T W_h q,

    with the readouts r_h = P_h,S^T w_S unknown and sum_h r_h = g_S (the FFN's gradient in
    S) known. The logits are chosen, not left to chance: with C = [W_h q]_h (d, H) and its
    dual basis E = C (C^T C)^{-1}, delta = E tau + (a random vector orthogonal to C) has
    logits exactly tau, drawn uniformly in [-SPLIT_LOGIT, SPLIT_LOGIT] per head and probe;
    the cell is scaled out along its cone (r_h does not change) until such a delta fits in
    half its room. (H + 1) d probes per cell give the (H - 1) d unknowns by least squares;
    across unit k's hyperplane the readouts jump by w_k P_h,k. Queries: 2 m (1 + (H + 1) d).

    ``refine`` (heads known only roughly, e.g. to 1e-6): (2 H + 1) d probes per cell, and
    each cell fits k_h = W_h q jointly with all H readouts (Gauss-Newton from the rough
    W_h, 2 H d unknowns; sum_h r_h = g_S is checked, not imposed: imposing it would pass
    the FFN's error, summed over the active units, into every jump); then W_h is the
    least-squares solution of W_h q_j = k_h,j over all cells. Queries: 2 m (1 + (2H + 1) d).

    Returns (P_h (H, m, d), W (H, d, d), the largest probe radius, details).
    """
    H, d = W.shape[0], oracle.dim
    m = net.width
    cones = BiasedReLUNetwork(net.P, np.zeros(m), net.w, 0.0)
    units, y0, r = crossing_points(cones, rng, scale)
    if len(units) != m:
        raise ModelMismatchError(f"only {len(units)} of {m} units have a cell to split the heads in")
    half = 0.5 * r[:, None] * net.P
    Q = np.stack([y0 + half, y0 - half], axis=1).reshape(-1, d)           # (2m, d) cell points
    cone_room = np.repeat(0.5 * r, 2)                                      # at Q, without b
    room = cone_room * MARGIN_FRACTION / (2.0 * H)
    # (H + 1) d probes for (H - 1) d unknowns; 2 H d for H d when the sum is not known;
    # 2 H d for (2 H - 1) d when the logits are refined too
    n_cells = len(Q)
    n_probes = (2 * H + 1 if refine else 2 * H if not known_sum else H + 1) * d
    C = np.einsum("hde,je->jdh", W, Q)                                    # (2m, d, H)
    E = np.stack([c @ np.linalg.pinv(c.T @ c) for c in C])               # dual bases
    # scale each cell out: |E tau| shrinks like 1 / lambda, its room grows like lambda
    need = safe_norm(E, axis=(1, 2)) * SPLIT_LOGIT * math.sqrt(H)
    lam = np.sqrt(np.maximum(need / room, 1.0))
    if np.any(net.b != 0):
        lam, room = _biased_scales(net, Q, units, need, lam, H)
    Q, room, E = lam[:, None] * Q, lam * room, E / lam[:, None, None]
    tau = rng.uniform(-SPLIT_LOGIT, SPLIT_LOGIT, size=(n_cells, n_probes, H))
    along = np.einsum("jdh,jph->jpd", E, tau)
    xi = rng.standard_normal((n_cells, n_probes, d))
    basis_c = np.stack([np.linalg.qr(c)[0] for c in C])                  # (2m, d, H)
    xi -= np.einsum("jdh,jph->jpd", basis_c, np.einsum("jdh,jpd->jph", basis_c, xi))
    xi *= (safe_norm(along, axis=2) / safe_norm(xi, axis=2))[:, :, None]
    delta = along + xi
    delta *= np.minimum(1.0, room[:, None] / safe_norm(delta, axis=2))[:, :, None]
    K = C * lam[:, None, None]                                            # (2m, d, H): W_h q
    oracle.require(n_cells * (1 + n_probes), "splitting the heads")
    F0 = oracle.query(Q[:, None, :])
    seqs = np.stack([(Q[:, None, :] + delta).reshape(-1, d), np.repeat(Q, n_probes, axis=0)],
                    axis=1)
    y = oracle.query(seqs).reshape(n_cells, n_probes) - F0[:, None]
    G = ((Q @ net.P.T + net.b > 0) * net.w) @ net.P if known_sum else None   # g_S per cell
    details = {}
    if refine:
        # every readout free: imposing sum_h r_h = g_S would pass the FFN's own error
        # (summed over the active units) into every head's jump
        K, steps = _refine_logits(delta, y, K)
        # W_h from W_h q_j = k_h,j over all cells (least squares, one solve per head)
        W = np.stack([np.linalg.lstsq(Q, K[:, :, h], rcond=None)[0].T for h in range(H)])
        K = np.einsum("hde,je->jdh", W, Q)
        details["logit refinement"] = f"Gauss-Newton per cell, last step {steps:.1e} relative"
    tau = np.einsum("jpd,jdh->jph", delta, K)                             # exact logits
    R, fit = _readouts(delta, y, tau, None if refine else G)
    if refine and G is not None:
        gap = float(np.abs(R.sum(axis=1) - G).max() / np.abs(G).max())
        details["sum_h r_h vs the FFN's gradient"] = f"{gap:.1e} relative"
        if not gap <= READOUT_SUM_TOLERANCE:
            raise ModelMismatchError(f"the heads' readouts in a cell add up to {gap:.1e} (relative) "
                                     f"off the single-token FFN's gradient there")
    jumps = R[0::2] - R[1::2]                                                # w_k P_h,k
    P_h = np.swapaxes(jumps / net.w[:, None, None], 0, 1)                    # (H, m, d)
    if refine and known_sum:
        # sum_h P_h,k is unit k's single-token row, known from the FFN stage to its own
        # precision (about 1e-10): the least-squares correction spreads the difference
        # evenly over the heads (an error common to all heads moves f most)
        P_h += (net.P - P_h.sum(axis=0))[None] / H
    if not fit <= 1e-8:
        raise ModelMismatchError(
            f"the probes do not split into {H} heads within linear pieces of the FFN (relative "
            f"misfit {fit:.1e})")
    details["head split"] = (f"{n_cells} cells scaled by {lam.min():.3g} .. {lam.max():.3g}, "
                             f"misfit {fit:.1e}")
    return P_h, W, float(safe_norm(Q, axis=1).max()), details


def _biased_scales(net: BiasedReLUNetwork, Q: np.ndarray, units: np.ndarray, need: np.ndarray,
                   lam: np.ndarray, H: int):
    """With biases: per pair of cells (rows 2j, 2j + 1 of Q, either side of unit units[j]'s
    hyperplane through the origin) the smallest scale lambda >= the cone's on a geometric
    grid at which the biased sign patterns of the two points differ in that unit only and
    the designed probes fit in the biased room. Small lambda keeps f small against the
    probes' signal (their ratio goes like 1 / lambda^2). Returns (lambda, room per unit
    of lambda), both (2m,)."""
    m = len(units)
    grid = np.geomspace(1.0, 2.0 ** 20, 81)
    lam_out, room_out = np.empty(2 * m), np.empty(2 * m)
    for j, k in enumerate(units):
        pair = Q[2 * j:2 * j + 2]
        for g in grid:
            scale = g * lam[2 * j:2 * j + 2].max()
            pre = scale * pair @ net.P.T + net.b                                # (2, m)
            differ = np.flatnonzero((pre[0] > 0) != (pre[1] > 0))
            room = MARGIN_FRACTION / (2.0 * H) * np.abs(pre).min(axis=1)
            if (len(differ) == 1 and differ[0] == k
                    and np.all(need[2 * j:2 * j + 2] / scale <= room)):
                break
        else:
            raise NotIdentifiableError(f"no scale puts unit {k}'s two cells in its reach")
        lam_out[2 * j:2 * j + 2] = scale
        room_out[2 * j:2 * j + 2] = room / scale
    return lam_out, room_out


def _readouts(delta, y, tau, G):
    """Readouts r_h (cells, H, d) from y = sum_h sigma(tau_h) delta^T r_h per cell, with
    sum_h r_h = G (cells, d) when G is given; and the relative misfit."""
    n_cells, n_probes, H = tau.shape
    d = delta.shape[2]
    a = 1.0 / (1.0 + np.exp(-tau))                                        # (j, p, H)
    if G is not None:
        # r_H = g - sum_{h<H} r_h: sum_{h<H} (a_h - a_H) delta^T r_h = y - a_H delta^T g
        rows = ((a[:, :, :-1] - a[:, :, -1:])[:, :, :, None] * delta[:, :, None, :]).reshape(
            n_cells, n_probes, (H - 1) * d)
        rhs = y - a[:, :, -1] * np.einsum("jpd,jd->jp", delta, G)
    else:
        # residual term: the FFN's gradient also carries A, so all H d readouts are unknown
        rows = (a[:, :, :, None] * delta[:, :, None, :]).reshape(n_cells, n_probes, H * d)
        rhs = y
    R = np.stack([np.linalg.lstsq(M, b_, rcond=None)[0] for M, b_ in zip(rows, rhs)])
    fit = float(np.abs(np.einsum("jpk,jk->jp", rows, R) - rhs).max() / np.abs(y).max())
    if G is not None:
        R = R.reshape(n_cells, H - 1, d)
        return np.concatenate([R, (G - R.sum(axis=1))[:, None, :]], axis=1), fit
    return R.reshape(n_cells, H, d), fit


def _refine_logits(delta, y, K):
    """Gauss-Newton per cell on y = sum_h sigma(delta^T k_h) delta^T r_h over (k_h, r_h).

    delta (cells, p, d), y (cells, p), K (cells, d, H) the start; 2 H d unknowns per
    cell. Returns the fitted K and the last relative step.
    """
    n_cells, n_probes, d = delta.shape
    H = K.shape[2]
    K = K.copy()
    step = math.inf
    for _ in range(REFINE_ROUNDS):
        tau = np.einsum("jpd,jdh->jph", delta, K)
        R, _ = _readouts(delta, y, tau, None)                    # readouts given the logits
        a = 1.0 / (1.0 + np.exp(-tau))
        slope = a * (1.0 - a)                                    # (j, p, H)
        read = np.einsum("jpd,jhd->jph", delta, R)               # delta^T r_h
        pred = np.einsum("jph,jph->jp", a, read)
        # d y / d k_h = sigma'(tau_h) (delta^T r_h) delta; d y / d r_h = sigma(tau_h) delta
        Jk = (slope * read)[:, :, :, None] * delta[:, :, None, :]       # (j, p, H, d)
        Jr = a[:, :, :, None] * delta[:, :, None, :]
        J = np.concatenate([Jk.reshape(n_cells, n_probes, H * d),
                            Jr.reshape(n_cells, n_probes, H * d)], axis=2)
        res = y - pred
        dx = np.stack([np.linalg.lstsq(M, r_, rcond=None)[0] for M, r_ in zip(J, res)])
        dK = dx[:, :H * d].reshape(n_cells, H, d).transpose(0, 2, 1)
        K += dK
        step = float(np.abs(dK).max() / np.abs(K).max())
        if step < 1e-14:
            break
    return K, step


def canonical_units(model: TransformerLayer):
    """The hidden units in canonical form, as the single-token FFN sees them.

    Rows of the single-token matrix (A + sum_h P_h with a residual term, sum_h P_h
    without) are scaled to unit norm; every unit's P_h rows, residual row, b and w follow.
    Returns a dict: ``single`` (m, d), ``P`` (H, m, d), ``A`` (m, d) (residual weights,
    zeros without the term), ``b`` (m,), ``w`` (m,).
    """
    P = model.head_maps()
    R = model.A if model.residual else np.zeros_like(model.A)
    single = R + P.sum(axis=0)
    norm = safe_norm(single, axis=1)
    keep = (norm > 0) & (model.w != 0)
    n = norm[keep]
    return {"single": single[keep] / n[:, None], "P": P[:, keep] / n[None, :, None],
            "A": R[keep] / n[:, None], "b": model.b[keep] / n, "w": model.w[keep] * n}


def compare_transformer_layer(recovered: TransformerLayer, truth: TransformerLayer, *,
                              count: int = 256, seed=0) -> dict:
    """Parameter and output errors of a recovered layer against the truth, in canonical form.

    Units are matched by the Hungarian method on 1 - cos of their single-token rows, heads
    by :func:`attnextract.learners.multi_head.match_heads` on (W_h, P_h^T w). Every error is
    the largest entry error relative to the largest entry of the true array. A true unit
    the recovered layer lacks (fewer units recovered) is compared as a zero weight: it
    adds |w_i| / max |w| to ``error_w`` (a unit below the low-precision detection limit);
    more units recovered than true is an infinite error.

    Returns
    -------
    dict
        ``units`` (recovered, true), ``error_W`` (heads), ``error_P`` (A V_h per head),
        ``error_A`` (residual weights), ``error_b``, ``error_w``, ``error_c0`` (relative to
        max(|c0|, max |w|)), ``max_error``, ``bits`` = -log2(max_error), and
        ``max_output_error`` on held-out sequences (lengths 1..16).
    """
    from scipy.optimize import linear_sum_assignment

    from ..models import MultiHeadAttention
    from ..report import held_out_output_error
    from .multi_head import match_heads

    rec, tru = canonical_units(recovered), canonical_units(truth)
    out: dict[str, Any] = {"units": (len(rec["w"]), len(tru["w"]))}
    rel = lambda a, b: float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-300))  # noqa: E731
    if len(rec["w"]) > len(tru["w"]) or recovered.residual != truth.residual:
        out.update(max_error=math.inf, bits=0.0)
    else:
        rows, cols = linear_sum_assignment(1.0 - rec["single"] @ tru["single"].T)
        perm = np.empty(len(rows), dtype=int)
        perm[rows] = cols
        largest_w = float(np.abs(tru["w"]).max())
        unseen = np.setdiff1d(np.arange(len(tru["w"])), cols)
        out["unseen units |w|"] = np.abs(tru["w"][unseen]) / largest_w
        tru = {k: (v[:, perm] if k == "P" else v[perm]) for k, v in tru.items()}
        # heads: readouts P_h^T w identify them (with W_h)
        order, w_err, _ = match_heads(
            MultiHeadAttention(recovered.W, np.einsum("hmd,m->hd", rec["P"], rec["w"])),
            MultiHeadAttention(truth.W, np.einsum("hmd,m->hd", tru["P"], tru["w"])))
        out["error_W"] = max(rel(recovered.W[order[h]], truth.W[h]) for h in range(truth.heads)) \
            if math.isfinite(w_err) else math.inf
        out["error_P"] = max(rel(rec["P"][order[h]], tru["P"][h]) for h in range(truth.heads)) \
            if math.isfinite(w_err) else math.inf
        out["error_A"] = rel(rec["A"], tru["A"]) if truth.residual else 0.0
        out["error_b"] = float(np.abs(rec["b"] - tru["b"]).max() / max(np.abs(tru["b"]).max(), 1.0))
        out["error_w"] = max(float(np.abs(rec["w"] - tru["w"]).max()) / largest_w,
                             float(out["unseen units |w|"].max(initial=0.0)))
        out["error_c0"] = abs(recovered.c0 - truth.c0) / max(abs(truth.c0), largest_w)
        worst = max(out[k] for k in ("error_W", "error_P", "error_A", "error_b", "error_w",
                                     "error_c0"))
        out.update(max_error=worst, bits=float(-math.log2(worst)) if worst > 0 else 53.0)
    out["max_output_error"] = held_out_output_error(recovered, truth, count=count, seed=seed)
    return out
