"""Held-out verification that looks where impostors hide.

A recovered model is accepted only after the black box has answered sequences the
learner never chose. Random short Gaussian sequences at the probes' scale are the
easy part: a black box that differs from the model class only on long sequences,
on large or tiny tokens, on sparse tokens or where attention is near one-hot passes
them. The default held-out set therefore mixes these families (fractions of the
``count`` sequences, every family at least one sequence):

``ordinary``   Gaussian tokens, lengths 1..16, at the model's scale and at d^-1/4
               (what earlier versions used);
``long``       lengths log-uniform in 2..L, L = max(256, 4 x the longest probe):
               sliding windows, ALiBi, temperatures that depend on the length;
``repeated``   long sequences built from one to three distinct tokens: position
               and count effects (a window or a sink shows at full strength);
``norms``      every sequence scaled by 10^U(-3, 3) (half with tokens of mixed
               norms inside one sequence): biases show at small norms, norm
               triggers, clipping and saturation at large ones;
``sparse``     one-hot and two-hot tokens, and Gaussian tokens sharing one constant
               coordinate (a bias-like direction);
``peaked``     tokens scaled so that the model's own scores span about 30: attention
               near one-hot, where the softmax's tails are tested;
``hull``       (single-head models) the second layer, below.

Second layer: the nearest other members of the class. For a single head every
output is a convex combination of the values of its tokens,

    f(X) = sum_i alpha_i(X) v^T x_i  in  [min_i f([x_i]), max_i f([x_i])],

whatever W is: the interval is spanned by the black box's own answers to the
length-1 sequences [x_i]. It is sharpest where it is narrowest: tokens orthogonal
to the recovered v, on which the recovered model answers 0 for every W, and so does
every single head within the model's error of it (dv^T x_i, dv the error of v).
A second head (W2, v2) at relative size eps is absorbed into v by the length-1
probes (v_hat = v + eps v2), so on these tokens its output is
eps (alpha2 - alpha)^T X v2: the full eps, not eps times the model's error.
Those pairs (a sequence and its tokens alone) are the sequences that best separate
the model from its nearest neighbours outside the class, and the check needs no
model: it holds for every single head, up to the black box's float64 rounding
(about eps_64 (d + N) of the token norm times |v|). ``HULL_FRACTION`` of the
tolerance is allowed (1e-11 relative at the default 1e-7).

Relative error. The error of sequence i is |f_hat_i - f_i| / max(|f_i|, s_i K), with
s_i the largest token norm of the sequence and K the root mean square of f_j / s_j
over the set: outputs scale with the tokens, so an honest model's error relative to
s_i K does not grow with the scale of the tokens, and a family of small tokens is
judged against outputs of its own size, not against the largest family's. Rounding
in float64 grows like eps_64 (d + N) |v| s_i, about 1e-13 relative at N = 1024, d = 384.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from .oracle import live_queries

MIN_LONGEST = 256             # held-out lengths reach at least this
LENGTH_FACTOR = 4             # ... and 4 x the longest probe
ORDINARY_LENGTH = 16
HULL_FRACTION = 1e-4          # hull tolerance = this x the output tolerance
HULL_MIN_SPREAD = 1e-2        # hull violations relative to at least this x the token norm
SCALE_CAP = 100.0            # token scales stop at this x d^-1/4
PEAK_SPREAD = 30.0            # model scores span about this on the "peaked" family
FAMILIES = {"ordinary": 0.12, "long": 0.2, "repeated": 0.12, "norms": 0.16, "sparse": 0.12,
            "peaked": 0.1, "hull": 0.25, "steps": 0.1, "heads": 0.1}
SECOND_LAYER = {"hull", "steps", "heads"}   # families that need the model (see design)
HEADS_OVERSAMPLE = 8          # candidates drawn per "heads" sequence kept
HULL_CANDIDATES = 6           # candidate orders drawn per hull sequence kept


@dataclass
class HeldOutSet:
    """Held-out sequences (N_i, d), the family of each, and the hull pairs.

    ``hull`` lists (i, singles): sequence i and the indices of the length-1 sequences
    [x] of each of its tokens (also in ``sequences``). ``replay`` lists (x, y): sequence
    x was answered y during recovery (:func:`add_replays`; not in ``sequences``).
    """

    sequences: list
    family: list
    hull: list
    replay: list = field(default_factory=list)   # (sequence, answer the learner was given)
    # per hull pair: the model's output change per unit of token displacement across the
    # pool (FFN regions: |A_S^T w_S|), or 0 to judge the pair against K (single heads)
    hull_slope: list = field(default_factory=list)

    @property
    def lengths(self) -> tuple[int, int]:
        n = [len(s) for s in self.sequences]
        return min(n), max(n)


def longest_length(probe_length: int | None = None) -> int:
    """L = max(256, 4 x the longest probe)."""
    return max(MIN_LONGEST, LENGTH_FACTOR * int(probe_length or 1))


def _split(count: int, second: set) -> dict[str, int]:
    weights = {k: w for k, w in FAMILIES.items() if k not in SECOND_LAYER or k in second}
    if count < 2 * len(weights):
        return {"ordinary": count}
    total = sum(weights.values())
    sizes = {k: max(1, int(count * w / total)) for k, w in weights.items()}
    sizes["ordinary"] += count - sum(sizes.values())
    return sizes


def length_grid(longest: int) -> np.ndarray:
    """The lengths held-out sequences take: 1..6, then steps of ~1.4x up to ``longest``.

    Sequences are sent one batch per length, so a grid keeps the black-box calls few
    (about 20 for L = 256) while still covering every scale of length.
    """
    grid = {1, 2, 3, 4, 5, 6, int(longest)}
    x = 6.0
    while x < longest:
        x *= math.sqrt(2.0)
        grid.add(min(int(round(x)), int(longest)))
    return np.array(sorted(grid))


def _log_uniform_int(rng, lo, hi, size, grid):
    """Lengths in lo..hi, log-uniform, snapped to the lengths of ``grid`` in that range."""
    grid = grid[(grid >= lo) & (grid <= hi)]
    x = rng.uniform(math.log(lo), math.log(hi + 1), size)
    return grid[np.abs(np.log(grid)[None, :] - x[:, None]).argmin(axis=1)]


def design(dim: int, count: int, rng: np.random.Generator, scale: float = 1.0, *,
           probe_length: int | None = None, model=None, hull_v=None) -> HeldOutSet:
    """The default held-out set: ``count`` sequences (N_i, dim) in the families above.

    Parameters
    ----------
    dim : int
        Token width d.
    count : int
        Number of sequences (queries), length-1 hull tokens included.
    rng : numpy Generator
    scale : float
        Per-coordinate token scale c where the model's scores are of order one.
    probe_length : int, optional
        The longest probe the learner sent (sets L).
    model : optional
        The recovered model: a single head (W, v) adds the hull family and sets the
        scale of the ``peaked`` family; other models get the first layer only.
    hull_v : array (d,), optional
        Put the hull tokens orthogonal to this v (the black box's own, measured)
        instead of the model's.
    """
    d = dim
    W = getattr(model, "W", None)
    v = getattr(model, "v", None)
    heads = None
    if W is not None and v is not None and np.ndim(W) == 3 and np.ndim(v) == 2:
        if W.shape[0] == 1:                     # one head: the single-head families
            W, v = W[0], v[0]
        elif W.shape[0] > 1:
            heads = (np.asarray(W, dtype=float), np.asarray(v, dtype=float))
    single = (W is not None and v is not None and np.ndim(W) == 2 and np.ndim(v) == 1
              and d >= 2 and np.any(v) and count >= 16)
    ffn = ffn_view(model) if not single and d >= 2 and count >= 16 else None
    if ffn is not None:
        W = ffn[0]
    second = ({"hull", "steps"} if single or ffn is not None else
              {"steps", "heads"} if heads is not None and count >= 16 else set())
    sizes = _split(count, second)
    L = longest_length(probe_length)
    grid = length_grid(L)
    anchor = d ** -0.25
    # A model with W ~ 0 (rounding noise) has an enormous token scale; beyond ~100 x the
    # d^-1/4 anchor its W is known only to that noise, so the scale stops there.
    scale = min(scale, SCALE_CAP * anchor)
    low = min(scale, anchor)
    seqs, fam = [], []

    def add(name, xs):
        for x in xs:
            seqs.append(np.ascontiguousarray(x, dtype=np.float64))
            fam.append(name)

    # ordinary: lengths 1..16, scale c or d^-1/4, times 1/2, 1 or 2
    n = sizes["ordinary"]
    base = np.where(np.arange(n) % 2 == 0, scale, anchor) * rng.choice([0.5, 1.0, 2.0], n)
    add("ordinary", [b * rng.standard_normal((int(k), d))
                     for b, k in zip(base, _log_uniform_int(rng, 1, ORDINARY_LENGTH, n, grid))])
    # long: log-uniform lengths up to L
    n = sizes.get("long", 0)
    base = np.where(np.arange(n) % 2 == 0, scale, anchor)
    lengths = _log_uniform_int(rng, 2, L, n, grid)
    lengths[:2] = L                       # the longest length always, at both scales
    add("long", [b * rng.standard_normal((int(k), d)) for b, k in zip(base, lengths)])
    # repeated: one to three distinct tokens, repeated in runs or at random
    n = sizes.get("repeated", 0)
    out = []
    for i, k in enumerate(_log_uniform_int(rng, 16, L, n, grid)):
        b = scale if i % 2 == 0 else anchor
        pool = b * rng.standard_normal((1 + i % 3, d))
        pick = np.sort(rng.integers(0, len(pool), int(k))) if i % 2 else rng.integers(0, len(pool), int(k))
        x = pool[pick]
        x[-1] = b * rng.standard_normal(d) if i % 4 == 3 else x[-1]   # sometimes a fresh query token
        out.append(x)
    add("repeated", out)
    # norms: per-sequence factor 10^U(-3, 3); half with mixed norms inside a sequence
    n = sizes.get("norms", 0)
    out = []
    # stratified: every decade of the range gets its share, whatever the draw
    exponents = -3.0 + 6.0 * (rng.permutation(n) + rng.uniform(size=n)) / max(n, 1)
    for i, k in enumerate(_log_uniform_int(rng, 1, 64, n, grid)):
        x = low * 10.0 ** exponents[i] * rng.standard_normal((int(k), d))
        if i % 2:
            x *= 10.0 ** rng.uniform(-2, 2, size=(int(k), 1))
        out.append(x)
    add("norms", out)
    # sparse: one-hot, two-hot, and a constant coordinate
    n = sizes.get("sparse", 0)
    out = []
    for i, k in enumerate(_log_uniform_int(rng, 1, 64, n, grid)):
        k = int(k)
        b = (scale if i % 2 == 0 else anchor) * math.sqrt(d) * 10.0 ** rng.uniform(-1, 1)
        kind = i % 3
        x = np.zeros((k, d))
        if kind == 0:      # one-hot tokens e_j of random signs and sizes
            x[np.arange(k), rng.integers(0, d, k)] = b * rng.choice([-1.0, 1.0], k) * rng.uniform(0.5, 2, k)
        elif kind == 1:    # two-hot
            for t in range(k):
                x[t, rng.choice(d, size=min(2, d), replace=False)] = b * rng.standard_normal(min(2, d))
        else:              # Gaussian tokens with one coordinate held constant
            x = (b / math.sqrt(d)) * rng.standard_normal((k, d))
            x[:, rng.integers(d)] = b * rng.choice([-1.0, 1.0]) * rng.uniform(0.5, 2)
        out.append(x)
    add("sparse", out)
    # peaked: the model's scores span ~PEAK_SPREAD (attention near one-hot)
    n = sizes.get("peaked", 0)
    out = []
    for i, k in enumerate(_log_uniform_int(rng, 2, 64, n, grid)):
        x = rng.standard_normal((int(k), d))
        if W is not None and np.ndim(W) == 2:
            s = x @ (W @ x[-1])
            spread = float(s.max() - s.min())
            c = math.sqrt(PEAK_SPREAD * 10.0 ** rng.uniform(-0.5, 0.5) / spread) if spread > 0 else scale
            c = min(c, 1e3 * low)
        elif heads is not None:
            s = np.einsum("nd,hde,e->hn", x, heads[0], x[-1])
            spread = float((s.max(axis=1) - s.min(axis=1)).max())
            c = math.sqrt(PEAK_SPREAD * 10.0 ** rng.uniform(-0.5, 0.5) / spread) if spread > 0 else scale
            c = min(c, 1e3 * low)
        else:
            c = scale * math.sqrt(PEAK_SPREAD) * 10.0 ** rng.uniform(-0.25, 0.25)
        out.append(c * x)
    add("peaked", out)
    # steps: copy probes [a; ...; a; q; ...; q], a = q + u, at a head's sigmoid step
    n = sizes.get("steps", 0)
    if n:
        step_heads = heads[0] if heads is not None else np.asarray(W, dtype=float)[None]
        add("steps", _step_sequences(step_heads, n, rng, scale, L, grid))
    # heads: where two heads' attention patterns differ most
    n = sizes.get("heads", 0)
    if n:
        add("heads", _separating_sequences(heads[0], heads[1], n, rng, scale, grid))
    # hull pairs: tokens orthogonal to v, then each token alone
    hull, hull_slope = [], []
    if ffn is not None and sizes.get("hull", 0) >= 4:
        first = len(seqs)
        pools, pairs, slopes = _ffn_hull(ffn, sizes["hull"], rng, max(scale, anchor), L, grid)
        for pool in pools:
            add("hull", [p[None] for p in pool])
        offsets = np.cumsum([first] + [len(pool) for pool in pools])
        for c, pick in pairs:
            hull.append((len(seqs), offsets[c] + pick))
            hull_slope.append(slopes[c])
            add("hull", [pools[c][pick]])
    if single and sizes.get("hull", 0) >= 2:
        n = sizes["hull"]
        pool_size = max(1, min(n // 2, 2 * d))
        n_seq = n - pool_size
        u = np.asarray(hull_v if hull_v is not None and np.any(hull_v) else v, dtype=float)
        u = u / np.linalg.norm(u)
        P = rng.standard_normal((pool_size, d))
        P -= np.outer(P @ u, u)
        P -= np.outer(P @ u, u)                         # twice: orthogonal to rounding
        norms = np.linalg.norm(P, axis=1, keepdims=True)
        P = P / np.where(norms > 0, norms, 1.0)
        # from where attention is soft (half the pool: where a second head shows) to
        # where it is near one-hot
        top = np.where(np.arange(pool_size) % 2 == 0, 0.5, 1.5)[:, None]
        P *= max(scale, anchor) * math.sqrt(d) * 10.0 ** rng.uniform(-0.5, top, (pool_size, 1))
        first = len(seqs)
        add("hull", [p[None] for p in P])
        singles = np.arange(first, first + pool_size)
        for k in _log_uniform_int(rng, 2, min(L, 64), n_seq, grid):
            pick = _soft_pick(W, P, int(k), rng)
            hull.append((len(seqs), singles[pick]))
            hull_slope.append(0.0)
            add("hull", [P[pick]])
    return HeldOutSet(sequences=seqs, family=fam, hull=hull, hull_slope=hull_slope)


def _soft_pick(W: np.ndarray, P: np.ndarray, k: int, rng, candidates: int = HULL_CANDIDATES):
    """Indices of k pool tokens (rows of P) forming the hull sequence, chosen among
    ``candidates`` random orders as the one whose attention under W is least one-hot.

    On tokens orthogonal to v a second head shows as eps (alpha2 - alpha)^T X v2: nothing
    where both heads put all their weight on one token (or spread it evenly), the full
    eps where the model's attention is spread but not flat."""
    best, best_peak = None, np.inf
    for _ in range(candidates):
        pick = rng.permutation(np.resize(rng.permutation(len(P)), k))
        X = P[pick]
        s = X @ (W @ X[-1])
        a = np.bincount(pick, np.exp(s - s.max()), minlength=len(P))   # weight per token
        peak = abs(float(a.max() / a.sum()) - 0.5)      # 0.5: spread, not flat
        if best is None or peak < best_peak:
            best, best_peak = pick, peak
    return best


def ffn_view(model):
    """(W (d, d), A_eff (m, d), b (m,), w (m,)) of a one-head model that reads its
    attention output z through a ReLU layer, f = w^T ReLU(A_eff z + b) + c0 (a one-layer
    Transformer, A_eff = A; a Transformer layer with one head and no residual term,
    A_eff = A V); None for other models."""
    A, w = getattr(model, "A", None), getattr(model, "w", None)
    W = getattr(model, "W", None)
    if A is None or w is None or W is None or getattr(model, "residual", False):
        return None
    W = np.asarray(W, dtype=float)
    V = getattr(model, "V", None)
    if W.ndim == 3:
        if W.shape[0] != 1:
            return None
        W = W[0]
    A_eff = np.asarray(A, dtype=float)
    if V is not None:
        V = np.asarray(V, dtype=float)
        A_eff = A_eff @ (V[0] if V.ndim == 3 else V)
    if W.ndim != 2 or A_eff.shape[1] != W.shape[0] or getattr(model, "B", None) is not None:
        return None
    b = np.asarray(getattr(model, "b", np.zeros(len(A_eff))), dtype=float)
    return W, A_eff, b, np.asarray(w, dtype=float)


FFN_CENTRES = 3               # linear regions the FFN hull pairs are drawn in
FFN_SPREAD = 10.0             # the model's scores span about this on a hull pool


def _region_tokens(A, b, w, p, rng, k: int):
    """k tokens p + delta_i in the linear region of the FFN containing p, with every
    delta_i orthogonal to the region's readout v_S and to the normals of the d/2
    nearest hyperplanes, each as long as keeps every unit's sign (times 0.9)."""
    d = len(p)
    pre = A @ p + b
    active = pre > 0
    v_S = A[active].T @ w[active]
    rows = np.maximum(np.linalg.norm(A, axis=1), np.finfo(float).tiny)
    nearest = np.argsort(np.abs(pre) / rows)[:max(0, d // 2 - 1)]
    basis = np.linalg.qr(np.column_stack([v_S] + [A[j] for j in nearest]))[0]
    D = rng.standard_normal((k, d))
    D -= (D @ basis) @ basis.T
    D -= (D @ basis) @ basis.T                # twice: orthogonal to rounding
    D /= np.maximum(np.linalg.norm(D, axis=1, keepdims=True), np.finfo(float).tiny)
    with np.errstate(divide="ignore"):
        reach = np.abs(pre)[None, :] / np.abs(D @ A.T)        # step to each hyperplane
    # no hyperplane in the way: stay within the centre's own norm
    step = 0.9 * np.minimum(reach.min(axis=1), np.linalg.norm(p)) * rng.uniform(0.3, 1.0, k)
    return p + step[:, None] * D


def _ffn_hull(ffn, n: int, rng, scale: float, longest: int, grid):
    """Hull pairs inside one linear region of the FFN: there f = v_S^T z + const with
    v_S = A_S^T w_S (S the active units), a single head, so the answer to a sequence
    lies between its tokens' own answers whatever W is. Tokens x = p + delta with
    delta orthogonal to v_S, each keeping every unit's sign (regions are convex, so
    every convex combination stays too): the model answers f(p) on all of them, and a
    second head with another value map shows in full, as for a single head. The
    centre's norm is raised until the model's scores span about FFN_SPREAD.

    Returns (pools, pairs, slopes): ``pools`` a list of token arrays (k, d), one per
    centre; ``pairs`` (centre, indices into its pool) for the sequences; ``slopes`` the
    region's |v_S| per centre, the scale a pair's violation is judged at (the layer's
    constants, c0 and w^T ReLU(b), would inflate the set's K).
    """
    W, A, b, w = ffn
    d = W.shape[0]
    n_centres = max(1, min(FFN_CENTRES, n // 6))
    pool_size = max(2, min(n // (2 * n_centres), 2 * d))
    pools, pairs, slopes = [], [], []
    for c in range(n_centres):
        p = rng.standard_normal(d)
        p *= scale * math.sqrt(d) / np.linalg.norm(p)
        for _ in range(4):                    # scores scale like |p|^2 (a cone for b = 0)
            X = _region_tokens(A, b, w, p, rng, pool_size)
            s = X @ (W @ X[-1])
            spread = float(s.max() - s.min())
            if not spread > 0:
                break
            p = p * min(math.sqrt(FFN_SPREAD / spread), 1e3)
        pool = _region_tokens(A, b, w, p, rng, pool_size)
        if np.all(np.isfinite(pool)):
            pools.append(pool)
            active = A @ p + b > 0
            slopes.append(float(np.linalg.norm(A[active].T @ w[active])))
    if not pools:
        return [], [], []
    n_centres = len(pools)
    n_seq = n - n_centres * pool_size
    for i, k in enumerate(_log_uniform_int(rng, 2, min(longest, 64), max(n_seq, 0), grid)):
        c = i % n_centres
        pairs.append((c, _soft_pick(W, pools[c], int(k), rng)))
    return pools, pairs, slopes


def _step_sequences(W: np.ndarray, count: int, rng, scale: float, longest: int, grid) -> list:
    """Copy probes at each head's step: m copies of a = q + u, then N - m copies of q.

    With lambda = ln(m / (N - m)), head h attends to a with weight sigma(t_h + lambda),
    t_h = u^T W_h q (the identity of the multi-head learner): at lambda = -t_h the
    output is most sensitive to head h, and a model whose head h is off, or a black box
    whose attention depends on counts or positions, shows there. Sequences (N, d).
    """
    H, d = W.shape[0], W.shape[1]
    out = []
    for i, N in enumerate(_log_uniform_int(rng, 4, longest, count, grid)):
        N = int(N)
        h = i % H
        q = scale * rng.standard_normal(d)
        u = scale * rng.standard_normal(d)
        t = float(u @ W[h] @ q)
        reach = 0.8 * math.log(N - 1)          # |lambda| a length N can realise
        if abs(t) > reach:
            u *= reach / abs(t)
            t = float(u @ W[h] @ q)
        m = int(np.clip(round(N / (1.0 + math.exp(t))), 1, N - 1))   # m / N = sigma(-t)
        out.append(np.concatenate([np.tile(q + u, (m, 1)), np.tile(q, (N - m, 1))]))
    return out


def _separating_sequences(W: np.ndarray, v: np.ndarray, count: int, rng, scale: float,
                          grid) -> list:
    """Sequences where two heads' attention patterns differ most.

    Merging heads g and h (giving head h the weights alpha_g) changes the output by
    (alpha_g - alpha_h)^T X v_h: the nearest other models of the class (heads merged,
    swapped or split) differ from the model most where that is large. Of
    HEADS_OVERSAMPLE x ``count`` Gaussian candidates (lengths 2..64, at the scale and at
    scales where attention is sharper), the ``count`` with the largest
    max_{g != h} |(alpha_g - alpha_h)^T X v_h| / (s |v_h|) are kept.
    """
    from .models import softmax
    H, d = W.shape[0], W.shape[1]
    vn = np.maximum(np.linalg.norm(v, axis=1), np.finfo(float).tiny)
    cands, merit = [], []
    for k in _log_uniform_int(rng, 2, 64, HEADS_OVERSAMPLE * count, grid):
        x = scale * 10.0 ** rng.uniform(0.0, 0.75) * rng.standard_normal((int(k), d))
        alpha = softmax((W @ x[-1]) @ x.T)           # (H, N): W x_N first, O(H d^2 + N H d)
        values = x @ v.T                                                    # (N, H)
        gap = np.abs(np.einsum("gn,nh->gh", alpha, values) - np.diag(alpha @ values)[None, :])
        cands.append(x)
        # tokens that underflow to 0 (a model with enormous W has a tiny scale) merit 0
        size = float(np.linalg.norm(x, axis=1).max())
        merit.append(float((gap / vn[None, :]).max()) / size if size > 0 else 0.0)
    return [cands[i] for i in np.argsort(merit)[::-1][:count]]


REPLAY_FRACTION = 0.125       # at most this share of the check re-asks learner queries


def root_oracle(oracle):
    """The :class:`attnextract.oracle.Oracle` under a learner's view of it (``.base``)."""
    from .oracle import Oracle
    while not isinstance(oracle, Oracle) and hasattr(oracle, "base"):
        oracle = oracle.base
    return oracle


def add_replays(held: HeldOutSet, oracle, count: int) -> HeldOutSet:
    """Add up to ``count`` of the root oracle's kept (sequence, answer) pairs
    (:attr:`attnextract.oracle.Oracle.replay`) as the ``replay`` family: asked again of
    the root oracle (a learner's view may change what a query means), a fixed function
    answers the same (to its rounding); a black box that switched behaviour during the
    run does not, even where the new behaviour is itself a member of the class."""
    pairs = list(getattr(root_oracle(oracle), "replay", None) or [])[:max(0, int(count))]
    held.replay.extend((np.ascontiguousarray(x, dtype=np.float64), float(y)) for x, y in pairs)
    return held


def is_biased(model) -> bool:
    """True for the biased attention classes (query biases b, output constant c)."""
    return str(getattr(model, "kind", "")).startswith("biased-")


def score_spread(model, sequences) -> np.ndarray:
    """Largest range max_i s_i - min_i s_i of any head's scores s = X W_h x_N per
    sequence, shape (len(sequences),); zeros for a model without W."""
    W = getattr(model, "W", None)
    if W is None or np.size(W) == 0:
        return np.zeros(len(sequences))
    W = np.asarray(W, dtype=float)
    W = W[None] if W.ndim == 2 else W
    b = np.reshape(model.b, W.shape[:2]) if is_biased(model) else np.zeros(W.shape[:2])
    out = np.empty(len(sequences))
    for i, X in enumerate(sequences):
        s = np.einsum("nd,hd->hn", X, np.einsum("hde,e->hd", W, X[-1]) + b)
        out[i] = float((s.max(axis=1) - s.min(axis=1)).max())
    return out


def token_norms(sequences) -> np.ndarray:
    """Largest token norm of each sequence, shape (len(sequences),)."""
    return np.array([float(np.linalg.norm(s, axis=1).max()) for s in sequences])


def output_scale(observed: np.ndarray, norms: np.ndarray) -> float:
    """K = rms of f_j / s_j: the black box's output per unit of token norm."""
    with np.errstate(divide="ignore", invalid="ignore"):
        r = np.where(norms > 0, observed / np.where(norms > 0, norms, 1.0), 0.0)
    return math.sqrt(float(np.mean(r ** 2))) if r.size else 0.0


def scaled_relative_errors(predicted, observed, norms, reference=None) -> np.ndarray:
    """|predicted - observed| / max(|observed|, s K) per sequence (see the module docstring).

    ``reference`` (boolean mask) picks the sequences K is computed from (default all);
    the hull family, built to answer ~0, is left out of it."""
    K = output_scale(observed[reference] if reference is not None else observed,
                     norms[reference] if reference is not None else norms)
    denom = np.maximum(np.abs(observed), np.maximum(norms * K, np.finfo(float).tiny))
    return np.abs(predicted - observed) / denom


def hull_violations(held: HeldOutSet, observed: np.ndarray, norms: np.ndarray) -> np.ndarray:
    """For each hull pair: how far f(X) lies outside [min f([x_i]), max f([x_i])], relative
    to r K (K from the other families, or the pair's own ``hull_slope``; r the spread of
    the tokens about their mean, at least HULL_MIN_SPREAD x their largest norm s). Zero
    inside. Shape (len(held.hull),).

    The spread, not s: tokens p + delta_i around a far centre p (the FFN's linear
    regions) vary only by delta, and so does everything a convex combination can do."""
    if not held.hull:
        return np.zeros(0)
    ref = np.array([f != "hull" for f in held.family])
    K = output_scale(observed[ref], norms[ref])
    slopes = list(held.hull_slope) + [0.0] * (len(held.hull) - len(held.hull_slope))
    out = np.empty(len(held.hull))
    for j, (i, singles) in enumerate(held.hull):
        lo, hi = observed[singles].min(), observed[singles].max()
        gap = max(0.0, observed[i] - hi, lo - observed[i])
        X = held.sequences[i]
        spread = float(np.linalg.norm(X - X.mean(axis=0), axis=1).max())
        slope = slopes[j] if slopes[j] > 0 else K
        out[j] = gap / max(max(spread, HULL_MIN_SPREAD * norms[i]) * slope, np.finfo(float).tiny)
    return out


@dataclass
class Check:
    """What one held-out check measured (before it becomes a report.Verification)."""

    errors: np.ndarray
    family: list
    hull: np.ndarray
    observed: np.ndarray
    predicted: np.ndarray
    lengths: tuple

    def worst_family(self) -> str:
        return self.family[int(np.argmax(self.errors))] if self.errors.size else ""

    def family_errors(self) -> dict:
        out = {}
        for f, e in zip(self.family, self.errors):
            out[f] = max(out.get(f, 0.0), float(e))
        return out


def run_check(oracle, model, held: HeldOutSet) -> Check:
    """Ask the black box every held-out sequence (one batch per length); compare."""
    from .oracle import evaluate_ragged
    with live_queries(oracle):          # the live black box, never a journal's answers
        observed = oracle.query_ragged(held.sequences)
    predicted = evaluate_ragged(model, held.sequences)
    norms = token_norms(held.sequences)
    reference = np.array([f != "hull" for f in held.family])
    # a biased model's output constant c is taken off both sides: the errors are then
    # judged against the part that scales with the tokens (a box whose constant differs
    # shows at small tokens, where its f - c does not vanish), and the hull intervals
    # are unchanged by a common shift
    offset = float(model.c) if is_biased(model) else 0.0
    errors = scaled_relative_errors(predicted - offset, observed - offset, norms, reference)
    hull = hull_violations(held, observed - offset, norms)
    family = list(held.family)
    if held.replay:
        # the answer now against the answer the learner was given (root oracle, live)
        root = root_oracle(oracle)
        xs = [x for x, _ in held.replay]
        then = np.array([y for _, y in held.replay])
        with live_queries(root):
            now = root.query_ragged(xs)
        errors = np.concatenate([errors, scaled_relative_errors(now, then, token_norms(xs))])
        observed, predicted = np.concatenate([observed, now]), np.concatenate([predicted, then])
        family += ["replay"] * len(xs)
    return Check(errors=errors, family=family, hull=hull, observed=observed,
                 predicted=predicted, lengths=held.lengths)


def looks_like_rounding(error: float) -> bool:
    """A failed check with an error this small is more likely limited output precision
    (float32 ~1e-7 .. 1e-3, bfloat16 ~1e-2, a few decimals) than another model."""
    return 0.0 < error < 3e-2


# -- labels: the decision boundary -------------------------------------------------------

BOUNDARY_FRACTION = 0.25      # share of a label check spent next to the model's boundary
BOUNDARY_REACH = (2.0, 30.0)   # offsets from the boundary, in units of the model's allowance


def boundary_shift(model, sequences, targets, iterations: int = 200) -> list:
    """Move each sequence X along E = 1 v^T / |v| (every token by the same multiple of
    v_hat) until the model answers ``targets[i]``; returns the moved sequences.

    For a single head f(X + t E) = alpha(t)^T X v + t |v| with |alpha^T X v| <= max_i
    |x_i^T v|, so the bracket below always holds the target and bisection (on the model,
    no queries) finds a t with f = target to float64 precision.
    """
    v = np.asarray(model.v, dtype=float)
    u = v / np.linalg.norm(v)
    out = []
    for X, target in zip(sequences, targets):
        if not (np.all(np.isfinite(X)) and math.isfinite(target)):
            continue
        reach = (float(np.abs(X @ v).max()) + abs(float(target))) / np.linalg.norm(v) + 1.0
        lo, hi = -reach, reach
        for _ in range(iterations):
            mid = 0.5 * (lo + hi)
            if model((X + mid * u)[None])[0] < target:
                lo = mid
            else:
                hi = mid
            if hi - lo <= 1e-17 * reach:
                break
        out.append(X + 0.5 * (lo + hi) * u)
    return out


def near_boundary(model, count: int, rng: np.random.Generator, scale: float, threshold: float,
                  allowance) -> list:
    """``count`` sequences on which the model answers threshold +- k allowance(X), k
    log-uniform in BOUNDARY_REACH: just clear of its own uncertainty, on both sides.

    A label-only check on random sequences sees a black box only where its labels
    differ from the model's, which for a perturbation of relative size eps is a set of
    measure ~eps around the decision boundary; these sequences sit inside that set, so a
    second head at 1e-8 flips about half of them while an honest black box (whose
    outputs are within the allowance of the model's) flips none. ``allowance(X)`` is the
    model's own output uncertainty on a batch X (B, N, d) -> (B,).
    """
    # half short, half log-uniform up to MIN_LONGEST: a box that differs only on long
    # sequences (a sliding window of 64) differs there by O(1), and flips labels here
    lengths = np.where(np.arange(count) % 2 == 0, rng.integers(2, ORDINARY_LENGTH + 1, count),
                       np.exp(rng.uniform(np.log(ORDINARY_LENGTH), np.log(MIN_LONGEST + 1),
                                          count)).astype(int))
    seeds = [scale * rng.standard_normal((int(n), model.dim)) for n in lengths]
    on = boundary_shift(model, seeds, np.full(count, float(threshold)))
    k = np.exp(rng.uniform(*np.log(BOUNDARY_REACH), count)) * rng.choice([-1.0, 1.0], count)
    room = np.array([float(allowance(X[None])[0]) for X in on])
    # an infinite allowance (a model with unbounded error bars) leaves nothing to check
    keep = np.flatnonzero(np.isfinite(room) & (room > 0))
    moved = boundary_shift(model, [on[i] for i in keep], threshold + k[keep] * room[keep])
    return [X for X in moved if np.all(np.isfinite(X))]
