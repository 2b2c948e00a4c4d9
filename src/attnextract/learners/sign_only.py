"""Single-head extraction from label-only (membership) answers, by bisection.

The black box answers only the label 1{f(X) > t} for a known threshold t (the single-head paper,
Appendix B treats such membership queries by bisection; its details are not at hand,
this is our design; overview in docs/algorithms.md, "Sign-only outputs").

v. For one token f([x]) = v^T x.
- t = 0: labels are the sign of a linear form, so only the direction of v is
  identifiable. In the plane of two orthonormal vectors b_0, b_i, g(phi) =
  v^T (cos phi b_0 + sin phi b_i) = A cos phi + C_i sin phi changes sign exactly once on
  (0, pi); bisection finds that angle and C_i / A = -cot(phi_i), all d - 1 planes in
  parallel (one batch per step). A coarse pass from a random b_0 gives v_1; a fine pass
  with b_0 = v_1 (A about |v|, every phi_i about pi/2, where cot is well conditioned)
  gives v_hat = v / |v|.
- t != 0: along a ray, 1{lam v^T x > t} changes at lam = t / v^T x, so v keeps its
  scale: a coarse geometric bisection along +-e_i, then a fine one along an orthogonal
  basis with v^T u_k = sign(t) |v| / sqrt(d).

W, with its scale. With u_k the columns of the orthogonal basis with v_hat^T u_k =
1/sqrt(d), and q~_j = (I - 2 v_hat v_hat^T) u_j (orthogonal, v_hat^T q~_j = -1/sqrt(d)),
the probe [q_j + g u_k; q_j], q_j = s q~_j + (t / |v|) v_hat, has

    f - t = |v| (g sigma(g A_kj) - s) / sqrt(d),   A_kj = u_k^T W q_j,

so with g = kappa s the label is 1{kappa sigma(lam kappa) > 1}, lam = s A_kj: |v|
cancels. kappa sigma(lam kappa) = 1 has exactly one crossing in (1, 4] when lam >
-0.2747 (kappa = 1 is always below, kappa = 4 above), found by bisection; then lam =
logit(1/kappa) / kappa. The column scale s keeps lam small (s is shrunk by 4 for a
column whose bracket check fails). With m_kj = u_k^T W q~_j and v_hat = -(1/sqrt(d))
sum_j q~_j, lam_kj = s_j^2 m_kj - (t / (|v| sqrt(d))) s_j sum_j' m_kj': one d x d solve
(diagonal when t = 0); W = U M Q~^T.

Queries (t = 0): 1 + (d - 1)(24 + bits_v) for v, d^2 (bracket check, + d per shrunk
column) and d^2 bits for W. The precision reached is measured from the final brackets
and reported as error bars.
"""

from __future__ import annotations

import math
import time

import numpy as np

from ..errors import InputError, ModelMismatchError, NotIdentifiableError
from ..models import SingleHeadAttention
from ..oracle import QueryAccess, evaluate_ragged
from ..report import ExtractionResult, Report, verification_count
from ..verification import (
    BOUNDARY_FRACTION,
    _norm_range,
    _soft_pick,
    boundary_shift,
    design,
    max_length_of,
    near_boundary,
    root_oracle,
)
from .noisy import FLOAT_SLACK, NoisyVerification, output_gradient_norms
from .single_head import logit, probe_basis

KAPPA_LOW, KAPPA_HIGH = 1.0, 4.0    # kappa sigma(lambda kappa) = 1 is bracketed here for lambda > -0.2747
MAX_SHRINKS = 30
COARSE_BITS = 24
MIN_LABEL_CHECK = 128               # labels in a check, at least
LABEL_HULL_FRACTION = 0.375         # share of a label check spent on the label hull
LABEL_HULL_MARGIN = 300.0           # hull tokens sit this x their own uncertainty off the threshold
HINGE_FRACTION = 0.25               # share of a label check on labels that hinge on one token
# the hinge token's norm, in units of an ordinary token (log10): large and tiny tokens
HINGE_LARGE, HINGE_TINY = (1.0, 3.5), (-7.0, -1.0)
HINGE_SHARE = (1e-3, 0.1)           # the hinge token's share of f left beyond the threshold
HINGE_ROOM = 4.0                    # that share is at least this x the model's allowance


