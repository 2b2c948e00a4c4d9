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

import json
import math
import os
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from .errors import InputError, ModelMismatchError, TargetLoadError
from .models import MODEL_CLASSES
from .oracle import Oracle, live_queries

DEFAULT_VERIFY_TOLERANCE = 1e-7
# verify_model(expected_error=e): held-out errors above max(1e3 e, 1e-10) are refused
CONSISTENCY_FACTOR = 1e3
CONSISTENCY_FLOOR = 1e-10
SENSITIVITY = 4.0              # ... plus 4 e x the model's score spread on the sequence
MAX_VERIFY_LENGTH = 16
REPORT_SCHEMA_VERSION = 2      # to_dict(): snake_case keys, numbers, ranges as [lo, hi]


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

    @property
    def passed(self) -> bool:
        return bool(self.max_relative_error <= self.tolerance
                    and self.hull_violation <= self.hull_tolerance)

    def __repr__(self) -> str:
        return (f"<Verification {'PASSED' if self.passed else 'FAILED'}: {self.sequences} "
                f"held-out sequences, max relative error {self.max_relative_error:.2e} "
                f"{'<=' if self.passed else '>'} {self.tolerance:.0e}>")


def verification_count(free_parameters: int) -> int:
    """Held-out queries: max(64, 1% of the parameter count)."""
    return max(64, free_parameters // 100)


def token_scale(model) -> float:
    """Token scale c with scores x^T W y of order one for x, y ~ N(0, c^2 I)."""
    W = getattr(model, "W", None)
    if W is None or np.size(W) == 0:        # no heads (f = 0): any scale
        return 1.0
    norm = float(np.max(np.linalg.norm(np.reshape(W, (-1,) + W.shape[-2:]), axis=(1, 2))))
    return math.sqrt(2.0 / norm) if norm > 0 else 1.0


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
    out = [None] * count
    for idx, batch in held_out_batches(dim, count, rng, scale, max_length):
        for i, x in zip(idx, batch):
            out[i] = x
    return out


def relative_errors(predicted: np.ndarray, observed: np.ndarray) -> np.ndarray:
    """|predicted - observed| / max(|observed|, rms(observed)) per sequence."""
    rms = math.sqrt(float(np.mean(observed ** 2))) if observed.size else 0.0
    denom = np.maximum(np.abs(observed), max(rms, np.finfo(float).tiny))
    return np.abs(predicted - observed) / denom


def held_out_output_error(recovered, truth, *, count: int = 256, seed=0) -> float:
    """Largest :func:`relative_errors` of ``recovered`` against a known ``truth`` model on
    ``count`` held-out sequences at the truth's token scale (bench and tests; one batch
    per length)."""
    from .oracle import evaluate_ragged
    sequences = held_out_sequences(truth.dim, count, np.random.default_rng(seed),
                                   token_scale(truth))
    return float(relative_errors(evaluate_ragged(recovered, sequences),
                                 evaluate_ragged(truth, sequences)).max())


def verify_model(oracle: Oracle, model, *, count: int, seed=None,
                 tolerance: float = DEFAULT_VERIFY_TOLERANCE,
                 scale: float | None = None, probe_length: int | None = None,
                 measure_v: bool = False, expected_error: float | None = None) -> Verification:
    """Compare ``model`` with the black box on the ``count`` held-out sequences of
    :func:`attnextract.verification.design`: short and long (up to max(256, 4 x
    ``probe_length``)), repeated, tiny to large, sparse and peaked tokens, and for a
    single head the hull pairs. ``scale`` is the per-coordinate token scale where the
    model's scores are of order one (default :func:`token_scale`). ``measure_v``
    (checking a saved model): first ask the black box's own v (d more queries) and put
    the hull tokens orthogonal to it rather than to the model's v. Up to 1/8 of the
    ``count`` re-ask sequences the learner was answered through this oracle
    (``oracle.replay``): a black box that changed during the run fails there.

    ``expected_error`` e (the learner's own predicted relative parameter error) tightens
    the tolerance to max(CONSISTENCY_FACTOR x e, CONSISTENCY_FLOOR) when that is
    smaller: a model known to 1e-13 that misses the black box by 1e-8 is not the black
    box's model, even though 1e-8 is under the user's tolerance (a third head at 1e-8 is
    refused this way where no hull check applies). It also widens each sequence's
    allowance by SENSITIVITY x e x the spread of the model's scores on it: a relative
    error e of W moves scores of spread S by about e S, and large tokens (scores up to
    1e6 on the ``norms`` family) are known only that well. The errors reported are
    scaled to the tolerance (error x tolerance / allowance).
    """
    from .verification import (HULL_FRACTION, REPLAY_FRACTION, add_replays, design,
                               root_oracle, run_check)
    requested = tolerance
    bar = expected_error if expected_error is not None and math.isfinite(expected_error) \
        and expected_error >= 0 else None
    if bar is not None:
        tolerance = min(tolerance, max(CONSISTENCY_FACTOR * bar, CONSISTENCY_FLOOR))
    rng = np.random.default_rng(seed)
    scale = token_scale(model) if scale is None else scale
    hull_v = None
    if measure_v and getattr(model, "kind", "") == "single-head":
        oracle.require(count + oracle.dim, "held-out verification")
        with live_queries(oracle):                 # the live black box, never a journal
            hull_v = oracle.query(np.eye(oracle.dim)[:, None, :])
    replays = min(len(getattr(root_oracle(oracle), "replay", None) or []),
                  int(REPLAY_FRACTION * count))
    held = add_replays(design(oracle.dim, count - replays, rng, scale, probe_length=probe_length,
                              model=model, hull_v=hull_v), oracle, replays)
    oracle.require(len(held.sequences) + len(held.replay), "held-out verification")
    check = run_check(oracle, model, held)
    if bar:
        from .verification import score_spread
        spread = np.concatenate([score_spread(model, held.sequences),
                                 np.zeros(len(check.errors) - len(held.sequences))])
        check.errors = check.errors * tolerance / (tolerance + SENSITIVITY * bar * spread)
    asked = len(held.sequences) + len(held.replay) + (0 if hull_v is None else oracle.dim)
    return Verification(sequences=asked, max_relative_error=float(check.errors.max()),
                        median_relative_error=float(np.median(check.errors)), tolerance=tolerance,
                        lengths=check.lengths,
                        hull_violation=float(check.hull.max(initial=0.0)),
                        hull_tolerance=HULL_FRACTION * tolerance,
                        worst_family=check.worst_family(), family_errors=check.family_errors(),
                        requested_tolerance=requested if tolerance < requested else 0.0)


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

    def render(self) -> str:
        lines = [f"model        {self.kind}, d = {self.dim}",
                 f"queries      {self.queries} in all"]
        for name, n in self.breakdown.items():
            lines.append(f"  {name:<12} {n}")
        recovery = ("recovery used" if self.recovery is None else
                    f"recovery ({self.recovery} queries, the parts' own checks left out) used")
        lines.append(f"floor        {self.floor} (free parameters); "
                     f"{recovery} {self.recovery_queries / self.floor:.3f}x")
        if self.verification is not None:
            v = self.verification
            lines.append(f"verification {v.sequences} held-out sequences (lengths "
                         f"{v.lengths[0]}-{v.lengths[1]}): max relative error "
                         f"{v.max_relative_error:.2e}, median {v.median_relative_error:.2e} "
                         f"-> {'PASSED' if v.passed else 'FAILED'} (tolerance {v.tolerance:.0e})")
            if v.hull_tolerance > 0:
                lines.append(f"  hull check  answers outside their tokens' interval by at most "
                             f"{v.hull_violation:.1e} (tolerance {v.hull_tolerance:.0e})")
        lines.append(f"time         {self.seconds:.3f} s ({self.black_box_seconds:.3f} s inside "
                     f"the black box, {self.learner_seconds:.3f} s in the learner)")
        for key, value in self.details.items():
            lines.append(f"{key:<12} {value}")
        lines += [f"note         {n}" for n in self.notes]
        return "\n".join(lines)


@dataclass
class ExtractionResult:
    """A recovered model, the number of queries it rests on, and the report."""

    model: object
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


def checked_result(model, report: Report, claim: str) -> ExtractionResult:
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
              "vs floors": "versus_floors"}


