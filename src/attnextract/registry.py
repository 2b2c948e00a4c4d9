"""One entry point: ``attnextract.extract(oracle, model="low-rank", **options)``.

Every learner is registered here once, by name, with a one-line description; the
command line (``--model``), the Python API and ``attnextract bench`` all go through
this table. A learner is a function ``learner(oracle, *, seed=None,
verify_tolerance=..., **options) -> ExtractionResult``; its options are read from its
signature, so registering one is a single line::

    register("low-rank", "attnextract.learners.low_rank:extract_low_rank",
             "a single head whose W has rank r << d, at d + r(2d - r) queries")

(a ``"module:function"`` string is imported on first use; a function works too).

Two kinds of output are handled here rather than inside a learner, so that no learner
imports another to dispatch:

- ``tolerance=TAU``: the outputs are accurate to +-TAU only; the model's
  ``with_tolerance`` learner runs instead (single-head -> ``noisy``, with error bars).
- ``sign_only=True``: the black box answers labels 1{f(X) > threshold}; the model's
  ``with_sign_only`` learner runs instead (single-head -> ``sign-only``, bisection).
- vector answers: when the oracle's black box answers the output vector (at the last
  position or at every position), the model's ``with_vectors`` learner runs instead
  (single-head -> ``vector-single-head``, ...). A box of unknown kind is found out at
  its first answer: if that is vectors, the scalar learner stops there and the vector
  learner runs (the first batch is counted in the result's queries).

The mathematics of each learner is in ``docs/algorithms.md``.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import logging
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from .errors import (
    AttnExtractError,
    InputError,
    ModelMismatchError,
    RecoveryFailedError,
    RefusalWithResult,
    VectorAnswersFound,
)
from .oracle import QueryAccess, root_oracle
from .precision import check_precision_options, detect_precision, name_the_options, stated_precision
from .report import ExtractionResult
from .verification import answers_array, answers_look_rounded

log = logging.getLogger(__name__)

# added to a refusal by a learner that can model biases but was not asked to
BIASES_HINT = ("a black box with query, value or output biases (as deployed layers have, "
               "e.g. f([0]) != 0) is outside the bias-free class: extract with --biases "
               "(API: biases=True)")
# ... when the box answered one zero token with 0 (no value or output bias)
QUERY_BIASES_HINT = ("the black box answers 0 for one zero token, so it adds no constant "
                     "(no value or output bias), but query biases alone (as deployed layers "
                     "have) also put a box outside the bias-free class: extract with "
                     "--biases (API: biases=True)")

# learners that detect float16/float32 answers but not rounding to K decimals: their
# refusals of answers that are all multiples of 10^-K name --decimals K first
DETECTS_NO_DECIMALS = ("multi-head",)

# keyword arguments every learner takes; not "options"
COMMON = ("oracle", "seed", "verify_tolerance")


@dataclass
class Learner:
    """A registered learner: name, function (or "module:function"), description.

    ``with_tolerance`` / ``with_sign_only`` name the learner that replaces this one
    when the outputs are noisy (``tolerance=`` given) or labels (``sign_only=True``).
    """

    name: str
    target: Callable | str
    description: str
    with_tolerance: str | None = None
    with_sign_only: str | None = None
    with_vectors: str | None = None  # the learner for boxes that answer vectors
    vectors: bool = False           # this learner reads vector answers
    hidden: bool = False            # a variant reached through tolerance= / sign_only=
    _function: Callable | None = field(default=None, repr=False)

    @property
    def function(self) -> Callable:
        if self._function is None:
            if callable(self.target):
                self._function = self.target
            else:
                module, _, name = self.target.partition(":")
                self._function = getattr(importlib.import_module(module), name)
        return self._function

    @property
    def options(self) -> dict[str, object]:
        """Keyword options the learner takes (beyond seed, verify_tolerance): name -> default."""
        params = inspect.signature(self.function).parameters.values()
        return {p.name: (None if p.default is inspect.Parameter.empty else p.default)
                for p in params if p.name not in COMMON
                and p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)}

    def __repr__(self) -> str:
        return f"<learner {self.name}: {self.description}>"


LEARNERS: dict[str, Learner] = {}


def register(name: str, target: Callable | str, description: str, **settings: Any) -> Learner:
    """Register (or replace) the learner ``name``; see :class:`Learner` for ``settings``."""
    LEARNERS[name] = Learner(name, target, description, **settings)
    return LEARNERS[name]


def learner_names(hidden: bool = False) -> list[str]:
    """Registered model names, sorted (variants reached by tolerance/sign_only if ``hidden``)."""
    return sorted(n for n, entry in LEARNERS.items() if hidden or not entry.hidden)


def get_learner(name: str) -> Learner:
    """The registered learner ``name``; an unknown name suggests the closest one."""
    if name in LEARNERS:
        return LEARNERS[name]
    close = difflib.get_close_matches(name, list(LEARNERS), n=1, cutoff=0.5)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    raise InputError(f"unknown model {name!r}{hint} (known: {', '.join(learner_names())})")


def resolve(model: str = "single-head", *, tolerance: float | None = None, sign_only: bool = False,
            outputs: str | None = None) -> Learner:
    """The learner that runs for ``model`` given the kind of outputs (noisy, labels,
    vectors: ``outputs`` "last" or "all", see :class:`attnextract.oracle.Oracle`)."""
    entry = get_learner(model)
    if outputs in ("last", "all") and not entry.vectors:
        if sign_only:
            raise InputError("sign-only answers are labels, one per sequence; this black box "
                             "answers vectors")
        if entry.with_vectors is None:
            raise InputError(f"the black box answers vectors ({outputs} position"
                             f"{'s' if outputs == 'all' else ''}); {model!r} reads one number "
                             f"per sequence. Vector learners: "
                             f"{', '.join(n for n in learner_names() if LEARNERS[n].vectors)}")
        return get_learner(entry.with_vectors)
    if outputs in ("scalar",) and entry.vectors:
        raise InputError(f"{model!r} reads vector answers; this black box answers one number "
                         f"per sequence (use {_scalar_twin(model) or 'a scalar learner'})")
    if sign_only:
        if tolerance is not None:
            raise InputError("sign-only answers are labels: tolerance does not apply")
        if entry.with_sign_only is None and model != "sign-only":
            raise InputError(f"sign-only outputs are supported for "
                             f"{_supporting('with_sign_only')}, not {model!r}")
        return get_learner(entry.with_sign_only or model)
    if tolerance is not None and "tolerance" not in entry.options:
        if entry.with_tolerance is None:
            raise InputError(f"tolerance applies to {_supporting('with_tolerance')}, "
                             f"not {model!r}")
        return get_learner(entry.with_tolerance)
    return entry


def _scalar_twin(name: str) -> str | None:
    """The scalar learner whose vector twin ``name`` is."""
    return next((repr(n) for n, e in LEARNERS.items() if e.with_vectors == name), None)


def _vector_tolerance(entry: Learner, tolerance: float | None, options: dict[str, Any]) -> None:
    """Vector learners take ``tolerance`` as their own option (noisy vector answers),
    put in ``options``; the scalar dispatch then gets none."""
    if tolerance is not None:
        if "tolerance" not in entry.options:
            raise InputError(f"tolerance does not apply to {entry.name!r}")
        options["tolerance"] = tolerance
    return None


def _supporting(attribute: str) -> str:
    names = [n for n, e in LEARNERS.items() if getattr(e, attribute)]
    return " and ".join(repr(n) for n in names) or "no registered model"


def _answers_may_be_rounded(root: Any) -> bool:
    """Whether a refusal may be a precision problem: the oracle's kept answers (its replay
    sample) show rounding, or too few were asked to tell. Float64 answers of a box that
    was refused are a mismatch: naming --output-dtype there invites loosening the check on
    an impostor."""
    answers = [answer for _, answer in getattr(root, "replay", [])]
    # answers_array: every-position answers of different lengths are ragged
    return len(answers) < 4 or answers_look_rounded(answers_array(answers))


def _zero_token_answers(root: Any) -> tuple[float, float] | None:
    """The black box's answers to one zero token, asked twice in one batch (0 for
    attention without biases, c with them; two different answers: the box is not
    deterministic), live after a refusal; None when they cannot be asked (budget,
    failure)."""
    try:
        first, second = root.query(np.zeros((2, 1, root.dim)), live=True)
    except (AttnExtractError, AttributeError, TypeError, ValueError):
        return None
    return float(first), float(second)


def _detected_decimals(root: Any) -> int | None:
    """K when every kept answer of the root oracle (at least 4 nonzero ones) is a
    multiple of 10^-K (K <= 12) and not a float16/float32 number: the box rounds its
    answers to K decimals. None otherwise."""
    answers = [answer for _, answer in getattr(root, "replay", [])]
    if len(answers) < 4:
        return None
    return detect_precision(np.array(answers)).decimals


def extract(oracle: QueryAccess, model: str = "single-head", *, seed: int | None = None,
            verify_tolerance: float | None = None, tolerance: float | None = None,
            sign_only: bool = False, **options: Any) -> ExtractionResult:
    """Extract ``model`` from the black box behind ``oracle``.

    Parameters
    ----------
    oracle : Oracle
        Door to the black box; ``oracle.dim`` is the token width d.
    model : str
        A registered learner: ``"single-head"``, ``"low-rank"``, ``"multi-head"``,
        ``"one-layer"``, ``"one-layer-residual"``, ``"relu-network"``, ... (see
        :func:`learner_names`). A misspelled name suggests the closest one.
    seed : int, optional
        Seed of the learner's random choices and of the held-out verification.
    verify_tolerance : float, optional
        Largest held-out relative output error accepted as a match (default 1e-7;
        for noisy and sign-only outputs, extra relative slack beyond the stated noise,
        default 0).
    tolerance : float, optional
        The outputs are accurate to +-tolerance: the model's noisy learner runs.
    sign_only : bool
        The black box answers labels 1{f(X) > threshold}: the model's sign-only learner.
    **options
        The learner's own options (``rank``, ``method``, ``heads``, ``polish``, ``bits``,
        ...); an option the learner does not take is an :class:`InputError`.

    Returns
    -------
    ExtractionResult
        With ``options`` recording the model and the options used (saved with it).
    """
    root = root_oracle(oracle)
    first, checks = getattr(root, "queries", 0), getattr(root, "check_queries", 0)
    try:
        return _extract(oracle, model, seed=seed, verify_tolerance=verify_tolerance,
                        tolerance=tolerance, sign_only=sign_only, **options)
    except RefusalWithResult as exc:
        # a refusal reports every query the box answered for it: the learner's, the
        # journal's checks, and what was asked after the learner stopped (the zero token
        # that tells a constant)
        result = getattr(exc, "result", None)
        if result is not None and isinstance(getattr(root, "queries", None), int):
            spent = root.queries - first + getattr(root, "check_queries", 0) - checks
            result.queries = result.report.queries = spent
        raise


def _count_the_whole_check(result: ExtractionResult, span: int) -> None:
    """A learner's report names the verification count it planned; the check may ask
    another (``--verify-sequences``; a batch-invariance share the batch limits cut): the
    breakdown says what it asked, and the result counts every query the learner's run
    sent (``span``)."""
    report = result.report
    check = report.verification
    planned = report.breakdown.get("verification")
    if check is not None and isinstance(planned, int) and check.sequences != planned:
        report.breakdown["verification"] = int(check.sequences)
    if report.queries < span:
        result.queries += span - report.queries
        report.queries = span


def _extract(oracle: QueryAccess, model: str = "single-head", *, seed: int | None = None,
             verify_tolerance: float | None = None, tolerance: float | None = None,
             sign_only: bool = False, **options: Any) -> ExtractionResult:
    """:func:`extract` itself (the refusal's count is completed by the caller)."""
    root = root_oracle(oracle)
    entry = resolve(model, tolerance=tolerance, sign_only=sign_only,
                    outputs=getattr(root, "outputs", None))
    if entry.vectors:
        _vector_tolerance(entry, tolerance, options)
        tolerance = None                  # the vector learner's own option now
    accepted = entry.options
    if tolerance is not None:
        options["tolerance"] = tolerance
    stray = sorted(set(options) - set(accepted))
    if stray:
        raise InputError(f"option {stray[0]!r} does not apply to model {entry.name!r} "
                         f"(its options: {', '.join(sorted(accepted)) or 'none'})")
    # the progress display draws solver iterations when the learner reports them
    fitting = getattr(getattr(oracle, "progress", None), "fitting", None)
    if "fit_progress" in accepted and options.get("fit_progress") is None and fitting:
        options["fit_progress"] = fitting
    if verify_tolerance is not None:
        options["verify_tolerance"] = verify_tolerance
    log.info("extracting %s (learner %s) at d = %d with %s", model, entry.name, oracle.dim,
             {k: v for k, v in options.items() if k != "fit_progress"} or "default options")
    # a journal's fingerprint queries are the box's answers too: counted in the result
    checks = getattr(root, "check_queries", 0)
    held_out = getattr(root, "held_out_journal_queries", 0)
    if "output_dtype" in accepted:         # bad values, or both: refused before any query
        check_precision_options(options.get("output_dtype"), options.get("decimals"))
    sent = first_sent = getattr(root, "queries", 0)
    spent = 0                   # queries of a scalar learner before vectors were found
    try:
        if getattr(root, "outputs", "") is None and entry.with_vectors and not sign_only:
            root.detect_vectors = True
        try:
            result = entry.function(oracle, seed=seed, **options)
        except VectorAnswersFound:
            root.detect_vectors = False
            spent = root.queries - sent
            assert entry.with_vectors is not None     # only then are vectors detected
            vector = get_learner(entry.with_vectors)
            log.info("the black box answers vectors: %s runs instead of %s (%d queries spent "
                     "finding out)", vector.name, entry.name, spent)
            options = {k: v for k, v in options.items() if k in vector.options
                       or k == "verify_tolerance"}
            entry = vector
            sent = root.queries
            result = entry.function(oracle, seed=seed, **options)
        finally:
            if hasattr(root, "detect_vectors"):
                root.detect_vectors = False
    except RefusalWithResult as exc:
        if getattr(root, "queries", 0) == sent:
            # refused before any query (a limit of the learner's, such as heads > d): the
            # box was not asked, so no hint about its precision or biases applies, and
            # no zero token is sent to find one
            raise
        decimals = None
        if "output_dtype" in accepted:     # a learner that can be told the precision
            stated = stated_precision(options.get("output_dtype"), options.get("decimals"))
            if stated is None and entry.name in DETECTS_NO_DECIMALS:
                decimals = _detected_decimals(root)
            if decimals is not None and exc.args and isinstance(exc.args[0], str):
                # measured: every answer is a multiple of 10^-K; say so first (the
                # learner, not told, judged them as float64 answers)
                exc.args = (f"every answer is a multiple of 1e-{decimals}: if the black box "
                            f"rounds its outputs to {decimals} decimals, say so with "
                            f"--decimals {decimals} (API: decimals={decimals}); this learner "
                            f"does not detect decimals by itself, and stopped at: "
                            f"{exc.args[0]}",) + exc.args[1:]
            elif stated is not None or _answers_may_be_rounded(root):
                name_the_options(exc, stated)
        # (a vector learner detects biases itself: c = F([0]) is one of its answers)
        if (isinstance(exc, (ModelMismatchError, RecoveryFailedError)) and "biases" in accepted
                and not entry.vectors and not options.get("biases") and exc.args
                and decimals is None):
            zero = _zero_token_answers(root)
            if zero is not None and zero[0] != zero[1]:
                # measured: the same sequence got two answers; a constant cannot be told
                raise ModelMismatchError(
                    f"the black box answers one zero token twice with different numbers "
                    f"({zero[0]:.6g} and {zero[1]:.6g}): its answers are not a function of "
                    f"the sequence (noise, sampling or state), which is outside every exact "
                    f"class; noisy outputs are extracted with --tolerance (single-head); "
                    f"the learner had stopped at: {exc.args[0]}",
                    result=getattr(exc, "result", None)) from exc
            constant = zero[0] if zero is not None else None
            if constant:
                # measured: the box adds a constant, so it is outside the bias-free class,
                # whatever the learner's own stage said when it stopped
                raise ModelMismatchError(
                    f"the black box answers {constant:.6g} for one zero token, where "
                    f"attention without biases answers 0: it adds a constant (value or "
                    f"output biases, as deployed layers and trained PyTorch modules have) "
                    f"and is outside the bias-free class: extract with --biases (API: "
                    f"biases=True); the bias-free learner had stopped at: {exc.args[0]}",
                    result=getattr(exc, "result", None)) from exc
            if ((isinstance(exc, ModelMismatchError) or getattr(exc, "box_may_be_outside", False))
                    and not getattr(exc, "biases_ruled_out", False)):
                # f([0]) = 0 rules out a constant; a query bias is still possible where the
                # answers are not the class's (a mismatch) or may not be (a fit failure the
                # learner could not place); not on a refusal of the learner's own (an
                # error bar above max_error_bar, its limit at a rounding): the answers fit
                hint = BIASES_HINT if zero is None else QUERY_BIASES_HINT
                told = options.get("heads")
                if isinstance(told, int) and not isinstance(told, bool):
                    # told H: a box with more heads than H fails the same way, and is the
                    # likelier reading than biases when nothing rules either out
                    hint = (f"if the black box has more than {told} head"
                            f"{'s' if told > 1 else ''}, give a larger --heads (API: heads=), "
                            f"or leave it out to have the heads counted; otherwise {hint}")
                exc.args = (f"{exc.args[0]}; {hint}",) + exc.args[1:]
        raise
    _count_the_whole_check(result, getattr(root, "queries", sent) - sent)
    numbers, tokens = getattr(root, "numbers", None), getattr(root, "tokens", None)
    if (numbers is not None and tokens is not None
            and getattr(root, "outputs", None) not in (None, "scalar")):
        # vector answers: the cost in the three units (sequences, numbers, tokens)
        result.report.details.setdefault("numbers received", int(numbers))
        result.report.details.setdefault("tokens sent", int(tokens))
    if spent:
        if result.queries + spent <= root.queries - first_sent:
            # a learner counting its own queries only: the first batch is spent too
            result.queries += spent
            result.report.queries += spent
        result.report.breakdown["answers found to be vectors"] = spent
        result.report.notes.append(
            f"{spent} queries were spent before the answers were found to be vectors; "
            f"state the kind of answers (--outputs last|all, API: Oracle(..., outputs=...)) "
            f"to save them")
    answered = getattr(root, "held_out_journal_queries", 0) - held_out
    if answered:
        result.report.notes.append(
            f"{answered} of the held-out verification's answers came from the journal "
            f"{getattr(root.journal, 'path', '')} (recorded by an earlier run against a black "
            f"box that answers the journal's checks the same now); the journal vouches for "
            f"them, not the live black box: attnextract verify without --journal asks it")
    fingerprint = getattr(root, "check_queries", 0) - checks
    if fingerprint:
        result.queries += fingerprint
        result.report.queries += fingerprint
        result.report.breakdown["journal fingerprint"] = fingerprint
    result.options = {"model": entry.name, "seed": seed,
                      **{k: v for k, v in options.items() if k != "fit_progress"}}
    if hasattr(root, "settle_progress"):
        root.settle_progress()          # the bar ends at what was sent, not at the plan
    return result


# -- the learners ---------------------------------------------------------------------
# one line each; another branch adds its learner with one more register(...) call.
_L = "attnextract.learners."
register("single-head", _L + "single_head:extract_single_head",
         "one attention head, W (d, d) and v (d,), exactly at d^2 + d queries",
         with_tolerance="noisy", with_sign_only="sign-only", with_vectors="vector-single-head")
register("low-rank", _L + "low_rank:extract_low_rank",
         "one head whose W has rank r << d, at d + r(2d - r) queries (or the single-head paper's ROP)",
         with_vectors="vector-single-head")
register("multi-head", _L + "multi_head:extract_multi_head",
         "H heads summed, recovered up to the canonical form (copy-count probes)",
         with_vectors="vector-multi-head")
register("vector-multi-head", _L + "vector_multi_head:extract_vector_multi_head",
         "H full-rank heads from vector answers (overlapping O_h ranges): shared "
         "sigmoid steps read across all m channels", vectors=True)
register("relu-network", _L + "relu_network:extract_relu_network",
         "a one-hidden-layer ReLU network on single tokens")
register("one-layer", _L + "one_layer:extract_one_layer",
         "a one-layer Transformer: attention head then ReLU feed-forward")
register("one-layer-residual", _L + "residual:extract_one_layer_residual",
         "a one-layer Transformer with a residual connection")
register("multi-head-low-rank", _L + "multi_head_low_rank:extract_multi_head_low_rank",
         "H low-rank heads summed, like a real layer (H r <= d), at about the floor "
         "H(d + r(2d - r))", with_vectors="vector-layer")
register("transformer-layer", _L + "transformer_layer:extract_transformer_layer",
         "multi-head attention then a ReLU feed-forward network, biases detected "
         "(optionally residual)")
register("pre-ln", _L + "pre_layer_norm:extract_pre_layer_norm",
         "a pre-LayerNorm attention block (GPT-2 style) on the sphere where LayerNorm is "
         "affine: one head at d^2 + d - 1 queries, or H heads (heads=H)",
         with_vectors="vector-pre-ln")
register("noisy", _L + "noisy:extract_noisy",
         "one head from outputs accurate to +-tolerance, with error bars", hidden=True,
         with_vectors="vector-single-head")
register("sign-only", _L + "sign_only:extract_sign_only",
         "one head from labels 1{f(X) > threshold}, by bisection", hidden=True)
register("low-precision", _L + "noisy:extract_low_precision",
         "one head from a forward pass in float32/bfloat16/float16 or outputs rounded to "
         "k decimals, error bars from repeated dithered probes", hidden=True,
         with_vectors="vector-single-head")
register("vector-single-head", _L + "vector_single_head:extract_vector_single_head",
         "one head from vector answers (last or every position): W, b, O, c in 2d + 2 "
         "queries (d + 2 at every position)", vectors=True)
register("vector-layer", _L + "vector_layer_positions:extract_standard_layer",
         "a standard attention layer from vector answers (heads with independent output "
         "ranges, biases): every head's W_h, b_h, O_h and c (the scores read at every "
         "position when the box answers every position)", vectors=True)
register("vector-pre-ln", _L + "vector_pre_layer_norm:extract_vector_pre_layer_norm",
         "a pre-LayerNorm attention block answering vectors (last position, residual R "
         "x_N or none), on the sphere where LayerNorm is affine: one head at 4d - 3 queries, "
         "or H heads with independent output ranges (heads=H)",
         vectors=True)
