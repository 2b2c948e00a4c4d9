"""Extraction results, held-out verification, reports and result files.

Every learner returns an :class:`ExtractionResult`: the recovered model, the number
of queries it rests on, and a :class:`Report` with the query breakdown, the floor,
timing and the held-out :class:`Verification` against the black box.

``result.save(path)`` writes one ``.npz`` file (the model's arrays, the query count,
the report as JSON and the options the learner ran with);
``ExtractionResult.load(path)`` reads all of it back, ``load_model(path)`` the model
only. ``Report.to_dict()`` is for programs (snake_case keys, numbers, ranges as
[lo, hi], ``schema_version``); ``str(report)`` is for people.
"""

from __future__ import annotations

import html
import json
import math
import os
import re
import zipfile
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Generic, TypeVar

import numpy as np

from .errors import InputError, ModelMismatchError, TargetLoadError
from .models import MODEL_CLASSES, Regressor
from .numerics import looks_like_rounding, safe_norm
from .oracle import evaluate_ragged

# the check's outcome and its defaults belong to verification.py; results and learners
# read them here, beside the report they go into
from .verification import (  # noqa: F401
    COVERAGE_CONFIDENCE,
    DEFAULT_VERIFY_TOLERANCE,
    MAX_VERIFY_LENGTH,
    Verification,
    coverage_share,
    draws_for_coverage,
    token_scale,
    verify_model,
)

REPORT_SCHEMA_VERSION = 2      # to_dict(): snake_case keys, numbers, ranges as [lo, hi]


VERIFY_COUNT = 64             # held-out queries of a full check (or 1% of the parameters)
VERIFY_SHARE = 0.05           # ... at most this share of the recovery's queries, when given,
# ... but never fewer: every family and the search (24), and the batch check (10 more)
MIN_VERIFY_COUNT = 34


