"""The sphere LayerNorm maps tokens onto: {x : 1^T x = 0, |x| = R} (R = sqrt(d) by
default), and the geometry the pre-LayerNorm learners and their held-out check probe it
with: a basis of the hyperplane 1^T x = 0, random rotations fixing 1, regular simplices
of columns and of tangents, and random tokens on the sphere.
"""

from __future__ import annotations

import math

import numpy as np

from .errors import InputError


def sphere_radius(d: int, radius) -> float:
    """The tokens' norm R on the sphere (sqrt(d), LayerNorm's image, unless given)."""
    R = math.sqrt(d) if radius is None else float(radius)
    if not (math.isfinite(R) and R > 0):
        raise InputError(f"radius must be positive and finite, got {radius!r}")
    return R


def hyperplane_basis(dim: int) -> np.ndarray:
    """An orthonormal basis (d, d - 1) of the hyperplane 1^T x = 0."""
    return np.linalg.qr(np.eye(dim)[:, :-1] - 1.0 / dim)[0]


def hyperplane_rotation(dim: int, rng: np.random.Generator) -> np.ndarray:
    """A random orthogonal (d, d) that fixes the all-ones direction (maps 1^T x = 0 to itself)."""
    basis = hyperplane_basis(dim)
    G, R = np.linalg.qr(rng.standard_normal((dim - 1, dim - 1)))
    G *= np.sign(np.diag(R))
    return basis @ G @ basis.T + 1.0 / dim


def simplex_columns(dim: int, radius: float, rng: np.random.Generator) -> np.ndarray:
    """The d vertices (d, d), one per column, of a randomly rotated regular simplex on
    S: q_j = radius * Rot (e_j - 1/d) / sqrt(1 - 1/d); q_i^T q_j = -radius^2 / (d - 1)."""
    vertices = (np.eye(dim) - 1.0 / dim) / math.sqrt(1.0 - 1.0 / dim)
    return radius * hyperplane_rotation(dim, rng) @ vertices


def tangent_simplex(Q: np.ndarray, j: int) -> np.ndarray:
    """A regular m-simplex (d, m) of unit vectors in the tangent space at q_j (orthogonal
    to q_j and to 1): the other vertices' components orthogonal to q_j, normalised."""
    unit = Q / np.linalg.norm(Q[:, j])
    m = Q.shape[1] - 1
    return (np.delete(unit, j, axis=1) + unit[:, [j]] / m) / math.sqrt(1.0 - 1.0 / m ** 2)


def column_probes(q: np.ndarray, tangents: np.ndarray, chord: float) -> np.ndarray:
    """Probe tokens a_k (k, d) of column q at chord |a_k - q| = chord |q|: q rotated
    towards the unit tangents e_k (d, k) by the angle 2 asin(chord / 2)."""
    theta = 2.0 * math.asin(min(chord / 2.0, 1.0))
    return math.cos(theta) * q[None] + np.linalg.norm(q) * math.sin(theta) * tangents.T


def sphere_tokens(count: int, dim: int, radius: float, rng: np.random.Generator) -> np.ndarray:
    """``count`` random tokens (count, d) with zero mean and norm ``radius``."""
    X = rng.standard_normal((count, dim))
    X -= X.mean(axis=1, keepdims=True)
    return radius * X / np.linalg.norm(X, axis=1, keepdims=True)