def _labels(oracle: QueryAccess, X: np.ndarray) -> np.ndarray:
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


def extract_sign_only(oracle: QueryAccess, *, bits: int = 40, bits_v: int = 48, seed=None,
                      threshold: float = 0.0, verify_tolerance: float = 0.0) -> ExtractionResult:
    """Recover W and v (its direction when threshold = 0) from labels 1{f(X) > t} by bisection.

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
        The black box's (known) threshold t: labels are 1{f(X) > t}. t = 0 leaves v's
        scale unidentifiable; any t != 0 fixes it.
    verify_tolerance : float
        Extra slack (relative to the held-out output scale) within which a label may disagree.

    Returns
    -------
    ExtractionResult
        ``model`` SingleHeadAttention(W, v_hat). threshold 0: ||v_hat|| = 1, v_hat =
        v / ||v||, so the model's outputs are f / ||v|| and its labels are the black
        box's; threshold != 0: v_hat estimates v itself (``error_bar_v``).
        ``report.details``: ``error_bar_W`` (Frobenius, from the final brackets),
        ``error_bar_v_direction`` and the note that v is known up to a positive scale.

    Raises
    ------
    InputError
        threshold not finite, or bits out of range.
    NotIdentifiableError
        Every label is the same (v = 0 gives f = 0 everywhere), or the threshold is out
        of reach (|t| / |v| so large that the probes' offsets swamp W).
    ModelMismatchError
        Answers are not labels, a bracket cannot be found, or held-out labels disagree
        away from the decision boundary.
    """
    threshold = float(threshold)
    if not math.isfinite(threshold):
        raise InputError(f"threshold must be finite, got {threshold!r}")
    for name, value in (("bits", bits), ("bits_v", bits_v)):
        if not isinstance(value, (int, np.integer)) or not 4 <= value <= 60:
            raise InputError(f"{name} must be an integer in 4..60, got {value!r}")
    start, start_queries, start_bb = time.perf_counter(), oracle.queries, oracle.black_box_seconds
    d = oracle.dim
    rng = np.random.default_rng(seed)
    coarse = min(bits_v, COARSE_BITS)
    v_planned = (2 + (d - 1) * (coarse + bits_v) if threshold == 0.0
                 else 6 * d + 2 * d * coarse + d * bits_v)
    # a stronger coverage statement asked for (--verify-sequences N): never fewer labels
    n_verify = max(label_check_count(d, v_planned + d * d * (bits + 1)),
                   int(getattr(root_oracle(oracle), "verify_sequences", None) or 0))
    oracle.plan(v_planned + d * d * (bits + 1) + n_verify, "sign-only extraction by bisection")

    # v's direction: a coarse pass from a random b0, then a fine pass from b0 = v_1
    if threshold != 0.0:                          # f([lam x]) = lam v^T x crosses it: v with scale
        v_scaled, v_bar, v_queries = _scaled_v(oracle, threshold, coarse, bits_v)
        v = v_scaled / np.linalg.norm(v_scaled)
        v_dir_bar = v_bar / float(np.linalg.norm(v_scaled))
    elif d == 1:
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
    # threshold t != 0: q_j = s q~_j + (t / |v|) v_hat keeps the label 1{g sigma(...) > s}
    offset = (threshold / np.linalg.norm(v_scaled)) * v if threshold != 0.0 else np.zeros(d)
    s = np.ones(d)                                # column scales
    shrinks = 0
    todo = np.arange(d)
    for _ in range(MAX_SHRINKS):
        above = _labels(oracle, _sign_probes(U, Q, s, todo, np.full((len(todo), d), KAPPA_HIGH), offset))
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
    # lam_kj = s_j^2 T_kj - c s_j sum_j' T_kj' (c = offset length / sqrt(d)): the matrix
    # D^2 - c s 1^T is singular at c sum 1/s_j = 1; halving s moves away from it (and keeps
    # every bracket: lam only shrinks towards 0)
    c_off = (float(threshold / np.linalg.norm(v_scaled)) / math.sqrt(d) if threshold != 0.0
             else 0.0)
    while abs(1.0 - c_off * np.sum(1.0 / s)) < 0.25:
        s /= 2.0
    lo = np.full((d, d), KAPPA_LOW)               # [column j, k]
    hi = np.full((d, d), KAPPA_HIGH)
    cols = np.arange(d)
    for _ in range(bits):
        mid = 0.5 * (lo + hi)
        above = _labels(oracle, _sign_probes(U, Q, s, cols, mid, offset)).reshape(d, d)
        lo, hi = np.where(above, lo, mid), np.where(above, mid, hi)
    kappa = 0.5 * (lo + hi)
    lam = logit(1.0 / kappa) / kappa
    # lam(kappa) is monotone: the true lam lies between lam(lo) and lam(hi)
    spread = np.maximum(np.abs(logit(1.0 / lo) / lo - lam), np.abs(logit(1.0 / hi) / hi - lam))
    # v's direction error moves each crossing by about 2 sqrt(d) |dv| in kappa sigma
    spread = spread + (2.0 + abs(c_off) * d) * math.sqrt(d) * v_dir_bar
    # the black box's own float64 rounding of f near the threshold moves each crossing too
    spread = spread + FLOAT_SLACK * math.sqrt(d) * (3.0 + abs(c_off) * math.sqrt(d) / s)[:, None]
    M = np.diag(s ** 2) - c_off * np.outer(s, np.ones(d))
    if np.linalg.cond(M) > 1e12:
        raise NotIdentifiableError(
            f"the threshold {threshold:g} is out of reach: |threshold| / |v| = "
            f"{abs(threshold) / np.linalg.norm(v_scaled):.3g} makes the probes' offset swamp W "
            f"(the linear system for W has condition number {np.linalg.cond(M):.3g})")
    T = np.linalg.solve(M, lam).T                 # T[k, j] = m_kj = u_k^T W q~_j
    dT = np.linalg.norm(np.linalg.inv(M), 2) * spread if c_off else (spread / (s[:, None] ** 2)).T
    W = U @ T @ Q.T
    W_bar = float(np.linalg.norm(dT)) + FLOAT_SLACK * d * float(np.linalg.norm(W))
    if not (math.isfinite(W_bar) and np.all(np.isfinite(W))):
        # an honest head's every crossing lies inside its bracket (kappa in (1, 4]), so
        # its bars are finite: a crossing at the bracket's end is not a single head's
        raise ModelMismatchError(
            "the black box is not a single-head attention regressor: some label crossings "
            "lie at the end of their brackets (infinite error bars for W)")
    model = SingleHeadAttention(W, v_scaled if threshold != 0.0 else v)

    verification = _verify_labels(oracle, model, W_bar, v_bar if threshold != 0.0 else v_dir_bar,
                                  threshold, count=n_verify, seed=seed,
                                  extra_relative=verify_tolerance)
    recovery = oracle.queries - start_queries - verification.sequences
    W_norm = float(np.linalg.norm(W))
    report = Report(
        kind=SingleHeadAttention.kind, dim=d, queries=oracle.queries - start_queries,
        breakdown={"recovery": recovery - shrinks, "rescaling": shrinks, "verification": verification.sequences},
        floor=d * d + d, verification=verification, seconds=time.perf_counter() - start,
        black_box_seconds=oracle.black_box_seconds - start_bb,
        notes=[f"label-only answers 1{{f(X) > {threshold:g}}}: " + (
            "v is recovered up to a positive scale (v_hat = v / ||v||, so ||v_hat|| = 1 and "
            "the model's outputs are f / ||v||); W is recovered with its scale"
            if threshold == 0.0 else
            "the nonzero threshold fixes the scale: v and W are recovered with their scale")],
        details={"method": f"bisection on labels: {bits_v} steps per coordinate of v "
                           f"(+ {coarse} coarse), {bits} per entry of W",
                 "error_bar_W": W_bar,
                 "error_bar_W_relative": W_bar / W_norm if W_norm > 0 else math.inf,
                 "error_bar_v_direction": v_dir_bar,
                 **({"error_bar_v": v_bar} if threshold != 0.0 else {}),
                 "queries_for_v": v_queries,
                 "column scales s": f"{s.min():.3g} .. {s.max():.3g}",
                 "verification labels": f"{verification.max_relative_error:.3g} of "
                                        f"{verification.sequences} held-out labels disagree (the 'max relative "
                                        f"error' above); any disagreement must lie within 1.5 x "
                                        f"the model's error bars of the threshold "
                                        f"(worst {verification.worst_ratio:.3g} of that)",
                 "verified token norms": f"{verification.norms[0]:.3g} .. "
                                         f"{verification.norms[1]:.3g}: the norms of the tokens "
                                         f"a held-out label hinged on (a change of more than "
                                         f"{HINGE_SHARE[1]:.0%} of such a token's part of f "
                                         f"flips that label); tokens up to "
                                         f"{verification.norms_sent[1]:.3g} were sent"})
    result = ExtractionResult(model=model, queries=report.queries, report=report)
    if not verification.passed:
        raise ModelMismatchError(
            f"held-out labels disagree with the extracted model away from its decision "
            f"boundary ({verification.worst_ratio:.3g} x the allowance)", result=result)
    return result


