"""The fits: steps of one row, logits of many probes, and the joint fit of a main row.

Everything here fits sums of sigmoid steps

    g(lambda) = sum_h c_h sigma(t_h + lambda)

(see :mod:`.design`) by Levenberg-Marquardt on the full Jacobian (least squares on the
augmented system, never the normal equations, whose condition is the square). The
Jacobian at the solution and the measured residual give each fit's covariance,
sigma^2 (J^T J)^-1 with sigma^2 = |r|^2 / (samples - parameters): the conditioning the
learner reports and refuses on.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np
from scipy.interpolate import AAA
from scipy.optimize import least_squares
from scipy.special import expit


def sigmoid_and_slope(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """sigma(x) and sigma'(x) = sigma(x) (1 - sigma(x))."""
    s = expit(x)
    return s, s * expit(-x)


def levenberg_marquardt(fun, x: np.ndarray, iterations: int = 200):
    """Minimise |r(x)|^2 for ``fun(x) -> (r, J)``; returns (x, r, J) at the solution.

    scipy's trust-region reflective solver with exact (SVD) steps on the Jacobian
    scaled by its column norms, tolerances at machine precision (:func:`_solve`). At
    most ``iterations`` evaluations: from the starts used here it converges in tens.
    """
    cache: dict[str, np.ndarray] = {}

    def evaluate(x):
        # one evaluation per point: the solver asks for r and J at the same x, and the
        # start and the solution are asked for again here
        if "x" not in cache or not np.array_equal(cache["x"], x):
            cache["x"], (cache["r"], cache["J"]) = x.copy(), fun(x)

    def residual(x):
        evaluate(x)
        return cache["r"]

    def jacobian(x):
        evaluate(x)
        return cache["J"]

    x = np.asarray(x, dtype=np.float64)
    if residual(x).size < x.size:
        raise ValueError("fewer samples than parameters")
    x_opt = _solve(residual, x, jacobian, iterations)
    evaluate(x_opt)
    return x_opt, cache["r"], cache["J"]


def _solve(residual, x0: np.ndarray, jacobian="2-point", iterations: int | None = None):
    """argmin |residual(x)|^2 from ``x0``: least squares by the trust-region reflective
    method (numpy/LAPACK only). MINPACK's Levenberg-Marquardt (method 'lm') was used
    before; its C work arrays are allocated per call, and their memory alignment,
    which the heap (and so PYTHONHASHSEED) decides, changed its last bits and through
    them the design: the same seed gave different runs."""
    eps = np.finfo(np.float64).eps
    return least_squares(residual, x0, jac=jacobian, method="trf", x_scale="jac",
                         xtol=eps, ftol=eps, gtol=eps, max_nfev=iterations).x


def unit_std(J: np.ndarray) -> np.ndarray:
    """sqrt(diag((J^T J)^-1)): the parameters' standard deviations per unit output noise.

    Directions the samples do not pin down (singular values below 1e-15 of the
    largest) give inf.
    """
    if not np.all(np.isfinite(J)):
        return np.full(J.shape[1], np.inf)      # no SVD of a non-finite matrix
    return _std_and_singular_values(J)[0]


