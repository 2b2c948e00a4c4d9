"""The value-output circuits O_h and the constant c of a layer whose score circuits are known.

Once a scalar learner has read a layer's heads through one readout r, the score circuits
(W_h, b_h) are known exactly but each head's value-output circuit only along r
(v_h = O_h^T r). A black box that answers the whole output vector at the last position,

    F(X) = sum_h O_h X^T softmax(X (W_h x_N + b_h)) + c     in R^m,

is linear in the unknowns [c | O_1 | ... | O_H] (m x (1 + H d)) once the attention
weights are computable, and they are: F(X) = M phi(X) with
phi(X) = [1; X^T alpha_1(X); ...; X^T alpha_H(X)]. So O and c follow from one batch of
n >= 1 + H d sequences by least squares (docs/algorithms.md, "Vector outputs").

Design (no query spent on it): two-token sequences [q + u; q] with q ~ N(0, I) and u
scaled per sequence so that the largest head logit |u^T (W_h q + b_h)| is LOGIT (the
attention weights sigma(t_h) then differ across heads, which is what separates the heads'
blocks of phi; saturated weights would make them coincide). The condition number of phi
is computed before anything is sent and sets the error bar.

On the sphere of a pre-LayerNorm layer (``basis`` given: tokens of zero mean and norm R)
the pairs are drawn on the sphere and phi is written in the hyperplane's coordinates:
only O_h P is identified there.
"""

from __future__ import annotations

import math
import time

import numpy as np
from scipy.linalg import solve_triangular
from scipy.linalg.lapack import dtrcon

from ..errors import ModelMismatchError, RecoveryFailedError

LOGIT = 2.0          # the largest head logit of a designed pair
OVERSAMPLE = 2.0     # sequences per unknown column of phi
HELD_OUT = 64        # held-out sequences of the check
EPS = np.finfo(float).eps


def attention_features(X: np.ndarray, W: np.ndarray, b: np.ndarray) -> np.ndarray:
    """phi(X) = [1; X^T alpha_h(X) for every head], (B, 1 + H d), read at the last token."""
    scores = np.einsum("bnd,hde,be->bhn", X, W, X[:, -1]) + np.einsum("bnd,hd->bhn", X, b)
    scores -= scores.max(axis=-1, keepdims=True)
    alpha = np.exp(scores)
    alpha /= alpha.sum(axis=-1, keepdims=True)
    mixed = np.einsum("bhn,bnd->bhd", alpha, X).reshape(len(X), -1)
    return np.hstack([np.ones((len(X), 1)), mixed])


def _pairs_free(W, b, count, rng):
    d = W.shape[1]
    q = rng.standard_normal((count, d))
    u = rng.standard_normal((count, d))
    t = np.abs(np.einsum("bd,hde,be->bh", u, W, q) + u @ b.T).max(axis=1)
    u *= (LOGIT / np.maximum(t, 1e-300))[:, None]
    return np.stack([q + u, q], axis=1)


def _pairs_on_sphere(W, b, count, rng, basis, radius):
    z = rng.standard_normal((2, count, basis.shape[1]))
    q = z[0] @ basis.T
    q *= radius / np.linalg.norm(q, axis=1, keepdims=True)
    e = z[1] @ basis.T
    e -= np.sum(e * q, axis=1, keepdims=True) * q / radius ** 2
    e *= radius / np.linalg.norm(e, axis=1, keepdims=True)
    # the angle from q sets the logits; pick it per pair so the largest is near LOGIT
    best = np.full(count, np.inf)
    keys = q.copy()
    for angle in np.linspace(0.05, 1.5, 30):
        a = math.cos(angle) * q + math.sin(angle) * e
        t = np.abs(np.einsum("bd,hde,be->bh", a - q, W, q) + (a - q) @ b.T).max(axis=1)
        better = np.abs(t - LOGIT) < best
        best = np.where(better, np.abs(t - LOGIT), best)
        keys[better] = a[better]
    return np.stack([keys, q], axis=1)


