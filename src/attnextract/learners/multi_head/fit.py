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

from dataclasses import dataclass

import numpy as np
from scipy.optimize import least_squares
from scipy.special import expit

RANDOM_STARTS = 2      # random starts of a row's free step fit, per head beyond the first


def sigmoid_and_slope(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """sigma(x) and sigma'(x) = sigma(x) (1 - sigma(x))."""
    s = expit(x)
    return s, s * expit(-x)


def levenberg_marquardt(fun, x: np.ndarray, iterations: int = 200):
    """Minimise |r(x)|^2 for ``fun(x) -> (r, J)``; returns (x, r, J) at the solution.

    MINPACK's Levenberg-Marquardt (scipy.optimize.least_squares, method 'lm'): QR
    steps on the scaled Jacobian, tolerances at machine precision.
    """
    cache = {}

    def residual(x):
        cache["x"], (cache["r"], cache["J"]) = x.copy(), fun(x)
        return cache["r"]

    def jacobian(x):
        if "x" not in cache or not np.array_equal(cache["x"], x):
            residual(x)
        return cache["J"]

    x = np.asarray(x, dtype=np.float64)
    if fun(x)[0].size < x.size:
        raise ValueError("fewer samples than parameters")
    out = least_squares(residual, x, jac=jacobian, method="lm", xtol=1e-15, ftol=1e-15,
                        gtol=1e-15, max_nfev=iterations * (x.size + 1))
    r, J = fun(out.x)
    return out.x, r, J


def unit_std(J: np.ndarray) -> np.ndarray:
    """sqrt(diag((J^T J)^-1)): the parameters' standard deviations per unit output noise.

    Directions the samples do not pin down (singular values below 1e-15 of the
    largest) give inf.
    """
    _, s, Vt = np.linalg.svd(J, full_matrices=False)
    if s.size == 0 or s[-1] <= s[0] * 1e-15:
        return np.full(J.shape[1], np.inf)
    return np.sqrt(np.einsum("ij,i->j", Vt ** 2, 1.0 / s ** 2))


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


def _best_new_step(lam, g, total, t_fixed, grid, weight_total):
    """Grid search of one more step's position with the heights solved linearly."""
    S = lam.size
    cols = [expit(t + lam) for t in t_fixed]
    best = (np.inf, None, None)
    A_fixed = np.array(cols).T if cols else np.zeros((S, 0))
    A = np.empty((grid.size, S + 1, len(cols) + 1))
    A[:, :S, :len(cols)] = A_fixed[None]
    A[:, :S, -1] = expit(grid[:, None] + lam[None, :])
    A[:, S, :] = weight_total
    b = np.concatenate([g, [weight_total * total]])
    c = np.einsum("gij,j->gi", np.linalg.pinv(A), b)
    cost = np.sum((np.einsum("gij,gj->gi", A, c) - b) ** 2, axis=1)
    i = int(np.argmin(cost))
    if cost[i] < best[0]:
        best = (cost[i], grid[i], c[i])
    return best


def fit_free_steps(lam: np.ndarray, g: np.ndarray, total: float, heads: int,
                   half_window: float, floor: float) -> list[StepFit]:
    """Fits with 1..heads steps to one row's lambda scan; entry h - 1 has h steps.

    Steps are added one at a time (grid search of the new position, heights linear),
    then every step is searched again with the others fixed, and all are polished by
    Levenberg-Marquardt. ``total`` = sum_h c_h = u^T v is the known top asymptote.
    """
    scale = max(float(np.max(np.abs(g))), abs(total), 1e-300)
    gs, ts = g / scale, total / scale
    w_total = 1.0
    grid = np.linspace(-half_window - 2.5, half_window + 2.5, 241)
    fun = _steps_residual(lam, gs, ts, w_total)
    fits, t = [], np.zeros(0)
    rng = np.random.default_rng(0)          # the starts are part of the method, not of the run
    for h in range(1, heads + 1):
        _, t_new, c = _best_new_step(lam, gs, ts, t, grid, w_total)
        x, r, J = levenberg_marquardt(fun, np.concatenate([np.append(t, t_new), c]))
        # more starts: each step of the fit with h - 1 steps split in two (close pairs),
        # and, for the largest count, random positions over the window; each start is
        # screened by a short run, the best one polished
        splits = [np.concatenate([np.delete(t, i), t[i] + np.array([-0.3, 0.3])])
                  for i in range(t.size)]
        randoms = [np.sort(rng.uniform(-half_window, half_window, h))
                   for _ in range(RANDOM_STARTS * (h - 1) if h == heads else 0)]
        for t_try in splits + randoms:
            if float(r @ r) <= (floor / scale) ** 2 * lam.size:
                break
            A = np.vstack([expit(t_try[None, :] + lam[:, None]), np.full((1, h), w_total)])
            c_try = np.linalg.lstsq(A, np.append(gs, w_total * ts), rcond=None)[0]
            x_try, r_try, _ = levenberg_marquardt(fun, np.concatenate([t_try, c_try]), 20)
            if r_try @ r_try < r @ r:
                x, r, J = levenberg_marquardt(fun, x_try)
        t = x[:h]
        std = unit_std(J) * residual_sigma(r, J.shape[1], floor / scale)
        order = np.argsort(t)
        fits.append(StepFit(t=x[:h][order], c=x[h:][order] * scale,
                            rms=float(np.sqrt(np.mean(r[:-1] ** 2))) * scale,
                            t_std=std[:h][order], c_std=std[h:][order] * scale))
    return fits


def refit_steps(lam: np.ndarray, g: np.ndarray, total: float, t0: np.ndarray,
                c0: np.ndarray) -> tuple[np.ndarray, np.ndarray, float]:
    """Polish a row's steps from positions near the solution (a perturbed base row).

    The heights may change a lot (a small base height can change sign), so they start
    from the linear least-squares fit at the positions ``t0``; ``c0`` is not used.
    """
    scale = max(float(np.max(np.abs(g))), abs(total), 1e-300)
    A = np.vstack([expit(t0[None, :] + lam[:, None]), np.ones((1, t0.size))])
    c_start = np.linalg.lstsq(A, np.append(g, total) / scale, rcond=None)[0]
    fun = _steps_residual(lam, g / scale, total / scale, 1.0)
    x, r, _ = levenberg_marquardt(fun, np.concatenate([t0, c_start]))
    H = t0.size
    return x[:H], x[H:] * scale, float(np.sqrt(np.mean(r[:-1] ** 2))) * scale


# ---------------------------------------------------------------------------
# many probes, heights known: logits t (P, H)
# ---------------------------------------------------------------------------

def fit_logits(lam: np.ndarray, g: np.ndarray, c: np.ndarray, t0: np.ndarray,
               bound: float = np.inf, iterations: int = 60) -> np.ndarray:
    """Logits of P probes at once, heights known: batched damped Gauss-Newton.

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
    mu = np.full(t.shape[0], 1e-3)

    def residual(t):
        s, ds = sigmoid_and_slope(t[:, None, :] + lam[:, :, None])   # (P, S, H)
        return np.einsum("psh,ph->ps", s, c) - g, ds * c[:, None, :]

    r, J = residual(t)
    cost = np.einsum("ps,ps->p", r, r)
    H = t.shape[1]
    for _ in range(iterations):
        JtJ = np.einsum("psh,psk->phk", J, J)
        Jtr = np.einsum("psh,ps->ph", J, r)
        diag = np.einsum("phh->ph", JtJ) + 1e-300
        A = JtJ + mu[:, None, None] * diag[:, :, None] * np.eye(H)[None]
        step = -np.linalg.solve(A, Jtr[..., None])[..., 0]
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
    w = mask.astype(np.float64)

    def fun(x):
        c, z = x[:H], x[H:].reshape(H, d)
        t = columns @ z.T                                          # (J, H)
        s, ds = sigmoid_and_slope(t[:, None, :] + lam[:, :, None])  # (J, S, H)
        r = (np.einsum("jsh,h->js", s, c) - g) * w
        Jc = s * w[..., None]                                       # (J, S, H)
        Jz = (ds * c[None, None, :] * w[..., None])[..., None] * columns[:, None, None, :]
        return r.ravel(), np.concatenate([Jc.reshape(-1, H), Jz.reshape(-1, H * d)], axis=1)

    x, r, J = levenberg_marquardt(fun, np.concatenate([c0, z0.ravel()]))
    keep = w.ravel() > 0
    J, r = J[keep], r[keep]
    std = unit_std(J)
    return RowFit(c=x[:H], z=x[H:].reshape(H, d), c_std=std[:H], z_std=std[H:].reshape(H, d),
                  residual=r, jacobian_singular_values=np.linalg.svd(J, compute_uv=False))