def snake_case(key: str) -> str:
    """A report key for programs: "logit scale" -> "logit_scale", "FFN signs" -> "ffn_signs"."""
    key = _KEY_NAMES.get(key, key)
    if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
        return key              # already a name (error_bar_W keeps the matrix's letter)
    return re.sub(r"[^0-9a-z]+", "_", key.lower()).strip("_") or "value"


def machine_value(value):
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
    from .verification import looks_like_rounding
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
    if looks_like_rounding(check.max_relative_error):
        text += ("; an error this small looks like limited output precision (a float32, "
                 "bfloat16 or float16 forward pass, or rounded outputs): extract with "
                 "--output-dtype float32|bfloat16|float16 or --decimals K (error bars from "
                 "repeated measurements)")
    return text


def parameter_errors(model, truth) -> dict:
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

    def part(diff, ref, whole):
        return diff / np.where(ref > 0, ref, max(whole, tiny))

    W_norm, v_norm = float(np.linalg.norm(W)), float(np.linalg.norm(v))
    cols = part(np.linalg.norm(W_hat - W, axis=0), np.linalg.norm(W, axis=0), W_norm)
    rows = part(np.linalg.norm(W_hat - W, axis=1), np.linalg.norm(W, axis=1), W_norm)
    ents = part(np.abs(v_hat - v), np.abs(v), v_norm)
    return {"W_columns": cols, "W_rows": rows, "v_entries": ents,
            "W_column_max": float(cols.max()), "W_row_max": float(rows.max()),
            "v_entry_max": float(ents.max()),
            "W_relative": float(np.linalg.norm(W_hat - W) / max(W_norm, tiny)),
            "v_relative": float(np.linalg.norm(v_hat - v) / max(v_norm, tiny))}