def verification_count(free_parameters: int, recovery_queries: int | None = None) -> int:
    """Held-out queries: max(64, 1% of the parameter count).

    ``recovery_queries`` (a learner whose recovery is cheap: a single head, low rank,
    noisy) caps the count at VERIFY_SHARE = 5% of them, but never below
    MIN_VERIFY_COUNT = 34, the smallest check that still holds every family of
    :func:`attnextract.verification.design`, the adversarial search (6 queries) and the
    batch-invariance check (BATCH_SMALL = 10: a box computing large batches another way
    is seen by every check). A single head at d = 32 (1,056 queries) gets 52, a rank-8
    head at d = 32 (480) 34; d = 8 (72 queries) 34. Pass a lower bound on the recovery
    (its floor), so that the share holds whatever rescaling the learner adds.
    """
    full = max(VERIFY_COUNT, free_parameters // 100)
    if recovery_queries is None:
        return full
    return max(MIN_VERIFY_COUNT, min(full, int(VERIFY_SHARE * recovery_queries)))


def held_out_batches(dim: int, count: int, rng: np.random.Generator, scale: float = 1.0,
                     max_length: int = MAX_VERIFY_LENGTH) -> list[tuple[np.ndarray, np.ndarray]]:
    """Random Gaussian sequences, lengths 1..max_length, scales scale * {1/2, 1, 2}, by length.

    Returns [(indices, batch (b, N, d))], one entry per length N: sequence i of the
    ``count`` is ``batch[k]`` where ``indices[k] == i``.
    """
    lengths = rng.integers(1, max_length + 1, size=count)
    scales = scale * rng.choice([0.5, 1.0, 2.0], size=count)
    batches = []
    for n in np.unique(lengths):
        idx = np.flatnonzero(lengths == n)
        batch = rng.standard_normal((len(idx), int(n), dim))
        batch *= scales[idx, None, None]
        batches.append((idx, batch))
    return batches


def held_out_sequences(dim: int, count: int, rng: np.random.Generator, scale: float = 1.0,
                       max_length: int = MAX_VERIFY_LENGTH) -> list[np.ndarray]:
    """The sequences of :func:`held_out_batches` as a list (N_i, d), in order."""
    out: list[Any] = [None] * count          # every entry is set below
    for idx, batch in held_out_batches(dim, count, rng, scale, max_length):
        for i, x in zip(idx, batch):
            out[i] = x
    return out


def relative_errors(predicted: np.ndarray, observed: np.ndarray) -> np.ndarray:
    """|predicted - observed| / max(|observed|, rms(observed)) per sequence."""
    rms = math.sqrt(float(np.mean(observed ** 2))) if observed.size else 0.0
    denom = np.maximum(np.abs(observed), max(rms, np.finfo(float).tiny))
    return np.abs(predicted - observed) / denom


def held_out_output_error(recovered: Callable[[np.ndarray], Any], truth: Regressor, *,
                          count: int = 256, seed: int | None = 0) -> float:
    """Largest :func:`relative_errors` of ``recovered`` against a known ``truth`` model on
    ``count`` held-out sequences at the truth's token scale (bench and tests; one batch
    per length)."""
    sequences = held_out_sequences(truth.dim, count, np.random.default_rng(seed),
                                   token_scale(truth))
    return float(relative_errors(evaluate_ragged(recovered, sequences),
                                 evaluate_ragged(truth, sequences)).max())


@dataclass
class Report:
    """What an extraction did and measured."""

    kind: str
    dim: int
    queries: int
    breakdown: dict[str, int]
    floor: int
    verification: Verification | None
    seconds: float
    black_box_seconds: float
    notes: list[str] = field(default_factory=list)
    details: dict = field(default_factory=dict)
    # recovery queries when the breakdown's parts are not split that way (one-layer:
    # ffn + attention + verification, each part with its own checks)
    recovery: int | None = None

    @property
    def learner_seconds(self) -> float:
        return max(self.seconds - self.black_box_seconds, 0.0)

    @property
    def recovery_queries(self) -> int:
        """Queries spent on recovery (not on the final held-out verification)."""
        if self.recovery is not None:
            return self.recovery
        return self.breakdown.get("recovery", self.queries - self.breakdown.get("verification", 0))

    def to_dict(self) -> dict:
        """The report for programs: snake_case keys holding numbers, ``schema_version`` 2.

        Detail values written for people ("0.0156 .. 1.41", "0.177 (every probe)") become
        numbers or [lo, hi] lists; other text stays text. ``str(report)`` is unchanged.
        """
        out = asdict(self)
        out["schema_version"] = REPORT_SCHEMA_VERSION
        out["breakdown"] = {snake_case(k): v for k, v in self.breakdown.items()}
        out["details"] = {snake_case(k): machine_value(v) for k, v in self.details.items()}
        out["recovery_queries"] = self.recovery_queries
        del out["recovery"]
        out["learner_seconds"] = self.learner_seconds
        if self.verification is not None:
            out["verification"]["passed"] = self.verification.passed
            out["verification_error"] = self.verification.max_relative_error
        return _jsonable(out)

    def state(self) -> dict:
        """Every field as given (for :meth:`from_state`: an exact round trip)."""
        return _jsonable(asdict(self))

    @classmethod
    def from_state(cls, state: dict) -> "Report":
        state = dict(state)
        if state.get("verification") is not None:
            fields = Verification.__dataclass_fields__
            check = {k: v for k, v in state["verification"].items() if k in fields}
            check["lengths"] = tuple(check.get("lengths", (1, MAX_VERIFY_LENGTH)))
            check["norms"] = tuple(check.get("norms", (0.0, 0.0)))
            check["norms_sent"] = tuple(check.get("norms_sent", (0.0, 0.0)))
            check["batch_sizes"] = tuple(check.get("batch_sizes", ()))
            state["verification"] = Verification(**check)
        known = cls.__dataclass_fields__
        return cls(**{k: v for k, v in state.items() if k in known})

    def __str__(self) -> str:
        return self.render()

    def __repr__(self) -> str:
        check = ("not verified" if self.verification is None else
                 f"held-out error {self.verification.max_relative_error:.1e} "
                 f"{'PASSED' if self.verification.passed else 'FAILED'}")
        return (f"<Report {self.kind} d={self.dim}: {self.queries} queries (floor {self.floor}), "
                f"{check}, {self.seconds:.3g} s>")

    def render(self, extra: Sequence[tuple[str, str]] = (), *, verbose: bool = False) -> str:
        """The report for people: aligned labels in words, numbers to 3 significant digits.

        By default the headline in at most 15 lines (:meth:`rows`); ``verbose`` adds every
        measurement the learner kept (the CLI's ``-v``). Exact counts stay integers;
        ``to_dict()`` (``--json``) keeps everything at full precision. ``extra`` rows
        (label, text) are appended in the same columns (the CLI's ``wrote FILE``)."""
        rows = self.rows(verbose) + list(extra)
        column = min(max(len(label) for label, _ in rows), LABEL_WIDTH) + 2
        return "\n".join((f"{label:<{column}}" if len(label) < column else label + "  ")
                         + text for label, text in rows)

    def _repr_html_(self) -> str:
        """A notebook's view: the headline rows as a table, every row folded below it."""
        full = self._full_rows()
        return (_html_table(self.rows()) + f"<details><summary>every row ({len(full)}: the "
                f"query breakdown, the check's families, the learner's measurements)</summary>"
                + _html_table(full) + "</details>")

    def rows(self, verbose: bool = False) -> list[tuple[str, str]]:
        """(label, text) rows of :meth:`render`: by default the model, the queries, the
        floor, the check and its domain, the time, what was found (heads, rank, error
        bar; :data:`HEADLINE_DETAILS`), the journal and up to :data:`HEADLINE_NOTES`
        notes, then one row counting what ``verbose`` would add."""
        full = self._full_rows()
        if verbose:
            return full
        v = self.verification
        named = {"recovery": self.recovery_queries,
                 "held-out verification": self.breakdown.get("verification", 0),
                 **{name: n for name, n in self.breakdown.items() if name in BRIEF_PARTS}}
        named["other (-v: the breakdown)"] = self.queries - sum(named.values())
        parts = [f"{n} {name}" for name, n in named.items() if n > 0 or name == "recovery"]
        rows = [full[0], ("queries", f"{self.queries} in all: {', '.join(parts)}")]
        rows += [row for row in full if row[0] in ("floor", "verification", "verified domain")]
        if v is not None and v.batch_dependence:
            rows.append(("batch invariance", v.batch_dependence))
        rows += [row for row in full if row[0] == "time"]
        found = [(human_label(key), human_value(value)) for key, value in self.details.items()
                 if key in HEADLINE_DETAILS]
        rows += found[:HEADLINE_ROWS]
        if "journal" in self.details:
            rows.append(("journal", f"{self.details['journal']} ("
                                    f"{self.details.get('black_box_queries', 0)} answered by "
                                    f"the black box, {self.details.get('journal_queries', 0)} "
                                    f"by the journal)"))
        rows += [("note", n) for n in self.notes[:HEADLINE_NOTES]]
        hidden = sum(1 for row in full if row not in rows)
        if hidden:
            rows.append(("more", f"{hidden} more rows (query breakdown, check families, "
                                 f"measurements): -v, or --json / report.to_dict()"))
        return rows

    def _full_rows(self) -> list[tuple[str, str]]:
        """Every row: the breakdown, the check's families, every detail the learner kept."""
        v = self.verification
        rows: list[tuple[str, str]] = [("model", f"{self.kind}, d = {self.dim}"),
                                       ("queries", f"{self.queries} in all")]
        width = max([len(str(n)) for n in self.breakdown.values()] + [1])
        rows += [("", f"{n:>{width}}  {name}") for name, n in self.breakdown.items()]
        recovery = ("recovery used" if self.recovery is None else
                    f"recovery ({self.recovery} queries, the parts' own checks left out) used")
        # vector learners state their parameter count: their floor is in queries
        what = ("free parameters" if "parameters" not in self.details else
                f"queries ({self.details['parameters']} free parameters over the numbers "
                f"one query brings)")
        rows.append(("floor", f"{self.floor} {what}; {recovery} "
                              f"{human_number(self.recovery_queries / self.floor)}x"))
        if v is not None:
            rows.append(("verification",
                         f"{'PASSED' if v.passed else 'FAILED'}: {v.sequences} held-out "
                         f"sequences (lengths {v.lengths[0]}-{v.lengths[1]}), largest relative "
                         f"error {human_number(v.max_relative_error)}, median "
                         f"{human_number(v.median_relative_error)}, tolerance "
                         f"{human_number(v.tolerance)}"
                         + (f" (widened from {human_number(v.judged_tolerance)} by the model's "
                            f"error bar on sequences of large score reach)"
                            if v.judged_tolerance and v.tolerance > v.judged_tolerance else "")))
            if v.max_length:
                rows.append(("verified domain",
                             f"lengths {v.lengths[0]}-{v.lengths[1]} of up to {v.max_length}, "
                             f"token norms {human_number(v.norms[0])} .. "
                             f"{human_number(v.norms[1])} (tokens the answers read: the query "
                             f"token and keys given attention weight)"
                             + (f", sent {human_number(v.norms_sent[0])} .. "
                                f"{human_number(v.norms_sent[1])}" if any(v.norms_sent) else "")
                             + f"; {v.search_queries} of the sequences "
                             f"from the adversarial search, {v.own_probes} own longest probes "
                             f"compared"))
            if v.coverage:
                rows.append(("coverage", _coverage_text(v)))
            if v.batch_sizes:
                rows.append(("batch invariance",
                             v.batch_dependence or f"held-out sequences asked again alone and "
                             f"in a batch of {v.batch_sizes[-1]}: the same answers"))
            if v.hull_tolerance > 0:
                rows.append(("hull check", f"answers outside their tokens' interval by at most "
                                           f"{human_number(v.hull_violation)} (tolerance "
                                           f"{human_number(v.hull_tolerance)})"))
        rows.append(("time", f"{human_number(self.seconds)} s: "
                             f"{human_number(self.black_box_seconds)} s inside the black box, "
                             f"{human_number(self.learner_seconds)} s in the learner"))
        used = {label for label, _ in rows}
        for key, value in self.details.items():
            label = human_label(key)
            if label in used:              # one label, one meaning
                label = f"{label} (detail)"
            used.add(label)
            rows.append((label, human_value(value)))
        rows += [("note", n) for n in self.notes]
        return rows




def _html_table(rows: list[tuple[str, str]]) -> str:
    """(label, text) rows as an HTML table (a breakdown row's empty label stays empty)."""
    cells = "".join(f"<tr><th style='text-align:left'>{html.escape(label)}</th>"
                    f"<td style='text-align:left'>{html.escape(text.strip())}</td></tr>"
                    for label, text in rows)
    return f"<table>{cells}</table>"


def _coverage_text(v: Verification) -> str:
    """One line: the share of each family's inputs a deviation must cover to be caught
    with 95% confidence, the weakest first."""
    parts = sorted(v.coverage.items(), key=lambda item: -item[1])
    shown = ", ".join(f"{name} {100 * p:.3g}% ({v.family_sequences.get(name, 0)})"
                      for name, p in parts)
    return (f"a deviation on at least this share of a family's inputs is caught with "
            f"{100 * COVERAGE_CONFIDENCE:.0f}% confidence: {shown}; more held-out sequences "
            f"(--verify-sequences N) buy smaller shares")


# -- the human rendering of values -----------------------------------------------------

LABEL_WIDTH = 34          # labels longer than this push their value right, not the column
# the headline report (Report.rows): the details shown by default (what was found, how
# well it is known), at most HEADLINE_ROWS of them, and the first HEADLINE_NOTES notes
HEADLINE_DETAILS = ("heads", "heads found", "rank", "ranks", "hidden units",
                    "output ranks r_h", "error bar", "error_bar", "output precision",
                    "cost", "floor in queries", "http")
HEADLINE_ROWS = 3
HEADLINE_NOTES = 2
BRIEF_PARTS = ("journal fingerprint",)   # breakdown parts named beside recovery + verification
# detail keys written for programs, in words for people
_LABELS = {"error_bar_W": "error bar of W", "error_bar_W_columns": "error bar of W's columns",
           "error_bar_W_rows": "error bar of W's rows",
           "error_bar_W_relative": "error bar of W, relative",
           "error_bar_v": "error bar of v", "error_bar_b": "error bar of b",
           "error_bar_v_relative": "error bar of v, relative",
           "error_bar_v_direction": "error bar of v's direction",
           "relative_error_W": "relative error of W", "relative_error_v": "relative error of v",
           "black_box_queries": "answered by the black box",
           "journal_queries": "answered by the journal", "check_queries": "journal checks",
           "journal": "journal file", "http": "HTTP", "low_rank_floor": "low-rank floor",
           "full_floor": "full floor", "vs floors": "against the floors",
           "queries_for_v": "queries for v", "first_pass_error": "first-pass error",
           "conditioning_numbers": "conditioning", "max_error_bar": "largest error bar allowed",
           "verify_tolerance": "verification tolerance"}
_LONG_DECIMAL = re.compile(r"(?<![\w.])[-+]?(?:\d+\.\d{4,}|\d\.\d+[eE][-+]?\d+)(?:[eE][-+]?\d+)?(?![\w.])")


def human_label(key: str) -> str:
    """A report key in words: "error_bar_W" -> "error bar of W", "queries_sent" -> "queries sent"."""
    if key in _LABELS:
        return _LABELS[key]
    if "_" in key and " " not in key:
        return " ".join(key.split("_"))
    return key


def human_number(x: float | np.generic) -> str:
    """An integer as itself, any other number to 3 significant digits."""
    if isinstance(x, (bool, np.bool_)):
        return "yes" if x else "no"
    if isinstance(x, (int, np.integer)):
        return str(int(x))
    x = float(x)
    if not math.isfinite(x):
        return str(x)
    return f"{x:.3g}"


def human_value(value: object) -> str:
    """A detail value for people: numbers to 3 digits, mappings and sequences in words."""
    if value is None:
        return "none"
    if isinstance(value, (bool, np.bool_, int, float, np.integer, np.floating)):
        return human_number(value)
    if isinstance(value, str):
        return _LONG_DECIMAL.sub(lambda m: human_number(float(m.group())), value)
    if isinstance(value, dict):
        return ", ".join(f"{human_label(str(k))} {human_value(v)}" for k, v in value.items())
    if isinstance(value, (list, tuple, np.ndarray)):
        items = np.asarray(value, dtype=object).ravel() if not isinstance(value, np.ndarray) \
            else value.ravel()
        numeric = items.size and all(isinstance(x, (int, float, np.integer, np.floating))
                                     and not isinstance(x, bool) for x in items)
        if numeric and items.size > 6:
            values = np.asarray(items, dtype=float)
            return (f"largest {human_number(values.max())}, median "
                    f"{human_number(float(np.median(values)))} ({items.size} values)")
        return ", ".join(human_value(x.item() if isinstance(x, np.generic) else x)
                         for x in items)
    return human_value(str(value))


ModelT = TypeVar("ModelT", bound=Regressor)


@dataclass
class ExtractionResult(Generic[ModelT]):
    """A recovered model, the number of queries it rests on, and the report.

    ``ExtractionResult[M]`` holds a model of class M; a bare ``ExtractionResult`` (what
    :func:`attnextract.extract` returns, any model class) types its model as Any."""

    model: ModelT
    queries: int
    report: Report
    options: dict = field(default_factory=dict)   # model name and options it ran with

    def save(self, path: str | os.PathLike) -> Path:
        """Write the result to ``path`` (``.npz`` appended if missing); returns the path written."""
        return save_result(path, self)

    @classmethod
    def load(cls, path: str | os.PathLike) -> "ExtractionResult":
        """Read back a result file: model, report, query count and options."""
        return load_result(path)

    def __repr__(self) -> str:
        check = ("not verified" if self.report.verification is None else
                 f"held-out error {self.report.verification.max_relative_error:.1e} "
                 f"{'PASSED' if self.report.verification.passed else 'FAILED'}")
        model = self.options.get("model", self.report.kind)
        return f"<ExtractionResult {model} d={self.report.dim}: {self.queries} queries, {check}>"

    def _repr_html_(self) -> str:
        """A notebook's view: one line on the result, then the report's table."""
        check = self.report.verification
        verdict = ("not verified" if check is None else
                   "<b style='color:green'>PASSED</b>" if check.passed else
                   "<b style='color:red'>FAILED</b> (a refused model: not to be used)")
        model = html.escape(str(self.options.get("model", self.report.kind)))
        return (f"<p><b>ExtractionResult</b>: {model}, d = {self.report.dim}, "
                f"{self.queries} queries, held-out check {verdict}</p>"
                + self.report._repr_html_())


def checked_result(model: Any, report: Report, claim: str) -> ExtractionResult:
    """The extraction result, or :class:`ModelMismatchError` if held-out verification failed.

    ``claim`` says what the black box was assumed to be ("a single-head attention
    regressor"); the error carries the result, so that nothing measured is lost.
    """
    result = ExtractionResult(model=model, queries=report.queries, report=report)
    check = report.verification
    if check is not None and not check.passed:
        raise ModelMismatchError(f"the black box is not {claim}: " + mismatch_reason(check),
                                 result=result)
    return result


_NUMBER = r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?"
_RANGE = re.compile(rf"^\s*({_NUMBER})\s*(?:\.\.|to)\s*({_NUMBER})\s*$")
_LEADING = re.compile(rf"^\s*({_NUMBER})(?:\s*\(.*\))?\s*$")
# detail names written for the eye; everything else is snake-cased mechanically
_KEY_NAMES = {"|v^T u_k|": "probe_readout", "|A^T w|": "readout_norm",
              "vs floors": "versus_floors",
              "multi-head paper's count": "paper_count",
              "paper-2 count": "paper_count"}   # its earlier name, in results saved before


def snake_case(key: str) -> str:
    """A report key for programs: "logit scale" -> "logit_scale", "FFN signs" -> "ffn_signs"."""
    key = _KEY_NAMES.get(key, key)
    if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
        return key              # already a name (error_bar_W keeps the matrix's letter)
    return re.sub(r"[^0-9a-z]+", "_", key.lower()).strip("_") or "value"


def machine_value(value: object) -> object:
    """A detail for programs: "0.0156 .. 1.41" -> [0.0156, 1.41]; "0.177 (every probe)" -> 0.177."""
    if isinstance(value, str):
        match = _RANGE.match(value)
        if match:
            return [float(match.group(1)), float(match.group(2))]
        match = _LEADING.match(value)
        if match:
            number = float(match.group(1))
            return int(number) if number.is_integer() and "." not in match.group(1) else number
    return value


def mismatch_reason(check: Verification) -> str:
    """Why a held-out check failed, with a hint when the error looks like output rounding."""
    hint = ("extract with --output-dtype float32|bfloat16|float16 or --decimals K (error bars "
            "from repeated measurements)")
    if check.batch_dependence:
        text = check.batch_dependence
        if getattr(check, "float32_answers", False):
            # a float32 forward pass sums in an order its batch picks: its answers move
            # with the batch by its own rounding, which a float64 model does not allow
            text += ("; the answers are float32 numbers (a float32, bfloat16 or float16 "
                     "forward pass rounds differently in different batches): " + hint)
        return text
    if check.max_relative_error > check.tolerance:
        where = f" (worst on {check.worst_family} sequences)" if check.worst_family else ""
        text = (f"held-out relative error {check.max_relative_error:.2e} > tolerance "
                f"{check.tolerance:.0e}{where}")
        if check.requested_tolerance > check.tolerance:
            text += (f" (the model's own error bar allows {check.tolerance:.0e}, tighter than "
                     f"the {check.requested_tolerance:.0e} asked for: the black box differs "
                     f"from the model by far more than the model's own uncertainty)")
    else:
        text = (f"an answer left the interval spanned by its tokens' own answers by "
                f"{check.hull_violation:.2e} > {check.hull_tolerance:.0e} (no single head does "
                f"that: a second head or another model)")
    if getattr(check, "float32_answers", False):
        # a learner that assumed float64 answers can err by any amount on float32 ones
        text += ("; the answers are float32 numbers (limited output precision: a float32, "
                 "bfloat16 or float16 forward pass): " + hint)
    elif looks_like_rounding(check.max_relative_error, getattr(check, "rounded_answers", False)):
        text += ("; an error this small looks like limited output precision (a float32, "
                 "bfloat16 or float16 forward pass, or rounded outputs): " + hint)
    return text


def parameter_errors(model: Any, truth: Any) -> dict[str, Any]:
    """Errors per part of a recovered single head against the truth (bench and tests).

    Returns ``W_columns`` (d,) |W_hat e_j - W e_j| / |W e_j|, ``W_rows`` (d,) the same
    for rows, ``v_entries`` (d,) |v_hat_i - v_i| / |v_i| (a zero part is measured
    against the whole W or v), their maxima ``W_column_max``, ``W_row_max``,
    ``v_entry_max`` and the Frobenius ``W_relative``, ``v_relative``. One Frobenius
    number hides a column or row 1e12 times smaller than the rest; these do not.
    """
    W_hat, W = np.asarray(model.W, float), np.asarray(truth.W, float)
    v_hat, v = np.asarray(model.v, float), np.asarray(truth.v, float)
    tiny = np.finfo(float).tiny

    def part(diff: np.ndarray, ref: np.ndarray, whole: float) -> np.ndarray:
        return diff / np.where(ref > 0, ref, max(whole, tiny))

    W_norm, v_norm = float(safe_norm(W)), float(safe_norm(v))
    cols = part(safe_norm(W_hat - W, axis=0), safe_norm(W, axis=0), W_norm)
    rows = part(safe_norm(W_hat - W, axis=1), safe_norm(W, axis=1), W_norm)
    ents = part(np.abs(v_hat - v), np.abs(v), v_norm)
    return {"W_columns": cols, "W_rows": rows, "v_entries": ents,
            "W_column_max": float(cols.max()), "W_row_max": float(rows.max()),
            "v_entry_max": float(ents.max()),
            "W_relative": float(safe_norm(W_hat - W) / max(W_norm, tiny)),
            "v_relative": float(safe_norm(v_hat - v) / max(v_norm, tiny))}


def _jsonable(obj: object) -> Any:
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    return obj


_STRUCTURE_KEYS = ("queries", "kind", "report", "report_state", "options")


def result_path(path: str | os.PathLike[str]) -> Path:
    """The file a result is written to: ``path``, with ``.npz`` appended if missing."""
    path = Path(path)
    return path if path.suffix == ".npz" else path.with_name(path.name + ".npz")


def save_result(path: str | os.PathLike[str], result: ExtractionResult) -> Path:
    """Write the model's parameters, ``queries``, ``kind``, the report (JSON: ``report`` for
    programs, ``report_state`` for an exact reload) and ``options`` to an npz file.

    Returns the path written (``.npz`` appended if ``path`` lacks it)."""
    path = result_path(path)
    arrays: dict[str, Any] = {k: np.asarray(v) for k, v in result.model.parameters().items()}
    with open(path, "wb") as handle:
        np.savez(handle, **arrays, queries=np.int64(result.queries),
                 kind=np.str_(result.report.kind),
                 report=np.str_(json.dumps(result.report.to_dict())),
                 report_state=np.str_(json.dumps(result.report.state())),
                 options=np.str_(json.dumps(_jsonable(result.options))))
    return path


def _read(path: str | os.PathLike[str]) -> dict[str, np.ndarray]:
    """The arrays of a result file. Never unpickles: a result holds numbers and text only,
    so any file that is not such an npz is refused in one line, whatever it holds."""
    what = "an .npz written by attnextract extract"
    if not os.path.isfile(path):
        raise TargetLoadError(f"result file {path} is not a file (expected {what})")
    if not zipfile.is_zipfile(path):
        raise TargetLoadError(f"{path} is not a result file (expected {what})")
    try:
        with np.load(path, allow_pickle=False) as data:
            return {k: data[k] for k in data.files}
    except ValueError as exc:
        if "pickle" in str(exc) or "allow_pickle" in str(exc) or "Object arrays" in str(exc):
            raise TargetLoadError(f"{path} holds Python objects, which a result file never "
                                  f"does; it is not loaded (expected {what})") from None
        raise TargetLoadError(f"{path} is not a readable result file (expected {what})") from exc
    except (OSError, KeyError, zipfile.BadZipFile) as exc:
        raise TargetLoadError(f"{path} is not a readable result file (expected {what}): "
                              f"{' '.join(str(exc).split())[:100]}") from exc


def load_result(path: str | os.PathLike[str]) -> ExtractionResult:
    """Read a result file written by :func:`save_result`: model, report, queries, options.

    Files written before reports were stored whole get a report rebuilt from the
    stored JSON summary (the human rendering may then lack some details)."""
    data = _read(path)
    model = _model_from(path, data)
    if "report_state" in data:
        report = Report.from_state(json.loads(str(data["report_state"])))
    elif "report" in data:
        report = Report.from_state(json.loads(str(data["report"])))
    else:
        raise TargetLoadError(f"result file {path} holds no report (a secret file, not a result?)")
    options = json.loads(str(data["options"])) if "options" in data else {}
    queries = int(data["queries"]) if "queries" in data else report.queries
    return ExtractionResult(model=model, queries=queries, report=report, options=options)


def load_model(path: str | os.PathLike[str]) -> Regressor:
    """Rebuild the model stored in a result file written by :func:`save_result`."""
    return _model_from(path, _read(path))


def _model_from(path: str | os.PathLike[str], data: dict[str, np.ndarray]) -> Regressor:
    kind = str(data["kind"]) if "kind" in data else "single-head"
    arrays: dict[str, Any] = {k: v for k, v in data.items() if k not in _STRUCTURE_KEYS}
    if kind not in MODEL_CLASSES:
        raise TargetLoadError(f"result file {path} holds an unknown model kind {kind!r}")
    if "kind" not in data and not {"W", "v"} <= set(arrays):
        raise TargetLoadError(f"{path} is not a result file: it holds {', '.join(sorted(data)) or 'nothing'}, "
                              f"not a model (expected an .npz written by attnextract extract)")
    try:
        return MODEL_CLASSES[kind](**arrays)
    except (TypeError, InputError) as exc:
        raise TargetLoadError(f"result file {path} does not hold a valid {kind} model: {exc}") from exc
