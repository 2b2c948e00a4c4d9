"""Multi-head attention: non-identifiability, twins, and canonical recovery.

Model (ALGORITHMS.md, section 7): f(X) = sum_h softmax(X W_h x_N)^T X v_h, h = 1..H.

Non-identifiability (arXiv 2601.16873). Heads with equal W can split their v in any
way, a head with v_h = 0 can carry any W_h, heads can be permuted. The canonical form
merges heads with equal W (adding their v) and drops heads whose v is 0; two parameter
sets give the same f exactly when their canonical forms agree up to permutation.
:func:`non_identifiable_twin` builds a different parameter set with the same map,
:func:`twin_difference` measures the largest output difference.

Known orthogonal subspaces (paper 1): inside S_h every other head scores 0 (uniform
attention) and reads 0 (v_g is orthogonal to S_h), so the single-head learner of
section 3 runs per head through a restricted view of the oracle.

No subspace assumption (arXiv 2608.03294): the copy-count identity. With m copies of
a followed by n copies of q (q last), u = a - q, mu = m / n,

    g(mu) = f - v^T a = - sum_h c_h kappa_h / (mu + kappa_h),
    kappa_h = exp(-u^T W_h q),   c_h = v_h^T u,   v = sum_h v_h,

(head h puts weight w_h = mu / (mu + kappa_h) on the copies of a; checked numerically
to 1e-15). g is a strictly proper rational function of mu with one pole -kappa_h per
canonical head; its value at mu = 0 (only copies of q) is -v^T u, known from v without
a query. So 2H - 1 copy ratios determine the 2H numbers (t_h = u^T W_h q, c_h) of one
probe (u, q), and the Loewner matrix of the samples has rank H, which counts the
canonical heads. Derivatives used by the least-squares polish:

    dg/dt_h = c_h w_h (1 - w_h),   dg/dc_h = -(1 - w_h).

Algorithm. v from d single tokens; DETECTION_PROBES random probes fix the logit scale
and the number H of canonical heads (largest Loewner rank above the output's rounding
level); then probes (u_k, q_j) for random orthonormal bases U, Q and every k, j, at
2H - 1 copy ratios each (lengths <= 2H + 1). Steps:

1. Free pole fit of every probe (linearised g Q = P, roots of Q, Levenberg-Marquardt).
   Probes whose logits saturate or crowd are probed again with q rescaled (c is
   unchanged, t scales with q).
2. Within a row k the residue c_h = v_h^T u_k does not depend on q: heads are matched
   across j by residue, the row's residues are the median, and every probe's logits
   are fitted again with the residues fixed (condition ~1e3-1e5 against ~1e7-1e13 for
   the free fit), from every assignment of its own poles; the lowest residual wins.
3. Gauss-Newton over whole rows (residues shared, each probe's t eliminated by a
   Schur complement). Probes left in a wrong local solution (residual far above the
   rest) get a grid search of their logits.
4. Probes on which two heads' logits nearly coincide cannot be split by their own
   samples: each is re-measured as the pair (u_k, q_j + r), (u_k, q_j - r) (random r),
   whose mean logits are t(u_k, q_j), and starts the final polish from there.
5. Rows are linked to row 1 by the probes (u_1 + u_k, q_1): their samples are
   predicted by (t_1 + t_k[p], c_1 + c_k[p]) for the right assignment p only
   (linearity in u). Rows whose residues tie (heads with equal v) are matched across
   j by probes (u_k, q_1 + q_j) (linearity in q).
6. A last polish of all rows on the queries already made. Rows whose residual stays
   above rounding (a coincident-pole probe fitted the wrong way round bends the row's
   residues, so no single probe stands out) are repaired: every reassignment of one
   probe's logits, and a global search of the worse half of the row with the residues
   of its best-fitting half, each polished with the whole row by Gauss-Newton on the
   full Jacobian (SVD; the normal equations square a condition of 1e7 and crawl); the
   rows are then linked again on the same link samples. Probes replaced by pairs take
   their logits from the pair, refitted with the final residues (polishing drifts along
   a coincident-pole probe's flat direction). W_h = U T_h Q^T / G, v_h = U C_h / c;
   verification on held-out sequences.

Recovery queries: d + detection + (2H - 1)(d^2 + d - 1) without extra probes, near
2Hd^2; the extra probes of steps 1 and 4 only spend what paper 2's count
4Hd^2 - 2H + 1 leaves after the links still to come, so the total stays within it
(measured for d >= 3; for d <= 2 the detection probes alone exceed it). The floor is H(d^2 + d),
the canonical form's free parameters.
"""

from __future__ import annotations

import math
import time
from math import gcd

import numpy as np
from scipy.optimize import linear_sum_assignment

from ..errors import InputError, ModelMismatchError, NotIdentifiableError
from ..models import MultiHeadAttention, SingleHeadAttention
from ..oracle import Oracle
from ..report import (DEFAULT_VERIFY_TOLERANCE, ExtractionResult, Report, checked_result, held_out_sequences,
                     token_scale, verification_count, verify_model)
from .single_head import extract_single_head

TARGET_LOGIT = 2.0      # aim for max |u^T W_h q| about this on the detection probe
RANK_TOL = 1e-10        # relative singular value of the Loewner matrix counted as a head
TIE_TOL = 1e-3          # residues closer than this (relative) cannot match heads
MAX_HEADS = 12          # largest H searched when no bound is given
MAX_SCALE_ROUNDS = 8
MAX_GROWTH = 1e6
GN_ITERATIONS = 30
MAX_RESCUES = 4
DETECTION_PROBES = 2    # random probes that set the logit scale (4 from d = 16 on: the
DETECTION_PROBES_WIDE = 4  # median of 2 peaks misjudges the scale too often there)
GRID_POINTS = 20000
RANK_NOISE_FACTOR = 1e3   # Loewner singular values below this many output roundings are noise
MISFIT_NOISE_FACTOR = 30  # probe residuals below this many output roundings are not misfits     # grid of the global search of one probe's logits
COINCIDENT_LOGIT = 0.03  # two heads' logits closer than this on a probe: probe it another way
WEAK_FACTOR = 30.0       # ... or its weakest logit direction this far below the typical probe
MISFIT_FACTOR = 1e4     # a probe whose relative residual exceeds the median's by this
SATURATED_LOGIT = 3.0   # beyond log(2H) + this, weights w(1 - w) fall below ~0.05: probe again
CROWDED_LOGIT = 0.5     # with H > 1, all |t| below it crowd the poles: probe again, larger
PROBE_FLOATS = 1 << 23  # probe floats per batch (64 MB)
NONMONOTONE = 1e6        # an exact row polish step may raise the residual this much
SWAP_PROBES = 8          # probes of a row whose logits are reassigned in the swap search


# ---------------------------------------------------------------------------
# canonical form, twins, matching
# ---------------------------------------------------------------------------

def _check_multi(model) -> MultiHeadAttention:
    if isinstance(model, SingleHeadAttention):
        return MultiHeadAttention(model.W[None], model.v[None])
    if not isinstance(model, MultiHeadAttention):
        raise InputError(f"expected a MultiHeadAttention model, got {type(model).__name__}")
    return model


def canonical_form(model, tol: float = 1e-9) -> MultiHeadAttention:
    """Merge heads with equal W (adding their v), then drop heads whose v is 0.

    Parameters
    ----------
    model : MultiHeadAttention
        W (H, d, d), v (H, d).
    tol : float
        Two W are equal when ||W_g - W_h||_F <= tol * max_h ||W_h||_F (or both are 0);
        a merged v is 0 when ||v|| <= tol * max_h ||v_h||.

    Returns
    -------
    MultiHeadAttention
        The canonical heads, W (H', d, d), v (H', d), H' <= H, in order of first appearance.
    """
    model = _check_multi(model)
    if tol < 0 or not np.isfinite(tol):
        raise InputError(f"tol must be a non-negative number, got {tol}")
    W, v, d = model.W, model.v, model.dim
    w_scale = max(float(np.max(np.linalg.norm(W, axis=(1, 2)), initial=0.0)), 0.0)
    v_scale = float(np.max(np.linalg.norm(v, axis=1), initial=0.0))
    groups: list[list[int]] = []
    for h in range(model.heads):
        for g in groups:
            if np.linalg.norm(W[h] - W[g[0]]) <= tol * w_scale:
                g.append(h)
                break
        else:
            groups.append([h])
    keep_W, keep_v = [], []
    for g in groups:
        merged = v[g].sum(axis=0)
        if np.linalg.norm(merged) > tol * v_scale and np.any(merged):
            keep_W.append(W[g].mean(axis=0))
            keep_v.append(merged)
    if not keep_W:
        return MultiHeadAttention(np.zeros((0, d, d)), np.zeros((0, d)))
    return MultiHeadAttention(np.array(keep_W), np.array(keep_v))