def _std_and_singular_values(J: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """:func:`unit_std` and the singular values of J, from one SVD."""
    if not np.all(np.isfinite(J)):
        return np.full(J.shape[1], np.inf), np.linalg.svd(J, compute_uv=False)
    _, s, Vt = np.linalg.svd(J, full_matrices=False)
    if s.size == 0 or s[-1] <= s[0] * 1e-15:
        return np.full(J.shape[1], np.inf), s
    return np.sqrt(np.einsum("ij,i->j", Vt ** 2, 1.0 / s ** 2)), s


def residual_sigma(r: np.ndarray, parameters: int, floor: float = 0.0) -> float:
    """sigma = sqrt(|r|^2 / (samples - parameters)), at least ``floor`` (the output
    precision: a residual below it is luck, not accuracy)."""
    return max(float(np.sqrt(r @ r / max(r.size - parameters, 1))), floor)


# ---------------------------------------------------------------------------
# one row, free steps: (t_h, c_h) for h = 1..H from a lambda scan
# ---------------------------------------------------------------------------

@dataclass
class StepFit:
    """Steps of one row: logits t (H,), heights c (H,), residual rms, predicted std of t."""

    t: np.ndarray
    c: np.ndarray
    rms: float
    t_std: np.ndarray
    c_std: np.ndarray


def _steps_residual(lam, g, total, weight_total):
    def fun(x):
        H = x.size // 2
        t, c = x[:H], x[H:]
        s, ds = sigmoid_and_slope(t[None, :] + lam[:, None])      # (S, H)
        r = np.concatenate([s @ c - g, [weight_total * (c.sum() - total)]])
        J = np.vstack([np.hstack([ds * c[None, :], s]),
                       np.concatenate([np.zeros(H), np.full(H, weight_total)])[None]])
        return r, J
    return fun


def rational_steps(lam: np.ndarray, g: np.ndarray, heads: int) -> np.ndarray:
    """Step positions t (at most ``heads``) from the poles of a rational fit, no start needed.

    In x = e^lambda a step is c sigma(t + lambda) = c x / (x + e^-t): g is a rational
    function of degree H with its poles at x = -e^-t. AAA (barycentric rational
    approximation with greedily chosen support points, scipy.interpolate.AAA) finds
    them by a generalized eigenvalue problem, well conditioned where the samples are,
    with no random starts. Poles off the negative real axis (noise, or two steps too
    close to split) are mapped to their modulus.
    """
    x = np.exp(lam)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            poles = AAA(x, g, max_terms=heads + 1, rtol=0.0).poles()
        except (np.linalg.LinAlgError, ValueError):
            return np.zeros(0)
    near_axis = (poles.real < 0) & (np.abs(np.angle(-poles)) < 0.5)
    t = -np.log(np.abs(poles[near_axis]))
    return np.sort(t[np.isfinite(t)])[:heads]


def fit_free_steps(lam: np.ndarray, g: np.ndarray, total: float, heads: int,
                   half_window: float, floor: float, counts=None,
                   enough=None) -> list[StepFit]:
    """Fits with 1..heads steps (or the step ``counts`` given) to one row's lambda scan.

    Stops after the first fit for which ``enough(fit)`` is true: fewer steps than
    that never fit, more are not needed.

    Each fit starts from the poles of the rational fit of degree h
    (:func:`rational_steps`), heights solved linearly, and is polished by
    Levenberg-Marquardt. ``total`` = sum_h c_h = u^T v is the known top asymptote.
    """
    scale = max(float(np.max(np.abs(g))), abs(total), 1e-300)
    gs, ts = g / scale, total / scale
    fun = _steps_residual(lam, gs, ts, 1.0)
    fits = []
    for h in (range(1, heads + 1) if counts is None else counts):
        t = rational_steps(lam, gs, h)
        # a degree-h fit may show fewer real poles (a step outside the window): the
        # missing ones start at the window's edges, where such steps are
        edges = np.linspace(-half_window - 1.0, half_window + 1.0, h - t.size + 2)[1:-1]
        t = np.sort(np.concatenate([t, edges]))
        A = np.vstack([expit(t[None, :] + lam[:, None]), np.ones((1, h))])
        c = np.linalg.lstsq(A, np.append(gs, ts), rcond=None)[0]
        x, r, J = levenberg_marquardt(fun, np.concatenate([t, c]))
        std = unit_std(J) * residual_sigma(r, J.shape[1], floor / scale)
        order = np.argsort(x[:h])
        fits.append(StepFit(t=x[:h][order], c=x[h:][order] * scale,
                            rms=float(np.sqrt(np.mean(r[:-1] ** 2))) * scale,
                            t_std=std[:h][order], c_std=std[h:][order] * scale))
        if enough is not None and enough(fits[-1]):
            break
    return fits


def label_steps(t: np.ndarray, c: np.ndarray, t_predicted: np.ndarray,
                c_predicted: np.ndarray, spacing: float) -> np.ndarray:
    """Which fitted step is which head: order such that t[order][h] is head h's step.

    Matches positions (in units of the designed spacing) and heights (relative to the
    row's largest) to their predictions at once (Hungarian assignment), so two heads
    whose predicted positions or heights alone are close are still told apart.
    """
    from scipy.optimize import linear_sum_assignment
    top = max(float(np.max(np.abs(c_predicted))), 1e-300)
    cost = (np.abs(t_predicted[:, None] - t[None, :]) / spacing
            + np.abs(c_predicted[:, None] - c[None, :]) / top)
    _, order = linear_sum_assignment(cost)
    return order


def refit_steps(lam: np.ndarray, g: np.ndarray, total: float, t0: np.ndarray,
                floor: float = 0.0) -> StepFit:
    """Polish a row's steps from positions near the solution (a perturbed base row).

    Variable projection: the heights are linear, so for any positions they are solved
    exactly and only the H positions are searched (from ``t0``); a small base height
    may change sign without leading the search astray. A final joint step on (t, c)
    polishes both. The steps keep the order of ``t0`` (their labels); their standard
    deviations use the residual, at least ``floor``.
    """
    scale = max(float(np.max(np.abs(g))), abs(total), 1e-300)
    gs, ts = g / scale, total / scale
    H = t0.size
    target = np.append(gs, ts)                  # built once: the search evaluates
    A = np.ones((lam.size + 1, H))              # heights() thousands of times

    def heights(t):
        A[:-1] = expit(t[None, :] + lam[:, None])
        if not np.all(np.isfinite(A)):
            # a trial point the search reached through a non-finite Jacobian (a box
            # outside the class: ReLU attention printed "On entry to DLASCL parameter
            # number 4 had an illegal value" 6 times): no LAPACK call on it; the
            # non-finite residual makes the solver shrink its step, as the NaN
            # heights LAPACK gave back did
            return A, np.full(H, np.nan)
        return A, np.linalg.lstsq(A, target, rcond=None)[0]

    def projected(t):
        A, c = heights(t)
        return A @ c - target

    t = _solve(projected, t0)
    fun = _steps_residual(lam, gs, ts, 1.0)
    x, r, J = levenberg_marquardt(fun, np.concatenate([t, heights(t)[1]]))
    std = unit_std(J) * residual_sigma(r, J.shape[1], floor / scale)
    return StepFit(t=x[:H], c=x[H:] * scale, rms=float(np.sqrt(np.mean(r[:-1] ** 2))) * scale,
                   t_std=std[:H], c_std=std[H:] * scale)


def fit_steps_from(lam: np.ndarray, g: np.ndarray, total: float, t_start: np.ndarray,
                   half_window: float, noise: float, allowed: float) -> tuple[StepFit, bool]:
    """A row's steps from a predicted start, or free when the start was too far off.

    :func:`refit_steps` from ``t_start``; when its residual exceeds ``allowed``, a free
    fit of as many steps (:func:`fit_free_steps`, rational start), and the better of the
    two. Returns (fit, started): ``started`` False when the free fit won, whose steps
    are in position order, not in the start's.
    """
    steps = refit_steps(lam, g, total, t_start, floor=noise)
    if steps.rms <= allowed:
        return steps, True
    free = fit_free_steps(lam, g, total, t_start.size, half_window, noise,
                          counts=[t_start.size])[-1]
    return (free, False) if free.rms < steps.rms else (steps, True)


# ---------------------------------------------------------------------------
# many probes, heights known: logits t (P, H)
# ---------------------------------------------------------------------------

def fit_logits(lam: np.ndarray, g: np.ndarray, c: np.ndarray, t0: np.ndarray,
               bound: float = np.inf, iterations: int = 60) -> np.ndarray:
    """Logits of P probes at once, heights known: batched damped Gauss-Newton, the heads
    freed strongest first (by |c|: the strongest alone, then the two strongest, ..., all).

    Freed together from the start, a weak head's logit absorbed a strong head's misfit in
    the first step and stuck at the bound (d = 8, H = 2, one head's value 1e-3 of the
    other's: 8 of 64 columns, cost 1e-6 against 1e-30 at the truth, and the row fits
    started from them walked to norms 100 to 2000 times the true ones: refused as a
    wrong basin; nn.MultiheadAttention(8, 8) float64 trial 26 the same, a head 1e-4 of
    the others'). With the strong steps placed first the weak one fits what is left.

    Parameters
    ----------
    lam, g : arrays (P, S)
    c : array (P, H)
        Heights (shared along a row, so known once the row's heights are).
    t0 : array (P, H)
        Start (the designed positions).
    bound : float
        The logits stay within ``bound`` of the start (the design moves steps less):
        a head too weak in one probe to be located stays near its designed place.
    """
    t = t0.copy()
    H = t.shape[1]
    rank = np.argsort(np.argsort(-np.abs(c), axis=1), axis=1)        # 0: the strongest
    for stage in range(1, H + 1):
        t = _damped_gauss_newton(lam, g, c, t, t0, bound, iterations, rank < stage)
    return t


def _damped_gauss_newton(lam, g, c, t, t0, bound, iterations, free):
    """:func:`fit_logits`' iterations from ``t`` (P, H), only the ``free`` (P, H) logits
    moving."""
    t = t.copy()
    mu = np.full(t.shape[0], 1e-3)
    H = t.shape[1]

    def residual(t):
        s, ds = sigmoid_and_slope(t[:, None, :] + lam[:, :, None])   # (P, S, H)
        return np.einsum("psh,ph->ps", s, c) - g, ds * c[:, None, :] * free[:, None, :]

    r, J = residual(t)
    cost = np.einsum("ps,ps->p", r, r)
    fixed = np.eye(H)[None] * (~free)[:, :, None]          # keeps A regular
    for _ in range(iterations):
        JtJ = np.einsum("psh,psk->phk", J, J)
        Jtr = np.einsum("psh,ps->ph", J, r)
        diag = np.einsum("phh->ph", JtJ) + 1e-300
        A = JtJ + mu[:, None, None] * diag[:, :, None] * np.eye(H)[None] + fixed
        step = -np.linalg.solve(A, Jtr[..., None])[..., 0] * free
        step = np.clip(t + step, t0 - bound, t0 + bound) - t
        r_new, J_new = residual(t + step)
        cost_new = np.einsum("ps,ps->p", r_new, r_new)
        better = cost_new <= cost
        t[better] += step[better]
        r[better], J[better], cost[better] = r_new[better], J_new[better], cost_new[better]
        mu = np.where(better, np.maximum(mu / 5, 1e-12), mu * 5)
    return t


# ---------------------------------------------------------------------------
# one main row: heights c (H) and z_h = W_h^T u_k (H, d), all its columns jointly
# ---------------------------------------------------------------------------

@dataclass
class RowFit:
    """A main row's fit: heights c (H,), z (H, d), their standard deviations per unit
    output noise, the residual (samples,)."""

    c: np.ndarray
    z: np.ndarray
    c_std: np.ndarray
    z_std: np.ndarray
    residual: np.ndarray
    jacobian_singular_values: np.ndarray


def fit_row(lam: np.ndarray, g: np.ndarray, mask: np.ndarray, columns: np.ndarray,
            c0: np.ndarray, z0: np.ndarray) -> RowFit:
    """Joint fit of one main row: g[j, s] = sum_h c_h sigma(z_h^T q_j + lam[j, s]).

    Parameters
    ----------
    lam, g, mask : arrays (J, S)
        Samples of the row's J probes; ``mask`` 1 where a sample exists.
    columns : array (J, d)
        The probes' q_j.
    c0, z0 : arrays (H,), (H, d)
        Start.
    """
    H, d = z0.shape
    # only the samples that exist (a masked one is a zero row of the Jacobian, which
    # every step's SVD would pay for: half the rows of a column-padded row)
    keep = mask > 0
    probe = np.nonzero(keep)[0]                                     # (M,) its probe j
    lam_m, g_m, w = lam[keep], g[keep], mask[keep].astype(np.float64)
    q_m = columns[probe]                                            # (M, d)

    def fun(x):
        c, z = x[:H], x[H:].reshape(H, d)
        t = columns @ z.T                                          # (J, H)
        s, ds = sigmoid_and_slope(t[probe] + lam_m[:, None])        # (M, H)
        r = (s @ c - g_m) * w
        Jz = (ds * (c * w[:, None]))[:, :, None] * q_m[:, None, :]  # (M, H, d)
        return r, np.concatenate([s * w[:, None], Jz.reshape(-1, H * d)], axis=1)

    x, r, J = levenberg_marquardt(fun, np.concatenate([c0, z0.ravel()]))
    std, singular_values = _std_and_singular_values(J)
    return RowFit(c=x[:H], z=x[H:].reshape(H, d), c_std=std[:H], z_std=std[H:].reshape(H, d),
                  residual=r, jacobian_singular_values=singular_values)
