"""Typed errors. Every failure a user can cause or meet has its own class.

All derive from :class:`AttnExtractError`, so ``except AttnExtractError`` catches
everything the library raises on purpose.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np

    from .report import ExtractionResult


class AttnExtractError(Exception):
    """Base class of every error attnextract raises on purpose."""


class InputError(AttnExtractError, ValueError):
    """A query, shape, dimension or option given to the library is invalid."""


class BudgetExceededError(AttnExtractError):
    """Sending the next batch would exceed the query budget (raised before sending).

    ``partial_outputs`` (set by a black box that answered part of a batch before the
    budget stopped it): the answers it did deliver, journaled by the Oracle."""

    partial_outputs: np.ndarray

    def __init__(self, message: str, *, needed: int, remaining: int):
        super().__init__(message)
        self.needed = needed
        self.remaining = remaining


class BlackBoxError(AttnExtractError):
    """The black box itself failed: raised an exception, or cannot be reached.

    ``partial_outputs`` (set by a black box that failed mid-batch): the answers it did
    deliver, journaled by the Oracle."""

    partial_outputs: np.ndarray


class DimensionError(InputError, BlackBoxError):
    """The black box takes tokens of another width than the one given (``dim``,
    ``--dim``): a usage error, found at its first batch. ``expected`` is the width the
    black box answers for."""

    def __init__(self, message: str, *, expected: int):
        super().__init__(message)
        self.expected = expected


class MalformedOutputError(BlackBoxError):
    """The black box answered, but its answer has the wrong type or shape.

    ``kind_known`` (set when True): what the box answers was stated, and the answer
    contradicts it."""

    kind_known: bool


class NonFiniteOutputError(MalformedOutputError):
    """The black box answered NaN or infinity for at least one query."""


class NotIdentifiableError(AttnExtractError):
    """The target's parameters cannot be determined from queries (e.g. v = 0)."""


class RefusalWithResult(AttnExtractError):
    """A refusal after measuring: ``result`` holds the best-effort extraction (with its
    report) when one was computed, so that nothing measured is lost; it must not be
    used as a model.

    Learners may set ``box_may_be_outside`` (a refusal that did not rule out a box
    outside the class) and ``biases_ruled_out`` (the answers exclude a query bias);
    :func:`attnextract.extract` reads them for its hint, absent meaning False."""

    box_may_be_outside: bool
    biases_ruled_out: bool

    def __init__(self, message: str, result: ExtractionResult | None = None):
        super().__init__(message)
        self.result = result


class ModelMismatchError(RefusalWithResult):
    """The black box is not of the assumed model class (``result``: see
    :class:`RefusalWithResult`)."""


class TargetLoadError(AttnExtractError):
    """A target given as FILE.py:NAME (or a result file) cannot be loaded."""


class RecoveryFailedError(RefusalWithResult):
    """A learner's solver found no parameters consistent with its own measurements
    (e.g. too few random measurements for the rank), or its measurements do not pin
    them down; nothing wrong is returned (``result``: see :class:`RefusalWithResult`)."""


class JournalError(AttnExtractError):
    """The query journal cannot be read, written or trusted (a fault of the journal file,
    not of the black box): a full disk, a read-only or locked file, a row that fails its
    checksum, a file cut short.

    ``path`` is the journal file; ``batch`` the batch being recorded when writing failed
    (None otherwise); ``sidecar`` where that batch's answers were saved instead (None if
    they could only be kept in memory, in ``QueryJournal.unsaved``).
    """

    def __init__(self, message: str, *, path: str | os.PathLike[str] | None = None,
                 batch: int | None = None, sidecar: str | None = None):
        super().__init__(message)
        self.path = path
        self.batch = batch
        self.sidecar = sidecar


class JournalMismatchError(JournalError):
    """A resumed journal was recorded against another black box: the live black box
    answers its challenge sequences (or a sample of its journaled queries) differently.

    ``difference`` describes the first differing answer (which query, journaled and live
    values)."""

    def __init__(self, message: str, *, path: str | os.PathLike[str] | None = None,
                 difference: dict[str, Any] | None = None):
        super().__init__(message, path=path)
        self.difference = difference


class VectorAnswersFound(AttnExtractError):
    """Raised by an :class:`~attnextract.oracle.Oracle` in ``detect_vectors`` mode when the
    black box's first answer turns out to be vectors while a scalar learner is running:
    :func:`attnextract.extract` catches it and runs the model's vector learner instead
    (the first batch was spent and is counted). Never reaches a user."""

    def __init__(self, message: str, *, spent: int = 0):
        super().__init__(message)
        self.spent = spent
