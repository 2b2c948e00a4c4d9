"""A pre-LayerNorm attention block (GPT-2 style) answering vectors, on the sphere.

The box answers the sublayer at the last position, with its residual R x_N (R the
identity when m = d, or 0 for a box that answers the sublayer alone):

    F(X) = R x_N + O LN(X)^T softmax(LN(X) (W LN(x_N) + b)) + c          in R^m.

On the sphere S = {x : 1^T x = 0, |x| = rho} LayerNorm is affine, LN(x) = A x + beta, so
there (docs/learners/pre-ln.md; :meth:`PreLayerNormAttention.on_sphere` for scalars)

    F(X) = R x_N + O' X^T alpha + c',   alpha = softmax(X (W' x_N + b')),   x_i in S,

with W' = A W A, b' = A (W beta + b), O' = O A, c' = c + O beta (beta^T (W LN(x_N) + b)
is the same for every key and cancels). Only the restrictions to the hyperplane
1^T x = 0 are seen (P = I - 1 1^T / d): P W' P, P b', O' P, R P and c', with
n = d - 1, n^2 + n + 2 m n + m numbers (:class:`attnextract.models.VectorSphereAttention`).
Tokens must lie on S (LN sees directions only): the vector single head's zero token
and t e_k are not available, and the knob left is the chord |a - q| between tokens.

Identities, for tokens a, q in S, u = a - q and M = (R + O') P:

1. Single tokens: F([x]) = M x + c'. At the d vertices q_j of a regular simplex in S
   (sum_j q_j = 0, sum_j q_j q_j^T = rho^2 d / n P): c' = mean_j F([q_j]) and
   M = n / (rho^2 d) sum_j (F([q_j]) - c') q_j^T: d queries.
2. Three tokens [a, a, q] and [a, q, q] (one length: one batch):
       g_A = F - c' - M q = sigma(t + log 2) O' u,   g_B = sigma(t - log 2) O' u,
   t = u^T (W' q + b'). The two answers are parallel; with k = g_B / g_A (in (1/4, 1)),
       O' u = 3 g_B / (4 k - 1),   t = log((4 k - 1) / (2 (1 - k))).
   n directions u_k around q_0: O' P (so R P = M - O' P) and W' q_0 + b': 2n queries.
3. One query of d tokens [a_1, ..., a_n, q] (u_k = a_k - q spanning the hyperplane):
       F - c' - M q = O' U^T (alpha_1, ..., alpha_n),   alpha_N = 1 - sum_k alpha_k,
   a least-squares solve through O' U^T (m x n, full column rank), and
   ln(alpha_k / alpha_N) = u_k^T (W' q + b'): the whole W' q + b' from ONE query, at
   each of the other n vertices (n queries, one batch).
4. [W' | b'] from y_j = W' q_j + b' at the d vertices: b' = mean_j y_j,
   W' = n / (rho^2 d) sum_j y_j q_j^T.

Total d + 3n = 4d - 3 queries (against the information floor
ceil((n^2 + n + 2 m n + m) / m), about 3d at m = d). Conditioning: the logits grow with
the chord, so a round whose largest |t_k| exceeds MAX_LOGIT is asked again at a shorter
chord (counted as "rescaling"). Error bars are first-order from the answers' rounding
through the measured conditioning (|k| near 1/4 or 1, sigma_min of U and of O' U^T).
One head here; ``heads`` >= 2 runs :mod:`attnextract.learners.vector_pre_layer_norm_heads`
(heads with independent output ranges, told apart by them). A box
answering every position is read at its last one (the causal mask changes nothing there).

Verification (:func:`attnextract.verification.verify_vector_on_sphere`): held-out sequences on S against the
model, every channel, at 10 x its error bound, and rescaled or shifted copies off S
against the box's own answers (a box with LayerNorm in front sees neither, except the
residual of the rescaled last token).
"""

from __future__ import annotations

import logging
import math
import time

import numpy as np

from ..errors import InputError, ModelMismatchError, NotIdentifiableError
from ..models import VectorSphereAttention
from ..numerics import safe_norm
from ..oracle import QueryAccess, on_scaled_outputs, root_oracle
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
from ..verification import INVARIANCE_SHARE, last_answers, verify_vector_on_sphere
from .pre_layer_norm import (
    MAX_LOGIT,
    MAX_RESCALES,
    _shorter,
    _solve_on_hyperplane,
)
from .vector_pre_layer_norm_heads import (
    extract_heads_on_sphere,
    three_token_sequences,
    three_token_solve,
)

