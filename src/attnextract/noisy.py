"""Single-head extraction from noisy or rounded outputs, with honest error bars.

The black box answers y = f(X) + eta. Two noise models:

- ``bounded`` (paper 1, Theorem 6.1): |eta| <= tau + rho |f(X)|, possibly adversarial
  (rho covers rounding: 2^-24 for float32, 2^-11 for float16, 0.5e(1-k) for k digits).
  The error bar is a worst-case bound: it holds for every noise pattern within the
  tolerance, adversarial included.
- ``random``: independent zero-mean noise with standard deviation at most
  tau + rho |f(X)| (Gaussian noise; rounding errors of dithered probes). Repeated,
  dithered probes average it out; the error bar is a high-probability bound
  (``CONFIDENCE_SIGMAS`` standard deviations of a Gaussian-concentration tail).

Identity (ALGORITHMS.md, section 2): for the probe P(u, q) = [q + u; q],
f = v^T q + sigma(u^T W q) v^T u, so u^T W q = logit((f - v^T q) / (v^T u)).

Paper 1, Theorem 6.1 (method ``paper``, implemented as stated in ALGORITHMS.md,
section 5): with B >= ||W||_F and margin |v_i| >= mu, v_i = f([e_i]) and the probes
[e_i / B + e_j / 2; e_j / 2] give sigma(W_ij / (2B)); the weight is clipped to
[sigma(-1/2), sigma(1/2)] and inverted. Writing a = sigma(W_ij / 2B), the measured
weight obeys |a_hat - a| <= tau (1.5 B + 1) / mu, the logit is L = 1/(sigma(1/2)
sigma(-1/2)) ~ 4.26-Lipschitz on the clip interval, hence the bound reported beside it

    ||W_hat - W||_F <= 2 d B L tau (1.5 B + 1) / mu,    ||v_hat - v|| <= sqrt(d) tau

(our derivation of the constants; the paper's own constants are not at hand).

Default method ``robust``. Why the paper's probes waste accuracy: the signal v^T u =
v_i / B is small (and vanishes with v_i), and the logits W_ij / 2B are of order
1/(2d), so the weight barely moves. The robust design, at the same token norm:

- u ranges over an orthogonal basis with |u_k^T v_hat| = |v_hat| / sqrt(d) for every k
  (:func:`single_head.probe_basis`): no margin on v is needed;
- the probe P(c u_k, s e_j) has logit G u_k^T w_j with G = c s; (c, s) with c + s <= R
  (the token norm cap, default 1) minimise the predicted error for the logits seen so
  far (bigger c enlarges the signal c v^T u, bigger G the logit, saturation shrinks
  a(1 - a));
- with ``repeats`` r > 1 every column is measured in r different orthogonal bases
  U_r = U_0 R_r (R_r fixes (1, ..., 1), so |u^T v_hat| is unchanged) and solved by
  weighted least squares; v likewise in r bases. Repeats average random noise (and
  dithered rounding errors); they cannot beat adversarial noise, and the worst-case
  bar says so.

Error bar (bounded noise). Per probe, |a_hat - a| <= (b + (s + a_hat c) ||dv||) /
(c |u^T v_hat| (1 - kappa)) with b the output tolerance, dv the error of v_hat and
kappa = ||dv|| / |u^T v_hat|; the logit error is at most L_i |a_hat - a| with L_i the
largest 1/(a(1-a)) over that interval (mean value theorem). For the least-squares map
M_j of column j, ||dw_j|| <= ||M_j|| ||theta * b|| + ||M_j diag(theta) D_j|| ||dv||,
and Minkowski's inequality over columns gives the Frobenius bound. Random noise: the
same linearisation gives the covariance; the bar is sqrt(trace) + z sqrt(lambda_max).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import numpy as np

from .errors import InputError, ModelMismatchError, NotIdentifiableError
from .models import SingleHeadAttention, softmax
from .oracle import Oracle
from .report import (ExtractionResult, Report, Verification, held_out_sequences,
                     relative_errors, verification_count)
from .single_head import logit, probe_basis

NOISE_KINDS = ("bounded", "random")
METHODS = ("robust", "paper")
CONFIDENCE_SIGMAS = 4.0      # random noise: bar = sqrt(trace) + 4 sqrt(lambda_max), P(miss) < 4e-4
VERIFY_SIGMAS = 5.0          # random noise: a held-out answer may be off by 5 std
MODEL_SLACK = 1.5            # held-out answers: allowed model error = 1.5 x (gradient . bar)
SATURATED_LOGIT = 6.0        # measured |logit| beyond it (with a precise weight): probe smaller
CLIP_LOGIT = 12.0            # weights are clipped to [sigma(-12), sigma(12)] before inversion
MAX_RESCALES = 6
BLOCK_FLOATS = 1 << 20
FLOAT_SLACK = 8 * np.finfo(float).eps
PAPER_LIPSCHITZ = 1.0 / (0.25 - 0.25 * math.tanh(0.25) ** 2)   # 1 / (sigma(1/2) sigma(-1/2))


def sigmoid(x):
    """Logistic function, accurate for large |x| (via tanh)."""
    return 0.5 + 0.5 * np.tanh(0.5 * np.asarray(x, dtype=float))


@dataclass(frozen=True)
class NoiseModel:
    """What the outputs are accurate to: |eta| <= tolerance + relative_tolerance |f|.

    For ``kind="random"`` the same expression bounds the noise's standard deviation.
    """

    tolerance: float
    relative_tolerance: float = 0.0
    kind: str = "bounded"

    def __post_init__(self):
        for name in ("tolerance", "relative_tolerance"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float, np.floating)) and math.isfinite(value)
                    and value >= 0):
                raise InputError(f"{name} must be a finite number >= 0, got {value!r}")
        if self.relative_tolerance >= 0.5:
            raise InputError(f"relative_tolerance must be < 0.5, got {self.relative_tolerance}")
        if self.kind not in NOISE_KINDS:
            raise InputError(f"noise must be one of {NOISE_KINDS}, got {self.kind!r}")

    def bound(self, observed: np.ndarray) -> np.ndarray:
        """Per-answer bound on |eta| (or its std) given the observed answers, same shape.

        |f| <= |y| + |eta| gives |eta| <= (tau + rho |y|) / (1 - rho); a few ulps of
        the black box's own float64 arithmetic are added.
        """
        y = np.abs(observed)
        rho = self.relative_tolerance
        return (self.tolerance + rho * y) / (1.0 - rho) + FLOAT_SLACK * y


@dataclass
class NoisyVerification(Verification):
    """Held-out check against a noisy black box.

    Each answer may differ from the model's prediction by the noise bound plus the
    model's own uncertainty (its output gradient times the error bars, x MODEL_SLACK);
    ``worst_ratio`` is the largest |f_hat - y| / allowed. Passed when it is <= 1.
    ``tolerance`` shows the loosest per-sequence allowance as a relative error.
    """

    worst_ratio: float = 0.0

    @property
    def passed(self) -> bool:
        return bool(self.worst_ratio <= 1.0)


def random_orthogonal_fixing_ones(d: int, rng: np.random.Generator) -> np.ndarray:
    """A random orthogonal R (d, d) with R^T 1 = 1, so |(U R)^T v| stays |U^T v| for U = probe_basis(v)."""
    if d == 1:
        return np.ones((1, 1))
    ones = np.ones(d) / np.sqrt(d)
    # Householder reflection mapping e_1 to ones: its columns 2..d span ones' complement
    w = np.eye(d)[0] - ones
    H = np.eye(d) - 2.0 * np.outer(w, w) / (w @ w) if w @ w > 0 else np.eye(d)
    P = H[:, 1:]
    Q, Rq = np.linalg.qr(rng.standard_normal((d - 1, d - 1)))
    Q = Q * np.sign(np.diag(Rq))[None, :]
    return P @ Q @ P.T + np.outer(ones, ones)


def _check_options(tolerance, relative_tolerance, noise, repeats, norm_bound, margin, token_norm):
    model = NoiseModel(float(tolerance), float(relative_tolerance), noise)
    if not isinstance(repeats, (int, np.integer)) or repeats < 1:
        raise InputError(f"repeats must be a positive integer, got {repeats!r}")
    for name, value in (("norm_bound", norm_bound), ("margin", margin)):
        if value is not None and not (math.isfinite(float(value)) and float(value) > 0):
            raise InputError(f"{name} must be a finite number > 0, got {value!r}")
    if not (math.isfinite(float(token_norm)) and float(token_norm) > 0):
        raise InputError(f"token_norm must be a finite number > 0, got {token_norm!r}")
    return model


def extract_noisy(oracle: Oracle, *, tolerance: float, relative_tolerance: float = 0.0,
                  noise: str = "bounded", method: str = "robust", repeats: int = 1,
                  norm_bound: float | None = None, margin: float | None = None,
                  token_norm: float = 1.0, seed=None,
                  verify_tolerance: float = 0.0) -> ExtractionResult:
    """Recover (W, v) of a single head from noisy outputs, with Frobenius error bars.

    Parameters
    ----------
    oracle : Oracle
        Door to the black box (token width d = ``oracle.dim``).
    tolerance : float
        tau: answers are accurate to +-(tau + relative_tolerance |f|) (``bounded``), or
        that is their noise standard deviation (``random``).
    relative_tolerance : float
        rho, the relative part (rounding): 2^-24 float32, 2^-11 float16.
    noise : {"bounded", "random"}
        Worst-case (adversarial allowed) or independent zero-mean noise.
    method : {"robust", "paper"}
        The noise-aware default, or paper 1's Theorem 6.1 algorithm (needs norm_bound).
    repeats : int
        robust: measure every probe in this many dithered bases (r (d^2 + d) queries).
    norm_bound : float, optional
        B >= ||W||_F. Required by ``paper``; ``robust`` uses it to size its first probes.
    margin : float, optional
        mu <= min_i |v_i| (``paper``); by default the measured min |v_hat_i| minus its bar.
    token_norm : float
        R: no probe token is longer than R (the paper's probes have norm <= sqrt(1/4 + 1/B^2)).
    seed : int, optional
        Seed of the dithered bases and of the held-out verification sequences.
    verify_tolerance : float
        Extra relative slack allowed on held-out answers (on top of the noise bound).

    Returns
    -------
    ExtractionResult
        ``model`` SingleHeadAttention W (d, d), v (d,); ``report.details`` holds
        ``error_bar_W`` (bound on ||W_hat - W||_F), ``error_bar_v`` (on ||v_hat - v||_2),
        their relative forms, the noise model and the probe design.

    Raises
    ------
    InputError
        Invalid options (or ``paper`` without norm_bound).
    NotIdentifiableError
        v is indistinguishable from 0 at this noise level, or (``paper``) the margin
        condition mu > tau fails.
    ModelMismatchError
        Held-out answers disagree with the model beyond noise plus error bars, or the
        probes keep saturating; ``.result`` holds the best effort.
    BudgetExceededError
        The budget cannot cover the planned queries (raised before any query).
    """
    model_noise = _check_options(tolerance, relative_tolerance, noise, repeats, norm_bound,
                                 margin, token_norm)
    if method not in METHODS:
        raise InputError(f"method must be one of {METHODS}, got {method!r}")
    if method == "paper":
        if norm_bound is None:
            raise InputError("the paper's method (Theorem 6.1) needs norm_bound B >= ||W||_F")
        if repeats != 1:
            raise InputError("the paper's method makes one query per probe (repeats=1)")
        return _extract_paper(oracle, model_noise, float(norm_bound), margin, seed,
                              float(verify_tolerance))
    return _extract_robust(oracle, model_noise, int(repeats), norm_bound, float(token_norm),
                           seed, float(verify_tolerance))


# -- the robust default ----------------------------------------------------------

def _design(G_grid, R, m_pool, v_col, uv, noise: NoiseModel):
    """Pick (c, s) with c + s = R minimising the predicted error for logit slopes m_pool."""
    c = 0.5 * (R + np.sqrt(np.maximum(R * R - 4.0 * G_grid, 0.0)))
    s = G_grid / c
    t = G_grid[:, None] * m_pool[None, :]
    a = sigmoid(t)
    f = s[:, None] * v_col + a * c[:, None] * uv
    sd = noise.bound(f) + 1e-300
    with np.errstate(divide="ignore", over="ignore"):     # saturated designs cost inf
        err = sd / (c[:, None] * abs(uv) * a * (1.0 - a) * G_grid[:, None])
    best = int(np.argmin(np.sum(err ** 2, axis=1)))
    return float(c[best]), float(s[best])


def _probes(Us, cols, c, s):
    """Probes P(c u_k, s e_j), shape (r * len(cols) * d, 2, d), rounds outermost."""
    r, d = Us.shape[0], Us.shape[1]
    nb = len(cols)
    X = np.zeros((r, nb, d, 2, d))
    X[:, :, :, 0, :] = c * np.transpose(Us, (0, 2, 1))[:, None]
    slots = np.arange(nb)
    X[:, slots, :, 0, cols] += s
    X[:, slots, :, 1, cols] = s
    return X.reshape(r * nb * d, 2, d)


def _extract_robust(oracle, noise, r, norm_bound, R, seed, verify_tolerance):
    start, start_queries, start_bb = time.perf_counter(), oracle.queries, oracle.black_box_seconds
    d = oracle.dim
    n_verify = verification_count(d * d + d)
    oracle.plan(r * (d * d + d) + n_verify, "noisy single-head extraction")
    rng = np.random.default_rng(seed)

    # v: f([R o_k]) = R o_k^T v in r orthogonal bases (the identity first)
    bases = [np.eye(d)] + [np.linalg.qr(rng.standard_normal((d, d)))[0] for _ in range(r - 1)]
    A_v = R * np.concatenate([O.T for O in bases])                 # (r d, d)
    y_v = oracle.query(A_v[:, None, :])
    M_v = A_v.T / (r * R * R)                                      # = pinv(A_v): orthogonal blocks
    v = M_v @ y_v
    b_v = noise.bound(y_v)
    if noise.kind == "bounded":
        v_bar = float(np.linalg.norm(b_v) / (R * math.sqrt(r)))
        dv_norm = v_bar
        cov_v = None
    else:
        cov_v = (M_v * b_v[None, :] ** 2) @ M_v.T
        eig_v = np.linalg.eigvalsh(cov_v)
        v_bar = float(math.sqrt(max(eig_v.sum(), 0.0)) + CONFIDENCE_SIGMAS * math.sqrt(max(eig_v[-1], 0.0)))
        dv_norm = None
    # every probe's signal is u^T v_hat = +-|v_hat| / sqrt(d); it must stand clear of v's error
    if not np.any(v) or np.linalg.norm(v) / math.sqrt(d) <= 2.0 * v_bar:
        raise NotIdentifiableError(
            f"v is indistinguishable from 0 at this noise level (|v_hat| = {np.linalg.norm(v):.3g}, "
            f"its error bar {v_bar:.3g}, d = {d}): the outputs carry too little information "
            f"about W; lower the tolerance")
    U0 = probe_basis(v)
    Us = np.stack([U0] + [U0 @ random_orthogonal_fixing_ones(d, rng) for _ in range(r - 1)])
    uv = float(U0[:, 0] @ v)                                       # u^T v_hat, the same for every probe
    G_cap = R * R / 4.0
    G_grid = G_cap * np.geomspace(1e-12, 1.0, 241)
    quantiles = np.sqrt(2.0) * _erfinv(np.linspace(-0.98, 0.98, 64))
    m_pool = (norm_bound / d) * quantiles if norm_bound is not None else np.zeros(1)

    cs = np.empty((d, 2))                  # (c, s) of each column
    F = np.empty((r, d, d))                # answers F[round, k, column]
    block = max(1, min(d, BLOCK_FLOATS // (2 * r * d * d)))
    starts = [0] + list(range(1, d, block))
    rescaled = 0
    for b, lo in enumerate(starts):
        cols = np.arange(lo, min(d, lo + block) if b else 1)
        c, s = _design(G_grid, R, m_pool, np.abs(v[cols]).mean(), uv, noise)
        cs[cols] = (c, s)
        F[:, :, cols] = _measure(oracle, Us, v, uv, cols, cs).transpose(1, 2, 0)
        for _ in range(MAX_RESCALES):
            peak, precise = _saturation(F[:, :, cols], v, uv, cols, cs, noise)
            bad = (peak > SATURATED_LOGIT) & precise
            if not bad.any():
                break
            redo = cols[bad]
            G = cs[redo, 0] * cs[redo, 1]
            finite = np.isfinite(peak[bad])
            G = G * np.where(finite, 1.5 / np.where(finite, peak[bad], 1.0), 2.0 ** -10)
            cs[redo, 0] = 0.5 * (R + np.sqrt(np.maximum(R * R - 4.0 * G, 0.0)))
            cs[redo, 1] = G / cs[redo, 0]
            F[:, :, redo] = _measure(oracle, Us, v, uv, redo, cs).transpose(1, 2, 0)
            rescaled += r * d * len(redo)
        else:
            peak, precise = _saturation(F[:, :, cols], v, uv, cols, cs, noise)
            if ((peak > SATURATED_LOGIT) & precise).any():
                raise ModelMismatchError(
                    f"the black box is not a single-head attention regressor: after "
                    f"{MAX_RESCALES} rescalings some probes still imply attention weights "
                    f"outside (0, 1) or logits beyond {SATURATED_LOGIT}")
        a = _weights(F[0][:, cols], v, uv, cols, cs)
        G = cs[cols, 0] * cs[cols, 1]
        m_pool = np.concatenate([m_pool[m_pool != 0] if b else np.zeros(0),
                                 (logit(np.clip(a, sigmoid(-CLIP_LOGIT), sigmoid(CLIP_LOGIT)))
                                  / G[None, :]).ravel()])
        if m_pool.size > 2048:
            m_pool = rng.choice(m_pool, 2048, replace=False)
        if not m_pool.size:
            m_pool = np.zeros(1)

    W, W_bar, logit_range = _solve(Us, F, v, uv, cs, noise, dv_norm, cov_v)
    model = SingleHeadAttention(W, v)
    recovery = oracle.queries - start_queries
    details = _bar_details(model, W_bar, v_bar, noise)
    G = cs[:, 0] * cs[:, 1]
    details.update({
        "method": f"robust (noise-aware probes, {r} basis/bases per column, least squares)",
        "probe design": f"token norm <= {R:.3g}; c = {cs[:, 0].min():.3g}..{cs[:, 0].max():.3g}, "
                        f"logit scale G = cs = {G.min():.3g}..{G.max():.3g}; logits "
                        f"{logit_range[0]:.3g}..{logit_range[1]:.3g}; |v^T u| = {abs(uv):.3g}",
    })
    return _finish(oracle, model, noise, W_bar, v_bar, n_verify, seed, verify_tolerance, R,
                   start, start_queries, start_bb,
                   {"recovery": r * (d * d + d), "rescaling": rescaled, "verification": n_verify},
                   details, recovery)


def _measure(oracle, Us, v, uv, cols, cs):
    """Answers for the probes of ``cols`` in every basis, shape (len(cols), r, d)."""
    r, d = Us.shape[0], Us.shape[1]
    out = np.empty((len(cols), r, d))
    # columns sharing (c, s) (a whole block, unless some were rescaled) go in one batch
    keys = {}
    for pos, j in enumerate(cols):
        keys.setdefault((cs[j, 0], cs[j, 1]), []).append(pos)
    for (c, s), positions in keys.items():
        group = np.asarray(positions)
        f = oracle.query(_probes(Us, cols[group], c, s)).reshape(r, len(group), d)
        out[group] = f.transpose(1, 0, 2)
    return out


def _weights(F_cols, v, uv, cols, cs):
    """Attention weights a = (f - s v_j) / (c u^T v_hat), same shape as F_cols (..., d, len(cols))."""
    c, s = cs[cols, 0], cs[cols, 1]
    return (F_cols - s * v[cols]) / (c * uv)


def _saturation(F_cols, v, uv, cols, cs, noise):
    """Per column: largest measured |logit| (inf if a weight left (0, 1)), and whether
    the weights are precise enough (noise bound < 1%) for that to mean saturation."""
    a = _weights(F_cols, v, uv, cols, cs)
    with np.errstate(divide="ignore", invalid="ignore"):
        t = np.where((a > 0) & (a < 1), np.abs(logit(np.clip(a, 1e-300, 1.0))), np.inf)
    peak = t.reshape(-1, len(cols)).max(axis=0)
    spread = noise.bound(F_cols) / (cs[cols, 0] * abs(uv))
    precise = spread.reshape(-1, len(cols)).max(axis=0) < 0.01
    return peak, precise


def _solve(Us, F, v, uv, cs, noise, dv_norm, cov_v):
    """Weighted least squares per column and the Frobenius error bar of W."""
    r, d = Us.shape[0], Us.shape[1]
    a_lo, a_hi = sigmoid(-CLIP_LOGIT), sigmoid(CLIP_LOGIT)
    c, s = cs[:, 0], cs[:, 1]
    G = c * s
    W = np.empty((d, d))
    A = np.concatenate([U.T for U in Us])             # (r d, d): row (round, k) is u_{r,k}^T
    kappa = (dv_norm / abs(uv)) if dv_norm is not None else 0.0
    if kappa >= 1.0:
        kappa_factor = math.inf
    else:
        kappa_factor = 1.0 / (1.0 - kappa)
    eta_sq, dv_sq = 0.0, 0.0         # bounded: sums of squared per-column bounds
    trace, lam_eta = 0.0, 0.0        # random: trace and largest eigenvalue of the eta part
    J = np.empty((d, d, d)) if cov_v is not None else None
    lo_logit, hi_logit = math.inf, -math.inf
    for j in range(d):
        f = F[:, :, j].reshape(-1)                               # (r d,)
        a_raw = (f - s[j] * v[j]) / (c[j] * uv)
        a = np.clip(a_raw, a_lo, a_hi)
        t = logit(a)
        lo_logit, hi_logit = min(lo_logit, t.min()), max(hi_logit, t.max())
        y = t / G[j]
        b = noise.bound(f) + FLOAT_SLACK * (s[j] * abs(v[j]) + c[j] * abs(uv))
        theta = 1.0 / (c[j] * abs(uv) * a * (1.0 - a) * G[j])   # W-units per unit of output error
        if noise.kind == "bounded":
            delta = (b + (s[j] + a * c[j]) * dv_norm) * kappa_factor / (c[j] * abs(uv))
            ends = np.stack([np.clip(a - delta, a_lo, a_hi), np.clip(a + delta, a_lo, a_hi)])
            L = (1.0 / (ends * (1.0 - ends))).max(axis=0)
            theta_bar = L * kappa_factor / (c[j] * abs(uv) * G[j])
        else:
            theta_bar = theta
        weight = 1.0 / (theta * b) ** 2
        if r == 1:
            M = Us[0]                                             # A = U^T is orthogonal
        else:
            Aw = A * weight[:, None]
            M = np.linalg.solve(A.T @ Aw, Aw.T)                   # (d, r d)
        W[:, j] = M @ y
        D = (s[j] * np.eye(d)[j])[None, :] + (a * c[j])[:, None] * A   # d(numerator)/d(dv), (r d, d)
        MD = M @ (theta_bar[:, None] * D)
        if noise.kind == "bounded":
            norm_M = 1.0 if r == 1 else np.linalg.norm(M, 2)
            eta_sq += (norm_M * np.linalg.norm(theta_bar * b)) ** 2
            dv_sq += np.linalg.norm(MD, 2) ** 2
        else:
            C = (M * (theta * b)[None, :] ** 2) @ M.T
            eig = np.linalg.eigvalsh(C)
            trace += eig.sum()
            lam_eta = max(lam_eta, eig[-1])
            J[j] = MD
    if noise.kind == "bounded":
        W_bar = math.sqrt(eta_sq) + dv_norm * math.sqrt(dv_sq)
        if not math.isfinite(kappa_factor):
            W_bar = math.inf
    else:
        Jall = J.reshape(d * d, d)
        lam, Q = np.linalg.eigh(cov_v)                       # cov_v = S S^T, S = Q sqrt(lam)
        S = Q * np.sqrt(np.maximum(lam, 0.0))[None, :]
        eig_v = np.linalg.eigvalsh(S.T @ (Jall.T @ Jall) @ S)   # spectrum of J cov_v J^T
        W_bar = math.sqrt(max(trace + eig_v.sum(), 0.0)) + CONFIDENCE_SIGMAS * math.sqrt(
            max(lam_eta, 0.0) + max(eig_v[-1], 0.0))
    return W, float(W_bar), (lo_logit, hi_logit)


def _erfinv(x):
    from scipy.special import erfinv
    return erfinv(x)


# -- paper 1, Theorem 6.1 ------------------------------------------------------------

def paper_bound(d: int, tau: float, norm_bound: float, margin: float) -> tuple[float, float]:
    """Theorem 6.1's error bounds (our constants): (||W_hat - W||_F, ||v_hat - v||) bounds."""
    if margin <= tau:
        return math.inf, math.sqrt(d) * tau
    B = norm_bound
    return (2.0 * d * B * PAPER_LIPSCHITZ * tau * (1.5 * B + 1.0) / margin, math.sqrt(d) * tau)


def _extract_paper(oracle, noise, B, margin, seed, verify_tolerance):
    start, start_queries, start_bb = time.perf_counter(), oracle.queries, oracle.black_box_seconds
    d = oracle.dim
    n_verify = verification_count(d * d + d)
    oracle.plan(d * d + d + n_verify, "Theorem 6.1 extraction (d^2 + d + verification)")
    eye = np.eye(d)
    v = oracle.query(eye[:, None, :])
    b_v = noise.bound(v)
    tau = float(b_v.max())
    if noise.kind == "random":
        tau *= CONFIDENCE_SIGMAS
    mu = float(margin) if margin is not None else float(np.min(np.abs(v)) - tau)
    if mu <= tau:
        raise NotIdentifiableError(
            f"Theorem 6.1 needs a margin min|v_i| = mu > tau; here mu = {mu:.3g}, "
            f"tau = {tau:.3g} (use the robust method, which needs no margin)")
    lo, hi = sigmoid(-0.5), sigmoid(0.5)
    W = np.empty((d, d))
    block = max(1, min(d, BLOCK_FLOATS // (2 * d * d)))
    answers = []
    for j0 in range(0, d, block):
        cols = np.arange(j0, min(d, j0 + block))
        X = np.zeros((len(cols), d, 2, d))               # X[j, i] = [e_i / B + e_j / 2; e_j / 2]
        X[:, :, 0, :] = eye[None] / B
        X[np.arange(len(cols)), :, 0, cols] += 0.5
        X[np.arange(len(cols)), :, 1, cols] = 0.5
        f = oracle.query(X.reshape(-1, 2, d)).reshape(len(cols), d)
        answers.append(f)
        a = (f - 0.5 * v[cols][:, None]) * B / v[None, :]
        W[:, cols] = (2.0 * B * logit(np.clip(a, lo, hi))).T
    tau_all = max(tau, float(noise.bound(np.concatenate(answers).ravel()).max())
                  * (CONFIDENCE_SIGMAS if noise.kind == "random" else 1.0))
    W_bar, v_bar = paper_bound(d, tau_all, B, mu)
    model = SingleHeadAttention(W, v)
    details = _bar_details(model, W_bar, v_bar, noise)
    details.update({
        "method": f"paper 1, Theorem 6.1 (B = {B:.4g}, mu = {mu:.4g}, clip to "
                  f"[sigma(-1/2), sigma(1/2)])",
        "error bar source": "Theorem 6.1: 2 d B L tau (1.5 B + 1) / mu, L = 4.26; sqrt(d) tau",
    })
    return _finish(oracle, model, noise, W_bar, v_bar, n_verify, seed, verify_tolerance,
                   math.sqrt(0.25 + 1.0 / B ** 2), start, start_queries, start_bb,
                   {"recovery": d * d + d, "rescaling": 0, "verification": n_verify},
                   details, oracle.queries - start_queries)


# -- shared: report and verification ---------------------------------------------------

def _bar_details(model, W_bar, v_bar, noise):
    W_norm, v_norm = np.linalg.norm(model.W), np.linalg.norm(model.v)
    kind = ("worst case over |eta| <= tau + rho|f| (adversarial included)"
            if noise.kind == "bounded" else
            f"independent noise, std <= tau + rho|f|; bars hold with probability ~ 1 - 4e-4")
    return {
        "noise": f"{noise.kind}: tau = {noise.tolerance:.3g}, rho = {noise.relative_tolerance:.3g}; {kind}",
        "error_bar_W": float(W_bar),
        "error_bar_v": float(v_bar),
        "error_bar_W_relative": float(W_bar / W_norm) if W_norm > 0 else math.inf,
        "error_bar_v_relative": float(v_bar / v_norm) if v_norm > 0 else math.inf,
    }


def output_gradient_norms(model: SingleHeadAttention, X: np.ndarray):
    """||df/dW||_F and ||df/dv|| of the model at a batch X (B, N, d); each (B,)."""
    scores = np.einsum("bnd,bd->bn", X, X[:, -1, :] @ model.W.T)
    alpha = softmax(scores)
    values = X @ model.v
    f = np.einsum("bn,bn->b", alpha, values)
    grad_v = np.einsum("bn,bnd->bd", alpha, X)
    spread = np.einsum("bn,bnd->bd", alpha * (values - f[:, None]), X)
    grad_W = np.linalg.norm(spread, axis=1) * np.linalg.norm(X[:, -1, :], axis=1)
    return f, grad_W, np.linalg.norm(grad_v, axis=1)


def verify_noisy(oracle, model, noise: NoiseModel, W_bar, v_bar, *, count, seed, scale,
                 extra_relative=0.0) -> NoisyVerification:
    """Held-out comparison allowing noise plus the model's own error bars."""
    rng = np.random.default_rng(seed)
    sequences = held_out_sequences(oracle.dim, count, rng, scale)
    observed = oracle.query_ragged(sequences)
    predicted, gW, gv = np.empty(count), np.empty(count), np.empty(count)
    lengths = np.array([len(s_) for s_ in sequences])
    for n in np.unique(lengths):
        idx = np.flatnonzero(lengths == n)
        predicted[idx], gW[idx], gv[idx] = output_gradient_norms(
            model, np.stack([sequences[i] for i in idx]))
    rel = relative_errors(predicted, observed)
    rms = math.sqrt(float(np.mean(observed ** 2)))
    denom = np.maximum(np.abs(observed), max(rms, np.finfo(float).tiny))
    sigmas = VERIFY_SIGMAS if noise.kind == "random" else 1.0
    allowed = (sigmas * noise.bound(observed) + MODEL_SLACK * (gW * W_bar + gv * v_bar)
               + extra_relative * denom + FLOAT_SLACK * 16 * denom)
    ratio = np.abs(predicted - observed) / allowed
    return NoisyVerification(sequences=count, max_relative_error=float(rel.max()),
                             median_relative_error=float(np.median(rel)),
                             tolerance=float(np.max(allowed / denom)),
                             worst_ratio=float(ratio.max()))


def _finish(oracle, model, noise, W_bar, v_bar, n_verify, seed, verify_tolerance, token_norm,
            start, start_queries, start_bb, breakdown, details, recovery):
    d = model.dim
    verification = verify_noisy(oracle, model, noise, W_bar, v_bar, count=n_verify, seed=seed,
                                scale=token_norm / math.sqrt(d), extra_relative=verify_tolerance)
    details["verification bound"] = (
        f"max |f_hat - y| / allowed = {verification.worst_ratio:.3g} (passes at <= 1; allowed = "
        f"noise bound{' x 5' if noise.kind == 'random' else ''} + {MODEL_SLACK} x output "
        f"gradient . error bars)")
    report = Report(kind=SingleHeadAttention.kind, dim=d, queries=oracle.queries - start_queries,
                    breakdown=breakdown, floor=d * d + d, verification=verification,
                    seconds=time.perf_counter() - start,
                    black_box_seconds=oracle.black_box_seconds - start_bb, details=details)
    assert recovery == breakdown["recovery"] + breakdown["rescaling"]
    result = ExtractionResult(model=model, queries=report.queries, report=report)
    if not verification.passed:
        raise ModelMismatchError(
            f"held-out answers disagree with the extracted model beyond the noise bound plus "
            f"the error bars ({verification.worst_ratio:.3g} x the allowance): the black box "
            f"is not a single-head attention regressor with outputs accurate to the given "
            f"tolerance", result=result)
    return result
