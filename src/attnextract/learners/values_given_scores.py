"""The value-output circuits O_h and the constant c of a layer whose score circuits are known.

Once a scalar learner has read a layer's heads through one readout r, the score circuits
(W_h, b_h) are known exactly but each head's value-output circuit only along r
(v_h = O_h^T r). A black box that answers the whole output vector at the last position,

    F(X) = sum_h O_h X^T softmax(X (W_h x_N + b_h)) + c     in R^m,

is linear in the unknowns [c | O_1 | ... | O_H] (m x (1 + H d)) once the attention
weights are computable, and they are: F(X) = M phi(X) with
phi(X) = [1; X^T alpha_1(X); ...; X^T alpha_H(X)]. So O and c follow from one batch of
n >= 1 + H d sequences by least squares (docs/algorithms.md, "Vector outputs").

Free tokens (a post-LN layer such as BERT's): the unknowns separate by direction. c from
one zero token, O = sum_h O_h from d single tokens, then for each direction u_k of a
random orthonormal basis 2H pairs [q_j + u_k; q_j] give F - c - O q_j =
sum_h sigma_h(q_j) O_h u_k, a 2H x H solve for the vectors O_h u_k (:func:`_by_directions`:
1 + d + 2Hd queries, 9601 for a MiniLM layer, and d small solves). The logits are spread
to LOGIT (sigmoids that all saturate would make the heads' columns coincide).

On the sphere of a pre-LayerNorm layer (``basis`` given: tokens of zero mean and norm R)
single tokens and free directions are not available (a pair q, q + u stays on the sphere
only if q^T u = -|u|^2 / 2): pairs are drawn on the sphere, phi is written in the
hyperplane's coordinates and solved whole by least squares (only O_h P is identified).
"""

from __future__ import annotations

import math
import time

import numpy as np
from scipy.linalg import solve_triangular
from scipy.linalg.lapack import dtrcon

from ..errors import ModelMismatchError, RecoveryFailedError

LOGIT = 2.0          # the largest head logit of a designed pair
OVERSAMPLE = 2.0     # sequences per unknown column of phi (on the sphere)
PAIRS_PER_HEAD = 2   # pairs per direction u_k and head (free tokens)
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
    if basis is None:
        return _by_directions(ask, W, b, rng, verify_tolerance, start)
    H, k = W.shape[0], basis.shape[1]
    count = math.ceil(OVERSAMPLE * (1 + H * k))
    X = _pairs_on_sphere(W, b, count, rng, basis, radius)
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
    scale = float(np.median(np.linalg.norm(X[:, 1], axis=1)))
    held_out = _held_out(ask, W, b, M, basis, radius, scale, rng, verify_tolerance)
    bar = float(condition * EPS * math.sqrt(count))
    return {"O": O, "c": c, "queries": count + HELD_OUT, "condition": condition,
            "error_bar": bar, "held_out_error": held_out,
            "seconds": time.perf_counter() - start}


def _by_directions(ask, W, b, rng, verify_tolerance, start) -> dict:
    """Free tokens (no LayerNorm in front): c from one zero token, O = sum_h O_h from d
    single tokens (each head attends to its one token whole), then per direction u_k of a
    random orthonormal basis J = 2H pairs [q_j + u_k; q_j]:

        F - c - O q_j = sum_h sigma(u_k^T (W_h q_j + b_h)) O_h u_k,

    a J x H solve for the H vectors O_h u_k (the sigmoids are known). O_h = [O_h u_k] U^T.
    1 + d + 2 H d queries and d solves of J x H: no (H d)-wide least squares."""
    H, d = W.shape[0], W.shape[1]
    J = PAIRS_PER_HEAD * H
    U = np.linalg.qr(rng.standard_normal((d, d)))[0]
    q = rng.standard_normal((d, J, d))
    # logits t[k, j, h] = a_k u_k^T (W_h q_j + b_h): a_k sets their spread to LOGIT
    t = np.einsum("dk,hde,kje->kjh", U, W, q) + np.einsum("dk,hd->kh", U, b)[:, None, :]
    a = LOGIT / np.maximum(t.std(axis=(1, 2)), 1e-300)
    t *= a[:, None, None]
    scale = float(np.sqrt(d))                       # the pairs' query tokens have norm ~ sqrt(d)
    singles = np.vstack([np.zeros((1, d)), scale * np.eye(d)])[:, None, :]
    pairs = np.stack([q + (a[:, None] * U.T)[:, None, :], q], axis=2).reshape(d * J, 2, d)
    F = np.asarray(ask(singles), dtype=np.float64)
    c = F[0]
    O = (F[1:] - c).T / scale                        # (m, d) = sum_h O_h
    Y = np.asarray(ask(pairs), dtype=np.float64).reshape(d, J, -1)
    Y = Y - c - np.einsum("md,kjd->kjm", O, q)
    S = 1.0 / (1.0 + np.exp(-t))                    # (d, J, H)
    Z = np.stack([np.linalg.lstsq(S[k], Y[k], rcond=None)[0] for k in range(d)])  # (d, H, m)
    conditions = np.linalg.cond(S)
    condition = float(conditions.max())
    if not np.isfinite(condition) or condition > 1e8:
        raise RecoveryFailedError(f"the value stage's pairs do not separate the heads "
                                  f"(condition {condition:.1e}): two heads attend alike")
    Ou = Z / a[:, None, None]                        # O_h u_k
    O_heads = np.einsum("khm,dk->hmd", Ou, U)        # O_h = [O_h u_k] U^T
    M = np.vstack([c[None, :], O_heads.transpose(0, 2, 1).reshape(H * d, -1)])
    held_out = _held_out(ask, W, b, M, None, None, scale, rng, verify_tolerance)
    return {"O": O_heads, "c": c, "queries": 1 + d + d * J + HELD_OUT,
            "condition": condition, "error_bar": float(condition * EPS * math.sqrt(J)),
            "held_out_error": held_out, "seconds": time.perf_counter() - start}


def _held_out(ask, W, b, M, basis, radius, scale, rng, verify_tolerance) -> float:
    """Largest relative error of the model's output vectors on HELD_OUT sequences of 1 to
    16 tokens at the probes' scale, never asked before; refused above the tolerance."""
    d = W.shape[1]
    lengths = rng.integers(1, 17, size=HELD_OUT)
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
    if not held_out <= verify_tolerance:
        raise ModelMismatchError(f"the layer's output vectors are not those of its heads: "
                                 f"held-out relative error {held_out:.2e} > "
                                 f"{verify_tolerance:.0e}")
    return held_out


def _features(X, W, b, basis):
    phi = attention_features(X, W, b)
    if basis is None:
        return phi
    H = W.shape[0]
    mixed = phi[:, 1:].reshape(len(X), H, -1) @ basis
    return np.hstack([phi[:, :1], mixed.reshape(len(X), -1)])
