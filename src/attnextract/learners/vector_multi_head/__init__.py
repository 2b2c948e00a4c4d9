"""Full-rank multi-head attention from vector answers: heads read by shared sigmoid steps.

Model (docs/algorithms.md, "Vector outputs"): at the last position

    F(X) = sum_h O_h X^T softmax(X (W_h x_N + b_h)) + c            in R^m,

H <= m / 2 heads whose O_h (m, d) may all have full rank d, so that their ranges overlap
and no output subspace separates them. Only the canonical form is identifiable
(:mod:`attnextract.learners.vector_canonical`): heads with equal attention merge their
O_h, heads with O_h = 0 drop, any order.

Identities.

- One token: F([x]) = O x + c, O = sum_h O_h (c = F([0])): d + 1 queries.
- Copy scans (:mod:`.steps`): n copies of q_0 + t v, then L - n copies of q_0, give
  (F - c - O q_0) / t = sum_h sigma(lambda + p_h) O_h v, lambda = ln(n / (L - n)),
  p_h = t v^T (W_h q_0 + b_h). Each head is ONE sigmoid step shared by all m channels:
  the K answers (m, K) have rank H (the head count) and each step is a zero of the
  distance from sigma(lambda + p) to their row space: no pole fit. A scan of each of d
  directions v_k (K = H + 4 queries each, one more per head beyond 4) gives every
  head's v_k^T z_h and O_h v_k.
- Crowded windows (many heads): H steps share one window of width 2 ln(L - 1) = 13.9.
  With more than SPREAD_HEADS heads, a scan whose steps all lie within
  CROWDED_LOW_SHARE of the edge is spread (scale grown) before it is accepted; a scan
  that fits poorly or shows fewer steps than heads while its steps crowd is spread too,
  not shrunk or called a misfit; the step fit uses its closed-form Jacobian and leaves
  local minima by remove-and-re-add moves; the pilot's head count grows with the
  largest rank it sees (crowded steps at the first scale hide one).
- Labels (:mod:`.labels`): mixed probes of direction 1 and direction k are linear in
  the permutation pairing their steps: about H / 2 + 2 queries per direction (designed
  without a query until the least-squares system pins the pairing, at most 2H). Where
  steps crowd that system stays ill conditioned for any count; then the pairing is
  read from each step's own attention weight in the probes (2H independent heights,
  2H <= m) by an assignment, and crowded directions get H / 2 + 2 probes. Then
  z_h = V^-T a_h and O_h = [O_h v_k]_k V^-1 for every head.
- Outputs (:mod:`.outputs`, :mod:`.refine`): with every z_h known the probes
  q_0 + t g_i, q_0 are linear in [O_1 .. O_H]: max(H d / 2, d) + 4 designed probes; then
  z_h, O_h and c are fitted jointly (variable projection, no query) to every probe that
  ends with q_0. The scans' heights alone carry the conditioning of their sigmoid
  matrices (O_h to 1e-10 at d = 16, H = 4); the joint fit brings them to the rounding.
- Query-key circuits (:mod:`.qk`): with every O_h known, one probe of n + 1 tokens
  q + t u_i, q resolves n logits of every head at once (a linear solve in the H n
  attention weights, n <= m / H): (d + 1) ceil(d / n) queries give every W_h and b_h.
  The solve is square when n = m / H, so these answers say nothing of O_h: the error
  of W_h is the condition number of that solve times the error of O_h.

Cost at d = m = 16, H = 4: 17 + 128 + 60 + 36 + 68 = 309 queries plus rescans and
verification (343 to 375 measured, 20 boxes) against the floor
(H (d^2 + d + m d) + m) / m = 133; the scalar learner spends 4,156 on the same boxes.
At d = 16, H = 8: 669 to 786 (floor 265); d = 32, H = 8: 1,317 to 1,557 (floor 521).

Error bar: ERROR_BAR_FACTOR x the largest condition number of the designed solves (logits,
outputs) x the measured noise (the rms misfit of the final model to every answer it
rests on, at least the answers' rounding). Refusals: a scan that needs more steps than H (told)
or that no H steps fit to the noise, labels that are not a permutation and a final
misfit above the noise are :class:`ModelMismatchError`; steps that cannot be brought
into the window or separated are :class:`RecoveryFailedError`.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field

import numpy as np

from ...errors import InputError, ModelMismatchError, RecoveryFailedError
from ...models import VectorAttention, biased_attention_weights
from ...oracle import QueryAccess, on_scaled_outputs
from ...precision import stated_precision
from ...report import (
    DEFAULT_VERIFY_TOLERANCE,
    ExtractionResult,
    Report,
    checked_result,
    token_scale,
    verification_count,
    verify_model,
)
from . import labels, outputs, qk, refine, steps

log = logging.getLogger(__name__)

EXTRA_SAMPLES = 4          # scan samples beyond the H steps
CROWDED = 4                # ... and one more per head beyond this many (crowded windows:
                           # 12 samples for 8 heads at d = 16 met local minima)
FIRST_WAVE = 3             # directions scanned at the pilot's scale, before the rest
MISFIT_TRIES = 2           # misfitting scans of one direction (redrawn) before a mismatch
SCAN_ROUNDS = 6            # scans of one direction at most (scale changes, new directions)
LOW_SHARE = 0.1            # a scan whose steps all lie within this share of the edge grows
SPREAD_HEADS = 5           # with more heads than this, steps within
CROWDED_LOW_SHARE = 0.3    # ... this share of the edge grow (8 steps within 1.0 at d = 16
                           # left sigmoid matrices conditioned 1e8 .. 1e10)
GOOD_FIT = 100.0           # a scan fit within this x the rounding ends the step search
MAX_TOKEN = 64.0           # largest scan scale t, in units of |q_0| (or of 1 / |q_0|)
EDGE_SHARE = 0.45          # aim the largest step at this share of the window's edge
BEYOND_SHRINK = 0.25       # a scan that sees no step: its scale shrinks this much
REDRAW_SHRINK = 0.7        # a redrawn direction's scale, in case a step was beyond the window
MIN_GAP = 0.005            # steps closer than this in one scan: the direction is redrawn
STEP_CONDITION = 1e8       # ... or a sigmoid matrix conditioned above this (three of seven
                           # steps within 0.03, 9.5e8: heights too rough to pair them)
FIT_NOISE = 1e3            # a scan fit or solve missing by more than this x the rounding
                           # of the answers is a misfit (outside the class)
MISFIT_LIMIT = 1e7          # final misfit above this x the rounding: not the class
ERROR_BAR_FACTOR = 10.0
MAX_ERROR_BAR = 1e-4        # the bar (10 x condition x misfit) grows as condition^2 x the
                            # rounding, the misfit carrying the parameters' own error: 3e-6
                            # for a true 4.3e-11 at cond(O) 4.6e3 (d = 8, one head): a bar
                            # that loose is stated, not refused; the held-out check's
                            # allowance does not follow it (verify_model)


class _Asker:
    """Asks the oracle one batch per round, reads the last position, and keeps the
    (probe, answer) pairs the fits rest on (``keep=False``: the caller keeps the rows it
    uses; a scan asked again at another scale is not one of them)."""

    def __init__(self, oracle: QueryAccess):
        self.oracle = oracle
        self.kept: list[tuple[np.ndarray, np.ndarray]] = []

    def __call__(self, X: np.ndarray, keep: bool = True) -> np.ndarray:
        F = np.asarray(self.oracle.query(X), dtype=np.float64)
        if F.ndim == 3:                       # every position: the last one carries all
            F = F[:, -1, :]
        if F.ndim != 2:
            raise InputError("vector-multi-head reads vector answers; this black box "
                             "answers one number per sequence (use 'multi-head')")
        if keep:
            self.kept.append((X, F))
        return F


def _values(ask: _Asker, d: int, biases: bool) -> tuple[np.ndarray, np.ndarray]:
    """c = F([0]) (0 without biases) and O (m, d) from the single tokens e_k."""
    tokens = np.eye(d)[:, None, :]
    if not biases:
        F = ask(tokens)
        return np.zeros(F.shape[1]), F.T
    F = ask(np.concatenate([np.zeros((1, 1, d)), tokens]))
    return F[0], (F[1:] - F[0]).T


def samples(H: int) -> int:
    """Copy scan samples for H steps."""
    return H + EXTRA_SAMPLES + max(0, H - CROWDED)


class _Scans:
    """Stage 2: copy scans of d directions at q_0 (every head's v_k^T z_h, O_h v_k)."""

    def __init__(self, ask, c, O, q0, V, noise, heads, rng):
        self.ask, self.c, self.O, self.q0, self.V = ask, c, O, q0, V.copy()
        self.noise, self.heads, self.rng = noise, heads, rng
        self.H = heads
        self.n = None
        self.misfits: dict[int, int] = {}
        self.queries = 0

    def scan(self, idx, t):
        """Y (len(idx), m, K) of directions idx at scales t; also each scan's rounding
        floor (len(idx),): the answers' rounding divided by t (Y is a difference of
        answers of size |F|, so it carries their rounding, not its own)."""
        X = steps.scan_probes(self.q0, self.V[:, idx], t, self.n)
        F = self.ask(X, keep=False).reshape(len(idx), len(self.n), -1)
        self.queries += len(X)
        self.last = (X.reshape(len(idx), len(self.n), *X.shape[1:]), F)
        base = self.c + self.O @ self.q0
        floor = self.noise * np.max(np.abs(F), axis=(1, 2)) / t
        return ((F - base) / t[:, None, None]).transpose(0, 2, 1), floor

    @property
    def largest_scale(self) -> float:
        """The largest scan scale: MAX_TOKEN x |q_0| (tokens that size), or MAX_TOKEN x the
        first scale 1 / |q_0| if larger (a short q_0, |q_0| = 0.21 at d = 8, left the two
        2.9x apart, and no scale could spread two close steps)."""
        norm = max(float(np.linalg.norm(self.q0)), 1e-300)
        return MAX_TOKEN * max(norm, 1.0 / norm)

    def pilot(self):
        """Direction 0 alone: the head count (not told) and the scale of the steps.
        Returns (t_0, the largest |v_0^T z_h|, (positions, heights) of direction 0)."""
        K = samples(self.heads or 4)
        t = np.array([1.0 / max(np.linalg.norm(self.q0), 1e-300)])
        for _ in range(SCAN_ROUNDS):
            self.n = steps.scan_counts(K)
            Ys, floors = self.scan([0], t)
            rank = self._rank(Ys[0], floors[0])
            if self.heads is None and rank >= K - EXTRA_SAMPLES // 2:
                K = samples(2 * rank)                   # the scan may hide more: widen
                continue
            if rank > 0 and (self.H is None or (self.heads is None and rank > self.H)):
                # a scan's rank is a lower bound of the count: crowded steps at the first
                # scale can hide one (d = 16, 8 heads: 7 seen, then 8 at more samples)
                self.H = self.heads or rank
                self.n = steps.scan_counts(samples(self.H))
                if len(self.n) != K:                    # the count's own samples
                    K = len(self.n)
                    continue
            verdict, p, t = self._assess(Ys[0], floors[0], 0, t)
            if verdict == "redraw":
                self.V[:, 0] = self._new_direction()
            if verdict == "ok":
                self._keep(0)
                return float(t[0]), np.max(np.abs(p)) / t[0], \
                    (p, steps.step_heights(Ys[0], self.lam, p))
        raise RecoveryFailedError("the copy scans could not bring the heads' steps into "
                                  "the lambda window")

    def _assess(self, Y, floor, k, t):
        """Verdict on one scan: ("ok", positions, t), or "rescale" / "redraw" with the
        next scale. A rank above H is a mismatch; so is a second misfit of direction k."""
        H = self.H if self.H is not None else self.heads
        rank = self._rank(Y, floor)
        if H is not None and rank > H:
            raise ModelMismatchError(
                f"a copy scan along direction {k} has rank {rank}: more steps than the {H} "
                f"heads {'told' if self.heads else 'the first scan shows'} (a head the "
                f"count missed, or not attention)")
        if rank == 0:                               # every step beyond the window
            return "rescale", None, t * BEYOND_SHRINK
        if rank < H:                                # steps merged here, or beyond
            return self._merged(Y, rank, H, t)
        p, ratio = self._fit(Y, floor)
        if p is None:
            return "redraw", None, t * REDRAW_SHRINK
        edge = float(np.max(np.abs(self.lam)))
        peak = float(np.max(np.abs(p)))
        if ratio > FIT_NOISE and H > 1 and peak < self._low(H) * edge:
            # crowded steps fit poorly (local minima): spread them before calling it a misfit
            grown = t * EDGE_SHARE * edge / max(peak, 1e-3)
            if grown[0] <= self.largest_scale:
                return "rescale", None, grown
        if ratio > FIT_NOISE and np.max(np.abs(p)) > edge - 1.0:
            # steps at or beyond the window's edge fit poorly: bring them in first
            return "rescale", None, t * EDGE_SHARE * edge / np.max(np.abs(p))
        if ratio > FIT_NOISE:
            self.misfits[k] = self.misfits.get(k, 0) + 1
            if self.misfits[k] >= MISFIT_TRIES:
                raise ModelMismatchError(
                    f"{H} sigmoid steps miss copy scans along direction {k} by {ratio:.2e} "
                    f"times their rounding: the black box is not softmax attention with "
                    f"{H} heads")
            return "redraw", None, t
        verdict, t = self._judge(p, t)
        return verdict, p, t

    def _merged(self, Y, rank, H, t):
        """Verdict on a scan showing fewer steps (rank) than heads: steps beyond the
        window (a new direction, smaller), or crowded ones merged: spread (the smaller
        scale only crowded them more: d = 16, 8 heads within 0.3, four redraws)."""
        p = steps.step_positions(Y, self.lam, rank)
        edge = float(np.max(np.abs(self.lam)))
        peak = float(np.max(np.abs(p))) if p is not None else edge
        grown = t * EDGE_SHARE * edge / max(peak, 1e-3)
        if peak < self._low(H) * edge and grown[0] <= self.largest_scale:
            return "rescale", None, grown
        return "redraw", None, t * REDRAW_SHRINK

    @staticmethod
    def _low(H):
        """Steps within this share of the window's edge are spread (more for many heads)."""
        return LOW_SHARE if H <= SPREAD_HEADS else CROWDED_LOW_SHARE

    def _rank(self, Y, floor):
        return steps.scan_rank(Y, steps.COUNT_FACTOR * floor)

    def _fit(self, Y, floor):
        """The H step positions of one scan (None: fewer separate minima) and the fit's
        rms misfit in units of the scan's rounding floor."""
        p = steps.step_positions(Y, self.lam, self.H, good=GOOD_FIT * floor)
        if p is None:
            return None, np.inf
        misfit = np.linalg.norm(steps.projection_residual(Y, self.lam, p)) / math.sqrt(Y.size)
        return p, misfit / max(floor, np.finfo(float).tiny)

    @property
    def lam(self):
        return steps.copy_lambdas(self.n)

    def _judge(self, p, t):
        """Verdict on fitted positions: inside the window and separated ("ok"), or the
        scale to try next. Steps are spread (scale grown) only to separate them, never
        beyond :attr:`largest_scale` (a direction almost orthogonal to every z_h would ask
        for huge tokens, whose answers no fit can use): there the direction is redrawn."""
        edge = float(np.max(np.abs(self.lam)))
        if p is None:          # two steps merged (or one flat beyond the window)
            return "redraw", t * REDRAW_SHRINK
        peak = float(np.max(np.abs(p)))
        if peak > edge:
            return "rescale", t * EDGE_SHARE * edge / peak
        if len(p) > 1 and peak < self._low(len(p)) * edge:
            grown = t * EDGE_SHARE * edge / max(peak, 1e-3)
            limit = self.largest_scale
            return ("rescale", grown) if grown[0] <= limit else ("redraw", t)
        if len(p) > 1 and np.min(np.diff(p)) < MIN_GAP:
            return "redraw", t
        if len(p) > 1 and np.linalg.cond(steps.step_matrix(self.lam, p)) > STEP_CONDITION:
            return "redraw", t
        return "ok", t

    def all_directions(self, t0, reach, first):
        """Scan every direction but the pilot's (``first``: its positions and heights);
        returns positions (d, H), heights (d, m, H), scales (d,).

        A few directions go first (FIRST_WAVE) at the pilot's scale; the rest at the
        scale their median reach asks for (one pilot direction with unusually small
        logits would otherwise send every scan beyond the window); scans that miss go
        again with their own new scale, in the same batch as the next wave."""
        d = self.V.shape[1]
        edge = float(np.max(np.abs(self.lam)))
        t = np.full(d, EDGE_SHARE * edge / reach)
        t[0] = t0
        P, Wv = np.zeros((d, self.H)), np.zeros((d, self.O.shape[0], self.H))
        P[0], Wv[0] = first
        reaches = [reach]
        pending, again = list(range(1, d)), []
        for _ in range(SCAN_ROUNDS + 1):
            wave = pending[:FIRST_WAVE] if len(pending) == d - 1 else pending
            pending = pending[len(wave):]
            t[wave] = min(EDGE_SHARE * edge / float(np.median(reaches)), self.largest_scale)
            todo = np.array(again + wave, dtype=int)
            if not todo.size:
                return P, Wv, t
            again = self._scan_round(todo, t, P, Wv, reaches)
        if not again and not pending:
            return P, Wv, t
        raise RecoveryFailedError(
            f"{len(again)} direction(s) never showed {self.H} separate steps inside the "
            f"window (heads with nearly equal attention there, or steps out of reach)")

    def _scan_round(self, todo, t, P, Wv, reaches) -> list[int]:
        """One batch of scans; fills P, Wv for accepted directions (their reach appended
        to ``reaches``), updates t; returns the directions to scan again."""
        Ys, floors = self.scan(todo, t[todo])
        # a redrawn direction starts again from the scale the scanned ones ask for: its
        # own scale, once thrown far off by a misfit at the window's edge, only shrank
        # with every redraw (d = 16, 4 heads: 14 -> 0.02 -> 0.004, two steps merged at
        # every one of them, refused)
        typical = min(EDGE_SHARE * float(np.max(np.abs(self.lam))) / float(np.median(reaches)),
                      self.largest_scale) * REDRAW_SHRINK
        again = []
        for k, Y, floor in zip(todo, Ys, floors):
            verdict, p, scale = self._assess(Y, floor, k, t[k:k + 1])
            if verdict == "redraw":
                self.V[:, k] = self._new_direction()
                scale = np.array([typical])
            if verdict != "ok":
                if verdict == "rescale":    # the new scale is aimed at this scan's reach
                    reaches.append(EDGE_SHARE * float(np.max(np.abs(self.lam))) / scale[0])
                t[k] = scale[0]
                again.append(int(k))
                continue
            P[k], Wv[k] = p, steps.step_heights(Y, self.lam, p)
            self._keep(int(np.flatnonzero(todo == k)[0]))
            reaches.append(float(np.max(np.abs(p))) / t[k])
        return again

    def _keep(self, row):
        """Keep scan ``row`` of the last batch (accepted) for the joint fit."""
        X, F = self.last
        self.ask.kept.append((X[row], F[row]))

    def _new_direction(self):
        v = self.rng.standard_normal(self.V.shape[0])
        return v / np.linalg.norm(v)


def _label(ask, scans, P, Wv, t, rng):
    """Stage 3: the permutation of every direction's steps onto direction 0's heads.
    Returns z (H, d) = W_h q_0 + b_h and O_h (H, m, d)."""
    H, d = scans.H, scans.V.shape[1]
    if d > 1 and H > 1:            # one head: nothing to pair
        L = steps.WINDOW_LENGTH
        counts = labels.label_design([(P[k], Wv[k], t[k]) for k in range(d)], rng, L,
                                     crowded=H > SPREAD_HEADS)
        J = len(counts)
        X = labels.label_probes(scans.q0, scans.V[:, 0], t[0], scans.V[:, 1:], t[1:], counts, L)
        F = ask(X).reshape(d - 1, J, -1) - scans.c - scans.O @ scans.q0
        ref = (P[0], Wv[0], t[0])
        for k in range(1, d):
            perm, gap = labels.match(ref, (P[k], Wv[k], t[k]), counts, F[k - 1])
            if perm is None:
                perm, miss = labels.match_weights(ref, (P[k], Wv[k], t[k]), counts, F[k - 1])
                perm = perm if miss <= labels.WEIGHTS_MISFIT else None
            if perm is None:
                raise ModelMismatchError(
                    f"mixed probes of directions 0 and {k} do not pair their steps (nearest "
                    f"permutation {gap:.2e} away): not {H} softmax heads")
            P[k], Wv[k] = P[k, perm], Wv[k][:, perm]
    z_dir, O_dir = (P / t[:, None]).T, Wv.transpose(2, 1, 0)
    Vinv = np.linalg.inv(scans.V)
    return z_dir @ Vinv, O_dir @ Vinv


def _query_key(ask, O, c, biases, q_scale, z_scale, rng):
    """Stage 4: W (H, d, d) and b (H, d) from the logit solves; also the design
    (U, n, condition), the probes' answers and the last tokens Q with their scales."""
    d = O.shape[2]
    U, n, cond = qk.design_basis(O, rng)
    Q = q_scale * np.eye(d)
    if biases:
        Q = np.concatenate([np.zeros((1, d)), Q])
    t = np.full(len(Q), qk.TARGET_LOGIT / max(z_scale, 1e-300))
    answers = None
    todo = np.arange(len(Q))
    for _ in range(qk.RESCALE_ROUNDS):
        F = ask(qk.qk_probes(Q[todo], t[todo], U, n))
        answers = F if answers is None else _replace(answers, F, todo, len(Q))
        _, peak, _ = qk.solve_logits(answers, Q, t, O, c, U, n)
        redo = np.flatnonzero(qk.needs_rescale(peak) & (np.arange(len(Q)) >= int(biases)))
        if biases and not np.isfinite(peak[0]):
            redo = np.concatenate([[0], redo])
        if not redo.size:
            break
        t[redo] = qk.next_scales(t[redo], peak[redo])
        todo = redo
    return U, n, cond, Q, t, answers


def _replace(answers, F, todo, count):
    per = len(answers) // count
    out = answers.reshape(count, per, -1).copy()
    out[todo] = F.reshape(len(todo), per, -1)
    return out.reshape(count * per, -1)


def _circuits(g, Q, U, biases, q_scale):
    """W (H, d, d), b (H, d) from logits g (len(Q), H, d) in U's basis."""
    Z = g @ U.T                                          # z_h(q) in coordinates, (Q, H, d)
    b = Z[0] if biases else np.zeros(Z.shape[1:])
    cols = Z[int(biases):] - b[None]
    return cols.transpose(1, 2, 0) / q_scale, b


def _pooled(X, W, b):
    """X^T softmax(X (W_h x_N + b_h)) of every head: (B, H, d)."""
    return np.stack([np.einsum("bn,bnd->bd", biased_attention_weights(X, Wh, bh), X)
                     for Wh, bh in zip(W, b)], axis=1)


def extract_vector_multi_head(oracle: QueryAccess, *, seed=None,
                              verify_tolerance: float = DEFAULT_VERIFY_TOLERANCE,
                              heads: int | None = None, biases: bool | None = None,
                              output_dtype: str | None = None,
                              max_error_bar: float = MAX_ERROR_BAR) -> ExtractionResult:
    """Recover the canonical heads (W_h, b_h, O_h) and c of multi-head attention from
    vector answers, heads separated by their shared sigmoid steps.

    Parameters
    ----------
    oracle : Oracle
        Door to a black box answering (B, m) (last position) or (B, N, m) (every
        position; the last one is read); ``oracle.dim`` is d.
    seed : int, optional
        Seed of the random directions, designs and held-out verification.
    verify_tolerance : float
        Largest held-out relative output error accepted.
    heads : int, optional
        H when known; else found as the rank of the first copy scan.
    biases : bool, optional
        False: the box has no biases (b_h = 0, c = 0 assumed, one query fewer per
        direction set). None or True: b_h and c are recovered (0 when absent).
    output_dtype : {"float64", "float32", "bfloat16", "float16"}, optional
        The precision of the answers: sets the noise the fits are judged against.
    max_error_bar : float
        Largest stated relative error bar accepted; above it the result is refused.

    Returns
    -------
    ExtractionResult
        ``model`` a :class:`VectorAttention` (W (H, d, d), O (H, m, d), b (H, d), c (m,)).

    Raises
    ------
    ModelMismatchError
        The answers are not H softmax heads (scans, labels, misfit, verification).
    RecoveryFailedError
        Steps that could not be placed or separated; an error bar above max_error_bar.
    """
    if getattr(oracle, "outputs", None) == "scalar":
        raise InputError("vector-multi-head reads vector answers; this black box answers "
                         "one number per sequence (use 'multi-head')")
    longest = getattr(oracle, "max_length", None)
    if longest is not None and longest < steps.WINDOW_LENGTH:
        raise InputError(f"vector-multi-head sends copy scans of {steps.WINDOW_LENGTH} tokens; "
                         f"the black box accepts at most {longest} (max_length): nothing "
                         f"was sent")
    precision = stated_precision(output_dtype)
    noise = precision.relative if precision is not None else float(np.finfo(float).eps)

    def learn(view):
        # answers of any size (1e-300 .. 1e300) are learned on an exact 2^k rescaling
        begin = _Start(view)
        fit = _recover(_Asker(view), heads, biases is not False, noise,
                       np.random.default_rng(seed))
        return _finish(view, begin, fit, seed=seed, verify_tolerance=verify_tolerance,
                       max_error_bar=max_error_bar,
                       rounded=precision is not None and not precision.exact)

    return on_scaled_outputs(oracle, learn)


@dataclass
class _Start:
    """The oracle's counters when the learner started."""

    oracle: QueryAccess
    seconds: float = field(default_factory=time.perf_counter)

    def __post_init__(self):
        o = self.oracle
        self.queries, self.black_box = o.queries, o.black_box_seconds
        self.numbers, self.tokens = o.numbers, o.tokens


@dataclass
class _Fit:
    """What the stages recovered, with their measured conditioning."""

    W: np.ndarray
    b: np.ndarray
    O: np.ndarray
    c: np.ndarray
    biases: bool
    noise: float
    misfit: float
    condition: float
    tokens_per_probe: int
    stage: dict


def _recover(ask: _Asker, heads, biases: bool, noise: float, rng) -> _Fit:
    """The stages in order (values, scans, labels, outputs, refinement, logits)."""
    oracle, d = ask.oracle, ask.oracle.dim
    count = _Counter(oracle)
    c, O = _values(ask, d, biases)
    m = O.shape[0]
    count("values")
    q0 = rng.standard_normal(d) / math.sqrt(d)
    V = np.linalg.qr(rng.standard_normal((d, d)))[0]
    scans = _Scans(ask, c, O, q0, V, noise, heads, rng)
    t0, reach, first = scans.pilot()
    log.info("vector multi-head at d = %d, m = %d: %d heads", d, m, scans.H)
    P, Wv, t = scans.all_directions(t0, reach * math.sqrt(d) / 3.0 if d > 1 else reach, first)
    count("copy scans")
    z0, O_heads = _label(ask, scans, P, Wv, t, rng)
    count("labels")
    H = scans.H
    if H > m // 2:
        raise RecoveryFailedError(f"{H} heads need m >= {2 * H} numbers per answer (pairs "
                                  f"of heads' outputs must be independent); m = {m}")
    G, tg, cond_O = outputs.design(z0, rng)
    O_heads = outputs.solve(z0, G, tg, ask(outputs.probes(q0, G, tg)) - c - O @ q0)[0]
    count("outputs")
    at_q0 = [(X, A) for X, A in ask.kept if X.shape[1] > 1 and np.all(X[:, -1] == q0)]
    z0, O_heads, c, _ = refine.refine([X for X, _ in at_q0],
                                      np.concatenate([A for _, A in at_q0]), z0, biases)
    q_scale = float(np.linalg.norm(q0))
    U, n, cond, Q, tq, answers = _query_key(ask, O_heads, c, biases, q_scale,
                                            float(np.max(np.abs(z0))) * q_scale, rng)
    count("logits")
    W, b = _circuits(qk.solve_logits(answers, Q, tq, O_heads, c, U, n)[0], Q, U, biases,
                     q_scale)
    return _Fit(W, b, O_heads, c, biases, noise, _misfit(ask.kept, W, b, O_heads, c),
                max(cond, cond_O), n, count.stage)


class _Counter:
    """Queries per stage: ``count(name)`` books those sent since the last call."""

    def __init__(self, oracle):
        self.oracle, self.last, self.stage = oracle, oracle.queries, {}

    def __call__(self, name):
        self.stage[name] = self.oracle.queries - self.last
        self.last = self.oracle.queries


def _misfit(kept, W, b, O, c) -> float:
    """Relative rms misfit of the model to every kept answer (no query)."""
    num = den = 0.0
    for X, answer in kept:
        predicted = c + np.einsum("bhd,hmd->bm", _pooled(X, W, b), O)
        num += float(np.sum((predicted - answer) ** 2))
        den += float(np.sum(answer ** 2))
    return math.sqrt(num / max(den, 1e-300))


def _finish(oracle, begin: _Start, fit: _Fit, *, seed, verify_tolerance,
            max_error_bar, rounded: bool = False) -> ExtractionResult:
    """Misfit check, error bar, held-out verification and the report."""
    H, m, d = fit.O.shape
    if not np.all(np.isfinite(fit.W)) or not np.all(np.isfinite(fit.b)):
        raise RecoveryFailedError("the logit solves left weights outside (0, 1)")
    if fit.misfit > MISFIT_LIMIT * fit.noise:
        raise ModelMismatchError(
            f"{H} softmax heads miss the answers they rest on by {fit.misfit:.2e} "
            f"(relative): the black box is not multi-head attention with {H} heads")
    # an answer's error becomes a logit error through the worst solve's conditioning
    bar = ERROR_BAR_FACTOR * fit.condition * max(fit.misfit, fit.noise)
    if bar > max_error_bar:
        raise RecoveryFailedError(f"the stated error bar {bar:.2e} exceeds max_error_bar "
                                  f"{max_error_bar:.0e}")
    # every-position answers: the model answers them too, so verification compares
    # every position (causal as the oracle states it; the learner read the last only)
    every = getattr(oracle, "outputs", None) == "all"
    model = VectorAttention(fit.W, fit.O, fit.b if fit.biases else None,
                            fit.c if fit.biases else None, positions="all" if every else "last",
                            causal=bool(getattr(oracle, "causal", False)) if every else False)
    params = H * (d * d + m * d + (d if fit.biases else 0)) + (m if fit.biases else 0)
    n_verify = verification_count(params, oracle.queries - begin.queries)
    verification = verify_model(oracle, model, count=n_verify, seed=seed,
                                tolerance=verify_tolerance, scale=token_scale(model),
                                expected_error=bar, rounded_answers=rounded)
    report = Report(
        kind=model.kind, dim=d, queries=oracle.queries - begin.queries,
        breakdown={**fit.stage, "verification": n_verify}, floor=-(-params // m),
        verification=verification, seconds=time.perf_counter() - begin.seconds,
        black_box_seconds=oracle.black_box_seconds - begin.black_box,
        details={"heads": H, "out_dim": m, "error_bar": bar,
                 "logit tokens per probe": fit.tokens_per_probe,
                 "logit condition": fit.condition, "misfit": fit.misfit,
                 "parameters": params,
                 "numbers received": int(oracle.numbers - begin.numbers),
                 "tokens sent": int(oracle.tokens - begin.tokens)})
    return checked_result(model, report, f"multi-head attention with {H} heads "
                          f"(vector answers)")
