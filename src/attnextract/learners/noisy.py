"""Single-head extraction from noisy or rounded outputs, with honest error bars.

The black box answers y = f(X) + eta. Two noise models:

- ``bounded`` (the single-head paper, Theorem 6.1): |eta| <= tau + rho |f(X)|, possibly adversarial
  (rho covers rounding: 2^-24 for float32, 2^-11 for float16, 0.5e(1-k) for k digits).
  The error bar is a worst-case bound: it holds for every noise pattern within the
  tolerance, adversarial included.
- ``random``: independent zero-mean noise with standard deviation at most
  tau + rho |f(X)| (Gaussian noise; rounding errors of dithered probes). Repeated,
  dithered probes average it out; the error bar is a high-probability bound
  (``CONFIDENCE_SIGMAS`` standard deviations of a Gaussian-concentration tail).

Identity (docs/algorithms.md, "Noisy outputs"): for the probe P(u, q) = [q + u; q],
f = v^T q + sigma(u^T W q) v^T u, so u^T W q = logit((f - v^T q) / (v^T u)).

Paper 1, Theorem 6.1 (method ``paper``, implemented as the paper states it;
see docs/algorithms.md): with B >= ||W||_F and margin |v_i| >= mu, v_i = f([e_i]) and the probes
[e_i / B + e_j / 2; e_j / 2] give sigma(W_ij / (2B)); the weight is clipped to
[sigma(-1/2), sigma(1/2)] and inverted. Writing a = sigma(W_ij / 2B), the measured
weight obeys |a_hat - a| <= tau (1.5 B + 1) / mu, the logit is L = 1/(sigma(1/2)
sigma(-1/2)) ~ 4.26-Lipschitz on the clip interval, hence the bound reported beside it

    ||W_hat - W||_F <= 2 d B L tau (1.5 B + 1) / mu,    ||v_hat - v|| <= sqrt(d) tau

(our derivation of the constants; the paper's own constants are not at hand).

Default method ``robust``. Why the paper's probes waste accuracy: the signal v^T u =
v_i / B is small (and vanishes with v_i), and the logits W_ij / 2B are of order
1/(2d), so the weight barely moves. The robust design, at the same token norm R
(default 1) and the same d^2 + d queries:

- u ranges over an orthogonal basis U with |u_k^T v_hat| = |v_hat| / sqrt(d) for every k
  (:func:`single_head.probe_basis`): no margin on v is needed; it measures
  T = U^T W U (||W_hat - W||_F = ||T_hat - T||_F, U orthogonal);
- diagonal probes [R u_k; -b u_k] (u = (R + b) u_k, logit -(R + b) b T_kk) and
  off-diagonal probes [a u_k + s u_j; -b u_k + s u_j] (logit (a + b)(s T_kj - b T_kk),
  the known T_kk subtracted): both tokens may point in opposite directions, so the
  difference u, which carries the signal (a + b) u^T v, is up to twice the token norm.
  (a, b, s), a^2 + s^2 <= R^2, minimise the predicted error for the logits seen so far
  (signal, logit size, saturation a(1 - a), relative noise, and the error inherited
  from T_kk); big W gets b ~ 0, s small (a lopsided probe), small W a symmetric one;
- with ``repeats`` r > 1, T is measured in r bases U_r = U_0 R_r (R_r fixes
  (1, ..., 1), so |u^T v_hat| is unchanged) and the W estimates are averaged; v likewise
  in r bases. Repeats average random noise (and dithered rounding errors); they cannot
  beat adversarial noise, and the worst-case bar says so.

Error bar (bounded noise). For a probe [x_1; x_2] with u = x_1 - x_2 the measured weight
obeys a_hat - a = (eta - g^T dv) / (v^T u), g = x_2 + a_hat u, dv the error of v_hat;
|v^T u| >= |v_hat^T u| (1 - kappa), kappa = ||dv|| / |u_k^T v_hat|. The logit error is at
most L |a_hat - a| with L the largest 1/(a(1-a)) on the interval the weight can lie in
(mean value theorem). Entry by entry this bounds |dT_kj| by a term in |eta| and one
linear in |dv|; the first gives a Frobenius bound directly, the second through the
largest singular value of the (sparse) map |dv| -> |dT|. Random noise: the same
linearisation gives the covariance of W_hat; the bar is sqrt(trace) + 4 sqrt(lambda_max)
(Gaussian concentration of a norm).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace

import numpy as np

from ..errors import InputError, ModelMismatchError, NotIdentifiableError
from ..models import SingleHeadAttention, softmax
from ..oracle import (
    QueryAccess,
    ScaledOutputs,
    by_length,
    evaluate_ragged,
    on_scaled_outputs,
    root_oracle,
)
from ..report import ExtractionResult, Report, Verification, verification_count
from ..verification import (
    BATCH_BIG_MIN,
    BATCH_REASKS,
    BATCH_SMALL,
    batch_dependence,
    design,
    max_length_of,
    output_scale,
    reask_in_other_batches,
    safe_norm,
    scaled_relative_errors,
    token_norms,
)
from .single_head import logit, probe_basis

NOISE_KINDS = ("bounded", "random")
ERROR_BARS = ("model", "measured")
METHODS = ("robust", "paper")
CONFIDENCE_SIGMAS = 4.0      # random noise: bar = sqrt(trace) + 4 sqrt(lambda_max), P(miss) < 4e-4
VERIFY_SIGMAS = 5.0          # random noise: a held-out answer may be off by 5 std
MODEL_SLACK = 1.5            # held-out answers: allowed model error = 1.5 x (gradient . bar)
SPREAD_SAMPLES = 32          # measured bars: models within the bars sampled for the allowance
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
    forward: bool = False     # rounding of a whole forward pass (see extract_low_precision)
    # forward passes: unit roundoff of the sums over the sequence (ACCUMULATION_UNIT)
    accumulation: float = 0.0
    # a ScaledOutputs view the answers come through: ``tolerance`` is in the black box's
    # units, the answers bound() sees in the view's (divided by its factor 2^k)
    unit: ScaledOutputs | None = field(default=None, compare=False, repr=False)

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
        tau = self.tolerance if self.unit is None else self.tolerance / self.unit.factor
        return (tau + rho * y) / (1.0 - rho) * (1.0 + FLOAT_SLACK) + FLOAT_SLACK * y


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
        return bool(self.worst_ratio <= 1.0 and not self.batch_dependence)


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


# Relative noise level assumed for the probe design and the held-out allowance of a
# forward pass in each dtype (a few units of roundoff: measured errors of torch heads
# relative to the output scale are ~2e-6 float32, ~3e-2 bfloat16, ~5e-3 float16). The
# error bars do not use them: they come from the spread of the repeats.
FORWARD_RHO = {"float32": 64 * 2.0 ** -24, "bfloat16": 2 * 2.0 ** -8, "float16": 4 * 2.0 ** -11}
# The two sums over the N tokens of a sequence (the softmax's normaliser and the
# attention-weighted sum of the values) round once per token: a long sequence's answer
# is off by up to gamma_{N-1} = (N - 1) u times the magnitudes summed (first order, for
# any summation order; Higham, "Accuracy and Stability of Numerical Algorithms", 4.2),
# which no per-answer level states: float32 answers to 4096 repeated tokens are off by
# up to 1.0e-4 relative (a one-off run, in the git history). u is the unit roundoff of
# the accumulator: float32 for bfloat16 and float16 forward passes too (torch accumulates
# their reductions in float32; a box that accumulates in bfloat16 is off by up to N 2^-8
# and is not described by output_dtype). Used by the held-out allowance only.
ACCUMULATION_UNIT = {"float32": 2.0 ** -24, "bfloat16": 2.0 ** -24, "float16": 2.0 ** -24}
LOW_PRECISION_REPEATS = 4


def extract_low_precision(oracle: QueryAccess, *, output_dtype: str | None = None,
                          decimals: int | None = None, repeats: int = LOW_PRECISION_REPEATS,
                          seed=None, verify_tolerance: float = 0.0,
                          token_norm: float = 1.0) -> ExtractionResult:
    """Single head from a black box run in low precision or rounded to k decimals.

    A forward pass in float32 or bfloat16 is off from float64 by the rounding of every
    token, score and value, up to ~1e-3 relative of the output in float32 (and more
    where attention is near one-hot), not by one rounding of the output, so no
    ``relative_tolerance`` states it. Here the probes are measured in ``repeats``
    dithered bases and the error bars come from the spread of the repeats
    (:func:`measured_bars`, ``error_bars="measured"``).

    Parameters
    ----------
    output_dtype : {"float32", "bfloat16", "float16"}, optional
        The dtype of the black box's forward pass.
    decimals : int, optional
        The outputs are rounded to this many decimals (|error| <= 0.5 10^-k).
    repeats : int
        Dithered repeats (>= 3); (d^2 + d) queries each.

    Returns
    -------
    ExtractionResult
        As :func:`extract_noisy`; ``details["error_bar_W"]`` is the measured bar.
    """
    if (output_dtype is None) == (decimals is None):
        raise InputError("give one of output_dtype= (float32, bfloat16, float16) or decimals=")
    if output_dtype is not None:
        if output_dtype not in FORWARD_RHO:
            raise InputError(f"output_dtype must be one of {sorted(FORWARD_RHO)}, got {output_dtype!r}")
        noise = NoiseModel(0.0, FORWARD_RHO[output_dtype], "random", forward=True,
                           accumulation=ACCUMULATION_UNIT[output_dtype])
    else:
        if not isinstance(decimals, (int, np.integer)) or decimals < 0:
            raise InputError(f"decimals must be an integer >= 0, got {decimals!r}")
        noise = NoiseModel(0.5 * 10.0 ** -int(decimals), 0.0, "random")
    if not isinstance(repeats, (int, np.integer)) or repeats < 3:
        raise InputError(f"measured error bars need repeats >= 3, got {repeats!r}")
    return _extract_robust(oracle, noise, int(repeats), None, float(token_norm), seed,
                           float(verify_tolerance), "measured")


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


def extract_noisy(oracle: QueryAccess, *, tolerance: float, relative_tolerance: float = 0.0,
                  noise: str = "bounded", method: str = "robust", repeats: int = 1,
                  norm_bound: float | None = None, margin: float | None = None,
                  token_norm: float = 1.0, seed=None,
                  verify_tolerance: float = 0.0, error_bars: str = "model") -> ExtractionResult:
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
        The noise-aware default, or the single-head paper's Theorem 6.1 algorithm (needs norm_bound).
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
    error_bars : {"model", "measured"}
        ``model``: bars derived from the noise model (tolerance, relative_tolerance).
        ``measured`` (robust, repeats >= 3): bars from the spread of the repeats
        (:func:`measured_bars`); the noise model then only shapes the probes and the
        held-out allowance. For forward passes in low precision, where no output
        bound is known (:func:`extract_low_precision`).

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
    if error_bars not in ERROR_BARS:
        raise InputError(f"error_bars must be one of {ERROR_BARS}, got {error_bars!r}")
    if error_bars == "measured" and repeats < 3:
        raise InputError("measured error bars need repeats >= 3 (the spread of the repeats)")
    # a box outside the class can drive the probe design to overflow; the result is then
    # refused (non-finite W or error bars), without warnings on the way
    def learn(view):
        # on answers rescaled to order one (exactly, by a power of two): outputs of 1e-300
        # underflowed in the error bars; the noise bound follows the view's units
        def bar_back(result):
            if result is not None and view.exponent:
                details = result.report.details
                details["error_bar_v"] = details["error_bar_v"] * view.factor
            return result

        with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
            try:
                return bar_back(_extract_robust(
                    view, replace(model_noise, unit=view), int(repeats), norm_bound,
                    float(token_norm), seed, float(verify_tolerance), error_bars))
            except ModelMismatchError as exc:
                bar_back(exc.result)
                raise

    return on_scaled_outputs(oracle, learn)


# -- the robust default ----------------------------------------------------------

DESIGN_SAMPLES = 64          # logit slopes sampled to score a probe design


@dataclass
class _Round:
    """One full measurement of T = U^T W U in one orthogonal basis U.

    Per probe (k, j) (the diagonal ones at k = j): the clipped weight ``a``, the output
    bound ``b``, v_hat^T u (``vu``), the logit coefficient ``coef`` of T_kj, and the
    components of g = x_2 + a u along u_k (``gk``) and u_j (``gj``): the output error
    of the probe is eta - g^T dv. Off-diagonal estimates carry + c_j dT_kk (``c``).
    """

    T: np.ndarray
    a: np.ndarray
    b: np.ndarray
    vu: np.ndarray
    coef: np.ndarray
    gk: np.ndarray
    gj: np.ndarray
    c: np.ndarray
    beta_d: np.ndarray
    alpha: np.ndarray
    beta: np.ndarray
    side: np.ndarray
    rescaled: int
    logits: tuple


def _extract_robust(oracle, noise, r, norm_bound, R, seed, verify_tolerance, error_bars="model"):
    start, start_queries, start_bb = time.perf_counter(), oracle.queries, oracle.black_box_seconds
    d = oracle.dim
    n_verify = verification_count(d * d + d, r * (d * d + d))   # within 5% of the recovery
    oracle.plan(r * (d * d + d) + n_verify, "noisy single-head extraction")
    rng = np.random.default_rng(seed)

    # v: f([R o_k]) = R o_k^T v in r orthogonal bases (the identity first)
    bases_v = [np.eye(d)] + [np.linalg.qr(rng.standard_normal((d, d)))[0] for _ in range(r - 1)]
    A_v = R * np.concatenate([O.T for O in bases_v])               # (r d, d)
    y_v = oracle.query(A_v[:, None, :])
    M_v = A_v.T / (r * R * R)                                      # = pinv(A_v): orthogonal blocks
    v = M_v @ y_v
    b_v = noise.bound(y_v)
    if noise.kind == "bounded":
        v_bar = float(safe_norm(b_v) / (R * math.sqrt(r)))
        dv_norm, cov_v = v_bar, None
    else:
        cov_v = (M_v * b_v[None, :] ** 2) @ M_v.T
        eig_v = np.linalg.eigvalsh(cov_v)
        v_bar = float(math.sqrt(max(eig_v.sum(), 0.0))
                      + CONFIDENCE_SIGMAS * math.sqrt(max(eig_v[-1], 0.0)))
        dv_norm = v_bar
    # every probe's signal is u^T v_hat = +-|u| |v_hat| / sqrt(d); it must stand clear of v's error
    if not np.any(v) or safe_norm(v) / math.sqrt(d) <= 2.0 * v_bar:
        raise NotIdentifiableError(
            f"v is indistinguishable from 0 at this noise level (|v_hat| = {safe_norm(v):.3g}, "
            f"its error bar {v_bar:.3g}, d = {d}): the outputs carry too little information "
            f"about W; lower the tolerance")

    U0 = probe_basis(v)
    uv = float(U0[:, 0] @ v)                                       # u_k^T v_hat, the same for every k
    bases = [U0] + [U0 @ random_orthogonal_fixing_ones(d, rng) for _ in range(r - 1)]
    if norm_bound is not None:
        prior = (norm_bound / d) * math.sqrt(2.0) * _erfinv(np.linspace(-0.98, 0.98, 64))
    else:
        prior = np.zeros(1)
    rounds = []
    for U in bases:
        rounds.append(_measure_round(oracle, U, v, uv, R, noise, prior, rng))
        prior = rng.choice(rounds[0].T.ravel(), min(d * d, DESIGN_SAMPLES), replace=False)
    W_samples = np.array([U @ rd.T @ U.T for U, rd in zip(bases, rounds)])
    W = W_samples.mean(axis=0)
    if not np.all(np.isfinite(W)):
        raise ModelMismatchError("the probes' answers give no finite W: the black box is not "
                                 "a single-head attention regressor within the tolerance")
    measured = None
    if error_bars == "measured":
        v_samples = np.array([O @ y_v[i * d:(i + 1) * d] / R for i, O in enumerate(bases_v)])
        W_bar, v_bar, measured = measured_bars(W_samples, v_samples, _v_jacobian(bases, rounds))
    elif noise.kind == "bounded":
        W_bar = float(np.mean([_bounded_bar(rd, uv, dv_norm) for rd in rounds]))
    else:
        W_bar = _random_bar(bases, rounds, cov_v)
    model = SingleHeadAttention(W, v)
    rescaled = sum(rd.rescaled for rd in rounds)
    recovery = oracle.queries - start_queries
    details = _bar_details(model, W_bar, v_bar, noise)
    if measured is not None:
        details["error bar source"] = (
            f"measured: spread of {r} independent repeats (dithered bases), upper "
            f"{1 - MEASURED_MISS:.1%} confidence on the variance, {1 - MEASURED_MISS:.1%} "
            f"quantile of the error; the noise model only shaped the probes")
        details.update(measured)
    lo = min(rd.logits[0] for rd in rounds)
    hi = max(rd.logits[1] for rd in rounds)
    rd = rounds[0]
    details.update({
        "method": f"robust (symmetric probes in {r} orthogonal basis/bases, error bars from "
                  f"the probe design)",
        "probe design": f"token norm <= {R:.3g}; diagonal [R u_k; -b u_k], b = "
                        f"{rd.beta_d.min():.3g}..{rd.beta_d.max():.3g}; off-diagonal "
                        f"[a u_k + s u_j; -b u_k + s u_j], a = {rd.alpha.min():.3g}..{rd.alpha.max():.3g}, "
                        f"b = {rd.beta.min():.3g}..{rd.beta.max():.3g}, s = {rd.side.min():.3g}.."
                        f"{rd.side.max():.3g}; logits {lo:.3g}..{hi:.3g}; |v^T u_k| = {abs(uv):.3g}",
    })
    return _finish(oracle, model, noise, W_bar, v_bar, n_verify, seed, verify_tolerance, R,
                   start, start_queries, start_bb,
                   {"recovery": r * (d * d + d), "rescaling": rescaled, "verification": n_verify},
                   details, recovery, nonlinear=measured is not None)


def _design_diagonal(R, m, uv, noise):
    """beta for the probes [R u_k; -beta u_k] (logit -(R + beta) beta m, signal (R + beta) u^T v)."""
    beta = R * np.geomspace(1e-9, 1.0, 91)[:, None]
    span = R + beta
    t = -span * beta * m[None, :]
    a = sigmoid(t)
    f = -beta * uv + a * span * uv
    with np.errstate(divide="ignore", over="ignore"):
        err = noise.bound(f) / (span * abs(uv) * a * (1.0 - a) * span * beta)
    return float(beta[int(np.argmin(np.mean(err ** 2, axis=1))), 0])


def _design_offdiagonal(R, m, dk, sig_k, uv, noise):
    """(alpha, beta, s) for [alpha u_k + s u_j; -beta u_k + s u_j], alpha = sqrt(R^2 - s^2):
    logit (alpha + beta)(s m - beta dk), signal (alpha + beta) u^T v."""
    side = R * np.geomspace(1e-9, 0.999, 37)
    frac = np.concatenate([[0.0], np.geomspace(1e-6, 1.0, 24)])
    S, Fr = np.meshgrid(side, frac, indexing="ij")
    alpha = np.sqrt(R * R - S ** 2)
    beta = Fr * alpha
    side, alpha, beta = S.ravel()[:, None], alpha.ravel()[:, None], beta.ravel()[:, None]
    span = alpha + beta
    t = span * (side * m[None, :] - beta * dk[None, :])
    a = sigmoid(t)
    f = (side - beta) * uv + a * span * uv
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        err = noise.bound(f) / (span * abs(uv) * a * (1.0 - a) * span * side)
        total = np.mean(err ** 2 + (beta / side * sig_k[None, :]) ** 2, axis=1)
    best = int(np.nanargmin(np.where(np.isfinite(total), total, np.nan)))
    return float(alpha[best, 0]), float(beta[best, 0]), float(side[best, 0])


def _saturated(a, b, vu):
    """Probes whose measured |logit| exceeds SATURATED_LOGIT (or whose weight left (0, 1))
    although the weight is precise (noise bound < 1%): they must be probed smaller."""
    with np.errstate(divide="ignore", invalid="ignore"):
        t = np.where((a > 0) & (a < 1), np.abs(logit(np.clip(a, 1e-300, 1.0))), np.inf)
    precise = b / np.abs(vu) < 0.01
    return np.where(precise, t, 0.0)


def _shrink(peak):
    """Factor bringing a saturated logit back to about 1.5 (2^-5 when no logit was measurable)."""
    finite = np.isfinite(peak)
    return np.where(finite, 1.5 / np.where(finite, peak, 1.0), 2.0 ** -5)


def _measure_round(oracle, U, v, uv, R, noise, prior, rng):
    d = U.shape[0]
    a_lo, a_hi = sigmoid(-CLIP_LOGIT), sigmoid(CLIP_LOGIT)
    A, Bd, VU, C, GK, GJ, T = (np.zeros((d, d)) for _ in range(7))
    rescaled = 0
    ks = np.arange(d)

    # diagonal: [R u_k; -beta u_k], logit -(R + beta) beta T_kk, signal (R + beta) u^T v
    beta_d = np.full(d, _design_diagonal(R, prior, uv, noise))

    def diagonal(idx):
        X = np.stack([R * U[:, idx].T, -beta_d[idx, None] * U[:, idx].T], axis=1)
        return oracle.query(X)

    def diagonal_weights(f):
        return (f + beta_d * uv) / ((R + beta_d) * uv)

    f = diagonal(ks)
    for _ in range(MAX_RESCALES):
        peak = _saturated(diagonal_weights(f), noise.bound(f), (R + beta_d) * uv)
        bad = peak > SATURATED_LOGIT
        if not bad.any():
            break
        beta_d[bad] *= _shrink(peak[bad])
        f[bad] = diagonal(ks[bad])
        rescaled += int(bad.sum())
    else:
        _still_saturated()
    a = np.clip(diagonal_weights(f), a_lo, a_hi)
    coef_d = -(R + beta_d) * beta_d
    T[ks, ks] = logit(a) / coef_d
    A[ks, ks], Bd[ks, ks] = a, noise.bound(f)
    VU[ks, ks], C[ks, ks] = (R + beta_d) * uv, coef_d
    GK[ks, ks] = a * (R + beta_d) - beta_d
    diag_T = T[ks, ks].copy()
    sig_d = Bd[ks, ks] / (np.abs(VU[ks, ks]) * a * (1.0 - a) * np.abs(coef_d))
    lo_t, hi_t = float(logit(a).min()), float(logit(a).max())

    # off-diagonal: [alpha u_k + s u_j; -beta u_k + s u_j], logit (alpha + beta)(s T_kj - beta T_kk)
    alpha, beta, side, c = np.empty(d), np.empty(d), np.empty(d), np.zeros(d)
    block = max(1, min(d, BLOCK_FLOATS // (2 * d * d)))
    pool = np.zeros(0)
    for lo in range(0, d, block):
        cols = np.arange(lo, min(d, lo + block))
        pick = rng.integers(0, d, size=DESIGN_SAMPLES)
        m = rng.choice(pool, DESIGN_SAMPLES) if pool.size else diag_T[rng.integers(0, d, DESIGN_SAMPLES)]
        if not np.any(m) and np.any(prior):
            m = rng.choice(prior, DESIGN_SAMPLES)
        alpha[cols], beta[cols], side[cols] = _design_offdiagonal(R, m, diag_T[pick], sig_d[pick],
                                                                  uv, noise)

        def weights(F):
            return ((F - ((side[cols] - beta[cols]) * uv)[None, :])
                    / ((alpha[cols] + beta[cols]) * uv)[None, :])

        F = _offdiagonal(oracle, U, cols, alpha, beta, side)
        for _ in range(MAX_RESCALES):
            peak = np.nan_to_num(_saturated(weights(F), noise.bound(F),
                                            (alpha[cols] + beta[cols]) * uv), nan=0.0).max(axis=0)
            bad = peak > SATURATED_LOGIT
            if not bad.any():
                break
            factor = _shrink(peak[bad])
            side[cols[bad]] *= factor
            beta[cols[bad]] *= factor
            alpha[cols[bad]] = np.sqrt(R * R - side[cols[bad]] ** 2)
            F[:, bad] = _offdiagonal(oracle, U, cols[bad], alpha, beta, side)
            rescaled += int(bad.sum()) * (d - 1)
        else:
            _still_saturated()
        off = np.ones((d, len(cols)), dtype=bool)
        off[cols, np.arange(len(cols))] = False
        a = np.clip(weights(F), a_lo, a_hi)
        t = logit(a)
        span = alpha[cols] + beta[cols]
        coef = span * side[cols]
        Tc = (t + span * beta[cols] * diag_T[:, None]) / coef[None, :]
        T[:, cols] = np.where(off, Tc, T[:, cols])
        for arr, value in ((A, a), (Bd, noise.bound(F)), (VU, np.broadcast_to(span * uv, a.shape)),
                           (C, np.broadcast_to(coef, a.shape)), (GK, a * span - beta[cols]),
                           (GJ, np.broadcast_to(side[cols], a.shape))):
            arr[:, cols] = np.where(off, value, arr[:, cols])
        c[cols] = beta[cols] / side[cols]
        lo_t, hi_t = min(lo_t, float(t[off].min(initial=0.0))), max(hi_t, float(t[off].max(initial=0.0)))
        pool = np.concatenate([pool, Tc[off]])[-4096:]
    return _Round(T=T, a=A, b=Bd, vu=VU, coef=C, gk=GK, gj=GJ, c=c, beta_d=beta_d, alpha=alpha,
                  beta=beta, side=side, rescaled=rescaled, logits=(lo_t, hi_t))


def _still_saturated():
    raise ModelMismatchError(
        f"the black box is not a single-head attention regressor: after {MAX_RESCALES} "
        f"rescalings some probes still imply attention weights outside (0, 1) or logits "
        f"beyond {SATURATED_LOGIT}")


def _offdiagonal(oracle, U, cols, alpha, beta, side):
    """Answers F (d, len(cols)) to [alpha_j u_k + s_j u_j; -beta_j u_k + s_j u_j], k != j
    (NaN at k = j)."""
    d, n = U.shape[0], len(cols)
    base = (side[cols, None] * U[:, cols].T)[:, None, :]            # (n, 1, d): s_j u_j
    X = np.stack([base + alpha[cols, None, None] * U.T[None], base - beta[cols, None, None] * U.T[None]],
                 axis=2)                                             # (n, d, 2, d)
    keep = np.ones((n, d), dtype=bool)
    keep[np.arange(n), cols] = False
    F = np.full((n, d), np.nan)
    F[keep] = oracle.query(X[keep])
    return F.T


def _bounded_bar(rd: _Round, uv, dv_norm):
    """Worst-case bound on ||W_hat - W||_F for one round (see the module docstring)."""
    d = rd.T.shape[0]
    a_lo, a_hi = sigmoid(-CLIP_LOGIT), sigmoid(CLIP_LOGIT)
    kappa = dv_norm / abs(uv)
    if kappa >= 1.0:
        return math.inf
    kf = 1.0 / (1.0 - kappa)
    gnorm = np.hypot(rd.gk, rd.gj)
    b = rd.b + FLOAT_SLACK * np.abs(rd.vu)
    delta = (b + gnorm * dv_norm) * kf / np.abs(rd.vu)
    ends = np.stack([np.clip(rd.a - delta, a_lo, a_hi), np.clip(rd.a + delta, a_lo, a_hi)])
    L = (1.0 / (ends * (1.0 - ends))).max(axis=0)
    theta = L * kf / (np.abs(rd.vu) * np.abs(rd.coef))             # |dT| per unit of |output error|
    off = ~np.eye(d, dtype=bool)
    diag_theta = np.diag(theta)
    eta = theta * b
    eta = eta + np.where(off, rd.c[None, :] * np.diag(eta)[:, None], 0.0)
    A = theta * np.abs(rd.gk) + np.where(off, rd.c[None, :] * (diag_theta * np.abs(np.diag(rd.gk)))[:, None], 0.0)
    B = np.where(off, theta * np.abs(rd.gj), 0.0)
    MtM = A * B + (A * B).T
    MtM[np.diag_indices(d)] = (A ** 2).sum(axis=1) + (B ** 2).sum(axis=0)
    if not (np.all(np.isfinite(MtM)) and np.all(np.isfinite(eta))):
        return math.inf             # a probe's answer no head gives (_finish refuses)
    return float(safe_norm(eta) + math.sqrt(max(np.linalg.eigvalsh(MtM)[-1], 0.0)) * dv_norm)


def _random_bar(bases, rounds, cov_v):
    """High-probability bound on ||W_hat - W||_F for the average of the rounds."""
    r, d = len(rounds), rounds[0].T.shape[0]
    off = ~np.eye(d, dtype=bool)
    trace = lam = 0.0
    for rd in rounds:
        s = 1.0 / (rd.vu * rd.a * (1.0 - rd.a) * rd.coef)            # signed dT per unit of output error
        sig = np.abs(s) * rd.b
        sig_d = np.diag(sig)
        c_norm2 = 1.0 + (rd.c ** 2).sum() - rd.c ** 2                # |c~_k|^2: 1 + sum_{j != k} c_j^2
        sig_off = np.where(off, sig, 0.0)
        trace += float(((sig_off ** 2).sum(axis=1) + sig_d ** 2 * c_norm2).sum())
        lam += float(((sig_off ** 2).max(axis=1) + sig_d ** 2 * c_norm2).max())
    lam_v, Q = np.linalg.eigh(cov_v)
    S = Q * np.sqrt(np.maximum(lam_v, 0.0))[None, :]
    Jall = _v_jacobian(bases, rounds)
    eig = np.linalg.eigvalsh(S.T @ (Jall.T @ Jall) @ S)
    return float(math.sqrt(max(trace / r ** 2 + eig.sum(), 0.0))
                 + CONFIDENCE_SIGMAS * math.sqrt(max(lam / r ** 2 + eig[-1], 0.0)))


def _v_jacobian(bases, rounds) -> np.ndarray:
    """d vec(W_hat) / d v_hat for the average of the rounds, shape (d^2, d)."""
    r, d = len(rounds), rounds[0].T.shape[0]
    off = ~np.eye(d, dtype=bool)
    J_avg = np.zeros((d, d, d))
    for U, rd in zip(bases, rounds):
        s = 1.0 / (rd.vu * rd.a * (1.0 - rd.a) * rd.coef)
        # dT / d(dv'), dv' = U^T dv: row (k, j) is -(s_kj (gk e_k + gj e_j) + c_j s_kk gk_kk e_k)
        J = np.zeros((d, d, d))
        ks = np.arange(d)
        J[ks, :, ks] = -(s * rd.gk) - np.where(
            off, rd.c[None, :] * (np.diag(s) * np.diag(rd.gk))[:, None], 0.0)   # along e_k
        J[:, ks, ks] += np.where(off, -(s * rd.gj), 0.0)                        # along e_j
        Jv = J @ U.T                                                    # per original dv coordinate
        JW = np.tensordot(np.tensordot(U, Jv, axes=(1, 0)), U, axes=(1, 1))   # (a, i, b)
        J_avg += np.transpose(JW, (0, 2, 1)) / r
    return J_avg.reshape(d * d, d)


MEASURED_MISS = 0.005        # measured bars: each of the two tails below gets this probability


def measured_bars(W_samples, v_samples, J) -> tuple[float, float, dict]:
    """Error bars of the averages from the spread of r independent repeats.

    ``W_samples`` (r, d, d) are the per-round estimates of W (each from its own dithered
    basis, all with the averaged v_hat), ``v_samples`` (r, d) the per-basis estimates of
    v, ``J`` (d^2, d) the map from v_hat's error to W_hat's. Nothing about the noise is
    assumed beyond independence between repeats and a Gaussian shape:

    E|W_hat - W|^2 = S_W / r + tr(J^T C_v J),  S_W = sum of the per-entry sample
    variances of the W rounds, C_v = (S_v / d) I / r from the v bases' spread. The
    expectation is estimated with nu = (r - 1) n_eff degrees of freedom (n_eff the
    effective number of independent entries) and raised to its 1 - MEASURED_MISS upper
    confidence limit; the bar is then the 1 - MEASURED_MISS quantile of |error| for a
    chi-square with n_eff degrees of freedom. Returns (W_bar, v_bar, details).
    """
    from scipy.stats import chi2
    W_samples, v_samples = np.asarray(W_samples), np.asarray(v_samples)
    r, d = v_samples.shape
    var_W = W_samples.var(axis=0, ddof=1).ravel()
    var_v = v_samples.var(axis=0, ddof=1)
    sigma_v2 = float(var_v.sum()) / d / r                  # per coordinate, of the average
    eig_J = np.linalg.eigvalsh(J.T @ J) * sigma_v2
    parts_W = np.concatenate([var_W / r, eig_J])
    total_W = float(parts_W.sum())
    total_v = float(var_v.sum()) / r

    def bar(total, parts, dof_per):
        if total <= 0:
            return 0.0
        n_eff = max(float(total ** 2 / np.sum(parts ** 2)), 1.0)
        nu = max((r - 1) * min(n_eff, dof_per), 1.0)
        upper = total * nu / chi2.ppf(MEASURED_MISS, nu)
        return math.sqrt(upper * chi2.ppf(1.0 - MEASURED_MISS, n_eff) / n_eff)

    W_bar = bar(total_W, parts_W, parts_W.size)
    v_bar = bar(total_v, var_v / r, d)
    # per column and row: the variance's upper limit as above, then the quantile of a
    # chi-square with d degrees of freedom (d entries), MEASURED_MISS shared by d parts
    var_mean = var_W.reshape(d, d) / r + sigma_v2 * (J ** 2).sum(axis=1).reshape(d, d)
    n_all = max(float(total_W ** 2 / np.sum(parts_W ** 2)), 1.0) if total_W > 0 else 1.0
    nu = max((r - 1) * n_all, 1.0)
    factor = math.sqrt(nu / chi2.ppf(MEASURED_MISS, nu) * chi2.ppf(1.0 - MEASURED_MISS / d, d) / d)
    W_mean = W_samples.mean(axis=0)
    with np.errstate(divide="ignore", invalid="ignore"):
        cols = factor * np.sqrt(var_mean.sum(axis=0)) / safe_norm(W_mean, axis=0)
        rows = factor * np.sqrt(var_mean.sum(axis=1)) / safe_norm(W_mean, axis=1)
    return W_bar, v_bar, {"repeats": r, "W spread (rms of one round)": math.sqrt(float(var_W.sum())),
                          "v spread (rms of one basis)": math.sqrt(float(var_v.sum())),
                          "error_bar_W_columns": float(np.nanmax(cols)),
                          "error_bar_W_rows": float(np.nanmax(rows))}


def _erfinv(x):
    from scipy.special import erfinv
    return erfinv(x)


# -- the single-head paper, Theorem 6.1 ------------------------------------------------------------

def paper_bound(d: int, tau: float, norm_bound: float, margin: float) -> tuple[float, float]:
    """Theorem 6.1's error bounds (our constants): (||W_hat - W||_F, ||v_hat - v||) bounds."""
    if margin <= tau:
        return math.inf, math.sqrt(d) * tau
    B = norm_bound
    return (2.0 * d * B * PAPER_LIPSCHITZ * tau * (1.5 * B + 1.0) / margin, math.sqrt(d) * tau)


