"""What a black box computes.

Every model maps a batch of token sequences ``X`` of shape (B, N, d) to one real
number per sequence, the output read at the last token, shape (B,) (a single
sequence (N, d) gives a float), except :class:`VectorAttention`, which answers the
layer's whole output vector: (B, m) at the last position, (B, N, m) at every one. The
same classes serve as targets and as recovered
models.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numpy.typing import ArrayLike

from .errors import InputError


def softmax(scores: np.ndarray) -> np.ndarray:
    """Numerically stable softmax over the last axis (shift by the maximum)."""
    shifted = scores - scores.max(axis=-1, keepdims=True)
    weights = np.exp(shifted)
    return weights / weights.sum(axis=-1, keepdims=True)


def as_sequences(X: ArrayLike, dim: int) -> tuple[np.ndarray, bool]:
    """Validate X as (N, d) or (B, N, d) float64; returns (batch, was_single)."""
    X = np.asarray(X, dtype=np.float64)
    single = X.ndim == 2
    if single:
        X = X[None]
    if X.ndim != 3 or X.shape[1] < 1 or X.shape[2] != dim:
        raise InputError(
            f"expected a sequence (N, {dim}) or a batch (B, N, {dim}) with N >= 1, "
            f"got shape {np.shape(X)}"
        )
    return X, single


def attention_weights(X: np.ndarray, W: np.ndarray) -> np.ndarray:
    """alpha = softmax(X W x_N) for a batch X (B, N, d): the last token's attention (B, N)."""
    return softmax(np.einsum("bnd,bd->bn", X, X[:, -1, :] @ W.T))


def attention_output(X: np.ndarray, W: np.ndarray) -> np.ndarray:
    """h(X) = X^T softmax(X W x_N) for a batch X (B, N, d): the attended token (B, d)."""
    return np.einsum("bn,bnd->bd", attention_weights(X, W), X)


