"""Single-head extraction from sign-only (membership) answers, by bisection.

The black box answers only the label 1{f(X) > 0} (paper 1, Appendix B treats such
membership queries by bisection; its details are not at hand, this is our design).

v, up to a positive scale. For one token f([x]) = v^T x, so labels are the sign of a
linear form and only the direction of v is identifiable. In the plane of two
orthonormal vectors b_0, b_i, g(phi) = v^T (cos phi b_0 + sin phi b_i) = A cos phi +
C_i sin phi changes sign exactly once on (0, pi); bisection finds that angle phi_i and
C_i / A = -cot(phi_i). All d - 1 planes are bisected in parallel (one batch per step).
A first coarse pass from a random b_0 gives v_1; a second pass with b_0 = v_1 (so A is
about |v| and every phi_i about pi/2, where cot is well conditioned) gives v_hat.

W, exactly (its scale is not lost). With u_k = columns of the orthogonal basis with
v_hat^T u_k = 1/sqrt(d), and q_j = (I - 2 v_hat v_hat^T) u_j (orthogonal, with
v_hat^T q_j = -1/sqrt(d)), the probe [s q_j + g u_k; s q_j] has

    f / |v| = (g sigma(g s m_kj) - s) / sqrt(d),     m_kj = u_k^T W q_j,

so with g = kappa s the label is 1{kappa sigma(lambda kappa) > 1}, lambda = s^2 m_kj:
|v| cancels. kappa sigma(lambda kappa) = 1 has exactly one crossing in (1, 4] when
lambda > -0.2747 (kappa = 1 is always below, kappa = 4 above), found by bisection;
then lambda = logit(1/kappa) / kappa. The column scale s keeps s^2 |m| small (s is
shrunk by 4 for a column whose bracket check fails). With T = [m_kj], W = U T Q^T.

Queries: 1 + 2 (d - 1) bits_v (for v) plus d^2 (bracket check, + d per shrunk column)
plus d^2 bits (bisection). The precision reached is measured from the final
brackets and reported.
"""

from __future__ import annotations

import math
import time

import numpy as np

from .errors import InputError, ModelMismatchError, NotIdentifiableError
from .models import SingleHeadAttention
from .noisy import FLOAT_SLACK, NoisyVerification, output_gradient_norms
from .oracle import Oracle
from .report import ExtractionResult, Report, held_out_sequences, verification_count
from .single_head import logit, probe_basis

KAPPA_LOW, KAPPA_HIGH = 1.0, 4.0    # kappa sigma(lambda kappa) = 1 is bracketed here for lambda > -0.2747
TARGET_LAMBDA = 0.05                # aim for s^2 max|m| about this
MAX_SHRINKS = 30
COARSE_BITS = 24


def _labels(oracle: Oracle, X: np.ndarray) -> np.ndarray:
    """Send a batch, return booleans; answers must be labels (0/1 or -1/1)."""
    y = oracle.query(X)
    if not np.all((y == 0.0) | (y == 1.0) | (y == -1.0)):
        raise ModelMismatchError(
            "the black box does not answer labels (0/1 or -1/+1): use the noisy or exact "
            "extraction for real-valued answers")
    return y > 0.0


def _bisect_directions(oracle, b0, others, bits):
    """Bisect, for each row b_i of ``others``, the sign change of v^T(cos phi b0 + sin phi b_i).

    Returns (cot_mid, cot_halfwidth, sign_A, queries): C_i / A = -cot(phi_i), with the
    final bracket's half width in cot, and the sign of A = v^T b0.
    """
    positive_A = bool(_labels(oracle, b0[None, None, :])[0])
    n = others.shape[0]
    lo, hi = np.zeros(n), np.full(n, np.pi)      # label(lo) = positive_A, label(hi) = not
    for _ in range(bits):
        mid = 0.5 * (lo + hi)
        X = np.cos(mid)[:, None] * b0[None, :] + np.sin(mid)[:, None] * others
        same = _labels(oracle, X[:, None, :]) == positive_A
        lo, hi = np.where(same, mid, lo), np.where(same, hi, mid)
    with np.errstate(divide="ignore"):
        cot_lo, cot_hi = 1.0 / np.tan(lo), 1.0 / np.tan(hi)
    mid = 0.5 * (lo + hi)
    return 1.0 / np.tan(mid), 0.5 * np.abs(cot_lo - cot_hi), positive_A, 1 + n * bits


def _complement(b0: np.ndarray) -> np.ndarray:
    """Rows: an orthonormal basis of b0's orthogonal complement, shape (d - 1, d)."""
    H = probe_basis(b0)                       # orthogonal, every column has the same b0-component
    Q, _ = np.linalg.qr(np.column_stack([b0, H]))
    return Q[:, 1:].T


