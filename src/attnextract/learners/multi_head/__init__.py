"""Multi-head attention: canonical recovery from copy probes with a designed conditioning.

Model: f(X) = sum_h softmax(X W_h x_N)^T X v_h, h = 1..H (W_h (d, d), v_h (d,)).
Only the canonical heads are identifiable (:mod:`.canonical`: equal W merge, v_h = 0
drops, any order).

Identity (copy probes, :mod:`.design`). With m copies of a = q + u followed by N - m
copies of q, lambda = ln(m / (N - m)) and v = sum_h v_h (from d single tokens),

    g := f - v^T q = sum_h c_h sigma(t_h + lambda),  t_h = u^T W_h q,  c_h = u^T v_h.

Head h is a sigmoid step at lambda = -t_h of height c_h. t is bilinear in (u, q), c is
linear in u and does not depend on q.

Algorithm (one module per stage).

1. v from d single tokens.
2. Base row (:mod:`.base_row`): a random (u_0, q_0) scanned on a uniform lambda grid; a
   rational fit locates the steps; the fewest steps that fit to the output precision is
   the number of canonical heads (decided by agreement between rows when not told).
3. Designed column (:mod:`.base_row`): a crowded base row moves to the column that
   spaces its steps evenly; perturbations of u_0 give every head's W_h q_0 and v_h.
4. Main rows (:mod:`.main_rows`): d rows u_k placing each head's step at an evenly
   spaced position, fitted and labelled against the base estimate (:mod:`.labels`).
5. Round 2: d columns per row; 6. row fits: W_h = U^-1 Z_h, v_h = U^-1 C_h.
7. Round 3 (wide columns) when the predicted error bar exceeds 1e-10 and the count allows.
8. Short probes (:mod:`.short_probes`): the rest of the multi-head paper's count as two-token probes.
9. Joint polish (:mod:`.polish`, no query): Gauss-Newton on all canonical parameters.

The query budget of every stage and the retry of a failed design are in :mod:`.budget`;
the tuning constants, each with the measurement behind it, in :mod:`.constants`.

Conditioning. Each row fit's Jacobian and the pooled residual give the covariance of
(c, z), propagated through U^-1 to a predicted relative error of every W_h and v_h. The
learner refuses (:class:`RecoveryFailedError`) when that prediction exceeds
``max_error_bar`` or when a main row's fit does not reach the output precision (it
cannot tell a box outside the class from two steps that fell too close in one row),
reports a mismatch (:class:`ModelMismatchError`) when no base row fits at most H steps
or held-out verification fails, and otherwise states the prediction as the error bar
(on coarse answers, float32 or decimals, the larger of it and the joint polish's own
prediction when the polish is not kept: :meth:`.main_rows.MainRowStage.polished`).
What limits it: the steps' spacing in the lambda window (2 (ln N - 1.5) / H; the window
grows with H, N up to 32768 tokens) and the black box's own rounding, which grows with
the heights sum_h |c_h|.

Cost. The black box's work grows with the tokens it is sent, so every copy probe is only
as long as its lambda needs (:func:`.design.probe_lengths`: the window only near its
edges, down to window / 32 near lambda = 0); a round goes to the box in one batch per
length. Shorter sums also round less: the thresholds of the main rounds and the error
bar's floor use each probe's own length (the base stages' thresholds the window's, an
upper bound), the polish weights every answer by its own length. At d = 32, H = 12 this
sends a quarter of the tokens of window-long probes (157 against 604 million).

Queries: see :mod:`.budget` (never above the multi-head paper's count 4Hd^2 - 2H + 1; with biases
that + (H + 1) d + 1).
"""

from __future__ import annotations

import math
import re
import time
from typing import NoReturn

import numpy as np

from ...errors import (
    AttnExtractError,
    InputError,
    ModelMismatchError,
    RecoveryFailedError,
    RefusalWithResult,
)
from ...models import BiasedMultiHeadAttention, MultiHeadAttention
from ...oracle import QueryAccess, on_scaled_outputs
from ...report import (
    DEFAULT_VERIFY_TOLERANCE,
    ExtractionResult,
    Report,
    checked_result,
    token_scale,
    verification_count,
    verify_model,
)
from ...verification import max_length_of, safe_rms
from ..single_head import _model_error_bar, constant_and_values, measure_weights, probe_basis
from . import design, polish
from .base_row import BaseRowStage
from .budget import Budget, _Redesign, _scan_size, biased_count, paper2_count
from .canonical import (
    canonical_error,
    canonical_form,
    match_heads,
    non_identifiable_twin,
    non_identifiable_vector_twin,
    twin_difference,
)
from .constants import (
    BASE_CANDIDATES,
    COARSE_ROUNDING,
    COARSEST_SHARE,
    COUNT_FIRST,
    DEFAULT_TOLERANCE,
    DTYPE_PRECISION,
    MAX_DESIGNS,
    MAX_HEADS,
    NOISE_FACTOR,
    PRECISIONS,
    ROUNDED_BAR_OFFERED,
    ROUNDED_TOLERANCE,
    SCALE_ROUNDS,
    SINGLE_TOKEN_MISFIT,
)
from .main_rows import MainRowStage
from .short_probes import ShortProbeStage
from .state import MultiHeadModel
from .subspaces import extract_in_subspaces

__all__ = ["extract_multi_head", "canonical_form", "canonical_error", "match_heads",
           "non_identifiable_twin", "non_identifiable_vector_twin", "twin_difference",
           "output_precision", "paper2_count", "biased_count"]



def output_precision(values: np.ndarray) -> tuple[float, str]:
    """Relative precision the black box's outputs carry: float16, float32 or float64.

    Generic float64 numbers are almost never exactly representable in float32; if
    every nonzero output is, the black box rounds to float32 (likewise float16).
    """
    x = np.asarray(values, dtype=np.float64)
    x = x[x != 0]
    if x.size >= 2:
        if np.all(x.astype(np.float16).astype(np.float64) == x):
            return 2.0 ** -11, "float16"
        if np.all(x.astype(np.float32).astype(np.float64) == x):
            return 2.0 ** -24, "float32"
    return 2.0 ** -53, "float64"


