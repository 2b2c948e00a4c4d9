"""Extraction results, held-out verification, reports and result files.

Every learner returns an :class:`ExtractionResult`: the recovered model, the number
of queries it rests on, and a :class:`Report` with the query breakdown, the floor,
timing and the held-out :class:`Verification` against the black box.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field

import numpy as np

from .errors import InputError, ModelMismatchError, TargetLoadError
from .models import MODEL_CLASSES
from .oracle import Oracle, live_queries

DEFAULT_VERIFY_TOLERANCE = 1e-7
MAX_VERIFY_LENGTH = 16


@dataclass
class Verification:
    """Outcome of comparing a recovered model with the black box on held-out sequences.

    The relative error of one sequence is |f_hat - f| / max(|f|, rms), with rms the
    root mean square of the black box's outputs over the whole verification set, so
    that outputs near zero do not inflate it.
    """

    sequences: int
    max_relative_error: float
    median_relative_error: float
    tolerance: float
    lengths: tuple[int, int] = (1, MAX_VERIFY_LENGTH)

    @property
    def passed(self) -> bool:
        return bool(self.max_relative_error <= self.tolerance)


def verification_count(free_parameters: int) -> int:
    """Held-out queries: max(64, 1% of the parameter count)."""
    return max(64, free_parameters // 100)


def token_scale(model) -> float:
    """Token scale c with scores x^T W y of order one for x, y ~ N(0, c^2 I)."""
    W = getattr(model, "W", None)
    if W is None:
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


def verify_model(oracle: Oracle, model, *, count: int, seed=None,
                 tolerance: float = DEFAULT_VERIFY_TOLERANCE,
                 scale: float | None = None) -> Verification:
    """Compare ``model`` with the black box on ``count`` held-out random sequences.

    Tokens are N(0, c^2 I) with c times 1/2, 1 or 2, where c = ``scale`` (default
    :func:`token_scale`, where the model's scores are of order one) for half of the
    sequences and d^{-1/4} for the other half; lengths are uniform in 1..16.
    """
    rng = np.random.default_rng(seed)
    scale = token_scale(model) if scale is None else scale
    # Half the sequences at a scale that does not depend on the model: a wrong model
    # with a huge W would otherwise pick tokens so small that every W looks alike.
    anchor = oracle.dim ** -0.25
    half = count - count // 2
    batches = (held_out_batches(oracle.dim, half, rng, scale)
               + [(idx + half, b) for idx, b in held_out_batches(oracle.dim, count // 2, rng, anchor)])
    oracle.require(count, "held-out verification")
    observed, predicted = np.empty(count), np.empty(count)
    with live_queries(oracle):                   # the live black box, never a journal
        for idx, batch in batches:               # one batch per length and scale group
            observed[idx] = oracle.query(batch)
            predicted[idx] = model(batch)
    err = relative_errors(predicted, observed)
    return Verification(sequences=count, max_relative_error=float(err.max()),
                        median_relative_error=float(np.median(err)), tolerance=tolerance)


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

    @property
    def learner_seconds(self) -> float:
        return max(self.seconds - self.black_box_seconds, 0.0)

    def to_dict(self) -> dict:
        out = asdict(self)
        out["learner_seconds"] = self.learner_seconds
        if self.verification is not None:
            out["verification"]["passed"] = self.verification.passed
            out["verification_error"] = self.verification.max_relative_error
        return _jsonable(out)

    def render(self) -> str:
        lines = [f"model        {self.kind}, d = {self.dim}",
                 f"queries      {self.queries} in all"]
        for name, n in self.breakdown.items():
            lines.append(f"  {name:<13}{n}")
        lines.append(f"floor        {self.floor} (free parameters); "
                     f"recovery used {self.breakdown.get('recovery', 0) / self.floor:.3f}x")
        if self.verification is not None:
            v = self.verification
            lines.append(f"verification {v.sequences} held-out sequences (lengths "
                         f"{v.lengths[0]}-{v.lengths[1]}): max relative error "
                         f"{v.max_relative_error:.2e}, median {v.median_relative_error:.2e} "
                         f"-> {'PASSED' if v.passed else 'FAILED'} (tolerance {v.tolerance:.0e})")
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

    def save(self, path: str | os.PathLike) -> None:
        save_result(path, self)


def checked_result(model, report: Report, claim: str) -> ExtractionResult:
    """The extraction result, or :class:`ModelMismatchError` if held-out verification failed.

    ``claim`` says what the black box was assumed to be ("a single-head attention
    regressor"); the error carries the result, so that nothing measured is lost.
    """
    result = ExtractionResult(model=model, queries=report.queries, report=report)
    check = report.verification
    if check is not None and not check.passed:
        raise ModelMismatchError(
            f"the black box is not {claim}: held-out relative error "
            f"{check.max_relative_error:.2e} > tolerance {check.tolerance:.0e}", result=result)
    return result


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


def save_result(path, result: ExtractionResult) -> None:
    """Write the model's parameters, ``queries``, ``kind`` and the report (JSON) to npz."""
    arrays = {k: np.asarray(v) for k, v in result.model.parameters().items()}
    np.savez(path, **arrays, queries=np.int64(result.queries),
             kind=np.str_(result.report.kind),
             report=np.str_(json.dumps(result.report.to_dict())))


def load_model(path):
    """Rebuild the model stored in a result file written by :func:`save_result`."""
    try:
        with np.load(path, allow_pickle=False) as data:
            kind = str(data["kind"]) if "kind" in data else "single-head"
            arrays = {k: data[k] for k in data.files if k not in ("queries", "kind", "report")}
    except (OSError, ValueError, KeyError) as exc:
        raise TargetLoadError(f"cannot read result file {path}: {exc}") from exc
    if kind not in MODEL_CLASSES:
        raise TargetLoadError(f"result file {path} holds an unknown model kind {kind!r}")
    try:
        return MODEL_CLASSES[kind](**arrays)
    except (TypeError, InputError) as exc:
        raise TargetLoadError(f"result file {path} does not hold a valid {kind} model: {exc}") from exc
