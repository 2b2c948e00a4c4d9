"""The measurement design: copy probes, their lambdas, rows and columns.

A copy probe (u, q, m, N) is the sequence of m copies of a = q + u followed by N - m
copies of q (q last). Head h puts the weight sigma(t_h + lambda) on the copies of a,
with t_h = u^T W_h q and lambda = ln(m / (N - m)), so

    g(u, q, lambda) := f - v^T q = sum_h c_h sigma(t_h + lambda),   c_h = u^T v_h,

with v = sum_h v_h read from d single tokens. Each head is a sigmoid step centred at
lambda = -t_h with height c_h. A stage's window N sets the range +-ln(N - 1) of lambda;
each probe is only as long as its own lambda needs (:func:`probe_lengths`: window / 2^k
tokens, with RARE_COPIES copies of the rarer token at least), since the identity holds
for any length and the black box's cost grows with the tokens: steps spread over the
window take about a third of the window's tokens. A round's probes go to the box in one
batch per length (:func:`measure`).

The design keeps the steps apart on purpose:

- the base row: a random row (u_0, q_0) scaled so that its steps fill the lambda window,
  sampled on a uniform lambda grid (:func:`base_lambdas`);
- base perturbations: rows u_0 + eps w_k (w_k orthonormal, orthogonal to u_0)
  (:func:`orthonormal_complement`) on a uniform grid; eps keeps every step near its base
  position, so the heads keep their labels;
- main rows u_k (:func:`design_rows`): u_k^T (W_h q_0) = designed positions (evenly
  spaced, :func:`step_positions`, a different order and shift in every row) using the
  base estimate of W_h q_0, heights u_k^T v_h as even as the candidates allow; each
  sampled at its steps, midpoints and ends (:func:`row_lambdas`);
- columns q_0 + s r_j, s small enough that the steps move by a fraction of their gap,
  sampled at the row's steps and one midpoint (:func:`column_lambdas`); the wide columns
  of round 3 are designed by :func:`design_rows` from each row's W_h^T u_k.
"""

from __future__ import annotations

import math

import numpy as np

PROBE_FLOATS = 1 << 22          # floats of probe tokens per oracle call (32 MB)
RARE_COPIES = 8                 # copies of the rarer token a copy probe has at least
LENGTH_CLASSES = 6              # probe lengths per window at most: window / 2^k, k < this
ROW_FRACTIONS = (0.5,)


def window_length(heads: int) -> int:
    """Sequence length N of every main copy probe: lambda spans +-ln(N - 1).

    More heads need a wider window to keep their designed steps apart: the spacing
    2 (ln(N - 1) - 1.5) / H stays at 1.48 or more up to H = 12 (N = 32768).
    """
    return (128 if heads <= 2 else 512 if heads <= 6 else 2048 if heads <= 8
            else 8192 if heads <= 10 else 32768)


def base_length(heads: int) -> int:
    """Sequence length of the base stages for up to ``heads`` heads: 2048 (lambda in
    +-7.6) up to 8 heads, the main window beyond (the base row's steps crowd more)."""
    return 2048 if heads <= 8 else window_length(heads)


