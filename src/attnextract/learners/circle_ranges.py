"""The heads' rough output ranges from circles of query tokens (every-position answers).

Identity. Two selectors +T u and -T u first, then query tokens q_j on a circle of radius
RADIUS_SHARE sqrt(d) in a random plane. Where attention saturates, head h at position j
takes the selector of the sign of u^T g_h(q_j) (g_h(q) = W_h q + b_h), so

    F_j - c = T sum_h s_hj O_h u,        s_hj = sign(u^T g_h(q_j)) in {-1, +1},

and two positions between which only head h changes sign differ by exactly 2 T s O_h u
(no O^{-1}). Along the circle u^T g_h(q(theta)) = A cos theta + B sin theta + C changes
sign twice or never: each head's step appears twice, with opposite signs. Causal boxes
see the selectors from every position (they come first).

Design (DESIGN_QUERIES queries at most, MIN_REFINES + 1 at least): n positions evenly on
the circle, then n more inside the gaps where the answer steps (heads whose sign changes
share a gap part); a step that pairs with no opposite one (two heads in one gap, or a
position so near a sign change that it is not saturated) sends the next design query's
positions into its gap. Each head is a pair of opposite steps; the runs of equal answers
between steps give the sign pattern S (runs x heads), each head's column up to its sign.
Heads that never change sign on the circle ("the rest") share one constant column.

Ranges. One or two positions per run (the most central in angle) are asked again with
u_k = u + eps_k w_k (1 + K queries, w_k random unit directions, K = 1.25 rank(O) / (heads
+ 1) + 4): per query the least squares F_j - c = z_k + sum_h s_hj Y_hk gives
Y_hk = T O_h u_k, R_h = span(O_h u, (Y_hk - Y_h0) / (T eps_k)), and the rest's range
from z_k. eps_k is measured, not fixed: u_k keeps every sign at every position only if
eps_k |w_k^T g| < |u^T g| there (on MiniLM min |u^T g| / max |w^T g| ranged from 7.9e-5
to 4.1e-3), while O_h's error grows as rounding / eps_k. A sign that flips moves an
answer by 2 T O_g u, far off the pattern, so each query's residual must stay at rounding
(RESIDUAL_TOL); one that does not is asked again with eps / EPS_CUT, and the queries after
it start there. A flip is seen only if it cannot be absorbed by the heads' columns: a run
whose indicator lies (LEVERAGE_MAX) in their span (a head changing sign twice around
one run) could flip as a whole unseen, so such runs are let go first (a head left with
one sign joins the rest); positions whose residual shows them unsaturated are let go
while the rest stays so determined.

Merged heads. Two heads whose sign changes fall into the same gaps share a block (MiniLM
layer 1: two such pairs on one circle with one refining query), and the widths alone
cannot tell. So the blocks are checked by the next circle: its design and unperturbed
query give its heads' O_h u; two of them within one block, or a rest left, and that
circle's perturbed queries refine the blocks (pairwise intersections, widths adding up to
rank(O)). At most MAX_CIRCLES circles; blocks never checked go on to random selector
sets.

Checks: widths that do not add up to rank(O) (a flip carried into a range): that circle
is let go and the next one reads the ranges again. Steps that do not pair, a pattern of
deficient rank, ranges without a clean rank drop, partitions that do not refine, or
MAX_CIRCLES circles without a checked split: the circles give up (None) and the caller
falls back to random selector sets, which refuse answers that are not saturated softmax
attention. The circles' queries are kept out of the
answers held-out verification compares the model with (:func:`attnextract.oracle.
live_queries`): a position at a sign change moves by T |q| times a parameter's error
(MiniLM layer 0: W within 1.3e-11 of the truth, a design query off by 1.1e-6).
"""

from __future__ import annotations

import logging
import math

import numpy as np

from ..oracle import Oracle, live_queries
from .vector_layer import _orth, _rotation, _unit

log = logging.getLogger(__name__)

