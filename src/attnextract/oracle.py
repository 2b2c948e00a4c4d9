"""The oracle: the only door to a black box.

A learner never calls a black box directly. It hands whole batches of probe
sequences to an :class:`Oracle`, which

- validates the batch (shape (B, N, d), finite float64),
- refuses, before sending anything, a batch that would exceed the budget,
- sends it (split into chunks of at most ``max_batch`` sequences if asked),
- validates the answer (finite real numbers of one of three shapes, fixed at the first
  answer: (B,) one number per sequence, (B, m) the output vector at the last position,
  (B, N, m) the output vector at every position) and
- counts queries (one query = one sequence), tokens, numbers received, calls and the
  time spent inside the black box.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
from numpy.typing import ArrayLike

from .adapters.torch_target import module_black_box
from .errors import (
    BlackBoxError,
    BudgetExceededError,
    InputError,
    MalformedOutputError,
    NonFiniteOutputError,
    RefusalWithResult,
    VectorAnswersFound,
)
from .models import scale_outputs

if TYPE_CHECKING:
    from .adapters.journal import QueryJournal
    from .report import ExtractionResult

# a black box: a batch (B, N, d) in, its answers out (any form the Oracle validates)
BlackBox = Callable[[np.ndarray], Any]
# a query kept for replay or among the longest: the sequence (N, d) and its answer
Answered = tuple[np.ndarray, float | np.ndarray]

log = logging.getLogger(__name__)


REPLAY_KEEP = 16      # learner queries kept to be asked again at verification
REPLAY_SEED = 0x5EED
LONGEST_KEEP = 8      # the learner's longest answered queries, compared with its model

# what a black box answers per sequence (``Oracle.outputs``)
OUTPUT_KINDS = ("scalar", "last", "all")
OUTPUT_MEANINGS = {"scalar": "one number per sequence", "last": "a vector (m,) per sequence, "
                   "the output at the last position", "all": "an array (N, m) per sequence, "
                   "the output at every position"}


class Oracle:
    """Counting, budgeted, validating access to a black box.

    Parameters
    ----------
    black_box : callable
        Takes a float64 array (B, N, d) and returns B real numbers (a (B, 1) column or a
        torch tensor will do). A box written for one sequence, (N, d) -> one number, is
        found at its first answer and then asked one sequence at a time
        (``per_sequence``). A ``torch.nn.Module`` taking a batch tensor is served through
        :class:`~attnextract.adapters.torch_target.TorchModuleBlackBox`.
    dim : int
        Token width d the black box accepts.
    outputs : {"scalar", "last", "all"}, optional
        What the black box answers per sequence: one number (the papers' readout), the
        output vector (m,) at the last position, or the output vectors (N, m) at every
        position. Default: found from the first answer's shape ((B,) or (B, 1):
        scalar; (B, m): last; (B, N, m): all), then held to for every later answer.
    out_dim : int, optional
        m, the width of a vector answer; default: found from the first answer.
    causal : bool, optional
        For every-position answers: whether position j sees only positions i <= j
        (a decoder), or every position (an encoder). Stated by the user; learners that
        need to know refuse without it, and verification refuses a box that answers
        the other way.
    budget : int, optional
        Hard limit on the number of queries (sequences). A batch that would
        exceed it raises :class:`BudgetExceededError` before it is sent.
    max_batch : int, optional
        Largest number of sequences handed to the black box in one call.
    max_length : int, optional
        The longest sequence the deployment accepts (tokens). A query longer than this
        raises :class:`InputError` before anything is sent (a learner that needs longer
        probes refuses at its start), and held-out verification covers lengths up to it.
        Default: the black box's own ``max_length`` attribute where it declares one (an
        :class:`~attnextract.adapters.remote.HttpBlackBox` declares its server's limit).
    progress : callable, optional
        Called as ``progress(queries_sent, queries_planned)`` after each call (both
        counting the journal's fingerprint queries); ``queries_planned == queries_sent``
        when no forecast is left; at the end of a run, ``progress.finish(queries_sent)``
        when the callback has that method (:meth:`settle_progress`).
    journal : QueryJournal, optional
        Consulted for every batch (see :mod:`attnextract.adapters.journal`): sequences it has
        answered before are answered from it, only the others reach the black box,
        and their answers are recorded (committed per batch). ``queries`` counts both;
        ``journal_queries`` those answered by the journal, ``black_box_queries`` the rest.
        The budget counts every query the result rests on, so a resumed run stops where
        the original would have. Before the first batch the journal is bound to the
        live black box (:meth:`QueryJournal.bind`: its fingerprint is stored, or checked
        when the journal is resumed); those queries are counted in ``check_queries``
        (apart from ``queries``, the learner's count) and against the budget like every
        query the black box answers; :func:`attnextract.extract` adds them to the
        result's ``queries``. The binding checks are never part of a learner's plan:
        ``queries`` and every answer a learner sees are the same with a journal, without
        one and on a resumed run. Queries asked in :meth:`live` (held-out verification)
        are journaled too: a rerun of a finished run asks the black box only the checks.

    Answers are counted in three units: ``queries`` (sequences), ``tokens`` (tokens sent)
    and ``numbers`` (numbers received: 1, m or N m per sequence).

    ``replay`` holds a uniform sample (REPLAY_KEEP pairs, reservoir sampling) of the
    sequences answered outside :meth:`live` and their answers; held-out verification
    asks them again, so that a black box that changed during the run is refused.
    ``longest`` is the longest sequence answered outside :meth:`live` and ``longest_probes``
    up to LONGEST_KEEP of the longest (sequence, answer) pairs: verification compares the
    model with them (no new queries) and covers lengths up to at least ``longest``.
    """

    def __init__(self, black_box: BlackBox, dim: int, *, budget: int | None = None,
                 max_batch: int | None = None, progress: Callable[[int, int], None] | None = None,
                 journal: QueryJournal | None = None,
                 max_length: int | None = None, outputs: str | None = None,
                 out_dim: int | None = None, causal: bool | None = None) -> None:
        if _is_torch_module(black_box):        # numpy in, a tensor's numbers out
            black_box = module_black_box(black_box)
        if not callable(black_box):
            raise InputError(f"black box must be callable, got {type(black_box).__name__}")
        if not isinstance(dim, (int, np.integer)) or dim < 1:
            raise InputError(f"dim must be a positive integer, got {dim!r}")
        if budget is not None and (not isinstance(budget, (int, np.integer)) or budget < 0):
            raise InputError(f"budget must be a non-negative integer, got {budget!r}")
        if max_batch is not None and (not isinstance(max_batch, (int, np.integer)) or max_batch < 1):
            raise InputError(f"max_batch must be a positive integer, got {max_batch!r}")
        if max_length is not None and (not isinstance(max_length, (int, np.integer))
                                       or isinstance(max_length, bool) or max_length < 1):
            raise InputError(f"max_length must be a positive integer, got {max_length!r}")
        if outputs is not None and outputs not in OUTPUT_KINDS:
            raise InputError(f"outputs must be one of {', '.join(OUTPUT_KINDS)}, got {outputs!r}")
        if out_dim is not None and (not isinstance(out_dim, (int, np.integer))
                                    or isinstance(out_dim, bool) or out_dim < 1):
            raise InputError(f"out_dim must be a positive integer, got {out_dim!r}")
        if outputs == "scalar" and out_dim not in (None, 1):
            raise InputError(f"a scalar box answers one number per sequence; out_dim "
                             f"{out_dim} contradicts outputs='scalar'")
        if causal is not None and not isinstance(causal, (bool, np.bool_)):
            raise InputError(f"causal must be True or False, got {causal!r}")
        self.black_box = black_box
        self.dim = int(dim)
        # what the box answers: stated, or fixed at its first answer (None until then)
        self.outputs = outputs
        self.out_dim = None if out_dim is None else int(out_dim)
        if outputs == "scalar":
            self.out_dim = 1
        self.causal = None if causal is None else bool(causal)
        if outputs is None:
            # a box that declares what it answers (a VectorAttention model, a served
            # layer) is held to it from the first query
            declared = getattr(black_box, "output_kind", None)
            if declared in OUTPUT_KINDS:
                self.outputs = declared
                declared_causal = getattr(black_box, "causal", None)
                if causal is None and isinstance(declared_causal, bool):
                    self.causal = declared_causal
        # set by attnextract.extract while a scalar learner runs on a box of unknown kind:
        # vector answers at the first batch raise VectorAnswersFound
        self.detect_vectors = False
        if max_length is None:
            # a box that declares its limit (a server's longest sequence) is never sent more
            declared = getattr(black_box, "max_length", None)
            if isinstance(declared, (int, np.integer)) and not isinstance(declared, bool) \
                    and declared >= 1:
                max_length = int(declared)
        self.max_length = None if max_length is None else int(max_length)
        self.longest = 0          # longest sequence answered outside live()
        self.largest_batch = 0    # largest batch answered outside live() (the learner's)
        self.longest_probes: list[Answered] = []  # up to LONGEST_KEEP (sequence, answer), the longest
        self.budget = None if budget is None else int(budget)
        self.max_batch = None if max_batch is None else int(max_batch)
        self.progress = progress
        self.queries = 0          # sequences sent
        self.tokens = 0           # tokens sent (sum of lengths)
        self.numbers = 0          # numbers received (1, m or N m per sequence)
        self.calls = 0            # calls made to the black box
        self.black_box_seconds = 0.0
        self.planned = 0          # queries announced by the running learner
        self.journal = journal
        self.journal_queries = 0  # queries answered by the journal, not the black box
        self.check_queries = 0    # queries binding the journal to the black box (budgeted)
        # held-out sequences the verification asks at least (a stronger coverage
        # statement, ``--verify-sequences``); None: each learner's own count
        self.verify_sequences: int | None = None
        # held-out checks the journal answered (a rerun of a finished run): the report says
        # so, since the journal, not the live black box, vouched for them
        self.held_out_journal_queries = 0
        self._live = 0            # > 0 inside live(): held-out checks, kept for no replay
        # a uniform sample of the (sequence, answer) pairs the learner was given, asked
        # again by held-out verification: a black box that changed during the run shows
        self.replay: list[Answered] = []
        self._replay_rng = np.random.default_rng(REPLAY_SEED)
        # None until the box's first answer: True for a box written for one sequence
        # (N, d) -> one number, asked one sequence at a time; False for a batched box
        self.per_sequence: bool | None = None

    def answer_shape(self, length: int) -> tuple[int, ...]:
        """The shape of one answer to a sequence of ``length`` tokens: () for a scalar
        box (or one not yet asked: its m unknown), (m,) at the last position, (length, m) at every one."""
        if self.outputs in (None, "scalar") or self.out_dim is None:
            return ()
        return (self.out_dim,) if self.outputs == "last" else (length, self.out_dim)

    @property
    def numbers_per_query(self) -> int | None:
        """Numbers in one answer at the last position: 1 or m (every position: m per
        token); None before the first answer."""
        return None if self.outputs is None else (self.out_dim or 1)

    # -- budget -------------------------------------------------------------
    @property
    def black_box_queries(self) -> int:
        """Queries answered by the black box itself (``queries`` minus journal answers)."""
        return self.queries - self.journal_queries

    @property
    def remaining(self) -> int | None:
        """Queries left in the budget (None when unlimited)."""
        return None if self.budget is None else self.budget - self.queries - self.check_queries

    def require(self, n: int, what: str = "this step") -> None:
        """Raise :class:`BudgetExceededError` unless ``n`` more queries fit (the budget
        holds every query the black box answers, the journal's checks too)."""
        left = None if self.budget is None else self.budget - self.queries - self.check_queries
        if left is not None and n > left:
            raise BudgetExceededError(
                f"{what} needs {n} queries but only {left} of the budget of {self.budget} "
                f"remain", needed=n, remaining=left)

    def plan(self, n: int, what: str = "the extraction", need: int | None = None) -> None:
        """Announce ``n`` upcoming queries: sets the progress total and checks the budget
        for ``need`` of them (default all ``n``). A learner whose ``n`` is an upper bound
        (a count search sized for more heads than it may find) gives the least it can
        succeed with as ``need``, so that a budget equal to what a run spent lets that
        run through; its later stages check the budget themselves."""
        self.require(n if need is None else min(int(need), int(n)), what)
        self.planned = self.queries + int(n)
        log.info("%s: %d queries planned (%d sent so far)", what, n, self.queries)

    def bind_journal(self) -> int:
        """Bind the journal to the live black box now (its fingerprint queries, counted in
        ``check_queries`` and budgeted); returns the queries it cost (0 without a journal
        or when already bound). The first batch sent binds it otherwise;
        :func:`attnextract.extract` adds what binding cost to the result's ``queries``."""
        if self.journal is None or self.journal.bound:
            return 0
        before = self.check_queries
        self.journal.bind(self._ask_to_check, self.dim, self.black_box,
                          **({"max_length": self.max_length} if self.max_length else {}))
        return self.check_queries - before

    def check_length(self, n: int, what: str = "a query") -> None:
        """Raise :class:`InputError` if sequences of ``n`` tokens exceed ``max_length``."""
        if self.max_length is not None and n > self.max_length:
            raise InputError(f"{what} of {n} tokens is longer than the longest sequence the "
                             f"black box accepts (max_length {self.max_length}); nothing was "
                             f"sent")

    # -- queries ------------------------------------------------------------
    @contextmanager
    def live(self) -> Iterator[Oracle]:
        """Within this block queries are held-out checks (verification): their answers are
        not kept for replay nor among the longest probes. With a journal they are
        journaled like the learner's, so a rerun of a finished run asks the black box only
        the journal's binding checks (which are what vouch for the journal's answers)."""
        self._live += 1
        try:
            yield self
        finally:
            self._live -= 1

    def query(self, X: ArrayLike, *, live: bool = False) -> np.ndarray:
        """Send a batch (B, N, d) (or one sequence (N, d)); returns the outputs (B,).

        ``live=True``: a held-out check (as within :meth:`live`)."""
        if live:
            with self.live():
                return self.query(X)
        X = np.asarray(X, dtype=np.float64)
        if X.ndim == 2:
            X = X[None]
        if X.ndim != 3 or X.shape[1] < 1 or X.shape[2] != self.dim:
            raise InputError(f"queries must have shape (B, N, {self.dim}) with N >= 1, "
                             f"got {X.shape}")
        if not np.isfinite(np.add.reduce(X, axis=None)) and not np.all(np.isfinite(X)):
            raise InputError("queries contain NaN or infinity")
        B = X.shape[0]
        if B == 0:
            return np.empty((0,) + self.answer_shape(X.shape[1]))
        self.check_length(X.shape[1])
        self.require(B, f"a batch of {B} sequences")
        step = self.max_batch or B
        return np.concatenate([self._send(X[i:i + step]) for i in range(0, B, step)])

    def query_ragged(self, sequences: Sequence[np.ndarray], *, live: bool = False) -> np.ndarray:
        """Send sequences of different lengths: one batch per length, answers in order.

        ``live=True``: a held-out check (as within :meth:`live`)."""
        if live:
            with self.live():
                return self.query_ragged(sequences)
        sequences = [np.asarray(s, dtype=np.float64) for s in sequences]
        for s in sequences:
            if s.ndim != 2 or s.shape[1] != self.dim or s.shape[0] < 1:
                raise InputError(f"each sequence must have shape (N, {self.dim}), got {s.shape}")
        self.require(len(sequences), f"{len(sequences)} sequences")
        return evaluate_ragged(self.query, sequences)

    def _send(self, X: np.ndarray) -> np.ndarray:
        B, N, _ = X.shape
        if self.journal is not None and not self.journal.bound:
            # refuses a journal of another black box; its queries are counted and budgeted
            self.bind_journal()
        self.require(B, f"a batch of {B} sequences")
        # a sent query is spent, whatever comes back: counted before sending
        if self.journal is None:
            self.queries += B
            self.tokens += B * N
            self.calls += 1
            out = self._ask_black_box(X)
        else:
            keys, out = self.journal.lookup(X)
            # a journal answers (B,) or (B,) + the answer's shape, NaN where it has none
            missing = np.isnan(out.reshape(B, -1)).any(axis=1)
            self.journal_queries += B - int(missing.sum())
            if self._live:
                self.held_out_journal_queries += B - int(missing.sum())
            self.queries += B
            self.tokens += B * N
            if missing.any():
                asked = np.ascontiguousarray(X[missing])
                keys = [k for k, m in zip(keys, missing) if m]
                self.calls += 1
                try:
                    answers = self._ask_black_box(asked)
                except (BudgetExceededError, BlackBoxError) as exc:
                    self._journal_partial(exc, keys, asked)
                    raise
                # written (committed) before the learner sees them
                self.journal.record(keys, answers, asked)
                if out.shape[1:] != answers.shape[1:]:   # the journal held none of them
                    out = np.full((B,) + answers.shape[1:], np.nan)
                out[missing] = answers
        self.numbers += out.size
        if not self._live:
            self._keep_for_replay(X, out)
            self._keep_longest(X, out)
        self._report_progress()
        return out

    def _report_progress(self) -> None:
        """``progress(answered, forecast)``: every query the black box answered for this
        run (the journal's fingerprint too, as the result counts them) and the plan."""
        if self.progress is not None:
            done = self.queries + self.check_queries
            self.progress(done, max(self.planned + self.check_queries, done))

    def settle_progress(self) -> None:
        """The run is over: the progress total becomes what was sent (a plan sized for
        more than the learner needed, a count search for more heads than it found, is
        withdrawn)."""
        self.planned = self.queries
        finish = getattr(self.progress, "finish", None)
        if callable(finish):
            finish(self.queries + self.check_queries)
        else:
            self._report_progress()

    def _keep_for_replay(self, X: np.ndarray, out: np.ndarray) -> None:
        """Reservoir sampling: after n answers, each is in ``replay`` with probability
        REPLAY_KEEP / n (an O(B) step per batch, REPLAY_KEEP sequences kept). The list is
        kept in the order the pairs were asked (an evicted pair leaves, the new one joins
        at the end), so that a check can re-ask pairs spread over the whole run."""
        B = len(X)
        first = self.queries - B                      # global index of X[0]
        t = first + np.arange(B)
        slot = np.where(t < REPLAY_KEEP, t, self._replay_rng.integers(0, t + 1))
        for i in np.flatnonzero(slot < REPLAY_KEEP):
            pair = (np.array(X[i]), _kept(out[i]))
            if slot[i] < len(self.replay):
                del self.replay[slot[i]]
            self.replay.append(pair)

    def _keep_longest(self, X: np.ndarray, out: np.ndarray) -> None:
        """Keep the LONGEST_KEEP longest answered sequences (the first ones of a length)."""
        N = X.shape[1]
        self.longest = max(self.longest, N)
        self.largest_batch = max(self.largest_batch, len(X))
        kept = self.longest_probes
        if len(kept) >= LONGEST_KEEP and N <= min(len(x) for x, _ in kept):
            return
        take = min(len(X), LONGEST_KEEP)
        kept.extend((np.array(X[i]), _kept(out[i])) for i in range(take))
        kept.sort(key=lambda pair: -len(pair[0]))
        del kept[LONGEST_KEEP:]

    def _ask_to_check(self, X: np.ndarray) -> np.ndarray:
        """A journal's binding check: counted in ``check_queries``, within the budget
        (every query the black box answers is)."""
        self.check_length(X.shape[1], "the journal's fingerprint query")
        self.require(len(X), f"the journal's {len(X)} fingerprint queries")
        self.check_queries += len(X)
        self.tokens += len(X) * X.shape[1]
        step = self.max_batch or len(X)
        return np.concatenate([self._ask_black_box(X[i:i + step])
                               for i in range(0, len(X), step)])

    def _journal_partial(self, exc: Exception, keys: list[tuple[bytes, int]],
                         X: np.ndarray) -> None:
        """Journal the answers a failed call did deliver (``exc.partial_outputs``).

        Contract with black boxes (e.g. an HTTP client refused mid-batch): the exception
        may carry ``partial_outputs``, either the answers to the first k <= B sequences
        of the batch, or B values with NaN where no answer came. Finite ones are journaled
        (they were paid for); ``exc.journaled`` says how many."""
        assert self.journal is not None         # called on a journaled batch only
        partial = getattr(exc, "partial_outputs", None)
        if partial is None:
            return
        try:
            values = np.asarray(partial, dtype=np.float64)
        except (TypeError, ValueError):
            return
        if values.ndim <= 1:
            values = values.ravel()
        if len(values) > len(keys):
            return                           # breaks the contract: trust none of it
        # a vector answer is received when every one of its numbers is
        received = (np.flatnonzero(np.isfinite(values.reshape(len(values), -1)).all(axis=1))
                    if values.size else np.empty(0, dtype=int))
        if len(received):
            self.journal.record([keys[i] for i in received], values[received], X[received])
            if exc.args and isinstance(exc.args[0], str):     # said in the error's one line
                exc.args = (f"{exc.args[0]} ({len(received)} answers received before it were "
                            f"journaled in {self.journal.path})",) + exc.args[1:]
        try:
            # any exception the box raised: the count rides on it as an attribute
            exc.journaled = len(received)  # type: ignore[attr-defined]
        except AttributeError:
            pass

    def _ask_black_box(self, X: np.ndarray) -> np.ndarray:
        """One call to the black box with the batch X (B, N, d); validated outputs (B,).

        A box written for one sequence (N, d) -> one number is asked one sequence at a
        time: :meth:`_ask_batched` finds out which kind the box is at its first call."""
        if self.per_sequence:
            start = time.perf_counter()
            try:
                return self._ask_each(X)
            finally:
                self.black_box_seconds += time.perf_counter() - start
        return self._ask_batched(X)

    def _ask_each(self, X: np.ndarray) -> np.ndarray:
        """A per-sequence box's answers to the batch X (B, N, d), one call per sequence."""
        try:
            answers = [self.black_box(x.copy()) for x in X]
        except (BudgetExceededError, BlackBoxError):
            raise
        except Exception as exc:
            raise _box_failure(exc) from exc
        except SystemExit as exc:
            raise _box_failure(exc) from None
        if self.outputs in (None, "scalar"):
            return validate_outputs([_one_number(a) for a in answers], len(X))
        return validate_answers(_stacked(answers), len(X), X.shape[1], self.outputs,
                                self.out_dim or 1)

    def _per_sequence_answers(self, X: np.ndarray, failure: Exception) -> np.ndarray:
        """The answers to X when the box, which failed the batch with ``failure``, answers
        one sequence (N, d) with one number; else ``failure`` is raised, saying what the
        single sequence gave. Decided once, at the box's first answer."""
        try:
            first = _from_tensor(self.black_box(X[0].copy()))
            single = np.asarray(first)
        except Exception as exc:                 # neither a batch nor a sequence works
            own = " ".join(f"{type(exc).__name__}: {exc}".split())
            note = (f"; given one sequence ({X.shape[1]}, {self.dim}) it raised "
                    f"{own if len(own) <= 120 else own[:117] + '...'}")
            single = None
        else:
            note = (f"; given one sequence ({X.shape[1]}, {self.dim}) it returned "
                    f"{_describe(first)}, not one number")
        if (single is not None and single.size >= 1 and single.dtype.kind in "biuf"
                and self.outputs != "scalar" and (single.size > 1 or self.outputs)):
            # a vector (m,) or one vector per position (N, m): a box for one sequence
            # that answers vectors
            found = answer_kind((1,) + single.shape, 1, X.shape[1])
            if found is not None and found[0] != "scalar" or self.outputs in ("last", "all"):
                kind, m = found if found is not None and found[0] != "scalar" else (
                    self.outputs, int(single.shape[-1]) if single.ndim else 1)
                assert kind is not None           # found, or the answers stated
                if self.outputs is not None and kind != self.outputs or (
                        self.out_dim is not None and m != self.out_dim):
                    raise MalformedOutputError(
                        f"black box answered one sequence ({X.shape[1]}, {self.dim}) with "
                        f"{_describe(first)}; expected {OUTPUT_MEANINGS[self.outputs or kind]}"
                        + (f" with m = {self.out_dim}" if self.out_dim else "")) from failure
                self.outputs, self.out_dim, self.per_sequence = kind, m, True
                log.info("the black box answers one sequence (N, d) with %s: it is asked one "
                         "sequence at a time", OUTPUT_MEANINGS[kind])
                out = validate_answers(_stacked([first]), 1, X.shape[1], kind, m)
                if len(X) > 1:
                    out = np.concatenate([out, self._ask_each(X[1:])])
                if self.detect_vectors:
                    self.numbers += out.size          # received, though no learner reads them
                    raise VectorAnswersFound(f"the black box answers {OUTPUT_MEANINGS[kind]} "
                                             f"(m = {m})", spent=len(X))
                return out
        if single is not None and single.size > 1 and single.dtype.kind in "biuf":
            # answers, but several for one sequence: say that first, the batch's failure after
            own = " ".join(str(failure).split())
            raise MalformedOutputError(
                f"black box returned {single.size} numbers ({_describe(first)}) for one sequence "
                f"({X.shape[1]}, {self.dim}); expected one number (a box answers a batch "
                f"(B, N, d) with B numbers, or one sequence (N, d) with one); a batch "
                f"{X.shape} failed: {own if len(own) <= 160 else own[:157] + '...'}") from failure
        if single is None or single.size != 1 or single.dtype.kind not in "biuf":
            # a first-batch hint (a wrong --dim) already says what to fix
            if failure.args and isinstance(failure.args[0], str) and not getattr(
                    failure, "first_batch", False):
                failure.args = (failure.args[0] + note,) + failure.args[1:]
            raise failure
        self.per_sequence = True
        self.outputs, self.out_dim = "scalar", 1
        log.info("the black box answers one sequence (N, d) with one number: it is asked "
                 "one sequence at a time")
        rest = self._ask_each(X[1:]) if len(X) > 1 else np.empty(0)
        return np.concatenate([validate_outputs([_one_number(first)], 1), rest])

    def _ask_batched(self, X: np.ndarray) -> np.ndarray:
        start = time.perf_counter()
        try:
            # the black box gets its own writable copy: it cannot change the learner's
            # probes, and libraries that want writable input (torch.as_tensor) do not warn
            raw = self.black_box(X.copy())
        except BudgetExceededError as exc:
            # a remote budget refused part of the batch: only the answered prefix was spent
            answered = len(getattr(exc, "partial_outputs", X))
            self.queries -= len(X) - answered
            self.tokens -= (len(X) - answered) * X.shape[1]
            raise
        except BlackBoxError as exc:
            if self.per_sequence is None and getattr(exc, "first_batch", False):
                # a Python target's first batch failed: it may be written for one sequence
                return self._per_sequence_answers(X, exc)
            raise                  # already typed (e.g. an HTTP black box unreachable)
        except Exception as exc:   # the black box's own failure, typed and chained
            error = _box_failure(exc)
            error.__cause__ = exc
            if self.per_sequence is None:
                return self._per_sequence_answers(X, error)
            raise error from exc
        except SystemExit as exc:  # sys.exit() in a target must not end the run as success
            raise _box_failure(exc) from None
        finally:
            self.black_box_seconds += time.perf_counter() - start
        if self.per_sequence is None:
            try:
                out = self._first_answers(raw, X)
            except MalformedOutputError as exc:
                shape = _shape_of(_from_tensor(raw))
                if isinstance(exc, NonFiniteOutputError) or shape == (len(X),) or getattr(
                        exc, "kind_known", False) or (self.outputs is not None and answer_kind(
                            shape, len(X), X.shape[1]) is not None):
                    raise               # answers, of a kind other than stated
                # not B answers (one number for a batch, say): a per-sequence box?
                start = time.perf_counter()
                try:
                    return self._per_sequence_answers(X, exc)
                finally:
                    self.black_box_seconds += time.perf_counter() - start
            if len(X) >= 2:
                self.per_sequence = False         # a batch answered: the box is batched
            return out
        return validate_answers(raw, len(X), X.shape[1], self.outputs or "scalar",
                                self.out_dim or 1)

    def _first_answers(self, raw: Any, X: np.ndarray) -> np.ndarray:
        """Validate the answer to the first batch X that the box answered; it fixes the
        kind of answers (and m) where they were not stated."""
        B, N = X.shape[:2]
        if self.outputs is not None and self.out_dim is not None:
            return validate_answers(raw, B, N, self.outputs, self.out_dim)
        shape = _shape_of(_from_tensor(raw))
        found = answer_kind(shape, B, N)
        if found is None:
            return validate_answers(raw, B, N, self.outputs or "scalar", self.out_dim or 1)
        kind, m = found
        if self.outputs is not None:
            kind = self.outputs
        elif kind == "last" and m == N and self.per_sequence is None and not getattr(
                self.black_box, "outputs", None):
            # (B, N) may be one number per position of a box written for one sequence
            # ((N, d) @ v on a batch): such a box answers one sequence with one number
            if _answers_one_number(self.black_box, X[0]):
                raise MalformedOutputError(
                    f"black box answered a batch {X.shape} with shape {shape}, one number per "
                    f"position of a box written for one sequence")
        if self.out_dim is not None and m != self.out_dim:
            error = MalformedOutputError(
                f"black box answered vectors of width m = {m}; out_dim {self.out_dim} was "
                f"stated")
            error.kind_known = True
            raise error
        out = validate_answers(raw, B, N, kind, m)
        if (kind, m) != ("scalar", 1) or self.outputs is None:
            self.outputs, self.out_dim = kind, m
            if kind != "scalar":
                log.info("the black box answers %s (m = %d)", OUTPUT_MEANINGS[kind], m)
                if self.detect_vectors:
                    self.numbers += out.size          # received, though no learner reads them
                    raise VectorAnswersFound(f"the black box answers {OUTPUT_MEANINGS[kind]} "
                                             f"(m = {m})", spent=B)
        return out

    def phase(self, text: str) -> None:
        """Tell the progress display what the learner is doing ("columns 37/384, rank 12").

        For learners whose query total is not known up front; a display without a
        ``phase`` method ignores it."""
        log.debug("phase: %s", text)
        show = getattr(self.progress, "phase", None)
        if show is not None:
            show(text)

    def __repr__(self) -> str:
        budget = "" if self.budget is None else f" of budget {self.budget}"
        journal = "" if self.journal is None else (
            f", {self.journal_queries} from journal {getattr(self.journal, 'path', '?')}")
        name = getattr(self.black_box, "__name__", type(self.black_box).__name__)
        return (f"<Oracle d={self.dim} -> {name}: {self.queries} queries{budget} in "
                f"{self.calls} calls, {self.black_box_seconds:.3g} s in the black box{journal}>")

    def summary(self) -> dict:
        return {"queries": self.queries, "tokens": self.tokens, "numbers": self.numbers,
                "outputs": self.outputs, "out_dim": self.out_dim, "calls": self.calls,
                "black_box_seconds": self.black_box_seconds, "budget": self.budget,
                "journal_queries": self.journal_queries,
                "black_box_queries": self.black_box_queries,
                "check_queries": self.check_queries}


class QueryAccess(Protocol):
    """What :func:`attnextract.extract` and the learners use of an oracle: an
    :class:`Oracle`, or a view of one that sends every query through it (such as
    :class:`ScaledOutputs`), so that the Oracle counts and budgets them all."""

    @property
    def dim(self) -> int: ...
    @property
    def queries(self) -> int: ...
    @property
    def black_box_seconds(self) -> float: ...
    def query(self, X: ArrayLike) -> np.ndarray: ...
    def query_ragged(self, sequences: Sequence[np.ndarray]) -> np.ndarray: ...
    def require(self, n: int, what: str = "this step") -> None: ...
    def plan(self, n: int, what: str = "the extraction", need: int | None = None) -> None: ...


class OracleView:
    """A learner's view of an oracle: queries go through ``base`` (counted, budgeted and
    journaled there); subclasses change what a query means by overriding ``query``.
    ``what`` names the view in budget messages."""

    def __init__(self, base: QueryAccess, what: str | None = None) -> None:
        self.base, self.what, self.dim = base, what, base.dim

    @property
    def queries(self) -> int:
        return self.base.queries

    @property
    def black_box_seconds(self) -> float:
        return self.base.black_box_seconds

    # what the box answers and what was sent, as the base states and counts them
    @property
    def outputs(self) -> str | None:
        return getattr(self.base, "outputs", None)

    @property
    def causal(self) -> bool | None:
        return getattr(self.base, "causal", None)

    @property
    def max_length(self) -> int | None:
        return getattr(self.base, "max_length", None)

    @property
    def numbers(self) -> int:
        return int(getattr(self.base, "numbers", 0))

    @property
    def tokens(self) -> int:
        return int(getattr(self.base, "tokens", 0))

    def _named(self, what: str) -> str:
        return what if self.what is None else f"{what} ({self.what})"

    def require(self, n: int, what: str = "this step") -> None:
        self.base.require(n, self._named(what))

    def plan(self, n: int, what: str = "the extraction", need: int | None = None) -> None:
        self.base.plan(n, self._named(what), need)


class ScaledOutputs(OracleView):
    """A learner's view of an oracle whose answers are divided by 2^k, chosen once from
    the first answers that are not all zero so that their largest is of order one; a
    learner working in absolute numbers (thresholds, squared sums, LAPACK) then sees
    outputs of 1 whether the black box answers 1e-300 or 1e300.

    Powers of two are exact: y / 2^k has every bit of y (a normal number stays normal),
    so nothing is lost or rounded, and a model recovered on the view is mapped back by
    :func:`attnextract.models.scale_outputs` (values and output constants x 2^k).
    Answers whose largest lies within BAND are left as they are (k = 0, the view is the
    oracle itself): at ordinary scales a learner runs exactly as without the view.

    ``replay`` and ``longest_probes`` are the base Oracle's pairs in the view's units,
    so held-out verification on the view compares the learner's own answers too.
    """

    BAND = (2.0 ** -10, 2.0 ** 10)

    def __init__(self, base: QueryAccess, what: str | None = None) -> None:
        super().__init__(base, what)
        self.exponent: int | None = None         # k; None until an answer is not zero

    @property
    def factor(self) -> float:
        """2^k (1.0 until fixed)."""
        return math.ldexp(1.0, self.exponent or 0)

    def _scaled(self, y: np.ndarray) -> np.ndarray:
        if y.dtype == object:                    # answers at every position, ragged
            return np.array([None] + [self._scaled(a) for a in y], dtype=object)[1:]
        if self.exponent is None:
            finite = np.abs(y[np.isfinite(y)])
            top = float(finite.max()) if finite.size else 0.0
            if top > 0:
                inside = self.BAND[0] <= top <= self.BAND[1]
                self.exponent = 0 if inside else int(round(math.log2(top)))
                if self.exponent:
                    log.info("answers of size %.3g: the learner works on them / 2^%d",
                             top, self.exponent)
        return np.ldexp(y, -self.exponent) if self.exponent else y

    def query(self, X: ArrayLike, **kwargs: Any) -> np.ndarray:
        return self._scaled(self.base.query(X, **kwargs))

    def query_ragged(self, sequences: Sequence[np.ndarray], **kwargs: Any) -> np.ndarray:
        return self._scaled(self.base.query_ragged(sequences, **kwargs))

    def phase(self, text: str) -> None:
        phase = getattr(self.base, "phase", None)
        if phase is not None:
            phase(text)

    def _pairs(self, name: str) -> list:
        pairs = getattr(self.base, name, None) or []
        k = self.exponent or 0
        return [(x, math.ldexp(y, -k) if np.ndim(y) == 0 else np.ldexp(y, -k))
                for x, y in pairs]

    @property
    def replay(self) -> list:
        return self._pairs("replay")

    @property
    def longest_probes(self) -> list:
        return self._pairs("longest_probes")


def on_scaled_outputs(oracle: QueryAccess,
                      run: Callable[[ScaledOutputs], ExtractionResult]) -> ExtractionResult:
    """``run(view)`` on a :class:`ScaledOutputs` view of ``oracle``; the model of its
    result (or of a refusal's ``result``) is mapped back to the black box's units, and
    the report says by how much the answers were divided. Returns the result."""
    view = ScaledOutputs(oracle)

    def back(result: ExtractionResult | None) -> ExtractionResult | None:
        if result is not None and view.exponent:
            result.model = scale_outputs(result.model, view.factor)
            result.report.notes.append(
                f"the answers were divided by 2^{view.exponent} (exact) while learning, "
                f"the model's outputs mapped back")
        return result

    try:
        result = run(view)
        back(result)
        return result
    except RefusalWithResult as exc:
        back(exc.result)
        raise


def root_oracle(oracle: Any) -> Any:
    """The :class:`Oracle` under a learner's view of it (``.base``); anything else as is."""
    while not isinstance(oracle, Oracle) and hasattr(oracle, "base"):
        oracle = oracle.base
    return oracle


def live_queries(oracle: Any) -> AbstractContextManager[Any]:
    """Context: queries through ``oracle`` are held-out checks (:meth:`Oracle.live`).

    ``oracle`` may be an :class:`Oracle` or a learner's view of one (an object with the
    Oracle's query interface and the underlying oracle as ``base``, e.g. the odd-part
    oracle); the innermost Oracle's :meth:`Oracle.live` is used. Held-out verification
    runs inside it."""
    root = root_oracle(oracle)
    return root.live() if isinstance(root, Oracle) else nullcontext(oracle)


def by_length(sequences: Sequence[np.ndarray]) -> list[tuple[np.ndarray, np.ndarray]]:
    """Group sequences (N_i, d) by length: [(indices, batch (b, N, d))], one entry per length."""
    lengths = np.array([len(s) for s in sequences])
    return [(idx, np.stack([sequences[int(i)] for i in idx]))
            for idx in (np.flatnonzero(lengths == n) for n in np.unique(lengths))]


def evaluate_ragged(fn: Callable[[np.ndarray], Any], sequences: Sequence[np.ndarray]) -> np.ndarray:
    """``fn`` (a batch (b, N, d) -> (b,), (b, m) or (b, N, m)) on sequences of mixed
    lengths, one call per length. Returns (B,) or (B, m) in the sequences' order; answers
    at every position, whose shapes differ with the length, as an object array of B
    arrays (N_i, m)."""
    parts = [(idx, np.asarray(fn(batch))) for idx, batch in by_length(sequences)]
    if any(part.ndim >= 3 for _, part in parts):
        out = np.empty(len(sequences), dtype=object)
        for idx, part in parts:
            for i, answer in zip(idx, part):
                out[i] = answer
        return out
    tail = parts[0][1].shape[1:] if parts else ()
    out = np.empty((len(sequences),) + tail)
    for idx, part in parts:
        out[idx] = part
    return out


def _kept(answer: Any) -> float | np.ndarray:
    """One answer as kept for replay: a float (scalar boxes), or a copy of the vector."""
    return float(answer) if np.ndim(answer) == 0 else np.array(answer)


def _box_failure(exc: BaseException) -> BlackBoxError:
    """The black box's own failure, an exception or ``sys.exit()`` (which must not end
    the run as a success), as a :class:`BlackBoxError` saying which."""
    if isinstance(exc, SystemExit):
        return BlackBoxError(f"black box called sys.exit({exc.code!r}) (a target must "
                             f"return its answers, not exit)")
    return BlackBoxError(f"black box raised {type(exc).__name__}: {exc}")


def _is_torch_module(obj: object) -> bool:
    """Whether obj is a ``torch.nn.Module`` (without importing torch)."""
    return any(f"{c.__module__}.{c.__qualname__}" == "torch.nn.modules.module.Module"
               for c in type(obj).__mro__)


def _from_tensor(answer: Any) -> Any:
    """A torch tensor answer as a numpy array (detached, on the CPU, bfloat16 and float16
    widened exactly); anything else unchanged."""
    if type(answer).__module__.startswith("torch") and hasattr(answer, "detach"):
        tensor = answer.detach().cpu()
        if str(tensor.dtype) in ("torch.bfloat16", "torch.float16"):
            tensor = tensor.float()              # numpy has no bfloat16; exact in float32
        return tensor.numpy()
    return answer


def _one_number(answer: Any) -> Any:
    """A per-sequence box's answer as one number: a Python or numpy scalar, a 0-d array or
    an array of one element; anything else is :class:`MalformedOutputError`."""
    answer = _from_tensor(answer)
    arr = np.asarray(answer) if not isinstance(answer, (int, float)) else None
    if arr is None:
        return answer
    if arr.size != 1:
        raise MalformedOutputError(f"black box answered one sequence with {_describe(answer)}; "
                                   f"expected one number")
    return arr.reshape(())[()]


def _answers_one_number(black_box: BlackBox, x: np.ndarray) -> bool:
    """Whether ``black_box`` answers the one sequence x (N, d) with one number (any
    failure: no)."""
    try:
        answer = np.asarray(_from_tensor(black_box(x.copy())))
    except Exception:
        return False
    return answer.size == 1 and answer.dtype.kind in "biuf"


def _stacked(answers: list) -> np.ndarray:
    """A per-sequence box's vector answers as one array (B, ...); answers of different
    shapes are :class:`MalformedOutputError`."""
    arrays = [np.asarray(_from_tensor(a)) for a in answers]
    shapes = {a.shape for a in arrays}
    if len(shapes) > 1:
        raise MalformedOutputError(
            f"black box answered sequences of one batch with arrays of different shapes "
            f"({', '.join(str(s) for s in sorted(shapes))})")
    return np.stack(arrays) if arrays else np.empty(0)


def _shape_of(answer: Any) -> tuple[int, ...] | None:
    """The shape of a box's answer, None when it has none (ragged lists, objects)."""
    try:
        return np.shape(answer)
    except Exception:
        return None


def _describe(answer: Any) -> str:
    """What a box returned, for a message: "a list of 2 numbers", "shape (3, 2)"."""
    try:
        arr = np.asarray(answer)
    except Exception:
        return f"a {type(answer).__name__}"
    if isinstance(answer, (list, tuple)):
        return f"a {type(answer).__name__} of {len(answer)}"
    return f"a {type(answer).__name__} of shape {arr.shape}"


def answer_kind(shape: tuple[int, ...] | None, batch: int, length: int) -> tuple[str, int] | None:
    """The kind of answer a first answer's ``shape`` shows for a batch (batch, length, d):
    ("scalar", 1) for (B,) or (B, 1), ("last", m) for (B, m), ("all", m) for
    (B, N, m); None for any other shape."""
    if shape is None or not shape or shape[0] != batch:
        return None
    if len(shape) == 1 or (len(shape) == 2 and shape[1] == 1):
        return "scalar", 1
    if len(shape) == 2 and shape[1] >= 1:
        return "last", int(shape[1])
    if len(shape) == 3 and shape[1] == length and shape[2] >= 1:
        return "all", int(shape[2])
    return None


def expected_shape(kind: str, batch: int, length: int, m: int) -> tuple[int, ...]:
    """The answer shape of ``kind`` for a batch (batch, length, d) with outputs of width m."""
    return {"scalar": (batch,), "last": (batch, m), "all": (batch, length, m)}[kind]


def validate_answers(raw: Any, batch: int, length: int = 1, kind: str = "scalar",
                     m: int = 1) -> np.ndarray:
    """Check a black box's answer to a batch (batch, length, d) of the ``kind`` it answers
    (:data:`OUTPUT_KINDS`, outputs of width m); returns float64 of
    :func:`expected_shape`. A scalar box may answer a column (B, 1).

    Only real numbers are answers: complex values (an imaginary part would be lost),
    strings (even "1.5"), None and integers beyond float64's range are
    :class:`MalformedOutputError`, never converted silently."""
    try:
        arr = np.asarray(_from_tensor(raw))
    except (TypeError, ValueError, OverflowError) as exc:
        raise MalformedOutputError(
            f"black box returned {type(raw).__name__} that is not an array of numbers: {exc}"
        ) from exc
    want = expected_shape(kind, batch, length, m)
    if kind == "scalar" and arr.shape == (batch, 1):   # a column, as out[:, -1] @ r[:, None]
        arr = arr[:, 0]
    if arr.shape != want:
        found = answer_kind(arr.shape, batch, length)
        what = ("" if found is None or found == (kind, m) else
                f" ({OUTPUT_MEANINGS[found[0]]}" + (f", m = {found[1]}" if found[0] != "scalar"
                                                    else "") + ")")
        meant = OUTPUT_MEANINGS[kind] + (f", m = {m}" if kind != "scalar" else "")
        raise MalformedOutputError(
            f"black box returned shape {arr.shape}{what} for a batch of {batch} sequences of "
            f"{length} tokens; expected {want} ({meant}, as it answered before or as "
            f"stated)")
    kind = arr.dtype.kind
    if kind == "O":                     # Python objects: real numbers only, each in range
        items = arr.ravel().tolist()
        for item in items:
            if not isinstance(item, (int, float, np.integer, np.floating, np.bool_)):
                raise MalformedOutputError(
                    f"black box returned a {type(item).__name__} ({item!r:.60}) among its "
                    f"answers; expected real numbers")
        try:
            arr = np.array([float(item) for item in items], dtype=np.float64).reshape(arr.shape)
        except OverflowError:
            raise MalformedOutputError(
                "black box returned an integer beyond the float64 range (|x| > 1.8e308)") from None
    elif kind == "c":
        raise MalformedOutputError(
            f"black box returned complex numbers ({arr.dtype}); expected real numbers (the "
            f"imaginary part would be lost)")
    elif kind not in "biuf":
        raise MalformedOutputError(
            f"black box returned {'strings' if kind in 'US' else arr.dtype} "
            f"({type(raw).__name__} of {arr.dtype}), not an array of numbers")
    out = arr.astype(np.float64)
    bad = ~np.isfinite(out)
    if bad.any():
        rows = bad.reshape(batch, -1).any(axis=1)
        first = int(np.flatnonzero(rows)[0])
        raise NonFiniteOutputError(
            f"black box returned {int(bad.sum())} non-finite value(s) in {int(rows.sum())} "
            f"of {batch} answers (first at index {first}: "
            f"{out.reshape(batch, -1)[first][bad.reshape(batch, -1)[first]][0]})")
    return out


def validate_outputs(raw: Any, batch: int) -> np.ndarray:
    """Check a scalar black box's answer to a batch of ``batch`` sequences; returns
    float64 (B,) (see :func:`validate_answers`)."""
    return validate_answers(raw, batch)


# -- black boxes that answer like real endpoints -------------------------------
#
# Each wrapper takes any black box (a callable (B, N, d) -> (B,)) and returns what a
# real endpoint would: the clean outputs plus noise, rounded, or reduced to a label.
# They are black boxes themselves (hand them to an Oracle), so they serve both as
# targets and to simulate defences. ``tolerance`` and ``relative_tolerance`` state the
# guarantee a wrapper gives: |answer - f(X)| <= tolerance + relative_tolerance * |f(X)|
# (None where no bound exists, as for Gaussian noise).


class OutputWrapper:
    """Base class: calls the wrapped black box and post-processes its outputs."""

    tolerance: float | None = 0.0
    relative_tolerance: float = 0.0

    def __init__(self, black_box: BlackBox) -> None:
        if not callable(black_box):
            raise InputError(f"black box must be callable, got {type(black_box).__name__}")
        self.black_box = black_box
        self.calls = 0

    def clean(self, X: np.ndarray) -> np.ndarray:
        """The wrapped black box's exact outputs, float64 (B,) (or (B, m), (B, N, m) for a
        box that answers vectors: every number is treated alike)."""
        X = np.asarray(X, dtype=np.float64)
        single = X.ndim == 2
        return np.atleast_1d(np.asarray(self.black_box(X[None] if single else X), dtype=np.float64))

    def __call__(self, X: ArrayLike) -> float | np.ndarray:
        X = np.asarray(X, dtype=np.float64)
        single = X.ndim == 2
        batch = X[None] if single else X
        out = self.transform(batch, self.clean(batch))
        self.calls += 1
        if single:
            return float(out[0]) if out.ndim == 1 else out[0]
        return out

    def transform(self, X: np.ndarray, clean: np.ndarray) -> np.ndarray:
        """Post-process the clean outputs (B,); the base class answers them unchanged."""
        return clean

    @property
    def dim(self) -> int | None:
        return getattr(self.black_box, "dim", None)


def _check_tau(tau: float, name: str = "tau") -> float:
    tau = float(tau)
    if not (np.isfinite(tau) and tau >= 0.0):
        raise InputError(f"{name} must be a finite number >= 0, got {tau!r}")
    return tau


BOUNDED_PATTERNS = ("uniform", "sign", "plus", "minus", "alternating", "outward")


class BoundedNoise(OutputWrapper):
    """Additive noise |eta| <= tau in a fixed (worst-case style) pattern.

    Patterns: ``uniform`` U[-tau, tau]; ``sign`` +-tau with random signs; ``plus``
    / ``minus`` the constant +tau / -tau (a bias); ``alternating`` +tau, -tau, ...
    by query index; ``outward`` tau * sign(f(X)) (every answer inflated in magnitude).
    Random patterns are seeded and reproducible.
    """

    tolerance: float

    def __init__(self, black_box: BlackBox, tau: float, pattern: str = "uniform",
                 seed: int | None = None) -> None:
        super().__init__(black_box)
        if pattern not in BOUNDED_PATTERNS:
            raise InputError(f"pattern must be one of {BOUNDED_PATTERNS}, got {pattern!r}")
        self.tolerance = _check_tau(tau)
        self.pattern = pattern
        self.rng = np.random.default_rng(seed)
        self.sent = 0

    def transform(self, X: np.ndarray, clean: np.ndarray) -> np.ndarray:
        B, tau = clean.shape[0], self.tolerance
        eta: np.ndarray
        if self.pattern == "uniform":
            eta = self.rng.uniform(-tau, tau, size=clean.shape)
        elif self.pattern == "sign":
            eta = tau * self.rng.choice([-1.0, 1.0], size=clean.shape)
        elif self.pattern == "plus":
            eta = np.full(clean.shape, tau)
        elif self.pattern == "minus":
            eta = np.full(clean.shape, -tau)
        elif self.pattern == "alternating":
            eta = tau * (1.0 - 2.0 * ((self.sent + np.arange(B)) % 2))
            eta = eta.reshape((B,) + (1,) * (clean.ndim - 1)) * np.ones(clean.shape)
        else:  # outward
            eta = tau * np.where(clean >= 0.0, 1.0, -1.0)
        self.sent += B
        return clean + eta


class AdversarialNoise(OutputWrapper):
    """Adversarial additive noise |eta| <= tau that knows the truth and a goal.

    ``decoy``: a model the adversary impersonates; it answers the point of
    [f(X) - tau, f(X) + tau] closest to decoy(X), so a learner is pulled towards the
    decoy as far as the tolerance allows (no learner can tell the two apart once the
    decoy is within tau of f on every probe).
    ``against``: a reference predictor (e.g. the learner's current estimate); the
    adversary answers f(X) + tau * sign(f(X) - reference(X)), pushing every answer
    away from what the reference expects.
    """

    tolerance: float

    def __init__(self, black_box: BlackBox, tau: float, *, decoy: BlackBox | None = None,
                 against: BlackBox | None = None) -> None:
        super().__init__(black_box)
        if (decoy is None) == (against is None):
            raise InputError("give exactly one of decoy= (a model to impersonate) or against= "
                             "(a reference predictor to push away from)")
        for name, f in (("decoy", decoy), ("against", against)):
            if f is not None and not callable(f):
                raise InputError(f"{name} must be callable, got {type(f).__name__}")
        self.tolerance = _check_tau(tau)
        self.decoy, self.against = decoy, against

    def transform(self, X: np.ndarray, clean: np.ndarray) -> np.ndarray:
        tau = self.tolerance
        if self.decoy is not None:
            goal = np.asarray(self.decoy(X), dtype=np.float64)
            return clean + np.clip(goal - clean, -tau, tau)
        assert self.against is not None       # exactly one of decoy, against (__init__)
        expected = np.asarray(self.against(X), dtype=np.float64)
        return clean + tau * np.where(clean >= expected, 1.0, -1.0)


class GaussianNoise(OutputWrapper):
    """Additive independent N(0, std^2) noise (seeded). No bound: ``tolerance`` is None."""

    tolerance = None

    def __init__(self, black_box: BlackBox, std: float, seed: int | None = None) -> None:
        super().__init__(black_box)
        self.std = _check_tau(std, "std")
        self.rng = np.random.default_rng(seed)

    def transform(self, X: np.ndarray, clean: np.ndarray) -> np.ndarray:
        return clean + self.std * self.rng.standard_normal(clean.shape)


class RoundedOutputs(OutputWrapper):
    """Outputs rounded to float32, float16, ``digits`` significant decimal digits, or
    (``decimals=k``) k decimals after the point.

    Round to nearest: the relative error is at most half a unit in the last place,
    2^-24 (float32), 2^-11 (float16) or 0.5 * 10^(1 - digits); below the normal range
    the absolute error is at most half the smallest subnormal (``tolerance``).
    Outputs beyond the float16 range become infinite (the oracle rejects them).
    """

    def __init__(self, black_box: BlackBox, precision: str | int = "float32", *,
                 decimals: int | None = None) -> None:
        super().__init__(black_box)
        self.decimals: int | None = None
        self.precision: str | int
        if decimals is not None:         # k decimals: |error| <= 0.5 10^-k, absolute
            if not isinstance(decimals, (int, np.integer)) or not 0 <= decimals <= 300:
                raise InputError(f"decimals must be an integer in 0..300, got {decimals!r}")
            self.decimals, self.precision = int(decimals), f"{int(decimals)} decimals"
            self.tolerance, self.relative_tolerance = 0.5 * 10.0 ** -int(decimals), 0.0
        elif precision in ("float32", "float16"):
            self.precision = precision
            self.relative_tolerance = 2.0 ** -24 if precision == "float32" else 2.0 ** -11
            self.tolerance = 2.0 ** -150 if precision == "float32" else 2.0 ** -25
        else:
            try:
                digits = int(precision)
            except (TypeError, ValueError):
                raise InputError(f"precision must be 'float32', 'float16' or a number of "
                                 f"significant digits, got {precision!r}") from None
            if not 1 <= digits <= 17:
                raise InputError(f"significant digits must be in 1..17, got {digits}")
            self.precision = digits
            self.relative_tolerance = 0.5 * 10.0 ** (1 - digits)
            self.tolerance = 0.0

    def transform(self, X: np.ndarray, clean: np.ndarray) -> np.ndarray:
        if self.decimals is not None:
            return np.round(clean, self.decimals)
        if self.precision == "float32":
            return clean.astype(np.float32).astype(np.float64)
        if self.precision == "float16":
            with np.errstate(over="ignore"):
                return clean.astype(np.float16).astype(np.float64)
        with np.errstate(divide="ignore"):
            exponent = np.floor(np.log10(np.abs(np.where(clean == 0.0, 1.0, clean))))
        unit = 10.0 ** (exponent - (int(self.precision) - 1))   # significant digits
        return np.where(clean == 0.0, 0.0, np.round(clean / unit) * unit)


class SignOnly(OutputWrapper):
    """A label-only black box: 1.0 where f(X) > threshold, else 0.0."""

    tolerance = None

    def __init__(self, black_box: BlackBox, threshold: float = 0.0):
        super().__init__(black_box)
        threshold = float(threshold)
        if not np.isfinite(threshold):
            raise InputError(f"threshold must be finite, got {threshold!r}")
        self.threshold = threshold

    def transform(self, X: np.ndarray, clean: np.ndarray) -> np.ndarray:
        return (clean > self.threshold).astype(np.float64)