def label_check_count(d: int, recovery: int) -> int:
    """Held-out labels: max(MIN_LABEL_CHECK, verification_count(d^2 + d), 2% of the
    planned recovery), plus HINGE_FRACTION of that in hinge labels (d >= 2,
    :func:`hinge_sequences`).

    A label carries one bit, and shows a departure from the class only where the
    departure exceeds the distance to the threshold; the recovery spends ~bits labels per
    parameter, so the check may spend 2% of them. A departure that flips a label on half
    the sequences of one kind (a norm trigger on large tokens) needs about ten labels of
    that kind to be seen every time, hence the floor (4% of the recovery at d = 8)."""
    base = max(MIN_LABEL_CHECK, verification_count(d * d + d), int(recovery) // 50)
    return base + hinge_count(d, base)


def hinge_count(d: int, base: int) -> int:
    """Hinge labels on top of a label check of ``base`` labels (none at d = 1)."""
    return int(HINGE_FRACTION * base) if d >= 2 else 0


def _sign_probes(U, Q, s, cols, kappa, offset):
    """Probes [q_j + kappa s u_k; q_j], q_j = s q~_j + offset, j in cols, all k; kappa (len(cols), d)."""
    d = U.shape[0]
    q = s[cols, None] * Q[:, cols].T + offset[None, :]         # (n, d)
    X = np.empty((len(cols), d, 2, d))
    X[:, :, 1, :] = q[:, None, :]
    X[:, :, 0, :] = q[:, None, :] + (kappa * s[cols, None])[:, :, None] * U.T[None, :, :]
    return X.reshape(len(cols) * d, 2, d)


def _verify_labels(oracle, model, W_bar, v_bar, threshold, *, count, seed, extra_relative):
    """Held-out labels must match 1{f_hat > threshold} wherever f_hat is clear of its own error."""
    rng = np.random.default_rng(None if seed is None else seed + 1)
    scale = 1.0 / math.sqrt(model.dim)
    # the hinge labels come on top of the other parts (their shares are of the rest):
    # label_check_count's split of base + HINGE_FRACTION x base
    n_hinge = (int(count * HINGE_FRACTION / (1.0 + HINGE_FRACTION) + 1e-9)
               if model.dim >= 2 else 0)
    count -= n_hinge
    n_boundary = int(BOUNDARY_FRACTION * count) if model.dim >= 2 else 0
    n_hull = int(LABEL_HULL_FRACTION * count) if model.dim >= 2 else 0
    sequences = design(oracle.dim, count - n_boundary - n_hull, rng, scale,
                       max_length=max_length_of(oracle)).sequences
    rms = math.sqrt(float(np.mean(evaluate_ragged(model, sequences) ** 2))) or 1.0

    def allowance(X):
        _, gW, gv = output_gradient_norms(model, X)
        return 1.5 * (gW * W_bar + gv * v_bar) + (extra_relative + 1e-12) * rms

    # a label shows a departure from the class only where the departure exceeds the
    # distance to the threshold: every other sequence of each family is moved (all its
    # tokens along v_hat) to within 10^-6 .. 10^-0.5 of its own distance, still clear of
    # the model's allowance (the others keep their tokens' norms: norm triggers)
    if model.dim >= 2:
        moved = sequences[1::2]
        gap = np.abs(evaluate_ragged(model, moved) - threshold)
        room = np.concatenate([allowance(x[None]) for x in moved]) if moved else np.zeros(0)
        size = np.maximum(gap * 10.0 ** rng.uniform(-6.0, -0.5, len(moved)), 3.0 * room)
        targets = threshold + rng.choice([-1.0, 1.0], len(moved)) * size
        ok = np.isfinite(targets)
        sequences = sequences[0::2] + boundary_shift(model, [x for x, k in zip(moved, ok) if k],
                                                     targets[ok])
    # the second part: sequences just clear of the model's decision boundary, where a
    # small departure from the class (a second head at 1e-8) flips labels
    before = len(sequences)
    if n_boundary:
        sequences += near_boundary(model, n_boundary, rng, scale, threshold, allowance,
                                   longest=max_length_of(oracle))
    n_boundary_sent = len(sequences) - before
    # labels that hinge on one large or tiny token with attention weight (a box that
    # clips large tokens or takes tiny ones for padding flips them)
    first_hinge = len(sequences)
    hinges = hinge_sequences(model, n_hinge, rng, scale, threshold, allowance) if n_hinge else []
    sequences += [X for X, _, _ in hinges]
    # the label hull: sequences whose tokens all lie (just) on one side of the threshold
    first_hull = len(sequences)
    hull = label_hull(model, n_hull, rng, scale, threshold, v_bar) if n_hull else []
    sequences += [X for X, _ in hull]
    count = len(sequences)
    lengths = np.array([len(x) for x in sequences])
    observed = np.empty(count, dtype=bool)
    predicted, gW, gv = np.empty(count), np.empty(count), np.empty(count)
    for n in np.unique(lengths):
        idx = np.flatnonzero(lengths == n)
        X = np.stack([sequences[i] for i in idx])
        observed[idx] = _labels(oracle, X)
        predicted[idx], gW[idx], gv[idx] = output_gradient_norms(model, X)
    with np.errstate(invalid="ignore"):
        model_part = np.nan_to_num(gW * W_bar + gv * v_bar, nan=np.inf, posinf=np.inf)
    allowed = 1.5 * model_part + (extra_relative + 1e-12) * rms
    wrong = (predicted > threshold) != observed
    ratio = np.where(wrong, np.abs(predicted - threshold) / allowed, 0.0)
    # a hull sequence must take the label its tokens take alone, whatever W is
    for j, (_X, singles) in enumerate(hull):
        i = first_hull + j
        if singles is not None:
            side = observed[first_hull + np.asarray(singles)]
            if side.all() != side.any():
                continue                # the tokens alone disagree (judged as singles)
            wrong[i] = observed[i] != side[0]
            ratio[i] = np.inf if wrong[i] else 0.0
    # the verified norms: what the hinge labels resolved (a label shows a token's
    # treatment only where it hinges on that token), with the ordinary tokens' norms
    resolved = [R for _, R, rho in hinges if rho <= HINGE_SHARE[1]]
    ordinary = scale * math.sqrt(model.dim)
    low, high = min(resolved + [ordinary]), max(resolved + [ordinary])
    drawn = {"design": first_hinge - n_boundary_sent, "boundary": n_boundary_sent,
             "hinge": len(hinges), "hull": count - first_hull}
    drawn["all"] = count
    return NoisyVerification(sequences=count, max_relative_error=float(wrong.mean()),
                             median_relative_error=0.0, tolerance=0.0,
                             worst_ratio=float(ratio.max()),
                             lengths=(int(lengths.min()), int(lengths.max())),
                             norms=(low, high), norms_sent=_norm_range(sequences),
                             family_sequences=drawn)


def label_hull(model, count: int, rng, scale: float, threshold: float, v_bar: float) -> list:
    """``count`` label-hull queries: a pool of single tokens placed just above or just
    below the threshold, then sequences built from one side's tokens only.

    f(X) = sum_i alpha_i(X) f([x_i]) is a convex combination of what the tokens answer
    alone, whatever W is: when every token alone is labelled above the threshold, so is
    the sequence. The black box's own single-token labels decide the side, so the check
    needs neither W nor its error bar. Tokens are orthogonal to v_hat plus an offset
    along it that puts f([x]) at t +- delta, delta a few hundred times the model's error
    on f([x]) (v_bar |x|) and the black box's float64 rounding: a second head at
    relative size eps adds eps (alpha_2 - alpha)^T X v_2 to the sequence's output but
    nothing the singles see, and flips the label once that exceeds delta (about 1e-11
    relative). Half the pool has norms where the model's attention is soft (there the
    second head shows); the other half, 10 to 1000 times the probes' tokens, is asked
    alone only (judged against the model like any held-out label).

    Returns a list of (X (N, d), singles): singles None for a pool token, else the pool
    positions (0-based within the returned list) of X's tokens.
    """
    d = model.dim
    v = np.asarray(model.v, dtype=float)
    v_norm = float(np.linalg.norm(v))
    u = v / v_norm
    pool_size = max(4, min(count // 3, 2 * d))
    n_seq = count - pool_size
    P = np.empty((0, d))
    while len(P) < pool_size:               # directions orthogonal to v_hat (never 0)
        draw = rng.standard_normal((pool_size, d))
        draw -= np.outer(draw @ u, u)
        draw -= np.outer(draw @ u, u)
        norms = np.linalg.norm(draw, axis=1)
        P = np.vstack([P, draw[norms > 1e-6] / norms[norms > 1e-6, None]])[:pool_size]
    # pool tokens 0, 1 (mod 4) soft, for the sequences; 2, 3 large (10 .. 1000 x the
    # probes' tokens), asked alone: a behaviour that switches on at some norm shows there
    large = np.arange(pool_size) % 4 >= 2
    P *= scale * math.sqrt(d) * 10.0 ** np.where(large, rng.uniform(1.0, 3.0, pool_size),
                                                 rng.uniform(-0.5, 0.5, pool_size))[:, None]
    side = np.where(np.arange(pool_size) % 2 == 0, 1.0, -1.0)
    norms = np.hypot(np.linalg.norm(P, axis=1), threshold / v_norm)   # with the offset below
    delta = LABEL_HULL_MARGIN * (v_bar + FLOAT_SLACK * (d + 64) * v_norm) * norms
    P += ((threshold + side * delta) / v_norm)[:, None] * u[None, :]
    out = [(p[None], None) for p in P]
    for i, k in enumerate(rng.integers(2, 17, n_seq)):
        group = np.flatnonzero((side == (1.0 if i % 2 == 0 else -1.0)) & ~large)
        pick = group[_soft_pick(model.W, P[group], int(k), rng)]
        out.append((P[pick], pick))
    return out


def hinge_sequences(model, count: int, rng, scale: float, threshold: float, allowance) -> list:
    """``count`` sequences whose model label hinges on one token of large or tiny norm.

    A label is one bit: a box that changes what a large token or a tiny one contributes
    (clips its value, takes it for padding, rescales its score) shows only where that
    change crosses the threshold. Each sequence [y_1 .. y_n, x_s, x_N] (x_s at a random key
    position) has an ordinary query x_N, keys y_j with score 0 (orthogonal to W x_N) and
    the hinge token x_s of norm R, large (10^1 .. 10^3.5 ordinary tokens, log-stratified;
    d >= 3) or tiny (10^-7 .. 10^-1), with attention weight a_s in about 0.1 .. 0.6 (a large
    token's score set by its component along W x_N, its value v^T x_s of an ordinary
    token's size; a tiny token scores 0). The keys are then moved along v (orthogonal to
    W x_N: no score changes, so f is linear in the move) until

        f = t + sigma rho a_s v^T x_s,   rho log-uniform in HINGE_SHARE,

    so the rest of the sequence cancels all but rho of the hinge token's term: a box whose
    contribution from x_s is off by more than rho of it (sigma = +1: less, as a clip or
    padding; -1: more) flips the label. rho is at least HINGE_ROOM x the model's own
    allowance over |a_s v^T x_s|. An ordinary token has norm scale sqrt(d).

    Returns a list of (X (N, d), R, rho): R the hinge token's norm, rho its share
    (a share above HINGE_SHARE's top was needed for the model's allowance: that token's
    treatment is not resolved by its label).
    """
    d = model.dim
    W, v = np.asarray(model.W, dtype=float), np.asarray(model.v, dtype=float)
    v_norm = float(np.linalg.norm(v))
    ordinary = scale * math.sqrt(d)
    out: list = []
    # a large token needs a third direction for its norm (d >= 3); at d = 2 all are tiny
    large = (np.arange(count) % 2 == 0) & (d >= 3)
    # log-stratified norms: every stretch of each range gets its share
    strata = np.empty(count)
    for kind in (large, ~large):
        n = int(kind.sum())
        strata[kind] = (rng.permutation(n) + rng.uniform(size=n)) / max(n, 1)
    logs = np.where(large, HINGE_LARGE[0] + strata * (HINGE_LARGE[1] - HINGE_LARGE[0]),
                    HINGE_TINY[0] + strata * (HINGE_TINY[1] - HINGE_TINY[0]))
    # sigma = -1 (a term that grew) on every fourth norm of each kind in order: the
    # norms beyond any limit get their share of sigma = +1 (a term that shrank: a clip,
    # padding), not left to chance
    signs = np.ones(count)
    for kind in (large, ~large):
        members = np.flatnonzero(kind)
        signs[members[np.argsort(np.argsort(logs[members])) % 4 == 3]] = -1.0
    attempts = 0
    while len(out) < count and attempts < 20 * count:    # a draw that fails is drawn again
        i, attempts = len(out), attempts + 1
        for _ in range(20):                     # draws where v is not along W x_N
            x_N = scale * rng.standard_normal(d)
            q = float(x_N @ W @ x_N)
            if abs(q) > 1.0:                    # the query's own score of order one
                x_N /= math.sqrt(abs(q))
                q = float(x_N @ W @ x_N)
            w = W @ x_N
            w_norm = float(np.linalg.norm(w))
            if w_norm == 0.0:
                continue
            e1 = w / w_norm
            e2 = v - (v @ e1) * e1
            if np.linalg.norm(e2) > 0.2 * v_norm:
                break
        else:
            continue
        e2 /= np.linalg.norm(e2)
        e3 = rng.standard_normal(d)
        e3 -= (e3 @ e1) * e1 + (e3 @ e2) * e2
        e3 = e3 / np.linalg.norm(e3) if d >= 3 and np.linalg.norm(e3) > 0 else np.zeros(d)
        n_rest = int(rng.integers(1, 4))
        Y = scale * rng.standard_normal((n_rest, d))
        Y -= np.outer(Y @ e1, e1)                  # keys of score 0
        R = ordinary * 10.0 ** logs[i]
        if large[i]:
            # score s gives weight a_s against the rest (n_rest keys at 0, the query at q)
            a_s = rng.uniform(0.15, 0.6)
            s = math.log(a_s / (1.0 - a_s)) + float(np.logaddexp(math.log(n_rest), q))
            along = s / w_norm
            value = rng.choice([-1.0, 1.0]) * ordinary * v_norm * rng.uniform(0.5, 2.0)
            beta = (value - (v @ e1) * along) / float(v @ e2)
            rest = R * R - along * along - beta * beta
            if rest <= 0.0 or not e3.any():
                continue
            x_s = along * e1 + beta * e2 + math.sqrt(rest) * e3
        else:
            phi = rng.uniform(0.0, 0.5 * math.pi) * rng.choice([-1.0, 1.0])
            x_s = R * (math.cos(phi) * e2 + math.sin(phi) * e3)
        at = int(rng.integers(0, n_rest + 1))
        X = np.vstack([Y[:at], x_s[None], Y[at:], x_N[None]])
        keys = np.r_[np.arange(at), np.arange(at + 1, n_rest + 1)]

        def f(Z):
            return float(model(Z[None])[0])

        scores = X @ (W @ x_N)
        alpha = np.exp(scores - scores.max())
        alpha /= alpha.sum()
        term = float(alpha[at] * (v @ x_s))
        slope = float(alpha[keys].sum() * (v @ e2))      # df / d(move of every key along e2)
        if term == 0.0 or slope == 0.0 or not math.isfinite(term):
            continue
        sigma = signs[i]
        rho = math.exp(rng.uniform(math.log(HINGE_SHARE[0]), math.log(HINGE_SHARE[1])))
        for _ in range(3):                 # rho may grow with the allowance at the new X
            Z = X.copy()
            for _ in range(3):             # linear in the move: the rest is rounding
                target = threshold + sigma * rho * term
                Z[keys] += ((target - f(Z)) / slope) * e2
            need = HINGE_ROOM * float(allowance(Z[None])[0]) / abs(term)
            if need <= rho:
                break
            rho = need
        if np.all(np.isfinite(Z)):
            out.append((Z, float(R), float(rho)))
    return out


def _ray_crossings(oracle, X, lo, hi, bits, geometric):
    """Bisect lam in [lo, hi] (per row of X) for the change of label of [lam x].

    Returns (lam, half_width, found): found where the labels at lo and hi differ.
    """
    n = X.shape[0]
    at_lo = _labels(oracle, (lo[:, None] * X)[:, None, :])
    at_hi = _labels(oracle, (hi[:, None] * X)[:, None, :])
    for _ in range(bits):
        mid = np.sqrt(lo * hi) if geometric else 0.5 * (lo + hi)
        same = _labels(oracle, (mid[:, None] * X)[:, None, :]) == at_lo
        lo, hi = np.where(same, mid, lo), np.where(same, hi, mid)
    mid = np.sqrt(lo * hi) if geometric else 0.5 * (lo + hi)
    return mid, 0.5 * (hi - lo), at_lo != at_hi, 2 * n + n * bits


def _scaled_v(oracle, threshold, coarse, fine):
    """v with its scale from labels 1{lam v^T x > t}: the crossing is lam = t / v^T x.

    A coarse geometric bisection along +-e_i over 2^-40..2^40 |t|, then a fine one along
    an orthogonal basis whose every u_k has v^T u_k of the sign of t and size |v|/sqrt(d).
    Returns (v, bound on ||v_hat - v||, queries).
    """
    d = oracle.dim
    t = threshold
    X = np.concatenate([np.eye(d), -np.eye(d)])
    lam, _, found, q1 = _ray_crossings(oracle, X, np.full(2 * d, abs(t) * 2.0 ** -40),
                                       np.full(2 * d, abs(t) * 2.0 ** 40), coarse, True)
    proj = np.where(found, t / lam, 0.0)               # v^T x where the label changed
    v1 = proj[:d] - proj[d:]
    if not np.any(v1):
        raise NotIdentifiableError(
            "no label changes along any axis: v = 0 (f = 0 everywhere), or |v| is below "
            f"|threshold| 2^-40 = {abs(t) * 2.0 ** -40:.3g}")
    U = probe_basis(v1)
    U *= np.sign(t) * np.sign(U[:, 0] @ v1)           # sign(v^T u_k) = sign(t)
    guess = t / (U.T @ v1)
    lam, half, found, q2 = _ray_crossings(oracle, U.T, guess / 2.0, guess * 2.0, fine, False)
    if not found.all():
        raise ModelMismatchError(
            "the black box is not a single-head attention regressor: labels of single tokens "
            "do not follow a linear form")
    v = U @ (t / lam)
    spread = abs(t) * np.abs(1.0 / (lam - half) - 1.0 / (lam + half)) / 2.0
    return v, float(np.linalg.norm(spread)) + FLOAT_SLACK * float(np.linalg.norm(v)), q1 + q2
