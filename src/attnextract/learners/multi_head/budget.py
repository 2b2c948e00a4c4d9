"""Query budget of a multi-head run: the multi-head paper's count, the biased count and each stage's
share, and the redesign a failed design triggers while the count allows.

Queries: d + base (3 to 14 scans of 4H + 8 samples, within what the multi-head paper's count leaves;
a crowded row's H + 1 nudged and one to five designed columns of 3H + 1;
(d - 1)(2H + 3) perturbations)
+ d (2H + 1) + d^2 (H + 1) main probes (one head: d^2, :func:`column_spares`; told one
head on float64 answers where that design exceeds the multi-head paper's count but the floor plus the
verification fit it, d = 6 and 7: the single-head identities, d + d^2), plus d^2 (H + 1)
when round 3 runs: the floor H(d^2 + d) (the canonical form's free parameters) plus
about d^2 + Hd + base (twice the columns with round 3), never above the multi-head paper's count
4Hd^2 - 2H + 1. With ``precision="full"`` and float64 answers, the short probes spend
what that count leaves after the verification (to within d - 1 queries) when it leaves
at least 1.25 H (d + 1) per row. With biases the count is the multi-head paper's plus what the biases
add, 4Hd^2 - 2H + 1 + (H + 1) d + 1 (:func:`biased_count`: c and H + 1 more samples per
short-probe row), the base stage keeps the bias-free run's share and the short probes
need 1.25 H (d + 1) + H + 1 per row (sent when the bias-free run's would be).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from ...oracle import root_oracle
from ...report import verification_count
from .constants import (
    BASE_CANDIDATES,
    BIASED_COUNT_BOUND,
    COLUMN_SPARES,
    EXTRA_COLUMNS,
    RANDOM_COLUMNS,
    SCALE_ROUNDS,
    SHORT_OVERSAMPLE,
)


class _Redesign(Exception):
    """A design failed (a fit that misses the noise, an error bar too large, a held-out
    mismatch): draw another while the count allows, else refuse with ``kind``."""

    def __init__(self, kind, message: str, model=None, bar=None, result=None,
                 low_count: bool = False, rows=None, fitted: bool = False):
        super().__init__(message)
        self.kind, self.message, self.model, self.bar = kind, message, model, bar
        self.result = result          # already verified (a held-out mismatch)
        # the failure says the head count may be low (a fit of the count's steps misses
        # the noise): not told H, the count is reopened when measurements show more steps
        # (:meth:`.base_row.BaseRowStage.reopen_count`); ``rows``: (u (n, d), q (d,),
        # lambdas (n, S), g (n, S)) the rows that missed and their samples, rescanned
        self.low_count, self.rows = low_count, rows
        # every fit reached the answers' noise (an error bar above the one accepted, a
        # labelling of the learner's): the answers are not evidence against the class
        self.fitted = fitted


def paper2_count(heads: int, dim: int) -> int:
    """The multi-head paper's query count 4 H d^2 - 2H + 1."""
    return 4 * heads * dim * dim - 2 * heads + 1


def biased_count(heads: int, dim: int) -> int:
    """The biased learner's query count: the multi-head paper's count plus what the biases add,
    4 H d^2 - 2H + 1 + (H + 1) d + 1 (at most BIASED_COUNT_BOUND x (the multi-head paper's count
    + H d), binding only at d <= 3 with one head).

    The biased run's stages are the bias-free run's (its base stage keeps the multi-head paper's
    share, its main rounds are the same size); what b_h and c need beyond them is
    c = f([0]) (1 query) and, in each of the d rows that the short probes (or wide
    columns) fit, H + 1 more samples: the row's H more unknowns (the intercepts
    u^T b_h of the affine column [q; 1]) and one that keeps the row's fit as
    overdetermined as the bias-free one. So the biased run spends at most (H + 1) d + 1
    more than the bias-free run on the same heads that spends its count (median 1.002x
    to 1.018x the bias-free run's + H d at d = 8 and 16, at most 1.065x:
    benchmarks/bench_multi_head_biases.py, the run is in the git history); where the bias-free run leaves part of its
    count unspent (short probes that do not fit) the biased run leaves the same part
    (:meth:`Budget.short_need`). The count the multi-head paper would give affine columns,
    4 H d (d + 1) - 2H + 2 = the multi-head paper's + 4 H d + 1, spent 1.09x to 1.16x the bias-free
    run's + H d at d = 8 (benchmarks/bench_multi_head_biases.py, also in the git history). It stays above the floor
    H(d^2 + 2d) + 1 plus the verification from d = 5 on (d = 4 with two heads or more),
    as the multi-head paper's count does above the bias-free floor."""
    derived = paper2_count(heads, dim) + (heads + 1) * dim + 1
    bound = paper2_count(heads, dim) + heads * dim
    return min(derived, int(BIASED_COUNT_BOUND * bound))


def bias_share_per_row(heads: int) -> int:
    """Queries per short-probe row the biased count adds to the bias-free run's: the
    row's H intercepts and one more sample (:func:`biased_count`)."""
    return heads + 1