log = logging.getLogger(__name__)

EPS = float(np.finfo(float).eps)
ROUNDING = 4.0           # error bars: ulps of rounding per answer number
VALUE_ROUNDING = 64.0    # g within this many ulps of the answers' size: O' P = 0


def extract_vector_pre_layer_norm(oracle: QueryAccess, heads: int | None = None, *, seed=None,
                                  verify_tolerance: float = DEFAULT_VERIFY_TOLERANCE,
                                  radius: float | None = None) -> ExtractionResult:
    """Recover a pre-LayerNorm attention block answering vectors, on the sphere.

    Parameters
    ----------
    oracle : Oracle
        Door to the black box, answering (B, m) at the last position
        (``Oracle(..., outputs="last")``): F(X) = R x_N + O Y^T softmax(Y (W y_N + b)) + c,
        Y = LN(X), one head; a box answering every position (``outputs="all"``, causal or
        not) is read at its last position.
    heads : int, optional
        The block's number of heads (default 1). Two or more run
        :func:`attnextract.learners.vector_pre_layer_norm_heads.extract_heads_on_sphere`:
        heads with independent output ranges, told apart by them.
    seed : int, optional
        Seed of the simplex's rotation and of the held-out verification.
    verify_tolerance : float
        Largest held-out error on the sphere, relative to the RMS of F - c.
    radius : float, optional
        Norm rho of every probe token (default sqrt(d): LayerNorm's unit-variance tokens).

    Returns
    -------
    ExtractionResult
        ``model`` a :class:`attnextract.models.VectorSphereAttention`: W (1, d, d),
        b (1, d), O (1, m, d), c (m,), R (m, d), projected on 1^T x = 0, valid on the
        sphere of ``radius`` only; ``queries`` 4d - 3, plus rescaling and verification.

    Raises
    ------
    InputError
        The oracle does not answer vectors, or ``heads`` is not a positive integer.
    NotIdentifiableError
        d < 3, answers narrower than d - 1, or O' P = 0 (the answers never depend on
        W or b).
    ModelMismatchError
        The box is not a pre-LayerNorm head: its three-token probes imply no attention
        weight or an O' P of rank below d - 1 (not covered), or held-out verification
        (on the sphere, or off it) failed; ``.result`` holds the extraction.
    """
    if heads is not None and (int(heads) != heads or heads < 1):
        raise InputError(f"heads must be a positive integer, got {heads!r}")
    root = root_oracle(oracle)
    if getattr(root, "outputs", None) not in ("last", "all"):
        raise InputError("vector-pre-ln reads vector answers: the oracle must answer (B, m) "
                         "or (B, N, m) (Oracle(..., outputs='last' or 'all'))")
    if heads is not None and heads >= 2:
        return on_scaled_outputs(oracle, lambda view: extract_heads_on_sphere(
            view, int(heads), seed=seed, verify_tolerance=verify_tolerance, radius=radius))
    # answers of any size (1e-300 .. 1e300) are learned on an exact 2^k rescaling
    return on_scaled_outputs(oracle, lambda view: _extract_on_sphere(
        view, seed=seed, verify_tolerance=verify_tolerance, radius=radius))


