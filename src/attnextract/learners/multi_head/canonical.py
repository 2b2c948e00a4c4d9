"""Canonical form, non-identifiable twins and head matching for multi-head attention.

Non-identifiability (arXiv 2601.16873). For f(X) = sum_h softmax(X W_h x_N)^T X v_h,
heads with equal W can split their v in any way, a head with v_h = 0 can carry any
W_h, and heads can be permuted. The canonical form merges heads with equal W (adding
their v) and drops heads whose v is 0; two parameter sets give the same f exactly
when their canonical forms agree up to a permutation. :func:`non_identifiable_twin`
builds a different parameter set with the same map, :func:`twin_difference` measures
the largest output difference of two models.
"""

from __future__ import annotations

import math
from typing import Protocol, overload

import numpy as np
from numpy.typing import ArrayLike
from scipy.optimize import linear_sum_assignment

from ...errors import InputError
from ...models import (
    BiasedMultiHeadAttention,
    MultiHeadAttention,
    SingleHeadAttention,
    VectorAttention,
)
from ...report import held_out_sequences, token_scale
from ..vector_canonical import vector_canonical_errors, vector_canonical_form


class HeadsLike(Protocol):
    """Any object with heads' arrays W (H, d, d) and v (H, d) (or one head's, (d, d) and
    (d,)): a :class:`MultiHeadAttention`, a :class:`SingleHeadAttention`, a user's own truth."""

    @property
    def W(self) -> np.ndarray: ...
    @property
    def v(self) -> np.ndarray: ...


def _check_multi(model) -> MultiHeadAttention:
    """``model`` as a MultiHeadAttention: that, a single head, a (W, v) pair of arrays or
    any object with arrays ``W`` (H, d, d) and ``v`` (H, d) (a user's own truth)."""
    if isinstance(model, SingleHeadAttention):
        return MultiHeadAttention(model.W[None], model.v[None])
    if isinstance(model, MultiHeadAttention):
        return model
    if isinstance(model, (tuple, list)) and len(model) == 2:
        W, v = model
    elif hasattr(model, "W") and hasattr(model, "v"):
        W, v = model.W, model.v
    else:
        raise InputError(f"expected a MultiHeadAttention model (attnextract."
                         f"MultiHeadAttention(W, v)), a (W, v) pair or an object with arrays "
                         f"W (H, d, d) and v (H, d), got {type(model).__name__}")
    W, v = np.asarray(W, dtype=np.float64), np.asarray(v, dtype=np.float64)
    if W.ndim == 2 and v.ndim == 1:      # one head
        W, v = W[None], v[None]
    return MultiHeadAttention(W, v)


@overload
def canonical_form(model: VectorAttention, tol: float = 1e-9) -> VectorAttention: ...
@overload
def canonical_form(model: HeadsLike | tuple[ArrayLike, ArrayLike],
                   tol: float = 1e-9) -> MultiHeadAttention: ...
def canonical_form(model: object,
                   tol: float = 1e-9) -> MultiHeadAttention | VectorAttention:
    """Merge heads with equal W (adding their v), then drop heads whose v is 0.

    A :class:`~attnextract.models.VectorAttention` gets its own canonical form (heads
    with equal W and b merge their O; O = 0 drops):
    :func:`attnextract.learners.vector_canonical.vector_canonical_form`.

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
    if isinstance(model, VectorAttention):
        return vector_canonical_form(model, tol)
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
    if isinstance(recovered, VectorAttention) or isinstance(truth, VectorAttention):
        return vector_canonical_errors(recovered, truth, tol)["max"]
    _, w_err, v_err = match_heads(canonical_form(recovered, tol), canonical_form(truth, tol))
    return max(w_err, v_err)


@overload
def non_identifiable_twin(model: VectorAttention, seed: int | None = None) -> VectorAttention: ...
@overload
def non_identifiable_twin(model: HeadsLike | tuple[ArrayLike, ArrayLike],
                          seed: int | None = None) -> MultiHeadAttention: ...
def non_identifiable_twin(model: object,
                          seed: int | None = None) -> MultiHeadAttention | VectorAttention:
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
        W (H + 2, d, d), v (H + 2, d); for a VectorAttention (O (H, m, d)),
        :func:`non_identifiable_vector_twin`.
    """
    if isinstance(model, VectorAttention):
        return non_identifiable_vector_twin(model, seed)
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
    # answers of any shape per sequence: one number, a vector (m,) or (N, m) (vector
    # models compare every channel and position)
    diff, squares, numbers = 0.0, 0.0, 0
    for n in np.unique(lengths):
        batch = np.stack([seqs[i] for i in np.flatnonzero(lengths == n)])
        fa, fb = np.asarray(model_a(batch)), np.asarray(model_b(batch))
        if fa.shape != fb.shape:
            raise InputError(f"the models answer shapes {fa.shape} and {fb.shape}")
        diff = max(diff, float(np.max(np.abs(fa - fb))))
        squares, numbers = squares + float(np.sum(fa ** 2)), numbers + fa.size
    rms = math.sqrt(squares / numbers)
    return {"max_abs": diff, "max_relative": diff / rms if rms > 0 else diff,
            "rms_output": rms, "sequences": count}


