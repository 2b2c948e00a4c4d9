"""Labelling the heads of every direction scan against the first (reference) direction.

A scan of direction v_k yields its H steps (p_j, w_j) in its own order. Head h of
direction 1 and step j of direction k belong to the same head exactly when the pair
explains mixed probes: n_1 copies of q_0 + t_1 v_1, n_2 copies of q_0 + t_k v_k and
n_3 copies of q_0 (q_0 last) answer

    F - c - O q_0 = sum_{i, j} P_ij f_ij,   f_ij = a_1 t_1 w^1_i + a_2 t_k w^k_j,
    (a_1, a_2, a_3) = softmax(p^1_i + ln n_1, p^k_j + ln n_2, ln n_3),

with P the permutation matrix pairing them. P enters linearly: with the 2H heights
independent (2H <= m), each probe gives 2H equations, so J >= H / 2 + 1 probes pin
the H^2 entries of P by least squares; the nearest permutation is accepted only when
P is within LABEL_TOLERANCE of it.
"""

from __future__ import annotations

import numpy as np
from scipy.optimize import linear_sum_assignment
from scipy.special import softmax

LABEL_TOLERANCE = 1e-3     # largest |P - permutation| accepted
PAIRED_MISFIT = 1e-6       # ... or a rounded pairing that predicts the answers this well
MAX_CONDITION = 1e8        # of the least-squares system for P
DRAWS = 8                  # random count sets tried per J (no query)
MORE_PROBES = 2            # at most this x H mixed probes per direction (then the best draw)
CROWDED_PROBES = 1         # crowded steps: at most H // 2 + 1 + this many
WEIGHTS_MISFIT = 1e-2      # largest relative miss of a pairing read from the weights