def extract_values(ask, W: np.ndarray, b: np.ndarray, *, seed=None, basis=None,
                   radius: float | None = None, verify_tolerance: float = 1e-7) -> dict:
    """O_h and c from vector answers, with (W_h, b_h) known.

    Parameters
    ----------
    ask : callable
        (B, N, d) -> (B, m): the black box's output vector at the last position.
    W : array (H, d, d)
    b : array (H, d)
        The known score circuits (canonical, as a scalar learner returned them).
    seed : int, optional
        Seed of the designed pairs and the held-out sequences.
    basis : array (d, d - 1), optional
        Orthonormal basis of the hyperplane 1^T x = 0: a pre-LayerNorm layer, probed on
        the sphere of ``radius``.
    verify_tolerance : float
        Largest held-out relative error of the output vectors accepted.

    Returns
    -------
    dict
        ``O`` (H, m, d), ``c`` (m,), ``queries`` (designed + held-out), ``condition``
        (of phi), ``error_bar`` (relative, first order), ``held_out_error``, ``seconds``.

    Raises
    ------
    RecoveryFailedError
        phi is singular (two heads with the same attention everywhere).
    ModelMismatchError
        The held-out vectors differ from the model's by more than ``verify_tolerance``.
    """
    start = time.perf_counter()
    rng = np.random.default_rng(seed)
    H, d = W.shape[0], W.shape[1]
    k = d if basis is None else basis.shape[1]
    count = math.ceil(OVERSAMPLE * (1 + H * k))
    X = (_pairs_free(W, b, count, rng) if basis is None
         else _pairs_on_sphere(W, b, count, rng, basis, radius))
    phi = _features(X, W, b, basis)
    # least squares by QR (an SVD of phi costs several times more at MiniLM's 9218 x 4609),
    # its condition estimated from the triangular factor in O(n^2) (LAPACK trcon)
    Q, R = np.linalg.qr(phi)
    rcond, info = dtrcon(R, norm="1", uplo="U", diag="N")
    condition = float(1.0 / rcond) if info == 0 and rcond > 0 else math.inf
    if condition > 1e10:
        raise RecoveryFailedError(f"the value stage's design is singular (condition "
                                  f"{condition:.1e}): two heads attend alike")
    F = np.asarray(ask(X), dtype=np.float64)
    M = solve_triangular(R, Q.T @ F)                      # (1 + H k, m)
    c = M[0]
    O = M[1:].reshape(H, k, -1).transpose(0, 2, 1)       # (H, m, k)
    if basis is not None:
        O = O @ basis.T                                   # O_h P in the token coordinates
    # held-out: sequences of 1 to 16 tokens at the designed scale, never asked before
    lengths = rng.integers(1, 17, size=HELD_OUT)
    scale = float(np.median(np.linalg.norm(X[:, 1], axis=1)))
    errors = []
    for n in map(int, np.unique(lengths)):
        Z = rng.standard_normal((int(np.sum(lengths == n)), n, d))
        if basis is not None:
            Z = Z @ basis @ basis.T
        Z *= (scale if basis is None else radius) / np.linalg.norm(Z, axis=2, keepdims=True)
        truth = np.asarray(ask(Z), dtype=np.float64)
        model = _features(Z, W, b, basis) @ M
        errors.append(np.linalg.norm(model - truth, axis=1)
                      / np.maximum(np.linalg.norm(truth, axis=1), 1e-300))
    held_out = float(np.max(np.concatenate(errors)))
    bar = float(condition * EPS * math.sqrt(count))
    if not held_out <= verify_tolerance:
        raise ModelMismatchError(f"the layer's output vectors are not those of its heads: "
                                 f"held-out relative error {held_out:.2e} > "
                                 f"{verify_tolerance:.0e}")
    return {"O": O, "c": c, "queries": count + HELD_OUT, "condition": condition,
            "error_bar": bar, "held_out_error": held_out,
            "seconds": time.perf_counter() - start}


def _features(X, W, b, basis):
    phi = attention_features(X, W, b)
    if basis is None:
        return phi
    H = W.shape[0]
    mixed = phi[:, 1:].reshape(len(X), H, -1) @ basis
    return np.hstack([phi[:, :1], mixed.reshape(len(X), -1)])