def match_heads(recovered, truth) -> tuple[np.ndarray, float, float]:
    """Match the canonical heads of ``recovered`` to those of ``truth``.

    Returns
    -------
    order : int array (H,)
        ``recovered`` head order[h] is matched to ``truth`` head h.
    W_error, v_error : float
        Largest relative Frobenius error over matched heads, each head relative to its
        own norm (to the largest head's norm if its own is 0). ``inf`` if the numbers of
        canonical heads differ.
    """
    a, b = _check_multi(recovered), _check_multi(truth)
    if a.heads != b.heads or a.dim != b.dim:
        return np.arange(min(a.heads, b.heads)), math.inf, math.inf
    if b.heads == 0:
        return np.zeros(0, dtype=int), 0.0, 0.0
    w_norm = np.linalg.norm(b.W, axis=(1, 2))
    v_norm = np.linalg.norm(b.v, axis=1)
    w_norm = np.where(w_norm > 0, w_norm, max(w_norm.max(), 1e-300))
    v_norm = np.where(v_norm > 0, v_norm, max(v_norm.max(), 1e-300))
    dW = np.linalg.norm(a.W[None, :] - b.W[:, None], axis=(2, 3)) / w_norm[:, None]
    dv = np.linalg.norm(a.v[None, :] - b.v[:, None], axis=2) / v_norm[:, None]
    rows, cols = linear_sum_assignment(np.nan_to_num(dW + dv, nan=1e300, posinf=1e300))
    order = cols[np.argsort(rows)]
    idx = np.arange(b.heads)
    return order, float(dW[idx, order].max()), float(dv[idx, order].max())


def canonical_error(recovered, truth, tol: float = 1e-9) -> float:
    """Largest relative error between the canonical forms after matching heads."""
    _, w_err, v_err = match_heads(canonical_form(recovered, tol), canonical_form(truth, tol))
    return max(w_err, v_err)


def non_identifiable_twin(model, seed=None) -> MultiHeadAttention:
    """A different parameter set with exactly the same input-output map.

    Applies the three symmetries of section 7: one head's v is split between two
    heads with the same W, a dead head (random W, v = 0) is added, and the heads are
    permuted (never the identity when H >= 2).

    Parameters
    ----------
    model : MultiHeadAttention
        W (H, d, d), v (H, d) with H >= 1.

    Returns
    -------
    MultiHeadAttention
        W (H + 2, d, d), v (H + 2, d).
    """
    model = _check_multi(model)
    if model.heads == 0:
        raise InputError("a model with no heads has no twin to build from its heads")
    rng = np.random.default_rng(seed)
    d = model.dim
    W, v = list(model.W.copy()), list(model.v.copy())
    h = int(rng.integers(model.heads))
    share = rng.uniform(0.2, 0.8)
    noise = rng.standard_normal(d) * (np.linalg.norm(v[h]) + 1.0)
    split = share * v[h] + noise                    # value splitting: v_h = split + rest
    W.append(W[h].copy())
    v.append(v[h] - split)
    v[h] = split
    scale = float(np.linalg.norm(model.W) / math.sqrt(model.heads * d)) or 1.0
    W.append(scale * rng.standard_normal((d, d)))   # dead head: any W, v = 0
    v.append(np.zeros(d))
    order = rng.permutation(len(W))
    while np.all(order == np.arange(len(W))):
        order = rng.permutation(len(W))
    return MultiHeadAttention(np.array(W)[order], np.array(v)[order])


def twin_difference(model_a, model_b, count: int = 256, seed=None,
                    max_length: int = 16) -> dict:
    """Largest output difference of two models on random sequences (lengths 1..max_length).

    Tokens are N(0, c^2 I) with c such that model_a's scores are of order one.

    Returns
    -------
    dict
        ``max_abs``, ``max_relative`` (relative to the rms output), ``rms_output``,
        ``sequences``.
    """
    if model_a.dim != model_b.dim:
        raise InputError(f"models have different widths {model_a.dim} and {model_b.dim}")
    rng = np.random.default_rng(seed)
    seqs = held_out_sequences(model_a.dim, count, rng, token_scale(model_a), max_length)
    lengths = np.array([len(s) for s in seqs])
    fa, fb = np.empty(count), np.empty(count)
    for n in np.unique(lengths):
        idx = np.flatnonzero(lengths == n)
        batch = np.stack([seqs[i] for i in idx])
        fa[idx], fb[idx] = model_a(batch), model_b(batch)
    rms = float(np.sqrt(np.mean(fa ** 2)))
    diff = float(np.max(np.abs(fa - fb)))
    return {"max_abs": diff, "max_relative": diff / rms if rms > 0 else diff,
            "rms_output": rms, "sequences": count}


# ---------------------------------------------------------------------------
# known orthogonal subspaces (paper 1)
# ---------------------------------------------------------------------------

def _subspace_bases(subspaces, d: int) -> list[np.ndarray]:
    bases = []
    for i, s in enumerate(subspaces):
        arr = np.asarray(s)
        if arr.ndim == 1 and arr.size and np.issubdtype(arr.dtype, np.integer):
            if np.any(arr < 0) or np.any(arr >= d) or len(set(arr.tolist())) != arr.size:
                raise InputError(f"subspace {i}: coordinate indices must be distinct in 0..{d - 1}")
            basis = np.eye(d)[:, arr]
        else:
            basis = np.asarray(s, dtype=np.float64)
            if basis.ndim != 2 or basis.shape[0] != d or basis.shape[1] < 1:
                raise InputError(f"subspace {i}: expected a basis (d={d}, r) or coordinate "
                                 f"indices, got shape {np.shape(s)}")
            if not np.all(np.isfinite(basis)):
                raise InputError(f"subspace {i}: basis is not finite")
            q, r = np.linalg.qr(basis)
            if np.min(np.abs(np.diag(r))) <= 1e-12 * np.max(np.abs(np.diag(r))):
                raise InputError(f"subspace {i}: basis columns are linearly dependent")
            basis = q
        bases.append(basis)
    for i in range(len(bases)):
        for j in range(i):
            overlap = np.linalg.norm(bases[i].T @ bases[j])
            if overlap > 1e-9:
                raise InputError(f"subspaces {j} and {i} are not orthogonal "
                                 f"(|B_{j}^T B_{i}| = {overlap:.2e})")
    if sum(b.shape[1] for b in bases) > d:
        raise InputError("the subspaces' dimensions add up to more than d")
    return bases


def _extract_in_subspaces(oracle: Oracle, subspaces, seed, verify_tolerance) -> ExtractionResult:
    start, q0, bb0 = time.perf_counter(), oracle.queries, oracle.black_box_seconds
    d = oracle.dim
    bases = _subspace_bases(subspaces, d)
    if not bases:
        raise InputError("subspaces must hold at least one subspace")
    n_verify = verification_count(sum(b.shape[1] ** 2 + b.shape[1] for b in bases))
    inner_total = sum(b.shape[1] ** 2 + b.shape[1] + verification_count(b.shape[1] ** 2 + b.shape[1])
                      for b in bases)
    oracle.plan(inner_total + n_verify, "multi-head extraction in known subspaces")
    W, v, notes, per_head = [], [], [], []
    for i, B in enumerate(bases):
        # The restricted view: tokens y in R^r are sent as B y; every query goes through
        # the outer oracle, so its counter and budget see each one.
        view = Oracle(lambda Y, B=B: oracle.query(Y @ B.T), B.shape[1])
        try:
            inner = extract_single_head(view, seed=None if seed is None else seed + i,
                                        verify_tolerance=verify_tolerance)
        except NotIdentifiableError:
            notes.append(f"subspace {i}: v = 0 (dead head), dropped from the canonical form")
            per_head.append(view.queries)
            continue
        except ModelMismatchError as exc:
            raise ModelMismatchError(
                f"subspace {i}: the black box restricted to it is not a single head "
                f"(are the subspaces right?): {exc}", result=exc.result) from exc
        per_head.append(view.queries)
        W.append(B @ inner.model.W @ B.T)
        v.append(B @ inner.model.v)
    model = (MultiHeadAttention(np.array(W), np.array(v)) if W
             else MultiHeadAttention(np.zeros((0, d, d)), np.zeros((0, d))))
    recovery = oracle.queries - q0
    verification = verify_model(oracle, model, count=n_verify, seed=seed,
                                tolerance=verify_tolerance)
    floor = sum(b.shape[1] ** 2 + b.shape[1] for b in bases)
    report = Report(kind=MultiHeadAttention.kind, dim=d, queries=oracle.queries - q0,
                    breakdown={"recovery": recovery, "verification": n_verify},
                    floor=floor, verification=verification,
                    seconds=time.perf_counter() - start,
                    black_box_seconds=oracle.black_box_seconds - bb0, notes=notes,
                    details={"method": "known orthogonal subspaces (paper 1)",
                             "heads": model.heads, "queries per subspace": per_head,
                             "sequence lengths": "1..2 (+ 1..16 verification)"})
    return checked_result(model, report, "multi-head attention on these subspaces")


# ---------------------------------------------------------------------------
# copy-count probes and rational fitting (paper 2)
# ---------------------------------------------------------------------------

