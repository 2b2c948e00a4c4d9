"""Every head's query-key circuit once the heads' outputs O_h are known.

Identity. For tokens q + t u_1, ..., q + t u_n followed by q (q last), head h weighs
token i by a^h_i = exp(t u_i^T z_h) / (1 + sum_k exp(t u_k^T z_h)), z_h = W_h q + b_h,
and the answer is

    F - c - O q = t sum_h O_h U_n a^h_{1:n} = t M x,   M = [O_1 U_n, ..., O_H U_n] (m, H n),

a linear system in the H n weights x once every O_h is known: with H n <= m and M well
conditioned, ONE query resolves n logits of every head, ln(a^h_i / a^h_0) = t u_i^T z_h,
a^h_0 = 1 - sum_i a^h_i (the last token's weight). So d / n queries give z_h(q) of
every head; q = 0 gives b_h, q = s e_j gives W_h e_j = (z_h(s e_j) - b_h) / s.
Conditioning by design: n is the largest count (at most m / H) whose M has a
condition number below MAX_CONDITION, chunks of a random orthonormal U re-drawn (no
query) until that holds; t is chosen so the logits stay of order one (a probe whose
weights leave (0, 1) or whose logits exceed MAX_LOGIT is asked again smaller).
"""

from __future__ import annotations

import numpy as np

MAX_CONDITION = 1e4        # largest condition number of a chunk's system M
TARGET_LOGIT = 1.5         # aim the largest |t u^T z_h| of a probe here
MAX_LOGIT = 6.0            # ... above it (or a weight outside (0, 1)) ask again smaller
MIN_LOGIT = 0.05           # ... below it ask again larger (rounding would dominate)
RESCALE_ROUNDS = 5
DRAWS = 20                 # random bases tried per chunk size


def chunks(d: int, n: int) -> np.ndarray:
    """Index sets (ceil(d / n), n) covering 0..d-1, the last wrapping around."""
    count = -(-d // n)
    return (np.arange(count)[:, None] * n + np.arange(n)[None, :]) % d


def systems(O: np.ndarray, U: np.ndarray, n: int) -> list[np.ndarray]:
    """M (m, H n) of every chunk of U's columns."""
    return [np.concatenate([Oh @ U[:, c] for Oh in O], axis=1) for c in chunks(U.shape[0], n)]


def design_basis(O: np.ndarray, rng: np.random.Generator) -> tuple[np.ndarray, int, float]:
    """A random orthonormal U (d, d) and chunk size n with every chunk's M conditioned
    below MAX_CONDITION (largest n first). Returns (U, n, the largest condition number)."""
    H, m, d = O.shape
    for n in range(max(1, min(d, m // H)), 0, -1):
        best = None
        for _ in range(DRAWS):
            U = np.linalg.qr(rng.standard_normal((d, d)))[0]
            worst = max(np.linalg.cond(M) for M in systems(O, U, n))
            if best is None or worst < best[2]:
                best = (U, n, float(worst))
        assert best is not None             # DRAWS >= 1
        if best[2] <= MAX_CONDITION:
            return best
    assert best is not None                 # n = 1 was tried
    return best


def qk_probes(Q: np.ndarray, t: np.ndarray, U: np.ndarray, n: int) -> np.ndarray:
    """Probes (len(Q) * chunks, n + 1, d): tokens q + t_q u_i of a chunk, then q."""
    d = U.shape[0]
    sets = chunks(d, n)
    X = np.broadcast_to(Q[:, None, None, :], (len(Q), len(sets), n + 1, d)).copy()
    X[:, :, :n, :] += t[:, None, None, None] * U.T[sets][None]
    return X.reshape(-1, n + 1, d)


def solve_logits(answers, Q, t, O, c, U, n):
    """Logits g (len(Q), H, d) with g[q, h, i] = u_i^T z_h(q), from answers
    (len(Q) * chunks, m); also the largest |t g| per q and each solve's relative misfit.
    Weights outside (0, 1) give NaN logits."""
    H, m, d = O.shape
    sets = chunks(d, n)
    Ms = systems(O, U, n)
    y = answers.reshape(len(Q), len(sets), m) - c - (Q @ O.sum(axis=0).T)[:, None, :]
    g = np.zeros((len(Q), H, d))
    seen = np.zeros(d)
    misfit = np.zeros((len(Q), len(sets)))
    for s, (idx, M) in enumerate(zip(sets, Ms)):
        x = np.linalg.lstsq(M, (y[:, s] / t[:, None]).T, rcond=None)[0]   # (H n, Q)
        misfit[:, s] = (np.linalg.norm(M @ x - (y[:, s] / t[:, None]).T, axis=0)
                        / np.maximum(np.linalg.norm(y[:, s] / t[:, None], axis=1), 1e-300))
        a = x.T.reshape(len(Q), H, n)
        last = 1.0 - a.sum(axis=2, keepdims=True)
        ok = (a > 0) & (last > 0)
        with np.errstate(divide="ignore", invalid="ignore"):
            logit = np.where(ok, np.log(np.where(ok, a, 1.0) / np.where(last > 0, last, 1.0)),
                             np.nan)
        fresh = seen[idx] == 0
        g[:, :, idx[fresh]] = logit[:, :, fresh] / t[:, None, None]
        seen[idx] += 1
    peak = np.max(np.abs(g), axis=(1, 2)) * t
    return g, peak, misfit


def next_scales(t: np.ndarray, peak: np.ndarray) -> np.ndarray:
    """New probe scales: logits peaking at TARGET_LOGIT; unmeasurable ones 8x smaller."""
    ok = np.isfinite(peak) & (peak > 0)
    return np.where(ok, t * TARGET_LOGIT / np.where(ok, peak, 1.0), t / 8.0)


def needs_rescale(peak: np.ndarray) -> np.ndarray:
    return ~((peak <= MAX_LOGIT) & (peak >= MIN_LOGIT))