def _check_queries(oracle) -> int:
    """A journal's binding queries so far (0 without one), through oracle views."""
    return int(getattr(root_oracle(oracle), "check_queries", 0))


def _budget_left(oracle) -> float:
    """Queries the budget still allows (inf without one), through oracle views: a
    journal's binding checks are answered by the black box, so they are within the
    budget (as :meth:`attnextract.oracle.Oracle.require` counts them)."""
    root = root_oracle(oracle)
    budget = getattr(root, "budget", None)
    return math.inf if budget is None else budget - root.queries - _check_queries(root)


def _scan_size(heads: int) -> int:
    """Samples of a base scan that decides head counts up to ``heads``."""
    return 4 * heads + 8


def perturbation_samples(H: int) -> int:
    """Samples of each perturbed base row: 2H + 3 on a uniform grid (its H steps are
    evenly spaced by the designed column, 2H unknowns; 3H + 3 around crowded rows left
    the short probes too few queries at d = H = 8)."""
    return 2 * H + 3


def column_spares(H: int) -> int:
    """Samples per column probe of the main rows (rounds 2 and 3) beyond its H steps:
    COLUMN_SPARES midpoints, which pin the row's heights. One head has no midpoint and
    its row's height is pinned by the row's first probe (3 samples, 2 unknowns), so
    none: with a spare the smallest one-head design at d = 8 needed 295 queries with
    the verification, above the multi-head paper's count 255."""
    return COLUMN_SPARES if H > 1 else 0


def column_samples(H: int) -> int:
    """Samples of each column scan of the base row (:meth:`_Extraction.designed_column`):
    3H + 1 on a uniform grid (2H + 3 left the free fits of crowded columns in a wrong
    basin: at d = 16, H = 10 four of eleven columns missed the noise; 3H + 3 left the
    short probes 98 of the 100 queries per row they need at d = H = 8 with biases)."""
    return 3 * H + 1


if TYPE_CHECKING:
    from .state import RunState
else:
    RunState = object     # the run's attributes, a type only (state.py)