def extract_sign_only(oracle: Oracle, *, bits: int = 40, bits_v: int = 48, seed=None,
                      threshold: float = 0.0, verify_tolerance: float = 0.0) -> ExtractionResult:
    """Recover W and the direction of v from labels 1{f(X) > 0} by bisection.

    Parameters
    ----------
    oracle : Oracle
        Door to a label-only black box (answers 0/1 or -1/+1), token width d.
    bits : int
        Bisection steps per entry of W (precision about 8 2^-bits relative to max|m|).
    bits_v : int
        Bisection steps per coordinate of v's direction (fine pass; the coarse pass uses
        min(bits_v, 24)).
    seed : int, optional
        Seed of the coarse pass's random reference direction and of the held-out checks.
    threshold : float
        The black box's threshold; only 0 is supported (labels of sign(f)).
    verify_tolerance : float
        Extra slack (relative to the held-out output scale) within which a label may disagree.

    Returns
    -------
    ExtractionResult
        ``model`` SingleHeadAttention(W, v_hat) with ||v_hat|| = 1: v_hat = v / ||v||,
        so the model's outputs are f / ||v|| and its labels are the black box's.
        ``report.details``: ``error_bar_W`` (Frobenius, from the final brackets),
        ``error_bar_v_direction`` and the note that v is known up to a positive scale.

    Raises
    ------
    InputError
        threshold != 0 or bits out of range.
    NotIdentifiableError
        Every label is the same (v = 0 gives f = 0 everywhere).
    ModelMismatchError
        Answers are not labels, a bracket cannot be found, or held-out labels disagree
        away from the decision boundary.
    """
    if threshold != 0.0:
        raise InputError("sign-only extraction supports threshold 0 (labels 1{f(X) > 0}); "
                         f"got {threshold!r}")
    for name, value in (("bits", bits), ("bits_v", bits_v)):
        if not isinstance(value, (int, np.integer)) or not 4 <= value <= 60:
            raise InputError(f"{name} must be an integer in 4..60, got {value!r}")
    start, start_queries, start_bb = time.perf_counter(), oracle.queries, oracle.black_box_seconds
    d = oracle.dim
    rng = np.random.default_rng(seed)
    coarse = min(bits_v, COARSE_BITS)
    n_verify = verification_count(d * d + d)
    oracle.plan(2 + (d - 1) * (coarse + bits_v) + d * d * (bits + 1) + n_verify,
                "sign-only extraction by bisection")

    # v's direction: a coarse pass from a random b0, then a fine pass from b0 = v_1
    if d == 1:
        positive = bool(_labels(oracle, np.ones((1, 1, 1)))[0])
        negative = bool(_labels(oracle, -np.ones((1, 1, 1)))[0])
        if positive == negative:
            raise NotIdentifiableError("every label is the same: v = 0 (f = 0 everywhere)")
        v = np.array([1.0 if positive else -1.0])
        v_dir_bar, v_queries = 0.0, 2
    else:
        b0 = rng.standard_normal(d)
        b0 /= np.linalg.norm(b0)
        others = _complement(b0)
        cot, _, positive, q1 = _bisect_directions(oracle, b0, others, coarse)
        v1 = (1.0 if positive else -1.0) * (b0 - cot @ others)
        v1 /= np.linalg.norm(v1)
        others = _complement(v1)
        cot, half, positive, q2 = _bisect_directions(oracle, v1, others, bits_v)
        if not positive:
            raise NotIdentifiableError(
                "labels never turn on along the coarse estimate of v: v = 0 (f = 0 everywhere) "
                "or the black box is not a single head")
        raw = v1 - cot @ others
        v = raw / np.linalg.norm(raw)
        v_dir_bar = float(np.linalg.norm(half) / np.linalg.norm(raw)) + FLOAT_SLACK * d
        v_queries = q1 + q2

    # W: one bracket check per probe (kappa = 4 must be above), then bisection in kappa
    U = probe_basis(v)
    U *= np.sign(U[:, 0] @ v)                     # v^T u_k = +1/sqrt(d)
    Q = U - 2.0 * np.outer(v, v @ U)              # (I - 2 v v^T) U: v^T q_j = -1/sqrt(d)
    s = np.ones(d)                                # column scales
    shrinks = 0
    todo = np.arange(d)
    for _ in range(MAX_SHRINKS):
        above = _labels(oracle, _sign_probes(U, Q, s, todo, np.full((len(todo), d), KAPPA_HIGH)))
        failed = ~above.reshape(len(todo), d).all(axis=1)
        if not failed.any():
            break
        todo = todo[failed]
        s[todo] /= 4.0
        shrinks += len(todo) * d
    else:
        raise ModelMismatchError(
            "the black box is not a single-head attention regressor: no bracket for the "
            f"labels of {len(todo)} column(s) after {MAX_SHRINKS} shrinks")
    lo = np.full((d, d), KAPPA_LOW)               # [column j, k]
    hi = np.full((d, d), KAPPA_HIGH)
    cols = np.arange(d)
    for _ in range(bits):
        mid = 0.5 * (lo + hi)
        above = _labels(oracle, _sign_probes(U, Q, s, cols, mid)).reshape(d, d)
        lo, hi = np.where(above, lo, mid), np.where(above, mid, hi)
    kappa = 0.5 * (lo + hi)
    lam = logit(1.0 / kappa) / kappa
    spread = np.abs(logit(1.0 / lo) / lo - logit(1.0 / hi) / hi) / 2.0
    T = (lam / (s[:, None] ** 2)).T               # T[k, j] = m_kj = u_k^T W q_j
    # v's direction error moves each crossing by about 2 sqrt(d) |dv| in kappa sigma
    dT = ((spread + 2.0 * math.sqrt(d) * v_dir_bar) / (s[:, None] ** 2)).T
    W = U @ T @ Q.T
    W_bar = float(np.linalg.norm(dT)) + FLOAT_SLACK * d * float(np.linalg.norm(W))
    model = SingleHeadAttention(W, v)

    verification = _verify_labels(oracle, model, W_bar, v_dir_bar, count=n_verify, seed=seed,
                                  extra_relative=verify_tolerance)
    recovery = oracle.queries - start_queries - n_verify
    W_norm = float(np.linalg.norm(W))
    report = Report(
        kind=SingleHeadAttention.kind, dim=d, queries=oracle.queries - start_queries,
        breakdown={"recovery": recovery - shrinks, "rescaling": shrinks, "verification": n_verify},
        floor=d * d + d, verification=verification, seconds=time.perf_counter() - start,
        black_box_seconds=oracle.black_box_seconds - start_bb,
        notes=["sign-only answers: v is recovered up to a positive scale (v_hat = v / ||v||, "
               "so ||v_hat|| = 1 and the model's outputs are f / ||v||); W is recovered with "
               "its scale"],
        details={"method": f"bisection on labels: {bits_v} steps per coordinate of v "
                           f"(+ {coarse} coarse), {bits} per entry of W",
                 "error_bar_W": W_bar,
                 "error_bar_W_relative": W_bar / W_norm if W_norm > 0 else math.inf,
                 "error_bar_v_direction": v_dir_bar,
                 "queries_for_v": v_queries,
                 "column scales s": f"{s.min():.3g} .. {s.max():.3g}"})
    result = ExtractionResult(model=model, queries=report.queries, report=report)
    if not verification.passed:
        raise ModelMismatchError(
            f"held-out labels disagree with the extracted model away from its decision "
            f"boundary ({verification.worst_ratio:.3g} x the allowance)", result=result)
    return result


