"""Joint polish: all heads refitted at once on every answer the learner holds.

Identity. A copy probe (u, q, lambda) (m copies of q + u, then N - m copies of q,
lambda = ln(m / (N - m))) answers

    f = sum_h (q + sigma(u^T W_h q + lambda) u)^T v_h,

and a single token x answers x^T sum_h v_h (u = 0). Every answer the learner received
(v tokens, base scans, base perturbations, main rows, columns, wide columns) is a
sample of this one function of the canonical parameters (W_h, v_h), h = 1..H.

With query biases and an output constant (``biases=True``, a deployed layer) the
logit gains u^T b_h and every answer c (the key bias cancels in the softmax):

    f = sum_h (q + sigma(u^T (W_h q + b_h) + lambda) u)^T v_h + c,

so the parameters are (W_h, v_h, b_h) and c, H (d^2 + 2d) + 1 of them, and the
answer c = f([0]) (u = q = 0) is one more sample.

Method. The row fits solve for each main row's (W_h^T u_k, u_k^T v_h) on that row's
samples alone; W_h = U^-1 Z_h then ignores the base samples, the v tokens, and the
different noise of different samples. The polish minimises

    sum_p (f_model(p) - f_p)^2 / noise_p^2

over all H (d^2 + d) parameters (with biases H (d^2 + 2d) + 1) jointly by Gauss-Newton from the row fits' model,
noise_p the black box's expected rounding for that answer (its precision times the
size of the terms it sums, as :meth:`_Extraction.noise`). The step is solved from the
column-scaled normal equations (Cholesky): the step is a correction of relative size
1e-12, so the squared condition number costs nothing that matters. The covariance
sigma^2 (J^T J)^-1 at the solution (sigma the weighted residual rms, at least the
least noise: a residual below it is luck) gives the predicted rms relative error
of every W_h and v_h, as the row fits' prediction does.

The polish is kept only when it lowers the weighted residual, its predicted error is
below the row fits', and it moves no head by more than the row fits' error bar (it
corrects within the uncertainty, never jumps elsewhere); otherwise the row fits'
model stands. It sends no query. Its cost is a dense (samples x parameters)
Jacobian, so it runs only up to ``MAX_WORK`` (samples times parameters squared) and
``MAX_PARAMETERS``: d = 8 for every H, d = 16 up to 5 heads (with biases too); it is
skipped above (stated in the report's ``joint polish``).

Measured (d = 8, H = 6, float64 numpy boxes, 8 seeds): the error drops 1.1x to 1.8x;
the data's own Cramer-Rao bound (this covariance) is within 2x of the row fits'
error, so no polish of these answers reaches 1e-14: the black box's rounding of its
512-token sums (about 30 ulps of f, measured against a long-double evaluation) times
the design's amplification limits it. The short probes (two tokens, the learner's
``short_probes``) are the design change that does: with them among the samples the
polish takes d = 8, H = 6 below 1e-14.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy.linalg import LinAlgError, cho_factor, cho_solve, lapack
from scipy.special import expit

MAX_WORK = 1.5e10          # samples x parameters^2 above which the polish is skipped
MAX_PARAMETERS = 1600      # ... and parameters (its Cholesky and covariance: n^3 / 3 flops)
CHUNK = 512                # samples per product of the normal equations: each BLAS call
                           # stays well under a second, so Ctrl-C is honoured in between
LENGTH_FACTOR = 0.25       # a sum over N tokens errs by about this x N^0.75 x precision x
                           # its terms: measured rms 5, 13 and 50 to 100 at N = 128, 512
                           # and 2048 (numpy boxes against a long-double evaluation)
GROWTH = 1.5               # a polished prediction up to this x the row fits' is kept: the
                           # two use different noise models (weighted, unweighted)
ITERATIONS = 4             # Gauss-Newton steps at most (it converges in one or two)


@dataclass
class Samples:
    """Every answer as a copy probe: u, q (P, d), lambda (P,), answer f (P,), noise (P,)."""

    u: np.ndarray
    q: np.ndarray
    lam: np.ndarray
    f: np.ndarray
    length: np.ndarray


@dataclass
class Polished:
    """Outcome: the polished parameters W (H, d, d), v (H, d), their predicted rms
    relative error (max over heads of W and v), the weighted residual norm before and
    after, whether it was kept, and why not; with biases also b (H, d) and c."""

    W: np.ndarray
    v: np.ndarray
    predicted: float
    cost_before: float
    cost_after: float
    kept: bool
    reason: str
    b: np.ndarray | None = None
    c: float | None = None
    own_predicted: float = np.nan   # the polish's own predicted error, kept or not (nan
                                    # when it was skipped before its covariance)


def collect(records: list[tuple]) -> Samples:
    """Stack recorded batches (u (P, d), q (P, d), lambda (P,), f (P,), N (one for the
    batch or (P,), each probe's own))."""
    u = np.concatenate([r[0] for r in records])
    q = np.concatenate([r[1] for r in records])
    lam = np.concatenate([r[2] for r in records])
    f = np.concatenate([r[3] for r in records])
    length = np.concatenate([np.broadcast_to(np.asarray(r[4], dtype=np.float64), r[0].shape[:1])
                             for r in records])
    return Samples(u, q, lam, f, length)


def noise_of(samples: Samples, v: np.ndarray, precision: float, absolute: float,
             c: float | None = None, W: np.ndarray | None = None,
             b: np.ndarray | None = None) -> np.ndarray:
    """Expected rounding of every answer (P,): the precision times the size of the terms
    the box sums (|q^T v_h| and |u^T v_h| of every head) and its length, plus an absolute
    rounding (decimals). ``v`` (H, d) the current heads. With biases (``c`` given) one
    more rounding of |c|, added once to the sum, and an answer with no terms at all
    (f([0]) = c = 0, exact) weighs as the least rounded other answer (a finite weight).

    With the heads' W (H, d, d) and b (H, d) given (the biased learner), also the
    rounding of the box's scores: the logit u^T (W_h q + b_h) is the difference of the
    scores s = x^T (W_h q + b_h) of the tokens q + u and q, each rounded to the
    precision times |s|, which moves the answer by |u^T v_h| sigma'(logit) times that.
    The intercepts u^T b_h make those scores large (hundreds on a short probe at
    |b_h| = 5: 10x to 40x the value terms' rounding, measured against a long-double
    evaluation; 1.6x to 3x with this term). Without biases, W given (c None): the
    rounding of the scores as a box that forms them through its projections makes it
    (:func:`factored_logit_rounding`)."""
    terms = np.abs(samples.u @ v.T).sum(axis=1) + np.abs(samples.q @ v.T).sum(axis=1)
    factor = (LENGTH_FACTOR * samples.length ** 0.75 + 1.0 if precision < 1e-12
              else length_factor(samples.length, precision))
    if c is None:
        noise = factor * precision * np.maximum(terms, 1e-300) + absolute
        if W is not None:
            noise = noise + precision * factored_logit_rounding(samples, v, W)
        return noise
    noise = factor * precision * terms + precision * abs(c)
    if W is not None:
        assert b is not None, "W with c is the biased learner's: b comes with them"
        keys = np.einsum("hij,pj->phi", W, samples.q) + b[None]              # (P, H, d)
        scores = (np.abs(np.einsum("pi,phi->ph", samples.u + samples.q, keys))
                  + np.abs(np.einsum("pi,phi->ph", samples.q, keys)))
        s = expit(np.einsum("pi,phi->ph", samples.u, keys) + samples.lam[:, None])
        noise = noise + precision * np.sum(np.abs(samples.u @ v.T) * s * (1.0 - s) * scores,
                                           axis=1)
    positive = noise[noise > 0]
    return np.maximum(noise, positive.min() if positive.size else 1e-300) + absolute


def factored_logit_rounding(samples: Samples, v: np.ndarray, W: np.ndarray) -> np.ndarray:
    """How far (P,), in units of the precision, the rounding of the logits moves each
    answer of a box that forms the scores through its projections (bias-free):
    sum_h |u^T v_h| s_h (1 - s_h) (|W_h^T a| + |W_h^T q|) |q| + (|a| + |q|) |W_h q|),
    a = q + u. A score x^T W_h q computed as (K_h x)^T (Q_h q) (nn.MultiheadAttention,
    W_h = K_h^T Q_h) errs by the rounding of each projection times the other, whatever
    the logit: at head_dim 1 those are |W_h^T x| |q| and |x| |W_h q| (Cauchy-Schwarz on
    the dot products' terms). Short probes with |u| about 6e3 whose q falls near a head's
    query null space (|W_h q| 1e-3, |W_h^T u| 1e4) erred 1e3 to 1e4 x the value terms'
    rounding (torch float64 nn.MultiheadAttention(8, 8), head_dim 1: measured against a
    long-double evaluation, 0.85 of this bound at most); weighted as precise, they pulled
    the joint polish off by 5 x its predicted error."""
    u, q = samples.u, samples.q
    a = q + u
    Wq = np.linalg.norm(np.einsum("hij,pj->phi", W, q), axis=2)                 # (P, H)
    Wta = np.linalg.norm(np.einsum("hij,pi->phj", W, a), axis=2)
    Wtq = np.linalg.norm(np.einsum("hij,pi->phj", W, q), axis=2)
    a_norm = np.linalg.norm(a, axis=1)[:, None]
    q_norm = np.linalg.norm(q, axis=1)[:, None]
    s = expit(np.einsum("pi,hij,pj->ph", u, W, q) + samples.lam[:, None])
    spread = (Wta + Wtq) * q_norm + (a_norm + q_norm) * Wq
    return np.sum(np.abs(u @ v.T) * s * (1.0 - s) * spread, axis=1)


def length_factor(length, precision: float):
    """How many roundings of its terms a box's answer for a sequence of ``length`` tokens
    errs by (rms), scalar or array. float64: 8 + log2 N (the learner's thresholds; the
    polish weights with its own measured law, LENGTH_FACTOR). A coarser forward pass
    (float32, PyTorch's default) errs far more on long sums: nn.MultiheadAttention in
    float32 at d = 16 measured rms 15-24, 44-61 and 177-202 roundings of its terms at
    N = 128, 512 and 2048 (against its float64 truth): 0.35 N^0.83."""
    base = 8.0 + np.log2(length)
    if precision < 1e-12:
        return base
    return np.maximum(base, 0.35 * np.power(length, 0.83))


def residual_and_jacobian(samples: Samples, W: np.ndarray, v: np.ndarray,
                          b: np.ndarray | None = None, c: float | None = None,
                          jacobian: bool = True):
    """f_model - f (P,) and its Jacobian (P, H d^2 + H d) in the order (W.ravel(), v.ravel());
    with biases b (H, d) and c: (P, H d^2 + 2 H d + 1), then (b.ravel(), c)."""
    u, q, lam = samples.u, samples.q, samples.lam
    x = np.einsum("pi,hij,pj->ph", u, W, q) + lam[:, None]               # (P, H)
    if b is not None:
        x += u @ b.T                                                      # u^T b_h
    s = expit(x)
    heights = u @ v.T                                                     # (P, H)
    r = q @ v.sum(axis=0) + np.einsum("ph,ph->p", s, heights) - samples.f
    if b is not None:
        r += c
    if not jacobian:
        return r, None
    P, H = s.shape
    d = u.shape[1]
    slope = s * expit(-x) * heights                                       # (P, H)
    JW = slope[:, :, None, None] * u[:, None, :, None] * q[:, None, None, :]
    Jv = q[:, None, :] + s[:, :, None] * u[:, None, :]
    blocks = [JW.reshape(P, H * d * d), Jv.reshape(P, H * d)]
    if b is not None:
        blocks += [(slope[:, :, None] * u[:, None, :]).reshape(P, H * d), np.ones((P, 1))]
    return r, np.concatenate(blocks, axis=1)


def _relative_error(std: np.ndarray, W: np.ndarray, v: np.ndarray,
                    biases: bool = False) -> float:
    """max over heads of rms(std of W_h) / |W_h| and the same for v_h; with biases the
    std of [W_h | b_h] relative to |W_h| (as the row fits state it: b_h may be 0, its
    logits are on W's scale)."""
    H, d, _ = W.shape
    sW = std[:H * d * d].reshape(H, d * d)
    sv = std[H * d * d:H * (d * d + d)].reshape(H, d)
    if biases:
        sW = np.hstack([sW, std[H * (d * d + d):H * (d * d + 2 * d)].reshape(H, d)])
    W_rel = np.linalg.norm(sW, axis=1) / np.maximum(np.linalg.norm(W, axis=(1, 2)), 1e-300)
    v_rel = np.linalg.norm(sv, axis=1) / np.maximum(np.linalg.norm(v, axis=1), 1e-300)
    return float(np.max(np.maximum(W_rel, v_rel)))


def polish(samples: Samples, W: np.ndarray, v: np.ndarray, precision: float,
           absolute: float, predicted: float, bar: float, b: np.ndarray | None = None,
           c: float | None = None) -> Polished:
    """Joint Gauss-Newton polish of all heads on all samples (module docstring).

    Parameters
    ----------
    samples : Samples
        Every answer held (P of them); with biases the answers as the box gave them
        (c included), among them f([0]) = c.
    W, v : arrays (H, d, d), (H, d)
        The row fits' heads.
    precision, absolute : float
        The box's relative precision and absolute rounding (decimals).
    predicted, bar : float
        The row fits' predicted rms relative error and error bar.
    b, c : array (H, d) and float, optional
        The row fits' query biases and constant (both or neither): polished with the
        heads (the bar and the predicted error then cover [W_h | b_h] against |W_h|).

    Returns
    -------
    Polished
        ``kept`` False: W, v (b, c) and ``predicted`` are the row fits' own.
    """
    H, d, _ = W.shape
    biases = b is not None
    n = H * (d * d + d) + (H * d + 1 if biases else 0)
    P = samples.f.size

    def unchanged(reason: str, before: float = np.nan, after: float = np.nan,
                  own: float = np.nan) -> Polished:
        return Polished(W, v, predicted, before, after, False, reason, b, c, own)

    if P * float(n) ** 2 > MAX_WORK or n > MAX_PARAMETERS:
        return unchanged(f"skipped ({P} samples x {n} parameters: too large for a dense fit)")
    if P <= n:
        return unchanged(f"skipped (only {P} samples for {n} parameters)")
    x0 = np.concatenate([W.ravel(), v.ravel()] + ([b.ravel(), np.array([c])] if b is not None else []))
    expected = noise_of(samples, v, precision, absolute, c, W, *((b,) if biases else ()))
    noise = expected.copy()                 # rescaled per length below
    # least noise per answer: a weighted residual below it is luck. float64: the
    # expected rounding itself (weight 1); coarser answers: one rounding of the answer
    # (their forward pass's larger errors show in the residual), as the row fits' floor
    least = (np.ones(P) if precision < 1e-12 else
             (0.6 * precision * np.abs(samples.f) + 0.3 * absolute) / noise)
    try:
        x, _, _, _ = _gauss_newton(samples, x0, noise, H, d, biases)
        # feasible generalised least squares: answers of one length share a rounding
        # law, so each length's measured weighted rms (at least its least noise)
        # rescales its weights, and the fit is repeated
        r, _ = residual_and_jacobian(samples, *_split(x, H, d, biases), jacobian=False)
        for length in np.unique(samples.length):
            group = samples.length == length
            noise[group] *= max(float(np.sqrt(np.mean((r[group] / noise[group]) ** 2))),
                                float(np.sqrt(np.mean(least[group] ** 2))))
        least = least * expected / noise
        x, cost, A, scale = _gauss_newton(samples, x, noise, H, d, biases)
    except LinAlgError as exc:
        return unchanged(f"skipped ({exc})")
    r0, _ = residual_and_jacobian(samples, W, v, b, c, jacobian=False)
    cost0 = float(np.sum((r0 / noise) ** 2))
    W1, v1, b1, c1 = _split(x, H, d, biases)
    if not cost < cost0:
        return unchanged("not kept (the weighted residual did not drop)", cost0, cost)
    # covariance at the accepted point (the last Jacobian is at most one step away:
    # the step is far below the parameters' size, so its curvature is the same)
    factor, info = lapack.dpotrf(A, lower=False)
    inverse, info_inverse = lapack.dpotri(factor, lower=False) if info == 0 else (None, 1)
    if info_inverse != 0:
        return unchanged("not kept (singular covariance)", cost0, cost)
    assert inverse is not None
    inverse_diag = np.diag(inverse)
    sigma = max(float(np.sqrt(cost / (P - n))), float(np.sqrt(np.mean(least ** 2))))
    std = np.sqrt(np.maximum(inverse_diag, 0.0)) / scale * sigma
    new_predicted = _relative_error(std, W1, v1, biases)
    # with biases [W_h | b_h] moves against |W_h| and c against max(|c|, |v_h|)
    W_moved = (np.hstack([(W1 - W).reshape(H, -1), b1 - b])
               if b1 is not None and b is not None else W1 - W)
    moved = max(float(np.max(np.linalg.norm(W_moved.reshape(H, -1), axis=1)
                             / np.maximum(np.linalg.norm(W, axis=(1, 2)), 1e-300))),
                float(np.max(np.linalg.norm(v1 - v, axis=1)
                             / np.maximum(np.linalg.norm(v, axis=1), 1e-300))),
                abs(c1 - c) / max(abs(c), float(np.max(np.linalg.norm(v, axis=1))), 1e-300)
                if c1 is not None and c is not None else 0.0)
    if not new_predicted <= GROWTH * predicted:
        return unchanged(f"not kept (predicted error {new_predicted:.1e}, the row fits' "
                         f"{predicted:.1e})", cost0, cost, new_predicted)
    if not moved <= bar:
        return unchanged(f"not kept (it moved a head by {moved:.1e}, beyond the row fits' "
                         f"error bar {bar:.1e})", cost0, cost, new_predicted)
    return Polished(W1, v1, new_predicted, cost0, cost, True, "kept", b1, c1, new_predicted)


def _split(x: np.ndarray, H: int, d: int, biases: bool = False
           ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, float | None]:
    """The parameter vector as (W (H, d, d), v (H, d), b (H, d) or None, c or None)."""
    W, v = x[:H * d * d].reshape(H, d, d), x[H * d * d:H * (d * d + d)].reshape(H, d)
    if not biases:
        return W, v, None, None
    return W, v, x[H * (d * d + d):H * (d * d + 2 * d)].reshape(H, d), float(x[-1])


def _gauss_newton(samples: Samples, x: np.ndarray, noise: np.ndarray, H: int, d: int,
                  biases: bool = False):
    """Gauss-Newton on |r / noise|^2 from x; returns (x, cost, A, scale): the normal
    matrix A of the column-scaled Jacobian (scale its column norms) at the last
    linearisation. Raises LinAlgError when no sample depends on a parameter."""
    n, P = x.size, samples.f.size
    r, _ = residual_and_jacobian(samples, *_split(x, H, d, biases), jacobian=False)
    cost = float(np.sum((r / noise) ** 2))
    A = scale = None
    for _ in range(ITERATIONS):
        r, J = residual_and_jacobian(samples, *_split(x, H, d, biases))
        J /= noise[:, None]
        rw = r / noise
        scale = np.linalg.norm(J, axis=0)
        if not (np.all(np.isfinite(J)) and np.all(scale > 0)):
            raise LinAlgError("a parameter no sample depends on")
        J /= scale
        A = np.zeros((n, n))
        for lo in range(0, P, CHUNK):
            A += J[lo:lo + CHUNK].T @ J[lo:lo + CHUNK]
        step = -cho_solve(cho_factor(A), J.T @ rw) / scale
        trial = x + step
        r_new, _ = residual_and_jacobian(samples, *_split(trial, H, d, biases), jacobian=False)
        cost_new = float(np.sum((r_new / noise) ** 2))
        if not cost_new < cost:
            break
        improvement = (cost - cost_new) / cost
        x, cost = trial, cost_new
        if improvement < 1e-3:
            break
    return x, cost, A, scale