class Budget(RunState):
    """Stage methods of :class:`_Extraction` (budget)."""

    def smallest_design(self, H: int) -> int:
        """Queries of the smallest design told H, verification included: v, three base
        scans, the base estimate and the main rounds."""
        return (self.d + 3 * _scan_size(H) + self.perturbation_cost(H) + self.main_cost(H)
                + verification_count(self.parameters(H)))

    def least_run(self, H: int) -> int:
        """Queries of the least run told H that can succeed: v (and c), three base scans,
        the base estimate, the main rounds with :meth:`least_columns` and the held-out
        verification. A budget below it is refused before any query."""
        return (self.d + self.biases + 2 * _scan_size(H) + self.attempt_cost(H, least=True)
                + verification_count(self.parameters(H)))

    def rest_cost(self, H: int) -> int:
        """Queries of a run told H beyond its base scans: v (and c), the perturbations,
        rounds 1 and 2 and the held-out verification."""
        return (self.d + self.biases + self.perturbation_cost(H) + self.main_cost(H)
                + verification_count(self.parameters(H)))

    def short_share(self) -> bool:
        """Whether the base search keeps the short probes' share of the count
        (``precision="full"`` on float64 answers without decimals)."""
        return (self.full_precision and self.precision_name == "float64"
                and self.decimals is None)

    def base_scans(self, H: int, short_share: bool) -> int:
        """Base scans (scale rounds and candidate rows) of a run told H, at least three:
        what the multi-head paper's count leaves after :meth:`rest_cost` (a rounded box, whose rows
        never pin their steps to BASE_QUALITY, spent all of it: --decimals 5 at d = 8,
        H = 2 used 495 + 64 verification = 559 of 509). ``short_share``: also after the
        short probes' SHORT_OVERSAMPLE x H (d + 1) per row; a base search that spends it
        (ten crowded candidate rows at d = 8, H = 8, none pinned to BASE_QUALITY) leaves
        the main rows' 1e-10 where the short probes give 1e-14 (binding where the count
        is tight, d = 8).

        With biases the base stage's share is the bias-free run's: the biased count's
        (H + 1) d + 1 more queries (:func:`biased_count`) pay for c and the short
        probes' H + 1 more per row, not for more base rows (a base search that spent the
        biases' share, crowded rows at d = H = 8, left the short probes 86 to 99 of
        their 100 per row in 6 of 20 runs)."""
        s0 = _scan_size(H)
        left = paper2_count(H, self.d) - (self.rest_cost(H) - self.biases)    # c apart
        scans = max(3, min(SCALE_ROUNDS + BASE_CANDIDATES, left // s0))
        short = self.d * SHORT_OVERSAMPLE * H * (self.d + 1)
        if short_share and math.isfinite(short):       # (no short probes: infinite)
            scans = max(3, min(scans, int((left - short) // s0)))
        return scans

    def short_need(self, H: int) -> float:
        """Queries per row the short probes need: SHORT_OVERSAMPLE x the bias-free row's
        H (d + 1) unknowns, with biases H + 1 more (the biased count's share per row,
        :func:`bias_share_per_row`), so that a biased run sends them exactly when the
        bias-free run on the same spending would (1.24x its H (d + 2) unknowns at
        d = H = 8)."""
        need = SHORT_OVERSAMPLE * H * (self.d + 1)
        return need + bias_share_per_row(H) if self.biases else need

    def attempt_cost(self, H: int, least: bool = False) -> int:
        """Queries of one more design: a base scan, the perturbations and the main rounds
        (``least``: with :meth:`least_columns` per main row, the smallest design a retry
        sizes itself down to, :meth:`main_columns`)."""
        columns = self.least_columns() if least else None
        return _scan_size(H) + self.perturbation_cost(H) + self.main_cost(H, columns)

    def search_scans(self, H: int) -> int:
        """Base scans a new count search may make (:meth:`count_heads`): as many as
        the multi-head paper's count and the budget leave after a design of the least main rounds
        (:meth:`attempt_cost`, one scan included), SCALE_ROUNDS + BASE_CANDIDATES at
        most; 0 when none fits."""
        s0, least = _scan_size(H), self.attempt_cost(H, least=True)
        return next((k for k in range(SCALE_ROUNDS + BASE_CANDIDATES, 0, -1)
                     if self.affordable(least + (k - 1) * s0, H)), 0)

    def affordable(self, queries: int, H: int) -> bool:
        """Whether ``queries`` more and the held-out verification stay within the multi-head paper's
        count and the budget."""
        verify = verification_count(self.parameters(H))
        return (self.spent() + queries + verify <= self.count_cap(self.max_heads)
                and queries + verify <= _budget_left(self.oracle))

    def spent(self) -> int:
        """Queries this run's plan has cost so far. A journal's binding checks are not in
        it: they are counted apart (in the total and within the budget, see
        :func:`_budget_left`), so the plan, and every bit of the result, is the same with
        a journal, without one and on a resumed run (whose checks are more)."""
        return self.oracle.queries - self.q0

    def parameters(self, H: int) -> int:
        """Free parameters of H canonical heads: the floor H(d^2 + d), with biases
        H(d^2 + 2d) + 1 (b_h and c)."""
        d = self.d
        return H * (d * d + 2 * d) + 1 if self.biases else H * (d * d + d)

    def count_cap(self, H: int) -> int:
        """Queries this learner never exceeds: the multi-head paper's count, with biases
        :func:`biased_count` (c and H + 1 more samples per row)."""
        return biased_count(H, self.d) if self.biases else paper2_count(H, self.d)

    def count_name(self) -> str:
        """How reports name :meth:`count_cap`."""
        return "the biased count" if self.biases else "the multi-head paper's count"

    def main_cost(self, H: int, columns: int | None = None) -> int:
        """Queries of rounds 1 and 2: the main rows and their ``columns`` columns each
        (default d - 1 + EXTRA_COLUMNS)."""
        d = self.d
        columns = d - 1 + EXTRA_COLUMNS if columns is None else columns
        return d * (2 * H + 1) + d * columns * (H + column_spares(H))

    def least_columns(self) -> int:
        """Fewest round-2 columns per main row: d - 1, which with q_0 give the d columns
        that determine z_hk (with biases the affine z_hk has d + 1 entries: d)."""
        return min(self.d - 1 + EXTRA_COLUMNS, self.d - 1 + self.biases)

    def main_columns(self, H: int) -> int:
        """Round-2 columns per main row: d - 1 + EXTRA_COLUMNS when the main rounds with
        them and the verification fit in the multi-head paper's count and the budget, else
        :meth:`least_columns`. A first design always fits them (:meth:`base_scans` keeps
        their share); a retry after a failed design has spent a base row, a designed
        column and perturbations more, and fits the rest of the count instead (d = 8,
        H = 2, s = 3, seed 12: the extra columns took a retry to 526 of 509)."""
        full = self.d - 1 + EXTRA_COLUMNS
        return full if self.affordable(self.main_cost(H, full), H) else self.least_columns()

    def design_rest_cost(self, H: int) -> int:
        """Queries of a design after its designed column: the base perturbations and the
        main rounds, the latter as a retry sizes them (:meth:`least_columns`)."""
        columns = self.least_columns() if self.designs_failed else None
        return (self.perturbation_cost(H) - self.column_cost(H)) + self.main_cost(H, columns)

    def column_cost(self, H: int) -> int:
        """Queries of the designed column (:meth:`designed_column`, H >= 2): the nudged
        columns and one designed scan."""
        return (H + RANDOM_COLUMNS + 1) * column_samples(H) if H > 1 else 0

    def perturbation_cost(self, H: int) -> int:
        """Queries of the base estimate: the designed column and the base perturbations."""
        return self.column_cost(H) + (self.d - 1) * perturbation_samples(H)

    def wide_cost(self, H: int) -> int:
        """Queries of round 3 (wide columns)."""
        return self.d * self.d * (H + column_spares(H))