def _sign_probes(U, Q, s, cols, kappa):
    """Probes [s q_j + kappa s u_k; s q_j] for j in cols, all k; kappa (len(cols), d)."""
    d = U.shape[0]
    q = (s[cols, None] * Q[:, cols].T)                         # (n, d)
    X = np.empty((len(cols), d, 2, d))
    X[:, :, 1, :] = q[:, None, :]
    X[:, :, 0, :] = q[:, None, :] + (kappa * s[cols, None])[:, :, None] * U.T[None, :, :]
    return X.reshape(len(cols) * d, 2, d)


def _verify_labels(oracle, model, W_bar, v_dir_bar, *, count, seed, extra_relative):
    """Held-out labels must match sign(f_hat) wherever f_hat is clear of its own error."""
    rng = np.random.default_rng(None if seed is None else seed + 1)
    scale = 1.0 / math.sqrt(model.dim)
    sequences = held_out_sequences(oracle.dim, count, rng, scale)
    lengths = np.array([len(x) for x in sequences])
    observed = np.empty(count, dtype=bool)
    predicted, gW, gv = np.empty(count), np.empty(count), np.empty(count)
    for n in np.unique(lengths):
        idx = np.flatnonzero(lengths == n)
        X = np.stack([sequences[i] for i in idx])
        observed[idx] = _labels(oracle, X)
        predicted[idx], gW[idx], gv[idx] = output_gradient_norms(model, X)
    rms = math.sqrt(float(np.mean(predicted ** 2))) or 1.0
    allowed = 1.5 * (gW * W_bar + gv * v_dir_bar) + (extra_relative + 1e-12) * rms
    wrong = (predicted > 0) != observed
    ratio = np.where(wrong, np.abs(predicted) / allowed, 0.0)
    return NoisyVerification(sequences=count, max_relative_error=float(wrong.mean()),
                             median_relative_error=0.0, tolerance=0.0,
                             worst_ratio=float(ratio.max()))