def copy_ratios(count: int, max_length: int | None = None) -> list[tuple[int, int]]:
    """``count`` copy counts (m, n), m, n >= 1, m + n <= max_length, log-spread ratios m/n.

    The ratios are reduced fractions; among them the ones nearest a log-uniform grid
    over [1/(L - 1), L - 1] are taken (L = max_length, by default the smallest length
    that holds ``count`` distinct ratios, at least 3), so both ends are always used.
    """
    if count < 1:
        raise InputError(f"count must be >= 1, got {count}")
    L = max(3, max_length or 3)
    while True:
        cand = sorted({(m // gcd(m, n), n // gcd(m, n)) for m in range(1, L)
                       for n in range(1, L - m + 1)}, key=lambda p: p[0] / p[1])
        if len(cand) >= count or max_length is not None:
            break
        L += 1
    if len(cand) < count:
        raise InputError(f"only {len(cand)} ratios fit in length {L}, {count} needed")
    logs = np.log([m / n for m, n in cand])
    grid = np.linspace(logs[0], logs[-1], count) if count > 1 else np.array([0.0])
    chosen: list[int] = []
    for g in grid:                      # nearest unused candidate to each grid point
        order = np.argsort(np.abs(logs - g))
        chosen.append(next(int(i) for i in order if int(i) not in chosen))
    return [cand[i] for i in sorted(chosen)]


def _ratio_lengths(ratios) -> list[int]:
    return [m + n for m, n in ratios]


def measure_probes(oracle: Oracle, v: np.ndarray, u: np.ndarray, q: np.ndarray,
                   ratios) -> np.ndarray:
    """g(mu) = f - v^T a for probes (u_p, q_p) at every copy ratio; one query per length.

    Parameters
    ----------
    u, q : arrays (P, d)
    ratios : list of (m, n)

    Returns
    -------
    array (P, len(ratios) + 1)
        Column 0 is mu = 0 (no query: -v^T u), then the ratios in order.
    """
    P, d = u.shape
    a = q + u
    base = a @ v
    out = np.empty((P, len(ratios) + 1))
    out[:, 0] = -(u @ v)
    lengths = _ratio_lengths(ratios)
    for L in sorted(set(lengths)):
        cols = [i for i, n in enumerate(lengths) if n == L]
        per_block = max(1, PROBE_FLOATS // (len(cols) * L * d))
        for lo in range(0, P, per_block):       # one query per length unless huge
            hi = min(P, lo + per_block)
            X = np.empty((len(cols), hi - lo, L, d))
            for r, i in enumerate(cols):
                m = ratios[i][0]
                X[r, :, :m, :] = a[lo:hi, None, :]
                X[r, :, m:, :] = q[lo:hi, None, :]
            f = oracle.query(X.reshape(-1, L, d)).reshape(len(cols), hi - lo)
            for r, i in enumerate(cols):
                out[lo:hi, i + 1] = f[r] - base[lo:hi]
    return out


def _mu_grid(ratios) -> np.ndarray:
    return np.array([0.0] + [m / n for m, n in ratios])


def loewner_singular_values(mu: np.ndarray, g: np.ndarray) -> np.ndarray:
    """Singular values of the Loewner matrix of samples g(mu); its rank is the number of poles.

    Points are split alternately into a left and a right set. mu (n,), g (n,).
    """
    order = np.argsort(mu)
    x, y = mu[order], g[order]
    lx, ly, rx, ry = x[0::2], y[0::2], x[1::2], y[1::2]
    L = (ly[:, None] - ry[None, :]) / (lx[:, None] - rx[None, :])
    return np.linalg.svd(L, compute_uv=False)


def _model_g(mu, t, c):
    """g and the attention weights w; mu (R,), t and c (..., H) -> g (..., R), w (..., H, R)."""
    kappa = np.exp(-np.clip(t, -700, 700))
    w = mu / (mu + kappa[..., None])
    g = -np.einsum("...h,...hr->...r", c, 1.0 - w)
    return g, w


def initial_fit(mu: np.ndarray, g: np.ndarray, H: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Poles and residues of every probe by linearised rational fitting, then Gauss-Newton.

    g Q = P with Q monic of degree H and P of degree H - 1 (least squares over the
    samples, mu scaled to [0, 1]); poles are the roots of Q, residues by linear least
    squares; then each probe is polished on its own.

    Parameters
    ----------
    mu : (R,) copy ratios, mu[0] = 0.
    g : (P, R) samples.

    Returns
    -------
    t (P, H), c (P, H), ok (P,) bool (poles real and negative, fit consistent).
    """
    P, R = g.shape
    scale = mu.max()
    x = mu / scale
    powers = x[:, None] ** np.arange(H + 1)                # (R, H + 1)
    A = np.concatenate([g[:, :, None] * powers[None, :, :H],
                        -np.broadcast_to(powers[:, :H], (P, R, H))], axis=2)
    rhs = -g * powers[:, H]
    coef = np.linalg.lstsq(A[0], rhs[0], rcond=None)[0][None] if P == 1 else None
    if coef is None:
        if R == 2 * H:
            try:
                coef = np.linalg.solve(A, rhs[..., None])[..., 0]
            except np.linalg.LinAlgError:
                coef = np.einsum("pij,pj->pi", np.linalg.pinv(A), rhs)
        else:
            coef = np.einsum("pij,pj->pi", np.linalg.pinv(A), rhs)
    companion = np.zeros((P, H, H))
    companion[:, 0, :] = -coef[:, H - 1::-1][:, :H]        # x^H + q_{H-1} x^{H-1} + ... + q_0
    if H > 1:
        companion[:, np.arange(1, H), np.arange(H - 1)] = 1.0
    roots = np.linalg.eigvals(companion)
    kappa = -roots.real * scale
    ok = np.all(kappa > 0, axis=1) & np.all(np.abs(roots.imag) <= 1e-6 * np.abs(roots) + 1e-300,
                                             axis=1)
    kappa = np.where(kappa > 0, kappa, 1.0)
    t = -np.log(kappa)
    t = np.sort(t, axis=1)
    c = _residues(mu, g, t)
    t, c = polish_probes(mu, g, t, c)
    fit, _ = _model_g(mu, t, c)
    size = np.abs(g).max(axis=1) + 1e-300
    ok &= np.all(np.isfinite(t), axis=1) & (np.abs(fit - g).max(axis=1) <= 1e-6 * size)
    return t, c, ok


def _residues(mu, g, t):
    """Linear least squares for c given t: g = -sum_h c_h (1 - w_h)."""
    _, w = _model_g(mu, t, np.ones_like(t))
    B = -(1.0 - w)                                          # (P, H, R)
    return np.einsum("phr,pr->ph", np.linalg.pinv(np.swapaxes(B, 1, 2)), g)


def polish_probes(mu, g, t, c, iterations: int = GN_ITERATIONS):
    """Levenberg-Marquardt on each probe's own (t, c); mu (R,), g (P, R), t, c (P, H)."""
    H = t.shape[1]
    lam = np.full(t.shape[0], 1e-6)
    fit, w = _model_g(mu, t, c)
    cost = np.sum((g - fit) ** 2, axis=1)
    for _ in range(iterations):
        J = np.concatenate([c[:, :, None] * w * (1.0 - w), -(1.0 - w)], axis=1)  # (P, 2H, R)
        r = g - fit
        N = np.einsum("pir,pjr->pij", J, J)
        diag = np.einsum("pii->pi", N)
        damped = N + (lam[:, None] * (diag + 1e-300))[:, :, None] * np.eye(2 * H)
        try:
            step = np.linalg.solve(damped, np.einsum("pir,pr->pi", J, r)[..., None])[..., 0]
        except np.linalg.LinAlgError:
            step = np.einsum("pij,pj->pi", np.linalg.pinv(damped), np.einsum("pir,pr->pi", J, r))
        t_new, c_new = t + step[:, :H], c + step[:, H:]
        fit_new, w_new = _model_g(mu, t_new, c_new)
        cost_new = np.sum((g - fit_new) ** 2, axis=1)
        better = np.isfinite(cost_new) & (cost_new <= cost)
        t = np.where(better[:, None], t_new, t)
        c = np.where(better[:, None], c_new, c)
        fit = np.where(better[:, None], fit_new, fit)
        w = np.where(better[:, None, None], w_new, w)
        cost = np.where(better, cost_new, cost)
        lam = np.where(better, lam / 10, lam * 10)
        if np.all(lam > 1e20) or np.all(cost <= 1e-32 * np.sum(g ** 2, axis=1)):
            break
    return t, c


def polish_rows(mu, g, t, c, iterations: int = GN_ITERATIONS, weight=None):
    """Gauss-Newton over whole rows: probes (u_k, q_j) for all j share c_h = v_h^T u_k.

    Parameters
    ----------
    mu : (R,)
    g : (K, J, R) samples of row k, column j.
    t : (K, J, H) logits, matched across j.
    c : (K, H) shared residues.
    weight : (K, J) 0/1, optional
        Probes with weight 0 are left out (their t is kept as given).

    The normal equations are solved by eliminating each probe's t (H x H blocks) and
    solving the H x H Schur complement for the shared c; the step is accepted only if
    the row's residual decreases (Levenberg damping otherwise).
    """
    K, J, H = t.shape
    lam = np.full(K, 1e-9)
    eye = np.eye(H)
    mask = np.ones((K, J)) if weight is None else np.asarray(weight, dtype=float)

    def residual(t, c):
        fit, w = _model_g(mu, t, np.broadcast_to(c[:, None, :], t.shape))
        return (g - fit) * mask[:, :, None], w

    r, w = residual(t, c)
    cost = np.sum(r ** 2, axis=(1, 2))
    for _ in range(iterations):
        Jt = c[:, None, :, None] * w * (1.0 - w) * mask[:, :, None, None]   # (K, J, H, R)
        Jc = -(1.0 - w) * mask[:, :, None, None]
        A = np.einsum("kjhr,kjgr->kjhg", Jt, Jt) + (1.0 - mask)[:, :, None, None] * eye
        B = np.einsum("kjhr,kjgr->kjhg", Jt, Jc)
        D = np.einsum("kjhr,kjgr->khg", Jc, Jc)
        bt = np.einsum("kjhr,kjr->kjh", Jt, r)
        bc = np.einsum("kjhr,kjr->kh", Jc, r)
        Ad = A + (lam[:, None, None, None] * (np.einsum("kjhh->kjh", A) + 1e-300)[..., None]) * eye
        Dd = D + (lam[:, None, None] * (np.einsum("khh->kh", D) + 1e-300)[..., None]) * eye
        try:
            AinvB = np.linalg.solve(Ad, B)
            Ainvb = np.linalg.solve(Ad, bt[..., None])[..., 0]
            S = Dd - np.einsum("kjhg,kjhf->kgf", B, AinvB)
            rhs = bc - np.einsum("kjhg,kjh->kg", B, Ainvb)
            dc = np.linalg.solve(S, rhs[..., None])[..., 0]
        except np.linalg.LinAlgError:
            lam *= 10
            continue
        dt = Ainvb - np.einsum("kjhg,kg->kjh", AinvB, dc)
        t_new, c_new = t + dt, c + dc
        r_new, w_new = residual(t_new, c_new)
        cost_new = np.sum(r_new ** 2, axis=(1, 2))
        better = np.isfinite(cost_new) & (cost_new <= cost)
        t = np.where(better[:, None, None], t_new, t)
        c = np.where(better[:, None], c_new, c)
        r = np.where(better[:, None, None], r_new, r)
        w = np.where(better[:, None, None, None], w_new, w)
        cost = np.where(better, cost_new, cost)
        lam = np.where(better, np.maximum(lam / 10, 1e-15), lam * 10)
        step = np.max(np.abs(dt), axis=(1, 2))
        if np.all((step < 1e-15) | ~better):
            if np.all(lam > 1e10) or np.all(step < 1e-15):
                break
    return t, c, cost


def polish_rows_exact(mu, g, t, c, iterations: int = GN_ITERATIONS):
    """Levenberg-Marquardt over whole rows on the full Jacobian, solved by SVD.

    Same model and arguments as :func:`polish_rows` (g (K, J, R), t (K, J, H), c (K, H))
    but each row's step is the least-squares solution of its (J R) x (J H + H) Jacobian
    itself rather than of the normal equations, which square its condition (1e7 and
    more when two heads nearly coincide on a probe): there the Schur-complement polish
    crawls, this one converges. Returns t, c and the rows' residual sums of squares.
    """
    K, J, H = t.shape
    R = g.shape[2]
    n = J * H + H
    lam = np.full(K, 1e-12)
    rows = np.arange(J * R).reshape(J, R)

    def residual(t, c):
        fit, w = _model_g(mu, t, np.broadcast_to(c[:, None, :], t.shape))
        return g - fit, w

    r, w = residual(t, c)
    cost = np.sum(r ** 2, axis=(1, 2))
    best_t, best_c, best_cost = t.copy(), c.copy(), cost.copy()
    for _ in range(iterations):
        Jac = np.zeros((K, J * R, n))
        dt = c[:, None, :, None] * w * (1.0 - w)                       # (K, J, H, R)
        dc = -(1.0 - w)
        for j in range(J):
            Jac[:, rows[j], j * H:(j + 1) * H] = np.moveaxis(dt[:, j], 1, 2)
            Jac[:, rows[j], J * H:] = np.moveaxis(dc[:, j], 1, 2)
        scale = np.sqrt(np.sum(Jac ** 2, axis=1)) + 1e-300               # (K, n) column scaling
        Js = Jac / scale[:, None, :]
        damp = np.sqrt(lam)[:, None, None] * np.eye(n)[None]
        A = np.concatenate([Js, damp], axis=1)
        b = np.concatenate([r.reshape(K, -1), np.zeros((K, n))], axis=1)
        try:
            step = np.einsum("kij,kj->ki", np.linalg.pinv(A, rcond=1e-15), b) / scale
        except np.linalg.LinAlgError:
            break
        t_new = t + step[:, :J * H].reshape(K, J, H)
        c_new = c + step[:, J * H:]
        r_new, w_new = residual(t_new, c_new)
        cost_new = np.sum(r_new ** 2, axis=(1, 2))
        # Non-monotone: near a curved valley's floor the full Gauss-Newton step may
        # first raise the residual and then converge in two or three steps where a
        # strictly descending LM crawls; the best point seen is what is returned.
        take = np.isfinite(cost_new) & (cost_new <= NONMONOTONE * best_cost)
        t = np.where(take[:, None, None], t_new, t)
        c = np.where(take[:, None], c_new, c)
        r = np.where(take[:, None, None], r_new, r)
        w = np.where(take[:, None, None, None], w_new, w)
        cost = np.where(take, cost_new, cost)
        improved = take & (cost < best_cost)
        best_t = np.where(improved[:, None, None], t, best_t)
        best_c = np.where(improved[:, None], c, best_c)
        best_cost = np.where(improved, cost, best_cost)
        lam = np.where(take, np.maximum(lam / 10, 1e-18), lam * 10)
        if np.all(lam > 1e6):
            break
    return best_t, best_c, best_cost

# ---------------------------------------------------------------------------
# the learner
# ---------------------------------------------------------------------------

def extract_multi_head(oracle: Oracle, *, heads=None, subspaces=None, seed=None,
                       verify_tolerance: float = DEFAULT_VERIFY_TOLERANCE,
                       rank_tol: float = RANK_TOL) -> ExtractionResult:
    """Recover the canonical heads of a multi-head attention black box.

    Parameters
    ----------
    oracle : Oracle
        Door to the black box; ``oracle.dim`` is the token width d.
    heads : int, optional
        Upper bound on the number of heads (the model's H is one); None searches up to
        MAX_HEADS. Ignored when ``subspaces`` is given.
    subspaces : list, optional
        Known pairwise orthogonal head subspaces (paper 1), each a basis (d, r_h) or a
        list of coordinate indices; then the single-head learner runs inside each.
    seed : int, optional
        Seed of the random probe bases and of the held-out verification sequences.
    verify_tolerance : float
        Largest held-out relative output error accepted as a match.
    rank_tol : float
        Relative Loewner singular value below which a pole is not counted as a head.

    Returns
    -------
    ExtractionResult
        ``model`` a :class:`MultiHeadAttention` with the canonical heads, W (H, d, d),
        v (H, d); ``report.details`` gives the heads detected and the sequence lengths.

    Raises
    ------
    ModelMismatchError
        Verification failed: the black box is not multi-head attention with at most
        ``heads`` canonical heads (or the pole fit broke down); ``.result`` holds the
        best-effort extraction.
    BudgetExceededError
        The budget cannot cover the next round (raised before it is sent).
    """
    if subspaces is not None:
        return _extract_in_subspaces(oracle, subspaces, seed, verify_tolerance)
    # Pole fits of poorly conditioned probes overflow on the way to being rejected;
    # that is expected and handled, not worth a warning.
    with np.errstate(all="ignore"):
        return _extract_copy_count(oracle, heads, seed, verify_tolerance, rank_tol)


def _extract_copy_count(oracle, heads, seed, verify_tolerance, rank_tol):
    if heads is not None and (not isinstance(heads, (int, np.integer)) or heads < 1):
        raise InputError(f"heads must be a positive integer or None, got {heads!r}")
    if not (0 < rank_tol < 1):
        raise InputError(f"rank_tol must lie in (0, 1), got {rank_tol}")
    start, q0, bb0 = time.perf_counter(), oracle.queries, oracle.black_box_seconds
    d = oracle.dim
    rng = np.random.default_rng(seed)
    breakdown: dict[str, int] = {}
    oracle.plan(d + (2 * (heads or 1) - 1), "multi-head extraction: single tokens")

    v = oracle.query(np.eye(d)[:, None, :])
    breakdown["v tokens"] = d

    # Outputs rounded to float32 (or float16) leave far fewer digits: the rank and
    # misfit thresholds follow the precision the outputs actually carry.
    precision, precision_name = output_precision(v)
    rank_tol = max(rank_tol, RANK_NOISE_FACTOR * precision)
    floor_rel = max(1e-26, (MISFIT_NOISE_FACTOR * precision) ** 2)
    H, G, det = _detect(oracle, v, rng, heads, rank_tol)
    breakdown["detection"] = det["queries"]
    notes: list[str] = []
    det["precision"] = precision_name
    if precision_name != "float64":
        notes.append(f"outputs are rounded to {precision_name} (relative {precision:.1e}): "
                     f"heads whose poles the rounding hides are not detected")
    if H == 0:
        model = MultiHeadAttention(np.zeros((0, d, d)), np.zeros((0, d)))
        return _finish(oracle, model, H, d, breakdown, det, {}, notes, start, q0, bb0, seed,
                       verify_tolerance, G)

    ratios = copy_ratios(2 * H - 1, max_length=2 * H + 1)
    mu = _mu_grid(ratios)
    n_main = d * d * len(ratios)
    n_links = (d - 1) * len(ratios)
    n_verify = verification_count(H * (d * d + d))
    oracle.plan(n_main + n_links + n_verify, "multi-head extraction: copy-count probes")

    U = np.linalg.qr(rng.standard_normal((d, d)))[0]
    Q = np.linalg.qr(rng.standard_normal((d, d)))[0]
    cu, sq = max(1.0, G), min(1.0, G)
    kk, jj = np.divmod(np.arange(d * d), d)                  # probe (k, j) at k * d + j
    g = measure_probes(oracle, v, cu * U.T[kk], sq * Q.T[jj], ratios).reshape(d, d, -1)
    breakdown["main probes"] = n_main
    t, c, ok = initial_fit(mu, g.reshape(d * d, -1), H)
    t, c, ok = t.reshape(d, d, H), c.reshape(d, d, H), ok.reshape(d, d)

    # Probes whose logits saturate (or, with several heads, crowd near 0) are probed
    # again with q rescaled: c = v_h^T u_k does not change, t scales with q.
    q_scale = np.full((d, d), sq)
    rescaled = 0
    # Extra probes (rescaling, coincident poles) spend only what paper 2's count leaves
    # after everything still to come (row links, tie links for rows whose residues tie).
    bound = 4 * H * d * d - 2 * H + 1
    tie_rows = _match_columns(t.copy(), c.copy(), ok.copy())[2]
    reserved = {"links": n_links, "ties": int(tie_rows.sum()) * (d - 1) * len(ratios)}

    def spare_probes(per_probe: int) -> int:
        left = bound - (oracle.queries - q0) - sum(reserved.values())
        return max(0, left // per_probe)

    for _ in range(MAX_RESCUES):
        peak = np.abs(t).max(axis=2)
        # A probe without a clean free fit is left alone here: with several heads that
        # is nearly always crowded poles, which the fits with known residues handle.
        redo = ok & (peak > SATURATED_LOGIT + math.log(2 * H))
        if H == 1:
            redo |= ~ok
        else:
            redo |= ok & (peak < CROWDED_LOGIT) & (q_scale < sq * MAX_GROWTH)
        if not redo.any():
            break
        allowed = spare_probes(len(ratios))
        if redo.sum() > allowed:                 # the worst probes first
            severity = np.where(peak > 1.0, peak, 1.0 / np.maximum(peak, 1e-300))
            severity = np.where(ok, severity, np.inf)
            keep = np.argsort(-np.where(redo, severity, -1.0), axis=None)[:allowed]
            redo = np.zeros_like(redo)
            redo.flat[keep] = True
            if not redo.any():
                break
        factor = np.where(ok & (peak > 0), TARGET_LOGIT / np.maximum(peak, 1e-300), 1 / 8)
        q_scale[redo] *= np.clip(factor[redo], 1 / 64, 64)
        k_r, j_r = np.nonzero(redo)
        oracle.require(len(k_r) * len(ratios) + n_links + n_verify, "rescaled probes")
        g[k_r, j_r] = measure_probes(oracle, v, cu * U.T[k_r], q_scale[k_r, j_r, None] * Q.T[j_r],
                                     ratios)
        rescaled += len(k_r) * len(ratios)
        t[k_r, j_r], c[k_r, j_r], ok[k_r, j_r] = initial_fit(mu, g[k_r, j_r], H)
    if rescaled:
        breakdown["rescaling"] = rescaled
    if not ok.all():
        notes.append(f"{int((~ok).sum())} of {d * d} probes had no clean {H}-pole fit; "
                     f"refitted with their row's residues")

    # Residues of a row are shared by its probes: match them by residue, take the
    # median as the row's residues, then fit every probe's logits again with those
    # residues fixed (far better conditioned than a free pole fit), starting from
    # every assignment of its own poles: the right one leaves no residual.
    t, c, ties, _ = _match_columns(t, c, ok)
    C = np.median(c, axis=1)
    t, c, _, _ = _match_columns(t, c, ok, C)
    C = np.median(c, axis=1)
    # Twice: the polished residues tell apart assignments that the medians could not.
    for _ in range(2):
        t = _refit_logits(mu, g, t, C, ties)
        t, C, cost = polish_rows(mu, g, t, C)
    # A probe left in a wrong local solution fits its samples visibly worse than the
    # rest: search its logits globally (residues known), then polish again.
    t, C, cost, searched = _repair_misfits(mu, g, t, C, ties, floor_rel)
    if searched:
        notes.append(f"{searched} probe fit(s) left in a wrong local solution were searched "
                     f"globally")
    # Two heads with nearly equal logits on a probe (W_h - W_g nearly orthogonal to
    # that (u, q)) cannot be split by its samples. Such a probe is replaced by the
    # pair (u_k, q_j + r), (u_k, q_j - r) for a random r: t(q_j) is their mean.
    weight = np.ones((d, d))
    # the pair that replaced a probe, kept to re-derive its logits once the residues
    # are final: samples (d, d, 2, R + 1), logits (d, d, 2, H)
    pair_g = np.zeros((d, d, 2, len(ratios) + 1))
    pair_t = np.zeros((d, d, 2, H))
    quality = np.zeros((d, d))          # weakest direction of the pair that replaced a probe
    replaced = 0
    if H > 1:
        Cb = np.broadcast_to(C[:, None, :], t.shape)
        typical = float(np.median(_weakest_direction(mu, t, Cb)))
        misfit = _misfits(mu, g, t, C, floor_rel)
        close = (_coincident(mu, t, Cb, typical) | misfit) & ~ties[:, None]
        urgency = np.where(misfit, -np.inf, _weakest_direction(mu, t, Cb))
        for _ in range(3):
            allowed = spare_probes(2 * len(ratios))
            if close.sum() > allowed:            # misfits, then the weakest probes first
                keep = np.argsort(np.where(close, urgency, np.inf), axis=None)[:allowed]
                close = np.zeros_like(close)
                close.flat[keep] = True
            if not close.any():
                break
            k_c, j_c = np.nonzero(close)
            F = len(k_c)
            oracle.require(2 * F * len(ratios) + n_links + n_verify, "probes for coincident poles")
            z = rng.standard_normal((F, d))
            z *= (q_scale[k_c, j_c] / np.linalg.norm(z, axis=1))[:, None]
            qs = q_scale[k_c, j_c, None] * Q.T[j_c]
            ga = measure_probes(oracle, v, np.tile(cu * U.T[k_c], (2, 1)),
                                np.vstack([qs + z, qs - z]), ratios)
            replaced += 2 * F * len(ratios)
            ta = _fit_known_residues(mu, ga, np.tile(C[k_c], (2, 1)), 100 * floor_rel)
            weak = np.minimum(_weakest_direction(mu, ta[:F], C[k_c]),
                              _weakest_direction(mu, ta[F:], C[k_c]))
            take = weak > quality[k_c, j_c]      # keep the best-conditioned pair so far
            # ... unless its mean logits contradict the probe's own samples outright
            # (a pair caught in a wrong solution of its own)
            mean = 0.5 * (ta[:F] + ta[F:])
            size = np.sum(g[k_c, j_c] ** 2, axis=1) + 1e-300
            own = _probe_costs(mu, g[k_c, j_c][:, None], t[k_c, j_c][:, None], C[k_c])[:, 0]
            via_pair = _probe_costs(mu, g[k_c, j_c][:, None], mean[:, None], C[k_c])[:, 0]
            own, via_pair = own / size, via_pair / size
            take &= via_pair <= np.maximum(1e6 * own, 1e6 * floor_rel)
            t[k_c[take], j_c[take]] = mean[take]
            pair_g[k_c[take], j_c[take]] = np.stack([ga[:F], ga[F:]], axis=1)[take]
            pair_t[k_c[take], j_c[take]] = np.stack([ta[:F], ta[F:]], axis=1)[take]
            weight[k_c[take], j_c[take]] = 0.0
            quality[k_c[take], j_c[take]] = weak[take]
            # a pair that is itself poorly conditioned is tried again with another r
            close = np.zeros((d, d), dtype=bool)
            retry = (_coincident(mu, ta[:F], C[k_c], typical)
                     | _coincident(mu, ta[F:], C[k_c], typical)) & (quality[k_c, j_c] < typical / 3)
            close[k_c[retry], j_c[retry]] = True
        if replaced:
            breakdown["pole pairs"] = replaced
            notes.append(f"{int((weight == 0).sum())} probe(s) with coincident poles replaced "
                         f"by pairs q +- r")
    c = np.broadcast_to(C[:, None, :], t.shape).copy()
    if d > 1:
        # row links (u_1 + u_k, q_1): pairs are sums of rows 1 and k (linearity in u)
        gl = measure_probes(oracle, v, cu * (U[:, :1] + U[:, 1:]).T,
                            np.repeat(q_scale[0, 0] * Q[:, :1].T, d - 1, axis=0), ratios)
        breakdown["row links"] = n_links
        reserved["links"] = 0
        t0 = t[:, 0] * (q_scale[0, 0] / q_scale[:, :1])       # column 1 at the link's scale
        for k in range(1, d):
            p = _link_permutation(mu, gl[k - 1], t0[0], c[0, 0], t0[k], c[k, 0])
            t[k], c[k] = t[k][:, p], c[k][:, p]
            pair_t[k] = pair_t[k][:, :, p]
    if ties.any() and d > 1:
        tied = np.flatnonzero(ties)
        oracle.require(len(tied) * (d - 1) * len(ratios), "tie links")
        uq = np.repeat(cu * U[:, tied].T, d - 1, axis=0)
        qq = np.tile(sq * (Q[:, :1] + Q[:, 1:]).T, (len(tied), 1))
        gq = measure_probes(oracle, v, uq, qq, ratios).reshape(len(tied), d - 1, -1)
        breakdown["tie links"] = len(tied) * (d - 1) * len(ratios)
        for i, k in enumerate(tied):
            ts = t[k] * (sq / q_scale[k])[:, None]
            for j in range(1, d):
                p = _link_permutation(mu, gq[i, j - 1], ts[0], c[k, 0], ts[j])
                t[k, j] = t[k, j][p]
                pair_t[k, j] = pair_t[k, j][:, p]
        notes.append(f"{len(tied)} row(s) had tied residues (heads with equal v): matched "
                     f"across q by linearity")

    # all probes, the replaced ones starting from their pairs' logits (the right basin)
    t, C, cost = polish_rows(mu, g, t, c[:, 0, :].copy())
    t, C, cost, more = _repair_misfits(mu, g, t, C, ties, floor_rel)
    if more:
        notes.append(f"{more} probe fit(s) searched globally after the final polish")
    t, C, cost, swapped = _repair_swaps(mu, g, t, C, ties, floor_rel)
    if swapped:
        notes.append(f"{swapped} row repair(s): probes' logits reassigned, or searched "
                     f"with the residues of the row's best-fitting half")
        if d > 1:
            # the rows were linked with the logits before the repair: link them again
            # on the same link samples (no query; a row's cost ignores its head order)
            t0 = t[:, 0] * (q_scale[0, 0] / q_scale[:, :1])
            relinked = 0
            for k in range(1, d):
                p = _link_permutation(mu, gl[k - 1], t0[0], C[0], t0[k], C[k])
                relinked += int(np.any(p != np.arange(H)))
                t[k], C[k] = t[k][:, p], C[k][p]
                pair_t[k] = pair_t[k][:, :, p]
            if relinked:
                notes.append(f"{relinked} row(s) linked again after the repair")
    replaced_probes = weight == 0
    if replaced_probes.any():
        # A probe with coincident poles pins only the sum of the close heads' terms:
        # polishing drifts along that flat direction. Its logits are taken again from
        # its pair (u, q +- r), refitted with the final residues, unless that mean fits
        # the probe's own samples visibly worse (a pair caught in a wrong solution).
        k_p, j_p = np.nonzero(replaced_probes)
        F = len(k_p)
        Cp = np.tile(C[k_p], (2, 1))
        tp, _ = polish_logits(mu, np.concatenate([pair_g[k_p, j_p, 0], pair_g[k_p, j_p, 1]]),
                              np.concatenate([pair_t[k_p, j_p, 0], pair_t[k_p, j_p, 1]]), Cp)
        mean = 0.5 * (tp[:F] + tp[F:])
        size = np.sum(g[k_p, j_p] ** 2, axis=1) + 1e-300
        own = _probe_costs(mu, g[k_p, j_p][:, None], t[k_p, j_p][:, None], C[k_p])[:, 0] / size
        via_pair = _probe_costs(mu, g[k_p, j_p][:, None], mean[:, None], C[k_p])[:, 0] / size
        take = via_pair <= np.maximum(100 * own, floor_rel)
        t[k_p[take], j_p[take]] = mean[take]
    T = np.moveaxis(t / (cu * q_scale[:, :, None]), 2, 0)     # (H, k, j): U^T W_h Q
    W = np.einsum("ak,hkj,bj->hab", U, T, Q)
    vh = (U @ C / cu).T                                        # (H, d)
    if not (np.all(np.isfinite(W)) and np.all(np.isfinite(vh))):
        # the fit broke down (e.g. more heads than the bound): keep a finite stand-in
        # so that verification reports the mismatch
        notes.append("the pole fit diverged: non-finite parameters replaced by 0")
        W, vh = np.nan_to_num(W, nan=0.0, posinf=0.0, neginf=0.0), np.nan_to_num(vh)
    model = MultiHeadAttention(W, vh)
    fit_info = {"residual rms": float(np.sqrt(cost.sum() / g.size)),
                "ratios": ratios}
    return _finish(oracle, model, H, d, breakdown, det, fit_info, notes, start, q0, bb0, seed,
                   verify_tolerance, G)


def output_precision(values: np.ndarray) -> tuple[float, str]:
    """Relative precision the black box's outputs carry: float16, float32 or float64.

    Generic float64 numbers are almost never exactly representable in float32; if
    every nonzero output is, the black box rounds to float32 (likewise float16).
    """
    x = np.asarray(values, dtype=np.float64)
    x = x[x != 0]
    if x.size >= 2:
        if np.all(x.astype(np.float16).astype(np.float64) == x):
            return 2.0 ** -11, "float16"
        if np.all(x.astype(np.float32).astype(np.float64) == x):
            return 2.0 ** -24, "float32"
    return 2.0 ** -53, "float64"


def _detect(oracle, v, rng, bound, rank_tol):
    """Logit scale G and number of canonical heads H from DETECTION_PROBES random probes.

    The Loewner matrix of a probe's samples has rank H (the largest rank over the
    probes is taken). Samples are taken at 2k - 1 ratios (k = bound, or growing until
    the rank stops filling the matrix); the scale is adjusted until the median over
    the probes of the largest fitted |t| is near TARGET_LOGIT.
    """
    d = v.shape[0]
    n_probes = DETECTION_PROBES_WIDE if d >= 16 else DETECTION_PROBES
    u0 = rng.standard_normal((n_probes, d))
    u0 /= np.linalg.norm(u0, axis=1, keepdims=True)
    q0 = rng.standard_normal((n_probes, d))
    q0 /= np.linalg.norm(q0, axis=1, keepdims=True)
    G, used, history, longest = 1.0, 0, [], 0
    k_max = bound or MAX_HEADS
    H = 0
    for _ in range(MAX_SCALE_ROUNDS):
        cu, sq = max(1.0, G), min(1.0, G)
        # after a first round the rank is known: one more ratio pair confirms it
        k = bound or (min(H + 1, k_max) if H else 2)
        measured: dict[tuple[int, int], np.ndarray] = {}
        while True:
            want = [r for r in copy_ratios(2 * k - 1) if r not in measured]
            oracle.require(len(want) * n_probes, "detection")
            if want:
                vals = measure_probes(oracle, v, cu * u0, sq * q0, want)
                used += len(want) * n_probes
                longest = max(longest, max(_ratio_lengths(want)))
                measured.update({r: vals[:, i + 1] for i, r in enumerate(want)})
            ratios = sorted(measured, key=lambda p: p[0] / p[1])
            mu = _mu_grid(ratios)
            gs = np.column_stack([-(cu * u0) @ v] + [measured[r] for r in ratios])
            ranks = []
            for row in gs:
                sv = loewner_singular_values(mu, row)
                ranks.append(0 if not np.any(row) or sv[0] <= 0
                             else int(np.sum(sv > rank_tol * sv[0])))
            rank = max(ranks)
            full = rank >= min(k, len(sv))
            if bound is not None or not full or k >= k_max:
                break
            k += 1
        H = min(rank, k_max)
        history.append({"scale": G, "rank": rank, "samples": gs.shape[1]})
        if H == 0:
            break
        t, c, ok = initial_fit(mu, gs, H)
        peaks = np.abs(t).max(axis=1)
        peak = float(np.median(peaks[ok])) if ok.any() else float(np.median(peaks))
        history[-1]["median max |t|"] = peak
        if ok.any() and TARGET_LOGIT / 2 <= peak <= 2 * TARGET_LOGIT:
            break
        if not np.isfinite(peak) or peak > 1e3:
            G /= 8.0                      # a saturated head breaks the fit: probe smaller
        elif peak < 1e-12 * G:            # every W is 0 along these probes: no scale to set
            break
        else:
            G *= min(TARGET_LOGIT / peak, MAX_GROWTH)
    return H, G, {"queries": used, "rounds": history, "max_len": longest}


def _match_columns(t, c, ok, reference=None):
    """Match heads across the columns j of each row k by residue (c does not depend on q).

    The reference is ``reference[k]`` or the row's first probe with a clean fit.
    Returns t, c permuted, ``ties`` (K,) bool (rows whose residues are too close to tell
    heads apart: heads with equal v) and the reference residues (K, H).
    """
    K, J, H = t.shape
    ties = np.zeros(K, dtype=bool)
    refs = np.empty((K, H))
    for k in range(K):
        good = np.flatnonzero(ok[k])
        cref = (reference[k] if reference is not None else c[k, good[0] if good.size else 0]).copy()
        refs[k] = cref
        size = np.abs(cref).max() + 1e-300
        if H > 1:
            gaps = np.abs(cref[:, None] - cref[None, :]) + np.eye(H) * size
            ties[k] = gaps.min() < TIE_TOL * size
        for j in range(J):
            cost = np.nan_to_num(np.abs(cref[:, None] - c[k, j][None, :]) / size, nan=1e300,
                                 posinf=1e300)
            _, perm = linear_sum_assignment(cost)
            t[k, j], c[k, j] = t[k, j][perm], c[k, j][perm]
    return t, c, ties, refs


def polish_logits(mu, g, t, c, iterations: int = GN_ITERATIONS):
    """Levenberg-Marquardt on t alone, residues c fixed; mu (R,), g, (P, R), t, c (P, H).

    Returns t (P, H) and the residual sum of squares (P,).
    """
    H = t.shape[1]
    lam = np.full(t.shape[0], 1e-6)
    fit, w = _model_g(mu, t, c)
    cost = np.sum((g - fit) ** 2, axis=1)
    for _ in range(iterations):
        J = c[:, :, None] * w * (1.0 - w)
        N = np.einsum("pir,pjr->pij", J, J)
        diag = np.einsum("pii->pi", N)
        damped = N + (lam[:, None] * (diag + 1e-300))[:, :, None] * np.eye(H)
        step = np.einsum("pij,pj->pi", np.linalg.pinv(damped), np.einsum("pir,pr->pi", J, g - fit))
        t_new = t + step
        fit_new, w_new = _model_g(mu, t_new, c)
        cost_new = np.sum((g - fit_new) ** 2, axis=1)
        better = np.isfinite(cost_new) & (cost_new <= cost)
        t = np.where(better[:, None], t_new, t)
        fit = np.where(better[:, None], fit_new, fit)
        w = np.where(better[:, None, None], w_new, w)
        cost = np.where(better, cost_new, cost)
        lam = np.where(better, np.maximum(lam / 10, 1e-15), lam * 10)
        if np.all(lam > 1e20):
            break
    return t, cost


def _refit_logits(mu, g, t, C, ties):
    """Fit every probe's logits again with its row's residues C (K, H) fixed.

    Multi-start: every assignment of the probe's own poles to the heads (H <= 5; the
    residue matching alone for larger H) and the row's median logits; the lowest
    residual wins. In rows with tied residues the assignment stays as matched (tie
    links settle it).
    """
    K, J, H = t.shape
    from itertools import permutations
    perms = np.array(list(permutations(range(H))) if H <= 5 else [tuple(range(H))])
    med = np.median(t, axis=1)                                           # (K, H)
    starts = np.concatenate([t[:, :, perms], med[:, None, None, :].repeat(J, axis=1)],
                            axis=2)                                      # (K, J, S, H)
    S = starts.shape[2]
    gg = np.broadcast_to(g[:, :, None, :], (K, J, S, g.shape[2])).reshape(-1, g.shape[2])
    cc = np.broadcast_to(C[:, None, None, :], (K, J, S, H)).reshape(-1, H)
    tt, cost = polish_logits(mu, gg, starts.reshape(-1, H), cc)
    tt, cost = tt.reshape(K, J, S, H), cost.reshape(K, J, S)
    best = np.argmin(cost, axis=2)
    best[ties] = 0                                   # identity start: keep the matching
    return np.take_along_axis(tt, best[:, :, None, None], axis=2)[:, :, 0, :]


def _probe_costs(mu, g, t, C):
    """Residual sum of squares of every probe; g (K, J, R), t (K, J, H), C (K, H) -> (K, J)."""
    fit, _ = _model_g(mu, t, np.broadcast_to(C[:, None, :], t.shape))
    return np.sum((g - fit) ** 2, axis=2)


def _misfits(mu, g, t, C, floor_rel: float = 1e-26):
    """Probes whose residual stands far above the others' (a wrong local solution)."""
    cost = _probe_costs(mu, g, t, C)
    size = np.sum(g ** 2, axis=2) + 1e-300
    rel = cost / size
    floor = max(float(np.median(rel)), 1e-30)
    return rel > max(MISFIT_FACTOR * floor, floor_rel)


def _global_refit(mu, g, C, t_now, limit: float):
    """Best logits of single probes by a grid search over t in [-limit, limit]^H, then LM.

    g (P, R), C (P, H). The grid has at most ~3e5 points per probe.
    """
    P, H = C.shape
    n = max(4, min(25, int(round(GRID_POINTS ** (1.0 / H)))))
    axis = np.linspace(-limit, limit, n)
    grid = np.stack(np.meshgrid(*([axis] * H), indexing="ij"), axis=-1).reshape(-1, H)
    out = np.empty((P, H))
    for p in range(P):
        costs = np.empty(len(grid))
        for lo in range(0, len(grid), 1 << 16):
            fit, _ = _model_g(mu, grid[lo:lo + (1 << 16)], C[p][None])
            costs[lo:lo + (1 << 16)] = np.sum((fit - g[p]) ** 2, axis=1)
        best = np.vstack([grid[np.argpartition(costs, 16)[:16]], t_now[p][None]])
        tt, cost = polish_logits(mu, np.repeat(g[p][None], len(best), 0), best,
                                 np.repeat(C[p][None], len(best), 0))
        out[p] = tt[np.argmin(cost)]
    return out


def _weakest_direction(mu, t, C):
    """Smallest singular value of each probe's logit Jacobian c_h w_h (1 - w_h), residues known.

    t (..., H), C (..., H) -> (...). Small when two heads' logits nearly coincide (their
    columns become parallel) or when a head saturates on that probe.
    """
    _, w = _model_g(mu, t, C)
    J = C[..., :, None] * w * (1.0 - w)
    return np.linalg.svd(J, compute_uv=False)[..., -1]


def _coincident(mu, t, C, reference=None):
    """Probes whose logits are poorly determined: two heads' logits within
    COINCIDENT_LOGIT, or a weakest Jacobian direction WEAK_FACTOR below ``reference``
    (by default the median over the probes given)."""
    H = t.shape[-1]
    if H < 2:
        return np.zeros(t.shape[:-1], dtype=bool)
    gaps = np.abs(t[..., :, None] - t[..., None, :]) + np.eye(H) * 1e300
    weak = _weakest_direction(mu, t, C)
    ref = np.median(weak) if reference is None else reference
    return (gaps.min(axis=(-1, -2)) < COINCIDENT_LOGIT) | (weak < ref / WEAK_FACTOR)


def _fit_known_residues(mu, g, C, floor_rel: float = 1e-24):
    """Logits of single probes whose residues C (P, H) are known; g (P, R) -> t (P, H).

    A free pole fit gives starting poles; every assignment of them to the heads is
    polished with C fixed; probes still fitting badly get a global grid search.
    """
    from itertools import permutations
    P, H = C.shape
    t_free, _, _ = initial_fit(mu, g, H)
    perms = np.array(list(permutations(range(H))) if H <= 5 else [tuple(range(H))])
    starts = t_free[:, perms].reshape(-1, H)
    tt, cost = polish_logits(mu, np.repeat(g, len(perms), 0), starts, np.repeat(C, len(perms), 0))
    tt, cost = tt.reshape(P, len(perms), H), cost.reshape(P, len(perms))
    best = np.argmin(cost, axis=1)
    t = tt[np.arange(P), best]
    rel = cost[np.arange(P), best] / (np.sum(g ** 2, axis=1) + 1e-300)
    bad = rel > floor_rel
    if bad.any():
        t[bad] = _global_refit(mu, g[bad], C[bad], t[bad], float(np.abs(t).max()) + 1.0)
    return t


def _repair_misfits(mu, g, t, C, ties, floor_rel: float = 1e-26, rounds: int = 3):
    """Search globally the logits of probes left in a wrong local solution, then polish.

    A misfit fits its samples visibly worse than the other probes. Its row's residues
    are first polished without it (a wrong fit pulls them), then its logits are searched
    on a grid with those residues fixed. Returns t, C, the rows' costs and the number
    of probes searched.
    """
    searched, cost = 0, None
    for _ in range(rounds):
        bad = _misfits(mu, g, t, C, floor_rel) & ~ties[:, None]
        if not bad.any() or t.shape[2] == 1:
            break
        k_b, j_b = np.nonzero(bad)
        t, C, cost = polish_rows(mu, g, t, C, weight=~bad)
        limit = float(np.abs(t).max()) + 1.0
        t[k_b, j_b] = _global_refit(mu, g[k_b, j_b], C[k_b], t[k_b, j_b], limit)
        t, C, cost = polish_rows(mu, g, t, C)
        searched += len(k_b)
    if cost is None:
        t, C, cost = polish_rows(mu, g, t, C)
    return t, C, cost, searched


def _repair_swaps(mu, g, t, C, ties, floor_rel: float = 1e-26, rounds: int | None = None):
    """Reassign the heads' logits on single probes of rows whose fit stays above rounding.

    Two heads with nearly equal logits (or nearly equal residues) on a probe can be
    fitted the wrong way round: their outputs differ only by (c_a - c_b)(w_a - w_b), so
    the row's residues bend a little and every probe of the row then fits to ~1e-12,
    none standing out as a misfit. For each such row, every reassignment of one probe's
    logits (all H! orders for H <= 5, the swaps of two heads beyond) is polished with
    the whole row as one candidate; the best is kept while it lowers the row's residual
    at least twofold (greedy, one probe per round). Returns t, C, the rows' costs and
    the reassignments made.
    """
    from itertools import combinations, permutations
    K, J, H = t.shape
    if H <= 5:
        orders = [p for p in permutations(range(H)) if p != tuple(range(H))]
    else:
        orders = []
        for a, b in combinations(range(H), 2):
            p = list(range(H))
            p[a], p[b] = b, a
            orders.append(tuple(p))
    orders = np.array(orders, dtype=int).reshape(-1, H)
    swaps = 0
    for _ in range(J + 2 if rounds is None else rounds):
        probe_cost = _probe_costs(mu, g, t, C)
        cost = np.sum(probe_cost, axis=1)
        size = np.sum(g ** 2, axis=(1, 2)) + 1e-300
        suspect = np.flatnonzero((cost / size > floor_rel) & ~ties)
        if H < 2 or suspect.size == 0:
            break
        changed = False
        for k in suspect:
            # Several probes of the row in wrong solutions bend its residues together:
            # take the residues from the best-fitting half of the row alone, search the
            # other probes' logits globally with them, polish the whole row.
            order = np.argsort(probe_cost[k] / (np.sum(g[k] ** 2, axis=1) + 1e-300))
            trusted, rest = order[:max(2, (J + 1) // 2)], order[max(2, (J + 1) // 2):]
            if rest.size:
                _, c_half, _ = polish_rows_exact(mu, g[k][trusted][None], t[k][trusted][None],
                                                 C[k][None])
                t_try = t[k].copy()
                limit = float(np.abs(t).max()) + 1.0
                t_try[rest] = _global_refit(mu, g[k][rest], np.repeat(c_half, rest.size, 0),
                                            t[k][rest], limit)
                tb, cb, cost_b = polish_rows_exact(mu, g[k][None], t_try[None], c_half)
                if cost_b[0] < 0.5 * cost[k]:
                    t[k], C[k], cost[k] = tb[0], cb[0], cost_b[0]
                    probe_cost[k] = _probe_costs(mu, g[k][None], t[k][None], C[k][None])[0]
                    swaps += 1
                    changed = True
            # candidates: the probes fitting worst and those with the closest logits
            gaps = np.abs(t[k][:, :, None] - t[k][:, None, :]) + np.eye(H) * 1e300
            closest = np.argsort(gaps.min(axis=(1, 2)))[:SWAP_PROBES // 2]
            worst = np.argsort(-probe_cost[k])[:SWAP_PROBES // 2]
            probes = np.unique(np.concatenate([closest, worst]))
            S = len(probes) * len(orders)
            cand = np.repeat(t[k][None], S, axis=0)                      # (S, J, H)
            jj = np.repeat(probes, len(orders))
            cand[np.arange(S), jj] = t[k][jj[:, None], np.tile(orders, (len(probes), 1))]
            tt, cc, cc_cost = polish_rows_exact(mu, np.repeat(g[k][None], S, axis=0), cand,
                                                np.repeat(C[k][None], S, axis=0), iterations=12)
            cc_cost = np.where(np.isfinite(cc_cost), cc_cost, np.inf)
            best = int(np.argmin(cc_cost))
            tb, cb, cost_b = polish_rows_exact(mu, g[k][None], tt[best][None], cc[best][None])
            if cost_b[0] < 0.5 * cost[k]:
                t[k], C[k] = tb[0], cb[0]
                swaps += 1
                changed = True
        if not changed:
            break
    t, C, _ = polish_rows_exact(mu, g, t, C)
    cost = np.sum(_probe_costs(mu, g, t, C), axis=1)
    return t, C, cost, swaps

def _link_permutation(mu, g_link, t_a, c_a, t_b, c_b=None):
    """Permutation p of probe b's heads that explains a linked probe.

    The linked probe's pairs are (t_a + t_b[p], c_a + c_b[p]) (a sum of u's), or
    (t_a + t_b[p], c_a) with ``c_b`` None (a sum of q's, same u). Every assignment is
    scored by the residual of the samples ``g_link`` (R,) it predicts; the right one
    explains them to rounding. For H > 6 the assignment is built head by head instead.
    """
    from itertools import permutations
    H = t_a.shape[0]
    if H <= 6:
        perms = np.array(list(permutations(range(H))))
        tt = t_a[None] + t_b[perms]
        cc = c_a[None] + (c_b[perms] if c_b is not None else 0.0)
        fit, _ = _model_g(mu, tt, cc)
        return perms[int(np.argmin(np.sum((fit - g_link) ** 2, axis=1)))]
    # greedy: cost of pairing a's head h with b's head h' = residual change of that pair
    cost = np.empty((H, H))
    for h in range(H):
        for h2 in range(H):
            tt, cc = t_a.copy(), c_a.copy() + (0 if c_b is None else c_b.mean() * 0)
            tt[h] += t_b[h2]
            if c_b is not None:
                cc[h] += c_b[h2]
            fit, _ = _model_g(mu, tt[None], cc[None])
            cost[h, h2] = np.sum((fit[0] - g_link) ** 2)
    return linear_sum_assignment(np.nan_to_num(cost, nan=1e300, posinf=1e300))[1]


def _finish(oracle, model, H, d, breakdown, det, fit_info, notes, start, q0, bb0, seed,
            verify_tolerance, G):
    n_verify = verification_count(max(H, 1) * (d * d + d))
    recovery = oracle.queries - q0
    # Held-out tokens where the recovered scores are of order one, but no larger than
    # the probes reached (a diverged fit must not shrink them to nothing).
    reach = 2.0 * math.sqrt(max(G, 1e-300))
    scale = float(np.clip(token_scale(model), reach / 64, reach)) if model.heads else reach
    verification = verify_model(oracle, model, count=n_verify, seed=seed,
                                tolerance=verify_tolerance, scale=scale)
    breakdown = {**breakdown, "verification": n_verify}
    Hb = max(H, 1)
    details = {
        "method": "copy-count rational interpolation (paper 2)",
        "heads": H,
        "recovery queries": recovery,
        "paper-2 count": 4 * Hb * d * d - 2 * Hb + 1,
        "2Hd^2": 2 * Hb * d * d,
        "sequence lengths": (f"1 (v), detection up to {max(det.get('max_len', 0), 0) or '-'}, "
                             f"probes {sorted(set(_ratio_lengths(fit_info['ratios'])))}"
                             if fit_info else "1 (v), detection"),
        "logit scale": f"{G:.3g}",
        "output precision": det.get("precision", "float64"),
        "detection": "; ".join(f"scale {r['scale']:.3g}: rank {r['rank']} of {r['samples']} "
                               f"samples" for r in det["rounds"]),
    }
    if fit_info:
        details["polish residual rms"] = f"{fit_info['residual rms']:.2e}"
    report = Report(kind=MultiHeadAttention.kind, dim=d, queries=oracle.queries - q0,
                    breakdown={**{k: v for k, v in breakdown.items() if k != "verification"},
                               "recovery": recovery, "verification": n_verify},
                    floor=Hb * (d * d + d), verification=verification,
                    seconds=time.perf_counter() - start,
                    black_box_seconds=oracle.black_box_seconds - bb0, notes=notes,
                    details=details)
    return checked_result(model, report, f"multi-head attention with {H} canonical head(s) "
                                         f"(or the pole fit broke down)")