class Regressor:
    """What every model shares: called on one sequence (N, d) it returns a float, on a
    batch (B, N, d) an array (B,); ``parameters()`` returns the arrays named in
    PARAMETERS (the keys of a result file: arrays, and numpy scalars for options such as
    ``positions``). A subclass sets ``kind``, PARAMETERS and
    ``dim`` and computes ``outputs(X)`` on a validated batch."""

    kind = ""
    PARAMETERS: tuple[str, ...] = ()

    @property
    def dim(self) -> int:
        raise NotImplementedError

    def outputs(self, X: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def __call__(self, X: ArrayLike) -> float | np.ndarray:
        X, single = as_sequences(X, self.dim)
        out = self.outputs(X)
        return float(out[0]) if single else out

    def parameters(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.PARAMETERS}


def _square_matrix(W: ArrayLike, what: str) -> np.ndarray:
    """Validate a finite square query-key matrix W (d, d)."""
    W = np.array(W, dtype=np.float64)
    if W.ndim != 2 or W.shape[0] != W.shape[1]:
        raise InputError(f"{what}: W must be square (d, d), got shape {W.shape}")
    if not np.all(np.isfinite(W)):
        raise InputError(f"{what}: W must be finite")
    return W


class StackedHeads(Regressor):
    """A model whose heads' W are stacked (H, d, d): its width and head count read off W."""

    W: np.ndarray

    @property
    def dim(self) -> int:
        return self.W.shape[1]

    @property
    def heads(self) -> int:
        return self.W.shape[0]


class SingleHeadAttention(Regressor):
    """Single-head softmax attention regressor read at the last token.

    f(X) = softmax(X W x_N)^T X v, with X = [x_1; ...; x_N] of shape (N, d).

    Parameters
    ----------
    W : array (d, d)
        Merged query-key matrix (W = Q K^T up to a scale).
    v : array (d,)
        Merged value-output readout vector.
    """

    kind, PARAMETERS = "single-head", ("W", "v")

    def __init__(self, W: ArrayLike, v: ArrayLike) -> None:
        W = _square_matrix(W, "SingleHeadAttention")
        v = np.array(v, dtype=np.float64)
        if v.shape != (W.shape[0],):
            raise InputError(f"v must have shape ({W.shape[0]},), got {v.shape}")
        if not np.all(np.isfinite(v)):
            raise InputError("v must be finite")
        self.W, self.v = W, v

    @property
    def dim(self) -> int:
        return self.W.shape[0]

    def outputs(self, X: np.ndarray) -> np.ndarray:
        return np.einsum("bn,bn->b", attention_weights(X, self.W), X @ self.v)

    def __repr__(self) -> str:
        return f"SingleHeadAttention(d={self.dim})"


def _relu_parameters(A: ArrayLike, w: ArrayLike, what: str) -> tuple[np.ndarray, np.ndarray]:
    """Validate the feed-forward parameters A (m, d), w (m,) of a bias-free ReLU layer."""
    A = np.array(A, dtype=np.float64)
    w = np.array(w, dtype=np.float64)
    if A.ndim != 2 or A.shape[0] < 1 or A.shape[1] < 1:
        raise InputError(f"{what}: A must have shape (m, d) with m, d >= 1, got {A.shape}")
    if w.shape != (A.shape[0],):
        raise InputError(f"{what}: w must have shape ({A.shape[0]},), got {w.shape}")
    if not (np.all(np.isfinite(A)) and np.all(np.isfinite(w))):
        raise InputError(f"{what}: A and w must be finite")
    return A, w


class ReLUNetwork(Regressor):
    """Bias-free one-hidden-layer ReLU network applied to the last token.

    F(x) = w^T ReLU(A x), read at x = x_N for a sequence X = [x_1; ...; x_N]
    (a length-1 sequence [x] gives F(x)).

    Parameters
    ----------
    A : array (m, d)
        Hidden-unit weights, one row a_i per unit.
    w : array (m,)
        Output weights.
    """

    kind, PARAMETERS = "relu-network", ("A", "w")

    def __init__(self, A: ArrayLike, w: ArrayLike) -> None:
        self.A, self.w = _relu_parameters(A, w, "ReLUNetwork")

    @property
    def dim(self) -> int:
        return self.A.shape[1]

    @property
    def width(self) -> int:
        """Number of hidden units m."""
        return self.A.shape[0]

    def forward(self, x: np.ndarray) -> np.ndarray:
        """F on vectors: x (..., d) -> (...)."""
        return np.maximum(x @ self.A.T, 0.0) @ self.w

    def outputs(self, X: np.ndarray) -> np.ndarray:
        return self.forward(X[:, -1, :])

    def __repr__(self) -> str:
        return f"ReLUNetwork(d={self.dim}, m={self.width})"


class OneLayerTransformer(Regressor):
    """Single-head attention followed by a bias-free ReLU feed-forward layer.

    h(X) = X^T softmax(X W x_N),  f(X) = w^T ReLU(A h(X))  (the single-head paper's form; the value
    and output projections are merged into A).

    Parameters
    ----------
    W : array (d, d)
        Merged query-key matrix.
    A : array (m, d)
        Feed-forward hidden weights (value projection merged in).
    w : array (m,)
        Feed-forward output weights.
    """

    kind, PARAMETERS = "one-layer", ("W", "A", "w")

    def __init__(self, W: ArrayLike, A: ArrayLike, w: ArrayLike) -> None:
        W = _square_matrix(W, "OneLayerTransformer")
        A, w = _relu_parameters(A, w, "OneLayerTransformer")
        if A.shape[1] != W.shape[0]:
            raise InputError(f"A must have {W.shape[0]} columns to match W, got {A.shape}")
        self.W, self.A, self.w = W, A, w

    @property
    def dim(self) -> int:
        return self.W.shape[0]

    @property
    def width(self) -> int:
        return self.A.shape[0]

    def attend(self, X: np.ndarray) -> np.ndarray:
        """h(X) = X^T softmax(X W x_N) for a batch (B, N, d) -> (B, d)."""
        return attention_output(X, self.W)

    def outputs(self, X: np.ndarray) -> np.ndarray:
        return np.maximum(self.attend(X) @ self.A.T, 0.0) @ self.w

    def __repr__(self) -> str:
        return f"OneLayerTransformer(d={self.dim}, m={self.width})"


class MultiHeadAttention(StackedHeads):
    """Multi-head softmax attention regressor read at the last token.

    f(X) = sum_h softmax(X W_h x_N)^T X v_h, h = 1..H. H = 0 is allowed (f = 0).

    Parameters
    ----------
    W : array (H, d, d)
        Merged query-key matrix of every head.
    v : array (H, d)
        Merged value-output readout vector of every head.
    """

    kind, PARAMETERS = "multi-head", ("W", "v")

    def __init__(self, W: ArrayLike, v: ArrayLike) -> None:
        W = np.array(W, dtype=np.float64)
        v = np.array(v, dtype=np.float64)
        if W.ndim != 3 or W.shape[1] != W.shape[2] or W.shape[1] < 1:
            raise InputError(f"W must have shape (H, d, d) with d >= 1, got {W.shape}")
        if v.shape != W.shape[:2]:
            raise InputError(f"v must have shape {W.shape[:2]} (H, d), got {v.shape}")
        if not (np.all(np.isfinite(W)) and np.all(np.isfinite(v))):
            raise InputError("W and v must be finite")
        self.W, self.v = W, v

    def outputs(self, X: np.ndarray) -> np.ndarray:
        out = np.zeros(X.shape[0])
        for W, v in zip(self.W, self.v):                 # H is small: one pass per head
            out += np.einsum("bn,bn->b", attention_weights(X, W), X @ v)
        return out

    def __repr__(self) -> str:
        return f"MultiHeadAttention(H={self.heads}, d={self.dim})"


def _biases(b: ArrayLike, c: ArrayLike, shape: tuple[int, ...], what: str) -> tuple[np.ndarray, float]:
    """Validate finite query biases b of ``shape`` and a finite scalar output bias c."""
    b = np.array(b, dtype=np.float64)
    if b.shape != shape:
        raise InputError(f"{what}: b must have shape {shape}, got {b.shape}")
    c = np.asarray(c, dtype=np.float64)
    if c.size != 1:
        raise InputError(f"{what}: c must be a scalar, got shape {c.shape}")
    if not (np.all(np.isfinite(b)) and np.isfinite(c).all()):
        raise InputError(f"{what}: b and c must be finite")
    return b, float(c.reshape(()))


def biased_attention_weights(X: np.ndarray, W: np.ndarray, b: np.ndarray) -> np.ndarray:
    """alpha = softmax(X (W x_N + b)) for a batch X (B, N, d): shape (B, N)."""
    return softmax(np.einsum("bnd,bd->bn", X, X[:, -1, :] @ W.T + b))


class BiasedSingleHeadAttention(Regressor):
    """Single-head attention as deployed layers compute it: query, value and output biases.

    f(X) = softmax(X (W x_N + b))^T X v + c. With W = W_k^T W_q / sqrt(d_h),
    b = W_k^T b_q / sqrt(d_h) (the key bias cancels in the softmax), v the value-output
    readout and c the value and output biases read out (docs/algorithms.md, "Biases").

    Parameters
    ----------
    W : array (d, d)
        Merged query-key matrix.
    v : array (d,)
        Merged value-output readout vector.
    b : array (d,)
        Merged query bias (every score x_i^T b gains it).
    c : float
        Output constant.
    """

    kind, PARAMETERS = "biased-single-head", ("W", "v", "b", "c")

    def __init__(self, W: ArrayLike, v: ArrayLike, b: ArrayLike, c: float = 0.0) -> None:
        head = SingleHeadAttention(W, v)
        self.W, self.v = head.W, head.v
        self.b, self.c = _biases(b, c, self.v.shape, "BiasedSingleHeadAttention")

    @property
    def dim(self) -> int:
        return self.W.shape[0]

    def outputs(self, X: np.ndarray) -> np.ndarray:
        return np.einsum("bn,bn->b", biased_attention_weights(X, self.W, self.b), X @ self.v) + self.c

    def __repr__(self) -> str:
        return f"BiasedSingleHeadAttention(d={self.dim})"


class BiasedMultiHeadAttention(StackedHeads):
    """Multi-head attention with query, value and output biases, read at the last token.

    f(X) = sum_h softmax(X (W_h x_N + b_h))^T X v_h + c, h = 1..H.

    Parameters
    ----------
    W : array (H, d, d)
    v : array (H, d)
    b : array (H, d)
        Merged query bias of every head.
    c : float
        Output constant (all heads' value biases and the output bias, read out).
    """

    kind, PARAMETERS = "biased-multi-head", ("W", "v", "b", "c")

    def __init__(self, W: ArrayLike, v: ArrayLike, b: ArrayLike, c: float = 0.0) -> None:
        heads = MultiHeadAttention(W, v)
        self.W, self.v = heads.W, heads.v
        self.b, self.c = _biases(b, c, self.v.shape, "BiasedMultiHeadAttention")

    def outputs(self, X: np.ndarray) -> np.ndarray:
        out = np.full(X.shape[0], self.c)
        for W, v, b in zip(self.W, self.v, self.b):      # H is small: one pass per head
            out += np.einsum("bn,bn->b", biased_attention_weights(X, W, b), X @ v)
        return out

    def __repr__(self) -> str:
        return f"BiasedMultiHeadAttention(H={self.heads}, d={self.dim})"


def layer_norm(X: np.ndarray, gamma: np.ndarray, beta: np.ndarray, eps: float) -> np.ndarray:
    """LN(x) = gamma * (x - mean(x)) / sqrt(var(x) + eps) + beta per token (last axis)."""
    centred = X - X.mean(axis=-1, keepdims=True)
    return gamma * centred / np.sqrt((centred * centred).mean(axis=-1, keepdims=True) + eps) + beta


class PreLayerNormAttention(Regressor):
    """A pre-LayerNorm (GPT-2 style) attention block, read at the last token by r.

    f(X) = r^T x_N + sum_h softmax(Y (W_h y_N + b_h))^T Y v_h + c,  Y = LN(X) per token,

    the residual stream plus biased multi-head attention on the normalised tokens
    (W_h, b_h, v_h, c merged as in :class:`BiasedMultiHeadAttention`). A black box can
    only tell :meth:`on_sphere` of it (docs/algorithms.md, "Pre-LayerNorm layer").

    Parameters
    ----------
    gamma, beta : array (d,)
        LayerNorm scale and shift.
    W : array (H, d, d);  b, v : array (H, d);  c : float
        The attention's merged parameters, acting on LN(x).
    r : array (d,)
        Readout of the residual stream x_N.
    eps : float
        LayerNorm's variance floor (> 0; torch's default 1e-5).
    """

    kind = "pre-ln-attention"
    PARAMETERS = ("gamma", "beta", "W", "b", "v", "c", "r", "eps")

    def __init__(self, gamma: ArrayLike, beta: ArrayLike, W: ArrayLike, b: ArrayLike,
                 v: ArrayLike, c: float = 0.0, r: ArrayLike | None = None,
                 eps: float = 1e-5) -> None:
        self.attention = BiasedMultiHeadAttention(W, v, b, c)
        self.W, self.v, self.b, self.c = (self.attention.W, self.attention.v,
                                          self.attention.b, self.attention.c)
        d = self.dim
        self.gamma, self.beta = (np.array(a, dtype=np.float64) for a in (gamma, beta))
        self.r = np.zeros(d) if r is None else np.array(r, dtype=np.float64)
        self.eps = float(np.asarray(eps, dtype=np.float64).reshape(()))
        if any(a.shape != (d,) or not np.all(np.isfinite(a))
               for a in (self.gamma, self.beta, self.r)):
            raise InputError(f"PreLayerNormAttention: gamma, beta and r must be finite ({d},)")
        if not (np.isfinite(self.eps) and self.eps > 0):
            raise InputError(f"PreLayerNormAttention: eps must be positive, got {self.eps}")

    @property
    def dim(self) -> int:
        return self.W.shape[1]

    def outputs(self, X: np.ndarray) -> np.ndarray:
        Y = layer_norm(X, self.gamma, self.beta, self.eps)
        return X[:, -1, :] @ self.r + self.attention.outputs(Y)

    def on_sphere(self, radius: float) -> "SphereAttention":
        """What the box computes on tokens with zero mean and norm ``radius``: there
        LN(x) = A x + beta with A = diag(gamma) / s, s = sqrt(radius^2 / d + eps), so
        the block is a biased head in x with W_h' = A W_h A, b_h' = A (W_h beta + b_h),
        v_h' = A v_h, c' = c + sum_h beta^T v_h (beta^T W_h (A x_N + beta) is the same for
        every key and cancels in the softmax), plus r^T x_N."""
        A = self.gamma / np.sqrt(radius ** 2 / self.dim + self.eps)
        return SphereAttention(A[None, :, None] * self.W * A[None, None, :],
                               A * (self.W @ self.beta + self.b), A * self.v,
                               self.c + float(np.sum(self.v @ self.beta)), self.r, radius)

    def __repr__(self) -> str:
        return f"PreLayerNormAttention(H={self.W.shape[0]}, d={self.dim})"


SPHERE_TOLERANCE = 1e-9    # relative: how far off the sphere a token may be


class SphereAttention(StackedHeads):
    """A pre-LayerNorm block as far as it is identifiable: on the sphere
    S = {x : 1^T x = 0, |x| = radius},

    f(X) = r^T x_N + sum_h softmax(X (W_h x_N + b_h))^T X v_h + c,   x_i in S.

    Only the restriction to the hyperplane 1^T x = 0 of each parameter is seen, so
    they are stored projected: W_h <- P W_h P, b_h <- P b_h, v_h <- P v_h, r <- P r,
    P = I - 1 1^T / d. Tokens off S raise :class:`InputError`: nothing is known there.
    """

    kind, PARAMETERS = "pre-ln-sphere", ("W", "b", "v", "c", "r", "radius")

    def __init__(self, W: ArrayLike, b: ArrayLike, v: ArrayLike, c: float, r: ArrayLike,
                 radius: float) -> None:
        heads = BiasedMultiHeadAttention(W, v, b, c)
        d = heads.dim
        P = np.eye(d) - 1.0 / d
        self.radius = float(np.asarray(radius, dtype=np.float64).reshape(()))
        r = np.array(r, dtype=np.float64)
        if r.shape != (d,) or not np.all(np.isfinite(r)):
            raise InputError(f"SphereAttention: r must be finite ({d},), got shape {r.shape}")
        if not (np.isfinite(self.radius) and self.radius > 0):
            raise InputError(f"SphereAttention: radius must be positive, got {self.radius}")
        self.W, self.b, self.v = P @ heads.W @ P, heads.b @ P, heads.v @ P
        self.c, self.r = heads.c, P @ r
        self.heads_model = BiasedMultiHeadAttention(self.W, self.v, self.b, self.c)

    def outputs(self, X: np.ndarray) -> np.ndarray:
        means = np.abs(X.sum(axis=-1)) / np.sqrt(self.dim)
        norms = np.linalg.norm(X, axis=-1)
        if np.any(means > SPHERE_TOLERANCE * self.radius) or np.any(
                np.abs(norms - self.radius) > SPHERE_TOLERANCE * self.radius):
            raise InputError(f"SphereAttention is known only on tokens with zero mean and "
                             f"norm {self.radius:.6g}; a pre-LayerNorm box is not identified "
                             f"elsewhere")
        return X[:, -1, :] @ self.r + self.heads_model.outputs(X)

    def __repr__(self) -> str:
        return f"SphereAttention(H={self.heads}, d={self.dim}, radius={self.radius:.6g})"


class ResidualOneLayer(Regressor):
    """One-layer Transformer with a residual connection, in merged form.

    f(X) = w^T ReLU(A x_N + B X^T softmax(X W x_N)); the residual model
    h(X) = x_N + V^T X^T softmax(...), f = w^T ReLU(A h) is B = A V^T
    (:meth:`from_value_matrix`).

    Parameters
    ----------
    W : array (d, d)
    A : array (m, d)
        FFN weights applied to the residual stream x_N.
    B : array (m, d)
        FFN weights applied to the attention output (A V^T).
    w : array (m,)
    """

    kind, PARAMETERS = "one-layer-residual", ("W", "A", "B", "w")

    def __init__(self, W: ArrayLike, A: ArrayLike, B: ArrayLike, w: ArrayLike) -> None:
        W = _square_matrix(W, "ResidualOneLayer")
        A, w = _relu_parameters(A, w, "ResidualOneLayer")
        B = np.array(B, dtype=np.float64)
        if A.shape[1] != W.shape[0] or B.shape != A.shape or not np.all(np.isfinite(B)):
            raise InputError(f"A and B must be finite ({A.shape[0]}, {W.shape[0]}) arrays, "
                             f"got {A.shape} and {B.shape}")
        self.W, self.A, self.B, self.w = W, A, B, w

    @classmethod
    def from_value_matrix(cls, W: ArrayLike, V: ArrayLike, A: ArrayLike, w: ArrayLike) -> "ResidualOneLayer":
        """The model with h(X) = x_N + V^T X^T softmax(X W x_N), f = w^T ReLU(A h)."""
        A = np.asarray(A, dtype=np.float64)
        return cls(W, A, A @ np.asarray(V, dtype=np.float64).T, w)

    @property
    def dim(self) -> int:
        return self.W.shape[0]

    @property
    def width(self) -> int:
        return self.A.shape[0]

    def value_matrix(self) -> np.ndarray:
        """V (d, d) with B = A V^T (least squares; exact when A has full column rank)."""
        return np.linalg.lstsq(self.A, self.B, rcond=None)[0].T

    def outputs(self, X: np.ndarray) -> np.ndarray:
        z = attention_output(X, self.W)
        return np.maximum(X[:, -1, :] @ self.A.T + z @ self.B.T, 0.0) @ self.w

    def __repr__(self) -> str:
        return f"ResidualOneLayer(d={self.dim}, m={self.width})"


class TransformerLayer(StackedHeads):
    """Multi-head attention followed by a ReLU feed-forward layer with biases.

    y(X) = [x_N +] sum_h V_h X^T softmax(X W_h x_N),   f(X) = w^T ReLU(A y(X) + b) + c0,

    the bracketed residual term present when ``residual`` is true. With one head and
    b = 0, c0 = 0, no residual, this is :class:`OneLayerTransformer` with A V in place of A.

    Parameters
    ----------
    W : array (H, d, d) (or (d, d) for one head)
        Merged query-key matrix of every head.
    V : array (H, d, d) (or (d, d))
        Merged value-output matrix of every head (y is in R^d).
    A : array (m, d)
        Feed-forward hidden weights.
    b : array (m,)
        Hidden biases.
    w : array (m,)
        Output weights.
    c0 : float
        Output bias.
    residual : bool
        Whether y(X) includes the residual stream x_N.
    """

    kind = "transformer-layer"
    PARAMETERS = ("W", "V", "A", "b", "w", "c0", "residual")

    def __init__(self, W: ArrayLike, V: ArrayLike, A: ArrayLike, b: ArrayLike, w: ArrayLike,
                 c0: ArrayLike = 0.0, residual: bool = False) -> None:
        W = np.array(W, dtype=np.float64)
        V = np.array(V, dtype=np.float64)
        if W.ndim == 2:
            W = W[None]
        if V.ndim == 2:
            V = V[None]
        if W.ndim != 3 or W.shape[1] != W.shape[2] or W.shape[1] < 1:
            raise InputError(f"TransformerLayer: W must have shape (H, d, d), got {W.shape}")
        if V.shape != W.shape:
            raise InputError(f"TransformerLayer: V must have the shape of W {W.shape}, got {V.shape}")
        A, w = _relu_parameters(A, w, "TransformerLayer")
        b = np.array(b, dtype=np.float64)
        if A.shape[1] != W.shape[1]:
            raise InputError(f"TransformerLayer: A must have {W.shape[1]} columns, got {A.shape}")
        if b.shape != w.shape:
            raise InputError(f"TransformerLayer: b must have shape {w.shape}, got {b.shape}")
        c0 = np.asarray(c0, dtype=np.float64)
        if c0.size != 1:
            raise InputError(f"TransformerLayer: c0 must be a scalar, got shape {c0.shape}")
        if not (np.all(np.isfinite(W)) and np.all(np.isfinite(V)) and np.all(np.isfinite(b))
                and np.isfinite(c0).all()):
            raise InputError("TransformerLayer: W, V, b and c0 must be finite")
        self.W, self.V, self.A, self.b, self.w = W, V, A, b, w
        self.c0 = float(c0.reshape(()))
        self.residual = bool(np.asarray(residual).reshape(()))

    @property
    def width(self) -> int:
        return self.A.shape[0]

    def head_maps(self) -> np.ndarray:
        """P_h = A V_h (H, m, d): all a black box can tell of A and V_h (see the learner)."""
        return np.einsum("md,hde->hme", self.A, self.V)

    def attend(self, X: np.ndarray) -> np.ndarray:
        """y(X) (B, d) for a batch (B, N, d)."""
        y = X[:, -1, :].copy() if self.residual else np.zeros((X.shape[0], self.dim))
        for W, V in zip(self.W, self.V):
            y += attention_output(X, W) @ V.T
        return y

    def outputs(self, X: np.ndarray) -> np.ndarray:
        return np.maximum(self.attend(X) @ self.A.T + self.b, 0.0) @ self.w + self.c0

    def __repr__(self) -> str:
        return (f"TransformerLayer(H={self.heads}, d={self.dim}, m={self.width}"
                f"{', residual' if self.residual else ''})")


POSITIONS = ("last", "all")      # where a vector model answers: the last position, every one


class VectorAttention(StackedHeads):
    """Multi-head attention answering the layer's whole output vector (canonical form).

    At the last position (``positions="last"``), for X (N, d):

        F(X) = sum_h O_h X^T softmax(X (W_h x_N + b_h)) + c        in R^m

    and at every position (``positions="all"``), F_j(X) for j = 1..N with x_N replaced
    by x_j; ``causal=True``: position j attends to positions i <= j only. With a
    standard layer's projections, W_h = W_k,h^T W_q,h / sqrt(d_h), b_h = W_k,h^T b_q,h /
    sqrt(d_h) (the key bias cancels in the softmax), O_h = W_o,h W_v,h (m x d, rank
    d_h) and c = W_o b_v + b_o. Heads with equal (W_h, b_h) merge their O_h, and a head
    with O_h = 0 is no head: that canonical form is what queries determine.

    Parameters
    ----------
    W : array (H, d, d)
        Merged query-key matrix of every head.
    O : array (H, m, d)
        Merged output-value matrix of every head.
    b : array (H, d), optional
        Merged query bias of every head (default 0).
    c : array (m,), optional
        Output constant (default 0).
    positions : {"last", "all"}
        Answer at the last position, (B, m), or at every position, (B, N, m).
    causal : bool
        Every-position answers under a causal mask (meaningless at the last position,
        where the mask changes nothing).
    """

    kind = "vector-attention"
    PARAMETERS = ("W", "O", "b", "c", "positions", "causal")

    def __init__(self, W: ArrayLike, O: ArrayLike, b: ArrayLike | None = None,
                 c: ArrayLike | None = None, positions: str = "last",
                 causal: bool = False) -> None:
        W = np.array(W, dtype=np.float64)
        O = np.array(O, dtype=np.float64)
        if W.ndim == 2:                              # one head
            W = W[None]
        if O.ndim == 2:
            O = O[None]
        if W.ndim != 3 or W.shape[1] != W.shape[2] or W.shape[1] < 1:
            raise InputError(f"VectorAttention: W must have shape (H, d, d) with d >= 1, "
                             f"got {W.shape}")
        H, d = W.shape[0], W.shape[1]
        if O.ndim != 3 or O.shape[0] != H or O.shape[2] != d or O.shape[1] < 1:
            raise InputError(f"VectorAttention: O must have shape ({H}, m, {d}) with m >= 1, "
                             f"got {O.shape}")
        m = O.shape[1]
        b = np.zeros((H, d)) if b is None else np.array(b, dtype=np.float64).reshape(
            (H, d) if np.size(b) == H * d else np.shape(b))
        if b.shape != (H, d):
            raise InputError(f"VectorAttention: b must have shape ({H}, {d}), got {b.shape}")
        c = np.zeros(m) if c is None else np.array(c, dtype=np.float64).reshape(-1)
        if c.shape != (m,):
            raise InputError(f"VectorAttention: c must have shape ({m},), got {c.shape}")
        if not all(np.all(np.isfinite(a)) for a in (W, O, b, c)):
            raise InputError("VectorAttention: W, O, b and c must be finite")
        positions = str(np.asarray(positions).reshape(()))
        if positions not in POSITIONS:
            raise InputError(f"VectorAttention: positions must be one of {POSITIONS}, "
                             f"got {positions!r}")
        self.W, self.O, self.b, self.c = W, O, b, c
        self.positions, self.causal = positions, bool(np.asarray(causal).reshape(()))

    @property
    def out_dim(self) -> int:
        """m, the width of every answer."""
        return self.O.shape[1]

    @property
    def output_kind(self) -> str:
        """What the model answers, declared to an Oracle: "last" or "all"."""
        return self.positions

    def parameters(self) -> dict[str, Any]:
        return {"W": self.W, "O": self.O, "b": self.b, "c": self.c,
                "positions": np.str_(self.positions), "causal": np.bool_(self.causal)}

    def outputs(self, X: np.ndarray) -> np.ndarray:
        B, N, _ = X.shape
        if self.positions == "last":
            out = np.broadcast_to(self.c, (B, self.out_dim)).copy()
            for W, O, b in zip(self.W, self.O, self.b):   # H is small: one pass per head
                alpha = biased_attention_weights(X, W, b)                  # (B, N)
                out += np.einsum("bn,bnd->bd", alpha, X) @ O.T
            return out
        out = np.broadcast_to(self.c, (B, N, self.out_dim)).copy()
        mask = np.triu(np.ones((N, N), dtype=bool), 1) if self.causal else None
        for W, O, b in zip(self.W, self.O, self.b):
            scores = (X @ W.T + b) @ X.transpose(0, 2, 1)                # (B, j, i), BLAS
            if mask is not None:
                scores = np.where(mask, -np.inf, scores)
            out += (softmax(scores) @ X) @ O.T
        return out

    def __call__(self, X: ArrayLike) -> np.ndarray:
        X, single = as_sequences(X, self.dim)
        out = self.outputs(X)
        return out[0] if single else out

    def __repr__(self) -> str:
        where = "every position" + (", causal" if self.causal else "") \
            if self.positions == "all" else "last position"
        return f"VectorAttention(H={self.heads}, d={self.dim}, m={self.out_dim}, {where})"


class VectorSphereAttention(StackedHeads):
    """A pre-LayerNorm block answering vectors, as far as it is identifiable: on the sphere
    S = {x : 1^T x = 0, |x| = radius}, at the last position,

    F(X) = R x_N + sum_h O_h X^T softmax(X (W_h x_N + b_h)) + c   in R^m,   x_i in S,

    with R the residual map (identity when the box adds its input, 0 when it answers the
    sublayer alone). Only the restrictions to the hyperplane 1^T x = 0 are seen, so the
    parameters are stored projected: W_h <- P W_h P, b_h <- P b_h, O_h <- O_h P,
    R <- R P, P = I - 1 1^T / d. Tokens off S raise :class:`InputError`.

    Parameters
    ----------
    W : array (H, d, d);  b : array (H, d);  O : array (H, m, d);  c : array (m,)
        The heads' parameters in x (LayerNorm's affine map on S folded in).
    R : array (m, d)
        The residual map applied to x_N.
    radius : float
        The norm of every token of S.
    """

    kind = "vector-pre-ln-sphere"
    PARAMETERS = ("W", "b", "O", "c", "R", "radius")

    def __init__(self, W: ArrayLike, b: ArrayLike, O: ArrayLike, c: ArrayLike, R: ArrayLike,
                 radius: float) -> None:
        heads = VectorAttention(W, O, b, c)
        d, m = heads.dim, heads.out_dim
        P = np.eye(d) - 1.0 / d
        self.radius = float(np.asarray(radius, dtype=np.float64).reshape(()))
        R = np.array(R, dtype=np.float64)
        if R.shape != (m, d) or not np.all(np.isfinite(R)):
            raise InputError(f"VectorSphereAttention: R must be finite ({m}, {d}), "
                             f"got shape {R.shape}")
        if not (np.isfinite(self.radius) and self.radius > 0):
            raise InputError(f"VectorSphereAttention: radius must be positive, "
                             f"got {self.radius}")
        self.W, self.b, self.O = P @ heads.W @ P, heads.b @ P, heads.O @ P
        self.c, self.R = heads.c, R @ P
        self.heads_model = VectorAttention(self.W, self.O, self.b, self.c)

    @property
    def out_dim(self) -> int:
        """m, the width of every answer."""
        return self.O.shape[1]

    @property
    def output_kind(self) -> str:
        """What the model answers, declared to an Oracle: the last position's vector."""
        return "last"

    def outputs(self, X: np.ndarray) -> np.ndarray:
        means = np.abs(X.sum(axis=-1)) / np.sqrt(self.dim)
        norms = np.linalg.norm(X, axis=-1)
        if np.any(means > SPHERE_TOLERANCE * self.radius) or np.any(
                np.abs(norms - self.radius) > SPHERE_TOLERANCE * self.radius):
            raise InputError(f"VectorSphereAttention is known only on tokens with zero mean "
                             f"and norm {self.radius:.6g}; a pre-LayerNorm box is not "
                             f"identified elsewhere")
        return X[:, -1, :] @ self.R.T + self.heads_model.outputs(X)

    def __call__(self, X: ArrayLike) -> np.ndarray:
        X, single = as_sequences(X, self.dim)
        out = self.outputs(X)
        return out[0] if single else out

    def __repr__(self) -> str:
        return (f"VectorSphereAttention(H={self.heads}, d={self.dim}, m={self.out_dim}, "
                f"radius={self.radius:.6g})")


# kind -> class: how report.load_model rebuilds a model from a result file
MODEL_CLASSES = {cls.kind: cls for cls in (SingleHeadAttention, MultiHeadAttention, ReLUNetwork,
                                           OneLayerTransformer, ResidualOneLayer, TransformerLayer,
                                           BiasedSingleHeadAttention, BiasedMultiHeadAttention,
                                           PreLayerNormAttention, SphereAttention,
                                           VectorAttention, VectorSphereAttention)}


# the parameters a model's output is linear in (values and output constants): x a
# factor, they give the model whose every output is that factor times the model's
OUTPUT_PARAMETERS = {"single-head": ("v",), "multi-head": ("v",),
                     "biased-single-head": ("v", "c"), "biased-multi-head": ("v", "c"),
                     "one-layer": ("w",), "one-layer-residual": ("w",), "relu-network": ("w",),
                     "transformer-layer": ("w", "c0"), "pre-ln-attention": ("v", "c", "r"),
                     "pre-ln-sphere": ("v", "c", "r"), "vector-attention": ("O", "c"),
                     "vector-pre-ln-sphere": ("O", "c", "R")}


def scale_outputs(model: Regressor, factor: float) -> Regressor:
    """The model whose outputs are ``factor`` times ``model``'s (a new model of the same
    class: its value and output parameters x factor, scores unchanged). Used to map a
    model learned on rescaled answers back (:class:`attnextract.oracle.ScaledOutputs`)."""
    names = OUTPUT_PARAMETERS.get(getattr(model, "kind", ""))
    if names is None:
        raise InputError(f"scale_outputs: no output parameters known for {type(model).__name__}")
    params = dict(model.parameters())
    for name in names:
        params[name] = np.asarray(params[name], dtype=float) * factor
    return type(model)(**params)

