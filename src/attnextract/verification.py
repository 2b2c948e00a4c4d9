"""Held-out verification over the domain the model will be used on.

A recovered model is accepted only after the black box has answered sequences the
learner never chose. Random short Gaussian sequences at the probes' scale are the
easy part: a black box that differs from the model class only on long sequences,
on large or tiny tokens, on sparse tokens, where every score is far from zero or
where attention is near one-hot passes them. The held-out set therefore mixes these
families (fractions of the ``count`` sequences, every family at least one sequence),
each built by one small function (``_family_<name>``):

``ordinary``   Gaussian tokens, lengths 1..16, at the model's scale and at d^-1/4;
``long``       lengths spread evenly in log over 2..L, L the domain's longest length
               (below), both ends always: truncated contexts, sliding windows, ALiBi,
               temperatures or offsets that depend on the length;
``repeated``   long sequences built from one to three distinct tokens: position
               and count effects (a window or a sink shows at full strength);
``norms``      every sequence scaled by 10^U(-3, 3), the top end always (half with
               tokens of mixed norms inside one sequence): biases show at small
               norms, norm triggers, clipping and saturation at large ones;
``sparse``     one-hot and two-hot tokens, and Gaussian tokens sharing one constant
               coordinate (a bias-like direction);
``peaked``     tokens scaled so that the model's own scores span about 30: attention
               near one-hot, where the softmax's tails are tested;
``far``        every score of a head far below zero (-10 .. -1000) or far above,
               while the scores stay within a few units of each other: an attention
               sink (an extra logit the tokens' scores must beat), score clipping or
               a saturating score map show there, nowhere else;
``hull``       (single-head models) the second layer, below;
``steps``, ``heads``  copy probes at a head's sigmoid step, and sequences where two
               heads' attention patterns differ most (multi-head models).

Then two checks that cost no query or few:

``own``        the learner's own longest probes (kept by the oracle, answers already
               measured) against the model: a learner that probes with 2,048 tokens
               compares its model with those answers too;
``search``     an adversarial stage: a few rounds that start from the worst held-out
               sequences and move them in length (towards L), token norm (x or / 10^0.5)
               and direction (a random turn), keeping the variants where model and black
               box differ most. An effect that grows with length or norm is largest at
               the edge of the domain, where random draws rarely land; the search walks
               there. Its queries are part of ``count`` (SEARCH_SHARE of it).

The domain. Lengths run over a geometric ladder 1..6, then x sqrt(2) up to L, with L
the deployment's longest sequence (``max_length``, the oracle's or given) when known,
else max(the longest sequence the learner sent, DEFAULT_LONGEST = 4096). No sequence
longer than ``max_length`` is ever sent. The report states the verified lengths and
token norms.

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

Vector answers. A black box that answers the output vector (m,) at the last position,
or (N, m) at every position, is compared on every number it answers: |.| below is the
Euclidean norm of a sequence's whole answer (every channel, every position), so a
deviation in one channel or at one position counts as in a scalar answer.

Relative error. The error of sequence i is |f_hat_i - f_i| / max(|f_i|, s_i K), with
s_i the largest token norm of the sequence and K the root mean square of f_j / s_j
over the set: outputs scale with the tokens, so an honest model's error relative to
s_i K does not grow with the scale of the tokens, and a family of small tokens is
judged against outputs of its own size, not against the largest family's. Rounding
in float64 grows like eps_64 (d + N) |v| s_i, about 1e-13 relative at N = 1024, d = 384.
Every comparison is scale-safe: K and the differences are computed on scaled values
(as np.hypot does), so outputs of 1e-300 or 1e300 are judged like outputs of 1.

The error bar. A learner that knows its model's relative parameter error e passes it
(``expected_error``): the tolerance becomes max(CONSISTENCY_FACTOR e, CONSISTENCY_FLOOR)
when that is tighter than the one asked for, and each sequence's allowance grows by
SENSITIVITY e times the reach of the model's scores on it (max_i |x_i| |x_N| |W_h|):
a model known to 1e-13 that misses the black box by 1e-8 is not the black box's model.
With exact (float64) answers the widening takes e at most tolerance / CONSISTENCY_FACTOR,
the bar the tolerance assumes: a learner's bar can be a loose bound from its probes'
design (700x a vector head's real error, where the tolerance stays at 1e-7), and at
large scores its widening passed a box with an attention sink at errors of 0.11.
Rounded answers keep e whole: the box's own rounding of its scores grows with them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from .models import (
    PreLayerNormAttention,
    SphereAttention,
    VectorAttention,
    VectorSphereAttention,
    layer_norm,
    softmax,
)
from .numerics import FLOAT32_SHARE, answers_look_rounded, float32_share, safe_norm, safe_rms
from .oracle import Oracle, ScaledOutputs, evaluate_ragged, live_queries, root_oracle
from .sphere import sphere_tokens

# -- the outcome of a check ---------------------------------------------------------------

DEFAULT_VERIFY_TOLERANCE = 1e-7
MAX_VERIFY_LENGTH = 16


@dataclass
class Verification:
    """Outcome of comparing a recovered model with the black box on held-out sequences.

    The relative error of one sequence is |f_hat - f| / max(|f|, s K), with s the
    sequence's largest token norm and K the root mean square of f / s over the set
    (see :mod:`attnextract.verification`), so that outputs near zero do not inflate
    it and families of small tokens are judged at their own size. ``hull_violation``
    is the second layer (single heads): how far an answer left the interval spanned
    by its tokens' own answers; it must stay within ``hull_tolerance``.
    """

    sequences: int
    max_relative_error: float
    median_relative_error: float
    tolerance: float
    lengths: tuple[int, int] = (1, MAX_VERIFY_LENGTH)
    hull_violation: float = 0.0
    hull_tolerance: float = 0.0
    worst_family: str = ""
    family_errors: dict = field(default_factory=dict)
    # the tolerance asked for, when the model's own error bar made ``tolerance`` tighter
    requested_tolerance: float = 0.0
    # the domain verified: the norms (smallest, largest) of the tokens whose treatment
    # the answers showed (given a share of the model's attention at the query, or the
    # query token: attnextract.verification.weighted_tokens), ``lengths`` up to the
    # longest such reach, and L, the longest length the design could use (the
    # deployment's max_length, or the default); ``norms_sent``: every token sent
    norms: tuple = (0.0, 0.0)
    max_length: int = 0
    search_queries: int = 0        # of ``sequences``: the adversarial search's queries
    own_probes: int = 0            # the learner's longest probes compared (no query)
    rounded_answers: bool = False  # the answers show rounding (float32, decimals)
    # (nearly) every answer is a float32 number: a float32 forward pass, whatever the size
    # of the error its rounding caused in a learner that assumed float64 answers
    float32_answers: bool = False
    # the model's own relative parameter error bar the check allowed for (0: none); a
    # saved result is re-verified against the same bar (``attnextract verify``)
    error_bar: float = 0.0
    norms_sent: tuple = (0.0, 0.0)
    # sequences asked per family, and the coverage each buys (:func:`coverage_share`): a
    # deviation on at least that share of the family's inputs is caught with 95%
    # confidence; a check that states no families: one entry "all"
    family_sequences: dict = field(default_factory=dict)
    coverage: dict = field(default_factory=dict)
    # the tolerance each sequence was judged by before the model's error bar widened its
    # allowance (0: not stated); ``tolerance`` is then the largest error the check
    # accepted, never less than this: every error met the tolerance printed
    judged_tolerance: float = 0.0
    # the largest error scaled to its sequence's allowance (error x judged_tolerance /
    # allowance): what was compared with judged_tolerance
    judged_error: float = 0.0
    # why the black box's answers depend on the batch they are asked in ("" when they do
    # not: the same sequences alone and at the end of a large batch agreed to the
    # rounding), and the batch sizes those re-asks were compared in
    batch_dependence: str = ""
    batch_sizes: tuple = ()

    def __post_init__(self):
        if not self.coverage and self.sequences > 0:
            self.family_sequences = self.family_sequences or {"all": int(self.sequences)}
            self.coverage = {k: coverage_share(n) for k, n in self.family_sequences.items()}

    @property
    def passed(self) -> bool:
        return bool(self.max_relative_error <= self.tolerance
                    and self.hull_violation <= self.hull_tolerance
                    and not self.batch_dependence)

    def __repr__(self) -> str:
        return (f"<Verification {'PASSED' if self.passed else 'FAILED'}: {self.sequences} "
                f"held-out sequences, max relative error {self.max_relative_error:.2e} "
                f"{'<=' if self.passed else '>'} {self.tolerance:.0e}>")


COVERAGE_CONFIDENCE = 0.95


def coverage_share(n: int, confidence: float = COVERAGE_CONFIDENCE) -> float:
    """The smallest share p of a family's inputs a deviation must cover to be caught with
    probability ``confidence`` by ``n`` independent draws from that family:
    1 - (1 - p)^n >= confidence, so p = 1 - (1 - confidence)^(1/n) (1.0 for n = 0).
    24 draws: 11.8%; 64: 4.6%; 600: 0.5%."""
    return 1.0 if n <= 0 else 1.0 - (1.0 - confidence) ** (1.0 / n)


def draws_for_coverage(p: float, confidence: float = COVERAGE_CONFIDENCE) -> int:
    """Draws from one family that catch a deviation on a share ``p`` of its inputs with
    probability ``confidence`` (the inverse of :func:`coverage_share`)."""
    # less a hair: coverage_share(n) maps back to n, not n + 1 by rounding
    return math.ceil(math.log(1.0 - confidence) / math.log1p(-p) - 1e-9)


def token_scale(model) -> float:
    """Token scale c with scores x^T W y of order one for x, y ~ N(0, c^2 I)."""
    W = getattr(model, "W", None)
    if W is None or np.size(W) == 0:        # no heads (f = 0): any scale
        return 1.0
    norm = float(np.max(safe_norm(np.reshape(W, (-1,) + W.shape[-2:]), axis=(1, 2))))
    return math.sqrt(2.0 / norm) if norm > 0 else 1.0


# -- the held-out design ----------------------------------------------------------------

DEFAULT_LONGEST = 4096        # held-out lengths reach at least this (unless max_length) ...
DEFAULT_NUMBERS = 1 << 20     # ... cut to this many numbers per sequence for wide tokens
                              # (a served endpoint's request limit: 2,730 tokens at d = 384)
ORDINARY_LENGTH = 16
HULL_FRACTION = 1e-4          # hull tolerance = this x the output tolerance
HULL_NOISE = 30.0             # ... or this x the answers' measured noise, when larger
# answers rounded to an absolute a (K decimals) are off by up to a; twice that is
# allowed per sequence (:class:`_Judge`)
ABSOLUTE_NOISE_FACTOR = 2.0
HULL_MIN_SPREAD = 1e-2        # hull violations relative to at least this x the token norm
SCALE_CAP = 100.0            # token scales stop at this x d^-1/4
PEAK_SPREAD = 30.0            # model scores span about this on the "peaked" family
FAR_SCORES = (1.0, 3.0)       # "far": every score near -+10^U(1, 3)
FAR_SPREAD = 2.0              # ... within +-this of each other (soft attention among them)
FAMILIES = {"ordinary": 0.1, "long": 0.2, "repeated": 0.1, "norms": 0.14, "sparse": 0.1,
            "peaked": 0.08, "far": 0.12, "hull": 0.25, "steps": 0.1, "heads": 0.1}
SECOND_LAYER = {"hull", "steps", "heads"}   # families that need the model (see design)
HEADS_OVERSAMPLE = 8          # candidates drawn per "heads" sequence kept
HULL_CANDIDATES = 6           # candidate orders drawn per hull sequence kept
# sequences a family gets at least (1 for the others): the hull 2 pool tokens and 2
# sequences of them; norms and far one at each end (tiny and huge tokens; scores far
# below and far above zero), so that a small check still spans the whole domain
FAMILY_MIN = {"hull": 4, "norms": 2, "far": 2}
SMALLEST_DESIGN = 12          # the second layer needs a design of at least this many
SEARCH_SHARE = 0.2            # share of the count the adversarial search asks
SEARCH_ROUNDS = 3
SEARCH_MIN = 6                # a count below this searches nothing
REPLAY_FRACTION = 0.125       # at most this share of the check re-asks learner queries
# the error bar (see the module docstring)
CONSISTENCY_FACTOR = 1e3
CONSISTENCY_FLOOR = 1e-10
SENSITIVITY = 4.0
# a bar above this (a model known to worse than 10%) is no bar: its allowance would
# accept any box (a refused multi-head model wrong by 36 passed at 2.7e-12 with a bar of 744)
MAX_ERROR_BAR = 0.1
# expected_error="measured" (learners without an error bar of their own): the bar is the
# model's error on the learner's own answered queries, at least MEASURED_ROUNDING d eps_64,
# and the tolerance at least MEASURED_FLOOR (held-out errors of honest models run up to
# ~1e4 x their error on the probes: 1.3e-10 measured on a Transformer layer at d = 8)
MEASURED_ROUNDING = 100.0
MEASURED_FLOOR = 1e-9
# Batch invariance: BATCH_REASKS held-out sequences of one length are asked again alone
# (a batch of one) and at the end of a batch as large as the check's share allows, up to
# the learner's largest (at most BATCH_CAP; filled with fresh held-out sequences of that
# length, compared with the model like the others). A function of the sequence
# answers the same in every batch, to its rounding: BATCH_FRACTION of the tolerance, or
# BATCH_ROUNDING relative when every answer is rounded (a float32 forward pass moves by
# ~3.5e-7 with its batch); answers rounded in one batch shape and not in another are a
# precision that depends on the batch.
BATCH_REASKS = 4
REASKED = "batch re-asks"     # family_sequences entry of the re-asks (not random draws)
BATCH_CAP = 256
BATCH_FRACTION = 0.1
BATCH_ROUNDING = 1e-6
BATCH_LONGEST = 64            # the re-asked length is at most this (a big batch stays cheap)
# the check's queries are part of the verification count, taken from the replays' and
# the search's shares (the families keep theirs): half of each above their minimums
BATCH_LEAST = 6               # fewer: no batch check (reask_in_other_batches)
BATCH_BIG_MIN = 9             # the big batch reaches past 8 whenever the share allows
# a check whose replays and search cannot spare this many takes the rest from its
# design, while the design keeps SMALL_DESIGN (every family's minimum): one held-out
# sequence again alone and at the end of a batch of BATCH_BIG_MIN, so that a box
# computing large batches another way is seen by a check of 34 (MIN_VERIFY_COUNT)
BATCH_SMALL = 2 + (BATCH_BIG_MIN - 1)
SMALL_DESIGN = 15
# the learner's own answers asked again (replays): answers float32 numbers in the
# learner's batches and not in the check's (or the reverse), over at least this many
# nonzero numbers each, are a precision that depends on the batch
REPLAY_PRECISION_LEAST = 3


BATCH_QUERIES = 12            # the check's queries: one alone, a batch of 11


def batch_share(replays: int, searched: int, designed: int) -> tuple[int, int, int, int]:
    """(replays, search queries, design sequences, batch-check queries): the check's
    BATCH_QUERIES, or a quarter of a larger verification (a big batch up to BATCH_CAP:
    --verify-sequences buys one as large as the learner's), come from half the replays,
    then the search above SEARCH_MIN, then the design while it keeps 40 sequences (every
    family's minimum and more). A check that cannot spare BATCH_SMALL so takes the
    rest of it from its design while the design keeps SMALL_DESIGN; a smaller
    one (below MIN_VERIFY_COUNT = 34) keeps its shares whole and has no batch check."""
    count = replays + searched + designed
    need = max(BATCH_QUERIES, min(count // 4, BATCH_CAP + BATCH_REASKS))
    from_replays = min(replays // 2, need)
    from_search = min(max(0, searched - SEARCH_MIN), need - from_replays)
    from_design = min(max(0, designed - 40), need - from_replays - from_search)
    total = from_replays + from_search + from_design
    if total < BATCH_SMALL:          # too few for a batch past 8: topped up from the design
        from_design = BATCH_SMALL - from_replays - from_search
        if designed - from_design < SMALL_DESIGN:
            return replays, searched, designed, 0
        total = BATCH_SMALL
    return replays - from_replays, searched - from_search, designed - from_design, total


# The verified domain: a token counts (its norm, its distance from the end) only where the
# model's attention at the query gives it at least WEIGHT_SHARE of a head's weight, or
# half an even share (0.5 / N: a long sequence of equal weights is read in full), or it
# is the query token. A token that carries no weight cannot show in the answer what the
# box does with it, so its norm is no evidence.
WEIGHT_SHARE = 1e-3
# the norms family places one extreme token where it must show: as the query token, or
# as a key the query attends to while every other score sits KEY_GAP below it
KEY_GAP = (4.0, 8.0)


def _attention_heads(model):
    """(W (H, d, d), b (H, d) or None, layer norm (gamma, beta, eps) or None) of the
    model's attention at the query token; None for a model without attention (a ReLU
    network on single tokens) or one that reads every position (every token is a query
    token there)."""
    if isinstance(model, VectorAttention) and model.positions != "last":
        return None
    W = getattr(model, "W", None)
    if W is None or np.ndim(W) not in (2, 3) or np.size(W) == 0:
        return None
    W = np.asarray(W, dtype=float)
    W = W[None] if W.ndim == 2 else W
    b = None
    # query biases only of the classes that have them (a Transformer layer's b is its
    # feed-forward bias)
    if is_biased(model) or isinstance(model, (PreLayerNormAttention, VectorAttention)):
        b = getattr(model, "b", None)
        b = None if b is None else np.asarray(b, dtype=float).reshape(len(W), -1)
    ln = ((model.gamma, model.beta, model.eps) if isinstance(model, PreLayerNormAttention)
          else None)
    return W, b, ln


def weighted_tokens(model, X: np.ndarray) -> np.ndarray:
    """Which tokens of X (N, d) the model's answer reads: those given at least
    min(WEIGHT_SHARE, 0.5 / N) of some head's attention at the query token, and the
    query token itself. Boolean (N,); every token for models without attention at one
    query (see :func:`_attention_heads`)."""
    X = np.asarray(X, dtype=float)
    heads = _attention_heads(model)
    if heads is None or len(X) == 1:
        return np.ones(len(X), dtype=bool)
    W, b, ln = heads
    Y = X if ln is None else layer_norm(X, *ln)
    with np.errstate(over="ignore", invalid="ignore"):
        scores = (W @ Y[-1]) @ Y.T                  # (H, N): W x_N first, then one product
        if b is not None:
            scores = scores + b @ Y.T
        alpha = softmax(np.where(np.isfinite(scores), scores, -np.inf))
    keep = np.nan_to_num(alpha).max(axis=0) >= min(WEIGHT_SHARE, 0.5 / len(X))
    keep[-1] = True
    return keep


def verified_domain(model, sequences) -> tuple[tuple[float, float], int]:
    """((smallest, largest) norm of the tokens the model's answers read, the longest
    reach): over ``sequences``, the tokens of :func:`weighted_tokens`, and the largest
    N - i over sequences of length N whose token i (0-based) carries weight. Norms of 0
    are left out of the smallest."""
    lo, hi, reach = math.inf, 0.0, 1
    for X in sequences:
        keep = weighted_tokens(model, X)
        norms = _safe_norm(X)[keep]
        positive = norms[norms > 0]
        if positive.size:
            lo = min(lo, float(positive.min()))
        hi = max(hi, float(norms.max()))
        reach = max(reach, len(X) - int(np.argmax(keep)))
    return ((0.0 if not math.isfinite(lo) else lo), hi), reach


@dataclass
class HeldOutSet:
    """Held-out sequences (N_i, d), the family of each, and the hull pairs.

    ``hull`` lists (i, singles): sequence i and the indices of the length-1 sequences
    [x] of each of its tokens (also in ``sequences``). ``replay`` lists (x, y): sequence
    x was answered y during recovery (:func:`add_replays`; not in ``sequences``).
    ``longest`` is L, the longest length the design could use.
    """

    sequences: list
    family: list
    hull: list
    replay: list = field(default_factory=list)   # (sequence, answer the learner was given)
    # per hull pair: the model's output change per unit of token displacement across the
    # pool (FFN regions: |A_S^T w_S|), or 0 to judge the pair against K (single heads)
    hull_slope: list = field(default_factory=list)
    longest: int = 0

    @property
    def lengths(self) -> tuple[int, int]:
        n = [len(s) for s in self.sequences]
        return min(n), max(n)


def max_length_of(oracle) -> int | None:
    """The ``max_length`` of the Oracle under ``oracle`` (a learner's view), or None."""
    return getattr(root_oracle(oracle), "max_length", None)


def longest_length(probe_length: int | None = None, max_length: int | None = None,
                   dim: int | None = None) -> int:
    """L, the longest held-out length: ``max_length`` when given (the deployment's
    context), else max(the longest probe, DEFAULT_LONGEST, cut to DEFAULT_NUMBERS / d
    numbers for wide tokens)."""
    if max_length:
        return int(max_length)
    default = DEFAULT_LONGEST if not dim else min(DEFAULT_LONGEST, max(16, DEFAULT_NUMBERS // int(dim)))
    return max(default, int(probe_length or 1))


def _split(count: int, second: set) -> dict[str, int]:
    """Sequences per family: ``count`` x the family's weight, every family at least
    FAMILY_MIN (1 unless listed); the rest to ``ordinary``. A count below the minimums
    is all ``ordinary``."""
    weights = {k: w for k, w in FAMILIES.items() if k not in SECOND_LAYER or k in second}
    least = {k: FAMILY_MIN.get(k, 1) for k in weights}
    if count < sum(least.values()) + 1:
        return {"ordinary": count}
    total = sum(weights.values())
    sizes = {k: max(least[k], int(count * w / total)) for k, w in weights.items()}
    sizes["ordinary"] += count - sum(sizes.values())
    if sizes["ordinary"] < 1:            # the minimums took more than the weights gave
        for k in sorted(sizes, key=lambda k: sizes[k] - least[k], reverse=True):
            while sizes["ordinary"] < 1 and sizes[k] > least[k]:
                sizes[k] -= 1
                sizes["ordinary"] += 1
    return sizes


def length_grid(longest: int) -> np.ndarray:
    """The lengths held-out sequences take: 1..6, then steps of ~1.4x up to ``longest``
    (a geometric ladder; ``longest`` itself always).

    Sequences are sent one batch per length, so a grid keeps the black-box calls few
    (about 30 for L = 4096) while still covering every scale of length.
    """
    longest = max(1, int(longest))
    grid = {k for k in (1, 2, 3, 4, 5, 6) if k <= longest} | {longest}
    x = 6.0
    while x < longest:
        x *= math.sqrt(2.0)
        grid.add(min(int(round(x)), longest))
    return np.array(sorted(grid))


def _log_uniform_int(rng, lo, hi, size, grid):
    """Lengths in lo..hi, log-uniform, snapped to the lengths of ``grid`` in that range."""
    hi = max(min(hi, int(grid.max())), 1)
    lo = min(lo, hi)
    grid = grid[(grid >= lo) & (grid <= hi)]
    x = rng.uniform(math.log(lo), math.log(hi + 1), size)
    return grid[np.abs(np.log(grid)[None, :] - x[:, None]).argmin(axis=1)]


@dataclass
class _Domain:
    """What every family function needs: width, scales, lengths and the model's heads."""

    d: int
    rng: np.random.Generator
    scale: float                  # per-coordinate scale where the model's scores are O(1)
    anchor: float                 # d^-1/4
    low: float                    # min(scale, anchor)
    longest: int                  # L
    grid: np.ndarray              # length_grid(L)
    W: np.ndarray | None          # one head (d, d) (single head or FFN view), else None
    heads: tuple | None           # (W (H, d, d), v (H, d)) of a multi-head model

    def lengths(self, lo, hi, n):
        return _log_uniform_int(self.rng, lo, hi, n, self.grid)

    def score_heads(self) -> np.ndarray | None:
        """The model's score matrices (H, d, d), or None without any."""
        if self.W is not None and np.ndim(self.W) == 2:
            return np.asarray(self.W, dtype=float)[None]
        return None if self.heads is None else self.heads[0]


def _family_ordinary(dom: _Domain, n: int) -> list:
    """Lengths 1..16, scale c or d^-1/4, times 1/2, 1 or 2."""
    base = np.where(np.arange(n) % 2 == 0, dom.scale, dom.anchor) * dom.rng.choice([0.5, 1.0, 2.0], n)
    return [b * dom.rng.standard_normal((int(k), dom.d))
            for b, k in zip(base, dom.lengths(1, ORDINARY_LENGTH, n))]


def _family_long(dom: _Domain, n: int) -> list:
    """Lengths stratified in log over 2..L (L itself at both scales)."""
    base = np.where(np.arange(n) % 2 == 0, dom.scale, dom.anchor)
    top = math.log(max(dom.longest, 2))
    # stratified: every stretch of the log range gets its share, whatever the draw
    x = math.log(2) + (top - math.log(2)) * (dom.rng.permutation(n) + dom.rng.uniform(size=n)) / max(n, 1)
    lengths = dom.grid[np.abs(np.log(dom.grid)[None, :] - x[:, None]).argmin(axis=1)]
    lengths = np.maximum(lengths, min(2, dom.longest))
    lengths[:2] = dom.longest                 # the longest length always, at both scales
    return [b * dom.rng.standard_normal((int(k), dom.d)) for b, k in zip(base, lengths)]


def _family_repeated(dom: _Domain, n: int) -> list:
    """One to three distinct tokens, repeated in runs or at random, lengths 16..L."""
    out = []
    for i, k in enumerate(dom.lengths(16, dom.longest, n)):
        b = dom.scale if i % 2 == 0 else dom.anchor
        pool = b * dom.rng.standard_normal((1 + i % 3, dom.d))
        pick = (np.sort(dom.rng.integers(0, len(pool), int(k))) if i % 2
                else dom.rng.integers(0, len(pool), int(k)))
        x = pool[pick]
        if i % 4 == 3:
            x[-1] = b * dom.rng.standard_normal(dom.d)     # sometimes a fresh query token
        out.append(x)
    return out


def _family_norms(dom: _Domain, n: int) -> list:
    """Per-sequence factor 10^U(-3, 3), stratified, 10^3 always (all its tokens). The
    others take turns: one token at the sequence's norm as a key the query attends to
    (every other score KEY_GAP below it, so a tiny token too carries most of the weight),
    as the query token among ordinary keys, all tokens at that norm with mixed norms
    inside (10^U(-2, 2)), all tokens at it. The bottom stays drawn: tokens all at 10^-3
    give outputs that a box rounded to k decimals (absolute) cannot answer to the
    tolerance."""
    out = []
    exponents = -3.0 + 6.0 * (dom.rng.permutation(n) + dom.rng.uniform(size=n)) / max(n, 1)
    top = -1
    if n >= 2:       # the top end always (as ``long`` reaches L): a small check reaches it
        top = int(np.argmax(exponents))
        exponents[top] = 3.0
    heads = dom.score_heads()
    roles = ("key", "query", "mixed", "plain")
    turn = 0
    for i, k in enumerate(dom.lengths(2, 64, n)):
        k = int(k)
        factor = 10.0 ** exponents[i]
        x = dom.low * factor * dom.rng.standard_normal((k, dom.d))
        if i == top:     # every token there (a mix moved them in by 10^-2: a norm-20
            out.append(x)    # trigger slipped past at d = 8, 1 of 20)
            continue
        role = roles[turn % len(roles)]
        if role in ("key", "query"):
            # one token at an end of the norm range, tiny and large in turn (the key starts
            # tiny: a box that takes tiny tokens for padding shows only where one carries
            # the weight), 10^-3..10^-2 or 10^2..10^3
            low_end = (turn // len(roles)) % 2 == (0 if role == "key" else 1)
            factor = 10.0 ** ((-3.0 if low_end else 2.0) + dom.rng.uniform())
            x = dom.low * factor * dom.rng.standard_normal((k, dom.d))
        turn += 1
        if role == "mixed":
            x *= 10.0 ** dom.rng.uniform(-2, 2, size=(k, 1))
        elif role == "query":
            x[:-1] = dom.scale * dom.rng.standard_normal((k - 1, dom.d))
        elif role == "key":
            x = _attended_key(dom, heads, k, factor, i)
        out.append(x)
    return out


def _attended_key(dom: _Domain, heads, k: int, factor: float, i: int) -> np.ndarray:
    """A sequence (k, d) of ordinary tokens and one key at ``factor`` times the low token
    scale (per coordinate) that the query attends to: along W_h q, the other keys' scores
    set KEY_GAP below its own (as the ``far`` family sets scores). Without heads, the
    key at a random place among ordinary tokens."""
    rng, d = dom.rng, dom.d
    X = dom.scale * rng.standard_normal((k, d))
    key = dom.low * factor * rng.standard_normal(d)
    if heads is None or k < 2:
        X[rng.integers(0, k)] = key
        return X
    q = X[-1]
    w = heads[i % len(heads)] @ q
    ww = float(w @ w)
    if not (ww > 0 and math.isfinite(ww)):
        X[0] = key
        return X
    # the key along +w (its score positive, or ~0 for a tiny key); the others below it
    key = safe_norm(key) * w / math.sqrt(ww)
    top = float(key @ w)
    R = X[:-1]
    t = min(top, 0.0) - rng.uniform(*KEY_GAP, k - 1)
    R = R + ((t - R @ w) / ww)[:, None] * w[None, :]
    # no token beyond the far family's cap: where W ~ 0 (known only to its noise) the
    # gap would need tokens of any size, and there the model itself is not known
    if np.all(np.isfinite(R)) and float(_safe_norm(R).max()) <= 1e3 * dom.low * math.sqrt(d):
        X[:-1] = R
    X[rng.integers(0, k - 1)] = key
    return X


def _family_sparse(dom: _Domain, n: int) -> list:
    """One-hot tokens, two-hot tokens, and Gaussian tokens with a constant coordinate."""
    d, rng, out = dom.d, dom.rng, []
    for i, k in enumerate(dom.lengths(1, 64, n)):
        k = int(k)
        b = (dom.scale if i % 2 == 0 else dom.anchor) * math.sqrt(d) * 10.0 ** rng.uniform(-1, 1)
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
    return out


def _family_peaked(dom: _Domain, n: int) -> list:
    """Tokens scaled so that the model's scores span ~PEAK_SPREAD (attention near one-hot)."""
    heads, out = dom.score_heads(), []
    for k in dom.lengths(2, 64, n):
        x = dom.rng.standard_normal((int(k), dom.d))
        if heads is not None:
            s = np.einsum("nd,hde,e->hn", x, heads, x[-1])
            spread = float((s.max(axis=1) - s.min(axis=1)).max())
            c = (math.sqrt(PEAK_SPREAD * 10.0 ** dom.rng.uniform(-0.5, 0.5) / spread)
                 if spread > 0 else dom.scale)
            c = min(c, 1e3 * dom.low)
        else:
            c = dom.scale * math.sqrt(PEAK_SPREAD) * 10.0 ** dom.rng.uniform(-0.25, 0.25)
        out.append(c * x)
    return out


def _family_far(dom: _Domain, n: int) -> list:
    """Every score of one head near -S (even i) or +S (odd i), log10 S stratified over
    FAR_SCORES = (1, 3) for each sign, the scores within +-FAR_SPREAD of each other.

    The query token q is an eigenvector of W_h's symmetric part with the most negative
    (positive) eigenvalue lambda, scaled so that q^T W_h q = -+S; every other token is
    r_i + (t_i - r_i^T w) w / |w|^2 with w = W_h q, r_i Gaussian of |q|'s size and t_i
    its target score, so that x_i^T W_h q = t_i exactly. When lambda has the wrong sign
    (W_h's symmetric part definite), the query's own score stays near 0 and the other
    tokens are still far. Models without heads get ordinary sequences instead.
    """
    heads = dom.score_heads()
    if heads is None:
        return _family_ordinary(dom, n)
    rng, d, out = dom.rng, dom.d, []
    # log S stratified per sign: each sign's sequences cover FAR_SCORES evenly, the top
    # stretch always (an extra logit at -b is seen only where every score is below -b)
    exponents = np.empty(n)
    for sign_index in (0, 1):
        m = len(range(sign_index, n, 2))
        strata = (rng.permutation(m) + rng.uniform(size=m)) / max(m, 1)
        exponents[sign_index::2] = FAR_SCORES[0] + (FAR_SCORES[1] - FAR_SCORES[0]) * strata
    for i, k in enumerate(dom.lengths(2, min(dom.longest, 256), n)):
        W = heads[i % len(heads)]
        sign = -1.0 if i % 2 == 0 else 1.0
        S = 10.0 ** exponents[i]
        lam, vecs = np.linalg.eigh(0.5 * (W + W.T))
        j = int(np.argmin(lam)) if sign < 0 else int(np.argmax(lam))
        if lam[j] * sign > 0:
            q = vecs[:, j] * math.sqrt(S / abs(lam[j]))
        else:                           # no direction of that sign: the smallest |lambda|
            j = int(np.argmin(np.abs(lam)))
            q = vecs[:, j] * math.sqrt(S / max(float(np.abs(lam).max()), 1e-300))
        # no larger than the peaked family's tokens: beyond, a W ~ 0 is known only to its
        # noise (the scores stay as far as that norm allows)
        cap = 1e3 * dom.low * math.sqrt(d)
        if safe_norm(q) > cap:
            q *= cap / safe_norm(q)
        q = q + 1e-3 * safe_norm(q) / math.sqrt(d) * rng.standard_normal(d)
        w = W @ q
        ww = float(w @ w)
        if not (ww > 0 and np.all(np.isfinite(q))):
            out.append(dom.scale * rng.standard_normal((int(k), d)))
            continue
        R = (safe_norm(q) / math.sqrt(d)) * rng.standard_normal((int(k) - 1, d))
        # scores a token within the cap can reach: |t| <= |w| cap / 2
        S = min(S, 0.5 * math.sqrt(ww) * cap)
        t = sign * S + min(FAR_SPREAD, S) * rng.uniform(-1.0, 1.0, int(k) - 1)
        X = R + ((t - R @ w) / ww)[:, None] * w[None, :]
        out.append(np.vstack([X, q[None]]))
    return out


def _family_steps(dom: _Domain, n: int) -> list:
    if dom.longest < 4:                 # no room for a copy probe's counts
        return _family_ordinary(dom, n)
    heads = dom.score_heads()
    assert heads is not None            # the family is drawn for models with score heads
    return _step_sequences(heads, n, dom.rng, dom.scale, dom.longest, dom.grid)


def _family_heads(dom: _Domain, n: int) -> list:
    assert dom.heads is not None        # the family is drawn for multi-head models
    return _separating_sequences(dom.heads[0], dom.heads[1], n, dom.rng, dom.scale, dom.grid)


FIRST_LAYER = {"ordinary": _family_ordinary, "long": _family_long,
               "repeated": _family_repeated, "norms": _family_norms,
               "sparse": _family_sparse, "peaked": _family_peaked, "far": _family_far,
               "steps": _family_steps, "heads": _family_heads}


def _hull_single(dom: _Domain, n: int, v, hull_v):
    """Pool tokens orthogonal to v (each a length-1 sequence), then sequences of them:
    (pool (p, d), [indices into the pool per sequence])."""
    d, rng = dom.d, dom.rng
    pool_size = max(1, min(n // 2, 2 * d))
    n_seq = n - pool_size
    u = np.asarray(hull_v if hull_v is not None and np.any(hull_v) else v, dtype=float)
    u = u / np.abs(u).max()                         # scaled first: |v| of 1e-300 or 1e300
    u = u / safe_norm(u)
    P = rng.standard_normal((pool_size, d))
    P -= np.outer(P @ u, u)
    P -= np.outer(P @ u, u)                         # twice: orthogonal to rounding
    norms = np.linalg.norm(P, axis=1, keepdims=True)
    P = P / np.where(norms > 0, norms, 1.0)
    # from where attention is soft (half the pool: where a second head shows) to
    # where it is near one-hot
    top = np.where(np.arange(pool_size) % 2 == 0, 0.5, 1.5)[:, None]
    P *= max(dom.scale, dom.anchor) * math.sqrt(d) * 10.0 ** rng.uniform(-0.5, top, (pool_size, 1))
    assert dom.W is not None            # the hull family of a single head
    picks = [_soft_pick(dom.W, P, int(k), rng) for k in dom.lengths(2, min(dom.longest, 64), n_seq)]
    return P, picks


def design(dim: int, count: int, rng: np.random.Generator, scale: float = 1.0, *,
           probe_length: int | None = None, max_length: int | None = None, model=None,
           hull_v=None, exclude=()) -> HeldOutSet:
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
        The longest sequence the learner sent (L is at least this).
    max_length : int, optional
        The longest sequence the black box accepts: L is exactly this when given.
    model : optional
        The recovered model: a single head (W, v) adds the hull family and sets the
        scale of the ``peaked`` and ``far`` families; other models get the first layer
        (and their heads' ``far``, ``steps`` and ``heads`` families).
    hull_v : array (d,), optional
        Put the hull tokens orthogonal to this v (the black box's own, measured)
        instead of the model's.
    exclude : tuple of str
        Families left out (their share goes to ``ordinary``): the noisy learners leave
        out ``far``, whose scores of +-1000 a float32 forward pass rounds beyond any
        output noise bound.
    """
    d = dim
    W = getattr(model, "W", None)
    v = getattr(model, "v", None)
    heads = None
    O = getattr(model, "O", None)
    if W is not None and v is None and O is not None and np.ndim(O) == 3:
        v = vector_readouts(O)        # a vector model's heads, read along their top outputs
    if W is not None and v is not None and np.ndim(W) == 3 and np.ndim(v) == 2:
        if W.shape[0] == 1:                     # one head: the single-head families
            W, v = W[0], v[0]
        elif W.shape[0] > 1:
            heads = (np.asarray(W, dtype=float), np.asarray(v, dtype=float))
    single = (W is not None and v is not None and np.ndim(W) == 2 and np.ndim(v) == 1
              and d >= 2 and np.any(v) and count >= SMALLEST_DESIGN and O is None)
    ffn = ffn_view(model) if not single and d >= 2 and count >= 16 else None
    if ffn is not None:
        W = ffn[0]
    second = ({"hull", "steps"} if single or ffn is not None else
              {"steps", "heads"} if heads is not None and count >= 16 else set())
    sizes = _split(count, second)
    for name in exclude:
        sizes["ordinary"] = sizes.get("ordinary", 0) + sizes.pop(name, 0)
    L = longest_length(probe_length, max_length, d)
    anchor = d ** -0.25
    # A model with W ~ 0 (rounding noise) has an enormous token scale; beyond ~100 x the
    # d^-1/4 anchor its W is known only to that noise, so the scale stops there.
    scale = min(scale, SCALE_CAP * anchor)
    dom = _Domain(d=d, rng=rng, scale=scale, anchor=anchor, low=min(scale, anchor), longest=L,
                  grid=length_grid(L), W=W if (single or ffn is not None) else None,
                  heads=heads)
    seqs, fam = [], []

    def add(name, xs):
        for x in xs:
            seqs.append(np.ascontiguousarray(x, dtype=np.float64))
            fam.append(name)

    for name, build in FIRST_LAYER.items():
        if sizes.get(name, 0):
            add(name, build(dom, sizes[name]))
    # hull pairs: tokens orthogonal to v, then each token alone
    hull, hull_slope = [], []
    if ffn is not None and sizes.get("hull", 0) >= 4:
        first = len(seqs)
        pools, pairs, slopes = _ffn_hull(ffn, sizes["hull"], rng, max(scale, anchor), L, dom.grid)
        for pool in pools:
            add("hull", [p[None] for p in pool])
        offsets = np.cumsum([first] + [len(pool) for pool in pools])
        for c, pick in pairs:
            hull.append((len(seqs), offsets[c] + pick))
            hull_slope.append(slopes[c])
            add("hull", [pools[c][pick]])
    if single and sizes.get("hull", 0) >= 2:
        P, picks = _hull_single(dom, sizes["hull"], v, hull_v)
        first = len(seqs)
        add("hull", [p[None] for p in P])
        for pick in picks:
            hull.append((len(seqs), first + pick))
            hull_slope.append(0.0)
            add("hull", [P[pick]])
    return HeldOutSet(sequences=seqs, family=fam, hull=hull, hull_slope=hull_slope, longest=L)


def vector_readouts(O: np.ndarray) -> np.ndarray:
    """v_h (H, d) for the design's head families of a vector model: each head's O_h
    (m, d) read along its own largest output direction (the top right singular vector
    times its singular value), so v_h's size is the head's."""
    out = np.zeros((O.shape[0], O.shape[2]))
    for h, Oh in enumerate(np.asarray(O, dtype=float)):
        if np.any(Oh):
            _, sv, Vt = np.linalg.svd(Oh, full_matrices=False)
            out[h] = sv[0] * Vt[0]
    return out


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
    rows = np.maximum(safe_norm(A, axis=1), np.finfo(float).tiny)
    nearest = np.argsort(np.abs(pre) / rows)[:max(0, d // 2 - 1)]
    basis = np.linalg.qr(np.column_stack([v_S] + [A[j] for j in nearest]))[0]
    D = rng.standard_normal((k, d))
    D -= (D @ basis) @ basis.T
    D -= (D @ basis) @ basis.T                # twice: orthogonal to rounding
    D /= np.maximum(np.linalg.norm(D, axis=1, keepdims=True), np.finfo(float).tiny)
    with np.errstate(divide="ignore"):
        reach = np.abs(pre)[None, :] / np.abs(D @ A.T)        # step to each hyperplane
    # no hyperplane in the way: stay within the centre's own norm
    step = 0.9 * np.minimum(reach.min(axis=1), safe_norm(p)) * rng.uniform(0.3, 1.0, k)
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
    for _c in range(n_centres):
        p = rng.standard_normal(d)
        p *= scale * math.sqrt(d) / safe_norm(p)
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
            slopes.append(float(safe_norm(A[active].T @ w[active])))
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
    d = W.shape[1]
    vn = np.maximum(safe_norm(v, axis=1), np.finfo(float).tiny)
    cands, merit = [], []
    for k in _log_uniform_int(rng, 2, 64, HEADS_OVERSAMPLE * count, grid):
        x = scale * 10.0 ** rng.uniform(0.0, 0.75) * rng.standard_normal((int(k), d))
        alpha = softmax((W @ x[-1]) @ x.T)           # (H, N): W x_N first, O(H d^2 + N H d)
        values = x @ v.T                                                    # (N, H)
        gap = np.abs(np.einsum("gn,nh->gh", alpha, values) - np.diag(alpha @ values)[None, :])
        cands.append(x)
        # tokens that underflow to 0 (a model with enormous W has a tiny scale) merit 0
        size = float(safe_norm(x, axis=1).max())
        merit.append(float((gap / vn[None, :]).max()) / size if size > 0 else 0.0)
    return [cands[i] for i in np.argsort(merit)[::-1][:count]]


def add_replays(held: HeldOutSet, oracle, count: int) -> HeldOutSet:
    """Add up to ``count`` of the root oracle's kept (sequence, answer) pairs
    (:attr:`attnextract.oracle.Oracle.replay`) as the ``replay`` family: asked again of
    the root oracle (a learner's view may change what a query means), a fixed function
    answers the same (to its rounding); a black box that switched behaviour during the
    run does not, even where the new behaviour is itself a member of the class. The pairs
    are spread over the run (the replay sample is in the order asked; its first and last
    pairs are among them): a box that switched after the first few percent of the run
    is asked one of its earlier answers (the first 4 of 16 missed a switch at a quarter
    of a one-layer run on every seed)."""
    kept = list(getattr(root_oracle(oracle), "replay", None) or [])
    count = min(max(0, int(count)), len(kept))
    picks = (np.unique(np.round(np.linspace(0, len(kept) - 1, count)).astype(int))
             if count else np.zeros(0, dtype=int))
    pairs = [kept[i] for i in picks]
    held.replay.extend((np.ascontiguousarray(x, dtype=np.float64),
                        float(y) if np.ndim(y) == 0 else np.array(y, dtype=np.float64))
                       for x, y in pairs)
    return held


def is_biased(model) -> bool:
    """True for the biased attention classes (query biases b, output constant c)."""
    return str(getattr(model, "kind", "")).startswith("biased-")


def output_offset(model):
    """The output constant c a model's answers are judged without: a float for the biased
    scalar classes, an array (m,) for a vector model, else 0.0."""
    if getattr(model, "kind", "") in ("vector-attention", "vector-pre-ln-sphere"):
        return np.asarray(model.c, dtype=float)
    return float(model.c) if is_biased(model) else 0.0


def answers_array(answers: list) -> np.ndarray:
    """Answers of several sequences as one array: (B,) or (B, m); answers at every
    position (N_i, m), whose shapes differ, as an object array of B arrays."""
    arrays = [np.asarray(a, dtype=float) for a in answers]
    if not arrays:
        return np.empty(0)
    if arrays[0].ndim >= 2:
        out = np.empty(len(arrays), dtype=object)
        for i, a in enumerate(arrays):
            out[i] = a
        return out
    return np.array(arrays, dtype=float)


def shifted(answers: np.ndarray, offset) -> np.ndarray:
    """answers - offset for every sequence (offset a float, or (m,) for vector answers)."""
    if np.ndim(offset) == 0 and float(offset) == 0.0:
        return answers
    if answers.dtype == object:
        return answers_array([a - offset for a in answers])
    return answers - offset


def answer_norms(answers) -> np.ndarray:
    """|f| per sequence, shape (B,): the absolute value of a scalar answer, the Euclidean
    norm (scale-safe) of a vector answer over every channel and position."""
    if isinstance(answers, np.ndarray) and answers.dtype == object:
        return np.array([safe_norm(a) for a in answers], dtype=float)
    answers = np.asarray(answers, dtype=float)
    if answers.ndim <= 1:
        return np.abs(answers)
    return safe_norm(answers.reshape(len(answers), -1), axis=1)


def _head_norms(model) -> np.ndarray | None:
    W = getattr(model, "W", None)
    if W is None or np.size(W) == 0:
        return None
    W = np.asarray(W, dtype=float)
    return safe_norm(W.reshape((-1,) + W.shape[-2:]), axis=(1, 2))


def score_reach(model, sequences) -> np.ndarray:
    """max_i |x_i| x (max_h |W_h|_F x |x_N| + max_h |b_h|) per sequence, shape
    (len(sequences),): a bound on every score x_i^T (W_h x_N + b_h), so e times it bounds
    a score's error when W and b are known to relative error e (without the bias term a
    sequence whose last token is tiny had no allowance, yet its scores x_i^T b_h carry
    b's error). Zeros for a model without W."""
    norms = _head_norms(model)
    if norms is None:
        return np.zeros(len(sequences))
    top = float(norms.max())
    b = getattr(model, "b", None)
    top_b = 0.0 if b is None or np.size(b) == 0 else float(
        safe_norm(np.atleast_2d(np.asarray(b, dtype=float)), axis=1).max())
    return np.array([_safe_norm(X).max() * (top * _safe_norm(X[-1:])[0] + top_b)
                     for X in sequences])


def _safe_norm(X: np.ndarray) -> np.ndarray:
    """Row norms of X (n, d) without overflow or underflow, shape (n,)."""
    return safe_norm(np.atleast_2d(X), axis=1)


def _norm_range(sequences) -> tuple[float, float]:
    """(smallest nonzero, largest) norm of every token of ``sequences`` (0 when none)."""
    norms = np.concatenate([_safe_norm(X) for X in sequences]) if len(sequences) else np.zeros(1)
    positive = norms[norms > 0]
    return (float(positive.min()) if positive.size else 0.0), float(norms.max())


def token_norms(sequences) -> np.ndarray:
    """Largest token norm of each sequence, shape (len(sequences),)."""
    return np.array([float(_safe_norm(s).max()) for s in sequences])


def output_scale(observed: np.ndarray, norms: np.ndarray) -> float:
    """K = rms of f_j / s_j: the black box's output per unit of token norm (computed on
    values scaled by their largest, so outputs of 1e300 do not overflow)."""
    observed, norms = answer_norms(observed), np.asarray(norms, dtype=float)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        r = np.where(norms > 0, observed / np.where(norms > 0, norms, 1.0), 0.0)
    r = r[np.isfinite(r)]
    if not r.size:
        return 0.0
    top = float(np.abs(r).max())
    return top * math.sqrt(float(np.mean((r / top) ** 2))) if top > 0 else 0.0


def _difference(predicted, observed) -> np.ndarray:
    """|predicted - observed| without overflow (halved first where the difference is inf);
    for vector answers the norm of the difference per sequence, shape (B,)."""
    if (isinstance(observed, np.ndarray) and (observed.dtype == object or observed.ndim > 1)) \
            or (isinstance(predicted, np.ndarray) and (predicted.dtype == object
                                                       or predicted.ndim > 1)):
        with np.errstate(over="ignore", invalid="ignore"):
            # halves first: the difference of two answers near the float64 maximum is finite
            halves = answer_norms(answers_array([0.5 * np.asarray(p, dtype=float)
                                                 - 0.5 * np.asarray(o, dtype=float)
                                                 for p, o in zip(predicted, observed)]))
            return 2.0 * halves
    predicted = np.atleast_1d(np.asarray(predicted, dtype=float))
    observed = np.atleast_1d(np.asarray(observed, dtype=float))
    with np.errstate(over="ignore", invalid="ignore"):
        diff = np.abs(predicted - observed)
    wide = ~np.isfinite(diff) & np.isfinite(predicted) & np.isfinite(observed)
    diff[wide] = 2.0 * np.abs(0.5 * predicted[wide] - 0.5 * observed[wide])   # inf if > max
    return diff


def error_scale(observed, norms, K: float) -> np.ndarray:
    """max(|observed|, s K) per sequence: what a difference is relative to."""
    observed, norms = answer_norms(observed), np.asarray(norms, dtype=float)
    with np.errstate(over="ignore"):
        return np.maximum(observed, np.maximum(norms * K, np.finfo(float).tiny))


def scaled_relative_errors(predicted, observed, norms, reference=None, K=None) -> np.ndarray:
    """|predicted - observed| / max(|observed|, s K) per sequence (see the module docstring).

    ``reference`` (boolean mask) picks the sequences K is computed from (default all);
    the hull family, built to answer ~0, is left out of it. ``K`` given: used as is.
    Scale-safe: outputs from 1e-300 to 1e300 give the same errors as outputs of 1."""
    if not (isinstance(observed, np.ndarray) and observed.dtype == object):
        observed = np.asarray(observed, dtype=float)
    norms = np.asarray(norms, dtype=float)
    if K is None:
        K = output_scale(observed[reference] if reference is not None else observed,
                         norms[reference] if reference is not None else norms)
    denom = error_scale(observed, norms, K)
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        out = _difference(predicted, observed) / denom
        # a difference beyond the float64 range: compare halves (an error > 1 anyway)
        big = ~np.isfinite(out)
        out[big] = np.where(np.isfinite(answer_norms(predicted)[big]), 2.0, np.inf)
    return out


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
        gap = max(0.0, float(_difference(observed[i], hi)[0]) if observed[i] > hi else 0.0,
                  float(_difference(lo, observed[i])[0]) if observed[i] < lo else 0.0)
        X = held.sequences[i]
        spread = float(_safe_norm(X - X.mean(axis=0)).max())
        slope = slopes[j] if slopes[j] > 0 else K
        with np.errstate(over="ignore"):
            out[j] = gap / max(max(spread, HULL_MIN_SPREAD * norms[i]) * slope,
                               np.finfo(float).tiny)
    return out


@dataclass
class Check:
    """What one held-out check measured (before it becomes a report.Verification)."""

    errors: np.ndarray
    family: list
    hull: np.ndarray
    observed: np.ndarray
    predicted: np.ndarray
    lengths: tuple                  # shortest length, longest reach (verified_domain)
    norms: tuple = (0.0, 0.0)       # smallest and largest norm of tokens that were read
    search_queries: int = 0
    own_probes: int = 0
    sent_norms: tuple = (0.0, 0.0)  # smallest and largest token norm sent (search bound)
    # the errors before scaling to each sequence's allowance (``errors``, the judged ones,
    # are error x tolerance / allowance): what the report states as the error
    raw_errors: np.ndarray = field(default_factory=lambda: np.zeros(0))
    batch_queries: int = 0          # fresh sequences filling the batch-invariance batch
    reasks: int = 0                 # held-out sequences asked again (batch invariance)

    def worst_family(self) -> str:
        return self.family[int(np.argmax(self.errors))] if self.errors.size else ""

    def family_errors(self) -> dict:
        out: dict[str, float] = {}
        for f, e in zip(self.family, self.errors):
            out[f] = max(out.get(f, 0.0), float(e))
        return out


class _Judge:
    """Errors of sequences against a fixed K, each scaled to the tolerance by its
    allowance: tolerance + SENSITIVITY e reach when the model has an error bar e, plus
    ABSOLUTE_NOISE_FACTOR a / max(|y|, s K) for answers rounded to an absolute a (K
    decimals: a = 10^-K / 2, which no relative level states at small tokens, where the
    answers are small: a model exact to 1e-15 missed 6-decimal answers by 15.9 times
    the tolerance on tokens of norm 1e-6)."""

    def __init__(self, model, K: float, tolerance: float, bar: float | None,
                 absolute_noise: float = 0.0, model_scale: float = 1.0):
        self.model, self.K, self.tolerance, self.bar = model, K, tolerance, bar
        self.absolute_noise = absolute_noise
        self.model_scale = model_scale      # per-coordinate token scale of the design
        self.last_raw = np.zeros(0)

    def __call__(self, sequences, predicted, observed) -> np.ndarray:
        offset = output_offset(self.model)       # judged without the output constant c
        predicted, observed = shifted(predicted, offset), shifted(observed, offset)
        norms = token_norms(sequences)
        errors = scaled_relative_errors(predicted, observed, norms, K=self.K)
        allowance: float | np.ndarray = self.tolerance
        if self.bar:
            allowance = allowance + SENSITIVITY * self.bar * score_reach(self.model, sequences)
        if self.absolute_noise:
            allowance = allowance + (ABSOLUTE_NOISE_FACTOR * self.absolute_noise
                                     / error_scale(observed, norms, self.K))
        self.last_raw = errors
        return errors * self.tolerance / allowance


def run_check(oracle, model, held: HeldOutSet, *, tolerance: float = 1e-7,
              bar: float | None = None, absolute_noise: float = 0.0) -> Check:
    """Ask the black box every held-out sequence (one batch per length); compare."""
    with live_queries(oracle):          # held-out checks: kept for no replay
        observed = oracle.query_ragged(held.sequences)
    predicted = evaluate_ragged(model, held.sequences)
    norms = token_norms(held.sequences)
    reference = np.array([f != "hull" for f in held.family])
    # a biased model's output constant c is taken off both sides (here and in _Judge):
    # the errors are then judged against the part that scales with the tokens (a box
    # whose constant differs shows at small tokens, where its f - c does not vanish),
    # and the hull intervals are unchanged by a common shift
    offset = output_offset(model)
    K = output_scale(shifted(observed[reference], offset), norms[reference])
    judge = _Judge(model, K, tolerance, bar, absolute_noise)
    errors = judge(held.sequences, predicted, observed)
    raw = judge.last_raw
    hull = hull_violations(held, shifted(observed, offset), norms)
    family = list(held.family)
    if held.replay:
        # the answer now against the answer the learner was given (root oracle, live)
        root = root_oracle(oracle)
        xs = [x for x, _ in held.replay]
        then = answers_array([y for _, y in held.replay])
        with live_queries(root):
            now = root.query_ragged(xs)
        again = scaled_relative_errors(now, then, token_norms(xs))
        errors, raw = np.concatenate([errors, again]), np.concatenate([raw, again])
        observed, predicted = np.concatenate([observed, now]), np.concatenate([predicted, then])
        family += ["replay"] * len(xs)
    read, reach = verified_domain(model, held.sequences)
    return Check(errors=errors, family=family, hull=hull, observed=observed,
                 predicted=predicted, lengths=(held.lengths[0], reach), norms=read,
                 sent_norms=_norm_range(held.sequences), raw_errors=raw)


def compare_own_probes(oracle, model, check: Check, judge: _Judge) -> None:
    """The learner's longest answered probes (``Oracle.longest_probes``, no new query)
    against the model, added to ``check`` as the ``own`` family. Only for an Oracle
    (or its :class:`attnextract.oracle.ScaledOutputs` view): other views may change what
    their answers mean (:func:`keeps_own_answers`)."""
    if not keeps_own_answers(oracle) or not oracle.longest_probes:
        return
    xs = [x for x, _ in oracle.longest_probes]
    answers = answers_array([y for _, y in oracle.longest_probes])
    errors = judge(xs, evaluate_ragged(model, xs), answers)
    check.errors = np.concatenate([check.errors, errors])
    check.raw_errors = np.concatenate([check.raw_errors, judge.last_raw])
    check.family += ["own"] * len(xs)
    check.own_probes = len(xs)


def _mutants(parent: np.ndarray, rng, longest: int, round_: int, norms=(0.0, math.inf)) -> list:
    """Variants of one sequence (N, d): longer (x4, towards L), tokens larger and smaller
    (x 10^+-(0.5 + round / 4), kept within the design's token norms ``norms``: beyond,
    the model itself is not known), and turned (a random perturbation of 30% of the
    token scale)."""
    N, d = parent.shape
    size = float(np.sqrt(np.mean((parent / max(np.abs(parent).max(), 1e-300)) ** 2))
                 * np.abs(parent).max()) or 1.0
    out = []
    if N < longest:
        M = min(longest, 4 * N if N > 1 else 16)
        extra = parent[rng.integers(0, max(N - 1, 1), M - N)]
        extra = extra + 0.3 * size * rng.standard_normal(extra.shape)
        out.append(np.vstack([parent[:-1], extra, parent[-1:]]))
    up = 10.0 ** (0.5 + 0.25 * round_)
    top = float(_safe_norm(parent).max())
    low = float(_safe_norm(parent).min())
    if top * up <= norms[1]:
        out.append(parent * up)
    if low / up >= norms[0]:
        out.append(parent / up)
    out.append(parent + 0.3 * size * rng.standard_normal(parent.shape))
    return out


def _children(pool: list, rng, longest: int, round_: int, budget: int,
              norms=(0.0, math.inf)) -> list:
    """Exactly ``budget`` variants of the pool's sequences (the best first; random turns
    fill up when the mutations run short)."""
    out = []
    for _, X in pool:
        out += [c for c in _mutants(X, rng, longest, round_, norms) if np.all(np.isfinite(c))]
    i = 0
    while len(out) < budget:
        X = pool[i % len(pool)][1]
        size = float(np.abs(X).max()) or 1.0
        out.append(X + 0.1 * size * rng.standard_normal(X.shape) / math.sqrt(X.shape[1]))
        i += 1
    return out[:budget]


def adversarial_search(oracle, model, check: Check, held: HeldOutSet, judge: _Judge,
                       queries: int, rng) -> None:
    """The ``search`` stage: SEARCH_ROUNDS rounds over length, norm and direction from
    the worst held-out sequences, ``queries`` queries in all (live, counted); adds the
    sequences asked to ``check`` as the ``search`` family."""
    if queries < SEARCH_MIN:
        return
    eligible = [i for i, f in enumerate(held.family) if f != "hull" and len(held.sequences[i]) > 1]
    if not eligible:
        return
    errors = check.errors[:len(held.sequences)]
    domain = check.sent_norms            # the search stays within the design's token norms
    per_round = max(1, queries // SEARCH_ROUNDS)
    parents = [(float(errors[i]), held.sequences[i]) for i in eligible]
    parents.sort(key=lambda p: -p[0] if math.isfinite(p[0]) else -math.inf)
    pool = parents[:max(1, per_round // 4)]
    asked = 0
    all_errors, all_raw, children_asked = [], [], []
    for r in range(SEARCH_ROUNDS):
        budget = queries - asked if r == SEARCH_ROUNDS - 1 else min(per_round, queries - asked)
        children = _children(pool, rng, held.longest, r, budget, domain)
        if not children:
            break
        with live_queries(oracle):
            observed = oracle.query_ragged(children)
        asked += len(children)
        errs = judge(children, evaluate_ragged(model, children), observed)
        all_errors.append(errs)
        all_raw.append(judge.last_raw)
        children_asked += children
        ranked = sorted(pool + list(zip(errs.tolist(), children)),
                        key=lambda p: -p[0] if math.isfinite(p[0]) else -math.inf)
        pool = ranked[:len(pool)]
    if not all_errors:
        return
    errs = np.concatenate(all_errors)
    check.errors = np.concatenate([check.errors, errs])
    check.raw_errors = np.concatenate([check.raw_errors] + all_raw)
    check.family += ["search"] * len(errs)
    check.search_queries = asked
    lo_sent, hi_sent = _norm_range(children_asked)
    check.sent_norms = (min(x for x in (check.sent_norms[0], lo_sent, math.inf) if x > 0)
                        if max(check.sent_norms[0], lo_sent) > 0 else 0.0,
                        max(check.sent_norms[1], hi_sent))
    (lo, hi), reach = verified_domain(model, children_asked)
    check.lengths = (min(check.lengths[0], min(len(c) for c in children_asked)),
                     max(check.lengths[1], reach))
    check.norms = (min(x for x in (check.norms[0], lo) if x > 0) if max(check.norms[0], lo) > 0
                   else 0.0, max(check.norms[1], hi))


@dataclass
class Reasked:
    """Held-out sequences asked again in other batches (:func:`reask_in_other_batches`)."""

    picks: list                 # indices of the re-asked sequences in the held-out set
    alone: np.ndarray           # their answers, each asked alone (a batch of one)
    again: np.ndarray           # their answers at the end of the big batch
    fill: list                  # fresh sequences that filled the big batch
    fill_answers: np.ndarray
    big: int                    # the big batch's size

    @property
    def sizes(self) -> tuple:
        return (1, self.big)

    @property
    def queries(self) -> int:
        return 2 * len(self.picks) + len(self.fill)


def reask_in_other_batches(oracle, sequences, family, rng, scale: float,
                           queries: int) -> Reasked | None:
    """Ask up to BATCH_REASKS held-out sequences of one length (the most common one up
    to BATCH_LONGEST, not hull tokens) again: each alone, and together at the end of a
    batch as large as the learner's largest, within ``queries`` in all (and BATCH_CAP,
    the oracle's max_batch, the budget), filled with fresh Gaussian sequences of that
    length at ``scale`` (x 1/2, 1, 2). None when no sequence qualifies or ``queries``
    is 0."""
    if queries < BATCH_LEAST:
        return None
    root = root_oracle(oracle)
    lengths: dict[int, list[int]] = {}
    for i, (X, name) in enumerate(zip(sequences, family)):
        if name != "hull" and len(X) <= BATCH_LONGEST:
            lengths.setdefault(len(X), []).append(i)
    if not lengths:
        return None
    # the length with the most held-out sequences: its re-asks were first asked together
    n, picks = max(lengths.items(), key=lambda item: (len(item[1]), item[0]))
    # at least one re-ask, and a big batch past BATCH_BIG_MIN - 1 where the share allows
    picks = picks[:max(1, min(BATCH_REASKS, (queries - BATCH_BIG_MIN) // 2))]
    X0 = np.stack([sequences[i] for i in picks])
    k = len(picks)
    # as large as the share allows, within BATCH_CAP (the learner's largest batch where
    # the share reaches it: --verify-sequences buys a larger share)
    big = min(queries - k, BATCH_CAP)
    if getattr(root, "max_batch", None):
        big = min(big, int(root.max_batch))
    left = getattr(root, "remaining", None)
    if left is not None:
        big = min(big, max(k, int(left) - k))
    fill = [max(scale, 1e-300) * rng.choice([0.5, 1.0, 2.0])
            * rng.standard_normal((n, oracle.dim)) for _ in range(max(0, big - k))]
    oracle.require(2 * k + len(fill), "held-out batch-invariance check")
    with live_queries(oracle):
        alone = np.concatenate([np.asarray(oracle.query(X0[j:j + 1])) for j in range(k)])
        together = np.asarray(oracle.query(np.stack(fill + list(X0))))
    return Reasked(picks=picks, alone=alone, again=together[len(fill):], fill=fill,
                   fill_answers=together[:len(fill)], big=len(fill) + k)


def batch_dependence(reasked: Reasked, first, differences, allowed) -> str:
    """Why the re-asked answers show a box whose answers depend on the batch ("" when
    they do not). ``differences(answers)`` measures each re-asked answer against its
    first answer ``first`` (same units as ``allowed``, a number or one per re-ask)."""
    together = np.concatenate([np.ravel(a) for a in (reasked.fill_answers, reasked.again)])
    if (np.count_nonzero(together) >= BATCH_BIG_MIN - 1 and float32_share(together) >= FLOAT32_SHARE
            and float32_share(first) < 0.5):
        return (f"answers in a batch of {reasked.big} are float32 numbers, the same "
                f"sequences' answers in the held-out batches are not: the box's precision "
                f"depends on the batch")
    n = len(reasked.fill[0]) if reasked.fill else None
    for what, answers in (("alone", reasked.alone),
                          (f"at the end of a batch of {reasked.big}", reasked.again)):
        moved = np.asarray(differences(answers), dtype=float)
        over = moved / np.asarray(allowed, dtype=float)
        if float(np.max(over)) > 1.0:
            j = int(np.argmax(over))
            limit = float(np.broadcast_to(np.asarray(allowed, dtype=float), moved.shape)[j])
            return (f"the same sequence{'' if n is None else f' (length {n})'} asked again "
                    f"{what} is answered differently by {float(moved[j]):.2e} (allowed "
                    f"{limit:.0e}, the rounding): the answers depend on the batch, not only "
                    f"on the sequence")
    return ""


def batch_invariance(oracle, model, check: Check, held: HeldOutSet, judge: _Judge,
                     rng, queries: int) -> tuple[str, tuple]:
    """The batch-invariance stage of :func:`verify_model` (see BATCH_REASKS): returns
    (why the answers depend on the batch, or "", the batch sizes compared). The big
    batch's fresh sequences join ``check`` as the ``batch`` family (compared with the
    model)."""
    reasked = reask_in_other_batches(oracle, held.sequences, held.family, rng,
                                     judge.model_scale, queries)
    if reasked is None:
        return "", ()
    if reasked.fill:
        errs = judge(reasked.fill, evaluate_ragged(model, reasked.fill), reasked.fill_answers)
        check.errors = np.concatenate([check.errors, errs])
        check.raw_errors = np.concatenate([check.raw_errors, judge.last_raw])
        check.family += ["batch"] * len(reasked.fill)
        check.batch_queries = len(reasked.fill)
    check.reasks = 2 * len(reasked.picks)
    first = check.observed[:len(held.sequences)]
    firsts = answers_array([first[i] for i in reasked.picks])
    norms = token_norms([held.sequences[i] for i in reasked.picks])
    rounded = answers_look_rounded(check.observed)
    allowed = BATCH_FRACTION * judge.tolerance
    if rounded:
        allowed = max(allowed, BATCH_ROUNDING)

    def differences(answers):
        return scaled_relative_errors(answers_array(list(answers)), firsts, norms, K=judge.K)

    return batch_dependence(reasked, firsts, differences, allowed), reasked.sizes


def replay_precision(check: Check) -> str:
    """Why the replays show a precision that depends on the batch ("" when they do not):
    the learner's answers (asked in its own batches, up to its largest) float32 numbers
    and the same sequences' answers in the check's batches not, or the reverse, over at
    least REPLAY_PRECISION_LEAST nonzero numbers each. No query: the replays are part of
    the check already."""
    replay = np.array([f == "replay" for f in check.family[:len(check.observed)]])
    if not replay.any():
        return ""
    then = check.predicted[:len(replay)][replay]     # run_check keeps them as "predicted"
    now = check.observed[:len(replay)][replay]

    def numbers(answers):
        answers = np.asarray(answers)
        y = (np.concatenate([np.ravel(a) for a in answers]) if answers.dtype == object
             else np.ravel(answers)).astype(float)
        return int(np.count_nonzero(np.isfinite(y) & (y != 0)))

    if min(numbers(then), numbers(now)) < REPLAY_PRECISION_LEAST:
        return ""
    shares = float32_share(then), float32_share(now)
    if max(shares) >= FLOAT32_SHARE and min(shares) < 0.5:
        rounded = "learner's batches" if shares[0] >= FLOAT32_SHARE else "check's batches"
        return (f"the learner's own sequences asked again are float32 numbers in the "
                f"{rounded} only: the box's precision depends on the batch")
    return ""


def keeps_own_answers(oracle) -> bool:
    """Whether ``oracle``'s ``replay`` and ``longest_probes`` are answers in the units the
    model is in: an Oracle, or a :class:`attnextract.oracle.ScaledOutputs` view of one
    (other views may change what a query means)."""
    return isinstance(oracle, Oracle) or (isinstance(oracle, ScaledOutputs)
                                          and isinstance(oracle.base, Oracle))


def measured_error_bar(oracle, model) -> float | None:
    """The model's largest relative error on the answers the learner was given (the
    oracle's ``replay`` sample and ``longest_probes``; no query), at least
    MEASURED_ROUNDING d eps_64; None when ``oracle`` is a learner's view whose answers
    mean something else (:func:`keeps_own_answers`) or kept nothing."""
    if not keeps_own_answers(oracle):
        return None
    pairs = list(oracle.replay) + list(oracle.longest_probes)
    if not pairs:
        return None
    xs = [x for x, _ in pairs]
    answers = answers_array([y for _, y in pairs])
    residual = float(np.max(scaled_relative_errors(evaluate_ragged(model, xs), answers,
                                                   token_norms(xs))))
    return max(residual, MEASURED_ROUNDING * oracle.dim * np.finfo(float).eps)


def misfit_bar(bar: float | None, tolerance: float) -> float | None:
    """A relative error bar measured from a model's misfit to its own answers, as the
    check may use it: None (the flat tolerance, no widening) when it is above
    tolerance / CONSISTENCY_FACTOR, since an impostor's misfit must not widen its own
    allowance (a box with cubic scores passed a layer learner at a stated 0.17 that way).
    """
    return None if bar is None or CONSISTENCY_FACTOR * bar > tolerance else bar


def verify_model(oracle, model, *, count: int, seed=None, tolerance: float | None = None,
                 scale: float | None = None, probe_length: int | None = None,
                 max_length: int | None = None, measure_v: bool = False,
                 expected_error: float | str | None = None, search: bool = True,
                 tolerance_floor: float | None = None, answer_noise: float = 0.0,
                 absolute_noise: float = 0.0, rounded_answers: bool = False):
    """Compare ``model`` with the black box on ``count`` queries: the held-out sequences
    of :func:`design` over lengths 1..L and tiny to huge tokens, for a single head the
    hull pairs, the learner's own longest probes (no query), and the adversarial search
    (SEARCH_SHARE of ``count``). Returns a :class:`attnextract.report.Verification`.

    ``scale`` is the per-coordinate token scale where the model's scores are of order
    one (default :func:`attnextract.report.token_scale`). ``probe_length`` is the
    longest sequence the learner sent (default: the oracle's ``longest``), ``max_length``
    the longest the black box accepts (default: the oracle's ``max_length``): L is
    ``max_length`` when known, else max(DEFAULT_LONGEST, ``probe_length``).
    ``measure_v`` (checking a saved model): first ask the black box's own v (d more
    queries) and put the hull tokens orthogonal to it rather than to the model's v. Up
    to 1/8 of the ``count`` re-ask sequences the learner was answered through this
    oracle (``oracle.replay``): a black box that changed during the run fails there.

    ``expected_error`` e (the learner's own predicted relative parameter error) tightens
    the tolerance to max(CONSISTENCY_FACTOR x e, CONSISTENCY_FLOOR) when that is
    smaller, and widens each sequence's allowance by SENSITIVITY x e x the reach of the
    model's scores on it (:func:`score_reach`); e above MAX_ERROR_BAR is not used (the
    flat tolerance). The errors reported are scaled to the
    tolerance (error x tolerance / allowance). ``expected_error="measured"`` (a learner
    without a bar of its own): e is :func:`measured_error_bar` and the tolerance at
    least MEASURED_FLOOR; a measured e above tolerance / CONSISTENCY_FACTOR is not used
    (an impostor's misfit must not widen the allowance). With exact answers (no
    ``rounded_answers``, ``answer_noise`` or ``absolute_noise``) the widening takes e at
    most tolerance / CONSISTENCY_FACTOR (the bar the tightened tolerance assumes);
    ``rounded_answers`` (a stated precision below float64, or answers rounded to
    decimals) keeps e whole: the box's rounding of its scores grows with them.
    ``tolerance_floor`` replaces
    that floor (re-verifying a saved result: the tolerance its learner was held to).
    ``answer_noise`` (relative, measured by a learner on rounded answers) widens the hull
    check, which holds to the black box's own rounding, to HULL_NOISE times it.
    ``absolute_noise`` a (answers rounded to K decimals: a = 10^-K / 2, in the black
    box's units) widens each sequence's allowance by ABSOLUTE_NOISE_FACTOR a over the
    size its error is relative to (:class:`_Judge`).
    """
    tolerance = DEFAULT_VERIFY_TOLERANCE if tolerance is None else tolerance
    sphere_check = SPHERE_CHECKS.get(getattr(model, "kind", ""))
    if sphere_check is not None:                          # defined on its sphere only
        return sphere_check(oracle, model, count=count, rng=np.random.default_rng(seed),
                            invariance=max(4, int(INVARIANCE_SHARE * count)),
                            tolerance=tolerance, error_bar=expected_error
                            if isinstance(expected_error, (int, float)) else None)
    requested = tolerance
    floor = CONSISTENCY_FLOOR
    if isinstance(expected_error, str):
        if expected_error != "measured":
            raise ValueError(f"expected_error must be a number or 'measured', got {expected_error!r}")
        expected_error, floor = measured_error_bar(oracle, model), MEASURED_FLOOR
        expected_error = misfit_bar(expected_error, tolerance)
    bar = expected_error if expected_error is not None and math.isfinite(expected_error) \
        and 0 <= expected_error <= MAX_ERROR_BAR else None
    if bar is not None:
        floor = floor if tolerance_floor is None else tolerance_floor
        tolerance = min(tolerance, max(CONSISTENCY_FACTOR * bar, floor))
        if not (rounded_answers or answer_noise or absolute_noise):
            # exact answers: a bar above the one the tolerance assumes is a loose bound,
            # and its widening at large scores would hide a box's deviation there
            bar = min(bar, tolerance / CONSISTENCY_FACTOR)
    root = root_oracle(oracle)
    # a stronger coverage statement asked for (--verify-sequences N): never fewer
    count = max(int(count), int(getattr(root, "verify_sequences", None) or 0))
    if max_length is None:
        max_length = getattr(root, "max_length", None)
    if probe_length is None:
        probe_length = getattr(root, "longest", None)
    rng = np.random.default_rng(seed)
    scale = token_scale(model) if scale is None else scale
    hull_v = None
    if measure_v and getattr(model, "kind", "") == "single-head":
        oracle.require(count + oracle.dim, "held-out verification")
        with live_queries(oracle):                 # held-out checks: kept for no replay
            hull_v = oracle.query(np.eye(oracle.dim)[:, None, :])
    replays = min(len(getattr(root, "replay", None) or []), int(REPLAY_FRACTION * count))
    # a small check (24 and more) still searches: SEARCH_MIN queries, 2 a round
    searched = (max(SEARCH_MIN, int(SEARCH_SHARE * count)) if search and count >= 4 * SEARCH_MIN
                else 0)
    replays, searched, design_count, batched = batch_share(replays, searched,
                                                           count - replays - searched)
    held = add_replays(design(oracle.dim, design_count, rng, scale,
                              probe_length=probe_length, max_length=max_length,
                              model=model, hull_v=hull_v), oracle, replays)
    oracle.require(len(held.sequences) + len(held.replay) + searched + batched,
                   "held-out verification")
    check = run_check(oracle, model, held, tolerance=tolerance, bar=bar,
                      absolute_noise=absolute_noise)
    norms = token_norms(held.sequences)
    reference = np.array([f != "hull" for f in held.family])
    offset = output_offset(model)                              # as in run_check
    K = output_scale(shifted(check.observed[:len(held.sequences)][reference], offset),
                     norms[reference])
    judge = _Judge(model, K, tolerance, bar, absolute_noise,
                   model_scale=min(scale, SCALE_CAP * oracle.dim ** -0.25))
    dependence, batch_sizes = batch_invariance(oracle, model, check, held, judge, rng, batched)
    dependence = dependence or replay_precision(check)
    compare_own_probes(oracle, model, check, judge)
    # what the batch check did not use goes to the search (the count is kept exactly)
    searched += batched - check.batch_queries - check.reasks if searched else 0
    adversarial_search(oracle, model, check, held, judge, searched, rng)
    asked = (len(held.sequences) + len(held.replay) + check.search_queries
             + check.batch_queries + check.reasks + (0 if hull_v is None else oracle.dim))
    judged = float(np.max(check.errors)) if check.errors.size else 0.0
    raw = check.raw_errors if check.raw_errors.size == check.errors.size else check.errors
    worst = float(np.max(raw)) if raw.size else 0.0
    # The tolerance printed is one every error met. A model's error bar widens each
    # sequence's allowance by its score reach: where that accepted a larger error than
    # the tolerance, the check states the larger tolerance it achieved (a hidden head
    # at 23x the tolerance passed behind a printed tolerance before); a failed check
    # keeps the tolerance it was judged by (its error exceeds it either way)
    stated = max(tolerance, worst) if judged <= tolerance else tolerance
    # the draws of each family that were asked of the black box (the own probes are the
    # learner's choice, not draws): what the coverage statement rests on
    drawn: dict[str, int] = {}
    for name in check.family:
        if name != "own":
            drawn[name] = drawn.get(name, 0) + 1
    if hull_v is not None:
        drawn["hull"] = drawn.get("hull", 0) + oracle.dim
    # a deviation on a share of every family's inputs (a region of query tokens, say)
    # meets every draw: the whole check's statement
    drawn["all"] = sum(drawn.values())
    if check.reasks:
        drawn[REASKED] = check.reasks      # not draws: out of "all" and the coverage
    return Verification(sequences=asked, family_sequences=drawn,
                        coverage={k: coverage_share(n) for k, n in drawn.items()
                                  if k != REASKED},
                        max_relative_error=worst,
                        median_relative_error=float(np.median(raw)) if raw.size else 0.0,
                        tolerance=stated, judged_tolerance=tolerance, judged_error=judged,
                        batch_dependence=dependence, batch_sizes=batch_sizes,
                        lengths=check.lengths,
                        hull_violation=float(check.hull.max(initial=0.0)),
                        # the hull holds to the box's own rounding, not the model's bar
                        hull_tolerance=max(HULL_FRACTION * requested, HULL_NOISE * answer_noise),
                        worst_family=check.worst_family(), family_errors=check.family_errors(),
                        requested_tolerance=requested if tolerance < requested else 0.0,
                        norms=check.norms, norms_sent=check.sent_norms,
                        max_length=int(held.longest),
                        search_queries=check.search_queries, own_probes=check.own_probes,
                        rounded_answers=answers_look_rounded(check.observed),
                        float32_answers=float32_share(check.observed) >= FLOAT32_SHARE,
                        error_bar=0.0 if bar is None else float(bar))


def merge_verifications(near, far):
    """One :class:`attnextract.report.Verification` of two checks of the same model
    (a Transformer layer's near and far token scales): it passes when both do; its
    tolerance is one every error of both met when both passed (the larger), else the
    tolerance of a check that failed; counts, domains and coverage add up."""
    failed = [v for v in (near, far) if not v.passed]
    tolerance = (min(v.tolerance for v in failed) if failed
                 else max(near.tolerance, far.tolerance))
    drawn = dict(near.family_sequences)
    for name, n in far.family_sequences.items():
        drawn[name] = drawn.get(name, 0) + n
    worst = near if near.max_relative_error >= far.max_relative_error else far

    def lowest(a, b):
        return min(x for x in (a, b, math.inf) if x > 0) if max(a, b) > 0 else 0.0

    return Verification(
        sequences=near.sequences + far.sequences,
        max_relative_error=worst.max_relative_error,
        median_relative_error=max(near.median_relative_error, far.median_relative_error),
        tolerance=tolerance, judged_tolerance=min(near.judged_tolerance or math.inf,
                                                  far.judged_tolerance or math.inf)
        if near.judged_tolerance or far.judged_tolerance else 0.0,
        judged_error=max(near.judged_error, far.judged_error),
        requested_tolerance=max(near.requested_tolerance, far.requested_tolerance),
        lengths=(min(near.lengths[0], far.lengths[0]), max(near.lengths[1], far.lengths[1])),
        norms=(lowest(near.norms[0], far.norms[0]), max(near.norms[1], far.norms[1])),
        norms_sent=(lowest(near.norms_sent[0], far.norms_sent[0]),
                    max(near.norms_sent[1], far.norms_sent[1])),
        max_length=near.max_length,
        search_queries=near.search_queries + far.search_queries,
        own_probes=near.own_probes, error_bar=max(near.error_bar, far.error_bar),
        # the near check's second layer (the hull) and families are kept, not dropped
        hull_violation=max(near.hull_violation, far.hull_violation),
        hull_tolerance=max(near.hull_tolerance, far.hull_tolerance),
        worst_family=worst.worst_family,
        family_errors={**far.family_errors, **near.family_errors},
        rounded_answers=near.rounded_answers or far.rounded_answers,
        float32_answers=near.float32_answers or far.float32_answers,
        family_sequences=drawn,
        coverage={k: coverage_share(n) for k, n in drawn.items() if k != REASKED})


# -- models on a sphere: the pre-LayerNorm heads --------------------------------------
# A pre-LN model is defined on LayerNorm's sphere only: its held-out check draws there,
# then sends rescaled and shifted copies off it, which a box with LayerNorm in front
# cannot tell apart (:func:`verify_on_sphere`).

# held-out check off the sphere: rescaling tokens and shifting them along 1 must leave
# the attention unchanged up to LayerNorm's eps (relative change ~ eps d / R^2)
INVARIANCE_TOLERANCE = 1e-3
INVARIANCE_SHARE = 0.25
# the error bars here are first-order bounds, not estimates: honest held-out errors on the
# sphere were at most 0.035 of the bar (median 0.006; 60 runs, d = 8, 16, 32), so the
# tolerance is tightened to 10 x the bar (the other learners' estimates get 1000 x)
BOUND_FACTOR = 10.0


def held_out_on_sphere(count: int, dim: int, radius: float, rng: np.random.Generator,
                       longest: int) -> tuple[list, list]:
    """Held-out sequences on the sphere and their family: "ordinary" (lengths 1..16, the
    first a single token), "long" (lengths stratified in log over 2..L, L itself first)
    and "close" (tokens a small angle from the last one: their scores differ little, the
    softmax at its most sensitive)."""
    kinds = [("ordinary", "long", "close")[i % 3] for i in range(count)]
    n_long = kinds.count("long")
    grid = length_grid(longest)
    spots = math.log(2) + (math.log(max(longest, 2)) - math.log(2)) * (
        rng.permutation(n_long) + rng.uniform(size=n_long)) / max(n_long, 1)
    long_lengths = list(grid[np.abs(np.log(grid)[None, :] - spots[:, None]).argmin(axis=1)])
    if long_lengths:
        long_lengths[0] = longest
    sequences = []
    for i, kind in enumerate(kinds):
        n = (int(max(long_lengths.pop(), 2)) if kind == "long"
             else 1 if i == 0 else int(rng.integers(1, 17)))
        X = sphere_tokens(n, dim, radius, rng)
        if kind == "close":
            near = X[-1] + rng.uniform(0.01, 0.3) * X
            near -= near.mean(axis=1, keepdims=True)
            X = radius * near / np.linalg.norm(near, axis=1, keepdims=True)
        sequences.append(X)
    return sequences, kinds


def extreme_sequences(model: SphereAttention, rng: np.random.Generator) -> list:
    """Sequences where the model's output is at its extremes on the sphere: the single
    tokens +-R v_hat and +-R w_hat (w = v + r: f([x]) = c + x^T w), and 16 keys near
    +-R v_hat before a random query (the attention output y^T v + c at its ends). A box
    that differs only at large outputs (clipping) shows there if anywhere."""
    d, R = model.dim, model.radius
    v = model.v.sum(axis=0)
    out = []
    for u in (v, v + model.r):
        norm = safe_norm(u)
        if norm > 0:
            out += [R * u[None] / norm, -R * u[None] / norm]
    norm = safe_norm(v)
    if norm > 0:
        for sign in (1.0, -1.0):
            keys = sign * v / norm + 0.05 * sphere_tokens(16, d, 1.0, rng)
            keys -= keys.mean(axis=1, keepdims=True)
            keys = R * keys / np.linalg.norm(keys, axis=1, keepdims=True)
            out.append(np.concatenate([keys, sphere_tokens(1, d, R, rng)]))
    return out


def verify_on_sphere(oracle, model: SphereAttention | VectorSphereAttention, *, count: int,
                     invariance: int,
                     rng: np.random.Generator, tolerance: float,
                     error_bar: float | None = None, extremes=None, residual=None,
                     answers=None) -> Verification:
    """The held-out check of a pre-LN model: ``count`` sequences on its sphere against the
    model, then ``invariance`` of them with every token rescaled (x 1/2 .. 2) and the
    keys shifted along 1 (a box with LayerNorm in front cannot see either, except the
    residual r^T x_N of the rescaled last token), against the box's own answers.

    Errors are relative to the RMS of f - c over the set; the invariance errors are
    scaled by tolerance / INVARIANCE_TOLERANCE (LayerNorm's eps moves them slightly).
    The model's own relative error bar e (``error_bar``) tightens the tolerance on the
    sphere to max(BOUND_FACTOR e, CONSISTENCY_FLOOR), as
    :func:`verify_model` does with its estimates: a model known
    to 1e-12 that misses the box by 1e-8 is not the box's model.

    The same check serves a model answering vectors: ``extremes(model, rng)`` builds its
    extreme sequences (default :func:`extreme_sequences`), ``residual(X)`` is the residual
    term of the last token (default r^T x_N), ``answers(observed)`` reads the box's
    answers (default as they come); a sequence's error is then its largest channel error.
    """
    extremes = extreme_sequences if extremes is None else extremes
    if residual is None:
        if not isinstance(model, SphereAttention):
            raise TypeError("a vector pre-LN model's check needs its residual term R x_N")
        r = model.r

        def residual(X: np.ndarray) -> np.ndarray:
            return X[-1] @ r
    requested = tolerance
    if error_bar is not None and math.isfinite(error_bar) and 0 <= error_bar <= MAX_ERROR_BAR:
        tolerance = min(tolerance, max(BOUND_FACTOR * error_bar, CONSISTENCY_FLOOR))
    d, R = model.dim, model.radius
    root = root_oracle(oracle)
    longest = longest_length(getattr(root, "longest", None), max_length_of(oracle), d)
    extreme = extremes(model, rng)
    sequences, family = held_out_on_sphere(count - len(extreme), d, R, rng, longest)
    sequences, family = sequences + extreme, family + ["extreme"] * len(extreme)
    moved, last_scale = [], rng.uniform(0.5, 2.0, size=invariance)
    for X, lam in zip(sequences[:invariance], last_scale):
        scales = rng.uniform(0.5, 2.0, size=len(X))
        scales[-1] = lam
        shifts = rng.uniform(-1.0, 1.0, size=len(X)) * R / math.sqrt(d)
        shifts[-1] = 0.0                   # the residual would see a shift of x_N along 1
        moved.append(scales[:, None] * X + shifts[:, None])
    oracle.require(count + invariance, "held-out verification on the sphere")
    with live_queries(oracle):
        observed = oracle.query_ragged(sequences + moved)
    if answers is not None:
        observed = answers(observed)
    on_sphere, off_sphere = observed[:count], observed[count:]
    predicted = np.array([model(X) for X in sequences])
    # scale-safe: answers of 1e200 must not overflow into an infinite K (every error 0)
    K = max(safe_rms(on_sphere - model.c), np.finfo(float).tiny)

    def worst(difference):                 # per sequence: the largest channel's error
        difference = np.abs(difference)
        return difference.max(axis=1) if difference.ndim == 2 else difference

    errors = worst(predicted - on_sphere) / K
    grow = (last_scale - 1.0).reshape((-1,) + (1,) * (on_sphere.ndim - 1))
    expected = on_sphere[:invariance] + grow * np.array(
        [residual(X) for X in sequences[:invariance]])
    drift = worst(off_sphere - expected) / K * (tolerance / INVARIANCE_TOLERANCE)
    errors, family = np.concatenate([errors, drift]), family + ["invariance"] * invariance
    family_errors: dict = {}
    for f, e in zip(family, errors):
        family_errors[f] = max(family_errors.get(f, 0.0), float(e))
    lengths = [len(X) for X in sequences]
    norms = [np.linalg.norm(X, axis=1) for X in sequences + moved]
    return Verification(sequences=count + invariance, max_relative_error=float(errors.max()),
                        median_relative_error=float(np.median(errors)), tolerance=tolerance,
                        requested_tolerance=requested if tolerance < requested else 0.0,
                        error_bar=0.0 if error_bar is None else float(error_bar),
                        lengths=(min(lengths), max(lengths)),
                        worst_family=family[int(np.argmax(errors))], family_errors=family_errors,
                        norms=(float(min(n.min() for n in norms)), float(max(n.max() for n in norms))),
                        max_length=longest)


def last_answers(answers) -> np.ndarray:
    """Answers (B, m) at the last position: from (B, m), (B, N, m), or an object array of
    B every-position answers (N_i, m) (sequences of mixed lengths)."""
    answers = np.asarray(answers)
    if answers.dtype == object:
        return np.stack([np.asarray(a, dtype=float)[-1] for a in answers])
    answers = answers.astype(float)
    return answers[:, -1, :] if answers.ndim == 3 else answers


def extreme_vector_sequences(model: VectorSphereAttention, rng: np.random.Generator) -> list:
    """Sequences where the answers are at their extremes on the sphere: single tokens
    +-rho along the top right singular vectors of O P and (R + O) P, and 16 keys near
    +-rho times O's before a random query."""
    d, rho = model.dim, model.radius
    O = model.O.sum(axis=0)
    out = []
    tops = [np.linalg.svd(T)[2][0] for T in (O, O + model.R) if safe_norm(T) > 0]
    for u in tops:
        out += [rho * u[None], -rho * u[None]]
    if safe_norm(O) > 0:
        u = tops[0]
        for sign in (1.0, -1.0):
            keys = sign * u + 0.05 * sphere_tokens(16, d, 1.0, rng)
            keys -= keys.mean(axis=1, keepdims=True)
            keys = rho * keys / np.linalg.norm(keys, axis=1, keepdims=True)
            out.append(np.concatenate([keys, sphere_tokens(1, d, rho, rng)]))
    return out


def verify_vector_on_sphere(oracle, model: VectorSphereAttention, *, count: int,
                            invariance: int, rng: np.random.Generator, tolerance: float,
                            error_bar: float | None = None) -> Verification:
    """The held-out check of a vector pre-LN model: ``count`` sequences on its sphere
    against the model (every channel), then ``invariance`` of them with every token
    rescaled (x 1/2 .. 2) and the keys shifted along 1 against the box's own answers
    (LayerNorm sees neither; the residual R x_N of the rescaled last token is added).

    A sequence's error is its largest channel error relative to the RMS of F - c over
    the set (answers (count, m)); the invariance errors are scaled by tolerance /
    INVARIANCE_TOLERANCE. The model's error bar e tightens the tolerance on the sphere
    to max(BOUND_FACTOR e, CONSISTENCY_FLOOR), as :func:`verify_on_sphere`.
    """
    return verify_on_sphere(oracle, model, count=count, invariance=invariance, rng=rng,
                            tolerance=tolerance, error_bar=error_bar,
                            extremes=extreme_vector_sequences,
                            residual=lambda X: model.R @ X[-1], answers=last_answers)


# the held-out check of each model defined on a sphere of its own, by its kind
SPHERE_CHECKS: dict[str, Callable[..., Verification]] = {
                 "pre-ln-sphere": verify_on_sphere,
                 "vector-pre-ln-sphere": verify_vector_on_sphere}


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
    u = v / safe_norm(v)
    out = []
    for X, target in zip(sequences, targets):
        if not (np.all(np.isfinite(X)) and math.isfinite(target)):
            continue
        reach = (float(np.abs(X @ v).max()) + abs(float(target))) / safe_norm(v) + 1.0
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
                  allowance, longest: int | None = None) -> list:
    """``count`` sequences on which the model answers threshold +- k allowance(X), k
    log-uniform in BOUNDARY_REACH: just clear of its own uncertainty, on both sides.

    A label-only check on random sequences sees a black box only where its labels
    differ from the model's, which for a perturbation of relative size eps is a set of
    measure ~eps around the decision boundary; these sequences sit inside that set, so a
    second head at 1e-8 flips about half of them while an honest black box (whose
    outputs are within the allowance of the model's) flips none. ``allowance(X)`` is the
    model's own output uncertainty on a batch X (B, N, d) -> (B,). ``longest``: the
    longest length used (default DEFAULT_LONGEST; give the black box's max_length).
    """
    # half short, half log-uniform up to L: a box that differs only on long
    # sequences (a sliding window of 64) differs there by O(1), and flips labels here
    top = max(ORDINARY_LENGTH, int(longest or DEFAULT_LONGEST))
    # the long half stratified in log (every stretch up to L gets its share), L itself once
    strata = (rng.permutation(count) + rng.uniform(size=count)) / max(count, 1)
    long = np.exp(np.log(ORDINARY_LENGTH) + strata * np.log((top + 1) / ORDINARY_LENGTH))
    long[np.argmax(strata)] = top
    lengths = np.where(np.arange(count) % 2 == 0, rng.integers(2, ORDINARY_LENGTH + 1, count),
                       long.astype(int))
    if longest:
        lengths = np.minimum(lengths, int(longest))
    seeds = [scale * rng.standard_normal((int(n), model.dim)) for n in lengths]
    on = boundary_shift(model, seeds, np.full(count, float(threshold)))
    k = (np.exp(rng.uniform(np.log(BOUNDARY_REACH[0]), np.log(BOUNDARY_REACH[1]), count))
         * rng.choice([-1.0, 1.0], count))
    room = np.array([float(allowance(X[None])[0]) for X in on])
    # an infinite allowance (a model with unbounded error bars) leaves nothing to check
    keep = np.flatnonzero(np.isfinite(room) & (room > 0))
    moved = boundary_shift(model, [on[i] for i in keep], threshold + k[keep] * room[keep])
    return [X for X in moved if np.all(np.isfinite(X))]