CIRCLE_POSITIONS = 46     # query tokens per query at most (two selectors before them)
MIN_CIRCLE_POSITIONS = 12  # fewer allowed by max_length: no circle (random selectors)
MIN_CIRCLE_DIM = 16       # below: d + 3 random-selector queries cost less than a circle
RADIUS_SHARE = 8.0        # circle radius, x sqrt(d) (a LayerNorm'd token's norm)
CIRCLE_LOGIT = 1e6        # typical selector score T kappa (margins far above 40 but
                          # close to a sign change: the larger, the nearer saturated)
LEVERAGE_MAX = 0.9        # a run this much inside the heads' columns' span could flip
                          # unseen: let go
DESIGN_QUERIES = 4        # design queries per circle at most
MIN_REFINES = 2           # ... of which at least this many refine the stepping gaps
MAX_CIRCLES = 4           # circles (the last one checking) before random selector sets
SPLIT_TOL = 1e-6          # a head's O_h u this little outside a block: inside it
STEP_TOL = 1e-10          # answers closer than this x the largest |F - c|: equal
PAIR_TOL = 1e-9           # two steps summing to less than this x the largest: one head
RESIDUAL_TOL = 1e-13      # a position's least-squares residual above this x |F - c|: bad
CHUNK = 8                 # perturbed queries per round (a flip lowers eps for the next)
EPS_START = 1e-3          # the perturbation's first step (O_h's error ~ 1e-15 / eps)
EPS_CUT = 8.0             # a query that flips is asked again with eps this much smaller
EPS_MIN = 1e-8            # ... not below this (O_h's error ~ 1e-7): the circle gives up
RANK_GAP = 1e-8           # a range ends at a singular value below this x the largest
DIRECTIONS_EXTRA = 4      # perturbed directions beyond 1.25 x rank(O) / heads


def _runs(angles: np.ndarray, F: np.ndarray, tol: float):
    """Positions sorted by angle grouped into runs of equal answers (cyclic): a list of
    index arrays (into ``angles``), each in angle order. A position whose steps to
    both neighbours point the same way (a weight part way between two selectors) is
    dropped first."""
    order = np.argsort(angles)
    keep = list(order)
    changed = True
    while changed and len(keep) > 2:
        changed = False
        for i in range(len(keep)):
            a, b, c = keep[i - 1], keep[i], keep[(i + 1) % len(keep)]
            s1, s2 = F[b] - F[a], F[c] - F[b]
            n1, n2 = np.linalg.norm(s1), np.linalg.norm(s2)
            if n1 > tol and n2 > tol and s1 @ s2 > (1 - 1e-6) * n1 * n2:
                del keep[i]
                changed = True
                break
    keep_arr = np.array(keep)
    runs, current = [], [keep_arr[0]]
    for i in range(1, len(keep_arr)):
        if np.linalg.norm(F[keep_arr[i]] - F[current[-1]]) <= tol:
            current.append(keep_arr[i])
        else:
            runs.append(current)
            current = [keep_arr[i]]
    if runs and np.linalg.norm(F[current[-1]] - F[runs[0][0]]) <= tol:
        runs[0] = current + runs[0]          # the circle closes
    else:
        runs.append(current)
    return [np.array(r) for r in runs]


def _pair_steps(F, runs, tol):
    """Steps between consecutive runs (cyclic; step b goes from run b to run b + 1) paired
    into heads: two opposite steps are one head's two sign changes. Returns (pairs, the
    indices of unpaired steps)."""
    R = len(runs)
    V = np.stack([F[r[0]] for r in runs])
    steps = np.roll(V, -1, axis=0) - V
    pairs, unpaired, used = [], [], set()
    for b in range(R):
        if b in used:
            continue
        partners = [b2 for b2 in range(R) if b2 != b and b2 not in used
                    and np.linalg.norm(steps[b] + steps[b2]) <= tol]
        if len(partners) == 1:
            pairs.append((b, partners[0]))
            used.update((b, partners[0]))
        else:
            unpaired.append(b)
    return pairs, unpaired