def label_design(scans, rng, L, crowded: bool = False) -> np.ndarray:
    """Copy counts (J, 3) of the fewest mixed probes (J from H // 2 + 1) whose pair
    predictions pin P for every direction (condition number below MAX_CONDITION):
    decided before any query, from the scans alone."""
    refs, others = scans[0], scans[1:]
    H, m = len(refs[0]), refs[1].shape[0]
    best: tuple[np.ndarray, float] | None = None
    last = H // 2 + 1 + CROWDED_PROBES if crowded else MORE_PROBES * H
    for J in range(H // 2 + 1, last + 1):
        for _ in range(DRAWS):
            counts = label_counts(J, L, rng)
            worst = max((np.linalg.cond(pair_predictions(refs, o, counts).reshape(J * m, -1))
                         for o in others), default=1.0)
            if worst <= MAX_CONDITION:
                return counts
            if best is None or worst < best[1]:
                best = (counts, float(worst))
    assert best is not None     # the loop runs at least once (last >= H // 2 + 1)
    return best[0]


def label_counts(J: int, L: int, rng: np.random.Generator) -> np.ndarray:
    """Copy counts (J, 3), each at least 1, summing to L (random points of the simplex)."""
    share = rng.dirichlet(np.full(3, 4.0), size=J)
    n = np.maximum(1, np.floor(share * (L - 3)).astype(int))
    n[:, 2] = L - n[:, 0] - n[:, 1]
    return n


def label_probes(q0, v1, t1, V, t, counts, L) -> np.ndarray:
    """Mixed probes of direction 1 with every direction k of V (d, D), shape
    (D * J, L, d): counts (J, 3) copies of q_0 + t_1 v_1, q_0 + t_k v_k and q_0."""
    D, J = V.shape[1], len(counts)
    X = np.broadcast_to(q0, (D, J, L, d := len(q0))).copy()
    pos = np.arange(L)[None, :]
    first = pos < counts[:, :1]                                       # (J, L)
    second = (pos >= counts[:, :1]) & (pos < counts[:, :1] + counts[:, 1:2])
    X += first[None, :, :, None] * (t1 * v1)[None, None, None, :]
    X += second[None, :, :, None] * (t[:, None] * V.T)[:, None, None, :]
    return X.reshape(D * J, L, d)


def pair_predictions(ref, other, counts) -> np.ndarray:
    """f_ij for every probe: shape (J, m, H, H). ``ref`` and ``other`` are (p (H,),
    w (m, H), t) of direction 1 and direction k."""
    (p1, w1, t1), (pk, wk, tk) = ref, other
    H = len(p1)
    logs = np.log(counts.astype(float))                               # (J, 3)
    logits = np.stack(np.broadcast_arrays(p1[None, :, None] + logs[:, 0, None, None],
                                          pk[None, None, :] + logs[:, 1, None, None],
                                          np.broadcast_to(logs[:, 2, None, None],
                                                          (len(counts), H, H))), axis=-1)
    a = softmax(logits, axis=-1)                                      # (J, H, H, 3)
    return (t1 * a[None, :, :, :, 0] * w1[:, None, :, None]
            + tk * a[None, :, :, :, 1] * wk[:, None, None, :]).transpose(1, 0, 2, 3)


def match(ref, other, counts, answers) -> tuple[np.ndarray | None, float]:
    """The permutation perm (H,) with step perm[h] of ``other`` the head h of ``ref``, or
    None when P is not near a permutation; and the distance |P - permutation|.
    ``answers`` (J, m): F - c - O q_0 of the J mixed probes."""
    f = pair_predictions(ref, other, counts)                          # (J, m, H, H)
    J, m, H, _ = f.shape
    P = np.linalg.lstsq(f.reshape(J * m, H * H), answers.reshape(-1), rcond=None)[0]
    P = P.reshape(H, H)
    rows, cols = linear_sum_assignment(-P)
    perm = np.empty(H, dtype=int)
    perm[rows] = cols
    target = np.zeros((H, H))
    target[rows, cols] = 1.0
    gap = float(np.max(np.abs(P - target)))
    # an ill-conditioned relaxation may still round to the pairing: its own prediction
    # of the answers decides
    paired = np.einsum("jmhk,hk->jm", f, target)
    miss = float(np.linalg.norm(paired - answers) / np.linalg.norm(answers))
    return (perm if gap <= LABEL_TOLERANCE or miss <= PAIRED_MISFIT else None), gap


def match_weights(ref, other, counts, answers) -> tuple[np.ndarray, float]:
    """The pairing read through each step's own attention weight (crowded steps: the
    relaxed P of :func:`match` is ill conditioned when steps of one direction lie close).

    The 2H heights [t_1 w^1, t_k w^k] (m, 2H) are independent (2H <= m), so every probe's
    answer gives each step's weight: alpha_i = a_1 of head i, beta_j = a_2 of step j. The
    pair (i, j) predicts both, a_1(i, j) and a_2(i, j): the assignment with the smallest
    summed squared miss is the pairing. Returns perm (H,) as :func:`match` and the
    relative miss of the paired prediction of the answers."""
    (p1, w1, t1), (pk, wk, tk) = ref, other
    H = len(p1)
    B = np.concatenate([t1 * w1, tk * wk], axis=1)                    # (m, 2H)
    x = np.linalg.lstsq(B, answers.T, rcond=None)[0]                  # (2H, J)
    alpha, beta = x[:H], x[H:]
    logs = np.log(counts.astype(float))
    logits = np.stack(np.broadcast_arrays(p1[None, :, None] + logs[:, 0, None, None],
                                          pk[None, None, :] + logs[:, 1, None, None],
                                          np.broadcast_to(logs[:, 2, None, None],
                                                          (len(counts), H, H))), axis=-1)
    a = softmax(logits, axis=-1)                                      # (J, H, H, 3)
    cost = (np.sum((alpha.T[:, :, None] - a[..., 0]) ** 2, axis=0)
            + np.sum((beta.T[:, None, :] - a[..., 1]) ** 2, axis=0))  # (H, H)
    rows, cols = linear_sum_assignment(cost)
    perm = np.empty(H, dtype=int)
    perm[rows] = cols
    target = np.zeros((H, H))
    target[rows, cols] = 1.0
    paired = np.einsum("jmhk,hk->jm", pair_predictions(ref, other, counts), target)
    return perm, float(np.linalg.norm(paired - answers) / np.linalg.norm(answers))