def _extract_on_sphere(oracle, *, seed, verify_tolerance, radius) -> ExtractionResult:
    """:func:`extract_vector_pre_layer_norm` (one head) on the (rescaled) view ``oracle``."""

    def ask(X: np.ndarray) -> np.ndarray:
        """The answers (B, m) at the last position of a batch (B, N, d) (every-position
        answers are read there: the causal mask changes nothing at the last token)."""
        return last_answers(oracle.query(X))
    start, start_queries, start_bb = time.perf_counter(), oracle.queries, oracle.black_box_seconds
    d = oracle.dim
    if d < 3:
        raise NotIdentifiableError(f"the sphere of 1^T x = 0 in d = {d} holds two tokens only")
    n = d - 1
    rho = sphere_radius(d, radius)
    nominal = d + 3 * n
    n_verify = verification_count(nominal, nominal)
    n_invariance = max(4, int(INVARIANCE_SHARE * n_verify))
    oracle.plan(nominal + n_verify + n_invariance,
                "vector pre-LayerNorm head on the sphere (4d - 3 + verification)")
    rng = np.random.default_rng(seed)
    Q = simplex_columns(d, rho, rng)
    basis = hyperplane_basis(d)

    log.info("vector pre-LN head at d = %d, tokens of norm %.3g: c and R + O from %d single "
             "tokens", d, rho, d)
    singles = ask(Q.T[:, None, :])        # (d, m)
    m = singles.shape[1]
    c = singles.mean(axis=0)
    M = (n / (rho * rho * d)) * (singles - c).T @ Q.T                      # (m, d): (R + O) P
    if m < n:
        raise NotIdentifiableError(f"answers of width m = {m} < d - 1 = {n}: one query "
                                   f"cannot read the d - 1 attention weights of vector-pre-ln")
    scale = float(np.abs(singles).max()) + float(np.abs(c).max())          # answers' size

    def differences(out: np.ndarray, q: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """g = F - c - M q (rows) and its rounding per row (first order, 2-norm)."""
        g = out - c - q @ M.T
        level = ROUNDING * EPS * math.sqrt(m) * (np.abs(out).max(axis=1) + scale
                                                  + float(np.abs(q @ M.T).max()))
        return g, level

    # stage 2: O' u_k and t_k at q_0 from [a, a, q] and [a, q, q], one batch per chord
    chords = np.full(d, 2.0 / math.sqrt(n))
    rescaled = 0
    q0 = Q[:, 0]
    for attempt in range(MAX_RESCALES + 1):
        A = column_probes(q0, tangent_simplex(Q, 0), chords[0])
        out = ask(three_token_sequences(A, q0))
        g, level = differences(out, q0)
        gA, gB = g[:n], g[n:]
        h, t, k = three_token_solve(gA, gB)
        peak = float(np.max(np.abs(t))) if np.all(np.isfinite(t)) else math.inf
        if peak <= MAX_LOGIT or attempt == MAX_RESCALES:
            break
        if np.max(np.linalg.norm(g, axis=1)) <= VALUE_ROUNDING * EPS * math.sqrt(m) * scale:
            break                                  # nothing to rescale: O' P = 0
        chords[0] = _shorter(chords[0], peak)
        rescaled += 2 * n
    if np.max(np.linalg.norm(g, axis=1)) <= VALUE_ROUNDING * EPS * math.sqrt(m) * scale:
        raise NotIdentifiableError("O' P = 0 (the values are orthogonal to the sphere's "
                                   "hyperplane): the answers never depend on W or b")
    _require_finite(t, "q_0")
    U0 = A - q0                                                            # (n, d)
    restricted = U0 @ basis
    O = basis @ np.linalg.solve(restricted, h)                             # (d, m) = (O' P)^T
    O = O.T
    spread0 = 1.0 / np.linalg.svd(restricted, compute_uv=False)[-1]
    # first-order errors of k, h, t from the rounding of g_A, g_B
    normA = np.linalg.norm(gA, axis=1)
    k_error = (level[:n] * np.abs(k) + level[n:]) / normA
    h_error = (3.0 * level[n:] + 12.0 * np.linalg.norm(gB, axis=1) * k_error
               / np.abs(4.0 * k - 1.0)) / np.abs(4.0 * k - 1.0)
    O_error = spread0 * float(np.linalg.norm(h_error))                    # 2-norm bound
    t_error = k_error * (4.0 / np.abs(4.0 * k - 1.0) + 1.0 / np.abs(1.0 - k))
    Y = np.empty((d, d))
    Y_error = np.empty(d)
    Y[:, 0], spread = _solve_on_hyperplane(U0, t, basis)
    Y_error[0] = spread * safe_norm(t_error)
    R = M - O
    sv = np.linalg.svd(O, compute_uv=False)
    if sv[n - 1] <= 1e3 * O_error:
        raise ModelMismatchError(
            f"the black box is not a pre-LayerNorm attention head whose O' has full rank "
            f"d - 1 = {n} on the hyperplane: its probes imply sigma_min(O' P) = "
            f"{sv[n - 1]:.3g} against an error of {O_error:.3g} (a head of lower output "
            f"rank is not covered: one query could not read every attention weight)")

    # stage 3: every other vertex in one query of d tokens, one batch per round
    log.info("W q_j + b at %d more vertices: one query of %d tokens each", n, d)
    chords[1:] = chords[0]
    todo = np.arange(1, d)
    for attempt in range(MAX_RESCALES + 1):
        probes = [column_probes(Q[:, j], tangent_simplex(Q, int(j)), chords[j]) for j in todo]
        X = np.stack([np.vstack([P, Q[:, j]]) for P, j in zip(probes, todo)])
        out = ask(X)
        again = []
        for P, j, answer in zip(probes, todo, out):
            g, level = differences(answer[None], Q[:, j])
            U = P - Q[:, j]
            L = O @ U.T                                                    # (m, n)
            left, sigma, right = np.linalg.svd(L, full_matrices=False)      # one SVD
            weights = right.T @ ((left.T @ g[0]) / sigma)                  # L^+ g
            last = 1.0 - weights.sum()
            with np.errstate(divide="ignore", invalid="ignore"):
                tj = np.log(weights / last)
            peak = float(np.max(np.abs(tj))) if np.all(np.isfinite(tj)) else math.inf
            if peak > MAX_LOGIT and attempt < MAX_RESCALES:
                chords[j] = _shorter(chords[j], peak)
                again.append(j)
                continue
            _require_finite(tj, f"q_{j}")
            Y[:, j], _ = _solve_on_hyperplane(U, tj, basis)
            # first order: y = B (U B)^{-1} t(w), w = L^+ g; dt_k / dw_i = [k = i] / w_k +
            # 1 / alpha_N; an error of g (rounding, and O's error times U^T w) maps
            # through their product, bounded by its Frobenius norm (L^+'s left factor is
            # orthonormal and drops out)
            J = np.diag(1.0 / weights) + 1.0 / last
            E = np.linalg.solve(U @ basis, J @ right.T) / sigma
            Y_error[j] = safe_norm(E) * (level[0] + O_error * safe_norm(U.T @ weights))
        if not again:
            break
        rescaled += len(again)
        todo = np.array(again)

    b = Y.mean(axis=1)
    W = (n / (rho * rho * d)) * (Y @ Q.T)
    model = VectorSphereAttention(W[None], b[None], O[None], c, R, rho)
    W_norm = max(safe_norm(W), np.finfo(float).tiny)
    O_norm = max(safe_norm(O), np.finfo(float).tiny)
    bars = {"error_bar_W": math.sqrt(n / d) * float(np.linalg.norm(Y_error)) / rho / W_norm,
            "error_bar_b": float(np.linalg.norm(Y_error)) / math.sqrt(d)
            / max(safe_norm(b), rho * W_norm),
            "error_bar_O": O_error / O_norm,
            "error_bar_R": O_error / max(safe_norm(R), O_norm)}
    recovery = oracle.queries - start_queries
    assert recovery == nominal + rescaled
    verification = verify_vector_on_sphere(oracle, model, count=n_verify,
                                           invariance=n_invariance, rng=rng,
                                           tolerance=verify_tolerance,
                                           error_bar=max(bars.values()))
    floor = math.ceil((n * n + n + 2 * m * n + m) / m)
    report = Report(
        kind=model.kind, dim=d, queries=oracle.queries - start_queries,
        breakdown={"constant and R + O": d, "O and column 0": 2 * n, "columns": n,
                   "rescaling": rescaled, "verification": verification.sequences},
        floor=floor, verification=verification, seconds=time.perf_counter() - start,
        black_box_seconds=oracle.black_box_seconds - start_bb,
        details={"sphere": f"tokens with 1^T x = 0 and |x| = {rho:.6g} (the model is "
                           f"defined there only)",
                 "chord |a - q| / R": f"{chords.min():.3g} .. {chords.max():.3g}",
                 "out_dim": m,
                 "condition of O' P": f"{sv[0] / sv[n - 1]:.3g}",
                 "identified": "P W P, P b, O P, R P and c of the head on the sphere "
                               "(gamma, beta, eps and the raw weights are not identifiable)",
                 **bars})
    try:
        return checked_result(model, report, "a pre-LayerNorm attention head (vector answers)")
    except ModelMismatchError as exc:
        families = verification.family_errors
        hints = []
        if max((e for f, e in families.items() if f != "invariance"), default=0.0) \
                > verification.tolerance:
            hints.append("several heads are not covered by vector-pre-ln")
        if families.get("invariance", 0.0) > verification.tolerance:
            hints.append(f"off the sphere, rescaling the tokens or shifting them along "
                         f"(1, ..., 1) changed the answers: no LayerNorm in front of the "
                         f"attention, or an eps too large for tokens of norm {rho:.3g} (try a "
                         f"larger --radius)")
        exc.args = ("; ".join([exc.args[0]] + hints),)
        raise


def _require_finite(t: np.ndarray, where: str) -> None:
    if not np.all(np.isfinite(t)):
        raise ModelMismatchError(
            f"the black box is not a pre-LayerNorm attention head: its probes at {where} "
            f"imply no attention weights in (0, 1) (or saturate at every chord)")
