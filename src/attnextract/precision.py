"""The precision of a black box's outputs: stated (``output_dtype=``, ``decimals=``) or detected.

Learners that accept low-precision black boxes (single-head through
:func:`attnextract.learners.noisy.extract_low_precision`; multi-head, multi-head-low-rank
and transformer-layer through their ``output_dtype`` / ``decimals`` keywords) share the
option check, the detection of rounded outputs and the wording of refusals here.

Two kinds of low precision differ a lot:

- outputs computed in float64 and rounded once (to float32, or to k decimals): every
  answer is off by at most half a unit in its last place, and the rounding shows in
  the answers themselves (they are exactly representable in float32, or multiples of
  10^-k), so it is detected;
- a forward pass run in float32 or bfloat16: every token, score and sum is rounded, so
  answers are off by many units of the dtype (errors accumulate inside the model) and
  nothing in an answer shows it (the answer cast to float64 looks like any float32
  number, but so does one rounded once). The relative level assumed for probe design
  is :data:`attnextract.learners.noisy.FORWARD_RHO`; error bars must come from measured
  spread or residuals, never from this assumed level.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .errors import InputError
from .learners.multi_head import output_precision
from .learners.noisy import FORWARD_RHO

EPS64 = float(np.finfo(np.float64).eps)
OUTPUT_DTYPES = ("float64", "float32", "bfloat16", "float16")   # float64: exact, stated
MAX_DECIMALS = 15            # beyond 15 decimals a float64 output is not rounded at all
DETECT_DECIMALS = 12         # rounding to at most this many decimals is detected
MIN_DETECT_VALUES = 4        # nonzero answers needed before rounding is called detected


def check_precision_options(output_dtype=None, decimals=None) -> None:
    """Raise :class:`InputError` unless the options are None or valid (and not both given)."""
    if output_dtype is not None and decimals is not None:
        raise InputError("give output_dtype= or decimals=, not both (--output-dtype or "
                         "--decimals)")
    if output_dtype is not None and output_dtype not in OUTPUT_DTYPES:
        raise InputError(f"output_dtype must be one of {', '.join(OUTPUT_DTYPES)}, got "
                         f"{output_dtype!r}")
    if decimals is not None and (isinstance(decimals, bool)
                                 or not isinstance(decimals, (int, np.integer))
                                 or not 0 <= decimals <= MAX_DECIMALS):
        raise InputError(f"decimals must be an integer in 0..{MAX_DECIMALS}, got {decimals!r}")


@dataclass(frozen=True)
class OutputPrecision:
    """What one answer may be off by: ``relative`` |f| + ``absolute`` (a typical size
    for a forward pass, a bound for one rounding).

    ``name`` is "float64", "float32", "bfloat16", "float16" or "K decimals";
    ``forward`` is True for a forward pass run in that dtype (stated), False for one
    rounding of float64 outputs; ``stated`` says whether the user gave it or it was
    detected from the answers.
    """

    name: str
    relative: float
    absolute: float = 0.0
    forward: bool = False
    stated: bool = False

    @property
    def exact(self) -> bool:
        """float64 outputs (nothing stated, no rounding detected)."""
        return self.name == "float64"

    @property
    def decimals(self) -> int | None:
        """K for outputs rounded to K decimals, else None."""
        return int(self.name.split()[0]) if self.name.endswith(" decimals") else None

    def level(self, scale: float) -> float:
        """The absolute error of an answer of size ``scale``."""
        return self.relative * abs(scale) + self.absolute

    def describe(self) -> str:
        """One phrase for a report note."""
        how = "stated" if self.stated else "detected from the answers"
        what = (f"a forward pass in {self.name}" if self.forward
                else f"outputs rounded to {self.name}")
        return f"{what} ({how}; relative {self.relative:.1e}, absolute {self.absolute:.1e})"


def stated_precision(output_dtype=None, decimals=None) -> OutputPrecision | None:
    """The precision the options state (checked), or None when neither is given."""
    check_precision_options(output_dtype, decimals)
    if output_dtype == "float64":                    # exact answers, said so
        return OutputPrecision("float64", EPS64, stated=True)
    if output_dtype is not None:
        return OutputPrecision(output_dtype, FORWARD_RHO[output_dtype], forward=True,
                               stated=True)
    if decimals is not None:
        return OutputPrecision(f"{int(decimals)} decimals", EPS64,
                               0.5 * 10.0 ** -int(decimals), stated=True)
    return None


def detect_precision(values) -> OutputPrecision:
    """Rounding seen in the answers ``values``: float16, float32, K decimals or float64.

    Generic float64 numbers are almost never exactly representable in float32 nor
    multiples of 10^-k (k <= 12); when every nonzero answer (at least
    MIN_DETECT_VALUES of them) is, the black box rounds. A forward pass run in float32
    is detected as float32 too, but only its last rounding is seen: its real error is
    larger (state ``output_dtype`` then).
    """
    x = np.asarray(values, dtype=np.float64).ravel()
    x = x[np.isfinite(x) & (x != 0)]
    if x.size < MIN_DETECT_VALUES:
        return OutputPrecision("float64", EPS64)
    with np.errstate(over="ignore"):           # answers beyond float16's range: not float16
        relative, name = output_precision(x)
    if name != "float64":
        return OutputPrecision(name, relative)
    # float32 first: a float32 number of size >= 2^11 is also a multiple of 10^-12, and
    # integers below 2^24 are float32 numbers (either description holds for them)
    for k in range(DETECT_DECIMALS + 1):
        if np.all(np.round(x, k) == x):
            return OutputPrecision(f"{k} decimals", EPS64, 0.5 * 10.0 ** -k)
    return OutputPrecision("float64", EPS64)


def precision_of(values, output_dtype=None, decimals=None) -> OutputPrecision:
    """The stated precision if given, else the one detected in ``values``."""
    return stated_precision(output_dtype, decimals) or detect_precision(values)


def option_hint(precision: OutputPrecision | None) -> str:
    """The sentence a refusal ends with: which option states the black box's precision."""
    if precision is None or precision.exact:
        return ("if the black box computes in low precision or rounds its outputs, say so "
                "with --output-dtype float32|bfloat16 or --decimals K (API: output_dtype=, "
                "decimals=)")
    if precision.stated:
        return (f"the stated precision ({precision.name}) leaves too little signal for this "
                f"learner on this box: a coarser one cannot help; a float64 forward pass "
                f"would (--output-dtype applies only when the box is really low precision)")
    return (f"the answers are rounded to {precision.name} (detected); if the black box runs "
            f"its whole forward pass in low precision, say so with --output-dtype "
            f"float32|bfloat16 (API: output_dtype=)")


def name_the_options(exc: Exception, precision: OutputPrecision | None) -> None:
    """End a refusal's message with :func:`option_hint` (unless it names the options
    already, or the answers were detected as float64), so that a user of a
    low-precision-capable learner learns what to state."""
    message = exc.args[0] if exc.args and isinstance(exc.args[0], str) else None
    if message is None or "output-dtype" in message or "output_dtype" in message:
        return
    if precision is not None and precision.exact and not precision.stated:
        return      # float64 answers (detected): a mismatch, not a precision problem; the
        # hint would invite loosening the check on an impostor
    exc.args = (f"{message}; {option_hint(precision)}",) + exc.args[1:]
