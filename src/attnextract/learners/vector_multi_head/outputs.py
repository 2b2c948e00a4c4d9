"""Every head's O_h by least squares, once its attention at q_0 is known.

Identity. With z_h = W_h q_0 + b_h known for every head (the labelled scans), a probe
of tokens q_0 + t g_1, ..., q_0 + t g_n followed by q_0 is answered

    F - c - O q_0 = sum_h O_h beta_h,   beta_h = t G a^h,   a^h = softmax(t G^T z_h, 0)_{1:n},

linear in the stacked [O_1 .. O_H] (m, H d) with known regressors [beta_1; ..; beta_H]
(H d,): H d probes whose regressor matrix is well conditioned give every O_h at once,
each channel of the answers being one more right-hand side. The heights read in the
scans are only as good as their sigmoid matrix's conditioning (1e-10 measured at
d = 16, H = 4); these probes are designed (random tokens, redrawn without a query
until the condition number is below MAX_CONDITION).
"""

from __future__ import annotations

import numpy as np
from scipy.special import softmax

MAX_CONDITION = 1e4
DRAWS = 20
SHARE = 0.5                # probes per unknown column of [O_1 .. O_H]
SPARE = 4                  # probes beyond H d: the fit's misfit says whether it holds
LOGIT_RANGE = (1.0, 3.0)   # largest |t g^T z_h| of a probe, drawn in this range


def regressors(z: np.ndarray, G: np.ndarray, t: np.ndarray) -> np.ndarray:
    """[beta_1 .. beta_H] (B, H d) for tokens q_0 + t_b G_b (G (B, n, d), t (B,))."""
    logits = t[:, None, None] * np.einsum("bnd,hd->bhn", G, z)       # (B, H, n)
    logits = np.concatenate([logits, np.zeros(logits.shape[:2] + (1,))], axis=2)
    a = softmax(logits, axis=2)[:, :, :-1]
    beta = t[:, None, None] * np.einsum("bhn,bnd->bhd", a, G)
    return beta.reshape(len(G), -1)


def design(z: np.ndarray, rng: np.random.Generator):
    """Tokens G (B, d, d), scales t (B,) and the regressor matrix's condition number."""
    H, d = z.shape
    B = max(int(SHARE * H * d), d) + SPARE
    reach = max(float(np.max(np.linalg.norm(z, axis=1))), 1e-300)
    best = None
    for _ in range(DRAWS):
        G = rng.standard_normal((B, d, d)) / np.sqrt(d)
        t = rng.uniform(*LOGIT_RANGE, size=B) / reach
        cond = np.linalg.cond(regressors(z, G, t))
        if best is None or cond < best[2]:
            best = (G, t, float(cond))
        if cond <= MAX_CONDITION:
            break
    return best


def probes(q0: np.ndarray, G: np.ndarray, t: np.ndarray) -> np.ndarray:
    """(B, n + 1, d): tokens q_0 + t_b g_i, then q_0."""
    X = np.broadcast_to(q0, (len(G), G.shape[1] + 1, len(q0))).copy()
    X[:, :-1] += t[:, None, None] * G
    return X


def solve(z, G, t, answers) -> tuple[np.ndarray, float]:
    """O_h (H, m, d) from answers (B, m) of F - c - O q_0; and the relative misfit."""
    A = regressors(z, G, t)
    sol = np.linalg.lstsq(A, answers, rcond=None)[0]                  # (H d, m)
    misfit = float(np.linalg.norm(A @ sol - answers) / np.linalg.norm(answers))
    H, d = z.shape
    return sol.T.reshape(-1, H, d).transpose(1, 0, 2), misfit