def _extract_paper(oracle, noise, B, margin, seed, verify_tolerance):
    start, start_queries, start_bb = time.perf_counter(), oracle.queries, oracle.black_box_seconds
    d = oracle.dim
    n_verify = verification_count(d * d + d, d * d + d)   # within 5% of the recovery
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
        "method": f"the single-head paper, Theorem 6.1 (B = {B:.4g}, mu = {mu:.4g}, clip to "
                  f"[sigma(-1/2), sigma(1/2)])",
        "error bar source": "Theorem 6.1: 2 d B L tau (1.5 B + 1) / mu, L = 4.26; sqrt(d) tau",
    })
    return _finish(oracle, model, noise, W_bar, v_bar, n_verify, seed, verify_tolerance,
                   math.sqrt(0.25 + 1.0 / B ** 2), start, start_queries, start_bb,
                   {"recovery": d * d + d, "rescaling": 0, "verification": n_verify},
                   details, oracle.queries - start_queries)


# -- shared: report and verification ---------------------------------------------------

def _bar_details(model, W_bar, v_bar, noise):
    W_norm, v_norm = safe_norm(model.W), safe_norm(model.v)
    kind = ("worst case over |eta| <= tau + rho|f| (adversarial included)"
            if noise.kind == "bounded" else
            "independent noise, std <= tau + rho|f|; bars hold with probability ~ 1 - 4e-4")
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
    grad_W = safe_norm(spread, axis=1) * safe_norm(X[:, -1, :], axis=1)
    return f, grad_W, safe_norm(grad_v, axis=1)