def _jsonable(obj):
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


def result_path(path) -> Path:
    """The file a result is written to: ``path``, with ``.npz`` appended if missing."""
    path = Path(path)
    return path if path.suffix == ".npz" else path.with_name(path.name + ".npz")


def save_result(path, result: ExtractionResult) -> Path:
    """Write the model's parameters, ``queries``, ``kind``, the report (JSON: ``report`` for
    programs, ``report_state`` for an exact reload) and ``options`` to an npz file.

    Returns the path written (``.npz`` appended if ``path`` lacks it)."""
    path = result_path(path)
    arrays = {k: np.asarray(v) for k, v in result.model.parameters().items()}
    with open(path, "wb") as handle:
        np.savez(handle, **arrays, queries=np.int64(result.queries),
                 kind=np.str_(result.report.kind),
                 report=np.str_(json.dumps(result.report.to_dict())),
                 report_state=np.str_(json.dumps(result.report.state())),
                 options=np.str_(json.dumps(_jsonable(result.options))))
    return path


def _read(path):
    try:
        with np.load(path, allow_pickle=False) as data:
            return {k: data[k] for k in data.files}
    except (OSError, ValueError, KeyError) as exc:
        raise TargetLoadError(f"cannot read result file {path}: {exc}") from exc


def load_result(path) -> ExtractionResult:
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


def load_model(path):
    """Rebuild the model stored in a result file written by :func:`save_result`."""
    return _model_from(path, _read(path))


def _model_from(path, data: dict):
    kind = str(data["kind"]) if "kind" in data else "single-head"
    arrays = {k: v for k, v in data.items() if k not in _STRUCTURE_KEYS}
    if kind not in MODEL_CLASSES:
        raise TargetLoadError(f"result file {path} holds an unknown model kind {kind!r}")
    try:
        return MODEL_CLASSES[kind](**arrays)
    except (TypeError, InputError) as exc:
        raise TargetLoadError(f"result file {path} does not hold a valid {kind} model: {exc}") from exc