def probe_lengths(lam: np.ndarray, window: int) -> np.ndarray:
    """Sequence length N_p of each copy probe (P,): as long as its lambda needs.

    lambda = ln(m / (N - m)) needs N >= 1 + e^|lambda| tokens, and the rarer token's
    copies min(m, N - m) set how finely lambda is realised (about 1 / that count). The
    length is the window divided by the largest power of two (below 2^LENGTH_CLASSES)
    that leaves RARE_COPIES copies of the rarer token: the window only within about
    ln(window / RARE_COPIES) of its edge. The realised lambda is exact whatever the
    length, and a shorter sum rounds less. A round's probes go in one batch per length,
    so at most LENGTH_CLASSES batches; the cost is in the long probes (the length grows
    like e^|lambda|), so the shortest class (window / 32) costs little: steps spread
    evenly over the window's lambdas take about 0.3 of the window's tokens.
    """
    lam = np.abs(np.asarray(lam, dtype=np.float64))
    need = RARE_COPIES * (1.0 + np.exp(np.minimum(lam, 700.0)))
    halvings = np.floor(np.log2(np.maximum(window / need, 1.0)))
    halvings = np.minimum(halvings, min(LENGTH_CLASSES - 1, math.floor(math.log2(window))))
    return np.maximum(window // 2 ** halvings.astype(np.int64), 1)


def copy_counts(lam: np.ndarray, length) -> np.ndarray:
    """Copies m in 1..N-1 of the first token whose lambda = ln(m / (N - m)) is nearest
    ``lam``; ``length`` N one for all or one per probe."""
    m = np.rint(length / (1.0 + np.exp(-np.asarray(lam, dtype=np.float64))))
    return np.clip(m, 1, np.asarray(length) - 1).astype(np.int64)


def realised_lambda(m: np.ndarray, length) -> np.ndarray:
    """lambda = ln(m / (N - m)) of copy counts m (N one for all or one per probe)."""
    m = np.asarray(m, dtype=np.float64)
    return np.log(m) - np.log(length - m)


def measure(oracle, v: np.ndarray, u: np.ndarray, q: np.ndarray, m: np.ndarray,
            length) -> np.ndarray:
    """Send the copy probes (u_p, q_p, m_p) of length N_p; returns g_p = f_p - v^T q_p.

    The probes of one length go in one batch (several where they exceed PROBE_FLOATS
    floats), lengths in increasing order; the answers come back in the probes' order.

    Parameters
    ----------
    u, q : arrays (P, d)
    m : int array (P,)
    length : int or int array (P,)
        N for every probe, or each probe's own N_p.
    """
    P, d = u.shape
    a = q + u
    lengths = np.broadcast_to(np.asarray(length, dtype=np.int64), (P,))
    out = np.empty(P)
    for n in np.unique(lengths):
        group = np.flatnonzero(lengths == n)
        step = max(1, PROBE_FLOATS // (int(n) * d))
        for lo in range(0, group.size, step):
            batch = group[lo:lo + step]
            # filled probe by probe: two broadcast copies each write the tokens at memory
            # speed (a masked select over the batch took 2x to 4x longer)
            X = np.empty((batch.size, int(n), d))
            for i, p in enumerate(batch):
                X[i, :m[p]] = a[p]
                X[i, m[p]:] = q[p]
            out[batch] = oracle.query(X)
    return out - q @ v


def step_positions(heads: int, half_width: float) -> np.ndarray:
    """Designed step positions t: evenly spaced over [-half_width, half_width]."""
    if heads == 1:
        return np.zeros(1)
    return np.linspace(-half_width, half_width, heads)


def base_lambdas(count: int, half_window: float) -> np.ndarray:
    """The base row's uniform lambda grid."""
    return np.linspace(-half_window, half_window, count)


def orthonormal_complement(u0: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """d - 1 random orthonormal vectors orthogonal to u0, rows (d - 1, d)."""
    d = u0.size
    basis = np.linalg.qr(np.column_stack([u0, rng.standard_normal((d, d - 1))]))[0]
    return basis[:, 1:].T


def design_rows(Y0: np.ndarray, V: np.ndarray, positions: np.ndarray, rng: np.random.Generator,
                candidates: int | None = None, jitter: float = 0.25,
                count: int | None = None, keep: np.ndarray | None = None,
                shift: np.ndarray | None = None) -> np.ndarray:
    """Main rows u_k (count, d), d by default, placing head h's step of row k at a
    designed position.

    Row k satisfies u_k^T y_h = positions[pi_k(h)] + o_k (y_h = W_h q_0, columns of Y0,
    pi_k a random order, o_k a small random offset so the rows span R^d). The component
    orthogonal to span(Y0) is random; among ``candidates`` draws the row with the most
    even heights u_k^T v_h (times its distance to the rows already chosen) is kept.

    Parameters
    ----------
    Y0 : array (d, H)
        Estimates of W_h q_0.
    V : array (d, H)
        Estimates of v_h.
    positions : array (H,)
        Designed step positions (-lambda of each step).
    candidates : int, optional
        Draws per row: 24, or 100 when H = d (no free complement: the orders and
        offsets alone condition U, and more draws halve cond(U) / cond(Y0)).
    count : int, optional
        Rows to design (default d).
    keep : array (k, d), optional
        Rows already measured: the new rows are scored by their distance to these too
        (the rows together must span R^d).
    shift : array (H,), optional
        Affine positions u^T y_h + shift_h (biased columns: y_h = W_h^T u_k,
        shift_h = u_k^T b_h); the targets are met with the shift included, in least
        squares where y_h are dependent (equal W_h, different b_h).
    """
    d, H = Y0.shape
    candidates = candidates or (24 if H < d else 100)
    # biased columns: heads with equal W_h (different b_h) have equal y_h, up to the fit's
    # error; their steps move together, and their targets are met in least squares
    pinv = np.linalg.pinv(Y0, rcond=1e-15 if shift is None else 1e-8)    # (H, d)
    P_perp = np.eye(d) - Y0 @ pinv
    scale_u = float(np.max(np.linalg.norm(pinv, axis=1))) * max(float(np.max(np.abs(positions))), 1.0)
    v_norm = np.linalg.norm(V, axis=0) + 1e-300 if V is not None else None
    rows: list[np.ndarray] = []
    kept = [] if keep is None else list(keep)
    for _k in range(d if count is None else count):
        orders = np.array([rng.permutation(H) for _ in range(candidates)])
        offsets = rng.uniform(-jitter, jitter, size=candidates)
        targets = positions[orders] + offsets[:, None]           # (C, H)
        if shift is not None:
            targets = targets - shift[None, :]
        z = rng.standard_normal((candidates, d)) @ P_perp
        # H = d: no complement (P_perp is rounding noise, which must not be scaled up)
        z *= scale_u / (np.linalg.norm(z, axis=1, keepdims=True) + 1e-300) if H < d else 0.0
        cand = targets @ pinv + z                                 # (C, d)
        if V is None:
            # columns: heights do not depend on q, but rounding does: the answers, their
            # scores q^T W_h q and so their rounding grow with |q| (at H = d an order may
            # need |q| ~ 1e4, whose answers rounded 300x the noise the fits expect)
            score = 1.0 / np.linalg.norm(cand, axis=1)
        else:
            heights = np.abs(cand @ V) / v_norm / np.linalg.norm(cand, axis=1, keepdims=True)
            score = heights.min(axis=1) * math.sqrt(d)
        if rows or kept:
            R = np.linalg.qr(np.array(kept + rows).T)[0]
            resid = cand - (cand @ R) @ R.T
            score = score * np.linalg.norm(resid, axis=1) / np.linalg.norm(cand, axis=1)
        rows.append(cand[int(np.argmax(score))])
    return np.array(rows)


def row_design_condition(U: np.ndarray) -> float:
    """Condition number of the rows U (d, d) scaled to unit length: what U^-1 multiplies
    the rows' relative errors by (a row's z_hk and heights err in proportion to |u_k|)."""
    return float(np.linalg.cond(U / np.linalg.norm(U, axis=1, keepdims=True)))


def best_conditioned_rows(Y0: np.ndarray, V: np.ndarray, positions: np.ndarray,
                          rng: np.random.Generator, draws: int, jitter: float) -> np.ndarray:
    """The best conditioned (:func:`row_design_condition`) of ``draws`` row designs
    :func:`design_rows` (d, d); no query is spent on the designs not kept.

    Why: the greedy row choice leaves cond(U) spread over a factor 3 to 6 between draws
    of the same estimate (float32 nn.MultiheadAttention, d = 8, H = 4: one draw 26, 81,
    130 where 30 draws reached 11, 22, 59), and U^-1 carries it into every head."""
    designs = [design_rows(Y0, V, positions, rng, jitter=jitter) for _ in range(draws)]
    return min(designs, key=row_design_condition)


def even_height_rows(V: np.ndarray, rng: np.random.Generator, candidates: int = 64) -> np.ndarray:
    """Rows u_k (d, d) whose heights u_k^T v_h / |v_h| are all +-1 (random signs), the
    component orthogonal to span(v_h) random of the same size; among ``candidates``
    draws per row the one farthest from the rows already chosen is kept (the rows
    must span R^d, well conditioned).

    Parameters
    ----------
    V : array (d, H)
        The heads' v_h (columns), H <= d.
    """
    d, H = V.shape
    unit = V / (np.linalg.norm(V, axis=0) + 1e-300)
    pinv = np.linalg.pinv(unit.T)                                   # (d, H)
    P_perp = np.eye(d) - unit @ np.linalg.pinv(unit)
    rows: list[np.ndarray] = []
    for _ in range(d):
        signs = rng.choice([-1.0, 1.0], size=(candidates, H))
        cand = signs @ pinv.T                                          # (C, d)
        if H < d:
            cand = cand + _free_part(rng.standard_normal((candidates, d)) @ P_perp, cand)
        score = np.ones(candidates)
        if rows:
            R = np.linalg.qr(np.array(rows).T)[0]
            score = np.linalg.norm(cand - (cand @ R) @ R.T, axis=1) / np.linalg.norm(cand, axis=1)
        rows.append(cand[int(np.argmax(score))])
    return np.array(rows)


def short_columns(Z: np.ndarray, spacing: float, count: int,
                  rng: np.random.Generator, shift: np.ndarray | None = None) -> np.ndarray:
    """Columns q (count, d) of one short row: head h's logit z_h^T q at a position of
    an evenly spaced ladder (``spacing`` apart, centred on 0, a random order and a
    random shift of up to half a spacing per column), so that about one head per column
    sits on its sigmoid's slope and the others saturate (they pin the heights). The
    component outside span(z_h) is random, of the size of the part within.

    Parameters
    ----------
    Z : array (H, d)
        The row's z_h = W_h^T u (rows), H <= d.
    shift : array (H,), optional
        Affine logits z_h^T q + shift_h (biased heads: shift_h = u^T b_h); the ladder
        is met with the shift included.
    """
    H, d = Z.shape
    ladder = (np.arange(H) - 0.5 * (H - 1)) * spacing
    orders = np.argsort(rng.random((count, H)), axis=1)
    targets = ladder[orders] + rng.uniform(-0.5 * spacing, 0.5 * spacing, size=(count, 1))
    if shift is not None:
        targets = targets - shift[None, :]
    # biased: heads with equal W_h (different b_h) have equal z_h up to the fit's error;
    # their ladder targets are met in least squares (as in design_rows)
    pinv = np.linalg.pinv(Z, rcond=1e-15 if shift is None else 1e-8)  # (d, H)
    q = targets @ pinv.T                                             # (count, d)
    if H < d:
        free = rng.standard_normal((count, d))
        q = q + _free_part(free - (free @ pinv) @ Z, q)              # out of span(z_h)
    return q


def _free_part(free: np.ndarray, part: np.ndarray) -> np.ndarray:
    """``free`` (n, d), each row rescaled to the norm of the same row of ``part``: the
    random component outside the designed span, of the size of the designed one."""
    return free * (np.linalg.norm(part, axis=1, keepdims=True)
                   / (np.linalg.norm(free, axis=1, keepdims=True) + 1e-300))


def least_uncertain_row(Y0: np.ndarray, V: np.ndarray | None, Y_cov: np.ndarray,
                        positions: np.ndarray, rng: np.random.Generator,
                        candidates: int = 24, jitter: float = 0.25,
                        shift: np.ndarray | None = None) -> np.ndarray:
    """A row u (d,) placing head h's step at a designed position, whose positions the
    estimate predicts best.

    u^T y_h = positions[pi(h)] + o (a random order pi, offset o) and, among such rows,
    the least predicted variance sum_h u^T Cov(y_h) u (generalised least squares: the
    d - H free directions are spent where the estimate is sure). Among ``candidates``
    orders the row with the most even heights u^T v_h is kept (with V None, the least
    predicted variance u^T Y_cov u).

    The base row's designed column (a combination a of measured columns whose heads'
    positions are T (H, n): T a = positions) is the same problem with Y0 = T^T.

    Parameters
    ----------
    Y0 : array (d, H)
        Estimate of W_h q_0.
    V : array (d, H) or None
        Estimate of v_h, or None (the heights do not depend on the row chosen).
    Y_cov : array (d, d)
        sum_h Cov(y_h).
    positions : array (H,)
    shift : array (H,), optional
        Subtracted from head h's target after the order is drawn: head h's designed
        position is then u^T y_h + shift_h (a combination of columns measured in
        differences from an anchor whose positions are ``shift``).
    """
    d = Y0.shape[0]
    orders = np.array([rng.permutation(Y0.shape[1]) for _ in range(candidates)])
    targets = positions[orders] + rng.uniform(-jitter, jitter, size=candidates)[:, None]
    if shift is not None:
        targets = targets - shift[None]
    H = Y0.shape[1]
    # null-space method (stable where the normal equations of generalised least squares
    # are not: the covariance spans many decades, and at H = d the rows are fixed):
    # u = u_p + N z with Y0^T u_p = targets, N a basis of null(Y0^T), z minimising u^T M u
    Q, R = np.linalg.qr(Y0, mode="complete")                     # Y0 = Q[:, :H] R[:H]
    rows = np.linalg.solve(R[:H].T, targets.T).T @ Q[:, :H].T      # (C, d), u_p
    N = Q[:, H:]                                                 # (d, d - H)
    if N.shape[1]:
        M = Y_cov / max(float(np.trace(Y_cov)) / d, 1e-300)
        z = np.linalg.lstsq(N.T @ M @ N, -(rows @ M @ N).T, rcond=None)[0].T   # (C, d - H)
        rows = rows + z @ N.T
    if V is None:
        return rows[int(np.argmin(np.einsum("cd,de,ce->c", rows, Y_cov, rows)))]
    heights = np.abs(rows @ V) / (np.linalg.norm(V, axis=0) + 1e-300)
    return rows[int(np.argmax(heights.min(axis=1)))]


def row_lambdas(positions_row: np.ndarray, half_window: float) -> np.ndarray:
    """Samples of a main row's first probe: each predicted step, the midpoints between
    neighbouring steps and one beyond each end (2H + 1); centres pin the positions,
    midpoints and ends the heights."""
    t = np.sort(-np.asarray(positions_row, dtype=np.float64))
    gap = float(np.min(np.diff(t))) if t.size > 1 else 2.0
    between = [f * t[1:] + (1 - f) * t[:-1] for f in ROW_FRACTIONS]
    lam = np.concatenate([t, *between, [t[0] - 0.5 * gap - 1.0,
                                                      t[-1] + 0.5 * gap + 1.0]])
    return np.clip(lam, -half_window, half_window)


def column_lambdas(t_row: np.ndarray, column: int, half_window: float, spares: int) -> np.ndarray:
    """Samples of a column probe: the row's measured steps (the column moves them by a
    fraction of a gap), plus ``spares`` midpoints between neighbouring steps, a
    different one for each column, which pin the row's heights."""
    t = np.sort(-np.asarray(t_row, dtype=np.float64))
    mids = 0.5 * (t[1:] + t[:-1]) if t.size > 1 else t + 1.0
    extra = [mids[(column * spares + i) % mids.size] for i in range(spares)]
    return np.clip(np.concatenate([-np.asarray(t_row), extra]), -half_window, half_window)