def summed_magnitudes(model: SingleHeadAttention, X: np.ndarray) -> np.ndarray:
    """sum_i alpha_i |v^T x_i| of the model at a batch X (B, N, d), (B,): the size of the
    terms the attention-weighted sum of the values adds up, per unit of the weights."""
    scores = np.einsum("bnd,bd->bn", X, X[:, -1, :] @ model.W.T)
    return np.einsum("bn,bn->b", softmax(scores), np.abs(X @ model.v))


def sampled_spread(model: SingleHeadAttention, sequences, W_bar, v_bar, rng,
                   samples: int = SPREAD_SAMPLES) -> np.ndarray:
    """Largest |f_model' - f_model| over models W + dW, v + dv with random directions of
    norm W_bar and v_bar, per sequence (len(sequences),). Where attention is near one-hot
    an error of W can move it to another token: the gradient misses that, this does not."""
    base = evaluate_ragged(model, sequences)
    worst = np.zeros(len(sequences))
    d = model.dim
    for _ in range(samples):
        dW = rng.standard_normal((d, d))
        dv = rng.standard_normal(d)
        other = SingleHeadAttention(model.W + W_bar * dW / safe_norm(dW),
                                    model.v + v_bar * dv / safe_norm(dv))
        worst = np.maximum(worst, np.abs(evaluate_ragged(other, sequences) - base))
    return worst


