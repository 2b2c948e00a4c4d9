"""Canonical form of attention with vector answers, and errors against a truth.

What vector answers determine. F(X) = sum_h O_h X^T softmax(X (W_h x_N + b_h)) + c
is unchanged when heads are permuted, when two heads with the same attention (equal
W_h and b_h) split their O_h in any way, and when a head with O_h = 0 carries any
W_h, b_h. The canonical form merges heads with equal (W_h, b_h) (adding their O_h)
and drops heads whose O_h is 0; two parameter sets give the same F exactly when
their canonical forms agree up to a permutation of the heads. Unlike a scalar
readout, O_h is determined whole (m x d), not only one projection r^T O_h.
"""

from __future__ import annotations

import numpy as np
from scipy.optimize import linear_sum_assignment

from ..errors import InputError
from ..models import VectorAttention


def _as_vector_model(model) -> VectorAttention:
    if isinstance(model, VectorAttention):
        return model
    if all(hasattr(model, name) for name in ("W", "O")):
        return VectorAttention(model.W, model.O, getattr(model, "b", None),
                               getattr(model, "c", None))
    raise InputError(f"expected a VectorAttention (or an object with arrays W (H, d, d), "
                     f"O (H, m, d) and optionally b (H, d), c (m,)), got {type(model).__name__}")


def vector_canonical_form(model, tol: float = 1e-9) -> VectorAttention:
    """Merge heads with equal attention (adding their O), then drop heads whose O is 0.

    Parameters
    ----------
    model : VectorAttention
        W (H, d, d), O (H, m, d), b (H, d), c (m,).
    tol : float
        Two heads have equal attention when ||[W_g | b_g] - [W_h | b_h]||_F <= tol x the
        largest ||[W_h | b_h]||_F; a merged O is 0 when ||O|| <= tol x the largest ||O_h||.

    Returns
    -------
    VectorAttention
        The canonical heads (H' <= H), in order of first appearance; c, positions and
        causal unchanged.
    """
    model = _as_vector_model(model)
    scores = np.concatenate([model.W, model.b[:, :, None]], axis=2)      # (H, d, d + 1)
    top = max((float(np.linalg.norm(s)) for s in scores), default=0.0)
    groups: list[list[int]] = []
    for h in range(model.heads):
        for group in groups:
            if np.linalg.norm(scores[h] - scores[group[0]]) <= tol * top:
                group.append(h)
                break
        else:
            groups.append([h])
    O = [model.O[g].sum(axis=0) for g in groups]
    top_O = max((float(np.linalg.norm(o)) for o in model.O), default=0.0)
    keep = [i for i, o in enumerate(O) if np.linalg.norm(o) > tol * top_O]
    d, m = model.dim, model.out_dim
    return VectorAttention(np.array([model.W[groups[i][0]] for i in keep]).reshape(-1, d, d),
                           np.array([O[i] for i in keep]).reshape(-1, m, d),
                           np.array([model.b[groups[i][0]] for i in keep]).reshape(-1, d),
                           model.c, positions=model.positions, causal=model.causal)


def match_vector_heads(recovered, truth) -> np.ndarray:
    """perm with recovered head perm[h] matched to truth head h (Hungarian assignment on
    the distance of [W | b]); both canonical forms must have the same number of heads."""
    a, b = _as_vector_model(recovered), _as_vector_model(truth)
    if a.heads != b.heads:
        raise InputError(f"cannot match {a.heads} recovered heads to {b.heads} true heads")
    A = np.concatenate([a.W, a.b[:, :, None]], axis=2).reshape(a.heads, -1)
    B = np.concatenate([b.W, b.b[:, :, None]], axis=2).reshape(b.heads, -1)
    cost = np.linalg.norm(A[:, None, :] - B[None, :, :], axis=2)
    rows, cols = linear_sum_assignment(cost)
    perm = np.empty(b.heads, dtype=int)
    perm[cols] = rows
    return perm


def vector_canonical_errors(recovered, truth, tol: float = 1e-9) -> dict:
    """Relative errors of the canonical parts, heads matched: ``W``, ``b``, ``O`` (each
    ||hat - true||_F / ||true||_F over all heads, a head's part measured against the
    largest head's when the true part is 0), ``c``, their maximum ``max``, and
    ``heads`` (recovered, true) after the canonical form. A different head count gives
    ``max`` = inf."""
    a, b = vector_canonical_form(recovered, tol), vector_canonical_form(truth, tol)
    if a.heads != b.heads:
        return {"W": np.inf, "b": np.inf, "O": np.inf, "c": np.inf, "max": np.inf,
                "heads": (a.heads, b.heads)}
    perm = match_vector_heads(a, b)
    tiny = np.finfo(float).tiny

    def rel(hat, true):
        return float(np.linalg.norm(hat - true) / max(np.linalg.norm(true), tiny)) \
            if np.any(true) else float(np.linalg.norm(hat))

    W_scale = max(float(np.linalg.norm(b.W)), tiny)
    out = {"W": rel(a.W[perm], b.W),
           "b": float(np.linalg.norm(a.b[perm] - b.b)) / max(float(np.linalg.norm(b.b)),
                                                              W_scale * 1e-300, tiny)
           if np.any(b.b) else float(np.linalg.norm(a.b[perm])) / W_scale,
           "O": rel(a.O[perm], b.O),
           "c": rel(a.c, b.c) if np.any(b.c) else float(np.linalg.norm(a.c))
           / max(float(np.linalg.norm(b.O)), tiny)}
    out["max"] = max(out.values())
    out["heads"] = (a.heads, b.heads)
    return out