class Circle:
    """One circle: u, the plane, its design answers and the heads it isolates."""

    def __init__(self, oracle: Oracle, c, rng, T: float, n: int):
        d = oracle.dim
        self.oracle, self.c, self.T, self.n, self.d = oracle, c, T, n, d
        self.u = _unit(rng, d)
        self.plane = _rotation(rng, d)[:, :2] * (RADIUS_SHARE * math.sqrt(d))
        self.phase = rng.uniform(0, 2 * math.pi)
        self.queries = 0

    def tokens(self, angles):
        """Query tokens (len(angles), d) at these angles on the circle."""
        return np.stack([np.cos(angles), np.sin(angles)], axis=1) @ self.plane.T

    def ask(self, angles, us):
        """Answers (len(us), len(angles), m) at the query tokens of ``angles`` with the
        selectors +-T u_k first (causal positions see them)."""
        X = np.empty((len(us), 2 + len(angles), self.d))
        X[:, 0] = self.T * us
        X[:, 1] = -self.T * us
        X[:, 2:] = self.tokens(angles)[None]
        self.queries += len(us)
        # kept out of the answers held-out verification compares the model with: positions
        # at a sign change move by up to T |q| times a parameter's error (MiniLM layer 0:
        # W within 1.3e-11, a design query's answer off by 1.1e-6)
        with live_queries(self.oracle):
            return np.asarray(self.oracle.query(X), dtype=np.float64)[:, 2:]

    def design(self):
        """Positions placed so that neighbouring runs differ in one head. Returns (angles,
        answers, runs, pairs) or None (steps that never pair)."""
        n = self.n
        angles = self.phase + 2 * math.pi * np.arange(n) / n
        F = self.ask(angles, self.u[None])[0]
        self.scale = float(np.max(np.linalg.norm(F - self.c, axis=1)))
        if self.scale == 0:
            return None
        step_tol, pair_tol = STEP_TOL * self.scale, PAIR_TOL * self.scale
        for round_ in range(DESIGN_QUERIES):
            runs = _runs(angles, F, step_tol)
            if len(runs) < 2:
                return None                      # no head changes sign on this circle
            pairs, unpaired = _pair_steps(F, runs, pair_tol)
            log.debug("circle design %d: %d runs, %d heads, %d unpaired", round_, len(runs),
                      len(pairs), len(unpaired))
            if not unpaired and round_ >= MIN_REFINES:
                return angles, F, runs, pairs
            if round_ == DESIGN_QUERIES - 1:
                return None
            # the gaps to refine: the unpaired steps' if any, else every step's
            gaps = unpaired or list(range(len(runs)))
            lo = np.array([angles[runs[b][-1]] for b in gaps])
            hi = np.array([angles[runs[(b + 1) % len(runs)][0]] for b in gaps])
            hi = np.where(hi < lo, hi + 2 * math.pi, hi)
            per = np.full(len(gaps), n // len(gaps))
            per[np.argsort(lo - hi)[: n - per.sum()]] += 1
            new = np.concatenate([lo[i] + (hi[i] - lo[i]) * np.arange(1, k + 1) / (k + 1)
                                  for i, k in enumerate(per) if k > 0])
            new = np.mod(new, 2 * math.pi)
            F = np.concatenate([F, self.ask(new, self.u[None])[0]])
            angles = np.concatenate([np.mod(angles, 2 * math.pi), new])
        return None


def _patterns(runs, pairs) -> np.ndarray:
    """Sign pattern (runs, heads): +1 on the runs after a head's first step up to its
    second, -1 elsewhere."""
    S = -np.ones((len(runs), len(pairs)))
    for h, (b1, b2) in enumerate(pairs):
        lo, hi = sorted((b1, b2))
        S[lo + 1:hi + 1, h] = 1.0
    return S


def _chosen(angles, runs, n):
    """Per run its most central position, then second ones for the widest runs, n in all:
    (positions, run of each)."""
    picks = []
    for r, idx in enumerate(runs):
        a = np.unwrap(angles[idx])
        centre = (a[0] + a[-1]) / 2
        by_centre = idx[np.argsort(np.abs(a - centre))]
        picks.append((float(a[-1] - a[0]), r, by_centre))
    first = [(r, int(p[0])) for _, r, p in picks]
    second = [(r, int(p[1])) for _, r, p in sorted(picks, key=lambda t: -t[0])
              if len(p) > 1][: max(0, n - len(first))]
    both = sorted(first + second)
    return np.array([j for _, j in both]), np.array([r for r, _ in both])


def _range(M: np.ndarray, level: float):
    """Orthonormal basis of M's column space (D, k) at a clean rank drop (singular values
    below RANK_GAP x ``level``, the largest over the blocks: the rest's columns are
    rounding alone when every head changed sign), whether the columns ran out before the
    drop, or None (no clean drop: not saturated answers)."""
    U, s, _ = np.linalg.svd(M, full_matrices=False)
    k = int(np.sum(s > RANK_GAP * level))
    if k == len(s):
        return U[:, :k], True
    if k and s[k - 1] < 1e3 * s[k]:       # no clean gap between the range and rounding
        return None
    return U[:, :k], False


def circle_partition(oracle: Oracle, c, E, rng, T: float, n: int, splits=None):
    """One circle: the blocks it isolates (coordinate bases in E, each a head or heads
    changing sign at the same places) and the rest's block, or None. ``splits``: given
    the heads' O_h u in range coordinates (D, H) after the design and the unperturbed
    query, whether the perturbed queries are needed (the known blocks split); if not,
    returns ([], None, queries). Returns (blocks, rest, queries)."""
    circle = Circle(oracle, c, rng, T, n)
    designed = circle.design()
    if designed is None:
        return None, None, circle.queries
    angles, F, runs, pairs = designed
    pos, run_of = _chosen(angles, runs, n)
    tol = RESIDUAL_TOL * circle.scale
    D = E.shape[1]
    A_all = np.concatenate([np.ones((len(pos), 1)), _patterns(runs, pairs)[run_of]], axis=1)
    active = np.ones(len(pos), dtype=bool)

    def run_leverage(A, A_pinv, runs_kept):
        """Per run, the share of its positions' indicator inside the columns' span: a run
        at 1 can flip as a whole (a sign change moving past it) unseen."""
        hat = A @ A_pinv
        out = np.zeros(len(runs))
        for r in np.unique(runs_kept):
            ind = (runs_kept == r).astype(float)
            out[r] = ind @ hat @ ind / ind.sum()
        return out

    def solver(keep):
        """The least-squares solver on the positions ``keep``, or None (a deficient rank,
        or a run so determined by the others' absence that a flip there would not show)."""
        A = A_all[keep]
        sv = np.linalg.svd(A, compute_uv=False)
        if sv[-1] < 1e-6 * sv[0]:
            return None
        A_pinv = np.linalg.pinv(A)
        return None if run_leverage(A, A_pinv, run_of[keep]).max() > LEVERAGE_MAX else A_pinv

    # runs that could flip unseen are let go; a head left without a sign change at the
    # positions kept joins the rest (another circle), two heads alike: give up
    while True:
        A = A_all[active]
        sv = np.linalg.svd(A, compute_uv=False)
        if sv[-1] < 1e-6 * sv[0]:
            return None, None, circle.queries
        lev = run_leverage(A, np.linalg.pinv(A), run_of[active])
        if lev.max() <= LEVERAGE_MAX:
            break
        active &= run_of != np.argmax(lev)
        varying = np.ptp(A_all[active], axis=0) > 0
        varying[0] = True
        if not varying.all():
            log.debug("circle: %d heads join the rest", int(np.sum(~varying)))
        A_all = A_all[:, varying]
        pairs = [p for p, v in zip(pairs, varying[1:]) if v]
        if len(pairs) == 0:
            return None, None, circle.queries
    H = len(pairs)

    def settled(y) -> bool:
        """Whether answers y (positions, m) are saturated answers of the sign pattern at
        the active positions, letting go of the worst position while the rest stays
        determined (a position near a sign change)."""
        while True:
            A_pinv = solver(active)
            if A_pinv is None:
                return False
            rows = np.linalg.norm(y[active] - A_all[active] @ (A_pinv @ y[active]), axis=1)
            if rows.max() <= tol:
                return True
            worst = np.flatnonzero(active)[np.argmax(rows)]
            active[worst] = False
            if solver(active) is None:
                active[worst] = True
                log.debug("circle: residual %.1e at %d positions", rows.max() / circle.scale,
                          int(active.sum()))
                return False

    base = circle.ask(angles[pos], circle.u[None])[0] - c
    if not settled(base):
        return None, None, circle.queries
    if splits is not None:
        Y0 = solver(active) @ base[active]
        if not splits(E.T @ Y0[1:].T / T):
            return [], None, circle.queries
    # directions: 1.25 x an even share of rank(O) (the rest counted as a head)
    K = min(D, math.ceil(1.25 * D / (H + 1)) + DIRECTIONS_EXTRA)
    answers: list[tuple[np.ndarray, float]] = []
    eps = EPS_START
    todo = K
    while todo:
        # directions in chunks at the current eps; a chunk with a flip lowers it for the
        # chunks after it, and its flipped directions are asked again at the lower eps
        queue = [(_unit(rng, circle.d), eps) for _ in range(todo)]
        while queue:
            chunk, queue = queue[:CHUNK], queue[CHUNK:]
            y = circle.ask(angles[pos], np.stack([circle.u + e * w for w, e in chunk])) - c
            for (w, e), yk in zip(chunk, y):
                if settled(yk):
                    answers.append((yk, e))
                elif e / EPS_CUT < EPS_MIN:
                    return None, None, circle.queries
                else:
                    eps = min(eps, e / EPS_CUT)
                    queue.append((w, eps))
            queue = [(w, min(e, eps)) for w, e in queue]
        # every answer read again through the positions left (each settled on more)
        A_pinv = solver(active)
        Y0 = A_pinv @ base[active]                              # (1 + H, m): z, Y_h
        Ys = np.stack([(A_pinv @ yk[active] - Y0) / (T * e) for yk, e in answers])
        Ms = [E.T @ np.concatenate([Y0[i][:, None] / T, Ys[:, i].T], axis=1)
              for i in range(1 + H)]
        level = max(float(np.linalg.norm(M, 2)) for M in Ms)
        ranges = [_range(M, level) for M in Ms]
        if any(r is None for r in ranges):
            return None, None, circle.queries
        # a block as wide as its columns may be wider (two heads in it): more directions,
        # a chunk at a time (a round of K cost 48 queries where a block of 64 needed 16)
        todo = min(CHUNK, D - len(answers)) if any(full for _, full in ranges) else 0
    bases = [r[0] for r in ranges]
    log.debug("circle: widths %s (rest %d), eps %.1e, %d queries",
              [B.shape[1] for B in bases[1:]], bases[0].shape[1], eps, circle.queries)
    if any(B.shape[1] == 0 for B in bases[1:]):
        return None, None, circle.queries
    return bases[1:], bases[0], circle.queries


def _intersection(B: np.ndarray, C: np.ndarray) -> np.ndarray:
    """Orthonormal basis of span(B) cap span(C) (both with orthonormal columns)."""
    M = np.concatenate([B, -C], axis=1)
    _, s, Vt = np.linalg.svd(M)
    s = np.concatenate([s, np.zeros(M.shape[1] - len(s))])
    null = Vt[s <= 1e-6 * max(s[0], 1e-300)].T
    if not null.size:
        return B[:, :0]
    return _orth(B @ null[:B.shape[1]])


def refine(blocks: list[np.ndarray], other: list[np.ndarray]) -> list[np.ndarray] | None:
    """The common refinement of two partitions of range(O) into blocks (each block a sum of
    heads' ranges): the nonempty pairwise intersections, or None if their widths do not
    add up (not a partition of one set of independent ranges)."""
    out = []
    for B in blocks:
        for C in other:
            X = _intersection(B, C)
            if X.shape[1]:
                out.append(X)
    return out if sum(X.shape[1] for X in out) == sum(B.shape[1] for B in blocks) else None


def circle_positions(oracle: Oracle) -> int:
    """Query tokens per circle query (two selectors before them, within max_length)."""
    return min(CIRCLE_POSITIONS, (oracle.max_length or CIRCLE_POSITIONS + 2) - 2)


def circles_fit(oracle: Oracle) -> bool:
    """Whether circles apply: enough positions and dimensions (else random selectors)."""
    return circle_positions(oracle) >= MIN_CIRCLE_POSITIONS and oracle.dim >= MIN_CIRCLE_DIM


def circle_ranges(oracle: Oracle, c, E, rng, kappa: float):
    """The rough ranges from circles of query tokens. Returns (blocks: coordinate bases in
    E, whether every block is checked, the queries, the circles) or None where the circle
    does not apply or gives up (the caller uses random selectors then).

    Each circle's partition (its heads and its rest) refines the blocks. Two heads whose
    sign changes fall into the same gaps on a circle share a block there (MiniLM layer
    1: two such pairs on one circle), so the blocks are checked by the next circle's
    design and unperturbed query: its heads' O_h u, two of them inside one block (or a
    rest left) and that circle's perturbed queries refine the blocks too. Checked: no
    block holds two heads of the last circle and no rest is left."""
    D = E.shape[1]
    n = circle_positions(oracle)
    if not circles_fit(oracle):
        return None
    T = CIRCLE_LOGIT / kappa
    blocks: list[np.ndarray] | None = None
    rest = np.eye(D)
    spent = 0

    def splits(V: np.ndarray) -> bool:
        """Whether heads whose O_h u are the columns of V (D, H) split a block: two in
        one block, or a rest left."""
        if blocks is None or rest.shape[1]:
            return True
        bounds = np.cumsum([0] + [B.shape[1] for B in blocks])
        coef = np.linalg.solve(np.concatenate(blocks, axis=1), V)
        parts = np.stack([np.linalg.norm(B @ coef[a:b], axis=0)
                          for B, a, b in zip(blocks, bounds[:-1], bounds[1:])])  # (blocks, H)
        inside = parts <= SPLIT_TOL * np.linalg.norm(V, axis=0)
        alone = np.sum(~inside, axis=0) == 1                  # heads within one block
        holds = np.sum(~inside[:, alone], axis=1)
        log.debug("circle check: heads per block %s", holds.tolist())
        return bool(np.any(holds > 1))

    for circles in range(1, MAX_CIRCLES + 1):
        found, rest_new, q = circle_partition(oracle, c, E, rng, T, n, splits)
        spent += q
        if found is None:
            continue
        if not found and rest_new is None:
            return blocks, True, spent, circles          # checked: nothing to split
        partition = found + ([rest_new] if rest_new.shape[1] else [])
        if sum(B.shape[1] for B in partition) != D:
            # a flip carried into a range (MiniLM layer 2, seed 2: widths adding up to
            # 387): this circle is let go, the next one reads the ranges again
            log.debug("circle: widths %s do not add up to %d",
                      [B.shape[1] for B in partition], D)
            continue
        refined = partition if blocks is None else refine(blocks, partition)
        if refined is None:
            return None
        blocks = refined
        rest = _intersection(rest, rest_new) if rest_new.shape[1] else rest[:, :0]
    if blocks is None or len(blocks) == 1:
        return None
    return blocks, False, spent, MAX_CIRCLES