def verify_noisy(oracle, model, noise: NoiseModel, W_bar, v_bar, *, count, seed, scale,
                 extra_relative=0.0, nonlinear=False) -> NoisyVerification:
    """Held-out comparison allowing noise plus the model's own error bars."""
    rng = np.random.default_rng(seed)
    # a stronger coverage statement asked for (--verify-sequences N): never fewer
    count = max(int(count), int(getattr(root_oracle(oracle), "verify_sequences", None) or 0))
    # the batch-invariance check's part of the count (a check of 34 or more), at least
    # BATCH_SMALL: a batch past 8
    batched = (max(BATCH_SMALL, min(count // 4, BATCH_BIG_MIN + 2 * BATCH_REASKS))
               if count >= BATCH_SMALL + 24 else 0)
    held = design(oracle.dim, count - batched, rng, scale, model=model,
                  max_length=max_length_of(oracle), exclude=("far",))
    sequences, count = held.sequences, len(held.sequences)
    observed = oracle.query_ragged(sequences)
    predicted, gW, gv = np.empty(count), np.empty(count), np.empty(count)
    summed, length = np.zeros(count), np.zeros(count)
    for idx, batch in by_length(sequences):
        predicted[idx], gW[idx], gv[idx] = output_gradient_norms(model, batch)
        length[idx] = batch.shape[1]
        if noise.accumulation:
            summed[idx] = summed_magnitudes(model, batch)
    norms = token_norms(sequences)
    ref = np.array([f != "hull" for f in held.family])
    rel = scaled_relative_errors(predicted, observed, norms, ref)
    denom = np.maximum(np.abs(observed), np.maximum(norms * output_scale(observed[ref], norms[ref]),
                                                    np.finfo(float).tiny))
    sigmas = VERIFY_SIGMAS if noise.kind == "random" else 1.0
    if noise.forward:
        # a low-precision forward pass rounds the tokens, scores and values, not only the
        # output: its error is relative to the output's scale s K, plus a relative
        # perturbation rho of W and v seen through the output's gradients
        bound = sigmas * (noise.bound(denom) + noise.relative_tolerance * (
            gW * safe_norm(model.W) + gv * safe_norm(model.v)))
        # plus the rounding of the two sums over the N tokens (ACCUMULATION_UNIT), a
        # worst-case bound, not times sigmas: (N - 1) u times the magnitudes summed, the
        # values' sum_i alpha_i |v^T x_i| and, for the normaliser and for the parts each
        # value is a sum of (of the output's scale s K), denom
        bound = bound + noise.accumulation * (length - 1) * (summed + denom)
    else:
        bound = sigmas * noise.bound(observed)
    model_part = gW * W_bar + gv * v_bar
    if nonlinear:       # large bars: the first-order allowance is not enough
        model_part = np.maximum(model_part, sampled_spread(model, sequences, W_bar, v_bar, rng))
    allowed = (bound + MODEL_SLACK * model_part
               + extra_relative * denom + FLOAT_SLACK * 16 * denom)
    ratio = np.abs(predicted - observed) / allowed
    # hull pairs: the answer within its tokens' answers, up to the noise of both (no model)
    hull_ratio = [max(0.0, observed[i] - observed[s].max(), observed[s].min() - observed[i])
                  / (bound[i] + bound[s].max() + (extra_relative + FLOAT_SLACK * 16) * denom[i])
                  for i, s in held.hull]
    worst = max(float(ratio.max()), max(hull_ratio, default=0.0))
    # batch invariance: the same sequences alone and in a large batch agree within the
    # noise of both answers (a box rounded in one batch shape only is refused: its
    # precision is not the one stated or found)
    reasked = reask_in_other_batches(oracle, sequences, held.family, rng, scale, batched)
    dependence = ""
    if reasked is not None:
        firsts = observed[reasked.picks]
        dependence = batch_dependence(
            reasked, firsts, lambda answers: np.abs(np.asarray(answers) - firsts),
            2.0 * bound[reasked.picks] + FLOAT_SLACK * 16 * denom[reasked.picks])
        count += reasked.queries
    return NoisyVerification(sequences=count, max_relative_error=float(rel.max()),
                             batch_dependence=dependence,
                             batch_sizes=() if reasked is None else reasked.sizes,
                             median_relative_error=float(np.median(rel)),
                             tolerance=float(np.max(allowed / denom)),
                             worst_ratio=worst, lengths=held.lengths,
                             worst_family=held.family[int(np.argmax(ratio))])


def _finish(oracle, model, noise, W_bar, v_bar, n_verify, seed, verify_tolerance, token_norm,
            start, start_queries, start_bb, breakdown, details, recovery, nonlinear=False):
    d = model.dim
    if not (math.isfinite(W_bar) and math.isfinite(v_bar)):
        # an honest head within the tolerance always gives finite bars (v was checked to
        # stand clear of its error first): these answers are not one head's
        raise ModelMismatchError(
            "the probes' answers give the extracted model infinite error bars (an answer "
            "outside what one head can give within the tolerance): the black box is not a "
            "single-head attention regressor with outputs accurate to the given tolerance")
    verification = verify_noisy(oracle, model, noise, W_bar, v_bar, count=n_verify, seed=seed,
                                scale=token_norm / math.sqrt(d), extra_relative=verify_tolerance,
                                nonlinear=True)
    details["verification bound"] = (
        f"max |f_hat - y| / allowed = {verification.worst_ratio:.3g} (passes at <= 1; allowed = "
        f"noise bound{' x 5' if noise.kind == 'random' else ''}"
        f"{' + (N - 1) u (sums over the N tokens)' if noise.accumulation else ''} + "
        f"{MODEL_SLACK} x output gradient . error bars)")
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
            f"tolerance" + (
                "; a small error like this one looks like a forward pass in low precision, "
                "which a tolerance on the output does not describe: extract with "
                "--output-dtype float32|bfloat16|float16 or --decimals K (error bars measured "
                "from repeated probes)" if verification.max_relative_error < 3e-2
                and not noise.forward else ""), result=result)
    return result