def extract_multi_head(oracle: QueryAccess, heads=None, *, subspaces=None, seed=None,
                       max_error_bar: float | None = None,
                       verify_tolerance: float = DEFAULT_VERIFY_TOLERANCE,
                       precision: str = "full", output_dtype: str | None = None,
                       decimals: int | None = None, progress=None,
                       biases: bool = False) -> ExtractionResult:
    """Recover the canonical heads of a multi-head attention black box.

    Parameters
    ----------
    oracle : Oracle
        Door to the black box; ``oracle.dim`` is the token width d.
    heads : int, optional
        Upper bound H on the number of canonical heads (the model's head count is
        one); None: up to min(d, 12). The designed rows need H <= d: a larger H is
        refused (RecoveryFailedError: this learner's limit, the box is not judged).
    subspaces : list, optional
        Known pairwise orthogonal head subspaces (the single-head paper), each a basis (d, r_h) or a
        list of coordinate indices; then the single-head learner runs inside each.
    seed : int, optional
        Seed of the random design and of the held-out verification sequences.
    max_error_bar : float, optional
        Largest error bar (relative parameter error, ERROR_BAR_FACTOR times the
        predicted rms error) accepted; above it the learner refuses. Default 1e-6
        (DEFAULT_TOLERANCE), or ROUNDED_TOLERANCE = 1.6e5 times the output precision for
        rounded outputs (9.5e-3 for float32, at most 0.5).
    verify_tolerance : float
        Largest held-out relative output error accepted as a match (float64 outputs;
        rounded outputs add their precision).
    precision : {"full", "fast"}
        "full" (default): round 3 (wide columns) runs whenever the multi-head paper's count and the
        budget allow, for the smallest error. "fast": only when the predicted error
        bar would otherwise exceed 1e-10, so fewer queries at a larger error.
    output_dtype : {"float64", "float32", "bfloat16", "float16"}, optional
        The precision the black box computes in (its forward pass, not only its
        output); None: detected from the outputs (float64, or float32/float16 when
        every output is exactly representable there).
    decimals : int, optional
        The outputs are rounded to this many decimals (an absolute error of half a
        unit of the last one).
    progress : callable, optional
        Called with a short message at each stage.
    biases : bool
        The heads have query biases and the output a constant (a deployed layer):
        f = sum_h softmax(X (W_h x_N + b_h))^T X v_h + c. c = f([0]) is one more query;
        the row fits become affine in the column (t_h = u^T (W_h q + b_h)) and give
        b_h too (docs/algorithms.md, "Biases"). Not with ``subspaces``.

    Returns
    -------
    ExtractionResult
        ``model`` a :class:`MultiHeadAttention` with the canonical heads, W (H', d, d),
        v (H', d) (with ``biases`` a :class:`BiasedMultiHeadAttention`, also b (H', d)
        and c); ``report.details`` gives the queries against the multi-head paper's count and the
        floor, the smallest separation between heads, the predicted parameter error and
        the error bar next to the measured held-out error.

    Raises
    ------
    ModelMismatchError
        No base row fits at most H steps to the output precision, held-out
        verification failed, or (where the learner's fits failed) the box answers single
        tokens x other than x^T v, as no multi-head box does; ``.result`` holds the best
        effort when one was computed.
    RecoveryFailedError
        The fit's predicted error (conditioning times residual) exceeds
        ``max_error_bar``, or a main row's fit does not reach the output precision (the
        message then says a box outside the class may also end there); ``.result`` as
        above.
    BudgetExceededError
        The budget cannot cover the next round (raised before it is sent).
    """
    if not isinstance(biases, (bool, np.bool_)):
        raise InputError(f"biases must be True or False, got {biases!r}")
    if subspaces is not None and biases:
        raise InputError("biases=True does not apply with known subspaces (the single-head "
                         "learner inside each subspace is bias-free)")
    if subspaces is not None:
        return extract_in_subspaces(oracle, subspaces, seed, verify_tolerance)
    if heads is not None and (isinstance(heads, bool) or not isinstance(heads, (int, np.integer))
                              or heads < 1):
        raise InputError(f"heads must be a positive integer or None, got {heads!r}")
    if max_error_bar is not None and not (isinstance(max_error_bar, (int, float))
                                          and 0 < max_error_bar < 1):
        raise InputError(f"max_error_bar must lie in (0, 1), got {max_error_bar!r}")
    if precision not in PRECISIONS:
        raise InputError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    if output_dtype is not None and output_dtype not in DTYPE_PRECISION:
        raise InputError(f"output_dtype must be one of {tuple(DTYPE_PRECISION)} or None, "
                         f"got {output_dtype!r}")
    if decimals is not None and (isinstance(decimals, bool)
                                 or not isinstance(decimals, (int, np.integer)) or decimals < 0):
        raise InputError(f"decimals must be a non-negative integer or None, got {decimals!r}")
    def learn(view):
        with np.errstate(over="ignore", under="ignore", invalid="ignore", divide="ignore"):
            run = _Extraction(view, heads, seed, max_error_bar, verify_tolerance, progress)
            run.full_precision = precision == "full"
            run.output_dtype, run.decimals = output_dtype, decimals
            run.biases = bool(biases)
            return run.run()

    # on answers rescaled to order one (exactly, by a power of two; answers of 1e-150 gave
    # NaN in the fits, 1e300 inf): not with decimals, a rounding in the box's own units
    return learn(oracle) if decimals is not None else on_scaled_outputs(oracle, learn)