def non_identifiable_vector_twin(model: VectorAttention, seed=None) -> VectorAttention:
    """A VectorAttention with other parameters and exactly the same answers.

    One head's O is split between two heads with the same W and b (O_h = A + (O_h - A),
    A random), a dead head (random W and b, O = 0) is added, and the heads are permuted
    (never the identity). Its canonical form
    (:func:`~attnextract.learners.vector_canonical.vector_canonical_form`) is the model's.

    Parameters
    ----------
    model : VectorAttention
        W (H, d, d), O (H, m, d), b (H, d), c (m,) with H >= 1.

    Returns
    -------
    VectorAttention
        W (H + 2, d, d), O (H + 2, m, d), b (H + 2, d), the same c, positions and causal.
    """
    if model.heads == 0:
        raise InputError("a model with no heads has no twin to build from its heads")
    rng = np.random.default_rng(seed)
    d, m = model.dim, model.out_dim
    W, O, b = list(model.W.copy()), list(model.O.copy()), list(model.b.copy())
    h = int(rng.integers(model.heads))
    split = rng.uniform(0.2, 0.8) * O[h] + rng.standard_normal((m, d)) * (
        np.linalg.norm(O[h]) / math.sqrt(m * d) + 1.0)
    W.append(W[h].copy())
    b.append(b[h].copy())
    O.append(O[h] - split)
    O[h] = split
    scale = float(np.linalg.norm(model.W) / math.sqrt(model.heads * d)) or 1.0
    W.append(scale * rng.standard_normal((d, d)))   # dead head: any W and b, O = 0
    b.append(rng.standard_normal(d))
    O.append(np.zeros((m, d)))
    order = rng.permutation(len(W))
    while np.all(order == np.arange(len(W))):
        order = rng.permutation(len(W))
    return VectorAttention(np.array(W)[order], np.array(O)[order], np.array(b)[order],
                           model.c, positions=model.positions, causal=model.causal)


def _augmented(model) -> MultiHeadAttention:
    """A biased multi-head model as a bias-free one in dimension d + 1: W'_h = [[W_h, b_h],
    [0, 0]], v'_h = [v_h; 0], so that equal [W_h | b_h] merge (heads with equal W but
    different b are different canonical heads)."""
    W, v = np.asarray(model.W), np.asarray(model.v)
    H, d = v.shape
    b = np.asarray(getattr(model, "b", np.zeros((H, d))))
    Wa = np.zeros((H, d + 1, d + 1))
    Wa[:, :d, :d], Wa[:, :d, d] = W, b
    return MultiHeadAttention(Wa, np.hstack([v, np.zeros((H, 1))]))


def biased_canonical_errors(recovered, truth, tol: float = 1e-9) -> dict:
    """Errors of a recovered biased multi-head model against the truth, canonical forms.

    Heads merge when [W_h | b_h] agree (adding their v) and drop when their v is 0;
    they are matched as in :func:`match_heads` on [W_h | b_h] and v_h. Either model may
    be bias-free (b = 0, c = 0).

    Returns
    -------
    dict
        ``W``, ``b``, ``v``: largest relative error over matched heads (W_h against
        |W_h|, b_h against max(|b_h|, |W_h|): a zero bias has no scale of its own, its
        logits are on W's; v_h against |v_h|); ``c``: |c - c_true| relative to
        max(|c_true|, largest |v_h|); ``heads``: canonical heads of each. Errors are
        inf when the numbers of canonical heads differ.
    """
    a = canonical_form(_augmented(recovered), tol)
    t = canonical_form(_augmented(truth), tol)
    c_rec, c_true = float(getattr(recovered, "c", 0.0)), float(getattr(truth, "c", 0.0))
    v_scale = float(np.max(np.linalg.norm(t.v, axis=1), initial=0.0))
    out = {"heads": (a.heads, t.heads),
           "c": abs(c_rec - c_true) / max(abs(c_true), v_scale, 1e-300)}
    if a.heads != t.heads:
        return {**out, "W": math.inf, "b": math.inf, "v": math.inf}
    if t.heads == 0:
        return {**out, "W": 0.0, "b": 0.0, "v": 0.0}
    order, _, _ = match_heads(a, t)
    d = t.dim - 1
    Wa, Wt = a.W[order, :d, :d], t.W[:, :d, :d]
    ba, bt = a.W[order, :d, d], t.W[:, :d, d]
    w_norm = np.maximum(np.linalg.norm(Wt, axis=(1, 2)), 1e-300)
    return {**out,
            "W": float(np.max(np.linalg.norm(Wa - Wt, axis=(1, 2)) / w_norm)),
            "b": float(np.max(np.linalg.norm(ba - bt, axis=1)
                              / np.maximum(np.linalg.norm(bt, axis=1), w_norm))),
            "v": float(np.max(np.linalg.norm(a.v[order] - t.v, axis=1)
                              / np.maximum(np.linalg.norm(t.v, axis=1), 1e-300)))}


def smallest_separation(model: MultiHeadAttention | BiasedMultiHeadAttention) -> float:
    """min over head pairs of |W_g - W_h|_F / max_h |W_h|_F (inf for one head)."""
    if model.heads < 2:
        return math.inf
    norm = float(np.max(np.linalg.norm(model.W, axis=(1, 2))))
    diffs = np.linalg.norm(model.W[:, None] - model.W[None], axis=(2, 3))
    diffs[np.diag_indices(model.heads)] = np.inf
    return float(diffs.min() / max(norm, 1e-300))
