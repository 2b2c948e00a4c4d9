"""What a black box computes.

Every model maps a batch of token sequences ``X`` of shape (B, N, d) to one real
number per sequence, the output read at the last token, shape (B,). A single
sequence (N, d) gives a float. The same classes serve as targets and as recovered
models.
"""

from __future__ import annotations

import numpy as np

from .errors import InputError


def softmax(scores: np.ndarray) -> np.ndarray:
    """Numerically stable softmax over the last axis (shift by the maximum)."""
    shifted = scores - scores.max(axis=-1, keepdims=True)
    weights = np.exp(shifted)
    return weights / weights.sum(axis=-1, keepdims=True)


def as_sequences(X, dim: int) -> tuple[np.ndarray, bool]:
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


class SingleHeadAttention:
    """Single-head softmax attention regressor read at the last token.

    f(X) = softmax(X W x_N)^T X v, with X = [x_1; ...; x_N] of shape (N, d).

    Parameters
    ----------
    W : array (d, d)
        Merged query-key matrix (W = Q K^T up to a scale).
    v : array (d,)
        Merged value-output readout vector.
    """

    kind = "single-head"

    def __init__(self, W, v):
        W = np.array(W, dtype=np.float64)
        v = np.array(v, dtype=np.float64)
        if W.ndim != 2 or W.shape[0] != W.shape[1]:
            raise InputError(f"W must be square (d, d), got shape {W.shape}")
        if v.shape != (W.shape[0],):
            raise InputError(f"v must have shape ({W.shape[0]},), got {v.shape}")
        if not (np.all(np.isfinite(W)) and np.all(np.isfinite(v))):
            raise InputError("W and v must be finite")
        self.W, self.v = W, v

    @property
    def dim(self) -> int:
        return self.W.shape[0]

    def __call__(self, X):
        X, single = as_sequences(X, self.dim)
        queries = X[:, -1, :] @ self.W.T                 # (B, d): W x_N per sequence
        scores = np.einsum("bnd,bd->bn", X, queries)     # (B, N): x_i^T W x_N
        values = X @ self.v                              # (B, N): x_i^T v
        out = np.einsum("bn,bn->b", softmax(scores), values)
        return float(out[0]) if single else out

    def parameters(self) -> dict[str, np.ndarray]:
        return {"W": self.W, "v": self.v}

    def __repr__(self) -> str:
        return f"SingleHeadAttention(d={self.dim})"


class MultiHeadAttention:
    """Multi-head softmax attention regressor read at the last token.

    f(X) = sum_h softmax(X W_h x_N)^T X v_h, h = 1..H. H = 0 is allowed (f = 0).

    Parameters
    ----------
    W : array (H, d, d)
        Merged query-key matrix of every head.
    v : array (H, d)
        Merged value-output readout vector of every head.
    """

    kind = "multi-head"

    def __init__(self, W, v):
        W = np.array(W, dtype=np.float64)
        v = np.array(v, dtype=np.float64)
        if W.ndim != 3 or W.shape[1] != W.shape[2] or W.shape[1] < 1:
            raise InputError(f"W must have shape (H, d, d) with d >= 1, got {W.shape}")
        if v.shape != W.shape[:2]:
            raise InputError(f"v must have shape {W.shape[:2]} (H, d), got {v.shape}")
        if not (np.all(np.isfinite(W)) and np.all(np.isfinite(v))):
            raise InputError("W and v must be finite")
        self.W, self.v = W, v

    @property
    def dim(self) -> int:
        return self.W.shape[1]

    @property
    def heads(self) -> int:
        return self.W.shape[0]

    def __call__(self, X):
        X, single = as_sequences(X, self.dim)
        out = np.zeros(X.shape[0])
        for W, v in zip(self.W, self.v):                 # H is small: one pass per head
            queries = X[:, -1, :] @ W.T
            scores = np.einsum("bnd,bd->bn", X, queries)
            out += np.einsum("bn,bn->b", softmax(scores), X @ v)
        return float(out[0]) if single else out

    def parameters(self) -> dict[str, np.ndarray]:
        return {"W": self.W, "v": self.v}

    def __repr__(self) -> str:
        return f"MultiHeadAttention(H={self.heads}, d={self.dim})"


MODEL_CLASSES = {SingleHeadAttention.kind: SingleHeadAttention,
                 MultiHeadAttention.kind: MultiHeadAttention}
