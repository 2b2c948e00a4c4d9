"""Which measured step is which head: the main rows' labels checked against the base rows.

A main row k measured on column q_0 gives H steps (t, c) = (u_k^T W_h q_0, u_k^T v_h)
to the output precision, but which step belongs to which head comes from the design's
prediction (the base estimate of W_h q_0 and v_h), which can be off by more than a
gap when the base row's steps crowd. Any labelling of d rows gives some heads
(W_h q_0 = U^-1 T, v_h = U^-1 C: d rows, d unknowns per head), so the rows cannot check
themselves; the base rows can. The base row u_0 and its perturbations (rows P) measured
the same heads with their own labels, T_ref = P Y and C_ref = P V to their fits'
standard deviations. With every main row fitted, a labelling pi predicts them,

    P U^-1 T(pi) ~ T_ref,    P U^-1 C(pi) ~ C_ref,

and a swapped pair of heads in row k moves both predictions by (P U^-1)[:, k] times
the difference of the two steps: a gap of 0.1 against fits pinned to 1e-6.

Method. chi^2(pi), the weighted squared misfit of both predictions, is separable over
heads once the other rows' labels are fixed, so each row's best labelling given the
others is a linear assignment problem (Hungarian); the row whose best labelling
changes the most first (from the design's labels, which are mostly right), until no
row's change lowers chi^2.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy.optimize import linear_sum_assignment

DECISIVE = 25.0      # chi^2 drop (5 deviations) for which the rough estimate alone
                     # relabels a row
SWEEPS = 3           # row changes at most this x d (a wrong row needs one)


@dataclass
class Relabelled:
    """Outcome of :func:`relabel_rows`: ``order`` (d, H), row k's head h is the measured
    step order[k, h]; the misfit per checked entry before and after (about 1 when the
    labels agree with the base rows and the fits' deviations are right); rows changed."""

    order: np.ndarray
    misfit_before: float
    misfit_after: float
    rows_changed: int


def relabel_rows(U: np.ndarray, T: np.ndarray, C: np.ndarray, T_row_std: np.ndarray,
                 C_row_std: np.ndarray, P: np.ndarray, T_ref: np.ndarray, C_ref: np.ndarray,
                 T_std: np.ndarray, C_std: np.ndarray) -> Relabelled:
    """The labelling of the main rows' steps that best predicts the base rows.

    Parameters
    ----------
    U : array (d, d)
        Main rows u_k.
    T, C : arrays (d, H)
        Row k's measured step positions and heights on column q_0, in its current labels.
    T_row_std, C_row_std : arrays (d,)
        Their largest standard deviation per row (the rows' errors reach the
        predictions through P U^-1, and can exceed the base rows' own).
    P : array (n, d)
        Base rows (u_0 and its perturbations).
    T_ref, C_ref : arrays (n, H)
        Their measured positions and heights, in the base row's labels.
    T_std, C_std : arrays (n, H)
        Their standard deviations (non-finite or zero: that entry is not checked).

    Returns
    -------
    Relabelled
    """
    d, H = T.shape
    U_inv = np.linalg.inv(U)
    order = np.tile(np.arange(H), (d, 1))
    full = _Check(P @ U_inv, T_ref, C_ref, T_std, C_std, T_row_std, C_row_std)
    before = full.misfit(T, C, order)
    if not (np.isfinite(before) and H > 1):
        return Relabelled(order, before, before, 0)
    # first each row alone against the base rows' estimate of the heads (Y = P^-1 T_ref,
    # rough where the perturbations are small, but with every direction's deviation):
    # no other row can make up for a wrong one there. Then every row together with the
    # base row's precise positions, each row's own rough cost kept (alone the sum over
    # rows can be lowered by a wrong labelling of one row making up for another's)
    prior = _row_costs(U, T, C, T_row_std, C_row_std, P, T_ref, C_ref, T_std, C_std)
    for k in range(d):
        if np.all(np.isfinite(prior[k])):
            best = linear_sum_assignment(prior[k])[1]
            # only a decisive difference (the rough estimate may not tell two heads
            # apart in this row: then the design's labels stay for the next stage)
            if (prior[k][np.arange(H), order[k]].sum() - prior[k][np.arange(H), best].sum()
                    > DECISIVE):
                order[k] = best
    full.descend(T, C, order, prior)
    changed = np.any(order != np.arange(H), axis=1)
    return Relabelled(order, before, full.misfit(T, C, order), int(np.count_nonzero(changed)))


class _Check:
    """Predictions M T(pi), M C(pi) of reference rows against their measurements."""

    def __init__(self, M, T_ref, C_ref, T_std, C_std, T_row_std, C_row_std):
        self.M, self.T_ref, self.C_ref = M, T_ref, C_ref
        self.wT = _weights(_combined(T_std, M, T_row_std))
        self.wC = _weights(_combined(C_std, M, C_row_std))

    def misfit(self, T, C, order) -> float:
        """chi^2 per checked entry."""
        total = 0.0
        for values, ref, w in ((T, self.T_ref, self.wT), (C, self.C_ref, self.wC)):
            r = (self.M @ np.take_along_axis(values, order, axis=1) - ref) * w
            total += float(np.sum(np.square(r)))
        return total / max(int(np.count_nonzero(self.wT) + np.count_nonzero(self.wC)), 1)

    def descend(self, T, C, order, prior) -> np.ndarray:
        """Change ``order`` in place, one row at a time: every row's best labelling given
        the others (and its own cost ``prior`` (d, H, H)), and only the row whose change
        lowers chi^2 most is changed (changing
        the first row that gains a little leads astray). Returns the rows changed."""
        d, H = T.shape
        M = self.M
        changed = np.zeros(d, dtype=bool)
        for _ in range(SWEEPS * d):
            gains = np.zeros(d)
            proposals = order.copy()
            for k in range(d):
                cost = prior[k].copy()
                for values, ref, w in ((T, self.T_ref, self.wT), (C, self.C_ref, self.wC)):
                    rest = (M @ np.take_along_axis(values, order, axis=1)
                            - np.outer(M[:, k], values[k, order[k]]) - ref)
                    # cost[h, j]: head h takes row k's measured step j
                    trial = rest[:, :, None] + M[:, k, None, None] * values[k][None, None, :]
                    cost += np.einsum("ihj,ih->hj", np.square(trial), np.square(w))
                if not np.all(np.isfinite(cost)):
                    continue
                _, proposals[k] = linear_sum_assignment(cost)
                gains[k] = (cost[np.arange(H), order[k]].sum()
                            - cost[np.arange(H), proposals[k]].sum())
            k = int(np.argmax(gains))
            if not gains[k] > 0 or np.array_equal(proposals[k], order[k]):
                break
            order[k] = proposals[k]
            changed[k] = True
        return changed


def _row_costs(U, T, C, T_row_std, C_row_std, P, T_ref, C_ref, T_std, C_std):
    """cost[k, h, j] (d, H, H): chi^2 of row k's step j as head h against the base rows'
    own estimate Y = P^-1 T_ref, V = P^-1 C_ref and its deviations (rows of P
    independent); inf where P is singular."""
    if P.shape[0] != P.shape[1]:
        return np.zeros((U.shape[0], T.shape[1], T.shape[1]))
    A = U @ np.linalg.pinv(P)                                        # (d, n)
    cost = 0.0
    for values, ref, std, row_std in ((T, T_ref, T_std, T_row_std), (C, C_ref, C_std, C_row_std)):
        predicted = A @ ref                                          # (d, H)
        sd = np.sqrt(np.square(A) @ np.square(np.where(np.isfinite(std), std, 0.0))
                     + np.square(row_std)[:, None])
        w = _weights(sd)
        cost = cost + np.square((values[:, None, :] - predicted[:, :, None]) * w[:, :, None])
    return cost


def _combined(ref_std: np.ndarray, M: np.ndarray, row_std: np.ndarray) -> np.ndarray:
    """Standard deviations (n, H) of prediction minus reference: the reference's own
    and the main rows' propagated through M = P U^-1 (rows independent)."""
    row_var = np.square(M) @ np.square(np.asarray(row_std, dtype=np.float64))    # (n,)
    return np.sqrt(np.square(ref_std) + row_var[:, None])


def _weights(std: np.ndarray) -> np.ndarray:
    """1 / std where it is finite and positive, else 0 (not checked)."""
    std = np.asarray(std, dtype=np.float64)
    ok = np.isfinite(std) & (std > 0)
    return np.where(ok, 1.0 / np.where(ok, std, 1.0), 0.0)


HEIGHT_MATCH = 5.0   # deviations within which a step's height matches a head's


def match_heights(c_ref: np.ndarray, c_ref_std: np.ndarray, c: np.ndarray,
                  c_std: np.ndarray, moved=None) -> tuple[np.ndarray, np.ndarray]:
    """Label one column's steps of a row by their heights (which the column leaves).

    In a row u the heights c_h = u^T v_h are the same in every column q, so the steps
    of another column are labelled by the assignment (Hungarian) that best matches
    their heights to the reference's, each difference in units of the two fits'
    deviations (with a floor of 1e-9 of the largest height: fits to the rounding).

    Parameters
    ----------
    c_ref, c_ref_std : arrays (H,)
        Reference heights (a well pinned column of the row) and their deviations.
    c, c_std : arrays (H,)
        The column's fitted heights and deviations.
    moved : tuple (t_ref (H,), t (H,), move), optional
        A column that moved every step by about ``move`` at most (a nudge): the squared
        distance from each reference position in units of ``move`` is added to the
        cost, which decides where heights do not (two steps whose heights the
        reference's fit did not pin, both far off in deviations).

    Returns
    -------
    order : array (H,) of int
        Head h is the column's step order[h].
    matched : array (H,) of bool
        Whether head h's height matches within HEIGHT_MATCH deviations (a step that
        two crowded steps share, or a wrong fit, does not).
    """
    floor = 1e-9 * float(np.max(np.abs(c_ref)))
    with np.errstate(over="ignore", invalid="ignore"):
        scale = np.hypot(c_ref_std[:, None], c_std[None, :]) + floor
        z = np.abs(c_ref[:, None] - c[None, :]) / np.maximum(scale, 1e-300)
    # a step whose height its fit does not pin matches nothing: one cost for every head
    # (the heads left after the pinned steps are matched are those it may be)
    z = np.where(np.isfinite(scale), z, np.inf)
    cost = np.where(np.isfinite(z), np.square(np.minimum(z, 1e6)), 1e12)
    if moved is not None:
        t_ref, t, move = moved
        cost = cost + np.square((t_ref[:, None] - t[None, :]) / move)
    order = linear_sum_assignment(cost)[1]
    return order, z[np.arange(c_ref.size), order] <= HEIGHT_MATCH