class _Extraction(BaseRowStage, MainRowStage, ShortProbeStage, Budget):
    """One run of the learner: the stages of the module docstring, in order."""

    def __init__(self, oracle, heads, seed, tolerance, verify_tolerance, progress):
        # heads None: the count is searched up to COUNT_FIRST heads (base window 2048)
        # first, up to min(d, MAX_HEADS) only when no row fits that few steps
        self.heads_told = heads is not None
        self.oracle, self.d = oracle, oracle.dim
        self.max_heads = int(heads) if heads is not None else min(oracle.dim, COUNT_FIRST)
        self.rng = np.random.default_rng(seed)
        self.seed, self.tolerance, self.verify_tolerance = seed, tolerance, verify_tolerance
        self.tolerance_given = tolerance is not None         # max_error_bar= (set_precision)
        self.say = progress or (lambda message: None)
        self.start, self.q0, self.bb0 = time.perf_counter(), oracle.queries, oracle.black_box_seconds
        self.breakdown: dict[str, int] = {}
        self.details: dict = {}
        self.notes: list[str] = []
        self.biases, self.c = False, 0.0      # biases: set by extract_multi_head, c = f([0])
        self.labels_trusted, self.label_misfit = False, math.inf   # set by main's relabel
        self.coarse = False                   # set by set_precision
        self.coarse_extra_scans = 0
        self.count_ended_early = False        # not told, coarse: the count search ended
                                              # at agreeing pinned rows (pinned_enough)
        self.count_level = self.max_heads    # steps a base scan decides first (count_heads)
        self.scans_made = 0                  # base scans of the count search (base_row)
        self.designs_failed = 0              # failed designs so far (attempts)
        self.spare_rows = []                 # candidate base rows not used yet (base_row)
        self.column_gain = None              # |W_h^T u| / |u| measured (designed_column)
        self.set_window(design.base_length(self.max_heads))   # the base stages; main() switches
        needed = max(self.length, design.window_length(self.max_heads))
        limit = max_length_of(oracle)
        if limit is not None and limit < needed:
            raise InputError(f"the multi-head learner (up to {self.max_heads} heads) probes with "
                             f"sequences of {needed} tokens, longer than max_length {limit}; "
                             f"nothing was sent")

    # -- bookkeeping ---------------------------------------------------------
    def spend(self, stage: str, before: int) -> None:
        self.breakdown[stage] = self.breakdown.get(stage, 0) + self.oracle.queries - before

    def measure(self, u, q, lam, length: int | None = None):
        """g at the nearest realisable lambdas of sequences of ``length`` tokens (default
        each probe as long as its lambda needs within the current window,
        :meth:`lengths`); returns (realised lambda, g).

        A design built from answers no multi-head box gives can be non-finite: that is
        a mismatch, refused before anything is sent."""
        if not (np.all(np.isfinite(u)) and np.all(np.isfinite(q)) and np.all(np.isfinite(lam))):
            raise _Redesign(RecoveryFailedError, "a fit gave a non-finite probe design")
        lengths = self.lengths(lam) if length is None else np.full(np.shape(lam), length)
        m = design.copy_counts(lam, lengths)
        lam = design.realised_lambda(m, lengths)
        g = design.measure(self.oracle, self.v, u, q, m, lengths) - self.c
        self.answers.append((u, q, lam, g + q @ self.v, lengths))   # for the polish
        return lam, g

    def lengths(self, lam) -> np.ndarray:
        """Tokens of the copy probes :meth:`measure` sends for the designed lambdas
        ``lam`` (any shape) in the current window (:func:`.design.probe_lengths`)."""
        return design.probe_lengths(lam, self.length)

    def noise(self, f_values, heights=0.0, *, floor: bool = False, lengths=None) -> float:
        """Absolute output noise expected from the precision, for outputs like ``f_values``
        of probes of ``lengths`` tokens (default the window's, the longest a copy probe
        has: an upper bound).

        A black box computing in precision p rounds its own softmax sums: the terms are
        as large as the heights |c_h| = |u^T v_h| (which cancel in g), summed over N
        tokens, so its rounding grows with sum_h |c_h| and log2 N (rms over the probes'
        own lengths). This holds for a
        float32 forward pass (PyTorch's default) as for float64; outputs rounded once
        to float32 after a float64 pass err less, and are judged the same (their
        error bars are the looser for it). Outputs rounded to K decimals add half a
        unit of the last decimal.

        ``floor``: the least noise the error bar assumes (a smaller measured residual
        is luck): the forward pass's rounding in float64, one rounding of the output
        otherwise (a float32 forward pass shows its larger errors in the residual).
        """
        # the box rounds its whole output, c included (g and v^T q have c taken off)
        f_values = np.asarray(f_values) + self.c
        rms = safe_rms(f_values)
        if floor and self.precision_name != "float64":
            return 0.6 * self.precision * max(rms, 1e-300) + 0.3 * self.absolute_noise
        # the thresholds use the float64 law (8 + log2 N roundings) at the box's own
        # precision, stated or detected: a coarse forward pass errs more on long sums
        # (0.35 N^0.83 roundings, the polish's weights), but thresholds NOISE_FACTOR = 30
        # times that law let a fit with a step too few pass (float32
        # nn.MultiheadAttention, d = 16, H = 4: 11 of 13 within the bar with it, 15 of 16
        # with detection's law; H = 2: 20 of 20 with detection's law)
        factor = safe_rms(polish.length_factor(
            np.asarray(self.length if lengths is None else lengths, dtype=np.float64), 0.0))
        relative = factor * self.precision * max(rms + heights, 1e-300)
        return relative + self.absolute_noise

    def set_precision(self) -> None:
        """The black box's precision: told (output_dtype, decimals) or detected from
        the d single-token outputs; the default error-bar tolerance follows it."""
        if self.output_dtype is not None:
            self.precision_name = self.output_dtype
            self.precision = DTYPE_PRECISION[self.output_dtype]
        else:
            # the answers as the box gave them (with biases v has c taken off)
            self.precision, self.precision_name = output_precision(
                np.append(self.v + self.c, self.c) if self.biases else self.v)
            if self.precision_name != "float64":
                self.notes.append(f"outputs detected as rounded to {self.precision_name} "
                                  f"(relative {self.precision:.1e}); error bars allow for "
                                  f"a forward pass in that precision")
        self.absolute_noise = 0.0 if self.decimals is None else 0.5 * 10.0 ** -self.decimals
        scale = max(safe_rms(self.v), 1e-300)
        self.relative_rounding = self.precision + self.absolute_noise / scale
        self.coarse = self.relative_rounding >= COARSE_ROUNDING
        if self.decimals is not None:
            self.notes.append(f"outputs rounded to {self.decimals} decimals (absolute "
                              f"{self.absolute_noise:.1e})")
        if self.tolerance is None:
            self.tolerance = min(0.5, max(DEFAULT_TOLERANCE, ROUNDED_TOLERANCE * self.relative_rounding))
        # a step is told from the rounding when NOISE_FACTOR times the rounding of a base
        # scan stays well below the answers: a bfloat16 (2^-8) or float16 (2^-11) pass
        # puts that at 2.2 and 0.28 of them, so every row looked flat (bfloat16: a
        # model with no heads, refused as a held-out mismatch that blamed the box)
        share = (NOISE_FACTOR * polish.length_factor(design.base_length(self.max_heads), 0.0)
                 * self.precision)
        # (stated only: answers that all happen to be float16 numbers, such as a constant
        # box's 0.5, are detected as float16 and still run)
        if self.output_dtype is not None and share > COARSEST_SHARE:
            self.refuse(f"answers in {self.precision_name} (relative rounding "
                        f"{self.precision:.1e}, stated) are too coarse for this learner: it "
                        f"tells a sigmoid step from the rounding when {NOISE_FACTOR:.0f} times "
                        f"the rounding of a base scan stays below {COARSEST_SHARE:g} of the "
                        f"answers, and here it is {share:.2f} of them; answers in float32 or "
                        f"finer are needed", RecoveryFailedError)

    # -- stages --------------------------------------------------------------
    def run(self) -> ExtractionResult:
        d, H = self.d, self.max_heads
        if H > d:
            self.refuse(f"{H} heads asked at d = {d}: this learner places every head's "
                        f"step at its own designed position in rows of d coordinates, so it "
                        f"recovers at most d = {d} canonical heads. The black box was not "
                        f"queried and is not judged (it may well be multi-head attention "
                        f"with {H} heads); if it has at most {d} canonical heads (heads with "
                        f"equal W merge, heads with v = 0 drop), run with heads <= {d}",
                        RecoveryFailedError)
        s0, rest = _scan_size(H), self.rest_cost(H)
        self.scans_left = self.base_scans(H, short_share=False)
        # not told H, the plan is sized for the most heads the search may count; the
        # budget need only hold the smallest design of the fewest (one head): every later
        # stage checks what it spends against the budget (Budget.affordable)
        least = H if self.heads_told else 1
        self.oracle.plan(rest + self.scans_left * s0, "multi-head extraction",
                         need=min(rest + self.scans_left * s0, self.least_run(least)))
        before = self.oracle.queries
        self.c, self.v = constant_and_values(self.oracle, self.biases)
        self.spend("v tokens" + (" and c = f([0])" if self.biases else ""), before)
        self.answers = [(np.zeros((d, d)), np.eye(d), np.zeros(d), self.v, 1)]  # the polish's
        self.set_precision()
        if self.identities_fit():
            return self.one_head_identities()
        if self.heads_told:
            self.scans_left = self.base_scans(H, self.short_share())
        # coarse answers, told H: a candidate row costs up to two scans (its own scale),
        # so up to as many scans again, within what the multi-head paper's count leaves, spent only
        # while no pinned row shows H steps (spent always, they cut the wide columns:
        # median bar 3.3e-3 against 9.3e-4, float32 nn.MultiheadAttention, H = 4)
        self.coarse_extra_scans = (max(0, min(SCALE_ROUNDS + BASE_CANDIDATES,
                                              (self.count_cap(H) - rest) // s0
                                              - self.scans_left))
                                   if self.coarse and self.heads_told else 0)
        self.say("base row")
        try:
            heads = self.count_heads()
        except np.linalg.LinAlgError as error:            # a fit on non-finite samples
            exc = _Redesign(RecoveryFailedError, f"a base row's fit failed numerically ({error})")
            self.give_up(exc, [exc.message])
        if heads == 0:
            return self.finish(self.no_heads(), None)
        if not self.heads_told and heads == 1 and self.identities_fit(counted=True):
            return self.one_head_identities()
        return self.attempts(heads)

    def identities_fit(self, counted: bool = False) -> bool:
        """Whether a one-head run takes the single-head identities (the single-head paper, d^2 + d
        queries) instead of the designed rows: float64 answers, no biases, v != 0, and
        the design above the multi-head paper's count. Told H = 1 (before any base scan): the smallest
        design exceeds the count where the floor plus the verification fit it (d = 6: 185
        against 143, floor 42 + 64; from d = 8 the design fits). ``counted`` (not told,
        the search found one head): the design from here (base estimate, main rounds,
        verification) would exceed the count (d = 7: 7 + 48 + 158 + 64 = 277 of 195)."""
        H = self.max_heads
        if not (H == 1 and not self.biases and np.any(self.v)
                and self.precision_name == "float64" and self.decimals is None):
            return False
        verify = verification_count(self.parameters(H))
        if counted:
            return (self.spent() + self.perturbation_cost(H) + self.main_cost(H) + verify
                    > self.count_cap(H))
        return (self.heads_told and self.parameters(H) + verify
                <= self.count_cap(H) < self.smallest_design(H))

    def one_head_identities(self) -> ExtractionResult:
        """One head by the single-head identities: with v known, the d^2 two-token probes
        [q + u; q] give u^T W q = logit((f - v^T q) / v^T u) (:func:`.single_head.
        measure_weights`; its float64 rounding bars are the error bar)."""
        before = self.oracle.queries
        self.say("W from two-token probes")
        W, _, bars, _ = measure_weights(self.oracle, probe_basis(self.v), self.v)
        self.spend("two-token probes", before)
        bar = _model_error_bar(bars)
        self.method = "single-head identities (d^2 two-token probes, the single-head paper)"
        self.details.update({"predicted relative error": bar, "error bar": bar})
        return self.finish(MultiHeadAttention(W[None], self.v[None]), bar)

    def count_heads(self) -> int:
        """The base row and the number of canonical heads (:meth:`search_count`). A
        search that fails for the learner's own reasons (every row flat at the scale
        it chose after steps were seen, a non-finite design) is followed by a new one
        (new rows, new scale rounds; v and the answers kept) while the multi-head paper's count and
        the budget leave three base scans and the rest of a design
        (:meth:`Budget.search_scans`), else refused (:meth:`give_up`)."""
        failures: list[str] = []
        while True:
            try:
                return self.search_count()
            except _Redesign as exc:
                failures.append(exc.message)
                self.details["count searches failed"] = list(failures)
                scans = self.search_scans(self.max_heads)
                if len(failures) >= MAX_DESIGNS or scans < 3:
                    self.give_up(exc, failures)
                self.scans_left = scans

    def search_count(self) -> int:
        """The base row and the number of canonical heads (:meth:`base_row`). Told H:
        at most H. Not told: at most COUNT_FIRST, then min(d, MAX_HEADS) when no row
        fits that few steps; afterwards the run plans for the count found (its paper-2
        count, its base scans), as a run told that count would.

        Not told, a row's scan grows with the count it needs (:meth:`base_row`): counts
        up to k are read from 4 (k + COUNT_MARGIN) + 8 samples, where a run told k
        scans 4k + 8, so a box of few heads is counted at about a told run's cost
        (scans sized for COUNT_FIRST heads made a 1-head box at d = 8 cost 1.28x the
        queries of a told run; now 1.04x)."""
        self.count_level = self.max_heads if self.heads_told else 1
        if self.heads_told:
            return self.base_row()
        try:
            heads = self.base_row()
        except ModelMismatchError:
            if self.max_heads >= min(self.d, MAX_HEADS):
                raise
            self.count_level = self.max_heads + 1   # fewer steps fit no row (or refused)
            self.max_heads = min(self.d, MAX_HEADS)
            self.set_window(design.base_length(self.max_heads))
            self.scans_left = 3     # the long window is slow to query: a few rows decide
            heads = self.base_row()
        if heads:
            self.max_heads = heads
            # later base scans (a recentred or fresh row) as a run told the count scans
            self.base_grid = design.base_lambdas(_scan_size(heads), self.half_window)
        return heads

    def attempts(self, heads: int) -> ExtractionResult:
        """Designs until one gives a verified model: a fit that fails, an error bar too
        large, or a held-out mismatch with a small bar draws a fresh design (base row,
        perturbations, main rows) and measures again while the multi-head paper's count and the
        budget allow. The head count, v and the base rows scanned are kept
        (:meth:`fresh_base_row`), and a retry fits the rest of the count: it is tried when
        its least design (:meth:`attempt_cost` with ``least``, d - 1 main columns per
        row) fits, and its main rounds take the columns the count leaves
        (:meth:`main_columns`). Not told H, a failure that says the count may be low
        reopens it when a scan shows more steps (:meth:`.base_row.BaseRowStage.
        reopen_count`): the next design starts from that scan's row under the higher
        count's multi-head paper's count. Every attempt's failure is reported. Without room for
        another attempt the last failure is raised."""
        failures: list[str] = []
        reopened = False
        while True:
            self.say("base perturbations" if not failures else
                     f"new design (attempt {len(failures) + 1})")
            try:
                try:
                    if failures and not reopened:
                        heads = self.fresh_base_row(heads)
                        self.details["canonical heads"] = heads
                    Y0, V0 = self.base_estimate()
                    self.say("main probes")
                    return self.main(Y0, V0)
                except np.linalg.LinAlgError as error:   # a fit on non-finite samples
                    raise _Redesign(RecoveryFailedError,
                                    f"a fit failed numerically ({error})") from None
            except _Redesign as exc:
                failures.append(exc.message)
                self.designs_failed = len(failures)
                self.details["designs tried"] = len(failures)
                self.details["failed designs"] = list(failures)
                # not told H: a failure that says the count may be low reopens it when a
                # measurement shows more steps (:meth:`.base_row.BaseRowStage.reopen_count`)
                more = self.reopen_count(heads, exc) if len(failures) < MAX_DESIGNS else 0
                reopened = bool(more)
                if more:
                    heads = more
                    self.details["designs tried"] = len(failures) + 1
                    continue
                # a retry sizes its main rounds to what the count leaves (least columns)
                if (len(failures) >= MAX_DESIGNS
                        or not self.affordable(self.attempt_cost(heads, least=True), heads)):
                    self.give_up(exc, failures)
                self.details["designs tried"] = len(failures) + 1

    def give_up(self, exc: "_Redesign", failures: list[str]):
        """The last refusal: no room for another design. The learner's own fits failed
        (``exc.kind`` RecoveryFailedError) or the box answered held-out sequences
        unlike every model measured (ModelMismatchError)."""
        d = self.d
        outside = None
        if exc.kind is RecoveryFailedError:
            # the learner's own fits failed: single tokens, which every multi-head box
            # answers linearly, tell a box outside the class from the learner's failure
            # (before a refused model's held-out check, whose queries it leaves room for)
            heads = exc.result is None and exc.model is not None and exc.model.heads
            outside = self.single_token_misfit(
                verification_count(self.parameters(self.max_heads)) if heads else 0)
        model = exc.model if exc.model is not None else self.no_heads()
        if exc.result is not None:           # verified already: its report is kept,
            self.result = exc.result         # counted, as every refusal, for the H asked
            H, details = self.max_heads, exc.result.report.details
            details.pop("heads", None)
            details["heads asked" if self.heads_told else "heads searched up to"] = H
            details["multi-head paper's count"] = paper2_count(H, d)
            floor_key = "floor H(d^2 + 2d) + 1" if self.biases else "floor H(d^2 + d)"
            details[floor_key] = exc.result.report.floor = self.parameters(H)
            details["recovery / floor"] = details["recovery queries"] / self.parameters(H)
        else:
            self.finish(model, exc.bar, check=False)
        H = self.max_heads
        room = (f"no design left to try (H = {H}: {self.count_name()} {self.count_cap(H)}, "
                f"the floor {self.parameters(H)})" if len(failures) >= MAX_DESIGNS else
                f"{self.count_name()} {self.count_cap(H)} for H = {H} (the floor "
                f"{self.parameters(H)}) and the budget leave no room for another design")
        reopened = self.details.get("head count reopened")
        if not self.heads_told and reopened:
            room += (f"; the head count {self.max_heads} was found by the learner (base rows "
                     f"agreed on {reopened[0][0]}, a scan after a failed design showed "
                     f"{self.max_heads} steps): if the box's head count is known, give "
                     f"heads= (--heads)")
        elif not self.heads_told:
            room += (f"; the head count {self.max_heads} was found by the learner (base rows "
                     f"agreed on it): if the box's head count is known, give heads= (--heads)")
        shown = self.details.get("steps shown after a failed design", 0)
        if not self.heads_told and shown > self.max_heads:
            room += (f"; a scan after the failed design showed {shown} steps, but after the "
                     f"{self.spent()} queries spent {self.count_name()} for H = {shown} "
                     f"({self.count_cap(shown)}) leaves no room for a design of {shown} heads "
                     f"(the count {self.max_heads} is likely low: heads={shown} plans for it)")
        # a failed base-row search before the designs is listed with them
        failures = [f for f in self.details.get("count searches failed", [])
                    if f not in failures] + failures
        if len(failures) == 1:
            message = f"{failures[0]}; {room}"
        else:
            listed = "; ".join(f"({i + 1}) {f}" for i, f in enumerate(failures))
            message = f"{len(failures)} designs failed: {listed}; {room}"
        if outside is not None:
            # the fits' failures are listed as what they were measured against, without
            # the clause that left the box unjudged
            stopped = "; ".join(re.sub(r"(: | \()?the black box (is|was) not judged\)?", "", f)
                                for f in failures)
            error = ModelMismatchError(f"{outside}; the learner's fits had failed on its "
                                       f"answers: {stopped}", result=self.result)
            error.biases_ruled_out = True    # a query bias keeps single tokens linear
            raise error
        limit = self.rounding_limit(exc)
        undecided = exc.kind is RecoveryFailedError and not exc.fitted and not limit
        if undecided:
            # no test of this run tells the box from the learner's failure: both are said
            limit = self.outside_note()
        error = exc.kind(message + limit, result=self.result)
        error.box_may_be_outside = undecided     # the registry's biases hint reads it
        raise error

    def single_token_misfit(self, reserved: int = 0) -> str | None:
        """A box outside the class, told by single tokens (None: consistent, or not
        asked): multi-head attention answers one token x with x^T v (+ c) exactly, its
        softmax over one token being 1, whatever its heads (v = sum_h v_h, measured from
        the d tokens e_i at the start). Tokens x and 3x of two random unit directions go
        in one batch (4 queries, asked only when a refusal is due and, told H, the multi-head paper's
        count leaves room for them and the ``reserved`` queries still to come); ReLU or sigmoid
        attention answers them act(x^T W_h x) x^T v_h, not linear in x.

        The rounding of an in-class answer grows with sum_h |v_h|, which v hides when the
        heads' values cancel; the copy probes bound it from below (|f| <= sum_h |v_h| times
        the largest token norm). The misfit |f(x) - x^T v| / |x| is taken relative to
        the larger of |v| and that bound over the probes whose tokens are no longer than
        3 (as the check's: a box whose answers grow faster than its tokens, ReLU
        attention, inflates the bound on long ones) and must exceed SINGLE_TOKEN_MISFIT
        (plus K decimals' rounding), and relative to the bound over every probe it must
        exceed 1e4 roundings: both, or the box is not judged by this check. Measured
        (benchmarks/results/check_verdict_separation.md): in-class boxes at most 1.3e-7 (float32
        nn.MultiheadAttention), out-of-class ReLU and sigmoid attention at least 1.6e-1."""
        d = self.d
        if self.heads_told and self.spent() + 4 + reserved > self.count_cap(self.max_heads):
            return None                      # the count is spent: not asked, not decided
                                             # (not told, a search may pass it already)
        rng = np.random.default_rng([0 if self.seed is None else int(self.seed), 22])
        x = rng.standard_normal((2, d))
        x /= np.linalg.norm(x, axis=1, keepdims=True)
        x = np.concatenate([x, 3.0 * x])
        before = self.oracle.queries
        try:
            f = np.asarray(self.oracle.query(x[:, None, :]), dtype=np.float64) - self.c
        except AttnExtractError:             # budget, a failing box: not decided
            return None
        finally:
            self.spend("single-token check", before)
        short = every = float(np.linalg.norm(self.v))
        for u, q, _, answers, _ in self.answers:
            tokens = np.maximum(np.linalg.norm(np.atleast_2d(q + u), axis=-1),
                                np.linalg.norm(np.atleast_2d(q), axis=-1))
            # (answers less c, as measure keeps them)
            per_norm = np.abs(np.atleast_1d(answers)) / np.maximum(tokens, 1e-300)
            kept = np.isfinite(per_norm) & (tokens > 0)
            if np.any(kept):
                every = max(every, float(np.max(per_norm[kept])))
            if np.any(kept & (tokens <= 3.0)):
                short = max(short, float(np.max(per_norm[kept & (tokens <= 3.0)])))
        if not (short > 0 and np.all(np.isfinite(f))):
            return None
        expected = x @ self.v
        norms = np.linalg.norm(x, axis=1)
        misfit = np.abs(f - expected) / (norms * short)
        allowed = (max(SINGLE_TOKEN_MISFIT, 30 * d * self.precision)
                   + 10 * self.absolute_noise * (1 + np.abs(x).sum(1)) / (norms * short))
        beyond = (misfit > allowed) & (np.abs(f - expected) / (norms * every)
                                       > 1e4 * self.relative_rounding)
        worst = int(np.argmax(misfit / allowed))
        self.details["single-token misfit"] = float(misfit[worst])
        if not beyond[worst]:
            return None
        return (f"the black box is not multi-head attention: multi-head attention answers "
                f"one token x with x^T v{' + c' if self.biases else ''} (softmax over one "
                f"token is 1; v from the d tokens e_i), and this box's answers to single "
                f"tokens miss it by {misfit[worst]:.1e} of |x| times its answers' scale "
                f"(allowed {allowed[worst]:.1e} at its {self.precision_name} rounding): "
                f"f(x) = {f[worst]:.6g} where x^T v = {expected[worst]:.6g}, at |x| = "
                f"{norms[worst]:g} (its attention weights are not a softmax, or it adds a "
                f"term that is not linear in a single token)")

    def rounding_limit(self, exc: "_Redesign") -> str:
        """For a refusal on rounded answers (float32, decimals) that the rounding
        explains, the limit this run measured and what lets a box through ("" else).

        - Told H, most base rows showed fewer steps than H: on coarse answers close
          steps merge and small ones sink below the rounding, so the base stage cannot
          locate every head (float32 ``nn.MultiheadAttention`` with head dimension 1 or
          2 at H = 8: 4 to 7 of 8 steps per row at d = 8 and 16, every trial refused).
          No option of this learner helps; a float64 forward pass resolves them (d = 16,
          H = 8: 4 of 4 trials within their bars).
        - The last design's error bar was finite but above the bar accepted: the count's
          samples pin the heads only that well at this rounding (float32
          ``nn.MultiheadAttention``, d = 8, H = 4: bars 1.5e-2 and 2.6e-2 against 9.5e-3);
          ``max_error_bar`` above it returns that model, its bar stated (offered for
          bars up to ROUNDED_BAR_OFFERED).
        - Not told H, the base rows' counts differ (coarse answers only hide steps), or
          the search ended at a few rows that agree (:meth:`.base_row.BaseRowStage.
          pinned_enough`): the count read from them may be low for the same reason.
        Each names ``--output-dtype`` as changing nothing (the learner already allows for
        a forward pass in the detected dtype), which keeps the registry's precision
        hint, meant for undetected rounding, off the message."""
        if self.precision_name == "float64" and self.decimals is None:
            return ""
        how = "stated" if (self.output_dtype is not None or self.decimals is not None) \
            else "detected"
        name = (self.precision_name if self.decimals is None
                else f"{self.decimals} decimals")
        counts = [c for c in self.details.get("head counts of the base rows", [])
                  if c is not None]
        H = self.max_heads
        below = [c for c in counts if c < H]
        if self.coarse and self.heads_told and counts and 2 * len(below) > len(counts):
            half = math.log(design.base_length(H) - 1)
            return (f"; this learner's limit at this rounding ({name}, {how}): {len(below)} "
                    f"of {len(counts)} base rows showed fewer steps than the {H} heads asked "
                    f"(counts {sorted(counts)}): on answers this coarse, steps that lie close "
                    f"together in the base window +-{half:.1f} merge and heads with little "
                    f"height in a row sink below the rounding, so the learner cannot "
                    f"locate every head (the black box is not judged); no option of this "
                    f"learner lets it through (stating --output-dtype changes nothing, a "
                    f"larger max_error_bar does not help); answers from a float64 forward "
                    f"pass resolve them (a torch module served in float64: "
                    f"TorchAttentionBlackBox's default dtype=\"float64\", or module.double())")
        bar = exc.bar
        # (a bar of 5e-2 lets the held-out check allow half the answers' size: larger
        # bars are not offered, a model missing a head could pass with them)
        if (exc.kind is RecoveryFailedError and bar is not None and math.isfinite(bar)
                and self.tolerance < bar <= ROUNDED_BAR_OFFERED):
            suggest = float(f"{2.0 * bar:.0e}")         # one digit, rounded from 2x the bar
            default = "" if self.tolerance_given else f", the default for {name} answers"
            return (f"; at this rounding ({name}, {how}) the samples the query count "
                    f"4Hd^2 - 2H + 1 allows pin these heads to an error bar of {bar:.1e} "
                    f"(the measured residual through the fits' conditioning), above the "
                    f"largest accepted "
                    f"{self.tolerance:.1e}{default}; to accept a model with a bar that size, "
                    f"pass max_error_bar={suggest:g} (--max-error-bar {suggest:g}): the "
                    f"held-out check allows for it (stating --output-dtype changes nothing)")
        if self.coarse and not self.heads_told and counts and (
                max(counts) > min(counts) or self.count_ended_early):
            return (f"; on answers this coarse ({name}, {how}) base rows hide heads whose "
                    f"steps crowd or whose heights sink below the rounding (the rows showed "
                    f"{sorted(counts)} steps), so the count {H} may be low and this learner "
                    f"may not locate every head (its limit at this rounding, the black box "
                    f"is not judged; stating --output-dtype changes nothing); answers from a "
                    f"float64 forward pass avoid it")
        return ""

    def no_heads(self):
        """The model with no canonical heads (f = c)."""
        d = self.d
        if self.biases:
            return BiasedMultiHeadAttention(np.zeros((0, d, d)), np.zeros((0, d)),
                                            np.zeros((0, d)), self.c)
        return MultiHeadAttention(np.zeros((0, d, d)), np.zeros((0, d)))

    def affine(self, columns: np.ndarray) -> np.ndarray:
        """The row fits' columns: q_j (J, d), with biases [q_j, 1] (J, d + 1), since
        t_h = u^T (W_h q + b_h) = [W_h^T u; u^T b_h]^T [q; 1]."""
        if not self.biases:
            return columns
        return np.hstack([columns, np.ones((columns.shape[0], 1))])

    def refuse(self, message: str, kind: type[RefusalWithResult] = ModelMismatchError,
               judge: bool = False) -> NoReturn:
        """Raise ``kind`` (the box is not in the class, or RecoveryFailedError: the
        learner cannot do it) with the run's report and no heads. ``judge`` (a
        RecoveryFailedError after fits that missed the answers): single tokens decide
        whether the box is outside the class (:meth:`single_token_misfit`), else the
        message says it may be."""
        if not hasattr(self, "precision"):
            self.precision, self.precision_name = 2.0 ** -53, "float64"
            self.relative_rounding, self.absolute_noise = self.precision, 0.0
        outside = self.single_token_misfit() if judge else None
        self.finish(self.no_heads(), None, check=False)
        if outside is not None:
            error: RefusalWithResult = ModelMismatchError(
                f"{outside}; the learner's fits had failed on its "
                f"answers: {message}", result=self.result)
            error.biases_ruled_out = True    # a query bias keeps single tokens linear
            raise error
        if judge:
            message += self.outside_note()
        error = kind(message, result=self.result)
        error.box_may_be_outside = judge     # the registry's biases hint reads it
        raise error

    def outside_note(self) -> str:
        """What a refusal that single tokens did not decide says about the box."""
        checked = ("its answers to single tokens are linear in the token, as multi-head "
                   "attention's are, which does not settle it" if
                   self.details.get("single-token misfit") is not None else
                   "its single tokens were not asked (the query count 4Hd^2 - 2H + 1 was spent)")
        return (f"; a black box outside the class (not softmax attention, or with a "
                f"residual, bias or other term) may also end here: {checked}")

    def finish(self, model: MultiHeadModel, bar: float | None,
               check: bool = True) -> ExtractionResult:
        """Verify ``model`` on held-out sequences and build the result and its report.

        A returned model is counted for its canonical heads; a refusal (``check``
        False) for the H asked (or searched), so that its floor and multi-head paper's count are
        those of the run. A refusal with no model spends no verification queries."""
        d = self.d
        refused = not check
        H = self.max_heads if refused or not model.heads else model.heads
        n_verify = verification_count(self.parameters(H))
        recovery = self.oracle.queries - self.q0
        tol, answer_noise = self.verify_tolerance, 0.0
        if self.precision_name != "float64" or self.decimals is not None:
            tol = max(tol, 30 * self.relative_rounding + 10 * (bar or 0.0))
            # a one-head model's hull check holds to the box's own rounding: a float32
            # forward pass left its interval by 2.7e-8 against the float64 1e-8 (H = 1,
            # d = 8, a model within its bar refused as "a second head")
            answer_noise = self.relative_rounding
        verification = None
        if model.heads or not refused:
            scale = token_scale(model) if model.heads else 1.0
            verification = verify_model(self.oracle, model, count=n_verify, seed=self.seed,
                                        tolerance=tol, scale=scale, answer_noise=answer_noise,
                                        absolute_noise=self.absolute_noise,
                                        # a refused model's bar is not trusted: with a
                                        # bar of 744 the check scales the error it reports
                                        # (a model wrong by 36 showed 2.7e-12)
                                        expected_error=bar if model.heads and not refused
                                        else None)
        floor = self.parameters(H)
        count = self.count_cap(H)
        total = self.oracle.queries - self.q0
        spent = self.spent()
        self.details.update({
            "method": getattr(self, "method", "copy probes at designed step positions, "
                                                "row-wise joint fits"),
            ("heads asked" if self.heads_told else "heads searched up to") if refused
            else "heads": self.max_heads if refused else model.heads,
            "recovery queries": recovery,
            "multi-head paper's count": paper2_count(H, d),
            **({"count with biases": count} if self.biases else {}),
            ("floor H(d^2 + 2d) + 1" if self.biases else "floor H(d^2 + d)"): floor,
            "recovery / floor": recovery / floor,
            "output precision": self.precision_name,
        })
        if verification is not None:
            self.details["held-out error"] = verification.max_relative_error
        if spent > count and not any(self.count_name() in n for n in self.notes):
            smallest = self.smallest_design(H)
            why = (f"the count is below the floor plus the verification ({floor} + "
                   f"{n_verify}) at d = {d}" if count < floor + n_verify else
                   f"the smallest design this learner runs needs {smallest} at d = {d}"
                   if smallest > count and not hasattr(self, "method") else
                   "the head count search (give heads= to plan for H)" if not self.heads_told
                   else "the redesigns")
            self.notes.append(f"{spent} queries (verification included), "
                              f"above {self.count_name()} {count} for H = {H}, d = {d}: {why}")
        report = Report(kind=model.kind, dim=d, queries=total,
                        breakdown={**self.breakdown, "recovery": recovery,
                                   "verification": n_verify if verification is not None else 0},
                        floor=floor, verification=verification,
                        seconds=time.perf_counter() - self.start,
                        black_box_seconds=self.oracle.black_box_seconds - self.bb0,
                        notes=self.notes, details=self.details)
        self.result = ExtractionResult(model=model, queries=report.queries, report=report)
        if not check:
            return self.result
        return checked_result(model, report, f"multi-head attention with at most "
                                             f"{self.max_heads} canonical head(s)")
